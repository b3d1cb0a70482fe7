"""Live Python sessions on the machine (gpumagic/remote/kernel.py, notebook/magics/kernel.py,
remote/programs/kernel_keeper.py), against the real test sshd.

The test machine is this computer: kernels run with this venv's python (it has ipykernel,
matplotlib, pandas), chosen explicitly with ``python=sys.executable`` / ``--python``.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

import gpumagic
from gpumagic.remote import kernel as gk
from gpumagic.errors import Interrupted
from gpumagic.remote.kernel import KernelConnectionLost, KernelError, Output, RemoteKernelError

from conftest import CLIENT_HOME, session_sshd_pid, wait_until

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


class Recorder(Output):
    """Keeps everything a kernel shows, in order."""

    def __init__(self, on_text=None, answers=()):
        self.events: list[tuple] = []
        self.on_text = on_text
        self.answers = list(answers)
        self.prompts: list[tuple[str, bool]] = []

    def stream(self, name, text):
        self.events.append(("stream", name, text))
        if self.on_text:
            self.on_text(self.text)

    def display(self, data, metadata, display_id=None, update=False):
        self.events.append(("update" if update else "display", data, display_id))

    def clear(self, wait=False):
        self.events.append(("clear", wait))

    def note(self, text):
        self.events.append(("note", text))

    def ask(self, prompt, password=False):
        self.prompts.append((prompt, password))
        return self.answers.pop(0)

    @property
    def text(self) -> str:
        return "".join(e[2] for e in self.events if e[0] == "stream" and e[1] == "stdout")


def remote_home(sshd) -> Path:
    return Path(sshd.env["HOME"])


def kernel_dir(sshd, name: str) -> Path:
    return remote_home(sshd) / ".gpumagic" / "kernels" / name


@pytest.fixture(scope="module", autouse=True)
def stop_every_kernel(sshd):
    """No keeper or kernel outlives this module (they are detached by design)."""
    yield
    root = remote_home(sshd) / ".gpumagic" / "kernels"
    for state in root.glob("*/state.json"):
        try:
            pid = json.loads(state.read_text(encoding="utf-8"))["keeper_pid"]
            os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError, KeyError):
            pass
    deadline = time.monotonic() + 20
    while list(root.glob("*/state.json")) and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.fixture
def m(sshd):
    machine = gpumagic.connect("testgpu")
    yield machine
    machine.close()


def start(m, name: str) -> gk.RemoteKernel:
    k = m.kernel(name, python=PY)
    return k


def stop_quietly(k):
    try:
        k.stop()
    except Exception:
        pass


# -- case 1 -------------------------------------------------------------------------------


def test_a_variable_set_in_one_kernel_cell_is_there_in_the_next(ip, capsys):
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", f"kernel start c1 --python {PY}")
    capsys.readouterr()
    ip.run_cell_magic("remote", "--kernel c1", "x = 41")
    ip.run_cell_magic("remote", "--kernel c1", "print(x + 1)")
    assert capsys.readouterr().out == "42\n"
    # the default session is the one used last
    ip.run_cell_magic("remote", "--kernel", "print(x * 2)")
    assert capsys.readouterr().out == "82\n"
    ip.run_line_magic("gpu", "kernel stop c1")


def test_a_remote_exception_raises_here_with_the_machines_traceback(ip):
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", f"kernel start c1e --python {PY}")
    try:
        with pytest.raises(RemoteKernelError) as e:
            ip.run_cell_magic("remote", "--kernel c1e", "def f():\n    return 1 / 0\nf()")
        assert e.value.ename == "ZeroDivisionError"
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln) for ln in e.value._render_traceback_()]
        assert any("return 1 / 0" in ln for ln in lines)
        assert not any("gpumagic/" in ln for ln in lines)
        # through run_cell (what a notebook does), the cell fails so Run All stops
        result = ip.run_cell("%%remote --kernel c1e\n[][1]")
        assert isinstance(result.error_in_exec, RemoteKernelError)
        assert result.error_in_exec.ename == "IndexError"
        # --no-raise-error shows it and goes on
        ip.run_cell_magic("remote", "--kernel c1e --no-raise-error --out r", "{}['k']")
        assert ip.user_ns["r"].status == "error" and ip.user_ns["r"].error.ename == "KeyError"
    finally:
        ip.run_line_magic("gpu", "kernel stop c1e")


# -- case 2 -------------------------------------------------------------------------------


def test_a_plot_comes_back_as_png_and_a_dataframe_as_html_in_the_executed_notebook(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(f"%load_ext gpumagic\n%gpu connect testgpu\n%gpu kernel start c2 --python {PY}"),
        nbformat.v4.new_code_cell("%%remote --kernel c2\nimport matplotlib.pyplot as plt\n"
                                  "plt.plot([1, 3, 2])\nplt.title('loss')\nplt.show()"),
        nbformat.v4.new_code_cell("%%remote --kernel c2\nimport pandas as pd\n"
                                  "pd.DataFrame({'epoch': [1, 2], 'loss': [0.9, 0.5]})"),
        nbformat.v4.new_code_cell("%%remote --kernel c2\nfrom IPython.display import display, Markdown\n"
                                  "h = display(Markdown('step 1'), display_id=True)\nh.update(Markdown('step 2'))"),
        nbformat.v4.new_code_cell("%%remote --kernel c2\nimport sys\nfor i in range(3):\n"
                                  "    print(f'\\rtraining {i}', end='')\nprint()"),
        nbformat.v4.new_code_cell("%%remote --kernel c2\nfrom IPython.display import clear_output\n"
                                  "print('old')\nclear_output()\nprint('new')"),
        nbformat.v4.new_code_cell("%gpu kernel stop c2"),
    ]
    NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    plot, table, handle, bar = nb.cells[1].outputs, nb.cells[2].outputs, nb.cells[3].outputs, nb.cells[4].outputs
    assert any(o.output_type == "display_data" and "image/png" in o.data for o in plot), plot
    png = next(o.data["image/png"] for o in plot if o.output_type == "display_data")
    import base64

    assert base64.b64decode(png)[:8] == b"\x89PNG\r\n\x1a\n"
    assert any("text/html" in o.get("data", {}) and "<table" in o.data["text/html"] for o in table), table
    assert [o.data["text/markdown"] for o in handle if o.output_type == "display_data"] == ["step 2"]
    text = "".join(o.get("text", "") for o in bar if o.output_type == "stream")
    assert text.endswith("training 2\n")
    assert [o.get("text") for o in nb.cells[5].outputs] == ["new\n"]


def test_a_machine_connected_from_python_in_a_notebook_displays_its_sessions_there(ip, m):
    # outputs.py no longer looks for IPython: the package's connect hands the notebook's
    # output in (the magics' own, with their comm bridges), as %gpu connect's fleet does
    from gpumagic.notebook.magics.kernel import NotebookOutput

    out = m.kernels.output()
    assert isinstance(out, NotebookOutput) and out.bridges is ip._gpumagic.state.bridges
    ip.run_line_magic("gpu", "connect testgpu")
    assert ip._gpumagic.fleet.get("testgpu").kernels.output().bridges is ip._gpumagic.state.bridges


def test_a_kernels_output_is_printed_where_nothing_handed_one_in(sshd):
    from gpumagic.machine import connect
    from gpumagic.remote.kernel import TextOutput

    with connect("testgpu") as machine:  # the Machine's own connect: no notebook handed in
        assert isinstance(machine.kernels.output(), TextOutput)
        assert isinstance(machine.kernels.handle("plain").default_output(), TextOutput)


# -- case 3 -------------------------------------------------------------------------------


def test_output_printed_while_disconnected_is_shown_once_in_order_on_attach(m, monkeypatch):
    # A running cell reconnects by itself now (tests/test_resilience.py); without that,
    # the cell's error and then `attach` must still show every line once, in order.
    monkeypatch.setattr(gk.client, "RECONNECT", gk.client.RECONNECT.but(times=0))
    k = start(m, "c3")
    try:
        sshd_pid = session_sshd_pid(m)
        killed = []

        def kill_after_three(text):
            if not killed and "line 2\n" in text:
                killed.append(time.monotonic())
                os.kill(sshd_pid, signal.SIGKILL)  # the SSH connection drops mid-cell

        first = Recorder(on_text=kill_after_three)
        with pytest.raises(KernelConnectionLost) as e:
            k.execute("import time\nfrom IPython.display import display\nfor i in range(30):\n"
                      "    print(f'line {i}', flush=True)\n"
                      "    if i == 4:\n        display({'image/png': 'iVBORw0KGgo='}, raw=True)\n"
                      "    time.sleep(0.3)\ndone = 'yes'", output=first)
        assert "attach c3" in str(e.value)
        assert killed
        time.sleep(2)  # the cell goes on printing on the machine meanwhile (9 s in all)
        second = Recorder()
        status = k.attach(output=second)  # reconnects, shows the backlog, follows to the end
        assert status["state"] == "idle"
        lines = (first.text + second.text).splitlines()
        assert lines == [f"line {i}" for i in range(30)]
        # the image printed while away comes in its place, once
        shown = [e[2] if e[0] == "stream" else "<image>" for e in second.events if e[0] in ("stream", "display")]
        assert "".join(shown).count("<image>") == 1
        assert "line 4\n<image>line 5\n" in "".join(shown)
        assert k.pull(["i", "done"]) == {"i": 29, "done": "yes"}
    finally:
        stop_quietly(k)


def test_output_shown_just_before_a_disconnect_is_not_shown_again(sshd):
    m1 = gpumagic.connect("testgpu")
    k = m1.kernel("c3b", python=PY)
    try:
        k.execute("print('once')", output=Recorder())
        m1.close()  # at once: before the deferred acknowledgement
        m2 = gpumagic.connect("testgpu")
        out = Recorder()
        m2.kernel("c3b", start=False).execute("print('next')", output=out)
        # its text, in however many messages the kernel's stream flushed it ('next', then '\n',
        # with both suites at once): 'once' is not among them
        assert {e[:2] for e in out.events} == {("stream", "stdout")} and out.text == "next\n", out.events
        m2.close()
    finally:
        stop_quietly(gpumagic.connect("testgpu").kernel("c3b", start=False))


def test_the_display_cap_of_remote_applies_to_kernel_cells(ip, capsys):
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", f"kernel start cap --python {PY}")
    ip.run_line_magic("config", "GpuMagics.max_display_bytes = 1000")
    try:
        capsys.readouterr()
        ip.run_cell_magic("remote", "--kernel cap --out r", "print('x' * 5000)")
        shown = capsys.readouterr()
        assert shown.out == "x" * 1000
        assert "4,001 more characters were not displayed (limit 1,000)" in shown.err
        assert ip.user_ns["r"].stdout == "x" * 5000 + "\n"  # --out keeps everything
    finally:
        ip.run_line_magic("config", "GpuMagics.max_display_bytes = 5000000")
        ip.run_line_magic("gpu", "kernel stop cap")


# -- issue 32 (7): text counts as text, images as images -----------------------------------


@pytest.fixture
def shown_bundles(ip, monkeypatch):
    """The MIME bundles this notebook's shell displays, in order."""
    out: list[dict] = []
    monkeypatch.setattr(ip.display_pub, "publish",
                        lambda data, metadata=None, source=None, **kw: out.append(data))
    return out


