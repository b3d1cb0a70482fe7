"""A sync root that is a symlink to a folder is followed, as rsync follows it (issue 43):
rented machines often have /workspace or ~/data as a link to a big disk.  Against the real
test sshd; the machine is this computer, so its side is read here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def project(tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "train.py").write_text("print('train')\n", encoding="utf-8")
    (src / "pkg" / "model.py").write_text("W = 3\n", encoding="utf-8")
    (src / "big.bin").write_bytes(os.urandom(9 << 20))  # a large file: its own channel and part
    return src


@pytest.mark.parametrize("slash", ["", "/"])
def test_a_push_into_a_linked_folder_writes_into_what_it_points_at(machine, tmp_path, project, slash):
    big = tmp_path / "big" / "data"
    big.mkdir(parents=True)
    (tmp_path / "data").symlink_to(big)
    machine.push(f"{project}/", f"{tmp_path / 'data'}{slash}")
    assert (tmp_path / "data").is_symlink()
    assert _tree(big) == _tree(project)


def test_a_pull_from_a_linked_folder_brings_what_it_points_at(machine, tmp_path, project):
    (tmp_path / "data").symlink_to(project)
    back = tmp_path / "back"
    machine.pull(f"{tmp_path / 'data'}/", str(back))
    assert not back.is_symlink() and _tree(back) == _tree(project)


def test_a_pull_into_a_linked_folder_here_keeps_the_link(machine, tmp_path, project):
    big = tmp_path / "big" / "runs"
    big.mkdir(parents=True)
    (tmp_path / "runs").symlink_to(big)
    machine.pull(f"{project}/", str(tmp_path / "runs"))
    assert (tmp_path / "runs").is_symlink(), "the link was replaced by a folder"
    assert _tree(big) == _tree(project)
    # and again, when everything is there already
    summary = machine.pull(f"{project}/", str(tmp_path / "runs"))
    assert summary.files_sent == 0 and (tmp_path / "runs").is_symlink()


def test_a_delete_into_a_link_to_a_folder_holding_ssh_is_refused(machine, tmp_path, project):
    # followed, the link's folder is what --delete would empty: the guards see what it holds
    home_like = tmp_path / "home"
    (home_like / ".ssh").mkdir(parents=True)
    (home_like / ".ssh" / "authorized_keys").write_text("ssh-ed25519 AAAA key\n", encoding="utf-8")
    (tmp_path / "work").symlink_to(home_like)
    from gpumagic.errors import SyncError

    with pytest.raises(SyncError) as e:
        machine.push(f"{project}/", str(tmp_path / "work"), delete=True)
    assert ".ssh" in e.value.message, e.value.message
    assert (home_like / ".ssh" / "authorized_keys").exists()
