"""The one door to paramiko's private internals.

gpumagic uses a few of paramiko's private names where its public API cannot do the job:

* sending DATA, EOF and WINDOW_ADJUST on a channel without racing the channel's CLOSE (sshd
  drops the whole connection for a message on a freed channel; see below);
* never waiting for a key exchange on paramiko's own transport thread, the only thread that
  can finish one;
* waiting, without polling, for a channel's exit status (``Channel.status_event``) or for
  its send window to open (``Channel.out_buffer_cv``), and reading the window's size;
* noticing a dead path: a hook on every packet read from the machine
  (``Transport.packetizer.read_message``), so that any packet, not only a keepalive's
  reply, proves the path alive (:func:`on_every_packet`);
* tunnels: opening a ``direct-tcpip`` channel in two halves, handling its confirmation on the
  transport thread and taking the channel's DATA as it arrives (``Channel.in_buffer``), which
  brings a tunnel's time to first byte to ``ssh -L``'s (see :mod:`gpumagic.tunnel`).

Every private name used is listed in :data:`PRIVATE_NAMES` and checked once, at import, on a
real (unstarted) ``Transport`` and ``Channel`` (:func:`probe`).  When one is missing (a paramiko
release that changed them), or when the environment sets ``GPUMAGIC_PARAMIKO_PRIVATE=0``,
:data:`FAST` is False and every function here takes the public API instead: slower, still
correct (``tests/test_paramiko_door.py`` runs cells, sync and tunnels both ways).  No module
but this one may touch paramiko's private names.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from typing import Protocol

import paramiko
from paramiko.common import (CONNECTION_FAILED_CODE, MSG_CHANNEL_OPEN_FAILURE,
                             MSG_CHANNEL_OPEN_SUCCESS, cMSG_CHANNEL_OPEN)
from paramiko.common import cMSG_CHANNEL_DATA as _MSG_CHANNEL_DATA
from paramiko.common import cMSG_CHANNEL_WINDOW_ADJUST as _MSG_CHANNEL_WINDOW_ADJUST

#: Every private (or undocumented) attribute of paramiko that gpumagic uses, by owner.
PRIVATE_NAMES = {
    "Transport": ("_send_message", "_send_user_message", "_handler_table", "_channels",
                  "_next_channel", "_sanitize_window_size", "_sanitize_packet_size",
                  "clear_to_send", "clear_to_send_lock", "clear_to_send_timeout",
                  "channel_events", "channels_seen", "lock", "active", "saved_exception",
                  "banner_timeout", "handshake_timeout", "host_key", "packetizer"),
    "Channel": ("_send_eof", "_wait_for_send_window", "_check_add_window", "_set_transport",
                "_set_window", "in_buffer", "lock", "eof_sent", "eof_received", "closed",
                "out_window_size", "out_max_packet_size", "remote_chanid", "chanid",
                "status_event", "out_buffer_cv"),
    "Packetizer": ("read_message",),
}

#: Seconds to wait for a late channel confirmation that is being handled right now.
_LATE_ANSWER_WAIT = 5.0


def probe() -> list[str]:
    """The private names of :data:`PRIVATE_NAMES` that this paramiko lacks (``Owner.name``),
    found on a real ``Transport`` (never started) and ``Channel``; empty when all are there.

    Also checks that the transport's handler table holds the two channel-open handlers that
    :func:`request_channel` wraps, and that its channel table has ``get``/``put``/``delete``.
    """
    a, b = socket.socketpair()
    try:
        t = paramiko.Transport(a)
        objects = {"Transport": t, "Channel": paramiko.Channel(0),
                   "Packetizer": getattr(t, "packetizer", None)}
        missing = [f"{owner}.{name}" for owner, names in PRIVATE_NAMES.items()
                   for name in names if not hasattr(objects[owner], name)]
        table = getattr(t, "_handler_table", {})
        for msg in (MSG_CHANNEL_OPEN_SUCCESS, MSG_CHANNEL_OPEN_FAILURE):
            if msg not in table:
                missing.append(f"Transport._handler_table[{msg}]")
        channels = getattr(t, "_channels", None)
        for method in ("get", "put", "delete"):
            if not hasattr(channels, method):
                missing.append(f"Transport._channels.{method}")
        return missing
    finally:
        a.close()
        b.close()


#: What :func:`probe` found missing at import.
MISSING = probe()
#: True when gpumagic may use paramiko's private names (all present, not switched off).
FAST = not MISSING and os.environ.get("GPUMAGIC_PARAMIKO_PRIVATE", "1") != "0"


# -- sending on a channel without racing its close ----------------------------------------
#
# paramiko builds a channel's DATA or EOF message under the channel's lock but sends it after
# releasing the lock, while the transport thread answers the server's CLOSE with our CLOSE.
# A DATA or EOF that leaves after that CLOSE names a channel the server has already freed,
# and OpenSSH's sshd then drops the WHOLE connection ("ieof packet referred to nonexistent
# channel", channels.c channel_from_packet_id), killing every cell running on it.  Measured
# here: about one small request in 1000 when the browser closes as the server does.
# The functions below hold the transport's send lock from the "is the channel still open?"
# check until the message is on the wire, so a CLOSE can only follow them.  Lock order:
# transport.clear_to_send_lock, then channel.lock (paramiko never takes them the other way).
# (paramiko's recv can still send a WINDOW_ADJUST late; sshd only logs that one:
# channel_input_window_adjust, "Received window adjust for non-open channel".)

def never_wait_on_the_transport_thread(t: paramiko.Transport) -> None:
    """Make paramiko's own replies from its transport thread never wait for a key exchange.

    Paramiko answers a channel's CLOSE (``Channel._handle_close``) and a channel request
    that wants a reply (``_handle_request``: sshd's ``keepalive@openssh.com``, sent when
    ClientAliveInterval is set) from its transport thread through ``_send_user_message``,
    which waits while a key exchange runs, and only that thread can finish the exchange.
    A CLOSE that arrived during a re-key then stalled the whole connection for paramiko's
    30 s ``clear_to_send_timeout`` and killed it (measured with re-keys every 10 ms under
    tunnel traffic).  Such a reply now goes out from a short-lived thread once the exchange
    is done; the peer waits for it as for any reply.
    """
    if not FAST:
        return
    send_user_message = t._send_user_message

    def _send_user_message(data) -> None:
        if threading.current_thread() is not t:
            send_user_message(data)
            return
        if not t.active:
            return
        with t.clear_to_send_lock:  # no exchange can start while it is held
            if t.clear_to_send.is_set():
                t._send_message(data)
                return
        threading.Thread(target=_after_exchange, args=(data,), daemon=True,
                         name="gpumagic-after-rekey").start()

    def _after_exchange(data) -> None:
        try:
            send_user_message(data)  # waits for the exchange to end
        except (paramiko.SSHException, EOFError, OSError):
            pass  # the exchange failed: the connection is gone, and with it the channel

    t._send_user_message = _send_user_message


def _send_in_order(chan: paramiko.Channel, build, wait: bool = True) -> bool | None:
    """Send the message ``build()`` makes (called under the channel's lock) unless the
    channel is closed; False when it was closed.

    Waits like paramiko's ``Transport._send_user_message`` while a key exchange runs.  With
    ``wait=False`` (paramiko's transport thread, the only one that can finish a key
    exchange) it returns None at once instead.
    """
    t = chan.transport
    if wait:
        start = time.monotonic()
        while True:
            t.clear_to_send.wait(0.1)
            if not t.active:
                raise EOFError("the SSH connection is closed")
            t.clear_to_send_lock.acquire()
            if t.clear_to_send.is_set():
                break
            t.clear_to_send_lock.release()
            if time.monotonic() > start + t.clear_to_send_timeout:
                raise paramiko.SSHException("key exchange timed out waiting to send")
    else:
        # Under this lock no key exchange can start (paramiko clears clear_to_send under it).
        t.clear_to_send_lock.acquire()
        if not t.clear_to_send.is_set():
            t.clear_to_send_lock.release()
            return None
    try:
        with chan.lock:
            if chan.closed:
                return False
            m = build()
        if m is not None:
            t._send_message(m)
        return True
    finally:
        t.clear_to_send_lock.release()


def send_data_now(chan: paramiko.Channel, data: bytes) -> bool:
    """Send ``data`` as one CHANNEL_DATA message without waiting for anything, for
    paramiko's transport thread; never after the channel's CLOSE.

    Returns False, sending nothing, when it would have to wait: a key exchange runs, the
    channel's send window or the server's largest packet is smaller than ``data``, or the
    channel is closed or half-closed.  The caller then sends it from another thread.
    """
    if not FAST:
        return False
    sent = False

    def build():
        nonlocal sent
        n = len(data)
        if chan.eof_sent or n > chan.out_window_size or n > chan.out_max_packet_size - 64:
            return None
        chan.out_window_size -= n
        m = paramiko.Message()
        m.add_byte(_MSG_CHANNEL_DATA)
        m.add_int(chan.remote_chanid)
        m.add_string(data)
        sent = True
        return m

    _send_in_order(chan, build, wait=False)
    return sent


def sendall_ordered(chan: paramiko.Channel, data: bytes | memoryview) -> None:
    """``chan.sendall(data)`` that never sends after the channel's CLOSE.

    Raises
    ------
    OSError
        The channel was closed (by the remote side) before everything was sent.
    """
    if not FAST:
        chan.sendall(data)
        return
    view = memoryview(data)
    while view:
        with chan.lock:
            size = chan._wait_for_send_window(len(view))  # blocks while the window is 0
        if size == 0:
            raise OSError(errno.EPIPE, "the remote side closed the channel")
        chunk = bytes(view[:size])

        def build(chunk=chunk):
            m = paramiko.Message()
            m.add_byte(_MSG_CHANNEL_DATA)
            m.add_int(chan.remote_chanid)
            m.add_string(chunk)
            return m

        if not _send_in_order(chan, build):
            raise OSError(errno.EPIPE, "the remote side closed the channel")
        view = view[size:]


def send_some(chan: paramiko.Channel, data: bytes | memoryview) -> int:
    """Send as much of ``data`` as the channel's send window takes now, never waiting for
    more and never after the channel's CLOSE; the number of bytes sent (0: the window is
    shut).  Without :data:`FAST` it is paramiko's public ``send`` once ``send_ready()``.

    Raises
    ------
    OSError
        The channel is closed, or our EOF was sent.
    """
    if not chan.send_ready():  # the window is shut (True once closed: then it raises)
        return 0
    if not FAST:
        return chan.send(data)  # raises when closed; never waits: the window is open
    view = memoryview(data)
    sent = 0
    ended = False
    while sent < len(view):
        piece = 0

        def build():
            nonlocal piece, ended
            if chan.eof_sent:
                ended = True
                return None
            n = min(len(view) - sent, chan.out_window_size, chan.out_max_packet_size - 64)
            if n <= 0:
                return None
            chan.out_window_size -= n
            m = paramiko.Message()
            m.add_byte(_MSG_CHANNEL_DATA)
            m.add_int(chan.remote_chanid)
            m.add_string(bytes(view[sent:sent + n]))
            piece = n
            return m

        if not _send_in_order(chan, build) or (ended and not sent):
            raise OSError(errno.EPIPE, "the remote side closed the channel")
        if not piece:
            break
        sent += piece
    return sent


def send_window_adjust(chan: paramiko.Channel, nbytes: int, wait: bool = True) -> bool:
    """Give ``nbytes`` of the channel's receive window back to the server
    (CHANNEL_WINDOW_ADJUST, RFC 4254 section 5.2), never after the channel's CLOSE.

    For a reader that takes a channel's bytes without ``Channel.recv`` (which sends these
    itself): call it with what ``chan._check_add_window(n)`` returns when that is not 0.
    Returns False only with ``wait=False`` (paramiko's transport thread) while a key
    exchange runs: nothing was sent, and another thread must send it.
    """
    def build():
        m = paramiko.Message()
        m.add_byte(_MSG_CHANNEL_WINDOW_ADJUST)
        m.add_int(chan.remote_chanid)
        m.add_int(nbytes)
        return m

    return _send_in_order(chan, build, wait) is not None


def send_eof(chan: paramiko.Channel) -> None:
    """``chan.shutdown_write()`` that never sends the EOF after the channel's CLOSE.

    Without :data:`FAST` it is ``shutdown_write()`` unless the channel has closed or seen the
    remote's EOF: the remote can still close in between (a narrow window, which with sshd
    costs the whole connection), but the remote side gets its EOF and the output is kept.
    """
    if FAST:
        _send_in_order(chan, chan._send_eof)
    elif not (chan.closed or chan.eof_received):
        chan.shutdown_write()


# -- waiting on a channel without polling -----------------------------------------------

#: Seconds between looks at the channel on the public path (no event to wait on there).
_PUBLIC_POLL = 0.01


def wait_for_exit_status(chan: paramiko.Channel, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the channel's exit status; True once it is there.

    A reader needs this after the remote's EOF: paramiko leaves the channel's event pipe
    readable for good then, so poll(2) on ``fileno()`` returns at once until the status
    comes (a busy loop).  With :data:`FAST` it waits on the event paramiko sets when the
    status arrives (``Channel.status_event``); without, it looks every 10 ms.
    """
    if FAST:
        return chan.status_event.wait(timeout)
    deadline = time.monotonic() + timeout
    while not chan.exit_status_ready():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(_PUBLIC_POLL, left))
    return True


