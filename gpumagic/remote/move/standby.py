"""A standby machine, and the machine a job left (see :mod:`gpumagic.remote.move`).

A standby (:func:`arm_fallback`, ``%%remote --job NAME --keep DIR --fallback b``): the job's
keeper, once it has found the machine lost, moves the job to ``b`` by itself (:func:`standby_move`);
after a restart of the notebook the standby is armed again once the job's machine and ``b`` are
both connected (:func:`rearm_fallbacks`).  A machine a job moved away from is *cleaned* on the
next connect to it (:func:`clean_after_move`): the old job, if it still runs there, is stopped
(no second copy), and its budget guard disarmed.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from typing import TYPE_CHECKING, Callable

from ...errors import JobError
from ..keep import records as keep_records
from .loss import _clock, gpu_lost, job_gone
from .moving import Start, move
from .reaching import note_seen
from .store import StartRecord, start_record, start_records, update_start

if TYPE_CHECKING:
    from ..._types import MachineLike
    from ..jobs import Job

#: Seconds between a standby keeper's checks, on a machine that answers, that the job's process
#: and its GPUs are still there (two round trips; see :func:`arm_fallback`).
CHECK_EVERY = 30.0

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
                    say: Callable[[str], None],
                    renting: Callable[[str, str], Callable[[], MachineLike] | None] | None = None) -> list[str]:
    """Arm again the standby of each job of ``machine`` started with ``--fallback`` whose keeper
    is not running in this process (the notebook restarted, or ``machine`` was connected anew):
    where the job was not moved and is not known to have ended (by a listing, or its keeper's
    last look), and its fallback machine is
    connected here (``connected(name)``, None otherwise), its keeper starts again with the
    ``--keep`` options of its start record (what it kept before carries over) and the fallback
    armed, checking the job at its first look (:func:`arm_fallback`).  No round trip here: the
    keeper's thread looks.  ``renting(fallback, job)``: for a fallback that is a machine yet to be
    rented (``new:PROVIDER...``), what rents and connects it when the job moves (None: it is a
    connected machine's name).  Returns the jobs armed again."""
    armed: list[str] = []
    standbys = [r for r in start_records(machine.name) if r.fallback and r.keep]
    if not standbys:  # after every cell, for every machine: most have none
        return armed
    ended = {r.job for r in keep_records(machine.name) if r.state == "the job ended"}
    for rec in standbys:
        name, fallback, keep = rec.job, rec.fallback or "", rec.keep
        rent = renting(fallback, name) if renting is not None else None
        if (rec.moved_to or rec.ended or name in ended
                or machine.keepers.get(name) is not None or (rent is None and connected(fallback) is None)):
            continue
        try:
            k = machine.keepers.start(machine, name, rec.cwd, keep)
        except Exception as e:  # a folder here gone or unwritable: said once, the job runs on
            update_start(machine.name, name, fallback=None)
            say(f"job {name}: its standby (--fallback {fallback}) could not be armed again: "
                f"{getattr(e, 'message', None) or e}; `%gpu job move {name} --to {fallback}` moves it by hand")
            continue
        arm_fallback(k, name, rent or functools.partial(_connected, connected, fallback), say, check_first=True)
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
        if rec is None or rec.moved_to or rec.ended:
            return None  # moved already (by hand), or it ended
        fallback = rec.fallback or "?"
        said: list[str] = []
        try:
            machine = target()
            # no flags to type here: a job with nothing kept starts from the beginning, one
            # with no project folder recorded takes only its checkpoint (both said)
            job = move(source, machine, name, rec=rec, how=Start(no_src=True, from_start_if_none_kept=True), say=said.append)
        except Exception as e:
            say(f"job {name}: lost on {source_name} ({why}), and the move to {fallback} failed: "
                f"{getattr(e, 'message', None) or e}; `%gpu job move {name} --to {fallback}` tries again")
            return None
        took = time.time() - begun
        moved = start_record(machine.name, name)
        start = f"from checkpoint {moved.checkpoint}" if moved and moved.checkpoint else "from the beginning"
        say(f"job {name}: lost on {source_name} at {_clock(begun)} ({why}); moved to {machine.name} by "
            f"itself (--fallback) and started there {start} ({took:.0f} s); "
            f"`%gpu logs {name} --host {machine.name}` shows one log")
        for line in said:
            if line.startswith(("the budget", "armed", "the guard", "no project folder", f"job {name} starts")):
                say(f"  {line}")
        return job


def pending_cleanups(machine_name: str) -> list[StartRecord]:
    """The start records of jobs that moved away from ``machine_name`` and whose old copy has
    not been seen to (:func:`clean_after_move`) since."""
    return [r for r in start_records(machine_name) if r.moved_to and r.cleanup == "pending"]


def clean_after_move(machine: MachineLike, say: Callable[[str], None]) -> int:
    """On a machine that answers again after its jobs moved away: each moved job that still runs
    there is stopped (the run goes on elsewhere: no second copy), and a budget guard armed
    there is disarmed (the guard went with the job).  Returns the jobs seen to; never starts one.

    Raises
    ------
    Exception
        The machine's errors (not answering...): it is tried again at a later connect.
    """
    from ...budget.guard import disarm_if_armed
    from ..jobs import Job, list_jobs

    todo = pending_cleanups(machine.name)
    if not todo:
        return 0
    found = {i.name: i for i in list_jobs(machine)}
    note_seen(machine.name)
    for rec in todo:
        name, where = rec.job, rec.moved_to
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
            f"{', '.join(sorted({r.moved_to or '?' for r in todo}))})")
    return len(todo)
