"""The soak of issue 28: everything a notebook runs at once, over a link that blinks and roams.

Shared by ``benchmarks/soak.py`` (two hours: a blink every 5 minutes, a roam every 20) and
the 2-minute version in CI (tests/test_resilience.py: a blink every 30 s, a roam every 60 s).
Over one :class:`linkemu.LinkedMachine`, for ``seconds``:

* a ``%%remote`` cell (``Machine.run``, as the magic runs it) printing ``cell N`` every second;
* a detached job printing ``job N`` every second, its log followed with ``Job.follow`` (what
  ``%gpu logs -f`` runs) over a second connection (see :func:`run_soak`);
* a live session (``RemoteKernel``, what ``%gpu kernel`` drives) running cells back to back,
  each printing ``session N`` every second for ``session_cell`` seconds, ``N`` counted in the
  session's own variable;

and meanwhile the link blinks (nothing moves for ``blink_seconds``, then everything does)
every ``blink_every`` seconds and roams (every open connection silent for good) every
``roam_every`` seconds (a blink that falls on a roam is left out).

Counted: the numbered lines of each (every number once, in order, none missing), the
errors shown (an exception, a stderr line, a gpumagic note, a warning logged), and each new
connection: seconds from the fault before it.  The bound for a reconnect is the issue's
while a cell runs (something always runs here): :data:`NOTICE_BOUND` plus one connect
(measured at the start on a second connection through the same link).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
import uuid
from typing import Callable

from gpumagic.remote.kernel import Output
from linkemu import Lines

#: The issue's bound for noticing a dead path while a cell runs (seconds); one connect is added.
NOTICE_BOUND = 10.0


@dataclasses.dataclass
class Fault:
    kind: str  # "blink" or "roam"
    at: float  # seconds since the soak started


@dataclasses.dataclass
class SoakResult:
    seconds: float
    cell: list[str]
    job: list[str]
    session: list[str]
    cell_expected: int
    job_expected: int
    session_expected: int
    faults: list[Fault]
    opens: list[float]  # each new connection, seconds since the start
    connect: float  # one connect through the link, measured at the start (s)
    errors: list[str]

    @property
    def bound(self) -> float:
        return NOTICE_BOUND + self.connect

    @property
    def blinks(self) -> int:
        return sum(f.kind == "blink" for f in self.faults)

    @property
    def roams(self) -> int:
        return sum(f.kind == "roam" for f in self.faults)

    def reconnects(self) -> list[tuple[Fault | None, float]]:
        """Each new connection with the fault before it and the seconds since that fault."""
        out: list[tuple[Fault | None, float]] = []
        for t in self.opens:
            before = [f for f in self.faults if f.at <= t]
            out.append((before[-1], t - before[-1].at) if before else (None, t))
        return out

    def problems(self) -> list[str]:
        """Why the soak failed (empty: it passed)."""
        found: list[str] = []
        for what, lines, want in (("cell", self.cell, self.cell_expected), ("job", self.job, self.job_expected),
                                  ("session", self.session, self.session_expected)):
            bad = _numbering(what, lines, want)
            if bad:
                found.append(bad)
        found += [f"error shown: {e}" for e in self.errors]
        for fault, took in self.reconnects():
            if fault is None:
                found.append(f"a reconnect {took:.1f} s into the soak with no fault before it")
            elif took > self.bound:
                found.append(f"reconnect {took:.2f} s after the {fault.kind} at {fault.at:.0f} s "
                             f"(bound {self.bound:.2f} s)")
        for fault in self.faults:
            if fault.kind == "roam" and not any(f is fault for f, _ in self.reconnects()):
                found.append(f"no new connection after the roam at {fault.at:.0f} s")
        return found

    def report(self) -> str:
        took = [t for f, t in self.reconnects() if f is not None]
        slowest = f"{max(took):.2f} s" if took else "none"
        lines = [
            f"soak: {self.seconds / 60:g} min, {self.blinks} blinks, {self.roams} roams",
            f"  cell lines: {len(self.cell)} of {self.cell_expected}; job lines (followed): "
            f"{len(self.job)} of {self.job_expected}; session lines: {len(self.session)} of "
            f"{self.session_expected}",
            f"  reconnects: {len(self.opens)}; slowest {slowest} from its fault (bound {self.bound:.2f} s: "
            f"{NOTICE_BOUND:g} s + one connect {self.connect:.2f} s)",
        ]
        for fault, t in self.reconnects():
            where = f"{fault.kind} at {fault.at:.0f} s" if fault else "no fault"
            lines.append(f"    {t:.2f} s after the {where}")
        lines.append(f"  errors shown: {len(self.errors)}")
        lines += [f"    {e}" for e in self.errors]
        problems = self.problems()
        lines.append("PASS" if not problems else "FAIL")
        lines += [f"  {p}" for p in problems]
        return "\n".join(lines)


def _numbering(what: str, lines: list[str], want: int) -> str:
    """'' when ``lines`` are exactly ``what 1`` .. ``what want``; else what is wrong."""
    expected = [f"{what} {i}" for i in range(1, want + 1)]
    if lines == expected:
        return ""
    seen = [line for line in lines if line.startswith(f"{what} ")]
    numbers = [int(s.split()[1]) for s in seen if s.split()[1:2] and s.split()[1].isdigit()]
    repeated = sorted({n for n in numbers if numbers.count(n) > 1})
    missing = sorted(set(range(1, want + 1)) - set(numbers))
    other = [line for line in lines if line not in expected]
    return (f"{what}: {len(lines)} lines for {want}; missing {missing[:10]}, repeated {repeated[:10]}, "
            f"out of order {numbers != sorted(numbers)}, other {other[:3]}")



class _SessionOutput(Output):
    """A session's output: stdout kept; stderr, notes and displays are errors shown."""

    def __init__(self, errors: list[str]):
        self.out = Lines()
        self.errors = errors

    def stream(self, name, text):
        if name == "stdout":
            self.out(text)
        else:
            self.errors.append(f"session {name}: {text.strip()!r}")

    def display(self, data, metadata, display_id=None, update=False):
        self.errors.append(f"session display: {str(data.get('text/plain'))[:200]!r}")

    def note(self, text):
        self.errors.append(f"session note: {text!r}")


