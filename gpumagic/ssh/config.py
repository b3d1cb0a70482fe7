"""ssh_config(5) read the way OpenSSH's ``ssh`` reads it (``readconf.c``, ``ssh.c``, 9.2).

This module is a port of the parts of OpenSSH that decide where ``ssh HOST`` connects: the
line reader (keyword case, ``Keyword value`` / ``Keyword=value``, ``"``/``'`` quoting and
``\\`` escapes, a line ending at a word that starts with ``#``), the first-obtained-value rule,
``Host`` patterns (``*``, ``?``, ``!`` negation, one pattern per word), ``Match`` with every
criterion of OpenSSH 9.2 (``all``, ``canonical``, ``final``, ``exec``, ``host``,
``originalhost``, ``user``, ``localuser`` and their ``!`` forms) including the final pass,
``Include`` kept inside the block it appears in, ``HostName`` ``%h`` expansion and lower-casing,
address canonicalisation, ``CanonicalizeHostname``, and the ``%`` / ``${VAR}`` / ``~``
expansion of ``IdentityFile`` and ``UserKnownHostsFile``.  ``ssh -G`` is the judge:
``tests/test_ssh_config_conformance.py`` compares this module with it on a corpus of configs.

Every line of every file read is checked as OpenSSH checks it, so a config that ``ssh``
refuses as a whole (a bad keyword, unbalanced quotes, ``Port 0``) raises :class:`ConfigError`
naming the file and line, instead of being half-applied.

Known, documented differences from ``ssh``:

* ``~`` and ``%d`` expand to ``home`` (``$HOME`` by default); ``ssh`` uses the passwd entry's
  home directory (the same thing outside of tests).
* Algorithm lists (``Ciphers``, ``MACs``, ``KexAlgorithms``, ``HostKeyAlgorithms``...) are
  not checked against the names ``ssh`` was built with.
* Keywords of later OpenSSH releases (``ChannelTimeout``, ``ObscureKeystrokeTiming``,
  ``Tag``, ``VersionAddendum``, ``RefuseConnection``, ``WarnWeakCrypto``) and Apple's
  ``UseKeychain`` are accepted and ignored; OpenSSH 9.2 refuses them.  Unknown keywords in
  the system-wide ``/etc/ssh/ssh_config`` are skipped (vendors patch their own in there).
* ``Match exec`` commands get :data:`EXEC_TIMEOUT` seconds; ``ssh`` waits for ever.
"""

from __future__ import annotations

import glob as _glob
import hashlib
import os
import re
import socket
import subprocess
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Callable, ClassVar

from .. import localpath
from ..errors import ConfigError

WHITESPACE = " \t\r\n"
INT_MAX = 2**31 - 1
READCONF_MAX_DEPTH = 16
SSH_MAX_IDENTITY_FILES = 100
SSH_MAX_HOSTS_FILES = 32
MAX_CANON_DOMAINS = 32
#: The system-wide files on POSIX; on Windows they live in ``%PROGRAMDATA%\ssh``
#: (:func:`gpumagic.localpath.ssh_system_dir`), which is what SshConfig reads there.
SYSTEM_CONFIG = "/etc/ssh/ssh_config"
SSH_SYSTEM_DIR = localpath.POSIX_SSH_DIR

#: Seconds a ``Match exec`` command may run before gpumagic gives up on the config.
EXEC_TIMEOUT = 15.0

# read_config_file flags (readconf.h)
CHECKPERM = 1
USERCONF = 2
FINAL = 4
NEVERMATCH = 8

CANON_NO, CANON_YES, CANON_ALWAYS = 0, 1, 2

_CONFIG_HINT = "fix that line (OpenSSH's ssh refuses this config too: try `ssh -G HOST`)"


# -- small C helpers ------------------------------------------------------------------------

def lowercase(s: str) -> str:
    """ASCII-only lower-casing, as ``tolower`` in OpenSSH's C locale (``ü`` stays ``ü``)."""
    return s.translate(_LOWER)


_LOWER = {c: c + 32 for c in range(ord("A"), ord("Z") + 1)}


_CSPACE = " \t\n\v\f\r"


def _isspace(c: str) -> bool:
    return c in _CSPACE


def _strtol_prefix(s: str, base: int = 10) -> tuple[int | None, int]:
    """C ``strtol``: (value or None when no digits, index after the number)."""
    i, n = 0, len(s)
    while i < n and _isspace(s[i]):
        i += 1
    sign = 1
    if i < n and s[i] in "+-":
        sign = -1 if s[i] == "-" else 1
        i += 1
    if base == 0:
        if s[i:i + 2].lower() == "0x" and i + 2 < n and s[i + 2] in "0123456789abcdefABCDEF":
            base, i = 16, i + 2
        elif s[i:i + 1] == "0":
            base = 8
        else:
            base = 10
    digits = "0123456789abcdef"[:base]
    j = i
    while j < n and s[j].lower() in digits:
        j += 1
    if j == i:
        return None, 0
    return sign * int(s[i:j], base), j


def strtonum(s: str | None, lo: int, hi: int) -> tuple[int, str | None]:
    """OpenBSD ``strtonum`` (base 10, the whole string): (value, None) or (0, reason)."""
    if s is None:
        return 0, "invalid"
    value, end = _strtol_prefix(s)
    if value is None or end != len(s):
        return 0, "invalid"
    if value < lo:
        return 0, "too small"
    if value > hi:
        return 0, "too large"
    return value, None


def a2port(s: str) -> int:
    """``a2port``: a port number 0-65535 or a TCP service name (``ssh`` -> 22); -1 if neither."""
    value, err = strtonum(s, 0, 65535)
    if err is None:
        return value
    try:
        return socket.getservbyname(s, "tcp")
    except (OSError, UnicodeError, ValueError):
        return -1


def convtime(s: str | None) -> int:
    """``convtime``: ``30``, ``30s``, ``1m``, ``1h30m``, ``2d``, ``1w`` -> seconds; -1 if invalid."""
    if not s:
        return -1
    total, p = 0, s
    mult = {"s": 1, "S": 1, "m": 60, "M": 60, "h": 3600, "H": 3600, "d": 86400, "D": 86400,
            "w": 604800, "W": 604800}
    while p:
        secs, end = _strtol_prefix(p)
        if secs is None or secs < 0 or secs >= INT_MAX:
            return -1
        unit = p[end:end + 1]
        if unit == "":
            m, rest = 1, ""
        elif unit in mult:
            m, rest = mult[unit], p[end + 1:]
        else:
            return -1
        if secs > INT_MAX // m:
            return -1
        secs *= m
        if total > INT_MAX - secs:
            return -1
        total += secs
        p = rest
    return total


def _time_problem(arg: str) -> str:
    """Why ``convtime`` refused ``arg``: 'out of range' or 'not a time'."""
    if re.fullmatch(r"\s*[+-]?\d+[sSmMhHdDwW]?(\d+[sSmMhHdDwW]?)*", arg):
        return "is out of range (0 to 2147483647 seconds)"
    return "is not a time (ssh reads 30, 30s, 1m, 1h30m, 2d)"


def strdelim(s: str | None, split_equals: bool = True) -> tuple[str | None, str | None]:
    """``strdelim``: (next token, rest); splits at whitespace, ``"..."`` and one ``=``."""
    if s is None:
        return None, None
    delims = WHITESPACE + '"' + ("=" if split_equals else "")
    idx = next((i for i, c in enumerate(s) if c in delims), -1)
    if idx < 0:
        return s, None
    if s[idx] == '"':
        s = s[:idx] + s[idx + 1:]
        end = s.find('"', idx)
        if end < 0:
            return None, None  # no matching quote
        return s[:end], s[end + 1:].lstrip(WHITESPACE)
    equals = split_equals and s[idx] == "="
    token, rest = s[:idx], s[idx + 1:].lstrip(WHITESPACE)
    if split_equals and rest.startswith("=") and not equals:
        rest = rest[1:].lstrip(WHITESPACE)
    return token, rest


def argv_split(s: str, terminate_on_comment: bool = True) -> list[str] | None:
    """``argv_split``: words with ``"``/``'`` quotes and ``\\`` escapes; None for bad quotes."""
    out: list[str] = []
    i, n = 0, len(s)
    while i < n:
        if s[i] in " \t":
            i += 1
            continue
        if terminate_on_comment and s[i] == "#":
            break
        quote, arg = "", []
        while i < n:
            c = s[i]
            if c == "\\":
                nxt = s[i + 1] if i + 1 < n else ""
                if nxt in ("'", '"', "\\") and nxt or (not quote and nxt == " "):
                    i += 1
                    arg.append(nxt)
                else:
                    arg.append(c)
            elif not quote and c in " \t":
                break
            elif not quote and c in "\"'":
                quote = c
            elif quote and c == quote:
                quote = ""
            else:
                arg.append(c)
            i += 1
        out.append("".join(arg))
        if i >= n:
            if quote:
                return None
            break
    return out


def match_pattern(s: str, pattern: str) -> bool:
    """``match_pattern``: ``*`` and ``?`` wildcards, nothing else, case-sensitive."""
    rx = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(rx, s, re.DOTALL) is not None


def match_pattern_list(string: str, pattern: str, dolower: bool) -> int:
    """``match_pattern_list``: 1 on a match, -1 on a negated match, 0 otherwise."""
    got_positive = 0
    for sub in pattern.split(","):
        negated = sub.startswith("!")
        if negated:
            sub = sub[1:]
        if len(sub) >= 1023:
            return 0
        if dolower:
            sub = lowercase(sub)
        if match_pattern(string, sub):
            if negated:
                return -1
            got_positive = 1
    return got_positive


def match_hostname(host: str, pattern: str) -> int:
    return match_pattern_list(lowercase(host), pattern, True)


def ssh_valid_hostname(s: str) -> bool:
    """Debian's ``ssh_valid_hostname``: no shell metacharacters, blanks or leading ``-``."""
    if s.startswith("-"):
        return False
    return not any(c in "'`\"$\\;&<>|(){}," or c in _CSPACE or ord(c) < 32 or ord(c) == 127 for c in s)


def ssh_valid_ruser(s: str) -> bool:
    """``ssh_valid_ruser``: the check ssh applies to a user name given on its command line."""
    if s.startswith("-"):
        return False
    for i, c in enumerate(s):
        if ord(c) < 32 or ord(c) == 127 or c in "'`\";&<>|(){}":
            return False
        if c in _CSPACE and s[i + 1:i + 2] == "-":
            return False
        if c == "\\" and i == len(s) - 1:
            return False
    return True


