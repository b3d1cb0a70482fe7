"""Issue case 8: ``%gpu add-host`` writes values that OpenSSH reads back as given, or refuses them.

A value OpenSSH cannot read (an unbalanced ``'`` was the report) makes ssh refuse the whole
~/.ssh/config, which breaks every ``ssh`` on the laptop (VS Code Remote-SSH included).  The
judge is ``ssh -G -F FILE ALIAS`` on the file add-host wrote.
"""

import shutil
import subprocess

import pytest

from gpumagic.ssh import hosts
from gpumagic import keys as setup
from gpumagic.errors import ConfigError

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="the judge is OpenSSH's ssh -G")

BEFORE = b"Host old\n  HostName 198.51.100.9\n"


def _home(tmp_path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    cfg = home / ".ssh" / "config"
    cfg.write_bytes(BEFORE)
    cfg.chmod(0o600)
    return home, cfg


def ssh_G(cfg, name: str) -> tuple[int, dict, str]:
    p = subprocess.run(["ssh", "-G", "-F", str(cfg), name], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=60, encoding="utf-8")
    out: dict[str, list[str]] = {}
    for line in p.stdout.splitlines():
        key, _, value = line.partition(" ")
        out.setdefault(key, []).append(value)
    return p.returncode, out, p.stderr


@pytest.mark.parametrize("kw,keyword,shown", [
    (dict(user="o'brien"), "user", "o'brien"),
    (dict(user='say"hi'), "user", 'say"hi'),
    (dict(user="=eq"), "user", "=eq"),
    (dict(user="#x"), "user", "#x"),
    (dict(key="~/.ssh/o'key"), "identityfile", "~/.ssh/o'key"),
    (dict(key="~/my keys/id 1"), "identityfile", "~/my keys/id 1"),
    (dict(key="~/.ssh/#hash"), "identityfile", "~/.ssh/#hash"),
    (dict(key="~/.ssh/back\\slash"), "identityfile", "~/.ssh/back\\slash"),
    (dict(key='~/.ssh/"q" \'both\''), "identityfile", '~/.ssh/"q" \'both\''),
    (dict(key="~/.ssh/id_%h"), "identityfile", "~/.ssh/id_%h"),
    (dict(hostname="GPU-Box.Example"), "hostname", "gpu-box.example"),
    (dict(hostname="2001:db8::7"), "hostname", "2001:db8::7"),
    (dict(jump="u@bastion:2222,second"), "proxyjump", "u@bastion:2222,second"),
    (dict(options={"ConnectTimeout": "30s"}), "connecttimeout", "30"),
    (dict(options={"UserKnownHostsFile": ("~/kh one", "~/kh2")}), "userknownhostsfile", None),
])
def test_issue8_written_values_read_back_through_ssh_G(tmp_path, kw, keyword, shown):
    home, cfg = _home(tmp_path)
    kw = dict(kw)
    hostname = kw.pop("hostname", "203.0.113.10")
    setup.add_host("gpu", hostname, home=home, **kw)
    rc, g, err = ssh_G(cfg, "gpu")
    assert rc == 0, err
    if shown is None:  # several files: ssh -G joins them with blanks after expanding ~
        assert g[keyword][0].endswith("/kh one " + g[keyword][0].rsplit(" ", 1)[1])
        assert g[keyword][0].split(" ")[-1].endswith("/kh2")
    else:
        assert g[keyword][0] == shown
    # gpumagic reads the file the same way, and ssh still reads the block that was there
    assert hosts.resolve("gpu", home=home).hostname == g["hostname"][0]
    assert ssh_G(cfg, "old")[1]["hostname"] == ["198.51.100.9"]


@pytest.mark.parametrize("kw,fragment", [
    (dict(hostname="it's.example"), "HostName"),
    (dict(hostname="h%p"), "HostName"),
    (dict(hostname="-oProxyCommand=x"), "HostName"),
    (dict(jump="o'x@bastion"), "ProxyJump"),
    (dict(jump="bastion # c"), "ProxyJump"),
    (dict(jump="a,"), "ProxyJump"),
    (dict(user="100%"), "User"),
    (dict(user="a b"), "User"),
    (dict(user="bob\nHost *"), "User"),
    (dict(key="~/.ssh/%z"), "IdentityFile"),
    (dict(key="~/.ssh/a\nb"), "IdentityFile"),
    (dict(server_alive_interval=-5), "ServerAliveInterval"),
    (dict(server_alive_count_max=-1), "ServerAliveCountMax"),
    (dict(port=-5), "port -5 is out of range"),
    (dict(port=70000), "port 70000 is out of range"),
    (dict(options={"ConnectTimeout": "nan"}), "ConnectTimeout"),
    (dict(options={"IdentitiesOnly": "maybe"}), "IdentitiesOnly"),
])
def test_issue8_unwritable_values_refused_and_file_untouched(tmp_path, kw, fragment):
    home, cfg = _home(tmp_path)
    kw = dict(kw)
    hostname = kw.pop("hostname", "203.0.113.10")
    with pytest.raises(ConfigError) as e:
        setup.add_host("gpu", hostname, home=home, **kw)
    assert fragment in e.value.message and "\n" not in e.value.message and e.value.hint
    assert cfg.read_bytes() == BEFORE
    assert not (home / ".ssh" / "config.bak").exists()
    assert ssh_G(cfg, "old")[0] == 0


def test_issue8_add_host_magic_with_a_quote_in_the_user(tmp_path, monkeypatch, ip, capsys):
    home, cfg = _home(tmp_path)
    monkeypatch.setenv("HOME", str(home))
    ip.run_line_magic("gpu", """add-host q --hostname 192.0.2.4 -l "o'brien" -i "~/.ssh/o'key" """)
    assert "added to" in capsys.readouterr().out
    rc, g, err = ssh_G(cfg, "q")
    assert rc == 0, err
    assert (g["user"], g["identityfile"]) == (["o'brien"], ["~/.ssh/o'key"])
    with pytest.raises(ConfigError, match="ProxyJump"):
        ip.run_line_magic("gpu", """add-host r --hostname 192.0.2.5 -J "o'x@bastion" """)
    assert ssh_G(cfg, "r")[0] == 0 and "Host r" not in cfg.read_text(encoding="utf-8")
