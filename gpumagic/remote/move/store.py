"""The records a move reads, typed, and the JSON files they live in (see :mod:`gpumagic.remote.move`).

Each record is a dataclass with ``from_dict``/``to_dict`` and, through
:class:`gpumagic._stored.Stored`, ``load``/``save``: one JSON object of its own ``format`` and
schema ``version``, written atomically under ``keep/MACHINE/`` of gpumagic's data directory, for
the user alone.  A record written before its format had a version field (``@reach.json``,
``@pushes.json``) reads as version 0: its fields are the same.

``JOB.job.json`` (:class:`StartRecord`)
    What the job was started with: the command, its options (:class:`RunOptions`,
    ``resume_arg`` included), the ``--keep`` options, the working directory, the project folder
    here that was pushed to it (``src``), the GPUs nvidia-smi listed then (``gpus``), and later
    ``moved_to`` / ``moved_from``.  Written by :func:`record_start` when
    :func:`gpumagic.remote.jobs.start` starts a job (a job name has no ``.``, so no keep record
    ``JOB.json`` can clash with it).
``@pushes.json`` (:class:`Pushes`)
    Which folder here was pushed to which folder there (:meth:`gpumagic.machine.Machine.push`
    calls :func:`note_push`), so a move pushes the job's project folder without being told.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import posixpath
import shlex
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar

from ..._stored import Stored, opt_float, opt_str
from ...errors import JobError
from ..keep import KeepOptions, record_dir

if TYPE_CHECKING:
    from ..._types import MachineLike
    from ..jobs import JobOptions

START_FORMAT = "gpumagic-job-start"
PUSHES_FORMAT = "gpumagic-pushes"
#: At most this many pushes are remembered per machine (the newest).
PUSHES_KEPT = 50

#: The ``--query-gpu`` fields (``nvidia-smi --help-query-gpu``) a job's GPUs are recorded by at
#: its start, and checked by later.
GPU_FIELDS = ("index", "uuid")

lock = threading.Lock()  # the keeper threads and the magics write the same small files


# -- the start record ---------------------------------------------------------------------------


@dataclass
class RunOptions:
    """The :class:`~gpumagic.remote.jobs.JobOptions` a start record holds (its ``cwd`` is the
    record's own), with ``stop_on`` as parsed at the start."""

    python: bool = False
    env: dict[str, str] = field(default_factory=dict)
    stop_on: list[str] = field(default_factory=list)
    then_shutdown: float | None = None
    alerts: bool = True
    resume_arg: str | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> RunOptions:
        d = d or {}
        return cls(python=bool(d.get("python")), env={str(k): str(v) for k, v in (d.get("env") or {}).items()},
                   stop_on=[str(s) for s in d.get("stop_on") or ()], then_shutdown=opt_float(d.get("then_shutdown")),
                   alerts=bool(d.get("alerts", True)), resume_arg=opt_str(d.get("resume_arg")))

    def to_dict(self) -> dict:
        return {"python": self.python, "env": dict(self.env), "stop_on": list(self.stop_on),
                "then_shutdown": self.then_shutdown, "alerts": self.alerts, "resume_arg": self.resume_arg}


def keep_from_dict(d: dict | None) -> KeepOptions | None:
    """The ``--keep`` options a start record holds (``to``: the local folder as resolved at the start)."""
    if not d:
        return None
    return KeepOptions(str(d["path"]), every=float(d["every"]), to=opt_str(d.get("to")),
                       last=None if d.get("last") is None else int(d["last"]), settle=float(d["settle"]))


def keep_to_dict(k: KeepOptions | None) -> dict | None:
    if k is None:
        return None
    return {"path": k.path, "every": k.every, "to": k.to, "last": k.last, "settle": k.settle}


@dataclass(frozen=True)
class HeldGpu:
    """A GPU nvidia-smi listed when the job started (None: a field it could not tell)."""

    index: int | None
    uuid: str | None

    @classmethod
    def from_dict(cls, d: dict) -> HeldGpu:
        return cls(None if d.get("index") is None else int(d["index"]), opt_str(d.get("uuid")))

    def to_dict(self) -> dict:
        return {"index": self.index, "uuid": self.uuid}


@dataclass(frozen=True)
class GpuGone:
    """When a GPU the job could use was first seen gone (laptop clock), and why."""

    at: float
    why: str

    @classmethod
    def from_dict(cls, d: dict | None) -> GpuGone | None:
        return None if not d else cls(float(d["at"]), str(d.get("why") or ""))

    def to_dict(self) -> dict:
        return {"at": self.at, "why": self.why}


@dataclass(frozen=True)
class TorchrunLayout:
    """How a torchrun job ran: processes per machine (a number or ``"auto"``), torchrun's own
    arguments, and the machines."""

    nproc: int | str
    args: tuple[str, ...] = ()
    hosts: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, d: dict | None) -> TorchrunLayout | None:
        if not d:
            return None
        nproc = d["nproc"]
        return cls(nproc if isinstance(nproc, (int, str)) else int(nproc), tuple(str(a) for a in d.get("args") or ()),
                   tuple(str(h) for h in d.get("hosts") or ()))

    def to_dict(self) -> dict:
        return {"nproc": self.nproc, "args": list(self.args), "hosts": list(self.hosts)}