def valid_domain(name: str) -> tuple[str | None, str | None]:
    """``valid_domain``: (name lower-cased without a trailing dot, None) or (None, reason)."""
    if not name:
        return None, "empty domain name"
    if not (name[0].isascii() and name[0].isalnum()):
        return None, f'domain name "{name}" starts with invalid character'
    last = ""
    for c in lowercase(name):
        if last == "." and c == ".":
            return None, f'domain name "{name}" contains consecutive separators'
        if c not in ".-_" and not (c.isascii() and c.isalnum()):
            return None, f'domain name "{name}" contains invalid characters'
        last = c
    out = lowercase(name)
    return (out[:-1] if out.endswith(".") else out), None


class ExpandError(ValueError):
    """A ``%`` token or ``${VAR}`` that OpenSSH cannot expand."""


def percent_expand(string: str, tokens: dict[str, str] | None, *, dollar: bool = False,
                   env: dict | None = None) -> str:
    """``percent_expand`` / ``percent_dollar_expand`` / ``dollar_expand``.

    ``tokens`` maps a letter to its value (None: no ``%`` expansion); ``%%`` is ``%``.

    Raises
    ------
    ExpandError
        For an unknown ``%x``, a trailing ``%``, or a ``${VAR}`` that is unset or unclosed.
    """
    env = os.environ if env is None else env
    out, i, n = [], 0, len(string)
    while i < n:
        c = string[i]
        if dollar and c == "$" and string[i + 1:i + 2] == "{":
            end = string.find("}", i + 2)
            if end < 0:
                raise ExpandError(f"${{...}} in {string!r} has no closing '}}'")
            var = string[i + 2:end]
            if not var:
                raise ExpandError(f"empty ${{}} in {string!r}")
            if var not in env:
                raise ExpandError(f"environment variable ${{{var}}} (in {string!r}) is not set")
            out.append(env[var])
            i = end + 1
            continue
        if c != "%" or tokens is None:
            out.append(c)
            i += 1
            continue
        key = string[i + 1:i + 2]
        if key == "%":
            out.append("%")
        elif key == "":
            raise ExpandError(f"{string!r} ends with a lone %")
        elif key in tokens:
            out.append(tokens[key])
        else:
            raise ExpandError(f"%{key} in {string!r} is not a token here (write %% for a %)")
        i += 2
    return "".join(out)


def _home_of(user: str) -> str:
    """``getpwnam(user)->pw_dir``; KeyError for an unknown user.  Windows has no passwd
    database: there ``~user`` is known for the current user alone (``%USERPROFILE%``), as
    OpenSSH for Windows' own ``getpwnam`` resolves only accounts it can look up."""
    try:
        import pwd
    except ImportError:
        if user.lower() == local_user().lower():
            return os.path.expanduser("~")
        raise KeyError(user) from None
    return pwd.getpwnam(user).pw_dir


def tilde_expand(filename: str, home: str, *, windows: bool | None = None) -> str:
    """``tilde_expand_filename``: ``~``, ``~/path``, ``~user/path`` (``home`` for ``~``).

    On Windows (``windows``, default this computer) ``~\\path`` is ``~/path`` and the result
    is written with backslashes, as OpenSSH for Windows takes ``~`` for ``%USERPROFILE%``
    (see :mod:`gpumagic.localpath`).

    Raises
    ------
    ExpandError
        For ``~user`` of an unknown user.
    """
    parts = localpath.split_tilde(filename, windows=windows)
    if parts is None:
        return filename
    user, path = parts
    if user:
        try:
            base = _home_of(user)
        except KeyError:
            raise ExpandError(f"{filename!r}: no such user {user!r}") from None
    else:
        base = home
    return localpath.join_home(base, path, windows=windows)


def hpdelim2(s: str | None) -> tuple[str | None, str | None, str]:
    """``hpdelim2``: (host field, rest or None, delimiter) -- ``[v6]`` brackets kept."""
    if s is None:
        return None, None, ""
    if s.startswith("["):
        end = s.find("]")
        if end < 0:
            return None, None, ""
        k = end + 1
    else:
        k = next((i for i, c in enumerate(s) if c in ":/"), len(s))
    if k >= len(s):
        return s, None, ""
    if s[k] in ":/":
        return s[:k], s[k + 1:], s[k]
    return None, None, ""


def cleanhostname(host: str) -> str:
    if host.startswith("[") and host.endswith("]") and len(host) >= 2:
        return host[1:-1]
    return host


def parse_user_host_port(s: str) -> tuple[str | None, str, int] | None:
    """``parse_user_host_port``: ``[user@]host[:port]`` -> (user, host, port or -1); None if bad."""
    user = None
    at = s.rfind("@")
    if at >= 0:
        if at == 0:
            return None
        user, s = s[:at], s[at + 1:]
    host, rest, delim = hpdelim2(s)
    if host is None or host == "" or delim == "/":
        return None
    host = cleanhostname(host)
    port = -1
    if rest:
        port = a2port(rest)
        if port <= 0:
            return None
    return user, host, port


def _urldecode(s: str) -> str | None:
    out, i = [], 0
    while i < len(s):
        c = s[i]
        if c == "+":
            out.append(" ")
        elif c == "%":
            h = s[i + 1:i + 3]
            if len(h) != 2 or not all(x in "0123456789abcdefABCDEF" for x in h) or int(h, 16) == 0:
                return None
            out.append(chr(int(h, 16)))
            i += 2
        else:
            out.append(c)
        i += 1
    return "".join(out)


def parse_ssh_uri(uri: str, *, allow_v6: bool = False) -> tuple[int, str | None, str | None, int]:
    """``parse_ssh_uri``: (0, user, host, port) for ``ssh://``, (1, ...) if not a URI, (-1, ...) if bad.

    ``allow_v6``: also accept ``ssh://[2001:db8::1]`` (RFC 3986), which OpenSSH refuses.
    """
    if not uri.startswith("ssh://"):
        return 1, None, None, -1
    tmp = uri[len("ssh://"):]
    user = None
    at = tmp.find("@")
    if at >= 0:
        info = tmp[:at].split(";", 1)[0]
        if info == "":
            return -1, None, None, -1
        user = _urldecode(info)
        if user is None:
            return -1, None, None, -1
        tmp = tmp[at + 1:]
    host, rest, delim = hpdelim2(tmp)
    if host is None or host == "":
        return -1, None, None, -1
    bracketed = host.startswith("[")
    host = cleanhostname(host)
    if valid_domain(host)[0] is None and not (allow_v6 and bracketed and _numeric_addr(host, -1)):
        return -1, None, None, -1
    port, path = -1, None
    if rest:
        if delim == ":":
            p, slash, after = rest.partition("/")
            port = a2port(p)
            if port <= 0:
                return -1, None, None, -1
            rest = after if slash else None
        if rest:
            path = _urldecode(rest)
            if path is None:
                return -1, None, None, -1
    if path is not None:
        return -1, None, None, -1  # a path is not allowed in an ssh:// destination
    return 0, user, host, port


def format_hop(user: str | None, host: str, port: int) -> str:
    """One jump host as gpumagic's targets write it: ``[user@]host[:port]``, ``[v6]:port``."""
    h = f"[{host}]" if ":" in host else host
    return f"{user + '@' if user else ''}{h}{':' + str(port) if port > 0 else ''}"


def parse_hop(text: str) -> tuple[str | None, str, int] | None:
    """One ``ProxyJump`` hop (``ssh://`` URI or ``[user@]host[:port]``); None if ssh refuses it."""
    r, user, host, port = parse_ssh_uri(text)
    if r == -1:
        return None
    if r == 0:
        return user, host or "", port
    return parse_user_host_port(text)


def _parse_fwd_field(s: str) -> tuple[str, bool, str | None] | None:
    """``parse_fwd_field``: (field, is_path, rest or None at the end); None on error."""
    if s == "":
        return None
    if s.startswith("["):
        end = 1
        ispath = False
        while end < len(s) and s[end] != "]":
            ispath = ispath or s[end] == "/"
            end += 1
        if end >= len(s) or (end + 1 < len(s) and s[end + 1] != ":"):
            return None
        return s[1:end], ispath, s[end + 2:]
    out, ispath, i = [], False, 0
    while i < len(s):
        c = s[i]
        if c == "\\":
            if i + 1 >= len(s):
                return None
            out.append(s[i + 1])
            i += 2
            continue
        if c == "/":
            ispath = True
        if c == ":":
            return "".join(out), ispath, s[i + 1:]
        out.append(c)
        i += 1
    return "".join(out), ispath, ""


def parse_forward(spec: str, dynamic: bool, remote: bool) -> bool:
    """``parse_forward``: whether OpenSSH accepts a ``LocalForward``/``-L`` (etc.) spec."""
    try:
        cp = percent_expand(spec, None, dollar=True)
    except ExpandError:
        return False
    cp = cp.lstrip(" \t\n\v\f\r")
    fields: list[tuple[str, bool]] = []
    rest: str | None = cp
    while len(fields) < 4 and rest is not None:
        got = _parse_fwd_field(rest)
        if got is None:
            rest = None
            break
        fields.append(got[:2])
        rest = got[2] if got[2] != "" else None
        if got[2] == "":
            rest = ""
            break
    if rest:
        return False
    n = len(fields)
    listen_port = connect_port = 0
    listen_path = connect_path = None
    if n == 1:
        if fields[0][1]:
            listen_path = fields[0][0]
        else:
            listen_port = a2port(fields[0][0])
    elif n == 2:
        if fields[0][1] and fields[1][1]:
            listen_path, connect_path = fields[0][0], fields[1][0]
        elif fields[1][1]:
            listen_port, connect_path = a2port(fields[0][0]), fields[1][0]
        else:
            listen_port = a2port(fields[1][0])
    elif n == 3:
        if fields[0][1]:
            listen_path, connect_port = fields[0][0], a2port(fields[2][0])
        elif fields[2][1]:
            listen_port, connect_path = a2port(fields[1][0]), fields[2][0]
        else:
            listen_port, connect_port = a2port(fields[0][0]), a2port(fields[2][0])
    elif n == 4:
        listen_port, connect_port = a2port(fields[1][0]), a2port(fields[3][0])
    else:
        return False
    if dynamic:
        if n not in (1, 2):
            return False
    else:
        if n not in (3, 4) and connect_path is None and listen_path is None:
            return False
        if connect_port <= 0 and connect_path is None:
            return False
    if (listen_port < 0 and listen_path is None) or (not remote and listen_port == 0 and listen_path is None):
        return False
    return True


