"""``%gpu tunnel``: a port of the machine in your browser, over the SSH connection; and the
tunnel errors said after each cell (:func:`_tunnel_faults_post_run_cell`)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display as _show

from ..._format import count, format_bytes
from ...fleet import Fleet
from ...tunnel import ReverseTunnel
from .. import display
from ._args import LOCAL_PORT, PORT, Subcommands, host_arg, out_arg, parse

if TYPE_CHECKING:
    from . import GpuMagics


def _moved_note(t, fleet: Fleet | None = None) -> str:
    """Why ``t`` is not on the local port asked for ("" when it is)."""
    if t.moved_from is None:
        return ""
    why = t.moved_reason
    holder = next(((name, o) for name, o in (_all_tunnels(fleet) if fleet else [])
                   if o is not t and o.local_port == t.moved_from), None)
    if holder is not None and holder[1].connection is not t.connection:  # another machine's
        name, o = holder
        why = f"is used by gpumagic's tunnel {o.local_port} -> {o.target} on {name} ({o.name})"
    return f"local port {t.moved_from} {why}; using {t.local_port} instead"


@magic_arguments()
@argument("port", type=PORT, help="port on the machine")
@argument("--local-port", type=LOCAL_PORT, metavar="N", help="local port (default: the same; another if taken)")
@argument("--remote-host", metavar="H", default="localhost",
          help="host to reach from the machine (default: localhost)")
@argument("--path", default="/", help="URL path to show (default: /)")
@host_arg()
@argument("--inline", action="store_true", help="also show the page in the cell")
@out_arg("the Tunnel (.url, .local_port, .stop())")
def _tunnel_port(magics: GpuMagics, line: str):
    args = parse(_tunnel_port, line, "tunnel")
    m = magics.fleet.get(args.host)
    before = m.tunnels.find(args.remote_host, args.port)
    t = m.tunnel(args.port, local_port=args.local_port, remote_host=args.remote_host,
                 path=args.path)
    note = (f"a tunnel to {t.target} is already open at {t.url} (the same one)" if t is before
            else _moved_note(t, magics.fleet))
    refused = t.target_refusal()
    if refused:  # the tunnel still works once the service starts
        note = "\n".join(filter(None, [note, (
            f"nothing accepts connections on {t.target} on the machine yet ({refused}); the "
            f"link works once a service listens there (start it, or check the port)")]))
    _show(display.tunnel_opened(t, m.name, note, inline=args.inline))
    if args.out:
        magics.shell.user_ns[args.out] = t


@magic_arguments()
@argument("local_port", type=PORT, metavar="LOCAL_PORT", help="port on this computer (a local proxy's: 7890)")
@argument("--remote-port", type=PORT, metavar="P",
          help="port on the machine's 127.0.0.1 (default: the same; another the server picks if taken)")
@argument("--name", default="", help="label for `%%gpu tunnel list`")
@host_arg()
@out_arg("the ReverseTunnel (.remote_port, .stop())")
def _tunnel_reverse(magics: GpuMagics, line: str):
    args = parse(_tunnel_reverse, line, "tunnel --reverse")
    m = magics.fleet.get(args.host)
    before = list(m.tunnels.reverse_tunnels())
    t = m.tunnels.open_reverse(args.local_port, remote_port=args.remote_port, name=args.name)
    if any(t is b for b in before):
        note = f"a reverse tunnel to this computer's {t.target} is already open (the same one)"
    elif t.moved_from is not None:
        note = f"port {t.moved_from} on the machine {t.moved_reason}; using {t.remote_port} instead"
    else:
        note = ""
    _show(display.reverse_tunnel_opened(t, m.name, note))
    if args.out:
        magics.shell.user_ns[args.out] = t


def _service_subcommand(what: str, local_port: int, open_service, *options):
    """``%gpu tunnel tensorboard`` and ``%gpu tunnel jupyter``: one routine, each with its own
    parser.  ``open_service(machine, args)`` returns the tunnel (``machine.tensorboard``,
    ``machine.jupyter``); ``options`` are the service's own ``argument``s, first in its help."""
    def sub(magics: GpuMagics, line: str):
        args = parse(sub, line, f"tunnel {what.lower()}")  # every argument checked before anything starts
        m = magics.fleet.get(args.host)
        open_before = list(m.tunnels)
        t = open_service(m, args)
        if any(t is x for x in open_before):  # asked again: the open tunnel, its server untouched
            note = f"{what} on {m.name}: a tunnel is already open at {t.url} (the same one)"
        else:
            how = _service_note(what, m.name, t.service)
            note = "\n".join(x for x in (how, _moved_note(t, magics.fleet)) if x)
        _show(display.tunnel_opened(t, m.name, note, inline=args.inline))
        if args.out:
            magics.shell.user_ns[args.out] = t

    sub.__name__ = sub.__qualname__ = f"_tunnel_{what.lower()}"
    decorators = [magic_arguments(), *options,
                  argument("--local-port", type=LOCAL_PORT, default=local_port, metavar="N",
                           help=f"local port (default {local_port}; another if taken)"),
                  host_arg(),
                  argument("--inline", action="store_true", help=f"also show {what} in the cell"),
                  out_arg("the Tunnel (.url, .local_port, .stop())")]
    for decorate in reversed(decorators):  # as if stacked above ``def``, top one first in the help
        sub = decorate(sub)
    return sub


_tunnel_tensorboard = _service_subcommand(
    "TensorBoard", 6006, lambda m, args: m.tunnels.tensorboard(args.logdir, local_port=args.local_port),
    argument("--logdir", default="runs", metavar="DIR",
             help="event files directory on the machine (default: runs, relative to the cell directory)"))
