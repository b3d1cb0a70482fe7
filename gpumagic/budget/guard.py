"""The guard: a small POSIX ``sh`` loop on the machine that stops paying for it.

It shuts the machine down at the budget limit, at a deadline, or after the GPU has been
*measurably* idle for a given time, and it runs detached (``setsid nohup``) on the machine,
so it works with the laptop closed.  The programs are files in ``gpumagic/remote/programs/``:
``budget-guard.sh`` (the guard, installed in its folder on the machine with ``lib.sh``) and
``budget-guard-ctl.sh`` (arm, cancel, status: one round trip each).

:func:`arm_guard`, :func:`cancel_guard` and :func:`read_status` act on the machine alone;
:func:`read_meter`, :func:`arm_machine_guard` and :func:`disarm_machine_guard` also read and
record the machine's prices, limit and rentals in the :class:`~gpumagic.budget.ledger.Ledger`;
:class:`Budget` is all of it for one machine (``machine.budget``).  How the machine is stopped comes from :meth:`gpumagic.machine.Machine.shutdown_plan` (the
sandbox, which is this computer, answers with a stand-in).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..remote import program
from ..remote.execution import run_program
from .ledger import GuardRecord, Ledger, MachineRecord, prices_of, record_rental, set_prices
from .prices import (MAX_SPAN_S, BudgetError, MeterReading, Prices, guard_limit_in, is_number, meter,
                     platforms)

if TYPE_CHECKING:
    from .._types import MachineLike

#: Where the guard lives on the machine (relative to $HOME).
GUARD_DIR = ".gpumagic/guard"
#: The guard's program files, in the order they are installed as one script.
GUARD_PROGRAM = ("lib.sh", "budget-guard.sh")


def guard_dir(machine: MachineLike) -> str:
    """The guard's folder on ``machine``: :data:`GUARD_DIR` (relative to the remote home), or
    inside the machine's :meth:`~gpumagic.machine.Machine.scratch_dir` where it has one (the
    sandbox's temporary folder): the guard exits when its folder goes, so it ends with the
    machine there instead of running on."""
    scratch = machine.scratch_dir()
    return f"{scratch}/guard" if scratch else GUARD_DIR


def guard_log_path(machine: MachineLike) -> str:
    """Where the guard's log is on ``machine``, for messages (``~/`` for the remote home)."""
    d = guard_dir(machine)
    return f"{d}/log" if d.startswith("/") else f"~/{d}/log"


# -- reading the machine ------------------------------------------------------------------


@dataclass(frozen=True)
class Clock:
    """The remote clock and when the machine started (epoch seconds, remote clock)."""

    remote_now: float
    started: float | None


def parse_clock(line: str) -> Clock:
    """Parse the ``clock NOW BTIME STARTTICKS CLK_TCK`` line of ``budget-guard-ctl.sh status``."""
    parts = line.split()
    if len(parts) < 2 or parts[0] != "clock":
        raise BudgetError(f"could not read the machine's clock ({line!r})",
                          "give the billing start yourself: %gpu budget set --started-at HH:MM")
    now = float(parts[1])
    started = None
    try:
        btime, ticks, hz = float(parts[2]), float(parts[3]), float(parts[4])
        if hz > 0:
            started = btime + ticks / hz
    except (IndexError, ValueError):
        pass
    return Clock(now, started)


@dataclass(frozen=True)
class GuardStatus:
    """What the remote guard reports (see ``budget-guard.sh`` for its state file).

    Attributes
    ----------
    state : str
        ``armed``, ``fired``, ``failed``, ``cancelled``, or ``gone`` (state says armed but the
        process is not running: the machine restarted) or ``none``.
    alive : bool
    fire_at : float or None
        Remote epoch seconds when it would act now (``None``: no trigger pending).
    reason : str
        Why it would act / acted.
    idle : str
        Its last measurement (``idle ...``, ``busy ...``, ``unknown ...``).
    checks : int
        Measurements made.
    checked : float or None
        Remote epoch seconds of its last check (for ``fired``: when it acted).
    remote_now : float
    warning : str
        The alert text the guard wrote before acting (empty when none).
    log : list of str
        Last lines of its log.
    settings : dict
        What it was armed with (``idle_s``, ``limit_in``, ``deadline_in``, ``grace_s``, ``poll_s``).
    """

    state: str = "none"
    alive: bool = False
    fire_at: float | None = None
    reason: str = ""
    idle: str = ""
    checks: int = 0
    remote_now: float = 0.0
    warning: str = ""
    log: tuple = ()
    settings: dict = field(default_factory=dict)
    checked: float | None = None

    @property
    def fires_in(self) -> float | None:
        if self.fire_at is None:
            return None
        return max(0.0, self.fire_at - self.remote_now)


