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


# -- a pasted ``ssh ...`` command line ---------------------------------------------------

#: ssh(1) options that take an argument (OpenSSH 9 ``getopt`` string, ``ssh.c``).
_SSH_OPTS_WITH_ARG = set("BbcDEeFIiJLlmOopQRSWw")
#: ssh(1) options without an argument.
_SSH_FLAGS = set("46AaCfGgKkMNnqsTtVvXxYy")

#: ``-o`` keywords gpumagic honours, lower case -> canonical ssh_config spelling.
HONOURED_KEYWORDS = {k.lower(): k for k in (
    "HostName", "Port", "User", "IdentityFile", "ProxyJump", "IdentitiesOnly",
    "ServerAliveInterval", "ServerAliveCountMax", "ConnectTimeout", "UserKnownHostsFile",
)}

#: Why some well-known options are set aside (shown to the user, never silently dropped).
_IGNORED_WHY = {
    "stricthostkeychecking": "gpumagic never accepts a host key silently; compare the fingerprint "
                             "and connect with --trust-new-host",
    "-L": "open a tunnel with gpumagic instead of ssh -L",
    "-N": "gpumagic keeps its own connection open",
}


@dataclass(frozen=True)
class SshCommand:
    """What a pasted ``ssh ...`` login line asks for.

    Attributes
    ----------
    host : str
        The destination host (``user@`` part removed), or a ``~/.ssh/config`` alias.
    port : int or None
        ``-p PORT`` or ``-o Port=PORT`` (None: not given).
    user : str or None
        ``user@``, ``-l USER`` or ``-o User=USER``; the first one given wins, as in OpenSSH.
    key : str or None
        The first ``-i FILE`` (or ``-o IdentityFile=FILE``), as written (``~`` not expanded).
    keys : tuple of str
        Every identity file in the order written.
    jump : str or None
        ``-J`` / ``-o ProxyJump=`` value as written (comma-separated hops).
    options : dict
        Other ``-o`` keywords gpumagic honours, canonical spelling -> value as written
        (``ServerAliveInterval``, ``ConnectTimeout``, ``HostName``, ...).
    ignored : tuple of str
        Options gpumagic does not apply, each with the reason (for a note to the user).
    """

    host: str
    port: int | None = None
    user: str | None = None
    key: str | None = None
    keys: tuple[str, ...] = ()
    jump: str | None = None
    options: dict = field(default_factory=dict)
    ignored: tuple[str, ...] = ()


def is_ssh_command(text: str) -> bool:
    """True when ``text`` looks like a pasted ``ssh ...`` command line."""
    t = (text or "").strip()
    if t.startswith("$ "):
        t = t[2:].lstrip()
    return t == "ssh" or t.startswith(("ssh ", "ssh\t"))


