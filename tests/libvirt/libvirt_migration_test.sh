#!/usr/bin/env bash
# virsh migrate between two libvirt "hosts" on this machine.
#
# Two hosts, A and B, each a mount namespace (unshare -m) holding its own
# libvirtd and its own tmemd. Private copies of /etc/libvirt, /run/libvirt,
# /var/lib/libvirt, /var/log/libvirt and /var/cache/libvirt are bound over
# the real ones, and each host's socket directory over one common path
# (/run/tmemd-virsh-test.PID), so a domain's XML names the same socket on
# both hosts, as /run/tmemd/NAME.sock does in a real fleet. Each libvirtd
# has its own host_uuid (libvirt refuses a migration to its own host UUID)
# and migration ports, and runs tmemd's qemu hook from its private
# /etc/libvirt/hooks/qemu.d/ (tmemctl libvirt-hook on that host's tmemd),
# so the socket of an incoming transient domain is made by the
# destination's hook. Clients reach a host through its libvirtd socket
# (qemu:///system?socket=...). The system libvirtd (scripts/start-
# libvirtd.sh) is not touched, and ours run under another process name so
# that script's `pgrep -x libvirtd` does not find (and stop) them.
#
# The migrations are not live (`virsh migrate` without --live: libvirt
# pauses the guest, copies its memory once and resumes it on the
# destination): QEMU 7.2's live precopy under TCG has corrupted guests on
# this machine even without tmem (vm-images/migrate-test.py). `--live` is
# tried once, its outcome printed, not asserted.
#
# libvirt 9.0 does not put role='master' of an ivshmem-doorbell on QEMU's
# command line, so the domains add master=on with a <qemu:override>
# (domain_xml; docs/libvirt.md).
#
# The domains run no OS (SeaBIOS finds nothing to boot) but have tmem's
# ivshmem-doorbell device (role='master') connected to tmemd. Steps:
#  0. role='master' without the override: virsh migrate's answer printed.
#  1. persistent domain, defined on both hosts first, A -> B -> A: on the
#     destination QEMU (started with master=on) is connected to that host's
#     tmemd, which counts the region that arrived holding the source's
#     header (foreign) and re-initializes it; the XML keeps role='master';
#     a quota set with tmemctl on A (written into the domain's metadata) is
#     applied by B; the source's tmemd releases the VM (its config keeps
#     the device, so the channel is made again, empty and unconnected).
#  2. transient domain (virsh create), A -> B -> A: the destination's
#     socket comes from its hook (prepare), the source's channel is gone.
#  3. the same domain without the device, A -> B -> A, for the times.
#  5. a domain with a tmemd swap device (tmemctl attach --swap) does not
#     migrate: running, QEMU blocks it on the source (no dirty logging in
#     tmemd's back-end); --offline, the destination's migrate hook refuses
#     it, virsh shows why; it keeps running on the source.
#  6. virsh migrate --live once (outcome printed).
# Prints BENCH lines: virsh migrate wall time and libvirt's job time and
# downtime (domjobinfo --completed on the destination), with the tmem
# device and for the same domain without it.
#
# With --real-guest instead: the 5.10 test guest (vm-images/, TCG) with its
# verifying workload (init.sh tmemtest=ops) as a persistent domain, moved
# A -> B -> A -> B with virsh migrate at each of its WAIT_HOST_RESTART
# points, its reads, puts and gets in flight. Each destination tmemd counts
# the foreign region and gets the guest's puts and get hits, each source
# tmemd holds none of its pages afterwards; the guest sees every host
# generation change, verifies every page it reads (TMEMTEST DONE fails=0)
# and logs no BUG/Oops. GUEST_LIVE=1 in the environment migrates it with
# --live instead (by hand: live precopy under TCG is unreliable here).
#
# Exit 77 (skipped, with the reason) only when two libvirtd cannot run here.
# Usage: libvirt_migration_test.sh TMEMD TMEMCTL SOURCE_DIR [--real-guest]
set -uo pipefail
tmemd_bin="$1" tmemctl="$2" src="$3" real_guest=0
[[ "${4:-}" == --real-guest ]] && real_guest=1

log() { printf '[migration-test %s] %s\n' "$(date +%T)" "$*"; }
fail() {
  log "FAIL: $*"
  exit 1
}
skip() {
  log "SKIP: $*"
  exit 77
}

((EUID == 0)) || skip "needs root (two libvirtd, mount namespaces)"
for t in libvirtd virsh unshare nsenter qemu-system-x86_64 python3 bc; do
  command -v "${t}" >/dev/null 2>&1 || skip "${t} not installed"
done
getent group libvirt-qemu >/dev/null || skip "no libvirt-qemu group"
unshare -m true 2>/dev/null || skip "unshare -m is not permitted here"

