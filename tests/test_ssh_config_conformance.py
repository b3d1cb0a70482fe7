"""Differential test: gpumagic's ssh_config reader against OpenSSH's own ``ssh -G``.

Every case of ``CONFIGS`` is a config (plus the files it includes) and a host; the case is
resolved by gpumagic (:func:`gpumagic.ssh.config.resolve_options` and
:func:`gpumagic.ssh.hosts.resolve`) and by ``ssh -G -F FILE HOST``, and the values gpumagic uses
must agree: HostName, User, Port, IdentityFile, ProxyJump, ServerAliveInterval/CountMax,
ConnectTimeout, UserKnownHostsFile, IdentitiesOnly.  When ``ssh -G`` refuses the config,
gpumagic must raise ConfigError.  ``COMMAND_LINES`` does the same for pasted ``ssh ...``
lines (:func:`gpumagic.ssh.hosts.resolve_ssh_command` against ``ssh -G`` with the same options).

To add a reported case: append a ``Case`` below; nothing else changes.  A case whose id ends
in ``-refused`` is one that ``ssh -G`` refuses (checked).  In a case's texts
``{D}`` is the case's own directory, ``{HOME}`` the HOME the test gives ssh, ``{USER}`` the
local user name.

How the two are made comparable:

* ``ssh -G`` expands ``~`` and ``%d`` from the passwd entry, gpumagic from its ``home``
  (``$HOME``).  gpumagic runs with ``home`` = ``{HOME}`` (a temp dir, so that relative
  ``Include`` -- which OpenSSH resolves under ``~/.ssh`` through glob(3) and ``$HOME`` --
  reads the same files for both), and its paths are compared after replacing ``{HOME}`` by
  the passwd home.
* ``ssh -G`` prints ``IdentityFile`` as written (expanded only when ssh loads the key), so
  the raw lists are compared, and the expanded ones against ssh's own expansion, obtained by
  handing the same strings to ssh as ``-o UserKnownHostsFile`` (ssh expands both with
  ``tilde_expand_filename`` + ``default_client_percent_dollar_expand``).
* Defaults differ on purpose: ``ssh -G`` prints ServerAliveInterval 0 and ConnectTimeout
  none when they are not set; gpumagic's HostSpec uses 30 and 15 then (a notebook must not
  wait for ever).  So unset values are compared on the raw side (None <-> ``0``/``none``) and
  HostSpec is checked against the documented mapping.
* gpumagic keeps ``-i FILE`` even when the file is missing (the connection then says so);
  ``ssh`` drops it with a warning.  The command-line corpus only uses files that exist.
"""

from __future__ import annotations

import os
import pwd
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpumagic.ssh import hosts
from gpumagic.errors import ConfigError
from gpumagic.ssh.config import Local, SshConfig, format_hop, parse_hop, resolve_options

SSH = shutil.which("ssh")


def _ssh_version() -> str:
    if not SSH:
        return ""
    return subprocess.run([SSH, "-V"], capture_output=True, text=True, encoding="utf-8").stderr


pytestmark = pytest.mark.skipif(not re.match(r"OpenSSH_9\.", _ssh_version()),
                                reason="the judge is OpenSSH 9.x's ssh -G")

USER = pwd.getpwuid(os.getuid()).pw_name
PW_HOME = pwd.getpwuid(os.getuid()).pw_dir
SSH_DEFAULT_KEYS = ["~/.ssh/id_rsa", "~/.ssh/id_ecdsa", "~/.ssh/id_ecdsa_sk", "~/.ssh/id_ed25519",
                    "~/.ssh/id_ed25519_sk", "~/.ssh/id_xmss", "~/.ssh/id_dsa"]


@dataclass
class Case:
    id: str
    host: str
    config: str
    files: dict = field(default_factory=dict)  # path relative to {D} -> text
    why: str = ""  # the report or rule the case stands for


