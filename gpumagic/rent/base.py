"""One small interface over the platforms that rent GPU machines by API.

A :class:`Provider` lists offers, creates an instance from one, reads its state and SSH
address, stops, starts and releases it, and says the account's balance where its API has
one.  Each platform is one module (:mod:`.runpod`, :mod:`.lambdacloud`) written against its
published API; the HTTP door they share is :mod:`.http`.  States are read into four words,
``pending``, ``running``, ``stopped``, ``terminated`` (the platform's own word is kept in
:attr:`Instance.raw_state`), so the magics never learn a platform's vocabulary.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from ..errors import (BadKey, CreateTimeout, InsufficientBalance, NoOffer, NotSupported,  # noqa: F401
                      RateLimited, RentError, StuckPending)

#: The four states gpumagic reads every platform's states into.
STATES = ("pending", "running", "stopped", "terminated")


@dataclass(frozen=True)
class Offer:
    """One thing that can be rented now.

    Attributes
    ----------
    provider : str
    id : str
        What ``%gpu rent`` takes (``provider:id`` on the command line).
    gpu : str
        GPU model as the platform names it (``RTX 4090``).
    gpus : int
    vram_gb : int or None
        Memory of one GPU, GB.
    price_hr : float or None
        Price per hour while running, in ``currency``; ``None`` where the platform's list of
        offers gives no price (AutoDL prices a container when it places it, within the
        ``price_cap`` sent with the create).
    stopped_hr : float or None
        Price per hour while stopped (disk kept); ``None`` where it cannot be stopped.
    interruptible : bool
    region : str
    currency : str
        ``USD``, or the platform's own (``CNY`` on AutoDL); never converted.
    price_cap : float or None
        The most per hour the platform may charge, sent with the create where the platform
        prices on placement (``--max-price``); ``None`` for no cap of gpumagic's.
    """

    provider: str
    id: str
    gpu: str
    gpus: int
    vram_gb: int | None
    price_hr: float | None
    stopped_hr: float | None
    interruptible: bool
    region: str = ""
    currency: str = "USD"
    price_cap: float | None = None


@dataclass(frozen=True)
class Instance:
    """An instance as the platform's API reads now.

    ``state`` is one of :data:`STATES`; ``host``/``port`` are ``None`` until the platform
    has assigned them (read again after every start: a port may change).  ``stopped_at``
    (epoch seconds) is when it stopped, where the platform says.  ``workdir`` is the folder on
    the machine whose files a stop keeps, where the platform mounts one apart from the rest of
    the disk (RunPod's pod volume: ``volumeMountPath``, /workspace; what is outside it is lost at
    every stop): the rental's cells run there unless ``--cwd`` says otherwise.
    """

    provider: str
    id: str
    name: str
    state: str
    raw_state: str
    price_hr: float | None = None
    stopped_hr: float | None = None
    host: str | None = None
    port: int | None = None
    user: str = "root"
    gpu: str = ""
    currency: str = "USD"
    stopped_at: float | None = None
    workdir: str | None = None

    @property
    def ssh_ready(self) -> bool:
        return self.state == "running" and bool(self.host) and bool(self.port)


@dataclass(frozen=True)
class SelfStop:
    """How an instance ends its own bill through the platform's API, from the machine itself
    (the budget guard's stop on a rental; see :mod:`gpumagic.rent.billstop`).

    Attributes
    ----------
    method, path : str
        The one request that stops (or releases) the instance, under the API's base URL.
    body : dict or None
        Its JSON body.
    status_path : str
        ``GET`` of the instance now, to confirm.
    field : tuple of str
        Where the state is in that answer (keys, outermost first).
    done : tuple of str
        The values of ``field`` that mean the bill stopped (a 404 there: the instance is gone).
    action : str
        ``stop`` or ``release``.
    spacing_s : float
        Least seconds between two requests (the platform's rate limit).
    """

    method: str
    path: str
    body: dict | None
    status_path: str
    field: tuple[str, ...]
    done: tuple[str, ...]
    action: str = "stop"
    spacing_s: float = 0.0


class Provider(ABC):
    """What gpumagic needs of a rental platform.  Every method makes API calls; none waits
    for a state (the waiting is :mod:`.rentals`' job)."""

    #: Short name (``runpod``), used in ``provider:offer`` and in the key store.
    name: str = ""
    #: Whether a stopped instance keeps its disk and can be started again.
    can_stop: bool = True
    #: Whether a stopped instance can be started again (AutoDL's elastic containers cannot).
    can_start: bool = True
    #: A shell command that ends the instance's bill from inside it, with no key (AutoDL: the
    #: container ends with its ``cmd``); None: only the API can (:meth:`self_stop`).
    end_inside: str | None = None
    #: Days the platform keeps a stopped instance's data before it releases it (``None``: no
    #: such limit known); ``%gpu rentals`` warns when one is near.
    keeps_stopped_days: float | None = None
    #: Which API (and version) the module was written against, for the docs and errors.
    api_version: str = ""
    #: The environment variables the platform puts into each instance: an API key scoped to
    #: that instance, and the instance's own id ("": it injects none, e.g. Lambda).
    instance_key_env: str = ""
    instance_id_env: str = ""
    #: Files the platform's images export those variables to for SSH sessions (their
    #: ``NAME=VALUE`` or ``export NAME="VALUE"`` lines), read after the program's own
    #: environment and before PID 1's (``/proc/1/environ``).
    instance_env_files: tuple[str, ...] = ()

    @property
    def base_url(self) -> str:
        """The API's root that :meth:`self_stop`'s paths hang from."""
        return self.api.base_url  # type: ignore[attr-defined]

    def self_stop(self, instance_id: str, *, release: bool = False) -> SelfStop:
        """The request that stops (``release``: terminates) ``instance_id`` and the read that
        confirms it, for the machine to send itself.

        Raises
        ------
        NotSupported
            A stop where the platform can only terminate.
        """
        raise NotSupported(f"{self.name} cannot stop an instance, only terminate it",
                           "add --release: the guard then releases it (its disk is lost)")

    @abstractmethod
    def offers(self, *, gpu: str | None = None, vram_gb: float | None = None, max_price: float | None = None,
               region: str | None = None, interruptible: bool | None = None) -> list[Offer]:
        """Offers available now that fit, cheapest first."""

    @abstractmethod
    def create(self, offer: Offer, *, name: str, public_key: str, disk_gb: int = 50,
               image: str | None = None) -> Instance:
        """Create one instance from ``offer``, reachable with ``public_key``.  Exactly one:
        a create that got no answer is looked up by ``name`` before anything is tried again
        (:class:`CreateTimeout` when it is not found)."""

    @abstractmethod
    def status(self, instance_id: str) -> Instance:
        """The instance now."""

    @abstractmethod
    def instances(self) -> list[Instance]:
        """Every instance of the account that is not terminated."""

    def stop(self, instance_id: str) -> None:
        raise NotSupported(f"{self.name} cannot stop an instance",
                           "`%gpu release NAME` terminates it (its disk is lost); pull results first")

    def start(self, instance_id: str) -> None:
        raise NotSupported(f"{self.name} cannot start a stopped instance", "rent a new one: `%gpu rent ...`")

    @abstractmethod
    def release(self, instance_id: str) -> None:
        """Terminate: the instance and its disk are gone, billing ends."""

    def balance(self) -> float | None:
        """Credit left, USD; ``None`` where the API does not say."""
        return None


def offer_matches(o: Offer, *, gpu: str | None, vram_gb: float | None, max_price: float | None,
                  region: str | None, interruptible: bool | None) -> bool:
    """The filters of ``%gpu offers``: ``gpu`` as a case-blind substring of the model
    (``4090``), at least ``vram_gb`` per GPU, at most ``max_price`` per hour (an offer with no
    price passes: its platform is given the cap with the create)."""
    if gpu and gpu.lower().replace(" ", "") not in o.gpu.lower().replace(" ", ""):
        return False
    if vram_gb is not None and (o.vram_gb is None or o.vram_gb < vram_gb):
        return False
    if max_price is not None and o.price_hr is not None and o.price_hr > max_price:
        return False
    if region and region.lower() not in o.region.lower():
        return False
    if interruptible is not None and o.interruptible != interruptible:
        return False
    return True
