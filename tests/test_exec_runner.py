"""The per-connection cell runner (issue 20, cells): start-up files run once per connection,
not once per cell; interrupt, timeout and kill-on-drop under the runner; the fallback."""

import _thread
import os
import threading
import time
import uuid

import pytest

import gpumagic
from conftest import make_server
from gpumagic.errors import ConnectionLost, RemoteTimeout
from gpumagic.remote import execution


def unique_tag():
    token = "gm" + uuid.uuid4().hex[:12]
    return token, f"{token[:-1]}[{token[-1]}]"


def no_process(m, pattern):
    r = m.run(["pgrep", "-f", pattern], quiet=True)
    return r.exit_code == 1 and r.stdout == ""


def wait_no_process(m, pattern, seconds=8.0):
    deadline = time.monotonic() + seconds
    while not no_process(m, pattern) and time.monotonic() < deadline:
        time.sleep(0.2)
    return no_process(m, pattern)


#: The cell's parent: the runner (a Python whose -c text names the protocol) or the wrapper sh.
PARENT = 'echo "$PPID"; tr "\\0" " " < /proc/$PPID/cmdline | grep -c gpumagic-runner || true'


def parent(m):
    """(the cell's parent PID, whether that parent is the runner)."""
    pid, is_runner = m.run(PARENT, quiet=True).stdout.split()
    return int(pid), is_runner != "0"


@pytest.fixture
def counting_server():
    """A server whose ~/.bashrc (no "not interactive, return" guard, as many GPU images ship
    it) counts its runs in ~/rc-runs and exports a variable; ~/.profile exports another."""
    server = make_server("runner-" + uuid.uuid4().hex[:6])
    home = server.env["HOME"]
    with open(os.path.join(home, ".bashrc"), "w", encoding="utf-8") as f:
        f.write('echo run >> "$HOME/rc-runs"\nexport GM_FROM_BASHRC=bashrc-value\n'
                'gm_activate() { echo "activated $1"; }\n')
    with open(os.path.join(home, ".profile"), "w", encoding="utf-8") as f:
        f.write('export GM_FROM_PROFILE=profile-value\n[ -f ~/.bashrc ] && . ~/.bashrc\n')
    yield server, home
    server.stop()


def rc_runs(home):
    with open(os.path.join(home, "rc-runs"), encoding="utf-8") as f:
        return len(f.read().split())


def test_bashrc_runs_once_per_connection_not_once_per_cell(counting_server):
    server, home = counting_server
    with gpumagic.Machine(server.spec()) as m:
        r = m.run('echo "$GM_FROM_BASHRC $GM_FROM_PROFILE"', quiet=True)
        assert r.stdout == "bashrc-value profile-value\n"  # what `ssh host` gives
        after_first = rc_runs(home)
        for i in range(5):
            r = m.run(f'echo "cell {i} $GM_FROM_BASHRC $GM_FROM_PROFILE"', quiet=True)
            assert r.stdout == f"cell {i} bashrc-value profile-value\n"
        py = m.run("import os; print(os.environ['GM_FROM_BASHRC'])", python=True, quiet=True)
        assert py.stdout == "bashrc-value\n"
        assert rc_runs(home) == after_first  # no cell ran ~/.bashrc again
        assert parent(m)[1]  # the cells are children of the runner
        first_runner = parent(m)[0]
        assert parent(m)[0] == first_runner  # one runner for the connection
    with gpumagic.Machine(server.spec()) as m:  # a new connection: a new runner, once
        before = rc_runs(home)
        for _ in range(3):
            m.run(["true"], quiet=True)
        # per connection: the login-environment probe (its exec and its `bash -lic`), the
        # runner's start and its reading of the functions, whatever the number of cells
        assert rc_runs(home) - before == after_first == 4


def test_bash_cells_keep_the_functions_bashrc_defines(counting_server):
    # On the old path each cell's `bash -c` sourced ~/.bashrc, so a function it defines (as
    # conda's and pyenv's init blocks do: `conda activate`) worked in a cell; it still does,
    # without running ~/.bashrc again.
    server, home = counting_server
    with gpumagic.Machine(server.spec()) as m:
        assert m.run("gm_activate train", quiet=True).stdout == "activated train\n"
        before = rc_runs(home)
        r = m.run('gm_activate again; echo "[$BASH_ENV]"; bash -c "type gm_activate" >/dev/null 2>&1; echo $?',
                  quiet=True)
        assert r.stdout == "activated again\n[]\n1\n"  # nested scripts do not get it
        assert rc_runs(home) == before
        r = m.run("tr '\\0' '\\n' < /proc/$$/environ | sed -n 's/^BASH_ENV=//p'", quiet=True)
        functions = r.stdout.strip()
        assert os.path.basename(functions).startswith("gpumagic-functions-")
        assert os.stat(functions).st_mode & 0o077 == 0  # private to the account
    deadline = time.monotonic() + 10  # the runner's watchdog removes it when the runner ends
    while os.path.exists(functions) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(functions)


def test_interrupt_under_the_runner_stops_the_tree_and_the_runner_is_reused(machine):
    runner, is_runner = parent(machine)
    assert is_runner
    token, pattern = unique_tag()
    timer = threading.Timer(2, _thread.interrupt_main)
    timer.start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        machine.run(f'python3 -c "import time; time.sleep(600)" {token} & wait', quiet=True)
    assert time.monotonic() - start < 2 + 2.5
    assert no_process(machine, pattern)
    assert parent(machine) == (runner, True)  # the same runner serves the next cell


