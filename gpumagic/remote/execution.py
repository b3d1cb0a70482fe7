r"""Run a command or a cell on the remote machine: streaming, exit codes, interrupt, timeout.

How a command reaches the machine
---------------------------------
sshd runs every exec request as ``$SHELL -c "<request>"`` with the user's *login shell*, which
may be bash, zsh, fish or tcsh: each re-reads the text with its own quoting rules (fish turns
``\\`` into ``\`` inside single quotes, tcsh rejects a quoted newline).  So gpumagic never
sends a program in the request.  The request is always :data:`BOOTSTRAP`, ``exec /bin/sh``:
plain words, no quote, escape, ``$``, glob or operator, which every one of those shells reads
the same way.  The login shell still starts first (so ``~/.bashrc``, ``config.fish`` and
conda set the environment, as for ``ssh host cmd``), then becomes ``/bin/sh``, which reads the
real program from the channel's stdin, where no login shell touches it: cell text, ``--env``
values and ``--cwd`` arrive byte for byte, and none of them is ever in a process's argv
(``/proc/PID/cmdline`` is readable by every local user).

The program is one ``{ ...; }`` group followed by ``exit``, so ``/bin/sh`` has read and parsed
all of it before it runs the first line, and never reads stdin again.  Its first line prints
a marker (``\036gpumagic-NONCE PID``).  A shell reading a pipe may read ahead of the command
it runs (dash does, in blocks), so data meant for the program's own stdin is sent only after
that marker arrived (see :func:`exec_simple` and :func:`start_program`): one more round trip,
only for commands that read stdin.

How a cell runs
---------------
Through the connection's *runner* when it can start
(``gpumagic/remote/programs/exec-runner.py``; :func:`_take_runner`): a Python process on the
connection, started once like every program here (through the login shell, so its
environment is the one every exec gets; the login-environment delta is applied per cell as
before), on a session channel that stays open.  Each cell is one request frame on that
channel (argv, directory, environment, NUL-separated: no shell reads them); the runner starts the
cell as its child in a new session with stdin from ``/dev/null`` and sends back its PID,
stdout and stderr as they come, and its exit status.  No shell start-up file runs again per
cell (``~/.bashrc`` cost 200 ms a cell on images that run ``pyenv init`` or conda's hook
unguarded; ``SHLVL`` is set so that the cell's own ``bash -c`` does not source it either).
A stop request (interrupt, timeout) does what a terminal's Ctrl-C does first: SIGINT to the
cell's processes, so the program's ``except KeyboardInterrupt:`` and ``finally:`` run (a
checkpoint saved on Ctrl-C is saved) and what they print is shown; SIGTERM follows
:func:`run`'s ``interrupt_wait`` seconds later (:data:`INTERRUPT_WAIT`; at once once the cell's own
process ended and only what it started is left), SIGKILL :data:`KILL_GRACE` seconds after
that; a second interrupt sends the next signal at once.  The cell's processes are its process
group and every process that carries its mark (``GPUMAGIC_CELL`` in its environment), also
one that left the group (``setsid``, a daemon).  Kill on drop: the runner's watchdog process kills every
running cell's group when the runner ends, whether the channel closed (dropped connection,
killed sshd, the client gave up) or the runner itself was killed (a kept cell, below,
outlives a closed channel for its grace).  One cell uses a runner
at a time; a cell that comes while the others run gets a runner of its own beside them
(:class:`_Pool`, up to :data:`MAX_RUNNERS` a connection), so it is kept too.  A cell past
those, or every cell where the runner cannot start (no usable Python 3), runs the old way
below.

Kept cells (issue 28): a cell run through the runner with a grace (:data:`GRACE`, 600 s by
default; :func:`run`'s ``grace``, ``%%remote --grace``) outlives a dead path.  Its request ("K")
carries an id that the machine claims with ``mkdir`` (``~/.gpumagic/cells/ID``), so a request
sent again never starts it twice; the runner keeps its output there (bounded by
:data:`SPOOL_BYTES`: past it the oldest part goes, and the client says how many bytes it
missed) and feeds the channel from it without ever letting a stalled channel block the cell.
When the path dies (:meth:`Connection.in_flight` notices within seconds, or the channel ends)
the client connects again within the grace and sends the same request with the stdout and
stderr byte counts it has shown: the new connection's runner follows the spool from there to
the exit status (:class:`_KeptCell`, :func:`_reattach`).  The client sends a few bytes ("h")
while a kept cell runs; the machine stops a cell whose client it has not heard for its grace,
and gpumagic stops it over a new connection when the grace is over
(``exec-stop-kept.py``).  With a grace of 0 a cell is stopped with its connection, as below.

The old way, one exec per cell: the program is the wrapper
``gpumagic/remote/programs/exec-cell.sh`` (run through :mod:`gpumagic.remote.program`), with the directory, the environment and the cell's argv as
its arguments.  It:

* (in the frame :func:`program` puts around it) prints the marker with its PID -- sshd made the login shell a session leader and
  ``exec`` kept the PID, so it is also the process group of everything the cell starts;
* enters the working directory (``~`` and relative paths start at ``$HOME``), exports the
  environment, and runs the cell (``bash -c`` or ``python3 -u -c``) with stdin from
  ``/dev/null``;
* watches the channel's stdin from a small background ``sh`` (handed fd 3, since an
  asynchronous list's own stdin is /dev/null; its command line holds no cell text): when the
  channel closes (interrupt, timeout, dropped connection, killed sshd) it sends SIGTERM to the
  whole process group, then SIGKILL one second later.  Nothing the cell started is left
  running.

stdout and stderr are read concurrently in one loop (no deadlock on megabytes of both) and
decoded incrementally as UTF-8 with replacement, so a character split across reads stays
whole and invalid bytes never raise.
"""

from __future__ import annotations

import codecs
import logging
import re
import secrets
import shlex
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import paramiko

from ..ssh._paramiko import send_eof, sendall_ordered
from ..ssh.connection import Connection
from ..ssh.pump import ChannelPump
from ..ssh.reconnect import RECONNECT, GaveUp, Reconnects
from .._format import duration
from ..errors import ConnectionLost, RemoteCommandError, RemoteTimeout
from . import program as _program

log = logging.getLogger(__name__)

#: The exec request of every command gpumagic runs: three plain words that sh, bash, dash,
#: zsh, fish, tcsh and csh all parse alike.  The program follows on stdin.
BOOTSTRAP = "exec /bin/sh"
#: Run cells through the per-connection runner when it can start (benchmarks turn it off).
USE_RUNNER = True
#: Largest cell or command text sent inline (bytes).  Linux limits one argument to 128 KiB.
MAX_INLINE = 120 * 1024
#: Seconds between SIGTERM and SIGKILL when a cell is stopped.
KILL_GRACE = 1.0
#: Seconds an interrupted cell gets after SIGINT (its handler saving a checkpoint) before
#: SIGTERM, by default (:func:`run`'s ``interrupt_wait``; ``%config GpuMagics.interrupt_wait``).
INTERRUPT_WAIT = 10.0
#: Seconds after its SIGINT a cell still running is told of what comes next (one line).
STOP_NOTE_AFTER = 1.0
#: The wrapper's exit status when the working directory does not exist (stderr says which).
CWD_MISSING = 97

#: Seconds the error of a cell cut by a lost connection waits for its processes to be
#: stopped over a new connection (the stop goes on in the background past it).
STOP_WAIT = 5.0
#: The stopper of a cut cell (``gpumagic/remote/programs/exec-stop-cell.sh``).
STOP_PROGRAM = "exec-stop-cell.sh"

#: Seconds a running cell outlives a dead path (a roam, a blink, a laptop asleep) by default:
#: it runs on, its output kept on the machine, and the client re-attaches on a new connection
#: (see "Kept cells" in the module docstring).  0: the cell is stopped when its path is lost.
#: A new connection is sought as :mod:`gpumagic.ssh.reconnect` says, within it.
GRACE = RECONNECT.grace
#: Most bytes of a kept cell's output the machine holds for a client that is away; past
#: it the oldest part is dropped, and the client says how many bytes it missed.
SPOOL_BYTES = 64 << 20
#: The stopper of a kept cell by its id (``gpumagic/remote/programs/exec-stop-kept.py``).
STOP_KEPT_PROGRAM = "exec-stop-kept.py"

#: The wrapper every cell runs in (``gpumagic/remote/programs/exec-cell.sh``).
CELL_PROGRAM = "exec-cell.sh"
#: The login-environment probe (``gpumagic/remote/programs/exec-login-env.sh``).
LOGIN_ENV_PROGRAM = "exec-login-env.sh"

_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: Variables that belong to the shell itself (read-only where /bin/sh is bash): never passed.
_SHELL_OWN = frozenset({"UID", "EUID", "PPID", "SHELLOPTS", "BASHOPTS", "BASH_VERSINFO"})


