"""Live Python sessions (the API: :mod:`gpumagic.remote.kernel`): ``%gpu kernel SUB ...``
(the table :data:`KERNEL`), ``%%remote --kernel [NAME]`` and the autorun mode.

Each handler takes the :class:`gpumagic.notebook.magics.GpuMagics` instance and its argument
line (or parsed arguments), calls the plain-Python API once, and displays.
"""

from __future__ import annotations

import contextlib
import html
import sys
import time
import weakref
from typing import Iterator, MutableMapping

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

from ..._format import format_bytes
from ...remote.kernel import (DEFAULT_NAME, KernelError, Output, RemoteKernel, RemoteValue, check_name,
                              list_kernels)
from ...kernel_bridge import spec as kernelspec
from .. import display
from ._args import Subcommands, env_pairs, host_arg, parse
from ._output import OutputCap


class NotebookOutput(Output):
    """A live session's output shown in this notebook: streams to stdout/stderr (``\\r`` kept),
    MIME bundles through IPython's display machinery with their display ids, so
    ``update_display_data`` and ``clear_output`` act on the right output.

    At most ``limit`` characters of text and ``image_limit`` bytes of images are shown per
    cell (the ``%%remote`` cap, :class:`OutputCap`: a MIME bundle with an image counts as an
    image, any other as text), counting what the notebook holds: ``clear_output`` empties the
    count, and an update of a display replaces its size with the update's.
    """

    def __init__(self, limit: int | None = None, cell_result: bool = False,
                 image_limit: int | None = None, *, bridges: MutableMapping | None = None):
        self.cap = OutputCap(limit, kept="the text", image_limit=image_limit)
        #: The notebook's comm bridges, by session (``GpuMagics.state.bridges``); None: this
        #: output's own (its widgets then live only as long as it does).
        self.bridges: MutableMapping = weakref.WeakKeyDictionary() if bridges is None else bridges
        #: Show the cell's value (its execute_result) as this notebook cell's own result
        #: (``%%remote --kernel``), rather than as a display.
        self.cell_result = cell_result

    def stream(self, name: str, text: str) -> None:
        self.cap.write(sys.stderr if name == "stderr" else sys.stdout, text)

    def display(self, data, metadata, display_id=None, update=False) -> None:
        from IPython.display import display as ipy_display
        from IPython.display import update_display

        if not self.cap.admit_display(data, display_id, update):
            return
        if update and display_id:
            update_display(data, raw=True, metadata=metadata, display_id=display_id)
        elif display_id:
            ipy_display(data, raw=True, metadata=metadata, display_id=display_id)
        else:
            ipy_display(data, raw=True, metadata=metadata)

    def clear(self, wait: bool = False) -> None:
        from IPython.display import clear_output

        self.cap.clear()
        clear_output(wait=wait)

    def page(self, data: dict) -> None:
        # as for a local `len?`: IPython's pager (a "page" payload of this notebook's own
        # execute_reply under ipykernel; the terminal's pager in IPython)
        from IPython.core import page

        page.page(data)

    def note(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def result(self, data, metadata) -> None:
        # a %%remote --kernel cell's value goes through IPython's display hook when it comes
        # (so in the order the machine sent it, before the figures its inline backend shows
        # after it): an execute_result with this notebook's count, `_` and Out[n] set here
        from IPython import get_ipython

        shell = get_ipython()
        if not self.cell_result or shell is None:
            self.display(data, metadata)
            return
        if self.cap.admit_value(data):
            shell.displayhook(RemoteValue(data, metadata))

    def comm(self, kernel, kind, content, metadata, buffers) -> None:
        from .. import comms

        comms.bridge(self.bridges, kernel, lambda: NotebookOutput(bridges=self.bridges)).from_session(
            kind, content, metadata, buffers)

    def request_id(self) -> str | None:
        # the message of this notebook's that runs the cell: what a widget's Output there
        # names as the parent of its output, and what the front end then looks for here
        from IPython import get_ipython

        kernel = getattr(get_ipython(), "kernel", None)
        parent = kernel.get_parent() if kernel is not None and hasattr(kernel, "get_parent") else {}
        return (parent or {}).get("header", {}).get("msg_id") or None

    def finish(self) -> None:
        if self.cap.held_back:
            self.note(self.cap.note())


def _output(magics, cell_result: bool = False) -> NotebookOutput:
    return NotebookOutput(magics.max_display_bytes, cell_result, image_limit=magics.max_image_bytes,
                          bridges=magics.state.bridges)


def _get(magics, host: str | None, name: str | None, *, start: bool = False,
         **options) -> RemoteKernel:
    """The session ``name`` on machine ``host``; with ``start``, started when it is not
    running yet (saying so), and when it was running, saying which of ``options`` (``cwd``,
    ``env``) it did not take."""
    m = magics.fleet.get(host)
    ks = m.kernels
    k = ks.handle(ks.resolve(name))
    if start:
        answer = k.ensure(**options)
        if answer is None or answer.get("status") == "running":
            state = (answer or {}).get("state") or {"cwd": k.cwd}
            note = not_applied(k.name, state, cwd=options.get("cwd"), env=options.get("env"))
            if note:
                print(f"session {k.name} already runs; {note}", file=sys.stderr)
        elif answer.get("status") == "started":
            print(f"started session {k.name} on {m.name} ({answer.get('python')}, Python "
                  f"{answer.get('python_version', '?')}); it keeps running when this notebook "
                  f"closes: `%gpu kernel stop {k.name}` ends it", file=sys.stderr)
        _used(k)
    return k


def _used(k: RemoteKernel) -> None:
    """``k`` becomes what a later command without a name means: once a command on it worked,
    so that a misspelt name that failed is not taken up by the next one."""
    k.machine.kernels.last = k.name


def not_applied(name: str, state: dict, *, python: str | None = None, cwd: str | None = None,
                env: dict | None = None) -> str:
    """What a running session did not take of the options given to start it (``python``,
    ``cwd`` and ``env`` are fixed when its kernel starts), with the way out; "" when it
    took them all.  ``state`` is its ``state.json`` (``python``, ``cwd``)."""
    left = []
    if python and state.get("python") and python != state.get("python"):
        left.append(f"--python {python}")
    if cwd and not _same_dir(cwd, state.get("cwd") or ""):
        left.append(f"--cwd {cwd} (it runs in {state.get('cwd') or '?'}; os.chdir() in a cell moves it)")
    if env:
        left.append("--env " + " ".join(f"{k}={v}" for k, v in env.items()))
    if not left:
        return ""
    return (f"{', '.join(left)} {'was' if len(left) == 1 else 'were'} not applied "
            f"(`%gpu kernel stop {name}` first to change {'it' if len(left) == 1 else 'them'})")


def _same_dir(given: str, actual: str) -> bool:
    """Whether ``--cwd given`` names the session's absolute ``actual`` directory (``~`` and
    relative paths start at the machine's HOME, which is not known here: their tail decides)."""
    g, actual = given.rstrip("/") or "/", actual.rstrip("/") or "/"
    if g.startswith("~"):
        g = g[1:].lstrip("/")
    if g.startswith("/"):
        return g == actual
    return not g or g == "." or actual.endswith("/" + g)


# -- %%remote --kernel ------------------------------------------------------------------------


def skip_blank_kernel_cells(lines: list[str]) -> list[str]:
    """An IPython input transformer (``shell.input_transformers_cleanup``): a ``%%remote
    --kernel`` cell with nothing under its first line becomes an empty cell, which does
    nothing, as an empty local cell does (IPython refuses a cell magic whose body is empty,
    ``run_cell_magic``, before the magic is called)."""
    first = lines[0] if lines else ""
    if not (first.startswith("%%remote ") or first.rstrip() == "%%remote") or any(ln.strip() for ln in lines[1:]):
        return lines
    words = first.split()[1:]
    if any(w in ("-h", "--help") for w in words) or not any(w == "--kernel" or w.startswith("--kernel=") for w in words):
        return lines
    return []


def skip_blank_kernel_cells_in(shell) -> None:
    """Register :func:`skip_blank_kernel_cells` with ``shell`` (once)."""
    if shell is not None and skip_blank_kernel_cells not in shell.input_transformers_cleanup:
        shell.input_transformers_cleanup.append(skip_blank_kernel_cells)


def remote_cell(magics, args, cell: str):
    """``%%remote --kernel [NAME]``: run the cell in a live session (started on first use).

    The cell's output streams into this cell; an exception raises here with the machine's
    traceback; an interrupt interrupts the cell there and re-raises KeyboardInterrupt.
    """
    bad = [opt for opt, on in (("--job", args.job is not None), ("--stop-on", bool(args.stop_on)),
                               ("--then-shutdown", args.then_shutdown is not None),
                               ("--no-alerts", args.no_alerts), ("--python", args.python),
                               ("--keep", args.keep is not None)) if on]
    if bad == ["--python"]:
        raise UsageError("--kernel does not combine with --python: a session keeps the python it "
                         "started with (`%gpu kernel start NAME --python PATH` picks it)")
    if bad:
        raise UsageError(f"--kernel does not combine with {', '.join(bad)}: a session runs "
                         "Python cells in place (use --job for a detached script)")
    if not cell.strip():  # as a local empty cell: nothing runs, nothing is sent
        return None
    k = _get(magics, args.host, _name(args.kernel), start=True, cwd=args.cwd, env=env_pairs(args.env))
    out = _output(magics, cell_result=True)
    try:
        result = k.execute(cell, output=out, timeout=args.timeout, capture=bool(args.out),
                           raise_error=not args.no_raise_error)
    finally:
        out.finish()
    if args.out:
        magics.shell.user_ns[args.out] = result
    return None


def _name(name: str | None) -> str | None:
    """A session name as given (checked: a bad one is exactly ``UsageError``); None or "" -> None."""
    if not name:
        return None
    try:
        return check_name(name)
    except KernelError as e:
        raise UsageError(f"{e.message}: {e.hint}") from None


# -- %gpu kernel SUB ---------------------------------------------------------------------------


@magic_arguments()
@argument("name", nargs="?", help=f"session name (default: {DEFAULT_NAME}, or the machine's only one)")
@argument("--python", metavar="PATH", help="the machine's python for the kernel (default: python3)")
@argument("--cwd", metavar="DIR", help="the kernel's working directory (default: the machine's)")
@argument("--env", metavar="K=V", action="append", default=[], help="environment variable (repeatable)")
@argument("--install", action="store_true",
          help="run `PYTHON -m pip install ipykernel` on the machine first if it is missing")
@host_arg()
def _start(magics, line: str):
    args = parse(_start, line, "kernel start")
    name, env = _name(args.name), env_pairs(args.env)  # every argument checked before anything starts
    m = magics.fleet.get(args.host)
    ks = m.kernels
    name = name or ks.resolve(None)
    k = ks.handle(name)
    answer = k.start(python=args.python, cwd=args.cwd, env=env, install=args.install, output=_output(magics))
    ks.last = k.name
    if answer.get("status") == "running":
        state = answer.get("state") or {}
        note = not_applied(name, state, python=args.python, cwd=args.cwd, env=env)
        note = f"; {note}" if note else ""
        print(f"session {name} already runs on {m.name} ({state.get('python')}, "
              f"{state.get('state', '?')}){note}")
        return
    print(f"started session {name} on {m.name}: {answer.get('python')} (Python "
          f"{answer.get('python_version', '?')}), in {answer.get('cwd')}; it keeps running when "
          f"this notebook closes.\n`%%remote --kernel` runs cells there; "
          f"`%gpu kernel stop {name}` ends it")


@magic_arguments()
@argument("--kernelspecs", action="store_true",
          help="list the gpumagic kernelspecs installed on this computer instead (`%%gpu kernel install`)")
@host_arg()
def _list(magics, line: str):
    args = parse(_list, line, "kernel list")
    if args.kernelspecs:
        if args.host is not None:
            raise UsageError("--kernelspecs lists every machine's kernelspecs: leave out --host")
        print(kernelspec.listing())
        return
    m = magics.fleet.get(args.host)
    kernels = list_kernels(m)
    from IPython.display import display as ipy_display

    running = [k.name for k in kernels if k.running]
    current = m.kernels.last or (running[0] if len(running) == 1 else None)
    ipy_display(kernels_table(kernels, m.name, current))


def kernels_table(kernels, machine_name: str, current: str | None = None) -> display.Rendered:
    """The ``%gpu kernel list`` table (or a sentence when there is none)."""
    if not kernels:
        text = (f"no sessions on {machine_name}; `%gpu kernel start` or a `%%remote --kernel` "
                "cell starts one")
        return display.Rendered(text, f"<p>{html.escape(text)}</p>")
    now = time.time()
    rows = [("NAME", "PYTHON", "STATE", "GPU MEM", "STARTED")]
    for k in kernels:
        gpu = "-" if k.gpu_mib is None else f"{k.gpu_mib} MiB"
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(k.started)) if k.started else "-"
        mark = " *" if k.name == current else ""
        rows.append((k.name + mark, k.python + (f" ({k.python_version})" if k.python_version else ""),
                     k.state_text(now), gpu, started))
    head = "".join(f"<th style='text-align:left'>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td style='text-align:left'>{html.escape(c)}</td>" for c in r)
                   + "</tr>" for r in rows[1:])
    foot = "* the session %%remote --kernel uses" if current in {k.name for k in kernels} else ""
    return display.Rendered(f"sessions on {machine_name}:\n" + display.text_table(rows)
                            + (f"\n{foot}" if foot else ""),
                            f"<p>sessions on <b>{html.escape(machine_name)}</b></p><table><thead>"
                            f"<tr>{head}</tr></thead><tbody>{body}</tbody></table>"
                            + (f"<p>{html.escape(foot)}</p>" if foot else ""))


