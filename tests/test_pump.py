"""The one channel pump (gpumagic/ssh/pump.py) on real exec channels of the test sshd:
both streams read together, stdin sent as the window allows and gated, the end (EOF, exit
status), deadlines, and no busy loop after the remote's EOF (counted in waits)."""

from __future__ import annotations

import time

from gpumagic.ssh.pump import ChannelPump


def _exec(machine, command: str):
    chan = machine.connection.open_session()
    chan.exec_command(command)
    return chan


def test_a_command_that_fills_stderr_before_writing_stdout_still_ends(machine):
    # 3 MiB of stderr first: more than the channel's window, so a reader of stdout alone
    # would wait for ever while the command waits for its stderr to drain.
    out, err = bytearray(), bytearray()
    chan = _exec(machine, "head -c 3145728 /dev/zero >&2; head -c 1048576 /dev/zero")
    pump = ChannelPump(chan, out.extend, err.extend)
    assert pump.run(lambda: pump.finished, deadline=time.monotonic() + 60)
    assert (len(out), len(err), chan.recv_exit_status()) == (1048576, 3145728, 0)
    chan.close()


def test_stdin_is_sent_through_the_window_in_order_and_gated(machine):
    # 4 MiB through `cat` (more than one window), the second part only once its gate opens,
    # then EOF: every byte comes back, in order.
    out = bytearray()
    first, second = bytes(range(256)) * 8192, b"second part\n"
    chan = _exec(machine, "cat")
    pump = ChannelPump(chan, out.extend)
    pump.send(first)
    pump.send(second, when=lambda: len(out) >= len(first))
    pump.send_eof(when=lambda: len(out) >= len(first))
    assert pump.run(lambda: pump.finished, deadline=time.monotonic() + 60)
    assert bytes(out) == first + second and chan.recv_exit_status() == 0
    chan.close()


def test_after_the_remote_eof_it_waits_for_the_exit_status_without_a_busy_loop(machine):
    # The command closes its output, then lives 0.6 s more: paramiko's event pipe is
    # readable for good after the EOF, so a pump that waited on it would spin.
    chan = _exec(machine, "exec >&- 2>&-; sleep 0.6; exit 3")
    pump = ChannelPump(chan)
    waits = 0
    wait = pump.wait

    def counted(timeout: float) -> None:
        nonlocal waits
        if pump.eof_received:
            waits += 1
        wait(timeout)

    pump.wait = counted  # type: ignore[method-assign]
    assert pump.run(lambda: pump.finished, deadline=time.monotonic() + 30)
    assert chan.recv_exit_status() == 3
    assert 1 <= waits <= 8  # 0.6 s in waits of 0.2 s; a busy loop makes thousands
    chan.close()


def test_a_deadline_ends_the_run_and_watch_runs_while_idle(machine):
    chan = _exec(machine, "sleep 5")
    pump = ChannelPump(chan)
    watched = 0

    def watch() -> None:
        nonlocal watched
        watched += 1

    start = time.monotonic()
    assert pump.run(lambda: pump.finished, deadline=start + 0.5, watch=watch) is False
    assert 0.5 <= time.monotonic() - start < 3
    assert 2 <= watched <= 10  # once per idle wait of 0.2 s
    chan.close()
