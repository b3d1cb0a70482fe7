"""Remote execution: streaming, decoding, exit codes, interrupt, timeout, dropped connections."""

import _thread
import os
import signal
import threading
import time
import uuid

import pytest

import gpumagic
from conftest import make_server, session_sshd_pid
from gpumagic.errors import ConnectionLost, RemoteCommandError, RemoteTimeout
from gpumagic.remote import execution
from gpumagic.remote.execution import _MarkerFilter, _Stream


def unique_tag():
    """A token to find this test's processes (other test runs may share the machine) and a
    pgrep pattern for it that does not match the pgrep command line itself."""
    token = "gm" + uuid.uuid4().hex[:12]
    return token, f"{token[:-1]}[{token[-1]}]"


def no_process(machine_or_server_check, pattern):
    """True when no process whose command line matches ``pattern`` exists on the server."""
    r = machine_or_server_check.run(["pgrep", "-f", pattern], quiet=True)
    return r.exit_code == 1 and r.stdout == ""


def test_ten_mib_on_both_streams_arrive_whole_without_deadlock(machine):
    cell = ("bash -c 'yes 0123456789abcdef | head -c 10485760 & "
            "yes EEEEEEEEEEEEEEE | head -c 10485760 >&2; wait'")
    r = machine.run(cell, quiet=True, timeout=120)
    assert r.exit_code == 0
    assert (r.stdout_bytes, r.stderr_bytes) == (10485760, 10485760)
    assert len(r.stdout) == 10485760 and len(r.stderr) == 10485760
    assert r.stdout[:17] == "0123456789abcdef\n" and set(r.stderr) == {"E", "\n"}


def test_streams_arrive_live_not_at_the_end(machine):
    seen = []
    start = time.monotonic()
    machine.run("echo first; sleep 1; echo second", stdout=lambda t: seen.append((time.monotonic() - start, t)))
    first = next(t for t, text in seen if "first" in text)
    assert first < 0.9


def test_utf8_split_across_reads_stays_whole():
    s = _Stream(None, True)
    data = "训练 loss ✓".encode()
    for i in range(len(data)):  # one byte at a time
        s.feed(data[i:i + 1])
    s.feed(b"", final=True)
    assert s.text == "训练 loss ✓"


def test_invalid_utf8_is_replaced_never_raises(machine):
    r = machine.run(r"printf 'ok \377\376 end\n'; printf 'half \xe2\x82'", quiet=True)
    assert r.stdout == "ok \ufffd\ufffd end\nhalf \ufffd"


def test_carriage_return_updates_are_passed_through(machine):
    chunks = []
    r = machine.run(r"for i in 1 2 3; do printf '\rstep %s/3' $i; sleep 0.05; done; echo",
                    stdout=chunks.append)
    assert r.stdout == "\rstep 1/3\rstep 2/3\rstep 3/3\n"


def test_marker_line_is_stripped_even_after_chatty_rc_output():
    f = _MarkerFilter("abc")
    out = f.feed(b"welcome from bashrc\n\x1egpumagic-abc 4")
    out += f.feed(b"242\nreal output\n")
    assert out == b"welcome from bashrc\nreal output\n"
    assert f.pid == 4242


def test_exit_code_and_raise_with_check(machine):
    assert machine.run("exit 7", quiet=True).exit_code == 7
    with pytest.raises(RemoteCommandError) as e:
        machine.run("echo oops >&2; exit 3", quiet=True, check=True)
    assert e.value.exit_code == 3 and e.value.stderr == "oops\n"


def test_python_cell_shows_the_remote_traceback(machine):
    r = machine.run("x = 1\nprint('before')\nx / 0", python=True, quiet=True)
    assert r.exit_code == 1 and r.stdout == "before\n"
    assert 'File "<string>", line 3' in r.stderr
    assert r.stderr.rstrip().endswith("ZeroDivisionError: division by zero")


