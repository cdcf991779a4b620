#!/usr/bin/env bash
# Lints tmemd's C++ (clang-format, check only; clang-tidy) and the guest
# driver's kernel C (checkpatch.pl: the module and guest-driver/core).
#
# Usage: scripts/lint.sh [--fix-format] [--format-only | --tidy-only |
#                         --checkpatch-only]
#   --fix-format  rewrite files with clang-format -i instead of checking them
#   --format-only / --tidy-only / --checkpatch-only  run one part
# checkpatch.pl comes from the guest kernel source that vm-images/build-all.sh
# unpacks under /var/cache/tmemd-vm (or TMEM_CHECKPATCH=/path/checkpatch.pl).
# Without it the checkpatch step FAILS with a message saying so; set
# TMEM_LINT_ALLOW_NO_CHECKPATCH=1 to report it as "not run" instead.
# Environment: TMEM_JOBS (default 2), TMEM_LINT_BUILD_DIR (default
#   build/release), TMEM_LINT_DIRS (default
#   "backend host-agent guest-driver/userspace tests bench"). proto/tmem_abi.h
#   is C shared with the kernel module: kernel style, not linted here.
#
# clang-tidy uses build/release/compile_commands.json (configured here if
# missing) and checks the .cc files of those folders that the build compiles.
# Exit status: 0 when both are clean, 1 otherwise. The report of each tool is
# also saved under build/lint/.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${root}" || exit 1
jobs="${TMEM_JOBS:-2}"
read -r -a dirs <<<"${TMEM_LINT_DIRS:-backend host-agent guest-driver/userspace tests bench}"
db_dir="${TMEM_LINT_BUILD_DIR:-build/release}"
out="build/lint"

do_format=1 do_tidy=1 do_checkpatch=1 fix=0
for arg in "$@"; do
  case "${arg}" in
    --fix-format) fix=1 ;;
    --format-only) do_tidy=0 do_checkpatch=0 ;;
    --tidy-only) do_format=0 do_checkpatch=0 ;;
    --checkpatch-only) do_format=0 do_tidy=0 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "unknown argument: ${arg}" >&2; exit 2 ;;
  esac
done

existing=()
for d in "${dirs[@]}"; do [[ -d "${d}" ]] && existing+=("${d}"); done
mkdir -p "${out}"
status=0
format_result="skipped" tidy_result="skipped" checkpatch_result="skipped"