@dataclass
class StartRecord(Stored):
    """What a job was started with, and what became of it since (``JOB.job.json``; see the module).

    Attributes
    ----------
    machine, job : str
        The machine's name here and the job's.
    started : float
        When it started (laptop epoch seconds).
    command : str
        The command as it starts again (for a torchrun job, the script each rank runs).
    cwd : str
        Its working directory as given ("" for the login directory).
    src : str or None
        The project folder here pushed to its working directory, when known.
    gpus : list of HeldGpu, or None
        The GPUs nvidia-smi listed at the start (``[]``: none; None: it could not tell).
    gpu_ok_at : float or None
        When its GPUs were last seen whole; ``gpu_lost``: when one was first seen gone.
    options : RunOptions
    keep : KeepOptions or None
        The ``--keep`` options, ``to`` the local folder as resolved at the start.
    seen_running, ended : float or None, str or None
        The last listing that saw it running; how it ended (``exited 0``) once a listing saw that.
    moved_to, moved_at, moved_from, cleanup : ...
        Where it went and when; where it came from; ``"pending"`` while its old copy is to be
        stopped (:func:`gpumagic.remote.move.clean_after_move`), then ``"done"``.
    checkpoint, resumed_at, seam, earlier_logs : ...
        For a run that continues another: the checkpoint it continued from (as the job names
        it), when, its log's first line, and the logs kept here of the runs before it.
    fallback : str or None
        The standby machine (``--fallback``).
    torchrun : TorchrunLayout or None
    """

    FORMAT: ClassVar[str] = START_FORMAT
    VERSION: ClassVar[int] = 1

    machine: str
    job: str
    started: float = 0.0
    command: str = ""
    cwd: str = ""
    src: str | None = None
    gpus: list[HeldGpu] | None = None
    gpu_ok_at: float | None = None
    gpu_lost: GpuGone | None = None
    options: RunOptions = field(default_factory=RunOptions)
    keep: KeepOptions | None = None
    seen_running: float | None = None
    ended: str | None = None
    moved_to: str | None = None
    moved_at: float | None = None
    moved_from: str | None = None
    cleanup: str | None = None
    checkpoint: str | None = None
    resumed_at: float | None = None
    seam: str | None = None
    earlier_logs: list[str] = field(default_factory=list)
    fallback: str | None = None
    torchrun: TorchrunLayout | None = None
    version: int = VERSION
    extra: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, d: dict) -> StartRecord:
        gpus = d.get("gpus")
        return cls(
            machine=str(d["machine"]), job=str(d["job"]), started=float(d.get("started") or 0),
            command=str(d.get("command") or ""), cwd=str(d.get("cwd") or ""), src=opt_str(d.get("src")),
            gpus=None if gpus is None else [HeldGpu.from_dict(g) for g in gpus],
            gpu_ok_at=opt_float(d.get("gpu_ok_at")), gpu_lost=GpuGone.from_dict(d.get("gpu_lost")),
            options=RunOptions.from_dict(d.get("options")), keep=keep_from_dict(d.get("keep")),
            seen_running=opt_float(d.get("seen_running")), ended=opt_str(d.get("ended")),
            moved_to=opt_str(d.get("moved_to")), moved_at=opt_float(d.get("moved_at")),
            moved_from=opt_str(d.get("moved_from")), cleanup=opt_str(d.get("cleanup")),
            checkpoint=opt_str(d.get("checkpoint")), resumed_at=opt_float(d.get("resumed_at")),
            seam=opt_str(d.get("seam")), earlier_logs=[p for p in d.get("earlier_logs") or () if isinstance(p, str)],
            fallback=opt_str(d.get("fallback")), torchrun=TorchrunLayout.from_dict(d.get("torchrun")))

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("version", "extra")}
        out.update(gpus=None if self.gpus is None else [g.to_dict() for g in self.gpus],
                   gpu_lost=None if self.gpu_lost is None else self.gpu_lost.to_dict(),
                   options=self.options.to_dict(), keep=keep_to_dict(self.keep),
                   earlier_logs=list(self.earlier_logs),
                   torchrun=None if self.torchrun is None else self.torchrun.to_dict())
        return out

    def visible(self) -> list[str] | None:
        """The GPUs the job was limited to by ``CUDA_VISIBLE_DEVICES`` in its environment (indexes
        or UUIDs, as CUDA reads it), or None (every GPU of the machine)."""
        value = self.options.env.get("CUDA_VISIBLE_DEVICES")
        return None if value is None else [v.strip() for v in str(value).split(",") if v.strip()]


