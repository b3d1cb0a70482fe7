"""A session's raw Jupyter messages, both ways, for a program that is a kernel to a front end
of its own (the kernel bridge, :mod:`gpumagic.kernel_bridge`).

:class:`RemoteKernel` shows a session's output itself; a :class:`Relay` hands each message on
as it came (header, parent header, metadata, content, buffers), with the same cursor: it
connects through :meth:`RemoteKernel._connect` (the keeper streams its journal from after
what was acknowledged, so what a cell printed while nothing was attached comes first, once,
in order), acknowledges what was handed on, and after a lost path connects again and sends
again the requests of which nothing came back (the keeper runs a shell request sent twice
once).
"""

from __future__ import annotations

import math
import threading
import time

from ...errors import KernelConnectionLost
from ...ssh import reconnect
from .client import RemoteKernel
from .link import Message, _Lost

#: How a bridge seeks a new connection after its path was lost (:mod:`gpumagic.ssh.reconnect`):
#: as long as its front end lives, 0.5 s between tries at first, doubled up to 4 s.
RECONNECT = reconnect.RECONNECT.but(grace=math.inf, max_pause=4.0)


class Relay:
    """The messages of session ``kernel`` (a :class:`RemoteKernel`), raw.

    ``next()`` is called from one thread; ``send()``, ``op()`` and ``delivered()`` from any.
    """

    def __init__(self, kernel: RemoteKernel, cursor_file: str | None = None):
        self.kernel = kernel
        self.cursor = _Cursor(cursor_file) if cursor_file else None
        self._lock = threading.Lock()
        #: Shell requests sent whose reply has not come: msg_id -> (channel, parts); those of
        #: which nothing came are sent again after a reconnect.
        self.pending: dict[str, list[bytes]] = {}
        self._seen: set[str] = set()
        #: Requests made while no path was open, sent once there is one.
        self._queued: list[tuple[dict, list[bytes]]] = []
        #: Times the path was lost and made again.
        self.reconnects = 0
        self.resent = 0
        #: The last message returned by :meth:`next` (handed on or about to be).
        self.received = 0

    @property
    def connected(self) -> bool:
        link = self.kernel._link
        return link is not None and link.lost is None and not link.closed

    def ensure(self, **options) -> dict:
        """Connect to the session, starting it first when it does not run (``options``:
        see :meth:`RemoteKernel.start`); a new session's messages are numbered from 1 again,
        so the cursor starts over.  Returns the keeper's welcome."""
        if self.kernel.ensure(**options) is not None:  # started: a new journal
            self.received = 0
        return self.connect()

    def connect(self) -> dict:
        """Open the path to the keeper (after a loss: again, sending again what had no
        answer); returns the keeper's welcome (``state``, ``last``, ``acked``...).

        Raises
        ------
        KernelError
            No such session (or its keeper is gone).
        GpumagicError
            No connection to the machine.
        """
        k = self.kernel
        link = k._connect()
        if self.cursor is not None:  # what an earlier relay here handed on is not again
            self.received = max(self.received, self.cursor.load(_keeper_id(k.keeper_state)))
        with self._lock:
            queued, self._queued = self._queued, []
            resend = [(m, p) for m, p in self.pending.items() if m not in self._seen]
        for msg_id, parts in resend:
            link.send({"op": "send", "ch": "shell", "ack": k._last_seq}, parts)
            self.resent += 1
        for meta, parts in queued:
            link.send(meta, parts)
        return dict(k._welcome)

    def send(self, ch: str, parts: list[bytes], msg_id: str | None = None) -> None:
        """Pass a front end's request (its four JSON parts and buffers) to the kernel on
        channel ``ch`` (shell, stdin, control); queued while no path is open."""
        meta = {"op": "send", "ch": ch, "ack": self.kernel._last_seq}
        with self._lock:
            if ch == "shell" and msg_id and _expects_reply(parts[0]):
                self.pending[msg_id] = parts
            link = self.kernel._link
            if link is None or link.lost is not None or link.closed:
                self._queued.append((meta, parts))
                return
        try:
            link.send(meta, parts)
        except _Lost:
            with self._lock:
                self._queued.append((meta, parts))

    def forget_pending(self) -> dict[str, list[bytes]]:
        """The shell requests still waiting for a reply, forgotten (the kernel that had them
        died, or the session was stopped: no reply will come)."""
        with self._lock:
            pending, self.pending = self.pending, {}
            self._seen.clear()
        return pending

    def op(self, name: str) -> None:
        """A keeper operation (``interrupt``; queued while no path is open)."""
        self.send_meta({"op": name})

    def send_meta(self, meta: dict) -> None:
        link = self.kernel._link
        if link is None or link.lost is not None or link.closed:
            with self._lock:
                self._queued.append((meta, []))
            return
        try:
            link.send(meta)
        except _Lost:
            with self._lock:
                self._queued.append((meta, []))

    def next(self, timeout: float) -> Message | None:
        """The next message of the session not handed on before (its ``seq`` past the
        cursor), or None after ``timeout`` seconds.

        Raises
        ------
        KernelConnectionLost
            The path was lost (:meth:`reconnect` makes it again; nothing is lost meanwhile).
        KernelError
            The keeper went away (the session was stopped, the machine restarted).
        """
        k = self.kernel
        link = k._link
        if link is None:
            raise KernelConnectionLost("not connected", "connect first")
        deadline = time.monotonic() + timeout
        while True:
            msg = k._next(link, max(0.0, deadline - time.monotonic()))
            if msg is None:
                return None
            if msg.seq is None or msg.seq <= max(self.received, k._last_seq):
                # a reply to this client, or one handed on before the path was made again
                if time.monotonic() >= deadline:
                    return None
                continue
            self.received = msg.seq
            pid = msg.parent_id
            if pid:
                with self._lock:
                    if pid in self.pending:
                        self._seen.add(pid)
                        if msg.ch == "shell" and msg.msg_type.endswith("_reply"):
                            self.pending.pop(pid, None)
                            self._seen.discard(pid)
            return msg

    def delivered(self, seq: int) -> None:
        """Message ``seq`` reached the front end: a new path (or a new relay) starts after it."""
        k = self.kernel
        k._last_seq = max(k._last_seq, seq)
        if self.cursor is not None:
            self.cursor.save(_keeper_id(k.keeper_state), seq)

    def ack(self) -> None:
        """Tell the keeper what was handed on (so a later client starts after it)."""
        link = self.kernel._link
        if link is not None and not link.closed:
            self.kernel._ack(link, force=True)

    def reconnect(self, stop: threading.Event) -> dict:
        """Connect again after a loss, as :data:`RECONNECT` says, until it works or ``stop``
        is set; returns the keeper's welcome.

        Raises
        ------
        KernelError
            The session is gone.
        GpumagicError
            ``stop`` was set, or the new connection failed in a way another try cannot mend
            (the bridge tries again when the front end next asks).
        """
        try:
            welcome = reconnect.Reconnects(self.kernel.machine.connection, RECONNECT).again(self.connect, stop=stop)
        except reconnect.GaveUp as e:
            raise KernelConnectionLost(f"stopped while connecting to {self.kernel.machine.name} again "
                                       f"({e.last or e.out_of})", "the next request connects again") from None
        self.reconnects += 1
        return welcome

    def close(self) -> None:
        """Acknowledge what was handed on and close the path; the session runs on."""
        self.kernel.close()