class _Warnings(logging.Handler):
    """gpumagic's log records at WARNING and above (what a notebook would show)."""

    def __init__(self, errors: list[str]):
        super().__init__(logging.WARNING)
        self.errors = errors

    def emit(self, record):
        self.errors.append(f"log {record.name} {record.levelname}: {record.getMessage()[:300]}")


def fault_plan(seconds: float, blink_every: float, roam_every: float) -> list[Fault]:
    """The faults before ``seconds``: a roam every ``roam_every``, a blink every
    ``blink_every`` where no roam falls."""
    roams = {round(k * roam_every, 3) for k in range(1, int(seconds // roam_every) + 1) if k * roam_every < seconds}
    blinks = {round(k * blink_every, 3) for k in range(1, int(seconds // blink_every) + 1)
              if k * blink_every < seconds} - roams
    return sorted([Fault("roam", t) for t in roams] + [Fault("blink", t) for t in blinks], key=lambda f: f.at)


def _measure_connect(linked) -> float:
    import gpumagic

    m = gpumagic.Machine(linked.spec)
    start = time.monotonic()
    try:
        m.connect()
        return time.monotonic() - start
    finally:
        m.close()


def _guard(errors: list[str], where: str, fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - every error counts
            cause = e.__cause__
            why = f" (from {type(cause).__name__}: {getattr(cause, 'message', None) or cause})" if cause else ""
            errors.append(f"{where}: {type(e).__name__}: {getattr(e, 'message', None) or e}{why}")
    return run


def run_soak(linked, *, seconds: float, blink_every: float, roam_every: float, blink_seconds: float = 5.0,
             session_cell: int = 30, python: str = sys.executable, one_connection: bool = False,
             say: Callable[[str], None] = lambda text: None) -> SoakResult:
    """Run the soak over ``linked`` (a connected :class:`linkemu.LinkedMachine`); see the
    module docstring.  ``say`` gets a line at each fault.

    The job is followed over a second connection (a second ``Machine``, as a second notebook
    would); ``one_connection=True`` follows it on ``linked.machine``, beside the cell and the
    session: two ``Machine.run`` at once on one connection, each in a runner of its own, so
    each is kept through a roam with its grace."""
    import gpumagic

    m = linked.machine
    n = int(seconds)
    errors: list[str] = []
    connect = _measure_connect(linked)
    tag = uuid.uuid4().hex[:6]
    k = m.kernel(f"soak{tag}", python=python)
    session = _SessionOutput(errors)
    k.execute("n = 0", output=session)
    job = m.start_job(f"soak{tag}", f"for i in $(seq 1 {n}); do echo job $i; sleep 1; done")
    cell, followed = Lines(), Lines()
    follower = m if one_connection else gpumagic.Machine(linked.spec).connect()
    followed_job = follower.job(job.name)
    opens: list[float] = []
    start = time.monotonic()
    hook = lambda conn: opens.append(time.monotonic() - start)  # noqa: E731
    conns = list(dict.fromkeys([m.connection, follower.connection]))
    for conn in conns:
        conn.after_open.append(hook)
    logger = logging.getLogger("gpumagic")
    warnings = _Warnings(errors)
    logger.addHandler(warnings)
    end = start + seconds
    cells_run = [0]

    def run_cell() -> None:
        r = m.run(f"for i in $(seq 1 {n}); do echo cell $i; sleep 1; done", stdout=cell)
        if r.exit_code != 0 or r.stderr:
            errors.append(f"cell: exit code {r.exit_code}, stderr {r.stderr[:300]!r}")

    def follow() -> None:
        info = followed_job.follow(out=followed, lines=None)
        if info.state_text != "exited 0":
            errors.append(f"job: {info.state_text}")

    def session_cells() -> None:
        while time.monotonic() < end - 1:
            count = max(1, min(session_cell, int(end - time.monotonic())))
            r = k.execute(f"import time\nfor _ in range({count}):\n    n += 1\n"
                          "    print(f'session {n}', flush=True)\n    time.sleep(1)", output=session)
            cells_run[0] += count
            if not r.ok:
                errors.append(f"session cell: {r.status}")

    threads = [threading.Thread(target=_guard(errors, where, fn), daemon=True, name=f"soak-{where}")
               for where, fn in (("cell", run_cell), ("job follow", follow), ("session", session_cells))]
    for t in threads:
        t.start()
    faults = fault_plan(seconds, blink_every, roam_every)
    try:
        for fault in faults:
            left = start + fault.at - time.monotonic()
            if left > 0:
                time.sleep(left)
            fault.at = time.monotonic() - start
            if fault.kind == "roam":
                linked.roam()
            else:
                linked.blink(blink_seconds)
            say(f"{fault.at:7.1f} s: {fault.kind}")
        for t in threads:
            t.join(max(0.0, end - time.monotonic()) + 120)
            if t.is_alive():
                errors.append(f"{t.name}: still running 120 s after the soak's end")
        try:
            last = k.pull(["n"])["n"]
            if last != cells_run[0]:
                errors.append(f"session: n is {last} on the machine, {cells_run[0]} lines were asked for")
        except Exception as e:  # noqa: BLE001
            errors.append(f"session pull: {type(e).__name__}: {e}")
    finally:
        logger.removeHandler(warnings)
        for conn in conns:
            conn.after_open.remove(hook)
        for stop in (k.stop, job.kill, follower.close if follower is not m else lambda: None):
            try:
                stop()
            except Exception:  # noqa: BLE001 - clean-up
                pass
    return SoakResult(seconds=seconds, cell=cell.lines(), job=followed.lines(), session=session.out.lines(),
                      cell_expected=n, job_expected=n, session_expected=cells_run[0], faults=faults,
                      opens=opens, connect=connect, errors=errors)
