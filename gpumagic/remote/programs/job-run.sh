# gpumagic job runner: installed (after lib.sh) as run.sh in the job's directory by
# job-launch.sh and run there as `/bin/sh ./run.sh` (its pid leads the job's process group).
# Do not edit while the job runs.  The layout of the job directory: gpumagic/remote/jobs.py.
# shellcheck shell=sh
umask 077  # the job's own files (pid, exit_code, ...) are private; the command gets the user's
echo $$ > pid.tmp && mv pid.tmp pid
# shellcheck disable=SC2034 # a signal for the job must not stop us before exit_code is written
trap 'sig=1' TERM INT HUP
jd=$(pwd -P)
interp=$(cat interp)
# shellcheck disable=SC1091 # written by job-launch.sh: the job's environment
. ./env.sh
export PYTHONUNBUFFERED="${PYTHONUNBUFFERED-1}"
GPUMAGIC_JOB="$(cat name)"
export GPUMAGIC_JOB
echo "gpumagic job $GPUMAGIC_JOB: its output goes to $jd/log (tail -f it; Ctrl-b d detaches)"
if [ -s stop_on ]; then
  /bin/sh ./watch.sh </dev/null >/dev/null 2>&1 &
fi
(
  umask "$(cat umask)"
  wd=$(cat workdir)
  # shellcheck disable=SC2088 # a literal "~" typed as the directory, expanded here
  case $wd in "~") wd=$HOME ;; "~/"*) wd=$HOME/${wd#"~/"} ;; /*) ;; ?*) wd=$HOME/$wd ;; esac
  if [ -n "$wd" ] && ! cd -- "$wd" 2>/dev/null; then
    echo "gpumagic: cannot enter directory $wd on this machine"; exit 97
  fi
  if [ "$interp" = python3 ]; then exec python3 -u "$jd/command"; fi
  exec bash "$jd/command"
) >>log 2>&1 </dev/null
rc=$?
date +%s > ended.tmp && mv ended.tmp ended
# The job is over: stop whatever it left in its process group (the watcher too).
for p in $(gm_procs | awk -v g=$$ '$4 == g && $1 != g && $5 !~ /^Z/ { print $1 }'); do
  kill -TERM "$p" 2>/dev/null
done
if [ "$rc" = 0 ] && [ -s shutdown_command ] && [ ! -e killed ]; then
  grace=$(cat shutdown_grace)
  echo $(( $(date +%s) + grace )) > shutdown.tmp && mv shutdown.tmp shutdown
  # A cancel that came while the job ran (see job-cancel-shutdown.sh): renames are the arbiter.
  [ -e shutdown_cancelled ] && mv shutdown shutdown_cancelled.late 2>/dev/null
  if [ -e shutdown ]; then
    # HUP ignored before the fork (as gm_detach does): the pane's HUP as we exit may come
    # before a trap inside the background subshell would run
    ( trap '' HUP
      (
        sleep "$grace"
        if mv shutdown shutdown_started 2>/dev/null; then
          date +%s >> shutdown_started
          /bin/sh -c "$(cat shutdown_command)"
        fi
      ) </dev/null >>shutdown.log 2>&1 &
      echo $! > shutdown_pid )
  fi
fi
echo "$rc" > exit_code.tmp && mv exit_code.tmp exit_code
# Tell the user away from the notebook (once; kill.sh tells it when it killed us first).
gm_job_end_notify "$jd" "$GPUMAGIC_JOB" "$rc"
