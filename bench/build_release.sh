# shellcheck shell=bash
# Sourced by bench/run_*.sh: bench_build_release DIR TARGET LOGNAME
# configures DIR as its own Release tree with the benchmarks and without the
# tests (unless it already is one), then builds TARGET. Its own directory so
# a RelWithDebInfo or sanitizer tree elsewhere is never reconfigured, and
# leaving the tests out keeps it independent of the test tree's state.
bench_build_release() {
  local root build_dir="$1" target="$2" name="$3"
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  local cache="$build_dir/CMakeCache.txt"
  if [[ ! -f "$build_dir/build.ninja" ]] ||
     ! grep -q '^CMAKE_BUILD_TYPE:STRING=Release$' "$cache" ||
     ! grep -q '^TMEM_BUILD_BENCH:BOOL=ON$' "$cache"; then
    echo "$name: configuring Release in $build_dir" >&2
    cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DTMEM_BUILD_BENCH=ON -DTMEM_BUILD_TESTS=OFF >&2
  fi
  echo "$name: building $target" >&2
  cmake --build "$build_dir" --target "$target" >&2
}
