"""Training that outlives its machine (issue 27, items 2 and 3): noticing that a job's machine
is gone, and moving the run to another machine (or resuming it on the same one after a
restart) from the newest checkpoint kept on the laptop (:mod:`gpumagic.remote.keep`).

Everything here is read from and written to the laptop's gpumagic data directory, beside the
keep records (``keep/MACHINE/`` under :func:`gpumagic.budget.ledger.data_dir`), so that it
works after the notebook restarts and while the machine does not answer:

``JOB.job.json`` (the *start record*)
    What the job was started with: the command, its :class:`~gpumagic.remote.jobs.JobOptions`
    (``resume_arg`` included), the ``--keep`` options, the working directory, the project
    folder here that was pushed to it (``src``), and later ``moved_to`` / ``moved_from``.
    Written by :func:`gpumagic.remote.jobs.start` (a job name has no ``.``, so no keep record
    ``JOB.json`` can clash with it).
``@reach.json``
    When the machine last answered (``last_seen``), and since when every attempt to reach it
    has failed (``failing_since``), as the keeper's looks and ``%gpu jobs`` saw it.
``@pushes.json``
    Which folder here was pushed to which folder there (:meth:`gpumagic.machine.Machine.push`
    calls :func:`note_push`), so a move pushes the job's project folder without being told.

A job is *lost* (:class:`Loss`) when every attempt to reach its machine (connection refused,
timed out, dropped) has failed for :data:`LOST_AFTER` seconds; when the machine answers but the
job's folder or process is gone without an exit code (it rebooted, or was rebuilt); or when a
GPU it could use vanished (:func:`gpu_loss`: the start record holds the GPUs nvidia-smi listed
when the job started, ``gpus``).  ``%gpu jobs`` on an unreachable
machine tries again every :data:`PROBE_EVERY` seconds until it can say which (so with the
defaults, "lost" is shown at most ``LOST_AFTER`` plus one connect timeout after the loss), and
a keeper that fails a look looks again every ``PROBE_EVERY`` seconds, and at once when its
watcher's channel drops, so the streak is often already long enough.

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

A standby (:func:`arm_fallback`, ``%%remote --job NAME --keep DIR --fallback b``): the job's
keeper, once it has found the machine lost, moves the job to ``b`` by itself (:func:`standby_move`);
after a restart of the notebook the standby is armed again once the job's machine and ``b`` are
both connected (:func:`rearm_fallbacks`).  Two moves of one job never run at once, from one
notebook or two: each holds the start record's lock file (:func:`move_lock`).
A machine a job moved away from is *cleaned* on the next connect to it
(:func:`clean_after_move`): the old job, if it still runs there, is stopped (no second copy),
and its budget guard disarmed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import posixpath
import re
import shlex
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .._fs import atomic_write, private_dir
from ..errors import ConnectionLost, ConnectionRefused, ConnectTimeout, Interrupted, JobError
from .keep import KeepOptions, record_dir, records as keep_records

if TYPE_CHECKING:
    from .._types import MachineLike
    from .jobs import Job, JobInfo, JobOptions

#: Seconds every attempt to reach a machine must have failed before its jobs count as lost.
LOST_AFTER = 30.0
#: Seconds between attempts while a machine does not answer.
PROBE_EVERY = 5.0
#: What an attempt to reach a machine that is gone (or cut off) raises.
UNREACHABLE = (ConnectionRefused, ConnectTimeout, ConnectionLost)

START_FORMAT = "gpumagic-job-start"
REACH_FORMAT = "gpumagic-reach"
PUSHES_FORMAT = "gpumagic-pushes"
#: At most this many pushes are remembered per machine (the newest).
PUSHES_KEPT = 50

_lock = threading.Lock()  # the keeper threads and the magics write the same small files


def _read(path: Path, fmt: str) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == fmt else None


def _write(path: Path, data: dict) -> None:
    private_dir(path.parent.parent)  # keep/ itself for the user alone too (see private_record_dir)
    private_dir(path.parent)
    atomic_write(path, json.dumps(data, indent=1, sort_keys=True))


# -- the start record ---------------------------------------------------------------------------


def start_path(machine_name: str, job: str) -> Path:
    return record_dir(machine_name) / f"{job}.job.json"


def start_record(machine_name: str, job: str) -> dict | None:
    """The start record of ``job`` on ``machine_name`` (None when there is none)."""
    return _read(start_path(machine_name, job), START_FORMAT)


def start_records(machine_name: str) -> list[dict]:
    """Every start record of ``machine_name``, oldest start first."""
    folder = record_dir(machine_name)
    found = [_read(p, START_FORMAT) for p in sorted(folder.glob("*.job.json"))] if folder.is_dir() else []
    return sorted((r for r in found if r), key=lambda r: (r.get("started") or 0, r.get("job", "")))


def update_start(machine_name: str, job: str, **changes) -> dict | None:
    """Change fields of a start record (None when there is none); never raises for the disk."""
    with _lock:
        rec = start_record(machine_name, job)
        if rec is None:
            return None
        rec.update(changes)
        with contextlib.suppress(OSError):
            _write(start_path(machine_name, job), rec)
        return rec


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


def _pushes(machine_name: str) -> list[dict]:
    return [p for p in (_read(record_dir(machine_name) / "@pushes.json", PUSHES_FORMAT) or {}).get("pushes") or []
            if isinstance(p, dict) and p.get("remote") and p.get("local")]


def _match_push(pushes: list[dict], cwd: str, form: Callable[[str], str | None]) -> str | None:
    """The local folder of the newest push (remote resolved by ``form``) that holds ``cwd``."""
    cwd = cwd.rstrip("/") or "/"
    for p in reversed(pushes):
        remote = (form(str(p["remote"])) or "").rstrip("/")
        if remote and (cwd == remote or cwd.startswith(remote + "/")):
            local = os.path.join(p["local"], *[x for x in cwd[len(remote):].split("/") if x])
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
    remotes = sorted({str(p["remote"]) for p in pushes})
    resolved = _resolve(machine, [work, *remotes])
    there = dict(zip(remotes, resolved[1:]))
    return _match_push(pushes, resolved[0], there.get)


def record_start(machine: MachineLike, name: str, command: str, options: JobOptions) -> dict:
    """Write the start record of a job that just started (see the module); returns it.

    It holds the GPUs nvidia-smi lists now (``gpus``, one round trip; ``[]`` on a machine without
    one), by which a GPU that vanishes later is told (:func:`gpu_loss`).  A failure to write here
    never fails the start: the record is what a later move needs, and the job runs without it.
    """
    from .jobs import parse_stop_on

    cwd = options.cwd if options.cwd is not None else (machine.cwd or "")
    src = None
    with contextlib.suppress(Exception):  # a project folder is a convenience: --src names one
        src = _project_folder(machine, cwd)
    gpus = None
    with contextlib.suppress(Exception):  # what a GPU that vanishes is told by (gpu_loss)
        gpus = gpus_held(gpu_status(machine)[0])
    now = time.time()
    rec = {"format": START_FORMAT, "version": 1, "machine": machine.name, "job": name,
           "started": now, "command": command, "cwd": cwd, "src": src, "gpus": gpus, "gpu_ok_at": now,
           "options": {"python": bool(options.python), "env": dict(options.env or {}),
                       "stop_on": list(parse_stop_on(options.stop_on)), "then_shutdown": options.then_shutdown,
                       "alerts": bool(options.alerts), "resume_arg": options.resume_arg},
           "keep": None, "seen_running": None, "moved_to": None, "moved_from": None, "checkpoint": None}
    with _lock, contextlib.suppress(OSError):
        _write(start_path(machine.name, name), rec)
    return rec


def record_keep(machine_name: str, job: str, options: KeepOptions, local: str) -> None:
    """Add the ``--keep`` options (with the local folder as resolved at start) to the record."""
    update_start(machine_name, job, keep={"path": options.path, "every": options.every, "to": local,
                                          "last": options.last, "settle": options.settle})


def job_options(rec: dict, **changes) -> JobOptions:
    """The :class:`~gpumagic.remote.jobs.JobOptions` a start record holds (``changes`` on top)."""
    from .jobs import JobOptions

    o = rec.get("options") or {}
    return JobOptions(python=bool(o.get("python")), cwd=rec.get("cwd"), env=dict(o.get("env") or {}),
                      stop_on=tuple(o.get("stop_on") or ()), then_shutdown=o.get("then_shutdown"),
                      alerts=bool(o.get("alerts", True)), resume_arg=o.get("resume_arg")).with_(**changes)


# -- pushes -------------------------------------------------------------------------------------


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
    path = record_dir(machine_name) / "@pushes.json"
    with _lock, contextlib.suppress(OSError):
        rec = _read(path, PUSHES_FORMAT) or {"format": PUSHES_FORMAT, "pushes": []}
        local = os.path.abspath(src)
        last = rec["pushes"][-1] if rec["pushes"] else {}
        if (last.get("local"), last.get("remote")) == (local, remote):
            return  # already the newest: a resync writes nothing (an fsync, 3 ms)
        pushes = [p for p in rec["pushes"] if (p.get("local"), p.get("remote")) != (local, remote)]
        rec["pushes"] = (pushes + [{"local": local, "remote": remote, "at": time.time()}])[-PUSHES_KEPT:]
        _write(path, rec)


# -- reaching the machine -----------------------------------------------------------------------


def reach(machine_name: str) -> dict:
    """``{"last_seen", "failing_since", "why"}`` of ``machine_name`` (Nones when not known)."""
    rec = _read(record_dir(machine_name) / "@reach.json", REACH_FORMAT) or {}
    return {"last_seen": rec.get("last_seen"), "failing_since": rec.get("failing_since"), "why": rec.get("why", "")}


def _note_reach(machine_name: str, ok: bool, at: float, why: str = "") -> None:
    path = record_dir(machine_name) / "@reach.json"
    with _lock, contextlib.suppress(OSError):
        rec = _read(path, REACH_FORMAT) or {"format": REACH_FORMAT}
        if ok:
            rec.update(last_seen=max(at, rec.get("last_seen") or 0), failing_since=None, why="")
        elif not rec.get("failing_since") or (rec.get("last_seen") or 0) > rec["failing_since"]:
            rec.update(failing_since=at, why=why)
        else:
            rec["why"] = why
        _write(path, rec)


def note_seen(machine_name: str, at: float | None = None) -> None:
    """The machine answered (at ``at``, default now): any failure streak ends."""
    _note_reach(machine_name, True, time.time() if at is None else at)


def note_failed(machine_name: str, why: str, at: float | None = None) -> None:
    """An attempt to reach the machine, begun at ``at``, failed with ``why``."""
    _note_reach(machine_name, False, time.time() if at is None else at, why)


def why(e: Exception) -> str:
    """A short reason for an :data:`UNREACHABLE` error (``connection refused``...)."""
    if isinstance(e, ConnectionRefused):
        return "connection refused"
    if isinstance(e, ConnectTimeout):
        return "connection timed out"
    return "connection dropped"


@dataclass(frozen=True)
class Unreachable:
    """The verdict on a machine that did not answer for :data:`LOST_AFTER` seconds."""

    since: float  # the first failed attempt of the streak (laptop clock)
    last_seen: float | None  # the last time it answered, when known
    why: str


def list_or_lost(machine: MachineLike, say: Callable[[str], None] = print) -> list[JobInfo] | Unreachable:
    """The jobs of ``machine`` (one round trip when it answers), or, when it does not, the
    verdict once every attempt for :data:`LOST_AFTER` seconds failed (tried again every
    :data:`PROBE_EVERY` seconds; ``say`` is told once that it waits).

    Raises
    ------
    Interrupted
        On a kernel interrupt while it waits (one line, no chained traceback).
    """
    try:
        return _list_or_lost(machine, say)
    except KeyboardInterrupt:
        raise Interrupted(f"stopped waiting for {machine.name}; its jobs were not listed "
                          f"(`%gpu jobs --host {machine.name}` tries again)") from None


def _list_or_lost(machine: MachineLike, say: Callable[[str], None]) -> list[JobInfo] | Unreachable:
    from .jobs import list_jobs

    told = False
    while True:
        begun = time.time()
        try:
            infos = list_jobs(machine)
        except UNREACHABLE as e:
            note_failed(machine.name, why(e), begun)
            r = reach(machine.name)
            streak = time.time() - (r["failing_since"] or begun)
            if streak >= LOST_AFTER:
                return Unreachable(r["failing_since"] or begun, r["last_seen"], r["why"])
            if not told:
                say(f"{machine.name} does not answer ({why(e)}); trying again every {PROBE_EVERY:g} s until it "
                    f"has not answered for {LOST_AFTER:g} s")
                told = True
            time.sleep(max(0.0, min(PROBE_EVERY, LOST_AFTER - streak)))
            continue
        note_seen(machine.name, begun)
        return infos


#: How each cause of a loss reads: (the head of ``%gpu jobs``' lost line, with ``{at}`` the time
#: it was lost; the short reason that other messages put in parentheses).  ``{detail}``: what
#: was seen (``3 min: connection refused``; nvidia-smi's words).
LOSSES = {
    "unreachable": ("lost with the machine at {at} (unreachable {detail})", "unreachable {detail}"),
    "folder": ("lost at {at}: the machine answers, but the job's folder is gone (it was reset or rebuilt)",
               "the machine answers, but the job's folder is gone: it was reset or rebuilt"),
    "process": ("lost at {at}: its process is gone without an exit code (the machine rebooted, or the "
                "process was killed outright)", "its process is gone without an exit code"),
    "gpu": ("lost with the machine at {at} (its GPU fell off the bus: {detail})",
            "its GPU fell off the bus: {detail}"),
    "gpu-gone": ("lost with the machine at {at} (its GPU is gone: {detail})", "its GPU is gone: {detail}"),
}


@dataclass(frozen=True)
class Loss:
    """Why a job counts as lost: ``kind`` (a key of :data:`LOSSES`) and what was seen."""

    kind: str
    detail: str = ""

    def head(self, at: float) -> str:
        """``lost with the machine at 14:07 (unreachable 3 min: connection refused)``."""
        return LOSSES[self.kind][0].format(at=_clock(at), detail=self.detail)

    def __str__(self) -> str:
        return LOSSES[self.kind][1].format(detail=self.detail)


def lost_for(machine_name: str) -> Loss | None:
    """Why ``machine_name`` counts as lost (``unreachable 31 s: connection refused``) once
    every attempt to reach it has failed for :data:`LOST_AFTER` seconds; else None."""
    r = reach(machine_name)
    if not r["failing_since"]:
        return None
    streak = time.time() - r["failing_since"]
    return Loss("unreachable", f"{_span(streak)}: {r['why']}") if streak >= LOST_AFTER else None


def job_gone(machine: MachineLike, name: str) -> Loss | None:
    """Why job ``name`` is gone from a machine that answers (its folder, or its process without
    an exit code: the machine rebooted), or None while it runs or ended by itself (one round trip)."""
    from .jobs import list_jobs

    found = list_jobs(machine, only=name)
    if not found:
        return Loss("folder")
    if found[0].state == "lost":
        return Loss("process")
    return None


# -- a GPU that vanished --------------------------------------------------------------------------

#: The ``--query-gpu`` fields (``nvidia-smi --help-query-gpu``) a job's GPUs are recorded by at
#: its start, and checked by later.
GPU_FIELDS = ("index", "uuid")
#: What nvidia-smi prints, among the rows of the others, for a GPU it cannot reach any more
#: ("Unable to determine the device handle for GPU0000:1B:00.0: Unknown Error", as users report it).
GPU_GONE_RE = re.compile(r"Unable to determine the device handle|GPU is lost|fallen off the bus", re.IGNORECASE)
#: Seconds between a standby keeper's checks, on a machine that answers, that the job's process
#: and its GPUs are still there (two round trips; see :func:`arm_fallback`).
CHECK_EVERY = 30.0


def gpu_status(machine: MachineLike):
    """The machine's GPUs as nvidia-smi lists them now, in one round trip: ``(status, rc)``, a
    :class:`gpumagic.gpu.smi.GpuStatus` of :data:`GPU_FIELDS` (whatever nvidia-smi says is its
    ``kind``) and nvidia-smi's exit status."""
    from ..gpu import smi

    login_path = machine.login_env().get("PATH") or ""
    r = machine.exec(smi.sections_command(["gpus=" + ",".join(GPU_FIELDS)], login_path), timeout=smi.SMI_TIMEOUT + 30)
    sections = smi.split_sections(r.stdout)
    rc = sections["gpus"].rc if "gpus" in sections else -1
    return smi.status_from_sections(sections, host=machine.name, fields=GPU_FIELDS), rc


