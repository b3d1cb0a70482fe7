"""Per-command latency: a gpumagic cell on the open connection vs the `ssh host cmd` command.

Starts its own loopback sshds (like the test bed): one whose account has an empty HOME, one
whose ``~/.bashrc`` costs about 200 ms (``sleep 0.2`` with no "not interactive, return" guard,
as many GPU images ship with conda or pyenv init).  On each it times, N times each:
  * `ssh -i KEY -p PORT host echo hi`          (what a student types; a new connection each time)
  * a raw paramiko exec of `echo hi` on the open connection (open_session, exec_command,
    read to the exit status: the least any exec can cost; it runs the login shell too)
  * `machine.exec("true")`                      (one exec on the open connection, no wrapper)
  * `machine.run(["true"])`                     (a full %%remote cell)
  * `machine.run("echo hi")`                    (the same for `%%remote echo hi`: bash runs the cell)
each cell both through the per-connection runner (today's path) and with the runner turned
off (``execution.USE_RUNNER = False``: one exec through the login shell per cell),
then prints medians and the issue's two ratios against their targets.
Not a test: numbers vary by machine.

    python benchmarks/exec_vs_ssh.py [N]
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time

import gpumagic
from gpumagic.remote import execution
from gpumagic.ssh.sandbox import SshServer

SLOW_BASHRC = "sleep 0.2\nexport GM_SLOW_RC=1\n"


def median_seconds(fn, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(d, name, bashrc, n):
    home = os.path.join(d, name + "-home")
    os.makedirs(home)
    if bashrc:
        with open(os.path.join(home, ".bashrc"), "w", encoding="utf-8") as f:
            f.write(bashrc)
    out = {}
    with SshServer(os.path.join(d, name), env={"HOME": home}, alias=name) as server:
        ssh = server.ssh_command("echo hi")
        subprocess.run(ssh, check=True, capture_output=True)
        out["ssh host echo hi"] = median_seconds(
            lambda: subprocess.run(ssh, check=True, capture_output=True), max(5, n // 2))
        m = gpumagic.Machine(server.spec()).connect()
        m.run(["true"], quiet=True)  # reads the login environment once, starts the runner
        transport = m.connection.transport

        def raw():
            chan = transport.open_session()
            chan.exec_command("echo hi")
            chan.recv_exit_status()
            chan.close()

        out["raw paramiko exec"] = median_seconds(raw, n)
        out["machine.exec('true')"] = median_seconds(lambda: m.exec("true"), n)
        for use in (False, True):
            execution.USE_RUNNER = use
            m.run(["true"], quiet=True)
            tag = "runner" if use else "no runner"
            out[f"run(['true']), {tag}"] = median_seconds(lambda: m.run(["true"], quiet=True), n)
            out[f"run('echo hi'), {tag}"] = median_seconds(lambda: m.run("echo hi", quiet=True), n)
        execution.USE_RUNNER = True
        m.close()
    return out


def main(n=20):
    with tempfile.TemporaryDirectory() as d:
        empty = measure(d, "empty", "", n)
        slow = measure(d, "slowrc", SLOW_BASHRC, n)
    print(f"median of {n} (ssh: of {max(5, n // 2)}), ms:")
    print(f"  {'':<28} {'empty HOME':>11} {'slow .bashrc':>13}")
    for k in empty:
        print(f"  {k:<28} {empty[k] * 1000:11.1f} {slow[k] * 1000:13.1f}")
    print("issue 20 targets:")
    for tag in ("no runner", "runner"):
        cell_e, cell_s = empty[f"run('echo hi'), {tag}"], slow[f"run('echo hi'), {tag}"]
        r1 = cell_e / empty["raw paramiko exec"]
        r2 = cell_s / slow["ssh host echo hi"]
        r3 = cell_s / slow["raw paramiko exec"]
        print(f"  [{tag}] %%remote echo hi / raw exec, empty HOME: {r1:.2f}x (target <= 1.5x) "
              f"{'met' if r1 <= 1.5 else 'NOT met'}")
        print(f"  [{tag}] %%remote echo hi / ssh host echo hi, slow .bashrc: {r2:.3f}x (target <= 0.1x) "
              f"{'met' if r2 <= 0.1 else 'NOT met'}")
        print(f"  [{tag}] %%remote echo hi / raw exec, slow .bashrc: {r3:.2f}x (target <= 1.5x) "
              f"{'met' if r3 <= 1.5 else 'NOT met'}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
