"""What the rental costs: ``%gpu budget`` (the meter), ``set``, ``estimate``, ``history``,
``guard`` and ``notify``, and the alerts shown after each cell (:func:`budget_alert_hook`)."""

from __future__ import annotations

import getpass
import re
import time
from typing import TYPE_CHECKING, Callable

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display as _show

from ... import budget
from ..._format import duration
from ...budget import MAX_AMOUNT, PRICE_OPTIONS, Ledger
from ...budget import notify as notifymod
from ..display import SANDBOX_SHUTDOWN_NOTE, AlertView, EstimateView, GuardView, HistoryView, MeterView
from ._args import GB, LIMIT, MONEY, Subcommands, host_arg, number, parse

if TYPE_CHECKING:
    from . import GpuMagics

#: Seconds between checks of a remote guard's warning from the post-run-cell hook (the
#: default of ``GpuMagics.guard_alert_poll``).
GUARD_ALERT_POLL = 60.0


def _budget_ledger(magics: GpuMagics):
    """The ledger (a new object per command, so notes are this command's)."""
    return Ledger()


def _budget_notes(ledger) -> None:
    """Show the ledger's notes (a damaged record left out, ...) once each."""
    while ledger.notes:
        _show(AlertView(ledger.notes.pop(0)))


def _crossed(reading, name: str | None = None) -> list[str]:
    """One message per alert threshold ``reading`` (a :class:`~gpumagic.budget.MeterReading`)
    newly crossed: "NAME has spent X, past your alert at T"."""
    money = reading.prices.money
    return [f"{name or reading.machine} has spent {money(reading.spent)}, past your alert at {money(t)}"
            for t in reading.crossed]


def _usage(fn, *args, **kw):
    """Call a pure parser; its ValueError becomes exactly UsageError."""
    try:
        return fn(*args, **kw)
    except ValueError as e:
        raise UsageError(str(e)) from None


@magic_arguments()
@host_arg()
def _budget_meter(magics: GpuMagics, line: str):
    """Show the meter: spent so far, rate, limit, next billing boundary, the guard."""
    args = parse(_budget_meter, line, "budget")
    ledger = _budget_ledger(magics)
    reading = magics.fleet.get(args.host).budget.meter(ledger=ledger)
    _budget_notes(ledger)
    _show(MeterView(reading))
    for msg in _crossed(reading):
        _show(AlertView(msg))


@magic_arguments()
@argument("--rate", type=MONEY, metavar="PER_HOUR", help="instance (GPU) price per hour")
@argument("--currency", help="shown after amounts (CNY, USD, ...); never converted")
@argument("--billing", choices=("second", "minute", "hour"), help="billing granularity (a started unit costs in full)")
@argument("--platform", help="preset: generic, autodl, vastai, runpod, lambda (billing, data disk, how to stop)")
@argument("--storage-gb", type=GB, metavar="GB", help="extra disk size")
@argument("--storage-rate-month", type=MONEY, metavar="PER_GB_MONTH", help="disk price per GB per month (30 days)")
@argument("--storage-rate-day", type=MONEY, metavar="PER_GB_DAY", help="disk price per GB per day")
@argument("--image-gb", type=GB, metavar="GB", help="saved images / snapshots size")
@argument("--image-rate-month", type=MONEY, metavar="PER_GB_MONTH", help="image price per GB per month")
@argument("--image-rate-day", type=MONEY, metavar="PER_GB_DAY", help="image price per GB per day")
@argument("--ip-rate", type=MONEY, metavar="PER_HOUR", help="reserved public IP price per hour")
@argument("--started-at", metavar="TIME", help="billing start: HH:MM, -2h, ISO time (default: the machine's start)")
@argument("--alert", metavar="AMOUNTS", help="alert thresholds, e.g. 10,20")
@argument("--limit", type=LIMIT, metavar="AMOUNT", help="spending limit (meter bar; --at-limit guard)")
@host_arg()
def _budget_set(magics: GpuMagics, line: str):
    """Store the machine's prices and thresholds (kept in the ledger across kernel restarts)."""
    # `--started-at -2h` reads naturally; argparse would take -2h for an option
    line = re.sub(r"(--started-at)\s+(-\S+)", r"\1=\2", line)
    args = parse(_budget_set, line, "budget set")
    name = args.host or magics.fleet.get(None).name
    ledger = _budget_ledger(magics)
    started = _usage(budget.parse_time, args.started_at, time.time(), future=False) if args.started_at else None
    alerts = _usage(budget.parse_amounts, args.alert) if args.alert else None
    try:
        rec = _usage(budget.change_prices, ledger, name, limit=args.limit, alerts=alerts, started_at=started,
                     **{k: getattr(args, k) for k in PRICE_OPTIONS})
    finally:
        _budget_notes(ledger)
    prices = rec.prices
    if rec.guard is not None and rec.guard.limit_in is not None:
        print("note: the armed guard still acts at the limit computed with the old prices; "
              "re-arm it with `%gpu budget guard --at-limit`")
    parts = ", ".join(f"{k} {prices.money(v)}/h" for k, v in prices.per_hour().items() if v)
    print(f"{name}: {prices.money(prices.hourly)}/h ({parts}), billed per {prices.billing}"
          + (f"; limit {prices.money(rec.limit)}" if rec.limit is not None else "")
          + (f"; alerts at {', '.join(prices.money(a) for a in rec.alerts)}" if rec.alerts else ""))
    if args.platform:
        preset = budget.platform(args.platform)
        print(f"{preset['name']}: data disk {preset['data_disk'] or '-'}; to stop: {preset['stop']}")
    m = magics.fleet.machines.get(name)
    if m is not None and m.is_connected:  # record the rental now, so alerts can fire after any cell
        for msg in _crossed(m.budget.meter(ledger=ledger), name):
            _show(AlertView(msg))
        if notifymod.read_config(m) is not None:  # re-arm the machine's spending alerts
            notifymod.schedule_thresholds(m, ledger)


