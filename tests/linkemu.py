"""A link emulator for the test bed: a userspace TCP proxy that makes a loopback sshd look like
a rented machine 20-60 ms away behind a student's uplink.

The kernels these tests run on have no ``sch_netem`` (``tc netem`` fails), so the link is
emulated in userspace, where it works on any machine: :class:`Link` listens on 127.0.0.1 and
relays every connection it accepts to a target port (a test sshd), through two one-way pipes.

The model (one *way* per direction, shared by every connection through the link, as a home
router's queue is):

* **rate** (``up_mbit``/``down_mbit``, Mbit/s = 10^6 bit/s; ``None``: no limit).  A way
  serialises the bytes it has read one after another: a chunk of ``n`` bytes read at ``t``
  starts when the way is free (``max(t, free_at)``) and takes ``n * 8 / rate`` seconds.
* **bounded queue** (``queue`` bytes per way; default 100 ms of the rate, at least 64 KiB).
  The bytes read but not yet serialised are the queue.  When it is full the proxy stops
  reading from the sender, so the sender's TCP flow control feels the cap (its writes block
  once its socket buffer is full), as behind a real bottleneck.  The proxy's own receive
  buffers are kept small (64 KiB) so that they do not add a hidden queue.
* **one-way delay** (``rtt_ms / 2``).  A chunk is written to the receiver a one-way delay
  after its last byte was serialised.  A new connection reaches the target at once, but the
  target's first bytes are read a one-way delay later (the server "sees" the connection
  then).  The TCP handshake itself is not delayed: a new connection costs one round trip less
  than on a real link, for every tool alike.
* A receiver that does not read stops the way for its connection too (the proxy keeps at most
  ``queue`` + one bandwidth-delay product + 64 KiB undelivered per connection and direction).

Faults (issue 28), all in *link time*, a clock that stands still while the link is held:

* :meth:`Link.hold` / :meth:`Link.release`: nothing moves in either direction on any
  connection (the proxy neither reads nor writes; new connections are accepted and wait).
  On release everything held is delivered, with the delay and rate it still had to go, as
  TCP's retransmissions would deliver it.
* :meth:`Link.blink` ``(seconds)``: a hold released by itself after ``seconds``.
* :meth:`Link.roam`: every connection open now goes silent for good in both directions (a
  network change, a NAT that forgot its entry): nothing is read from or written to either
  end again, and neither end is closed, so no FIN or RST tells anyone (they are closed when
  the link is).  Connections made afterwards work.

Counters (:meth:`Link.counters`, a :class:`Counters` snapshot; subtract two for a window):

* ``up_bytes`` / ``down_bytes``: payload bytes delivered to the server / to the client
  (SSH's own framing included: what a metered link bills).
* ``turns``: request/response turns, counted per connection.  The side that last sent holds
  *the floor*.  A read in the other direction is a turn when everything the floor's holder
  sent has already been delivered (its data fully left the link: the other side had it all,
  then spoke); the reader then takes the floor.  Data sent while the other side's bytes are
  still on the link (a window adjust during a bulk transfer, a second request sent before
  the first was answered, both banners at connect) is not a turn and leaves the floor as it
  is.  So a ping-pong of ``n`` exchanges is ``2n`` turns, pipelined requests answered as they
  arrive are one exchange, and a stream with a back-channel that nobody waits for is one.
  The very first data on a connection takes the floor as a turn.
* ``round_trips``: the turns towards the client (``down``): each time the server answered
  after all the client had sent reached it, i.e. each time the client had to wait for the
  server.  On a link with no delay and no rate the count degenerates to changes of direction
  (noise from back-channels is possible); count on a link with a delay.
* ``connections``: connections accepted.

An unprompted message that happens to follow the other side's (an SSH keepalive) counts like
a response: tests that count turns use a long ``ServerAliveInterval``.  :meth:`Link.settle`
waits until nothing is on the link and nothing was read for a while, then returns the
counters, so that trailing messages (a channel close) land in the window deterministically.

The proxy runs an asyncio event loop on one daemon thread (selector readiness callbacks and
timers, no per-connection threads): a few percent of one core at 50 Mbit/s.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import random
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Callable

MBIT = 1e6 / 8  # bytes per second in one Mbit/s
KIB = 1024
_RCVBUF = 64 * KIB  # the proxy's receive buffers on rated ways (Linux doubles it)
_SLACK = 64 * KIB  # undelivered bytes allowed per pipe beyond the queue and the BDP
_UNLIMITED_CHUNK = 256 * KIB
_UNLIMITED_CAP = 4 << 20  # undelivered bytes per pipe on a way with no rate


@dataclasses.dataclass(frozen=True)
class Counters:
    """What went over a :class:`Link` (see the module docstring for the definitions).

    ``a - b`` gives the counts of the window between snapshot ``b`` and snapshot ``a``.
    """

    up_bytes: int = 0
    down_bytes: int = 0
    round_trips: int = 0
    turns: int = 0
    connections: int = 0

    def __sub__(self, other: "Counters") -> "Counters":
        return Counters(*(getattr(self, f.name) - getattr(other, f.name)
                          for f in dataclasses.fields(self)))

    @property
    def bytes(self) -> int:
        """Both directions together."""
        return self.up_bytes + self.down_bytes


class _Way:
    """One direction's bottleneck, shared by all connections: its rate, queue and delay."""

    def __init__(self, mbit: float | None, delay: float, queue: int | None):
        self.rate = mbit * MBIT if mbit else None  # bytes per second
        self.delay = delay
        if queue is None:
            queue = max(64 * KIB, int(self.rate * 0.1)) if self.rate else 0
        self.queue = max(queue, KIB) if self.rate else queue
        if self.rate:
            self.chunk = max(4 * KIB, min(64 * KIB, int(self.rate * 0.004)))  # ~4 ms of the rate
            self.chunk = min(self.chunk, self.queue)
            self.cap = self.queue + int(self.rate * delay) + _SLACK
        else:
            self.chunk = _UNLIMITED_CHUNK
            self.cap = _UNLIMITED_CAP
        self.free_at = 0.0  # link time at which everything admitted is serialised
        self.peak_backlog = 0

    def backlog(self, now: float) -> int:
        """Bytes read but not yet serialised at link time ``now``."""
        if not self.rate:
            return 0
        return max(0, int((self.free_at - now) * self.rate))

    def room(self, now: float) -> int:
        """Bytes the queue may take now (0 while it is full), at most one chunk."""
        if not self.rate:
            return self.chunk
        free = self.queue - self.backlog(now)
        return min(self.chunk, free) if free >= self.chunk else 0

    def when_room(self) -> float:
        """Link time at which :meth:`room` is one chunk again."""
        assert self.rate
        return self.free_at - (self.queue - self.chunk) / self.rate + 1e-4  # past the rounding

    def admit(self, now: float, n: int) -> float:
        """Take ``n`` bytes read at ``now``; returns the link time they are due at the receiver."""
        if self.rate:
            self.free_at = max(now, self.free_at) + n / self.rate
            self.peak_backlog = max(self.peak_backlog, self.backlog(now))
            return self.free_at + self.delay
        return now + self.delay


