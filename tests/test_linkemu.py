"""The link emulator itself (tests/linkemu.py): rate, delay, bounded queue, turns, faults.

Timing is asserted only where timing is what the emulator is for (a rate, a delay), with a
strict bound on the side the emulator controls (it never delivers early or fast) and a loose
one on the side a loaded machine can spoil.  Turn counts are exact.
"""

from __future__ import annotations

import select
import socket
import threading
import time

import pytest

from linkemu import Link


class Target:
    """A plain TCP server on 127.0.0.1 behind the link: ``accept()`` hands over each connection."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]

    def accept(self, timeout: float = 5) -> socket.socket:
        self.sock.settimeout(timeout)
        conn, _ = self.sock.accept()
        conn.settimeout(timeout)
        return conn

    def close(self):
        self.sock.close()


@pytest.fixture
def target():
    t = Target()
    yield t
    t.close()


def dial(link: Link, timeout: float = 5) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", link.port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recv_exactly(s: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise EOFError(f"end of stream after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def in_thread(fn, *args) -> threading.Thread:
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("direction, mbit, size", [("up", 8, 600_000), ("down", 24, 1_800_000)])
def test_rate_caps_a_bulk_transfer(target, direction, mbit, size):
    """Bytes delivered over the measured interval (first to last arrival) come at the rate set:
    never faster (the emulator's clock), not much slower (a loaded machine's timers)."""
    rates = {"up_mbit": None, "down_mbit": None, f"{direction}_mbit": mbit}
    payload = (bytes(range(256)) * (size // 256 + 1))[:size]
    with Link(target.port, rtt_ms=0, **rates) as link:
        client = dial(link)
        server = target.accept()
        sender, receiver = (client, server) if direction == "up" else (server, client)
        in_thread(sender.sendall, payload)
        first = receiver.recv(65536)
        t0 = time.monotonic()
        rest = recv_exactly(receiver, len(payload) - len(first))
        elapsed = time.monotonic() - t0
        assert first + rest == payload
        measured = len(rest) * 8 / elapsed / 1e6
        assert measured <= mbit * 1.05, f"{measured:.2f} Mbit/s through a {mbit} Mbit/s link"
        assert measured >= mbit * 0.7, f"{measured:.2f} Mbit/s through a {mbit} Mbit/s link"
        c = link.counters()
        assert (c.up_bytes, c.down_bytes) == ((size, 0) if direction == "up" else (0, size))
        client.close(), server.close()


def test_ping_pong_takes_one_rtt_per_exchange_and_counts_each(target):
    """Five request/response exchanges over a 30 ms RTT: at least 5 x 30 ms, and exactly 5
    round trips (10 turns), 500 bytes each way."""
    with Link(target.port, rtt_ms=30, up_mbit=None, down_mbit=None) as link:
        client = dial(link)
        server = target.accept()

        def answer():
            for _ in range(5):
                server.sendall(recv_exactly(server, 100).upper())

        in_thread(answer)
        time.sleep(0.05)  # past the connection's start (the server is "seen" a one-way delay later)
        before = link.counters()
        t0 = time.monotonic()
        for i in range(5):
            client.sendall(b"q%02d" % i + b"x" * 97)
            assert recv_exactly(client, 100) == b"Q%02d" % i + b"X" * 97
        elapsed = time.monotonic() - t0
        c = link.settle() - before
        assert elapsed >= 5 * 0.030
        assert elapsed < 5 * 0.030 + 1.5
        assert (c.round_trips, c.turns, c.up_bytes, c.down_bytes) == (5, 10, 500, 500)
        client.close(), server.close()


def test_pipelined_requests_answered_as_they_arrive_are_one_round_trip(target):
    """Three requests sent 3 ms apart without waiting, each answered on arrival: the client
    waited once."""
    with Link(target.port, rtt_ms=40, up_mbit=None, down_mbit=None) as link:
        client = dial(link)
        server = target.accept()

        def answer():
            for _ in range(3):
                server.sendall(recv_exactly(server, 10))

        in_thread(answer)
        time.sleep(0.05)
        before = link.counters()
        for i in range(3):
            client.sendall(b"request-%d" % i + b"\n")
            time.sleep(0.003)
        assert recv_exactly(client, 30) == b"request-0\nrequest-1\nrequest-2\n"
        c = link.settle() - before
        assert (c.round_trips, c.turns) == (1, 2)
        client.close(), server.close()


def test_back_channel_nobody_waits_for_is_not_a_round_trip(target):
    """A request answered by a 512 KB stream at 20 Mbit/s while the client acknowledges every
    64 KB (as SSH's window adjusts do) and the server never waits for them: one round trip."""
    total, window = 512 * 1024, 64 * 1024
    with Link(target.port, rtt_ms=40, up_mbit=20, down_mbit=20) as link:
        client = dial(link)
        server = target.accept()

        def serve():
            recv_exactly(server, 4)
            in_thread(lambda: recv_exactly(server, 3 * (total // window - 1)))  # the acks, unread
            server.sendall(b"d" * total)

        in_thread(serve)
        time.sleep(0.05)
        before = link.counters()
        client.sendall(b"GET!")
        got = 0
        while got < total:
            got += len(recv_exactly(client, window))
            if got < total:
                client.sendall(b"ack")
        c = link.settle() - before
        assert (c.round_trips, c.turns) == (1, 2)
        assert c.down_bytes == total
        client.close(), server.close()


def test_window_stalls_are_round_trips(target):
    """The same stream where the server waits for each acknowledgement before its next 64 KB
    (a window that is too small): each stall is a round trip, 4 windows are 4."""
    windows, window = 4, 64 * 1024
    with Link(target.port, rtt_ms=40, up_mbit=20, down_mbit=20) as link:
        client = dial(link)
        server = target.accept()

        def serve():
            recv_exactly(server, 4)
            for i in range(windows):
                if i:
                    recv_exactly(server, 3)
                server.sendall(b"d" * window)

        in_thread(serve)
        time.sleep(0.05)
        before = link.counters()
        client.sendall(b"GET!")
        for i in range(windows):
            recv_exactly(client, window)
            if i < windows - 1:
                client.sendall(b"ack")
        c = link.settle() - before
        assert (c.round_trips, c.turns) == (windows, 2 * windows)
        client.close(), server.close()


def test_full_queue_stops_reading_from_the_sender(target):
    """At 1 Mbit/s with a 32 KiB queue, a sender that writes as fast as its socket lets it is
    held back after its own and the proxy's buffers: it cannot hand over megabytes at once, and
    the link's backlog never passes the queue and one chunk."""
    queue = 32 * 1024
    with Link(target.port, rtt_ms=0, up_mbit=1, down_mbit=None, queue=queue) as link:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 * 1024)
        client.connect(("127.0.0.1", link.port))
        server = target.accept()
        in_thread(_drain, server)
        client.setblocking(False)
        written, deadline = 0, time.monotonic() + 0.3
        block = b"x" * 65536
        while time.monotonic() < deadline:
            try:
                written += client.send(block)
            except BlockingIOError:
                select.select([], [client], [], 0.02)
        # 0.3 s of a 125 kB/s link is 37.5 kB; the sender's, the proxy's and the kernel's
        # buffers add a few hundred kB at most.  Without flow control it would be 100s of MB.
        assert written < 600_000, f"the sender handed over {written:,} bytes in 0.3 s"
        up_peak, _ = link.peak_queue
        assert up_peak <= queue + 4096
        client.close(), server.close()


def _drain(s: socket.socket) -> None:
    try:
        while s.recv(65536):
            pass
    except OSError:
        pass


def test_receiver_that_does_not_read_stops_the_sender(target):
    """No rate at all, but the server never reads: the proxy keeps a bounded amount undelivered
    (4 MiB) and then stops reading, so the sender blocks instead of the proxy growing."""
    with Link(target.port, rtt_ms=0, up_mbit=None, down_mbit=None) as link:
        client = dial(link)
        server = target.accept()
        client.setblocking(False)
        written, deadline, block = 0, time.monotonic() + 0.5, b"x" * (1 << 20)
        while time.monotonic() < deadline and written < 64 << 20:
            try:
                written += client.send(block)
            except BlockingIOError:
                select.select([], [client], [], 0.02)
        assert written < 32 << 20, f"{written:,} bytes went into a link whose receiver reads nothing"
        client.close(), server.close()


def test_hold_delivers_nothing_until_release_then_everything_in_order(target):
    """Bytes already on the wire when the hold starts (one-way delay 100 ms) and bytes sent
    during it arrive only after release, all of them, in order."""
    with Link(target.port, rtt_ms=200, up_mbit=None, down_mbit=None) as link:
        client = dial(link)
        server = target.accept()
        client.sendall(b"in flight;")
        link.hold()
        client.sendall(b"sent while held")
        server.settimeout(0.3)
        with pytest.raises(socket.timeout):
            server.recv(100)
        assert link.counters().up_bytes == 0
        link.release()
        server.settimeout(5)
        assert recv_exactly(server, 25) == b"in flight;sent while held"
        client.close(), server.close()


def test_blink_holds_both_ways_then_delivers_it_all(target):
    """A 0.4 s blink: messages sent during it, either way, arrive in order, none before it ended."""
    with Link(target.port, rtt_ms=10, up_mbit=None, down_mbit=None) as link:
        client = dial(link)
        server = target.accept()
        time.sleep(0.02)
        t0 = time.monotonic()
        link.blink(0.4)
        for i in range(5):
            client.sendall(b"u%d" % i)
            server.sendall(b"d%d" % i)
            time.sleep(0.02)
        assert recv_exactly(server, 10) == b"u0u1u2u3u4"
        assert time.monotonic() - t0 >= 0.4
        assert recv_exactly(client, 10) == b"d0d1d2d3d4"
        client.close(), server.close()


def test_roam_silences_open_connections_for_good_and_new_ones_work(target):
    """After a roam the old connection carries nothing either way and is not closed (no EOF,
    no reset: the ends cannot tell); a new connection through the link works."""
    with Link(target.port, rtt_ms=10, up_mbit=None, down_mbit=None) as link:
        old_client = dial(link)
        old_server = target.accept()
        old_client.sendall(b"before")
        assert recv_exactly(old_server, 6) == b"before"
        assert link.roam() == 1
        assert link.open_connections == 0
        old_client.sendall(b"after")
        old_server.sendall(b"after")
        for s in (old_client, old_server):
            s.settimeout(0.3)
            with pytest.raises(socket.timeout):  # b"" would be an EOF the ends must not see
                s.recv(100)
        new_client = dial(link)
        new_server = target.accept()
        new_client.sendall(b"hello")
        assert recv_exactly(new_server, 5) == b"hello"
        c = link.counters()
        assert (c.connections, c.up_bytes) == (2, 11)
        for s in (old_client, new_client, new_server):
            s.close()
    old_server.settimeout(5)
    try:  # closing the link closes the silent ones too (a reset: the proxy left bytes unread)
        assert old_server.recv(100) == b""
    except ConnectionResetError:
        pass
    old_server.close()


def test_machine_through_the_link_runs_cells_and_survives_a_roam_with_a_new_connection(make_link):
    """The fixture: a gpumagic Machine connected through the link runs a cell; the link counts
    the cell's bytes and round trips; after a roam a second machine connects through the same
    link and runs one too."""
    linked = make_link(rtt_ms=20, up_mbit=20, down_mbit=50)
    m = linked.machine
    assert m.run("echo hi", quiet=True).stdout == "hi\n"
    before = linked.settle()
    assert m.run("echo again", quiet=True).stdout == "again\n"
    c = linked.settle() - before
    assert c.round_trips >= 1 and c.up_bytes > 0 and c.down_bytes > 0
    assert linked.roam() == 1
    import gpumagic

    other = gpumagic.Machine(linked.spec).connect()
    try:
        assert other.run("echo new", quiet=True).stdout == "new\n"
    finally:
        other.close()
    assert linked.counters().connections == 2
