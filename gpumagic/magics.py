"""IPython layer: ``%gpu <sub-command>`` and ``%%remote``.

Each sub-command is a small function with its own ``magic_arguments`` parser, listed in
``SUBCOMMANDS``; magic methods parse, call the plain-Python API, and display.  Bad
arguments raise exactly ``UsageError``; everything else is a ``GpumagicError`` whose
``_render_traceback_`` shows a short message instead of a traceback.
"""

from __future__ import annotations

import time
from typing import Callable

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Unicode

from . import known_hosts
from .errors import RemoteCommandError
from .hosts import config_aliases, load_ssh_config, parse_target, ssh_dir
from .session import Session

#: name -> (function(magics, line), one-line help).  Filled by ``@subcommand`` below.
SUBCOMMANDS: dict[str, tuple[Callable, str]] = {}


def subcommand(name: str, summary: str):
    """Register ``fn(magics, line)`` as ``%gpu NAME``; its docstring is its ``--help``."""

    def wrap(fn):
        SUBCOMMANDS[name] = (fn, summary)
        return fn

    return wrap


def parse(fn, line: str, name: str):
    """Parse ``line`` with ``fn``'s magic_arguments parser; ``-h`` prints help."""
    fn.parser.prog = f"%gpu {name}"
    try:
        return parse_argstring(fn, line)
    except SystemExit:  # argparse after printing --help
        return None