class _Pipe:
    """One direction of one connection: reads ``src``, writes ``dst`` when each chunk is due."""

    def __init__(self, conn: "_Conn", direction: str, src: socket.socket, dst: socket.socket,
                 way: _Way, not_before: float):
        self.conn, self.direction, self.src, self.dst, self.way = conn, direction, src, dst, way
        self.pending: collections.deque = collections.deque()  # [due, data or None (EOF)]
        self.pending_bytes = 0
        self.not_before = not_before  # link time before which nothing is read
        self.reading = self.writing = False
        self.read_timer: asyncio.TimerHandle | None = None
        self.write_timer: asyncio.TimerHandle | None = None
        self.eof_read = self.eof_sent = False
        self.last_due = 0.0


class _Conn:
    def __init__(self, client: socket.socket, server: socket.socket):
        self.client, self.server = client, server
        self.pipes: dict[str, _Pipe] = {}
        self.floor: str | None = None  # direction of the side that holds the floor
        self.dead = False  # roamed: silent for good
        self.closed = False


class Link:
    """A userspace TCP proxy on 127.0.0.1 in front of ``target_port``: delay, rate, queue, faults.

    Parameters
    ----------
    target_port : int
        Where connections go (a test sshd's port).
    rtt_ms : float
        Round-trip time added, in milliseconds (half each way).
    up_mbit, down_mbit : float or None
        Rates client -> server and server -> client, Mbit/s (10^6 bit/s); None: no limit.
    queue : int, optional
        Bytes each way's queue holds before the sender is stopped (default: 100 ms of that
        way's rate, at least 64 KiB).
    target_host : str
        The target's address.

    ``start()`` returns the link with :attr:`port` set; ``close()`` (safe twice) closes every
    connection, silent ones included.  Also a context manager.
    """

    def __init__(self, target_port: int, *, rtt_ms: float = 40, up_mbit: float | None = 20,
                 down_mbit: float | None = 50, queue: int | None = None,
                 target_host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self.rtt_ms = rtt_ms
        delay = rtt_ms / 2000
        self.up = _Way(up_mbit, delay, queue)
        self.down = _Way(down_mbit, delay, queue)
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._listener: socket.socket | None = None
        self._conns: set[_Conn] = set()
        self._silent: list[_Conn] = []
        self._held_since: float | None = None
        self._paused = 0.0  # seconds the link has been held, in all
        self._blink_timer: asyncio.TimerHandle | None = None
        self._last_activity = 0.0
        self._counts = {f.name: 0 for f in dataclasses.fields(Counters)}

    # -- life cycle (caller's thread) ----------------------------------------------------

    def start(self) -> "Link":
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.up.rate:  # inherited by the accepted sockets: no hidden queue before the way
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RCVBUF)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            assert self._loop is not None
            self._loop.add_reader(listener, self._accept)
            self._loop.call_soon(ready.set)
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name=f"link-emulator-{self.port}", daemon=True)
        self._thread.start()
        ready.wait()
        return self

    def close(self) -> None:
        """Close the listener and every connection (silent ones too); safe to call twice."""
        loop = self._loop
        if loop is None or self._closed:
            return
        self._closed = True

        def shut() -> None:
            assert self._listener is not None
            loop.remove_reader(self._listener)
            self._listener.close()
            for conn in list(self._conns) + self._silent:
                self._close_conn(conn, loop)
            loop.stop()

        loop.call_soon_threadsafe(shut)
        assert self._thread is not None
        self._thread.join(10)
        loop.close()

    def __enter__(self) -> "Link":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- faults and counters (caller's thread) --------------------------------------------

    def hold(self) -> None:
        """Stop everything, both ways, every connection, until :meth:`release`."""
        self._call(self._hold)

    def release(self) -> None:
        """End a hold (or a blink early): what was held goes on with the delay and rate it had left."""
        self._call(self._release)

    def blink(self, seconds: float) -> None:
        """Hold the link for ``seconds``, then release it by itself (returns at once)."""

        def blink() -> None:
            self._hold()
            self._blink_timer = self._ev.call_later(seconds, self._release)

        self._call(blink)

    def roam(self) -> int:
        """Make every connection open now silent for good (both ways, no FIN, no RST); new
        connections work.  Returns how many connections went silent."""
        return self._call(self._roam)

    def counters(self) -> Counters:
        """A consistent snapshot of what the link has carried so far."""
        return self._call(lambda: Counters(**self._counts))

    def settle(self, quiet: float | None = None, timeout: float = 30) -> Counters:
        """Wait until nothing is on the link and nothing was read or written for ``quiet``
        seconds (default: one RTT + 50 ms) of link time, then return :meth:`counters`.

        Raises
        ------
        TimeoutError
            When the link is still busy after ``timeout`` seconds.
        """
        quiet = self.rtt_ms / 1000 + 0.05 if quiet is None else quiet
        deadline = time.monotonic() + timeout

        def idle() -> float | None:
            if any(p.pending for c in self._conns for p in c.pipes.values()):
                return None
            return self._now() - self._last_activity

        while time.monotonic() < deadline:
            gap = self._call(idle)
            if gap is not None and gap >= quiet:
                return self.counters()
            time.sleep(max(0.005, quiet - gap) if gap is not None else 0.01)
        raise TimeoutError(f"the link did not go quiet for {quiet:.3f} s within {timeout} s")

    @property
    def peak_queue(self) -> tuple[int, int]:
        """The largest backlog (bytes read, not yet serialised) each way had: (up, down)."""
        return self._call(lambda: (self.up.peak_backlog, self.down.peak_backlog))

    @property
    def open_connections(self) -> int:
        """Connections relayed now (silent ones not included)."""
        return self._call(lambda: len(self._conns))

    def _live_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None or self._closed:
            raise RuntimeError("the link is not started (or was closed)")
        return self._loop

    @property
    def _ev(self) -> asyncio.AbstractEventLoop:
        """The loop, from code that runs on it."""
        assert self._loop is not None
        return self._loop

    def _call(self, fn: Callable):
        """Run ``fn`` on the link's loop and return its result."""
        loop = self._live_loop()
        done = threading.Event()
        box: list = []

        def run() -> None:
            try:
                box.append((True, fn()))
            except BaseException as e:  # handed back to the caller
                box.append((False, e))
            done.set()

        loop.call_soon_threadsafe(run)
        if not done.wait(30):
            raise RuntimeError("the link emulator's loop did not answer within 30 s")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    # -- the loop (everything below runs on the link's thread) ----------------------------

    def _now(self) -> float:
        """Link time: real time less the time the link was held (frozen during a hold)."""
        now = time.monotonic() if self._held_since is None else self._held_since
        return now - self._paused

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            server = socket.socket()
            if self.down.rate:
                server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RCVBUF)
            try:
                server.settimeout(5)
                server.connect(self.target)
            except OSError:
                server.close()
                client.close()
                continue
            for s in (client, server):
                s.setblocking(False)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(client, server)
            now = self._now()
            conn.pipes["up"] = _Pipe(conn, "up", client, server, self.up, now)
            conn.pipes["down"] = _Pipe(conn, "down", server, client, self.down, now + self.down.delay)
            self._conns.add(conn)
            self._counts["connections"] += 1
            for pipe in conn.pipes.values():
                self._want_read(pipe)

    def _want_read(self, pipe: _Pipe) -> None:
        """Read from ``pipe.src`` when the link may take bytes, else stop and arrange to look again."""
        loop = self._ev
        conn = pipe.conn
        if pipe.read_timer is not None:
            pipe.read_timer.cancel()
            pipe.read_timer = None
        can, wake = False, None
        if conn.dead or conn.closed or pipe.eof_read or self._held_since is not None:
            pass  # release() or nothing will look again
        elif self._now() < pipe.not_before:
            wake = pipe.not_before
        elif pipe.pending_bytes >= pipe.way.cap:
            pass  # the receiver is slow: the writer looks again when it delivers
        elif pipe.way.room(self._now()) == 0:
            wake = pipe.way.when_room()
        else:
            can = True
        if can and not pipe.reading:
            loop.add_reader(pipe.src.fileno(), self._on_readable, pipe)
            pipe.reading = True
        elif not can and pipe.reading:
            loop.remove_reader(pipe.src.fileno())
            pipe.reading = False
        if wake is not None:
            pipe.read_timer = loop.call_later(max(0.0, wake - self._now()), self._want_read, pipe)

    def _on_readable(self, pipe: _Pipe) -> None:
        conn = pipe.conn
        now = self._now()
        room = 0 if (conn.dead or self._held_since is not None) else pipe.way.room(now)
        room = min(room, pipe.way.cap - pipe.pending_bytes)
        if room <= 0:
            self._want_read(pipe)
            return
        try:
            data = pipe.src.recv(room)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""  # reset: passed on as an end of stream
        self._last_activity = now
        if not data:
            pipe.eof_read = True
            due = max(pipe.last_due, now + pipe.way.delay)
            pipe.pending.append([due, None])
        else:
            self._count_turn(conn, pipe.direction)
            due = pipe.way.admit(now, len(data))
            pipe.last_due = due
            pipe.pending.append([due, data])
            pipe.pending_bytes += len(data)
        self._arm_writer(pipe)
        self._want_read(pipe)

    def _count_turn(self, conn: _Conn, direction: str) -> None:
        if conn.floor == direction:
            return
        if conn.floor is not None and conn.pipes[conn.floor].pending_bytes:
            return  # the other side's bytes are still on the link: talking over, not a turn
        conn.floor = direction
        self._counts["turns"] += 1
        if direction == "down":
            self._counts["round_trips"] += 1

    def _arm_writer(self, pipe: _Pipe) -> None:
        if pipe.writing or pipe.write_timer is not None or not pipe.pending:
            return
        if self._held_since is not None or pipe.conn.dead or pipe.conn.closed:
            return
        wait = pipe.pending[0][0] - self._now()
        if wait <= 0:
            self._write(pipe)
        else:
            pipe.write_timer = self._ev.call_later(wait, self._on_due, pipe)

    def _on_due(self, pipe: _Pipe) -> None:
        pipe.write_timer = None
        self._write(pipe)

    def _on_writable(self, pipe: _Pipe) -> None:
        self._ev.remove_writer(pipe.dst.fileno())
        pipe.writing = False
        self._write(pipe)

    def _write(self, pipe: _Pipe) -> None:
        """Deliver every chunk that is due; wait for the receiver when its buffer is full."""
        conn = pipe.conn
        if self._held_since is not None or conn.dead or conn.closed:
            return
        now = self._now()
        delivered = False
        while pipe.pending and pipe.pending[0][0] <= now:
            entry = pipe.pending[0]
            data = entry[1]
            if data is None:
                pipe.pending.popleft()
                pipe.eof_sent = True
                try:
                    pipe.dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                if all(p.eof_sent for p in conn.pipes.values()):
                    self._close_conn(conn, self._ev)
                    return
                continue
            try:
                n = pipe.dst.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError:
                self._close_conn(conn, self._ev)
                return
            if n:
                delivered = True
                self._last_activity = now
                self._counts[f"{pipe.direction}_bytes"] += n
                pipe.pending_bytes -= n
            if n < len(data):
                entry[1] = data[n:]
                self._ev.add_writer(pipe.dst.fileno(), self._on_writable, pipe)
                pipe.writing = True
                break
            pipe.pending.popleft()
        if delivered:
            self._want_read(pipe)
        self._arm_writer(pipe)

    def _close_conn(self, conn: _Conn, loop: asyncio.AbstractEventLoop) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._stop_conn(conn, loop)
        self._conns.discard(conn)
        for s in (conn.client, conn.server):
            s.close()

    def _stop_conn(self, conn: _Conn, loop: asyncio.AbstractEventLoop) -> None:
        for pipe in conn.pipes.values():
            for timer in (pipe.read_timer, pipe.write_timer):
                if timer is not None:
                    timer.cancel()
            pipe.read_timer = pipe.write_timer = None
            if pipe.reading:
                loop.remove_reader(pipe.src.fileno())
                pipe.reading = False
            if pipe.writing:
                loop.remove_writer(pipe.dst.fileno())
                pipe.writing = False

    def _hold(self) -> None:
        if self._blink_timer is not None:
            self._blink_timer.cancel()
            self._blink_timer = None
        if self._held_since is None:
            self._held_since = time.monotonic()
            for conn in self._conns:
                for pipe in conn.pipes.values():
                    self._want_read(pipe)  # stops reading
                    if pipe.write_timer is not None:
                        pipe.write_timer.cancel()
                        pipe.write_timer = None

    def _release(self) -> None:
        if self._blink_timer is not None:
            self._blink_timer.cancel()
            self._blink_timer = None
        if self._held_since is None:
            return
        self._paused += time.monotonic() - self._held_since
        self._held_since = None
        for conn in list(self._conns):
            for pipe in conn.pipes.values():
                self._want_read(pipe)
                self._arm_writer(pipe)

    def _roam(self) -> int:
        loop = self._ev
        gone = list(self._conns)
        for conn in gone:
            conn.dead = True
            self._stop_conn(conn, loop)
            for pipe in conn.pipes.values():
                pipe.pending.clear()
                pipe.pending_bytes = 0
            self._conns.discard(conn)
            self._silent.append(conn)
        return len(gone)


