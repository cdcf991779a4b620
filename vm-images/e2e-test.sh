#!/usr/bin/env bash
# End-to-end test with a real guest: a 5.10 guest (TCG, 160 MiB, 2 vCPUs) with
# tmem_ivshmem.ko, attached to a real tmemd, on an ext4 data disk.
#  1. writes files totalling several times guest RAM, reads them back twice
#     and verifies every page (vm-images/guest/pagecheck.c);
#  2. coherency: overwrite, truncate, delete + recreate (inode reuse), drop
#     caches, re-read: no stale page;
#  3. tmemd is restarted while the guest runs: the guest notices, its ops go
#     to safe no-ops, data stays correct; then the device is removed and
#     re-probed in the guest;
#  4. hot re-plug through QEMU's monitor (device_del, chardev-remove,
#     chardev-add on the new tmemd's socket, device_add): the driver probes
#     the new device and the guest uses tmem again (puts and hits on the new
#     tmemd), data still correct.
# Passes only if every guest check passed, tmemd counted puts and get hits,
# the guest's debugfs counters agree, and the kernel logged no BUG/WARNING.
#
# Usage: vm-images/e2e-test.sh --tmemd PATH [--pages N] [--files N]
#          [--mem MIB] [--smp N] [--extra "KERNEL ARGS"] [--keep]
#   --extra passes e.g. "tmem_ivshmem.get_spin_us=200" (module parameters).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

tmemd="" pages=24000 files=4 mem=160 smp=2 extra="" keep=0
# The test checks the data path: the driver must not stand aside because a
# TCG round trip costs more than its default miss estimate (--extra wins).
e2e_params="tmem_ivshmem.miss_cost_ns=0"
while (($#)); do
  case "$1" in
    --tmemd) tmemd="$2"; shift 2 ;;
    --pages) pages="$2"; shift 2 ;;
    --files) files="$2"; shift 2 ;;
    --mem) mem="$2"; shift 2 ;;
    --smp) smp="$2"; shift 2 ;;
    --extra) extra="$2"; shift 2 ;;
    --keep) keep=1; shift ;;
    *) die "unknown argument: $1" ;;
  esac
done
[[ -x "${tmemd}" ]] || die "--tmemd PATH to the tmemd binary is required"
t_start=${SECONDS}

images="$("${VM_DIR}/build-all.sh")" || die "could not build the guest images"
eval "${images}"
work="$(mktemp -d /tmp/tmem-e2e.XXXXXX)"
tmemd_pid="" qemu_pid=""
cleanup() {
  [[ -n "${qemu_pid}" ]] && kill "${qemu_pid}" 2>/dev/null
  [[ -n "${tmemd_pid}" ]] && kill "${tmemd_pid}" 2>/dev/null
  exec 7>&- 2>/dev/null
  [[ -n "${mon_pid:-}" ]] && kill "${mon_pid}" 2>/dev/null
  wait 2>/dev/null
  if ((keep)); then vmlog "kept ${work}"; else rm -rf "${work}"; fi
}
trap cleanup EXIT

start_tmemd() { # start_tmemd LOG
  "${tmemd}" --vm guest --socket-dir "${work}" --stats-interval 10 >"$1" 2>&1 &
  tmemd_pid=$!
  local i
  for ((i = 0; i < 100; i++)); do
    [[ -S "${work}/guest.sock" ]] && return 0
    sleep 0.1
  done
  cat "$1" >&2
  die "tmemd did not create ${work}/guest.sock"
}
stop_tmemd() {
  kill -TERM "${tmemd_pid}"
  wait "${tmemd_pid}"
  tmemd_pid=""
}

truncate -s 1G "${work}/disk.img"
mkfs.ext4 -q -F "${work}/disk.img" || die "mkfs.ext4 failed"
start_tmemd "${work}/tmemd1.log"
serial="${work}/serial.log"
: >"${serial}"
mkfifo "${work}/mon.in" "${work}/mon.out"
cat "${work}/mon.out" >"${work}/monitor.log" 2>/dev/null &
mon_pid=$!
exec 7<>"${work}/mon.in"
hmp() { vmlog "monitor: $*"; printf '%s\n' "$*" >&7; }
"${VM_DIR}/run-guest.sh" --socket "${work}/guest.sock" --disk "${work}/disk.img" \
  --monitor-pipe "${work}/mon" \
  --mem "${mem}" --smp "${smp}" --serial "${serial}" --timeout 600 \
  --append "tmemtest=e2e tmemtest_pages=${pages} tmemtest_files=${files} ${e2e_params} ${extra}" &
qemu_pid=$!
t_boot=${SECONDS}

restarted=0 replug=0 shown=0
while kill -0 "${qemu_pid}" 2>/dev/null; do
  sleep 1
  # Echo guest results as they come (not the kernel's boot spew).
  n=$(wc -l <"${serial}")
  if ((n > shown)); then
    sed -n "$((shown + 1)),${n}p" "${serial}" | grep -a -E 'TMEMTEST|tmem_ivshmem' |
      sed "s/^/[guest $((SECONDS - t_boot))s] /"
    shown=${n}
  fi
  if ((!restarted)) && grep -aq 'TMEMTEST WAIT_RESTART' "${serial}"; then
    vmlog "guest waits: restarting tmemd (SIGTERM, then a new tmemd on the same socket path)"
    stop_tmemd
    start_tmemd "${work}/tmemd2.log"
    restarted=1
  fi
  if ((replug == 0)) && grep -aq 'TMEMTEST WAIT_REPLUG' "${serial}"; then
    hmp "device_del tmem0"
    replug=1
  fi
  # The guest acked the unplug (ACPI): plug a device on the new tmemd.
  if ((replug == 1)) && [[ "$(grep -ac 'device removed' "${serial}")" -ge 2 ]]; then
    sleep 1
    hmp "chardev-remove tm0"
    hmp "chardev-add socket,id=tm1,path=${work}/guest.sock"
    hmp "device_add ivshmem-doorbell,chardev=tm1,vectors=1,id=tmem1"
    replug=2
  fi
