"""Every tutorial run in a real browser: JupyterLab on 127.0.0.1, headless Chromium driven by
Playwright, Run All from the Run menu (issue 17, "A real-browser test").

For each tutorial: no "Error displaying widget", every widget output visible, no traceback
except in cells tagged ``raises-exception``; a screenshot lands in ``build/browser/``. Then the
saved, executed notebooks are reopened in a JupyterLab that has no kernel ("No Kernel"), as a
classmate without the environment would, and every saved output must render from the file.

The machine's session as a kernel in the list (issue 47): its kernelspec's card is in the launcher,
a notebook using it runs its cells on the machine, a slider made there is dragged and its value
reaches the machine, and the toolbar's interrupt stops a busy loop there.

Widgets made on the machine (issue 32, the comm bridge): a remote ``IntSlider`` renders in the
page, dragging it with the mouse to 7 makes the machine's value 7, a ``tqdm.notebook`` bar there
reaches 100 %, and the notebook saved with its widget state reopens showing both.

Slow (minutes), so it runs only with ``GPUMAGIC_TEST_BROWSER=1`` (``.ci/run`` sets it; as root
``scripts/_setup.sh`` then installs Debian's chromium). Playwright's own browser download is not
used: Debian's ``/usr/bin/chromium`` is.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "example-notebooks"
SHOTS = ROOT / "build" / "browser"
CHROMIUM = Path(os.environ.get("GPUMAGIC_CHROMIUM", "/usr/bin/chromium"))
WIDGET = "application/vnd.jupyter.widget-view+json"
ENABLE = "GPUMAGIC_TEST_BROWSER"

#: One pytest-xdist worker runs this module: one JupyterLab and one Chromium for every test, and
#: the reopen tests read what the Run All tests recorded (``_ran``).
pytestmark = pytest.mark.xdist_group("browser")

if os.environ.get(ENABLE) != "1":
    pytest.skip(f"the real-browser test takes minutes: run it with {ENABLE}=1 (.ci/run sets it)",
                allow_module_level=True)
if not CHROMIUM.exists():
    pytest.skip(f"Debian's chromium is not installed ({CHROMIUM}): sudo apt-get install chromium",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install playwright")
pytest.importorskip("jupyterlab", reason="jupyterlab is not installed: pip install jupyterlab")

from test_notebook_outputs import _remove_tutorial_jobs  # noqa: E402  (the same clean-up as nbclient's run)

ENGLISH = sorted(NOTEBOOKS.glob("*.ipynb"))
CHINESE = sorted((NOTEBOOKS / "zh-CN").glob("*.ipynb"))
TUTORIALS = [str(p.relative_to(NOTEBOOKS)) for p in ENGLISH + CHINESE]
#: Opened again with no kernel after JupyterLab saved them: the case-1 outputs (status, sync
#: bar, job table, budget meter).
REOPEN = ["02-check-the-machine.ipynb", "03-sync-code-and-results.ipynb", "04-long-training-jobs.ipynb",
          "06-budget.ipynb", "zh-CN/06-budget.ipynb"]
#: Run with Run All in JupyterLab: the tutorials whose cells show live widgets while they run (a
#: status watch, sync bars, a job's log, the budget meter, a session's tqdm bar), and those
#: reopened above.  Every tutorial, these too, is also opened as nbclient executed it
#: (``test_executed_tutorial_renders_with_no_kernel``): its outputs as saved, with no kernel.
LIVE = ["02-check-the-machine.ipynb", "03-sync-code-and-results.ipynb", "04-long-training-jobs.ipynb",
        "06-budget.ipynb", "07-remote-python-session.ipynb", "zh-CN/06-budget.ipynb"]

#: Chromium as root needs --no-sandbox; the rest keeps it off this machine's closed network.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
#: JupyterLab user settings: every cell in the DOM (windowing off), no news or update pop-up.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                         "checkForUpdates": False},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """A JupyterLab server on 127.0.0.1 with token auth, serving ``root``."""

    def __init__(self, root: Path, state: Path, *extra: str, settings_more: dict | None = None):
        self.root, self.port, self.token = root, _free_port(), secrets.token_hex(16)
        settings = state / "lab-settings"
        for name, value in {**LAB_SETTINGS, **(settings_more or {})}.items():
            (settings / name).parent.mkdir(parents=True, exist_ok=True)
            (settings / name).write_text(json.dumps(value), encoding="utf-8")
        env = dict(os.environ,  # HOME is the suite's temp HOME (conftest): the sandbox lives there
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                   JUPYTER_CONFIG_DIR=str(state / "config"), JUPYTER_RUNTIME_DIR=str(state / "runtime"),
                   JUPYTERLAB_SETTINGS_DIR=str(settings), JUPYTERLAB_WORKSPACES_DIR=str(state / "workspaces"))
        self.log = state / "server.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
             f"--port={self.port}", f"--IdentityProvider.token={self.token}",
             f"--ServerApp.root_dir={root}", *extra],
            env=env, stdout=open(self.log, "w", encoding="utf-8"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                self.api("status")
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not start:\n{self.log.read_text(encoding='utf-8')[-3000:]}")
                time.sleep(0.5)

    def url(self, path: str) -> str:
        # reset: a fresh workspace, so the notebooks opened before are not opened again
        return f"http://127.0.0.1:{self.port}/lab/tree/{path}?reset&token={self.token}"

    def api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/api/{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
        return json.loads(body) if body else None

    def shut_down_kernels(self) -> None:
        for s in self.api("sessions"):
            self.api(f"sessions/{s['id']}", "DELETE")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tutorials copied into a temp root (results land there, not in the checkout)."""
    root = tmp_path_factory.mktemp("lab-root")
    for name in TUTORIALS:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(NOTEBOOKS / name, root / name)
    return root