@dataclass
class RunResult:
    """What a remote command produced.

    Attributes
    ----------
    stdout, stderr : str
        Everything written (UTF-8, invalid bytes replaced), unless not captured (or its
        last ``capture`` characters, where ``capture`` was a number).
    exit_code : int
        Remote exit status; 128+N when ended by signal N.
    seconds : float
        Wall time from start to exit.
    stdout_bytes, stderr_bytes : int
        Raw byte counts received.
    """

    stdout: str
    stderr: str
    exit_code: int
    seconds: float
    stdout_bytes: int = 0
    stderr_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def __repr__(self) -> str:
        return (f"RunResult(exit_code={self.exit_code}, stdout={len(self.stdout)} chars, "
                f"stderr={len(self.stderr)} chars, seconds={self.seconds:.3f})")


Sink = Callable[[str], None]


def check_text(text: str, what: str = "the cell", *, by_line: bool = True) -> str:
    """Return ``text`` if it can be sent, else raise :class:`RemoteCommandError` naming the
    line (``by_line``; 1-based) that holds a NUL byte, or a lone surrogate that is not
    :func:`os.fsdecode`'s stand-in for a byte (``\\udc80``-``\\udcff``, sent as that byte).

    No program can receive a NUL: argv and environment strings end at one, and bash drops
    them from a script.  A NUL in a cell almost always comes from pasted binary data, so it is
    refused before anything is sent.
    """
    i = text.find("\0")
    if i >= 0:
        where = f"line {text.count(chr(10), 0, i) + 1} of {what}" if by_line else what
        raise RemoteCommandError(
            f"{where} holds a NUL byte (\\0), which cannot be sent to the machine",
            exit_code=-1,
            hint="remove it (pasted binary data?); to write a NUL byte, use printf '\\0' in the cell")
    try:
        text.encode("utf-8", "surrogateescape")  # \udc80-\udcff: a byte that is not UTF-8 (os.fsdecode)
    except UnicodeEncodeError as e:
        ch = ord(text[e.start])
        where = f"line {text.count(chr(10), 0, e.start) + 1} of {what}" if by_line else what
        raise RemoteCommandError(
            f"{where} holds a lone surrogate U+{ch:04X} (text from a broken decode), which no "
            "encoding can send", exit_code=-1,
            hint=f"retype that character, or write it as the escape '\\u{ch:04x}'") from None
    return text


def cell_text(code: str) -> str:
    """A cell's text as the machine runs it: its CRLF line endings as LF (a notebook or
    ``.py`` edited on Windows), so that bash never sees ``\\r`` glued to a command's last word
    (``$'\\r': command not found``) and a ``--python`` cell is its LF twin; checked with
    :func:`check_text`.  A lone ``\\r`` is the cell's own character and stays.  Output is
    never changed: it keeps the line endings the program wrote."""
    return check_text(code.replace("\r\n", "\n"))


def cell_bytes(code: str, *, python: bool = False, what: str = "the cell") -> bytes:
    """A cell's text as the bytes the machine receives: :func:`cell_text`, in UTF-8.

    A lone surrogate ``\\udc80``-``\\udcff`` is what :func:`os.fsdecode` makes of a byte that
    is not UTF-8 (a file name from ``os.listdir`` pasted into a cell).  A shell cell sends it
    as that byte (``surrogateescape``), so the cell names the same file as ``%gpu cd`` and
    ``--cwd`` do with the same text.  Python source must be UTF-8, so a ``--python`` cell
    holding one is refused, as is any other lone surrogate (:func:`check_text`): both name the
    line.

    Raises
    ------
    RemoteCommandError
        For a NUL byte or such a surrogate, naming its line.
    """
    code = cell_text(code)
    try:
        return code.encode("utf-8", "strict" if python else "surrogateescape")
    except UnicodeEncodeError as e:
        ch = code[e.start]
        line = code.count("\n", 0, e.start) + 1
        raise RemoteCommandError(
            f"line {line} of {what} holds a lone surrogate U+{ord(ch):04X} (text from a broken "
            "decode), and Python source must be UTF-8", exit_code=-1,
            hint=f"write the byte as b'\\x{ord(ch) - 0xDC00:02x}', or retype the character") from None


def program(body: str, nonce: str) -> bytes:
    """The bytes sent on stdin after :data:`BOOTSTRAP`: ``body`` (POSIX sh) in one group.

    The first line prints the marker ``\\036gpumagic-NONCE PID``; ``exit`` after the group
    keeps ``/bin/sh`` from ever reading stdin again, so what follows on stdin belongs to
    ``body``'s commands.

    Raises
    ------
    RemoteCommandError
        When ``body`` holds a NUL byte.
    """
    check_text(body, "the command")
    # surrogateescape: a path that is not UTF-8 (os.fsdecode's \udcXX) goes as its own bytes
    return (f"{{\nprintf '\\036gpumagic-%s %s\\n' {nonce} \"$$\"\n{body}\n}}; exit\n").encode(
        "utf-8", "surrogateescape")


def _split_env(env: Mapping[str, str | None]) -> tuple[list[tuple[str, str | None]], dict[str, str | None]]:
    """(the entries ``sh`` can set, in order; the entries whose names are not shell variable
    names), leaving out the shell's own variables; RemoteCommandError for a NUL byte."""
    shell, rest = [], {}
    for k, v in env.items():
        check_text(k + "=" + (v or ""), f"the environment variable {k.partition(chr(0))[0]}",
                   by_line=False)
        if k in _SHELL_OWN:
            continue
        if _SHELL_NAME.fullmatch(k):
            shell.append((k, v))
        else:
            rest[k] = v
    return shell, rest


def export_lines(env: Mapping[str, str | None]) -> tuple[list[str], dict[str, str | None]]:
    """``sh`` lines that set ``env`` (``export K='V'``; ``unset K`` for a ``None`` value),
    and the entries no ``sh`` can set: names that are not shell variable names.

    Variables of the shell itself (``UID``, ``PPID``, ``SHELLOPTS``... read-only where
    ``/bin/sh`` is bash) are left out.

    Raises
    ------
    RemoteCommandError
        For a NUL byte in a name or value.
    """
    shell, rest = _split_env(env)
    return [f"unset {k}" if v is None else f"export {k}={shlex.quote(v)}" for k, v in shell], rest


def build_program(argv: Sequence[str], *, cwd: str | None = None,
                  env: Mapping[str, str | None] | None = None, nonce: str,
                  interrupt_wait: float | None = None) -> bytes:
    """The program a cell runs as (see the module docstring): the wrapper
    ``exec-cell.sh`` around ``argv``, all of it arguments of the wrapper.

    ``env`` values of ``None`` unset that variable.  Names that are shell variable names are
    exported by the shell, so no value is ever in a process's argv; other names (bash's
    exported functions, ``BASH_FUNC_f%%``) can only be passed by ``env(1)``, on its command
    line for the instant before it runs ``argv``.  ``interrupt_wait``: as :func:`run`'s.
    """
    cmd = list(argv)
    check_text(cwd or "", "the working directory", by_line=False)
    shell, rest = _split_env(env or {})
    if rest:
        unset = [a for k, v in rest.items() if v is None for a in ("-u", k)]
        cmd = ["env", *unset, "--", *(f"{k}={v}" for k, v in rest.items() if v is not None), *cmd]
    entries = [k if v is None else f"{k}={v}" for k, v in shell]
    return program(_program.command(CELL_PROGRAM, cwd or "", f"{_wait(interrupt_wait):g}/{KILL_GRACE:g}", CWD_MISSING, len(entries),
                                    *entries, *cmd), nonce)


def cell_argv(code: str, *, python: bool = False, python_exe: str = "python3") -> list[str]:
    """argv that runs a cell: ``bash -c CODE`` or ``python3 -u -c CODE`` (CODE with LF line
    endings: :func:`cell_text`).

    Raises
    ------
    RemoteCommandError
        When the cell is over :data:`MAX_INLINE` bytes, or holds a NUL byte or a lone
        surrogate it cannot send (naming its line: :func:`cell_bytes`).
    """
    size = len(cell_bytes(code, python=python))
    code = cell_text(code)
    if size > MAX_INLINE:
        raise RemoteCommandError(
            f"the cell is {size} bytes; at most {MAX_INLINE} bytes can be sent inline",
            exit_code=-1,
            hint="put the code in a file, `%gpu sync` it, and run the file",
        )
    if python:
        return [python_exe, "-u", "-c", code]
    return ["bash", "-c", code]


