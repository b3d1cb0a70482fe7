"""The machine's live session as a Jupyter kernel (gpumagic/kernel_bridge/): kernelspecs, and
the bridge a front end starts, driven by jupyter_client against the real test sshd.

Each test installs its kernelspec (its own session name) into a temporary JUPYTER_DATA_DIR;
the bridge reaches the machine as the alias ``testgpu`` (the client HOME's ~/.ssh/config),
and the session runs with this venv's python, as in tests/test_kernel.py.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import time
from pathlib import Path

import pytest
from IPython.core.error import UsageError
from jupyter_client import KernelManager
from jupyter_client.session import Session

from gpumagic.__main__ import main as gpumagic_main
from gpumagic.errors import GpumagicError

from conftest import wait_until

PY = sys.executable
TIMEOUT = 60


@pytest.fixture(scope="module", autouse=True)
def stop_every_kernel(sshd):
    """No keeper or kernel outlives this module (they are detached by design)."""
    yield
    root = Path(sshd.env["HOME"]) / ".gpumagic" / "kernels"
    for state in root.glob("kb*/state.json"):
        try:
            os.kill(json.loads(state.read_text(encoding="utf-8"))["keeper_pid"], signal.SIGTERM)
        except (OSError, ValueError, KeyError):
            pass


@pytest.fixture
def jupyter_dirs(tmp_path, monkeypatch):
    data = tmp_path / "jupyter-data"
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(data))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("JUPYTER_PATH", str(data))
    return data


def install(session: str, *extra: str) -> str:
    assert gpumagic_main(["kernel", "install", "testgpu", "--name", session, "--python", PY, *extra]) == 0
    return f"gpumagic-testgpu-{session}"


class Frontend:
    """A jupyter_client front end of one bridge process."""

    def __init__(self, kernel_name: str, flush: bool = True):
        self.km = KernelManager(kernel_name=kernel_name)
        self.km.start_kernel()
        self.kc = self.km.client()
        self.kc.start_channels()
        if flush:  # jupyter_client's own readiness check, which drops what iopub had meanwhile
            self.kc.wait_for_ready(timeout=TIMEOUT)

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid

    def iopub_until_idle(self, msg_id: str, timeout: float = TIMEOUT, on_msg=None) -> list[dict]:
        """The iopub messages of request ``msg_id`` up to its idle (outputs only, in order)."""
        out = []
        deadline = time.monotonic() + timeout
        while True:
            msg = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "status":
                if msg["content"]["execution_state"] == "idle":
                    return out
                continue
            out.append(msg)
            if on_msg is not None:
                on_msg(msg)

    def run(self, code: str, **kw) -> tuple[dict, list[dict]]:
        msg_id = self.kc.execute(code, **kw)
        outputs = self.iopub_until_idle(msg_id)
        reply = self.reply(msg_id)
        return reply, outputs

    def reply(self, msg_id: str) -> dict:
        while True:
            msg = self.kc.get_shell_msg(timeout=TIMEOUT)
            if msg["parent_header"].get("msg_id") == msg_id:
                return msg

    def close(self, now: bool = False) -> None:
        self.kc.stop_channels()
        if self.km.has_kernel:
            self.km.shutdown_kernel(now=now)


def summary(outputs: list[dict]) -> list[tuple]:
    """What a notebook keeps of a cell's outputs: type, stream name and text, text/plain,
    error name and value."""
    rows = []
    for m in outputs:
        t, c = m["msg_type"], m["content"]
        if t == "stream":
            rows.append((t, c["name"], c["text"]))
        elif t in ("execute_result", "display_data"):
            rows.append((t, c["data"].get("text/plain")))
        elif t == "error":
            rows.append((t, c["ename"], c["evalue"]))
    return rows


def stop_session(session: str) -> None:
    gpumagic_main(["kernel", "stop", "testgpu", "--name", session])


# -- kernelspecs ----------------------------------------------------------------------------


def test_install_list_uninstall_writes_a_0644_kernelspec_without_secrets(jupyter_dirs, capsys, sshd):
    assert gpumagic_main(["kernel", "install", "testgpu", "--python", PY]) == 0
    assert gpumagic_main(["kernel", "install", "testgpu", "--name", "kb-other"]) == 0
    folder = jupyter_dirs / "kernels" / "gpumagic-testgpu"
    files = sorted(folder.iterdir())
    assert [f.name for f in files] == ["kernel.json"]
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o644
    spec = json.loads(files[0].read_text(encoding="utf-8"))
    assert spec["display_name"] == "Python 3 on testgpu (gpumagic)"
    assert spec["interrupt_mode"] == "message"
    assert spec["argv"][1:5] == ["-m", "gpumagic.kernel_bridge", "-f", "{connection_file}"]
    assert spec["metadata"]["gpumagic"]["shutdown"].startswith("detach")
    text = files[0].read_text(encoding="utf-8") + (jupyter_dirs / "kernels" / "gpumagic-testgpu-kb-other" /
                                                  "kernel.json").read_text(encoding="utf-8")
    # nothing that opens the machine: no key file, no token, no private key text
    assert "client_ed25519" not in text and "PRIVATE KEY" not in text and "token" not in text
    capsys.readouterr()
    assert gpumagic_main(["kernel", "list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in listed] == ["gpumagic-testgpu", "gpumagic-testgpu-kb-other"]
    assert "Python 3 on testgpu:kb-other (gpumagic)" in listed[1]
    assert gpumagic_main(["kernel", "uninstall", "testgpu"]) == 0
    assert not folder.exists()
    assert gpumagic_main(["kernel", "uninstall", "nosuch"]) == 1
    assert "no gpumagic kernelspec 'nosuch' is installed (installed: gpumagic-testgpu-kb-other)" in capsys.readouterr().err


def test_install_sandbox_and_a_host_that_cannot_name_a_kernelspec(jupyter_dirs, capsys):
    assert gpumagic_main(["kernel", "install", "--sandbox"]) == 0
    spec = json.loads((jupyter_dirs / "kernels" / "gpumagic-sandbox" / "kernel.json").read_text(encoding="utf-8"))
    assert "--sandbox" in spec["argv"] and spec["display_name"] == "Python 3 on sandbox (gpumagic)"
    assert gpumagic_main(["kernel", "install", "root@203.0.113.10:41022"]) == 0
    assert (jupyter_dirs / "kernels" / "gpumagic-root-203.0.113.10-41022").is_dir()
    capsys.readouterr()
    assert gpumagic_main(["kernel", "install", "@@@"]) == 1
    assert "'@@@' cannot name a kernelspec" in capsys.readouterr().err
    assert gpumagic_main(["kernel", "uninstall", "--sandbox"]) == 0  # as install and stop take it
    assert not (jupyter_dirs / "kernels" / "gpumagic-sandbox").exists()


def _spec_json(jupyter_dirs: Path, name: str) -> dict:
    return json.loads((jupyter_dirs / "kernels" / name / "kernel.json").read_text(encoding="utf-8"))


def test_gpu_kernel_install_writes_for_the_connected_machine_what_the_cli_writes(ip, jupyter_dirs, capsys, sshd,
                                                                                tmp_path, monkeypatch):
    ip.run_line_magic("gpu", "connect testgpu --name box")
    capsys.readouterr()
    ip.run_line_magic("gpu", f"kernel install --name kb-m --python {PY}")
    said = capsys.readouterr().out
    assert said.startswith("installed kernelspec gpumagic-testgpu-kb-m (Python 3 on testgpu:kb-m (gpumagic)) in ")
    assert "`gpumagic kernel stop testgpu --name kb-m` stops the session" in said
    by_magic = _spec_json(jupyter_dirs, "gpumagic-testgpu-kb-m")
    assert by_magic["argv"][-6:] == ["--host", "testgpu", "--session", "kb-m", "--python", PY]
    ip.run_line_magic("gpu", "kernel list --kernelspecs")
    listed = capsys.readouterr().out
    assert gpumagic_main(["kernel", "list"]) == 0
    assert listed == capsys.readouterr().out and listed.startswith("gpumagic-testgpu-kb-m  ")
    # without KERNELSPEC: the current machine's session --name
    ip.run_line_magic("gpu", "kernel uninstall --name kb-m")
    assert capsys.readouterr().out.startswith("removed kernelspec gpumagic-testgpu-kb-m (")
    assert not (jupyter_dirs / "kernels" / "gpumagic-testgpu-kb-m").exists()
    assert gpumagic_main(["kernel", "install", "testgpu", "--name", "kb-m", "--python", PY]) == 0
    assert _spec_json(jupyter_dirs, "gpumagic-testgpu-kb-m") == by_magic  # the same code path
    # HOST: a connected machine's name (as the bridge can reach it), else the text given
    ip.run_line_magic("gpu", "kernel install box --display-name 'my box'")
    assert _spec_json(jupyter_dirs, "gpumagic-testgpu")["display_name"] == "my box"
    with monkeypatch.context() as mp:  # --sys-prefix: this environment's, here not the venv's
        mp.setattr(sys, "prefix", str(tmp_path / "env"))
        ip.run_line_magic("gpu", "kernel install root@203.0.113.10:41022 --sys-prefix")
    assert (tmp_path / "env" / "share" / "jupyter" / "kernels" / "gpumagic-root-203.0.113.10-41022").is_dir()
    ip.run_line_magic("gpu", "kernel uninstall testgpu")
    capsys.readouterr()
    ip.run_line_magic("gpu", "kernel list --kernelspecs")
    assert capsys.readouterr().out.splitlines() == ["gpumagic-testgpu-kb-m  Python 3 on testgpu:kb-m (gpumagic)  "
                                                    f"(testgpu:kb-m)  {jupyter_dirs / 'kernels' / 'gpumagic-testgpu-kb-m'}"]


def test_gpu_kernel_install_refuses_what_a_kernelspec_cannot_reach_and_takes_the_sandbox(ip, jupyter_dirs, sshd):
    # connected by options ~/.ssh/config does not hold: no name reaches it, the line says how to make one
    ip.run_line_magic("gpu", f"connect {sshd.user}@{sshd.host} -p {sshd.port} -i {sshd.client_key} --name raw")
    with pytest.raises(UsageError) as e:
        ip.run_line_magic("gpu", "kernel install")
    assert type(e.value) is UsageError and str(e.value).startswith(
        "raw was connected with options ~/.ssh/config does not hold") and "--save NAME" in str(e.value)
    for line, says in [("kernel install --name ../x", "cannot name a session"),
                       ("kernel install testgpu --sandbox", "give either HOST or --sandbox, not both"),
                       ("kernel list --kernelspecs --host raw", "leave out --host")]:
        with pytest.raises(UsageError) as e:
            ip.run_line_magic("gpu", line)
        assert says in str(e.value), line
    assert not (jupyter_dirs / "kernels").exists()  # nothing written by a refused line
    ip.run_line_magic("gpu", "kernel install --sandbox")
    spec = _spec_json(jupyter_dirs, "gpumagic-sandbox")
    assert spec["argv"][-5:] == ["--sandbox", "--session", "main", "--python", PY]
    # a connected sandbox is the sandbox kernelspec; one with a home of its own has none
    ip.run_line_magic("gpu", "connect --sandbox")
    ip.run_line_magic("gpu", "kernel install --name kb-sb")
    assert _spec_json(jupyter_dirs, "gpumagic-sandbox-kb-sb")["argv"][-5:] == ["--sandbox", "--session", "kb-sb",
                                                                               "--python", PY]
    ip.run_line_magic("gpu", "connect --sandbox --name other")
    with pytest.raises(UsageError) as e:
        ip.run_line_magic("gpu", "kernel install")
    assert str(e.value).startswith("other is a sandbox with a home of its own")
    ip._gpumagic.fleet.close_all()
    with pytest.raises(GpumagicError) as e:
        ip.run_line_magic("gpu", "kernel install")
    assert "no machine is connected" in str(e.value)


# -- the bridge -----------------------------------------------------------------------------


CELLS = [
    "x = 41",
    "print(x + 1)",
    "x * 2",
    "import sys; print('warn', file=sys.stderr)",
    "1 / 0",
    "from IPython.display import display, Markdown\ndisplay(Markdown('**hi**'))",
]


def test_execute_gives_what_a_local_ipykernel_gives(jupyter_dirs, sshd):
    name = install("kb1")
    bridge, local = Frontend(name), Frontend("python3")
    try:
        info = bridge.kc.kernel_info(reply=True, timeout=TIMEOUT)["content"]
        assert info["language_info"]["name"] == "python" and info["implementation"] == "ipython"
        for code in CELLS:
            (r1, o1), (r2, o2) = bridge.run(code), local.run(code)
            assert summary(o1) == summary(o2), code
            assert r1["content"]["status"] == r2["content"]["status"]
            assert r1["content"]["execution_count"] == r2["content"]["execution_count"], code
        # complete, inspect, is_complete, history go to the machine's kernel
        c = bridge.kc.complete("import o", reply=True, timeout=TIMEOUT)["content"]
        assert "os" in c["matches"]
        i = bridge.kc.inspect("len", reply=True, timeout=TIMEOUT)["content"]
        assert i["found"] and "Return the number of items" in i["data"]["text/plain"]
        assert bridge.reply(bridge.kc.is_complete("for i in x:"))["content"]["status"] == "incomplete"
        h = bridge.kc.history(hist_access_type="tail", n=3, reply=True, timeout=TIMEOUT)["content"]
        assert h["status"] == "ok"
        # the heartbeat channel is answered (what a front end that watches it sees alive)
        if not bridge.kc.hb_channel.is_alive():
            bridge.kc.hb_channel.start()
        assert wait_until(bridge.kc.hb_channel.is_beating, 10)
    finally:
        bridge.close()
        local.close()
        stop_session("kb1")


def test_a_killed_bridge_leaves_the_cell_running_and_the_next_one_delivers_its_output_once(jupyter_dirs, sshd):
    name = install("kb2")
    fe = Frontend(name)
    try:
        fe.run("x = 'kept'")
        code = "import time\nfor i in range(12):\n    print(f'line {i}', flush=True)\n    time.sleep(0.25)"
        msg_id = fe.kc.execute(code)
        seen: list[str] = []
        deadline = time.monotonic() + TIMEOUT
        while not any("line 3" in t for t in seen) and time.monotonic() < deadline:
            msg = fe.kc.get_iopub_msg(timeout=TIMEOUT)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
                seen.append(msg["content"]["text"])
        os.kill(fe.pid, signal.SIGKILL)  # the front end's kernel process dies mid-cell
        fe.km.provisioner.process.wait(10)
        fe.kc.stop_channels()
        time.sleep(1.0)  # lines printed while nothing is attached
        fe2 = Frontend(name, flush=False)  # a front end that shows what comes from the start
        try:
            rest = fe2.iopub_until_idle(msg_id)
            seen += [m["content"]["text"] for m in rest if m["msg_type"] == "stream"]
            lines = "".join(seen).splitlines()
            assert lines == [f"line {i}" for i in range(12)]
            _, out = fe2.run("print(x)")
            assert summary(out) == [("stream", "stdout", "kept\n")]
        finally:
            fe2.close()
    finally:
        stop_session("kb2")


def test_after_a_reload_gpu_kernel_attach_shows_the_running_cells_output_from_its_first_line_once(jupyter_dirs, sshd):
    # a reloaded JupyterLab page is a new client of the same bridge (a new session id): the
    # old cell's output, which it drops, is shown in its cell `%gpu kernel attach`
    name = install("kb-re")
    fe = Frontend(name)
    page = None
    try:
        _, out = fe.run("%gpu kernel attach")
        assert summary(out) == [("stream", "stderr", "[gpumagic: no cell of session kb-re has run since this "
                                                     "kernel started]\n")]
        fe.run("x = 5")
        code = "import time\nfor i in range(8):\n    print(f'r {i}', flush=True)\n    time.sleep(0.4)"
        msg_id = fe.kc.execute(code)
        before: list[str] = []
        while len(before) < 2:
            msg = fe.kc.get_iopub_msg(timeout=TIMEOUT)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
                before.append(msg["content"]["text"])
        page = fe.km.client(session=Session(key=fe.km.session.key))
        page.start_channels()
        assert page.session.session != fe.kc.session.session
        # as JupyterLab, nothing before the kernel_info_reply, which the bridge gives while the
        # machine's kernel runs the cell (the attach below then finds it running)
        info = page.kernel_info(reply=True, timeout=TIMEOUT)["content"]
        assert info["language_info"]["name"] == "python" and info["implementation"] == "ipython"
        attach_id = page.execute("%gpu kernel attach")
        shown, ended_first = [], None
        deadline = time.monotonic() + TIMEOUT
        while True:
            msg = page.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            parent = msg["parent_header"].get("msg_id")
            if parent == msg_id and msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                ended_first = len(shown)  # the old cell's end, seen by the page too
            if parent != attach_id:
                continue
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
            if msg["msg_type"] == "stream":
                shown.append((msg["content"]["name"], msg["content"]["text"]))
        reply = page.get_shell_msg(timeout=TIMEOUT)
        assert reply["parent_header"]["msg_id"] == attach_id and reply["content"]["status"] == "ok"
        assert shown[0] == ("stderr", "[gpumagic: In [2] is running: its output from the first line]\n")
        assert "".join(t for n, t in shown[1:] if n == "stdout") == "".join(f"r {i}\n" for i in range(8))
        assert [n for n, _ in shown[1:]] == ["stdout"] * (len(shown) - 1)
        assert ended_first == len(shown)  # it followed the cell to its end, and ended with it
        # once the cell ended: its whole output again, said so; the session and x are there
        _, out = fe.run("%gpu kernel attach")
        rows = summary(out)
        assert rows[0] == ("stream", "stderr", "[gpumagic: In [2] ended: its output from the first line]\n")
        assert "".join(r[2] for r in rows[1:]) == "".join(f"r {i}\n" for i in range(8))
        assert summary(fe.run("print(x)")[1]) == [("stream", "stdout", "5\n")]
    finally:
        if page is not None:
            page.stop_channels()
        fe.close()
        stop_session("kb-re")


def test_a_cells_kept_output_drops_its_oldest_beyond_the_limit_and_a_clear_output_empties_it(monkeypatch):
    from gpumagic.kernel_bridge import bridge

    monkeypatch.setattr(bridge, "CELL_OUTPUT_KEPT", 100)
    cell = bridge.CellRecord(3)
    for i in range(10):  # 50 bytes of JSON each
        cell.add("stream", {"name": "stdout", "text": f"line {i:02d} ".ljust(20, ".")}, {})
    assert [o[1]["text"][:7] for o in cell.outputs] == ["line 08", "line 09"]
    assert (cell.size, cell.dropped) == (100, 8)
    cell.add("clear_output", {"wait": False}, {})
    assert (list(cell.outputs), cell.size, cell.dropped) == ([], 0, 0)


def test_interrupt_reaches_a_busy_loop_and_restart_gives_a_new_namespace(jupyter_dirs, sshd):
    name = install("kb3")
    fe = Frontend(name)
    try:
        fe.run("y = 5")
        msg_id = fe.kc.execute("while True:\n    pass")
        time.sleep(1.0)
        fe.km.interrupt_kernel()
        out = fe.iopub_until_idle(msg_id)
        assert [m["content"]["ename"] for m in out if m["msg_type"] == "error"] == ["KeyboardInterrupt"]
        assert fe.reply(msg_id)["content"]["status"] == "error"
        _, out = fe.run("print(y)")
        assert summary(out) == [("stream", "stdout", "5\n")]
        fe.km.restart_kernel()
        # a new client, as a front end reconnects after a restart (ZeroMQ's SUB socket does not
        # subscribe again to the new kernel process's iopub; the bridge holds iopub until one does)
        fe.kc.stop_channels()
        fe.kc = fe.km.client()
        fe.kc.start_channels()
        fe.kc.wait_for_ready(timeout=TIMEOUT)
        _, out = fe.run("print('y' in globals())")
        assert summary(out) == [("stream", "stdout", "False\n")]
    finally:
        fe.close()
        stop_session("kb3")


def test_a_restart_whose_front_end_keeps_its_sockets_is_ready_with_a_fresh_namespace(jupyter_dirs, sshd):
    """As jupyter_client's own restart_kernel leaves it (and a trial found hanging for 120 s):
    the same client, its SUB socket's subscription not heard by the new process; the bridge
    publishes once the front end asks on shell (SUBSCRIBED_AFTER), as ipykernel always does."""
    name = install("kbr")
    fe = Frontend(name)
    try:
        fe.run("y = 5")
        fe.km.restart_kernel()
        fe.kc.wait_for_ready(timeout=TIMEOUT)
        _, out = fe.run("print('y' in globals())")
        assert summary(out) == [("stream", "stdout", "False\n")]
    finally:
        fe.close()
        stop_session("kbr")


def test_input_reaches_the_front_end_and_its_answer_the_machine(jupyter_dirs, sshd):
    name = install("kb4")
    fe = Frontend(name)
    try:
        msg_id = fe.kc.execute("name = input('who? ')\nprint('hello', name)", allow_stdin=True)
        req = fe.kc.get_stdin_msg(timeout=TIMEOUT)
        assert req["msg_type"] == "input_request" and req["content"]["prompt"] == "who? "
        assert req["parent_header"]["msg_id"] == msg_id
        fe.kc.input("ada")
        out = fe.iopub_until_idle(msg_id)
        assert ("stream", "stdout", "hello ada\n") in summary(out)
    finally:
        fe.close()
        stop_session("kb4")


def test_a_front_ends_shutdown_detaches_leaving_a_running_cell_and_gpu_magics_run_on_the_laptop(jupyter_dirs, sshd):
    name = install("kb5")
    fe = Frontend(name)
    try:
        fe.run("z = 7")
        reply, out = fe.run("%gpu kernel list")
        assert reply["content"]["status"] == "ok"
        text = "".join(r[2] for r in summary(out) if r[0] == "stream") + "".join(
            str(r[1]) for r in summary(out) if r[0] == "display_data")
        assert "kb5" in text
        reply, out = fe.run("%gpu nosuchsub")
        assert reply["content"]["status"] == "error"
        # a front end's shutdown (jupyter_client interrupts first, then asks to shut down)
        # while a cell runs: the session and the cell are kept
        msg_id = fe.kc.execute("import time\nfor i in range(6):\n    print(f'n {i}', flush=True)\n    time.sleep(0.3)")
        seen: list[str] = []
        while not seen:
            msg = fe.kc.get_iopub_msg(timeout=TIMEOUT)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
                seen.append(msg["content"]["text"])
        fe.close()
        assert wait_until(lambda: not fe.km.has_kernel, 10)
        fe = Frontend(name, flush=False)
        rest = fe.iopub_until_idle(msg_id)
        assert [m for m in rest if m["msg_type"] == "error"] == []
        assert "".join(seen + [m["content"]["text"] for m in rest if m["msg_type"] == "stream"]) == \
            "".join(f"n {i}\n" for i in range(6))
        _, out = fe.run("print(z)")
        assert summary(out) == [("stream", "stdout", "7\n")]
    finally:
        fe.close()
        stop_session("kb5")


def test_a_roam_mid_cell_is_made_good_by_itself_every_line_once_and_no_error(jupyter_dirs, make_link, client_home):
    linked = make_link(rtt_ms=40, connect=False)
    config = client_home / ".ssh" / "config"
    config.write_text(config.read_text(encoding="utf-8") + "\n" + linked.ssh_config_block("kbroam"), encoding="utf-8")
    assert gpumagic_main(["kernel", "install", "kbroam", "--name", "kb6", "--python", PY]) == 0
    fe = Frontend("gpumagic-kbroam-kb6")
    try:
        fe.run("x = 1")
        code = "import time\nfor i in range(16):\n    print(f'line {i}', flush=True)\n    time.sleep(0.25)"
        msg_id = fe.kc.execute(code)
        roamed: list[int] = []

        def roam_after_line_2(msg):
            if not roamed and msg["msg_type"] == "stream" and "line 2" in msg["content"]["text"]:
                roamed.append(linked.roam())

        out = fe.iopub_until_idle(msg_id, on_msg=roam_after_line_2)
        assert roamed == [1]
        assert "".join(r[2] for r in summary(out) if r[0] == "stream").splitlines() == [f"line {i}" for i in range(16)]
        assert [m for m in out if m["msg_type"] == "error"] == []
        assert fe.reply(msg_id)["content"]["status"] == "ok"
        _, out = fe.run("print(x)")
        assert summary(out) == [("stream", "stdout", "1\n")]
    finally:
        fe.close()
        gpumagic_main(["kernel", "stop", "kbroam", "--name", "kb6"])


def test_comm_messages_go_both_ways_and_do_not_hold_the_next_cell(jupyter_dirs, sshd):
    name = install("kb7")
    fe = Frontend(name)
    try:
        reply, _ = fe.run("def echo(comm, open_msg):\n"
                          "    comm.on_msg(lambda m: comm.send({'echo': m['content']['data']['v'] * 2}))\n"
                          "get_ipython().kernel.comm_manager.register_target('echo', echo)")
        assert reply["content"]["status"] == "ok"
        s = fe.kc.session
        fe.kc.shell_channel.send(s.msg("comm_open", {"comm_id": "c1", "target_name": "echo", "data": {}}))
        fe.kc.shell_channel.send(s.msg("comm_msg", {"comm_id": "c1", "data": {"v": 21}}))
        deadline = time.monotonic() + TIMEOUT
        got = None
        while got is None and time.monotonic() < deadline:
            msg = fe.kc.get_iopub_msg(timeout=TIMEOUT)
            if msg["msg_type"] == "comm_msg" and msg["content"]["comm_id"] == "c1":
                got = msg["content"]["data"]
        assert got == {"echo": 42}
        # no reply comes to a comm message: a %gpu cell after it does not wait for one
        reply, _ = fe.run("%gpu kernel list")
        assert reply["content"]["status"] == "ok"
    finally:
        fe.close()
        stop_session("kb7")


def test_the_sandbox_kernelspec_runs_a_cell_on_the_sandbox_and_kernel_stop_ends_the_session(jupyter_dirs, monkeypatch):
    from gpumagic.ssh import sandbox

    monkeypatch.setenv("GPUMAGIC_SANDBOX_IDLE_STOP", "60")  # none outlives the test by long
    assert gpumagic_main(["kernel", "install", "--sandbox", "--name", "kb8", "--python", PY]) == 0
    fe = Frontend("gpumagic-sandbox-kb8")
    folder = sandbox.sandbox_home() / ".gpumagic" / "kernels" / "kb8"
    try:
        _, out = fe.run("import os; print(os.environ['HOME'])")
        assert summary(out) == [("stream", "stdout", f"{sandbox.sandbox_home()}\n")]
        assert (folder / "state.json").exists()
        fe.close()  # detach: the bridge's sandbox sshd ends with it, the session does not
        assert (folder / "state.json").exists()
    finally:
        fe.close()
        assert gpumagic_main(["kernel", "stop", "--sandbox", "--name", "kb8"]) == 0
    assert not folder.exists()


# -- a tutorial's cells under the bridge and under a local ipykernel -------------------------


def _session_cells(tutorial: Path) -> list[str]:
    """The bodies of the tutorial's ``%%remote --kernel`` cells: what ran in its session."""
    import nbformat

    nb = nbformat.read(tutorial, as_version=4)
    head = "%%remote --kernel\n"
    return [c.source[len(head):] for c in nb.cells if c.cell_type == "code" and c.source.startswith(head)]


