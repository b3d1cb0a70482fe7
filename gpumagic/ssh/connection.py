"""One SSH connection: open/close, host-key policy, keys, ProxyJump, keepalive, reconnect.

A :class:`Connection` is lazy: it opens on first use and re-opens by itself after the link
dropped (``ensure_open``), or when the path went dead without a word (``ensure_alive``: a
roam, a NAT that forgot the connection; see :class:`_Path` for how that is noticed).  Host keys follow OpenSSH's ``known_hosts`` rules and are never
accepted silently.  Private keys are read like OpenSSH reads them (refused when readable by
group or others; a passphrase is asked with ``getpass`` and kept only in memory).
"""

from __future__ import annotations

import base64
import getpass
import io
import logging
import os
import contextlib
import select
import socket
import stat
import struct
import threading
import time
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import paramiko

from . import _paramiko, known_hosts
from ..errors import (AuthenticationFailed, ChangedHostKey, ConfigError, ConnectionLost, ConnectionRefused, ConnectTimeout, GpumagicError, HostNotFound, InsecureKeyFile, NotConnected, RevokedHostKey, UnknownHostKey, WrongPassphrase)
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

# -- noticing a dead path (see _Path) ------------------------------------------------------
#: Seconds without a packet from the machine after which a path must answer a probe before
#: something new is sent on it (:meth:`Connection.ensure_alive`), within max(:data:`REQUEST_WAIT`,
#: 10 RTT).
QUIET_BEFORE_PROBE = 2.0
#: Fewest seconds a transfer's probe may take before its path counts as dead, max(this, 10 RTT)
#: (:meth:`Connection.in_flight` ``quick``: a sync, which resumes by itself).
ALIVE_WAIT = 3.0
#: A spare connection starts when a probe got no answer for max(this, 4 RTT) seconds.
SPARE_AFTER = 0.5
#: While work is in flight (a running cell: :meth:`Connection.in_flight`), a probe goes out
#: after this many seconds without a packet...
BUSY_PROBE_AFTER = 1.0
#: ...and the path is declared dead when nothing at all came for this many seconds after it.
BUSY_DEAD_AFTER = 6.5
#: A request just sent (a cell, a session request: :meth:`Connection.in_flight`), and the probe
#: of a quiet path before one (:meth:`Connection.ensure_alive`), must see a packet come back
#: within max(this, 10 RTT), or the path counts as dead.  A probe goes out
#: when it waited max(:data:`SPARE_AFTER`, 4 RTT), and a spare connection is opened side by
#: side at twice that, so that the cell goes on over it at once (a roam costs seconds, at
#: whatever moment the cell was sent after it).
REQUEST_WAIT = 2.0
#: Seconds between looks of the watch thread.
_TICK = 0.25
#: A look this much later than due means this process did not run meanwhile (SIGSTOP, the
#: laptop slept): the machine's silence in that time proves nothing.
_GAP = 2.0


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


