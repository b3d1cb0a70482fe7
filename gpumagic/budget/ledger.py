"""What a rented machine costs, alerts before it hurts, and a guard that stops paying for idle.

Three parts, each usable alone:

* **Price arithmetic** (pure functions over numbers; no I/O): :class:`Prices`,
  :func:`spent`, :func:`next_boundary_in`, :func:`limit_deadline`, :func:`meter`,
  :func:`new_alerts`, :func:`estimate`, :func:`history`.  Rates are money per hour; storage
  and image rates are money per GB per month (30 days) or per day, as the user states them.
  The currency is whatever the user's platform bills in: gpumagic never knows prices.
* **The ledger** (:class:`Ledger`): one JSON file in the user's data directory recording each
  machine's prices, thresholds and billing sessions.  Written with
  :func:`gpumagic._fs.atomic_write` under a lock; a file that cannot be read is reported,
  moved aside (kept, never overwritten) and a new one started.
* **The guard** (:func:`arm_guard`, :func:`guard_status`, :func:`cancel_guard`): a small POSIX
  ``sh`` loop started detached (``setsid nohup``) on the remote machine, so it works with
  the laptop closed.  It shuts the machine down at the budget limit, at a deadline, or after
  the GPU has been *measurably* idle for a given time (see :data:`GUARD_SCRIPT`).

What is billed how
------------------
The instance rate and the public-IP rate are billed in units of the platform's granularity
(``second``, ``minute`` or ``hour``; a started unit costs in full).  Storage and saved
images accrue continuously.  Spending starts when the instance started billing: by default
the machine's start as read from the machine (the start time of PID 1: the container's
start in a container, the boot in a VM), or a time the user gives.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import re
import shlex
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterable, Iterator

from .._fs import atomic_write, private_dir
from ..errors import ConfigError, GpumagicError

#: Seconds in one billing unit.
BILLING_UNITS = {"second": 1, "minute": 60, "hour": 3600}
#: Days in the "month" of a per-GB-month storage price (platforms quote 30-day months).
MONTH_DAYS = 30
#: How long before a minute/hour billing boundary the guard acts at the limit (seconds): a
#: shutdown takes a moment, and a started unit is billed in full.
BOUNDARY_LEAD = {"second": 0, "minute": 5, "hour": 60}
#: Largest price per hour (or per GB per month/day) and largest disk size in GB accepted: far
#: above any real price in any currency, and small enough that years of it stay exact floats.
MAX_RATE = 1e9
MAX_GB = 1e9
#: Largest amount of money (a limit, an alert threshold, a card price) accepted.
MAX_AMOUNT = 1e12
#: Durations and times given by the user lie within this many seconds of now (10 years).
MAX_SPAN_S = 10 * 365 * 86400


def is_number(v, lo: float = -math.inf, hi: float = math.inf) -> bool:
    """True for a finite ``int``/``float`` (never a bool) from ``lo`` to ``hi``."""
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and lo <= v <= hi)


class BudgetError(GpumagicError):
    """A budget cannot be computed or a guard cannot be armed (missing prices, no shutdown)."""


class LedgerError(GpumagicError):
    """The ledger file cannot be read or written."""


# -- prices -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prices:
    """One machine's prices.  Every number is given by the user; none is a known fact.

    Attributes
    ----------
    rate : float
        Instance (GPU) price per hour.
    currency : str
        Shown after amounts (``CNY``, ``USD``); no conversion is ever done.
    billing : str
        Billing granularity of the instance and IP: ``second``, ``minute`` or ``hour``.
    storage_gb, storage_rate, storage_per : float, float, str
        Extra disk: size in GB, price per GB per ``storage_per`` (``month`` or ``day``).
    image_gb, image_rate, image_per : float, float, str
        Saved images / snapshots, same units as storage.
    ip_rate : float
        Reserved public IP price per hour.
    platform : str
        Preset name the prices were entered with (see ``gpumagic/budget/platforms.json``).
    """

    rate: float
    currency: str = ""
    billing: str = "second"
    storage_gb: float = 0.0
    storage_rate: float = 0.0
    storage_per: str = "month"
    image_gb: float = 0.0
    image_rate: float = 0.0
    image_per: str = "month"
    ip_rate: float = 0.0
    platform: str = "generic"

    def __post_init__(self):
        for name in ("rate", "storage_gb", "storage_rate", "image_gb", "image_rate", "ip_rate"):
            v = getattr(self, name)
            top = MAX_GB if name.endswith("_gb") else MAX_RATE
            if not is_number(v, 0, top):
                raise ConfigError(f"{name} must be a number from 0 to {top:g}, not {v!r}",
                                  "give prices as plain numbers, e.g. --rate 2.5")
        for name in ("currency", "billing", "storage_per", "image_per", "platform"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be text, not {getattr(self, name)!r}",
                                  "e.g. --currency CNY --billing hour")
        if self.billing not in BILLING_UNITS:
            raise ConfigError(f"billing {self.billing!r} is not one of second, minute, hour",
                              "use --billing second|minute|hour (what the platform's terms say)")
        for name in ("storage_per", "image_per"):
            if getattr(self, name) not in ("month", "day"):
                raise ConfigError(f"{name} must be 'month' or 'day'", "state the price's unit")

    def per_hour(self) -> dict[str, float]:
        """Cost per hour of each part: ``instance``, ``ip``, ``storage``, ``image``."""
        return {"instance": self.rate, "ip": self.ip_rate,
                "storage": per_gb_rate_per_hour(self.storage_gb, self.storage_rate, self.storage_per),
                "image": per_gb_rate_per_hour(self.image_gb, self.image_rate, self.image_per)}

    @property
    def hourly(self) -> float:
        """Total cost per hour of everything this machine is billed for."""
        return sum(self.per_hour().values())

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Prices":
        """Prices from :meth:`to_dict`'s form (unknown keys ignored).

        Raises
        ------
        ConfigError
            Naming the field that is missing or of the wrong type.
        """
        if not isinstance(d, dict):
            raise ConfigError(f"prices must be a table, not {d!r}", "set them again with `%gpu budget set`")
        if "rate" not in d:
            raise ConfigError("prices have no rate", "set it with `%gpu budget set --rate PRICE_PER_HOUR`")
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)

    def money(self, amount: float) -> str:
        """``amount`` with two decimals (four below 1) and the currency."""
        return money(amount, self.currency)


def money(amount: float, currency: str = "") -> str:
    text = f"{amount:,.4f}" if 0 < abs(amount) < 1 else f"{amount:,.2f}"
    return f"{text} {currency}".rstrip()


def per_gb_rate_per_hour(gb: float, rate: float, per: str = "month") -> float:
    """Hourly cost of ``gb`` GB priced at ``rate`` per GB per ``per`` (``month`` = 30 days).

    >>> round(per_gb_rate_per_hour(100, 0.3, "month"), 4)
    0.0417
    """
    hours = MONTH_DAYS * 24 if per == "month" else 24
    return gb * rate / hours


def billed_units(elapsed_s: float, billing: str) -> int:
    """Number of billing units started after ``elapsed_s`` seconds (a started unit counts)."""
    if elapsed_s <= 0:
        return 0
    unit = BILLING_UNITS[billing]
    return math.ceil(round(elapsed_s / unit, 9))  # 3600.0000000001 s is still one hour


def spent(prices: Prices, elapsed_s: float) -> float:
    """Money spent ``elapsed_s`` seconds after billing started.

    Instance and IP in started units of ``prices.billing``; storage and image pro rata.
    """
    if elapsed_s <= 0:
        return 0.0
    parts = prices.per_hour()
    stepped = parts["instance"] + parts["ip"]
    units = billed_units(elapsed_s, prices.billing) * BILLING_UNITS[prices.billing]
    return stepped * units / 3600 + (parts["storage"] + parts["image"]) * elapsed_s / 3600


def next_boundary_in(elapsed_s: float, billing: str) -> float:
    """Seconds until the next billing unit starts (stopping before then costs no more)."""
    unit = BILLING_UNITS[billing]
    return billed_units(elapsed_s, billing) * unit - elapsed_s if elapsed_s > 0 else unit


def limit_deadline(prices: Prices, limit: float) -> float | None:
    """The latest moment (seconds after billing started) at which spending is within ``limit``.

    Returns ``None`` when nothing is billed (a zero rate never reaches a limit).  With minute
    or hour billing this is the end of the last unit that fits: stopping later starts a unit
    that crosses the limit.
    """
    if prices.hourly <= 0:
        return None
    if spent(prices, 1) > limit:
        return 0.0
    lo, hi = 1, 3600
    while spent(prices, hi) <= limit:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # spent is non-decreasing in whole seconds: bisect to the second
        mid = (lo + hi) // 2
        if spent(prices, mid) <= limit:
            lo = mid
        else:
            hi = mid
    return float(lo)


# -- the meter ----------------------------------------------------------------------------


@dataclass(frozen=True)
class MeterReading:
    """Everything ``%gpu budget`` shows, computed by :func:`meter` (amounts in ``currency``).

    Attributes
    ----------
    machine : str
    prices : Prices
    started_at, now : float
        Epoch seconds (laptop clock).
    spent : float
        Money spent since ``started_at``.
    per_hour : float
        Current cost per hour (all parts).
    breakdown : dict
        Cost per hour of each part (see :meth:`Prices.per_hour`).
    next_boundary_s : float or None
        Seconds until the next started unit (minute/hour billing only).
    limit : float or None
    limit_in_s : float or None
        Seconds until the limit must be reached by stopping (``0`` when reached).
    rest_of_today : float
        What staying on costs from now to local midnight.
    alerts : tuple of float
        Thresholds set.
    crossed : tuple of float
        Thresholds crossed by this reading that had not alerted before, ascending.
    guard : GuardStatus or None
    """

    machine: str
    prices: Prices
    started_at: float
    now: float
    spent: float
    per_hour: float
    breakdown: dict
    next_boundary_s: float | None
    limit: float | None
    limit_in_s: float | None
    rest_of_today: float
    alerts: tuple = ()
    crossed: tuple = ()
    guard: "GuardStatus | None" = None

    @property
    def elapsed_s(self) -> float:
        return max(0.0, self.now - self.started_at)


def seconds_to_midnight(now: float) -> float:
    """Seconds from epoch ``now`` to the next local midnight (laptop time zone)."""
    local = _dt.datetime.fromtimestamp(now).astimezone()
    midnight = (local + _dt.timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return midnight.timestamp() - now


def meter(machine: str, prices: Prices, started_at: float, now: float, *,
          limit: float | None = None, alerts: Iterable[float] = (),
          alerted: Iterable[float] = (), guard: "GuardStatus | None" = None) -> MeterReading:
    """Read the meter at epoch ``now`` for billing that started at epoch ``started_at``."""
    elapsed = max(0.0, now - started_at)
    cost = spent(prices, elapsed)
    boundary = None if prices.billing == "second" else next_boundary_in(elapsed, prices.billing)
    limit_in = None
    if limit is not None:
        dl = limit_deadline(prices, limit)
        limit_in = None if dl is None else max(0.0, dl - elapsed)
    today = spent(prices, elapsed + seconds_to_midnight(now)) - cost
    alerts = tuple(sorted(set(float(a) for a in alerts)))
    return MeterReading(machine=machine, prices=prices, started_at=started_at, now=now,
                        spent=cost, per_hour=prices.hourly, breakdown=prices.per_hour(),
                        next_boundary_s=boundary, limit=limit, limit_in_s=limit_in,
                        rest_of_today=today, alerts=alerts,
                        crossed=tuple(new_alerts(alerts, alerted, cost)), guard=guard)


def new_alerts(thresholds: Iterable[float], alerted: Iterable[float], spent_now: float) -> list[float]:
    """Thresholds reached by ``spent_now`` that have not alerted yet, ascending.

    Each threshold alerts once: the caller adds the returned ones to ``alerted``.
    """
    done = {float(a) for a in alerted}
    return sorted(t for t in {float(x) for x in thresholds} if t <= spent_now and t not in done)


# -- estimates ----------------------------------------------------------------------------


@dataclass(frozen=True)
class EstimateRow:
    label: str
    cost: float | None
    note: str = ""


def estimate(hours: float, rate: float, *, spot_rate: float | None = None,
             extra_per_hour: float = 0.0, card_price: float | None = None,
             power_w: float | None = None, kwh_price: float | None = None,
             resale: float = 0.0) -> list[EstimateRow]:
    """What ``hours`` of GPU time cost on-demand, on spot, and when buying the card instead.

    Parameters
    ----------
    hours : float
        Planned GPU hours.
    rate, spot_rate : float
        On-demand and spot/preemptible price per hour.
    extra_per_hour : float
        Storage, IP and image cost per hour (added to both rental rows).
    card_price, power_w, kwh_price, resale : float
        Buying instead: card price, its power draw in watts, electricity per kWh, and what
        the card sells for afterwards.

    Returns
    -------
    list of EstimateRow
        One row per option, plus the break-even hours of buying vs renting on-demand.
    """
    numbers = (rate, spot_rate, extra_per_hour, card_price, power_w, kwh_price, resale)
    if not (is_number(hours, 0, 1e7) and hours > 0) or not all(
            v is None or is_number(v, 0, MAX_AMOUNT) for v in numbers):
        raise ConfigError("hours must be > 0 and prices finite numbers >= 0",
                          "e.g. %gpu budget estimate --hours 200 --rate 2.5")
    rows = [EstimateRow("on-demand", hours * (rate + extra_per_hour),
                        f"{hours:g} h x {rate + extra_per_hour:g}/h")]
    if spot_rate is not None:
        saved = 1 - (spot_rate + extra_per_hour) / (rate + extra_per_hour) if rate + extra_per_hour else 0
        rows.append(EstimateRow("spot / preemptible", hours * (spot_rate + extra_per_hour),
                                f"{saved:.0%} less; may be interrupted: checkpoint often"))
    if card_price is not None:
        energy = (power_w or 0) / 1000 * hours * (kwh_price or 0)
        rows.append(EstimateRow("buy the card", card_price - resale + energy,
                                f"{card_price:g} - resale {resale:g} + power {energy:.2f}"))
        per_hour_own = (power_w or 0) / 1000 * (kwh_price or 0)
        if rate + extra_per_hour > per_hour_own:
            even = (card_price - resale) / (rate + extra_per_hour - per_hour_own)
            rows.append(EstimateRow("break-even", None, f"buying pays off after {even:,.0f} GPU hours"))
        else:
            rows.append(EstimateRow("break-even", None, "renting costs less per hour than the power: never"))
    return rows


# -- history ------------------------------------------------------------------------------


def history(ledger_data: dict, now: float) -> list[tuple[str, str, float, str]]:
    """Spending per machine and local day from the ledger's sessions.

    A session runs from its ``start`` to its ``last_seen`` (the last time gpumagic saw the
    machine up); its cost is :func:`spent` over that span, spread over the days it covers in
    proportion to time.  Returns ``(machine, "YYYY-MM-DD", cost, currency)`` rows, sorted.
    """
    totals: dict[tuple[str, str], float] = {}
    currencies: dict[str, str] = {}
    for name, rec in ledger_data.get("machines", {}).items():
        for s in rec.get("sessions", []):
            try:
                prices = Prices.from_dict(s["prices"])
                start, end = float(s["start"]), float(s.get("last_seen") or s["start"])
            except (KeyError, TypeError, ValueError, ConfigError):
                continue
            end = min(end, now)
            if end <= start:
                continue
            currencies[name] = prices.currency
            cost = spent(prices, end - start)
            t = start
            while t < end:
                day_end = t + seconds_to_midnight(t)
                piece = min(day_end, end) - t
                day = _dt.datetime.fromtimestamp(t).astimezone().strftime("%Y-%m-%d")
                totals[(name, day)] = totals.get((name, day), 0.0) + cost * piece / (end - start)
                t = min(day_end, end)
    return [(m, d, c, currencies.get(m, "")) for (m, d), c in sorted(totals.items())]


# -- parsing user input -------------------------------------------------------------------

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])", re.ASCII)
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``"30m"``, ``"2h"``, ``"1h30m"``, ``"90s"``, ``"1d"`` -> seconds.

    Raises
    ------
    ValueError
        Naming the accepted forms.
    """
    s = text.strip().lower().replace(" ", "")
    if not s or _DURATION.sub("", s):
        raise ValueError(f"cannot read the duration {text!r}: write it like 30m, 2h, 1h30m, 90s or 1d")
    seconds = float(sum(float(n) * _UNITS[u] for n, u in _DURATION.findall(s)))
    if not seconds <= MAX_SPAN_S:
        raise ValueError(f"the duration {text!r} is longer than 10 years: write it like 30m, 2h or 1d")
    return seconds


