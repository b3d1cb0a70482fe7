r"""The laptop's own paths and command lines, as its platform writes them (Windows or POSIX).

gpumagic's laptop side runs on Linux, macOS and Windows; the machine side is always Linux.
Everything here is a pure function of its arguments: ``windows`` (default: this computer,
``os.name == "nt"``) and, where the environment matters, ``env`` (default ``os.environ``),
so that tests on Linux exercise the Windows branch with :mod:`ntpath`'s rules.

Windows' rules, as OpenSSH for Windows and Python apply them:

- ``~`` is ``%USERPROFILE%`` (then ``%HOMEDRIVE%%HOMEPATH%``), as :func:`ntpath.expanduser`;
  ``~\x`` is ``~/x``;
- ``\`` and ``/`` both separate; a trailing ``\`` is a trailing ``/`` (rsync's "copy the
  contents"); ``C:\x`` and ``C:x`` carry a drive, ``\\server\share\x`` is a UNC path;
- OpenSSH for Windows reads ``%USERPROFILE%\.ssh\config``, then
  ``%PROGRAMDATA%\ssh\ssh_config`` (its ``/etc/ssh`` is ``%PROGRAMDATA%\ssh``);
- a command line's backslashes are path separators, never escapes: only quotes group words.
"""

from __future__ import annotations

import ntpath
import os
import posixpath
import shlex
from typing import Mapping

#: Where OpenSSH keeps its system-wide files on POSIX.
POSIX_SSH_DIR = "/etc/ssh"


def on_windows(windows: bool | None = None) -> bool:
    """``windows`` as given, else whether this computer is Windows (``os.name == "nt"``)."""
    return os.name == "nt" if windows is None else windows


def pathmod(windows: bool | None = None):
    """:mod:`ntpath` on Windows, :mod:`posixpath` elsewhere."""
    return ntpath if on_windows(windows) else posixpath


def seps(windows: bool | None = None) -> str:
    """The characters that separate a local path's parts: ``"/"``, or ``"/\\"`` on Windows."""
    return "/\\" if on_windows(windows) else "/"


def home_dir(*, windows: bool | None = None, env: Mapping[str, str] | None = None) -> str:
    """The user's home for ``~``: ``%USERPROFILE%`` (else ``%HOMEDRIVE%%HOMEPATH%``) on
    Windows, ``$HOME`` (else the passwd entry) elsewhere, as :func:`os.path.expanduser`."""
    if env is None and windows is None:
        return os.path.expanduser("~")
    env = os.environ if env is None else env
    if on_windows(windows):
        if env.get("USERPROFILE"):
            return env["USERPROFILE"]
        if env.get("HOMEPATH"):
            return env.get("HOMEDRIVE", "") + env["HOMEPATH"]
        return "~"
    return env.get("HOME") or os.path.expanduser("~")


def ssh_system_dir(*, windows: bool | None = None, env: Mapping[str, str] | None = None) -> str:
    """OpenSSH's system-wide directory: ``/etc/ssh``, or ``%PROGRAMDATA%\\ssh`` on Windows
    (OpenSSH for Windows' ``__PROGRAMDATA__\\ssh``; ``C:\\ProgramData`` when unset)."""
    if not on_windows(windows):
        return POSIX_SSH_DIR
    env = os.environ if env is None else env
    return ntpath.join(env.get("PROGRAMDATA") or "C:\\ProgramData", "ssh")


def ssh_config_files(home: str, *, windows: bool | None = None,
                     env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The files ``ssh`` reads without ``-F``, in order: the user's, then the system's
    (``~/.ssh/config`` and ``/etc/ssh/ssh_config``; on Windows
    ``%USERPROFILE%\\.ssh\\config`` and ``%PROGRAMDATA%\\ssh\\ssh_config``)."""
    p = pathmod(windows)
    return (p.join(home, ".ssh", "config"),
            p.join(ssh_system_dir(windows=windows, env=env), "ssh_config"))


def split_tilde(path: str, *, windows: bool | None = None) -> tuple[str, str] | None:
    """``(user, rest)`` for a path that starts with ``~`` (``user`` empty for ``~`` alone,
    ``rest`` without its leading separators); None for any other path.  ``~\\x`` counts as
    ``~/x`` on Windows."""
    if not path.startswith("~"):
        return None
    body = path[1:]
    cut = min((i for i in (body.find(s) for s in seps(windows)) if i >= 0), default=len(body))
    return body[:cut], body[cut:].lstrip(seps(windows))


def join_home(base: str, rest: str, *, windows: bool | None = None) -> str:
    """``rest`` (``/``-separated, as in a config) under ``base``; on Windows with ``\\``
    throughout, as Windows writes paths (``C:\\Users\\me\\.ssh\\id_ed25519``)."""
    if on_windows(windows):
        return ntpath.join(base, rest.replace("/", "\\")) if rest else base
    slash = "" if base.endswith("/") and base else "/"
    return f"{base}{slash}{rest}"


def strip_drive(path: str, *, windows: bool | None = None) -> str:
    """``path`` without its Windows drive or UNC share (``C:``, ``\\\\server\\share``);
    unchanged elsewhere."""
    return ntpath.splitdrive(path)[1] if on_windows(windows) else path


def split_command_line(line: str, *, windows: bool | None = None) -> list[str]:
    """Split a command line into words as the user's own shell would.

    POSIX: :func:`shlex.split` (quotes and backslash escapes, as sh).  Windows: backslashes
    are path separators (``C:\\Users\\me\\proj\\`` stays whole, trailing ``\\`` included);
    whitespace splits, ``"..."`` or ``'...'`` around a word groups it (as PowerShell and
    cmd users write a path with spaces).

    Raises
    ------
    ValueError
        For an unclosed quote (shlex's message).
    """
    if not on_windows(windows):
        return shlex.split(line)
    return [w[1:-1] if len(w) > 1 and w[0] == w[-1] and w[0] in "'\"" else w
            for w in shlex.split(line, posix=False)]
