"""Kernelspecs that show a machine's live session in a front end's kernel list.

``gpumagic kernel install HOST`` writes one into the user's Jupyter data directory through
``jupyter_client.kernelspec.KernelSpecManager`` (``--sys-prefix``: into the environment's),
as ``jupyter kernelspec install`` does.  It is named ``gpumagic-HOST`` (``gpumagic-HOST-SESSION``
for a session other than ``main``) and shown as ``Python 3 on HOST (gpumagic)``; its ``argv``
starts the bridge (:mod:`gpumagic.kernel_bridge`), and its metadata says what it is:

``metadata.gpumagic``
    ``host``, ``session``, ``python`` (the machine's, or null: ``python3`` there),
    ``sandbox`` (true: the bridge starts the local sandbox sshd), and ``shutdown``:
    :data:`SHUTDOWN_RULE`.

The files are 0644 and hold no secret: the host is a name to resolve with ``~/.ssh/config``
as ``%gpu connect`` does, and the session's token stays on the machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError, GpumagicError
from ..remote.kernel import DEFAULT_NAME, check_name

if TYPE_CHECKING:
    from ..ssh.hosts import HostSpec

#: What a front end's "shut down kernel" does, written into every kernelspec's metadata.
SHUTDOWN_RULE = ("detach: the front end's shutdown ends this bridge, never the session on the "
                 "machine (its variables and a running cell stay; the next start of this kernel "
                 "attaches to it); `gpumagic kernel stop HOST` stops the session; restart gives a "
                 "fresh namespace")
#: The prefix of every kernelspec gpumagic writes.
PREFIX = "gpumagic-"
SANDBOX = "sandbox"
#: File mode of the kernelspec's files (no secret in them: readable as any kernelspec).
FILE_MODE = 0o644


@dataclass
class BridgeSpec:
    """What one kernelspec starts: the bridge to session ``session`` on ``host``."""

    host: str
    session: str = DEFAULT_NAME
    python: str | None = None
    sandbox: bool = False
    display_name: str | None = None

    def __post_init__(self) -> None:
        # the sandbox is this computer: its session runs with this Python (which has ipykernel)
        if self.sandbox and not self.python:
            self.python = sys.executable

    @property
    def kernel_name(self) -> str:
        """``gpumagic-HOST`` (``-SESSION`` after it unless the session is ``main``), in the
        letters jupyter_client allows in a kernel name (``[a-z0-9._-]``)."""
        base = PREFIX + _slug(self.host)
        return base if self.session == DEFAULT_NAME else f"{base}-{_slug(self.session)}"

    def argv(self) -> list[str]:
        """The command a front end runs, with ``{connection_file}`` for it to fill in."""
        cmd = [sys.executable, "-m", "gpumagic.kernel_bridge", "-f", "{connection_file}"]
        cmd += ["--sandbox"] if self.sandbox else ["--host", self.host]
        cmd += ["--session", self.session]
        if self.python:
            cmd += ["--python", self.python]
        return cmd

    def to_json(self) -> dict:
        where = self.host if self.session == DEFAULT_NAME else f"{self.host}:{self.session}"
        return {
            "argv": self.argv(),
            "display_name": self.display_name or f"Python 3 on {where} (gpumagic)",
            "language": "python",
            # the bridge turns the front end's interrupt_request into SIGINT on the machine
            "interrupt_mode": "message",
            "env": {},
            "metadata": {"debugger": False,
                         "gpumagic": {"host": self.host, "session": self.session, "python": self.python,
                                      "sandbox": self.sandbox, "shutdown": SHUTDOWN_RULE}},
        }


def host_of(hs: HostSpec, home: str | None = None) -> str | None:
    """The text a kernelspec's bridge can reach the machine of ``hs`` by (``--host``, given to
    ``gpumagic.connect``), or None when there is none.

    The bridge knows a machine only by that text: an alias of ``~/.ssh/config`` or
    ``user@host[:port]``, resolved with ``~/.ssh/config`` as ``ssh`` does.  A machine connected
    with options the config does not hold (``-i KEY``, ``-J``) resolves otherwise from any
    text: None.  The alias typed comes first, then ``user@alias:port``, then
    ``user@hostname:port``: the first that resolves to ``hs``'s address, user, keys and jump
    hosts.
    """
    from ..ssh.hosts import resolve

    def same(text: str) -> bool:
        try:
            other = resolve(text, home=home)
        except GpumagicError:
            return False
        return all(getattr(other, f) == getattr(hs, f)
                   for f in ("hostname", "port", "user", "identity_files", "proxy_jump"))

    port = "" if hs.port == 22 else f":{hs.port}"
    host = f"[{hs.hostname}]" if ":" in hs.hostname else hs.hostname
    return next((t for t in dict.fromkeys((hs.alias, f"{hs.user}@{hs.alias}{port}", f"{hs.user}@{host}{port}"))
                 if same(t)), None)


def _slug(text: str) -> str:
    slug = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.")
    if not slug:
        raise ConfigError(f"{text!r} cannot name a kernelspec",
                          "give a host alias made of letters, digits, '.', '-' or '_' (or --display-name)")
    return slug


def _manager():
    try:
        from jupyter_client.kernelspec import KernelSpecManager
    except ImportError:
        raise ConfigError("installing a kernelspec needs jupyter_client",
                          "pip install 'gpumagic[notebook]' (or jupyter_client)") from None
    return KernelSpecManager()


def install(spec: BridgeSpec, *, sys_prefix: bool = False) -> str:
    """Write ``spec``'s kernelspec (replacing one of the same name); returns its folder.

    Raises
    ------
    ConfigError
        A session name gpumagic refuses, a host that cannot name a kernelspec, or no
        jupyter_client.
    """
    check_name(spec.session)
    ksm = _manager()
    src = tempfile.mkdtemp(prefix="gpumagic-kernelspec-")
    try:
        path = os.path.join(src, "kernel.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(spec.to_json(), f, indent=1)
            f.write("\n")
        os.chmod(path, FILE_MODE)
        dest = ksm.install_kernel_spec(src, spec.kernel_name, user=not sys_prefix, prefix=sys.prefix if sys_prefix else None)
    finally:
        shutil.rmtree(src, ignore_errors=True)
    os.chmod(dest, 0o755)
    for name in os.listdir(dest):
        os.chmod(os.path.join(dest, name), FILE_MODE)
    return dest


def installed_text(spec: BridgeSpec, path: str) -> str:
    """What ``gpumagic kernel install`` and ``%gpu kernel install`` say after :func:`install`."""
    stop = Installed(spec.kernel_name, "", spec.host, spec.session, path, spec.sandbox).stop_command
    return (f"installed kernelspec {spec.kernel_name} ({spec.to_json()['display_name']}) in {path}\n"
            f"pick it in your front end's kernel list; its shutdown detaches, `{stop}` stops the session")


@dataclass
class Installed:
    """One gpumagic kernelspec found by jupyter_client."""

    name: str
    display_name: str
    host: str
    session: str
    path: str
    sandbox: bool = False

    @property
    def stop_command(self) -> str:
        """The command that stops its session."""
        where = "--sandbox" if self.sandbox else self.host
        return f"gpumagic kernel stop {where}" + ("" if self.session == DEFAULT_NAME else f" --name {self.session}")


def installed() -> list[Installed]:
    """The gpumagic kernelspecs jupyter_client finds (every data directory), sorted by name."""
    ksm = _manager()
    out = []
    for name, path in sorted(ksm.find_kernel_specs().items()):
        if not name.startswith(PREFIX):
            continue
        try:
            spec = ksm.get_kernel_spec(name)
        except Exception:  # noqa: BLE001 - a broken spec of someone else's: not listed
            continue
        meta = (spec.metadata or {}).get("gpumagic")
        if isinstance(meta, dict):
            out.append(Installed(name, spec.display_name, str(meta.get("host")), str(meta.get("session")), path,
                                 bool(meta.get("sandbox"))))
    return out


def listing() -> str:
    """What ``gpumagic kernel list`` and ``%gpu kernel list --kernelspecs`` print: one line per
    installed gpumagic kernelspec (name, display name, ``host:session``, folder)."""
    found = installed()
    if not found:
        return "no gpumagic kernelspec is installed (`gpumagic kernel install HOST` adds one)"
    width = max(len(k.name) for k in found)
    return "\n".join(f"{k.name:<{width}}  {k.display_name}  ({k.host}:{k.session})  {k.path}" for k in found)


def find(name_or_host: str) -> Installed:
    """The installed gpumagic kernelspec named ``name_or_host`` (``gpumagic-HOST``, or just
    ``HOST``).

    Raises
    ------
    ConfigError
        None is installed by that name (naming those that are).
    """
    found = installed()
    for k in found:
        if name_or_host in (k.name, k.name.removeprefix(PREFIX)):
            return k
    matches = [k for k in found if k.host == name_or_host]
    if len(matches) == 1:
        return matches[0]
    names = ", ".join(k.name for k in found) or "none"
    raise ConfigError(f"no gpumagic kernelspec {name_or_host!r} is installed (installed: {names})",
                      "`gpumagic kernel list` lists them; `gpumagic kernel install HOST` adds one")


def uninstall(name_or_host: str) -> Installed:
    """Remove the gpumagic kernelspec ``name_or_host`` (see :func:`find`); returns what it was.
    The session on the machine is not touched."""
    k = find(name_or_host)
    _manager().remove_kernel_spec(k.name)
    return k


def uninstalled_text(k: Installed) -> str:
    """What ``gpumagic kernel uninstall`` and ``%gpu kernel uninstall`` say after :func:`uninstall`."""
    return (f"removed kernelspec {k.name} ({k.path}); the session {k.session} on {k.host} is not touched "
            f"(`{k.stop_command}` stops it)")
