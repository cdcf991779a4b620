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
# RESULTS (default $BUILD_DIR/ring_summary; .md and .csv are written).
# Exit status: that of the build, or of the benchmark (0 even if a target is
# missed; misses are listed under the table).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build/ring-bench}"
RESULTS="${RESULTS:-$BUILD_DIR/ring_summary}"

log() { echo "run_ring: $*" >&2; }

cache="$BUILD_DIR/CMakeCache.txt"
if [[ ! -f "$BUILD_DIR/build.ninja" ]] ||
   ! grep -q '^CMAKE_BUILD_TYPE:STRING=Release$' "$cache" ||
   ! grep -q '^TMEM_BUILD_BENCH:BOOL=ON$' "$cache"; then
  log "configuring Release in $BUILD_DIR"
  # Tests are not needed to benchmark, and leaving them out keeps this build
  # independent of the test tree's state.
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DTMEM_BUILD_BENCH=ON -DTMEM_BUILD_TESTS=OFF >&2
fi
log "building tmem_ring_bench"
cmake --build "$BUILD_DIR" --target tmem_ring_bench >&2

log "load average: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPUs" \
    "(the ring needs two CPUs at once; rounds in which a neighbour took one" \
    "are set aside and counted in the notes)"
exec "$BUILD_DIR/bench/tmem_ring_bench" \
  --markdown "$RESULTS.md" --csv "$RESULTS.csv" "$@"
