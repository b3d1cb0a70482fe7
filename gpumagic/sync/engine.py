"""``%gpu sync``: incremental push and pull over the open SSH connection -- the transfer.

What to send comes from :mod:`gpumagic.sync.plan` (where files go, the two listings, the
diff) and :mod:`gpumagic.sync.ignore` (``.gitignore`` / ``.gpuignore`` / ``--exclude``, as
git matches them).  Here: one round trip lists the remote tree, small files travel in one
tar stream over one exec channel, files of :data:`LARGE_FILE` bytes or more stream on
their own channel with resume.  The remote half is :mod:`gpumagic.sync.agent`, run by the
machine's ``python3`` (stdlib only; its source is sent with each request).  The two ends are
:class:`LocalSide` and :class:`RemoteSide`, with the same methods (scan, supply, stage, write,
finish); a push and a pull are one sequence, :func:`carry_out`, with the sides swapped.

Every file is written to a part file of its writer's own beside its target
(``.NAME.TOKEN.gpumagic-part``) and renamed only when whole (size checked; a resumed
file's sha256 too), on both sides, so neither a dropped connection nor a second sync of the
same tree at once ever leaves a half-written file at its real name.  A large file's part is
kept when a transfer stops, and a later run whose source starts with the same bytes takes it
over once its writer is gone (see "Part files" in :mod:`gpumagic.sync.agent`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import hashlib
import io
import json
import logging
import os
import posixpath
import queue
import re
import shlex
import socket
import stat
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import paramiko

from . import agent, laptop
from .._format import count, duration, format_bytes
from .._options import Options
from ..errors import ConnectionLost, GpumagicError, SyncDiskFull, SyncError, SyncIncomplete, SyncPermissionDenied
from ..remote import execution
from ..ssh import reconnect
from ..remote.execution import RunnerPipe, start_program
from ..ssh._paramiko import send_eof
from ..ssh.pump import ChannelPump
from .ignore import IgnoreRules
from .laptop import LocalFs
from .plan import (Entry, Listing, Plan, SourceWalk, destination_root, filter_listing, list_local,
                   local_seps, make_plan, parse_listing, tree_order, walk_local, walk_source)
from .plan import Transfer, parse_endpoint, transfer  # noqa: F401 -- read here by the sync and wrapup magics

#: Files of at least this many bytes go on their own channel with resume (bytes).
LARGE_FILE = 8 * 1024 * 1024
#: A changed file at least this big whose destination is as big as this or more goes on
#: its own channel, so that when the destination holds the source's first bytes (a log,
#: event file or CSV that grew by appending) only the new bytes travel (bytes).
APPEND_MIN = 256 * 1024
#: Seconds between progress callbacks (the last one always comes).
PROGRESS_INTERVAL = 0.1
#: Bytes buffered before one ``sendall`` on the tar channel.
SEND_BUFFER = 256 * 1024
AGENT_SOURCE = Path(agent.__file__).read_text(encoding="utf-8")
#: The level a compressed stream starts at where both ends have Python's ``lzma``: xz's
#: codec in its normal mode (``agent.XZ``; its writer steps down to xz -0 and zlib's levels
#: while the link waits for it).
LEVEL = agent.XZ
#: Where one end lacks ``lzma``: rsync -z's default (zlib's own default).
ZLIB_LEVEL = 6
#: A connection whose channel opens in fewer seconds (one round trip) is a link faster than
#: zlib at :data:`ZLIB_LEVEL` (loopback, a LAN): ``auto`` sends it uncompressed.  Loopback
#: measured 0.3-4.1 ms on a loaded 2-core machine; students' links are 20-60 ms.
FAST_LINK_RTT = 0.010

log = logging.getLogger(__name__)

# -- summary and progress --------------------------------------------------------------


@dataclass
class SyncSummary:
    """What a sync did (or, with ``dry_run``, would do).

    Attributes
    ----------
    direction : str
        ``"push"`` or ``"pull"``.
    source, destination : str
        The roots, as resolved (``NAME:/abs/path`` for the remote side).
    files_sent : int
        Files whose content was transferred (fully or the rest of a partial one).
    bytes_sent : int
        Content bytes transferred (a resumed file counts only the part sent this time).
    bytes_resumed : int
        Bytes of partial files kept from an earlier, interrupted run.
    links, dirs : int
        Symlinks created; directories created or stamped.
    skipped : int
        Files and links that already matched.
    newer : list of str
        Files left alone because the destination was newer (``update``).
    kept_dirs : list of str
        Folders at the destination left where the source has a file or link of that name,
        because they hold files (a protected one, with ``delete``): those were not sent.
    deleted : list of str
        Paths deleted (or, with ``dry_run``, that would be).
    would_send : list of str
        With ``dry_run``: the files that would be sent.
    unreadable : dict of str to str
        Source paths that could not be read (path -> reason); they were not synced, and the
        sync raised :class:`~gpumagic.errors.SyncIncomplete` once the rest was (rsync's 23).
    vanished : dict of str to str
        Source files gone between the listing and their read (path -> reason); the rest
        was synced, with no error (rsync's "file has vanished", its exit status 24).
    specials : dict of str to str
        Devices, sockets and FIFOs of the source (path -> which), never synced (as rsync
        ``-a`` skips them: "skipping non-regular file").
    links_refused : dict of str to str
        Symlinks a pull could not make on this computer, path -> target (named in one line).
    renamed : dict of str to str
        With ``rename_clashes``: machine path -> the local path it was written to.
    wire_bytes : int or None
        Bytes the file data took on the wire when it went compressed (frames included);
        None when it went as it is (then ``bytes_sent``).
    compression : str
        How compression was decided (``--compress``, ``Compression no`` in the ssh config,
        or ``auto`` and why), also logged on ``gpumagic.sync.engine``.
    seconds : float
        Wall time.
    dry_run : bool
    reconnects : int
        Times the connection was lost during the sync and it reconnected and resumed by
        itself (the summary says ``resumed after 1 reconnect``); the counts are those of
        the whole sync.
    """

    direction: str
    source: str
    destination: str
    files_sent: int = 0
    bytes_sent: int = 0
    bytes_resumed: int = 0
    links: int = 0
    dirs: int = 0
    skipped: int = 0
    newer: list[str] = field(default_factory=list)
    kept_dirs: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    would_send: list[str] = field(default_factory=list)
    unreadable: dict[str, str] = field(default_factory=dict)
    vanished: dict[str, str] = field(default_factory=dict)
    specials: dict[str, str] = field(default_factory=dict)
    #: Symlinks a pull could not make here (Windows without Developer Mode, FAT): path -> target.
    links_refused: dict[str, str] = field(default_factory=dict)
    #: Paths a pull wrote under another name (``rename_clashes``): machine path -> local path.
    renamed: dict[str, str] = field(default_factory=dict)
    wire_bytes: int | None = None
    compression: str = ""
    seconds: float = 0.0
    dry_run: bool = False
    reconnects: int = 0

    def __str__(self) -> str:
        return summary_text(self)


def _paths(label: str, paths: list[str], limit: int = 20) -> list[str]:
    if not paths:
        return []
    lines = [f"{label} ({len(paths)}):"] + [f"  {p}" for p in paths[:limit]]
    if len(paths) > limit:
        lines.append(f"  ... and {len(paths) - limit} more")
    return lines


def summary_text(s: SyncSummary) -> str:
    """The summary of a :class:`gpumagic.sync.SyncSummary`: one line, then the paths deleted
    (or, for a dry run, those that would be sent and deleted)."""
    arrow = f"{s.source} -> {s.destination}"
    if s.dry_run:
        head = (f"dry run, nothing changed: {arrow}: would send {count(len(s.would_send), 'file')}, "
                f"delete {len(s.deleted)}, {s.skipped} unchanged")
        lines = [head] + _paths("would send", s.would_send) + _paths("would delete", s.deleted)
        return "\n".join(lines + _kept_dirs(s) + _unreadable(s))
    wire = getattr(s, "wire_bytes", None)  # compressed: what the data took on the wire
    sent = (f"{format_bytes(s.bytes_sent)}, {format_bytes(wire)} sent" if wire is not None
            else f"{format_bytes(s.bytes_sent)} sent")
    head = (f"{s.direction} {arrow}: {count(s.files_sent, 'file')}, {sent}"
            + (f" (+{format_bytes(s.bytes_resumed)} resumed)" if s.bytes_resumed else "")
            + f", {s.skipped} unchanged"
            + (f", {len(s.deleted)} deleted" if s.deleted else "")
            + (f", {len(s.newer)} newer at destination kept" if s.newer else "")
            + (f", resumed after {count(s.reconnects, 'reconnect')}" if getattr(s, "reconnects", 0) else "")
            + f" in {duration(s.seconds)}")
    return "\n".join([head] + _paths("deleted", s.deleted) + _kept_dirs(s) + _unreadable(s) + _laptop_notes(s))


def _kept_dirs(s) -> list[str]:
    """Folders at the destination a file of the source would have replaced, kept: they hold files."""
    kept = getattr(s, "kept_dirs", None) or []
    if not kept:
        return []
    return [f"kept {count(len(kept), 'folder')} where the source has a file of that name (it holds "
            "files; the file was not sent: move the folder away, or sync with --delete, which replaces "
            "it unless the ignore rules protect a file in it): "
            + ", ".join(kept[:5]) + (f" and {len(kept) - 5} more" if len(kept) > 5 else "")]


def _unreadable(s) -> list[str]:
    """Source entries left out: unreadable (an error, rsync's 23), vanished while the sync
    ran (a warning, rsync's "file has vanished", its 24), special files (rsync -a's
    "skipping non-regular file")."""
    vanished = getattr(s, "vanished", None) or {}
    specials = getattr(s, "specials", None) or {}
    return (_paths("could not read, not synced", [f"{p}: {why}" for p, why in s.unreadable.items()])
            + _paths("file has vanished, not synced", list(vanished))
            + _paths("skipping non-regular file", [f"{p} ({what})" for p, what in specials.items()]))


def _laptop_notes(s) -> list[str]:
    """What this computer's folder could not hold as the machine has it: one line each."""
    out = []
    refused = getattr(s, "links_refused", None) or {}
    if refused:
        shown = ", ".join(f"{p} -> {t}" for p, t in list(refused.items())[:5])
        more = f" and {len(refused) - 5} more" if len(refused) > 5 else ""
        out.append(f"{count(len(refused), 'symlink')} not made here, this computer refused them: {shown}{more} "
                   "(Windows makes symlinks with Developer Mode on, or as administrator; then sync again)")
    renamed = getattr(s, "renamed", None) or {}
    if renamed:
        out += _paths("written under another name (this folder ignores case)",
                      [f"{p} -> {q}" for p, q in renamed.items()])
    return out


@dataclass
class SyncProgress:
    """Progress so far, handed to the ``progress`` callback (bytes and seconds).

    ``counting`` is true while the totals still grow: a push into an empty destination
    sends each folder's files as soon as the local walk has listed them (rsync's
    incremental recursion, its ``ir-chk``), before the whole tree is counted.  Before that,
    a long walk of the machine's side is reported with ``listing`` and ``listed`` set.
    """

    files_total: int
    bytes_total: int
    files_done: int = 0
    bytes_done: int = 0
    current: str = ""
    started: float = field(default_factory=time.monotonic)
    finished: bool = False
    counting: bool = False
    #: While a side is still being listed (``"testgpu:/data"``): what is walked, and the
    #: entries listed there so far (the machine's walk reports each second once it takes
    #: longer).  Empty once the transfer has its totals.
    listing: str = ""
    listed: int = 0

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started


ProgressCallback = Callable[[SyncProgress], None]


# -- remote channel helpers --------------------------------------------------------------


#: Printed by a short agent command (see :func:`agent_command`) that found no kept agent.
AGENT_MISSING = b"\x1egpumagic-sync-agent-missing\n"
#: Printed by a whole agent command that could not keep the agent (a read-only HOME).
AGENT_UNKEPT = b"\x1egpumagic-sync-agent-unkept\n"
#: Exit status of a short agent command that found no kept agent.
AGENT_MISSING_EXIT = 97


def agent_digest() -> str:
    """The agent's content hash (16 hex digits), which names its kept copy on the machine."""
    return hashlib.sha256(AGENT_SOURCE.encode("utf-8", "surrogateescape")).hexdigest()[:16]


#: The ``python3 -c`` program that runs the kept agent (its path the first argument): it
#: imports it, so that Python keeps its bytecode in ``__pycache__`` beside it (run as a
#: script, it was compiled each time: python3 started and ran it in 28.6 ms, imported it in
#: 12 ms).  The import runs under umask 077 (``__pycache__`` is private state like the
#: file), and bytecode that does not load is removed and made again: Python does not check
#: the length of what it writes there, so a nearly full disk left it cut short ("marshal
#: data too short") and every later sync failed.  It goes up with every sync: kept short.
_AGENT_LOADER = """import sys, os
p = sys.argv.pop(1); m = os.path.basename(p)[:-3]; sys.path.insert(0, os.path.dirname(p))
u = os.umask(63)
try:
    a = __import__(m)
except Exception:
    from importlib.util import cache_from_source
    try:
        os.remove(cache_from_source(p))
    except OSError:
        pass
    a = __import__(m)
os.umask(u)
a.run()"""


def agent_command(op: str, nonce: str, *args: str, kept: bool = False) -> str:
    """The ``/bin/sh`` program that runs the agent operation ``op`` with the remote
    ``python3`` (started with :func:`gpumagic.remote.execution.start_program`); ``nonce``
    goes into the start marker it prints (see :mod:`gpumagic.sync.agent`).

    The agent's source (about 70 KB) travels once per connection: the whole program keeps
    it as ``~/.gpumagic/sync_agent_HASH.py`` (0600, written whole then renamed) and runs
    it with :data:`_AGENT_LOADER`; with ``kept`` (this connection kept it already) the
    program only runs the file, and prints :data:`AGENT_MISSING` and exits
    :data:`AGENT_MISSING_EXIT` when it is gone.  Where it cannot be kept (a read-only HOME),
    the whole program says :data:`AGENT_UNKEPT` and runs the source from its command line
    (the whole agent travels on each call).
    """
    digest = agent_digest()
    path = f'"$HOME/.gpumagic/sync_agent_{digest}.py"'
    rest = " ".join(shlex.quote(a) for a in (op, nonce, *args))
    run = f"exec python3 -I -S -c '{_AGENT_LOADER}' \"$a\" {rest}"
    if kept:
        return (f"a={path}\n"
                f"[ -r \"$a\" ] || {{ printf '\\036{AGENT_MISSING[1:-1].decode()}\\n'; exit {AGENT_MISSING_EXIT}; }}\n"
                + run)
    end = f"GPUMAGIC_SYNC_AGENT_{digest}"
    if end in AGENT_SOURCE:
        raise AssertionError("the agent's source holds its here-document's end")
    return (f"a={path}\n"
            f"s=$(cat <<'{end}'\n{AGENT_SOURCE}\n{end}\n)\n"
            '(umask 077 && mkdir -p "$HOME/.gpumagic" && printf \'%s\\n\' "$s" > "$a.$$" && '
            'mv -f "$a.$$" "$a") 2>/dev/null && ' + run + "\n"
            'rm -f "$a.$$" 2>/dev/null\n'
            f"printf '\\036{AGENT_UNKEPT[1:-1].decode()}\\n'\n"
            'exec python3 -I -S -c "$s" ' + rest)


#: Seconds the login shell may take to start the agent: its start-up files (``~/.bashrc``)
#: run first, and one that waits (for input, a hung mount) would stall the sync.
START_TIMEOUT = 60.0
#: Seconds without a byte from the agent after which, on a connection that sends no
#: keepalives of its own (``ServerAliveInterval 0``), the server is asked to answer.
PROBE_AFTER = 15.0
#: Seconds the server has to answer that probe before the connection counts as lost.
PROBE_TIMEOUT = 30.0
#: Seconds the end of a sync waits for the cell runner's start it sent beside its channel.
PRESTART_WAIT = 10.0
#: Seconds a failed agent has to exit once its stdin is closed, before it is left.
EXIT_TIMEOUT = 10.0
#: Bytes of the agent's stderr kept for error messages (the rest is read and dropped, so
#: that a chatty start-up file never fills the channel's window).
STDERR_KEEP = 64 * 1024


#: A progress record of the agent's walk on its stderr (see ``agent.LISTED_TAG``).
_LISTED = re.compile(re.escape(agent.LISTED_TAG) + rb"(\d+)\n")
_LISTED_START = agent.LISTED_TAG[:8]


class _ClosedHere(Exception):
    """A channel of the sync was closed by this side (an interrupt, another worker's error)
    while a worker still used it: the worker stops at once; the error that closed it is the
    one raised."""


class _Channel:
    """An agent exec channel: reads after the start marker, with the connection watched.

    A ``serve`` agent (the listing, the plan and the small files) runs in the connection's
    cell runner where that is up and free (:func:`gpumagic.remote.execution.start_in_runner`):
    one message starts it, with no channel to open, no exec request to answer and no login
    shell to start (a conda or pyenv ``~/.bashrc`` costs 0.1-0.2 s each time), so a no-change
    resync on an open connection is two round trips.  Otherwise, and for the ``put``/``get``
    agents of large files (which run beside it), it runs on a channel of its own, started
    through the login shell; a ``serve`` channel then has the runner's start sent beside
    it, for the next sync.

    Whatever the login shell prints before the agent's marker (``MARKER_PREFIX`` + a
    nonce of this channel's) is skipped, however it is split into packets.  Every wait for
    data has the connection's keepalive behind it (or, where it sends none, a probe of the
    server after :data:`PROBE_AFTER` idle seconds), and the wait for the marker has
    :data:`START_TIMEOUT`.  A connection that drops raises :class:`ConnectionLost`.

    Made in two phases: the constructor only records what to run (no I/O), :meth:`start`
    starts the agent; :meth:`open` does both.
    """

    @classmethod
    def open(cls, machine, op: str, *args: str) -> "_Channel":
        """A channel with the agent's ``op`` started on it (see :meth:`start`)."""
        ch = cls(machine, op, *args)
        ch.start()
        return ch

    def __init__(self, machine, op: str, *args: str):
        self.machine = machine
        self.op = op
        #: The agent operation's arguments (see :func:`agent_command`).
        self.args = args
        #: Closed by this side (:meth:`close`): a failing send is no news then.
        self.closed_here = False
        #: What the agent does to its files, for error messages ("reading": it sends them).
        self.doing = "reading" if op == "get" else "writing"
        self.nonce = os.urandom(8).hex()
        self.marker = agent.MARKER_PREFIX + self.nonce.encode() + b"\n"
        #: The transport the agent was started on (see :func:`_started`), once it was.
        self._running: paramiko.Transport | None = None
        #: The agent's hash, and whether this channel ran the copy kept on the machine
        #: (known once the connection it starts on is: see :meth:`_command`).
        self.digest = agent_digest()
        self.kept = False
        #: What came before the agent's marker (its tail): the kept agent's notes.
        self.before = bytearray()
        #: Seconds the channel took to open, one round trip of the connection (None when
        #: the connection had to be made first, or not measured).
        self.rtt: float | None = None
        #: The thread that sends the cell runner's start beside this channel (joined at
        #: :meth:`close`), or None.
        self.prestart: threading.Thread | None = None
        self.buf = bytearray()
        self.err = bytearray()
        self.marked = False
        #: Entries the agent's walk has listed so far (its progress records on stderr), and
        #: what is told of them: called with that number on the thread that opened the
        #: channel, while it waits for the listing.
        self.listed = 0
        self.on_listed: Callable[[int], None] | None = None
        self._listed_told = 0
        #: The thread that started the channel (see :meth:`start`).
        self._owner = threading.get_ident()
        #: A ``serve`` channel's first byte (its root is empty; its agent reads xz frames)
        #: and its listing, when :func:`early_listing` read them before the local walk.
        self.empty: bool | None = None
        self.reads = 0  # the codecs the agent reads beyond zlib (agent.READS_XZ | READS_BZ2)
        self.early: Listing | None = None
        self.started = 0.0  # (time.monotonic() at start)
        #: Moves the agent's bytes: stdout into ``buf``, stderr into ``err`` (its tail).
        self.pump: ChannelPump | RunnerPipe
        #: The agent's channel, or its pipe in the runner.
        self.chan: paramiko.Channel | RunnerPipe

    def start(self) -> None:
        """Start the agent: in the cell runner (a ``serve``, where it is up and free), else
        on a channel of its own through the login shell.

        Raises
        ------
        SyncError
            The login shell did not start it within :data:`START_TIMEOUT` s.
        ConnectionLost
            The connection failed meanwhile.
        """
        machine, op, args, nonce = self.machine, self.op, self.args, self.nonce
        conn = machine.connection
        self._owner = threading.get_ident()
        self.started = time.monotonic()
        command: str | None = None
        if op == "serve":
            try:
                conn.ensure_alive()  # before what is kept there is looked up: it may reconnect
                command = self._command(conn, op, nonce, args)
                pipe = execution.start_in_runner(conn, ["/bin/sh", "-c", command], self._got_stdout,
                                                 self._got_stderr, chunk=1 << 20)
            except (paramiko.SSHException, EOFError, OSError):
                pipe = None  # the runner's channel failed: the agent gets a channel of its own
            if pipe is not None:
                self.chan = self.pump = pipe
                # self.rtt stays None: the runner's channel may have opened beside other
                # traffic, so a sync that sends files measures one round trip itself
                conn.kept_programs.add(self.digest)
                self.pump.active = self.started
                self._running = _started(conn, self.nonce)
                return
        was_open = conn.is_connected
        opening = time.monotonic()
        chan = self.chan = conn.open_session()
        if was_open:
            self.rtt = time.monotonic() - opening
        if command is None or self.kept != (self.digest in conn.kept_programs):
            command = self._command(conn, op, nonce, args)
        if op == "serve" and execution.USE_RUNNER:
            # the runner starts beside this channel, for the next sync (and the cells)
            self.prestart = threading.Thread(target=_prestart_runner, args=(conn,), daemon=True,
                                             name="gpumagic-sync-runner")
            self.prestart.start()
        try:
            # whatever the login shell; a start-up file that never returns is named
            start_program(chan, command, timeout=START_TIMEOUT)
            conn.kept_programs.add(self.digest)  # kept now (AGENT_UNKEPT says when it was not)
            self._running = _started(conn, nonce)
        except socket.timeout:
            chan.close()
            raise self._never_started() from None
        except (paramiko.SSHException, EOFError, OSError) as e:
            chan.close()
            raise _lost(machine, e) from None
        except BaseException:  # Ctrl-C while the login shell starts it: no agent left behind
            chan.close()
            raise
        self.pump = ChannelPump(chan, self._got_stdout, self._got_stderr, chunk=1 << 20)
        self.pump.active = self.started

    def _command(self, conn, op: str, nonce: str, args: tuple[str, ...]) -> str:
        """The agent's command for the connection as it is now (its source whole unless
        this connection kept it already)."""
        self.kept = self.digest in conn.kept_programs
        return agent_command(op, nonce, *args, kept=self.kept)

    def _never_started(self) -> SyncError:
        return SyncError(
            f"the sync helper on {self.machine.name} did not start within {START_TIMEOUT:g} s: "
            "the login shell's start-up files (~/.bashrc, ~/.profile) did not finish",
            "make them return at once for non-interactive shells (e.g. `[[ $- == *i* ]] || return` "
            "at the top of ~/.bashrc), then run the sync again")

    # -- the connection -------------------------------------------------------------------

    def _connection_gone(self, wait: float = 2.0) -> bool:
        """Whether the connection is down (waiting up to ``wait`` s: paramiko closes the
        channels of a dead transport just before it marks the transport inactive)."""
        deadline = time.monotonic() + wait
        while self.machine.connection.is_connected:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def _got_stdout(self, data: bytes) -> None:
        """Every byte of the agent's stdout as it arrives (the start marker included)."""
        self.buf += data

    def _got_stderr(self, data: bytes) -> None:
        self.err += data
        if _LISTED_START in self.err:  # the walk's progress records: counted, not kept
            found = _LISTED.findall(self.err)
            if found:
                self.listed = int(found[-1])
                self.err = bytearray(_LISTED.sub(b"", self.err))
        if len(self.err) > STDERR_KEEP:
            del self.err[:-STDERR_KEEP]

    def _drain_stderr(self) -> None:
        self.pump.read_stderr()

    def _idle(self) -> None:
        """While the send window stays shut: keep stderr moving, watch the connection."""
        self._drain_stderr()
        self._watch()

    def _watch(self) -> None:
        """Raise when waiting longer makes no sense: the connection is down, the server
        does not answer, or the agent never started."""
        conn = self.machine.connection
        if not conn.is_connected:
            raise _lost(self.machine)
        if self.listed != self._listed_told and self.on_listed is not None \
                and threading.get_ident() == self._owner:
            self._listed_told = self.listed
            self.on_listed(self.listed)
        now = time.monotonic()
        if not self.marked and now - self.started > START_TIMEOUT:
            self.close()
            raise self._never_started()
        if now - self.pump.active > PROBE_AFTER and getattr(conn.spec, "server_alive_interval", 0) <= 0:
            self._probe()
            self.pump.active = time.monotonic()

    def _probe(self) -> None:
        """Ask the server for an answer (``keepalive@openssh.com``); ConnectionLost when none
        comes within :data:`PROBE_TIMEOUT` (for connections without keepalives)."""
        t = self.machine.connection.transport
        answered = threading.Event()

        def ask():
            try:
                t.global_request("keepalive@openssh.com", wait=True)
            except Exception:  # noqa: BLE001 - a dead transport: no answer
                return
            answered.set()

        threading.Thread(target=ask, daemon=True, name="gpumagic-sync-probe").start()
        if not answered.wait(PROBE_TIMEOUT):
            self.close()
            raise ConnectionLost(
                f"lost the connection to {self.machine.name} during the sync (no answer for "
                f"{PROBE_AFTER + PROBE_TIMEOUT:g} s)", RESUME_HINT)

    # -- reading --------------------------------------------------------------------------

    def _more(self) -> bool:
        """Read more of stdout into the buffer, waiting with the connection watched; False
        at its end."""
        n = len(self.buf)
        try:
            self.pump.run(lambda: len(self.buf) > n or self.pump.at_eof, watch=self._watch,
                          wait=0.5)
            if len(self.buf) > n:
                return True
            self._drain_stderr()
            if not self.pump.eof_received and self._connection_gone():
                raise _lost(self.machine)
            return False
        except (paramiko.SSHException, EOFError, OSError) as e:
            raise _lost(self.machine, e) from None

    def _fill(self) -> bool:
        """Read more into the buffer; False at the end of stdout."""
        if not self._more():
            return False
        if not self.marked:
            i = self.buf.find(self.marker)
            cut = i if i >= 0 else max(0, len(self.buf) - (len(self.marker) - 1))  # a marker may be split
            self._before(self.buf[:cut])
            if i < 0:
                del self.buf[:cut]
                return True
            del self.buf[:i + len(self.marker)]
            self.marked = True
        return True

    def _before(self, data: bytes | bytearray) -> None:
        """Output before the agent's marker (a login shell's, the agent command's notes)."""
        self.before += data
        del self.before[:-4096]
        if AGENT_UNKEPT in self.before:  # not kept there: the next sync sends it whole again
            self.machine.connection.kept_programs.discard(self.digest)

    def _take(self, n: int) -> bytes:
        out = bytes(self.buf[:n])
        del self.buf[:n]  # O(1) at the front of a bytearray
        return out

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (fewer when that is what has arrived; ``b""`` at the end), or
        everything until EOF when ``n < 0``.  File-like, for tarfile's stream mode."""
        if n < 0:
            while self._fill():
                pass
        else:
            while not (self.marked and self.buf) and self._fill():
                pass
        if not self.marked:
            return b""
        return self._take(len(self.buf) if n < 0 else n)

    def read_exact(self, n: int) -> bytes:
        """Exactly ``n`` bytes, or fewer only at the end of the stream."""
        while not (self.marked and len(self.buf) >= n) and self._fill():
            pass
        return self._take(n) if self.marked else b""

    def readline(self) -> bytes:
        while not (self.marked and b"\n" in self.buf) and self._fill():
            pass
        if not self.marked:
            return b""
        i = self.buf.find(b"\n")
        return self._take(len(self.buf) if i < 0 else i + 1)

    # -- writing --------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        try:
            # Never more than the window allows, waiting for it with the connection watched;
            # never after the agent's CLOSE (sshd would drop us).
            self.pump.send_all(data, self._idle)
        except (paramiko.SSHException, EOFError, OSError) as e:
            if self.closed_here:  # closed by this side (an interrupt): nothing to wait for
                raise _ClosedHere() from None
            if self._connection_gone():
                raise _lost(self.machine, e) from None
            raise self.failure(self.read()) from None  # the agent stopped (disk full...)

    def close_stdin(self) -> None:
        try:
            if isinstance(self.chan, RunnerPipe):
                self.chan.send_eof()
            else:
                send_eof(self.chan)
        except (paramiko.SSHException, EOFError, OSError) as e:
            raise _lost(self.machine, e) from None

    # -- the end --------------------------------------------------------------------------

    def finish(self, timeout: float | None = None) -> int | None:
        """Wait for the agent's exit status and return it (stdout and stderr are read
        meanwhile, so that it can exit); None when ``timeout`` seconds pass first.

        Raises
        ------
        ConnectionLost
            The connection dropped (the channel closed without an exit status).
        SyncError
            The agent ended without an exit status on a live connection (killed by a signal).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        # stdout and stderr are drained meanwhile, so that the agent can exit
        if not self.pump.run(self.chan.exit_status_ready, deadline=deadline, watch=self._watch):
            return None
        code = self.chan.recv_exit_status()
        if code != -1:
            self._drain_stderr()
            return code
        if self._connection_gone():
            raise _lost(self.machine)
        return -1  # killed: sshd sends exit-signal, which paramiko does not keep

    def record(self, text: bytes = b"") -> dict | None:
        """The agent's last JSON error record (stdout ``text``, then its stderr), or None."""
        for blob in (text, bytes(self.err)):
            for line in reversed(blob.splitlines()):
                if line.startswith(b"{"):
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(rec, dict) and "error" in rec:
                        return rec
        return None

    def failure(self, text: bytes = b"") -> Exception:
        """The error the agent reported (stdout ``text`` or stderr), as a GpumagicError;
        ConnectionLost when the connection is what failed."""
        if self._connection_gone(0.2):
            return _lost(self.machine)
        try:
            self.close_stdin()  # an agent still waiting for input can then exit
            code = self.finish(EXIT_TIMEOUT)
        except ConnectionLost as e:
            return e
        if code is None:
            self.close()
        err = bytes(self.err)
        rec = self.record(text)
        if rec is not None:
            return agent_error(rec, self.machine.name, self.doing)
        if self.kept and code == AGENT_MISSING_EXIT and AGENT_MISSING in bytes(self.before + self.buf):
            self.machine.connection.kept_programs.discard(self.digest)
            return SyncError(f"the sync helper gpumagic keeps on {self.machine.name} "
                             f"(~/.gpumagic/sync_agent_{self.digest}.py) was removed meanwhile",
                             "run the sync again: it is sent anew")
        if code == 127 or b"python3" in err and b"not found" in err:
            return SyncError(f"{self.machine.name} has no python3, which %gpu sync runs on the remote side",
                             "install it there (e.g. `apt-get install -y python3`)")
        tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no message"]
        how = ("did not exit" if code is None else "was killed" if code == -1 else f"exit {code}")
        return SyncError(f"sync helper on {self.machine.name} failed ({self.op}, {how}): {tail[0]}",
                         "run the sync again; if it repeats, report it with this message")

    def close(self) -> None:
        self.closed_here = True
        try:
            self.chan.close()
        except (paramiko.SSHException, EOFError, OSError):
            pass  # the transport is already gone
        if self._running is not None:
            # (a channel of a closed transport is "ready", with no status: -1)
            exited = self.chan.exit_status_ready() and self.chan.recv_exit_status() != -1
            _ended(self.machine.connection, self._running, self.nonce, exited)
            self._running = None
        prestart, self.prestart = self.prestart, None
        if prestart is not None and self.chan.exit_status_ready() and self.machine.connection.is_connected:
            # after a sync that went well: done long before, as a rule (two round trips,
            # beside the sync's own), so the next sync finds the runner
            prestart.join(PRESTART_WAIT)


# -- agents a cut connection left on the machine -------------------------------------------

def _started(conn, nonce: str) -> paramiko.Transport | None:
    """Note that an agent started with ``nonce`` runs on ``conn``'s transport; that transport."""
    t = conn.transport
    if t is not None:
        with conn.agents_lock:  # (see :func:`stop_cut_agents`)
            conn.agents.setdefault(t, set()).add(nonce)
    return t


def _ended(conn, t: paramiko.Transport, nonce: str, exited: bool) -> None:
    """The channel of the agent ``nonce`` on ``t`` was closed: it is forgotten when it
    exited, or when ``t`` still runs (its sshd then ends it).  On a dead transport it is
    kept: after a roam the machine's sshd knows nothing, and the agent (a ``put`` holding
    its part file) would run on for hours."""
    if not (exited or t.is_active()):
        return
    with conn.agents_lock:
        nonces = conn.agents.get(t)
        if nonces is not None:
            nonces.discard(nonce)
            if not nonces:
                del conn.agents[t]


def stop_cut_agents(machine) -> int:
    """Stop, over the connection as it is now, the agents that transports of it which died
    meanwhile left on the machine (the agent's ``stop``), and run the connection's
    ``after_abandon`` hooks for those transports (the cell runner's stop); how many agents
    were found.  Nothing is sent when no transport died with agents on it.  Done before a
    sync lists the destination again, so that the parts those agents held are abandoned,
    and taken over by the resume.

    Raises
    ------
    ConnectionLost
        The connection was lost again (the agents stay noted).
    """
    conn = machine.connection
    with conn.agents_lock:
        mine = conn.agents
        dead = {t: mine.pop(t) for t in list(mine) if t is not conn.transport and not t.is_active()}
    if not dead:
        return 0
    stopped = 0
    try:
        ch = _Channel.open(machine, "stop", ".", "", *sorted(set().union(*dead.values())))
        try:
            line = ch.readline()
            if ch.finish() != 0 or not line.startswith(b"STOPPED "):
                raise ch.failure(line)
            stopped = int(line.split()[1])
        finally:
            ch.close()
    except (ConnectionLost, KeyboardInterrupt):
        with conn.agents_lock:  # tried again at the next reconnect, or by the next sync
            for t, nonces in dead.items():
                conn.agents.setdefault(t, set()).update(nonces)
        raise
    except (GpumagicError, ValueError) as e:  # the resume works without it, only slower
        log.warning("sync with %s: could not stop the agents of a cut connection: %s", machine.name, e)
    for t in dead:
        conn.abandoned(t)
    log.info("sync with %s: stopped %d agent(s) of a cut connection", machine.name, stopped)
    return stopped


def _prestart_runner(conn) -> None:
    try:
        execution.prestart_runner(conn)
    except Exception:  # noqa: BLE001 - the next sync starts its agent the usual way then
        log.debug("gpumagic: the cell runner's start failed", exc_info=True)


def agent_error(rec: dict, where: str, doing: str = "writing") -> Exception:
    """Map an agent error record (see :func:`gpumagic.sync.agent.error_record`) to
    SyncDiskFull / SyncPermissionDenied / SyncError, naming the path and its mount."""
    path = rec.get("path", "?")
    mount = rec.get("mount")
    on = f" on {where}" if where else ""
    at = f" (mount {mount}" + (f", {format_bytes(rec['free'])} free)" if "free" in rec else ")") if mount else ""
    code = rec.get("errno", "")
    if code in ("ENOSPC", "EDQUOT"):
        removed = f"; its partial copy ({format_bytes(rec['removed'])}) was removed, so the space is free again" \
            if rec.get("removed") else ""
        return SyncDiskFull(f"disk full{on} writing {path}{at}{removed}",
                            f"free space on {mount or 'that disk'} (old checkpoints?) or sync elsewhere, then "
                            "run the sync again: files already complete are kept")
    if code in ("EACCES", "EPERM", "EROFS"):
        why = "read-only file system" if code == "EROFS" else "permission denied"
        return SyncPermissionDenied(f"{why}{on} {doing} {path}{at}",
                                    "sync into a directory you own (e.g. under ~ or your workspace), "
                                    "or fix its permissions")
    if code in ("ENOENT", "ENOTDIR") and doing == "writing":
        # makedirs on a path that cannot hold new entries (/proc/..., under a file)
        return SyncError(f"cannot create {path}{on}{at}: {rec.get('error')}",
                         "choose a destination that can be created, e.g. under ~ or your workspace "
                         "(running the sync again will not help)")
    if code == "DAMAGED":
        return SyncError(f"refused a damaged compressed stream{on} at {path}: {rec.get('error')}; "
                         "that file was not written", "run the sync again; if it repeats, sync with --no-compress")
    if code == "NOZLIB":
        return SyncError(f"{rec.get('error')}{on}", "sync with --no-compress")
    if code == "ENOTDIR" and doing == "reading":
        return SyncError(f"{path}{on} is not a directory: part of that path is a file",
                         "drop a trailing / to copy a file itself, or check the path")
    return SyncError(f"sync failed{on} at {path}{at}: {rec.get('error')}",
                     "run the sync again; completed files are kept")


#: The hint of every lost connection during a sync.
RESUME_HINT = ("run it again: it resumes (completed files are kept, and a partly sent large file "
               "continues where it stopped)")


def _lost(machine, exc: Exception | None = None) -> ConnectionLost:
    why = machine.connection.lost_reason or (str(exc) or type(exc).__name__ if exc else
                                            "the connection closed")
    return ConnectionLost(f"lost the connection to {machine.name} during the sync ({why})", RESUME_HINT)


def open_listing(machine, root: str, *, digests: bool = False,
                 names: list[str] | None = None, compare: bool = False) -> "_Channel":
    """Start the agent's ``serve`` operation on ``root``: it lists the tree at once, then
    waits on the same channel for one command (see :mod:`gpumagic.sync.agent`).  With
    ``compare``, read it with :func:`read_listing` given the local tree."""
    return _Channel.open(machine, "serve", root, machine.cwd or "", "1" if digests else "0",
                    json.dumps(names) if names is not None else "-", "1" if compare else "0")


class _Empty(Exception):
    """The agent said the destination is empty: the local walk stops (see :class:`_DestinationEmptyReader`)."""


class _DestinationEmptyReader:
    """Reads a push channel's first byte (is the destination empty?) on a thread while the
    local walk goes on: the walk need not wait the ~0.1 s the agent takes to start."""

    def __init__(self, ch: "_Channel"):
        self.ch = ch
        self.error: BaseException | None = None
        self.done = threading.Event()
        threading.Thread(target=self._read, name="gpumagic-sync-first", daemon=True).start()

    def _read(self) -> None:
        try:
            _destination_empty(self.ch)
        except BaseException as e:  # re-raised on the caller's thread by wait()
            self.error = e
        finally:
            self.done.set()

    def stop_if_empty(self) -> None:
        """For the walk, at each folder: raise :class:`_Empty` once the answer is "empty"
        (or reading it failed: :meth:`wait` raises why)."""
        if self.done.is_set() and (self.error is not None or self.ch.empty):
            raise _Empty

    def wait(self) -> bool:
        """Whether the destination is empty (re-raises what reading the byte raised)."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return bool(self.ch.empty)


def _destination_empty(ch: "_Channel") -> bool:
    """The digit a ``serve`` channel opened with ``compare`` sends before its walk: whether
    the root is absent or an empty folder, and the codecs the agent reads beyond zlib (read
    once; the codecs are kept in ``ch.reads``, see :func:`gpumagic.sync.agent.codecs_here`)."""
    if ch.empty is None:
        b = ch.read_exact(1)
        if len(b) < 1 or not b.isdigit():
            raise ch.failure()
        ch.empty, ch.reads = not int(b) & 1, int(b) & ~1
    return ch.empty


def _remote_fingerprint(ch: "_Channel") -> bytes:
    """What a ``serve`` channel opened with ``compare`` sends once it has walked: its tree's
    fingerprint (32 bytes; see :func:`gpumagic.sync.agent.fingerprint`)."""
    _destination_empty(ch)
    theirs = ch.read_exact(32)
    if len(theirs) < 32:
        raise ch.failure()
    return theirs


def _listing_body(ch: "_Channel") -> Listing:
    """The listing itself: an 8-byte length, then the records."""
    head = ch.read_exact(8)
    if len(head) < 8:
        raise ch.failure()
    (n,) = struct.unpack(">Q", head)
    data = ch.read_exact(n)
    if len(data) < n:
        raise ch.failure()
    return parse_listing(data)


def read_listing(ch: "_Channel", same_as: SourceWalk | None = None) -> Listing | None:
    """Read the listing a ``serve`` channel sends first (length-prefixed records).

    ``same_as`` (for a channel opened with ``compare``): the local tree, whose fingerprint is
    compared with the remote one first; None (and no records sent) when they are equal,
    which means the plan would be empty.  A listing :func:`early_listing` read is returned
    as it is."""
    if ch.early is not None:
        return ch.early
    if same_as is not None:
        # this side's first: the machine's walk usually ends later (it started a round trip
        # later), and its fingerprint arrives while this one is made (20 ms for 100,000 files)
        mine = None if same_as.has_errors else same_as.fingerprint()
        if _remote_fingerprint(ch) == mine:
            ch.send(b"=")
            return None
        ch.send(b"L")
    return _listing_body(ch)


def early_listing(ch: "_Channel") -> Listing | None:
    """On a push's ``serve`` channel opened with ``compare``: when the agent says at once
    that the destination is absent or an empty folder, its listing (one record at most,
    asked for without waiting for the local walk, kept for :func:`read_listing`); else None,
    and the listing waits for the local walk's fingerprint."""
    if not _destination_empty(ch):
        return None
    _remote_fingerprint(ch)
    ch.send(b"L")
    ch.early = _listing_body(ch)
    return ch.early


def _is_empty(listing: Listing) -> bool:
    """Whether a destination holds nothing: absent, or an empty folder (no part files)."""
    return (not listing.partials and not listing.parts and not listing.errors
            and (not listing.entries or (len(listing.entries) == 1 and listing.root is not None
                                         and listing.root.kind == "d")))


def remote_listing(machine, root: str, *, digests: bool = False,
                   names: list[str] | None = None) -> Listing:
    """List ``root`` on the machine in one round trip (see :func:`parse_listing`)."""
    ch = open_listing(machine, root, digests=digests, names=names)
    try:
        listing = read_listing(ch)
        assert listing is not None
        ch.close_stdin()
        ch.finish()
        return listing
    finally:
        ch.close()


def remote_root(machine, root: str) -> str:
    """The absolute remote path the agent resolves ``root`` to (for messages)."""
    if root.startswith("/") or root == "~" or root.startswith("~/"):  # the agent expands ~ itself
        return posixpath.normpath(root)
    cwd = machine.cwd or ""
    return posixpath.normpath(posixpath.join(cwd, root)) if cwd else root


def _is_local_root(path: str) -> bool:
    a = os.path.abspath(os.path.expanduser(path))
    return os.path.dirname(a) == a  # "/", or a Windows drive's "C:\\"


def whole_file_system(direction: str, machine, src: str, dst: str) -> tuple[str, str] | None:
    """``(role, where)`` when a ``direction`` (``"push"``/``"pull"``) sync of ``src`` to ``dst``
    walks a whole file system to compare, ``("destination", "the machine's /")`` say: a
    folder pushed from this computer's root or into the machine's ``/`` (its contents, with
    a trailing ``/``), a pull of the machine's ``/`` or into this computer's root.  None
    otherwise.  Such a walk can take minutes; a ``--delete`` into a root is refused."""
    seps = local_seps()
    if direction == "push":
        if not os.path.isdir(src):
            return None  # one file: the destination is looked up by its name
        if _is_local_root(src):
            return "source", f"this computer's {os.path.abspath(src)}"
        if remote_root(machine, destination_root(src, dst, src_seps=seps)) in ("/", "//"):
            return "destination", "the machine's /"
        return None
    if remote_root(machine, src) in ("/", "//"):
        return "source", "the machine's /"
    if _is_local_root(destination_root(src, dst, dst_join=os.path.join)):
        return "destination", f"this computer's {os.path.abspath(dst)}"
    return None


# -- compression -----------------------------------------------------------------------


def decide_compression(machine, compress: bool | None, rtt: float | None,
                       reads: int = agent.READS_XZ | agent.READS_BZ2) -> tuple[int, str]:
    """The top level of this sync's file streams (0: as they are; 1-9 zlib's, above that
    xz's, see ``ZWriter`` in :mod:`gpumagic.sync.agent`) and why, logged.

    ``compress`` (``--compress``/``--no-compress``) decides first, then ``Compression
    yes``/``no`` of the host's ssh config (``machine.spec.compression``), then ``auto``: a
    connection whose round trip is within :data:`FAST_LINK_RTT` s (``rtt``, the time its
    channel took to open, or its probes' smoothed round trip where smaller; a keepalive
    request's when neither is known) is loopback or a LAN, faster than
    zlib, and goes uncompressed; any other is compressed.  A compressed stream starts at
    :data:`LEVEL` (xz) when both ends have Python's ``lzma`` (``reads``: the codecs of the
    agent's Python, see :func:`gpumagic.sync.agent.codecs_here`), else at zlib
    :data:`ZLIB_LEVEL`, and its writer steps the level down while the link waits for it; xz
    levels try bzip2 beside xz where both ends have ``bz2`` (``agent.WITH_BZ2``).  Either way,
    data that does not compress (a sample of each frame is tried) goes as it is."""
    both = reads & agent.codecs_here()
    top = ZLIB_LEVEL
    if both & agent.READS_XZ:
        top = LEVEL | (agent.WITH_BZ2 if both & agent.READS_BZ2 else 0)
    if compress is not None:
        level, why = (top, "--compress") if compress else (0, "--no-compress")
    elif getattr(machine.spec, "compression", None) is not None:
        on = bool(machine.spec.compression)
        level = top if on else 0
        why = f"Compression {'yes' if on else 'no'} in the ssh config of {machine.spec.alias}"
    else:
        probed = getattr(getattr(machine, "connection", None), "rtt", None)
        if probed is not None:  # one channel's opening is one noisy sample (a loaded machine)
            rtt = probed if rtt is None else min(rtt, probed)
        if rtt is None or rtt >= FAST_LINK_RTT:
            # A channel's opening that says "slow" is asked again: on loopback the first
            # one on a new connection took 42 ms in 7 of 8 trials (a fresh-user trial)
            rtt = _round_trip(machine) if rtt is None else min(rtt, _round_trip(machine))
        ms = f"{rtt * 1000:.1f} ms"
        if rtt < FAST_LINK_RTT:
            level, why = 0, f"auto: a round trip takes {ms}, a link faster than zlib (loopback or a LAN)"
        else:
            level, why = top, f"auto: a round trip takes {ms} (over {FAST_LINK_RTT * 1000:g} ms: a link slower than zlib)"
    text = (agent.codec_name(level) if level else "uncompressed") + f" ({why})"
    log.info("sync with %s: %s", machine.name, text)
    return level, text


def _round_trip(machine) -> float:
    """Seconds one ``keepalive@openssh.com`` request takes to be answered, asked as the
    connection's probes ask (one at a time: paramiko gives a waiting request the next reply,
    so beside a probe's it read 5.3 ms on a 40 ms link)."""
    conn = machine.connection
    start = time.monotonic()
    try:
        conn.global_request("keepalive@openssh.com")
    except Exception:  # noqa: BLE001 - a dead transport: the sync's own channel says so
        pass
    return time.monotonic() - start


def _retuned(machine, what: str, z: agent.ZWriter) -> None:
    """Log the level changes of a push's compressor (the link or the compressor was slower)."""
    for at, level in z.changes:
        log.info("sync with %s: %s: %s from %s on (%s)", machine.name, what, agent.codec_name(level), format_bytes(at),
                 "the link waited for the compressor" if level < z.top else "the compressor waited for the link")
    for at, codec in z.trials:
        log.info("sync with %s: %s: %s from %s on (a trial of both made it smaller)", machine.name, what, codec,
                 format_bytes(at))


class _Direct:
    """A write-only file over a channel's ``send`` (what a ``ZWriter`` writes its frames to)."""

    def __init__(self, ch: "_Channel"):
        self.write = ch.send

    def flush(self) -> None:
        pass


# -- the engine ------------------------------------------------------------------------


class _TarSink(io.RawIOBase):
    """A write-only file that buffers into ``SEND_BUFFER`` chunks for the channel."""

    def __init__(self, ch: _Channel):
        self.ch = ch
        self.parts: list[bytes] = []
        self.n = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        if b.__class__ is not bytes:
            b = bytes(b)
        self.parts.append(b)
        self.n += len(b)
        if self.n >= SEND_BUFFER:
            self.flush()
        return len(b)

    def flush(self) -> None:
        if self.parts:
            data = b"".join(self.parts)
            self.parts, self.n = [], 0
            self.ch.send(data)


class _ListingProgress:
    """Progress while the machine walks its side, from the agent's progress records (a walk
    of a large tree, ``/``, takes minutes): a :class:`SyncProgress` with ``listing`` set.
    Nothing is reported for a walk that took under ``agent.LISTED_EVERY`` s."""

    def __init__(self, progress: ProgressCallback, where: str):
        self.progress = progress
        self.state = SyncProgress(0, 0, counting=True, listing=where)
        self.shown = False

    def __call__(self, listed: int) -> None:
        self.shown = True
        self.state.listed = listed
        self.progress(self.state)

    def done(self, listed: int) -> None:
        """The listing is whole (``listed`` entries) and nothing more follows (a dry run)."""
        if self.shown:
            self.state.listed = max(listed, self.state.listed)
            self.state.counting, self.state.finished = False, True
            self.progress(self.state)


class _Run:
    """Shared state of one push or pull: the plan, counters, progress throttling.

    Counters may be updated from a worker thread (large files beside the tar stream); the
    progress callback only ever runs on the thread that started the sync.
    """

    def __init__(self, plan: Plan, summary: SyncSummary, progress: ProgressCallback | None,
                 counting: bool = False, level: int = 0, attempt: list[_Run] | None = None):
        self.plan = plan
        #: Top level of the file streams: 0 as they are, zlib's 1-9, xz's above (see
        #: :func:`decide_compression`).
        self.level = level
        self.summary = summary
        self.progress = progress
        self.state = SyncProgress(len(plan.send), plan.bytes_to_send, counting=counting)
        self.last = 0.0
        self.owner = threading.get_ident()
        self.lock = threading.Lock()
        self.due = threading.Event()  # a worker's counters changed and a call is due
        #: Bytes of large files sent or resumed and not yet complete: path -> bytes (what
        #: their part files hold when the connection is cut, and a resume may keep).
        self.open: dict[str, int] = {}
        #: The files counted sent (a file of the tar once it is in the stream: when the
        #: connection is cut, the last ones may not have arrived, and are sent again).
        self.names: set[str] = set()
        if attempt is not None:  # a resume after a reconnect adds up what each attempt did
            attempt.append(self)
        self.tick(force=True)

    def grow(self, files: int, nbytes: int, counting: bool = True) -> None:
        """The walk found ``files`` more files of ``nbytes`` bytes to send (``counting``:
        whether it goes on)."""
        with self.lock:
            self.state.files_total += files
            self.state.bytes_total += nbytes
            self.state.counting = counting
        self.tick(force=not counting)  # the whole count is shown at once

    def add_bytes(self, n: int, resumed: bool = False, path: str | None = None) -> None:
        """``n`` content bytes of the file ``path`` (a large one; None: the tar's) arrived, or
        were kept from a part file (``resumed``)."""
        with self.lock:
            self.state.bytes_done += n
            if resumed:
                self.summary.bytes_resumed += n
            else:
                self.summary.bytes_sent += n
            if path is not None:
                self.open[path] = self.open.get(path, 0) + n
        self.tick()

    def add_wire(self, n: int) -> None:
        """A compressed stream took ``n`` bytes on the wire."""
        with self.lock:
            self.summary.wire_bytes = (self.summary.wire_bytes or 0) + n

    def file_done(self, name: str, nbytes: int = 0) -> None:
        """A file is complete (``nbytes``: its bytes not yet counted by :meth:`add_bytes`)."""
        with self.lock:
            self.state.files_done += 1
            self.state.bytes_done += nbytes
            self.summary.bytes_sent += nbytes
            self.state.current = name
            self.summary.files_sent += 1
            self.open.pop(name, None)
            self.names.add(name)
        self.tick()

    def skip(self, rel: str, size: int, reason: list) -> None:
        """A file of the plan was not sent: reading it failed with ``reason`` (``[errno name,
        text]``: :func:`gpumagic.sync.agent.skip_reason`).  ``ENOENT``: it vanished, a
        warning (rsync's 24); anything else leaves it unreadable (rsync's 23)."""
        code, text = reason
        with self.lock:
            self.open.pop(rel, None)
            if code == "ENOENT":
                self.summary.vanished[rel] = text
            else:
                self.summary.unreadable[rel] = text
            self.state.files_total -= 1
            self.state.bytes_total -= size
        self.tick()

    def tick(self, force: bool = False) -> None:
        """Call the progress callback when :data:`PROGRESS_INTERVAL` seconds have passed
        since the last call (or ``force``): at most 10 a second, whatever the file count."""
        if self.progress is None:
            return
        now = time.monotonic()
        if force or now - self.last >= PROGRESS_INTERVAL:
            if threading.get_ident() != self.owner:
                self.due.set()  # wakes the owner in wait_for (a worker never calls it)
                return
            self.last = now
            self.progress(self.state)

    def wait_for(self, fut: Future) -> None:
        """On the owner thread: wait for a worker's ``fut``, calling the progress callback as
        soon as the worker's counters make a call due (not on a polling beat, so a callback
        that acts on a count sees it while the transfer is still going); re-raise its error."""
        fut.add_done_callback(lambda _: self.due.set())
        while not fut.done():
            self.due.wait(0.5)
            self.due.clear()
            self.tick()
        fut.result()

    def done(self) -> None:
        self.state.finished = True
        self.tick(force=True)


def _tar_header(e: Entry) -> bytes:
    """The tar header of a link or directory entry (whole-second mtime)."""
    return agent.tar_header(e.path, e.kind, 0, e.mode, e.mtime_ns // 1_000_000_000, e.target)


def _local_path(root: str, rel: str) -> str:
    """Local path of ``rel`` under ``root``; a ``root`` that is a file stands for itself
    (a single-file SRC whose destination name may differ)."""
    if rel == "." or os.path.isfile(root):
        return root
    return os.path.join(root, *rel.split("/"))


def _local_paths(root: str) -> Callable[[str], str]:
    """:func:`_local_path` for many ``rel`` of one ``root`` (whether it is a file is asked
    once, not once a file)."""
    if os.path.isfile(root):
        return lambda rel: root
    if os.sep == "/":
        prefix = root if root.endswith("/") else root + "/"
        return lambda rel: root if rel == "." else prefix + rel
    return lambda rel: _local_path(root, rel)


def _read_source(path: str, size: int) -> tuple[bytes | None, list | None]:
    """The first ``size`` bytes of the local source file ``path`` (a file of the tar stream:
    below :data:`LARGE_FILE`) and None; or None and why it is left out (``[errno name,
    text]``): it vanished, cannot be read, is a folder now, or holds fewer bytes now (see
    :func:`gpumagic.sync.agent.read_source`)."""
    data, st = agent.read_source(path, size)
    return (data, None) if data is not None else (None, st)


def _open_source(path: str):
    """The local source file ``path`` opened for reading (a large file's channel): its file
    object, or raises OSError."""
    return open(path, "rb")


def _resolve_single_file(src_entries: Listing, name: str) -> dict[str, Entry]:
    e = src_entries.entries["."]
    return {name: Entry(name, e.kind, e.size, e.mtime_ns, e.mode, e.target, e.digest)}


@dataclass(frozen=True)
class SyncOptions(Options):
    """How a push or pull compares and copies (``%gpu sync``'s flags, rsync's names): one
    object from the magics to :func:`push`/:func:`pull`; the plain-Python API also takes
    each field as a keyword (``m.push("proj/", "proj", delete=True)``), merged by
    :meth:`with_`.

    Attributes
    ----------
    delete : bool
        Delete destination paths that the source lacks (ignored paths are kept).
    exclude : iterable of str
        gitignore-syntax patterns to leave out.
    ignore_files : bool, optional
        Honour ``.gitignore`` and ``.gpuignore`` files in the source tree.  None (the default):
        a push does (they keep it small), a pull does not: it brings everything, results that
        the project's ``.gitignore`` names (``*.pt``, ``runs/``) included, so nothing made on the
        machine is left behind unsaid (issue 43).  ``exclude`` patterns apply either way.
    dry_run : bool
        Change nothing; the summary lists what would be sent and deleted.
    checksum, update : bool
        Compare by sha256 instead of size+mtime; never replace a newer destination file.
    compress : bool, optional
        Send the files' bytes compressed (True: xz or bzip2, or zlib where an end lacks ``lzma``) or
        as they are (False); None (``auto``) follows ``Compression`` in the ssh config, else the link's speed
        (:func:`decide_compression`).  Data that does not compress goes as it is.
    rename_clashes : bool
        A pull only: write the machine's names that this computer's folder takes for one
        (``Model.pt`` and ``model.pt`` on NTFS/APFS) under new names instead of refusing.
    max_delete : int, optional
        With ``delete``: most paths it may remove (rsync's ``--max-delete``); a plan that
        removes more is refused before anything is touched, saying how many.  None:
        :data:`MAX_DELETE`; 0: no bound (``%gpu sync --yes``).
    grace : float, optional
        Seconds a sync whose connection was lost keeps trying to connect again, then
        resumes by itself (at most 5 times: :data:`RECONNECT`); None: its grace, 10 min;
        0: never, the sync raises :class:`~gpumagic.errors.ConnectionLost` at once.
    """

    delete: bool = False
    exclude: Iterable[str] = ()
    ignore_files: bool | None = None
    dry_run: bool = False
    checksum: bool = False
    update: bool = False
    compress: bool | None = None
    rename_clashes: bool = False
    grace: float | None = None
    max_delete: int | None = None

    kind = "sync"


#: Most paths a ``--delete`` removes without ``--yes`` (``SyncOptions.max_delete``).
MAX_DELETE = 1000
#: What a ``--delete`` destination may not hold at its top: a home's (a rented machine's
#: ``authorized_keys``: locked out) and gpumagic's own state (jobs, sessions, the sync agent).
GUARDED_NAMES = (".ssh", ".gpumagic")


def refuse_wide_delete(where: str, root: str, top: Iterable[str], home: bool, count: int,
                       max_delete: int | None, src: str) -> None:
    """Refuse a ``--delete`` before anything is touched when its destination ``root`` (shown
    as ``where``) is a home (``home``), holds one of :data:`GUARDED_NAMES` among its ``top``
    names, or lies inside gpumagic's own folder; or when it would remove more than
    ``max_delete`` paths (``count``; None: :data:`MAX_DELETE`, 0: no bound).

    Raises
    ------
    SyncError
        One line naming what was found and what to write instead.
    """
    guarded = sorted(set(top) & set(GUARDED_NAMES))
    parts = root.replace("\\", "/").split("/")
    why = ("it is a home folder" if home else f"it holds {guarded[0]}" if guarded
           else "it is gpumagic's own folder" if ".gpumagic" in parts else None)
    if why is not None:
        raise SyncError(f"--delete into {where} would delete what is there that {src} lacks, and {why}; "
                        "nothing was changed", "name the project's own folder as the destination "
                        "(e.g. :proj/ for the folder proj in the home), or leave out --delete")
    bound = MAX_DELETE if max_delete is None else max_delete
    if bound and count > bound:
        raise SyncError(f"--delete into {where} would remove {count:,} paths that {src} lacks (more than "
                        f"{bound:,}); nothing was changed", "look at them with --dry-run, check the destination, "
                        "then add --yes to remove them")


def _is_home_path(path: str, cwd: str | None) -> bool:
    """Whether a machine path as written names its login home: ``~`` or ``~/``, and, where no
    working directory is set (``%gpu cd``), an empty path or ``.`` (what the agent resolves
    from the login directory)."""
    p = path.strip()
    if p.startswith("/"):
        return False
    if p.rstrip("/") == "~":
        return True
    return not cwd and p.rstrip("/") in ("", ".")


#: The fields of :class:`SyncOptions`: what :func:`push` and :func:`pull` take as keywords.
SYNC_OPTION_NAMES = SyncOptions.names()


def push(machine, src: str, dst: str, options: SyncOptions | None = None, *,
         progress: ProgressCallback | None = None, **shortcuts) -> SyncSummary:
    """Copy a local tree (or file) to the machine, sending only what differs.

    Parameters
    ----------
    machine : Machine
        Connected (or connectable) machine; relative ``dst`` is under its ``cwd``.
    src : str
        Local path; ``dir/`` copies the contents of ``dir``, ``dir`` copies ``dir`` itself
        (rsync's trailing-slash rule).
    dst : str
        Remote path (without the ``NAME:`` prefix).
    options : SyncOptions, optional
        What to delete, leave out and compare, and how to send; each field may also be
        given as a keyword (``delete=True``), which wins over ``options``.
    progress : callable, optional
        Called with a :class:`SyncProgress` (at most every 0.1 s, and at the end).

    Returns
    -------
    SyncSummary

    Raises
    ------
    ConfigError
        A malformed ``--exclude`` pattern (before anything is sent).
    SyncError, SyncDiskFull, SyncPermissionDenied, ConnectionLost, KeyboardInterrupt
        Files already complete stay complete; a re-run resumes.  A file is renamed into
        place only whole, so a second sync of the same tree at once never exposes a
        partial one.
    """
    options = (options or SyncOptions()).with_(**shortcuts)
    if options.rename_clashes:
        raise TypeError("rename_clashes is for a pull (the machine's names written here)")
    return _sync("push", machine, src, dst, options, _progress_callback(progress))


def _progress_callback(progress) -> ProgressCallback | None:
    """``progress`` as :func:`push` and :func:`pull` take it: a callable, or None/False for
    none (``progress=False`` reads as "no progress", as it does for tqdm's ``disable``)."""
    if progress is None or progress is False:
        return None
    if not callable(progress):
        raise TypeError(f"progress must be a callable that takes a SyncProgress, or None/False "
                        f"for none (got {progress!r})")
    return progress


@dataclass
class _Sides:
    """Both ends of one sync, listed: what the planner and the transfer need."""

    source: dict[str, Entry]
    dest: Listing  # its parts and partials decide what is resumed or cleaned
    unreadable: dict[str, str]
    source_name: str
    dest_name: str
    dst_root: str
    listed: bool = False  # the listing channel is already finished (a pull of one file)
    #: Files and links of the source, when both trees had the same fingerprint (the
    #: remote listing was not sent; ``source`` and ``dest`` are empty).
    same: int | None = None
    #: A pull's renamed clashes: local path -> the machine's path.
    remote_of: dict[str, str] = field(default_factory=dict)
    #: The source's listing: what vanished while it was walked, and its special files.
    vanished: dict[str, str] = field(default_factory=dict)
    specials: dict[str, str] = field(default_factory=dict)
    #: The source root as a path of its side (a push: this computer's; a pull: the machine's).
    source_root: str = ""
    single_source: bool = False  # the source is one file (``source_root``)


#: How a sync cut by a lost connection seeks a new one (:mod:`gpumagic.ssh.reconnect`): for
#: its grace (issue 28's; ``SyncOptions.grace`` for one sync, 0: never), at most 5 times, the
#: bar saying so before each try.
RECONNECT = reconnect.RECONNECT.but(times=5, say_after=0)


def _sync(direction: str, machine, src: str, dst: str, options: SyncOptions,
          progress: ProgressCallback | None) -> SyncSummary:
    """:func:`_sync_once`, again after each lost connection: a new one is sought as
    :data:`RECONNECT` says (``options.grace`` for the grace), the agents the cut one left
    are stopped (:func:`stop_cut_agents`), and the sync runs again, which resumes: complete
    files are unchanged now, a large file's part is taken over.  The dead path is noticed
    by the connection's probing (``in_flight(quick=True)``: within max(3 s, 10 RTT) once it
    is quiet), not by ServerAliveInterval.  The summary counts the whole sync."""
    conn = machine.connection
    policy = RECONNECT if options.grace is None else RECONNECT.but(grace=options.grace)
    start = time.monotonic()
    shown = _Resumed(progress, start) if progress is not None else None

    def say(left: float) -> None:
        if shown is not None:
            shown.reconnecting(f"reconnecting to {machine.name} (grace left {duration(left)})")

    seeking = reconnect.Reconnects(conn, policy, say)
    cut: list[_Run] = []
    while True:
        runs: list[_Run] = []  # this attempt's (see _add_up)
        try:
            with conn.in_flight(quick=True):
                stop_cut_agents(machine)  # after a reconnect: their parts become the resume's
                summary = _sync_once(direction, machine, src, dst, options, shown, runs)
        except ConnectionLost as e:
            if policy.grace <= 0:
                raise
            cut += runs
            if shown is not None:
                shown.cut(runs)
            log.info("sync with %s: %s; reconnecting (%d)", machine.name, e.message, seeking.count + 1)
            try:
                seeking.again(lambda: True)
            except reconnect.GaveUp as gave_up:
                if gave_up.out_of == "times":
                    raise ConnectionLost(f"{e.message} (after {seeking.count} reconnects)", RESUME_HINT) from None
                raise ConnectionLost(f"{e.message}; no new connection within {policy.grace:g} s: {gave_up.last}",
                                     RESUME_HINT) from None
            continue
        except SyncIncomplete as e:
            if e.summary is not None:
                _add_up(e.summary, cut, runs, seeking.count, start)
            raise
        return _add_up(summary, cut, runs, seeking.count, start)


def _add_up(summary: SyncSummary, cut: list[_Run], last: list[_Run], reconnects: int,
            start: float) -> SyncSummary:
    """``summary`` of the last attempt of a sync (``last``: its runs), with what the ``cut``
    attempts did added: the files they sent that the last one did not send again (those are
    no longer counted unchanged), every byte they sent, their deletions; a part file they
    left and the last attempt kept counts as sent (by them), not resumed."""
    again = set().union(*(run.names for run in last))
    before = set().union(*(run.names for run in cut)) - again
    summary.files_sent += len(before)
    summary.skipped = max(0, summary.skipped - len(before))
    for run in cut:
        s = run.summary
        summary.bytes_sent += s.bytes_sent
        summary.bytes_resumed += s.bytes_resumed - sum(run.open.values())
        if s.wire_bytes is not None:
            summary.wire_bytes = (summary.wire_bytes or 0) + s.wire_bytes
        summary.deleted = list(dict.fromkeys(s.deleted + summary.deleted))
    summary.bytes_resumed = max(0, summary.bytes_resumed)
    summary.reconnects = reconnects
    summary.seconds = time.monotonic() - start
    return summary


class _Resumed:
    """The progress callback of a sync that may resume: what its cut attempts completed is
    added to the next attempt's counts (whose plan leaves it out), so that the bar goes on
    from where it was, and while it reconnects ``current`` says ``reconnecting to HOST (grace
    left T)``."""

    def __init__(self, progress: ProgressCallback, started: float):
        self.progress = progress
        self.started = started
        self.files = self.bytes = 0
        self.last: SyncProgress | None = None

    def __call__(self, p: SyncProgress) -> None:
        if self.files or self.bytes:
            p = dataclasses.replace(p, files_total=p.files_total + self.files, files_done=p.files_done + self.files,
                                    bytes_total=p.bytes_total + self.bytes, bytes_done=p.bytes_done + self.bytes,
                                    started=self.started)
        self.last = p
        self.progress(p)

    def cut(self, runs: list[_Run]) -> None:
        """The attempt of ``runs`` was cut: count what it completed."""
        for run in runs:
            self.files += run.state.files_done
            self.bytes += max(0, run.state.bytes_done - sum(run.open.values()))

    def reconnecting(self, text: str) -> None:
        """While it reconnects, the bar's ``current`` says so (``reconnecting to HOST (grace
        left T)``)."""
        if self.last is not None:
            self.progress(dataclasses.replace(self.last, current=text, finished=False))


def _sync_once(direction: str, machine, src: str, dst: str, options: SyncOptions,
               progress: ProgressCallback | None, attempt: list[_Run] | None = None) -> SyncSummary:
    """:func:`push` (``direction`` ``"push"``) or :func:`pull` (``"pull"``): list both
    sides (the remote one on the channel that then carries the small files), plan, copy.
    ``attempt`` collects the :class:`_Run` objects made (what :func:`_sync` adds up when
    this attempt is cut)."""
    delete, checksum, dry_run, compress = options.delete, options.checksum, options.dry_run, options.compress
    start = time.monotonic()
    pushing = direction == "push"
    _refuse_before_listing(direction, machine, src, dst, delete)
    use_files = pushing if options.ignore_files is None else options.ignore_files
    rules = IgnoreRules(options.exclude, use_files=use_files)
    source, destination = _open_sides(direction, machine, src, dst, checksum)
    here = source if isinstance(source, LocalSide) else destination
    there = destination if here is source else source
    assert isinstance(here, LocalSide) and isinstance(there, RemoteSide)
    ch = there.ch
    listing = None
    if progress is not None:
        listing = ch.on_listed = _ListingProgress(progress, there.label)
    try:
        walk = None
        if here is source and here.one is None and not dry_run:
            # The walk starts at once; when the agent says the destination is empty, it
            # turns into a push that sends each folder's files as soon as they are listed.
            first = _DestinationEmptyReader(ch)
            try:
                with _no_cyclic_gc():
                    walk = walk_source(src, rules, digests=checksum, each_dir=first.stop_if_empty)
            except _Empty:
                walk = None
            if first.wait() and _is_empty(early_listing(ch)):
                summary = SyncSummary(direction, src, there.label)
                level, summary.compression = decide_compression(machine, compress, ch.rtt, ch.reads)
                run = _Run(Plan(), summary, progress, counting=walk is None, level=level, attempt=attempt)
                with _no_cyclic_gc():
                    plan = _stream_into_empty(here, there, rules, run, walk, modes=here.fs.modes)
                return _complete(_finished(summary, plan, run, start), here.where, here.path)
        with _no_cyclic_gc():
            sides = _list_sides(source, destination, rules, checksum, walk, options.rename_clashes)
            if sides.same is not None:  # both trees give the same rows: nothing differs
                plan = Plan(unchanged=sides.same)
            else:
                fs = here.fs
                plan = make_plan(sides.source, sides.dest.entries, delete=delete, checksum=checksum,
                                 update=options.update, rules=rules, unreadable=sides.unreadable,
                                 fold=fs.key if fs.folds else None, whole_dest=not sides.single_source)
        if delete and plan.delete:
            top = [rel for rel in sides.dest.entries if "/" not in rel and rel != "."]
            where, root, home = destination.delete_guarded()
            refuse_wide_delete(where, root, top, home, 0 if dry_run else len(plan.delete), options.max_delete, src)
        summary = SyncSummary(direction, sides.source_name, sides.dest_name,
                              skipped=plan.unchanged, newer=plan.newer, kept_dirs=list(plan.kept_dirs),
                              dry_run=dry_run,
                              deleted=list(plan.delete), unreadable=dict(sides.unreadable),
                              vanished=dict(sides.vanished), specials=dict(sides.specials),
                              renamed={r: p for p, r in sides.remote_of.items()})
        if dry_run:
            there.end()
            if listing is not None:
                listing.done(len(sides.dest.entries if there is destination else sides.source))
            summary.would_send = [e.path for e in plan.send]
            summary.seconds = time.monotonic() - start
            return summary
        run = carry_out(source, destination, plan, sides, summary, progress, compress, attempt)
    finally:
        ch.close()
    return _complete(_finished(summary, plan, run, start), source.where, sides.source_root, sides.single_source)


def _refuse_before_listing(direction: str, machine, src: str, dst: str, delete: bool) -> None:
    """What is refused before anything is listed: a ``--delete`` into a whole file system or
    into the machine's home; a push of a local path that is absent, a file written as a
    folder (a trailing separator), or a special file.

    Raises
    ------
    SyncError
        One line naming what was found and what to write instead.
    """
    root = whole_file_system(direction, machine, src, dst) if delete else None
    if root is not None and root[0] == "destination":
        raise SyncError(f"--delete into {root[1]} would delete everything there that {src} lacks, "
                        "so nothing was changed", "name a folder below it as the destination (e.g. :/data/)")
    if direction != "push":
        return
    seps = local_seps()
    if not os.path.lexists(src.rstrip(seps) or src):
        raise SyncError(f"no local file or directory {src}", "check the path (relative paths start at "
                        f"the notebook's directory, {os.getcwd()})")
    if src.endswith(tuple(seps)) and not os.path.isdir(src):  # rsync: change_dir ... Not a directory
        raise SyncError(f"{src} is a file, not a directory (a trailing / means the folder's contents)",
                        f"drop the trailing / to copy the file itself: {src.rstrip(seps)}")
    _refuse_special(src, os.lstat(src.rstrip(seps) or src).st_mode, "this computer")
    if delete and os.path.isdir(src) and _is_home_path(destination_root(src, dst, src_seps=seps), machine.cwd):
        refuse_wide_delete(f"{machine.name}:{dst or '~'}", dst, (), True, 0, None, src)  # before it is listed


def _open_sides(direction: str, machine, src: str, dst: str, checksum: bool) -> tuple["Side", "Side"]:
    """The source and the destination of a ``direction`` sync, the machine's listing already
    under way on its ``serve`` channel (see :func:`open_listing`: a push's compares
    fingerprints first).  What this computer's folder keeps (modes, case, normalisation) is
    asked before it is walked."""
    if direction == "push":
        here = LocalSide(machine, src, sends=True, asked=src)
        here.probe()
        names = None
        if os.path.isdir(src):
            dst_root = destination_root(src, dst, src_seps=local_seps())
        else:
            dst_root, name = _single_file_target(machine, dst, os.path.basename(src))
            here.one, names = name, [name]
        ch = open_listing(machine, dst_root, digests=checksum, names=names, compare=names is None)
        return here, RemoteSide(machine, ch, dst_root)
    here = LocalSide(machine, destination_root(src, dst, dst_join=os.path.join), sends=False, asked=dst)
    here.probe()
    ch = open_listing(machine, src, digests=checksum)
    ch.doing = "reading"  # a pull reads there: an error names the source, not a destination
    return RemoteSide(machine, ch, src), here


#: A mode of each kind of special file (named by :func:`gpumagic.sync.agent.special_kind`).
_SPECIAL_MODES = {agent.special_kind(m): m for m in (stat.S_IFCHR, stat.S_IFBLK, stat.S_IFSOCK, stat.S_IFIFO)}


def _refuse_special(path: str, mode: int, where: str) -> None:
    """Refuse a sync root that is a device, socket or FIFO (``/dev/null``): rsync ``-a``
    sends none ("skipping non-regular file"), and nothing would arrive."""
    if stat.S_ISDIR(mode) or stat.S_ISREG(mode) or stat.S_ISLNK(mode):
        return
    raise SyncError(f"{path} on {where} is a {agent.special_kind(mode)}, not a file or folder: "
                    "%gpu sync copies files, folders and symlinks (as rsync -a does)",
                    "sync the folder of the files you mean, or copy what it gives into a file first")


def _complete(summary: SyncSummary, where: str, root: str, single: bool = False) -> SyncSummary:
    """``summary``, or :class:`SyncIncomplete` (rsync's exit status 23) once everything else
    was synced, when source files or folders on ``where`` (under ``root``) could not be
    read (``single``: ``root`` is that one file).  Vanished files only warn in the summary
    (rsync's 24)."""
    bad = summary.unreadable
    if not bad:
        return summary
    sep = "/" if where != "this computer" else os.sep
    base = root.rstrip("/" + os.sep) if root not in ("/", os.sep) else root
    first, why = next(iter(bad.items()))
    path = base if first == "." or single else (base + sep + first.replace("/", sep) if base else first)
    more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
    what = "a source file or folder" if len(bad) == 1 else f"{len(bad)} source files or folders"
    how = "fix its permissions there" if where != "this computer" else "make it readable (chmod u+r)"
    raise SyncIncomplete(
        f"{summary.direction} incomplete: could not read {what} on {where}, not synced: {path} ({why}){more}; "
        "everything else was synced",
        f"{how}, or leave it out with --exclude, then run the sync again", summary=summary)


def _finished(summary: SyncSummary, plan: Plan, run: _Run | None, start: float) -> SyncSummary:
    if run is not None:
        summary.links = len(plan.links) - len(summary.links_refused)
        summary.dirs = len(plan.dirs)
        run.done()
    summary.seconds = time.monotonic() - start
    return summary


@contextlib.contextmanager
def _no_cyclic_gc():
    """Python's cyclic garbage collector off while two listings are built and compared:
    with 100,000 entries a side its full passes over every live object made the listing
    time grow with the square of the file count (profiled: a no-change resync of 100,000
    files 9x the time of 20,000).  Nothing made there holds a cycle; reference counting
    frees it all as usual."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _list_sides(source: "Side", destination: "Side", rules: IgnoreRules, checksum: bool,
                walk: SourceWalk | None = None, rename_clashes: bool = False) -> _Sides:
    """Both ends listed, for the plan: this computer's first, while the machine walks its own
    (its agent started when its channel opened), then the machine's, from that channel (for
    a push, only when the fingerprints of the two trees differ: else :attr:`_Sides.same`).
    Then the source says what it holds, the destination checks its root, and this computer's
    folder says what it makes of the machine's names (:meth:`LocalSide.fold`)."""
    here = source if isinstance(source, LocalSide) else destination
    there = destination if here is source else source
    assert isinstance(here, LocalSide) and isinstance(there, RemoteSide)
    mine = here.scan(checksum, rules, walk)
    theirs = there.scan(checksum, rules, mine)
    if theirs is None:  # the same fingerprint: both trees give the same rows
        assert isinstance(mine, SourceWalk)
        return _Sides({}, Listing(), {}, source.label, destination.label, destination.root, same=mine.unchanged,
                      source_root=source.path,
                      vanished={rel: text for kind, rel, text in mine.left_out if kind == "v"},
                      specials={rel: text for kind, rel, text in mine.left_out if kind == "s"})
    if isinstance(mine, SourceWalk):
        mine = mine.listing()
    listed, dest = (mine, theirs) if here is source else (theirs, mine)
    entries, single = source.entries(listed, rules, destination)
    dest = destination.check(dest, single, checksum)
    entries, dest, remote_of = here.fold(entries, dest, rename_clashes)
    there.names.update(remote_of)
    return _Sides(entries, dest, listed.errors, source.label, destination.label, destination.root,
                  listed=there.ended, remote_of=remote_of, vanished=listed.vanished, specials=listed.specials,
                  source_root=source.path, single_source=single)


def _clashes_here(machine, src: dict[str, Entry], dst_root: str, fs: LocalFs,
                  rename: bool) -> tuple[dict[str, Entry], dict[str, str]]:
    """A pull's source entries where the local folder takes some of the machine's names for
    one: refused, naming them, before anything is written; or, with ``rename``, the later
    ones under new names (entries keyed by local path, and local path -> machine path)."""
    groups = laptop.clashes(src, fs)
    if not groups:
        return src, {}
    if not rename:
        what = "case" if not fs.case else "Unicode normalisation"
        if not fs.case and not fs.normalization:
            what = "case and Unicode normalisation"
        first = " and ".join(groups[0])
        more = f" (and {len(groups) - 1} more such group(s))" if len(groups) > 1 else ""
        raise SyncError(f"{first} on {machine.name} would be one file in {dst_root}, whose file system "
                        f"ignores {what}{more}; nothing was written",
                        "rename one of them on the machine, or pull with --rename-clashes "
                        "(the later one is written as 'NAME (2).EXT')")
    names = laptop.renamed(src, fs)
    out = {names.get(p, p): (dataclasses.replace(e, path=names[p]) if p in names else e) for p, e in src.items()}
    return out, {local: remote for remote, local in names.items()}


# -- the two sides ---------------------------------------------------------------------
#
# A sync moves files from a source side to a destination side: this computer's folder
# (:class:`LocalSide`) or the machine's (:class:`RemoteSide`).  Both have the same methods,
# in the roles of mutagen's ``Endpoint``: a source ``supply``-s bytes (and says when it
# has nothing more to supply on the listing's channel), a destination ``stage``-s (what
# goes before the files: removals, abandoned parts, folders), writes the small files
# (``write_small``, one tar stream) and the large ones (``write_large``, each on its own
# channel, resumed), and ``finish``-es (links, metadata, the folders' mtimes, last).  The
# agent runs the machine's half of each (``recv``/``send`` on the ``serve`` channel,
# ``put``/``get`` on a large file's); this computer's half runs here, with the agent's own
# functions.  :func:`carry_out` is the one sequence of a push and a pull: the sides swapped.


class LocalSide:
    """This computer's end of a sync: ``root`` here (a folder, or one source file).

    ``sends``: whether it is the source.  ``one``: the name of the one file a sync copies,
    at its destination (a push of one file: the name rsync's rule gives it there).
    ``asked``: the path as written (a pull's destination: where its one file goes is known
    once the machine has listed it)."""

    where = "this computer"

    def __init__(self, machine, root: str, *, sends: bool, one: str | None = None, asked: str = ""):
        self.machine = machine
        self.root = root
        self.sends = sends
        self.one = one
        self.asked = asked
        #: Why this destination cannot take a folder (it is a file), noted by :meth:`scan`.
        self.refused: SyncError | None = None
        #: What the folder here keeps (modes, case, normalisation): see :meth:`probe`.
        self.fs = LocalFs()
        self._path_of: Callable[[str], str] | None = None

    @property
    def label(self) -> str:
        """The root as the summary names it (as written)."""
        return self.root

    def probe(self) -> None:
        """Ask the folder here what it keeps (modes, case, normalisation: :attr:`fs`), before
        it is walked: the source's folder (the one file's), the destination as written."""
        folder = self.asked
        if self.sends and not os.path.isdir(folder):
            folder = os.path.dirname(folder) or "."
        self.fs = laptop.probe(folder)

    @property
    def path(self) -> str:
        """The root as an error names it (absolute)."""
        return os.path.abspath(self.root)

    # -- the listing ----------------------------------------------------------------------

    def scan(self, checksum: bool, rules: IgnoreRules, walk: SourceWalk | None = None) -> SourceWalk | Listing:
        """This computer's listing, made while the machine walks its own.  The source's: its
        walk (``walk``: made already), whose fingerprint the machine compares with its own,
        or its one file.  The destination's: with its part files; a root that is a file is
        noted (:attr:`refused`: an error only when the source is a folder)."""
        if self.sends:
            if self.one is not None:
                return walk_local(self.root, None, digests=checksum)
            return walk if walk is not None else walk_source(self.root, rules, digests=checksum)
        try:
            return _local_listing(self.root, checksum, None)
        except SyncError as exc:  # a file: fine when the source is one too (known below)
            self.refused = exc
            return Listing()

    def entries(self, listing: Listing, rules: IgnoreRules, destination: "RemoteSide") -> tuple[dict[str, Entry], bool]:
        """The source's entries (its one file under its name at the destination), and
        whether it is one file."""
        if self.one is not None:
            return _resolve_single_file(listing, self.one), True
        return listing.entries, False

    def one_file(self, name: str) -> str:
        """The destination of one file called ``name``, as rsync decides: into the folder
        written when it ends in a separator or is a folder, else that path is the file's
        (:attr:`root` becomes its folder); the file's name here."""
        if self.asked.endswith(tuple(local_seps())) or os.path.isdir(self.asked):
            self.root = self.asked
        else:
            root, name = os.path.split(self.asked)
            self.root = root or "."
        self.one = name
        return name

    def check(self, listing: Listing, single: bool, checksum: bool) -> Listing:
        """The destination's listing once the source's is known: for one file, that file's
        (it may go into a folder other than the one listed); a root that is not a folder is
        refused."""
        if single:
            listing = _local_listing(self.root, checksum, [self.one] if self.one is not None else None)
        elif self.refused is not None:
            raise self.refused
        if os.path.lexists(self.root) and not os.path.isdir(self.root):
            raise SyncError(f"{self.root} exists and is not a directory",
                            "choose another destination, or remove that file first")
        return listing

    def delete_guarded(self) -> tuple[str, str, bool]:
        """For :func:`refuse_wide_delete`, this destination as the message names it, its
        root (inside gpumagic's own folder: counted as one), and whether it is the home."""
        root = os.path.abspath(self.root)
        here = os.path.realpath(root)
        home = here == os.path.realpath(os.path.expanduser("~"))
        try:
            from ..paths import data_dir

            mine = os.path.realpath(data_dir())
            if here == mine or here.startswith(mine + os.sep):
                root = os.path.join(root, ".gpumagic")  # counted as gpumagic's own folder
        except Exception:  # noqa: BLE001 - no data dir: nothing of ours there
            pass
        return f"this computer's {self.root}", root, home

    def fold(self, source: dict[str, Entry], dest: Listing,
             rename_clashes: bool) -> tuple[dict[str, Entry], Listing, dict[str, str]]:
        """What this computer's folder makes of the machine's names (:attr:`fs`: case, Unicode
        normalisation, modes): the source's entries, the destination's listing, and the
        machine's path of each file renamed here (local path -> machine path).  Sending: a
        name here that the machine spells otherwise is compared with it, never sent beside
        it, and without modes here the machine's are kept.  Receiving: names that would be
        one file here are refused, or renamed (``rename_clashes``)."""
        fs = self.fs
        if self.sends:
            if fs.folds:  # A.txt here is the machine's a.txt: compared with it, never sent beside it
                source = laptop.respelled(source, dest.entries, fs)
            if not fs.modes:  # no modes here: the machine's are kept, new ones chosen by content
                source = laptop.machine_modes(source, dest.entries)
            return source, dest, {}
        if not fs.folds:
            return source, dest, {}
        source, remote_of = _clashes_here(self.machine, source, self.root, fs, rename_clashes)
        entries = laptop.respelled(dest.entries, source, fs)
        return source, Listing(entries, dest.partials, dest.parts, dest.ignore_texts, dest.errors), remote_of

    # -- as the source --------------------------------------------------------------------

    def supply(self, rel: str, size: int) -> tuple[bytes | None, list | None]:
        """The first ``size`` bytes of the file ``rel`` (a small one, for the tar) and None;
        or None and why it is left out (see :func:`_read_source`)."""
        if self._path_of is None:  # (whether the root is a file is asked once)
            self._path_of = _local_paths(self.root)
        return _read_source(self._path_of(rel), size)

    def open(self, rel: str):
        """The file ``rel`` opened for reading (a large file), or raises OSError."""
        return _open_source(_local_path(self.root, rel))

    def supplied(self) -> None:
        """Nothing more goes through the listing's channel from here (it is the machine's)."""

    # -- as the destination ---------------------------------------------------------------

    #: The codecs this side reads beyond zlib (what :func:`decide_compression` asks).
    reads = agent.READS_XZ | agent.READS_BZ2

    def needs_tar(self, plan: Plan, small: list[Entry], clean: list[str]) -> bool:
        """Whether :meth:`write_small` has anything to do: here, only the small files go in
        a tar (removals, folders, links and metadata are done here)."""
        return bool(small)

    @contextlib.contextmanager
    def writing(self, source: "RemoteSide"):
        """Errors of this computer's writes, as the sync's errors."""
        try:
            yield
        except OSError as exc:
            raise agent_error(agent.error_record(exc), "this computer") from None
        except agent.Damaged as exc:
            raise SyncError(f"refused the file stream from {self.machine.name}: {exc}; that file was not written",
                            "run the sync again; if it repeats, sync with --no-compress") from None
        except agent.AgentError as exc:
            raise SyncError(f"{exc}", "run the sync again: that file starts over") from None

    def stage(self, plan: Plan, clean: list[str]) -> None:
        """Before the files: abandoned part files and removed paths go, folders are made."""
        agent.remove_abandoned([_local_path(self.root, p) for p in clean])
        for rel in plan.removals:
            agent.remove(_local_path(self.root, rel))
        os.makedirs(self.root, exist_ok=True)
        for e in plan.dirs:
            if e.path != ".":  # the root is made above (a link to a folder stays a link: followed)
                agent.make_dir(_local_path(self.root, e.path), e.mode)

    def write_small(self, source: "RemoteSide", run: _Run, plan: Plan, small: list[Entry],
                    clean: list[str], before_end: Callable[[], None] | None = None) -> None:
        """The tar of ``small`` that ``source`` supplies, extracted via temp names; then
        ``before_end`` (the large files beside the tar)."""
        ch = source.ch
        stream = source.supply(small, run.level)
        try:
            agent.extract(self.root, stream, on_file=run.file_done, on_bytes=run.add_bytes,
                          allowed={e.path for e in small})
            rest = stream.read()  # the tar's last zero block, then the files left out, if any
        except agent.AgentError as exc:
            raise SyncError(f"refused the file stream from {ch.machine.name}: {exc}",
                            "run the sync again; if it repeats, check the machine") from None
        except EOFError as exc:
            if ch.finish() != 0:
                raise ch.failure() from None
            raise SyncError(f"the file stream from {ch.machine.name} was cut short: {exc}",
                            "run the sync again: files already complete are kept") from None
        if isinstance(stream, agent.ZReader):
            run.add_wire(stream.wire)
        if ch.finish() != 0:
            raise ch.failure(rest)
        sizes = {e.path: e.size for e in small}
        for rel, why in _skipped(rest).items():
            if rel in sizes:
                run.skip(rel, sizes[rel], why)
        if before_end is not None:
            before_end()

    def write_large(self, source: "RemoteSide", run: _Run, e: Entry, offset: int,
                    channels: list | None = None) -> None:
        """Fetch one file on its own channel (``get``), continuing an abandoned local part
        when the source's first bytes hash the same (the part says how many: ``offset``,
        the listing's, is not needed here); a resumed file is checked against the sha256 of
        the source that follows its bytes before it is renamed (see ``get`` in
        :mod:`gpumagic.sync.agent`)."""
        machine = self.machine
        path = _local_path(self.root, e.path)
        f, have, tmp, token = agent.take_part(path)
        try:
            if not have:
                have = _copy_grown(path, f, e.size)
            have = min(have, e.size)
            digest = agent.hash_file(f, have).hexdigest() if have else "-"
            ch = _Channel.open(machine, "get", source.base, machine.cwd or "", source.path_of(e.path), str(e.size),
                               str(have), digest, str(run.level))
            if channels is not None:
                channels.append(ch)
            try:
                line = ch.readline()
                if line.startswith(agent.SKIPPED):  # it vanished or cannot be read there: the rest goes on
                    ch.finish()
                    run.skip(e.path, e.size, json.loads(line[len(agent.SKIPPED):]))
                    return
                kept = _kept(ch, line, e.path, have)
                f.truncate(kept)
                f.seek(kept)
                run.add_bytes(kept, resumed=True, path=e.path)
                want = None
                stream: _Channel | agent.ZReader = agent.ZReader(ch) if run.level else ch
                try:
                    try:
                        agent.write_rest(f, stream, e.size - kept, path,
                                         on_bytes=lambda n: run.add_bytes(n, path=e.path))
                    except OSError as exc:
                        agent.drop_part(f, tmp, exc)
                        raise
                    if kept:
                        want = agent.read_exact(stream, 64).decode("ascii", "replace")
                        if len(want) < 64:
                            raise EOFError(f"the stream ended before the sha256 of {e.path}")
                    if isinstance(stream, agent.ZReader):
                        run.add_wire(stream.wire)
                except EOFError:
                    exc = ch.failure()
                    rec = ch.record()
                    if rec is not None and rec.get("errno") == "CHANGED":  # it shrank there: left out
                        run.skip(e.path, 0, ["CHANGED", f"shrank below its listed {e.size} bytes while it was read"])
                        return
                    raise exc from None
                if ch.finish() != 0:
                    raise ch.failure()
            finally:
                ch.close()
            agent.finish_part(f, tmp, path, e.size, e.mode, e.mtime_ns, want)
            run.file_done(e.path)
        finally:
            agent.leave_part(f, tmp)  # a part not renamed is kept for a resume
            agent.release(token)

    def written(self) -> None:
        """Nothing more goes through the listing's channel to here (it is the machine's)."""

    def finish(self, plan: Plan, summary: SyncSummary) -> None:
        """After the files: links, metadata, then the folders' modes and mtimes."""
        for e in plan.links:
            _make_link_here(summary, _local_path(self.root, e.path), e)
        for rel, mode, mtime in plan.meta:
            agent.set_meta(_local_path(self.root, rel), mode, mtime, ns=True)
        agent.stamp_dirs([(_local_path(self.root, e.path), e.mode, e.mtime_ns) for e in plan.dirs], ns=True)


class RemoteSide:
    """The machine's end of a sync: ``root`` there, and the ``serve`` channel ``ch`` that
    lists it and carries the small files' tar."""

    def __init__(self, machine, ch: _Channel, root: str):
        self.machine = machine
        self.ch = ch
        self.root = root
        #: The folder a large file's ``get`` reads from, and the machine's path there of a
        #: file whose name here differs (a pull's renamed clash, its one file).
        self.base = root
        self.names: dict[str, str] = {}
        #: The ``serve`` channel's agent has exited (stdin closed, status read).
        self.ended = False

    @property
    def where(self) -> str:
        return self.machine.name

    @property
    def label(self) -> str:
        """The root as the summary names it (``NAME:/abs/path``)."""
        return f"{self.machine.name}:{self.path}"

    @property
    def path(self) -> str:
        """The root as an error names it (absolute, see :func:`remote_root`)."""
        return remote_root(self.machine, self.root)

    def path_of(self, rel: str) -> str:
        """The machine's path (under :attr:`base`) of the file ``rel``."""
        return self.names.get(rel, rel)

    # -- the listing ----------------------------------------------------------------------

    def scan(self, checksum: bool, rules: IgnoreRules, same_as: SourceWalk | Listing | None = None) -> Listing | None:
        """The listing its agent sends (see :func:`read_listing`): None when ``same_as``, the
        walk of this computer's source, has the machine's fingerprint."""
        return read_listing(self.ch, same_as if isinstance(same_as, SourceWalk) else None)

    def entries(self, listing: Listing, rules: IgnoreRules, destination: LocalSide) -> tuple[dict[str, Entry], bool]:
        """The source's entries (less what ``rules`` leave out; its one file under its name
        at the destination), and whether it is one file.  A root that is absent or a
        special file is refused; one file is fetched from its folder with ``get``: the
        ``serve`` agent ends."""
        if "." in listing.specials:
            _refuse_special(self.path, _SPECIAL_MODES.get(listing.specials["."], 0), self.machine.name)
        if listing.root is None:
            raise SyncError(f"no file or directory {self.path} on {self.machine.name}",
                            f"check the path; relative paths start at {self.machine.cwd or 'the login directory'}")
        if listing.root.kind == "d":
            return filter_listing(listing, rules).entries, False
        self.end()
        name = destination.one_file(posixpath.basename(self.root))
        self.base, self.names = posixpath.dirname(self.root) or ".", {name: posixpath.basename(self.root)}
        return _resolve_single_file(listing, name), True

    def delete_guarded(self) -> tuple[str, str, bool]:
        """For :func:`refuse_wide_delete`, this destination as the message names it, its
        root, and whether it is the login home."""
        return self.label, self.root, _is_home_path(self.root, self.machine.cwd)

    def check(self, listing: Listing, single: bool, checksum: bool) -> Listing:
        """The destination's listing: a root that is not a folder is refused."""
        if listing.root is not None and listing.root.kind != "d":
            raise SyncError(f"{self.label} exists and is not a directory",
                            "choose another destination, or remove that file first")
        return listing

    def end(self) -> None:
        """End the ``serve`` agent (its stdin closed, its exit status read), once."""
        if not self.ended:
            self.ended = True
            self.ch.close_stdin()
            self.ch.finish()

    # -- as the source --------------------------------------------------------------------

    def supply(self, small: list[Entry], level: int) -> "_Channel | agent.ZReader":
        """Ask the ``serve`` agent for a tar of ``small`` (its ``send``); the stream to read it
        from (decompressed at ``level`` > 0)."""
        head = _json_bytes({"op": "send", "paths": [e.path for e in small],
                            **({"z": level} if level else {})})
        self.ch.doing = "reading"
        self.ch.send(struct.pack(">I", len(head)) + head)
        self.ch.close_stdin()
        self.ended = True  # (its exit status is read after the tar)
        return agent.ZReader(self.ch) if level else self.ch

    def supplied(self) -> None:
        """Nothing more is asked of the ``serve`` agent: it ends now."""
        self.end()

    # -- as the destination ---------------------------------------------------------------

    @property
    def reads(self) -> int:
        """The codecs the agent reads beyond zlib (from the ``serve`` channel's first byte)."""
        return self.ch.reads

    def needs_tar(self, plan: Plan, small: list[Entry], clean: list[str]) -> bool:
        """Whether :meth:`write_small` has anything to do: the ``recv`` command carries the
        removals, abandoned parts, folders, links and metadata too."""
        return bool(small or plan.links or plan.dirs or plan.meta or plan.removals or clean)

    def writing(self, source: LocalSide):
        """The agent names its own errors (see :meth:`_Channel.failure`)."""
        return contextlib.nullcontext()

    def stage(self, plan: Plan, clean: list[str]) -> None:
        """Nothing ahead of the files: the ``recv`` command carries the removals and the
        abandoned parts, and its tar the folders, ahead of its files."""

    def write_small(self, source: LocalSide, run: _Run, plan: Plan, small: list[Entry],
                    clean: list[str], before_end: Callable[[], None] | None = None) -> None:
        """Send the ``recv`` command and the tar stream on the ``serve`` channel; wait for
        the result.  ``clean``: abandoned part files to remove; ``before_end``: called
        before the tar's end (the large files beside it: folders are stamped after them)."""
        self.ended = True
        try:
            tar = _TarSender(self.ch, run, source, plan.removals, plan.meta, clean)
            tar.folders(plan.dirs)  # every folder before the first file (removals came first)
            for e in small:
                tar.file(e.path, e.size, e.mode, e.mtime_ns)
            tar.finish(plan.links, before_end)
        except KeyboardInterrupt:
            self.ch.close()
            raise

    def write_large(self, source: LocalSide, run: _Run, e: Entry, offset: int,
                    channels: list | None = None) -> None:
        """Send one file on its own channel (``put``), continuing an abandoned part there
        whose first ``offset`` bytes match (the listing's); a resumed file is followed by
        the sha256 of the whole, which the agent checks the part against before renaming
        it."""
        machine = self.machine
        offset = offset if 0 < offset <= e.size else 0
        try:
            f = source.open(e.path)
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                f.close()
                run.skip(e.path, e.size, ["EISDIR", "became a folder after it was listed"])
                return
        except OSError as exc:  # left out, the rest goes on (rsync: exit 23, or 24 when it vanished)
            run.skip(e.path, e.size, agent.skip_reason(exc))
            return
        with f:
            mode = e.mode
            if mode == laptop.BY_CONTENT:
                mode = laptop.mode_by_content(f.read(2))
                f.seek(0)
            whole = agent.hash_file(f, offset) if offset else None
            ch = _Channel.open(machine, "put", self.root, machine.cwd or "", e.path, str(e.size),
                               str(e.mtime_ns), "%o" % mode, str(offset), whole.hexdigest() if whole else "-",
                               str(run.level))
            if channels is not None:
                channels.append(ch)
            try:
                kept = _kept(ch, ch.readline(), e.path, offset, more=True)
                run.add_bytes(kept, resumed=True, path=e.path)
                whole = whole if kept else None
                f.seek(kept)
                left = e.size - kept
                out: _Channel | agent.ZWriter = ch
                if run.level:
                    out = agent.ZWriter(_Direct(ch), run.level)
                send = out.send if isinstance(out, _Channel) else out.write
                while left > 0:
                    try:
                        b = f.read(min(1 << 20, left))
                    except OSError as exc:
                        b, why = b"", agent.skip_reason(exc)
                    else:
                        why = ["CHANGED", f"shrank from {e.size} to {e.size - left} bytes while it was read"]
                    if not b:
                        # closed before its end: the machine keeps the part, never the file's name
                        ch.close()
                        run.skip(e.path, left, why)  # the bytes sent stay counted as sent
                        return
                    if whole is not None:
                        whole.update(b)
                    send(b)
                    left -= len(b)
                    run.add_bytes(len(b), path=e.path)
                if whole is not None:
                    send(whole.hexdigest().encode())
                if isinstance(out, agent.ZWriter):
                    out.flush()
                    run.add_wire(out.wire)
                    _retuned(machine, e.path, out)
                ch.close_stdin()
                reply = ch.read()
                if ch.finish() != 0:
                    raise ch.failure(reply)
                run.file_done(e.path)
            finally:
                ch.close()

    def written(self) -> None:
        """Nothing more goes to the ``serve`` agent: it ends now."""
        self.end()

    def finish(self, plan: Plan, summary: SyncSummary) -> None:
        """Nothing after the files: the agent stamped the folders at the tar's end."""


Side = LocalSide | RemoteSide


def _kept(ch: _Channel, line: bytes, rel: str, offered: int, more: bool = False) -> int:
    """The first answer of a large file's agent (``put``/``get``), ``OFFSET N``: how many
    bytes of the ``offered`` part it keeps (0, or all of them).  Any other line is its
    failure (``more``: with the rest of its output)."""
    if not line.startswith(b"OFFSET "):
        raise ch.failure(line + ch.read() if more else line)
    kept = int(line.split()[1])
    if kept not in (0, offered):
        raise SyncError(f"the sync helper on {ch.machine.name} answered OFFSET {kept} for {rel}",
                        "run the sync again; if it repeats, report it with this message")
    return kept


def carry_out(source: Side, destination: Side, plan: Plan, sides: _Sides, summary: SyncSummary,
             progress: ProgressCallback | None, compress: bool | None,
             attempt: list[_Run] | None = None) -> _Run | None:
    """Carry out ``plan`` from ``source`` to ``destination`` (one is this computer, the other
    the machine): a push and a pull are this one sequence with the sides swapped.

    Files of :data:`LARGE_FILE` bytes or more (and those whose destination may hold their
    first bytes, a pull's renamed ones, a pull of one file) go each on its own channel,
    resumed; the rest in one tar stream on the listing's channel, beside them.  ``sides``:
    both listings (the destination's parts decide what is resumed and what is cleaned).
    ``attempt`` collects the :class:`_Run` made.  None when a push has nothing to do."""
    remote = destination if isinstance(destination, RemoteSide) else source
    assert isinstance(remote, RemoteSide)
    grown = _grown(plan, sides.dest.entries)
    alone = {e.path for e in plan.send if e.size >= LARGE_FILE or sides.listed or e.path in grown
             or e.path in sides.remote_of}  # (fetched one by one: the tar names each file as the machine does)
    large = [e for e in plan.send if e.path in alone]
    small = [e for e in plan.send if e.path not in alone]
    clean = [p for p, target in sides.dest.parts.items() if target not in alone]
    _restamp_parents(plan, sides.source, clean)
    offsets = {e.path: sides.dest.partials.get(e.path, 0) or grown.get(e.path, 0) for e in large}
    tar = destination.needs_tar(plan, small, clean)
    if not small:
        source.supplied()
    if not (large or tar) and isinstance(destination, RemoteSide):
        destination.written()
        return None  # nothing at all to do (a no-change push): no run, no progress
    level = 0
    if large or small:
        level, summary.compression = decide_compression(remote.machine, compress, remote.ch.rtt,
                                                        destination.reads)
    run = _Run(plan, summary, progress, level=level, attempt=attempt)
    with destination.writing(source):
        destination.stage(plan, clean)
        if large and small:
            # Large files on a worker thread while the tar of small files streams: a
            # many-small-files tar is bound by file creation, not the network, so the large
            # files' bytes flow meanwhile.  The tar ends (and the folders are stamped, last)
            # only after the large files are in place, so their mtimes stay right.
            _beside_the_tar(run, large,
                            lambda e, chs: destination.write_large(source, run, e, offsets[e.path], chs),
                            lambda wait: destination.write_small(source, run, plan, small, clean, before_end=wait))
        else:
            for e in large:
                destination.write_large(source, run, e, offsets[e.path])
            if tar:
                destination.write_small(source, run, plan, small, clean)
            else:
                destination.written()
        destination.finish(plan, summary)
    return run


def _restamp_parents(plan: Plan, source: dict[str, Entry], removed: list[str]) -> None:
    """Add the folders of ``removed`` (abandoned part files, cleaned) to ``plan.dirs``:
    removing a file changes its folder's mtime, which is set again last."""
    listed = {e.path for e in plan.dirs}
    for p in removed:
        d = posixpath.dirname(p) or "."
        e = source.get(d)
        if d not in listed and e is not None and e.kind == "d":
            plan.dirs.append(e)
            listed.add(d)


def _grown(plan: Plan, dest: dict[str, Entry]) -> dict[str, int]:
    """Files to send whose destination may hold their first bytes (it is a smaller file of
    at least :data:`APPEND_MIN` bytes): path -> the destination's size.  Whether it really
    does is checked by hashing (the agent's ``put``/``get``); when not, the file is sent
    whole."""
    out = {}
    for e in plan.send:
        d = dest.get(e.path)
        if d is not None and d.kind == "f" and APPEND_MIN <= d.size < e.size:
            out[e.path] = d.size
    return out


def _make_link_here(summary: SyncSummary, path: str, e: Entry) -> None:
    """Make a pulled symlink; where this computer cannot make one (Windows without Developer
    Mode or admin rights: EPERM/ERROR_PRIVILEGE_NOT_HELD; FAT, exFAT: EOPNOTSUPP), record it
    in ``summary.links_refused`` to be named, and go on."""
    try:
        agent.make_link(path, e.target)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS) \
                and getattr(exc, "winerror", None) != 1314:
            raise
        summary.links_refused[e.path] = e.target


class _Channels(list):
    """The large files' channels of :func:`_beside_the_tar`: one added after ``stop`` was set
    (the worker was opening it when the stream failed) is closed at once, so that the worker
    does not send a whole file on a connection that the sync is about to leave."""

    def __init__(self, stop: threading.Event):
        super().__init__()
        self.stop = stop

    def append(self, ch) -> None:
        super().append(ch)
        if self.stop.is_set():
            ch.close()


def _beside_the_tar(run: _Run, large: Iterable[Entry], one: Callable[[Entry, list], None],
                    stream: Callable[[Callable[[], None]], None]) -> None:
    """``one(entry, channels)`` for each large file on a worker thread while
    ``stream(wait_for_large)`` moves the small files' tar; ``wait_for_large`` returns when
    the worker is done (re-raising its error).  An error or interrupt of the stream stops the
    worker and closes its channels."""
    stop = threading.Event()
    channels = _Channels(stop)

    def worker() -> None:
        for e in large:
            if stop.is_set():
                return
            one(e, channels)

    with ThreadPoolExecutor(1, thread_name_prefix="gpumagic-sync") as pool:
        fut = pool.submit(worker)

        try:
            stream(lambda: run.wait_for(fut))
        except BaseException:
            stop.set()
            for c in list(channels):
                c.close()
            raise


def _single_file_target(machine, dst: str, name: str) -> tuple[str, str]:
    """For a single-file SRC: (remote directory, file name), as rsync decides: into DST when
    it ends in ``/`` or is a directory, else DST is the file's new path."""
    if dst.endswith("/"):
        return dst, name
    probe = remote_listing(machine, dst, names=[])
    if probe.root is not None and probe.root.kind == "d":
        return dst, name
    d, n = posixpath.split(dst)
    return d or ".", n


class _TarSender:
    """The ``recv`` command on a ``serve`` channel and its tar stream: directories first
    (:meth:`folders`), then small files one by one (each read whole), then links, then the
    agent's answer.  The agent makes a folder when its entry arrives and stamps its mode and
    mtime after the tar's end, so a folder's entry ahead of its files costs nothing and
    makes the folders together, as rsync's receiver does: on ext4 without a journal, folders
    made one by one between their files land in the block groups a recent deletion emptied,
    where every new file pays a scan of the recently freed inodes (PROFILE-sync.md, "ext4
    without a journal").  ``removals``, ``meta``, ``clean``: see ``apply_push`` in
    :mod:`gpumagic.sync.agent`."""

    def __init__(self, ch: "_Channel", run: _Run, source: LocalSide, removals: Iterable[str] = (),
                 meta: Iterable[tuple[str, int, int]] = (), clean: Iterable[str] = ()):
        self.ch, self.run, self.source = ch, run, source
        self.sink: _TarSink | agent.ZWriter = _TarSink(ch)
        if run.level:  # frames of their own size go straight to the channel
            self.sink = agent.ZWriter(_Direct(ch), run.level)
        head = _json_bytes({"op": "recv", "delete": list(removals),
                            "meta": [[p, m, t] for p, m, t in meta], "clean": list(clean),
                            **({"z": run.level} if run.level else {})})
        ch.send(struct.pack(">I", len(head)) + head)

    def file(self, rel: str, size: int, mode: int, mtime_ns: int) -> None:
        data, why = self.source.supply(rel, size)
        if data is None:  # left out, the rest goes on (rsync: exit 23, or 24 when it vanished)
            self.run.skip(rel, size, why)
            return
        if mode == laptop.BY_CONTENT:
            mode = laptop.mode_by_content(data)
        self.sink.write(agent.tar_member(rel, data, mode, mtime_ns // 1_000_000_000))
        self.run.file_done(rel, size)

    def folders(self, dirs: Iterable[Entry]) -> None:
        """Directory entries, sent ahead of the files that go into them."""
        for e in dirs:
            self.sink.write(_tar_header(e))

    def finish(self, links: list[Entry], before_end: Callable[[], None] | None = None) -> None:
        """Links, then the tar's end once ``before_end`` (the large files beside the tar)
        has returned, then the agent's answer."""
        for e in links:
            self.sink.write(_tar_header(e))
        if before_end is not None:
            before_end()
        agent.end_tar(self.sink)
        self.sink.flush()
        if isinstance(self.sink, agent.ZWriter):
            self.run.add_wire(self.sink.wire)
            _retuned(self.ch.machine, "the small files' stream", self.sink)
        self.ch.close_stdin()
        reply = self.ch.read()
        if self.ch.finish() != 0:
            raise self.ch.failure(reply)


class _StreamedWalk(SourceWalk):
    """The sink of :func:`_stream_into_empty`'s walk: records' fields only, until handed off (no
    fingerprint rows, no part files)."""

    parts = False
    keeps_rows = False


def _stream_into_empty(source: LocalSide, destination: RemoteSide, rules: IgnoreRules,
                       run: _Run, walked: SourceWalk | None = None, modes: bool = True) -> Plan:
    """A push into an empty destination (``destination``, whose agent said so): with nothing there to compare, each folder's files
    go as soon as the walk has listed them, so the machine writes while this side still
    walks (rsync's incremental recursion).  The folders the walk has found go ahead of the
    files of each batch (a folder's subfolders are made before its files, as rsync's receiver
    makes each level's folders first; see :class:`_TarSender`).  Large files go beside the
    tar on their own channels, as in any push; links follow the files.  The progress totals
    grow meanwhile (``counting``).  ``walked``: the whole tree, when the walk ended before
    the agent said the destination was empty.  Returns the plan carried out (its links and
    dirs)."""
    ch, src = destination.ch, source.root
    walk = _StreamedWalk() if walked is None else walked
    walk.all_fields()  # a whole walk's plain files are kept as rows (see agent.Listed)
    plan = Plan()
    large: queue.SimpleQueue[Entry | None] = queue.SimpleQueue()

    def stream(wait_for_large: Callable[[], None]) -> None:
        try:
            tar = _TarSender(ch, run, source)

            def hand_off(counting: bool = True) -> None:
                # what the walk added since the last call: its folders (the subfolders of
                # the folders listed since), then its small files, into the tar now
                batch, folders = [], []
                files = nbytes = 0
                for kind, rel, size, mtime_ns, mode, text, _ in walk.fields:
                    if not modes:  # a folder without modes: new files by content, folders 0755
                        mode = laptop.BY_CONTENT if kind == "f" else laptop.NEW_DIR_MODE
                    if kind == "f":
                        files += 1
                        nbytes += size
                        if size >= LARGE_FILE:
                            large.put(Entry(rel, "f", size, mtime_ns, mode))
                        else:
                            batch.append((rel, size, mode, mtime_ns))
                    elif kind == "d":
                        folders.append(Entry(rel, "d", 0, mtime_ns, mode))
                    elif kind == "l":
                        plan.links.append(Entry(rel, "l", 0, mtime_ns, mode, text))
                    elif kind == "e":
                        run.summary.unreadable[rel] = text
                    elif kind == "v":
                        run.summary.vanished[rel] = text
                    elif kind == "s":
                        run.summary.specials[rel] = text
                walk.fields.clear()  # the walk appends to this very list
                run.grow(files, nbytes, counting)
                tar.folders(folders)
                plan.dirs.extend(folders)
                for item in batch:
                    tar.file(*item)

            if walked is None:  # at each new folder, the ones before it are listed whole
                walk_source(src, rules, each_dir=hand_off, out=walk)
            hand_off(counting=False)
        finally:
            large.put(None)
        plan.dirs.sort(key=lambda e: tree_order(e.path))
        tar.finish(plan.links, wait_for_large)

    try:
        _beside_the_tar(run, iter(large.get, None),
                        lambda e, chs: destination.write_large(source, run, e, 0, chs), stream)
    except KeyboardInterrupt:
        ch.close()
        raise
    return plan


def _json_bytes(obj) -> bytes:
    """JSON as ASCII: names that are not UTF-8 travel as ``\\udcXX`` escapes and come back
    as the same bytes through ``surrogateescape``."""
    return json.dumps(obj, ensure_ascii=True).encode("ascii")


def pull(machine, src: str, dst: str, options: SyncOptions | None = None, *,
         progress: ProgressCallback | None = None, **shortcuts) -> SyncSummary:
    """Copy a remote tree (or file) to a local path, fetching only what differs.

    Parameters are those of :func:`push`, with ``src`` remote (relative to the machine's
    ``cwd``) and ``dst`` local.  ``.gitignore``/``.gpuignore`` files of the remote tree
    are honoured (their texts come with the listing).  Where the local folder takes two
    of the machine's names for one (``Model.pt`` and ``model.pt`` on NTFS or APFS; see
    :mod:`gpumagic.sync.laptop`), the pull is refused before anything is written, naming
    them, unless ``rename_clashes``: then the later ones are written as ``model (2).pt``
    (listed in :attr:`SyncSummary.renamed`).  Symlinks this computer cannot make are named
    in :attr:`SyncSummary.links_refused`; everything else is pulled.

    Returns
    -------
    SyncSummary

    Raises
    ------
    ConfigError, SyncError, SyncDiskFull, SyncPermissionDenied, ConnectionLost, KeyboardInterrupt
        As for :func:`push`.
    """
    return _sync("pull", machine, src, dst, (options or SyncOptions()).with_(**shortcuts),
                 _progress_callback(progress))


def _local_listing(root: str, digests: bool, names: list[str] | None) -> Listing:
    """The local destination, listed by the agent's own code (partials included)."""
    try:
        return list_local(root, digests, names)
    except NotADirectoryError:
        raise SyncError(f"cannot copy into {root} on this computer: part of that path is a file, "
                        "not a directory", "name another destination, or move that file away") from None
    except OSError as exc:
        raise agent_error(agent.error_record(exc), "this computer", "reading") from None


def _skipped(rest: bytes) -> dict:
    """The files a ``send`` tar left out (see :func:`gpumagic.sync.agent.send_tar`): rel ->
    ``[errno name, reason]``; ``{}`` when none."""
    i = rest.find(agent.SKIPPED)
    if i < 0:
        return {}
    try:
        skipped = json.loads(rest[i + len(agent.SKIPPED):].split(b"\n", 1)[0])
    except ValueError:
        return {}
    return skipped if isinstance(skipped, dict) else {}


def _copy_grown(path: str, f, size: int) -> int:
    """Start the new part ``f`` of ``path`` with a copy of the local file (when it is a
    regular file of at least :data:`APPEND_MIN` bytes but fewer than ``size``): the machine
    then sends only the rest if its file starts with the same bytes (it grew by
    appending), else everything (the copy is cut off).  Bytes copied (0: none)."""
    try:
        with open(path, "rb") as src:
            st = os.fstat(src.fileno())
            if not (stat.S_ISREG(st.st_mode) and APPEND_MIN <= st.st_size < size):
                return 0
            return agent.copy_prefix(src, f, st.st_size)
    except OSError:
        f.seek(0)
        f.truncate(0)
        return 0
