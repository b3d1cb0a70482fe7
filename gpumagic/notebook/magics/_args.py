"""What every magic's arguments share: reading the line, the numeric types, the option bundles.

A sub-command declares its parser with IPython's ``magic_arguments`` decorators and reads its
line with :func:`parse`.  Options that several magics take are defined once here and applied
as decorators (``@host_arg()``, ``@out_arg("the Job handle")``), as IPython's
``core/magics/script.py`` does with ``script_args`` and ipyparallel's ``client/magics.py``
with ``exec_args`` and ``output_args``.  Bad arguments raise exactly ``UsageError``.
"""

from __future__ import annotations

import argparse
import functools
import keyword
import math
import os
import re
import shlex

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument

from ...budget.prices import MAX_AMOUNT, MAX_GB, MAX_RATE


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


# -- numbers --------------------------------------------------------------------------------

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


# -- options shared by several magics ------------------------------------------------------

#: ``--host``'s help where the option picks the machine to act on.
HOST_HELP = "machine (default: the current one)"


def host_arg(help: str = HOST_HELP):
    """``--host NAME``: which connected machine (a name for ``Session.get``; None: the current one)."""
    return argument("--host", metavar="NAME", help=help)


def out_arg(what: str, more: str = ""):
    """``--out VAR``: store ``what`` in the user's namespace as ``VAR``.

    :func:`parse` refuses a ``VAR`` that is not a Python variable name before the magic starts
    anything.  ``more`` is added to the help after "in VAR".
    """
    return argument("--out", metavar="VAR", help=f"store {what} in VAR{more}")


def check_out(name: str | None) -> None:
    """``--out NAME`` must be a Python variable name (checked before anything is started)."""
    if name is not None and (not name.isidentifier() or keyword.iskeyword(name)):
        raise UsageError(f"--out {name!r} is not a Python variable name; e.g. --out result")


def env_pairs(items: list[str]) -> dict[str, str]:
    """``--env NAME=VALUE`` (repeated) as a dict; raises exactly ``UsageError`` for a bad one."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not key.replace("_", "a").isalnum() or key[0].isdigit():
            raise UsageError(f"--env {item!r}: write it as NAME=VALUE, e.g. --env CUDA_VISIBLE_DEVICES=0")
        env[key] = value
    return env


# -- reading a line ------------------------------------------------------------------------


class HelpShown(Exception):
    """:func:`parse` printed the help (``-h``): the magic ends there and returns None.

    ``%gpu`` and ``%%remote`` catch it (see :func:`returns_after_help`), so a sub-command
    needs no check of its own.
    """


def returns_after_help(magic):
    """Decorate a magic method: after :func:`parse` printed the help, it returns None."""
    @functools.wraps(magic)  # keeps the docstring and magic_arguments' ``parser``
    def run(*args, **kwargs):
        try:
            return magic(*args, **kwargs)
        except HelpShown:
            return None
    return run


def parse(fn, line: str, name: str | None = None, *, cell: bool = False) -> argparse.Namespace:
    """Parse ``line`` with ``fn``'s magic_arguments parser.

    ``-h`` prints the help (``cell``: a cell magic's, usage ``%%name``) and raises
    :class:`HelpShown`.  Bad arguments, and an ``--out`` that is not a variable name, raise
    exactly ``UsageError``.
    """
    if name is not None:
        fn.parser.prog = f"%gpu {name}"
    argv = split_args(line)
    if any(tok in ("-h", "--help") for tok in argv):  # IPython's parser has add_help=False
        # IPython's parser formats help for docstrings ("::", "%%"); show it as typed, a cell
        # magic with its two %.
        text = fn.parser.format_help().lstrip(": \n").replace("%%", "%")
        if cell:
            text = text.replace(f"%{fn.__name__}", f"%%{fn.__name__}", 1)
        print("usage: " + text)
        raise HelpShown
    try:
        args = fn.parser.parse_args(argv)
    except SystemExit:  # argparse after printing --help
        raise HelpShown from None
    for action in fn.parser._actions:  # Python < 3.12 parses `--host=--` as the value []
        value = getattr(args, action.dest, None)
        values = value if isinstance(action, argparse._AppendAction) and isinstance(value, list) else [value]
        if action.option_strings and action.nargs is None and any(isinstance(v, list) for v in values):
            raise UsageError(f"argument {'/'.join(action.option_strings)}: expected one value, not '--'")
    check_out(getattr(args, "out", None))
    return args
