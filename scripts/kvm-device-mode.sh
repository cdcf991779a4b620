#!/usr/bin/env bash
# Gives /dev/kvm Debian's mode (root:kvm 0660, from udev's rule for it) when
# it has root:root 0600, as on this machine kind, where no udev runs.
#
# Why the libvirt tests need it: libvirtd probes QEMU's capabilities with
# accel=kvm:tcg, and the probe gets KVM (it opens /dev/kvm before dropping
# to user libvirt-qemu); then, before every use of the cached capabilities,
# libvirtd checks that libvirt-qemu can open /dev/kvm, finds it cannot, calls
# the cache outdated and probes again: about 18 QEMU launches, ~35 s, for
# every domain started, defined or migrated. The domains themselves stay
# TCG (type='qemu'); KVM is never required (nested guests hang here).
#
# Usage: scripts/kvm-device-mode.sh   (root; prints what it did)
set -uo pipefail
dev=/dev/kvm
[[ -c "${dev}" ]] || exit 0
getent group kvm >/dev/null || exit 0
read -r owner group mode < <(stat -c '%U %G %a' "${dev}")
if [[ "${group}" == root && "${mode}" == 600 ]]; then
  if chgrp kvm "${dev}" && chmod 0660 "${dev}"; then
    echo "[kvm-device-mode] ${dev}: ${owner}:${group} ${mode} -> ${owner}:kvm 660 (Debian's udev default)"
  else
    echo "[kvm-device-mode] note: could not set ${dev} to root:kvm 0660; libvirt re-probes QEMU on every domain start" >&2
  fi
fi
exit 0
