#!/usr/bin/env bash
# Real-guest benchmark (docs/real-guest.md): a TCG guest with little RAM runs the
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
#   seq-cloud       seq on a cloud volume: cache=none,aio=native throttled
#                   to 3000 IOPS and 125 MB/s (QEMU block throttling)
#   rand-cloud      rand on that cloud volume
#   control         stream read twice without tmem (the method's error)
#   control-writeback  seq-writeback's workload twice without tmem (that
#                   row's own error: its disk is the host page cache)
# Each row is one guest: its workload runs first without tmem (the driver
# not loaded, the device attached, tmemd idle), then, after the driver is
# loaded, with tmem, both from dropped caches over the same files. Two
# guests are never compared: on this shared host one QEMU process reads at
# 130-150 MB/s for its whole life and the next at 230-250 (plateaus), so a
# ratio of two processes was as noisy as 0.6-1.5 for the same row. The
# control row (full runs) is the same guest reading its stream twice
# without tmem: its ratio is the method's own error, order effects included.
#
# Usage: vm-images/bench.sh --tmemd PATH [--smoke] [--mem MIB]
#          [--rows seq,rand,stream-adaptive,stream-off,seq-writeback,seq-cloud,
#                  rand-cloud,control,control-writeback]
#          [--extra "tmem_ivshmem.PARAM=V ..."] [--keep DIR]
#          [--tmemd-args "--stats-interval 5 ..."] [--tmemd-nice N]
#          [--repeat N] [--profile] [--results PATH | --no-results]
# --repeat N: every row N times; the summary table gives each row's median
# ratio and the range.
# --profile: boot with the kernel's tick profiler and print, per row of
# the last run, the guest kernel's symbols whose share of the
# measured passes' ticks tmem changed most (vm-images/profile-report.py).
# --results PATH: record the summary's rows (median ratio per row, its
# target and verdict) in this results file (bench/results/record.py;
# section "real-guest", "real-guest-smoke" with --smoke) and regenerate the
# latest.md beside it. Default: bench/results/latest.json for full runs,
# nothing for --smoke; --no-results records nothing.
# --smoke: smaller data sets and rows seq, rand, stream-adaptive (a few
# minutes; CI). Exits non-zero if a guest saw a wrong byte (every page read
# is verified) or a run did not finish; targets are reported, not enforced
# (TCG timing on a shared machine is noise; compare ratios of one run).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

tmemd="" mem=128 smoke=0 extra="" keep="" rows="" repeat=1 profile=0
results="" results_off=0
command_line="$0 $*"
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
    --profile) profile=1; shift ;;
    --results) results="$2"; shift 2 ;;
    --no-results) results_off=1; shift ;;
    --sequential) die "--sequential: gone; a row's with and without now run in one guest, one row at a time" ;;
    -h|--help) sed -n '2,52p' "$0"; exit 0 ;;
    *) die "unknown argument: $1" ;;
  esac
done
[[ -x "${tmemd}" ]] || die "--tmemd PATH is required"
[[ "${repeat}" =~ ^[1-9][0-9]*$ ]] || die "--repeat ${repeat}: want a whole number >= 1"
if ((profile)); then
  command -v debugfs >/dev/null || die "--profile: debugfs (e2fsprogs) is needed to read the guest's profiles"
  # 16-byte buckets: 3 MB for the guest kernel's 12 MB of text.
  extra+=" profile=4"
fi
if ((smoke)); then
  : "${rows:=seq,rand,stream-adaptive}"
  seq_files=2 seq_pages=20480 rand_pages=40960 rand_reads=4000
  stream_files=2 stream_pages=24576
else
  : "${rows:=seq,rand,stream-adaptive,stream-off,seq-writeback,seq-cloud,rand-cloud,control,control-writeback}"
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

