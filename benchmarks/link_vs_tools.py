"""Benchmark: gpumagic against the tools it replaces, over an emulated student link.

Starts its own loopback OpenSSH sshd and puts the test kit's link emulator in front of it
(``tests/linkemu.py``: one-way delay, a rate per direction, a bounded queue), then runs the
rows of issue 29's "Measured" table side by side in one run, each tool going through the same
link: gpumagic on its open connection (as in a notebook), and the real tools (``rsync -az``,
``rsync -a``, ``ssh host ...``, ``ssh -N -L``) pointed at the link's port, paying their own
connection each time, as when typed by hand.

For every row it prints the median time of ``--runs`` (runs interleaved, the order of the
tools rotated each run), the bytes each way and the request/response round trips the link
counted by the time the call returned (its definition: tests/linkemu.py), the time in RTTs, the ratios gpumagic / tool
(time and bytes), and gpumagic's floor: its bytes / the rate of each direction + its counted
round trips x RTT.

The project pushed is made from ``--seed``: 200 source files, a README and a
requirements.txt (3.4 MB of text), a 20 MB CSV and 4 MB of random bytes (a ``.pt``, a
``.jpg``): 27.4 MB in 205 files.  The pulled log is a 9.9 MB CSV.

    PYTHONPATH=. python benchmarks/link_vs_tools.py                      # 40 ms, 20/50 Mbit/s
    ... --rtt-ms 60 --up-mbit 10 --down-mbit 30 --runs 1
    ... --cases push,resync,echo                                          # some rows only
    ... --cases weights                                                   # 50 MB of random bytes
    ... --cases many --many 100000                                        # 100,000 x 4 KB of text
"""

from __future__ import annotations

import argparse
import http.server
import logging
import os
import random
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from gpumagic.machine import Machine  # noqa: E402
from gpumagic.remote.kernel import Output  # noqa: E402
from gpumagic.ssh.sandbox import SshServer, free_port  # noqa: E402
from linkemu import MBIT, Counters, Link, LinkedMachine, csv_text  # noqa: E402

MB = 1_000_000
CASES = ("push", "pull", "resync", "edit", "connect", "echo", "python", "kernel", "tunnel", "print")
OPTIONAL = ("weights", "many")
WORDS = ("self value data batch model loss grad step epoch config args path name index count "
         "result items state device tensor shape size offset train eval optimizer scheduler "
         "logger metrics update return import from class def if else for in while with as not "
         "and or None True False len range print dict list int float str open read write").split()


# -- the data -------------------------------------------------------------------------------

def source_text(rng: random.Random, size: int) -> str:
    """Python-looking text of about ``size`` bytes: words of a small vocabulary in code shapes."""
    out, n = [], 0
    while n < size:
        name = "_".join(rng.choice(WORDS) for _ in range(2))
        args = ", ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
        body = [f"def {name}({args}):", f'    """{" ".join(rng.choice(WORDS) for _ in range(8))}."""']
        for _ in range(rng.randint(3, 12)):
            lhs = rng.choice(WORDS)
            rhs = f"{rng.choice(WORDS)}.{rng.choice(WORDS)}({rng.choice(WORDS)}, {rng.randint(0, 999)})"
            body.append(f"    {'    ' * rng.randint(0, 2)}{lhs} = {rhs}")
        body.append(f"    return {rng.choice(WORDS)}\n\n")
        block = "\n".join(body)
        out.append(block)
        n += len(block)
    return "".join(out)


