"""Every tutorial, executed with nbclient: its saved outputs render from the file alone.

A reopened notebook, nbviewer and GitHub have no widget models, so a finished output must be
static HTML with a text/plain fallback; a live widget (a --watch, a running sync bar) is
replaced by its final static state through its display id when it stops (issue 17 item 1).
"""

import importlib.util
import os
import re
import time
from pathlib import Path

import nbformat
import pytest
import tutorials

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "example-notebooks"
ENGLISH = sorted(NOTEBOOKS.glob("*.ipynb"))
CHINESE = sorted((NOTEBOOKS / "zh-CN").glob("*.ipynb"))
#: Tutorial 08 runs torchrun, which needs torch in this Python (GPUMAGIC_TEST_TORCH=1 installs it).
HAS_TORCH = importlib.util.find_spec("torch") is not None
TUTORIALS = [p for p in ENGLISH + CHINESE if HAS_TORCH or p.name != "08-several-gpus.ipynb"]
WIDGET = "application/vnd.jupyter.widget-view+json"


_remove_tutorial_jobs = tutorials.remove_tutorial_jobs


def rich_outputs(nb, command):
    """The display outputs of the code cells with a line that is ``command`` (a trailing
    ``*``: that starts with it)."""
    def runs(line):
        line = line.split("#")[0].strip()
        return line.startswith(command[:-1]) if command.endswith("*") else line == command

    return [o for c in nb.cells if c.cell_type == "code" and any(map(runs, c.source.splitlines()))
            for o in c.outputs if o.output_type in ("display_data", "execute_result")]


@pytest.mark.parametrize("name", [str(p.relative_to(NOTEBOOKS)) for p in TUTORIALS])
def test_no_saved_output_needs_a_widget_model(executed, name):
    nb = executed[name]
    for i, c in enumerate(nb.cells):
        for o in c.get("outputs", []):
            data = o.get("data", {})
            if WIDGET in data:
                assert "text/plain" in data and "text/html" in data, (name, i, c.source, data)


@pytest.mark.parametrize("notebook, cell, needle", [
    ("02-check-the-machine.ipynb", "%gpu status", "<table>"),             # a status snapshot
    ("02-check-the-machine.ipynb", "%gpu status --watch*", "<table>"),    # a watch, once stopped
    ("03-sync-code-and-results.ipynb", "%gpu sync project/ :project/", "sync: "),  # a finished sync bar
    ("06-budget.ipynb", "%gpu budget", "gpumagic-budget"),                # the budget meter
    ("04-long-training-jobs.ipynb", "%gpu jobs", "<table>"),               # the job table
])
def test_finished_outputs_are_static_html_with_text(executed, notebook, cell, needle):
    outs = rich_outputs(executed[notebook], cell)
    assert outs, f"no display output from {cell!r} in {notebook}"
    for o in outs:
        assert WIDGET not in o.data, (cell, o.data)
        assert "text/html" in o.data and "text/plain" in o.data, (cell, o.data)
    assert any(needle in o.data["text/html"] for o in outs), [o.data["text/html"] for o in outs]


def test_run_notebook_prints_no_tcp_encryption_warning(tmp_path):
    # issue 17 case 5: quickstart.sh printed ipykernel's "Kernel is running over TCP without
    # encryption" warning; the local kernel now talks over IPC sockets.
    import subprocess
    import sys

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("print(6 * 7)")]
    nbformat.write(nb, tmp_path / "tiny.ipynb")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-m", "gpumagic", "run-notebook", str(tmp_path / "tiny.ipynb"),
                        "--output-dir", str(tmp_path / "out")], capture_output=True, text=True,
                       env=env, timeout=300, encoding="utf-8")
    assert r.returncode == 0, r.stderr
    assert "without encryption" not in r.stderr and "WARNING" not in r.stderr, r.stderr
    out = nbformat.read(tmp_path / "out" / "tiny.ipynb", as_version=4)
    assert out.cells[0].outputs[0].text == "42\n"
    assert not list(Path(tmp_path).glob("**/kernel-ipc*"))  # no socket files left behind


def _run_notebook_cli(tmp_path, cells, *extra, **popen):
    import subprocess
    import sys

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) if isinstance(c, str) else c for c in cells]
    nbformat.write(nb, tmp_path / "t.ipynb")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-m", "gpumagic", "run-notebook", str(tmp_path / "t.ipynb"),
                             "--output-dir", str(tmp_path / "out"), *extra], stderr=subprocess.PIPE, text=True,
                            env=env, encoding="utf-8", **popen)


