"""Detached jobs on the remote machine: start, list, follow, kill.

A job is a cell started so that it outlives the SSH connection, the laptop and the kernel.
All of its state lives on the remote, in one directory per job (the budget guard reads it
too, so the layout is fixed)::

    ~/.gpumagic/jobs/<name>/
        command      the cell (bash script, or Python source when ``interp`` says python3)
        started      epoch seconds when it started
        log          combined stdout + stderr
        pid          the runner's pid: leader of the job's session and process group
        exit_code    written when the job ends (absent while it runs)

A job is *running* when ``exit_code`` is absent and its runner lives: the pid in ``pid`` answers
``kill -0``, is not a zombie, and is still this job's runner (one shell function,
``job_running``, used by every script here); *lost* when neither (the machine rebooted, or
something killed the runner with SIGKILL).  Everything in ``~/.gpumagic`` is private to the
user (directories 0700, files 0600: ``env.sh`` holds the ``--env`` values and the login
environment); the job's own command runs with the user's umask.
Other files: ``ended`` (epoch seconds), ``killed`` (why it was stopped: ``user``, ``nan``,
``oom``, ``traceback``), ``stopped_by`` (the log line that stopped it), ``runner`` (``tmux``
or ``nohup``), ``shutdown`` (epoch seconds of a pending shutdown), ``shutdown_started`` /
``shutdown_cancelled``, and the job's own scripts ``run.sh``, ``kill.sh``, ``watch.sh``.

How a job runs
--------------
A launcher (one ``exec``) takes the name's start lock (so of two starts of one name at the
same moment exactly one starts a job and the other is told it is already running), creates
the directory, writes the scripts, and starts
``run.sh`` in a new tmux session ``gpumagic-<name>`` -- tmux is looked up on the exec
channel's PATH followed by :data:`TOOL_DIRS` -- or, where tmux is missing, under
``setsid nohup``.  Either way the runner is a session and process-group leader, so the whole
job is one process group.  ``run.sh`` sources the environment the launcher saved (the
user's login environment, as for ``%%remote`` cells), sets ``PYTHONUNBUFFERED=1`` unless
already set, runs the command with output appended to ``log``, and writes ``exit_code``.
When the job ends, whatever it left in its process group is stopped.

The job sees ``GPUMAGIC_JOB=<name>``.  A tmux user can watch it with
``tmux attach -t gpumagic-<name>`` (the pane says where the log is).

``--stop-on`` starts ``watch.sh`` next to the command *on the remote*: it follows the log
with ``grep -E`` and, at the first matching line, runs ``kill.sh REASON``.  ``kill.sh``
first checks that the pid is still this job's runner (its ``/proc/PID/cwd`` is the job
directory, so a pid reused after a reboot is never signalled), then sends SIGTERM to the
process group, the session and every descendant of the runner (read from ``ps``, or from
``/proc/*/stat`` where ``ps`` is missing), waits up to :data:`KILL_GRACE` seconds, and
SIGKILLs what is left.  Processes that daemonize away (double fork) escape, as from any
process-tree kill.  Zombies count as ended (some container init processes never reap them).  ``--then-shutdown`` makes
``run.sh`` arm a timer after a successful exit (code 0) that runs the command found by
:func:`gpumagic.budget.shutdown.find_shutdown` after the grace, unless cancelled.

The alert patterns (:data:`ALERTS`) are POSIX extended regular expressions matched
case-insensitively, the same text for the remote ``grep -E -i`` and Python's :mod:`re`.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from .._format import duration
from ..errors import ConnectionLost, JobError, RemoteTimeout
from .execution import check_text, export_lines

#: Where job directories live, relative to the remote HOME.
JOBS_DIR = ".gpumagic/jobs"
#: Job names: they become directory and tmux session names.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
#: Directories searched for tmux (and setsid/nohup) after the remote PATH, in order.
TOOL_DIRS = ("~/.local/bin", "/usr/local/bin", "/opt/homebrew/bin", "/usr/bin", "/bin")
#: Seconds between SIGTERM and SIGKILL when a job is killed.
KILL_GRACE = 3
#: Bytes of the end of a log that a listing scans for alerts (16 MiB).
ALERT_SCAN_BYTES = 16 * 1024 * 1024

#: Alert kinds: name -> (POSIX ERE, matched case-insensitively; what it means).
ALERTS: dict[str, tuple[str, str]] = {
    "nan": (r"loss[^a-z0-9]*(is[^a-z0-9]*)?(tensor\()?[-+]?(nan|inf)([^a-z0-9]|$)",
            "NaN/inf loss"),
    "oom": (r"cuda out of memory|outofmemoryerror|cuda error: out of memory",
            "CUDA out of memory"),
    "traceback": (r"^Traceback \(most recent call last\)", "Python traceback"),
}


def check_name(name: str) -> str:
    """Return ``name`` if it is a valid job name, else raise :class:`JobError`."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise JobError(f"{name!r} is not a valid job name",
                       "use letters, digits, '-' and '_' (at most 64, starting with a letter or digit)")
    return name


