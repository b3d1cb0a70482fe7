"""The machine-side programs (``gpumagic/remote/programs/``) and their shared shell library.

The library runs under the machine's ``/bin/sh`` (dash on Debian/Ubuntu): here it runs under
this computer's, which is the same kind of machine as the test sshd's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumagic.remote import program

PROGRAM_FILES = sorted(p.name for p in program.PROGRAMS.iterdir() if p.name.endswith((".sh", ".py")))


def lib_sh(script: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/sh", "-c", program.source("lib.sh") + "\n" + script],
                          capture_output=True, text=True, env=env, timeout=30, encoding="utf-8")


@pytest.mark.parametrize("name", [n for n in PROGRAM_FILES if n.endswith(".sh")])
def test_shell_programs_pass_shellcheck(name):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed: sudo apt-get install shellcheck")
    path = program.PROGRAMS / name
    r = subprocess.run(["shellcheck", "-s", "sh", "-x", str(path)], capture_output=True, text=True, encoding="utf-8")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name", [n for n in PROGRAM_FILES if n.endswith(".py")])
def test_python_programs_compile(name):
    compile(program.source(name), name, "exec")


def test_a_zombie_is_not_alive_and_its_parent_is():
    # The parent forks a child that exits at once and is never reaped: a zombie.
    parent = subprocess.Popen([sys.executable, "-c",
                               "import os, sys, time\npid = os.fork()\nif pid == 0: os._exit(0)\n"
                               "print(pid, flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True, encoding="utf-8")
    try:
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 10
        while open(f"/proc/{child}/stat", encoding="utf-8").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = lib_sh(f"gm_alive {child} && echo child-alive; gm_alive {parent.pid} && echo parent-alive")
        assert r.stdout.split() == ["parent-alive"]
    finally:
        parent.kill()
        parent.wait()
    assert lib_sh(f"gm_alive {parent.pid} || echo gone").stdout.strip() == "gone"


def test_gm_pstart_tells_a_process_by_its_start_time():
    r = lib_sh("gm_pstart $$; gm_pstart $$")
    first, second = r.stdout.split()
    assert first == second and first.isdigit()


def test_gm_find_looks_outside_a_bare_path():
    r = lib_sh("gm_find sh; gm_find no-such-tool-here || echo missing", env={"PATH": "/nonexistent"})
    found, missing = r.stdout.split()
    assert os.path.basename(found) == "sh" and os.access(found, os.X_OK)
    assert missing == "missing"


def test_shutdown_find_finds_shutdown_off_a_bare_path(tmp_path):
    # A GPU image's non-login PATH often lacks /sbin: shutdown-find.sh still finds the
    # command there (gm_find) instead of answering "nocmd".
    off_path = lib_sh("gm_find shutdown || gm_find poweroff", env={"PATH": "/nonexistent"}).stdout.strip()
    if not off_path:
        pytest.skip("this computer has no shutdown or poweroff to find")
    if os.geteuid() != 0:
        pytest.skip("as a plain user without sudo the probe answers noroot before it looks")
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("id", "cat"):
        (bare / tool).symlink_to(shutil.which(tool))
    r = subprocess.run(["/bin/sh"], input=program.command("shutdown-find.sh"), capture_output=True,
                       text=True, env={"PATH": str(bare)}, timeout=30, encoding="utf-8")
    init = open("/proc/1/comm", encoding="utf-8").read().strip()
    args = " -h now" if os.path.basename(off_path) == "shutdown" else ""
    assert r.stdout.strip() == (f"ok {off_path}{args}" if init in ("systemd", "init") else f"noinit {init}")


def test_command_quotes_arguments_for_sh_alone(tmp_path):
    weird = ["it's", "a b", "$HOME", "`id`", "back\\slash", "", "--", "\u4e2d\u6587"]
    text = program.command("lib.sh", *weird) + '\nfor a in "$@"; do printf "<%s>\\n" "$a"; done\n'
    r = subprocess.run(["/bin/sh"], input=text, capture_output=True, text=True, timeout=30, encoding="utf-8")
    assert r.stdout.splitlines() == [f"<{w}>" for w in weird]


def test_gm_alive_refuses_an_empty_or_odd_pid():
    # An empty pid file must read as "no process" (/proc/ exists, so a bare test would pass).
    r = lib_sh('gm_alive "" || echo empty; gm_alive "1x" || echo odd; gm_alive $$ && echo self')
    assert r.stdout.split() == ["empty", "odd", "self"]


def test_gm_job_running_reads_the_job_directory(tmp_path):
    # The one "is the job still running" test: a live runner whose cwd is the job directory
    # runs; an exit_code, a dead pid, or a pid that is another process's (cwd elsewhere) does not.
    d = tmp_path / "jobs" / "j"
    d.mkdir(parents=True)
    runner = subprocess.Popen(["sleep", "60"], cwd=d)
    other = subprocess.Popen(["sleep", "60"], cwd=tmp_path)
    try:
        def running(pid) -> bool:
            (d / "pid").write_text(f"{pid}\n", encoding="utf-8")
            return lib_sh(f"gm_job_running {d} && echo yes || echo no").stdout.strip() == "yes"

        assert running(runner.pid)
        assert not running(other.pid)
        (d / "exit_code").write_text("0\n", encoding="utf-8")
        assert not running(runner.pid)
        (d / "exit_code").unlink()
        runner.kill()
        runner.wait()
        assert not running(runner.pid)
    finally:
        for p in (runner, other):
            p.kill()
            p.wait()


def test_job_programs_are_files_not_python_strings():
    # Every shell text the job module runs on the machine comes from programs/ (issue 15).
    from gpumagic.remote import jobs

    assert set(jobs.JOB_FILES.values()) <= set(PROGRAM_FILES)
    src = open(jobs.__file__, encoding="utf-8").read()
    assert "#!/bin/sh" not in src and "kill -TERM" not in src and "mkfifo" not in src


def test_no_shell_program_writes_kill_with_a_dashed_signal_before_double_dash():
    # dash (Debian's /bin/sh) refuses `kill -TERM -- -PGID` ("kill: Illegal number: -"), so
    # exec-stop-cell.sh signalled nothing; `kill -s TERM -- -PGID` is POSIX and works in dash
    import re

    bad = re.compile(r"\bkill\s+-[A-Z0-9]+\s+--")
    found = [f"{name}:{i}: {line.strip()}" for name in PROGRAM_FILES if name.endswith(".sh")
             for i, line in enumerate(program.source(name).splitlines(), 1) if bad.search(line)]
    assert found == []


@pytest.mark.parametrize("name", ["tunnel-stop-service.sh", "exec-stop-cell.sh"])
def test_the_stop_programs_stop_a_whole_process_group_under_bin_sh(name, tmp_path):
    # a service (TensorBoard and its data server) or a cell run the old way: a group leader
    # and a child of it; both must go, under the machine's /bin/sh (dash here)
    leader = subprocess.Popen(["setsid", "sh", "-c", "sleep 300 & echo $! > child; wait"], cwd=tmp_path,
                              stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not (tmp_path / "child").exists() or not (tmp_path / "child").read_text(encoding="ascii").strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int((tmp_path / "child").read_text(encoding="ascii"))
    args = [leader.pid] if name == "tunnel-stop-service.sh" else [1, leader.pid, 0]
    env = {**os.environ, "HOME": str(tmp_path)}
    subprocess.run(["/bin/sh", "-c", program.command(name, *args)], env=env, timeout=30,
                   capture_output=True)  # as sent to the machine: lib.sh, set -- ARGS, the program
    leader.wait(timeout=10)
    deadline = time.monotonic() + 10
    while running(child):
        assert time.monotonic() < deadline, f"the child {child} of the group still runs"
        time.sleep(0.05)


def running(pid: int) -> bool:
    """A process ``pid`` that is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text(encoding="ascii").rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
