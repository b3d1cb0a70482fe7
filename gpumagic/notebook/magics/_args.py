"""What every magic's arguments share: the sub-command tables, reading the line, the numeric
types, the option bundles.

``%gpu`` and its groups (``%gpu budget``, ``%gpu kernel``, ``%gpu tunnel``) are each a
:class:`Subcommands` table from a name to a small function.  A sub-command declares its
parser with IPython's ``magic_arguments`` decorators and reads its line with :func:`parse`.
Options that several magics take are defined once here and applied as decorators
(``@host_arg()``, ``@out_arg("the Job handle")``), as IPython's ``core/magics/script.py``
does with ``script_args`` and ipyparallel's ``client/magics.py`` with ``exec_args`` and
``output_args``.  Bad arguments raise exactly ``UsageError``.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import keyword
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument

from ... import localpath
from ...budget import MAX_AMOUNT, MAX_GB, MAX_RATE, parse_duration
from ...errors import JobError
from ...remote.jobs import JobOptions, parse_stop_on
from ...remote.keep import KeepOptions
from ...sync.engine import SyncOptions


def split_args(line: str, *, windows: bool | None = None) -> list[str]:
    """Split a magic's argument line the way a shell would (``'./my dir/'``, ``X=a\\ b``).

    IPython's own splitter keeps the quotes in the words.  On Windows (``windows``, default
    this computer), backslashes are path separators, so only quotes are honoured there
    (:func:`gpumagic.localpath.split_command_line`).

    Raises
    ------
    UsageError
        For an unclosed quote.
    """
    try:
        return localpath.split_command_line(line, windows=windows)
    except ValueError as e:
        raise UsageError(f"cannot read the arguments ({e}): close the quote") from None


# -- sub-command tables ---------------------------------------------------------------------

#: The words that ask a table for its help instead of naming a sub-command.
HELP_WORDS = ("help", "-h", "--help")


@dataclass(frozen=True)
class Subcommand:
    """One row of a :class:`Subcommands` table.

    Attributes
    ----------
    fn : callable
        ``fn(magics, line)``: the rest of the line after the name (a function with its own
        ``magic_arguments`` parser, or another :class:`Subcommands` table).
    summary : str
        One line for the table's help.
    usage : str
        What follows the name in the help's row (``"[NAME] [--python PATH]"``); "" for none.
    """

    fn: Callable[..., Any]
    summary: str
    usage: str = ""


class Subcommands(Mapping[str, Subcommand]):
    """A table from sub-command name to a small function with its own parser, as jupysql's
    ``magic_cmd.py`` routes ``%sqlcmd tables|columns|...``.

    Called as ``table(magics, line)``: the line's first word picks the row and the rest of the
    line goes to its function.  ``help``, ``-h``, ``--help`` or nothing print
    :meth:`help_text`; ``help NAME`` is ``NAME -h``.  An unknown word raises exactly
    ``UsageError`` naming the valid ones (:meth:`unknown`).

    Parameters
    ----------
    prog : str
        The command as typed: ``"%gpu"``, ``"%gpu kernel"``.
    commands : mapping
        name -> ``(fn, summary)`` or ``(fn, summary, usage)`` (see :class:`Subcommand`), in the
        order the help lists them.
    intro, outro : str
        The help's first and last paragraphs ("" for none).
    default : tuple, optional
        ``(fn, summary, usage)`` for a line with no sub-command (empty, or an option first),
        given the whole line: ``%gpu budget [--host NAME]`` is the meter.  Then nothing (but
        ``help``, ``-h``) runs it instead of printing the help.
    default_is : str
        What the default is, for the unknown-word message ("the meter").
    other : tuple, optional
        ``(label, accepts, (fn, summary, usage))``: a first word that names no row but
        ``accepts(word)`` goes to ``fn`` with the whole line; ``%gpu tunnel 8000`` is
        ``("PORT", str.isdigit, ...)``.
    aliases : mapping
        another name -> a row's name (``"-R"`` -> ``"--reverse"``, as ``ssh -R``); the help
        shows it beside the row's.  A row's name may look like an option: it is matched before
        ``default`` takes a line that starts with one.
    """

    def __init__(self, prog: str, commands: Mapping[str, tuple], *, intro: str = "", outro: str = "",
                 default: tuple | None = None, default_is: str = "",
                 other: tuple[str, Callable[[str], bool], tuple] | None = None,
                 aliases: Mapping[str, str] | None = None):
        self.prog = prog
        self.rows = {name: Subcommand(*row) for name, row in commands.items()}
        self.aliases = dict(aliases or {})
        assert set(self.aliases.values()) <= set(self.rows), "an alias names a row"
        self.intro, self.outro = intro, outro
        self.default = Subcommand(*default) if default is not None else None
        self.default_is = default_is
        self.other = (other[0], other[1], Subcommand(*other[2])) if other is not None else None

    def __getitem__(self, name: str) -> Subcommand:
        return self.rows[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __call__(self, magics, line: str):
        """Run the sub-command ``line`` names (see the class docstring); returns what it returns."""
        word, rest = _first_word(line)
        if word == "help" and rest:
            return self(magics, f"{rest} -h")
        if word in HELP_WORDS or not word and self.default is None:
            print(self.help_text())
            return None
        row = self.rows.get(self.aliases.get(word, word))
        if row is not None:
            return row.fn(magics, rest)
        if self.default is not None and (not word or word.startswith("-")):
            return self.default.fn(magics, line)
        if self.other is not None and self.other[1](word):
            return self.other[2].fn(magics, line)
        raise UsageError(self.unknown(word))

    def unknown(self, word: str) -> str:
        """The one-line message for a first word that names no sub-command."""
        names = list(self.rows)
        close = [] if word.startswith("-") else difflib.get_close_matches(word, names, n=1)
        valid = ", ".join(names + ([self.other[0]] if self.other else [])
                          + ([f"none ({self.default_is})"] if self.default is not None else []))
        return (f"unknown sub-command {word!r} of {self.prog}" + (f" (did you mean {close[0]}?)" if close else "")
                + f"; valid: {valid}; `{self.prog} help` says what each does")

    def help_text(self) -> str:
        """The table's help: ``intro``, one row per sub-command (usage and summary), ``outro``."""
        rows = [(f"{self.prog} {self.default.usage}".rstrip(), self.default.summary)] if self.default else []
        rows += [(f"{self.prog} {'|'.join([name, *(a for a, n in self.aliases.items() if n == name)])} {row.usage}"
                  .rstrip(), row.summary) for name, row in self.rows.items()]
        if self.other is not None:
            label, _, row = self.other
            rows.append((f"{self.prog} {label} {row.usage}".rstrip(), row.summary))
        width = max((len(left) for left, _ in rows if len(left) <= _HELP_COLUMN), default=0)
        lines = [f"  {left.ljust(width)}  {summary}" if len(left) <= _HELP_COLUMN
                 else f"  {left}\n  {' ' * width}  {summary}" for left, summary in rows]
        return "\n\n".join(part for part in (self.intro, "\n".join(lines), self.outro) if part)


