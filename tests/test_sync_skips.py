"""%gpu sync leaves out what it cannot read, as rsync does, and sends the rest.

rsync is the judge, in the same test and on the same tree: ``rsync -a`` skips a source file it
cannot open, sends everything else and exits 23 (unreadable) or 24 ("file has vanished").
Its failures are made with a small LD_PRELOAD shim that fails its ``open`` of one name with
one errno (built here with the C compiler; rsync's half is skipped without one); ours with a
hook on the local read that counts its events (no sleeps, no timing).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import wait_until
from gpumagic.errors import SyncError, SyncIncomplete
from gpumagic.sync import agent
from gpumagic.sync import engine as sync

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
static int hit(const char *p, int flags) {
    const char *name = getenv("FAIL_OPEN_NAME"), *b = strrchr(p, '/');
    b = b ? b + 1 : p;
    return name && !(flags & (O_PATH | O_DIRECTORY)) && strcmp(b, name) == 0;
}
static int code(void) { const char *e = getenv("FAIL_OPEN_ERRNO"); return e ? atoi(e) : ENOENT; }
int openat(int d, const char *p, int flags, ...) {
    static int (*real)(int, const char *, int, ...);
    va_list ap; va_start(ap, flags); int mode = va_arg(ap, int); va_end(ap);
    if (hit(p, flags)) { errno = code(); return -1; }
    if (!real) real = dlsym(RTLD_NEXT, "openat");
    return real(d, p, flags, mode);
}
int open(const char *p, int flags, ...) {
    static int (*real)(const char *, int, ...);
    va_list ap; va_start(ap, flags); int mode = va_arg(ap, int); va_end(ap);
    if (hit(p, flags)) { errno = code(); return -1; }
    if (!real) real = dlsym(RTLD_NEXT, "open");
    return real(p, flags, mode);
}
int open64(const char *p, int f, ...) { va_list ap; va_start(ap, f); int m = va_arg(ap, int); va_end(ap); return open(p, f, m); }
int openat64(int d, const char *p, int f, ...) { va_list ap; va_start(ap, f); int m = va_arg(ap, int); va_end(ap); return openat(d, p, f, m); }
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> Path | None:
    """The LD_PRELOAD shim for rsync, or None where no C compiler is found."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or shutil.which("rsync") is None:
        return None
    d = tmp_path_factory.mktemp("shim")
    (d / "fail.c").write_text(SHIM, encoding="utf-8")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "fail.so"), str(d / "fail.c"), "-ldl"], check=True)
    return d / "fail.so"


def _rsync(src: Path, dst: Path, shim: Path | None = None, name: str = "", code: int = 0, *extra: str):
    """``rsync -a SRC/ DST/`` (its open of ``name`` failing with ``code`` through the shim):
    (exit status, stdout + stderr)."""
    env = dict(os.environ)
    if shim is not None:
        env.update(LD_PRELOAD=str(shim), FAIL_OPEN_NAME=name, FAIL_OPEN_ERRNO=str(code))
    p = subprocess.run(["rsync", "-a", *extra, f"{src}/", f"{dst}/"], env=env, capture_output=True,
                       encoding="utf-8", errors="replace")
    return p.returncode, p.stdout + p.stderr


def _tree(root: Path, extra: dict[str, str]) -> Path:
    """The issue's ``src/``: a.txt, b.txt, sub/c.txt, and ``extra``."""
    for rel, text in {"a.txt": "alpha\n", "b.txt": "beta\n", "sub/c.txt": "gamma\n", **extra}.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    return root