@magic_arguments()
@argument("--hours", type=number(0, 1e7, above=True, what="hours"), required=True, help="planned GPU hours")
@argument("--rate", type=MONEY, metavar="PER_HOUR", help="on-demand price per hour (default: the machine's)")
@argument("--spot-rate", type=MONEY, metavar="PER_HOUR", help="spot / preemptible price per hour")
@argument("--card-price", type=LIMIT, help="buying instead: the card's price")
@argument("--power-w", type=number(0, 1e6, what="watts"), metavar="WATTS", help="the card's power draw (W)")
@argument("--kwh-price", type=MONEY, help="electricity price per kWh")
@argument("--resale", type=number(0, MAX_AMOUNT, what="an amount"), default=0.0, help="what the card sells for afterwards")
@argument("--currency", help="shown after amounts")
@host_arg("take the rate and extra costs from this machine's prices")
def _budget_estimate(magics: GpuMagics, line: str):
    """What a planned run costs: on-demand vs spot, and renting vs buying the card."""
    args = parse(_budget_estimate, line, "budget estimate")
    stored = None
    name = args.host or magics.fleet.default
    if name:
        ledger = _budget_ledger(magics)
        rec = ledger.machine(name)
        _budget_notes(ledger)
        if rec is not None:
            stored = rec.prices
    rate = args.rate if args.rate is not None else stored.rate if stored else None
    if rate is None:
        raise UsageError("give --rate PRICE_PER_HOUR (or set the machine's prices with `%gpu budget set`)")
    extra = stored.hourly - stored.rate if stored else 0.0
    rows = budget.estimate(args.hours, rate, spot_rate=args.spot_rate, extra_per_hour=extra,
                           card_price=args.card_price, power_w=args.power_w,
                           kwh_price=args.kwh_price, resale=args.resale)
    _show(EstimateView(rows, args.currency or (stored.currency if stored else "")))


@magic_arguments()
@host_arg("only this machine")
def _budget_history(magics: GpuMagics, line: str):
    """Spending per machine and per day, from the local ledger."""
    args = parse(_budget_history, line, "budget history")
    ledger = _budget_ledger(magics)
    rows = budget.history(ledger.machines(), time.time())
    _budget_notes(ledger)
    _show(HistoryView([r for r in rows if args.host in (None, r[0])]))


@magic_arguments()
@argument("--idle", metavar="DURATION", help="shut down after the GPU was idle this long (30m, 2h)")
@argument("--at-limit", action="store_true", help="shut down when the spending limit is reached")
@argument("--deadline", metavar="TIME", help="shut down at this time (HH:MM, +3h, ISO time)")
@argument("--grace", metavar="DURATION", default="10m", help="warn this long before (default 10m)")
@argument("--poll", metavar="SECONDS", type=number(1, 3600, what="seconds"), default=30, help="seconds between checks (default 30)")
@argument("--release", action="store_true",
          help="a rental: release it (instance and disk deleted) instead of stopping it; the only way on Lambda")
