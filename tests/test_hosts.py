"""Pure host resolution: targets, ssh_config keywords, Include, ProxyJump."""

import paramiko
import pytest

from gpumagic.errors import ConfigError
from gpumagic.hosts import (
    config_aliases,
    expand_includes,
    load_ssh_config,
    parse_target,
    resolve,
    split_jump,
)


def cfg(text):
    return paramiko.SSHConfig.from_text(text)


@pytest.mark.parametrize("text,host,user,port", [
    ("mygpu", "mygpu", None, None),
    ("root@203.0.113.10", "203.0.113.10", "root", None),
    ("root@203.0.113.10:41022", "203.0.113.10", "root", 41022),
    ("203.0.113.10:41022", "203.0.113.10", None, 41022),
    ("ubuntu@[2001:db8::1]:2222", "2001:db8::1", "ubuntu", 2222),
])
def test_parse_target_reads_user_host_port(text, host, user, port):
    t = parse_target(text)
    assert (t.host, t.user, t.port) == (host, user, port)


@pytest.mark.parametrize("bad", ["", "a b", "root@", "host:99999", "host:port"])
def test_parse_target_rejects_malformed_text_with_hint(bad):
    with pytest.raises(ConfigError) as e:
        parse_target(bad)
    assert e.value.hint


def test_resolve_honours_config_keywords(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # paramiko expands ~ in IdentityFile from $HOME
    c = cfg("""
Host mygpu
  HostName 203.0.113.10
  Port 41022
  User root
  IdentityFile ~/.ssh/autodl_key
  IdentitiesOnly yes
  ServerAliveInterval 10
  ServerAliveCountMax 4
  ConnectTimeout 7
  ProxyJump bastion
""")
    s = resolve("mygpu", config=c, home=str(tmp_path))
    assert s.hostname == "203.0.113.10" and s.port == 41022 and s.user == "root"
    assert s.identity_files == (f"{tmp_path}/.ssh/autodl_key",)
    assert s.identities_only is True
    assert (s.server_alive_interval, s.server_alive_count_max, s.connect_timeout) == (10, 4, 7)
    assert s.proxy_jump == ("bastion",)
    assert s.known_hosts == f"{tmp_path}/.ssh/known_hosts"
    assert s.known_hosts_name == "[203.0.113.10]:41022"


def test_command_line_options_beat_the_config(tmp_path):
    c = cfg("Host g\n  HostName h\n  Port 2222\n  User alice\n  ProxyJump b1\n")
    s = resolve("bob@g:3333", config=c, home=str(tmp_path))
    assert (s.user, s.port) == ("bob", 3333)
    s = resolve("g", config=c, home=str(tmp_path), port=4444, user="carol", proxy_jump="none",
                identity_file="~/k")
    assert (s.user, s.port, s.proxy_jump) == ("carol", 4444, ())
    assert s.identity_files[0] == f"{tmp_path}/k"


def test_first_matching_value_wins_like_openssh(tmp_path):
    c = cfg("Host g\n  User first\nHost *\n  User second\n  ServerAliveInterval 5\n")
    s = resolve("g", config=c, home=str(tmp_path))
    assert s.user == "first" and s.server_alive_interval == 5


def test_defaults_without_config(tmp_path):
    s = resolve("203.0.113.10", config=cfg(""), home=str(tmp_path), user="root")
    assert (s.hostname, s.port, s.server_alive_interval, s.server_alive_count_max) == \
        ("203.0.113.10", 22, 30, 3)
    assert s.known_hosts_name == "203.0.113.10"


@pytest.mark.parametrize("value,hops", [
    ("bastion", ("bastion",)),
    ("a,b", ("a", "b")),
    ("user@a:2222, b", ("user@a:2222", "b")),
    ("none", ()),
    (None, ()),
])
def test_split_jump_keeps_written_order(value, hops):
    assert split_jump(value) == hops


def test_include_relative_to_ssh_dir_in_sorted_glob_order(tmp_path):
    ssh = tmp_path / ".ssh"
    (ssh / "config.d").mkdir(parents=True)
    (ssh / "config.d" / "20-b.conf").write_text("Host b\n  HostName 10.0.0.2\n  User two\n")
    (ssh / "config.d" / "10-a.conf").write_text("Host b\n  User one\nHost a\n  HostName 10.0.0.1\n")
    (ssh / "config").write_text("# mine\nInclude config.d/*.conf\nHost c\n  HostName 10.0.0.3\n")
    c = load_ssh_config(home=tmp_path)
    assert config_aliases(c) == ["a", "b", "c"]
    # 10-a is read before 20-b, so its "User one" wins
    assert resolve("b", config=c, home=str(tmp_path)).user == "one"
    assert resolve("b", config=c, home=str(tmp_path)).hostname == "10.0.0.2"


def test_include_absolute_and_missing_files(tmp_path):
    other = tmp_path / "other.conf"
    other.write_text("Host x\n  Port 2200\n")
    text = expand_includes(f"Include {other} ~/nope/*\n", tmp_path)
    assert "Port 2200" in text


def test_include_loop_is_reported(tmp_path):
    ssh = tmp_path / ".ssh"
    ssh.mkdir()
    (ssh / "config").write_text("Include config\n")
    with pytest.raises(ConfigError, match="Include"):
        load_ssh_config(home=tmp_path)


def test_config_aliases_skip_patterns():
    assert config_aliases(cfg("Host a b\nHost *.lab !x c?\nHost *\n")) == ["a", "b"]