def _files(root: Path) -> dict[str, bytes]:
    """Every entry under ``root``: file -> content, folder -> b"/" (part files included: none
    may be left under a final name, and none is expected at all)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        out[rel] = b"/" if p.is_dir() else p.read_bytes()
    return out


def _no_parts(root: Path) -> bool:
    return not any(p.name.endswith(agent.PART_SUFFIX) for p in root.rglob("*"))


def _failing_open(monkeypatch, name: str, before=None, code: int | None = None) -> list[str]:
    """Make this process's ``os.open`` of files called ``name`` first run ``before(path)`` (a
    real change to the file: unlink, truncate, replace) or fail with ``code``; returns the
    list of paths it was called for (the events, counted)."""
    real = os.open
    seen: list[str] = []

    def fake(path, flags, *args, **kw):
        if os.path.basename(os.fsdecode(path)) == name and not flags & os.O_WRONLY:
            seen.append(os.fsdecode(path))
            if code is not None:
                raise OSError(code, os.strerror(code), os.fsdecode(path))
            before(os.fsdecode(path))
        return real(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", fake)
    return seen


# -- item 1: an unreadable source file (rsync's 23) --------------------------------------------


def _check_incomplete(exc: SyncIncomplete, where: str, path: str) -> None:
    text = str(exc)
    assert len(exc.message.splitlines()) == 1
    assert f"could not read a source file or folder on {where}, not synced: {path} (Permission denied)" in text
    assert "everything else was synced" in text
    assert "sync into a directory you own" not in text  # that hint is about a destination


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root reads a mode-000 file; scripts/test-as-user.sh runs this as a plain user "
                           "(test_push_skips_a_file_whose_read_fails_with_eacces covers root)")
def test_push_sends_the_rest_of_a_tree_with_a_mode_000_file_and_fails_as_rsync_23(machine, tmp_path):
    src = _tree(tmp_path / "src", {"secret.txt": "hidden\n"})
    (src / "secret.txt").chmod(0)
    judge = tmp_path / "judge"
    judge.mkdir()
    rc, err = _rsync(src, judge)
    assert rc == 23 and "secret.txt" in err
    remote = tmp_path / "remote"
    with pytest.raises(SyncIncomplete) as e:
        machine.push(f"{src}/", str(remote))
    _check_incomplete(e.value, "this computer", str(src / "secret.txt"))
    assert e.value.summary.unreadable == {"secret.txt": "Permission denied"}
    assert e.value.summary.files_sent == 3
    assert _files(remote) == _files(judge) and "secret.txt" not in _files(remote)


def test_push_skips_a_file_whose_read_fails_with_eacces_and_fails_as_rsync_23(machine, tmp_path, shim,
                                                                               monkeypatch):
    """As root too: the read of secret.txt fails with EACCES (the shim for rsync, a hook here)."""
    src = _tree(tmp_path / "src", {"secret.txt": "hidden\n"})
    judge = tmp_path / "judge"
    judge.mkdir()
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "a.txt").write_text("old\n", encoding="utf-8")  # a destination to compare with
    (judge / "a.txt").write_text("old\n", encoding="utf-8")
    if shim is not None:
        rc, err = _rsync(src, judge, shim, "secret.txt", errno.EACCES)
        assert rc == 23 and 'failed to open "' in err and "Permission denied (13)" in err
    seen = _failing_open(monkeypatch, "secret.txt", code=errno.EACCES)
    with pytest.raises(SyncIncomplete) as e:
        machine.push(f"{src}/", str(remote))
    monkeypatch.undo()
    assert seen == [str(src / "secret.txt")]
    _check_incomplete(e.value, "this computer", str(src / "secret.txt"))
    assert e.value.summary.files_sent == 3
    want = {"a.txt": b"alpha\n", "b.txt": b"beta\n", "sub": b"/", "sub/c.txt": b"gamma\n"}
    assert _files(remote) == want
    if shim is not None:
        assert _files(judge) == want


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root reads a mode-000 file; scripts/test-as-user.sh runs this as a plain user")
def test_pull_of_a_tree_with_a_mode_000_file_names_the_machine_and_pulls_the_rest_as_rsync_23(machine, tmp_path):
    remote = _tree(tmp_path / "remote", {"secret.txt": "hidden\n"})
    (remote / "secret.txt").chmod(0)
    judge = tmp_path / "judge"
    judge.mkdir()
    rc, err = _rsync(remote, judge)
    assert rc == 23 and "secret.txt" in err
    here = tmp_path / "here"
    with pytest.raises(SyncIncomplete) as e:
        machine.pull(f"{remote}/", str(here))
    _check_incomplete(e.value, machine.name, f"{remote}/secret.txt")
    assert _files(here) == _files(judge) and _no_parts(here)


def test_pull_of_a_tree_whose_file_became_a_folder_names_the_machine_and_pulls_the_rest(machine, tmp_path,
                                                                                       monkeypatch):
    """The machine's side, as root too: secret.txt is a folder by the time its agent reads it
    (made so by a hook before the ``send`` command)."""
    remote = _tree(tmp_path / "remote", {"secret.txt": "hidden\n"})
    real = sync.RemoteSide.supply
    calls = []

    def supply(side, small, level):
        calls.append([e.path for e in small])
        (remote / "secret.txt").unlink()
        (remote / "secret.txt").mkdir()  # open() there: EISDIR, whoever runs it
        return real(side, small, level)

    monkeypatch.setattr(sync.RemoteSide, "supply", supply)
    here = tmp_path / "here"
    with pytest.raises(SyncIncomplete) as e:
        machine.pull(f"{remote}/", str(here))
    assert calls == [["a.txt", "b.txt", "secret.txt", "sub/c.txt"]]
    assert e.value.message.startswith(f"pull incomplete: could not read a source file or folder on "
                                      f"{machine.name}, not synced: {remote}/secret.txt (")
    assert "sync into a directory you own" not in str(e.value)
    assert _files(here) == {"a.txt": b"alpha\n", "b.txt": b"beta\n", "sub": b"/", "sub/c.txt": b"gamma\n"}


def test_the_sync_magic_prints_the_summary_then_raises_so_run_all_stops(ip, tmp_path, monkeypatch, capsys):
    src = _tree(tmp_path / "src", {"secret.txt": "hidden\n"})
    ip.run_line_magic("gpu", "connect testgpu")
    _failing_open(monkeypatch, "secret.txt", code=errno.EACCES)
    with pytest.raises(SyncIncomplete):
        ip.run_line_magic("gpu", f"sync {src}/ :{tmp_path / 'remote'}")
    out = capsys.readouterr().out
    assert "could not read, not synced (1):\n  secret.txt: Permission denied" in out
    assert (tmp_path / "remote" / "sub" / "c.txt").read_text(encoding="utf-8") == "gamma\n"


# -- item 2: a file that vanishes between the listing and its read (rsync's 24) ---------------


@pytest.mark.parametrize("dest", ["empty", "holding a.txt"])
def test_a_file_vanishing_before_its_read_is_skipped_with_a_warning_as_rsync_24(machine, tmp_path, shim,
                                                                                 monkeypatch, dest):
    src = _tree(tmp_path / "src", {"m.tmp": "scratch\n", "z.txt": "zeta\n"})
    remote, judge = tmp_path / "remote", tmp_path / "judge"
    for d in (remote, judge):
        d.mkdir()
        if dest != "empty":
            (d / "a.txt").write_text("old\n", encoding="utf-8")
    if shim is not None:
        rc, err = _rsync(src, judge, shim, "m.tmp", errno.ENOENT)
        assert rc == 24 and f'file has vanished: "{src}/m.tmp"' in err
    seen = _failing_open(monkeypatch, "m.tmp", before=os.unlink)  # listed, then gone when read
    summary = machine.push(f"{src}/", str(remote))
    monkeypatch.undo()
    assert seen == [str(src / "m.tmp")]
    assert summary.vanished == {"m.tmp": "No such file or directory"} and not summary.unreadable
    assert summary.files_sent == 4
    assert "file has vanished, not synced (1):\n  m.tmp" in str(summary)
    want = {"a.txt": b"alpha\n", "b.txt": b"beta\n", "sub": b"/", "sub/c.txt": b"gamma\n", "z.txt": b"zeta\n"}
    assert _files(remote) == want
    if shim is not None:
        assert _files(judge) == want


def test_a_large_file_vanishing_before_its_read_is_skipped_with_a_warning(machine, tmp_path, monkeypatch):
    monkeypatch.setattr(sync, "LARGE_FILE", 1024)  # its own channel
    src = _tree(tmp_path / "src", {"big.bin": "x" * 4096})
    real = sync._open_source
    seen = []

    def open_source(path):
        seen.append(path)
        os.unlink(path)
        return real(path)

    monkeypatch.setattr(sync, "_open_source", open_source)
    summary = machine.push(f"{src}/", str(tmp_path / "remote"))
    assert seen == [str(src / "big.bin")]
    assert summary.vanished == {"big.bin": "No such file or directory"}
    assert set(_files(tmp_path / "remote")) == {"a.txt", "b.txt", "sub", "sub/c.txt"}


@pytest.mark.parametrize("large", [False, True])
def test_pull_of_a_file_vanishing_on_the_machine_before_its_read_warns_and_pulls_the_rest(
        machine, tmp_path, shim, monkeypatch, large):
    remote = _tree(tmp_path / "remote", {"m.tmp": "scratch\n" * 512})
    if large:
        monkeypatch.setattr(sync, "LARGE_FILE", 1024)
    judge = tmp_path / "judge"
    judge.mkdir()
    if shim is not None:  # rsync's sender is the local process here too
        rc, err = _rsync(remote, judge, shim, "m.tmp", errno.ENOENT)
        assert rc == 24 and "file has vanished" in err
    # (the large file's get, or the small files' send)
    side, step = (sync.LocalSide, "write_large") if large else (sync.RemoteSide, "supply")
    real = getattr(side, step)
    calls = []

    def gone_first(*args, **kw):
        calls.append(step)
        if (remote / "m.tmp").exists():
            (remote / "m.tmp").unlink()
        return real(*args, **kw)

    monkeypatch.setattr(side, step, gone_first)
    here = tmp_path / "here"
    summary = machine.pull(f"{remote}/", str(here))
    assert calls == [step]
    assert summary.vanished == {"m.tmp": "No such file or directory"} and not summary.unreadable
    want = {"a.txt": b"alpha\n", "b.txt": b"beta\n", "sub": b"/", "sub/c.txt": b"gamma\n"}
    assert _files(here) == want and _no_parts(here)
    if shim is not None:
        assert _files(judge) == want


# -- a file replaced by a folder, or truncated while it is read: never torn -------------------


def test_a_file_replaced_by_a_folder_after_the_listing_is_left_out_never_sent(machine, tmp_path, monkeypatch):
    src = _tree(tmp_path / "src", {"w.txt": "was a file\n"})

    def to_folder(path):
        os.unlink(path)
        os.mkdir(path)

    seen = _failing_open(monkeypatch, "w.txt", before=to_folder)
    remote = tmp_path / "remote"
    with pytest.raises(SyncIncomplete) as e:
        machine.push(f"{src}/", str(remote))
    monkeypatch.undo()
    assert seen == [str(src / "w.txt")]
    assert e.value.summary.unreadable == {"w.txt": "became a folder after it was listed"}
    assert not (remote / "w.txt").exists() and (remote / "sub" / "c.txt").exists() and _no_parts(remote)


def test_a_small_file_truncated_while_it_is_read_is_never_sent_torn(machine, tmp_path, monkeypatch):
    src = _tree(tmp_path / "src", {"log.txt": "0123456789" * 100})
    seen = _failing_open(monkeypatch, "log.txt", before=lambda p: os.truncate(p, 300))
    remote = tmp_path / "remote"
    with pytest.raises(SyncIncomplete) as e:
        machine.push(f"{src}/", str(remote))
    monkeypatch.undo()
    assert seen == [str(src / "log.txt")]
    assert e.value.summary.unreadable == {"log.txt": "shrank from 1000 to 300 bytes while it was read"}
    assert not (remote / "log.txt").exists() and (remote / "b.txt").exists() and _no_parts(remote)


def test_a_large_file_truncated_while_it_is_sent_is_never_renamed_into_place(machine, tmp_path, monkeypatch):
    monkeypatch.setattr(sync, "LARGE_FILE", 1024)
    src = _tree(tmp_path / "src", {})
    big = src / "big.bin"
    big.write_bytes(os.urandom(3 << 20))
    real = sync._open_source
    reads = []

    class Shrinking:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            b = self.f.read(n)
            reads.append(len(b))
            if len(reads) == 1:
                os.truncate(big, (1 << 20) + 10)  # after the first MiB
            return b

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(sync, "_open_source", lambda path: Shrinking(real(path)))
    remote = tmp_path / "remote"
    with pytest.raises(SyncIncomplete) as e:
        machine.push(f"{src}/", str(remote))
    assert reads == [1 << 20, 10, 0]
    assert e.value.summary.unreadable == {"big.bin": f"shrank from {3 << 20} to {(1 << 20) + 10} bytes while it was read"}
    assert not (remote / "big.bin").exists() and (remote / "a.txt").exists()


# -- item 7: device files and sockets as sources ------------------------------------------------


def test_pushing_dev_null_is_one_clear_error(machine, tmp_path):
    with pytest.raises(SyncError) as e:
        machine.push("/dev/null", str(tmp_path / "remote"))
    assert e.value.message.startswith("/dev/null on this computer is a character device, not a file or folder")
    assert not (tmp_path / "remote").exists()


def test_pulling_dev_null_is_one_clear_error(machine, tmp_path):
    with pytest.raises(SyncError) as e:
        machine.pull("/dev/null", str(tmp_path / "here"))
    assert e.value.message.startswith(f"/dev/null on {machine.name} is a character device, not a file or folder")


def test_a_socket_in_a_pushed_tree_is_skipped_as_rsync_skips_specials(machine, tmp_path, shim):
    src = _tree(tmp_path / "src", {})
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(src / "sub" / "app.sock"))
        judge = tmp_path / "judge"
        judge.mkdir()
        # -a is -rlptgoD; without -D (--devices --specials) rsync skips them, as gpumagic does
        rc, out = _rsync(src, judge, None, "", 0, "--no-D", "-v")
        assert rc == 0 and 'skipping non-regular file "sub/app.sock"' in out
        summary = machine.push(f"{src}/", str(tmp_path / "remote"))
        assert summary.specials == {"sub/app.sock": "socket"}
        assert "skipping non-regular file (1):\n  sub/app.sock (socket)" in str(summary)
        assert _files(tmp_path / "remote") == _files(judge)
        again = machine.push(f"{src}/", str(tmp_path / "remote"))
        assert again.files_sent == 0 and again.specials == {"sub/app.sock": "socket"}
        with pytest.raises(SyncError) as e:
            machine.push(str(src / "sub" / "app.sock"), str(tmp_path / "remote2"))
        assert " on this computer is a socket, not a file or folder" in e.value.message
    finally:
        s.close()


# -- a whole file system as a side (issue 31, item 9) ----------------------------------------


def test_whole_file_system_names_the_side_that_is_a_root(machine, tmp_path):
    src = tmp_path / "proj"
    src.mkdir()
    whole = sync.whole_file_system
    assert whole("push", machine, f"{src}/", "/") == ("destination", "the machine's /")
    assert whole("push", machine, f"{src}/", "//") == ("destination", "the machine's /")
    assert whole("push", machine, str(src), "/") is None  # lands in /proj
    assert whole("push", machine, f"{src}/", "/data") is None
    assert whole("push", machine, "/", "/data") == ("source", "this computer's /")
    assert whole("pull", machine, "/", str(tmp_path)) == ("source", "the machine's /")
    assert whole("pull", machine, "/data/", "/") == ("destination", "this computer's /")
    assert whole("pull", machine, "/data", "/") is None  # lands in /data
    assert whole("pull", machine, "/etc/", str(tmp_path)) is None


def test_delete_into_the_machines_root_is_refused_before_anything_starts(machine, tmp_path, monkeypatch):
    src = tmp_path / "proj"
    src.mkdir()
    (src / "a.txt").write_text("a", encoding="utf-8")
    opened = []
    monkeypatch.setattr(sync, "open_listing", lambda *a, **k: opened.append(a))
    with pytest.raises(SyncError, match=r"^--delete into the machine's / would delete everything there"):
        machine.push(f"{src}/", "/", delete=True)
    with pytest.raises(SyncError, match=r"^--delete into this computer's / would delete"):
        machine.pull("/data/", "/", delete=True)
    assert opened == []


def _serving(root: str) -> list[int]:
    """PIDs of sync agents serving a listing of ``root`` (``python3 -I -S -c SOURCE serve NONCE ROOT ...``)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) > 7 and argv[3:4] == [b"-c"] and argv[5] == b"serve" and argv[7] == root.encode():
            found.append(int(proc.name))
    return found


