"""The sandbox machine: a throwaway sshd that gpumagic starts, trusts, and stops."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpumagic
from gpumagic.ssh import sandbox
from gpumagic.errors import SandboxError

ROOT = Path(__file__).resolve().parent.parent


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill -0
        return Path(f"/proc/{pid}/stat").read_text(encoding="utf-8").split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_sandbox_connects_without_touching_the_users_known_hosts(client_home):
    kh = client_home / ".ssh" / "known_hosts"
    before = kh.read_text(encoding="utf-8") if kh.exists() else None
    m = gpumagic.connect(sandbox=True)
    try:
        assert m.run(["echo", "sandboxed"], quiet=True).stdout == "sandboxed\n"
        pid = m.sandbox.server.proc.pid
        assert m.spec.known_hosts.startswith(str(m.sandbox.server.dir))
    finally:
        m.close()
    assert not alive(pid)
    assert (kh.read_text(encoding="utf-8") if kh.exists() else None) == before


def test_sandbox_with_fake_gpu_replays_the_recording():
    with gpumagic.connect(sandbox=True, fake_gpu="h200-load") as m:
        r = m.run(["nvidia-smi", "--query-gpu=name,memory.used,utilization.gpu",
                   "--format=csv,noheader,nounits"], quiet=True)
    assert r.stdout == "NVIDIA H200, 20213, 100\n"


def test_no_sshd_gives_the_install_command(monkeypatch):
    monkeypatch.setattr(sandbox, "SSHD_CANDIDATES", ())
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxError) as e:
        gpumagic.connect(sandbox=True)
    assert "no sshd" in e.value.message and "apt-get install openssh-server" in e.value.hint


def test_sandbox_stops_when_the_python_process_exits(tmp_path):
    code = ("import gpumagic, sys\n"
            "m = gpumagic.connect(sandbox=True)\n"
            "print(m.sandbox.server.proc.pid, flush=True)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=60, encoding="utf-8")
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


def test_command_line_sandbox_is_reachable_with_the_ssh_command(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "gpumagic", "sandbox"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, encoding="utf-8")
    try:
        lines = []
        while not any(line.startswith("reach it with:") for line in lines):
            lines.append(proc.stdout.readline())
            assert proc.poll() is None, lines
        ssh_cmd = proc.stdout.readline().split()
        r = subprocess.run(ssh_cmd + ["echo", "via-openssh"], capture_output=True, text=True, timeout=30, encoding="utf-8")
        assert r.stdout == "via-openssh\n", r.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(10)
    assert proc.returncode == 0


def test_sandbox_cells_run_in_its_own_home_not_the_users(client_home):
    import pwd
    real_home = pwd.getpwuid(os.getuid()).pw_dir
    with gpumagic.connect(sandbox=True) as m:
        r = m.run('echo "$HOME"; pwd; mkdir -p ~/.gpumagic && echo ok', quiet=True)
        home, cwd, ok = r.stdout.split()
    assert home == cwd == str(sandbox.sandbox_home()) and ok == "ok"
    assert home != real_home and home.startswith(str(client_home))


def test_unknown_fake_gpu_is_refused_naming_the_recordings():
    with pytest.raises(SandboxError) as e:
        gpumagic.connect(sandbox=True, fake_gpu="nosuch")
    assert "'nosuch'" in e.value.message and "h200-idle, h200-load, mismatch, no-driver" in e.value.hint


def test_a_closed_sandbox_says_so_instead_of_connection_refused():
    m = gpumagic.connect(sandbox=True)
    m.close()
    with pytest.raises(gpumagic.errors.NotConnected) as e:
        m.run(["true"], quiet=True)
    assert "sandbox machine was stopped" in e.value.message and "--sandbox" in e.value.hint


def test_sandbox_sshd_dies_with_a_killed_python_process():
    code = ("import gpumagic, time\n"
            "m = gpumagic.connect(sandbox=True)\n"
            "print(m.sandbox.server.proc.pid, flush=True)\n"
            "time.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env, encoding="utf-8")
    pid = int(proc.stdout.readline())
    proc.kill()  # SIGKILL: no atexit, no finalizer runs
    proc.wait()
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


def test_command_line_sandbox_stops_on_sigterm_and_sighup():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        proc = subprocess.Popen([sys.executable, "-m", "gpumagic", "sandbox"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env, encoding="utf-8")
        line = proc.stdout.readline()  # "sandbox sshd running at 127.0.0.1:PORT ..."
        port = int(line.split("127.0.0.1:")[1].split()[0])
        proc.send_signal(sig)
        assert proc.wait(10) == 0
        with pytest.raises(OSError):
            import socket
            socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_submodules_are_reachable_after_import_gpumagic():
    code = "import gpumagic; print(gpumagic.keys.keygen.__name__, gpumagic.sync.push.__name__)"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, encoding="utf-8")
    assert r.stdout == "keygen push\n", r.stderr


# -- issue 13: a killed kernel's sandbox directory (it holds private keys) is removed -------

_HOLD_SANDBOX = ("import gpumagic, time\n"
                 "m = gpumagic.connect(sandbox=True)\n"
                 "print(m.sandbox.server.dir, flush=True)\n"
                 "time.sleep(120)\n")


def test_next_sandbox_removes_a_killed_ones_temp_dir_and_keeps_a_live_ones(tmp_path, monkeypatch):
    import tempfile

    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", _HOLD_SANDBOX], stdout=subprocess.PIPE, text=True,
                              env=env, encoding="utf-8") for _ in range(2)]
    try:
        killed_dir, live_dir = (Path(p.stdout.readline().strip()) for p in procs)
        assert killed_dir.parent == live_dir.parent == tmp_path
        assert (killed_dir / "client_ed25519").exists()  # a private key
        procs[0].kill()  # SIGKILL: no finalizer, no atexit
        procs[0].wait()
        assert killed_dir.exists()
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        with gpumagic.connect(sandbox=True) as m:
            assert not killed_dir.exists()
            assert live_dir.exists() and (live_dir / "client_ed25519").exists()
            assert m.sandbox.server.dir.parent == tmp_path
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_stale_sandbox_selection_never_takes_another_users_or_a_live_process_dir():
    running = {(100, 5)}
    entries = [("gpumagic-sandbox-100-5-abc", 1000),   # its process runs: kept
               ("gpumagic-sandbox-100-4-abc", 1000),   # pid 100 is another process now: stale
               ("gpumagic-sandbox-200-5-xyz", 1000),   # process gone: stale
               ("gpumagic-sandbox-200-5-other", 0),    # another user's (root's): never
               ("gpumagic-sandbox-300-7-other", 1001),  # another user's: never
               ("gpumagic-sandbox-oldname", 1000),     # no pid in its name: its owner is unknown
               ("something-200-5-xyz", 1000)]
    stale = sandbox.stale_sandbox_dirs(entries, 1000, lambda pid, start: (pid, start) in running)
    assert stale == ["gpumagic-sandbox-100-4-abc", "gpumagic-sandbox-200-5-xyz"]


def test_process_running_tells_a_reused_pid_and_a_zombie_from_the_owner():
    me = os.getpid()
    assert sandbox.process_running(me, sandbox.process_start(me))
    assert not sandbox.process_running(me, sandbox.process_start(me) + 1)
    zombie = subprocess.Popen(["true"])  # exited, not reaped yet: a zombie
    while Path(f"/proc/{zombie.pid}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
    assert not sandbox.process_running(zombie.pid, 0)
    zombie.wait()
    assert not sandbox.process_running(zombie.pid, 0)
