"""%gpu sync when the connection drops, and when the login shell is chatty.

The serving sshd process is SIGKILLed (the connection drops, as when a laptop's Wi-Fi goes)
in each phase of a push and a pull.  By default the sync then reconnects and resumes by
itself (issue 28; tests/test_resilience.py does it after roams); with that turned off
(``grace=0``, as when no new connection can be made) the error must say the connection was
lost and that running it again resumes, and running it again must complete.  A machine whose start-up
files print banners (stdout and stderr, split across writes, with a partial copy of the
agent's start marker) must not stall a sync.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from conftest import make_server, session_sshd_pid
from gpumagic.sync import engine as sync
from gpumagic.errors import ConnectionLost
from gpumagic.machine import Machine


def _tree(root: Path, *, small: int = 0, small_size: int = 4000, large: int = 0,
          large_size: int = 0) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(small):
        d = root / f"d{i % 5}"
        d.mkdir(exist_ok=True)
        (d / f"f{i:04d}.txt").write_bytes(os.urandom(small_size + i))
    for i in range(large):
        (root / f"big{i}.bin").write_bytes(os.urandom(large_size))
    return root


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.endswith(".gpumagic-part")}


def _parts(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*.gpumagic-part")] if root.exists() else []


class _Killer:
    """SIGKILLs the sshd serving ``machine`` once, when ``when(progress)`` first holds."""

    def __init__(self, machine, when):
        self.pid = session_sshd_pid(machine)
        self.when = when
        self.done = False

    def __call__(self, p) -> None:
        if not self.done and self.when(p):
            self.kill()

    def kill(self) -> None:
        self.done = True
        os.kill(self.pid, signal.SIGKILL)


def _assert_lost(e: pytest.ExceptionInfo) -> None:
    assert isinstance(e.value, ConnectionLost), repr(e.value)
    assert "lost the connection" in e.value.message, e.value.message
    assert "run it again: it resumes" in e.value.hint, e.value.hint


PHASES = {
    # name: (tree, when to kill).  Each tree is far larger than what can be in flight when
    # the kill comes (the channel window is 8 MiB), so the sync cannot have ended by then.
    "small-files": (dict(small=400, small_size=80_000), lambda p: p.files_done >= 100),
    "large-file": (dict(large=1, large_size=40 << 20), lambda p: p.bytes_done >= 12 << 20),
    "both": (dict(small=300, large=1, large_size=40 << 20), lambda p: p.bytes_done >= 8 << 20),
}


@pytest.mark.parametrize("phase", sorted(PHASES))
def test_push_cut_in_each_phase_says_lost_and_rerun_completes(machine, tmp_path, monkeypatch, phase):
    monkeypatch.setattr(sync, "PROGRESS_INTERVAL", 0)
    shape, when = PHASES[phase]
    src = _tree(tmp_path / "src", **shape)
    remote = tmp_path / "remote"
    killer = _Killer(machine, when)
    with pytest.raises(ConnectionLost) as e:
        machine.push(str(src) + "/", str(remote), progress=killer, grace=0)
    assert killer.done
    _assert_lost(e)
    for rel, data in _files(remote).items():  # what arrived is whole
        assert data == (src / rel).read_bytes(), rel
    again = machine.push(str(src) + "/", str(remote))
    assert _files(remote) == _files(src)
    assert _parts(remote) == []
    if shape.get("large"):
        assert again.bytes_resumed > 0


@pytest.mark.parametrize("phase", sorted(PHASES))
def test_pull_cut_in_each_phase_says_lost_and_rerun_completes(machine, tmp_path, monkeypatch, phase):
    monkeypatch.setattr(sync, "PROGRESS_INTERVAL", 0)
    shape, when = PHASES[phase]
    remote = _tree(tmp_path / "remote", **shape)
    local = tmp_path / "local"
    killer = _Killer(machine, when)
    with pytest.raises(ConnectionLost) as e:
        machine.pull(str(remote) + "/", str(local), progress=killer, grace=0)
    assert killer.done
    _assert_lost(e)
    for rel, data in _files(local).items():
        assert data == (remote / rel).read_bytes(), rel
    again = machine.pull(str(remote) + "/", str(local))
    assert _files(local) == _files(remote)
    assert _parts(local) == []
    if shape.get("large"):
        assert again.bytes_resumed > 0


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_a_cut_with_new_connections_possible_resumes_by_itself(machine, tmp_path, monkeypatch, direction):
    """The default: a drop in the transfer (small files and a large one) reconnects and
    resumes, and the summary says so."""
    monkeypatch.setattr(sync, "PROGRESS_INTERVAL", 0)
    shape, when = PHASES["both"]
    tree = _tree(tmp_path / "tree", **shape)
    other = tmp_path / "other"
    killer = _Killer(machine, when)
    go = machine.push if direction == "push" else machine.pull
    s = go(str(tree) + "/", str(other), progress=killer)
    assert killer.done
    assert s.reconnects == 1 and "resumed after 1 reconnect" in str(s), str(s)
    assert _files(other) == _files(tree)
    assert _parts(other) == []
    assert s.files_sent == len(_files(tree))


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_cut_while_listing_says_lost_and_rerun_completes(machine, tmp_path, monkeypatch, direction):
    tree = _tree(tmp_path / "tree", small=20)
    other = tmp_path / "other"
    real = sync._Channel.read_exact  # the first read of a sync is its listing's first bytes
    killer = _Killer(machine, lambda p: True)

    def cut_then_read(ch, n):
        if not killer.done:
            killer.kill()
            time.sleep(0.3)
        return real(ch, n)

    monkeypatch.setattr(sync._Channel, "read_exact", cut_then_read)
    go = machine.push if direction == "push" else machine.pull
    with pytest.raises(ConnectionLost) as e:
        go(str(tree) + "/", str(other), grace=0)
    _assert_lost(e)
    monkeypatch.setattr(sync._Channel, "read_exact", real)
    go(str(tree) + "/", str(other))
    assert _files(other) == _files(tree)


def test_cut_while_waiting_for_the_push_result_says_lost(machine, tmp_path, monkeypatch):
    src = _tree(tmp_path / "src", small=50)
    slow = sync.AGENT_SOURCE.replace(  # the agent answers 1.5 s after the stream ends
        "        written = extract(root, inp, on_file)\n",
        "        written = extract(root, inp, on_file)\n        import time; time.sleep(1.5)\n")
    assert slow != sync.AGENT_SOURCE
    monkeypatch.setattr(sync, "AGENT_SOURCE", slow)
    real_close = sync._Channel.close_stdin
    killer = _Killer(machine, lambda p: True)

    def close_then_cut(self):
        real_close(self)
        if self.op == "serve" and not killer.done:
            killer.kill()

    monkeypatch.setattr(sync._Channel, "close_stdin", close_then_cut)
    with pytest.raises(ConnectionLost) as e:
        machine.push(str(src) + "/", str(tmp_path / "remote"), grace=0)
    _assert_lost(e)
    monkeypatch.setattr(sync._Channel, "close_stdin", real_close)
    monkeypatch.undo()
    machine.push(str(src) + "/", str(tmp_path / "remote"))
    assert _files(tmp_path / "remote") == _files(src)


# -- a chatty login shell --------------------------------------------------------------------

BANNER_RC = r"""
echo "Welcome to the GPU box (stdout)"
echo "banner on stderr" >&2
printf '\036gpumagic-sy'
sleep 0.3
printf 'nc-partial marker, no newline'
printf 'split '; sleep 0.2; printf 'across writes\n'
printf '\036gpumagic-sync\n'
echo "more stderr" >&2
sleep 0.2
echo "last line"
"""


@pytest.fixture(scope="module")
def chatty():
    server = make_server("chatty")
    home = Path(server.env["HOME"])
    for rc in (".bashrc", ".profile", ".bash_profile", ".zshenv"):
        (home / rc).write_text(BANNER_RC, encoding="utf-8")
    yield server
    server.stop()


def test_chatty_start_up_files_do_not_stall_push_or_pull(chatty, tmp_path):
    src = _tree(tmp_path / "src", small=30, large=1, large_size=sync.LARGE_FILE + 4321)
    with Machine(chatty.spec()) as m:
        assert "hi" in m.run("echo hi", quiet=True).stdout  # the banners do reach cells
        result: dict = {}

        def go():
            try:
                result["push"] = m.push(str(src) + "/", str(tmp_path / "remote"))
                result["again"] = m.push(str(src) + "/", str(tmp_path / "remote"))
                result["pull"] = m.pull(str(tmp_path / "remote") + "/", str(tmp_path / "back"))
                result["one"] = m.pull(str(tmp_path / "remote" / "big0.bin"), str(tmp_path / "one.bin"))
            except BaseException as e:  # noqa: BLE001 - reported below
                result["error"] = e

        t = threading.Thread(target=go, daemon=True)
        t.start()
        t.join(120)
        assert not t.is_alive(), "sync hung behind the banners"
        assert "error" not in result, repr(result.get("error"))
    assert result["push"].files_sent == 31 and result["again"].files_sent == 0
    assert _files(tmp_path / "remote") == _files(src) == _files(tmp_path / "back")
    assert (tmp_path / "one.bin").read_bytes() == (src / "big0.bin").read_bytes()


def test_start_up_files_that_never_finish_are_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(sync, "START_TIMEOUT", 2.0)
    server = make_server("stuckrc")
    try:
        home = Path(server.env["HOME"])
        for rc in (".bashrc", ".profile", ".bash_profile"):
            (home / rc).write_text('echo "loading..."\nsleep 60\n', encoding="utf-8")
        src = _tree(tmp_path / "src", small=3)
        with Machine(server.spec()) as m:
            started = time.monotonic()
            with pytest.raises(sync.SyncError) as e:
                m.push(str(src) + "/", str(tmp_path / "remote"))
            assert time.monotonic() - started < 20
        assert "did not start within 2 s" in e.value.message and "~/.bashrc" in e.value.message
        assert "non-interactive" in e.value.hint
    finally:
        server.stop()


@pytest.mark.parametrize("direction", ["push", "pull"])
@pytest.mark.parametrize("keepalive", [0, 1])
def test_a_peer_that_stops_answering_mid_sync_is_a_lost_connection(sshd, tmp_path, monkeypatch, keepalive,
                                                                   direction):
    """SIGSTOP the serving sshd: with keepalives (ServerAliveInterval 1, CountMax 2) or
    without (ServerAliveInterval 0), the connection's probing while the sync waits (for
    data, or for the window to send into) ends the wait; with no resume (``grace=0``) the
    sync then says the connection was lost."""
    import dataclasses

    monkeypatch.setattr(sync, "PROGRESS_INTERVAL", 0)
    monkeypatch.setattr(sync, "PROBE_AFTER", 1.0)
    monkeypatch.setattr(sync, "PROBE_TIMEOUT", 2.0)
    spec = dataclasses.replace(sshd.spec(), server_alive_interval=keepalive, server_alive_count_max=2)
    remote = _tree(tmp_path / "remote", large=1, large_size=40 << 20)
    with Machine(spec) as m:
        pid = session_sshd_pid(m)
        stopped = []

        def freeze(p):
            if p.bytes_done >= 4 << 20 and not stopped:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(time.monotonic())

        try:
            with pytest.raises(ConnectionLost) as e:
                if direction == "pull":
                    m.pull(str(remote) + "/", str(tmp_path / "local"), progress=freeze, grace=0)
                else:
                    m.push(str(remote) + "/", str(tmp_path / "pushed"), progress=freeze, grace=0)
            waited = time.monotonic() - stopped[0]
        finally:
            os.kill(pid, signal.SIGCONT)
    _assert_lost(e)
    assert waited < 15, waited


def test_a_slow_listing_is_not_mistaken_for_a_helper_that_never_started(machine, tmp_path, monkeypatch):
    """The start marker leaves at once; only the login shell's start has a deadline."""
    slow = sync.AGENT_SOURCE.replace(
        "def list_tree(root, want_hash=False, names=None, prune=None, out=None, gone=None):\n",
        "def list_tree(root, want_hash=False, names=None, prune=None, out=None, gone=None):\n    import time; time.sleep(2.5)\n")
    assert slow != sync.AGENT_SOURCE
    monkeypatch.setattr(sync, "AGENT_SOURCE", slow)
    monkeypatch.setattr(sync, "START_TIMEOUT", 1.5)
    src = _tree(tmp_path / "src", small=3)
    s = machine.push(str(src) + "/", str(tmp_path / "remote"))
    assert s.files_sent == 3 and _files(tmp_path / "remote") == _files(src)