def test_cwd_env_and_tilde(machine):
    r = machine.run('pwd; echo "$GREETING"', cwd="/tmp", env={"GREETING": "hi there"}, quiet=True)
    assert r.stdout == "/tmp\nhi there\n"
    home = machine.run("echo $HOME", quiet=True).stdout.strip()
    assert machine.run(["pwd"], cwd="~", quiet=True).stdout.strip() == home
    with pytest.raises(RemoteCommandError) as e:
        machine.run(["pwd"], cwd="/no/such/dir", quiet=True)
    assert e.value.message == "no directory /no/such/dir on testgpu" and "mkdir -p" in e.value.hint


def test_interrupt_stops_the_whole_remote_tree_within_two_seconds(machine, sshd):
    # case 2: interrupted after about 3 s -> KeyboardInterrupt; no such process remains;
    # the next cell on the same machine works.
    token, pattern = unique_tag()
    cell = f'python3 -c "import time; [time.sleep(1) for _ in range(600)]" {token} & wait'
    timer = threading.Timer(3, _thread.interrupt_main)
    timer.start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        machine.run(cell, quiet=True)
    stopped = time.monotonic()
    assert 2.5 < stopped - start < 3 + 2.0
    with gpumagic.connect("testgpu") as other:  # a separate connection
        assert no_process(other, pattern)
    assert machine.run(["echo", "still usable"], quiet=True).stdout == "still usable\n"


def test_timeout_stops_the_process_and_raises(machine):
    token, pattern = unique_tag()
    with pytest.raises(RemoteTimeout) as e:
        machine.run(f"sleep 300 & wait # {token}", timeout=1, quiet=True)
    assert "1 s" in e.value.message
    assert no_process(machine, pattern)


def test_killed_sshd_child_raises_connection_lost_and_next_cell_reconnects(sshd):
    # Without a grace: the cell is stopped with its connection (with one it is
    # re-attached over a new connection: tests/test_resilience.py).
    m = gpumagic.connect("testgpu")
    pid = session_sshd_pid(m)
    token, pattern = unique_tag()
    threading.Timer(1, os.kill, (pid, signal.SIGKILL)).start()
    with pytest.raises(ConnectionLost) as e:
        m.run(f"sleep 120 & wait # {token}", quiet=True, grace=0)
    assert "lost the connection" in e.value.message and "again" in e.value.hint
    assert m.run(["echo", "reconnected"], quiet=True).stdout == "reconnected\n"
    assert m.connection.opened_count == 2
    # sshd closed the channel's pipes, so the wrapper stopped the cell's processes
    deadline = time.monotonic() + 5
    while not no_process(m, pattern) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert no_process(m, pattern)
    m.close()


def test_cells_get_the_interactive_login_environment():
    # Debian's ~/.bashrc returns early for non-interactive shells; what comes after it
    # (conda init, exports) is what `ssh host` gives, and cells must see it too.
    server = make_server("loginenv")
    home = server.env["HOME"]
    with open(os.path.join(home, ".profile"), "w", encoding="utf-8") as f:
        f.write('[ -f ~/.bashrc ] && . ~/.bashrc\n')
    with open(os.path.join(home, ".bashrc"), "w", encoding="utf-8") as f:
        f.write('echo "chatty rc"\ncase $- in *i*) ;; *) return;; esac\n'
                'export CONDA_DEFAULT_ENV=train\nexport PATH="$HOME/miniconda/bin:$PATH"\n')
    with gpumagic.Machine(server.spec()) as m:
        r = m.run('echo "$CONDA_DEFAULT_ENV"; echo "$PATH"', quiet=True)
        env, path = r.stdout.splitlines()[-2:]
        assert env == "train"
        assert path.startswith(str(server.bin) + ":")  # the server's own PATH entries stay first
        assert f"{home}/miniconda/bin" in path.split(":")
    server.stop()


