# exec-stop-kept.py GRACE ID: stop the kept cell ID (gpumagic/remote/execution.py, _reattach and
# _stop_kept_when_possible), run over a new connection when its client gave up on it: the
# grace passed without a connection, or Ctrl-C came while none was there.  Its owner runner
# (exec-runner.py) then spools its exit status and ends by itself.
# * The cell's process group is in ~/.gpumagic/cells/ID/lease (its third word, written when it
#   started; the first is its owner runner's PID, the second its grace): SIGTERM
#   to it, SIGKILL to what is left GRACE seconds later.
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


def group_alive(g):
    """A live (not zombie) process in process group ``g``."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:
            continue
        if len(fields) > 2 and fields[2] == b"%d" % g and fields[0] not in (b"Z", b"X"):
            return True
    return False


try:
    os.makedirs(cells, 0o700, exist_ok=True)
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
if pgid <= 1 or os.path.exists(os.path.join(d, "end")) or not group_alive(pgid):
    print("gone")
    sys.exit(0)
try:
    os.killpg(pgid, signal.SIGTERM)
except OSError:
    pass
until = time.monotonic() + grace
while time.monotonic() < until and group_alive(pgid):
    time.sleep(0.1)
if group_alive(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
until = time.monotonic() + 2
while time.monotonic() < until and group_alive(pgid):
    time.sleep(0.1)
print("left" if group_alive(pgid) else "stopped")
