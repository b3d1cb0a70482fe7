"""Detached jobs (issue 5): survive disconnects, tmux lookup and nohup fallback, --stop-on,
kill of the whole tree, --then-shutdown with a recording stand-in, and tutorial 04.

The servers are real sshd processes on this machine, so the tests look at the job's
processes with the local ``ps``.  tmux sessions share this machine's tmux server, so every
job name carries a per-run token.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from IPython.utils.capture import capture_output

from conftest import add_client_entry, install_shutdown, make_server
from gpumagic.remote import jobs, program
from gpumagic.notebook.display import job_alert, jobs_table
from gpumagic.errors import ConnectionLost, JobError, RemoteTimeout
from gpumagic.remote.jobs import Alert, classify, parse_listing, parse_stop_on, scan_alerts
from gpumagic.machine import Machine
from gpumagic.budget.shutdown import find_shutdown

TOKEN = secrets.token_hex(3)
REPO = Path(__file__).resolve().parent.parent
TMUX = shutil.which("tmux")
needs_tmux = pytest.mark.skipif(TMUX is None, reason="tmux is not installed on this computer")


def jname(what: str) -> str:
    return f"{what}-{TOKEN}"


def shown(cap) -> str:
    """Everything a captured cell showed: stdout plus the text of displayed objects, each on
    lines of its own as a notebook shows them (joined with nothing, an alert another test's
    job raised ran on from the table's last row: '... line 20!! ALERT job oomstop-...')."""
    return cap.stdout + "".join(o.data.get("text/plain", "") + "\n" for o in cap.outputs)


def processes(pattern: str) -> list[str]:
    """Command lines of processes on this machine matching ``pattern`` (regex)."""
    out = subprocess.run(["ps", "-e", "-o", "stat=,pid=,sid=,args="], capture_output=True, text=True, encoding="utf-8").stdout
    return [ln.strip() for ln in out.splitlines()
            if re.search(pattern, ln) and "ps -e" not in ln and not ln.lstrip().startswith("Z")]


def session_members(sid: int) -> list[str]:
    """Live (not zombie) processes in session or process group ``sid``."""
    out = subprocess.run(["ps", "-e", "-o", "stat=,pid=,sid=,pgid=,args="], capture_output=True, text=True, encoding="utf-8").stdout
    return [ln for ln in out.splitlines()
            if not ln.startswith("Z") and str(sid) in (ln.split()[2], ln.split()[3])]


def wait_for(predicate, timeout: float, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def link_bin(directory: Path, leave_out: set[str]) -> Path:
    """A PATH directory with every program of /usr/bin except ``leave_out``."""
    directory.mkdir(parents=True, exist_ok=True)
    for entry in os.scandir("/usr/bin"):
        if entry.name not in leave_out and not (directory / entry.name).exists():
            os.symlink(entry.path, directory / entry.name)
    return directory


def kill_all_jobs(home: Path) -> None:
    """Teardown: no job or shutdown timer of these tests stays on the machine."""
    base = home / ".gpumagic" / "jobs"
    if not base.is_dir():
        return
    for d in base.iterdir():
        env = {**os.environ, "HOME": str(home)}
        subprocess.run(["/bin/sh", "-c", program.command("job-cancel-shutdown.sh", d.name)], env=env,
                       capture_output=True)
        if (d / "kill.sh").exists():
            subprocess.run(["/bin/sh", "./kill.sh", "cleanup"], cwd=d, env=env, capture_output=True)


# -- pure parsers, on text recorded from the listing script -----------------------------------

RECORDED_LISTING = """now\t1795995730
job\tcrash
started\t1795995729
ended\t1795995729
exit_code\t1
runner\ttmux
last\tValueError: 1
alert\tTraceback (most recent call last):
job\tdiverged
started\t1795995729
ended\t1795995729
exit_code\t143
killed\tnan
runner\ttmux
stop_on\tnan,oom
stopped_by\tstep 20 loss nan
last\tstep 20 loss nan
alert\tstep 20 loss nan
job\tok
started\t1795995729
ended\t1795995729
exit_code\t0
runner\ttmux
shutdown\t1795995789
shutdown_command\t/tmp/jobsdev-eczqx8k_/bin/shutdown -h now
alive\t1
last\tprogress 100%
job\toom
started\t1795995729
ended\t1795995729
exit_code\t137
runner\ttmux
last\ttorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB
alert\ttorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB
job\trunning
started\t1795995700
runner\tnohup
alive\t1
last\tstep 1 loss 3.0
job\tgone
started\t1795990000
last\tepoch 3
"""


def test_parse_listing_reads_every_state_from_recorded_text():
    got = {j.name: j for j in parse_listing(RECORDED_LISTING)}
    assert {n: j.state_text for n, j in got.items()} == {
        "crash": "exited 1",
        "diverged": "killed (nan)",
        "ok": "exited 0",
        "oom": "killed by the system (exit 137: SIGKILL, often the out-of-memory killer)",
        "running": "running",
        "gone": "lost",
    }
    assert got["ok"].shutdown_text == "shutdown in 59 s"
    assert got["running"].run_seconds == 30.0 and got["running"].runner == "nohup"
    assert got["diverged"].stopped_by == "step 20 loss nan" and got["diverged"].stop_on == ("nan", "oom")
    assert got["crash"].alerts == (Alert("traceback", "Traceback (most recent call last):"),)
    assert got["gone"].run_seconds is None and got["gone"].last_line == "epoch 3"


ALERT_LINES = {
    "step 20 loss nan": "nan",
    "Epoch 3: loss=inf": "nan",
    "{'loss': nan, 'lr': 0.001}": "nan",
    "val_loss: -inf": "nan",
    "Loss is nan, stopping training": "nan",
    "loss tensor(nan, device='cuda:0')": "nan",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB": "oom",
    "RuntimeError: CUDA error: out of memory": "oom",
    "Traceback (most recent call last):": "traceback",
    "step 10 loss 2.31": None,
    "nan_count=0 loss 1.2": None,
    "loss: infinity_scaled 0.3": None,
    "info: loading nanogpt": None,
    "  Traceback mentioned in a sentence": None,
}


def test_alert_patterns_classify_recorded_lines():
    assert {line: classify(line) for line in ALERT_LINES} == ALERT_LINES
    progress = ["step 1 loss 2.0\rstep 2 loss nan\rstep 3 loss nan"]
    assert scan_alerts(progress)[0] == Alert("nan", "step 2 loss nan")


def test_remote_grep_selects_the_same_lines_as_python(tmp_path):
    # The watcher and the listing match with `grep -a -i -E` on the machine: same verdicts.
    sample = tmp_path / "log"
    sample.write_text("\n".join(ALERT_LINES) + "\n", encoding="utf-8")
    for kind, (pattern, _) in jobs.ALERTS.items():
        r = subprocess.run(["grep", "-a", "-i", "-E", "-e", pattern, str(sample)], capture_output=True, text=True, encoding="utf-8")
        assert r.stdout.splitlines() == [ln for ln, k in ALERT_LINES.items() if k == kind], kind


def test_bad_names_and_stop_on_kinds_are_refused_with_the_fix():
    with pytest.raises(JobError) as e:
        jobs.check_name("my job")
    assert "letters, digits" in e.value.hint
    with pytest.raises(JobError) as e:
        parse_stop_on("nan,segfault")
    assert "'segfault'" in str(e.value) and "nan, oom, traceback" in e.value.hint
    assert parse_stop_on(" NaN, oom ,nan") == ("nan", "oom")


def test_job_renderings_have_text_and_html():
    infos = parse_listing(RECORDED_LISTING)
    table = jobs_table(infos, "gpu1")
    assert "diverged  killed (nan)" in table.text and "<table>" in table._repr_mimebundle_()["text/html"]
    alert = job_alert("diverged", Alert("nan", "step 20 loss <nan>"), stopped=True)
    assert "step 20 loss <nan>" in repr(alert) and "step 20 loss &lt;nan&gt;" in alert._repr_mimebundle_()["text/html"]
    assert "no jobs on gpu1" in jobs_table([], "gpu1").text


# -- case 5: --then-shutdown with a recording stand-in (started first: it takes a minute) ----


@pytest.fixture(scope="module")
def shutdown_server():
    server = make_server("jobs-shutdown")
    # a plain user's shutdown goes through passwordless sudo: a stand-in one where not root
    server.expected_shutdown = install_shutdown(
        server, '#!/bin/sh\necho "$(date +%s) ${GPUMAGIC_JOB:-?} $*" >> "$HOME/shutdown-calls"\n')
    add_client_entry(server, "jobs-shutdown")
    yield server
    kill_all_jobs(Path(server.env["HOME"]))
    server.stop()


@pytest.fixture(scope="module")
def shutdown_jobs(shutdown_server):
    """Three jobs armed with --then-shutdown 1 on the recorder server: one succeeds, one
    fails, one succeeds but has its shutdown cancelled."""
    import gpumagic

    m = gpumagic.connect("jobs-shutdown")
    plan = find_shutdown(m)
    # Never a real shutdown: the plan must be the stand-in in this server's bin/.
    assert plan.command == shutdown_server.expected_shutdown
    names = {k: jname(f"sd-{k}") for k in ("ok", "fail", "cancel")}
    m.start_job(names["ok"], "echo trained", then_shutdown=1)
    m.start_job(names["fail"], "echo broken; exit 3", then_shutdown=1)
    m.start_job(names["cancel"], "echo trained", then_shutdown=1)
    yield m, names, Path(shutdown_server.env["HOME"]) / "shutdown-calls"
    m.close()


@needs_tmux
@pytest.mark.xdist_group("jobs-shutdown")  # one worker makes the three jobs and waits their minute
def test_then_shutdown_is_pending_after_success_only_and_kill_shutdown_cancels(ip, shutdown_jobs):
    m, names, recorder = shutdown_jobs
    for n in names.values():
        m.job(n).wait(timeout=30)
    ip.run_line_magic("gpu", "connect jobs-shutdown")
    with capture_output() as c:
        ip.run_line_magic("gpu", f"kill {names['cancel']} --shutdown")
    assert "cancelled the shutdown of jobs-shutdown" in c.stdout
    with capture_output() as c:
        ip.run_line_magic("gpu", "jobs")
    rows = {ln.split()[0]: ln for ln in shown(c).splitlines() if ln.startswith("sd-")}
    assert re.search(r"exited 0; shutdown in ([3-5]\d s|1 min)", rows[names["ok"]])
    assert "exited 3" in rows[names["fail"]] and "shutdown" not in rows[names["fail"]]
    assert "exited 0; shutdown cancelled" in rows[names["cancel"]]
    assert not recorder.exists()


def test_then_shutdown_is_refused_where_the_machine_cannot_shut_down(machine):
    plan = find_shutdown(machine)
    if plan.possible:
        pytest.skip("this test machine could really shut down; refusing needs one that cannot")
    name = jname("sd-refused")
    with pytest.raises(JobError) as e:
        machine.start_job(name, "exit 1", then_shutdown=1)
    # the actual reason (a plain user: no sudo, or what sudo said; root: a container's PID 1)
    assert str(e.value).startswith(f"--then-shutdown: {machine.name} cannot shut itself down, so the job "
                                   f"was not started: {plan.reason}")
    assert name not in [j.name for j in machine.jobs()]


@pytest.mark.parametrize("minutes", [float("nan"), float("inf"), -1, 1e400, "10"])
def test_then_shutdown_in_python_refuses_what_is_not_minutes(machine, minutes):
    name = jname("sd-bad")
    with pytest.raises(JobError) as e:
        machine.start_job(name, "exit 0", then_shutdown=minutes)
    assert str(e.value).startswith("--then-shutdown takes minutes from 0 to 43200")
    assert name not in [j.name for j in machine.jobs()]


def test_then_shutdown_is_never_armed_for_real_on_the_sandbox():
    import gpumagic

    # The sandbox is this computer: its shutdown plan is its stand-in, never the real
    # `shutdown` a probe would find on this computer's PATH, and, as for the guard, whoever
    # the user is (issue 17: a plain user got a refusal about sudo instead).
    m = gpumagic.connect(sandbox=True)
    name = jname("sd-sandbox")
    try:
        m.start_job(name, "exit 1", then_shutdown=1)
        armed = m.exec(f'cat "$HOME/.gpumagic/jobs/{name}/shutdown_command"').stdout.strip()
        assert armed == f"{m.sandbox.server.bin}/shutdown -h now"
        assert m.job(name).wait(timeout=60).exit_code == 1  # a failed job: nothing is called
        assert not (m.sandbox.server.dir / "shutdown-calls").exists()
    finally:
        m.exec(f'rm -rf "$HOME/.gpumagic/jobs/{name}"')
        m.close()


def test_the_magics_say_a_sandbox_shutdown_is_a_stand_in(ip, capsys):
    # a new user, as root on a laptop, could not tell that the laptop would not power off
    from gpumagic.notebook.display import SANDBOX_SHUTDOWN_NOTE

    ip.run_line_magic("gpu", "connect --sandbox")
    name = jname("sd-note")
    m = ip._gpumagic.fleet.get()
    try:
        ip.run_cell_magic("remote", f"--job {name} --then-shutdown 1", "exit 1")
        assert SANDBOX_SHUTDOWN_NOTE in capsys.readouterr().out
        ip.run_line_magic("gpu", "budget guard --idle 30m")
        assert SANDBOX_SHUTDOWN_NOTE in capsys.readouterr().out
    finally:
        ip.run_line_magic("gpu", "budget guard --cancel")
        m.job(name).wait(timeout=60)
        m.exec(f'rm -rf "$HOME/.gpumagic/jobs/{name}"')


# -- case 1: a job survives the connection and the shell that started it -------------------

_STARTER = """
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config
c = Config(); c.HistoryManager.hist_file = ":memory:"
shell = InteractiveShell.instance(config=c)
shell.run_line_magic("load_ext", "gpumagic")
shell.run_line_magic("gpu", "connect testgpu")
shell.run_cell_magic("remote", "--job {name}", "for i in $(seq 1 20); do echo line $i; sleep 1; done")
"""


@pytest.fixture(scope="module")
def survivor(sshd):
    """A job started by another Python process (its own IPython shell and SSH connection),
    which then exits.  Started once, early: the job runs 20 s while other tests run."""
    name = jname("survive")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", _STARTER.format(name=name)], env=env,
                       capture_output=True, text=True, timeout=60, encoding="utf-8")
    return name, r


@needs_tmux
def test_job_survives_closing_connection_and_shell_and_a_fresh_shell_lists_it_running(ip, survivor):
    name, r = survivor
    assert r.returncode == 0, r.stderr
    assert f"started job {name} on testgpu (tmux session gpumagic-{name})" in r.stdout
    # That process (its shell and its SSH connection) is gone; a fresh shell connects.
    ip.run_line_magic("gpu", "connect testgpu")
    with capture_output() as c:
        ip.run_line_magic("gpu", "jobs")
    row = next(ln for ln in shown(c).splitlines() if ln.startswith(name))
    assert row.split()[1] == "running"


# -- case 2: tmux found outside the exec PATH; nohup fallback; neither ---------------------


@pytest.fixture(scope="module")
def path_server(tmp_path_factory):
    """Exec PATH is a directory with /usr/bin's programs but no tmux; tmux is only in
    ~/.local/bin."""
    bindir = link_bin(tmp_path_factory.mktemp("bin-no-tmux"), {"tmux"})
    server = make_server("jobs-path", env={"PATH": str(bindir)})
    home = Path(server.env["HOME"])
    (home / ".local" / "bin").mkdir(parents=True, exist_ok=True)
    if TMUX:
        os.symlink(os.path.realpath(TMUX), home / ".local" / "bin" / "tmux")
    add_client_entry(server, "jobs-path")
    yield server
    kill_all_jobs(home)
    server.stop()


@needs_tmux
def test_tmux_only_in_local_bin_with_exec_path_lacking_it_runs_the_job_in_tmux(path_server):
    import gpumagic

    with gpumagic.connect("jobs-path") as m:
        assert m.exec("command -v tmux").exit_code != 0  # the exec channel's PATH has no tmux
        name = jname("localbin")
        job = m.start_job(name, "echo in tmux: $TMUX_PANE; sleep 1")
        home = path_server.env["HOME"]
        assert (job.runner, job.runner_path, job.note) == ("tmux", f"{home}/.local/bin/tmux", "")
        assert m.exec(f"{home}/.local/bin/tmux has-session -t =gpumagic-{name}").exit_code == 0
        assert job.wait(timeout=30).state_text == "exited 0"
        assert re.fullmatch(r"in tmux: %\d+\n", job.logs())


def test_without_tmux_the_job_runs_under_nohup_and_the_message_says_so_once(ip, path_server):
    ip.run_line_magic("gpu", "connect jobs-path")
    m = ip._gpumagic.fleet.get()
    m.tool_dirs = ()  # nothing after the exec PATH, which has no tmux
    first, second = jname("nohup1"), jname("nohup2")
    with capture_output() as c:
        ip.run_cell_magic("remote", f"--job {first}", "echo one ${TMUX_PANE:-outside-tmux}; sleep 1")
        ip.run_cell_magic("remote", f"--job {second}", "echo two")
    assert c.stdout.count("runs under setsid nohup instead") == 1
    assert "jobs-path has no usable tmux" in c.stdout
    assert f"started job {second} on jobs-path (setsid nohup)" in c.stdout
    assert m.exec(f"{TMUX or 'tmux'} has-session -t =gpumagic-{first}").exit_code != 0
    info = m.job(first).wait(timeout=30)
    assert (info.runner, info.state_text, m.job(first).logs()) == ("nohup", "exited 0", "one outside-tmux\n")


def test_with_neither_tmux_nor_nohup_the_error_names_the_machine_and_apt_install(tmp_path_factory):
    bindir = link_bin(tmp_path_factory.mktemp("bin-bare"), {"tmux", "setsid", "nohup"})
    server = make_server("jobs-bare", env={"PATH": str(bindir)})
    try:
        m = Machine(server.spec(), name="bare-gpu")
        m.tool_dirs = ()
        with pytest.raises(JobError) as e:
            m.start_job(jname("bare"), "echo hi")
        assert "on bare-gpu: neither tmux nor setsid+nohup was found" in str(e.value)
        assert "apt install tmux" in e.value.hint
        assert m.jobs() == []  # nothing half-made is left behind
        m.close()
    finally:
        server.stop()


# -- case 3: --stop-on nan -------------------------------------------------------------------


@needs_tmux
def test_stop_on_nan_alerts_with_the_line_kills_the_job_and_reads_killed_nan(ip):
    ip.run_line_magic("gpu", "connect testgpu")
    name = jname("nan")
    ip.run_cell_magic("remote", f"--job {name} --stop-on nan",
                      "echo 'step 10 loss 2.31'; sleep 0.5; echo 'step 20 loss nan'; sleep 30; echo never")
    with capture_output() as c:
        ip.run_line_magic("gpu", f"attach {name}")
    alerts = [o for o in c.outputs if "ALERT" in o.data.get("text/plain", "")]
    assert len(alerts) == 1
    assert "NaN/inf loss in the log -- --stop-on stops the job" in alerts[0].data["text/plain"]
    assert "step 20 loss nan" in alerts[0].data["text/plain"]
    assert "step 20 loss nan" in alerts[0].data["text/html"]
    assert c.stdout.startswith("step 10 loss 2.31\nstep 20 loss nan\n")
    assert f"job {name} killed (nan) after" in c.stdout
    m = ip._gpumagic.fleet.get()
    info = m.job(name).info()
    assert (info.state_text, info.stopped_by) == ("killed (nan)", "step 20 loss nan")
    assert "never" not in m.job(name).logs()
    pid = int(m.exec(f"cat ~/.gpumagic/jobs/{name}/pid").stdout)
    assert wait_for(lambda: not session_members(pid), 5) is True


@needs_tmux
def test_stop_on_oom_names_the_kind_that_matched(machine):
    job = machine.start_job(jname("oomstop"), "echo 'RuntimeError: CUDA error: out of memory'; sleep 30",
                            stop_on="nan,oom")
    info = job.wait(timeout=30)
    assert (info.state_text, info.stopped_by) == ("killed (oom)", "RuntimeError: CUDA error: out of memory")


# -- case 4: %gpu kill leaves no process of the job ------------------------------------------


@needs_tmux
def test_kill_leaves_no_process_of_the_job_children_included(ip):
    ip.run_line_magic("gpu", "connect testgpu")
    name = jname("tree")
    n = secrets.randbelow(900) + 100
    marks = [f"sleep 71{n}{i}" for i in range(1, 6)]
    script = "\n".join([
        f"{marks[0]} &",                                           # a plain child
        f"setsid {marks[1]} &",                                    # left the process group and session
        f"sh -c 'trap \"\" TERM; {marks[2]}' &",                   # ignores SIGTERM
        "python3 -c 'import subprocess, time; subprocess.Popen(\"" + marks[3] + "\".split()); "
        "time.sleep(7000)' &",                                    # a grandchild
        "echo started",
        marks[4],                                                  # the foreground step
    ])
    ip.run_cell_magic("remote", f"--job {name}", script)
    pattern = "|".join(marks)
    found = wait_for(lambda: len({m for m in marks if processes(m)}) == 5 and processes(pattern), 10)
    assert found, f"job processes never all appeared: {processes(pattern)}"
    with capture_output() as c:
        ip.run_line_magic("gpu", f"kill {name}")
    assert f"killed job {name} on testgpu: killed (user)" in c.stdout
    assert processes(pattern) == []
    m = ip._gpumagic.fleet.get()
    assert m.job(name).info().state_text == "killed (user)"
    with capture_output() as c:
        ip.run_line_magic("gpu", f"kill {name}")
    assert "is not running (killed (user)); nothing to kill" in c.stdout


# -- more behaviour the issue names -------------------------------------------------------


@needs_tmux
def test_interrupting_follow_stops_following_never_the_job(machine):
    job = machine.start_job(jname("follow"), "for i in 1 2 3 4 5 6; do echo tick $i; sleep 0.5; done")
    got = []

    def out(text):
        got.append(text)
        raise KeyboardInterrupt  # what Jupyter's interrupt does inside the stream callback

    with pytest.raises(KeyboardInterrupt):
        job.follow(out=out)
    assert got and got[0].startswith("tick")
    assert job.info().state == "running"
    assert job.wait(timeout=30).state_text == "exited 0"
    assert job.logs() == "".join(f"tick {i}\n" for i in range(1, 7))


@needs_tmux
def test_python_job_output_reaches_the_log_unbuffered_and_wait_times_out(machine):
    job = machine.start_job(jname("unbuf"), "import time\nprint('early')\ntime.sleep(6)\nprint('late')",
                            python=True)
    assert wait_for(lambda: job.logs() == "early\n", 3)
    assert job.info().state == "running"
    with pytest.raises(RemoteTimeout):
        job.wait(timeout=0.5)
    assert job.kill().state_text == "killed (user)"


@needs_tmux
def test_system_sigkill_reads_as_killed_by_the_system_and_follow_reports_it(ip):
    ip.run_line_magic("gpu", "connect testgpu")
    name = jname("oom")
    ip.run_cell_magic("remote", f"--job {name}",
                      "echo 'torch.OutOfMemoryError: CUDA out of memory.'; kill -9 $$")
    with capture_output() as c:
        ip.run_line_magic("gpu", f"logs {name} --follow")
    assert f"job {name} killed by the system (exit 137: SIGKILL" in c.stdout
    assert any("CUDA out of memory" in o.data.get("text/plain", "") for o in c.outputs)


@needs_tmux
def test_a_running_name_is_refused_and_a_finished_one_is_kept_under_another_name(machine):
    name = jname("dup")
    job = machine.start_job(name, "sleep 2; echo first")
    with pytest.raises(JobError) as e:
        machine.start_job(name, "echo second")
    assert f"a job named {name!r} is already running on testgpu" in str(e.value)
    job.wait(timeout=30)
    again = machine.start_job(name, "echo second")
    assert re.fullmatch(rf"{name}-\d+", again.archived)
    again.wait(timeout=30)
    assert machine.job(again.archived).logs() == "first\n" and again.logs() == "second\n"


def test_job_options_without_job_and_bad_values_are_usage_errors(ip):
    from IPython.core.error import UsageError

    ip.run_line_magic("gpu", "connect testgpu")
    for line, msg in [("--stop-on nan", "need --job NAME"),
                      ("--job 'a b'", "letters, digits"),
                      ("--job x --stop-on nan,segv", "use a comma-separated list of: nan, oom, traceback"),
                      ("--job x --timeout 5", "--timeout does not apply to --job")]:
        with pytest.raises(UsageError) as e:
            ip.run_cell_magic("remote", line, "echo hi")
        assert type(e.value) is UsageError and msg in str(e.value), line


@needs_tmux
def test_job_runs_in_its_directory_with_its_env_and_pythonunbuffered_unless_set(ip):
    ip.run_line_magic("gpu", "connect testgpu")
    m = ip._gpumagic.fleet.get()
    a, b = jname("env1"), jname("env2")
    ip.run_cell_magic("remote", f"--job {a} --cwd /tmp --env FOO=bar", 'echo "$PWD $FOO $PYTHONUNBUFFERED"')
    ip.run_cell_magic("remote", f"--job {b} --env PYTHONUNBUFFERED=0", 'echo "$PYTHONUNBUFFERED $GPUMAGIC_JOB"')
    assert m.job(a).wait(timeout=30).state_text == "exited 0"
    m.job(b).wait(timeout=30)
    assert (m.job(a).logs(), m.job(b).logs()) == ("/tmp bar 1\n", f"0 {b}\n")


@needs_tmux
def test_no_alerts_hides_alerts_when_listing_and_following(ip):
    ip.run_line_magic("gpu", "connect testgpu")
    name = jname("quiet")
    ip.run_cell_magic("remote", f"--job {name} --no-alerts", "echo 'step 5 loss nan'")
    with capture_output() as c:
        ip.run_line_magic("gpu", f"logs {name} --follow")
        ip.run_line_magic("gpu", "jobs")
    assert "step 5 loss nan" in c.stdout and f"job {name} exited 0" in c.stdout
    assert not any(name in o.data.get("text/plain", "") and "ALERT" in o.data.get("text/plain", "")
                   for o in c.outputs)


@needs_tmux
def test_dropped_connection_while_following_without_a_grace_leaves_the_job_running(machine):
    job = machine.start_job(jname("drop"), "for i in 1 2 3 4 5; do echo tick $i; sleep 0.5; done")

    def out(text):
        machine.connection.transport.sock.close()

    with pytest.raises(ConnectionLost) as e:
        job.follow(out=out, grace=0)
    assert "the job keeps running there" in str(e.value) and "%gpu attach" in e.value.hint
    assert job.info().state == "running"  # the next call reconnected by itself
    assert job.wait(timeout=30).state_text == "exited 0"
    assert job.logs() == "".join(f"tick {i}\n" for i in range(1, 6))


def test_following_goes_on_through_a_dropped_connection_with_every_line_once(machine):
    # issue 28: `%gpu logs -f` is a kept cell (the default grace): it connects again,
    # re-attaches and shows what it had not shown, once
    job = machine.start_job(jname("drop2"), "for i in 1 2 3 4 5; do echo tick $i; sleep 0.5; done")
    seen: list[str] = []
    first = machine.connection.transport

    def out(text):
        if not seen:
            machine.connection.transport.sock.close()
        seen.append(text)

    info = job.follow(out=out)
    assert machine.connection.transport is not first  # it did go through a new connection
    assert "".join(seen) == "".join(f"tick {i}\n" for i in range(1, 6))
    assert info.state_text == "exited 0"


@needs_tmux
def test_a_job_whose_runner_was_killed_outright_reads_lost(ip):
    ip.run_line_magic("gpu", "connect testgpu")
    m = ip._gpumagic.fleet.get()
    job = m.start_job(jname("lost"), "sleep 600")
    os.killpg(job.pid, 9)  # what a reboot or `kill -9 -PGID` does: no exit_code is written
    assert wait_for(lambda: job.info().state == "lost", 5)
    with capture_output() as c:
        ip.run_line_magic("gpu", f"kill {job.name}")
    assert f"job {job.name} is not running (lost); nothing to kill" in c.stdout
    with capture_output() as c:
        ip.run_line_magic("gpu", f"logs {job.name} --follow")
    assert f"job {job.name} is lost: its runner is gone without an exit code" in c.stdout


def test_kill_on_a_machine_without_ps_still_ends_the_tree_and_escalates_to_sigkill(tmp_path_factory):
    bindir = link_bin(tmp_path_factory.mktemp("bin-no-ps"), {"tmux", "ps"})
    server = make_server("jobs-nops", env={"PATH": str(bindir)})
    m = Machine(server.spec(), name="nops")
    m.tool_dirs = ()
    try:
        assert m.exec("command -v ps").exit_code != 0
        n = secrets.randbelow(900) + 100
        marks = [f"sleep 73{n}1", f"sleep 73{n}2"]
        job = m.start_job(jname("nops"), f"sh -c 'trap \"\" TERM; {marks[0]}' & {marks[1]}")
        assert job.runner == "nohup"
        assert wait_for(lambda: all(processes(x) for x in marks), 10)
        assert job.kill().state_text == "killed (user)"
        assert processes("|".join(marks)) == []
    finally:
        kill_all_jobs(Path(server.env["HOME"]))
        m.close()
        server.stop()


@needs_tmux
def test_the_surviving_job_later_shows_exited_0_with_all_20_lines_in_its_log(ip, survivor):
    name, _ = survivor
    ip.run_line_magic("gpu", "connect testgpu")
    m = ip._gpumagic.fleet.get()
    info = m.job(name).wait(timeout=60)
    assert info.state_text == "exited 0"
    assert info.run_seconds >= 19  # it ran its whole course, not cut short by the disconnect
    assert m.job(name).logs(None) == "".join(f"line {i}\n" for i in range(1, 21))
    with capture_output() as c:
        ip.run_line_magic("gpu", "jobs")
    row = next(ln for ln in shown(c).splitlines() if ln.startswith(name))
    assert "exited 0" in row and row.endswith("line 20")


# -- tutorial 04 ----------------------------------------------------------------------------


@needs_tmux
@pytest.mark.tutorial("04-long-training-jobs.ipynb")
def test_tutorial_04_runs_and_shows_the_nan_alert(executed):
    # run once for every test that reads it (tests/tutorials.py: its jobs are ended and removed after)
    nb = executed["04-long-training-jobs.ipynb"]

    def text(cell):
        parts = []
        for o in cell.get("outputs", []):
            parts.append(o.get("text", ""))
            parts.append(o.get("data", {}).get("text/plain", ""))
        return "".join(parts)

    code = [c for c in nb.cells if c.cell_type == "code"]
    everything = "\n".join(text(c) for c in code)
    assert "started job tutorial-train on sandbox" in everything
    assert re.search(r"tutorial-train\s+running", everything)  # listed again after reconnecting
    assert "NaN/inf loss in the log -- --stop-on stops the job" in everything
    assert "job tutorial-train killed (nan) after" in everything
    assert re.search(r"tutorial-train\s+killed \(nan\)", everything)
    assert "cancelled the shutdown of sandbox armed by job tutorial-eval" in everything
    assert not any(o.get("output_type") == "error" for c in code for o in c.get("outputs", []))


# -- case 5, the end: the recorder ran once, about a minute after the successful job -------


@needs_tmux
@pytest.mark.xdist_group("jobs-shutdown")
@pytest.mark.slow(200, reason="a job's shutdown comes a minute after it ends, by design")
def test_then_shutdown_calls_the_recorder_about_a_minute_after_success_and_not_after_failure(shutdown_jobs):
    m, names, recorder = shutdown_jobs
    ok = m.job(names["ok"]).wait(timeout=30)
    assert wait_for(recorder.exists, ok.ended + 80 - time.time(), interval=0.5)
    time.sleep(3)  # the failed and cancelled jobs ended at the same time as the ok one
    calls = recorder.read_text(encoding="utf-8").splitlines()
    assert len(calls) == 1
    when, job, args = calls[0].split(" ", 2)
    assert (job, args) == (names["ok"], "-h now")
    assert 58 <= int(when) - ok.ended <= 75  # "about a minute" after the job ended
    assert m.job(names["ok"]).info().shutdown_text == "shutdown ran"


# -- starting is atomic; one liveness check; private state; relative --cwd ----------------------


def runners_in(job_dir: Path) -> list[int]:
    """Pids of live (not zombie) job runners (``/bin/sh ./run.sh``) whose cwd is ``job_dir``."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if (os.readlink(p / "cwd") == str(job_dir.resolve())
                    and (p / "cmdline").read_bytes() == b"/bin/sh\0./run.sh\0"
                    and (p / "stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()[0] != "Z"):
                found.append(int(p.name))
        except OSError:
            continue
    return found


@needs_tmux
def test_two_concurrent_starts_of_one_name_start_one_job_and_the_other_is_told_already_running(sshd):
    # Issue case 2: both said "started", two runners ran, an empty archive `NAME-` appeared
    # and kill left one runner alive.  Two real starts over separate connections, five times.
    import threading

    import gpumagic

    name = jname("race")
    home = Path(sshd.env["HOME"])
    base = home / jobs.JOBS_DIR
    tag = f"7{secrets.randbelow(9000) + 1000}"
    machines = [gpumagic.connect("testgpu"), gpumagic.connect("testgpu")]
    try:
        for m in machines:
            m.env.login()  # read once beforehand, so both starts reach the machine together
        for round_ in range(5):
            barrier = threading.Barrier(2)
            results: list = [None, None]

            def start(i: int) -> None:
                barrier.wait()
                try:
                    results[i] = machines[i].start_job(name, f"echo from-{i}; sleep {tag}{round_}")
                except JobError as e:
                    results[i] = e

            threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            won = [r for r in results if isinstance(r, jobs.Job)]
            lost = [r for r in results if isinstance(r, JobError)]
            assert len(won) == 1 and len(lost) == 1, results
            assert f"a job named {name!r} is already running on testgpu" in str(lost[0])
            winner = results.index(won[0])
            assert (base / name / "command").read_text(encoding="utf-8") == f"echo from-{winner}; sleep {tag}{round_}"
            assert wait_for(lambda: won[0].logs() == f"from-{winner}\n", 10)
            assert runners_in(base / name) == [won[0].pid]
            assert not (base / f"{name}-").exists()
            assert sorted(p.name for p in base.glob(f"{name}-*")) == sorted(
                p.name for p in base.glob(f"{name}-[0-9]*"))  # every archive named by its start
            assert won[0].kill().state_text == "killed (user)"
            assert runners_in(base / name) == [] and processes(f"sleep {tag}{round_}") == []
        assert len(list(base.glob(f"{name}-*"))) == 4  # each later round archived the one before
    finally:
        for m in machines:
            m.close()


def test_a_zombie_runner_counts_as_ended_for_wait_follow_list_and_kill(machine, sshd):
    # Issue 15: `Job.wait` polled a zombie runner (it still answers `kill -0`) until its timeout.
    # The zombie is a child of this test that is not reaped yet; its job directory is written
    # as a runner that died without writing exit_code would leave it.
    zombie = subprocess.Popen(["true"])
    try:
        assert wait_for(lambda: Path(f"/proc/{zombie.pid}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()[0] == "Z", 5)
        name = jname("zombie")
        d = Path(sshd.env["HOME"]) / jobs.JOBS_DIR / name
        d.mkdir(parents=True)
        (d / "pid").write_text(f"{zombie.pid}\n", encoding="utf-8")
        (d / "started").write_text(f"{int(time.time())}\n", encoding="utf-8")
        (d / "log").write_text("step 1\n", encoding="utf-8")
        job = machine.job(name)
        start = time.monotonic()
        assert job.wait(timeout=20).state == "lost"
        assert time.monotonic() - start < 10
        assert job.follow(out=lambda t: None).state == "lost"
        assert job.info().state == "lost"
        assert job.kill().state == "lost"
        again = machine.start_job(name, "echo fresh")  # a lost job's name can be used again
        assert again.archived.startswith(f"{name}-") and again.wait(timeout=30).state_text == "exited 0"
    finally:
        zombie.wait()


@needs_tmux
def test_a_start_lock_left_by_a_dead_launcher_is_broken_and_a_live_one_means_already_running(machine, sshd):
    base = Path(sshd.env["HOME"]) / jobs.JOBS_DIR
    base.mkdir(parents=True, exist_ok=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    # The lock is a symlink naming its owner, "PID PSTART": a dead pid, or a target that names
    # no process at all, is a lock to break.
    for name, owner in [(jname("stale"), f"{dead.pid} 1"), (jname("ownerless"), "garbage")]:
        lock = base / f".{name}.lock"
        lock.symlink_to(owner)
        job = machine.start_job(name, "echo ran")
        assert job.wait(timeout=30).state_text == "exited 0" and job.logs() == "ran\n"
        assert not lock.is_symlink()
    # A live launcher (this test process stands in, with its real start time) holds it.
    name = jname("starting")
    lock = base / f".{name}.lock"
    start_time = Path(f"/proc/{os.getpid()}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()[19]
    lock.symlink_to(f"{os.getpid()} {start_time}")
    with pytest.raises(JobError) as e:
        machine.start_job(name, "echo never")
    assert "is already running" in str(e.value)
    assert not (base / name).exists() and lock.is_symlink()
    # A pid reused by another process (after a reboot) does not hold it.
    lock.unlink()
    lock.symlink_to(f"{os.getpid()} 1")
    # Something else at the lock's path is not taken for a lock, nor removed.
    other = jname("notalock")
    (base / f".{other}.lock").mkdir()
    with pytest.raises(JobError, match="is not a start lock gpumagic made: remove it"):
        machine.start_job(other, "echo never")
    assert (base / f".{other}.lock").is_dir() and not (base / other).exists()
    assert machine.start_job(name, "echo now").wait(timeout=30).state_text == "exited 0"


@needs_tmux
def test_relative_job_cwd_starts_at_home_and_the_job_state_is_private(machine, sshd):
    # --cwd sub used to resolve inside the job's own directory; env.sh (the --env values and
    # the login environment) was 0644 in 0755 directories.
    home = Path(sshd.env["HOME"])
    (home / "jobsub").mkdir(exist_ok=True)
    name = jname("private")
    umask = machine.run("umask", quiet=True).stdout.strip()
    job = machine.start_job(name, "pwd; touch made-by-the-job; umask", cwd="jobsub",
                            env={"TOKEN_FOR_JOB": "s3cret"})
    assert job.wait(timeout=30).state_text == "exited 0"
    assert job.logs() == f"{home}/jobsub\n{umask}\n"
    made = (home / "jobsub" / "made-by-the-job").stat().st_mode & 0o777
    assert made == 0o666 & ~int(umask, 8)  # the job itself keeps the user's umask
    d = home / jobs.JOBS_DIR / name
    assert "TOKEN_FOR_JOB='s3cret'" in (d / "env.sh").read_text(encoding="utf-8")
    for p in [home / ".gpumagic", home / jobs.JOBS_DIR, d, *d.iterdir()]:
        want = 0o700 if p.is_dir() else 0o600
        assert p.stat().st_mode & 0o777 == want, p


# -- issue 17 case 4: an alert is shown once, with its job ------------------------------------


def test_an_alert_is_shown_once_with_its_job_not_under_every_later_listing(ip):
    ip.run_line_magic("gpu", "connect testgpu")
    m = ip._gpumagic.fleet.get()
    diverged, later = jname("once"), jname("later")
    ip.run_cell_magic("remote", f"--job {diverged}", "echo 'step 20 loss nan'")
    m.job(diverged).wait(timeout=30)
    shown = []
    for _ in range(3):  # `%gpu attach`, then `%gpu jobs` twice, as re-running notebook 04 does
        with capture_output() as c:
            ip.run_line_magic("gpu", f"attach {diverged}" if not shown else "jobs")
        shown.append(c.outputs)
    ip.run_cell_magic("remote", f"--job {later}", "echo fine")
    m.job(later).wait(timeout=30)
    with capture_output() as c:
        ip.run_line_magic("gpu", "jobs")
    shown.append(c.outputs)
    # (this job's: a job of another test on this machine may raise its own alert meanwhile)
    alerts = [[o for o in outs if f"ALERT job {diverged}:" in o.data.get("text/plain", "")] for outs in shown]
    assert [len(a) for a in alerts] == [1, 0, 0, 0]
    assert f"ALERT job {diverged}: NaN/inf loss in the log" in alerts[0][0].data["text/plain"]
    table = next(o.data for o in shown[-1] if "jobs on" in o.data.get("text/plain", ""))
    row = next(line for line in table["text/plain"].splitlines() if line.startswith(diverged))
    assert "exited 0; alert: NaN/inf loss" in row  # the job keeps its alert, in its own row
    assert "exited 0; alert: NaN/inf loss" in table["text/html"]
    later_row = next(line for line in table["text/plain"].splitlines() if line.startswith(later))
    assert "alert" not in later_row


# -- one options object from the magics to the API (issue 25, item 3) -----------------------


def test_job_options_take_keyword_shortcuts_and_name_a_misspelt_one():
    from gpumagic.remote.jobs import JobOptions

    base = JobOptions(cwd="proj", alerts=False)
    assert base.with_(then_shutdown=10) == JobOptions(cwd="proj", alerts=False, then_shutdown=10)
    assert base.with_() is base
    with pytest.raises(TypeError, match=r"^unknown job option stop_one \(valid: alerts, cwd, env, python, "
                                        r"resume_arg, stop_on, then_shutdown\)$"):
        base.with_(stop_one="nan")


def test_start_distributed_splits_its_keywords_into_the_two_option_objects():
    from gpumagic.remote import distributed
    from gpumagic.remote.jobs import JobOptions

    job, run = distributed.split_options({"nproc": 2, "same_dir": "data", "cwd": "~", "env": {"A": "1"},
                                          "stop_on": "nan"})
    assert job == JobOptions(cwd="~", env={"A": "1"}, stop_on="nan")
    assert run == distributed.TorchrunOptions(nproc=2, same_dir="data")
    with pytest.raises(TypeError, match="unknown job option nprocs"):
        distributed.split_options({"nprocs": 2})


def test_the_job_magic_hands_its_options_as_one_object(ip, monkeypatch):
    """``%%remote --job`` builds one JobOptions from its flags; Machine.start_job gets it whole."""
    from gpumagic.machine import Machine
    from gpumagic.remote.jobs import JobOptions

    got = {}

    def fake_start_job(self, name, command, options=None, **kw):
        got.update(name=name, options=options, kw=kw)
        raise JobError("stop here", "nothing started")

    monkeypatch.setattr(Machine, "start_job", fake_start_job)
    ip.run_line_magic("gpu", "connect testgpu")
    with pytest.raises(JobError):
        ip.run_cell_magic("remote", "--job opt1 --cwd proj --env A=1 --stop-on nan --no-alerts --python",
                          "print(1)")
    assert got["options"] == JobOptions(python=True, cwd="proj", env={"A": "1"}, stop_on=("nan",), alerts=False)
    assert got["kw"] == {"keep": None}


# -- two sandboxes, two tmux servers (issue 43) ------------------------------------------------


@needs_tmux
def test_two_servers_jobs_of_one_name_live_in_their_own_tmux_servers(tmp_path):
    # A job `jy` started on sandbox b killed sandbox a's tmux session of the same name (the
    # process ran on, its session was gone), and panes had the environment of whichever sandbox
    # started the one tmux server: each machine's jobs are its own (TMUX_TMPDIR per server).
    import gpumagic
    from conftest import add_client_entry, make_server

    aliases = [f"tmux-{n}-{TOKEN}" for n in ("a", "b")]
    servers = [make_server(alias) for alias in aliases]
    machines = []
    name = jname("jy")
    try:
        for s, alias in zip(servers, aliases):
            add_client_entry(s, alias)
            machines.append(gpumagic.connect(alias))
        for m in machines:
            m.start_job(name, 'echo "home=$HOME"; sleep 600')
        for m, s in zip(machines, servers):
            assert m.exec(f"{TMUX} has-session -t =gpumagic-{name}").exit_code == 0  # both are there
            assert m.job(name).info().running
            assert wait_for(lambda: "home=" in m.job(name).logs(5), 20)
            assert m.job(name).logs(5).strip() == f"home={s.env['HOME']}"  # its own machine's HOME
        assert servers[0].tmux_dir() != servers[1].tmux_dir()
    finally:
        for m in machines:
            try:
                m.job(name).kill()
            except Exception:  # noqa: BLE001 - the clean-up below ends what is left
                pass
            m.close()
        for s in servers:
            kill_all_jobs(Path(s.env["HOME"]))
            s.stop()