class _Stream:
    """One stream of a command: decoded as it comes, passed to ``sink``, and kept for the
    result as ``capture`` says: everything (True), nothing (False), or its last ``capture``
    characters (an int: memory stays flat however much a cell prints)."""

    def __init__(self, sink: Sink | None, capture: bool | int):
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.sink = sink
        self.tail = None if isinstance(capture, bool) else max(0, int(capture))
        self.capture = bool(capture) or self.tail is not None
        self.parts: list[str] = []
        self.kept = 0  # characters in parts
        self.nbytes = 0

    def feed(self, data: bytes, final: bool = False) -> None:
        self.nbytes += len(data)
        text = self.decoder.decode(data, final)
        if not text:
            return
        self.keep(text)
        if self.sink is not None:
            self.sink(text)

    def keep(self, text: str) -> None:
        if not self.capture:
            return
        self.parts.append(text)
        self.kept += len(text)
        if self.tail is not None and self.kept > 2 * self.tail + 65536:  # trimmed now and then
            joined = "".join(self.parts)[-self.tail:]
            self.parts, self.kept = [joined], len(joined)

    @property
    def text(self) -> str:
        text = "".join(self.parts)
        return text if self.tail is None else text[-self.tail:] if self.tail else ""


class _MarkerFilter:
    """Strips the wrapper's ``\\x1egpumagic-NONCE PID`` line from the start of stdout."""

    def __init__(self, nonce: str):
        self.tag = f"\x1egpumagic-{nonce} ".encode()
        self.buf = b""
        self.pid: int | None = None
        self.done = False

    def feed(self, data: bytes) -> bytes:
        if self.done:
            return data
        self.buf += data
        i = self.buf.find(self.tag)
        if i < 0:
            # Output before the marker (a chatty ~/.bashrc) passes through, except a tail
            # that could be the start of the marker.
            keep = len(self.tag) + 16
            if len(self.buf) > keep:
                out, self.buf = self.buf[:-keep], self.buf[-keep:]
                return out
            return b""
        j = self.buf.find(b"\n", i)
        if j < 0:
            return b""
        try:
            self.pid = int(self.buf[i + len(self.tag):j])
        except ValueError:
            self.pid = None
        out = self.buf[:i] + self.buf[j + 1:]
        self.buf = b""
        self.done = True
        return out

    def flush(self) -> bytes:
        out, self.buf = self.buf, b""
        return out


def run(conn: Connection, argv: Sequence[str] | str, *, cwd: str | None = None,
        env: Mapping[str, str | None] | None = None, stdout: Sink | None = None,
        stderr: Sink | None = None, capture: bool | int = True, timeout: float | None = None,
        check: bool = False, grace: float | None = None,
        interrupt_wait: float | None = None) -> RunResult:
    """Run ``argv`` on the machine and stream its output.

    Parameters
    ----------
    conn : Connection
        Opened (or re-opened) on demand.
    argv : sequence of str, or str
        The program and its arguments, run without a shell; a ``str`` runs through
        ``bash -c``.
    cwd : str, optional
        Remote working directory: absolute, ``~/...``, or relative to ``$HOME``.
    env : mapping, optional
        Extra environment variables (a ``None`` value unsets one).  Values never appear in
        a process's argv.
    stdout, stderr : callable, optional
        Called with each decoded text chunk as it arrives (``\\r`` kept as sent).
    capture : bool or int
        Keep the whole output in the result (True), none of it (False: for huge outputs), or
        each stream's last ``capture`` characters (an int).
    timeout : float, optional
        Seconds; past it the process group is stopped and :class:`RemoteTimeout` raised.
    check : bool
        Raise :class:`RemoteCommandError` on a non-zero exit.
    grace : float, optional
        Seconds the command outlives a lost connection (default: :data:`GRACE`): it runs on,
        its output kept on the machine, and is re-attached over a new connection, its missed
        output shown once, in order (see :class:`_KeptCell`).  0 stops it when the connection is
        lost.  ``%%remote --grace`` and ``%config GpuMagics.grace`` hand it in.
    interrupt_wait : float, optional
        Seconds an interrupted command gets between SIGINT and SIGTERM (default:
        :data:`INTERRUPT_WAIT`; ``%config GpuMagics.interrupt_wait``).

    Returns
    -------
    RunResult

    Raises
    ------
    ConnectionLost
        The connection dropped mid-command and (with a grace) no new one came within the
        grace; the remote process group is stopped (by the machine itself too, once no
        client was heard for the grace).  The next call reconnects.
    RemoteTimeout, RemoteCommandError, KeyboardInterrupt
        KeyboardInterrupt is re-raised after the remote process group has been stopped.
        RemoteCommandError also before anything is sent, for a NUL byte in ``argv``,
        ``cwd`` or ``env`` (nothing can carry one).
    """
    if isinstance(argv, str):
        argv = ["bash", "-c", check_text(argv)]
    for i, a in enumerate(argv):
        check_text(a, f"argument {i} of the command", by_line=False)
    out, err = _Stream(stdout, capture), _Stream(stderr, capture)
    request = runner_request(argv, cwd=cwd, env=env)  # refuses a NUL byte before anything runs
    conn.ensure_alive()  # a path gone quiet must answer first, or a new one is taken
    runner = _take_runner(conn) if USE_RUNNER else None
    if runner is not None:
        start = time.monotonic()
        kept = _KeptCell(grace if grace is not None else GRACE, err)
        try:
            if kept.grace > 0:
                code = _run_kept(conn, runner, request, out, err, timeout, start, kept, interrupt_wait)
            else:
                with conn.in_flight():
                    code = runner.run(conn, request, out, err, timeout, start, interrupt_wait=interrupt_wait)
        except _NotStarted:
            code = None  # the runner ended before it started the cell: run it the old way
        except _LostMidCommand as e:
            raise _cut(conn, e, runner.cell_pid or 0, runner.pid or 0) from None
        if code is not None:
            result = RunResult(out.text, err.text, code, time.monotonic() - start, out.nbytes,
                               err.nbytes)
            if check and code != 0:
                raise RemoteCommandError(f"remote command exited with code {code}", exit_code=code,
                                         stdout=result.stdout, stderr=result.stderr)
            return result
    nonce = secrets.token_hex(6)
    script = build_program(argv, cwd=cwd, env=env, nonce=nonce, interrupt_wait=interrupt_wait)
    chan = conn.open_session()
    marker = _MarkerFilter(nonce)
    start = time.monotonic()
    try:
        chan.exec_command(BOOTSTRAP)
        try:
            with conn.in_flight():
                _pump(conn, chan, lambda data: out.feed(marker.feed(data)), err.feed, timeout,
                      start, script=script)
        except _Timeout:
            _stop(chan)
            raise RemoteTimeout(
                f"the command ran past its timeout of {timeout:g} s and was stopped",
                "raise --timeout, or run it as a job (%%remote --job) if it is meant to run long",
            )
        out.feed(marker.flush(), final=True)
        err.feed(b"", final=True)
        code = chan.recv_exit_status()
        if code == -1 and _gone(conn, chan):
            raise _lost(conn)
    except KeyboardInterrupt:
        _stop(chan)
        raise
    except _LostMidCommand as e:
        raise _cut(conn, e, marker.pid or 0, 0) from None
    except (paramiko.SSHException, EOFError, OSError) as e:
        raise _cut(conn, _LostMidCommand(conn, e), marker.pid or 0, 0) from None
    finally:
        chan.close()
    result = RunResult(out.text, err.text, code, time.monotonic() - start, out.nbytes, err.nbytes)
    if check and code != 0:
        raise RemoteCommandError(f"remote command exited with code {code}", exit_code=code,
                                 stdout=result.stdout, stderr=result.stderr)
    return result


def _wait(interrupt_wait: float | None) -> float:
    """Seconds between SIGINT and SIGTERM for a cell stopped now (None: :data:`INTERRUPT_WAIT`)."""
    return INTERRUPT_WAIT if interrupt_wait is None else max(0.0, float(interrupt_wait))