def _kept(outputs: list) -> list[tuple]:
    """What to compare of a cell's outputs: type, stream name and its text's last line (tqdm's
    bar before it holds rates that differ run to run), text/plain, the MIME types, error name."""
    rows = []
    for o in outputs:
        if o.output_type == "stream":
            rows.append((o.output_type, o.name, o.text.rstrip("\n").split("\r")[-1].splitlines()[-1]
                         if o.name == "stdout" else "training: 100%" in o.text))
        elif o.output_type in ("execute_result", "display_data"):
            plain = o.data.get("text/plain", "")
            rows.append((o.output_type, sorted(o.data), "" if plain.startswith("<Figure") else plain))
        elif o.output_type == "error":
            rows.append((o.output_type, o.ename))
    return rows


#: What kernel_startup.py does to a session's tqdm.auto, for a local ipykernel.
TEXT_TQDM = ("import sys, types, tqdm.std\n"
             "m = types.ModuleType('tqdm.autonotebook'); m.tqdm, m.trange = tqdm.std.tqdm, tqdm.std.trange\n"
             "sys.modules['tqdm.autonotebook'] = m")


def test_tutorial_07s_session_cells_under_nbclient_give_what_a_local_ipykernel_gives(jupyter_dirs, tmp_path, sshd):
    import nbformat
    from nbclient import NotebookClient

    from gpumagic.__main__ import join_streams

    cells = _session_cells(Path(__file__).resolve().parent.parent / "example-notebooks" / "07-remote-python-session.ipynb")
    assert len(cells) >= 4
    cells.append("undefined_name")  # and an error, as a notebook shows it
    name = install("kb9")
    runs = {}
    try:
        for kernel in (name, "python3"):
            nb = nbformat.v4.new_notebook()
            nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
            if kernel == "python3":  # the session's start-up rule (kernel_startup.py): tqdm.auto's text bar
                nb.cells.insert(0, nbformat.v4.new_code_cell(TEXT_TQDM))
            if kernel == name:
                nb.cells.append(nbformat.v4.new_code_cell("%gpu kernel list"))
            NotebookClient(nb, timeout=120, kernel_name=kernel, allow_errors=True,
                           resources={"metadata": {"path": str(tmp_path)}}).execute()
            runs[kernel] = nb
    finally:
        stop_session("kb9")
    bridge, local = runs[name], runs["python3"]
    local.cells = local.cells[1:]
    for b, lo in zip(bridge.cells, local.cells):
        assert _kept(join_streams(b.outputs)) == _kept(join_streams(lo.outputs)), b.source
        assert b.execution_count == lo.execution_count - 1  # (the local run's first cell is TEXT_TQDM)
    assert any("image/png" in o.get("data", {}) for c in bridge.cells for o in c.outputs)
    magic = bridge.cells[-1].outputs
    assert magic and not any(o.output_type == "error" for o in magic)