#: Widest usage column in a table's help; a longer usage puts its summary on the next line.
_HELP_COLUMN = 40


def _first_word(line: str) -> tuple[str, str]:
    """``"kernel start x"`` -> ``("kernel", "start x")``; any whitespace separates."""
    parts = line.strip().split(None, 1)
    return (parts[0], parts[1]) if len(parts) == 2 else (parts[0] if parts else "", "")


# -- numbers --------------------------------------------------------------------------------

_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_INTEGER = re.compile(r"[+-]?[0-9]+")


def _fmt_bound(v: float) -> str:
    return f"{v:,.0f}" if float(v).is_integer() and abs(v) < 1e15 else f"{v:g}"


def number(lo: float, hi: float, *, integer: bool = False, above: bool = False, what: str = "a number",
           durations: bool = False):
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
    durations : bool
        Seconds, also written with units: ``30s``, ``5m``, ``1h30m``, ``1d``
        (:func:`gpumagic.budget.parse_duration`).
    """
    kind = "a whole number" if integer else "a finite number"
    span = (f"above {_fmt_bound(lo)}, at most {_fmt_bound(hi)}" if above
            else f"from {_fmt_bound(lo)} to {_fmt_bound(hi)}")
    rule = f"{what}, {span}" + (", written like 90, 30s, 5m or 1h" if durations else "")
    if durations:
        kind = "a duration"

    def convert(text: str):
        s = text.strip()
        pattern = _INTEGER if integer else _DECIMAL
        if durations and not pattern.fullmatch(s):
            try:
                s = repr(parse_duration(s))
            except ValueError:
                raise argparse.ArgumentTypeError(f"{text!r} is not {kind}; give {rule}") from None
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


#: ``--keep-every`` (above 0) and ``--keep-settle`` (0 or more): seconds, at most 30 days.
EVERY_S = number(0, 30 * 86400, above=True, what="seconds", durations=True)
SETTLE_S = number(0, 30 * 86400, what="seconds", durations=True)
#: ``%%remote --grace``: seconds (0 or more; ``10m`` too) a cell outlives a lost connection.
GRACE_S = number(0, 30 * 86400, what="seconds", durations=True)
KEEP_LAST = number(1, 10**6, integer=True, what="a number of checkpoints")


# -- options shared by several magics ------------------------------------------------------

#: ``--host``'s help where the option picks the machine to act on.
HOST_HELP = "machine (default: the current one)"


def host_arg(help: str = HOST_HELP):
    """``--host NAME``: which connected machine (a name for ``Fleet.get``; None: the current one)."""
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


# -- a detached job's checkpoints (%%remote --job NAME --keep DIR) --------------------------


def checkpoint_args():
    """``%%remote --job``'s options for a job that continues from its checkpoints: ``--keep DIR``
    and its settings (:class:`gpumagic.remote.keep.KeepOptions`), the ``--resume-arg`` that
    `%gpu job move|resume` adds, and the ``--fallback`` machine it moves to by itself."""
    keep = argument("--keep", metavar="DIR",
                    help="pull new or changed files of DIR (relative to the job's working directory) to "
                         "this computer while the job runs and the notebook is open; a file is taken "
                         "whole: at its rename, or once it held still for --keep-settle")
    every = argument("--keep-every", metavar="S", type=EVERY_S,
                     help="with --keep: look every S (90, 30s, 5m; default 60s)")
    to = argument("--keep-to", metavar="LOCAL_DIR", help="with --keep: where the copies go (default ./NAME/DIR/)")
    last = argument("--keep-last", metavar="K", type=KEEP_LAST,
                    help="with --keep: keep only the newest K checkpoints here (a file or folder of DIR each)")
    settle = argument("--keep-settle", metavar="S", type=SETTLE_S,
                      help="with --keep: seconds a file written in place must hold still (size and mtime) "
                           "before it is taken (default 10s)")
    resume = argument("--resume-arg", metavar="ARGS",
                      help='with --job: what `%%gpu job move|resume` adds to the command to continue from a '
                           'checkpoint, {checkpoint} standing for its path, e.g. "--resume {checkpoint}"')
    fallback = argument("--fallback", metavar="MACHINE",
                        help="with --job and --keep: a connected machine the job moves to by itself if this "
                             "one is lost (as `%%gpu job move NAME --to MACHINE` would), while this notebook runs")
    return lambda fn: keep(every(to(last(settle(resume(fallback(fn)))))))  # in this order in the help


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


def _glue_dashed_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--opt -x`` as ``--opt=-x`` where ``--opt`` takes one value and ``-x`` is none of the
    parser's options: argparse reads every word that starts with ``-`` as an option, so
    ``--resume-arg "--resume={checkpoint}"`` failed with "expected one argument"."""
    known = {s for a in parser._actions for s in a.option_strings}
    takes_one = {s for a in parser._actions if a.option_strings and a.nargs is None for s in a.option_strings}
    out: list[str] = []
    words = iter(argv)
    for word in words:
        if word in takes_one:
            value = next(words, None)
            if value is not None and value.startswith("-") and value.split("=", 1)[0] not in known:
                word = f"{word}={value}"
            elif value is not None:
                out.append(word)
                word = value
        out.append(word)
    return out


