"""Pure host resolution: targets, ``~/.ssh/config`` (with Include) and the keywords gpumagic honours.

Nothing here opens a socket.  ``resolve`` turns what a user typed (``mygpu``,
``root@203.0.113.10:41022``) into a :class:`HostSpec` following OpenSSH's rules: the first
value found for a keyword wins, command-line options beat the config file.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import paramiko

from .errors import ConfigError

DEFAULT_KEY_NAMES = ("id_ed25519", "id_ecdsa", "id_rsa")


def ssh_dir(home: str | os.PathLike | None = None) -> Path:
    """The user's ``~/.ssh`` directory (``$HOME/.ssh``)."""
    return Path(home or os.path.expanduser("~")) / ".ssh"


@dataclass(frozen=True)
class Target:
    """What the user typed: ``[user@]host[:port]`` or an alias."""

    host: str
    user: str | None = None
    port: int | None = None


_TARGET_RE = re.compile(
    r"^(?:(?P<user>[^@\s]+)@)?(?:\[(?P<v6>[^\]]+)\]|(?P<host>[^:@\s\[\]]+))(?::(?P<port>\d+))?$"
)


def parse_target(text: str) -> Target:
    """Parse ``[user@]host[:port]`` (``[v6addr]:port`` for IPv6).

    Raises
    ------
    ConfigError
        When the text is empty or not of that form.
    """
    text = (text or "").strip()
    m = _TARGET_RE.match(text)
    if not m:
        raise ConfigError(
            f"cannot read {text!r} as a machine",
            "write a ~/.ssh/config alias or user@host[:port], e.g. root@203.0.113.10:41022",
        )
    port = int(m.group("port")) if m.group("port") else None
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"port {port} is out of range", "use a port between 1 and 65535")
    return Target(host=m.group("v6") or m.group("host"), user=m.group("user"), port=port)


@dataclass(frozen=True)
class HostSpec:
    """Everything needed to open one SSH connection.

    Attributes
    ----------
    alias : str
        The name the user typed (a config ``Host`` alias or the host itself).
    hostname : str
        ``HostName`` (defaults to the alias).
    port : int
        ``Port`` (default 22).
    user : str
        ``User`` (default: the local user name).
    identity_files : tuple of str
        ``IdentityFile`` entries, ``~`` expanded, in config order.
    identities_only : bool
        ``IdentitiesOnly``: offer only ``identity_files`` (no agent, no default keys).
    server_alive_interval : float
        ``ServerAliveInterval`` in seconds (0 = off; gpumagic's default is 30).
    server_alive_count_max : int
        ``ServerAliveCountMax``: unanswered keepalives before the peer is declared dead.
    connect_timeout : float
        ``ConnectTimeout`` in seconds (gpumagic's default is 15).
    proxy_jump : tuple of str
        ``ProxyJump`` hops in the order written (empty for none).
    known_hosts : str
        The ``UserKnownHostsFile`` to check and update.
    """

    alias: str
    hostname: str
    port: int = 22
    user: str = ""
    identity_files: tuple[str, ...] = ()
    identities_only: bool = False
    server_alive_interval: float = 30.0
    server_alive_count_max: int = 3
    connect_timeout: float = 15.0
    proxy_jump: tuple[str, ...] = ()
    known_hosts: str = ""
    from_config: bool = False
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def address(self) -> str:
        """``host:port`` as gpumagic names a machine in messages."""
        return f"{self.hostname}:{self.port}"

    @property
    def known_hosts_name(self) -> str:
        """The known_hosts name for this host: ``host`` on port 22, else ``[host]:port``."""
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"

    def with_options(self, **changes) -> "HostSpec":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


_INCLUDE_RE = re.compile(r"^\s*include(?:\s*=\s*|\s+)(.+)$", re.IGNORECASE)


def expand_includes(text: str, base: Path, _depth: int = 0) -> str:
    """Inline ``Include`` lines of an ssh_config text, as OpenSSH reads them.

    Relative paths resolve against ``base`` (``~/.ssh``), ``~`` expands, globs are read in
    sorted order, and missing files are skipped (OpenSSH does the same).
    """
    if _depth > 16:
        raise ConfigError("ssh config Include nests deeper than 16 levels",
                          "look for an Include that includes itself")
    out = []
    for line in text.splitlines():
        m = _INCLUDE_RE.match(line)
        if not m:
            out.append(line)
            continue
        for pattern in m.group(1).split():
            pattern = os.path.expanduser(pattern.strip('"'))
            if not os.path.isabs(pattern):
                pattern = str(base / pattern)
            for path in sorted(glob.glob(pattern)):
                try:
                    inner = Path(path).read_text(encoding="utf-8", errors="replace")
                except OSError:
                    continue
                out.append(expand_includes(inner, base, _depth + 1))
    return "\n".join(out) + "\n"


