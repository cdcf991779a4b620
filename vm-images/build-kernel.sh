#!/usr/bin/env bash
# Builds the tmemd guest kernel (Linux 5.10 LTS with CONFIG_CLEANCACHE) from
# Debian bullseye's linux-source-5.10, fetched through a PRIVATE apt config
# (the system's sources.list is never touched). Output, cached by kernel
# version + hash of kernel.config and this script:
#   ${TMEM_CACHE_DIR:-/var/cache/tmemd-vm}/kernel-5.10-KEY/{bzImage,linux/}
# linux/ is the configured, built tree that external modules build against.
# Prints the output directory on stdout. Takes ~12-20 min on 2 cores when cold.
#
# Usage: vm-images/build-kernel.sh [--print-dir]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

out="$(kernel_dir)"
if [[ "${1:-}" == "--print-dir" ]]; then echo "${out}"; exit 0; fi
if [[ -f "${out}/done" ]]; then
  vmlog "kernel cached: ${out}"
  echo "${out}"
  exit 0
fi
jobs="${TMEM_JOBS:-2}"
mkdir -p "${CACHE_DIR}"
exec 9>"${CACHE_DIR}/kernel.lock"
flock 9
[[ -f "${out}/done" ]] && { echo "${out}"; exit 0; }

# --- 1. kernel source via a private apt config for bullseye ---------------
apt_dir="${CACHE_DIR}/apt-bullseye"
mkdir -p "${apt_dir}/lists/partial" "${apt_dir}/cache/archives/partial" \
         "${apt_dir}/debs" "${apt_dir}/etc/preferences.d" \
         "${apt_dir}/etc/sources.list.d"
cat >"${apt_dir}/etc/sources.list" <<'SRC'
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bullseye main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian-security bullseye-security main
SRC
apt_opts=(
  -o "Dir::Etc::sourcelist=${apt_dir}/etc/sources.list"
  -o "Dir::Etc::sourceparts=${apt_dir}/etc/sources.list.d"
  -o "Dir::Etc::preferencesparts=${apt_dir}/etc/preferences.d"
  -o "Dir::State::Lists=${apt_dir}/lists"
  -o "Dir::Cache=${apt_dir}/cache"
  -o "APT::Get::List-Cleanup=0"
)
deb="$(ls "${apt_dir}/debs/${KERNEL_PKG}"_*.deb 2>/dev/null | head -n1 || true)"
if [[ -z "${deb}" ]]; then
  vmlog "fetching ${KERNEL_PKG} from bullseye (private apt config in ${apt_dir})"
  apt-get "${apt_opts[@]}" update >"${apt_dir}/update.log" 2>&1 ||
    { tail -n 20 "${apt_dir}/update.log" >&2; die "apt-get update (bullseye) failed"; }
  (cd "${apt_dir}/debs" && apt-get "${apt_opts[@]}" download "${KERNEL_PKG}") >&2 ||
    die "apt-get download ${KERNEL_PKG} failed"
  deb="$(ls "${apt_dir}/debs/${KERNEL_PKG}"_*.deb | head -n1)"
fi
vmlog "source package: $(basename "${deb}")"

# --- 2. unpack --------------------------------------------------------------
rm -rf "${out}.tmp"
mkdir -p "${out}.tmp"
dpkg-deb --fsys-tarfile "${deb}" |
  tar -x -C "${out}.tmp" --wildcards './usr/src/linux-source-*.tar.xz'
tarball="$(ls "${out}.tmp"/usr/src/linux-source-*.tar.xz)"
vmlog "unpacking $(basename "${tarball}")"
tar -xJf "${tarball}" -C "${out}.tmp"
rm -rf "${out}.tmp/usr"
mv "${out}.tmp"/linux-source-* "${out}.tmp/linux"
src="${out}.tmp/linux"

# --- 3. configure -----------------------------------------------------------
vmlog "configuring: defconfig + kvm_guest.config + vm-images/kernel.config"
make -C "${src}" defconfig >/dev/null
make -C "${src}" kvm_guest.config >/dev/null
cfg_args=()
while read -r line; do
  line="${line%%#*}"; line="${line// /}"
  [[ -z "${line}" ]] && continue
  case "${line}" in
    +*) cfg_args+=(-e "${line#+}") ;;
    -*) cfg_args+=(-d "${line#-}") ;;
    *) die "bad line in kernel.config: ${line}" ;;
  esac
done <"${VM_DIR}/kernel.config"
"${src}/scripts/config" --file "${src}/.config" "${cfg_args[@]}"
make -C "${src}" olddefconfig >/dev/null
for opt in CLEANCACHE PCI_MSI DEBUG_FS VIRTIO_BLK EXT4_FS DEVTMPFS MODULES; do
  grep -q "^CONFIG_${opt}=y" "${src}/.config" || die "CONFIG_${opt} not set after olddefconfig"
done

# --- 4. build ---------------------------------------------------------------
vmlog "building bzImage + modules with -j${jobs} (progress every 30 s; full log in ${out}.tmp/build.log)"
t0=${SECONDS}
run_with_progress "${out}.tmp/build.log" make -C "${src}" -j"${jobs}" bzImage modules ||
  die "kernel build failed"
cp "${src}/arch/x86/boot/bzImage" "${out}.tmp/bzImage"
vmlog "kernel built in $((SECONDS - t0)) s: $(make -s -C "${src}" kernelrelease)"
date -u >"${out}.tmp/done"
rm -rf "${out}"
mv "${out}.tmp" "${out}"
echo "${out}"
