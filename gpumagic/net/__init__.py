"""The machine's way out: the laptop's proxy lent over SSH (:mod:`.proxy`), what the machine
can reach (:mod:`.doctor`), and the mirrors a machine in China needs (:mod:`.mirrors`).

The list of mirrors, the hosts kept direct and the upstreams measured are data
(``mirrors.json``, read by :mod:`.catalog`); what changes the machine's files is one
machine-side program (``remote/programs/net-settings.py``, run by :mod:`.settings`).
:class:`Net` is all of it for one machine (``machine.net``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import doctor as _doctor
from .catalog import Target
from .doctor import NetReport
from .mirrors import MirrorChange, in_use, set_mirror, unset_mirror
from .proxy import DEFAULT_LOCAL_PORT, Proxy, ProxyOff, turn_off, turn_on

if TYPE_CHECKING:
    from .._types import MachineLike


class Net:
    """One machine's way out (:attr:`Machine.net <gpumagic.Machine.net>`): the proxy
    this computer lends it (:meth:`proxy_on`, :attr:`proxy`), the mirrors it uses
    (:meth:`mirrors`), and what it can reach (:meth:`doctor`).

    Parameters
    ----------
    machine : MachineLike
        The machine whose cells these change (through its :attr:`env`).
    """

    def __init__(self, machine: MachineLike):
        self.machine = machine
        #: The laptop's proxy lent to this machine (``%gpu proxy on``), or None.
        self.proxy: Proxy | None = None

    def proxy_on(self, local_port: int = DEFAULT_LOCAL_PORT, *, remote_port: int | None = None,
                 persist: bool = False) -> Proxy:
        """Lend this computer's proxy (Clash, v2rayN on 127.0.0.1:``local_port``) to the
        machine: a reverse tunnel, and ``http_proxy``/``https_proxy``/``all_proxy`` (and upper
        case) with a ``no_proxy`` that keeps the machine's mirrors and metadata endpoints
        direct, in every cell, session and job started after it; see
        :func:`gpumagic.net.proxy.turn_on`.

        Parameters
        ----------
        local_port : int
            The proxy's port on this computer.
        remote_port : int, optional
            Port on the machine's 127.0.0.1 (default: the same; another if taken).
        persist : bool
            Also write the variables into the login shell's start-up file on the machine
            (a marked block that :meth:`proxy_off` removes), for terminals opened there.

        Raises
        ------
        GpumagicError, TunnelError
        """
        return turn_on(self.machine, local_port, remote_port=remote_port, persist=persist)

    def proxy_off(self) -> ProxyOff:
        """Undo :meth:`proxy_on`: close the tunnel, new cells get no proxy variable, and a
        persisted block is removed (also one an earlier session left)."""
        return turn_off(self.machine)

    def environment(self) -> dict[str, str | None]:
        """The proxy's variables while it is lent (:meth:`gpumagic.net.proxy.Proxy.environment`),
        else none: what :meth:`gpumagic.remote.environment.Environment.current` adds last."""
        if self.proxy is not None and self.proxy.tunnel.stopped:
            self.proxy = None  # its tunnel was closed (`%gpu tunnel close R...`): the variables go too
        if self.proxy is None:
            return {}
        self.proxy.follow_move(self.machine)
        return self.proxy.environment()

    def mirrors(self, kind: str, name: str | None = None) -> MirrorChange:
        """Make this machine use a well-known mirror (``%gpu mirrors``): ``kind`` ``pip``
        (``pip config --user``), ``hf`` (``HF_ENDPOINT`` for new cells, sessions and jobs) or
        ``conda`` (``~/.condarc``); ``name`` from ``gpumagic/net/mirrors.json`` (default: the
        kind's first).  Returns the change (``.before``, ``.after``, ``.text``);
        :meth:`mirrors_off` undoes it.

        Raises
        ------
        ConfigError
            An unknown kind or mirror name (naming those that exist).
        """
        return set_mirror(self.machine, kind, name)

    def mirrors_off(self, kind: str) -> MirrorChange:
        """Undo :meth:`mirrors` for ``kind``: what was there before comes back."""
        return unset_mirror(self.machine, kind)

    def mirrors_in_use(self) -> dict[str, str]:
        """What each kind (pip, hf, conda) uses on the machine now: kind -> URL, "(not set: the
        upstream)" for none (one round trip)."""
        return in_use(self.machine)

    def targets(self) -> list[Target]:
        """What :meth:`doctor` measures by default: the upstreams (PyPI, the PyTorch wheel
        index, Hugging Face, GitHub, conda-forge), the mirrors this machine uses and each
        kind's default mirror (one round trip to read which are in use)."""
        return _doctor.machine_targets(self.machine)

    def doctor(self, targets: list[Target] | None = None, *, timeout: float | None = None,
               read_time: float | None = None) -> NetReport:
        """What the machine can reach, how fast, and what to do (``%gpu doctor --net``): each
        target's time to first byte and throughput, measured from the machine at once
        within ``timeout`` (s, default 4) plus ``read_time`` (s, default 2); see
        :func:`gpumagic.net.doctor.run`.

        Parameters
        ----------
        targets : list of gpumagic.net.catalog.Target, optional
            What to measure (default: :meth:`targets`).

        Returns
        -------
        NetReport
            ``.text`` one line per target with its verdict and hint; ``.results``.
        """
        return _doctor.run(self.machine, self.targets() if targets is None else targets,
                           timeout=_doctor.TIMEOUT if timeout is None else timeout,
                           read_time=_doctor.READ_TIME if read_time is None else read_time)

    def close(self) -> None:
        """Forget the proxy (its tunnel closes with the machine's)."""
        self.proxy = None
