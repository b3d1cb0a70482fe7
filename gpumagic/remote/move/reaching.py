"""Whether a machine answers, as seen from here over time (see :mod:`gpumagic.remote.move`).

``@reach.json`` (:class:`ReachRecord`, beside the keep records under ``keep/MACHINE/``) holds
when the machine last answered (``last_seen``), and since when every attempt to reach it has
failed (``failing_since``), as the keeper's looks and ``%gpu jobs`` saw it: it is read after the
notebook restarts, and while the machine does not answer.

:data:`LOST_AFTER`, :data:`PROBE_EVERY`: read from this module at each use (``reaching.LOST_AFTER``),
so that setting them here (a test's monkeypatch) is seen everywhere.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar

from ..._stored import Stored
from ...errors import ConnectionLost, ConnectionRefused, ConnectTimeout, Interrupted
from ..keep import record_dir
from .store import lock

if TYPE_CHECKING:
    from ..._types import MachineLike
    from ..jobs import JobInfo

#: Seconds every attempt to reach a machine must have failed before its jobs count as lost.
LOST_AFTER = 30.0
#: Seconds between attempts while a machine does not answer.
PROBE_EVERY = 5.0
#: What an attempt to reach a machine that is gone (or cut off) raises.
UNREACHABLE = (ConnectionRefused, ConnectTimeout, ConnectionLost)

REACH_FORMAT = "gpumagic-reach"


@dataclass
class ReachRecord(Stored):
    """``@reach.json``: when the machine last answered, since when every attempt failed and
    why (laptop epoch seconds; None when not known)."""

    FORMAT: ClassVar[str] = REACH_FORMAT
    VERSION: ClassVar[int] = 1

    last_seen: float | None = None
    failing_since: float | None = None
    why: str = ""
    version: int = VERSION
    extra: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, d: dict) -> ReachRecord:
        seen, since = d.get("last_seen"), d.get("failing_since")
        return cls(None if seen is None else float(seen), None if since is None else float(since),
                   str(d.get("why") or ""))

    def to_dict(self) -> dict:
        return {"last_seen": self.last_seen, "failing_since": self.failing_since, "why": self.why}


def reach_path(machine_name: str) -> Path:
    return record_dir(machine_name) / "@reach.json"


def reach(machine_name: str) -> ReachRecord:
    """What is known of whether ``machine_name`` answers (an empty record when nothing is)."""
    return ReachRecord.load(reach_path(machine_name)) or ReachRecord()


def _note_reach(machine_name: str, ok: bool, at: float, why: str = "") -> None:
    path = reach_path(machine_name)
    with lock, contextlib.suppress(OSError):
        rec = ReachRecord.load(path) or ReachRecord()
        if ok:
            rec.last_seen, rec.failing_since, rec.why = max(at, rec.last_seen or 0), None, ""
        elif not rec.failing_since or (rec.last_seen or 0) > rec.failing_since:
            rec.failing_since, rec.why = at, why
        else:
            rec.why = why
        rec.save(path)


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
    from ..jobs import list_jobs

    told = False
    while True:
        begun = time.time()
        try:
            infos = list_jobs(machine)
        except UNREACHABLE as e:
            note_failed(machine.name, why(e), begun)
            r = reach(machine.name)
            streak = time.time() - (r.failing_since or begun)
            if streak >= LOST_AFTER:
                return Unreachable(r.failing_since or begun, r.last_seen, r.why)
            if not told:
                say(f"{machine.name} does not answer ({why(e)}); trying again every {PROBE_EVERY:g} s until it "
                    f"has not answered for {LOST_AFTER:g} s")
                told = True
            time.sleep(max(0.0, min(PROBE_EVERY, LOST_AFTER - streak)))
            continue
        note_seen(machine.name, begun)
        return infos