class _KeptCell:
    """The client's side of a kept cell (issue 28; ``exec-runner.py``'s "K" request): a cell
    that outlives a dead path for :attr:`grace` seconds.

    Its :attr:`id` is claimed on the machine by the first request that arrives, so a request
    sent again over a new connection (the first one maybe lost in the dying path, maybe only
    late) starts the cell at most once and otherwise re-attaches to it.  :attr:`pos` counts
    the stdout and stderr bytes accounted for (shown, or dropped on the machine past its
    bound: :attr:`lost`), and a re-attach asks for what follows them, so every byte is
    shown once, in order.
    """

    def __init__(self, grace: float, err: "_Stream"):
        self.id = secrets.token_hex(8)
        self.grace = float(grace)
        #: Seconds between the client's "h" frames, as the runner's ``beat()`` computes.
        self.beat = min(10.0, max(0.5, self.grace / 4))
        self.pos = [0, 0]
        self.lost = [0, 0]
        #: The grace after which the machine stopped the cell (its "G"), if it did.
        self.graced: str | None = None
        self.reconnects = 0
        #: When the last "h" went out.
        self.beaten = 0.0
        #: While a new connection is sought (:func:`_reattach`): when the grace is over.
        self.ends: float | None = None
        self._err = err

    def request(self, request: bytes) -> bytes:
        """The "K" frame for ``request`` (:func:`runner_request`), from what was shown."""
        head = f"{self.id}\0{self.grace:g}\0{self.pos[0]}\0{self.pos[1]}\0".encode()
        return _FRAME.pack(b"K", len(head) + len(request)) + head + request

    def take(self, kind: bytes, payload: bytes) -> None:
        """Count a frame of the cell's stream (``O``, ``E``, ``Q``, ``G``)."""
        if kind in (b"O", b"E"):
            self.pos[kind == b"E"] += len(payload)
        elif kind == b"Q":
            at = [int(w) for w in payload.split()[:2]]
            for i, name in enumerate(("stdout", "stderr")):
                if at[i] > self.pos[i]:  # the machine dropped them past its bound
                    missed = at[i] - self.pos[i]
                    self.lost[i] += missed
                    self.pos[i] = at[i]
                    self.note(f"\n[gpumagic: {missed:,} bytes of {name} were "
                              f"dropped on the machine while the notebook was away: it keeps the last "
                              f"{SPOOL_BYTES / 2 ** 20:g} MiB of a cell's output]\n")
        elif kind == b"G":
            self.graced = payload.decode("ascii", "replace")

    def say(self, text: str) -> None:
        """A passing line of gpumagic's own where the cell's stderr is shown (not kept in its
        result: the program did not print it)."""
        if self._err.sink is not None:
            self._err.sink(text)

    def note(self, text: str) -> None:
        """A line of gpumagic's own among the cell's stderr (shown, and kept by ``--out``)."""
        self._err.keep(text)
        if self._err.sink is not None:
            self._err.sink(text)


def _run_kept(conn: Connection, runner: "_Runner", request: bytes, out: "_Stream", err: "_Stream",
              timeout: float | None, start: float, kept: _KeptCell, interrupt_wait: float | None) -> int:
    """Run a kept cell in ``runner``; when its path is lost, re-attach over a new connection
    (:func:`_reattach`) as often as it takes, each within the grace; its exit status.

    Raises
    ------
    ConnectionLost
        No new connection within the grace (the cell is stopped on the machine), or the
        machine stopped it after the grace without a client.
    KeyboardInterrupt
        After the cell was stopped.  Where its path had died (the stop reached no one, or
        the interrupt came while a new connection was sought), the stop goes on in the
        background and reaches the machine as soon as a connection is made
        (:func:`_stop_kept_later`).
    """
    stopped = False  # the runner stopped the cell and saw it end
    try:
        while True:
            try:
                with conn.in_flight():
                    code = runner.run(conn, request, out, err, timeout, start, kept=kept, interrupt_wait=interrupt_wait)
            except KeyboardInterrupt:
                stopped = not runner.dead  # dead: its stop got no answer, the path is gone
                raise
            except (_LostMidCommand, _NotStarted) as e:
                # _NotStarted: the runner ended with the request maybe read: its id decides
                lost = e if isinstance(e, _LostMidCommand) else _LostMidCommand(conn, None)
                runner = _reattach(conn, kept, lost, runner)
                continue
            if kept.graced is not None:
                raise ConnectionLost(
                    f"the machine stopped the cell: no client was heard for its grace of {kept.graced} s "
                    f"(the connection to {conn.spec.address} was lost)",
                    "raise the grace (%%remote --grace S, or %config GpuMagics.grace = S), or run it "
                    "as a job (%%remote --job) if it must outlive a closed laptop")
            return code
    except KeyboardInterrupt:
        if not stopped:
            runner.discard()  # the old path's, or a new one the cell never reached
            _stop_kept_later(conn, kept)
        raise


def _reattach(conn: Connection, kept: _KeptCell, cut: "_LostMidCommand", old: "_Runner") -> "_Runner":
    """A runner on a new connection for ``kept``, whose path was lost (``cut``), sought as
    :mod:`gpumagic.ssh.reconnect` says, within the cell's grace counted from the last packet
    the old path brought.  A wait longer than a connect is said in the cell's output.

    Raises
    ------
    ConnectionLost
        The grace passed first: the cell is stopped on the machine over a new connection
        if one comes within :data:`STOP_WAIT` s (the machine stops it by itself too).
    """
    old.discard()

    def say(left: float) -> None:
        kept.say(f"\n[gpumagic: reconnecting to {conn.spec.alias} ({cut.why}); grace left "
                 f"{duration(left)}, the cell runs on there meanwhile]\n")

    seeking = Reconnects(conn, RECONNECT.but(grace=kept.grace), say)
    kept.ends = seeking.deadline()
    try:
        runner = seeking.again(lambda: _take_runner(conn), deadline=kept.ends)
    except GaveUp:
        fate = _stop_elsewhere(conn, 0, 0, kept=kept.id)
        raise ConnectionLost(
            f"lost the connection to {conn.spec.address} while the cell ran ({cut.why}) and "
            f"got no new one within its grace of {kept.grace:g} s; {fate}",
            "run the cell again (raise the grace with %%remote --grace S or %config "
            "GpuMagics.grace = S; %%remote --job survives a closed laptop)") from None
    kept.reconnects += 1
    kept.ends = None
    log.info("gpumagic: re-attaching cell %s after: %s", kept.id, cut.why)
    if seeking.said:
        kept.say(f"[gpumagic: reconnected to {conn.spec.alias}; the cell's output goes on]\n")
    return runner


def _grace_ends(conn: Connection, kept: _KeptCell) -> float:
    """When ``kept``'s grace is over, were its path dead now: counted from the last packet
    the path brought."""
    return conn.last_heard() + kept.grace


def _stop_kept_later(conn: Connection, kept: _KeptCell) -> None:
    """An interrupt came while ``kept``'s path was dead: stop the cell on the machine as soon
    as a connection can be made (:func:`_stop_kept_when_possible`, on a thread: the
    interrupt is not held up), trying until its grace is over (then the machine has)."""
    ends = kept.ends if kept.ends is not None else _grace_ends(conn, kept)
    threading.Thread(target=_stop_kept_when_possible, args=(conn, kept.id, ends), daemon=True,
                     name="gpumagic-stop-kept-cell").start()


def _stop_kept_when_possible(conn: Connection, ident: str, deadline: float) -> None:
    """Stop the kept cell ``ident`` as soon as a connection can be made, trying until
    ``deadline`` (past it the machine stops it by itself).  A path that looks up but went
    quiet is probed first (:meth:`Connection.ensure_alive`, in ``open_session``), so a
    dead one is left for a new connection within max(3 s, 10 RTT)."""
    while time.monotonic() < deadline:
        try:
            run_program(conn, STOP_KEPT_PROGRAM, KILL_GRACE, ident, timeout=KILL_GRACE + 10)
            return
        except Exception:  # noqa: BLE001 - tried again until the grace is over
            time.sleep(1.0)


class _Timeout(Exception):
    pass


def _pump(conn: Connection, chan: paramiko.Channel, on_out: Callable[[bytes], None],
          on_err: Callable[[bytes], None], timeout: float | None, start: float, *,
          script: bytes, stdin: bytes | None = None,
          ready: Callable[[], bool] = lambda: True) -> None:
    """Move data until the command exits: send ``script`` at once, then ``stdin`` (and EOF)
    once ``ready()`` says the remote shell has read all of ``script``; read stdout and
    stderr as they come (never one while the other's window fills up).

    Everything is sent only as the channel's window allows, so nothing blocks.
    ``stdin=None`` leaves the channel's stdin open after ``script`` (the cell wrapper's
    watchdog needs it); ``b""`` sends EOF right after ``script`` (safe without waiting:
    the shell sees EOF only after the whole program).

    Raises
    ------
    ConnectionLost
        The transport died before an exit status arrived.
    _Timeout
        ``timeout`` seconds passed since ``start``.
    """
    chan.setblocking(False)
    pump = ChannelPump(chan, on_out, on_err)
    pump.send(script)
    if stdin is not None:  # None: nothing follows the script, and no EOF
        if stdin:
            pump.send(stdin, when=ready)
        pump.send_eof(when=ready if stdin else lambda: True)

    def watch() -> None:
        if _gone(conn, chan):
            raise _lost(conn)

    deadline = None if timeout is None else start + timeout
    if not pump.run(lambda: pump.finished, deadline=deadline, watch=watch):
        raise _Timeout()


def _gone(conn: Connection, chan: paramiko.Channel) -> bool:
    """Whether ``chan``'s connection was lost, or left for a new one (another thread's
    :meth:`Connection.ensure_alive` found its path dead)."""
    return not conn.is_connected or conn.transport is not chan.get_transport()