def parse_time(text: str, now: float, *, future: bool) -> float:
    """A moment given by the user -> epoch seconds (laptop's local time zone).

    Accepts ``now``; ``HH:MM`` (the next such time if ``future``, else the last);
    ``-2h`` / ``2h ago`` (past) or ``+2h`` / ``in 2h`` (future); ISO 8601
    (``2026-11-29T20:00``, with or without offset).

    Raises
    ------
    ValueError
        For text in none of these forms, and for a time more than 10 years from ``now``.
    """
    at = _parse_time(text, now, future=future)
    if not abs(at - now) <= MAX_SPAN_S:
        raise ValueError(f"the time {text!r} is more than 10 years from now: write HH:MM, "
                         f"{'+2h' if future else '-2h'} or a date within that")
    return at


def _parse_time(text: str, now: float, *, future: bool) -> float:
    s = text.strip()
    low = s.lower()
    if low == "now":
        return now
    m = re.fullmatch(r"(\d{1,2}):(\d{2})", s, re.ASCII)
    if m:
        if int(m[1]) > 23 or int(m[2]) > 59:
            raise ValueError(f"cannot read the time {text!r}: HH:MM runs from 00:00 to 23:59")
        local = _dt.datetime.fromtimestamp(now).astimezone()
        at = local.replace(hour=int(m[1]), minute=int(m[2]), second=0, microsecond=0)
        if future and at.timestamp() <= now:
            at += _dt.timedelta(days=1)
        if not future and at.timestamp() > now:
            at -= _dt.timedelta(days=1)
        return at.timestamp()
    for prefix, sign in (("+", 1), ("in ", 1), ("-", -1)):
        if low.startswith(prefix):
            return now + sign * parse_duration(low[len(prefix):])
    if low.endswith(" ago"):
        return now - parse_duration(low[:-4])
    try:
        at = _dt.datetime.fromisoformat(s)
        if at.tzinfo is None:
            at = at.astimezone()
        return at.timestamp()
    except (ValueError, OverflowError, OSError):  # OverflowError, OSError: year 1 or 9999 in some zones
        raise ValueError(f"cannot read the time {text!r}: write HH:MM, 2026-11-29T20:00, "
                         f"{'+2h' if future else '-2h'} or now") from None