@magic_arguments()
@argument("name", help="session name")
@host_arg()
def _stop(magics, line: str):
    args = parse(_stop, line, "kernel stop")
    name = _name(args.name)
    m = magics.fleet.get(args.host)
    ks = m.kernels
    k = ks.handle(name)
    if k.info() is None:
        raise KernelError(f"no session {args.name!r} on {m.name}", "`%gpu kernel list` shows them")
    k.stop()
    ks.forget(k.name)
    _autorun_off_for(magics, m.name, k.name)
    print(f"stopped session {k.name} on {m.name} (its kernel and the processes it started)")


def session_args(required: bool = False):
    """``NAME`` (a session; optional: the one used last, or the only one) and ``--host``: the
    options of a sub-command that acts on one running session."""
    name = (argument("name", help="session name") if required else
            argument("name", nargs="?", help="session name (default: the one used last, or the only one)"))
    return lambda fn: name(host_arg()(fn))  # NAME first in the help, then --host


@contextlib.contextmanager
def _session(magics, fn, line: str) -> Iterator[RemoteKernel]:
    """Parse ``line`` with ``fn``'s parser (:func:`session_args`); the session it names, for a
    ``with`` block that acts on it.  Once the block ran without an error, the session is the
    one used last (:func:`_used`)."""
    args = parse(fn, line, f"kernel {fn.__name__.lstrip('_')}")
    k = _get(magics, args.host, _name(args.name))
    yield k
    _used(k)


