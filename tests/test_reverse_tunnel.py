"""Reverse tunnels (``machine.tunnels.open_reverse``, ``%gpu tunnel --reverse``) against the real
test sshd: the machine's 127.0.0.1:P reaches this computer's 127.0.0.1:L (ssh -R).

The test sshd runs on this computer, so the machine's loopback is this computer's too: the
clients "on the machine" run there through ``machine.run``, and the local services are
servers started here.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading

import pytest

from conftest import add_client_entry, make_server, session_sshd_pid, wait_until
from gpumagic.errors import TunnelError
from gpumagic.ssh.sandbox import free_port
from gpumagic.tunnel.reverse import FORBIDDEN, listening_addresses


class EchoServer:
    """A TCP server on this computer's 127.0.0.1 that sends back every byte it gets (both
    directions at once), counting connections and bytes."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.bytes = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._echo, args=(c,), daemon=True).start()

    def _echo(self, c):
        with c:
            while data := c.recv(1 << 20):
                c.sendall(data)
                self.bytes += len(data)
            c.shutdown(socket.SHUT_WR)

    def close(self):
        self.sock.close()


@pytest.fixture
def echo():
    s = EchoServer()
    yield s
    s.close()


# Run on the machine: send N bytes (a SHA-256 chain) to 127.0.0.1:PORT while reading what comes
# back; print the digests of what was sent and what came back, and the count received.
_CLIENT = r"""
import hashlib, socket, sys, threading
port, n = int(sys.argv[1]), int(sys.argv[2])
s = socket.create_connection(("127.0.0.1", port))
sent, got = hashlib.sha256(), hashlib.sha256()
def send():
    block, left = hashlib.sha256(b"seed").digest() * 8192, n
    while left:
        chunk = block[:min(left, len(block))]
        s.sendall(chunk); sent.update(chunk); left -= len(chunk)
        block = hashlib.sha256(block[:32]).digest() * 8192
    s.shutdown(socket.SHUT_WR)
t = threading.Thread(target=send); t.start()
count = 0
while data := s.recv(1 << 20):
    got.update(data); count += len(data)
t.join()
print(sent.hexdigest(), got.hexdigest(), count)
"""


def machine_client(machine, port: int, n: int) -> tuple[str, str, int]:
    r = machine.run(["python3", "-c", _CLIENT, str(port), str(n)], quiet=True, timeout=120)
    assert r.exit_code == 0, r.stderr
    sent, got, count = r.stdout.split()
    return sent, got, int(count)


def test_reverse_tunnel_carries_50_mb_both_ways_unchanged(machine, echo):
    n = 50 * 1000 * 1000
    with machine.tunnels.open_reverse(echo.port, remote_port=free_port(), name="echo") as t:
        sent, got, count = machine_client(machine, t.remote_port, n)
        assert count == n and got == sent
        assert t.bytes_up == n and t.bytes_down == n  # up: this computer -> the machine
        assert t.connections_total == 1
    assert echo.bytes == n


def test_reverse_tunnel_listens_on_the_machines_loopback_only(machine, echo):
    port = free_port()
    with machine.tunnels.open_reverse(echo.port, remote_port=port) as t:
        assert t.remote_port == port and t.listen == f"127.0.0.1:{port}"
        assert listening_addresses(machine.connection, port) == ["127.0.0.1"]
    assert listening_addresses(machine.connection, port) == []  # stopped: nothing listens


def test_second_reverse_of_the_same_machine_port_says_it_is_taken(machine, echo):
    port = free_port()
    first = machine.tunnels.open_reverse(echo.port, remote_port=port, name="first")
    try:
        with pytest.raises(TunnelError) as e:
            machine.tunnels.open_reverse(echo.port + 1 if echo.port < 65535 else 1024, remote_port=port)
        assert str(e.value).splitlines()[0] == (
            f"port {port} on the machine is taken by gpumagic's reverse tunnel R{port} "
            f"(-> this computer's 127.0.0.1:{echo.port}, first)")
        # the same tunnel asked again is the same one
        assert machine.tunnels.open_reverse(echo.port) is first
    finally:
        machine.tunnels.close_all()