# boot NAME DISK_CACHE WORKLOAD PHASES [TMEMD ARGS...]: one guest, in its
# own directory (disk image, tmemd socket), its device attached to a tmemd
# of its own; PHASES as tmemtest_phases (vm-images/guest/init.sh).
boot() {
  local name="$1" cache="$2" workloads="$3" phases="$4" append
  local dir="${work}/${name}" tmemd_pid=""
  shift 4
  mkdir -p "${dir}"
  truncate -s 2G "${dir}/disk.img"
  mkfs.ext4 -q -F "${dir}/disk.img"
  append="tmemtest=bench tmemtest_workloads=${workloads} tmemtest_phases=${phases}"
  append+=" tmemtest_pages=${seq_pages} tmemtest_files=${seq_files} tmemtest_rand_pages=${rand_pages}"
  append+=" tmemtest_rand_reads=${rand_reads} tmemtest_stream_pages=${stream_pages}"
  append+=" tmemtest_stream_files=${stream_files} ${extra}"
  nice -n "${tmemd_nice}" "${tmemd}" "${tmemd_args[@]}" "$@" --vm guest --socket-dir "${dir}" --control-socket '' \
    >"${work}/tmemd-${name}.log" 2>&1 &
  tmemd_pid=$!
  for _ in $(seq 100); do [[ -S "${dir}/guest.sock" ]] && break; sleep 0.1; done
  [[ -S "${dir}/guest.sock" ]] || vmlog "${name}: tmemd did not start"
  local t0=${SECONDS}
  "${VM_DIR}/run-guest.sh" --socket "${dir}/guest.sock" --disk "${dir}/disk.img" --mem "${mem}" \
    --disk-cache "${cache}" --serial "${work}/serial-${name}.log" --timeout 1500 \
    --append "${append}" || true
  vmlog "${name}: guest ran $((SECONDS - t0)) s (host load $(cut -d' ' -f1-3 /proc/loadavg))"
  kill -TERM "${tmemd_pid}"
  wait "${tmemd_pid}"
  if ((profile)); then
    local ph wl
    for ph in ${phases//,/ }; do
      for wl in ${workloads//,/ }; do
        debugfs -R "dump /prof-${ph}-${wl} ${work}/prof-${name}-${ph}-${wl}" "${dir}/disk.img" >/dev/null 2>&1
      done
    done
  fi
  rm -rf "${dir}"
  finished "${name}"
}
finished() {
  grep -aq 'TMEMTEST DONE fails=0' "${work}/serial-$1.log" 2>/dev/null && return 0
  vmlog "$1: the guest did not finish cleanly:"
  grep -a 'TMEMTEST .*FAIL\|TMEMTEST DONE' "${work}/serial-$1.log" 2>/dev/null | head -n 5 >&2
  failed=1
}

# measured NAME PHASE-WORKLOAD: the CHECK lines of the measured passes
# (2-3; stream: its one).
measured() {
  local passes='pass[23]-'
  [[ "$2" == *stream ]] && passes='pass1-'
  grep -a "CHECK bench-$2-${passes}" "${work}/serial-$1.log" | grep ' PASS '
}
# rate NAME PHASE-WORKLOAD: MB/s of the measured passes.
rate() {
  measured "$1" "$2" |
    awk '{for (i = 1; i <= NF; i++) { split($i, kv, "="); if (kv[1] == "ok") p += kv[2]; if (kv[1] == "ms") m += kv[2] } }
         END { if (m > 0) printf "%.1f", p * 4096 / 1e6 / (m / 1000); else print "0" }'
}
# file_rates NAME PHASE-WORKLOAD: MB/s of each file read in the measured passes,
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
# row LABEL BOOT WORKLOAD TARGET [ON_PHASE OFF_PHASE]: ON_PHASE's rate
# over OFF_PHASE's (with / without), the guest's counters of ON_PHASE.
row() {
  local label="$1" boot="$2" wl="$3" target="$4" on_ph="${5:-with}" off_ph="${6:-without}"
  local on_boot="${boot}" from to
  from="bench-${on_ph}-${wl}-warm" to="bench-${on_ph}-${wl}-end"
  [[ "${wl}" == stream ]] && from="bench-${on_ph}-${wl}-start"
  local on off puts gets hits local_miss put_ns get_ns sent rts rt_ns
  on=$(rate "${boot}" "${on_ph}-${wl}") off=$(rate "${boot}" "${off_ph}-${wl}")
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
  files_with["${label}"]+=" $(file_rates "${boot}" "${on_ph}-${wl}" | tr '\n' ' ')"
  files_without["${label}"]+=" $(file_rates "${boot}" "${off_ph}-${wl}" | tr '\n' ' ')"
  targets["${label}"]="${target}"
  [[ " ${labels[*]} " == *" ${label} "* ]] || labels+=("${label}")
}
# median of the numbers given (a "-" counts as 0: a run that measured nothing)
median() {
  printf '%s\n' "$@" | sed 's/^-$/0/' | sort -g |
    awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else printf "%.2f", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

# One guest per row, one at a time: a TCG guest keeps one of this
# machine's two CPUs busy, tmemd and QEMU's own threads have the other.
for rep in $(seq "${repeat}"); do
  work="${base}/run${rep}"
  mkdir -p "${work}"
  ((repeat > 1)) && vmlog "run ${rep} of ${repeat}"
  # seq and rand in guests of their own: one guest's stand-aside state is
  # one for all it reads, so a sequential scan it stood aside for would
  # leave a random reader after it on the probe share.
  has_row seq && boot seq none seq without,with
  has_row rand && boot rand none rand without,with
  has_row stream-adaptive && boot stream-adaptive none stream without,with --memory-cap 8MiB --mode adaptive
  has_row stream-off && boot stream-off none stream without,with --memory-cap 8MiB --mode off
  has_row seq-writeback && boot wb writeback seq without,with
  has_row seq-cloud && boot seqcloud cloud seq without,with
  has_row rand-cloud && boot randcloud cloud rand without,with
  has_row control && boot control none stream without,without2 --memory-cap 8MiB --mode off
  has_row control-writeback && boot wbcontrol writeback seq without,without2
  grep -a 'CHECK .* FAIL' "${work}"/serial-*.log && { vmlog "a guest saw a wrong page or failed a step"; failed=1; }

  has_row seq && row "seq re-read, cache=none" seq seq ">= 1.0"
  has_row rand && row "random 4 KiB re-read, cache=none" rand rand ">= 2.0"
  has_row stream-adaptive && row "stream once, cap 8 MiB, adaptive" stream-adaptive stream ">= 0.97"
  has_row stream-off && row "stream once, cap 8 MiB, mode off" stream-off stream ">= 0.99"
  has_row seq-writeback && row "seq re-read, cache=writeback" wb seq ">= 0.95"
  # A disk slower than the TCG guest's own copies: tmem must pay here.
  has_row seq-cloud && row "seq re-read, cloud volume (3000 IOPS, 125 MB/s)" seqcloud seq "> 1.0"
  has_row rand-cloud && row "random 4 KiB re-read, cloud volume (3000 IOPS, 125 MB/s)" randcloud rand ">= 2.0"
  # The method's own error: the second of two passes without tmem over the
  # first (the with row's order).
  has_row control && row "control: stream twice without tmem, 2nd / 1st" control stream "0.97-1.03" without2 without
  has_row control-writeback && row "control: seq twice without tmem, cache=writeback, 2nd / 1st" wbcontrol seq "0.97-1.03" without2 without
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
    med="$(median "$@")"
    echo "| ${label} | ${med} | $(head -n1 <<<"${sorted}") | $(tail -n1 <<<"${sorted}") | ${targets[${label}]} |"
    # The results file's row: the same median (not measured when no run
    # measured anything), its target, every run's ratio.
    [[ " $* " == *[0-9]* ]] || med="-"
    printf '%s\t%s\tx\t%s\t%s\n' "${label}" "${med}" "${targets[${label}]}" \
      "median of ${repeat} run(s): $*; lowest $(head -n1 <<<"${sorted}"), highest $(tail -n1 <<<"${sorted}")" \
      >>"${base}/results.tsv"
  done
  echo
  # The same rows from the files: the median of every file's MB/s (the
  # stream's first file, read into free memory, left out) over every run,
  # with tmem and without; one slow file moves a pass's total, not this.
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
if [[ -z "${results}" ]] && ((!smoke)); then
  results="$(cd "${VM_DIR}/.." && pwd)/bench/results/latest.json"
fi
if [[ -n "${results}" ]] && ((!results_off)) && [[ -f "${base}/results.tsv" ]]; then
  section=real-guest
  ((smoke)) && section=real-guest-smoke
  warning=()
  ((failed)) && warning=(--warning "a guest saw a wrong page or did not finish")
  TMEM_COMMIT="${TMEM_COMMIT:-$(git -C "${VM_DIR}" describe --always --dirty 2>/dev/null || echo unknown)}" \
    python3 "${VM_DIR}/../bench/results/record.py" --results "${results}" \
      --benchmark "${section}" --command "${command_line}" \
      --rows "${base}/results.tsv" "${warning[@]}" &&
    python3 "${VM_DIR}/../bench/results/render.py" --in "${results}" \
      --out "${results%.json}.md" || failed=1
fi
if ((profile)); then
  system_map="$(dirname "${KERNEL}")/linux/System.map"
  for p in "${work}"/prof-*-with-*; do
    [[ -f "${p}" ]] || continue
    off="${p/-with-/-without-}"
    [[ -f "${off}" ]] || continue
    vmlog "guest kernel profile, ${p##*/prof-} against ${off##*/prof-} (last run):"
    python3 "${VM_DIR}/profile-report.py" "${system_map}" "${p}" "${off}" >&2
  done
fi
for b in seq rand stream-adaptive stream-off wb; do
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