def test_an_executed_copy_holds_a_cells_streams_as_jupyterlab_saves_them(tmp_path):
    """One output per run of one stream, not one per message (nbclient saved each print as
    it came: ``"python"``, ``" "``, ``"3.11.7"``...), with ``\\r`` applied as JupyterLab's
    output area applies it; a display between two prints ends the first."""
    cell = ("import sys, time\n"
            "for i in range(3):\n    print(i, flush=True); time.sleep(0.2)\n"
            "print('warn', file=sys.stderr, flush=True); time.sleep(0.2)\n"
            "for p in (10, 50, 100):\n    print(f'\\r{p:3}%', end='', flush=True); time.sleep(0.2)\n"
            "print(flush=True); time.sleep(0.2)\n"
            "display('shown')\n"
            "print('after', flush=True)")
    r = _run_notebook_cli(tmp_path, [cell])
    _, err = r.communicate(timeout=300)
    assert r.returncode == 0, err
    outputs = nbformat.read(tmp_path / "out" / "t.ipynb", as_version=4).cells[0].outputs
    assert [(o.output_type, o.get("name"), o.get("text")) for o in outputs] == [
        ("stream", "stdout", "0\n1\n2\n"), ("stream", "stderr", "warn\n"), ("stream", "stdout", "100%\n"),
        ("display_data", None, None), ("stream", "stdout", "after\n")]


@pytest.mark.parametrize("index, text, prev, want", [
    (0, "abc\rxy", "", ("xyc", 2)),  # \r goes back to the line's start; what follows overwrites
    (0, "a\nb\n", "", ("a\nb\n", 4)),
    (3, "\r 20%", " 10%", (" 20%", 4)),  # a progress bar's next message
    (2, "cd", "ab", ("abcd", 4)),
    (2, "\b", "ab", ("a", 1)),  # as JupyterLab does it
    (0, "x\r", "", ("x", 0)),
])
def test_process_text_writes_a_message_as_jupyterlab_does(index, text, prev, want):
    from gpumagic.__main__ import process_text

    assert process_text(index, text, prev) == want


def test_run_notebook_names_the_failed_cell_and_its_error(tmp_path):
    # a new user saw only "a cell failed:   hint: ..." (the last line of the error text)
    raising = nbformat.v4.new_code_cell("1 / 0")
    raising.metadata["tags"] = ["raises-exception"]
    r = _run_notebook_cli(tmp_path, [raising, "x = 1", "open('/nonexistent/gm-file')"])
    _, err = r.communicate(timeout=300)
    assert r.returncode == 1
    assert err.splitlines()[0] == ("a cell failed (code cell 3: open('/nonexistent/gm-file')): "
                                        "FileNotFoundError: [Errno 2] No such file or directory: "
                                        "'/nonexistent/gm-file'"), err
    assert err.splitlines()[1] == f"executed copy (with the error): {tmp_path / 'out' / 't.ipynb'}"


def test_run_notebook_names_the_cell_that_ran_past_the_timeout(tmp_path):
    # a fresh-user trial: a cell timeout (a TimeoutError, so an OSError) was reported as
    # "cannot run ...: the notebook must be readable and --output-dir writable"
    p = _run_notebook_cli(tmp_path, ["x = 1", "import time\ntime.sleep(60)", "y = 2"], "--timeout", "2")
    _, err = p.communicate(timeout=120)
    assert p.returncode == 1
    assert err.splitlines() == [
        "a cell ran longer than --timeout 2 s (code cell 2: import time); it was stopped",
        f"executed copy (up to there): {tmp_path / 'out' / 't.ipynb'}"], err


def test_run_notebook_interrupted_says_so_in_a_line_and_leaves_no_kernel(tmp_path):
    # a fresh-user trial: Ctrl-C gave two tracebacks ending in nbclient's AssertionError
    import signal

    pid_file = tmp_path / "kernel.pid"
    p = _run_notebook_cli(tmp_path, [f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                                     "time.sleep(60)"], start_new_session=True)
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text(encoding="utf-8")) and time.monotonic() < deadline:
        time.sleep(0.1)
    kernel = int(pid_file.read_text(encoding="utf-8"))
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130
    assert err.splitlines() == [f"interrupted; the notebook's kernel was shut down; executed copy (up to there): "
                                f"{tmp_path / 'out' / 't.ipynb'}"], err
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{kernel}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{kernel}")


