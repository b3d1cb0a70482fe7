"""Benchmark: the soak of issue 28, a notebook's whole working day over a link that blinks and roams.

Starts its own loopback OpenSSH sshd with the test kit's link emulator in front of it
(``tests/linkemu.py``; 40 ms RTT, 20 Mbit/s up, 50 down by default) and runs, all at once,
for ``--minutes`` (default 120): a ``%%remote`` cell printing a numbered line every second, a
detached job doing the same with its log followed (``Job.follow``, what ``%gpu logs -f``
runs), and a live session (``RemoteKernel``) running cells back to back that do the same.
Meanwhile the link blinks (``--blink-seconds``, default 5) every ``--blink-every`` seconds
(default 300) and roams every ``--roam-every`` seconds (default 1200).

Pass: no numbered line lost or repeated (the cell's, the followed job log's, the session's),
no error shown, every reconnect within the bound (10 s while a cell runs, plus one connect).
Prints what it counted and PASS or FAIL (exit status 1).  The logic is ``tests/soak.py``;
CI runs it for 2 minutes (tests/test_resilience.py).

    PYTHONPATH=. python benchmarks/soak.py                       # 2 hours
    ... --minutes 10 --blink-every 60 --roam-every 180
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from gpumagic.ssh.sandbox import SshServer  # noqa: E402
from linkemu import Link, LinkedMachine  # noqa: E402
from soak import run_soak  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=120)
    ap.add_argument("--blink-every", type=float, default=300, metavar="SECONDS")
    ap.add_argument("--roam-every", type=float, default=1200, metavar="SECONDS")
    ap.add_argument("--blink-seconds", type=float, default=5)
    ap.add_argument("--one-connection", action="store_true",
                    help="follow the job on the cell's connection (two Machine.run at once there)")
    ap.add_argument("--rtt-ms", type=float, default=40)
    ap.add_argument("--up-mbit", type=float, default=20)
    ap.add_argument("--down-mbit", type=float, default=50)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="gpumagic-soak-"))
    home = base / "home"
    home.mkdir()
    server = SshServer(base / "sshd", env={"HOME": str(home)}).start()
    link = Link(server.port, rtt_ms=args.rtt_ms, up_mbit=args.up_mbit, down_mbit=args.down_mbit).start()
    linked = LinkedMachine(server, link)
    print(f"link: {args.rtt_ms:g} ms RTT, {args.up_mbit:g}/{args.down_mbit:g} Mbit/s; {args.minutes:g} min, "
          f"a {args.blink_seconds:g} s blink every {args.blink_every:g} s, a roam every {args.roam_every:g} s",
          flush=True)
    try:
        result = run_soak(linked, seconds=args.minutes * 60, blink_every=args.blink_every,
                          roam_every=args.roam_every, blink_seconds=args.blink_seconds,
                          one_connection=args.one_connection,
                          say=lambda text: print(text, flush=True))
    finally:
        linked.close()
        server.stop()
    print(result.report(), flush=True)
    return 0 if not result.problems() else 1


if __name__ == "__main__":
    sys.exit(main())