def test_a_port_another_program_holds_is_taken_and_the_default_moves(machine, echo):
    holder = socket.create_server(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    try:
        with pytest.raises(TunnelError) as e:
            machine.tunnels.open_reverse(echo.port, remote_port=port)
        assert f"port {port} on the machine is taken (something listens on 127.0.0.1)" in str(e.value)
        # The default port (the local one) is this computer's own port here: it moves.
        with machine.tunnels.open_reverse(echo.port) as t:
            assert t.moved_from == echo.port and t.remote_port != echo.port
            assert "is this computer's port" in t.moved_reason
            assert machine_client(machine, t.remote_port, 1000)[2] == 1000
    finally:
        holder.close()


@pytest.fixture(scope="module")
def noforward():
    """A server whose sshd_config forbids forwarding (``AllowTcpForwarding no``; a Match
    block, since sshd keeps the first value of a keyword and the base config allows it)."""
    server = make_server("noforward", extra_config="Match all\n    AllowTcpForwarding no\n")
    add_client_entry(server, "noforward")
    yield server
    server.stop()


def test_a_server_that_forbids_forwarding_gives_the_one_line_reason(noforward, echo):
    import gpumagic

    with gpumagic.connect("noforward") as m:
        port = free_port()
        with pytest.raises(TunnelError) as e:
            m.tunnels.open_reverse(echo.port, remote_port=port)
        assert str(e.value).splitlines()[0] == (
            f"the machine refused to listen on 127.0.0.1:{port}: {FORBIDDEN}")
        assert "AllowTcpForwarding yes" in e.value.hint
        assert m.tunnels.reverse_tunnels() == []


def test_a_server_with_gateway_ports_yes_is_refused_and_left_not_listening(echo):
    import gpumagic

    server = make_server("gatewayports", extra_config="GatewayPorts yes\n")
    add_client_entry(server, "gatewayports")
    try:
        with gpumagic.connect("gatewayports") as m:
            port = free_port()
            with pytest.raises(TunnelError) as e:
                m.tunnels.open_reverse(echo.port, remote_port=port)
            first = str(e.value).splitlines()[0]
            assert re.fullmatch(rf"the machine's sshd listened on 0\.0\.0\.0:{port}(, \[::\]:{port})?, not on "
                                rf"127\.0\.0\.1 only \(sshd_config GatewayPorts yes\): this computer's port "
                                rf"would be open to the internet; closed it", first), first
            assert listening_addresses(m.connection, port) == []
    finally:
        server.stop()


def test_reverse_tunnel_listens_again_after_a_reconnect(machine, echo):
    port = free_port()
    with machine.tunnels.open_reverse(echo.port, remote_port=port) as t:
        assert machine_client(machine, port, 1000)[2] == 1000
        os.kill(session_sshd_pid(machine), signal.SIGKILL)  # the connection drops
        assert wait_until(lambda: not machine.is_connected, 10)
        sent, got, count = machine_client(machine, port, 100_000)  # the cell reconnects first
        assert count == 100_000 and got == sent
        assert t.reconnects == 1 and t.remote_port == port and t.state == "open, reconnected 1x"


def test_nothing_listening_on_this_computer_is_a_fault_raised_by_check(machine):
    local = free_port()  # nothing listens there
    t = machine.tunnels.open_reverse(local, remote_port=free_port())
    r = machine.run(["python3", "-c", "import socket, sys; s = socket.create_connection(('127.0.0.1', "
                     f"{t.remote_port})); print(repr(s.recv(10)))"], quiet=True)
    assert r.stdout.strip() == "b''"  # the machine's client sees the connection closed
    with pytest.raises(TunnelError) as e:
        t.stop()
    assert f"nothing accepts connections on this computer's 127.0.0.1:{local}" in str(e.value)
    assert "Clash" in e.value.hint


def test_gpu_tunnel_reverse_is_listed_and_closed_like_the_others(ip, echo, capsys):
    ip.run_line_magic("gpu", "connect testgpu")
    port = free_port()
    capsys.readouterr()
    ip.run_line_magic("gpu", f"tunnel --reverse {echo.port} --remote-port {port}")
    out = capsys.readouterr().out
    assert f"the machine's 127.0.0.1:{port} -> this computer's 127.0.0.1:{echo.port}" in out
    assert f"`%gpu tunnel close R{port}`" in out
    ip.run_line_magic("gpu", "tunnel list")
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"R{port} ")]
    assert len(rows) == 1 and f"127.0.0.1:{echo.port}" in rows[0] and "open" in rows[0]
    ip.run_line_magic("gpu", f"tunnel close R{port}")
    out = capsys.readouterr().out
    assert re.match(rf"closed reverse tunnel R{port} \(the machine's 127\.0\.0\.1:{port} -> this "
                    rf"computer's 127\.0\.0\.1:{echo.port}\); 0 connections", out), out
    assert listening_addresses(ip._gpumagic.fleet.get(None).connection, port) == []
