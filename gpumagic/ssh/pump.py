"""One pump for a session channel: every reader of an exec channel moves its bytes here.

A command on the machine writes stdout and stderr, takes stdin, and ends with an exit status
(RFC 4254 sections 5.2, 6.9 and 6.10).  :class:`ChannelPump` moves those bytes for cells
(:mod:`gpumagic.remote.execution`, with and without the cell runner) and for the sync agent
(:mod:`gpumagic.sync.engine`):

* it reads stdout and stderr as they come, both, so that neither fills the channel's window
  while the other is awaited (a command blocked on a full stderr never exits);
* it sends what is queued only as the server's window allows, so a send never blocks with
  nobody watching the connection, and never after the channel's CLOSE (sshd drops the whole
  connection for that: see :mod:`gpumagic.ssh._paramiko`);
* it knows the end: the remote's EOF or CLOSE, and the exit status after it;
* it waits on the channel between steps, never busy-polls: paramiko's event pipe stays
  readable for good after the remote's EOF, so from then on it waits for the exit status
  itself (:func:`_paramiko.wait_for_exit_status`);
* a caller's ``watch()`` runs at every idle step (raise there for a lost connection, a
  start-up that takes too long...), and a deadline ends :meth:`ChannelPump.run`.

paramiko's internals are used only through :mod:`gpumagic.ssh._paramiko`.
"""

from __future__ import annotations

import time
from typing import Callable

import paramiko

from ._paramiko import send_eof, send_some, sendall_ordered, wait_for_exit_status, wait_for_send_window
from .connection import wait_readable

#: A gate for queued bytes: they are sent once it returns True.
Gate = Callable[[], bool]


def _ignore(data: bytes) -> None:
    pass


def _always() -> bool:
    return True


def _nothing() -> None:
    pass


class ChannelPump:
    """Moves the bytes of one session channel (see the module docstring).

    Parameters
    ----------
    chan : paramiko.Channel
        An exec channel.  Its blocking mode is left as it is: the pump reads only what has
        arrived and sends only what the window takes, so no call of its own blocks.
    on_out, on_err : callable, optional
        Called with each piece of stdout and stderr (bytes) as it is read; dropped if None.
    chunk : int
        The most bytes read (or sent) in one step, per stream.

    Attributes
    ----------
    active : float
        ``time.monotonic()`` of the last stdout read or opened send window: what a caller
        that probes an idle connection measures from.
    """

    def __init__(self, chan: paramiko.Channel, on_out: Callable[[bytes], None] | None = None,
                 on_err: Callable[[bytes], None] | None = None, *, chunk: int = 65536):
        self.chan = chan
        self.on_out = on_out or _ignore
        self.on_err = on_err or _ignore
        self.chunk = chunk
        self.active = time.monotonic()
        self._sending: memoryview | None = None
        #: What follows, in order: (bytes, or None for our EOF; the gate it waits for).
        self._queue: list[tuple[bytes | None, Gate]] = []

    # -- what the remote side has done ----------------------------------------------------

    @property
    def at_eof(self) -> bool:
        """The remote side sent EOF or closed the channel: no more stdout will come."""
        return bool(self.chan.eof_received or self.chan.closed)

    @property
    def eof_received(self) -> bool:
        """The remote side sent EOF (not just a CLOSE, as a dropped connection leaves)."""
        return bool(self.chan.eof_received)

    @property
    def finished(self) -> bool:
        """The command exited, its output is all read, and nothing is being sent."""
        chan = self.chan
        return (chan.exit_status_ready() and self.at_eof and self._sending is None
                and not chan.recv_ready() and not chan.recv_stderr_ready())

    # -- sending ----------------------------------------------------------------------------

    def send(self, data: bytes, when: Gate = _always) -> None:
        """Queue ``data`` for stdin, sent (after what is queued before it) once ``when()``
        is true, by the steps of :meth:`run`."""
        self._queue.append((data, when))

    def send_eof(self, when: Gate = _always) -> None:
        """Queue our EOF (the end of stdin), sent after everything queued before it once
        ``when()`` is true."""
        self._queue.append((None, when))

    @property
    def sending(self) -> bool:
        """Bytes are being sent (some were, and the window holds back the rest)."""
        return self._sending is not None

    def _send_step(self) -> bool:
        moved = False
        if self._sending is None and self._queue:
            data, when = self._queue[0]
            if when():
                self._queue.pop(0)
                moved = True
                if data is None:
                    send_eof(self.chan)
                elif data:
                    self._sending = memoryview(data)
        if self._sending is not None:
            # No more than the window takes now, so this never blocks; never after a CLOSE.
            n = send_some(self.chan, self._sending[:self.chunk])
            if n:
                self._sending = self._sending[n:] or None
                moved = True
        return moved

    def send_all(self, data: bytes | memoryview, idle: Callable[[], None] = _nothing,
                 wait: float = 0.5) -> None:
        """Send ``data`` now, piece by piece as the window opens, calling ``idle()`` every
        ``wait`` seconds that the window stays shut (read stderr, watch the connection
        there).  Stdout is not read meanwhile.

        Raises
        ------
        OSError
            The channel closed (or our EOF was sent) before everything was sent.
        """
        view = memoryview(data)
        while view:
            n = self._window(idle, wait) or len(view)  # 0: closed; sendall_ordered raises
            sendall_ordered(self.chan, view[:n])
            view = view[n:]

    def _window(self, idle: Callable[[], None], wait: float) -> int:
        while True:
            window = wait_for_send_window(self.chan, wait)
            if window is None:
                return 0
            if window > 0:
                self.active = time.monotonic()
                return window
            idle()

    # -- reading ----------------------------------------------------------------------------

    def read_stderr(self) -> None:
        """Read all of stderr that has arrived (to ``on_err``)."""
        while self.chan.recv_stderr_ready():
            self.on_err(self.chan.recv_stderr(self.chunk))

    def read_stdout(self) -> None:
        """Read all of stdout that has arrived (to ``on_out``)."""
        while self.chan.recv_ready():
            self.active = time.monotonic()
            self.on_out(self.chan.recv(self.chunk))

    def step(self) -> bool:
        """Send what is due and the window allows, and read one piece of stdout and of
        stderr where they have come; True when anything moved."""
        moved = self._send_step()
        chan = self.chan
        if chan.recv_ready():
            data = chan.recv(self.chunk)
            if data:
                self.active = time.monotonic()
                self.on_out(data)
                moved = True
        if chan.recv_stderr_ready():
            data = chan.recv_stderr(self.chunk)
            if data:
                self.on_err(data)
                moved = True
        return moved

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for something to move (0.01 s while a send waits
        for the window): for data, or after the remote's EOF for the exit status."""
        if self.chan.eof_received and self._sending is None:
            wait_for_exit_status(self.chan, timeout)
        else:
            wait_readable(self.chan, 0.01 if self._sending is not None else timeout)

    def run(self, done: Callable[[], bool], *, deadline: float | None = None,
            watch: Callable[[], None] = _nothing, wait: float = 0.2) -> bool:
        """Step until ``done()`` (checked after every step); True then, False at
        ``deadline`` (``time.monotonic()``).  While nothing moves: ``done()``, then
        ``watch()`` (which raises to stop), then the deadline, then :meth:`wait`."""
        while True:
            moved = self.step()
            if done():
                return True
            if moved:
                continue
            watch()
            if deadline is not None and time.monotonic() > deadline:
                return False
            self.wait(wait)
