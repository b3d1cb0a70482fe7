"""The set-up scripts (issue 31, item 10): the quickstart installs only what the main job needs
(the sandbox's sshd, ssh, rsync, tmux, a venv, and the package with its [notebook] extra); the
tools only the tests use stay with scripts/test.sh.  Read off what scripts/_packages.sh asks for
on a machine that has none of them (an empty PATH, as a plain user: it prints the list)."""

from __future__ import annotations

import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEST_ONLY = {"git", "curl", "fish", "tcsh", "zsh", "shellcheck", "fuse3", "chromium"}


def missing(for_: str, tmp_path) -> set[str]:
    empty = tmp_path / "bin"
    empty.mkdir(exist_ok=True)
    (empty / "id").write_text("#!/bin/sh\necho 1000\n", encoding="utf-8")  # a plain user
    (empty / "id").chmod(0o755)
    r = subprocess.run(["/bin/bash", "-c", f"source {ROOT}/scripts/_packages.sh"], capture_output=True,
                       text=True, encoding="utf-8", env={"PATH": str(empty), "GPUMAGIC_FOR": for_})
    assert r.returncode == 1, r.stderr
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("gpumagic: missing "))
    return set(line.removeprefix("gpumagic: missing ").split(";")[0].split())


def test_quickstart_asks_only_for_what_the_main_job_needs(tmp_path):
    got = missing("main", tmp_path)
    assert {"openssh-client", "rsync", "tmux", "python3", "python3-venv"} <= got
    assert not got & TEST_ONLY, got & TEST_ONLY


def test_tests_ask_for_their_own_tools_too(tmp_path):
    got = missing("test", tmp_path)
    assert {"openssh-client", "rsync", "tmux", "git", "curl"} <= got