def _lost(conn: Connection, exc: Exception | None = None) -> ConnectionLost:
    return _LostMidCommand(conn, exc)


class _LostMidCommand(ConnectionLost):
    """The connection under a running command was lost (``why`` says how); for a cell,
    :func:`_cut` stops what it left on the machine and says so."""

    def __init__(self, conn: Connection, exc: Exception | None = None):
        #: True when gpumagic declared the path dead (no answer): the machine may not know.
        self.silent = conn.lost_reason is not None
        self.why = conn.lost_reason or (exc and str(exc)) or "the connection closed"  # EOFError says ""
        super().__init__(
            f"lost the connection to {conn.spec.address} while the command ran ({self.why})",
            "run it again: gpumagic reconnects by itself")


def _cut(conn: Connection, e: _LostMidCommand, pgid: int, runner: int) -> ConnectionLost:
    """The error of a cell whose connection was lost: its process group ``pgid`` (0: it had
    not said it started) and the runner ``runner`` (0: none) are stopped on the machine over
    a new connection first (:func:`_stop_elsewhere`) when the path went silent, and the
    message says what became of them.  A connection that closed (sshd ended it, or this
    side closed it) told the machine, which stopped them itself (the runner's watchdog,
    the wrapper's)."""
    fate = (_stop_elsewhere(conn, pgid, runner) if e.silent
            else "its processes were stopped")
    return ConnectionLost(
        f"lost the connection to {conn.spec.address} while the cell ran ({e.why}); {fate}",
        "run the cell again: gpumagic reconnects by itself (use %%remote --job for runs that "
        "must survive a network change)")


def _stop_elsewhere(conn: Connection, pgid: int, runner: int, *, kept: str | None = None) -> str:
    """Stop a cut cell's processes on the machine over a new connection, waiting up to
    :data:`STOP_WAIT` seconds; what became of them, as words for the error message.
    ``kept``: a kept cell's id instead (``exec-stop-kept.py``, which finds its group).

    Needed because a path that went silent (a roam, a NAT that forgot the connection) tells
    the machine nothing: its sshd keeps the old connection, and with it the cell, for as
    long as TCP does (hours without output).  Where the connection really closed, the
    machine already stopped the cell itself (the runner's watchdog, the wrapper's), and the
    stopper finds it gone.
    """
    done = threading.Event()
    said: list[str] = []

    def stop() -> None:
        try:
            conn.ensure_open()
            if kept is not None:
                r = run_program(conn, STOP_KEPT_PROGRAM, KILL_GRACE, kept, timeout=KILL_GRACE + 10)
            else:
                r = run_program(conn, STOP_PROGRAM, KILL_GRACE, pgid, runner,
                                 timeout=KILL_GRACE + 10)
            said.append(r.stdout.strip())
        except Exception as e:  # noqa: BLE001 - told in the message
            said.append(f"error: {getattr(e, 'message', None) or e}")
        finally:
            done.set()

    threading.Thread(target=stop, daemon=True, name="gpumagic-stop-cut-cell").start()
    if not done.wait(STOP_WAIT):
        return (f"gpumagic is still trying to stop its processes on the machine over a new "
                f"connection (none answered within {STOP_WAIT:g} s)")
    word = said[0] if said else ""
    if word == "stopped":
        return "its processes were stopped on the machine over a new connection"
    if word == "gone" and kept is not None:
        return "it had ended on the machine, or the machine stopped it itself (nothing of it is left running)"
    if word == "gone":
        return "it had already ended on the machine (nothing of it is left running)"
    if word == "left":
        return ("its processes were sent SIGKILL over a new connection, and one still runs "
                "there (uninterruptible I/O); check with `ps` in a cell")
    why = word.removeprefix("error: ") or "no answer"
    return (f"its processes could not be stopped over a new connection ({why}); the machine "
            "stops them when its sshd drops the old connection")


def _stop(chan: paramiko.Channel) -> None:
    """Close the cell's stdin: the remote wrapper then stops the whole process group."""
    try:
        send_eof(chan)
        # drained (and dropped) so that the wrapper can exit
        ChannelPump(chan).run(lambda: chan.exit_status_ready() or chan.closed,
                              deadline=time.monotonic() + KILL_GRACE + 2)
    except Exception:
        pass


# -- the per-connection cell runner ---------------------------------------------------------

#: The cell runner (``gpumagic/remote/programs/exec-runner.py``).
RUNNER_PROGRAM = "exec-runner.py"
#: Seconds allowed for the runner to start (the login shell's start-up files run once).
RUNNER_START_TIMEOUT = 30.0
#: Most runners one connection holds at once, one per cell running at the same time (a
#: ``%gpu status --watch`` refresh or a followed job log beside a cell).  Each holds a session
#: channel, and sshd allows 10 a connection by default (``MaxSessions``): a cell past them
#: runs the old way, with no grace.
MAX_RUNNERS = 4
#: Seconds an idle runner beyond the connection's first is kept after its last cell: a second
#: cell that keeps coming back (a watch's refresh) finds it started; one that came once (a
#: burst) gives its session slot and processes back at the next take after this.
SPARE_IDLE = 60.0
_FRAME = struct.Struct(">cI")


class _Pool:
    """The runners of one SSH transport (:func:`_take_runner`): one per cell running at once,
    up to :data:`MAX_RUNNERS`."""

    def __init__(self):
        self.runners: list[_Runner] = []
        #: No runner can start on this connection (no usable Python 3, a refused login): every
        #: cell runs the old way from now on, and none is tried again.
        self.failed = False
        #: A runner did start here: a later failed start is that runner's own, not the machine's.
        self.worked = False

    def take(self, new: bool) -> "tuple[_Runner | None, list[_Runner]]":
        """An idle runner marked busy (a started one first), else a new one (``new``) while
        fewer than :data:`MAX_RUNNERS`; and the idle extras to close (past :data:`SPARE_IDLE`).
        Called with the connection's ``runners_lock`` held."""
        self.runners = [r for r in self.runners if not (r.dead or (r.ready and not r.alive))]
        idle = sorted((r for r in self.runners if not r.busy), key=lambda r: (r.ready, r.used))
        runner = idle.pop() if idle else None
        now = time.monotonic()
        stale = [r for r in idle if now - r.used > SPARE_IDLE]
        for r in stale:
            self.runners.remove(r)
        if runner is None and new and len(self.runners) < MAX_RUNNERS:
            runner = _Runner()
            self.runners.append(runner)
        if runner is not None:
            runner.busy = True
        return runner, stale

    def drop(self, runner: "_Runner") -> None:
        """Close ``runner`` and forget it (called with the connection's ``runners_lock`` held)."""
        runner.discard()
        if runner in self.runners:
            self.runners.remove(runner)


class _NotStarted(Exception):
    """The runner ended before it started the cell: nothing of it ran."""


def runner_command() -> str:
    """The ``/bin/sh`` command that starts the cell runner: the machine's Python 3 (``-I``:
    no ``PYTHONPATH``, no ``~/signal.py`` shadowing the standard library; ``-S``: no
    ``site``, whose ``.pth`` files cost tens of ms and are not needed) with
    the program as ``-c`` text, :data:`KILL_GRACE`, :data:`CWD_MISSING` and
    :data:`SPOOL_BYTES` as arguments.
    Status 127 where the machine has no Python 3."""
    return (f"{_program.source('lib.sh')}\n_gm_py=$(gm_python) || exit 127\n"
            f"exec \"$_gm_py\" -I -S -c {shlex.quote(_program.source(RUNNER_PROGRAM))} "
            f"{KILL_GRACE:g} {CWD_MISSING} {SPOOL_BYTES}\n")


def runner_request(argv: Sequence[str], *, cwd: str | None = None,
                   env: Mapping[str, str | None] | None = None) -> bytes:
    """The runner's request for one cell (UTF-8): the directory, the number of arguments, the
    arguments, then the environment entries (``NAME=VALUE``; a bare ``NAME`` for a ``None``
    value, which unsets it), separated by NUL bytes, which no field can hold.  The shell's
    own variables are left out, as :func:`build_program` does.

    Raises
    ------
    RemoteCommandError
        For a NUL byte in ``cwd`` or ``env`` (``argv`` is checked by :func:`run`).
    """
    check_text(cwd or "", "the working directory", by_line=False)
    shell, rest = _split_env(env or {})
    entries = [k if v is None else f"{k}={v}" for k, v in [*shell, *rest.items()]]
    return "\0".join([cwd or "", str(len(argv)), *argv, *entries]).encode("utf-8", "surrogateescape")


