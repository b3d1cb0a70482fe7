"""Local port forwards over the machine's SSH connection (what ``ssh -L`` does).

A :class:`Tunnel` listens on ``127.0.0.1`` only (never on all interfaces) and forwards each
accepted connection through its own SSH ``direct-tcpip`` channel (RFC 4254 section 7.2) to a
host and port *as the machine sees them*, so a service bound to the machine's 127.0.0.1 is
reachable without opening it to the internet.

How it moves bytes
------------------
* One thread at a time waits on the listening socket and a wake-up socket pair (a selector,
  no polling).  The thread that accepts a connection serves it (leader/follower: no thread
  handoff before the first request): it sends CHANNEL_OPEN and only then hands listening on
  to an idle worker, so the woken worker does not compete with it before the request
  leaves (measured here: 5-10 % of the time to first byte), and the next connection is
  accepted while the machine connects (a slow or refused remote service never stalls the
  others).
* Remote -> local, and the first request, happen on paramiko's transport thread, as
  ``ssh -L`` does them in its one event loop: when the channel's OPEN_CONFIRMATION arrives,
  the transport thread sends the client's request that is waiting by then, and every DATA
  message is written straight to the local socket (:class:`_Forward`).  No thread is woken
  between the client's request and its answer.  A client that reads slowly gets the rest
  from a worker; the channel window is given back only for bytes the client took.
* Local -> remote: the serving thread reads the local socket into a buffer it reuses (a fresh
  1 MiB object per read cost ~17 us) and sends; worker threads are reused.
* Channels ask for a 16 MiB window and 256 KiB - 1 KiB packets (OpenSSH accepts packets up to
  256 KiB; paramiko's default of 32 KiB costs one Python round trip per 32 KiB).  Local
  sockets have ``TCP_NODELAY`` so small requests are not held back by Nagle's algorithm.

Failures
--------
* DATA and EOF on a channel are sent while holding the transport's send lock, so they can never
  follow the channel's CLOSE (see ``connection.send_eof``: sshd drops the whole connection then).
* When the remote side ends a connection (EOF), the local connection is closed too.  (OpenSSH
  keeps the client's sending half open until the client closes; for HTTP, WebSocket and
  the other protocols a browser speaks this makes no difference.)  A client still sending
  then gets a reset after the answer and FIN, as a close with unread data gives it through
  ``ssh -L``, instead of waiting forever on a closed receive window.
* Paramiko's transport thread never waits for a key exchange, which only it can finish: the
  first request and window adjustments it cannot send at once go from another thread
  (``connection.send_data_now``; paramiko's own replies too, see ``connection``).
* A channel given up on while opening (no answer within ConnectTimeout, or ``stop()``) is
  closed when its confirmation comes late, so it does not stay open on the machine.
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
from collections import deque
from dataclasses import dataclass, field

import paramiko

from ..ssh import _paramiko
from ..ssh._paramiko import (close_without_eof, send_data_now, send_eof, send_window_adjust, sendall_ordered, transport_dropped)
from ..errors import ConnectionLost, GpumagicError, TunnelError

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

_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)  # not on Windows: every write goes through _drain there

#: Bytes the transport thread reads for a connection's first request (a larger first
#: request is sent on by the serving thread).
FIRST_READ = 64 * 1024

#: A reusable read buffer per thread: ``recv(1 MiB)`` would allocate (and map) a fresh
#: 1 MiB object per call, ~17 us even for a 100-byte request.
_buffers = threading.local()

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
    """One accepted local connection and its channel.

    Remote -> local: the forward takes the place of the channel's input buffer
    (``Channel.in_buffer``, see :meth:`opened` and :mod:`gpumagic.ssh._paramiko`), so paramiko's transport thread hands it each DATA
    message (:meth:`feed`) and writes the bytes to the local socket right there, without
    waking another thread.  What the local socket cannot take at once (a client that reads
    slowly) waits in ``_pending`` while a worker thread writes it out (:meth:`_drain`).  The
    channel window is given back only for bytes the local socket took, so at most one window
    waits here per connection.  Paramiko calls :meth:`close` on the remote's EOF or CLOSE and
    when the SSH connection drops; the local side is told once every byte is delivered
    (:meth:`_finish`).

    Local -> remote: the thread that serves the connection reads the local socket
    (:meth:`Tunnel._serve`).

    Locks: ``chan.lock`` (paramiko's), then ``self._lock``; never the other way.  No thread
    waits for the transport thread while holding ``self._lock``, and the transport thread
    never blocks on anything but these short locks (never on a key exchange).
    """

    def __init__(self, tunnel: "Tunnel", number: int, sock: socket.socket, peer):
        self.tunnel = tunnel
        self.number = number
        self.sock = sock
        self.peer = peer
        self.chan: paramiko.Channel | None = None
        self.down = 0  # bytes remote -> local
        self.up = 0    # bytes local -> remote (written only by the serving thread)
        self.closed = False  # abort() ran
        #: The SSH connection dropped before the remote's EOF: the client gets a reset.
        self.lost = False
        #: Set when the remote -> local direction is over: every byte delivered and the
        #: local side told, or the local client gone.
        self.down_done = threading.Event()
        self._lock = threading.Lock()  # the local socket's sending side and the fields below
        self._pending: deque = deque()
        self._writing = False   # a worker is writing _pending out
        self._ended = False     # paramiko called close()
        self._discard = False   # the local client is gone: drop what still comes
        self._sock_closed = False
        self.first = b""  # a first request that opened() read but left to the serving thread
        self.first_error: BaseException | None = None  # what went wrong in opened()
        self.refused: paramiko.ChannelException | None = None  # the server's OPEN_FAILURE
        #: The channel given up on while opening (timeout, stop): a late confirmation
        #: closes it (see ``_paramiko.open_direct_tcpip``).
        self.abandoned: paramiko.Channel | None = None
        #: Client bytes were read but not forwarded because the remote had ended: the
        #: client is told with a reset, as a close with unread data would.
        self.dropped_up = False

    # -- paramiko's side (the channel's input buffer) ----------------------------------

    def opened(self, chan: paramiko.Channel) -> None:
        """The transport thread, on the channel's OPEN_CONFIRMATION (before any of its DATA
        can arrive, and before the serving thread wakes): become the channel's input buffer
        and send the client's first request, which is usually waiting by now."""
        self.chan = chan
        if not _paramiko.FAST:  # paramiko's public API: a thread reads the channel
            threading.Thread(target=self._pump_down, daemon=True,
                             name=f"gpumagic-tunnel-down-{self.number}").start()
            return
        _paramiko.become_input_buffer(chan, self)
        if self.closed or not _DONTWAIT:
            return
        try:
            first = self.sock.recv(FIRST_READ, _DONTWAIT)
            if not first:
                return  # the client's EOF, which the serving thread reads again
            # Never waits: during a key exchange (which only this thread can finish), or
            # when the window or the server's packet size is too small, the serving thread
            # sends it.
            if send_data_now(chan, first):
                self.up += len(first)
            else:
                self.first = first
        except (BlockingIOError, InterruptedError):
            pass
        except BaseException as e:  # never into paramiko's transport thread
            self.first_error = e

    def feed(self, data: bytes) -> None:
        """The transport thread: deliver one DATA message's bytes; never raises."""
        try:
            sent = 0
            with self._lock:
                if self._discard or self._sock_closed:
                    return
                if self._writing:
                    self._pending.append(data)
                    return
                if _DONTWAIT:
                    try:
                        sent = self.sock.send(data, _DONTWAIT)
                    except (BlockingIOError, InterruptedError):
                        pass
                self.down += sent
                start_drain = sent < len(data)
                if start_drain:
                    self._pending.append(memoryview(data)[sent:])
                    self._writing = True
            if start_drain:
                self.tunnel._workers.submit(self._drain)
            if sent:
                self._give_window(sent, on_transport_thread=True)
        except _LOCAL_GONE:
            self._local_gone()
        except BaseException as e:  # never into paramiko's transport thread
            self.tunnel._fault(self.number, _what_failed(self, e), e)
            self._local_gone()

    def close(self) -> None:
        """Paramiko (holding ``chan.lock``): the remote sent EOF or CLOSE, or the SSH
        connection dropped.  Safe twice."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            if self._writing:
                return  # _drain finishes after the last byte
        self._finish()

    def __len__(self) -> int:  # paramiko's repr of the channel
        return sum(len(b) for b in self._pending)

    def read_ready(self) -> bool:  # Channel.recv_ready: nothing is ever read through recv
        return False

    def _pump_down(self) -> None:
        """Remote -> local through ``Channel.recv`` (which gives the window back itself):
        the path without paramiko's internals (``_paramiko.FAST`` False), one thread per
        connection."""
        chan = self.chan
        try:
            while True:
                data = chan.recv(CHUNK)
                if not data:
                    break
                self.sock.sendall(data)
                with self._lock:
                    self.down += len(data)
        except _LOCAL_GONE:
            self._local_gone()
            return
        except (OSError, EOFError, paramiko.SSHException) as e:
            if not self.closed:
                self.tunnel._fault(self.number, _what_failed(self, e), e)
            self._local_gone()
            return
        self.close()

    # -- local side ------------------------------------------------------------------

    def _drain(self) -> None:
        """A worker: write ``_pending`` out (blocking), then finish if the remote ended."""
        try:
            while True:
                with self._lock:
                    if not self._pending or self._discard:
                        self._pending.clear()
                        self._writing = False
                        ended = self._ended
                        break
                    chunk = self._pending.popleft()
                self.sock.sendall(chunk)
                with self._lock:
                    self.down += len(chunk)
                self._give_window(len(chunk), on_transport_thread=False)
        except (OSError, EOFError, paramiko.SSHException) as e:
            if not isinstance(e, _LOCAL_GONE) and not self.closed:
                self.tunnel._fault(self.number, _what_failed(self, e), e)
            self._local_gone()
            return
        if ended:
            self._finish()

    def _give_window(self, n: int, on_transport_thread: bool) -> None:
        """Window back to the server for ``n`` delivered bytes (paramiko's ``recv`` does this
        for its own readers), in batches of a tenth of the window."""
        chan = self.chan
        ack = _paramiko.window_to_give(chan, n)
        if ack and not self._send_window(ack, wait=not on_transport_thread):
            # A key exchange runs and only the transport thread can finish it: send later.
            self.tunnel._workers.submit(self._send_window, ack)

    def _send_window(self, ack: int, wait: bool = True) -> bool:
        try:
            return send_window_adjust(self.chan, ack, wait)
        except (OSError, EOFError, paramiko.SSHException):
            return True  # the connection is gone: the channel ends with it

    def _finish(self) -> None:
        """Every byte delivered after the remote's end: tell the local client (FIN, or a
        reset after a dropped SSH connection, which the serving thread sends) and wake the
        serving thread."""
        chan = self.chan
        if not chan.eof_received and not self.closed and transport_dropped(chan.get_transport()):
            self.lost = True
        with self._lock:
            if not self._sock_closed:
                for how in ((socket.SHUT_RD,) if self.lost or self.closed
                            else (socket.SHUT_WR, socket.SHUT_RD)):
                    try:
                        self.sock.shutdown(how)
                    except OSError:
                        pass
        self.down_done.set()

    def _local_gone(self) -> None:
        """The local client went away: drop what still comes, wake the serving thread."""
        with self._lock:
            self._discard = True
            self._pending.clear()
            self._writing = False
            if not self._sock_closed:
                try:
                    self.sock.shutdown(socket.SHUT_RD)
                except OSError:
                    pass
        self.down_done.set()

    def abort(self) -> None:
        """Wake the serving thread and close the channel (safe from any thread, safe twice)."""
        self.closed = True
        with self._lock:
            if not self._sock_closed and not self.down_done.is_set():
                try:
                    # Wakes a recv blocked in another thread without sending FIN (the close
                    # that follows sends FIN, or a reset after _reset).
                    self.sock.shutdown(socket.SHUT_RD)
                except OSError:
                    pass
        chan = self.chan
        if chan is None:
            self.down_done.set()
            return
        close_without_eof(chan)  # paramiko calls self.close(): down_done unless _drain runs

    def release(self) -> None:
        """Close the local socket once no other thread uses it (the serving thread, last)."""
        if not self.down_done.is_set():
            # _drain may block on a client that stopped reading: break its send.
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.down_done.wait(JOIN_TIMEOUT)
        with self._lock:
            self._sock_closed = True
            self.sock.close()


class _Probe:
    """Stands in for a :class:`_Forward` when a channel is opened only to see whether the
    target accepts connections (:meth:`Tunnel.target_refusal`)."""

    closed = False

    def __init__(self):
        self.chan: paramiko.Channel | None = None
        self.refused: paramiko.ChannelException | None = None
        self.abandoned: paramiko.Channel | None = None

    def opened(self, chan: paramiko.Channel) -> None:  # the transport thread
        self.chan = chan


class Tunnel:
    """Forward ``127.0.0.1:local_port`` on this computer to ``remote_host:remote_port`` as the
    machine sees it.

    Parameters
    ----------
    connection : gpumagic.ssh.connection.Connection
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

    def target_refusal(self, timeout: float = 10.0) -> str | None:
        """Whether the target accepts connections now: None when it does, else the
        machine's reason ("Connection refused").  Opens one ``direct-tcpip`` channel to the
        target and closes it at once (one SSH round trip; the service sees a connection
        that closes without a byte).

        Raises
        ------
        ConnectionLost
            The SSH connection is down.
        """
        transport = self.connection.transport
        if transport is None or not transport.is_active():
            raise ConnectionLost("the SSH connection is down", "run `%gpu connect` again")
        probe = _Probe()  # through our own opening, which keeps the server's reason
        try:
            chan = _paramiko.open_direct_tcpip(transport, probe,
                                               (self.remote_host, self.remote_port),
                                               ("127.0.0.1", 0), 32768, 32768, timeout)
        except paramiko.ChannelException as e:
            return e.text or str(e)
        except (paramiko.SSHException, TimeoutError) as e:
            return str(e)
        close_without_eof(chan)
        return None

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
        """Wait for one local connection and serve it, handing listening on to an idle
        worker once its channel is asked for.

        Leader/follower: the thread that accepted a connection serves it itself, so the
        first request does not wait for a thread handoff.  Only one thread listens at a time.
        """
        fwd = self._accept_one()
        if fwd is None:
            return
        handed_off = False

        def hand_off() -> None:
            nonlocal handed_off
            if not handed_off:
                handed_off = True
                self._workers.submit(self._listen_and_serve)

        self._serve(fwd, hand_off)

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
                    fwd = _Forward(self, self.connections_total, sock, peer)
                    self._forwards[fwd.number] = fwd
                return fwd
        except BaseException as e:  # the listener itself broke: the tunnel cannot go on
            with self._lock:
                self._state = "failed: " + _describe(e)
            self._fault(None, f"the local listener stopped: {_describe(e)}", e)
        return None

    def _serve(self, fwd: _Forward, hand_off) -> None:
        """Open the channel (calling ``hand_off()`` once it is asked for), copy local ->
        remote until the client is done, wait for the remote -> local direction (the
        transport thread's, see :class:`_Forward`), close both ends; never raises."""
        try:
            try:
                chan = self._open_channel(fwd, hand_off)
            except GpumagicError as e:
                self._fault(fwd.number, e.message, e)
                return
            finally:
                hand_off()
            if chan is None or fwd.closed:  # stop() ran while the channel was opening
                return
            if fwd.first_error is not None:
                if isinstance(fwd.first_error, _LOCAL_GONE):
                    return  # the client went away before its first request: not a fault
                raise fwd.first_error
            if self._copy_up(fwd):
                fwd.down_done.wait()  # the client sent EOF: the remote's answer still comes
            if fwd.lost:
                _reset(fwd.sock)
                raise ConnectionLost("the SSH connection dropped during a transfer",
                                     "the tunnel reconnects on the next request")
            if fwd.dropped_up:
                # The client is still sending to a service that closed: a reset tells it
                # (its kernel keeps what it received before, and our FIN went first), once
                # every byte the service sent is delivered.
                fwd.down_done.wait(JOIN_TIMEOUT)
                _reset(fwd.sock)
        except BaseException as e:
            if not fwd.closed:
                self._fault(fwd.number, _what_failed(fwd, e), e)
        finally:
            try:
                fwd.abort()
                fwd.release()
            except BaseException as e:
                self._fault(fwd.number, f"while closing: {_describe(e)}", e)
            with self._lock:
                self._forwards.pop(fwd.number, None)
                self._done_down += fwd.down
                self._done_up += fwd.up

    def _copy_up(self, fwd: _Forward) -> bool:
        """Local -> remote until the client's EOF, then send the channel's EOF.

        Returns True after the client's EOF, False when the copy ended otherwise (the remote
        side ended, the client went away, the tunnel stops).
        """
        chan, sock = fwd.chan, fwd.sock
        view = getattr(_buffers, "view", None)
        if view is None:
            view = _buffers.view = memoryview(bytearray(CHUNK))
        recv_into = sock.recv_into
        ended = fwd.down_done.is_set
        try:
            if fwd.first:  # a first request that opened() could not send
                sendall_ordered(chan, fwd.first)
                fwd.up += len(fwd.first)
            while True:
                n = recv_into(view)
                if not n:
                    break
                if ended():  # the remote ended: these bytes go nowhere
                    fwd.dropped_up = True
                    return False
                sendall_ordered(chan, view[:n])
                fwd.up += n
            if fwd.closed or ended():
                return False  # woken by the remote's end, not by the client
            send_eof(chan)
            return True
        except _LOCAL_GONE:
            return False
        except (OSError, EOFError, paramiko.SSHException) as e:
            if isinstance(e, EOFError) or transport_dropped(chan.get_transport()):
                fwd.lost = True  # paramiko's send raises EOFError once the connection is gone
            elif chan.closed:
                fwd.dropped_up = True  # the remote closed while we forwarded these bytes
            elif not fwd.closed:
                self._fault(fwd.number, _what_failed(fwd, e), e)
            return False

    def _open_channel(self, fwd: _Forward, hand_off) -> paramiko.Channel | None:
        """A ``direct-tcpip`` channel to the target, re-opening the connection if it dropped;
        None when the forward was aborted while the channel was opening.

        ``hand_off()`` is called once CHANNEL_OPEN is on its way (or before anything that may
        block: a reconnect, a key exchange), so the next local connection is accepted while
        the machine connects to the target, and the thread that accepts it does not compete
        with this one before the request leaves.

        Raises
        ------
        TunnelError
            The machine could not connect to the target (nothing listens there), or did not
            within ``connect_timeout`` seconds (ssh_config ConnectTimeout).
        ConnectionLost
            The SSH connection cannot be re-opened.
        """
        conn = self.connection
        peer = fwd.peer
        origin = (peer[0], peer[1]) if isinstance(peer, tuple) else ("127.0.0.1", 0)
        for attempt in range(2):
            if not conn.is_connected:
                hand_off()
            conn.ensure_open()
            with self._lock:  # count each re-opened connection once, whoever re-opened it
                if conn.opened_count != self._opened_seen:
                    self._opened_seen = conn.opened_count
                    self.reconnects += 1
            transport = conn.transport
            try:
                if _paramiko.key_exchange_running(transport):
                    hand_off()  # a key exchange runs: sending waits for it
                return _paramiko.open_direct_tcpip(
                    transport, fwd, (self.remote_host, self.remote_port), origin,
                    self.window_size, self.max_packet_size, conn.spec.connect_timeout, hand_off)
            except paramiko.ChannelException as e:
                raise TunnelError(
                    f"the machine could not connect to {self.target}: {e.text or e}",
                    f"check that the service is running on the machine and listens on port "
                    f"{self.remote_port}") from e
            except TimeoutError as e:
                raise TunnelError(
                    f"the machine did not connect to {self.target} within "
                    f"{conn.spec.connect_timeout:g} s",
                    "check that the service on the machine accepts connections (is it "
                    "overloaded or stopped with SIGSTOP?); ConnectTimeout sets the wait") from e
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


