"""%gpu sync at scale (issue 20): files that grew by appending send only the new bytes,
counted on the channel; progress callbacks are throttled."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from gpumagic.sync import agent
from gpumagic.sync import engine as sync

MIB = 1 << 20


@pytest.fixture
def wire(monkeypatch):
    """Bytes the sync channels carry: {"sent": n, "received": n} (payload of every agent
    channel, tar headers and listings included)."""
    count = {"sent": 0, "received": 0}
    send, recv = sync._Channel.send, sync._Channel._recv

    def counted_send(self, data):
        count["sent"] += len(data)
        return send(self, data)

    def counted_recv(self):
        data = recv(self)
        count["received"] += len(data)
        return data

    monkeypatch.setattr(sync._Channel, "send", counted_send)
    monkeypatch.setattr(sync._Channel, "_recv", counted_recv)
    return count


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _append(p: Path, n: int) -> None:
    with open(p, "ab") as f:
        f.write(os.urandom(n))
    t = time.time() + 5
    os.utime(p, (t, t))


def _parts(root: Path) -> list[Path]:
    return list(root.rglob("*" + agent.PART_SUFFIX))


def test_push_after_appending_1_mib_to_a_20_mib_file_sends_at_most_2_mib(machine, tmp_path, wire):
    src = tmp_path / "src"
    (src / "logs").mkdir(parents=True)
    log = src / "logs" / "train.log"
    log.write_bytes(os.urandom(20 * MIB))
    (src / "metrics.csv").write_bytes(os.urandom(300 * 1024))
    remote = tmp_path / "remote"
    machine.push(f"{src}/", str(remote))
    _append(log, MIB)
    _append(src / "metrics.csv", 1000)
    wire["sent"] = 0
    s = machine.push(f"{src}/", str(remote))
    assert wire["sent"] <= 2 * MIB, wire
    assert s.files_sent == 2 and s.bytes_sent == MIB + 1000
    assert _digest(remote / "logs" / "train.log") == _digest(log)
    assert _digest(remote / "metrics.csv") == _digest(src / "metrics.csv")
    assert int(os.stat(remote / "logs" / "train.log").st_mtime) == int(log.stat().st_mtime)
    assert not _parts(remote)


def test_pull_after_appending_1_mib_to_a_20_mib_file_receives_at_most_2_mib(machine, tmp_path, wire):
    remote = tmp_path / "remote"
    remote.mkdir()
    log = remote / "events.out.tfevents"
    log.write_bytes(os.urandom(20 * MIB))
    back = tmp_path / "back"
    machine.pull(f"{remote}/", str(back))
    _append(log, MIB)
    wire["received"] = 0
    s = machine.pull(f"{remote}/", str(back))
    assert wire["received"] <= 2 * MIB, wire
    assert s.files_sent == 1 and s.bytes_sent == MIB
    assert _digest(back / "events.out.tfevents") == _digest(log)
    assert not _parts(back)
    # one file pulled by name takes the same way
    _append(log, MIB)
    wire["received"] = 0
    machine.pull(str(log), str(back / "events.out.tfevents"))
    assert wire["received"] <= 2 * MIB, wire
    assert _digest(back / "events.out.tfevents") == _digest(log)


def test_a_changed_file_that_did_not_grow_by_appending_is_sent_whole(machine, tmp_path, wire):
    src = tmp_path / "src"
    src.mkdir()
    f = src / "ckpt.pt"
    f.write_bytes(os.urandom(2 * MIB))
    remote = tmp_path / "remote"
    machine.push(f"{src}/", str(remote))
    f.write_bytes(os.urandom(3 * MIB))  # bigger, but its first bytes differ
    wire["sent"] = 0
    s = machine.push(f"{src}/", str(remote))
    assert s.bytes_sent == 3 * MIB and wire["sent"] >= 3 * MIB
    assert _digest(remote / "ckpt.pt") == _digest(f)
    assert not _parts(remote)
    back = tmp_path / "back"
    machine.pull(f"{remote}/", str(back))
    (remote / "ckpt.pt").write_bytes(os.urandom(4 * MIB))
    os.utime(remote / "ckpt.pt", (time.time() + 9, time.time() + 9))
    s = machine.pull(f"{remote}/", str(back))
    assert s.bytes_sent == 4 * MIB
    assert _digest(back / "ckpt.pt") == _digest(remote / "ckpt.pt")
    assert not _parts(back)