@argument("--with-my-key", action="store_true",
          help="a rental: place your API key for its platform on the machine (0600) for the guard; "
               "needed on Lambda, which injects none")
@argument("--cancel", action="store_true", help="disarm the guard")
@host_arg()
def _budget_guard(magics: GpuMagics, line: str):
    """Arm a watchdog ON the machine (works with the laptop closed) that shuts it down.

    On a rental (`%gpu rent`), it stops the bill instead: it calls the platform's API from the
    machine to stop the instance (vast.ai and RunPod, with the key they inject into it), or to
    release it (--release; on Lambda also --with-my-key), then reads that the instance is
    stopped.  Idle means: no GPU use, no cell, job or busy session running; an SSH login alone
    does not count."""
    args = parse(_budget_guard, line, "budget guard")
    m = magics.fleet.get(args.host)
    ledger = _budget_ledger(magics)
    rental = m.rental
    if (args.release or args.with_my_key) and rental is None:
        raise UsageError(f"--release and --with-my-key are for a rental (`%gpu rent`); {m.name} is not one")
    if args.cancel:
        status = m.budget.cancel_guard(ledger=ledger)
        _budget_notes(ledger)
        print(f"{m.name}: guard disarmed" if status.state != "armed" else f"{m.name}: guard still running!")
        if rental is not None and rental.forget_key(m):
            rental.renter.guard_choice(rental.name, with_my_key=False)
            print(f"your API key was removed from {m.name}")
        return
    if not (args.idle or args.at_limit or args.deadline):
        if rental is not None and _rental_stopped(rental):
            return
        _show(GuardView(m.budget.guard_status()))
        return
    idle = _usage(budget.parse_duration, args.idle) if args.idle else None
    deadline = _usage(budget.parse_time, args.deadline, time.time(), future=True) if args.deadline else None
    grace = _usage(budget.parse_duration, args.grace)
    if rental is not None:
        inst = rental.renter.status(rental.name)
        if inst.state != "running":
            raise budget.BudgetError(f"{rental.name} is {inst.state} ({inst.raw_state}) as the {inst.provider} API "
                                     "reads it: there is nothing to guard", f"`%gpu start {rental.name}` first")
        rental.renter.guard_choice(rental.name, release=args.release, with_my_key=args.with_my_key)
    status = m.budget.guard(idle=idle, at_limit=args.at_limit, deadline=deadline, grace=grace,
                            poll=args.poll, ledger=ledger)
    magics.state.budget_seen.clear()
    note = (f"armed on {m.name}; its log: {m.budget.guard_log()} there; "
            "`%gpu budget guard --cancel` disarms it")
    if rental is not None:
        rec = rental.renter.record(rental.name)
        note += (f"\nit ends the bill with the {rec.provider} API's {rec.stop_action}, sent from {m.name} itself "
                 "(the laptop may be closed), not with a shutdown")
        if rec.key_on_machine:
            note += "\n" + rental.key_statement()
    if m.is_this_computer:
        note += f"\n{SANDBOX_SHUTDOWN_NOTE}"
    if idle is not None and not status.idle.startswith(("idle", "busy")):
        note += (f"\nnote: the GPU cannot be measured now ({status.idle}), so the idle rule cannot "
                 "fire until it can (an unreadable GPU never counts as idle)")
    _budget_notes(ledger)
    _show(GuardView(status, note=note))


def _rental_stopped(rental) -> bool:
    """Say so, and return True, when the platform's API reads the rental stopped or gone (its
    guard, or someone, ended the bill: the machine cannot be asked then)."""
    inst = rental.renter.status(rental.name)
    if inst.state not in ("stopped", "terminated"):
        return False
    rec = rental.renter.record(rental.name)
    then = (f"`%gpu start {rental.name}` resumes it" if inst.state == "stopped"
            else f"`%gpu release {rental.name}` forgets it")
    print(f"{rental.name}: {inst.state} ({inst.raw_state}), as the {rec.provider} API reads it now: "
          f"its GPU is no longer billed; {then}")
    return True