@pytest.fixture(scope="module")
def lab(served, tmp_path_factory):
    server = Lab(served, tmp_path_factory.mktemp("lab-state"))
    try:
        yield server
    finally:
        server.stop()
        _remove_tutorial_jobs()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()


# -- what the page shows --------------------------------------------------------------------

#: The notebook on show (JupyterLab hides the others' panels).
PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"


#: One look at the page while Run All goes on: every widget output is given an id and its
#: record kept in window.__gm (polls seen, ever visible: a box with a size and some text);
#: returns whether every cell ran, whether "Error displaying widget" is shown, and the records.
#: Records every widget view that appears in the notebook while Run All goes on: each DOM
#: change is looked at as it happens (a MutationObserver), not at the next poll, so a sync bar
#: that lives 50 ms is seen as surely as one that lives a minute.  Installed once a page.
OBSERVE = """() => {
  const PANEL = '%s';
  const gm = window.__gm = window.__gm || {next: 0, seen: {}, error: false};
  if (gm.observer) return;
  gm.scan = () => {
    const views = [...document.querySelectorAll(`${PANEL} .jp-OutputArea-output`)]
      .filter(e => e.querySelector('.jupyter-widgets'));  // a widget view (no data-mime-type there)
    for (const e of views) {
      if (!e.dataset.gmId) e.dataset.gmId = String(gm.next++);
      const s = gm.seen[e.dataset.gmId] = gm.seen[e.dataset.gmId] || {polls: 0, visible: false, text: ''};
      const r = e.getBoundingClientRect();
      s.polls++;
      if (r.width > 0 && r.height > 0 && e.innerText.trim() !== '') {
        s.visible = true;
        s.text = e.innerText.slice(0, 200);
      }
    }
  };
  gm.observer = new MutationObserver(() => { gm.scan(); requestAnimationFrame(gm.scan); });
  gm.observer.observe(document.body, {childList: true, subtree: true, characterData: true});
}""" % PANEL

#: What the page shows now: whether every code cell has run, a widget error, and every widget
#: view recorded so far (OBSERVE).
LOOK = """() => {
  const PANEL = '%s';
  const gm = window.__gm;
  gm.scan();
  gm.error = gm.error || document.body.innerText.includes('Error displaying widget');
  const p = [...document.querySelectorAll(`${PANEL} .jp-CodeCell .jp-InputPrompt`)].map(e => e.textContent.trim());
  return {done: p.length > 0 && p.every(t => /^\\[\\d+\\]:$/.test(t)), error: gm.error,
          seen: Object.values(gm.seen)};
}""" % PANEL


def _run_all_and_watch(page, timeout: float) -> dict:
    """Poll the page (every 0.3 s) until every code cell has run; returns the last look."""
    deadline = time.monotonic() + timeout
    while True:
        look = page.evaluate(LOOK)
        if look["done"]:
            return look
        if time.monotonic() > deadline:
            raise AssertionError(f"Run All did not finish within {timeout:.0f} s")
        page.wait_for_timeout(300)