def gpus_held(status) -> list[dict] | None:
    """What a start record holds of the GPUs of ``status`` (``[{"index": 0, "uuid": "GPU-..."}]``;
    ``[]`` where nvidia-smi is missing or lists none; None where it could not tell: hung, a
    driver/library mismatch)."""
    from ..gpu.smi import StatusKind, known

    if status.kind is StatusKind.OK:
        return [{"index": g.index if known(g.index) else None, "uuid": g.uuid if known(g.uuid) else None}
                for g in status.gpus]
    return [] if status.kind in (StatusKind.NO_NVIDIA_SMI, StatusKind.NO_DRIVER, StatusKind.FAILED) else None


def _visible(rec: dict) -> list[str] | None:
    """The GPUs the job was limited to by ``CUDA_VISIBLE_DEVICES`` in its environment (indexes
    or UUIDs, as CUDA reads it), or None (every GPU of the machine)."""
    value = ((rec.get("options") or {}).get("env") or {}).get("CUDA_VISIBLE_DEVICES")
    return None if value is None else [v.strip() for v in str(value).split(",") if v.strip()]


def _gone(gpu) -> str | None:
    """``[GPU is lost]`` where nvidia-smi printed that for a value of ``gpu``'s row."""
    from ..gpu.smi import Unknown

    return next((v.raw for v in vars(gpu).values() if isinstance(v, Unknown) and v.raw.lower() == "[gpu is lost]"),
                None)


