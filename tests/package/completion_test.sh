#!/usr/bin/env bash
# tmemctl's bash completion (packaging/completion/tmemctl.bash), sourced in
# bash and driven as bash drives it (COMP_WORDS/COMP_CWORD, then the
# function): subcommands (top level and nested), options, option values,
# positionals, and VM names from a real tmemd. The expected subcommands are
# also checked against `tmemctl --help`, so a new subcommand shows here.
#
# Usage: completion_test.sh COMPLETION_SCRIPT TMEMCTL TMEMD
set -euo pipefail
script="$1"
tmemctl_bin="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"
tmemd_bin="$3"

fail() { printf 'completion_test: FAIL: %s\n' "$*" >&2; exit 1; }
work="$(mktemp -d /tmp/tmemd-completion-test.XXXXXX)"
tmemd_pid=""
cleanup() {
  [[ -n "${tmemd_pid}" ]] && kill "${tmemd_pid}" 2>/dev/null && wait "${tmemd_pid}" 2>/dev/null
  rm -rf "${work}"
}
trap cleanup EXIT

# `tmemctl` resolves to the built binary, as the installed one would.
mkdir "${work}/bin"
ln -s "${tmemctl_bin}" "${work}/bin/tmemctl"
PATH="${work}/bin:${PATH}"

# shellcheck source=/dev/null
source "${script}"
[[ "$(complete -p tmemctl)" == "complete -F _tmemctl tmemctl" ]] \
  || fail "sourcing did not register: $(complete -p tmemctl 2>&1)"

# Completions of LINE (the cursor at its end), sorted, space-separated.
completions() {
  local line="$1"
  read -r -a COMP_WORDS <<<"${line}"
  [[ "${line}" == *" " ]] && COMP_WORDS+=("")
  COMP_CWORD=$((${#COMP_WORDS[@]} - 1))
  COMP_LINE="${line}"
  COMP_POINT=${#line}
  COMPREPLY=()
  _tmemctl
  printf '%s\n' "${COMPREPLY[@]}" | sort | xargs
}

checks=0
expect() {  # LINE EXPECTED
  local got
  got="$(completions "$1")"
  [[ "${got}" == "$2" ]] || fail "'$1<TAB>': expected [$2], got [${got}]"
  printf 'ok  %-40s -> %s\n' "'$1'" "${got}"
  checks=$((checks + 1))
}
expect_has() {  # LINE WORD...
  local got w line="$1"
  shift
  got=" $(completions "${line}") "
  for w in "$@"; do
    [[ "${got}" == *" ${w} "* ]] || fail "'${line}<TAB>': lacks ${w} in [${got}]"
  done
  printf 'ok  %-40s -> has %s\n' "'${line}'" "$*"
  checks=$((checks + 1))
}

all_subcommands="attach authorize detach fleet flush freeze policy set-host set-mode set-policy set-quota set-weight status thaw vm vms watch"
expect "tmemctl " "${all_subcommands}"
from_help="$(tmemctl --help | awk '/^Subcommands:/ {s = 1; next} /^[^ ]/ {s = 0} s && NF {print $1}' | sort | xargs)"
[[ "${from_help}" == "${all_subcommands}" ]] \
  || fail "tmemctl --help lists [${from_help}], this test expects [${all_subcommands}]"
expect "tmemctl set-" "set-host set-mode set-policy set-quota set-weight"
expect "tmemctl --so" "--socket"
expect "tmemctl -o " "json table"
expect "tmemctl -o json st" "status"
expect "tmemctl -s /run/x.sock -t 2 fr" "freeze"
expect_has "tmemctl -" -s --socket -H --host --hosts --ca --cert --key --timeout -o --output
expect "tmemctl set-mode g1 " "adaptive always default off"
expect "tmemctl set-host --mode a" "adaptive always"
expect "tmemctl set-policy g1 --swap-m" "--swap-mode"
expect "tmemctl set-policy g1 --swap-mode o" "off"
expect "tmemctl set-host --" "--cpu-budget --generation --help --memory-cap --mode"
expect "tmemctl watch --i" "--interval-ms"
expect "tmemctl policy " "apply"
expect "tmemctl fleet --etcd e1:2379 " "apply history rollback status"
expect "tmemctl fleet --etcd-c" "--etcd-ca --etcd-cert"
touch "${work}/policy.toml"
expect "tmemctl policy apply ${work}/pol" "${work}/policy.toml"

# VM names from a running tmemd, through the socket given on the line.
"${tmemd_bin}" --socket-dir "${work}" --memory-cap 64MiB --workers 1 \
  --vm g1 --vm web-2 >"${work}/tmemd.log" 2>&1 &
tmemd_pid=$!
for _ in $(seq 1 600); do
  grep -q 'event=tmemd_ready' "${work}/tmemd.log" && break
  kill -0 "${tmemd_pid}" 2>/dev/null || fail "tmemd exited: $(cat "${work}/tmemd.log")"
  sleep 0.1
done
grep -q 'event=tmemd_ready' "${work}/tmemd.log" || fail "tmemd not ready in 60 s"
sock="${work}/control.sock"
expect "tmemctl -s ${sock} freeze " "g1 web-2"
expect "tmemctl -s ${sock} vm w" "web-2"
expect "tmemctl --socket ${sock} watch g1 " "g1 web-2"
expect "tmemctl -s ${sock} set-quota g1 " ""
# No tmemd behind the socket: no names, quickly, no error on the terminal.
expect "tmemctl -s ${work}/none.sock freeze " ""
echo "completion_test: PASS (${checks} completions)"