def test_timeout_under_the_runner_stops_a_tree_that_ignores_sigterm(machine):
    token, pattern = unique_tag()
    with pytest.raises(RemoteTimeout):
        machine.run(f"trap '' TERM; sh -c 'trap \"\" TERM; sleep 300' {token} & wait", timeout=1,
                    quiet=True)
    assert wait_no_process(machine, pattern, 4)  # SIGKILL after the grace second
    assert parent(machine)[1]


def test_killed_runner_leaves_no_orphan_and_the_next_cell_starts_a_new_one(sshd):
    m = gpumagic.connect("testgpu")
    runner, is_runner = parent(m)
    assert is_runner
    token, pattern = unique_tag()
    with gpumagic.connect("testgpu") as other:  # a second connection kills the first's runner
        threading.Timer(1.5, lambda: other.exec(f"kill -KILL {runner}")).start()
        with pytest.raises(ConnectionLost) as e:
            m.run(f"sleep 120 & sleep 121 & wait # {token}", quiet=True)
        assert "runner" in e.value.message and "again" in e.value.hint
        assert wait_no_process(other, pattern)  # the watchdog stopped the cell's group
    new_runner, is_runner = parent(m)
    assert is_runner and new_runner != runner
    assert m.connection.opened_count == 1  # the connection itself stayed up
    m.close()


def test_closing_the_connection_stops_a_running_cell_without_a_grace(sshd):
    # With a grace (the default) the cell would outlive the closed connection and be
    # re-attached (tests/test_resilience.py); with none it is stopped with the connection.
    m = gpumagic.connect("testgpu")
    token, pattern = unique_tag()
    threading.Timer(1.5, m.connection.close).start()
    with pytest.raises(ConnectionLost):
        m.run(f"sleep 120 & wait # {token}", quiet=True, grace=0)
    with gpumagic.connect("testgpu") as other:
        assert wait_no_process(other, pattern)
    m.close()


def test_a_machine_where_the_runner_cannot_start_runs_cells_the_old_way():
    # A python3 that fails (as a too-old or broken one would): the runner cannot start,
    # cells still run, each through the login shell (one exec per cell).
    server = make_server("norunner-" + uuid.uuid4().hex[:6])
    home = server.env["HOME"]
    (server.bin / "python3").write_text("#!/bin/sh\necho 'python3: broken' >&2\nexit 1\n", encoding="utf-8")
    os.chmod(server.bin / "python3", 0o755)
    with open(os.path.join(home, ".bashrc"), "w", encoding="utf-8") as f:
        f.write('echo run >> "$HOME/rc-runs"\nexport GM_FROM_BASHRC=bashrc-value\n')
    try:
        with gpumagic.Machine(server.spec()) as m:
            r = m.run('echo "$GM_FROM_BASHRC"; echo e >&2; exit 4', quiet=True)
            assert (r.stdout, r.stderr, r.exit_code) == ("bashrc-value\n", "e\n", 4)
            assert m.connection.runners[m.connection.transport].failed  # not retried
            before = rc_runs(home)
            assert m.run(["echo", "ok"], quiet=True).stdout == "ok\n"
            assert rc_runs(home) > before  # the old way: the login shell ran again
            assert not parent(m)[1]
    finally:
        server.stop()


def test_a_second_concurrent_cell_runs_beside_the_busy_runner(machine):
    got = {}
    t = threading.Thread(target=lambda: got.update(r=machine.run("sleep 2; echo slow", quiet=True)))
    t.start()
    time.sleep(0.7)
    assert machine.run(["echo", "fast"], quiet=True).stdout == "fast\n"
    t.join(30)
    assert got["r"].stdout == "slow\n"


def test_no_runner_flag_uses_the_old_path(machine, monkeypatch):
    monkeypatch.setattr(execution, "USE_RUNNER", False)
    assert not parent(machine)[1]
    monkeypatch.setattr(execution, "USE_RUNNER", True)
    assert parent(machine)[1]


def test_cell_env_unset_and_names_sh_cannot_set(machine):
    r = machine.run(["env"], env={"HOME2": "x", "A.B": "dotted", "LANG": None}, quiet=True)
    lines = r.stdout.splitlines()
    assert "HOME2=x" in lines and "A.B=dotted" in lines
    assert not any(line.startswith("LANG=") for line in lines)


def test_a_refused_cell_leaves_the_runner_free(machine):
    from gpumagic.errors import RemoteCommandError

    runner = parent(machine)
    for bad in ({"env": {"V": "a\0b"}}, {"cwd": "/tmp/a\0b"}):
        with pytest.raises(RemoteCommandError):
            machine.run("true", quiet=True, **bad)
        assert parent(machine) == runner  # still the runner, not the old way


def test_an_empty_argv_runs_nothing_and_keeps_the_runner(machine):
    runner = parent(machine)
    r = machine.run([], quiet=True)
    assert (r.exit_code, r.stdout, r.stderr) == (0, "", "")  # as the old wrapper's "$@"
    assert parent(machine) == runner


def test_the_first_cell_makes_gpumagics_folder_private():
    # the new-user trial: a first cell made ~/.gpumagic 0755 (os.makedirs gave only
    # ~/.gpumagic/cells the mode asked for); the README says gpumagic's folders are 0700
    import stat

    server = make_server("private-" + uuid.uuid4().hex[:6])
    try:
        home = server.env["HOME"]
        assert not os.path.exists(os.path.join(home, ".gpumagic"))
        with gpumagic.Machine(server.spec()) as m:
            assert m.run("echo hi", quiet=True).stdout == "hi\n"
        for folder in (".gpumagic", ".gpumagic/cells"):
            assert stat.S_IMODE(os.stat(os.path.join(home, folder)).st_mode) == 0o700, folder
    finally:
        server.stop()