#: What :func:`wait_for_send_window` reports without :data:`FAST` once the channel can send:
#: paramiko's public API does not say how much, and ``sendall`` waits for the rest.
PUBLIC_WINDOW = 65536


def wait_for_send_window(chan: paramiko.Channel, timeout: float) -> int | None:
    """Bytes the server lets ``chan`` send now (its send window, RFC 4254 section 5.2),
    waiting up to ``timeout`` seconds while that is 0: 0 when it stayed 0, None when the
    channel can send no more (closed, or our EOF sent).

    With :data:`FAST` the wait is on paramiko's own condition for a window adjust
    (``Channel.out_buffer_cv``).  Without, it looks at ``send_ready()`` every 10 ms and
    reports :data:`PUBLIC_WINDOW` once that is true (a send of more may then wait).
    """
    if FAST:
        with chan.lock:
            if chan.out_window_size == 0 and not (chan.closed or chan.eof_sent) and timeout > 0:
                chan.out_buffer_cv.wait(timeout)
            if chan.closed or chan.eof_sent:
                return None
            return chan.out_window_size
    deadline = time.monotonic() + timeout
    while True:
        if chan.closed:
            return None
        if chan.send_ready():
            return PUBLIC_WINDOW
        left = deadline - time.monotonic()
        if left <= 0:
            return 0
        time.sleep(min(_PUBLIC_POLL, left))


