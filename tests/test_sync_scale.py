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


# -- the tar stream (agent's own writer and reader) ---------------------------------------

_NAMES = ["a.txt", "d/" + "n" * 150 + ".bin", "héllo wörld/ü.py", "bad\udcff.dat", "x" * 99]


def test_tarfile_reads_what_the_agent_writes(tmp_path):
    import io
    import tarfile

    buf = io.BytesIO()
    for i, name in enumerate(_NAMES):
        data = bytes([i]) * (i * 700)
        agent.write_tar_file(buf, name, io.BytesIO(data), len(data), 0o640 + i, 1_700_000_000 + i)
    buf.write(agent.tar_header("d", "d", 0, 0o755, 1_600_000_000))
    buf.write(agent.tar_header("link", "l", 0, 0o777, 5, "t" * 120 + "é"))
    agent.end_tar(buf)
    buf.seek(0)
    with tarfile.open(fileobj=buf, mode="r:", encoding="utf-8", errors="surrogateescape") as tf:
        members = tf.getmembers()
        assert [m.name for m in members] == _NAMES + ["d", "link"]
        for i, m in enumerate(members[:len(_NAMES)]):
            assert (m.size, m.mode, m.mtime) == (i * 700, 0o640 + i, 1_700_000_000 + i)
            assert tf.extractfile(m).read() == bytes([i]) * (i * 700)
        assert members[-2].isdir() and members[-2].mtime == 1_600_000_000
        assert members[-1].issym() and members[-1].linkname == "t" * 120 + "é"


@pytest.mark.parametrize("fmt", ["PAX_FORMAT", "GNU_FORMAT", "USTAR_FORMAT"])
def test_the_agent_extracts_what_tarfile_writes(tmp_path, fmt):
    import io
    import tarfile

    names = _NAMES if fmt != "USTAR_FORMAT" else ["a.txt", "p" * 120 + "/q.bin"]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=getattr(tarfile, fmt), encoding="utf-8",
                      errors="surrogateescape") as tf:
        for i, name in enumerate(names):
            data = os.urandom(i * 3000 + 1)
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime = len(data), 0o600 + i, 1_650_000_000 + i
            tf.addfile(ti, io.BytesIO(data))
            (tmp_path / f"want{i}").write_bytes(data)
    buf.seek(0)
    seen = []
    out = tmp_path / "out"
    assert agent.extract(str(out), buf, on_file=seen.append) == len(names)
    assert seen == names
    for i, name in enumerate(names):
        p = out / name
        assert p.read_bytes() == (tmp_path / f"want{i}").read_bytes()
        assert (p.stat().st_mode & 0o777, int(p.stat().st_mtime)) == (0o600 + i, 1_650_000_000 + i)
    assert not _parts(out)


def test_files_above_the_small_size_keep_the_stream_in_step(tmp_path):
    # A file of more than agent.SMALL bytes (written through a part file) whose size is not a
    # multiple of 512 skipped one block of padding too many: the next member's header was read
    # from the wrong place ("damaged header", or a name missing its first letters).
    import io
    import tarfile

    sizes = [agent.SMALL - 1, agent.SMALL, agent.SMALL + 1, agent.SMALL + 513, 3_000_000, 11]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for i, n in enumerate(sizes):
            data = os.urandom(n)
            ti = tarfile.TarInfo(f"d/f{i}")
            ti.size, ti.mode, ti.mtime = n, 0o644, 1_650_000_000
            tf.addfile(ti, io.BytesIO(data))
            (tmp_path / f"want{i}").write_bytes(data)
    buf.seek(0)
    out = tmp_path / "out"
    assert agent.extract(str(out), buf) == len(sizes)
    for i in range(len(sizes)):
        assert (out / "d" / f"f{i}").read_bytes() == (tmp_path / f"want{i}").read_bytes(), i


def test_push_and_pull_of_files_just_above_the_small_size(machine, tmp_path):
    src = tmp_path / "src"
    (src / "exp1").mkdir(parents=True)
    (src / "exp1" / "last.pt").write_bytes(os.urandom(agent.SMALL + 1))
    (src / "exp1" / "metrics.csv").write_text("epoch,loss\n")
    machine.push(str(src) + "/", "~/small-edge/")
    back = tmp_path / "back"
    machine.pull("~/small-edge/", str(back) + "/")
    for name in ("exp1/last.pt", "exp1/metrics.csv"):
        assert (back / name).read_bytes() == (src / name).read_bytes(), name


def test_a_cut_or_damaged_stream_leaves_no_file_under_its_name(tmp_path):
    import io

    data = os.urandom(5000)
    whole = io.BytesIO()
    agent.write_tar_file(whole, "f.bin", io.BytesIO(data), len(data), 0o644, 1)
    agent.end_tar(whole)
    raw = whole.getvalue()
    with pytest.raises(EOFError):
        agent.extract(str(tmp_path / "cut"), io.BytesIO(raw[:3000]))
    assert not (tmp_path / "cut" / "f.bin").exists() and not _parts(tmp_path / "cut")
    bad = bytearray(raw)
    bad[10] ^= 1
    with pytest.raises(agent.AgentError, match="damaged header"):
        agent.extract(str(tmp_path / "bad"), io.BytesIO(bytes(bad)))
    assert not _parts(tmp_path / "bad")
    # a big file (written in chunks) cut short: nothing under its name, no part left
    big = os.urandom(agent.SMALL + 10)
    s = io.BytesIO()
    agent.write_tar_file(s, "big.bin", io.BytesIO(big), len(big), 0o644, 1)
    with pytest.raises(EOFError):
        agent.extract(str(tmp_path / "bigcut"), io.BytesIO(s.getvalue()[:len(big) // 2]))
    assert not (tmp_path / "bigcut" / "big.bin").exists() and not _parts(tmp_path / "bigcut")


def test_a_file_that_shrinks_while_it_is_sent_is_refused(tmp_path):
    import io

    with pytest.raises(agent.AgentError, match="shrank"):
        agent.write_tar_file(io.BytesIO(), "f", io.BytesIO(b"abc"), 10, 0o644, 1)


# -- progress --------------------------------------------------------------------------------


class _TimedProgress:
    """A progress callback (tqdm's text bar into a buffer) that times itself."""

    def __init__(self):
        import io

        from gpumagic.notebook.widgets import SyncProgressText

        self.bar = SyncProgressText(file=io.StringIO())
        self.calls = 0
        self.seconds = 0.0

    def __call__(self, p):
        t = time.perf_counter()
        self.bar(p)
        self.seconds += time.perf_counter() - t
        self.calls += 1


def test_progress_for_many_files_is_throttled_and_costs_under_2_percent(machine, tmp_path):
    src = tmp_path / "src"
    for i in range(3000):
        d = src / f"d{i % 30}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}.txt").write_bytes(b"x" * 100)
    progress = _TimedProgress()
    t = time.perf_counter()
    s = machine.push(f"{src}/", str(tmp_path / "remote"), progress=progress)
    wall = time.perf_counter() - t
    progress.bar.close()
    assert s.files_sent == 3000
    # at most one call per PROGRESS_INTERVAL, plus the first and the last
    assert progress.calls <= wall / sync.PROGRESS_INTERVAL + 2, (progress.calls, wall)
    assert progress.seconds < 0.02 * wall, (progress.seconds, wall)
    # what every file costs the throttle itself (the callback not due): far under 2%
    run = sync._Run(sync.Plan(), sync.SyncSummary("push", "a", "b"), progress)
    t = time.perf_counter()
    for i in range(3000):
        run.file_done("x", 100)
    assert time.perf_counter() - t < 0.02 * wall
