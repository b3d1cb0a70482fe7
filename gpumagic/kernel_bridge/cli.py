"""``gpumagic kernel install | list | uninstall | stop``: the command line of the kernelspecs
(:mod:`.spec`); :func:`add_parser` hangs them under ``gpumagic kernel``."""

from __future__ import annotations

import argparse

from ..remote.kernel import DEFAULT_NAME
from . import spec


def add_parser(sub) -> None:
    k = sub.add_parser("kernel", help="the machine's live session as a Jupyter kernel (kernelspecs)",
                       description="Put a machine's live session (%gpu kernel) in your front end's "
                                   "kernel list: JupyterLab, Notebook, VS Code. Shutdown rule: "
                                   + spec.SHUTDOWN_RULE + ".")
    ks = k.add_subparsers(dest="kernel_cmd", required=True)
    i = ks.add_parser("install", help="write a kernelspec gpumagic-HOST", allow_abbrev=False)
    where = i.add_mutually_exclusive_group(required=True)
    where.add_argument("host", nargs="?", help="a ~/.ssh/config alias or user@host[:port]")
    where.add_argument("--sandbox", action="store_true", help="the local sandbox machine (nothing rented)")
    i.add_argument("--name", default=DEFAULT_NAME, metavar="SESSION",
                   help=f"the session on the machine (default: {DEFAULT_NAME}, the one %%gpu kernel uses)")
    i.add_argument("--python", metavar="PATH", help="the machine's Python for the session (default: python3 there; "
                   "with --sandbox, this Python)")
    i.add_argument("--display-name", help="the name shown in the kernel list")
    i.add_argument("--sys-prefix", action="store_true",
                   help="install into this environment's share/jupyter, not the user's data directory")
    i.set_defaults(func=_install)
    lst = ks.add_parser("list", help="the gpumagic kernelspecs installed")
    lst.set_defaults(func=_list)
    u = ks.add_parser("uninstall", help="remove a kernelspec (the session on the machine keeps running)",
                      allow_abbrev=False)
    u_where = u.add_mutually_exclusive_group(required=True)
    u_where.add_argument("kernel", nargs="?", help="gpumagic-HOST, or HOST")
    u_where.add_argument("--sandbox", action="store_true", help="the sandbox machine's kernelspec")
    u.set_defaults(func=_uninstall)
    s = ks.add_parser("stop", help="stop the session on the machine (its variables are lost)", allow_abbrev=False)
    s_where = s.add_mutually_exclusive_group(required=True)
    s_where.add_argument("host", nargs="?", help="the machine (as given to install)")
    s_where.add_argument("--sandbox", action="store_true", help="the local sandbox machine")
    s.add_argument("--name", default=DEFAULT_NAME, metavar="SESSION", help=f"the session (default: {DEFAULT_NAME})")
    s.set_defaults(func=_stop)


def _install(args: argparse.Namespace) -> int:
    bs = spec.BridgeSpec(host=spec.SANDBOX if args.sandbox else args.host, session=args.name,
                         python=args.python, sandbox=args.sandbox, display_name=args.display_name)
    print(spec.installed_text(bs, spec.install(bs, sys_prefix=args.sys_prefix)))
    return 0


def _list(args: argparse.Namespace) -> int:
    print(spec.listing())
    return 0


def _uninstall(args: argparse.Namespace) -> int:
    print(spec.uninstalled_text(spec.uninstall(spec.SANDBOX if args.sandbox else args.kernel)))
    return 0


def _stop(args: argparse.Namespace) -> int:
    import gpumagic

    m = gpumagic.connect(sandbox=True) if args.sandbox else gpumagic.connect(args.host)
    try:
        k = m.kernel(args.name, start=False)
        k.stop()
    finally:
        m.close()
    print(f"stopped session {args.name} on {m.name}")
    return 0
