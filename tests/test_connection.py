"""Connecting: keys, errors, ProxyJump and keepalive against real sshd servers."""

import contextlib
import os
import signal
import socket
import time
from dataclasses import replace
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import gpumagic
from conftest import CLIENT_HOME, add_client_entry, make_server, session_sshd_pid
from gpumagic.errors import (AuthenticationFailed, ConnectionRefused, ConnectTimeout, HostNotFound, InsecureKeyFile, WrongPassphrase)
from gpumagic.ssh.sandbox import free_port, make_keypair


def encrypted_key(path: Path, passphrase: bytes) -> str:
    key = Ed25519PrivateKey.generate()
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                             serialization.BestAvailableEncryption(passphrase))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                         serialization.PublicFormat.OpenSSH).decode()


def test_connect_by_alias_runs_a_command(machine):
    assert machine.is_connected
    r = machine.run(["echo", "hello from", "the server"], quiet=True)
    assert (r.stdout, r.exit_code) == ("hello from the server\n", 0)


def test_close_is_safe_twice_and_reopens_lazily(machine):
    machine.close()
    machine.close()
    assert not machine.is_connected
    assert machine.run(["true"], quiet=True).exit_code == 0
    assert machine.is_connected


def test_private_key_readable_by_others_is_refused_with_chmod_fix(sshd, tmp_path):
    key = tmp_path / "id_loose"
    key.write_bytes(sshd.client_key.read_bytes())
    key.chmod(0o644)
    with pytest.raises(InsecureKeyFile) as e:
        gpumagic.connect("testgpu", key=str(key))
    assert f"chmod 600 {key}" in e.value.hint
    assert "0644" in e.value.message


def test_wrong_passphrase_names_the_key_file_not_authentication(sshd, tmp_path):
    key = tmp_path / "id_locked"
    pub = encrypted_key(key, b"correct horse")
    server = make_server("passphrase")
    server.authorized_keys.write_text(pub + "\n", encoding="utf-8")
    spec = replace(server.spec(), identity_files=(str(key),))
    prompts = []
    with pytest.raises(WrongPassphrase) as e:
        gpumagic.Machine(spec, passphrase_prompt=lambda p: prompts.append(p) or "wrong").connect()
    assert str(key) in e.value.message and "wrong passphrase" in e.value.message
    assert prompts == [str(key)]
    # the right passphrase logs in, asked once, kept only in memory for reconnects
    m = gpumagic.Machine(spec, passphrase_prompt=lambda p: prompts.append(p) or "correct horse")
    m.connect()
    m.connection.close()
    assert m.run(["echo", "ok"], quiet=True).stdout == "ok\n"
    assert prompts == [str(key), str(key)]
    m.close()
    server.stop()


def test_three_failures_give_three_different_one_line_messages(sshd, tmp_path):
    port = free_port()  # nothing listens there
    with pytest.raises(ConnectionRefused) as refused:
        gpumagic.connect(f"127.0.0.1:{port}")
    with pytest.raises(HostNotFound) as unknown:
        gpumagic.connect("no-such-alias.invalid")
    stranger = tmp_path / "id_stranger"
    make_keypair(stranger)
    with pytest.raises(AuthenticationFailed) as denied:
        gpumagic.connect(f"{sshd.user}@127.0.0.1:{sshd.port}", key=str(stranger))
    msgs = [refused.value.message, unknown.value.message, denied.value.message]
    assert len(set(msgs)) == 3
    assert all("\n" not in m for m in msgs)
    assert f"127.0.0.1:{port}" in msgs[0] and "port" in refused.value.hint
    assert "no-such-alias.invalid" in msgs[1] and "~/.ssh/config" in msgs[1]
    assert f"{sshd.user}@127.0.0.1:{sshd.port}" in msgs[2] and str(stranger) in msgs[2]
    assert "authorized_keys" in denied.value.hint


def test_a_missing_identity_file_is_named_as_ssh_names_it(sshd, tmp_path):
    # ssh: "Warning: Identity file X not accessible"; gpumagic listed only the keys it tried
    missing = tmp_path / "nonexist"
    with pytest.raises(AuthenticationFailed) as e:
        gpumagic.connect(f"{sshd.user}@127.0.0.1:{sshd.port}", key=str(missing))
    assert f"identity file {missing} not accessible (no such file)" in e.value.message


