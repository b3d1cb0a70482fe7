"""``%gpu wrapup``: before releasing a machine (the checks are :mod:`gpumagic.wrapup`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display as _show

from ... import wrapup as wrapupmod
from ...errors import ConfigError, Interrupted
from ...sync.engine import parse_endpoint
from ..display import Rendered
from ._args import host_arg, out_arg, parse

if TYPE_CHECKING:
    from . import GpuMagics


def _ask(text: str) -> bool:
    """One yes/no question in the notebook (``input``); no stdin (nbclient, a script) is no."""
    try:
        answer = input(text + "\n[y/N] ")
    except (EOFError, OSError):
        return False
    except Exception as e:  # IPython's StdinNotImplementedError: a front end without input
        if type(e).__name__ == "StdinNotImplementedError":
            return False
        raise
    return answer.strip().lower() in ("y", "yes")


@magic_arguments()
@argument("--pull", nargs=2, action="append", metavar=("REMOTE", "LOCAL"),
          help="results folder to check and pull, as in %%gpu sync (`--pull :runs/ ./runs/`; repeatable; "
               "remembered for the next wrapup of this machine)")
@argument("--no-pull", action="store_true", help="only list what is not pulled yet")
@argument("--clean", action="store_true",
          help="remove the caches listed (pip, conda pkgs, ~/.cache, temporary files, old VS Code servers, "
               "__pycache__), after one confirmation")
@argument("--yes", action="store_true", help="with --clean: skip the confirmation")
@host_arg()
@out_arg("the WrapupReport")
def _wrapup(magics: GpuMagics, line: str):
    """Before releasing a machine: pull the results not pulled yet, show (and --clean) the
    caches an image would carry, the image's size and price, and what still runs."""
    args = parse(_wrapup, line, "wrapup")
    m = magics.fleet.get(args.host)
    pulls = []
    for src, dst in args.pull or []:
        try:
            a, b = parse_endpoint(src), parse_endpoint(dst)
        except ConfigError as e:
            raise UsageError(e.message) from None
        if not a.remote or b.remote:
            raise UsageError(f"--pull {src} {dst}: give the machine's folder first, then the local one "
                             "(`--pull :runs/ ./runs/`)")
        if a.host and a.host != m.name:
            raise UsageError(f"--pull {src}: that names machine {a.host!r}, but this wrapup is of {m.name!r} "
                             f"(use --host {a.host})")
        pulls.append((src, dst))
    if args.yes and not args.clean:
        raise UsageError("--yes only applies to --clean")
    confirm = (lambda _text: True) if args.yes else (lambda text: _ask(text))
    try:
        report = wrapupmod.wrapup(m, pulls or None, pull=not args.no_pull, clean=args.clean, confirm=confirm)
    except KeyboardInterrupt:
        raise Interrupted("the wrap-up was interrupted and stopped, here and on the machine; run "
                          f"%gpu wrapup again before releasing {m.name} (it checks everything anew)") from None
    _show(Rendered(wrapupmod.report_text(report), wrapupmod.report_html(report)))
    if args.out:
        magics.shell.user_ns[args.out] = report