def _expects_reply(header: bytes) -> bool:
    """Whether a shell request gets a reply (``*_request``; comm_open, comm_msg and
    comm_close get none)."""
    import json

    try:
        return str(json.loads(header).get("msg_type", "")).endswith("_request")
    except (ValueError, AttributeError):
        return False


def _keeper_id(state: dict) -> str:
    """What names one keeper (one journal): its pid and port."""
    return f"{state.get('keeper_pid')}:{state.get('port')}"


#: Characters of the cursor file's line (before its newline): ``KEEPER SEQ`` and spaces.
_CURSOR_WIDTH = 80


class _Cursor:
    """The last message this computer handed on, kept in a small file (0600) written right
    after each one: a relay killed with SIGKILL before it acknowledged them to the keeper
    (which the keeper's journal then replays) leaves the next relay here knowing not to
    hand them on twice.  One line, ``KEEPER SEQ`` padded to a fixed width, rewritten in place by
    one ``write`` at its start (never a shorter line over a longer one)."""

    def __init__(self, path: str):
        import os

        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def load(self, keeper: str) -> int:
        import os

        os.lseek(self.fd, 0, os.SEEK_SET)
        words = os.read(self.fd, 200).decode("ascii", "replace").split()
        if len(words) == 2 and words[0] == keeper and words[1].isdigit():
            return int(words[1])
        return 0

    def save(self, keeper: str, seq: int) -> None:
        import os

        os.lseek(self.fd, 0, os.SEEK_SET)  # (lseek and write: Windows has no pwrite)
        os.write(self.fd, f"{keeper} {seq:020d}".ljust(_CURSOR_WIDTH).encode() + b"\n")