@magic_arguments()
@session_args(required=True)
def _restart(magics, line: str):
    with _session(magics, _restart, line) as k:
        k.restart(output=_output(magics))
    print(f"restarted session {k.name} on {k.machine.name}: a new kernel, no variables")


@magic_arguments()
@session_args()
def _interrupt(magics, line: str):
    with _session(magics, _interrupt, line) as k:
        k.interrupt()
    print(f"sent an interrupt to session {k.name} on {k.machine.name} (its variables are kept)")


@magic_arguments()
@session_args()
def _attach(magics, line: str):
    with _session(magics, _attach, line) as k:
        out = _output(magics)
        try:
            status = k.attach(output=out)
        finally:
            out.finish()
    print(f"session {k.name} on {k.machine.name}: {status.get('state')}; nothing more to show",
          file=sys.stderr)


def variables_args(whose: str):
    """``VAR...``, ``-k NAME`` (the session) and ``--host``: what push and pull take."""
    names = argument("names", nargs="+", metavar="VAR", help=f"variables of {whose}")
    kernel = argument("-k", "--kernel", metavar="NAME", help="session (default: the one used last, or the only one)")
    return lambda fn: names(kernel(host_arg()(fn)))


@magic_arguments()
@variables_args("this notebook")
def _push(magics, line: str):
    args = parse(_push, line, "kernel push")
    ns = magics.shell.user_ns
    missing = [n for n in args.names if n not in ns]
    if missing:
        raise UsageError(f"no variable {missing[0]!r} in this notebook (push copies variables by name)")
    k = _get(magics, args.host, _name(args.kernel), start=True)
    start = time.monotonic()
    sizes = k.push({n: ns[n] for n in args.names})
    print(f"pushed {_sizes(sizes, ns)} to {k.where} in {time.monotonic() - start:.2f} s")