def _port_value(value: str, where: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise ConfigError(f"{where} {value!r} is not a port number", "write the port as a number, e.g. -p 41022")
    if not 0 < port < 65536:
        raise ConfigError(f"port {port} is out of range", "use a port between 1 and 65535")
    return port


def parse_ssh_command(text: str) -> SshCommand:
    """Read a pasted ssh(1) command line the way OpenSSH's ``ssh`` reads its arguments.

    Understood: ``-p PORT``, ``-i FILE`` (repeatable), ``-l USER``, ``-J HOPS``,
    ``-o Key=Value`` and ``-o "Key Value"`` for :data:`HONOURED_KEYWORDS`, ``user@host``
    and ``ssh://[user@]host[:port]``; options may come before or after the destination and
    may be glued to their letter (``-p41022``) or grouped (``-tt``).  As in OpenSSH, the
    first value given for a setting wins (``ssh.c``, ``readconf.c``).  Other options are
    listed in ``ignored`` with the reason, never applied silently.  A leading ``$ `` prompt is
    accepted.

    Raises
    ------
    ConfigError
        Not an ssh command, no destination, a remote command after the destination, a
        missing option value, or a bad port -- each with a hint.
    """
    import shlex

    raw = (text or "").strip()
    if raw.startswith("$ "):
        raw = raw[2:].lstrip()
    try:
        argv = shlex.split(raw)
    except ValueError as e:
        raise ConfigError(f"cannot split the ssh command: {e}", "check the quotes in the pasted line")
    if not argv or argv[0] != "ssh":
        raise ConfigError(f"{text!r} is not an ssh command line",
                          "paste the whole line the platform shows, e.g. ssh -p 41022 root@203.0.113.10")
    first: dict[str, str] = {}
    keys: list[str] = []
    ignored: list[str] = []

    def setting(keyword: str, value: str) -> None:
        if keyword == "IdentityFile":
            keys.append(value)
        else:
            first.setdefault(keyword, value)  # OpenSSH: the first obtained value wins

    def dash_o(arg: str) -> None:
        key, sep, value = arg.partition("=")
        if not sep:
            key, _, value = arg.strip().partition(" ")
        key, value = key.strip(), value.strip().strip('"')
        if not key or not value:
            raise ConfigError(f"-o {arg!r} has no value",
                              f"write it as -o {key or 'Keyword'}=VALUE (e.g. -o Port=41022)")
        canon = HONOURED_KEYWORDS.get(key.lower())
        if canon is None:
            why = _IGNORED_WHY.get(key.lower(), "gpumagic does not use this option")
            ignored.append(f"-o {key}={value} ({why})")
        else:
            setting(canon, value)

    def destination(arg: str) -> None:
        user, host, port = _destination(arg)
        first["Host"] = host
        if user:
            setting("User", user)  # ssh.c: user@ applies unless -l / -o User came first
        if port:
            setting("Port", port)

    i, n = 1, len(argv)
    while i < n:
        arg = argv[i]
        i += 1
        if arg == "--":  # end of options: the destination follows
            if "Host" in first or i >= n:
                break
            destination(argv[i])
            i += 1
            break
        if not (arg.startswith("-") and len(arg) > 1):
            if "Host" in first:  # a second word after the destination: a remote command
                i -= 1
                break
            destination(arg)
            continue
        j = 1
        while j < len(arg):
            letter = arg[j]
            j += 1
            if letter in _SSH_FLAGS:
                if letter == "N":
                    ignored.append(f"-N ({_IGNORED_WHY['-N']})")
                continue
            if letter not in _SSH_OPTS_WITH_ARG:
                raise ConfigError(f"ssh has no option -{letter}",
                                  "paste the ssh command exactly as the platform shows it")
            value = arg[j:]
            if not value:
                if i >= n:
                    raise ConfigError(f"ssh option -{letter} needs a value",
                                      f"complete it (-{letter} VALUE) or paste the whole line")
                value = argv[i]
                i += 1
            if letter == "p":
                setting("Port", value)
            elif letter == "i":
                setting("IdentityFile", value)
            elif letter == "l":
                setting("User", value)
            elif letter == "J":
                if "ProxyJump" in first:
                    raise ConfigError("only one -J is allowed (as in OpenSSH)",
                                      "list the hops in one -J, comma-separated: -J a,b")
                setting("ProxyJump", value)
            elif letter == "o":
                dash_o(value)
            else:
                why = _IGNORED_WHY.get(f"-{letter}", "gpumagic does not use this option")
                ignored.append(f"-{letter} {value} ({why})")
            break
    if "Host" not in first:
        raise ConfigError("the ssh command names no machine",
                          "paste the whole line, e.g. ssh -p 41022 root@203.0.113.10")
    if i < n:
        raise ConfigError(f"the ssh command runs a remote command ({' '.join(argv[i:])!r}) "
                          "after the destination",
                          "paste only the login part: ssh [options] user@host")
    port_text = first.get("Port")
    port = _port_value(port_text, "port") if port_text else None
    options = {k: v for k, v in first.items() if k not in ("Port", "User", "ProxyJump")}
    return SshCommand(host=first["Host"], port=port, user=first.get("User"),
                      key=keys[0] if keys else None, keys=tuple(keys), jump=first.get("ProxyJump"),
                      options={k: v for k, v in options.items() if k != "Host"},
                      ignored=tuple(ignored))


def _destination(dest: str) -> tuple[str | None, str, str | None]:
    """Split ``[user@]host`` or ``ssh://[user@]host[:port]`` into (user, host, port text)."""
    if dest.startswith("ssh://"):
        m = _TARGET_RE.match(dest[len("ssh://"):].rstrip("/"))
        if not m:
            raise ConfigError(f"cannot read {dest!r} as an ssh:// address", "write it as ssh://user@host:port")
        return m.group("user"), m.group("v6") or m.group("host"), m.group("port")
    user, at, host = dest.rpartition("@")  # OpenSSH splits at the last '@'
    if at and not user:
        raise ConfigError(f"{dest!r} has an empty user name before '@'", "write it as user@host")
    if not host or any(c.isspace() for c in host) or host.startswith("-"):
        raise ConfigError(f"cannot read {dest!r} as a machine", "write it as user@host")
    return (user or None), host, None


def resolve_ssh_command(text: str, *, home=None, **overrides) -> tuple[HostSpec, list[str]]:
    """Resolve a pasted ``ssh ...`` line into a :class:`HostSpec` plus notes for the user.

    ``overrides`` (``port``, ``user``, ``key``, ``jump``) win over the pasted values.  The
    honoured ``-o`` keywords (``ServerAliveInterval``, ``ConnectTimeout``, ``IdentitiesOnly``,
    ``UserKnownHostsFile``, ``HostName``) are applied; the rest are listed in the notes.
    """
    cmd = parse_ssh_command(text)
    target = f"[{cmd.host}]" if ":" in cmd.host else cmd.host  # an IPv6 address
    spec = resolve(target, home=home, port=overrides.get("port") or cmd.port,
                   user=overrides.get("user") or cmd.user,
                   identity_file=overrides.get("key") or cmd.key,
                   proxy_jump=overrides.get("jump") or cmd.jump)
    o = cmd.options
    changes = {}
    if "HostName" in o:
        changes["hostname"] = o["HostName"]
    if len(cmd.keys) > 1 and not overrides.get("key"):
        changes["identity_files"] = tuple(os.path.expanduser(k) for k in cmd.keys) + spec.identity_files[1:]
    if "IdentitiesOnly" in o:
        changes["identities_only"] = o["IdentitiesOnly"].lower() in ("yes", "true")
    for kw, attr, conv in (("ServerAliveInterval", "server_alive_interval", float),
                           ("ServerAliveCountMax", "server_alive_count_max", int),
                           ("ConnectTimeout", "connect_timeout", float)):
        if kw in o:
            try:
                changes[attr] = conv(o[kw])
            except ValueError:
                raise ConfigError(f"-o {kw}={o[kw]} is not a number", f"write -o {kw}=NUMBER")
    if "UserKnownHostsFile" in o:
        changes["known_hosts"] = os.path.expanduser(o["UserKnownHostsFile"].split()[0])
    notes = [f"ignored {item}" for item in cmd.ignored]
    return spec.with_options(**changes), notes