# -- notify ---------------------------------------------------------------------------------


@magic_arguments()
@argument("--mail", metavar="ADDRESS", help="send alerts to this mail address (needs --smtp)")
@argument("--smtp", metavar="HOST[:PORT]", help="the SMTP server the machine sends through (port 465: SMTPS; "
                                                "otherwise STARTTLS when offered; default port 587)")
@argument("--user", metavar="U", help="SMTP login; the password is asked (not echoed), never in this line")
@argument("--from", dest="sender", metavar="ADDRESS", help="From: address (default: --user or --mail)")
@argument("--tls", default="auto", choices=notifymod.TLS_MODES,
          help="auto (STARTTLS when offered), ssl, starttls (required), none (never: plain text)")
@argument("--webhook", metavar="URL", help="a chat service's incoming-webhook URL (`ask`: type it, not echoed)")
@argument("--format", default="json", choices=notifymod.FORMATS, help="webhook payload form (default json)")
@argument("--chat-id", metavar="ID", help="--format telegram: the chat to send to")
@argument("--sign", action="store_true", help="ask for the bot's signing secret (feishu/lark, dingtalk)")
@argument("--test", action="store_true", help="send a test message now")
@argument("--no-test", action="store_true", help="do not send a test message after setting up")
@argument("--off", action="store_true", help="remove the settings (and credentials) from the machine")
@argument("--retries", type=number(0, 100, integer=True, what="a number of retries"), default=5,
          help="attempts after the first failure (default 5)")
@argument("--backoff", type=number(0, 3600, what="seconds"), default=2.0, metavar="S",
          help="first pause between attempts, doubled each time")
@host_arg()
def _budget_notify(magics: GpuMagics, line: str):
    """Alerts by mail or webhook, sent from the machine itself (works with the laptop closed):
    when spending passes each alert threshold of `%gpu budget set --alert`.

    Without options: the settings (no secrets), the thresholds armed (re-armed from the
    current prices and thresholds: run it after `%gpu budget set`), the last log lines.
    """
    args = parse(_budget_notify, line, "budget notify")
    m = magics.fleet.get(args.host)
    if args.off:
        if args.mail or args.webhook:
            raise UsageError("--off removes the settings: give it alone")
        notifymod.disable(m)
        print(f"{m.name}: notifications off; the settings and credentials were deleted from the machine")
        return None
    if args.mail and not args.smtp:
        raise UsageError("--mail needs the server to send through: --smtp HOST[:PORT] (e.g. smtp.qq.com:465)")
    if (args.smtp or args.user or args.sender) and not args.mail:
        raise UsageError("--smtp, --user and --from go with --mail ADDRESS")
    if (args.chat_id or args.sign) and not args.webhook:
        raise UsageError("--chat-id and --sign go with --webhook URL")
    channels = []
    try:
        if args.mail:
            password = None
            if args.user:
                password = getpass.getpass(f"SMTP password for {args.user} at {args.smtp}: ")
            channels.append(notifymod.mail_channel(args.mail, args.smtp, user=args.user, password=password,
                                                   sender=args.sender, tls=args.tls))
        if args.webhook:
            url = getpass.getpass("webhook URL: ") if args.webhook == "ask" else args.webhook
            secret = getpass.getpass("signing secret: ") if args.sign else None
            channels.append(notifymod.webhook_channel(url.strip(), args.format, secret=secret,
                                                      chat_id=args.chat_id))
    except ValueError as e:
        raise UsageError(str(e)) from None
    if channels:
        config = notifymod.configure(m, channels, retries=args.retries, backoff=args.backoff)
        print(f"{m.name}: alerts go to " + "; ".join(notifymod.describe(c) for c in config["channels"]))
        print(f"  settings and credentials: ~/{notifymod.NOTIFY_DIR}/config.json on {m.name} (mode 0600), "
              "never in a command line or a log")
        _print_schedule(m, notifymod.schedule_thresholds(m))
        if not args.no_test:
            _print_test(m)
        return None
    if args.test:
        _print_test(m)
        return None
    config = notifymod.read_config(m)
    if config is None:
        print(f"{m.name}: no alerts set up; `%gpu budget notify --mail ADDRESS --smtp HOST[:PORT]` or "
              "`%gpu budget notify --webhook URL --format slack|discord|feishu|dingtalk|wecom|telegram|json`")
        return None
    print(f"{m.name}: alerts go to " + "; ".join(notifymod.describe(c) for c in config.get("channels", [])))
    _print_schedule(m, notifymod.schedule_thresholds(m))  # thresholds changed since? armed as they are now
    lines, waiting = notifymod.log_tail(m)
    if waiting:
        print(f"  {waiting} message(s) waiting in the outbox (sent with the next one)")
    for ln in lines:
        print(f"  {ln}")
    return None