@magic_arguments()
@variables_args("the session")
def _pull(magics, line: str):
    args = parse(_pull, line, "kernel pull")
    bad = [n for n in args.names if not n.isidentifier()]
    if bad:
        raise UsageError(f"{bad[0]!r} is not a Python variable name")
    k = _get(magics, args.host, _name(args.kernel))
    start = time.monotonic()
    values = k.pull(list(args.names))
    _used(k)
    magics.shell.user_ns.update(values)
    print(f"pulled {_sizes(k.last_pull_sizes, values)} from {k.where} in "
          f"{time.monotonic() - start:.2f} s")


def _sizes(sizes: dict, values: dict) -> str:
    return ", ".join(f"{n} ({type(values[n]).__name__}, {format_bytes(s)})"
                     for n, s in sizes.items())


# -- autorun ----------------------------------------------------------------------------------


#: Line magics that configure the session a cell's code runs in, its display or its module
#: reloading: at the top of an autorun cell they go there with the rest of the cell.
SESSION_MAGICS = frozenset({"matplotlib", "pylab", "autoreload", "aimport"})
#: Magics that time or profile the code after them: at the top of an autorun cell they take
#: the whole cell to the session, which measures the code where it runs.  Here, IPython's
#: ``%time a = f()`` would send ``a = f()`` there (through this transformer) and run the
#: cell's other lines here; ``%timeit`` would time thousands of round trips.
MEASURING_MAGICS = frozenset({"time", "timeit", "prun"})


