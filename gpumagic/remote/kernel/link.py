"""The channel to a keeper: one ``direct-tcpip`` channel carrying the wire format
(:mod:`.wire`), read on a thread into a bounded queue, and the programs the keeper is
made of (sent to the machine as one tar)."""

from __future__ import annotations

import collections
import io
import json
import shlex
import tarfile
import threading
from dataclasses import dataclass, field
from importlib import resources
from typing import Iterable, TYPE_CHECKING

import paramiko

from ...errors import KernelConnectionLost
from ...ssh import _paramiko
from . import wire

if TYPE_CHECKING:
    from ..._types import MachineLike

#: Bytes of decoded frames held between the channel and the caller (the rest waits in
#: the SSH window and on the machine).
QUEUE_BYTES = 4 * 1024 * 1024
#: SSH channel window asked for the keeper's channel (bytes).
WINDOW_SIZE = 8 * 1024 * 1024
MAX_PACKET_SIZE = 255 * 1024


@dataclass
class Message:
    """One frame from the keeper: a kernel message (``ch`` iopub/shell/stdin/control), a
    keeper event (``ch == "keeper"``, ``content`` the event) or a reply to this client
    (``op`` set, no ``seq``)."""

    seq: int | None
    ch: str
    op: str | None = None
    header: dict = field(default_factory=dict)
    parent: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)
    content: dict = field(default_factory=dict)
    buffers: list = field(default_factory=list)

    @property
    def msg_type(self) -> str:
        return self.header.get("msg_type", "")

    @property
    def parent_id(self) -> str | None:
        return self.parent.get("msg_id")

    @classmethod
    def parse(cls, parts: list[bytes]) -> "Message":
        meta = json.loads(parts[0])
        if "op" in meta:
            return cls(None, "", op=meta["op"], content=meta)
        seq, ch = meta["seq"], meta["ch"]
        if ch == "keeper":
            return cls(seq, ch, content=json.loads(parts[1]))
        return cls(seq, ch, header=json.loads(parts[1]), parent=json.loads(parts[2]),
                   metadata=json.loads(parts[3]), content=json.loads(parts[4]),
                   buffers=parts[5:])


# -- the remote programs --------------------------------------------------------------------


def program_text(name: str) -> bytes:
    """A program of ``gpumagic/remote/programs`` (read with importlib.resources)."""
    return resources.files("gpumagic.remote").joinpath("programs", name).read_bytes()


def _programs_tar() -> tuple[str, bytes]:
    """(content hash, tar of the keeper, its startup code and the wire format they load) to
    unpack on the machine."""
    import hashlib

    files = {n: program_text(n) for n in ("kernel_keeper.py", "kernel_launch.py", "kernel_startup.py")}
    # the wire format both sides load: the same file as this side's kernel.wire module
    files["kernel_wire.py"] = resources.files("gpumagic.remote.kernel").joinpath("wire.py").read_bytes()
    digest = hashlib.sha256(b"".join(files[n] for n in sorted(files))).hexdigest()[:16]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for n, data in sorted(files.items()):
            ti = tarfile.TarInfo(n)
            ti.size, ti.mode, ti.mtime = len(data), 0o600, 0
            tar.addfile(ti, io.BytesIO(data))
    return digest, buf.getvalue()


def _q(*words: str) -> str:
    return " ".join(shlex.quote(w) for w in words)




class _Lost(Exception):
    pass


class _Link:
    """One ``direct-tcpip`` channel to a keeper, with a reader thread that decodes frames
    into a bounded queue (when it is full, the rest waits on the machine)."""

    def __init__(self, machine: MachineLike, port: int, token: str, since: int):
        self.machine = machine
        conn = machine.connection
        conn.ensure_open()
        self.opened = conn.opened_count
        try:
            self.chan = _paramiko.open_channel_public(
                conn.transport, ("127.0.0.1", port), ("127.0.0.1", 0), WINDOW_SIZE,
                MAX_PACKET_SIZE, conn.spec.connect_timeout)
        except paramiko.ChannelException as e:
            raise _Lost(f"nothing accepts connections on the keeper's port {port} ({e.text or e})")
        except (TimeoutError, paramiko.SSHException, EOFError, OSError) as e:
            raise KernelConnectionLost(f"cannot open a channel to {machine.name}: {e}",
                                       "run it again: gpumagic reconnects by itself")
        self._cv = threading.Condition()
        self._items: collections.deque = collections.deque()
        self._bytes = 0
        self.lost: str | None = None
        self.closed = False
        self._send_lock = threading.Lock()
        self.send({"op": "hello", "token": token, "since": since})
        self.thread = threading.Thread(target=self._read, daemon=True, name="gpumagic-kernel-link")
        self.thread.start()

    def send(self, meta: dict, parts: Iterable[bytes] = ()) -> None:
        data = wire.frame([wire.dumps(meta), *parts])
        try:
            with self._send_lock:
                _paramiko.sendall_ordered(self.chan, data)
        except (paramiko.SSHException, EOFError, OSError) as e:
            self.lost = self.lost or str(e) or "the channel closed"
            raise _Lost(self.lost)

    def _put(self, item, size: int = 0) -> None:
        """Queue a frame; waits while QUEUE_BYTES are queued (the rest waits in the SSH
        window and on the machine), so memory here stays flat however much a cell prints."""
        with self._cv:
            while not self.closed and self._items and self._bytes + size > QUEUE_BYTES:
                self._cv.wait(0.5)
            self._items.append((item, size))
            self._bytes += size
            self._cv.notify_all()

    def _read(self) -> None:
        buf = bytearray()
        try:
            while not self.closed:
                data = self.chan.recv(1 << 20)
                if not data:
                    break
                buf += data
                for parts, size in wire.take_frames(buf):
                    self._put(Message.parse(parts), size)
        except Exception as e:  # the channel or the connection ended
            self.lost = str(e) or type(e).__name__
        self.lost = self.lost or self.machine.connection.lost_reason or "the channel closed"
        self._put(None)

    def get(self, timeout: float) -> Message | None:
        """The next frame, or None after ``timeout`` seconds.

        Raises
        ------
        _Lost
            The channel ended (and everything before that was returned).
        """
        with self._cv:
            if not self._items:
                self._cv.wait(timeout)
            if not self._items:
                return None
            item, size = self._items[0]
            if item is None:  # stays queued: later calls see it too
                raise _Lost(self.lost or "the channel closed")
            self._items.popleft()
            self._bytes -= size
            self._cv.notify_all()
        return item

    def wait_head(self, timeout: float, after: "Message | None" = None) -> "Message | None":
        """The frame at the head of the queue, left there, waiting up to ``timeout`` seconds
        for one (for a head other than ``after``: one already looked at); None when there is
        none yet, or the channel ended."""
        with self._cv:
            head = self._items[0][0] if self._items else None
            if head is None or head is after:
                self._cv.wait(timeout)
                head = self._items[0][0] if self._items else None
            return None if head is after else head

    def close(self) -> None:
        self.closed = True
        try:
            self.chan.close()
        except Exception:
            pass

