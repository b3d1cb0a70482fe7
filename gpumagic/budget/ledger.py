"""The ledger: one JSON file in the user's data directory recording each machine's prices,
spending limit, alert thresholds, armed guard and rentals (stretches of billing).

Its records are :class:`MachineRecord` (with :class:`Rental` and :class:`GuardRecord`); the
file keeps the JSON form described in :class:`Ledger`.  Written with
:func:`gpumagic._fs.atomic_write` under a lock; a file that cannot be read is reported, moved
aside (kept, never overwritten) and a new one started; a damaged record is left out and
named.  Spending per day (:func:`history`) and the alert check after each cell
(:func:`check_alerts`) are computed from it with no round trip.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as _dt
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping

from .._fs import atomic_write, locked, private_dir
from ..errors import ConfigError, LedgerError  # noqa: F401 (LedgerError: its old home)
from ..paths import data_dir
from .prices import (MAX_AMOUNT, MAX_SPAN_S, BudgetError, MeterReading, Prices, is_number, meter,
                     price_changes, seconds_to_midnight, spent)

if TYPE_CHECKING:
    from .guard import Clock

LEDGER_FORMAT = "gpumagic-ledger"
LEDGER_VERSION = 1
#: Two readings of the machine's start time closer than this (seconds) are the same rental.
SAME_START = 120


# -- records ------------------------------------------------------------------------------


@dataclass
class Rental:
    """One rental of a machine: billed from its start to the last time gpumagic saw it up.

    Attributes
    ----------
    start, last_seen : float
        Epoch seconds (laptop clock); ``last_seen`` may be ``None`` in a file written by hand.
    prices : Prices
        The prices when it was last seen.
    alerted : list of float
        Alert thresholds already shown for this rental.
    """

    start: float
    last_seen: float | None
    prices: Prices
    alerted: list = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict) -> "Rental":
        return cls(d["start"], d.get("last_seen"), Prices.from_dict(d["prices"]), list(d.get("alerted", [])))

    def to_dict(self) -> dict:
        return {"start": self.start, "last_seen": self.last_seen, "prices": self.prices.to_dict(),
                "alerted": list(self.alerted)}


@dataclass
class GuardRecord:
    """What the guard was last armed with from this computer (seconds; ``None``: off).

    Attributes
    ----------
    armed_at : float
        Epoch seconds (laptop clock).
    idle_s, limit_in, deadline_in, grace_s : float or None
        As :class:`gpumagic.budget.guard.GuardSettings`.
    """

    armed_at: float | None = None
    idle_s: float | None = None
    limit_in: float | None = None
    deadline_in: float | None = None
    grace_s: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GuardRecord":
        """A record from :meth:`to_dict`'s form (a key missing there is ``None``)."""
        return cls(**{f.name: d.get(f.name) for f in fields(cls)})


@dataclass
class MachineRecord:
    """One machine in the ledger.

    Attributes
    ----------
    prices : Prices or None
        ``None`` until ``%gpu budget set`` gives them.
    limit : float or None
        Spending limit (money).
    alerts : list of float
        Alert thresholds (money), ascending.
    started_at : float or None
        Billing start given by the user (epoch seconds); ``None``: the machine's start.
    guard : GuardRecord or None
        The guard armed from here (``None``: none, or disarmed).
    rentals : list of Rental
        Stored under the JSON key ``sessions``, as since the format's version 1.
    """

    prices: Prices | None = None
    limit: float | None = None
    alerts: list = field(default_factory=list)
    started_at: float | None = None
    guard: GuardRecord | None = None
    rentals: list = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict) -> "MachineRecord":
        """A record from its JSON form, checked by :func:`record_problem` first."""
        return cls(prices=Prices.from_dict(d["prices"]) if "prices" in d else None,
                   limit=d.get("limit"), alerts=list(d.get("alerts", [])), started_at=d.get("started_at"),
                   guard=GuardRecord.from_dict(d["guard"]) if d.get("guard") is not None else None,
                   rentals=[Rental.from_dict(s) for s in d.get("sessions", [])])

    def to_dict(self) -> dict:
        out = {} if self.prices is None else {"prices": self.prices.to_dict()}
        out.update(limit=self.limit, alerts=list(self.alerts), started_at=self.started_at,
                   guard=None if self.guard is None else self.guard.to_dict(),
                   sessions=[s.to_dict() for s in self.rentals])
        return out

    def billing_start(self, clock: "Clock", local_now: float) -> float:
        """When billing started, on the laptop's clock: the user's ``started_at``, else the
        machine's start read from the machine (shifted by the remote-laptop clock difference).

        Raises
        ------
        BudgetError
            When neither is known.
        """
        if self.started_at is not None:
            return float(self.started_at)
        if clock.started is None:
            raise BudgetError("could not read when the machine started",
                              "give it yourself: %gpu budget set --started-at HH:MM (or -2h)")
        return local_now - (clock.remote_now - clock.started)