def gpu_loss(rec: dict, status, rc: int = 0) -> Loss | None:
    """Whether a GPU that job ``rec`` could use has vanished, from nvidia-smi's answer now
    (``status`` and its exit status ``rc``, :func:`gpu_status`) and the GPUs listed when the job
    started (``rec["gpus"]``).

    A job that started with no GPU listed is never lost so.  It is lost when nvidia-smi now
    finds no GPU or no driver (or fails with exit status 15); lists one of its GPUs as ``[GPU is lost]``; no longer lists one
    it listed at the start (by UUID); or exits 15 ("the GPU has fallen off the bus", nvidia-smi(1))
    or prints a device it cannot reach (``Unable to determine the device handle for GPU...``)
    while not every GPU the job could use is listed whole.  A job limited by
    ``CUDA_VISIBLE_DEVICES`` counts only those GPUs; one that is not could use every GPU.  Rows
    listed with another non-zero exit status (14: a corrupted infoROM, a card that still works),
    a driver/library mismatch (running processes keep working), a hung or missing nvidia-smi are
    no loss.
    """
    from ..gpu.smi import StatusKind, known

    had = rec.get("gpus") or []
    spec = _visible(rec)
    if not had or spec == []:
        return None

    def mine(index, uuid) -> bool:
        return spec is None or str(index) in spec or bool(uuid and any(
            s.startswith(("GPU-", "MIG-")) and str(uuid).startswith(s) for s in spec))

    if status.kind is StatusKind.NO_DRIVER or (status.kind is StatusKind.FAILED and (
            rc == 15 or status.message == "nvidia-smi found no GPU" or GPU_GONE_RE.search(status.message))):
        # no GPU at all where the job had some (another failure, an unreadable answer: no verdict)
        return Loss("gpu-gone", status.message + (f" (exit status {rc})" if rc > 0 and "exit status" not in status.message
                                                  else ""))
    if status.kind is not StatusKind.OK:
        return None
    said = [w.removeprefix("nvidia-smi: ") for w in status.warnings
            if w.startswith("nvidia-smi: ") and GPU_GONE_RE.search(w)]  # not "WARNING: infoROM is corrupted"
    tail = f" (exit status {rc})" if rc else ""
    at_start = {h.get("index"): h.get("uuid") for h in had}
    for g in status.gpus:
        gone = _gone(g)
        if gone and mine(g.index, at_start.get(g.index)):
            return Loss("gpu", f"nvidia-smi lists {g.label} as {gone}{tail}")
    listed = {g.uuid for g in status.gpus if known(g.uuid)}
    for h in had:
        if h.get("uuid") and h["uuid"] not in listed and mine(h.get("index"), h["uuid"]):
            return Loss("gpu-gone", f"nvidia-smi no longer lists GPU{h.get('index')} ({h['uuid']}){tail}")
    if rc == 15 or said:
        whole = [g for g in status.gpus if not _gone(g)]
        if spec is not None and all(any(s == str(g.index) or (known(g.uuid) and str(g.uuid).startswith(s))
                                        for g in whole) for s in spec):
            return None  # every GPU the job could use is listed whole: another one went
        return Loss("gpu", f"nvidia-smi: {said[0]}{tail}" if said else f"nvidia-smi{tail}")
    return None


