"""Checkpoints kept off the machine while a job runs: ``%%remote --job NAME --keep ckpt/``.

A :class:`Keeper` is a background thread of the notebook's process, one per kept job, owned
by the :class:`~gpumagic.machine.Machine` (:attr:`~gpumagic.machine.Machine.keepers`) and
stopped with its connection; it is no daemon of the laptop.  Every ``every`` seconds it lists
the job's checkpoint folder on the machine (``keep-list.py``: one round trip) and pulls each
new or changed file with the sync engine (:func:`gpumagic.sync.engine.pull`, so its
compression and appended-tail rules apply) into a staging folder beside the kept ones
(``.gpumagic-keep/``), then puts it at its kept name by a temporary name and a rename.

A checkpoint being written is never taken half:

* a file that appears by a rename (``torch.save(tmp); os.replace(tmp, final)``) is whole from
  that moment: the machine-side watcher (``keep-watch.py``, inotify) reports each rename into
  the folder with the file's size, mtime and inode, and a file that the listing shows with
  exactly those is taken at once;
* any other file (written in place, as ``torch.save(path)`` does) is taken only once it has
  held still for ``settle`` seconds: its mtime that old on the machine's clock (every write
  moves it), so a file already there when the keeper starts (after a notebook restart) is
  taken at the first look;
* after the pull the folder is listed again, and the copy is kept only if the file is still
  what was judged whole (no write began while it was read); otherwise it is left staged and
  judged again;
* once the job has ended (its ``exit_code`` is written), every file is whole: one last look
  takes them, and the keeper stops.

Names of temporary files (a leading ``.``, ``tmp-``, ``tmp_``, ``tmp.``; ``.tmp``, ``.part``,
``.partial``, ``.incomplete``, ``~`` endings), and what is in folders so named, are never
kept (Hugging Face writes ``tmp-checkpoint-500/`` and renames it ``checkpoint-500/``).  With ``last=K`` only the newest K
checkpoints stay on the laptop: a checkpoint is one entry of the folder (a file, or a folder
such as Hugging Face's ``checkpoint-500/``), dated by its newest file's mtime.

What was kept and when is recorded in the laptop's gpumagic data directory
(``keep/MACHINE/JOB.json`` under :func:`gpumagic.paths.data_dir`; a
:class:`KeepRecord`), so that ``%gpu jobs`` says it after the notebook restarts (:func:`records`).

The job's log is kept too, at most every :data:`LOG_EVERY` seconds and at the last look
(``keep/MACHINE/JOB.logs/RUN/log``, :func:`pull_log`): after a move, ``%gpu logs NAME`` on the
new machine shows it before the new log (:mod:`gpumagic.remote.move`).  With a *fallback*
(:attr:`Keeper.fallback`, ``--fallback b``), a keeper whose machine has not answered for
:data:`gpumagic.remote.move.reaching.LOST_AFTER` seconds, or answers without the job's process or a GPU it
could use (:attr:`Keeper.lost_check`), calls it once and stops.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar, Protocol

from .._fs import private_dir
from .._stored import Stored, opt_float
from ..errors import GpumagicError, JobError, SyncError
from . import program

if TYPE_CHECKING:
    from .._types import MachineLike

#: Default seconds between looks at the checkpoint folder.
EVERY = 60.0
#: Default seconds a file written in place must hold still (size and mtime) to be taken.
SETTLE = 10.0
#: The staging folder inside the local folder (the sync engine's destination).
STAGE = ".gpumagic-keep"


@dataclass(frozen=True)
class KeepOptions:
    """What ``--keep`` asks for (``%%remote --job NAME --keep DIR ...``).

    Attributes
    ----------
    path : str
        The folder on the machine, relative to the job's working directory (``~/...`` and
        absolute paths too).
    every : float
        Seconds between looks (``--keep-every``).
    to : str or None
        The local folder (``--keep-to``); None: ``./NAME/<last part of path>/`` under the
        notebook's directory when the job starts.
    last : int or None
        Keep only the newest ``last`` checkpoints on the laptop (``--keep-last``).
    settle : float
        Seconds a file written in place must hold still before it is taken (``--keep-settle``).

    Raises
    ------
    JobError
        For an empty path, ``every`` not above 0, ``settle`` below 0, ``last`` below 1.
    """

    path: str
    every: float = EVERY
    to: str | None = None
    last: int | None = None
    settle: float = SETTLE

    def __post_init__(self):
        if not self.path or not self.path.strip("/"):
            raise JobError(f"--keep {self.path!r} names no folder", "e.g. --keep ckpt/")
        if not self.every > 0:
            raise JobError(f"--keep-every must be above 0 s, not {self.every!r}", "e.g. --keep-every 5m")
        if not self.settle >= 0:
            raise JobError(f"--keep-settle must be 0 s or more, not {self.settle!r}", "e.g. --keep-settle 10s")
        if self.last is not None and not (isinstance(self.last, int) and self.last >= 1):
            raise JobError(f"--keep-last must be a whole number from 1, not {self.last!r}", "e.g. --keep-last 3")

    def local_folder(self, job: str, run: int = 1) -> str:
        """The absolute local folder for run ``run`` of job ``job``: ``--keep-to``'s, else
        ``./JOB/ckpt/`` for the first run and ``./JOB/run-N/ckpt/`` for run N after it, so
        that an earlier run's checkpoints are kept apart, never replaced by a later one's."""
        if self.to:
            return os.path.abspath(os.path.expanduser(self.to))
        name = os.path.basename(self.path.rstrip("/")) or "ckpt"
        return os.path.abspath(os.path.join(job, name) if run <= 1 else os.path.join(job, f"run-{run}", name))

    def make_local_folder(self, job: str, run: int = 1) -> str:
        """Make the local folder (and its staging folder) before the job starts; returns it.

        Raises
        ------
        JobError
            It cannot be made here (a file of that name, no permission, a full disk).
        """
        folder = self.local_folder(job, run)
        try:
            os.makedirs(os.path.join(folder, STAGE), exist_ok=True)
        except OSError as e:
            raise JobError(f"--keep-to {folder}: cannot make that folder here ({e.strerror or e}); "
                           "the job was not started", "name another folder with --keep-to LOCAL_DIR") from None
        return folder


# -- the record on the laptop -----------------------------------------------------------------


#: Seconds of slack when a new run's keeper leaves out the files written before the run
#: started (mtime granularity, the clocks' offset measured over a round trip).
RUN_SLACK = 1.0
#: The ``format`` of a keep record (``keep/MACHINE/JOB.json``, :func:`records`).
RECORD_FORMAT = "gpumagic-keep"
#: Seconds between pulls of the job's log (a look pulls it when this long has passed).
LOG_EVERY = 5.0


@dataclass
class KeptFile:
    """A file of the kept folder: its signature on the machine when it was taken (``(size,
    mtime in ns, inode)``), when it arrived here, when the machine wrote it (this computer's
    clock; None in a record made before that was recorded), and whether ``--keep-last``
    removed it since."""

    sig: tuple[int, int, int]
    kept_at: float = 0.0
    pruned: bool = False
    written_at: float | None = None

    @classmethod
    def from_dict(cls, d: dict) -> KeptFile:
        size, mtime, inode = (int(x) for x in d.get("sig") or (0, 0, 0))
        return cls((size, mtime, inode), float(d.get("kept_at") or 0), bool(d.get("pruned")),
                   opt_float(d.get("written_at")))

    def to_dict(self) -> dict:
        out: dict = {"sig": list(self.sig), "kept_at": self.kept_at, "pruned": self.pruned}
        if self.written_at is not None:
            out["written_at"] = self.written_at
        return out


@dataclass(frozen=True)
class LastKept:
    """The newest checkpoint kept (by its mtime there): its path in the folder, and when it arrived."""

    path: str
    at: float

    @classmethod
    def from_dict(cls, d: dict | None) -> LastKept | None:
        return None if not d else cls(str(d["path"]), float(d.get("at") or 0))

    def to_dict(self) -> dict:
        return {"path": self.path, "at": self.at}


@dataclass
class KeepRecord(Stored):
    """What a keeper kept of one run of a job, and how it stands (``keep/MACHINE/JOB.json``).

    Attributes
    ----------
    machine, job : str
    run : int
        Which start of the job (a record from before runs were numbered: 1).
    path : str
        The folder on the machine (``--keep``); ``local``: the folder here.
    every : float
        Seconds between looks; ``last``: ``--keep-last``.
    started : float
        When the keeper started (laptop epoch seconds).
    state : str
        ``keeping``, or why it stopped (``the job ended``, ``the job was lost (...)``).
    log : str
        The job's log as kept here.
    last_kept : LastKept or None
    kept_count : int
        Copies kept so far.
    last_look : float or None
        The last look that found the job alive.
    error : str
        The last look's failure ("" after one that worked).
    files : dict of str to KeptFile
        By path in the folder.
    """

    FORMAT: ClassVar[str] = RECORD_FORMAT
    VERSION: ClassVar[int] = 1

    machine: str
    job: str
    run: int = 1
    path: str = ""
    local: str = ""
    every: float = EVERY
    last: int | None = None
    started: float = 0.0
    state: str = "keeping"
    log: str = ""
    last_kept: LastKept | None = None
    kept_count: int = 0
    last_look: float | None = None
    error: str = ""
    files: dict[str, KeptFile] = field(default_factory=dict)
    version: int = VERSION
    extra: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, d: dict) -> KeepRecord:
        return cls(machine=str(d["machine"]), job=str(d["job"]), run=int(d.get("run") or 1),
                   path=str(d.get("path") or ""), local=str(d.get("local") or ""),
                   every=float(d.get("every") or 0), last=None if d.get("last") is None else int(d["last"]),
                   started=float(d.get("started") or 0), state=str(d.get("state") or ""), log=str(d.get("log") or ""),
                   last_kept=LastKept.from_dict(d.get("last_kept")), kept_count=int(d.get("kept_count") or 0),
                   last_look=opt_float(d.get("last_look")), error=str(d.get("error") or ""),
                   files={str(rel): KeptFile.from_dict(f) for rel, f in (d.get("files") or {}).items()})

    def to_dict(self) -> dict:
        return {"machine": self.machine, "job": self.job, "run": self.run, "path": self.path, "local": self.local,
                "every": self.every, "last": self.last, "started": self.started, "state": self.state,
                "log": self.log, "last_kept": None if self.last_kept is None else self.last_kept.to_dict(),
                "kept_count": self.kept_count, "last_look": self.last_look, "error": self.error,
                "files": {rel: f.to_dict() for rel, f in self.files.items()}}


def record_dir(machine_name: str) -> Path:
    """``keep/MACHINE`` under gpumagic's data directory (the name %-quoted)."""
    from ..paths import data_dir

    return data_dir() / "keep" / urllib.parse.quote(machine_name, safe="")