CONFIGS = [
    # -- every keyword gpumagic reads ------------------------------------------------------
    Case("all-keywords", "gpu", """
Host gpu
  HostName 203.0.113.10
  Port 41022
  User root
  IdentityFile {D}/k1
  IdentityFile {D}/k2
  IdentitiesOnly yes
  ProxyJump jump@198.51.100.5:2222
  ServerAliveInterval 10
  ServerAliveCountMax 4
  ConnectTimeout 7
  UserKnownHostsFile {D}/kh1 {D}/kh2
"""),
    Case("nothing-set", "plain.example", "Host other\n  Port 1\n"),
    # -- comments, quoting, '=', keyword case ---------------------------------------------
    Case("issue1-comment-after-value", "gpu", """
Host gpu
  Port 2222 # forwarded
  HostName 10.0.0.5 # the box
  User root #no space before the text
""", why="issue case 1"),
    Case("comment-lines", "gpu", """
# top comment
   # indented comment
#Port 1
Host gpu # a comment on the Host line
\t# tab-indented comment

  Port 2200
"""),
    Case("hash-inside-a-word", "gpu", "Host gpu\n  HostName a#b\n  IdentityFile {D}/key#1\n"),
    Case("quoted-hash", "gpu", 'Host gpu\n  IdentityFile "{D}/k #1"\n'),
    Case("keyword-case", "gpu", "HOST gpu\n  hOsTnAmE Box.Example\n  PORT 2201\n  user Alice\n"),
    Case("equals-forms", "gpu", """
Host=gpu
  Port=2201
  User = bob
  HostName= h.example
  IdentityFile ="{D}/x y"
  ConnectTimeout =9
"""),
    Case("double-and-single-quotes", "gpu", """
Host gpu
  User "a b"
  IdentityFile '{D}/single q'
  UserKnownHostsFile "{D}/kh one" '{D}/kh two'
"""),
    Case("backslash-escapes", "gpu", 'Host gpu\n  IdentityFile {D}/a\\ b\n  User o\\\'brien\n'),
    Case("unbalanced-quote-refused", "gpu", "Host gpu\n  HostName it's\n", why="issue case 8"),
    Case("crlf-tabs-formfeed", "gpu", "Host gpu\r\n\tPort\t2203\r\n  User u \f\r\n"),
    Case("extra-words-refused", "gpu", "Host gpu\n  Port 22 23\n"),
    Case("hostname-two-words-refused", "gpu", "Host gpu\n  HostName a b\n"),
    Case("missing-value-refused", "gpu", "Host gpu\n  User\n"),
    Case("only-comment-as-value-refused", "gpu", "Host gpu\n  User #nobody\n"),
    Case("unknown-keyword-refused", "gpu", "Host other\n  Hostnme typo\n"),
    Case("ignoreunknown", "gpu", "IgnoreUnknown Foo*,bar\nHost gpu\n  FooOption 1\n  Bar 2\n  Port 2204\n"),
    Case("ignoreunknown-after-is-too-late-refused", "gpu", "Host gpu\n  FooOption 1\nIgnoreUnknown Foo*\n"),
    Case("deprecated-and-unsupported-keywords", "gpu",
         "Host gpu\n  UseRoaming no\n  RSAAuthentication yes\n  Protocol 2\n  Port 2205\n"),
    # -- times and numbers -------------------------------------------------------------------
    Case("issue2-time-units", "gpu", "Host gpu\n  ServerAliveInterval 1m\n  ConnectTimeout 30s\n",
         why="issue case 2"),
    Case("time-compound-and-upper", "gpu", "Host gpu\n  ServerAliveInterval 1h30m\n  ConnectTimeout 2M\n"),
    Case("time-zero", "gpu", "Host gpu\n  ServerAliveInterval 0\n  ConnectTimeout 0\n"),
    Case("issue9-timeout-nan-refused", "gpu", "Host gpu\n  ConnectTimeout nan\n", why="issue case 9"),
    Case("issue9-timeout-negative-refused", "gpu", "Host gpu\n  ConnectTimeout -1\n", why="issue case 9"),
    Case("issue9-alive-nan-refused", "gpu", "Host gpu\n  ServerAliveInterval nan\n", why="issue case 9"),
    Case("time-too-large-refused", "gpu", "Host gpu\n  ServerAliveInterval 99999999999\n"),
    Case("countmax-negative-refused", "gpu", "Host gpu\n  ServerAliveCountMax -1\n"),
    Case("timeout-none-is-unset", "gpu", "Host gpu\n  ConnectTimeout none\nHost *\n  ConnectTimeout 5\n"),
    Case("port-service-name", "gpu", "Host gpu\n  Port ssh\n"),
    Case("port-zero-refused", "gpu", "Host gpu\n  Port 0\n"),
    Case("port-too-large-refused", "gpu", "Host gpu\n  Port 65536\n"),
    Case("bad-line-in-unused-block-refused", "gpu", "Host gpu\n  Port 2\nHost other\n  Port nope\n"),
    Case("identitiesonly-forms", "gpu", "Host gpu\n  IdentitiesOnly TRUE\n"),
    Case("identitiesonly-bad-refused", "gpu", "Host gpu\n  IdentitiesOnly maybe\n"),
    # -- tokens and ~ ------------------------------------------------------------------------
    Case("hostname-percent-h", "gpu", "Host gpu\n  HostName %h.lan.example\n"),
    Case("hostname-percent-percent", "gpu", "Host gpu\n  HostName a%%b\n"),
    Case("hostname-bad-token-refused", "gpu", "Host gpu\n  HostName %p.example\n"),
    Case("identityfile-tokens", "gpu", """
Host gpu
  HostName Box.Example
  User rt
  Port 2222
  IdentityFile {D}/id_%h_%p_%r_%u_%%_%n_%l_%L_%i_%k
  IdentityFile {D}/c_%C
  IdentityFile %d/.ssh/id_home
"""),
    Case("tilde", "gpu", "Host gpu\n  IdentityFile ~/.ssh/k\n  UserKnownHostsFile ~/kh %d/kh2 ~\n"),
    Case("dollar-env", "gpu", "Host gpu\n  IdentityFile {D}/${GPUMAGIC_T}/k\n  UserKnownHostsFile ${GPUMAGIC_T}_kh\n"),
    Case("userknownhostsfile-tokens", "gpu", "Host gpu\n  HostName H1\n  UserKnownHostsFile {D}/kh_%h_%p_%r\n"),
    # -- first value wins ---------------------------------------------------------------------
    Case("first-value-wins", "gpu", """
Host gpu
  User first
Host *
  User second
  Port 2206
  ServerAliveInterval 5
"""),
    Case("host-star-first-wins", "gpu", "Host *\n  User star\nHost gpu\n  User mine\n  HostName h\n"),
    Case("identityfile-accumulates-and-dedups", "gpu", """
Host gpu
  IdentityFile {D}/a
Host *
  IdentityFile {D}/b
  IdentityFile {D}/a
"""),
    Case("identityfile-none", "gpu", "Host gpu\n  IdentityFile none\n"),
    Case("userknownhostsfile-first-line-wins", "gpu",
         "Host gpu\n  UserKnownHostsFile {D}/a {D}/b\nHost *\n  UserKnownHostsFile {D}/c\n"),
    Case("userknownhostsfile-none", "gpu", "Host gpu\n  UserKnownHostsFile none\n"),
    Case("userknownhostsfile-none-not-alone-refused", "gpu", "Host gpu\n  UserKnownHostsFile none {D}/x\n"),
    # -- Host patterns --------------------------------------------------------------------------
    Case("host-list", "gpu", "Host a gpu c\n  Port 2207\n"),
    Case("host-comma-is-one-pattern", "gpu", "Host x,gpu\n  Port 2208\n"),
    Case("host-negation", "gpu", "Host * !gpu\n  Port 2209\nHost *\n  Port 2210\n"),
    Case("host-negation-first", "other", "Host !gpu *\n  Port 2211\n"),
    Case("host-wildcards", "box.lab", "Host g?u *.lab\n  User labuser\n"),
    Case("host-question-mark", "gpu", "Host g?u\n  User q\n"),
    Case("issue5-alias-case-sensitive", "GPU", "Host gpu\n  Port 2212\n", why="issue case 5"),
    Case("issue5-hostname-lowercased", "gpu", "Host gpu\n  HostName GPU-Box.Example\n", why="issue case 5"),
    Case("numeric-ipv6-canonical", "gpu", "Host gpu\n  HostName 2001:DB8:0:0::1\n"),
    Case("numeric-ipv4-short-form", "gpu", "Host gpu\n  HostName 127.1\n"),
    # -- ProxyJump ------------------------------------------------------------------------------
    Case("proxyjump-chain", "gpu", "Host gpu\n  ProxyJump u@a:2222,b\n"),
    Case("proxyjump-uri", "gpu", "Host gpu\n  ProxyJump ssh://u@h.example:2200\n"),
    Case("proxyjump-ipv6", "gpu", "Host gpu\n  ProxyJump root@[2001:db8::5]:22\n"),
    Case("proxyjump-comment", "gpu", "Host gpu\n  ProxyJump bastion # via the bastion\n"),
    Case("proxyjump-none", "gpu", "Host gpu\n  ProxyJump none\nHost *\n  ProxyJump b\n"),
    Case("proxyjump-first-wins", "gpu", "Host gpu\n  ProxyJump a\nHost *\n  ProxyJump b\n"),
    Case("proxyjump-loop-refused", "gpu", "Host gpu\n  ProxyJump gpu\n"),
    Case("proxycommand-before-proxyjump", "gpu", "Host gpu\n  ProxyCommand nc %h %p\n  ProxyJump b\n"),
    Case("proxyjump-bad-refused", "gpu", "Host gpu\n  ProxyJump u@\n"),
    # -- Include --------------------------------------------------------------------------------
    Case("issue3-include-stays-in-its-block", "trainbox", """
Host trainbox
  HostName 10.1.0.2
  Include {D}/common.conf
  User researcher
""", files={"common.conf": "  Port 2213\nHost mirror\n  HostName 10.9.9.9\n  User mirroruser\n"},
         why="issue case 3"),
    Case("issue3-included-blocks-skip-when-outer-does-not-match", "mirror", """
Host trainbox
  Include {D}/common.conf
  User researcher
""", files={"common.conf": "Host mirror\n  HostName 10.9.9.9\n  User mirroruser\n"},
         why="issue case 3"),
    Case("include-nested", "gpu", "Include {D}/a.conf\nHost *\n  User last\n",
         files={"a.conf": "Include {D}/b.conf\nHost gpu\n  Port 2214\n",
                "b.conf": "Host gpu\n  User fromb\n"}),
    Case("include-glob-sorted", "gpu", "Include {D}/conf.d/*.conf\n",
         files={"conf.d/20-b.conf": "Host gpu\n  User two\n  Port 2215\n",
                "conf.d/10-a.conf": "Host gpu\n  User one\n",
                "conf.d/.hidden.conf": "Host gpu\n  Port 1\n"}),
    Case("include-relative-is-under-home-ssh", "gpu", "Include rel.conf\n",
         files={"home/.ssh/rel.conf": "Host gpu\n  Port 2216\n"}),
    Case("include-tilde", "gpu", "Include ~/.ssh/t.conf\n", files={"home/.ssh/t.conf": "Host gpu\n  User tilde\n"}),
    Case("include-missing-is-fine", "gpu", "Include {D}/nope.conf {D}/none/*\nHost gpu\n  Port 2217\n"),
    Case("include-loop-refused", "gpu", "Include {D}/config\n"),
    Case("include-match-does-not-leak", "gpu", "Host gpu\n  Include {D}/m.conf\n  Port 2218\n",
         files={"m.conf": "Match host nothing-matches\n"}),
    Case("include-bad-line-refused", "gpu", "Host other\n  Include {D}/bad.conf\n",
         files={"bad.conf": "Port nope\n"}),
    # -- Match ------------------------------------------------------------------------------------
    Case("match-all", "gpu", "Match all\n  Port 2219\n"),
    Case("match-host-uses-hostname", "gpu", "Host gpu\n  HostName 10.0.0.9\nMatch host 10.0.0.*\n  User m\n"),
    Case("match-host-alias-not-matched-after-hostname", "gpu",
         "Host gpu\n  HostName 10.0.0.9\nMatch host gpu\n  User m\n"),
    Case("match-host-list-negated", "gpu", "Match host !gpu,*\n  Port 2220\nMatch host g*,x\n  Port 2221\n"),
    Case("match-originalhost", "gpu", "Host gpu\n  HostName 10.0.0.9\nMatch originalhost GPU\n  User orig\n"),
    Case("issue4-match-user-root", "gpu", "Host gpu\n  User root\nMatch user root\n  Port 2222\n",
         why="issue case 4"),
    Case("match-user-default-is-local-user", "gpu", "Match user {USER}\n  Port 2223\n"),
    Case("match-not-user", "gpu", "Host gpu\n  User alice\nMatch !user alice\n  Port 2224\nMatch all\n  Port 2225\n"),
    Case("match-localuser", "gpu", "Match localuser {USER}\n  User fromlocal\n"),
    Case("match-not-localuser", "gpu", "Match !localuser {USER}\n  User never\n"),
    Case("match-exec-true", "gpu", "Match exec true\n  Port 2226\n"),
    Case("match-exec-false", "gpu", "Match exec false\n  Port 1\nMatch !exec false\n  Port 2227\n"),
    Case("match-exec-tokens", "gpu",
         'Host gpu\n  HostName Box.Example\nMatch exec "test %h = Box.Example -a %n = gpu -a %u = {USER}"\n'
         '  Port 2228\nMatch exec "test %h = box.example"\n  User lowered\n'),
    Case("match-exec-file-test", "gpu", "Match exec \"test -f {D}/flag\"\n  User flagged\n",
         files={"flag": ""}),
    Case("match-exec-skipped-after-failed-criterion", "gpu",
         "Match host nope exec \"touch {D}/ran\"\n  Port 1\nMatch exec \"test ! -e {D}/ran\"\n  Port 2229\n"),
    Case("match-several-criteria", "gpu", "Host gpu\n  User bob\nMatch host gpu user bob localuser {USER}\n  Port 2230\n"),
    Case("match-final", "gpu", "Match final\n  Port 2231\nHost gpu\n  User fromhost\n"),
    Case("match-final-host-is-canonical", "gpu",
         "Host gpu\n  HostName Real.Example\nMatch final host real.example\n  User real\n"),
    Case("match-canonical", "a.b", """
CanonicalizeHostname yes
CanonicalizeMaxDots 0
Match canonical
  Port 2232
Match !canonical
  User firstpass
"""),
    Case("canonicalize-fallback-refused", "gpu",
         "CanonicalizeHostname yes\nCanonicalizeFallbackLocal no\n"),
    Case("final-pass-host-block-matches-hostname", "gpu",
         "Host gpu\n  HostName real.example\nMatch final\nHost real.example\n  Port 2233\n"),
    Case("match-one-criterion-then-all", "gpu", "Match host gpu all\n  Port 2236\n"),
    Case("match-all-with-others-refused", "gpu", "Match host gpu user x all\n  Port 1\n"),
    Case("match-missing-pattern-refused", "gpu", "Match host\n"),
    Case("match-unknown-criterion-refused", "gpu", "Match localnetwork 10.0.0.0/8\n  Port 1\n"),
    Case("match-comment", "gpu", "Match all # everything\n  Port 2234\n"),
    Case("host-match-host-interplay", "gpu",
         "Host gpu\n  User a\nMatch user a\n  Port 2235\nHost gpu\n  HostName h2\n"),
    # -- the rest of the keyword table: checked as ssh checks it, even where gpumagic ignores it --
    Case("other-keywords-valid", "gpu", """
Host gpu
  LocalForward 8888 localhost:8888
  RemoteForward 8080
  DynamicForward 1080
  SendEnv LANG LC_*
  SetEnv A=1 B=2
  ControlMaster auto
  ControlPersist 10m
  ControlPath ~/.ssh/cm-%C
  EscapeChar ^A
  IPQoS af21 cs1
  RekeyLimit 1G 1h
  AddKeysToAgent confirm 5m
  ForwardAgent $SSH_AUTH_SOCK
  LogLevel DEBUG3
  StrictHostKeyChecking accept-new
  Compression yes
  TunnelDevice any:any
  StreamLocalBindMask 0177
  FingerprintHash sha256
  PermitRemoteOpen localhost:8080 [::1]:22
  IdentityAgent none
  GlobalKnownHostsFile /etc/x /etc/y
  PubkeyAuthentication host-bound
  ProtocolKeepAlives 15
  CanonicalDomains example.com
  IdentityFile2 {D}/legacy
  Port 2237
"""),
    Case("controlpersist-is-case-sensitive-refused", "gpu", "Host gpu\n  ControlPersist Yes\n"),
    Case("localforward-without-target-refused", "gpu", "Host gpu\n  LocalForward 8888\n"),
    Case("localforward-bad-refused", "gpu", "Host gpu\n  LocalForward bad:x y\n"),
    Case("setenv-without-equals-refused", "gpu", "Host gpu\n  SetEnv A\n"),
    Case("forwardagent-unset-env-refused", "gpu", "Host gpu\n  ForwardAgent ${GPUMAGIC_UNSET_VAR}\n"),
    Case("escapechar-bad-refused", "gpu", "Host gpu\n  EscapeChar abc\n"),
    Case("ipqos-bad-refused", "gpu", "Host gpu\n  IPQoS nonsense\n"),
    Case("loglevel-bad-refused", "gpu", "Host gpu\n  LogLevel LOUD\n"),
    Case("permitremoteopen-no-port-refused", "gpu", "Host gpu\n  PermitRemoteOpen localhost\n"),
    Case("rekeylimit-too-small-refused", "gpu", "Host gpu\n  RekeyLimit 8\n"),
    Case("canonicaldomains-bad-refused", "gpu", "Host gpu\n  CanonicalDomains -bad.example\n"),
    Case("permitted-cnames-on-localhost", "localhost",
         "Host localhost\n  CanonicalizePermittedCNAMEs *.a.example:*.b.example\n  Port 2238\n"),
    Case("serveralivecountmax-zero-and-timeout-0s", "gpu", "Host gpu\n  ServerAliveCountMax 0\n  ConnectTimeout 0s\n"),
    # -- odd corners of the line reader ----------------------------------------------------------
    Case("equals-twice-refused", "gpu", "Host gpu\n  Port = = 22\n"),
    Case("equals-without-value-refused", "gpu", "Host gpu\n  Port=\n"),
    Case("empty-host-pattern-refused", "gpu", 'Host ""\n'),
    Case("quoted-include-with-space", "gpu", 'Include "{D}/with space.conf" {D}/second.conf\n',
         files={"with space.conf": "Host gpu\n  User spaced\n", "second.conf": "Host gpu\n  Port 2239\n"}),
    Case("include-inside-match", "gpu", "Match user nobody-at-all\n  Include {D}/m.conf\nHost gpu\n  Port 2240\n",
         files={"m.conf": "Host gpu\n  User frommatch\n"}),
    Case("host-negated-star", "gpu", "Host !*\n  Port 1\nHost GPU\n  Port 1\nHost gpu\n  Port 2241\n"),
    Case("hostname-octal-ipv4", "gpu", "Host gpu\n  HostName 010.0.0.1\n"),
    Case("hostname-trailing-dot", "gpu", "Host gpu\n  HostName Box.Example.\n"),
    Case("match-originalhost-case", "GPU", "Match originalhost gpu\n  Port 2242\n"),
    Case("match-not-all", "gpu", "Match !all\n  Port 1\nMatch canonical all\n  Port 2\nHost *\n  Port 2243\n"),
    Case("match-case-and-equals", "gpu", "MATCH HOST=gpu\n  Port 2244\n"),
    Case("match-exec-single-quotes", "gpu", "Match exec 'true'\n  Port 2245\n"),
    Case("match-final-identityfile-not-doubled", "gpu",
         "Host gpu\n  IdentityFile {D}/k\nMatch final\n  IdentityFile {D}/k2\n"),
    Case("proxyjump-equals-and-quotes", "gpu", 'Host gpu\n  ProxyJump = "quoted"\n'),
    Case("proxyjump-comment-with-commas", "gpu", "Host gpu\n  ProxyJump a,b # c,d\n"),
    Case("proxyjump-none-with-comment", "gpu", "Host gpu\n  ProxyJump none # literally\n"),
    Case("user-percent-is-literal", "gpu", "Host gpu\n  User a%hb\n"),
]


