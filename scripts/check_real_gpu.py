"""Check gpumagic's GPU parsers, doctor and failure hints on a real NVIDIA machine.

Run it ON the GPU machine (no SSH involved): it runs the exact program that ``%gpu status``
and ``%gpu doctor`` send (``gpu-sections.sh``), parses its output, and prints the renderings;
with PyTorch present it also puts a load on GPU 0 (bf16 matmuls holding ~10 GiB) to see
utilisation and a process, and provokes a real CUDA out-of-memory error to check its failure
hint.  The raw sections are written to OUTDIR (default ./real-gpu-check) as recordings.

    python3 scripts/check_real_gpu.py [OUTDIR]

Run it from a checkout (``PYTHONPATH=. python3 scripts/check_real_gpu.py``) or with gpumagic installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from gpumagic.notebook import display
from gpumagic.gpu import doctor, smi

LOAD = r"""
import time, torch
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
hold = torch.empty(10 * 2**30, dtype=torch.uint8, device="cuda")
end = time.time() + float(__import__("sys").argv[1])
print("load running", flush=True)
while time.time() < end:
    for _ in range(50):
        y = x @ x
    torch.cuda.synchronize()
"""


def gather(sections: list, outdir: Path, tag: str) -> dict:
    script = smi.sections_command(sections)
    start = time.monotonic()
    r = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=300, encoding="utf-8")
    took = time.monotonic() - start
    (outdir / f"{tag}.sections.txt").write_text(r.stdout, encoding="utf-8")
    secs = smi.split_sections(r.stdout)
    for name, s in secs.items():
        (outdir / f"{tag}.{name}.txt").write_text(f"# rc={s.rc}\n{s.text}", encoding="utf-8")
    print(f"[{tag}] gathered {sorted(secs)} in {took:.2f} s (stderr: {r.stderr.strip()!r})")
    return secs


def main() -> int:
    outdir = Path(sys.argv[1] if len(sys.argv) > 1 else "real-gpu-check")
    outdir.mkdir(parents=True, exist_ok=True)
    print("python:", sys.version.split()[0], "cwd:", os.getcwd())

    secs = gather(doctor.doctor_sections(), outdir, "idle")
    status = smi.status_from_sections(secs, host="device")
    print(display.status_text(status))
    print(display.doctor_text(doctor.diagnose(secs, host="device", expect_gpu="H200", expect_count=1)))
    print("unreadable lines:", status.skipped)
    for g in status.gpus:
        unknown = {k: v for k, v in vars(g).items() if not smi.known(v)}
        print(f"{g.label} unknown fields: {unknown}")

    has_torch = subprocess.run([sys.executable, "-c", "import torch; assert torch.cuda.is_available()"],
                               capture_output=True).returncode == 0
    print("torch with CUDA:", has_torch)
    if has_torch:
        load = subprocess.Popen([sys.executable, "-c", LOAD, "25"], stdout=subprocess.PIPE, text=True, encoding="utf-8")
        try:
            assert load.stdout.readline().strip() == "load running"
            time.sleep(2)
            secs = gather(doctor.doctor_sections(sample=3), outdir, "load")
            status = smi.status_from_sections(secs, host="device")
            print(display.status_text(status))
            report = doctor.diagnose(secs, host="device", expect_gpu="A100", sample=3)
            print(display.doctor_text(report))
            print("load pid:", load.pid, "listed:", [p.pid for p in status.processes])
        finally:
            load.kill()
            load.wait()
        oom = subprocess.run([sys.executable, "-c",
                              "import torch; torch.empty(400 * 2**30, dtype=torch.uint8, device='cuda')"],
                             capture_output=True, text=True, encoding="utf-8")
        (outdir / "oom-stderr.txt").write_text(oom.stderr, encoding="utf-8")
        print("OOM exit:", oom.returncode, "last line:", oom.stderr.strip().splitlines()[-1][:200])
        print("hint:", doctor.failure_hint(oom.stderr, oom.returncode))
    return 0


if __name__ == "__main__":
    sys.exit(main())