#: A cell that shows three 3600x3600-pixel figures' worth of PNG (about 2.5 MB of base64
#: each, as a dense 36x36-inch figure at 100 dpi gives).
THREE_FIGURES = ("from IPython.display import display\n"
                 "for i in range(3):\n"
                 "    display({'image/png': 'iVBORw0KGgo' + str(i) * 2_500_000,\n"
                 "             'text/plain': '<Figure size 3600x3600 with 1 Axes>'}, raw=True)")


def test_three_large_figures_all_show_under_the_default_limits(ip, capsys, shown_bundles):
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", f"kernel start figs --python {PY}")
    try:
        capsys.readouterr()
        ip.run_cell_magic("remote", "--kernel figs", THREE_FIGURES)
        pngs = [b["image/png"] for b in shown_bundles if "image/png" in b]
        assert [p[11] for p in pngs] == ["0", "1", "2"]
        assert all(len(p) == 2_500_011 for p in pngs)
        assert "not displayed" not in capsys.readouterr().err
    finally:
        ip.run_line_magic("gpu", "kernel stop figs")


def test_images_past_the_image_limit_are_held_back_and_the_note_says_how_to_get_them(ip, capsys,
                                                                                     shown_bundles):
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", f"kernel start imgcap --python {PY}")
    ip.run_line_magic("config", "GpuMagics.max_image_bytes = 3000000")
    try:
        capsys.readouterr()
        ip.run_cell_magic("remote", "--kernel imgcap --out r", THREE_FIGURES + "\nprint('text')")
        assert [b["image/png"][11] for b in shown_bundles if "image/png" in b] == ["0"]
        seen = capsys.readouterr()
        assert seen.out == "text\n"  # text has its own limit
        assert ("[gpumagic: 2 images (5 MB) were not displayed (image limit 3 MB); --out VAR keeps "
                "them in VAR.outputs; raise the limit with %config GpuMagics.max_image_bytes = N]") in seen.err
        assert "characters were not displayed" not in seen.err
        assert [o["data"]["image/png"][11] for o in ip.user_ns["r"].outputs] == ["0", "1", "2"]
    finally:
        ip.run_line_magic("config", "GpuMagics.max_image_bytes = 50000000")
        ip.run_line_magic("gpu", "kernel stop imgcap")


