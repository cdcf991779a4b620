#!/usr/bin/env bash
# libvirt's qemu hook (transient domains and incoming migrations).
# A real libvirtd on qemu:///system runs packaging/libvirt/tmemd-qemu-hook's
# command (tmemctl libvirt-hook) from /etc/libvirt/hooks/qemu.d/; a real
# tmemd (--libvirt-uri) answers it:
#  - a transient domain (virsh create) whose XML has the tmem device starts:
#    its socket did not exist before the hook, QEMU connects, the quota in
#    its metadata is applied;
#  - its socket outside tmemd's directory, or a bad metadata value: the hook
#    fails, libvirt does not start QEMU, and virsh says why;
#  - a domain without the device starts while tmemd is stopped;
#  - destroy: the VM's channel goes;
#  - the hook runs the packaged script's own command line (with its "--"):
#    a domain named "-ojson" without tmem starts, one named "-h" with tmem is
#    prepared and QEMU connects;
#  - a look-alike shmem inside <metadata> makes no socket;
#  - a domain XML over the control socket's 256 KiB default request limit
#    starts with its socket prepared;
#  - migrate (run on the destination before the incoming QEMU starts): a
#    domain with a disk on tmemd's swap socket is refused, naming it, and
#    nothing is printed on stdout (libvirt would use it as the domain XML);
#    other domains pass; with tmemd down a disk on a *.swap.sock socket is
#    still refused and other domains pass.
# Exit 77 (skipped, with the reason) only when libvirtd cannot run here.
#
# Usage: libvirt_hook_test.sh TMEMD TMEMCTL SOURCE_DIR
set -uo pipefail
tmemd="$1" tmemctl="$2" src="$3"

log() { printf '[hook-test %s] %s\n' "$(date +%T)" "$*"; }
fail() {
  log "FAIL: $*"
  [[ -s "${work:-}/hook.calls" ]] && { log "the hook's calls:"; cat "${work}/hook.calls"; }
  [[ -s "${work:-}/tmemd.log" ]] && { log "tmemd's log:"; cat "${work}/tmemd.log"; }
  exit 1
}

if ! "${src}/scripts/start-libvirtd.sh"; then
  log "SKIP: libvirtd cannot run here (scripts/start-libvirtd.sh failed)"
  exit 77
fi
[[ -x /usr/bin/qemu-system-x86_64 ]] || { log "SKIP: no qemu-system-x86_64"; exit 77; }
getent group libvirt-qemu >/dev/null || { log "SKIP: no libvirt-qemu group"; exit 77; }

hook_dir=/etc/libvirt/hooks/qemu.d
# A run killed before its cleanup (ctest's timeout sends SIGKILL) leaves its
# hook behind; libvirtd would run it for every domain it starts from then on.
# Take out the hooks of runs that are gone, and restart libvirtd to forget them.
stale=""
for h in "${hook_dir}"/tmemd-test-*; do
  [[ -e "${h}" ]] || continue
  pid="${h##*/tmemd-test-}"
  if [[ "${pid}" =~ ^[0-9]+$ ]] && ! kill -0 "${pid}" 2>/dev/null; then
    log "removing ${h}: left by hook-test run ${pid}, which is gone"
    rm -f "${h}" && stale=1
  fi
done
if [[ -n "${stale}" ]]; then
  "${src}/scripts/start-libvirtd.sh" --restart >/dev/null || fail "libvirtd did not restart"
fi

work="$(mktemp -d /tmp/tmemd-hook.XXXXXX)"
chmod 0711 "${work}"  # QEMU (libvirt-qemu) walks to the socket directory
sock="${work}/sock"
mkdir -m 0750 "${sock}"
chgrp libvirt-qemu "${sock}"
control="${work}/control.sock"
hook="${hook_dir}/tmemd-test-$$"
name="tmemd-test-hook-$$"
tmemd_pid=""
# Domains named "-ojson" and "-h" (libvirt accepts both) are destroyed by
# UUID: virsh would read their names as options.
uuid_ojson="$(printf '%08x-0000-4000-8000-000000000001' $$)"
uuid_h="$(printf '%08x-0000-4000-8000-000000000002' $$)"

