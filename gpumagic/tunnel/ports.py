"""Local ports for tunnels: checking a wanted one, binding one on 127.0.0.1, and telling
loopback addresses (a machine that is this computer: the loop guard's question).

A tunnel listens on ``127.0.0.1`` only, never on all interfaces.  A wanted port that is
taken moves the tunnel to one of the next ports, else to any free one; the caller says which
ports must never be used (see :meth:`gpumagic.tunnel.manager.TunnelManager.open`).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import sys

from ..errors import TunnelError

#: How many ports after a taken one are tried before asking the OS for any free port.
PORT_SCAN = 20


def check_local_port(local_port: int | None) -> None:
    """Refuse a local port that cannot be bound, before anything is started on the machine.

    Raises
    ------
    TunnelError
        For anything but None or a whole number from 0 (any free port) to 65535.
    """
    if local_port is None:
        return
    if isinstance(local_port, bool) or not isinstance(local_port, int) or not 0 <= local_port <= 65535:
        raise TunnelError(f"local port {local_port!r} is not a port number",
                          "give a whole number from 1 to 65535 (0: any free port)")


def bind_local(wanted: int, avoid=()) -> socket.socket:
    """A socket listening on 127.0.0.1: ``wanted``, else one of the next ports, else any;
    never one of the ``avoid`` ports.

    A port counts as taken when binding 127.0.0.1 fails, and also when another program
    listens on ::1 with it (a browser given ``localhost:PORT`` may go there).  No
    ``SO_REUSEADDR``: on BSD/macOS it would let us bind 127.0.0.1 under another program's
    wildcard listener and half-share its port.

    Raises
    ------
    TunnelError
        When no port can be bound at all.
    """
    candidates = [] if wanted == 0 else [p for p in range(wanted, min(wanted + PORT_SCAN, 65536))
                                         if p not in avoid]
    candidates += [0] * 3  # any free port (asked again if the OS picks one to avoid)
    last: OSError | None = None
    for port in candidates:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if sys.platform == "win32" and hasattr(socket, "SO_EXCLUSIVEADDRUSE"):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_EXCLUSIVEADDRUSE, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen(128)
            if port and _ipv6_loopback_taken(port):
                raise OSError(errno.EADDRINUSE, "in use on ::1")
            if s.getsockname()[1] in avoid:  # the OS's pick: ask again
                raise OSError(errno.EADDRINUSE, "a port to avoid")
            return s
        except OSError as e:
            s.close()
            last = e
    raise TunnelError(f"cannot listen on any local port on 127.0.0.1: {last}",
                      "close some programs holding ports, then try again")


def _ipv6_loopback_taken(port: int) -> bool:
    if not socket.has_ipv6:
        return False
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind(("::1", port))
        return False
    except OSError as e:
        return e.errno == errno.EADDRINUSE
    finally:
        s.close()


def is_loopback(host: str) -> bool:
    """True for a name or address that means "this computer" to whoever connects to it
    (``localhost``, 127.0.0.0/8, ``::1``, and 0.0.0.0 / ``::``, which Linux connects to
    as loopback)."""
    host = host.strip("[]").lower()
    if host in ("localhost", "localhost.localdomain", "ip6-localhost") or host.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified


def machine_is_this_computer(connection) -> bool:
    """True when the machine's SSH address is this computer's loopback (the sandbox, a
    local test server) with no ProxyJump: its ``localhost`` is then ours too.  (An
    ``ssh -L`` forward to another computer looks the same; treating it as here only moves
    a tunnel to another local port.)"""
    spec = connection.spec
    return not spec.proxy_jump and is_loopback(spec.hostname)