t_start=$(date +%s.%N)
work="$(mktemp -d /tmp/tmemd-virsh-mig.XXXXXX)"
chmod 0711 "${work}" # QEMU (libvirt-qemu) walks to the socket directories
tag="$$"
sockdir="/run/tmemd-virsh-test.${tag}" # each host binds its own here
declare -A ns_pid libvirtd_pid tmemd_pid
persistent="tmemd-mig-p-${tag}"
transient="tmemd-mig-t-${tag}"
plain="tmemd-mig-n-${tag}"
glued="tmemd-mig-u-${tag}"

uri() { echo "qemu:///system?socket=${work}/$1/run/libvirt-sock"; }
vsh() {
  local h="$1"
  shift
  # -k: virsh blocked in a call does not die of SIGTERM alone.
  timeout -k 10 120 virsh -q -c "$(uri "${h}")" "$@"
}
ctl() {
  local h="$1"
  shift
  "${tmemctl}" -s "${work}/${h}/control.sock" "$@"
}
stop_pid() {
  local p="$1"
  [[ -n "${p}" ]] || return 0
  kill -TERM "${p}" 2>/dev/null || return 0
  for _ in $(seq 50); do
    kill -0 "${p}" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "${p}" 2>/dev/null
  wait "${p}" 2>/dev/null
}

