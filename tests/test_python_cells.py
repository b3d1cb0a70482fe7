"""``--python`` cells in a Python started ahead (issue 44, "the link": a ``--python`` cell at
1.2 round trips): once a Python cell ended, the connection's runner starts the next
interpreter, which waits for the next cell's text (gpumagic/remote/programs/exec-runner.py,
"A Python started ahead").  Each cell must still behave exactly as ``python3 -u -c TEXT``: the
judge is the old path (``USE_RUNNER`` off), which execs the real ``python3 -u -c``.  Which
process ran a cell is told by its command line (a started-ahead one runs the runner's stub),
never by time."""

from __future__ import annotations

import time

import pytest

from gpumagic.remote import execution

#: Whether the cell runs in a Python started ahead (its command line is the runner's stub).
AHEAD = "print('_gm' + '_run' in open('/proc/self/cmdline').read())"

#: Cells whose output and exit status must be those of ``python3 -u -c``, started ahead or not.
CASES = {
    "names": "import sys\nprint(sys.argv, sys.orig_argv[1:], __name__, __spec__, __file__ if '__file__' in dir() else None)\n"
             "print(sorted(globals()))\nprint(__builtins__.__name__, sys.flags.unbuffered)",
    "modules": "import sys\nprint(sorted(m for m in sys.modules if m in "
               "('atexit', 'signal', 'threading', 'traceback', 'subprocess')))",
    "zero division": "x = 1\n1 / 0",
    "nested": "def f(n):\n    if n == 0:\n        raise ValueError('deep')\n    f(n - 1)\n\nf(3)\n",
    "chained": "try:\n    {}['k']\nexcept KeyError as e:\n    raise RuntimeError('wrapped') from e",
    "during handling": "try:\n    1 / 0\nexcept ZeroDivisionError:\n    undefined_name",
    "syntax": "x = (\nprint('never')",
    "indentation": "if True:\nprint(1)",
    "exit 3": "import sys\nprint('out')\nsys.exit(3)",
    "exit text": "import sys\nsys.exit('bye now')",
    "exit none": "raise SystemExit",
    "keyboard interrupt": "import atexit\natexit.register(print, 'atexit ran')\n"
                          "raise KeyboardInterrupt",
    "thread outlives": "import threading, time\n"
                       "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done'))).start()\n"
                       "raise ValueError('main ended first')",
    "warning": "import warnings\nwarnings.warn('careful')\nprint('after')",
    "stdin": "import sys\nprint(repr(sys.stdin.read()))",
    "unicode": "print('训练 ✓', 'é'.encode())\nraise ValueError('损失 NaN')",
    "excepthook": "import sys\nsys.excepthook = lambda t, v, tb: print('hook:', t.__name__, tb.tb_frame.f_code.co_filename)\n"
                  "raise OSError('via hook')",
}


#: pgrep's argv for a Python started ahead (the runner's own text holds the stub too).
STUB_PROCESS = ["pgrep", "-f", "--", "-u -c def _gm_run"]


def outcome(m, code: str) -> tuple:
    r = m.run(code, python=True, quiet=True)
    return r.exit_code, r.stdout, r.stderr


def test_python_cells_started_ahead_behave_as_python_c(machine, monkeypatch):
    monkeypatch.setattr(execution, "USE_RUNNER", False)
    judged = {name: outcome(machine, code) for name, code in CASES.items()}
    monkeypatch.setattr(execution, "USE_RUNNER", True)
    outcome(machine, "pass")  # the first Python cell of the runner: the next starts ahead
    for name, code in CASES.items():
        assert outcome(machine, AHEAD) == (0, "True\n", ""), name
        assert outcome(machine, code) == judged[name], name
    # the traceback is -c's own: no line of the runner's stub
    assert judged["nested"][2].count('File "<string>"') == 5
    assert judged["keyboard interrupt"][0] == 130 and "atexit ran" in judged["keyboard interrupt"][1]


