"""IPython layer: ``%gpu <sub-command>`` and ``%%remote``.

Each sub-command is a small function with its own ``magic_arguments`` parser, listed in
``SUBCOMMANDS``; magic methods parse, call the plain-Python API, and display.  Bad
arguments raise exactly ``UsageError``; everything else is a ``GpumagicError`` whose
``_render_traceback_`` shows a short message instead of a traceback.
"""

from __future__ import annotations

import argparse
import getpass
import keyword
import math
import os
import re
import shlex
import sys
import time
from typing import Callable

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display as ipy_display
from traitlets import Float, Int, Unicode

from . import display, widgets
from .. import keys as setup
from ..budget.ledger import MAX_AMOUNT, MAX_GB, MAX_RATE
from ..ssh import known_hosts
from .display import job_alert, job_ended, job_started, jobs_table, render_doctor, render_status
from ..errors import Interrupted, RemoteCommandError
from ..gpu.smi import Watcher, failure_hint
from ..ssh.hosts import (config_aliases, is_ssh_command, load_ssh_config, parse_ssh_command, parse_target, ssh_dir)
from ..remote.jobs import NAME_RE, parse_stop_on, scan_alerts
from ..session import Session

#: name -> (function(magics, line), one-line help).  Filled by ``@subcommand`` below.
SUBCOMMANDS: dict[str, tuple[Callable, str]] = {}


def subcommand(name: str, summary: str):
    """Register ``fn(magics, line)`` as ``%gpu NAME``; its docstring is its ``--help``."""

    def wrap(fn):
        SUBCOMMANDS[name] = (fn, summary)
        return fn

    return wrap


def split_args(line: str) -> list[str]:
    """Split a magic's argument line the way a shell would (``'./my dir/'``, ``X=a\\ b``).

    IPython's own splitter keeps the quotes in the words.  On Windows, backslashes are path
    separators, so only quotes are honoured there.

    Raises
    ------
    UsageError
        For an unclosed quote.
    """
    try:
        if os.name == "nt":
            return [w[1:-1] if len(w) > 1 and w[0] == w[-1] and w[0] in "'\"" else w
                    for w in shlex.split(line, posix=False)]
        return shlex.split(line)
    except ValueError as e:
        raise UsageError(f"cannot read the arguments ({e}): close the quote") from None


_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_INTEGER = re.compile(r"[+-]?[0-9]+")


def _fmt_bound(v: float) -> str:
    return f"{v:,.0f}" if float(v).is_integer() and abs(v) < 1e15 else f"{v:g}"


def number(lo: float, hi: float, *, integer: bool = False, above: bool = False, what: str = "a number"):
    """An argparse ``type`` for one numeric option: a finite number from ``lo`` to ``hi``.

    Used by every numeric option of every magic, so NaN, ``inf``, ``1e400``, ``-5`` where only
    ``>= 0`` makes sense, and digits that are not ASCII (``²``, ``١``) are all refused the same
    way: argparse turns the ``ArgumentTypeError`` into ``argument --NAME: ...``, which
    IPython's magic parser raises as exactly ``UsageError``.

    Parameters
    ----------
    lo, hi : float
        Inclusive bounds (``lo`` exclusive when ``above``).
    integer : bool
        Accept whole numbers only (``int``); otherwise ``float``.
    what : str
        What the number is, for the message ("seconds", "a port").
    """
    kind = "a whole number" if integer else "a finite number"
    span = (f"above {_fmt_bound(lo)}, at most {_fmt_bound(hi)}" if above
            else f"from {_fmt_bound(lo)} to {_fmt_bound(hi)}")
    rule = f"{what}, {span}"

    def convert(text: str):
        s = text.strip()
        pattern = _INTEGER if integer else _DECIMAL
        if not pattern.fullmatch(s):
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}; give {rule}")
        value = int(s) if integer else float(s)
        if not math.isfinite(value) or value < lo or value > hi or (above and value == lo):
            raise argparse.ArgumentTypeError(f"{text!r} is out of range; give {rule}")
        return value

    convert.__name__ = "integer" if integer else "number"  # argparse names the type in messages
    return convert


#: The numeric option types, one per kind of quantity (see :func:`number`).
PORT = number(1, 65535, integer=True, what="a TCP port")
LOCAL_PORT = number(0, 65535, integer=True, what="a local TCP port (0: any free one)")
#: Money per hour, per GB and so on (bounds: see gpumagic.budget).
MONEY = number(0, MAX_RATE, what="an amount")
LIMIT = number(0, MAX_AMOUNT, above=True, what="an amount")
GB = number(0, MAX_GB, what="GB")
TIMEOUT_S = number(0, 30 * 86400, above=True, what="seconds")
MINUTES = number(0, 30 * 24 * 60, what="minutes")
LINES = number(0, 10**9, integer=True, what="a number of lines")


def parse(fn, line: str, name: str | None = None):
    """Parse ``line`` with ``fn``'s magic_arguments parser; ``-h`` prints help.

    Returns None after printing help.  Bad arguments raise exactly ``UsageError``.
    """
    if name is not None:
        fn.parser.prog = f"%gpu {name}"
    argv = split_args(line)
    if any(tok in ("-h", "--help") for tok in argv):  # IPython's parser has add_help=False
        # IPython's parser formats help for docstrings ("::", "%%"); show it as typed.
        print("usage: " + fn.parser.format_help().lstrip(": \n").replace("%%", "%"))
        return None
    try:
        args = fn.parser.parse_args(argv)
    except SystemExit:  # argparse after printing --help
        return None
    for action in fn.parser._actions:  # Python < 3.12 parses `--host=--` as the value []
        value = getattr(args, action.dest, None)
        values = value if isinstance(action, argparse._AppendAction) and isinstance(value, list) else [value]
        if action.option_strings and action.nargs is None and any(isinstance(v, list) for v in values):
            raise UsageError(f"argument {'/'.join(action.option_strings)}: expected one value, not '--'")
    return args


