"""Host resolution: targets, ``~/.ssh/config`` and pasted ``ssh ...`` lines, as OpenSSH reads them.

Nothing here opens a socket (``Match exec`` runs its command, as ssh does).  ``resolve`` turns
what a user typed (``mygpu``, ``root@203.0.113.10:41022``) into a :class:`HostSpec` with
the values ``ssh -G`` prints for it: the config is read by :mod:`gpumagic.ssh.config`, a port
of OpenSSH's ``readconf.c``; the first value found for a keyword wins, and command-line
options beat the config file.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, ClassVar

from .. import localpath
from ..errors import ConfigError
from .config import (WHITESPACE, ExpandError, Local, Options, SshConfig, a2port, apply_cmdline_option, argv_split, parse_forward, parse_jump, parse_ssh_uri, resolve_options, ssh_valid_ruser, strdelim, strtonum, tilde_expand)

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
    """Parse ``[user@]host[:port]`` (``[v6addr]:port`` for IPv6) or ``ssh://[user@]host[:port]``.

    Raises
    ------
    ConfigError
        When the text is empty or not of that form.
    """
    text = (text or "").strip()
    if text.lower().startswith("ssh://"):
        r, user, host, uri_port = parse_ssh_uri(text, allow_v6=True)
        if r != 0 or not host:
            raise ConfigError(f"cannot read {text!r} as an ssh:// address", "write it as ssh://user@host:port")
        return Target(host=host, user=user, port=uri_port if uri_port > 0 else None)
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
        ``HostName`` (defaults to the alias) as ``ssh -G`` prints it: ``%h`` expanded,
        lower-cased (``GPU-Box.Example`` -> ``gpu-box.example``), a numeric address in its
        canonical form (``2001:DB8::1`` -> ``2001:db8::1``).  The name ssh looks up in
        known_hosts.
    port : int
        ``Port`` (default 22).
    user : str
        ``User`` (default: the local user name).
    identity_files : tuple of str
        ``IdentityFile`` entries in ssh's order (command line first), ``~``, ``%`` tokens and
        ``${VAR}`` expanded, ``none`` and repeats left out.
    identities_only : bool
        ``IdentitiesOnly``: offer only ``identity_files`` (no agent, no default keys).
    server_alive_interval : float
        ``ServerAliveInterval`` in seconds (0 = off; gpumagic's default is 30, ssh's is 0).
    server_alive_count_max : int
        ``ServerAliveCountMax``: unanswered keepalives before the peer is declared dead.
    connect_timeout : float
        ``ConnectTimeout`` in seconds.  gpumagic's default is 15; ``ConnectTimeout 0`` (ssh:
        no limit of its own) also gives 15, so a cell never waits for ever.
    proxy_jump : tuple of str
        ``ProxyJump`` hops in the order written (empty for none).
    known_hosts : str
        The first ``UserKnownHostsFile`` (expanded), checked and updated; ``os.devnull`` for
        ``UserKnownHostsFile none``.
    from_config : bool
        Whether some ``Host``/``Match`` block of the config applied.
    compression : bool or None
        ``Compression yes``/``no`` of the config; None when not set (``%gpu sync`` then
        decides by itself, see :mod:`gpumagic.sync.engine`).
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
    compression: bool | None = None

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


def load_ssh_config(path: str | os.PathLike | None = None,
                    home: str | os.PathLike | None = None) -> SshConfig:
    """The ssh client configuration, read the way OpenSSH's ``ssh`` reads it.

    Without ``path``: ``~/.ssh/config`` (it must not be writable by others, as ssh demands),
    then ``/etc/ssh/ssh_config``.  With ``path``: that file alone, like ``ssh -F PATH``.
    Files are read when a host is resolved (:func:`resolve`), so ``Host``, ``Match`` and
    ``Include`` apply per host exactly as in ssh (see :mod:`gpumagic.ssh.config`).

    Raises
    ------
    ConfigError
        When ``path`` does not exist or a file cannot be read.
    """
    return SshConfig(path, home=home)


def config_aliases(config: SshConfig) -> list[str]:
    """The concrete ``Host`` aliases of a config (patterns with ``*``/``?``/``!`` left out), sorted.

    Aliases from ``Include``'d files count where ssh would apply them (a file included inside
    ``Host a`` contributes only names that ``a``'s patterns match).
    """
    return config.aliases()


def split_jump(value: str | None) -> tuple[str, ...]:
    """Split a ``ProxyJump`` value into hops; ``none`` means no jump."""
    if not value or value.strip().lower() == "none":
        return ()
    return tuple(h.strip() for h in value.split(",") if h.strip())


def _port_number(value, what: str) -> int:
    """A port from gpumagic's own options (``-p/--port``, ``:PORT``): 1-65535."""
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} {value!r} is not a port number",
                          f"give {what} a number between 1 and 65535, e.g. 41022") from None
    if not 0 < port < 65536:
        raise ConfigError(f"{what} {port} is out of range", f"give {what} a number between 1 and 65535")
    return port


