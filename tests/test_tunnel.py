"""Tunnels (``machine.tunnel``, ``%gpu tunnel``) against the real test sshd.

The test sshd runs on this computer, so "the machine's 127.0.0.1" is this computer's too:
the services reached through tunnels are HTTP servers started here as separate processes,
and only ever reached through the SSH connection's direct-tcpip channels.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from conftest import wait_until
from gpumagic.ssh._paramiko import send_data_now, send_window_adjust
from gpumagic.errors import TunnelError
from gpumagic.ssh.sandbox import free_port

# A threaded HTTP server: GET /marker -> the marker text; GET /bytes/N -> N deterministic bytes.
_SERVER = r"""
import hashlib, http.server, socket, sys
host, port, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
block = hashlib.sha256(marker.encode()).digest() * 2048  # 64 KiB
class H(http.server.BaseHTTPRequestHandler):
    wbufsize = 1 << 16  # headers and a small body in one write (no Nagle/delayed-ACK wait)
    def do_GET(self):
        if self.path.startswith("/bytes/"):
            n = int(self.path.split("/")[2])
            self.send_response(200); self.send_header("Content-Length", str(n)); self.end_headers()
            while n > 0:
                chunk = block[:min(n, len(block))]
                self.wfile.write(chunk); n -= len(chunk)
            return
        body = marker.encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer.address_family = socket.AF_INET
s = http.server.ThreadingHTTPServer((host, port), H)
print("ready", flush=True)
s.serve_forever()
"""


def expected_bytes(marker: str, n: int) -> bytes:
    block = hashlib.sha256(marker.encode()).digest() * 2048
    return (block * (n // len(block) + 1))[:n]


@pytest.fixture
def server_script():
    """Run a server script (``python -c SCRIPT ARGS...``) until it prints "ready"; all
    stopped at the end."""
    procs = []

    def start(script: str, *args) -> None:
        p = subprocess.Popen([sys.executable, "-c", script, *map(str, args)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        procs.append(p)
        assert p.stdout.readline().strip() == b"ready", p.stderr.read()

    yield start
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture
def http_server(server_script):
    """Start HTTP servers (host, marker) -> port."""
    def start(host: str = "127.0.0.1", marker: str = "remote-content", port: int | None = None) -> int:
        port = port or free_port()
        server_script(_SERVER, host, port, marker)
        return port

    return start


# A TCP server.  "reject": reads 100 bytes, answers NO and closes, while the client may still
# be uploading.  "sink": reads everything until the client's EOF, then answers the count.
_TCP_SERVER = r"""
import socket, sys, threading
mode, port = sys.argv[1], int(sys.argv[2])
srv = socket.create_server(("127.0.0.1", port), backlog=128)
print("ready", flush=True)
def serve(c):
    with c:
        if mode == "reject":
            got = 0
            while got < 100:
                d = c.recv(100 - got)
                if not d:
                    break
                got += len(d)
            c.sendall(b"NO\n")
        else:
            n = 0
            while d := c.recv(1 << 20):
                n += len(d)
            c.sendall(str(n).encode())
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


@pytest.fixture
def tcp_server(server_script):
    """Start ``_TCP_SERVER`` in a mode -> port."""
    def start(mode: str) -> int:
        port = free_port()
        server_script(_TCP_SERVER, mode, port)
        return port

    return start