def test_text_past_the_text_limit_is_cut_and_images_are_not_counted_as_text(ip, capsys, shown_bundles):
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", f"kernel start txtcap --python {PY}")
    ip.run_line_magic("config", "GpuMagics.max_display_bytes = 1000")
    try:
        capsys.readouterr()
        ip.run_cell_magic("remote", "--kernel txtcap", (
            "from IPython.display import HTML, display\n"
            "display({'image/png': 'A' * 5000}, raw=True)\n"
            "display(HTML('<b>' + 'h' * 5000 + '</b>'))\n"
            "print('x' * 2000)"))
        assert [sorted(b) for b in shown_bundles] == [["image/png"]]  # the HTML is held back
        seen = capsys.readouterr()
        assert seen.out == "x" * 1000
        assert "6,042 more characters were not displayed (limit 1,000)" in seen.err
        assert "image" not in seen.err
    finally:
        ip.run_line_magic("config", "GpuMagics.max_display_bytes = 5000000")
        ip.run_line_magic("gpu", "kernel stop txtcap")


def test_limits_count_what_the_notebook_holds_a_live_plot_ends_on_its_last_frame(ip, capsys, shown_bundles):
    """A live plot that redraws with clear_output(wait=True), text that is cleared and a display
    updated in place: the notebook holds one frame, one text, one display; none is held back
    (12 frames of 1 MB under a 3 MB image limit said '[gpumagic: 9 images (9 MB) were not
    displayed ...]' where a local kernel ends on the last frame)."""
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", f"kernel start live --python {PY}")
    ip.run_line_magic("config", "GpuMagics.max_image_bytes = 3000000")
    ip.run_line_magic("config", "GpuMagics.max_display_bytes = 1000")
    cleared = []
    monkey = pytest.MonkeyPatch()
    import IPython.display
    monkey.setattr(IPython.display, "clear_output", lambda wait=False: cleared.append(wait))
    try:
        capsys.readouterr()
        ip.run_cell_magic("remote", "--kernel live", (
            "from IPython.display import clear_output, display\n"
            "for i in range(12):\n"
            "    clear_output(wait=True)\n"
            "    print('frame', i, '.' * 600)\n"
            "    display({'image/png': 'iVBORw0KGgo' + chr(65 + i) * 1_000_000}, raw=True)\n"
            "h = display({'text/plain': 'v0'}, raw=True, display_id=True)\n"
            "for i in range(1, 30):\n"
            "    h.update({'image/png': 'iVBORw0KGgo' + 'u' * 1_000_000, 'text/plain': f'v{i}'}, raw=True)\n"))
        pngs = [b["image/png"] for b in shown_bundles if "image/png" in b]
        assert [p[11] for p in pngs[:12]] == [chr(65 + i) for i in range(12)]
        assert len(pngs) == 12 + 29 and cleared == [True] * 12
        seen = capsys.readouterr()
        assert "not displayed" not in seen.err, seen.err
        assert seen.out.count("frame ") == 12
    finally:
        monkey.undo()
        ip.run_line_magic("config", "GpuMagics.max_image_bytes = 50000000")
        ip.run_line_magic("config", "GpuMagics.max_display_bytes = 5000000")
        ip.run_line_magic("gpu", "kernel stop live")


def test_output_cap_counts_updates_in_place_and_holds_back_what_never_fits():
    from gpumagic.notebook.magics._output import OutputCap

    cap = OutputCap(100, image_limit=1000)
    assert cap.admit_display({"image/png": "a" * 600}, "d1")
    assert cap.admit_display({"image/png": "b" * 900}, "d1", update=True)  # replaces the 600
    assert not cap.admit_display({"image/png": "c" * 1001}, "d1", update=True)  # too big: the 900 stays
    assert cap.images_shown == 900 and cap.images_dropped == 1
    assert not cap.admit_display({"image/png": "d" * 200}, "d2")  # 900 + 200 > 1000
    assert not cap.admit_display({"image/png": "e" * 10}, "d2", update=True)  # d2 was held back
    assert cap.admit_display({"image/png": "f" * 10}, "elsewhere", update=True)  # not this cell's: passes
    cap.clear()
    assert (cap.images_shown, cap.images_dropped, cap.held_back) == (0, 0, False)
    assert cap.admit_display({"image/png": "g" * 1000}, "d2")