def test_connect_error_has_no_paramiko_traceback_in_ipython(ip, capsys):
    port = free_port()
    ip.run_cell(f"%gpu connect 127.0.0.1:{port}")
    err = capsys.readouterr()
    shown = err.out + err.err
    assert "ConnectionRefused: connection refused by" in shown
    assert "Traceback" not in shown and "paramiko" not in shown


def test_proxyjump_goes_through_the_bastion(sshd):
    bastion = make_server("bastion", log_level="DEBUG1")
    behind = make_server("gpu-behind-srv")
    add_client_entry(bastion, "bastion")
    add_client_entry(behind, "gpu-behind", extra="  ProxyJump bastion\n")
    with gpumagic.connect("gpu-behind") as m:
        assert m.run(["echo", "behind"], quiet=True).stdout == "behind\n"
        assert [h.spec.alias for h in m.connection._hops] == ["bastion"]
    log = bastion.log.read_text(encoding="utf-8")
    assert f"target 127.0.0.1 port {behind.port}" in log
    bastion.stop()
    behind.stop()


def test_two_hop_proxyjump_chain_in_written_order(sshd):
    a = make_server("hop-a", log_level="DEBUG1")
    b = make_server("hop-b", log_level="DEBUG1")
    target = make_server("hop-target")
    add_client_entry(a, "hop-a")
    add_client_entry(b, "hop-b")
    add_client_entry(target, "hop-target", extra="  ProxyJump hop-a,hop-b\n")
    with gpumagic.connect("hop-target") as m:
        assert m.run(["echo", "two hops"], quiet=True).stdout == "two hops\n"
    assert f"target 127.0.0.1 port {b.port}" in a.log.read_text(encoding="utf-8")
    assert f"target 127.0.0.1 port {target.port}" in b.log.read_text(encoding="utf-8")
    assert f"port {target.port}" not in a.log.read_text(encoding="utf-8")
    for s in (a, b, target):
        s.stop()


def test_a_jump_hosts_own_proxyjump_is_followed_as_ssh_does(sshd):
    """Host gpu -> ProxyJump login, Host login -> ProxyJump bastion: ssh goes bastion -> login
    -> gpu (it dialled login directly, skipping the bastion: university clusters are reached
    this way); which sshd forwarded what is read from their logs."""
    bastion = make_server("jb-bastion", log_level="DEBUG1")
    login = make_server("jb-login", log_level="DEBUG1")
    gpu = make_server("jb-gpu")
    add_client_entry(bastion, "jb-bastion")
    add_client_entry(login, "jb-login", extra="  ProxyJump jb-bastion\n")
    add_client_entry(gpu, "jb-gpu", extra="  ProxyJump jb-login\n")
    try:
        with gpumagic.connect("jb-gpu") as m:
            assert m.run(["echo", "through"], quiet=True).stdout == "through\n"
            assert [h.spec.alias for h in m.connection._hops] == ["jb-bastion", "jb-login"]
        assert f"target 127.0.0.1 port {login.port}" in bastion.log.read_text(encoding="utf-8")
        assert f"port {gpu.port}" not in bastion.log.read_text(encoding="utf-8")
        assert f"target 127.0.0.1 port {gpu.port}" in login.log.read_text(encoding="utf-8")
    finally:
        for s in (bastion, login, gpu):
            s.stop()


