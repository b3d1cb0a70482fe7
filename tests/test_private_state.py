"""Everything gpumagic keeps is private to the user, on this computer and on the machine.

Issue case 11: ``~/.gpumagic/jobs/NAME/env.sh`` (the ``--env`` values and the login
environment) was 0644 in 0755 directories, and the Jupyter log with its token was 0644.
After a session that ran cells with ``--env``, a job, a sync both ways, Jupyter and the
budget ledger, every directory gpumagic wrote is 0700 and every file 0600, under the usual
umask 022.  The sandbox is the machine: its ``~/.gpumagic`` is the remote side, gpumagic's
user data directory the local side.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import gpumagic
from gpumagic import budget


def walk(top: Path) -> list[Path]:
    """``top`` and everything below it (symlinks not followed)."""
    out = [top]
    for root, dirs, files in os.walk(top):
        out += [Path(root) / n for n in dirs + files]
    return out


def test_every_directory_and_file_gpumagic_wrote_is_private(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUMAGIC_DATA_DIR", raising=False)
    old_umask = os.umask(0o022)
    try:
        m = gpumagic.connect(sandbox=True)
        try:
            assert m.run("umask", quiet=True).stdout == "0022\n"
            assert m.run('echo "$K"', env={"K": "v"}, quiet=True).stdout == "v\n"
            job = m.start_job("private-state", "echo job; touch ~/made-by-job", env={"TOKEN": "t"})
            assert job.wait(timeout=60).state_text == "exited 0"
            # killed, stopped by --stop-on: kill.sh and watch.sh write there too (`killed` was 0644)
            m.start_job("private-killed", "sleep 60").kill()
            stopped = m.start_job("private-stopped", "echo 'loss nan'; sleep 60", stop_on="nan")
            assert stopped.wait(timeout=60).killed == "nan"
            (tmp_path / "src").mkdir()
            (tmp_path / "src" / "f.txt").write_text("data", encoding="utf-8")
            m.push(str(tmp_path / "src") + "/", "~/private-sync/")
            m.pull("~/private-sync/", str(tmp_path / "back") + "/")
            m.budget.set(2.5, currency="CNY")
            t = m.tunnels.jupyter(local_port=0)
            log = Path(t.service.log)
            m.tunnels.close(t.local_port, stop_service=True)
            home = m.sandbox.home
        finally:
            m.close()
    finally:
        os.umask(old_umask)
    state = home / ".gpumagic"
    assert log.parent == state and "token" in log.read_text(encoding="utf-8")
    assert (state / "jobs" / "private-state" / "env.sh").exists()
    assert (state / "jobs" / "private-killed" / "killed").exists()
    assert (state / "jobs" / "private-stopped" / "stopped_by").exists()
    data = budget.data_dir()
    assert (data / "ledger.json").exists()
    # Everything in gpumagic's data directory except the sandbox homes' own files (a home
    # directory: what cells write there is the user's; other tests' named sandboxes have
    # sandbox-home-NAME), plus each home itself and its ~/.gpumagic (torchrun's state too).
    homes = [home, *home.parent.glob("sandbox-home-*")]
    paths = [p for p in walk(data) if not any(h in p.parents for h in homes)]
    for h in homes:
        paths += [h] + (walk(h / ".gpumagic") if (h / ".gpumagic").is_dir() else [])
    wrong = {str(p): oct(stat.S_IMODE(p.lstat().st_mode)) for p in paths
             if stat.S_IMODE(p.lstat().st_mode) != (0o700 if p.is_dir() else 0o600)}
    assert wrong == {}
    # What the job itself made keeps the user's umask.
    assert stat.S_IMODE((home / "made-by-job").stat().st_mode) == 0o644


def test_the_budget_guard_and_jobs_on_a_rented_machine_keep_a_private_state_dir(tmp_path):
    from conftest import install_shutdown, make_server
    from gpumagic.budget import Ledger
    from gpumagic.budget.shutdown import find_shutdown

    old_umask = os.umask(0o022)
    try:
        server = make_server("private-guard", fake_gpu="h200-idle")
        expected = install_shutdown(server, f"#!/bin/sh\necho \"$*\" >> {server.dir}/shutdown-calls\n")
        m = gpumagic.Machine(server.spec()).connect()
        try:
            plan = find_shutdown(m)
            assert plan.command == expected, plan  # never a real one
            ledger = Ledger(tmp_path / "ledger.json")
            m.budget.set(1, currency="CNY", ledger=ledger)
            m.budget.guard(idle=3600, poll=1, ledger=ledger, plan=plan)
            job = m.start_job("private-guard", "echo hi", env={"TOKEN": "t"})
            assert job.wait(timeout=60).state_text == "exited 0"
            time.sleep(2)  # a few polls: the guard rewrites its state file
            m.budget.cancel_guard(ledger=ledger)
        finally:
            m.close()
            server.stop()
    finally:
        os.umask(old_umask)
    state = Path(server.env["HOME"]) / ".gpumagic"
    assert (state / "guard" / "log").exists() and (state / "jobs" / "private-guard" / "env.sh").exists()
    wrong = {str(p): oct(stat.S_IMODE(p.lstat().st_mode)) for p in walk(state)
             if stat.S_IMODE(p.lstat().st_mode) != (0o700 if p.is_dir() else 0o600)}
    assert wrong == {}
    assert stat.S_IMODE((tmp_path / "ledger.json").stat().st_mode) == 0o600


def test_private_dir_only_takes_bits_away_and_leaves_a_read_only_directory_read_only(tmp_path):
    from gpumagic._fs import private_dir

    opened, read_only = tmp_path / "opened", tmp_path / "read-only"
    opened.mkdir()
    opened.chmod(0o755)  # what an older gpumagic made: tightened
    read_only.mkdir()
    read_only.chmod(0o555)  # what the user made read-only: still without the owner's w
    try:
        private_dir(opened)
        private_dir(read_only)
        assert stat.S_IMODE(opened.stat().st_mode) == 0o700
        assert stat.S_IMODE(read_only.stat().st_mode) == 0o500
        assert stat.S_IMODE(private_dir(tmp_path / "new" / "dir").stat().st_mode) == 0o700
    finally:
        read_only.chmod(0o700)