def configures_session(line: str) -> bool:
    """Whether ``line`` (stripped) is a line magic of :data:`SESSION_MAGICS`, ``%config
    InlineBackend...``, ``%load_ext autoreload``, or a line or cell magic of
    :data:`MEASURING_MAGICS`: one that belongs in the session an autorun cell runs in, not in
    this notebook's kernel."""
    if not line.startswith("%") or not line.lstrip("%").strip():
        return False
    name, *rest = line.lstrip("%").split(None, 1)
    if line.startswith("%%"):
        return name in MEASURING_MAGICS
    if name in MEASURING_MAGICS:
        return True
    arg = rest[0].strip() if rest else ""
    if name == "config":
        return arg.startswith("InlineBackend")
    if name == "load_ext":
        return arg == "autoreload"
    return name in SESSION_MAGICS


def runs_here(lines: list[str]) -> bool:
    """Whether autorun leaves a cell to this notebook's kernel: an empty cell, or one whose
    first line is a magic or shell escape (``%``, ``!``), unless every magic line at its top
    (comments and blank lines between them allowed) configures the session
    (:func:`configures_session`: ``%matplotlib inline``, ``%config InlineBackend...``,
    ``%load_ext autoreload``, ``%autoreload 2``, ...)."""
    top = False  # a magic that configures the session seen at the top
    for ln in (ln.strip() for ln in lines):
        if not ln or (top and ln.startswith("#")):
            continue
        if not ln.startswith(("%", "!")):
            return False  # code (or a comment first): the cell runs there
        if not configures_session(ln):
            return True
        top = True
    return not top  # an empty cell stays here; one of only such magics goes there


