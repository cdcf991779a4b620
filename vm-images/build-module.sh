#!/usr/bin/env bash
# Builds guest-driver/tmem_ivshmem.ko against the cached guest kernel (out of
# the source tree: sources are copied to the cache, keyed by the kernel and
# a hash of the driver sources). Checks kernel style with checkpatch.pl.
# Prints the .ko path on stdout.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

kdir="$("${VM_DIR}/build-kernel.sh")"
repo="$(cd "${VM_DIR}/.." && pwd)"
# The guest core is every C file and header in guest-driver/core/ (Kbuild
# names its objects; CMake checks it builds the same ones).
core=("${repo}"/guest-driver/core/*.[ch])
srcs=("${repo}/guest-driver/tmem_ivshmem_main.c" "${repo}/guest-driver/Kbuild"
      "${core[@]}" "${repo}/proto/tmem_abi.h")
key="$(basename "${kdir}")-$(cat "${srcs[@]}" | sha256sum | cut -c1-12)"
out="${CACHE_DIR}/module-${key}"
if [[ -f "${out}/tmem_ivshmem.ko" ]]; then
  vmlog "module cached: ${out}/tmem_ivshmem.ko"
  echo "${out}/tmem_ivshmem.ko"
  exit 0
fi
rm -rf "${out}.tmp"
mkdir -p "${out}.tmp/guest-driver/core" "${out}.tmp/proto"
cp "${repo}/guest-driver/tmem_ivshmem_main.c" "${repo}/guest-driver/Kbuild" "${out}.tmp/guest-driver/"
cp "${core[@]}" "${out}.tmp/guest-driver/core/"
cp "${repo}/proto/tmem_abi.h" "${out}.tmp/proto/"
vmlog "checkpatch.pl --no-tree -f on the module and the guest core"
perl "${kdir}/linux/scripts/checkpatch.pl" --no-tree --terse -f \
  "${out}.tmp/guest-driver/tmem_ivshmem_main.c" "${out}.tmp"/guest-driver/core/*.[ch] \
  >&2 || die "checkpatch found style problems"
vmlog "building tmem_ivshmem.ko against $(basename "${kdir}")"
make -C "${kdir}/linux" M="${out}.tmp/guest-driver" W=1 modules \
  >"${out}.tmp/build.log" 2>&1 || { cat "${out}.tmp/build.log" >&2; die "module build failed"; }
if grep -E 'warning:' "${out}.tmp/build.log" >&2; then die "module build has warnings"; fi
cp "${out}.tmp/guest-driver/tmem_ivshmem.ko" "${out}.tmp/"
rm -rf "${out}"
mv "${out}.tmp" "${out}"
echo "${out}/tmem_ivshmem.ko"