class LinkedMachine:
    """A :class:`Link` in front of a test sshd and a gpumagic Machine connected through it.

    The machine's ``ServerAliveInterval`` is ``keepalive`` seconds (long by default, so that
    no keepalive lands in a window whose turns a test counts).  ``spec`` reaches the server
    through the link; ``ssh_argv()`` is the OpenSSH client's command line to it (for
    ``rsync -e`` and ``ssh -L``).  ``blink``, ``hold``, ``release``, ``roam``, ``counters``
    and ``settle`` are the link's.  ``close()`` closes the machine, then the link.
    """

    def __init__(self, server, link: Link, *, keepalive: float = 300, connect: bool = True,
                 known_hosts: str | None = None):
        from pathlib import Path

        import gpumagic

        self.server, self.link = server, link
        kh = Path(known_hosts or f"{server.known_hosts}-link{link.port}")
        _name, key_type, key = server.known_hosts.read_text(encoding="utf-8").split()[:3]
        kh.write_text(f"[127.0.0.1]:{link.port} {key_type} {key}\n", encoding="utf-8")
        self.known_hosts = kh
        self.spec = server.spec().with_options(port=link.port, known_hosts=str(kh),
                                               server_alive_interval=keepalive)
        self.machine = gpumagic.Machine(self.spec)
        if connect:
            self.machine.connect()

    def ssh_argv(self, *remote: str) -> list[str]:
        """argv of OpenSSH's client to the server through the link (no user config read)."""
        s = self.server
        return ["ssh", "-F", "/dev/null", "-i", str(s.client_key), "-p", str(self.link.port),
                "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "StrictHostKeyChecking=yes",
                "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", f"{s.user}@127.0.0.1", *remote]

    def ssh_config_block(self, alias: str) -> str:
        """A ``Host alias`` block for ``~/.ssh/config`` that goes through the link."""
        s = self.server
        return (f"Host {alias}\n  HostName 127.0.0.1\n  Port {self.link.port}\n  User {s.user}\n"
                f"  IdentityFile {s.client_key}\n  IdentitiesOnly yes\n"
                f"  UserKnownHostsFile {self.known_hosts}\n")

    def blink(self, seconds: float) -> None:
        self.link.blink(seconds)

    def hold(self) -> None:
        self.link.hold()

    def release(self) -> None:
        self.link.release()

    def roam(self) -> int:
        return self.link.roam()

    def counters(self) -> Counters:
        return self.link.counters()

    def settle(self, quiet: float | None = None, timeout: float = 30) -> Counters:
        return self.link.settle(quiet, timeout)

    def close(self) -> None:
        try:
            self.machine.close()
        finally:
            self.link.close()