# -- tunnel channels: opened in two halves, confirmed on the transport thread ------------

def _hook_transport(transport: paramiko.Transport) -> dict:
    """Once per transport, let a tunnel channel's OPEN_CONFIRMATION be handled on the
    transport thread itself (the opener's ``opened``), before the thread that opens the
    channel is woken: the first request then leaves without a thread handoff, as with
    ``ssh -L``, and no DATA can reach the channel before its forward is in place.

    A refusal (OPEN_FAILURE) is kept on its forward (``fwd.refused``): paramiko keeps one
    exception per transport, so refusals that arrive together would take each other's.

    Uses paramiko's per-instance handler table (``Transport._handler_table``, which it keeps
    per instance "for easier per-instance manipulation").  Returns the forwards whose
    channels are being opened, by channel number (filled by :func:`request_channel`).
    """
    pending = vars(transport).get("_gpumagic_opening")
    if pending is not None:
        return pending
    pending = {}
    on_success = transport._handler_table[MSG_CHANNEL_OPEN_SUCCESS]
    on_failure = transport._handler_table[MSG_CHANNEL_OPEN_FAILURE]

    def _open_success(m: paramiko.Message) -> None:  # the transport thread
        chanid = m.get_int()
        m.rewind()
        waiter = None
        with transport.lock:  # against _await_channel giving up
            fwd = pending.pop(chanid, None)
            if fwd is not None and fwd.abandoned is None:
                # The opening thread waits on this event: wake it after opened().
                waiter = transport.channel_events.get(chanid)
                if waiter is not None:
                    transport.channel_events[chanid] = threading.Event()
        if fwd is None:
            on_success(m)
            return
        if fwd.abandoned is not None:  # too late: close it, or it stays open on the machine
            on_success(m)
            # Not the tunnel's workers: they may be gone (stop()).  Closing waits for sending.
            threading.Thread(target=close_without_eof, args=(fwd.abandoned,), daemon=True,
                             name="gpumagic-tunnel-late-close").start()
            return
        try:
            on_success(m)
            chan = transport._channels.get(chanid)
            if chan is not None:
                fwd.opened(chan)
        finally:
            if waiter is not None:
                waiter.set()

    def _open_failure(m: paramiko.Message) -> None:  # the transport thread
        chanid, reason, text = m.get_int(), m.get_int(), m.get_text()
        m.rewind()
        with transport.lock:
            fwd = pending.pop(chanid, None)
        if fwd is not None:  # before the waiter wakes (on_failure wakes it)
            fwd.refused = paramiko.ChannelException(
                reason, text or CONNECTION_FAILED_CODE.get(reason, f"reason {reason}"))
        on_failure(m)

    transport._handler_table[MSG_CHANNEL_OPEN_SUCCESS] = _open_success
    transport._handler_table[MSG_CHANNEL_OPEN_FAILURE] = _open_failure
    transport._gpumagic_opening = pending
    return pending


