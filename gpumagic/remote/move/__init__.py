"""Training that outlives its machine (issue 27, items 2 and 3): noticing that a job's machine
is gone, and moving the run to another machine (or resuming it on the same one after a
restart) from the newest checkpoint kept on the laptop (:mod:`gpumagic.remote.keep`).

Everything here is read from and written to the laptop's gpumagic data directory, beside the
keep records (``keep/MACHINE/`` under :func:`gpumagic.budget.ledger.data_dir`), so that it
works after the notebook restarts and while the machine does not answer.  One module per job:

:mod:`~gpumagic.remote.move.store`
    The typed records (:class:`StartRecord` in ``JOB.job.json``: what the job was started with,
    and what became of it; :class:`Pushes` in ``@pushes.json``: which folder here was pushed
    where), each with ``load``/``save`` and a schema version, and the job's folders.
:mod:`~gpumagic.remote.move.reaching`
    Whether the machine answers (:class:`ReachRecord` in ``@reach.json``), and
    :func:`list_or_lost`: the jobs, or the verdict once it has not answered for
    :data:`LOST_AFTER` seconds.
:mod:`~gpumagic.remote.move.loss`
    When a job counts as lost (:class:`Loss`: its machine, its folder or process, a GPU), and
    the lines ``%gpu jobs`` says it with.
:mod:`~gpumagic.remote.move.moving`
    The move itself (:func:`move`), one at a time per job (:func:`move_lock`).
:mod:`~gpumagic.remote.move.standby`
    The standby (``--fallback``) that moves a job by itself, and the clean-up of the machine
    a job left.

:class:`Moves` is all of it for one machine (``machine.moves``), as the magics use it.  The
names below are those the rest of gpumagic and the tests use.  :data:`LOST_AFTER`,
:data:`PROBE_EVERY` (of :mod:`.reaching`) and :data:`CHECK_EVERY` (of :mod:`.standby`) are
read from their module at each use, here too, so setting them there is seen everywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..keep import records as keep_records
from . import reaching
from .loss import (GPU_GONE_RE, LOSSES, Loss, gpu_loss, gpu_losses, gpu_lost, job_gone, keep_view, lost_for, lost_line,
                   lost_lines, lost_report, newest_kept, newest_written)
from .moving import (MOVER_FORMAT, Mover, Start, check_move, earlier_log, find_start, move, move_lock, record_torchrun,
                     resumed_command, torchrun_form, torchrun_script)
from .reaching import (REACH_FORMAT, UNREACHABLE, ReachRecord, Unreachable, list_or_lost, note_failed, note_seen,
                       reach, why)
from .standby import arm_fallback, clean_after_move, pending_cleanups, rearm_fallbacks, standby_move
from .store import (GPU_FIELDS, PUSHES_FORMAT, PUSHES_KEPT, START_FORMAT, GpuGone, HeldGpu, Push, Pushes, RunOptions,
                    StartRecord, TorchrunLayout, abs_dirs, gpu_status, gpus_held, job_options, note_push,
                    project_folder_here, record_keep, record_start, start_path, start_record, start_records,
                    update_start)

if TYPE_CHECKING:
    from ..._types import MachineLike
    from ..jobs import Job, JobInfo

__all__ = [
    "CHECK_EVERY", "GPU_FIELDS", "GPU_GONE_RE", "LOSSES", "LOST_AFTER", "MOVER_FORMAT", "PROBE_EVERY", "PUSHES_FORMAT",
    "PUSHES_KEPT", "REACH_FORMAT", "START_FORMAT", "UNREACHABLE", "GpuGone", "HeldGpu", "Loss", "Mover", "Push",
    "Moves", "Pushes", "ReachRecord", "RunOptions", "Start", "StartRecord", "TorchrunLayout", "Unreachable", "abs_dirs",
    "arm_fallback", "check_move", "clean_after_move", "earlier_log", "find_start", "gpu_loss", "gpu_losses", "gpu_lost",
    "gpu_status", "gpus_held", "job_gone", "job_options", "keep_view", "list_or_lost", "lost_for", "lost_line",
    "lost_lines", "lost_report", "move", "move_lock", "newest_kept", "newest_written", "note_failed", "note_push",
    "note_seen", "pending_cleanups", "project_folder_here", "reach", "rearm_fallbacks", "record_keep",
    "record_start", "record_torchrun", "resumed_command", "standby_move", "start_path", "start_record",
    "start_records", "torchrun_form", "torchrun_script", "update_start", "why",
]

_TUNABLES = {"LOST_AFTER": "reaching", "PROBE_EVERY": "reaching", "CHECK_EVERY": "standby"}


class Moves:
    """The jobs of one machine as this computer knows them from its records
    (:attr:`Machine.moves <gpumagic.Machine.moves>`): which are lost with the machine
    (:meth:`jobs`, :meth:`lost_report`), the standby that moves a job elsewhere by itself
    (:meth:`standby`, :meth:`rearm`), a job continued here from its newest checkpoint kept on
    this computer (:meth:`take`), and the clean-up once the machine answers after its jobs
    moved away (:meth:`clean_up`).  Everything is read from the laptop's data directory, so
    it works while the machine does not answer.

    Parameters
    ----------
    machine : MachineLike
        The machine (its name keys the records).
    """

    def __init__(self, machine: MachineLike):
        self.machine = machine

    @property
    def lost_after(self) -> float:
        """Seconds without an answer after which the machine counts as lost (:data:`LOST_AFTER`)."""
        return reaching.LOST_AFTER

    def record(self, job: str) -> StartRecord | None:
        """The start record of ``job`` on this machine (what it was started with), if any."""
        return start_record(self.machine.name, job)

    def jobs(self, say: Callable[[str], None] = print) -> list[JobInfo] | Unreachable:
        """The machine's jobs (one round trip); where jobs were started from here and it does not
        answer, the :class:`Unreachable` verdict after :attr:`lost_after` seconds of trying
        (:func:`list_or_lost`)."""
        if start_records(self.machine.name):
            return list_or_lost(self.machine, say)
        return self.machine.jobs()

    def lost_report(self, found: list[JobInfo] | Unreachable) -> tuple[list[str], dict[str, str]]:
        """The lines ``%gpu jobs`` adds for the jobs recorded here (lost ones, with a GPU lost
        too, and moved ones) and the lost jobs (name -> why), from :meth:`jobs`'s answer
        (:func:`lost_report`; one more round trip where a running job started with a GPU listed)."""
        return lost_report(self.machine.name, found, gpu=gpu_losses(self.machine, found))

    def kept(self, lost: dict[str, str]) -> list[tuple[dict, bool]]:
        """Each job's checkpoints kept here as ``%gpu jobs`` shows them: ``(record, live)``
        (:func:`keep_view`; ``lost``: :meth:`lost_report`'s)."""
        shown = []
        for rec in keep_records(self.machine.name):
            k = self.machine.keepers.get(rec.job)
            shown.append(keep_view(rec, lost.get(rec.job), live=k is not None and k.running))
        return shown

    def earlier_log(self, job: str, lines: int | None) -> str:
        """The last ``lines`` lines (None: all) of the logs kept here of ``job``'s runs before
        the one on this machine (:func:`earlier_log`; ``""`` when it was not moved or resumed)."""
        return earlier_log(self.machine.name, job, lines)

    def standby(self, job: str, fallback: str, target: Callable[[], MachineLike],
                say: Callable[[str], None]) -> None:
        """Make job ``job``'s keeper move it to machine ``fallback`` (``target()``, looked up
        when needed) by itself once this machine is lost (:func:`arm_fallback`); records the
        fallback."""
        update_start(self.machine.name, job, fallback=fallback)
        keeper = self.machine.keepers.get(job)
        if keeper is not None:
            arm_fallback(keeper, job, target, say)

    def rearm(self, connected: Callable[[str], MachineLike | None], say: Callable[[str], None],
              renting: Callable[[str, str], Callable[[], MachineLike] | None] | None = None) -> list[str]:
        """Arm again the standbys whose keeper does not run in this process
        (:func:`rearm_fallbacks`; ``renting``: for a fallback yet to be rented); returns the
        jobs armed again."""
        return rearm_fallbacks(self.machine, connected, say, renting)

    def cleanups_pending(self) -> bool:
        """Whether jobs moved away from this machine still run there as far as is known
        (:func:`pending_cleanups`)."""
        return bool(pending_cleanups(self.machine.name))

    def clean_up(self, say: Callable[[str], None]) -> bool:
        """Stop the jobs that moved away and still run here, and the guard that went with
        them (:func:`clean_after_move`); False when the machine did not answer (tried again
        later).

        Raises
        ------
        Exception
            The machine's other errors.
        """
        try:
            clean_after_move(self.machine, say)
        except UNREACHABLE:
            return False
        return True

    def take(self, job: str, rec: StartRecord, *, source: MachineLike | None, yes: bool = False,
             src: str | None = None, torchrun: int | str | None = None, from_start: bool = False,
             no_src: bool = False, say: Callable[[str], None] = print) -> Job:
        """Continue job ``job`` here from its newest checkpoint kept on this computer, started
        as ``rec`` says (:meth:`gpumagic.fleet.Fleet.job_record`) and moved from ``source`` (None: not connected here;
        this machine itself: a resume after a restart); see :func:`move`."""
        return move(source, self.machine, job, rec=rec, yes=yes, src=src, torchrun=torchrun,
                    how=Start(from_start=from_start, no_src=no_src), say=say)


def __getattr__(name: str):
    """The tunables, read from the module that uses them (see the module docstring)."""
    if name in _TUNABLES:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_TUNABLES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