# -- the options ssh collects ----------------------------------------------------------------

@dataclass
class Options:
    """The ssh options gpumagic needs, unset (-1 / None / empty) until a line sets them.

    Field names follow ``readconf.h``.  Filled by the command line first, then the config
    files; the first value obtained for each option is kept (ssh_config(5)).
    """

    user: str | None = None
    hostname: str | None = None
    port: int = -1
    identity_files: list = field(default_factory=list)  # [(path, user_provided)]
    identities_only: int = -1
    server_alive_interval: int = -1
    server_alive_count_max: int = -1
    connection_timeout: int = -1
    user_hostfiles: list = field(default_factory=list)
    jump_user: str | None = None
    jump_host: str | None = None
    jump_port: int = -1
    jump_extra: str | None = None
    proxy_command: str | None = None
    host_key_alias: str | None = None
    canonicalize_hostname: int = -1
    canonical_domains: list = field(default_factory=list)
    canonicalize_max_dots: int = -1
    canonicalize_fallback_local: int = -1
    permitted_cnames: list = field(default_factory=list)
    ignored_unknown: str | None = None
    address_family: int = -1
    batch_mode: int = -1
    compression: int = -1
    #: set when the user name came from the command line (-l, user@, gpumagic's --user)
    user_on_commandline: bool = False

    def add_identity_file(self, path: str, user_provided: bool = True) -> None:
        """``add_identity_file``: append unless the same path (and origin) is already listed."""
        if (path, user_provided) not in self.identity_files:
            self.identity_files.append((path, user_provided))


_MULTI = {
    "flag": {"true": 1, "false": 0, "yes": 1, "no": 0},
    "yesnoask": {"true": 1, "false": 0, "yes": 1, "no": 0, "ask": 2},
    "strict": {"true": 1, "false": 0, "yes": 1, "no": 0, "ask": 2, "off": 0, "accept-new": 3},
    "yesnoaskconfirm": {"true": 1, "false": 0, "yes": 1, "no": 0, "ask": 2, "confirm": 3},
    "addressfamily": {"inet": socket.AF_INET, "inet6": socket.AF_INET6, "any": socket.AF_UNSPEC},
    "controlmaster": {"true": 1, "yes": 1, "false": 0, "no": 0, "auto": 2, "ask": 3, "autoask": 4},
    "tunnel": {"ethernet": 2, "point-to-point": 1, "true": 1, "yes": 1, "false": 0, "no": 0},
    "requesttty": {"true": 1, "yes": 1, "false": 0, "no": 0, "force": 2, "auto": 3},
    "sessiontype": {"none": 0, "subsystem": 1, "default": 2},
    "canonicalizehostname": {"true": 1, "false": 0, "yes": 1, "no": 0, "always": 2},
    "pubkeyauth": {"true": 1, "false": 0, "yes": 1, "no": 0, "unbound": 2, "host-bound": 3},
    "compression": {"yes": 1, "no": 0},
}

_LOG_LEVELS = {"silent", "quiet", "fatal", "error", "info", "verbose", "debug", "debug1", "debug2", "debug3"}
_LOG_FACILITIES = {"daemon", "user", "auth", "authpriv"} | {f"local{i}" for i in range(8)}
_DIGESTS = {"md5", "sha1", "sha256", "sha384", "sha512"}
_IPQOS = {"none", "af11", "af12", "af13", "af21", "af22", "af23", "af31", "af32", "af33", "af41",
          "af42", "af43", "cs0", "cs1", "cs2", "cs3", "cs4", "cs5", "cs6", "cs7", "ef", "le",
          "lowdelay", "throughput", "reliability"}

#: keyword (lower case) -> (how its arguments are read, Options field or multistate table)
KEYWORDS: dict[str, tuple[str, str | None]] = {}


def _kw(kind: str, names: str, attr: str | None = None) -> None:
    for name in names.split():
        KEYWORDS[name] = (kind, attr)


_kw("ignore", "protocol")
_kw("deprecated", "cipher fallbacktorsh globalknownhostsfile2 rhostsauthentication useblacklistedkeys "
    "userknownhostsfile2 useroaming usersh useprivilegedport")
_kw("unsupported", "afstokenpassing kerberosauthentication kerberostgtpassing rsaauthentication "
    "rhostsrsaauthentication compressionlevel")
# Newer OpenSSH releases (9.5-10.1) and Apple's ssh: accepted and ignored, see the module docstring.
_kw("later", "channeltimeout obscurekeystroketiming tag versionaddendum refuseconnection "
    "warnweakcrypto usekeychain")
_kw("flag", "gssapiauthentication gssapikeyexchange gssapidelegatecredentials gssapitrustdns "
    "gssapirenewalforcesrekey forwardx11 forwardx11trusted exitonforwardfailure gatewayports "
    "passwordauthentication kbdinteractiveauthentication challengeresponseauthentication "
    "skeyauthentication tisauthentication hostbasedauthentication checkhostip tcpkeepalive "
    "keepalive nohostauthenticationforlocalhost enablesshkeysign clearallforwardings "
    "hashknownhosts permitlocalcommand visualhostkey stdinnull forkafterauthentication "
    "proxyusefdpass streamlocalbindunlink enableescapecommandline")
_kw("flag", "identitiesonly", "identities_only")
_kw("flag", "batchmode", "batch_mode")
_kw("flag", "canonicalizefallbacklocal", "canonicalize_fallback_local")
_kw("string", "gssapiclientidentity gssapiserveridentity pkcs11provider smartcarddevice "
    "kbdinteractivedevices xauthlocation preferredauthentications bindaddress bindinterface "
    "securitykeyprovider controlpath revokedhostkeys")
_kw("string", "user", "user")
_kw("string", "hostname", "hostname")
_kw("string", "hostkeyalias", "host_key_alias")
_kw("string", "ignoreunknown", "ignored_unknown")
_kw("algos", "gssapikexalgorithms ciphers macs kexalgorithms hostkeyalgorithms casignaturealgorithms "
    "hostbasedacceptedalgorithms hostbasedkeytypes pubkeyacceptedalgorithms pubkeyacceptedkeytypes")
_kw("pubkeyauth", "pubkeyauthentication dsaauthentication")
_kw("identityfile", "identityfile identityfile2")
_kw("certificatefile", "certificatefile")
_kw("addkeystoagent", "addkeystoagent")
_kw("identityagent", "identityagent")
_kw("forwardagent", "forwardagent")
_kw("command", "proxycommand", "proxy_command")
_kw("command", "localcommand remotecommand knownhostscommand")
_kw("proxyjump", "proxyjump")
_kw("port", "port")
_kw("forward_remote", "remoteforward")
_kw("forward_local", "localforward")
_kw("forward_dynamic", "dynamicforward")
_kw("permitremoteopen", "permitremoteopen")
_kw("host", "host")
_kw("match", "match")
_kw("escapechar", "escapechar")
_kw("strarray", "globalknownhostsfile")
_kw("strarray", "userknownhostsfile", "user_hostfiles")
_kw("int", "connectionattempts numberofpasswordprompts requiredrsasize")
_kw("int", "serveralivecountmax", "server_alive_count_max")
_kw("int", "canonicalizemaxdots", "canonicalize_max_dots")
_kw("strict", "stricthostkeychecking")
_kw("compression", "compression", "compression")
_kw("logfacility", "syslogfacility")
_kw("loglevel", "loglevel")
_kw("logverbose", "logverbose")
_kw("yesnoask", "verifyhostkeydns updatehostkeys")
_kw("rekeylimit", "rekeylimit")
_kw("time", "forwardx11timeout")
_kw("time", "connecttimeout", "connection_timeout")
_kw("time", "serveraliveinterval protocolkeepalives setuptimeout", "server_alive_interval")
_kw("addressfamily", "addressfamily", "address_family")
_kw("sendenv", "sendenv")
_kw("setenv", "setenv")
_kw("controlmaster", "controlmaster")
_kw("controlpersist", "controlpersist")
_kw("include", "include")
_kw("tunnel", "tunnel")
_kw("tunneldevice", "tunneldevice")
_kw("ipqos", "ipqos")
_kw("requesttty", "requesttty")
_kw("sessiontype", "sessiontype")
_kw("canonicaldomains", "canonicaldomains")
_kw("canonicalizehostname", "canonicalizehostname", "canonicalize_hostname")
_kw("permittedcnames", "canonicalizepermittedcnames")
_kw("streamlocalbindmask", "streamlocalbindmask")
_kw("fingerprinthash", "fingerprinthash")


def local_user() -> str:
    """The local user name as ``ssh`` takes it (``getpwuid(getuid())``: ``%u``, ``Match
    localuser``, the default ``User``); ``getpass.getuser()`` where there is no passwd entry."""
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError, AttributeError):
        import getpass

        return getpass.getuser()


@dataclass
class Local:
    """The local side, as ``ssh`` takes it from ``getpwuid(getuid())`` and ``gethostname``.

    ``home`` is used for ``~`` and ``%d``; ``user`` for ``%u``, ``Match localuser`` and the
    default remote user.
    """

    user: str
    home: str
    uid: int
    thishost: str

    @classmethod
    def current(cls, home: str | os.PathLike | None = None) -> "Local":
        user, uid = local_user(), getattr(os, "getuid", lambda: 0)()
        home = os.fspath(home) if home else os.path.expanduser("~")
        return cls(user=user, home=home, uid=uid, thishost=socket.gethostname())


def _secure_permissions(st: os.stat_result, uid: int) -> bool:
    """``secure_permissions`` with Debian's private-group rule (``user-group-modes.patch``)."""
    if st.st_uid not in (0, uid):
        return False
    if st.st_mode & 0o002:
        return False
    if st.st_mode & 0o020:
        try:
            import grp
            import pwd

            gr = grp.getgrgid(st.st_gid)
            members = 0
            for pw in pwd.getpwall():
                if pw.pw_gid == gr.gr_gid:
                    members += 1
                    if pw.pw_uid != uid:
                        return False
            owner = pwd.getpwuid(st.st_uid).pw_name
            if gr.gr_mem:
                members += 1
                if gr.gr_mem[0] != owner or len(gr.gr_mem) > 1:
                    return False
            if not members:
                return False
        except (ImportError, KeyError):
            return False
    return True


class _Bad(Exception):
    """One bad line: counted, reported with its file and line when the file ends."""


