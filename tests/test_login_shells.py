"""Cells, jobs, sync and tunnels on machines whose login shell is fish, tcsh or zsh.

sshd runs every exec request as ``$SHELL -c "<request>"`` with the account's login shell,
and fish (``\\\\`` is ``\\`` inside single quotes) or tcsh (no quoted newlines) re-read the
text differently from sh.  The test servers get such a login shell without changing any
account, so this works as root and as a plain user: sshd_config ``ForceCommand exec SHELL -c
"$SSH_ORIGINAL_COMMAND"`` runs the client's text through SHELL exactly as sshd does for an
account whose login shell is SHELL (the account's own shell runs that line and only expands
the variable: the text reaches SHELL unchanged), and ``SetEnv SHELL=...`` makes ``$SHELL``
name it, as sshd would.  A shell that is not installed is skipped with the apt-get line.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import urllib.request
from pathlib import Path

import pytest

from conftest import make_server, wait_until
from gpumagic.remote import jobs
from gpumagic.machine import Machine

SHELLS = {"fish": "fish", "tcsh": "tcsh", "zsh": "zsh"}

#: Start-up files: one variable every shell sets, one only a login (``ssh host``) sets.
RC_FILES = {
    "fish": {".config/fish/config.fish": "set -gx GM_RC_ALWAYS fish\n"
                                         "if status is-login\n  set -gx GM_RC_LOGIN yes\nend\n"},
    "tcsh": {".tcshrc": "setenv GM_RC_ALWAYS tcsh\n", ".login": "setenv GM_RC_LOGIN yes\n"},
    "zsh": {".zshenv": "export GM_RC_ALWAYS=zsh\n", ".zprofile": "export GM_RC_LOGIN=yes\n"},
}

#: Text that every shell's quoting would change somewhere: backslashes (fish), newlines in
#: quotes and ``!`` (tcsh), ``$``, globs, braces, ``%`` (old fish), a tab, and non-ASCII.
NASTY = ("C:\\\\data\\\\run1 \\t \\n \\' '\"' \"$HOME\" `x` $(y) ! !! * ? [a] {a,b} % ~ # ; & | < >\n"
         "second line\twith a tab \\\n训练 ✓ end\\")


def _login_shell_server(name: str, shell: str, tmp: Path):
    path = shutil.which(shell)
    if path is None:
        pytest.skip(f"{shell} is not installed here (apt-get install {shell})")
    server = make_server(f"login-{name}", env={"SHELL": path}, fake_gpu="h200-idle",
                         extra_config=f'ForceCommand exec {path} -c "$SSH_ORIGINAL_COMMAND"')
    home = Path(server.env["HOME"])
    for rel, text in RC_FILES[name].items():
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_text(text, encoding="utf-8")
    return server


@pytest.fixture(scope="module", params=sorted(SHELLS))
def shell_machine(request, tmp_path_factory):
    """A connected Machine whose login shell is fish, tcsh or zsh; its server; the name."""
    name = request.param
    server = _login_shell_server(name, SHELLS[name], tmp_path_factory.mktemp(name))
    m = Machine(server.spec(alias=f"login-{name}")).connect()
    yield m, server, name
    jobs_dir = Path(server.env["HOME"]) / ".gpumagic" / "jobs"
    for d in jobs_dir.glob("*") if jobs_dir.is_dir() else ():
        if (d / "kill.sh").exists() and not (d / "exit_code").exists():
            m.job(d.name).kill()
    m.close()
    server.stop()


def test_the_test_server_really_reads_requests_with_that_shell(shell_machine):
    # What the bug looked like: the same text sent as a plain exec request is changed (fish,
    # tcsh) or the shell is at least the one named; gpumagic's own commands are not affected.
    m, server, name = shell_machine
    chan = m.connection.open_session()
    chan.exec_command("echo $SHELL")
    assert chan.makefile().read().decode().strip() == shutil.which(SHELLS[name])
    chan.close()
    if name == "fish":
        chan = m.connection.open_session()
        chan.exec_command(r"printf '%s\n' 'C:\\data'")
        assert chan.makefile().read() == b"C:\\data\n"  # fish made one backslash of two
        chan.close()


def test_bash_cell_text_arrives_byte_for_byte(shell_machine):
    m, _, _ = shell_machine
    r = m.run(r"printf '%s\n' 'C:\\data\\run1'", quiet=True)
    assert (r.exit_code, r.stdout, r.stderr) == (0, "C:\\\\data\\\\run1\n", "")
    cell = 'printf %s "$BASH_EXECUTION_STRING"\n: <<\'EOF\'\n' + NASTY + "\nEOF"
    assert m.run(cell, quiet=True).stdout == cell


def test_python_cell_text_arrives_byte_for_byte(shell_machine):
    m, _, _ = shell_machine
    r = m.run("print(repr('a\\\\tb'), len('\\\\t'))", python=True, quiet=True)
    assert r.stdout == "'a\\\\tb' 2\n"  # a backslash and a t, not a TAB
    cell = "import sys; sys.stdout.write(sys.orig_argv[-1])\n" + "# " + NASTY.replace("\n", "\n# ")
    assert m.run(cell, python=True, quiet=True).stdout == cell


def test_env_values_and_cwd_arrive_byte_for_byte(shell_machine):
    m, server, _ = shell_machine
    weird = "dir 'q' \"d\" \\\\ $x !1 {a,b} *"
    (Path(server.env["HOME"]) / weird).mkdir(exist_ok=True)
    r = m.run('printf "%s|" "$V1" "$V2"; pwd', cwd=weird, env={"V1": NASTY, "V2": ""}, quiet=True)
    assert r.stdout == f"{NASTY}||{server.env['HOME']}/{weird}\n"


def test_cells_get_the_login_environment_of_that_shell(shell_machine):
    m, _, name = shell_machine
    r = m.run('echo "$GM_RC_ALWAYS $GM_RC_LOGIN"', quiet=True)
    assert r.stdout == f"{name} yes\n"


def test_machine_queries_and_stdin_work(shell_machine):
    m, _, _ = shell_machine
    assert m.exec("printf '%s\\n' 'a\\\\b'; echo \"$0\"").stdout == "a\\\\b\n/bin/sh\n"
    assert m.exec("cat", stdin=NASTY.encode()).stdout == NASTY
    assert [g.name for g in m.gpu_status().gpus] == ["NVIDIA H200"]


def test_job_command_env_and_cwd_arrive_byte_for_byte(shell_machine):
    m, server, name = shell_machine
    home = server.env["HOME"]
    (Path(home) / "jobdir").mkdir(exist_ok=True)
    jname = f"shell-{name}-{secrets.token_hex(3)}"
    cell = 'printf "%s|" "$V" "$GM_RC_LOGIN"; pwd\n: <<\'EOF\'\n' + NASTY + "\nEOF\n"
    job = m.start_job(jname, cell, env={"V": NASTY}, cwd="jobdir")
    info = job.wait(timeout=60)
    assert info.state_text == "exited 0", job.logs()
    assert job.logs(None).endswith(f"{NASTY}|yes|{home}/jobdir\n")
    assert (Path(home) / jobs.JOBS_DIR / jname / "command").read_bytes() == cell.encode()
    assert jname in [j.name for j in m.jobs()]


def test_sync_push_and_pull_round_trip(shell_machine, tmp_path):
    m, server, name = shell_machine
    src = tmp_path / "src"
    (src / "sub dir").mkdir(parents=True)
    (src / "a\\b 'q'.txt").write_text(NASTY, encoding="utf-8")
    (src / "sub dir" / "big.bin").write_bytes(os.urandom(9 * 1024 * 1024))  # own channel
    remote = Path(server.env["HOME"]) / f"sync-{name}"
    m.push(str(src) + "/", f"{remote}/")
    assert (remote / "a\\b 'q'.txt").read_text(encoding="utf-8") == NASTY
    back = tmp_path / "back"
    m.pull(f"{remote}/", str(back) + "/")
    assert (back / "sub dir" / "big.bin").read_bytes() == (src / "sub dir" / "big.bin").read_bytes()
    assert (back / "a\\b 'q'.txt").read_text(encoding="utf-8") == NASTY


@pytest.mark.parametrize("shell_machine", ["fish"], indirect=True)  # one slow start is enough
def test_jupyter_tunnel_starts_and_stops(shell_machine):
    m, _, name = shell_machine
    t = m.tunnels.jupyter(local_port=0)
    pid = t.service.pid
    try:
        token = re.search(r"\?token=(\w+)$", t.url).group(1)
        url = f"http://127.0.0.1:{t.local_port}/api/status?token={token}"
        assert b"started" in urllib.request.urlopen(url, timeout=30).read()
        assert t.service.started
    finally:
        m.tunnels.close(t.local_port, stop_service=True)
    assert wait_until(lambda: gone(pid), 15)  # stopped through an exec on that machine


def gone(pid: int) -> bool:
    """No process ``pid`` on this computer (the test machine), a zombie counting as gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_bootstrap_is_plain_words_every_shell_reads_alike():
    from gpumagic.remote.execution import BOOTSTRAP

    assert re.fullmatch(r"[A-Za-z0-9/ ]+", BOOTSTRAP)


def test_cells_run_in_the_runner_started_through_that_shell(shell_machine):
    # Issue 20: the per-connection runner starts through fish, tcsh and zsh too, and the
    # cell (its text in the runner's request, never re-read by a shell) is its child.
    m, _, _ = shell_machine
    r = m.run('tr "\\0" " " < /proc/$PPID/cmdline | grep -c gpumagic-runner', quiet=True)
    assert r.stdout == "1\n"