def parse_stop_on(text: str | Iterable[str] | None) -> tuple[str, ...]:
    """``"nan,oom"`` -> ``("nan", "oom")``; raises :class:`JobError` naming the valid kinds."""
    if not text:
        return ()
    items = text.split(",") if isinstance(text, str) else list(text)
    kinds = tuple(dict.fromkeys(i.strip().lower() for i in items if i.strip()))
    bad = [k for k in kinds if k not in ALERTS]
    if bad:
        raise JobError(f"unknown --stop-on kind {', '.join(bad)!r}",
                       f"use a comma-separated list of: {', '.join(ALERTS)}")
    return kinds


# -- pure parsers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Alert:
    """A log line that matched an alert pattern."""

    kind: str
    line: str

    @property
    def label(self) -> str:
        return ALERTS[self.kind][1]


def classify(line: str) -> str | None:
    """The alert kind a log line matches (``"nan"``, ``"oom"``, ``"traceback"``) or None."""
    for kind, (pattern, _) in ALERTS.items():
        if re.search(pattern, line, re.IGNORECASE):
            return kind
    return None


def scan_alerts(lines: Iterable[str]) -> list[Alert]:
    """Every line that matches an alert pattern, in order.

    A line is split at ``\\r`` as well (progress bars rewrite one line in place).
    """
    found = []
    for raw in lines:
        for line in raw.split("\r"):
            kind = classify(line)
            if kind:
                found.append(Alert(kind, line.strip()))
    return found


@dataclass(frozen=True)
class JobInfo:
    """What the remote job directory says about one job.

    Attributes
    ----------
    name : str
    started, ended : float or None
        Epoch seconds (the machine's clock).
    now : float
        The machine's clock when it was read (run times never mix two clocks).
    alive : bool
        ``kill -0`` on the runner pid succeeded.
    exit_code : int or None
    killed : str or None
        Why gpumagic stopped it (``user``, ``nan``, ``oom``, ``traceback``).
    stopped_by : str
        The log line that triggered ``--stop-on``.
    runner : str
        ``tmux`` or ``nohup``.
    shutdown_due : float or None
        Epoch seconds of a pending shutdown.
    shutdown_state : str
        ``""``, ``"pending"``, ``"started"`` (it ran) or ``"cancelled"``.
    last_line : str
        The last non-blank line of the log (after the last ``\\r``).
    alerts : tuple of Alert
        Alert lines found in the log (at most a few of each kind).
    stop_on : tuple of str
    alerts_enabled : bool
        False when started with ``--no-alerts``.
    """

    name: str
    now: float
    started: float | None = None
    ended: float | None = None
    alive: bool = False
    exit_code: int | None = None
    killed: str | None = None
    stopped_by: str = ""
    runner: str = ""
    shutdown_due: float | None = None
    shutdown_state: str = ""
    last_line: str = ""
    alerts: tuple[Alert, ...] = ()
    stop_on: tuple[str, ...] = ()
    alerts_enabled: bool = True

    @property
    def state(self) -> str:
        """``running``, ``exited``, ``killed`` or ``lost``."""
        if self.exit_code is None:
            return "running" if self.alive else "lost"
        return "killed" if self.killed else "exited"

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def state_text(self) -> str:
        """One phrase: ``running``, ``exited 0``, ``killed (nan)``, ``killed by the system
        (exit 137: SIGKILL, often the out-of-memory killer)``, ``lost``."""
        s = self.state
        if s == "exited":
            if self.exit_code in (137, -9):
                return "killed by the system (exit 137: SIGKILL, often the out-of-memory killer)"
            if self.exit_code and self.exit_code > 128:
                return f"exited {self.exit_code} (signal {self.exit_code - 128})"
            return f"exited {self.exit_code}"
        if s == "killed":
            return f"killed ({self.killed})"
        return s

    @property
    def run_seconds(self) -> float | None:
        """Seconds from start to end (or to now while running)."""
        if self.started is None:
            return None
        end = self.ended if self.ended is not None else (self.now if self.alive else None)
        return None if end is None else max(0.0, end - self.started)

    @property
    def shutdown_text(self) -> str:
        """``shutdown in 0:59``, ``shutdown ran``, ``shutdown cancelled`` or ``""``."""
        if self.shutdown_state == "pending" and self.shutdown_due is not None:
            return f"shutdown in {duration(max(0.0, self.shutdown_due - self.now))}"
        if self.shutdown_state == "started":
            return "shutdown ran"
        if self.shutdown_state == "cancelled":
            return "shutdown cancelled"
        if self.shutdown_state == "armed":
            return "shutdown after success"
        return ""