# -- case 4 -------------------------------------------------------------------------------


def test_an_interrupt_during_sleep_raises_keyboardinterrupt_here_and_keeps_the_variables(m):
    k = start(m, "c4")
    try:
        k.execute("before = 'kept'", output=Recorder())
        sent = []

        def interrupt_soon(text):
            if not sent and "sleeping" in text:
                sent.append(time.monotonic())
                threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()

        with pytest.raises(KeyboardInterrupt) as e:
            k.execute("import time\nprint('sleeping', flush=True)\ntime.sleep(100)",
                      output=Recorder(on_text=interrupt_soon))
        raised = time.monotonic()
        assert isinstance(e.value, Interrupted)
        assert "variables are kept" in str(e.value)
        assert raised - (sent[0] + 0.5) < 2.0
        out = Recorder()
        k.execute("print(before)", output=out)
        assert out.text == "kept\n"
    finally:
        stop_quietly(k)


def test_a_cell_that_ignores_sigint_says_so_and_restart_is_the_way_out(m, monkeypatch):
    monkeypatch.setattr(gk.client, "INTERRUPT_WAIT", 2.0)
    k = start(m, "c4i")
    try:
        def interrupt_soon(text):
            if "ignoring" in text:
                threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()

        with pytest.raises(Interrupted) as e:
            k.execute("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                      "print('ignoring', flush=True)\ntime.sleep(100)",
                      output=Recorder(on_text=interrupt_soon))
        assert "did not stop" in str(e.value) and "%gpu kernel restart c4i" in str(e.value)
        assert k.info().state == "busy"
        k.restart(output=Recorder())
        out = Recorder()
        k.execute("print('fresh', 'signal' in dir())", output=out)
        assert out.text == "fresh False\n"
    finally:
        stop_quietly(k)


# -- case 5 -------------------------------------------------------------------------------


def _local_process(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(CLIENT_HOME),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=120, encoding="utf-8")


def test_variables_are_there_for_a_new_local_process_after_the_first_exits(sshd):
    first = _local_process(
        "import gpumagic, sys\nm = gpumagic.connect('testgpu')\n"
        f"k = m.kernel('c5', python={PY!r})\nk.execute('z = 123; w = [1, 2]')\nprint('set')\n")
    assert first.returncode == 0, first.stderr
    assert first.stdout == "set\n"
    second = _local_process(
        "import gpumagic\nm = gpumagic.connect('testgpu')\nk = m.kernel('c5', start=False)\n"
        "print(k.pull(['z', 'w']))\nk.execute('print(z + 1)')\nk.stop()\n")
    assert second.returncode == 0, second.stderr
    assert second.stdout == "{'z': 123, 'w': [1, 2]}\n124\n"


# -- case 6 -------------------------------------------------------------------------------


def test_input_on_the_machine_prompts_here_and_the_answer_gets_back(ip, capsys, monkeypatch):
    prompts = []
    monkeypatch.setattr("builtins.input", lambda prompt="": prompts.append(prompt) or "Ada")
    monkeypatch.setattr("getpass.getpass", lambda prompt="": prompts.append(("secret", prompt)) or "s3cret")
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", f"kernel start c6 --python {PY}")
    capsys.readouterr()
    try:
        ip.run_cell_magic("remote", "--kernel c6",
                          "name = input('name? ')\nprint('hello', name)\n"
                          "import getpass\npw = getpass.getpass('password: ')\nprint(len(pw))")
        assert prompts == ["name? ", ("secret", "password: ")]
        assert capsys.readouterr().out.endswith("hello Ada\n6\n")
    finally:
        ip.run_line_magic("gpu", "kernel stop c6")


# -- case 7 -------------------------------------------------------------------------------


def test_a_python_without_ipykernel_gets_one_line_with_its_path_and_the_install_command(ip, sshd, tmp_path):
    bare = tmp_path / "bare"
    subprocess.run([sys.base_prefix + "/bin/python3" if os.path.exists(sys.base_prefix + "/bin/python3")
                    else "python3", "-m", "venv", "--without-pip", str(bare)], check=True)
    bare_py = str(bare / "bin" / "python")
    assert subprocess.run([bare_py, "-c", "import ipykernel"], capture_output=True).returncode != 0
    ip.run_line_magic("gpu", "connect testgpu")
    with pytest.raises(KernelError) as e:
        ip.run_line_magic("gpu", f"kernel start c7 --python {bare_py}")
    assert str(e.value) == (f"{bare_py} on testgpu has no ipykernel: install it with "
                            f"`{bare_py} -m pip install ipykernel` (or add --install)")
    assert e.value._render_traceback_() == [f"KernelError: {e.value}"]
    # nothing keeps running for it
    assert not (kernel_dir(sshd, "c7") / "state.json").exists()


def test_no_such_python_is_a_clear_error(m):
    with pytest.raises(KernelError) as e:
        m.kernel("c7b", python="/nonexistent/python3")
    assert "no python '/nonexistent/python3' on testgpu" in str(e.value)


# -- case 8 -------------------------------------------------------------------------------


def test_two_sessions_keep_separate_variables_and_stopping_one_leaves_the_other(m):
    a, b = start(m, "c8a"), start(m, "c8b")
    try:
        a.execute("v = 'from a'", output=Recorder())
        b.execute("v = 'from b'", output=Recorder())
        assert a.pull("v") == "from a" and b.pull("v") == "from b"
        a.stop()
        names = {i.name: i.state for i in gk.list_kernels(m)}
        assert "c8a" not in names and names["c8b"] == "idle"
        out = Recorder()
        b.execute("print(v)", output=out)
        assert out.text == "from b\n"
        with pytest.raises(KernelError) as e:
            a.execute("print(v)", output=Recorder())
        assert "no session 'c8a' on testgpu" in str(e.value)
    finally:
        stop_quietly(a)
        stop_quietly(b)


