#!/usr/bin/env bash
# Builds tmem-ivshmem-dkms_VERSION-1_all.deb: the guest module's source
# (guest-driver/Kbuild, tmem_ivshmem_main.c, guest-driver/core/,
# proto/tmem_abi.h) under /usr/src/tmem-ivshmem-VERSION with its dkms.conf,
# and postinst/prerm that add/build/install and remove it through DKMS.
# Installed in a guest, DKMS builds tmem_ivshmem.ko for its kernel.
#
# Usage: packaging/dkms/build-dkms-deb.sh VERSION OUT_DIR
# Prints the .deb path. Needs dpkg-deb and gzip.
set -euo pipefail

version="$1"
out_dir="$2"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "${here}/../.." && pwd)"
name=tmem-ivshmem
pkg=tmem-ivshmem-dkms

stage="$(mktemp -d /tmp/tmem-ivshmem-dkms.XXXXXX)"
trap 'rm -rf "${stage}"' EXIT
root="${stage}/root"
src="${root}/usr/src/${name}-${version}"
doc="${root}/usr/share/doc/${pkg}"
install -d "${src}/guest-driver/core" "${src}/proto" "${doc}" "${root}/DEBIAN"

install -m 0644 "${repo}/guest-driver/Kbuild" "${repo}/guest-driver/tmem_ivshmem_main.c" \
  "${src}/guest-driver/"
# The guest core: every C file and header of guest-driver/core/.
install -m 0644 "${repo}"/guest-driver/core/*.[ch] "${src}/guest-driver/core/"
install -m 0644 "${repo}/proto/tmem_abi.h" "${src}/proto/"
subst() { sed "s/@VERSION@/${version}/g" "$1"; }
subst "${here}/dkms.conf.in" >"${src}/dkms.conf"
chmod 0644 "${src}/dkms.conf"

install -m 0644 "${here}/copyright" "${doc}/copyright"
subst "${here}/changelog" | gzip -9n >"${doc}/changelog.Debian.gz"
chmod 0644 "${doc}/changelog.Debian.gz"

for script in postinst prerm; do
  subst "${here}/${script}" >"${root}/DEBIAN/${script}"
  chmod 0755 "${root}/DEBIAN/${script}"
done
installed_kb="$(du -sk --exclude=DEBIAN "${root}" | cut -f1)"
cat >"${root}/DEBIAN/control" <<CONTROL
Package: ${pkg}
Version: ${version}-1
Architecture: all
Section: kernel
Priority: optional
Maintainer: tmemd maintainers <tmemd@example.org>
Homepage: https://example.org/tmemd
Depends: dkms (>= 2.1.0.0)
Installed-Size: ${installed_kb}
Description: tmem_ivshmem guest kernel module for tmemd (DKMS source)
 The guest side of tmemd: a cleancache frontend that hands clean pages
 evicted from a Linux 5.10 guest's page cache to tmemd on the host, over a
 QEMU ivshmem-doorbell device. DKMS builds tmem_ivshmem.ko for each
 installed kernel. Install it in the guest, not on the host.
CONTROL
(cd "${root}" && find . -type f ! -path './DEBIAN/*' -printf '%P\0' | sort -z \
  | xargs -0 md5sum >DEBIAN/md5sums)
chmod 0644 "${root}/DEBIAN/control" "${root}/DEBIAN/md5sums"

mkdir -p "${out_dir}"
deb="$(cd "${out_dir}" && pwd)/${pkg}_${version}-1_all.deb"
dpkg-deb --root-owner-group -Zxz --build "${root}" "${deb}" >/dev/null
echo "${deb}"
