#!/usr/bin/env bash
# Builds (or finds in the cache) the stock Debian 12 guest: the registry's
# unmodified linux-image-cloud-amd64 kernel (6.1.0-*-cloud-amd64; no rebuild,
# no module of ours) and a minimal initramfs of busybox-static, that
# package's own virtio/zram modules, the swapcheck verifier and
# stock/init.sh as /init. Prints shell assignments:
#   KERNEL=... INITRD=... KVER=...
# Everything lives in the vm-images cache (common.sh), keyed by the package
# version and a hash of the initramfs inputs; a rerun with a warm cache only
# asks apt-cache which version the metapackage points at.
# Env: TMEM_STOCK_PKG overrides the metapackage (default
# linux-image-cloud-amd64).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
STOCK_DIR="${VM_DIR}/stock"
meta="${TMEM_STOCK_PKG:-linux-image-cloud-amd64}"

# The versioned image package the metapackage depends on, and its version.
# Offline with a warm cache: the newest kernel already extracted.
pkg="$(apt-cache depends "${meta}" 2>/dev/null |
       sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*\)$/\1/p' | head -n1 || true)"
ver=""
[[ -n "${pkg}" ]] && ver="$(apt-cache show "${pkg}" 2>/dev/null | sed -n 's/^Version: //p' | head -n1)"
if [[ -z "${pkg}" || -z "${ver}" ]]; then
  kdir="$(ls -d "${CACHE_DIR}"/stock-kernel-linux-image-* 2>/dev/null | sort -V | tail -n1 || true)"
  [[ -n "${kdir}" && -f "${kdir}/.done" ]] ||
    die "apt-cache does not know ${meta} (run apt-get update) and no stock kernel is cached"
  vmlog "apt-cache cannot resolve ${meta}; using cached ${kdir}"
else
  kdir="${CACHE_DIR}/stock-kernel-${pkg}-${ver}"
fi

if [[ ! -f "${kdir}/.done" ]]; then
  vmlog "downloading ${meta} -> ${pkg} ${ver}"
  tmp="$(mktemp -d "${CACHE_DIR}/stock-kernel.XXXXXX")"
  trap 'rm -rf "${tmp}"' EXIT
  # apt-get download writes into the current directory, as the _apt user
  # when it can: a world-writable scratch directory keeps it unprivileged.
  mkdir -p "${tmp}/debs" "${tmp}/root"
  chmod 0755 "${tmp}"
  chmod 0777 "${tmp}/debs"
  (cd "${tmp}/debs" && apt-get download -q "${meta}" "${pkg}" >&2) ||
    die "apt-get download ${meta} ${pkg} failed"
  for deb in "${tmp}"/debs/*.deb; do dpkg-deb -x "${deb}" "${tmp}/root"; done
  kver="$(ls "${tmp}/root/lib/modules" | head -n1)"
  [[ -n "${kver}" && -f "${tmp}/root/boot/vmlinuz-${kver}" ]] || die "no vmlinuz in ${pkg}"
  # The package ships no modules.dep (the postinst makes it).
  depmod -b "${tmp}/root" "${kver}"
  rm -rf "${kdir}.new"
  mkdir -p "${kdir}.new"
  cp "${tmp}/root/boot/vmlinuz-${kver}" "${kdir}.new/vmlinuz"
  cp "${tmp}/root/boot/config-${kver}" "${kdir}.new/config"
  mv "${tmp}/root/lib" "${kdir}.new/lib"
  echo "${kver}" >"${kdir}.new/kver"
  touch "${kdir}.new/.done"
  rm -rf "${kdir}"
  mv "${kdir}.new" "${kdir}"
  rm -rf "${tmp}"
  trap - EXIT
  vmlog "stock kernel ${kver} in ${kdir}"
fi
kver="$(cat "${kdir}/kver")"

# Modules the guest loads, in dependency order (modprobe resolves it from
# the package's own modules.dep): virtio-pci transport, virtio-blk, zram
# with its zsmalloc allocator and the lz4 crypto compressor zram asks for.
MODULES=(virtio_pci virtio_blk zram lz4)
busybox="$(command -v busybox || true)"
[[ -x "${busybox}" ]] || die "busybox not found (apt-get install busybox-static)"
file -L "${busybox}" 2>/dev/null | grep -q 'statically linked' ||
  ldd "${busybox}" 2>&1 | grep -q 'not a dynamic' || die "${busybox} is not static (busybox-static)"
key="$(cat "${busybox}" "${STOCK_DIR}/init.sh" "${STOCK_DIR}/swapcheck.c" \
       "${STOCK_DIR}/build.sh" | sha256sum | cut -c1-12)"
out="${kdir}/initramfs-${key}.cpio.gz"
if [[ ! -f "${out}" ]]; then
  root="$(mktemp -d "${CACHE_DIR}/stock-initramfs.XXXXXX")"
  trap 'rm -rf "${root}"' EXIT
  mkdir -p "${root}"/{bin,sbin,usr/bin,usr/sbin,proc,sys,dev,tmp,lib/modules/"${kver}"}
  cp "${busybox}" "${root}/bin/busybox"
  for applet in $("${busybox}" --list); do
    [[ -e "${root}/bin/${applet}" ]] || ln -s busybox "${root}/bin/${applet}"
  done
  gcc -O2 -static -Wall -Wextra -Werror -o "${root}/bin/swapcheck" "${STOCK_DIR}/swapcheck.c"
  : >"${root}/modules.load"
  for m in "${MODULES[@]}"; do
    modprobe -d "${kdir}" -S "${kver}" --show-depends "${m}" |
      while read -r verb path _; do
        [[ "${verb}" == insmod ]] || continue
        rel="${path#"${kdir}"/}"
        grep -qxF "/${rel}" "${root}/modules.load" && continue
        mkdir -p "${root}/$(dirname "${rel}")"
        cp "${path}" "${root}/${rel}"
        echo "/${rel}" >>"${root}/modules.load"
      done
  done
  grep -q '/virtio_blk\.ko' "${root}/modules.load" || die "virtio_blk not found in ${kver}"
  cp "${STOCK_DIR}/init.sh" "${root}/init"
  chmod +x "${root}/init"
  (cd "${root}" && find . | LC_ALL=C sort | cpio -o -H newc --quiet | gzip -6) >"${out}.tmp"
  mv "${out}.tmp" "${out}"
  rm -rf "${root}"
  trap - EXIT
  vmlog "stock initramfs: ${out} ($(du -k "${out}" | cut -f1) KiB)"
fi
printf 'KERNEL=%q\nINITRD=%q\nKVER=%q\n' "${kdir}/vmlinuz" "${out}" "${kver}"