#: Per code cell, in order: its input prompt, its stderr texts, and its widget outputs
#: (visible: a box with a size; text: what it shows).
CELLS = """() => { const PANEL = '%s'; return [...document.querySelectorAll(`${PANEL} .jp-CodeCell`)].map(c => ({
  prompt: c.querySelector('.jp-InputPrompt').textContent.trim(),
  outputs: c.querySelectorAll('.jp-OutputArea-output').length,
  html: c.querySelectorAll('.jp-OutputArea-output.jp-RenderedHTML').length,
  stderr: [...c.querySelectorAll('.jp-RenderedText[data-mime-type="application/vnd.jupyter.stderr"]')]
    .map(e => e.innerText),
  widgets: [...c.querySelectorAll('.jp-OutputArea-output')].filter(e => e.querySelector('.jupyter-widgets'))
    .map(e => {
    const r = e.getBoundingClientRect();
    return {visible: r.width > 0 && r.height > 0 && getComputedStyle(e).visibility !== 'hidden',
            text: e.innerText};
  }),
  empty: [...c.querySelectorAll('.jp-OutputArea-output')].filter(e => {
    const r = e.getBoundingClientRect();
    return !(r.width > 0 && r.height > 0);
  }).length,
}))}""" % PANEL


def _code_cells(path: Path):
    return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


def _open(page, lab: Lab, name: str) -> None:
    page.goto(lab.url(name))
    page.wait_for_selector(".jp-NotebookPanel .jp-CodeCell .jp-InputPrompt", timeout=120_000)