def _fill(text: str, d: Path, home: Path) -> str:
    return text.replace("{D}", str(d)).replace("{HOME}", str(home)).replace("{USER}", USER)


def _setup(case: Case, tmp_path: Path) -> tuple[Path, Path]:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    cfg = tmp_path / "config"
    cfg.write_bytes(_fill(case.config, tmp_path, home).encode())
    for rel, text in case.files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(_fill(text, tmp_path, home).encode())
    for p in [cfg, *(tmp_path / rel for rel in case.files)]:
        p.chmod(0o600)
    return cfg, home


def _env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("SSH_AUTH_SOCK",)}
    env.update(HOME=str(home), SHELL="/bin/sh", GPUMAGIC_T="tval")
    return env


def ssh_G(args: list[str], home: Path, cwd: Path) -> tuple[int, dict, str]:
    """``ssh -G ARGS``: (exit status, keyword -> list of values, stderr)."""
    p = subprocess.run([SSH, "-G", *args], capture_output=True, text=True, env=_env(home), cwd=cwd,
                       stdin=subprocess.DEVNULL, timeout=60, encoding="utf-8")
    out: dict[str, list[str]] = {}
    for line in p.stdout.splitlines():
        key, _, value = line.partition(" ")
        out.setdefault(key, []).append(value)
    return p.returncode, out, p.stderr