def prices_of(rec: MachineRecord | None, name: str) -> Prices:
    """The prices of machine ``name``'s record.

    Raises
    ------
    BudgetError
        When none are set, saying how to set them.
    """
    if rec is None or rec.prices is None:
        raise BudgetError(f"no prices are set for {name}",
                          "run `%gpu budget set --rate PRICE_PER_HOUR` (add --platform autodl|vastai|runpod|lambda)")
    return rec.prices


def record_rental(rec: MachineRecord, start: float, now: float, prices: Prices) -> Rental:
    """Add or extend the rental that began at ``start`` (within :data:`SAME_START`
    seconds) in ``rec``, seen up at ``now`` with ``prices``; returns it."""
    for s in rec.rentals:
        if abs(float(s.start) - start) <= SAME_START:
            s.last_seen = max(float(s.last_seen or 0), now)
            s.prices = prices
            return s
    s = Rental(start, now, prices, [])
    rec.rentals.append(s)
    return s


# -- the file -----------------------------------------------------------------------------


def _empty() -> dict:
    return {"format": LEDGER_FORMAT, "version": LEDGER_VERSION, "machines": {}}


class Ledger:
    """The local record of machines' prices and rentals (JSON, one file).

    Parameters
    ----------
    path : path, optional
        The ledger file (default: ``data_dir() / "ledger.json"``).

    Attributes
    ----------
    notes : list of str
        Problems met and what was done (a corrupt file moved aside); the caller shows them.

    Format
    ------
    ``{"format": "gpumagic-ledger", "version": 1, "machines": {NAME: {"prices": {...},
    "limit": float|null, "alerts": [float], "started_at": float|null, "guard": {...}|null,
    "sessions": [{"start": epoch, "last_seen": epoch, "prices": {...}, "alerted": [float]}]}}}``:
    each machine is a :class:`MachineRecord`'s :meth:`~MachineRecord.to_dict`.
    """

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else data_dir() / "ledger.json"
        self.notes: list[str] = []

    def read(self) -> dict:
        """The ledger's content in its JSON form (see Format); a missing file is an empty ledger.

        A file that is not a valid ledger (truncated by a crash, edited by hand) is moved
        aside to ``ledger.json.corrupt-TIMESTAMP`` (kept as it was) and reported in
        :attr:`notes`; an empty ledger is returned in its place.  A valid ledger in which
        some machines' records are damaged (a field of the wrong type, see
        :func:`record_problem`) keeps every machine whose record is valid: a copy of the
        file as it was is kept as ``ledger.json.corrupt-TIMESTAMP``, the damaged records are
        left out of the file, and :attr:`notes` names each one, its field and the fix.

        Raises
        ------
        LedgerError
            When the file cannot be read at all (permissions) or was written by a newer
            gpumagic; nothing is moved or overwritten then.
        """
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return _empty()
        except OSError as e:
            raise LedgerError(f"cannot read the budget ledger {self.path}: {e.strerror}",
                              "fix its permissions, or set GPUMAGIC_DATA_DIR to another directory")
        try:
            data = json.loads(raw.decode("utf-8"))
            problem = _ledger_problem(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            problem = f"not valid JSON ({e})"
        except RecursionError:
            problem = "not valid JSON (nested deeper than Python's parser follows)"
        except ValueError as e:  # an integer of more than 4300 digits (sys.get_int_max_str_digits)
            problem = f"not valid JSON (a number in it is too long: {str(e).partition(';')[0]})"
        if problem is None:
            return self._drop_damaged(data, raw)
        if problem == "newer":
            raise LedgerError(f"the budget ledger {self.path} was written by a newer gpumagic "
                              f"(version {data.get('version')})", "upgrade gpumagic: pip install -U gpumagic")
        aside = self._aside()
        try:
            os.replace(self.path, aside)
        except OSError as e:
            raise LedgerError(f"the budget ledger {self.path} could not be read ({problem}) and could "
                              f"not be moved aside to {aside}: {e.strerror}",
                              "move it away yourself (it is kept as it is), then run the command again")
        self.notes.append(f"the budget ledger {self.path} could not be read ({problem}); it was kept "
                          f"as {aside} and a new ledger was started")
        return _empty()

    def _drop_damaged(self, data: dict, raw: bytes) -> dict:
        """``data`` without the machines whose record is damaged; the file as it was kept aside."""
        bad = {name: why for name, rec in data["machines"].items()
               if (why := record_problem(rec)) is not None}
        if not bad:
            return data
        aside = self._aside()
        for name in bad:
            del data["machines"][name]
        try:
            with open(aside, "xb") as f:  # a new file: never one that exists
                f.write(raw)
            atomic_write(self.path, json.dumps(data, indent=1, sort_keys=True) + "\n")
        except OSError as e:
            raise LedgerError(f"the budget ledger {self.path} has damaged records ({_listing(bad)}) and "
                              f"could not be repaired: {e.strerror or e} ({e.filename or aside})",
                              f"make {self.path.parent} writable, or set GPUMAGIC_DATA_DIR to "
                              "another directory") from None
        for name, why in bad.items():
            self.notes.append(f"the budget ledger {self.path}: the record of {name} was damaged ({why}) "
                              f"and was left out (the file as it was is kept as {aside}); set it again "
                              f"with `%gpu budget set --host {name} --rate PRICE_PER_HOUR`")
        return data

    def _unwritable(self, e: OSError) -> LedgerError:
        return LedgerError(f"cannot write the budget ledger {self.path}: {e.strerror or e} "
                           f"({e.filename or self.path.parent})",
                           f"make {self.path.parent} writable (chmod u+w), or set GPUMAGIC_DATA_DIR "
                           "to a writable directory")

    def _aside(self) -> Path:
        stamp = time.strftime("%Y%m%dT%H%M%S")
        candidate = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while candidate.exists():
            n += 1
            candidate = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
        return candidate

    @contextlib.contextmanager
    def update(self) -> Iterator[dict[str, MachineRecord]]:
        """Read the machines' records, let the caller change them (or add one), write them back
        atomically; under a file lock so two kernels never lose each other's update.  A record
        the caller left as it was is written back as it was read, byte for byte."""
        try:
            private_dir(self.path.parent)
        except OSError as e:
            raise self._unwritable(e) from None
        with _locked(self.path.with_name(self.path.name + ".lock"), self._unwritable):
            data = self.read()
            stored = data["machines"]
            machines = {name: MachineRecord.from_dict(rec) for name, rec in stored.items()}
            yield machines
            data["machines"] = {
                name: stored[name] if name in stored and MachineRecord.from_dict(stored[name]) == rec
                else rec.to_dict() for name, rec in machines.items()}
            try:
                atomic_write(self.path, json.dumps(data, indent=1, sort_keys=True) + "\n")
            except OSError as e:
                raise self._unwritable(e) from None

    def machines(self) -> dict[str, MachineRecord]:
        """Every machine's record, by name."""
        return {name: MachineRecord.from_dict(rec) for name, rec in self.read()["machines"].items()}

    def machine(self, name: str) -> MachineRecord | None:
        """The record of one machine, or ``None``."""
        rec = self.read()["machines"].get(name)
        return None if rec is None else MachineRecord.from_dict(rec)


def _ledger_problem(data) -> str | None:
    if not isinstance(data, dict) or data.get("format") != LEDGER_FORMAT:
        return "not a gpumagic ledger"
    if not isinstance(data.get("version"), int):
        return "no version"
    if data["version"] > LEDGER_VERSION:
        return "newer"
    if not isinstance(data.get("machines"), dict):
        return "no machines table"
    return None


def _listing(bad: dict) -> str:
    return "; ".join(f"{name}: {why}" for name, why in bad.items())


def _number_problem(field_name: str, v, lo: float = 0, hi: float = math.inf, *, optional: bool = False):
    if (v is None and optional) or is_number(v, lo, hi):
        return None
    return f"{field_name} is {_short(v)}, not a number from {lo:g} to {hi:g}"


def _short(v) -> str:
    """``repr(v)``, cut to about 40 characters (a number of 400 digits, a long text)."""
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text)} characters)"


