"""Benchmark: ``%gpu sync`` (gpumagic.Machine.push/pull) against ``rsync -a -e ssh``.

Starts its own loopback OpenSSH sshd (gpumagic.ssh.sandbox.SshServer), builds a tree of
2,000 files of 1-8 KiB plus one 200 MiB file, and times, for each tool (runs interleaved,
median of ``--runs``):

* first push    -- into an empty directory
* no-change     -- the same push again
* one-file      -- after one small file changed
* pull          -- the whole tree into an empty local directory

It prints gpumagic / rsync ratios.  gpumagic's connection is opened once beforehand (as in
a notebook); rsync pays its own ssh handshake each time, as it does when typed by hand.

    PYTHONPATH=. python benchmarks/sync_vs_rsync.py [--files 2000] [--big-mib 200] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from gpumagic.machine import Machine
from gpumagic.ssh.sandbox import SshServer

TARGETS = {"first push": 1.0, "no-change resync": 0.3, "one-file resync": 0.5, "pull": None}


def build_tree(root: Path, files: int, big_mib: int) -> None:
    rng = random.Random(1)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        d = root / f"pkg{i % 40:02d}" / f"sub{i % 7}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"file_{i:04d}.py").write_bytes(os.urandom(rng.randint(1024, 8192)))
    if big_mib:
        with open(root / "weights.bin", "wb") as f:
            for _ in range(big_mib):
                f.write(os.urandom(1 << 20))


def rsync_argv(server: SshServer, src: str, dst: str) -> list[str]:
    ssh = (f"ssh -F /dev/null -i {server.client_key} -p {server.port} "
           f"-o UserKnownHostsFile={server.known_hosts} -o StrictHostKeyChecking=yes "
           f"-o IdentitiesOnly=yes -o BatchMode=yes")
    return ["rsync", "-a", "-e", ssh, src, dst]


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--big-mib", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()

    base = Path(tempfile.mkdtemp(prefix="gpumagic-bench-"))
    server = SshServer(base / "sshd", env={"HOME": str(base)}).start()
    remote_host = f"{server.user}@{server.host}"
    try:
        src = base / "tree"
        build_tree(src, args.files, args.big_mib)
        machine = Machine(server.spec()).connect()
        times = {k: {"gpumagic": [], "rsync": []} for k in TARGETS}

        def rsync_push(dst: Path):
            subprocess.run(rsync_argv(server, f"{src}/", f"{remote_host}:{dst}/"), check=True)

        def rsync_pull(remote: Path, dst: Path):
            subprocess.run(rsync_argv(server, f"{remote_host}:{remote}/", f"{dst}/"), check=True)

        small = next(p for p in sorted(src.rglob("*.py")))
        for run in range(args.runs):
            for tool in ("rsync", "gpumagic") if run % 2 == 0 else ("gpumagic", "rsync"):
                dst = base / f"remote-{tool}"
                shutil.rmtree(dst, ignore_errors=True)
                push = (lambda: rsync_push(dst)) if tool == "rsync" else \
                    (lambda: machine.push(f"{src}/", str(dst)))
                times["first push"][tool].append(timed(push))
                times["no-change resync"][tool].append(timed(push))
                small.write_bytes(os.urandom(4000))
                os.utime(small, (time.time() + run + 1, time.time() + run + 1))
                times["one-file resync"][tool].append(timed(push))
                back = base / f"back-{tool}"
                shutil.rmtree(back, ignore_errors=True)
                pull = (lambda: rsync_pull(dst, back)) if tool == "rsync" else \
                    (lambda: machine.pull(f"{dst}/", str(back)))
                times["pull"][tool].append(timed(pull))
                shutil.rmtree(back, ignore_errors=True)
        # both tools end with the same tree (a sanity check, not timed)
        rsync_push(base / "remote-rsync")
        machine.push(f"{src}/", str(base / "remote-gpumagic"))
        out = subprocess.run(["diff", "-r", str(base / "remote-rsync"), str(base / "remote-gpumagic")],
                             capture_output=True, text=True)
        print(f"tree: {args.files} files of 1-8 KiB + one {args.big_mib} MiB file; "
              f"median of {args.runs} runs; trees equal: {out.returncode == 0}")
        print(f"{'case':18} {'gpumagic s':>11} {'rsync s':>9} {'ratio':>7}  target")
        for case, target in TARGETS.items():
            g = statistics.median(times[case]["gpumagic"])
            r = statistics.median(times[case]["rsync"])
            verdict = "" if target is None else (f"<= {target:.1f}x " + ("met" if g / r <= target else "MISSED"))
            print(f"{case:18} {g:11.3f} {r:9.3f} {g / r:6.2f}x  {verdict}")
        machine.close()
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
