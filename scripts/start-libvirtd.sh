#!/usr/bin/env bash
# Starts libvirtd (and virtlogd) for tmemd's libvirt tests, without systemd.
# Idempotent: does nothing when a libvirtd already answers on
# qemu:///system. Exit 0 when `virsh -c qemu:///system version` works at the
# end, 1 otherwise (the tests then skip, saying why).
#
# The tests run with libvirt's default qemu.conf, as a production Debian
# host does: QEMU as user libvirt-qemu (group libvirt-qemu), dynamic
# ownership on, stdio through virtlogd, the default security driver (this
# machine has no AppArmor or SELinux, so that is DAC only). tmemd hands its
# sockets to QEMU through their group (docs/libvirt.md, "Unprivileged
# QEMU"). Earlier versions of this script appended a block making QEMU run
# as root; it is removed here (and libvirtd restarted) when found. The
# system D-Bus is started too when missing, so that libvirtd authorizes
# non-root clients through polkit as on a stock host (below).
#
# Usage: scripts/start-libvirtd.sh [--restart]
set -uo pipefail

log() { printf '[start-libvirtd] %s\n' "$*"; }

restart=0
[[ "${1:-}" == "--restart" ]] && restart=1

if ! command -v libvirtd >/dev/null 2>&1 || ! command -v virsh >/dev/null 2>&1; then
  log "libvirtd/virsh not installed (scripts/install-deps.sh installs them)"
  exit 1
fi

sudo_cmd=()
if ((EUID != 0)); then
  if command -v sudo >/dev/null 2>&1; then sudo_cmd=(sudo); else
    log "need root to run libvirtd for qemu:///system"; exit 1
  fi
fi

conf=/etc/libvirt/qemu.conf
begin='# BEGIN tmemd tests (scripts/start-libvirtd.sh)'
end='# END tmemd tests'
if grep -qF "${begin}" "${conf}" 2>/dev/null; then
  log "removing the old test block (QEMU as root) from ${conf}"
  "${sudo_cmd[@]}" sed -i "\|^${begin}\$|,\|^${end}\$|d" "${conf}"
  restart=1
fi
if grep -Eq '^[[:space:]]*(user|group|dynamic_ownership|security_driver)[[:space:]]*=' \
    "${conf}" 2>/dev/null; then
  log "note: ${conf} overrides user/group/dynamic_ownership/security_driver;" \
      "the tests expect libvirt's defaults"
fi

# Non-root clients of qemu:///system (tmemd runs as user tmemd) are
# authorized by polkit over the system D-Bus: libvirt's default
# auth_unix_rw is "polkit", and Debian's
# /usr/share/polkit-1/rules.d/60-libvirt.rules allows group libvirt. On a
# real host systemd starts the bus; here it is started when missing (polkitd
# is then bus-activated by dbus-daemon, as on Debian), and libvirtd is
# restarted: it looks for the bus once and keeps the failure ("Unable to get
# system bus connection") for its lifetime.
bus_answers() {
  dbus-send --system --dest=org.freedesktop.DBus --type=method_call \
    --print-reply / org.freedesktop.DBus.GetId >/dev/null 2>&1
}
if ! command -v dbus-daemon >/dev/null 2>&1 || ! command -v dbus-send >/dev/null 2>&1; then
  log "note: no dbus-daemon/dbus-send: libvirtd cannot ask polkit, only root may use qemu:///system"
elif ! bus_answers; then
  pid_file=/run/dbus/pid
  if [[ -f "${pid_file}" ]] && ! pgrep -x dbus-daemon >/dev/null 2>&1; then
    "${sudo_cmd[@]}" rm -f "${pid_file}"  # stale: dbus-daemon refuses to start over it
  fi
  log "starting the system D-Bus (dbus-daemon --system) for libvirtd's polkit checks"
  "${sudo_cmd[@]}" mkdir -p /run/dbus
  if "${sudo_cmd[@]}" dbus-daemon --system --fork && bus_answers; then
    restart=1
  else
    log "note: the system D-Bus did not start: only root may use qemu:///system"
  fi
fi

# Without it libvirtd re-probes QEMU for every domain (scripts/kvm-device-mode.sh).
"${sudo_cmd[@]}" "$(dirname "$0")/kvm-device-mode.sh"

running() { pgrep -x libvirtd >/dev/null 2>&1; }
answers() { timeout 10 virsh -c qemu:///system version >/dev/null 2>&1; }

# A libvirtd started before the bus existed never asks polkit: an
# unprivileged probe (user nobody, which polkit denies either way) shows it.
if ((!restart)) && running && bus_answers && ((EUID == 0)) &&
    timeout 10 setpriv --reuid=nobody --regid=nogroup --clear-groups \
      virsh -c qemu:///system version 2>&1 | grep -q 'system bus'; then
  log "libvirtd started before the system D-Bus: restarting it"
  restart=1
fi
if ((restart)) && running; then
  log "stopping the running libvirtd (pid $(pgrep -x libvirtd | tr '\n' ' '))"
  "${sudo_cmd[@]}" kill -TERM $(pgrep -x libvirtd)
  for _ in $(seq 50); do running || break; sleep 0.1; done
fi

if running && answers; then
  log "libvirtd already running and answering on qemu:///system"
  exit 0
fi

pgrep -x virtlogd >/dev/null 2>&1 || "${sudo_cmd[@]}" virtlogd -d
if ! running; then
  "${sudo_cmd[@]}" mkdir -p /run/libvirt
  "${sudo_cmd[@]}" libvirtd -d
fi
for _ in $(seq 100); do
  if answers; then
    log "libvirtd is up: $(virsh -c qemu:///system version 2>/dev/null | grep -i 'running hypervisor' || true)"
    exit 0
  fi
  sleep 0.2
done
log "libvirtd does not answer on qemu:///system after 20 s"
exit 1
