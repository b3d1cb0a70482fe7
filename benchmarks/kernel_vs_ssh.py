"""Benchmark: a gpumagic session (``machine.kernel``) against a Jupyter kernel reached
directly and through ``ssh -L``, on a loopback sshd, side by side in one run.

* direct: an ipykernel on 127.0.0.1 driven by jupyter_client's BlockingKernelClient (the
  floor: no SSH at all);
* ssh -L: the same kind of kernel, its five ports forwarded by OpenSSH's ``ssh -N -L`` (the
  manual way), the same client;
* gpumagic: ``machine.kernel(...)`` over the machine's SSH connection (paramiko), through the
  keeper on the machine.

Each timed cell counts from sending ``execute_request`` until its ``execute_reply`` and its
``status: idle`` (so all of its output) have arrived.  Cells: ``1+1``, and one displaying a
100 KB PNG.  Rounds are interleaved (one cell on each path in turn) so load on the machine
hits all of them alike.  Prints medians and the ratios to the direct floor (target <= 1.5)
and to ssh -L.

Then 50 MB of printed text through gpumagic: seconds, MB/s, the largest gap between two
pieces of output arriving (a responsive notebook sees output keep coming), and how much
this process's resident memory grew (flat: output is not kept).  Last, cells printing 1, 4,
12 and 16 MB with and without capture (``--out``): capturing stays linear in the size.

Usage::

    PYTHONPATH=. python benchmarks/kernel_vs_ssh.py [--runs 200] [--mb 50] [--capture-mb 1,4,12,16]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpumagic.remote.kernel import Output  # noqa: E402
from gpumagic.machine import Machine  # noqa: E402
from gpumagic.ssh.sandbox import SshServer, free_port  # noqa: E402


def png_bytes(size: int = 100_000) -> bytes:
    """A valid PNG of about ``size`` bytes (random pixels do not compress)."""
    side = int((size / 3) ** 0.5)
    raw = b"".join(b"\0" + os.urandom(side * 3) for _ in range(side))

    def chunk(kind, data):
        return struct.pack("!I", len(data)) + kind + data + struct.pack("!I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack("!IIBBBBB", side, side, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 1)) + chunk(b"IEND", b""))


SETUP = """
import base64
from IPython.display import Image, display
img = Image(data=base64.b64decode({b64!r}), format="png")
"""
CELLS = {"1+1": "1+1", "100 KB image": "display(img)"}


def wait_port(port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


def run_jc(kc, code: str) -> float:
    """Seconds for one cell through a jupyter_client BlockingKernelClient."""
    start = time.perf_counter()
    msg_id = kc.execute(code)
    idle = replied = False
    while not idle:
        msg = kc.get_iopub_msg(timeout=30)
        if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"):
            idle = True
    while not replied:
        msg = kc.get_shell_msg(timeout=30)
        replied = msg["parent_header"].get("msg_id") == msg_id
    return time.perf_counter() - start


class Discard(Output):
    pass


def run_gm(k, code: str) -> float:
    start = time.perf_counter()
    k.execute(code, output=Discard(), capture=False)
    return time.perf_counter() - start


def rss() -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Counting(Output):
    def __init__(self):
        self.bytes = 0
        self.last = None
        self.max_gap = 0.0

    def stream(self, name, text):
        now = time.perf_counter()
        if self.last is not None:
            self.max_gap = max(self.max_gap, now - self.last)
        self.last = now
        self.bytes += len(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=200, help="timed rounds per cell")
    p.add_argument("--mb", type=int, default=50, help="megabytes printed in the streaming test")
    p.add_argument("--capture-mb", default="1,4,12,16",
                   help="sizes (MB) of the cells timed with and without --out (capture)")
    args = p.parse_args(argv)
    from jupyter_client.manager import start_new_kernel

    b64 = __import__("base64").b64encode(png_bytes()).decode()
    setup = SETUP.format(b64=b64)
    with tempfile.TemporaryDirectory(prefix="gpumagic-bench-") as tmp:
        home = Path(tmp) / "home"
        home.mkdir()
        server = SshServer(Path(tmp) / "sshd", env={"HOME": str(home)}).start()
        km, direct = start_new_kernel(kernel_name="python3", extra_arguments=[])
        ssh = None
        machine = Machine(server.spec("bench"), name="bench")
        k = None
        try:
            info = km.get_connection_info()
            assert info["ip"] == "127.0.0.1", info["ip"]
            fwd = {ch: free_port() for ch in ("shell", "iopub", "stdin", "control", "hb")}
            ssh = subprocess.Popen(
                ["ssh", "-N", "-F", "/dev/null", "-i", str(server.client_key), "-p", str(server.port),
                 "-o", f"UserKnownHostsFile={server.known_hosts}", "-o", "StrictHostKeyChecking=yes",
                 "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes",
                 *[a for ch, port in fwd.items()
                   for a in ("-L", f"127.0.0.1:{port}:127.0.0.1:{info[ch + '_port']}")],
                 f"{server.user}@{server.host}"])
            for port in fwd.values():
                wait_port(port)
            from jupyter_client.blocking import BlockingKernelClient

            tunnelled = BlockingKernelClient()
            tunnelled.load_connection_info({**info, **{f"{ch}_port": port for ch, port in fwd.items()}})
            tunnelled.start_channels()
            tunnelled.wait_for_ready(timeout=60)
            t0 = time.perf_counter()
            k = machine.kernel("bench", python=sys.executable)
            print(f"gpumagic session started in {time.perf_counter() - t0:.2f} s "
                  f"(cipher {machine.connection.transport.remote_cipher}; ssh: its defaults)")
            paths = {"direct": lambda code: run_jc(direct, code),
                     "ssh -L": lambda code: run_jc(tunnelled, code),
                     "gpumagic": lambda code: run_gm(k, code)}
            for name, run in paths.items():
                run(setup)
                for code in CELLS.values():
                    for _ in range(20):  # warm-up
                        run(code)
            times = {(name, cell): [] for name in paths for cell in CELLS}
            for _ in range(args.runs):
                for cell, code in CELLS.items():
                    for name, run in paths.items():
                        times[name, cell].append(run(code))
            print(f"\nmedian of {args.runs} rounds (ms):")
            print(f"{'cell':14s} {'direct':>8s} {'ssh -L':>8s} {'gpumagic':>9s}   gpumagic/direct  "
                  "gpumagic/ssh -L  ssh -L/direct")
            for cell in CELLS:
                med = {name: statistics.median(times[name, cell]) * 1e3 for name in paths}
                print(f"{cell:14s} {med['direct']:8.2f} {med['ssh -L']:8.2f} {med['gpumagic']:9.2f}   "
                      f"{med['gpumagic'] / med['direct']:15.2f}  {med['gpumagic'] / med['ssh -L']:15.2f}  "
                      f"{med['ssh -L'] / med['direct']:13.2f}")
            print("target: gpumagic/direct <= 1.5")

            # 50 MB of printed text through gpumagic
            out = Counting()
            lines = args.mb * 1024 * 1024 // 100
            before = peak = rss()
            stop = threading.Event()

            def sample():
                nonlocal peak
                while not stop.wait(0.05):
                    peak = max(peak, rss())

            threading.Thread(target=sample, daemon=True).start()
            start = time.perf_counter()
            k.execute(f"line = 'x' * 99\nfor i in range({lines}):\n    print(line)", output=out,
                      capture=False)
            secs = time.perf_counter() - start
            stop.set()
            floor = run_jc(direct, f"line = 'x' * 99\nfor i in range({lines}):\n    print(line)")
            print(f"\n{out.bytes / 1e6:.1f} MB printed through gpumagic in {secs:.2f} s "
                  f"({out.bytes / 1e6 / secs:.1f} MB/s; direct: {floor:.2f} s); largest gap between "
                  f"outputs {out.max_gap * 1e3:.0f} ms; this process's memory grew by at most "
                  f"{(peak - before) / 1e6:.1f} MB")

            # capturing output (%%remote --kernel --out VAR) costs time linear in its size
            print("\ncell printing N MB: seconds without capture, with capture (--out), ratio "
                  "(target <= 1.2 at 12 MB)")
            for mb in [int(x) for x in args.capture_mb.split(",") if x]:
                code = f"line = 'x' * 99\nfor i in range({mb * 1024 * 1024 // 100}):\n    print(line)"
                secs = {}
                for capture in (False, True, False, True):  # interleaved; the faster of two
                    start = time.perf_counter()
                    k.execute(code, output=Discard(), capture=capture)
                    took = time.perf_counter() - start
                    secs[capture] = min(secs.get(capture, took), took)
                print(f"{mb:4d} MB  {secs[False]:7.2f} s  {secs[True]:7.2f} s  {secs[True] / secs[False]:5.2f}x")
            tunnelled.stop_channels()
        finally:
            if k is not None:
                k.stop()
            machine.close()
            direct.stop_channels()
            km.shutdown_kernel(now=True)
            if ssh is not None:
                ssh.terminate()
                ssh.wait()
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