def request_channel(transport: paramiko.Transport, fwd: Opener,
                     dest: tuple[str, int], origin: tuple[str, int], window_size: int,
                     max_packet_size: int) -> tuple[paramiko.Channel, threading.Event]:
    """Send CHANNEL_OPEN for a ``direct-tcpip`` channel (RFC 4254 section 7.2) and return
    without waiting: the first half of paramiko's ``Transport.open_channel``, so the caller
    can do other work (hand listening on) while the machine connects to ``dest``.  Wait for
    the answer with :func:`await_channel`, holding on to the channel meanwhile (paramiko's
    channel table keeps only a weak reference).

    Raises
    ------
    paramiko.SSHException
        The SSH connection is not active.
    """
    if not transport.active:
        raise paramiko.SSHException("SSH session not active")
    pending = _hook_transport(transport)
    m = paramiko.Message()
    with transport.lock:
        window_size = transport._sanitize_window_size(window_size)
        max_packet_size = transport._sanitize_packet_size(max_packet_size)
        chanid = transport._next_channel()
        m.add_byte(cMSG_CHANNEL_OPEN)
        m.add_string("direct-tcpip")
        m.add_int(chanid)
        m.add_int(window_size)
        m.add_int(max_packet_size)
        m.add_string(dest[0])
        m.add_int(dest[1])
        m.add_string(origin[0])
        m.add_int(origin[1])
        chan = paramiko.Channel(chanid)
        transport._channels.put(chanid, chan)
        transport.channel_events[chanid] = event = threading.Event()
        transport.channels_seen[chanid] = True
        chan._set_transport(transport)
        chan._set_window(window_size, max_packet_size)
        pending[chanid] = fwd
    try:
        transport._send_user_message(m)
    except BaseException:
        _forget_channel(transport, chanid)
        raise
    return chan, event


