"""Local port forwards over the machine's SSH connection (what ``ssh -L`` does).

A :class:`Tunnel` listens on ``127.0.0.1`` only (never on all interfaces) and forwards each
accepted connection through its own SSH ``direct-tcpip`` channel (RFC 4254 section 7.2) to a
host and port *as the machine sees them*, so a service bound to the machine's 127.0.0.1 is
reachable without opening it to the internet.

How it moves bytes
------------------
* One thread at a time waits on the listening socket and a wake-up socket pair (a selector,
  no polling).  The thread that accepts a connection serves it and hands listening on to an
  idle worker (leader/follower: no thread handoff before the first request); it opens the
  channel (so a slow or refused remote service never stalls the others), sends the request
  that is usually already waiting, then copies remote -> local while a second worker copies
  local -> remote.  Both copy loops block on large reads (1 MiB): bytes move as soon as they
  arrive, with no sleep and little per-chunk overhead.  Worker threads are reused.
* Channels ask for a 16 MiB window and 256 KiB - 1 KiB packets (OpenSSH accepts packets up to
  256 KiB; paramiko's default of 32 KiB costs one Python round trip per 32 KiB).  Local
  sockets have ``TCP_NODELAY`` so small requests are not held back by Nagle's algorithm.

Failures
--------
* DATA and EOF on a channel are sent while holding the transport's send lock, so they can never
  follow the channel's CLOSE (see ``connection.send_eof``: sshd drops the whole connection then).
* When the remote side ends a connection (EOF), the local connection is closed too.  (OpenSSH
  keeps the client's sending half open until the client closes; for HTTP, WebSocket and
  the other protocols a browser speaks this makes no difference.)
* When the machine is this computer (the sandbox), a tunnel never listens on a port that its
  own remote side (or another tunnel's) would connect to: that would forward in a loop until
  the file descriptors run out (see :meth:`TunnelManager.open`).
* When the SSH connection dropped, the next local connection re-opens it
  (``Connection.ensure_open``), so the same URL keeps working.
* Anything that goes wrong on a background thread is recorded as a :class:`TunnelFault`
  (``tunnel.faults``), shown by ``%gpu tunnel list``, and raised as :class:`TunnelError` by
  :meth:`Tunnel.check`, by :meth:`Tunnel.stop` and when the ``with`` block ends.  A local
  client that simply goes away (a browser closing a connection) is not a fault.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import queue
import selectors
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field

import paramiko

from .connection import send_eof, sendall_ordered
from .errors import ConnectionLost, GpumagicError, TunnelError

log = logging.getLogger(__name__)

#: Channel flow-control window asked of the server (bytes).
WINDOW_SIZE = 16 * 1024 * 1024
#: Largest SSH packet we accept on a tunnel channel (bytes).  OpenSSH's limit is 256 KiB for
#: a whole packet (``PACKET_MAX_SIZE`` in packet.c); 1 KiB is left for headers and padding.
MAX_PACKET_SIZE = 255 * 1024
#: Bytes asked for by one read in the copy loops.
CHUNK = 1024 * 1024
#: Seconds ``stop`` waits for the forwarding threads to finish.
JOIN_TIMEOUT = 5.0
#: How many ports after a taken one are tried before asking the OS for any free port.
PORT_SCAN = 20

_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)  # not on Windows: the first read is skipped there

# Errors of a local client that went away; they end that connection quietly.
_LOCAL_GONE = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


@dataclass
class TunnelFault:
    """Something that went wrong on a tunnel's background thread.

    Attributes
    ----------
    when : float
        ``time.time()`` of the fault (seconds since the epoch).
    connection : int or None
        Number of the local connection (1, 2, ...), None for the listener itself.
    message : str
        One line for the user.
    error : BaseException
        The exception caught on the thread (its traceback kept).
    """

    when: float
    connection: int | None
    message: str
    error: BaseException = field(repr=False)


class _Workers:
    """Daemon threads reused across connections (a new thread costs ~0.1 ms per request).

    A task goes to an idle worker, else to a new one, so every connection always has its
    threads (no cap, no queueing behind a slow connection).  Daemon threads, unlike
    ``concurrent.futures``, never hold up the interpreter's exit.
    """

    def __init__(self, name: str):
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._closing = False
        self.threads: list[threading.Thread] = []

    def submit(self, fn, *args) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                t = threading.Thread(target=self._work, daemon=True,
                                     name=f"{self.name}-{len(self.threads) + 1}")
                self.threads.append(t)
                t.start()
        self._queue.put((fn, args))

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args = item
            fn(*args)  # tasks record their own faults
            with self._lock:
                if self._closing:
                    return
                self._idle += 1

    def shutdown(self, timeout: float) -> None:
        """Let every worker finish its task and exit; wait up to ``timeout`` seconds."""
        with self._lock:
            self._closing = True
            threads = list(self.threads)
        for _ in threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))


class _Forward:
    """One accepted local connection and its channel."""

    def __init__(self, number: int, sock: socket.socket, peer):
        self.number = number
        self.sock = sock
        self.peer = peer
        self.chan: paramiko.Channel | None = None
        self.down = 0  # bytes remote -> local (written only by the down thread)
        self.up = 0    # bytes local -> remote (written only by the up thread)
        self.closed = False

    def abort(self) -> None:
        """Wake both copy loops and close both ends (safe from any thread, safe twice)."""
        self.closed = True
        try:
            # Wakes a recv blocked in another thread without sending FIN (the close that
            # follows sends FIN, or a reset after _reset).
            self.sock.shutdown(socket.SHUT_RD)
        except OSError:
            pass
        if self.chan is not None:
            try:
                self.chan.close()
            except (EOFError, OSError, paramiko.SSHException):
                pass  # the SSH connection is gone, and with it the channel


class Tunnel:
    """Forward ``127.0.0.1:local_port`` on this computer to ``remote_host:remote_port`` as the
    machine sees it.

    Parameters
    ----------
    connection : gpumagic.connection.Connection
        The machine's SSH connection (re-opened on the next local connection after a drop).
    remote_port : int
        Port on the machine (or on ``remote_host`` as the machine resolves it).
    remote_host : str
        Host to connect to *from the machine* (default ``localhost``, which reaches services
        bound to 127.0.0.1, ::1 or all interfaces).
    local_port : int, optional
        Wanted local port (default: the same number as ``remote_port``).  When it is taken,
        the next free one is used (see :attr:`local_port`, :attr:`moved_from` and
        :attr:`moved_reason`).
    avoid_ports : dict of int to str, optional
        Local ports never to bind, each with the reason to show when the wanted one is among
        them (:class:`TunnelManager` passes the ports whose listener would be reached by a
        tunnel's own remote side when the machine is this computer).
    name : str
        What is forwarded ("tensorboard", "jupyter", "port 8000"), for listings.
    path : str
        Path (and query) appended to the URL, e.g. ``/lab?token=...``.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(self, connection, remote_port: int, *, remote_host: str = "localhost",
                 local_port: int | None = None, name: str = "", path: str = "/",
                 avoid_ports: dict[int, str] | None = None,
                 window_size: int = WINDOW_SIZE, max_packet_size: int = MAX_PACKET_SIZE):
        if not 0 < int(remote_port) < 65536:
            raise TunnelError(f"remote port {remote_port} is not a TCP port number",
                              "give a port between 1 and 65535")
        if local_port is not None and not 0 <= int(local_port) < 65536:
            raise TunnelError(f"local port {local_port} is not a TCP port number",
                              "give a port between 1 and 65535 (or 0 for any free port)")
        self.connection = connection
        self.remote_host = remote_host
        self.remote_port = int(remote_port)
        self.wanted_port = int(remote_port if local_port is None else local_port)
        self.avoid_ports = dict(avoid_ports or {})
        self.name = name or f"port {remote_port}"
        self.path = path if path.startswith("/") else "/" + path
        self.window_size = window_size
        self.max_packet_size = max_packet_size
        self.local_port: int | None = None
        #: The port that was wanted but taken, when the tunnel moved to another one.
        self.moved_from: int | None = None
        #: Why it moved, completing "local port N ..." (e.g. "is taken by another program
        #: (left alone)"); empty when it did not move.
        self.moved_reason = ""
        self.faults: list[TunnelFault] = []
        #: The remote service (TensorBoard, Jupyter) this tunnel was opened for, if any.
        self.service: RemoteService | None = None
        self._reported = 0  # faults already raised or shown
        self.connections_total = 0
        self.reconnects = 0
        self._done_down = 0
        self._done_up = 0
        self._forwards: dict[int, _Forward] = {}
        self._workers = _Workers(f"gpumagic-tunnel-{self.wanted_port}")
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._selector: selectors.BaseSelector | None = None
        self._state = "new"  # new -> open -> closed | failed
        self._opened_seen = 0  # connection.opened_count when last seen

    # -- life cycle -------------------------------------------------------------------

    def start(self) -> "Tunnel":
        """Bind the local port and start forwarding.

        The listening socket is bound and listening before this returns, so :attr:`url`
        works as soon as it is shown.

        Raises
        ------
        TunnelError
            No local port could be bound.
        ConnectionLost, GpumagicError
            The machine's connection cannot be opened.
        """
        if self._state == "open":
            return self
        if self._state != "new":
            raise TunnelError(f"tunnel {self.name} was closed", "open a new tunnel")
        self.connection.ensure_open()
        self._opened_seen = self.connection.opened_count
        self._listener = _bind_local(self.wanted_port, avoid=self.avoid_ports)
        self.local_port = self._listener.getsockname()[1]
        if self.local_port != self.wanted_port and self.wanted_port != 0:
            self.moved_from = self.wanted_port
            self.moved_reason = self.avoid_ports.get(self.wanted_port,
                                                     "is taken by another program (left alone)")
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._state = "open"
        self._workers.submit(self._listen_and_serve)
        return self

    def stop(self, raise_errors: bool = True) -> None:
        """Close the listener and every forwarded connection; safe to call twice.

        Parameters
        ----------
        raise_errors : bool
            Raise :class:`TunnelError` for faults not yet reported (default).  With False
            they stay in :attr:`faults` for the caller to show.
        """
        with self._lock:
            was_open = self._state == "open"
            if self._state in ("new", "open"):
                self._state = "closed"
            forwards = list(self._forwards.values())
        if was_open and self._wake_w is not None:
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass
        for f in forwards:
            f.abort()
        self._workers.shutdown(JOIN_TIMEOUT)
        if self._selector is not None:
            self._selector.close()
        for s in (self._listener, self._wake_r, self._wake_w):
            if s is not None:
                s.close()
        if raise_errors:
            self.check()

    def __enter__(self) -> "Tunnel":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        # Faults from the threads are raised here unless another exception is on its way.
        self.stop(raise_errors=exc_type is None)

    def check(self) -> None:
        """Raise :class:`TunnelError` for faults recorded since the last check.

        Raises
        ------
        TunnelError
            Naming how many faults and the first one; ``__cause__`` is its exception.
        """
        with self._lock:
            new = self.faults[self._reported:]
            self._reported = len(self.faults)
        if new:
            more = f" (and {len(new) - 1} more: see tunnel.faults)" if len(new) > 1 else ""
            raise TunnelError(f"tunnel {self.url} -> {self.target}: {new[0].message}{more}",
                              _hint_for(new[0].error)) from new[0].error

    def unreported_faults(self) -> list[TunnelFault]:
        """Faults not yet raised or shown; marks them as shown."""
        with self._lock:
            new = self.faults[self._reported:]
            self._reported = len(self.faults)
        return new

    # -- what to show -----------------------------------------------------------------

    @property
    def url(self) -> str:
        """The local URL that reaches the remote service (127.0.0.1, never "localhost",
        which may resolve to ::1 where another program could listen)."""
        return f"http://127.0.0.1:{self.local_port}{self.path}"

    @property
    def target(self) -> str:
        """``host:port`` as seen from the machine."""
        return f"{self.remote_host}:{self.remote_port}"

    @property
    def active_connections(self) -> int:
        with self._lock:
            return len(self._forwards)

    @property
    def bytes_down(self) -> int:
        """Bytes received from the remote service so far (all connections)."""
        with self._lock:
            return self._done_down + sum(f.down for f in self._forwards.values())

    @property
    def bytes_up(self) -> int:
        """Bytes sent to the remote service so far (all connections)."""
        with self._lock:
            return self._done_up + sum(f.up for f in self._forwards.values())

    @property
    def state(self) -> str:
        """``open``, ``open, reconnected Nx``, ``SSH connection lost: reconnects on the next
        request``, ``closed`` or ``failed: ...``."""
        if self._state != "open":
            return self._state
        if not self.connection.is_connected:
            return "SSH connection lost: reconnects on the next request"
        if self.reconnects:
            return f"open, reconnected {self.reconnects}x"
        return "open"

    @property
    def is_open(self) -> bool:
        return self._state == "open"

    def __repr__(self) -> str:
        where = self.url if self.local_port else "(not started)"
        return f"<Tunnel {self.name}: {where} -> {self.target} {self.state}>"

    # -- threads ----------------------------------------------------------------------

    def _fault(self, number: int | None, message: str, error: BaseException) -> None:
        log.warning("gpumagic tunnel %s: %s", self.local_port, message)
        with self._lock:
            self.faults.append(TunnelFault(time.time(), number, message, error))

    def _listen_and_serve(self) -> None:
        """Wait for one local connection, hand listening on to an idle worker, serve it.

        Leader/follower: the thread that accepted a connection serves it itself, so the
        first request does not wait for a thread handoff.  Only one thread listens at a time.
        """
        fwd = self._accept_one()
        if fwd is not None:
            self._workers.submit(self._listen_and_serve)
            self._serve(fwd)

    def _accept_one(self) -> _Forward | None:
        """The next local connection, or None when the tunnel stops or the listener broke."""
        try:
            while self._state == "open":
                events = self._selector.select()
                if any(key.fileobj is self._wake_r for key, _ in events):
                    return None  # stop(): the wake byte stays, so any later listener returns too
                try:
                    sock, peer = self._listener.accept()
                except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                    continue
                except OSError as e:
                    if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                        self._fault(None, f"cannot accept a connection: {e.strerror}", e)
                        time.sleep(0.1)  # out of descriptors: give others time to close
                        continue
                    raise
                sock.setblocking(True)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                with self._lock:
                    if self._state != "open":
                        sock.close()
                        return None
                    self.connections_total += 1
                    fwd = _Forward(self.connections_total, sock, peer)
                    self._forwards[fwd.number] = fwd
                return fwd
        except BaseException as e:  # the listener itself broke: the tunnel cannot go on
            with self._lock:
                self._state = "failed: " + _describe(e)
            self._fault(None, f"the local listener stopped: {_describe(e)}", e)
        return None

    def _serve(self, fwd: _Forward) -> None:
        """Open the channel and copy both ways until both ends are done; never raises."""
        up_done = None
        try:
            try:
                fwd.chan = self._open_channel(fwd.peer)
            except GpumagicError as e:
                self._fault(fwd.number, e.message, e)
                return
            if fwd.closed:  # stop() ran while the channel was opening
                return
            # The client's first request is usually waiting already: send it from this
            # thread, before the local -> remote thread takes over.
            try:
                first = fwd.sock.recv(CHUNK, _DONTWAIT) if _DONTWAIT else b""
            except (BlockingIOError, InterruptedError):
                first = b""
            except _LOCAL_GONE:
                return
            if first:
                sendall_ordered(fwd.chan, first)
                fwd.up += len(first)
            up_done = threading.Event()
            self._workers.submit(self._copy_up, fwd, up_done)
            self._copy_down(fwd)
        except BaseException as e:
            if not fwd.closed:
                self._fault(fwd.number, _what_failed(fwd, e), e)
        finally:
            try:
                fwd.abort()
                if up_done is not None:
                    up_done.wait()
                fwd.sock.close()
            except BaseException as e:
                self._fault(fwd.number, f"while closing: {_describe(e)}", e)
            with self._lock:
                self._forwards.pop(fwd.number, None)
                self._done_down += fwd.down
                self._done_up += fwd.up

    def _copy_down(self, fwd: _Forward) -> None:
        """Remote -> local until the channel's EOF, then half-close the local socket.

        A channel that ends because the SSH connection dropped resets the local connection,
        so the client sees an error instead of a short, "complete" reply.  A channel the
        server closed without EOF ends like ``ssh -L`` ends it: with a FIN.
        """
        chan, sock = fwd.chan, fwd.sock
        recv, sendall = chan.recv, sock.sendall
        try:
            while True:
                data = recv(CHUNK)
                if not data:
                    break
                sendall(data)
                fwd.down += len(data)
        except _LOCAL_GONE:
            return
        if fwd.closed:
            return
        if not chan.eof_received and _dropped(chan.get_transport()):
            _reset(sock)
            raise ConnectionLost("the SSH connection dropped during a transfer",
                                 "the tunnel reconnects on the next request")
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def _copy_up(self, fwd: _Forward, done: threading.Event) -> None:
        """Local -> remote until the client's EOF, then send the channel's EOF."""
        chan, sock = fwd.chan, fwd.sock
        recv = sock.recv
        try:
            while True:
                data = recv(CHUNK)
                if not data:
                    break
                sendall_ordered(chan, data)
                fwd.up += len(data)
            send_eof(chan)
        except _LOCAL_GONE:
            fwd.abort()
        except (OSError, EOFError, paramiko.SSHException) as e:
            if not fwd.closed and not chan.closed:
                self._fault(fwd.number, _what_failed(fwd, e), e)
            fwd.abort()
        except BaseException as e:
            self._fault(fwd.number, _what_failed(fwd, e), e)
            fwd.abort()
        finally:
            done.set()

    def _open_channel(self, peer) -> paramiko.Channel:
        """A ``direct-tcpip`` channel to the target, re-opening the connection if it dropped.

        Raises
        ------
        TunnelError
            The machine could not connect to the target (nothing listens there).
        ConnectionLost
            The SSH connection cannot be re-opened.
        """
        conn = self.connection
        origin = (peer[0], peer[1]) if isinstance(peer, tuple) else ("127.0.0.1", 0)
        for attempt in range(2):
            conn.ensure_open()
            with self._lock:  # count each re-opened connection once, whoever re-opened it
                if conn.opened_count != self._opened_seen:
                    self._opened_seen = conn.opened_count
                    self.reconnects += 1
            transport = conn.transport
            try:
                return transport.open_channel(
                    "direct-tcpip", (self.remote_host, self.remote_port), origin,
                    window_size=self.window_size, max_packet_size=self.max_packet_size,
                    timeout=conn.spec.connect_timeout)
            except paramiko.ChannelException as e:
                raise TunnelError(
                    f"the machine could not connect to {self.target}: {e.text or e}",
                    f"check that the service is running on the machine and listens on port "
                    f"{self.remote_port}") from e
            except (paramiko.SSHException, EOFError, OSError) as e:
                if transport.is_active() or attempt:
                    raise ConnectionLost(f"cannot open a tunnel channel to {conn.spec.address}: {e}",
                                         "run `%gpu connect` again if this repeats") from e
                # The transport looked alive but was not: the next round re-opens it.
        raise AssertionError("unreachable")


class TunnelManager:
    """The tunnels of one machine, by local port (the ID shown by ``%gpu tunnel list``).

    Parameters
    ----------
    connection : Connection
        The machine's connection that new tunnels forward over.
    """

    def __init__(self, connection):
        self.connection = connection
        self.tunnels: dict[int, Tunnel] = {}

    def open(self, remote_port: int, *, remote_host: str = "localhost",
             local_port: int | None = None, **options) -> Tunnel:
        """Start a :class:`Tunnel` (options as its constructor) and keep it listed.

        An open tunnel to the same ``remote_host:remote_port`` is returned instead of a new
        one, unless another ``local_port`` is asked for than the one it has or was moved
        from (0: a new one on any free port).  A wanted local port held by another of these
        tunnels moves the new one to a free port, :attr:`Tunnel.moved_reason` naming the
        holder.  When the machine is this computer (its SSH address is loopback: the
        sandbox), a loopback target's own port and the targets of the other loopback
        tunnels are never bound: the machine's side would connect back into gpumagic's own
        listener and forward in a loop.
        """
        same = self.find(remote_host, int(remote_port))
        if same is not None and local_port in (None, same.local_port, same.moved_from):
            return same
        wanted = int(remote_port if local_port is None else local_port)
        avoid = {}
        if machine_is_this_computer(self.connection) and is_loopback(remote_host):
            here = f"({self.connection.spec.address} is this computer)"
            avoid = {o.remote_port: f"is the target of tunnel {o.local_port} {here}: listening there "
                                    "would forward in a loop"
                     for o in self if is_loopback(o.remote_host)}
            avoid[int(remote_port)] = (f"is {remote_host}:{remote_port} on the machine too {here}: "
                                       "listening there, the tunnel would forward to itself in a loop")
        for o in self:
            if o.local_port == wanted and wanted not in avoid:
                avoid[wanted] = f"is used by gpumagic's tunnel {o.local_port} -> {o.target} ({o.name})"
        t = Tunnel(self.connection, remote_port, remote_host=remote_host, local_port=local_port,
                   avoid_ports=avoid, **options).start()
        self.tunnels[t.local_port] = t
        return t

    def find(self, remote_host: str, remote_port: int) -> Tunnel | None:
        """An open tunnel to that target, if there is one."""
        for t in self.tunnels.values():
            if t.is_open and t.remote_port == remote_port and t.remote_host == remote_host:
                return t
        return None

    def close(self, local_port: int, stop_service: bool = False) -> Tunnel:
        """Stop and forget one tunnel; its unreported faults stay on the returned object.

        With ``stop_service``, also stop the remote TensorBoard/Jupyter that gpumagic
        started for it (one that was already running is left alone).

        Raises
        ------
        TunnelError
            When no tunnel uses that local port.
        """
        t = self.tunnels.pop(local_port, None)
        if t is None:
            known = ", ".join(str(p) for p in sorted(self.tunnels)) or "none"
            raise TunnelError(f"no tunnel on local port {local_port} (open: {known})",
                              "`%gpu tunnel list` shows the IDs (local ports)")
        t.stop(raise_errors=False)
        if stop_service and t.service is not None and self.connection.is_connected:
            try:
                stop_remote_service(self.connection, t.service)
            except GpumagicError as e:  # closing must go on; the caller shows the fault
                t._fault(None, f"could not stop its server (pid {t.service.pid}): {e.message}", e)
        return t

    def close_all(self, stop_service: bool = False) -> list[Tunnel]:
        """Stop every tunnel (on disconnect and when the kernel exits)."""
        closed = []
        for port in list(self.tunnels):
            closed.append(self.close(port, stop_service=stop_service))
        return closed

    def __iter__(self):
        # A tunnel stopped directly (``with machine.tunnel(...)``) leaves the list.
        for port, t in list(self.tunnels.items()):
            if t._state == "closed":
                self.tunnels.pop(port, None)
        return iter(list(self.tunnels.values()))

    def __len__(self) -> int:
        return len(self.tunnels)


def _bind_local(wanted: int, avoid=()) -> socket.socket:
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


def _dropped(transport) -> bool:
    """True when the SSH connection under a channel died (paramiko unlinks the channels
    after recording the error in ``saved_exception`` but before clearing ``active``)."""
    if transport is None or not transport.is_active():
        return True
    saved = transport.saved_exception  # a failed channel open also parks one here, briefly
    return saved is not None and not isinstance(saved, paramiko.ChannelException)


def _reset(sock: socket.socket) -> None:
    """Make the coming close send a TCP reset (SO_LINGER 0) instead of a clean FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass


def _what_failed(fwd: _Forward, e: BaseException) -> str:
    if fwd.chan is not None and _dropped(fwd.chan.get_transport()):
        return "the SSH connection dropped during a transfer"
    return _describe(e)


def _describe(e: BaseException) -> str:
    if isinstance(e, GpumagicError):
        return e.message
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _hint_for(e: BaseException) -> str:
    hint = getattr(e, "hint", "")
    return hint or "`%gpu tunnel list` shows the tunnel's state; close and open it again if it is stuck"


# -- remote services: TensorBoard ---------------------------------------------------------

#: Runs with the machine's ``python3``: reuse a TensorBoard serving LOGDIR (found through
#: TensorBoard's own info files, ``tensorboard.manager.get_all()``, as its notebook magic
#: does), else start one detached (own session, output to ~/.gpumagic/tensorboard-*.log)
#: bound to 127.0.0.1; TensorBoard itself picks 6006 or the next free port when ``--port``
#: is not given.  Prints one JSON line.
#: Shared by the service scripts (prepended to each): start ``argv`` detached in its own
#: session with output to ``~/.gpumagic/NAME-MS.log``, wait until ``running()`` lists its pid
#: (``pid_of(info)``), then ``report`` it; else print the log's last lines as "failed".
_START_AND_REPORT = r'''
import json, os, subprocess, sys, time
def start_and_report(name, argv, running, pid_of):
    state = os.path.expanduser("~/.gpumagic"); os.makedirs(state, exist_ok=True)
    log = os.path.join(state, "%s-%d.log" % (name, int(time.time() * 1000)))
    with open(log, "ab") as out:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                             start_new_session=True, close_fds=True)
    deadline = time.time() + __TIMEOUT__
    while time.time() < deadline:
        for info in running():
            if pid_of(info) == p.pid:
                report(info, True, log); sys.exit(0)
        if p.poll() is not None:
            break
        time.sleep(0.2)
    with open(log, "rb") as f:
        tail = f.read().decode("utf-8", "replace").strip().splitlines()[-3:]
    if p.poll() is None:
        p.kill()
    print(json.dumps({"failed": " | ".join(tail) or "no output", "log": log}))
'''

_TENSORBOARD_SCRIPT = r'''
logdir = os.path.abspath(os.path.expanduser(__LOGDIR__))
try:
    from tensorboard import manager
except ImportError:
    print(json.dumps({"missing": sys.executable})); sys.exit(0)
def serving():
    for info in manager.get_all():
        if os.path.abspath(info.logdir or "") == logdir:
            return info
def report(info, started, log=None):
    print(json.dumps({"port": info.port, "pid": info.pid, "logdir": logdir,
                      "path_prefix": info.path_prefix, "started": started, "log": log}))
info = serving()
if info is not None:
    report(info, False); sys.exit(0)
os.makedirs(logdir, exist_ok=True)
start_and_report("tensorboard", [sys.executable, "-m", "tensorboard.main", "--logdir", logdir,
                                 "--host", "127.0.0.1"], manager.get_all, lambda info: info.pid)
'''


@dataclass
class RemoteService:
    """A web service on the machine that a tunnel reaches.

    Attributes
    ----------
    port : int
        Its port on the machine (bound to the machine's 127.0.0.1).
    path : str
        URL path and query (a token) to open.
    pid : int
        Its process id on the machine.
    started : bool
        True when gpumagic started it now, False when it was already serving.
    log : str or None
        Its output file on the machine (when gpumagic started it).
    """

    port: int
    path: str
    pid: int
    started: bool
    log: str | None = None


def start_tensorboard(machine, logdir: str = "runs", timeout: float = 90.0) -> RemoteService:
    """Find the TensorBoard serving ``logdir`` on the machine, or start one detached.

    Parameters
    ----------
    machine : gpumagic.Machine
    logdir : str
        Event-file directory, relative to the machine's working directory (``machine.cwd``)
        or absolute; created when missing.
    timeout : float
        Seconds to wait for a new TensorBoard to serve.

    Raises
    ------
    TunnelError
        TensorBoard is not installed for the machine's ``python3`` (hint: the pip command),
        or it did not start (the last lines of its log).
    """
    info = _run_service_script(machine, "TensorBoard", _TENSORBOARD_SCRIPT, timeout, "tensorboard",
                               logdir=logdir)
    prefix = (info.get("path_prefix") or "").rstrip("/")
    return RemoteService(port=int(info["port"]), path=prefix + "/", pid=int(info["pid"]),
                         started=bool(info["started"]), log=info.get("log"))


# -- remote services: Jupyter -------------------------------------------------------------

#: Runs with the machine's ``python3``: reuse a running Jupyter server (its runtime files,
#: ``jupyter_server.serverapp.list_running_servers()``), else start JupyterLab (or Notebook 7,
#: or a bare Jupyter Server) detached, bound to 127.0.0.1 on 8888 or the next free port
#: (``port_retries``), without a browser.  Prints one JSON line with the token.
_JUPYTER_SCRIPT = r'''
import importlib.util
try:
    from jupyter_server.serverapp import list_running_servers
except ImportError:
    print(json.dumps({"missing": sys.executable})); sys.exit(0)
def report(info, started, log=None):
    print(json.dumps({"port": info["port"], "pid": info["pid"], "token": info.get("token", ""),
                      "base_url": info.get("base_url", "/"), "started": started, "log": log}))
for info in list_running_servers():
    report(info, False); sys.exit(0)
app = next((m for m in ("jupyterlab", "notebook") if importlib.util.find_spec(m)), "jupyter_server")
start_and_report("jupyter", [sys.executable, "-m", app, "--no-browser", "--ServerApp.ip=127.0.0.1",
                             "--ServerApp.port=8888", "--ServerApp.open_browser=False"]
                 # rented machines often log in as root; the server stays on 127.0.0.1
                 # behind its token
                 + (["--allow-root"] if hasattr(os, "getuid") and os.getuid() == 0 else []),
                 list_running_servers, lambda info: info["pid"])
'''


def start_jupyter(machine, timeout: float = 90.0) -> RemoteService:
    """Find a running Jupyter server on the machine, or start one detached.

    Returns
    -------
    RemoteService
        ``path`` is ``BASE_URL?token=TOKEN`` (the token from the server's runtime file).

    Raises
    ------
    TunnelError
        Jupyter is not installed for the machine's ``python3`` (hint: the pip command), or
        it did not start (the last lines of its log).
    """
    info = _run_service_script(machine, "Jupyter", _JUPYTER_SCRIPT, timeout, "jupyterlab")
    base = info.get("base_url") or "/"
    path = base + (f"?token={info['token']}" if info.get("token") else "")
    return RemoteService(port=int(info["port"]), path=path, pid=int(info["pid"]),
                         started=bool(info["started"]), log=info.get("log"))


def _run_service_script(machine, what: str, script: str, timeout: float, package: str,
                        logdir: str | None = None) -> dict:
    """Run a service script with the machine's python3; its JSON answer or a TunnelError."""
    import json
    import shlex

    script = (_START_AND_REPORT + script).replace("__TIMEOUT__", repr(float(timeout)))
    if logdir is not None:
        script = script.replace("__LOGDIR__", repr(logdir))
    r = machine.run(script, python=True, quiet=True, timeout=timeout + 30)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.exit_code != 0 or not lines:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise TunnelError(f"could not start {what} on {machine.name}: {last}",
                          "check that `python3` works on the machine (`%%remote python3 -V`)")
    info = json.loads(lines[-1])
    if "missing" in info:
        raise TunnelError(f"{what} is not installed for {info['missing']} on {machine.name}",
                          f"install it there: %%remote\\n{shlex.quote(info['missing'])} -m pip install {package}")
    if "failed" in info:
        raise TunnelError(f"{what} did not start on {machine.name}: {info['failed']}",
                          f"its log on the machine: {info['log']}")
    return info


def stop_remote_service(connection, service: RemoteService) -> None:
    """Stop a service gpumagic started (its whole process group: TensorBoard's data server
    too); a service that was already running is left alone."""
    from .execution import exec_simple

    if service.started:
        exec_simple(connection, f"kill -TERM -- -{int(service.pid)} 2>/dev/null || kill -TERM {int(service.pid)}",
                    timeout=30)
