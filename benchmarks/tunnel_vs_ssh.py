"""Benchmark: a gpumagic tunnel against OpenSSH's ``ssh -N -L`` on a loopback sshd.

Both forward a local port to the same local HTTP server (a separate process) through the
same real ``sshd``; ``curl`` (a separate process) downloads through each:

* throughput: one 200 MB download (MB/s), ``--runs`` times;
* latency: time to first byte (curl's ``time_starttransfer``) of 100 small requests, each
  on a new connection (so each opens a new SSH channel, as a browser's requests do).

Prints each run, the medians and the ratios gpumagic / OpenSSH (throughput: higher is
better, target >= 0.9; latency: lower is better, target <= 1.2), and the time to first byte
without any tunnel, so the latency each tunnel adds can be compared too.

With ``--reverse`` the same, the other way: a gpumagic reverse tunnel
(:class:`gpumagic.tunnel.ReverseTunnel`) against ``ssh -N -R``, curl on the machine's side
(the machine is this computer) reaching the HTTP server on this side.

Usage::

    PYTHONPATH=. python benchmarks/tunnel_vs_ssh.py [--mb 200] [--runs 3] [--small 100] [--reverse]
"""

from __future__ import annotations

import argparse
import http.server
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpumagic.ssh.connection import Connection  # noqa: E402
from gpumagic.ssh.sandbox import SshServer, free_port  # noqa: E402
from gpumagic.tunnel.forward import Tunnel  # noqa: E402
from gpumagic.tunnel.reverse import ReverseTunnel  # noqa: E402


def serve(port: int, megabytes: int) -> None:
    """The HTTP server process: ``/big`` is ``megabytes`` MB, ``/small`` is 100 bytes."""
    big = memoryview(os.urandom(1024 * 1024) * megabytes)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = big if self.path == "/big" else memoryview(b"x" * 100)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for i in range(0, len(body), 4 << 20):
                self.wfile.write(body[i:i + (4 << 20)])

        def log_message(self, *a):
            pass

    http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def wait_port(port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


def download(port: int) -> tuple[float, int]:
    """Seconds and bytes of one /big download through local ``port``."""
    out = subprocess.run(["curl", "-sS", "-o", "/dev/null", "-w", "%{time_total} %{size_download}",
                          f"http://127.0.0.1:{port}/big"], capture_output=True, text=True, check=True, encoding="utf-8")
    secs, size = out.stdout.split()
    return float(secs), int(size)


def small_ttfb(port: int, n: int) -> list[float]:
    """Time to first byte (seconds) of ``n`` small requests, one new connection each."""
    urls = [a for _ in range(n) for a in ("-o", "/dev/null", f"http://127.0.0.1:{port}/small")]
    out = subprocess.run(["curl", "-sS", "-w", "%{time_starttransfer}\n", *urls],
                         capture_output=True, text=True, check=True, encoding="utf-8")
    return [float(x) for x in out.stdout.split()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=200, help="size of the big download (MB)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--small", type=int, default=100, help="small requests per run")
    p.add_argument("--reverse", action="store_true", help="reverse tunnels: gpumagic's against ssh -N -R")
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve, args.mb)
        return 0

    with tempfile.TemporaryDirectory(prefix="gpumagic-bench-") as tmp:
        server = SshServer(Path(tmp) / "sshd").start()
        http_port = free_port()
        httpd = subprocess.Popen([sys.executable, __file__, "--serve", str(http_port), "--mb", str(args.mb)])
        ssh = None
        conn = Connection(server.spec("bench"))
        try:
            wait_port(http_port)
            ssh_port = free_port()
            ssh = subprocess.Popen(
                ["ssh", "-N", "-F", "/dev/null", "-i", str(server.client_key), "-p", str(server.port),
                 "-o", f"UserKnownHostsFile={server.known_hosts}", "-o", "StrictHostKeyChecking=yes",
                 "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes",
                 "-R" if args.reverse else "-L", f"127.0.0.1:{ssh_port}:127.0.0.1:{http_port}",
                 f"{server.user}@{server.host}"])
            wait_port(ssh_port)
            conn.open()
            tunnel: Tunnel | ReverseTunnel
            if args.reverse:
                tunnel = ReverseTunnel(conn, http_port, remote_port=free_port()).start()
                ports = {"openssh": ssh_port, "gpumagic": tunnel.remote_port}
            else:
                tunnel = Tunnel(conn, http_port, remote_host="127.0.0.1", local_port=0).start()
                ports = {"openssh": ssh_port, "gpumagic": tunnel.local_port}
            print("reverse tunnels (ssh -R)" if args.reverse else "local tunnels (ssh -L)")
            cipher = conn.transport.remote_cipher
            mac = "built in (AEAD)" if "gcm" in cipher else conn.transport.remote_mac
            print(f"gpumagic (paramiko) cipher: {cipher}, MAC: {mac}; ssh: its defaults")
            mbps = {k: [] for k in ports}
            ttfb = {k: [] for k in ports}
            direct = []  # the same requests without any tunnel: what both tunnels add to
            for k, port in ports.items():  # warm-up
                download(port)
            for run in range(args.runs):
                for k, port in ports.items():
                    secs, size = download(port)
                    assert size == args.mb * 1024 * 1024, (k, size)
                    mbps[k].append(size / secs / 1e6)
                    t = small_ttfb(port, args.small)
                    ttfb[k].append(statistics.median(t))
                    print(f"run {run + 1} {k:9s} {mbps[k][-1]:8.1f} MB/s   "
                          f"small-request TTFB median {ttfb[k][-1] * 1e3:6.2f} ms")
                direct.append(statistics.median(small_ttfb(http_port, args.small)))
            tunnel.stop(raise_errors=False)
            for f in tunnel.faults:
                print(f"tunnel fault on connection {f.connection}: {f.message}")
            med = {k: (statistics.median(mbps[k]), statistics.median(ttfb[k])) for k in ports}
            for k in ports:
                print(f"median {k:9s} {med[k][0]:8.1f} MB/s   TTFB {med[k][1] * 1e3:6.2f} ms")
            print(f"throughput ratio gpumagic/openssh: {med['gpumagic'][0] / med['openssh'][0]:.2f} "
                  "(target >= 0.9)")
            print(f"latency ratio    gpumagic/openssh: {med['gpumagic'][1] / med['openssh'][1]:.2f} "
                  "(target <= 1.2)")
            base = statistics.median(direct)
            print(f"without a tunnel: TTFB {base * 1e3:.2f} ms; latency each tunnel adds, gpumagic/openssh: "
                  f"{(med['gpumagic'][1] - base) / (med['openssh'][1] - base):.2f}")
        finally:
            conn.close()
            if ssh is not None:
                ssh.terminate()
                ssh.wait()
            httpd.terminate()
            httpd.wait()
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
