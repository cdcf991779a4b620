#!/usr/bin/env bash
# tmemctl attach --swap against a real libvirtd (qemu:///system, QEMU TCG as
# libvirt-qemu) and a real tmemd (--libvirt-uri):
#  - a bad SIZE is refused by tmemctl, naming --swap and the text;
#  - attach --swap 64M of a shut-off persistent domain: tmemd's swap socket
#    listens, libvirt's inactive XML has the vhostuser disk on it and
#    shared memfd memory, the answer says when it takes effect; a second
#    attach adds nothing;
#  - the domain starts (libvirt accepted the definition, QEMU as
#    libvirt-qemu connected to the swap socket in tmemd's group) and the
#    migrate hook refuses its live XML;
#  - attach --swap of a running domain says a reboot inside the guest is
#    not enough (next cold boot);
#  - a domain backed by private hugepages is refused, naming <hugepages/>,
#    and gets no swap socket;
#  - detach --swap of the running domain: the disk leaves the definition,
#    the memoryBacking stays, the device stays while QEMU uses it; after
#    destroy, detach --swap removes the socket.
# Exit 77 (skipped, with the reason) only when libvirtd cannot run here.
#
# Usage: libvirt_swap_test.sh TMEMD TMEMCTL SOURCE_DIR
set -uo pipefail
tmemd="$1" tmemctl="$2" src="$3"

log() { printf '[swap-test %s] %s\n' "$(date +%T)" "$*"; }
fail() {
  log "FAIL: $*"
  [[ -s "${work:-}/tmemd.log" ]] && { log "tmemd's log:"; tail -40 "${work}/tmemd.log"; }
  exit 1
}

if ! "${src}/scripts/start-libvirtd.sh"; then
  log "SKIP: libvirtd cannot run here (scripts/start-libvirtd.sh failed)"
  exit 77
fi
[[ -x /usr/bin/qemu-system-x86_64 ]] || { log "SKIP: no qemu-system-x86_64"; exit 77; }
getent group libvirt-qemu >/dev/null || { log "SKIP: no libvirt-qemu group"; exit 77; }