def _reset(sock: socket.socket) -> None:
    """Make the coming close send a TCP reset (SO_LINGER 0) instead of a clean FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass


def _what_failed(fwd: _Forward, e: BaseException) -> str:
    if fwd.chan is not None and transport_dropped(fwd.chan.get_transport()):
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
#: session with output to ``~/.gpumagic/NAME-MS.log`` (0600, in a 0700 directory), wait until
#: ``running()`` lists its pid (``pid_of(info)``), then ``report`` it; else print the log's last lines as "failed".
#:
#: Every service gpumagic starts is recorded at once in ``~/.gpumagic/services/PID.json``
#: (its name, log, and its start time in clock ticks after boot from ``/proc/PID/stat``
#: field 22, proc(5), so a later process given the same pid is not taken for it).  A
#: service found running later is reported ``ours`` when its record matches, whichever
#: kernel started it; records of processes that are gone are removed.
_START_AND_REPORT = r'''
import json, os, subprocess, sys, time
SERVICES = os.path.expanduser("~/.gpumagic/services")
def started_ticks(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None
def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
def record(name, pid, log):
    os.makedirs(SERVICES, 0o700, exist_ok=True)
    path = os.path.join(SERVICES, "%d.json" % pid)
    with open(os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump({"name": name, "pid": pid, "log": log, "ticks": started_ticks(pid)}, f)
    os.replace(path + ".tmp", path)
def recorded(pid):
    """The record of a service gpumagic started with this pid, or None; stale ones removed."""
    try:
        names = os.listdir(SERVICES)
    except OSError:
        return None
    found = None
    for n in names:
        path = os.path.join(SERVICES, n)
        try:
            with open(path) as f:
                rec = json.load(f)
            stale = not alive(int(rec["pid"])) or rec.get("ticks") not in (None, started_ticks(int(rec["pid"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if stale:
            try:
                os.remove(path)
            except OSError:
                pass
        elif int(rec["pid"]) == pid:
            found = rec
    return found
def start_and_report(name, argv, running, pid_of):
    state = os.path.expanduser("~/.gpumagic"); os.makedirs(state, 0o700, exist_ok=True)
    os.chmod(state, 0o700)  # private: Jupyter's log holds its token
    log = os.path.join(state, "%s-%d.log" % (name, int(time.time() * 1000)))
    with open(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as out:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                             start_new_session=True, close_fds=True)
    record(name, p.pid, log)
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
def report_found(info, pid):
    rec = recorded(pid)
    report(info, False, rec.get("log") if rec else None, rec is not None)
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
def report(info, started, log=None, ours=True):
    print(json.dumps({"port": info.port, "pid": info.pid, "logdir": logdir, "ours": ours,
                      "path_prefix": info.path_prefix, "started": started, "log": log}))
info = serving()
if info is not None:
    report_found(info, info.pid); sys.exit(0)
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
    ours : bool
        True when gpumagic started it, now or earlier (from any kernel: the machine keeps a
        record of each service gpumagic starts, ``~/.gpumagic/services/PID.json``); only
        such a service is stopped by ``%gpu tunnel close ID --stop``.
    """

    port: int
    path: str
    pid: int
    started: bool
    log: str | None = None
    ours: bool = False

    def __post_init__(self):
        self.ours = self.ours or self.started

    @property
    def origin(self) -> str:
        """``started by gpumagic now`` / ``started by gpumagic earlier`` / ``not started by gpumagic``."""
        if self.started:
            return "started by gpumagic now"
        return "started by gpumagic earlier" if self.ours else "not started by gpumagic"


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
                         started=bool(info["started"]), log=info.get("log"), ours=bool(info.get("ours")))


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
def report(info, started, log=None, ours=True):
    print(json.dumps({"port": info["port"], "pid": info["pid"], "token": info.get("token", ""),
                      "base_url": info.get("base_url", "/"), "started": started, "log": log,
                      "ours": ours}))
