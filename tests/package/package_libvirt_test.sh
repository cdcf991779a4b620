#!/usr/bin/env bash
# The operator's install chain, end to end on this machine (ctest
# `package_libvirt_test`, release build only; needs root, libvirtd and no
# tmemd package installed already). The commands are README's "Install"
# section, in its order:
#   1. cpack builds tmemd_VERSION_ARCH.deb; `apt install ./tmemd_*.deb`;
#   2. the tmemd user cannot use qemu:///system (polkit denies it) until
#      `adduser tmemd libvirt`, then it can (docs/install.md says why);
#   3. `[libvirt] uri = "qemu:///system"` appended to the installed
#      /etc/tmemd/tmemd.toml passes `tmemd --check-config`;
#   4. libvirtd restarted (it reads the package's qemu hook at start), a
#      small persistent domain defined and started (`virsh define`,
#      `virsh start`; diskless, no guest OS);
#   5. the installed /usr/sbin/tmemd started as the unit says (User=tmemd,
#      ExecStart=, no capabilities: tests/package/notify_harness.py, since
#      systemd is not PID 1 here), its libvirt glue on the real system
#      libvirtd; then, as the operator (root): `tmemctl attach DOMAIN`,
#      QEMU runs as user libvirt-qemu, the socket is tmemd:libvirt-qemu
#      0660, `tmemctl vms` lists the domain connected; `tmemctl detach`,
#      `virsh destroy`: the VM leaves `tmemctl vms`;
#   6. `dpkg -r`, `dpkg --purge`: the package's files are gone.
# The EXIT trap undoes everything (domain, package, the tmemd user and its
# libvirt membership if this test made them, directories), and restarts
# libvirtd once the package's hook is gone, so that it forgets the hook.
# Exit 77 (skipped, reason printed) only when dpkg/apt, libvirtd or QEMU
# are not available here.
#
# Usage: package_libvirt_test.sh BUILD_DIR SOURCE_DIR
#        package_libvirt_test.sh --attach DOMAIN   (step 5's operator part,
#                                                   run by the harness)
set -euo pipefail

