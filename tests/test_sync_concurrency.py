"""Two writers of one tree at once (two notebooks syncing the same project), and resumes.

Each writer must use part files of its own and never truncate or rename another's; a file
is renamed into place only whole (its size checked, and a resumed one's sha256), so no
file is ever visible under its final name at the wrong size, and a reported success means
every file is whole.  A part file is taken over for a resume only when its writer is gone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpumagic.sync import agent
from gpumagic.sync import engine as sync
from gpumagic.sync import laptop
from gpumagic.errors import GpumagicError, SyncError

BIG = 64 << 20


def _tree(root: Path) -> dict[str, int]:
    """A large file, a second large one, and 300 small files; returns path -> size."""
    sizes = {}
    root.mkdir(parents=True)
    for i in range(300):
        rel = f"pkg{i % 6}/m{i:03d}.py"
        (root / rel).parent.mkdir(exist_ok=True)
        (root / rel).write_bytes(os.urandom(2000 + 37 * i))
        sizes[rel] = 2000 + 37 * i
    with open(root / "weights.bin", "wb") as f:
        for _ in range(BIG >> 20):
            f.write(os.urandom(1 << 20))
    sizes["weights.bin"] = BIG
    (root / "pkg0" / "opt.bin").write_bytes(os.urandom(sync.LARGE_FILE + 999))
    sizes["pkg0/opt.bin"] = sync.LARGE_FILE + 999
    return sizes


class _Poller(threading.Thread):
    """Watches ``root`` until stopped: any file under its final name whose size differs
    from the source's is recorded (a rename of a part must be the only way in)."""

    def __init__(self, root: Path, sizes: dict[str, int]):
        super().__init__(daemon=True)
        self.root, self.sizes = root, sizes
        self.wrong: list[tuple[str, int]] = []
        self.seen = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for dirpath, _dirs, files in os.walk(self.root):
                for name in files:
                    if name.endswith(agent.PART_SUFFIX) or name.startswith(laptop.PROBE_PREFIX):
                        continue  # a part, or the file-system probe's own empty file
                    p = os.path.join(dirpath, name)
                    rel = os.path.relpath(p, self.root).replace(os.sep, "/")
                    try:
                        size = os.lstat(p).st_size
                    except FileNotFoundError:
                        continue
                    self.seen += 1
                    if size != self.sizes.get(rel):
                        self.wrong.append((rel, size))
            time.sleep(0.002)


def _same(a: Path, b: Path, sizes: dict[str, int]) -> list[str]:
    return [rel for rel in sizes if (a / rel).read_bytes() != (b / rel).read_bytes()]


def _parts(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("*" + agent.PART_SUFFIX))


