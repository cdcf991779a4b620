#!/usr/bin/env bash
# Real-guest benchmark (issue 13): a TCG guest with little RAM runs the
# workloads a user runs, once with tmem_ivshmem attached to tmemd and once
# without tmem (no device, module not loaded), in one run, and prints per
# row MB/s with and without, the ratio, and the guest's time per get and per
# put (from tmem_ivshmem's debugfs counters). TCG makes absolute numbers
# small; the ratios are what count.
#
# Rows (guest disk cache=none,aio=native unless said otherwise):
#   seq             sequential re-read of files larger than guest RAM
#                   (MB/s of passes 2-3)
#   rand            random 4 KiB reads (no readahead) over a file larger
#                   than guest RAM (MB/s of passes 2-3)
#   stream-adaptive a streaming read, never re-read, tmemd's cap far below
#                   the data set (8 MiB), valve mode adaptive
#   stream-off      the same with the host's valve mode off
#   seq-writeback   seq with cache=writeback (host page cache under the disk)
# Each row's guest with tmem runs at the same time as its guest without
# (same host load for both; tmemd's CPU is part of what tmem costs).
#
# Usage: vm-images/bench.sh --tmemd PATH [--smoke] [--mem MIB]
#          [--rows seq,rand,stream-adaptive,stream-off,seq-writeback]
#          [--extra "tmem_ivshmem.PARAM=V ..."] [--keep DIR]
#          [--tmemd-args "--stats-interval 5 ..."] [--tmemd-nice N]
#          [--repeat N] [--sequential]
# --repeat N: every pair N times; the summary table gives each row's median
# ratio and the range (a pair's two guests share the host's noise, but
# runs on a shared 2-core machine still differ from run to run).
# --sequential: a pair's two guests run one after the other (the order
# alternating between repeats) instead of at once. Two TCG guests at once
# fill this 2-core machine, so tmemd (and QEMU's own threads) take their
# CPU from the guest being measured, which a host with a spare core would
# not; one at a time, each guest has the machine and tmemd a core.
# --smoke: smaller data sets and rows seq, rand, stream-adaptive (a few
# minutes; CI). Exits non-zero if a guest saw a wrong byte (every page read
# is verified) or a run did not finish; targets are reported, not enforced
# (TCG timing on a shared machine is noise; compare ratios of one run).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

tmemd="" mem=128 smoke=0 extra="" keep="" rows="" repeat=1 sequential=0
tmemd_args=(--stats-interval 2)  # per-VM stats while the guest is attached
# tmemd runs at the priority its systemd unit gives it (Nice= in
# host-agent/tmemd.service): its data plane is latency-bound like a vhost
# backend, and its CPU is bounded by the valve's budget, not by the scheduler.
tmemd_nice="$(sed -n 's/^Nice=//p' "$(dirname "${BASH_SOURCE[0]}")/../host-agent/tmemd.service")"
tmemd_nice="${tmemd_nice:-0}"
while (($#)); do
  case "$1" in
    --tmemd) tmemd="$2"; shift 2 ;;
    --mem) mem="$2"; shift 2 ;;
    --smoke) smoke=1; shift ;;
    --rows) rows="$2"; shift 2 ;;
    --extra) extra="$2"; shift 2 ;;
    --keep) keep="$2"; shift 2 ;;
    --tmemd-args) read -r -a more <<<"$2"; tmemd_args+=("${more[@]}"); shift 2 ;;
    --tmemd-nice) tmemd_nice="$2"; shift 2 ;;
    --repeat) repeat="$2"; shift 2 ;;
    --sequential) sequential=1; shift ;;
    -h|--help) sed -n '2,37p' "$0"; exit 0 ;;
    *) die "unknown argument: $1" ;;
  esac
done
[[ -x "${tmemd}" ]] || die "--tmemd PATH is required"
[[ "${repeat}" =~ ^[1-9][0-9]*$ ]] || die "--repeat ${repeat}: want a whole number >= 1"
if ((smoke)); then
  : "${rows:=seq,rand,stream-adaptive}"
  seq_files=2 seq_pages=20480 rand_pages=40960 rand_reads=4000
  stream_files=2 stream_pages=24576
else
  : "${rows:=seq,rand,stream-adaptive,stream-off,seq-writeback}"
  seq_files=2 seq_pages=24576 rand_pages=49152 rand_reads=16000
  # 6 x 128 MiB, six times the guest's RAM: one pass of 3 files (~1.7 s
  # at the disk's speed under TCG) was shorter than this machine's noise.
  stream_files=6 stream_pages=32768
