"""%gpu sync: pure plan (paths, ignore rules, listings, diff) and real transfers over sshd."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path

import pytest

from gpumagic.sync import engine as sync
from gpumagic.sync import agent as agent
from gpumagic.errors import ConnectionLost, SyncDiskFull, SyncError, SyncPermissionDenied
from gpumagic.sync import plan as sync_plan
from gpumagic.sync.ignore import IgnoreRules
from gpumagic.sync.plan import Entry, make_plan, parse_endpoint

# `python -c 'list_tree(...)'` output of the agent for a small tree (recorded): a root dir,
# a symlink to ".", a .gitignore (with its text), a dir, an executable, a name with a space,
# and a partial transfer ".big.bin.gpumagic-part" of 3 bytes.
RECORDED_LISTING = (
    b'd\x00.\x000\x001767323045123456789\x00755\x00\x00\x00l\x00self\x001\x001795995579908014744'
    b'\x000\x00.\x00\x00f\x00.gitignore\x007\x001767323045123456789\x00644\x00\x0073bb41afa1d24a'
    b'26dd5cdade54c3e2547aefcfdb4d8809406ca8015bef68e4ec\x00i\x00.gitignore\x000\x000\x000\x00*.'
    b'ckpt\n\x00\x00d\x00sub\x000\x001767323045123456789\x00755\x00\x00\x00f\x00train.py\x009\x00'
    b'1767323045123456789\x00755\x00\x00cc42155088fca5730758db72b2a5bca33112a941dfaa2d43098ec422'
    b'ce4ea213\x00f\x00sub/a b.txt\x001\x001767323045123456789\x00644\x00\x002d711642b726b04401'
    b'627ca9fbac32f5c8530fb1903cc4db02258717921a4881\x00p\x00sub/big.bin\x003\x000\x000\x00\x00\x00'
)


# -- pure: paths -------------------------------------------------------------------------


def test_transfer_reads_which_side_is_the_machine_and_which_machine():
    from gpumagic.errors import ConfigError
    from gpumagic.sync.plan import Endpoint, Transfer, transfer

    assert transfer("./project/", ":/ws/project/") == Transfer(Endpoint("./project/"), Endpoint("/ws/project/", ""))
    assert not transfer("a", ":b").pull and transfer(":b", "a").pull
    assert transfer("gpu2:runs/", "runs/").host == "gpu2"
    assert transfer("gpu2:runs/", "runs/", host="gpu2").host == "gpu2"
    assert transfer(":runs/", "runs/", host="gpu3").host == "gpu3"
    assert transfer(":runs/", "runs/").host is None
    for src, dst in (("a", "b"), (":a", ":b"), ("g1:a", "g2:b")):
        with pytest.raises(ConfigError, match="^exactly one side must be remote: `%gpu sync"):
            transfer(src, dst)
    with pytest.raises(ConfigError) as e:
        transfer("a", "gpu2:b", host="gpu3")
    assert e.value.message == "gpu2:... and --host gpu3 name different machines; use one"
    with pytest.raises(ConfigError) as e:
        transfer("", ":b")
    assert e.value.message == "empty sync path"


def test_parse_endpoint_remote_default_named_and_local():
    assert parse_endpoint(":/ws") == sync_plan.Endpoint("/ws", "")
    assert parse_endpoint("gpu2:runs/") == sync_plan.Endpoint("runs/", "gpu2")
    assert parse_endpoint("gpu2:") == sync_plan.Endpoint(".", "gpu2")
    assert parse_endpoint("./a:b") == sync_plan.Endpoint("./a:b", None)
    assert parse_endpoint("data/x") == sync_plan.Endpoint("data/x", None)
    assert parse_endpoint("C:\\data", windows=True) == sync_plan.Endpoint("C:\\data", None)


def test_destination_root_follows_rsync_trailing_slash_rule():
    assert sync_plan.destination_root("source", "/ws") == "/ws/source"
    assert sync_plan.destination_root("source/", "/ws2") == "/ws2"
    assert sync_plan.destination_root("a/b/source", "/ws") == "/ws/source"
    assert sync_plan.destination_root(".", "/ws") == "/ws"
    assert sync_plan.destination_root("/", "/ws") == "/ws"


# -- pure: listings, ignore rules, plan ------------------------------------------------------


def test_parse_listing_reads_recorded_agent_output():
    lst = sync_plan.parse_listing(RECORDED_LISTING)
    assert lst.root == Entry(".", "d", 0, 1767323045123456789, 0o755)
    assert lst.entries["self"].kind == "l" and lst.entries["self"].target == "."
    assert lst.entries["train.py"].mode == 0o755 and lst.entries["train.py"].size == 9
    assert lst.entries["train.py"].mtime_s == 1767323045
    assert lst.entries["sub/a b.txt"].digest.startswith("2d711642")
    assert lst.ignore_texts == {".gitignore": "*.ckpt\n"}
    assert lst.partials == {"sub/big.bin": 3}
    assert "sub/.big.bin.gpumagic-part" not in lst.entries


def test_parse_listing_refuses_a_cut_listing():
    with pytest.raises(SyncError, match="cut short"):
        sync_plan.parse_listing(RECORDED_LISTING[:-20])


def test_ignore_rules_nested_files_negation_and_excludes():
    r = IgnoreRules(["*.log"])
    r.add_file(".gitignore", "*.ckpt\n__pycache__/\n/top.txt\n")
    r.add_file("sub/.gitignore", "!keep.ckpt\n")
    r.add_file(".gpuignore", "data/raw/\n")
    assert r.ignored("a.ckpt", False)
    assert r.ignored("sub/deep/b.ckpt", False)
    assert not r.ignored("sub/keep.ckpt", False)
    assert r.ignored("x/__pycache__", True) and not r.ignored("x/__pycache__", False)
    assert r.ignored("top.txt", False) and not r.ignored("sub/top.txt", False)
    assert r.ignored("data/raw", True) and not r.ignored("data", True)
    assert r.ignored("run.log", False)
    assert r.covers("data/raw/x.bin", False)
    off = IgnoreRules([], use_files=False)
    off.add_file(".gitignore", "*.ckpt\n")
    assert not off.ignored("a.ckpt", False)


def _f(path, size=1, mtime_s=100, mode=0o644, digest=""):
    return Entry(path, "f", size, mtime_s * 10**9, mode, "", digest)


def test_walk_local_is_the_agents_walk_with_ignored_dirs_never_entered(tmp_path, monkeypatch):
    root = tmp_path / "src"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text("a", encoding="utf-8")
    (root / "data" / "deep").mkdir(parents=True)
    (root / "data" / "deep" / "big.bin").write_bytes(b"x" * 10)
    (root / ".gitignore").write_text("data/\n", encoding="utf-8")
    (root / "link").symlink_to("pkg/a.py")
    (root / "pkg" / ".a.py.h-1-1.gpumagic-part").write_text("half", encoding="utf-8")
    entered = []
    real_scandir = os.scandir
    monkeypatch.setattr(agent.os, "scandir", lambda d: entered.append(d) or real_scandir(d))
    walked = sync_plan.walk_local(root, IgnoreRules(), digests=True)
    assert not any("data" in str(d) for d in entered)
    whole = sync_plan.parse_listing(b"".join(r + b"\0" for r in agent.list_tree(str(root), True)))
    assert walked.entries == {k: e for k, e in whole.entries.items() if not k.startswith("data")}
    assert sorted(walked.entries) == [".", ".gitignore", "link", "pkg", "pkg/a.py"]
    assert walked.partials == {} and walked.errors == {}


def test_plan_compares_size_and_mtime_to_the_second():
    src = {".": Entry(".", "d", 0, 5 * 10**9, 0o755), "same": _f("same"),
           "sub_second": Entry("sub_second", "f", 1, 100 * 10**9 + 5, 0o644),
           "grown": _f("grown", size=2), "touched": _f("touched", mtime_s=101),
           "new": _f("new"), "link": Entry("link", "l", target="same")}
    dst = {".": Entry(".", "d", 0, 5 * 10**9, 0o755), "same": _f("same"),
           "sub_second": _f("sub_second"), "grown": _f("grown"), "touched": _f("touched"),
           "link": Entry("link", "l", target="other"), "extra": _f("extra")}
    plan = make_plan(src, dst)
    assert sorted(e.path for e in plan.send) == ["grown", "new", "touched"]
    assert [e.path for e in plan.links] == ["link"]
    assert plan.unchanged == 2
    assert plan.delete == []
    assert [e.path for e in plan.dirs] == ["."]  # the root's mtime changes: restamped
    assert make_plan(src, dst, delete=True).delete == ["extra"]


def test_plan_update_checksum_and_type_change():
    src = {"a": _f("a", mtime_s=100, digest="h1"), "b": _f("b", mtime_s=100, digest="h2"),
           "d": _f("d")}
    dst = {"a": _f("a", mtime_s=200, digest="zz"), "b": _f("b", mtime_s=300, mode=0o600, digest="h2"),
           "d": Entry("d", "d", mode=0o755), "d/x": _f("d/x")}
    up = make_plan(src, dst, update=True)
    # the folder d holds d/x: a file d does not replace it without --delete (rsync: "cannot
    # delete non-empty directory"); it is kept and named
    assert up.newer == ["a", "b"] and [e.path for e in up.send] == [] and up.kept_dirs == ["d"]
    ck = make_plan(src, dst, checksum=True, delete=True)
    assert [e.path for e in ck.send] == ["a", "d"]
    assert ck.meta == [("b", 0o644, 100 * 10**9)]
    assert ck.replace == ["d"] and ck.removals == ["d"] and ck.kept_dirs == []


def test_plan_delete_keeps_paths_the_rules_ignore():
    rules = IgnoreRules(["*.ckpt"])
    plan = make_plan({".": Entry(".", "d")}, {".": Entry(".", "d"), "m.ckpt": _f("m.ckpt"),
                                              "old.py": _f("old.py")}, delete=True, rules=rules)
    assert plan.delete == ["old.py"]


def test_plan_delete_spares_what_lies_under_an_unreadable_source_dir():
    src = {".": Entry(".", "d"), "logs": Entry("logs", "d")}
    dst = {".": Entry(".", "d"), "logs": Entry("logs", "d"), "logs/a.txt": _f("logs/a.txt"),
           "old.txt": _f("old.txt")}
    plan = make_plan(src, dst, delete=True, unreadable={"logs": "Permission denied"})
    assert plan.delete == ["old.txt"]


def test_summary_text_lists_deleted_and_unreadable():
    s = sync.SyncSummary("pull", "gpu1:/ws/runs", "runs", files_sent=2, bytes_sent=3 * 1024 * 1024,
                         skipped=5, deleted=["a", "b/c"], unreadable={"secret": "Permission denied"},
                         seconds=1.25)
    assert str(s) == ("pull gpu1:/ws/runs -> runs: 2 files, 3.0 MiB sent, 5 unchanged, 2 deleted in 1.2 s\n"
                      "deleted (2):\n  a\n  b/c\n"
                      "could not read, not synced (1):\n  secret: Permission denied")


def test_agent_error_names_path_and_mount_for_disk_full_and_permission(tmp_path):
    import errno

    rec = agent.error_record(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "f")))
    err = sync.agent_error(rec, "gpu1")
    assert isinstance(err, SyncDiskFull)
    assert str(tmp_path / "f") in err.message and f"mount {agent.mount_of(str(tmp_path))}" in err.message
    rec = agent.error_record(OSError(errno.EACCES, "Permission denied", "/etc/x"))
    assert isinstance(sync.agent_error(rec, "gpu1"), SyncPermissionDenied)


# -- real transfers ------------------------------------------------------------------------


def _tree(root: Path) -> Path:
    """The tree of issue case 2."""
    (root / "data").mkdir(parents=True)
    (root / "train.py").write_text("import torch\nprint('train')\n", encoding="utf-8")
    (root / "data" / "a b.txt").write_text("a file with a space\n", encoding="utf-8")
    (root / "data" / "--help").write_text("not an option\n", encoding="utf-8")
    (root / "数据").mkdir()
    (root / "数据" / "样本.txt").write_text("样本\n", encoding="utf-8")
    (root / "empty").mkdir()
    (root / "run.sh").write_text("#!/bin/sh\necho run\n", encoding="utf-8")
    (root / "run.sh").chmod(0o755)
    (root / "it's \"quoted\"").write_text("q", encoding="utf-8")
    return root


def _snapshot(root: Path) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = p.lstat()
            if p.is_symlink():
                out[rel] = ("l", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("d", st.st_mode & 0o777, int(st.st_mtime))
            else:
                out[rel] = ("f", p.read_bytes(), st.st_mode & 0o777, int(st.st_mtime))
    return out


def test_push_then_pull_gives_identical_tree_and_second_push_sends_nothing(machine, tmp_path):
    src = _tree(tmp_path / "proj")
    remote = tmp_path / "remote"
    first = machine.push(str(src) + "/", str(remote))
    assert first.files_sent == 6 and first.bytes_sent == sum(
        p.stat().st_size for p in src.rglob("*") if p.is_file())
    assert _snapshot(remote) == _snapshot(src)
    assert os.stat(remote / "run.sh").st_mode & 0o111 == 0o111
    again = machine.push(str(src) + "/", str(remote))
    assert (again.files_sent, again.bytes_sent, again.skipped) == (0, 0, 6)
    back = tmp_path / "back"
    pulled = machine.pull(str(remote) + "/", str(back))
    assert pulled.files_sent == 6
    assert _snapshot(back) == _snapshot(src)
    assert (back / "empty").is_dir()


def test_small_files_and_large_file_together_keep_every_mtime(machine, tmp_path):
    src = _tree(tmp_path / "proj")
    (src / "data" / "weights.bin").write_bytes(os.urandom(sync.LARGE_FILE + 12345))
    os.utime(src / "data", (1_600_000_000, 1_600_000_000))
    s = machine.push(str(src) + "/", str(tmp_path / "remote"))
    assert s.files_sent == 7 and s.bytes_sent == sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    assert _snapshot(tmp_path / "remote") == _snapshot(src)
    assert int(os.stat(tmp_path / "remote" / "data").st_mtime) == 1_600_000_000
    pulled = machine.pull(str(tmp_path / "remote") + "/", str(tmp_path / "back"))
    assert pulled.files_sent == 7
    assert _snapshot(tmp_path / "back") == _snapshot(src)


def test_symlinks_are_recreated_and_never_followed(machine, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f.txt").write_text("x", encoding="utf-8")
    os.symlink(".", src / "loop")
    os.symlink("f.txt", src / "alias")
    os.symlink("/nonexistent/target", src / "dangling")
    s = machine.push(str(src) + "/", str(tmp_path / "dst"))
    assert s.links == 3 and s.files_sent == 1
    assert os.readlink(tmp_path / "dst" / "loop") == "."
    assert os.readlink(tmp_path / "dst" / "dangling") == "/nonexistent/target"
    machine.pull(str(tmp_path / "dst") + "/", str(tmp_path / "back"))
    assert os.readlink(tmp_path / "back" / "alias") == "f.txt"


def test_delete_removes_extra_remote_file_and_lists_it(machine, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "keep.py").write_text("k", encoding="utf-8")
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "stale.py").write_text("old", encoding="utf-8")
    (remote / "old_dir").mkdir()
    (remote / "old_dir" / "x").write_text("x", encoding="utf-8")
    kept = machine.push(str(src) + "/", str(remote))
    assert (remote / "stale.py").exists() and kept.deleted == []
    dry = machine.push(str(src) + "/", str(remote), delete=True, dry_run=True)
    assert dry.deleted == ["old_dir", "old_dir/x", "stale.py"]
    assert (remote / "stale.py").exists()
    done = machine.push(str(src) + "/", str(remote), delete=True)
    assert done.deleted == ["old_dir", "old_dir/x", "stale.py"]
    assert sorted(os.listdir(remote)) == ["keep.py"]
    assert "deleted (3):" in str(done) and "  stale.py" in str(done)


def test_gitignore_ckpt_and_pycache_not_pushed_unless_no_ignore_files(machine, tmp_path):
    src = tmp_path / "src"
    (src / "__pycache__").mkdir(parents=True)
    (src / "pkg" / "__pycache__").mkdir(parents=True)
    (src / ".gitignore").write_text("*.ckpt\n__pycache__/\n", encoding="utf-8")
    (src / "model.ckpt").write_bytes(b"\0" * 100)
    (src / "train.py").write_text("t", encoding="utf-8")
    (src / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"pyc")
    (src / "pkg" / "__pycache__" / "m.pyc").write_bytes(b"pyc")
    machine.push(str(src) + "/", str(tmp_path / "a"))
    assert sorted(str(p.relative_to(tmp_path / "a")) for p in (tmp_path / "a").rglob("*")) == \
        [".gitignore", "pkg", "train.py"]
    machine.push(str(src) + "/", str(tmp_path / "b"), ignore_files=False)
    assert (tmp_path / "b" / "model.ckpt").exists()
    assert (tmp_path / "b" / "pkg" / "__pycache__" / "m.pyc").exists()


def test_pull_asked_to_honours_remote_gitignore_and_exclude(machine, tmp_path):
    remote = tmp_path / "runs"
    (remote / "logs").mkdir(parents=True)
    (remote / ".gpuignore").write_text("scratch/\n", encoding="utf-8")
    (remote / "scratch").mkdir()
    (remote / "scratch" / "tmp.bin").write_text("t", encoding="utf-8")
    (remote / "logs" / "train.log").write_text("loss 0.1", encoding="utf-8")
    (remote / "logs" / "debug.trace").write_text("trace", encoding="utf-8")
    s = machine.pull(str(remote) + "/", str(tmp_path / "local"), exclude=["*.trace"], ignore_files=True)
    got = sorted(str(p.relative_to(tmp_path / "local")) for p in (tmp_path / "local").rglob("*"))
    assert got == [".gpuignore", "logs", "logs/train.log"]
    assert s.files_sent == 2


def test_a_pull_brings_what_the_projects_gitignore_names_and_wrapup_checks_every_file(ip, machine, tmp_path):
    # issue 43 finding 1: `%gpu sync :proj/ ./back/` brought .gitignore and train.py only, said
    # "2 files", and `%gpu wrapup` then said "everything is already here"
    from IPython.utils.capture import capture_output

    proj = tmp_path / "proj"
    (proj / "runs" / "exp1").mkdir(parents=True)
    (proj / "outputs").mkdir()
    (proj / ".gitignore").write_text("*.pt\nruns/\noutputs/\n", encoding="utf-8")
    for rel, data in {"runs/exp1/model.pt": "w1", "runs/exp1/log.txt": "loss", "outputs/best.pt": "w2",
                      "train.py": "print(1)"}.items():
        (proj / rel).write_text(data, encoding="utf-8")
    back = tmp_path / "back"
    ip.run_line_magic("gpu", "connect testgpu")
    with capture_output() as dry:
        ip.run_line_magic("gpu", f"sync :{proj}/ {back}/ --dry-run")
    assert all(f"  {rel}" in dry.stdout for rel in ("runs/exp1/model.pt", "outputs/best.pt")), dry.stdout
    with capture_output() as c:
        ip.run_line_magic("gpu", f"sync :{proj}/ {back}/")
    assert ": 5 files" in c.stdout, c.stdout
    assert (back / "runs" / "exp1" / "model.pt").read_text(encoding="utf-8") == "w1"
    assert (back / "outputs" / "best.pt").read_text(encoding="utf-8") == "w2"
    # asked for, the rules apply: only what git would keep
    only = tmp_path / "only"
    machine.pull(f"{proj}/", str(only), ignore_files=True)
    assert sorted(str(p.relative_to(only)) for p in only.rglob("*") if p.is_file()) == [".gitignore", "train.py"]
    # wrapup: "everything is here" only once every file under the folder is, by size and content
    from gpumagic import wrapup

    (back / "outputs" / "best.pt").unlink()
    r = wrapup.wrapup(machine, [(f"{proj}/", f"{back}/")], pull=False)
    assert r.pulls[0].pending == ["outputs/best.pt"], r.pulls[0]
    (back / "runs" / "exp1" / "log.txt").write_text("loss but edited here", encoding="utf-8")
    os.utime(back / "runs" / "exp1" / "log.txt", (time.time() + 60, time.time() + 60))
    r = wrapup.wrapup(machine, [(f"{proj}/", f"{back}/")])
    assert r.pulls[0].differs == ["runs/exp1/log.txt"] and (back / "outputs" / "best.pt").exists()
    text = wrapup.report_text(r)
    assert "everything is already here" not in text and "runs/exp1/log.txt" in text, text
    (back / "runs" / "exp1" / "log.txt").write_text("loss", encoding="utf-8")
    r = wrapup.wrapup(machine, [(f"{proj}/", f"{back}/")])
    assert "everything is already here (every file, by size and content)" in wrapup.report_text(r)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_cut_large_push_leaves_no_file_and_rerun_sends_only_the_rest(machine, tmp_path, monkeypatch):
    monkeypatch.setattr(sync, "PROGRESS_INTERVAL", 0)  # a callback per 1 MiB chunk
    size = 50 * 1024 * 1024
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(size))
    remote = tmp_path / "remote"

    def cut(p):
        if p.bytes_done >= size // 2 and machine.connection.transport is not None:
            machine.connection.transport.sock.close()

    with pytest.raises(ConnectionLost):
        machine.push(str(src) + "/", str(remote), progress=cut)
    assert not (remote / "big.bin").exists()
    second = machine.push(str(src) + "/", str(remote))
    assert second.files_sent == 1
    assert second.bytes_resumed > size // 5
    assert second.bytes_sent + second.bytes_resumed == size
    assert second.bytes_sent < size * 4 // 5
    assert second.bytes_sent <= size // 2 + 8 * 1024 * 1024  # the rest, plus at most a window in flight
    assert _sha(remote / "big.bin") == _sha(src / "big.bin")
    assert list(remote.glob("*.gpumagic-part")) == []


def test_interrupt_during_large_push_keeps_part_and_rerun_resumes(machine, tmp_path, monkeypatch):
    monkeypatch.setattr(sync, "PROGRESS_INTERVAL", 0)
    size = 20 * 1024 * 1024
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(os.urandom(size))

    def interrupt(p):
        if p.bytes_done >= size // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        machine.push(str(src) + "/", str(tmp_path / "remote"), progress=interrupt)
    assert not (tmp_path / "remote" / "w.bin").exists()
    assert [p.name.startswith(".w.bin.") for p in (tmp_path / "remote").glob("*.gpumagic-part")] == [True]
    again = machine.push(str(src) + "/", str(tmp_path / "remote"))
    assert again.bytes_resumed > 0 and again.bytes_sent + again.bytes_resumed == size
    assert _sha(tmp_path / "remote" / "w.bin") == _sha(src / "w.bin")
    assert list((tmp_path / "remote").glob("*.gpumagic-part")) == []


def test_cut_during_small_files_leaves_only_complete_files(machine, tmp_path, monkeypatch):
    monkeypatch.setattr(sync, "PROGRESS_INTERVAL", 0)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(300):
        (src / f"f{i:03d}.txt").write_bytes(os.urandom(6000))
    remote = tmp_path / "remote"

    def cut(p):
        if p.files_done >= 100 and machine.connection.transport is not None:
            machine.connection.transport.sock.close()

    with pytest.raises(ConnectionLost):
        machine.push(str(src) + "/", str(remote), progress=cut)
    arrived = [p for p in remote.iterdir() if not p.name.endswith(".gpumagic-part")] \
        if remote.exists() else []
    assert len(arrived) < 300  # the cut happened mid-stream
    for p in arrived:
        assert p.read_bytes() == (src / p.name).read_bytes(), p.name
    machine.push(str(src) + "/", str(remote))
    assert _snapshot(remote) == _snapshot(src)


def test_a_resync_opens_no_channel(machine, tmp_path, monkeypatch):
    # the first sync starts the connection's cell runner beside its channel; later ones
    # start their agent in it (tests/test_sync_round_trips.py counts the round trips)
    src = _tree(tmp_path / "proj")
    machine.push(str(src) + "/", str(tmp_path / "remote"))
    opened = []
    real = machine.connection.open_session
    monkeypatch.setattr(machine.connection, "open_session", lambda: opened.append(1) or real())
    s = machine.push(str(src) + "/", str(tmp_path / "remote"))
    assert s.bytes_sent == 0 and len(opened) == 0
    (src / "train.py").write_text("changed\n", encoding="utf-8")
    s = machine.push(str(src) + "/", str(tmp_path / "remote"))
    assert s.files_sent == 1 and len(opened) == 0


def test_large_pull_resumes_from_a_verified_partial(machine, tmp_path):
    size = 12 * 1024 * 1024
    remote = tmp_path / "remote"
    remote.mkdir()
    data = os.urandom(size)
    (remote / "ckpt.pt").write_bytes(data)
    local = tmp_path / "local"
    local.mkdir()
    (local / ".ckpt.pt.gpumagic-part").write_bytes(data[:5_000_000])
    s = machine.pull(str(remote) + "/", str(local))
    assert (s.bytes_resumed, s.bytes_sent) == (5_000_000, size - 5_000_000)
    assert (local / "ckpt.pt").read_bytes() == data
    # A partial whose bytes differ from the source is not trusted: the file starts over.
    (local / "ckpt.pt").unlink()
    (local / ".ckpt.pt.gpumagic-part").write_bytes(b"x" * 1000)
    s = machine.pull(str(remote) + "/", str(local))
    assert (s.bytes_resumed, s.bytes_sent) == (0, size)
    assert (local / "ckpt.pt").read_bytes() == data
    assert list(local.glob("*.gpumagic-part")) == []


def test_a_source_file_deleted_mid_pull_is_named_as_vanished_and_no_part_is_left(machine, tmp_path, monkeypatch):
    """rsync's "file has vanished" (its exit 24): a warning in the summary, not an error."""
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "ckpt.pt").write_bytes(os.urandom(sync.LARGE_FILE + 10))
    real = sync.LocalSide.write_large

    def delete_first(side, source, run, e, offset):
        (remote / "ckpt.pt").unlink()
        return real(side, source, run, e, offset)

    monkeypatch.setattr(sync.LocalSide, "write_large", delete_first)
    summary = machine.pull(str(remote) + "/", str(tmp_path / "local"))
    assert summary.vanished == {"ckpt.pt": "No such file or directory"} and summary.files_sent == 0
    assert "file has vanished, not synced (1):\n  ckpt.pt" in str(summary)
    assert list((tmp_path / "local").iterdir()) == []