def parse_status(text: str) -> tuple[Clock, GuardStatus]:
    """Parse the output of ``budget-guard-ctl.sh status`` (and ``cancel``)."""
    lines = text.splitlines()
    clock_line = next((ln for ln in lines if ln.startswith("clock ")), "")
    clock = parse_clock(clock_line)
    if "guard-state" not in lines:
        return clock, GuardStatus(remote_now=clock.remote_now)
    i = lines.index("guard-state")
    kv: dict[str, str] = {}
    j = i + 1
    while j < len(lines) and lines[j] != "guard-end":
        k, _, v = lines[j].partition("=")
        kv[k] = v
        j += 1
    alive = any(ln == "guard-alive 1" for ln in lines)
    warning = next((ln[len("guard-alert "):] for ln in lines if ln.startswith("guard-alert ")), "")
    log = tuple(lines[lines.index("guard-log") + 1:]) if "guard-log" in lines else ()
    state = kv.get("state", "none")
    if state == "armed" and not alive:
        state = "gone"

    def num(key):
        try:
            return float(kv[key])
        except (KeyError, ValueError):
            return None

    settings = {k: num(k) for k in ("idle_s", "limit_in", "deadline_in", "grace_s", "poll_s")
                if num(k) is not None}
    return clock, GuardStatus(state=state, alive=alive, fire_at=num("fire_at"),
                              reason=kv.get("reason", ""), idle=kv.get("idle", ""),
                              checks=int(num("checks") or 0), remote_now=clock.remote_now,
                              warning=warning, log=log, settings=settings, checked=num("checked"))


# -- the guard ----------------------------------------------------------------------------


@dataclass(frozen=True)
class GuardSettings:
    """What to arm the guard with (seconds; ``None`` = that trigger is off).

    Attributes
    ----------
    idle_s : float or None
        Shut down after the GPU was measured idle this long.
    limit_in : float or None
        Shut down this many seconds from now (the budget limit, computed at arm time).
    deadline_in : float or None
        Shut down this many seconds from now (a deadline).
    grace_s : float
        Warn (log, notebook alert, and mail or webhook where `%gpu budget notify` set them up)
        this long before acting.
    poll_s : float
        Seconds between measurements.
    idle_util : float
        GPU utilisation (%) below which the GPU counts as idle.
    busy_mem_mib : float
        GPU memory (MiB) not held by a visible process above which the GPU counts as busy.
    """

    idle_s: float | None = None
    limit_in: float | None = None
    deadline_in: float | None = None
    grace_s: float = 600
    poll_s: float = 30
    idle_util: float = 5
    busy_mem_mib: float = 64

    def __post_init__(self):
        if self.idle_s is None and self.limit_in is None and self.deadline_in is None:
            raise ConfigError("the guard needs something to watch",
                              "give --idle 30m, --at-limit (with a limit set) or --deadline HH:MM")
        if not (is_number(self.poll_s, 1, 86400) and is_number(self.grace_s, 0, MAX_SPAN_S)):
            raise ConfigError("poll must be 1 s to 1 day and grace 0 to 10 years",
                              "e.g. --poll 30 --grace 10m")
        for name in ("idle_s", "limit_in", "deadline_in"):
            v = getattr(self, name)
            if v is not None and not is_number(v, -MAX_SPAN_S, MAX_SPAN_S):
                raise ConfigError(f"{name} must be a number of seconds within 10 years, not {v!r}",
                                  "e.g. --idle 30m or --deadline +3h")
        if not (is_number(self.idle_util, 0, 100) and is_number(self.busy_mem_mib, 0, 1e9)):
            raise ConfigError("idle_util must be 0 to 100 (%) and busy_mem_mib a number of MiB >= 0",
                              "e.g. idle_util=5, busy_mem_mib=64")

    def args(self) -> list[str]:
        """The ``SETTING=VALUE`` arguments of ``budget-guard.sh`` (whole seconds, rounded up;
        empty: off)."""
        def opt(v):
            return "" if v is None else str(int(math.ceil(v)))

        return [f"idle_s={opt(self.idle_s)}", f"limit_in={opt(self.limit_in)}",
                f"deadline_in={opt(self.deadline_in)}", f"grace_s={opt(self.grace_s)}",
                f"poll_s={opt(self.poll_s)}", f"idle_util={self.idle_util:g}",
                f"busy_mem_mib={opt(self.busy_mem_mib)}"]