def _num(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None


def parse_listing(text: str) -> list[JobInfo]:
    """Read the output of :data:`LIST_SCRIPT`.

    The format (written by that script): a ``now<TAB>EPOCH`` line, then per job a
    ``job<TAB>NAME`` line followed by ``KEY<TAB>VALUE`` lines, one value per line.
    """
    now = 0.0
    jobs: list[JobInfo] = []
    cur: dict | None = None

    def finish():
        if cur is not None:
            jobs.append(_info(cur, now))

    for line in text.splitlines():
        key, sep, value = line.partition("\t")
        if not sep:
            continue
        if key == "now":
            now = _num(value) or 0.0
        elif key == "job":
            finish()
            cur = {"name": value, "alert": []}
        elif cur is not None:
            if key == "alert":
                cur["alert"].append(value)
            else:
                cur[key] = value
    finish()
    return jobs


def _info(d: dict, now: float) -> JobInfo:
    code = d.get("exit_code", "").strip()
    exit_code = int(code) if code.lstrip("-").isdigit() else None
    if "exit_code" in d and exit_code is None:
        exit_code = -1  # written but unreadable: the job did end
    if "shutdown_started" in d:
        sd_state = "started"
    elif "shutdown_cancelled" in d:
        sd_state = "cancelled"
    elif "shutdown" in d:
        sd_state = "pending"
    elif "shutdown_command" in d and exit_code is None:
        sd_state = "armed"
    else:
        sd_state = ""
    stopped_by = d.get("stopped_by", "")
    enabled = "no_alerts" not in d
    alerts = tuple(scan_alerts(d["alert"])) if enabled else ()
    return JobInfo(
        name=d["name"], now=now, started=_num(d.get("started", "")),
        ended=_num(d.get("ended", "")), alive=d.get("alive") == "1", exit_code=exit_code,
        killed=(d.get("killed", "").strip() or None) if "killed" in d else None,
        stopped_by=stopped_by, runner=d.get("runner", "").strip(),
        shutdown_due=_num(d.get("shutdown", "")), shutdown_state=sd_state,
        last_line=d.get("last", ""), alerts=alerts,
        stop_on=tuple(k for k in d.get("stop_on", "").split(",") if k), alerts_enabled=enabled)


def parse_launch(output: str) -> dict:
    """Read the launcher's last line: ``ok RUNNER PATH PID [tmux-error...]``, ``running``,
    ``norunner``, or ``error MESSAGE``."""
    lines = [ln for ln in output.strip().splitlines() if ln.strip()]
    line = lines[-1] if lines else ""
    word, _, rest = line.partition(" ")
    if word == "ok":
        runner, _, rest = rest.partition(" ")
        path, _, rest = rest.partition(" ")
        pid, _, why = rest.partition(" ")
        return {"status": "ok", "runner": runner, "path": path, "pid": int(pid) if pid.isdigit() else None,
                "tmux_error": why.strip()}
    if word in ("running", "norunner"):
        return {"status": word, "detail": rest}
    return {"status": "error", "detail": rest if word == "error" else line}


# -- remote scripts -------------------------------------------------------------------------

_PATH_SETUP = r"""
tooldirs=$1; shift
search=$PATH
IFS=:
for t in $tooldirs; do
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
"""

#: ``procs``: one line per process, ``PID PPID SID PGID STATE``, from ``ps`` or, where
#: ``ps`` is missing (slim containers), from ``/proc/PID/stat`` (proc(5): the fields after
#: the parenthesised command name are state, ppid, pgrp, session).
_PROCS_FN = r"""
procs() {
  if command -v ps >/dev/null 2>&1; then
    ps -e -o pid= -o ppid= -o sid= -o pgid= -o stat= 2>/dev/null; return
  fi
  for f in /proc/[0-9]*/stat; do
    read -r l < "$f" 2>/dev/null || continue
    p=${f#/proc/}; p=${p%/stat}
    set -- ${l##*) }
    echo "$p $2 $4 $3 $1"
  done
}
"""

#: The one test of "is this job still running", used by every script here (a zombie runner
#: must read as ended everywhere, or ``Job.wait`` polls it until its timeout).
#: ``alive PID``: the process exists
#: (``kill -0``) and is not a zombie (state ``Z`` in ``/proc/PID/stat``, proc(5): an exited
#: process whose parent has not reaped it; some container init processes never do).
#: ``pstart PID``: its start time (field 22 of that line), so that a pid reused after a reboot
#: is told apart.  ``job_running DIR``: no ``exit_code`` yet, and the pid in ``DIR/pid`` is
#: alive and still this job's runner (its ``/proc/PID/cwd`` is ``DIR``; where /proc is
#: missing, ``kill -0`` alone decides); before the runner has written its pid, the job runs
#: while a live launcher holds the job's start lock (``.NAME.starting``, see LAUNCH_SCRIPT).
_ALIVE_FN = r"""
alive() {
  case $1 in ""|*[!0-9]*) return 1 ;; esac
  kill -0 "$1" 2>/dev/null || return 1
  _st=; { read -r _st < "/proc/$1/stat"; } 2>/dev/null
  _st=${_st##*) }
  case $_st in Z*) return 1 ;; esac
  return 0
}
pstart() {
  _st=; { read -r _st < "/proc/$1/stat"; } 2>/dev/null
  _st=${_st##*) }
  set -- $_st
  echo "${20}"
}
lock_held() {
  _o=; { read -r _o _t < "$1/owner"; } 2>/dev/null
  [ -n "$_o" ] && alive "$_o" && [ "$(pstart "$_o")" = "$_t" ]
}
job_running() {
  [ -e "$1/exit_code" ] && return 1
  _p=$(cat "$1/pid" 2>/dev/null)
  if [ -z "$_p" ]; then lock_held "${1%/*}/.${1##*/}.starting"; return; fi
  alive "$_p" || return 1
  _c=$(readlink "/proc/$_p/cwd" 2>/dev/null) || return 0
  [ "$_c" = "$(cd "$1" 2>/dev/null && pwd -P)" ]
}
"""

#: Runs the job: ``/bin/sh ./run.sh`` in the job directory (its pid is the group leader).
RUN_SCRIPT = r"""# gpumagic job runner (do not edit while the job runs)
umask 077  # the job's own files (pid, exit_code, ...) are private; the command gets the user's
echo $$ > pid.tmp && mv pid.tmp pid
trap 'sig=1' TERM INT HUP  # a signal for the job must not stop us before exit_code is written
jd=$(pwd -P)
interp=$(cat interp)
. ./env.sh
export PYTHONUNBUFFERED="${PYTHONUNBUFFERED-1}"
export GPUMAGIC_JOB="$(cat name)"
echo "gpumagic job $GPUMAGIC_JOB: its output goes to $jd/log (tail -f it; Ctrl-b d detaches)"
if [ -s stop_on ]; then
  /bin/sh ./watch.sh </dev/null >/dev/null 2>&1 &
fi
(
  umask "$(cat umask)"
  wd=$(cat workdir)
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
for p in $(procs | awk -v g=$$ '$4 == g && $1 != g && $5 !~ /^Z/ { print $1 }'); do
  kill -TERM "$p" 2>/dev/null
done
if [ "$rc" = 0 ] && [ -s shutdown_command ] && [ ! -e killed ]; then
  grace=$(cat shutdown_grace)
  echo $(( $(date +%s) + grace )) > shutdown.tmp && mv shutdown.tmp shutdown
  # A cancel that came while the job ran (see CANCEL_SHUTDOWN_SCRIPT): renames are the arbiter.
  [ -e shutdown_cancelled ] && mv shutdown shutdown_cancelled.late 2>/dev/null
  if [ -e shutdown ]; then
    (
      trap '' HUP
      sleep "$grace"
      if mv shutdown shutdown_started 2>/dev/null; then
        date +%s >> shutdown_started
        /bin/sh -c "$(cat shutdown_command)"
      fi
    ) </dev/null >>shutdown.log 2>&1 &
    echo $! > shutdown_pid
  fi
fi
echo "$rc" > exit_code.tmp && mv exit_code.tmp exit_code
# Tell the user away from the notebook (gpumagic.budget.notify; nothing when not set up).
[ -f "$HOME/.gpumagic/notify/config.json" ] && { nohup python3 "$HOME/.gpumagic/notify/notify.py" --event job-end --job "$GPUMAGIC_JOB" --job-dir "$jd" --exit-code "$rc" --log "$jd/log" </dev/null >/dev/null 2>&1 & }
""".replace("# gpumagic job runner (do not edit while the job runs)\n",
            "# gpumagic job runner (do not edit while the job runs)\n" + _PROCS_FN, 1)

#: Follows the log and stops the job at the first line matching ``stop_on_re``.
WATCH_SCRIPT = r"""# gpumagic --stop-on watcher: runs next to the job, on this machine
re=$(cat stop_on_re)
rm -f watch.fifo; mkfifo watch.fifo || exit 0
tail -n +1 -f log > watch.fifo 2>/dev/null &
t=$!
grep -a -i -E -m 1 -e "$re" < watch.fifo > stopped_by.tmp
found=$?
kill $t 2>/dev/null
rm -f watch.fifo
[ "$found" = 0 ] || exit 0
line=$(head -n 1 stopped_by.tmp)
kind=user
for k in $(cat stop_on | tr ',' ' '); do
  if printf '%s\n' "$line" | grep -a -q -i -E -e "$(cat "stop_on_re.$k")"; then kind=$k; break; fi
done
mv stopped_by.tmp stopped_by
exec /bin/sh ./kill.sh "$kind"
"""

#: Ends the job's whole process tree: ``/bin/sh ./kill.sh REASON`` in the job directory.
KILL_SCRIPT = r"""# gpumagic job killer
trap '' TERM HUP INT
reason=${1:-user}
if [ -e exit_code ]; then echo "ended"; exit 0; fi
pg=$(cat pid 2>/dev/null)
tree() {  # the runner, its session and process group, and all their descendants (not us)
  procs | awk -v root="$pg" -v me="$$" '
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
if [ -z "$pg" ] || ! job_running "$(pwd -P)"; then
  echo "lost"; exit 0
fi
first=$(tree)
if [ -z "$first" ]; then echo "lost"; exit 0; fi
[ -e killed ] || printf '%s\n' "$reason" > killed
kill -TERM -"$pg" 2>/dev/null
kill -TERM $first 2>/dev/null
i=0
while [ $i -lt %(ticks)s ]; do
  left=$(tree)
  [ -z "$left" ] && break
  sleep 0.1; i=$((i + 1))
done
left=$(tree)
[ -n "$left" ] && kill -KILL $left 2>/dev/null
for p in $first; do kill -KILL "$p" 2>/dev/null; done
if [ ! -e exit_code ]; then
  [ -e ended ] || date +%s > ended
  echo 137 > exit_code.tmp && mv exit_code.tmp exit_code
fi
echo "killed"
kill -KILL -"$pg" 2>/dev/null
exit 0
""".replace("%(ticks)s", str(KILL_GRACE * 10)).replace(
    "# gpumagic job killer\n", "# gpumagic job killer\n" + _PROCS_FN + _ALIVE_FN, 1)

#: One round trip that creates the job directory and starts the runner.
#: Arguments: NAME WORKDIR INTERP STOP_ON SHUTDOWN_CMD SHUTDOWN_GRACE ALERTS TOOLDIRS.
#: Environment: RUN, KILL, WATCH (the scripts), STOP_RE and RE_<kind> (the patterns), and
#: JOBENV: ``export``/``unset`` lines giving the job's environment, applied only where
#: ``env.sh`` is written (values never in an argv, nor in a tmux server's environment).
#: The command text arrives on stdin.  Prints ``ok RUNNER PATH PID``, ``running``,
#: ``norunner`` or ``error MESSAGE``.
#:
#: Starting is atomic per name: ``mkdir .NAME.starting`` (atomic on every file system) is
#: the start lock, held from the "is it running?" check until the runner has written its
#: pid.  A second launcher that finds it held by a live launcher prints ``running``; one
#: whose owner died (SIGKILL, a reboot) is broken.  Everything is created private (umask
#: 077: directories 0700, files 0600); the command itself runs with the user's umask.
LAUNCH_SCRIPT = r"""
name=$1 workdir=$2 interp=$3 stop_on=$4 sd_cmd=$5 sd_grace=$6 alerts=$7
shift 7
""" + _PATH_SETUP + _ALIVE_FN + r"""
um=$(umask)
umask 077
base=$HOME/.gpumagic/jobs
d=$base/$name
lock=$base/.$name.starting
mkdir -p "$base" || { echo "error cannot create $base"; exit 0; }
chmod 700 "$HOME/.gpumagic" "$base" 2>/dev/null
i=0
broke=0
while ! mkdir "$lock" 2>/dev/null; do
  if lock_held "$lock"; then echo "running"; exit 0; fi
  if [ ! -s "$lock/owner" ] && [ $i -lt 40 ]; then  # its owner is writing it: 2 s at most
    i=$((i + 1)); sleep 0.05; continue
  fi
  # The launcher that took it is gone: break the lock (one of several breakers wins the mv).
  broke=$((broke + 1)); i=0
  [ $broke -le 5 ] || { echo "error cannot take the start lock $lock"; exit 0; }
  mv "$lock" "$lock.stale.$$" 2>/dev/null && rm -rf "$lock.stale.$$"
done
trap 'rm -rf "$lock"' EXIT
trap 'exit 1' HUP INT TERM PIPE
echo "$$ $(pstart $$)" > "$lock/owner.tmp" && mv "$lock/owner.tmp" "$lock/owner"
if [ -d "$d" ]; then
  if [ -s "$d/pid" ] && job_running "$d"; then echo "running"; exit 0; fi
  s=$(cat "$d/started" 2>/dev/null)
  case $s in ""|*[!0-9]*) s=$(date +%s) ;; esac
  old=$name-$s
  [ -e "$base/$old" ] && old=$old-$$
  mv "$d" "$base/$old" || { echo "error cannot move the ended job aside to $base/$old"; exit 0; }
  echo "archived $old"
fi
mkdir "$d" || { echo "error cannot create $d"; exit 0; }
cd "$d" || { echo "error cannot enter $d"; exit 0; }
cat > command
date +%s > started
: > log
printf '%s\n' "$name" > name
printf '%s\n' "$workdir" > workdir
printf '%s\n' "$interp" > interp
printf '%s\n' "$um" > umask
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
  setsid=$(find_tool setsid) && nohup=$(find_tool nohup) || {
    cd /; rm -rf "$d"; echo "norunner"; exit 0; }
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
"""

#: Lists jobs: ``sh -c LIST_SCRIPT list SCAN_BYTES NAME_OR_EMPTY ALERT_RE...`` (one ERE per
#: alert kind; the first two matching lines of each kind are reported).
LIST_SCRIPT = r"""
scan=$1 only=$2
shift 2
""" + _ALIVE_FN + r"""
printf 'now\t%s\n' "$(date +%s)"
base=$HOME/.gpumagic/jobs
[ -d "$base" ] || exit 0
for d in "$base"/*; do
  [ -d "$d" ] || continue
  n=${d##*/}
  [ -z "$only" ] || [ "$n" = "$only" ] || continue
  printf 'job\t%s\n' "$n"
  for f in started ended exit_code killed runner shutdown shutdown_started shutdown_cancelled \
           shutdown_command stop_on no_alerts; do
    [ -e "$d/$f" ] && printf '%s\t%s\n' "$f" "$(head -c 300 "$d/$f" | head -n 1)"
  done
  [ -e "$d/stopped_by" ] && printf 'stopped_by\t%s\n' "$(head -n 1 "$d/stopped_by" | cut -c1-300)"
  job_running "$d" && printf 'alive\t1\n'
  [ -f "$d/log" ] || continue
  printf 'last\t%s\n' "$(tail -c 4096 "$d/log" | tr '\r' '\n' | grep -a -v '^[[:space:]]*$' | tail -n 1 | cut -c1-300)"
  for are in "$@"; do
    tail -c "$scan" "$d/log" | tr '\r' '\n' | grep -a -i -E -m 2 -e "$are" | cut -c1-300 |
      while IFS= read -r l; do printf 'alert\t%s\n' "$l"; done
  done
done
"""

#: Prints the log from ``-n LINES`` before its end (``all``: from the start) and, with
#: ``follow`` = 1, keeps printing what is appended until the job ends.  Exit 3: no job.
FOLLOW_SCRIPT = r"""
name=$1 lines=$2 follow=$3
""" + _ALIVE_FN + r"""
d=$HOME/.gpumagic/jobs/$name
[ -d "$d" ] || { echo "no job named $name" >&2; exit 3; }
cd "$d" || exit 3
[ -e log ] || : > log
pos=$(wc -c < log)
if [ "$lines" = all ]; then head -c "$pos" log; else head -c "$pos" log | tail -n "$lines"; fi
[ "$follow" = 1 ] || exit 0
while :; do
  r=0; job_running "$d" && r=1
  size=$(wc -c < log)
  if [ "$size" -gt "$pos" ]; then
    tail -c +$((pos + 1)) log | head -c $((size - pos))
    pos=$size
  fi
  [ $r = 1 ] || break
  sleep 0.2
done
"""

#: Waits until a job is no longer running (``sh -c WAIT_SCRIPT wait NAME``).
WAIT_SCRIPT = r"""
d=$HOME/.gpumagic/jobs/$1
[ -d "$d" ] || exit 3
""" + _ALIVE_FN + r"""
while job_running "$d"; do
  sleep 0.2
done
"""

#: Cancels a pending (or future) shutdown of job ``$1``.  Prints ``cancelled``, ``none``
#: (none was armed), ``started`` (too late) or ``nojob``.  ``mv`` is atomic, so exactly one
#: of this script and the timer in RUN_SCRIPT wins the ``shutdown`` file.
CANCEL_SHUTDOWN_SCRIPT = r"""
d=$HOME/.gpumagic/jobs/$1
[ -d "$d" ] || { echo "nojob"; exit 0; }
cd "$d" || exit 0
[ -e shutdown_command ] || { echo "none"; exit 0; }
stop_timer() {
  p=$(cat shutdown_pid 2>/dev/null)
  [ -n "$p" ] || return 0
  for c in $(ps -e -o pid= -o ppid= 2>/dev/null | awk -v p="$p" '$2 == p { print $1 }'); do
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
"""


def _q(args: Iterable[str]) -> str:
    return " ".join(shlex.quote(a) for a in args)


def _sh(script: str, *args: str) -> str:
    """A command line running ``script`` with ``/bin/sh`` and positional ``args``."""
    return _q(["/bin/sh", "-c", script, "gpumagic", *args])


def _alert_re(kinds: Iterable[str]) -> str:
    return "|".join(f"({ALERTS[k][0]})" for k in kinds)


# -- the API --------------------------------------------------------------------------------


@dataclass
class Job:
    """A handle on one job of one machine (cheap: all state is read from the remote).

    Attributes
    ----------
    machine : Machine
    name : str
    runner : str
        ``tmux`` or ``nohup`` (empty when the handle came from a name, not a start).
    runner_path : str
        The tmux (or setsid) program that started it.
    note : str
        Something the user should be told once (the nohup fallback).
    archived : str
        Name under which a finished job of the same name was kept, if any.
    """

    machine: object
    name: str
    runner: str = ""
    runner_path: str = ""
    note: str = ""
    archived: str = ""
    pid: int | None = None

    @property
    def dir(self) -> str:
        return f"~/{JOBS_DIR}/{self.name}"

    def info(self) -> JobInfo:
        """The job's state now (one round trip).

        Raises
        ------
        JobError
            When the machine has no job of that name.
        """
        found = list_jobs(self.machine, only=self.name)
        if not found:
            raise JobError(f"no job named {self.name!r} on {self.machine.name}",
                           "`%gpu jobs` lists the jobs on that machine")
        return found[0]

    @property
    def state(self) -> str:
        """``running``, ``exited 0``, ``killed (nan)``, ``lost``... (see :attr:`JobInfo.state_text`)."""
        return self.info().state_text

    def logs(self, lines: int | None = 100) -> str:
        """The last ``lines`` lines of the log (None: all of it)."""
        r = self.machine.exec(_sh(FOLLOW_SCRIPT, self.name, "all" if lines is None else str(int(lines)), "0"),
                              timeout=120)
        if r.exit_code == 3:
            raise JobError(f"no job named {self.name!r} on {self.machine.name}",
                           "`%gpu jobs` lists the jobs on that machine")
        return r.stdout

    def follow(self, out: Callable[[str], None] | None = None,
               alert: Callable[[Alert], None] | None = None, lines: int | None = 100) -> JobInfo:
        """Print the log (the last ``lines`` lines) and everything appended until the job ends.

        Parameters
        ----------
        out : callable
            Receives text chunks as they arrive (default: this process's stdout).
        alert : callable
            Receives each :class:`Alert` found in complete lines, unless the job was
            started with ``--no-alerts``.
        lines : int or None
            Earlier lines to show first (None: the whole log).

        Returns
        -------
        JobInfo
            The job's state when following stopped.

        Raises
        ------
        KeyboardInterrupt
            Interrupting stops following (the remote ``tail`` loop), never the job.
        ConnectionLost
            The job keeps running; follow again after reconnecting.
        """
        import sys

        out = out or (lambda t: (sys.stdout.write(t), sys.stdout.flush()))
        scanner = _LineScanner(alert) if alert is not None else None
        if scanner is not None and not self.info().alerts_enabled:
            scanner = None

        def sink(text: str) -> None:
            out(text)
            if scanner is not None:
                scanner.feed(text)

        try:
            r = self.machine.run(["/bin/sh", "-c", FOLLOW_SCRIPT, "follow", self.name,
                                  "all" if lines is None else str(int(lines)), "1"],
                                 quiet=True, stdout=sink, capture=False, cwd="")
        except ConnectionLost as e:
            raise ConnectionLost(
                f"lost the connection to {self.machine.name} while following job {self.name}; "
                "the job keeps running there", f"reconnect and run `%gpu attach {self.name}`") from e
        if r.exit_code == 3:
            raise JobError(f"no job named {self.name!r} on {self.machine.name}",
                           "`%gpu jobs` lists the jobs on that machine")
        if scanner is not None:
            scanner.flush()
        return self.info()

    def wait(self, timeout: float | None = None) -> JobInfo:
        """Block until the job is no longer running; returns its final :class:`JobInfo`.

        Raises
        ------
        RemoteTimeout
            After ``timeout`` seconds (the job keeps running).
        """
        try:
            self.machine.run(["/bin/sh", "-c", WAIT_SCRIPT, "wait", self.name], quiet=True,
                             timeout=timeout, cwd="")
        except RemoteTimeout:
            raise RemoteTimeout(f"job {self.name} still runs after {timeout:g} s",
                                f"wait longer, or `%gpu kill {self.name}`") from None
        except ConnectionLost as e:
            raise ConnectionLost(
                f"lost the connection to {self.machine.name} while waiting for job {self.name}; "
                "the job keeps running there", "wait again: gpumagic reconnects by itself") from e
        return self.info()

    def kill(self, reason: str = "user") -> JobInfo:
        """End the job's whole process tree (SIGTERM, then SIGKILL after
        :data:`KILL_GRACE` seconds); returns the final state.  Safe on an ended job."""
        r = self.machine.exec(f"cd \"$HOME\"/{JOBS_DIR}/{shlex.quote(self.name)} 2>/dev/null || exit 3; "
                              f"exec /bin/sh ./kill.sh {shlex.quote(reason)}", timeout=KILL_GRACE + 30)
        if r.exit_code == 3:
            raise JobError(f"no job named {self.name!r} on {self.machine.name}",
                           "`%gpu jobs` lists the jobs on that machine")
        return self.info()

    def cancel_shutdown(self) -> str:
        """Cancel the shutdown armed by ``then_shutdown`` (pending, or for when the job ends).

        Returns
        -------
        str
            ``cancelled``, ``none`` (none was armed) or ``started`` (too late: it ran).
        """
        r = self.machine.exec(_sh(CANCEL_SHUTDOWN_SCRIPT, self.name))
        word = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "none"
        if word == "nojob":
            raise JobError(f"no job named {self.name!r} on {self.machine.name}",
                           "`%gpu jobs` lists the jobs on that machine")
        return word


class _LineScanner:
    """Feeds complete lines of streamed text to an alert callback (``\\r`` splits too)."""

    def __init__(self, alert: Callable[[Alert], None]):
        self.alert = alert
        self.buf = ""

    def feed(self, text: str) -> None:
        self.buf += text
        *done, self.buf = self.buf.split("\n")
        for a in scan_alerts(done):
            self.alert(a)

    def flush(self) -> None:
        if self.buf:
            for a in scan_alerts([self.buf]):
                self.alert(a)
            self.buf = ""


def list_jobs(machine, only: str | None = None) -> list[JobInfo]:
    """Every job on ``machine`` (one round trip), oldest first."""
    args = [str(ALERT_SCAN_BYTES), only or ""] + [pattern for pattern, _ in ALERTS.values()]
    r = machine.exec(_sh(LIST_SCRIPT, *args), timeout=120)
    return sorted(parse_listing(r.stdout), key=lambda j: (j.started or 0, j.name))


def start(machine, name: str, command: str, *, python: bool = False, cwd: str | None = None,
          env: Mapping[str, str] | None = None, stop_on: Iterable[str] | str | None = None,
          then_shutdown: float | None = None, alerts: bool = True,
          tool_dirs: Iterable[str] = TOOL_DIRS) -> Job:
    """Start ``command`` on ``machine`` as a detached job; returns at once.

    Parameters
    ----------
    machine : Machine
    name : str
        Job name (see :data:`NAME_RE`).  A finished job of that name is kept as
        ``NAME-STARTEPOCH``; a running one makes this fail.
    command : str
        A bash script, or Python source with ``python=True`` (run with ``python3 -u``).
    cwd : str, optional
        Working directory (default: the machine's ``cwd``, else the login directory);
        ``~/...`` and relative paths start at the remote ``$HOME``.
    env : mapping, optional
        Extra environment variables on top of the user's login environment.
    stop_on : iterable of str or "nan,oom,traceback"
        Kill the job at the first log line of these alert kinds (watched on the remote).
    then_shutdown : float, optional
        Minutes after a successful end (exit 0) after which the machine shuts down.
        Checked now with :func:`gpumagic.budget.shutdown.find_shutdown`.
    alerts : bool
        Show alerts when following or listing (``--no-alerts`` turns them off).
    tool_dirs : iterable of str
        Directories searched for tmux (then setsid/nohup) after the exec channel's PATH.

    Returns
    -------
    Job

    Raises
    ------
    JobError
        Bad name or stop-on kind; a job of that name is running; the machine cannot shut
        down (for ``then_shutdown``); neither tmux nor setsid+nohup exists.
    """
    check_name(name)
    kinds = parse_stop_on(stop_on)
    tool_dirs = tuple(tool_dirs)
    searched = "its PATH" + (f" and {', '.join(tool_dirs)}" if tool_dirs else "")
    sd_cmd, grace = "", 0
    if then_shutdown is not None:
        if not (isinstance(then_shutdown, (int, float)) and 0 <= then_shutdown <= 30 * 24 * 60):
            raise JobError(f"--then-shutdown takes minutes from 0 to 43200, not {then_shutdown!r}",
                           "e.g. --then-shutdown 10")
        plan = machine.shutdown_plan()  # the sandbox (this computer) answers with a stand-in
        if not plan.possible:
            raise JobError(f"--then-shutdown: {machine.name} cannot shut itself down, so the job "
                           f"was not started: {plan.reason}",
                           "start the job without --then-shutdown and stop the instance yourself")
        sd_cmd, grace = plan.command, int(round(then_shutdown * 60))
    check_text(command)
    work = check_text(cwd if cwd is not None else (machine.cwd or ""), "the working directory", by_line=False)
    # Names that are not shell variable names (exported bash functions) are left out.
    lines, _ = export_lines({**machine.login_env(), **(env or {})})
    # The launcher receives the job's scripts, patterns and environment as environment
    # variables (the exec program that sets them travels on stdin: no value is in an argv).
    launcher_env = {"RUN": RUN_SCRIPT, "KILL": KILL_SCRIPT, "WATCH": WATCH_SCRIPT,
                    "STOP_RE": _alert_re(kinds) if kinds else "", "JOBENV": "\n".join(lines)}
    launcher_env.update({f"RE_{k}": ALERTS[k][0] for k in ALERTS})
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in launcher_env.items())
    line = prefix + " " + _q(["/bin/sh", "-c", LAUNCH_SCRIPT, "launch", name, work,
                              "python3" if python else "bash", ",".join(kinds), sd_cmd, str(grace),
                              "1" if alerts else "0", ":".join(tool_dirs)])
    r = machine.exec(line, stdin=command.encode(), timeout=90)
    res = parse_launch(r.stdout)
    archived = next((ln.split(" ", 1)[1] for ln in r.stdout.splitlines() if ln.startswith("archived ")), "")
    if res["status"] == "running":
        raise JobError(f"a job named {name!r} is already running on {machine.name}",
                       f"pick another name, or `%gpu kill {name}` first")
    if res["status"] == "norunner":
        raise JobError(f"cannot start a detached job on {machine.name}: neither tmux nor "
                       f"setsid+nohup was found (searched {searched})",
                       f"install tmux on {machine.name}: `apt install tmux` "
                       "(or `conda install -c conda-forge tmux`)")
    if res["status"] != "ok":
        raise JobError(f"could not start job {name!r} on {machine.name}: {res['detail'] or r.stderr.strip()}",
                       "check the remote HOME is writable (`df -h ~`)")
    note = ""
    if res["runner"] == "nohup":
        why = f" (tmux failed: {res['tmux_error']})" if res["tmux_error"] else f" (searched {searched})"
        note = (f"{machine.name} has no usable tmux{why}: job {name} runs under setsid nohup instead; "
                "it survives disconnects, but `tmux attach` will not show it (`apt install tmux` for that)")
    return Job(machine, name, runner=res["runner"], runner_path=res["path"], note=note,
               archived=archived, pid=res["pid"])