# -- case 9 -------------------------------------------------------------------------------


def _listening(pid: int) -> list[str]:
    """Local addresses (``ip:port``) of the TCP sockets process ``pid`` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            rows = Path(table).read_text(encoding="utf-8").splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cells = row.split()
            local, st, inode = cells[1], cells[3], cells[9]
            if st != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            addr, port = local.split(":")
            if v6:
                ip = "::1" if addr == "0" * 24 + "01000000" else addr
            else:
                ip = ".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0))
            found.append(f"{ip}:{int(port, 16)}")
    return found


def test_connection_file_is_private_ports_are_loopback_and_the_key_is_never_shown(ip, sshd, capsys):
    before = _listening(os.getpid())
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", f"kernel start c9 --python {PY}")
    try:
        ip.run_cell_magic("remote", "--kernel c9", "print('hi')")
        ip.run_line_magic("gpu", "kernel list")
        d = kernel_dir(sshd, "c9")
        cf = d / "connection.json"
        assert stat.S_IMODE(cf.stat().st_mode) == 0o600
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
        assert stat.S_IMODE(d.parent.stat().st_mode) == 0o700
        info = json.loads(cf.read_text(encoding="utf-8"))
        assert info["ip"] == "127.0.0.1"
        state = json.loads((d / "state.json").read_text(encoding="utf-8"))
        kernel_ports = _listening(state["kernel_pid"])
        keeper_ports = _listening(state["keeper_pid"])
        assert len(kernel_ports) >= 5 and len(keeper_ports) == 1
        assert all(a.startswith("127.0.0.1:") for a in kernel_ports + keeper_ports), kernel_ports + keeper_ports
        assert {info[f"{ch}_port"] for ch in ("shell", "iopub", "stdin", "control", "hb")} <= {
            int(a.split(":")[1]) for a in kernel_ports}
        # nothing listens on this side (the laptop) for it
        assert _listening(os.getpid()) == before
        key = info["key"]
        assert len(key) >= 32
        shown = capsys.readouterr()
        assert key not in shown.out + shown.err
        for f in d.iterdir():
            if f.name != "connection.json" and f.is_file():
                assert key.encode() not in f.read_bytes(), f
        assert key.encode() not in sshd.log.read_bytes()
        for pid in (state["kernel_pid"], state["keeper_pid"]):
            assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
            assert key.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
    finally:
        ip.run_line_magic("gpu", "kernel stop c9")
    assert not kernel_dir(sshd, "c9").exists()


# -- more behaviour -----------------------------------------------------------------------


def test_push_and_pull_move_arrays_as_raw_bytes_and_say_their_size(ip, capsys):
    import numpy as np

    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", f"kernel start pp --python {PY}")
    try:
        ip.user_ns["big"] = np.arange(1_000_000, dtype=np.float64).reshape(1000, 1000)
        ip.user_ns["meta"] = {"lr": 3e-4}
        capsys.readouterr()
        ip.run_line_magic("gpu", "kernel push big meta -k pp")
        said = capsys.readouterr().out
        assert said.startswith("pushed big (ndarray, 7.6 MiB), meta (dict, ")
        ip.run_cell_magic("remote", "--kernel pp",
                          "big[0, 0] = -1.0  # writable there\nsq = big.T.copy() * 2\nprint(big.sum(), meta['lr'])")
        assert capsys.readouterr().out == f"{np.arange(1_000_000.0).sum() - 1.0} 0.0003\n"
        del ip.user_ns["big"]
        ip.run_line_magic("gpu", "kernel pull sq big -k pp")
        said = capsys.readouterr().out
        assert said.startswith("pulled sq (ndarray, 7.6 MiB), big (ndarray, 7.6 MiB) from testgpu:pp in ")
        sq = ip.user_ns["sq"]
        assert sq.shape == (1000, 1000) and sq.dtype == np.float64 and sq.flags.writeable
        assert sq[1, 0] == 2.0 and ip.user_ns["big"][0, 0] == -1.0
        # what cannot travel is named, with what to do
        ip.user_ns["fn"] = lambda x: x
        with pytest.raises(KernelError) as e:
            ip.run_line_magic("gpu", "kernel push fn -k pp")
        assert str(e.value).startswith("cannot push fn (function): it cannot be pickled")
        ip.run_cell_magic("remote", "--kernel pp", "gen = (i for i in range(3))")
        with pytest.raises(KernelError) as e:
            ip.run_line_magic("gpu", "kernel pull gen -k pp")
        assert str(e.value).startswith("cannot pull gen (generator): it cannot be pickled on the machine")
        with pytest.raises(KernelError) as e:
            ip.run_line_magic("gpu", "kernel pull nope -k pp")
        assert str(e.value).startswith("no variable 'nope' in session testgpu:pp")
    finally:
        ip.run_line_magic("gpu", "kernel stop pp")


def test_autorun_sends_code_cells_to_the_session_and_keeps_magics_local(ip, capsys):
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", f"kernel start ar --python {PY}")
    try:
        ip.run_line_magic("gpu", "kernel autorun on ar")
        ip.run_cell("import os\nwhere = os.getpid()")
        capsys.readouterr()
        ip.run_cell("%gpu kernel pull where -k ar")  # a magic cell runs here
        remote_pid = ip.user_ns["where"]
        assert remote_pid != os.getpid()
        assert capsys.readouterr().out.startswith("pulled where (int, ")
        ip.run_cell("print('remote', os.getpid() == where)")
        assert capsys.readouterr().out == "remote True\n"
        # a cell that begins with %time runs there whole, timed there
        ip.user_ns.pop("a", None), ip.user_ns.pop("b", None)  # test_magics' run leaves an `a` and a `b`
        ip.run_cell("%time a = os.getpid()\nb = os.getpid()")
        assert "Wall time" in capsys.readouterr().out
        assert "a" not in ip.user_ns and "b" not in ip.user_ns
        ip.run_cell("%gpu kernel pull a b -k ar")
        assert ip.user_ns["a"] == ip.user_ns["b"] == remote_pid
        ip.run_cell("%gpu kernel autorun off")
        ip.run_cell("local_only = 1")
        assert ip.user_ns["local_only"] == 1
    finally:
        ip.run_cell("%gpu kernel autorun off")
        ip.run_line_magic("gpu", "kernel stop ar")


def test_autorun_sends_a_cell_that_begins_with_matplotlib_inline_to_the_session(ip, capsys, shown_bundles):
    # issue 32 (12): `%matplotlib inline` at the top used to keep the whole cell here, imports
    # included, and the next cell failed there with NameError: name 'plt' is not defined
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", f"kernel start arm --python {PY}")
    ip.user_ns.pop("plt", None)
    try:
        ip.run_line_magic("gpu", "kernel autorun on arm")
        first = ip.run_cell("%config InlineBackend.figure_formats = ['svg']\n%matplotlib inline\n"
                            "import matplotlib.pyplot as plt")
        assert first.success, first.error_in_exec
        assert "plt" not in ip.user_ns  # imported there, not here
        capsys.readouterr()
        second = ip.run_cell("print(plt.get_backend())\nplt.plot([1, 2, 3])\nplt.show()")
        assert second.success, second.error_in_exec
        assert "inline" in capsys.readouterr().out
        # the session's inline backend, as %config set it there, drew the figure
        assert [sorted(b) for b in shown_bundles] == [["image/svg+xml", "text/plain"]]
    finally:
        ip.run_cell("%gpu kernel autorun off")
        ip.run_line_magic("gpu", "kernel stop arm")


@pytest.mark.parametrize("cell, there", [
    ("%matplotlib inline\nimport matplotlib.pyplot as plt", True),
    ("%matplotlib inline", True),
    ("\n  %matplotlib widget\n# the backend\n\nx = 1", True),
    ("%config InlineBackend.figure_format = 'retina'\nx = 1", True),
    ("%load_ext autoreload\n%autoreload 2\nimport mymodule", True),
    ("%aimport mymodule\nmymodule.f()", True),
    ("%pylab inline", True),
    ("x = 1\n%gpu status", True),                  # not at the top: the cell goes there whole
    ("%gpu status", False),
    ("%gpu kernel autorun off", False),
    ("%config GpuMagics.max_display_bytes = 10", False),
    ("%config Completer.use_jedi = False", False),
    ("%load_ext gpumagic", False),
    ("%matplotlib inline\n%gpu status", False),    # a magic of this notebook's among them
    ("%matplotlib inline\n!nvidia-smi", False),
    # timing magics take the cell there (they used to stay here, and IPython's %time sent its
    # own statement there through autorun but ran the cell's other lines here)
    ("%%time\nx = 1", True),
    ("%time a = f()\nb = 2", True),
    ("%%timeit -n 3\nf()", True),
    ("%timeit f()", True),
    ("%%capture out\nx = 1", False),
    ("%%remote\nls", False),
    ("!ls", False),
    ("%\nx = 1", False),
])
def test_autorun_runs_session_configuring_magics_there_and_other_magics_here(cell, there):
    from gpumagic.notebook.magics.kernel import Autorun

    lines = [ln + "\n" for ln in cell.split("\n")]
    out = Autorun("testgpu", "main")(lines)
    if there:
        assert out == [f"get_ipython().run_cell_magic('remote', '--kernel main --host testgpu', "
                       f"{''.join(lines)!r})\n"]
    else:
        assert out == lines


def test_tqdm_auto_gives_a_text_bar_that_updates_in_place(m):
    k = start(m, "tq")
    try:
        out = Recorder()
        k.execute("from tqdm.auto import tqdm\nfor _ in tqdm(range(3), desc='epochs', "
                  "mininterval=0): pass", output=out)
        err = "".join(e[2] for e in out.events if e[0] == "stream" and e[1] == "stderr")
        assert "\r" in err and "epochs: 100%" in err
        assert not [e for e in out.events if e[0] == "display"]  # no widget
    finally:
        stop_quietly(k)


def test_a_kernel_that_dies_says_how_and_restart_brings_a_fresh_one(m):
    k = start(m, "dd")
    try:
        with pytest.raises(KernelError) as e:
            k.execute("import os\nos._exit(3)", output=Recorder())
        assert "died (exit code 3)" in str(e.value) and "%gpu kernel restart dd" in str(e.value)
        assert k.info().state_text() == "dead (exit 3)"
        k.restart(output=Recorder())
        out = Recorder()
        k.execute("print('back')", output=out)
        assert out.text == "back\n"
        # it dies while no notebook follows it; a new one finds out, then restarts it
        k.execute("import os, threading\nthreading.Timer(1, os._exit, (4,)).start()", output=Recorder())
        k.close()
        time.sleep(3)
        with gpumagic.connect("testgpu") as m2:
            k2 = m2.kernel("dd", start=False)
            with pytest.raises(KernelError) as e:
                k2.execute("print('hello?')", output=Recorder())
            assert "died (exit code 4)" in str(e.value)
            news = Recorder()
            k2.restart(output=news)
            assert news.events == []  # said once already, by the execute above
            out = Recorder()
            k2.execute("print('back again')", output=out)
            assert out.text == "back again\n"
    finally:
        stop_quietly(k)


def _guard_measure(tmp_path, home: Path) -> str:
    """What the budget guard's ``measure`` says on the test machine (fake idle H200)."""
    from gpumagic.budget.guard import GuardSettings, guard_program

    script = tmp_path / "g.sh"
    script.write_text(guard_program(), encoding="utf-8")
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    smi = Path(gpumagic.__file__).parent / "gpu" / "fake" / "nvidia_smi.py"
    (bindir / "nvidia-smi").write_text(f"#!/bin/sh\nexec {PY} {smi} \"$@\"\n", encoding="utf-8")
    (bindir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "HOME": str(home), "PATH": f"{bindir}:{os.environ['PATH']}"}
    env.pop("GPUMAGIC_FAKE_GPU_STATE", None)  # default recording: h200-idle
    return subprocess.run(["sh", str(script), "measure", *GuardSettings(idle_s=60).args()], env=env, capture_output=True,
                          text=True, encoding="utf-8").stdout.strip()