def gpu_lost(machine: MachineLike, rec: dict) -> Loss | None:
    """:func:`gpu_loss` of job ``rec`` on ``machine`` now (one round trip; none for a job that
    started with no GPU listed).  The start record keeps when its GPUs were last seen whole
    (``gpu_ok_at``) and when one was first seen gone (``gpu_lost``)."""
    if not rec.get("gpus") or _visible(rec) == []:
        return None
    loss = gpu_loss(rec, *gpu_status(machine))
    _note_gpu(rec, loss)
    return loss


# -- what %gpu jobs says --------------------------------------------------------------------------


def _clock(epoch: float) -> str:
    """``14:07`` today, ``2025-03-01 14:07`` another day (laptop time)."""
    t = time.localtime(epoch)
    return time.strftime("%H:%M" if t[:3] == time.localtime()[:3] else "%Y-%m-%d %H:%M", t)


def _span(seconds: float) -> str:
    """``40 s``, ``3 min``, ``2.5 h``: how long, as the lost line says it."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def newest_kept(keep_rec: dict | None) -> tuple[str, float] | None:
    """``(checkpoint, kept at)`` of the newest checkpoint a keep record holds (a file or a
    folder of the kept folder, dated by its newest file's mtime), or None."""
    found = _newest(keep_rec)
    return None if found is None else (found[0], found[1])


def newest_written(keep_rec: dict | None) -> float | None:
    """When the machine wrote the newest kept checkpoint (:func:`newest_kept`), on this
    computer's clock: its newest file's mtime there (the keeper records it with the two clocks'
    difference); its arrival here for a record made before that was recorded."""
    found = _newest(keep_rec)
    return None if found is None else found[2]


def _newest(keep_rec: dict | None) -> tuple[str, float, float] | None:
    if not keep_rec:
        return None
    units: dict[str, tuple[int, float, float]] = {}
    for rel, f in (keep_rec.get("files") or {}).items():
        if f.get("pruned"):
            continue
        u = rel.split("/", 1)[0]
        mtime, at, written = units.get(u, (0, 0.0, 0.0))
        kept_at = float(f.get("kept_at") or 0)
        units[u] = (max(mtime, int(f["sig"][1])), max(at, kept_at), max(written, float(f.get("written_at") or kept_at)))
    if not units:
        return None
    u = max(units, key=lambda k: (units[k][0], k))
    return u, units[u][1], units[u][2]


def _cost(machine_name: str, seconds: float) -> str:
    """`` (0.37 CNY at 5.60 CNY/h)`` where the machine has a price set, else ``""``."""
    try:
        from ..budget.ledger import Ledger

        rec = Ledger().machine(machine_name)
    except Exception:  # a damaged ledger says so in %gpu budget; here the cost is left out
        return ""
    if rec is None or rec.prices is None or not rec.prices.hourly:
        return ""
    p = rec.prices
    cur = f" {p.currency}" if p.currency else ""
    return f" ({p.hourly * seconds / 3600:.2f}{cur} at {p.hourly:.2f}{cur}/h)"


def _lost_span(lower: float, gap: float | None) -> str:
    """How much training was lost: at least ``lower`` s (from the checkpoint to the last time
    the job was seen alive), at most ``gap`` s more (until the first failed attempt, or the
    keeper's next look): ``about 4 min``, or ``under 9 s`` where that is small."""
    lower = max(0.0, lower)
    if gap is not None and lower < 60:
        return f"under {_span(max(1.0, math.ceil(lower + max(0.0, gap))))}"
    return f"about {_span(lower)}" if lower >= 1 else "under 1 s"


def lost_line(start: dict, lost_at: float, loss: Loss, until: float | None = None) -> str:
    """The ``%gpu jobs`` line of a lost job: when, why (``loss``: ``unreachable 3 min``...), the
    last checkpoint kept and the training since then (from that checkpoint to ``lost_at``, the
    last time the job was seen alive; ``until``: the first failed attempt, or the first time its
    GPU was seen gone, when known), what that cost, and the command that continues it."""
    name, machine = start.get("job", "?"), start.get("machine", "?")
    keep_rec = next((r for r in keep_records(machine) if r.get("job") == name), None)
    kept = newest_kept(keep_rec)
    line = f"job {name}: {loss.head(lost_at)}"
    if until is None and keep_rec and keep_rec.get("every"):
        until = lost_at + float(keep_rec["every"])  # the keeper would have looked again by then
    if kept:
        path = (keep_rec or {}).get("path", "").rstrip("/")
        # from when the machine wrote it, not when it arrived here (a settle or --keep-every later)
        lost_s = max(0.0, lost_at - (newest_written(keep_rec) or kept[1]))
        line += f"; last checkpoint {path}/{kept[0]} kept at {_clock(kept[1])}"
    else:
        lost_s = max(0.0, lost_at - (start.get("started") or lost_at))
        line += "; no checkpoint kept" + ("" if start.get("keep") else " (it was started without --keep)")
    line += f"; {_lost_span(lost_s, None if until is None else until - lost_at)} of training lost{_cost(machine, lost_s)}"
    can = kept and (start.get("options") or {}).get("resume_arg")
    verb = "" if can else " --from-start"
    if loss.kind.startswith("gpu"):  # its process may still run there, stuck: a move stops it
        return line + f"; `%gpu job move {name} --to OTHER{verb}` continues it on another machine"
    return line + f"; `%gpu job move {name} --to OTHER{verb}` or `%gpu job resume {name}{verb}` continue it"


def _last_alive(start: dict) -> float | None:
    """The last time the job was seen running: by a listing, or by its keeper's looks."""
    keep_rec = next((r for r in keep_records(start.get("machine", "")) if r.get("job") == start.get("job")), None)
    times = [t for t in (start.get("seen_running"), (keep_rec or {}).get("last_look")) if t]
    return max(times) if times else None


def lost_lines(machine_name: str, found: list[JobInfo] | Unreachable, now: float | None = None) -> list[str]:
    """The lines ``%gpu jobs`` adds for the recorded jobs of ``machine_name`` (see :func:`lost_report`)."""
    return lost_report(machine_name, found, now)[0]


def gpu_losses(machine: MachineLike, found: list[JobInfo] | Unreachable) -> dict[str, Loss]:
    """The recorded jobs of ``machine`` that run (or whose process is gone) and lost a GPU they
    could use (:func:`gpu_loss`): name -> why.  One round trip where such a job started with a
    GPU listed, none otherwise; ``{}`` when the machine does not answer."""
    if isinstance(found, Unreachable):
        return {}
    infos = {i.name: i for i in found}
    recs = [r for r in start_records(machine.name)
            if not r.get("moved_to") and not r.get("ended") and r.get("gpus") and _visible(r) != []
            and (i := infos.get(r["job"])) is not None and (i.running or i.state == "lost")]
    if not recs:
        return {}
    try:
        status, rc = gpu_status(machine)
    except UNREACHABLE:
        return {}
    out = {}
    for r in recs:
        loss = gpu_loss(r, status, rc)
        _note_gpu(r, loss)
        if loss is not None:
            out[r["job"]] = loss
    return out


def _note_gpu(rec: dict, loss: Loss | None) -> None:
    """Keep in the start record when the job's GPUs were last seen whole (``gpu_ok_at``), or
    first seen gone (``gpu_lost``)."""
    if loss is None:
        update_start(rec["machine"], rec["job"], gpu_ok_at=time.time(), gpu_lost=None)
    elif not (start_record(rec["machine"], rec["job"]) or {}).get("gpu_lost"):
        update_start(rec["machine"], rec["job"], gpu_lost={"at": time.time(), "why": str(loss)})


def lost_report(machine_name: str, found: list[JobInfo] | Unreachable, now: float | None = None,
                gpu: dict[str, Loss] | None = None) -> tuple[list[str], dict[str, str]]:
    """The lines ``%gpu jobs`` adds for the recorded jobs of ``machine_name``: lost ones
    (``found`` is the listing, or the :class:`Unreachable` verdict; ``gpu``: the jobs that lost
    a GPU, :func:`gpu_losses`) and moved ones; and the lost jobs (name -> why).  A listing also
    brings the records up to date (seen running, ended)."""
    now = time.time() if now is None else now
    lines: list[str] = []
    lost: dict[str, str] = {}
    for rec in start_records(machine_name):
        name = rec["job"]
        if rec.get("moved_to"):
            lines.append(f"job {name}: moved to {rec['moved_to']} at {_clock(rec.get('moved_at') or now)}")
            continue
        if rec.get("ended"):
            continue
        if isinstance(found, Unreachable):
            if rec.get("fallback"):
                lines.append(f"job {name}: --fallback {rec['fallback']}: it moves there by itself once "
                             "its keeper finds the machine lost")
            alive = [t for t in (found.last_seen, _last_alive(rec), rec.get("started")) if t]
            lost_at = min(max(alive), found.since) if alive else found.since  # never after the first failure
            cut = Loss("unreachable", f"{_span(now - lost_at)}: {found.why}")
            lost[name] = str(cut)
            lines.append(lost_line(rec, lost_at, cut, until=found.since))
            continue
        info = next((i for i in found if i.name == name), None)
        loss = (gpu or {}).get(name)
        if loss is not None:
            # seen whole last at gpu_ok_at, gone at gpu_lost.at; a checkpoint kept after the
            # former was written before the loss
            kept = newest_kept(next((r for r in keep_records(machine_name) if r.get("job") == name), None))
            lost_at = max(rec.get("gpu_ok_at") or rec.get("started") or now, kept[1] if kept else 0)
            lost[name] = str(loss)
            lines.append(lost_line(rec, lost_at, loss, until=(rec.get("gpu_lost") or {}).get("at")))
        elif info is not None and info.running:
            update_start(machine_name, name, seen_running=now)
            if rec.get("fallback"):
                lines.append(f"job {name}: moves to {rec['fallback']} by itself if {machine_name} is lost "
                             f"(--fallback {rec['fallback']}, while this notebook runs)")
        elif info is not None and info.state != "lost":
            update_start(machine_name, name, ended=info.state_text)
        else:
            gone = Loss("folder") if info is None else Loss("process")
            lost[name] = str(gone)
            lines.append(lost_line(rec, _last_alive(rec) or rec.get("started") or now, gone))
    return lines, lost


def keep_view(rec: dict, lost: str | None, live: bool) -> tuple[dict, bool]:
    """A keep record as ``%gpu jobs``'s keep line shows it (:func:`gpumagic.notebook.display.keep_line`):
    the files counted as they are in its local folder now (the checkpoints an earlier run kept
    there too), and, for a job ``lost`` with its machine, never "keeping": what was kept, and
    that nothing more is.  Returns ``(record, live)``."""
    from .keep import kept_files

    view = dict(rec)
    local = rec.get("local") or ""
    if os.path.isdir(local):
        view["files"] = {str(i): {} for i in range(kept_files(local))}
    if lost is None:
        return view, live
    still = f"; its keeper looks every {PROBE_EVERY:g} s in case it comes back" if live else ""
    view["state"] = f"the job is lost ({lost}), nothing more is kept{still}"
    return view, False


# -- moving a job ---------------------------------------------------------------------------------


def find_start(job: str, machine_name: str | None = None) -> dict:
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
    from ..paths import data_dir

    base = data_dir() / "keep"
    found = [r for p in (sorted(base.glob(f"*/{job}.job.json")) if base.is_dir() else ())
             if (r := _read(p, START_FORMAT)) and not r.get("moved_to")]
    if not found:
        raise JobError(f"no record here of a job named {job!r}",
                       "move or resume a job started with `%%remote --job NAME` from this computer (`%gpu jobs` lists them)")
    return max(found, key=lambda r: r.get("started") or 0)


def resumed_command(rec: dict, checkpoint: str | None, seam: str) -> str:
    """The job's command as it starts again: a first line that prints ``seam`` (the log's
    mark), and the resume argument with ``{checkpoint}`` filled in: added to the last command
    line of a bash cell; for Python source, ``sys.argv`` set on that first line."""
    command = rec["command"]
    arg = (rec.get("options") or {}).get("resume_arg") or ""
    python = bool((rec.get("options") or {}).get("python"))
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
    from .jobs import Job

    k = source.keepers.get(name)
    if k is not None:
        k.stop("the job was moved")
        try:
            k.look()
        except Exception as e:  # the move goes on from what was kept before
            say(f"the last look at job {name}'s checkpoints on {source.name} failed ({e}); "
                "moving from the newest kept before")
    Job(source, name).kill("moved")


def _final_log(source: MachineLike, rec: dict) -> str | None:
    """Pull the job's log from ``source`` a last time (where its keeper keeps it, or beside the
    start record); returns the local file, or None when it could not be had."""
    from .keep import log_folder, pull_log

    name = rec["job"]
    k = source.keepers.get(name)
    keep_rec = next((r for r in keep_records(source.name) if r.get("job") == name), None)
    if k is not None:
        folder = os.path.dirname(k.record["log"])
    elif keep_rec and keep_rec.get("log") and (keep_rec.get("started") or 0) >= (rec.get("started") or 0) - 5:
        folder = os.path.dirname(keep_rec["log"])
    else:
        folder = os.fspath(log_folder(source.name, name, rec.get("started") or time.time()))
    try:
        return pull_log(source, name, folder)
    except Exception:  # the log is a convenience: the move goes on without it
        return None


def _check_source(source: MachineLike | None, rec: dict, yes: bool, same: bool,
                  say: Callable[[str], None]) -> tuple[bool, str | None]:
    """Whether the job may move from ``source`` (None: not connected here): refused while it
    runs there without ``yes`` (or always, for a resume); with ``yes`` stopped there first.
    Returns whether ``source`` answered, and the job's log there as pulled here a last time
    (None when it could not be)."""
    from .jobs import list_jobs

    name = rec["job"]
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


def _preflight(target: MachineLike, rec: dict, src: str | None, how: Start) -> str | None:
    """Everything a move checks before it stops anything (one-line errors that say what to do):
    that the job can continue from a checkpoint kept here (a resume argument, ``--keep``, a
    checkpoint kept) unless ``how.from_start``; that the project folder is known (``src``, or
    recorded) for a move to another machine unless ``how.no_src``.  Returns the project folder."""
    name, same = rec["job"], rec["machine"] == target.name
    verb = "resume" if same else "move"
    again = f"`%gpu job {verb} {name}{'' if same else ' --to ' + target.name} --from-start`"
    if src is not None and not os.path.isdir(src):
        raise JobError(f"--src {src}: no such folder here", "name the job's project folder on this computer")
    if not how.from_start:
        keep = rec.get("keep") or None
        kept = newest_kept(next((r for r in keep_records(rec["machine"]) if r.get("job") == name), None))
        if not (rec.get("options") or {}).get("resume_arg"):
            raise JobError(f"job {name} was started without --resume-arg, so it cannot continue from a checkpoint: "
                           f"{again} starts it again from the beginning")
        if not keep:
            raise JobError(f"job {name} was started without --keep: no checkpoint of it is kept here; "
                           f"{again} starts it again from the beginning")
        if not kept:
            raise JobError(f"no checkpoint of job {name} is kept here yet; {again} starts it again from the beginning")
    if src is None and not same and not how.no_src:
        raise JobError(f"no project folder is recorded for job {name} (no `%gpu sync` to its folder {rec.get('cwd') or '~'} "
                       f"here), so its files would be missing on {target.name}: pass --src DIR to push it, or "
                       "--no-src if they are there already")
    return src


def _push_state(target: MachineLike, rec: dict, src: str | None, how: Start,
                say: Callable[[str], None]) -> tuple[str | None, str | None]:
    """Push the project folder and the newest kept checkpoint to ``target``; returns
    ``(checkpoint path there, checkpoint as the job names it)`` (Nones: it starts from the
    beginning, ``how.from_start``, or a standby move with nothing kept)."""
    keep = rec.get("keep") or None
    keep_rec = next((r for r in keep_records(rec["machine"]) if r.get("job") == rec["job"]), None)
    kept = newest_kept(keep_rec)
    use = bool(kept and keep_rec is not None and keep and (rec.get("options") or {}).get("resume_arg")
               and not how.from_start)
    dirs = abs_dirs(target, rec.get("cwd") or "", keep["path"].rstrip("/") if keep and use else "")
    if src:
        if not os.path.isdir(src):
            raise JobError(f"--src {src}: no such folder here", "name the job's project folder on this computer")
        summary = target.push(src.rstrip("/\\") + os.sep, dirs[0])
        say(f"pushed the project folder {src} to {target.name}:{dirs[0]} ({summary.files_sent} file{'' if summary.files_sent == 1 else 's'} sent)")
    elif rec["machine"] != target.name:
        say(f"no project folder is recorded for job {rec['job']} (no push to its folder): only its "
            f"checkpoint goes; its files must be in {target.name}:{dirs[0]} already")
    if not use:
        say(f"job {rec['job']} starts from the beginning on {target.name}"
            + (" (--from-start)" if how.from_start else " (no checkpoint kept here, or no --resume-arg)"))
        return None, None
    assert kept is not None and keep_rec is not None and keep is not None
    local = os.path.join(keep_rec["local"], kept[0])
    if not os.path.exists(local):
        raise JobError(f"the newest kept checkpoint {local} is gone from this computer",
                       "put it back, or pass --src with a folder that holds the checkpoint")
    target.push(local, dirs[1] + "/")
    say(f"pushed checkpoint {kept[0]} to {target.name}:{dirs[1]}/")
    return f"{dirs[1]}/{kept[0]}", f"{keep['path'].rstrip('/')}/{kept[0]}"


@dataclass(frozen=True)
class Start:
    """How a moved job starts: ``from_start`` (from the beginning, on purpose: no checkpoint
    needed), ``no_src`` (no project folder pushed: its files are there already), ``fresh_if_none``
    (a standby move: from the beginning where nothing is kept, said)."""

    from_start: bool = False
    no_src: bool = False
    fresh_if_none: bool = False


def move(source: MachineLike | None, target: MachineLike, name: str, *, rec: dict, yes: bool = False,
         src: str | None = None, torchrun: int | str | None = None, how: Start = Start(),
         say: Callable[[str], None] = print) -> Job:
    """Move job ``name`` from ``source`` (None: not connected here; ``target`` itself for a
    resume) to ``target``, from the newest checkpoint kept here (see the module), holding the
    start record's lock throughout (:func:`move_lock`).

    Parameters
    ----------
    rec : dict
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
    with move_lock(rec["machine"], name, target.name, "resume" if source is target else "move"):
        fresh = start_record(rec["machine"], name)
        if fresh is not None and fresh.get("moved_to"):
            raise JobError(f"job {name} was moved from {rec['machine']} to {fresh['moved_to']} at "
                           f"{_clock(fresh.get('moved_at') or time.time())} already; "
                           f"`%gpu jobs --host {fresh['moved_to']}` lists it there")
        return _move(source, target, name, fresh or rec, yes, src, torchrun, how, say)


def _move(source: MachineLike | None, target: MachineLike, name: str, rec: dict, yes: bool, src: str | None,
          torchrun: int | str | None, how: Start, say: Callable[[str], None]) -> Job:
    same = source is target
    src = src or rec.get("src") or (None if same else project_folder_here(rec["machine"], rec.get("cwd") or ""))
    if how.fresh_if_none and not how.from_start:
        keep_rec = next((r for r in keep_records(rec["machine"]) if r.get("job") == name), None)
        if not newest_kept(keep_rec) or not (rec.get("options") or {}).get("resume_arg"):
            how = Start(from_start=True, no_src=how.no_src)
    ran = rec.get("torchrun") or {}
    layout = torchrun if torchrun is not None else ran.get("nproc")
    _preflight(target, rec, src, how)
    form = torchrun_form(rec) if layout is not None else None  # refused here, before anything is stopped
    reached, last_log = _check_source(source, rec, yes, same, say)
    keep = rec.get("keep") or None
    if source is not None and not same:
        k = source.keepers.get(name)
        if k is not None:
            k.stop(f"the job was moved to {target.name}")
    checkpoint, named = _push_state(target, rec, src, how, say)
    at = time.strftime("%Y-%m-%d %H:%M:%S")
    whence = f"resumed on {target.name}" if same else f"moved from {rec['machine']} to {target.name}"
    fresh = "from the beginning" + (" (--from-start)" if how.from_start else " (no checkpoint kept)")
    seam = f"--- gpumagic: job {name} {whence} at {at}, {'from checkpoint ' + named if named else fresh} ---"
    options = job_options(rec, env={**job_options(rec).env, **({"GPUMAGIC_RESUME": checkpoint} if checkpoint else {})})
    logs = _earlier_logs(rec, last_log)
    if form is not None:
        from .distributed import TorchrunOptions

        if keep:
            say(f"--torchrun: the checkpoints of job {name} are not kept on {target.name} (--keep is not yet "
                "for torchrun jobs)")
        if len(ran.get("hosts") or ()) > 1:
            say(f"job {name} ran under torchrun on {', '.join(ran['hosts'])}; it continues on {target.name} alone")
        run = TorchrunOptions(nproc=layout, torchrun_args=tuple(ran.get("args") or ()))  # type: ignore[arg-type]
        job = target.start_job(name, torchrun_script(form, (rec.get("options") or {}).get("resume_arg"),
                                                     checkpoint, seam), options, torchrun=run)
    else:
        keep_options = None
        if keep:
            keep_options = KeepOptions(keep["path"], every=keep["every"], to=keep["to"], last=keep["last"],
                                       settle=keep["settle"])
        job = target.start_job(name, resumed_command(rec, checkpoint, seam), options, keep=keep_options)
    now = time.time()
    if not same:
        # not reached: what it may still run, and its guard, are seen to when it is connected again
        update_start(rec["machine"], name, moved_to=target.name, moved_at=now,
                     cleanup=None if reached else "pending")
    update_start(target.name, name, command=rec["command"] if form is None else form, src=src,
                 moved_from=None if same else rec["machine"], checkpoint=named, resumed_at=now,
                 earlier_logs=logs, seam=seam,
                 torchrun=None if form is None else {"nproc": layout, "args": list(ran.get("args") or ()),
                                                     "hosts": [target.name]},
                 options={**rec.get("options", {}), "env": dict(rec.get("options", {}).get("env") or {})})
    if not same:
        _follow_rules(rec["machine"], target, say)
    return job


# -- one move at a time ---------------------------------------------------------------------------

MOVER_FORMAT = "gpumagic-mover"


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
        who = _read(who_path, MOVER_FORMAT) or {}
        by = "by another notebook on this computer"
        if who.get("pid"):
            here = who.get("pid") == os.getpid() and who.get("host") == socket.gethostname()
            by = ("by this notebook" if here else f"by another notebook (process {who['pid']} on {who.get('host', '?')})")
            by += f": a {who.get('what', 'move')} to {who.get('to', '?')} since {_clock_s(who.get('since') or 0)}"
        raise JobError(f"job {job} is being moved already, {by}; wait for it to end, then `%gpu jobs --host "
                       f"{who.get('to') or to}` shows where it runs") from None
    try:
        with contextlib.suppress(OSError):
            _write(who_path, {"format": MOVER_FORMAT, "pid": os.getpid(), "host": socket.gethostname(), "to": to,
                              "what": what, "since": time.time()})
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


def torchrun_form(rec: dict) -> str:
    """Job ``rec``'s command as torchrun runs it on each rank (what ``%%remote --job NAME
    --torchrun N`` takes): a torchrun job's own script (Python source, or a ``!`` command line);
    a Python job's source; a bash job of one command line as ``!LINE``.

    Raises
    ------
    JobError
        A bash job of several lines, or with shell syntax (torchrun starts one program per rank).
    """
    command = rec["command"]
    if rec.get("torchrun") or (rec.get("options") or {}).get("python"):
        return command
    lines = [ln.strip() for ln in command.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if len(lines) == 1 and _one_command(lines[0]) is not None:
        return "!" + lines[0]
    what = f"{len(lines)} lines" if len(lines) != 1 else f"shell syntax in {lines[0][:60]!r}"
    raise JobError(f"--torchrun: job {rec['job']}'s command is a bash script ({what}), and torchrun runs one "
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
        update_start(m.name, name, command=script, torchrun={"nproc": nproc, "args": list(args), "hosts": hosts})


def _earlier_logs(rec: dict, last_log: str | None) -> list[str]:
    """The logs kept here of the runs before this one: the earlier runs' (``earlier_logs`` of
    the record), then the log of the run that is moved (``last_log``: pulled a last time; else
    as its keeper kept it)."""
    logs = [p for p in rec.get("earlier_logs") or [] if isinstance(p, str)]
    if last_log:
        return logs + [last_log]
    keep_rec = next((r for r in keep_records(rec["machine"]) if r.get("job") == rec["job"]), None)
    mine = (keep_rec or {}).get("log")
    if mine and os.path.isfile(mine) and (keep_rec or {}).get("started", 0) >= (rec.get("started") or 0) - 5:
        logs.append(mine)
    return logs


def earlier_log(machine_name: str, name: str, lines: int | None) -> str:
    """The last ``lines`` lines (None: all) of the logs kept here of the runs of job ``name``
    before the one on ``machine_name`` (``""`` when it was not moved or resumed, or none was
    kept); each ends with a newline, so the new log's first line (the seam) follows on its own."""
    rec = start_record(machine_name, name)
    if not rec or not rec.get("earlier_logs") or lines == 0:
        return ""
    parts = []
    for path in rec["earlier_logs"]:
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
    from ..budget import guard as budget_guard
    from ..budget.ledger import Ledger, note_last_seen

    try:
        ledger = Ledger()
        last = reach(source_name)["last_seen"]
        if last:
            note_last_seen(ledger, source_name, last)
        rec = ledger.machine(target.name)
        if rec is not None and rec.prices is not None:
            target.budget_meter(ledger=ledger)  # its rental starts in the ledger now
        budget_guard.carry_guard(ledger, source_name, target, say)
    except Exception as e:  # the move is done; what follows it is said, never raised
        say(f"the budget rules of {source_name} did not follow the job to {target.name}: "
            f"{getattr(e, 'message', None) or e}")