def parse_amounts(text: str) -> list[float]:
    """``"10,20"`` -> ``[10.0, 20.0]`` (alert thresholds).

    Raises
    ------
    ValueError
    """
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"cannot read amounts {text!r}: write them like 10,20") from None
    if not values or not all(is_number(v, 0, MAX_AMOUNT) and v > 0 for v in values):
        raise ValueError(f"amounts must be positive numbers up to {MAX_AMOUNT:g}, like 10,20 (got {text!r})")
    return sorted(values)


# -- platform presets ---------------------------------------------------------------------


def platforms() -> dict[str, dict]:
    """The presets in ``gpumagic/budget/platforms.json`` (billing, data disk, how to stop)."""
    path = Path(__file__).parent / "platforms.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    return {k: v for k, v in data.items() if not k.startswith("_")}


def platform(name: str) -> dict:
    """One preset by name.

    Raises
    ------
    ConfigError
        Naming the presets that exist.
    """
    presets = platforms()
    try:
        return presets[name.lower()]
    except KeyError:
        raise ConfigError(f"no platform preset {name!r}",
                          f"use one of {', '.join(sorted(presets))}, or give --billing yourself") from None


# -- the ledger ---------------------------------------------------------------------------

LEDGER_FORMAT = "gpumagic-ledger"
LEDGER_VERSION = 1
#: Two readings of the machine's start time closer than this (seconds) are the same session.
SAME_START = 120