def test_list_shows_busy_since_and_the_budget_guard_counts_a_busy_kernel(m, sshd, tmp_path):
    k = start(m, "ls")
    try:
        assert _guard_measure(tmp_path, remote_home(sshd)).startswith("idle GPU utilisation 0%")
        threading.Thread(target=lambda: k.execute("import time; time.sleep(4)", output=Recorder()),
                         daemon=True).start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (k.info() or gk.KernelInfo("x")).state != "busy":
            time.sleep(0.1)
        info = k.info()
        assert info.state == "busy" and info.state_text().startswith("busy since ")
        assert info.python == PY and info.kernel_pid > 0
        assert _guard_measure(tmp_path, remote_home(sshd)) == "busy gpumagic kernel ls is executing a cell"
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and k.info().state != "idle":
            time.sleep(0.1)
        assert k.info().state == "idle"
        assert _guard_measure(tmp_path, remote_home(sshd)).startswith("idle GPU utilisation 0%")
    finally:
        stop_quietly(k)


def test_the_state_reads_idle_as_soon_as_a_cell_ends_while_a_thread_still_prints(m):
    """The keeper writes ``idle`` before the cell's idle reaches the client: a listing right
    after a cell never reads a stale ``busy``, also while the kernel keeps sending (a thread
    that prints every 10 ms: the keeper's loop is never quiet, so a write put off until it
    is came a second late)."""
    k = start(m, "idlenow")
    try:
        k.execute("import threading\nstop = threading.Event()\n"
                  "def tick():\n    while not stop.wait(0.01):\n        print('.', end='', flush=True)\n"
                  "threading.Thread(target=tick, daemon=True).start()", output=Recorder())
        states = []
        for _ in range(3):
            k.execute("x = 1", output=Recorder())
            states.append(k.info().state)
        k.execute("stop.set()", output=Recorder())
        assert states == ["idle"] * 3
    finally:
        stop_quietly(k)