def test_run_notebook_says_in_a_line_that_the_kernel_died(tmp_path):
    r = _run_notebook_cli(tmp_path, ["print('before')", "import os\nos._exit(3)"])
    _, err = r.communicate(timeout=300)
    assert r.returncode == 1
    assert err.splitlines() == [f"the notebook's kernel died while it ran {tmp_path / 't.ipynb'}: Kernel died",
                                     f"executed copy (up to there): {tmp_path / 'out' / 't.ipynb'}"], err
    executed = nbformat.read(tmp_path / "out" / "t.ipynb", as_version=4)
    assert executed.cells[0].outputs[0]["text"] == "before\n"


@pytest.mark.parametrize("path", ENGLISH + CHINESE, ids=lambda p: str(p.relative_to(NOTEBOOKS)))
def test_a_tutorial_uses_only_the_public_api(path):
    """A reader copies a tutorial's cells into their own notebook: no name that starts with _
    is reached from gpumagic (04 and 09 read get_ipython()._gpumagic.fleet: now
    gpumagic.current_machine())."""
    nb = nbformat.read(path, as_version=4)
    private = [ln for c in nb.cells if c.cell_type == "code" for ln in c.source.splitlines()
               if re.search(r"\._[A-Za-z]", ln)]
    assert private == [], path.name


def test_current_machine_is_the_one_percent_gpu_connect_connected(ip):
    import gpumagic
    from gpumagic.errors import NotConnected

    ip.run_line_magic("gpu", "connect testgpu")
    assert gpumagic.current_machine() is ip._gpumagic.fleet.get("testgpu") is gpumagic.current_machine("testgpu")
    with pytest.raises(NotConnected) as e:
        gpumagic.current_machine("nope")
    assert e.value.message == "no machine named 'nope' is connected (connected: testgpu)"


# -- the Simplified Chinese tutorials (example-notebooks/zh-CN) ------------------------------


def _code(nb):
    return [(c.source, c.metadata.get("tags", [])) for c in nb.cells if c.cell_type == "code"]


def test_every_english_tutorial_has_a_chinese_one():
    assert [p.name for p in CHINESE] == [p.name for p in ENGLISH]


@pytest.mark.parametrize("zh", CHINESE, ids=lambda p: p.name)
def test_each_chinese_tutorial_has_the_english_ones_code_cells(zh):
    en = NOTEBOOKS / zh.name
    assert en.exists(), f"{zh.name} has no English twin in example-notebooks/"
    zh_nb, en_nb = nbformat.read(zh, as_version=4), nbformat.read(en, as_version=4)
    assert _code(zh_nb) == _code(en_nb)
    prose = "".join(c.source for c in zh_nb.cells if c.cell_type == "markdown")
    assert sum("\u4e00" <= ch <= "\u9fff" for ch in prose) > len(prose) / 4  # written in Chinese


@pytest.mark.parametrize("zh", [p for p in CHINESE if f"zh-CN/{p.name}" in
                                [str(t.relative_to(NOTEBOOKS)) for t in TUTORIALS]], ids=lambda p: p.name)
def test_executed_chinese_tutorials_match_the_english_outputs(executed, zh):
    # The same code gives the same kinds of output: no cell errs in one language only.
    zh_nb, en_nb = executed[f"zh-CN/{zh.name}"], executed[zh.name]
    zh_kinds = [[o.output_type for o in c.outputs] for c in zh_nb.cells if c.cell_type == "code"]
    en_kinds = [[o.output_type for o in c.outputs] for c in en_nb.cells if c.cell_type == "code"]
    assert [("error" in k) for k in zh_kinds] == [("error" in k) for k in en_kinds], zh.name
    assert any(zh_kinds), zh.name


def test_readme_zh_cn_gives_the_same_two_set_up_commands():
    import re

    def commands(text):
        block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "quickstart.sh" in b)
        return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]

    en = commands((ROOT / "README.md").read_text(encoding="utf-8"))
    zh = commands((ROOT / "README.zh-CN.md").read_text(encoding="utf-8"))
    assert zh == en == ["bash scripts/quickstart.sh", "bash scripts/test.sh"]
    # and the docs' set-up pages, English and Chinese, where the README points for more
    for page in ("docs/guide/setup.md", "docs/zh-CN/setup.md"):
        assert commands((ROOT / page).read_text(encoding="utf-8")) == en, page


