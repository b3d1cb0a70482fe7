"""What a rented machine costs: prices, billing arithmetic, alerts, estimates, platform presets.

Pure functions over numbers and text (no I/O but reading ``platforms.json``).  Rates are
money per hour; storage and image rates are money per GB per month (30 days) or per day, as
the user states them.  The currency is whatever the user's platform bills in: gpumagic never
knows prices.

What is billed how
------------------
The instance rate and the public-IP rate are billed in units of the platform's granularity
(``second``, ``minute`` or ``hour``; a started unit costs in full).  Storage and saved
images accrue continuously.  Spending starts when the instance started billing: by default
the machine's start as read from the machine (the start time of PID 1: the container's
start in a container, the boot in a VM; see :mod:`gpumagic.budget.guard`), or a time the
user gives.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from ..errors import BudgetError, ConfigError  # noqa: F401 (BudgetError: its old home)

if TYPE_CHECKING:
    from .guard import GuardStatus

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
    """True for a finite ``int``/``float`` (never a bool) from ``lo`` to ``hi`` (an ``int`` too
    large for a float is compared as it is: ``math.isfinite`` would raise OverflowError)."""
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and (isinstance(v, int) or math.isfinite(v)) and lo <= v <= hi)


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


#: ``%gpu budget set``'s price options (see :func:`price_changes`).
PRICE_OPTIONS = ("rate", "currency", "billing", "platform", "storage_gb", "storage_rate_month",
                 "storage_rate_day", "image_gb", "image_rate_month", "image_rate_day", "ip_rate")


def price_changes(**options) -> dict:
    """The :class:`Prices` fields that ``%gpu budget set``'s options change.

    Parameters
    ----------
    **options
        The names of :data:`PRICE_OPTIONS`; ``None`` means "not given".  ``rate``,
        ``currency``, ``billing``, ``storage_gb``, ``image_gb`` and ``ip_rate`` are fields as
        they are; ``storage_rate_month`` (money per GB per month of 30 days) or
        ``storage_rate_day`` set ``storage_rate`` and ``storage_per`` (likewise ``image_``);
        ``platform`` names a preset of ``platforms.json``, whose billing applies unless
        ``billing`` is given.

    Returns
    -------
    dict
        Field name -> value, only for what was given.

    Raises
    ------
    ValueError
        A rate given both per month and per day, or an option that is not one of
        :data:`PRICE_OPTIONS`.
    ConfigError
        An unknown platform preset (naming those that exist).
    """
    unknown = set(options) - set(PRICE_OPTIONS)
    if unknown:
        raise ValueError(f"not a price option: {', '.join(sorted(unknown))}")
    given = {k: v for k, v in options.items() if v is not None}
    changes = {k: given[k] for k in ("rate", "currency", "billing", "storage_gb", "image_gb", "ip_rate")
               if k in given}
    for kind in ("storage", "image"):
        month, day = given.get(f"{kind}_rate_month"), given.get(f"{kind}_rate_day")
        if month is not None and day is not None:
            raise ValueError(f"give --{kind}-rate-month or --{kind}-rate-day, not both")
        if month is not None or day is not None:
            changes[f"{kind}_rate"], changes[f"{kind}_per"] = (month, "month") if month is not None else (day, "day")
    if "platform" in given:
        changes["platform"] = given["platform"].lower()
        changes.setdefault("billing", platform(given["platform"])["billing"])
    return changes