class CommRecorder(Recorder):
    """A Recorder that keeps the comm messages too, with when they came."""

    def comm(self, kernel, kind, content, metadata, buffers):
        self.events.append(("comm", kind, content, time.monotonic()))


def test_a_widget_a_thread_updates_between_cells_reaches_the_front_end_as_it_changes(m):
    """ipywidgets' background-progress example: the cell starts a thread and ends; the bar's
    value changes reach the front end as they are made, with no cell running (they waited
    for the next cell: the bar stayed at 0.0, then jumped to 1.0)."""
    pytest.importorskip("ipywidgets")
    k = start(m, "bgbar")
    try:
        out = CommRecorder()
        k.execute("import threading, time\nimport ipywidgets as widgets\n"
                  "bar = widgets.FloatProgress(value=0.0, min=0.0, max=1.0)\ndisplay(bar)\n"
                  "def work():\n    for i in range(1, 11):\n        time.sleep(0.2)\n        bar.value = i / 10\n"
                  "threading.Thread(target=work).start()", output=out)
        ended = time.monotonic()

        def values():
            return [e[2]["data"]["state"]["value"] for e in out.events if e[0] == "comm" and e[1] == "comm_msg"
                    and "value" in (e[2].get("data", {}).get("state") or {})]

        assert wait_until(lambda: values()[-1:] == [1.0], 30), values()
        assert values() == [i / 10 for i in range(1, 11)]
        came = [e[3] for e in out.events if e[0] == "comm" and e[1] == "comm_msg"]
        assert came[0] > ended and k.comms_between_cells >= 10  # each as it was made, no cell running
        assert k.execute("print(bar.value)", output=Recorder()).ok
    finally:
        stop_quietly(k)


def test_parse_listing_sums_gpu_memory_of_the_kernels_process_group():
    text = ("\x1ekernel a\n" + json.dumps({"name": "a", "python": "/usr/bin/python3", "state": "busy",
                                           "since": 100.0, "kernel_pid": 485, "keeper_pid": 480}) + "\nalive\n"
            "\x1ekernel b\n" + json.dumps({"name": "b", "state": "idle", "kernel_pid": 900}) + "\ngone\n"
            "\x1egpu-status\n0\n\x1egpu\n485, 20204\n486, 100\n12, 5\n\x1eps\n  485   485\n  486   485\n   12    12\n")
    a, b = gk.parse_listing(text)
    assert (a.name, a.state, a.gpu_mib, a.python) == ("a", "busy", 20304, "/usr/bin/python3")
    assert a.state_text(now=165.0).startswith("busy since ") and a.state_text(now=165.0).endswith("(1m 05s)")
    assert (b.name, b.state, b.gpu_mib) == ("b", "lost", None)
    no_smi = gk.parse_listing(text.replace("\x1egpu-status\n0", "\x1egpu-status\n127"))
    assert no_smi[0].gpu_mib is None


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_the_listing_script_passes_shellcheck():
    path = ROOT / "gpumagic" / "remote" / "programs" / "kernel_list.sh"
    r = subprocess.run(["shellcheck", "-s", "sh", str(path)], capture_output=True, text=True, encoding="utf-8")
    assert r.returncode == 0, r.stdout


@pytest.mark.parametrize("program", ["kernel_keeper.py", "kernel_launch.py", "kernel_startup.py", "kernel_wire.py"])
def test_the_programs_run_on_the_machine_are_python_3_8(program):
    """Rented machines often have an older python than the laptop (pickle protocol 5: 3.8)."""
    import ast
    import tarfile

    _, tar = gk.link._programs_tar()
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        text = t.extractfile(program).read()
    ast.parse(text.decode(), feature_version=(3, 8))


