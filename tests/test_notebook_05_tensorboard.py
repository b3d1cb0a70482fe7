"""example-notebooks/05-tensorboard.ipynb, executed with nbclient against the sandbox."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest



NOTEBOOK = Path(__file__).resolve().parent.parent / "example-notebooks" / "05-tensorboard.ipynb"


def _text(cell) -> str:
    parts = []
    for o in cell.outputs:
        parts.append(o.get("text") or o.get("data", {}).get("text/plain", ""))
    return "".join(parts)


@pytest.mark.tutorial("05-tensorboard.ipynb")
def test_tensorboard_notebook_serves_tensorboard_through_the_tunnel(executed):
    cells = [c for c in executed[NOTEBOOK.name].cells if c.cell_type == "code"]
    by_source = {c.source.splitlines()[0]: _text(c) for c in cells}

    opened = by_source["%gpu tunnel tensorboard --logdir gpumagic-tutorial/runs --out tb"]
    started = re.search(r"started TensorBoard on sandbox \(pid (\d+),", opened)
    assert started, opened
    link = re.search(r"-> (http://127\.0\.0\.1:(\d+)/)", opened)
    assert link, opened

    fetched = by_source["import json, urllib.request"]
    assert "TensorBoard page: ok" in fetched
    assert "runs and tags: {'demo': ['accuracy', 'loss']}" in fetched

    listed = by_source["%gpu tunnel list"]
    row = [ln for ln in listed.splitlines() if ln.startswith(link.group(2))]
    assert len(row) == 1 and link.group(1) in row[0], listed

    closed = by_source["%gpu tunnel close all --stop"]
    assert f"stopped its server on the machine (pid {started.group(1)})" in closed
    pid = int(started.group(1))
    try:
        os.kill(pid, 0)  # the sandbox is this computer: the process must be gone
        alive = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8").split()[2] != "Z"
    except ProcessLookupError:
        alive = False
    assert not alive, f"TensorBoard (pid {pid}) still running after `close --stop`"