def build_project(root: Path, seed: int) -> tuple[int, int]:
    """The project of issue 29 under ``root``; returns (files, bytes)."""
    rng = random.Random(seed)
    for i in range(200):
        d = root / ["src", "src/models", "src/data", "tests", "scripts", "configs"][i % 6]
        d.mkdir(parents=True, exist_ok=True)
        ext = ".yaml" if d.name == "configs" else ".py"
        (d / f"{rng.choice(WORDS)}_{i:03d}{ext}").write_text(source_text(rng, rng.randint(4000, 30000)), encoding="utf-8")
    (root / "README.md").write_text(source_text(rng, 6000), encoding="utf-8")
    (root / "requirements.txt").write_text("torch>=2.1\nnumpy\npandas\ntqdm\nmatplotlib\n", encoding="utf-8")
    (root / "data").mkdir()
    (root / "data" / "train.csv").write_text(csv_text(rng, 20 * MB), encoding="utf-8")
    (root / "checkpoints").mkdir()
    (root / "checkpoints" / "init.pt").write_bytes(rng.randbytes(3 * MB))
    (root / "assets").mkdir()
    (root / "assets" / "banner.jpg").write_bytes(rng.randbytes(1 * MB))
    files = [p for p in root.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def build_many(root: Path, files: int, size: int, seed: int, kind: str = "text") -> int:
    """``files`` files of ``size`` bytes in 100 folders; returns the bytes.  ``text``: a data
    set of small text samples, each its own words and numbers, so no file repeats another;
    ``same``: the loopback benchmark's tree (``sync_vs_rsync.py --cases many``), one random
    payload written as every ``.jpg``."""
    rng = random.Random(seed)
    if kind == "same":
        payload = rng.randbytes(size)
        for i in range(files):
            d = root / f"d{i % 100:03d}"
            if i < 100:
                d.mkdir(parents=True)
            (d / f"img{i:06d}.jpg").write_bytes(payload)
        return files * size
    words = WORDS + [f"{w}_{i}" for i in range(40) for w in ("id", "label", "token")]
    for i in range(files):
        d = root / f"d{i % 100:03d}"
        if i < 100:
            d.mkdir(parents=True)
        parts, n = [], 0
        while n < size:
            part = f"{rng.choice(words)}={rng.randint(0, 99999)}" if rng.random() < 0.3 else rng.choice(words)
            parts.append(part)
            n += len(part) + 1
        (d / f"sample{i:06d}.txt").write_text(" ".join(parts)[:size], encoding="ascii")
    return files * size


def seq_bytes(n: int) -> int:
    """Bytes ``seq 1 n`` prints."""
    total, digits, low = 0, 1, 1
    while low <= n:
        high = min(n, low * 10 - 1)
        total += (high - low + 1) * (digits + 1)
        digits, low = digits + 1, low * 10
    return total


# -- measuring ----------------------------------------------------------------------------

class Discard(Output):
    """A live session's output, dropped."""


class Measured:
    """Runs of one tool in one row: seconds and the link's counts of each run."""

    def __init__(self, tool: str):
        self.tool = tool
        self.seconds: list[float] = []
        self.counts: list[Counters] = []  # settled: trailing messages (a channel's close) in
        self.waited: list[int] = []  # round trips counted by the time the call returned

    def add(self, seconds: float, counts: Counters, waited: int) -> None:
        self.seconds.append(seconds)
        self.counts.append(counts)
        self.waited.append(waited)

    @property
    def round_trips(self) -> float:
        return statistics.median(self.waited)

    @property
    def time(self) -> float:
        return statistics.median(self.seconds)

    def median(self, field: str) -> float:
        return statistics.median(getattr(c, field) for c in self.counts)


class Bench:
    def __init__(self, linked: LinkedMachine, args):
        self.linked, self.link, self.args = linked, linked.link, args
        self.rtt = args.rtt_ms / 1000
        self.rows: list[tuple[str, Measured, Measured | None]] = []
        ssh = linked.ssh_argv()
        self.ssh_e = shlex.join(ssh[:-1])  # for rsync -e
        self.remote = ssh[-1]  # user@127.0.0.1

    def once(self, fn: Callable[[], object]) -> tuple[float, Counters, int]:
        """Seconds of ``fn``, what crossed the link for it (settled: trailing messages such as
        a channel's close in), and the round trips counted by the time it returned (the most
        it can have waited for: an answer counted later came after it had returned)."""
        before = self.link.settle()
        t = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t
        waited = self.link.counters().round_trips - before.round_trips
        return seconds, self.link.settle() - before, waited

    def compare(self, case: str, tools: dict[str, Callable[[], object]], runs: int,
                prepare: Callable[[str], None] | None = None) -> None:
        """Run every tool ``runs`` times, the order rotated each run; the first tool is gpumagic."""
        results = {name: Measured(name) for name in tools}
        names = list(tools)
        for run in range(runs):
            for name in names[run % len(names):] + names[:run % len(names)]:
                if prepare is not None:
                    prepare(name)
                results[name].add(*self.once(tools[name]))
        measured = list(results.values())
        g, others = measured[0], measured[1:]
        for i, other in enumerate(others or [None]):
            self.rows.append((case if i == 0 else '  " (same case)', g, other))
        print(f"  {case}: " + ", ".join(f"{m.tool} {m.time:.3f} s" for m in measured), flush=True)

    def run_ssh(self, *remote: str, check: bool = True) -> None:
        subprocess.run(self.linked.ssh_argv(*remote), check=check, stdout=subprocess.DEVNULL)

    def rsync(self, *argv: str) -> None:
        subprocess.run(["rsync", *argv, "-e", self.ssh_e], check=True, stdout=subprocess.DEVNULL)

    def floor(self, m: Measured) -> float:
        """Seconds the link needs at least for what ``m`` sent: bytes / rate + round trips x RTT."""
        up, down = self.link.up.rate, self.link.down.rate
        t = m.round_trips * self.rtt
        t += m.median("up_bytes") / up if up else 0
        t += m.median("down_bytes") / down if down else 0
        return t

    def table(self) -> str:
        head = ("| case | gpumagic | its bytes up / down | its RTTs counted (time / RTT) | its floor | "
                "tool | tool's time | tool's bytes up / down | tool's RTTs counted (time / RTT) | "
                "time ratio | bytes ratio |\n" + "| --- " * 11 + "|")
        out = [head]
        for case, g, t in self.rows:
            cells = [case, f"{g.time:.3f} s", fmt_bytes(g), f"{g.round_trips:.0f} ({g.time / self.rtt:.1f})",
                     f"{self.floor(g):.3f} s"]
            if t is None:
                cells += ["", "", "", "", "", ""]
            else:
                gb, tb = g.median("bytes"), t.median("bytes")
                cells += [t.tool, f"{t.time:.3f} s", fmt_bytes(t),
                          f"{t.round_trips:.0f} ({t.time / self.rtt:.1f})",
                          f"{g.time / t.time:.2f}x", f"{gb / tb:.2f}x" if tb else "-"]
            out.append("| " + " | ".join(cells) + " |")
        return "\n".join(out)


def fmt_bytes(m: Measured) -> str:
    return f"{fmt(m.median('up_bytes'))} / {fmt(m.median('down_bytes'))}"


def fmt(n: float) -> str:
    if n >= MB:
        return f"{n / MB:.2f} MB"
    if n >= 1000:
        return f"{n / 1000:.1f} kB"
    return f"{n:.0f} B"


def serve_http(port: int) -> http.server.ThreadingHTTPServer:
    """A small HTTP server on 127.0.0.1:port (the machine's TensorBoard, say), on a thread."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"x" * 2000
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def wait_port(port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


def curl(port: int) -> None:
    subprocess.run(["curl", "-sS", "-o", "/dev/null", f"http://127.0.0.1:{port}/"], check=True)


# -- the rows ---------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rtt-ms", type=float, default=40)
    ap.add_argument("--up-mbit", type=float, default=20)
    ap.add_argument("--down-mbit", type=float, default=50)
    ap.add_argument("--queue", type=int, default=None, help="bytes per direction (default: 100 ms of the rate)")
    ap.add_argument("--runs", type=int, default=3, help="runs of the transfer rows (median)")
    ap.add_argument("--reps", type=int, default=10, help="runs of the small rows (median)")
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated, of {', '.join(CASES + OPTIONAL)}")
    ap.add_argument("--seed", type=int, default=29)
    ap.add_argument("--many", type=int, default=100_000, help="files of the many case (4 KB each)")
    ap.add_argument("--many-kind", choices=("text", "same"), default="text",
                    help="text: each file its own text; same: one random 4 KB payload as every .jpg")
    ap.add_argument("--dir", default=None, help="where the trees go (default: the system's temp dir)")
    args = ap.parse_args()
    decided = logging.getLogger("gpumagic.sync.engine")  # how each sync decided to compress
    decided.setLevel(logging.INFO)
    shown = logging.StreamHandler(sys.stdout)
    shown.setFormatter(logging.Formatter("    %(message)s"))
    decided.addHandler(shown)
    cases = [c for c in args.cases.split(",") if c]
    bad = set(cases) - set(CASES + OPTIONAL)
    if bad:
        sys.exit(f"unknown case(s) {', '.join(sorted(bad))}; choose from {', '.join(CASES + OPTIONAL)}")

    base = Path(tempfile.mkdtemp(prefix="gpumagic-linkbench-", dir=args.dir))
    home = base / "home"
    home.mkdir()
    server = SshServer(base / "sshd", env={"HOME": str(home)}).start()
    link = Link(server.port, rtt_ms=args.rtt_ms, up_mbit=args.up_mbit, down_mbit=args.down_mbit,
                queue=args.queue).start()
    linked = LinkedMachine(server, link, keepalive=30, connect=False)
    bench = Bench(linked, args)
    print(f"link: {args.rtt_ms:g} ms RTT, {args.up_mbit:g} Mbit/s up, {args.down_mbit:g} Mbit/s down, "
          f"queue {link.up.queue:,} / {link.down.queue:,} B; {os.cpu_count()} CPUs; trees under {base}",
          flush=True)
    machine = linked.machine
    fresh = iter(range(1, 10 ** 6))
    try:
        t0 = time.perf_counter()
        machine.connect()
        machine.run("true", quiet=True)  # the login environment is read once per connection
        print(f"  gpumagic connected and ran its first cell in {time.perf_counter() - t0:.2f} s", flush=True)
        remote = bench.remote
        src = base / "project"
        if {"push", "resync", "edit"} & set(cases):
            files, size = build_project(src, args.seed)
            print(f"  project: {files} files, {size / MB:.1f} MB", flush=True)
        dest: dict[str, Path] = {}

        def new_dest(tool: str) -> None:
            dest[tool] = base / f"remote-{tool.split()[-1].lstrip('-')}-{next(fresh)}"

        if {"push", "resync", "edit"} & set(cases):
            bench.compare(f"first push of a project: {files} files, {size / MB:.1f} MB", {
                "gpumagic": lambda: machine.push(f"{src}/", str(dest["gpumagic"])),
                "gpumagic --no-compress": lambda: machine.push(f"{src}/", str(dest["gpumagic --no-compress"]),
                                                               compress=False),
                "rsync -az": lambda: bench.rsync("-az", f"{src}/", f"{remote}:{dest['rsync -az']}/"),
                "rsync -a": lambda: bench.rsync("-a", f"{src}/", f"{remote}:{dest['rsync -a']}/"),
            }, args.runs, prepare=new_dest)
        if "resync" in cases:
            bench.compare("no-change resync of that project", {
                "gpumagic": lambda: machine.push(f"{src}/", str(dest["gpumagic"])),
                "rsync -az": lambda: bench.rsync("-az", f"{src}/", f"{remote}:{dest['rsync -az']}/"),
            }, args.runs)
        if "edit" in cases:
            edited = sorted((src / "src").glob("*.py"))[0]
            rng = random.Random(args.seed + 1)

            def edit(tool: str) -> None:
                if tool == "gpumagic":  # one edit per run, that both tools then send
                    with open(edited, "a", encoding="utf-8") as f:
                        f.write(source_text(rng, 300))

            bench.compare("one edited source file, resync", {
                "gpumagic": lambda: machine.push(f"{src}/", str(dest["gpumagic"])),
                "rsync -az": lambda: bench.rsync("-az", f"{src}/", f"{remote}:{dest['rsync -az']}/"),
            }, args.runs, prepare=edit)
        if "weights" in cases:
            wsrc = base / "weights"
            wsrc.mkdir()
            (wsrc / "model.pt").write_bytes(random.Random(args.seed + 2).randbytes(50 * MB))
            bench.compare("push of 50 MB of random bytes (weights)", {
                "gpumagic": lambda: machine.push(f"{wsrc}/", str(dest["gpumagic"])),
                "gpumagic --no-compress": lambda: machine.push(f"{wsrc}/", str(dest["gpumagic --no-compress"]),
                                                               compress=False),
                "rsync -az": lambda: bench.rsync("-az", f"{wsrc}/", f"{remote}:{dest['rsync -az']}/"),
                "rsync -a": lambda: bench.rsync("-a", f"{wsrc}/", f"{remote}:{dest['rsync -a']}/"),
            }, args.runs, prepare=new_dest)
        if "many" in cases:
            msrc = base / "many"
            t = time.perf_counter()
            size = build_many(msrc, args.many, 4096, args.seed + 4, args.many_kind)
            what = "text" if args.many_kind == "text" else "one random payload"
            print(f"  many: {args.many:,} x 4 KB ({what}) made in {time.perf_counter() - t:.1f} s", flush=True)
            bench.compare(f"first push of {args.many:,} x 4 KB ({size / MB:.0f} MB of {what} in 100 folders)", {
                "gpumagic": lambda: machine.push(f"{msrc}/", str(dest["gpumagic"])),
                "rsync -az": lambda: bench.rsync("-az", f"{msrc}/", f"{remote}:{dest['rsync -az']}/"),
            }, args.runs, prepare=new_dest)
        if "pull" in cases:
            logs = base / "remote-logs"
            logs.mkdir()
            (logs / "train_log.csv").write_text(csv_text(random.Random(args.seed + 3), 9_900_000), encoding="utf-8")
            local: dict[str, Path] = {}

            def new_local(tool: str) -> None:
                local[tool] = base / f"pulled-{tool.split()[-1].lstrip('-')}-{next(fresh)}"

            bench.compare("pull of a 9.9 MB CSV training log", {
                "gpumagic": lambda: machine.pull(f"{logs}/", str(local["gpumagic"])),
                "gpumagic --no-compress": lambda: machine.pull(f"{logs}/", str(local["gpumagic --no-compress"]),
                                                               compress=False),
                "rsync -az": lambda: bench.rsync("-az", f"{remote}:{logs}/", f"{local['rsync -az']}/"),
            }, args.runs, prepare=new_local)
        if "connect" in cases:
            def connect() -> None:
                Machine(linked.spec).connect().close()

            bench.compare("%gpu connect (Machine.connect)", {
                "gpumagic": connect, "ssh host true": lambda: bench.run_ssh("true")}, args.reps)
        if "echo" in cases:
            bench.compare("%%remote echo hi on the open connection", {
                "gpumagic": lambda: machine.run("echo hi", quiet=True),
                "ssh host echo hi": lambda: bench.run_ssh("echo hi")}, args.reps)
        if "python" in cases:
            bench.compare("%%remote --python print(1)", {
                "gpumagic": lambda: machine.run("print(1)", python=True, quiet=True)}, args.reps)
        if "kernel" in cases:
            k = machine.kernel("bench", python=sys.executable)
            k.execute("x = 41", output=Discard())
            try:
                bench.compare("live session x + 1", {
                    "gpumagic": lambda: k.execute("x + 1", output=Discard())}, args.reps)
            finally:
                k.stop()
        if "tunnel" in cases:
            http_port = free_port()
            httpd = serve_http(http_port)
            tunnel = machine.tunnel(http_port, remote_host="127.0.0.1", local_port=free_port())
            ssh_port = free_port()
            ssh_l = subprocess.Popen(linked.ssh_argv()[:-1] + [
                "-N", "-o", "ExitOnForwardFailure=yes", "-L", f"127.0.0.1:{ssh_port}:127.0.0.1:{http_port}",
                remote])
            try:
                wait_port(ssh_port)
                curl(tunnel.local_port), curl(ssh_port)
                bench.compare("a new HTTP request through an open tunnel", {
                    "gpumagic": lambda: curl(tunnel.local_port), "ssh -L": lambda: curl(ssh_port)}, args.reps)
            finally:
                ssh_l.terminate()
                ssh_l.wait()
                tunnel.stop(raise_errors=False)
                httpd.shutdown()
        if "print" in cases:
            n = 690_000
            bench.compare(f"a cell printing {seq_bytes(n) / MB:.1f} MB (seq 1 {n})", {
                "gpumagic": lambda: machine.run(f"seq 1 {n}", quiet=True, capture=False),
                f"ssh host seq 1 {n}": lambda: bench.run_ssh(f"seq 1 {n}")}, args.runs)
            print(f"  the link's floor for that output: {seq_bytes(n) / (args.down_mbit * MBIT) + bench.rtt:.3f} s")
        machine.close()
        print(f"\n{args.rtt_ms:g} ms RTT, {args.up_mbit:g}/{args.down_mbit:g} Mbit/s, median of {args.runs} "
              f"(transfers) / {args.reps} (small rows) runs, tools' order rotated each run\n")
        print(bench.table(), flush=True)
    finally:
        linked.close()
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