cleanup() {
  local rc=$?
  trap - EXIT
  for h in A B; do
    [[ -n "${libvirtd_pid[${h}]:-}" ]] || continue
    for d in $(vsh "${h}" list --name 2>/dev/null); do vsh "${h}" destroy "${d}" >/dev/null 2>&1; done
    for d in $(vsh "${h}" list --all --name 2>/dev/null); do vsh "${h}" undefine "${d}" >/dev/null 2>&1; done
  done
  # A QEMU left behind (libvirtd unreachable): ours carry this run's tag.
  for p in $(pgrep -f "qemu-system-x86_64 .*guest=tmemd-mig-[a-z]-${tag}" 2>/dev/null); do
    kill -KILL "${p}" 2>/dev/null
  done
  for h in A B; do
    stop_pid "${tmemd_pid[${h}]:-}"
    stop_pid "${libvirtd_pid[${h}]:-}"
    # The namespace, and its bind mounts, go with its last process.
    stop_pid "${ns_pid[${h}]:-}"
  done
  rmdir "${sockdir}" 2>/dev/null
  # KEEP_WORK=1 keeps the work directory of a failed run, KEEP_WORK=always
  # of every run.
  if [[ "${KEEP_WORK:-}" == always ]] || { ((rc != 0)) && [[ -n "${KEEP_WORK:-}" ]]; }; then
    log "kept ${work}"
  else
    rm -rf "${work}"
  fi
  log "wall time $(printf '%.1f' "$(echo "$(date +%s.%N) - ${t_start}" | bc)") s"
  exit "${rc}"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# start_host NAME HOST_UUID FIRST_MIGRATION_PORT: its namespace and libvirtd.
start_host() {
  local h="$1" uuid="$2" port="$3" root="${work}/$1"
  mkdir -p "${root}"/{etc,run,lib,log,cache,sock}
  cp -a /etc/libvirt/. "${root}/etc/"
  # The system instance's QEMU capabilities: probing QEMU again takes
  # minutes on a loaded machine (libvirt re-probes if QEMU changed).
  [[ -d /var/cache/libvirt/qemu ]] && cp -a /var/cache/libvirt/qemu "${root}/cache/"
  # Nothing of the system instance's autostart (networks, domains) or hooks.
  rm -rf "${root}/etc/qemu/networks/autostart" "${root}/etc/qemu/autostart" \
    "${root}/etc/hooks"
  mkdir -p "${root}/etc/hooks/qemu.d" "${root}/lib/qemu" "${root}/lib/images"
  printf '# tmemd libvirt_migration_test: host %s\nhost_uuid = "%s"\n' \
    "${h}" "${uuid}" >>"${root}/etc/libvirtd.conf"
  # stdio_handler: QEMU's output to a file, no virtlogd (the system one
  # cannot see this host's run directory). cgroup_controllers: during a
  # migration both hosts run a domain of the same name, whose cgroup paths
  # would collide. Migration ports apart (libvirt refuses a local address
  # for migration_address/migration_host; the destination names itself by
  # its hostname, which resolves to this machine). remember_owner: the two
  # hosts label the same files (the guest's disk, kernel, console file);
  # each libvirtd keeping a reference count of their owner in the files'
  # xattrs refused the destination's label ("Setting different DAC user or
  # group ... already in use") in one run of three.
  cat >>"${root}/etc/qemu.conf" <<EOF
# tmemd libvirt_migration_test: host ${h}
stdio_handler = "file"
remember_owner = 0
cgroup_controllers = [ ]
migration_port_min = ${port}
migration_port_max = $((port + 9))
EOF
  cat >"${root}/etc/hooks/qemu.d/tmemd" <<EOF
#!/bin/sh
exec ${tmemctl} -s ${root}/control.sock libvirt-hook "\$@"
EOF
  chmod 0755 "${root}/etc/hooks/qemu.d/tmemd"
  chmod 0750 "${root}/sock"
  chgrp libvirt-qemu "${root}/sock"
  # The namespace: a process holding it, everything else joins it.
  unshare -m --propagation private -- /bin/sh -c "
    mount --bind '${root}/etc' /etc/libvirt &&
    mount --bind '${root}/run' /run/libvirt &&
    mount --bind '${root}/lib' /var/lib/libvirt &&
    mount --bind '${root}/log' /var/log/libvirt &&
    mount --bind '${root}/cache' /var/cache/libvirt &&
    mount --bind '${root}/sock' '${sockdir}' &&
    touch '${root}/ns-ready' && exec sleep infinity" >"${root}/ns.log" 2>&1 &
  ns_pid[${h}]=$!
  wait_until 60 test -e "${root}/ns-ready" || {
    cat "${root}/ns.log"
    skip "cannot bind libvirt's directories in a private mount namespace"
  }
  # Started through a link of another name: scripts/start-libvirtd.sh (run
  # by other tests and worktrees) finds and stops the system instance with
  # `pgrep -x libvirtd`, which must match neither of these.
  ln -s "$(command -v libvirtd)" "${root}/tmemd-test-libvirtd"
  nsenter -t "${ns_pid[${h}]}" -m -- "${root}/tmemd-test-libvirtd" --pid-file "${root}/libvirtd.pid" \
    >"${root}/libvirtd.log" 2>&1 &
  libvirtd_pid[${h}]=$!
}

# host_ready NAME HOST_UUID: waits for the host's libvirtd, starts its tmemd.
host_ready() {
  local h="$1" uuid="$2" root="${work}/$1"
  if ! wait_until 180 vsh "${h}" version >/dev/null 2>&1; then
    cat "${root}/libvirtd.log"
    skip "a libvirtd in a private mount namespace does not answer within 180 s here"
  fi
  # (Whole outputs compared, not piped into grep -q: with pipefail, grep
  # quitting early would fail the pipe.)
  [[ "$(vsh "${h}" capabilities)" == *"<uuid>${uuid}</uuid>"* ]] ||
    fail "host ${h} does not report host_uuid ${uuid}"
  # tmemd once its libvirtd answers; no tmem domain starts before, so the
  # hook has nobody to ask. tmemd connects to libvirt in the background:
  # ready means its first sync with libvirtd is logged.
  # The real guest's checks want hits after every hop: store every put
  # (--mode always, as vm-images/migrate-test.py), not the adaptive valve's
  # choice, which may keep few pages of a workload this short.
  local mode=()
  ((real_guest)) && mode=(--mode always)
  nsenter -t "${ns_pid[${h}]}" -m -- "${tmemd_bin}" --socket-dir "${sockdir}" \
    --control-socket "${root}/control.sock" --state-dir "${root}/state" \
    --no-fd-store --stats-interval 1 \
    "${mode[@]}" --libvirt-uri "$(uri "${h}")" >"${root}/tmemd.log" 2>&1 &
  tmemd_pid[${h}]=$!
  wait_until 30 ctl "${h}" status >/dev/null 2>&1 || {
    cat "${root}/tmemd.log"
    fail "host ${h}: tmemd does not answer"
  }
  wait_until 30 grep -q "event=libvirt_synced" "${root}/tmemd.log" || {
    cat "${root}/tmemd.log"
    fail "host ${h}: tmemd did not sync with its libvirtd"
  }
  log "host ${h}: libvirtd pid ${libvirtd_pid[${h}]} (host_uuid ${uuid}), tmemd pid ${tmemd_pid[${h}]}"
}

# wait_until SECONDS COMMAND...: true once COMMAND succeeds.
wait_until() {
  local deadline=$(($(date +%s) + $1))
  shift
  until "$@"; do
    (($(date +%s) >= deadline)) && return 1
    sleep 0.2
  done
}

# vm_field HOST VM FIELD, from `tmemctl -o json vm`: a summary field
# (connected, pages), a policy field (quota_bytes) or a counter by name
# (foreign_regions); "absent" when tmemd has no such VM, "error:..." when
# tmemctl failed otherwise.
vm_field() {
  ctl "$1" -o json vm "$2" 2>/dev/null | python3 -c '
import json, sys
field = sys.argv[1]
try:
    d = json.load(sys.stdin)
except ValueError:
    d = {}
if "summary" not in d:
    # tmemctl failed: {"hosts": [{"code": ...}]}
    codes = [h.get("code") for h in d.get("hosts", [])]
    print("absent" if codes == ["NOT_FOUND"] else "error:%s" % codes)
    sys.exit()
s = d["summary"]
if field in s:
    print(str(s[field]).lower())
elif field in s.get("policy", {}):
    print(str(s["policy"][field]).lower())
else:
    print(next((c.get("value", 0) for c in d.get("channel_counters", []) + d.get("counters", [])
                if c.get("name") == field), 0))' "$3"
}
is_field() { [[ "$(vm_field "$1" "$2" "$3")" == "$4" ]]; }
more_than() { (($(vm_field "$1" "$2" "$3") > $4)); }

# domain_xml NAME UUID WITH_TMEM(0|1) [MASTER_OVERRIDE(1|0)]
# libvirt 9.0 writes role='master' of an ivshmem-doorbell device into its
# own checks but not onto QEMU's command line (no master=on: QEMU keeps the
# "peer mode" migration blocker), so the device gets master=on through a
# <qemu:override> of its property. Without it (4th argument 0) the domain
# is what the glue and `tmemctl attach` write.
domain_xml() {
  local device="" override=""
  if (($3)); then
    device="<shmem name='tmem0' role='master'><model type='ivshmem-doorbell'/><server path='${sockdir}/$1.sock'/><msi vectors='1' ioeventfd='on'/><alias name='ua-tmem0'/></shmem>"
    ((${4:-1})) && override="<qemu:override><qemu:device alias='ua-tmem0'><qemu:frontend><qemu:property name='master' type='string' value='on'/></qemu:frontend></qemu:device></qemu:override>"
  fi
  cat <<EOF
<domain type='qemu' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'><name>$1</name><uuid>$2</uuid><memory unit='MiB'>64</memory><vcpu>1</vcpu>
<os><type arch='x86_64' machine='pc'>hvm</type></os><features><acpi/></features>
<on_poweroff>destroy</on_poweroff>
<devices><emulator>/usr/bin/qemu-system-x86_64</emulator><memballoon model='none'/>${device}</devices>
${override}</domain>
EOF
}

# migrate FROM TO DOMAIN LABEL [virsh migrate options]: prints a BENCH line.
migrate() {
  local from="$1" to="$2" dom="$3" label="$4" t0 t1 info
  shift 4
  t0=$(date +%s.%N)
  vsh "${from}" migrate "$@" "${dom}" "$(uri "${to}")" >"${work}/migrate.out" 2>&1 || return 1
  t1=$(date +%s.%N)
  info="$(vsh "${to}" domjobinfo --completed "${dom}" 2>/dev/null | tr -s ' ' | tr '\n' ';')"
  printf 'BENCH virsh-migrate %s %s->%s wall_ms=%.0f job_ms=%s downtime_ms=%s\n' \
    "${label}" "${from}" "${to}" "$(echo "(${t1} - ${t0}) * 1000" | bc)" \
    "$(sed -n 's/.*Time elapsed: \([0-9]*\) ms.*/\1/p' <<<"${info}")" \
    "$(sed -n 's/.*Total downtime: \([0-9]*\) ms.*/\1/p' <<<"${info}")"
}

quota_bytes=50331648 # 48MiB, set with tmemctl on A

# check_arrived FROM TO DOMAIN PERSISTENT(0|1) FOREIGN_BEFORE
check_arrived() {
  local from="$1" to="$2" dom="$3" persistent="$4" foreign_before="$5"
  [[ "$(vsh "${to}" domstate "${dom}" 2>/dev/null)" == running ]] ||
    fail "${dom} is not running on ${to} after the migration"
  wait_until 30 is_field "${to}" "${dom}" connected true ||
    fail "${to}'s tmemd: QEMU of ${dom} is not connected after the migration"
  # The region arrived holding the source's header: the destination's
  # tmemd recognises it as foreign and re-initializes it.
  wait_until 30 more_than "${to}" "${dom}" foreign_regions "${foreign_before}" ||
    fail "${to}'s tmemd counted no foreign region for ${dom} (before: ${foreign_before})"
  [[ "$(vsh "${to}" dumpxml "${dom}")" == *"<shmem name='tmem0' role='master'>"* ]] ||
    fail "${dom}'s XML on ${to} lost role='master'"
  grep -q '"master":"on"' "${work}/${to}/log/qemu/${dom}.log" ||
    fail "the QEMU libvirt started on ${to} for ${dom} has no master=on"
  wait_until 10 is_field "${to}" "${dom}" quota_bytes "${quota_bytes}" ||
    fail "${to}'s tmemd: quota of ${dom} is $(vm_field "${to}" "${dom}" quota_bytes), not the 48MiB set on A"
  if ((persistent)); then
    # The source keeps the definition (with the device): its channel is
    # released and made again, empty, for the next start.
    wait_until 30 is_field "${from}" "${dom}" connected false ||
      fail "${from}'s tmemd still sees ${dom}'s QEMU ($(vm_field "${from}" "${dom}" connected))"
    is_field "${from}" "${dom}" pages 0 || fail "${from}'s tmemd still holds pages of ${dom}"
  else
    wait_until 30 is_field "${from}" "${dom}" connected absent ||
      fail "${from}'s tmemd still has a channel for the transient ${dom}"
  fi
  log "   on ${to}: running, QEMU connected to ${to}'s tmemd, foreign regions $(vm_field "${to}" "${dom}" foreign_regions), quota 48MiB, role='master'; ${from}'s tmemd released it"
}

# there_and_back DOMAIN PERSISTENT(0|1) LABEL
there_and_back() {
  local dom="$1" persistent="$2" label="$3" from to before
  for hop in A:B B:A; do
    from="${hop%:*}" to="${hop#*:}"
    before="$(vm_field "${to}" "${dom}" foreign_regions)"
    [[ "${before}" == absent ]] && before=0
    migrate "${from}" "${to}" "${dom}" "${label}" ||
      fail "virsh migrate ${dom} ${from} -> ${to}: $(cat "${work}/migrate.out")"
    check_arrived "${from}" "${to}" "${dom}" "${persistent}" "${before}"
  done
}

# The real guest: domain XML like vm-images/tmem-guest.xml.in, the device
# made migratable as in domain_xml, the console appended to one file by the
# QEMU of every host.
guest_xml() { # NAME UUID KERNEL INITRD DISK SERIAL CMDLINE
  cat <<EOF
<domain type='qemu' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>
  <name>$1</name><uuid>$2</uuid><memory unit='MiB'>160</memory><vcpu>1</vcpu>
  <os><type arch='x86_64' machine='pc'>hvm</type><kernel>$3</kernel><initrd>$4</initrd>
    <cmdline>console=ttyS0 panic=-1 $7</cmdline></os>
  <features><acpi/></features>
  <on_poweroff>destroy</on_poweroff><on_reboot>destroy</on_reboot><on_crash>destroy</on_crash>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <disk type='file' device='disk'><driver name='qemu' type='raw' cache='none' io='native'/>
      <source file='$5'/><target dev='vda' bus='virtio'/></disk>
    <shmem name='tmem0' role='master'><model type='ivshmem-doorbell'/><server path='${sockdir}/$1.sock'/>
      <msi vectors='1' ioeventfd='on'/><alias name='ua-tmem0'/></shmem>
    <serial type='file'><source path='$6' append='on'/><target port='0'/></serial>
    <memballoon model='none'/>
  </devices>
  <qemu:override><qemu:device alias='ua-tmem0'><qemu:frontend>
    <qemu:property name='master' type='string' value='on'/></qemu:frontend></qemu:device></qemu:override>
</domain>
EOF
}

# logged_since HOST FROM_LINE TEXT: HOST's tmemd logged TEXT after line
# FROM_LINE.
logged_since() {
  [[ "$(tail -n +"$(($2 + 1))" "${work}/$1/tmemd.log")" == *"$3"* ]]
}

# stats_rose HOST VM FROM_LINE COUNTER ABOVE: after line FROM_LINE of
# HOST's tmemd log, a vm_stats line of the connected VM, or the
# channel_removed line that ends its channel (a guest that does its reads
# and powers off between two stats lines shows only there), has COUNTER
# above ABOVE (puts: valve_raw + valve_compressed, what the VM stored). Sets
# stat_seen to the counters of the line with the most.
stats_rose() {
  local line value best=-1 raw compressed
  while IFS= read -r line; do
    raw="$(sed -n 's/.* valve_raw=\([0-9]*\).*/\1/p' <<<"${line}")"
    compressed="$(sed -n 's/.* valve_compressed=\([0-9]*\).*/\1/p' <<<"${line}")"
    if [[ "$4" == puts ]]; then
      value=$((${raw:-0} + ${compressed:-0}))
    else
      value="$(sed -n "s/.* $4=\([0-9]*\).*/\1/p" <<<"${line}")"
    fi
    ((${value:-0} > best)) || continue
    best="${value:-0}"
    stat_seen="$(grep -o 'event=[a-z_]*' <<<"${line}") $(grep -o 'gets_hit=[0-9]*' <<<"${line}") stored=$((${raw:-0} + ${compressed:-0}))"
  done < <(tail -n +"$(($3 + 1))" "${work}/$1/tmemd.log" |
    grep -E "event=(vm_stats vm=$2 connected=true|channel_removed vm=$2) ")
  ((best > $5))
}

real_guest_test() {
  local dom="tmemd-mig-g-${tag}" images serial="${work}/guest/serial.log"
  local round=0 hosts=(A B) from to hits_before t0 waits log_lines
  images="$("${src}/vm-images/build-all.sh" 2>"${work}/build-all.log")" ||
    skip "the guest images do not build here ($(tail -1 "${work}/build-all.log"))"
  local KERNEL="" INITRD=""
  eval "${images}"
  mkdir -p "${work}/guest"
  chmod 0755 "${work}/guest"
  # Copies: libvirt relabels (chowns) what a domain uses, the cache is shared.
  cp "${KERNEL}" "${work}/guest/bzImage"
  cp "${INITRD}" "${work}/guest/initrd"
  truncate -s 1G "${work}/guest/disk.img"
  mkfs.ext4 -q -F "${work}/guest/disk.img" || fail "mkfs.ext4 failed"
  : >"${serial}"
  guest_xml "${dom}" "$(cat /proc/sys/kernel/random/uuid)" "${work}/guest/bzImage" \
    "${work}/guest/initrd" "${work}/guest/disk.img" "${serial}" \
    "tmem_ivshmem.miss_cost_ns=0 tmemtest=ops tmemtest_pages=${GUEST_PAGES:-6000} tmemtest_files=3" \
    >"${work}/g.xml"
  for h in A B; do
    vsh "${h}" define "${work}/g.xml" >/dev/null || fail "virsh define of the guest on ${h} failed"
  done
  vsh A start "${dom}" >/dev/null || fail "virsh start of the guest on A failed"
  log "real guest ${dom} started on A (TCG; boot and first writes take minutes)"
  t0=$(date +%s)
  while ((round < 3)); do
    (($(date +%s) - t0 > 1200)) && fail "the guest did not reach round $((round + 1)) in 20 min"
    if grep -aqE 'Kernel panic|BUG:|Oops' "${serial}"; then
      grep -aE 'TMEMTEST|tmem_ivshmem|panic|BUG|Oops' "${serial}" | tail -20
      fail "the guest kernel logged a panic/BUG/Oops"
    fi
    grep -aq "TMEMTEST DONE" "${serial}" && fail "the guest finished before round $((round + 1)): $(grep -a 'CHECK .* FAIL' "${serial}" | head -3)"
    waits=$(grep -ac "TMEMTEST WAIT_HOST_RESTART" "${serial}")
    if ((waits > round)); then
      round=$((round + 1))
      from="${hosts[$(((round + 1) % 2))]}" to="${hosts[$((round % 2))]}"
      hits_before="$(vm_field "${to}" "${dom}" gets_hit)"
      log_lines="$(wc -l <"${work}/${to}/tmemd.log")"
      log "round ${round}: the guest waits with reads in flight; virsh migrate ${from} -> ${to}"
      # --unsafe: the disk is one file both hosts see at the same path (one
      # machine), but on a local filesystem, which libvirt cannot tell from
      # unshared storage.
      # GUEST_LIVE=1 (by hand, not in ctest): --live, to see what live
      # precopy does to this guest here.
      migrate "${from}" "${to}" "${dom}" "real_guest${GUEST_LIVE:+_live}" --unsafe ${GUEST_LIVE:+--live} ||
        fail "virsh migrate of the guest ${from} -> ${to}: $(cat "${work}/migrate.out")"
      # From the log too: the first foreign region of a channel is logged.
      wait_until 60 logged_since "${to}" "${log_lines}" "event=foreign_region_reset vm=${dom} " ||
        fail "${to}'s tmemd counted no foreign region for the guest"
      wait_until 60 is_field "${from}" "${dom}" connected false ||
        fail "${from}'s tmemd still sees the guest's QEMU"
      is_field "${from}" "${dom}" pages 0 || fail "${from}'s tmemd still holds pages of the guest"
      # The guest's after-round rereads hit on the destination. Read from
      # the destination's per-second vm_stats lines since the migration:
      # after the last round the guest may finish, and its channel be made
      # again empty, before tmemctl would be asked.
      wait_until 600 stats_rose "${to}" "${dom}" "${log_lines}" gets_hit "${hits_before}" ||
        fail "no get hit for the guest on ${to} within 10 min of round ${round}"
      wait_until 60 stats_rose "${to}" "${dom}" "${log_lines}" puts 0 ||
        fail "no put from the guest on ${to} after round ${round}"
      log "   on ${to}: foreign region counted, guest puts and get hits (${stat_seen}); ${from}: released, 0 pages"
    fi
    sleep 1
  done
  wait_until 900 grep -aq "TMEMTEST DONE" "${serial}" || fail "the guest did not finish within 15 min of the last round"
  grep -aE 'TMEMTEST (CHECK (restart|after)|DONE)' "${serial}" | sed 's/^/   [guest] /' | grep -v 'PASS' | head -20
  grep -aq "TMEMTEST DONE fails=0" "${serial}" ||
    fail "the guest reports failures: $(grep -a 'CHECK .* FAIL' "${serial}" | head -5)"
  grep -aqE 'Kernel panic|BUG:|Oops|WARNING:' "${serial}" && fail "the guest kernel logged BUG/WARNING/Oops"
  log "real guest: 3 virsh migrations, $(grep -ac 'TMEMTEST CHECK .* PASS' "${serial}") guest checks passed, DONE fails=0"
  log "PASS"
}

mkdir -m 0755 "${sockdir}" || fail "cannot make ${sockdir}"
uuid_a=6a3b0d8e-5f2c-4c1e-9b7a-0000000000aa uuid_b=6a3b0d8e-5f2c-4c1e-9b7a-0000000000bb
# Without it each libvirtd re-probes QEMU for every domain (~35 s each).
"${src}/scripts/kvm-device-mode.sh"
start_host A "${uuid_a}" 49300
start_host B "${uuid_b}" 49320
host_ready A "${uuid_a}"
host_ready B "${uuid_b}"

((real_guest)) && {
  real_guest_test
  exit 0
}

log "0. role='master' alone (as the glue writes it): what virsh migrate says"
domain_xml "${transient}" "$(cat /proc/sys/kernel/random/uuid)" 1 0 >"${work}/t0.xml"
vsh A create "${work}/t0.xml" >/dev/null || fail "virsh create on A failed"
wait_until 30 is_field A "${transient}" connected true || fail "QEMU did not connect to A's tmemd"
if migrate A B "${transient}" role_master_only; then
  log "   migrated (this libvirt passes role='master' to QEMU)"
  vsh B destroy "${transient}" >/dev/null
else
  log "   refused: $(tr '\n' ' ' <"${work}/migrate.out")"
  vsh A destroy "${transient}" >/dev/null
fi
wait_until 30 is_field A "${transient}" connected absent || fail "A's tmemd kept ${transient}'s channel after destroy"
wait_until 30 is_field B "${transient}" connected absent || fail "B's tmemd kept ${transient}'s channel"

log "1. persistent domain ${persistent}, defined on A and on B first"
domain_xml "${persistent}" "$(cat /proc/sys/kernel/random/uuid)" 1 >"${work}/p.xml"
for h in A B; do
  vsh "${h}" define "${work}/p.xml" >/dev/null || fail "virsh define on ${h} failed"
  wait_until 15 is_field "${h}" "${persistent}" connected false ||
    fail "${h}'s tmemd made no channel for the defined ${persistent}"
done
vsh A start "${persistent}" >/dev/null || fail "virsh start on A failed"
wait_until 30 is_field A "${persistent}" connected true || fail "QEMU did not connect to A's tmemd"
ctl A set-quota "${persistent}" 48MiB >/dev/null || fail "tmemctl set-quota on A failed"
[[ "$(vsh A metadata "${persistent}" https://tmemd.dev/xmlns/tmem/1 --live)" == *"<quota>"* ]] ||
  fail "the quota set on A is not in the live metadata"
there_and_back "${persistent}" 1 with_tmem

log "2. transient domain ${transient} (virsh create on A; B's socket from B's hook)"
domain_xml "${transient}" "$(cat /proc/sys/kernel/random/uuid)" 1 >"${work}/t.xml"
vsh A create "${work}/t.xml" >/dev/null || fail "virsh create on A failed"
wait_until 30 is_field A "${transient}" connected true || fail "QEMU did not connect to A's tmemd"
is_field B "${transient}" connected absent || fail "B's tmemd has ${transient} before the migration"
ctl A set-quota "${transient}" 48MiB >/dev/null || fail "tmemctl set-quota on A failed"
there_and_back "${transient}" 0 with_tmem_transient
grep -q "event=libvirt_hook_prepared.*${transient}" "${work}/B/tmemd.log" ||
  fail "B's tmemd log has no libvirt_hook_prepared for ${transient}"
vsh A destroy "${transient}" >/dev/null

log "3. the same domain without the tmem device, for the migration time"
domain_xml "${plain}" "$(cat /proc/sys/kernel/random/uuid)" 0 >"${work}/n.xml"
vsh A create "${work}/n.xml" >/dev/null || fail "virsh create ${plain} on A failed"
for hop in A:B B:A; do
  migrate "${hop%:*}" "${hop#*:}" "${plain}" without_tmem ||
    fail "virsh migrate ${plain} ${hop}: $(cat "${work}/migrate.out")"
done
vsh A destroy "${plain}" >/dev/null

log "4. tmemctl attach --persistent (the glue writes master=on as a <qemu:override>): migrates after a restart"
domain_xml "${glued}" "$(cat /proc/sys/kernel/random/uuid)" 0 >"${work}/u.xml"
vsh A define "${work}/u.xml" >/dev/null || fail "virsh define ${glued} on A failed"
vsh A start "${glued}" >/dev/null || fail "virsh start ${glued} on A failed"
out="$(ctl A attach --persistent "${glued}" 2>&1)" || fail "tmemctl attach --persistent ${glued}: ${out}"
log "   tmemctl attach: ${out}"
[[ "${out}" == *"migratable from the next start"* ]] || fail "tmemctl attach does not say when ${glued} becomes migratable"
inactive="$(vsh A dumpxml --inactive "${glued}")"
[[ "${inactive}" == *"<qemu:property name='master' type='string' value='on'/>"* && "${inactive}" == *"<alias name='ua-tmem0'/>"* ]] ||
  fail "the persistent definition of ${glued} lacks the device's alias or the master=on override: ${inactive}"
if migrate A B "${glued}" glue_hotplugged; then
  log "   the hot-plugged device migrated (this libvirt passes role='master' on hot-plug)"
  migrate B A "${glued}" glue_hotplugged_back || fail "virsh migrate ${glued} B -> A: $(cat "${work}/migrate.out")"
else
  log "   hot-plugged device (before a restart), as expected refused: $(tr '\n' ' ' <"${work}/migrate.out")"
fi
vsh A destroy "${glued}" >/dev/null || fail "virsh destroy ${glued} failed"
vsh A start "${glued}" >/dev/null || fail "virsh start ${glued} (restart) failed"
wait_until 30 is_field A "${glued}" connected true || fail "QEMU did not connect to A's tmemd after the restart"
before="$(vm_field B "${glued}" foreign_regions)"
[[ "${before}" == absent ]] && before=0
migrate A B "${glued}" glue_attached ||
  fail "virsh migrate ${glued} A -> B after attach --persistent and a restart: $(cat "${work}/migrate.out")"
wait_until 30 is_field B "${glued}" connected true || fail "QEMU on B did not connect to B's tmemd"
wait_until 30 more_than B "${glued}" foreign_regions "${before}" || fail "B's tmemd counted no foreign region for ${glued}"
migrate B A "${glued}" glue_attached || fail "virsh migrate ${glued} B -> A: $(cat "${work}/migrate.out")"
wait_until 30 is_field A "${glued}" connected true || fail "QEMU did not connect to A's tmemd after coming back"
out="$(ctl A detach --persistent "${glued}" 2>&1)" || fail "tmemctl detach --persistent ${glued}: ${out}"
[[ "$(vsh A dumpxml --inactive "${glued}")" != *"ua-tmem0"* ]] ||
  fail "the persistent definition of ${glued} keeps tmem's device or override after detach --persistent"
vsh A destroy "${glued}" >/dev/null
vsh A undefine "${glued}" >/dev/null
log "   migrated A -> B -> A with the device the glue wrote; detach --persistent took device and override out"

log "5. a domain with a tmemd swap device (tmemctl attach --swap) does not migrate"
swapped="tmemd-mig-s-${tag}"
domain_xml "${swapped}" "$(cat /proc/sys/kernel/random/uuid)" 0 >"${work}/s.xml"
vsh A define "${work}/s.xml" >/dev/null || fail "virsh define ${swapped} on A failed"
out="$(ctl A attach --swap 16MiB "${swapped}" 2>&1)" || fail "tmemctl attach --swap ${swapped}: ${out}"
vsh A start "${swapped}" >/dev/null || fail "virsh start ${swapped} (with its swap disk) on A failed"
# Running: QEMU 7.2 blocks it on the source already (tmemd's back-end does
# not offer dirty logging, VHOST_USER_PROTOCOL_F_LOG_SHMFD), before B's
# hook could run; B's hook refuses it when nothing on the source does.
if migrate A B "${swapped}" swap_refused; then
  fail "a domain with a tmemd swap device migrated A -> B"
fi
grep -q -e "domain '${swapped}' has a tmemd swap device" -e "VHOST_USER_PROTOCOL_F_LOG_SHMFD" "${work}/migrate.out" ||
  fail "virsh migrate of ${swapped} failed for another reason: $(cat "${work}/migrate.out")"
log "   running, refused: $(tr '\n' ' ' <"${work}/migrate.out")"
[[ "$(vsh A domstate "${swapped}")" == running ]] || fail "${swapped} is not running on A after the refused migration"
vsh B dominfo "${swapped}" >/dev/null 2>&1 && fail "the refused domain ${swapped} exists on B"
# --offline (the definition only): nothing on the source refuses; B's hook
# does, naming the domain.
if vsh A migrate --offline --persistent "${swapped}" "$(uri B)" >"${work}/migrate.out" 2>&1; then
  fail "B's migrate hook let ${swapped} (tmemd swap device) migrate --offline"
fi
grep -q "domain '${swapped}' has a tmemd swap device" "${work}/migrate.out" ||
  fail "virsh migrate --offline does not show B's hook's reason: $(cat "${work}/migrate.out")"
grep -q "event=libvirt_migration_refused.*${swapped}" "${work}/B/tmemd.log" ||
  fail "B's tmemd log has no libvirt_migration_refused for ${swapped}"
vsh B dominfo "${swapped}" >/dev/null 2>&1 && fail "the refused domain ${swapped} is defined on B"
log "   --offline, refused by B's hook: $(tr '\n' ' ' <"${work}/migrate.out")"
vsh A destroy "${swapped}" >/dev/null
ctl A detach --swap "${swapped}" >/dev/null || fail "tmemctl detach --swap ${swapped} failed"
vsh A undefine "${swapped}" >/dev/null

log "6. virsh migrate --live (printed, not asserted: live precopy under TCG is unreliable here)"
before="$(vm_field B "${persistent}" foreign_regions)"
if migrate A B "${persistent}" live_with_tmem --live; then
  if wait_until 30 more_than B "${persistent}" foreign_regions "${before}" &&
    is_field B "${persistent}" connected true; then
    log "   --live: migrated; B's tmemd connected, counted the foreign region"
  else
    log "   --live: migrated, but B's tmemd: connected=$(vm_field B "${persistent}" connected) foreign_regions=$(vm_field B "${persistent}" foreign_regions)"
  fi
else
  log "   --live: refused or failed: $(tr '\n' ' ' <"${work}/migrate.out")"
fi
log "PASS"
