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
from jupyter_client import KernelManager

from gpumagic.__main__ import main as gpumagic_main


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
