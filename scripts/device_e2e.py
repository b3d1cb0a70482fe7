"""End-to-end check of gpumagic against a real GPU machine over a real sshd.

Meant for a GPU test machine where ``Host gpu`` in ~/.ssh/config reaches a loopback sshd
(see the project's device notes); usable against any machine alias.  Each step prints one
line ``STEP name: ok|FAIL ... (seconds)`` and the script exits non-zero if any failed.

    python3 scripts/device_e2e.py [ALIAS] [OUTDIR]
"""

from __future__ import annotations

import _thread
import os
import sys
import threading
import time
import traceback
import urllib.request
from pathlib import Path

import gpumagic
from gpumagic.notebook import display

ALIAS = sys.argv[1] if len(sys.argv) > 1 else "gpu"
OUT = Path(sys.argv[2] if len(sys.argv) > 2 else "device-e2e")
OUT.mkdir(parents=True, exist_ok=True)
results: list[tuple[str, bool, str, float]] = []


def step(name):
    def wrap(fn):
        t = time.monotonic()
        try:
            note = fn() or ""
            ok = True
        except Exception as e:  # report every step, keep going
            note = f"{type(e).__name__}: {e}"
            (OUT / f"{name}.traceback.txt").write_text(traceback.format_exc(), encoding="utf-8")
            ok = False
        took = time.monotonic() - t
        results.append((name, ok, note, took))
        print(f"STEP {name}: {'ok' if ok else 'FAIL'} {note} ({took:.2f} s)", flush=True)
        return fn
    return wrap


def compute_apps(m) -> str:
    return m.exec("nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader").stdout.strip()


m = gpumagic.connect(ALIAS)


@step("torch_cuda_cell")
def _():
    r = m.run("import torch; x = torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16);"
              "y = (x @ x).float().sum().item(); print(torch.cuda.get_device_name(0), torch.version.cuda)",
              python=True, quiet=True, check=True)
    assert "H200" in r.stdout, r.stdout
    return r.stdout.strip()


@step("interrupt_frees_gpu")
def _():
    code = ("import torch, time\nhold = torch.empty(8 * 2**30, dtype=torch.uint8, device='cuda')\n"
            "print('holding', flush=True)\nwhile True:\n    time.sleep(0.2)\n")
    started = threading.Event()

    def interrupt_once_running():
        if started.wait(60):
            time.sleep(2)
            _thread.interrupt_main()

    threading.Thread(target=interrupt_once_running, daemon=True).start()
    t0 = None
    try:
        m.run(code, python=True, quiet=True,
              stdout=lambda s: "holding" in s and started.set())
    except KeyboardInterrupt:
        t0 = time.monotonic()
    assert t0 is not None, "no KeyboardInterrupt"
    deadline = t0 + 2.0
    apps = compute_apps(m)
    while apps and time.monotonic() < deadline:
        time.sleep(0.1)
        apps = compute_apps(m)
    assert not apps, f"still on the GPU after 2 s: {apps}"
    return f"GPU free {time.monotonic() - t0:.2f} s after the interrupt"


@step("status_and_doctor")
def _():
    s = m.gpu_status()
    text = display.status_text(s)
    (OUT / "status.txt").write_text(text, encoding="utf-8")
    assert "H200" in text, text
    d = m.doctor(expect_gpu="H200", expect_count=1)
    (OUT / "doctor.txt").write_text(display.doctor_text(d), encoding="utf-8")
    return text.splitlines()[1] if len(text.splitlines()) > 1 else text


@step("job_survives_disconnect_in_tmux")
def _():
    m.start_job("e2e-train", "import torch, time\nfor i in range(8):\n"
                      "    x = torch.randn(1024, 1024, device='cuda'); print('step', i, 'loss', float(x.mean()))\n"
                      "    time.sleep(0.5)\n", python=True)
    m.close()
    m2 = gpumagic.connect(ALIAS)
    info = next(j for j in m2.jobs() if j.name == "e2e-train")
    state_while = info.state_text
    end = m2.job("e2e-train").wait(timeout=60)
    log = m2.job("e2e-train").logs(50)
    m2.close()
    assert end.exit_code == 0 and "step 7" in log, (end, log)
    return f"runner={end.runner}; while disconnected: {state_while}; then exited 0"


@step("job_kill_frees_gpu")
def _():
    mm = gpumagic.connect(ALIAS)
    job = mm.start_job("e2e-hold", "python3 -c \"import torch,time; h=torch.empty(2**30, device='cuda'); "
                       "print('held', flush=True); time.sleep(600)\" & wait")
    deadline = time.monotonic() + 60
    while "held" not in job.logs(5) and time.monotonic() < deadline:
        time.sleep(0.3)
    job.kill()
    deadline = time.monotonic() + 6
    while compute_apps(mm) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = compute_apps(mm)
    mm.close()
    assert not left, left
    return "no compute process left"


@step("sync_push_pull")
def _():
    mm = gpumagic.connect(ALIAS)
    src = OUT / "tree"
    (src / "data").mkdir(parents=True, exist_ok=True)
    for i in range(200):
        (src / "data" / f"f{i}.txt").write_text(f"file {i}\n" * 50, encoding="utf-8")
    (src / "big.bin").write_bytes(os.urandom(64 * 2**20))
    a = mm.push(str(src) + "/", "/tmp/e2e-tree/")
    b = mm.push(str(src) + "/", "/tmp/e2e-tree/")
    c = mm.pull("/tmp/e2e-tree/", str(OUT / "pulled") + "/")
    mm.close()
    assert (OUT / "pulled" / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
    return f"first: {a}; again: {b}; pull: {c}".replace("\n", " ")


@step("tensorboard_tunnel")
def _():
    mm = gpumagic.connect(ALIAS)
    mm.run("from torch.utils.tensorboard import SummaryWriter\nw = SummaryWriter('/tmp/e2e-runs')\n"
           "[w.add_scalar('loss', 1.0 / (i + 1), i) for i in range(20)]\nw.close()", python=True,
           quiet=True, check=True)
    tb = mm.tunnels.tensorboard("/tmp/e2e-runs")
    deadline = time.monotonic() + 60
    body = ""
    while time.monotonic() < deadline:
        try:
            body = urllib.request.urlopen(tb.url, timeout=5).read().decode(errors="replace")
            break
        except Exception:
            time.sleep(1)
    mm.close()
    assert "TensorBoard" in body or "tensorboard" in body, body[:200]
    return f"{tb.url} served TensorBoard"


@step("exec_latency")
def _():
    t = time.perf_counter()
    for _ in range(20):
        m.exec("true")
    e = (time.perf_counter() - t) / 20
    t = time.perf_counter()
    for _ in range(20):
        m.run(["true"], quiet=True)
    r = (time.perf_counter() - t) / 20
    return f"exec {e * 1000:.1f} ms, cell {r * 1000:.1f} ms per call on the open connection"


m.close()
failed = [r for r in results if not r[1]]
(OUT / "summary.txt").write_text("\n".join(f"{n}: {'ok' if ok else 'FAIL'} {note} ({t:.2f} s)"
                                           for n, ok, note, t in results) + "\n", encoding="utf-8")
print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
sys.exit(1 if failed else 0)
