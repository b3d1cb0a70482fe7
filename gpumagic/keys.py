"""First-time set-up: make a key, add a ``Host`` block, install a key over a password login.

Each step is one call, safe to repeat, and never weakens security:

* :func:`keygen` writes an ed25519 key pair in OpenSSH's format (private key 0600, ``~/.ssh``
  0700) and never overwrites a file.
* :func:`add_host` appends a ``Host`` block to ``~/.ssh/config`` keeping every existing byte,
  refuses a duplicate name (``replace=True`` swaps the old block in place), writes atomically
  and keeps the previous file as ``config.bak``.
* :func:`install_key` logs in once with a password (asked after the host key was checked,
  never stored), appends the public key to the remote ``~/.ssh/authorized_keys`` unless it is
  there already, then proves that a key login works.

Nothing here imports IPython; the magics in :mod:`gpumagic.notebook.magics` call these functions.
"""

from __future__ import annotations

import base64
import getpass
import os
import re
import socket
import stat
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import paramiko

from ._fs import atomic_write
from .ssh.connection import Connection, load_private_key
from .errors import (AuthenticationFailed, ConfigError, GpumagicError, HostExists, KeyExists,  # noqa: F401
                     LocalFileError)
from .ssh.config import local_user
from .ssh.known_hosts import fingerprint
from .ssh.hosts import (HONOURED_KEYWORDS, HostSpec, is_ssh_command, parse_ssh_command, parse_target, resolve,
                         ssh_dir)

PasswordPrompt = Callable[[str], str]


def _getpass(prompt: str) -> str:
    """The default :data:`PasswordPrompt`: ``getpass.getpass``, looked up when called."""
    return getpass.getpass(prompt)


def _os_reason(e: OSError) -> str:
    return e.strerror or str(e)


# -- keys --------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyPair:
    """A key pair on disk.

    Attributes
    ----------
    path : Path
        The private key file (the public key is ``path`` + ``.pub``).
    public_key : str
        The ``.pub`` line: ``ssh-ed25519 AAAA... comment`` (what goes into authorized_keys).
    fingerprint : str
        ``SHA256:...`` as ``ssh-keygen -l`` prints it.
    """

    path: Path
    public_key: str
    fingerprint: str

    @property
    def public_path(self) -> Path:
        return Path(str(self.path) + ".pub")


def public_key_fingerprint(line: str) -> str:
    """The ``SHA256:...`` fingerprint of a ``.pub`` / authorized_keys line (``ssh-keygen -lf``)."""
    _, blob = _key_type_and_blob(line)
    return fingerprint(base64.b64decode(blob))


_KEY_TYPE_RE = re.compile(r"^(ssh-(ed25519|rsa|dss)|ecdsa-sha2-nistp\d+|sk-\S+@openssh\.com)$")


def _key_type_and_blob(line: str) -> tuple[str, str]:
    """(type, base64) of a public key line (the format of ``sshd(8)`` AUTHORIZED_KEYS, no options)."""
    fields = (line or "").strip().split()
    if len(fields) < 2 or not _KEY_TYPE_RE.match(fields[0]):
        raise ConfigError(f"{(line or '').strip()[:40]!r}... is not an OpenSSH public key line",
                          "use the .pub file (it starts with ssh-ed25519, ssh-rsa or ecdsa-sha2-...)")
    try:
        base64.b64decode(fields[1], validate=True)
    except ValueError:
        raise ConfigError("the public key's base64 part is damaged", "copy the .pub line again, whole")
    return fields[0], fields[1]


def _local_path(path) -> Path:
    """A local path as typed in a magic: ``~`` and ``$VAR``/``${VAR}`` expanded (IPython does
    not expand ``$HOME`` in a magic's line unless a Python variable of that name exists)."""
    return Path(os.path.expanduser(os.path.expandvars(str(path))))


