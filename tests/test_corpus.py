"""Public teaching notebooks run locally and in a live session give the same outputs (issue 32).

The corpus (``tests/corpus/``, sources, commits and licences in its README) is three notebooks
no one on the project wrote: pandas' Styler guide, a matplotlib gallery example with fourteen
figures and a scikit-learn gallery example (digits, an SVC, a report and a confusion matrix).
Each is run with nbclient three ways:

* ``local``: as it is, with a local ipykernel;
* ``remote``: after a setup cell (``%load_ext gpumagic``, ``%gpu connect testgpu``, ``%gpu kernel
  start``), every code cell prefixed with ``%%remote --kernel NAME``;
* ``autorun``: the same setup cell ending in ``%gpu kernel autorun on NAME``, cells unchanged.

Both remote variants end with a ``%gpu kernel stop NAME`` cell (nbclient runs it after a failed
cell too: ``allow_errors``; the module's ``stop_every_kernel`` kills what a broken run leaves).

Then every code cell is compared with its local twin: the cell's execution count, and for each
output its type, the execute_result's execution count, its mime types, every text value
(text/plain, text/html, stream text, error name and value), its metadata, and the byte size of
each PNG.  Execution counts: the setup cell takes count 1 in the remote variants, so their
counts are the local ones plus :data:`SETUP_CELLS` (and the remote execute_result must carry
that local-notebook count, not the session's own).  Streams are coalesced as JupyterLab does
when it saves (``coalesce_streams``): how a stream was cut into messages is not compared.
stderr is compared like stdout (none of the three writes to it, locally or remotely).

The only differences let through are :data:`ALLOWED`: text that is random or an address in
either run.
"""

from __future__ import annotations

import base64
import copy
import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from test_kernel import PY, ROOT, stop_every_kernel  # noqa: F401  (stop_every_kernel: autouse)

pytest.importorskip("sklearn")

CORPUS = Path(__file__).parent / "corpus"
NOTEBOOKS = sorted(p.name for p in CORPUS.glob("*.ipynb"))

#: Differences allowed between a local and a remote run, each a (pattern, replacement) applied
#: to every text value of both runs before they are compared.  Keep it short: everything else
#: that differs is a difference the test reports.
ALLOWED = [
    # Object addresses in default reprs (``[<matplotlib.lines.Line2D at 0x7f3a...>]``,
    # ``<pandas.io.formats.style.Styler at 0x7f...>``): two processes, two heaps.
    (re.compile(r"\b0x[0-9a-f]{6,16}\b"), "0xADDR"),
    # pandas' Styler names its table and cells after a random 5-hex-digit uuid (``#T_3fa2c_row0_col1``,
    # ``<table id="T_3fa2c">``) unless the notebook sets one: random in every run, local ones too.
    (re.compile(r"(?<=\bT_)[0-9a-f]{5}(?=[_\"\s])"), "UUID5"),
]

#: Code cells a remote variant runs before the notebook's first one.
SETUP_CELLS = 1


def _norm(text: str) -> str:
    for pattern, replacement in ALLOWED:
        text = pattern.sub(replacement, text)
    return text


def _execute(nb, cwd: Path):
    NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True, coalesce_streams=True,
                   resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


def _variant(nb, mode: str, name: str):
    """The notebook as the remote variant ``mode`` runs it: a setup cell, the notebook's cells
    (each code cell prefixed with ``%%remote --kernel NAME`` for ``remote``), a stop cell."""
    nb = copy.deepcopy(nb)
    setup = f"%load_ext gpumagic\n%gpu connect testgpu\n%gpu kernel start {name} --python {PY}"
    if mode == "autorun":
        setup += f"\n%gpu kernel autorun on {name}"
    else:
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.source = f"%%remote --kernel {name}\n{cell.source}"
    nb.cells = [nbformat.v4.new_code_cell(setup), *nb.cells, nbformat.v4.new_code_cell(f"%gpu kernel stop {name}")]
    return nb


