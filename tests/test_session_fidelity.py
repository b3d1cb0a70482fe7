"""A live session indistinguishable from a local kernel (issue 32): file modes, error names,
help text, options a running session cannot take, empty cells, captured output, a crash.

Against the real test sshd; the machine is this computer, the kernels run this venv's python.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import stat

import nbformat
import pytest
from nbclient import NotebookClient

import gpumagic
from gpumagic.errors import RemoteKernelError
from gpumagic.notebook.magics.kernel import skip_blank_kernel_cells
from gpumagic.remote import kernel as gk
from gpumagic.remote.kernel import KernelError

from test_kernel import PY, ROOT, Recorder, kernel_dir, start, stop_every_kernel, stop_quietly  # noqa: F401

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture
def m(sshd):
    machine = gpumagic.connect("testgpu")
    yield machine
    machine.close()


def plain(text: str) -> str:
    return ANSI.sub("", text)


@contextlib.contextmanager
def magic_session(ip, name: str):
    """``%gpu connect testgpu`` and ``%gpu kernel start NAME``; ``%gpu kernel stop NAME`` after."""
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", f"kernel start {name} --python {PY}")
    try:
        yield
    finally:
        ip.run_line_magic("gpu", f"kernel stop {name}")


# -- 5: files made in a session get the user's umask -------------------------------------------


def test_files_made_in_a_session_get_the_login_umask_and_the_keepers_files_stay_private(m, sshd, tmp_path):
    login = int(m.exec("umask", timeout=30).stdout.strip(), 8)
    assert login != 0o077  # else the test cannot tell the two apart
    k = start(m, "um")
    try:
        made_file, made_dir = tmp_path / "made.txt", tmp_path / "made" / "deeper"
        k.execute(f"import os\nopen({str(made_file)!r}, 'w').close()\nos.makedirs({str(made_dir)!r})",
                  output=Recorder())
        assert stat.S_IMODE(made_file.stat().st_mode) == 0o666 & ~login  # 0644 under umask 022
        assert stat.S_IMODE(made_dir.stat().st_mode) == 0o777 & ~login  # 0755
        d = kernel_dir(sshd, "um")
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
        for name in ("state.json", "token", "journal", "connection.json", "kernel.log", "keeper.log"):
            assert stat.S_IMODE((d / name).stat().st_mode) == 0o600, name
        # a restarted kernel gets it too
        k.restart(output=Recorder())
        again = tmp_path / "again.txt"
        k.execute(f"open({str(again)!r}, 'w').close()", output=Recorder())
        assert stat.S_IMODE(again.stat().st_mode) == 0o666 & ~login
    finally:
        stop_quietly(k)


# -- 2: a remote error keeps its name ----------------------------------------------------------


def test_a_remote_error_is_raised_under_the_machines_exception_name(m):
    k = start(m, "en")
    try:
        with pytest.raises(RemoteKernelError) as e:
            k.execute("1 / 0", output=Recorder())
        err = e.value
        assert type(err).__name__ == "ZeroDivisionError"
        assert (err.ename, err.evalue, str(err)) == ("ZeroDivisionError", "division by zero", "division by zero")
        assert err.where == "testgpu:en" and "testgpu:en" in err.hint
        assert "ZeroDivisionError: division by zero" in plain("\n".join(err._render_traceback_()))
        copy = pickle.loads(pickle.dumps(err))
        assert type(copy).__name__ == "ZeroDivisionError" and isinstance(copy, RemoteKernelError)
        assert copy.traceback == err.traceback
        with pytest.raises(RemoteKernelError) as e:
            k.execute("def f(:\n    pass", output=Recorder())
        assert type(e.value).__name__ == "SyntaxError" and e.value.ename == "SyntaxError"
    finally:
        stop_quietly(k)


def test_a_remote_zerodivisionerror_is_saved_in_the_notebook_as_zerodivisionerror(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(f"%load_ext gpumagic\n%gpu connect testgpu\n%gpu kernel start nbe --python {PY}"),
        nbformat.v4.new_code_cell("%%remote --kernel nbe\ndef f():\n    return 1 / 0\nf()"),
        nbformat.v4.new_code_cell("%gpu kernel stop nbe"),
    ]
    NotebookClient(nb, timeout=180, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for o in nb.cells[1].outputs if o.output_type == "error"]
    assert len(errors) == 1, nb.cells[1].outputs
    assert (errors[0].ename, errors[0].evalue) == ("ZeroDivisionError", "division by zero")
    lines = [plain(ln) for ln in errors[0].traceback]
    assert any("return 1 / 0" in ln for ln in lines) and not any("gpumagic/" in ln for ln in lines)
    assert not [o for o in nb.cells[2].outputs if o.output_type == "error"]


# -- 4: help output --------------------------------------------------------------------------


def test_help_with_a_question_mark_shows_the_signature_and_docstring(m):
    k = start(m, "hp")
    try:
        for code in ("len?", "len??", "%pinfo len"):
            out = Recorder()
            r = k.execute(code, output=out)
            shown = [plain(e[1].get("text/plain", "")) for e in out.events if e[0] == "display"]
            assert len(shown) == 1, (code, out.events)
            assert "Signature: len(obj, /)" in shown[0], shown
            assert "Return the number of items in a container." in shown[0]
            assert [plain(o["data"]["text/plain"]) for o in r.outputs] == shown  # kept with --out
    finally:
        stop_quietly(k)


def test_help_in_a_kernel_cell_goes_to_ipythons_pager(ip, monkeypatch):
    paged = []
    monkeypatch.setattr("IPython.core.page.page", lambda data, *a, **kw: paged.append(data))
    with magic_session(ip, "hpm"):
        ip.run_cell_magic("remote", "--kernel hpm", "len?")
        assert len(paged) == 1
        assert "Return the number of items in a container." in plain(paged[0]["text/plain"])


# -- 6: --cwd / --env on a running session -----------------------------------------------------


def test_cwd_and_env_given_to_a_running_session_at_start_say_they_were_not_applied(ip, capsys, tmp_path):
    with magic_session(ip, "ce"):
        capsys.readouterr()
        ip.run_line_magic("gpu", f"kernel start ce --cwd {tmp_path} --env ALPHA=1")
        said = capsys.readouterr().out
        assert said.startswith("session ce already runs on testgpu")
        assert f"--cwd {tmp_path} (it runs in " in said
        assert "--env ALPHA=1 were not applied (`%gpu kernel stop ce` first to change them)" in said
        ip.run_line_magic("gpu", "kernel start ce --cwd ~")  # where it runs: nothing to say
        assert "not applied" not in capsys.readouterr().out


def test_cwd_and_env_on_a_kernel_cell_of_a_running_session_say_they_were_not_applied(ip, capsys, tmp_path):
    with magic_session(ip, "cc"):
        capsys.readouterr()
        ip.run_cell_magic("remote", f"--kernel cc --cwd {tmp_path}", "import os\nprint(os.getcwd())")
        shown = capsys.readouterr()
        assert shown.out != f"{tmp_path}\n"
        assert f"session cc already runs; --cwd {tmp_path} (it runs in {shown.out.strip()}; " in shown.err
        assert "was not applied (`%gpu kernel stop cc` first to change it)" in shown.err
        ip.run_cell_magic("remote", "--kernel cc --env BETA=2", "import os\nprint(os.environ.get('BETA'))")
        shown = capsys.readouterr()
        assert shown.out == "None\n"
        assert "--env BETA=2 was not applied" in shown.err
        ip.run_cell_magic("remote", "--kernel cc", "print('plain')")
        shown = capsys.readouterr()
        assert (shown.out, shown.err) == ("plain\n", "")


# -- 8: an empty cell ------------------------------------------------------------------------


def test_an_empty_kernel_cell_does_nothing(ip, capsys):
    with magic_session(ip, "ec"):
        capsys.readouterr()
        ip.run_cell_magic("remote", "--kernel ec", "print(get_ipython().execution_count)")
        before = int(capsys.readouterr().out)
        for cell in ("%%remote --kernel ec", "%%remote --kernel ec\n", "%%remote --kernel ec\n\n   \n"):
            result = ip.run_cell(cell)
            assert result.success, result.error_before_exec or result.error_in_exec
        ip.run_cell_magic("remote", "--kernel ec", "    \n")  # the magic itself: nothing sent either
        ip.run_cell_magic("remote", "--kernel ec", "print(get_ipython().execution_count)")
        assert int(capsys.readouterr().out) == before + 1  # no cell ran there in between


def test_only_blank_kernel_cells_are_skipped():
    assert skip_blank_kernel_cells(["%%remote --kernel\n"]) == []
    assert skip_blank_kernel_cells(["%%remote --host a --kernel k\n", "  \n"]) == []
    for cell in (["%%remote\n"], ["%%remote --python\n"], ["%%remote --kernel -h\n"],
                 ["%%remote --kernel\n", "x = 1\n"], ["%%remotely --kernel\n"]):
        assert skip_blank_kernel_cells(cell) == cell


# -- 10: captured output is collected in linear time ---------------------------------------------


class _CountingResult(gk.ExecuteResult):
    """Counts assignments to ``stdout``: one per message is the quadratic pattern."""

    def __setattr__(self, name, value):
        if name == "stdout":
            self.__dict__["stdout_sets"] = self.__dict__.get("stdout_sets", 0) + 1
        super().__setattr__(name, value)


def test_captured_output_is_joined_once_not_copied_per_message(m):
    k = gk.RemoteKernel(m, "unit")
    result = _CountingResult()
    result.stdout_sets = 0
    for i in range(5000):
        msg = gk.Message(i + 1, "iopub", header={"msg_type": "stream"},
                         content={"name": "stdout", "text": f"{i}\n"})
        k._render(gk.Output(), msg, result, capture=True, show_error=False)
    getattr(result, "_join", lambda: None)()  # what execute does when the cell ends
    assert result.stdout == "".join(f"{i}\n" for i in range(5000))
    assert result.stdout_sets == 1


def test_a_cell_printing_many_small_lines_is_captured_whole(ip, capsys):
    with magic_session(ip, "many"):
        ip.run_cell_magic("remote", "--kernel many --out r",
                          "import sys\nfor i in range(20000):\n    print(i, flush=True)\n"
                          "print('err', file=sys.stderr)")
        r = ip.user_ns["r"]
        assert r.stdout == "".join(f"{i}\n" for i in range(20000))
        assert r.stderr == "err\n"
        capsys.readouterr()


def test_output_printed_while_the_keeper_is_stopped_is_kept_whole(m):
    """ZeroMQ's PUB socket drops what its peer is too slow to take (1000 messages by default):
    under load, a keeper that falls behind a printing cell must not lose a line. The cell
    stops its keeper (SIGSTOP, its parent) while it prints far more than 1000 messages and
    the TCP buffers hold, then lets it go on."""
    k = start(m, "stall")
    try:
        rec = Recorder()
        n = 30000
        r = k.execute("import os, signal, time\n"
                      "keeper = os.getppid()\n"
                      "os.kill(keeper, signal.SIGSTOP)\n"
                      "try:\n"
                      f"    for i in range({n}):\n"
                      "        print(str(i).rjust(400, '.'), flush=True)\n"
                      "    time.sleep(1)\n"
                      "finally:\n"
                      "    os.kill(keeper, signal.SIGCONT)", output=rec, timeout=300)
        assert r.stdout == "".join(str(i).rjust(400, ".") + "\n" for i in range(n))
    finally:
        stop_quietly(k)


# -- 9: a crashed kernel ---------------------------------------------------------------------


def test_a_segfault_is_named_and_the_tcp_warning_is_not_the_reason(m):
    k = start(m, "sg")
    try:
        with pytest.raises(KernelError) as e:
            k.execute("import ctypes\nctypes.string_at(0)", output=Recorder())
        said = str(e.value)
        assert "died (killed by signal 11, SIGSEGV: segmentation fault)" in said, said
        assert "TCP" not in said and "encryption" not in said, said
        assert "%gpu kernel restart sg" in said
    finally:
        stop_quietly(k)


# -- 1: a cell's value is its execute_result, as a local kernel's --------------------------------


def _run_notebook(tmp_path, monkeypatch, cells: list[str]):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    NotebookClient(nb, timeout=180, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    from gpumagic.__main__ import join_streams

    for cell in nb.cells:  # as run-notebook and JupyterLab save them: one print, however it was flushed
        cell.outputs = join_streams(cell.outputs)
    return nb


def _shape(cell) -> list[tuple]:
    """What a grader or nbval compares: each output's type, execution count and mime types."""
    return [(o.output_type, o.get("execution_count"), sorted(o.get("data", {}))) for o in cell.outputs]