def _link_new(data: bytes, path: Path, mode: int) -> None:
    """Create ``path`` with ``data`` and ``mode`` all at once, failing if it exists.

    The bytes go to a temp file in the same directory (fsynced), which is then hard-linked to
    ``path``: ``link(2)`` fails with EEXIST instead of overwriting, so a key is never half
    written and never replaced.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
            return
        except FileExistsError:
            raise
        except OSError:
            pass  # no hard links here (some network/FUSE mounts): exclusive create instead
    finally:
        os.unlink(tmp)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(path)
        raise


def _cannot_write_key(path: Path, why: str) -> "LocalFileError":
    return LocalFileError(f"cannot write the key to {path}: {why}",
                          "choose a path in a directory you can write, e.g. "
                          "--path ~/.ssh/id_ed25519 (the default)")


def _write_key_file(data: bytes, path: Path, mode: int) -> None:
    """:func:`_link_new`, its failures as gpumagic errors."""
    try:
        _link_new(data, path, mode)
    except FileExistsError:
        raise KeyExists(f"{path} appeared while the key was made; it was left as it was",
                        "run keygen again with another --path") from None
    except OSError as e:
        raise _cannot_write_key(path, _os_reason(e)) from None


def _ensure_ssh_dir(directory: Path, home: str | os.PathLike | None = None) -> None:
    """Create ``directory``; ``~/.ssh`` itself is made (or tightened to) mode 0700."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    if directory.resolve() == ssh_dir(home).resolve():
        mode = stat.S_IMODE(directory.stat().st_mode)
        if mode != 0o700:
            os.chmod(directory, 0o700)


def default_key_path(home: str | os.PathLike | None = None) -> Path:
    """``~/.ssh/id_ed25519``: the first key OpenSSH's client tries."""
    return ssh_dir(home) / "id_ed25519"


