"""OpenSSH ``known_hosts``: check a server's host key, trust (append), forget (``ssh-keygen -R``).

The rules are OpenSSH 9.x's (``hostfile.c``, ``match.c``, ``sshconnect.c``
``check_host_key``), checked against the real ``ssh`` in ``tests/test_known_hosts_conformance.py``:

* The name looked up is the host name in lower case (ssh lower-cases it), ``host`` for port
  22 and ``[host]:port`` otherwise.  When nothing is known under ``[host]:port``, ssh looks
  again under the bare ``host`` and accepts a matching key found there (and only accepts:
  a different key there does not make the port's key "changed").
* The host field of a line is a comma list of patterns with ``*`` and ``?`` wildcards,
  matched case-insensitively against the whole name (``[*.example]:2222`` is a pattern
  too); a ``!pattern`` that matches vetoes the line.  A field that starts with ``|1|`` is
  one hashed name (``ssh-keygen -H``).
* A line whose key does not parse (broken or cut-short base64, a key type that does not
  match the key, trailing bytes, an unknown type) is skipped, as ssh skips it.
* Any stored key equal to the server's accepts it.  Otherwise any other plain key stored for
  the name, of whatever type, makes it *changed*.  Nothing stored: *unknown*.
* ``@revoked`` lines whose patterns match the name revoke their key (and, for a certificate,
  its CA) whatever the other lines say.
* ``@cert-authority`` lines never hold a host key: they trust host certificates signed by
  their key (see :func:`check`).

Files are never rewritten except by :func:`forget`, which keeps a ``.old`` copy as
``ssh-keygen -R`` does; :func:`add` appends one line and leaves every other byte as it was.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import paramiko

from .._fs import atomic_write

CA_MARKER = "@cert-authority"
REVOKED_MARKER = "@revoked"

#: Fields after the type name in the wire form of each public key type OpenSSH 9.x reads
#: (``sshkey.c``); every field is a length-prefixed string or mpint.
_KEY_FIELDS = {
    "ssh-ed25519": 1,                           # public key (32 bytes)
    "ssh-rsa": 2,                               # e, n
    "ssh-dss": 4,                               # p, q, g, y
    "ecdsa-sha2-nistp256": 2,                   # curve name, point
    "ecdsa-sha2-nistp384": 2,
    "ecdsa-sha2-nistp521": 2,
    "sk-ssh-ed25519@openssh.com": 2,            # public key, application
    "sk-ecdsa-sha2-nistp256@openssh.com": 3,    # curve name, point, application
}

#: Certificate type -> the plain key type it certifies (PROTOCOL.certkeys).
_CERT_TYPES = {
    "ssh-ed25519-cert-v01@openssh.com": "ssh-ed25519",
    "ssh-rsa-cert-v01@openssh.com": "ssh-rsa",
    "ssh-dss-cert-v01@openssh.com": "ssh-dss",
    "ecdsa-sha2-nistp256-cert-v01@openssh.com": "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384-cert-v01@openssh.com": "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521-cert-v01@openssh.com": "ecdsa-sha2-nistp521",
    "sk-ssh-ed25519-cert-v01@openssh.com": "sk-ssh-ed25519@openssh.com",
    "sk-ecdsa-sha2-nistp256-cert-v01@openssh.com": "sk-ecdsa-sha2-nistp256@openssh.com",
}

#: Names a known_hosts line may give its key besides the blob's own type: ``sshkey_read``
#: takes the RSA signature-algorithm names too (not short names such as ``ED25519``).
_TYPE_ALIASES = {"rsa-sha2-256": "ssh-rsa", "rsa-sha2-512": "ssh-rsa"}


def _named_types(name: str) -> tuple[str, ...]:
    """Key types a line's type name stands for; () for a name ssh does not know."""
    name = _TYPE_ALIASES.get(name, name)
    return (name,) if name in _KEY_FIELDS or name in _CERT_TYPES else ()