cleanup() {
  for d in "${name}" "${name}-outside" "${name}-badmeta" "${name}-plain" \
    "${name}-meta" "${name}-big" "${uuid_ojson}" "${uuid_h}"; do
    virsh -c qemu:///system destroy --domain "${d}" >/dev/null 2>&1
  done
  [[ -n "${tmemd_pid}" ]] && kill "${tmemd_pid}" 2>/dev/null && wait "${tmemd_pid}" 2>/dev/null
  if [[ -e "${hook}" ]]; then
    rm -f "${hook}"
    # libvirtd reads the hook directory when it starts: forget ours.
    "${src}/scripts/start-libvirtd.sh" --restart >/dev/null
  fi
  rm -rf "${work}"
}
trap cleanup EXIT

start_tmemd() {
  "${tmemd}" --socket-dir "${sock}" --control-socket "${control}" \
    --state-dir "${work}/state" \
    --libvirt-uri qemu:///system >>"${work}/tmemd.log" 2>&1 &
  tmemd_pid=$!
  for _ in $(seq 100); do
    [[ -S "${control}" ]] && "${tmemctl}" -s "${control}" status >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  cat "${work}/tmemd.log"
  fail "tmemd did not start"
}

# $1 name, $2 socket path ('' for no tmem device), $3 metadata element or '',
# $4 UUID or ''
domain_xml() {
  local device="" uuid=""
  [[ -n "${4:-}" ]] && uuid="<uuid>$4</uuid>"
  [[ -n "$2" ]] && device="<shmem name='tmem0' role='master'><model type='ivshmem-doorbell'/><server path='$2'/><msi vectors='1' ioeventfd='on'/></shmem>"
  cat <<EOF
<domain type='qemu'><name>$1</name>${uuid}<memory unit='MiB'>64</memory><vcpu>1</vcpu>
<os><type arch='x86_64' machine='pc'>hvm</type></os><features><acpi/></features>
<on_poweroff>destroy</on_poweroff>
<metadata>$3</metadata>
<devices><emulator>/usr/bin/qemu-system-x86_64</emulator><memballoon model='none'/>${device}</devices>
</domain>
EOF
}

meta() {
  printf '<tmem:tmem xmlns:tmem="https://tmemd.dev/xmlns/tmem/1"><quota>%s</quota></tmem:tmem>' "$1"
}

start_tmemd
mkdir -p "${hook_dir}"
# libvirtd runs every hook for every domain: this one answers only for this
# run's domains, and only while this run lives, so a run that dies without
# its cleanup cannot stop other domains (or other tests) from starting. It
# runs the packaged hook's own command line (its "--" included), with this
# run's tmemctl and control socket.
packaged="${src}/packaging/libvirt/tmemd-qemu-hook"
hook_cmd="$(grep '^exec /usr/bin/tmemctl ' "${packaged}" |
  sed "s#^exec /usr/bin/tmemctl #${tmemctl} -s ${control} #")"
[[ "${hook_cmd}" == *' libvirt-hook -- "$@"' ]] ||
  fail "the packaged hook does not end tmemctl's options with --: ${hook_cmd}"
cat >"${hook}" <<EOF
#!/bin/sh
case "\$1" in
${name} | ${name}-* | -ojson | -h) kill -0 $$ 2>/dev/null || exit 0 ;;
*) exit 0 ;;
esac
echo "\$*" >>${work}/hook.calls
${hook_cmd} >>${work}/hook.calls
rc=\$?
echo "\$* -> \$rc" >>${work}/hook.calls
exit \$rc
EOF
chmod 0755 "${hook}"
log "hook ${hook} installed; restarting libvirtd so that it sees it"
"${src}/scripts/start-libvirtd.sh" --restart >/dev/null || fail "libvirtd did not restart"

log "1. a transient domain with the tmem device, socket not there yet"
[[ -e "${sock}/hook.sock" ]] && fail "the socket exists before the hook ran"
domain_xml "${name}" "${sock}/hook.sock" "$(meta 64MiB)" >"${work}/dom.xml"
virsh -c qemu:///system create "${work}/dom.xml" >"${work}/create.out" 2>&1 ||
  { cat "${work}/create.out" "${work}/tmemd.log"; fail "virsh create failed"; }
connected=""
for _ in $(seq 100); do
  out="$("${tmemctl}" -s "${control}" -o json vm "${name}" 2>/dev/null)"
  if grep -q '"connected": *true' <<<"${out}"; then connected=1; break; fi
  sleep 0.1
done
[[ -n "${connected}" ]] || { echo "${out}"; fail "QEMU did not connect to the prepared socket"; }
grep -q '"quota_bytes": *"67108864"' <<<"${out}" ||
  { echo "${out}"; fail "the metadata quota (64MiB) is not applied"; }
grep -q "event=libvirt_hook_prepared" "${work}/tmemd.log" || fail "no libvirt_hook_prepared in the log"
log "   started, QEMU connected, quota 64MiB applied"

