"""One SSH connection: open/close, host-key policy, keys, ProxyJump, keepalive, reconnect.

A :class:`Connection` is lazy: it opens on first use and re-opens by itself after the link
dropped (``ensure_open``).  Host keys follow OpenSSH's ``known_hosts`` rules and are never
accepted silently.  Private keys are read like OpenSSH reads them (refused when readable by
group or others; a passphrase is asked with ``getpass`` and kept only in memory).
"""

from __future__ import annotations

import errno
import getpass
import logging
import os
import select
import socket
import stat
import threading
import time
from dataclasses import replace
from typing import Callable

import paramiko
from paramiko.common import cMSG_CHANNEL_DATA as _MSG_CHANNEL_DATA
from paramiko.common import cMSG_CHANNEL_WINDOW_ADJUST as _MSG_CHANNEL_WINDOW_ADJUST

from . import known_hosts
from .errors import (
    AuthenticationFailed,
    ChangedHostKey,
    ConnectionLost,
    ConnectionRefused,
    ConnectTimeout,
    GpumagicError,
    HostNotFound,
    InsecureKeyFile,
    NotConnected,
    UnknownHostKey,
    WrongPassphrase,
)
from .hosts import HostSpec, default_identity_files, resolve

log = logging.getLogger(__name__)

#: Flow-control window and packet size asked of the server (bytes).  A larger window than
#: paramiko's default keeps bulk transfers (sync, tunnels) from stalling on round trips.
WINDOW_SIZE = 8 * 1024 * 1024
MAX_PACKET_SIZE = 32768

#: Ciphers offered first: AES-GCM (RFC 5647, OpenSSH's ``@openssh.com`` variants) encrypts
#: and authenticates in one pass inside OpenSSL, where CTR + HMAC costs paramiko a second,
#: Python-driven pass per packet; tunnels and transfers measured about 1.4x faster with it.
PREFERRED_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")

PassphrasePrompt = Callable[[str], str]


def _default_prompt(path: str) -> str:
    return getpass.getpass(f"Passphrase for key {path}: ")


