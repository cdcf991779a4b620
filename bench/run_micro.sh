#!/usr/bin/env bash
# Builds the backend micro-benchmark (Release) if needed and runs its summary
# mode: interleaved measured/baseline rounds, then the results table with
# targets and PASS/FAIL on stdout. Progress goes to stderr.
#
#   bench/run_micro.sh                      summary table (~15-45 s)
#   bench/run_micro.sh --gbench             full Google Benchmark run (~2 min)
#                                           followed by a table from it
#   bench/run_micro.sh --rounds 51          more rounds (any tmem_micro_bench flag)
#
# Environment: BUILD_DIR (default build/micro-bench; its own directory so a
# RelWithDebInfo or sanitizer tree elsewhere is never reconfigured),
# RESULTS (default $BUILD_DIR/micro_summary; .md and .csv are written),
# RESULTS_JSON (default bench/results/latest.json: the rows are recorded
# there and bench/results/latest.md regenerated; bench/results/results.sh),
# TMEM_COMMIT (default: git describe of this tree).
# Exit status: that of the build, or of the benchmark (0 even if a target is
# missed; misses are listed under the table).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build/micro-bench}"
RESULTS="${RESULTS:-$BUILD_DIR/micro_summary}"

mode=(--summary)
args=()
for a in "$@"; do
  if [[ "$a" == "--gbench" ]]; then
    mode=()
  else
    args+=("$a")
  fi
done

log() { echo "run_micro: $*" >&2; }

# shellcheck source=bench/build_release.sh
source "$ROOT/bench/build_release.sh"
# shellcheck source=bench/results/results.sh
source "$ROOT/bench/results/results.sh"
results_setup
bench_build_release "$BUILD_DIR" tmem_micro_bench run_micro

log "load average: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPUs" \
    "(figures are ratios measured side by side; a busy machine mostly" \
    "affects the 2-thread row, which says so)"
log "running ${mode[*]:-Google Benchmark mode}"
rc=0
"$BUILD_DIR/bench/tmem_micro_bench" "${mode[@]}" \
  --markdown "$RESULTS.md" --csv "$RESULTS.csv" --results "$RESULTS_JSON" \
  "${args[@]}" || rc=$?
results_render || rc=1
exit "$rc"