def record_problem(rec) -> str | None:
    """What is wrong with one machine's ledger record (a field and why), or None when valid.

    The fields and their types are those of :class:`Ledger`'s format; epoch times must lie
    between 1970 and 5138 (what ``datetime`` can show).
    """
    if not isinstance(rec, dict):
        return f"the record is {type(rec).__name__}, not a table"
    if "prices" in rec:
        try:
            Prices.from_dict(rec["prices"])
        except ConfigError as e:
            return f"prices: {e.message}"
    epoch = 1e11
    for problem in (_number_problem("limit", rec.get("limit"), 0, MAX_AMOUNT, optional=True),
                    _number_problem("started_at", rec.get("started_at"), 0, epoch, optional=True)):
        if problem:
            return problem
    alerts = rec.get("alerts", [])
    if not isinstance(alerts, list) or not all(is_number(a, 0, MAX_AMOUNT) for a in alerts):
        return f"alerts is {alerts!r}, not a list of amounts"
    guard = rec.get("guard")
    if guard is not None and not (isinstance(guard, dict) and all(
            v is None or is_number(v, -epoch, epoch) for v in guard.values())):  # seconds, amounts
        return f"guard is {_short(guard)}, not a table of numbers"
    sessions = rec.get("sessions", [])
    if not isinstance(sessions, list):
        return f"sessions is {sessions!r}, not a list"
    for i, sess in enumerate(sessions):
        if not isinstance(sess, dict):
            return f"sessions[{i}] is {sess!r}, not a table"
        problem = (_number_problem(f"sessions[{i}].start", sess.get("start"), 0, epoch)
                   or _number_problem(f"sessions[{i}].last_seen", sess.get("last_seen"), 0, epoch, optional=True))
        if problem:
            return problem
        alerted = sess.get("alerted", [])
        if not isinstance(alerted, list) or not all(is_number(a) for a in alerted):
            return f"sessions[{i}].alerted is {alerted!r}, not a list of amounts"
        try:
            Prices.from_dict(sess.get("prices"))
        except ConfigError as e:
            return f"sessions[{i}].prices: {e.message}"
    return None