def _ssh_expand(paths: list[str], args: list[str], home: Path, cwd: Path) -> list[str]:
    """How ssh itself expands each of ``paths`` (~, %tokens, ${VAR}) for ``ssh ARGS``.

    Each is handed to ssh as the first ``-o UserKnownHostsFile`` (first value wins), which
    ssh expands exactly as it expands IdentityFile when it loads a key.
    """
    out = []
    for p in paths:
        quoted = '"' + p.replace("\\", "\\\\").replace('"', '\\"') + '"'
        rc, g, err = ssh_G(["-o", f"UserKnownHostsFile {quoted}", *args], home, cwd)
        assert rc == 0, err
        out.append(g["userknownhostsfile"][0])
    return out


def _mine(path: str, home: Path) -> str:
    """gpumagic's expansion with the test HOME put back to the passwd home, as ssh -G has it."""
    return path.replace(str(home), PW_HOME.rstrip("/") or "/")


def _hops(value: str) -> tuple[str, ...]:
    return tuple(format_hop(*parse_hop(h)) for h in value.split(","))


@pytest.fixture(autouse=True)
def _same_env(monkeypatch):
    monkeypatch.setenv("SHELL", "/bin/sh")
    monkeypatch.setenv("GPUMAGIC_T", "tval")


@pytest.mark.parametrize("case", CONFIGS, ids=[c.id for c in CONFIGS])
def test_config_resolves_as_ssh_G(case, tmp_path):
    cfg, home = _setup(case, tmp_path)
    rc, g, err = ssh_G(["-F", str(cfg), case.host], home, tmp_path)
    # what Match exec did under ssh must not leak into gpumagic's run (and back)
    for p in tmp_path.glob("ran"):
        p.unlink()
    assert (rc != 0) == case.id.endswith("-refused"), f"the corpus names what ssh does: {err}"
    config = SshConfig(cfg, home=home)
    local = Local.current(home)
    if rc != 0:
        with pytest.raises(ConfigError) as e:
            resolve_options(case.host, config, local=local)
        assert "\n" not in e.value.message, e.value.message
        assert e.value.hint
        return
    r = resolve_options(case.host, config, local=local)
    assert r.hostname == g["hostname"][0]
    assert r.user == g["user"][0]
    assert r.port == int(g["port"][0])
    assert (r.identity_files or SSH_DEFAULT_KEYS) == g["identityfile"]
    assert (r.server_alive_interval or 0) == int(g["serveraliveinterval"][0])
    assert (3 if r.server_alive_count_max is None else r.server_alive_count_max) == int(g["serveralivecountmax"][0])
    assert ("none" if r.connect_timeout is None else str(r.connect_timeout)) == g["connecttimeout"][0]
    assert (" ".join(_mine(p, home) for p in r.user_known_hosts_files) or "none") == g["userknownhostsfile"][0]
    assert ("yes" if r.identities_only else "no") == g["identitiesonly"][0]
    assert r.proxy_jump == (g["proxyjump"][0] if "proxyjump" in g else None)
    assert r.proxy_command == (g["proxycommand"][0] if "proxycommand" in g else None)

    # HostSpec, what the connection uses
    if r.proxy_command is not None:  # gpumagic cannot run a ProxyCommand: it says so
        with pytest.raises(ConfigError, match="ProxyCommand"):
            hosts.resolve(case.host, config=config, home=home)
        return
    _check_spec(hosts.resolve(case.host, config=config, home=home), r, g, ["-F", str(cfg), case.host],
                home, tmp_path)