@pytest.mark.skipif(not HAS_TORCH, reason="tutorial 08 needs torch: .venv/bin/pip install torch==2.13.0")
@pytest.mark.parametrize("name", ["08-several-gpus.ipynb", "zh-CN/08-several-gpus.ipynb"])
def test_tutorial_08_trains_on_two_sandboxes_and_pulls_each_result(executed, name):
    # run from a copy (the fixture's src/), so results/ (the notebook's sync --from-all) lands there
    src = Path(executed.src) / name
    assert (src.parent / "results" / "b" / "result.txt").read_text(encoding="utf-8") == "trained with LR=3e-4\n"
    text = "".join(o.get("text", "") for c in executed[name].cells if c.cell_type == "code"
                   for o in c.outputs if o.output_type == "stream")
    assert "rank 1 of 2: all-reduced sum 1" in text
    assert text.count(": sum 6") == 4
    assert "trained with LR=1e-3" in text and "trained with LR=3e-4" in text


@pytest.mark.parametrize("name", ["10-proxy-and-mirrors.ipynb", "zh-CN/10-proxy-and-mirrors.ipynb"])
def test_tutorial_10_lends_the_stand_in_proxy_sets_mirrors_and_undoes_both(executed, name):
    nb = executed[name]

    def text(start):
        cell = next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith(start))
        assert not [o for o in cell.outputs if o.output_type == "error"], cell.outputs
        return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")

    doctor = text("%gpu doctor --net")
    assert "huggingface.co timed out (no answer within 4 s); hf-mirror.com " in doctor
    assert "github.com slow (" in doctor and "try `%gpu proxy on`" in doctor
    assert "proxy on for sandbox: the machine's 127.0.0.1:" in text("%gpu proxy on")
    curl = text('%%remote\necho "https_proxy=')
    assert curl.startswith("https_proxy=http://127.0.0.1:")
    assert curl.endswith("stand-in for github.com: this request went through the proxy on this computer\n")
    assert text('print("requests the proxy carried:"') == "requests the proxy carried: {'github.com': 1}\n"
    assert "100.100.100.200\n169.254.169.254\n" in text('%%remote\necho "$no_proxy"')
    assert "HF_ENDPOINT = https://hf-mirror.com\n" in text("%%remote --python\nimport os")
    assert text("%%remote\nenv | grep") == "no proxy variable left\nHF_ENDPOINT=[]\n"