def _take_runner(conn: Connection, *, new: bool = True) -> "_Runner | None":
    """A runner of this connection for one cell, marked busy: an idle one, else one started
    now (:class:`_Pool`: one per cell running at once, up to :data:`MAX_RUNNERS`); None when
    none can start on this connection, or that many cells run now (the cell then runs the way
    every exec does, through the login shell).  With ``new`` False, None also where no idle
    runner was started or sent its start (:func:`prestart_runner`): nothing waits for one."""
    conn.ensure_open()
    transport = conn.transport
    if transport is None:
        return None
    if _stop_abandoned_runner not in conn.after_abandon:
        conn.after_abandon.append(_stop_abandoned_runner)
    with conn.runners_lock:
        pool = conn.runners.setdefault(transport, _Pool())
        if pool.failed:
            return None
        runner, stale = pool.take(new)
    for extra in stale:
        extra.discard()  # its channel closes: the runner ends
    if runner is None:
        return None
    try:
        if runner.ready or runner.start(conn, beside=pool.worked):
            pool.worked = True
            return runner
    except (paramiko.SSHException, EOFError, OSError, RemoteCommandError):
        pass
    except BaseException:
        with conn.runners_lock:
            pool.drop(runner)
        raise
    with conn.runners_lock:
        pool.drop(runner)
        # the first runner could not start (no Python 3, a refused login...): the old way
        # from now on; a later one (a channel refused past MaxSessions): this cell only
        pool.failed = pool.failed or not pool.worked
    return None


def _stop_abandoned_runner(conn: Connection, transport: paramiko.Transport) -> None:
    """After :meth:`Connection.ensure_alive` left a dead path: end that path's runners on the
    machine over the new connection (its sshd keeps the old connection, and the runners with
    it, for hours); a cell one ran is stopped by its watchdog.  A runner that started or
    follows a kept cell is left alone: the cell re-attaches."""
    with conn.runners_lock:
        pool = conn.runners.pop(transport, None)
    for runner in pool.runners if pool is not None else []:
        if runner.pid and runner.kept is None:
            run_program(conn, STOP_PROGRAM, KILL_GRACE, runner.cell_pid or 0, runner.pid,
                         timeout=KILL_GRACE + 10)


def prestart_runner(conn: Connection) -> None:
    """Send the runner's start to the machine without waiting for it, so that it starts
    while the caller does something else there (the login-environment probe); the first
    cell then waits only for what is left.  Nothing happens when this connection has a
    runner, or had one fail to start."""
    if not USE_RUNNER or conn.transport is None:
        return
    transport = conn.transport
    with conn.runners_lock:
        pool = conn.runners.setdefault(transport, _Pool())
        if pool.failed or any(not r.dead for r in pool.runners):
            return
        runner = _Runner()
        pool.runners.append(runner)
    try:
        runner.begin(conn)
    except BaseException as e:
        with conn.runners_lock:
            pool.drop(runner)
        if not isinstance(e, Exception):
            raise
    finally:
        runner.release()


def _frames(buf: bytearray):
    """Take the whole frames off the front of ``buf``: yields (kind, payload)."""
    while len(buf) >= _FRAME.size:
        kind, n = _FRAME.unpack_from(buf)
        if len(buf) < _FRAME.size + n:
            return
        payload = bytes(buf[_FRAME.size:_FRAME.size + n])
        del buf[:_FRAME.size + n]
        yield kind, payload


class _Runner:
    """The client side of ``exec-runner.py`` on one session channel (see the program's
    header for the protocol).  Used by one cell at a time (``busy``); a connection holds
    several (:class:`_Pool`)."""

    def __init__(self):
        self.chan: paramiko.Channel | None = None
        #: The transport its channel is on: a cell there is cut when the connection has
        #: another one now (another thread's :meth:`Connection.ensure_alive` left the path).
        self.transport: paramiko.Transport | None = None
        self.busy = True
        #: When its last cell ended (:meth:`release`).
        self.used = time.monotonic()
        self.dead = False
        self.ready = False
        self.tag = b""
        self.buf = bytearray()
        #: The runner's PID on the machine (from its start marker), and the running cell's
        #: (its process group; from the "P" frame); None while not known.
        self.pid: int | None = None
        self.cell_pid: int | None = None
        #: The runner answered the stop being sent ("s"): the path lives.
        self.stop_heard = False
        #: The kept cell running now (its frames are counted there), None for others; left
        #: set when the runner was given up on with the cell still there (it re-attaches
        #: elsewhere, so the runner, maybe its owner, must not be stopped).
        self.kept: _KeptCell | None = None

    @property
    def alive(self) -> bool:
        c = self.chan
        return c is not None and not (c.closed or c.eof_received or c.exit_status_ready())

    def cut(self, conn: Connection) -> bool:
        """Whether the connection this runner is on was lost (or left for a new one)."""
        return not conn.is_connected or conn.transport is not self.transport

    def release(self) -> None:
        """Its cell ended: the runner takes the next one."""
        self.used = time.monotonic()
        self.busy = False

    def begin(self, conn: Connection, *, beside: bool = False) -> None:
        """Open the channel and send the runner's start (through the login shell).
        ``beside``: next to a runner that started on this transport, whose path was just
        checked: the channel is asked of the transport as it is, so one that sshd refuses
        (past its ``MaxSessions``) fails this runner alone and never reopens the connection
        under the cells that run there."""
        if beside and conn.transport is not None:
            self.chan = conn.transport.open_session(timeout=conn.spec.connect_timeout)
        else:
            self.chan = conn.open_session()
        self.transport = self.chan.get_transport()
        self.tag = _send_program(self.chan, runner_command())

    def start(self, conn: Connection, *, beside: bool = False) -> bool:
        """Start the runner (unless :meth:`begin` did) and wait for its greeting."""
        if self.chan is None:
            self.begin(conn, beside=beside)
        assert self.chan is not None
        self.pid = _await_marker(self.chan, self.tag, RUNNER_START_TIMEOUT)
        self.ready = self._greeted(time.monotonic() + RUNNER_START_TIMEOUT)
        return self.ready

    def _greeted(self, deadline: float) -> bool:
        assert self.chan is not None
        old = self.chan.gettimeout()
        try:
            while True:
                for kind, payload in _frames(self.buf):
                    return kind == b"H" and payload.startswith(b"gpumagic-runner ")
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.chan.settimeout(left)
                data = self.chan.recv(65536)
                if not data:
                    return False
                self.buf += data
        finally:
            self.chan.settimeout(old)

    def discard(self) -> None:
        """Close the channel: the runner sees EOF and its watchdog stops what still runs."""
        self.dead = True
        if self.chan is not None:
            try:
                self.chan.close()
            except Exception:
                pass

    def run(self, conn: Connection, request: bytes, out: _Stream, err: _Stream,
            timeout: float | None, start: float, *, kept: "_KeptCell | None" = None,
            interrupt_wait: float | None = None) -> int:
        """Run one cell (``request``: :func:`runner_request`); its exit status.  ``kept``: as
        a kept cell (a "K" request; started, or re-attached to when its id is known there).

        Raises
        ------
        _NotStarted
            The runner had ended before it started the cell (run it another way).
        ConnectionLost, RemoteTimeout, KeyboardInterrupt
            As :func:`run`; the cell's process group is stopped first.
        """
        chan = self.chan
        assert chan is not None
        done = False
        self.cell_pid = None
        self.kept = kept
        try:
            try:
                sendall_ordered(chan, kept.request(request) if kept is not None
                                else _FRAME.pack(b"C", len(request)) + request)
            except OSError:
                raise _NotStarted()
            code = self._pump(conn, out, err, timeout, start)
            assert code is not None
            done = True
            self._ack()
            return code
        except _Timeout:
            done = self._stop(conn, out, err, interrupt_wait)
            self._ack()
            raise RemoteTimeout(
                f"the command ran past its timeout of {timeout:g} s and was stopped",
                "raise --timeout, or run it as a job (%%remote --job) if it is meant to run long",
            )
        except KeyboardInterrupt:
            done = self._stop(conn, out, err, interrupt_wait)
            self._ack()
            raise
        except (paramiko.SSHException, EOFError, OSError) as e:
            raise _lost(conn, e)
        finally:
            if done:
                self.kept = None
                self.release()
            else:
                self.discard()

    def _pump(self, conn: Connection, out: _Stream, err: _Stream, timeout: float | None,
              start: float, *, started: bool = False,
              until: Callable[[], bool] | None = None) -> int | None:
        chan = self.chan
        assert chan is not None
        code: int | None = None

        def on_out(data: bytes) -> None:
            nonlocal started, code
            beat()
            ended = self.take(data, out.feed, err.feed)
            started = started or self.cell_pid is not None
            if ended is not None:
                started = True
                out.feed(b"", final=True)
                err.feed(b"", final=True)
                code = ended

        def beat() -> None:
            kept = self.kept
            if kept is not None and time.monotonic() - kept.beaten >= kept.beat:
                # "h": the client is there (the machine stops a kept cell after its grace
                # without one); a few bytes, waited for by nobody
                kept.beaten = time.monotonic()
                sendall_ordered(chan, _FRAME.pack(b"h", 0))

        def watch() -> None:
            beat()
            if pump.at_eof:
                if self.cut(conn):
                    raise _lost(conn)
                if not started:
                    raise _NotStarted()
                raise ConnectionLost(
                    f"gpumagic's cell runner on {conn.spec.address} ended while the cell ran; "
                    "its processes were stopped",
                    "run the cell again (a new runner starts by itself)")
            if self.cut(conn):
                raise _lost(conn)

        # stderr is the runner's own complaints, not the cell's: read and dropped
        pump = ChannelPump(chan, on_out)
        deadline = None if timeout is None else start + timeout
        if not pump.run(lambda: code is not None or (until is not None and until()),
                        deadline=deadline, watch=watch):
            raise _Timeout()
        return code

    def take(self, data: bytes, on_out: Callable[[bytes], None],
             on_err: Callable[[bytes], None]) -> int | None:
        """Read a piece of the runner's channel: the program's output (``O``/``E`` frames)
        to ``on_out``/``on_err``, its pid (``P``) into :attr:`cell_pid`; its exit status
        when its ``X`` came (what follows stays in the buffer, for the next program)."""
        self.buf += data
        for kind, payload in _frames(self.buf):
            if self.kept is not None:
                self.kept.take(kind, payload)
            if kind == b"O":
                on_out(payload)
            elif kind == b"E":
                on_err(payload)
            elif kind == b"P":
                self.cell_pid = int(payload)
            elif kind == b"s":
                self.stop_heard = True
            elif kind == b"X":
                self.cell_pid = None  # ended: its group's number may be reused
                return int(payload)
        return None

    def _ack(self) -> None:
        """A kept cell's exit status is here: the machine may remove its spool ("F"; sent,
        not waited for)."""
        kept = self.kept
        if kept is not None and self.chan is not None:
            try:
                sendall_ordered(self.chan, _FRAME.pack(b"F", len(kept.id)) + kept.id.encode())
            except OSError:
                pass  # swept on the machine later

    def _stop(self, conn: Connection, out: _Stream, err: _Stream, interrupt_wait: float | None) -> bool:
        """Stop the cell as a terminal's Ctrl-C does, then harder (the runner's "S": SIGINT,
        SIGTERM ``interrupt_wait`` s later (:func:`_wait`), SIGKILL :data:`KILL_GRACE` s after that), showing
        what it prints meanwhile (its handler's, its ``finally:``'s); a further Ctrl-C here
        sends the next signal at once.  Drained to its exit status; True when the runner is
        ready for the next cell."""
        wait = _wait(interrupt_wait)
        stop = f"{wait:g}".encode()
        out.capture = err.capture = False
        sent = 0
        told = False
        self.stop_heard = False
        try:
            # the runner answers a stop at once ("s"): a path that brings no answer within
            # KILL_GRACE + 2 s is dead, and the stop goes on over a new one (the caller's)
            now = time.monotonic()
            deadline = now + KILL_GRACE + 2
            while True:
                try:
                    if sent < 3:
                        sendall_ordered(self.chan, _FRAME.pack(b"S", len(stop)) + stop)
                        sent += 1
                    now = time.monotonic()
                    if not self.stop_heard:
                        if self._pump(conn, out, err, max(0.0, deadline - now), now, started=True,
                                      until=lambda: self.stop_heard) is not None:
                            return True
                        deadline = time.monotonic() + wait + KILL_GRACE + 3
                        now = time.monotonic()
                    if sent == 1 and not told and wait > STOP_NOTE_AFTER:
                        told = True  # a program still running after its SIGINT: say what comes
                        try:
                            self._pump(conn, out, err, STOP_NOTE_AFTER, now, started=True)
                            return True
                        except _Timeout:
                            if err.sink is not None:
                                err.sink(f"[gpumagic: the cell got SIGINT and still runs; SIGTERM follows "
                                         f"{wait:g} s after it (interrupt again to send it now)]\n")
                        now = time.monotonic()
                    self._pump(conn, out, err, max(0.0, deadline - now), now, started=True)
                    return True
                except KeyboardInterrupt:  # the next signal at once
                    stop = b""
                    deadline = min(deadline, time.monotonic() + KILL_GRACE * (3 - sent) + 3)
        except BaseException:
            return False


