# Shared settings for the vm-images scripts (sourced, not run).
# Everything built lives OUTSIDE the source tree, in TMEM_CACHE_DIR, keyed by
# the kernel version and a hash of the inputs that shape it.

VM_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# Default /var/cache/tmemd-vm; a user who cannot write there gets ~/.cache.
if [[ -n "${TMEM_CACHE_DIR:-}" ]]; then
  CACHE_DIR="${TMEM_CACHE_DIR}"
elif mkdir -p /var/cache/tmemd-vm 2>/dev/null && [[ -w /var/cache/tmemd-vm ]]; then
  CACHE_DIR=/var/cache/tmemd-vm
else
  CACHE_DIR="${XDG_CACHE_HOME:-${HOME}/.cache}/tmemd-vm"
fi
mkdir -p "${CACHE_DIR}"
KERNEL_PKG="linux-source-5.10"
KERNEL_SERIES="5.10"

vmlog() { printf '[%s %s] %s\n' "$(basename "$0")" "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { vmlog "ERROR: $*"; exit 1; }

# Hash of the files that define the kernel build (config fragment + script).
kernel_key() {
  cat "${VM_DIR}/kernel.config" "${VM_DIR}/build-kernel.sh" | sha256sum | cut -c1-12
}

kernel_dir() { echo "${CACHE_DIR}/kernel-${KERNEL_SERIES}-$(kernel_key)"; }

# run_with_progress LOG CMD... : runs CMD with its output in LOG and prints a
# line every 30 s (elapsed time, log lines, last target) instead of the spew.
run_with_progress() {
  local log="$1"; shift
  local t0=${SECONDS}
  "$@" >"${log}" 2>&1 &
  local pid=$!
  while kill -0 "${pid}" 2>/dev/null; do
    local i
    for ((i = 0; i < 30; i++)); do
      kill -0 "${pid}" 2>/dev/null || break
      sleep 1
    done
    kill -0 "${pid}" 2>/dev/null || break
    vmlog "  ... $((SECONDS - t0))s elapsed, $(wc -l <"${log}") lines, last: $(grep -E '^\s+(CC|LD|AR|AS|GEN)' "${log}" | tail -n1 | tr -s ' ')"
  done
  local rc=0
  wait "${pid}" || rc=$?
  if ((rc != 0)); then
    vmlog "command failed (exit ${rc}): $*; last lines of ${log}:"
    tail -n 30 "${log}" >&2
  fi
  return "${rc}"
}