#: ssh's default ``HostKeyAlgorithms`` (OpenSSH 9.x, as ``ssh -G`` prints it):
#: certificates first, then plain keys.
DEFAULT_HOST_KEY_ALGORITHMS = (
    "ssh-ed25519-cert-v01@openssh.com",
    "ecdsa-sha2-nistp256-cert-v01@openssh.com",
    "ecdsa-sha2-nistp384-cert-v01@openssh.com",
    "ecdsa-sha2-nistp521-cert-v01@openssh.com",
    "sk-ssh-ed25519-cert-v01@openssh.com",
    "sk-ecdsa-sha2-nistp256-cert-v01@openssh.com",
    "rsa-sha2-512-cert-v01@openssh.com",
    "rsa-sha2-256-cert-v01@openssh.com",
    "ssh-ed25519",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "sk-ssh-ed25519@openssh.com",
    "sk-ecdsa-sha2-nistp256@openssh.com",
    "rsa-sha2-512",
    "rsa-sha2-256",
)

#: ssh's default ``CASignatureAlgorithms`` (OpenSSH 9.x, as ``ssh -G`` prints it): no SHA-1
#: ``ssh-rsa``.
CA_SIGNATURE_ALGORITHMS = frozenset({
    "ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521",
    "sk-ssh-ed25519@openssh.com", "sk-ecdsa-sha2-nistp256@openssh.com",
    "rsa-sha2-512", "rsa-sha2-256",
})

_SSH2_CERT_TYPE_HOST = 2
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def _lower(s: str) -> str:
    # ssh's lowercase() is C tolower() in the C locale: ASCII letters only.
    return s.translate(_ASCII_LOWER)


def known_name(host: str, port: int) -> str:
    """The name ssh looks up for ``host`` on ``port``: lower case, ``[host]:port`` unless 22.

    Port 0 means "no port" (the bare name), as in ssh's ``put_host_port``.
    """
    host = _lower(host)
    return host if int(port) in (0, 22) else f"[{host}]:{int(port)}"


def fingerprint(key: paramiko.PKey | bytes) -> str:
    """The ``SHA256:...`` fingerprint that ``ssh`` and ``ssh-keygen -l`` print.

    ``key`` is a paramiko key or the key's wire-format blob.
    """
    if not isinstance(key, bytes):
        return key.fingerprint  # paramiko's, in OpenSSH's form
    return "SHA256:" + base64.b64encode(hashlib.sha256(key).digest()).decode().rstrip("=")


# -- SSH wire format -----------------------------------------------------------------------

class _Reader:
    """Reads RFC 4251 wire data; every short read raises ValueError."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise ValueError("truncated")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return struct.unpack(">I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack(">Q", self.take(8))[0]

    def string(self) -> bytes:
        return self.take(self.u32())

    def done(self) -> bool:
        return self.pos == len(self.data)


def _pack_string(b: bytes) -> bytes:
    return struct.pack(">I", len(b)) + b


def _check_key_fields(ktype: str, fields: list[bytes]) -> None:
    """Refuse what OpenSSH's key parser refuses beyond the field count (``sshkey.c``)."""
    if ktype in ("ssh-ed25519", "sk-ssh-ed25519@openssh.com"):
        if len(fields[0]) != 32:
            raise ValueError("ed25519 key is not 32 bytes")
    elif ktype.startswith("ecdsa-sha2-") or ktype.startswith("sk-ecdsa-sha2-"):
        curve = re.search(r"nistp\d+", ktype).group(0)
        if fields[0] != curve.encode():
            raise ValueError("ECDSA curve does not match the key type")
        if ktype.startswith("ecdsa-"):
            # on-curve check, as sshkey_ec_validate_public does
            paramiko.PKey.from_type_string(ktype, _pack_string(ktype.encode())
                                           + b"".join(_pack_string(f) for f in fields))
    elif ktype == "ssh-rsa":
        n = int.from_bytes(fields[1], "big")
        if n.bit_length() < 1024:  # SSH_RSA_MINIMUM_MODULUS_SIZE
            raise ValueError("RSA key shorter than 1024 bits")


