"""Benchmark: ``%gpu sync`` (gpumagic.Machine.push/pull) against ``rsync -a -e ssh``.

Starts its own loopback OpenSSH sshd (gpumagic.ssh.sandbox.SshServer) and times, for each
tool (runs interleaved, median of ``--runs``), the cases of issue 20:

* many: first push of ``--many`` files of ``--many-size`` bytes in ``--folders`` folders,
  then the no-change resync of that tree; gpumagic's client peak RSS
  (``resource.getrusage``, this process) after it
* pull: ``--files`` files of 1-8 KiB plus one ``--big-mib`` MiB file, pulled into an empty
  directory; then the no-change resync of that tree (a push)
* one-file: a push after one small file of that tree changed
* huge: one file of ``--huge-mib`` MiB (2 GiB by default), pushed; throughput
* append: ``--append-base-mib`` MiB pushed, then 1 MiB appended and pushed again: bytes
  gpumagic's channels carried (counted on them) and rsync's "Total bytes sent"

It prints each ratio (gpumagic / rsync), its target and whether it was met.  gpumagic's
connection is opened once beforehand (as in a notebook); rsync pays its own ssh handshake
each time, as it does when typed by hand.

    PYTHONPATH=. python benchmarks/sync_vs_rsync.py            # issue 20's sizes
    PYTHONPATH=. python benchmarks/sync_vs_rsync.py --quick    # 20,000 files, 256 MiB, 100 MiB
    ... --cases many,pull --many 50000 --runs 1
    ... --dir /dev/shm                                         # trees on tmpfs
"""

from __future__ import annotations

import argparse
import os
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpumagic.machine import Machine
from gpumagic.ssh.sandbox import SshServer
from gpumagic.sync import engine

MIB = 1 << 20
CASES = ("many", "pull", "huge", "append")


def build_pull_tree(root: Path, files: int, big_mib: int) -> None:
    rng = random.Random(1)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        d = root / f"pkg{i % 40:02d}" / f"sub{i % 7}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"file_{i:04d}.py").write_bytes(os.urandom(rng.randint(1024, 8192)))
    if big_mib:
        write_random(root / "weights.bin", big_mib)


def build_many(root: Path, files: int, size: int, folders: int) -> None:
    payload = os.urandom(size)
    for i in range(files):
        d = root / f"d{i % folders:03d}"
        if i < folders:
            d.mkdir(parents=True)
        (d / f"img{i:06d}.jpg").write_bytes(payload)


def write_random(path: Path, mib: int, mode: str = "wb") -> None:
    block = os.urandom(MIB)
    with open(path, mode) as f:
        for i in range(mib):
            f.write(block[i % 997:] + block[:i % 997])  # no two MiB alike, cheap to make


def rsync_argv(server: SshServer, src: str, dst: str, *extra: str) -> list[str]:
    ssh = (f"ssh -F /dev/null -i {server.client_key} -p {server.port} "
           f"-o UserKnownHostsFile={server.known_hosts} -o StrictHostKeyChecking=yes "
           f"-o IdentitiesOnly=yes -o BatchMode=yes")
    return ["rsync", "-a", *extra, "-e", ssh, src, dst]


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class WireCount:
    """Bytes gpumagic's sync channels carry (payload, both ways), counted on _Channel."""

    def __init__(self):
        self.sent = self.received = 0
        send, recv = engine._Channel.send, engine._Channel._recv
        me = self

        def counted_send(ch, data):
            me.sent += len(data)
            return send(ch, data)

        def counted_recv(ch):
            data = recv(ch)
            me.received += len(data)
            return data

        engine._Channel.send, engine._Channel._recv = counted_send, counted_recv


