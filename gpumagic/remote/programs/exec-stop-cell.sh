# exec-stop-cell.sh GRACE PGID RUNNER: stop a cell whose SSH connection was lost
# (gpumagic/remote/execution.py, _stop_elsewhere), run over a new connection.  After a
# roam the machine's sshd does not know the old connection is gone, so the cell and its
# runner (exec-runner.py, or exec-cell.sh's watchdog) would keep running for hours.
# * PGID (0: not known) is the cell's process group (its session: the runner starts each cell
#   with setsid; exec-cell.sh's is its login shell's): SIGTERM to it, SIGKILL to what is left
#   GRACE seconds later.
# * RUNNER (0: none) is the cell runner of the old connection, ended with SIGTERM only when
#   /proc says it is one (its command line holds the program's name), never a reused PID: its
#   watchdog then stops every cell it had started.
# Prints `stopped` (the group was running and is gone now), `gone` (it had ended already), or
# `left` (it outlived SIGKILL: a process in uninterruptible sleep, D state).
# shellcheck shell=sh
grace=$1 pgid=$2 runner=$3
case $grace in ""|*[!0-9.]*) grace=1 ;; esac
case $pgid in ""|*[!0-9]*) pgid=0 ;; esac
case $runner in ""|*[!0-9]*) runner=0 ;; esac
group_alive() {  # a live (not zombie) process in the group (gm_procs: pid ppid sid pgid stat)
  [ "$pgid" -gt 1 ] || return 1
  gm_procs | awk -v g="$pgid" '$4 == g && $5 !~ /^Z/ { found = 1 } END { exit !found }'
}
was=gone
if group_alive; then
  was=running
  kill -s TERM -- "-$pgid" 2>/dev/null
fi
if [ "$runner" -gt 1 ] && tr '\0' ' ' < "/proc/$runner/cmdline" 2>/dev/null | grep -q 'exec-runner'; then
  kill -TERM "$runner" 2>/dev/null
fi
if [ "$was" = running ]; then
  i=0
  ticks=$(awk -v g="$grace" 'BEGIN { printf "%d", g * 10 }')
  while [ "$i" -lt "$ticks" ] && group_alive; do sleep 0.1; i=$((i + 1)); done
  group_alive && kill -s KILL -- "-$pgid" 2>/dev/null
  i=0
  while [ "$i" -lt 20 ] && group_alive; do sleep 0.1; i=$((i + 1)); done
  if group_alive; then echo left; exit 0; fi
  echo stopped
else
  echo gone
fi
