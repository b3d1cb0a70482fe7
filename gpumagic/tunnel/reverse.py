"""Remote port forwards: the machine's ``127.0.0.1:P`` reaches this computer's
``127.0.0.1:L`` over the SSH connection (what ``ssh -R P:127.0.0.1:L`` does).

The machine's sshd listens (``tcpip-forward``, RFC 4254 section 7.1) and sends each connection
it accepts back as a ``forwarded-tcpip`` channel; gpumagic connects that channel to the local
port.  The use it is built for: lending the laptop's proxy (Clash, v2rayN on 127.0.0.1:7890)
to a machine that cannot reach GitHub or Hugging Face itself (:mod:`gpumagic.net`).

Where it listens
----------------
Always on the machine's ``127.0.0.1`` only.  gpumagic asks for 127.0.0.1, and then reads the
machine's listening sockets (``/proc/net/tcp``, ``remote/programs/net-listeners.py``): an
sshd with ``GatewayPorts yes`` binds every interface whatever the client asks, which would
open the laptop's proxy to the internet, so such a tunnel is closed at once and refused with
that reason.

When it is refused
------------------
The protocol's answer to a refused ``tcpip-forward`` says nothing but "no".  gpumagic tells
the cases apart: the port is held by another of its reverse tunnels, or something listens
there on the machine (taken: a port that was only the default moves to one the server
chooses, as a local tunnel moves to a free local port), or a port below 1024 for a user who
is not root, or else the server's configuration forbids it (``AllowTcpForwarding no`` or
``local``, ``DisableForwarding``, ``PermitListen``).

After a reconnect
-----------------
The listener lives as long as the SSH connection.  When the connection is opened again
(:attr:`gpumagic.ssh.connection.Connection.after_open`), the tunnel asks for the same port
again; when the old connection's sshd still holds it (a roam: the server has not yet noticed
that the old connection is gone), it moves to a port the server chooses and
:attr:`ReverseTunnel.remote_port` says where (the proxy's variables follow it).

Moving bytes
------------
Each forwarded connection has two threads (reused, :class:`gpumagic.tunnel.forward._Workers`):
one copies the channel to the local socket (``Channel.recv``, which gives the window back),
one the local socket to the channel (``sendall_ordered``, which never races the channel's
CLOSE).  An EOF is passed on in each direction (half-close), and both ends are closed once
both directions ended.  Faults on these threads are recorded (:attr:`ReverseTunnel.faults`)
and raised by :meth:`ReverseTunnel.check`, by :meth:`ReverseTunnel.stop` and at the end of a
``with`` block; a client that simply goes away is not a fault.
"""

from __future__ import annotations

import socket
import threading

import paramiko

from ..errors import ConnectionLost, GpumagicError, TunnelError
from ..remote.execution import run_program
from ..ssh._paramiko import close_without_eof, send_eof, sendall_ordered, transport_dropped
from .forward import CHUNK, TunnelBase, _Workers
from .ports import is_loopback, machine_is_this_computer

#: The only address a reverse tunnel listens on, on the machine.
LISTEN_HOST = "127.0.0.1"
#: The machine-side program that lists a port's listening addresses.
LISTENERS_PROGRAM = "net-listeners.py"

_LOCAL_GONE = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)

#: Why the server may refuse a remote forward, when the port is not taken.
FORBIDDEN = ("the machine's sshd refuses remote port forwarding (sshd_config: AllowTcpForwarding "
             "no or local, DisableForwarding yes, or a PermitListen that leaves this port out)")
FORBIDDEN_HINT = ("where you administer the machine: `AllowTcpForwarding yes` in /etc/ssh/sshd_config, "
                  "then restart sshd; elsewhere use the platform's own accelerator (AutoDL: "
                  "`source /etc/network_turbo`) or `%gpu mirrors`")


def listening_addresses(connection, port: int) -> list[str] | None:
    """The addresses that listen on TCP ``port`` on the machine (one round trip); None when
    the machine cannot tell (no ``/proc/net/tcp``: not Linux)."""
    r = run_program(connection, LISTENERS_PROGRAM, port, timeout=connection.spec.connect_timeout)
    lines = r.stdout.split()
    if r.exit_code != 0 or "noproc" in lines:
        return None
    return lines