def _env_pairs(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not key.replace("_", "a").isalnum() or key[0].isdigit():
            raise UsageError(f"--env {item!r}: write it as NAME=VALUE, e.g. --env CUDA_VISIBLE_DEVICES=0")
        env[key] = value
    return env


@magics_class
class GpuMagics(Magics):
    """``%gpu`` and ``%%remote``: run notebook cells on a rented GPU machine over SSH."""

    default_cwd = Unicode(
        None, allow_none=True, config=True,
        help="Working directory for cells on newly connected machines (e.g. '/root/autodl-tmp').",
    )

    def __init__(self, shell=None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        self.session = Session()

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
    @argument("--timeout", metavar="S", type=float, help="stop the cell after S seconds")
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
    @argument("--then-shutdown", metavar="MINUTES", type=float,
              help="with --job: shut the machine down MINUTES after the job succeeds (exit 0)")
    @argument("--no-alerts", action="store_true",
              help="with --job: do not show NaN/OOM/traceback alerts when following or listing")
    @cell_magic
    def remote(self, line: str, cell: str):
        """Run this cell on the remote machine, with output streamed live.

        The cell is a bash script, or Python with --python.  A non-zero exit raises (so
        "Run All" stops) unless --no-raise-error.  Interrupting the kernel stops the
        cell's whole remote process tree, then raises KeyboardInterrupt.
        """
        args = parse_argstring(self.remote, line)
        if args.job is not None or args.stop_on or args.then_shutdown is not None or args.no_alerts:
            return _remote_job(self, args, cell)
        machine = self.session.get(args.host)
        result = machine.run(cell, python=args.python, cwd=args.cwd, env=_env_pairs(args.env),
                             timeout=args.timeout)
        if args.out:
            self.shell.user_ns[args.out] = result
        if result.exit_code != 0 and not args.no_raise_error:
            kind = "python cell" if args.python else "cell"
            raise RemoteCommandError(f"{kind} on {machine.name} exited with code {result.exit_code}",
                                     exit_code=result.exit_code, stdout=result.stdout,
                                     stderr=result.stderr)
        return None


# -- sub-commands ------------------------------------------------------------------------


@subcommand("connect", "connect to a machine: ~/.ssh/config alias or user@host[:port]")
@magic_arguments()
@argument("target", nargs="?", help="~/.ssh/config alias or [user@]host[:port]")
@argument("-p", "--port", type=int, help="SSH port (like ssh -p)")
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
def _connect(magics: GpuMagics, line: str):
    args = parse(_connect, line, "connect")
    if args is None:
        return
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
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


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


# -- jobs ---------------------------------------------------------------------------------


def _job_name(name: str) -> str:
    from .jobs import NAME_RE

    if not NAME_RE.fullmatch(name):
        raise UsageError(f"{name!r} is not a job name: use letters, digits, '-' and '_' (see `%gpu jobs`)")
    return name


def _display(obj) -> None:
    from IPython.display import display

    display(obj)


def _remote_job(magics: GpuMagics, args, cell: str):
    """``%%remote --job NAME ...``: start the cell detached and return at once."""
    from . import display as show
    from .jobs import NAME_RE, parse_stop_on

    if args.job is None:
        raise UsageError("--stop-on, --then-shutdown and --no-alerts need --job NAME")
    if not NAME_RE.fullmatch(args.job):
        raise UsageError(f"--job {args.job!r}: use letters, digits, '-' and '_' (e.g. --job train-1)")
    if args.timeout is not None:
        raise UsageError("--timeout does not apply to --job (a job runs until it ends or `%gpu kill NAME`)")
    if args.then_shutdown is not None and args.then_shutdown < 0:
        raise UsageError("--then-shutdown takes minutes >= 0, e.g. --then-shutdown 10")
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
    print(show.job_started(job, machine.name))
    if args.out:
        magics.shell.user_ns[args.out] = job


def _show_alerts(info, alerts=None) -> None:
    from . import display as show

    seen = set()
    for a in (info.alerts if alerts is None else alerts):
        if a.kind not in seen:
            seen.add(a.kind)
            _display(show.job_alert(info.name, a, stopped=(info.killed == a.kind)))


@subcommand("jobs", "list the detached jobs on a machine: state, start, run time, last line")
@magic_arguments()
@argument("--host", metavar="NAME", help="machine (default: the current one)")
def _jobs(magics: GpuMagics, line: str):
    args = parse(_jobs, line, "jobs")
    if args is None:
        return
    from . import display as show

    machine = magics.session.get(args.host)
    infos = machine.jobs()
    _display(show.jobs_table(infos, machine.name))
    for info in infos:
        _show_alerts(info)


def _follow(magics: GpuMagics, name: str, host: str | None, lines: int | None) -> None:
    from . import display as show

    machine = magics.session.get(host)
    job = machine.job(_job_name(name))
    before = job.info()
    seen: set[str] = set()

    def alert(a):
        if a.kind not in seen:  # one alert per kind while following
            seen.add(a.kind)
            _display(show.job_alert(name, a, stopped=a.kind in before.stop_on))

    try:
        info = job.follow(alert=alert, lines=lines)
    except KeyboardInterrupt:
        print(f"\nstopped following {name}; the job keeps running on {machine.name} "
              f"(`%gpu attach {name}` follows it again)")
        raise
    print(show.job_ended(info))


@subcommand("logs", "show a job's output; --follow streams it until the job ends")
@magic_arguments()
@argument("name", help="job name (see `%%gpu jobs`)")
@argument("-n", "--lines", type=int, default=100, help="how many last lines to show (default 100; 0: all)")
@argument("-f", "--follow", action="store_true",
          help="keep printing new output until the job ends (interrupting stops following, never the job)")
@argument("--host", metavar="NAME", help="machine (default: the current one)")
def _logs(magics: GpuMagics, line: str):
    args = parse(_logs, line, "logs")
    if args is None:
        return
    if args.lines < 0:
        raise UsageError("-n takes a number of lines >= 0 (0: the whole log)")
    lines = args.lines or None
    if args.follow:
        return _follow(magics, args.name, args.host, lines)
    machine = magics.session.get(args.host)
    job = machine.job(_job_name(args.name))
    text = job.logs(lines)
    print(text, end="" if text.endswith("\n") or not text else "\n")
    info = job.info()
    if info.alerts_enabled:
        from .jobs import scan_alerts

        _show_alerts(info, scan_alerts(text.splitlines()))


@subcommand("attach", "show a job's earlier output, then follow it until it ends")
@magic_arguments()
@argument("name", help="job name (see `%%gpu jobs`)")
@argument("-n", "--lines", type=int, default=1000, help="earlier lines to show first (default 1000; 0: all)")
@argument("--host", metavar="NAME", help="machine (default: the current one)")
def _attach(magics: GpuMagics, line: str):
    args = parse(_attach, line, "attach")
    if args is None:
        return
    if args.lines < 0:
        raise UsageError("-n takes a number of lines >= 0 (0: the whole log)")
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