def csv_text(rng: random.Random, size: int) -> str:
    """A training log as CSV, about ``size`` bytes (numbers as a trainer prints them): what the
    link's tests and benchmarks/link_vs_tools.py sync (it compresses as such logs do)."""
    lines = ["step,epoch,loss,accuracy,lr,grad_norm,seconds\n"]
    n, step, loss = len(lines[0]), 0, 6.0
    while n < size:
        step += 1
        loss = max(0.01, loss * 0.99995 + rng.gauss(0, 0.01))
        line = (f"{step},{step // 5000},{loss:.6f},{min(1.0, 1 - loss / 7 + rng.gauss(0, 0.01)):.4f},"
                f"{3e-4 * (1 - step / 2e6):.6e},{abs(rng.gauss(1.5, 0.4)):.4f},{step * 0.0931:.3f}\n")
        lines.append(line)
        n += len(line)
    return "".join(lines)


# -- what tests and benchmarks of faults share ---------------------------------------------------


class Lines:
    """A stdout sink that keeps every chunk (thread-safe); :meth:`lines` splits them."""

    def __init__(self):
        self.text = ""
        self.lock = threading.Lock()

    def __call__(self, chunk: str) -> None:
        with self.lock:
            self.text += chunk

    def lines(self) -> list[str]:
        return self.text.splitlines()


def lose(server) -> None:
    """Machine ``server`` goes: its sshd, every connection it serves and every process they
    started (Linux's ``/proc``; a job's tmux keeps its group out of this tree: its caller
    kills that).  Its port stays bound, and not listening, until :func:`come_back`: a
    connection to it is refused, as to a machine that went, and no other test's sshd takes
    the port meanwhile (CI once saw another server's host key there: gpumagic refused it as
    a changed key, rightly, and the test read that as the wrong loss)."""
    parents = {}
    for proc in Path("/proc").iterdir():
        try:
            parents[int(proc.name)] = int((proc / "stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    tree, grew = {server.proc.pid}, True
    while grew:
        more = {p for p, pp in parents.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    server.stop()
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        held.bind((server.host, server.port))
    except OSError:  # taken already in the moment between: the test sees what it sees
        held.close()
        return
    server.held_port = held


def come_back(server) -> None:
    """Machine ``server``, lost by :func:`lose`, answers again on its port."""
    held = getattr(server, "held_port", None)
    if held is not None:
        held.close()
        server.held_port = None
    server.start()