def _screenshot(page, name: str) -> Path:
    """The whole notebook: the viewport is made as tall as its scrolled content (at most 30000 px)."""
    height = page.evaluate("p => document.querySelector(`${p} .jp-WindowedPanel-outer`).scrollHeight", PANEL)
    page.set_viewport_size({"width": 1280, "height": min(int(height) + 200, 30_000)})
    page.evaluate("p => { document.querySelector(`${p} .jp-WindowedPanel-outer`).scrollTop = 0; }", PANEL)
    page.wait_for_timeout(500)
    out = SHOTS / (name.replace("/", "-").removesuffix(".ipynb") + ".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(out))
    page.set_viewport_size({"width": 1280, "height": 900})
    return out


def _saved(path: Path, timeout: float = 60) -> list:
    """The code cells of ``path`` once the file shows every one executed (Ctrl+S landed)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            cells = _code_cells(path)
            if all(c.execution_count for c in cells):
                return cells
        except Exception:  # caught mid-write
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} was not saved with every cell executed")
        time.sleep(0.5)


def _problems(name: str, cells: list, shown: list) -> list[str]:
    """What is wrong on the page ``shown`` for the notebook whose code cells are ``cells``."""
    bad = []
    assert len(shown) == len(cells), (name, len(shown), len(cells))
    for i, (cell, dom) in enumerate(zip(cells, shown)):
        where = f"{name} code cell {i + 1} ({cell.source.splitlines()[0] if cell.source else ''!r})"
        allowed = "raises-exception" in cell.metadata.get("tags", [])
        if not allowed and any("Traceback" in t for t in dom["stderr"]):
            bad.append(f"{where}: a traceback: {dom['stderr']}")
        if not allowed and any(o.output_type == "error" for o in cell.outputs):
            bad.append(f"{where}: an error output: {[o.ename for o in cell.outputs if o.output_type == 'error']}")
        for w in dom["widgets"]:
            if not w["visible"] or not w["text"].strip():
                bad.append(f"{where}: a widget output not visible ({w})")
    return bad


# -- the tests ------------------------------------------------------------------------------

_ran: dict[str, float] = {}  # the tutorials run below and their seconds, for the reopen test
_widgets: dict[str, int] = {}  # widget outputs on each one's page once it finished


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", LIVE)
@pytest.mark.slow(300, reason="a whole tutorial run with Run All in JupyterLab in Chromium")
def test_tutorial_runs_in_jupyterlab_with_run_all(lab, browser, name):
    if name.endswith("08-several-gpus.ipynb"):
        pytest.importorskip("torch", reason="tutorial 08 runs torchrun: .venv/bin/pip install torch==2.13.0")
    started = time.monotonic()
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        _open(page, lab, name)
        page.get_by_text("| Idle").wait_for(timeout=120_000)  # the status bar: the kernel is ready
        page.evaluate(OBSERVE)
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").click()
        page.locator(".lm-Menu-itemLabel").get_by_text("Run All Cells", exact=True).click()
        live = _run_all_and_watch(page, 780)
        page.get_by_text("| Idle").wait_for(timeout=120_000)
        live = page.evaluate(LOOK)
        page.keyboard.press("Control+s")
        cells = _saved(lab.root / name)
        shown = page.evaluate(CELLS)
        body = page.evaluate("() => document.body.innerText")
        _screenshot(page, name)
    finally:
        page.close()
        lab.shut_down_kernels()  # the sandbox stops with its kernel
    assert "Error displaying widget" not in body and not live["error"]
    # a live widget may be replaced by its static state between two looks; one seen three
    # times or more must have been visible
    assert [w for w in live["seen"] if w["polls"] >= 3 and not w["visible"]] == []
    assert _problems(name, cells, shown) == []
    assert all(d["empty"] == 0 for d in shown), [d for d in shown if d["empty"]]
    _ran[name] = time.monotonic() - started
    _widgets[name] = sum(w["visible"] for w in live["seen"])
    print(f"{name}: ran in {_ran[name]:.0f} s, {_widgets[name]} live widget outputs seen visible")


@pytest.fixture(scope="module")
def kernelless(served, lab, tmp_path_factory):
    """A second JupyterLab on the same files with no kernel at all (an empty kernelspec list)."""
    server = Lab(served, tmp_path_factory.mktemp("lab-nokernel"), "--KernelSpecManager.allowed_kernelspecs=none")
    assert server.api("kernelspecs")["kernelspecs"] == {}
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", REOPEN)
def test_saved_notebook_renders_with_no_kernel(kernelless, browser, name):
    if name not in _ran:
        pytest.skip(f"{name} was not run in the browser in this session")
    _renders_with_no_kernel(kernelless, browser, name, "reopened-" + name)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", TUTORIALS)
def test_executed_tutorial_renders_with_no_kernel(kernelless, browser, executed, name):
    # the copy nbclient executed (tests/tutorials.py, shared with the other tests), as a
    # classmate opens it from GitHub or a shared folder: every output shows from the file
    if name not in executed:
        pytest.skip("tutorial 08 runs torchrun: .venv/bin/pip install torch==2.13.0")
    rel = f"executed/{name}"
    (kernelless.root / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(executed.path(name), kernelless.root / rel)
    _renders_with_no_kernel(kernelless, browser, rel, "executed-" + name)


def _shown_outputs(outputs: list) -> int:
    """How many outputs JupyterLab shows for a cell's saved ``outputs``: its output area joins
    consecutive stream outputs of one name (stdout after stdout) into one, as a live kernel's
    are joined while they arrive (nbclient saves them as they came; run-notebook joins them)."""
    shown, last = 0, None
    for o in outputs:
        stream = o.get("name") if o.get("output_type") == "stream" else None
        if stream is None or stream != last:
            shown += 1
        last = stream
    return shown


def _renders_with_no_kernel(kernelless: Lab, browser, name: str, shot: str) -> None:
    cells = _code_cells(kernelless.root / name)
    saved_outputs = [_shown_outputs(c.outputs) for c in cells]
    assert sum(saved_outputs) > 0
    assert saved_outputs == [len(c.outputs) for c in cells]  # saved as JupyterLab holds them
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        _open(page, kernelless, name)
        dialog = page.get_by_role("dialog")  # "Select Kernel": the file's python3 is not here
        dialog.get_by_text("Select Kernel").first.wait_for(timeout=60_000)
        dialog.locator("button.jp-Dialog-button", has_text="No Kernel").click()
        dialog.wait_for(state="detached", timeout=60_000)
        page.wait_for_function("([p, n]) => document.querySelectorAll(`${p} .jp-OutputArea-output`).length >= n",
                               arg=[PANEL, sum(saved_outputs)], timeout=60_000)
        shown = page.evaluate(CELLS)
        body = page.evaluate("() => document.body.innerText")
        _screenshot(page, shot)
    finally:
        page.close()
    assert kernelless.api("sessions") == []  # nothing was executed: the outputs are the file's
    assert "Error displaying widget" not in body
    assert [d["outputs"] for d in shown] == saved_outputs
    # every saved HTML form is what shows (a status table, a sync bar, the meter, the job
    # table), not the widget renderer's text/plain stand-in
    assert [d["html"] for d in shown] == [sum("text/html" in o.get("data", {}) for o in c.outputs) for c in cells]
    assert all(d["empty"] == 0 for d in shown), [d for d in shown if d["empty"]]
    assert _problems(name, cells, shown) == []
    for cell, dom in zip(cells, shown):  # what the file saved as a widget has static HTML with it
        for o in cell.outputs:
            if WIDGET in o.get("data", {}):
                assert "text/html" in o.data and "text/plain" in o.data, (name, cell.source)


def test_live_widgets_were_seen_and_checked():
    # The widget checks above must have had something to check: the tutorials' live widgets
    # (tutorial 03's sync bars, for one) were on the page, visible, while Run All went on.
    if not _ran:
        pytest.skip("no tutorial was run in the browser in this session")
    assert sum(_widgets.values()) > 0, _widgets


# -- widgets made on the machine (issue 32: the comm bridge) --------------------------------

#: The session's name on the machine, and the notebook that makes its widgets.
SESSION = "brw"
WIDGETS_NB = "remote-widgets.ipynb"
#: ipywidgets' own setting: the widget state goes into the notebook's metadata on save.
SAVE_WIDGET_STATE = {"@jupyter-widgets/jupyterlab-manager/plugin.jupyterlab-settings": {"saveState": True}}


@pytest.fixture(scope="module")
def widget_root(tmp_path_factory):
    """A root of its own: the tutorials' lab does not save widget state, this one does."""
    root = tmp_path_factory.mktemp("lab-widgets")
    nb = nbformat.v4.new_notebook(metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    nb.cells = [nbformat.v4.new_code_cell(s) for s in [
        f"%load_ext gpumagic\n%gpu connect testgpu\n%gpu kernel start {SESSION} --python {sys.executable}",
        f"%%remote --kernel {SESSION}\nimport ipywidgets\ns = ipywidgets.IntSlider(3)\ns",
        f"%%remote --kernel {SESSION}\nfrom tqdm.notebook import tqdm\nfor i in tqdm(range(5)):\n    pass",
        f"%%remote --kernel {SESSION}\nprint(s.value)",
        f"%gpu kernel stop {SESSION}",
    ]]
    nbformat.write(nb, root / WIDGETS_NB)
    return root


@pytest.fixture(scope="module")
def widget_lab(widget_root, sshd, tmp_path_factory):
    server = Lab(widget_root, tmp_path_factory.mktemp("lab-widgets-state"), settings_more=SAVE_WIDGET_STATE)
    try:
        yield server
    finally:
        server.stop()


def _cell(page, i: int):
    return page.locator(f"{PANEL} .jp-CodeCell").nth(i)


def _run_cell(page, i: int, timeout: float = 120) -> None:
    """Click into code cell ``i`` and press Shift+Enter; returns once its prompt is ``[n]:``."""
    cell = _cell(page, i)
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")
    page.wait_for_function(
        "([p, i]) => /^\\[\\d+\\]:$/.test(document.querySelectorAll(`${p} .jp-CodeCell`)[i]"
        ".querySelector('.jp-InputPrompt').textContent.trim())", arg=[PANEL, i], timeout=timeout * 1000)


def _drag_slider_to(page, slider, value: int) -> list[str]:
    """Drag the slider's handle with the mouse to where ``value`` lies on its 0..100 track, then
    (a pixel may round to the next step) press the arrow keys on the focused handle until its
    readout says ``value``. Returns the readouts seen, for the failure message."""
    handle, readout = slider.locator(".noUi-handle"), slider.locator(".widget-readout")
    base = slider.locator(".noUi-base").bounding_box()
    box = handle.bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.down()
    target = base["x"] + base["width"] * value / 100
    page.mouse.move(target, box["y"] + box["height"] / 2, steps=10)
    page.mouse.up()
    seen = [readout.inner_text().strip()]
    for _ in range(10):
        now = int(seen[-1])
        if now == value:
            break
        handle.press("ArrowRight" if now < value else "ArrowLeft")
        seen.append(readout.inner_text().strip())
    _wait_kernel_quiet(page)
    return seen


def _wait_kernel_quiet(page, quiet_ms: int = 1000, timeout: float = 60) -> None:
    """Wait until the status bar has said Idle for ``quiet_ms`` on end.  ipywidgets sends one
    update at a time and keeps the newest value until the kernel is idle after the last one
    (its ``msg_throttle``): a readout shows 7 at once, while the 7 itself leaves the page only
    when the 6 before it was answered.  A cell run before then can overtake it, with a local
    kernel too; a person looking at the slider waits that long without noticing."""
    page.evaluate("() => { delete window.__gmIdleSince; }")
    page.wait_for_function(
        """(quiet) => {
            const idle = document.body.innerText.includes('| Idle');
            const now = performance.now();
            if (!idle) { delete window.__gmIdleSince; return false; }
            if (window.__gmIdleSince === undefined) window.__gmIdleSince = now;
            return now - window.__gmIdleSince >= quiet;
        }""", arg=quiet_ms, polling=100, timeout=timeout * 1000)


def _stop_session(sshd) -> None:
    """The keeper of SESSION on the machine, stopped as the tests' clean-up does, if it lives."""
    from test_kernel import kernel_dir

    state = kernel_dir(sshd, SESSION) / "state.json"
    try:
        os.kill(json.loads(state.read_text(encoding="utf-8"))["keeper_pid"], 15)
    except (OSError, ValueError, KeyError):
        return
    deadline = time.monotonic() + 20
    while state.exists() and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.mark.timeout(600)
def test_a_slider_made_on_the_machine_is_dragged_in_the_browser_and_saved_with_the_notebook(
        widget_lab, browser, sshd):
    # issue 32: a remote IntSlider renders, dragging it to 7 changes the machine's value to 7,
    # a tqdm.notebook bar reaches 100 %, and the saved notebook reopens with the widget state.
    path = widget_lab.root / WIDGETS_NB
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    stopped = False
    try:
        _open(page, widget_lab, WIDGETS_NB)
        page.get_by_text("| Idle").wait_for(timeout=120_000)
        for i in range(3):  # the session, the slider, the bar
            _run_cell(page, i)
        slider = _cell(page, 1).locator(".jp-OutputArea-output .widget-slider")
        slider.locator(".noUi-handle").wait_for(timeout=60_000)
        assert slider.locator(".widget-readout").inner_text().strip() == "3"
        bar = _cell(page, 2).locator(".jp-OutputArea-output .widget-hprogress")
        page.wait_for_function("e => e.innerText.includes('100%') && e.innerText.includes('5/5')",
                               arg=_cell(page, 2).element_handle(), timeout=60_000)
        assert bar.count() == 1
        bar_text = _cell(page, 2).locator(".jp-OutputArea-output").inner_text()
        readouts = _drag_slider_to(page, slider, 7)
        assert readouts[-1] == "7", readouts
        _run_cell(page, 3)  # print(s.value) on the machine
        printed = _cell(page, 3).locator(".jp-OutputArea-output").inner_text().strip()
        body = page.evaluate("() => document.body.innerText")
        _screenshot(page, WIDGETS_NB)
        page.keyboard.press("Control+s")  # the session still holds its widgets: saved with them
        deadline = time.monotonic() + 60
        while True:
            try:
                saved = nbformat.read(path, as_version=4)
                if "widgets" in saved.metadata:
                    break
            except Exception:  # caught mid-write
                pass
            assert time.monotonic() < deadline, f"{WIDGETS_NB} was not saved with its widget state"
            time.sleep(0.5)
        _run_cell(page, 4)  # %gpu kernel stop
        stopped = "Traceback" not in _cell(page, 4).inner_text()
    finally:
        page.close()
        widget_lab.shut_down_kernels()
        if not stopped:
            _stop_session(sshd)
    assert "Error displaying widget" not in body
    assert printed == "7", (printed, readouts)
    assert "100%" in bar_text and "5/5" in bar_text, bar_text
    state = saved.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    sliders = [m["state"] for m in state.values() if m["model_name"] == "IntSliderModel"]
    bars = [m["state"] for m in state.values() if m["model_name"] == "FloatProgressModel"]
    assert [s["value"] for s in sliders] == [7], sliders
    assert [(b["value"], b["max"]) for b in bars] == [(5, 5)], bars
    views = [o.data[WIDGET]["model_id"] for o in saved.cells[1].outputs if WIDGET in o.get("data", {})]
    assert len(views) == 1 and views[0] in state and state[views[0]]["model_name"] == "IntSliderModel"

    # reopened (a fresh page and a fresh local kernel; no session, nothing run): the slider
    # shows 7 and the bar 100 % from the file's widget state, disconnected from any kernel.
    # Not in the kernel-less lab the tutorials are reopened in: jupyterlab_widgets 3.0 makes
    # no widget manager for a notebook with "No Kernel" (it reads the session's kernel id), so
    # every widget output there stays "Loading widget..." whatever the file holds.
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        _open(page, widget_lab, WIDGETS_NB)
        page.get_by_text("| Idle").wait_for(timeout=120_000)
        slider = _cell(page, 1).locator(".jp-OutputArea-output .widget-slider")
        slider.locator(".noUi-handle").wait_for(timeout=60_000)
        reopened = slider.locator(".widget-readout").inner_text().strip()
        reopened_classes = slider.get_attribute("class")
        _cell(page, 2).locator(".jp-OutputArea-output .widget-hprogress").wait_for(timeout=60_000)
        reopened_bar = _cell(page, 2).locator(".jp-OutputArea-output").inner_text()
        reopened_prompts = [_cell(page, i).locator(".jp-InputPrompt").inner_text().strip() for i in range(5)]
        reopened_body = page.evaluate("() => document.body.innerText")
        _screenshot(page, "reopened-" + WIDGETS_NB)
    finally:
        page.close()
        widget_lab.shut_down_kernels()
    assert "Error displaying widget" not in reopened_body
    assert reopened_prompts == ["[1]:", "[2]:", "[3]:", "[4]:", "[ ]:"]  # as saved: nothing ran
    assert reopened == "7"
    assert "jupyter-widgets-disconnected" in reopened_classes  # the file's state, not a live comm
    assert "100%" in reopened_bar and "5/5" in reopened_bar, reopened_bar
    print(f"slider readouts as it was dragged (then arrow keys): {readouts}; session stopped: {stopped}")


# -- the machine's session as a kernel picked from the list (issue 47) -----------------------

BRIDGE_SESSION = "browserkb"
BRIDGE_NB = "bridge.ipynb"
BRIDGE_DISPLAY = f"Python 3 on testgpu:{BRIDGE_SESSION} (gpumagic)"
NO_AUTOSAVE = {"@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False}}


@pytest.fixture(scope="module")
def bridge_lab(sshd, tmp_path_factory):
    """A JupyterLab whose kernel list holds the kernelspec of the test machine's session
    ``browserkb`` (in a Jupyter data dir of its own), serving a notebook that uses it."""
    from gpumagic.__main__ import main as gpumagic_main

    root, data = tmp_path_factory.mktemp("lab-bridge"), tmp_path_factory.mktemp("lab-bridge-data")
    saved = {k: os.environ.get(k) for k in ("JUPYTER_DATA_DIR", "JUPYTER_PATH")}
    os.environ["JUPYTER_DATA_DIR"] = os.environ["JUPYTER_PATH"] = str(data)
    try:
        assert gpumagic_main(["kernel", "install", "testgpu", "--name", BRIDGE_SESSION, "--python", sys.executable]) == 0
        nb = nbformat.v4.new_notebook(metadata={"kernelspec": {
            "name": f"gpumagic-testgpu-{BRIDGE_SESSION}", "display_name": BRIDGE_DISPLAY, "language": "python"}})
        nb.cells = [nbformat.v4.new_code_cell(s) for s in [
            "import os\nprint('HOME', os.environ['HOME'])",
            "import time\nfor i in range(6):\n    print(f'line {i}', flush=True)\n    time.sleep(0.3)",
            "import ipywidgets\ns = ipywidgets.IntSlider(3)\ns",
            "print(s.value)",
            "n = 0\nprint('looping', flush=True)\nwhile True:\n    n += 1",
            "print('kept', n > 0, s.value)",
            "import time\nfor i in range(20):\n    print(f'tick {i}', flush=True)\n    time.sleep(1)",
            "%gpu kernel attach",
        ]]
        nbformat.write(nb, root / BRIDGE_NB)
        # no autosave: what the reloaded page shows of the old cell is what the file held before
        # it ran (a save while it ran would show its lines up to then there, from the file)
        server = Lab(root, tmp_path_factory.mktemp("lab-bridge-state"), settings_more=NO_AUTOSAVE)
        try:
            yield server
        finally:
            server.stop()
            gpumagic_main(["kernel", "stop", "testgpu", "--name", BRIDGE_SESSION])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.timeout(600)
def test_the_sessions_kernel_is_in_the_launcher_and_its_cells_run_on_the_machine(bridge_lab, browser, sshd):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(f"http://127.0.0.1:{bridge_lab.port}/lab?reset&token={bridge_lab.token}")
        page.locator(".jp-LauncherCard", has_text=BRIDGE_DISPLAY).first.wait_for(timeout=120_000)
        _open(page, bridge_lab, BRIDGE_NB)
        page.get_by_text("| Idle").wait_for(timeout=120_000)
        for i in range(2):
            _run_cell(page, i)
        home = _cell(page, 0).locator(".jp-OutputArea-output").inner_text()
        assert home.strip() == f"HOME {sshd.env['HOME']}"  # the machine's, not this process's
        lines = _cell(page, 1).locator(".jp-OutputArea-output").inner_text().split()
        assert " ".join(lines) == " ".join(f"line {i}" for i in range(6))
    finally:
        _screenshot(page, "bridge-kernel")
        page.close()



@pytest.mark.timeout(600)
def test_a_slider_made_on_the_machine_moves_in_a_notebook_of_the_sessions_kernel_and_interrupt_reaches_a_loop(
        bridge_lab, browser):
    # the comms go through the bridge both ways: the page's widget manager renders the
    # machine's IntSlider, the drag's comm_msg reaches the machine; the toolbar's interrupt
    # (interrupt_mode "message": an interrupt_request on the control channel) stops a busy loop
    # there, and the session keeps its variables
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        _open(page, bridge_lab, BRIDGE_NB)
        page.get_by_text("| Idle").wait_for(timeout=120_000)
        _run_cell(page, 2)
        slider = _cell(page, 2).locator(".jp-OutputArea-output .widget-slider")
        slider.locator(".noUi-handle").wait_for(timeout=60_000)
        first = slider.locator(".widget-readout").inner_text().strip()
        readouts = _drag_slider_to(page, slider, 7)
        _run_cell(page, 3)  # print(s.value) on the machine
        printed = _cell(page, 3).locator(".jp-OutputArea-output").inner_text().strip()
        body = page.evaluate("() => document.body.innerText")
        _cell(page, 4).locator(".jp-InputArea-editor").click()
        page.keyboard.press("Shift+Enter")
        page.wait_for_function("e => e.innerText.includes('looping')", arg=_cell(page, 4).element_handle(),
                               timeout=60_000)
        busy = _cell(page, 4).locator(".jp-InputPrompt").inner_text().strip()
        page.locator(f"{PANEL} .jp-Toolbar-item[data-jp-item-name='interrupt']").click()
        page.wait_for_function(
            "e => /^\\[\\d+\\]:$/.test(e.querySelector('.jp-InputPrompt').textContent.trim())",
            arg=_cell(page, 4).element_handle(), timeout=60_000)
        stopped = _cell(page, 4).locator(".jp-OutputArea").inner_text()
        _run_cell(page, 5)
        kept = _cell(page, 5).locator(".jp-OutputArea-output").inner_text().strip()
    finally:
        _screenshot(page, "bridge-kernel-widgets")
        page.close()
    assert "Error displaying widget" not in body
    assert first == "3" and readouts[-1] == "7", (first, readouts)
    assert printed == "7", (printed, readouts)
    assert busy == "[*]:" and "KeyboardInterrupt" in stopped, (busy, stopped)
    assert kept == "kept True 7"


@pytest.mark.timeout(600)
def test_a_page_reloaded_while_a_20_s_cell_prints_gets_its_whole_output_once_from_gpu_kernel_attach(
        bridge_lab, browser):
    # JupyterLab shows output only for requests its page sent: after a reload, the old cell's
    # output (which goes on) is dropped by the page, and `%gpu kernel attach` shows it in its
    # own cell, from the first line, once, following it to its end (gpumagic/kernel_bridge/bridge.py)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    ticks = [f"tick {i}" for i in range(20)]
    try:
        _open(page, bridge_lab, BRIDGE_NB)
        page.get_by_text("| Idle").wait_for(timeout=120_000)
        _cell(page, 6).locator(".jp-InputArea-editor").click()
        page.keyboard.press("Shift+Enter")
        page.wait_for_function("e => e.innerText.includes('tick 1')", arg=_cell(page, 6).element_handle(),
                               timeout=60_000)
        page.reload()
        page.wait_for_selector(f"{PANEL} .jp-CodeCell .jp-InputPrompt", timeout=120_000)
        # the page connects while the cell runs, and knows the kernel is busy
        page.get_by_text(f"{BRIDGE_DISPLAY} | Busy").wait_for(timeout=120_000)
        old_after_reload = _cell(page, 6).locator(".jp-OutputArea").inner_text()
        _run_cell(page, 7)  # returns once it ended: with the old cell
        shown = _cell(page, 7).locator(".jp-OutputArea").inner_text()
        old_at_end = _cell(page, 6).locator(".jp-OutputArea").inner_text()
        body = page.evaluate("() => document.body.innerText")
    finally:
        _screenshot(page, "bridge-kernel-reloaded")
        page.close()
    assert "tick" not in old_after_reload and old_at_end == old_after_reload  # the page drops its messages
    lines = [ln.strip() for ln in shown.splitlines() if ln.strip()]
    assert re.fullmatch(r"\[gpumagic: In \[\d+\] is running: its output from the first line\]", lines[0]), lines[0]
    assert lines[1:] == ticks, shown  # from the first line, then followed to the end
    assert [body.count(t + "\n") + body.endswith(t) for t in ticks] == [1] * 20, body  # no line twice on the page
