#!/usr/bin/env bash
# Starts libvirtd (and virtlogd) for tmemd's libvirt tests, without systemd.
# Idempotent: does nothing when a libvirtd already answers on
# qemu:///system. Exit 0 when `virsh -c qemu:///system version` works at the
# end, 1 otherwise (the tests then skip, saying why).
#
# Test settings go into /etc/libvirt/qemu.conf inside a marked block (libvirt
# 9.0 has no qemu.conf.d): QEMU runs as root so it can reach tmemd's sockets
# wherever a test puts them, logs go to files (no virtlogd dependency for
# stdio), and no security driver relabels or confines the test sockets
# (libvirt does not add a hot-attached socket to an AppArmor profile).
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
if ! grep -qF "${begin}" "${conf}" 2>/dev/null; then
  log "adding the test block to ${conf}"
  "${sudo_cmd[@]}" tee -a "${conf}" >/dev/null <<CONF
${begin}
user = "root"
group = "root"
dynamic_ownership = 0
stdio_handler = "file"
security_driver = "none"
namespaces = []
${end}
CONF
  restart=1
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