def data_dir() -> Path:
    """Where gpumagic keeps local data: ``$GPUMAGIC_DATA_DIR``, else platformdirs' user data dir."""
    env = os.environ.get("GPUMAGIC_DATA_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("gpumagic", appauthor=False))


def _empty() -> dict:
    return {"format": LEDGER_FORMAT, "version": LEDGER_VERSION, "machines": {}}


class Ledger:
    """The local record of machines' prices and billing sessions (JSON, one file).

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
    "sessions": [{"start": epoch, "last_seen": epoch, "prices": {...}, "alerted": [float]}]}}}``
    """

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else data_dir() / "ledger.json"
        self.notes: list[str] = []

    def read(self) -> dict:
        """The ledger's content; a missing file is an empty ledger.

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
    def update(self) -> Iterator[dict]:
        """Read, let the caller change the dict, write it back atomically; under a file lock
        so two kernels never lose each other's update."""
        try:
            private_dir(self.path.parent)
        except OSError as e:
            raise self._unwritable(e) from None
        with _locked(self.path.with_name(self.path.name + ".lock"), self._unwritable):
            data = self.read()
            yield data
            try:
                atomic_write(self.path, json.dumps(data, indent=1, sort_keys=True) + "\n")
            except OSError as e:
                raise self._unwritable(e) from None

    def machine(self, name: str) -> dict | None:
        """The record of one machine, or ``None``."""
        return self.read()["machines"].get(name)


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
    return f"{field_name} is {v!r}, not a number from {lo:g} to {hi:g}"


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
            v is None or is_number(v) for v in guard.values())):
        return f"guard is {guard!r}, not a table of numbers"
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


@contextlib.contextmanager
def _locked(lock_path: Path, unwritable=None):
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; atomic_write still prevents torn files
        yield
        return
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        if unwritable is None:
            raise
        raise unwritable(e) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def record_session(rec: dict, start: float, now: float, prices: Prices) -> dict:
    """Add or extend the billing session that began at ``start`` in machine record ``rec``.

    Returns the session dict (``start``, ``last_seen``, ``prices``, ``alerted``).
    """
    sessions = rec.setdefault("sessions", [])
    for s in sessions:
        if abs(float(s.get("start", 0)) - start) <= SAME_START:
            s["last_seen"] = max(float(s.get("last_seen") or 0), now)
            s["prices"] = prices.to_dict()
            return s
    s = {"start": start, "last_seen": now, "prices": prices.to_dict(), "alerted": []}
    sessions.append(s)
    return s


# -- reading the machine ------------------------------------------------------------------

#: One round trip: the remote clock, when the machine (PID 1) started, and the guard's state.
#: /proc/stat ``btime`` is the kernel's boot (epoch s); /proc/1/stat field 22 is PID 1's start
#: in clock ticks after boot (proc(5)); the comm field before it may hold spaces, so the text
#: up to the last ")" is cut first.
STATUS_PROBE = r"""
printf 'clock %s %s %s %s\n' "$(date +%s)" "$(awk '/^btime/{print $2}' /proc/stat 2>/dev/null)" \
  "$(sed 's/.*) //' /proc/1/stat 2>/dev/null | awk '{print $20}')" "$(getconf CLK_TCK 2>/dev/null)"
d=@GUARD_DIR@
if [ -f "$d/state" ]; then
  echo "guard-state"; cat "$d/state"; echo "guard-end"
  p=$(cat "$d/pid" 2>/dev/null)
  case "$p" in ''|*[!0-9]*) echo "guard-alive 0" ;;
    *) if kill -0 "$p" 2>/dev/null && grep -q gpumagic-guard "/proc/$p/cmdline" 2>/dev/null; then
         echo "guard-alive 1"; else echo "guard-alive 0"; fi ;;
  esac
  if [ -f "$d/alert" ]; then echo "guard-alert $(cat "$d/alert")"; fi
  echo "guard-log"; tail -n 5 "$d/log" 2>/dev/null
fi
"""


@dataclass(frozen=True)
class Clock:
    """The remote clock and when the machine started (epoch seconds, remote clock)."""

    remote_now: float
    started: float | None