def _array_values(av, written: str):
    """The values of an array keyword, read to the end of the line (OpenSSH readconf.c's loop
    for SendEnv, LogVerbose, CanonicalDomains, ...): a value may not be empty, and ``none``
    must stand alone.  A generator: each value is checked before it is handed out.

    Raises
    ------
    _Bad
        An empty value, or ``none`` among others.
    """
    i = 0
    while (arg := av.next()) is not None:
        if arg == "":
            raise _Bad(f"{written} has an empty value")
        if arg.lower() == "none" and (i > 0 or av.left > 0):
            raise _Bad(f'{written} "none" must appear alone')
        i += 1
        yield arg


class _Fatal(ConfigError):
    """An error after which OpenSSH stops at once (``fatal()``)."""


def _shown(path: str, home: str) -> str:
    """A path as messages show it: ``~/.ssh/config`` rather than ``/home/me/.ssh/config``."""
    home = home.rstrip("/")
    if home and (path == home or path.startswith(home + "/")):
        return "~" + path[len(home):]
    return path


# -- reading files ---------------------------------------------------------------------------

class SshConfig:
    """An ssh client configuration: the files ``ssh`` reads, read when a host is resolved.

    Parameters
    ----------
    path : path, optional
        A config file given explicitly (``ssh -F FILE``): read without the ownership check
        and without the system-wide file.  Default: ``~/.ssh/config`` (checked like ``ssh``
        does: owned by you or root, not writable by others), then ``/etc/ssh/ssh_config``.
    home : path, optional
        The home directory for ``~``, ``%d`` and relative ``Include`` (``~/.ssh/...``).
    text : str, optional
        The contents of ``path`` (or of an unnamed file) instead of reading it.
    system : path or None, optional
        The system-wide file read after the user's (default ``/etc/ssh/ssh_config`` when
        ``path`` is not given; None for none).

    Raises
    ------
    ConfigError
        An explicit ``path`` that does not exist, or a file that cannot be read.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, home: str | os.PathLike | None = None,
                 text: str | None = None, system: str | os.PathLike | None | bool = True):
        self.home = os.fspath(home) if home else os.path.expanduser("~")
        self.explicit = path is not None or text is not None
        self.text = text
        user_file, system_file = localpath.ssh_config_files(self.home)
        if path is None and text is None:
            path = user_file
        self.path = os.fspath(path) if path is not None else "<config>"
        if system is True:
            system = None if self.explicit else system_file
        self.system = os.fspath(system) if system else None
        if text is None:
            try:
                Path(self.path).read_bytes()
            except FileNotFoundError:
                if self.explicit:
                    raise ConfigError(f"cannot open ssh config {_shown(self.path, self.home)}: no such file",
                                      "check the path given with -F") from None
            except IsADirectoryError:
                pass
            except OSError as e:
                raise ConfigError(f"cannot read {_shown(self.path, self.home)}: {e.strerror}",
                                  f"check the permissions of {self.path}") from None

    @classmethod
    def from_text(cls, text: str, *, home: str | os.PathLike | None = None,
                  name: str = "<config>") -> "SshConfig":
        """A config whose main file holds ``text`` (``Include`` still reads real files)."""
        return cls(name, home=home, text=text, system=None)

    def _read(self, path: str) -> list[str] | None:
        if self.text is not None and path == self.path:
            data = self.text.encode("utf-8", "surrogateescape")
        else:
            try:
                data = Path(path).read_bytes()
            except (FileNotFoundError, NotADirectoryError):
                return None
            except IsADirectoryError:
                data = b""
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        return [ln.decode("utf-8", "surrogateescape") for ln in lines]

    # -- the aliases a user can type -------------------------------------------------------

    def aliases(self) -> list[str]:
        """Concrete ``Host`` names (no ``*``, ``?``, ``!``) that can apply to themselves.

        Names in a file included inside ``Host P`` count only when ``P`` matches them (as
        ``ssh`` applies them); lines that cannot be read are skipped here.  Sorted.
        """
        names: list[str] = []
        self._scan(self.path, [], names, 0, True)
        return sorted(dict.fromkeys(names))

    def _scan(self, path: str, outer: list[list[str]], names: list[str], depth: int, user: bool) -> None:
        if depth > READCONF_MAX_DEPTH:
            return
        try:
            lines = self._read(path)
        except OSError:
            return
        context: list[str] | None = None  # patterns of the Host block we are in
        for line in lines or []:
            parsed = _split_line(line)
            if parsed is None:
                continue
            keyword, _raw, args = parsed
            if keyword == "host":
                context = args
                for name in args:
                    if name and not any(c in name for c in "*?!") and all(
                            _host_line_matches(name, pats) for pats in outer + [args]):
                        names.append(name)
            elif keyword == "match":
                context = None
            elif keyword == "include":
                inner = outer + ([context] if context else [])
                for arg in args:
                    for p in self._include_paths(arg, user):
                        self._scan(p, inner, names, depth + 1, user)

    def _include_paths(self, arg: str, user: bool) -> list[str]:
        if not localpath.pathmod().isabs(arg) and not arg.startswith("~"):  # Windows: C:\x, \\srv\x
            arg = ("~/.ssh/" + arg if user else localpath.pathmod().join(localpath.ssh_system_dir(), arg))
        if arg.startswith("~"):
            try:
                arg = tilde_expand(arg, self.home)
            except ExpandError:
                return []
        return sorted(_glob.glob(arg))

    # -- resolution ------------------------------------------------------------------------

    def lookup(self, host: str, **kwargs) -> dict:
        """``ssh -G host`` as a dict of the values gpumagic uses (lower-case keywords).

        Keys: ``host``, ``hostname``, ``user``, ``port``, ``identityfile`` (list, as written),
        ``proxyjump`` (when set), ``connecttimeout`` (when set).

        Raises
        ------
        ConfigError
            As :func:`resolve_options`.
        """
        r = resolve_options(host, self, **kwargs)
        out = {"host": r.host_arg, "hostname": r.hostname, "user": r.user, "port": r.port,
               "identityfile": list(r.identity_files)}
        if r.proxy_jump:
            out["proxyjump"] = r.proxy_jump
        if r.connect_timeout is not None:
            out["connecttimeout"] = r.connect_timeout
        return out


def _split_line(line: str) -> tuple[str, str, list[str]] | None:
    """(keyword lower-cased, rest of the line, words) as readconf reads a line; None if empty."""
    line = line[:1] + line[1:].rstrip(WHITESPACE + "\f")
    keyword, rest = strdelim(line)
    if keyword is None:
        return None
    if keyword == "":
        keyword, rest = strdelim(rest)
    if not keyword or keyword[0] in "\n#":
        return None
    if rest is not None:
        rest = rest.lstrip(WHITESPACE)
    args = argv_split(rest or "") or []
    return lowercase(keyword), rest or "", args


def _host_line_matches(host: str, patterns: list[str]) -> bool:
    active = False
    for arg in patterns:
        negated = arg.startswith("!")
        if match_pattern(host, arg[1:] if negated else arg):
            if negated:
                return False
            active = True
    return active


# -- processing lines ------------------------------------------------------------------------

class _Args:
    """``argv_next`` / ``argv_consume`` over one line's words."""

    def __init__(self, words: list[str]):
        self.words, self.i = words, 0

    def next(self) -> str | None:
        if self.i >= len(self.words):
            return None
        self.i += 1
        return self.words[self.i - 1]

    @property
    def left(self) -> int:
        return len(self.words) - self.i

    def consume(self) -> None:
        self.i = len(self.words)


@dataclass
class _Line:
    """One config line as a keyword handler of :class:`_Reader` reads it.

    The locals of readconf.c's ``process_config_line_depth`` that its cases share: the
    keyword as ``written`` (for messages), the ``rest`` of the line after it and its words
    ``av``; ``kind`` and ``attr`` from :data:`KEYWORDS`; ``active``, the one-element list that
    ``Host`` / ``Match`` / ``Include`` switch, and ``on``, its value when the line was read;
    ``cmdline`` for an ``ssh -o`` argument; the file's ``flags``, ``want_final`` and Include
    ``depth``; where the line is (``filename``, ``linenum``).
    """

    written: str
    rest: str
    av: _Args
    kind: str
    attr: str | None
    active: list[bool]
    cmdline: bool
    flags: int
    want_final: list[bool] | None
    depth: int
    filename: str
    linenum: int
    on: bool = field(init=False)

    def __post_init__(self) -> None:
        self.on = self.active[0]

    def need(self, arg: str | None) -> str:
        """``arg``, which a keyword must have.

        Raises
        ------
        _Bad
            When it is missing or empty.
        """
        if not arg:
            raise _Bad(f"{self.written} is missing its value")
        return arg


