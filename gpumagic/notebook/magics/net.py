"""The machine's way out: ``%gpu proxy on|off`` (this computer's proxy lent over SSH) and
``%gpu mirrors`` (pip, Hugging Face and conda mirrors).  The logic is in :mod:`gpumagic.net`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

from ...errors import ConfigError
from ...net import catalog
from ...net import proxy as netproxy
from ._args import PORT, Subcommands, host_arg, out_arg, parse

if TYPE_CHECKING:
    from . import GpuMagics


@magic_arguments()
@argument("--local", type=PORT, default=netproxy.DEFAULT_LOCAL_PORT, metavar="PORT",
          help="the proxy's port on this computer (default 7890, Clash's)")
@argument("--remote-port", type=PORT, metavar="P",
          help="port on the machine's 127.0.0.1 (default: the same; another the server picks if taken)")
@argument("--persist", action="store_true",
          help="also write the variables into the login shell's start-up file on the machine "
               "(a marked block; `%%gpu proxy off` removes it)")
@host_arg()
@out_arg("the Proxy (.url, .environment(), .tunnel)")
def _proxy_on(magics: GpuMagics, line: str):
    args = parse(_proxy_on, line, "proxy on")
    m = magics.fleet.get(args.host)
    p = m.net.proxy_on(args.local, remote_port=args.remote_port, persist=args.persist)
    print(proxy_text(p, m.name))
    if args.out:
        magics.shell.user_ns[args.out] = p


@magic_arguments()
@host_arg()
def _proxy_off(magics: GpuMagics, line: str):
    args = parse(_proxy_off, line, "proxy off")
    m = magics.fleet.get(args.host)
    off = m.net.proxy_off()
    said = []
    if off.tunnel is not None:
        said.append(f"proxy off for {m.name}: closed reverse tunnel {off.tunnel.id}; new cells, sessions "
                    "and jobs get no proxy variable")
    else:
        said.append(f"no proxy was on for {m.name} in this notebook")
    said += [f"  removed the proxy block from {path}" for path in off.removed]
    print("\n".join(said))


@magic_arguments()
@host_arg()
def _proxy_show(magics: GpuMagics, line: str):
    args = parse(_proxy_show, line, "proxy")
    m = magics.fleet.get(args.host)
    print(proxy_text(m.net.proxy, m.name) if m.net.proxy is not None else
          f"no proxy on for {m.name}; `%gpu proxy on [--local 7890]` lends this computer's")


#: ``%gpu proxy``: on, off, and nothing (what is on).
PROXY = Subcommands("%gpu proxy", {
    "on": (_proxy_on, "a reverse tunnel to it, and http(s)_proxy, all_proxy, no_proxy in new cells, "
                      "sessions and jobs", "[--local 7890] [--remote-port P] [--persist]"),
    "off": (_proxy_off, "close it; new cells get no proxy variable; a --persist block goes"),
}, default=(_proxy_show, "what is on", "[--host NAME]"), default_is="what is on",
   intro="%gpu proxy: lend this computer's proxy (Clash, v2rayN...) to the machine over SSH.",
   outro="`%gpu proxy on -h` shows its options.")


def proxy_text(p: netproxy.Proxy, machine: str) -> str:
    """What ``%gpu proxy on`` says: where the tunnel goes, the variables, what to restart."""
    t = p.tunnel
    moved = (f"\n  port {t.moved_from} on the machine {t.moved_reason}; using {t.remote_port}"
             if t.moved_from is not None else "")
    lines = [f"proxy on for {machine}: the machine's {t.listen} -> this computer's {t.target} "
             f"(reverse tunnel {t.id}){moved}",
             f"  http_proxy, https_proxy, all_proxy (and upper case) = {p.url} in new cells, sessions and jobs",
             f"  no_proxy: {','.join(p.no_proxy)}",
             "  a session already running keeps its environment: stop it and start it again "
             "(`%gpu kernel stop NAME`, `%gpu kernel start NAME`; a restart keeps the old one)"]
    if p.persisted:
        lines.append(f"  also in {p.persisted} on the machine (terminals there); `%gpu proxy off` removes it")
    return "\n".join(lines)


@magic_arguments()
@argument("words", nargs="*", metavar="KIND [NAME|off]",
          help="pip, hf or conda, then a mirror's name (default: the first listed) or off; "
               "`off` alone undoes every kind; nothing: what is in use and the mirrors known")
@host_arg()
@out_arg("the change (.before, .after) or, for `off`, the list of changes")
def _mirrors(magics: GpuMagics, line: str):
    """Set a well-known mirror for pip, Hugging Face or conda on the machine, show the change,
    undo it with `off` (the list lives in gpumagic/net/mirrors.json, each with its source)."""
    args = parse(_mirrors, line, "mirrors")
    words = args.words
    if len(words) > 2:
        raise UsageError("`%gpu mirrors KIND [NAME|off]`: at most two words (e.g. `%gpu mirrors pip tuna`)")
    if words and words[0] not in (*catalog.KINDS, "off"):
        raise UsageError(f"`%gpu mirrors {words[0]}`: give pip, hf or conda (or off)")
    m = magics.fleet.get(args.host)
    if not words:
        used = m.net.mirrors_in_use()
        rows = []
        for kind, what in catalog.KINDS.items():
            known = ", ".join(x.name for x in catalog.mirrors(kind))
            rows.append(f"  {kind:<5} {what}\n        in use: {used[kind]}\n        known: {known}")
        print(f"mirrors on {m.name} (`%gpu mirrors KIND [NAME]` sets one, `%gpu mirrors KIND off` undoes it):\n"
              + "\n".join(rows))
        return
    if words == ["off"]:
        changes = [m.net.mirrors_off(kind) for kind in catalog.KINDS]
        print("\n".join(c.text for c in changes))
        result = changes
    elif len(words) == 2 and words[1] == "off":
        result = m.net.mirrors_off(words[0])
        print(result.text)
    else:
        try:
            result = m.net.mirrors(words[0], words[1] if len(words) == 2 else None)
        except ConfigError as e:  # an unknown mirror name is bad input
            raise UsageError(e.message + (f"; {e.hint}" if e.hint else "")) from None
        print(result.text)
    if args.out:
        magics.shell.user_ns[args.out] = result
