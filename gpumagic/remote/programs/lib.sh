# gpumagic's shell library: sourced (as text, first) by every shell program gpumagic runs on the
# machine (gpumagic/remote/program.py).  POSIX sh only: the machine's /bin/sh may be dash.
# shellcheck shell=sh

# gm_alive PID: true while PID is a live process.  A zombie (state Z in /proc/PID/stat: it
# exited and waits for its parent) counts as ended, which `kill -0` alone does not tell.
gm_alive() {
  case $1 in ""|*[!0-9]*) return 1 ;; esac  # no pid (an empty pid file) is no process
  kill -0 "$1" 2>/dev/null || [ -d "/proc/$1" ] || return 1
  [ -r "/proc/$1/stat" ] || return 0  # no /proc (macOS): kill -0 is all there is
  # The state is the field after the ')' that ends the command name (which may hold spaces).
  _gm_state=$(sed 's/.*) \(.\).*/\1/' "/proc/$1/stat" 2>/dev/null) || return 1
  [ -n "$_gm_state" ] && [ "$_gm_state" != Z ] && [ "$_gm_state" != X ]
}

# gm_pstart PID: the process's start time (clock ticks since boot, /proc/PID/stat field 22),
# to tell a reused PID from the process that was recorded; empty without /proc.
gm_pstart() {
  sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f20
}

# gm_find TOOL: the path of TOOL, looked for on PATH and then where GPU images keep tools off
# a non-login PATH (nvidia-smi under /usr/local/nvidia/bin, shutdown under /sbin, ...).
# Prints nothing and fails when it is nowhere.
gm_find() {
  _gm_p=$(command -v "$1" 2>/dev/null) && [ -n "$_gm_p" ] && { printf '%s\n' "$_gm_p"; return 0; }
  for _gm_d in /usr/local/sbin /usr/local/bin /usr/sbin /usr/bin /sbin /bin \
               /usr/local/nvidia/bin /usr/local/cuda/bin /usr/lib/wsl/lib /opt/conda/bin; do
    [ -x "$_gm_d/$1" ] && { printf '%s\n' "$_gm_d/$1"; return 0; }
  done
  return 1
}

# gm_python: the machine's Python 3 interpreter (python3, else a python that is 3.x).
gm_python() {
  gm_find python3 && return 0
  _gm_p=$(gm_find python) || return 1
  "$_gm_p" -c 'import sys; sys.exit(sys.version_info[0] != 3)' 2>/dev/null && printf '%s\n' "$_gm_p"
}

# gm_detach CMD [ARG...]: start CMD in the background outside the caller's process tree,
# process group and session (setsid where it exists), stdio on /dev/null, immune to SIGHUP;
# so a job's kill.sh, which ends the runner's whole tree, never ends it.
# gm_job_end_notify JOB_DIR NAME EXIT_CODE: the job's end, told once (gpumagic.budget.notify;
# nothing when not set up).  The runner calls it when the job ends; kill.sh calls it too, for
# a runner it had to kill before it got there.  The sender claims the job by making
# JOB_DIR/notified only once detached (gm_detach), so a kill of the runner's process group
# never takes the claim with it: the first sender to get that far sends, any other exits.
gm_job_end_notify() {
  [ -f "$HOME/.gpumagic/notify/config.json" ] || return 0
  # shellcheck disable=SC2016 # expanded by the detached sh, from its arguments
  gm_detach /bin/sh -c 'mkdir "$1/notified" 2>/dev/null || exit 0
exec python3 "$HOME/.gpumagic/notify/notify.py" --event job-end --job "$2" --job-dir "$1" --exit-code "$3" --log "$1/log"' \
    gm-notify "$1" "$2" "$3"
}
gm_detach() {
  # HUP is ignored before the fork, in the subshell the caller waits for, so the detached
  # process is born ignoring it: a tmux pane closing as the caller exits sends HUP at once,
  # and a trap set inside the background process could come too late (a job-end message was
  # lost that way on a loaded machine).
  ( trap '' HUP
    (
      if command -v setsid >/dev/null 2>&1; then exec setsid nohup "$@"; fi
      exec nohup "$@"
    ) </dev/null >/dev/null 2>&1 & )
}

# gm_procs: one line per process, "PID PPID SID PGID STATE", from ps or, where ps is missing
# (slim containers), from /proc/PID/stat (proc(5): after the parenthesised command name come
# state, ppid, pgrp, session).
gm_procs() {
  if command -v ps >/dev/null 2>&1; then
    ps -e -o pid= -o ppid= -o sid= -o pgid= -o stat= 2>/dev/null; return
  fi
  for _gm_f in /proc/[0-9]*/stat; do
    read -r _gm_l < "$_gm_f" 2>/dev/null || continue
    _gm_p=${_gm_f#/proc/}; _gm_p=${_gm_p%/stat}
    # shellcheck disable=SC2086 # split the stat fields
    set -- ${_gm_l##*) }
    echo "$_gm_p $2 $4 $3 $1"
  done
}

# gm_lock_held LOCK: the process that the symlink LOCK names ("PID PSTART") is alive and is
# still that process (its start time matches: not a pid reused after a reboot).
gm_lock_held() {
  _gm_l=$(readlink "$1" 2>/dev/null) || return 1
  _gm_o=${_gm_l%% *}; _gm_t=${_gm_l#* }
  [ "$_gm_t" != "$_gm_l" ] && gm_alive "$_gm_o" && [ "$(gm_pstart "$_gm_o")" = "$_gm_t" ]
}

# gm_job_running DIR: the one test of "is this gpumagic job still running"
# (gpumagic/remote/jobs.py): no DIR/exit_code yet, and the pid in DIR/pid is alive (a zombie
# is not: see gm_alive) and still this job's runner (its /proc/PID/cwd is DIR; where /proc is
# missing, gm_alive alone decides).  Before the runner has written its pid, the job runs while
# a live launcher holds the job's start lock (JOBS/.NAME.lock, see job-launch.sh).
gm_job_running() {
  [ -e "$1/exit_code" ] && return 1
  _gm_p=$(cat "$1/pid" 2>/dev/null)
  if [ -z "$_gm_p" ]; then gm_lock_held "${1%/*}/.${1##*/}.lock"; return; fi
  gm_alive "$_gm_p" || return 1
  _gm_c=$(readlink "/proc/$_gm_p/cwd" 2>/dev/null) || return 0
  [ "$_gm_c" = "$(cd "$1" 2>/dev/null && pwd -P)" ]
}