done
wait "${qemu_pid}"
qemu_rc=$?
qemu_pid=""
t_guest=$((SECONDS - t_boot))
n=$(wc -l <"${serial}")
((n > shown)) && sed -n "$((shown + 1)),${n}p" "${serial}" | grep -a -E 'TMEMTEST|tmem_ivshmem'
[[ -n "${tmemd_pid}" ]] && stop_tmemd

# --- verdict -----------------------------------------------------------------
fails=0
fail() { vmlog "FAIL: $*"; fails=$((fails + 1)); }
logval() { # logval FILE EVENT KEY  (last value)
  grep -a "event=$2" "$1" | tail -n1 | grep -o " $3=[0-9]*" | cut -d= -f2
}
guestval() { # guestval PHASE KEY
  grep -a "TMEMTEST COUNTERS $1 " "${serial}" | tail -n1 | grep -o " $2=[0-9]*" | cut -d= -f2
}
((qemu_rc == 0)) || fail "qemu exited with ${qemu_rc} (124: timeout)"
grep -aq 'TMEMTEST DONE fails=0' "${serial}" || fail "guest did not finish with fails=0"
passes=$(grep -ac 'TMEMTEST CHECK .* PASS' "${serial}")
failed=$(grep -ac 'TMEMTEST CHECK .* FAIL' "${serial}")
((failed == 0)) || { grep -a 'CHECK .* FAIL' "${serial}"; fail "${failed} guest checks failed"; }
((passes >= 40)) || fail "only ${passes} guest checks passed (expected >= 40)"
if grep -aE 'BUG:|WARNING:|Oops|Call Trace|Kernel panic' "${serial}"; then
  fail "the guest kernel logged a BUG/WARNING/Oops"
fi
((restarted)) || fail "the guest never reached the tmemd restart phase"
((replug == 2)) || fail "the device was never re-plugged (replug stage ${replug})"
puts2=$(( $(logval "${work}/tmemd2.log" final_stats puts_compressed || echo 0) +
          $(logval "${work}/tmemd2.log" final_stats puts_raw || echo 0) +
          $(logval "${work}/tmemd2.log" final_stats puts_zero_same || echo 0) ))
hits2=$(logval "${work}/tmemd2.log" final_stats gets_hit)
((puts2 > 0)) || fail "after the re-plug the new tmemd stored no puts"
((${hits2:-0} > 0)) || fail "after the re-plug the new tmemd served no get hits"
puts=$(( $(logval "${work}/tmemd1.log" final_stats puts_compressed || echo 0) +
         $(logval "${work}/tmemd1.log" final_stats puts_raw || echo 0) +
         $(logval "${work}/tmemd1.log" final_stats puts_zero_same || echo 0) ))
hits=$(logval "${work}/tmemd1.log" final_stats gets_hit)
bad=$(logval "${work}/tmemd1.log" vm_stats bad_entries)
((puts > 0)) || fail "tmemd stored no puts"
((${hits:-0} > 0)) || fail "tmemd served no get hits"
[[ "${bad:-x}" == 0 ]] || fail "tmemd saw bad ring entries (${bad:-none})"
g_puts=$(guestval after-read2 puts_sent)
g_hits=$(guestval after-read2 gets_hit)
((${g_puts:-0} > 0)) || fail "guest sent no puts"
((${g_hits:-0} > 0)) || fail "guest got no hits"
verified=$(grep -a 'CHECK .* PASS ok=' "${serial}" | grep -o 'ok=[0-9]*' | cut -d= -f2 |
           paste -sd+ | bc)

vmlog "guest: ${passes} checks passed, ${failed} failed, ${verified:-0} pages verified"
vmlog "guest counters (after read 2): $(grep -a 'TMEMTEST COUNTERS after-read2' "${serial}" | cut -d' ' -f4-)"
vmlog "guest counters (final):        $(grep -a 'TMEMTEST COUNTERS final' "${serial}" | cut -d' ' -f4-)"
vmlog "tmemd (before restart): $(grep -a 'event=final_stats' "${work}/tmemd1.log" | tail -n1)"
vmlog "tmemd (after restart):  $(grep -a 'event=final_stats' "${work}/tmemd2.log" 2>/dev/null | tail -n1)"
vmlog "read passes: $(grep -a 'CHECK read[12]-' "${serial}" | grep -o 'read[12]-f[0-9]* PASS.*MBps=[0-9]*' | sed 's/ PASS.* ms=/ ms=/' | tr '\n' ';')"
vmlog "timing: guest ran ${t_guest}s, test total $((SECONDS - t_start))s"
if ((fails)); then
  vmlog "RESULT: FAIL (${fails}); serial log tail:"
  tail -n 40 "${serial}" >&2
  keep=1
  exit 1
fi
vmlog "RESULT: PASS"