def _env_pairs(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not key.replace("_", "a").isalnum() or key[0].isdigit():
            raise UsageError(f"--env {item!r}: write it as NAME=VALUE, e.g. --env CUDA_VISIBLE_DEVICES=0")
        env[key] = value
    return env


#: Seconds between checks of a remote guard's warning from the post-run-cell hook (the
#: default of ``GpuMagics.guard_alert_poll``).
GUARD_ALERT_POLL = 60.0


@magics_class
class GpuMagics(Magics):
    """``%gpu`` and ``%%remote``: run notebook cells on a rented GPU machine over SSH."""

    max_display_bytes = Int(
        5_000_000, config=True,
        help="Most characters of one cell's output shown in the notebook (the rest is still "
             "kept by --out); a browser tab slows down on tens of megabytes.",
    )

    guard_alert_poll = Float(
        GUARD_ALERT_POLL, config=True,
        help="Seconds between checks, after cells run, for a warning from a machine's budget guard "
             "(one SSH round trip each).",
    )

    default_cwd = Unicode(
        None, allow_none=True, config=True,
        help="Working directory for cells on newly connected machines (e.g. '/root/autodl-tmp').",
    )

    def __init__(self, shell=None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        self.session = Session()
        #: machine name -> running ``%gpu status --watch`` (a gpu.Watcher)
        self.status_watchers: dict = {}
        if shell is not None:  # budget alerts after each cell (see the budget section)
            shell.events.register("post_run_cell", _budget_post_run_cell(self))
            shell.events.register("post_run_cell", _tunnel_faults_post_run_cell(self))

    # -- %gpu ---------------------------------------------------------------------------

    @line_magic
    def gpu(self, line: str = ""):
        """Drive rented GPU machines over SSH.  `%gpu help` lists the sub-commands."""
        name, _, rest = line.strip().partition(" ")
        if not name or name in ("help", "-h", "--help"):
            print(self.help_text())
            return None
        if name not in SUBCOMMANDS:
            raise UsageError(f"unknown sub-command {name!r}; valid: {', '.join(sorted(SUBCOMMANDS))} "
                             "(see `%gpu help`)")
        fn, _ = SUBCOMMANDS[name]
        return fn(self, rest)

    def help_text(self) -> str:
        width = max(len(n) for n in SUBCOMMANDS)
        rows = [f"  %gpu {n.ljust(width)}  {summary}" for n, (_, summary) in sorted(SUBCOMMANDS.items())]
        return ("gpumagic: run cells on a rented GPU machine over SSH.\n\n"
                "  %%remote [--python] ...  run the cell on the machine (see %%remote?)\n"
                + "\n".join(rows)
                + "\n\n`%gpu NAME -h` shows a sub-command's options.")

    # -- %%remote -------------------------------------------------------------------------

    @magic_arguments()
    @argument("--python", action="store_true", help="run the cell with the remote python3 (default: bash)")
    @argument("--host", metavar="NAME", help="machine to run on (default: the last connected)")
    @argument("--cwd", metavar="DIR", help="working directory for this cell")
    @argument("--env", metavar="K=V", action="append", default=[], help="environment variable (repeatable)")
    @argument("--timeout", metavar="S", type=TIMEOUT_S, help="stop the cell after S seconds")
    @argument("--no-raise-error", action="store_true",
              help="do not raise when the cell exits non-zero (Run All continues)")
    @argument("--out", metavar="VAR", help="store the RunResult (stdout, stderr, exit_code) in VAR "
                                           "(with --job: the Job handle)")
    @argument("--job", metavar="NAME",
              help="start the cell as a detached job that survives disconnects, and return at once "
                   "(see `%%gpu jobs`, `%%gpu logs NAME --follow`, `%%gpu kill NAME`)")
    @argument("--stop-on", metavar="KINDS",
              help="with --job: kill the job when its log shows one of nan,oom,traceback "
                   "(comma-separated; watched on the machine, so it works with the laptop closed)")
    @argument("--then-shutdown", metavar="MINUTES", type=MINUTES,
              help="with --job: shut the machine down MINUTES after the job succeeds (exit 0)")
    @argument("--no-alerts", action="store_true",
              help="with --job: do not show NaN/OOM/traceback alerts when following or listing")
    @argument("--kernel", metavar="NAME", nargs="?", const="",
              help="run the cell in a live Python session on the machine, whose variables persist "
                   "(default: the one used last, or the only one; started on first use; see `%%gpu kernel`)")
    @argument("--torchrun", metavar="N|auto",
              help="with --job: run the cell (a Python script, or `!command`) under PyTorch's torchrun "
                   "with N processes per machine (auto: one per visible GPU)")
    @argument("--torchrun-args", metavar="ARGS", help='with --torchrun: more torchrun options, e.g. "--max-restarts 1"')
    @argument("--hosts", metavar="A,B", help="with --job: connected machines to run on (one torchrun each, "
                                             "or with --each one job each)")
    @argument("--each", metavar="K=V", nargs="+",
              help='with --hosts: one environment setting per machine, e.g. --each "LR=1e-3" "LR=3e-4"')
    @argument("--same-dir", metavar="PATH", help="with --torchrun --hosts: a data folder that must match on every machine")
    @argument("--same-dir-hash", action="store_true", help="with --same-dir: compare contents (SHA-256), not just sizes")
    @cell_magic
    def remote(self, line: str, cell: str):
        """Run this cell on the remote machine, with output streamed live.

        The cell is a bash script, or Python with --python.  A non-zero exit raises (so
        "Run All" stops) unless --no-raise-error.  Interrupting the kernel stops the
        cell's whole remote process tree, then raises KeyboardInterrupt.
        """
        args = parse(self.remote, line)
        if args is None:
            return None
        _check_out(args.out)
        if args.kernel is not None:
            from .kernel_magics import remote_cell
            return remote_cell(self, args, cell)
        if args.torchrun is not None or args.hosts is not None or args.each:
            from .torchrun_magics import remote_cell as torchrun_cell
            return torchrun_cell(self, args, cell)
        if args.job is not None or args.stop_on or args.then_shutdown is not None or args.no_alerts:
            return _remote_job(self, args, cell)
        machine = self.session.get(args.host)
        echo = _CappedEcho(self.max_display_bytes)
        try:
            result = machine.run(cell, python=args.python, cwd=args.cwd, env=_env_pairs(args.env),
                                 timeout=args.timeout, stdout=echo.stdout, stderr=echo.stderr)
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


class _CappedEcho:
    """Echo a cell's output to this kernel's stdout/stderr, up to ``limit`` characters in all.

    A browser tab slows to a crawl on tens of megabytes of output; past the limit the rest is
    not displayed (``--out VAR`` still keeps all of it) and one line says so.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.shown = 0
        self.dropped = 0

    def _write(self, stream, text: str) -> None:
        room = self.limit - self.shown
        if room > 0:
            part = text[:room]
            stream.write(part)
            stream.flush()
            self.shown += len(part)
            text = text[room:]
        self.dropped += len(text)

    def stdout(self, text: str) -> None:
        self._write(sys.stdout, text)

    def stderr(self, text: str) -> None:
        self._write(sys.stderr, text)

    def finish(self) -> None:
        if self.dropped:
            print(f"\n[gpumagic: {self.dropped:,} more characters were not displayed (limit "
                  f"{self.limit:,}); --out VAR keeps all output; raise it with "
                  f"%config GpuMagics.max_display_bytes = N]", file=sys.stderr)


# -- sub-commands ------------------------------------------------------------------------


@subcommand("connect", "connect to a machine: ~/.ssh/config alias, user@host[:port] or a pasted ssh line")
@magic_arguments()
@argument("target", nargs="?",
          help="~/.ssh/config alias, [user@]host[:port], or the platform's ssh command line "
               "(ssh -p 41022 root@203.0.113.10), quoted or not")
@argument("-p", "--port", type=PORT, help="SSH port (like ssh -p)")
@argument("-i", "--identity", metavar="KEYFILE", help="private key file (like ssh -i)")
@argument("-J", "--jump", metavar="JUMP", help="ProxyJump host(s), comma-separated (like ssh -J)")
@argument("-l", "--user", help="login user (like ssh -l)")
@argument("--name", help="name for this machine in gpumagic (default: the target)")
@argument("--cwd", metavar="DIR", help="working directory for this machine's cells")
@argument("--trust-new-host", action="store_true",
          help="add the host's key to ~/.ssh/known_hosts if it is not known yet (never if it changed)")
@argument("--sandbox", action="store_true", help="start a local throwaway sshd and connect to it")
@argument("--fake-gpu", metavar="RECORDING",
          help="sandbox only: replay a recorded GPU through a stand-in nvidia-smi (h200-idle, h200-load)")
@argument("--save", metavar="NAME",
          help="also write a `Host NAME` block to ~/.ssh/config (for ssh NAME and VS Code) and connect by it")
@argument("--replace", action="store_true", help="with --save: replace an existing Host NAME block")
def _connect(magics: GpuMagics, line: str):
    pasted, line = split_pasted_ssh(line)
    args = parse(_connect, line, "connect")
    if args is None:
        return
    if pasted is not None:
        if args.target:
            raise UsageError(f"give either the ssh command or a target, not both ({args.target!r})")
        args.target = pasted
    save = _prepare_save(args) if args.save else None
    if not args.target and not args.sandbox:
        raise UsageError("name a machine: `%gpu connect ALIAS` or `%gpu connect user@host:port` "
                         "(or `%gpu connect --sandbox` to try gpumagic locally)")
    if args.fake_gpu and not args.sandbox:
        raise UsageError("--fake-gpu only applies to --sandbox")
    start = time.monotonic()
    options = dict(port=args.port, key=args.identity, jump=args.jump, user=args.user,
                   name=args.name, cwd=args.cwd or magics.default_cwd,
                   trust_new_host=args.trust_new_host)
    if args.sandbox:
        m = magics.session.connect(None, sandbox=True, fake_gpu=args.fake_gpu, name=args.name,
                                   cwd=options["cwd"])
        gpu = f"replaying recorded {args.fake_gpu} (not a real GPU)" if args.fake_gpu else "no GPU"
        print(f"sandbox machine up: a local sshd at {m.spec.address} ({gpu}); "
              f"it stops when the kernel exits")
    else:
        m = magics.session.connect(args.target, **options)
    for note in m.connection.notes:
        print(note)
    print(f"connected to {m.name} ({m.spec.user}@{m.spec.address}) in "
          f"{time.monotonic() - start:.2f} s; %%remote cells run there")
    if save is not None:  # only after the line proved to work: no block from a mistyped line
        _print_add_host(save())


@subcommand("kernel", "a live Python session on the machine: start, list, attach, push, pull, stop, autorun")
def _kernel(magics: GpuMagics, line: str):
    """`%gpu kernel SUB ...`: see gpumagic/notebook/kernel_magics.py (`%gpu kernel` lists the SUBs)."""
    from .kernel_magics import dispatch
    return dispatch(magics, line)


@subcommand("disconnect", "close a machine's connection (default: the current one)")
@magic_arguments()
@argument("name", nargs="?", help="machine name (default: the current one)")
def _disconnect(magics: GpuMagics, line: str):
    args = parse(_disconnect, line, "disconnect")
    if args is None:
        return
    m = magics.session.disconnect(args.name)
    print(f"disconnected from {m.name}")


@subcommand("hosts", "list ~/.ssh/config aliases and which machines are connected")
@magic_arguments()
def _hosts(magics: GpuMagics, line: str):
    args = parse(_hosts, line, "hosts")
    if args is None:
        return
    print(hosts_table(magics.session))


def hosts_table(session: Session) -> str:
    """Text table: every config alias and connected machine, with its state."""
    config = load_ssh_config()
    rows = [("NAME", "TARGET", "STATE")]
    names = list(dict.fromkeys(config_aliases(config) + list(session.machines)))
    for name in names:
        m = session.machines.get(name)
        if m is not None:
            target = f"{m.spec.user}@{m.spec.address}"
            state = "connected" if m.is_connected else "closed"
            if session.default == name:
                state += " (default)"
        else:
            found = config.lookup(name)
            target = f"{found.get('user', '')}{'@' if found.get('user') else ''}{found.get('hostname', name)}:{found.get('port', 22)}"
            state = "-"
        rows.append((name, target, state))
    if len(rows) == 1:
        return "no machines: add a Host block to ~/.ssh/config or run `%gpu connect user@host:port`"
    return display.text_table(rows)


@subcommand("forget", "remove a host's key from ~/.ssh/known_hosts (after rebuilding an instance)")
@magic_arguments()
@argument("host", help="HOST or HOST:PORT, as named in the changed-key message")
def _forget(magics: GpuMagics, line: str):
    args = parse(_forget, line, "forget")
    if args is None:
        return
    target = parse_target(args.host)
    path = ssh_dir() / "known_hosts"
    port = target.port or 22
    n = known_hosts.forget(path, target.host, port)
    name = known_hosts.known_name(target.host, port)
    if n:
        print(f"removed {n} line(s) for {name} from {path} (previous file kept as {path}.old)")
    else:
        print(f"{path} has no entry for {name}; nothing changed")


@subcommand("cd", "set the working directory for the current machine's cells")
@magic_arguments()
@argument("dir", help="directory on the machine (absolute, ~/..., or relative to the current one)")
@argument("--host", metavar="NAME", help="machine (default: the current one)")
def _cd(magics: GpuMagics, line: str):
    args = parse(_cd, line, "cd")
    if args is None:
        return
    m = magics.session.get(args.host)
    print(f"{m.name}: cells now run in {m.cd(args.dir)}")


# -- setup: keygen, add-host, install-key, pasted ssh lines ------------------------------

#: gpumagic's own ``%gpu connect`` options that may follow an unquoted pasted ssh line
#: (ssh itself has no long options, so a ``--word`` there is always ours).
_CONNECT_LONG_WITH_VALUE = ("--save", "--name", "--cwd")


def split_pasted_ssh(line: str, with_value: tuple[str, ...] = _CONNECT_LONG_WITH_VALUE
                     ) -> tuple[str | None, str]:
    """Separate a pasted ``ssh ...`` command from ``%gpu connect``'s own options.

    ``%gpu connect "ssh -p 41022 root@h" --save gpu`` and the unquoted
    ``%gpu connect ssh -p 41022 root@h --save gpu`` both give
    ``("ssh -p 41022 root@h", "--save gpu")``.  Any other line comes back unchanged with None.
    """
    try:
        tokens = shlex.split(line)
    except ValueError:
        return None, line
    ours: list[str] = []
    while tokens and tokens[0].startswith("--"):  # our options may also come first
        ours.append(tokens.pop(0))
        if ours[-1] in with_value and tokens:
            ours.append(tokens.pop(0))
    if tokens and tokens[0] == "$":
        tokens = tokens[1:]
    if not tokens:
        return None, line
    if is_ssh_command(tokens[0]) and tokens[0] != "ssh":  # quoted as one argument
        return tokens[0], shlex.join(ours + tokens[1:])
    if tokens[0] != "ssh":
        return None, line
    ssh_part = ["ssh"]
    it = iter(tokens[1:])
    for tok in it:
        if tok.startswith("--") and len(tok) > 2:
            ours.append(tok)
            if tok in with_value:
                ours.append(next(it, ""))
        else:
            ssh_part.append(tok)
    return shlex.join(ssh_part), shlex.join(ours)


def _prepare_save(args) -> Callable[[], "setup.AddHostResult"]:
    """``--save NAME``: check now that the Host block can be written; write it when called.

    Checked before connecting (bad name, a different ``Host NAME`` already there), written
    after the connection succeeded.
    """
    if args.sandbox:
        raise UsageError("--save does not apply to --sandbox (its port changes every time)")
    if not args.target:
        raise UsageError("--save NAME needs a machine: the pasted ssh line or user@host[:port]")
    if is_ssh_command(args.target):
        cmd = parse_ssh_command(args.target)
        opts = dict(cmd.options)
        host = opts.pop("HostName", cmd.host)
        port, user, key, jump = cmd.port, cmd.user, cmd.key, cmd.jump
    else:
        t = parse_target(args.target)
        if t.host in config_aliases(load_ssh_config()):
            raise UsageError(f"{t.host} is already a Host in ~/.ssh/config; connect to it by name, "
                             f"or use `%gpu add-host {args.save} --hostname ...`")
        opts, host, port, user, key, jump = {}, t.host, t.port, t.user, None, None
    block = dict(name=args.save, hostname=host, port=args.port or port, user=args.user or user,
                 key=args.identity or key, jump=args.jump or jump, options=opts,
                 replace=args.replace)
    setup.add_host(dry_run=True, **block)  # raises HostExists / ConfigError before connecting
    args.name = args.name or args.save
    return lambda: setup.add_host(**block)


def _print_add_host(result: "setup.AddHostResult") -> None:
    name = result.block.split()[1]
    if result.action == "unchanged":
        print(f"{result.path} already has this `Host {name}` block; nothing changed")
        return
    if result.action == "replaced":
        print(f"replaced this block in {result.path}:\n{result.old_block.rstrip()}\nwith:")
    else:
        print(f"added to {result.path}:")
    print(result.block.rstrip())
    if result.backup is not None:
        print(f"(previous file kept as {result.backup})")
    for note in result.notes:
        print(f"note: {note}")
    print(f"now `ssh {name}`, VS Code Remote-SSH and `%gpu connect {name}` all reach it")


def _ask_new_passphrase() -> str:
    first = getpass.getpass("Passphrase for the new key: ")
    if not first:
        raise UsageError("empty passphrase: leave out --passphrase for a key without one")
    if getpass.getpass("Same passphrase again: ") != first:
        raise UsageError("the two passphrases differ; run keygen again")
    return first


@subcommand("keygen", "make an ed25519 SSH key pair and show the public key to paste")
@magic_arguments()
@argument("--path", metavar="FILE", help="private key file (default ~/.ssh/id_ed25519; FILE.pub gets the public key)")
@argument("--comment", metavar="TEXT", help="comment at the end of the public key (default user@host)")
@argument("--passphrase", action="store_true", help="encrypt the private key; asks for the passphrase (not echoed)")
def _keygen(magics: GpuMagics, line: str):
    args = parse(_keygen, line, "keygen")
    if args is None:
        return
    passphrase = _ask_new_passphrase() if args.passphrase else None
    pair = setup.keygen(args.path, comment=args.comment, passphrase=passphrase)
    show_public_key(pair, magics.shell)


@subcommand("add-host", "add a Host block to ~/.ssh/config (keeps the rest of the file as it is)")
@magic_arguments()
@argument("name", help="the alias: then `ssh NAME`, VS Code Remote-SSH and `%%gpu connect NAME` work")
@argument("--hostname", required=True, metavar="H", help="address or DNS name of the machine")
@argument("-p", "--port", type=PORT, help="SSH port")
@argument("-l", "--user", help="login user")
@argument("-i", "--key", metavar="FILE", help="private key file (IdentityFile)")
@argument("-J", "--jump", metavar="JUMP", help="ProxyJump host(s), comma-separated")
@argument("--alive-interval", type=number(0, 86400, integer=True, what="seconds"), default=30, metavar="S",
          help="ServerAliveInterval in seconds (default 30; 0 leaves it out)")
@argument("--alive-count", type=number(0, 1000, integer=True, what="a count"), default=3, metavar="N", help="ServerAliveCountMax (default 3)")
@argument("--replace", action="store_true", help="replace an existing Host NAME block (shows the old one)")
def _add_host(magics: GpuMagics, line: str):
    args = parse(_add_host, line, "add-host")
    if args is None:
        return
    interval = args.alive_interval or None
    result = setup.add_host(args.name, args.hostname, port=args.port, user=args.user, key=args.key,
                            jump=args.jump, server_alive_interval=interval,
                            server_alive_count_max=args.alive_count if interval else None,
                            replace=args.replace)
    _print_add_host(result)


@subcommand("install-key", "copy your public key to a machine that allows a password login (once)")
@magic_arguments()
@argument("target", nargs="?", help="[user@]host[:port], a ~/.ssh/config alias, or the platform's ssh line")
@argument("-i", "--key", metavar="FILE", help="private key whose .pub to install (default: the host's IdentityFile or ~/.ssh/id_ed25519)")
@argument("-p", "--port", type=PORT, help="SSH port")
@argument("-l", "--user", help="login user")
@argument("-J", "--jump", metavar="JUMP", help="ProxyJump host(s)")
@argument("--trust-new-host", action="store_true", help="add an unknown host key to known_hosts (never a changed one)")
def _install_key(magics: GpuMagics, line: str):
    pasted, line = split_pasted_ssh(line, with_value=("--key",))
    args = parse(_install_key, line, "install-key")
    if args is None:
        return
    args.target = pasted or args.target
    if not args.target:
        raise UsageError("name the machine: `%gpu install-key root@203.0.113.10:41022` "
                         "or paste its ssh line after install-key")
    r = setup.install_key(args.target, key=args.key, port=args.port, user=args.user, jump=args.jump,
                          trust_new_host=args.trust_new_host, password_prompt=getpass.getpass)
    where = f"{r.spec.user}@{r.spec.address}"
    if r.state == "added":
        print(f"added key {r.fingerprint} to ~/.ssh/authorized_keys on {where}")
    else:
        print(f"key {r.fingerprint} was already in ~/.ssh/authorized_keys on {where}; nothing added")
    print(f"key login to {where} works" + ("" if r.used_password else " (no password was needed)"))


# -- GPU status and doctor ---------------------------------------------------------------


@subcommand("status", "GPU memory, utilisation, temperature, power and processes (--watch N refreshes)")
@magic_arguments()
@argument("--watch", metavar="SECONDS", type=number(1, 86400, what="seconds"), help="refresh in place every SECONDS (>= 1)")
@argument("--stop", action="store_true", help="stop a running --watch")
@argument("--text", action="store_true", help="plain text instead of the widget")
@argument("--host", metavar="NAME", help="machine (default: the current one)")
def _status(magics: GpuMagics, line: str):
    """Per GPU: memory and utilisation bars, temperature, power, and the processes using it.

    One SSH round trip per refresh.  With --watch the widget refreshes in place from a background
    thread until `%gpu status --stop`, a disconnect, or three failed refreshes in a row.
    """
    args = parse(_status, line, "status")
    if args is None:
        return
    if args.stop:
        names = [args.host] if args.host else list(magics.status_watchers)
        stopped = []
        for name in names:
            watcher = magics.status_watchers.pop(name, None)
            if watcher is not None and watcher.running:
                watcher.stop()
                stopped.append(name)
        print(f"stopped watching {', '.join(stopped)}" if stopped else "no --watch is running")
        return
    if args.watch is not None and args.text:
        raise UsageError("--watch updates a widget in place: drop --text")
    m = magics.session.get(args.host)
    status = m.gpu_status()
    if args.text:
        print(render_status(status).text)
        return
    if not widgets.available() or (args.watch is not None and not widgets.can_show(magics.shell)):
        ipy_display(render_status(status))
        if args.watch is not None:  # no thread refreshing a view nobody sees
            why = ("ipywidgets is not installed (pip install ipywidgets)" if not widgets.available()
                   else "this front end (no Jupyter kernel) cannot show one")
            print(f"not watching: --watch refreshes a widget, and {why}; "
                  "run `%gpu status --text` again, or use a notebook")
        return
    view = widgets.status_widget(status)
    ipy_display(view)
    if args.watch is not None:
        old = magics.status_watchers.pop(m.name, None)
        if old is not None:
            old.stop("stopped: a newer `%gpu status --watch` took over")
        view.set_note(f"refreshing every {args.watch:g} s; `%gpu status --stop` stops it")
        magics.status_watchers[m.name] = Watcher(
            lambda prev: m.gpu_status(cuda_version=prev.known_cuda if prev else None),
            view.update, view.set_note, interval=args.watch,
            is_connected=lambda: m.is_connected, previous=status).start()


@subcommand("doctor", "preflight: GPU model and memory, PyTorch CUDA vs driver, disks, python, tools")
@magic_arguments()
@argument("--expect-gpu", metavar="NAME", help='GPU model rented, e.g. "H200" (matched in the name)')
@argument("--expect-count", metavar="N", type=number(1, 1024, integer=True, what="a number of GPUs"), help="number of GPUs rented")
@argument("--sample", metavar="SECONDS", type=number(0, 600, integer=True, what="seconds"), default=0,
          help="also sample GPU and CPU utilisation for SECONDS (run it while training runs)")
@argument("--host", metavar="NAME", help="machine (default: the current one)")
@argument("--hosts", metavar="A,B", help="run the torchrun preflight across these machines instead")
def _doctor(magics: GpuMagics, line: str):
    """Preflight checks, each ok / WARN / FAIL with a one-line fix, gathered in one round trip.

    GPU model and count against what was rented, GPU memory already in use, the remote
    PyTorch's CUDA build against the driver, disks (the largest data disk, a small system
    disk holding the working directory, disks over 90% full), Python, venv/conda, tmux, rsync.
    """
    args = parse(_doctor, line, "doctor")
    if args is None:
        return
    if args.hosts is not None:
        from .torchrun_magics import doctor_hosts
        return doctor_hosts(magics, args)
    m = magics.session.get(args.host)
    ipy_display(render_doctor(m.doctor(expect_gpu=args.expect_gpu, expect_count=args.expect_count,
                                       sample=args.sample)))


# -- sync ---------------------------------------------------------------------------------


@subcommand("sync", "copy files to or from a machine, sending only what changed (like rsync -a)")
@magic_arguments()
@argument("src", help="source: local path, or :REMOTE_PATH / NAME:REMOTE_PATH; a trailing / copies the contents")
@argument("dst", help="destination: the other side (exactly one side is remote)")
@argument("--delete", action="store_true", help="delete destination files the source lacks (listed)")
@argument("--exclude", metavar="PATTERN", action="append", default=[],
          help="leave out paths matching this gitignore-style pattern (repeatable)")
@argument("--no-ignore-files", action="store_true", help="do not honour .gitignore / .gpuignore files")
@argument("--dry-run", action="store_true", help="change nothing; list what would be sent and deleted")
@argument("--checksum", action="store_true", help="compare files by content hash, not size and mtime")
@argument("--update", action="store_true", help="never replace a destination file that is newer")
@argument("--host", metavar="NAME", help="machine for :PATH (default: the current one)")
@argument("--from-all", action="store_true", help="pull :PATH from every connected machine into DST/<machine>/")
def _sync(magics: GpuMagics, line: str):
    args = parse(_sync, line, "sync")
    if args is None:
        return
    if args.from_all:
        from .torchrun_magics import sync_from_all
        return sync_from_all(magics, args)
    from ..sync import engine as sync
    from . import widgets
    from ..errors import ConfigError

    try:
        src, dst = sync.parse_endpoint(args.src), sync.parse_endpoint(args.dst)
    except ConfigError as e:
        raise UsageError(e.message) from None
    try:
        sync.IgnoreRules(args.exclude)  # a malformed --exclude, named before anything starts
    except ConfigError as e:
        raise UsageError(f"{e.message}; {e.hint}") from None
    if src.remote == dst.remote:
        raise UsageError("exactly one side must be remote: `%gpu sync ./project/ :/workspace/project/` "
                         "pushes, `%gpu sync :/workspace/runs/ ./runs/` pulls")
    remote = src if src.remote else dst
    if remote.host and args.host and remote.host != args.host:
        raise UsageError(f"{remote.host}:... and --host {args.host} name different machines; use one")
    m = magics.session.get(remote.host or args.host)
    options = dict(delete=args.delete, exclude=args.exclude, ignore_files=not args.no_ignore_files,
                   dry_run=args.dry_run, checksum=args.checksum, update=args.update)
    progress = options["progress"] = None if args.dry_run else widgets.sync_progress()
    summary = None
    try:
        sync_once = m.pull if src.remote else m.push
        summary = sync_once(src.path, dst.path, **options)
    finally:  # the bar's line ends before an error is shown
        if progress is not None:
            progress.close(failed=summary is None)
    print(summary)
# -- jobs ---------------------------------------------------------------------------------


def _job_name(name: str) -> str:
    if not NAME_RE.fullmatch(name):
        raise UsageError(f"{name!r} is not a job name: use letters, digits, '-' and '_' (see `%gpu jobs`)")
    return name


def _remote_job(magics: GpuMagics, args, cell: str):
    """``%%remote --job NAME ...``: start the cell detached and return at once."""
    if args.job is None:
        raise UsageError("--stop-on, --then-shutdown and --no-alerts need --job NAME")
    if not NAME_RE.fullmatch(args.job):
        raise UsageError(f"--job {args.job!r}: use letters, digits, '-' and '_' (e.g. --job train-1)")
    if args.timeout is not None:
        raise UsageError("--timeout does not apply to --job (a job runs until it ends or `%gpu kill NAME`)")
    try:
        stop_on = parse_stop_on(args.stop_on)
    except Exception as e:
        raise UsageError(f"--stop-on {args.stop_on!r}: {getattr(e, 'hint', e)}") from None
    machine = magics.session.get(args.host)
    job = machine.start_job(args.job, cell, python=args.python, cwd=args.cwd,
                            env=_env_pairs(args.env), stop_on=stop_on,
                            then_shutdown=args.then_shutdown, alerts=not args.no_alerts)
    if job.note and job.runner not in machine.notes_shown:
        machine.notes_shown.add(job.runner)
        print(job.note)
    print(job_started(job, machine.name))
    if args.out:
        magics.shell.user_ns[args.out] = job


def _show_alerts(info, alerts=None) -> None:
    seen = set()
    for a in (info.alerts if alerts is None else alerts):
        if a.kind not in seen:
            seen.add(a.kind)
            ipy_display(job_alert(info.name, a, stopped=(info.killed == a.kind)))


@subcommand("jobs", "list the detached jobs on a machine: state, start, run time, last line")
@magic_arguments()
@argument("--host", metavar="NAME", help="machine (default: the current one)")
@argument("--all", action="store_true", help="one table over every connected machine")
def _jobs(magics: GpuMagics, line: str):
    args = parse(_jobs, line, "jobs")
    if args is None:
        return
    if args.all:
        from .torchrun_magics import jobs_all
        return jobs_all(magics)
    machine = magics.session.get(args.host)
    infos = machine.jobs()
    ipy_display(jobs_table(infos, machine.name))
    for info in infos:
        _show_alerts(info)


def _follow(magics: GpuMagics, name: str, host: str | None, lines: int | None) -> None:
    machine = magics.session.get(host)
    job = machine.job(_job_name(name))
    before = job.info()
    seen: set[str] = set()

    def alert(a):
        if a.kind not in seen:  # one alert per kind while following
            seen.add(a.kind)
            ipy_display(job_alert(name, a, stopped=a.kind in before.stop_on))

    try:
        info = job.follow(alert=alert, lines=lines)
    except KeyboardInterrupt:
        raise Interrupted(f"stopped following {name}; the job keeps running on {machine.name} "
                          f"(`%gpu attach {name}` follows it again)") from None
    print(job_ended(info))


@subcommand("logs", "show a job's output; --follow streams it until the job ends")
@magic_arguments()
@argument("name", help="job name (see `%%gpu jobs`)")
@argument("-n", "--lines", type=LINES, default=100, help="how many last lines to show (default 100; 0: all)")
@argument("-f", "--follow", action="store_true",
          help="keep printing new output until the job ends (interrupting stops following, never the job)")
@argument("--host", metavar="NAME", help="machine (default: the current one)")
@argument("--rank", metavar="R", type=number(0, 1 << 20, integer=True, what="a rank"), help="a torchrun job: show global rank R's lines (default 0)")
@argument("--all", action="store_true", help="a torchrun job: every rank's lines, prefixed [host:rank]")
def _logs(magics: GpuMagics, line: str):
    args = parse(_logs, line, "logs")
    if args is None:
        return
    if args.rank is not None or args.all:
        from .torchrun_magics import logs as torchrun_logs
        return torchrun_logs(magics, args)
    lines = args.lines or None
    if args.follow:
        return _follow(magics, args.name, args.host, lines)
    machine = magics.session.get(args.host)
    job = machine.job(_job_name(args.name))
    text = job.logs(lines)
    print(text, end="" if text.endswith("\n") or not text else "\n")
    info = job.info()
    if info.alerts_enabled:
        _show_alerts(info, scan_alerts(text.splitlines()))


@subcommand("attach", "show a job's earlier output, then follow it until it ends")
@magic_arguments()
@argument("name", help="job name (see `%%gpu jobs`)")
@argument("-n", "--lines", type=LINES, default=1000, help="earlier lines to show first (default 1000; 0: all)")
@argument("--host", metavar="NAME", help="machine (default: the current one)")
def _attach(magics: GpuMagics, line: str):
    args = parse(_attach, line, "attach")
    if args is None:
        return
    _follow(magics, args.name, args.host, args.lines or None)


@subcommand("kill", "end a job's whole process tree; --shutdown cancels its pending shutdown")
@magic_arguments()
@argument("name", help="job name (see `%%gpu jobs`)")
@argument("--shutdown", action="store_true",
          help="cancel the shutdown armed by --then-shutdown instead (the job itself is left alone)")
@argument("--host", metavar="NAME", help="machine (default: the current one)")
def _kill(magics: GpuMagics, line: str):
    args = parse(_kill, line, "kill")
    if args is None:
        return
    machine = magics.session.get(args.host)
    job = machine.job(_job_name(args.name))
    from .torchrun_magics import kill as torchrun_kill
    if not args.shutdown and torchrun_kill(magics, machine, args.name):
        return
    if args.shutdown:
        what = job.cancel_shutdown()
        print({"cancelled": f"cancelled the shutdown of {machine.name} armed by job {args.name}",
               "none": f"job {args.name} armed no shutdown; nothing to cancel",
               "started": f"too late: the shutdown armed by job {args.name} has already run"}[what])
        return
    info = job.info()
    if not info.running:
        extra = (f"; its {info.shutdown_text} (`%gpu kill {args.name} --shutdown` cancels it)"
                 if info.shutdown_state == "pending" else "")
        print(f"job {args.name} is not running ({info.state_text}); nothing to kill{extra}")
        return
    info = job.kill()
    print(f"killed job {args.name} on {machine.name}: {info.state_text}; "
          "its whole process tree was stopped")
# -- budget ------------------------------------------------------------------------------


def _budget_ledger(magics: GpuMagics):
    """The ledger (a fresh object per command, so notes are this command's)."""
    from ..budget.ledger import Ledger

    return Ledger()
# -- tunnels -----------------------------------------------------------------------------


def _show(obj) -> None:
    from IPython.display import display

    display(obj)


def _budget_notes(ledger) -> None:
    """Show the ledger's notes (a damaged record left out, ...) once each."""
    from .display import AlertView

    while ledger.notes:
        _show(AlertView(ledger.notes.pop(0)))


def _usage(fn, *args, **kw):
    """Call a pure parser; its ValueError becomes exactly UsageError."""
    try:
        return fn(*args, **kw)
    except ValueError as e:
        raise UsageError(str(e)) from None


@magic_arguments()
@argument("--host", metavar="NAME", help="machine (default: the current one)")
def _budget_meter(magics: GpuMagics, line: str):
    """Show the meter: spent so far, rate, limit, next billing boundary, the guard."""
    args = parse(_budget_meter, line, "budget")
    if args is None:
        return
    from .display import AlertView, MeterView

    ledger = _budget_ledger(magics)
    reading = magics.session.get(args.host).budget_meter(ledger=ledger)
    _budget_notes(ledger)
    _show(MeterView(reading))
    for t in reading.crossed:
        _show(AlertView(f"{reading.machine} has spent {reading.prices.money(reading.spent)}, "
                        f"past your alert at {reading.prices.money(t)}"))


@magic_arguments()
@argument("--rate", type=MONEY, metavar="PER_HOUR", help="instance (GPU) price per hour")
@argument("--currency", help="shown after amounts (CNY, USD, ...); never converted")
@argument("--billing", choices=("second", "minute", "hour"), help="billing granularity (a started unit costs in full)")
@argument("--platform", help="preset: generic, autodl, vastai, runpod, lambda (billing, data disk, how to stop)")
@argument("--storage-gb", type=GB, metavar="GB", help="extra disk size")
@argument("--storage-rate-month", type=MONEY, metavar="PER_GB_MONTH", help="disk price per GB per month (30 days)")
@argument("--storage-rate-day", type=MONEY, metavar="PER_GB_DAY", help="disk price per GB per day")
@argument("--image-gb", type=GB, metavar="GB", help="saved images / snapshots size")
@argument("--image-rate-month", type=MONEY, metavar="PER_GB_MONTH", help="image price per GB per month")
@argument("--image-rate-day", type=MONEY, metavar="PER_GB_DAY", help="image price per GB per day")
@argument("--ip-rate", type=MONEY, metavar="PER_HOUR", help="reserved public IP price per hour")
@argument("--started-at", metavar="TIME", help="billing start: HH:MM, -2h, ISO time (default: the machine's start)")
@argument("--alert", metavar="AMOUNTS", help="alert thresholds, e.g. 10,20")
@argument("--limit", type=LIMIT, metavar="AMOUNT", help="spending limit (meter bar; --at-limit guard)")
@argument("--host", metavar="NAME", help="machine (default: the current one)")
def _budget_set(magics: GpuMagics, line: str):
    """Store the machine's prices and thresholds (kept in the ledger across kernel restarts)."""
    # `--started-at -2h` reads naturally; argparse would take -2h for an option
    line = re.sub(r"(--started-at)\s+(-\S+)", r"\1=\2", line)
    args = parse(_budget_set, line, "budget set")
    if args is None:
        return
    import dataclasses

    from ..budget import ledger as budget

    for kind in ("storage", "image"):
        if getattr(args, f"{kind}_rate_month") is not None and getattr(args, f"{kind}_rate_day") is not None:
            raise UsageError(f"give --{kind}-rate-month or --{kind}-rate-day, not both")
    name = args.host or magics.session.get(None).name
    ledger = _budget_ledger(magics)
    old = ledger.machine(name)
    _budget_notes(ledger)
    changes = {k: getattr(args, k) for k in ("rate", "currency", "billing", "storage_gb", "image_gb", "ip_rate")
               if getattr(args, k) is not None}
    for kind in ("storage", "image"):
        for per in ("month", "day"):
            v = getattr(args, f"{kind}_rate_{per}")
            if v is not None:
                changes[f"{kind}_rate"], changes[f"{kind}_per"] = v, per
    preset = None
    if args.platform:
        preset = budget.platform(args.platform)
        changes["platform"] = args.platform.lower()
        changes.setdefault("billing", preset["billing"])
    if old and "prices" in old:
        prices = dataclasses.replace(budget.Prices.from_dict(old["prices"]), **changes)
    elif "rate" in changes:
        prices = budget.Prices(**changes)
    else:
        raise UsageError(f"no prices stored for {name} yet: give at least --rate PRICE_PER_HOUR")
    now = time.time()
    started = _usage(budget.parse_time, args.started_at, now, future=False) if args.started_at else None
    alerts = _usage(budget.parse_amounts, args.alert) if args.alert else None
    rec = budget.set_prices(ledger, name, prices, limit=args.limit, alerts=alerts, started_at=started)
    _budget_notes(ledger)
    if (rec.get("guard") or {}).get("limit_in") is not None:
        print("note: the armed guard still acts at the limit computed with the old prices; "
              "re-arm it with `%gpu budget guard --at-limit`")
    parts = ", ".join(f"{k} {prices.money(v)}/h" for k, v in prices.per_hour().items() if v)
    print(f"{name}: {prices.money(prices.hourly)}/h ({parts}), billed per {prices.billing}"
          + (f"; limit {prices.money(rec['limit'])}" if rec.get("limit") is not None else "")
          + (f"; alerts at {', '.join(prices.money(a) for a in rec['alerts'])}" if rec.get("alerts") else ""))
    if preset:
        print(f"{preset['name']}: data disk {preset['data_disk'] or '-'}; to stop: {preset['stop']}")
    m = magics.session.machines.get(name)
    if m is not None and m.is_connected:  # record the session now, so alerts can fire after any cell
        from .display import AlertView

        reading = m.budget_meter(ledger=ledger)
        for t in reading.crossed:
            _show(AlertView(f"{name} has spent {prices.money(reading.spent)}, past your alert at {prices.money(t)}"))


@magic_arguments()
@argument("--hours", type=number(0, 1e7, above=True, what="hours"), required=True, help="planned GPU hours")
@argument("--rate", type=MONEY, metavar="PER_HOUR", help="on-demand price per hour (default: the machine's)")
@argument("--spot-rate", type=MONEY, metavar="PER_HOUR", help="spot / preemptible price per hour")
@argument("--card-price", type=LIMIT, help="buying instead: the card's price")
@argument("--power-w", type=number(0, 1e6, what="watts"), metavar="WATTS", help="the card's power draw (W)")
@argument("--kwh-price", type=MONEY, help="electricity price per kWh")
@argument("--resale", type=number(0, MAX_AMOUNT, what="an amount"), default=0.0, help="what the card sells for afterwards")
@argument("--currency", help="shown after amounts")
@argument("--host", metavar="NAME", help="take the rate and extra costs from this machine's prices")
def _budget_estimate(magics: GpuMagics, line: str):
    """What a planned run costs: on-demand vs spot, and renting vs buying the card."""
    args = parse(_budget_estimate, line, "budget estimate")
    if args is None:
        return
    from ..budget import ledger as budget
    from .display import EstimateView

    stored = None
    name = args.host or magics.session.default
    if name:
        ledger = _budget_ledger(magics)
        rec = ledger.machine(name)
        _budget_notes(ledger)
        if rec and "prices" in rec:
            stored = budget.Prices.from_dict(rec["prices"])
    rate = args.rate if args.rate is not None else stored.rate if stored else None
    if rate is None:
        raise UsageError("give --rate PRICE_PER_HOUR (or set the machine's prices with `%gpu budget set`)")
    extra = stored.hourly - stored.rate if stored else 0.0
    rows = budget.estimate(args.hours, rate, spot_rate=args.spot_rate, extra_per_hour=extra,
                           card_price=args.card_price, power_w=args.power_w,
                           kwh_price=args.kwh_price, resale=args.resale)
    _show(EstimateView(rows, args.currency or (stored.currency if stored else "")))


@magic_arguments()
@argument("--host", metavar="NAME", help="only this machine")
def _budget_history(magics: GpuMagics, line: str):
    """Spending per machine and per day, from the local ledger."""
    args = parse(_budget_history, line, "budget history")
    if args is None:
        return
    from ..budget import ledger as budget
    from .display import HistoryView

    ledger = _budget_ledger(magics)
    rows = budget.history(ledger.read(), time.time())
    _budget_notes(ledger)
    _show(HistoryView([r for r in rows if args.host in (None, r[0])]))


@magic_arguments()
@argument("--idle", metavar="DURATION", help="shut down after the GPU was idle this long (30m, 2h)")
@argument("--at-limit", action="store_true", help="shut down when the spending limit is reached")
@argument("--deadline", metavar="TIME", help="shut down at this time (HH:MM, +3h, ISO time)")
@argument("--grace", metavar="DURATION", default="10m", help="warn this long before (default 10m)")
@argument("--poll", metavar="SECONDS", type=number(1, 3600, what="seconds"), default=30, help="seconds between checks (default 30)")
@argument("--cancel", action="store_true", help="disarm the guard")
@argument("--host", metavar="NAME", help="machine (default: the current one)")
def _budget_guard(magics: GpuMagics, line: str):
    """Arm a watchdog ON the machine (works with the laptop closed) that shuts it down."""
    args = parse(_budget_guard, line, "budget guard")
    if args is None:
        return
    from ..budget import ledger as budget
    from .display import GuardView

    m = magics.session.get(args.host)
    ledger = _budget_ledger(magics)
    if args.cancel:
        status = m.budget_guard_cancel(ledger=ledger)
        _budget_notes(ledger)
        print(f"{m.name}: guard disarmed" if status.state != "armed" else f"{m.name}: guard still running!")
        return
    if not (args.idle or args.at_limit or args.deadline):
        _show(GuardView(m.budget_guard_status()))
        return
    idle = _usage(budget.parse_duration, args.idle) if args.idle else None
    deadline = _usage(budget.parse_time, args.deadline, time.time(), future=True) if args.deadline else None
    grace = _usage(budget.parse_duration, args.grace)
    status = m.budget_guard(idle=idle, at_limit=args.at_limit, deadline=deadline, grace=grace,
                            poll=args.poll, ledger=ledger)
    magics._budget_seen = {}
    note = (f"armed on {m.name}; its log: {budget.guard_log_path(m)} there; "
            "`%gpu budget guard --cancel` disarms it")
    if idle is not None and not status.idle.startswith(("idle", "busy")):
        note += (f"\nnote: the GPU cannot be measured now ({status.idle}), so the idle rule cannot "
                 "fire until it can (an unreadable GPU never counts as idle)")
    _budget_notes(ledger)
    _show(GuardView(status, note=note))


_BUDGET_SUBS = {"set": _budget_set, "estimate": _budget_estimate, "history": _budget_history,
                "guard": _budget_guard}


@subcommand("budget", "what the rental costs: set prices, meter, estimate, history, guard")
def _budget(magics: GpuMagics, line: str):
    """`%gpu budget [set|estimate|history|guard] ...`; no sub-command shows the meter."""
    word, _, rest = line.strip().partition(" ")
    if word in _BUDGET_SUBS:
        return _BUDGET_SUBS[word](magics, rest)
    if word and not word.startswith("-"):
        raise UsageError(f"unknown budget command {word!r}; valid: {', '.join(_BUDGET_SUBS)} "
                         "(or none, for the meter)")
    return _budget_meter(magics, line)


def budget_alert_hook(magics: GpuMagics, *, now: float | None = None,
                      clock: Callable[[], float] = time.monotonic) -> list[str]:
    """After each cell: show newly crossed alert thresholds (local arithmetic, no round trip)
    and, at most every ``magics.guard_alert_poll`` seconds of ``clock``, a pending guard
    warning from connected machines whose guard this ledger knows of.  ``now`` (epoch s)
    is the meter's time.  Returns the messages shown."""
    poll = getattr(magics, "guard_alert_poll", GUARD_ALERT_POLL)
    from ..budget import ledger as budget
    from .display import AlertView

    shown: list[str] = []
    ledger = budget.Ledger()
    if not magics.session.machines or not ledger.path.exists():
        return shown
    seen = getattr(magics, "_budget_seen", None)
    if seen is None:
        seen = magics._budget_seen = {}
    for name, m in list(magics.session.machines.items()):
        reading, crossed = budget.check_alerts(ledger, name, now=now)
        for t in crossed:
            shown.append(f"{name} has spent {reading.prices.money(reading.spent)}, "
                         f"past your alert at {reading.prices.money(t)}")
        rec = ledger.machine(name) or {}
        last = seen.get(name, (0.0, ""))
        if rec.get("guard") and m.is_connected and clock() - last[0] >= poll:
            try:
                status = m.budget_guard_status()
            except Exception:  # a hook must never break the user's cell
                status = None
            warning = status.warning if status else ""
            if warning and warning != last[1]:
                shown.append(f"{name}: guard: {warning}")
            seen[name] = (clock(), warning or last[1])
    shown += ledger.notes
    for msg in shown:
        _show(AlertView(msg))
    return shown


def _budget_post_run_cell(magics: GpuMagics):
    said: set[str] = set()

    def hook(*_):
        try:
            budget_alert_hook(magics)
        except Exception as e:  # never break the user's cell; say why once
            if str(e) not in said:
                said.add(str(e))
                print(f"gpumagic: budget alert check failed: {e}")
    return hook


def _tunnel_faults_post_run_cell(magics: GpuMagics):
    """After each cell: say the tunnel errors that happened in the background since the
    last time (a browser only sees a reset connection), once each, with what to do."""
    def hook(*_):
        for name, t in _all_tunnels(magics.session):
            new = t.unreported_faults()
            if new:
                more = f" (and {len(new) - 1} more: `%gpu tunnel list`)" if len(new) > 1 else ""
                hint = getattr(new[0].error, "hint", "")
                print(f"gpumagic: tunnel {t.url} -> {t.target} on {name}: {new[0].message}{more}"
                      + (f"\n  hint: {hint}" if hint else ""))
    return hook


def _moved_note(t, session: Session | None = None) -> str:
    """Why ``t`` is not on the local port asked for ("" when it is)."""
    if t.moved_from is None:
        return ""
    why = t.moved_reason
    holder = next(((name, o) for name, o in (_all_tunnels(session) if session else [])
                   if o is not t and o.local_port == t.moved_from), None)
    if holder is not None and holder[1].connection is not t.connection:  # another machine's
        name, o = holder
        why = f"is used by gpumagic's tunnel {o.local_port} -> {o.target} on {name} ({o.name})"
    return f"local port {t.moved_from} {why}; using {t.local_port} instead"


_TUNNEL_HELP = """\
%gpu tunnel: open a port of the machine in your browser, over the SSH connection
(local side on 127.0.0.1 only; nothing is opened to the internet).

  %gpu tunnel tensorboard [--logdir DIR]   start TensorBoard there if needed, link to it
  %gpu tunnel jupyter                      the machine's Jupyter server (URL with token)
  %gpu tunnel PORT [--local-port N]        any port (like ssh -N -L N:localhost:PORT)
  %gpu tunnel list                         local URL, remote target, connections, bytes, state
  %gpu tunnel close ID|all [--stop]        close (and stop what gpumagic started)

`%gpu tunnel tensorboard -h` (and so on) shows each one's options."""


@subcommand("tunnel", "open a remote port in your browser: tensorboard, jupyter, PORT, list, close")
@magic_arguments()
@argument("what", help="tensorboard | jupyter | PORT | list | close (`%%gpu tunnel WHAT -h` for options)")
@argument("rest", nargs="*", help="options of WHAT")
def _tunnel(magics: GpuMagics, line: str):
    """Forward a local port on 127.0.0.1 to a port on the machine, over the SSH connection.

    `%gpu tunnel tensorboard [--logdir DIR]`, `%gpu tunnel jupyter`, `%gpu tunnel 8000`,
    `%gpu tunnel list`, `%gpu tunnel close ID|all`.
    """
    what, _, rest = line.strip().partition(" ")
    if what in ("", "-h", "--help"):
        print(_TUNNEL_HELP)
        return
    sub = {"tensorboard": _tunnel_tensorboard, "jupyter": _tunnel_jupyter,
           "list": _tunnel_list, "close": _tunnel_close}.get(what)
    if sub is None and what.isdigit():
        sub, rest = _tunnel_port, line
    if sub is not None and {"-h", "--help"} & set(rest.split()):
        # IPython's magic parsers have no -h of their own (their help is `%gpu?`).
        sub.parser.prog = f"gpu tunnel {what if sub is not _tunnel_port else ''}".rstrip()
        print(sub.parser.format_help())
        return
    if sub is not None:
        return sub(magics, rest)
    if not what.isdigit():
        raise UsageError(f"`%gpu tunnel {what}`: give a port number, or one of tensorboard, "
                         "jupyter, list, close")
    return _tunnel_port(magics, line)


@magic_arguments()
@argument("port", type=PORT, help="port on the machine")
@argument("--local-port", type=LOCAL_PORT, metavar="N", help="local port (default: the same; another if taken)")
@argument("--remote-host", metavar="H", default="localhost",
          help="host to reach from the machine (default: localhost)")
@argument("--path", default="/", help="URL path to show (default: /)")
@argument("--host", metavar="NAME", help="machine (default: the current one)")
@argument("--inline", action="store_true", help="also show the page in the cell")
@argument("--out", metavar="VAR", help="store the Tunnel (.url, .local_port, .stop()) in VAR")
def _tunnel_port(magics: GpuMagics, line: str):
    args = parse(_tunnel_port, line, "tunnel")
    if args is None:
        return
    _check_out(args.out)
    m = magics.session.get(args.host)
    before = m.tunnels.find(args.remote_host, args.port)
    t = m.tunnel(args.port, local_port=args.local_port, remote_host=args.remote_host,
                 path=args.path)
    note = (f"a tunnel to {t.target} is already open at {t.url} (the same one)" if t is before
            else _moved_note(t, magics.session))
    refused = t.target_refusal()
    if refused:  # the tunnel still works once the service starts
        note = "\n".join(filter(None, [note, (
            f"nothing accepts connections on {t.target} on the machine yet ({refused}); the "
            f"link works once a service listens there (start it, or check the port)")]))
    _show(display.tunnel_opened(t, m.name, note, inline=args.inline))
    if args.out:
        magics.shell.user_ns[args.out] = t


@magic_arguments()
@argument("--logdir", default="runs", metavar="DIR",
          help="event files directory on the machine (default: runs, relative to the cell directory)")
@argument("--local-port", type=LOCAL_PORT, default=6006, metavar="N", help="local port (default 6006; another if taken)")
@argument("--host", metavar="NAME", help="machine (default: the current one)")
@argument("--inline", action="store_true", help="also show TensorBoard in the cell")
@argument("--out", metavar="VAR", help="store the Tunnel (.url, .local_port, .stop()) in VAR")
def _tunnel_tensorboard(magics: GpuMagics, line: str):
    args = parse(_tunnel_tensorboard, line, "tunnel tensorboard")
    if args is None:
        return
    _check_out(args.out)  # every argument is checked before anything starts on the machine
    m = magics.session.get(args.host)
    t = m.tensorboard(args.logdir, local_port=args.local_port)
    how = _service_note("TensorBoard", m.name, t.service)
    note = "\n".join(x for x in (how, _moved_note(t, magics.session)) if x)
    _show(display.tunnel_opened(t, m.name, note, inline=args.inline))
    if args.out:
        magics.shell.user_ns[args.out] = t


@magic_arguments()
@argument("--local-port", type=LOCAL_PORT, default=8888, metavar="N", help="local port (default 8888; another if taken)")
@argument("--host", metavar="NAME", help="machine (default: the current one)")
@argument("--inline", action="store_true", help="also show Jupyter in the cell")
@argument("--out", metavar="VAR", help="store the Tunnel (.url, .local_port, .stop()) in VAR")
def _tunnel_jupyter(magics: GpuMagics, line: str):
    args = parse(_tunnel_jupyter, line, "tunnel jupyter")
    if args is None:
        return
    _check_out(args.out)  # every argument is checked before anything starts on the machine
    m = magics.session.get(args.host)
    t = m.jupyter(local_port=args.local_port)
    how = _service_note("Jupyter", m.name, t.service)
    note = "\n".join(x for x in (how, _moved_note(t, magics.session)) if x)
    _show(display.tunnel_opened(t, m.name, note, inline=args.inline))
    if args.out:
        magics.shell.user_ns[args.out] = t


def _check_out(name: str | None) -> None:
    """``--out NAME`` must be a Python variable name (checked before anything is started)."""
    if name is not None and (not name.isidentifier() or keyword.iskeyword(name)):
        raise UsageError(f"--out {name!r} is not a Python variable name; e.g. --out result")


def _service_note(what: str, machine: str, service) -> str:
    """Whether gpumagic started the server now, earlier, or not at all (then --stop leaves it)."""
    if service.started:
        return f"started {what} on {machine} (pid {service.pid}, log {service.log})"
    if service.ours:
        log = f", log {service.log}" if service.log else ""
        return f"{what} already serving on {machine} (pid {service.pid}, started by gpumagic earlier{log})"
    return (f"{what} already serving on {machine} (pid {service.pid}, not started by gpumagic: "
            "`%gpu tunnel close ID --stop` leaves it running)")


def _all_tunnels(session: Session):
    return [(m.name, t) for m in session.machines.values() for t in m.tunnels]


@magic_arguments()
def _tunnel_list(magics: GpuMagics, line: str):
    if parse(_tunnel_list, line, "tunnel list") is None:
        return
    rows = _all_tunnels(magics.session)
    _show(display.Rendered(display.tunnel_table(rows), display.tunnel_table_html(rows)))


@magic_arguments()
@argument("id", help="the tunnel's ID (its local port, see `%%gpu tunnel list`) or `all`")
@argument("--stop", action="store_true",
          help="also stop the TensorBoard/Jupyter server gpumagic started for it on the machine")
def _tunnel_close(magics: GpuMagics, line: str):
    args = parse(_tunnel_close, line, "tunnel close")
    if args is None:
        return
    try:
        port = None if args.id == "all" else LOCAL_PORT(args.id)
    except argparse.ArgumentTypeError:
        raise UsageError(f"`%gpu tunnel close {args.id}`: give an ID from `%gpu tunnel list` (a local "
                         "port number) or `all`") from None
    closed = []
    for m in magics.session.machines.values():
        if port is None:
            closed += m.tunnels.close_all(stop_service=args.stop)
        elif port in m.tunnels.tunnels:
            closed.append(m.tunnels.close(port, stop_service=args.stop))
    if not closed and args.id != "all":
        ids = ", ".join(str(t.local_port) for _, t in _all_tunnels(magics.session)) or "none"
        raise UsageError(f"no tunnel with ID {args.id} (open: {ids})")
    for t in closed:
        print(f"closed tunnel {t.local_port} -> {t.target} ({t.name}); "
              f"{t.connections_total} connection(s), {display.format_bytes(t.bytes_down)} down")
        if args.stop and t.service is not None:
            print(f"  stopped its server on the machine (pid {t.service.pid})" if t.service.ours
                  else "  its server was not started by gpumagic; left running")
        for f in t.unreported_faults():
            print(f"  error on connection {f.connection}: {f.message}")
    if not closed:
        print("no tunnels were open")


def show_public_key(pair: "setup.KeyPair", shell=None) -> None:
    """Show the key: the widget plus its text fallback in a kernel, plain text otherwise."""
    text = setup.public_key_text(pair)
    in_kernel = shell is not None and getattr(shell, "kernel", None) is not None
    view = widgets.public_key_widget(pair) if in_kernel else None
    if view is None:
        print(text)
        return
    ipy_display({"text/plain": text,
                 "application/vnd.jupyter.widget-view+json": {
                     "version_major": 2, "version_minor": 0, "model_id": view.model_id}}, raw=True)


# -- fit, wrapup, budget notify: handlers in more_magics.py ------------------------------


def _more(name: str) -> Callable:
    def run(magics: GpuMagics, line: str):
        from . import more_magics

        return getattr(more_magics, name)(magics, line)
    return run


SUBCOMMANDS["fit"] = (_more("fit"), "will it fit? GPU memory for training or inference, vs the GPU or a card")
SUBCOMMANDS["wrapup"] = (_more("wrapup"), "before releasing: pull results, list/--clean caches, image size, what runs")
_BUDGET_SUBS["notify"] = _more("budget_notify")
