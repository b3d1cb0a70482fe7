"""Run a command or a cell on the remote machine: streaming, exit codes, interrupt, timeout.

How a cell runs
---------------
One ``exec`` channel per cell, through the user's login shell (so ``~/.bashrc``, conda and
pyenv set the same environment as ``ssh host cmd``).  A small POSIX-sh wrapper then:

* prints a marker line with its PID -- sshd made that shell a session leader, so the PID is
  also the process group of everything the cell starts;
* runs the cell (``bash -c`` or ``python3 -u -c``) with stdin from ``/dev/null``;
* watches the channel's stdin from a small background ``sh`` (handed fd 3, since an
  asynchronous list's own stdin is /dev/null; its command line holds no cell text): when the channel closes (interrupt, timeout, dropped
  connection, killed sshd) it sends SIGTERM to the whole process group, then SIGKILL one
  second later.  Nothing the cell started is left running.

stdout and stderr are read concurrently in one loop (no deadlock on megabytes of both) and
decoded incrementally as UTF-8 with replacement, so a character split across reads stays
whole and invalid bytes never raise.
"""

from __future__ import annotations

import codecs
import secrets
import shlex
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import paramiko

from ..ssh._paramiko import send_eof, sendall_ordered
from ..ssh.connection import Connection, wait_readable
from ..errors import ConnectionLost, RemoteCommandError, RemoteTimeout

#: Largest cell or command text sent inline (bytes).  Linux limits one argument to 128 KiB.
MAX_INLINE = 120 * 1024
#: Seconds between SIGTERM and SIGKILL when a cell is stopped.
KILL_GRACE = 1.0
#: The wrapper's exit status when the working directory does not exist (stderr says which).
CWD_MISSING = 97

_WRAPPER = r"""
printf '\036gpumagic-%s %s\n' "$1" "$$"
case $2 in "~") d=$HOME ;; "~/"*) d=$HOME/${2#"~/"} ;; *) d=$2 ;; esac
if [ -n "$d" ] && ! cd -- "$d" 2>/dev/null; then
  printf 'gpumagic: cannot enter directory %s on this machine\n' "$d" >&2; exit %(cwd_missing)s
fi
shift 2
exec 3<&0
exec sh -c 'trap "" TERM; while IFS= read -r _; do :; done; kill -TERM 0; sleep %(grace)s; kill -KILL 0' \
  gpumagic-watchdog <&3 >/dev/null 2>&1 &
watchdog=$!
exec 3<&-
"$@" </dev/null
rc=$?
kill -KILL $watchdog 2>/dev/null
exit $rc
""".strip().replace("%(grace)s", str(KILL_GRACE)).replace("%(cwd_missing)s", str(CWD_MISSING))