def test_a_session_stopped_under_an_attached_bridge_is_started_again_only_by_the_next_cell(jupyter_dirs, sshd):
    name = install("kb10")
    fe = Frontend(name)
    folder = Path(sshd.env["HOME"]) / ".gpumagic" / "kernels" / "kb10"
    try:
        fe.run("x = 1")
        stop_session("kb10")
        assert not folder.exists()
        time.sleep(2.0)  # the bridge heard of it: it starts nothing by itself
        assert not folder.exists()
        _, out = fe.run("print('x' in globals())")
        assert summary(out) == [("stream", "stdout", "False\n")]
        assert folder.exists()
    finally:
        fe.close()
        stop_session("kb10")


# -- tutorial 11 ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["11-kernel-from-the-list.ipynb", "zh-CN/11-kernel-from-the-list.ipynb"])
def test_tutorial_11_closes_the_notebook_mid_cell_and_the_reopened_one_shows_the_rest_once(executed, name):
    nb = executed[name]
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]

    def text(cell):
        return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")

    assert "installed kernelspec gpumagic-sandbox (Python 3 on sandbox (gpumagic))" in text(code[0])
    before, after = text(code[2]), text(code[3])
    assert before.endswith("-- the notebook was closed mid-cell --\n")
    steps = [ln for ln in (before + after).splitlines() if ln.startswith("step ")]
    assert steps == [f"step {i}" for i in range(8)]  # each once, in order, across the close
    assert after.endswith("\n42\n")
    assert "main *" in text(code[4])  # %gpu kernel list ran on the laptop
    assert "stopped session main on sandbox" in text(code[5])
    assert "removed kernelspec gpumagic-sandbox" in text(code[5])


