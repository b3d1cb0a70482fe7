"""Where a session's output goes (:class:`Output`: printed, or displayed by the magics)
and what one cell did (:class:`ExecuteResult`)."""

from __future__ import annotations

import builtins
import getpass
import sys
from dataclasses import dataclass, field

from ...errors import KernelError, RemoteKernelError


class Output:
    """Receives a kernel's output; :class:`TextOutput` prints, the magics display.

    Methods are called on the caller's thread, in the order the kernel sent the messages.
    """

    def stream(self, name: str, text: str) -> None:
        """``name`` is ``stdout`` or ``stderr``; ``text`` may hold ``\\r`` (progress bars)."""

    def display(self, data: dict, metadata: dict, display_id: str | None = None,
                update: bool = False) -> None:
        """A MIME bundle (``display_data`` or, with ``update``, ``update_display_data``)."""

    def result(self, data: dict, metadata: dict) -> None:
        """The cell's value (``execute_result``: its last expression, what a local kernel
        shows as ``Out[n]``).  By default it is displayed like any bundle; the notebook's
        output returns it from the magic instead, so that IPython shows it as this cell's
        own result (see :class:`RemoteValue`)."""
        self.display(data, metadata)

    def clear(self, wait: bool = False) -> None:
        """``clear_output``."""

    def page(self, data: dict) -> None:
        """A pager payload of the cell's execute_reply (``len?``, ``%pinfo``, ``%page``): a
        MIME bundle (``text/plain``, maybe ``text/html``) that IPython shows in its pager.
        By default it is displayed like any bundle."""
        self.display(data, {})

    def note(self, text: str) -> None:
        """One of gpumagic's own lines (not the cell's output)."""

    def comm(self, kernel, kind: str, content: dict, metadata: dict, buffers: list) -> None:
        """A comm message of the session (``comm_open``, ``comm_msg``, ``comm_close``): a
        widget made, changed or closed on the machine.  Dropped by default; the notebook's
        output passes it to the front end (:mod:`gpumagic.notebook.comms`)."""

    def request_id(self) -> str | None:
        """The id to give the session's request, when the caller has one of its own (the
        notebook's message that runs this cell); None: a new one."""
        return None

    def ask(self, prompt: str, password: bool = False) -> str:
        """Answer the machine's ``input()`` / ``getpass()``."""
        return getpass.getpass(prompt) if password else builtins.input(prompt)


class TextOutput(Output):
    """Print to this process's stdout/stderr; rich output as its ``text/plain``."""

    def __init__(self, stdout=None, stderr=None):
        self._out, self._err = stdout, stderr

    def stream(self, name: str, text: str) -> None:
        f = (self._err or sys.stderr) if name == "stderr" else (self._out or sys.stdout)
        f.write(text)
        f.flush()

    def display(self, data, metadata, display_id=None, update=False) -> None:
        text = data.get("text/plain")
        kinds = ", ".join(k for k in data if k != "text/plain")
        self.stream("stdout", (text if text is not None else f"<{kinds}>") + "\n")

    def note(self, text: str) -> None:
        self.stream("stderr", text + "\n")


class _Quiet(Output):
    def ask(self, prompt, password=False):
        raise KernelError("gpumagic's own request asked for input", "")


def default_output() -> Output:
    """Where a session's output goes when its caller names none: printed.  The notebook's
    magics hand in their own (:attr:`gpumagic.remote.kernel.Kernels.output`), so that a machine
    connected by ``%gpu connect`` displays its sessions' rich output in the notebook."""
    return TextOutput()


# -- results --------------------------------------------------------------------------------


class RemoteValue:
    """A cell's value on the machine, as this notebook shows it: the ``execute_result``
    bundle the session sent, given back through ``_repr_mimebundle_``.

    ``%%remote --kernel`` returns one, so IPython's display hook shows it as the cell's own
    result: an ``execute_result`` with this notebook's execution count (``Out[n]``), the
    same MIME bundle the machine made, and ``_``/``Out[n]`` set here to this object (the value
    itself stays on the machine: ``%gpu kernel pull`` copies it).
    """

    def __init__(self, data: dict, metadata: dict | None = None):
        self.data = dict(data)
        self.metadata = dict(metadata or {})

    def _repr_mimebundle_(self, include=None, exclude=None):
        return self.data, self.metadata

    def __repr__(self) -> str:
        text = self.data.get("text/plain")
        return text if text is not None else f"<{', '.join(self.data)}>"


@dataclass
class ExecuteResult:
    """What one cell did on the machine.

    Attributes
    ----------
    status : str
        ``ok``, ``error`` or ``aborted`` (Jupyter's execute_reply status).
    execution_count : int or None
        The kernel's ``In [N]``.
    error : RemoteKernelError or None
        The remote exception (ename, evalue, traceback).
    stdout, stderr : str
        The cell's printed text (empty unless captured).
    outputs : list of dict
        The MIME bundles displayed (``{"data": ..., "metadata": ...}``), when captured.
    result : dict or None
        The ``execute_result`` bundle (the last expression's value), when there is one.
    user_expressions : dict
        As in the execute_reply.
    seconds : float
        Wall time until the reply and all output arrived.
    """

    status: str = "ok"
    execution_count: int | None = None
    error: RemoteKernelError | None = None
    stdout: str = ""
    stderr: str = ""
    outputs: list = field(default_factory=list)
    result: dict | None = None
    user_expressions: dict = field(default_factory=dict)
    seconds: float = 0.0
    #: Text captured so far, by stream name, as chunks: joined once into ``stdout`` and
    #: ``stderr`` when the cell ends (appending to a growing string copies it each time).
    _chunks: dict = field(default_factory=lambda: {"stdout": [], "stderr": []}, repr=False,
                          compare=False)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def _collect(self, name: str, text: str) -> None:
        self._chunks["stderr" if name == "stderr" else "stdout"].append(text)

    def _join(self) -> None:
        """Set ``stdout`` and ``stderr`` from the chunks collected (once, at the end)."""
        for name, chunks in self._chunks.items():
            if chunks:
                setattr(self, name, getattr(self, name) + "".join(chunks))
                chunks.clear()

    def __repr__(self) -> str:
        return (f"ExecuteResult(status={self.status!r}, execution_count={self.execution_count}, "
                f"stdout={len(self.stdout)} chars, outputs={len(self.outputs)}, "
                f"seconds={self.seconds:.3f})")