def parse_clock(line: str) -> Clock:
    """Parse the ``clock NOW BTIME STARTTICKS CLK_TCK`` line of :data:`STATUS_PROBE`."""
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
    """What the remote guard reports (see :data:`GUARD_SCRIPT` for the state file).

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
    """Parse the output of :data:`STATUS_PROBE`."""
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

#: The guard, run on the remote as ``sh guard.sh run DIR`` (detached) or ``sh guard.sh
#: measure``.  gpumagic prepends the settings as shell assignments.
#:
#: Measured idle: ``nvidia-smi --query-gpu=utilization.gpu,memory.used`` and
#: ``--query-compute-apps=pid,used_memory`` (``--format=csv,noheader,nounits``, field names
#: from ``nvidia-smi --help-query-gpu`` / ``--help-query-compute-apps``) both succeed, every
#: value is a plain number, every GPU's utilisation is below IDLE_UTIL %, GPU memory not held
#: by a visible process is at most BUSY_MEM_MIB (memory used by processes we cannot see, e.g.
#: another container's, means busy), and no gpumagic job runs (a job runs iff its
#: ``~/.gpumagic/jobs/NAME/exit_code`` is absent and ``kill -0 $(cat pid)`` succeeds).
#: Anything else -- nvidia-smi failing, ``[N/A]``, no GPU listed, one GPU of several lost --
#: is *not* idle.  Exit status 14 ("infoROM is corrupted", nvidia-smi(1)) with valid rows is
#: measured like 0: the warning line it prints is skipped.
#:
#: State file ``DIR/state`` (key=value lines, replaced atomically each poll): state, since,
#: checked, checks, fire_at, reason, idle, and the settings.  ``DIR/alert`` holds the warning
#: while a shutdown is pending; ``DIR/log`` the history.
GUARD_SCRIPT = r"""
# gpumagic-guard: shuts this machine down at a budget limit, a deadline, or after the GPU
# has been idle; armed and cancelled by gpumagic (%gpu budget guard).
PATH="$PATH:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin:/usr/local/nvidia/bin"

# why nvidia-smi failed: its first line that is not a row, and its exit status
smi_failed() {
  printf '%s (exit status %s)\n' "$(printf '%s\n' "$2" | grep -v -E '^[0-9., ]*$' | grep -v '^WARNING: infoROM' | head -n 1)" "$1"
}

measure() {
  # Exit status 14 means "infoROM is corrupted" (nvidia-smi(1)): a warning printed beside
  # valid rows.  Any other non-zero status is a failure (a GPU of several lost: not idle).
  gpu=$(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits 2>&1); rc=$?
  if [ "$rc" != 0 ] && [ "$rc" != 14 ]; then
    echo "unknown nvidia-smi failed: $(smi_failed "$rc" "$gpu")"; return
  fi
  apps=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>&1); rc=$?
  if [ "$rc" != 0 ] && [ "$rc" != 14 ]; then
    echo "unknown nvidia-smi --query-compute-apps failed: $(smi_failed "$rc" "$apps")"; return
  fi
  for d in "$JOBS_DIR"/*/; do
    [ -f "${d}pid" ] || continue
    [ -e "${d}exit_code" ] && continue
    p=$(cat "${d}pid" 2>/dev/null)
    case "$p" in ''|*[!0-9]*) continue ;; esac
    # a zombie (exited, never reaped: containers without an init) still answers kill -0,
    # but its cmdline is empty
    if kill -0 "$p" 2>/dev/null && { [ ! -d "/proc/$p" ] || [ -n "$(tr -d '\000' < "/proc/$p/cmdline" 2>/dev/null)" ]; }; then
      echo "busy gpumagic job $(basename "$d") is running (pid $p)"; return
    fi
  done
  # a live Python session (%gpu kernel) executing a cell: its keeper keeps a `busy` file
  # while a cell runs (see gpumagic/remote/programs/kernel_keeper.py)
  for d in "${JOBS_DIR%/jobs}/kernels"/*/; do
    [ -f "${d}busy" ] || continue
    p=$(sed -n 's/.*"keeper_pid": *\([0-9][0-9]*\).*/\1/p' "${d}state.json" 2>/dev/null)
    case "$p" in ''|*[!0-9]*) continue ;; esac
    if kill -0 "$p" 2>/dev/null && { [ ! -d "/proc/$p" ] || tr '\000' ' ' < "/proc/$p/cmdline" 2>/dev/null | grep -q kernel_keeper; }; then
      echo "busy gpumagic kernel $(basename "$d") is executing a cell"; return
    fi
  done
  printf '%s\n--\n%s\n' "$gpu" "$apps" | awk -F', *' -v thr="$IDLE_UTIL" -v slack="$BUSY_MEM_MIB" '
    function num(s) { gsub(/^[ \t]+|[ \t]+$/, "", s); return s ~ /^[0-9]+(\.[0-9]+)?$/ }
    BEGIN { part = 0; n = 0; used = 0; maxu = 0; apps = 0; appmem = 0; appunk = 0; bad = "" }
    /^--$/ { part = 1; next }
    /^[ \t]*$/ { next }
    /^WARNING: infoROM is corrupted/ { next }
    part == 0 {
      if (NF != 2 || !num($1) || !num($2)) { if (bad == "") bad = $0; next }
      n++; if ($1 + 0 > maxu) maxu = $1 + 0; used += $2
      next
    }
    { apps++; if (NF >= 2 && num($2)) appmem += $2; else appunk = 1 }
    END {
      if (bad != "") { print "unknown unreadable nvidia-smi value: " bad; exit }
      if (n == 0) { print "unknown nvidia-smi listed no GPU"; exit }
      why = ""
      if (!appunk && used - appmem > slack)
        why = sprintf("%d MiB of GPU memory in use by no visible process", used - appmem)
      if (maxu >= thr)
        why = (why == "" ? "" : why "; ") sprintf("GPU utilisation %d%% (idle below %d%%)", maxu, thr)
      if (why != "") { print "busy " why; exit }
      printf "idle GPU utilisation %d%%, %d MiB used, %d visible process(es)\n", maxu, used, apps
    }'
}

