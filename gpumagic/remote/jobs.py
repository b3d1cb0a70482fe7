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
``gm_job_running`` in ``programs/lib.sh``, used by every job program); *lost* when neither (the machine rebooted, or
something killed the runner with SIGKILL).  Everything in ``~/.gpumagic`` is private to the
user (directories 0700, files 0600: ``env.sh`` holds the ``--env`` values and the login
environment); the job's own command runs with the user's umask.
Other files: ``ended`` (epoch seconds), ``killed`` (why it was stopped: ``user``, ``nan``,
``oom``, ``traceback``), ``stopped_by`` (the log line that stopped it), ``runner`` (``tmux``
or ``nohup``), ``shutdown`` (epoch seconds of a pending shutdown), ``shutdown_started`` /
``shutdown_cancelled``, ``kill_grace``, ``notified`` (a directory: the job-end message was
claimed by its one sender, see ``gm_job_end_notify`` in ``programs/lib.sh``), and the job's own scripts ``run.sh``, ``kill.sh``,
``watch.sh`` (:data:`JOB_FILES`).

The machine-side programs are files under ``gpumagic/remote/programs/`` (run by name through
:mod:`gpumagic.remote.program`): ``job-launch.sh``, ``job-run.sh``, ``job-kill.sh``,
``job-watch.sh``, ``job-list.sh``, ``job-follow.sh``, ``job-wait.sh`` and
``job-cancel-shutdown.sh``.

How a job runs
--------------
A launcher (``job-launch.sh``, one ``exec``) takes the name's start lock (so of two starts of one name at the
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
``run.sh`` arm a timer after a successful exit (code 0) that runs the command of
:meth:`gpumagic.machine.Machine.shutdown_plan` (the budget guard's; on the sandbox, its
stand-in) after the grace, unless cancelled.

The alert patterns (:data:`ALERTS`) are POSIX extended regular expressions matched
case-insensitively, the same text for the remote ``grep -E -i`` and Python's :mod:`re`.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping, TYPE_CHECKING

from .._format import duration
from .._options import Options
from ..errors import ConnectionLost, JobError, RemoteTimeout
from . import program
from .execution import cell_bytes, check_text, export_lines

if TYPE_CHECKING:
    from .._types import MachineLike
    from .keep import Keeper

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
    """A log line that matched an alert pattern.

    Attributes
    ----------
    kind : str
        A key of :data:`ALERTS`.
    line : str
        The log line, stripped.
    where : str
        Which process of which machine wrote it, for a torchrun job (``rank 3 on box-b``, see
        :meth:`JobInfo.where`); empty for a plain job.
    """

    kind: str
    line: str
    where: str = ""

    @property
    def label(self) -> str:
        """What the alert means (``NaN/inf loss``), with its source when known
        (``NaN/inf loss from rank 3 on box-b``)."""
        return ALERTS[self.kind][1] + (f" from {self.where}" if self.where else "")


#: torchrun's prefix of a worker's output line in the job's log (``--tee 3``): ``[defaultL]:``
#: with ``L`` the local rank (torch.distributed.elastic's default log line prefix).
RANK_PREFIX_RE = re.compile(r"^\[default(\d+)\]:(.*)$")


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
    """What the remote job directory (``~/.gpumagic/jobs/NAME/``) says about one job, as
    ``job-list.sh`` lists it (:func:`parse_listing`).

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
    host : str
        The name of the machine it runs on (as the user named it).
    torchrun : bool
        The job is one machine's part of a torchrun job (:mod:`gpumagic.remote.distributed`).
    ranks : tuple of (int, int)
        For one machine's part of a torchrun job: ``(global rank, local rank)`` of each rank
        that started there (from ``ranks/`` in its torchrun folder); empty for a plain job.
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
    host: str = ""
    torchrun: bool = False
    ranks: tuple[tuple[int, int], ...] = ()

    def where(self, line: str) -> str:
        """Which rank of which machine wrote ``line`` of a torchrun job's log (``rank 3 on
        box-b``; ``local rank 1 on box-b`` before its global rank is known); ``""`` for a line
        without torchrun's ``[defaultL]:`` prefix or a plain job."""
        m = RANK_PREFIX_RE.match(line.strip())
        if not m or not self.torchrun:
            return ""
        local = int(m.group(1))
        glob = next((g for g, lo in self.ranks if lo == local), None)
        on = f" on {self.host}" if self.host else ""
        return f"rank {glob}{on}" if glob is not None else f"local rank {local}{on}"

    def located(self, alert: "Alert") -> "Alert":
        """``alert`` with :attr:`Alert.where` filled in from its line (see :meth:`where`)."""
        where = self.where(alert.line)
        return Alert(alert.kind, alert.line, where) if where else alert

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
            where = self.where(self.stopped_by)
            return f"killed ({self.killed}{', ' + where if where else ''})"
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


