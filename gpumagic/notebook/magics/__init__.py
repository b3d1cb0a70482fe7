"""IPython layer: ``%gpu <sub-command>`` and ``%%remote``.

Each sub-command is a small function ``fn(magics, line)`` with its own ``magic_arguments``
parser, a row of the table :data:`SUBCOMMANDS` (a :class:`._args.Subcommands`, as jupysql's
``magic_cmd.py``); it parses (:func:`._args.parse`), calls the plain-Python API, and
displays.  The functions live one module per group: :mod:`.connect`, :mod:`.keys`,
:mod:`.gpu`, :mod:`.sync`, :mod:`.jobs`, :mod:`.torchrun`, :mod:`.kernel`, :mod:`.budget`,
:mod:`.tunnel`, :mod:`.net`, :mod:`.wrapup`, :mod:`.rent`; options several magics share are in :mod:`._args`, the
output cap in :mod:`._output`.  Bad arguments raise exactly ``UsageError``; everything else
is a ``GpumagicError`` whose ``_render_traceback_`` shows a short message instead of a
traceback.

Adding a sub-command (``%gpu proxy``):

1. In its group's module (or a new one, ``proxy.py``), write the function with its parser::

       @magic_arguments()
       @argument("port", type=PORT, help="...")
       @host_arg()                       # the shared options: host_arg(), out_arg("the X")
       def _proxy(magics: GpuMagics, line: str):
           # (its docstring: what `%gpu proxy -h` says above the options)
           args = parse(_proxy, line, "proxy")   # -h, bad input -> exactly UsageError
           m = magics.fleet.get(args.host)
           ...                                   # call the plain-Python API, display

2. Add one row to :data:`SUBCOMMANDS`: ``"proxy": (_proxy, "one line for `%gpu help`")``.
   ``%gpu help``, ``%gpu help proxy``, the unknown-name message (which lists it) follow from
   the table; add it to ``tests/test_fuzz_magics.py``'s ``_specs`` (a test checks that every
   row is fuzzed).

A group with sub-commands of its own (``%gpu mirrors list|set``) is a table of its own in its
module, ``MIRRORS = Subcommands("%gpu mirrors", {"list": (_mirrors_list, "..."), ...},
intro="...")``, and that table is the row's function: ``"mirrors": (MIRRORS, "...")``, as
``kernel``, ``budget`` and ``tunnel`` are.  A plain sub-command that grows sub-commands keeps
its old form as the table's ``default`` (``%gpu budget [--host NAME]`` is the meter,
``%gpu budget set ...`` a sub-command): so ``%gpu jobs`` can stay the list when ``%gpu jobs
move NAME`` arrives.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, argument_group, magic_arguments
from traitlets import Float, Int, Unicode

from ...errors import Interrupted, RemoteCommandError
from ...gpu.doctor import failure_hint
from ...fleet import Fleet
from ...remote.execution import INTERRUPT_WAIT
from ._args import (GB, GRACE_S, LIMIT, LINES, LOCAL_PORT, MINUTES, MONEY, PORT, TIMEOUT_S, Subcommands, checkpoint_args,
                    env_pairs, host_arg, keep_given, number, out_arg, parse, returns_after_help, split_args)
from ._output import OutputCap
from .budget import BUDGET, GUARD_ALERT_POLL, _budget_post_run_cell, budget_alert_hook
from .connect import _cd, _connect, _disconnect, _forget, _hosts, hosts_table, split_pasted_ssh
from .gpu import _doctor, _fit, _status
from .jobs import JOB, _attach, _jobs, _kill, _logs, _moves_post_run_cell, _remote_job
from .keys import _add_host, _install_key, _keygen, show_public_key
from .net import PROXY, _mirrors
from .rent import PROVIDER, _offers, _release, _rent, _rentals, _start, _stop
from .sync import _sync
from .tunnel import TUNNEL, _tunnel_faults_post_run_cell
from .wrapup import _wrapup

# Each parser's function is reachable here too (the tests reach them as ``magics._NAME``).
from .budget import (_budget_estimate, _budget_guard, _budget_history, _budget_meter,  # noqa: F401
                     _budget_notify, _budget_set)
from .tunnel import (_service_note, _tunnel_close, _tunnel_jupyter, _tunnel_list,  # noqa: F401
                     _tunnel_port, _tunnel_reverse, _tunnel_tensorboard)

def _kernel(magics: GpuMagics, line: str):
    """`%gpu kernel SUB ...`: the table :data:`.kernel.KERNEL` (imported on first use)."""
    from .kernel import KERNEL

    return KERNEL(magics, line)


#: ``%gpu NAME``: name -> (function(magics, line), one line for ``%gpu help``).
SUBCOMMANDS = Subcommands("%gpu", {
    "connect": (_connect, "connect to a machine: ~/.ssh/config alias, user@host[:port] or a pasted ssh line"),
    "disconnect": (_disconnect, "close a machine's connection (default: the current one)"),
    "hosts": (_hosts, "list ~/.ssh/config aliases and which machines are connected"),
    "forget": (_forget, "remove a host's key from ~/.ssh/known_hosts (after rebuilding an instance)"),
    "cd": (_cd, "set the working directory for the current machine's cells"),
    "keygen": (_keygen, "make an ed25519 SSH key pair and show the public key to paste"),
    "add-host": (_add_host, "add a Host block to ~/.ssh/config (keeps the rest of the file as it is)"),
    "install-key": (_install_key, "copy your public key to a machine that allows a password login (once)"),
    "status": (_status, "GPU memory, utilisation, temperature, power and processes (--watch N refreshes)"),
    "doctor": (_doctor, "preflight: GPU model and memory, PyTorch CUDA vs driver, disks, python, tools"),
    "fit": (_fit, "will it fit? GPU memory for training or inference, vs the GPU or a card"),
    "sync": (_sync, "copy files to or from a machine, sending only what changed (like rsync -a)"),
    "jobs": (_jobs, "list the detached jobs on a machine: state, start, run time, last line"),
    "logs": (_logs, "show a job's output; --follow streams it until the job ends"),
    "attach": (_attach, "show a job's earlier output, then follow it until it ends"),
    "kill": (_kill, "end a job's whole process tree; --shutdown cancels its pending shutdown"),
    "job": (JOB, "move a job to another machine, or resume it after a restart, from its newest kept checkpoint"),
    "kernel": (_kernel, "a live Python session on the machine: start, list, attach, push, pull, stop, autorun"),
    "budget": (BUDGET, "what the rental costs: set prices, meter, estimate, history, guard, notify"),
    "tunnel": (TUNNEL, "open a remote port in your browser: tensorboard, jupyter, PORT, --reverse, list, close"),
    "proxy": (PROXY, "lend this computer's proxy to the machine: on [--local 7890] [--persist], off"),
    "mirrors": (_mirrors, "use a pip, Hugging Face or conda mirror on the machine: pip|hf|conda [NAME], off"),
    "wrapup": (_wrapup, "before releasing: pull results, list/--clean caches, image size, what runs"),
    "offers": (_offers, "machines to rent now (RunPod, Lambda, vast.ai), cheapest first: price, price while stopped"),
    "rent": (_rent, "rent a machine, wait until it runs, and connect to it"),
    "stop": (_stop, "stop a rental (its disk is kept and billed; the GPU is not)"),
    "start": (_start, "start a stopped rental and connect at its new address"),
    "release": (_release, "terminate a rental, after checking no results are only on it"),
    "rentals": (_rentals, "every machine of every platform with a key: state, price now, price stopped"),
    "provider": (PROVIDER, "the platforms' API keys: login (kept in the keychain), logout"),
}, intro="gpumagic: run cells on a rented GPU machine over SSH.\n\n"
         "  %%remote [--python] ...  run the cell on the machine (see %%remote?)",
   outro="`%gpu NAME -h` (or `%gpu help NAME`) shows a sub-command's options.")


@dataclass
class NotebookState:
    """What this notebook remembers between cells (one per :class:`GpuMagics`, so a second
    notebook, a reload of the extension and each test start empty)."""

    #: What happened to jobs in the background (a move by ``--fallback``, a machine cleaned
    #: after a move), said after the next cell (:mod:`.jobs`).
    job_events: list[str] = field(default_factory=list)
    #: The budget alerts already shown, by machine (:func:`.budget.budget_alert_hook`).
    budget_seen: dict = field(default_factory=dict)
    #: Job alerts already shown: (job name, alert kind) -> the start times of the jobs of that
    #: name it was shown for (:func:`gpumagic.notebook.display.first_alert`).
    alerts_shown: dict[tuple[str, str], set[float | None]] = field(default_factory=dict)
    #: Each session's comm bridge (:mod:`gpumagic.notebook.comms`), by the session, gone with it.
    bridges: "weakref.WeakKeyDictionary[Any, Any]" = field(default_factory=weakref.WeakKeyDictionary)
    #: The rentals of the platforms' APIs (:func:`.rent.renter`; None until first used).
    renter: Any = None


@magics_class
class GpuMagics(Magics):
    """``%gpu`` and ``%%remote``: run notebook cells on a rented GPU machine over SSH."""

    max_display_bytes = Int(
        5_000_000, config=True,
        help="Most characters of one cell's output shown in the notebook (the rest is still "
             "kept by --out); a browser tab slows down on tens of megabytes.",
    )

    max_image_bytes = Int(
        50_000_000, config=True,
        help="Most bytes of images (image/png, image/jpeg, image/svg+xml, ..., as the notebook "
             "holds them: base64) one cell shows, counted apart from its text; the rest is still "
             "kept by --out (VAR.outputs).",
    )

    guard_alert_poll = Float(
        GUARD_ALERT_POLL, config=True,
        help="Seconds between checks, after cells run, for a warning from a machine's budget guard "
             "(one SSH round trip each).",
    )

    grace = Float(
        600.0, config=True,
        help="Seconds a running %%remote cell outlives a lost connection (a Wi-Fi blink, a network "
             "change, a laptop asleep): it runs on, its output kept on the machine, and the cell "
             "re-attaches on a new connection, showing what it missed once; past it the cell is "
             "stopped.  0: stopped when the connection is lost.  --grace S sets it for one cell.",
    )

    interrupt_wait = Float(
        INTERRUPT_WAIT, config=True,
        help="Seconds an interrupted %%remote cell gets between SIGINT (a terminal's Ctrl-C: the "
             "program's `except KeyboardInterrupt:` and `finally:` run, e.g. to save a checkpoint) "
             "and SIGTERM; SIGKILL follows 1 s later.  Interrupting again sends the next signal "
             "at once.",
    )

    default_cwd = Unicode(
        None, allow_none=True, config=True,
        help="Working directory for cells on newly connected machines (e.g. '/root/autodl-tmp').",
    )

    def __init__(self, shell=None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        #: What this notebook remembers between cells.
        self.state = NotebookState()
        # a session of a machine connected here displays its rich output in this notebook
        self.fleet = Fleet(kernel_output=self._kernel_output)
        #: machine name -> running ``%gpu status --watch`` (a gpu.Watcher)
        self.status_watchers: dict = {}
        #: True once :meth:`close` ran (the extension was unloaded)
        self.closed = False
        #: (event, callback) registered with ``shell.events``, unregistered by :meth:`close`
        self._hooks: list[tuple[str, Callable]] = []
        if shell is not None:  # budget alerts, tunnel errors and moved jobs after each cell
            for hook in (_budget_post_run_cell(self), _tunnel_faults_post_run_cell(self),
                         _moves_post_run_cell(self)):
                shell.events.register("post_run_cell", hook)
                self._hooks.append(("post_run_cell", hook))

    def _kernel_output(self):
        """The output of a session call that names none (``m.kernel().execute(...)``):
        displayed in this notebook, as ``%%remote --kernel`` does."""
        from .kernel import NotebookOutput

        return NotebookOutput(bridges=self.state.bridges)

    def close(self) -> None:
        """Unregister the post-cell hooks, stop ``--watch`` threads, close every connection.

        Called by ``%unload_ext gpumagic`` and ``%reload_ext gpumagic``; safe twice.  A hook
        kept elsewhere does nothing once this ran.
        """
        self.closed = True
        while self._hooks:
            event, hook = self._hooks.pop()
            try:
                self.shell.events.unregister(event, hook)
            except ValueError:  # already gone
                pass
        for name in list(self.status_watchers):
            self.status_watchers.pop(name).stop("stopped: gpumagic was unloaded")
        self.fleet.close_all()

    # -- %gpu ---------------------------------------------------------------------------

    @line_magic
    @returns_after_help
    def gpu(self, line: str = ""):
        """Drive rented GPU machines over SSH.  `%gpu help` lists the sub-commands."""
        return SUBCOMMANDS(self, line)

    def help_text(self) -> str:
        """What ``%gpu help`` prints: every sub-command with one line."""
        return SUBCOMMANDS.help_text()

    # -- %%remote -------------------------------------------------------------------------

    @magic_arguments()
    @argument_group("a cell (the default)", "It runs while you wait, its output streamed as it comes.")
    @argument("--python", action="store_true",
              help="run the cell with the remote python3 (default: bash); with --job too")
    @argument("--timeout", metavar="S", type=TIMEOUT_S, help="stop the cell after S seconds (with --kernel too)")
    @argument("--no-raise-error", action="store_true",
              help="do not raise when the cell exits non-zero (Run All continues; with --kernel too)")
    @argument_group("every mode")
    @host_arg("machine to run on (default: the last connected)")
    @argument("--cwd", metavar="DIR", help="working directory for this cell")
    @argument("--env", metavar="K=V", action="append", default=[], help="environment variable (repeatable)")
    @argument("--grace", metavar="S", type=GRACE_S,
              help="a cell you wait for: keep it running for S seconds through a lost connection "
                   "(a Wi-Fi blink, a network change, a laptop asleep) and re-attach, showing what "
                   "it printed meanwhile once (default 600: %%config GpuMagics.grace; 0: stop it); "
                   "refused with --job and --kernel, which live on with no limit")
    @out_arg("the RunResult (stdout, stderr, exit_code)", " (with --job: the Job handle)")
    @argument_group("a detached job (--job NAME)",
                    "It survives disconnects and a closed laptop; the cell returns at once.")
    @argument("--job", metavar="NAME",
              help="start the cell as a detached job, and return at once "
                   "(see `%%gpu jobs`, `%%gpu logs NAME --follow`, `%%gpu kill NAME`)")
    @argument("--stop-on", metavar="KINDS",
              help="kill the job when its log shows one of nan,oom,traceback "
                   "(comma-separated; watched on the machine, so it works with the laptop closed)")
    @argument("--then-shutdown", metavar="MINUTES", type=MINUTES,
              help="shut the machine down MINUTES after the job succeeds (exit 0)")
    @argument("--no-alerts", action="store_true",
              help="do not show NaN/OOM/traceback alerts when following or listing")
    @checkpoint_args()
    @argument_group("torchrun and fan-out (with --job NAME)",
                    "One training run over the GPUs of one or more machines, or one job per machine.")
    @argument("--torchrun", metavar="N|auto",
              help="run the cell (a Python script, or `!command`) under PyTorch's torchrun "
                   "with N processes per machine (auto: one per visible GPU)")
    @argument("--torchrun-args", metavar="ARGS", help='with --torchrun: more torchrun options, e.g. "--max-restarts 1"')
    @argument("--hosts", metavar="A,B", help="connected machines to run on (one torchrun each, "
                                             "or with --each one job each)")
    @argument("--each", metavar="K=V", nargs="+",
              help='with --hosts: one environment setting per machine, e.g. --each "LR=1e-3" "LR=3e-4"')
    @argument("--same-dir", metavar="PATH", help="with --torchrun --hosts: a data folder that must match on every machine")
    @argument("--same-dir-hash", action="store_true", help="with --same-dir: compare contents (SHA-256), not just sizes")
    @argument_group("a live Python session (--kernel [NAME])",
                    "Python cells run in place on the machine; variables persist between cells.")
    @argument("--kernel", metavar="NAME", nargs="?", const="",
              help="run the cell in that session (default: the one used last, or the only one; "
                   "started on first use; see `%%gpu kernel`)")
    @cell_magic
    @returns_after_help
    def remote(self, line: str, cell: str):
        """Run this cell on the remote machine, with output streamed live.

        The cell is a bash script, or Python with --python.  A non-zero exit raises (so
        "Run All" stops) unless --no-raise-error.  Interrupting the kernel stops the
        cell's whole remote process tree, then raises KeyboardInterrupt.
        """
        args = parse(self.remote, line, cell=True)
        _refuse_grace_outside_a_cell(args)
        if args.kernel is not None:
            from .kernel import remote_cell

            return remote_cell(self, args, cell)
        if args.torchrun is not None or args.hosts is not None or args.each:
            from .torchrun import remote_cell as torchrun_cell

            return torchrun_cell(self, args, cell)
        if (args.job is not None or args.stop_on or args.then_shutdown is not None or args.no_alerts
                or keep_given(args) or args.resume_arg is not None or args.fallback is not None):
            return _remote_job(self, args, cell)
        machine = self.fleet.get(args.host)
        echo = OutputCap(self.max_display_bytes)
        try:
            # kept whole only for --out; else the last 64 KiB of each stream (the error's
            # and the failure hint's), so a cell printing gigabytes costs no memory here
            result = machine.run(cell, python=args.python, cwd=args.cwd, env=env_pairs(args.env),
                                 timeout=args.timeout, stdout=echo.stdout, stderr=echo.stderr,
                                 capture=True if args.out else UNKEPT_TAIL,
                                 grace=self.grace if args.grace is None else args.grace,
                                 interrupt_wait=self.interrupt_wait)
        except KeyboardInterrupt:
            raise Interrupted(f"interrupted; the cell's processes on {machine.name} were stopped") from None
        echo.finish()
        if args.out:
            self.shell.user_ns[args.out] = result
        hint = failure_hint(result.stderr, result.exit_code) if result.exit_code != 0 else None
        if result.exit_code != 0 and not args.no_raise_error:
            kind = "python cell" if args.python else "cell"
            raise RemoteCommandError(f"{kind} on {machine.name} exited with code {result.exit_code}",
                                     exit_code=result.exit_code, stdout=result.stdout,
                                     stderr=result.stderr, hint=hint)
        if result.exit_code != 0:
            print(f"(exit code {result.exit_code})", file=sys.stderr)
        if hint:
            print(f"hint: {hint}", file=sys.stderr)
        return None


#: Characters of each stream of a %%remote cell kept without --out (what the failure hint and
#: the error read: the end of the output).
UNKEPT_TAIL = 64 * 1024


def _refuse_grace_outside_a_cell(args) -> None:
    """``--grace`` is for a cell you wait for; a session cell and a job outlive a lost
    connection with no limit, so the option given with them is refused (as UsageError)."""
    if args.grace is None:
        return
    if args.kernel is not None:
        raise UsageError("--grace does not apply to --kernel: a session and its running cell live on "
                         "through a lost connection and re-attach by themselves (`%gpu kernel stop NAME` "
                         "ends one); drop --grace")
    if args.job is not None or args.torchrun is not None or args.hosts is not None or args.each:
        raise UsageError("--grace does not apply to --job: a job runs on through a lost connection "
                         "until it ends (`%gpu logs NAME -f` follows it, `%gpu kill NAME` stops it); "
                         "drop --grace")


# -- %load_ext / %unload_ext / %reload_ext gpumagic -------------------------------------------


def load(shell) -> GpuMagics:
    """Register ``%gpu`` and ``%%remote`` with ``shell`` (``%load_ext gpumagic``)."""
    from .kernel import skip_blank_kernel_cells_in

    magics = GpuMagics(shell=shell)
    shell.register_magics(magics)
    skip_blank_kernel_cells_in(shell)  # an empty %%remote --kernel cell does nothing, as locally
    shell._gpumagic = magics  # reached by unload and by tests
    return magics


def unload(shell) -> None:
    """Undo :func:`load` (``%unload_ext gpumagic``, and the first half of ``%reload_ext``):
    the post-cell hooks are unregistered and every connection is closed."""
    from .kernel import skip_blank_kernel_cells

    magics = getattr(shell, "_gpumagic", None)
    if magics is not None:
        magics.close()
    if skip_blank_kernel_cells in getattr(shell, "input_transformers_cleanup", []):
        shell.input_transformers_cleanup.remove(skip_blank_kernel_cells)


__all__ = ["GpuMagics", "SUBCOMMANDS", "load", "unload", "budget_alert_hook", "hosts_table",
           "show_public_key", "split_args", "split_pasted_ssh", "number", "parse",
           "PORT", "LOCAL_PORT", "MONEY", "LIMIT", "GB", "TIMEOUT_S", "MINUTES", "LINES", "GUARD_ALERT_POLL"]