def parse(fn, line: str, name: str | None = None, *, cell: bool = False) -> argparse.Namespace:
    """Parse ``line`` with ``fn``'s magic_arguments parser.

    ``-h`` prints the help (``cell``: a cell magic's, usage ``%%name``) and raises
    :class:`HelpShown`.  Bad arguments, and an ``--out`` that is not a variable name, raise
    exactly ``UsageError``.
    """
    if name is not None:
        fn.parser.prog = f"%gpu {name}"
    # No option is reached by a prefix of its name (argparse's default): `--del` would be
    # --delete, `--ti` --timeout.  A destructive option is only ever asked for in full.
    fn.parser.allow_abbrev = False
    argv = split_args(line)
    nul = next((w for w in argv if "\0" in w), None)
    if nul is not None:  # no path, name or value holds one; the OS would refuse it later
        raise UsageError(f"an argument holds a NUL character ({nul!r}): remove it")
    if any(tok in ("-h", "--help") for tok in argv):  # IPython's parser has add_help=False
        # IPython's parser formats help for docstrings ("::", "%%"); show it as typed, a cell
        # magic with its two %.
        text = fn.parser.format_help().lstrip(": \n").replace("%%", "%")
        if cell:
            text = text.replace(f"%{fn.__name__}", f"%%{fn.__name__}", 1)
        print("usage: " + text)
        raise HelpShown
    try:
        args = fn.parser.parse_args(_glue_dashed_values(fn.parser, argv))
    except SystemExit:  # argparse after printing --help
        raise HelpShown from None
    for action in fn.parser._actions:  # Python < 3.12 parses `--host=--` as the value []
        value = getattr(args, action.dest, None)
        values = value if isinstance(action, argparse._AppendAction) and isinstance(value, list) else [value]
        if action.option_strings and action.nargs is None and any(isinstance(v, list) for v in values):
            raise UsageError(f"argument {'/'.join(action.option_strings)}: expected one value, not '--'")
    check_out(getattr(args, "out", None))
    return args