def test_a_cell_with_another_directory_or_environment_starts_cold_and_the_next_one_ahead(machine):
    assert outcome(machine, AHEAD)[1] in ("True\n", "False\n")
    assert outcome(machine, AHEAD) == (0, "True\n", "")
    # another directory, another environment: a Python started for them, not the one ready
    r = machine.run(AHEAD + "\nimport os\nprint(os.getcwd())", python=True, cwd="/tmp", quiet=True)
    assert r.stdout == "False\n/tmp\n"
    r = machine.run(AHEAD + "\nimport os\nprint(os.getcwd())", python=True, cwd="/tmp", quiet=True)
    assert r.stdout == "True\n/tmp\n"
    code = AHEAD + "\nimport os\nprint(os.environ.get('GM_V'))"
    assert machine.run(code, python=True, env={"GM_V": "a"}, quiet=True).stdout == "False\na\n"
    assert machine.run(code, python=True, env={"GM_V": "a"}, quiet=True).stdout == "True\na\n"
    assert machine.run(code, python=True, env={"GM_V": "b"}, quiet=True).stdout == "False\nb\n"
    # a bash cell between two Python cells leaves the one ready
    assert machine.run("echo sh", quiet=True).stdout == "sh\n"
    assert machine.run(code, python=True, env={"GM_V": "b"}, quiet=True).stdout == "True\nb\n"


def test_what_a_cell_started_ahead_starts_carries_its_mark_and_an_interrupt_runs_its_finally(
        machine, tmp_path):
    from test_interrupt import interrupt_when

    outcome(machine, "pass")
    code = ("import os, subprocess\n"
            "child = subprocess.run(['sh', '-c', 'echo $GPUMAGIC_CELL'], capture_output=True, text=True)\n"
            "print(child.stdout.strip() == os.environ['GPUMAGIC_CELL'] != '')\n" + AHEAD)
    assert outcome(machine, code) == (0, "True\nTrue\n", "")
    started = tmp_path / "started"
    interrupt_when(started)
    out: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        machine.run(AHEAD + "\nimport pathlib, time\ntry:\n"
                    f"    pathlib.Path({str(started)!r}).write_text('yes')\n"
                    "    time.sleep(600)\nfinally:\n    print('finally ran')",
                    python=True, quiet=True, stdout=out.append)
    assert "".join(out) == "True\nfinally ran\n"


def test_no_python_started_ahead_outlives_its_connection(sshd):
    import gpumagic

    m = gpumagic.connect("testgpu")
    outcome(m, "pass")
    assert outcome(m, AHEAD) == (0, "True\n", "")
    watcher = gpumagic.connect("testgpu")
    try:
        assert watcher.run(STUB_PROCESS, quiet=True).exit_code == 0
        m.close()
        deadline = time.monotonic() + 10
        while watcher.run(STUB_PROCESS, quiet=True).exit_code == 0:
            assert time.monotonic() < deadline, "a Python started ahead outlived its connection"
            time.sleep(0.2)
    finally:
        watcher.close()


def test_a_python_cell_costs_one_round_trip_on_the_link(make_link):
    linked = make_link(rtt_ms=40, up_mbit=20, down_mbit=50)
    m = linked.machine
    assert m.run("print(1)", python=True, quiet=True).stdout == "1\n"
    for _ in range(3):
        before = linked.settle()
        assert m.run("print(1)", python=True, quiet=True).stdout == "1\n"
        c = linked.settle() - before
        # the request up (one frame), and "P", the output and "X" back in one turn
        assert c.round_trips == 1 and c.up_bytes < 400 and c.down_bytes < 400, c


def test_a_package_installed_after_the_python_started_ahead_is_seen_by_the_next_cell(machine, tmp_path):
    import sys

    venv = tmp_path / "venv"
    assert machine.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], quiet=True).exit_code == 0
    # (no bytecode written: the first import's __pycache__ in `extra` is a change as well)
    env = {"PATH": f"{venv}/bin:/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}
    code = AHEAD + "\nimport gm_extra_mod\nprint(gm_extra_mod.X)"
    r = machine.run(code, python=True, env=env, quiet=True)
    assert "ModuleNotFoundError: No module named 'gm_extra_mod'" in r.stderr
    # what `pip install -e` does: a .pth file in site-packages naming a folder
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "gm_extra_mod.py").write_text("X = 'installed'\n", encoding="utf-8")
    site = machine.run("import site; print(site.getsitepackages()[0])", python=True, env=env,
                       quiet=True).stdout.strip()
    # (the one ready started when the last Python cell ended, before this; the pause puts the
    # next one's start more than the runner's 20 ms margin after the change)
    assert machine.run(f"echo {extra} > {site}/gm-extra.pth && sleep 0.1", quiet=True).exit_code == 0
    # the one ready started before the .pth came: the cell starts as `python -c` would
    assert machine.run(code, python=True, env=env, quiet=True).stdout == "False\ninstalled\n"
    assert machine.run(code, python=True, env=env, quiet=True).stdout == "True\ninstalled\n"
