"""Profile ``Machine.push`` of many small files: the client under cProfile, the remote agent
under cProfile too (its source is wrapped so that each agent process dumps its stats).

    PYTHONPATH=. python benchmarks/profile_sync.py [--files 20000] [--folders 100] [--size 4096]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import tempfile
import time
from pathlib import Path

from gpumagic.machine import Machine
from gpumagic.ssh.sandbox import SshServer
from gpumagic.sync import engine


def top(stats: pstats.Stats, n: int) -> str:
    out = io.StringIO()
    stats.stream = out
    stats.sort_stats("cumulative").print_stats(n)
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=20000)
    ap.add_argument("--folders", type=int, default=100)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--resync-only", action="store_true", help="profile only the no-change resync")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="gpumagic-prof-"))
    prof_dir = base / "agent-prof"
    prof_dir.mkdir()
    wrapped = engine.AGENT_SOURCE.replace(
        'if __name__ == "__main__":\n    main(',
        'if __name__ == "__main__":\n    import cProfile as _cp, time as _t\n'
        '    _p = _cp.Profile(); _t0 = _t.perf_counter(); _p.enable()\n'
        '    try:\n        main([os.fsdecode(a) for a in sys.argv[1:]])\n'
        '    finally:\n        _p.disable()\n'
        f'        _p.dump_stats("{prof_dir}/%d-%s.prof" % (os.getpid(), sys.argv[1]))\n'
        '    sys.exit(0)\n    main(')
    assert wrapped != engine.AGENT_SOURCE
    server = SshServer(base / "sshd", env={"HOME": str(base)}).start()
    try:
        src = base / "tree"
        payload = os.urandom(args.size)
        for i in range(args.files):
            d = src / f"d{i % args.folders:03d}"
            if i < args.folders:
                d.mkdir(parents=True)
            (d / f"f{i:06d}.bin").write_bytes(payload)
        machine = Machine(server.spec()).connect()
        dst = str(base / "remote")
        if args.resync_only:
            machine.push(f"{src}/", dst)
        engine.AGENT_SOURCE = wrapped
        for label in ("no-change resync",) if args.resync_only else ("first push", "no-change resync"):
            for p in prof_dir.iterdir():
                p.unlink()
            prof = cProfile.Profile()
            t = time.perf_counter()
            prof.enable()
            s = machine.push(f"{src}/", dst)
            prof.disable()
            wall = time.perf_counter() - t
            print(f"## {label}: {args.files} x {args.size} B in {args.folders} folders: "
                  f"{wall:.2f} s wall, {s.files_sent} files sent\n")
            print("### client (cProfile, cumulative)\n```")
            print(top(pstats.Stats(prof), args.top))
            print("```\n")
            for p in sorted(prof_dir.iterdir()):
                st = pstats.Stats(str(p))
                print(f"### agent {p.name.split('-', 1)[1][:-5]} (cProfile, {st.total_tt:.2f} s)\n```")
                print(top(st, args.top))
                print("```\n")
        machine.close()
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