virsh=(virsh -c qemu:///system)
work="$(mktemp -d /tmp/tmemd-swap.XXXXXX)"
chmod 0711 "${work}"  # QEMU (libvirt-qemu) walks to the socket directory
sock="${work}/sock"
mkdir -m 0750 "${sock}"
chgrp libvirt-qemu "${sock}"
control="${work}/control.sock"
name="tmemd-test-swap-$$"
tmemd_pid=""
ctl() { "${tmemctl}" -s "${control}" "$@"; }

cleanup() {
  for d in "${name}" "${name}-run" "${name}-huge"; do
    "${virsh[@]}" destroy "${d}" >/dev/null 2>&1
    "${virsh[@]}" undefine "${d}" >/dev/null 2>&1
  done
  [[ -n "${tmemd_pid}" ]] && kill "${tmemd_pid}" 2>/dev/null && wait "${tmemd_pid}" 2>/dev/null
  rm -rf "${work}"
}
trap cleanup EXIT

"${tmemd}" --socket-dir "${sock}" --control-socket "${control}" \
  --state-dir "${work}/state" \
  --libvirt-uri qemu:///system >>"${work}/tmemd.log" 2>&1 &
tmemd_pid=$!
for _ in $(seq 100); do
  [[ -S "${control}" ]] && ctl status >/dev/null 2>&1 && break
  sleep 0.1
done
ctl status >/dev/null 2>&1 || fail "tmemd did not start"

# $1 name, $2 extra top-level elements (e.g. a <memoryBacking>)
define() {
  cat >"${work}/$1.xml" <<EOF
<domain type='qemu'><name>$1</name><memory unit='MiB'>64</memory><vcpu>1</vcpu>$2
<os><type arch='x86_64' machine='pc'>hvm</type></os><features><acpi/></features>
<on_poweroff>destroy</on_poweroff>
<devices><emulator>/usr/bin/qemu-system-x86_64</emulator><memballoon model='none'/></devices>
</domain>
EOF
  "${virsh[@]}" define "${work}/$1.xml" >/dev/null || fail "virsh define $1 failed"
}
# QEMU (pid $1) holds a UNIX stream whose peer is one of tmemd's sockets
# (tmemd serves nothing else here: this run's domains have no tmem device).
qemu_connected() {
  ss -xpn 2>/dev/null | awk -v t="pid=${tmemd_pid}," -v q="pid=$1," '
    $2 == "ESTAB" && index($0, t) { tmemd[$6] = 1 }
    $2 == "ESTAB" && index($0, q) { peer[$8] = 1 }
    END { for (i in peer) if (i in tmemd) found = 1; exit !found }'
}

define "${name}" ""
swap_sock="${sock}/${name}.swap.sock"

log "1. a bad SIZE is refused by tmemctl, naming --swap"
for bad in 12banana 0 -5M; do
  if ctl attach --swap "${bad}" "${name}" >"${work}/bad.out" 2>&1; then
    fail "attach --swap '${bad}' was accepted"
  fi
  grep -q -- "--swap" "${work}/bad.out" ||
    { cat "${work}/bad.out"; fail "the refusal of '${bad}' does not name --swap"; }
done
[[ -e "${swap_sock}" ]] && fail "a refused attach made a swap socket"
log "   refused: $(head -1 "${work}/bad.out")"

log "2. attach --swap 64M of the shut-off domain"
ctl attach --swap 64M "${name}" >"${work}/attach.out" 2>&1 ||
  { cat "${work}/attach.out"; fail "attach --swap 64M failed"; }
cat "${work}/attach.out"
grep -q "takes effect when the domain next starts" "${work}/attach.out" ||
  fail "the answer does not say when the swap device takes effect"
[[ -S "${swap_sock}" ]] || fail "no swap socket ${swap_sock}"
"${virsh[@]}" dumpxml --inactive "${name}" >"${work}/inactive.xml"
grep -q "<disk type='vhostuser' device='disk'" "${work}/inactive.xml" &&
  grep -q "path='${swap_sock}'" "${work}/inactive.xml" &&
  grep -q "<source type='memfd'/>" "${work}/inactive.xml" &&
  grep -q "<access mode='shared'/>" "${work}/inactive.xml" ||
  { cat "${work}/inactive.xml"; fail "the persistent definition lacks the disk or the shared memfd memory"; }
ctl attach --swap 64M "${name}" >"${work}/again.out" 2>&1 ||
  { cat "${work}/again.out"; fail "a second attach --swap failed"; }
"${virsh[@]}" dumpxml --inactive "${name}" >"${work}/again.xml"
n="$(grep -c "type='vhostuser'" "${work}/again.xml")"
[[ "${n}" == 1 ]] || fail "a second attach left ${n} vhostuser disks"

log "3. the cold boot: QEMU (libvirt-qemu) connects to the swap socket"
"${virsh[@]}" start "${name}" >"${work}/start.out" 2>&1 ||
  { cat "${work}/start.out"; fail "the domain with the swap disk did not start"; }
qpid="$(pgrep -f "guest=${name}," | head -1)"
[[ -n "${qpid}" ]] || fail "no QEMU process for ${name}"
(( $(stat -c %u "/proc/${qpid}") != 0 )) || fail "QEMU of ${name} runs as root"
cmdline="$(tr '\0' ' ' <"/proc/${qpid}/cmdline")"
grep -q '"driver":"vhost-user-blk-pci","num-queues":1' <<<"${cmdline}" &&
  grep -q '"qom-type":"memory-backend-memfd","id":"pc.ram","share":true' <<<"${cmdline}" ||
  { echo "${cmdline}"; fail "QEMU has no vhost-user-blk-pci (one queue) or no shared memfd RAM"; }
connected=""
for _ in $(seq 50); do
  if qemu_connected "${qpid}"; then connected=1; break; fi
  sleep 0.2
done
[[ -n "${connected}" ]] || { ss -xpn | grep -E "tmemd|qemu"; fail "QEMU is not connected to tmemd"; }
log "   QEMU (uid $(stat -c %u "/proc/${qpid}")) connected to tmemd's swap device"

log "4. the migrate hook refuses the running domain's XML"
"${virsh[@]}" dumpxml "${name}" >"${work}/live.xml"
if ctl libvirt-hook -- "${name}" migrate begin - <"${work}/live.xml" \
  >"${work}/migrate.out" 2>"${work}/migrate.err"; then
  fail "the migrate hook let the domain with a swap device migrate"
fi
grep -q "domain '${name}'" "${work}/migrate.err" || { cat "${work}/migrate.err"; fail "the refusal does not name the domain"; }
[[ -s "${work}/migrate.out" ]] && fail "the migrate hook wrote to stdout"

log "5. attach --swap of a running domain: from the next cold boot"
define "${name}-run" ""
"${virsh[@]}" start "${name}-run" >/dev/null || fail "virsh start ${name}-run failed"
ctl attach --swap 32MiB "${name}-run" >"${work}/run.out" 2>&1 ||
  { cat "${work}/run.out"; fail "attach --swap of a running domain failed"; }
grep -q "next cold boot" "${work}/run.out" && grep -q "reboot inside the guest" "${work}/run.out" ||
  { cat "${work}/run.out"; fail "the answer does not say a reboot inside the guest is not enough"; }
"${virsh[@]}" dumpxml "${name}-run" | grep -q vhostuser &&
  fail "the running domain's live XML changed"

log "6. private hugepages: refused, naming them, no socket"
define "${name}-huge" "<memoryBacking><hugepages/></memoryBacking>"
if ctl attach --swap 64M "${name}-huge" >"${work}/huge.out" 2>&1; then
  fail "attach --swap of a hugepages domain was accepted"
fi
grep -q "<hugepages/>" "${work}/huge.out" || { cat "${work}/huge.out"; fail "the refusal does not name <hugepages/>"; }
[[ -e "${sock}/${name}-huge.swap.sock" ]] && fail "a refused attach left a swap socket"
log "   refused: $(head -1 "${work}/huge.out")"

log "7. detach --swap: out of the definition, device kept while QEMU uses it"
ctl detach --swap "${name}" >"${work}/detach.out" 2>&1 ||
  { cat "${work}/detach.out"; fail "detach --swap failed"; }
cat "${work}/detach.out"
"${virsh[@]}" dumpxml --inactive "${name}" >"${work}/detached.xml"
grep -q vhostuser "${work}/detached.xml" && fail "the disk is still in the persistent definition"
grep -q "<access mode='shared'/>" "${work}/detached.xml" || fail "detach took the memoryBacking out"
[[ -S "${swap_sock}" ]] || fail "the device went while QEMU still uses it"
"${virsh[@]}" destroy "${name}" >/dev/null || fail "virsh destroy failed"
ctl detach --swap "${name}" >"${work}/detach2.out" 2>&1 ||
  { cat "${work}/detach2.out"; fail "detach --swap of the shut-off domain failed"; }
[[ -e "${swap_sock}" ]] && fail "the swap socket is still there after detach of the shut-off domain"
log "PASS"