log() { printf '%s %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$*" >> "$dir/log"; }

put_state() {
  {
    echo "state=$1"; echo "since=$start"; echo "checked=$now"; echo "checks=$checks"
    echo "fire_at=$fire_at"; echo "reason=$why"; echo "idle=$m"
    echo "idle_s=$IDLE_S"; echo "limit_in=$LIMIT_IN"; echo "deadline_in=$DEADLINE_IN"
    echo "grace_s=$GRACE_S"; echo "poll_s=$POLL_S"
  } > "$dir/state.tmp" && mv -f "$dir/state.tmp" "$dir/state"
}

run() {
  dir=$1
  echo $$ > "$dir/pid"
  start=$(date +%s); now=$start; checks=0; fire_at=""; why=""; m=""; idle_since=""; warned=""
  limit_at=""; [ -n "$LIMIT_IN" ] && limit_at=$((start + LIMIT_IN))
  deadline_at=""; [ -n "$DEADLINE_IN" ] && deadline_at=$((start + DEADLINE_IN))
  trap 'log "guard cancelled"; put_state cancelled; rm -f "$dir/alert" "$dir/pid"; exit 0' TERM INT
  armed=""  # only the triggers set: "idle=1800s deadline_in=3s", never "idle=-s"
  [ -n "$IDLE_S" ] && armed="$armed idle=${IDLE_S}s"
  [ -n "$LIMIT_IN" ] && armed="$armed limit_in=${LIMIT_IN}s"
  [ -n "$DEADLINE_IN" ] && armed="$armed deadline_in=${DEADLINE_IN}s"
  log "guard armed:${armed} grace=${GRACE_S}s poll=${POLL_S}s; shutdown: $SHUTDOWN_CMD"
  while :; do
    # stop if disarmed behind our back: directory removed, or another guard took over
    [ -d "$dir" ] || exit 0
    [ "$(cat "$dir/pid" 2>/dev/null)" = "$$" ] || { log "replaced by another guard"; exit 0; }
    now=$(date +%s); fire_at=""; why=""
    if [ -n "$limit_at" ]; then fire_at=$limit_at; why="budget limit reached"; fi
    if [ -n "$deadline_at" ] && { [ -z "$fire_at" ] || [ "$deadline_at" -lt "$fire_at" ]; }; then
      fire_at=$deadline_at; why="deadline reached"
    fi
    if [ -n "$IDLE_S" ]; then
      m=$(measure); checks=$((checks + 1))
      case "$m" in
        idle*) if [ -z "$idle_since" ]; then idle_since=$now; log "GPU idle: ${m#idle }"; fi ;;
        *) if [ -n "$idle_since" ] || [ "$checks" = 1 ]; then log "not idle: $m"; fi; idle_since="" ;;
      esac
      if [ -n "$idle_since" ]; then
        t=$((idle_since + IDLE_S))
        if [ -z "$fire_at" ] || [ "$t" -lt "$fire_at" ]; then fire_at=$t; why="GPU idle for ${IDLE_S}s"; fi
      fi
    fi
    if [ -n "$fire_at" ] && [ "$now" -ge $((fire_at - GRACE_S)) ]; then
      if [ "$warned" != "$fire_at" ]; then
        msg="shutting down in $((fire_at - now))s ($why); cancel with: %gpu budget guard --cancel"
        log "WARNING: $msg"; printf '%s\n' "$msg" > "$dir/alert"; warned=$fire_at
      fi
    elif [ -n "$warned" ]; then
      log "shutdown withdrawn: $m"; rm -f "$dir/alert"; warned=""
    fi
    if [ -n "$fire_at" ] && [ "$now" -ge "$fire_at" ]; then
      log "SHUTDOWN: $why; running: $SHUTDOWN_CMD"
      put_state firing
      sh -c "$SHUTDOWN_CMD" >> "$dir/log" 2>&1; rc=$?
      if [ "$rc" = 0 ]; then log "shutdown command succeeded"; put_state fired
      else log "shutdown command FAILED with exit code $rc"; put_state failed
        printf 'the guard could not shut down (exit code %s): stop the instance yourself\n' "$rc" > "$dir/alert"
      fi
      rm -f "$dir/pid"; exit 0
    fi
    put_state armed
    n=$POLL_S
    if [ -n "$fire_at" ] && [ $((fire_at - now)) -lt "$n" ]; then n=$((fire_at - now)); fi
    [ "$n" -ge 1 ] || n=1
    sleep "$n"
  done
}

case "$1" in
  run) run "$2" ;;
  measure) measure ;;
  *) echo "usage: guard.sh run DIR | guard.sh measure" >&2; exit 2 ;;
esac
"""

#: Where the guard lives on the remote (relative to $HOME).
GUARD_DIR = ".gpumagic/guard"


def guard_dir(machine) -> str:
    """The guard's directory on ``machine`` as a shell word: ``"$HOME/.gpumagic/guard"``, or on
    the sandbox (which is this computer) a folder inside the sandbox's temporary directory:
    the guard exits when its directory goes, so it ends with the sandbox instead of running
    on in the kept sandbox home."""
    sandbox = getattr(machine, "sandbox", None)
    if sandbox is not None:
        return shlex.quote(str(Path(sandbox.server.dir) / "guard"))
    return f'"$HOME/{GUARD_DIR}"'


def guard_log_path(machine) -> str:
    """Where the guard's log is on ``machine``, for messages."""
    sandbox = getattr(machine, "sandbox", None)
    return str(Path(sandbox.server.dir) / "guard" / "log") if sandbox is not None else f"~/{GUARD_DIR}/log"


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
        Warn (log + notebook alert) this long before acting.
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


def guard_script(settings: GuardSettings, shutdown_cmd: str, jobs_dir: str = "$HOME/.gpumagic/jobs") -> str:
    """The guard script with ``settings`` prepended as shell assignments (quoted)."""

    def opt(v):
        return "" if v is None else str(int(math.ceil(v)))

    head = {
        "IDLE_S": opt(settings.idle_s), "LIMIT_IN": opt(settings.limit_in),
        "DEADLINE_IN": opt(settings.deadline_in), "GRACE_S": opt(settings.grace_s),
        "POLL_S": opt(settings.poll_s), "IDLE_UTIL": f"{settings.idle_util:g}",
        "BUSY_MEM_MIB": opt(settings.busy_mem_mib), "SHUTDOWN_CMD": shutdown_cmd,
    }
    lines = ["#!/bin/sh"] + [f"{k}={shlex.quote(v)}" for k, v in head.items()]
    lines.append(f'JOBS_DIR="{jobs_dir}"' if jobs_dir.startswith("$HOME/")
                 else f"JOBS_DIR={shlex.quote(jobs_dir)}")
    return "\n".join(lines) + "\n" + GUARD_SCRIPT.lstrip("\n")