# -- the options of a job and of a sync, read by one machine's magics and by torchrun's -------


#: The ``--keep`` options (``%%remote --job NAME --keep DIR ...``): option -> attribute.
_KEEP_OPTIONS = {"--keep-every": "keep_every", "--keep-to": "keep_to", "--keep-last": "keep_last",
                 "--keep-settle": "keep_settle"}


def keep_given(args) -> bool:
    """Whether the line gave ``--keep`` or one of its options (``--fallback`` among them)."""
    return getattr(args, "keep", None) is not None or getattr(args, "fallback", None) is not None or any(
        getattr(args, a, None) is not None for a in _KEEP_OPTIONS.values())


def keep_options(args) -> KeepOptions | None:
    """The :class:`KeepOptions` of the ``--keep`` options (None without ``--keep``); raises
    exactly ``UsageError`` for an option of ``--keep`` without it, or a bad value."""
    if args.keep is None:
        given = [o for o, a in _KEEP_OPTIONS.items() if getattr(args, a) is not None]
        if given:
            raise UsageError(f"{', '.join(given)} need --keep DIR (e.g. --keep ckpt/)")
        return None
    options = {k: v for k, v in (("every", args.keep_every), ("to", args.keep_to), ("last", args.keep_last),
                                 ("settle", args.keep_settle)) if v is not None}
    try:
        return KeepOptions(args.keep, **options)
    except JobError as e:
        raise UsageError(f"{e.message}; {e.hint}") from None


def job_options(args, **changes) -> JobOptions:
    """The :class:`JobOptions` of ``%%remote --job``'s options (``changes`` on top); raises
    exactly ``UsageError`` for a bad ``--stop-on`` or ``--env``."""
    try:
        stop_on = parse_stop_on(args.stop_on)
    except Exception as e:
        raise UsageError(f"--stop-on {args.stop_on!r}: {getattr(e, 'hint', e)}") from None
    resume_arg = getattr(args, "resume_arg", None)
    if resume_arg is not None and not resume_arg.strip():
        raise UsageError('--resume-arg is empty: give the words that continue from a checkpoint, '
                         'e.g. --resume-arg "--resume {checkpoint}"')
    return JobOptions(python=args.python, cwd=args.cwd, env=env_pairs(args.env), stop_on=stop_on,
                      then_shutdown=args.then_shutdown, alerts=not args.no_alerts,
                      resume_arg=resume_arg).with_(**changes)


def sync_options(args) -> SyncOptions:
    """The :class:`gpumagic.sync.engine.SyncOptions` of ``%gpu sync``'s flags."""
    return SyncOptions(delete=args.delete, exclude=tuple(args.exclude), ignore_files=args.ignore_files,
                            dry_run=args.dry_run, checksum=args.checksum, update=args.update,
                            compress=args.compress, rename_clashes=bool(getattr(args, "rename_clashes", False)),
                            max_delete=0 if getattr(args, "yes", False) else None)