class Autorun:
    """An IPython input transformer (``shell.input_transformers_cleanup``) that turns each
    code cell into ``%%remote --kernel NAME``, except cells whose first line is a magic or
    shell escape (``%``, ``!``), which run here: so line magics, and ``%gpu kernel autorun
    off``, still run locally (as with ipyparallel's ``%autopx``).  Magics that configure the
    session at the top of a cell (``%matplotlib inline``, ``%config InlineBackend...``,
    autoreload's; ``%time``, ``%%timeit``...: :func:`runs_here`) go there with the cell, so
    its imports do too, and the code is timed where it runs."""

    def __init__(self, machine: str, kernel: str):
        self.machine, self.kernel = machine, kernel

    def __call__(self, lines: list[str]) -> list[str]:
        if runs_here(lines):
            return lines
        args = f"--kernel {self.kernel} --host {self.machine}"
        return [f"get_ipython().run_cell_magic('remote', {args!r}, {''.join(lines)!r})\n"]


def _autorun_current(magics) -> Autorun | None:
    return next((t for t in magics.shell.input_transformers_cleanup if isinstance(t, Autorun)), None)


def _autorun_off_for(magics, machine: str, kernel: str) -> None:
    t = _autorun_current(magics)
    if t is not None and (t.machine, t.kernel) == (machine, kernel):
        magics.shell.input_transformers_cleanup.remove(t)
        print(f"autorun is off (session {kernel} was stopped)")


@magic_arguments()
@argument("mode", choices=["on", "off"], help="on: send every following code cell to the session")
@argument("name", nargs="?", help="session name (default: the one used last, or the only one)")
@host_arg()
def _autorun(magics, line: str):
    args = parse(_autorun, line, "kernel autorun")
    shell = magics.shell
    old = _autorun_current(magics)
    if old is not None:
        shell.input_transformers_cleanup.remove(old)
    if args.mode == "off":
        print("autorun is off: cells run here again" if old else "autorun was not on")
        return
    k = _get(magics, args.host, _name(args.name), start=True)
    shell.input_transformers_cleanup.append(Autorun(k.machine.name, k.name))
    print(f"autorun is on: every following code cell runs in session {k.name} on {k.machine.name}; "
          "cells starting with % or ! run here (but %matplotlib, %config InlineBackend, "
          "autoreload's magics and %time, %timeit, %prun go there with their cell); "
          "`%gpu kernel autorun off` ends it")


# -- kernelspecs: the session in a front end's kernel list (gpumagic.kernel_bridge) ------------


def kernelspec_args(fn):
    """``[HOST]``, ``--sandbox`` and ``--name SESSION``: the session a kernelspec picks."""
    host = argument("target", nargs="?", metavar="HOST",
                    help="a connected machine's name, a ~/.ssh/config alias or user@host[:port] "
                         "(default: the current machine)")
    sandbox = argument("--sandbox", action="store_true",
                       help="the local sandbox machine (as `%%gpu connect --sandbox`; nothing rented)")
    name = argument("--name", default=DEFAULT_NAME, metavar="SESSION",
                    help=f"the session on the machine (default: {DEFAULT_NAME}, as for `%%gpu kernel start`)")
    return host(sandbox(name(fn)))


