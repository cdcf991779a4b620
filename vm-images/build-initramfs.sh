#!/usr/bin/env bash
# Builds the test guest's initramfs: busybox (Debian busybox-static), the
# tmem_ivshmem.ko module, the pagecheck tool and guest/init.sh as /init.
# Cached by a hash of its inputs. Prints the .cpio.gz path on stdout.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

ko="$("${VM_DIR}/build-module.sh")"
busybox="$(command -v busybox || true)"
[[ -x "${busybox}" ]] || die "busybox not found (apt-get install busybox-static)"
file -L "${busybox}" 2>/dev/null | grep -q 'statically linked' ||
  ldd "${busybox}" 2>&1 | grep -q 'not a dynamic' || die "${busybox} is not static (busybox-static)"
key="$(cat "${ko}" "${busybox}" "${VM_DIR}/guest/init.sh" "${VM_DIR}/guest/pagecheck.c" \
       "${VM_DIR}/build-initramfs.sh" | sha256sum | cut -c1-12)"
out="${CACHE_DIR}/initramfs-${key}.cpio.gz"
if [[ -f "${out}" ]]; then
  vmlog "initramfs cached: ${out}"
  echo "${out}"
  exit 0
fi
root="$(mktemp -d "${CACHE_DIR}/initramfs.XXXXXX")"
trap 'rm -rf "${root}"' EXIT
mkdir -p "${root}"/{bin,sbin,usr/bin,usr/sbin,proc,sys,dev,mnt,tmp}
cp "${busybox}" "${root}/bin/busybox"
for applet in $("${busybox}" --list); do
  [[ -e "${root}/bin/${applet}" ]] || ln -s busybox "${root}/bin/${applet}"
done
gcc -O2 -static -Wall -Wextra -Werror -o "${root}/bin/pagecheck" "${VM_DIR}/guest/pagecheck.c"
cp "${VM_DIR}/guest/init.sh" "${root}/init"
chmod +x "${root}/init"
cp "${ko}" "${root}/tmem_ivshmem.ko"
(cd "${root}" && find . | LC_ALL=C sort | cpio -o -H newc --quiet | gzip -6) >"${out}.tmp"
mv "${out}.tmp" "${out}"
vmlog "initramfs: ${out} ($(du -k "${out}" | cut -f1) KiB)"
echo "${out}"
