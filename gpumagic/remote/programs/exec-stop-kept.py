# exec-stop-kept.py GRACE ID: stop the kept cell ID (gpumagic/remote/execution.py, _reattach and
# _stop_kept_when_possible), run over a new connection when its client gave up on it: the
# grace passed without a connection, or Ctrl-C came while none was there.  Its owner runner
# (exec-runner.py) then spools its exit status and ends by itself.
# * The cell's process group is in ~/.gpumagic/cells/ID/lease (its third word, written when it
#   started; the first is its owner runner's PID, the second its grace), and every process
#   that carries the cell's mark (GPUMAGIC_CELL=ID in its environment: also one that left
#   the group with setsid): SIGTERM to them, SIGKILL to what is left GRACE seconds later.
# * An ID not claimed yet (its request is still on its way through a dying path, or lost) is
#   claimed here as ended, so that the request never starts it later.
# Prints `stopped` (the group was running and is gone now), `gone` (nothing of it runs), or
# `left` (it outlived SIGKILL: a process in uninterruptible sleep, D state).
import os
import signal
import sys
import time

grace = float(sys.argv[1])
cells = os.path.join(os.environ.get("HOME") or "/", ".gpumagic", "cells")
d = os.path.join(cells, os.path.basename(sys.argv[2]))


MARK = b"GPUMAGIC_CELL=" + os.path.basename(sys.argv[2]).encode("ascii", "replace")


def private_dirs(path):
    """Make ``path`` and ~/.gpumagic above it, each 0700 (os.makedirs gives only the last one
    its mode: ~/.gpumagic came out 0755 when a cell made it first)."""
    for d in (os.path.dirname(path), path):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass


def alive(g):
    """The live (not zombie) processes of the cell: in process group ``g``, or marked."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
            if len(fields) < 3 or fields[0] in (b"Z", b"X"):
                continue
            if fields[2] == b"%d" % g:
                pids.append((int(name), True))
            else:
                with open("/proc/%s/environ" % name, "rb") as f:
                    if MARK in f.read().split(b"\0"):
                        pids.append((int(name), False))
        except OSError:
            continue
    return pids


def kill(g, sig):
    try:
        os.killpg(g, sig)
    except OSError:
        pass
    for pid, in_group in alive(g):
        if not in_group:
            try:
                os.kill(pid, sig)
            except OSError:
                pass


try:
    private_dirs(cells)
    os.mkdir(d, 0o700)
except FileExistsError:
    pass
except OSError:
    print("gone")
    sys.exit(0)
else:
    with open(os.path.join(d, "end"), "w") as f:
        f.write("130\n")
    with open(os.path.join(d, "lease"), "w"):
        pass
    print("gone")
    sys.exit(0)
try:
    with open(os.path.join(d, "lease"), "rb") as f:
        pgid = int(f.read().split()[2])
except (OSError, ValueError, IndexError):
    pgid = 0
if pgid <= 1 or os.path.exists(os.path.join(d, "end")) or not alive(pgid):
    print("gone")
    sys.exit(0)
kill(pgid, signal.SIGTERM)
until = time.monotonic() + grace
while time.monotonic() < until and alive(pgid):
    time.sleep(0.1)
if alive(pgid):
    kill(pgid, signal.SIGKILL)
until = time.monotonic() + 2
while time.monotonic() < until and alive(pgid):
    time.sleep(0.1)
print("left" if alive(pgid) else "stopped")