def _locked(lock_path: Path, unwritable=None):
    """The ledger's lock file ``lock_path``, held for the block (:func:`gpumagic._fs.locked`:
    flock on POSIX, msvcrt.locking on Windows), so two notebooks recording at once never lose
    a record."""
    return locked(lock_path, unwritable)



# -- changing and reading records ---------------------------------------------------------


def set_prices(ledger: Ledger, name: str, prices: Prices, *, limit: float | None = None,
               alerts: Iterable[float] | None = None, started_at: float | None = None) -> MachineRecord:
    """Store ``name``'s prices (and limit, alert thresholds, billing start) in the ledger.

    Options left ``None`` keep what was stored before.  Returns (a copy of) the machine's record.

    Raises
    ------
    ConfigError
        For a limit or alert that is not a positive finite amount (up to :data:`MAX_AMOUNT`),
        or a billing start that is not an epoch time within 10 years of now.
    """
    if limit is not None and not (is_number(limit, 0, MAX_AMOUNT) and limit > 0):
        raise ConfigError(f"the limit must be an amount above 0, not {limit!r}", "e.g. --limit 50")
    alerts = None if alerts is None else list(alerts)
    if alerts is not None and not all(is_number(a, 0, MAX_AMOUNT) and a > 0 for a in alerts):
        raise ConfigError(f"alerts must be amounts above 0, not {alerts!r}", "e.g. --alert 10,20")
    if started_at is not None and not is_number(started_at, time.time() - MAX_SPAN_S, time.time() + MAX_SPAN_S):
        raise ConfigError(f"the billing start must be an epoch time within 10 years, not {started_at!r}",
                          "e.g. --started-at -2h")
    with ledger.update() as machines:
        rec = machines.setdefault(name, MachineRecord())
        rec.prices = prices
        if limit is not None:
            rec.limit = limit
        if alerts is not None:
            rec.alerts = sorted(float(a) for a in alerts)
        if started_at is not None:
            rec.started_at = started_at
        return copy.deepcopy(rec)


