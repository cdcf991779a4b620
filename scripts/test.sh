#!/usr/bin/env bash
# THE test command of tmemd (CI runs it through .ci/run).
#
# Installs the build dependencies, then for each preset in turn -- release,
# asan (ASan+UBSan), tsan -- configures, builds and runs the whole ctest
# suite, then lints (clang-format, clang-tidy). A failing stage does not stop the others: everything is reported,
# then the script exits non-zero if anything failed.
#
# Usage: scripts/test.sh [PRESET...]      (default: release asan tsan)
# Environment: TMEM_JOBS (default 2: the project's machines have 2 cores).
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${root}" || exit 1

export TMEM_JOBS="${TMEM_JOBS:-2}"
jobs="${TMEM_JOBS}"
if (($# > 0)); then presets=("$@"); else presets=(release asan tsan); fi

banner() {
  printf '\n'
  printf '=%.0s' {1..78}; printf '\n'
  printf '== %s\n' "$*"
  printf '=%.0s' {1..78}; printf '\n'
}

fmt_secs() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

summary=()      # one line per step
failed=0        # failed steps
tests_passed=0
tests_failed=0
start_all=${SECONDS}

# run_step NAME COMMAND... : runs the command, records status and duration.
run_step() {
  local name="$1"; shift
  local t0=${SECONDS} rc=0
  printf '\n--- %s: %s\n' "${name}" "$*"
  "$@" || rc=$?
  local dt=$((SECONDS - t0))
  if ((rc == 0)); then
    summary+=("$(printf '  %-22s PASS  %s' "${name}" "$(fmt_secs ${dt})")")
  else
    summary+=("$(printf '  %-22s FAIL  %s  (exit %d)' "${name}" "$(fmt_secs ${dt})" "${rc}")")
    failed=$((failed + 1))
  fi
  return "${rc}"
}

skip_step() {
  summary+=("$(printf '  %-22s SKIP  (%s)' "$1" "$2")")
}

# ctest prints "NN% tests passed, F tests failed out of T"; add it up.
count_tests() {
  local log="$1" line passed_n failed_n total
  line="$(grep -E '^[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' "${log}" | tail -n1)" || return 0
  failed_n="$(sed -E 's/.* ([0-9]+) tests? failed out of ([0-9]+).*/\1/' <<<"${line}")"
  total="$(sed -E 's/.* failed out of ([0-9]+).*/\1/' <<<"${line}")"
  passed_n="$((total - failed_n))"
  tests_passed=$((tests_passed + passed_n))
  tests_failed=$((tests_failed + failed_n))
}

run_ctest() {
  local preset="$1" log="$2"
  # pipefail: ctest's status survives the tee.
  ctest --preset "${preset}" -j "${jobs}" 2>&1 | tee "${log}"
}

banner "tmemd test suite: presets ${presets[*]} (-j${jobs})"
printf 'host: %s, %s cores\n' "$(uname -sr)" "$(nproc)"

banner "dependencies (scripts/install-deps.sh)"
if ! run_step "install-deps" scripts/install-deps.sh; then
  banner "FAILED: could not install dependencies"
  printf '%s\n' "${summary[@]}"
  exit 1
fi
printf '%s | %s | %s | %s\n' "$(cmake --version | head -n1)" \
  "ninja $(ninja --version)" "$(g++ --version | head -n1)" \
  "$(clang++ --version | head -n1)"

# The libvirt tests (ctest label libvirt) need a running libvirtd; they skip,
# saying why, only when it cannot run at all.
banner "libvirtd for the libvirt tests (scripts/start-libvirtd.sh)"
run_step "start-libvirtd" scripts/start-libvirtd.sh || true

for preset in "${presets[@]}"; do
  stage_t0=${SECONDS}
  banner "stage ${preset}: configure, build, test"
  mkdir -p "build/${preset}"
  rm -f "build/${preset}/ctest.log"  # the summary reads this run's only
  ok=1
  if ((ok)); then
    run_step "${preset}/configure" cmake --preset "${preset}" || ok=0
  else
    skip_step "${preset}/configure" "deps failed"
  fi
  if ((ok)); then
    run_step "${preset}/build" cmake --build --preset "${preset}" -j "${jobs}" || ok=0
  else
    skip_step "${preset}/build" "earlier step failed"
  fi
  # The real-guest test (ctest label vm, release only) needs the guest
  # kernel, module and initramfs; build them here (cached outside the tree,
  # ~15 min when cold) so the test itself only boots the guest.
  if ((ok)) && [[ "${preset}" == release ]]; then
    run_step "vm-images/build" bash -c 'vm-images/build-all.sh >/dev/null' || true
  fi
  if ((ok)); then
    run_step "${preset}/test" run_ctest "${preset}" "build/${preset}/ctest.log" || ok=0
    count_tests "build/${preset}/ctest.log"
  else
    skip_step "${preset}/test" "earlier step failed"
  fi
  summary+=("$(printf '  %-22s %s  %s' "${preset} (stage)" \
    "$( ((ok)) && echo PASS || echo FAIL)" "$(fmt_secs $((SECONDS - stage_t0)))")")
  summary+=("")
done

# Lint runs last, on the release tree's compile_commands.json, and only when
# the default presets ran (a single-preset run is for quick iteration).
if (($# == 0)); then
  banner "stage lint: clang-format + clang-tidy (scripts/lint.sh)"
  run_step "lint" scripts/lint.sh || true
  summary+=("")
fi

banner "summary ($(fmt_secs $((SECONDS - start_all))) total)"
printf '%s\n' "${summary[@]}"
# Which tests failed, per preset (ctest lists them after "The following
# tests FAILED:"), so the last lines of a CI log name the culprit.
for preset in "${presets[@]}"; do
  log="build/${preset}/ctest.log"
  [[ -f "${log}" ]] || continue
  while IFS= read -r line; do
    printf 'FAILED TEST: %s: %s\n' "${preset}" "$(tr -s ' ' <<<"${line}" | sed 's/^ //')"
  done < <(sed -n '/The following tests FAILED:/,/^Errors while running/p' "${log}" \
             | grep -E '^[[:space:]]+[0-9]+ - ')
  # What failed inside them (ctest prints a failed test's output): the
  # gtest failure lines and the scripts' FAIL lines, so that a CI log cut
  # to its end still says why.
  grep -E ': Failure$|^\[  FAILED  \] [A-Za-z]|FAIL: |^(Expected|Value of|  Actual|Which is|  Expected)' "${log}" \
    | grep -v 'listed below' | head -40 | sed "s/^/  ${preset} detail: /"
done
if ((failed > 0)); then
  printf 'RESULT: FAIL (%d step(s) failed)\n' "${failed}"
else
  printf 'RESULT: PASS\n'
fi
# Plain closing line: ctest results added up over all presets.
printf 'tests: %d passed, %d failed\n' "${tests_passed}" "${tests_failed}"
((failed == 0))
