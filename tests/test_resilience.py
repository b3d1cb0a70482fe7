"""A path that dies without a word (issue 28): roams, blinks and holds of the emulated link
(tests/linkemu.py) in front of the test sshd, with gpumagic's noticing
(gpumagic/ssh/connection.py: _Path, ensure_alive, in_flight) and the stop of a cut cell
over a new connection (remote/programs/exec-stop-cell.sh).

Outcomes are counted (lines, errors, connections, processes left on the machine); only the
noticing bounds are timed.  The machine is this computer, so what a cell left running is
looked for with the local ``pgrep``.  Each machine's ServerAliveInterval is 300 s, so
everything noticed here is noticed by the probing, not by OpenSSH's keepalive schedule.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from gpumagic.errors import ConnectionLost
from gpumagic.remote import execution
from gpumagic.remote.kernel import Output

from conftest import wait_until

#: The issue's bound for noticing a dead path while a cell runs (seconds).
RUNNING_BOUND = 10.0
#: max(3 s, 10 RTT) on these links, plus one connect and the cell (generous for a loaded CI).
IDLE_BOUND = 3.0 + 3.0


def unique_tag() -> tuple[str, str]:
    """A token for this test's processes and a pgrep pattern that does not match pgrep."""
    token = "gm" + uuid.uuid4().hex[:12]
    return token, f"{token[:-1]}[{token[-1]}]"


def running_here(pattern: str) -> list[str]:
    """PIDs of the processes whose command line matches ``pattern`` (the machine is local)."""
    r = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True, encoding="utf-8")
    return r.stdout.split()


class Lines:
    """A stdout sink that keeps every chunk and the time each complete line arrived."""

    def __init__(self):
        self.text = ""
        self.lock = threading.Lock()

    def __call__(self, chunk: str) -> None:
        with self.lock:
            self.text += chunk

    def lines(self) -> list[str]:
        return self.text.splitlines()


def test_after_an_idle_roam_the_next_cell_runs_on_a_new_connection_with_no_error(make_link):
    linked = make_link(rtt_ms=40)
    m = linked.machine
    assert m.run("echo first", quiet=True).stdout == "first\n"
    old_runner = execution._runners[m.connection.transport].pid
    assert old_runner and Path(f"/proc/{old_runner}").exists()
    time.sleep(2.5)  # quiet for longer than FRESH: the next cell asks the path first
    assert linked.roam() == 1
    start = time.monotonic()
    r = m.run("echo back", quiet=True)
    took = time.monotonic() - start
    assert (r.stdout, r.exit_code) == ("back\n", 0)
    assert m.connection.opened_count == 2
    assert linked.counters().connections >= 2
    assert took < IDLE_BOUND, took
    # and the one after runs on it at once
    assert m.run("echo again", quiet=True).stdout == "again\n"
    assert m.connection.opened_count == 2
    # the old path's runner, which the machine's sshd would have kept, was ended there
    assert wait_until(lambda: not _alive(old_runner), 15)