def test_exec_sends_megabytes_of_stdin_while_reading_output(machine):
    # `cat` echoes while we are still sending: without interleaving, both sides would block.
    data = bytes(range(256)) * (8 * 4096)  # 8 MiB
    r = machine.exec("cat; echo done >&2", stdin=data, timeout=120)
    assert r.exit_code == 0 and r.stdout_bytes == len(data) and r.stderr == "done\n"
    assert machine.exec("wc -c", stdin=b"").stdout.strip() == "0"


def test_cells_work_with_more_than_1024_open_file_descriptors(machine):
    # A long-running kernel can hold many descriptors; select(2) breaks past 1024.
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # what the suite already holds (earlier tests' connections), plus 1100, plus room to work
    need = len(os.listdir("/proc/self/fd")) + 1100 + 200 if os.path.isdir("/proc/self/fd") else 1400
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the hard limit of open files is {hard} (needs {need})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    held = [open(os.devnull, encoding="utf-8") for _ in range(1100)]
    try:
        machine.connection.close()  # the new connection's socket gets a descriptor above 1024
        r = machine.run("echo high", quiet=True)
        assert r.stdout == "high\n"
        assert machine.exec("echo quick").stdout == "quick\n"
    finally:
        for f in held:
            f.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# -- a NUL byte is refused before anything is sent ----------------------------------------


def test_a_nul_byte_is_refused_naming_its_line_and_a_concurrent_cell_survives(machine, ip, capsys):
    # Issue case 6: sshd dropped the whole connection (a concurrent cell died) and the
    # message's reason was empty, "()".
    token, _ = unique_tag()
    marker = f"/tmp/{token}"
    running = {}
    t = threading.Thread(target=lambda: running.update(r=machine.run("sleep 2; echo survived", quiet=True)))
    t.start()
    time.sleep(0.5)
    with pytest.raises(RemoteCommandError) as e:
        machine.run(f"touch {marker}\necho 'a\0b'\necho three", quiet=True)
    assert e.value.message == ("line 2 of the cell holds a NUL byte (\\0), which cannot be sent "
                               "to the machine")
    assert "printf '\\0'" in e.value.hint
    with pytest.raises(RemoteCommandError) as e:
        machine.run("\0", python=True, quiet=True)
    assert e.value.message.startswith("line 1 of the cell holds a NUL byte")
    with pytest.raises(RemoteCommandError) as e:
        machine.run("true", env={"SECRETISH": "a\0b"}, quiet=True)
    assert e.value.message.startswith("the environment variable SECRETISH holds a NUL byte")
    with pytest.raises(RemoteCommandError) as e:
        machine.run("true", cwd="/tmp/a\0b", quiet=True)
    assert e.value.message.startswith("the working directory holds a NUL byte")
    with pytest.raises(RemoteCommandError) as e:
        machine.start_job("nul-" + token, "echo ok\n\0")
    assert e.value.message.startswith("line 2 of the cell holds a NUL byte")
    t.join(30)
    assert running["r"].stdout == "survived\n" and running["r"].exit_code == 0
    assert machine.connection.opened_count == 1
    assert not os.path.exists(marker)  # nothing of the refused cell ran
    # In a notebook: one line with the fix, no traceback.
    ip.run_line_magic("gpu", "connect testgpu")
    result = ip.run_cell("%%remote\necho one\necho 'two\0'")
    assert isinstance(result.error_in_exec, RemoteCommandError)
    shown = "".join(capsys.readouterr())
    assert "line 2 of the cell holds a NUL byte" in shown and "Traceback" not in shown


# -- secrets never in an argv ------------------------------------------------------------------


