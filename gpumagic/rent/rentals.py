"""The rentals gpumagic made, and the life cycle around one: rent, wait, stop, start, release.

What is stored (``DATA/rentals.json``, :class:`RentalRecord` per name) is what the platform
cannot tell: which provider and instance a name means, the offer, the price at rent time.
Everything that changes (state, address, price now) is read from the API each time.
Provider settings that are not secret (a base URL, the SSH user) are in
``DATA/providers.json``; keys are in :mod:`.keystore`, never here.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

from ..errors import ConfigError, GpumagicError
from .base import Instance, NoOffer, Offer, Provider, RentError, StuckPending, offer_matches
from .keystore import KeyStore

RENTALS_FORMAT = "gpumagic-rentals"
RENTALS_VERSION = 1
#: Providers gpumagic can rent from, name -> (module, class).
PROVIDERS = {"runpod": ("runpod", "RunPod"), "lambda": ("lambdacloud", "LambdaCloud"), "vast": ("vast", "Vast"),
             "autodl": ("autodl", "AutoDL")}
#: Seconds a rent or start waits for ``running``, and between two reads of the state.
WAIT_S = 900.0
POLL_S = 5.0


def _data_dir() -> Path:
    from ..paths import data_dir

    return data_dir()


@dataclass
class RentalRecord:
    """One rental by name: ``provider``, ``instance_id``, the ``offer`` id, ``price_hr`` at
    rent time (USD per hour), ``created`` (epoch seconds), ``key`` (the private key file the
    machine is reached with), ``host_key`` (the SHA256 fingerprint of the host key the user
    trusted for it: after a start moves it to a new port, only that key is trusted there),
    ``stop_action`` (what the budget guard does to end its bill from the machine: ``stop``, or
    ``release``) and ``key_on_machine`` (the user agreed to place their API key on the machine
    for that: ``%gpu budget guard --with-my-key``)."""

    provider: str
    instance_id: str
    offer: str = ""
    price_hr: float | None = None
    created: float = 0.0
    key: str = ""
    host_key: str = ""
    stop_action: str = "stop"
    key_on_machine: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> "RentalRecord":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class ProviderSettings:
    """Non-secret settings of one provider: ``base_url`` (and RunPod's ``catalog_url``),
    the SSH ``user``, Lambda's ``ssh_port``, the ``timeout`` of one request (seconds)."""

    base_url: str | None = None
    catalog_url: str | None = None
    user: str | None = None
    ssh_port: int | None = None
    timeout: float | None = None
    spacing: dict | None = None

    def kwargs(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class RentalsFile:
    """``rentals.json``: ``{"format", "version", "rentals": {name: record}, "providers": {...}}``."""

    rentals: dict[str, RentalRecord] = field(default_factory=dict)
    providers: dict[str, ProviderSettings] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> "RentalsFile":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read {path}: {e}", f"fix or remove {path}") from None
        if data.get("format") != RENTALS_FORMAT or data.get("version") != RENTALS_VERSION:
            raise ConfigError(f"{path} is not a gpumagic rentals file of version {RENTALS_VERSION}",
                              "move it aside and run it again")
        return cls({n: RentalRecord.from_dict(r) for n, r in data.get("rentals", {}).items()},
                   {n: ProviderSettings(**s) for n, s in data.get("providers", {}).items()})

    def save(self, path: Path) -> None:
        from .._fs import atomic_write, private_dir

        private_dir(path.parent)
        atomic_write(path, json.dumps({"format": RENTALS_FORMAT, "version": RENTALS_VERSION,
                                       "rentals": {n: asdict(r) for n, r in self.rentals.items()},
                                       "providers": {n: asdict(s) for n, s in self.providers.items()}},
                                      indent=1), mode=0o600)


def parse_offer_ref(ref: str) -> tuple[str, str]:
    """``provider:offer`` -> ``(provider, offer)``."""
    provider, sep, offer = ref.partition(":")
    if not sep or provider not in PROVIDERS or not offer:
        raise ConfigError(f"{ref!r} is not an offer", "give it as `%gpu offers` shows it: PROVIDER:OFFER "
                                                       "(runpod:NVIDIA GeForce RTX 4090/secure, "
                                                       "lambda:gpu_1x_a10@us-east-1, vast:12345, "
                                                       "autodl:RTX 4090@westDC2)")
    return provider, offer


#: What a machine a job left becomes once the job runs on a new rental (``old=``).
OLD_RENTAL = ("stop", "release", "keep")


@dataclass(frozen=True)
class NewRental:
    """A machine yet to be rented, as ``%gpu job move --to`` and ``--fallback`` name it:
    ``new:PROVIDER[,gpu=G][,vram=GB][,max-price=USD][,region=R][,interruptible][,name=N]
    [,old=stop|release|keep][,trust-new-host]`` -- the cheapest offer of PROVIDER that fits,
    rented under ``name`` (default: the job's name and the provider's), and what becomes of the
    rental the job left (default ``stop``: the GPU's bill ends, the disk is kept)."""

    provider: str
    gpu: str | None = None
    vram_gb: float | None = None
    max_price: float | None = None
    region: str | None = None
    interruptible: bool | None = None
    name: str | None = None
    old: str = "stop"
    trust_new_host: bool = False

    @property
    def filters(self) -> dict:
        """The offer filters, as :meth:`Renter.pick` takes them."""
        return dict(gpu=self.gpu, vram_gb=self.vram_gb, max_price=self.max_price, region=self.region,
                    interruptible=self.interruptible)

    def machine_name(self, job: str) -> str:
        return self.name or f"{job}-{self.provider}"


def is_new_rental(text: str | None) -> bool:
    """Whether a ``--to``/``--fallback`` value names a machine yet to be rented."""
    return bool(text) and str(text).startswith("new:")


def parse_new_rental(text: str) -> NewRental:
    """``new:vast,max-price=1.5,old=release`` -> :class:`NewRental`.

    Raises
    ------
    ConfigError
        Not that form, an unknown provider or key, or a value that is not a number where one
        is needed (one line, with the form)."""
    form = ("new:PROVIDER[,gpu=G][,vram=GB][,max-price=USD][,region=R][,interruptible][,name=N]"
            "[,old=stop|release|keep][,trust-new-host]")
    head, *items = str(text).split(",")
    provider = head[4:] if head.startswith("new:") else ""
    if provider not in PROVIDERS:
        raise ConfigError(f"{text!r}: {'no provider named ' + repr(provider) if provider else 'not a new rental'} "
                          f"(providers: {', '.join(PROVIDERS)})", f"write it as {form}")
    fields: dict = {"provider": provider}
    numbers = {"vram": "vram_gb", "max-price": "max_price"}
    words = {"gpu": "gpu", "region": "region", "name": "name", "old": "old"}
    for item in items:
        key, sep, value = item.strip().partition("=")
        if not sep and key in ("interruptible", "trust-new-host"):
            fields[key.replace("-", "_")] = True
        elif sep and key in numbers:
            try:
                number = float(value)
            except ValueError:
                number = -1.0
            if not number > 0:
                raise ConfigError(f"{text!r}: {key}={value!r} is not a positive number", f"write it as {form}")
            fields[numbers[key]] = number
        elif sep and key in words and value:
            fields[words[key]] = value
        else:
            raise ConfigError(f"{text!r}: {item.strip()!r} is not one of its parts", f"write it as {form}")
    if fields.get("old", "stop") not in OLD_RENTAL:
        raise ConfigError(f"{text!r}: old={fields['old']} is none of {', '.join(OLD_RENTAL)}", f"write it as {form}")
    return NewRental(**fields)


class Renter:
    """Rentals across providers, for the magics and scripts.

    Parameters
    ----------
    directory : path, optional
        Where ``rentals.json`` is (default: gpumagic's data dir).
    keys : KeyStore, optional
    poll_s, wait_s : float
        Seconds between state reads, and the most a rent or start waits for ``running``.
    """

    def __init__(self, directory=None, *, keys: KeyStore | None = None, poll_s: float = POLL_S,
                 wait_s: float = WAIT_S, sleep: Callable[[float], None] = time.sleep):
        self.dir = Path(directory) if directory is not None else _data_dir()
        self.path = self.dir / "rentals.json"
        self.keys = keys or KeyStore(self.dir / "keys")
        self.poll_s = poll_s
        self.wait_s = wait_s
        self._sleep = sleep
        self._providers: dict[str, Provider] = {}

    # -- providers ---------------------------------------------------------------------

    def load(self) -> RentalsFile:
        return RentalsFile.load(self.path)

    @contextlib.contextmanager
    def update(self) -> Iterator[RentalsFile]:
        """``rentals.json`` read, changed by the caller, and written back, under the lock file
        ``rentals.json.lock`` (the budget ledger's lock: :func:`gpumagic._fs.locked`), so two
        notebooks renting at once never lose each other's record."""
        from .._fs import locked, private_dir

        private_dir(self.dir)
        with locked(self.path.with_name(self.path.name + ".lock")):
            f = self.load()
            yield f
            f.save(self.path)

    def configure(self, provider: str, **settings) -> None:
        """Store non-secret settings for ``provider`` (``base_url=...``); ``None`` keeps a value."""
        _check_provider(provider)
        with self.update() as f:
            s = f.providers.setdefault(provider, ProviderSettings())
            for k, v in settings.items():
                if v is not None:
                    setattr(s, k, v)
        self._providers.pop(provider, None)

    def provider(self, name: str, key: str | None = None) -> Provider:
        """The provider ``name`` with the stored key (or ``key``)."""
        _check_provider(name)
        if key is None and name in self._providers:
            return self._providers[name]
        key = key or self.keys.get(name)
        if not key:
            from .base import BadKey

            raise BadKey(f"no API key for {name}", f"run `%gpu provider login {name}` first")
        import importlib

        module, cls = PROVIDERS[name]
        settings = self.load().providers.get(name, ProviderSettings()).kwargs()
        if name != "lambda":
            settings.pop("ssh_port", None)
            settings.pop("spacing", None)
        if name != "runpod":
            settings.pop("catalog_url", None)
        p = getattr(importlib.import_module(f"{__package__}.{module}"), cls)(key, **settings)
        self._providers[name] = p
        return p

    def configured(self) -> list[str]:
        return [n for n in PROVIDERS if self.keys.get(n)]

    def login(self, provider: str, key: str) -> str:
        """Check ``key`` with one API call (listing instances), then store it.  Returns where."""
        p = self.provider(provider, key=key)
        p.instances()  # BadKey when refused: nothing stored
        self._providers.pop(provider, None)
        return self.keys.set(provider, key)

    # -- offers ------------------------------------------------------------------------

    def offers(self, provider: str | None = None, *, skipped: list | None = None, **filters) -> list[Offer]:
        """Offers of ``provider``, or of every provider with a key, cheapest first.

        Across providers, one that fails (a revoked key, a 429) is left out and its error
        appended to ``skipped`` (when given; else raised); all failing raises the first error.
        """
        names = [provider] if provider else self.configured()
        if not names:
            from .base import BadKey

            raise BadKey("no provider has an API key yet", "run `%gpu provider login runpod` (or lambda, vast, autodl) first")
        found: list[Offer] = []
        errors: list[RentError] = []
        for n in names:
            try:
                found += self.provider(n).offers(**filters)
            except RentError as e:
                if provider or skipped is None:
                    raise
                errors.append(e)
        if errors and len(errors) == len(names):
            raise errors[0]
        if skipped is not None:
            skipped.extend(errors)
        return sorted(found, key=_by_price)

    def pick(self, ref: str | None, *, provider: str | None = None, **filters) -> Offer:
        """The offer ``ref`` names (``provider:offer``), or the cheapest that fits ``filters``.

        Raises
        ------
        NoOffer
            Naming the filters, and the cheapest offer above the price cap when one exists.
        """
        if ref:
            pname, oid = parse_offer_ref(ref)
            unpriced = {k: v for k, v in filters.items() if k != "max_price"}
            for o in self.provider(pname).offers(**unpriced):
                if o.id == oid:
                    if o.price_hr is None:  # priced on placement: the cap goes with the create
                        return replace(o, price_cap=filters.get("max_price"))
                    if filters.get("max_price") is not None and o.price_hr > filters["max_price"]:
                        raise NoOffer(f"{ref} costs {o.price_hr:.2f}/h, above --max-price {filters['max_price']:g}",
                                      "raise --max-price, or pick a cheaper one from `%gpu offers`")
                    return o
            raise NoOffer(f"{ref} is not offered now", "it may have been taken: pick one from `%gpu offers`")
        found = self.offers(provider, **filters)
        if found:
            return found[0]
        cap = filters.get("max_price")
        if cap is not None:
            above = self.offers(provider, **{k: v for k, v in filters.items() if k != "max_price"})
            if above and above[0].price_hr is not None:
                return _raise(NoOffer(f"no offer under {cap:g}/h fits (the cheapest that fits: {above[0].provider}:"
                                      f"{above[0].id} at {above[0].price_hr:.2f}/h)",
                                      "raise --max-price, or ask for less (--gpu, --vram)"))
        raise NoOffer("no offer fits " + (", ".join(f"{k}={v}" for k, v in filters.items() if v is not None)
                                          or "(no filter)"),
                      "ask for less (--gpu, --vram, --region), or another --provider")

    # -- one rental --------------------------------------------------------------------

    def record(self, name: str) -> RentalRecord:
        f = self.load()
        if name not in f.rentals:
            known = ", ".join(sorted(f.rentals)) or "none"
            raise ConfigError(f"no rental named {name!r} (rentals: {known})", "`%gpu rentals` lists them")
        return f.rentals[name]

    def note_host_key(self, name: str, fingerprint: str) -> None:
        """Record the host key fingerprint the machine ``name`` was reached with."""
        with self.update() as f:
            if name in f.rentals:
                f.rentals[name].host_key = fingerprint

    def guard_choice(self, name: str, *, release: bool | None = None, with_my_key: bool | None = None) -> RentalRecord:
        """Record how the guard of ``name`` ends its bill: ``release`` instead of stop, and
        whether the user's key may be placed on the machine (``None`` keeps a choice)."""
        with self.update() as f:
            if name not in f.rentals:
                raise ConfigError(f"no rental named {name!r}", "`%gpu rentals` lists them")
            rec = f.rentals[name]
            if release is not None:
                rec.stop_action = "release" if release else "stop"
            if with_my_key is not None:
                rec.key_on_machine = with_my_key
        return rec

    def rent(self, offer: Offer, *, name: str, public_key: str, key_path: str = "", disk_gb: int = 50,
             image: str | None = None, progress: Callable[[str], None] = lambda _line: None) -> Instance:
        """Create an instance from ``offer`` under ``name``, record it, wait until it runs.

        The record is written as soon as the platform answered, so a rental is never lost
        (a wait that ends in :class:`StuckPending` leaves it in ``%gpu rentals``).
        """
        f = self.load()
        if name in f.rentals:
            raise ConfigError(f"a rental named {name!r} exists already",
                              f"pick another --name, or `%gpu release {name}` first")
        p = self.provider(offer.provider)
        inst = p.create(offer, name=name, public_key=public_key, disk_gb=disk_gb, image=image)
        with self.update() as f:
            f.rentals[name] = RentalRecord(offer.provider, inst.id, offer.id, inst.price_hr or offer.price_hr,
                                           time.time(), key_path)
        progress(f"{name}: {offer.provider} instance {inst.id} created ({inst.raw_state or inst.state})")
        return self.wait(name, "running", progress=progress)

    def wait(self, name: str, state: str, *, progress: Callable[[str], None] = lambda _line: None) -> Instance:
        """Read the instance until it is in ``state`` (``running`` also needs its SSH address).

        Raises
        ------
        StuckPending
            After :attr:`wait_s` seconds, naming the state it stayed in.
        """
        rec = self.record(name)
        p = self.provider(rec.provider)
        deadline = time.monotonic() + self.wait_s
        last = None
        while True:
            inst = p.status(rec.instance_id)
            if inst.state == state and (state != "running" or inst.ssh_ready):
                return inst
            if inst.state == "terminated" and state != "terminated":
                raise RentError(f"{name}: the {rec.provider} instance was terminated",
                                f"`%gpu release {name}` forgets it; rent another")
            if inst.raw_state != last:
                progress(f"{name}: {inst.raw_state or inst.state}, waiting for {state}")
                last = inst.raw_state
            if time.monotonic() >= deadline:
                raise StuckPending(f"{name} stayed {inst.raw_state or inst.state!r} for {self.wait_s:g} s "
                                   f"(wanted {state})",
                                   f"it is still billed: `%gpu release {name}` to give it up, or "
                                   f"`%gpu rentals` to look again later")
            self._sleep(self.poll_s)

    def stop(self, name: str, progress=lambda _line: None) -> Instance:
        rec = self.record(name)
        self.provider(rec.provider).stop(rec.instance_id)
        return self.wait(name, "stopped", progress=progress)

    def start(self, name: str, progress=lambda _line: None) -> Instance:
        """Start a stopped instance and wait until it runs; its address is read anew."""
        rec = self.record(name)
        self.provider(rec.provider).start(rec.instance_id)
        return self.wait(name, "running", progress=progress)

    def release(self, name: str) -> None:
        """Terminate the instance and forget the name."""
        rec = self.record(name)
        try:
            self.provider(rec.provider).release(rec.instance_id)
        except RentError as e:
            if getattr(e, "status", None) != 404:
                raise
        with self.update() as f:
            f.rentals.pop(name, None)

    def status(self, name: str) -> Instance:
        rec = self.record(name)
        return self.provider(rec.provider).status(rec.instance_id)

    def rentals(self) -> list[tuple[str, Instance]]:
        """Every instance of every provider with a key, named as recorded (else ``-``)."""
        f = self.load()
        by_id = {(r.provider, r.instance_id): n for n, r in f.rentals.items()}
        rows = []
        for pname in self.configured():
            for inst in self.provider(pname).instances():
                rows.append((by_id.get((pname, inst.id), "-"), inst))
        return rows


def _by_price(o: Offer):
    """Cheapest first; offers the platform prices only on placement last."""
    return (o.price_hr is None, o.price_hr or 0.0, o.provider, o.gpu)


def _raise(e: GpumagicError):
    raise e


def _check_provider(name: str) -> None:
    if name not in PROVIDERS:
        raise ConfigError(f"unknown provider {name!r}", f"one of: {', '.join(PROVIDERS)}")


__all__ = ["Renter", "RentalRecord", "RentalsFile", "ProviderSettings", "PROVIDERS", "parse_offer_ref",
           "offer_matches"]