def _launch_script(script: str, gdir: str = f'"$HOME/{GUARD_DIR}"') -> str:
    """The ``sh`` program that installs ``script`` and starts it (fed to ``sh -s``)."""
    if "\nGPUMAGIC_GUARD_EOF\n" in script:
        raise ValueError("the guard script contains its own here-document delimiter")
    # Stop a previous guard (its whole process group: the loop and its sleep), then start the
    # new one in its own session with no terminal, stdio on /dev/null: it outlives this SSH
    # connection and the laptop.  The script's path names it for `kill` checks.
    return (f'd={gdir}\n'
            'umask 077\n'  # the guard's directory and files are private (0700/0600)
            f'mkdir -p "$d" && chmod 700 "$d" || exit 1\n'
            f"cat > \"$d/gpumagic-guard.sh.tmp\" <<'GPUMAGIC_GUARD_EOF' || exit 1\n"
            f"{script.rstrip()}\nGPUMAGIC_GUARD_EOF\n"
            f'mv -f "$d/gpumagic-guard.sh.tmp" "$d/gpumagic-guard.sh" || exit 1\n'
            f'{_STOP}\n'
            f'rm -f "$d/state" "$d/alert" || exit 1\n'
            f'if command -v setsid >/dev/null 2>&1; then s=setsid; else s=; fi\n'
            f'cd / || exit 1\n'
            # a simple command with all three fds redirected: nothing keeps the SSH channel open
            f'$s nohup sh "$d/gpumagic-guard.sh" run "$d" >/dev/null 2>&1 </dev/null &\n')


def _sh(machine, program: str):
    """Run a POSIX ``sh`` program on ``machine`` whatever its login shell is (bash, zsh, fish,
    csh): the program travels on stdin to ``sh -s``, so no shell quoting is involved."""
    return machine.exec("sh -s", stdin=program.encode())


# A guard is gone once its /proc/PID/cmdline no longer names it: an exited process whose
# parent never reaps it (a container whose PID 1 is not an init) stays a zombie, and a zombie
# still answers `kill -0` (its cmdline is empty).
_STOP = ('p=$(cat "$d/pid" 2>/dev/null); case "$p" in ""|*[!0-9]*) ;; *) '
         'if grep -q gpumagic-guard "/proc/$p/cmdline" 2>/dev/null; then '
         'kill -TERM -"$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null; '
         'i=0; while [ $i -lt 50 ] && grep -q gpumagic-guard "/proc/$p/cmdline" 2>/dev/null; '
         'do sleep 0.1; i=$((i+1)); done; '
         'kill -KILL -"$p" 2>/dev/null; fi ;; esac; rm -f "$d/pid";')


def read_status(machine) -> tuple[Clock, GuardStatus]:
    """One round trip: the remote clock, the machine's start, and the guard's state."""
    r = _sh(machine, STATUS_PROBE.replace("@GUARD_DIR@", guard_dir(machine)))
    return parse_status(r.stdout)


def arm_guard(machine, settings: GuardSettings, *, plan=None, wait: float = 10.0) -> GuardStatus:
    """Start the guard on ``machine``, replacing any earlier one; returns its first status.

    ``plan`` (a :class:`gpumagic.budget.shutdown.ShutdownPlan`) defaults to
    :func:`gpumagic.budget.shutdown.find_shutdown`.  On the sandbox (which is this computer) the
    shutdown is always a stand-in that records the call in the sandbox directory.

    Raises
    ------
    BudgetError
        When no shutdown command can run on the machine (with what to do instead), or the
        guard did not start.
    """
    from .shutdown import ShutdownPlan, find_shutdown

    sandbox = getattr(machine, "sandbox", None)
    if sandbox is not None:
        stand_in = install_sandbox_shutdown(sandbox.server)
        plan = ShutdownPlan(f"{shlex.quote(str(stand_in))} -h now")
    if plan is None:
        plan = find_shutdown(machine)
    if not plan.possible:
        raise BudgetError(f"the guard cannot shut {machine.name} down: no shutdown command can run there",
                          plan.reason)
    script = guard_script(settings, plan.command)
    r = _sh(machine, _launch_script(script, guard_dir(machine)))
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
                      f"(state {status.state!r})", "look at ~/.gpumagic/guard/log on the machine")


def cancel_guard(machine) -> GuardStatus:
    """Stop the guard (its whole process group); returns the status after."""
    _sh(machine, f'd={guard_dir(machine)}; [ -d "$d" ] || exit 0; {_STOP} rm -f "$d/alert"; '
                 f'if [ -f "$d/state" ] && grep -q "^state=armed" "$d/state"; then '
                 f'sed "s/^state=armed/state=cancelled/" "$d/state" > "$d/state.tmp" && '
                 f'mv -f "$d/state.tmp" "$d/state"; fi')
    return read_status(machine)[1]


def install_sandbox_shutdown(server) -> Path:
    """Put a stand-in ``shutdown`` on the sandbox's PATH that only records its calls in
    ``SERVER_DIR/shutdown-calls`` (the sandbox is the user's own computer)."""
    calls = Path(server.dir) / "shutdown-calls"
    script = ("#!/bin/sh\n# gpumagic sandbox stand-in: records the call, powers nothing off\n"
              f'printf "%s shutdown %s\\n" "$(date +%s)" "$*" >> {shlex.quote(str(calls))}\n')
    return server.install_bin("shutdown", script)


# -- one machine: ledger + remote ---------------------------------------------------------


