"""example-notebooks/02-check-the-machine.ipynb, executed with nbclient against the sandbox
(the replaying nvidia-smi on h200-load)."""

import os
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "example-notebooks" / "02-check-the-machine.ipynb"


@pytest.fixture(autouse=True)
def kernel_imports_this_checkout(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def cell_outputs(nb, source: str) -> tuple[str, str, list]:
    """(stdout+stderr text, text/plain of displays, errors) of the code cell with this source."""
    cell = next(c for c in nb.cells if c.cell_type == "code" and c.source == source)
    streams = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
    plain = "".join(o.get("data", {}).get("text/plain", "") for o in cell.outputs
                    if o.output_type in ("display_data", "execute_result"))
    return streams, plain, [o for o in cell.outputs if o.output_type == "error"]


@pytest.mark.tutorial("02-check-the-machine.ipynb")
def test_check_the_machine_notebook_runs_and_shows_status_doctor_and_hint(executed):
    nb = executed["02-check-the-machine.ipynb"]
    line = "GPU0 NVIDIA H200 | util 100% | mem 20213/143771 MiB | 58C | 691/700 W"
    streams, plain, _ = cell_outputs(nb, "%gpu status --text")
    assert plain == ""  # --text: plain text only, no HTML
    assert streams.splitlines() == ["sandbox: driver 580.159.04, CUDA 13.0 (driver maximum)", line,
                                    "  python3 (pid 485) 20204 MiB"]
    cell = next(c for c in nb.cells if c.cell_type == "code" and c.source == "%gpu status")
    shown, = [o for o in cell.outputs if o.output_type == "display_data"]
    # a one-shot status is static: HTML and text, no widget model (issue 17 case 1)
    assert set(shown.data) == {"text/plain", "text/html"}
    assert line in shown.data["text/plain"]
    streams, _, _ = cell_outputs(nb, "%gpu status --stop")
    assert streams == "stopped watching sandbox\n"
    _, plain, _ = cell_outputs(nb, "%gpu doctor --expect-gpu H200 --expect-count 1")
    assert plain.startswith("sandbox doctor: 0 fail, ")
    assert "ok    GPU model          NVIDIA H200 (expected H200)" in plain
    _, plain, _ = cell_outputs(nb, "%gpu doctor --expect-gpu A100")
    assert "FAIL  GPU model          expected A100, the machine has NVIDIA H200" in plain
    _, plain, _ = cell_outputs(nb, "%gpu doctor --sample 2")
    assert "ok    utilisation        over 2 s: GPU 100% busy" in plain
    source = next(c.source for c in nb.cells if c.source.startswith("%%remote --python --no-raise-error"))
    streams, _, errors = cell_outputs(nb, source)
    assert errors == []
    assert "RuntimeError: CUDA out of memory" in streams
    assert streams.rstrip().splitlines()[-1].startswith("hint: GPU memory ran out: halve the batch size")
    # %gpu fit against the replayed H200 (143771 MiB, 20213 MiB held by a process)
    _, plain, _ = cell_outputs(nb, "%gpu fit 7B --infer")
    assert "against NVIDIA H200 on sandbox (GPU0): 120.7 GiB free of 140.4 GiB -> FITS" in plain
    _, plain, _ = cell_outputs(nb, "%gpu fit 7B --train --batch 4 --seq 2048")
    assert "-> DOES NOT FIT" in plain and "change first: " in plain and "an estimate" in plain
    source = next(c.source for c in nb.cells if c.source.endswith("--batch 16 --seq 1024 --card 4090"))
    _, plain, _ = cell_outputs(nb, source)
    assert "124M parameters (exact count from " in plain and "against RTX 4090 24 GB" in plain
    streams, _, _ = cell_outputs(nb, "%gpu disconnect")
    assert streams == "disconnected from sandbox\n"
