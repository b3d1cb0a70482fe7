"""A no-change resync on an open connection (issue 29, "fast on the link a student really
has"): its agent starts in the connection's cell runner, with no channel to open, no exec
request and no login shell, so it costs two round trips once the walks are done, and a slow
``~/.bashrc`` on the machine costs it nothing.  Counted on the emulated link
(tests/linkemu.py) and in the dotfile's own log, never timed."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from conftest import make_server
from gpumagic.remote import execution
from gpumagic.sync import engine as sync
from linkemu import Link, LinkedMachine


def _tree(root: Path) -> Path:
    for i in range(20):
        (root / "src" / f"d{i % 4}").mkdir(parents=True, exist_ok=True)
        (root / "src" / f"d{i % 4}" / f"f{i}.py").write_text(f"x = {i}\n" * 50, encoding="utf-8")
    return root / "src"


def test_a_no_change_resync_makes_at_most_2_round_trips_once_connected(make_link, tmp_path):
    linked = make_link(rtt_ms=40, up_mbit=20, down_mbit=50)
    m = linked.machine
    src = _tree(tmp_path)
    assert m.push(f"{src}/", "rt-a").files_sent == 20
    for _ in range(3):
        before = linked.settle()
        s = m.push(f"{src}/", "rt-a")
        c = linked.settle() - before
        # the agent's start (one message to the runner) and its fingerprint; "=" and the
        # end of its stdin, and its exit status (was 4: the channel's open, the exec
        # request, the login shell's start of the agent, the exit)
        assert s.files_sent == 0 and s.skipped == 20
        assert c.round_trips <= 2 and c.up_bytes < 1024, c
    # the runner is free again: a cell runs in it, and a changed file still goes up
    assert m.run("echo ok", quiet=True).stdout == "ok\n"
    (src / "d0" / "f0.py").write_text("changed\n", encoding="utf-8")
    before = linked.settle()
    assert m.push(f"{src}/", "rt-a").files_sent == 1
    assert (linked.settle() - before).round_trips <= 4
    assert m.run("cat rt-a/d0/f0.py", quiet=True).stdout == "changed\n"


@pytest.fixture
def slow_rc():
    """A server whose ~/.bashrc and ~/.profile (as a conda or pyenv image's, unguarded)
    take 0.3 s and log each run in ~/rc-runs."""
    server = make_server("slowrc-" + uuid.uuid4().hex[:6])
    home = Path(server.env["HOME"])
    for rc in (".bashrc", ".profile"):
        (home / rc).write_text(f'echo {rc} >> "$HOME/rc-runs"\nsleep 0.3\n', encoding="utf-8")
    link = Link(server.port, rtt_ms=40, up_mbit=20, down_mbit=50).start()
    linked = LinkedMachine(server, link)
    yield linked, home
    linked.close()
    server.stop()


def _runs(home: Path) -> int:
    f = home / "rc-runs"
    return len(f.read_text(encoding="utf-8").split()) if f.exists() else 0


def test_a_slow_bashrc_is_not_run_by_a_resync(slow_rc, tmp_path):
    linked, home = slow_rc
    m = linked.machine
    src = _tree(tmp_path)
    m.push(f"{src}/", "rt-b")
    # the runner the first sync started beside its channel greets once its start-up files
    # ran (0.6 s: the login shell's, then the functions it reads with bash)
    linked.settle(quiet=1.0)
    runs = _runs(home)
    assert runs >= 1  # the first sync's agent (and the runner's start) went through it
    for _ in range(3):
        before = linked.settle()
        assert m.push(f"{src}/", "rt-b").files_sent == 0
        assert (linked.settle() - before).round_trips <= 2
    assert _runs(home) == runs  # no resync ran a start-up file


def test_a_resync_cut_in_the_runner_leaves_no_agent_and_the_next_cell_runs(machine, tmp_path, monkeypatch):
    src = _tree(tmp_path)
    token = "rt-c-" + uuid.uuid4().hex[:8]
    machine.push(f"{src}/", token)
    started = []

    def cut(ch, same_as=None):  # Ctrl-C while the agent in the runner waits for the plan
        started.append(isinstance(ch.chan, execution.RunnerPipe))
        sync._remote_fingerprint(ch)  # it has walked, and waits
        raise KeyboardInterrupt

    monkeypatch.setattr(sync, "read_listing", cut)
    with pytest.raises(KeyboardInterrupt):
        machine.push(f"{src}/", token)
    monkeypatch.undo()
    assert started == [True]
    deadline = time.monotonic() + 8
    while True:
        left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _serves(pid, token)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert left == []
    assert machine.run("echo ok", quiet=True).stdout == "ok\n"
    assert machine.push(f"{src}/", token).files_sent == 0


def _serves(pid: str, token: str) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"serve" in argv and any(token.encode() in a for a in argv)


def test_without_the_runner_a_resync_starts_its_agent_as_before(machine, tmp_path, monkeypatch):
    monkeypatch.setattr(execution, "USE_RUNNER", False)
    src = _tree(tmp_path)
    token = "rt-d-" + uuid.uuid4().hex[:8]
    assert machine.push(f"{src}/", token).files_sent == 20
    opened = []
    real = machine.connection.open_session
    monkeypatch.setattr(machine.connection, "open_session", lambda: opened.append(1) or real())
    assert machine.push(f"{src}/", token).files_sent == 0
    assert opened == [1]


def test_megabytes_of_small_files_both_ways_through_the_runner(machine, tmp_path, monkeypatch):
    # more than the runner holds for the agent's stdin (PENDING, 1 MiB): the channel's
    # window holds the rest back; and a pull's tar comes back through it
    src = tmp_path / "src"
    token = "rt-e-" + uuid.uuid4().hex[:8]
    (src / "a").mkdir(parents=True)
    (src / "first.txt").write_text("first\n", encoding="utf-8")
    machine.push(f"{src}/", token)  # starts the runner beside its channel
    piped = []
    real = execution.start_in_runner
    monkeypatch.setattr(execution, "start_in_runner",
                        lambda *a, **kw: (piped.append(pipe := real(*a, **kw)), pipe)[1])
    for i in range(60):
        (src / "a" / f"f{i}.bin").write_bytes(os.urandom(60_000))
    s = machine.push(f"{src}/", token, compress=False)
    assert s.files_sent == 60
    back = tmp_path / "back"
    s = machine.pull(f"{token}/", str(back))
    assert s.files_sent == 61
    for p in (src / "a").iterdir():
        assert (back / "a" / p.name).read_bytes() == p.read_bytes()
    assert machine.push(f"{src}/", token).files_sent == 0
    assert len(piped) == 3 and None not in piped
