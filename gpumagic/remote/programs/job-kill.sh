# gpumagic job killer: installed (after lib.sh) as kill.sh in the job's directory and run
# there as `/bin/sh ./kill.sh REASON` (by `%gpu kill`, Job.kill, or watch.sh).  Ends the
# job's whole process tree: SIGTERM to the runner's process group, its session and every
# descendant, then SIGKILL to what is left after kill_grace seconds.  Prints `killed`,
# `ended` (it had already ended) or `lost` (its runner is gone, or the pid is no longer it).
# shellcheck shell=sh
umask 077  # what it writes in the job's directory is private, as the rest there
trap '' TERM HUP INT
reason=${1:-user}
if [ -e exit_code ]; then echo "ended"; exit 0; fi
pg=$(cat pid 2>/dev/null)
grace=$(cat kill_grace 2>/dev/null)
case $grace in ""|*[!0-9]*) grace=3 ;; esac
tree() {  # the runner, its session and process group, and all their descendants (not us)
  gm_procs | awk -v root="$pg" -v me="$$" '
    $5 ~ /^Z/ { next }  # zombies are already dead (waiting for a parent to reap them)
    { pid[NR] = $1; pp[$1] = $2; if ($1 == root || $3 == root || $4 == root) keep[$1] = 1 }
    END {
      mine[me] = 1
      do { more = 0
        for (i in pid) { p = pid[i]
          if (!(p in keep) && (pp[p] in keep)) { keep[p] = 1; more = 1 }
          if (!(p in mine) && (pp[p] in mine)) { mine[p] = 1; more = 1 } }
      } while (more)
      for (p in keep) if (!(p in mine)) print p
    }'
}
# The pid must still be this job's runner (its cwd is this directory), not a reused pid.
if [ -z "$pg" ] || ! gm_job_running "$(pwd -P)"; then
  echo "lost"; exit 0
fi
first=$(tree)
if [ -z "$first" ]; then echo "lost"; exit 0; fi
[ -e killed ] || printf '%s\n' "$reason" > killed
kill -TERM -"$pg" 2>/dev/null
# shellcheck disable=SC2086 # one pid per word
kill -TERM $first 2>/dev/null
i=0
while [ $i -lt $((grace * 10)) ]; do
  left=$(tree)
  [ -z "$left" ] && break
  sleep 0.1; i=$((i + 1))
done
left=$(tree)
# shellcheck disable=SC2086 # one pid per word
[ -n "$left" ] && kill -KILL $left 2>/dev/null
for p in $first; do kill -KILL "$p" 2>/dev/null; done
if [ ! -e exit_code ]; then
  [ -e ended ] || date +%s > ended
  echo 137 > exit_code.tmp && mv exit_code.tmp exit_code
fi
# The job's end is told once: by the runner, or here when the runner was killed before it
# got there (whichever sender claims it first; see gm_job_end_notify).  Before the group is
# killed below (this script may be in it: watch.sh runs it), a sender must have left it.
jd=$(pwd -P)
gm_job_end_notify "$jd" "$(cat name 2>/dev/null)" "$(cat exit_code 2>/dev/null)"
if [ -f "$HOME/.gpumagic/notify/config.json" ]; then
  i=0
  while [ ! -d notified ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
fi
echo "killed"
kill -KILL -"$pg" 2>/dev/null
exit 0