def change_prices(ledger: Ledger, name: str, *, limit: float | None = None,
                  alerts: Iterable[float] | None = None, started_at: float | None = None,
                  **options) -> MachineRecord:
    """Change some of ``name``'s prices (what ``%gpu budget set`` does) and store them.

    ``options`` are ``%gpu budget set``'s price options (see
    :func:`gpumagic.budget.prices.price_changes`; ``None``: keep the stored value); the
    prices stored before are the base, or new prices when none are stored.  ``limit``,
    ``alerts`` and ``started_at`` as :func:`set_prices`.  Returns (a copy of) the record.

    Raises
    ------
    ValueError
        No prices stored yet and no ``rate`` given; a rate per month and per day.
    ConfigError
        An unknown platform preset, or a value out of range.
    """
    changes = price_changes(**options)
    old = ledger.machine(name)
    if old is not None and old.prices is not None:
        prices = replace(old.prices, **changes)
    elif "rate" in changes:
        prices = Prices(**changes)
    else:
        raise ValueError(f"no prices stored for {name} yet: give at least --rate PRICE_PER_HOUR")
    return set_prices(ledger, name, prices, limit=limit, alerts=alerts, started_at=started_at)


def check_alerts(ledger: Ledger, name: str, *, now: float | None = None) -> tuple[MeterReading | None, list[float]]:
    """Alert thresholds newly crossed by ``name``'s latest rental, computed locally (no round
    trip); each is returned once, then recorded as shown.  ``(None, [])`` without a rental."""
    local_now = time.time() if now is None else now
    rec = ledger.machine(name)
    if rec is None or not rec.alerts or not rec.rentals or rec.prices is None:
        return None, []
    with ledger.update() as machines:
        rec = machines[name]
        rental = max(rec.rentals, key=lambda s: float(s.start))
        reading = meter(name, rec.prices, float(rental.start), local_now, limit=rec.limit,
                        alerts=rec.alerts, alerted=rental.alerted)
        if reading.crossed:
            rental.alerted = sorted(set(rental.alerted) | set(reading.crossed))
    return reading, list(reading.crossed)


def history(machines: Mapping[str, MachineRecord], now: float) -> list[tuple[str, str, float, str]]:
    """Spending per machine and local day from the machines' rentals (:meth:`Ledger.machines`).

    A rental runs from its ``start`` to its ``last_seen`` (the last time gpumagic saw the
    machine up); its cost is :func:`gpumagic.budget.prices.spent` over that span, spread over
    the days it covers in proportion to time.  Returns ``(machine, "YYYY-MM-DD", cost,
    currency)`` rows, sorted.
    """
    totals: dict[tuple[str, str], float] = {}
    currencies: dict[str, str] = {}
    for name, rec in machines.items():
        for s in rec.rentals:
            start, end = float(s.start), float(s.last_seen or s.start)
            end = min(end, now)
            if end <= start:
                continue
            currencies[name] = s.prices.currency
            cost = spent(s.prices, end - start)
            t = start
            while t < end:
                day_end = t + seconds_to_midnight(t)
                piece = min(day_end, end) - t
                day = _dt.datetime.fromtimestamp(t).astimezone().strftime("%Y-%m-%d")
                totals[(name, day)] = totals.get((name, day), 0.0) + cost * piece / (end - start)
                t = min(day_end, end)
    return [(m, d, c, currencies.get(m, "")) for (m, d), c in sorted(totals.items())]


def note_last_seen(ledger: Ledger, name: str, at: float) -> bool:
    """``name`` was seen up at ``at`` (epoch s, laptop clock): its latest rental, begun before
    then, is extended to it (a machine lost after a meter reading is billed until it went).
    Returns whether a rental was extended."""
    rec = ledger.machine(name)
    if rec is None or not rec.rentals:
        return False
    with ledger.update() as machines:
        rental = max(machines[name].rentals, key=lambda s: float(s.start))
        if float(rental.start) <= at and float(rental.last_seen or 0) < at:
            rental.last_seen = at
            return True
    return False
