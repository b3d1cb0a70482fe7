"""The sync agent travels once per connection (issue 29, round trips and bytes as a budget):
the first sync keeps it on the machine as ``~/.gpumagic/sync_agent_HASH.py`` and runs it from
there, later syncs on that connection send a few hundred bytes instead of its ~70 KB source.
Counted on the emulated link (tests/linkemu.py), never timed."""

from __future__ import annotations

import os
import stat
import shutil
from pathlib import Path

import pytest

from gpumagic.errors import SyncError
from gpumagic.sync import engine as sync

SOURCE = len(sync.AGENT_SOURCE.encode())


def _tree(root: Path) -> Path:
    for i in range(20):
        (root / "src" / f"d{i % 4}").mkdir(parents=True, exist_ok=True)
        (root / "src" / f"d{i % 4}" / f"f{i}.py").write_text(f"x = {i}\n" * 50, encoding="utf-8")
    return root / "src"


def _kept(sshd) -> Path:
    return Path(sshd.env["HOME"]) / ".gpumagic" / f"sync_agent_{sync.agent_digest()}.py"


def test_the_agent_goes_up_once_per_connection_and_a_no_change_resync_then_sends_under_8_kb(
        make_link, sshd, tmp_path):
    linked = make_link(rtt_ms=40, up_mbit=20, down_mbit=50)
    m = linked.machine
    src = _tree(tmp_path)
    before = linked.settle()
    m.push(f"{src}/", "kept-agent-a")
    first = linked.settle() - before
    assert first.up_bytes > SOURCE  # the agent's source went up with the first sync
    kept = _kept(sshd)
    assert kept.read_text(encoding="utf-8") == sync.AGENT_SOURCE.rstrip("\n") + "\n"
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    before = linked.settle()
    s = m.push(f"{src}/", "kept-agent-a")
    again = linked.settle() - before
    assert s.files_sent == 0 and again.up_bytes < 8192, again  # was SOURCE + a few KB each time
    # a new connection (a rebuilt machine may answer): the whole agent again, once
    m.close()
    before = linked.settle()
    m.push(f"{src}/", "kept-agent-a")
    assert (linked.settle() - before).up_bytes > SOURCE


def test_an_agent_removed_while_connected_is_one_clear_error_and_the_next_sync_sends_it_again(
        machine, sshd, tmp_path):
    src = _tree(tmp_path)
    machine.push(f"{src}/", "kept-agent-b")
    _kept(sshd).unlink()
    with pytest.raises(SyncError, match=r"^the sync helper gpumagic keeps on testgpu \(~/.gpumagic/sync_agent_"
                                        r"[0-9a-f]{16}\.py\) was removed meanwhile") as e:
        machine.push(f"{src}/", "kept-agent-b")
    assert e.value.hint == "run the sync again: it is sent anew"
    assert machine.push(f"{src}/", "kept-agent-b").files_sent == 0
    assert _kept(sshd).exists()


def test_the_kept_agent_runs_imported_so_its_bytecode_is_kept_too(machine, sshd, tmp_path):
    """Run as a script, python3 compiled the 70 KB agent at every start (29 against 12 ms
    imported, measured): the kept one is imported, and Python keeps its bytecode beside it,
    written once, read by each later start."""
    src = _tree(tmp_path)
    machine.push(f"{src}/", "kept-agent-d")
    cache = list((_kept(sshd).parent / "__pycache__").glob(f"sync_agent_{sync.agent_digest()}.*.pyc"))
    assert len(cache) == 1
    before = cache[0].stat().st_mtime_ns
    assert machine.push(f"{src}/", "kept-agent-d").files_sent == 0
    machine.pull("kept-agent-d/", str(tmp_path / "back"))
    assert cache[0].stat().st_mtime_ns == before
    assert stat.S_IMODE(cache[0].stat().st_mode) == 0o600  # as its source
    assert stat.S_IMODE(cache[0].parent.stat().st_mode) == 0o700  # private state, not the umask's
    shutil.rmtree(Path(sshd.env["HOME"]) / "kept-agent-d", ignore_errors=True)


@pytest.mark.parametrize("damage", ["cut short", "garbled"])
def test_kept_bytecode_that_does_not_load_is_made_again_and_the_sync_goes_on(machine, sshd, tmp_path, damage):
    """Python writes bytecode without checking the length written: on a nearly full disk it
    left the agent's cut short, and every later sync failed with "marshal data too short"
    (found by a fresh-user trial on a 200 KB tmpfs).  Its 16-byte header still matches the
    source, so Python does not skip it by itself."""
    src = _tree(tmp_path)
    dest = Path(sshd.env["HOME"]) / "kept-agent-e"
    machine.push(f"{src}/", str(dest))
    [pyc] = (_kept(sshd).parent / "__pycache__").glob(f"sync_agent_{sync.agent_digest()}.*.pyc")
    whole = pyc.read_bytes()
    pyc.write_bytes(whole[:len(whole) // 2] if damage == "cut short" else whole[:16] + b"\xff" * 4096)
    (src / "d0" / "f0.py").write_text("x = 'edited'\n", encoding="utf-8")
    assert machine.push(f"{src}/", str(dest)).files_sent == 1
    assert (dest / "d0" / "f0.py").read_text(encoding="utf-8") == "x = 'edited'\n"
    assert pyc.read_bytes() == whole  # made again, for the next sync
    assert machine.push(f"{src}/", str(dest)).files_sent == 0
    shutil.rmtree(dest, ignore_errors=True)


def test_a_home_where_nothing_can_be_kept_runs_the_agent_whole_every_time(machine, sshd, tmp_path, monkeypatch):
    src = _tree(tmp_path)
    home = Path(sshd.env["HOME"])
    saved = home / ".gpumagic-saved-by-test"
    sent: list[int] = []
    real = sync.agent_command
    monkeypatch.setattr(sync, "agent_command",
                        lambda *a, **kw: (sent.append(len(command := real(*a, **kw))), command)[1])
    os.rename(home / ".gpumagic", saved)
    try:
        (home / ".gpumagic").write_text("not a folder\n", encoding="utf-8")  # mkdir -p fails there
        for _ in range(2):
            assert machine.push(f"{src}/", "kept-agent-c").files_sent in (0, 20)
    finally:
        (home / ".gpumagic").unlink()
        os.rename(saved, home / ".gpumagic")
    assert len(sent) == 2 and all(n > SOURCE for n in sent)  # never the short form: nothing was kept
    shutil.rmtree(home / "kept-agent-c", ignore_errors=True)

