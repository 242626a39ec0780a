# Sourced by the scripts in this folder (never run alone).
#   run CMD ...     CMD as this script's child: a TERM, INT or HUP sent to the script reaches it (TERM; then KILL
#                   after 10 s), so no stage, pip or pytest outlives the script that started it. A foreground child
#                   of a script that is killed keeps running; a Ctrl-C only reaches it because the terminal signals
#                   the whole group. INT goes on as TERM: a background child of a script ignores INT.
#   fail MSG VALUE  one `error:` line, VALUE quoted so that a newline in it cannot make a second line; exit 2.
_child=
_stop() {
  trap - TERM INT HUP
  # the child, also when the signal came between its start and `_child=$!` (the shell knows its jobs from the fork:
  # on a loaded machine a stop landed there, and the child outlived the script)
  local pids p alive
  pids="$_child $(jobs -p)"
  if [ -n "${pids// /}" ]; then
    kill -TERM $pids 2>/dev/null || true
    for _ in $(seq 100); do
      alive=
      for p in $pids; do kill -0 "$p" 2>/dev/null && alive=1; done
      [ -n "$alive" ] || break
      sleep 0.1
    done
    kill -KILL $pids 2>/dev/null || true
  fi
  exit 143
}
trap _stop TERM INT HUP
run() {
  local rc=0
  "$@" &
  _child=$!
  wait "$_child" || rc=$?
  _child=
  return "$rc"
}
fail() {  # fail "NAME=" VALUE "what was expected"
  printf 'error: %s%q: %s\n' "$1" "$2" "$3" >&2
  exit 2
}
