# gpumagic job wait (gpumagic/remote/jobs.py: Job.wait): `job-wait.sh NAME` returns once job
# NAME no longer runs (gm_job_running).  Exit 3: no job of that name.
# shellcheck shell=sh
d=$HOME/.gpumagic/jobs/$1
[ -d "$d" ] || exit 3
while gm_job_running "$d"; do
  sleep 0.2
done