def _race(jobs) -> list:
    """Run the callables at once; their results or exceptions."""
    out: list = [None] * len(jobs)
    start = threading.Barrier(len(jobs))

    def go(i, job):
        start.wait()
        try:
            out[i] = job()
        except BaseException as e:  # noqa: BLE001 - returned to the test
            out[i] = e

    threads = [threading.Thread(target=go, args=(i, j), daemon=True) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not any(t.is_alive() for t in threads), "a sync hung"
    return out


def _check_outcomes(results) -> None:
    """Both succeed, or one fails with a clear one-line message (never a misleading one)."""
    ok = [r for r in results if isinstance(r, sync.SyncSummary)]
    assert ok, results
    for r in results:
        if not isinstance(r, sync.SyncSummary):
            assert isinstance(r, GpumagicError) and r.hint, repr(r)
            assert "no message" not in r.message and "will not help" not in (r.hint or ""), r


@pytest.fixture
def two_machines(sshd):
    import gpumagic

    a, b = gpumagic.connect("testgpu"), gpumagic.connect("testgpu")
    assert a.connection is not b.connection
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("round_", [1, 2])
def test_two_pushes_of_one_tree_at_once(two_machines, tmp_path, round_):
    a, b = two_machines
    src = tmp_path / "src"
    sizes = _tree(src)
    remote = tmp_path / "remote"
    remote.mkdir()
    poller = _Poller(remote, sizes)
    poller.start()
    try:
        results = _race([lambda: a.push(str(src) + "/", str(remote)),
                         lambda: b.push(str(src) + "/", str(remote))])
    finally:
        poller.stop.set()
        poller.join()
    assert poller.seen > 0 and poller.wrong == []
    _check_outcomes(results)
    assert _same(src, remote, sizes) == []
    assert _parts(remote) == []


def test_two_pulls_into_one_directory_at_once(two_machines, tmp_path):
    a, b = two_machines
    remote = tmp_path / "remote"
    sizes = _tree(remote)
    local = tmp_path / "local"
    local.mkdir()
    poller = _Poller(local, sizes)
    poller.start()
    try:
        results = _race([lambda: a.pull(str(remote) + "/", str(local)),
                         lambda: b.pull(str(remote) + "/", str(local))])
    finally:
        poller.stop.set()
        poller.join()
    assert poller.seen > 0 and poller.wrong == []
    _check_outcomes(results)
    assert _same(remote, local, sizes) == []
    assert _parts(local) == []


PULL_SCRIPT = """
import sys
from gpumagic.machine import Machine
from gpumagic.ssh.hosts import HostSpec
spec = HostSpec(alias="testgpu", hostname="127.0.0.1", port=int(sys.argv[1]), user=sys.argv[2],
                identity_files=(sys.argv[3],), identities_only=True, known_hosts=sys.argv[4])
with Machine(spec) as m:
    s = m.pull(sys.argv[5], sys.argv[6])
print("OK", s.files_sent)
"""


def test_two_pull_processes_into_one_directory_at_once(sshd, tmp_path):
    remote = tmp_path / "remote"
    sizes = _tree(remote)
    local = tmp_path / "local"
    local.mkdir()
    poller = _Poller(local, sizes)
    poller.start()
    argv = [sys.executable, "-c", PULL_SCRIPT, str(sshd.port), sshd.user, str(sshd.client_key),
            str(sshd.known_hosts), str(remote) + "/", str(local)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    try:
        procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, encoding="utf-8")
                 for _ in range(2)]
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        poller.stop.set()
        poller.join()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out.startswith("OK"), err[-2000:]
    assert poller.seen > 0 and poller.wrong == []
    assert _same(remote, local, sizes) == []
    assert _parts(local) == []


# -- part files: names, owners, resume ----------------------------------------------------------


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _part(target: Path, pid: int) -> Path:
    return target.parent / f".{target.name}.{agent._HOST}-{pid}-0123abcd1{agent.PART_SUFFIX}"


def test_part_names_are_per_writer_and_parse_back(tmp_path):
    target = tmp_path / "model.ckpt"
    a, ta = agent.new_part_name(str(target))
    b, tb = agent.new_part_name(str(target))
    try:
        assert a != b and ta != tb
        for p in (a, b):
            assert agent.parse_part(os.path.basename(p))[0] == "model.ckpt"
            assert agent.real_name(p) == str(target)
        assert agent.parse_part(".model.ckpt.gpumagic-part") == ("model.ckpt", None)  # older gpumagic
        assert agent.parse_part("model.ckpt") is None
        Path(a).write_bytes(b"x")
        assert agent.part_state(a) == "busy"  # this process still writes it
    finally:
        agent.release(ta)
        agent.release(tb)
    assert agent.part_state(a) == "gone"


