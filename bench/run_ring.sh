#!/usr/bin/env bash
# Builds the data-plane benchmark (Release) if needed and runs it: tmemd's
# rings, worker and guest library against the same puts and gets on the
# store in-process, in interleaved rounds; the results table with targets and
# PASS/FAIL/INCONCLUSIVE goes to stdout, progress to stderr.
#
#   bench/run_ring.sh                         the full table (~25-70 s)
#   bench/run_ring.sh --rounds 51             more rounds (any tmem_ring_bench
#                                             flag: --sections, --gap_us, ...)
#   bench/run_ring.sh --debug_rounds          one stderr line per round (how
#                                             busy the machine was)
#
# Environment: BUILD_DIR (default build/ring-bench; its own directory so a
# RelWithDebInfo or sanitizer tree elsewhere is never reconfigured),
# RESULTS (default $BUILD_DIR/ring_summary; .md and .csv are written),
# RESULTS_JSON (default bench/results/latest.json: the rows are recorded
# there and bench/results/latest.md regenerated; bench/results/results.sh),
# TMEM_COMMIT (default: git describe of this tree).
# Exit status: that of the build, or of the benchmark (0 even if a target is
# missed; misses are listed under the table).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build/ring-bench}"
RESULTS="${RESULTS:-$BUILD_DIR/ring_summary}"

log() { echo "run_ring: $*" >&2; }

# shellcheck source=bench/build_release.sh
source "$ROOT/bench/build_release.sh"
# shellcheck source=bench/results/results.sh
source "$ROOT/bench/results/results.sh"
results_setup
bench_build_release "$BUILD_DIR" tmem_ring_bench run_ring

log "load average: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPUs" \
    "(the ring needs two CPUs at once; rounds in which a neighbour took one" \
    "are set aside and counted in the notes)"
rc=0
"$BUILD_DIR/bench/tmem_ring_bench" \
  --markdown "$RESULTS.md" --csv "$RESULTS.csv" --results "$RESULTS_JSON" \
  "$@" || rc=$?
results_render || rc=1
exit "$rc"