fi
has_row() { [[ ",${rows}," == *",$1,"* ]]; }
images="$("${VM_DIR}/build-all.sh")" || die "could not build the guest images"
eval "${images}"
# Disk images must be on a filesystem that takes O_DIRECT (not tmpfs).
base="$(mktemp -d "${TMPDIR:-/var/tmp}/tmem-bench.XXXXXX")"
work="${base}/run1"
cleanup() {
  local pids
  pids="$(jobs -p)"
  [[ -n "${pids}" ]] && kill ${pids} 2>/dev/null
  wait 2>/dev/null
  if [[ -n "${keep}" ]]; then
    local d
    for d in "${base}"/run*; do
      mkdir -p "${keep}/${d##*/}" && cp "${d}"/*.log "${keep}/${d##*/}/" 2>/dev/null
    done
  fi
  rm -rf "${base}"
}
trap cleanup EXIT
failed=0

# boot NAME WITH_TMEM DISK_CACHE WORKLOADS [TMEMD ARGS...]: one guest, in
# its own directory (disk image, tmemd socket). Run two at once (with and
# without tmem, see `pair`), so both see the same load on a shared host, or
# one after the other (--sequential).
boot() {
  local name="$1" with="$2" cache="$3" workloads="$4" sockarg=() append
  local dir="${work}/${name}" tmemd_pid=""
  shift 4
  mkdir -p "${dir}"
  truncate -s 2G "${dir}/disk.img"
  mkfs.ext4 -q -F "${dir}/disk.img"
  append="tmemtest=bench tmemtest_workloads=${workloads} tmemtest_pages=${seq_pages}"
  append+=" tmemtest_files=${seq_files} tmemtest_rand_pages=${rand_pages}"
  append+=" tmemtest_rand_reads=${rand_reads} tmemtest_stream_pages=${stream_pages}"
  append+=" tmemtest_stream_files=${stream_files} ${extra}"
  if ((with)); then
    nice -n "${tmemd_nice}" "${tmemd}" "${tmemd_args[@]}" "$@" --vm guest --socket-dir "${dir}" --control-socket '' \
      >"${work}/tmemd-${name}.log" 2>&1 &
    tmemd_pid=$!
    for _ in $(seq 100); do [[ -S "${dir}/guest.sock" ]] && break; sleep 0.1; done
    [[ -S "${dir}/guest.sock" ]] || vmlog "${name}: tmemd did not start"
    sockarg=(--socket "${dir}/guest.sock")
  else
    append+=" tmemtest_module=0"
  fi
  local t0=${SECONDS}
  "${VM_DIR}/run-guest.sh" "${sockarg[@]}" --disk "${dir}/disk.img" --mem "${mem}" \
    --disk-cache "${cache}" --serial "${work}/serial-${name}.log" --timeout 1500 \
    --append "${append}" || true
  vmlog "${name}: guest ran $((SECONDS - t0)) s (host load $(cut -d' ' -f1-3 /proc/loadavg))"
  if [[ -n "${tmemd_pid}" ]]; then kill -TERM "${tmemd_pid}"; wait "${tmemd_pid}"; fi
  rm -rf "${dir}"
}
# pair BOOT_A_ARGS... -- BOOT_B_ARGS...: both boots at once.
pair() {
  local a=() b=()
  while [[ "$1" != -- ]]; do a+=("$1"); shift; done
  shift
  b=("$@")
  if ((sequential)); then
    if ((rep % 2)); then boot "${a[@]}"; boot "${b[@]}"; else boot "${b[@]}"; boot "${a[@]}"; fi
    return
  fi
  boot "${a[@]}" &
  local pa=$!
  boot "${b[@]}" &
  wait "${pa}" $!
}
finished() {
  grep -aq 'TMEMTEST DONE fails=0' "${work}/serial-$1.log" 2>/dev/null && return 0
  vmlog "$1: the guest did not finish cleanly:"
  grep -a 'TMEMTEST .*FAIL\|TMEMTEST DONE' "${work}/serial-$1.log" 2>/dev/null | head -n 5 >&2
  failed=1
}