def test_a_proxyjump_loop_is_one_clear_error_before_any_connection(sshd):
    from gpumagic.errors import ConfigError

    add_client_entry(sshd, "loop-a", extra="  ProxyJump loop-b\n")
    ssh = CLIENT_HOME / ".ssh" / "config"
    ssh.write_text(ssh.read_text(encoding="utf-8") + "\nHost loop-b\n  HostName 127.0.0.1\n  Port 1\n"
                   "  ProxyJump loop-a\n", encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        gpumagic.connect("loop-a")
    assert e.value.message.startswith("ProxyJump loops: 127.0.0.1:") and " -> " in e.value.message
    assert "ProxyJump none" in e.value.hint


def test_command_line_jump_none_overrides_config(sshd):
    # ProxyJump none on the command line connects directly even if the config says a hop.
    add_client_entry(sshd, "testgpu-via-nowhere", extra="  ProxyJump nowhere.invalid\n")
    with gpumagic.connect("testgpu-via-nowhere", jump="none") as m:
        assert m.run(["true"], quiet=True).exit_code == 0


def test_dead_peer_is_reported_after_interval_times_count(sshd):
    spec = replace(sshd.spec(), server_alive_interval=0.5, server_alive_count_max=2)
    m = gpumagic.Machine(spec).connect()
    sshd_child = session_sshd_pid(m)
    os.kill(sshd_child, signal.SIGSTOP)  # the server stops answering, TCP stays up
    try:
        start = time.monotonic()
        while m.is_connected and time.monotonic() - start < 10:
            time.sleep(0.05)
        waited = time.monotonic() - start
        assert not m.is_connected
        assert 0.9 <= waited <= 4, waited
        assert "did not answer keepalives for 1 s" in m.connection.lost_reason
    finally:
        os.kill(sshd_child, signal.SIGCONT)
        with contextlib.suppress(ProcessLookupError):  # continued, it may see its client gone and end
            os.kill(sshd_child, signal.SIGKILL)
    # the next use reconnects by itself
    assert m.run(["echo", "back"], quiet=True).stdout == "back\n"
    m.close()


def test_tcp_nodelay_is_set(machine):
    sock = machine.connection.transport.sock
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_client_home_is_isolated():
    assert os.path.expanduser("~") == str(CLIENT_HOME)
    assert "SSH_AUTH_SOCK" not in os.environ


def test_silent_port_times_out_after_connect_timeout(sshd):
    # A port that accepts TCP but never speaks SSH (a wrong port forward, a hung sshd).
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(5)
    port = listener.getsockname()[1]
    spec = replace(sshd.spec(), port=port, connect_timeout=1)
    start = time.monotonic()
    try:
        with pytest.raises(ConnectTimeout) as e:
            gpumagic.Machine(spec).connect()
    finally:
        listener.close()
    assert 0.9 < time.monotonic() - start < 5
    assert f"127.0.0.1:{port}" in e.value.message and "within 1 s" in e.value.message
    assert "SSH port" in e.value.hint


def test_ssh_agent_keys_are_offered(sshd, agent, monkeypatch):
    agent(sshd.client_key)
    # no IdentityFile and no ~/.ssh/id_* key: only the agent can log in
    spec = replace(sshd.spec(), identity_files=(), identities_only=False)
    with gpumagic.Machine(spec) as m:
        assert m.run(["echo", "agent"], quiet=True).stdout == "agent\n"
    monkeypatch.delenv("SSH_AUTH_SOCK")
    with pytest.raises(AuthenticationFailed) as e:
        gpumagic.Machine(spec).connect()
    assert "no IdentityFile, no ~/.ssh/id_* key, no agent" in e.value.message


@pytest.fixture
def agent(tmp_path, monkeypatch):
    """A real ssh-agent on its own socket (SSH_AUTH_SOCK set for the test); yields ``add(path)``."""
    import shutil
    import subprocess
    if not shutil.which("ssh-agent"):
        pytest.skip("ssh-agent is not installed")
    sock = tmp_path / "agent.sock"
    proc = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if sock.exists():
                break
            time.sleep(0.05)
        monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
        yield lambda path: subprocess.run(["ssh-add", "-q", str(path)], check=True, capture_output=True)
    finally:
        proc.terminate()
        proc.wait(5)


def _ssh_judge(sshd, identities_only: bool):
    """What the real ssh makes of the same login: IdentityFile the sandbox's key, the agent."""
    import subprocess
    argv = sshd.ssh_command("echo", "in")
    argv[argv.index("IdentitiesOnly=yes")] = f"IdentitiesOnly={'yes' if identities_only else 'no'}"
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, encoding="utf-8")