log "2. the device's socket outside tmemd's directory: refused before QEMU starts"
domain_xml "${name}-outside" "${work}/outside.sock" "" >"${work}/outside.xml"
if virsh -c qemu:///system create "${work}/outside.xml" >"${work}/outside.out" 2>&1; then
  fail "a domain with its socket outside the socket directory started"
fi
grep -q "tmemctl libvirt-hook" "${work}/outside.out" ||
  { cat "${work}/outside.out"; fail "virsh does not show the hook's reason"; }
log "   refused: $(grep -o 'tmemctl libvirt-hook.*' "${work}/outside.out" | head -1)"

log "3. a bad metadata value: refused, naming it"
domain_xml "${name}-badmeta" "${sock}/badmeta.sock" "$(meta banana)" >"${work}/badmeta.xml"
if virsh -c qemu:///system create "${work}/badmeta.xml" >"${work}/badmeta.out" 2>&1; then
  fail "a domain with quota 'banana' started"
fi
grep -q "quota" "${work}/badmeta.out" || { cat "${work}/badmeta.out"; fail "the refusal does not name the quota"; }
[[ -e "${sock}/badmeta.sock" ]] && fail "a refused domain left a socket"

log "4. destroy: the channel goes"
virsh -c qemu:///system destroy "${name}" >/dev/null || fail "virsh destroy failed"
gone=""
for _ in $(seq 100); do
  if ! "${tmemctl}" -s "${control}" vm "${name}" >/dev/null 2>&1; then gone=1; break; fi
  sleep 0.1
done
[[ -n "${gone}" ]] || fail "the VM's channel is still there after destroy"

log "5. a domain named -ojson without tmem starts; one named -h with tmem is prepared"
domain_xml "-ojson" "" "" "${uuid_ojson}" >"${work}/ojson.xml"
virsh -c qemu:///system create "${work}/ojson.xml" >"${work}/ojson.out" 2>&1 ||
  { cat "${work}/ojson.out"; fail "the domain named -ojson (no tmem) did not start"; }
virsh -c qemu:///system destroy --domain "${uuid_ojson}" >/dev/null 2>&1
domain_xml "-h" "${sock}/dash-h.sock" "" "${uuid_h}" >"${work}/h.xml"
virsh -c qemu:///system create "${work}/h.xml" >"${work}/h.out" 2>&1 ||
  { cat "${work}/h.out"; fail "the domain named -h (with tmem) did not start"; }
connected=""
for _ in $(seq 100); do
  # Not a safe file name: its VM is named by its UUID.
  out="$("${tmemctl}" -s "${control}" -o json vm "${uuid_h}" 2>/dev/null)"
  if grep -q '"connected": *true' <<<"${out}"; then connected=1; break; fi
  sleep 0.1
done
[[ -n "${connected}" ]] || { echo "${out}"; fail "QEMU of domain -h did not connect to its prepared socket"; }
virsh -c qemu:///system destroy --domain "${uuid_h}" >/dev/null 2>&1

log "6. a look-alike shmem in <metadata> (another namespace) makes no socket"
lookalike="<x:shmem xmlns:x='https://example.org/x' name='tmem0'><x:model type='ivshmem-doorbell'/><x:server path='${sock}/victim.sock'/></x:shmem>"
domain_xml "${name}-meta" "" "${lookalike}" >"${work}/meta.xml"
virsh -c qemu:///system create "${work}/meta.xml" >"${work}/meta.out" 2>&1 ||
  { cat "${work}/meta.out"; fail "the domain with a look-alike in its metadata did not start"; }
[[ -e "${sock}/victim.sock" ]] && fail "a shmem inside <metadata> made tmemd create victim.sock"
virsh -c qemu:///system destroy --domain "${name}-meta" >/dev/null 2>&1

log "7. a domain XML of more than 256 KiB starts, its socket prepared"
blob="$(head -c 300000 /dev/zero | tr '\0' 'x')"
domain_xml "${name}-big" "${sock}/big.sock" \
  "<big:blob xmlns:big='https://example.org/big'>${blob}</big:blob>" >"${work}/big.xml"
(( $(stat -c %s "${work}/big.xml") > 262144 )) || fail "the big domain XML is not over 256 KiB"
virsh -c qemu:///system create "${work}/big.xml" >"${work}/big.out" 2>&1 ||
  { cat "${work}/big.out"; fail "the domain with a 300 KB XML did not start"; }