def _print_schedule(m, sched) -> None:
    if sched.items:
        parts = ", ".join(f"{it['threshold']} in {duration(it['in_s'])}" for it in sched.items)
        print(f"  spending alerts armed on {m.name}: {parts} (sent from there, laptop closed or not)")
    else:
        print(f"  no spending alert armed: {sched.reason}")


def _print_test(m) -> None:
    r = notifymod.send_from_machine(m, "test", retries=1, keep=False)
    if r.ok:
        print(f"  test message sent: {', '.join(r.sent)}")
    elif r.skipped:
        print(f"  test message not sent: {r.skipped}")
    else:
        for f in r.failed:
            print(f"  test message FAILED: {f}")
        print("  check the address, server or URL, then `%gpu budget notify --test`")


# -- the table, and the alerts after each cell ---------------------------------------------


#: ``%gpu budget [SUB]``: name -> (function, summary, usage); no sub-command is the meter.
BUDGET = Subcommands("%gpu budget", {
    "set": (_budget_set, "store the machine's prices, limit and alert thresholds", "--rate PER_HOUR [...]"),
    "estimate": (_budget_estimate, "what a planned run costs: on-demand vs spot, renting vs buying",
                 "--hours H [...]"),
    "history": (_budget_history, "spending per machine and day, from the local ledger"),
    "guard": (_budget_guard, "shut the machine down when idle, at the limit or at a deadline",
              "[--idle D] [--at-limit] [--deadline T] [--cancel]"),
    "notify": (_budget_notify, "alerts by mail or webhook, sent from the machine",
               "[--mail ADDRESS --smtp HOST] [--webhook URL] [--test] [--off]"),
}, intro="%gpu budget: what the rental costs, and alerts and a guard before it costs too much.",
   outro="`%gpu budget SUB -h` shows each one's options.",
   default=(_budget_meter, "the meter: spent so far, rate, limit, next billing boundary, the guard",
            "[--host NAME]"),
   default_is="the meter")


def budget_alert_hook(magics: GpuMagics, *, now: float | None = None,
                      clock: Callable[[], float] = time.monotonic) -> list[str]:
    """After each cell: show newly crossed alert thresholds (local arithmetic, no round trip)
    and, at most every ``magics.guard_alert_poll`` seconds of ``clock``, a pending guard
    warning from connected machines whose guard this ledger knows of.  ``now`` (epoch s)
    is the meter's time.  Returns the messages shown."""
    poll = getattr(magics, "guard_alert_poll", GUARD_ALERT_POLL)
    shown: list[str] = []
    ledger = budget.Ledger()
    if not magics.fleet.machines or not ledger.path.exists():
        return shown
    seen = magics.state.budget_seen
    for name, m in list(magics.fleet.machines.items()):
        reading, crossed = budget.check_alerts(ledger, name, now=now)
        if crossed:
            shown += _crossed(reading, name)
        rec = ledger.machine(name)
        last = seen.get(name, (0.0, ""))
        if rec is not None and rec.guard is not None and m.is_connected and clock() - last[0] >= poll:
            try:
                status = m.budget.guard_status()
            except Exception:  # a hook must never break the user's cell
                status = None
            warning = status.warning if status else ""
            if warning and warning != last[1]:
                shown.append(f"{name}: guard: {warning}")
            seen[name] = (clock(), warning or last[1])
    shown += ledger.notes
    for msg in shown:
        _show(AlertView(msg))
    return shown


def _budget_post_run_cell(magics: GpuMagics):
    said: set[str] = set()

    def hook(*_):
        if magics.closed:  # the extension was unloaded (see GpuMagics.close)
            return
        try:
            budget_alert_hook(magics)
        except Exception as e:  # never break the user's cell; say why once
            if str(e) not in said:
                said.add(str(e))
                print(f"gpumagic: budget alert check failed: {e}")
    return hook