def await_channel(transport: paramiko.Transport, fwd: Opener,
                   chan: paramiko.Channel, event: threading.Event,
                   timeout: float) -> paramiko.Channel | None:
    """The second half of ``open_channel``: wait up to ``timeout`` seconds for the answer to
    :func:`request_channel`.  Returns the channel (which may have closed again since), or
    None when the forward was aborted (``stop()``) first.  A channel given up on stays
    registered, so that a late confirmation closes it on the machine too.

    Raises
    ------
    paramiko.ChannelException, paramiko.SSHException, TimeoutError
        As :func:`open_direct_tcpip` (the one caller) says.
    """
    deadline = time.monotonic() + timeout
    while not event.wait(0.1):
        if not transport.active:
            break
        late = time.monotonic() > deadline
        if fwd.closed or late:
            with transport.lock:
                gave_up = chan.chanid in _hook_transport(transport)  # no answer handled yet
                if gave_up:
                    fwd.abandoned = chan
            if gave_up:
                if late and not fwd.closed:
                    raise TimeoutError(f"no answer to opening a channel in {timeout:g} s")
                return None
            event.wait(_LATE_ANSWER_WAIT)  # the answer is being handled now: it wakes us at once
            break
    if fwd.chan is chan:
        return chan  # confirmed: opened() ran
    _forget_channel(transport, chan.chanid)
    saved = transport.get_exception()  # clears paramiko's copy of a refusal
    raise fwd.refused or saved or paramiko.SSHException("Unable to open channel.")