_tunnel_jupyter = _service_subcommand("Jupyter", 8888, lambda m, args: m.tunnels.jupyter(local_port=args.local_port))


def _service_note(what: str, machine: str, service) -> str:
    """Whether gpumagic started the server now, earlier, or not at all (then --stop leaves it)."""
    if service.started:
        return f"started {what} on {machine} (pid {service.pid}, log {service.log})"
    if service.ours:
        log = f", log {service.log}" if service.log else ""
        return f"{what} already serving on {machine} (pid {service.pid}, started by gpumagic earlier{log})"
    return (f"{what} already serving on {machine} (pid {service.pid}, not started by gpumagic: "
            "`%gpu tunnel close ID --stop` leaves it running)")


def _all_tunnels(fleet: Fleet):
    """(machine name, tunnel) for every open tunnel, local ones first, then reverse ones."""
    return [(m.name, t) for m in fleet.machines.values()
            for t in [*m.tunnels, *m.tunnels.reverse_tunnels()]]


@magic_arguments()
def _tunnel_list(magics: GpuMagics, line: str):
    parse(_tunnel_list, line, "tunnel list")
    rows = _all_tunnels(magics.fleet)
    _show(display.Rendered(display.tunnel_table(rows), display.tunnel_table_html(rows)))


@magic_arguments()
@argument("id", help="the tunnel's ID (its local port, or R and the machine's port for a reverse "
                     "tunnel: see `%%gpu tunnel list`) or `all`")
@argument("--stop", action="store_true",
          help="also stop the TensorBoard/Jupyter server gpumagic started for it on the machine")
def _tunnel_close(magics: GpuMagics, line: str):
    args = parse(_tunnel_close, line, "tunnel close")
    reverse = args.id[:1] in ("R", "r") and args.id[1:].isdigit()
    try:
        port = None if args.id == "all" or reverse else LOCAL_PORT(args.id)
    except argparse.ArgumentTypeError:
        raise UsageError(f"`%gpu tunnel close {args.id}`: give an ID from `%gpu tunnel list` (a local "
                         "port number, or R and a port for a reverse tunnel) or `all`") from None
    closed = []
    for m in magics.fleet.machines.values():
        if args.id == "all":
            closed += m.tunnels.close_all(stop_service=args.stop)
        elif reverse:
            if args.id.upper() in {r.id for r in m.tunnels.reverse_tunnels()}:
                closed.append(m.tunnels.close_reverse(args.id.upper()))
        elif port in m.tunnels.tunnels:
            closed.append(m.tunnels.close(port, stop_service=args.stop))
    if not closed and args.id != "all":
        ids = ", ".join(t.id for _, t in _all_tunnels(magics.fleet)) or "none"
        raise UsageError(f"no tunnel with ID {args.id} (open: {ids})")
    for t in closed:
        if isinstance(t, ReverseTunnel):
            print(f"closed reverse tunnel {t.id} (the machine's {t.listen} -> this computer's {t.target}); "
                  f"{count(t.connections_total, 'connection')}, {format_bytes(t.bytes_up)} up")
        else:
            print(f"closed tunnel {t.local_port} -> {t.target} ({t.name}); "
                  f"{count(t.connections_total, 'connection')}, {format_bytes(t.bytes_down)} down")
        if args.stop and getattr(t, "service", None) is not None:
            print(f"  stopped its server on the machine (pid {t.service.pid})" if t.service.ours
                  else "  its server was not started by gpumagic; left running")
        for f in t.unreported_faults():
            print(f"  error on connection {f.connection}: {f.message}")
    if not closed:
        print("no tunnels were open")


def _tunnel_faults_post_run_cell(magics: GpuMagics):
    """After each cell: say the tunnel errors that happened in the background since the
    last time (a browser only sees a reset connection), once each, with what to do."""
    def hook(*_):
        if magics.closed:  # the extension was unloaded (see GpuMagics.close)
            return
        for name, t in _all_tunnels(magics.fleet):
            new = t.unreported_faults()
            if new:
                more = f" (and {len(new) - 1} more: `%gpu tunnel list`)" if len(new) > 1 else ""
                hint = getattr(new[0].error, "hint", "")
                print(f"gpumagic: {t.label} on {name}: {new[0].message}{more}"
                      + (f"\n  hint: {hint}" if hint else ""))
    return hook


#: ``%gpu tunnel SUB``: name -> (function, summary, usage); a port number is ``%gpu tunnel PORT``.
TUNNEL = Subcommands("%gpu tunnel", {
    "tensorboard": (_tunnel_tensorboard, "start TensorBoard there if needed, link to it", "[--logdir DIR]"),
    "jupyter": (_tunnel_jupyter, "the machine's Jupyter server (URL with token)"),
    "list": (_tunnel_list, "local URL, remote target, connections, bytes, state"),
    "--reverse": (_tunnel_reverse, "the machine's 127.0.0.1:P reaches this computer's 127.0.0.1:N "
                                   "(like ssh -N -R P:127.0.0.1:N)", "N [--remote-port P]"),
    "close": (_tunnel_close, "close (and stop what gpumagic started)", "ID|all [--stop]"),
}, aliases={"-R": "--reverse"}, intro="%gpu tunnel: open a port of the machine in your browser, over the SSH connection\n"
         "(local side on 127.0.0.1 only; nothing is opened to the internet).",
   outro="`%gpu tunnel tensorboard -h` (and so on) shows each one's options.",
   other=("PORT", str.isdigit, (_tunnel_port, "any port (like ssh -N -L N:localhost:PORT)", "[--local-port N]")))
