#!/usr/bin/env bash
# Installs the Debian 12 (bookworm) packages tmemd needs to build, test, lint
# and benchmark. Idempotent: when every package is already installed it only
# asks dpkg (no apt-get at all), so reruns take well under a second.
#
# Usage: scripts/install-deps.sh [EXTRA_PACKAGE...]
#   Runs apt-get as root, or through sudo when not root.
#   Extra arguments are installed along with the list below.
#
# To add packages for a new part of the project, uncomment (or add) its group
# in PACKAGES below; keep one group per purpose, each with the issue needing it.
set -euo pipefail

PACKAGES=(
  # --- build: toolchain, build system, sanitizer runtimes, lint ------------
  build-essential      # gcc/g++ 12, make, dpkg-dev (dpkg-source), patch
  cmake                # 3.25: CMakePresets.json version 6
  ninja-build
  pkg-config
  git
  ca-certificates
  clang                # clang 14: tsan/clang presets, -Wthread-safety
  libclang-rt-14-dev   # clang's sanitizer and libFuzzer runtimes
  clang-format
  clang-tidy

  # --- backend store: codecs, containers, tests, micro-bench --------------
  liblz4-dev
  libabsl-dev
  libgtest-dev
  libgmock-dev
  libbenchmark-dev

  # --- tmemd daemon and data plane ----------------------------------------
  libtomlplusplus-dev  # tmemd's TOML config
  libcli11-dev         # command-line flags (tmemd, tmem-guestsim)
  qemu-system-x86      # real QEMU (TCG) for the ivshmem handshake tests
  qemu-utils

  # --- scenario benchmark: the 2011 report replayed -----------------------
  gnuplot-nox          # bench/scenario: throughput / hit-ratio PNG plot

  # --- gRPC control plane, tmemctl -----------------------------------------
  protobuf-compiler
  protobuf-compiler-grpc
  libgrpc++-dev        # includes grpc++_reflection
  libprotobuf-dev
  nlohmann-json3-dev   # tmemctl -o json, policy files, tmemd's state file
  openssl              # tests/control: throwaway CA and certs for mTLS

  # --- libvirt glue --------------------------------------------------------
  libvirt-dev
  libvirt-daemon-system   # libvirtd + virtlogd for the integration tests
  libvirt-clients         # virsh

  # --- guest kernel 5.10 + initramfs, real-guest e2e test -----------------
  # (the kernel source itself, bullseye's linux-source-5.10, is fetched by
  # vm-images/build-kernel.sh through a private apt config)
  bc
  bison
  flex
  libelf-dev
  libssl-dev
  xz-utils             # unpacks linux-source-5.10.tar.xz
  cpio                 # initramfs
  busybox-static       # the guest's userland
  e2fsprogs            # mkfs.ext4 for the guest's data disk

  # --- restart, upgrade and live migration ---------------------------------
  libsystemd-dev       # sd_notify fd store, sd_listen_fds_with_names

  # --- Debian package and systemd unit -------------------------------------
  lintian              # tests/package: lint the .deb (errors fail)
  bash-completion      # tests/package: the installed tmemctl completion loads
  dkms                 # tests/package/dkms_test.sh: dkms build of tmem-ivshmem-dkms
  prometheus           # tests/monitoring: promtool check metrics/config/rules,
                       # and a real Prometheus scraping tmemd
  # (cpack, dpkg-deb, dpkg-shlibdeps, fakeroot: cmake and dpkg-dev above;
  # systemd-analyze: systemd; setpriv: util-linux; adduser: base system)
  # --- fleet policy in etcd ------------------------------------------------
  etcd-server          # tests/fleet start a 3-member cluster on loopback
  etcd-client          # etcdctl, for operators (docs/fleet.md)

  # --- stock Debian 12 guest and swap verification ------------------------
  # (its kernel, linux-image-cloud-amd64, is fetched by
  # vm-images/stock/build.sh with apt-get download, never installed)
  kmod                 # depmod/modprobe -d on the extracted kernel's modules
  qemu-system-common   # qemu-storage-daemon: the reference vhost-user-blk backend
)

log() { printf '[install-deps] %s\n' "$*"; }

wanted=("${PACKAGES[@]}" "$@")

# One dpkg-query for all packages; unknown names print nothing (stderr muted).
declare -A installed=()
while read -r name abbrev; do
  [[ "${abbrev}" == "ii" ]] && installed["${name}"]=1
done < <(dpkg-query -W -f='${Package} ${db:Status-Abbrev}\n' "${wanted[@]}" \
           2>/dev/null || true)

missing=()
for pkg in "${wanted[@]}"; do
  [[ -n "${installed[${pkg}]:-}" ]] || missing+=("${pkg}")
done

if ((${#missing[@]} == 0)); then
  log "all ${#wanted[@]} packages already installed; nothing to do."
  exit 0
fi

log "missing ${#missing[@]} of ${#wanted[@]} packages: ${missing[*]}"

sudo_cmd=()
if ((EUID != 0)); then
  if command -v sudo >/dev/null 2>&1; then
    sudo_cmd=(sudo)
    log "not root: using sudo for apt-get."
  else
    log "ERROR: need root (or sudo) to install: ${missing[*]}" >&2
    exit 1
  fi
fi

apt_get() {
  "${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get "$@"
}

install_missing() {
  apt_get install -y --no-install-recommends "${missing[@]}"
}

# A fresh machine may have no package lists at all: update first then.
if ! compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null; then
  log "apt package lists are empty: running apt-get update."
  apt_get update
fi

if ! install_missing; then
  log "install failed; refreshing package lists (apt-get update) and retrying."
  apt_get update
  if ! install_missing; then
    log "ERROR: apt-get install failed for: ${missing[*]}" >&2
    exit 1
  fi
fi

log "installed: ${missing[*]}"