def check_key_permissions(path: str) -> None:
    """Refuse a private key file that group or others can read, as OpenSSH does.

    Raises
    ------
    InsecureKeyFile
        With the ``chmod 600`` fix.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if os.name == "posix" and stat.S_IMODE(mode) & 0o077:
        raise InsecureKeyFile(
            f"private key {path} is readable by others (mode {stat.S_IMODE(mode):04o}); "
            "OpenSSH refuses it and so does gpumagic",
            f"run: chmod 600 {path}",
        )


def load_private_key(path: str, prompt: PassphrasePrompt = _default_prompt) -> paramiko.PKey:
    """Load a private key file (OpenSSH or PEM format), asking for a passphrase if needed.

    Raises
    ------
    InsecureKeyFile
        Mode allows group/others access.
    WrongPassphrase
        The passphrase does not decrypt the key (names the file).
    GpumagicError
        The file is not a private key gpumagic can read.
    """
    check_key_permissions(path)
    try:
        return paramiko.PKey.from_path(path)
    except paramiko.PasswordRequiredException:
        pass
    except FileNotFoundError:
        raise
    except (paramiko.SSHException, ValueError, TypeError) as e:
        # cryptography says "Key is password-protected, but password was not provided."
        if "password" not in str(e).lower():
            raise GpumagicError(f"cannot read private key {path}: {e}",
                                "point IdentityFile (or -i) at an OpenSSH private key file")
    passphrase = prompt(path)
    try:
        return paramiko.PKey.from_path(path, password=passphrase.encode())
    except (paramiko.SSHException, ValueError, TypeError):
        raise WrongPassphrase(f"wrong passphrase for key {path}",
                              "connect again and type the passphrase of that key file")


class Connection:
    """One SSH connection to one machine (possibly through ProxyJump hops).

    Parameters
    ----------
    spec : HostSpec
        Where and how to connect (see :func:`gpumagic.hosts.resolve`).
    trust_new_host : bool
        Add an unknown host's key to known_hosts (OpenSSH format) instead of refusing.
        A *changed* key is always refused.
    passphrase_prompt : callable
        ``prompt(path) -> str`` for encrypted keys; default asks with ``getpass``.
    home : str, optional
        The local home directory whose ``~/.ssh`` is read (default ``$HOME``).
    use_agent : bool
        Offer ssh-agent keys (``$SSH_AUTH_SOCK``) unless ``IdentitiesOnly yes``.

    Use as a context manager, or call :meth:`open` / :meth:`close` (safe to call twice).
    """

    def __init__(self, spec: HostSpec, *, trust_new_host: bool = False,
                 passphrase_prompt: PassphrasePrompt = _default_prompt,
                 home: str | None = None, use_agent: bool = True,
                 via: "Connection | None" = None):
        self.spec = spec
        self.via = via
        self.trust_new_host = trust_new_host
        self.passphrase_prompt = passphrase_prompt
        self.home = home
        self.use_agent = use_agent
        self.transport: paramiko.Transport | None = None
        self._hops: list[Connection] = []
        self._keys: dict[str, paramiko.PKey] = {}  # decrypted keys, in memory only
        self._lock = threading.RLock()
        self._keepalive_stop = threading.Event()
        self._lost_reason: str | None = None
        self.opened_count = 0
        #: Messages for the user from the last open (e.g. a host key that was trusted).
        self.notes: list[str] = []
        #: (message, hint) when this connection must not open again (a stopped sandbox).
        self.refuse_reopen: tuple[str, str] | None = None

    # -- life cycle -------------------------------------------------------------------

    @property
    def is_connected(self) -> bool:
        """True while the SSH transport is up and authenticated."""
        t = self.transport
        return bool(t is not None and t.is_active() and t.is_authenticated())

    @property
    def lost_reason(self) -> str | None:
        """Why the last transport ended on its own (keepalive timeout, reset), if it did."""
        return self._lost_reason

    def __enter__(self) -> "Connection":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def ensure_open(self) -> "Connection":
        """Open the connection unless it is already up (re-opens after a drop)."""
        with self._lock:
            if not self.is_connected:
                self._teardown()
                self.open()
        return self

    def open(self) -> "Connection":
        """Connect, check the host key, authenticate, start keepalives.

        Raises
        ------
        HostNotFound, ConnectionRefused, ConnectTimeout, UnknownHostKey, ChangedHostKey,
        AuthenticationFailed, WrongPassphrase, InsecureKeyFile
            Each with a one-line hint.
        """
        with self._lock:
            if self.is_connected:
                return self
            if self.refuse_reopen is not None:
                raise NotConnected(*self.refuse_reopen)
            sock = self._open_socket()
            t = paramiko.Transport(sock, default_window_size=WINDOW_SIZE,
                                   default_max_packet_size=MAX_PACKET_SIZE)
            # paramiko logs its own tracebacks (e.g. "Error reading SSH protocol banner");
            # gpumagic reports every failure itself, so they go under its silent logger.
            t.set_log_channel("gpumagic.ssh")
            _never_wait_on_the_transport_thread(t)
            try:
                self._prefer_fast_ciphers(t)
                self._prefer_known_key_types(t)
                t.banner_timeout = t.handshake_timeout = self.spec.connect_timeout
                started = time.monotonic()
                try:
                    # start_client returns silently when its own timeout passes first.
                    t.start_client(timeout=self.spec.connect_timeout + 1)
                    handshake_done = t.is_active() and getattr(t, "host_key", None) is not None
                    error = None
                except (paramiko.SSHException, EOFError, OSError) as e:
                    handshake_done, error = False, e
                if not handshake_done:
                    raise self._handshake_error(error, time.monotonic() - started)
                self._check_host_key(t)
                self._authenticate(t)
            except BaseException:
                t.close()
                raise
            self.transport = t
            self._lost_reason = None
            self.opened_count += 1
            self._start_keepalive(t)
            return self

    def _handshake_error(self, error: Exception | None, seconds: float) -> GpumagicError:
        address, limit = self.spec.address, self.spec.connect_timeout
        hint = "check that this port is the machine's SSH port (not a web or Jupyter port)"
        if seconds < limit - 0.5 and (error is None or "banner" in str(error).lower()
                                      or isinstance(error, EOFError)):
            return ConnectionRefused(
                f"{address} is not an SSH server: it closed the connection without an SSH greeting", hint)
        if error is None or "banner" in str(error).lower() or isinstance(error, (socket.timeout, TimeoutError)):
            return ConnectTimeout(
                f"{address} accepted the connection but the SSH handshake did not finish within {limit:g} s",
                hint)
        return ConnectionLost(f"SSH handshake with {address} failed: {error}",
                              "check that the port is the machine's SSH port and that sshd is running there")

    def close(self) -> None:
        """Close the connection and every ProxyJump hop; safe to call more than once."""
        with self._lock:
            self._teardown()

    def _teardown(self) -> None:
        self._keepalive_stop.set()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        for hop in reversed(self._hops):
            hop.close()
        self._hops = []

    # -- socket and hops --------------------------------------------------------------

    def _open_socket(self):
        spec = self.spec
        if self.via is not None:
            return _direct(self.via, spec)
        if spec.proxy_jump:
            return self._open_via_jumps()
        try:
            sock = socket.create_connection((spec.hostname, spec.port), timeout=spec.connect_timeout)
        except (socket.gaierror, UnicodeError):  # UnicodeError: a name IDNA cannot encode (ü..x)
            raise HostNotFound(
                f"cannot find host {spec.hostname!r}: it is not a ~/.ssh/config alias and DNS does not know it",
                "check the spelling, or add a Host block (`%gpu add-host`) or use user@IP:port",
            )
        except ConnectionRefusedError:
            raise ConnectionRefused(
                f"connection refused by {spec.address}: nothing accepts SSH on that port",
                "check the port (the platform's ssh command shows it after -p) and that the instance is running",
            )
        except (socket.timeout, TimeoutError):
            raise ConnectTimeout(
                f"no answer from {spec.address} within {spec.connect_timeout:g} s",
                "check the address and that the instance is running; a firewall may drop the port",
            )
        except OSError as e:
            raise ConnectionRefused(f"cannot reach {spec.address}: {e.strerror or e}",
                                    "check the address and your network")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        return sock

    def _open_via_jumps(self):
        """Connect hop by hop in the order written; each hop is resolved like a target."""
        prev: Connection | None = None
        for hop_text in self.spec.proxy_jump:
            # Inside a chain a hop's own ProxyJump is not followed (as OpenSSH does for -J a,b).
            hop_spec = replace(resolve(hop_text, home=self.home), proxy_jump=())
            hop = Connection(hop_spec, trust_new_host=self.trust_new_host,
                             passphrase_prompt=self.passphrase_prompt, home=self.home,
                             use_agent=self.use_agent, via=prev)
            hop._keys = self._keys
            hop.open()
            self._hops.append(hop)
            prev = hop
        assert prev is not None
        return _direct(prev, self.spec)

    # -- host keys --------------------------------------------------------------------

    @staticmethod
    def _prefer_fast_ciphers(t: paramiko.Transport) -> None:
        opts = t.get_security_options()
        ciphers = list(opts.ciphers)
        opts.ciphers = tuple([c for c in PREFERRED_CIPHERS if c in ciphers]
                             + [c for c in ciphers if c not in PREFERRED_CIPHERS])

    def _prefer_known_key_types(self, t: paramiko.Transport) -> None:
        stored = known_hosts.lookup(self.spec.known_hosts, self.spec.hostname, self.spec.port)
        if not stored:
            return
        opts = t.get_security_options()
        want = [k.get_name() for k in stored]
        types = list(opts.key_types)
        opts.key_types = tuple([k for k in types if k in want] + [k for k in types if k not in want])

    def _check_host_key(self, t: paramiko.Transport) -> None:
        spec = self.spec
        key = t.get_remote_server_key()
        stored = known_hosts.lookup(spec.known_hosts, spec.hostname, spec.port)
        fp = known_hosts.fingerprint(key)
        same_type = [k for k in stored if k.get_name() == key.get_name()]
        if any(k == key for k in same_type):
            return
        name = f"{spec.hostname}:{spec.port}"
        if same_type:
            raise ChangedHostKey(
                f"the host key of {name} has CHANGED (now {key.get_name()} {fp}); refusing to connect",
                f"if you rebuilt or re-rented the instance run `%gpu forget {name}`, then connect again; "
                "otherwise someone may be intercepting the connection",
                host=name, fingerprint=fp,
            )
        if self.trust_new_host:
            known_hosts.add(spec.known_hosts, spec.hostname, spec.port, key)
            self.notes.append(f"trusted new host {spec.known_hosts_name}: added its {key.get_name()} "
                              f"key {fp} to {spec.known_hosts}")
            return
        raise UnknownHostKey(
            f"{name} is not a known host; its {key.get_name()} key fingerprint is {fp}",
            f"if that matches your machine, connect again with --trust-new-host "
            f"(e.g. `%gpu connect {spec.alias} --trust-new-host`)",
            host=name, fingerprint=fp,
        )

    # -- authentication ---------------------------------------------------------------

    def _candidate_keys(self):
        """Yield (label, loader) pairs in OpenSSH's order: agent, IdentityFile, defaults."""
        spec = self.spec
        if self.use_agent and not spec.identities_only and os.environ.get("SSH_AUTH_SOCK"):
            try:
                for k in paramiko.Agent().get_keys():
                    yield f"agent key {known_hosts.fingerprint(k)}", (lambda k=k: k)
            except Exception:  # a broken agent socket must not stop file keys
                pass
        files = list(spec.identity_files)
        if not spec.identities_only or not files:
            files += [f for f in default_identity_files(self.home) if f not in files]
        for path in files:
            if not os.path.exists(path):
                continue
            yield path, (lambda p=path: self._load_key(p))

    def _load_key(self, path: str) -> paramiko.PKey:
        if path not in self._keys:
            self._keys[path] = load_private_key(path, self.passphrase_prompt)
        return self._keys[path]

    def _authenticate(self, t: paramiko.Transport) -> None:
        spec = self.spec
        tried = []
        for label, loader in self._candidate_keys():
            key = loader()
            tried.append(label)
            try:
                t.auth_publickey(spec.user, key)
            except paramiko.BadAuthenticationType as e:
                raise AuthenticationFailed(
                    f"{spec.user}@{spec.address} does not accept key logins (it allows: {', '.join(e.allowed_types)})",
                    f"install your public key once with `%gpu install-key {spec.user}@{spec.address}`",
                )
            except paramiko.AuthenticationException:
                continue
            except (paramiko.SSHException, EOFError, OSError) as e:
                raise ConnectionLost(f"connection to {spec.address} dropped during login: {e}",
                                     "connect again; if it repeats, check the machine's sshd")
            if t.is_authenticated():
                return
        keys = ", ".join(tried) if tried else "none (no IdentityFile, no ~/.ssh/id_* key, no agent)"
        raise AuthenticationFailed(
            f"{spec.user}@{spec.address} refused every key offered; keys tried: {keys}",
            f"check the user name ({spec.user!r}) and that your public key is in "
            f"~/.ssh/authorized_keys on the machine, or pass the right key with -i",
        )

    # -- keepalive --------------------------------------------------------------------

    def _start_keepalive(self, t: paramiko.Transport) -> None:
        interval = self.spec.server_alive_interval
        self._keepalive_stop = stop = threading.Event()
        if interval <= 0:
            return
        limit = interval * max(1, self.spec.server_alive_count_max)

        def ping_loop():
            while not stop.wait(interval):
                if not t.is_active():
                    return
                answered = threading.Event()

                def ping():
                    try:
                        t.global_request("keepalive@openssh.com", wait=True)
                    finally:
                        answered.set()

                threading.Thread(target=ping, daemon=True, name="gpumagic-ping").start()
                if not answered.wait(limit) and not stop.is_set():
                    self._lost_reason = (f"{self.spec.address} did not answer keepalives for "
                                         f"{limit:g} s (ServerAliveInterval x ServerAliveCountMax)")
                    t.close()
                    return

        threading.Thread(target=ping_loop, daemon=True, name="gpumagic-keepalive").start()

    # -- channels ---------------------------------------------------------------------

    def open_session(self) -> paramiko.Channel:
        """A new session channel (re-opening the connection first if it dropped).

        Raises
        ------
        ConnectionLost
            When no channel can be opened even on a fresh connection.
        """
        self.ensure_open()
        assert self.transport is not None
        try:
            return self.transport.open_session(timeout=self.spec.connect_timeout)
        except (paramiko.SSHException, EOFError, OSError):
            # The transport looked alive but was not: reconnect once.
            self.close()
            self.ensure_open()
            try:
                return self.transport.open_session(timeout=self.spec.connect_timeout)
            except (paramiko.SSHException, EOFError, OSError) as e:
                raise ConnectionLost(f"cannot open a channel to {self.spec.address}: {e}",
                                     "run `%gpu connect` again")

    def __repr__(self) -> str:
        state = "connected" if self.is_connected else "closed"
        return f"<Connection {self.spec.user}@{self.spec.address} {state}>"