def _command_line(*, home: str, port=None, user=None, identity_file=None, proxy_jump=None) -> Options:
    """ssh's options after its command line: gpumagic's own ``--port/--user/--key/--jump``."""
    o = Options()
    if user:
        o.user, o.user_on_commandline = user, True
    if port is not None:
        o.port = _port_number(port, "-p/--port")
    if identity_file:
        try:
            o.add_identity_file(tilde_expand(identity_file, home))  # ssh -i expands ~ at once
        except ExpandError as e:
            raise ConfigError(f"-i/--key: {e}", "give the key file's path") from None
    if proxy_jump is not None and not parse_jump(proxy_jump, o, strict=True, active=True):
        raise ConfigError(f"-J/--jump {proxy_jump!r} is not a list of [user@]host[:port] hops",
                          "write it like ssh -J: user@bastion:22,second-hop")
    return o


def resolve(text: str, *, config: SshConfig | None = None,
            home: str | os.PathLike | None = None, port: int | None = None,
            user: str | None = None, identity_file: str | None = None,
            proxy_jump: str | None = None) -> HostSpec:
    """Resolve what the user typed into a :class:`HostSpec`, as ``ssh -G`` would.

    Parameters
    ----------
    text : str
        A ``~/.ssh/config`` alias or ``[user@]host[:port]``.
    config : SshConfig, optional
        Defaults to ``load_ssh_config(home=home)``.
    port, user, identity_file, proxy_jump : optional
        Command-line values; they win over the target text and the config
        (``-p``, ``-l``/``user@``, ``-i``, ``-J``; ``proxy_jump="none"`` removes a ProxyJump).

    Raises
    ------
    ConfigError
        For a malformed target, an out-of-range port, or anything ssh refuses in the config
        (the message names the file and line), or a host that needs ``ProxyCommand``.
    """
    target = parse_target(text)
    if config is None:
        config = load_ssh_config(home=home)
    home_dir = os.fspath(home) if home else config.home
    o = _command_line(home=home_dir, port=port, user=user, identity_file=identity_file,
                      proxy_jump=proxy_jump)
    if target.user is not None and o.user is None:  # ssh.c: user@ applies unless -l came first
        o.user, o.user_on_commandline = target.user, True
    if target.port is not None and o.port == -1:
        o.port = target.port
    return _spec(target.host, config, o, Local.current(home_dir))


