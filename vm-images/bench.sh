#!/usr/bin/env bash
# Real-guest re-read benchmark: a TCG guest with little RAM re-reads a
# working set larger than its RAM (3 passes over tmemtest_files files of
# tmemtest_pages pages), once with tmem_ivshmem attached to tmemd and once
# without tmem (no device, module not loaded). Prints MB/s of passes 2-3 and
# the ratio. TCG makes absolute numbers small; compare ratios only.
#
# Usage: vm-images/bench.sh --tmemd PATH [--mem MIB] [--pages N] [--files N]
#          [--extra "tmem_ivshmem.PARAM=V ..."] [--tmemd-config FILE]
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

tmemd="" mem=128 pages=24576 files=2 extra="" tconf=()
while (($#)); do
  case "$1" in
    --tmemd) tmemd="$2"; shift 2 ;;
    --mem) mem="$2"; shift 2 ;;
    --pages) pages="$2"; shift 2 ;;
    --files) files="$2"; shift 2 ;;
    --extra) extra="$2"; shift 2 ;;
    --tmemd-config) tconf=(--config "$2"); shift 2 ;;
    *) die "unknown argument: $1" ;;
  esac
done
[[ -x "${tmemd}" ]] || die "--tmemd PATH is required"
images="$("${VM_DIR}/build-all.sh")" || die "could not build the guest images"
eval "${images}"
work="$(mktemp -d /tmp/tmem-bench.XXXXXX)"
tmemd_pid=""
trap '[[ -n "${tmemd_pid}" ]] && kill "${tmemd_pid}" 2>/dev/null; wait 2>/dev/null; rm -rf "${work}"' EXIT

run() { # run NAME with_tmem
  local name="$1" with="$2" sockarg=() append
  truncate -s 1G "${work}/disk.img"
  mkfs.ext4 -q -F "${work}/disk.img"
  append="tmemtest=bench tmemtest_pages=${pages} tmemtest_files=${files} ${extra}"
  if ((with)); then
    "${tmemd}" "${tconf[@]}" --vm guest --socket-dir "${work}" >"${work}/tmemd-${name}.log" 2>&1 &
    tmemd_pid=$!
    for _ in $(seq 100); do [[ -S "${work}/guest.sock" ]] && break; sleep 0.1; done
    sockarg=(--socket "${work}/guest.sock")
  else
    append+=" tmemtest_module=0"
  fi
  local t0=${SECONDS}
  "${VM_DIR}/run-guest.sh" "${sockarg[@]}" --disk "${work}/disk.img" --mem "${mem}" \
    --serial "${work}/serial-${name}.log" --timeout 900 --append "${append}" || true
  vmlog "${name}: guest ran $((SECONDS - t0)) s"
  if [[ -n "${tmemd_pid}" ]]; then kill -TERM "${tmemd_pid}"; wait "${tmemd_pid}"; tmemd_pid=""; fi
  rm -f "${work}/disk.img"
}
# MB/s of passes 2 and 3: total pages read / total ms.
rate() {
  grep -a 'CHECK bench-pass[23]-' "${work}/serial-$1.log" | grep ' PASS ' |
    awk '{for (i = 1; i <= NF; i++) { split($i, kv, "="); if (kv[1] == "ok") p += kv[2]; if (kv[1] == "ms") m += kv[2] } }
         END { if (m > 0) printf "%.1f", p * 4096 / 1e6 / (m / 1000); else print "0" }'
}
run with-tmem 1
run without-tmem 0
on=$(rate with-tmem)
off=$(rate without-tmem)
grep -a 'CHECK .* FAIL' "${work}"/serial-*.log && die "a bench pass failed verification"
vmlog "working set: ${files} x ${pages} pages = $((files * pages * 4 / 1024)) MiB, guest RAM ${mem} MiB"
vmlog "re-read (passes 2-3): with tmem ${on} MB/s, without ${off} MB/s, ratio $(echo "scale=2; ${on} / ${off}" | bc)"
ctrs="$(grep -a 'COUNTERS bench-pass3' "${work}/serial-with-tmem.log" | cut -d' ' -f4-)"
val() { grep -o "\b$1=[0-9]*" <<<"${ctrs}" | cut -d= -f2; }
puts=$(val cc_puts) gets=$(( $(val cc_succ_gets) + $(val cc_failed_gets) ))
vmlog "guest time per op (wall, TCG): put $(( $(val put_ns) / (puts > 0 ? puts : 1) )) ns over ${puts} puts; get $(( $(val get_ns) / (gets > 0 ? gets : 1) )) ns over ${gets} gets ($(val gets_hit) hits, $(val gets_skipped_never_sent) answered locally)"
vmlog "guest counters with tmem: ${ctrs}"
vmlog "tmemd: $(grep -a 'event=final_stats' "${work}/tmemd-with-tmem.log" | tail -n1)"