class RunnerPipe:
    """A program the connection's runner started with its stdin a pipe (an ``A`` request:
    see ``exec-runner.py``), spoken to on the runner's channel: no new channel, no exec
    request, no login shell, so it starts after one message.  The sync agent runs this way
    (:class:`gpumagic.sync.engine._Channel`) where the runner is up and free.

    It offers the part of :class:`~gpumagic.ssh.pump.ChannelPump` and of the channel that
    the sync uses: :meth:`run`, :meth:`send_all`, :meth:`send_eof`, :meth:`read_stderr`,
    ``at_eof``/``eof_received``, ``active``, :meth:`exit_status_ready` and
    :meth:`recv_exit_status`.  :meth:`close` gives the runner back when the program ended
    (its exit status came), and otherwise closes the runner's channel, whose watchdog then
    stops the program's process group (kill on drop, as for a cell); the next cell starts
    a new runner.
    """

    #: The most bytes of stdin sent in one ``I`` frame.
    FRAME = 256 * 1024

    def __init__(self, conn: Connection, runner: "_Runner", on_out: Callable[[bytes], None],
                 on_err: Callable[[bytes], None], *, chunk: int = 65536):
        assert runner.chan is not None
        self.conn, self.runner, self.chan = conn, runner, runner.chan
        self.on_out, self.on_err = on_out, on_err
        self.code: int | None = None
        self.given_back = False
        # the runner's own stderr (its complaints) is read and dropped
        self.pump = ChannelPump(self.chan, self._got, chunk=chunk)

    def _got(self, data: bytes) -> None:
        if self.code is None:  # nothing of this program follows its exit status
            self.code = self.runner.take(data, self.on_out, self.on_err)

    def start(self, request: bytes) -> None:
        """Send the ``A`` request (:func:`runner_request`)."""
        self.runner.cell_pid = None
        sendall_ordered(self.chan, _FRAME.pack(b"A", len(request)) + request)

    @property
    def active(self) -> float:
        return self.pump.active

    @active.setter
    def active(self, value: float) -> None:
        self.pump.active = value

    @property
    def at_eof(self) -> bool:
        """The program ended (its output is all here), or the runner's channel did."""
        return self.code is not None or self.pump.at_eof

    @property
    def eof_received(self) -> bool:
        """The program ended with all of its output read (not a dropped channel)."""
        return self.code is not None

    def exit_status_ready(self) -> bool:
        return self.code is not None or self.pump.at_eof

    def recv_exit_status(self) -> int:
        """The program's exit status (128+N for signal N); -1 when the runner's channel
        ended first."""
        return -1 if self.code is None else self.code

    def run(self, done: Callable[[], bool], *, deadline: float | None = None,
            watch: Callable[[], None] = lambda: None, wait: float = 0.2) -> bool:
        return self.pump.run(done, deadline=deadline, watch=watch, wait=wait)

    def read_stderr(self) -> None:
        """Read what has arrived (stdout and stderr share the runner's stream)."""
        self.pump.read_stdout()
        self.pump.read_stderr()

    def send_all(self, data: bytes | memoryview, idle: Callable[[], None] = lambda: None,
                 wait: float = 0.5) -> None:
        """Send ``data`` to the program's stdin (as ``I`` frames), as the window opens."""
        view = memoryview(data)
        while view:
            piece = view[:self.FRAME]
            self.pump.send_all(_FRAME.pack(b"I", len(piece)) + piece, idle, wait)
            view = view[len(piece):]

    def send_eof(self) -> None:
        """Close the program's stdin (a ``Z`` frame)."""
        if self.code is None:
            sendall_ordered(self.chan, _FRAME.pack(b"Z", 0))

    def close(self) -> None:
        if self.given_back:
            return
        self.given_back = True
        if self.code is not None and not self.pump.at_eof:
            self.runner.release()  # ended: the runner takes the next cell
        else:
            self.runner.discard()  # its watchdog stops the program


def start_in_runner(conn: Connection, argv: Sequence[str], on_out: Callable[[bytes], None],
                    on_err: Callable[[bytes], None], *, chunk: int = 65536) -> "RunnerPipe | None":
    """Start ``argv`` (no environment entries, in ``$HOME``) in this connection's runner with
    its stdin a pipe, when the runner is already started (or its start was sent) and no cell
    uses it; None otherwise, and then the caller starts it the usual way.  Its environment
    is the runner's: the exec environment the login shell gave.

    Raises
    ------
    paramiko.SSHException, EOFError, OSError
        Sending the request failed (the runner is discarded).
    """
    if not USE_RUNNER or sum(len(a) for a in argv) > MAX_INLINE:
        return None
    runner = _take_runner(conn, new=False)
    if runner is None:
        return None
    pipe = RunnerPipe(conn, runner, on_out, on_err, chunk=chunk)
    try:
        pipe.start(runner_request(argv))
    except BaseException:
        runner.discard()
        raise
    return pipe