def test_the_machine_side_gets_the_laptops_own_wire_module_and_copies_none_of_it():
    """Issue 25: one wire format.  The tar carries the very file the laptop imports, and
    neither program defines a frame or pickle codec of its own."""
    import ast
    import tarfile

    from gpumagic.remote.kernel import wire as kernel_wire

    _, tar = gk.link._programs_tar()
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        assert sorted(t.getnames()) == ["kernel_keeper.py", "kernel_launch.py", "kernel_startup.py", "kernel_wire.py"]
        assert t.extractfile("kernel_wire.py").read() == Path(kernel_wire.__file__).read_bytes()
    wire_names = {n.name for n in ast.parse(Path(kernel_wire.__file__).read_text(encoding="utf-8")).body
                  if isinstance(n, ast.FunctionDef)}
    for program in ("kernel_keeper.py", "kernel_launch.py", "kernel_startup.py"):
        tree = ast.parse(gk.program_text(program).decode())
        defined = {n.name.lstrip("_") for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert not defined & (wire_names | {"encode", "decode", "pickle", "unframe"}), program


def test_take_frames_takes_whole_frames_and_leaves_a_partial_one():
    from gpumagic.remote.kernel import wire

    a, b = wire.frame([b"{}", b"x" * 5]), wire.frame([wire.dumps({"seq": 2}), b""])
    buf = bytearray(a + b + b[:7])
    assert wire.take_frames(buf) == [([b"{}", b"xxxxx"], len(a) - 4), ([b'{"seq":2}', b""], len(b) - 4)]
    assert bytes(buf) == b[:7]
    assert wire.take_frames(buf) == [] and bytes(buf) == b[:7]
    buf += b[7:]
    assert wire.take_frames(buf) == [([b'{"seq":2}', b""], len(b) - 4)] and buf == bytearray()


def test_pickled_values_keep_their_buffers_out_of_band():
    from gpumagic.remote.kernel import wire

    big = bytearray(range(256)) * 4
    main, buffers = wire.pickle_value(pickle.PickleBuffer(big))
    assert len(buffers) == 1 and buffers[0].nbytes == 1024 and len(main) < 100
    data = bytearray(b"".join(bytes(p) for p in wire.encode_values([("v", main, buffers), ("n", *wire.pickle_value(7))])))
    got = wire.decode_values(data)
    assert bytes(got["v"]) == bytes(big) and got["n"] == 7


def test_bad_names_and_arguments_are_usage_errors(ip):
    from IPython.core.error import UsageError

    ip.run_line_magic("gpu", "connect testgpu")
    with pytest.raises(UsageError) as e:
        ip.run_line_magic("gpu", "kernel frobnicate")
    assert "valid: start, list" in str(e.value)
    with pytest.raises(UsageError) as e:
        ip.run_cell_magic("remote", "--kernel ../x", "1")
    assert "cannot name a session" in str(e.value)
    with pytest.raises(UsageError) as e:
        ip.run_cell_magic("remote", "--kernel k --job j", "1")
    assert "--kernel does not combine with --job" in str(e.value)
    with pytest.raises(UsageError):
        ip.run_line_magic("gpu", "kernel push not_defined_here")


# -- the tutorial -------------------------------------------------------------------------


def test_tutorial_07_trains_plots_pulls_and_finds_the_model_after_reconnecting(tmp_path, monkeypatch):
    from gpumagic.__main__ import run_notebook
    from gpumagic.ssh.sandbox import sandbox_home

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    kernels = sandbox_home() / ".gpumagic" / "kernels"
    try:
        out = run_notebook(ROOT / "example-notebooks" / "07-remote-python-session.ipynb", tmp_path, timeout=180)
    finally:
        for state in kernels.glob("*/state.json"):  # a failed run must not leave the session
            try:
                os.kill(json.loads(state.read_text(encoding="utf-8"))["keeper_pid"], signal.SIGTERM)
            except (OSError, ValueError, KeyError):
                pass
    cells = [c for c in nbformat.read(out, as_version=4).cells if c.cell_type == "code"]
    assert not [o for c in cells for o in c.outputs if o.output_type == "error"]

    def cell(start):
        return next(c for c in cells if c.source.startswith(start))

    def text(c, name="stdout"):
        return "".join(o.text for o in c.outputs if o.output_type == "stream" and o.name == name)

    assert "started session main on sandbox" in text(cell("%gpu kernel start"))
    loaded = cell("%%remote --kernel\nimport numpy as np")
    assert text(loaded) == "2000 rows loaded\n"
    assert any("<table" in o.get("data", {}).get("text/html", "") for o in loaded.outputs)
    trained = cell("%%remote --kernel\nfrom tqdm.auto")
    assert text(trained).startswith("loss 5.439 -> 0.01")
    assert "training: 100%" in text(trained, "stderr")
    plot = cell("%%remote --kernel\nimport matplotlib")
    assert [o.output_type for o in plot.outputs] == ["display_data"] and "image/png" in plot.outputs[0].data
    assert text(cell("%gpu kernel pull")).startswith("pulled losses (list, ")
    assert text(cell("import numpy as np")) == "final loss 0.0105, weights [ 2.  -1.   0.5]\n"
    assert text(cell("lr = 0.1")).startswith("pushed lr (float, ")
    assert text(cell("%%remote --kernel\nprint(\"still here")) == "still here: [ 2.  -1.   0.5] after 300 epochs\n"
    listed = "".join(o.get("data", {}).get("text/plain", "") for o in cell("%gpu connect --sandbox").outputs)
    assert "main *" in listed and " idle " in listed
    assert text(cell("import os")).startswith("running in process ")
    assert text(cell("%gpu kernel stop main")).startswith("stopped session main on sandbox")
    assert not (kernels / "main").exists()
