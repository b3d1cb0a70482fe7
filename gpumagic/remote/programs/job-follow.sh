# gpumagic job log (gpumagic/remote/jobs.py: Job.logs, Job.follow).
#
#   job-follow.sh NAME LINES FOLLOW
#
# Prints job NAME's log from LINES lines before its end (`all`: from the start) and, with
# FOLLOW = 1, keeps printing what is appended until the job ends (gm_job_running).
# Exit 3: no job of that name.
# shellcheck shell=sh
name=$1 lines=$2 follow=$3
d=$HOME/.gpumagic/jobs/$name
[ -d "$d" ] || { echo "no job named $name" >&2; exit 3; }
cd "$d" || exit 3
[ -e log ] || : > log
pos=$(wc -c < log)
if [ "$lines" = all ]; then head -c "$pos" log; else head -c "$pos" log | tail -n "$lines"; fi
[ "$follow" = 1 ] || exit 0
while :; do
  r=0; gm_job_running "$d" && r=1
  size=$(wc -c < log)
  if [ "$size" -gt "$pos" ]; then
    tail -c +$((pos + 1)) log | head -c $((size - pos))
    pos=$size
  fi
  [ $r = 1 ] || break
  sleep 0.2
done