def test_a_dry_run_into_the_machines_root_warns_and_ctrl_c_stops_both_sides(ip, machine, tmp_path, capsys):
    src = tmp_path / "proj"
    src.mkdir()
    (src / "a.txt").write_text("a", encoding="utf-8")
    ip.run_line_magic("gpu", "connect testgpu")
    capsys.readouterr()
    seen: list[list[str]] = []

    def interrupt():
        seen.append(_serving("/"))  # the machine's walk of / is under way
        os.kill(os.getpid(), signal.SIGINT)

    threading.Timer(1.5, interrupt).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        ip.run_line_magic("gpu", f"sync {src}/ :/ --dry-run")
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert err.startswith("warning: the destination is the machine's /: the whole file system is walked"), err
    if not seen or not seen[0]:
        pytest.skip("the machine listed / in under 1.5 s: nothing was left to stop")
    assert took < 3
    assert wait_until(lambda: _serving("/") == [], 5), _serving("/")  # its walk stopped too


# -- progress while the machine walks a large tree (issue 31, item 9) -------------------------


def _folders(root: Path, folders: int) -> None:
    for i in range(folders):
        (root / f"d{i:04d}").mkdir(parents=True)
        (root / f"d{i:04d}" / "f.txt").write_bytes(b"x")


def test_the_agents_walk_reports_its_count_each_interval_and_a_short_walk_reports_none(tmp_path, monkeypatch):
    import io

    _folders(tmp_path / "t", 200)  # 201 folders with the root: asked at the 64th, 128th and 192nd
    err = io.BytesIO()
    sink: list = []
    agent.list_tree(str(tmp_path / "t"), out=sink, gone=agent.WalkWatch(lambda: len(sink), err))
    assert err.getvalue() == b""  # it took under LISTED_EVERY: nothing said
    monkeypatch.setattr(agent, "LISTED_EVERY", 0.0)
    err, sink = io.BytesIO(), []
    agent.list_tree(str(tmp_path / "t"), out=sink, gone=agent.WalkWatch(lambda: len(sink), err))
    counts = [int(line[len(agent.LISTED_TAG):]) for line in err.getvalue().splitlines()]
    assert err.getvalue().count(agent.LISTED_TAG) == 3 and counts == sorted(counts) and counts[0] > 0
    assert counts[-1] < len(sink) == 401


