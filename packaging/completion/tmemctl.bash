# bash completion for tmemctl                               -*- shell-script -*-
#
# Installed as /usr/share/bash-completion/completions/tmemctl (loaded on
# demand by bash-completion). It asks tmemctl itself: subcommands, options
# and option values come from `tmemctl [SUBCOMMAND...] --help`, so the
# completion never lags behind the binary; VM names come from `tmemctl vms`
# against the socket or hosts given on the line (1 s deadline; nothing if
# tmemd does not answer). Tested by tests/package/completion_test.sh.

# Global options whose value selects the tmemd to ask for VM names.
_tmemctl_target_opts=(-s --socket -H --host --hosts --ca --cert --key
                      --server-name)

# Prints the help of the command path "$@" (tmemctl SUB...).
_tmemctl_help() {
  "$@" --help 2>/dev/null
}

# From help text on stdin: the names listed under "Subcommands:".
_tmemctl_subcommands() {
  awk '/^Subcommands:/ {s = 1; next} /^[^ ]/ {s = 0} s && NF {print $1}'
}

# From help text on stdin: every option spelling, one a line.
_tmemctl_options() {
  awk '/^Options:/ {s = 1; next} /^[^ ]/ {s = 0}
       s && $1 ~ /^-/ {n = split($1, a, ","); for (i = 1; i <= n; i++) print a[i]}'
}

# From help text on stdin: the value type of option $1 (TEXT, INT,
# TEXT:{a,b}, ...), empty for a flag.
_tmemctl_option_type() {
  awk -v opt="$1" '/^Options:/ {s = 1; next} /^[^ ]/ {s = 0}
       s && $1 ~ /^-/ {n = split($1, a, ",");
         for (i = 1; i <= n; i++) if (a[i] == opt) {
           if ($2 ~ /^[A-Z]/) print $2; exit }}'
}

_tmemctl_vm_names() {
  local -a target=()
  local i w t
  for ((i = 1; i < ${#COMP_WORDS[@]} - 1; i++)); do
    w=${COMP_WORDS[i]}
    for t in "${_tmemctl_target_opts[@]}"; do
      if [[ ${w} == "${t}" ]]; then
        target+=("${w}" "${COMP_WORDS[i + 1]}")
      fi
    done
  done
  "${COMP_WORDS[0]}" "${target[@]}" -t 1 vms 2>/dev/null | awk 'NR > 1 {print $1}'
}

_tmemctl() {
  local cur=${COMP_WORDS[COMP_CWORD]}
  local prev=${COMP_WORDS[COMP_CWORD - 1]}
  local -a path=("${COMP_WORDS[0]}")
  local help i w type positionals=0

  # Walk the words before the cursor: subcommands extend the path, options
  # that take a value skip it, the rest are positionals.
  help=$(_tmemctl_help "${path[@]}")
  for ((i = 1; i < COMP_CWORD; i++)); do
    w=${COMP_WORDS[i]}
    if [[ ${w} == -* ]]; then
      [[ ${w} == *=* ]] && continue
      type=$(_tmemctl_option_type "${w}" <<<"${help}")
      [[ -n ${type} ]] && ((i++))
    elif _tmemctl_subcommands <<<"${help}" | grep -qxF -- "${w}"; then
      path+=("${w}")
      help=$(_tmemctl_help "${path[@]}")
      positionals=0
    else
      ((positionals++))
    fi
  done

  COMPREPLY=()
  # The value of an option.
  if [[ ${prev} == -* && ${prev} != *=* ]]; then
    type=$(_tmemctl_option_type "${prev}" <<<"${help}")
    if [[ -n ${type} ]]; then
      if [[ ${type} == *:\{*\} ]]; then
        local choices=${type#*:\{}
        choices=${choices%\}}
        mapfile -t COMPREPLY < <(compgen -W "${choices//,/ }" -- "${cur}")
      elif [[ ${type} == TEXT* && ${prev} != --server-name &&
              ${prev} != --memory-cap && ${prev} != --mode &&
              ${prev} != --quota && ${prev} != --weight &&
              ${prev} != --swap-quota && ${prev} != --swap-mode ]]; then
        # Paths: sockets, host lists, certificates, keys.
        mapfile -t COMPREPLY < <(compgen -f -- "${cur}")
      elif [[ ${prev} == --mode || ${prev} == --swap-mode ]]; then
        mapfile -t COMPREPLY < <(compgen -W "default off always adaptive" -- "${cur}")
      fi
      return 0
    fi
  fi
  if [[ ${cur} == -* ]]; then
    mapfile -t COMPREPLY < <(compgen -W "$(_tmemctl_options <<<"${help}")" -- "${cur}")
    return 0
  fi
  local subs
  subs=$(_tmemctl_subcommands <<<"${help}")
  if [[ -n ${subs} ]]; then
    mapfile -t COMPREPLY < <(compgen -W "${subs}" -- "${cur}")
    return 0
  fi
  # Positionals of a leaf subcommand.
  case "${path[*]:1}" in
    "set-mode")
      if ((positionals == 1)); then
        mapfile -t COMPREPLY < <(compgen -W "default off always adaptive" -- "${cur}")
        return 0
      fi
      ;;
    "policy apply" | "fleet apply")
      mapfile -t COMPREPLY < <(compgen -f -- "${cur}")
      return 0
      ;;
  esac
  case "${path[1]}" in
    vm | set-quota | set-weight | set-mode | set-policy | freeze | thaw | flush | authorize | watch)
      if ((positionals == 0)) || [[ ${path[1]} == watch ]]; then
        mapfile -t COMPREPLY < <(compgen -W "$(_tmemctl_vm_names)" -- "${cur}")
      fi
      ;;
  esac
  return 0
} && complete -F _tmemctl tmemctl
