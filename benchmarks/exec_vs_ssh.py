"""Per-command latency: a gpumagic cell on the open connection vs the `ssh host cmd` command.

Starts its own loopback sshd (like the test bed), then times, N times each:
  * `ssh -i KEY -p PORT host true`             (what a student types; a new connection each time)
  * a raw paramiko exec of `true` on the open connection (open_session, exec_command,
    read to the exit status: the least any exec can cost)
  * `machine.exec("true")`                      (one exec on the open connection, no wrapper)
  * `machine.run(["true"])`                     (a full %%remote cell: wrapper, login env, cleanup)
  * `machine.run("echo hi")`                    (the same for `%%remote echo hi`: bash runs the cell)
and prints medians and the ratios gpumagic / ssh and gpumagic / raw paramiko exec.
Not a test: numbers vary by machine.

    python benchmarks/exec_vs_ssh.py [N]
"""

import statistics
import subprocess
import sys
import tempfile
import time

import gpumagic
from gpumagic.ssh.sandbox import SshServer


def median_seconds(fn, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(n=20):
    with tempfile.TemporaryDirectory() as d, SshServer(d) as server:
        ssh = server.ssh_command("true")
        subprocess.run(ssh, check=True)
        t_ssh = median_seconds(lambda: subprocess.run(ssh, check=True), n)
        m = gpumagic.Machine(server.spec()).connect()
        m.run(["true"], quiet=True)  # reads the login environment once
        transport = m.connection.transport

        def raw():
            chan = transport.open_session()
            chan.exec_command("true")
            chan.recv_exit_status()
            chan.close()

        t_raw = median_seconds(raw, n)
        t_exec = median_seconds(lambda: m.exec("true"), n)
        t_cell = median_seconds(lambda: m.run(["true"], quiet=True), n)
        t_echo = median_seconds(lambda: m.run("echo hi", quiet=True), n)
        m.close()
    print(f"median of {n}:")
    print(f"  ssh host true          {t_ssh * 1000:8.1f} ms")
    print(f"  raw paramiko exec      {t_raw * 1000:8.1f} ms   ratio {t_raw / t_ssh:.3f}x ssh")
    for label, t in (("machine.exec('true')", t_exec), ("machine.run(['true'])", t_cell),
                     ("machine.run('echo hi')", t_echo)):
        print(f"  {label:<22} {t * 1000:8.1f} ms   ratio {t / t_ssh:.3f}x ssh, {t / t_raw:.3f}x raw exec")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