# -- a standby machine, and the machine a job left ---------------------------------------------

_moving = threading.Lock()  # a standby move and a typed one never run at once


def arm_fallback(keeper, name: str, target: Callable[[], MachineLike],
                 say: Callable[[str], None], *, check_first: bool = False) -> None:
    """Make ``keeper`` (the :class:`~gpumagic.remote.keep.Keeper` of job ``name``) move the job
    to ``target()`` (the connected fallback machine, looked up when it is needed) by itself
    once it finds its machine lost; ``say`` hears what happened (from the keeper's thread).

    Besides the machine not answering for :data:`LOST_AFTER` seconds, the keeper then checks,
    after a look that reached the machine, that the job's process and the GPUs it could use are
    still there (:func:`job_gone`, :func:`gpu_lost`): after looks that failed, and every
    :data:`CHECK_EVERY` seconds (``check_first``: at the first look too, for a standby armed
    again after a restart, :func:`rearm_fallbacks`)."""
    source = keeper.machine
    last = [-math.inf if check_first else time.monotonic()]

    def lost_check(was_unreachable: bool) -> str | None:
        if not was_unreachable and time.monotonic() - last[0] < CHECK_EVERY:
            return None
        last[0] = time.monotonic()
        loss = job_gone(source, name)
        if loss is None:
            rec = start_record(source.name, name)
            loss = gpu_lost(source, rec) if rec is not None else None
        return None if loss is None else str(loss)

    keeper.lost_check = lost_check
    keeper.fallback = lambda why, answers: standby_move(source if answers else None, source.name, target, name,
                                                        why, say)