def _check_spec(spec, r, g, args, home, cwd):
    """HostSpec against ssh -G, with gpumagic's documented defaults (30 s / 15 s)."""
    assert (spec.hostname, spec.user, spec.port) == (g["hostname"][0], g["user"][0], int(g["port"][0]))
    raw = [p for p in r.identity_files if p.lower() != "none"]
    want = _ssh_expand(raw, args, home, cwd) if raw else []
    assert [_mine(p, home) for p in spec.identity_files] == list(dict.fromkeys(want))
    assert spec.server_alive_interval == (30 if r.server_alive_interval is None else r.server_alive_interval)
    assert spec.server_alive_count_max == int(g["serveralivecountmax"][0])
    timeout = g["connecttimeout"][0]
    assert spec.connect_timeout == (15 if timeout in ("none", "0") else int(timeout))
    assert spec.proxy_jump == (_hops(g["proxyjump"][0]) if "proxyjump" in g else ())
    # ssh -G joins the files with blanks; the list itself was compared with r's before
    assert spec.known_hosts == (r.user_known_hosts_files[0] if r.user_known_hosts_files else os.devnull)
    assert spec.identities_only is (g["identitiesonly"][0] == "yes")


def test_corpus_is_big_enough_and_covers_every_match_criterion():
    assert len(CONFIGS) >= 40
    text = "\n".join(c.config + "\n".join(c.files.values()) for c in CONFIGS).lower()
    for criterion in ("all", "canonical", "final", "exec", "host", "originalhost", "user", "localuser",
                      "!user", "!localuser", "!exec", "!canonical"):
        assert f"match {criterion}" in text or f" {criterion} " in text, criterion