connected=""
for _ in $(seq 100); do
  out="$("${tmemctl}" -s "${control}" -o json vm "${name}-big" 2>/dev/null)"
  if grep -q '"connected": *true' <<<"${out}"; then connected=1; break; fi
  sleep 0.1
done
[[ -n "${connected}" ]] || { echo "${out}"; fail "QEMU of the big domain did not connect"; }
virsh -c qemu:///system destroy --domain "${name}-big" >/dev/null 2>&1

log "8. migrate (libvirt runs it on the destination before QEMU starts): a domain"
log "   with a disk on tmemd's swap socket is refused, naming it; others pass; nothing on stdout"
swap_disk() {
  printf "<disk type='vhostuser' device='disk'><driver name='qemu' type='raw'/><source type='unix' path='%s'><reconnect enabled='yes' timeout='1'/></source><target dev='vdb' bus='virtio'/></disk>" "$1"
}
migrate_hook() {  # $1 domain name, $2 XML file; as libvirt calls it
  "${tmemctl}" -s "${control}" libvirt-hook -- "$1" migrate begin - <"$2" \
    >"${work}/migrate.out" 2>"${work}/migrate.err"
}
domain_xml "${name}-swap" "" "" "${uuid_h}" |
  sed "s#</devices>#$(swap_disk "${sock}/${name}-swap.swap.sock")</devices>#" >"${work}/swap.xml"
grep -q "type='vhostuser'" "${work}/swap.xml" || fail "the test's swap XML has no vhostuser disk"
migrate_hook "${name}-swap" "${work}/swap.xml" &&
  fail "the migrate hook let a domain with a tmemd swap device migrate"
grep -q "domain '${name}-swap'" "${work}/migrate.err" &&
  grep -q "cannot migrate swap devices" "${work}/migrate.err" ||
  { cat "${work}/migrate.err"; fail "the refusal does not name the domain and the reason"; }
[[ -s "${work}/migrate.out" ]] && { cat "${work}/migrate.out"; fail "the migrate hook wrote to stdout (libvirt would take it as the XML)"; }
grep -q "event=libvirt_migration_refused" "${work}/tmemd.log" || fail "no libvirt_migration_refused in tmemd's log"
log "   refused: $(head -1 "${work}/migrate.err")"
# Another program's vhost-user disk, and a domain with tmem but no swap.
domain_xml "${name}-spdk" "" "" |
  sed "s#</devices>#$(swap_disk /var/tmp/spdk/vhost.0)</devices>#" >"${work}/spdk.xml"
migrate_hook "${name}-spdk" "${work}/spdk.xml" ||
  { cat "${work}/migrate.err"; fail "the migrate hook refused another program's vhost-user disk"; }
[[ -s "${work}/migrate.out" ]] && fail "the migrate hook wrote to stdout for a migratable domain"
migrate_hook "${name}" "${work}/dom.xml" ||
  { cat "${work}/migrate.err"; fail "the migrate hook refused a domain without a swap device"; }
[[ -s "${work}/migrate.out" ]] && fail "the migrate hook wrote to stdout for a tmem domain"

log "9. tmemd stopped: a domain without the device still starts"
kill "${tmemd_pid}" && wait "${tmemd_pid}" 2>/dev/null
tmemd_pid=""
domain_xml "${name}-plain" "" "" >"${work}/plain.xml"
virsh -c qemu:///system create "${work}/plain.xml" >"${work}/plain.out" 2>&1 ||
  { cat "${work}/plain.out"; fail "a domain without tmem did not start with tmemd down"; }
virsh -c qemu:///system destroy "${name}-plain" >/dev/null 2>&1
# ... and migrates: without a vhost-user disk the hook does not ask tmemd;
# another program's vhost-user disk passes, a *.swap.sock one is refused.
migrate_hook "${name}-plain" "${work}/plain.xml" ||
  { cat "${work}/migrate.err"; fail "with tmemd down the migrate hook refused a domain without a swap device"; }
migrate_hook "${name}-spdk" "${work}/spdk.xml" ||
  { cat "${work}/migrate.err"; fail "with tmemd down the migrate hook refused another program's vhost-user disk"; }
migrate_hook "${name}-swap" "${work}/swap.xml" &&
  fail "with tmemd down the migrate hook let a domain with a swap device migrate"
grep -q "domain '${name}-swap'" "${work}/migrate.err" ||
  { cat "${work}/migrate.err"; fail "the refusal with tmemd down does not name the domain"; }
[[ -s "${work}/migrate.out" ]] && fail "the migrate hook wrote to stdout with tmemd down"
log "PASS"