def _connected(connected: Callable[[str], MachineLike | None], name: str) -> MachineLike:
    m = connected(name)
    if m is None:
        raise JobError(f"{name} is no longer connected here", f"`%gpu connect ALIAS --name {name}`, then "
                       "`%gpu job move` the job there")
    return m


def rearm_fallbacks(machine: MachineLike, connected: Callable[[str], MachineLike | None],
                    say: Callable[[str], None]) -> list[str]:
    """Arm again the standby of each job of ``machine`` started with ``--fallback`` whose keeper
    is not running in this process (the notebook restarted, or ``machine`` was connected anew):
    where the job was not moved and is not known to have ended (by a listing, or its keeper's
    last look), and its fallback machine is
    connected here (``connected(name)``, None otherwise), its keeper starts again with the
    ``--keep`` options of its start record (what it kept before carries over) and the fallback
    armed, checking the job at its first look (:func:`arm_fallback`).  No round trip here: the
    keeper's thread looks.  Returns the jobs armed again."""
    armed: list[str] = []
    standbys = [r for r in start_records(machine.name) if r.get("fallback") and r.get("keep")]
    if not standbys:  # after every cell, for every machine: most have none
        return armed
    ended = {r.get("job") for r in keep_records(machine.name) if r.get("state") == "the job ended"}
    for rec in standbys:
        name, fallback, keep = rec["job"], rec["fallback"], rec["keep"]
        if (rec.get("moved_to") or rec.get("ended") or name in ended
                or machine.keepers.get(name) is not None or connected(fallback) is None):
            continue
        try:
            options = KeepOptions(keep["path"], every=keep["every"], to=keep["to"], last=keep["last"],
                                  settle=keep["settle"])
            k = machine.keepers.start(machine, name, rec.get("cwd") or "", options)
        except Exception as e:  # a folder here gone or unwritable: said once, the job runs on
            update_start(machine.name, name, fallback=None)
            say(f"job {name}: its standby (--fallback {fallback}) could not be armed again: "
                f"{getattr(e, 'message', None) or e}; `%gpu job move {name} --to {fallback}` moves it by hand")
            continue
        arm_fallback(k, name, functools.partial(_connected, connected, fallback), say, check_first=True)
        armed.append(name)
        say(f"job {name}: its standby is armed again: it moves to {fallback} by itself if {machine.name} is lost "
            f"(--fallback {fallback}), and its checkpoints are kept here again")
    return armed