def private_record_dir(machine_name: str) -> Path:
    """Make :func:`record_dir` and the ``keep`` folder above it, both for the user alone
    (0700, as the rest of gpumagic's data folder); returns it."""
    folder = record_dir(machine_name)
    private_dir(folder.parent)
    return private_dir(folder)


def kept_files(local: str) -> int:
    """How many files the local folder of a keeper holds now (its staging folder and
    half-promoted copies left out): what is there, kept by this keeper or an earlier one."""
    count = 0
    for top, dirs, files in os.walk(local):
        if top == local:
            dirs[:] = [d for d in dirs if d != STAGE]
        count += sum(1 for f in files if not f.endswith(".keep-tmp"))
    return count


def records(machine_name: str) -> list[KeepRecord]:
    """The keep records of jobs of ``machine_name``, oldest start first (unreadable ones left out)."""
    folder = record_dir(machine_name)
    found = [KeepRecord.load(p) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []
    return sorted((r for r in found if r is not None), key=lambda r: (r.started, r.job))


def record_of(machine_name: str, job: str) -> KeepRecord | None:
    """The keep record of ``job`` on ``machine_name`` (its latest run's), None when there is none."""
    return KeepRecord.load(record_path(machine_name, job))


def record_path(machine_name: str, job: str) -> Path:
    """The keep record of ``job`` on ``machine_name`` (its latest run's)."""
    return record_dir(machine_name) / f"{job}.json"


def next_run(machine_name: str, job: str) -> int:
    """The number of a new start of ``job`` on ``machine_name``: 1, or one more than the run
    its keep record is of (a record from before runs were numbered counts as run 1)."""
    old = record_of(machine_name, job)
    return 1 if old is None else old.run + 1


def log_folder(machine_name: str, job: str, started: float) -> Path:
    """Where the log of the run of ``job`` that started at ``started`` is kept here (a
    folder holding ``log``: the sync engine's destination)."""
    return record_dir(machine_name) / f"{job}.logs" / f"{int(started * 1000)}"


def pull_log(machine: MachineLike, job: str, folder: str | os.PathLike) -> str:
    """Bring ``folder``/log up to date with the job's log on ``machine`` (the sync engine: only
    the appended tail travels); returns the local file.

    Raises
    ------
    SyncError
        The job's log is not there; the connection's errors as they come.
    """
    from ..sync import engine as sync

    private_record_dir(machine.name)
    private_dir(Path(folder).parent)  # JOB.logs/ (under keep/MACHINE/): the user's alone too
    private_dir(folder)
    sync.pull(machine, f"~/.gpumagic/jobs/{job}/log", os.fspath(folder) + os.sep, grace=0)  # see look()
    return os.path.join(folder, "log")


# -- judging what is whole ----------------------------------------------------------------------


@dataclass
class _Seen:
    sig: tuple[int, int, int]  # size, mtime_ns, inode
    since: int  # the machine's clock (ns) when first listed with that sig


@dataclass
class Listing:
    """One look at the folder (the output of ``keep-list.py``)."""

    now: int
    root: str
    ended: bool
    files: dict[str, tuple[int, int, int]] = field(default_factory=dict)


def parse_listing(text: str) -> Listing:
    """Read ``keep-list.py``'s JSON line."""
    d = json.loads(text.strip().splitlines()[-1])
    return Listing(int(d["now"]), d["root"], bool(d["ended"]),
                   {f[0]: (int(f[1]), int(f[2]), int(f[3])) for f in d["files"]})


def unit(rel: str) -> str:
    """The checkpoint a kept file belongs to: the first part of its path in the folder."""
    return rel.split("/", 1)[0]


class Reach(Protocol):
    """What a keeper tells, and asks of, the record of when each machine was last reached and
    of what a move starts again (:mod:`gpumagic.remote.move` keeps both; the machine hands
    it in as :class:`Keepers`' ``reach``, so that this module imports nothing above it)."""

    @property
    def probe_every(self) -> float:
        """Seconds between looks while the machine does not answer (its loss noticed in time)."""
        ...

    def unreachable(self, error: Exception) -> bool:
        """Whether ``error`` says the machine was not reached (refused, timed out, lost)."""
        ...

    def started(self, machine_name: str, job: str, options: KeepOptions, local: str) -> None:
        """A keeper started: what a move keeps again."""
        ...

    def seen(self, machine_name: str) -> None:
        """The machine answered a look now."""
        ...

    def failed(self, machine_name: str, error: Exception, at: float) -> None:
        """A look begun at ``at`` (epoch seconds) did not reach the machine."""
        ...

    def lost(self, machine_name: str) -> object | None:
        """Why the machine counts as lost now (a truthy value that reads as text), or None."""
        ...


class Keeper:
    """Keeps one job's checkpoint folder on the laptop while the notebook runs (see the module).

    Parameters
    ----------
    machine : Machine
    job : str
        The job's name.
    cwd : str
        The job's working directory as given to :func:`gpumagic.remote.jobs.start` ("" for
        the login directory).
    options : KeepOptions
    reach : Reach
        Told of each look, asked whether the machine is lost (:class:`Reach`).

    Attributes
    ----------
    looks : int
        Listings done (each a round trip), for tests and ``%gpu jobs``.
    kept : list of (str, float)
        ``(path in the folder, laptop epoch seconds)`` of each copy kept, in order.
    error : str
        The last look's failure ("" after a look that worked); the keeper tries again.
    """

    def __init__(self, machine: MachineLike, job: str, cwd: str, options: KeepOptions, reach: Reach,
                 run: int | None = None, since: float | None = None):
        self.machine, self.job, self.cwd, self.options = machine, job, cwd, options
        self.reach = reach
        #: The run it keeps: a number for a new start of the job (:func:`next_run`), None for
        #: the same run going on (a resume, a move, a standby armed again)
        self.run = run
        #: For a new run: when it started (this computer's clock, a moment before the job did).
        #: A file the machine wrote before then is an earlier run's, never this one's.
        self.since = since
        #: The files an earlier run kept, path -> signature (a new run leaves them alone).
        self._earlier: dict[str, tuple] = {}
        self.to = options.local_folder(job, run or 1)
        self.stage = os.path.join(self.to, STAGE)
        self.settle = options.settle
        self.looks = 0
        self.kept: list[tuple[str, float]] = []
        self.error = ""
        self.renames = 0
        self.watching = False
        self.done = threading.Event()
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by stop() and when the watcher's channel drops
        #: True while looks fail to reach the machine (then looked at every PROBE_EVERY s)
        self.unreachable = False
        self._lock = threading.Lock()
        self._seen: dict[str, _Seen] = {}
        self._renamed: dict[str, tuple[int, int, int]] = {}
        self._watch_chan = None
        self._root: str | None = None
        self._record_path = record_path(machine.name, job)
        self.record: KeepRecord = self._load()
        #: Called once, from the keeper's thread, with why and whether the machine answers,
        #: when the machine is noticed lost
        #: (``--fallback``: :func:`gpumagic.remote.move.arm_fallback`); the keeper stops then.
        self.fallback: Callable[[str, bool], None] | None = None
        #: With a fallback: called after each look that reached the machine, with whether looks
        #: failed before it; returns why the job is lost there though the machine answers (its
        #: process or a GPU gone), or None (set with the fallback by ``arm_fallback``).
        self.lost_check: Callable[[bool], str | None] | None = None
        self._stopped_by_user = False
        self._log_pulled = 0.0  # time.monotonic() of the last pull of the job's log
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"gpumagic-keep-{job}")

    # -- record ---------------------------------------------------------------------------

    def _load(self) -> KeepRecord:
        """A new record.  For the same run going on (``run`` None: a resume, a move), the files
        of its earlier record carry over (they are on the laptop already); a new run starts
        with none: an earlier run's checkpoints are never this one's."""
        files: dict[str, KeptFile] = {}
        run = self.run
        old = KeepRecord.load(self._record_path)
        if run is None:
            run = old.run if old is not None else 1
            if old is not None and old.local == self.to:
                files = old.files
        elif old is not None:
            # the files an earlier run kept, as they were: still there unchanged, they are its
            self._earlier = {rel: f.sig for rel, f in old.files.items()}
        started = time.time()
        return KeepRecord(machine=self.machine.name, job=self.job, run=run, path=self.options.path, local=self.to,
                          every=self.options.every, last=self.options.last, started=started,
                          log=os.path.join(log_folder(self.machine.name, self.job, started), "log"), files=files)

    def _save(self) -> None:
        self.record.save(self._record_path)

    # -- life cycle -----------------------------------------------------------------------

    def start(self) -> "Keeper":
        os.makedirs(self.stage, exist_ok=True)
        self._save()
        self.reach.started(self.machine.name, self.job, self.options, self.to)  # what a move keeps again
        self._thread.start()
        return self

    def stop(self, why: str = "stopped", timeout: float = 10) -> None:
        """Stop looking (safe twice); the record says ``why``."""
        self._stopped_by_user = True
        self._stop.set()
        self._wake.set()
        self._close_watch()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        with self._lock:
            if self.record.state == "keeping":
                self.record.state = why
                with contextlib.suppress(OSError):
                    self._save()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                ended = False
                begun = time.time()
                was_unreachable = self.unreachable
                try:
                    self._ensure_watch()
                    ended = self.look()
                    if not ended:
                        self._ensure_watch()  # after the first look, which names the folder
                    self.error = ""
                    self.unreachable = False
                    if self.fallback is not None and self.lost_check is not None and not ended:
                        gone = self.lost_check(was_unreachable)  # back after a reboot? its GPU gone?
                        if gone:
                            self._lost(gone, answers=True)
                            return
                except Exception as e:  # the connection went, a disk filled: said, then tried again
                    self.error = f"{type(e).__name__}: {getattr(e, 'message', None) or e}"
                    if self.reach.unreachable(e):  # %gpu jobs counts the machine lost from these
                        self.unreachable = True
                        self.reach.failed(self.machine.name, e, begun)
                        lost = self.reach.lost(self.machine.name) if self.fallback is not None else None
                        if lost:
                            self._lost(str(lost), answers=False)
                            return
                with self._lock:
                    if self.record.error != self.error:
                        self.record.error = self.error
                        with contextlib.suppress(OSError):
                            self._save()
                if ended:
                    with self._lock:
                        self.record.state = "the job ended"
                        self._save()
                    return
                self._wake.wait(self._next_wait())
                self._wake.clear()
        finally:
            self._close_watch()
            self.done.set()

    def _lost(self, why: str, answers: bool) -> None:
        """The machine is lost: stop looking, then call :attr:`fallback` (once)."""
        fallback, self.fallback = self.fallback, None
        with self._lock:
            self.record.state = f"the job was lost ({why})"
            with contextlib.suppress(OSError):
                self._save()
        self._stop.set()
        if fallback is not None and not self._stopped_by_user:
            fallback(why, answers)

    def _next_wait(self) -> float:
        """``every``, or sooner when a file written in place will have settled before that,
        or while the machine does not answer (so that its loss is noticed in time)."""
        wait = self.options.every
        if self.unreachable:
            wait = min(wait, self.reach.probe_every)
        if self._seen:
            wait = min(wait, max(self.settle / 2, 0.05))
        return wait

    # -- the watcher of renames -------------------------------------------------------------

    def _ensure_watch(self) -> None:
        if self._watch_chan is not None and not self._watch_chan.closed:
            return
        if self._root is None:
            return  # after the first listing, which names the folder
        from .execution import start_program

        chan = self.machine.connection.open_session()
        start_program(chan, program.command("keep-watch.py", self._root), timeout=60)
        self._watch_chan = chan
        threading.Thread(target=self._read_watch, args=(chan,), daemon=True,
                         name=f"gpumagic-keep-watch-{self.job}").start()

    def _read_watch(self, chan) -> None:
        buf = b""
        try:
            while True:
                data = chan.recv(65536)
                if not data:
                    return
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    self._watch_event(line)
        except Exception:  # the channel went with the connection: the next look starts another
            return
        finally:
            was, self.watching = self.watching, False
            chan.close()
            if was and self._watch_chan is chan:  # it dropped (the machine went?): look now, not in `every`
                self._wake.set()

    def _watch_event(self, line: bytes) -> None:
        try:
            ev = json.loads(line)
        except ValueError:
            return
        if ev.get("k") == "watching":
            self.watching = True
        elif ev.get("k") == "moved":
            with self._lock:
                self._renamed[ev["rel"]] = (int(ev["size"]), int(ev["mtime_ns"]), int(ev["ino"]))
                self.renames += 1
            self._wake.set()  # a renamed checkpoint is whole: taken at the rename, not at the next look

    def _close_watch(self) -> None:
        chan, self._watch_chan = self._watch_chan, None
        if chan is not None:
            with contextlib.suppress(Exception):
                chan.close()

    # -- one look ---------------------------------------------------------------------------

    def _list(self) -> Listing:
        r = self.machine.exec(program.command("keep-list.py", self.cwd, self.options.path, self.job), timeout=120)
        if r.exit_code != 0:
            raise GpumagicError(f"could not list {self.options.path} on {self.machine.name}: "
                                f"{r.stderr.strip() or r.stdout.strip()}", "it is tried again at the next look")
        listing = parse_listing(r.stdout)
        self._root = listing.root
        self.reach.seen(self.machine.name)
        with self._lock:
            self.looks += 1
            self.record.last_look = time.time()  # on disk too: the job was alive then (%gpu jobs)
            with contextlib.suppress(OSError):
                self._save()
        return listing

    def _whole(self, listing: Listing, ended: bool) -> list[str]:
        """The files of ``listing`` to take now: new or changed, and whole (see the module)."""
        take = []
        settle_ns = int(self.settle * 1e9)
        # an earlier run's files, still in the folder on the machine: written (on the machine's
        # clock, this look's offset off) before this run started, with a second of slack
        before_ns = None if self.since is None else \
            int((self.since - (time.time() - listing.now / 1e9) - RUN_SLACK) * 1e9)
        with self._lock:
            for rel in list(self._seen):
                if rel not in listing.files:
                    del self._seen[rel]
            for rel, sig in listing.files.items():
                if before_ns is not None and sig[1] < before_ns or self._earlier.get(rel) == sig:
                    continue
                done = self.record.files.get(rel)
                if done is not None and done.sig == sig:
                    self._seen.pop(rel, None)
                    continue
                seen = self._seen.get(rel)
                if seen is None or seen.sig != sig:
                    seen = self._seen[rel] = _Seen(sig, listing.now)
                renamed = self._renamed.get(rel) == sig
                # a write moves the mtime: one that is settle old says the file held still that
                # long, at its first listing too (files there before the notebook restarted)
                settled = listing.now - sig[1] >= settle_ns
                if ended or renamed or settled:
                    take.append(rel)
        return take

    def pull_log(self) -> None:
        """Bring the job's log kept here up to date (see :func:`pull_log`); a log that is not
        there (yet) is no error."""
        self._log_pulled = time.monotonic()
        with contextlib.suppress(SyncError):
            pull_log(self.machine, self.job, os.path.dirname(self.record.log))

    def look(self) -> bool:
        """List the folder, pull what is whole, keep what is still whole after the pull, drop
        the oldest beyond ``last``; the job's log with each checkpoint kept, every
        :data:`LOG_EVERY` seconds, and at the end.  Returns True once the job has ended and
        its last files are kept."""
        kept = len(self.kept)
        ended = self._look()
        # with each checkpoint too: a move resumes from the newest one, and the log kept here
        # must hold every line up to it (pulled every LOG_EVERY s alone, 34-37 step lines
        # before the checkpoint were missing from %gpu logs after a move)
        if ended or len(self.kept) > kept or time.monotonic() - self._log_pulled >= LOG_EVERY:
            self.pull_log()
        return ended

    def _look(self) -> bool:
        from ..sync import engine as sync

        listing = self._list()
        ended = listing.ended
        take = self._whole(listing, ended)
        if not take:
            return ended
        failed: list[tuple[str, str]] = []
        for rel in take:
            staged = os.path.join(self.stage, *rel.split("/"))
            os.makedirs(os.path.dirname(staged), exist_ok=True)
            try:
                # grace=0: a cut pull is not waited on for minutes; the next look takes it up,
                # and a machine that went is counted lost in time (LOST_AFTER)
                sync.pull(self.machine, f"{listing.root}/{rel}", os.path.dirname(staged) + os.sep, grace=0)
            except SyncError as e:  # gone since the listing (a script that keeps its last 3): the rest goes on
                failed.append((rel, e.message))
        after = self._list()  # what was read is whole only if nothing wrote it meanwhile
        # this computer's clock minus the machine's (a look's round trip off): a file's mtime
        # there, on this clock, is when its training step was saved
        offset = time.time() - after.now / 1e9
        for rel in take:
            sig = listing.files[rel]
            staged = os.path.join(self.stage, *rel.split("/"))
            try:
                size = os.stat(staged).st_size
            except OSError:
                size = -1
            if after.files.get(rel) != sig or size != sig[0]:
                with self._lock:
                    self._seen.pop(rel, None)  # judged again from the next look
                continue
            self._promote(rel, staged, sig, sig[1] / 1e9 + offset)
        self._prune()
        still = [f"{rel}: {why}" for rel, why in failed if rel in after.files]  # not just gone
        if still:
            raise GpumagicError(f"could not pull {'; '.join(still)}", "it is tried again at the next look")
        return ended and after.files == listing.files

    def _promote(self, rel: str, staged: str, sig: tuple[int, int, int], written: float | None = None) -> None:
        """Put the staged copy at its kept name: a temporary name, then a rename (a hard link
        to the staged file, so the next pull can still send only an appended tail).
        ``written``: when the machine wrote it, on this computer's clock (epoch seconds)."""
        final = os.path.join(self.to, *rel.split("/"))
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.{secrets.token_hex(4)}.keep-tmp")
        if not (os.path.exists(final) and os.path.samefile(staged, final)):  # else kept already
            try:
                os.link(staged, tmp)
            except OSError:  # a file system without hard links: the staged copy moves instead
                shutil.move(staged, tmp)
            os.replace(tmp, final)
        now = time.time()
        with self._lock:
            files = self.record.files
            # written: never after it arrived here
            files[rel] = KeptFile(sig, now, written_at=None if written is None else min(written, now))
            last = self.record.last_kept
            newest = files.get(last.path) if last is not None else None
            if last is None or newest is None or newest.pruned or (sig[1], rel) >= (newest.sig[1], last.path):
                # the newest checkpoint by mtime, the one a move takes (not the last one a batch
                # happened to promote: a look takes several in listing order)
                self.record.last_kept = LastKept(rel, now)
            self.record.kept_count += 1
            self._seen.pop(rel, None)
            self._save()
            self.kept.append((rel, now))  # after the record: what `kept` shows, a move finds on disk

    def _prune(self) -> None:
        """Remove the oldest kept checkpoints beyond ``last`` (theirs and their staged copies)."""
        last = self.options.last
        if last is None:
            return
        with self._lock:
            files = self.record.files
            newest: dict[str, int] = {}
            for rel, f in files.items():
                if not f.pruned:
                    newest[unit(rel)] = max(newest.get(unit(rel), 0), f.sig[1])
            drop = sorted(newest, key=lambda u: (newest[u], u), reverse=True)[last:]
            if not drop:
                return
            for rel, f in files.items():
                if unit(rel) in drop and not f.pruned:
                    for base in (self.to, self.stage):
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(os.path.join(base, *rel.split("/")))
                    f.pruned = True
            for u in drop:
                for base in (self.to, self.stage):
                    path = os.path.join(base, u)
                    if os.path.isdir(path):
                        _remove_empty_dirs(path)
            self._save()