def test_env_values_and_login_exports_are_in_no_process_command_line():
    # Issue case 11: `--env` values and profile exports were in /proc/PID/cmdline of the cell's
    # wrapper (readable by every local user) for the whole cell.  The server runs on this
    # computer, so its /proc is read here, as fast as possible, from before the cell starts
    # until after it ends, and also for a job's start.
    server = make_server("argv-secrets")
    home = server.env["HOME"]
    profile_secret = "pr0file" + uuid.uuid4().hex
    with open(os.path.join(home, ".profile"), "w", encoding="utf-8") as f:  # read by `ssh host` logins only
        f.write(f"export PROFILE_TOKEN={profile_secret}\n")
    cell_secret, job_secret = "c3ll" + uuid.uuid4().hex, "j0b" + uuid.uuid4().hex
    seen, stop = [], threading.Event()

    def scan():
        while not stop.is_set():
            for p in os.listdir("/proc"):
                if p.isdigit():
                    try:
                        with open(f"/proc/{p}/cmdline", "rb") as f:
                            line = f.read()
                    except OSError:
                        continue
                    if any(s.encode() in line for s in (profile_secret, cell_secret, job_secret)):
                        seen.append(line)

    scanner = threading.Thread(target=scan)
    scanner.start()
    try:
        with gpumagic.Machine(server.spec()) as m:
            r = m.run('echo "${#SECRET} ${#PROFILE_TOKEN}"; sleep 3', env={"SECRET": cell_secret},
                      quiet=True)
            assert r.stdout == f"{len(cell_secret)} {len(profile_secret)}\n"  # they did arrive
            job = m.start_job("argv-" + uuid.uuid4().hex[:6], 'echo "${#JSECRET}"; sleep 1',
                              env={"JSECRET": job_secret})
            assert job.wait(timeout=30).state_text == "exited 0"
            assert job.logs() == f"{len(job_secret)}\n"
    finally:
        stop.set()
        scanner.join()
        server.stop()
    assert seen == []


# -- relative working directories start at $HOME (the sandbox's home on the sandbox) ----------


def test_relative_cwd_starts_at_home_not_where_sshd_started_the_shell(machine, sshd):
    # The test server's HOME is not the account's home directory, where sshd starts shells.
    home = sshd.env["HOME"]
    os.makedirs(os.path.join(home, "rel sub"), exist_ok=True)
    assert machine.run(["pwd"], cwd="rel sub", quiet=True).stdout == f"{home}/rel sub\n"
    assert machine.run(["pwd"], cwd="~/rel sub", quiet=True).stdout == f"{home}/rel sub\n"


def test_sandbox_relative_cwd_is_inside_the_sandbox_home(ip):
    # Issue case 14: `%%remote --cwd sub` resolved against the real home.
    from gpumagic.ssh.sandbox import sandbox_home

    sub = sandbox_home() / f"sub-{uuid.uuid4().hex[:6]}"
    sub.mkdir()
    ip.run_line_magic("gpu", "connect --sandbox")
    try:
        ip.run_cell_magic("remote", f"--cwd {sub.name} --out r", "pwd")
        assert ip.user_ns["r"].stdout == f"{sub}\n"
    finally:
        ip.run_line_magic("gpu", "disconnect sandbox")


def test_the_grace_of_a_cell_comes_from_its_line_then_from_config(ip, monkeypatch):
    # %%remote --grace S, else %config GpuMagics.grace (default 600 s), reach the cell's run
    # as its parameter (the cell lives through a lost connection that long:
    # tests/test_resilience.py), and %config GpuMagics.interrupt_wait beside it
    seen = []
    real = execution.run

    def spy(*args, **kwargs):
        seen.append(kwargs["grace"])
        assert kwargs["interrupt_wait"] == execution.INTERRUPT_WAIT
        return real(*args, **kwargs)

    monkeypatch.setattr(execution, "run", spy)
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_cell_magic("remote", "--grace 3", "true")
    ip.run_cell_magic("remote", "--grace 2m", "true")
    ip.run_cell_magic("remote", "", "true")
    ip.run_line_magic("config", "GpuMagics.grace = 0")
    try:
        ip.run_cell_magic("remote", "", "true")
    finally:
        ip.run_line_magic("config", "GpuMagics.grace = 600")
    assert seen == [3.0, 120.0, 600.0, 0.0]