def public_blob(path: str) -> bytes | None:
    """The public key of a private key file, without its passphrase, as OpenSSH finds it to
    match an agent's keys: ``PATH.pub``, or the clear public part of an ``openssh-key-v1``
    file; None where neither is there (an old PEM file without its ``.pub``)."""
    try:
        with open(path + ".pub", encoding="utf-8", errors="replace") as f:
            return base64.b64decode(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        pass
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            text = f.read()
        begin, end = "-----BEGIN OPENSSH PRIVATE KEY-----", "-----END OPENSSH PRIVATE KEY-----"
        data = base64.b64decode("".join(text[text.index(begin) + len(begin):text.index(end)].split()))
        magic = b"openssh-key-v1\0"
        if not data.startswith(magic):
            return None
        at = len(magic)
        for _ in range(3):  # ciphername, kdfname, kdfoptions
            at += 4 + struct.unpack(">I", data[at:at + 4])[0]
        at += 4  # the number of keys
        n = struct.unpack(">I", data[at:at + 4])[0]
        return data[at + 4:at + 4 + n] or None
    except (OSError, ValueError, struct.error):
        return None


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
        return _key_from_path(path)
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
        return _key_from_path(path, passphrase.encode())
    except (paramiko.SSHException, ValueError, TypeError):
        raise WrongPassphrase(f"wrong passphrase for key {path}",
                              "connect again and type the passphrase of that key file")


def _key_from_path(path: str, password: bytes | None = None) -> paramiko.PKey:
    """``paramiko.PKey.from_path``, reading the key (and its ``-cert.pub``) as ASCII, the
    armour every OpenSSH and PEM key file is written in; paramiko reads them in the locale's
    encoding (GBK on Chinese Windows), which a text file must never depend on."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    data = Path(path).read_bytes()
    try:
        loaded = serialization.load_ssh_private_key(data, password)
    except ValueError:
        loaded = serialization.load_pem_private_key(data, password)
    classes = ((rsa.RSAPrivateKey, paramiko.RSAKey), (ed25519.Ed25519PrivateKey, paramiko.Ed25519Key),
               (ec.EllipticCurvePrivateKey, paramiko.ECDSAKey))
    key_class = next((c for kind, c in classes if isinstance(loaded, kind)), None)
    if key_class is None:
        raise paramiko.UnknownKeyType(key_bytes=data, key_type=loaded.__class__)
    key = key_class.from_private_key(io.StringIO(data.decode("ascii", "replace")), password=password)
    try:
        cert = Path(path + "-cert.pub").read_bytes()
    except FileNotFoundError:
        return key
    key.load_certificate(cert.decode("ascii", "replace"))  # the text, not its file name
    return key


class Connection:
    """One SSH connection to one machine (possibly through ProxyJump hops).

    Parameters
    ----------
    spec : HostSpec
        Where and how to connect (see :func:`gpumagic.ssh.hosts.resolve`).
    trust_new_host : bool or str
        Add an unknown host's key to known_hosts (OpenSSH format) instead of refusing; a
        ``"SHA256:..."`` fingerprint trusts only a key that has it (one a platform publishes,
        or the key a rental showed at its address before a restart moved it).  A *changed*
        key is always refused.
    passphrase_prompt : callable
        ``prompt(path) -> str`` for encrypted keys; default asks with ``getpass``.
    home : str, optional
        The local home directory whose ``~/.ssh`` is read (default ``$HOME``).
    use_agent : bool
        Offer ssh-agent keys (``$SSH_AUTH_SOCK``) unless ``IdentitiesOnly yes``.

    Use as a context manager, or call :meth:`open` / :meth:`close` (safe to call twice).
    """

    def __init__(self, spec: HostSpec, *, trust_new_host: bool | str = False,
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
        self._path: _Path | None = None  # the current transport's health
        self._busy = 0  # blocks of in_flight() running now
        self._quick = 0  # ... of which with quick=True
        self._busy_lock = threading.Lock()
        self._lost_reason: str | None = None
        self.opened_count = 0
        #: Content hashes of programs that this connection has kept on the machine (the sync
        #: agent): sent whole once, then run from there.  Emptied at each (re-)open.
        self.kept_programs: set[str] = set()
        #: The cell runners of each transport (:mod:`gpumagic.remote.execution`'s pools, one
        #: per transport: a runner lives on the path that started it), under :attr:`runners_lock`.
        self.runners: "weakref.WeakKeyDictionary[paramiko.Transport, Any]" = weakref.WeakKeyDictionary()
        self.runners_lock = threading.Lock()
        #: The sync agents started on each transport and not known to have ended: their nonces
        #: (:func:`gpumagic.sync.engine.stop_cut_agents`), under :attr:`agents_lock`.
        self.agents: dict[paramiko.Transport, set[str]] = {}
        self.agents_lock = threading.Lock()
        #: Messages for the user from the last open (e.g. a host key that was trusted).
        self.notes: list[str] = []
        #: (message, hint) when this connection must not open again (a stopped sandbox).
        self.refuse_reopen: tuple[str, str] | None = None
        #: The phase after each (re-)open: ``hook(connection)`` for every hook here, in
        #: order, once the new transport is authenticated (reverse tunnels ask for their
        #: listeners again).  A hook records its own faults; one that raises is logged.
        self.after_open: list[Callable[["Connection"], None]] = []
        #: Called as ``hook(connection, old_transport)`` from a short thread after
        #: :meth:`ensure_alive` left a dead path for a new one: the machine may still run
        #: what the old transport had started there (its sshd was told nothing), and a hook
        #: stops that over the new connection (the cell runner's, in remote/execution.py).
        self.after_abandon: list[Callable[["Connection", paramiko.Transport], None]] = []
        # paramiko matches a global request's reply to the last request sent, so two
        # threads waiting at once (a keepalive, a port forward) could take each other's
        # reply: every global request that waits holds this lock.
        self._global_lock = threading.Lock()
        #: Remote (``ssh -R``) listeners of the current transport: bound port -> handler
        #: ``handler(channel, (origin_host, origin_port))`` (see :meth:`forward_remote`).
        self._remote_forwards: dict[int, Callable] = {}

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

    def ensure_alive(self) -> "Connection":
        """Open the connection unless it is up, and make sure the path still carries packets
        before the caller sends something that matters on it (a cell, a session request).

        When nothing came from the machine for :data:`QUIET_BEFORE_PROBE` seconds (on the monotonic or
        the wall clock: a laptop that slept counts), a probe (``keepalive@openssh.com``) must
        be answered within max(:data:`REQUEST_WAIT`, 10 RTT).  Meanwhile, once the probe is
        :data:`SPARE_AFTER` late, a spare connection is opened side by side; when the
        probe's time is up the old path is declared dead and the spare adopted (an open in
        every respect: the reverse tunnels' ``after_open`` hooks run), with no error.  On a
        path heard from recently this costs nothing; on a quiet one, one round trip.

        Raises
        ------
        HostNotFound, ConnectionRefused, ConnectTimeout, ...
            As :meth:`open`, when no new connection can be made either.
        """
        with self._lock:
            path, t = self._path, self.transport
            if not self.is_connected or path is None or t is None:
                return self.ensure_open()
            if path.quiet() < QUIET_BEFORE_PROBE or threading.current_thread() is t:
                return self
            head, bound = path.answer_bounds()
            sent = time.monotonic()
            path.probe(self)
            if path.wait_answer(sent, head):
                return self
            spare = _Spare(self)
            if path.wait_answer(sent, bound - (time.monotonic() - sent)):
                spare.abandon()
                return self
            self._replace(t, spare.result(), f"{self.spec.address} did not answer a probe within "
                                             f"{bound:g} s (the network changed or dropped)")
            return self

    @property
    def rtt(self) -> float | None:
        """The smoothed round trip of this path's probes (seconds), None before the first."""
        path = self._path
        return path.rtt if path is not None else None

    @property
    def heard_recently(self) -> bool:
        """True when the connection is up and a packet came from the machine within
        :data:`QUIET_BEFORE_PROBE` seconds: :meth:`ensure_alive` returns at once, sending nothing."""
        path = self._path
        return self.is_connected and path is not None and path.quiet() < QUIET_BEFORE_PROBE

    def last_heard(self) -> float:
        """When the path last brought a packet (``time.monotonic()``; now, before the first
        path): where a reconnect's grace starts (:mod:`gpumagic.ssh.reconnect`)."""
        path = self._path
        return path.heard_at if path is not None else time.monotonic()

    def abandoned(self, old: paramiko.Transport) -> None:
        """Run the :attr:`after_abandon` hooks for ``old``, a transport whose path was
        declared dead (by :meth:`ensure_alive`, or by the watch of :meth:`in_flight`, for
        a caller that reconnects itself: a sync), each on a short thread."""
        for hook in list(self.after_abandon):
            threading.Thread(target=self._abandoned, args=(hook, old), daemon=True,
                             name="gpumagic-after-abandon").start()

    def _abandoned(self, hook: Callable, old: paramiko.Transport) -> None:
        try:
            hook(self, old)
        except Exception:  # noqa: BLE001 - clean-up on the machine: best effort, logged
            log.exception("gpumagic: after-abandon hook %r failed", hook)

    @contextlib.contextmanager
    def in_flight(self, *, quick: bool = False):
        """While this block runs, work is in flight on the path (a cell runs): it is probed
        after :data:`BUSY_PROBE_AFTER` quiet seconds and declared dead (the transport closed,
        :attr:`lost_reason` set) when nothing came for :data:`BUSY_DEAD_AFTER` seconds after
        that probe, instead of after ServerAliveInterval x ServerAliveCountMax.  It holds for the
        connection, so also for a new transport opened inside the block (a session that
        reconnects while its cell runs).

        ``quick``: the work resumes by itself on a new connection (a sync), so a blink costs
        it nothing but a reconnect: the probe must be answered within max(:data:`ALIVE_WAIT`,
        10 RTT) instead of :data:`BUSY_DEAD_AFTER`."""
        with self._busy_lock:
            self._busy += 1
            self._quick += quick
        path = self._path
        if path is not None:
            path.waiting = time.monotonic()  # the request that starts the block
        try:
            yield
        finally:
            with self._busy_lock:
                self._busy -= 1
                self._quick -= quick

    def open(self) -> "Connection":
        """Connect, check the host key, authenticate, start keepalives.

        Raises
        ------
        HostNotFound, ConnectionRefused, ConnectTimeout, UnknownHostKey, ChangedHostKey, RevokedHostKey,
        AuthenticationFailed, WrongPassphrase, InsecureKeyFile
            Each with a one-line hint.
        """
        with self._lock:
            if self.is_connected:
                return self
            if self.refuse_reopen is not None:
                raise NotConnected(*self.refuse_reopen)
            self._adopt(*self._new_transport())
            return self

    def _new_transport(self) -> "tuple[_Transport, list[Connection]]":
        """A new transport, host key checked and authenticated, and the ProxyJump hops it
        goes through; nothing of this connection's state changes (a spare may be made while
        the old transport is still in use)."""
        hops: list[Connection] = []
        try:
            sock = self._open_socket(hops)
        except BaseException:
            for hop in reversed(hops):
                hop.close()
            raise
        t = _Transport(sock, default_window_size=WINDOW_SIZE,
                       default_max_packet_size=MAX_PACKET_SIZE)
        # paramiko logs its own tracebacks (e.g. "Error reading SSH protocol banner");
        # gpumagic reports every failure itself, so they go under its silent logger.
        t.set_log_channel("gpumagic.ssh")
        _paramiko.never_wait_on_the_transport_thread(t)
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
            for hop in reversed(hops):
                hop.close()
            raise
        return t, hops

    def _adopt(self, t: "_Transport", hops: "list[Connection]") -> None:
        """Make ``t`` (from :meth:`_new_transport`) this connection's transport, closing the
        one before (a dead path, or none), then run the ``after_open`` hooks."""
        with self._lock:
            self._teardown()
            self.transport = t
            self._hops = hops
            self._lost_reason = None
            self.opened_count += 1
            self.kept_programs = set()
            self._remote_forwards = {}  # the old transport's listeners went with it
            self._start_keepalive(t)
            for hook in list(self.after_open):
                try:
                    hook(self)
                except Exception:  # noqa: BLE001 - a hook records its own faults
                    log.exception("gpumagic: after-open hook %r failed", hook)

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

    def _open_socket(self, hops: "list[Connection]"):
        spec = self.spec
        if self.via is not None:
            return _direct(self.via, spec)
        if spec.proxy_jump:
            return self._open_via_jumps(hops)
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

    def _open_via_jumps(self, hops: "list[Connection]"):
        """Connect hop by hop in the order :func:`jump_route` gives (each hop appended to
        ``hops``)."""
        prev: Connection | None = None
        for hop_spec in jump_route(self.spec, home=self.home):
            hop = Connection(hop_spec, trust_new_host=self.trust_new_host,
                             passphrase_prompt=self.passphrase_prompt, home=self.home,
                             use_agent=self.use_agent, via=prev)
            hop._keys = self._keys
            hops.append(hop)
            hop.open()
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

    def _prefer_known_key_types(self, t: "_Transport") -> None:
        """Ask for host key algorithms in ssh's order (``order_hostkeyalgs``): the types
        stored for this host first, host certificates first when a @cert-authority line
        names it."""
        order = known_hosts.host_key_algorithms(
            self.spec.known_hosts, self.spec.hostname, self.spec.port, t.preferred_keys)
        # plain algorithms through paramiko's public setting too (it keeps certificates last)
        t.get_security_options().key_types = tuple(a for a in order if "-cert-v01@" not in a)
        t.host_key_order = order

    def _check_host_key(self, t: paramiko.Transport) -> None:
        spec = self.spec
        key = t.get_remote_server_key()
        blob = key.public_blob
        cert = blob.key_blob if blob is not None and blob.key_type.endswith("-cert-v01@openssh.com") else None
        verdict = known_hosts.check(spec.known_hosts, spec.hostname, spec.port, key, cert)
        if verdict.status == "accept":
            return
        fp = known_hosts.fingerprint(key)
        name = f"{spec.hostname}:{spec.port}"
        notes = "".join(f"; {n}" for n in verdict.notes)
        line = verdict.entry.where if verdict.entry is not None else spec.known_hosts
        if verdict.status == "revoked":
            what = ("the CA that signed its host certificate" if verdict.revoked_ca
                    else f"its {key.get_name()} host key {fp}")
            raise RevokedHostKey(
                f"REVOKED host key: {what} is marked @revoked at {line}; refusing to connect to {name}",
                "someone may be impersonating this machine: ask its owner for its current key; "
                "never remove the @revoked line to get in",
                host=name, fingerprint=fp, line=line,
            )
        if verdict.status == "changed":
            stored = verdict.entry.key_type if verdict.entry is not None else key.get_name()
            raise ChangedHostKey(
                f"the host key of {name} has CHANGED (now {key.get_name()} {fp}; {line} holds a "
                f"different {stored} key); refusing to connect{notes}",
                f"if you rebuilt or re-rented the instance run `%gpu forget {name}`, then connect again; "
                "otherwise someone may be intercepting the connection",
                host=name, fingerprint=fp,
            )
        expected = self.trust_new_host if isinstance(self.trust_new_host, str) else None
        if self.trust_new_host is True or fp == expected:
            known_hosts.add(spec.known_hosts, spec.hostname, spec.port, key)
            self.notes.append(f"trusted new host {known_hosts.known_name(spec.hostname, spec.port)}: "
                              f"added its {key.get_name()} "
                              f"key {fp} to {spec.known_hosts}")
            return
        if expected is not None:
            raise UnknownHostKey(
                f"{name} is not a known host, and its {key.get_name()} key {fp} is not the {expected} "
                f"expected{notes}; refusing to connect",
                "someone may be intercepting the connection, or the machine was rebuilt: compare the key "
                "with what its platform shows before trusting it (--trust-new-host)",
                host=name, fingerprint=fp,
            )
        raise UnknownHostKey(
            f"{name} is not a known host; its {key.get_name()} key fingerprint is {fp}{notes}",
            f"if that matches your machine, connect again with --trust-new-host "
            f"(e.g. `%gpu connect {spec.alias} --trust-new-host`)",
            host=name, fingerprint=fp,
        )

    # -- authentication ---------------------------------------------------------------

    def _candidate_keys(self):
        """Yield (label, loader) pairs in OpenSSH's order (``sshconnect2.c`` ``pubkey_prepare``):
        the configured IdentityFiles the agent holds (the agent's copy, in the agent's order),
        then the agent's other keys (none with ``IdentitiesOnly yes``), then the configured
        files it does not hold.  The default ``~/.ssh/id_*`` files stand in only where no
        IdentityFile is configured.  An agent full of keys so cannot use up the server's
        ``MaxAuthTries`` before the configured key is offered."""
        spec = self.spec
        files = list(spec.identity_files) or default_identity_files(self.home)
        agent_keys: list = []
        if self.use_agent and os.environ.get("SSH_AUTH_SOCK"):
            try:
                agent_keys = list(paramiko.Agent().get_keys())
            except Exception:  # a broken agent socket must not stop file keys
                pass
        blobs = {path: public_blob(path) for path in files}
        rest: list = []
        for k in agent_keys:
            path = next((f for f in files if blobs.get(f) is not None and blobs[f] == k.asbytes()), None)
            if path is not None:
                files.remove(path)
                yield f"{path} (from the agent)", (lambda k=k: k)
            elif not spec.identities_only:
                rest.append(k)
        for k in rest:
            yield f"agent key {known_hosts.fingerprint(k)}", (lambda k=k: k)
        for path in files:
            if not os.path.exists(path):
                if path in spec.identity_files:  # ssh: "Identity file X not accessible"
                    self._missing_keys.append(path)
                continue
            yield path, (lambda p=path: self._load_key(p))

    def _load_key(self, path: str) -> paramiko.PKey:
        if path not in self._keys:
            self._keys[path] = load_private_key(path, self.passphrase_prompt)
        return self._keys[path]

    def _authenticate(self, t: paramiko.Transport) -> None:
        spec = self.spec
        tried: list[str] = []
        self._missing_keys: list[str] = []
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
                if len(tried) > 1:  # sshd ends a login at MaxAuthTries (6) refused keys
                    raise AuthenticationFailed(
                        f"{spec.user}@{spec.address} ended the login after {len(tried) - 1} keys were "
                        f"refused: too many keys offered (MaxAuthTries); keys tried: {', '.join(tried)}",
                        "offer this machine's key alone: `IdentityFile KEY` and `IdentitiesOnly yes` in its "
                        "Host block (or -i KEY with IdentitiesOnly), or fewer keys in the agent (ssh-add -d)",
                    ) from None
                raise ConnectionLost(f"connection to {spec.address} dropped during login: {e}",
                                     "connect again; if it repeats, check the machine's sshd")
            if t.is_authenticated():
                self.notes += [f"warning: identity file {p} not accessible (no such file); logged in with {label}"
                               for p in self._missing_keys]
                return
        keys = ", ".join(tried) if tried else "none (no IdentityFile, no ~/.ssh/id_* key, no agent)"
        missing = "".join(f"; identity file {p} not accessible (no such file)" for p in self._missing_keys)
        raise AuthenticationFailed(
            f"{spec.user}@{spec.address} refused every key offered; keys tried: {keys}{missing}",
            f"check the user name ({spec.user!r}) and that your public key is in "
            f"~/.ssh/authorized_keys on the machine, or pass the right key with -i",
        )

    # -- keepalive --------------------------------------------------------------------

    def _start_keepalive(self, t: paramiko.Transport) -> None:
        """Start watching ``t``'s path (:class:`_Path`): keepalives while idle
        (``ServerAliveInterval`` x ``ServerAliveCountMax``, as OpenSSH), quicker probes
        while work is in flight, and a transport closed when its path is dead."""
        self._keepalive_stop = stop = threading.Event()
        self._path = path = _Path(t)
        threading.Thread(target=self._watch, args=(t, path, stop), daemon=True,
                         name="gpumagic-keepalive").start()

    def _watch(self, t: paramiko.Transport, path: "_Path", stop: threading.Event) -> None:
        try:
            self._watch_path(t, path, stop)
        finally:
            spare, path.spare = path.spare, None
            if spare is not None:  # a spare this path's waiting request opened, not adopted
                spare.abandon()

    def _watch_path(self, t: paramiko.Transport, path: "_Path", stop: threading.Event) -> None:
        interval = self.spec.server_alive_interval
        limit = interval * max(1, self.spec.server_alive_count_max)
        last_m, last_w = time.monotonic(), time.time()
        while not stop.wait(_TICK):
            if not t.is_active():
                return
            now_m, now_w = time.monotonic(), time.time()
            if now_m - last_m > _TICK + _GAP or now_w - last_w > _TICK + _GAP:
                # This process did not run (SIGSTOP, a laptop asleep): ask again, and count
                # the machine's silence from now.
                path.restart(now_m)
                path.probe(self)
            last_m, last_w = now_m, now_w
            if self._awaited(t, path, now_m):
                return
            if self._quick > 0:
                after, dead = BUSY_PROBE_AFTER, max(ALIVE_WAIT, 10 * (path.rtt or 0.0))
                why = f"{self.spec.address} did not answer a probe within {dead:.3g} s during a transfer"
            elif self._busy > 0:
                after, dead = BUSY_PROBE_AFTER, BUSY_DEAD_AFTER
                why = f"{self.spec.address} did not answer for {dead:g} s while a cell ran"
            elif interval > 0:
                after, dead = interval, limit
                why = (f"{self.spec.address} did not answer keepalives for {limit:g} s "
                       "(ServerAliveInterval x ServerAliveCountMax)")
            else:
                continue
            asked = path.asked
            if asked is not None:
                if now_m - asked > dead and not stop.is_set():
                    self._lost_reason = why
                    log.info("gpumagic: %s; closing that connection", why)
                    t.close()
                    return
            elif now_m - path.heard_at >= after:
                path.probe(self)

    def _awaited(self, t: paramiko.Transport, path: "_Path", now: float) -> bool:
        """The watch's look at a request that waits for its first answer (:attr:`_Path.waiting`,
        set by :meth:`in_flight`): a probe when it waited max(:data:`SPARE_AFTER`, 4 RTT), a spare
        connection at twice that, and past max(:data:`REQUEST_WAIT`, 10 RTT) without a packet
        the path is dead: the spare is adopted (as :meth:`ensure_alive` adopts one) and ``t``
        closed, so the cell's reattach finds a connection made.  True when ``t`` is done with."""
        sent = path.waiting
        if sent is None:
            return False
        if path.heard_at >= sent:  # answered: any packet after it tells the path carries
            path.waiting = None
            if path.spare is not None:
                path.spare.abandon()
                path.spare = None
            return False
        head, bound = path.answer_bounds()
        if now - sent >= head and path.asked is None:
            path.probe(self)
        if now - sent >= 2 * head and path.spare is None:
            path.spare = _Spare(self)
        if now - sent < bound:
            return False
        spare, path.spare = path.spare, None
        try:
            made = spare.result(self.spec.connect_timeout + 1) if spare is not None else None
        except BaseException as e:  # noqa: BLE001 - no spare: the caller reconnects, and says why
            log.info("gpumagic: the spare connection to %s failed: %s", self.spec.address, e)
            made = None
        self._replace(t, made, f"{self.spec.address} did not answer a request within {bound:.3g} s "
                               "(the network changed or dropped)")
        return True

    def _replace(self, t: paramiko.Transport, made: tuple | None, why: str) -> None:
        """``t``'s path is dead (``why``): adopt ``made`` (a spare's transport and hops) in its
        place and run the :attr:`after_abandon` hooks for ``t``; without ``made``, close ``t``
        (the caller reconnects).  When ``t`` was replaced meanwhile (by another look at the
        same path), ``made`` is closed and the new transport kept."""
        with self._lock:
            if self.transport is not t:
                if made is not None:
                    _close_made(made)
                return
            self._lost_reason = why
            if made is None:
                log.info("gpumagic: %s; closing that connection", why)
                t.close()
                return
            log.info("gpumagic: %s; adopting a new connection", why)
            self._adopt(*made)
        self.abandoned(t)

    # -- global requests and remote forwards (ssh -R) ----------------------------------

    def global_request(self, kind: str, data: tuple | None = None, *,
                       transport: paramiko.Transport | None = None) -> paramiko.Message | None:
        """Send a global request (RFC 4254 section 4) and wait for its reply: the reply's
        message, or None when the server refused it or the connection ended first.

        One at a time per connection: paramiko takes the next reply for the last request
        sent, so a keepalive and a port forward waiting at once could swap replies.
        """
        t = transport or self.transport
        if t is None:
            return None
        with self._global_lock:
            return t.global_request(kind, data, wait=True)

    def forward_remote(self, port: int, handler: Callable, address: str = "127.0.0.1") -> int:
        """Ask the server to listen on ``address:port`` on the machine and to forward each
        connection there back over this connection (``tcpip-forward``, RFC 4254 section 7.1:
        what ``ssh -R`` asks for).  ``port`` 0 lets the server choose.  ``handler(channel,
        (origin_host, origin_port))`` is called on paramiko's transport thread for each
        connection: it must not block.

        Returns
        -------
        int
            The port the server listens on.

        Raises
        ------
        paramiko.SSHException
            The server refused (its sshd_config forbids it, or the port is taken: the
            protocol does not say which).
        ConnectionLost
            The connection ended before the answer.
        """
        self.ensure_open()
        t = self.transport
        assert t is not None
        with self._global_lock:
            if port:  # a connection may come as soon as the server listens
                self._remote_forwards[port] = handler
            try:
                bound = int(t.request_port_forward(address, port, handler=self._forwarded))
            except paramiko.SSHException:
                if port and self._remote_forwards.get(port) is handler:
                    del self._remote_forwards[port]
                if not t.is_active():
                    raise ConnectionLost(f"the connection to {self.spec.address} ended while asking "
                                         "for a remote port forward", "run `%gpu connect` again") from None
                raise
            self._remote_forwards[bound] = handler
        return bound

    def cancel_remote(self, port: int, address: str = "127.0.0.1") -> None:
        """Stop the server's listener on ``address:port`` (``cancel-tcpip-forward``); nothing
        when the connection is down (the listener went with it)."""
        if self._remote_forwards.pop(port, None) is None:
            return
        t = self.transport
        if t is not None and t.is_active():
            self.global_request("cancel-tcpip-forward", (address, port), transport=t)

    def _forwarded(self, chan: paramiko.Channel, origin: tuple, server: tuple) -> None:
        """paramiko's transport thread: a connection to one of our remote listeners."""
        handler = self._remote_forwards.get(int(server[1]))
        if handler is None:  # cancelled meanwhile
            chan.close()
            return
        handler(chan, origin)

    # -- channels ---------------------------------------------------------------------

    def open_session(self) -> paramiko.Channel:
        """A new session channel (re-opening the connection first if it dropped, or if its
        path went dead: :meth:`ensure_alive`).

        Raises
        ------
        ConnectionLost
            When no channel can be opened even on a new connection.
        """
        self.ensure_alive()
        t = self.transport
        assert t is not None
        try:
            return t.open_session(timeout=self.spec.connect_timeout)
        except (paramiko.SSHException, EOFError, OSError):
            # The transport looked alive but was not: reconnect once (unless the watch of a
            # waiting request replaced it meanwhile: that new one is kept).
            with self._lock:
                if self.transport is t:
                    self._teardown()
            self.ensure_open()
            try:
                return self.transport.open_session(timeout=self.spec.connect_timeout)
            except (paramiko.SSHException, EOFError, OSError) as e:
                raise ConnectionLost(f"cannot open a channel to {self.spec.address}: {e}",
                                     "run `%gpu connect` again")

    def __repr__(self) -> str:
        state = "connected" if self.is_connected else "closed"
        return f"<Connection {self.spec.user}@{self.spec.address} {state}>"


class _Path:
    """What is known of one transport's path to the machine: when a packet last came
    (any packet, through :func:`gpumagic.ssh._paramiko.on_every_packet`; only the replies
    to probes without the private door) and the round-trip time the probes measured.

    A probe is a ``keepalive@openssh.com`` global request that wants a reply (RFC 4254
    section 4), what OpenSSH's ``ServerAliveInterval`` sends: sshd answers it
    (REQUEST_FAILURE, as for any request it does not know) without waking any process.
    """

    def __init__(self, transport: paramiko.Transport):
        self.transport = transport
        self.heard_at = time.monotonic()  # the last packet, on the monotonic clock
        self.heard_wall = time.time()  # ... and on the wall clock (it runs on in a sleep)
        #: Smoothed round-trip time of the probes (seconds), None before the first.
        self.rtt: float | None = None
        #: When the unanswered probe went out (monotonic), None when none waits.
        self.asked: float | None = None
        #: When a request went out that no packet has answered yet (monotonic), else None.
        self.waiting: float | None = None
        #: The spare connection opened while that request waits (Connection._awaited).
        self.spare: _Spare | None = None
        self._asking = False
        self._news = threading.Event()
        self.hooked = _paramiko.on_every_packet(transport, self.heard)

    def heard(self) -> None:
        """A packet came (paramiko's transport thread: quick)."""
        self.heard_at, self.heard_wall = time.monotonic(), time.time()
        self.asked = None
        self._news.set()

    def quiet(self) -> float:
        """Seconds since the last packet, the larger of the two clocks."""
        return max(time.monotonic() - self.heard_at, time.time() - self.heard_wall)

    def answer_bounds(self) -> tuple[float, float]:
        """(head, bound) for a probe or a request on this path: a spare connection is opened
        when no packet answered it for max(:data:`SPARE_AFTER`, 4 RTT) seconds, and the path
        counts as dead past max(:data:`REQUEST_WAIT`, 10 RTT)."""
        rtt = self.rtt or 0.0
        return max(SPARE_AFTER, 4 * rtt), max(REQUEST_WAIT, 10 * rtt)

    def restart(self, now: float) -> None:
        """Count an unanswered probe's or request's silence from ``now`` (this process did
        not run)."""
        if self.asked is not None:
            self.asked = now
        if self.waiting is not None:
            self.waiting = now

    def probe(self, conn: Connection) -> None:
        """Send a probe unless one waits for its reply already (from a short thread:
        paramiko waits for a global request's reply, and only one may wait at a time)."""
        if self.asked is None:
            self.asked = time.monotonic()
        if self._asking:
            return
        self._asking = True
        t = self.transport

        def ask() -> None:
            sent = time.monotonic()
            try:
                conn.global_request("keepalive@openssh.com", transport=t)
            except Exception:  # noqa: BLE001 - a dead transport: no answer
                return
            finally:
                self._asking = False
            if not t.is_active():
                return
            sample = min(time.monotonic() - sent, 1.0)  # a reply after a blink is no RTT
            self.rtt = sample if self.rtt is None else 0.75 * self.rtt + 0.25 * sample
            if not self.hooked:
                self.heard()

        threading.Thread(target=ask, daemon=True, name="gpumagic-ping").start()

    def wait_answer(self, since: float, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a packet that came after ``since``
        (monotonic); False also when the transport ended."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            self._news.clear()
            if self.heard_at >= since:
                return True
            left = deadline - time.monotonic()
            if left <= 0 or not self.transport.is_active():
                return False
            self._news.wait(min(left, 0.05))


class _Spare:
    """A second connection attempt run side by side with a probe
    (:meth:`Connection.ensure_alive`): :meth:`result` waits for it, :meth:`abandon` closes
    it when it is not needed after all."""

    def __init__(self, conn: Connection):
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._abandoned = False
        self._result: tuple | None = None
        self._error: BaseException | None = None

        def connect() -> None:
            try:
                made = conn._new_transport()
            except BaseException as e:  # noqa: BLE001 - handed to result()
                self._error = e
                self._done.set()
                return
            with self._lock:
                if not self._abandoned:
                    self._result = made
                    self._done.set()
                    return
            _close_made(made)

        threading.Thread(target=connect, daemon=True, name="gpumagic-spare-connect").start()

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            made, self._result = self._result, None
        if made is not None:
            _close_made(made)

    def result(self, timeout: float | None = None) -> tuple:
        """(transport, hops) once the attempt authenticated; its error when it failed, or
        :class:`ConnectTimeout` when ``timeout`` seconds passed first (it is abandoned)."""
        if not self._done.wait(timeout):
            self.abandon()
            raise ConnectTimeout(f"the spare connection did not open within {timeout:g} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def _close_made(made: tuple) -> None:
    t, hops = made
    t.close()
    for hop in reversed(hops):
        hop.close()


#: How many hops a route may have, its jump hosts' own ProxyJump followed (a loop ends here).
MAX_HOPS = 16


def jump_route(spec: HostSpec, home: str | None = None, _seen: tuple = ()) -> list[HostSpec]:
    """The hosts to go through, in order, to reach ``spec``, as ssh goes: ``ProxyJump a,b``
    runs ``ssh -J a -W HOST:PORT b``, so ``b``'s own ProxyJump is overridden by ``a``, and
    ``ssh -W b:PORT a`` reads ``a``'s Host block, whose own ProxyJump is followed: ``Host gpu``
    -> ``ProxyJump login``, ``Host login`` -> ``ProxyJump bastion`` goes bastion, login, gpu.

    Raises
    ------
    ConfigError
        A loop (a host reached through itself) or a route of more than :data:`MAX_HOPS` hops.
    """
    if not spec.proxy_jump:
        return []
    seen = _seen or ((spec.user, spec.hostname, spec.port),)
    chain = [resolve(h, home=home) for h in spec.proxy_jump]
    first = (chain[0].user, chain[0].hostname, chain[0].port)
    if chain[0].proxy_jump and first in seen:  # its own ProxyJump leads back: no end
        names = " -> ".join(f"{h}:{p}" for _, h, p in (*seen, first))
        raise ConfigError(f"ProxyJump loops: {names} (each hop's own ProxyJump followed, as ssh does)",
                          "end the loop: `ProxyJump none` in the jump host's Host block, or -J to give the route")
    route = jump_route(chain[0], home, (*seen, first)) + [replace(h, proxy_jump=()) for h in chain]
    if len(route) > MAX_HOPS:
        raise ConfigError(f"the route to {spec.address} has {len(route)} ProxyJump hops (at most {MAX_HOPS})",
                          "give a shorter route with -J")
    return route


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


class _Transport(paramiko.Transport):
    """paramiko's Transport with a settable host key algorithm order.

    paramiko lists every plain algorithm before any ``-cert-v01@openssh.com`` one whatever
    ``key_types`` says; ssh asks for certificates first.  ``host_key_order`` (set before
    ``start_client``) is the order asked for; algorithms it leaves out follow in paramiko's.
    """

    host_key_order: tuple[str, ...] = ()

    @property
    def preferred_keys(self):
        keys = super().preferred_keys
        first = [k for k in self.host_key_order if k in keys]
        return tuple(first + [k for k in keys if k not in first])
