"""A ``--delete`` never wipes what a student cannot get back (issue 43, finding 2).

On a sandbox home: ``%gpu sync ./proj/ : --delete`` (the path after ``:`` forgotten) deleted
``~/.ssh/authorized_keys``, ``~/important/model.pt`` and all of ``~/.gpumagic``.  Now a
``--delete`` into a home, a folder holding ``.ssh``, or gpumagic's own folder is refused before
anything is touched; more than 1,000 removals need ``--yes``; and what the ignore rules protect
is never removed, also inside a folder gone from the source (rsync's protect rules).
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

from gpumagic.errors import SyncError
from gpumagic.sync import engine as sync
from gpumagic.sync.ignore import IgnoreRules
from gpumagic.sync.plan import Entry, make_plan


def _home(sshd) -> Path:
    return Path(sshd.env["HOME"])


@pytest.fixture
def a_home(sshd):
    """What a rented machine's home holds, in the test server's home (removed after)."""
    home = _home(sshd)
    made = [home / ".ssh" / "authorized_keys", home / "important" / "model.pt"]
    for p in made:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(p.name, encoding="utf-8")
    yield home
    for p in made:
        p.unlink(missing_ok=True)
    (home / "important").rmdir()


@pytest.fixture
def proj(tmp_path):
    p = tmp_path / "proj"
    p.mkdir()
    (p / "train.py").write_text("print(1)\n", encoding="utf-8")
    return p


@pytest.mark.parametrize("dst", [":", ":.", ":~/", ":~"])
def test_delete_into_the_home_is_refused_before_anything_is_touched(ip, sshd, a_home, proj, dst, monkeypatch):
    ip.run_line_magic("gpu", "connect testgpu")
    opened = []
    monkeypatch.setattr(sync, "open_listing", lambda *a, **k: opened.append(a))  # refused before listing
    def listed():  # gpumagic's own folder aside (the sync agent is kept there)
        return sorted(str(p.relative_to(a_home)) for p in a_home.rglob("*") if ".gpumagic" not in p.parts)

    before = listed()
    with pytest.raises(SyncError) as e:
        ip.run_line_magic("gpu", f"sync {proj}/ {dst} --delete")
    assert "it is a home folder" in e.value.message or "it holds .ssh" in e.value.message, e.value.message
    assert "nothing was changed" in e.value.message and "\n" not in e.value.message
    assert "name the project's own folder as the destination" in e.value.hint
    assert listed() == before
    assert (a_home / ".ssh" / "authorized_keys").read_text(encoding="utf-8") == "authorized_keys"
    assert opened == []


def test_delete_into_a_folder_holding_ssh_or_into_gpumagics_own_is_refused(machine, sshd, tmp_path, proj):
    other = tmp_path / "someone"
    (other / ".ssh").mkdir(parents=True)
    (other / ".ssh" / "authorized_keys").write_text("k", encoding="utf-8")
    with pytest.raises(SyncError, match="it holds .ssh; nothing was changed"):
        machine.push(f"{proj}/", str(other), delete=True)
    assert (other / ".ssh" / "authorized_keys").exists()
    with pytest.raises(SyncError, match="it holds .ssh"):  # a dry run is refused too
        machine.push(f"{proj}/", str(other), delete=True, dry_run=True)
    own = _home(sshd) / ".gpumagic" / "stash"
    own.mkdir(parents=True, exist_ok=True)
    (own / "x").write_text("x", encoding="utf-8")
    with pytest.raises(SyncError, match="it is gpumagic's own folder"):
        machine.push(f"{proj}/", "~/.gpumagic/stash/", delete=True)
    assert (own / "x").exists()


def test_a_pull_with_delete_into_this_computers_home_is_refused(machine, tmp_path, monkeypatch):
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "a.txt").write_text("a", encoding="utf-8")
    home = tmp_path / "laptop-home"
    (home / "notes").mkdir(parents=True)
    (home / "notes" / "n.txt").write_text("n", encoding="utf-8")
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(SyncError, match="it is a home folder; nothing was changed"):
        machine.pull(f"{remote}/", str(home), delete=True)
    assert (home / "notes" / "n.txt").exists()


def test_more_than_1000_removals_need_yes_and_say_how_many(ip, machine, tmp_path, proj):
    dest = tmp_path / "dest"
    (dest / "old").mkdir(parents=True)
    for i in range(1001):
        (dest / "old" / f"f{i}").write_text("x", encoding="utf-8")
    with pytest.raises(SyncError) as e:
        machine.push(f"{proj}/", str(dest), delete=True)
    assert "would remove 1,002 paths" in e.value.message and "(more than 1,000)" in e.value.message
    assert "add --yes" in e.value.hint
    assert len(list((dest / "old").iterdir())) == 1001  # nothing was touched
    dry = machine.push(f"{proj}/", str(dest), delete=True, dry_run=True)  # how the count is looked at
    assert len(dry.deleted) == 1002
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", f"sync {proj}/ :{dest} --delete --yes")
    assert sorted(os.listdir(dest)) == ["train.py"]


def test_a_protected_file_inside_a_folder_gone_from_the_source_is_kept(machine, tmp_path, proj):
    # mutagen#114, rsync's protect rules: old/runs/ckpt.pt is ignored by runs/ in .gpuignore
    (proj / ".gpuignore").write_text("runs/\n", encoding="utf-8")
    dest = tmp_path / "dest"
    (dest / "old" / "runs").mkdir(parents=True)
    (dest / "old" / "runs" / "ckpt.pt").write_text("weights", encoding="utf-8")
    (dest / "old" / "notes.txt").write_text("n", encoding="utf-8")
    (dest / "stale.py").write_text("s", encoding="utf-8")
    s = machine.push(f"{proj}/", str(dest), delete=True)
    assert (dest / "old" / "runs" / "ckpt.pt").read_text(encoding="utf-8") == "weights"
    assert not (dest / "old" / "notes.txt").exists() and not (dest / "stale.py").exists()
    assert sorted(s.deleted) == ["old/notes.txt", "stale.py"]


@pytest.mark.parametrize("line", ["sync a :b --del", "sync a :b --dry", "sync a :b --exc x"])
def test_no_option_is_reached_by_a_prefix_of_its_name(ip, line):
    with pytest.raises(UsageError) as e:
        ip.run_line_magic("gpu", line)
    assert type(e.value) is UsageError and "unrecognized arguments" in str(e.value), str(e.value)


@pytest.mark.parametrize("line", ["wrapup --pull ':\0' ./b", "sync ./a\0 :b", "cd /tmp/\0x"])
def test_a_nul_in_any_argument_is_one_usage_error(ip, line):
    with pytest.raises(UsageError) as e:
        ip.run_line_magic("gpu", line)
    assert type(e.value) is UsageError and "holds a NUL character" in str(e.value)


# -- the property: a protect rule's paths and paths outside the destination are never removed


NAMES = st.sampled_from(["a", "b", "runs", "ckpt.pt", "x.log", "old", "keep"])
PATHS = st.lists(NAMES, min_size=1, max_size=4).map("/".join)
PATTERNS = st.lists(st.sampled_from(["runs/", "*.pt", "*.log", "old/keep", "/a", "b/", "!x.log"]), max_size=4)


def _tree(paths) -> dict[str, Entry]:
    """A listing: every path a file unless another path lies under it (then a folder)."""
    tree = {".": Entry(".", "d")}
    for p in paths:
        parts = p.split("/")
        for i in range(1, len(parts)):
            d = "/".join(parts[:i])
            if d in tree and tree[d].kind != "d":
                break
            tree[d] = Entry(d, "d")
        else:
            if p not in tree:
                tree[p] = Entry(p, "f", size=1, mtime_ns=10**9, mode=0o644)
    return tree


@settings(max_examples=300, deadline=None)
@given(src=st.lists(PATHS, max_size=6), dst=st.lists(PATHS, max_size=10), patterns=PATTERNS)
def test_delete_never_removes_a_protected_path_or_one_outside_the_destination(src, dst, patterns):
    source, dest = _tree(src), _tree(dst)
    rules = IgnoreRules(patterns)
    plan = make_plan(source, dest, delete=True, rules=rules)
    removed = _replaced(plan, dest)
    for rel in plan.delete:  # the agent removes a listed folder with all it holds
        assert rel in dest and rel != "." and ".." not in rel.split("/") and not rel.startswith("/")
        removed |= {p for p in dest if p == rel or p.startswith(rel + "/")}
    protected = {p for p in dest if p != "." and p not in source and rules.covers(p, dest[p].kind == "d")}
    assert not removed & protected, (sorted(removed & protected), plan.delete)
    assert not removed & set(source), "a source path is never removed"
    # and everything unprotected that the source lacks does go (or lies under a kept folder)
    for p in dest:
        if p != "." and p not in source and p not in protected:
            assert p in removed or any(q.startswith(p + "/") for q in protected), p
    assert all(posixpath.normpath(r) == r for r in plan.delete)


def _replaced(plan, dest) -> set[str]:
    """What the replacements remove: a folder replaced by a file goes with all it holds."""
    return {p for rel in plan.replace for p in dest if p.startswith(rel + "/")}


@settings(max_examples=300, deadline=None)
@given(src=st.lists(PATHS, max_size=6), dst=st.lists(PATHS, max_size=10), patterns=PATTERNS)
def test_without_delete_nothing_the_source_lacks_is_removed(src, dst, patterns):
    # a file where the destination has a folder that holds files does not replace it (rsync:
    # "cannot delete non-empty directory"): it was wiped with all it held
    source, dest = _tree(src), _tree(dst)
    plan = make_plan(source, dest, rules=IgnoreRules(patterns))
    assert plan.delete == []
    assert _replaced(plan, dest) == set(), plan.replace
    for rel in plan.kept_dirs:
        assert dest[rel].kind == "d" and source[rel].kind != "d"
        assert rel not in {e.path for e in plan.send} | {e.path for e in plan.links}


def test_a_file_where_a_folder_of_results_is_keeps_the_folder(machine, tmp_path, proj):
    # without --delete: the folder and all it holds stay, the file is not sent, the summary says
    # so; with --delete: replaced, unless the rules protect something in it
    dest = tmp_path / "dest"
    (dest / "results").mkdir(parents=True)
    (dest / "results" / "model.pt").write_text("weights", encoding="utf-8")
    (proj / "results").write_text("a file now", encoding="utf-8")
    s = machine.push(f"{proj}/", str(dest))
    assert (dest / "results" / "model.pt").read_text(encoding="utf-8") == "weights"
    assert s.kept_dirs == ["results"]
    from gpumagic.sync.engine import summary_text

    assert "kept 1 folder where the source has a file of that name (it holds files" in summary_text(s)
    (proj / ".gpuignore").write_text("*.pt\n", encoding="utf-8")
    s = machine.push(f"{proj}/", str(dest), delete=True)
    assert (dest / "results" / "model.pt").read_text(encoding="utf-8") == "weights" and s.kept_dirs == ["results"]
    (proj / ".gpuignore").unlink()
    s = machine.push(f"{proj}/", str(dest), delete=True, max_delete=0)
    assert (dest / "results").read_text(encoding="utf-8") == "a file now" and s.kept_dirs == []


def test_refuse_wide_delete_names_each_reason():
    with pytest.raises(SyncError, match="it is a home folder"):
        sync.refuse_wide_delete("gpu:~", "~", [], True, 0, None, "./p/")
    with pytest.raises(SyncError, match="it holds .gpumagic"):
        sync.refuse_wide_delete("gpu:/root", "/root", ["a", ".gpumagic"], False, 0, None, "./p/")
    with pytest.raises(SyncError, match="would remove 1,001 paths"):
        sync.refuse_wide_delete("gpu:/w", "/w", [], False, 1001, None, "./p/")
    sync.refuse_wide_delete("gpu:/w", "/w", [], False, 1001, 0, "./p/")  # --yes
    sync.refuse_wide_delete("gpu:/w", "/w", [], False, 1000, None, "./p/")  # at the bound
    assert sync._is_home_path("", None) and sync._is_home_path("~/", "/ws") and not sync._is_home_path("", "/ws")
    assert not sync._is_home_path("/", None) and not sync._is_home_path("proj", None)


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_one_file_sent_onto_a_folder_of_that_name_keeps_the_folder(machine, tmp_path, direction):
    # the new-user trial: `%gpu sync ./proj5/results :proj5`, with proj5/results/ a folder of
    # results there, removed the folder and model.pt (a one-file sync lists only that name, so
    # the folder looked empty); a dry run said "delete 0"
    here, there = tmp_path / "here", tmp_path / "there"
    (here).mkdir()
    (there / "results").mkdir(parents=True)
    (there / "results" / "model.pt").write_text("weights", encoding="utf-8")
    (here / "results").write_text("a file", encoding="utf-8")
    # the machine is this computer: a push sends here/results to there/ as the machine's, a
    # pull brings the machine's here/results into there/ on this computer
    sync_one = machine.pull if direction == "pull" else machine.push
    s = sync_one(str(here / "results"), str(there))
    folder = there / "results"
    assert folder.is_dir() and (folder / "model.pt").read_text(encoding="utf-8") == "weights"
    assert s.kept_dirs == ["results"] and s.files_sent == 0