def _remove_empty_dirs(top: str) -> None:
    for folder, _dirs, _files in os.walk(top, topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(folder)  # only an empty one goes


class Keepers:
    """The keepers of one machine (:attr:`gpumagic.machine.Machine.keepers`): job name -> Keeper.
    ``reach``: what each keeper tells of the machine's answers (:class:`Reach`)."""

    def __init__(self, reach: Reach):
        self.by_job: dict[str, Keeper] = {}
        self.reach = reach

    def start(self, machine: MachineLike, job: str, cwd: str, options: KeepOptions,
              run: int | None = None, since: float | None = None) -> Keeper:
        """Start keeping ``job`` (a keeper of an earlier job of that name stops first); ``run``:
        the number of a new start (:func:`next_run`) and ``since`` when it started, or None
        for the same run going on."""
        old = self.by_job.pop(job, None)
        if old is not None:
            old.stop("a new job of that name started")
        k = self.by_job[job] = Keeper(machine, job, cwd, options, self.reach, run, since).start()
        return k

    def get(self, job: str) -> Keeper | None:
        return self.by_job.get(job)

    def close(self) -> None:
        """Stop every keeper (the connection closes); safe twice."""
        while self.by_job:
            _, k = self.by_job.popitem()
            k.stop("stopped when the notebook closed the connection")