class TimedProgress:
    """The notebook's progress widget (not displayed; tqdm's text bar without ipywidgets),
    timing every call made to it."""

    def __init__(self):
        from gpumagic.notebook import widgets

        try:
            self.view, self.kind = widgets.SyncProgressBar(display=False), "widget"
        except ImportError:
            self.view, self.kind = widgets.SyncProgressText(file=open(os.devnull, "w")), "tqdm"
        self.calls, self.seconds = 0, 0.0

    def __call__(self, p) -> None:
        t = time.perf_counter()
        self.view(p)
        self.seconds += time.perf_counter() - t
        self.calls += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="smaller sizes for a loaded machine: 20,000 files, 256 MiB, 100 MiB")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--many", type=int, default=None, help="files of the many case (100000)")
    ap.add_argument("--many-size", type=int, default=4096)
    ap.add_argument("--folders", type=int, default=100)
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--big-mib", type=int, default=100)
    ap.add_argument("--huge-mib", "--size", type=int, default=None, help="the one big file (2048)")
    ap.add_argument("--append-base-mib", type=int, default=None, help="the file appended to (500)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--dir", default=None,
                    help="where the trees go (default: the system's temp dir); /dev/shm takes the "
                         "disk out of the comparison")
    args = ap.parse_args()
    many = args.many or (20000 if args.quick else 100000)
    huge = args.huge_mib or (256 if args.quick else 2048)
    base_mib = args.append_base_mib or (100 if args.quick else 500)
    cases = [c for c in args.cases.split(",") if c]
    bad = set(cases) - set(CASES)
    if bad:
        sys.exit(f"unknown case(s) {', '.join(sorted(bad))}; choose from {', '.join(CASES)}")

    base = Path(tempfile.mkdtemp(prefix="gpumagic-bench-", dir=args.dir))
    server = SshServer(base / "sshd", env={"HOME": str(base)}).start()
    remote_host = f"{server.user}@{server.host}"
    rows: list[tuple[str, str, str, str, str]] = []  # case, gpumagic, rsync, ratio, target
    wire = WireCount()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        machine = Machine(server.spec()).connect()

        def rsync(src: str, dst: str, *extra: str) -> str:
            return subprocess.run(rsync_argv(server, src, dst, *extra), check=True,
                                  capture_output=True, text=True).stdout

        def compare(case: str, fn_g, fn_r, target: float | None, prepare=None) -> None:
            g, r = [], []
            for run in range(args.runs):
                for tool in ("rsync", "gpumagic") if run % 2 == 0 else ("gpumagic", "rsync"):
                    if prepare is not None:
                        prepare(tool)
                    (g if tool == "gpumagic" else r).append(timed(fn_g if tool == "gpumagic" else fn_r))
            gm, rm = statistics.median(g), statistics.median(r)
            verdict = "" if target is None else f"<= {target:.1f}x " + ("met" if gm / rm <= target else "MISSED")
            rows.append((case, f"{gm:.3f} s", f"{rm:.3f} s", f"{gm / rm:.2f}x", verdict))
            runs = f" (runs: {' '.join(f'{x:.2f}' for x in g)} / {' '.join(f'{x:.2f}' for x in r)})" if args.runs > 1 else ""
            print(f"  {case}: gpumagic {gm:.3f} s, rsync {rm:.3f} s{runs}", flush=True)

        if "many" in cases:
            src = base / "many"
            build_many(src, many, args.many_size, args.folders)
            dest = {"gpumagic": base / "many-g", "rsync": base / "many-r"}
            fresh = iter(range(1, 10 ** 6))

            def clean(tool):
                # A new, empty destination each run, nothing removed until the end: ext4 passes
                # over inodes freed in the last minutes when it allocates one (recently_deleted),
                # so removing 100,000 files just before a run made that run pay for it (measured
                # 32.8 s for gpumagic, 9.8 s for rsync, in the run order then).
                dest[tool] = base / f"many-{tool[0]}{next(fresh)}"

            label = f"first push, {many:,} x {args.many_size} B in {args.folders} folders"
            compare(label, lambda: machine.push(f"{src}/", str(dest["gpumagic"])),
                    lambda: rsync(f"{src}/", f"{remote_host}:{dest['rsync']}/"), 1.0, prepare=clean)
            dg, dr = dest["gpumagic"], dest["rsync"]
            compare(f"no-change resync of those {many:,}", lambda: machine.push(f"{src}/", str(dg)),
                    lambda: rsync(f"{src}/", f"{remote_host}:{dr}/"), 0.3)
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            rows.append((f"client peak RSS during the {many:,}", f"{rss:.0f} MB", "-", "-",
                         "< 300 MB " + ("met" if rss < 300 else "MISSED")
                         + f" (before: {rss_before / 1024:.0f} MB)"))
            dg = base / "many-progress"  # a fresh destination (removing the first one takes long)
            progress = TimedProgress()
            wall = timed(lambda: machine.push(f"{src}/", str(dg), progress=progress))
            share = progress.seconds / wall
            rows.append((f"progress ({progress.kind}) during that first push", f"{progress.calls} calls, "
                         f"{progress.seconds * 1000:.1f} ms of {wall:.2f} s", "-", f"{share:.2%}",
                         "< 2% " + ("met" if share < 0.02 else "MISSED")))

        if "pull" in cases:
            remote = base / "pull-remote"
            build_pull_tree(remote, args.files, args.big_mib)
            bg, br = base / "pull-g", base / "pull-r"

            def clean(tool):
                shutil.rmtree(bg if tool == "gpumagic" else br, ignore_errors=True)

            compare(f"pull, {args.files:,} x 1-8 KB + {args.big_mib} MB",
                    lambda: machine.pull(f"{remote}/", str(bg)),
                    lambda: rsync(f"{remote_host}:{remote}/", f"{br}/"), 1.0, prepare=clean)
            out = subprocess.run(["diff", "-r", str(bg), str(br)], capture_output=True)
            print(f"  pulled trees equal: {out.returncode == 0}")
            compare(f"no-change resync, {args.files:,} files + {args.big_mib} MB",
                    lambda: machine.push(f"{bg}/", str(remote)),
                    lambda: rsync(f"{br}/", f"{remote_host}:{remote}/"), 0.3)
            small = sorted(bg.rglob("*.py"))[0]

            def touch(tool):
                p = small if tool == "gpumagic" else br / small.relative_to(bg)
                p.write_bytes(os.urandom(4000))
                t = time.time() + random.randint(10, 10000)
                os.utime(p, (t, t))

            compare("one-file resync", lambda: machine.push(f"{bg}/", str(remote)),
                    lambda: rsync(f"{br}/", f"{remote_host}:{remote}/"), 0.5, prepare=touch)
            shutil.rmtree(remote), shutil.rmtree(bg), shutil.rmtree(br)

        if "huge" in cases:
            src = base / "huge"
            src.mkdir()
            write_random(src / "model.safetensors", huge)
            hg, hr = base / "huge-g", base / "huge-r"

            def clean(tool):
                shutil.rmtree(hg if tool == "gpumagic" else hr, ignore_errors=True)

            compare(f"one {huge:,} MiB file", lambda: machine.push(f"{src}/", str(hg)),
                    lambda: rsync(f"{src}/", f"{remote_host}:{hr}/"), 1.0, prepare=clean)
            case, g, r, ratio, verdict = rows[-1]
            rows[-1] = (case + f" ({huge / float(g.split()[0]):.0f} vs {huge / float(r.split()[0]):.0f} MiB/s)",
                        g, r, ratio, verdict)
            shutil.rmtree(src), shutil.rmtree(hg), shutil.rmtree(hr)

        if "append" in cases:
            src = base / "append"
            src.mkdir()
            log = src / "train.log"
            write_random(log, base_mib)
            ag, ar = base / "append-g", base / "append-r"
            machine.push(f"{src}/", str(ag))
            rsync(f"{src}/", f"{remote_host}:{ar}/")
            write_random(log, 1, mode="ab")
            t = time.time() + 5
            os.utime(log, (t, t))
            wire.sent = wire.received = 0
            tg = timed(lambda: machine.push(f"{src}/", str(ag)))
            sent_g = wire.sent + wire.received
            t0 = time.perf_counter()
            stats = rsync(f"{src}/", f"{remote_host}:{ar}/", "--stats")
            tr = time.perf_counter() - t0
            m = re.search(r"Total bytes sent: ([\d,.]+)", stats)
            sent_r = int(re.sub(r"[,.]", "", m.group(1))) if m else 0
            same = subprocess.run(["cmp", str(ag / "train.log"), str(log)]).returncode == 0
            rows.append((f"1 MiB appended to a {base_mib} MiB file: bytes sent",
                         f"{sent_g / MIB:.2f} MiB", f"{sent_r / MIB:.2f} MiB", f"{sent_g / max(sent_r, 1):.2f}x",
                         "<= 2 MiB " + ("met" if sent_g <= 2 * MIB and same else "MISSED")))
            rows.append(("  its time", f"{tg:.3f} s", f"{tr:.3f} s", f"{tg / tr:.2f}x", ""))
            shutil.rmtree(src), shutil.rmtree(ag), shutil.rmtree(ar)
        machine.close()
        # the table before the clean-up (removing 100,000 files takes a while)
        print(f"\nloopback sshd, {os.cpu_count()} CPUs, median of {args.runs} run(s), trees under {base.parent}\n")
        print("| case | gpumagic | rsync | ratio | target |\n| --- | --- | --- | --- | --- |")
        for row in rows:
            print("| " + " | ".join(row) + " |", flush=True)
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