def test_part_of_a_dead_process_is_abandoned_and_of_a_live_one_is_not(tmp_path):
    target = tmp_path / "w.bin"
    dead = _part(target, _dead_pid())
    dead.write_bytes(b"d" * 10)
    live = _part(target, os.getppid())
    live.write_bytes(b"l" * 20)
    assert agent.part_state(str(dead)) == "gone"
    assert agent.part_state(str(live)) == "busy"
    assert agent.abandoned_parts(str(target)) == [str(dead)]
    legacy = tmp_path / ".w.bin.gpumagic-part"
    legacy.write_bytes(b"old")
    assert agent.part_state(str(legacy)) == "gone"
    with open(legacy, "rb+") as f:  # an older gpumagic held its part locked while writing
        assert agent._try_lock(f) is True
        assert agent.part_state(str(legacy)) == "busy"
    assert agent.part_state(str(legacy)) == "gone"


def test_push_never_takes_over_a_part_whose_writer_runs(machine, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(sync.LARGE_FILE + 5000)
    (src / "w.bin").write_bytes(data)
    remote = tmp_path / "remote"
    remote.mkdir()
    live = _part(remote / "w.bin", os.getpid())  # this test process: alive
    live.write_bytes(data[:3_000_000])
    s = machine.push(str(src) + "/", str(remote))
    assert s.bytes_resumed == 0 and (remote / "w.bin").read_bytes() == data
    assert live.read_bytes() == data[:3_000_000]  # untouched
    live.unlink()
    dead = _part(remote / "w.bin", _dead_pid())
    dead.write_bytes(data[:3_000_000])
    (remote / "w.bin").unlink()
    s = machine.push(str(src) + "/", str(remote))
    assert (s.bytes_resumed, s.bytes_sent) == (3_000_000, len(data) - 3_000_000)
    assert (remote / "w.bin").read_bytes() == data and _parts(remote) == []


def test_abandoned_parts_of_unchanged_or_small_files_are_removed(machine, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a", encoding="utf-8")
    remote = tmp_path / "remote"
    machine.push(str(src) + "/", str(remote))
    _part(remote / "a.txt", _dead_pid()).write_bytes(b"left by a killed writer")
    _part(remote / "gone.txt", _dead_pid()).write_bytes(b"of a file no longer there")
    live = _part(remote / "a.txt", os.getpid())
    live.write_bytes(b"still being written")
    s = machine.push(str(src) + "/", str(remote))
    assert s.files_sent == 0
    assert _parts(remote) == [str(live)]
    # and on this side, for a pull
    local = tmp_path / "local"
    machine.pull(str(remote) + "/", str(local))
    _part(local / "a.txt", _dead_pid()).write_bytes(b"x")
    machine.pull(str(remote) + "/", str(local))
    assert _parts(local) == []


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_a_resumed_file_whose_part_changed_underneath_is_never_renamed(machine, tmp_path, monkeypatch,
                                                                       direction):
    """The sha256 of a resumed file is checked before its rename: here the kept prefix of
    the part is overwritten mid-transfer (as a foreign writer would), and the check fails."""
    monkeypatch.setattr(sync, "PROGRESS_INTERVAL", 0)
    size = 24 << 20
    data = os.urandom(size)
    source = tmp_path / "source"
    source.mkdir()
    (source / "w.bin").write_bytes(data)
    dest = tmp_path / "dest"
    dest.mkdir()
    _part(dest / "w.bin", _dead_pid()).write_bytes(data[:4_000_000])
    spoiled = []

    def spoil(p):
        if p.bytes_done > 8_000_000 and not spoiled:
            (part,) = dest.glob("*" + agent.PART_SUFFIX)
            with open(part, "r+b") as f:
                f.write(b"\0" * 1000)
            spoiled.append(part)

    go = machine.push if direction == "push" else machine.pull
    with pytest.raises(SyncError) as e:
        go(str(source) + "/", str(dest), progress=spoil)
    assert spoiled and "does not hash to the source's sha256" in e.value.message
    assert not (dest / "w.bin").exists() and _parts(dest) == []
    s = go(str(source) + "/", str(dest))
    assert s.bytes_resumed == 0 and (dest / "w.bin").read_bytes() == data
