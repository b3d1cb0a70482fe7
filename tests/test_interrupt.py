"""An interrupted cell is stopped as a terminal's Ctrl-C stops a program, then harder (issue
43, finding 3): SIGINT to the cell's processes first, so "save a checkpoint on Ctrl-C" code
runs and what it prints is shown; SIGTERM after the interrupt wait (at once when only what
the cell started is left); SIGKILL a second later; a second interrupt sends the next signal
at once.  "The cell's processes" includes a child that left its process group (setsid).

Against the real test sshd; the machine is this computer, so the cells' files are read here.
"""

from __future__ import annotations

import _thread
import threading
import time
import uuid
from pathlib import Path

import pytest

from gpumagic.errors import RemoteTimeout
from gpumagic.remote import execution


def unique_tag():
    token = "gm" + uuid.uuid4().hex[:12]
    return token, f"{token[:-1]}[{token[-1]}]"


def no_process(m, pattern):
    r = m.run(["pgrep", "-f", pattern], quiet=True)
    return r.exit_code == 1 and r.stdout == ""


def wait_no_process(m, pattern, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not no_process(m, pattern) and time.monotonic() < deadline:
        time.sleep(0.2)
    return no_process(m, pattern)


def interrupt_when(path: Path, text: str = "", times: int = 1) -> threading.Thread:
    """Interrupt the main thread (the stop button) once ``path`` holds ``text``; ``times``
    times, each after the file holds one more line than at the last interrupt."""

    def go():
        lines = -1
        for _ in range(times):
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    said = path.read_text(encoding="utf-8")
                except FileNotFoundError:
                    said = None
                if said is not None and text in said and len(said.splitlines()) > lines:
                    lines = len(said.splitlines())
                    break
                time.sleep(0.05)
            else:
                raise AssertionError(f"{path} never held {text!r}")
            _thread.interrupt_main()

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


#: A process that sleeps ARGV[1] seconds, named by the token that follows (`sleep` would add it).
SLEEPER = "python3 -c 'import sys, time; time.sleep(float(sys.argv[1]))'"

#: A program that logs each signal it gets to LOG (a line each), keeps running on SIGINT and
#: exits on SIGTERM.
SIGNAL_LOGGER = """\
import pathlib, signal, sys, time
log = pathlib.Path({log!r})
def on(sig, frame):
    with log.open("a") as f:
        f.write(signal.Signals(sig).name + "\\n")
    if sig == signal.SIGTERM:
        sys.exit(143)
signal.signal(signal.SIGINT, on)
signal.signal(signal.SIGTERM, on)
log.write_text("started\\n")
while True:
    time.sleep(0.05)
"""


def test_an_interrupted_python_cell_runs_its_handler_and_finally_and_shows_what_they_print(ip, capsys, tmp_path):
    ckpt, started = tmp_path / "ckpt.pt", tmp_path / "started"
    ip.run_line_magic("gpu", "connect testgpu")
    interrupt_when(started)
    result = ip.run_cell(
        "%%remote --python\n"
        "import pathlib, time\n"
        "try:\n"
        f"    pathlib.Path({str(started)!r}).write_text('yes')\n"
        "    time.sleep(600)\n"
        "except KeyboardInterrupt:\n"
        f"    pathlib.Path({str(ckpt)!r}).write_text('weights at step 7')\n"
        "    print('saved a checkpoint', flush=True)\n"
        "    raise\n"
        "finally:\n"
        "    print('finally ran', flush=True)\n")
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    assert ckpt.read_text(encoding="utf-8") == "weights at step 7"
    shown = capsys.readouterr()
    assert shown.out.count("saved a checkpoint\n") == 1 and shown.out.count("finally ran\n") == 1, shown
    assert "KeyboardInterrupt: interrupted; the cell's processes on testgpu were stopped" in shown.out
    assert shown.err.endswith("KeyboardInterrupt\n")  # the program's own traceback, as python prints it


def test_an_interrupted_bash_cell_runs_its_int_trap_and_nothing_is_left(machine, tmp_path):
    token, pattern = unique_tag()
    saved, started = tmp_path / "saved", tmp_path / "started"
    interrupt_when(started)
    out: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        machine.run(f"trap 'echo saved > {saved}; echo trapped; exit 130' INT\n"
                    f"{SLEEPER} 600 {token} &\n"
                    f"touch {started}\n"
                    "wait", stdout=out.append, quiet=True)
    assert saved.read_text(encoding="utf-8") == "saved\n"
    assert "".join(out) == "trapped\n"
    assert wait_no_process(machine, pattern)  # the background sleep (SIGINT ignored) got SIGTERM


def test_a_child_that_left_the_cells_group_is_stopped_too_without_the_interrupt_wait(machine, tmp_path):
    # `setsid sleep 204 &` survived an interrupt, which took 5 s; a double fork into a new
    # session (a daemon) too.  The cell's own process ends at SIGINT, so what is left gets
    # SIGTERM at once, not after the interrupt wait (60 s here).
    token, pattern = unique_tag()
    started = tmp_path / "started"
    interrupt_when(started)
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        machine.run(f"setsid {SLEEPER} 204 {token} &\n"
                    f"setsid sh -c \"{SLEEPER} 205 {token} &\"\n"
                    f"touch {started}\n"
                    "wait", quiet=True, interrupt_wait=60)
    assert time.monotonic() - began < 30  # far from the 60 s wait
    assert wait_no_process(machine, pattern)


def test_a_program_that_goes_on_after_sigint_gets_sigterm_after_the_wait(machine, tmp_path):
    log = tmp_path / "signals"
    interrupt_when(log, "started")
    with pytest.raises(KeyboardInterrupt):
        machine.run(SIGNAL_LOGGER.format(log=str(log)), python=True, quiet=True, interrupt_wait=1)
    assert log.read_text(encoding="utf-8") == "started\nSIGINT\nSIGTERM\n"


def test_a_second_interrupt_sends_the_next_signal_at_once(machine, tmp_path):
    log = tmp_path / "signals"
    said: list[str] = []

    def stop_button() -> None:
        wait_for = (lambda: "started" in (log.read_text(encoding="utf-8") if log.exists() else ""),
                    lambda: "still runs" in "".join(said))  # the second: once told it still runs
        for ready in wait_for:
            deadline = time.monotonic() + 120
            while not ready() and time.monotonic() < deadline:
                time.sleep(0.05)
            _thread.interrupt_main()

    threading.Thread(target=stop_button, daemon=True).start()
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        machine.run(SIGNAL_LOGGER.format(log=str(log)), python=True, stdout=said.append,
                    stderr=said.append, interrupt_wait=300)
    assert log.read_text(encoding="utf-8") == "started\nSIGINT\nSIGTERM\n"
    assert time.monotonic() - began < 120  # not the 300 s wait
    # while it waited, one line said what comes next and how to hurry it
    assert "".join(said).count("still runs; SIGTERM follows 300 s after it (interrupt again") == 1, said


def test_a_timeout_stops_with_sigint_first(machine, tmp_path):
    log = tmp_path / "signals"
    with pytest.raises(RemoteTimeout):
        machine.run(SIGNAL_LOGGER.format(log=str(log)), python=True, quiet=True, timeout=3, interrupt_wait=1)
    assert log.read_text(encoding="utf-8") == "started\nSIGINT\nSIGTERM\n"


def test_without_the_runner_an_interrupt_sends_sigint_first_too(machine, tmp_path, monkeypatch):
    # The old way (no Python 3 for the runner, or more cells at once than runners): closing
    # the channel makes the wrapper's watchdog send SIGINT, then SIGTERM, then SIGKILL.
    monkeypatch.setattr(execution, "USE_RUNNER", False)
    log = tmp_path / "signals"
    interrupt_when(log, "started")
    with pytest.raises(KeyboardInterrupt):
        machine.run(SIGNAL_LOGGER.format(log=str(log)), python=True, quiet=True, interrupt_wait=1)
    deadline = time.monotonic() + 15  # the watchdog goes on after the cell's channel closed
    while log.read_text(encoding="utf-8").count("\n") < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert log.read_text(encoding="utf-8") == "started\nSIGINT\nSIGTERM\n"
