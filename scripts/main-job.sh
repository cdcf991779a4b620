#!/usr/bin/env bash
# The main-job command of tmemd: builds the release preset and runs the
# backend micro-benchmark summary (bench/run_micro.sh prints a table of
# ratios measured on this machine, e.g. a put vs. a plain LZ4 compress).
#
# Usage: scripts/main-job.sh [ARGS...]   (ARGS are passed to bench/run_micro.sh)
# Environment: TMEM_JOBS (default 2). bench/run_micro.sh gets
# BUILD_DIR=<repo>/build/release, so it reuses the release tree just built
# (Release, benchmarks on) instead of configuring a second one.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${root}"
export TMEM_JOBS="${TMEM_JOBS:-2}"
export BUILD_DIR="${root}/build/release"

banner() { printf '\n== %s\n' "$*"; }

banner "dependencies (scripts/install-deps.sh)"
scripts/install-deps.sh

banner "configure + build: release preset (-j${TMEM_JOBS})"
cmake --preset release
cmake --build --preset release -j "${TMEM_JOBS}"

banner "backend micro-benchmarks (bench/run_micro.sh)"
if [[ ! -f bench/run_micro.sh ]]; then
  echo "ERROR: bench/run_micro.sh does not exist yet." >&2
  exit 1
fi
exec bash bench/run_micro.sh "$@"