def _direct(via: Connection, spec: HostSpec):
    """A ``direct-tcpip`` channel from ``via`` to ``spec``'s host and port (one ProxyJump hop)."""
    assert via.transport is not None
    try:
        return via.transport.open_channel(
            "direct-tcpip", (spec.hostname, spec.port), ("127.0.0.1", 0),
            timeout=spec.connect_timeout,
            window_size=WINDOW_SIZE, max_packet_size=MAX_PACKET_SIZE,
        )
    except paramiko.ChannelException as e:
        raise ConnectionRefused(
            f"jump host {via.spec.address} could not reach {spec.address}: {e.text or e}",
            "check HostName and Port of the target as the jump host sees them",
        )
    except (paramiko.SSHException, EOFError, OSError) as e:
        raise ConnectionLost(f"jump host {via.spec.address} dropped: {e}", "connect again")


def wait_readable(chan: paramiko.Channel, timeout: float) -> None:
    """Block until ``chan`` has data or EOF, or ``timeout`` seconds pass.

    Uses poll(2) where it exists: select(2) fails once the process holds more than 1024
    file descriptors, which a long-running notebook kernel can reach.
    """
    if hasattr(select, "poll"):
        p = select.poll()
        p.register(chan.fileno(), select.POLLIN)
        p.poll(timeout * 1000)
    else:  # Windows: select works on sockets there, without the 1024 limit
        select.select([chan], [], [], timeout)


# -- sending on a channel that the other side may be closing ---------------------------------

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

_ORDERED = (all(hasattr(paramiko.Transport, a) for a in ("_send_message", "_send_user_message"))
            and all(hasattr(paramiko.Channel, a) for a in ("_send_eof", "_wait_for_send_window")))


def _never_wait_on_the_transport_thread(t: paramiko.Transport) -> None:
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
    if not _ORDERED:
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
    if not _ORDERED:
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
    if not _ORDERED:
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
    """``chan.shutdown_write()`` that never sends the EOF after the channel's CLOSE."""
    if _ORDERED:
        _send_in_order(chan, chan._send_eof)
    else:  # no safe EOF without paramiko's internals: close instead (loses half-close)
        chan.close()