def _spec(host: str, config: SshConfig | None, options: Options, local: Local) -> HostSpec:
    r = resolve_options(host, config, options, local=local)
    if r.proxy_command is not None:
        raise ConfigError(f"{host} is reached through ProxyCommand {r.proxy_command!r}, which gpumagic "
                          "cannot run", "use ProxyJump (ssh -J) for a jump host, or a Host block "
                          "without ProxyCommand")
    keys = [r.expand(p) for p in r.identity_files if p.lower() != "none"]
    return HostSpec(
        alias=host,
        hostname=r.hostname,
        port=r.port,
        user=r.user,
        identity_files=tuple(dict.fromkeys(keys)),
        identities_only=r.identities_only,
        server_alive_interval=float(30 if r.server_alive_interval is None else r.server_alive_interval),
        server_alive_count_max=3 if r.server_alive_count_max is None else r.server_alive_count_max,
        connect_timeout=float(r.connect_timeout) if r.connect_timeout else 15.0,
        proxy_jump=tuple(r.jump_hops),
        known_hosts=r.user_known_hosts_files[0] if r.user_known_hosts_files else os.devnull,
        from_config=r.matched,
        compression=r.compression,
    )


def default_identity_files(home: str | os.PathLike | None = None) -> list[str]:
    """OpenSSH's default key files that exist (``~/.ssh/id_ed25519``, ``id_ecdsa``, ``id_rsa``)."""
    base = ssh_dir(home)
    return [str(base / n) for n in DEFAULT_KEY_NAMES if (base / n).exists()]


# -- a pasted ``ssh ...`` command line ---------------------------------------------------

#: ssh(1) options that take an argument (OpenSSH 9.2 ``getopt`` string, ``ssh.c``).
_SSH_OPTS_WITH_ARG = frozenset("BbcDEeFIiJLlmOopQRSWw")
#: ssh(1) options without an argument.
_SSH_FLAGS = frozenset("246AaCfGgKkMNnPqsTtVvXxYy")

#: ``-o`` keywords gpumagic honours, lower case -> canonical ssh_config spelling.
HONOURED_KEYWORDS = {k.lower(): k for k in (
    "HostName", "Port", "User", "IdentityFile", "ProxyJump", "IdentitiesOnly",
    "ServerAliveInterval", "ServerAliveCountMax", "ConnectTimeout", "UserKnownHostsFile",
)}