def guard_program() -> str:
    """The guard as installed on the machine: ``lib.sh`` then ``budget-guard.sh``, one ``sh``
    script (``sh FILE run DIR SETTINGS...`` or ``sh FILE measure SETTINGS...``)."""
    return "\n".join(program.source(name) for name in GUARD_PROGRAM)


def _ctl(machine: MachineLike, *args, stdin: bytes | None = None):
    return run_program(machine.connection, "budget-guard-ctl.sh", *args, stdin=stdin, timeout=60)


def read_status(machine: MachineLike) -> tuple[Clock, GuardStatus]:
    """One round trip: the remote clock, the machine's start, and the guard's state."""
    return parse_status(_ctl(machine, "status", guard_dir(machine)).stdout)


def arm_guard(machine: MachineLike, settings: GuardSettings, *, plan=None, wait: float = 10.0) -> GuardStatus:
    """Start the guard on ``machine``, replacing any earlier one; returns its first status.

    ``plan`` (a :class:`gpumagic.budget.shutdown.ShutdownPlan`) defaults to
    :meth:`machine.shutdown_plan() <gpumagic.machine.Machine.shutdown_plan>`: on the sandbox
    (which is this computer) a stand-in that records the call in the sandbox's folder.

    Raises
    ------
    BudgetError
        When no shutdown command can run on the machine (with what to do instead), or the
        guard did not start or report within ``wait`` seconds.
    """
    if plan is None:
        plan = machine.shutdown_plan()
    if not plan.possible:
        raise BudgetError(f"the guard cannot shut {machine.name} down: no shutdown command can run there",
                          plan.reason)
    r = _ctl(machine, "arm", guard_dir(machine), *settings.args(), f"shutdown={plan.command}",
             stdin=guard_program().encode())
    if r.exit_code != 0:
        raise BudgetError(f"could not start the guard on {machine.name}: {r.stderr.strip()[-300:]}",
                          "check that $HOME is writable on the machine")
    deadline = time.monotonic() + wait
    status = GuardStatus()
    while time.monotonic() < deadline:
        _, status = read_status(machine)
        if status.state in ("armed", "fired", "failed", "firing") and (status.checks or settings.idle_s is None):
            return status
        time.sleep(0.1)
    raise BudgetError(f"the guard on {machine.name} did not report within {wait:g} s "
                      f"(state {status.state!r})", f"look at {guard_log_path(machine)} on the machine")


def cancel_guard(machine: MachineLike) -> GuardStatus:
    """Stop the guard (its whole process group); returns the status after (one round trip)."""
    return parse_status(_ctl(machine, "cancel", guard_dir(machine)).stdout)[1]


# -- one machine: ledger + remote ---------------------------------------------------------


def read_meter(machine: MachineLike, ledger: Ledger, *, now: float | None = None) -> MeterReading:
    """Read ``machine``'s meter (one round trip), record the rental, mark new alerts as shown.

    Raises
    ------
    BudgetError
        When no prices are set for the machine.
    """
    name = machine.name
    prices = prices_of(ledger.machine(name), name)
    clock, guard = read_status(machine)
    local_now = time.time() if now is None else now
    with ledger.update() as machines:
        rec = machines[name]
        start = rec.billing_start(clock, local_now)
        rental = record_rental(rec, start, local_now, prices)
        reading = meter(name, prices, start, local_now, limit=rec.limit, alerts=rec.alerts,
                        alerted=rental.alerted, guard=guard if guard.state != "none" else None)
        rental.alerted = sorted(set(rental.alerted) | set(reading.crossed))
    return reading


