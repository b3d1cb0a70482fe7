# Arm, cancel and read the budget guard (budget-guard.sh) from gpumagic/budget/guard.py.
#
#   arm DIR [SETTING=VALUE...]   install the guard program read from stdin as DIR/gpumagic-guard.sh
#                                and start it detached with these settings, replacing any earlier one
#   cancel DIR                   stop the guard (its whole process group), then as status
#   status DIR                   the clock line, then the guard's state, liveness, alert and log
#
# DIR is the guard's folder: absolute, or relative to $HOME.  The status output, read by
# gpumagic.budget.guard.parse_status:
#   clock NOW BTIME PID1_START CLK_TCK     the remote clock (epoch s), the kernel's boot
#                                         (/proc/stat btime, epoch s), PID 1's start (clock
#                                         ticks after boot, /proc/1/stat field 22; proc(5))
#   guard-state / KEY=VALUE lines / guard-end, guard-alive 0|1, guard-alert TEXT, guard-log /
#   its last 5 lines -- only when DIR/state exists.
# shellcheck shell=sh

# is_guard PID: PID is a live gpumagic guard (not a zombie, not a reused pid: its command
# line names the guard's file).
is_guard() {
  gm_alive "$1" && grep -q gpumagic-guard "/proc/$1/cmdline" 2>/dev/null
}

stop_guard() {
  p=$(cat "$d/pid" 2>/dev/null)
  case "$p" in ''|*[!0-9]*) ;; *)
    if is_guard "$p"; then
      # the group: the loop and its sleep (a trap runs only once the sleep ends)
      kill -TERM -"$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null
      i=0
      while [ "$i" -lt 50 ] && is_guard "$p"; do sleep 0.1; i=$((i + 1)); done
      kill -KILL -"$p" 2>/dev/null
    fi ;;
  esac
  rm -f "$d/pid"
}

arm() {
  umask 077  # the guard's folder and files are private (0700/0600)
  { mkdir -p "$d" && chmod 700 "$d"; } || exit 1
  cat > "$d/gpumagic-guard.sh.tmp" || exit 1
  mv -f "$d/gpumagic-guard.sh.tmp" "$d/gpumagic-guard.sh" || exit 1
  stop_guard
  rm -f "$d/state" "$d/alert" || exit 1
  cd / || exit 1
  # Its own session with no terminal, all three fds redirected: it outlives this SSH
  # connection and the laptop, and nothing keeps the channel open.
  if command -v setsid >/dev/null 2>&1; then
    setsid nohup sh "$d/gpumagic-guard.sh" run "$d" "$@" >/dev/null 2>&1 </dev/null &
  else
    nohup sh "$d/gpumagic-guard.sh" run "$d" "$@" >/dev/null 2>&1 </dev/null &
  fi
}

cancel() {
  [ -d "$d" ] || { status; return; }
  stop_guard
  rm -f "$d/alert"
  if [ -f "$d/state" ] && grep -q "^state=armed" "$d/state"; then
    sed "s/^state=armed/state=cancelled/" "$d/state" > "$d/state.tmp" && mv -f "$d/state.tmp" "$d/state"
  fi
  status
}

status() {
  printf 'clock %s %s %s %s\n' "$(date +%s)" "$(awk '/^btime/{print $2}' /proc/stat 2>/dev/null)" \
    "$(gm_pstart 1)" "$(getconf CLK_TCK 2>/dev/null)"
  [ -f "$d/state" ] || return 0
  echo "guard-state"; cat "$d/state"; echo "guard-end"
  p=$(cat "$d/pid" 2>/dev/null)
  case "$p" in ''|*[!0-9]*) echo "guard-alive 0" ;;
    *) if is_guard "$p"; then echo "guard-alive 1"; else echo "guard-alive 0"; fi ;;
  esac
  if [ -f "$d/alert" ]; then echo "guard-alert $(cat "$d/alert")"; fi
  echo "guard-log"; tail -n 5 "$d/log" 2>/dev/null
}

what=$1 d=$2
[ -n "$d" ] || { echo "usage: budget-guard-ctl.sh arm|cancel|status DIR [SETTING=VALUE...]" >&2; exit 2; }
shift 2
case "$d" in /*) ;; *) d="$HOME/$d" ;; esac
case "$what" in
  arm) arm "$@" ;;
  cancel) cancel ;;
  status) status ;;
  *) echo "usage: budget-guard-ctl.sh arm|cancel|status DIR [SETTING=VALUE...]" >&2; exit 2 ;;
esac