# -- Ctrl-C while the agent starts ----------------------------------------------------------


@pytest.fixture(scope="module")
def slow_start():
    server = make_server("slowstart")
    home = Path(server.env["HOME"])
    for rc in (".bashrc", ".profile", ".bash_profile", ".zshenv"):
        (home / rc).write_text("sleep 2\n", encoding="utf-8")
    yield server
    server.stop()


def _agents_for(path: Path) -> list[str]:
    import subprocess

    out = subprocess.run(["pgrep", "-af", str(path)], capture_output=True, text=True, encoding="utf-8").stdout
    return [line for line in out.splitlines() if "python3" in line]


def test_ctrl_c_while_the_agent_starts_leaves_no_agent_running(slow_start, tmp_path):
    # The channel was left open when Ctrl-C came while the login shell was still starting
    # the agent: it then ran (and waited) until the whole connection closed.
    src = _tree(tmp_path / "src", small=3)
    dst = tmp_path / "dst-ctrl-c"
    with Machine(slow_start.spec()) as m:
        t0 = time.monotonic()
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            m.push(str(src) + "/", str(dst))
        while time.monotonic() - t0 < 4.5:  # the agent would have started at ~2 s
            time.sleep(0.1)
        assert _agents_for(dst) == [], "an agent runs on after Ctrl-C (connection still open)"