@pytest.mark.parametrize("name", ["12-rent-a-machine.ipynb", "zh-CN/12-rent-a-machine.ipynb"])
def test_tutorial_12_rents_from_the_runpod_stand_in_stops_guards_starts_and_releases(executed, name):
    """Run as saved against the RunPod stand-in (tests/tutorials.py: ``stand_in``), which its
    login reaches through the environment; every request and answer was checked against
    RunPod's published documents."""
    import json

    nb = executed[name]
    saw = json.loads((executed.path(name).parent / tutorials.STAND_IN).read_text(encoding="utf-8"))
    assert saw["violations"] == [] and saw["undocumented"] == []
    errors = [(c.source, o.ename, o.evalue) for c in nb.cells if c.cell_type == "code"
              for o in c.outputs if o.output_type == "error"]
    assert errors == []

    def texts(source):
        """The text of each code cell whose source is ``source`` (or starts with it, for a cell of
        several lines), in order: its prints, and its displays' text/plain."""
        cells = [c for c in nb.cells if c.cell_type == "code" and (c.source == source or
                                                                   c.source.startswith(source + "\n"))]
        assert cells, source
        return ["".join(o.get("text", "") if o.output_type == "stream" else o.get("data", {}).get("text/plain", "") + "\n"
                        for o in c.outputs) for c in cells]

    everything = json.dumps([c.get("outputs", []) for c in nb.cells])
    assert "good-key" not in everything  # the key from the environment is never shown
    login, = texts("%gpu provider login runpod")
    assert login.splitlines() == [
        f"runpod: the key in $GPUMAGIC_RUNPOD_API_KEY works; kept in {executed.data(name) / 'gpumagic' / 'keys'} "
        "(mode 0600)",
        "runpod: --base-url from $GPUMAGIC_RUNPOD_BASE_URL, --catalog-url from $GPUMAGIC_RUNPOD_CATALOG_URL, "
        "--user from $GPUMAGIC_RUNPOD_USER"]
    offers, = texts("%gpu offers --max-price 1")
    rows = offers.splitlines()[1:]
    assert [r.split()[0] for r in rows] == ["runpod:NVIDIA", "runpod:NVIDIA"]  # the two 4090s; no H100 (2.99)
    assert "community" in rows[0] and "0.340" in rows[0] and "secure" in rows[1] and "0.690" in rows[1]
    rent, = texts("%gpu rent --gpu 4090 --max-price 0.5 --name my-4090 --trust-new-host")
    assert rent.startswith("renting runpod:NVIDIA GeForce RTX 4090/community (RTX 4090, 0.340 USD/h) as my-4090\n")
    # its cells run in the pod's volume (the stand-in's is its sshd's home; RunPod's /workspace)
    volume = next(executed.data(name).glob("runpod/pod-*/home"))
    assert rent.splitlines()[-1] == (f"my-4090's cells run in {volume}, its volume: what a stop keeps "
                                     "(the rest of its disk is not kept)")
    ports = [int(m) for t in [rent] + texts("%gpu start my-4090")
             for m in re.findall(r"^connected to my-4090 \(\S+@127\.0\.0\.1:(\d+)\)", t, re.M)]
    assert len(ports) == 3 and len(set(ports)) == 3  # the rent and each start: a new port every time
    first, second = texts("%%remote")
    assert first.rstrip().endswith("epoch 1 written: epoch-1.json")
    assert second.splitlines()[-2:] == ["epoch-1.json", "epoch 2 written"]  # the volume was kept through the stop
    assert sorted(p.name for p in (volume / "runs").iterdir()) == ["epoch-1.json", "epoch-2.json"]
    stop, = texts("%gpu stop my-4090")
    assert stop.startswith("my-4090 is stopped; its disk costs 0.014 USD/h while stopped")
    after_stop, after_guard, after_release = texts("%gpu rentals")
    assert "my-4090" in after_stop and "EXITED" in after_stop and "EXITED" in after_guard
    assert after_release == "no instances on any platform with a key\n"
    guard, = texts("%gpu budget guard --idle 1m --poll 10")
    assert "it ends the bill with the runpod API's stop, sent from my-4090 itself (the laptop may be closed)" in guard
    waited, = texts("import time\nfrom gpumagic.rent import Renter")
    assert waited == "my-4090 is stopped (EXITED), as RunPod's API reads it\n"
    named, = texts("%gpu wrapup --pull :runs/ ./runs/")
    assert "results :runs/ -> ./runs/: 1 not pulled yet; pulled 1 files (26 B)\n  epoch-1.json\n" in named
    pulled, = texts("%gpu wrapup")  # the folder named above, remembered
    assert "results :runs/ -> ./runs/: 1 not pulled yet; pulled 1 files (26 B)\n  epoch-2.json\n" in pulled
    assert pulled.splitlines()[-1] == "here: ['epoch-1.json', 'epoch-2.json']"
    release, = texts("%gpu release my-4090")
    assert release == "my-4090 is released: the platform has terminated it and its disk\n"
    # one pod, stopped twice: by `%gpu stop` with the account's key, then by the guard, from the
    # pod, with the pod-scoped key RunPod injects; then released
    (pod, state), = saw["pods"].items()
    assert state == "TERMINATED"
    assert saw["stops"] == [[pod, "stop", "account"], [pod, "stop", "instance"], [pod, "release", "account"]]


def test_run_notebook_leaves_ctrl_c_as_it_found_it_when_the_kernel_cannot_start(tmp_path):
    # nbclient installs a SIGINT handler of its event loop and keeps it when the kernel fails
    # to start: Ctrl-C in the caller (a test's interrupt, a script) then did nothing at all
    import signal

    import nbformat
    from jupyter_client.kernelspec import NoSuchKernel

    from gpumagic.__main__ import run_notebook

    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell("1 + 1"))
    nbformat.write(nb, tmp_path / "k.ipynb")
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(NoSuchKernel):
        run_notebook(tmp_path / "k.ipynb", tmp_path / "out", kernel_name="gpumagic-no-such-kernel")
    assert signal.getsignal(signal.SIGINT) is before