step() { printf '\n=== package_libvirt_test: %s\n' "$*"; }
die() { printf 'package_libvirt_test: FAIL: %s\n' "$*" >&2; exit 1; }
skip() { printf 'package_libvirt_test: SKIP: %s\n' "$*"; exit 77; }
virsh_sys() { virsh -c qemu:///system "$@"; }

# Runs COMMAND ARGS every 0.2 s until it succeeds, for up to $1 seconds.
wait_for() {
  local seconds="$1"; shift
  local i
  for ((i = 0; i < seconds * 5; i++)); do
    if "$@"; then return 0; fi
    sleep 0.2
  done
  return 1
}

# JSON of `tmemctl -o json vms` on stdin: "yes" when VM $1 is connected,
# "no" when listed but not connected, "absent" otherwise.
vm_state() {
  python3 -c '
import json, sys
vms = json.load(sys.stdin).get("vms", [])
hit = [v for v in vms if v.get("name") == sys.argv[1]]
print("absent" if not hit else ("yes" if hit[0].get("connected") else "no"))
' "$1"
}

# --- step 5's operator part: runs once the installed tmemd sent READY=1 ---
if [[ "${1:-}" == "--attach" ]]; then
  name="$2" tmemd_pid="$3"
  # tmemd as the unit runs it: user tmemd, the admin socket its own, and
  # its supplementary groups from the group database (systemd's User=):
  # libvirt-qemu for the sockets, libvirt for qemu:///system.
  [[ "$(stat -c %U:%G:%a /run/tmemd/control.sock)" == tmemd:tmemd:600 ]] \
    || die "control.sock is $(stat -c %U:%G:%a /run/tmemd/control.sock)"
  tmemd_groups="$(ps -o supgrp= -p "${tmemd_pid}")"
  echo "tmemd pid ${tmemd_pid}: user $(ps -o user= -p "${tmemd_pid}"), groups ${tmemd_groups}"
  for g in libvirt libvirt-qemu; do
    tr ',' '\n' <<<"${tmemd_groups// /}" | grep -qx "${g}" || die "tmemd is not running in group ${g}"
  done

  step "tmemctl attach ${name}"
  /usr/bin/tmemctl attach "${name}" || die "tmemctl attach ${name} failed"
  uuid="$(virsh_sys domuuid "${name}" | tr -d '[:space:]')"
  sock="/run/tmemd/${uuid}.sock"
  xml="$(virsh_sys dumpxml "${name}")"
  grep -A4 '<shmem' <<<"${xml}" || die "no <shmem> in the live XML after attach"
  grep -q "<server path='${sock}'/>" <<<"${xml}" || die "the device does not name ${sock}"
  vm_is() { [[ "$(/usr/bin/tmemctl -o json vms | vm_state "${name}")" == "$1" ]]; }
  wait_for 30 vm_is yes \
    || { /usr/bin/tmemctl vms; die "tmemctl vms does not list ${name} connected within 30 s"; }
  table="$(/usr/bin/tmemctl vms)"
  printf '$ tmemctl vms\n%s\n' "${table}"
  grep -qE "^${name} +yes " <<<"${table}" || die "the table of tmemctl vms lacks '${name} yes'"

  # QEMU unprivileged, as libvirt's default qemu.conf runs it.
  qemu_pid="$(cat "/run/libvirt/qemu/${name}.pid")"
  qemu_user="$(ps -o user= -p "${qemu_pid}" | tr -d ' ')"
  qemu_groups="$(ps -o group=,supgrp= -p "${qemu_pid}")"
  echo "QEMU pid ${qemu_pid}: user ${qemu_user}, groups ${qemu_groups}"
  [[ "${qemu_user}" == libvirt-qemu ]] || die "QEMU runs as ${qemu_user}, not libvirt-qemu"
  sock_owner="$(stat -c %U:%G:%a "${sock}")"
  echo "${sock}: ${sock_owner}"
  [[ "${sock_owner}" == tmemd:libvirt-qemu:660 ]] \
    || die "${sock} is ${sock_owner}, expected tmemd:libvirt-qemu:660"

  step "tmemctl detach ${name}, virsh destroy ${name}"
  # No guest OS acks the ACPI unplug, so the device stays until the domain
  # stops (docs/libvirt.md, "Detach is asynchronous").
  /usr/bin/tmemctl detach "${name}" || die "tmemctl detach ${name} failed"
  virsh_sys destroy "${name}" >/dev/null || die "virsh destroy ${name} failed"
  wait_for 30 vm_is absent \
    || { /usr/bin/tmemctl vms; die "${name} still in tmemctl vms 30 s after destroy"; }
  # The VM leaves the list before its channel is torn down (the socket is
  # unlinked as the channel goes).
  gone() { [[ ! -e "$1" ]]; }
  wait_for 30 gone "${sock}" || die "${sock} left 30 s after the domain stopped"
  echo "${name} left tmemctl vms, its socket is gone"
  exit 0
fi

build_dir="$(cd "$1" && pwd)"
source_dir="$(cd "$2" && pwd)"
self="${source_dir}/tests/package/package_libvirt_test.sh"
harness="${source_dir}/tests/package/notify_harness.py"

((EUID == 0)) || die "needs root (apt install, a system user, libvirtd)"
for tool in dpkg apt; do
  command -v "${tool}" >/dev/null || skip "no ${tool}: not a Debian host"
done
for tool in cpack setpriv python3 virsh; do
  command -v "${tool}" >/dev/null || die "missing tool: ${tool} (scripts/install-deps.sh installs it)"
done
[[ -x /usr/bin/qemu-system-x86_64 ]] || skip "no /usr/bin/qemu-system-x86_64"
getent group libvirt >/dev/null || skip "no group libvirt (libvirt-daemon-system not installed)"
getent group libvirt-qemu >/dev/null || skip "no group libvirt-qemu (libvirt-daemon-system not installed)"
"${source_dir}/scripts/start-libvirtd.sh" || skip "libvirtd cannot run here (scripts/start-libvirtd.sh failed)"
if dpkg-query -W -f='${db:Status-Abbrev}' tmemd 2>/dev/null | grep -q '^[ihUFWt]'; then
  die "a tmemd package is already installed here; this test would replace it (dpkg --purge tmemd first)"
fi

work="$(mktemp -d /tmp/tmemd-package-libvirt.XXXXXX)"
name="tmemd-pkg-test-$$"
user_existed=0
getent passwd tmemd >/dev/null && user_existed=1
group_existed=0
getent group tmemd >/dev/null && group_existed=1
in_libvirt_before=0
id -nG tmemd 2>/dev/null | tr ' ' '\n' | grep -qx libvirt && in_libvirt_before=1
for d in /run/tmemd /var/lib/tmemd /etc/tmemd; do
  [[ ! -e "${d}" ]] || die "${d} exists already (left by an earlier run?); remove it first"
done
libvirtd_saw_hook=0

cleanup() {
  local rc=$?
  set +e
  virsh_sys destroy "${name}" >/dev/null 2>&1
  virsh_sys undefine "${name}" >/dev/null 2>&1
  if dpkg-query -W tmemd >/dev/null 2>&1; then
    echo "package_libvirt_test: cleanup: purging tmemd"
    dpkg --purge tmemd >/dev/null 2>&1
  fi
  if ((!in_libvirt_before)) && id -nG tmemd 2>/dev/null | tr ' ' '\n' | grep -qx libvirt; then
    deluser --quiet tmemd libvirt >/dev/null 2>&1
  fi
  ((user_existed)) || { getent passwd tmemd >/dev/null && deluser --quiet --system tmemd >/dev/null 2>&1; }
  ((group_existed)) || { getent group tmemd >/dev/null && delgroup --quiet --system tmemd >/dev/null 2>&1; }
  rm -rf /run/tmemd /var/lib/tmemd /etc/tmemd
  # libvirtd read the package's hook when it started: forget it.
  ((libvirtd_saw_hook)) && "${source_dir}/scripts/start-libvirtd.sh" --restart >/dev/null
  rm -rf "${work}"
  exit "${rc}"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

t_start=${SECONDS}
# --- 1. build and install -----------------------------------------------
step "cpack -G DEB"
cpack --config "${build_dir}/CPackConfig.cmake" -G DEB -B "${work}/out" >"${work}/cpack.log" 2>&1 \
  || { cat "${work}/cpack.log"; die "cpack failed"; }
debs=("${work}"/out/tmemd_*.deb)
((${#debs[@]} == 1)) && [[ -f "${debs[0]}" ]] || die "expected one tmemd_*.deb, got: ${debs[*]}"
deb="${debs[0]}"
echo "built $(basename "${deb}") in $((SECONDS - t_start)) s"

step "apt install ./$(basename "${deb}")"
t0=${SECONDS}
# Offline: every dependency is installed already (scripts/install-deps.sh),
# so apt only resolves them and runs dpkg.
(cd "${work}/out" && apt install -y "./$(basename "${deb}")") </dev/null 2>&1 | grep -v '^WARNING: apt does not have a stable CLI' \
  || true
[[ "$(dpkg-query -W -f='${db:Status-Abbrev}' tmemd 2>/dev/null)" == "ii " ]] || die "apt did not install tmemd"
echo "installed in $((SECONDS - t0)) s"
id -nG tmemd | tr ' ' '\n' | grep -qx libvirt-qemu \
  || die "the postinst did not add tmemd to group libvirt-qemu (groups: $(id -nG tmemd))"
echo "tmemd's groups after install: $(id -nG tmemd)"

# --- 2. qemu:///system for the tmemd user -----------------------------------
step "the tmemd user and qemu:///system (polkit, group libvirt)"
as_tmemd=(setpriv --reuid=tmemd --regid=tmemd --init-groups)
if ((in_libvirt_before)); then
  echo "tmemd was in group libvirt before this test: the refusal is not checked"
else
  if out="$("${as_tmemd[@]}" timeout 30 virsh -c qemu:///system list --name 2>&1)"; then
    die "the tmemd user reached qemu:///system without group libvirt (libvirtd.conf not the default?): ${out}"
  fi
  echo "before adduser: ${out//$'\n'/ }"
  [[ "${out}" == *polkit* ]] || die "refused, but not by polkit: ${out}"
fi
adduser tmemd libvirt
out="$("${as_tmemd[@]}" timeout 30 virsh -c qemu:///system list --name 2>&1)" \
  || die "the tmemd user cannot use qemu:///system after adduser tmemd libvirt: ${out}"
echo "after adduser tmemd libvirt: virsh as tmemd works"

# --- 3. the config ------------------------------------------------------------
step "[libvirt] uri in /etc/tmemd/tmemd.toml"
printf '\n[libvirt]\nuri = "qemu:///system"\n' >>/etc/tmemd/tmemd.toml
/usr/sbin/tmemd --check-config /etc/tmemd/tmemd.toml || die "the edited config fails --check-config"

# --- 4. libvirtd and a domain ---------------------------------------------------
step "libvirtd restarted (the package's qemu hook), a domain defined and started"
libvirtd_saw_hook=1
"${source_dir}/scripts/start-libvirtd.sh" --restart || die "libvirtd did not restart"
# The smallest domain tmem can hot-plug into: machine pc with ACPI
# (docs/libvirt.md), no disk, no guest OS (SeaBIOS finds nothing to boot).
cat >"${work}/${name}.xml" <<EOF
<domain type='qemu'>
  <name>${name}</name>
  <memory unit='MiB'>64</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='pc'>hvm</type></os>
  <features><acpi/></features>
  <devices><emulator>/usr/bin/qemu-system-x86_64</emulator><memballoon model='none'/></devices>
</domain>
EOF
virsh_sys define "${work}/${name}.xml"
virsh_sys start "${name}"

# --- 5. tmemd as the unit runs it, and the operator's commands ------------------
step "the installed tmemd under the unit's command line, libvirt glue on qemu:///system"
t0=${SECONDS}
python3 "${harness}" /lib/systemd/system/tmemd.service \
  --watchdog-sec 3 \
  --after-ready "bash ${self} --attach ${name} \$MAINPID" \
  || die "the installed tmemd did not serve the libvirt domain"
echo "tmemd run, attach, detach, destroy: $((SECONDS - t0)) s"
virsh_sys undefine "${name}" >/dev/null

# --- 6. remove, purge -------------------------------------------------------------
step "dpkg -r tmemd, dpkg --purge tmemd"
dpkg -r tmemd
dpkg --purge tmemd
for f in /usr/sbin/tmemd /usr/bin/tmemctl /lib/systemd/system/tmemd.service /etc/tmemd \
         /var/lib/tmemd /run/tmemd /etc/libvirt/hooks/qemu.d/tmemd; do
  [[ ! -e "${f}" ]] || die "${f} left after dpkg --purge"
done
if dpkg-query -W tmemd >/dev/null 2>&1; then die "dpkg still knows tmemd after --purge"; fi
echo "purged"

printf '\npackage_libvirt_test: PASS (%d s)\n' "$((SECONDS - t_start))"