def test_a_kernel_cells_value_is_saved_as_execute_result_with_the_cells_count_and_sets_out(tmp_path, monkeypatch):
    frame = "import pandas as pd\npd.DataFrame({'a': [1, 2]}, index=pd.Index(['x', 'y'], name='k'))"
    nb = _run_notebook(tmp_path, monkeypatch, [
        f"%load_ext gpumagic\n%gpu connect testgpu\n%gpu kernel start nbr --python {PY}",
        "%%remote --kernel nbr\nx = 41\nx + 1",                               # 2
        "print(repr(_), repr(Out[2]))",                                        # 3
        f"%%remote --kernel nbr\n{frame}",                                     # 4
        frame,                                                                 # 5: the same, locally
        "%%remote --kernel nbr\nx;",                                           # 6: ';' shows nothing
        "%gpu kernel autorun on nbr",                                          # 7
        "x + 2",                                                               # 8
        "x\nprint('after')",                                                   # 9: not the last line
        "%gpu kernel autorun off",                                             # 10
        "%gpu kernel stop nbr",
    ])
    cells = nb.cells
    assert not [o for c in cells for o in c.outputs if o.output_type == "error"], [c.outputs for c in cells]
    assert _shape(cells[1]) == [("execute_result", 2, ["text/plain"])]
    assert cells[1].outputs[0].data["text/plain"] == "42"
    assert [o.text for o in cells[2].outputs] == ["42 42\n"]
    assert _shape(cells[3]) == [("execute_result", 4, ["text/html", "text/plain"])]
    assert _shape(cells[4]) == [("execute_result", 5, ["text/html", "text/plain"])]
    assert cells[3].outputs[0].data == cells[4].outputs[0].data  # the same bundle as locally
    assert cells[5].outputs == []
    assert _shape(cells[7]) == [("execute_result", 8, ["text/plain"])]
    assert cells[7].outputs[0].data["text/plain"] == "43"
    assert [(o.output_type, o.get("text")) for o in cells[8].outputs] == [("stream", "after\n")]