def standby_move(source: MachineLike | None, source_name: str, target: Callable[[], MachineLike], name: str,
                 why: str, say: Callable[[str], None]) -> Job | None:
    """Move job ``name`` from the lost machine ``source_name`` (``source``: the machine, where it
    still answers, for a last pull of the log) to the fallback (see :func:`arm_fallback`); never
    raises: a failure is said, with the command that tries again."""
    begun = time.time()
    with _moving:
        rec = start_record(source_name, name)
        if rec is None or rec.get("moved_to") or rec.get("ended"):
            return None  # moved already (by hand), or it ended
        fallback = rec.get("fallback") or "?"
        said: list[str] = []
        try:
            machine = target()
            # no flags to type here: a job with nothing kept starts from the beginning, one
            # with no project folder recorded takes only its checkpoint (both said)
            job = move(source, machine, name, rec=rec, how=Start(no_src=True, fresh_if_none=True), say=said.append)
        except Exception as e:
            say(f"job {name}: lost on {source_name} ({why}), and the move to {fallback} failed: "
                f"{getattr(e, 'message', None) or e}; `%gpu job move {name} --to {fallback}` tries again")
            return None
        took = time.time() - begun
        rec = start_record(machine.name, name) or {}
        start = f"from checkpoint {rec['checkpoint']}" if rec.get("checkpoint") else "from the beginning"
        say(f"job {name}: lost on {source_name} at {_clock(begun)} ({why}); moved to {machine.name} by "
            f"itself (--fallback) and started there {start} ({took:.0f} s); "
            f"`%gpu logs {name} --host {machine.name}` shows one log")
        for line in said:
            if line.startswith(("the budget", "armed", "the guard", "no project folder", f"job {name} starts")):
                say(f"  {line}")
        return job


