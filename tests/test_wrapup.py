"""``%gpu wrapup`` on a real sshd whose temporary folder ($TMPDIR) is a test folder."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

import gpumagic
from gpumagic import wrapup

from conftest import add_client_entry, make_server

HOUR_AGO = time.time() - 3600


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wrapup-tmp")
    s = make_server("wrapgpu", env={"TMPDIR": str(tmp)})
    s.tmp = tmp
    s.home = s.dir / "home"
    add_client_entry(s, "wrapgpu")
    yield s
    s.stop()


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUMAGIC_DATA_DIR", str(tmp_path / "data"))


def _write(path: Path, size: int, mtime: float | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


@pytest.fixture
def caches(server):
    """Caches of known sizes in the remote home and $TMPDIR, next to files that are not caches."""
    h, t = server.home, server.tmp
    made = {
        "pip": _write(h / ".cache/pip/http/wheel.bin", 1000),
        "hf": _write(h / ".cache/huggingface/hub/model.bin", 5000),
        "pycache": _write(h / "project/__pycache__/train.cpython-311.pyc", 300),
        "vscode-old": _write(h / ".vscode-server/bin/aaaa/server.js", 200),
        "tmp-old": _write(t / "old-build/obj.o", 700, HOUR_AGO),
    }
    os.utime(h / ".vscode-server/bin/aaaa", (HOUR_AGO, HOUR_AGO))
    os.utime(t / "old-build", (HOUR_AGO, HOUR_AGO))
    keep = [
        _write(h / ".vscode-server/bin/bbbb/server.js", 100),   # the newest VS Code server
        _write(h / "project/train.py", 50),
        _write(h / "data/keep.bin", 4000),
        _write(h / ".config/app/settings.json", 10),
        _write(t / "in-use.tmp", 10),                            # changed just now: left alone
        _write(t / "tmux-0/default", 5, HOUR_AGO),               # tmux's socket folder
        # gpumagic's own state: its sync agent's bytecode, in this home and in a sandbox's
        _write(h / ".gpumagic/__pycache__/sync_agent_0.cpython-311.pyc", 20),
        _write(h / ".local/share/gpumagic/sandbox-home/.gpumagic/__pycache__/sync_agent_0.cpython-311.pyc", 30),
    ]
    yield made, keep
    import shutil

    keep[-2].unlink()
    for p in (h / ".cache", h / "project", h / ".vscode-server", h / "data", h / ".config", h / ".local"):
        shutil.rmtree(p, ignore_errors=True)
    for p in t.iterdir():
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()


def _run(ip, line):
    with capture_output() as cap:
        ip.run_line_magic("gpu", line)
    return cap.stdout + "".join(o.data.get("text/plain", "") + "\n" for o in cap.outputs)  # each on lines of its own


def test_two_new_result_files_are_listed_and_pulled(ip, server, tmp_path, data_dir):
    runs = server.home / "runs"
    _write(runs / "metrics.csv", 20)
    ip.run_line_magic("gpu", "connect wrapgpu")
    local = tmp_path / "results"
    ip._gpumagic.fleet.get().pull(f"{runs}/", f"{local}/")  # pulled once before
    _write(runs / "ckpt/last.pt", 3000)
    _write(runs / "log.txt", 40)
    out = _run(ip, f"wrapup --pull :{runs}/ {local}/")
    assert f"results :{runs}/ -> {local}/: 2 not pulled yet; pulled 2 files (3.0 KiB)" in out
    assert "  ckpt/last.pt\n" in out and "  log.txt\n" in out and "metrics.csv" not in out
    assert (local / "ckpt/last.pt").stat().st_size == 3000 and (local / "log.txt").read_text(encoding="utf-8") == "x" * 40
    # the folders are remembered for this machine
    out = _run(ip, "wrapup")
    assert f"results :{runs}/ -> {local}/: everything is already here (every file, by size and content)" in out


def test_caches_are_listed_with_their_sizes(server, caches, data_dir):
    m = gpumagic.connect("wrapgpu")
    try:
        r = wrapup.wrapup(m)
    finally:
        m.close()
    sizes = {c.label: c.bytes for c in r.caches}
    assert sizes == {"~/.cache/huggingface": 5000, "~/.cache/pip": 1000,
                     f"temporary files in {server.tmp} (yours, unchanged for 10 min)": 700,
                     "__pycache__ folders (1)": 300, "old VS Code server versions (1)": 200}
    assert all(c.cleanable for c in r.caches)
    text = wrapup.report_text(r)
    assert "caches an image would carry: 7.0 KiB; `%gpu wrapup --clean` removes them" in text
    assert "     4.9 KiB  ~/.cache/huggingface" in text and "     200 B  old VS Code server versions (1)" in text
    assert "an image of / would hold about" in text and "%gpu budget set --image-rate-month" in text


def test_clean_removes_only_the_caches_after_one_confirmation(ip, server, caches, monkeypatch, data_dir):
    made, keep = caches
    ip.run_line_magic("gpu", "connect wrapgpu")
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "n")
    out = _run(ip, "wrapup --clean")
    assert len(asked) == 1 and "nothing removed: the confirmation was not given" in out
    assert all(p.exists() for p in made.values())
    prompt = asked[0]
    assert prompt.startswith("remove these caches (nothing else is touched)?")
    for label in ("~/.cache/huggingface", "~/.cache/pip", "__pycache__ folders (1)", "old VS Code server versions"):
        assert label in prompt
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "y")
    out = _run(ip, "wrapup --clean")
    assert len(asked) == 2
    assert "cleaned 5 caches, 7.0 KiB freed:" in out
    assert "caches an image would carry: 0 B\n" in out  # listed again after cleaning
    assert not any(p.exists() for p in made.values())
    assert all(p.exists() for p in keep), [p for p in keep if not p.exists()]
    assert (server.home / ".cache").is_dir() and (server.home / "project").is_dir()
    # --yes skips the question; nothing is left to remove
    out = _run(ip, "wrapup --clean --yes")
    assert len(asked) == 2 and "caches an image would carry: 0 B" in out


def test_a_running_job_is_named(ip, server, data_dir):
    ip.run_line_magic("gpu", "connect wrapgpu")
    m = ip._gpumagic.fleet.get()
    job = m.start_job("wrapup-sleeper", "echo training epoch 3; sleep 120")
    try:
        out = _run(ip, "wrapup")
        assert "still running:\n  job wrapup-sleeper is running (training epoch 3)" in out
        assert "no shutdown is armed" in out
    finally:
        job.kill()
    job.wait(timeout=30)  # the runner writes exit_code once the tree is gone
    out = _run(ip, "wrapup")
    assert "wrapup-sleeper" not in out  # (this test machine is this computer: other kernels may run)


def test_sandbox_never_touches_this_computers_temporary_folder(data_dir):
    m = gpumagic.connect(sandbox=True)
    try:
        r = wrapup.wrapup(m)
    finally:
        m.close()
    tmp = [c for c in r.caches if c.id == "tmp"]
    assert tmp and not tmp[0].cleanable and tmp[0].note == "not looked at: this machine is your own computer"


def test_wrapup_arguments(ip, server):
    ip.run_line_magic("gpu", "connect wrapgpu")
    with pytest.raises(UsageError, match="machine's folder first"):
        ip.run_line_magic("gpu", "wrapup --pull ./runs/ :runs/")
    with pytest.raises(UsageError, match="--yes only applies to --clean"):
        ip.run_line_magic("gpu", "wrapup --yes")
    with pytest.raises(UsageError, match="names machine 'other'"):
        ip.run_line_magic("gpu", "wrapup --pull other:runs/ ./runs/")
