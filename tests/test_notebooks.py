"""Notebooks executed with nbclient against the sandbox machine."""

import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "example-notebooks"


@pytest.fixture(autouse=True)
def kernel_imports_this_checkout(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def outputs(nb, startswith):
    cell = next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith(startswith))
    text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
    errors = [o for o in cell.outputs if o.output_type == "error"]
    return text, errors


@pytest.mark.tutorial("01-quickstart.ipynb")
def test_quickstart_notebook_runs_end_to_end(executed):
    nb = executed["01-quickstart.ipynb"]
    text, _ = outputs(nb, "%gpu connect --sandbox")
    assert "sandbox machine up" in text and "connected to sandbox" in text
    text, _ = outputs(nb, '%%remote\necho "hello')
    assert "hello from" in text and "step 3" in text
    text, _ = outputs(nb, "%%remote --python\nimport platform")
    assert "sum of squares: 332833500" in text
    text, _ = outputs(nb, "%%remote --python\nimport time")
    assert text.endswith("training 100%\n") and "\r" not in text  # saved as JupyterLab shows it
    text, errors = outputs(nb, '%%remote --python\ndata = {"lr"')
    assert "KeyError: 'batch_size'" in text
    assert errors and errors[0].ename == "RemoteCommandError"
    assert not any("gpumagic/" in line for line in errors[0].traceback)
    text, _ = outputs(nb, 'print("exit code:"')
    assert "exit code: 2" in text and "No such file or directory" in text
    text, _ = outputs(nb, "free_gb")
    assert text.startswith("free on /: ") and text.rstrip().endswith("GB")
    text, _ = outputs(nb, "%gpu disconnect")
    assert text == "disconnected from sandbox\n"


def _pgrep(pattern):
    r = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True, encoding="utf-8")
    return r.stdout.split()


def test_interrupting_a_cell_stops_run_all_and_the_remote_process(tmp_path):
    # case 2, notebook half: cell 2 writes a file; interrupting cell 1 means it never ran.
    marker = tmp_path / "cell2-ran"
    token = "gm" + uuid.uuid4().hex[:12]  # other test runs may share this machine
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext gpumagic\n%gpu connect --sandbox"),
        nbformat.v4.new_code_cell(f'%%remote\npython3 -c "import time; [time.sleep(1) for _ in range(600)]" {token}'),
        nbformat.v4.new_code_cell(f"open({str(marker)!r}, 'w').write('ran')"),
    ]
    client = NotebookClient(nb, timeout=60, kernel_name="python3")
    pattern = f"{token[:-1]}[{token[-1]}]"
    fired = {}

    def interrupt_when_running():
        deadline = time.monotonic() + 60
        while not _pgrep(pattern) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(3)
        fired["pids"] = _pgrep(pattern)
        fired["at"] = time.monotonic()
        os.kill(client.km.provisioner.pid, signal.SIGINT)  # what Jupyter's interrupt sends

    t = threading.Thread(target=interrupt_when_running, daemon=True)
    t.start()
    with pytest.raises(CellExecutionError) as e:
        client.execute()
    t.join()
    assert fired["pids"], "the remote cell never started"
    assert "KeyboardInterrupt" in str(e.value)
    assert not marker.exists()
    deadline = fired["at"] + 2
    while _pgrep(pattern) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _pgrep(pattern) == []


@pytest.mark.parametrize("name, message, hint", [
    ("nosuch.ipynb", "gpumagic: nosuch.ipynb does not exist",
     "  hint: give the path of an .ipynb file (relative paths start at {cwd})"),
    ("not-json.ipynb", "gpumagic: not-json.ipynb is not a notebook (not JSON)",
     "  hint: give the path of an .ipynb file saved by Jupyter"),
])
def test_run_notebook_command_bad_notebook_is_a_one_line_error(tmp_path, monkeypatch, capsys, name,
                                                              message, hint):
    from gpumagic.__main__ import main  # what `python -m gpumagic` runs

    (tmp_path / "not-json.ipynb").write_text("print('hello')\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert main(["run-notebook", name]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [message, hint.format(cwd=tmp_path)], err


@pytest.mark.timeout(300)
@pytest.mark.tutorial("09-move-a-run.ipynb")
def test_tutorial_09_runs_again_against_the_same_sandbox_and_reads_run_2s_folder(executed, tmp_path):
    """Run a second time as a student re-runs it, the sandbox's home and this computer's keep
    records kept from the first: the job is run 2, kept in ./tutorial-move/run-2/ckpt/, which
    the tutorial asks the keeper for (it waited on ./tutorial-move/ckpt/ for ever)."""
    import tutorials

    name = "09-move-a-run.ipynb"
    assert executed[name]  # the first run
    nb = nbformat.read(tutorials._run(executed.src / name, tmp_path / "again", executed.data(name)), as_version=4)
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    text, _ = outputs(nb, "%%remote --job tutorial-move")
    assert "of job tutorial-move in " in text and "/tutorial-move/run-2/ckpt" in text, text
    text, _ = outputs(nb, "import time")
    assert text.startswith("kept here: [") and "'step-10.json'" in text, text


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["09-move-a-run.ipynb", "zh-CN/09-move-a-run.ipynb"])
def test_tutorial_09_moves_a_lost_run_to_b_and_its_loss_goes_on_from_the_checkpoint(executed, name):
    nb = executed[name]
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    text, _ = outputs(nb, "%gpu jobs --host a")
    lost = next(ln for ln in text.splitlines() if ln.startswith("job tutorial-move: lost at "))
    assert ": its process is gone without an exit code" in lost, lost
    assert "; last checkpoint ckpt/step-" in lost and "of training lost" in lost, lost
    text, _ = outputs(nb, "%gpu job move tutorial-move --to b")
    assert "job tutorial-move moved from a to b and started there" in text, text
    text, _ = outputs(nb, 'b = gpumagic.current_machine("b")')
    log = text.splitlines()
    seam = next(i for i, ln in enumerate(log) if ln.startswith("--- gpumagic: job tutorial-move moved from a to b"))
    assert "from checkpoint ckpt/step-" in log[seam], log[seam]
    step = int(log[seam + 1].split()[3])  # "resumed at step 10 from ..."
    assert log[seam + 1].startswith("resumed at step ") and step >= 5, log[seam + 1]
    assert log[seam + 2].startswith(f"step {step + 1} loss "), log[seam + 2]  # on from the checkpoint
    starts = [i for i, ln in enumerate(log) if ln.startswith("step 1 loss ")]
    assert starts == [0], starts  # a's log as kept here starts the one log; b did not start anew
    assert log[-1].startswith("done, w = 2.9"), log[-1]
    text, _ = outputs(nb, "import re")
    assert text.startswith("step   on a    on b\n"), text
    again = [ln.split() for ln in text.splitlines()[1:] if ln.split()[1] != "-" and ln.split()[2] != "-"]
    assert again and all(a == b for _, a, b in again), text  # the steps run twice give the same loss
    cell = next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith("import re"))
    assert any("image/png" in o.get("data", {}) for o in cell.outputs)
