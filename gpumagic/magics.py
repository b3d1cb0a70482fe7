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

from . import display, known_hosts
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
    @argument("--out", metavar="VAR", help="store the RunResult (stdout, stderr, exit_code) in VAR")
    @cell_magic
    def remote(self, line: str, cell: str):
        """Run this cell on the remote machine, with output streamed live.

        The cell is a bash script, or Python with --python.  A non-zero exit raises (so
        "Run All" stops) unless --no-raise-error.  Interrupting the kernel stops the
        cell's whole remote process tree, then raises KeyboardInterrupt.
        """
        args = parse_argstring(self.remote, line)
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


# -- tunnels -----------------------------------------------------------------------------


def _show(obj) -> None:
    from IPython.display import display

    display(obj)


def _moved_note(t) -> str:
    if t.moved_from is None:
        return ""
    return (f"local port {t.moved_from} is taken by another program (left alone); "
            f"using {t.local_port} instead")


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
@argument("port", type=int, help="port on the machine")
@argument("--local-port", type=int, metavar="N", help="local port (default: the same; another if taken)")
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
    if not 0 < args.port < 65536 or (args.local_port is not None and not 0 <= args.local_port < 65536):
        raise UsageError("ports are numbers from 1 to 65535")
    m = magics.session.get(args.host)
    t = m.tunnel(args.port, local_port=args.local_port, remote_host=args.remote_host,
                 path=args.path)
    _show(display.tunnel_opened(t, m.name, _moved_note(t), inline=args.inline))
    if args.out:
        magics.shell.user_ns[args.out] = t


@magic_arguments()
@argument("--logdir", default="runs", metavar="DIR",
          help="event files directory on the machine (default: runs, relative to the cell directory)")
@argument("--local-port", type=int, default=6006, metavar="N", help="local port (default 6006; another if taken)")
@argument("--host", metavar="NAME", help="machine (default: the current one)")
@argument("--inline", action="store_true", help="also show TensorBoard in the cell")
@argument("--out", metavar="VAR", help="store the Tunnel (.url, .local_port, .stop()) in VAR")
def _tunnel_tensorboard(magics: GpuMagics, line: str):
    args = parse(_tunnel_tensorboard, line, "tunnel tensorboard")
    if args is None:
        return
    m = magics.session.get(args.host)
    t = m.tensorboard(args.logdir, local_port=args.local_port)
    how = (f"started TensorBoard on {m.name} (pid {t.service.pid}, log {t.service.log})"
           if t.service.started else f"TensorBoard already serving on {m.name} (pid {t.service.pid})")
    note = "\n".join(x for x in (how, _moved_note(t)) if x)
    _show(display.tunnel_opened(t, m.name, note, inline=args.inline))
    if args.out:
        magics.shell.user_ns[args.out] = t


@magic_arguments()
@argument("--local-port", type=int, default=8888, metavar="N", help="local port (default 8888; another if taken)")
@argument("--host", metavar="NAME", help="machine (default: the current one)")
@argument("--inline", action="store_true", help="also show Jupyter in the cell")
@argument("--out", metavar="VAR", help="store the Tunnel (.url, .local_port, .stop()) in VAR")
def _tunnel_jupyter(magics: GpuMagics, line: str):
    args = parse(_tunnel_jupyter, line, "tunnel jupyter")
    if args is None:
        return
    m = magics.session.get(args.host)
    t = m.jupyter(local_port=args.local_port)
    how = (f"started Jupyter on {m.name} (pid {t.service.pid}, log {t.service.log})"
           if t.service.started else f"Jupyter already serving on {m.name} (pid {t.service.pid})")
    note = "\n".join(x for x in (how, _moved_note(t)) if x)
    _show(display.tunnel_opened(t, m.name, note, inline=args.inline))
    if args.out:
        magics.shell.user_ns[args.out] = t


def _all_tunnels(session: Session):
    return [(m.name, t) for m in session.machines.values() for t in m.tunnels]


@magic_arguments()
def _tunnel_list(magics: GpuMagics, line: str):
    if parse(_tunnel_list, line, "tunnel list") is None:
        return
    rows = _all_tunnels(magics.session)
    _show(display.Rich(display.tunnel_table(rows), display.tunnel_table_html(rows)))


@magic_arguments()
@argument("id", help="the tunnel's ID (its local port, see `%%gpu tunnel list`) or `all`")
@argument("--stop", action="store_true",
          help="also stop the TensorBoard/Jupyter server gpumagic started for it on the machine")
def _tunnel_close(magics: GpuMagics, line: str):
    args = parse(_tunnel_close, line, "tunnel close")
    if args is None:
        return
    if args.id != "all" and not args.id.isdigit():
        raise UsageError(f"`%gpu tunnel close {args.id}`: give an ID from `%gpu tunnel list` or `all`")
    closed = []
    for m in magics.session.machines.values():
        if args.id == "all":
            closed += m.tunnels.close_all(stop_service=args.stop)
        elif int(args.id) in m.tunnels.tunnels:
            closed.append(m.tunnels.close(int(args.id), stop_service=args.stop))
    if not closed and args.id != "all":
        ids = ", ".join(str(t.local_port) for _, t in _all_tunnels(magics.session)) or "none"
        raise UsageError(f"no tunnel with ID {args.id} (open: {ids})")
    for t in closed:
        print(f"closed tunnel {t.local_port} -> {t.target} ({t.name}); "
              f"{t.connections_total} connection(s), {display.format_bytes(t.bytes_down)} down")
        if args.stop and t.service is not None:
            print(f"  stopped its server on the machine (pid {t.service.pid})" if t.service.started
                  else "  its server was already running before gpumagic; left running")
        for f in t.unreported_faults():
            print(f"  error on connection {f.connection}: {f.message}")
    if not closed:
        print("no tunnels were open")
