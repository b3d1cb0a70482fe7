"""When a job counts as lost, and how ``%gpu jobs`` says so (see :mod:`gpumagic.remote.move`).

A job is *lost* (:class:`Loss`) when every attempt to reach its machine (connection refused,
timed out, dropped) has failed for :data:`~gpumagic.remote.move.reaching.LOST_AFTER` seconds;
when the machine answers but the job's folder or process is gone without an exit code (it
rebooted, or was rebuilt); or when a GPU it could use vanished (:func:`gpu_loss`: the start
record holds the GPUs nvidia-smi listed when the job started, ``gpus``).  ``%gpu jobs`` on an
unreachable machine tries again every ``PROBE_EVERY`` seconds until it can say which (so with
the defaults, "lost" is shown at most ``LOST_AFTER`` plus one connect timeout after the loss),
and a keeper that fails a look looks again every ``PROBE_EVERY`` seconds, and at once when its
watcher's channel drops, so the streak is often already long enough.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..._format import rough_duration
from ..keep import KeepRecord, record_of as keep_record_of
from . import reaching
from .reaching import UNREACHABLE, Unreachable, reach
from .store import GpuGone, StartRecord, gpu_status, start_record, start_records, update_start

if TYPE_CHECKING:
    from ..._types import MachineLike
    from ..jobs import JobInfo


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
    if not r.failing_since:
        return None
    streak = time.time() - r.failing_since
    return Loss("unreachable", f"{rough_duration(streak)}: {r.why}") if streak >= reaching.LOST_AFTER else None


def job_gone(machine: MachineLike, name: str) -> Loss | None:
    """Why job ``name`` is gone from a machine that answers (its folder, or its process without
    an exit code: the machine rebooted), or None while it runs or ended by itself (one round trip)."""
    from ..jobs import list_jobs

    found = list_jobs(machine, only=name)
    if not found:
        return Loss("folder")
    if found[0].state == "lost":
        return Loss("process")
    return None


#: What nvidia-smi prints, among the rows of the others, for a GPU it cannot reach any more
#: ("Unable to determine the device handle for GPU0000:1B:00.0: Unknown Error", as users report it).
GPU_GONE_RE = re.compile(r"Unable to determine the device handle|GPU is lost|fallen off the bus", re.IGNORECASE)
#: Seconds between a standby keeper's checks, on a machine that answers, that the job's process
def _gone(gpu) -> str | None:
    """``[GPU is lost]`` where nvidia-smi printed that for a value of ``gpu``'s row."""
    from ...gpu.smi import Unknown

    return next((v.raw for v in vars(gpu).values() if isinstance(v, Unknown) and v.raw.lower() == "[gpu is lost]"),
                None)