def parse_listing(text: str, host: str = "") -> list[JobInfo]:
    """Read the output of the ``job-list.sh`` program.

    The format (written by that script): a ``now<TAB>EPOCH`` line, then per job a
    ``job<TAB>NAME`` line followed by ``KEY<TAB>VALUE`` lines, one value per line (``rank``:
    ``GLOBAL LOCAL`` of a torchrun job's rank on this machine).  ``host`` names the machine
    (:attr:`JobInfo.host`; the alerts of a torchrun job name their rank and host).
    """
    now = 0.0
    jobs: list[JobInfo] = []
    cur: dict | None = None

    def finish():
        if cur is not None:
            jobs.append(_info(cur, now, host))

    for line in text.splitlines():
        key, sep, value = line.partition("\t")
        if not sep:
            continue
        if key == "now":
            now = _num(value) or 0.0
        elif key == "job":
            finish()
            cur = {"name": value, "alert": [], "rank": []}
        elif cur is not None:
            if key in ("alert", "rank"):
                cur[key].append(value)
            else:
                cur[key] = value
    finish()
    return jobs


def _ranks(values: Iterable[str]) -> tuple[tuple[int, int], ...]:
    out = []
    for v in values:
        g, _, lo = v.partition(" ")
        if g.isdigit() and lo.strip().isdigit():
            out.append((int(g), int(lo)))
    return tuple(sorted(out))


def _info(d: dict, now: float, host: str = "") -> JobInfo:
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
    info = JobInfo(
        name=d["name"], now=now, started=_num(d.get("started", "")),
        ended=_num(d.get("ended", "")), alive=d.get("alive") == "1", exit_code=exit_code,
        killed=(d.get("killed", "").strip() or None) if "killed" in d else None,
        stopped_by=stopped_by, runner=d.get("runner", "").strip(),
        shutdown_due=_num(d.get("shutdown", "")), shutdown_state=sd_state,
        last_line=d.get("last", ""), alerts=alerts,
        stop_on=tuple(k for k in d.get("stop_on", "").split(",") if k), alerts_enabled=enabled,
        host=host, torchrun="torchrun" in d, ranks=_ranks(d.get("rank", ())))
    if info.torchrun:
        info = replace(info, alerts=tuple(info.located(a) for a in alerts))
    return info


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


# -- the machine-side programs ---------------------------------------------------------------

#: The job's own programs, installed in its directory at start (each after ``lib.sh``, so a
#: job keeps the scripts it was started with): file name there -> program.
JOB_FILES = {"run.sh": "job-run.sh", "kill.sh": "job-kill.sh", "watch.sh": "job-watch.sh"}


