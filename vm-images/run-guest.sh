#!/usr/bin/env bash
# Starts the tmemd test guest in QEMU: the cached 5.10 kernel + initramfs,
# an optional ivshmem-doorbell device on a tmemd socket, an optional raw
# data disk (virtio-blk). TCG by default; KVM only when a short, timeout-
# bounded probe boots the guest under KVM (nested KVM hangs on some hosts).
#
# Usage: vm-images/run-guest.sh [--socket DIR/NAME.sock] [--disk IMG]
#          [--mem MIB] [--smp N] [--append "ARGS"] [--serial FILE]
#          [--timeout SECS] [--accel auto|tcg|kvm] [--monitor-pipe PATH]
#          [--peer-mode] [--incoming unix:PATH] [--qmp PATH]
#          [--disk-cache none|writeback|cloud]
# The device is master=on, which QEMU migrates; the VM must then be ivshmem
# peer 0, so tmemd runs as peer 1 (its default). --peer-mode starts the
# device without master=on (QEMU refuses to migrate it), for a tmemd run
# with --host-peer-id 0. --migratable is accepted and is the default.
# --incoming: start as a live-migration destination; --qmp: a QMP socket.
# --disk-cache: none (default) is what production hosts run, cache=none,
# aio=native (O_DIRECT to the host device, no host page cache under the
# guest); writeback puts the host page cache under the guest's disk; cloud
# is none throttled to 3000 IOPS and 125 MB/s (QEMU throttling), a cloud
# volume's limits.
# --monitor-pipe: HMP monitor on the FIFOs PATH.in / PATH.out (e.g. for
# device_del tmem0 / chardev-add / device_add: hot re-plug of the device).
# Without --serial the console is this terminal. Exits with QEMU's status
# (124 on timeout).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

socket="" disk="" mem=160 smp=1 append="" serial="" timeout_s=0 disk_cache=none
accel="${TMEM_VM_ACCEL:-auto}" monpipe="" master=",master=on" incoming="" qmp=""
while (($#)); do
  case "$1" in
    --socket) socket="$2"; shift 2 ;;
    --disk) disk="$2"; shift 2 ;;
    --mem) mem="$2"; shift 2 ;;
    --smp) smp="$2"; shift 2 ;;
    --append) append="$2"; shift 2 ;;
    --serial) serial="$2"; shift 2 ;;
    --timeout) timeout_s="$2"; shift 2 ;;
    --accel) accel="$2"; shift 2 ;;
    --monitor-pipe) monpipe="$2"; shift 2 ;;
    --migratable) master=",master=on"; shift ;;
    --peer-mode) master=""; shift ;;
    --incoming) incoming="$2"; shift 2 ;;
    --qmp) qmp="$2"; shift 2 ;;
    --disk-cache) disk_cache="$2"; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) die "unknown argument: $1" ;;
  esac
done

images="$("${VM_DIR}/build-all.sh")" || die "could not build the guest images"
eval "${images}"

# KVM probe: boot the guest under KVM with tmemtest=probe; it must print
# PROBE_OK within 20 s. The answer is cached per kernel build.
probe_kvm() {
  local cache="${CACHE_DIR}/kvm-probe-$(basename "$(dirname "${KERNEL}")")"
  if [[ -f "${cache}" ]]; then cat "${cache}"; return; fi
  local result=tcg log
  if [[ -r /dev/kvm && -w /dev/kvm ]]; then
    log="$(mktemp)"
    timeout 20 qemu-system-x86_64 -machine pc,accel=kvm -m 128 -nographic -no-reboot \
      -kernel "${KERNEL}" -initrd "${INITRD}" -net none \
      -append "console=ttyS0 panic=-1 tmemtest=probe" >"${log}" 2>&1 </dev/null || true
    grep -q 'TMEMTEST PROBE_OK' "${log}" && result=kvm
    rm -f "${log}"
  fi
  vmlog "KVM probe: using ${result}"
  echo "${result}" >"${cache}"
  echo "${result}"
}
case "${accel}" in
  auto) accel="$(probe_kvm)" ;;
  tcg|kvm) ;;
  *) die "--accel must be auto, tcg or kvm" ;;
esac

args=(-machine "pc,accel=${accel}" -m "${mem}" -smp "${smp}" -nographic -no-reboot
      -kernel "${KERNEL}" -initrd "${INITRD}" -net none
      -append "console=ttyS0 panic=-1 ${append}")
[[ "${accel}" == tcg ]] && args+=(-cpu max)
case "${disk_cache}" in
  none) drive_cache="cache=none,aio=native" ;;
  writeback) drive_cache="cache=writeback" ;;
  # A cloud volume's limits (e.g. a general-purpose SSD volume: 3000 IOPS,
  # 125 MB/s), enforced by QEMU's block throttling.
  cloud) drive_cache="cache=none,aio=native,throttling.iops-total=3000,throttling.bps-total=125000000" ;;
  *) die "--disk-cache must be none, writeback or cloud, not '${disk_cache}'" ;;
esac
if [[ -n "${disk}" ]]; then
  args+=(-drive "file=${disk},format=raw,if=virtio,${drive_cache}")
fi
if [[ -n "${socket}" ]]; then
  args+=(-chardev "socket,path=${socket},id=tm0"
         -device "ivshmem-doorbell,chardev=tm0,vectors=1,id=tmem0${master}")
fi
[[ -n "${incoming}" ]] && args+=(-incoming "${incoming}")
[[ -n "${qmp}" ]] && args+=(-qmp "unix:${qmp},server=on,wait=off")
if [[ -n "${serial}" ]]; then
  args=(-serial "file:${serial}" -display none
        "${args[@]/-nographic/}")
  # drop the empty element left by removing -nographic
  clean=(); for a in "${args[@]}"; do [[ -n "${a}" ]] && clean+=("${a}"); done
  args=("${clean[@]}")
fi
if [[ -n "${monpipe}" ]]; then
  args+=(-chardev "pipe,id=mon0,path=${monpipe}" -mon chardev=mon0,mode=readline)
elif [[ -n "${serial}" ]]; then
  args+=(-monitor none)
fi
vmlog "qemu (${accel}, ${mem} MiB, ${smp} vCPU)${socket:+ with tmem on ${socket}}${disk:+, disk ${disk} (${drive_cache})}"
if ((timeout_s > 0)); then
  exec timeout --foreground -k 5 "${timeout_s}" qemu-system-x86_64 "${args[@]}"
fi
exec qemu-system-x86_64 "${args[@]}"
