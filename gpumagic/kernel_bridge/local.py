"""``%gpu`` line magics in a cell of the bridge's kernel, run on the laptop.

A cell whose lines (comments and blank lines aside) are all ``%gpu ...`` line magics runs
here, in the bridge's own IPython shell with gpumagic loaded and this machine connected in
it, as under ``%gpu kernel autorun on``: ``%gpu status``, ``%gpu sync``, ``%gpu tunnel``,
``%gpu kernel list``, ``%gpu budget``... act on the laptop's side.  Any other cell runs on the
machine (``!nvidia-smi``, ``%timeit`` and ``%matplotlib`` too, where they mean something).
What it prints and displays goes to the front end as the cell's output; the cell keeps the
execution count of the machine's last cell.
"""

from __future__ import annotations

import contextlib
import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .bridge import Bridge


def gpu_lines(code: str) -> list[str]:
    """The cell's lines that are not blank or comments."""
    return [ln.strip() for ln in code.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def handles(code: str) -> bool:
    """Whether the cell runs here: every line that is not blank or a comment is ``%gpu``."""
    lines = gpu_lines(code)
    return bool(lines) and all(ln == "%gpu" or ln.startswith("%gpu ") for ln in lines)


def attaches(code: str, session: str) -> bool:
    """Whether the cell is ``%gpu kernel attach`` (or ``... attach SESSION`` for the bridge's
    own session): the bridge shows its running cell's output there (``Bridge.attach_cell``)."""
    lines = gpu_lines(code)
    words = lines[0].split() if len(lines) == 1 else []
    return words[:3] == ["%gpu", "kernel", "attach"] and words[3:] in ([], [session])


class _Stream:
    """A file-like whose writes are the cell's ``stream`` messages."""

    def __init__(self, send, name: str):
        self.send, self.name = send, name

    def write(self, text: str) -> int:
        if text:
            self.send("stream", {"name": self.name, "text": text})
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


class LocalMagics:
    """The bridge's IPython shell, made on the first ``%gpu`` cell."""

    def __init__(self, bridge: Bridge):
        self.bridge = bridge
        self.shell = None
        self._send = None

    def _make_shell(self):
        from IPython.core.displaypub import DisplayPublisher
        from IPython.core.interactiveshell import InteractiveShell

        outer = self

        class Publisher(DisplayPublisher):
            def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kw):
                content = {"data": data, "metadata": metadata or {}, "transient": transient or {}}
                outer._send("update_display_data" if update else "display_data", content)

            def clear_output(self, wait=False):
                outer._send("clear_output", {"wait": wait})

        shell = InteractiveShell.instance()
        shell.run_line_magic("load_ext", "gpumagic")
        shell.display_pub = Publisher(shell=shell)
        if self.bridge.machine is not None:
            shell._gpumagic.fleet.add(self.bridge.machine)
        return shell

    def execute(self, idents: list[bytes], header: dict, content: dict) -> None:
        b = self.bridge
        code = content.get("code", "")
        count = b.execution_count
        silent = bool(content.get("silent"))

        def send(kind, c):
            if not silent:
                b.publish(kind, c, header)

        self._send = send
        b.publish("status", {"execution_state": "busy"}, header)
        b.publish("execute_input", {"code": code, "execution_count": count}, header)
        reply: dict = {"status": "ok", "execution_count": count, "user_expressions": {}, "payload": []}
        try:
            if self.shell is None:
                self.shell = self._make_shell()
            value = None
            with contextlib.redirect_stdout(_Stream(send, "stdout")), \
                    contextlib.redirect_stderr(_Stream(send, "stderr")):
                for line in gpu_lines(code):
                    value = self.shell.run_line_magic("gpu", line[len("%gpu"):].strip())
            if value is not None:
                data, md = self.shell.display_formatter.format(value)
                send("execute_result", {"data": data, "metadata": md, "execution_count": count})
        except Exception as e:  # noqa: BLE001 - the cell's error, shown as a cell's is
            render = getattr(e, "_render_traceback_", None)
            tb = render() if render is not None else (
                [f"{type(e).__name__}: {e}"] if type(e).__name__ == "UsageError"
                else traceback.format_exception(type(e), e, e.__traceback__))
            err = {"ename": type(e).__name__, "evalue": str(e), "traceback": tb}
            send("error", err)
            reply = {"status": "error", "execution_count": count, **err}
        b.reply("shell", idents, header, "execute_reply", reply)
        b.publish("status", {"execution_state": "idle"}, header)