def arm_machine_guard(machine: MachineLike, ledger: Ledger, *, idle_s: float | None = None, at_limit: bool = False,
                      deadline: float | None = None, grace_s: float = 600, poll_s: float = 30,
                      idle_util: float = 5, plan=None, now: float | None = None) -> GuardStatus:
    """Arm the guard on ``machine`` with the budget's limit (``at_limit``) from the ledger.

    ``deadline`` is an epoch time on the laptop's clock; it is sent as "seconds from now" so
    the two clocks need not agree.  Where the machine cannot shut down, the error says how
    its platform (the preset its prices were set with) stops an instance.

    Raises
    ------
    BudgetError
        At-limit without prices or limit, a limit already reached, a deadline in the past,
        or no way to shut the machine down.
    """
    local_now = time.time() if now is None else now
    rec = ledger.machine(machine.name) or MachineRecord()
    limit_in = None
    if at_limit:
        prices = prices_of(rec, machine.name)
        if rec.limit is None:
            raise BudgetError(f"no limit is set for {machine.name}", "run `%gpu budget set --limit AMOUNT` first")
        clock, _ = read_status(machine)
        limit_in = guard_limit_in(prices, float(rec.limit), local_now - rec.billing_start(clock, local_now))
        if limit_in <= 0:
            raise BudgetError(f"{machine.name} has already reached its limit of {prices.money(float(rec.limit))}",
                              "raise it with `%gpu budget set --limit AMOUNT`, or stop the machine now")
    deadline_in = None
    if deadline is not None:
        deadline_in = deadline - local_now
        if deadline_in <= 0:
            raise BudgetError("the deadline is in the past", "give a later time, e.g. --deadline +2h")
    settings = GuardSettings(idle_s=idle_s, limit_in=limit_in, deadline_in=deadline_in,
                             grace_s=grace_s, poll_s=poll_s, idle_util=idle_util)
    if plan is None:
        plan = machine.shutdown_plan()
        preset = rec.prices.platform if rec.prices is not None else None
        how = platforms().get(preset, {}).get("stop") if preset and preset != "generic" else None
        if not plan.possible and how:
            plan = replace(plan, reason=f"{plan.reason}. On {platforms()[preset]['name']}: {how}")
    status = arm_guard(machine, settings, plan=plan)
    with ledger.update() as machines:
        machines.setdefault(machine.name, MachineRecord()).guard = GuardRecord(
            armed_at=local_now, idle_s=idle_s, limit_in=limit_in, deadline_in=deadline_in, grace_s=grace_s)
    return status


def disarm_machine_guard(machine: MachineLike, ledger: Ledger) -> GuardStatus:
    """Cancel the guard on ``machine`` and forget it in the ledger."""
    status = cancel_guard(machine)
    with ledger.update() as machines:
        if machine.name in machines:
            machines[machine.name].guard = None
    return status