# -- pasted ssh command lines ------------------------------------------------------------------

LINE_CONFIG = """
Host gpu
  HostName GPU-Box.Example
  Port 2222
  User researcher
  IdentityFile {D}/cfgkey
  ProxyJump cfgjump
Host *
  ServerAliveCountMax 5
"""


@dataclass
class Line:
    id: str
    line: str  # without "ssh"; -F {D}/config is put first


COMMAND_LINES = [
    Line("port-user-at", "-p 41022 root@203.0.113.10"),
    Line("options-after-destination", "root@203.0.113.10 -p 41022 -i {D}/k1"),
    Line("o-port-and-l", "-o Port=41022 -l root 203.0.113.10"),
    Line("jump", "-J jump@198.51.100.5 ubuntu@10.0.0.7"),
    Line("first-value-wins", '-o "Port 2200" -p41022 -tt -o ServerAliveInterval=60 -i {D}/k1 -i {D}/k2 '
                             "-o User=alice bob@h"),
    Line("user-at-before-l", "bob@h -l alice"),
    Line("ssh-uri", "ssh://carol@host.example:2222"),
    Line("issue2-o-time", "-o ConnectTimeout=30s -o ServerAliveInterval=1m30s h"),
    Line("issue9-o-nan-refused", "-o ConnectTimeout=nan h"),
    Line("issue9-o-negative-refused", "-o ConnectTimeout=-1 h"),
    Line("issue9-p-negative-refused", "-p -5 h"),
    Line("p-too-large-refused", "-p 70000 h"),
    Line("p-service-name", "-p ssh h"),
    Line("p-twice-first-wins", "-p 2222 -p 3333 h"),
    Line("o-hostname", "-o HostName=GPU.Example h"),
    Line("l-beats-config", "-l root gpu"),
    Line("p-after-alias-beats-config", "gpu -p 2000"),
    Line("o-known-hosts-and-identitiesonly", "-o IdentitiesOnly=yes -o UserKnownHostsFile={D}/kh gpu"),
    Line("J-then-o-proxyjump", "-J a,b -o ProxyJump=c h"),
    Line("o-proxyjump-then-J-refused", "-o ProxyJump=c -J a h"),
    Line("J-none-beats-config", "-J none gpu"),
    Line("o-unknown-refused", "-o Foo=bar h"),
    Line("o-host-refused", "-o Host=x h"),
    Line("family-flag", "-4 -o Port=2 h"),
    Line("double-dash", "-p 2 -- h"),
    Line("quote-in-user-refused", "\"o'brien@h\""),
    Line("dash-user-refused", "-l -x h"),
    Line("bad-hostname-refused", "'h;x'"),
    Line("o-user-two-words-refused", '-o "User=a b" h'),
    Line("o-user-quoted-space", """-o 'User="a b"' h"""),
    Line("i-and-o-identityfile-order", "-i {D}/k1 -o IdentityFile={D}/k2 gpu"),
    Line("canonicalize-on-command-line", "-o CanonicalizeHostname=yes -o CanonicalizeMaxDots=0 a.b"),
    Line("forward-ignored", "-L 8888:localhost:8888 -N h"),
    Line("forward-bad-refused", "-L bad h"),
    Line("o-port-bad-refused", "-o Port=abc h"),
    Line("ipv6-destination", "root@2001:DB8::1"),
    Line("proxycommand-none-then-J-refused", "-o ProxyCommand=none -J a h"),
    Line("F-other-config", "-F {D}/other gpu"),
    Line("o-user-and-at", "-o User=x y@h"),
    Line("config-alias-everything", "gpu"),
    Line("relative-i", "-i k1 h"),
    Line("glued-and-grouped", "-tt -p2201 -lroot -oPort=1 h"),
    Line("uri-without-user", "ssh://host.example"),
    Line("uri-with-path-refused", "ssh://host.example/path"),
    Line("empty-user-refused", "@h"),
    Line("jump-uri", "-J ssh://u@j.example:2200 h"),
]