for info in list_running_servers():
    report_found(info, info["pid"]); sys.exit(0)
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
                         started=bool(info["started"]), log=info.get("log"), ours=bool(info.get("ours")))


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
    """Stop a service gpumagic started, now or earlier (its whole process group: TensorBoard's
    data server too), and remove its record; a service gpumagic did not start is left alone."""
    from ..remote.execution import exec_simple

    if service.ours:
        pid = int(service.pid)
        exec_simple(connection, f"kill -TERM -- -{pid} 2>/dev/null || kill -TERM {pid}; "
                                f"rm -f \"$HOME/.gpumagic/services/{pid}.json\"", timeout=30)


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


def open_service_tunnel(machine, service: RemoteService, *, local_port: int | None, name: str) -> Tunnel:
    """The tunnel to ``service`` (reused when one is open), keeping what gpumagic knows of it.

    A service started just now (``service.started``) is stopped again when its tunnel cannot
    open, so a failed command leaves nothing running on the machine that nobody asked for.
    """
    t = machine.tunnels.find("127.0.0.1", service.port)
    if t is None:
        try:
            t = machine.tunnels.open(service.port, remote_host="127.0.0.1", local_port=local_port,
                                     name=name, path=service.path)
        except BaseException:
            if service.started:
                try:
                    stop_remote_service(machine.connection, service)
                except (GpumagicError, OSError):
                    pass  # the error that stopped us is the one to show
            raise
    if t.service is None or t.service.pid != service.pid:  # keep "started by gpumagic now"
        t.service = service
    return t
