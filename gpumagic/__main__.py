"""Command line: ``python -m gpumagic sandbox``, ``python -m gpumagic run-notebook`` and
``python -m gpumagic kernel ...`` (:mod:`gpumagic.kernel_bridge.cli`)."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from .errors import GpumagicError


def _sandbox(args) -> int:
    from .ssh.sandbox import Sandbox

    def stop(signum, frame):  # a closed terminal or `kill` stops the sandbox like Ctrl-C
        raise KeyboardInterrupt

    # SIGHUP (a closed terminal) is POSIX's; Windows has SIGTERM and Ctrl-C.
    for sig in (signal.SIGTERM, signal.SIGHUP) if hasattr(signal, "SIGHUP") else (signal.SIGTERM,):
        signal.signal(sig, stop)

    try:
        with Sandbox(fake_gpu=args.fake_gpu) as sb:  # leaving the block stops sshd
            s = sb.server
            print(f"sandbox sshd running at {s.host}:{s.port} as {s.user} (keys in {s.dir})",
                  flush=True)
            print("reach it with:\n  " + shlex.join(s.ssh_command()))
            print("or add to ~/.ssh/config:\n" + s.ssh_config_block())
            print("Ctrl-C stops it.", flush=True)
            while s.running:
                time.sleep(1)
    except KeyboardInterrupt:
        pass
    return 0


def run_notebook(path: str | Path, output_dir: str | Path, timeout: int = 600,
                 kernel_name: str = "python3") -> Path:
    """Execute a notebook with nbclient and write the executed copy; returns its path.

    Raises
    ------
    nbclient.exceptions.CellExecutionError
        When a cell fails (the executed copy is still written, with the error in it).
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    out = Path(output_dir) / path.name
    out.parent.mkdir(parents=True, exist_ok=True)
    from traitlets.config import Config

    # IPC sockets, not TCP on 127.0.0.1: the kernel is local, and over TCP ipykernel warns
    # "Kernel is running over TCP without encryption" into every run.
    # The socket files go in a short private directory (a Unix socket path has at most 107
    # bytes; the kernel runs in the notebook's folder, so the path must be absolute).
    sockets = tempfile.mkdtemp(prefix="gm-kernel-")
    config = Config({"KernelManager": {"transport": "ipc", "ip": os.path.join(sockets, "ipc")}})
    client = NotebookClient(nb, timeout=timeout, kernel_name=kernel_name, config=config,
                            resources={"metadata": {"path": str(path.parent)}})
    # The kernel's own stderr (ipykernel's logging, a traceback of its shutdown racing its
    # last status message) goes to a log, as a Jupyter server keeps it out of the notebook;
    # it is shown only when the kernel died.
    log = os.path.join(sockets, "kernel.log")
    # nbclient's SIGINT handler stays installed when the kernel fails to start: Ctrl-C in the
    # caller would do nothing afterwards; the caller's own handler is put back at the end
    ctrl_c = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    try:
        with open(log, "wb") as stderr:
            client.execute(stderr=stderr)
    except (DeadKernelError, AssertionError) as e:
        # nbclient's own SIGINT/SIGTERM handler shuts the kernel down (none is left
        # running); the cell then ends as a dead kernel, or its clean-up trips an assert
        if getattr(client, "_async_cleanup_kernel_future", None) is not None:
            raise KeyboardInterrupt from None
        if isinstance(e, AssertionError):
            raise
        last = _tail(log)
        raise DeadKernelError(f"{e}; its last words: {last}" if last else str(e)) from None
    finally:
        if ctrl_c is not None and signal.getsignal(signal.SIGINT) is not ctrl_c:
            signal.signal(signal.SIGINT, ctrl_c)
        for cell in nb.cells:
            if cell.get("outputs"):
                cell.outputs = join_streams(cell.outputs)
        nbformat.write(nb, out)
        shutil.rmtree(sockets, ignore_errors=True)
    return out


_CONTROL = re.compile(r"[\n\b\r]")


def process_text(index: int, text: str, prev: str = "") -> tuple[str, int]:
    """``text`` written into ``prev`` at ``index`` as JupyterLab's output area writes a stream
    message into the stream output before it (``processText`` in @jupyterlab/outputarea 4):
    ``\r`` goes back to the line's start, ``\b`` takes back a character, ``\n`` ends the line.
    Returns the text and where the next message writes."""
    if not _CONTROL.search(text):
        return prev[:index] + text + prev[index + len(text):], index + len(text)
    r, at = index, 0
    while True:
        m = _CONTROL.search(text, at)
        end = m.start() if m else len(text)
        seg = text[at:end]
        prev = prev[:r] + seg + prev[r + len(seg):]
        r += len(seg)
        if m is None:
            return prev, r
        at = end + 1
        ch = text[end]
        if ch == "\b":
            if r > 0 and prev[r - 1] != "\n":
                prev = prev[:r - 1] + prev[r + 1:]  # (as JupyterLab does: the character after goes too)
                r -= 1
        elif ch == "\r":
            while r > 0 and prev[r - 1] != "\n":
                r -= 1
        else:
            prev += "\n"
            r = len(prev)


