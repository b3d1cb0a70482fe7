# gpumagic job launcher (gpumagic/remote/jobs.py: jobs.start): one round trip that creates the
# job's directory under ~/.gpumagic/jobs and starts its runner in tmux, else setsid nohup.
#
#   job-launch.sh NAME WORKDIR INTERP STOP_ON SD_CMD SD_GRACE ALERTS KILL_GRACE TOOLDIRS
#
# The command text arrives on stdin.  Shell variables set before this program (never in an
# argv, never exported): RUN, KILL, WATCH (the job's run.sh, kill.sh, watch.sh), STOP_RE and
# RE_<kind> (the alert patterns), JOBENV (`export`/`unset` lines giving the job's environment,
# applied only where env.sh is written: no value reaches a tmux server's environment).
# Prints `ok RUNNER PATH PID [TMUX-ERROR]`, `running`, `norunner` or `error MESSAGE` last.
#
# Starting is atomic per name: the start lock is a symlink, JOBS/.NAME.lock -> "PID PSTART"
# (symlink(2) is atomic and carries its owner, so no launcher ever sees a lock whose owner is
# not yet written), held from the "is it running?" check until the runner has written its pid.
# A second launcher that finds it held by a live launcher prints `running`; one whose owner died
# (SIGKILL, a reboot) is broken.  Everything is created private (umask 077: directories 0700,
# files 0600); the command itself runs with the user's umask.
# shellcheck shell=sh
# shellcheck disable=SC2154 # RUN, KILL, WATCH, STOP_RE, RE_<kind>, JOBENV: see above
name=$1 workdir=$2 interp=$3 stop_on=$4 sd_cmd=$5 sd_grace=$6 alerts=$7 kill_grace=$8 tooldirs=$9
# The directories searched for tmux (then setsid/nohup) after this shell's PATH.
search=$PATH
IFS=:
for t in $tooldirs; do
  # shellcheck disable=SC2088 # a literal "~/" prefix, replaced by $HOME
  case $t in "~/"*) t=$HOME/${t#"~/"} ;; esac
  search=$search:$t
done
unset IFS
find_tool() {  # find_tool NAME -> absolute path on $search
  _IFS=$IFS; IFS=:
  for _d in $search; do
    if [ -n "$_d" ] && [ -f "$_d/$1" ] && [ -x "$_d/$1" ]; then IFS=$_IFS; echo "$_d/$1"; return 0; fi
  done
  IFS=$_IFS; return 1
}
um=$(umask)
umask 077
base=$HOME/.gpumagic/jobs
d=$base/$name
lock=$base/.$name.lock
mkdir -p "$base" || { echo "error cannot create $base"; exit 0; }
chmod 700 "$HOME/.gpumagic" "$base" 2>/dev/null
me="$$ $(gm_pstart $$)"
broke=0
# (`ln -s` onto a directory would make a link inside it and succeed.)
[ -d "$lock" ] && [ ! -L "$lock" ] && { echo "error $lock is not a start lock gpumagic made: remove it"; exit 0; }
while ! ln -s "$me" "$lock" 2>/dev/null; do
  if ! seen=$(readlink "$lock" 2>/dev/null); then
    [ -e "$lock" ] || continue  # released meanwhile: try again
    echo "error $lock is not a start lock gpumagic made: remove it"; exit 0
  fi
  if gm_lock_held "$lock"; then echo "running"; exit 0; fi
  # The launcher that took it is gone: break the lock.  Of several breakers one wins the mv;
  # one that took a lock taken afresh meanwhile (not the dead owner's) puts it back.
  broke=$((broke + 1))
  [ $broke -le 5 ] || { echo "error cannot take the start lock $lock"; exit 0; }
  if mv "$lock" "$lock.stale.$$" 2>/dev/null; then
    took=$(readlink "$lock.stale.$$" 2>/dev/null)
    rm -f "$lock.stale.$$"
    [ "$took" = "$seen" ] || ln -s "$took" "$lock" 2>/dev/null
  fi
done
trap 'rm -f "$lock"' EXIT
trap 'exit 1' HUP INT TERM PIPE
if [ -d "$d" ]; then
  if [ -s "$d/pid" ] && gm_job_running "$d"; then echo "running"; exit 0; fi
  s=$(cat "$d/started" 2>/dev/null)
  case $s in ""|*[!0-9]*) s=$(date +%s) ;; esac
  old=$name-$s
  [ -e "$base/$old" ] && old=$old-$$
  mv "$d" "$base/$old" || { echo "error cannot move the ended job aside to $base/$old"; exit 0; }
  echo "archived $old"