def test_the_api_keeps_the_value_in_the_result_and_text_output_prints_it(m, capsys):
    k = start(m, "val")
    try:
        r = k.execute("6 * 7", output=gk.TextOutput())
        assert r.result == {"data": {"text/plain": "42"}, "metadata": {}}
        assert capsys.readouterr().out == "42\n"
    finally:
        stop_quietly(k)


# -- 3: widgets made on the machine work here (the comm bridge) ---------------------------------


class _Kernel:
    """A local ipykernel driven as a front end drives it: execute, and send comm messages."""

    def __init__(self, tmp_path):
        from jupyter_client.manager import start_new_kernel

        self.km, self.kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))

    def _until_idle(self, msg_id: str, timeout: float = 180) -> list[dict]:
        msgs = []
        while True:
            m = self.kc.get_iopub_msg(timeout=timeout)
            if m["parent_header"].get("msg_id") != msg_id:
                continue
            msgs.append(m)
            if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                return msgs

    def run(self, code: str) -> list[dict]:
        msgs = self._until_idle(self.kc.execute(code))
        errors = [m["content"] for m in msgs if m["msg_type"] == "error"]
        assert not errors, errors
        return msgs

    def comm_msg(self, comm_id: str, data: dict) -> tuple[str, list[dict]]:
        msg = self.kc.session.msg("comm_msg", {"comm_id": comm_id, "data": data})
        self.kc.shell_channel.send(msg)
        return msg["header"]["msg_id"], self._until_idle(msg["header"]["msg_id"])

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def _stdout(msgs: list[dict]) -> str:
    return "".join(m["content"]["text"] for m in msgs if m["msg_type"] == "stream")