class _Pair:
    """One forwarded connection: the channel from the machine and the local socket."""

    def __init__(self, number: int, chan: paramiko.Channel, sock: socket.socket):
        self.number = number
        self.chan = chan
        self.sock = sock
        self.down = 0  # bytes machine -> this computer
        self.up = 0    # bytes this computer -> machine
        self.down_done = threading.Event()
        self.closed = False

    def abort(self) -> None:
        """Wake both threads (safe from any thread, safe twice)."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        close_without_eof(self.chan)


class ReverseTunnel(TunnelBase):
    """Make ``127.0.0.1:remote_port`` on the machine reach ``local_host:local_port`` here.

    Parameters
    ----------
    connection : gpumagic.ssh.connection.Connection
        The machine's SSH connection (the listener lives as long as it; it is asked for again
        after a reconnect).
    local_port : int
        Port on this computer (the laptop's proxy: 7890).
    remote_port : int, optional
        Port to listen on at the machine's 127.0.0.1 (default: the same number).  When it is
        taken there, a port given here is refused; the default moves to one the server
        chooses (:attr:`moved_from`, :attr:`moved_reason`).
    local_host : str
        Where the connections go on this computer (default 127.0.0.1).
    name : str
        What is forwarded ("proxy"), for listings.
    taken : dict of int to str, optional
        Machine ports that are taken, each with who holds it (the manager passes its other
        reverse tunnels).

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    _lost_state = "SSH connection lost: listens again after the reconnect"

    def __init__(self, connection, local_port: int, *, remote_port: int | None = None,
                 local_host: str = "127.0.0.1", name: str = "", taken: dict[int, str] | None = None):
        for what, p in (("local", local_port), ("remote", remote_port)):
            if p is not None and not 0 < int(p) < 65536:
                raise TunnelError(f"{what} port {p} is not a TCP port number", "give a port between 1 and 65535")
        self.connection = connection
        self.local_port = int(local_port)
        self.local_host = local_host
        self.explicit = remote_port is not None
        self.wanted_port = int(remote_port if remote_port is not None else local_port)
        self.name = name or f"this computer's port {local_port}"
        self.taken = dict(taken or {})
        #: The port the machine listens on (None until started).
        self.remote_port: int | None = None
        #: The machine port that was wanted but taken, when the tunnel moved to another one.
        self.moved_from: int | None = None
        #: Why it moved, completing "port N on the machine ..."; empty when it did not.
        self.moved_reason = ""
        self.reconnects = 0
        self._lock = threading.Lock()
        self._init_counts()
        self._workers = _Workers(f"gpumagic-reverse-{self.local_port}")
        self._state = "new"  # new -> open -> closed | failed: ...

    # -- life cycle -------------------------------------------------------------------

    def start(self) -> "ReverseTunnel":
        """Ask the machine to listen and start forwarding; the listener is up on return.

        Raises
        ------
        TunnelError
            The server refused (the one-line reason says why: taken, forbidden by its
            sshd_config, a privileged port), or it would listen on every interface
            (GatewayPorts yes).
        ConnectionLost
            The connection cannot be opened.
        """
        if self._state == "open":
            return self
        if self._state != "new":
            raise TunnelError(f"{self.label} was closed", "open a new one")
        port = self.wanted_port
        if (machine_is_this_computer(self.connection) and is_loopback(self.local_host)
                and port == self.local_port):
            # The machine is this computer: its 127.0.0.1:L is the local port itself.
            if self.explicit:
                raise TunnelError(f"port {port} on the machine is this computer's port {port} "
                                  f"({self.connection.spec.address} is this computer): it would "
                                  "forward to itself", "give another --remote-port")
            self._move(port, f"is this computer's port {port} too ({self.connection.spec.address} "
                             "is this computer)")
            port = 0
        if port in self.taken:
            if self.explicit:
                raise TunnelError(f"port {port} on the machine is taken by {self.taken[port]}",
                                  "give another --remote-port, or close that tunnel first")
            self._move(port, f"is taken by {self.taken[port]}")
            port = 0
        self.remote_port = self._listen(port)
        self._check_loopback_only()
        self.connection.after_open.append(self._reopened)
        self._state = "open"
        return self

    def _move(self, port: int, reason: str) -> None:
        self.moved_from, self.moved_reason = port, reason

    def _listen(self, port: int) -> int:
        """Ask for ``port`` (0: any); when refused, find out why and move or raise."""
        try:
            return self.connection.forward_remote(port, self._accepted, LISTEN_HOST)
        except paramiko.SSHException as e:
            refusal = e
        reason, taken = self._why_refused(port)
        if taken and not self.explicit and port:
            self._move(port, reason)
            try:
                return self.connection.forward_remote(0, self._accepted, LISTEN_HOST)
            except paramiko.SSHException as e:
                refusal = e
            reason, taken = self._why_refused(0)
        hint = ("give another --remote-port (or none: the server picks a free one)" if taken
                else "give --remote-port 1024 or higher" if port and port < 1024 else FORBIDDEN_HINT)
        raise TunnelError(f"the machine refused to listen on {LISTEN_HOST}:{port or '(any port)'}: {reason}",
                          hint) from refusal

    def _why_refused(self, port: int) -> tuple[str, bool]:
        """(one line saying why the server refused ``port``, whether it is taken)."""
        if port and port < 1024 and self.connection.spec.user != "root":
            return f"ports below 1024 need root on the machine (you are {self.connection.spec.user})", False
        if port:
            listening = listening_addresses(self.connection, port)
            if listening:
                return f"port {port} on the machine is taken (something listens on {', '.join(listening)})", True
        return FORBIDDEN, False

    def _check_loopback_only(self) -> None:
        """Close the listener and raise when the machine's sshd bound it beyond loopback."""
        port = self.remote_port
        assert port is not None
        listening = listening_addresses(self.connection, port)
        wide = [a for a in listening or [] if not is_loopback(a) or a in ("0.0.0.0", "::")]
        if not wide:
            return
        self.connection.cancel_remote(port, LISTEN_HOST)
        self._state = "failed: listened on every interface"
        where = ", ".join(f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in wide)
        raise TunnelError(
            f"the machine's sshd listened on {where}, not on {LISTEN_HOST} only "
            "(sshd_config GatewayPorts yes): this computer's port would be open to the internet; "
            "closed it", "set `GatewayPorts no` (or clientspecified) in the machine's "
                         "/etc/ssh/sshd_config and restart sshd")

    def _reopened(self, connection) -> None:
        """After-open phase: ask the new transport for the listener again.  Whatever goes
        wrong is a fault of this tunnel (shown after the cell, raised by :meth:`check`),
        never an error of the reconnect itself."""
        try:
            self._listen_again(connection)
        except Exception as e:  # noqa: BLE001 - recorded, re-raised by check()
            self._fault(None, f"could not listen again after the reconnect: {type(e).__name__}: {e}", e)

    def _listen_again(self, connection) -> None:
        if self._state != "open":
            return
        old = self.remote_port
        assert old is not None
        with self._lock:
            self.reconnects += 1
        try:
            self.remote_port = connection.forward_remote(old, self._accepted, LISTEN_HOST)
            return
        except paramiko.SSHException:
            pass
        except GpumagicError as e:
            self._fault(None, f"could not listen again after the reconnect: {e.message}", e)
            return
        try:  # still held (by the old connection's sshd, most often): any port
            self.remote_port = connection.forward_remote(0, self._accepted, LISTEN_HOST)
            self._move(old, "was still held on the machine after the reconnect (the old connection's sshd)")
        except (paramiko.SSHException, GpumagicError) as e:
            with self._lock:
                self._state = "failed: not listening after the reconnect"
            self._fault(None, f"could not listen on the machine again after the reconnect: {e}", e)

    def _stop_listening(self, was_open: bool) -> None:
        """Stop listening on the machine, and after a reconnect too (:meth:`stop`)."""
        if self._reopened in self.connection.after_open:
            self.connection.after_open.remove(self._reopened)
        if was_open and self.remote_port is not None:
            try:
                self.connection.cancel_remote(self.remote_port, LISTEN_HOST)
            except (paramiko.SSHException, EOFError, OSError) as e:
                self._fault(None, f"could not stop listening on the machine: {e}", e)

    # -- what to show -----------------------------------------------------------------

    @property
    def id(self) -> str:
        """What ``%gpu tunnel list`` shows and ``%gpu tunnel close`` takes: ``R`` and the
        machine's port."""
        return f"R{self.remote_port if self.remote_port is not None else self.wanted_port}"

    @property
    def listen(self) -> str:
        """Where the machine listens: ``127.0.0.1:P``."""
        return f"{LISTEN_HOST}:{self.remote_port if self.remote_port is not None else self.wanted_port}"

    @property
    def target(self) -> str:
        """Where its connections go on this computer: ``host:port``."""
        return f"{self.local_host}:{self.local_port}"

    @property
    def label(self) -> str:
        return f"reverse tunnel {self.id} (the machine's {self.listen} -> this computer's {self.target})"

    def __repr__(self) -> str:
        return f"<ReverseTunnel {self.name}: machine {self.listen} -> {self.target} {self.state}>"

    # -- threads ----------------------------------------------------------------------

    def _accepted(self, chan: paramiko.Channel, origin: tuple) -> None:
        """paramiko's transport thread: a connection to the machine's listener."""
        with self._lock:
            if self._state != "open":
                number = 0
            else:
                self.connections_total += 1
                number = self.connections_total
        if not number:
            chan.close()
            return
        self._workers.submit(self._serve, number, chan)

    def _serve(self, number: int, chan: paramiko.Channel) -> None:
        """Connect the channel to the local port and copy both ways; never raises."""
        try:
            sock = socket.create_connection((self.local_host, self.local_port),
                                            timeout=self.connection.spec.connect_timeout)
        except OSError as e:
            close_without_eof(chan)
            self._fault(number, f"nothing accepts connections on this computer's {self.target} "
                                f"({e.strerror or e})",
                        TunnelError(str(e), f"start the program that listens on {self.target} here "
                                            "(your proxy: Clash, v2rayN...), or give another local port"))
            return
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pair = _Pair(number, chan, sock)
        with self._lock:
            if self._state != "open":
                pair.abort()
                sock.close()
                return
            self._connections[number] = pair
        try:
            self._workers.submit(self._copy_down, pair)
            self._copy_up(pair)
            pair.down_done.wait()
        except BaseException as e:  # noqa: BLE001 - recorded, re-raised by check()
            if not pair.closed:
                self._fault(number, self._what_failed(pair, e), e)
        finally:
            pair.abort()
            sock.close()
            self._ended(number, pair)

    def _copy_up(self, pair: _Pair) -> None:
        """This computer -> machine until the local EOF, then the channel's EOF."""
        view = memoryview(bytearray(CHUNK))
        try:
            while True:
                n = pair.sock.recv_into(view)
                if not n:
                    break
                sendall_ordered(pair.chan, view[:n])
                pair.up += n
            if not pair.chan.closed:
                send_eof(pair.chan)
        except _LOCAL_GONE:
            pair.abort()
        except (OSError, EOFError, paramiko.SSHException) as e:
            if not (pair.closed or pair.chan.closed):
                self._fault(pair.number, self._what_failed(pair, e), e)
            pair.abort()

    def _copy_down(self, pair: _Pair) -> None:
        """Machine -> this computer until the channel's EOF, then the local EOF (a worker)."""
        try:
            while True:
                data = pair.chan.recv(CHUNK)
                if not data:
                    break
                pair.sock.sendall(data)
                pair.down += len(data)
            if not pair.closed and transport_dropped(pair.chan.get_transport()) and not pair.chan.eof_received:
                raise ConnectionLost("the SSH connection dropped during a transfer",
                                     "the tunnel listens again after the reconnect")
            try:
                pair.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        except _LOCAL_GONE:
            pair.abort()
        except (OSError, EOFError, paramiko.SSHException, ConnectionLost) as e:
            if not pair.closed:
                self._fault(pair.number, self._what_failed(pair, e), e)
            pair.abort()
        finally:
            pair.down_done.set()

    @staticmethod
    def _what_failed(pair: _Pair, e: BaseException) -> str:
        if transport_dropped(pair.chan.get_transport()):
            return "the SSH connection dropped during a transfer"
        if isinstance(e, GpumagicError):
            return e.message
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
