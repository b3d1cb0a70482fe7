"""IPython layer: ``%gpu <sub-command>`` and ``%%remote``.

Each sub-command is a small function with its own ``magic_arguments`` parser, listed in
``SUBCOMMANDS``; magic methods parse, call the plain-Python API, and display.  Bad
arguments raise exactly ``UsageError``; everything else is a ``GpumagicError`` whose
``_render_traceback_`` shows a short message instead of a traceback.
"""

from __future__ import annotations

import re
import time
from typing import Callable

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Unicode

from . import known_hosts
from .errors import RemoteCommandError
from .hosts import config_aliases, load_ssh_config, parse_target, ssh_dir
from .session import Session

#: name -> (function(magics, line), one-line help).  Filled by ``@subcommand`` below.
SUBCOMMANDS: dict[str, tuple[Callable, str]] = {}


def subcommand(name: str, summary: str):
    """Register ``fn(magics, line)`` as ``%gpu NAME``; its docstring is its ``--help``."""

    def wrap(fn):
        SUBCOMMANDS[name] = (fn, summary)
        return fn

    return wrap


def parse(fn, line: str, name: str):
    """Parse ``line`` with ``fn``'s magic_arguments parser; ``-h`` prints help."""
    fn.parser.prog = f"%gpu {name}"
    try:
        return parse_argstring(fn, line)
    except SystemExit:  # argparse after printing --help
        return None


