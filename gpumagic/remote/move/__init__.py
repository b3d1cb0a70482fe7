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

The names below are those the rest of gpumagic and the tests use.  :data:`LOST_AFTER`,
:data:`PROBE_EVERY` (of :mod:`.reaching`) and :data:`CHECK_EVERY` (of :mod:`.standby`) are
read from their module at each use, here too, so setting them there is seen everywhere.
"""

from __future__ import annotations

from .loss import (GPU_GONE_RE, LOSSES, Loss, gpu_loss, gpu_losses, gpu_lost, job_gone, keep_view, lost_for, lost_line,
                   lost_lines, lost_report, newest_kept, newest_written)
from .moving import (MOVER_FORMAT, Mover, Start, earlier_log, find_start, move, move_lock, record_torchrun,
                     resumed_command, torchrun_form, torchrun_script)
from .reaching import (REACH_FORMAT, UNREACHABLE, ReachRecord, Unreachable, list_or_lost, note_failed, note_seen,
                       reach, why)
from .standby import arm_fallback, clean_after_move, pending_cleanups, rearm_fallbacks, standby_move
from .store import (GPU_FIELDS, PUSHES_FORMAT, PUSHES_KEPT, START_FORMAT, GpuGone, HeldGpu, Push, Pushes, RunOptions,
                    StartRecord, TorchrunLayout, abs_dirs, gpu_status, gpus_held, job_options, note_push,
                    project_folder_here, record_keep, record_start, start_path, start_record, start_records,
                    update_start)

__all__ = [
    "CHECK_EVERY", "GPU_FIELDS", "GPU_GONE_RE", "LOSSES", "LOST_AFTER", "MOVER_FORMAT", "PROBE_EVERY", "PUSHES_FORMAT",
    "PUSHES_KEPT", "REACH_FORMAT", "START_FORMAT", "UNREACHABLE", "GpuGone", "HeldGpu", "Loss", "Mover", "Push",
    "Pushes", "ReachRecord", "RunOptions", "Start", "StartRecord", "TorchrunLayout", "Unreachable", "abs_dirs",
    "arm_fallback", "clean_after_move", "earlier_log", "find_start", "gpu_loss", "gpu_losses", "gpu_lost",
    "gpu_status", "gpus_held", "job_gone", "job_options", "keep_view", "list_or_lost", "lost_for", "lost_line",
    "lost_lines", "lost_report", "move", "move_lock", "newest_kept", "newest_written", "note_failed", "note_push",
    "note_seen", "pending_cleanups", "project_folder_here", "reach", "rearm_fallbacks", "record_keep",
    "record_start", "record_torchrun", "resumed_command", "standby_move", "start_path", "start_record",
    "start_records", "torchrun_form", "torchrun_script", "update_start", "why",
]

_TUNABLES = {"LOST_AFTER": "reaching", "PROBE_EVERY": "reaching", "CHECK_EVERY": "standby"}


def __getattr__(name: str):
    """The tunables, read from the module that uses them (see the module docstring)."""
    if name in _TUNABLES:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_TUNABLES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
