#!/usr/bin/env bash
# Builds (or finds in the cache) everything a test guest needs and prints it
# as shell assignments: KERNEL=... INITRD=... MODULE=...
# The kernel build takes ~12-20 min on 2 cores when the cache is cold.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
kdir="$("${VM_DIR}/build-kernel.sh")"
ko="$("${VM_DIR}/build-module.sh")"
initrd="$("${VM_DIR}/build-initramfs.sh")"
printf 'KERNEL=%q\nINITRD=%q\nMODULE=%q\n' "${kdir}/bzImage" "${initrd}" "${ko}"