# measured NAME WORKLOAD: the CHECK lines of the measured passes (2-3;
# stream: its one).
measured() {
  local passes='pass[23]-'
  [[ "$2" == stream ]] && passes='pass1-'
  grep -a "CHECK bench-$2-${passes}" "${work}/serial-$1.log" | grep ' PASS '
}
# rate NAME WORKLOAD: MB/s of the measured passes.
rate() {
  measured "$1" "$2" |
    awk '{for (i = 1; i <= NF; i++) { split($i, kv, "="); if (kv[1] == "ok") p += kv[2]; if (kv[1] == "ms") m += kv[2] } }
         END { if (m > 0) printf "%.1f", p * 4096 / 1e6 / (m / 1000); else print "0" }'
}
# file_rates NAME WORKLOAD: MB/s of each file read in the measured passes,
# one per line (stream: files 2.. of its one pass; the first file is read
# into free memory, with no page evicted and so nothing put).
file_rates() {
  measured "$1" "$2" | grep -v 'pass1-s1 ' |
    awk '{ ok = 0; ms = 0; for (i = 1; i <= NF; i++) { split($i, kv, "="); if (kv[1] == "ok") ok = kv[2]; if (kv[1] == "ms") ms = kv[2] }
           if (ms > 0) printf "%.1f\n", ok * 4096 / 1e6 / (ms / 1000) }'
}
# counter NAME PHASE FIELD: a debugfs counter at a COUNTERS line.
counter() {
  grep -a "COUNTERS $2 " "${work}/serial-$1.log" | tail -n1 | grep -o "\b$3=[0-9]*" | cut -d= -f2
}
# delta NAME FROM TO FIELD
delta() {
  local a b
  a=$(counter "$1" "$2" "$4") b=$(counter "$1" "$3" "$4")
  echo $(( ${b:-0} - ${a:-0} ))
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }'; }
per() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.1f", a / b / 1000; else print "-" }'; }