def _env_pairs(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not key.replace("_", "a").isalnum() or key[0].isdigit():
            raise UsageError(f"--env {item!r}: write it as NAME=VALUE, e.g. --env CUDA_VISIBLE_DEVICES=0")
        env[key] = value
    return env


@magics_class
class GpuMagics(Magics):
    """``%gpu`` and ``%%remote``: run notebook cells on a rented GPU machine over SSH."""

    default_cwd = Unicode(
        None, allow_none=True, config=True,
        help="Working directory for cells on newly connected machines (e.g. '/root/autodl-tmp').",
    )

    def __init__(self, shell=None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        self.session = Session()
        if shell is not None:  # budget alerts after each cell (see the budget section)
            shell.events.register("post_run_cell", _budget_post_run_cell(self))

    # -- %gpu ---------------------------------------------------------------------------

    @line_magic
    def gpu(self, line: str = ""):
        """Drive rented GPU machines over SSH.  `%gpu help` lists the sub-commands."""
        name, _, rest = line.strip().partition(" ")
        if not name or name in ("help", "-h", "--help"):
            print(self.help_text())
            return None
        if name not in SUBCOMMANDS:
            raise UsageError(f"unknown sub-command {name!r}; valid: {', '.join(sorted(SUBCOMMANDS))} "
                             "(see `%gpu help`)")
        fn, _ = SUBCOMMANDS[name]
        return fn(self, rest)

    def help_text(self) -> str:
        width = max(len(n) for n in SUBCOMMANDS)
        rows = [f"  %gpu {n.ljust(width)}  {summary}" for n, (_, summary) in sorted(SUBCOMMANDS.items())]
        return ("gpumagic: run cells on a rented GPU machine over SSH.\n\n"
                "  %%remote [--python] ...  run the cell on the machine (see %%remote?)\n"
                + "\n".join(rows)
                + "\n\n`%gpu NAME -h` shows a sub-command's options.")

    # -- %%remote -------------------------------------------------------------------------

    @magic_arguments()
    @argument("--python", action="store_true", help="run the cell with the remote python3 (default: bash)")
    @argument("--host", metavar="NAME", help="machine to run on (default: the last connected)")
    @argument("--cwd", metavar="DIR", help="working directory for this cell")
    @argument("--env", metavar="K=V", action="append", default=[], help="environment variable (repeatable)")
    @argument("--timeout", metavar="S", type=float, help="stop the cell after S seconds")
    @argument("--no-raise-error", action="store_true",
              help="do not raise when the cell exits non-zero (Run All continues)")
    @argument("--out", metavar="VAR", help="store the RunResult (stdout, stderr, exit_code) in VAR")
    @cell_magic
    def remote(self, line: str, cell: str):
        """Run this cell on the remote machine, with output streamed live.

        The cell is a bash script, or Python with --python.  A non-zero exit raises (so
        "Run All" stops) unless --no-raise-error.  Interrupting the kernel stops the
        cell's whole remote process tree, then raises KeyboardInterrupt.
        """
        args = parse_argstring(self.remote, line)
        machine = self.session.get(args.host)
        result = machine.run(cell, python=args.python, cwd=args.cwd, env=_env_pairs(args.env),
                             timeout=args.timeout)
        if args.out:
            self.shell.user_ns[args.out] = result
        if result.exit_code != 0 and not args.no_raise_error:
            kind = "python cell" if args.python else "cell"
            raise RemoteCommandError(f"{kind} on {machine.name} exited with code {result.exit_code}",
                                     exit_code=result.exit_code, stdout=result.stdout,
                                     stderr=result.stderr)
        return None


# -- sub-commands ------------------------------------------------------------------------


@subcommand("connect", "connect to a machine: ~/.ssh/config alias or user@host[:port]")
@magic_arguments()
@argument("target", nargs="?", help="~/.ssh/config alias or [user@]host[:port]")
@argument("-p", "--port", type=int, help="SSH port (like ssh -p)")
@argument("-i", "--identity", metavar="KEYFILE", help="private key file (like ssh -i)")
@argument("-J", "--jump", metavar="JUMP", help="ProxyJump host(s), comma-separated (like ssh -J)")
@argument("-l", "--user", help="login user (like ssh -l)")
@argument("--name", help="name for this machine in gpumagic (default: the target)")
@argument("--cwd", metavar="DIR", help="working directory for this machine's cells")
@argument("--trust-new-host", action="store_true",
          help="add the host's key to ~/.ssh/known_hosts if it is not known yet (never if it changed)")
@argument("--sandbox", action="store_true", help="start a local throwaway sshd and connect to it")
@argument("--fake-gpu", metavar="RECORDING",
          help="sandbox only: replay a recorded GPU through a stand-in nvidia-smi (h200-idle, h200-load)")
def _connect(magics: GpuMagics, line: str):
    args = parse(_connect, line, "connect")
    if args is None:
        return
    if not args.target and not args.sandbox:
        raise UsageError("name a machine: `%gpu connect ALIAS` or `%gpu connect user@host:port` "
                         "(or `%gpu connect --sandbox` to try gpumagic locally)")
    if args.fake_gpu and not args.sandbox:
        raise UsageError("--fake-gpu only applies to --sandbox")
    start = time.monotonic()
    options = dict(port=args.port, key=args.identity, jump=args.jump, user=args.user,
                   name=args.name, cwd=args.cwd or magics.default_cwd,
                   trust_new_host=args.trust_new_host)
    if args.sandbox:
        m = magics.session.connect(None, sandbox=True, fake_gpu=args.fake_gpu, name=args.name,
                                   cwd=options["cwd"])
        gpu = f"replaying recorded {args.fake_gpu} (not a real GPU)" if args.fake_gpu else "no GPU"
        print(f"sandbox machine up: a local sshd at {m.spec.address} ({gpu}); "
              f"it stops when the kernel exits")
    else:
        m = magics.session.connect(args.target, **options)
    for note in m.connection.notes:
        print(note)
    print(f"connected to {m.name} ({m.spec.user}@{m.spec.address}) in "
          f"{time.monotonic() - start:.2f} s; %%remote cells run there")


@subcommand("disconnect", "close a machine's connection (default: the current one)")
@magic_arguments()
@argument("name", nargs="?", help="machine name (default: the current one)")
def _disconnect(magics: GpuMagics, line: str):
    args = parse(_disconnect, line, "disconnect")
    if args is None:
        return
    m = magics.session.disconnect(args.name)
    print(f"disconnected from {m.name}")


@subcommand("hosts", "list ~/.ssh/config aliases and which machines are connected")
@magic_arguments()
def _hosts(magics: GpuMagics, line: str):
    args = parse(_hosts, line, "hosts")
    if args is None:
        return
    print(hosts_table(magics.session))


def hosts_table(session: Session) -> str:
    """Text table: every config alias and connected machine, with its state."""
    config = load_ssh_config()
    rows = [("NAME", "TARGET", "STATE")]
    names = list(dict.fromkeys(config_aliases(config) + list(session.machines)))
    for name in names:
        m = session.machines.get(name)
        if m is not None:
            target = f"{m.spec.user}@{m.spec.address}"
            state = "connected" if m.is_connected else "closed"
            if session.default == name:
                state += " (default)"
        else:
            found = config.lookup(name)
            target = f"{found.get('user', '')}{'@' if found.get('user') else ''}{found.get('hostname', name)}:{found.get('port', 22)}"
            state = "-"
        rows.append((name, target, state))
    if len(rows) == 1:
        return "no machines: add a Host block to ~/.ssh/config or run `%gpu connect user@host:port`"
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


@subcommand("forget", "remove a host's key from ~/.ssh/known_hosts (after rebuilding an instance)")
@magic_arguments()
@argument("host", help="HOST or HOST:PORT, as named in the changed-key message")
def _forget(magics: GpuMagics, line: str):
    args = parse(_forget, line, "forget")
    if args is None:
        return
    target = parse_target(args.host)
    path = ssh_dir() / "known_hosts"
    port = target.port or 22
    n = known_hosts.forget(path, target.host, port)
    name = known_hosts.known_name(target.host, port)
    if n:
        print(f"removed {n} line(s) for {name} from {path} (previous file kept as {path}.old)")
    else:
        print(f"{path} has no entry for {name}; nothing changed")


@subcommand("cd", "set the working directory for the current machine's cells")
@magic_arguments()
@argument("dir", help="directory on the machine (absolute, ~/..., or relative to the current one)")
@argument("--host", metavar="NAME", help="machine (default: the current one)")
def _cd(magics: GpuMagics, line: str):
    args = parse(_cd, line, "cd")
    if args is None:
        return
    m = magics.session.get(args.host)
    print(f"{m.name}: cells now run in {m.cd(args.dir)}")


# -- budget ------------------------------------------------------------------------------


def _budget_ledger(magics: GpuMagics):
    """The ledger (a fresh object per command, so notes are this command's)."""
    from .budget import Ledger

    return Ledger()


def _show(obj) -> None:
    from IPython.display import display

    display(obj)


def _budget_notes(ledger) -> None:
    from .display import AlertView

    for note in ledger.notes:
        _show(AlertView(note))


def _usage(fn, *args, **kw):
    """Call a pure parser; its ValueError becomes exactly UsageError."""
    try:
        return fn(*args, **kw)
    except ValueError as e:
        raise UsageError(str(e)) from None


@magic_arguments()
@argument("--host", metavar="NAME", help="machine (default: the current one)")
def _budget_meter(magics: GpuMagics, line: str):
    """Show the meter: spent so far, rate, limit, next billing boundary, the guard."""
    args = parse(_budget_meter, line, "budget")
    if args is None:
        return
    from .display import AlertView, MeterView

    ledger = _budget_ledger(magics)
    reading = magics.session.get(args.host).budget_meter(ledger=ledger)
    _budget_notes(ledger)
    _show(MeterView(reading))
    for t in reading.crossed:
        _show(AlertView(f"{reading.machine} has spent {reading.prices.money(reading.spent)}, "
                        f"past your alert at {reading.prices.money(t)}"))


@magic_arguments()
@argument("--rate", type=float, metavar="PER_HOUR", help="instance (GPU) price per hour")
@argument("--currency", help="shown after amounts (CNY, USD, ...); never converted")
@argument("--billing", choices=("second", "minute", "hour"), help="billing granularity (a started unit costs in full)")
@argument("--platform", help="preset: generic, autodl, vastai, runpod, lambda (billing, data disk, how to stop)")
@argument("--storage-gb", type=float, metavar="GB", help="extra disk size")
@argument("--storage-rate-month", type=float, metavar="PER_GB_MONTH", help="disk price per GB per month (30 days)")
@argument("--storage-rate-day", type=float, metavar="PER_GB_DAY", help="disk price per GB per day")
@argument("--image-gb", type=float, metavar="GB", help="saved images / snapshots size")
@argument("--image-rate-month", type=float, metavar="PER_GB_MONTH", help="image price per GB per month")
@argument("--image-rate-day", type=float, metavar="PER_GB_DAY", help="image price per GB per day")
@argument("--ip-rate", type=float, metavar="PER_HOUR", help="reserved public IP price per hour")
@argument("--started-at", metavar="TIME", help="billing start: HH:MM, -2h, ISO time (default: the machine's start)")
@argument("--alert", metavar="AMOUNTS", help="alert thresholds, e.g. 10,20")
@argument("--limit", type=float, metavar="AMOUNT", help="spending limit (meter bar; --at-limit guard)")
@argument("--host", metavar="NAME", help="machine (default: the current one)")
def _budget_set(magics: GpuMagics, line: str):
    """Store the machine's prices and thresholds (kept in the ledger across kernel restarts)."""
    # `--started-at -2h` reads naturally; argparse would take -2h for an option
    line = re.sub(r"(--started-at)\s+(-\S+)", r"\1=\2", line)
    args = parse(_budget_set, line, "budget set")
    if args is None:
        return
    import dataclasses

    from . import budget

    for kind in ("storage", "image"):
        if getattr(args, f"{kind}_rate_month") is not None and getattr(args, f"{kind}_rate_day") is not None:
            raise UsageError(f"give --{kind}-rate-month or --{kind}-rate-day, not both")
    name = args.host or magics.session.get(None).name
    ledger = _budget_ledger(magics)
    old = ledger.machine(name)
    changes = {k: getattr(args, k) for k in ("rate", "currency", "billing", "storage_gb", "image_gb", "ip_rate")
               if getattr(args, k) is not None}
    for kind in ("storage", "image"):
        for per in ("month", "day"):
            v = getattr(args, f"{kind}_rate_{per}")
            if v is not None:
                changes[f"{kind}_rate"], changes[f"{kind}_per"] = v, per
    preset = None
    if args.platform:
        preset = budget.platform(args.platform)
        changes["platform"] = args.platform.lower()
        changes.setdefault("billing", preset["billing"])
    if old and "prices" in old:
        prices = dataclasses.replace(budget.Prices.from_dict(old["prices"]), **changes)
    elif "rate" in changes:
        prices = budget.Prices(**changes)
    else:
        raise UsageError(f"no prices stored for {name} yet: give at least --rate PRICE_PER_HOUR")
    now = time.time()
    started = _usage(budget.parse_time, args.started_at, now, future=False) if args.started_at else None
    alerts = _usage(budget.parse_amounts, args.alert) if args.alert else None
    rec = budget.set_prices(ledger, name, prices, limit=args.limit, alerts=alerts, started_at=started)
    _budget_notes(ledger)
    if (rec.get("guard") or {}).get("limit_in") is not None:
        print("note: the armed guard still acts at the limit computed with the old prices; "
              "re-arm it with `%gpu budget guard --at-limit`")
    parts = ", ".join(f"{k} {prices.money(v)}/h" for k, v in prices.per_hour().items() if v)
    print(f"{name}: {prices.money(prices.hourly)}/h ({parts}), billed per {prices.billing}"
          + (f"; limit {prices.money(rec['limit'])}" if rec.get("limit") is not None else "")
          + (f"; alerts at {', '.join(prices.money(a) for a in rec['alerts'])}" if rec.get("alerts") else ""))
    if preset:
        print(f"{preset['name']}: data disk {preset['data_disk'] or '-'}; to stop: {preset['stop']}")
    m = magics.session.machines.get(name)
    if m is not None and m.is_connected:  # record the session now, so alerts can fire after any cell
        from .display import AlertView

        reading = m.budget_meter(ledger=ledger)
        for t in reading.crossed:
            _show(AlertView(f"{name} has spent {prices.money(reading.spent)}, past your alert at {prices.money(t)}"))


@magic_arguments()
@argument("--hours", type=float, required=True, help="planned GPU hours")
@argument("--rate", type=float, metavar="PER_HOUR", help="on-demand price per hour (default: the machine's)")
@argument("--spot-rate", type=float, metavar="PER_HOUR", help="spot / preemptible price per hour")
@argument("--card-price", type=float, help="buying instead: the card's price")
@argument("--power-w", type=float, metavar="WATTS", help="the card's power draw (W)")
@argument("--kwh-price", type=float, help="electricity price per kWh")
@argument("--resale", type=float, default=0.0, help="what the card sells for afterwards")
@argument("--currency", help="shown after amounts")
@argument("--host", metavar="NAME", help="take the rate and extra costs from this machine's prices")
def _budget_estimate(magics: GpuMagics, line: str):
    """What a planned run costs: on-demand vs spot, and renting vs buying the card."""
    args = parse(_budget_estimate, line, "budget estimate")
    if args is None:
        return
    from . import budget
    from .display import EstimateView

    stored = None
    name = args.host or magics.session.default
    if name:
        rec = _budget_ledger(magics).machine(name)
        if rec and "prices" in rec:
            stored = budget.Prices.from_dict(rec["prices"])
    rate = args.rate if args.rate is not None else stored.rate if stored else None
    if rate is None:
        raise UsageError("give --rate PRICE_PER_HOUR (or set the machine's prices with `%gpu budget set`)")
    extra = stored.hourly - stored.rate if stored else 0.0
    rows = budget.estimate(args.hours, rate, spot_rate=args.spot_rate, extra_per_hour=extra,
                           card_price=args.card_price, power_w=args.power_w,
                           kwh_price=args.kwh_price, resale=args.resale)
    _show(EstimateView(rows, args.currency or (stored.currency if stored else "")))


@magic_arguments()
@argument("--host", metavar="NAME", help="only this machine")
def _budget_history(magics: GpuMagics, line: str):
    """Spending per machine and per day, from the local ledger."""
    args = parse(_budget_history, line, "budget history")
    if args is None:
        return
    from . import budget
    from .display import HistoryView

    ledger = _budget_ledger(magics)
    rows = budget.history(ledger.read(), time.time())
    _budget_notes(ledger)
    _show(HistoryView([r for r in rows if args.host in (None, r[0])]))


@magic_arguments()
@argument("--idle", metavar="DURATION", help="shut down after the GPU was idle this long (30m, 2h)")
@argument("--at-limit", action="store_true", help="shut down when the spending limit is reached")
@argument("--deadline", metavar="TIME", help="shut down at this time (HH:MM, +3h, ISO time)")
@argument("--grace", metavar="DURATION", default="10m", help="warn this long before (default 10m)")
@argument("--poll", metavar="SECONDS", type=float, default=30, help="seconds between checks (default 30)")
@argument("--cancel", action="store_true", help="disarm the guard")
@argument("--host", metavar="NAME", help="machine (default: the current one)")
def _budget_guard(magics: GpuMagics, line: str):
    """Arm a watchdog ON the machine (works with the laptop closed) that shuts it down."""
    args = parse(_budget_guard, line, "budget guard")
    if args is None:
        return
    from . import budget
    from .display import GuardView

    m = magics.session.get(args.host)
    ledger = _budget_ledger(magics)
    if args.cancel:
        status = m.budget_guard_cancel(ledger=ledger)
        print(f"{m.name}: guard disarmed" if status.state != "armed" else f"{m.name}: guard still running!")
        return
    if not (args.idle or args.at_limit or args.deadline):
        _show(GuardView(m.budget_guard_status()))
        return
    idle = _usage(budget.parse_duration, args.idle) if args.idle else None
    deadline = _usage(budget.parse_time, args.deadline, time.time(), future=True) if args.deadline else None
    grace = _usage(budget.parse_duration, args.grace)
    status = m.budget_guard(idle=idle, at_limit=args.at_limit, deadline=deadline, grace=grace,
                            poll=args.poll, ledger=ledger)
    magics._budget_seen = {}
    note = (f"armed on {m.name}; its log: {budget.guard_log_path(m)} there; "
            "`%gpu budget guard --cancel` disarms it")
    if idle is not None and not status.idle.startswith(("idle", "busy")):
        note += (f"\nnote: the GPU cannot be measured now ({status.idle}), so the idle rule cannot "
                 "fire until it can (an unreadable GPU never counts as idle)")
    _show(GuardView(status, note=note))


_BUDGET_SUBS = {"set": _budget_set, "estimate": _budget_estimate, "history": _budget_history,
                "guard": _budget_guard}


@subcommand("budget", "what the rental costs: set prices, meter, estimate, history, guard")
def _budget(magics: GpuMagics, line: str):
    """`%gpu budget [set|estimate|history|guard] ...`; no sub-command shows the meter."""
    word, _, rest = line.strip().partition(" ")
    if word in _BUDGET_SUBS:
        return _BUDGET_SUBS[word](magics, rest)
    if word and not word.startswith("-"):
        raise UsageError(f"unknown budget command {word!r}; valid: {', '.join(_BUDGET_SUBS)} "
                         "(or none, for the meter)")
    return _budget_meter(magics, line)


#: Seconds between checks of a remote guard's warning from the post-run-cell hook.
GUARD_ALERT_POLL = 60.0


def budget_alert_hook(magics: GpuMagics, *, now: float | None = None) -> list[str]:
    """After each cell: show newly crossed alert thresholds (local arithmetic, no round trip)
    and, at most every GUARD_ALERT_POLL s, a pending guard warning from connected machines
    whose guard this ledger knows of.  Returns the messages shown."""
    from . import budget
    from .display import AlertView

    shown: list[str] = []
    ledger = budget.Ledger()
    if not magics.session.machines or not ledger.path.exists():
        return shown
    seen = getattr(magics, "_budget_seen", None)
    if seen is None:
        seen = magics._budget_seen = {}
    for name, m in list(magics.session.machines.items()):
        reading, crossed = budget.check_alerts(ledger, name, now=now)
        for t in crossed:
            shown.append(f"{name} has spent {reading.prices.money(reading.spent)}, "
                         f"past your alert at {reading.prices.money(t)}")
        rec = ledger.machine(name) or {}
        last = seen.get(name, (0.0, ""))
        if rec.get("guard") and m.is_connected and time.monotonic() - last[0] >= GUARD_ALERT_POLL:
            try:
                status = m.budget_guard_status()
            except Exception:  # a hook must never break the user's cell
                status = None
            warning = status.warning if status else ""
            if warning and warning != last[1]:
                shown.append(f"{name}: guard: {warning}")
            seen[name] = (time.monotonic(), warning or last[1])
    shown += ledger.notes
    for msg in shown:
        _show(AlertView(msg))
    return shown


def _budget_post_run_cell(magics: GpuMagics):
    said: set[str] = set()

    def hook(*_):
        try:
            budget_alert_hook(magics)
        except Exception as e:  # never break the user's cell; say why once
            if str(e) not in said:
                said.add(str(e))
                print(f"gpumagic: budget alert check failed: {e}")
    return hook