def test_an_agent_full_of_keys_offers_the_configured_key_first_as_ssh_does(sshd, tmp_path, agent):
    """9 keys in the agent, the configured IdentityFile the last of them, sshd's MaxAuthTries
    6: ssh logs in (it offers the agent's copy of the configured key first), and so does
    gpumagic (it offered the agent's keys in the agent's order: 'No existing session')."""
    for i in range(8):
        make_keypair(tmp_path / f"other{i}", f"other{i}")
        agent(tmp_path / f"other{i}")
    agent(sshd.client_key)
    spec = replace(sshd.spec(), identities_only=False)
    assert _ssh_judge(sshd, identities_only=False).stdout == "in\n"
    with gpumagic.Machine(spec) as m:
        assert m.run(["echo", "agent"], quiet=True).stdout == "agent\n"


def test_public_blob_reads_a_keys_pub_or_the_clear_part_of_an_openssh_file(tmp_path):
    """As OpenSSH matches an agent's key with an IdentityFile without its passphrase."""
    import base64

    from gpumagic.ssh.connection import public_blob

    key = Ed25519PrivateKey.generate()
    want = base64.b64decode(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                          serialization.PublicFormat.OpenSSH).split()[1])
    locked = tmp_path / "locked"  # encrypted, no .pub: the public part is in the clear
    locked.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                         serialization.BestAvailableEncryption(b"secret")))
    assert public_blob(str(locked)) == want
    (tmp_path / "locked.pub").write_text("ssh-ed25519 " + base64.b64encode(b"other").decode() + " c\n")
    assert public_blob(str(locked)) == b"other"  # the .pub first, as ssh reads it
    assert public_blob(str(tmp_path / "none")) is None


def test_too_many_agent_keys_before_the_right_one_is_named_as_maxauthtries(sshd, tmp_path, agent):
    """The configured key not in the agent and 9 other keys there: ssh fails ('Too many
    authentication failures'), and gpumagic names why and what to do; IdentitiesOnly logs in."""
    for i in range(9):
        make_keypair(tmp_path / f"other{i}", f"other{i}")
        agent(tmp_path / f"other{i}")
    judge = _ssh_judge(sshd, identities_only=False)
    assert judge.returncode != 0 and "Too many authentication failures" in judge.stderr, judge.stderr
    with pytest.raises(AuthenticationFailed) as e:
        gpumagic.Machine(replace(sshd.spec(), identities_only=False)).connect()
    assert "ended the login after 6 keys were refused: too many keys offered (MaxAuthTries)" in e.value.message
    assert "IdentitiesOnly yes" in e.value.hint
    assert _ssh_judge(sshd, identities_only=True).stdout == "in\n"
    with gpumagic.Machine(sshd.spec()) as m:  # IdentitiesOnly yes: the agent's other keys are not offered
        assert m.run(["echo", "only"], quiet=True).stdout == "only\n"


def test_a_port_that_is_not_ssh_says_so_at_once_without_paramiko_noise(sshd):
    # A web server on the port: it answers paramiko's greeting with an HTTP error and closes.
    import http.server
    import subprocess
    import sys
    import threading
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    start = time.monotonic()
    try:
        with pytest.raises(ConnectionRefused) as e:
            gpumagic.connect(f"127.0.0.1:{port}")
        assert time.monotonic() - start < 5
        # in a plain process (no pytest log capture) nothing but our own message is printed
        code = ("import gpumagic\ntry:\n    gpumagic.connect('127.0.0.1:%d')\n"
                "except gpumagic.GpumagicError as e:\n    print(e.message)\n" % port)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, encoding="utf-8")
    finally:
        server.shutdown()
    want = f"127.0.0.1:{port} is not an SSH server: it closed the connection without an SSH greeting"
    assert e.value.message == want and "SSH port" in e.value.hint
    assert (r.stdout, r.stderr) == (want + "\n", "")


def test_connection_negotiates_aes_gcm_for_fast_bulk_transfer(machine):
    # AES-GCM is one OpenSSL call per packet (CTR + HMAC is two): sync and tunnels depend on it.
    assert machine.connection.transport.remote_cipher in ("aes128-gcm@openssh.com",
                                                          "aes256-gcm@openssh.com")
