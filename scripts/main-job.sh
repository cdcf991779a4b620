#!/usr/bin/env bash
# The main job of tmemd: tmemd serving simulated guests, on its embedded
# default configuration (no config file, no libvirt), then the benchmark
# tables.
#
#  1. installs dependencies and builds the release preset;
#  2. starts tmemd with three VMs (--vm streamer --vm rereader --vm checker)
#     on sockets in a temporary directory;
#  3. runs one tmem-guestsim per VM at once, each connecting exactly as QEMU
#     would: "streamer" streams pages that never come back (the 2011 report's
#     workload), "rereader" re-reads a working set, "checker" runs random ops
#     and verifies every page that comes back against its own model;
#  4. stops tmemd with SIGTERM and prints its final statistics;
#  5. runs the scenario benchmark (bench/scenario, tmem-scenario): the 2011
#     report replayed: tmemd serving simulated guests with a page cache, a
#     300 MB/s disk and an application, streaming and re-reading, in modes
#     off/always/adaptive side by side, with the targets as PASS/FAIL
#     (table, CSV and PNG in build/release/bench/scenario-results/);
#  6. runs the backend micro-benchmark summary (bench/run_micro.sh) and, when
#     present, the ring benchmark (bench/run_ring.sh), unless --scenario-only.
# Every benchmark records its rows, with this machine, the date and the
# commit, in bench/results/latest.json (RESULTS_JSON overrides it), and
# bench/results/latest.md is regenerated from it after each.
#
# Usage: scripts/main-job.sh [--quick] [--scenario-only] [--real-guest]
#   --quick: smaller runs (the scenario benchmark in ~2-3 min instead of ~8)
#   --scenario-only: skip the micro and ring benchmarks
#   --real-guest: instead of the simulated guests, boot a real 5.10 guest
#   with tmem_ivshmem.ko under QEMU against tmemd (vm-images/e2e-test.sh;
#   builds the guest kernel first, ~15 min cold).
# Environment: TMEM_JOBS (default 2).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${root}"
export TMEM_JOBS="${TMEM_JOBS:-2}"
export BUILD_DIR="${root}/build/release"
quick=0 scenario_only=0 real_guest=0
for arg in "$@"; do
  case "${arg}" in
    --quick) quick=1 ;;
    --scenario-only) scenario_only=1 ;;
    --real-guest) real_guest=1 ;;
    *) echo "usage: $0 [--quick] [--scenario-only] [--real-guest]" >&2; exit 2 ;;
  esac
done

banner() { printf '\n== %s\n' "$*"; }
# shellcheck source=bench/results/results.sh
source "${root}/bench/results/results.sh"
results_setup

banner "dependencies (scripts/install-deps.sh)"
scripts/install-deps.sh

banner "configure + build: release preset (-j${TMEM_JOBS})"
cmake --preset release >/dev/null
cmake --build --preset release -j "${TMEM_JOBS}"

if ((real_guest)); then
  banner "real guest: 5.10 + tmem_ivshmem.ko under QEMU against tmemd (vm-images/e2e-test.sh)"
  exec vm-images/e2e-test.sh --tmemd "${BUILD_DIR}/host-agent/tmemd"
fi

bin="${BUILD_DIR}"
tmemd="${bin}/host-agent/tmemd"
guestsim="${bin}/guest-driver/tmem-guestsim"
work="$(mktemp -d /tmp/tmemd-main-job.XXXXXX)"
tmemd_pid=""
cleanup() {
  if [[ -n "${tmemd_pid}" ]] && kill -0 "${tmemd_pid}" 2>/dev/null; then
    kill -TERM "${tmemd_pid}" 2>/dev/null || true
    wait "${tmemd_pid}" 2>/dev/null || true
  fi
  rm -rf "${work}"
}
trap cleanup EXIT

pages=20000 ops=60000
((quick)) && pages=4000 ops=12000

banner "tmemd: 3 VMs, memory cap 128MiB, sockets in ${work}/sock"
"${tmemd}" --socket-dir "${work}/sock" --memory-cap 128MiB \
  --vm streamer --vm rereader --vm checker --stats-interval 2 \
  >"${work}/tmemd.log" 2>&1 &
tmemd_pid=$!
for vm in streamer rereader checker; do
  for _ in $(seq 100); do [[ -S "${work}/sock/${vm}.sock" ]] && break; sleep 0.05; done
  [[ -S "${work}/sock/${vm}.sock" ]] || { cat "${work}/tmemd.log"; echo "tmemd did not start" >&2; exit 1; }
done
sed 's/^/  tmemd | /' "${work}/tmemd.log"

banner "simulated guests (tmem-guestsim, one per VM, concurrently)"
"${guestsim}" --socket "${work}/sock/streamer.sock" --workload seq \
  --pages "$((pages * 4))" --ops "$((pages * 4))" --seed 1 >"${work}/streamer.out" 2>&1 &
p1=$!
"${guestsim}" --socket "${work}/sock/rereader.sock" --workload reread \
  --pages "$((pages / 4))" --ops "${ops}" --seed 2 >"${work}/rereader.out" 2>&1 &
p2=$!
"${guestsim}" --socket "${work}/sock/checker.sock" --workload coherency \
  --pages "${pages}" --ops "${ops}" --seed 3 >"${work}/checker.out" 2>&1 &
p3=$!
status=0
for p in "${p1}" "${p2}" "${p3}"; do wait "${p}" || status=1; done
for vm in streamer rereader checker; do
  printf '\n-- %s\n' "${vm}"
  cat "${work}/${vm}.out"
done

banner "tmemd shutdown (SIGTERM) and final statistics"
kill -TERM "${tmemd_pid}"
wait "${tmemd_pid}" || status=1
tmemd_pid=""
grep -E 'event=(final_stats|vm_stats|tmemd_stopped)' "${work}/tmemd.log" |
  sed 's/^/  tmemd | /'
if ((status != 0)); then
  echo "FAILED: a guest or tmemd exited non-zero (logs above)" >&2
  exit 1
fi

banner "scenario benchmark: the 2011 report (bench/scenario, tmem-scenario)"
scenario_args=()
((quick)) && scenario_args+=(--quick)
if ! "${bin}/bench/scenario/tmem-scenario" "${scenario_args[@]}" \
    --out "${bin}/bench/scenario-results" --results "${RESULTS_JSON}"; then
  results_render || true
  echo "FAILED: a scenario run failed (logs in ${bin}/bench/scenario-results/runs)" >&2
  exit 1
fi
results_render

if ((scenario_only)); then
  exit 0
fi
banner "backend micro-benchmarks (bench/run_micro.sh)"
bash bench/run_micro.sh
if [[ -f bench/run_ring.sh ]]; then
  banner "data-plane ring benchmark (bench/run_ring.sh)"
  bash bench/run_ring.sh
fi