@dataclass
class RunResult:
    """What a remote command produced.

    Attributes
    ----------
    stdout, stderr : str
        Everything written (UTF-8, invalid bytes replaced), unless not captured.
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


def build_command(argv: Sequence[str], *, cwd: str | None = None,
                  env: Mapping[str, str | None] | None = None, nonce: str) -> str:
    """The shell line sent in the exec request: the wrapper around ``argv``.

    ``env`` values of ``None`` unset that variable.
    """
    cmd = list(argv)
    if env:
        unset = [a for k, v in env.items() if v is None for a in ("-u", k)]
        cmd = ["env"] + unset + ["--"] + [f"{k}={v}" for k, v in env.items() if v is not None] + cmd
    parts = ["exec", "/bin/sh", "-c", _WRAPPER, "gpumagic", nonce, cwd or ""] + cmd
    return " ".join(shlex.quote(p) for p in parts)


def cell_argv(code: str, *, python: bool = False, python_exe: str = "python3") -> list[str]:
    """argv that runs a cell: ``bash -c CODE`` or ``python3 -u -c CODE``."""
    if len(code.encode()) > MAX_INLINE:
        raise RemoteCommandError(
            f"the cell is {len(code.encode())} bytes; at most {MAX_INLINE} bytes can be sent inline",
            exit_code=-1,
            hint="put the code in a file, `%gpu sync` it, and run the file",
        )
    if python:
        return [python_exe, "-u", "-c", code]
    return ["bash", "-c", code]


class _Stream:
    def __init__(self, sink: Sink | None, capture: bool):
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.sink = sink
        self.capture = capture
        self.parts: list[str] = []
        self.nbytes = 0

    def feed(self, data: bytes, final: bool = False) -> None:
        self.nbytes += len(data)
        text = self.decoder.decode(data, final)
        if not text:
            return
        if self.capture:
            self.parts.append(text)
        if self.sink is not None:
            self.sink(text)

    @property
    def text(self) -> str:
        return "".join(self.parts)


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
        stderr: Sink | None = None, capture: bool = True, timeout: float | None = None,
        check: bool = False) -> RunResult:
    """Run ``argv`` on the machine and stream its output.

    Parameters
    ----------
    conn : Connection
        Opened (or re-opened) on demand.
    argv : sequence of str, or str
        The program and its arguments, run without a shell; a ``str`` runs through
        ``bash -c``.
    cwd : str, optional
        Remote working directory: absolute, ``~/...``, or relative to the login directory.
    env : mapping, optional
        Extra environment variables (a ``None`` value unsets one).
    stdout, stderr : callable, optional
        Called with each decoded text chunk as it arrives (``\\r`` kept as sent).
    capture : bool
        Keep the whole output in the result (turn off for huge outputs).
    timeout : float, optional
        Seconds; past it the process group is stopped and :class:`RemoteTimeout` raised.
    check : bool
        Raise :class:`RemoteCommandError` on a non-zero exit.

    Returns
    -------
    RunResult

    Raises
    ------
    ConnectionLost
        The connection dropped mid-command (the remote process group is stopped by the
        wrapper when sshd closes the channel; the next call reconnects).
    RemoteTimeout, RemoteCommandError, KeyboardInterrupt
        KeyboardInterrupt is re-raised after the remote process group has been stopped.
    """
    if isinstance(argv, str):
        argv = ["bash", "-c", argv]
    nonce = secrets.token_hex(6)
    command = build_command(argv, cwd=cwd, env=env, nonce=nonce)
    chan = conn.open_session()
    out, err = _Stream(stdout, capture), _Stream(stderr, capture)
    marker = _MarkerFilter(nonce)
    start = time.monotonic()
    try:
        chan.exec_command(command)
        try:
            _pump(conn, chan, lambda data: out.feed(marker.feed(data)), err.feed, timeout, start)
        except _Timeout:
            _stop(chan)
            raise RemoteTimeout(
                f"the command ran past its timeout of {timeout:g} s and was stopped",
                "raise --timeout, or run it as a job (%%remote --job) if it is meant to run long",
            )
        out.feed(marker.flush(), final=True)
        err.feed(b"", final=True)
        code = chan.recv_exit_status()
        if code == -1 and not conn.is_connected:
            raise _lost(conn)
    except KeyboardInterrupt:
        _stop(chan)
        raise
    except (paramiko.SSHException, EOFError, OSError) as e:
        raise _lost(conn, e)
    finally:
        chan.close()
    result = RunResult(out.text, err.text, code, time.monotonic() - start, out.nbytes, err.nbytes)
    if check and code != 0:
        raise RemoteCommandError(f"remote command exited with code {code}", exit_code=code,
                                 stdout=result.stdout, stderr=result.stderr)
    return result


class _Timeout(Exception):
    pass


def _pump(conn: Connection, chan: paramiko.Channel, on_out: Callable[[bytes], None],
          on_err: Callable[[bytes], None], timeout: float | None, start: float,
          stdin: bytes | None = None) -> None:
    """Move data until the command exits: read stdout and stderr as they come (never one
    while the other's window fills up), and send ``stdin`` (then EOF) as the channel takes it.

    ``stdin=None`` leaves the channel's stdin open (the cell wrapper's watchdog needs it).

    Raises
    ------
    ConnectionLost
        The transport died before an exit status arrived.
    _Timeout
        ``timeout`` seconds passed since ``start``.
    """
    chan.setblocking(False)
    pending = memoryview(stdin) if stdin else None
    if stdin is not None and not stdin:
        send_eof(chan)
    while True:
        busy = False
        if pending is not None and chan.send_ready():
            # no more than the window allows, so this never blocks; never after a CLOSE
            size = max(1, min(65536, chan.out_window_size))
            sendall_ordered(chan, bytes(pending[:size]))
            pending = pending[size:]
            if not pending:
                send_eof(chan)
                pending = None
            busy = True
        if chan.recv_ready():
            data = chan.recv(65536)
            if data:
                on_out(data)
                busy = True
        if chan.recv_stderr_ready():
            data = chan.recv_stderr(65536)
            if data:
                on_err(data)
                busy = True
        if busy:
            continue
        if chan.exit_status_ready() and (chan.eof_received or chan.closed):
            return
        if not conn.is_connected:
            raise _lost(conn)
        if timeout is not None and time.monotonic() - start > timeout:
            raise _Timeout()
        wait_readable(chan, 0.01 if pending is not None else 0.2)


def _lost(conn: Connection, exc: Exception | None = None) -> ConnectionLost:
    why = conn.lost_reason or (str(exc) if exc else "the connection closed")
    return ConnectionLost(
        f"lost the connection to {conn.spec.address} while the command ran ({why}); "
        "its processes were stopped",
        "run the cell again: gpumagic reconnects by itself (use %%remote --job for runs that must survive)",
    )


def _stop(chan: paramiko.Channel) -> None:
    """Close the cell's stdin: the remote wrapper then stops the whole process group."""
    try:
        send_eof(chan)
        deadline = time.monotonic() + KILL_GRACE + 2
        while not chan.exit_status_ready() and time.monotonic() < deadline and not chan.closed:
            while chan.recv_ready():
                chan.recv(65536)
            while chan.recv_stderr_ready():
                chan.recv_stderr(65536)
            time.sleep(0.02)
    except Exception:
        pass