fi
mkdir "$d" || { echo "error cannot create $d"; exit 0; }
cd "$d" || { echo "error cannot enter $d"; exit 0; }
cat > ./command
date +%s > started
: > log
printf '%s\n' "$name" > name
printf '%s\n' "$workdir" > workdir
printf '%s\n' "$interp" > interp
printf '%s\n' "$um" > ./umask
printf '%s\n' "$kill_grace" > kill_grace
printf '%s' "$RUN" > run.sh
printf '%s' "$KILL" > kill.sh
printf '%s' "$WATCH" > watch.sh
if [ -n "$stop_on" ]; then
  printf '%s\n' "$stop_on" > stop_on
  printf '%s\n' "$STOP_RE" > stop_on_re
  for k in $(printf '%s' "$stop_on" | tr ',' ' '); do
    eval "printf '%s\n' \"\$RE_$k\"" > "stop_on_re.$k"
  done
fi
[ "$alerts" = 1 ] || : > no_alerts
if [ -n "$sd_cmd" ]; then
  printf '%s\n' "$sd_cmd" > shutdown_command
  printf '%s\n' "$sd_grace" > shutdown_grace
fi
(
  unset RUN KILL WATCH STOP_RE RE_nan RE_oom RE_traceback TMUX TMUX_PANE OLDPWD
  eval "$JOBENV" && unset JOBENV && export -p > env.sh
) || { cd /; rm -rf "$d"; echo "error cannot write the job's environment"; exit 0; }
unset RUN KILL WATCH STOP_RE RE_nan RE_oom RE_traceback JOBENV TMUX TMUX_PANE
tmux=$(find_tool tmux) || tmux=
why=
if [ -n "$tmux" ]; then
  # A finished job's session kept open by a `remain-on-exit` setting would block the name.
  "$tmux" kill-session -t "=gpumagic-$name" 2>/dev/null
  if err=$(umask "$um"; "$tmux" new-session -d -s "gpumagic-$name" -c "$d" /bin/sh ./run.sh 2>&1 </dev/null); then
    echo tmux > runner
  else
    why=$(printf '%s' "$err" | tr '\n' ' ')
    tmux=
  fi
fi
if [ -z "$tmux" ]; then
  if ! setsid=$(find_tool setsid) || ! nohup=$(find_tool nohup); then
    cd /; rm -rf "$d"; echo "norunner"; exit 0
  fi
  echo nohup > runner
  (umask "$um"; exec "$setsid" "$nohup" /bin/sh ./run.sh) </dev/null >/dev/null 2>&1 &
  bg=$!
fi
i=0
while [ ! -s pid ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i + 1)); done
if [ ! -s pid ]; then  # no runner after 30 s: stop it, so that no late one runs unseen
  if [ -n "$tmux" ]; then "$tmux" kill-session -t "=gpumagic-$name" 2>/dev/null; else kill -KILL "$bg" 2>/dev/null; fi
  cd /; rm -rf "$d"; echo "error the job's runner did not start within 30 s"; exit 0
fi
if [ -n "$tmux" ]; then echo "ok tmux $tmux $(cat pid)"
else echo "ok nohup $setsid $(cat pid) $why"; fi