def pending_cleanups(machine_name: str) -> list[dict]:
    """The start records of jobs that moved away from ``machine_name`` and whose old copy has
    not been seen to (:func:`clean_after_move`) since."""
    return [r for r in start_records(machine_name) if r.get("moved_to") and r.get("cleanup") == "pending"]


def clean_after_move(machine: MachineLike, say: Callable[[str], None]) -> int:
    """On a machine that answers again after its jobs moved away: each moved job that still runs
    there is stopped (the run goes on elsewhere: no second copy), and a budget guard armed
    there is disarmed (the guard went with the job).  Returns the jobs seen to; never starts one.

    Raises
    ------
    Exception
        The machine's errors (not answering...): it is tried again at a later connect.
    """
    from ..budget.guard import disarm_if_armed
    from .jobs import Job, list_jobs

    todo = pending_cleanups(machine.name)
    if not todo:
        return 0
    found = {i.name: i for i in list_jobs(machine)}
    note_seen(machine.name)
    for rec in todo:
        name, where = rec["job"], rec["moved_to"]
        info = found.get(name)
        if info is not None and info.running:
            k = machine.keepers.get(name)
            if k is not None:
                k.stop(f"the job moved to {where}")
            Job(machine, name).kill("moved")
            say(f"{machine.name} is back: job {name} was still running there; stopped it (it runs on {where} now)")
        update_start(machine.name, name, cleanup="done")
    if disarm_if_armed(machine):
        say(f"{machine.name} is back: its budget guard was disarmed (it went with the job to "
            f"{', '.join(sorted({r['moved_to'] for r in todo}))})")
    return len(todo)
