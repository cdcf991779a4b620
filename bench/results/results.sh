# shellcheck shell=bash
# Sourced by the scripts that run benchmarks (bench/run_*.sh,
# scripts/main-job.sh): where the benchmarks record their rows and which
# commit they measured.
#   results_setup       sets RESULTS_JSON (default: bench/results/latest.json
#                       of this tree) and exports TMEM_COMMIT (default: git
#                       describe --always --dirty of this tree), which the
#                       benchmark programs write into their section;
#   results_render      regenerates the latest.md beside RESULTS_JSON
#                       (bench/results/render.py); says so on stderr.
results_setup() {
  local root
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  RESULTS_JSON="${RESULTS_JSON:-${root}/bench/results/latest.json}"
  TMEM_COMMIT="${TMEM_COMMIT:-$(git -C "${root}" describe --always --dirty 2>/dev/null || echo unknown)}"
  TMEM_REPO_ROOT="${root}"
  export RESULTS_JSON TMEM_COMMIT TMEM_REPO_ROOT
}
results_render() {
  local root
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  [[ -f "${RESULTS_JSON}" ]] || return 0
  python3 "${root}/bench/results/render.py" --in "${RESULTS_JSON}" \
    --out "${RESULTS_JSON%.json}.md" &&
    echo "results: ${RESULTS_JSON%.json}.md regenerated" >&2
}