def _alive(pid: int) -> bool:
    """A live (not zombie) process ``pid`` on the machine (this computer)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def test_a_fresh_path_is_not_probed_and_a_quiet_healthy_one_is_kept(make_link):
    linked = make_link(rtt_ms=40)
    m = linked.machine
    m.run("true", quiet=True)
    path = m.connection._path
    m.run("true", quiet=True)  # right after: no probe
    assert path.rtt is None
    time.sleep(2.5)
    assert m.run("echo kept", quiet=True).stdout == "kept\n"
    assert path.rtt is not None and path.rtt < 1.0  # one probe, answered
    assert m.connection.opened_count == 1 and linked.counters().connections == 1


def test_a_roam_during_a_printing_cell_fails_fast_and_leaves_nothing_running(make_link):
    linked = make_link(rtt_ms=40)
    m = linked.machine
    token, pattern = unique_tag()
    out = Lines()
    roamed: list[float] = []

    def roam_after_line_3() -> None:
        wait_until(lambda: "line 3\n" in out.text, 20)
        linked.roam()
        roamed.append(time.monotonic())

    threading.Thread(target=roam_after_line_3, daemon=True).start()
    with pytest.raises(ConnectionLost) as e:
        m.run(f"for i in $(seq 1 100); do echo line $i; sleep 0.3; done # {token}", stdout=out)
    noticed = time.monotonic() - roamed[0]
    assert noticed < RUNNING_BOUND, noticed
    msg = e.value.message
    assert "lost the connection" in msg and "while the cell ran" in msg
    assert "did not answer" in msg
    assert "stopped on the machine over a new connection" in msg, msg
    assert running_here(pattern) == []
    lines = out.lines()
    assert lines == [f"line {i}" for i in range(1, len(lines) + 1)]  # in order, none twice
    # the next cell runs on the connection the stop opened
    assert m.run("echo next", quiet=True).stdout == "next\n"


def test_a_blink_of_5_s_during_a_cell_loses_and_repeats_no_line(make_link):
    linked = make_link(rtt_ms=40)
    m = linked.machine
    out = Lines()

    def blink_after_line_3() -> None:
        wait_until(lambda: "line 3\n" in out.text, 20)
        linked.blink(5)

    threading.Thread(target=blink_after_line_3, daemon=True).start()
    r = m.run("for i in $(seq 1 30); do echo line $i; sleep 0.3; done; exit 3", stdout=out)
    assert r.exit_code == 3
    assert out.lines() == [f"line {i}" for i in range(1, 31)]
    assert r.stdout == out.text
    assert m.connection.opened_count == 1


def test_a_frozen_path_is_not_mistaken_for_a_finished_cell(make_link):
    linked = make_link(rtt_ms=40)
    m = linked.machine
    token, pattern = unique_tag()
    out = Lines()

    def hold_after_line_2() -> None:
        wait_until(lambda: "line 2\n" in out.text, 20)
        linked.hold()

    threading.Thread(target=hold_after_line_2, daemon=True).start()
    try:
        with pytest.raises(ConnectionLost) as e:
            m.run(f"for i in $(seq 1 100); do echo line $i; sleep 0.3; done # {token}", stdout=out)
        assert "while the cell ran" in e.value.message
        lines = out.lines()
        assert len(lines) < 100 and lines == [f"line {i}" for i in range(1, len(lines) + 1)]
    finally:
        linked.release()
    # once the link moves again the machine hears the old connection close, or the stop
    # that waited runs: nothing is left
    assert wait_until(lambda: running_here(pattern) == [], 15)
    assert m.run("echo after", quiet=True).stdout == "after\n"


def test_sleep_of_the_laptop_process_is_not_the_machines_silence(make_link):
    """SIGSTOP of a child running gpumagic for longer than the dead-path bound while a cell
    runs, with a probe unanswered when it stopped, then SIGCONT: the cell ends with all its
    lines and its exit code, on the same connection."""
    linked = make_link(rtt_ms=40)
    script = (
        "import sys, gpumagic, json, pickle\n"
        f"spec = pickle.loads(bytes.fromhex({pickle.dumps(linked.spec).hex()!r}))\n"
        "m = gpumagic.Machine(spec).connect()\n"
        "print('ready', flush=True)\n"
        "r = m.run('for i in $(seq 1 40); do echo line $i; sleep 0.3; done; exit 5', quiet=True)\n"
        "print(json.dumps([r.exit_code, r.stdout.splitlines(), m.connection.opened_count]), flush=True)\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             encoding="utf-8", env={**os.environ})
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(1.5)
        linked.hold()  # the laptop falls asleep: its network holds everything...
        time.sleep(2.0)  # (long enough for a probe to go out unanswered)
        child.send_signal(signal.SIGSTOP)  # ...and its process stops
        time.sleep(12)
        linked.release()
        child.send_signal(signal.SIGCONT)
        code, lines, opened = json.loads(child.stdout.readline())
        assert child.wait(60) == 0
    finally:
        if child.poll() is None:
            child.kill()
    assert code == 5
    assert lines == [f"line {i}" for i in range(1, 41)]
    assert opened == 1


def test_a_session_request_after_a_roam_reconnects_and_keeps_the_variables(make_link):
    linked = make_link(rtt_ms=40)
    m = linked.machine
    name = "roam" + uuid.uuid4().hex[:6]
    k = m.kernel(name, python=sys.executable)
    try:
        assert k.execute("x = 41", output=_Quiet()).ok
        time.sleep(2.5)
        assert linked.roam() >= 1
        start = time.monotonic()
        out = _Quiet()
        k.execute("print(x + 1)", output=out)
        took = time.monotonic() - start
        assert out.text == "42\n"
        assert took < IDLE_BOUND + 2, took
        assert m.connection.opened_count == 2
    finally:
        try:
            k.stop()
        except Exception:
            pass
        _stop_keepers(linked.server, name)


class _Quiet(Output):
    """A session's output, stdout kept."""

    def __init__(self):
        self.text = ""

    def stream(self, name, text):
        if name == "stdout":
            self.text += text

    def display(self, data, metadata, display_id=None, update=False):
        pass

    def note(self, text):
        pass


def _stop_keepers(server, name: str) -> None:
    state = Path(server.env["HOME"]) / ".gpumagic" / "kernels" / name / "state.json"
    try:
        os.kill(json.loads(state.read_text(encoding="utf-8"))["keeper_pid"], signal.SIGTERM)
    except (OSError, ValueError, KeyError):
        pass


def test_a_session_cell_lives_through_a_roam_with_every_line_once(make_link):
    linked = make_link(rtt_ms=40)
    m = linked.machine
    name = "roamcell" + uuid.uuid4().hex[:6]
    k = m.kernel(name, python=sys.executable)
    try:
        out = _Quiet()
        roamed: list[float] = []

        def roam_after_line_3() -> None:
            wait_until(lambda: "line 3\n" in out.text, 30)
            linked.roam()
            roamed.append(time.monotonic())

        threading.Thread(target=roam_after_line_3, daemon=True).start()
        r = k.execute("import time\nfor i in range(40):\n    print(f'line {i}', flush=True)\n"
                      "    time.sleep(0.3)\ndone = 'yes'", output=out)
        assert r.ok and roamed
        assert out.text.splitlines() == [f"line {i}" for i in range(40)]
        assert m.connection.opened_count == 2
        assert k.pull(["done"]) == {"done": "yes"}
    finally:
        try:
            k.stop()
        except Exception:
            pass
        _stop_keepers(linked.server, name)
