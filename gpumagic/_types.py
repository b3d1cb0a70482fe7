"""What the capability modules (jobs, torchrun, budget, wrapup, tunnel services, GPU
queries, sessions) need of a machine: :class:`MachineLike`.

:class:`gpumagic.machine.Machine` (and its :class:`~gpumagic.machine.SandboxMachine`) is the
one implementation; the capability modules take a ``MachineLike`` so that they depend on this
small surface, not on the whole class (and not on the sandbox: where the sandbox must act
differently it overrides a method -- :meth:`shutdown_plan`, :meth:`scratch_dir` -- or says so
in :attr:`is_this_computer`).  mypy checks that ``Machine`` satisfies it (``tool.mypy`` in
pyproject.toml lists this file).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Protocol, Sequence

if TYPE_CHECKING:
    from .budget.shutdown import ShutdownPlan
    from .machine import Machine
    from .remote.execution import RunResult
    from .remote.jobs import Job, JobInfo, JobOptions
    from .remote.environment import Environment
    from .remote.keep import Keepers
    from .ssh.connection import Connection
    from .tunnel import TunnelManager


class MachineLike(Protocol):
    """One machine reached over SSH, as the capability modules use it.

    Attributes
    ----------
    name : str
        The name the user gave it (``%%remote --host NAME``); messages name the machine so.
    cwd : str or None
        The working directory for cells (absolute, ``~/...`` or relative to ``$HOME``).
    connection : Connection
        The SSH connection (for :mod:`gpumagic.remote.program` and the channel-level modules).
    tool_dirs : tuple of str
        Directories searched for tmux (then setsid/nohup) after the remote ``PATH``.
    env : Environment
        What its cells, sessions and jobs start with (the login shell's differences,
        gpumagic's settings there, the proxy's variables).
    tunnels : TunnelManager
        Its tunnels.
    keepers : Keepers
        The keepers of its jobs' checkpoints running in this process.
    is_this_computer : bool
        True for the sandbox, whose files and processes are this computer's own (so, for
        example, ``%gpu wrapup`` does not report system-wide caches there).
    session_idle_stop : float or None
        Seconds after which a session (``%gpu kernel``) started here stops by itself once no
        notebook is attached and no cell runs: the sandbox's, which nothing else ends (it is
        this computer); None on a rented machine, where sessions run until stopped.
    """

    name: str
    cwd: str | None
    connection: Connection
    tool_dirs: tuple[str, ...]
    env: Environment
    tunnels: TunnelManager
    keepers: Keepers
    session_idle_stop: float | None

    @property
    def is_this_computer(self) -> bool: ...

    def run(self, command: str | Sequence[str], *, python: bool = False, cwd: str | None = None,
            env: Mapping[str, str] | None = None, timeout: float | None = None,
            check: bool = False, quiet: bool = False,
            stdout: Callable[[str], None] | None = None,
            stderr: Callable[[str], None] | None = None, capture: bool = True,
            grace: float | None = None, interrupt_wait: float | None = None) -> RunResult:
        """A command or cell, output streamed (:meth:`gpumagic.machine.Machine.run`)."""
        ...

    def exec(self, command: str, *, stdin: bytes | None = None, timeout: float | None = 60) -> RunResult:
        """A short ``/bin/sh`` command line, output captured (:meth:`gpumagic.machine.Machine.exec`)."""
        ...

    def shutdown_plan(self) -> ShutdownPlan:
        """How the machine powers itself off (the sandbox: a recording stand-in)."""
        ...

    def scratch_dir(self) -> str | None:
        """A folder that goes when the machine is closed (the sandbox's), else None."""
        ...

    def start_job(self, name: str, command: str, options: JobOptions | None = None, *,
                  torchrun=None, keep=None, **shortcuts) -> Job:
        """Start a detached job (:meth:`gpumagic.machine.Machine.start_job`)."""
        ...

    def jobs(self) -> list[JobInfo]:
        """Every detached job on the machine."""
        ...

    def job(self, name: str) -> Job:
        """A handle on the detached job ``name``."""
        ...


if TYPE_CHECKING:
    def _machine_is_machine_like(m: Machine) -> MachineLike:  # mypy: Machine satisfies it
        return m