def join_streams(outputs: list) -> list:
    """A cell's outputs as JupyterLab holds and saves them: consecutive stream outputs of one
    name (one per message, as nbclient saves them) are one, with ``\r`` and ``\b`` applied
    (:func:`process_text`); a non-stream output between two ends the first."""
    joined: list = []
    index = 0
    for o in outputs:
        if o.get("output_type") != "stream":
            joined.append(o)
            continue
        text = o["text"] if isinstance(o["text"], str) else "".join(o["text"])
        last = joined[-1] if joined else None
        if last is not None and last.get("output_type") == "stream" and last.get("name") == o.get("name"):
            last["text"], index = process_text(index, text, last["text"])
        else:
            o = type(o)(o)
            o["text"], index = process_text(0, text)
            joined.append(o)
    return joined


def _tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return " | ".join(f.read().splitlines()[-lines:])
    except OSError:
        return ""


def _failed_cell(executed: Path) -> str:
    """`` (code cell N, first line: ...)`` for the first cell of ``executed`` with an error
    output that is not tagged ``raises-exception``; empty when it cannot be told."""
    import nbformat

    try:
        nb = nbformat.read(executed, as_version=4)
    except Exception:
        return ""
    code = [c for c in nb.cells if c.cell_type == "code"]
    for n, c in enumerate(code, 1):
        if "raises-exception" in c.metadata.get("tags", []):
            continue
        if any(o.output_type == "error" for o in c.get("outputs", [])):
            first = next((ln for ln in c.source.splitlines() if ln.strip()), "")
            return f" (code cell {n}: {first[:60]})"
    return ""


def _running_cell(executed: Path) -> str:
    """`` (code cell N: first line)`` for the last code cell of ``executed`` that started (its
    execution count is set when it starts); empty when it cannot be told."""
    import nbformat

    try:
        nb = nbformat.read(executed, as_version=4)
    except Exception:
        return ""
    code = [c for c in nb.cells if c.cell_type == "code"]
    started = [n for n, c in enumerate(code, 1) if c.get("execution_count") is not None]
    if not started:
        return ""
    first = next((ln for ln in code[started[-1] - 1].source.splitlines() if ln.strip()), "")
    return f" (code cell {started[-1]}: {first[:60]})"


def _run_notebook(args) -> int:
    try:
        from nbclient.exceptions import CellExecutionError
    except ImportError:
        print("run-notebook needs nbclient and ipykernel: pip install 'gpumagic[notebook]'",
              file=sys.stderr)
        return 2
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    from nbformat.reader import NotJSONError

    notebook = Path(args.notebook)
    if not notebook.is_file():
        what = "is a directory, not a notebook" if notebook.is_dir() else "does not exist"
        raise GpumagicError(f"{args.notebook} {what}",
                            f"give the path of an .ipynb file (relative paths start at {Path.cwd()})")
    copy = Path(args.output_dir) / Path(args.notebook).name
    try:
        out = run_notebook(args.notebook, args.output_dir, timeout=args.timeout)
    except CellTimeoutError:  # a TimeoutError, so an OSError: before that
        print(f"a cell ran longer than --timeout {args.timeout} s{_running_cell(copy)}; it was stopped",
              file=sys.stderr)
        print(f"executed copy (up to there): {copy}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted; the notebook's kernel was shut down; executed copy (up to there): {copy}",
              file=sys.stderr)
        return 130
    except NotJSONError:
        raise GpumagicError(f"{args.notebook} is not a notebook (not JSON)",
                            "give the path of an .ipynb file saved by Jupyter") from None
    except OSError as e:  # an unreadable notebook, an output directory that cannot be written
        where = f" ({e.filename})" if e.filename else ""
        raise GpumagicError(f"cannot run {args.notebook}: {e.strerror or e}{where}",
                            "the notebook must be readable and --output-dir writable") from None
    except CellExecutionError as e:
        print(f"a cell failed{_failed_cell(copy)}: {e.ename}: {e.evalue}".rstrip(": "), file=sys.stderr)
        print(f"executed copy (with the error): {copy}", file=sys.stderr)
        return 1
    except DeadKernelError as e:  # a cell ended its Python (os._exit, a crash, out of memory)
        print(f"the notebook's kernel died while it ran {args.notebook}: {e}", file=sys.stderr)
        print(f"executed copy (up to there): {copy}", file=sys.stderr)
        return 1
    print(f"executed notebook written to {out.resolve()}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpumagic")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sandbox", help="run the local sandbox sshd until Ctrl-C")
    s.add_argument("--fake-gpu", metavar="RECORDING",
                   help="replay a recorded GPU through a stand-in nvidia-smi (h200-idle, h200-load)")
    s.set_defaults(func=_sandbox)
    r = sub.add_parser("run-notebook", help="execute a notebook and write the executed copy")
    r.add_argument("notebook", help="the .ipynb file to run (its cells run in its own folder)")
    r.add_argument("--output-dir", default="build/executed",
                   help="where the executed copy is written (default: build/executed)")
    r.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    r.set_defaults(func=_run_notebook)
    from .kernel_bridge import cli as kernel_cli

    kernel_cli.add_parser(sub)
    args = p.parse_args(argv)
    try:
        return args.func(args)
    except GpumagicError as e:
        print(f"gpumagic: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