@pytest.mark.parametrize("case", COMMAND_LINES, ids=[c.id for c in COMMAND_LINES])
def test_pasted_line_resolves_as_ssh_G(case, tmp_path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    for name in ("k1", "k2", "cfgkey"):
        (tmp_path / name).write_text("", encoding="utf-8")
    cfg = tmp_path / "config"
    cfg.write_text(_fill(LINE_CONFIG, tmp_path, home), encoding="utf-8")
    (tmp_path / "other").write_text("Host gpu\n  Port 2300\n", encoding="utf-8")
    args = ["-F", str(cfg), *shlex.split(_fill(case.line, tmp_path, home))]
    rc, g, err = ssh_G(args, home, tmp_path)
    line = "ssh " + shlex.join(args)
    assert (rc != 0) == case.id.endswith("-refused"), f"the corpus names what ssh does: {err}"
    if rc != 0:
        with pytest.raises(ConfigError) as e:
            hosts.resolve_ssh_command(line, home=home)
        assert "\n" not in e.value.message and e.value.hint
        return
    spec, _notes = hosts.resolve_ssh_command(line, home=home)
    cmd, options, config, local = hosts.ssh_command_options(line, home=home)
    r = resolve_options(cmd.host, config, options, local=local)
    assert (r.hostname, r.user, r.port) == (g["hostname"][0], g["user"][0], int(g["port"][0]))
    assert (r.identity_files or SSH_DEFAULT_KEYS) == [_mine(p, home) if p.startswith(str(home)) else p
                                                      for p in g["identityfile"]]
    assert (r.server_alive_interval or 0) == int(g["serveraliveinterval"][0])
    assert ("none" if r.connect_timeout is None else str(r.connect_timeout)) == g["connecttimeout"][0]
    assert r.proxy_jump == (g["proxyjump"][0] if "proxyjump" in g else None)
    assert (" ".join(_mine(p, home) for p in r.user_known_hosts_files) or "none") == g["userknownhostsfile"][0]
    assert ("yes" if r.identities_only else "no") == g["identitiesonly"][0]
    _check_spec(spec, r, g, args, home, tmp_path)


def test_line_corpus_is_big_enough():
    assert len(COMMAND_LINES) >= 30