def job_file(name: str) -> str:
    """The text installed as ``name`` (``run.sh``, ``kill.sh``, ``watch.sh``) in a job's
    directory: the shell library, then the program :data:`JOB_FILES` names."""
    return program.source("lib.sh") + "\n" + program.source(JOB_FILES[name])


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

    machine: MachineLike
    name: str
    runner: str = ""
    runner_path: str = ""
    note: str = ""
    archived: str = ""
    pid: int | None = None
    #: The :class:`gpumagic.remote.keep.Keeper` of a job started with ``keep=`` (else None).
    keeper: Keeper | None = None

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
        r = self.machine.exec(program.command("job-follow.sh", self.name,
                                              "all" if lines is None else int(lines), 0), timeout=120)
        if r.exit_code == 3:
            raise JobError(f"no job named {self.name!r} on {self.machine.name}",
                           "`%gpu jobs` lists the jobs on that machine")
        return r.stdout

    def follow(self, out: Callable[[str], None] | None = None,
               alert: Callable[[Alert], None] | None = None, lines: int | None = 100, *,
               grace: float | None = None) -> JobInfo:
        """Print the log (the last ``lines`` lines) and everything appended until the job ends.

        Parameters
        ----------
        out : callable
            Receives text chunks as they arrive (default: this process's stdout).
        alert : callable
            Receives each :class:`Alert` found in complete lines, unless the job was
            started with ``--no-alerts`` (for a torchrun job, with :attr:`Alert.where`: the
            rank and machine; ``local rank L on HOST`` for a rank that started after following
            began).
        lines : int or None
            Earlier lines to show first (None: the whole log).
        grace : float, optional
            Seconds the follow outlives a lost connection, re-attached over a new one (as a
            cell's: :meth:`gpumagic.Machine.run`); 0: it stops when the connection is lost.

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
        scanner = None
        if alert is not None:
            first = self.info()
            if first.alerts_enabled:  # a torchrun job's alerts name their rank and machine
                scanner = _LineScanner(lambda a: alert(first.located(a)))

        def sink(text: str) -> None:
            out(text)
            if scanner is not None:
                scanner.feed(text)

        try:
            r = self.machine.run(["/bin/sh", "-c", program.command(
                "job-follow.sh", self.name, "all" if lines is None else int(lines), 1)],
                                 quiet=True, stdout=sink, capture=False, cwd="", grace=grace)
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
            self.machine.run(["/bin/sh", "-c", program.command("job-wait.sh", self.name)], quiet=True,
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
        r = self.machine.exec(program.command("job-cancel-shutdown.sh", self.name))
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


def list_jobs(machine: MachineLike, only: str | None = None) -> list[JobInfo]:
    """Every job on ``machine`` (one round trip), oldest first."""
    args = [str(ALERT_SCAN_BYTES), only or ""] + [pattern for pattern, _ in ALERTS.values()]
    r = machine.exec(program.command("job-list.sh", *args), timeout=120)
    return sorted(parse_listing(r.stdout, machine.name), key=lambda j: (j.started or 0, j.name))


def shutdown_arming(machine: MachineLike, then_shutdown: float | None) -> tuple[str, int]:
    """``(command, grace_seconds)`` that a job started with ``then_shutdown`` minutes arms on
    ``machine`` (``("", 0)`` for None): the command of :meth:`machine.shutdown_plan()
    <gpumagic.machine.Machine.shutdown_plan>` (the sandbox answers with its stand-in).  One
    round trip; nothing is started.

    Raises
    ------
    JobError
        ``then_shutdown`` is not minutes from 0 to 43200; the machine cannot shut itself down.
    """
    if then_shutdown is None:
        return "", 0
    if not (isinstance(then_shutdown, (int, float)) and 0 <= then_shutdown <= 30 * 24 * 60):
        raise JobError(f"--then-shutdown takes minutes from 0 to 43200, not {then_shutdown!r}",
                       "e.g. --then-shutdown 10")
    plan = machine.shutdown_plan()  # the sandbox (this computer) answers with a stand-in
    if not plan.possible or plan.command is None:
        raise JobError(f"--then-shutdown: {machine.name} cannot shut itself down, so the job "
                       f"was not started: {plan.reason}",
                       "start the job without --then-shutdown and stop the instance yourself")
    return plan.command, int(round(then_shutdown * 60))


@dataclass(frozen=True)
class JobOptions(Options):
    """How a detached job runs, whatever starts it (``%%remote --job``, ``--torchrun``,
    ``--each``): one object from the magics to :func:`start`, as asyncssh's
    ``SSHClientConnectionOptions`` travels.  The plain-Python API also takes each field as
    a keyword (``m.start_job("train", cmd, cwd="proj", then_shutdown=10)``), merged by
    :meth:`with_`.

    Attributes
    ----------
    python : bool
        The command is Python source (run with ``python3 -u``), not a bash script.
    cwd : str, optional
        Working directory (default: the machine's ``cwd``, else the login directory);
        ``~/...`` and relative paths start at the remote ``$HOME``.
    env : mapping, optional
        Extra environment variables on top of the user's login environment.
    stop_on : iterable of str or "nan,oom,traceback"
        Kill the job at the first log line of these alert kinds (watched on the remote).
    then_shutdown : float, optional
        Minutes after a successful end (exit 0) after which the machine shuts down.
        Checked when the job starts with :meth:`Machine.shutdown_plan
        <gpumagic.machine.Machine.shutdown_plan>` (on the sandbox: its stand-in).
    alerts : bool
        Show alerts when following or listing (``--no-alerts`` turns them off).
    resume_arg : str, optional
        What a move or resume (:mod:`gpumagic.remote.move`) adds to the command to continue
        from a checkpoint, ``{checkpoint}`` standing for its path there (``--resume-arg
        "--resume {checkpoint}"``); recorded here at start, unused by the start itself.
    """

    python: bool = False
    cwd: str | None = None
    env: Mapping[str, str] | None = None
    stop_on: Iterable[str] | str | None = None
    then_shutdown: float | None = None
    alerts: bool = True
    resume_arg: str | None = None

    kind = "job"


#: The fields of :class:`JobOptions`: what the plain-Python API takes as keywords.
JOB_OPTION_NAMES = JobOptions.names()


def start(machine: MachineLike, name: str, command: str, options: JobOptions = JobOptions(), *,
          tool_dirs: Iterable[str] = TOOL_DIRS) -> Job:
    """Start ``command`` on ``machine`` as a detached job; returns at once.

    Parameters
    ----------
    machine : Machine
    name : str
        Job name (see :data:`NAME_RE`).  A finished job of that name is kept as
        ``NAME-STARTEPOCH``; a running one makes this fail.
    command : str
        A bash script, or Python source with ``options.python`` (run with ``python3 -u``).
    options : JobOptions
        Working directory, environment, alerts, stop-on kinds, shutdown after the end.
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
    kinds = parse_stop_on(options.stop_on)
    if options.resume_arg is not None and (not isinstance(options.resume_arg, str) or not options.resume_arg.strip()):
        raise JobError(f"--resume-arg must be the words to add to the command, not {options.resume_arg!r}",
                       'e.g. --resume-arg "--resume {checkpoint}"')
    tool_dirs = tuple(tool_dirs)
    searched = "its PATH" + (f" and {', '.join(tool_dirs)}" if tool_dirs else "")
    sd_cmd, grace = shutdown_arming(machine, options.then_shutdown)
    data = cell_bytes(command, python=options.python)  # CRLF -> LF, no NUL, no surrogate it cannot send
    cwd = options.cwd
    work = check_text(cwd if cwd is not None else (machine.cwd or ""), "the working directory", by_line=False)
    # Names that are not shell variable names (exported bash functions) are left out.
    lines, _ = export_lines({**machine.env.current(), **(options.env or {})})
    # The launcher receives the job's programs, patterns and environment as shell variables
    # set before it (the program travels on stdin: no value is in an argv, none is exported).
    given = {"RUN": job_file("run.sh"), "KILL": job_file("kill.sh"), "WATCH": job_file("watch.sh"),
             "STOP_RE": _alert_re(kinds) if kinds else "", "JOBENV": "\n".join(lines)}
    given.update({f"RE_{k}": ALERTS[k][0] for k in ALERTS})
    line = "".join(f"{k}={shlex.quote(v)}\n" for k, v in given.items()) + program.command(
        "job-launch.sh", name, work, "python3" if options.python else "bash", ",".join(kinds), sd_cmd, grace,
        1 if options.alerts else 0, KILL_GRACE, ":".join(tool_dirs))
    r = machine.exec(line, stdin=data, timeout=90)
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