if ((do_format)); then
  mapfile -t files < <(find "${existing[@]}" -type f \( -name '*.cc' -o -name '*.h' \) | sort)
  echo "== clang-format: ${#files[@]} files in ${existing[*]}"
  if ((${#files[@]} == 0)); then
    format_result="no files"
  elif ((fix)); then
    clang-format -i "${files[@]}"
    format_result="rewrote ${#files[@]} files"
  else
    clang-format --dry-run -Werror "${files[@]}" >"${out}/clang-format.txt" 2>&1
    bad="$(grep -oE '^[^:]+\.(cc|h):' "${out}/clang-format.txt" | sort -u | wc -l)"
    if ((bad > 0)); then
      grep -oE '^[^:]+\.(cc|h):' "${out}/clang-format.txt" | sort -u | tr -d ':' | sed 's/^/  needs formatting: /'
      echo "  (see ${out}/clang-format.txt; fix with scripts/lint.sh --fix-format)"
      format_result="FAIL: ${bad} of ${#files[@]} files need formatting"
      status=1
    else
      format_result="clean (${#files[@]} files)"
    fi
  fi
fi

if ((do_tidy)); then
  if [[ ! -f "${db_dir}/compile_commands.json" ]]; then
    echo "== configuring the release preset for compile_commands.json"
    cmake --preset release >"${out}/configure.log" 2>&1 \
      || { cat "${out}/configure.log"; echo "configure failed" >&2; exit 1; }
  fi
  # The .cc files under our folders that the build actually compiles.
  dir_re="$(IFS='|'; echo "${existing[*]}")"
  mapfile -t tus < <(grep -oE '"file": *"[^"]+"' "${db_dir}/compile_commands.json" \
    | sed -E 's/"file": *"([^"]+)"/\1/' \
    | grep -E "^${root}/(${dir_re})/.*\.cc$" | sort -u)
  echo "== clang-tidy: ${#tus[@]} translation units (-j${jobs})"
  if ((${#tus[@]} == 0)); then
    tidy_result="no translation units"
  else
    # Root-anchored: our headers, never generated ones under build/. The
    # kernel-style C of guest-driver/core is checkpatch's, like proto/.
    root_re="$(printf '%s' "${root}" | sed 's/[][\.*^$+?(){}|/]/\\&/g')"
    header_filter="^${root_re}/(backend|host-agent|guest-driver/userspace|tests|bench)/"
    printf '%s\0' "${tus[@]}" \
      | xargs -0 -n 1 -P "${jobs}" clang-tidy --quiet -p "${db_dir}" \
          --header-filter="${header_filter}" >"${out}/clang-tidy.txt" 2>"${out}/clang-tidy.stderr"
    tidy_rc=$?
    # A header's warning repeats once per file including it: count it once.
    warnings="$(grep -E ': warning: ' "${out}/clang-tidy.txt" | sort -u | wc -l)"
    errors="$(grep -E ': error: ' "${out}/clang-tidy.txt" | sort -u | wc -l)"
    if ((warnings + errors > 0)); then
      grep -E ': (warning|error): ' "${out}/clang-tidy.txt" | sort -u | sed 's/^/  /'
      echo "  (full report: ${out}/clang-tidy.txt)"
      tidy_result="FAIL: ${warnings} warning(s), ${errors} error(s) in ${#tus[@]} files"
      status=1
    elif ((tidy_rc != 0)); then
      cat "${out}/clang-tidy.stderr"
      tidy_result="FAIL: clang-tidy exited ${tidy_rc}"
      status=1
    else
      tidy_result="clean (${#tus[@]} files)"
    fi
  fi
fi

if ((do_checkpatch)); then
  # Kernel-style C: the module and the guest core it is built from.
  mapfile -t kfiles < <(find guest-driver -maxdepth 2 -type f \( -name '*.c' -o -name '*.h' \) \
    -not -path 'guest-driver/userspace/*' | sort)
  checkpatch="${TMEM_CHECKPATCH:-}"
  if [[ -z "${checkpatch}" ]]; then
    for c in /var/cache/tmemd-vm/kernel-5.10-*/linux/scripts/checkpatch.pl; do
      [[ -f "${c}" ]] && checkpatch="${c}" && [[ "${c}" != *.tmp/* ]] && break
    done
  fi
  echo "== checkpatch.pl: ${#kfiles[@]} files (${kfiles[*]})"
  if [[ -z "${checkpatch}" || ! -f "${checkpatch}" ]]; then
    echo "  checkpatch.pl NOT FOUND: build the guest kernel (vm-images/build-all.sh) or set TMEM_CHECKPATCH"
    if [[ "${TMEM_LINT_ALLOW_NO_CHECKPATCH:-0}" == 1 ]]; then
      checkpatch_result="NOT RUN (checkpatch.pl not found; allowed by TMEM_LINT_ALLOW_NO_CHECKPATCH)"
    else
      checkpatch_result="FAIL: NOT RUN, checkpatch.pl not found"
      status=1
    fi
  elif perl "${checkpatch}" --no-tree --terse -f "${kfiles[@]}" >"${out}/checkpatch.txt" 2>&1; then
    checkpatch_result="clean (${#kfiles[@]} files, ${checkpatch})"
  else
    grep -E '(ERROR|WARNING|CHECK):' "${out}/checkpatch.txt" | sed 's/^/  /'
    n="$(grep -cE '(ERROR|WARNING|CHECK):' "${out}/checkpatch.txt")"
    checkpatch_result="FAIL: ${n} problem(s) (see ${out}/checkpatch.txt)"
    status=1
  fi
fi

echo "== lint summary"
echo "  clang-format: ${format_result}"
echo "  clang-tidy:   ${tidy_result}"
echo "  checkpatch:   ${checkpatch_result}"
exit "${status}"
