# exec-cell.sh DIR WAIT/GRACE CWD_MISSING N ENV1..ENVN ARGV...: the wrapper every cell runs in
# (gpumagic/remote/execution.py, build_program).  It
# * enters DIR (empty: stay; "~" and "~/x" in $HOME; a relative path from $HOME), or exits
#   CWD_MISSING with a message on stderr;
# * starts a watchdog that reads this shell's stdin (the SSH channel, handed over as fd 3):
#   when the channel closes (an interrupt, a timeout, a dropped connection) it sends SIGINT
#   to the whole process group (a terminal's Ctrl-C: the program's handler and `finally:`
#   run), SIGTERM WAIT seconds later, then SIGKILL GRACE seconds after that, so nothing the
#   cell started is left running;
# * applies the N environment entries (NAME=VALUE exports it, a bare NAME unsets it);
# * runs ARGV with stdin from /dev/null and exits with its status.
# The values arrive as shell words read from stdin, never in a process's argv.
# shellcheck shell=sh
_gm_d=$1 _gm_wait=${2%/*} _gm_grace=${2#*/} _gm_missing=$3 _gm_n=$4
shift 4
# shellcheck disable=SC2088 # a literal "~" typed as the directory, expanded here
case $_gm_d in
  "~") _gm_d=$HOME ;;
  "~/"*) _gm_d=$HOME/${_gm_d#"~/"} ;;
  /*) ;;
  ?*) _gm_d=$HOME/$_gm_d ;;
esac
if [ -n "$_gm_d" ] && ! cd -- "$_gm_d" 2>/dev/null; then
  printf 'gpumagic: cannot enter directory %s on this machine\n' "$_gm_d" >&2; exit "$_gm_missing"
fi
exec 3<&0
# shellcheck disable=SC2016 # $1 is the watchdog's own argument
exec /bin/sh -c 'trap "" INT TERM; while IFS= read -r _; do :; done
kill -INT 0; sleep "$1"; kill -TERM 0; sleep "$2"; kill -KILL 0' \
  gpumagic-watchdog "$_gm_wait" "$_gm_grace" <&3 >/dev/null 2>&1 &
_gm_watchdog=$!
exec 3<&-
while [ "$_gm_n" -gt 0 ]; do
  case $1 in
    *=*) export "${1?}" ;;
    *) unset "$1" ;;
  esac
  shift; _gm_n=$((_gm_n - 1))
done
"$@" </dev/null
_gm_rc=$?
kill -KILL "$_gm_watchdog" 2>/dev/null
exit "$_gm_rc"
