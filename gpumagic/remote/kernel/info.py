"""The sessions of a machine as the machine lists them: names, states, GPU memory
(``kernel_list.sh``, one round trip), and what a session may be called."""

from __future__ import annotations

import json
import re
import shlex
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import KernelError
from .link import program_text

if TYPE_CHECKING:
    from ..._types import MachineLike

#: Where the keepers keep their kernels, relative to the remote HOME.
KERNELS_DIR = ".gpumagic/kernels"
#: Kernel (session) names: they become directory names on the machine.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
#: The session ``%%remote --kernel`` starts when the machine has none.
DEFAULT_NAME = "main"


def check_name(name: str) -> str:
    """``name`` if it can name a session (letters, digits, ``-``, ``_``; 64 at most).

    Raises
    ------
    KernelError
    """
    if not NAME_RE.fullmatch(name or ""):
        raise KernelError(f"{name!r} cannot name a session",
                          "use letters, digits, - and _ (up to 64), starting with a letter or digit")
    return name


@dataclass
class KernelInfo:
    """One session on the machine, as ``%gpu kernel list`` shows it.

    Attributes
    ----------
    name, python : str
        Session name; the kernel's ``sys.executable`` on the machine.
    state : str
        ``idle``, ``busy`` (a cell executes), ``starting``, ``dead`` (the kernel exited;
        ``restart`` starts a new one) or ``lost`` (the keeper is gone: machine restarted).
    since, started : float or None
        Epoch seconds of the last state change and of the kernel's start.
    kernel_pid, keeper_pid, port : int or None
        On the machine (``port`` is the keeper's, on its 127.0.0.1).
    gpu_mib : int or None
        GPU memory held by the kernel's process group (``nvidia-smi
        --query-compute-apps=pid,used_memory``); None when nvidia-smi cannot tell.
    cwd : str
    exit_code : int or None
        The kernel's exit status once ``dead``.
    idle_stop : float or None
        Seconds after which the session stops by itself once no notebook is attached and
        no cell runs (the sandbox's sessions: ``SandboxMachine.session_idle_stop``); None:
        it runs until stopped.
    """

    name: str
    python: str = ""
    state: str = ""
    since: float | None = None
    started: float | None = None
    kernel_pid: int | None = None
    keeper_pid: int | None = None
    port: int | None = None
    gpu_mib: int | None = None
    cwd: str = ""
    exit_code: int | None = None
    python_version: str = ""
    idle_stop: float | None = None

    @property
    def running(self) -> bool:
        return self.state in ("idle", "busy", "starting")

    def state_text(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        if self.state == "busy" and self.since:
            clock = time.strftime("%H:%M:%S", time.localtime(self.since))
            return f"busy since {clock} ({_duration(now - self.since)})"
        if self.state == "dead":
            return f"dead (exit {self.exit_code})" if self.exit_code is not None else "dead"
        if self.state == "lost":
            return "lost (its keeper is not running: the machine restarted?)"
        return self.state


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"


def parse_listing(text: str) -> list[KernelInfo]:
    """Parse what ``kernel_list.sh`` prints (see there) into sessions with GPU memory.

    Pure; the GPU memory of a session is the sum of ``used_memory`` (MiB) over the
    ``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`` rows
    whose pid is in the kernel's process group (from ``ps -e -o pid=,pgid=``).
    """
    sections: dict[str, list[str]] = {}
    kernels: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    for line in text.split("\n"):  # not splitlines(): it splits at \x1e too
        line = line.rstrip("\r")
        if line.startswith("\x1e"):
            word, _, arg = line[1:].partition(" ")
            current = []
            if word == "kernel":
                kernels.append((arg, current))
            else:
                sections[word] = current
            continue
        if current is not None:
            if line:
                current.append(line)
    gpu_ok = sections.get("gpu-status", ["1"])[:1] == ["0"]
    mem_by_pid: dict[int, int] = {}
    for row in sections.get("gpu", []):
        cells = [c.strip() for c in row.split(",")]
        if len(cells) >= 2 and cells[0].isdigit() and cells[1].isdigit():
            mem_by_pid[int(cells[0])] = mem_by_pid.get(int(cells[0]), 0) + int(cells[1])
    groups: dict[int, list[int]] = {}
    for row in sections.get("ps", []):
        cells = row.split()
        if len(cells) == 2 and cells[0].isdigit() and cells[1].isdigit():
            groups.setdefault(int(cells[1]), []).append(int(cells[0]))
    out = []
    for name, lines in kernels:
        alive = lines[-1:] == ["alive"]
        try:
            state = json.loads("\n".join(ln for ln in lines if ln not in ("alive", "gone")) or "{}")
        except ValueError:
            state = {}
        info = KernelInfo(name=name, python=state.get("python", ""), state=state.get("state", ""),
                          since=state.get("since"), started=state.get("started"),
                          kernel_pid=state.get("kernel_pid"), keeper_pid=state.get("keeper_pid"),
                          port=state.get("port"), cwd=state.get("cwd", ""),
                          exit_code=state.get("exit_code"),
                          python_version=state.get("python_version", ""),
                          idle_stop=state.get("idle_stop"))
        if not alive:
            info.state = "lost"
        elif gpu_ok and info.kernel_pid and info.state != "dead":
            pids = groups.get(info.kernel_pid, [info.kernel_pid])
            info.gpu_mib = sum(mem_by_pid.get(p, 0) for p in pids)
        out.append(info)
    return out


def list_kernels(machine: MachineLike) -> list[KernelInfo]:
    """Every session on ``machine`` with its state and GPU memory (one round trip)."""
    r = machine.exec("sh -c " + shlex.quote(program_text("kernel_list.sh").decode()), timeout=60)
    return parse_listing(r.stdout)
