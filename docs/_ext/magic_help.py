"""Every magic's help, as the notebook prints it: the table behind ``%gpu`` walked, and each
command's ``-h`` run through a real IPython shell with gpumagic loaded.

:func:`commands` lists the commands (``%%remote``, ``%gpu``, ``%gpu connect``, ...,
``%gpu kernel``, ``%gpu kernel start``, ...); :func:`help_text` gives what typing the command
with ``-h`` (a table: ``help``) prints.  The docs' magic reference (``gpumagic_docs``) and
``tests/test_docs.py`` read them, so the reference is the parsers' own text.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """One command of the reference.

    Attributes
    ----------
    name : str
        As typed: ``"%gpu kernel start"``; a table's default row reads ``"%gpu budget [--host NAME]"``.
    line : str
        What follows ``%gpu`` (``%%remote``: the cell magic's line) to print its help.
    table : bool
        A table of sub-commands (``%gpu``, ``%gpu kernel``): its help lists them.
    """

    name: str
    line: str
    table: bool = False

    @property
    def anchor(self) -> str:
        """The reference section's id: ``magic-gpu-kernel-start``."""
        words = self.name.replace("%", " ").replace("[", " ").replace("]", " ").replace("|", " ").replace("(", " ").replace(")", " ").split()
        return "magic-" + "-".join(w.strip("-").lower() for w in words if w.strip("-"))


def _is_table(fn) -> bool:
    """A ``Subcommands`` table (``gpumagic/notebook/magics/_args.py``): rows and a help text."""
    return hasattr(fn, "rows") and hasattr(fn, "help_text")


def _table_of(name: str, fn):
    """The table a row's function is, or imports on first use (``%gpu kernel``'s function imports
    ``gpumagic.notebook.magics.kernel.KERNEL``: the group's module, its name in capitals)."""
    if _is_table(fn) or hasattr(fn, "parser"):
        return fn
    import importlib

    try:
        table = getattr(importlib.import_module(f"gpumagic.notebook.magics.{name}"), name.upper().replace("-", "_"))
    except (ImportError, AttributeError):
        return fn
    return table if _is_table(table) else fn


def commands() -> list[Command]:
    """Every command, in the order ``%gpu help`` lists them, ``%%remote`` first; a table's rows
    follow the table."""
    from gpumagic.notebook import magics

    out = [Command("%%remote", "-h"), Command("%gpu", "help", table=True)]

    def walk(table, words: list[str]) -> None:
        if table.default is not None:
            usage = _default_usage(table)
            # a line that starts with an option goes to the default row: its own -h
            out.append(Command(f"%gpu {' '.join(words)}{usage}", " ".join(words + ["--host", "_", "-h"])))
        for name, row in table.rows.items():
            fn = _table_of(name, row.fn)
            if _is_table(fn):
                out.append(Command(fn.prog, " ".join(words + [name, "help"]), table=True))
                walk(fn, words + [name])
            elif hasattr(fn, "parser"):
                out.append(Command(f"%gpu {' '.join(words + [name])}", " ".join(words + [name, "-h"])))
            else:
                raise LookupError(f"%gpu {' '.join(words + [name])}: its function has no magic_arguments parser "
                                  f"and is no Subcommands table; teach docs/_ext/magic_help.py where its parser is")
        if table.other is not None:
            label, _accepts, row = table.other
            out.append(Command(f"%gpu {' '.join(words)} {label}", " ".join(words + [_EXAMPLE[label], "-h"])))

    walk(magics.SUBCOMMANDS, [])
    return out


def _default_usage(table) -> str:
    """What follows the words of a table's default row in its name: its usage (``[--host
    NAME]``), or, where it takes none, a note that tells it from the table (``%gpu provider``)."""
    return f" {table.default.usage}" if table.default.usage else " (no sub-command)"


#: A word that a table's ``other`` row accepts, to reach its help.
_EXAMPLE = {"PORT": "8000"}


def shell():
    """An IPython shell with gpumagic loaded (the running one, else a new one, history in memory)."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    if InteractiveShell.initialized():
        ip = InteractiveShell.instance()
    else:
        c = Config()
        c.HistoryManager.hist_file = ":memory:"
        ip = InteractiveShell.instance(config=c)
    if getattr(ip, "_gpumagic", None) is None:
        ip.run_line_magic("load_ext", "gpumagic")
    return ip


def help_text(command: Command, ip=None) -> str:
    """What the notebook prints for ``command``'s help, without the trailing newline."""
    ip = ip if ip is not None else shell()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if command.name == "%%remote":
            ip.run_cell_magic("remote", command.line, "pass")
        else:
            ip.run_line_magic("gpu", command.line)
    return out.getvalue().rstrip("\n")


def summaries() -> dict[str, str]:
    """A command's one line from its table (what ``%gpu help`` says beside it), by name."""
    from gpumagic.notebook import magics

    def first_line(fn) -> str:  # magic_arguments puts the usage first in __doc__; not in its parser's
        parser = getattr(fn, "parser", None)
        return ((parser.description if parser is not None else None) or fn.__doc__ or "").strip().split("\n")[0]

    found = {"%%remote": first_line(magics.GpuMagics.remote), "%gpu": first_line(magics.GpuMagics.gpu)}

    def walk(table, words):
        if table.default is not None:
            usage = _default_usage(table)
            found[f"%gpu {' '.join(words)}{usage}"] = table.default.summary
        for name, row in table.rows.items():
            found[f"%gpu {' '.join(words + [name])}"] = row.summary
            fn = _table_of(name, row.fn)
            if _is_table(fn):
                walk(fn, words + [name])
        if table.other is not None:
            found[f"%gpu {' '.join(words)} {table.other[0]}"] = table.other[2].summary
    walk(magics.SUBCOMMANDS, [])
    return found