def _parse_plain(blob: bytes) -> tuple[str, bytes]:
    """``(type, blob)`` of a plain public key blob; ValueError if OpenSSH would refuse it."""
    r = _Reader(blob)
    ktype = r.string().decode("ascii", "replace")
    if ktype not in _KEY_FIELDS:
        raise ValueError(f"unknown key type {ktype!r}")
    fields = [r.string() for _ in range(_KEY_FIELDS[ktype])]
    if not r.done():
        raise ValueError("trailing bytes after the key")
    _check_key_fields(ktype, fields)
    return ktype, blob


@dataclass(frozen=True)
class Certificate:
    """An OpenSSH certificate (PROTOCOL.certkeys), parsed but not yet trusted.

    Attributes
    ----------
    key_type : str
        The certified plain key type (``ssh-ed25519``...).
    key : bytes
        The certified plain public key, wire format (what the server signs the exchange with).
    cert_type : int
        1 user, 2 host.
    key_id : str
    principals : tuple of str
        Names it is valid for (empty: any name).
    valid_after, valid_before : int
        Seconds since the epoch (``valid_before`` 2**64-1: forever).
    critical_options : bytes
        Raw field; a host certificate with any is refused.
    ca_key : bytes
        The signing CA's public key, wire format.
    signature_algorithm : str
    signed : bytes
        The bytes the signature covers.
    signature : bytes
        The whole signature field (algorithm and signature).
    """

    key_type: str
    key: bytes
    cert_type: int
    key_id: str
    principals: tuple[str, ...]
    valid_after: int
    valid_before: int
    critical_options: bytes
    ca_key: bytes
    signature_algorithm: str
    signed: bytes
    signature: bytes

    @classmethod
    def parse(cls, blob: bytes) -> "Certificate":
        """Parse a certificate blob; ValueError when it is not one OpenSSH could read."""
        r = _Reader(blob)
        ctype = r.string().decode("ascii", "replace")
        if ctype not in _CERT_TYPES:
            raise ValueError(f"not a certificate type: {ctype!r}")
        plain = _CERT_TYPES[ctype]
        r.string()  # nonce
        fields = [r.string() for _ in range(_KEY_FIELDS[plain])]
        _check_key_fields(plain, fields)
        key = _pack_string(plain.encode()) + b"".join(_pack_string(f) for f in fields)
        r.u64()  # serial
        cert_type = r.u32()
        key_id = r.string().decode("utf-8", "replace")
        pr = _Reader(r.string())
        principals = []
        while not pr.done():
            principals.append(pr.string().decode("utf-8", "replace"))
        valid_after, valid_before = r.u64(), r.u64()
        critical = r.string()
        r.string()  # extensions
        r.string()  # reserved
        ca_key = r.string()
        signed = blob[:r.pos]
        signature = r.string()
        if not r.done():
            raise ValueError("trailing bytes after the certificate")
        _parse_plain(ca_key)  # a CA key must be a plain key (OpenSSH: no certified CAs)
        sig_alg = _Reader(signature).string().decode("ascii", "replace")
        return cls(plain, key, cert_type, key_id, tuple(principals), valid_after, valid_before,
                   critical, ca_key, sig_alg, signed, signature)

    def problem(self, hostname: str, now: float | None = None) -> str | None:
        """Why ssh would not accept this as ``hostname``'s host certificate; None if it would.

        The checks of OpenSSH's ``sshkey_cert_check_host``: the CA's signature, a host
        certificate, within its validity, ``hostname`` (lower case, no port) among the
        principals (any name when there are none), no critical options, a signature
        algorithm in ``CA_SIGNATURE_ALGORITHMS``.
        """
        if self.signature_algorithm not in CA_SIGNATURE_ALGORITHMS:
            return f"it is signed with {self.signature_algorithm}, which ssh no longer accepts"
        try:
            ca_type = _parse_plain(self.ca_key)[0]
            ca = paramiko.PKey.from_type_string(ca_type, self.ca_key)
            good = ca.verify_ssh_sig(self.signed, paramiko.Message(self.signature))
        except Exception:
            return f"its CA signature ({self.signature_algorithm}) cannot be checked by paramiko"
        if not good:
            return "its CA signature does not verify"
        if self.cert_type != _SSH2_CERT_TYPE_HOST:
            return "it is not a host certificate"
        now = time.time() if now is None else now
        if now < self.valid_after:
            return "it is not yet valid"
        if now >= self.valid_before:
            return "it has expired"
        if self.principals and hostname not in self.principals:
            return f"{hostname} is not among its principals ({', '.join(self.principals)})"
        if self.critical_options:
            return "it has critical options, which ssh refuses on host certificates"
        return None


