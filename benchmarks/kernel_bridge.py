"""Benchmark: one ``execute_request`` round trip through the kernel bridge (a gpumagic
kernelspec picked from a front end's list) against a local ipykernel and against the same
session reached with ``%%remote --kernel`` (``machine.kernel(...).execute``), on a loopback
sshd and through the link emulator (tests/linkemu.py: 40 ms RTT, 20/50 Mbit/s by default).

Each timed cell (``1+1``) counts from sending ``execute_request`` until its ``execute_reply``
and its ``status: idle`` have arrived (jupyter_client's BlockingKernelClient for the local
ipykernel and the bridge; the API for ``%%remote --kernel``).  Rounds are interleaved, one
cell on each path in turn.  Prints medians, the bridge's ratio to ``%%remote --kernel``, and
on the link each path's median in round trips.

Usage::

    PYTHONPATH=. python benchmarks/kernel_bridge.py [--runs 100] [--rtt-ms 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from gpumagic.remote.kernel import Output  # noqa: E402
from gpumagic.ssh.sandbox import SshServer  # noqa: E402
from linkemu import Link  # noqa: E402


def round_trip(kc, code: str = "1+1") -> float:
    """Seconds from an execute_request to its reply and its idle, both."""
    t0 = time.perf_counter()
    msg_id = kc.execute(code)
    replied = idle = False
    while not (replied and idle):
        if not replied:
            m = kc.get_shell_msg(timeout=60)
            replied = m["parent_header"].get("msg_id") == msg_id
        if not idle:
            m = kc.get_iopub_msg(timeout=60)
            idle = (m["parent_header"].get("msg_id") == msg_id and m["msg_type"] == "status"
                    and m["content"]["execution_state"] == "idle")
    return time.perf_counter() - t0


def start(kernel_name: str):
    from jupyter_client import KernelManager

    km = KernelManager(kernel_name=kernel_name)
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=120)
    return km, kc


def measure(paths: dict, runs: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in paths}
    for fn in paths.values():  # one warm-up each
        fn()
    for _ in range(runs):
        for name, fn in paths.items():
            times[name].append(fn())
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--rtt-ms", type=float, default=40)
    ap.add_argument("--up-mbit", type=float, default=20)
    ap.add_argument("--down-mbit", type=float, default=50)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="gpumagic-bridgebench-"))
    (base / "home").mkdir()
    client_home = base / "client"
    (client_home / ".ssh").mkdir(parents=True, mode=0o700)
    server = SshServer(base / "sshd", env={"HOME": str(base / "home")}).start()
    link = Link(server.port, rtt_ms=args.rtt_ms, up_mbit=args.up_mbit, down_mbit=args.down_mbit).start()
    host_key = server.known_hosts.read_text(encoding="utf-8").split()[1:3]
    known = client_home / ".ssh" / "known_hosts"
    known.write_text(f"[127.0.0.1]:{server.port} {' '.join(host_key)}\n"
                     f"[127.0.0.1]:{link.port} {' '.join(host_key)}\n", encoding="utf-8")
    blocks = [f"Host {alias}\n  HostName 127.0.0.1\n  Port {port}\n  User {server.user}\n"
              f"  IdentityFile {server.client_key}\n  IdentitiesOnly yes\n"
              for alias, port in (("loopback", server.port), ("linked", link.port))]
    (client_home / ".ssh" / "config").write_text("\n".join(blocks), encoding="utf-8")
    os.environ["HOME"] = str(client_home)
    os.environ["JUPYTER_DATA_DIR"] = str(base / "jupyter")
    os.environ["JUPYTER_PATH"] = str(base / "jupyter")

    import gpumagic
    from gpumagic.__main__ import main as gpumagic_main

    local_km, local_kc = start("python3")
    started = [(local_km, local_kc)]
    try:
        for alias, rtt in (("loopback", 0.0), ("linked", args.rtt_ms / 1000)):
            assert gpumagic_main(["kernel", "install", alias, "--name", "bench", "--python", sys.executable]) == 0
            km, kc = start(f"gpumagic-{alias}-bench")
            started.append((km, kc))
            m = gpumagic.connect(alias)
            k = m.kernel("bench", python=sys.executable)
            quiet = Output()
            medians = measure({"local ipykernel": lambda: round_trip(local_kc),
                               "bridge": lambda: round_trip(kc),
                               "%%remote --kernel": lambda: _timed(lambda: k.execute("1+1", output=quiet))},
                              args.runs)
            where = "loopback" if not rtt else f"link {args.rtt_ms:g} ms RTT, {args.up_mbit:g}/{args.down_mbit:g} Mbit/s"
            print(f"{where}: one execute_request round trip (1+1), median of {args.runs}:")
            for name, t in medians.items():
                rt = f" = {t / rtt:.2f} RTT" if rtt and name != "local ipykernel" else ""
                print(f"  {name:<18} {t * 1000:8.2f} ms{rt}")
            print(f"  bridge / %%remote --kernel: {medians['bridge'] / medians['%%remote --kernel']:.2f}x", flush=True)
            k.stop()
            m.close()
    finally:
        for km, kc in started:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
        link.close()
        server.stop()


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