def start_path(machine_name: str, job: str) -> Path:
    return record_dir(machine_name) / f"{job}.job.json"


def start_record(machine_name: str, job: str) -> StartRecord | None:
    """The start record of ``job`` on ``machine_name`` (None when there is none)."""
    return StartRecord.load(start_path(machine_name, job))


def start_records(machine_name: str) -> list[StartRecord]:
    """Every start record of ``machine_name``, oldest start first."""
    folder = record_dir(machine_name)
    found = [StartRecord.load(p) for p in sorted(folder.glob("*.job.json"))] if folder.is_dir() else []
    return sorted((r for r in found if r), key=lambda r: (r.started, r.job))


def update_start(machine_name: str, job: str, **changes) -> StartRecord | None:
    """Change fields of a start record (None when there is none); never raises for the disk.

    Raises
    ------
    TypeError
        A name that is no field of :class:`StartRecord`.
    """
    with lock:
        rec = start_record(machine_name, job)
        if rec is None:
            return None
        rec = dataclasses.replace(rec, **changes)
        with contextlib.suppress(OSError):
            rec.save(start_path(machine_name, job))
        return rec


def record_start(machine: MachineLike, name: str, command: str, options: JobOptions) -> StartRecord:
    """Write the start record of a job that just started (see the module); returns it.

    It holds the GPUs nvidia-smi lists now (``gpus``, one round trip; ``[]`` on a machine without
    one), by which a GPU that vanishes later is told (:func:`gpumagic.remote.move.gpu_loss`).  A
    failure to write here never fails the start: the record is what a later move needs, and the
    job runs without it.
    """
    from ..jobs import parse_stop_on

    cwd = options.cwd if options.cwd is not None else (machine.cwd or "")
    src = None
    with contextlib.suppress(Exception):  # a project folder is a convenience: --src names one
        src = _project_folder(machine, cwd)
    gpus = None
    with contextlib.suppress(Exception):  # what a GPU that vanishes is told by (gpu_loss)
        gpus = gpus_held(gpu_status(machine)[0])
    now = time.time()
    rec = StartRecord(machine=machine.name, job=name, started=now, command=command, cwd=cwd, src=src, gpus=gpus,
                      gpu_ok_at=now,
                      options=RunOptions(python=bool(options.python), env=dict(options.env or {}),
                                         stop_on=list(parse_stop_on(options.stop_on)),
                                         then_shutdown=options.then_shutdown, alerts=bool(options.alerts),
                                         resume_arg=options.resume_arg))
    with lock, contextlib.suppress(OSError):
        rec.save(start_path(machine.name, name))
    return rec


def record_keep(machine_name: str, job: str, options: KeepOptions, local: str) -> None:
    """Add the ``--keep`` options (with the local folder as resolved at start) to the record."""
    update_start(machine_name, job, keep=dataclasses.replace(options, to=local))


def job_options(rec: StartRecord, **changes) -> JobOptions:
    """The :class:`~gpumagic.remote.jobs.JobOptions` a start record holds (``changes`` on top)."""
    from ..jobs import JobOptions

    o = rec.options
    return JobOptions(python=o.python, cwd=rec.cwd, env=dict(o.env), stop_on=tuple(o.stop_on),
                      then_shutdown=o.then_shutdown, alerts=o.alerts, resume_arg=o.resume_arg).with_(**changes)


# -- the GPUs a job started with ------------------------------------------------------------------