def exec_simple(conn: Connection, command: str, *, stdin: bytes | None = None,
                timeout: float | None = 60) -> RunResult:
    """Run a short ``/bin/sh`` command line with no wrapper, optionally feeding stdin.

    For gpumagic's own quick queries (``nvidia-smi``, ``df``, listing files).  Not for user
    code: an interrupt here does not stop remote children.  ``command`` travels as a program
    on stdin (see the module docstring), so it means the same whatever the login shell is; it
    may span lines.  One round trip; two when ``stdin`` has data (it is sent once ``/bin/sh``
    has read the whole command).

    Raises
    ------
    ConnectionLost, RemoteTimeout
    RemoteCommandError
        For a NUL byte in ``command``.
    """
    nonce = secrets.token_hex(6)
    script = program(command, nonce)
    chan = conn.open_session()
    start = time.monotonic()
    out, err = _Stream(None, True), _Stream(None, True)
    marker = _MarkerFilter(nonce)
    try:
        chan.exec_command(BOOTSTRAP)
        try:
            _pump(conn, chan, lambda data: out.feed(marker.feed(data)), err.feed, timeout, start,
                  script=script, stdin=stdin or b"", ready=lambda: marker.done)
        except _Timeout:
            raise RemoteTimeout(f"`{command[:60]}` took longer than {timeout:g} s",
                                "check the machine's load, then try again")
        out.feed(marker.flush(), final=True)
        err.feed(b"", final=True)
        code = chan.recv_exit_status()
        if code == -1 and _gone(conn, chan):
            raise _lost(conn)
    except (paramiko.SSHException, EOFError, OSError) as e:
        raise _lost(conn, e)
    finally:
        chan.close()
    return RunResult(out.text, err.text, code, time.monotonic() - start, out.nbytes, err.nbytes)


def run_program(conn: Connection, name: str, *args: object, stdin: bytes | None = None,
                timeout: float | None = 60) -> RunResult:
    """Run the machine-side program ``name`` (``gpumagic/remote/programs/NAME``: see
    :mod:`gpumagic.remote.program`) with ``args`` and wait for it (one round trip; two with
    ``stdin``).  Returns its :class:`RunResult` (a non-zero exit status is not raised).

    Raises
    ------
    ConnectionLost, RemoteTimeout
        As :func:`exec_simple`.
    """
    return exec_simple(conn, _program.command(name, *args), stdin=stdin, timeout=timeout)


def start_program(chan: paramiko.Channel, command: str, *, timeout: float | None = 60) -> None:
    """Start the ``/bin/sh`` command line ``command`` on the session channel ``chan``, the
    way every gpumagic command starts (see the module docstring), and return once
    ``/bin/sh`` has read all of it.

    For callers that talk to the command over the channel themselves (the sync agent): what
    they send from then on reaches ``command``'s stdin byte for byte, and what they read is
    its output.  Output of the login shell before that point (a chatty ``~/.bashrc``) is
    read and dropped; nothing after the marker line is consumed.  If the channel closes
    first (no ``/bin/sh``, a refused login), this returns and the caller reads the end.

    Raises
    ------
    paramiko.SSHException, EOFError, OSError
        As ``exec_command`` and ``recv`` do; ``socket.timeout`` (an ``OSError``) after
        ``timeout`` seconds without the marker.
    RemoteCommandError
        For a NUL byte in ``command``.
    """
    _await_marker(chan, _send_program(chan, command), timeout)


def _send_program(chan: paramiko.Channel, command: str) -> bytes:
    """The first half of :func:`start_program`: the exec request and the program; returns
    the marker's tag to wait for."""
    nonce = secrets.token_hex(6)
    script = program(command, nonce)
    chan.exec_command(BOOTSTRAP)
    sendall_ordered(chan, script)
    return f"\x1egpumagic-{nonce} ".encode()


def _await_marker(chan: paramiko.Channel, tag: bytes, timeout: float | None) -> int | None:
    """The second half of :func:`start_program`: read up to the end of the marker line;
    the PID it names (the ``/bin/sh`` that ``exec``s the program: the program's PID), or
    None when the channel ended first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    old = chan.gettimeout()
    pid = b""
    try:
        seen = 0  # how much of ``tag`` the bytes read so far end with
        while True:
            # Read no further than the tag's end could be: never past the marker line.
            want = len(tag) - seen if seen < len(tag) else 1
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout(f"no answer from /bin/sh within {timeout:g} s")
                chan.settimeout(left)
            data = chan.recv(want)
            if not data:
                return None
            for b in data:
                if seen == len(tag):
                    if b == 0x0A:
                        return int(pid) if pid.isdigit() else None
                    pid += bytes((b,))
                    continue
                seen = _advance(tag, seen, b)
    finally:
        chan.settimeout(old)


def _advance(tag: bytes, seen: int, b: int) -> int:
    """Knuth-Morris-Pratt step: how much of ``tag`` the stream ends with after byte ``b``,
    given that it ended with ``tag[:seen]``."""
    while True:
        if tag[seen] == b:
            return seen + 1
        if seen == 0:
            return 0
        # fall back to the longest proper border of tag[:seen] (tags are short: recompute)
        part = tag[:seen]
        seen = next(k for k in range(seen - 1, -1, -1) if part.endswith(tag[:k]))


_ENV_MARK = "\x1egpumagic-env\x1e"
#: Variables that differ between shells for reasons that do not matter to a cell.
_ENV_SKIP = frozenset({"_", "SHLVL", "PWD", "OLDPWD", "PS1", "PS2", "PS4", "PROMPT_COMMAND",
                       "LINES", "COLUMNS", "TERM", "HISTFILE", "HISTSIZE", "HISTFILESIZE",
                       "HISTCONTROL", "BASH_EXECUTION_STRING", "SSH_TTY", "LS_COLORS"})


_SETTINGS_MARK = "\x1egpumagic-settings\x1e"


def login_env_delta(conn: Connection, timeout: float = 15) -> dict[str, str | None]:
    """What an interactive login shell (``ssh host``) sets beyond a plain ``ssh host cmd``:
    the first half of :func:`read_environment`."""
    return read_environment(conn, timeout)[0]


def read_environment(conn: Connection, timeout: float = 15) -> tuple[dict[str, str | None], dict[str, str]]:
    """(what an interactive login shell sets beyond a plain ``ssh host cmd``, gpumagic's own
    settings for every cell, session and job on the machine).

    One round trip: the exec environment and ``$SHELL -lic env`` (``$SHELL -l`` reading the
    command from stdin for csh and tcsh) are read together, and
    the differences (conda/pyenv PATH, variables exported after the "not interactive,
    return" line of ``~/.bashrc``) are returned, ``None`` meaning "unset".  PATH entries
    that only the exec environment has are kept in front of the login PATH.  Cells apply
    it so that they see what the user sees over ``ssh host``, while each later exec pays
    only for a non-interactive shell.  The settings are ``~/.gpumagic/env``'s ``NAME=VALUE``
    lines (``HF_ENDPOINT`` from ``%gpu mirrors hf``), read in the same round trip.
    """
    try:
        r = run_program(conn, LOGIN_ENV_PROGRAM, _ENV_MARK, _SETTINGS_MARK, timeout=timeout)
    except RemoteTimeout:
        return {}, {}
    settings: dict[str, str] = {}
    stdout = r.stdout
    if stdout.startswith(_SETTINGS_MARK):
        block, _, stdout = stdout[len(_SETTINGS_MARK):].partition(_SETTINGS_MARK)
        for line in block.splitlines():
            k, sep, v = line.partition("=")
            if sep and _SHELL_NAME.fullmatch(k.strip()):
                settings[k.strip()] = v
    parts = stdout.split(_ENV_MARK)
    if len(parts) < 3:
        return {}, settings

    def parse(block: str) -> dict[str, str]:
        out = {}
        for item in block.split("\0"):
            k, sep, v = item.partition("=")
            if sep and k and "\n" not in k:
                out[k] = v
        return out

    base, login = parse(parts[0]), parse(parts[-1])
    if "PATH" in base and "PATH" in login:
        # Entries only the exec PATH has (sshd SetEnv, a sandbox's stand-ins) stay in front.
        login_path = login["PATH"].split(":")
        extra = [p for p in base["PATH"].split(":") if p and p not in login_path]
        login["PATH"] = ":".join(extra + login_path)
    delta: dict[str, str | None] = {k: v for k, v in login.items()
                                    if k not in _ENV_SKIP and base.get(k) != v}
    delta.update({k: None for k in base if k not in login and k not in _ENV_SKIP})
    return delta, settings
