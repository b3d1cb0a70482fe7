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
* Local -> remote: the serving thread reads the local socket into a buffer it reuses (a new
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
  the file descriptors run out (see :meth:`gpumagic.tunnel.manager.TunnelManager.open`).
* When the SSH connection dropped, the next local connection re-opens it; when its path
  went dead without a word (a roam, a NAT that forgot it), the next local connection
  notices (``Connection.ensure_alive``: a path quiet for 2 s answers a probe within
  max(3 s, 10 RTT), or a new connection is taken), so the same URL keeps working.
* Anything that goes wrong on a background thread is recorded as a :class:`TunnelFault`
  (``tunnel.faults``), shown by ``%gpu tunnel list``, and raised as :class:`TunnelError` by
  :meth:`Tunnel.check`, by :meth:`Tunnel.stop` and when the ``with`` block ends.  A local
  client that simply goes away (a browser closing a connection) is not a fault.
"""

from __future__ import annotations

import errno
import logging
import queue
import selectors
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import paramiko

from ..ssh import _paramiko
from ..ssh._paramiko import (close_without_eof, send_data_now, send_eof, send_window_adjust, sendall_ordered, transport_dropped)
from ..errors import ConnectionLost, GpumagicError, TunnelError
from .ports import bind_local

if TYPE_CHECKING:
    from ..ssh.connection import Connection
    from .services import RemoteService

log = logging.getLogger(__name__)

_T = TypeVar("_T", bound="TunnelBase")

#: Channel flow-control window asked of the server (bytes).
WINDOW_SIZE = 16 * 1024 * 1024
#: Largest SSH packet we accept on a tunnel channel (bytes).  OpenSSH's limit is 256 KiB for
#: a whole packet (``PACKET_MAX_SIZE`` in packet.c); 1 KiB is left for headers and padding.
MAX_PACKET_SIZE = 255 * 1024
#: Bytes asked for by one read in the copy loops.
CHUNK = 1024 * 1024
#: Seconds ``stop`` waits for the forwarding threads to finish.
JOIN_TIMEOUT = 5.0

_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)  # not on Windows: every write goes through _drain there

#: Bytes the transport thread reads for a connection's first request (a larger first
#: request is sent on by the serving thread).
FIRST_READ = 64 * 1024

#: A reusable read buffer per thread: ``recv(1 MiB)`` would allocate (and map) a new
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


class TunnelBase:
    """What every tunnel (local or reverse) keeps: the faults of its background threads
    (:attr:`faults`), each raised once -- by :meth:`check` (and so by ``stop`` and at the end
    of a ``with`` block) or handed out by :meth:`unreported_faults` for the notebook to show
    -- its byte counts, its state (:attr:`state`) and how it stops (:meth:`stop`).
    Subclasses set ``self._lock``, ``self.connection``, ``self.reconnects``,
    ``self._workers`` and ``self._state`` (``new`` -> ``open`` -> ``closed`` or
    ``failed: ...``), call :meth:`_init_counts`, say in :attr:`_lost_state` what happens
    while the SSH connection is down, name themselves in :attr:`label`, keep their live
    connections (objects with ``down`` and ``up`` byte counts and ``abort()``) in
    :attr:`_connections` by number, handing each to :meth:`_ended` when it is over, define
    :meth:`start`, and may add phases to :meth:`stop` (:meth:`_stop_listening`,
    :meth:`_release`)."""

    faults: list[TunnelFault]
    _lock: threading.Lock
    _workers: _Workers
    connection: Connection
    reconnects: int
    _state: str
    #: :attr:`state` while the SSH connection is down.
    _lost_state: ClassVar[str] = "SSH connection lost"
    #: True once :meth:`stop` ran (a failed tunnel stays listed until then).
    stopped: bool = False

    def start(self: _T) -> _T:
        """Start listening and forwarding; the listener is up on return."""
        raise NotImplementedError

    def stop(self, raise_errors: bool = True) -> None:
        """Stop listening and close every forwarded connection; safe to call twice.

        The phases: mark the tunnel closed (a failed one stays failed), stop listening
        (:meth:`_stop_listening`), abort each live connection, end the worker threads, and
        release what is left (:meth:`_release`).

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
            self.stopped = True
            live = list(self._connections.values())
        self._stop_listening(was_open)
        for c in live:
            c.abort()
        self._workers.shutdown(JOIN_TIMEOUT)
        self._release()
        if raise_errors:
            self.check()

    def _stop_listening(self, was_open: bool) -> None:
        """:meth:`stop`'s phase that ends the listener (``was_open``: the tunnel was open)."""

    def _release(self) -> None:
        """:meth:`stop`'s last phase, after the worker threads ended."""

    def __enter__(self: _T) -> _T:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        # Faults from the threads are raised here unless another exception is on its way.
        self.stop(raise_errors=exc_type is None)

    @property
    def state(self) -> str:
        """``open``, ``open, reconnected Nx``, :attr:`_lost_state` (the SSH connection is
        down), ``closed`` or ``failed: ...``."""
        if self._state != "open":
            return self._state
        if not self.connection.is_connected:
            return self._lost_state
        return f"open, reconnected {self.reconnects}x" if self.reconnects else "open"

    @property
    def is_open(self) -> bool:
        return self._state == "open"

    def _init_counts(self) -> None:
        self.faults = []
        self._reported = 0  # faults already raised or shown
        self.connections_total = 0
        self._connections: dict[int, Any] = {}  # the live ones, by number
        self._done_down = 0  # bytes of the connections that ended
        self._done_up = 0

    def _ended(self, number: int, conn) -> None:
        """Connection ``number`` (``conn``) is over: it is no longer live, and its bytes count
        in the totals."""
        with self._lock:
            self._connections.pop(number, None)
            self._done_down += conn.down
            self._done_up += conn.up

    @property
    def active_connections(self) -> int:
        with self._lock:
            return len(self._connections)

    @property
    def bytes_down(self) -> int:
        """Bytes towards this computer so far (all connections): from the remote service of
        a local tunnel, from the machine's clients of a reverse one."""
        with self._lock:
            return self._done_down + sum(c.down for c in self._connections.values())

    @property
    def bytes_up(self) -> int:
        """Bytes towards the machine so far (all connections)."""
        with self._lock:
            return self._done_up + sum(c.up for c in self._connections.values())

    @property
    def label(self) -> str:
        """What the tunnel is, for messages ("tunnel http://127.0.0.1:6006/ -> localhost:6006")."""
        raise NotImplementedError

    def _fault(self, number: int | None, message: str, error: BaseException) -> None:
        log.warning("gpumagic %s: %s", self.label, message)
        with self._lock:
            self.faults.append(TunnelFault(time.time(), number, message, error))

    def check(self) -> None:
        """Raise :class:`TunnelError` for faults recorded since the last check.

        Raises
        ------
        TunnelError
            Naming how many faults and the first one; ``__cause__`` is its exception.
        """
        new = self.unreported_faults()
        if new:
            more = f" (and {len(new) - 1} more: see tunnel.faults)" if len(new) > 1 else ""
            raise TunnelError(f"{self.label}: {new[0].message}{more}",
                              _hint_for(new[0].error)) from new[0].error

    def unreported_faults(self) -> list[TunnelFault]:
        """Faults not yet raised or shown; marks them as shown."""
        with self._lock:
            new = self.faults[self._reported:]
            self._reported = len(self.faults)
        return new


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


class Tunnel(TunnelBase):
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

    _lost_state = "SSH connection lost: reconnects on the next request"

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
        self._init_counts()
        #: The remote service (TensorBoard, Jupyter) this tunnel was opened for, if any.
        self.service: RemoteService | None = None
        self.reconnects = 0
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
        self._listener = bind_local(self.wanted_port, avoid=self.avoid_ports)
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

    def _stop_listening(self, was_open: bool) -> None:
        """Wake the thread that listens, so that it returns (:meth:`stop`)."""
        if was_open and self._wake_w is not None:
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass

    def _release(self) -> None:
        """Close the listener and the wake-up sockets (:meth:`stop`)."""
        if self._selector is not None:
            self._selector.close()
        for s in (self._listener, self._wake_r, self._wake_w):
            if s is not None:
                s.close()

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

    # -- what to show -----------------------------------------------------------------

    @property
    def url(self) -> str:
        """The local URL that reaches the remote service (127.0.0.1, never "localhost",
        which may resolve to ::1 where another program could listen)."""
        return f"http://127.0.0.1:{self.local_port}{self.path}"

    @property
    def label(self) -> str:
        """What the tunnel is, for messages: ``tunnel http://127.0.0.1:6006/ -> localhost:6006``
        (:attr:`url` and :attr:`target`)."""
        return f"tunnel {self.url} -> {self.target}"

    @property
    def id(self) -> str:
        """What ``%gpu tunnel list`` shows and ``%gpu tunnel close`` takes: the local port."""
        return str(self.local_port)

    @property
    def target(self) -> str:
        """``host:port`` as seen from the machine."""
        return f"{self.remote_host}:{self.remote_port}"

    def __repr__(self) -> str:
        where = self.url if self.local_port else "(not started)"
        return f"<Tunnel {self.name}: {where} -> {self.target} {self.state}>"

    # -- threads ----------------------------------------------------------------------

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
                    self._connections[fwd.number] = fwd
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
            self._ended(fwd.number, fwd)

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
            if not conn.heard_recently:
                hand_off()  # a probe of the path, or a new connection, may take seconds
            # A path quiet for a while must answer a probe first: after a roam it never
            # would, and the channel would wait ConnectTimeout for nothing; a new connection
            # is taken instead (Connection.ensure_alive), and the request goes there.
            conn.ensure_alive()
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
                if not attempt and self._path_was_dead(transport):
                    continue  # the path died just before (it had been heard from): again
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

    def _path_was_dead(self, transport) -> bool:
        """After a channel that did not open within ConnectTimeout on ``transport``: whether
        its path was dead (a roam just after the last packet, so no probe was asked before
        the channel): it is probed now, and True when a new connection was taken."""
        conn = self.connection
        if conn.transport is transport and transport.is_active():
            conn.ensure_alive()
        return conn.transport is not transport


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
