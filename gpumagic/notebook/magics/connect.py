"""``%gpu connect``, ``disconnect``, ``hosts``, ``forget``, ``cd``, and pasted ssh lines."""

from __future__ import annotations

import shlex
import time
from typing import TYPE_CHECKING, Callable

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

from ... import keys as setup
from ...fleet import Fleet
from ...ssh import known_hosts
from ...ssh.hosts import config_aliases, is_ssh_command, load_ssh_config, parse_target, ssh_dir
from .. import display
from ._args import PORT, host_arg, parse

if TYPE_CHECKING:
    from . import GpuMagics


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
    if pasted is not None:
        if args.target:
            raise UsageError(f"give either the ssh command or a target, not both ({args.target!r})")
        args.target = pasted
    if args.sandbox:
        _refuse_with_sandbox(args)
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
        m = magics.fleet.connect(None, sandbox=True, fake_gpu=args.fake_gpu, name=args.name,
                                   cwd=options["cwd"])
        gpu = f"replaying recorded {args.fake_gpu} (not a real GPU)" if args.fake_gpu else "no GPU"
        print(f"sandbox machine up: a local sshd at {m.spec.address} ({gpu}); "
              f"it stops when the kernel exits")
    else:
        m = magics.fleet.connect(args.target, **options)
    for note in m.connection.notes:
        print(note)
    print(f"connected to {m.name} ({m.spec.user}@{m.spec.address}) in "
          f"{time.monotonic() - start:.2f} s; %%remote cells run there")
    if save is not None:  # only after the line proved to work: no block from a mistyped line
        _print_add_host(save())


def _refuse_with_sandbox(args) -> None:
    """``--sandbox`` with what only a real machine takes (a target, ``-p``...): one usage error,
    not a sandbox that silently drops them."""
    given = [shown for shown, value in ((repr(args.target), args.target), ("-p", args.port), ("-i", args.identity),
                                        ("-J", args.jump), ("-l", args.user),
                                        ("--trust-new-host", args.trust_new_host))
             if value]
    if given:
        raise UsageError(f"--sandbox starts a local sshd of its own and takes no {', '.join(given)}: "
                         "drop --sandbox to connect to a machine, or drop the rest to try the sandbox")


@magic_arguments()
@argument("name", nargs="?", help="machine name (default: the current one)")
def _disconnect(magics: GpuMagics, line: str):
    args = parse(_disconnect, line, "disconnect")
    m = magics.fleet.disconnect(args.name)
    print(f"disconnected from {m.name}")


@magic_arguments()
def _hosts(magics: GpuMagics, line: str):
    parse(_hosts, line, "hosts")
    print(hosts_table(magics.fleet))


def hosts_table(fleet: Fleet) -> str:
    """Text table: every config alias and connected machine, with its state."""
    config = load_ssh_config()
    rows = [("NAME", "TARGET", "STATE")]
    names = list(dict.fromkeys(config_aliases(config) + list(fleet.machines)))
    for name in names:
        m = fleet.machines.get(name)
        if m is not None:
            target = f"{m.spec.user}@{m.spec.address}"
            state = "connected" if m.is_connected else "closed"
            if fleet.default == name:
                state += " (default)"
        else:
            found = config.lookup(name)
            target = f"{found.get('user', '')}{'@' if found.get('user') else ''}{found.get('hostname', name)}:{found.get('port', 22)}"
            state = "-"
        rows.append((name, target, state))
    if len(rows) == 1:
        return "no machines: add a Host block to ~/.ssh/config or run `%gpu connect user@host:port`"
    return display.text_table(rows)


@magic_arguments()
@argument("host", help="HOST or HOST:PORT, as named in the changed-key message")
def _forget(magics: GpuMagics, line: str):
    args = parse(_forget, line, "forget")
    target = parse_target(args.host)
    path = ssh_dir() / "known_hosts"
    port = target.port or 22
    n = known_hosts.forget(path, target.host, port)
    name = known_hosts.known_name(target.host, port)
    if n:
        print(f"removed {n} line(s) for {name} from {path} (previous file kept as {path}.old)")
    else:
        print(f"{path} has no entry for {name}; nothing changed")


@magic_arguments()
@argument("dir", help="directory on the machine (absolute, ~/..., or relative to the current one)")
@host_arg()
def _cd(magics: GpuMagics, line: str):
    args = parse(_cd, line, "cd")
    m = magics.fleet.get(args.host)
    print(f"{m.name}: cells now run in {m.cd(args.dir)}")


# -- pasted ssh lines, --save ------------------------------------------------------------

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
    given = setup.host_fields(args.target)
    if not is_ssh_command(args.target) and given["hostname"] in config_aliases(load_ssh_config()):
        raise UsageError(f"{given['hostname']} is already a Host in ~/.ssh/config; connect to it by name, "
                         f"or use `%gpu add-host {args.save} --hostname ...`")
    block = dict(given, name=args.save, port=args.port or given["port"], user=args.user or given["user"],
                 key=args.identity or given["key"], jump=args.jump or given["jump"], replace=args.replace)
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