def test_a_machine_that_cannot_be_reached_gives_a_ready_kernel_whose_cells_say_why(jupyter_dirs, client_home):
    from gpumagic.ssh.sandbox import free_port

    config = client_home / ".ssh" / "config"
    config.write_text(config.read_text(encoding="utf-8") + f"\nHost kbdown\n  HostName 127.0.0.1\n  Port {free_port()}\n",
                      encoding="utf-8")
    assert gpumagic_main(["kernel", "install", "kbdown"]) == 0
    fe = Frontend("gpumagic-kbdown")  # ready: the editor is not left waiting for a kernel
    try:
        reply, out = fe.run("1 + 1")
        assert reply["content"]["status"] == "error"
        (err,) = [m["content"] for m in out if m["msg_type"] == "error"]
        assert err["ename"] == "ConnectionRefused"
        assert err["evalue"].startswith("cannot reach kbdown: connection refused by 127.0.0.1:")
        assert err["traceback"] == [f"ConnectionRefused: {err['evalue']}"]  # what to do, not a traceback
        assert "\n  hint: check the port" in err["evalue"]
    finally:
        fe.close(now=True)


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_bridge_whose_front_end_was_killed_detaches_and_ends(jupyter_dirs, sshd):
    # a front end killed with SIGKILL never sends shutdown_request: the bridge notices that
    # its parent is gone (as ipykernel's parent poller does) and ends; the session runs on
    import subprocess

    name = install("kbparent")
    front = subprocess.Popen(
        [PY, "-c", "import time\nfrom jupyter_client import KernelManager\n"
                   f"km = KernelManager(kernel_name={name!r})\nkm.start_kernel()\n"
                   "kc = km.client()\nkc.start_channels()\nkc.wait_for_ready(timeout=60)\n"
                   "print(km.provisioner.process.pid, flush=True)\ntime.sleep(600)"],
        stdout=subprocess.PIPE, text=True, encoding="utf-8")
    try:
        bridge = int(front.stdout.readline())
        assert _running(bridge)
        front.kill()
        front.wait()
        assert wait_until(lambda: not _running(bridge), 15)
    finally:
        front.kill()
        stop_session("kbparent")