def gpu_status(machine: MachineLike):
    """The machine's GPUs as nvidia-smi lists them now, in one round trip: ``(status, rc)``, a
    :class:`gpumagic.gpu.smi.GpuStatus` of :data:`GPU_FIELDS` (whatever nvidia-smi says is its
    ``kind``) and nvidia-smi's exit status."""
    from ...gpu import smi

    login_path = machine.env.login().get("PATH") or ""
    r = machine.exec(smi.sections_command(["gpus=" + ",".join(GPU_FIELDS)], login_path), timeout=smi.SMI_TIMEOUT + 30)
    sections = smi.split_sections(r.stdout)
    rc = sections["gpus"].rc if "gpus" in sections else -1
    return smi.status_from_sections(sections, host=machine.name, fields=GPU_FIELDS), rc


def gpus_held(status) -> list[HeldGpu] | None:
    """What a start record holds of the GPUs of ``status`` (``[HeldGpu(0, "GPU-...")]``; ``[]``
    where nvidia-smi is missing or lists none; None where it could not tell: hung, a
    driver/library mismatch)."""
    from ...gpu.smi import StatusKind, known

    if status.kind is StatusKind.OK:
        return [HeldGpu(g.index if known(g.index) else None, g.uuid if known(g.uuid) else None) for g in status.gpus]
    return [] if status.kind in (StatusKind.NO_NVIDIA_SMI, StatusKind.NO_DRIVER, StatusKind.FAILED) else None


# -- the job's folders, and the project folder pushed to it ---------------------------------------


@dataclass(frozen=True)
class Push:
    """The folder ``local`` here was pushed to ``remote`` there (as written: ``~/proj``, ``proj``) at ``at``."""

    local: str
    remote: str
    at: float = 0.0

    @classmethod
    def from_dict(cls, d: dict) -> Push:
        return cls(str(d["local"]), str(d["remote"]), float(d.get("at") or 0))

    def to_dict(self) -> dict:
        return {"local": self.local, "remote": self.remote, "at": self.at}


@dataclass
class Pushes(Stored):
    """``@pushes.json``: the newest :data:`PUSHES_KEPT` pushes to a machine, oldest first."""

    FORMAT: ClassVar[str] = PUSHES_FORMAT
    VERSION: ClassVar[int] = 1

    pushes: list[Push] = field(default_factory=list)
    version: int = VERSION
    extra: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, d: dict) -> Pushes:
        return cls([Push.from_dict(p) for p in d.get("pushes") or ()
                    if isinstance(p, dict) and p.get("remote") and p.get("local")])

    def to_dict(self) -> dict:
        return {"pushes": [p.to_dict() for p in self.pushes]}


def pushes_path(machine_name: str) -> Path:
    return record_dir(machine_name) / "@pushes.json"


def abs_dirs(machine: MachineLike, work: str, sub: str = "") -> list[str]:
    """The absolute paths on ``machine`` of the job working directory ``work`` (as the job's
    ``run.sh`` reads it: ``~``, ``~/...`` and relative paths from ``$HOME``) and, with ``sub``,
    of ``sub`` inside it; both made when missing.  One round trip."""
    script = ('wd=$1; case $wd in "~") wd=$HOME ;; "~/"*) wd=$HOME/${wd#"~/"} ;; /*) ;; ?*) wd=$HOME/$wd ;; '
              '"") wd=$HOME ;; esac\nmkdir -p -- "$wd" && cd -- "$wd" && pwd || exit 3\n'
              'if [ -n "$2" ]; then s=$2; case $s in "~/"*) s=$HOME/${s#"~/"} ;; esac\n'
              'mkdir -p -- "$s" && cd -- "$s" && pwd || exit 3; fi\n')
    r = machine.exec(f"set -- {shlex.quote(work)} {shlex.quote(sub)}\n{script}", timeout=60)
    lines = r.stdout.splitlines()
    if r.exit_code != 0 or len(lines) < (2 if sub else 1):
        raise JobError(f"could not make the folder {work or '~'}{'/' + sub if sub else ''} on {machine.name}: "
                       f"{r.stderr.strip() or 'no answer'}", "check the disk there (`df -h`)")
    return lines[:2] if sub else lines[:1]