def close_without_eof(chan: paramiko.Channel) -> None:
    """Close a channel, ignoring a connection that is already gone; never on the transport
    thread (sending may wait for a key exchange)."""
    try:
        if FAST:
            with chan.lock:
                # CLOSE alone ends a channel (RFC 4254 section 5.3): paramiko would send an
                # EOF just before it, one more packet for both sides to handle.
                chan.eof_sent = True
        chan.close()
    except (EOFError, OSError, paramiko.SSHException):
        pass  # the SSH connection is gone, and with it the channel


def _forget_channel(transport: paramiko.Transport, chanid: int) -> None:
    """Drop a channel that never opened from paramiko's tables and ours."""
    with transport.lock:
        transport._channels.delete(chanid)
        transport.channel_events.pop(chanid, None)
    _hook_transport(transport).pop(chanid, None)


class Opener(Protocol):
    """What :func:`request_channel` needs of the object a channel is opened for."""

    closed: bool  # the caller gave up (stop())
    chan: paramiko.Channel | None  # set by opened()
    refused: paramiko.ChannelException | None
    abandoned: paramiko.Channel | None

    def opened(self, chan: paramiko.Channel) -> None: ...


def key_exchange_running(transport: paramiko.Transport) -> bool:
    """True while a key exchange holds back sending on ``transport`` (sending waits for
    it); False when it cannot be told (without :data:`FAST`)."""
    return FAST and not transport.clear_to_send.is_set()


def become_input_buffer(chan: paramiko.Channel, reader) -> None:
    """Make ``reader`` the channel's input buffer (``Channel.in_buffer``): paramiko's
    transport thread then calls ``reader.feed(bytes)`` for each DATA message, ``close()`` at
    the remote's EOF or CLOSE, and ``len()``/``read_ready()``; ``Channel.recv`` is never
    used on it.  Only with :data:`FAST`."""
    with chan.lock:
        chan.in_buffer = reader


def window_to_give(chan: paramiko.Channel, nbytes: int) -> int:
    """For a reader that takes a channel's bytes without ``Channel.recv``: account
    ``nbytes`` consumed, and return the window to give back now (0: not yet; paramiko gives
    it back in batches of a tenth of the window), for :func:`send_window_adjust`."""
    return chan._check_add_window(nbytes)


