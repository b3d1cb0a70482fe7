"""OpenSSH ``known_hosts`` handling: look up, trust (append), forget (like ``ssh-keygen -R``).

Names follow OpenSSH: ``host`` for port 22, ``[host]:port`` otherwise; hashed entries
(``|1|salt|hash``) are matched too.  Files are never rewritten except by ``forget``, which
keeps a ``.old`` copy as ``ssh-keygen -R`` does; ``add`` appends one line and leaves every
other byte as it was.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from pathlib import Path

import paramiko

from ._fs import atomic_write


def known_name(host: str, port: int) -> str:
    """The name OpenSSH stores for ``host`` on ``port``."""
    return host if int(port) == 22 else f"[{host}]:{int(port)}"


def fingerprint(key: paramiko.PKey) -> str:
    """The ``SHA256:...`` fingerprint that ``ssh`` and ``ssh-keygen -l`` print."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def _entry_matches(entry: str, name: str) -> bool:
    if entry.startswith("|1|"):
        try:
            _, _, salt, want = entry.split("|")
            mac = hmac.new(base64.b64decode(salt), name.encode(), hashlib.sha1).digest()
            return hmac.compare_digest(base64.b64encode(mac).decode(), want)
        except Exception:
            return False
    return entry == name


def _line_names(line: str) -> list[str] | None:
    s = line.strip()
    if not s or s.startswith("#"):
        return None
    fields = s.split()
    if fields[0].startswith("@"):  # @cert-authority / @revoked markers
        return None
    return fields[0].split(",")


def lookup(path: str | os.PathLike, host: str, port: int) -> list[paramiko.PKey]:
    """Host keys stored for exactly ``host`` on ``port`` (no fallback to other ports)."""
    name = known_name(host, port)
    keys = []
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return keys
    for line in text.splitlines():
        names = _line_names(line)
        if not names or not any(_entry_matches(n, name) for n in names):
            continue
        entry = paramiko.hostkeys.HostKeyEntry.from_line(line)
        if entry is not None and entry.key is not None:
            keys.append(entry.key)
    return keys


def add(path: str | os.PathLike, host: str, port: int, key: paramiko.PKey) -> str:
    """Append ``name keytype base64`` for ``host``/``port``; returns the line written."""
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


def forget(path: str | os.PathLike, host: str, port: int = 22) -> int:
    """Remove every line for ``host``/``port``, like ``ssh-keygen -R``; returns lines removed.

    The previous file is kept as ``known_hosts.old``.
    """
    path = Path(path)
    name = known_name(host, port)
    try:
        text = path.read_bytes().decode("utf-8", errors="surrogateescape")
    except FileNotFoundError:
        return 0
    kept, removed = [], 0
    for line in text.splitlines(keepends=True):
        names = _line_names(line)
        if names and any(_entry_matches(n, name) for n in names):
            removed += 1
        else:
            kept.append(line)
    if removed:
        atomic_write(path, "".join(kept).encode("utf-8", errors="surrogateescape"),
                     backup=str(path) + ".old")
    return removed