def load_ssh_config(path: str | os.PathLike | None = None,
                    home: str | os.PathLike | None = None) -> paramiko.SSHConfig:
    """Read ``~/.ssh/config`` (or ``path``) with Include expanded.

    Returns an empty config when the file does not exist.

    Raises
    ------
    ConfigError
        When the file cannot be parsed.
    """
    base = ssh_dir(home)
    path = Path(path) if path else base / "config"
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        text = ""
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}", f"check the permissions of {path}")
    try:
        return paramiko.SSHConfig.from_text(expand_includes(text, base))
    except Exception as e:  # paramiko raises ConfigParseError and plain Exceptions
        raise ConfigError(f"cannot parse {path}: {e}", "fix that line, then connect again")


def config_aliases(config: paramiko.SSHConfig) -> list[str]:
    """The concrete ``Host`` aliases of a config (patterns with ``*``/``?``/``!`` left out)."""
    names = []
    for name in config.get_hostnames():
        if name and not any(c in name for c in "*?!") and name not in names:
            names.append(name)
    return sorted(names)


def _yes(value) -> bool:
    return str(value).strip().lower() in ("yes", "true", "1")


def _seconds(value, keyword: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{keyword} {value!r} is not a number of seconds",
                          f"fix {keyword} in ~/.ssh/config")


def split_jump(value: str | None) -> tuple[str, ...]:
    """Split a ``ProxyJump`` value into hops; ``none`` means no jump."""
    if not value or value.strip().lower() == "none":
        return ()
    return tuple(h.strip() for h in value.split(",") if h.strip())


def resolve(text: str, *, config: paramiko.SSHConfig | None = None,
            home: str | os.PathLike | None = None, port: int | None = None,
            user: str | None = None, identity_file: str | None = None,
            proxy_jump: str | None = None) -> HostSpec:
    """Resolve what the user typed into a :class:`HostSpec`.

    Parameters
    ----------
    text : str
        A ``~/.ssh/config`` alias or ``[user@]host[:port]``.
    config : paramiko.SSHConfig, optional
        Defaults to ``load_ssh_config(home=home)``.
    port, user, identity_file, proxy_jump : optional
        Command-line values; they win over the target text and the config
        (``-p``, ``-l``/``user@``, ``-i``, ``-J``).

    Raises
    ------
    ConfigError
        For a malformed target or config value.
    """
    target = parse_target(text)
    if config is None:
        config = load_ssh_config(home=home)
    found = config.lookup(target.host)
    from_config = target.host in config_aliases(config) or "hostname" in found

    def expand(p: str) -> str:
        p = p.replace("%d", str(Path(home or os.path.expanduser("~"))))
        p = p.replace("%u", os.environ.get("USER", "")).replace("%h", found.get("hostname", target.host))
        if p.startswith("~"):
            p = str(Path(home or os.path.expanduser("~"))) + p[1:]
        return p

    identity_files = tuple(expand(p) for p in found.get("identityfile", []))
    if identity_file:
        identity_files = (expand(identity_file),) + identity_files
    cfg_port = found.get("port")
    try:
        final_port = int(port or target.port or cfg_port or 22)
    except ValueError:
        raise ConfigError(f"Port {cfg_port!r} for {target.host} is not a number", "fix Port in ~/.ssh/config")
    final_user = (user or target.user or found.get("user") or os.environ.get("USER")
                  or _local_user())
    jump = proxy_jump if proxy_jump is not None else found.get("proxyjump")
    known = found.get("userknownhostsfile")
    known_hosts = expand(known.split()[0]) if known else str(ssh_dir(home) / "known_hosts")
    return HostSpec(
        alias=target.host,
        hostname=found.get("hostname", target.host),
        port=final_port,
        user=final_user,
        identity_files=identity_files,
        identities_only=_yes(found.get("identitiesonly", "no")),
        server_alive_interval=_seconds(found.get("serveraliveinterval", 30), "ServerAliveInterval"),
        server_alive_count_max=int(_seconds(found.get("serveralivecountmax", 3), "ServerAliveCountMax")),
        connect_timeout=_seconds(found.get("connecttimeout", 15), "ConnectTimeout"),
        proxy_jump=split_jump(jump),
        known_hosts=known_hosts,
        from_config=from_config,
    )


def _local_user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except Exception:
        return "root"


def default_identity_files(home: str | os.PathLike | None = None) -> list[str]:
    """OpenSSH's default key files that exist (``~/.ssh/id_ed25519``, ``id_ecdsa``, ``id_rsa``)."""
    base = ssh_dir(home)
    return [str(base / n) for n in DEFAULT_KEY_NAMES if (base / n).exists()]