def _home_form(path: str) -> str:
    """``path`` as the job's ``run.sh`` reads a working directory, without the machine: ``~``,
    ``~/x`` and relative ``x`` (from ``$HOME``) all as ``~/x``; absolute paths as they are
    (both normalised), so that a push to ``~/proj`` and a job with ``--cwd proj`` compare equal."""
    p = path.strip()
    if p in ("", "~"):
        return "~"
    if p.startswith("~/"):
        p = p[2:]
    elif p.startswith("/"):
        return posixpath.normpath(p)
    p = posixpath.normpath(p)
    return "~" if p == "." else f"~/{p}"


def _pushes(machine_name: str) -> list[Push]:
    rec = Pushes.load(pushes_path(machine_name))
    return rec.pushes if rec is not None else []


def _match_push(pushes: list[Push], cwd: str, form: Callable[[str], str | None]) -> str | None:
    """The local folder of the newest push (remote resolved by ``form``) that holds ``cwd``."""
    cwd = cwd.rstrip("/") or "/"
    for p in reversed(pushes):
        remote = (form(p.remote) or "").rstrip("/")
        if remote and (cwd == remote or cwd.startswith(remote + "/")):
            local = os.path.join(p.local, *[x for x in cwd[len(remote):].split("/") if x])
            if os.path.isdir(local):
                return local
    return None


def project_folder_here(machine_name: str, work: str) -> str | None:
    """The folder here whose recorded push to ``machine_name`` holds the working directory
    ``work``, from the records alone (no round trip: the machine may be gone); paths written
    with ``~`` or relative ones compare as the job reads them (:func:`_home_form`)."""
    return _match_push(_pushes(machine_name), _home_form(work), _home_form)


def _resolve(machine: MachineLike, paths: list[str]) -> list[str]:
    """The absolute paths on ``machine`` of ``paths``, each read as the job's ``run.sh`` reads
    its working directory (``~``, ``~/...`` and relative paths from ``$HOME``); one round
    trip, nothing made."""
    script = ('for wd in "$@"; do case $wd in "~") wd=$HOME ;; "~/"*) wd=$HOME/${wd#"~/"} ;; /*) ;; '
              '?*) wd=$HOME/$wd ;; "") wd=$HOME ;; esac\n'
              'r=$(cd -- "$wd" 2>/dev/null && pwd) || r=$wd; printf \'%s\\0\' "$r"; done\n')
    r = machine.exec(f"set -- {' '.join(shlex.quote(p) for p in paths)}\n{script}", timeout=60)
    out = r.stdout.split("\0")[:len(paths)]
    if r.exit_code != 0 or len(out) < len(paths):
        raise JobError(f"could not read folders on {machine.name}: {r.stderr.strip() or 'no answer'}")
    return out


def _project_folder(machine: MachineLike, work: str) -> str | None:
    """The folder here whose push to ``machine`` holds the job's working directory (the
    newest such push), or None: from the records where the paths compare as written (see
    :func:`project_folder_here`), else with one round trip that resolves them all there (a
    push to an absolute path, a job in ``~/...``)."""
    pushes = _pushes(machine.name)
    if not pushes:
        return None
    found = _match_push(pushes, _home_form(work), _home_form)
    if found:
        return found
    remotes = sorted({p.remote for p in pushes})
    resolved = _resolve(machine, [work, *remotes])
    there = dict(zip(remotes, resolved[1:]))
    return _match_push(pushes, resolved[0], there.get)


def note_push(machine_name: str, src: str, summary) -> None:
    """Remember that the folder ``src`` here was pushed (``summary``: the push's
    :class:`~gpumagic.sync.engine.SyncSummary`); a single file or a dry run is not a project."""
    if getattr(summary, "dry_run", False) or not os.path.isdir(src):
        return
    remote = str(getattr(summary, "destination", "")).partition(":")[2].strip()
    if not remote:
        return
    # ~/proj and proj (from $HOME, as a job's --cwd) are kept as written and compared as the
    # job's working directory is read (see _project_folder)
    path = pushes_path(machine_name)
    with lock, contextlib.suppress(OSError):
        rec = Pushes.load(path) or Pushes()
        local = os.path.abspath(src)
        last = rec.pushes[-1] if rec.pushes else None
        if last is not None and (last.local, last.remote) == (local, remote):
            return  # already the newest: a resync writes nothing (an fsync, 3 ms)
        pushes = [p for p in rec.pushes if (p.local, p.remote) != (local, remote)]
        rec.pushes = (pushes + [Push(local, remote, time.time())])[-PUSHES_KEPT:]
        rec.save(path)
