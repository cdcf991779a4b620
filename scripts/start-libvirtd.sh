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
# as root; it is removed here (and libvirtd restarted) when found.
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

running() { pgrep -x libvirtd >/dev/null 2>&1; }
answers() { timeout 10 virsh -c qemu:///system version >/dev/null 2>&1; }

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