def test_single_file_push_into_directory_and_to_new_name(machine, tmp_path):
    f = tmp_path / "model.py"
    f.write_text("m", encoding="utf-8")
    (tmp_path / "ws").mkdir()
    machine.push(str(f), str(tmp_path / "ws"))
    assert (tmp_path / "ws" / "model.py").read_text(encoding="utf-8") == "m"
    machine.push(str(f), str(tmp_path / "ws" / "renamed.py"))
    assert (tmp_path / "ws" / "renamed.py").read_text(encoding="utf-8") == "m"
    machine.pull(str(tmp_path / "ws" / "renamed.py"), str(tmp_path / "back") + "/")
    assert (tmp_path / "back" / "renamed.py").read_text(encoding="utf-8") == "m"


@pytest.fixture
def small_mount(tmp_path):
    """A real 1 MiB tmpfs (needs root, which can mount)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_remote_disk_full_names_path_and_mount_and_keeps_complete_files(machine, tmp_path, small_mount):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a_small.txt").write_text("fits", encoding="utf-8")
    (src / "b_big.bin").write_bytes(os.urandom(3 * 1024 * 1024))
    with pytest.raises(SyncDiskFull) as e:
        machine.push(str(src) + "/", str(small_mount / "ws"))
    assert f"mount {small_mount}" in e.value.message
    assert str(small_mount / "ws") in e.value.message
    assert (small_mount / "ws" / "a_small.txt").read_text(encoding="utf-8") == "fits"
    assert not (small_mount / "ws" / "b_big.bin").exists()


def test_remote_read_only_or_forbidden_dir_is_a_clear_error(machine, tmp_path, small_mount):
    subprocess.run(["mount", "-o", "remount,ro", str(small_mount)], check=True)
    src = tmp_path / "src"
    src.mkdir()
    (src / "x.py").write_text("x", encoding="utf-8")
    with pytest.raises(SyncPermissionDenied) as e:
        machine.push(str(src) + "/", str(small_mount / "ws"))
    assert "read-only" in e.value.message and f"mount {small_mount}" in e.value.message


def test_missing_local_source_is_a_clear_error(machine, tmp_path):
    with pytest.raises(SyncError, match="no local file or directory"):
        machine.push(str(tmp_path / "nope") + "/", str(tmp_path / "x"))


def test_a_home_relative_destination_is_named_as_given(machine, tmp_path):
    # the summary said "sandbox:~/~/x" (the cell directory joined with a path the agent
    # expands from $HOME itself)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_text("x", encoding="utf-8")
    old = machine.cwd
    machine.cd("~")
    try:
        s = machine.push(str(tmp_path / "src") + "/", "~/home-rel/")
    finally:
        machine.cwd = old
    assert s.destination == f"{machine.name}:~/home-rel"


def test_a_file_given_as_a_folder_is_a_one_line_error_on_either_side(machine, tmp_path):
    # a new user: `%gpu sync afile/ :x/` ended in NotADirectoryError's traceback, and a pull of
    # `:/etc/hostname/` said "cannot create /etc/hostname/" as if it were the destination
    (tmp_path / "afile").write_text("x", encoding="utf-8")
    with pytest.raises(SyncError) as e:
        machine.push(str(tmp_path / "afile") + "/", "x/")
    assert e.value.message == f"{tmp_path / 'afile'}/ is a file, not a directory (a trailing / means the folder's contents)"
    assert e.value.hint == f"drop the trailing / to copy the file itself: {tmp_path / 'afile'}"
    machine.run(["sh", "-c", "echo x > ~/a-remote-file"], quiet=True)
    with pytest.raises(SyncError) as e:
        machine.pull("~/a-remote-file/", str(tmp_path / "z") + "/")
    assert e.value.message.endswith(f"a-remote-file/ on {machine.name} is not a directory: part of that path is a file")
    assert not (tmp_path / "z").exists()


# -- magics ----------------------------------------------------------------------------------


def test_magic_sync_trailing_slash_rule(ip, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "source").mkdir()
    (tmp_path / "source" / "some_data").write_text("d", encoding="utf-8")
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", f"sync source :{tmp_path}/ws")
    ip.run_line_magic("gpu", f"sync source/ testgpu:{tmp_path}/ws2")
    assert (tmp_path / "ws" / "source" / "some_data").read_text(encoding="utf-8") == "d"
    assert (tmp_path / "ws2" / "some_data").read_text(encoding="utf-8") == "d"
    out = capsys.readouterr().out
    assert f"push source -> testgpu:{tmp_path}/ws/source: 1 file," in out


def test_magic_sync_bad_arguments_are_usage_errors(ip, tmp_path):
    from IPython.core.error import UsageError

    ip.run_line_magic("gpu", "connect testgpu")
    with pytest.raises(UsageError, match="exactly one side must be remote"):
        ip.run_line_magic("gpu", f"sync {tmp_path} {tmp_path}/x")
    with pytest.raises(UsageError, match="name different machines"):
        ip.run_line_magic("gpu", f"sync {tmp_path} other:/x --host testgpu")


def test_progress_widget_and_text_show_files_bytes_rate(tmp_path):
    from gpumagic.notebook.widgets import SyncProgressBar, SyncProgressText

    p = sync.SyncProgress(files_total=4, bytes_total=4096, files_done=1, bytes_done=1024,
                          started=time.monotonic() - 2)  # a rate and an ETA show after 1 s
    bar = SyncProgressBar(display=False)
    bar(p)
    assert (bar.bar.value, bar.bar.max) == (1024, 4096)
    assert bar.label.value.startswith("1/4 files  1.0 KiB/4.0 KiB  ") and "ETA" in bar.label.value
    bundle = bar._repr_mimebundle_()
    assert bundle["text/plain"].startswith("sync progress: 1/4 files")
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/html"].startswith("<div><div style=") and "sync: 1/4 files" in bundle["text/html"]
    with open(tmp_path / "err.txt", "w", encoding="utf-8") as f:
        t = SyncProgressText(file=f)
        t(p)
        p.finished = True
        t(p)
    assert "done in" in t.text


def test_progress_while_the_walk_still_counts_ends_its_totals_in_plus_and_has_no_eta(tmp_path):
    from gpumagic.notebook.display import sync_progress_text
    from gpumagic.notebook.widgets import SyncProgressText

    p = sync.SyncProgress(files_total=40, bytes_total=4 << 20, files_done=3, bytes_done=1 << 20,
                          started=time.monotonic() - 2, counting=True)
    text = sync_progress_text(p)
    assert text.startswith("3/40+ files  1.0 MiB/4.0 MiB+  ") and "ETA" not in text, text
    with open(tmp_path / "err.txt", "w", encoding="utf-8") as f:
        t = SyncProgressText(file=f)
        t(p)
        grown = sync.SyncProgress(files_total=90, bytes_total=9 << 20, files_done=50,
                                  bytes_done=5 << 20, started=p.started, counting=False)
        t(grown)
        assert t.bar.total == 9 << 20 and "50/90 files" in str(t.bar), str(t.bar)
        t.close()


def test_the_text_bar_keeps_drawing_after_a_large_step(tmp_path):
    # tqdm's dynamic miniters, after one step of 9 MB, waited for another as large before it
    # drew again: the bar froze for the rest of the sync (2 frames for 300 calls)
    import io

    from gpumagic.notebook.widgets import SyncProgressText

    buf = io.StringIO()
    bar = SyncProgressText(file=buf)
    p = sync.SyncProgress(300, 10_000_000, counting=True)
    bar(p)
    assert "0/300+ files" in buf.getvalue()
    p.files_done, p.bytes_done = 1, 9_000_000
    bar(p)
    for _ in range(299):
        p.files_done += 1
        p.bytes_done += 1000
        time.sleep(0.005)  # 1.5 s in all: tqdm draws at most every 0.1 s
        bar(p)
    frames = [f for f in buf.getvalue().split("\r") if f.strip()]
    assert len(frames) >= 6, frames
    bar.close()


def test_progress_shows_no_rate_or_eta_in_the_first_second(tmp_path):
    from gpumagic.notebook.display import sync_progress_text
    from gpumagic.notebook.widgets import SyncProgressText

    early = sync.SyncProgress(files_total=4, bytes_total=4 << 20, bytes_done=88,
                              started=time.monotonic() - 0.2)
    assert sync_progress_text(early) == "0/4 files  88 B/4.0 MiB"
    later = sync.SyncProgress(files_total=4, bytes_total=4 << 20, bytes_done=1 << 20,
                              started=time.monotonic() - 2)
    assert "/s  ETA " in sync_progress_text(later)
    with open(tmp_path / "err.txt", "w", encoding="utf-8") as f:
        t = SyncProgressText(file=f)
        t(early)
        first = (tmp_path / "err.txt").read_bytes().decode()  # keeping the \r
        t(later)
        shown = str(t.bar)  # what tqdm draws at its next refresh
        t.close()
    assert "0/4 files]" in first and "<" not in first and "B/s" not in first, repr(first)
    assert "<" in shown and "B/s, 0/4 files]" in shown, shown  # tqdm's ETA and rate after 1 s


def test_failed_sync_ends_the_bar_line_before_the_error_and_leaves_nothing_behind(tmp_path):
    import gc

    from gpumagic.notebook.widgets import SyncProgressText

    p = sync.SyncProgress(files_total=4, bytes_total=4000, started=time.monotonic() - 0.1)
    with open(tmp_path / "err.txt", "w", encoding="utf-8") as f:
        t = SyncProgressText(file=f)
        t(p)
        t.close(failed=True)  # what %gpu sync does in its finally
        f.write("SyncError: ...\n")
        f.flush()
        t.close(failed=True)
        del t
        gc.collect()  # an unclosed tqdm bar would clear its line here, over later output
        f.write("next output\n")
    lines = (tmp_path / "err.txt").read_bytes().decode().split("\n")
    assert lines[0].endswith("0/4 files]") and lines[1:] == ["SyncError: ...", "next output", ""], lines


def test_magic_sync_to_an_uncreatable_destination_says_so_and_ends_the_bar(ip, tmp_path, capsys,
                                                                            monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "proj").mkdir()
    for i in range(4):
        (tmp_path / "proj" / f"f{i}").write_bytes(b"x" * 1000)
    ip.run_line_magic("gpu", "connect testgpu")
    capsys.readouterr()
    with pytest.raises(SyncError) as info:
        ip.run_line_magic("gpu", "sync ./proj/ :/proc/nope/")
    err = capsys.readouterr().err
    assert info.value.message.startswith("cannot create /proc/nope/ on testgpu")
    assert "choose a destination that can be created" in info.value.hint
    assert "run the sync again" not in info.value.hint
    assert err.endswith("0/4 files]\n"), repr(err)


# -- tutorial --------------------------------------------------------------------------------


def test_tutorial_03_sync_code_and_results(tmp_path, monkeypatch):
    import nbformat

    from gpumagic.__main__ import run_notebook

    repo = Path(__file__).resolve().parent.parent
    monkeypatch.setenv("PYTHONPATH", str(repo))
    out = run_notebook(repo / "example-notebooks" / "03-sync-code-and-results.ipynb", tmp_path,
                       timeout=120)
    cells = [c for c in nbformat.read(out, as_version=4).cells if c.cell_type == "code"]

    def text(i):
        return "".join(o.get("text", "") for o in cells[i].outputs if o.output_type == "stream")

    assert "connected to sandbox" in text(1)
    assert "push project/ -> sandbox:" in text(2) and ": 3 files," in text(2)
    assert ": 0 files, 0 B sent, 3 unchanged" in text(3)
    assert "trained; wrote ['metrics.json', 'model.ckpt']" in text(4)
    # a pull brings what .gitignore names too: runs/exp1/model.ckpt (*.ckpt) comes back (issue 43)
    assert ": 5 files," in text(5) and '{"epoch": 3, "loss": 0.042}' in text(5)
    assert "and the checkpoint, though .gitignore says *.ckpt: ['metrics.json', 'model.ckpt']" in text(5)
    # model.ckpt (*.ckpt in .gitignore) is protected, and so are runs/ and runs/exp1 that hold it
    assert "would delete (2):\n  data/train set.csv\n  runs/exp1/metrics.json\n" in text(6)
    assert "1 file," in text(7) and "deleted (1):\n  data/train set.csv\n" in text(7)
    # the progress bar was a widget while it ran; the saved file has its final static state
    bars = [o["data"] for o in cells[2].outputs if o.output_type == "display_data"]
    assert len(bars) == 1 and set(bars[0]) == {"text/plain", "text/html"}, bars
    assert bars[0]["text/plain"].startswith("sync: 3/3 files")


def test_missing_remote_python3_is_a_clear_error(tmp_path):
    from conftest import make_server

    from gpumagic.machine import Machine

    server = make_server("nopython", env={"PATH": str(tmp_path / "empty-bin")})
    try:
        with Machine(server.spec()) as m:
            with pytest.raises(SyncError, match="has no python3") as e:
                m.push(str(tmp_path) + "/", "ws")
            assert "apt-get install -y python3" in e.value.hint
    finally:
        server.stop()


def test_pull_extraction_refuses_entries_it_did_not_ask_for(tmp_path):
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        ti = tarfile.TarInfo("data")
        ti.type, ti.linkname = tarfile.SYMTYPE, "/etc"
        tf.addfile(ti)
    buf.seek(0)
    with pytest.raises(agent.AgentError, match="unexpected entry 'data'"):
        agent.extract(str(tmp_path / "out"), buf, allowed={"data/passwd"})
    assert not os.path.lexists(tmp_path / "out" / "data")
    with pytest.raises(agent.AgentError, match="unsafe path"):
        agent.check_rel("../escape")


def test_checksum_sends_a_file_whose_size_and_mtime_match_but_content_differs(machine, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "cfg.yaml").write_text("lr: 0.1\n", encoding="utf-8")
    remote = tmp_path / "remote"
    machine.push(str(src) + "/", str(remote))
    (remote / "cfg.yaml").write_text("lr: 0.9\n", encoding="utf-8")
    st = (src / "cfg.yaml").stat()
    os.utime(remote / "cfg.yaml", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert machine.push(str(src) + "/", str(remote)).files_sent == 0
    assert machine.push(str(src) + "/", str(remote), checksum=True).files_sent == 1
    assert (remote / "cfg.yaml").read_text(encoding="utf-8") == "lr: 0.1\n"


def test_update_keeps_a_newer_remote_file(machine, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "notes.txt").write_text("old local", encoding="utf-8")
    os.utime(src / "notes.txt", (1_600_000_000, 1_600_000_000))
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "notes.txt").write_text("edited on the machine", encoding="utf-8")
    s = machine.push(str(src) + "/", str(remote), update=True)
    assert s.newer == ["notes.txt"] and s.files_sent == 0
    assert (remote / "notes.txt").read_text(encoding="utf-8") == "edited on the machine"


def test_python_push_and_pull_accept_the_sync_colon_forms(machine, tmp_path):
    from gpumagic.errors import ConfigError
    src = tmp_path / "colon src"
    src.mkdir()
    (src / "f.txt").write_text("colon\n", encoding="utf-8")
    remote = f"/tmp/gm-colon-{os.getpid()}"
    machine.push(str(src) + "/", f":{remote}/")
    assert machine.run(["cat", f"{remote}/f.txt"], quiet=True).stdout == "colon\n"
    machine.pull(f"{machine.name}:{remote}/", str(tmp_path / "back") + "/")
    assert (tmp_path / "back" / "f.txt").read_text(encoding="utf-8") == "colon\n"
    with pytest.raises(ConfigError) as e:
        machine.push(str(src) + "/", f"othermachine:{remote}/")
    assert "'othermachine'" in e.value.message
    machine.run(["rm", "-rf", remote], quiet=True)


def _published(ip, monkeypatch):
    out = []
    monkeypatch.setattr(ip.display_pub, "publish", lambda data, metadata=None, source=None, *,
                        transient=None, update=False, **kw: out.append((data, transient, update)))
    return out


@pytest.mark.parametrize("failed", [False, True])
def test_a_finished_sync_bar_is_replaced_by_static_html_and_text(ip, monkeypatch, failed):
    # issue 17 case 1: the live bar, then its final state with no widget model.
    from gpumagic.notebook.widgets import SyncProgressBar

    shown = _published(ip, monkeypatch)
    bar = SyncProgressBar()
    (live, transient, update), = shown
    assert "application/vnd.jupyter.widget-view+json" in live and not update
    assert live["text/plain"] == "sync progress: starting" and bar.label.value == "starting"
    p = sync.SyncProgress(files_total=4, bytes_total=4096, files_done=4 if not failed else 1,
                          bytes_done=4096 if not failed else 1024, started=time.monotonic() - 2)
    p.finished = not failed
    bar(p)
    bar.close(failed=failed)
    data, transient2, update = shown[-1]
    assert update and transient2 == transient
    assert set(data) == {"text/plain", "text/html"}
    if failed:
        assert data["text/plain"].startswith("sync FAILED: 1/4 files  1.0 KiB/4.0 KiB")
        assert "#c62828" in data["text/html"]
    else:
        assert data["text/plain"].startswith("sync: 4/4 files  4.0 KiB/4.0 KiB") and "done in" in data["text/plain"]
        assert "width:100%" in data["text/html"] and "#2e7d32" in data["text/html"]
    bar.close()  # twice: nothing more
    assert len(shown) == 2


def test_a_no_op_sync_says_nothing_to_transfer_instead_of_an_empty_bar(ip, monkeypatch):
    # issue 17 case 5: "a no-op sync shows an empty, unlabelled grey bar".
    from gpumagic.notebook.widgets import SyncProgressBar

    shown = _published(ip, monkeypatch)
    bar = SyncProgressBar()
    p = sync.SyncProgress(files_total=0, bytes_total=0, started=time.monotonic())
    p.finished = True
    bar(p)
    assert bar.label.value == "nothing to transfer (everything is up to date)"
    bar.close()
    data = shown[-1][0]
    assert data["text/plain"] == "sync: nothing to transfer (everything is up to date)"
    assert data["text/html"] == "<div>sync: nothing to transfer (everything is up to date)</div>"


# -- one options object from the magic to the engine (issue 25, item 3) ---------------------


def test_sync_options_take_keyword_shortcuts_and_name_a_misspelt_one(machine, tmp_path):
    from gpumagic.sync import SyncOptions

    assert SyncOptions(delete=True).with_(checksum=True) == SyncOptions(delete=True, checksum=True)
    with pytest.raises(TypeError, match=r"^unknown sync option delet \(valid: checksum, compress, delete, "):
        machine.push(str(tmp_path), "x", delet=True)
    with pytest.raises(TypeError, match="rename_clashes is for a pull"):
        machine.push(str(tmp_path), "x", rename_clashes=True)


def test_the_sync_magic_hands_its_flags_as_one_object(ip, monkeypatch, tmp_path):
    from gpumagic.machine import Machine
    from gpumagic.sync import SyncOptions

    got = {}

    def fake_push(self, src, dst, options=None, **kw):
        got.update(options=options, kw=kw)
        raise SyncError("stop here", "nothing sent")

    monkeypatch.setattr(Machine, "push", fake_push)
    ip.run_line_magic("gpu", "connect testgpu")
    with pytest.raises(SyncError):
        ip.run_line_magic("gpu", f"sync {tmp_path}/ :x --delete --exclude '*.pt' --checksum --no-compress")
    assert got["options"] == SyncOptions(delete=True, exclude=("*.pt",), checksum=True, compress=False)
    assert set(got["kw"]) == {"progress"}


def test_progress_false_is_no_progress_and_a_non_callable_is_a_clear_error(machine, tmp_path):
    # a user's trial: progress=False failed deep inside the engine ('bool' object is not callable)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a\n", encoding="utf-8")
    s = machine.push(f"{src}/", str(tmp_path / "remote"), progress=False)
    assert s.files_sent == 1 and (tmp_path / "remote" / "a.txt").read_text(encoding="utf-8") == "a\n"
    assert machine.pull(f"{tmp_path / 'remote'}/", str(tmp_path / "back"), progress=None).files_sent == 1
    with pytest.raises(TypeError, match=r"^progress must be a callable that takes a SyncProgress"):
        machine.push(f"{src}/", str(tmp_path / "remote"), progress="yes")


@pytest.mark.parametrize("flags", ["", "--compress"])
def test_ctrl_c_in_a_sync_is_one_line_at_once_and_the_same_sync_resumes(ip, capsys, tmp_path, flags):
    # Issue 43: Ctrl-C during %gpu sync printed a 30-frame traceback (threading's
    # waiter.acquire) and took 4.9 s with --compress: the large file's worker, its channel
    # closed under it, waited 2 s for the connection to look down, then read the agent's end.
    import _thread
    import threading

    from gpumagic.errors import Interrupted
    from gpumagic.notebook.magics.sync import INTERRUPTED

    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    block = os.urandom(1 << 20)
    with open(src / "big.bin", "wb") as f:  # 200 MiB, half of it compressible
        for i in range(100):
            f.write(block[i:] + block[:i] + b"a" * (1 << 20))
    ip.run_line_magic("gpu", "connect testgpu")
    worker_left: list[bool] = []

    def interrupt_when_a_part_grows() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            parts = list(dst.glob(".big.bin.*.gpumagic-part")) if dst.exists() else []
            if parts and parts[0].stat().st_size > 16 << 20:
                break
            time.sleep(0.01)
        _thread.interrupt_main()

    threading.Thread(target=interrupt_when_a_part_grows, daemon=True).start()
    result = ip.run_cell(f"%gpu sync {src}/ :{dst}/ {flags}")
    # the large file's worker ended with the sync: none is left sending
    worker_left.extend(t.name.startswith("gpumagic-sync") for t in threading.enumerate())
    assert isinstance(result.error_in_exec, Interrupted)
    shown = capsys.readouterr()
    lines = [ln for ln in (shown.out + shown.err).splitlines() if ln.startswith("KeyboardInterrupt")]
    assert lines == ["KeyboardInterrupt: " + INTERRUPTED]
    assert "Traceback" not in shown.out + shown.err
    assert not any(worker_left)
    assert not (dst / "big.bin").exists() and len(list(dst.glob(".big.bin.*.gpumagic-part"))) == 1
    ip.run_line_magic("gpu", f"sync {src}/ :{dst}/ {flags}")
    again = capsys.readouterr().out
    assert "resumed)" in again, again
    assert _sha(dst / "big.bin") == _sha(src / "big.bin")


def _parts(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*.gpumagic-part")]


@pytest.mark.parametrize("size", [3 << 20, 10 << 20], ids=["small file", "large file"])
def test_a_pull_into_a_full_disk_names_the_file_and_mount_and_leaves_no_part(machine, tmp_path, small_mount, size):
    # Issue 43: "SyncDiskFull: disk full on this computer writing ?", and a hidden 19-31 MB
    # part file left the disk full.
    there = tmp_path / "there"
    there.mkdir()
    (there / "ok.txt").write_text("fits", encoding="utf-8")
    (there / "w.bin").write_bytes(os.urandom(size))
    with pytest.raises(SyncDiskFull) as e:
        machine.pull(str(there) + "/", str(small_mount / "back"))
    said = e.value.message
    assert f"disk full on this computer writing {small_mount / 'back' / 'w.bin'} (mount {small_mount}" in said, said
    assert _parts(small_mount) == []
    if size >= sync.LARGE_FILE:
        assert "its partial copy (" in said and "was removed, so the space is free again" in said, said
    assert (small_mount / "back" / "ok.txt").read_text(encoding="utf-8") == "fits"


def test_a_push_into_a_full_disk_leaves_no_part_there(machine, tmp_path, small_mount):
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(os.urandom(10 << 20))
    with pytest.raises(SyncDiskFull) as e:
        machine.push(str(src) + "/", str(small_mount / "ws"))
    said = e.value.message
    assert f"writing {small_mount / 'ws' / 'w.bin'} (mount {small_mount}" in said, said
    assert "was removed, so the space is free again" in said, said
    assert _parts(small_mount) == []
