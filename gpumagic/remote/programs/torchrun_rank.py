# gpumagic's per-rank start under torchrun (copied next to the job's script, run by torchrun as
# the worker's program): records which local rank and pid this global rank has, in
# $GPUMAGIC_TORCHRUN_DIR/ranks/RANK ("LOCAL_RANK PID"), then runs the job's script as __main__
# (or, after --exec, replaces itself with the command) with the user's umask ($GPUMAGIC_UMASK).
# RANK and LOCAL_RANK are set by torchrun.
import os
import runpy
import sys

d = os.environ.get("GPUMAGIC_TORCHRUN_DIR", ".")
rank = os.environ.get("RANK", "")
if rank.isdigit():
    os.makedirs(os.path.join(d, "ranks"), exist_ok=True)
    tmp = os.path.join(d, "ranks", f".{rank}.tmp")
    with open(tmp, "w") as f:
        f.write(f"{os.environ.get('LOCAL_RANK', '')} {os.getpid()}\n")
    os.replace(tmp, os.path.join(d, "ranks", rank))
umask = os.environ.pop("GPUMAGIC_UMASK", "")
if umask.isdigit():  # torchrun ran with umask 077; the job's own files get the user's umask
    os.umask(int(umask, 8))
if len(sys.argv) > 2 and sys.argv[1] == "--exec":
    os.execvp(sys.argv[2], sys.argv[2:])
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
