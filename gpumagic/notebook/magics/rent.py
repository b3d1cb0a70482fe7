"""``%gpu offers``, ``rent``, ``stop``, ``start``, ``release``, ``rentals``, ``provider``.

Each parses, calls :class:`gpumagic.rent.Renter` (the plain-Python API), and prints; the
connection after a rent or a start is ``%gpu connect``'s (:meth:`Fleet.connect`) with the
address the platform's API gives, read again after every start.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from IPython.core.magic_arguments import argument, magic_arguments

from ...errors import ConfigError, GpumagicError, ReleaseRefused, RentError
from .. import display
from ._args import GB, MONEY, PORT, Subcommands, number, out_arg, parse

if TYPE_CHECKING:
    from ...rent import Instance, Offer, Renter
    from . import GpuMagics

PROVIDER_NAMES = ("runpod", "lambda", "vast", "autodl")
ROWS = number(1, 10**6, integer=True, what="a number of rows")


def renter(magics: GpuMagics) -> Renter:
    """The notebook's :class:`Renter` (``magics.state.renter``: made on first use; a test or
    script may set its own)."""
    r = magics.state.renter
    if r is None:
        from ...rent import Renter

        r = magics.state.renter = Renter()
    return r


def _filters(args) -> dict:
    return dict(gpu=args.gpu, vram_gb=args.vram, max_price=args.max_price, region=args.region,
                interruptible=True if args.interruptible else None)


def _offer_filters(fn):
    for dec in reversed([
        argument("--provider", choices=PROVIDER_NAMES, help="only this platform (default: every one with a key)"),
        argument("--gpu", help="GPU model, any part of its name (4090, H100)"),
        argument("--vram", type=GB, metavar="GB", help="at least this much memory per GPU"),
        argument("--max-price", type=MONEY, metavar="PER_HOUR", help="at most this price per hour (USD)"),
        argument("--region", help="region or cloud (any part of its name)"),
        argument("--interruptible", action="store_true", help="only interruptible (spot) offers"),
    ]):
        fn = dec(fn)
    return fn


def _money(v: float | None, currency: str = "USD") -> str:
    """A price; in a currency other than USD (AutoDL's CNY) the currency follows it."""
    text = "-" if v is None else f"{v:.3f}" if v < 1 else f"{v:.2f}"
    return text if currency == "USD" or v is None else f"{text} {currency}"


def _stopped_cost(inst: Instance) -> str:
    """``; its disk costs 0.014 USD/h while stopped`` (empty where the platform says nothing)."""
    if inst.stopped_hr is None:
        return ""
    per_hour = "USD/h" if inst.currency == "USD" else f"{inst.currency}/h"
    return f"; its disk costs {_money(inst.stopped_hr)} {per_hour} while stopped"


def offers_table(offers: list[Offer]) -> str:
    """Text table of offers, as ``%gpu offers`` prints it (already sorted, cheapest first)."""
    rows = [("OFFER", "GPU", "N", "VRAM", "USD/H", "STOPPED/H", "INTERRUPTIBLE")]
    for o in offers:
        rows.append((f"{o.provider}:{o.id}", o.gpu, str(o.gpus), f"{o.vram_gb} GB" if o.vram_gb else "?",
                     _money(o.price_hr, o.currency),
                     "no stop" if o.stopped_hr is None else _money(o.stopped_hr, o.currency),
                     "yes" if o.interruptible else "no"))
    return display.text_table(rows)


@magic_arguments()
@_offer_filters
@argument("--limit", type=ROWS, default=20, metavar="N", help="show the N cheapest (default 20)")
@out_arg("the list of Offer")
def _offers(magics: GpuMagics, line: str):
    """Offers to rent now, cheapest first: the price per hour, the disk's price per hour while
    stopped (50 GB; "no stop" where the platform can only terminate), interruptible or not.
    AutoDL's stock gives no price ("-"): it prices a container when it places it, at most
    --max-price (read in CNY there), and bills in CNY."""
    args = parse(_offers, line, "offers")
    skipped: list = []
    found = renter(magics).offers(args.provider, skipped=skipped, **_filters(args))
    for e in skipped:
        print(f"left out: {e.message} ({e.hint})")
    if not found:
        print("no offer fits; ask for less (--gpu, --vram, --max-price, --region)")
    else:
        print(offers_table(found[:args.limit]))
        if len(found) > args.limit:
            print(f"({len(found) - args.limit} more: --limit {len(found)})")
    if args.out:
        magics.shell.user_ns[args.out] = found


@magic_arguments()
@argument("offer", nargs="?", help="PROVIDER:OFFER as `%%gpu offers` shows it (default: the cheapest that fits)")
@_offer_filters
@argument("--name", required=True, help="the machine's name in gpumagic and on the platform")
@argument("--disk", type=GB, default=50, metavar="GB", help="disk kept while stopped (RunPod's volume; default 50)")
@argument("--image", help="container image (default a PyTorch image); on AutoDL an image UUID (image-... of "
                           "your saved images, base-image-... of its public ones)")
@argument("-i", "--key", metavar="KEYFILE", help="SSH private key (default ~/.ssh/id_ed25519; its .pub is given "
                                                 "to the platform)")
@argument("--cwd", metavar="DIR", help="working directory for this machine's cells")
@argument("--trust-new-host", action="store_true",
          help="trust the new machine's host key (else it is shown, and refused as `%%gpu connect` does)")
def _rent(magics: GpuMagics, line: str):
    """Rent a machine, wait until it runs, and connect to it as `%gpu connect` does.

    The platform's API gives the SSH address.  No platform here publishes its machines' host
    keys, so the new machine's key is refused, with its fingerprint, as `%gpu connect` refuses
    an unknown host, unless --trust-new-host; the key trusted is recorded, and after a
    `%gpu start` moves the machine to a new port only that key is trusted there.  The ledger
    records the price the platform reports, for `%gpu budget`."""
    args = parse(_rent, line, "rent")
    rent_and_connect(magics, args.name, offer_ref=args.offer, provider=args.provider, filters=_filters(args),
                     key=args.key, disk_gb=int(args.disk), image=args.image, cwd=args.cwd,
                     trust=args.trust_new_host)


def rent_and_connect(magics: GpuMagics, name: str, *, offer_ref: str | None = None, provider: str | None = None,
                     filters: dict | None = None, key: str | None = None, disk_gb: int = 50,
                     image: str | None = None, cwd: str | None = None, trust: bool = False,
                     say=print):
    """``%gpu rent``'s work, also for a job moved to a new rental (``%gpu job move --to
    new:P``, ``--fallback new:P``): pick the offer (``offer_ref``, else the cheapest that fits
    ``filters`` on ``provider``), rent it as ``name``, wait until it runs, record its price,
    connect (:func:`_connect`).  Returns the connected :class:`~gpumagic.machine.Machine`."""
    from ...keys import default_key_path, read_public_key

    r = renter(magics)
    key = str(key or default_key_path())
    public_key = read_public_key(key)
    offer = r.pick(offer_ref, provider=provider, **(filters or {}))
    price = (f"{_money(offer.price_hr)} USD/h" if offer.price_hr is not None and offer.currency == "USD"
             else f"{_money(offer.price_hr, offer.currency)}/h" if offer.price_hr is not None
             else f"priced when placed, at most {_money(offer.price_cap, offer.currency)}/h"
             if offer.price_cap is not None else "priced when placed")
    say(f"renting {offer.provider}:{offer.id} ({offer.gpu}, {price}) as {name}")
    inst = r.rent(offer, name=name, public_key=public_key, key_path=key, disk_gb=disk_gb,
                  image=image, progress=say)
    _record_price(name, inst, offer)
    return _connect(magics, name, inst, key, cwd=cwd or magics.default_cwd, trust=trust, say=say)


def leave_old_rental(magics: GpuMagics, name: str, how: str, say=print) -> None:
    """What becomes of the rental ``name`` that a job moved away from (``how``: ``stop``,
    ``release`` or ``keep``); a machine that is no rental of gpumagic's is left as it is, and
    so is one whose platform cannot do it (said, with what the user can do)."""
    r = renter(magics)
    try:
        rec = r.record(name)
    except ConfigError:
        if how != "keep":
            say(f"{name} is not a machine gpumagic rented: it is left as it is")
        return
    if how == "keep":
        say(f"{name} is kept as it is (and billed as {rec.provider} bills it); `%gpu stop {name}` or "
            f"`%gpu release {name}` when its files are no longer needed")
        return
    try:
        if how == "release":
            _check_results(magics, name)
            r.release(name)
            say(f"{name} is released: the platform has terminated it and its disk")
        else:
            p = r.provider(rec.provider)
            if not p.can_stop:
                say(f"{name} is left running: {rec.provider} cannot stop a machine, only release it; "
                    f"`%gpu release {name}` once its results are pulled")
                return
            inst = r.stop(name, progress=say)
            say(f"{name} is stopped{_stopped_cost(inst)} (`%gpu release {name}` ends it)")
    except GpumagicError as e:  # the check could not reach it, or the platform refused
        say(f"{name} was not {'released' if how == 'release' else 'stopped'}: {e.message} ({e.hint})")
        return
    if name in magics.fleet.machines:
        magics.fleet.disconnect(name)


def _record_price(name: str, inst: Instance, offer: Offer) -> None:
    """The price the platform reports, in the ledger (``%gpu budget`` meters from now)."""
    from ...budget import Ledger, Prices
    from ...budget.ledger import set_prices

    rate = inst.price_hr if inst.price_hr is not None else offer.price_hr
    if rate is None:  # (a platform that never said its price: nothing to meter)
        return
    set_prices(Ledger(), name, Prices(rate=rate, currency=inst.currency, platform=inst.provider),
               started_at=time.time())


#: Seconds an instance the platform reads as running gets for its sshd to answer.
SSHD_WAIT_S = 120.0


def _connect(magics: GpuMagics, name: str, inst: Instance, key: str, cwd: str | None = None,
             trust: bool = False, say=print):
    """Connect to a rental that the platform reads as running.  Its sshd may start a little
    later than the API says "running": a refused or unanswered connection is tried again, every
    poll interval, for :data:`SSHD_WAIT_S`.  An unknown host key is trusted with ``trust``, or
    when it is the key recorded for this rental (a start moved it to a new port); the key it
    was reached with is recorded.  With no ``cwd``, cells run in the folder a stop keeps where
    the platform has one (``inst.workdir``: RunPod's /workspace).  Returns the machine."""
    from ...errors import ConnectionRefused, ConnectTimeout, UnknownHostKey
    from ...ssh.known_hosts import fingerprint

    r = renter(magics)
    start = time.monotonic()
    target = f"{inst.user}@{inst.host}:{inst.port}"
    cwd = cwd or inst.workdir
    trusted: bool | str = True if trust else (r.record(name).host_key or False)
    while True:
        try:
            m = magics.fleet.connect(target, key=key or None, name=name, cwd=cwd, trust_new_host=trusted)
            m.connect()
            break
        except (ConnectionRefused, ConnectTimeout) as e:
            if time.monotonic() - start >= SSHD_WAIT_S:
                e.hint = (f"{name} is running (and billed) but its sshd does not answer at {target}: "
                          f"`%gpu connect {target} --name {name}` later, or `%gpu release {name}`")
                raise
            time.sleep(r.poll_s)
        except UnknownHostKey as e:
            e.hint = (f"{name} is running (and billed); if {e.fingerprint} is the key its platform shows, "
                      f"`%gpu start {name} --trust-new-host` connects, else `%gpu release {name}`")
            raise
    transport = m.connection.transport
    if transport is not None:
        r.note_host_key(name, fingerprint(transport.get_remote_server_key()))
    from ...rent.billstop import RentalStop

    m.rental = RentalStop(r, name)  # its guard and --then-shutdown stop the bill through the API
    for note in m.connection.notes:
        say(note)
    say(f"connected to {name} ({inst.user}@{inst.host}:{inst.port}) in {time.monotonic() - start:.2f} s; "
        f"%%remote cells run there")
    if inst.workdir and cwd == inst.workdir:
        say(f"{name}'s cells run in {inst.workdir}, its volume: what a stop keeps (the rest of its disk is not kept)")
    return m


@magic_arguments()
@argument("name", help="the rental's name (`%%gpu rentals`)")
def _stop(magics: GpuMagics, line: str):
    """Stop a rental: its disk is kept (and billed, see `%gpu rentals`), the GPU is not."""
    args = parse(_stop, line, "stop")
    r = renter(magics)
    p = r.provider(r.record(args.name).provider)
    if not p.can_stop:
        p.stop("")  # raises NotSupported, before the connection is closed
    if args.name in magics.fleet.machines:
        magics.fleet.disconnect(args.name)
    inst = r.stop(args.name, progress=print)
    if not p.can_start:
        print(f"{args.name} is stopped, and no longer billed; {p.name} cannot start it again: "
              f"`%gpu release {args.name}` deletes it, `%gpu rent` makes a new one")
        return
    print(f"{args.name} is stopped{_stopped_cost(inst)} (`%gpu start {args.name}` resumes it, "
          f"`%gpu release {args.name}` ends it)")


@magic_arguments()
@argument("name", help="the rental's name (`%%gpu rentals`)")
@argument("--cwd", metavar="DIR", help="working directory for this machine's cells")
@argument("--trust-new-host", action="store_true",
          help="trust its host key even if it is not the one trusted for it before (a rebuilt machine)")
def _start(magics: GpuMagics, line: str):
    """Start a stopped rental, wait until it runs, and connect at the address it has now
    (a platform may give a new port on every start): there, the host key trusted for it
    before is trusted, and another one refused unless --trust-new-host."""
    args = parse(_start, line, "start")
    r = renter(magics)
    rec = r.record(args.name)
    inst = r.status(args.name)
    if inst.state != "running" or not inst.host:  # (a running one is connected to as it is)
        inst = r.start(args.name, progress=print)
    _connect(magics, args.name, inst, rec.key, cwd=args.cwd or magics.default_cwd, trust=args.trust_new_host)


@magic_arguments()
@argument("name", help="the rental's name (`%%gpu rentals`)")
@argument("--yes", action="store_true", help="release even if results may be only on the machine")
def _release(magics: GpuMagics, line: str):
    """Release (terminate) a rental: the machine and its disk are gone, billing ends.

    First the wrap-up check (`%gpu wrapup`'s): while a results folder it knows has files
    only on the machine -- or none was ever named, or the machine cannot be reached -- the
    release is refused, unless --yes."""
    args = parse(_release, line, "release")
    r = renter(magics)
    r.record(args.name)
    if not args.yes:
        _check_results(magics, args.name)
    r.release(args.name)
    if args.name in magics.fleet.machines:
        magics.fleet.disconnect(args.name)
    print(f"{args.name} is released: the platform has terminated it and its disk")


def _check_results(magics: GpuMagics, name: str) -> None:
    """Refuse (ReleaseRefused) unless the wrap-up check finds every named results folder pulled."""
    from ... import wrapup

    m = magics.fleet.machines.get(name)
    if m is None:
        raise ReleaseRefused(f"{name} is not connected, so what is only on it cannot be checked",
                             f"`%gpu start {name}` or `%gpu connect`, pull what you need, then release; "
                             f"or `%gpu release {name} --yes`")
    report = wrapup.wrapup(m, pull=False)
    if not report.pulls:
        raise ReleaseRefused(f"no results folder of {name} was ever checked",
                             f"`%gpu wrapup --pull :runs/ ./runs/ --host {name}` pulls one (and remembers it); "
                             f"or `%gpu release {name} --yes`")
    left = [(p.src, len(p.pending)) for p in report.pulls if p.pending]
    failed = [p.src for p in report.pulls if p.error]
    if left or failed:
        what = ", ".join([f"{n} file(s) in {src}" for src, n in left] + [f"{src} (unreadable)" for src in failed])
        raise ReleaseRefused(f"{name} still holds results not pulled: {what}",
                             f"`%gpu wrapup --host {name}` pulls them; or `%gpu release {name} --yes`")


def rentals_table(rows) -> str:
    """Text table of ``Renter.rentals()``."""
    table = [("NAME", "PROVIDER", "STATE", "USD/H NOW", "STOPPED/H", "ADDRESS", "ID")]
    for name, inst in rows:
        now = inst.price_hr if inst.state in ("running", "pending") else inst.stopped_hr
        address = f"{inst.host}:{inst.port}" if inst.host else "-"
        table.append((name, inst.provider, inst.raw_state or inst.state, _money(now, inst.currency),
                      "no stop" if inst.stopped_hr is None else _money(inst.stopped_hr, inst.currency), address,
                      inst.id))
    return display.text_table(table)


#: Days before a platform's release of a stopped instance from which `%gpu rentals` warns.
RELEASE_WARN_DAYS = 2.0


def release_warnings(rows, keeps: dict, now: float | None = None) -> list[str]:
    """One line per stopped instance whose platform releases it within
    :data:`RELEASE_WARN_DAYS` (``keeps``: provider -> days it keeps a stopped one)."""
    now = time.time() if now is None else now
    out = []
    for name, inst in rows:
        days = keeps.get(inst.provider)
        if inst.state != "stopped" or days is None or inst.stopped_at is None:
            continue
        left = days - (now - inst.stopped_at) / 86400
        if left <= RELEASE_WARN_DAYS:
            when = f"in {left:.1f} days" if left > 0 else "any time now"
            out.append(f"warning: {name} ({inst.provider} {inst.id}) has been stopped "
                       f"{(now - inst.stopped_at) / 86400:.1f} days; {inst.provider} keeps a stopped one "
                       f"{days:g} days, so its data goes {when}")
    return out


@magic_arguments()
@out_arg("the list of (name, Instance)")
def _rentals(magics: GpuMagics, line: str):
    """Every instance of every platform with a key: its state, its price now, its price while stopped.
    Warns when a stopped instance is near the day its platform releases it (AutoDL keeps a
    stopped elastic container 7 days)."""
    args = parse(_rentals, line, "rentals")
    rows = renter(magics).rentals()
    print(rentals_table(rows) if rows else "no instances on any platform with a key")
    r = renter(magics)
    keeps = {p: r.provider(p).keeps_stopped_days for p in {inst.provider for _, inst in rows}}
    for line in release_warnings(rows, {p: d for p, d in keeps.items() if d is not None}):
        print(line)
    stray = [inst for name, inst in rows if name == "-"]
    if stray:
        print(f"{len(stray)} instance(s) not rented by gpumagic here (NAME -): they bill too")
    if args.out:
        magics.shell.user_ns[args.out] = rows


# -- %gpu provider ----------------------------------------------------------------------------


#: The options of `%gpu provider login P` that an environment variable may give when the line
#: does not (``GPUMAGIC_P_BASE_URL``...: :func:`gpumagic.rent.keystore.env_var`).
ENV_OPTIONS = ("base_url", "catalog_url", "user", "ssh_port")


def _options_from_env(args) -> list[str]:
    """Fill each option of ``args`` (a parsed login) that the line left out from its variable;
    returns the ones taken, as ``--base-url from $GPUMAGIC_RUNPOD_BASE_URL``."""
    import argparse
    import os

    from ...rent.keystore import env_var

    taken = []
    for opt in ENV_OPTIONS:
        var = env_var(args.provider, opt)
        value = os.environ.get(var, "").strip()
        if getattr(args, opt) is not None or not value:
            continue
        if opt == "ssh_port":
            try:
                value = PORT(value)
            except argparse.ArgumentTypeError as e:
                raise ConfigError(f"${var}={value!r}: {e}", f"set {var} to a TCP port, or unset it") from None
        setattr(args, opt, value)
        taken.append(f"--{opt.replace('_', '-')} from ${var}")
    return taken


@magic_arguments()
@argument("provider", choices=PROVIDER_NAMES)
@argument("--base-url", metavar="URL", help="the API's root (default: $GPUMAGIC_P_BASE_URL where set, "
                                            "else the platform's)")
@argument("--catalog-url", metavar="URL", help="RunPod: the v2 catalog's root (default $GPUMAGIC_RUNPOD_CATALOG_URL "
                                               "where set, else https://api.runpod.io)")
@argument("--user", help="SSH user on its machines (default: $GPUMAGIC_P_USER where set, else root on RunPod, "
                         "vast.ai and AutoDL, ubuntu on Lambda)")
@argument("--ssh-port", type=PORT, help="Lambda: the SSH port of its machines (default $GPUMAGIC_LAMBDA_SSH_PORT "
                                        "where set, else 22)")
def _provider_login(magics: GpuMagics, line: str):
    """Store a platform's API key: asked here without echo (never on the command line),
    checked with one API call, kept in the OS keychain or a 0600 file.

    Where no one can type it (a script, CI, a notebook run by `gpumagic run-notebook`), the
    key is taken from the environment variable GPUMAGIC_P_API_KEY when it is set (P the
    platform in capitals: GPUMAGIC_RUNPOD_API_KEY), instead of asking; it is checked and kept
    the same way, and never shown.  Each option left out of the line likewise comes from
    GPUMAGIC_P_BASE_URL, GPUMAGIC_P_CATALOG_URL, GPUMAGIC_P_USER or GPUMAGIC_P_SSH_PORT where
    set (a test server, a proxy of the API), and the output says which did."""
    args = parse(_provider_login, line, "provider login")
    from ...errors import BadKey
    from ...rent.keystore import ask_key, env_key, env_var

    taken = _options_from_env(args)
    r = renter(magics)
    r.configure(args.provider, base_url=args.base_url, catalog_url=args.catalog_url, user=args.user,
                ssh_port=args.ssh_port)
    var = env_var(args.provider)
    key = env_key(args.provider)
    from_env = key is not None
    if key is None:
        try:
            key = ask_key(args.provider).strip()
        except (EOFError, OSError, NotImplementedError):  # no terminal; no stdin (IPython's is a NotImplementedError)
            key = ""
    if not key:
        raise RentError(f"no key was entered for {args.provider}",
                        f"run `%gpu provider login {args.provider}` in a notebook and paste the key, "
                        f"or set ${var} where no one can type it")
    try:
        where = r.login(args.provider, key)
    except BadKey as e:
        if from_env:
            e.hint = f"the key came from ${var}: set it to a working key, or unset it to be asked for one"
        raise
    print(f"{args.provider}: the key{' in $' + var if from_env else ''} works; kept in {where}")
    if taken:
        print(f"{args.provider}: {', '.join(taken)}")


@magic_arguments()
@argument("provider", choices=PROVIDER_NAMES)
def _provider_logout(magics: GpuMagics, line: str):
    """Forget a platform's API key."""
    args = parse(_provider_logout, line, "provider logout")
    gone = renter(magics).keys.delete(args.provider)
    print(f"{args.provider}: key removed" if gone else f"{args.provider} had no key stored")


@magic_arguments()
def _provider_list(magics: GpuMagics, line: str):
    """Which platforms have a key, and where keys are kept."""
    parse(_provider_list, line, "provider")
    r = renter(magics)
    have = set(r.configured())
    for name in PROVIDER_NAMES:
        print(f"{name}: {'key stored' if name in have else 'no key (`%gpu provider login ' + name + '`)'}")
    print(f"keys are kept in {r.keys.where}")


PROVIDER = Subcommands("%gpu provider", {
    "login": (_provider_login, "store a platform's API key (asked without echo, checked, kept in the keychain)",
              "runpod|lambda|vast|autodl"),
    "logout": (_provider_logout, "forget a platform's API key", "runpod|lambda|vast|autodl"),
}, intro="%gpu provider: the API keys of the platforms gpumagic rents from.",
   outro="`%gpu provider SUB -h` shows each one's options.",
   default=(_provider_list, "which platforms have a key", ""))
