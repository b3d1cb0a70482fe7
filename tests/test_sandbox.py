"""The sandbox machine: a throwaway sshd that gpumagic starts, trusts, and stops."""

import json
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


# -- sessions left on a closed sandbox (issue 32, finding 11) -------------------------------


def _gone_within(pids, seconds):
    """The pids among ``pids`` still alive after waiting up to ``seconds`` for them to end."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def _group_members(pgid):
    """The live (not zombie) processes of process group ``pgid``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:
                found.append(int(entry))
    return found


def _stop_if_left(name, pids):
    if any(alive(p) for p in pids):
        with gpumagic.connect(sandbox=True) as m:
            m.kernel(name, start=False).stop()


def test_a_session_left_on_a_closed_sandbox_is_named_and_stops_after_its_idle_time(monkeypatch, capsys):
    from gpumagic.remote.kernel import Output
    from gpumagic.remote.kernel.info import list_kernels

    monkeypatch.setenv("GPUMAGIC_SANDBOX_IDLE_STOP", "3")
    m = gpumagic.connect(sandbox=True)
    pids = []
    try:
        assert m.session_idle_stop == 3
        k = m.kernel("leak", python=sys.executable)
        # a program the cell starts is in the kernel's process group: it must end too
        r = k.execute("import subprocess\np = subprocess.Popen(['sleep', '300'])\nprint(p.pid)",
                      output=Output())
        info = k.info()
        assert info is not None and info.state == "idle" and info.idle_stop == 3
        keeper, kernel, child = info.keeper_pid, info.kernel_pid, int(r.stdout)
        pids = [keeper, kernel, child]
        assert all(alive(p) for p in pids)
        capsys.readouterr()
        m.close()
        err = capsys.readouterr().err
        assert ("session leak keeps running on the sandbox; it stops after 3 s with no notebook "
                "attached and no cell running (`%gpu kernel stop leak` on a sandbox ends it now)") in err
        assert all(alive(p) for p in pids)  # the session outlives the sandbox ...
        assert _gone_within(pids, 45) == []  # ... until its idle time has passed
        assert _group_members(kernel) == []  # nothing of the kernel's group is left
        assert not (sandbox.sandbox_home() / ".gpumagic" / "kernels" / "leak").exists()
        with gpumagic.connect(sandbox=True) as m2:  # a later sandbox finds it gone (not "lost")
            assert "leak" not in [i.name for i in list_kernels(m2)]
            assert "leak" not in [name for name, _ in m2.sandbox.running_sessions()]
        assert "leak" not in capsys.readouterr().err  # and says nothing of it as it closes
    finally:
        m.close()
        _stop_if_left("leak", pids)


def test_a_sandbox_session_running_a_cell_is_not_stopped_while_the_cell_runs(monkeypatch):
    import threading

    from gpumagic.remote.kernel import Output

    monkeypatch.setenv("GPUMAGIC_SANDBOX_IDLE_STOP", "2")
    m = gpumagic.connect(sandbox=True)
    pids = []
    try:
        k = m.kernel("busyleft", python=sys.executable)
        info = k.info()
        pids = [info.keeper_pid, info.kernel_pid]

        def run():
            try:
                k.execute("import time\ntime.sleep(9)\n", output=Output())
            except Exception:  # noqa: BLE001 - the sandbox closes under it: the cell runs on
                pass

        threading.Thread(target=run, daemon=True).start()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and k.info().state != "busy":
            time.sleep(0.1)
        assert k.info().state == "busy"
        started = time.monotonic()
        m.close()  # no client from here on; the cell runs for about 9 s more
        time.sleep(max(0.0, started + 6 - time.monotonic()))  # 3 idle times: it is busy
        assert all(alive(p) for p in pids)
        state = sandbox.sandbox_home() / ".gpumagic" / "kernels" / "busyleft" / "state.json"
        assert '"busy"' in state.read_text(encoding="utf-8")
        assert _gone_within(pids, 45) == []  # the cell ended: then it stops after 2 s idle
    finally:
        m.close()
        _stop_if_left("busyleft", pids)


def test_a_rented_machines_session_gets_no_idle_time(machine, monkeypatch):
    monkeypatch.setenv("GPUMAGIC_SANDBOX_IDLE_STOP", "1")  # the sandbox's only
    assert machine.session_idle_stop is None
    k = machine.kernel("rentedidle", python=sys.executable)
    try:
        info = k.info()
        state = json.loads(machine.exec('cat "$HOME/.gpumagic/kernels/rentedidle/state.json"').stdout)
        assert info.idle_stop is None and "idle_stop" in state and state["idle_stop"] is None
        machine.close()  # no client connected
        time.sleep(4)
        assert alive(info.keeper_pid) and alive(info.kernel_pid)
        assert k.info().state == "idle"
    finally:
        k.stop()


def test_the_sandboxs_idle_time_comes_from_the_environment(monkeypatch):
    from gpumagic import machine

    for value, expected in [("", 1800.0), ("90", 90.0), ("0", None), ("off", None),
                            ("soon", 1800.0), ("inf", None)]:
        monkeypatch.setenv("GPUMAGIC_SANDBOX_IDLE_STOP", value)
        assert machine.sandbox_session_idle_stop() == expected, value
    assert machine.sessions_left_note([("a", 1800.0), ("b", None)]).splitlines() == [
        "session a keeps running on the sandbox; it stops after 30 min with no notebook attached "
        "and no cell running (`%gpu kernel stop a` on a sandbox ends it now)",
        "session b keeps running on the sandbox; it runs until stopped "
        "(`%gpu kernel stop b` on a sandbox ends it now)"]