@pytest.fixture
def front_end(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    k = _Kernel(tmp_path)
    k.run(f"%load_ext gpumagic\n%gpu connect testgpu\n%gpu kernel start wid --python {PY}")
    yield k
    try:
        k.run("%gpu kernel stop wid")
    finally:
        k.close()


def test_a_slider_made_on_the_machine_is_a_model_here_and_moving_it_here_moves_it_there(front_end):
    msgs = front_end.run("%%remote --kernel wid\nimport ipywidgets\ns = ipywidgets.IntSlider(3)\ns")
    opens = {m["content"]["comm_id"]: m["content"] for m in msgs if m["msg_type"] == "comm_open"}
    slider = [cid for cid, c in opens.items() if c["data"]["state"].get("_model_name") == "IntSliderModel"]
    assert len(slider) == 1 and opens[slider[0]]["data"]["state"]["value"] == 3
    assert opens[slider[0]]["target_name"] == "jupyter.widget"
    shown = [m["content"]["data"] for m in msgs if m["msg_type"] == "execute_result"]
    assert [d["application/vnd.jupyter.widget-view+json"]["model_id"] for d in shown] == slider
    # the front end drags it to 7: the machine's slider holds 7
    front_end.comm_msg(slider[0], {"method": "update", "state": {"value": 7}, "buffer_paths": []})
    assert _stdout(front_end.run("%%remote --kernel wid\nprint(s.value)")) == "7\n"
    # the machine sets it to 9: the front end's model gets 9
    msgs = front_end.run("%%remote --kernel wid\ns.value = 9")
    updates = [m["content"] for m in msgs if m["msg_type"] == "comm_msg"]
    assert {"comm_id": slider[0], "data": {"method": "update", "state": {"value": 9}, "buffer_paths": []}} in updates


def test_interact_calls_the_function_on_the_machine_and_its_output_goes_to_the_widget(front_end):
    msgs = front_end.run("%%remote --kernel wid\nimport os\nfrom ipywidgets import interact\n"
                         "@interact(x=3)\ndef f(x):\n    print('f', x, os.getpid())")
    first = _stdout(msgs)
    assert first.startswith("f 3 ") and int(first.split()[2]) != os.getpid()  # ran on the machine
    slider = next(m["content"]["comm_id"] for m in msgs if m["msg_type"] == "comm_open"
                  and m["content"]["data"]["state"].get("_model_name") == "IntSliderModel")
    msg_id, answer = front_end.comm_msg(slider, {"method": "update", "state": {"value": 7}, "buffer_paths": []})
    # printed on the machine, under the front end's own message: its Output widget shows it
    streams = [m for m in answer if m["msg_type"] == "stream"]
    assert [m["content"]["text"].split()[:2] for m in streams] == [["f", "7"]]
    outputs_state = [m["content"]["data"]["state"] for m in answer if m["msg_type"] == "comm_msg"
                     and "msg_id" in m["content"]["data"].get("state", {})]
    assert {"msg_id": msg_id} in outputs_state  # the Output widget captures under that id


def test_a_tqdm_notebook_bar_on_the_machine_reaches_100_percent_in_the_saved_notebook(tmp_path, monkeypatch):
    nb = _run_notebook(tmp_path, monkeypatch, [
        f"%load_ext gpumagic\n%gpu connect testgpu\n%gpu kernel start tq --python {PY}",
        "%%remote --kernel tq\nfrom tqdm.notebook import tqdm\nfor i in tqdm(range(5)):\n    pass",
        "%gpu kernel stop tq",
    ])
    assert not [o for c in nb.cells for o in c.outputs if o.output_type == "error"], [c.outputs for c in nb.cells]
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    bars = [m["state"] for m in state.values() if m["model_name"] == "FloatProgressModel"]
    assert [(b["value"], b["max"]) for b in bars] == [(5, 5)]
    texts = [m["state"]["value"] for m in state.values() if m["model_name"] == "HTMLModel"]
    assert any(t.startswith("100%") for t in texts), texts
    views = [o for o in nb.cells[1].outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert len(views) == 1 and views[0].data["application/vnd.jupyter.widget-view+json"]["model_id"] in state


# -- what a new user found (a fresh clone's trial) -----------------------------------------------


def test_attach_and_restart_work_first_on_a_new_connection(sshd):
    """A session whose output an earlier connection acknowledged: a new connection's attach and
    restart wait for nothing that will not come again (they hung 30 s: 'did not answer')."""
    m = gpumagic.connect("testgpu")
    k = start(m, "fresh")
    try:
        k.execute("x = 1", output=Recorder())
        m.close()
        m = gpumagic.connect("testgpu")
        assert m.kernel("fresh").attach(output=Recorder())["state"] == "idle"
        m.close()
        m = gpumagic.connect("testgpu")
        k = m.kernel("fresh")
        k.restart(output=Recorder())
        assert k.execute("'x' in dir()", output=Recorder()).result["data"]["text/plain"] == "False"
    finally:
        stop_quietly(k)
        m.close()


def test_a_cells_value_is_shown_after_the_text_cap_was_reached(tmp_path, monkeypatch):
    nb = _run_notebook(tmp_path, monkeypatch, [
        f"%load_ext gpumagic\n%gpu connect testgpu\n%gpu kernel start capv --python {PY}\n"
        "%config GpuMagics.max_display_bytes = 100",
        "%%remote --kernel capv\nprint('a' * 200)\n42",
        "print(repr(_))",
        "%gpu kernel stop capv",
    ])
    kinds = [(o.output_type, o.get("name")) for o in nb.cells[1].outputs]
    assert ("execute_result", None) in kinds, nb.cells[1].outputs
    assert [o.data["text/plain"] for o in nb.cells[1].outputs if o.output_type == "execute_result"] == ["42"]
    assert "200 more characters" not in "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert [o.text for o in nb.cells[2].outputs] == ["42\n"]


def test_an_earlier_cells_value_replayed_is_shown_but_is_not_this_cells_value(m):
    """Output kept while no notebook followed (a value among it) comes before the next cell's:
    shown as a display, while only the followed cell's value is that cell's result."""

    class Values(Recorder):
        def result(self, data, metadata):
            self.events.append(("result", data))

    k = gk.RemoteKernel(m, "unit")
    value = gk.Message(1, "iopub", header={"msg_type": "execute_result"},
                       content={"data": {"text/plain": "'done'"}, "metadata": {}})
    out = Values()
    k._render(out, value, None, capture=False, show_error=True)  # an earlier cell's
    k._render(out, value, gk.ExecuteResult(), capture=False, show_error=False)  # the followed one's
    assert [e[0] for e in out.events] == ["display", "result"]


def test_a_misspelt_session_name_that_failed_is_not_what_the_next_command_means(ip, capsys):
    with magic_session(ip, "realname"):
        with pytest.raises(KernelError, match="no session 'realnam'"):
            ip.run_line_magic("gpu", "kernel interrupt realnam")
        ip.run_line_magic("gpu", "kernel interrupt")
        assert "sent an interrupt to session realname" in capsys.readouterr().out


def test_a_disconnected_sandbox_is_named_with_the_command_that_connects_it_again(ip):
    from gpumagic.errors import NotConnected

    ip.run_line_magic("gpu", "connect --sandbox")
    ip.run_line_magic("gpu", "disconnect")
    with pytest.raises(NotConnected) as e:
        ip._gpumagic.fleet.get("sandbox")
    assert e.value.hint == "run `%gpu connect --sandbox` first"