def set_prices(ledger: Ledger, name: str, prices: Prices, *, limit: float | None = None,
               alerts: Iterable[float] | None = None, started_at: float | None = None) -> dict:
    """Store ``name``'s prices (and limit, alert thresholds, billing start) in the ledger.

    Options left ``None`` keep what was stored before.  Returns the machine's record.

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
    with ledger.update() as data:
        rec = data["machines"].setdefault(name, {})
        rec["prices"] = prices.to_dict()
        if limit is not None:
            rec["limit"] = limit
        if alerts is not None:
            rec["alerts"] = sorted(float(a) for a in alerts)
        if started_at is not None:
            rec["started_at"] = started_at
        rec.setdefault("limit", None)
        rec.setdefault("alerts", [])
        rec.setdefault("sessions", [])
        return json.loads(json.dumps(rec))


def _prices_of(rec: dict | None, name: str) -> Prices:
    if not rec or "prices" not in rec:
        raise BudgetError(f"no prices are set for {name}",
                          "run `%gpu budget set --rate PRICE_PER_HOUR` (add --platform autodl|vastai|runpod|lambda)")
    return Prices.from_dict(rec["prices"])


def billing_start(rec: dict, clock: Clock, local_now: float) -> float:
    """When billing started, on the laptop's clock: the user's ``started_at``, else the
    machine's start read from the machine (shifted by the remote-laptop clock difference)."""
    if rec.get("started_at") is not None:
        return float(rec["started_at"])
    if clock.started is None:
        raise BudgetError("could not read when the machine started",
                          "give it yourself: %gpu budget set --started-at HH:MM (or -2h)")
    return local_now - (clock.remote_now - clock.started)


def read_meter(machine, ledger: Ledger, *, now: float | None = None) -> MeterReading:
    """Read ``machine``'s meter (one round trip), record the session, mark new alerts as shown.

    Raises
    ------
    BudgetError
        When no prices are set for the machine.
    """
    name = machine.name
    prices = _prices_of(ledger.machine(name), name)
    clock, guard = read_status(machine)
    local_now = time.time() if now is None else now
    with ledger.update() as data:
        rec = data["machines"][name]
        start = billing_start(rec, clock, local_now)
        session = record_session(rec, start, local_now, prices)
        reading = meter(name, prices, start, local_now, limit=rec.get("limit"),
                        alerts=rec.get("alerts", ()), alerted=session["alerted"],
                        guard=guard if guard.state != "none" else None)
        session["alerted"] = sorted(set(session["alerted"]) | set(reading.crossed))
    return reading


def check_alerts(ledger: Ledger, name: str, *, now: float | None = None) -> tuple[MeterReading | None, list[float]]:
    """Alert thresholds newly crossed by ``name``'s latest session, computed locally (no round
    trip); each is returned once, then recorded as shown.  ``(None, [])`` without a session."""
    local_now = time.time() if now is None else now
    rec = ledger.machine(name)
    if not rec or not rec.get("alerts") or not rec.get("sessions") or "prices" not in rec:
        return None, []
    with ledger.update() as data:
        rec = data["machines"][name]
        session = max(rec["sessions"], key=lambda s: float(s["start"]))
        prices = Prices.from_dict(rec["prices"])
        reading = meter(name, prices, float(session["start"]), local_now, limit=rec.get("limit"),
                        alerts=rec["alerts"], alerted=session.get("alerted", []))
        if reading.crossed:
            session["alerted"] = sorted(set(session.get("alerted", [])) | set(reading.crossed))
    return reading, list(reading.crossed)


def guard_limit_in(prices: Prices, limit: float, elapsed_s: float) -> float:
    """Seconds from now until the guard must act to keep spending within ``limit``: the limit
    deadline, less :data:`BOUNDARY_LEAD` when that deadline is a minute/hour boundary."""
    dl = limit_deadline(prices, limit)
    if dl is None:
        raise BudgetError("nothing is billed (all rates are 0), so the limit is never reached",
                          "set the rate: %gpu budget set --rate PRICE_PER_HOUR")
    unit = BILLING_UNITS[prices.billing]
    if prices.billing != "second" and dl % unit == 0:
        dl -= BOUNDARY_LEAD[prices.billing]
    return dl - elapsed_s


def arm_machine_guard(machine, ledger: Ledger, *, idle_s: float | None = None, at_limit: bool = False,
                      deadline: float | None = None, grace_s: float = 600, poll_s: float = 30,
                      idle_util: float = 5, plan=None, now: float | None = None) -> GuardStatus:
    """Arm the guard on ``machine`` with the budget's limit (``at_limit``) from the ledger.

    ``deadline`` is an epoch time on the laptop's clock; it is sent as "seconds from now" so
    the two clocks need not agree.

    Raises
    ------
    BudgetError
        At-limit without prices or limit, a limit already reached, a deadline in the past,
        or no way to shut the machine down.
    """
    local_now = time.time() if now is None else now
    limit_in = None
    if at_limit:
        rec = ledger.machine(machine.name)
        prices = _prices_of(rec, machine.name)
        if rec.get("limit") is None:
            raise BudgetError(f"no limit is set for {machine.name}", "run `%gpu budget set --limit AMOUNT` first")
        clock, _ = read_status(machine)
        start = billing_start(rec, clock, local_now)
        limit_in = guard_limit_in(prices, float(rec["limit"]), local_now - start)
        if limit_in <= 0:
            raise BudgetError(f"{machine.name} has already reached its limit of "
                              f"{prices.money(float(rec['limit']))}",
                              "raise it with `%gpu budget set --limit AMOUNT`, or stop the machine now")
    deadline_in = None
    if deadline is not None:
        deadline_in = deadline - local_now
        if deadline_in <= 0:
            raise BudgetError("the deadline is in the past", "give a later time, e.g. --deadline +2h")
    settings = GuardSettings(idle_s=idle_s, limit_in=limit_in, deadline_in=deadline_in,
                             grace_s=grace_s, poll_s=poll_s, idle_util=idle_util)
    if plan is None and getattr(machine, "sandbox", None) is None:
        from .shutdown import find_shutdown

        plan = find_shutdown(machine)
        preset = ((ledger.machine(machine.name) or {}).get("prices") or {}).get("platform")
        if not plan.possible and preset and preset != "generic":
            how = platforms().get(preset, {}).get("stop")
            if how:
                plan = replace(plan, reason=f"{plan.reason}. On {platforms()[preset]['name']}: {how}")
    status = arm_guard(machine, settings, plan=plan)
    with ledger.update() as data:
        rec = data["machines"].setdefault(machine.name, {})
        rec["guard"] = {"armed_at": local_now, "idle_s": idle_s, "limit_in": limit_in,
                        "deadline_in": deadline_in, "grace_s": grace_s}
    return status


def disarm_machine_guard(machine, ledger: Ledger) -> GuardStatus:
    """Cancel the guard on ``machine`` and forget it in the ledger."""
    status = cancel_guard(machine)
    with ledger.update() as data:
        rec = data["machines"].get(machine.name)
        if rec is not None:
            rec["guard"] = None
    return status