table=() labels=()
declare -A ratios targets files_with files_without
# row LABEL WORKLOAD WITH_BOOT WITHOUT_BOOT TARGET
row() {
  local label="$1" wl="$2" on_boot="$3" off_boot="$4" target="$5" from to
  from="bench-${wl}-warm" to="bench-${wl}-end"
  [[ "${wl}" == stream ]] && from="bench-${wl}-start"
  local on off puts gets hits local_miss put_ns get_ns sent rts rt_ns
  on=$(rate "${on_boot}" "${wl}") off=$(rate "${off_boot}" "${wl}")
  rts=$(delta "${on_boot}" "${from}" "${to}" round_trips)
  rt_ns=$(delta "${on_boot}" "${from}" "${to}" round_trip_wait_ns)
  puts=$(delta "${on_boot}" "${from}" "${to}" puts_sent)
  hits=$(delta "${on_boot}" "${from}" "${to}" gets_hit)
  gets=$(( $(delta "${on_boot}" "${from}" "${to}" gets_hit) + $(delta "${on_boot}" "${from}" "${to}" gets_miss) ))
  local_miss=$(delta "${on_boot}" "${from}" "${to}" gets_miss_local)
  put_ns=$(delta "${on_boot}" "${from}" "${to}" put_ns)
  get_ns=$(delta "${on_boot}" "${from}" "${to}" get_ns)
  sent=$((gets - local_miss))
  local r
  r=$(ratio "${on}" "${off}")
  table+=("| ${label} | ${rep} | ${on} | ${off} | ${r} | ${target} | ${hits} / ${sent} / ${gets} | $(per "${get_ns}" "${sent}") | $(awk -v a="${get_ns}" -v b="${gets}" 'BEGIN { if (b > 0) printf "%.2f", a / b / 1000; else print "-" }') | ${rts} | $(per "${rt_ns}" "${rts}") | ${puts} | $(per "${put_ns}" "${puts}") |")
  ratios["${label}"]+=" ${r}"
  files_with["${label}"]+=" $(file_rates "${on_boot}" "${wl}" | tr '\n' ' ')"
  files_without["${label}"]+=" $(file_rates "${off_boot}" "${wl}" | tr '\n' ' ')"
  targets["${label}"]="${target}"
  [[ " ${labels[*]} " == *" ${label} "* ]] || labels+=("${label}")
}
# median of the numbers given (a "-" counts as 0: a run that measured nothing)
median() {
  printf '%s\n' "$@" | sed 's/^-$/0/' | sort -g |
    awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else printf "%.2f", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

# Boots: each row's with-tmem guest runs at the same time as its
# without-tmem guest.
for rep in $(seq "${repeat}"); do
  work="${base}/run${rep}"
  mkdir -p "${work}"
  ((repeat > 1)) && vmlog "run ${rep} of ${repeat}"
  # seq and rand in guests of their own: one guest's stand-aside state is
  # one for all it reads, so a sequential scan it stood aside for would
  # leave a random reader after it on the probe share.
  if has_row seq; then
    pair seq-with 1 none seq -- seq-without 0 none seq
    finished seq-with; finished seq-without
  fi
  if has_row rand; then
    pair rand-with 1 none rand -- rand-without 0 none rand
    finished rand-with; finished rand-without
  fi
  if has_row stream-adaptive; then
    pair stream-adaptive 1 none stream --memory-cap 8MiB --mode adaptive \
      -- stream-without 0 none stream
    finished stream-adaptive; finished stream-without
  fi
  if has_row stream-off; then
    pair stream-off 1 none stream --memory-cap 8MiB --mode off \
      -- stream-without2 0 none stream
    finished stream-off; finished stream-without2
  fi
  if has_row seq-writeback; then
    pair wb-with 1 writeback seq -- wb-without 0 writeback seq
    finished wb-with; finished wb-without
  fi
  grep -a 'CHECK .* FAIL' "${work}"/serial-*.log && { vmlog "a guest saw a wrong page or failed a step"; failed=1; }

  has_row seq && row "seq re-read, cache=none" seq seq-with seq-without ">= 1.0"
  has_row rand && row "random 4 KiB re-read, cache=none" rand rand-with rand-without ">= 2.0"
  has_row stream-adaptive && row "stream once, cap 8 MiB, adaptive" stream stream-adaptive stream-without ">= 0.97"
  has_row stream-off && row "stream once, cap 8 MiB, mode off" stream stream-off stream-without2 ">= 0.99"
  has_row seq-writeback && row "seq re-read, cache=writeback" seq wb-with wb-without ">= 0.95"

done
vmlog "guest ${mem} MiB, 1 vCPU (TCG); seq ${seq_files} x ${seq_pages} pages, rand ${rand_pages} pages x ${rand_reads} reads/pass, stream ${stream_files} x ${stream_pages} pages"
{
  echo
  echo "| row | run | with tmem MB/s | without MB/s | ratio | target | get hits / sent / all | guest us per get sent | guest us per page-cache miss | round trips | guest us waiting per round trip | puts sent | guest us per put |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
  printf '%s\n' "${table[@]}"
  echo
  echo "| row | median ratio (${repeat} runs) | lowest | highest | target |"
  echo "| --- | --- | --- | --- | --- |"
  for label in "${labels[@]}"; do
    # shellcheck disable=SC2086
    set -- ${ratios[${label}]}
    sorted="$(printf '%s\n' "$@" | sed 's/^-$/0/' | sort -g)"
    echo "| ${label} | $(median "$@") | $(head -n1 <<<"${sorted}") | $(tail -n1 <<<"${sorted}") | ${targets[${label}]} |"
  done
  echo
  # The same rows from the files: on this machine a guest's speed moves in
  # plateaus (a guest without tmem read at 130-150 MB/s for a whole run and
  # at 230-250 in the next), so a pair's ratio is as noisy as its two
  # guests. The median over every file of every run, with tmem and without,
  # is steadier.
  echo "| row | files with / without | median file MB/s with tmem | without | ratio of medians | target |"
  echo "| --- | --- | --- | --- | --- | --- |"
  for label in "${labels[@]}"; do
    # shellcheck disable=SC2086
    set -- ${files_with[${label}]}
    n_with=$#
    mwith="$( (($#)) && median "$@" || echo 0)"
    # shellcheck disable=SC2086
    set -- ${files_without[${label}]}
    mwithout="$( (($#)) && median "$@" || echo 0)"
    echo "| ${label} | ${n_with} / $# | ${mwith} | ${mwithout} | $(ratio "${mwith}" "${mwithout}") | ${targets[${label}]} |"
  done
  echo
} >&2
for b in seq-with rand-with stream-adaptive stream-off wb-with; do
  [[ -f "${work}/tmemd-${b}.log" ]] || continue
  # The last report while the guest was attached (a detach zeroes the
  # guest's own fields), else the last one.
  stats="$(grep -a 'event=vm_stats' "${work}/tmemd-${b}.log" | grep -v 'guest_ram_pages=0 ' | tail -n1)"
  [[ -n "${stats}" ]] || stats="$(grep -a 'event=vm_stats' "${work}/tmemd-${b}.log" | tail -n1)"
  # Host CPU per ring entry: of a round trip, what tmemd itself spends.
  host_us="$(tr ' ' '\n' <<<"${stats}" | awk -F= '$1 == "valve_cpu_ns" { c = $2 } $1 == "sqe_processed" { n = $2 }
    END { if (n > 0) printf "%.1f", c / n / 1000; else print "-" }')"
  vmlog "tmemd ${b} (last run): host_us_per_entry=${host_us} $(tr ' ' '\n' <<<"${stats}" |
    grep -E '^(gets_hit|gets_miss|admission|reuse|valve_compressed|valve_raw|valve_dropped_[a-z]+|valve_ghost_hits(_far)?|valve_throttle_events|doorbells|poll_rounds|interrupts|get_batches|guest_[a-z_]+)=' | tr '\n' ' ')"
done
exit "${failed}"