def gpu_loss(rec: StartRecord, status, rc: int = 0) -> Loss | None:
    """Whether a GPU that job ``rec`` could use has vanished, from nvidia-smi's answer now
    (``status`` and its exit status ``rc``, :func:`gpu_status`) and the GPUs listed when the job
    started (``rec.gpus``).

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
    from ...gpu.smi import StatusKind, known

    had = rec.gpus or []
    spec = rec.visible()
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
    at_start = {h.index: h.uuid for h in had}
    for g in status.gpus:
        gone = _gone(g)
        if gone and mine(g.index, at_start.get(g.index)):
            return Loss("gpu", f"nvidia-smi lists {g.label} as {gone}{tail}")
    listed = {g.uuid for g in status.gpus if known(g.uuid)}
    for h in had:
        if h.uuid and h.uuid not in listed and mine(h.index, h.uuid):
            return Loss("gpu-gone", f"nvidia-smi no longer lists GPU{h.index} ({h.uuid}){tail}")
    if rc == 15 or said:
        whole = [g for g in status.gpus if not _gone(g)]
        if spec is not None and all(any(s == str(g.index) or (known(g.uuid) and str(g.uuid).startswith(s))
                                        for g in whole) for s in spec):
            return None  # every GPU the job could use is listed whole: another one went
        return Loss("gpu", f"nvidia-smi: {said[0]}{tail}" if said else f"nvidia-smi{tail}")
    return None


def gpu_lost(machine: MachineLike, rec: StartRecord) -> Loss | None:
    """:func:`gpu_loss` of job ``rec`` on ``machine`` now (one round trip; none for a job that
    started with no GPU listed).  The start record keeps when its GPUs were last seen whole
    (``gpu_ok_at``) and when one was first seen gone (``gpu_lost``)."""
    if not rec.gpus or rec.visible() == []:
        return None
    loss = gpu_loss(rec, *gpu_status(machine))
    _note_gpu(rec, loss)
    return loss


# -- what %gpu jobs says --------------------------------------------------------------------------


def _clock(epoch: float) -> str:
    """``14:07`` today, ``2025-03-01 14:07`` another day (laptop time)."""
    t = time.localtime(epoch)
    return time.strftime("%H:%M" if t[:3] == time.localtime()[:3] else "%Y-%m-%d %H:%M", t)


def newest_kept(keep_rec: KeepRecord | None) -> tuple[str, float] | None:
    """``(checkpoint, kept at)`` of the newest checkpoint a keep record holds (a file or a
    folder of the kept folder, dated by its newest file's mtime), or None."""
    found = _newest(keep_rec)
    return None if found is None else (found[0], found[1])


def newest_written(keep_rec: KeepRecord | None) -> float | None:
    """When the machine wrote the newest kept checkpoint (:func:`newest_kept`), on this
    computer's clock: its newest file's mtime there (the keeper records it with the two clocks'
    difference); its arrival here for a record made before that was recorded."""
    found = _newest(keep_rec)
    return None if found is None else found[2]


def _newest(keep_rec: KeepRecord | None) -> tuple[str, float, float] | None:
    if not keep_rec:
        return None
    units: dict[str, tuple[int, float, float]] = {}
    for rel, f in keep_rec.files.items():
        if f.pruned:
            continue
        u = rel.split("/", 1)[0]
        mtime, at, written = units.get(u, (0, 0.0, 0.0))
        units[u] = (max(mtime, f.sig[1]), max(at, f.kept_at), max(written, f.written_at or f.kept_at))
    if not units:
        return None
    u = max(units, key=lambda k: (units[k][0], k))
    return u, units[u][1], units[u][2]


def _cost(machine_name: str, seconds: float) -> str:
    """`` (0.37 CNY at 5.60 CNY/h)`` where the machine has a price set, else ``""``."""
    try:
        from ...budget.ledger import Ledger

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
        return f"under {rough_duration(max(1.0, math.ceil(lower + max(0.0, gap))))}"
    return f"about {rough_duration(lower)}" if lower >= 1 else "under 1 s"


def lost_line(start: StartRecord, lost_at: float, loss: Loss, until: float | None = None) -> str:
    """The ``%gpu jobs`` line of a lost job: when, why (``loss``: ``unreachable 3 min``...), the
    last checkpoint kept and the training since then (from that checkpoint to ``lost_at``, the
    last time the job was seen alive; ``until``: the first failed attempt, or the first time its
    GPU was seen gone, when known), what that cost, and the command that continues it."""
    name, machine = start.job, start.machine
    keep_rec = keep_record_of(machine, name)
    kept = newest_kept(keep_rec)
    line = f"job {name}: {loss.head(lost_at)}"
    if until is None and keep_rec and keep_rec.every:
        until = lost_at + keep_rec.every  # the keeper would have looked again by then
    if kept:
        path = keep_rec.path.rstrip("/") if keep_rec else ""
        # from when the machine wrote it, not when it arrived here (a settle or --keep-every later)
        lost_s = max(0.0, lost_at - (newest_written(keep_rec) or kept[1]))
        line += f"; last checkpoint {path}/{kept[0]} kept at {_clock(kept[1])}"
    else:
        lost_s = max(0.0, lost_at - (start.started or lost_at))
        line += "; no checkpoint kept" + ("" if start.keep else " (it was started without --keep)")
    line += f"; {_lost_span(lost_s, None if until is None else until - lost_at)} of training lost{_cost(machine, lost_s)}"
    can = kept and start.options.resume_arg
    verb = "" if can else " --from-start"
    if loss.kind.startswith("gpu"):  # its process may still run there, stuck: a move stops it
        return line + f"; `%gpu job move {name} --to OTHER{verb}` continues it on another machine"
    return line + f"; `%gpu job move {name} --to OTHER{verb}` or `%gpu job resume {name}{verb}` continue it"


def _last_alive(start: StartRecord) -> float | None:
    """The last time the job was seen running: by a listing, or by its keeper's looks."""
    keep_rec = keep_record_of(start.machine, start.job)
    times = [t for t in (start.seen_running, keep_rec.last_look if keep_rec else None) if t]
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
            if not r.moved_to and not r.ended and r.gpus and r.visible() != []
            and (i := infos.get(r.job)) is not None and (i.running or i.state == "lost")]
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
            out[r.job] = loss
    return out