#: ``-o`` keywords that only take part in finding the host: applied, not listed as ignored.
_RESOLUTION_KEYWORDS = {"hostkeyalias", "canonicalizehostname", "canonicaldomains", "canonicalizemaxdots",
                        "canonicalizefallbacklocal", "canonicalizepermittedcnames", "ignoreunknown",
                        "addressfamily", "proxycommand"}

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
    config : str or None
        ``-F FILE`` (the last one, as in ssh): read instead of ``~/.ssh/config``.
    actions : tuple of (str, object)
        The options that set something, in the order ssh applies them (``("o", "Port=22")``,
        ``("p", "22")``, ``("l", ...)``, ``("i", ...)``, ``("J", ...)``, ``("4", "")``,
        ``("dest", (user, port))``); :func:`resolve_ssh_command` replays them.
    """

    host: str
    port: int | None = None
    user: str | None = None
    key: str | None = None
    keys: tuple[str, ...] = ()
    jump: str | None = None
    options: dict = field(default_factory=dict)
    ignored: tuple[str, ...] = ()
    config: str | None = None
    actions: tuple = ()


def is_ssh_command(text: str) -> bool:
    """True when ``text`` looks like a pasted ``ssh ...`` command line."""
    t = (text or "").strip()
    if t.startswith("$ "):
        t = t[2:].lstrip()
    return t == "ssh" or t.startswith(("ssh ", "ssh\t"))


def _ssh_port(value: str, where: str) -> int:
    """``a2port`` as ``ssh -p`` applies it: a number 1-65535 or a service name (``ssh``)."""
    port = a2port(value)
    if port > 0:
        return port
    number, err = strtonum(value, -(2**63), 2**63 - 1)
    if err is None:
        raise ConfigError(f"{where} {number} is out of range", "use a port between 1 and 65535")
    raise ConfigError(f"{where} {value!r} is not a port number", "write the port as a number, e.g. -p 41022")


def _split_o(arg: str) -> tuple[str, str, list[str]]:
    """An ``-o`` argument as readconf splits it: (keyword as written, raw value, words)."""
    key, rest = strdelim(arg)
    if key == "":
        key, rest = strdelim(rest)
    rest = (rest or "").lstrip(WHITESPACE)
    return key or "", rest, argv_split(rest) or []


def parse_ssh_command(text: str) -> SshCommand:
    """Read a pasted ssh(1) command line the way OpenSSH's ``ssh`` reads its arguments.

    Understood: ``-p PORT``, ``-i FILE`` (repeatable), ``-l USER``, ``-J HOPS``, ``-F FILE``,
    ``-o Key=Value`` and ``-o "Key Value"`` (every ssh_config keyword, checked as ssh checks
    it; :data:`HONOURED_KEYWORDS` are used), ``user@host`` and ``ssh://[user@]host[:port]``;
    options may come before or after the destination and may be glued to their letter
    (``-p41022``) or grouped (``-tt``), ``--`` ends them.  As in OpenSSH, the first value
    given for a setting wins (``ssh.c``, ``readconf.c``).  Other options are listed in
    ``ignored`` with the reason, never applied silently.  A leading ``$ `` prompt is accepted.

    Raises
    ------
    ConfigError
        Not an ssh command, no destination, a remote command after the destination, a
        missing option value, a bad port, an ``-o`` that ssh refuses -- each with a hint.
    """
    line = _CommandLine(_ssh_argv(text))
    line.read()
    cmd = line.command()
    home = os.path.expanduser("~")
    local = Local.current(home)
    o = Options()
    _replay(cmd, o, home=home, local=local)  # everything ssh checks before reading a config
    port_text = line.first.get("Port")
    cmd = replace(cmd, port=_ssh_port(port_text, "port") if port_text else None)
    if o.user is not None and o.user_on_commandline and not ssh_valid_ruser(o.user):
        raise ConfigError(f"user name {o.user!r} contains characters ssh refuses",
                          "give the user name without quotes, ;, &, |, <, > or a leading -")
    return cmd


def _ssh_argv(text: str) -> list[str]:
    """The words of a pasted ``ssh ...`` line (``localpath.split_command_line``; ``$ `` dropped).

    Raises
    ------
    ConfigError
        Unbalanced quotes, or a line that does not start with ``ssh``.
    """
    raw = (text or "").strip()
    if raw.startswith("$ "):
        raw = raw[2:].lstrip()
    try:
        argv = localpath.split_command_line(raw)  # Windows: -i C:\Users\me\.ssh\id stays whole
    except ValueError as e:
        raise ConfigError(f"cannot split the ssh command: {e}", "check the quotes in the pasted line")
    if not argv or argv[0] != "ssh":
        raise ConfigError(f"{text!r} is not an ssh command line",
                          "paste the whole line the platform shows, e.g. ssh -p 41022 root@203.0.113.10")
    return argv


#: ssh(1) options that set a login setting -> the ssh_config keyword they set.
_SETTING_OPTIONS = {"p": "Port", "i": "IdentityFile", "l": "User"}


class _CommandLine:
    """An ssh(1) argument list read as ``ssh.c``'s ``main`` reads it, one step per method.

    ``first`` holds the first value given for each setting (``IdentityFile`` goes to
    ``keys``, every one), ``actions`` the options that set something in the order ssh
    applies them, ``ignored`` what gpumagic sets aside with the reason; ``i`` is the next word.
    """

    def __init__(self, argv: list[str]):
        self.argv, self.i, self.terminated = argv, 1, False
        self.first: dict[str, str | tuple[str, ...]] = {}
        self.keys: list[str] = []
        self.ignored: list[str] = []
        self.actions: list[tuple[str, object]] = []
        self.config: str | None = None
        self.host: str | None = None

    def read(self) -> None:
        """Options, the destination, then options after it (``ssh.c`` runs getopt again),
        until ``--`` or the first word of a remote command."""
        n = len(self.argv)
        while True:
            self.read_options()
            if self.host is None and self.i < n:
                self.host = self.destination(self.argv[self.i])
                self.i += 1
                if self.i < n and not self.terminated:
                    continue  # ssh.c: options may follow the destination
            break

    def read_options(self) -> None:
        """One getopt(3) run: option words up to ``--`` (taken) or the first other word."""
        argv = self.argv
        while self.i < len(argv):
            arg = argv[self.i]
            if arg == "--":
                self.i, self.terminated = self.i + 1, True
                return
            if not arg.startswith("-") or arg == "-":
                return
            self.i += 1
            self.option_word(arg)

    def option_word(self, arg: str) -> None:
        """One ``-xyz`` word: grouped flags (``-tt``), then at most one option that takes a
        value, glued (``-p41022``) or in the next word; :attr:`OPTIONS` handles it.

        Raises
        ------
        ConfigError
            ``-1``, a letter ssh has no option for, or a value missing at the end.
        """
        j = 1
        while j < len(arg):
            letter = arg[j]
            j += 1
            if letter in _SSH_FLAGS:
                self.flag(letter)
                continue
            if letter == "1":
                raise ConfigError("ssh -1 (SSH protocol 1) is no longer supported", "remove -1")
            handler = self.OPTIONS.get(letter)
            if handler is None:
                raise ConfigError(f"ssh has no option -{letter}",
                                  "paste the ssh command exactly as the platform shows it")
            handler(self, letter, arg[j:] or self.next_value(letter))
            return

    def next_value(self, letter: str) -> str:
        """The word after ``-LETTER``, its value (getopt's ``optarg``)."""
        if self.i >= len(self.argv):
            raise ConfigError(f"ssh option -{letter} needs a value",
                              f"complete it (-{letter} VALUE) or paste the whole line")
        self.i += 1
        return self.argv[self.i - 1]

    def setting(self, keyword: str, value: str) -> None:
        """Keep ``value`` for the ssh_config ``keyword`` unless one came first (every
        ``IdentityFile`` is kept)."""
        if keyword == "IdentityFile":
            self.keys.append(value)
        else:
            self.first.setdefault(keyword, value)  # OpenSSH: the first obtained value wins

    # -- one handler per option (see OPTIONS) --

    def flag(self, letter: str) -> None:
        """An option without a value: ``-4`` / ``-6`` (``AddressFamily``) are replayed, ``-N``
        is set aside, the rest do not change where ssh connects."""
        if letter == "N":
            self.ignored.append(f"-N ({_IGNORED_WHY['-N']})")
        elif letter in "46":
            self.actions.append((letter, ""))

    def option_setting(self, letter: str, value: str) -> None:
        """``-p PORT``, ``-i FILE``, ``-l USER``: ``Port``, ``IdentityFile``, ``User``."""
        self.actions.append((letter, value))
        self.setting(_SETTING_OPTIONS[letter], value)

    def option_jump(self, letter: str, value: str) -> None:
        """``-J HOPS`` (``ProxyJump``), allowed once, as in ssh.c."""
        if any(a == "J" for a, _ in self.actions):
            raise ConfigError("only one -J is allowed (as in OpenSSH)",
                              "list the hops in one -J, comma-separated: -J a,b")
        self.actions.append(("J", value))
        self.setting("ProxyJump", value)

    def option_o(self, letter: str, arg: str) -> None:
        """``-o Keyword=Value`` / ``-o "Keyword Value"``: replayed through readconf; a
        :data:`HONOURED_KEYWORDS` one is kept as written, others are listed as ignored unless
        they take part in finding the host."""
        key, rest, words = _split_o(arg)
        if not key or not rest:
            raise ConfigError(f"-o {arg!r} has no value",
                              f"write it as -o {key or 'Keyword'}=VALUE (e.g. -o Port=41022)")
        self.actions.append(("o", arg))
        canon = HONOURED_KEYWORDS.get(key.lower())
        shown = " ".join(words) if words else rest
        if canon == "ProxyJump":
            self.setting(canon, rest.lstrip(WHITESPACE + "="))
        elif canon == "UserKnownHostsFile" and len(words) > 1:
            self.first.setdefault(canon, tuple(words))  # several files; add-host writes each as one word
        elif canon is not None:
            self.setting(canon, words[0] if words else rest)
        elif key.lower() not in _RESOLUTION_KEYWORDS:
            why = _IGNORED_WHY.get(key.lower(), "gpumagic does not use this option")
            self.ignored.append(f"-o {key}={shown} ({why})")

    def option_config(self, letter: str, value: str) -> None:
        """``-F FILE``: the config to read instead of ``~/.ssh/config`` (the last one wins)."""
        self.config = value

    def option_set_aside(self, letter: str, value: str) -> None:
        """Any other option with a value: listed as ignored with the reason; ``-L`` / ``-R`` /
        ``-D`` must still be forwarding specifications ssh accepts (``parse_forward``)."""
        if letter in "LRD" and not parse_forward(value, letter == "D", letter == "R"):
            raise ConfigError(f"-{letter} {value} is not a forwarding specification ssh accepts",
                              f"write it as -{letter} 8888:localhost:8888, or leave it out")
        why = _IGNORED_WHY.get(f"-{letter}", "gpumagic does not use this option")
        self.ignored.append(f"-{letter} {value} ({why})")

    #: ssh(1) option letter that takes a value -> its handler
    OPTIONS: ClassVar[dict[str, Callable[[_CommandLine, str, str], None]]] = {
        **dict.fromkeys(_SSH_OPTS_WITH_ARG, option_set_aside),
        **dict.fromkeys(_SETTING_OPTIONS, option_setting),
        "J": option_jump,
        "o": option_o,
        "F": option_config,
    }

    # -- the destination, and the result --

    def destination(self, arg: str) -> str:
        """``[user@]host`` (split at the last ``@``) or ``ssh://[user@]host[:port]``: its user
        and port apply unless ``-l`` / ``-p`` / ``-o`` came first.  Returns the host."""
        # gpumagic also reads ssh://user@[2001:db8::1]:22, which OpenSSH 9.2 refuses
        r, user, h, port = parse_ssh_uri(arg, allow_v6=True)
        if r == -1:
            raise ConfigError(f"cannot read {arg!r} as an ssh:// address", "write it as ssh://user@host:port")
        if r == 1:
            user, at, h = arg.rpartition("@")  # OpenSSH splits at the last '@'
            if at and not user:
                raise ConfigError(f"{arg!r} has an empty user name before '@'", "write it as user@host")
            user, port = (user if at else None), -1
        if not h:
            raise ConfigError(f"cannot read {arg!r} as a machine", "write it as user@host")
        self.actions.append(("dest", (user, port)))
        if user:
            self.setting("User", user)  # ssh.c: user@ applies unless -l / -o User came first
        if port > 0:
            self.setting("Port", str(port))
        return h

    def command(self) -> SshCommand:
        """The :class:`SshCommand` read.

        Raises
        ------
        ConfigError
            No destination, or words after it (a remote command).
        """
        argv, i = self.argv, self.i
        if self.host is None:
            raise ConfigError("the ssh command names no machine",
                              "paste the whole line, e.g. ssh -p 41022 root@203.0.113.10")
        if i < len(argv):
            raise ConfigError(f"the ssh command runs a remote command ({' '.join(argv[i:])!r}) "
                              "after the destination",
                              "paste only the login part: ssh [options] user@host")
        first, keys = self.first, self.keys
        options = {k: v for k, v in first.items() if k not in ("Port", "User", "ProxyJump")}
        return SshCommand(host=self.host, user=first.get("User"),
                          key=keys[0] if keys else None, keys=tuple(keys), jump=first.get("ProxyJump"),
                          options=options, ignored=tuple(self.ignored), config=self.config,
                          actions=tuple(self.actions))


def _replay(cmd: SshCommand, o: Options, *, home: str, local: Local, skip_keys: bool = False,
            skip_jump: bool = False) -> None:
    """Apply a parsed command line to ``o`` in ssh's order (``ssh.c`` main's option loop)."""
    import socket

    host = ""
    for letter, value in cmd.actions:
        if letter == "o":
            apply_cmdline_option(o, value, local, host=host)
        elif letter == "p":
            if o.port == -1:
                o.port = _ssh_port(value, "-p")
        elif letter == "l":
            if o.user is None:
                o.user, o.user_on_commandline = value, True
        elif letter == "i":
            if not skip_keys:
                try:
                    o.add_identity_file(tilde_expand(value, home))
                except ExpandError as e:
                    raise ConfigError(f"-i: {e}", "give the key file's path") from None
        elif letter == "J":
            if skip_jump:
                continue
            if o.jump_host is not None:
                raise ConfigError("only one -J is allowed (as in OpenSSH)",
                                  "list the hops in one -J, comma-separated: -J a,b")
            if o.proxy_command is not None:
                raise ConfigError("-J cannot be combined with -o ProxyCommand", "keep one of them")
            if not parse_jump(value, o, strict=True, active=True):
                raise ConfigError(f"-J {value!r} is not a list of [user@]host[:port] hops",
                                  "write it like -J user@bastion:22,second-hop")
        elif letter in "46":
            o.address_family = socket.AF_INET if letter == "4" else socket.AF_INET6
        elif letter == "dest":
            user, port = value
            if user is not None and o.user is None:
                o.user, o.user_on_commandline = user, True
            if port > 0 and o.port == -1:
                o.port = port
            host = cmd.host


def ssh_command_options(text: str, *, home=None, **overrides) -> tuple[SshCommand, Options, SshConfig | None, Local]:
    """A pasted ``ssh ...`` line as ssh holds it before reading its config.

    Returns the parsed command, the options its command line set (``overrides`` first, see
    :func:`resolve_ssh_command`), the config ssh would read (``-F FILE``, ``-F none`` ->
    None, else ``~/.ssh/config``) and the local side; :func:`gpumagic.ssh.config.resolve_options`
    of those is what ``ssh -G`` prints for the line.

    Raises
    ------
    ConfigError
        As :func:`parse_ssh_command`.
    """
    cmd = parse_ssh_command(text)
    home_dir = os.fspath(home) if home else os.path.expanduser("~")
    local = Local.current(home_dir)
    key, jump = overrides.get("key") or None, overrides.get("jump") or None
    o = _command_line(home=home_dir, port=overrides.get("port") or None, user=overrides.get("user") or None,
                      identity_file=key, proxy_jump=jump)
    _replay(cmd, o, home=home_dir, local=local, skip_keys=key is not None, skip_jump=jump is not None)
    if cmd.config is None:
        config = load_ssh_config(home=home_dir)
    elif cmd.config.lower() == "none":
        config = None
    else:
        config = SshConfig(tilde_expand(cmd.config, home_dir), home=home_dir)
    return cmd, o, config, local


def resolve_ssh_command(text: str, *, home=None, **overrides) -> tuple[HostSpec, list[str]]:
    """Resolve a pasted ``ssh ...`` line into a :class:`HostSpec` plus notes for the user.

    The line's options are applied as ssh applies them, then the config (``-F FILE`` or
    ``~/.ssh/config``) is read for its destination: the result is what ``ssh -G`` prints
    for the same line.  ``overrides`` (``port``, ``user``, ``key``, ``jump``: gpumagic's own
    options) win over the pasted values; a ``key`` or ``jump`` override replaces the pasted
    ``-i`` / ``-J``.  Options gpumagic does not use are listed in the notes.

    Raises
    ------
    ConfigError
        As :func:`parse_ssh_command` and :func:`resolve`.
    """
    cmd, o, config, local = ssh_command_options(text, home=home, **overrides)
    spec = _spec(cmd.host, config, o, local)
    notes = [f"ignored {item}" for item in cmd.ignored]
    return spec, notes
