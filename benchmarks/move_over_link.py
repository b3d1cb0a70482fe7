"""Benchmark: `%gpu job move` of a run with a 200 MB checkpoint over an emulated student link
(issue 27, "Measure and report").

Starts two loopback OpenSSH sshd servers, each with its own HOME: machine ``a``, reached
directly, and machine ``b``, behind the test kit's link emulator (``tests/linkemu.py``: 40 ms
RTT, 20 Mbit/s up, 50 down by default), since a move pushes from this computer to ``b``.  A
job is started on ``a`` with ``--keep ckpt/`` and ``--resume-arg "--resume {checkpoint}"``
(the Python API: ``Machine.start_job(..., keep=KeepOptions(...))``); it writes a checkpoint
of ``--mb`` MB of random bytes (incompressible, like real weights) by write-then-rename, then
goes on "training".  Once that checkpoint is kept here, ``a`` goes (the job's process group,
then its sshd with every connection it serves), and ``gpumagic.remote.move.move(a, b, ...)``,
what ``%gpu job move NAME --to b`` calls, is timed until it returns with the job started on
``b``.  It prints that time, what each of its steps said and when, the bytes that crossed the
link each way and the request/response round trips it counted, the floor (bytes up / the up
rate + bytes down / the down rate + round trips x RTT) and the ratio of the time to the floor;
then the time until the job's log on ``b`` says it resumed.

Not part of the test suite.

    PYTHONPATH=. python benchmarks/move_over_link.py                 # 200 MB, 40 ms, 20/50 Mbit/s
    ... --mb 50 --rtt-ms 60 --up-mbit 10
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

MB = 1_000_000

#: The job: one checkpoint of --mb MB of random bytes (written to a temporary name, then
#: renamed), then steps until it is stopped; with --resume, it checks the checkpoint's size,
#: says so and ends.
TRAIN = r'''
import argparse, os, sys, time
p = argparse.ArgumentParser()
p.add_argument("--mb", type=int, required=True)
p.add_argument("--resume")
a = p.parse_args()
if a.resume:
    size = os.path.getsize(a.resume)
    print(f"resumed from {a.resume} ({size} bytes)", flush=True)
    sys.exit(0 if size == a.mb * 1000000 else 3)
os.makedirs("ckpt", exist_ok=True)
with open("ckpt/.step-100.pt.tmp", "wb") as f:
    for _ in range(a.mb):
        f.write(os.urandom(1000000))
os.replace("ckpt/.step-100.pt.tmp", "ckpt/step-100.pt")
print("saved ckpt/step-100.pt", flush=True)
step = 100
while True:
    step += 1
    print(f"step {step}", flush=True)
    time.sleep(0.5)
'''



def kill_group(pid_file: Path) -> None:
    try:
        os.killpg(int(pid_file.read_text(encoding="utf-8").strip()), signal.SIGKILL)
    except (OSError, ValueError):
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200, help="the checkpoint's size in MB (10^6 bytes)")
    ap.add_argument("--rtt-ms", type=float, default=40)
    ap.add_argument("--up-mbit", type=float, default=20)
    ap.add_argument("--down-mbit", type=float, default=50)
    ap.add_argument("--dir", default=None, help="where the folders go (default: the system's temp dir)")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="gpumagic-movebench-", dir=args.dir))
    os.environ["GPUMAGIC_DATA_DIR"] = str(base / "data")  # its records, not the user's

    from gpumagic.machine import Machine
    from gpumagic.remote import move
    from gpumagic.remote.jobs import JobOptions
    from gpumagic.remote.keep import KeepOptions
    from gpumagic.ssh.sandbox import SshServer
    from linkemu import MBIT, Link, LinkedMachine, lose

    servers, machines, linked = {}, {}, None
    name = "movebench"
    try:
        for n in ("a", "b"):
            (base / f"home-{n}").mkdir()
            servers[n] = SshServer(base / f"sshd-{n}", env={"HOME": str(base / f"home-{n}")}, alias=n).start()
        link = Link(servers["b"].port, rtt_ms=args.rtt_ms, up_mbit=args.up_mbit, down_mbit=args.down_mbit).start()
        linked = LinkedMachine(servers["b"], link, keepalive=30, connect=True)
        a = machines["a"] = Machine(servers["a"].spec("a"), name="a").connect()
        b = machines["b"] = linked.machine
        b.run("true", quiet=True)  # connected and its login environment read, as in a notebook
        print(f"link to b: {args.rtt_ms:g} ms RTT, {args.up_mbit:g} Mbit/s up, {args.down_mbit:g} Mbit/s down; "
              f"a reached directly; {os.cpu_count()} CPUs; folders under {base}", flush=True)
        proj = base / "proj"
        proj.mkdir()
        (proj / "train.py").write_text(TRAIN, encoding="utf-8")
        # by its full path: a test sshd's login directory is not the HOME its jobs get
        a.push(f"{proj}/", f"{base / 'home-a'}/work/")
        t0 = time.perf_counter()
        started = a.start_job(name, f"python3 train.py --mb {args.mb}",
                    JobOptions(cwd="work", resume_arg="--resume {checkpoint}"),
                    keep=KeepOptions("ckpt/", every=1.0, to=str(base / "kept"), settle=10.0))
        k = a.keepers.get(name)
        while not k.kept:
            if time.perf_counter() - t0 > 300 or not started.info().running:
                sys.exit(f"no checkpoint kept ({k.error or 'no error'}): {started.logs(20)}")
            time.sleep(0.1)
        kept = base / "kept" / k.kept[0][0]
        print(f"checkpoint {k.kept[0][0]} ({kept.stat().st_size / MB:.0f} MB) kept here "
              f"{time.perf_counter() - t0:.1f} s after the start", flush=True)
        # a goes: the job's process group, then its sshd with every connection
        kill_group(base / "home-a" / ".gpumagic" / "jobs" / name / "pid")
        lose(servers["a"])
        rec = move.find_start(name, "a")
        said: list[tuple[float, str]] = []
        before = link.settle()
        t = time.perf_counter()
        job = move.move(a, b, name, rec=rec, say=lambda s: said.append((time.perf_counter() - t, s)))
        took = time.perf_counter() - t
        waited = link.counters().round_trips - before.round_trips  # answers waited for by then
        counts = link.settle() - before
        for at, s in said:
            print(f"  {at:7.2f} s  {s}")
        up, down = args.up_mbit * MBIT, args.down_mbit * MBIT
        floor = counts.up_bytes / up + counts.down_bytes / down + waited * args.rtt_ms / 1000
        print(f"\n`job move` of a {args.mb} MB checkpoint to b ({args.rtt_ms:g} ms RTT, {args.up_mbit:g}/"
              f"{args.down_mbit:g} Mbit/s): {took:.1f} s until the job was started on b", flush=True)
        print(f"  bytes over the link: {counts.up_bytes / MB:.2f} MB up, {counts.down_bytes / MB:.3f} MB down; "
              f"round trips counted: {waited}; connections: {counts.connections}")
        print(f"  floor: {counts.up_bytes / MB:.2f} MB / {args.up_mbit:g} Mbit/s = {counts.up_bytes / up:.1f} s"
              f" + {counts.down_bytes / down:.2f} s down + {waited} x {args.rtt_ms:g} ms = {floor:.1f} s; "
              f"time / floor = {took / floor:.2f}x")
        print(f"  the checkpoint alone at {args.up_mbit:g} Mbit/s: {args.mb * MB / up:.1f} s")
        t2 = time.perf_counter()
        while "resumed from" not in job.logs(5):
            if time.perf_counter() - t2 > 120:
                sys.exit(f"the job did not resume on b: {job.logs(20)}")
            time.sleep(0.2)
        print(f"  its log on b said it resumed {took + time.perf_counter() - t2:.1f} s after the move began: "
              f"{job.logs(5).strip().splitlines()[-1]}")
    finally:
        for m in machines.values():
            for k in list(m.keepers.by_job.values()):
                k.stop("benchmark over")
        if linked is not None:
            linked.close()
        if "a" in machines:
            machines["a"].close()
        for n, s in servers.items():
            for pid in (base / f"home-{n}" / ".gpumagic" / "jobs").glob("*/pid"):
                kill_group(pid)
            s.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