@dataclass
class _Reader:
    """One pass of ``process_config_files`` (or the ``-o`` lines of a command line): the files
    (None for ``-o`` lines alone), the options being filled, this computer, and the host as
    matched now and as given."""

    config: SshConfig | None
    o: Options
    local: Local
    _: KW_ONLY
    host: str
    original_host: str
    run_exec: bool = True
    #: Whether any ``Host`` or ``Match`` line has matched (what the pass returns).
    matched: bool = field(default=False, init=False)

    @property
    def home(self) -> str:
        return self.config.home if self.config is not None else self.local.home

    # -- files --

    def read_file(self, path: str, flags: int, active: list[bool], want_final: list[bool] | None,
                  depth: int) -> bool:
        """``read_config_file_depth``: False when the file cannot be opened (ENOENT etc.)."""
        if depth < 0 or depth > READCONF_MAX_DEPTH:
            raise _Fatal(f"ssh config Include nests deeper than {READCONF_MAX_DEPTH} levels "
                         f"(at {_shown(path, self.home)})", "look for an Include that includes itself")
        try:
            lines = self.config._read(path)
        except PermissionError as e:
            raise _Bad(f"cannot open {_shown(path, self.home)}: {e.strerror}") from None
        if lines is None:
            return False
        if flags & CHECKPERM and not (self.config.text is not None and path == self.config.path):
            try:
                st = os.stat(path)
            except OSError:
                st = None
            if st is not None and hasattr(os, "getuid") and not _secure_permissions(st, os.getuid()):
                raise _Fatal(f"bad owner or permissions on {_shown(path, self.home)}: OpenSSH refuses "
                             "a config that others can write",
                             f"run `chmod go-w {path}` (and make sure you own it)")
        errors = []
        for n, line in enumerate(lines, 1):
            try:
                self.line(line, path, n, active, flags, want_final, depth)
            except _Bad as e:
                errors.append(f"{_shown(path, self.home)} line {n}: {e}")
        if errors:
            more = f" (and {len(errors) - 1} more bad line(s))" if len(errors) > 1 else ""
            raise ConfigError(errors[0] + more, _CONFIG_HINT)
        return True

    # -- one line --

    def line(self, line: str, filename: str, linenum: int, active: list[bool] | None, flags: int,
             want_final: list[bool] | None, depth: int) -> None:
        """Check and apply one config line (``process_config_line_depth``).

        The keyword's kind (:data:`KEYWORDS`) picks its handler in :attr:`HANDLERS`; the
        handler reads the words it takes, and words left over make the line bad.

        Parameters
        ----------
        line : str
            The line as written, without its newline.
        filename, linenum : str, int
            Where it was read (for messages and ``Match exec``'s tokens).
        active : list of bool or None
            One element, whether the current ``Host`` / ``Match`` block applies; ``Host``,
            ``Match`` and ``Include`` set it.  None for an ``ssh -o`` argument.
        flags : int
            ``CHECKPERM``, ``USERCONF``, ``FINAL``, ``NEVERMATCH`` as readconf.c's.
        want_final : list of bool or None
            Set to True by ``Match final`` (ssh then reads the files again).
        depth : int
            How many ``Include`` levels deep the line is.

        Raises
        ------
        _Bad
            For a line ssh counts as bad (reported with its file and line when the file ends).
        _Fatal
            Where ssh stops at once (an ``Include`` loop, a bad ``PermitRemoteOpen``...).
        """
        cmdline = active is None
        active = [True] if active is None else active
        if not line:
            return
        line = line[:1] + line[1:].rstrip(WHITESPACE + "\f")
        keyword, s = strdelim(line)
        if keyword is None:
            return
        if keyword == "":
            keyword, s = strdelim(s)
        if keyword is None or keyword == "" or keyword[0] in "\n#":
            return
        written = keyword
        if s is not None:
            s = s.lstrip(WHITESPACE)
        if not s:
            raise _Bad(f"{written} has no value")
        kind, attr = self._kind(lowercase(keyword), written, flags, cmdline)
        words = argv_split(s)
        if words is None:
            raise _Bad(f"invalid quotes in {written} {s} (close the quote, or write \\' for a quote)")
        ln = _Line(written, s, _Args(words), kind, attr, active, cmdline, flags, want_final, depth,
                   filename, linenum)
        self.HANDLERS[kind](self, ln)
        if ln.av.left > 0:
            raise _Bad(f"{written} has extra words at the end of the line: "
                       f"{' '.join(ln.av.words[ln.av.i:])!r} (quote a value with spaces)")

    def _kind(self, keyword: str, written: str, flags: int, cmdline: bool) -> tuple[str, str | None]:
        """A keyword's (kind, Options field) from :data:`KEYWORDS`, as readconf.c's ``parse_token``.

        An unknown keyword is ignored when ``IgnoreUnknown`` names it or when it is in the
        system-wide file; otherwise the line is bad.

        Raises
        ------
        _Bad
            ``Bad configuration option``.
        """
        kind, attr = KEYWORDS.get(keyword, (None, None))
        if kind is not None:
            return kind, attr
        if self.o.ignored_unknown is not None and match_pattern_list(keyword, self.o.ignored_unknown, True) == 1:
            return "ignore", None
        if not flags & USERCONF and not cmdline:
            return "ignore", None  # a vendor keyword in /etc/ssh/ssh_config
        raise _Bad(f"Bad configuration option: {written} (OpenSSH 9.x has no such keyword; if "
                   f"your ssh is newer, put `IgnoreUnknown {written}` above this line)")

    def _unset(self, name: str) -> bool:
        """Whether the Options field ``name`` still holds its unset value (-1, None, [])."""
        value = getattr(self.o, name)
        return value is None or value == -1 or value == []

    def _store(self, ln: _Line, value: object) -> None:
        """Set the line's Options field in an active block, unless set before (first value wins)."""
        if ln.attr and ln.on and self._unset(ln.attr):
            setattr(self.o, ln.attr, value)

    # -- the keyword kinds: readconf.c's cases, one handler each (see HANDLERS) --

    def _read_skipped(self, ln: _Line) -> None:
        """``oIgnore``, ``oDeprecated``, ``oUnsupported`` and later releases' keywords: the
        rest of the line is read and not used."""
        ln.av.consume()

    def _read_time(self, ln: _Line) -> None:
        """``ConnectTimeout``, ``ServerAliveInterval``, ``ForwardX11Timeout``: a ``convtime``
        time (seconds, or ``1m30s``) or ``none``."""
        av, written = ln.av, ln.written
        arg = av.next()
        if not arg:
            raise _Bad(f"{written} is missing its time value")
        if arg == "none":
            value = -1
        else:
            value = convtime(arg)
            if value == -1:
                raise _Bad(f"{written} {arg} {_time_problem(arg)}")
        self._store(ln, value)

    def _read_multistate(self, ln: _Line) -> None:
        """Yes/no and the other multistate keywords (``parse_multistate``): one word of the
        kind's table in ``_MULTI`` (``BatchMode``, ``StrictHostKeyChecking``, ``AddressFamily``...)."""
        arg = ln.av.next()
        table = _MULTI[ln.kind]
        value = table.get((arg or "").lower())
        if value is None:
            raise _Bad(f"{ln.written} {arg or ''} is not one of {', '.join(table)}".replace("  ", " "))
        self._store(ln, value)

    def _read_int(self, ln: _Line) -> None:
        """``ServerAliveCountMax``, ``ConnectionAttempts``, ``CanonicalizeMaxDots``...
        (``parse_int``): a whole number 0 to ``INT_MAX``."""
        arg = ln.av.next()
        if not arg:
            raise _Bad(f"{ln.written} is missing its number")
        value, err = strtonum(arg, 0, INT_MAX)
        if err:
            raise _Bad(f"{ln.written} {arg} is {'not a whole number' if err == 'invalid' else 'out of range (0 to 2147483647)'}")
        self._store(ln, value)

    def _read_string(self, ln: _Line) -> None:
        """``User``, ``HostName``, ``HostKeyAlias``, the algorithm lists... (``parse_string``):
        one word, kept as written."""
        self._store(ln, ln.need(ln.av.next()))

    def _read_identityfile(self, ln: _Line) -> None:
        """``IdentityFile``: each line adds a file (``add_identity_file``), at most
        ``SSH_MAX_IDENTITY_FILES``."""
        arg = ln.need(ln.av.next())
        if ln.on:
            if len(self.o.identity_files) >= SSH_MAX_IDENTITY_FILES:
                raise _Bad(f"too many IdentityFile lines (OpenSSH's limit is {SSH_MAX_IDENTITY_FILES})")
            self.o.add_identity_file(arg, bool(ln.flags & USERCONF) or ln.cmdline)

    def _read_certificatefile(self, ln: _Line) -> None:
        """``CertificateFile``: one path, not used here."""
        ln.need(ln.av.next())

    def _read_strarray(self, ln: _Line) -> None:
        """``UserKnownHostsFile``, ``GlobalKnownHostsFile``: the first line's list wins whole,
        at most ``SSH_MAX_HOSTS_FILES`` entries."""
        o, attr, written = self.o, ln.attr, ln.written
        was_empty = self._unset(attr) if attr else True
        for arg in _array_values(ln.av, written):
            if attr and ln.on and was_empty:
                if len(getattr(o, attr)) >= SSH_MAX_HOSTS_FILES:
                    raise _Bad(f"too many {written} entries")
                getattr(o, attr).append(arg)

    def _read_command(self, ln: _Line) -> None:
        """``ProxyCommand``, ``LocalCommand``, ``RemoteCommand``, ``KnownHostsCommand``: the
        rest of the line, raw (a leading ``=`` dropped)."""
        s, attr = ln.rest, ln.attr
        value = s[len(s) - len(s.lstrip(WHITESPACE + "=")):]
        if attr and ln.on and getattr(self.o, attr) is None:
            setattr(self.o, attr, value)
        ln.av.consume()

    def _read_proxyjump(self, ln: _Line) -> None:
        """``ProxyJump``: the rest of the line as ``[user@]host[:port]`` hops (``parse_jump``)."""
        s = ln.rest
        value = s[len(s) - len(s.lstrip(WHITESPACE + "=")):]
        if not parse_jump(value, self.o, strict=ln.cmdline, active=ln.on):
            raise _Bad(f'{ln.written} "{value}" is not a list of [user@]host[:port] hops')
        ln.av.consume()

    def _read_port(self, ln: _Line) -> None:
        """``Port``: a number 1-65535 or a service name (``a2port``)."""
        arg = ln.need(ln.av.next())
        value = a2port(arg)
        if value <= 0:
            raise _Bad(f"Port {arg} {_port_problem(arg)}")
        if ln.on and self.o.port == -1:
            self.o.port = value

    def _read_logverbose(self, ln: _Line) -> None:
        """``LogVerbose``: an array of patterns, checked and not used."""
        for _ in _array_values(ln.av, ln.written):
            pass

    def _read_loglevel(self, ln: _Line) -> None:
        """``LogLevel`` (``log_level_number``): QUIET, FATAL, ERROR, INFO, VERBOSE, DEBUG1-3."""
        arg = ln.av.next()
        if (arg or "").lower() not in _LOG_LEVELS:
            raise _Bad(f"{ln.written} {arg} is not a log level (QUIET, FATAL, ERROR, INFO, VERBOSE, DEBUG1-3)")

    def _read_logfacility(self, ln: _Line) -> None:
        """``SyslogFacility`` (``log_facility_number``): DAEMON, USER, AUTH, LOCAL0-7..."""
        arg = ln.av.next()
        if (arg or "").lower() not in _LOG_FACILITIES:
            raise _Bad(f"{ln.written} {arg} is not a syslog facility")

    def _read_forward(self, ln: _Line) -> None:
        """``LocalForward``, ``RemoteForward``, ``DynamicForward`` (``parse_forward``): a listen
        spec and, except for dynamic ones, a target; ``RemoteForward`` without one is dynamic."""
        av, written = ln.av, ln.written
        arg = ln.need(av.next())
        remote, dynamic = ln.kind == "forward_remote", ln.kind == "forward_dynamic"
        if not dynamic:
            arg2 = av.next()
            if not arg2:
                if remote:
                    dynamic = True
                else:
                    raise _Bad(f"{written} needs a target (LocalForward PORT HOST:PORT)")
            else:
                arg = f"{arg}:{arg2}"[:255]
        if not parse_forward(arg, dynamic, remote):
            raise _Bad(f"{written} {arg} is not a forwarding specification")

    def _read_permitremoteopen(self, ln: _Line) -> None:
        """``PermitRemoteOpen``: ``host:port`` pairs (``*`` for any port), or ``none`` / ``any``
        alone; a missing host or bad port is fatal, as in ssh."""
        av, written = ln.av, ln.written
        where = f"{_shown(ln.filename, self.home)} line {ln.linenum}"
        i = 0
        while (arg := av.next()) is not None:
            if arg.lower() in ("none", "any"):
                if i > 0 or av.left > 0:
                    raise _Bad(f'{written} "{arg}" must appear alone')
            else:
                host, rest, delim = hpdelim2(arg)
                if host is None or delim == "/":
                    raise _Fatal(f"{where}: missing host in {written} {arg}", _CONFIG_HINT)
                if rest is None or (rest != "*" and a2port(rest) <= 0):
                    raise _Fatal(f"{where}: bad port number in {written} {arg}", _CONFIG_HINT)
            i += 1
        if i == 0:
            raise _Fatal(f"{where}: missing {written} specification", _CONFIG_HINT)

    def _read_host(self, ln: _Line) -> None:
        """``Host``: the block applies when a pattern matches and no ``!pattern`` does (one
        pattern per word; ``match_pattern``)."""
        av, active = ln.av, ln.active
        if ln.cmdline:
            raise _Bad("Host cannot be given as a command-line option")
        active[0] = False
        while (arg := av.next()) is not None:
            if arg == "":
                raise _Bad("Host has an empty pattern")
            if ln.flags & NEVERMATCH:
                av.consume()
                break
            negated = arg.startswith("!")
            if match_pattern(self.host, arg[1:] if negated else arg):
                if negated:
                    active[0] = False
                    av.consume()
                    break
                active[0] = True
        if active[0]:
            self.matched = True

    def _read_match(self, ln: _Line) -> None:
        """``Match``: the block applies when every criterion holds (``match_cfg_line``, see
        :meth:`match`)."""
        if ln.cmdline:
            raise _Bad("Match cannot be given as a command-line option")
        value, rest = self.match(ln.rest, ln.flags & FINAL, ln.want_final, ln.filename, ln.linenum)
        ln.active[0] = False if ln.flags & NEVERMATCH else value
        if ln.active[0]:
            self.matched = True
        if not rest:
            ln.av.consume()

    def _read_escapechar(self, ln: _Line) -> None:
        """``EscapeChar``: ``none``, one character, or ``^`` and a control letter."""
        arg = ln.need(ln.av.next())
        b = arg.encode("utf-8", "surrogateescape")
        if not (arg == "none" or len(b) == 1 or (len(b) == 2 and b[:1] == b"^" and 64 <= b[1] < 128)):
            raise _Bad(f"{ln.written} {arg} is not an escape character")

    def _read_sendenv(self, ln: _Line) -> None:
        """``SendEnv``: variable names or patterns, none empty or with ``=``."""
        while (arg := ln.av.next()) is not None:
            if arg == "" or "=" in arg:
                raise _Bad(f"{ln.written} {arg} is not an environment variable name")

    def _read_setenv(self, ln: _Line) -> None:
        """``SetEnv``: ``NAME=VALUE`` words."""
        while (arg := ln.av.next()) is not None:
            if "=" not in arg:
                raise _Bad(f"{ln.written} {arg} is not NAME=VALUE")

    def _read_controlpersist(self, ln: _Line) -> None:
        """``ControlPersist``: yes, no or a ``convtime`` time."""
        arg = ln.need(ln.av.next())
        if arg not in ("no", "false", "yes", "true") and convtime(arg) < 0:
            raise _Bad(f"{ln.written} {arg} is not yes, no or a time")

    def _read_tunneldevice(self, ln: _Line) -> None:
        """``TunnelDevice``: ``local[:remote]``, each ``any`` or a tun number (``a2tun``)."""
        arg = ln.need(ln.av.next())
        if not all(_tun_ok(x) for x in arg.split(":", 1)):
            raise _Bad(f"{ln.written} {arg} is not a tun device")

    def _read_include(self, ln: _Line) -> None:
        """``Include``: read each file a glob names, in order, inside the current block (a
        relative path is under ``~/.ssh`` or ``/etc/ssh``; a ``Match`` in it does not leak out)."""
        av, active, flags = ln.av, ln.active, ln.flags
        if ln.cmdline:
            raise _Bad("Include cannot be given as a command-line option")
        while (arg := av.next()) is not None:
            if arg == "":
                raise _Bad("Include has an empty path")
            if arg.startswith("~") and not flags & USERCONF:
                raise _Bad(f"bad include path {arg} (a system config cannot use ~)")
            oactive = active[0]
            for path in self.config._include_paths(arg, bool(flags & USERCONF)):
                try:
                    self.read_file(path, flags | CHECKPERM | (0 if oactive else NEVERMATCH),
                                   active, ln.want_final, ln.depth + 1)
                except _Bad as e:  # cannot open it
                    raise _Bad(str(e)) from None
                active[0] = oactive  # a Match in an included file does not leak out

    def _read_ipqos(self, ln: _Line) -> None:
        """``IPQoS``: one or two DSCP names (``af21``, ``cs1``, ``lowdelay``...) or numbers 0-255."""
        av = ln.av
        for k, arg in enumerate((av.next(), av.next())):
            if arg is None and k == 1:
                break
            if not _ipqos_ok(arg):
                raise _Bad(f"{ln.written} {arg} is not an IPQoS value")

    def _read_canonicaldomains(self, ln: _Line) -> None:
        """``CanonicalDomains``: valid domain names, the first line's list wins whole, at most
        ``MAX_CANON_DOMAINS``."""
        o = self.o
        was_empty = not o.canonical_domains
        for arg in _array_values(ln.av, ln.written):
            name, err = valid_domain(arg)
            if err:
                raise _Bad(err)
            if ln.on and was_empty:
                if len(o.canonical_domains) >= MAX_CANON_DOMAINS:
                    raise _Bad("too many hostname suffixes")
                o.canonical_domains.append(name)

    def _read_permittedcnames(self, ln: _Line) -> None:
        """``CanonicalizePermittedCNAMEs``: ``SOURCE:TARGET`` pattern pairs, ``*`` or ``none``
        alone; the first line's list wins whole."""
        av, written, o = ln.av, ln.written, self.o
        was_empty = not o.permitted_cnames
        i = 0
        while (arg := av.next()) is not None:
            if arg.lower() == "none":
                if i > 0 or av.left > 0:
                    raise _Bad(f'{written} "none" must appear alone')
                pair = (arg, "")
            elif arg == "*":
                pair = ("*", "*")
            else:
                src, colon, dst = lowercase(arg).partition(":")
                if not colon or not dst:
                    raise _Bad(f'{written} "{arg}" is not SOURCE:TARGET')
                pair = (src, dst)
            i += 1
            if ln.on and was_empty:
                if len(o.permitted_cnames) >= MAX_CANON_DOMAINS:
                    raise _Bad("too many permitted CNAMEs")
                o.permitted_cnames.append(pair)

    def _read_streamlocalbindmask(self, ln: _Line) -> None:
        """``StreamLocalBindMask``: an octal mask 0-0777."""
        arg = ln.need(ln.av.next())
        value, _ = _strtol_prefix(arg, 8)
        if value is None or not 0 <= value <= 0o777:
            raise _Bad(f"{ln.written} {arg} is not an octal mask")

    def _read_fingerprinthash(self, ln: _Line) -> None:
        """``FingerprintHash``: a digest name (``ssh_digest_alg_by_name``: md5, sha256...)."""
        arg = ln.need(ln.av.next())
        if arg.lower() not in _DIGESTS:
            raise _Bad(f"{ln.written} {arg} is not a hash algorithm (sha256, md5...)")

    def _read_addkeystoagent(self, ln: _Line) -> None:
        """``AddKeysToAgent``: yes, no, ask, confirm (optionally followed by a time), or a time."""
        arg, arg2 = ln.av.next(), ln.av.next()
        value = _MULTI["yesnoaskconfirm"].get((arg or "").lower(), -1) if arg else -1
        ok = True
        if value == 3 and arg2 is not None:
            ok = 0 <= convtime(arg2)
        elif value == -1 and arg2 is None:
            ok = arg is not None and 0 <= convtime(arg)
        elif value == -1 or arg2 is not None:
            ok = False
        if not ok:
            raise _Bad(f"{ln.written} {arg} {arg2 or ''} is not yes, no, ask, confirm or a time".rstrip())

    def _read_agent(self, ln: _Line) -> None:
        """``IdentityAgent``, ``ForwardAgent``: a socket path whose ``${VAR}`` / ``$VAR`` must
        expand (``ForwardAgent`` also takes yes / no)."""
        arg = ln.need(ln.av.next())
        if ln.kind == "forwardagent" and arg.lower() in _MULTI["flag"]:
            return
        try:
            percent_expand(arg, None, dollar=True)
            bad = False
        except ExpandError:
            bad = True
        if bad or (arg.startswith("$") and not arg.startswith("${") and not re.fullmatch(r"\w+", arg[1:], re.ASCII)):
            raise _Bad(f"{ln.written} {arg}: invalid environment expansion")

    def _read_rekeylimit(self, ln: _Line) -> None:
        """``RekeyLimit``: ``default`` or a size of at least 16 bytes (``scan_scaled``), then
        optionally a time or ``none``."""
        av, written = ln.av, ln.written
        arg = ln.need(av.next())
        if arg != "default":
            m = re.fullmatch(r"\s*[+-]?(\d*)(\.\d*)?([bBkKmMgGtTpPeE]?)", arg)
            if not m or not (m.group(1) or m.group(2)):
                raise _Bad(f"{written} {arg} is not a size")
            if arg.strip().startswith("-") or (not m.group(3) and not m.group(2) and 0 < int(m.group(1)) < 16):
                raise _Bad(f"{written} {arg} is too small")
        if av.left:
            if av.words[av.i] == "none":
                av.next()
            else:
                arg = av.next()
                if convtime(arg) == -1 and arg != "none":
                    raise _Bad(f"{written} interval {arg} {_time_problem(arg)}")

    #: keyword kind (the first field of :data:`KEYWORDS`) -> the handler that reads its words
    HANDLERS: ClassVar[dict[str, Callable[[_Reader, _Line], None]]] = {
        **dict.fromkeys(("ignore", "deprecated", "unsupported", "later"), _read_skipped),
        **dict.fromkeys(_MULTI, _read_multistate),
        "time": _read_time,
        "int": _read_int,
        "string": _read_string,
        "algos": _read_string,
        "identityfile": _read_identityfile,
        "certificatefile": _read_certificatefile,
        "strarray": _read_strarray,
        "command": _read_command,
        "proxyjump": _read_proxyjump,
        "port": _read_port,
        "logverbose": _read_logverbose,
        "loglevel": _read_loglevel,
        "logfacility": _read_logfacility,
        **dict.fromkeys(("forward_local", "forward_remote", "forward_dynamic"), _read_forward),
        "permitremoteopen": _read_permitremoteopen,
        "host": _read_host,
        "match": _read_match,
        "escapechar": _read_escapechar,
        "sendenv": _read_sendenv,
        "setenv": _read_setenv,
        "controlpersist": _read_controlpersist,
        "tunneldevice": _read_tunneldevice,
        "include": _read_include,
        "ipqos": _read_ipqos,
        "canonicaldomains": _read_canonicaldomains,
        "permittedcnames": _read_permittedcnames,
        "streamlocalbindmask": _read_streamlocalbindmask,
        "fingerprinthash": _read_fingerprinthash,
        "addkeystoagent": _read_addkeystoagent,
        **dict.fromkeys(("identityagent", "forwardagent"), _read_agent),
        "rekeylimit": _read_rekeylimit,
    }

    # -- Match --

    def match(self, cond: str, final: int, want_final: list[bool] | None, filename: str,
              linenum: int) -> tuple[bool, str | None]:
        """``match_cfg_line``: (whether the block applies, what was left unread)."""
        o, local = self.o, self.local
        port = o.port if o.port > 0 else 22
        ruser = o.user if o.user is not None else local.user
        if final:
            host = o.hostname or ""
        elif o.hostname is not None:
            try:
                host = percent_expand(o.hostname, {"h": self.host})
            except ExpandError as e:
                raise _Fatal(f"HostName {o.hostname}: {e}", "in HostName only %h and %% are tokens") from None
        else:
            host = self.host
        result, attributes, cp = True, 0, cond
        while True:
            attrib, cp = strdelim(cp)
            if not attrib:
                break
            if attrib.startswith("#"):
                cp = None
                break
            negate = attrib.startswith("!")
            name = lowercase(attrib[1:] if negate else attrib)
            if name == "all":
                arg, rest = strdelim(cp)
                if attributes > 1 or (arg is not None and arg != "" and not arg.startswith("#")):
                    raise _Bad(f"Match '{attrib}' cannot be combined with other Match criteria")
                cp = None if arg is None or arg.startswith("#") else rest
                if result:
                    result = not negate
                return result, cp
            attributes += 1
            if name in ("canonical", "final"):
                if name == "final" and want_final is not None:
                    want_final[0] = True
                if bool(final) == negate:
                    result = False
                continue
            arg, cp = strdelim(cp)
            if arg is None or arg == "" or arg.startswith("#"):
                raise _Bad(f"Match {attrib} is missing its pattern")
            if name == "host":
                r = match_hostname(host, arg) == 1
            elif name == "originalhost":
                r = match_hostname(self.original_host, arg) == 1
            elif name == "user":
                r = match_pattern_list(ruser, arg, False) == 1
            elif name == "localuser":
                r = match_pattern_list(local.user, arg, False) == 1
            elif name == "exec":
                if not result:
                    continue  # ssh skips the command once an earlier criterion failed
                r = self.exec(arg, host, ruser, port, filename, linenum) == 0
            else:
                raise _Bad(f"Match {attrib} is not a criterion OpenSSH 9.2 understands (all, canonical, "
                           "final, exec, host, originalhost, user, localuser)")
            if r == negate:
                result = False
        if attributes == 0:
            raise _Bad("Match needs at least one criterion (e.g. Match host NAME)")
        return result, cp

    def exec(self, command: str, host: str, ruser: str, port: int, filename: str, linenum: int) -> int:
        """Run a ``Match exec`` command as ``execute_in_shell`` does; its exit status."""
        local = self.local
        tokens = {
            "C": connection_hash(local.thishost, host, str(port), ruser),
            "L": local.thishost.split(".")[0], "d": self.home, "h": host,
            "k": self.o.host_key_alias or host, "l": local.thishost, "n": self.original_host,
            "p": str(port), "r": ruser, "u": local.user, "i": str(local.uid),
        }
        where = f"{_shown(filename, self.home)} line {linenum}"
        try:
            cmd = percent_expand(command, tokens)
        except ExpandError as e:
            raise _Fatal(f"{where}: Match exec: {e}", _CONFIG_HINT) from None
        if not self.run_exec:
            return 1
        shell = os.environ.get("SHELL") or "/bin/sh"
        if not os.access(shell, os.X_OK):
            raise _Fatal(f"{where}: Match exec needs a shell, and {shell} is not executable",
                         "set SHELL to your shell (e.g. /bin/sh) and try again")
        try:
            proc = subprocess.Popen([shell, "-c", cmd], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except OSError as e:
            raise _Fatal(f"{where}: cannot run Match exec {cmd!r}: {e.strerror}", _CONFIG_HINT) from None
        try:
            _, err = proc.communicate(timeout=EXEC_TIMEOUT)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise _Fatal(f"{where}: Match exec {cmd!r} did not finish within {EXEC_TIMEOUT:g} s",
                         "make that command quick (ssh runs it on every connection)") from None
        if proc.returncode < 0:
            raise _Fatal(f"{where}: Match exec {cmd!r} was killed by signal {-proc.returncode}",
                         _CONFIG_HINT)
        return proc.returncode


def _kill_group(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (OSError, AttributeError):
        proc.kill()
    proc.wait()


def _tun_ok(s: str) -> bool:
    return s.lower() == "any" or strtonum(s, 0, 0x7fffffff - 2)[1] is None


def _ipqos_ok(arg: str | None) -> bool:
    if arg is None:
        return False
    if arg.lower() in _IPQOS:
        return True
    value, end = _strtol_prefix(arg, 0)
    return arg != "" and value is not None and end == len(arg) and 0 <= value <= 255


def _port_problem(arg: str) -> str:
    value, err = strtonum(arg, -(2**63), 2**63 - 1)
    if err is None:
        return "is out of range (1-65535)"
    return "is not a port number or a service name"


def connection_hash(thishost: str, host: str, port: str, user: str) -> str:
    """``%C``: SHA-1 of local host name, host, port and user, in hex (``ssh_connection_hash``)."""
    return hashlib.sha1((thishost + host + port + user).encode("utf-8", "surrogateescape")).hexdigest()


def parse_jump(s: str, o: Options, *, strict: bool, active: bool) -> bool:
    """``parse_jump`` (Debian 9.2): set ``jump_*`` from a ProxyJump value; False if invalid."""
    if s.lower() == "none":
        if active and o.jump_host is None:
            o.jump_host, o.jump_port = "none", 0
        return True
    orig = s.split("#", 1)[0].rstrip(" \t\n\v\f\r")
    active = active and o.proxy_command is None and o.jump_host is None
    parts = orig.split(",")
    first = None
    for part in reversed(parts):
        got = parse_hop(part)
        if got is None:
            return False
        user, host, port = got
        if strict and (not ssh_valid_hostname(host) or (user is not None and not ssh_valid_ruser(user))):
            return False
        if first is None:
            first = got
    if active and first is not None:
        o.jump_user, o.jump_host, o.jump_port = first
        o.proxy_command = "none"
        if "," in orig:
            o.jump_extra = orig[:orig.rfind(",")]
    return True


# -- resolution: ssh.c main ------------------------------------------------------------------

@dataclass
class Resolved:
    """What ``ssh -G`` prints for a host, for the keywords gpumagic uses.

    Attributes
    ----------
    host_arg : str
        The name as typed (``host``).
    hostname : str
        ``hostname``: HostName with ``%h`` expanded, lower-cased (addresses canonicalised).
    user, port
        ``user`` (default: the local user), ``port`` (default 22).
    identity_files : list of str
        ``identityfile`` lines as written (``~`` and ``%`` not expanded), without ssh's
        defaults; ``defaults`` is True when none was set and ssh uses its default keys.
    identities_only : bool
    server_alive_interval : int or None
        Seconds; None when not set (``ssh -G`` prints 0).
    server_alive_count_max : int or None
        None when not set (``ssh -G`` prints 3).
    connect_timeout : int or None
        Seconds; None when not set (``connecttimeout none``).
    user_known_hosts_files : list of str
        ``userknownhostsfile``, expanded; empty for ``none``.
    proxy_jump : str or None
        ``proxyjump`` as ``ssh -G`` prints it (None: no jump host).
    jump_hops : list of str
        The hops in connection order, each as ``[user@]host[:port]``.
    proxy_command : str or None
        An effective ``ProxyCommand`` (``none`` removed).
    compression : bool or None
        ``Compression``; None when not set (``ssh -G`` prints no).
    matched : bool
        Whether some ``Host``/``Match`` block applied.
    """

    host_arg: str
    hostname: str
    user: str
    port: int
    identity_files: list
    identities_only: bool
    server_alive_interval: int | None
    server_alive_count_max: int | None
    connect_timeout: int | None
    user_known_hosts_files: list
    proxy_jump: str | None
    jump_hops: list
    proxy_command: str | None
    matched: bool
    expand: Callable[[str], str] = field(repr=False, default=str)
    compression: bool | None = None


def _is_addr_fast(name: str) -> bool:
    return "%" in name or ":" in name or all(c in "0123456789." for c in name)


def _numeric_addr(name: str, family: int) -> str | None:
    """``resolve_addr``: the canonical form of a single numeric address, else None."""
    try:
        res = socket.getaddrinfo(name, "22", family if family != -1 else socket.AF_UNSPEC,
                                 socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST | socket.AI_NUMERICSERV)
    except (socket.gaierror, UnicodeError, ValueError, OSError):
        return None
    if len(res) != 1:
        return None
    try:
        return socket.getnameinfo(res[0][4], socket.NI_NUMERICHOST)[0]
    except (socket.gaierror, OSError):
        return None


def _is_addr(name: str, family: int) -> bool:
    return _is_addr_fast(name) or _numeric_addr(name, family) is not None


def _resolve_host(name: str, port: int, family: int) -> tuple[bool, str]:
    """``resolve_host`` with AI_CANONNAME: (found, canonical name or '')."""
    try:
        res = socket.getaddrinfo(name, str(port if port > 0 else 22),
                                 family if family != -1 else socket.AF_UNSPEC, socket.SOCK_STREAM,
                                 0, socket.AI_CANONNAME)
    except (socket.gaierror, UnicodeError, ValueError, OSError):
        return False, ""
    cname = res[0][3] if res else ""
    if cname and valid_domain(cname)[1] is not None:
        cname = ""
    return True, cname or ""


def resolve_options(host_arg: str, config: SshConfig | None, cmdline: Options | None = None, *,
                    local: Local | None = None, run_exec: bool = True) -> Resolved:
    """Resolve ``host_arg`` as ``ssh [options] host_arg`` would (``ssh.c`` main, 9.2).

    Parameters
    ----------
    host_arg : str
        The destination as typed (an alias or a host name; no ``user@``).
    config : SshConfig or None
        The configuration (None: ``ssh -F none``).
    cmdline : Options, optional
        Options from the command line (``-o``, ``-p``, ``-l``, ``-i``, ``-J``); they win.
    local : Local, optional
        Local user, home and host name (default: this process's).
    run_exec : bool
        Run ``Match exec`` commands (False: treat them as not matching).

    Raises
    ------
    ConfigError
        For anything ``ssh`` refuses: a bad line in any file read, a ``Match`` that cannot be
        evaluated, an invalid user or host name on the command line, a ``%`` token that does
        not expand, a host that CanonicalizeHostname cannot resolve -- each naming the file
        and line where there is one.
    """
    o = cmdline if cmdline is not None else Options()
    if local is None:
        local = Local.current(config.home if config is not None else None)
    home = config.home if config is not None else local.home
    if o.user is not None and not ssh_valid_ruser(o.user):
        raise ConfigError(f"user name {o.user!r} contains characters ssh refuses on its command line",
                          "give the user name without quotes, ;, &, |, <, >, $ or a leading -")
    if not ssh_valid_hostname(host_arg):
        raise ConfigError(f"host name {host_arg!r} contains characters ssh refuses",
                          "give a host name or alias without spaces, quotes, commas or shell characters")
    want_final = [False]
    matched = _process_config_files(config, o, local, host_arg, host_arg, False, want_final, run_exec)
    if o.canonicalize_max_dots == -1:
        o.canonicalize_max_dots = 1
    if o.canonicalize_fallback_local == -1:
        o.canonicalize_fallback_local = 1
    if o.canonicalize_hostname == -1:
        o.canonicalize_hostname = CANON_NO
    host = host_arg
    if o.hostname is not None:
        try:
            host = percent_expand(o.hostname, {"h": host})
        except ExpandError as e:
            raise ConfigError(f"HostName {o.hostname}: {e}", "in HostName only %h and %% are tokens") from None
        o.hostname = host
    was_addr = _is_addr(host, o.address_family)
    if not was_addr:
        host = lowercase(host)
    resolved_cname = False
    if o.canonicalize_hostname != CANON_NO or was_addr:
        host, resolved_cname = _resolve_canonicalize(host, o)
    direct = (o.proxy_command is None or o.proxy_command.lower() == "none") and o.jump_host is None
    has_cnames = bool(o.permitted_cnames) and not (
        len(o.permitted_cnames) == 1 and o.permitted_cnames[0][0].lower() == "none" and o.permitted_cnames[0][1] == "")
    if not resolved_cname and has_cnames and (direct or o.canonicalize_hostname == CANON_ALWAYS):
        found, cname = _resolve_host(host, o.port, o.address_family)
        if not found:
            if direct:
                raise ConfigError(f"cannot resolve host name {host!r} (CanonicalizePermittedCNAMEs asks "
                                  "ssh to look it up)", "check the name, or your network")
        else:
            host = _follow_cname(direct, host, cname, o)
    if o.canonicalize_hostname != CANON_NO and not want_final[0]:
        want_final[0] = True
    if want_final[0]:
        o.hostname = host
        matched = _process_config_files(config, o, local, host, host_arg, True, None, run_exec) or matched

    user = o.user if o.user is not None else local.user
    port = o.port if o.port > 0 else 22
    if o.jump_host is not None and o.jump_host == "none" and o.jump_port == 0 and o.jump_user is None:
        o.jump_host = None
    proxy_command = o.proxy_command if o.proxy_command and o.proxy_command.lower() != "none" else None
    proxy_jump, hops = None, []
    if o.jump_host is not None:
        jport = o.jump_port if o.jump_port > 0 else 22
        if o.jump_host == host and port == jport and user == (o.jump_user or user):
            raise ConfigError(f"ProxyJump {o.jump_host} loops back to {host} itself",
                              "remove that ProxyJump for this host")
        if proxy_command is not None:
            raise ConfigError("ProxyCommand and ProxyJump are both set", "keep one of them")
        numeric = ":" in o.jump_host or all(c in "1234567890." for c in o.jump_host)
        last = (f"{o.jump_user + '@' if o.jump_user else ''}{'[' if numeric else ''}{o.jump_host}"
                f"{']' if numeric else ''}{':' + str(o.jump_port) if o.jump_port > 0 else ''}")
        proxy_jump = f"{o.jump_extra + ',' if o.jump_extra else ''}{last}"
        for part in (o.jump_extra.split(",") if o.jump_extra else []):
            got = parse_hop(part.strip())
            hops.append(format_hop(*got) if got else part.strip())
        hops.append(format_hop(o.jump_user, o.jump_host, o.jump_port))
    tokens = {
        "C": connection_hash(local.thishost, host, str(port), user),
        "L": local.thishost.split(".")[0], "i": str(local.uid),
        "k": lowercase(o.host_key_alias) if o.host_key_alias else host_arg,
        "l": local.thishost, "n": host_arg, "p": str(port), "d": home, "h": host, "r": user,
        "u": local.user,
    }

    def expand(path: str) -> str:
        """``~`` then ``%`` tokens and ``${VAR}``, as ssh expands IdentityFile at connect time."""
        try:
            return percent_expand(tilde_expand(path, home), tokens, dollar=True)
        except ExpandError as e:
            raise ConfigError(f"cannot expand {path!r}: {e}", "fix that path in your ssh config") from None

    if o.user_hostfiles and o.user_hostfiles[0].lower() == "none":
        if len(o.user_hostfiles) > 1:
            raise ConfigError('UserKnownHostsFile "none" appears with other files', "keep none alone")
        known: list[str] = []
    else:
        known = [expand(p) for p in (o.user_hostfiles or ["~/.ssh/known_hosts", "~/.ssh/known_hosts2"])]
    return Resolved(
        host_arg=host_arg, hostname=host, user=user, port=port,
        identity_files=[p for p, _ in o.identity_files],
        identities_only=o.identities_only == 1,
        server_alive_interval=None if o.server_alive_interval == -1 else o.server_alive_interval,
        server_alive_count_max=None if o.server_alive_count_max == -1 else o.server_alive_count_max,
        connect_timeout=None if o.connection_timeout == -1 else o.connection_timeout,
        user_known_hosts_files=known, proxy_jump=proxy_jump, jump_hops=hops,
        proxy_command=proxy_command, matched=matched, expand=expand,
        compression=None if o.compression == -1 else o.compression == 1,
    )


def _follow_cname(direct: bool, name: str, cname: str, o: Options) -> str:
    """``check_follow_cname``."""
    if not cname or name == cname or not o.permitted_cnames:
        return name
    if o.canonicalize_hostname == CANON_NO:
        return name
    if not direct and o.canonicalize_hostname != CANON_ALWAYS:
        return name
    for src, dst in o.permitted_cnames:
        if match_pattern_list(name, src, True) == 1 and match_pattern_list(cname, dst, True) == 1:
            return cname
    return name


def _resolve_canonicalize(host: str, o: Options) -> tuple[str, bool]:
    """``resolve_canonicalize``: (host, whether a lookup found it)."""
    addr = _numeric_addr(host, o.address_family)
    if addr is not None:
        return (addr if addr.lower() != host.lower() else host), True
    if _is_addr_fast(host):
        return host, False
    if o.canonicalize_hostname == CANON_NO:
        return host, False
    direct = (o.proxy_command is None or o.proxy_command.lower() == "none") and o.jump_host is None
    if not direct and o.canonicalize_hostname != CANON_ALWAYS:
        return host, False
    candidates = []
    if host.endswith("."):
        candidates = [host]
    else:
        if host.count(".") > o.canonicalize_max_dots:
            return host, False
        for domain in o.canonical_domains:
            if domain.lower() == "none":
                break
            candidates.append(f"{host}.{domain}.")
    for full in candidates:
        found, cname = _resolve_host(full, o.port, o.address_family)
        if found:
            full = full[:-1]
            return _follow_cname(direct, full, cname, o), True
        if host.endswith("."):
            break
    if not o.canonicalize_fallback_local:
        raise ConfigError(f"cannot resolve host {host!r} with CanonicalDomains "
                          f"{' '.join(o.canonical_domains) or '(none)'}",
                          "check the name, or set CanonicalizeFallbackLocal yes")
    return host, False


def _process_config_files(config: SshConfig | None, o: Options, local: Local, host: str, original_host: str,
                          final: bool, want_final: list[bool] | None, run_exec: bool) -> bool:
    """``process_config_files``: the user's file then the system file; True if a block applied."""
    if config is None:
        return False
    reader = _Reader(config, o, local, host=host, original_host=original_host, run_exec=run_exec)
    f = FINAL if final else 0
    try:
        if config.explicit:
            if not reader.read_file(config.path, USERCONF | f, [True], want_final, 0):
                raise ConfigError(f"cannot open ssh config {_shown(config.path, config.home)}",
                                  "check the path given with -F")
        else:
            reader.read_file(config.path, CHECKPERM | USERCONF | f, [True], want_final, 0)
            if config.system:
                reader.read_file(config.system, f, [True], want_final, 0)
    except _Bad as e:
        raise ConfigError(str(e), _CONFIG_HINT) from None
    return reader.matched


def apply_cmdline_option(o: Options, text: str, local: Local | None = None, *, host: str = "") -> None:
    """Apply one ``ssh -o`` argument (``Key=Value`` or ``"Key Value"``) to ``o``.

    Raises
    ------
    ConfigError
        When ssh refuses it (``Host``/``Match``/``Include``, a bad value, an unknown keyword).
    """
    local = local or Local.current()
    reader = _Reader(None, o, local, host=host, original_host=host)
    try:
        reader.line(text, "command-line", 0, None, USERCONF, None, 0)
    except _Bad as e:
        raise ConfigError(f"-o {text}: {e}", "write it as -o Keyword=value, e.g. -o Port=41022") from None
