"""Lend this computer's proxy to the machine (``%gpu proxy on``): a reverse tunnel plus the
proxy variables in the environment of every cell, session and job started after it.

What a student does by hand, in one step: ``ssh -R 7890:127.0.0.1:7890`` (here:
:class:`gpumagic.tunnel.ReverseTunnel`, loopback only), then ``export https_proxy=...`` on the
machine, and a ``no_proxy`` that keeps the machine's own mirrors and its cloud's metadata
endpoints direct (a proxy on the laptop cannot reach a mirror inside the machine's network
faster than the machine, and a metadata endpoint answers only from inside).

The variables are ``http_proxy``, ``https_proxy``, ``all_proxy`` and their upper-case forms
(curl reads only the lower-case ``http_proxy``; other tools read either), all
``http://127.0.0.1:P`` (Clash's and v2rayN's "mixed" and HTTP ports speak HTTP proxying,
CONNECT included; a ``socks5://`` all_proxy would break ``requests`` without PySocks), and
``no_proxy``/``NO_PROXY``.  They live on the laptop (:attr:`gpumagic.net.Net.proxy`),
added by :meth:`gpumagic.remote.environment.Environment.current`, because they are only true while the
tunnel is: nothing is written on the machine unless asked (``persist``: a marked block in the
login shell's start-up file, so terminals opened there get it too; ``off`` removes it, also
one left by an earlier notebook session).  A session started before ``on`` keeps its own
environment: restart it.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import GpumagicError
from . import catalog, settings

if TYPE_CHECKING:
    from ..tunnel import ReverseTunnel

#: The local port a laptop's proxy usually listens on (Clash's default mixed port).
DEFAULT_LOCAL_PORT = 7890
#: The variables that point at the proxy (each also in upper case).
PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy")
#: The variables that list the hosts reached directly.
NO_PROXY_VARS = ("no_proxy", "NO_PROXY")
#: Every variable ``%gpu proxy`` sets.
ALL_VARS = (*PROXY_VARS, *(v.upper() for v in PROXY_VARS), *NO_PROXY_VARS)


def no_proxy_hosts(existing: str | None, configured_urls: list[str]) -> list[str]:
    """The machine's ``no_proxy``: what it had, this machine and the metadata endpoints
    (``mirrors.json``'s direct hosts), every known mirror, and the mirrors it is set to use
    (``configured_urls``: pip's index URLs, ``HF_ENDPOINT``, ``~/.condarc``'s channels);
    each once, in that order.  Pure."""
    hosts = [h.strip() for h in (existing or "").split(",") if h.strip()]
    hosts += catalog.direct_hosts()
    hosts += [m.host for m in catalog.mirrors()]
    hosts += [h for h in (catalog.host_of(u) for u in configured_urls) if h]
    return list(dict.fromkeys(hosts))


def check_local_proxy(port: int, host: str = "127.0.0.1", timeout: float = 2.0) -> None:
    """Raise when nothing accepts connections on this computer's ``host:port``.

    Raises
    ------
    GpumagicError
        With what to start.
    """
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        raise GpumagicError(
            f"nothing accepts connections on this computer's {host}:{port} ({e.strerror or e})",
            "start your proxy (Clash, v2rayN...: its HTTP or mixed port), or give its port with "
            "--local PORT") from None


@dataclass
class Proxy:
    """This computer's proxy, lent to one machine.

    Attributes
    ----------
    tunnel : ReverseTunnel
        The machine's 127.0.0.1:P -> this computer's proxy.
    no_proxy : list of str
        The hosts reached directly (see :func:`no_proxy_hosts`).
    persisted : str or None
        The machine's start-up file that holds the variables (``--persist``), else None.
    """

    tunnel: "ReverseTunnel"
    no_proxy: list[str]
    persisted: str | None = None
    _persisted_url: str | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        """``http://127.0.0.1:P``, P the machine's end of the tunnel (it follows a move
        after a reconnect)."""
        return f"http://{self.tunnel.listen}"

    def environment(self) -> dict[str, str | None]:
        """The variables for new cells, sessions and jobs."""
        env: dict[str, str | None] = {}
        for var in PROXY_VARS:
            env[var] = env[var.upper()] = self.url
        for var in NO_PROXY_VARS:
            env[var] = ",".join(self.no_proxy)
        return env

    def follow_move(self, machine) -> None:
        """Rewrite the persisted block once the tunnel moved to another port (after a
        reconnect, when the old connection's sshd still held the port)."""
        if self.persisted is None or self._persisted_url == self.url:
            return
        self._persisted_url = self.url  # first: the write below runs a cell, which asks again
        self.persisted = write_block(machine, self)


def write_block(machine, proxy: Proxy) -> str:
    """Write the proxy's variables as a marked block in the machine's login-shell start-up
    file; returns its path."""
    pairs = [f"{k}={v}" for k, v in proxy.environment().items() if v is not None]
    path = settings.run(machine, "block-set", *pairs)["file"]
    proxy._persisted_url = proxy.url
    machine.env.forget()
    return path


def turn_on(machine, local_port: int = DEFAULT_LOCAL_PORT, *, remote_port: int | None = None,
            persist: bool = False) -> Proxy:
    """Lend this computer's proxy on ``local_port`` to ``machine`` (see the module).

    One round trip reads the machine's mirror settings (for ``no_proxy``), two ask for the
    reverse tunnel and check where it listens, one more writes the block with ``persist``.

    Raises
    ------
    GpumagicError
        Nothing listens on ``local_port`` here; the machine refused the tunnel (the
        one-line reason: :class:`gpumagic.errors.TunnelError`).
    """
    check_local_proxy(local_port)
    found = settings.run(machine, "read")
    env = {**machine.env.login(), **machine.env.settings()}  # the machine's own, without ours
    configured = [*found.get("pip_urls", []), *found.get("conda_urls", []),
                  *(u for u in (env.get("HF_ENDPOINT"), found.get("env", {}).get("HF_ENDPOINT")) if u)]
    existing = env.get("no_proxy") or env.get("NO_PROXY")
    if machine.net.proxy is not None:
        turn_off(machine, remove_blocks=False)
    tunnel = machine.tunnels.open_reverse(local_port, remote_port=remote_port, name="proxy")
    proxy = Proxy(tunnel, no_proxy_hosts(existing, configured))
    machine.net.proxy = proxy
    if persist:
        proxy.persisted = write_block(machine, proxy)
    return proxy


@dataclass
class ProxyOff:
    """What ``%gpu proxy off`` undid: the tunnel closed (or None) and the start-up files
    whose block was removed."""

    tunnel: "ReverseTunnel | None"
    removed: list[str]


def turn_off(machine, *, remove_blocks: bool = True) -> ProxyOff:
    """Stop lending the proxy: close the tunnel, drop the variables (new cells get none),
    and remove the persisted block from every start-up file that has one (one round trip;
    also a block an earlier notebook session left)."""
    proxy, machine.net.proxy = machine.net.proxy, None
    tunnel = None
    if proxy is not None:
        tunnel = proxy.tunnel
        for r in machine.tunnels.reverse_tunnels():
            if r is tunnel:
                machine.tunnels.close_reverse(r.id)
        tunnel.stop(raise_errors=False)
    removed: list[str] = []
    if remove_blocks:
        removed = settings.run(machine, "block-remove")["removed"]
        if removed:
            machine.env.forget()
    return ProxyOff(tunnel, removed)