def exec_simple(conn: Connection, command: str, *, stdin: bytes | None = None,
                timeout: float | None = 60) -> RunResult:
    """Run a short shell command with no wrapper (one round trip), optionally feeding stdin.

    For gpumagic's own quick queries (``nvidia-smi``, ``df``, listing files).  Not for user
    code: an interrupt here does not stop remote children.

    Raises
    ------
    ConnectionLost, RemoteTimeout
    """
    chan = conn.open_session()
    start = time.monotonic()
    out, err = _Stream(None, True), _Stream(None, True)
    try:
        chan.exec_command(command)
        try:
            _pump(conn, chan, out.feed, err.feed, timeout, start, stdin=stdin or b"")
        except _Timeout:
            raise RemoteTimeout(f"`{command[:60]}` took longer than {timeout:g} s",
                                "check the machine's load, then try again")
        out.feed(b"", final=True)
        err.feed(b"", final=True)
        code = chan.recv_exit_status()
        if code == -1 and not conn.is_connected:
            raise _lost(conn)
    except (paramiko.SSHException, EOFError, OSError) as e:
        raise _lost(conn, e)
    finally:
        chan.close()
    return RunResult(out.text, err.text, code, time.monotonic() - start, out.nbytes, err.nbytes)


_ENV_MARK = "\x1egpumagic-env\x1e"
#: Variables that differ between shells for reasons that do not matter to a cell.
_ENV_SKIP = frozenset({"_", "SHLVL", "PWD", "OLDPWD", "PS1", "PS2", "PS4", "PROMPT_COMMAND",
                       "LINES", "COLUMNS", "TERM", "HISTFILE", "HISTSIZE", "HISTFILESIZE",
                       "HISTCONTROL", "BASH_EXECUTION_STRING", "SSH_TTY", "LS_COLORS"})


def login_env_delta(conn: Connection, timeout: float = 15) -> dict[str, str | None]:
    """What an interactive login shell (``ssh host``) sets beyond a plain ``ssh host cmd``.

    One round trip: the exec environment and ``$SHELL -lic env`` are read together, and
    the differences (conda/pyenv PATH, variables exported after the "not interactive,
    return" line of ``~/.bashrc``) are returned, ``None`` meaning "unset".  PATH entries
    that only the exec environment has are kept in front of the login PATH.  Cells apply
    it so that they see what the user sees over ``ssh host``, while each later exec pays
    only for a non-interactive shell.
    """
    probe = (f"env -0; printf '{_ENV_MARK}'; "
             f"\"${{SHELL:-/bin/sh}}\" -lic \"printf '{_ENV_MARK}'; env -0\" </dev/null 2>/dev/null")
    try:
        r = exec_simple(conn, probe, timeout=timeout)
    except RemoteTimeout:
        return {}
    parts = r.stdout.split(_ENV_MARK)
    if len(parts) < 3:
        return {}

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
    return delta