def _digest(cell, offset: int) -> dict:
    """What is compared of one code cell (counts brought back to the local notebook's)."""
    outputs = []
    for o in cell.outputs:
        if o.output_type == "stream":
            outputs.append({"type": "stream", "name": o.name, "text": _norm(o.text)})
        elif o.output_type == "error":
            outputs.append({"type": "error", "ename": o.ename, "evalue": _norm(o.evalue)})
        else:
            data = {}
            for mime, value in sorted(o.data.items()):
                if mime == "image/png":
                    data[mime] = f"{len(base64.b64decode(value))} bytes"
                else:
                    data[mime] = _norm(value) if isinstance(value, str) else value
            d = {"type": o.output_type, "mimes": sorted(o.data), "data": data, "metadata": dict(o.metadata)}
            if o.output_type == "execute_result":
                d["execution_count"] = o.execution_count - offset
            outputs.append(d)
    return {"execution_count": (cell.execution_count or 0) - offset, "outputs": outputs}


def _differences(local, remote) -> list[str]:
    """Every difference between the local run and a remote one, cell by cell, one line each
    (the outputs' order included: a cell's value comes before the figures it draws)."""
    ours = [c for c in local.cells if c.cell_type == "code"]
    theirs = [c for c in remote.cells if c.cell_type == "code"]
    setup, body, stop = theirs[:SETUP_CELLS], theirs[SETUP_CELLS:-1], theirs[-1]
    found = []
    for cell in [*setup, stop]:
        found += [f"setup/stop cell {cell.source!r}: {o.ename}: {o.evalue}" for o in cell.outputs
                  if o.output_type == "error"]
    if len(body) != len(ours):
        return found + [f"{len(body)} code cells ran remotely, {len(ours)} locally"]
    for i, (a, b) in enumerate(zip(ours, body)):
        da, db = _digest(a, 0), _digest(b, SETUP_CELLS)
        where = f"code cell {i} (count {a.execution_count}, {a.source.splitlines()[0][:50]!r})"
        if da["execution_count"] != db["execution_count"]:
            found.append(f"{where}: execution_count {a.execution_count} here, {b.execution_count} remotely")
        oa, ob = da["outputs"], db["outputs"]
        if [o["type"] for o in oa] != [o["type"] for o in ob]:
            found.append(f"{where}: output types {[o['type'] for o in oa]} here, {[o['type'] for o in ob]} remotely"
                         f" -- remote outputs {ob!r:.600}")
            continue
        for j, (x, y) in enumerate(zip(oa, ob)):
            for key in sorted(set(x) | set(y)):
                if key == "data":
                    for mime in sorted(set(x["data"]) | set(y["data"])):
                        u, v = x["data"].get(mime), y["data"].get(mime)
                        if u != v:
                            found.append(f"{where}, output {j} {mime}: {str(u)[:300]!r} here, {str(v)[:300]!r} remotely")
                elif x.get(key) != y.get(key):
                    found.append(f"{where}, output {j} {key}: {x.get(key)!r:.300} here, {y.get(key)!r:.300} remotely")
    return found


_RUNS: dict[tuple[str, str], object] = {}


def _run(name: str, mode: str, tmp_path_factory, monkeypatch):
    """The notebook ``name`` run as ``mode`` (``local``, ``remote``, ``autorun``), once per module."""
    if (name, mode) not in _RUNS:
        nb = nbformat.read(CORPUS / name, as_version=4)
        if mode != "local":
            monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
            nb = _variant(nb, mode, "corpus_" + re.sub(r"\W", "_", Path(name).stem) + "_" + mode)
        _RUNS[name, mode] = _execute(nb, tmp_path_factory.mktemp(mode))
    return _RUNS[name, mode]


def test_the_corpus_is_three_notebooks_with_their_sources_and_licences():
    assert len(NOTEBOOKS) >= 3
    readme = (CORPUS / "README.md").read_text(encoding="utf-8")
    for name in NOTEBOOKS:
        source = nbformat.read(CORPUS / name, as_version=4).metadata["gpumagic_corpus_source"]
        assert name in readme and source.split("@")[0] in readme, name
    for licence in ("LICENSE.pandas", "LICENSE.matplotlib", "COPYING.scikit-learn"):
        assert (CORPUS / licence).is_file(), licence


@pytest.mark.timeout(300)
@pytest.mark.slow(240, reason="a teaching notebook run locally and in a session on the machine, each cell compared")
@pytest.mark.parametrize("mode", ["remote", "autorun"])
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_a_teaching_notebook_gives_the_same_outputs_in_a_session_as_locally(name, mode, tmp_path_factory, monkeypatch):
    local = _run(name, "local", tmp_path_factory, monkeypatch)
    assert not [o for c in local.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    differences = _differences(local, _run(name, mode, tmp_path_factory, monkeypatch))
    assert not differences, "\n".join(differences)
