#!/usr/bin/env python3
"""A stand-in ``nvidia-smi`` that replays real recordings (for tests and the sandbox only).

Which recording it replays is read on every call from the file named by
``$GPUMAGIC_FAKE_GPU_STATE`` (default: ``h200-idle``).  The file holds one word:

* a recording directory name beside this script (``h200-idle``, ``h200-load``) or an
  absolute path to a directory laid out the same way;
* ``mismatch``: NVML driver/library version mismatch, as printed by a real machine whose
  driver was upgraded without a reboot;
* ``no-driver``: "couldn't communicate with the NVIDIA driver".

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
        with open(path) as f:
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
        rows.append(", ".join(cols[i] for i in idx))
    return "\n".join(rows) + ("\n" if rows else "")


def main(argv):
    mode = state()
    if mode == "mismatch":
        sys.stdout.write(MISMATCH)
        return 18
    if mode == "no-driver":
        sys.stdout.write(NO_DRIVER)
        return 9
    d = mode if os.path.isabs(mode) else os.path.join(HERE, "recordings", mode)
    if not os.path.isdir(d):
        sys.stderr.write(f"fake nvidia-smi: no recording {mode!r}\n")
        return 2
    fmt = next((a.split("=", 1)[1] for a in argv if a.startswith("--format=")), "csv")
    noheader = "noheader" in fmt
    nounits = "nounits" in fmt
    for a in argv:
        if a.startswith("--query-gpu="):
            wanted = [ALIASES.get(w.strip(), w.strip()) for w in a.split("=", 1)[1].split(",")]
            unknown = [w for w in wanted if w not in RECORDED_Q]
            if unknown:
                sys.stdout.write(f'Field "{unknown[0]}" is not a valid field to query.\n\n')
                return 2
            if nounits:
                text = read(d, "query-gpu-noheader-nounits.csv")
                out = select_columns(text, False, wanted, RECORDED_Q)
                if not noheader:
                    head = select_columns(read(d, "query-gpu.csv"), True, wanted, RECORDED_Q)
                    out = head.splitlines()[0] + "\n" + out
            else:
                out = select_columns(read(d, "query-gpu.csv"), True, wanted, RECORDED_Q)
                if noheader:
                    out = "".join(out.splitlines(keepends=True)[1:])
            sys.stdout.write(out)
            return 0
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
            sys.stdout.write(out)
            return 0
    simple = {("-L",): "nvidia-smi-L.txt", ("--version",): "nvidia-smi-version.txt",
              ("-q",): "nvidia-smi-q.txt", ("-q", "-x"): "nvidia-smi-q.xml",
              ("-x", "-q"): "nvidia-smi-q.xml", (): "nvidia-smi.txt",
              ("dmon", "-c", "2"): "dmon.txt"}
    name = simple.get(tuple(argv))
    text = read(d, name) if name else None
    if text is None:
        sys.stderr.write(f"fake nvidia-smi: nothing recorded for {' '.join(argv)!r} in {mode}\n")
        return 2
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