def _note_gpu(rec: StartRecord, loss: Loss | None) -> None:
    """Keep in the start record when the job's GPUs were last seen whole (``gpu_ok_at``), or
    first seen gone (``gpu_lost``)."""
    if loss is None:
        update_start(rec.machine, rec.job, gpu_ok_at=time.time(), gpu_lost=None)
    elif (now := start_record(rec.machine, rec.job)) is not None and now.gpu_lost is None:
        update_start(rec.machine, rec.job, gpu_lost=GpuGone(time.time(), str(loss)))


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
        name = rec.job
        if rec.moved_to:
            lines.append(f"job {name}: moved to {rec.moved_to} at {_clock(rec.moved_at or now)}")
            continue
        if rec.ended:
            continue
        if isinstance(found, Unreachable):
            if rec.fallback:
                lines.append(f"job {name}: --fallback {rec.fallback}: it moves there by itself once "
                             "its keeper finds the machine lost")
            alive = [t for t in (found.last_seen, _last_alive(rec), rec.started) if t]
            lost_at = min(max(alive), found.since) if alive else found.since  # never after the first failure
            unreachable = Loss("unreachable", f"{rough_duration(now - lost_at)}: {found.why}")
            lost[name] = str(unreachable)
            lines.append(lost_line(rec, lost_at, unreachable, until=found.since))
            continue
        info = next((i for i in found if i.name == name), None)
        loss = (gpu or {}).get(name)
        if loss is not None:
            # seen whole last at gpu_ok_at, gone at gpu_lost.at; a checkpoint kept after the
            # former was written before the loss
            kept = newest_kept(keep_record_of(machine_name, name))
            lost_at = max(rec.gpu_ok_at or rec.started or now, kept[1] if kept else 0)
            lost[name] = str(loss)
            lines.append(lost_line(rec, lost_at, loss, until=rec.gpu_lost.at if rec.gpu_lost else None))
        elif info is not None and info.running:
            update_start(machine_name, name, seen_running=now)
            if rec.fallback:
                lines.append(f"job {name}: moves to {rec.fallback} by itself if {machine_name} is lost "
                             f"(--fallback {rec.fallback}, while this notebook runs)")
        elif info is not None and info.state != "lost":
            update_start(machine_name, name, ended=info.state_text)
        else:
            gone = Loss("folder") if info is None else Loss("process")
            lost[name] = str(gone)
            lines.append(lost_line(rec, _last_alive(rec) or rec.started or now, gone))
    return lines, lost


def keep_view(rec: KeepRecord, lost: str | None, live: bool) -> tuple[dict, bool]:
    """A keep record as ``%gpu jobs``'s keep line shows it (:func:`gpumagic.notebook.display.keep_line`,
    which reads the record's JSON form): the files counted as they are in its local folder now
    (the checkpoints an earlier run kept there too), and, for a job ``lost`` with its machine,
    never "keeping": what was kept, and that nothing more is.  Returns ``(record, live)``."""
    from ..keep import kept_files

    view = rec.to_dict()
    local = rec.local
    if os.path.isdir(local):
        view["files"] = {str(i): {} for i in range(kept_files(local))}
    if lost is None:
        return view, live
    still = f"; its keeper looks every {reaching.PROBE_EVERY:g} s in case it comes back" if live else ""
    view["state"] = f"the job is lost ({lost}), nothing more is kept{still}"
    return view, False


