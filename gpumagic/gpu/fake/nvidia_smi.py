#!/usr/bin/env python3
"""A stand-in ``nvidia-smi`` that replays real recordings (for tests and the sandbox only).

Which recording it replays is read on every call from the file named by
``$GPUMAGIC_FAKE_GPU_STATE`` (default: ``h200-idle``).  The file holds one word:

* a recording directory name beside this script (``h200-idle``, ``h200-load``) or an
  absolute path to a directory laid out the same way;
* ``mismatch``: NVML driver/library version mismatch, as printed by a real machine whose
  driver was upgraded without a reboot;
* ``no-driver``: "couldn't communicate with the NVIDIA driver".
* ``inforom`` (or ``inforom:RECORDING``): the recording's output, preceded by the line
  ``WARNING: infoROM is corrupted at gpu BUS_ID`` (the GPU's recorded ``pci.bus_id``), and
  exit status 14 ("infoROM is corrupted", nvidia-smi(1)): a card that still works.
* ``lost-gpu`` (or ``lost-gpu:RECORDING``): four GPUs made from the recorded one (index,
  uuid and bus id changed; every other value as recorded), GPU 2 lost: queries list GPUs
  0, 1, 3 and, in GPU 2's place, ``Unable to determine the device handle for
  GPU0000:00:08.0: Unknown Error``; plain ``nvidia-smi`` prints only that line.  Exit
  status 15 ("GPU has fallen off the bus").
* ``lost-gpu-fields`` (or ``lost-gpu-fields:RECORDING``): the same four GPUs, but GPU 2's
  row is listed with every value but its index as ``[GPU is lost]``; exit status 0.

The messages of these three modes are those users report from real machines; the exit
statuses are those nvidia-smi(1) documents for the condition, not recorded ones.

Arguments are matched to the recorded command lines (see recordings/README.md).  A
``--query-gpu`` asking for a subset of the recorded fields is answered by selecting those
columns from the recorded CSV, so every value printed was printed by the real tool.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RECORDED_Q = ("index,uuid,name,driver_version,pci.bus_id,memory.total,memory.used,memory.free,"
              "utilization.gpu,utilization.memory,temperature.gpu,power.draw,power.limit,"
              "clocks.sm,clocks.max.sm,pstate,compute_mode,mig.mode.current,fan.speed,"
              "persistence_mode").split(",")
# Names nvidia-smi accepts for the same field.
ALIASES = {"clocks.current.sm": "clocks.sm", "clocks.max.sm": "clocks.max.sm",
           "gpu_name": "name", "gpu_uuid": "uuid", "gpu_bus_id": "pci.bus_id",
           "temperature.gpu": "temperature.gpu"}
APPS_Q = ["pid", "process_name", "used_memory", "gpu_uuid"]

MISMATCH = ("Failed to initialize NVML: Driver/library version mismatch\n"
            "NVML library version: 570.124\n")
NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
             "Make sure that the latest NVIDIA driver is installed and running.\n\n")


def state():
    path = os.environ.get("GPUMAGIC_FAKE_GPU_STATE")
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or "h200-idle"
    return "h200-idle"


def read(d, name):
    p = os.path.join(d, name)
    if not os.path.exists(p):
        return None
    with open(p, encoding="utf-8") as f:
        return f.read()


def select_columns(text, header, wanted, fields):
    rows = []
    idx = [fields.index(w) for w in wanted]
    lines = text.splitlines()
    if header:
        head = [h.strip() for h in lines[0].split(", ")]
        rows.append(", ".join(head[i] for i in idx))
        lines = lines[1:]
    for line in lines:
        cols = line.split(", ")
        if len(cols) != len(fields):  # a message printed among the rows
            rows.append(line)
            continue
        rows.append(", ".join(cols[i] for i in idx))
    return "\n".join(rows) + ("\n" if rows else "")


#: Four GPUs made from one recorded GPU; GPU 2 is the one the lost-gpu modes lose.
SEVERAL = 4
LOST = 2


def lost_line(index):
    return f"Unable to determine the device handle for GPU0000:00:{6 + index:02X}.0: Unknown Error"


def several(text, header, lost_as):
    """The recorded one-GPU query-gpu CSV (RECORDED_Q order) as SEVERAL GPUs, GPU LOST shown as
    ``lost_as`` ("line": the handle error instead of its row; "fields": [GPU is lost] values)."""
    lines = text.splitlines()
    head, rows = (lines[:1], lines[1:]) if header else ([], lines)
    out = list(head)
    for row in rows:
        cols = row.split(", ")
        for i in range(SEVERAL):
            c = list(cols)
            if i:  # GPU 0 is the recorded one (the recorded processes run on it)
                c[0] = str(i)
                c[1] = c[1][:-2] + f"{i:02x}"
                c[4] = c[4][:-4] + f"{6 + i:02X}.0"
            if i == LOST and lost_as == "line":
                out.append(lost_line(i))
                continue
            if i == LOST:
                c = [c[0]] + ["[GPU is lost]"] * (len(c) - 1)
            out.append(", ".join(c))
    return "\n".join(out) + "\n"


def main(argv):
    mode = state()
    if mode == "mismatch":
        sys.stdout.write(MISMATCH)
        return 18
    if mode == "no-driver":
        sys.stdout.write(NO_DRIVER)
        return 9
    special, _, base = mode.partition(":")
    if special in ("inforom", "lost-gpu", "lost-gpu-fields"):
        rc, out = replay(argv, base or "h200-idle", lost_as={"lost-gpu": "line", "lost-gpu-fields": "fields"}
                         .get(special))
        if special == "inforom":
            bus = read(recording_dir(base or "h200-idle"), "query-gpu-noheader-nounits.csv").split(", ")[4]
            sys.stdout.write(f"WARNING: infoROM is corrupted at gpu {bus}\n")
            sys.stdout.write(out)
            return rc or 14
        if special == "lost-gpu" and not argv:  # the table: only the error, as users report it
            out = lost_line(LOST) + "\n"
        sys.stdout.write(out)
        return rc or (15 if special == "lost-gpu" else 0)
    rc, out = replay(argv, mode)
    sys.stdout.write(out)
    return rc


def recording_dir(mode):
    return mode if os.path.isabs(mode) else os.path.join(HERE, "recordings", mode)


def replay(argv, mode, lost_as=None):
    """(exit status, stdout) of the recorded ``nvidia-smi ARGV``; with ``lost_as``, the
    query-gpu rows of :func:`several` GPUs.  Its own errors go to stderr."""
    d = recording_dir(mode)
    if not os.path.isdir(d):
        sys.stderr.write(f"fake nvidia-smi: no recording {mode!r}\n")
        return 2, ""
    fmt = next((a.split("=", 1)[1] for a in argv if a.startswith("--format=")), "csv")
    noheader = "noheader" in fmt
    nounits = "nounits" in fmt

    def gpu_csv(name, header):
        text = read(d, name)
        return several(text, header, lost_as) if lost_as else text

    for a in argv:
        if a.startswith("--query-gpu="):
            wanted = [ALIASES.get(w.strip(), w.strip()) for w in a.split("=", 1)[1].split(",")]
            unknown = [w for w in wanted if w not in RECORDED_Q]
            if unknown:
                return 2, f'Field "{unknown[0]}" is not a valid field to query.\n\n'
            if nounits:
                text = gpu_csv("query-gpu-noheader-nounits.csv", False)
                out = select_columns(text, False, wanted, RECORDED_Q)
                if not noheader:
                    head = select_columns(read(d, "query-gpu.csv"), True, wanted, RECORDED_Q)
                    out = head.splitlines()[0] + "\n" + out
            else:
                out = select_columns(gpu_csv("query-gpu.csv", True), True, wanted, RECORDED_Q)
                if noheader:
                    out = "".join(out.splitlines(keepends=True)[1:])
            return 0, out
        if a.startswith("--query-compute-apps="):
            wanted = [w.strip() for w in a.split("=", 1)[1].split(",")]
            if noheader and nounits:
                text = read(d, "query-compute-apps-noheader-nounits.csv")
                if text is None:  # recorded with header only: no process
                    text = ""
                out = select_columns(text, False, wanted, APPS_Q) if text.strip() else ""
            else:
                out = select_columns(read(d, "query-compute-apps.csv"), True, wanted, APPS_Q)
                if noheader:
                    out = "".join(out.splitlines(keepends=True)[1:])
            if lost_as == "line":
                out = lost_line(LOST) + "\n" + out
            return 0, out
    simple = {("-L",): "nvidia-smi-L.txt", ("--version",): "nvidia-smi-version.txt",
              ("-q",): "nvidia-smi-q.txt", ("-q", "-x"): "nvidia-smi-q.xml",
              ("-x", "-q"): "nvidia-smi-q.xml", (): "nvidia-smi.txt",
              ("dmon", "-c", "2"): "dmon.txt"}
    name = simple.get(tuple(argv))
    text = read(d, name) if name else None
    if text is None:
        sys.stderr.write(f"fake nvidia-smi: nothing recorded for {' '.join(argv)!r} in {mode}\n")
        return 2, ""
    return 0, text


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