def _kernelspec_host(magics, args) -> tuple[str, bool]:
    """``(host, sandbox)`` for :class:`gpumagic.kernel_bridge.spec.BridgeSpec` from ``HOST`` /
    ``--sandbox``: a connected machine (the current one by default) as the bridge can reach
    it, or the text given, as ``gpumagic kernel install`` takes it."""
    if args.sandbox:
        if args.target:
            raise UsageError(f"give either HOST or --sandbox, not both ({args.target!r})")
        return kernelspec.SANDBOX, True
    if args.target and args.target not in magics.fleet.machines:
        return args.target, False
    m = magics.fleet.get(args.target)
    if m.sandbox is not None:
        from ...ssh.sandbox import sandbox_home

        if m.sandbox.home != sandbox_home():
            raise UsageError(f"{m.name} is a sandbox with a home of its own (--name {m.name}); a kernelspec "
                             "reaches only the default sandbox: `%gpu kernel install --sandbox`")
        return kernelspec.SANDBOX, True
    host = kernelspec.host_of(m.spec)
    if host is None:
        raise UsageError(f"{m.name} was connected with options ~/.ssh/config does not hold (-i, -J, -l or -p), "
                         "and a kernelspec reaches a machine by a name alone: run your `%gpu connect` line again "
                         "with --save NAME (it writes a Host block to ~/.ssh/config), then `%gpu kernel install`")
    return host, False


@magic_arguments()
@kernelspec_args
@argument("--python", metavar="PATH", help="the machine's Python for the session (default: python3 there; "
          "on the sandbox, this Python)")
@argument("--display-name", help="the name shown in the kernel list (default: Python 3 on HOST (gpumagic))")
@argument("--sys-prefix", action="store_true",
          help="install into this environment's share/jupyter, not the user's data directory")
def _install(magics, line: str):
    args = parse(_install, line, "kernel install")
    session = _name(args.name)
    host, sandbox = _kernelspec_host(magics, args)
    spec = kernelspec.BridgeSpec(host=host, session=session or DEFAULT_NAME, python=args.python,
                                 sandbox=sandbox, display_name=args.display_name)
    print(kernelspec.installed_text(spec, kernelspec.install(spec, sys_prefix=args.sys_prefix)))


@magic_arguments()
@argument("kernel", nargs="?", metavar="KERNELSPEC",
          help="gpumagic-HOST, or HOST (default: the kernelspec of the current machine's session --name)")
@argument("--name", default=DEFAULT_NAME, metavar="SESSION",
          help=f"without KERNELSPEC: the session whose kernelspec goes (default: {DEFAULT_NAME})")
def _uninstall(magics, line: str):
    args = parse(_uninstall, line, "kernel uninstall")
    name = args.kernel
    if name is None:
        args.target, args.sandbox = None, False
        host, sandbox = _kernelspec_host(magics, args)
        name = kernelspec.BridgeSpec(host=host, session=_name(args.name) or DEFAULT_NAME, sandbox=sandbox).kernel_name
    print(kernelspec.uninstalled_text(kernelspec.uninstall(name)))


#: ``%gpu kernel SUB``: name -> (function, summary, usage).
KERNEL = Subcommands("%gpu kernel", {
    "start": (_start, "start one (or say it runs)", "[NAME] [--python PATH] [--cwd DIR] [--env K=V] [--install]"),
    "list": (_list, "name, python, state (idle / busy since), GPU memory", "[--kernelspecs]"),
    "attach": (_attach, "show what it printed while you were away, then follow", "[NAME]"),
    "push": (_push, "copy variables from here to the session", "VAR... [-k NAME]"),
    "pull": (_pull, "copy variables from the session to here", "VAR... [-k NAME]"),
    "interrupt": (_interrupt, "interrupt the running cell (variables are kept)", "[NAME]"),
    "restart": (_restart, "a new kernel (variables are lost)", "NAME"),
    "stop": (_stop, "stop it and its processes", "NAME"),
    "autorun": (_autorun, "send every following code cell to the session", "on [NAME] | off"),
    "install": (_install, "a kernelspec: the session in JupyterLab's kernel list",
                "[HOST] [--name SESSION] [--python PATH]"),
    "uninstall": (_uninstall, "remove that kernelspec (the session runs on)", "[KERNELSPEC]"),
}, intro="%gpu kernel: a live Python session on the machine (ipykernel), kept running when this\n"
         "notebook closes; variables persist between cells.",
   outro="%%remote --kernel [NAME] runs one cell there (default: the session used last, or the\n"
         "machine's only one, or `main`, started on first use).  `%gpu kernel SUB -h` shows options.")