class Budget:
    """What one machine costs and the guard that stops paying for it (:attr:`Machine.budget
    <gpumagic.Machine.budget>`): its prices in the ledger (:meth:`set`), the meter
    (:meth:`meter`), and the guard on the machine (:meth:`guard`, :meth:`cancel_guard`,
    :meth:`guard_status`, :meth:`guard_log`).  ``ledger``: the :class:`~gpumagic.budget.ledger.Ledger` to read
    and write (default: the user's).

    Parameters
    ----------
    machine : MachineLike
        The machine (its name keys the ledger's record).
    """

    def __init__(self, machine: MachineLike):
        self.machine = machine

    def set(self, rate: float, *, ledger: Ledger | None = None, limit: float | None = None,
            alerts=None, started_at: float | None = None, **prices) -> MachineRecord:
        """Store this machine's prices (per hour; see :class:`gpumagic.budget.Prices` for
        ``currency``, ``billing``, ``storage_gb``/``storage_rate``/``storage_per``, ``ip_rate``,
        ``image_*``, ``platform``), an optional ``limit``, ``alerts`` thresholds and billing
        start (epoch s; default: the machine's start).  Returns the ledger record."""
        return set_prices(ledger or Ledger(), self.machine.name, Prices(rate=rate, **prices),
                          limit=limit, alerts=alerts, started_at=started_at)

    def meter(self, *, ledger: Ledger | None = None) -> MeterReading:
        """Read the meter: spent, rate, limit, next billing boundary, guard (one round trip;
        see :func:`read_meter`)."""
        return read_meter(self.machine, ledger or Ledger())

    def guard(self, *, idle: float | None = None, at_limit: bool = False, deadline: float | None = None,
              grace: float = 600, poll: float = 30, ledger: Ledger | None = None, plan=None) -> GuardStatus:
        """Arm the guard on the machine: shut down after ``idle`` seconds of measured GPU
        idleness, at the budget limit, or at epoch ``deadline``; warn ``grace`` seconds before
        (see :func:`arm_machine_guard`).

        Raises
        ------
        BudgetError
            Where no shutdown command can run (and as :func:`arm_machine_guard`).
        """
        return arm_machine_guard(self.machine, ledger or Ledger(), idle_s=idle, at_limit=at_limit,
                                 deadline=deadline, grace_s=grace, poll_s=poll, plan=plan)

    def cancel_guard(self, *, ledger: Ledger | None = None) -> GuardStatus:
        """Disarm the guard; returns its status after."""
        return disarm_machine_guard(self.machine, ledger or Ledger())

    def guard_status(self) -> GuardStatus:
        """The guard's status on the machine (one round trip)."""
        return read_status(self.machine)[1]

    def guard_log(self) -> str:
        """Where the guard's log is on the machine (``~/`` for the remote home; no round trip)."""
        return guard_log_path(self.machine)


# -- a job that moved (gpumagic.remote.move) ---------------------------------------------


def carry_guard(ledger: Ledger, source_name: str, target: MachineLike, say) -> GuardStatus | None:
    """Arm on ``target`` the guard armed from here on ``source_name`` (its job moved there):
    the same idle time and grace, the same deadline (as a time, where it is still ahead), and
    the limit rule where ``target`` has a limit set.  A guard ``target`` has already is left as
    it is.  ``say`` hears what was done; returns the new guard's status (None: none armed).

    Raises
    ------
    BudgetError
        No shutdown command can run on ``target`` (with what to do instead).
    """
    old = (ledger.machine(source_name) or MachineRecord()).guard
    if old is None:
        return None
    mine = ledger.machine(target.name) or MachineRecord()
    if mine.guard is not None:
        say(f"the guard of {target.name} is left as it is (the job's guard on {source_name} is not carried over it)")
        return None
    deadline = None
    if old.deadline_in is not None and old.armed_at is not None:
        deadline = old.armed_at + old.deadline_in
        if deadline <= time.time():
            deadline = None
    at_limit = old.limit_in is not None and mine.limit is not None and mine.prices is not None
    if old.idle_s is None and deadline is None and not at_limit:
        say(f"the guard of {source_name} had nothing left to carry to {target.name} (its deadline "
            "passed, or a limit rule without a limit set there)")
        return None
    status = arm_machine_guard(target, ledger, idle_s=old.idle_s, at_limit=at_limit, deadline=deadline,
                               grace_s=old.grace_s if old.grace_s is not None else 600)
    rules = ([f"idle {old.idle_s:g} s"] if old.idle_s is not None else []) + (["at the limit"] if at_limit else []) \
        + ([f"deadline {time.strftime('%H:%M', time.localtime(deadline))}"] if deadline is not None else [])
    say(f"armed the guard of {source_name} on {target.name} too ({', '.join(rules)})")
    return status


def disarm_if_armed(machine: MachineLike, ledger: Ledger | None = None) -> bool:
    """Disarm ``machine``'s guard where one runs there or the ledger has one armed from here
    (one or two round trips); returns whether one was."""
    ledger = ledger or Ledger()
    rec = ledger.machine(machine.name)
    _, status = read_status(machine)
    if status.state not in ("armed", "firing") and (rec is None or rec.guard is None):
        return False
    disarm_machine_guard(machine, ledger)
    return True