def keygen(path: str | os.PathLike | None = None, *, comment: str | None = None,
           passphrase: str | None = None, home: str | os.PathLike | None = None) -> KeyPair:
    """Create an ed25519 key pair in OpenSSH's format, like ``ssh-keygen -t ed25519``.

    Parameters
    ----------
    path : path, optional
        The private key file (default ``~/.ssh/id_ed25519``; ``~`` is expanded).  The public
        key goes to ``path.pub``.
    comment : str, optional
        The public key's comment (default ``user@hostname``, as ssh-keygen writes).
    passphrase : str, optional
        Encrypt the private key with it (OpenSSH's bcrypt KDF + aes256-ctr).  None or empty:
        not encrypted.
    home : path, optional
        The local home directory (default ``$HOME``).

    Returns
    -------
    KeyPair

    Raises
    ------
    KeyExists
        When ``path`` or ``path.pub`` exists (nothing is written).
    LocalFileError
        When the key cannot be written there, or ``path`` holds a NUL byte (nothing is left
        behind).
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if path and "\0" in str(path):
        raise LocalFileError(f"the key path {str(path)[:60]!r} holds a NUL byte (\\0), which no file name can",
                             "give --path without it, e.g. --path ~/.ssh/id_ed25519 (the default)")
    path = _local_path(path) if path else default_key_path(home)
    pub_path = Path(str(path) + ".pub")
    for p in (path, pub_path):
        try:
            taken = p.exists() or p.is_symlink()
        except OSError as e:  # a name too long, a file where a directory should be
            raise _cannot_write_key(path, _os_reason(e)) from None
        if taken:
            raise KeyExists(f"{p} already exists; gpumagic never overwrites a key",
                            f"use that key (its public half is {pub_path}), or pick another file "
                            "with --path ~/.ssh/id_ed25519_gpu")
    if comment is None:
        comment = f"{local_user()}@{socket.gethostname()}"
    if any(c in comment for c in "\r\n"):
        raise ConfigError("the key comment has a line break", "use a one-line comment")
    key = Ed25519PrivateKey.generate()
    encryption = (serialization.BestAvailableEncryption(passphrase.encode()) if passphrase
                  else serialization.NoEncryption())
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                encryption)
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH).decode()
    line = f"{public} {comment}".rstrip()
    try:
        _ensure_ssh_dir(path.parent, home)
    except OSError as e:
        raise _cannot_write_key(path, f"cannot make the directory {path.parent}: {_os_reason(e)}") from None
    _write_key_file(private, path, 0o600)
    try:
        _write_key_file((line + "\n").encode(), pub_path, 0o644)
    except BaseException:
        path.unlink()  # no private key without its public half
        raise
    return KeyPair(path=path, public_key=line, fingerprint=public_key_fingerprint(line))


def read_public_key(key_path: str | os.PathLike, *, prompt=None) -> str:
    """The public key line for private key ``key_path``: its ``.pub`` file, else derived.

    Raises
    ------
    ConfigError
        When neither the private key nor its ``.pub`` file exists.
    """
    key_path = _local_path(key_path)
    pub = Path(str(key_path) + ".pub")
    if pub.exists():
        line = pub.read_text(encoding="utf-8", errors="replace").strip().splitlines()[0]
        _key_type_and_blob(line)
        return line
    if not key_path.exists():
        raise ConfigError(f"no key at {key_path}",
                          "make one with `%gpu keygen`, or name your key with --key PATH")
    kw = {"prompt": prompt} if prompt else {}
    k = load_private_key(str(key_path), **kw)
    return f"{k.get_name()} {k.get_base64()}"


def public_key_text(pair: KeyPair) -> str:
    """Plain-text view of a new key: where it is and the line to paste into the platform."""
    return (f"private key: {pair.path} (mode 0600; never share it)\n"
            f"public key:  {pair.public_path}  ({pair.fingerprint})\n\n"
            f"{pair.public_key}\n\n"
            "Paste the line above into your GPU platform's SSH-key settings (or run "
            "`%gpu install-key user@host` where a password login works).")


# -- ~/.ssh/config -----------------------------------------------------------------------


@dataclass
class AddHostResult:
    """What :func:`add_host` did.

    Attributes
    ----------
    path : Path
        The config file written (a symlink's target when ``~/.ssh/config`` is a link).
    block : str
        The ``Host`` block as written.
    action : str
        ``"added"``, ``"replaced"`` or ``"unchanged"`` (the same block was there already).
    old_block : str or None
        The block that was replaced (``replace=True``) or found.
    backup : Path or None
        Copy of the previous file (``config.bak``), when the file existed and changed.
    notes : list of str
        Warnings, e.g. an earlier ``Host *`` block whose values win over this block's.
    """

    path: Path
    block: str
    action: str
    old_block: str | None = None
    backup: Path | None = None
    notes: list[str] = field(default_factory=list)


_HEADER_RE = re.compile(r"^\s*(host|match)(?:\s*=\s*|\s+)(.*?)\s*$", re.IGNORECASE)
_PLAIN = re.compile(r"""[^\s"'\\#=][^\s"'\\]*""")

#: %-tokens ssh expands in IdentityFile (ssh_config(5) TOKENS; ``%%`` is a literal %).
_IDENTITY_TOKENS = {t: "x" for t in "CLiklnpdhru"}


def _refuse(keyword: str, value, why: str, hint: str) -> ConfigError:
    return ConfigError(f"cannot write {keyword} {value!r} to ~/.ssh/config: {why}", hint)


def _config_word(keyword: str, value: str) -> str:
    """``value`` as one ssh_config word that readconf's ``argv_split`` reads back unchanged.

    Plain words are written as they are; anything with blanks, quotes, ``\\``, ``#`` or a
    leading ``=`` goes in double quotes with ``"`` and ``\\`` escaped (``readconf.c``).
    """
    if _PLAIN.fullmatch(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _check_row(keyword: str, value) -> str:
    """The text after ``keyword`` on its line, or ConfigError when ssh could not read it back."""
    from .ssh.config import (ExpandError, Options, convtime, parse_jump, percent_expand, ssh_valid_hostname, strtonum)

    words = [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    for w in words:
        if w == "" or any(c in w for c in "\n\r\0"):
            raise _refuse(keyword, w, "it is empty or has a line break", f"give a one-line {keyword}")
    w = words[0]
    if keyword == "HostName":
        if not ssh_valid_hostname(w) or "%" in w:
            raise _refuse(keyword, w, "ssh cannot use it as a host name (blanks, quotes, %, or shell "
                          "characters)", "give the machine's address or DNS name, e.g. 203.0.113.10")
    elif keyword == "User":
        if "%" in w or w.startswith("-"):
            raise _refuse(keyword, w, "a % or a leading - in a user name is read differently by "
                          "newer ssh versions", "give the login name as the platform shows it")
    elif keyword in ("IdentityFile", "UserKnownHostsFile"):
        for p in words:
            try:
                percent_expand(p, _IDENTITY_TOKENS, dollar=True, env={})
            except ExpandError as e:
                if "environment variable" not in str(e):
                    raise _refuse(keyword, p, str(e), "write %% for a literal % in the path") from None
    elif keyword == "ProxyJump":
        if "#" in w or not parse_jump(w, Options(), strict=True, active=True):
            raise _refuse(keyword, w, "it is not a list of [user@]host[:port] hops ssh accepts",
                          "write it like ssh -J: user@bastion:22,second-hop (no blanks or quotes)")
        return w  # readconf reads ProxyJump from the raw line, without unquoting
    elif keyword in ("ServerAliveInterval", "ConnectTimeout"):
        if w != "none" and convtime(w) < 0:
            raise _refuse(keyword, w, "it is not a time ssh reads (0 or more seconds, or 30s, 1m, 1h30m)",
                          f"give {keyword} in seconds, e.g. 30")
    elif keyword == "ServerAliveCountMax":
        if strtonum(w, 0, 2**31 - 1)[1] is not None:
            raise _refuse(keyword, w, "it is not a whole number from 0 up", f"give {keyword} as e.g. 3")
    elif keyword == "IdentitiesOnly":
        if w.lower() not in ("yes", "no", "true", "false"):
            raise _refuse(keyword, w, "it is not yes or no", "give IdentitiesOnly yes or no")
    elif keyword == "Port":
        if strtonum(w, 1, 65535)[1] is not None:
            raise ConfigError(f"port {w} is out of range", "use a port between 1 and 65535")
    return " ".join(_config_word(keyword, v) for v in words)


def host_block(name: str, hostname: str, *, port: int | None = None, user: str | None = None,
               key: str | None = None, jump: str | None = None,
               server_alive_interval: int | None = 30, server_alive_count_max: int | None = 3,
               options: dict | None = None, newline: str = "\n") -> str:
    """The text of one ``Host NAME`` block (ssh_config(5) keywords, two-space indent).

    ``IdentitiesOnly yes`` goes with a key so that an agent full of keys cannot exhaust the
    server's ``MaxAuthTries`` first.  ``server_alive_interval`` in seconds; None leaves the
    keyword out.  ``options`` adds other honoured keywords (``ConnectTimeout``...) and
    replaces gpumagic's defaults where it names them (``-o ServerAliveInterval=10`` pasted with
    ``--save``); a keyword given by name (``port``...) wins over it.  Every
    value is written so that OpenSSH reads it back as given (quoted where needed, see
    :func:`_config_word`); the block is read back with :mod:`gpumagic.ssh.config` to prove it.

    Raises
    ------
    ConfigError
        For a name with spaces or wildcards, a bad port, or a value OpenSSH could not read
        back as given (nothing is written then).
    """
    if not name or not re.match(r"^[A-Za-z0-9_.@-]+$", name) or name.startswith("-"):
        raise ConfigError(f"{name!r} is not a usable host name for ~/.ssh/config",
                          "use letters, digits, '-', '_' or '.', e.g. mygpu (no spaces or *?!)")
    if port is not None:
        try:
            port = int(port)
        except (TypeError, ValueError):
            raise ConfigError(f"port {port!r} is not a number", "use a port between 1 and 65535") from None
        if not 0 < port < 65536:
            raise ConfigError(f"port {port} is out of range", "use a port between 1 and 65535")
    rows = [("HostName", hostname), ("Port", port), ("User", user), ("IdentityFile", key),
            ("IdentitiesOnly", "yes" if key else None), ("ProxyJump", jump),
            ("ServerAliveInterval", server_alive_interval),
            ("ServerAliveCountMax", server_alive_count_max)]
    # what was given by name wins over an -o of the same keyword; gpumagic's own defaults
    # (IdentitiesOnly with a key, the keepalives) yield to it, in their place
    given = {k for k, v in rows[:6] if v is not None and v != "" and k != "IdentitiesOnly"}
    for k, v in (options or {}).items():
        canon = HONOURED_KEYWORDS.get(k.lower(), k)
        if canon in given:
            continue
        given.add(canon)
        if any(kw == canon for kw, _ in rows):
            rows = [(kw, v if kw == canon else val) for kw, val in rows]
        else:
            rows.append((canon, v))
    lines = [f"Host {name}"]
    wanted = []
    for keyword, value in rows:
        if value is None or value == "":
            continue
        if keyword not in ("IdentityFile", "UserKnownHostsFile") and re.search(r"\s", str(value)):
            raise ConfigError(f"{keyword} {value!r} has a space in it", f"give {keyword} without spaces")
        lines.append(f"  {keyword} {_check_row(keyword, value)}")
        wanted.append((keyword, [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]))
    _read_back(lines, wanted)
    return newline.join(lines) + newline


def _read_back(lines: list[str], wanted: list[tuple[str, list[str]]]) -> None:
    """Check that OpenSSH's line reader gives back exactly the values meant (else refuse)."""
    from .ssh.config import Local, Options, _Bad, _Reader, _split_line

    o = Options()
    reader = _Reader(None, o, Local(user="", home="/", uid=0, thishost=""), host="", original_host="")
    for line, (keyword, values) in zip(lines[1:], wanted):
        parsed = _split_line(line)
        got = [parsed[1].lstrip(" \t=")] if keyword == "ProxyJump" else parsed[2]
        if parsed[0] != keyword.lower() or got != values:
            raise _refuse(keyword, " ".join(values), "ssh would read it back differently",
                          "give the value without quotes or backslashes")
        try:
            reader.line(line, "block", 0, [True], 2, None, 0)
        except _Bad as e:
            raise _refuse(keyword, " ".join(values), str(e), "fix the value and try again") from None


@dataclass
class _Section:
    start: int          # index of the header line ("Host ..." / "Match ..."), -1 for the top
    end: int            # index after the last line that belongs to it
    kind: str           # "top", "host" or "match"
    patterns: list[str]


def _sections(lines: list[str]) -> list[_Section]:
    """Split config lines into the top part and Host/Match sections (ssh_config(5))."""
    out = [_Section(-1, 0, "top", [])]
    for i, line in enumerate(lines):
        m = _HEADER_RE.match(line)
        if m:
            out[-1].end = i
            out.append(_Section(i, i + 1, m.group(1).lower(), m.group(2).split()))
        else:
            out[-1].end = i + 1
    return out


def _block_text(lines: list[str], sec: _Section) -> str:
    end = sec.end
    while end > sec.start + 1 and not lines[end - 1].strip():  # trailing blank lines
        end -= 1
    return "".join(lines[sec.start:end])


def config_path(home: str | os.PathLike | None = None) -> Path:
    """``~/.ssh/config``; when it is a symlink (dotfile managers), the file it points to."""
    p = ssh_dir(home) / "config"
    return Path(os.path.realpath(p)) if p.is_symlink() else p


def host_fields(target: str) -> dict:
    """The :func:`add_host` fields a target names, to save it as a ``Host`` block.

    Parameters
    ----------
    target : str
        A pasted ``ssh`` command line (its ``-o`` options kept; ``-o HostName=`` wins over the
        destination, as in OpenSSH) or ``[user@]host[:port]``.

    Returns
    -------
    dict
        ``hostname``, ``port``, ``user``, ``key``, ``jump`` (None where not given) and
        ``options`` (``-o`` keyword -> value as written).

    Raises
    ------
    ConfigError
        A line or target that cannot be read (see :func:`gpumagic.ssh.hosts.parse_ssh_command`
        and :func:`gpumagic.ssh.hosts.parse_target`).
    """
    if is_ssh_command(target):
        cmd = parse_ssh_command(target)
        options = dict(cmd.options)
        return dict(hostname=options.pop("HostName", cmd.host), port=cmd.port, user=cmd.user, key=cmd.key,
                    jump=cmd.jump, options=options)
    t = parse_target(target)
    return dict(hostname=t.host, port=t.port, user=t.user, key=None, jump=None, options={})


def add_host(name: str, hostname: str, *, port: int | None = None, user: str | None = None,
             key: str | None = None, jump: str | None = None,
             server_alive_interval: int | None = 30, server_alive_count_max: int | None = 3,
             options: dict | None = None, replace: bool = False, dry_run: bool = False,
             home: str | os.PathLike | None = None) -> AddHostResult:
    """Add ``Host name`` to ``~/.ssh/config``, keeping every existing byte.

    The block is appended (after a blank line; the file's line ending, LF or CRLF, is kept).
    With ``replace=True`` an existing ``Host name`` block is swapped in place, so its position
    (and so OpenSSH's first-value-wins order) stays.  The write is atomic
    (:func:`gpumagic._fs.atomic_write`) and the previous file is kept as ``config.bak``.

    Parameters
    ----------
    name : str
        The alias (``ssh NAME``, VS Code Remote-SSH, ``%gpu connect NAME``).
    hostname, port, user, key, jump
        ``HostName``, ``Port``, ``User``, ``IdentityFile`` (``~`` kept as written), ``ProxyJump``.
    server_alive_interval : int or None
        ``ServerAliveInterval`` in seconds (default 30; None: leave it out).
    server_alive_count_max : int or None
        ``ServerAliveCountMax`` (default 3; None: leave it out).
    options : dict, optional
        More honoured keywords, e.g. ``{"ConnectTimeout": "20"}``.
    replace : bool
        Replace a block with the same name instead of refusing.
    dry_run : bool
        Check and compute everything, write nothing (``backup`` is then None).

    Returns
    -------
    AddHostResult
        ``action`` is ``"unchanged"`` when an identical block is already there.

    Raises
    ------
    HostExists
        A different ``Host name`` block exists and ``replace`` is False (the hint shows how
        to replace it), or the name shares its ``Host`` line with other names.
    ConfigError
        Bad name or values.
    LocalFileError
        ``~/.ssh/config`` cannot be read or written (the old file stays as it was).
    """
    path = config_path(home)
    try:
        old = path.read_bytes()
    except FileNotFoundError:
        old = b""
    except OSError as e:
        raise LocalFileError(f"cannot read {path}: {_os_reason(e)}",
                             f"check that {path.parent} is a directory and {path} a file you can "
                             "read (e.g. `ls -ld ~/.ssh ~/.ssh/config`)") from None
    text = old.decode("utf-8", errors="surrogateescape")
    newline = "\r\n" if "\r\n" in text else "\n"
    block = host_block(name, hostname, port=port, user=user, key=key, jump=jump,
                       server_alive_interval=server_alive_interval,
                       server_alive_count_max=server_alive_count_max, options=options,
                       newline=newline)
    lines = text.splitlines(keepends=True)
    found = [s for s in _sections(lines)
             if s.kind == "host" and any(p.lower() == name.lower() for p in s.patterns)]
    old_block = None
    if found:
        sec = found[0]
        old_block = _block_text(lines, sec)
        if old_block.replace("\r\n", "\n") == block.replace("\r\n", "\n"):
            return AddHostResult(path=path, block=block, action="unchanged", old_block=old_block)
        if not replace:
            raise HostExists(f"{path} already has a different `Host {name}` block:\n{old_block.rstrip()}",
                             f"pass --replace to swap it for the new one (the old file is kept as "
                             f"{path.name}.bak), or choose another name")
        if len(sec.patterns) != 1:
            raise HostExists(f"`Host {name}` shares its line with {' '.join(sec.patterns)} in {path}",
                             "edit that block by hand, or add this machine under another name")
        end = sec.start + len(old_block.splitlines())
        new_text = "".join(lines[:sec.start]) + block + "".join(lines[end:])
        action = "replaced"
    else:
        prefix = text
        if prefix and not prefix.endswith(("\n", "\r")):
            prefix += newline
        if prefix.strip() and not prefix.endswith(newline * 2):
            prefix += newline
        new_text = prefix + block
        action = "added"
    notes = _shadowed(new_text, name, block, home)
    if dry_run:
        return AddHostResult(path=path, block=block, action=action, old_block=old_block, notes=notes)
    backup = Path(str(path) + ".bak") if old else None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.parent == ssh_dir(home):
            _ensure_ssh_dir(path.parent, home)
        atomic_write(path, new_text.encode("utf-8", errors="surrogateescape"),
                     mode=None if old else 0o600, backup=backup)
    except OSError as e:  # atomic_write leaves the old file as it was
        raise LocalFileError(f"cannot write {path}: {_os_reason(e)}",
                             f"check that you own {path.parent} and can write there (e.g. "
                             f"`ls -ld {path.parent}`), or add the block by hand") from None
    return AddHostResult(path=path, block=block, action=action, old_block=old_block,
                         backup=backup, notes=notes)


def _shadowed(text: str, name: str, block: str, home) -> list[str]:
    """Warnings for keywords of ``block`` that an earlier block (e.g. ``Host *``) overrides.

    OpenSSH uses the first value it reads for a keyword, so ``User`` in a ``Host *`` block
    above the new one wins over the new block's ``User``.  Both texts are resolved for
    ``name`` with :mod:`gpumagic.ssh.config` (``Match exec`` commands are not run here).
    """
    from .ssh.config import SshConfig, resolve_options

    try:
        got = resolve_options(name, SshConfig.from_text(text, home=home or None), run_exec=False)
        want = resolve_options(name, SshConfig.from_text(block, home=home or None), run_exec=False)
    except GpumagicError:
        return []
    notes = []
    if want.identity_files and (got.identity_files or [None])[0] != want.identity_files[0]:
        notes.append(f"an earlier block in ~/.ssh/config lists IdentityFile {got.identity_files[0]} first; "
                     f"ssh offers it before {want.identity_files[0]}")
    set_in_block = {line.split()[0].lower() for line in block.splitlines()[1:] if line.strip()}
    for kw, attr in (("HostName", "hostname"), ("Port", "port"), ("User", "user"),
                     ("ProxyJump", "proxy_jump"), ("ServerAliveInterval", "server_alive_interval"),
                     ("ServerAliveCountMax", "server_alive_count_max"), ("ConnectTimeout", "connect_timeout"),
                     ("IdentitiesOnly", "identities_only"), ("UserKnownHostsFile", "user_known_hosts_files")):
        if kw.lower() not in set_in_block:
            continue
        g, w = getattr(got, attr), getattr(want, attr)
        if g != w:
            notes.append(f"an earlier block in ~/.ssh/config sets {kw} {_as_written(g)}, which wins over "
                         f"this block's {kw} {_as_written(w)} (OpenSSH uses the first value): move "
                         f"`Host {name}` above that block")
    return notes


def _as_written(value) -> str:
    if isinstance(value, list):
        return " ".join(value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


# -- install-key -------------------------------------------------------------------------

#: The machine-side program (``gpumagic/remote/programs/keys-authorize.sh``): the key line is
#: its argument (a public key is no secret); it prints ``added`` or ``present``.
AUTHORIZE = "keys-authorize.sh"


def authorize_key(connection: Connection, public_key: str) -> str:
    """Append ``public_key`` to the remote ``~/.ssh/authorized_keys`` unless it is there.

    Returns
    -------
    str
        ``"added"`` or ``"present"``.

    Raises
    ------
    GpumagicError
        When the remote shell cannot write the file (its stderr in the message).
    """
    from .remote.execution import run_program

    _key_type_and_blob(public_key)
    line = public_key.strip()
    if "\n" in line or "\r" in line:
        raise ConfigError("the public key spans several lines", "give one .pub line")
    r = run_program(connection, AUTHORIZE, line, timeout=60)
    state = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    if r.exit_code != 0 or state not in ("added", "present"):
        raise GpumagicError(f"could not update ~/.ssh/authorized_keys on {connection.spec.address}: "
                            f"{(r.stderr or r.stdout).strip()[-300:]}",
                            "check the disk space and the permissions of ~/.ssh on the machine")
    return state


class _PasswordConnection(Connection):
    """A :class:`Connection` that logs in with a password instead of keys.

    The host key is checked exactly as for key logins before the password is asked, so a
    password is never sent to an unverified server.  The password is asked once and
    dropped right after use.
    """

    def __init__(self, spec: HostSpec, *, password_prompt: PasswordPrompt, **kw):
        super().__init__(spec, **kw)
        self._password_prompt = password_prompt

    def _authenticate(self, t: paramiko.Transport) -> None:
        spec = self.spec
        try:
            with warnings.catch_warnings():  # getpass's "can not control echo" on a pipe
                warnings.simplefilter("ignore", getpass.GetPassWarning)
                password = self._password_prompt(f"Password for {spec.user}@{spec.address}: ")
        except (EOFError, KeyboardInterrupt, NotImplementedError) as e:
            # no terminal (stdin at EOF), or a Jupyter frontend without an input box
            # (ipykernel's StdinNotImplementedError is a NotImplementedError)
            why = "cancelled" if isinstance(e, KeyboardInterrupt) else "there is no terminal or input box here"
            raise AuthenticationFailed(f"cannot ask for the password of {spec.user}@{spec.address}: {why}",
                                       "run it where you can type (IPython in a terminal, or a notebook cell), "
                                       "or add the public key in your platform's console") from None
        try:
            # fallback=True: servers that offer only keyboard-interactive get the same password
            t.auth_password(spec.user, password, fallback=True)
        except paramiko.BadAuthenticationType as e:
            raise AuthenticationFailed(
                f"{spec.user}@{spec.address} does not accept passwords (it allows: {', '.join(e.allowed_types)})",
                "add the public key in your platform's console (SSH keys page) instead")
        except paramiko.AuthenticationException:
            raise AuthenticationFailed(f"{spec.user}@{spec.address} refused the password",
                                       "check the user name and the password the platform shows")
        finally:
            password = None  # noqa: F841 -- drop our reference right away


@dataclass(frozen=True)
class InstallKeyResult:
    """What :func:`install_key` did.

    Attributes
    ----------
    spec : HostSpec
        The machine.
    state : str
        ``"added"`` (appended), ``"present"`` (the key was there already).
    used_password : bool
        False when a key login already worked, so no password was asked.
    fingerprint : str
        ``SHA256:...`` of the installed key.
    """

    spec: HostSpec
    state: str
    used_password: bool
    fingerprint: str


def install_key(target: str, *, key: str | os.PathLike | None = None, port: int | None = None,
                user: str | None = None, jump: str | None = None, trust_new_host: bool = False,
                password_prompt: PasswordPrompt = _getpass, try_key_first: bool = True,
                home: str | os.PathLike | None = None) -> InstallKeyResult:
    """Put the public key of ``key`` into the machine's ``~/.ssh/authorized_keys``, like ssh-copy-id.

    Order: check the host key (never trusted silently); try a key login first when
    ``try_key_first`` (then no password is needed); otherwise ask the password once with
    ``password_prompt`` and log in with it; append the key unless already there (creating
    ``~/.ssh`` 0700 and the file 0600); finally open a new connection with only that key
    to prove a key login works.

    Parameters
    ----------
    target : str
        ``[user@]host[:port]``, a ``~/.ssh/config`` alias, or a pasted ``ssh ...`` line.
    key : path, optional
        The private key whose ``.pub`` is installed (default: the target's first
        ``IdentityFile``, else ``~/.ssh/id_ed25519``).
    password_prompt : callable
        ``prompt(text) -> password``; default ``getpass.getpass`` (no echo).  The password is
        never stored or logged.

    Raises
    ------
    UnknownHostKey, ChangedHostKey, RevokedHostKey
        Before any password is asked.
    AuthenticationFailed
        Password refused, password logins disabled, or the key login still fails afterwards
        (e.g. the server reads keys from another AuthorizedKeysFile).
    ConfigError
        No key file.
    """
    if is_ssh_command(target):
        cmd = parse_ssh_command(target)
        target = cmd.host
        port, user, jump = port or cmd.port, user or cmd.user, jump or cmd.jump
        key = key or cmd.key
    spec = resolve(target, home=home, port=port, user=user, proxy_jump=jump)
    if key is None:
        key = next((f for f in spec.identity_files if os.path.exists(f)), None) or default_key_path(home)
    key = str(_local_path(key))
    if not os.path.exists(key):
        raise ConfigError(f"no private key at {key}",
                          "make one first with `%gpu keygen`, or name yours with --key PATH")
    line = read_public_key(key)
    key_spec = spec.with_options(identity_files=(key,), identities_only=True)
    used_password = False
    conn: Connection | None = None
    decrypted: dict = {}  # one passphrase prompt for the probe and the final check
    if try_key_first:
        probe = Connection(key_spec, trust_new_host=trust_new_host, home=home, use_agent=False)
        probe._keys = decrypted
        try:
            probe.open()
            conn = probe
        except AuthenticationFailed:
            probe.close()
    try:
        if conn is None:
            conn = _PasswordConnection(spec, password_prompt=password_prompt,
                                       trust_new_host=trust_new_host, home=home, use_agent=False)
            conn.open()
            used_password = True
        state = authorize_key(conn, line)
    finally:
        if conn is not None:
            conn.close()
    check = Connection(key_spec, trust_new_host=False, home=home, use_agent=False)
    check._keys = decrypted
    try:
        check.open()
    except AuthenticationFailed:
        raise AuthenticationFailed(
            f"the key is in ~/.ssh/authorized_keys on {spec.address}, but a key login still fails",
            "the server may read keys from another file (AuthorizedKeysFile in its sshd_config) "
            "or refuse loose permissions on the home directory; add the key in the platform's console")
    finally:
        check.close()
    return InstallKeyResult(spec=spec, state=state, used_password=used_password,
                            fingerprint=public_key_fingerprint(line))


