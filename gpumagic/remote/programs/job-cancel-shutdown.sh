# gpumagic: cancel the pending (or future) shutdown armed by `--then-shutdown` for job $1
# (gpumagic/remote/jobs.py: Job.cancel_shutdown).  Prints `cancelled`, `none` (none was
# armed), `started` (too late) or `nojob`.  `mv` is atomic, so exactly one of this program and
# the timer in job-run.sh wins the `shutdown` file.
# shellcheck shell=sh
umask 077  # what it writes in the job's directory is private, as the rest there
d=$HOME/.gpumagic/jobs/$1
[ -d "$d" ] || { echo "nojob"; exit 0; }
cd "$d" || exit 0
[ -e shutdown_command ] || { echo "none"; exit 0; }
stop_timer() {
  p=$(cat shutdown_pid 2>/dev/null)
  [ -n "$p" ] || return 0
  for c in $(gm_procs | awk -v p="$p" '$2 == p { print $1 }'); do
    kill -TERM "$c" 2>/dev/null
  done
  kill -TERM "$p" 2>/dev/null
}
if mv shutdown shutdown_cancelled 2>/dev/null; then stop_timer; echo "cancelled"; exit 0; fi
[ -e shutdown_started ] && { echo "started"; exit 0; }
[ -e shutdown_cancelled ] || date +%s > shutdown_cancelled
mv shutdown shutdown_cancelled.late 2>/dev/null && stop_timer
[ -e shutdown_started ] && { echo "started"; exit 0; }
echo "cancelled"
