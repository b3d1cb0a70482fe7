"""The plain-Python API: a :class:`Machine` is one rented (or sandbox) computer.

>>> import gpumagic
>>> m = gpumagic.connect("mygpu")            # ~/.ssh/config alias or user@host:port
>>> m.run("nvidia-smi -L").stdout
>>> m.run("import torch; print(torch.cuda.is_available())", python=True)

The IPython magics are a thin layer over this module.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import sys
import time
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from . import gpu
from ._format import rough_duration
from .budget.guard import Budget
from .budget.shutdown import ShutdownPlan, find_shutdown
from .errors import ConfigError, JobError, RemoteCommandError, UnknownHostKey
from .net import Net
from .net.standin import StandInNet
from .remote import distributed, execution, jobs, move
from .remote.distributed import TorchrunOptions
from .remote.environment import Environment
from .remote.execution import RunResult
from .remote.jobs import JobOptions
from .remote.keep import Keepers, next_run
from .remote.kernel import Kernels
from .ssh.connection import Connection, PassphrasePrompt, _default_prompt
from .ssh.hosts import HostSpec, is_ssh_command, resolve, resolve_ssh_command
from .ssh.sandbox import Sandbox
from .sync import engine as sync
from .sync.plan import parse_endpoint
from .tunnel import Tunnel, TunnelManager

if TYPE_CHECKING:
    from .remote.distributed import DistributedJob
    from .remote.jobs import Job, JobInfo
    from .remote.keep import KeepOptions
    from .remote.kernel import RemoteKernel
    from .rent.billstop import RentalStop
    from .sync.engine import SyncOptions, SyncSummary


class _MoveReach:
    """What a job's keeper tells :mod:`gpumagic.remote.move` (:class:`gpumagic.remote.keep.Reach`):
    when the machine answered or did not, what a move keeps again; and whether it is lost."""

    @property
    def probe_every(self) -> float:
        return move.PROBE_EVERY

    def unreachable(self, error: Exception) -> bool:
        return isinstance(error, move.UNREACHABLE)

    def started(self, machine_name: str, job: str, options: KeepOptions, local: str) -> None:
        move.record_keep(machine_name, job, options, local)

    def seen(self, machine_name: str) -> None:
        move.note_seen(machine_name)

    def failed(self, machine_name: str, error: Exception, at: float) -> None:
        move.note_failed(machine_name, move.why(error), at)

    def lost(self, machine_name: str) -> object | None:
        return move.lost_for(machine_name)


class Machine:
    """One remote machine reached over SSH.

    The verbs are methods (:meth:`run`, :meth:`push`, :meth:`start_job`, :meth:`kernel`,
    :meth:`tunnel`...); each other capability is an object on it: :attr:`env` (what cells
    start with), :attr:`tunnels`, :attr:`net` (proxy, mirrors, reachability), :attr:`budget`
    (prices, meter, guard), :attr:`kernels`, :attr:`keepers`, :attr:`moves` (jobs lost, moved,
    resumed).

    Parameters
    ----------
    spec : HostSpec
        Where and how to connect.
    name : str, optional
        Name used by ``%%remote --host NAME`` (default: the alias typed).
    cwd : str, optional
        Working directory for cells (absolute, ``~/...``, or relative to the remote ``$HOME``).
    trust_new_host : bool or str
        Add an unknown host key to known_hosts instead of refusing (never for a changed key); a
        ``"SHA256:..."`` fingerprint: only a key that has it.
    """

    #: False: a rented machine, not this computer (see :class:`SandboxMachine`).
    is_this_computer: bool = False
    #: None: sessions here run until stopped (the machine's release ends them); see
    #: :attr:`SandboxMachine.session_idle_stop`.
    session_idle_stop: float | None = None

    def __init__(self, spec: HostSpec, *, name: str | None = None, cwd: str | None = None,
                 trust_new_host: bool | str = False, home: str | None = None,
                 passphrase_prompt: PassphrasePrompt = _default_prompt, sandbox=None):
        self.spec = spec
        self.name = name or spec.alias
        self.cwd = cwd
        self.sandbox = sandbox
        self.connection = Connection(spec, trust_new_host=trust_new_host, home=home,
                                     passphrase_prompt=passphrase_prompt)
        #: The machine's way out: the proxy lent to it, mirrors, what it can reach.
        self.net: Net = Net(self)
        #: The environment new cells, sessions and jobs start with (the login shell's,
        #: gpumagic's settings there, the proxy's variables while :attr:`net` lends it).
        self.env = Environment(self.connection, lambda: self.net.environment())
        #: Its prices and meter in the ledger, and the guard that shuts it down.
        self.budget = Budget(self)
        #: Directories searched for tmux (then setsid/nohup) after the remote PATH.
        self.tool_dirs: tuple[str, ...] = jobs.TOOL_DIRS
        #: One-time notes already shown for this machine (e.g. the nohup fallback).
        self.notes_shown: set[str] = set()
        #: Its tunnels, local and reverse (closed with it), and TensorBoard or Jupyter through them.
        self.tunnels = TunnelManager(self)
        #: Jobs whose checkpoints are kept on this computer (``keep=``), stopped with it.
        self.keepers = Keepers(_MoveReach())
        #: Its jobs as this computer's records know them: lost, moved here or away, standbys.
        self.moves = move.Moves(self)
        #: The live Python sessions this process has used here (they keep running on the
        #: machine when it is closed).
        self.kernels = Kernels(self)
        #: The rental this machine is (:class:`gpumagic.rent.billstop.RentalStop`, set by
        #: ``%gpu rent`` and ``%gpu start``), or None: its guard stops the bill through the
        #: platform's API instead of shutting down.
        self.rental: RentalStop | None = None

    # -- life cycle -------------------------------------------------------------------

    @property
    def is_connected(self) -> bool:
        return self.connection.is_connected

    def connect(self) -> "Machine":
        """Open the SSH connection now (otherwise it opens on first use)."""
        self.connection.ensure_open()
        return self

    def close(self) -> None:
        """Close every tunnel and the connection (and stop the sandbox sshd if this is the
        sandbox, with the TensorBoard/Jupyter servers gpumagic started there); safe twice.

        A closed machine re-opens on its next use, except the sandbox, whose server is gone.
        """
        self.keepers.close()
        self.tunnels.close_all(stop_service=self.sandbox is not None)
        self.net.close()
        self.kernels.close()
        self.connection.close()
        if self.sandbox is not None:
            left = self.sandbox.running_sessions()
            self.sandbox.stop()
            self.sandbox = None
            self.connection.refuse_reopen = ("the sandbox machine was stopped when it was closed",
                                             "start a new one: `%gpu connect --sandbox` "
                                             "(gpumagic.connect(sandbox=True))")
            if left:
                self.kernels.output().note(sessions_left_note(left, self.name))

    def __enter__(self) -> "Machine":
        return self.connect()

    def __exit__(self, *exc) -> None:
        self.close()

    def cd(self, path: str) -> str:
        """Set the working directory for later cells after checking it exists.

        Raises
        ------
        RemoteCommandError
            When the directory does not exist on the machine.
        """
        # `cd -` (and a CDPATH match) print a directory themselves; "~" is not expanded in "$1"
        script = ('case "$1" in -) set -- ./- ;; "~") set -- "$HOME" ;; "~/"*) set -- "$HOME/${1#"~/"}" ;; esac; '
                  'cd -- "$1" >/dev/null && pwd -P | od -An -tx1')
        r = self.run(["sh", "-c", script, "sh", path], quiet=True)
        if r.exit_code != 0:
            raise RemoteCommandError(f"no directory {path} on {self.name}", exit_code=r.exit_code,
                                     stderr=r.stderr, hint=f"create it first: `mkdir -p {path}` in a %%remote cell")
        # in hex (od): a name that is not UTF-8 comes back as os.fsdecode gives it (\udcXX for
        # each such byte), which later cells send as the same bytes, not as U+FFFD
        self.cwd = bytes.fromhex("".join(r.stdout.split())).removesuffix(b"\n").decode("utf-8", "surrogateescape")
        return self.cwd

    # -- running ----------------------------------------------------------------------

    def run(self, command: str | Sequence[str], *, python: bool = False, cwd: str | None = None,
            env: Mapping[str, str] | None = None, timeout: float | None = None,
            check: bool = False, quiet: bool = False,
            stdout: Callable[[str], None] | None = None,
            stderr: Callable[[str], None] | None = None, capture: bool | int = True,
            grace: float | None = None, interrupt_wait: float | None = None) -> RunResult:
        """Run a command or a cell on the machine, streaming its output.

        Parameters
        ----------
        command : str or sequence of str
            A bash script (str), Python source with ``python=True``, or an argv list run
            without a shell.
        python : bool
            Run ``command`` with the remote ``python3 -u``.
        cwd, env, timeout, capture
            See :func:`gpumagic.remote.execution.run` (timeout in seconds).
        grace : float, optional
            Seconds the command outlives a lost connection, re-attached over a new one
            (default: :data:`gpumagic.remote.execution.GRACE`; 0: stopped when it is lost).
        interrupt_wait : float, optional
            Seconds an interrupted command gets between SIGINT and SIGTERM (default:
            :data:`gpumagic.remote.execution.INTERRUPT_WAIT`).
        check : bool
            Raise :class:`RemoteCommandError` on a non-zero exit.
        quiet : bool
            Do not echo output to this process's stdout/stderr.
        stdout, stderr : callable, optional
            Receive decoded chunks as they arrive (instead of echoing).

        Returns
        -------
        RunResult
            ``stdout``, ``stderr``, ``exit_code``, ``seconds``.

        Raises
        ------
        ConnectionLost, RemoteTimeout, RemoteCommandError, KeyboardInterrupt
        """
        if isinstance(command, str):
            argv = execution.cell_argv(command, python=python)
        else:
            argv = list(command)
        if not quiet:
            stdout = stdout or _echo(sys.stdout)
            stderr = stderr or _echo(sys.stderr)
        full_env = {**self.env.current(), **(env or {})}
        result = execution.run(self.connection, argv, cwd=cwd if cwd is not None else self.cwd,
                               env=full_env, stdout=stdout, stderr=stderr, timeout=timeout,
                               capture=capture, grace=grace, interrupt_wait=interrupt_wait)
        if result.exit_code == execution.CWD_MISSING and result.stderr.startswith("gpumagic: cannot enter"):
            where = cwd if cwd is not None else self.cwd
            raise RemoteCommandError(
                f"no directory {where} on {self.name}", exit_code=result.exit_code, stderr=result.stderr,
                hint="create it first (`mkdir -p DIR` in a cell), or fix --cwd / `%gpu cd`")
        if check and result.exit_code != 0:
            raise RemoteCommandError(
                f"{'python cell' if python else 'command'} on {self.name} exited with code {result.exit_code}",
                exit_code=result.exit_code, stdout=result.stdout, stderr=result.stderr)
        return result

    def exec(self, command: str, *, stdin: bytes | None = None, timeout: float | None = 60) -> RunResult:
        """Run a short ``/bin/sh`` command line, output captured, nothing echoed.

        For quick queries (``df``, ``nvidia-smi --query-gpu=...``); user code goes
        through :meth:`run`, which stops remote children on interrupt.  The command means
        the same whatever the machine's login shell is; ``stdin`` reaches it byte for byte
        (see :func:`gpumagic.remote.execution.exec_simple`).
        """
        return execution.exec_simple(self.connection, command, stdin=stdin, timeout=timeout)

    # -- GPU status and preflight (gpumagic/gpu/) ------------------------------------------

    def gpu_status(self, *, cuda_version: str | None = None) -> gpu.GpuStatus:
        """A snapshot of the GPUs in one round trip; see :func:`gpumagic.gpu.query_status`.

        Whatever nvidia-smi says (no driver, driver/library mismatch) becomes the
        status's ``kind``; only connection trouble raises.
        """
        return gpu.query_status(self, cuda_version=cuda_version)

    def doctor(self, *, expect_gpu: str | None = None, expect_count: int | None = None,
               sample: int = 0) -> gpu.DoctorReport:
        """Preflight checks gathered in one round trip; see :func:`gpumagic.gpu.run_doctor`.

        Parameters
        ----------
        expect_gpu : str, optional
            The model rented ("H200"); matched inside the GPU name.
        expect_count : int, optional
            The number of GPUs rented.
        sample : int
            Seconds to sample GPU and CPU utilisation for (0: no sampling).
        """
        return gpu.run_doctor(self, expect_gpu=expect_gpu, expect_count=expect_count, sample=sample)
    # -- files ----------------------------------------------------------------------------

    def push(self, src: str, dst: str, options: "SyncOptions | None" = None, **shortcuts) -> "SyncSummary":
        """Copy a local tree or file to this machine, sending only what differs.

        ``dir/`` copies the contents of ``dir``, ``dir`` the directory itself (rsync's
        rule).  ``dst`` is a path on this machine, written plainly or as in ``%gpu sync``
        (``:path``, ``NAME:path``).  ``options``: a :class:`gpumagic.sync.SyncOptions`;
        its fields (``delete``, ``exclude``, ``ignore_files``, ``dry_run``, ``checksum``,
        ``update``, ``compress``) and ``progress`` may be given as keywords; see
        :func:`gpumagic.sync.push`.

        Returns
        -------
        SyncSummary
            Files and bytes sent, skipped, deleted, seconds.

        Raises
        ------
        ConfigError
            When ``dst`` names another machine (``OTHER:path``).
        """
        summary = sync.push(self, src, self._remote_path(dst), options, **shortcuts)
        move.note_push(self.name, src, summary)  # a job started in that folder can be moved with it
        return summary

    def pull(self, src: str, dst: str, options: "SyncOptions | None" = None, **shortcuts) -> "SyncSummary":
        """Copy a tree or file from this machine (``src``: ``path``, ``:path`` or
        ``NAME:path``) to a local path; options as for :meth:`push` (and ``rename_clashes``);
        see :func:`gpumagic.sync.pull`."""
        return sync.pull(self, self._remote_path(src), dst, options, **shortcuts)

    def _remote_path(self, text: str) -> str:
        """A path on this machine from ``path``, ``:path`` or ``NAME:path`` (``%gpu sync``'s forms)."""
        end = parse_endpoint(text)
        if end.host is None:
            return text
        if end.host and end.host != self.name:
            raise ConfigError(f"{text!r} names machine {end.host!r}, but this is {self.name!r}",
                              f"write the path on {self.name} alone, or use that machine's push/pull")
        return end.path

    # -- detached jobs (gpumagic/remote/jobs.py) -------------------------------------------

    def start_job(self, name: str, command: str, options: JobOptions | None = None, *,
                  torchrun: int | str | TorchrunOptions | None = None, keep: KeepOptions | None = None,
                  **shortcuts) -> Job:
        """Start ``command`` as a detached job that survives disconnects; returns at once.

        ``options`` (a :class:`gpumagic.remote.jobs.JobOptions`) says how it runs; each of its
        fields may also be given as a keyword (``python``, ``cwd``, ``env``, ``stop_on``,
        ``then_shutdown``, ``alerts``), which wins over ``options``.

        With ``torchrun=N`` (or ``"auto"``, or a
        :class:`gpumagic.remote.distributed.TorchrunOptions`; ``torchrun_args=`` as a
        keyword) the command is a Python training script (or a ``!command line``) run by
        ``N`` ranks under PyTorch's torchrun, and the handle is a
        :class:`gpumagic.remote.distributed.DistributedJob` (``state``, ``logs(rank=)``,
        ``wait()``, ``kill()``); see :func:`gpumagic.remote.distributed.start`.

        >>> job = m.start_job("train", "python train.py", stop_on="nan")
        >>> job.state, job.logs(20), job.wait(), job.kill()

        Runs in tmux (``gpumagic-NAME``; found on the remote PATH or in
        :data:`gpumagic.remote.jobs.TOOL_DIRS`, see :attr:`tool_dirs`), else under ``setsid nohup``.
        ``then_shutdown`` is in minutes after a successful end (for a torchrun job: after
        every rank has ended, see :func:`gpumagic.remote.distributed.start`).  See
        :func:`gpumagic.remote.jobs.start`.

        With ``keep`` (a :class:`gpumagic.remote.keep.KeepOptions`), new or changed files of
        that folder (relative to the job's ``cwd``) are pulled to this computer while the
        job runs, by a thread of this process (:attr:`keepers`; see :mod:`gpumagic.remote.keep`).

        Raises
        ------
        JobError
        TypeError
            A keyword that names no option.
        """
        torchrun_args = shortcuts.pop("torchrun_args", None)
        options = (options or JobOptions()).with_(**shortcuts)
        if torchrun is not None and keep is not None:
            raise JobError("--keep works with a job on one machine, not yet with --torchrun",
                           "start it without --keep and pull the checkpoints with `%gpu sync`")
        if torchrun is not None:
            run = torchrun if isinstance(torchrun, TorchrunOptions) else TorchrunOptions(nproc=torchrun)
            if torchrun_args is not None:
                run = dataclasses.replace(run, torchrun_args=torchrun_args)
            return start_distributed([self], name, command, options, run)  # type: ignore[return-value]
        if torchrun_args is not None:
            raise TypeError("torchrun_args is for a torchrun job: give torchrun=N too")
        keep_run, since = 1, time.time()
        if keep is not None:
            jobs.check_name(name)
            keep_run = next_run(self.name, name)  # each start is a run of its own: its checkpoints apart
            keep.make_local_folder(name, keep_run)  # refused here, before anything starts there
        job = jobs.start(self, name, command, options, tool_dirs=self.tool_dirs)
        move.record_start(self, name, command, options)  # what a later move or resume starts again
        if keep is not None:
            cwd = options.cwd if options.cwd is not None else (self.cwd or "")
            # run 2 on: what an earlier run left in the folder on the machine is not this run's
            job.keeper = self.keepers.start(self, name, cwd, keep, run=keep_run,
                                            since=since if keep_run > 1 else None)
        return job

    def jobs(self) -> list[JobInfo]:
        """Every job on this machine, read from ``~/.gpumagic/jobs`` (one round trip)."""
        return jobs.list_jobs(self)

    def job(self, name: str) -> Job:
        """A handle on an existing job (started from this or any earlier kernel)."""
        return jobs.Job(self, jobs.check_name(name))

    # -- live Python sessions (gpumagic/remote/kernel/) ------------------------------------

    def kernel(self, name: str | None = None, *, start: bool = True, python: str | None = None,
               cwd: str | None = None, env: Mapping[str, str] | None = None,
               install: bool = False) -> "RemoteKernel":
        """A Jupyter kernel on this machine that keeps its variables between calls and
        outlives this process: ``k = m.kernel("main"); k.execute("x = 41")``.

        ``name`` defaults to the session used last, else the machine's only one, else
        ``main``.  With ``start``, it is started (``python``, ``cwd``, ``env``, ``install``:
        see :meth:`gpumagic.remote.kernel.RemoteKernel.start`) unless it already runs.

        Raises
        ------
        KernelError
        """
        return self.kernels.get(name, start=start, python=python, cwd=cwd, env=env, install=install)

    # -- what the capability modules ask (the sandbox answers with stand-ins) -----------

    def shutdown_plan(self) -> "ShutdownPlan":
        """How this machine can power itself off (one round trip): the command, or why none
        can run, with what to do instead; see :func:`gpumagic.budget.shutdown.find_shutdown`.
        For a rental (:attr:`rental`), the stop of its bill through the platform's API, sent
        from the machine (:meth:`gpumagic.rent.billstop.RentalStop.plan`: it raises
        :class:`gpumagic.errors.BudgetError` where that cannot be).  The budget guard and
        ``--then-shutdown`` jobs arm what this returns."""
        if self.rental is not None:
            return self.rental.plan(self)
        return find_shutdown(self)

    def scratch_dir(self) -> str | None:
        """A folder on the machine that goes when this machine is closed, for detached gpumagic
        programs that must end with it (an absolute path); ``None`` on a rented machine, whose
        programs outlive the connection (see :class:`SandboxMachine`)."""
        return None

    # -- tunnels ----------------------------------------------------------------------

    def tunnel(self, remote_port: int, *, local_port: int | None = None,
               remote_host: str = "localhost", name: str = "", path: str = "/") -> Tunnel:
        """Forward a local port on 127.0.0.1 to ``remote_host:remote_port`` as seen from the
        machine (like ``ssh -N -L``), started and listed in :attr:`tunnels`.

        Parameters
        ----------
        remote_port : int
            Port on the machine.
        local_port : int, optional
            Wanted local port (default: ``remote_port``); a free one is used when taken
            (``tunnel.local_port``, ``tunnel.moved_from``).
        remote_host : str
            Host as the machine resolves it (default ``localhost``).
        name, path : str
            Label for listings; URL path (and query) of :attr:`Tunnel.url`.

        Returns
        -------
        Tunnel
            Already listening; ``with machine.tunnel(8000) as t:`` closes it at the end.  An
            open tunnel to the same target is returned as it is, unless another
            ``local_port`` is asked for (see :meth:`gpumagic.tunnel.TunnelManager.open`).

        Raises
        ------
        TunnelError, ConnectionLost
        """
        return self.tunnels.open(remote_port, local_port=local_port, remote_host=remote_host,
                                 name=name, path=path)

    def __repr__(self) -> str:
        state = "connected" if self.is_connected else "not connected"
        return f"<Machine {self.name} {self.spec.user}@{self.spec.address} {state}>"


class SandboxMachine(Machine):
    """The sandbox: this computer, reached through a throwaway local sshd
    (:class:`gpumagic.ssh.sandbox.Sandbox`, in :attr:`sandbox`).

    What would act on the computer itself is a stand-in: its :meth:`shutdown_plan` is the
    sandbox's recording ``shutdown``, never a real one; and detached programs keep their
    state in the sandbox's temporary folder (:meth:`scratch_dir`), so they end with it.
    """

    #: True: its files and processes are this computer's own (``%gpu wrapup`` leaves the
    #: system-wide caches out).
    is_this_computer: bool = True

    def __init__(self, spec: HostSpec, **options):
        super().__init__(spec, **options)
        #: Seconds after which a session started here stops by itself once no notebook is
        #: attached and no cell runs (:func:`sandbox_session_idle_stop`: 30 min unless
        #: ``GPUMAGIC_SANDBOX_IDLE_STOP`` says otherwise).  The sandbox's sessions outlive it,
        #: for a later sandbox (a later notebook) to find, as on a rented machine; but no
        #: release ends them on this computer, so they end themselves.
        self.session_idle_stop = sandbox_session_idle_stop()
        #: As a rented machine's, but ``%gpu doctor --net`` measures stand-ins for the
        #: internet on this computer (:class:`gpumagic.net.standin.StandInNet`).
        self.net = StandInNet(self)

    def shutdown_plan(self) -> "ShutdownPlan":
        """The sandbox's stand-in ``shutdown -h now`` (see
        :meth:`gpumagic.ssh.sandbox.Sandbox.shutdown_stand_in`); no round trip."""
        if self.sandbox is None:
            return ShutdownPlan(None, "the sandbox was stopped when it was closed")
        return ShutdownPlan(f"{shlex.quote(str(self.sandbox.shutdown_stand_in()))} -h now")

    def scratch_dir(self) -> str | None:
        """The sandbox's temporary folder (removed when the sandbox stops)."""
        return None if self.sandbox is None else str(self.sandbox.server.dir)


def start_distributed(machines: Sequence[Machine], name: str, command: str, options: JobOptions,
                      run: TorchrunOptions) -> "DistributedJob":
    """Start ``command`` under PyTorch's torchrun on every machine of ``machines`` (the first
    holds the rendezvous endpoint), recorded here for a later move or resume; see
    :func:`gpumagic.remote.distributed.start`.

    Raises
    ------
    JobError
        The preflight refused (a table of what differs per host), or a bad name or nproc.
    """
    return distributed.start(list(machines), name, command, options, run, record=move.record_torchrun)


#: Seconds a sandbox's session is kept with no notebook attached and no cell running.
SANDBOX_SESSION_IDLE_STOP = 30 * 60.0
#: The environment variable that sets it (seconds; ``0`` or ``off``: never stop).
IDLE_STOP_ENV = "GPUMAGIC_SANDBOX_IDLE_STOP"


def sandbox_session_idle_stop() -> float | None:
    """:data:`SANDBOX_SESSION_IDLE_STOP`, or ``$GPUMAGIC_SANDBOX_IDLE_STOP`` (seconds; ``0``
    or ``off``: None, never); a value that is not a number is ignored."""
    text = os.environ.get(IDLE_STOP_ENV, "").strip().lower()
    if not text:
        return SANDBOX_SESSION_IDLE_STOP
    if text in ("off", "never", "none"):
        return None
    try:
        seconds = float(text)
    except ValueError:
        return SANDBOX_SESSION_IDLE_STOP
    return seconds if seconds > 0 and math.isfinite(seconds) else None


def sessions_left_note(left: Sequence[tuple[str, float | None]], machine: str = "sandbox") -> str:
    """The line a closing sandbox gives about the sessions (``(name, idle_stop)``) it leaves
    running: they outlive it (a later sandbox finds them) and stop after their idle time."""
    where = "the sandbox" if machine == "sandbox" else f"the sandbox {machine}"
    lines = []
    for name, idle in left:
        when = (f"it stops after {rough_duration(idle)} with no notebook attached and no cell running"
                if idle else "it runs until stopped")
        lines.append(f"session {name} keeps running on {where}; {when} "
                     f"(`%gpu kernel stop {name}` on a sandbox ends it now)")
    return "\n".join(lines)


def _echo(stream):
    def write(text: str) -> None:
        stream.write(text)
        stream.flush()
    return write


#: The longest machine name (``--name``): it names a sandbox's home folder, and the file
#: systems' NAME_MAX is 255 bytes.
MAX_NAME = 100


def check_machine_name(name: str) -> str:
    """Return ``name`` if it can name a machine (``%gpu connect --name``), else raise
    :class:`~gpumagic.errors.ConfigError`: at most :data:`MAX_NAME` characters, no NUL byte,
    no line break."""
    bad = (f"is {len(name)} characters long (at most {MAX_NAME})" if len(name) > MAX_NAME else
           "holds a NUL byte (\\0)" if "\0" in name else
           "holds a line break" if any(c in name for c in "\r\n") else "")
    if bad:
        raise ConfigError(f"the machine name (--name) {bad}",
                          "give a short name of letters, digits, '-' and '_', e.g. --name gpu1")
    return name


def connect(target: str | None = None, *, port: int | None = None, key: str | None = None,
            jump: str | None = None, user: str | None = None, name: str | None = None,
            cwd: str | None = None, trust_new_host: bool | str = False, sandbox: bool = False,
            home: str | None = None, lazy: bool = False, fake_gpu: str | None = None,
            passphrase_prompt: PassphrasePrompt = _default_prompt) -> Machine:
    """Connect to a machine and return it.

    Parameters
    ----------
    target : str
        A ``~/.ssh/config`` alias, ``[user@]host[:port]``, or a pasted ``ssh ...`` command
        line (``ssh -p 41022 -i ~/.ssh/key root@203.0.113.10``; see
        :func:`gpumagic.ssh.hosts.parse_ssh_command`).
    port, key, jump, user : optional
        Like ``ssh -p``, ``-i``, ``-J``, ``-l``; they win over ~/.ssh/config and over the
        values in a pasted ssh line.
    name : str, optional
        The machine's name in gpumagic (default: ``target``).
    cwd : str, optional
        Working directory for cells.
    trust_new_host : bool or str
        Add an unknown host's key to known_hosts (prints its SHA256 fingerprint); a
        ``"SHA256:..."`` fingerprint: only a key that has it.
    sandbox : bool
        Start the local sandbox sshd and connect to it (``target`` is ignored).
    fake_gpu : str, optional
        Sandbox only: replay a recorded GPU (``h200-idle``, ``h200-load``).
    lazy : bool
        Do not open the connection until first use.

    Raises
    ------
    GpumagicError
        One of its kinds (ConfigError for a ``name`` :func:`check_machine_name` refuses,
        HostNotFound, ConnectionRefused, ConnectTimeout,
        AuthenticationFailed, WrongPassphrase, InsecureKeyFile, UnknownHostKey,
        ChangedHostKey, RevokedHostKey), each with a one-line hint.
    """
    if name:
        check_machine_name(name)
    sb = None
    if sandbox:
        # A sandbox named other than "sandbox" gets a home of its own (two sandboxes stand
        # for two machines, as in tutorial 08); the default one keeps the shared home.
        sb = Sandbox(fake_gpu=fake_gpu, home_name=name if name and name != "sandbox" else None).start()
        spec = sb.spec()
        name = name or "sandbox"
        cwd = cwd or "~"  # the sandbox's own HOME, not the directory sshd starts in
    else:
        if not target:
            raise ConfigError("no machine given", "name a ~/.ssh/config alias or user@host[:port]")
        notes: list[str] = []
        if is_ssh_command(target):
            spec, notes = resolve_ssh_command(target, home=home, port=port, user=user, key=key,
                                              jump=jump)
            name = name or spec.alias
        else:
            spec = resolve(target, home=home, port=port, user=user, identity_file=key,
                           proxy_jump=jump)
    m = (SandboxMachine if sandbox else Machine)(spec, name=name, cwd=cwd, trust_new_host=trust_new_host,
                                                 home=home, passphrase_prompt=passphrase_prompt, sandbox=sb)
    if not sandbox:
        m.connection.notes.extend(notes)
    if not lazy:
        try:
            m.connect()
        except UnknownHostKey as e:
            m.close()
            if target and is_ssh_command(target):  # the alias-based hint would lose -p etc.
                e.hint = ("if that matches the fingerprint your platform shows, run the same "
                          "line again with --trust-new-host added")
            raise
        except BaseException:
            m.close()
            raise
    return m