def transport_dropped(transport: paramiko.Transport | None) -> bool:
    """True when the SSH connection under a channel died (paramiko unlinks the channels
    after recording the error in ``saved_exception`` but before clearing ``active``)."""
    if transport is None or not transport.is_active():
        return True
    saved = getattr(transport, "saved_exception", None)  # a failed open parks one here, briefly
    return saved is not None and not isinstance(saved, paramiko.ChannelException)


def open_direct_tcpip(transport: paramiko.Transport, opener: Opener, dest: tuple[str, int],
                      origin: tuple[str, int], window_size: int, max_packet_size: int,
                      timeout: float, hand_off=None) -> paramiko.Channel | None:
    """Open a ``direct-tcpip`` channel (RFC 4254 section 7.2) to ``dest`` for ``opener``.

    With :data:`FAST`, ``opener.opened(chan)`` runs on paramiko's transport thread when the
    confirmation arrives, before this call returns (:func:`request_channel`,
    :func:`await_channel`), and ``hand_off()`` is called once CHANNEL_OPEN is sent.  Without
    it, ``hand_off()`` is called first, then paramiko's public ``open_channel`` waits and
    ``opener.opened(chan)`` runs on this thread.  Returns the channel, or None when the opener
    was closed (``stop()``) while the channel was opening (the channel is then closed).

    Raises
    ------
    paramiko.ChannelException
        The server refused (OPEN_FAILURE: nothing listens at the target, or it is forbidden).
    paramiko.SSHException
        The SSH connection ended.
    TimeoutError
        No answer came within ``timeout`` seconds (the machine's connect to the target hangs).
    """
    if FAST:
        chan, answered = request_channel(transport, opener, dest, origin, window_size,
                                         max_packet_size)
        if hand_off is not None:
            hand_off()
        return await_channel(transport, opener, chan, answered, timeout)
    if hand_off is not None:
        hand_off()
    chan = open_channel_public(transport, dest, origin, window_size, max_packet_size, timeout)
    if opener.closed:
        close_without_eof(chan)
        return None
    opener.opened(chan)
    return chan


def open_channel_public(transport: paramiko.Transport, dest: tuple[str, int],
                        origin: tuple[str, int], window_size: int, max_packet_size: int,
                        timeout: float) -> paramiko.Channel:
    """Open a ``direct-tcpip`` channel through paramiko's public ``Transport.open_channel``
    (the path taken without :data:`FAST`), waiting up to ``timeout`` seconds.

    Raises
    ------
    paramiko.ChannelException
        The server refused (nothing listens at the target, or it is forbidden).
    TimeoutError
        No answer came in time.
    paramiko.SSHException
        The SSH connection ended.
    """
    try:
        return transport.open_channel("direct-tcpip", dest, origin, window_size=window_size,
                                      max_packet_size=max_packet_size, timeout=timeout)
    except paramiko.ChannelException:
        raise
    except paramiko.SSHException as e:
        if transport.is_active() and "timeout" in str(e).lower():
            raise TimeoutError(f"no answer to opening a channel in {timeout:g} s") from e
        if transport.is_active():
            # paramiko keeps one refusal per transport: a parallel open may have taken ours.
            raise paramiko.ChannelException(2, CONNECTION_FAILED_CODE[2]) from e
        raise


# -- hearing from the machine --------------------------------------------------------------

def on_every_packet(transport: paramiko.Transport, heard) -> bool:
    """Call ``heard()`` on paramiko's transport thread after every packet read from the
    machine (wrapping this transport's ``packetizer.read_message``), as OpenSSH counts any
    packet, not only a keepalive's reply, as a sign of life (``ServerAliveInterval``).
    ``heard`` must be quick and must not raise.

    Returns False, hooking nothing, without :data:`FAST`: the caller then hears only the
    replies to its own probes.
    """
    if not FAST:
        return False
    packetizer = transport.packetizer
    read_message = packetizer.read_message

    def _read_message():
        result = read_message()
        heard()
        return result

    packetizer.read_message = _read_message
    return True