def test_a_dry_run_over_a_large_tree_on_the_machine_shows_the_walk_and_then_its_whole_count(
        machine, tmp_path, monkeypatch):
    src, dst = tmp_path / "proj", tmp_path / "big"
    src.mkdir()
    (src / "a.txt").write_text("a", encoding="utf-8")
    _folders(dst, 300)
    # a record every 64 folders instead of every second: the walk of 301 folders says 4
    chatty = sync.AGENT_SOURCE.replace("LISTED_EVERY = 1.0", "LISTED_EVERY = 0.0")
    assert chatty != sync.AGENT_SOURCE
    monkeypatch.setattr(sync, "AGENT_SOURCE", chatty)
    seen: list[tuple[str, int, bool]] = []
    s = machine.push(f"{src}/", str(dst), dry_run=True,
                     progress=lambda p: seen.append((p.listing, p.listed, p.finished)))
    assert s.would_send == ["a.txt"]
    where = f"testgpu:{dst}"
    walking = [n for w, n, done in seen if not done]
    assert seen and all(w == where for w, _, _ in seen)
    assert walking and walking == sorted(set(walking)) and walking[-1] <= 601
    assert seen[-1] == (where, 601, True)  # 300 folders, 300 files and the root
    assert sum(done for _, _, done in seen) == 1


