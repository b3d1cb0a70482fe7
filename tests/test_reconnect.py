"""The one reconnect policy (gpumagic.ssh.reconnect): its schedule, counted on a fake clock,
and that cells, syncs, the session and the kernel bridge all take it.  What each of them does
on the new path is tested with a real sshd in test_resilience.py, test_sync_faults.py,
test_kernel.py and test_kernel_bridge.py."""

from __future__ import annotations

import threading
import time

import pytest

from gpumagic.errors import AuthenticationFailed, ConnectionRefused
from gpumagic.ssh import reconnect
from gpumagic.ssh.reconnect import RECONNECT, GaveUp, Reconnect, Reconnects


class _Clock:
    """``time.monotonic`` and ``time.sleep`` of the module, on a clock that only sleeps move."""

    def __init__(self):
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(round(s, 6))
        self.now += s


class _Conn:
    """A connection whose tries fail with ``fails`` in turn, then succeed."""

    def __init__(self, clock: _Clock, fails=(), heard: float | None = None):
        self.clock, self.fails, self.tries = clock, list(fails), []
        self.heard = clock.now if heard is None else heard

    def last_heard(self) -> float:
        return self.heard

    def ensure_alive(self):
        self.tries.append(self.clock.now)
        if self.fails:
            raise self.fails.pop(0)
        return self


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(reconnect.time, "monotonic", c.monotonic)
    monkeypatch.setattr(reconnect.time, "sleep", c.sleep)
    return c


def refused():
    return ConnectionRefused("the machine refused the connection", "check it runs")


def test_the_pause_doubles_from_half_a_second_to_five_and_the_grace_counts_from_the_last_packet(clock):
    conn = _Conn(clock, [refused() for _ in range(7)], heard=clock.now - 5)  # silent for 5 s already
    assert Reconnects(conn, RECONNECT.but(grace=30)).again(lambda: "new path") == "new path"
    assert clock.sleeps == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    assert len(conn.tries) == 8


def test_past_the_grace_it_gives_up_with_the_last_failure(clock):
    conn = _Conn(clock, [refused() for _ in range(100)], heard=clock.now - 5)
    seeking = Reconnects(conn, RECONNECT.but(grace=10))
    with pytest.raises(GaveUp) as e:
        seeking.again(lambda: True)
    assert e.value.out_of == "grace" and e.value.last == "the machine refused the connection"
    # tries at -5 s + 5, 5.5, 6.5, 8.5; then the 1.5 s left, and one last try at 10 s
    assert clock.sleeps == [0.5, 1.0, 2.0, 1.5] and len(conn.tries) == 5
    assert seeking.count == 0


def test_a_failure_another_try_cannot_mend_ends_the_wait_at_once(clock):
    conn = _Conn(clock, [AuthenticationFailed("the machine refused the key", "check the key")])
    with pytest.raises(AuthenticationFailed):
        Reconnects(conn, RECONNECT).again(lambda: True)
    assert len(conn.tries) == 1 and clock.sleeps == []


def test_work_that_had_its_reconnects_gets_no_more(clock):
    conn = _Conn(clock)
    seeking = Reconnects(conn, RECONNECT.but(times=2))
    seeking.again(lambda: True)
    seeking.again(lambda: True)
    with pytest.raises(GaveUp) as e:
        seeking.again(lambda: True)
    assert e.value.out_of == "times" and seeking.count == 2 and len(conn.tries) == 2


def test_a_new_path_that_cannot_take_the_work_yet_is_asked_again_shortly(clock):
    conn = _Conn(clock)
    answers = [None, None, "runner"]
    assert Reconnects(conn, RECONNECT).again(lambda: answers.pop(0)) == "runner"
    assert clock.sleeps == [0.2, 0.2]


def test_a_progress_bar_is_told_before_each_try_with_the_grace_left(clock):
    conn = _Conn(clock, [refused(), refused()])
    said: list[float] = []
    Reconnects(conn, RECONNECT.but(grace=60, say_after=0), said.append).again(lambda: True)
    assert said == [60.0, 59.5, 58.5]


def test_a_wait_longer_than_say_after_is_said_once_and_a_quick_one_not_at_all():
    slow = threading.Event()

    class Conn:
        def last_heard(self):
            return time.monotonic()

        def ensure_alive(self):
            if slow.is_set():
                time.sleep(0.6)  # a connect that takes its time
            return self

    said: list[float] = []
    seeking = Reconnects(Conn(), RECONNECT.but(say_after=0.2), said.append)
    seeking.again(lambda: True)
    assert said == [] and not seeking.said
    slow.set()
    seeking.again(lambda: True)
    assert len(said) == 1 and 590 < said[0] < 600 and seeking.said


def test_a_set_stop_ends_the_wait():
    stop = threading.Event()

    class Conn:
        tries = 0

        def last_heard(self):
            return time.monotonic()

        def ensure_alive(self):
            Conn.tries += 1
            stop.set()
            raise refused()

    with pytest.raises(GaveUp) as e:
        Reconnects(Conn(), RECONNECT.but(grace=float("inf")), None).again(lambda: True, stop=stop)
    assert e.value.out_of == "stop" and Conn.tries == 1


def test_cells_syncs_the_session_and_the_bridge_take_the_one_policy():
    from gpumagic.remote import execution
    from gpumagic.remote.kernel import client, relay
    from gpumagic.sync import engine

    assert execution.GRACE == RECONNECT.grace
    for own in (engine.RECONNECT, client.RECONNECT, relay.RECONNECT):
        assert isinstance(own, Reconnect)
        assert own.pause == RECONNECT.pause  # each changes only what it must (grace, times, saying)
    assert engine.RECONNECT == RECONNECT.but(times=5, say_after=0)
    assert client.RECONNECT == RECONNECT.but(times=3)
    # no loop of its own is left beside it
    for module, names in ((engine, ("RESUME_GRACE", "MAX_RECONNECTS", "RECONNECT_PAUSE", "_reconnect")),
                          (client, ("RECONNECTS",)), (relay, ("RETRY_WAITS",)),
                          (execution, ("REATTACH_NOTE_AFTER", "_reattach_within"))):
        assert [n for n in names if hasattr(module, n)] == [], module.__name__