def fetch(url: str, timeout: float = 20) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def listening_sockets_of_this_process() -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that this process owns.

    Reads /proc/net/tcp and /proc/net/tcp6 (columns from the kernel's
    ``tcp4_seq_show``: local_address as hex IP:port, st 0A = LISTEN, inode) and keeps the
    inodes that /proc/self/fd links to.
    """
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        m = re.fullmatch(r"socket:\[(\d+)\]", target)
        if m:
            inodes.add(m.group(1))
    found = []
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = open(f"/proc/net/{name}", encoding="utf-8").read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state != "0A" or inode not in inodes:
                continue
            hexip, hexport = local.split(":")
            raw = bytes.fromhex(hexip)
            # The kernel prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((socket.inet_ntop(family, raw), int(hexport, 16)))
    return found


# -- cases of the issue -------------------------------------------------------------------


def test_taken_local_port_moves_tunnel_and_other_program_keeps_it(ip, http_server, capsys):
    held = 6006
    other = subprocess.Popen([sys.executable, "-c", _SERVER, "127.0.0.1", str(held), "other-program"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        if other.stdout.readline().strip() != b"ready":  # 6006 already used on this computer
            other.wait()
            held = free_port()
            other = subprocess.Popen([sys.executable, "-c", _SERVER, "127.0.0.1", str(held), "other-program"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            assert other.stdout.readline().strip() == b"ready"
        remote = http_server(marker="remote-content")
        ip.run_line_magic("gpu", "connect testgpu")
        capsys.readouterr()
        ip.run_line_magic("gpu", f"tunnel {remote} --local-port {held}")
        out = capsys.readouterr().out
        assert f"local port {held} is taken by another program" in out
        url = re.search(r"-> (http://127\.0\.0\.1:(\d+)/)", out)
        assert url is not None, out
        assert int(url.group(2)) != held
        assert fetch(url.group(1)) == b"remote-content"
        assert fetch(f"http://127.0.0.1:{held}/") == b"other-program"
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_port_held_on_ipv6_loopback_counts_as_taken(machine, http_server):
    # A browser may resolve "localhost" to ::1: a port another program holds there is
    # not offered, even though 127.0.0.1 with that port is free.
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this computer")
    holder = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        holder.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        holder.bind(("::1", 0))
    except OSError:
        holder.close()
        pytest.skip("no ::1 on this computer")
    holder.listen()
    held = holder.getsockname()[1]
    try:
        port = http_server(marker="v6")
        with machine.tunnel(port, local_port=held) as t:
            assert t.local_port != held and t.moved_from == held
            assert fetch(t.url) == b"v6"
    finally:
        holder.close()


def test_remote_servers_on_loopback_and_all_interfaces_both_reachable(machine, http_server):
    on_loopback = http_server("127.0.0.1", marker="bound-127")
    on_all = http_server("0.0.0.0", marker="bound-all")
    with machine.tunnel(on_loopback, local_port=0) as a, machine.tunnel(on_all, local_port=0) as b:
        assert fetch(a.url) == b"bound-127"
        assert fetch(b.url) == b"bound-all"


def test_twenty_parallel_5mb_downloads_complete_with_correct_bytes(machine, http_server):
    port = http_server(marker="parallel")
    size = 5 * 1024 * 1024
    want = hashlib.sha256(expected_bytes("parallel", size)).hexdigest()
    with machine.tunnel(port, local_port=0) as t:
        with ThreadPoolExecutor(20) as pool:
            bodies = list(pool.map(lambda i: fetch(f"http://127.0.0.1:{t.local_port}/bytes/{size}", 60),
                                   range(20)))
        assert [len(b) for b in bodies] == [size] * 20
        assert {hashlib.sha256(b).hexdigest() for b in bodies} == {want}
        assert t.connections_total == 20
        assert t.bytes_down >= 20 * size
        assert t.faults == []


def test_killed_ssh_connection_next_request_through_same_url_succeeds(machine, http_server):
    port = http_server(marker="after-drop")
    with machine.tunnel(port, local_port=0) as t:
        assert fetch(t.url) == b"after-drop"
        assert wait_until(lambda: t.active_connections == 0, 10)
        machine.connection.transport.sock.close()
        assert wait_until(lambda: not machine.connection.is_connected, 10)
        assert t.state == "SSH connection lost: reconnects on the next request"
        assert fetch(t.url) == b"after-drop"
        assert machine.connection.is_connected
        assert t.reconnects == 1
        assert t.state == "open, reconnected 1x"


def test_drop_during_a_transfer_resets_the_client_and_is_reported(machine, http_server):
    port = http_server(marker="big")
    size = 64 * 1024 * 1024  # more than the channel window: the server waits for us
    t = machine.tunnel(port, local_port=0)
    with socket.create_connection(("127.0.0.1", t.local_port), timeout=20) as s:
        s.sendall(f"GET /bytes/{size} HTTP/1.0\r\n\r\n".encode())
        got = len(s.recv(65536))
        machine.connection.transport.sock.close()
        with pytest.raises(ConnectionResetError):
            while True:
                chunk = s.recv(1 << 20)
                assert chunk, "the tunnel ended a cut transfer with a clean close"
                got += len(chunk)
    assert got < size
    with pytest.raises(TunnelError, match="the SSH connection dropped during a transfer"):
        t.stop()


def test_many_short_connections_never_break_the_ssh_connection(machine, http_server, sshd):
    # Each client closes just as the server closes: paramiko's own shutdown_write/sendall
    # could then send EOF/DATA after the channel's CLOSE, and sshd drops the whole
    # connection ("ieof packet referred to nonexistent channel"); seen about 1 in 1000.
    port = http_server(marker="short")
    opened = machine.connection.opened_count
    log_before = sshd.log.read_text(errors="replace", encoding="utf-8").count("nonexistent channel")
    with machine.tunnel(port, local_port=0) as t:
        for _ in range(200):
            with socket.create_connection(("127.0.0.1", t.local_port), timeout=20) as s:
                s.sendall(b"GET / HTTP/1.0\r\n\r\n")
                s.shutdown(socket.SHUT_WR)
                reply = b""
                while chunk := s.recv(65536):
                    reply += chunk
            assert reply.endswith(b"short")
    assert sshd.log.read_text(errors="replace", encoding="utf-8").count("nonexistent channel") == log_before
    assert machine.connection.opened_count == opened
    assert t.reconnects == 0


# A TCP server that speaks first: sends a banner on connect, then echoes lines back.
_BANNER_SERVER = r"""
import socket, sys, threading
srv = socket.create_server(("127.0.0.1", int(sys.argv[1])))
print("ready", flush=True)
def serve(c):
    with c:
        c.sendall(b"BANNER server-speaks-first\r\n")
        f = c.makefile("rb")
        for line in f:
            c.sendall(b"echo " + line)
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def test_server_that_speaks_first_reaches_a_client_that_has_not_sent_anything(machine):
    # The banner arrives right after the channel opens, before the client's first byte:
    # the moment the forward takes over the channel's input (none of it may be stranded).
    port = free_port()
    p = subprocess.Popen([sys.executable, "-c", _BANNER_SERVER, str(port)], stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"ready"
        with machine.tunnel(port, local_port=0) as t:
            for i in range(30):
                with socket.create_connection(("127.0.0.1", t.local_port), timeout=10) as s:
                    f = s.makefile("rb")
                    assert f.readline() == b"BANNER server-speaks-first\r\n"
                    s.sendall(f"ping {i}\n".encode())
                    assert f.readline() == f"echo ping {i}\n".encode()
            assert t.faults == []
    finally:
        p.kill()
        p.wait()


@pytest.mark.slow(270, reason="a client that reads more than a window slowly, on purpose")
def test_client_reading_slowly_gets_every_byte_of_more_than_a_window(machine, http_server):
    # 40 MiB with a 16 MiB channel window: the client reads nothing for a while, so the
    # local socket fills, bytes wait in the forward and the window is given back only as
    # the client takes them; then everything must arrive, in order.
    port = http_server(marker="slow-reader")
    size = 40 * 1024 * 1024
    with machine.tunnel(port, local_port=0) as t:
        with socket.create_connection(("127.0.0.1", t.local_port), timeout=30) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            s.sendall(f"GET /bytes/{size} HTTP/1.0\r\n\r\n".encode())
            assert wait_until(lambda: t.bytes_down >= 64 * 1024, 10)
            time.sleep(1.5)
            stalled = t.bytes_down
            assert stalled < size, "the window did not hold the server back"
            body = b""
            while chunk := s.recv(1 << 20):
                body += chunk
        head, _, data = body.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 200")
        assert len(data) == size
        assert hashlib.sha256(data).digest() == hashlib.sha256(expected_bytes("slow-reader", size)).digest()
        assert wait_until(lambda: t.active_connections == 0, 10)
        assert t.faults == []


def test_upload_to_a_service_that_closes_early_ends_in_an_error_not_a_hang(machine, tcp_server):
    # The service answers after 100 bytes and closes while each client still uploads 50 MB:
    # every client must read the answer, then get an error on sending (as through
    # `ssh -L`), never wait on a zero window.  The tunnel did hang about 1 client in 60.
    port = tcp_server("reject")
    payload = b"u" * (50 * 1024 * 1024)

    def upload(_):
        with socket.create_connection(("127.0.0.1", t.local_port), timeout=15) as s:
            answer = []

            def read():
                data = b""
                try:
                    while chunk := s.recv(100):
                        data += chunk
                except OSError:
                    pass
                answer.append(data)

            reader = threading.Thread(target=read)
            reader.start()
            try:
                s.sendall(payload)
                outcome = "sent all"
            except OSError as e:
                outcome = type(e).__name__
            reader.join(15)
            return outcome, answer

    with machine.tunnel(port, local_port=0) as t:
        for _ in range(3):
            with ThreadPoolExecutor(10) as pool:
                results = list(pool.map(upload, range(10)))
            assert {outcome for outcome, _ in results} <= {"BrokenPipeError", "ConnectionResetError"}, results
            assert all(answer == [b"NO\n"] for _, answer in results), results
        assert wait_until(lambda: t.active_connections == 0, 10)
        assert t.faults == []


def test_clients_that_reset_at_once_are_not_faults(machine, http_server):
    port = http_server(marker="after-resets")
    with machine.tunnel(port, local_port=0) as t:
        for i in range(20):  # half of them reset after their request, half before any
            s = socket.create_connection(("127.0.0.1", t.local_port))
            if i % 2:
                s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        assert wait_until(lambda: t.connections_total == 20 and t.active_connections == 0, 10)
        assert t.faults == []
        assert fetch(t.url) == b"after-resets"


def test_drop_during_uploads_is_reported_as_the_dropped_connection(machine, tcp_server):
    port = tcp_server("sink")
    t = machine.tunnel(port, local_port=0)
    clients = [socket.create_connection(("127.0.0.1", t.local_port), timeout=10) for _ in range(6)]
    try:
        for c in clients:
            c.sendall(b"u" * (1 << 20))
        assert wait_until(lambda: t.bytes_up >= 6 << 20, 10)
        machine.connection.transport.sock.close()
        for c in clients:
            with pytest.raises(OSError):
                for _ in range(200):
                    c.sendall(b"u" * (1 << 20))
    finally:
        for c in clients:
            c.close()
    assert wait_until(lambda: len(t.faults) == 6, 10), t.faults
    assert {f.message for f in t.faults} == {"the SSH connection dropped during a transfer"}
    t.stop(raise_errors=False)


def test_sends_on_the_transport_thread_never_wait_for_a_key_exchange(machine, tcp_server):
    # Only paramiko's transport thread can finish a key exchange: if it waited for one to
    # end before sending (the first request, a window adjustment), the whole SSH connection
    # would stall until paramiko's 30 s timeout.
    port = tcp_server("sink")
    transport = machine.connection.transport
    chan = transport.open_channel("direct-tcpip", ("127.0.0.1", port), ("127.0.0.1", 0))
    try:
        with transport.clear_to_send_lock:
            transport.clear_to_send.clear()  # what paramiko does when a key exchange starts
        try:
            start = time.monotonic()
            assert send_data_now(chan, b"first") is False
            assert send_window_adjust(chan, 1024, wait=False) is False
            assert time.monotonic() - start < 0.5
        finally:
            transport.clear_to_send.set()
        assert send_data_now(chan, b"12345") is True
        assert send_data_now(chan, b"x" * (chan.out_max_packet_size + 1)) is False  # two packets
        chan.shutdown_write()
        assert chan.recv(100) == b"5"
    finally:
        chan.close()


def test_key_exchanges_during_transfers_lose_nothing_and_stall_nothing(machine, http_server, tcp_server):
    down_port = http_server(marker="rekey")
    sink_port = tcp_server("sink")
    transport = machine.connection.transport
    size = 100 * 1024 * 1024
    done = threading.Event()
    rekeys = []

    def rekey():
        while not done.is_set():
            transport.renegotiate_keys()
            rekeys.append(time.monotonic())
            # a tenth of a second between them: dozens during the transfers (back to back, a
            # channel's open waited out its 15 s between exchanges with both suites at once)
            time.sleep(0.1)

    def upload(n: int) -> bytes:
        with socket.create_connection(("127.0.0.1", up.local_port), timeout=30) as s:
            s.sendall(b"u" * n)
            s.shutdown(socket.SHUT_WR)
            return s.recv(100)

    with machine.tunnel(down_port, local_port=0) as down, machine.tunnel(sink_port, local_port=0) as up:
        rekeyer = threading.Thread(target=rekey)
        rekeyer.start()
        try:
            with ThreadPoolExecutor(3) as pool:
                big_down = pool.submit(fetch, f"http://127.0.0.1:{down.local_port}/bytes/{size}", 30)
                big_up = pool.submit(upload, size // 2)
                shorts = [fetch(down.url, 30) for _ in range(100)]
                assert hashlib.sha256(big_down.result()).digest() == \
                    hashlib.sha256(expected_bytes("rekey", size)).digest()
                assert big_up.result() == str(size // 2).encode()
            assert shorts == [b"rekey"] * 100
        finally:
            done.set()
            rekeyer.join(60)
        assert len(rekeys) >= 5
        assert down.faults == [] and up.faults == []
    assert machine.connection.transport is transport  # never dropped


def test_a_channel_given_up_while_opening_is_closed_when_it_opens_late(machine):
    # The machine's connect to the target hangs (its accept queue is full): the tunnel gives
    # up on the channel (ConnectTimeout, or stop()), and when sshd's connect completes later
    # the channel must be closed, not left open on the machine.
    target = socket.socket()
    target.bind(("127.0.0.1", 0))
    target.listen(0)
    port = target.getsockname()[1]
    fillers = []
    for _ in range(3):
        f = socket.socket()
        f.setblocking(False)
        f.connect_ex(("127.0.0.1", port))
        fillers.append(f)
    filler_ports = {f.getsockname()[1] for f in fillers}
    spec = machine.connection.spec
    machine.connection.spec = replace(spec, connect_timeout=1.0)
    try:
        t = machine.tunnel(port, local_port=0)
        with socket.create_connection(("127.0.0.1", t.local_port), timeout=10) as s:
            s.sendall(b"hello")
            with pytest.raises(ConnectionResetError):  # our unread "hello": a reset
                s.recv(10)
        assert [f.message for f in t.faults] == [
            f"the machine did not connect to localhost:{port} within 1 s"]
        assert "accept" in t.faults[0].error.hint
        with socket.create_connection(("127.0.0.1", t.local_port), timeout=10) as s:
            s.sendall(b"hello")
            assert wait_until(lambda: t.connections_total == 2, 5)
            time.sleep(0.3)
            start = time.monotonic()
            t.stop(raise_errors=False)
            assert time.monotonic() - start < 1.0  # not the 5 s join timeout
            with pytest.raises(ConnectionResetError):
                s.recv(10)
        assert len(t.faults) == 1  # stop() is not a fault
    finally:
        machine.connection.spec = spec
        for f in fillers:
            f.close()
    target.settimeout(20)
    late = []
    while len(late) < 2:
        c, peer = target.accept()
        if peer[1] in filler_ports:
            c.close()
            continue
        late.append(c)
    for c in late:
        c.settimeout(10)
        assert c.recv(10) == b""  # closed through the SSH connection, nothing sent
        c.close()
    target.close()


def test_gpumagic_listens_only_on_127_0_0_1(machine, http_server):
    port = http_server(marker="x")
    with machine.tunnel(port) as same, machine.tunnel(port, local_port=0) as other:
        mine = listening_sockets_of_this_process()
        ports = {p for _, p in mine}
        assert {same.local_port, other.local_port} <= ports
        assert {addr for addr, _ in mine} == {"127.0.0.1"}, mine


# -- more behaviour ------------------------------------------------------------------------


def test_listing_parser_reads_proc_net_tcp_hex_addresses():
    # 127.0.0.1:6006 prints as 0100007F:1776 on little-endian Linux.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert ("127.0.0.1", s.getsockname()[1]) in listening_sockets_of_this_process()


def test_refused_remote_port_is_recorded_and_raised_when_the_block_ends(machine):
    dead = free_port()
    with pytest.raises(TunnelError, match=f"could not connect to localhost:{dead}") as info:
        with machine.tunnel(dead, local_port=0) as t:
            with pytest.raises(OSError):
                fetch(t.url, timeout=10)
            assert wait_until(lambda: t.faults, 10)
            assert t.faults[0].connection == 1
    assert "check that the service is running" in info.value.hint


def test_parallel_refused_connections_each_say_the_service_is_not_there(machine):
    # Paramiko keeps one "last exception" per SSH connection: refusals that arrive together
    # must not take each other's reason (and leave "Unable to open channel" to the others).
    dead = free_port()
    t = machine.tunnel(dead, local_port=0)
    try:
        clients = [socket.create_connection(("127.0.0.1", t.local_port)) for _ in range(16)]
        for c in clients:
            c.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert wait_until(lambda: len(t.faults) == 16, 20), t.faults
        messages = {f.message for f in t.faults}
        assert messages == {f"the machine could not connect to localhost:{dead}: Connection refused"}, messages
        for c in clients:
            c.close()
    finally:
        t.stop(raise_errors=False)


def test_slow_connection_does_not_stall_others(machine, http_server):
    port = http_server(marker="fast")
    with machine.tunnel(port, local_port=0) as t:
        idle = socket.create_connection(("127.0.0.1", t.local_port))  # never sends a request
        try:
            assert fetch(t.url, timeout=10) == b"fast"
            assert wait_until(lambda: t.active_connections == 1, 10)
            assert t.connections_total == 2
        finally:
            idle.close()


def test_stop_closes_listener_and_machine_close_closes_every_tunnel(sshd, http_server):
    import gpumagic

    port = http_server(marker="y")
    m = gpumagic.connect("testgpu")
    t = m.tunnel(port, local_port=0)
    assert fetch(t.url) == b"y"
    m.close()
    assert not t.is_open and len(m.tunnels) == 0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", t.local_port), timeout=5).close()


def test_magic_list_and_close(ip, http_server, capsys):
    port = http_server(marker="z")
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", f"tunnel {port} --local-port 0")
    m = ip._gpumagic.fleet.get()
    (t,) = list(m.tunnels)
    fetch(t.url)
    assert wait_until(lambda: t.active_connections == 0, 10)
    capsys.readouterr()
    ip.run_line_magic("gpu", "tunnel list")
    out = capsys.readouterr().out
    row = [ln for ln in out.splitlines() if ln.startswith(str(t.local_port))]
    assert len(row) == 1 and f"localhost:{port}" in row[0] and "0/1" in row[0] and row[0].endswith("open"), out
    ip.run_line_magic("gpu", f"tunnel close {t.local_port}")
    assert f"closed tunnel {t.local_port}" in capsys.readouterr().out
    assert len(m.tunnels) == 0
    ip.run_line_magic("gpu", "tunnel list")
    assert "no tunnels open" in capsys.readouterr().out


def test_magic_says_when_nothing_listens_and_reports_the_failure_after_the_next_cell(ip, capsys):
    dead = free_port()
    ip.run_line_magic("gpu", "connect testgpu")
    capsys.readouterr()
    ip.run_line_magic("gpu", f"tunnel {dead} --local-port 0")
    out = capsys.readouterr().out
    assert (f"nothing accepts connections on localhost:{dead} on the machine yet "
            "(Connection refused)") in out, out
    (t,) = list(ip._gpumagic.fleet.get().tunnels)
    with pytest.raises(OSError):  # a browser sees only a reset connection
        fetch(t.url, timeout=10)
    assert wait_until(lambda: t.faults, 10)
    ip.run_cell("1 + 1")
    out = capsys.readouterr().out
    assert (f"gpumagic: tunnel {t.url} -> localhost:{dead} on testgpu: the machine could not "
            f"connect to localhost:{dead}: Connection refused") in out, out
    assert "hint: check that the service is running on the machine" in out
    ip.run_cell("2 + 2")
    assert "gpumagic: tunnel" not in capsys.readouterr().out  # said once


def test_magic_bad_arguments_are_usage_errors(ip):
    from IPython.core.error import UsageError

    ip.run_line_magic("gpu", "connect testgpu")
    for line in ("tunnel nonsense", "tunnel close abc", "tunnel close 1", "tunnel 70000"):
        with pytest.raises(UsageError):
            ip.run_line_magic("gpu", line)


def test_tensorboard_missing_on_machine_names_the_pip_command(tmp_path):
    from conftest import add_client_entry, make_server

    import gpumagic

    server = make_server("notensorboard")
    server.install_bin("python3", "#!/bin/sh\nexec /usr/bin/python3 \"$@\"\n")
    add_client_entry(server, "notensorboard")
    try:
        with gpumagic.connect("notensorboard") as m:
            with pytest.raises(TunnelError) as info:
                m.tunnels.tensorboard()
        assert "TensorBoard is not installed" in info.value.message
        # one line a user can act on (it printed a literal \n between %%remote and the command)
        hint = info.value.hint
        assert hint.startswith("install it there: a %%remote cell with `") and "\\" not in hint, hint
        assert hint.endswith("python3 -m pip install tensorboard`"), hint
    finally:
        server.stop()


def test_jupyter_tunnel_url_carries_the_token_and_stop_ends_the_server(machine):
    import json
    import urllib.error

    t = machine.tunnels.jupyter(local_port=0)
    pid = t.service.pid
    try:
        token = re.search(r"\?token=(\w+)$", t.url)
        assert token and t.service.started, t.url
        base = f"http://127.0.0.1:{t.local_port}/api/status"
        assert "started" in json.loads(fetch(f"{base}?token={token.group(1)}"))
        with pytest.raises(urllib.error.HTTPError) as denied:
            fetch(base)
        assert denied.value.code == 403
        assert machine.tunnels.jupyter(local_port=0) is t  # found running: reused, not started twice
        assert t.service.pid == pid and t.service.started
    finally:
        machine.tunnels.close(t.local_port, stop_service=True)
    assert wait_until(lambda: process_gone(pid), 15)


def process_gone(pid: int) -> bool:
    """True when no process ``pid`` runs on this computer (a zombie counts as gone)."""
    try:
        return open(f"/proc/{pid}/stat", encoding="utf-8").read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


# -- reuse and loops (defects a new user found) --------------------------------------------


def test_same_target_three_times_is_one_tunnel_said_already_open(ip, http_server, capsys):
    port = http_server(marker="once")
    ip.run_line_magic("gpu", "connect testgpu")
    m = ip._gpumagic.fleet.get()
    capsys.readouterr()
    outs = []
    for _ in range(3):
        ip.run_line_magic("gpu", f"tunnel {port}")
        outs.append(capsys.readouterr().out)
    (t,) = list(m.tunnels)
    assert "already open" not in outs[0]
    for out in outs[1:]:
        assert f"a tunnel to localhost:{port} is already open at {t.url}" in out, out
        assert "taken by another program" not in out
    assert fetch(t.url) == b"once"


def tunnel_twice_on_one_local_port(ip, capsys, first: int, second: int, local: int):
    """``%gpu tunnel first`` then ``second``, both asking for ``local``: (machine, the second's output)."""
    ip.run_line_magic("gpu", "connect testgpu")
    m = ip._gpumagic.fleet.get()
    ip.run_line_magic("gpu", f"tunnel {first} --local-port {local}")
    capsys.readouterr()
    ip.run_line_magic("gpu", f"tunnel {second} --local-port {local}")
    return m, capsys.readouterr().out


def test_local_port_held_by_own_tunnel_to_same_target_is_that_tunnel(ip, http_server, capsys):
    port, local = http_server(marker="same"), free_port()
    m, out = tunnel_twice_on_one_local_port(ip, capsys, port, port, local)
    assert [t.local_port for t in m.tunnels] == [local]
    assert f"already open at http://127.0.0.1:{local}/" in out and "taken" not in out, out


def test_local_port_held_by_own_tunnel_to_another_target_names_that_tunnel(ip, http_server, capsys):
    first, second, local = http_server(marker="a"), http_server(marker="b"), free_port()
    m, out = tunnel_twice_on_one_local_port(ip, capsys, first, second, local)
    assert (f"local port {local} is used by gpumagic's tunnel {local} -> localhost:{first} "
            f"(port {first}); using ") in out, out
    other = m.tunnels.find("localhost", second)
    assert other.local_port != local and other.moved_from == local
    assert fetch(other.url) == b"b" and fetch(f"http://127.0.0.1:{local}/") == b"a"


def test_tunnel_on_the_sandbox_to_an_unused_port_never_loops_into_itself(tmp_path):
    import gpumagic

    dead = free_port()  # nothing listens there, on the sandbox (this computer) or here
    with gpumagic.connect(sandbox=True) as m:
        t = m.tunnel(dead)
        try:
            assert t.local_port != dead and t.moved_from == dead
            assert "the tunnel would forward to itself in a loop" in t.moved_reason
            with pytest.raises(OSError):  # closed without a reply, like a proxy's 502
                fetch(t.url, timeout=10)
            assert wait_until(lambda: t.faults and t.active_connections == 0, 10)
            assert t.faults[0].message.startswith(f"the machine could not connect to localhost:{dead}")
            assert t.connections_total == 1
            # An explicit --local-port equal to the target's port is refused the same way.
            again = m.tunnel(dead, local_port=dead)
            assert again is t
            second = m.tunnel(t.local_port, local_port=dead)  # would close a two-tunnel cycle
            assert second.local_port != dead and second.local_port != t.local_port
        finally:
            t.stop(raise_errors=False)


# -- issue 12: check every argument first; record every service gpumagic starts -------------


def _service_logs(sshd) -> set:
    from pathlib import Path

    return set((Path(sshd.env["HOME"]) / ".gpumagic").glob("*.log"))


def _running_jupyters(machine) -> int:
    r = machine.run("from jupyter_server.serverapp import list_running_servers\n"
                    "print(len(list(list_running_servers())))", python=True, quiet=True)
    return int(r.stdout)


def test_bad_arguments_start_no_server_on_the_machine(ip, sshd):
    from IPython.core.error import UsageError

    ip.run_line_magic("gpu", "connect testgpu")
    m = ip._gpumagic.fleet.get()
    before = _service_logs(sshd)
    for line in ("tunnel jupyter --local-port 70000", "tunnel jupyter --out 1bad",
                 "tunnel tensorboard --local-port -1", "tunnel tensorboard --out class"):
        with pytest.raises(UsageError) as e:
            ip.run_line_magic("gpu", line)
        assert type(e.value) is UsageError, line
    for start in (lambda: m.tunnels.jupyter(local_port=70000), lambda: m.tunnels.tensorboard(local_port=-1)):
        with pytest.raises(TunnelError, match="is not a port number"):
            start()
    assert _service_logs(sshd) == before  # nothing was started
    assert list(m.tunnels) == []


def test_server_started_for_a_tunnel_that_cannot_open_is_stopped_again(machine, sshd, monkeypatch):
    from gpumagic.tunnel import TunnelManager

    assert _running_jupyters(machine) == 0
    before = _service_logs(sshd)

    def refuse(*args, **kwargs):
        raise TunnelError("no local port (test)", "none")

    monkeypatch.setattr(TunnelManager, "open", refuse)
    with pytest.raises(TunnelError, match="no local port"):
        machine.tunnels.jupyter(local_port=0)
    assert len(_service_logs(sshd) - before) == 1  # it was started...
    assert wait_until(lambda: _running_jupyters(machine) == 0, 20)  # ...and stopped again


def test_asking_for_jupyter_again_gives_the_open_tunnel_said_already_open(ip, capsys):
    # a new user: the second `%gpu tunnel jupyter` said "started Jupyter" again
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", "tunnel jupyter --local-port 0 --out t")
    t = ip.user_ns["t"]
    try:
        first = capsys.readouterr().out
        assert "started Jupyter on testgpu" in first and "already open" not in first
        ip.run_line_magic("gpu", "tunnel jupyter --local-port 0 --out t2")
        again = capsys.readouterr().out
        assert ip.user_ns["t2"] is t
        assert f"Jupyter on testgpu: a tunnel is already open at {t.url} (the same one)" in again, again
        assert "started" not in again
    finally:
        ip.run_line_magic("gpu", "tunnel close all --stop")


def test_jupyter_started_by_gpumagic_is_named_and_stopped_from_a_later_kernel(ip, sshd, capsys):
    from pathlib import Path

    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", "tunnel jupyter --local-port 0 --out t")
    pid = ip.user_ns["t"].service.pid
    out = capsys.readouterr().out
    assert f"started Jupyter on testgpu (pid {pid}, log " in out
    record = Path(sshd.env["HOME"]) / ".gpumagic" / "services" / f"{pid}.json"
    try:
        assert record.exists()
        ip.run_line_magic("gpu", "tunnel close all")  # the server is left running
        ip._gpumagic.fleet.close_all()  # as after a kernel restart: gpumagic remembers nothing
        ip.run_line_magic("gpu", "connect testgpu")
        capsys.readouterr()
        ip.run_line_magic("gpu", "tunnel jupyter --local-port 0")
        out = capsys.readouterr().out
        assert f"Jupyter already serving on testgpu (pid {pid}, started by gpumagic earlier, log " in out
        ip.run_line_magic("gpu", "tunnel close all --stop")
        out = capsys.readouterr().out
        assert f"stopped its server on the machine (pid {pid})" in out
        assert wait_until(lambda: process_gone(pid), 15)
        assert not record.exists()
    finally:
        if not process_gone(pid):
            os.kill(pid, 15)


def test_server_not_started_by_gpumagic_is_named_so_and_never_stopped(machine):
    from gpumagic.notebook.magics import _service_note
    from gpumagic.tunnel.services import RemoteService, stop_remote_service

    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)  # the machine is this computer
    try:
        theirs = RemoteService(port=1, path="/", pid=sleeper.pid, started=False, ours=False)
        assert _service_note("Jupyter", "m", theirs) == (
            f"Jupyter already serving on m (pid {sleeper.pid}, not started by gpumagic: "
            "`%gpu tunnel close ID --stop` leaves it running)")
        stop_remote_service(machine.connection, theirs)
        time.sleep(0.5)
        assert sleeper.poll() is None
        stop_remote_service(machine.connection, replace(theirs, ours=True))
        assert sleeper.wait(10) == -15
    finally:
        if sleeper.poll() is None:
            sleeper.kill()


# -- issue 15: the service programs are files; two service magics, one routine -------------


def test_tensorboard_logdir_with_quotes_spaces_and_dollar_is_the_directory_it_serves(machine):
    import json
    from pathlib import Path

    logdir = "it's a $HOME `id` dir"  # an argument of tunnel-service.py, never program text
    cwd = Path(machine.run("pwd", quiet=True).stdout.strip())  # the machine's HOME: this user's
    t = machine.tunnels.tensorboard(logdir, local_port=0)
    pid = t.service.pid
    try:
        assert (cwd / logdir).is_dir()
        assert t.service.started and t.name == f"tensorboard {logdir}"
        assert json.loads(fetch(t.url + "data/logdir"))["logdir"] == str(cwd / logdir)
    finally:
        machine.tunnels.close(t.local_port, stop_service=True)
        if (cwd / logdir).is_dir() and not any((cwd / logdir).iterdir()):
            (cwd / logdir).rmdir()  # the service made it empty: leave this user's HOME as it was
    assert wait_until(lambda: process_gone(pid), 15)


def test_tensorboard_and_jupyter_subcommands_keep_their_own_options(ip, capsys):
    from IPython.core.error import UsageError

    from gpumagic.notebook import magics

    tb, jp = magics._tunnel_tensorboard.parser, magics._tunnel_jupyter.parser
    assert tb.parse_args([]).local_port == 6006 and tb.parse_args([]).logdir == "runs"
    assert jp.parse_args([]).local_port == 8888 and not hasattr(jp.parse_args([]), "logdir")
    ip.run_line_magic("gpu", "connect testgpu")
    with pytest.raises(UsageError):
        ip.run_line_magic("gpu", "tunnel jupyter --logdir runs")
    capsys.readouterr()
    ip.run_line_magic("gpu", "tunnel jupyter -h")
    out = capsys.readouterr().out
    assert "also show Jupyter in the cell" in out and "default 8888" in out and "--logdir" not in out
    ip.run_line_magic("gpu", "tunnel tensorboard -h")
    out = capsys.readouterr().out
    assert out.index("--logdir") < out.index("--local-port") and "default 6006" in out