def test_a_short_dry_run_reports_no_listing_and_its_magic_draws_no_bar(ip, machine, tmp_path, capsys):
    src, dst = tmp_path / "proj", tmp_path / "small"
    src.mkdir()
    (src / "a.txt").write_text("a", encoding="utf-8")
    _folders(dst, 3)
    seen: list = []
    machine.push(f"{src}/", str(dst), dry_run=True, progress=seen.append)
    assert seen == []
    ip.run_line_magic("gpu", "connect testgpu")
    capsys.readouterr()
    ip.run_line_magic("gpu", f"sync {src}/ :{dst} --dry-run")
    out = capsys.readouterr()
    assert "sync:" not in out.err and "listing" not in out.err and "would send 1 file" in out.out


def test_the_listing_reads_as_one_line_while_it_goes_and_when_it_is_whole():
    from gpumagic.notebook import display

    p = sync.SyncProgress(0, 0, counting=True, listing="testgpu:/", listed=48213)
    p.started -= 12
    assert display.sync_bar_text(p) == "sync: listing testgpu:/: 48,213 entries so far (12 s)"
    p.finished, p.counting = True, False
    assert display.sync_bar_text(p) == "sync: listed 48,213 entries of testgpu:/ in 12 s"
    assert display.sync_bar_html(p) == "<div>sync: listed 48,213 entries of testgpu:/ in 12 s</div>"