# -- known_hosts lines ---------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    """One usable known_hosts line: ``[marker] hosts key-type key [comment]``, as sshd(8)
    describes the file (SSH_KNOWN_HOSTS FILE FORMAT).

    Attributes
    ----------
    path : str
        The known_hosts file it is in.
    line : int
        1-based line number.
    marker : str
        ``""``, ``"@cert-authority"`` or ``"@revoked"``.
    hosts : str
        The host field as written.
    key_type : str
        Type of the stored key (of the plain key, for a certificate stored on the line).
    key : bytes
        The stored plain public key, wire format.
    """

    path: str
    line: int
    marker: str
    hosts: str
    key_type: str
    key: bytes

    @property
    def where(self) -> str:
        """``path:line``, as ssh names a line."""
        return f"{self.path}:{self.line}"


def _match_pattern(name: str, pattern: str) -> bool:
    # match.c match_pattern: '*' any run, '?' any one character, everything else literal.
    rx = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(rx, name, re.DOTALL) is not None


def match_hostname(name: str, patterns: str) -> int:
    """match.c ``match_pattern_list``: 1 a pattern matches, -1 a ``!pattern`` matches, else 0.

    Patterns are lower-cased (ASCII) before matching; ``name`` is matched as given.
    """
    positive = 0
    for sub in patterns.split(","):
        negated = sub.startswith("!")
        if negated:
            sub = sub[1:]
        if len(sub) >= 1023:  # ssh gives up on a sub-pattern that long
            return 0
        if _match_pattern(name, _lower(sub)):
            if negated:
                return -1
            positive = 1
    return positive


def _host_field_matches(name: str, hosts: str) -> bool | None:
    """hostfile.c ``match_maybe_hashed``: True/False, or None for a broken hashed field."""
    if not hosts.startswith("|"):
        return match_hostname(name, hosts) == 1
    m = re.fullmatch(r"\|1\|([^|]*)\|(.*)", hosts, re.DOTALL)
    if not m or not m.group(1) or len(m.group(1)) > 1024:
        return None
    try:
        salt = base64.b64decode(m.group(1), validate=True)
    except (binascii.Error, ValueError):
        return None
    if len(salt) != 20:
        return None
    mac = hmac.new(salt, name.encode("utf-8", "surrogateescape"), hashlib.sha1).digest()
    want = f"|1|{base64.b64encode(salt).decode()}|{base64.b64encode(mac).decode()}"
    return hmac.compare_digest(want, hosts)


def _split_marker(rest: str) -> tuple[str | None, str]:
    """hostfile.c ``check_markers``: (marker or None for a bad one, rest of the line)."""
    marker = ""
    while rest.startswith("@"):
        if marker:
            return None, rest  # only one marker is allowed
        end = rest.find(" ")
        if end < 0:
            end = rest.find("\t")
        if end < 0 or end <= 1 or end >= 32:
            return None, rest
        marker = rest[:end]
        if marker not in (CA_MARKER, REVOKED_MARKER):
            return None, rest
        rest = rest[end:].lstrip(" \t")
    return marker, rest


def _parse_key(text: str) -> tuple[str, bytes] | None:
    """``sshkey_read`` on ``TYPE BASE64 [comment]``: (plain type, plain blob) or None.

    A certificate stored on a line counts as its plain key (``sshkey_equal_public``).
    """
    fields = re.split(r"[ \t]+", text, maxsplit=2)
    if len(fields) < 2 or not fields[1]:
        return None
    named = _named_types(fields[0])
    try:
        # b64_pton skips white space (a CRLF file leaves "\r" on the blob)
        blob = base64.b64decode(re.sub(r"\s", "", fields[1]), validate=True)
        btype = _Reader(blob).string().decode("ascii", "replace")
        if btype not in named:
            return None
        if btype in _CERT_TYPES:
            cert = Certificate.parse(blob)
            return cert.key_type, cert.key
        return _parse_plain(blob)
    except Exception:  # any refusal by the parser: ssh skips the line
        return None


def _lines(path: str | os.PathLike) -> list[str]:
    try:
        data = Path(path).read_bytes()
    except OSError:  # missing or unreadable: ssh reads nothing from it either
        return []
    # getline(): lines end at "\n" only ("\r" stays on the line)
    return data.decode("utf-8", "surrogateescape").split("\n")


def entries(path: str | os.PathLike, name: str) -> list[Entry]:
    """Every usable line of ``path`` whose host field matches the lookup ``name``.

    ``name`` is what :func:`known_name` returns.  Lines that ssh skips (comments, bad
    markers, broken hashes, keys that do not parse) are left out.
    """
    out = []
    for n, line in enumerate(_lines(path), 1):
        rest = line.lstrip(" \t")
        if not rest or rest.startswith("#"):
            continue
        marker, rest = _split_marker(rest)
        if marker is None:
            continue
        hosts, rest = re.match(r"([^ \t]*)(.*)", rest, re.DOTALL).groups()
        if not _host_field_matches(name, hosts):
            continue
        rest = rest.lstrip(" \t")
        if not rest or rest.startswith("#"):
            continue
        parsed = _parse_key(rest)
        if parsed is None:
            continue
        out.append(Entry(str(path), n, marker, hosts, parsed[0], parsed[1]))
    return out


def lookup(path: str | os.PathLike, host: str, port: int) -> list[paramiko.PKey]:
    """Plain host keys stored under exactly the name of ``host``/``port`` (no markers).

    Keys paramiko cannot load (``ssh-dss``, security keys) are left out.
    """
    keys = []
    for e in entries(path, known_name(host, port)):
        if e.marker:
            continue
        try:
            keys.append(paramiko.PKey.from_type_string(e.key_type, e.key))
        except Exception:
            pass
    return keys


# -- the verdict ---------------------------------------------------------------------------

@dataclass
class Verdict:
    """What ssh decides about a host key (``sshconnect.c`` ``check_host_key``).

    Attributes
    ----------
    status : str
        ``"accept"``, ``"unknown"``, ``"changed"`` or ``"revoked"``.
    name : str
        The known_hosts name looked up (``host`` or ``[host]:port``).
    entry : Entry or None
        The line that decided: the matching key or CA (accept), a different key stored for
        the name (changed), the ``@revoked`` line (revoked).
    by_certificate : bool
        Accepted through a host certificate signed by a ``@cert-authority`` key.
    revoked_ca : bool
        For "revoked": the line revokes the certificate's CA, not the host key itself.
    notes : list of str
        Why a certificate or a ``@cert-authority`` line did not help, one line each.
    """

    status: str
    name: str
    entry: Entry | None = None
    by_certificate: bool = False
    revoked_ca: bool = False
    notes: list[str] = field(default_factory=list)


def _status(found: list[Entry], key: bytes, cert: Certificate | None):
    """hostfile.c ``check_hostkeys_by_key_or_type`` -> (status, entry, revoked_ca)."""
    status, entry = "unknown", None
    for e in found:
        if cert is not None:
            if e.marker == CA_MARKER and e.key == cert.ca_key:
                status, entry = "accept", e
                break
        elif not e.marker:
            if e.key == key:
                status, entry = "accept", e
                break
            status, entry = "changed", e
    for e in found:
        if e.marker == REVOKED_MARKER:
            if e.key == key:
                return "revoked", e, False
            if cert is not None and e.key == cert.ca_key:
                return "revoked", e, True
    return status, entry, False


def _check(path, host: str, port: int, key: bytes, cert: Certificate | None,
           now: float | None, clobber_port: bool) -> Verdict:
    """``check_host_key`` for the name of ``host``/``port`` (the bare name if ``clobber_port``)."""
    name = known_name(host, 0 if clobber_port else port)
    found = entries(path, name)
    notes: list[str] = []
    while True:
        status, entry, revoked_ca = _status(found, key, cert)
        if status == "revoked":
            return Verdict(status, name, entry, revoked_ca=revoked_ca, notes=notes)
        if status == "accept":
            problem = cert.problem(host, now) if cert is not None else None
            if problem is None:
                return Verdict(status, name, entry, by_certificate=cert is not None, notes=notes)
            notes.append(f"its host certificate was not accepted: {problem}")
            status, entry = "unknown", None  # and straight to the plain key, as ssh does
        elif status == "unknown" and not clobber_port and int(port) not in (0, 22):
            # "checking without port identifier": a key stored under the bare host name
            # is accepted on any port (only accepted: nothing else found there counts).
            bare = _check(path, host, port, key, cert, now, clobber_port=True)
            if bare.status in ("accept", "revoked"):
                # For a key revoked under the bare name ssh says "unknown" (and would add it
                # with accept-new); gpumagic refuses it as revoked, so --trust-new-host cannot.
                return bare
            notes.extend(n for n in bare.notes if n not in notes)
        if cert is None:
            return Verdict(status, name, entry, notes=notes)
        cert = None  # ssh: "No matching CA found. Retry with plain key"


def check(path: str | os.PathLike, host: str, port: int, key: paramiko.PKey | bytes,
          certificate: bytes | None = None, *, now: float | None = None) -> Verdict:
    """Decide, as ssh with ``StrictHostKeyChecking yes`` would, about a server's host key.

    Parameters
    ----------
    path : path
        The known_hosts file (a missing or unreadable one holds nothing).
    host : str
        The host name (``HostName``); compared in lower case, as ssh does.
    port : int
    key : paramiko.PKey or bytes
        The server's plain host key (the key inside the certificate, if it sent one).
    certificate : bytes, optional
        The host certificate the server sent (wire format), if the negotiated host key
        algorithm was a ``-cert-v01@openssh.com`` one.
    now : float, optional
        Seconds since the epoch for the certificate's validity (default: now).

    Returns
    -------
    Verdict
        ``accept`` when a stored key equals ``key`` or a ``@cert-authority`` key signed a
        valid certificate for ``host``; ``revoked``, ``changed`` or ``unknown`` otherwise.
    """
    blob = key if isinstance(key, bytes) else key.asbytes()
    cert = None
    notes = []
    if certificate is not None:
        try:
            cert = Certificate.parse(certificate)
            if cert.key != blob:
                raise ValueError("the certificate certifies another key")
        except ValueError as e:
            cert = None
            notes.append(f"its host certificate was not used: {e}")
    verdict = _check(path, _lower(host), port, blob, cert, now, clobber_port=False)
    verdict.notes[:0] = notes
    if verdict.status == "unknown" and certificate is None:
        names = {known_name(host, port), known_name(host, 0)}
        cas = [e for n in sorted(names) for e in entries(path, n) if e.marker == CA_MARKER]
        if cas:
            verdict.notes.append(
                f"{cas[0].where} is a {CA_MARKER} line, which trusts host certificates signed "
                "by its key (never the key itself), and the server sent no certificate")
    return verdict


def _alg_key_type(alg: str) -> str:
    """The plain key type a host key algorithm uses (``rsa-sha2-512-cert-v01@...`` -> ``ssh-rsa``)."""
    base = alg.replace("-cert-v01@openssh.com", "")
    if base.startswith("sk-") and not base.endswith("@openssh.com"):
        base += "@openssh.com"
    return _TYPE_ALIASES.get(base, base)


def host_key_algorithms(path: str | os.PathLike, host: str, port: int,
                        available: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """``available`` host key algorithms in the order ssh would ask for them.

    OpenSSH's ``order_hostkeyalgs``: over its default order (certificates first), the
    algorithms whose key type is stored (not revoked) for the name come first, and every
    certificate algorithm too when a ``@cert-authority`` line matches the name; the rest
    keep their order after them.  Algorithms not in ``available`` are left out; ones ssh
    does not know keep paramiko's order at the end.
    """
    found = entries(path, known_name(host, port))
    revoked = {e.key for e in found if e.marker == REVOKED_MARKER}
    # only the first stored key of each type is looked at (lookup_key_in_hostkeys_by_type)
    first_of_type: dict[str, bytes] = {}
    for e in found:
        if not e.marker:
            first_of_type.setdefault(e.key_type, e.key)
    known = {t for t, k in first_of_type.items() if k not in revoked}
    has_ca = any(e.marker == CA_MARKER for e in found)
    first, last = [], []
    for alg in DEFAULT_HOST_KEY_ALGORITHMS:
        is_cert = alg.endswith("-cert-v01@openssh.com")
        (first if (is_cert and has_ca) or _alg_key_type(alg) in known else last).append(alg)
    order = [a for a in first + last if a in available]
    return tuple(order + [a for a in available if a not in order])


# -- writing -------------------------------------------------------------------------------

def add(path: str | os.PathLike, host: str, port: int, key: paramiko.PKey) -> str:
    """Append ``name keytype base64`` for ``host``/``port``, as ssh writes a new host.

    The name is :func:`known_name` (lower case, ``[host]:port`` unless port 22), so that
    ``ssh`` finds the line.  Returns the line written (no newline).
    """
    path = Path(path)
    line = f"{known_name(host, port)} {key.get_name()} {key.get_base64()}\n"
    try:
        old = path.read_bytes()
    except FileNotFoundError:
        old = b""
    if old and not old.endswith(b"\n"):
        old += b"\n"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    atomic_write(path, old + line.encode(), mode=0o600 if not old else None)
    return line.rstrip("\n")


def _forget_matches(line: str, name: str) -> bool:
    # ssh-keygen -R (known_hosts_find_delete over hostkeys_foreach without key parsing):
    # a line goes when its host field matches and a known key type follows with something
    # after it; @cert-authority / @revoked lines and lines ssh finds invalid stay.
    rest = line.lstrip(" \t")
    if not rest or rest.startswith("#"):
        return False
    marker, rest = _split_marker(rest)
    if marker != "":
        return False
    parts = re.split(r"[ \t]+", rest, maxsplit=2)
    if not _host_field_matches(name, parts[0]):
        return False
    if len(parts) < 3 or not parts[2] or parts[2].startswith("#") or parts[1].startswith("#"):
        return False
    return bool(_named_types(parts[1]))


def forget(path: str | os.PathLike, host: str, port: int = 22) -> int:
    """Remove the host-key lines for ``host``/``port``, like ``ssh-keygen -R``; returns how many.

    Every line whose host field matches the name (patterns and hashes included) goes, except
    ``@cert-authority`` and ``@revoked`` lines, which stay.  Unlike ``ssh-keygen -R``, a file
    with lines ssh cannot read is still cleaned (those lines are kept as they are).  The
    previous file is kept as ``known_hosts.old``.
    """
    path = Path(path)
    name = known_name(host, port)
    try:
        text = path.read_bytes().decode("utf-8", errors="surrogateescape")
    except FileNotFoundError:
        return 0
    kept, removed = [], 0
    for line in re.findall(r"[^\n]*\n|[^\n]+\Z", text):
        if _forget_matches(line.rstrip("\n"), name):
            removed += 1
        else:
            kept.append(line)
    if removed:
        atomic_write(path, "".join(kept).encode("utf-8", errors="surrogateescape"),
                     backup=str(path) + ".old")
    return removed
