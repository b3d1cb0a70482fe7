"""Moving a job to another machine, or resuming it on the same one (see :mod:`gpumagic.remote.move`).

A move (:func:`move`): a job still running on a machine that answers is refused unless
``yes``; with it, its keeper looks a last time, then the job is killed there.  The project
folder goes to the same working directory on the other machine, then the newest kept
checkpoint into the same checkpoint folder; the command starts there under the same name with
the same options, its resume argument filled in (``--resume {checkpoint}`` -> the path
there), ``GPUMAGIC_RESUME`` set to that path, and a first log line that marks the seam.
What the job arranged for its machine follows it (:func:`_follow_rules`): ``--then-shutdown``
(an option of the job), and a budget guard armed from here on the old machine is armed on the
new one (:func:`gpumagic.budget.guard.carry_guard`); the ledger keeps the old machine's
rental up to the last time it answered.  The new start record names the logs of the earlier
runs as kept here (``earlier_logs``), so ``%gpu logs NAME`` shows one log (:func:`earlier_log`).

Two moves of one job never run at once, from one notebook or two: each holds the start
record's lock file (:func:`move_lock`), and writes who holds it beside it (:class:`Mover`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, ClassVar

from ..._fs import private_dir
from ..._stored import Stored
from ...errors import JobError
from ..keep import record_dir, record_of as keep_record_of
from .loss import _clock, gpu_lost, newest_kept
from .reaching import UNREACHABLE, note_failed, note_seen, reach, why
from .store import (StartRecord, TorchrunLayout, abs_dirs, job_options, project_folder_here, start_record,
                    update_start)

if TYPE_CHECKING:
    from ..._types import MachineLike
    from ..jobs import Job

# -- a move, step by step -------------------------------------------------------------------------------


def find_start(job: str, machine_name: str | None = None) -> StartRecord:
    """The start record of ``job`` (on ``machine_name``, else the newest of any machine's that
    was not moved away).

    Raises
    ------
    JobError
        When no record of that job is here.
    """
    if machine_name is not None:
        rec = start_record(machine_name, job)
        if rec is None:
            raise JobError(f"no record here of a job {job!r} started on {machine_name}",
                           "move or resume a job started with `%%remote --job NAME` from this computer")
        return rec
    from ...paths import data_dir

    base = data_dir() / "keep"
    found = [r for p in (sorted(base.glob(f"*/{job}.job.json")) if base.is_dir() else ())
             if (r := StartRecord.load(p)) and not r.moved_to]
    if not found:
        raise JobError(f"no record here of a job named {job!r}",
                       "move or resume a job started with `%%remote --job NAME` from this computer (`%gpu jobs` lists them)")
    return max(found, key=lambda r: r.started)


def resumed_command(rec: StartRecord, checkpoint: str | None, seam: str) -> str:
    """The job's command as it starts again: a first line that prints ``seam`` (the log's
    mark), and the resume argument with ``{checkpoint}`` filled in: added to the last command
    line of a bash cell; for Python source, ``sys.argv`` set on that first line."""
    command = rec.command
    arg = rec.options.resume_arg or ""
    python = rec.options.python
    fill = checkpoint or ""
    if python:
        argv = [w.replace("{checkpoint}", fill) for w in shlex.split(arg)] if arg and checkpoint else []
        first = f"import sys; print({seam!r}, flush=True)" + (f"; sys.argv[1:] = {argv!r}" if argv else "")
        return first + "\n" + command
    lines = command.split("\n")
    if arg and checkpoint:
        idx = next((i for i in range(len(lines) - 1, -1, -1)
                    if lines[i].strip() and not lines[i].lstrip().startswith("#")), None)
        if idx is not None:
            lines[idx] = lines[idx].rstrip() + " " + arg.replace("{checkpoint}", shlex.quote(fill))
    return f"printf '%s\\n' {shlex.quote(seam)}\n" + "\n".join(lines)


def _final_pull_and_stop(source: MachineLike, name: str, say: Callable[[str], None]) -> None:
    """A last look of the job's keeper (the newest checkpoint written whole is kept), then
    the job is killed on ``source``."""
    from ..jobs import Job

    k = source.keepers.get(name)
    if k is not None:
        k.stop("the job was moved")
        try:
            k.look()
        except Exception as e:  # the move goes on from what was kept before
            say(f"the last look at job {name}'s checkpoints on {source.name} failed ({e}); "
                "moving from the newest kept before")
    Job(source, name).kill("moved")


def _final_log(source: MachineLike, rec: StartRecord) -> str | None:
    """Pull the job's log from ``source`` a last time (where its keeper keeps it, or beside the
    start record); returns the local file, or None when it could not be had."""
    from ..keep import log_folder, pull_log

    name = rec.job
    k = source.keepers.get(name)
    keep_rec = keep_record_of(source.name, name)
    if k is not None:
        folder = os.path.dirname(k.record.log)
    elif keep_rec and keep_rec.log and keep_rec.started >= rec.started - 5:
        folder = os.path.dirname(keep_rec.log)
    else:
        folder = os.fspath(log_folder(source.name, name, rec.started or time.time()))
    try:
        return pull_log(source, name, folder)
    except Exception:  # the log is a convenience: the move goes on without it
        return None


def _check_source(source: MachineLike | None, rec: StartRecord, yes: bool, same: bool,
                  say: Callable[[str], None]) -> tuple[bool, str | None]:
    """Whether the job may move from ``source`` (None: not connected here): refused while it
    runs there without ``yes`` (or always, for a resume); with ``yes`` stopped there first.
    Returns whether ``source`` answered, and the job's log there as pulled here a last time
    (None when it could not be)."""
    from ..jobs import list_jobs

    name = rec.job
    if source is None:
        return False, None
    try:
        found = list_jobs(source, only=name)
    except UNREACHABLE as e:
        note_failed(source.name, why(e))
        if not same:
            say(f"{source.name} does not answer ({why(e)}): job {name} could not be stopped there; "
                f"it is stopped when {source.name} is connected again")
        return False, None
    note_seen(source.name)
    info = found[0] if found else None
    if info is None or not info.running:
        if info is not None and info.state == "exited" and info.exit_code == 0:
            raise JobError(f"job {name} finished on {source.name} (exited 0): there is nothing to "
                           f"{'resume' if same else 'move'}; start it anew with `%%remote --job {name} ...`")
        return True, _final_log(source, rec)
    if same:
        raise JobError(f"job {name} is still running on {source.name}; there is nothing to resume",
                       f"`%gpu logs {name} --follow` watches it")
    loss = None if yes else gpu_lost(source, rec)  # a run whose GPU went is stuck or failing: no --yes needed
    if not yes and loss is None:
        raise JobError(f"job {name} is still running on {source.name}: pass --yes to stop it there "
                       f"(after a last checkpoint pull) and move it")  # one line: it says what to do
    _final_pull_and_stop(source, name, say)
    say(f"stopped job {name} on {source.name} after a last look at its checkpoints"
        + (f" ({loss})" if loss is not None else ""))
    return True, _final_log(source, rec)


def _preflight(target_name: str, rec: StartRecord, src: str | None, how: Start) -> str | None:
    """Everything a move checks before it stops anything (one-line errors that say what to do):
    that the job can continue from a checkpoint kept here (a resume argument, ``--keep``, a
    checkpoint kept) unless ``how.from_start``; that the project folder is known (``src``, or
    recorded) for a move to another machine unless ``how.no_src``.  Returns the project folder."""
    name, same = rec.job, rec.machine == target_name
    verb = "resume" if same else "move"
    again = f"`%gpu job {verb} {name}{'' if same else ' --to ' + target_name} --from-start`"
    if src is not None and not os.path.isdir(src):
        raise JobError(f"--src {src}: no such folder here", "name the job's project folder on this computer")
    if not how.from_start:
        keep = rec.keep
        kept = newest_kept(keep_record_of(rec.machine, name))
        if not rec.options.resume_arg:
            raise JobError(f"job {name} was started without --resume-arg, so it cannot continue from a checkpoint: "
                           f"{again} starts it again from the beginning")
        if not keep:
            raise JobError(f"job {name} was started without --keep: no checkpoint of it is kept here; "
                           f"{again} starts it again from the beginning")
        if not kept:
            raise JobError(f"no checkpoint of job {name} is kept here yet; {again} starts it again from the beginning")
    if src is None and not same and not how.no_src:
        raise JobError(f"no project folder is recorded for job {name} (no `%gpu sync` to its folder {rec.cwd or '~'} "
                       f"here), so its files would be missing on {target_name}: pass --src DIR to push it, or "
                       "--no-src if they are there already")
    return src


def _push_state(target: MachineLike, rec: StartRecord, src: str | None, how: Start,
                say: Callable[[str], None]) -> tuple[str | None, str | None]:
    """Push the project folder and the newest kept checkpoint to ``target``; returns
    ``(checkpoint path there, checkpoint as the job names it)`` (Nones: it starts from the
    beginning, ``how.from_start``, or a standby move with nothing kept)."""
    keep = rec.keep
    keep_rec = keep_record_of(rec.machine, rec.job)
    kept = newest_kept(keep_rec)
    use = bool(kept and keep_rec is not None and keep and rec.options.resume_arg
               and not how.from_start)
    dirs = abs_dirs(target, rec.cwd, keep.path.rstrip("/") if keep and use else "")
    if src:
        if not os.path.isdir(src):
            raise JobError(f"--src {src}: no such folder here", "name the job's project folder on this computer")
        summary = target.push(src.rstrip("/\\") + os.sep, dirs[0])
        say(f"pushed the project folder {src} to {target.name}:{dirs[0]} ({summary.files_sent} file{'' if summary.files_sent == 1 else 's'} sent)")
    elif rec.machine != target.name:
        say(f"no project folder is recorded for job {rec.job} (no push to its folder): only its "
            f"checkpoint goes; its files must be in {target.name}:{dirs[0]} already")
    if not use:
        say(f"job {rec.job} starts from the beginning on {target.name}"
            + (" (--from-start)" if how.from_start else " (no checkpoint kept here, or no --resume-arg)"))
        return None, None
    assert kept is not None and keep_rec is not None and keep is not None
    local = os.path.join(keep_rec.local, kept[0])
    if not os.path.exists(local):
        raise JobError(f"the newest kept checkpoint {local} is gone from this computer",
                       "put it back, or pass --src with a folder that holds the checkpoint")
    target.push(local, dirs[1] + "/")
    say(f"pushed checkpoint {kept[0]} to {target.name}:{dirs[1]}/")
    return f"{dirs[1]}/{kept[0]}", f"{keep.path.rstrip('/')}/{kept[0]}"


@dataclass(frozen=True)
class Start:
    """How a moved job starts: ``from_start`` (from the beginning, on purpose: no checkpoint
    needed), ``no_src`` (no project folder pushed: its files are there already),
    ``from_start_if_none_kept`` (a standby move: from the beginning where no checkpoint is kept
    or the job has no resume argument, said))."""

    from_start: bool = False
    no_src: bool = False
    from_start_if_none_kept: bool = False


def move(source: MachineLike | None, target: MachineLike, name: str, *, rec: StartRecord, yes: bool = False,
         src: str | None = None, torchrun: int | str | None = None, how: Start = Start(),
         say: Callable[[str], None] = print) -> Job:
    """Move job ``name`` from ``source`` (None: not connected here; ``target`` itself for a
    resume) to ``target``, from the newest checkpoint kept here (see the module), holding the
    start record's lock throughout (:func:`move_lock`).

    Parameters
    ----------
    rec : StartRecord
        The job's start record (:func:`find_start`); read again once the lock is held.
    yes : bool
        Stop the job on ``source`` first when it still runs there (after a last look of its
        keeper); not needed where a GPU it could use is gone (:func:`gpu_lost`).
    src : str, optional
        The project folder here (default: the one recorded as pushed to the job's folder).
    torchrun : int or "auto", optional
        Start it under torchrun with that many processes per machine (then without ``--keep``);
        default: as it ran (a torchrun job keeps its layout, recorded at its start).
    how : Start
        From the beginning on purpose; without a project folder on purpose (see :class:`Start`).

    Raises
    ------
    JobError
        Before anything is stopped: another move of the job runs (naming it), or one moved it
        already; no resume argument, ``--keep`` or kept checkpoint (without ``how.from_start``);
        no project folder known (without ``how.no_src``); a command torchrun cannot run on each
        rank (with ``torchrun``).  Still running without ``yes``; a resume of a job that runs or
        ended with exit code 0.
    """
    with move_lock(rec.machine, name, target.name, "resume" if source is target else "move"):
        current = start_record(rec.machine, name)  # as it is now that the lock is held
        if current is not None and current.moved_to:
            raise JobError(f"job {name} was moved from {rec.machine} to {current.moved_to} at "
                           f"{_clock(current.moved_at or time.time())} already; "
                           f"`%gpu jobs --host {current.moved_to}` lists it there")
        return _move(source, target, name, current or rec, yes, src, torchrun, how, say)


def check_move(source: MachineLike | None, target_name: str, name: str, *, rec: StartRecord, yes: bool = False,
               src: str | None = None, torchrun: int | str | None = None, how: Start = Start()) -> None:
    """What :func:`move` would refuse, checked before there is a target (one that is yet to be
    rented, named ``target_name``), so that no machine is rented for a move that cannot go: the
    job moved already, nothing to continue from, no project folder known, a command torchrun
    cannot run, or (without ``yes``) a job still running on a ``source`` that answers.  Reads
    only; stops nothing.

    Raises
    ------
    JobError
        As :func:`move` would, with the same words.
    """
    from ..jobs import list_jobs

    current = start_record(rec.machine, name) or rec
    if current.moved_to:
        raise JobError(f"job {name} was moved from {rec.machine} to {current.moved_to} already; "
                       f"`%gpu jobs --host {current.moved_to}` lists it there")
    src = src or current.src or project_folder_here(current.machine, current.cwd)
    _preflight(target_name, current, src, how)
    if torchrun is not None or current.torchrun is not None:
        torchrun_form(current)
    if yes or source is None:
        return
    try:
        found = list_jobs(source, only=name)
    except UNREACHABLE:
        return  # a lost machine: the move goes on without it
    info = found[0] if found else None
    if info is not None and info.running and gpu_lost(source, current) is None:
        raise JobError(f"job {name} is still running on {source.name}: pass --yes to stop it there "
                       f"(after a last checkpoint pull) and move it")


def _move(source: MachineLike | None, target: MachineLike, name: str, rec: StartRecord, yes: bool, src: str | None,
          torchrun: int | str | None, how: Start, say: Callable[[str], None]) -> Job:
    same = source is target
    src = src or rec.src or (None if same else project_folder_here(rec.machine, rec.cwd))
    if how.from_start_if_none_kept and not how.from_start:
        if not newest_kept(keep_record_of(rec.machine, name)) or not rec.options.resume_arg:
            how = Start(from_start=True, no_src=how.no_src)
    ran = rec.torchrun
    layout = torchrun if torchrun is not None else (ran.nproc if ran else None)
    _preflight(target.name, rec, src, how)
    form = torchrun_form(rec) if layout is not None else None  # refused here, before anything is stopped
    reached, last_log = _check_source(source, rec, yes, same, say)
    keep = rec.keep
    if source is not None and not same:
        k = source.keepers.get(name)
        if k is not None:
            k.stop(f"the job was moved to {target.name}")
    checkpoint, named = _push_state(target, rec, src, how, say)
    at = time.strftime("%Y-%m-%d %H:%M:%S")
    whence = f"resumed on {target.name}" if same else f"moved from {rec.machine} to {target.name}"
    anew = "from the beginning" + (" (--from-start)" if how.from_start else " (no checkpoint kept)")
    seam = f"--- gpumagic: job {name} {whence} at {at}, {'from checkpoint ' + named if named else anew} ---"
    options = job_options(rec, env={**job_options(rec).env, **({"GPUMAGIC_RESUME": checkpoint} if checkpoint else {})})
    logs = _earlier_logs(rec, last_log)
    if form is not None:
        from ..distributed import TorchrunOptions

        if keep:
            say(f"--torchrun: the checkpoints of job {name} are not kept on {target.name} (--keep is not yet "
                "for torchrun jobs)")
        if ran is not None and len(ran.hosts) > 1:
            say(f"job {name} ran under torchrun on {', '.join(ran.hosts)}; it continues on {target.name} alone")
        run = TorchrunOptions(nproc=layout, torchrun_args=ran.args if ran else ())  # type: ignore[arg-type]
        job = target.start_job(name, torchrun_script(form, rec.options.resume_arg,
                                                     checkpoint, seam), options, torchrun=run)
    else:
        job = target.start_job(name, resumed_command(rec, checkpoint, seam), options, keep=keep)
    now = time.time()
    if not same:
        # not reached: what it may still run, and its guard, are seen to when it is connected again
        update_start(rec.machine, name, moved_to=target.name, moved_at=now,
                     cleanup=None if reached else "pending")
    update_start(target.name, name, command=rec.command if form is None else form, src=src,
                 moved_from=None if same else rec.machine, checkpoint=named, resumed_at=now,
                 earlier_logs=logs, seam=seam,
                 torchrun=None if form is None or layout is None else
                 TorchrunLayout(layout, ran.args if ran else (), (target.name,)),
                 options=dataclasses.replace(rec.options, env=dict(rec.options.env)))
    if not same:
        _follow_rules(rec.machine, target, say)
    return job


# -- one move at a time ---------------------------------------------------------------------------

MOVER_FORMAT = "gpumagic-mover"


@dataclass
class Mover(Stored):
    """``JOB.job.mover``: who holds a job's move lock (:func:`move_lock`): its process and
    computer, the machine it moves the job to, ``move`` or ``resume``, and since when."""

    FORMAT: ClassVar[str] = MOVER_FORMAT
    VERSION: ClassVar[int] = 1

    pid: int | None = None
    host: str = "?"
    to: str = "?"
    what: str = "move"
    since: float = 0.0
    version: int = VERSION
    extra: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, d: dict) -> Mover:
        return cls(None if d.get("pid") is None else int(d["pid"]), str(d.get("host") or "?"),
                   str(d.get("to") or "?"), str(d.get("what") or "move"), float(d.get("since") or 0))

    def to_dict(self) -> dict:
        return {"pid": self.pid, "host": self.host, "to": self.to, "what": self.what, "since": self.since}


@contextlib.contextmanager
def move_lock(machine_name: str, job: str, to: str, what: str = "move"):
    """Hold the lock of job ``job``'s start record on ``machine_name`` for a move (or resume) to
    ``to``: ``JOB.job.lock`` beside the record, taken with filelock (``flock`` on POSIX,
    ``msvcrt.locking`` on Windows), so two notebooks, or a typed move and a ``--fallback`` one,
    never move one job at once.  Who holds it is written beside it (``JOB.job.mover``: process,
    computer, target, since when) for the one that finds it taken.

    Raises
    ------
    JobError
        Another move holds it (one line that names it); nothing was done.
    """
    import socket

    import filelock

    folder = record_dir(machine_name)
    private_dir(folder.parent)
    private_dir(folder)
    who_path = folder / f"{job}.job.mover"
    lock = filelock.FileLock(os.fspath(folder / f"{job}.job.lock"), mode=0o600)
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        who = Mover.load(who_path)
        by = "by another notebook on this computer"
        if who is not None and who.pid:
            here = who.pid == os.getpid() and who.host == socket.gethostname()
            by = ("by this notebook" if here else f"by another notebook (process {who.pid} on {who.host})")
            by += f": a {who.what} to {who.to} since {_clock_s(who.since)}"
        raise JobError(f"job {job} is being moved already, {by}; wait for it to end, then `%gpu jobs --host "
                       f"{who.to if who is not None and who.to != '?' else to}` shows where it runs") from None
    try:
        with contextlib.suppress(OSError):
            Mover(os.getpid(), socket.gethostname(), to, what, time.time()).save(who_path)
        yield
    finally:
        with contextlib.suppress(OSError):
            who_path.unlink()
        lock.release()


def _clock_s(epoch: float) -> str:
    """``14:07:02`` (laptop time)."""
    return time.strftime("%H:%M:%S", time.localtime(epoch))


# -- a run under torchrun -------------------------------------------------------------------------


def _one_command(line: str) -> list[str] | None:
    """The words of ``line`` when it is one command without shell syntax (no ``|``, ``;``,
    ``&&``, redirection, ``$``, backquote or leading ``NAME=value``), split as a shell would;
    else None."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    try:
        words = list(lex)
    except ValueError:
        return None
    if (not words or "$" in line or "`" in line or any(w and set(w) <= set("();<>|&") for w in words)
            or "=" in words[0].split("/")[0]):
        return None
    return words


def torchrun_form(rec: StartRecord) -> str:
    """Job ``rec``'s command as torchrun runs it on each rank (what ``%%remote --job NAME
    --torchrun N`` takes): a torchrun job's own script (Python source, or a ``!`` command line);
    a Python job's source; a bash job of one command line as ``!LINE``.

    Raises
    ------
    JobError
        A bash job of several lines, or with shell syntax (torchrun starts one program per rank).
    """
    command = rec.command
    if rec.torchrun or rec.options.python:
        return command
    lines = [ln.strip() for ln in command.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if len(lines) == 1 and _one_command(lines[0]) is not None:
        return "!" + lines[0]
    what = f"{len(lines)} lines" if len(lines) != 1 else f"shell syntax in {lines[0][:60]!r}"
    raise JobError(f"--torchrun: job {rec.job}'s command is a bash script ({what}), and torchrun runs one "
                   "program on each rank", "start it with one command line (`python3 train.py ...`) or as "
                   "Python (--python), or move it without --torchrun")


def torchrun_script(form: str, resume_arg: str | None, checkpoint: str | None, seam: str) -> str:
    """The Python script each rank runs for a moved torchrun job (``form``, :func:`torchrun_form`):
    rank 0 prints ``seam`` first (in the job's log as ``[default0]:--- gpumagic: ...``); the
    resume words, ``{checkpoint}`` filled in, become ``sys.argv[1:]`` of Python source, or end
    the ``!`` command line, which the rank then runs in its place (as torchrun's ``--exec``)."""
    words = [w.replace("{checkpoint}", checkpoint) for w in shlex.split(resume_arg)] if resume_arg and checkpoint else []
    head = f"import os, sys; print({seam!r}, flush=True) if os.environ.get('RANK', '0') == '0' else None"
    text = form.lstrip()
    if text.startswith("!"):
        argv = shlex.split(text[1:].strip()) + words
        return f"{head}; os.execvp({argv[0]!r}, {argv!r})\n"
    return head + (f"; sys.argv[1:] = {words!r}" if words else "") + "\n" + form


def record_torchrun(machines, name: str, script: str, nproc: int | str, args) -> None:
    """Keep in the start records of a torchrun job (one per machine) what a move starts again:
    the script the ranks run (not the machine's torchrun command line) and the layout."""
    hosts = [m.name for m in machines]
    for m in machines:
        update_start(m.name, name, command=script, torchrun=TorchrunLayout(nproc, tuple(args), tuple(hosts)))


def _earlier_logs(rec: StartRecord, last_log: str | None) -> list[str]:
    """The logs kept here of the runs before this one: the earlier runs' (``earlier_logs`` of
    the record), then the log of the run that is moved (``last_log``: pulled a last time; else
    as its keeper kept it)."""
    logs = list(rec.earlier_logs)
    if last_log:
        return logs + [last_log]
    keep_rec = keep_record_of(rec.machine, rec.job)
    if keep_rec and keep_rec.log and os.path.isfile(keep_rec.log) and keep_rec.started >= rec.started - 5:
        logs.append(keep_rec.log)
    return logs


def earlier_log(machine_name: str, name: str, lines: int | None) -> str:
    """The last ``lines`` lines (None: all) of the logs kept here of the runs of job ``name``
    before the one on ``machine_name`` (``""`` when it was not moved or resumed, or none was
    kept); each ends with a newline, so the new log's first line (the seam) follows on its own."""
    rec = start_record(machine_name, name)
    if not rec or not rec.earlier_logs or lines == 0:
        return ""
    parts = []
    for path in rec.earlier_logs:
        try:
            with open(path, encoding="utf-8", errors="replace", newline="") as f:
                text = f.read()
        except OSError:
            continue
        parts.append(text if not text or text.endswith("\n") else text + "\n")
    text = "".join(parts)
    if lines is None:
        return text
    kept = text.splitlines(keepends=True)[-lines:]
    return "".join(kept)


def _follow_rules(source_name: str, target: MachineLike, say: Callable[[str], None]) -> None:
    """After a move from ``source_name``: its rental kept in the ledger up to the last time it
    answered, ``target``'s begun, and a guard armed from here on ``source_name`` armed on
    ``target`` too (never raises: each failure is said)."""
    from ...budget import guard as budget_guard
    from ...budget.ledger import Ledger, note_last_seen

    try:
        ledger = Ledger()
        last = reach(source_name).last_seen
        if last:
            note_last_seen(ledger, source_name, last)
        rec = ledger.machine(target.name)
        if rec is not None and rec.prices is not None:
            target.budget.meter(ledger=ledger)  # its rental starts in the ledger now
        budget_guard.carry_guard(ledger, source_name, target, say)
    except Exception as e:  # the move is done; what follows it is said, never raised
        say(f"the budget rules of {source_name} did not follow the job to {target.name}: "
            f"{getattr(e, 'message', None) or e}")


