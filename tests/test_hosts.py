"""Host resolution: targets, ssh_config keywords, Include, Match, ProxyJump.

The full comparison with OpenSSH (``ssh -G``) is in test_ssh_config_conformance.py; here are
the reported cases by name, and the behaviour around them (errors, %gpu hosts, Match exec).
"""

import os
import sys
import time

import pytest

from gpumagic.ssh import hosts
from gpumagic.errors import ConfigError
from gpumagic.ssh.hosts import config_aliases, load_ssh_config, parse_target, resolve, split_jump


def write_home(tmp_path, config: str, files: dict | None = None):
    """A HOME whose ~/.ssh/config holds ``config`` (``{H}`` is the HOME), plus other files."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    for rel, text in {".ssh/config": config, **(files or {})}.items():
        p = home / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text.replace("{H}", str(home)), encoding="utf-8")
        p.chmod(0o600)
    return home


def resolve_in(tmp_path, config: str, target: str, files: dict | None = None, **kw):
    home = write_home(tmp_path, config, files)
    return resolve(target, home=home, **kw)


@pytest.mark.parametrize("text,host,user,port", [
    ("mygpu", "mygpu", None, None),
    ("root@203.0.113.10", "203.0.113.10", "root", None),
    ("root@203.0.113.10:41022", "203.0.113.10", "root", 41022),
    ("203.0.113.10:41022", "203.0.113.10", None, 41022),
    ("ubuntu@[2001:db8::1]:2222", "2001:db8::1", "ubuntu", 2222),
    # a bare ssh:// target (a new user got user 'ssh://root')
    ("ssh://root@127.0.0.1:44999", "127.0.0.1", "root", 44999),
    ("ssh://gpu-box", "gpu-box", None, None),
    ("ssh://ubuntu@[2001:db8::1]:2222", "2001:db8::1", "ubuntu", 2222),
])
def test_parse_target_reads_user_host_port(text, host, user, port):
    t = parse_target(text)
    assert (t.host, t.user, t.port) == (host, user, port)


@pytest.mark.parametrize("bad", ["", "a b", "root@", "host:99999", "host:port", "ssh://@h", "ssh://h/path",
                                 "ssh://h:0"])
def test_parse_target_rejects_malformed_text_with_hint(bad):
    with pytest.raises(ConfigError) as e:
        parse_target(bad)
    assert e.value.hint


def test_resolve_honours_config_keywords(tmp_path):
    s = resolve_in(tmp_path, """
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
""", "mygpu")
    home = tmp_path / "home"
    assert s.hostname == "203.0.113.10" and s.port == 41022 and s.user == "root"
    assert s.identity_files == (f"{home}/.ssh/autodl_key",)
    assert s.identities_only is True
    assert (s.server_alive_interval, s.server_alive_count_max, s.connect_timeout) == (10, 4, 7)
    assert s.proxy_jump == ("bastion",)
    assert s.known_hosts == f"{home}/.ssh/known_hosts"
    assert s.known_hosts_name == "[203.0.113.10]:41022"


def test_command_line_options_beat_the_config(tmp_path):
    home = write_home(tmp_path, "Host g\n  HostName h\n  Port 2222\n  User alice\n  ProxyJump b1\n")
    s = resolve("bob@g:3333", home=home)
    assert (s.user, s.port) == ("bob", 3333)
    s = resolve("g", home=home, port=4444, user="carol", proxy_jump="none", identity_file="~/k")
    assert (s.user, s.port, s.proxy_jump) == ("carol", 4444, ())
    assert s.identity_files[0] == f"{home}/k"


def test_first_matching_value_wins_like_openssh(tmp_path):
    s = resolve_in(tmp_path, "Host g\n  User first\nHost *\n  User second\n  ServerAliveInterval 5\n", "g")
    assert s.user == "first" and s.server_alive_interval == 5


def test_defaults_without_config(tmp_path):
    s = resolve_in(tmp_path, "", "203.0.113.10", user="root")
    assert (s.hostname, s.port, s.server_alive_interval, s.server_alive_count_max, s.connect_timeout) == \
        ("203.0.113.10", 22, 30, 3, 15)
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


def test_proxyjump_hops_in_connection_order_as_targets(tmp_path):
    s = resolve_in(tmp_path, "Host g\n  ProxyJump ssh://u@first.example:2200,root@[2001:db8::5]:22,last\n", "g")
    assert s.proxy_jump == ("u@first.example:2200", "root@[2001:db8::5]:22", "last")
    assert [parse_target(h).host for h in s.proxy_jump] == ["first.example", "2001:db8::5", "last"]


def test_include_relative_to_ssh_dir_in_sorted_glob_order(tmp_path):
    home = write_home(tmp_path, "# mine\nInclude config.d/*.conf\nHost c\n  HostName 10.0.0.3\n", {
        ".ssh/config.d/20-b.conf": "Host b\n  HostName 10.0.0.2\n  User two\n",
        ".ssh/config.d/10-a.conf": "Host b\n  User one\nHost a\n  HostName 10.0.0.1\n",
    })
    c = load_ssh_config(home=home)
    assert config_aliases(c) == ["a", "b", "c"]
    # 10-a is read before 20-b, so its "User one" wins
    assert resolve("b", config=c, home=home).user == "one"
    assert resolve("b", config=c, home=home).hostname == "10.0.0.2"


def test_include_absolute_and_missing_files(tmp_path):
    other = tmp_path / "other.conf"
    other.write_text("Host x\n  Port 2200\n", encoding="utf-8")
    other.chmod(0o600)
    assert resolve_in(tmp_path, f"Include {other} ~/nope/*\n", "x").port == 2200


def test_include_loop_is_reported_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="Include") as e:
        resolve_in(tmp_path, "Include config\n", "x")
    assert "\n" not in e.value.message


def test_config_aliases_skip_patterns_and_blocks_that_cannot_apply(tmp_path):
    home = write_home(tmp_path, "Host a b\nHost *.lab !x c?\nHost *\nHost trainbox\n  Include {H}/inc.conf\n"
                                "Match all\n  Include {H}/inc2.conf\n",
                      {"inc.conf": "Host mirror trainbox\n", "inc2.conf": "Host fromMatch\n"})
    assert config_aliases(load_ssh_config(home=home)) == ["a", "b", "fromMatch", "trainbox"]


# -- the reported cases ----------------------------------------------------------------------

def test_issue1_a_word_starting_with_hash_ends_the_line(tmp_path):
    s = resolve_in(tmp_path, "Host gpu\n  Port 2222 # forwarded\n  HostName 10.0.0.5 # the box\n", "gpu")
    assert (s.hostname, s.port) == ("10.0.0.5", 2222)
    # '#' inside a word is part of it, and a quoted one too
    s = resolve_in(tmp_path, 'Host gpu\n  IdentityFile "/k #1"\n  HostName a#b\n', "gpu")
    assert (s.hostname, s.identity_files) == ("a#b", ("/k #1",))


@pytest.mark.parametrize("text,seconds", [("30", 30), ("30s", 30), ("1m", 60), ("1h30m", 5400), ("2M", 120),
                                          ("1w", 604800)])
def test_issue2_ssh_time_format_in_config(tmp_path, text, seconds):
    s = resolve_in(tmp_path, f"Host gpu\n  ServerAliveInterval {text}\n  ConnectTimeout {text}\n", "gpu")
    assert (s.server_alive_interval, s.connect_timeout) == (seconds, seconds)


def test_issue2_ssh_time_format_in_pasted_line(tmp_path):
    spec, _ = hosts.resolve_ssh_command("ssh -o ConnectTimeout=30s -o ServerAliveInterval=1m root@h",
                                        home=write_home(tmp_path, ""))
    assert (spec.connect_timeout, spec.server_alive_interval) == (30, 60)


def test_issue3_include_stays_inside_the_block_it_appears_in(tmp_path):
    config = "Host trainbox\n  HostName 10.1.0.2\n  Include {H}/common.conf\n  User researcher\n"
    common = {"common.conf": "  Port 2213\nHost mirror\n  HostName 10.9.9.9\n  User mirroruser\n"}
    s = resolve_in(tmp_path, config, "trainbox", common)
    assert (s.hostname, s.port, s.user) == ("10.1.0.2", 2213, "researcher")
    m = resolve_in(tmp_path, config, "mirror", common, user="me")
    # the included Host mirror block sits inside Host trainbox: it never applies to mirror
    assert (m.hostname, m.port, m.user) == ("mirror", 22, "me")


def test_issue4_match_user_root_resolves_and_hosts_lists(tmp_path, monkeypatch):
    config = "Host gpu\n  HostName 10.0.0.7\n  User root\nHost other\n  User bob\nMatch user root\n  Port 2222\n"
    s = resolve_in(tmp_path, config, "gpu")
    assert (s.user, s.port) == ("root", 2222)
    assert resolve("other", home=tmp_path / "home").port == 22
    from gpumagic.notebook.magics import hosts_table
    from gpumagic.fleet import Fleet

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    table = hosts_table(Fleet())
    assert "root@10.0.0.7:2222" in table and "bob@other:22" in table


@pytest.mark.parametrize("config,fragment", [
    ("Match localnetwork 10.0.0.0/8\n  Port 1\n", "localnetwork"),
    ("Match host\n", "missing its pattern"),
    ("Match host gpu user x all\n", "cannot be combined"),
    ("Match\n", "has no value"),
    ("Match exec\n", "missing its pattern"),
])
def test_issue4_match_that_cannot_be_evaluated_is_one_line(tmp_path, config, fragment):
    with pytest.raises(ConfigError) as e:
        resolve_in(tmp_path, config, "gpu")
    assert fragment in e.value.message and "line 1" in e.value.message
    assert "\n" not in e.value.message and e.value.hint


def test_issue4_match_exec_runs_through_the_users_shell_with_tokens(tmp_path, monkeypatch):
    log = tmp_path / "log"
    monkeypatch.setenv("SHELL", "/bin/sh")
    s = resolve_in(tmp_path, f'Host gpu\n  HostName Box.Example\nMatch exec "echo %h %n %p %r >> {log}"\n'
                             "  Port 2300\n", "gpu", user="u")
    assert s.port == 2300
    assert log.read_text(encoding="utf-8") == "Box.Example gpu 22 u\n"  # %h in Match exec: HostName as written (readconf.c)
    s = resolve_in(tmp_path, "Match !exec false\n  Port 2301\nMatch exec false\n  User never\n", "gpu")
    assert s.port == 2301 and s.user != "never"


def test_issue4_match_exec_that_hangs_is_stopped_and_reported(tmp_path, monkeypatch):
    from gpumagic.ssh import config as ssh_config

    monkeypatch.setattr(ssh_config, "EXEC_TIMEOUT", 0.5)
    monkeypatch.setenv("SHELL", "/bin/sh")
    pidfile = tmp_path / "pid"
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="did not finish") as e:
        resolve_in(tmp_path, f'Match exec "echo $$ > {pidfile}; exec sleep 30"\n', "gpu")
    assert time.monotonic() - t0 < 10
    assert "\n" not in e.value.message
    pid = int(pidfile.read_text(encoding="utf-8"))
    with pytest.raises(ProcessLookupError):  # killed, not left running
        for _ in range(50):
            os.kill(pid, 0)
            time.sleep(0.1)


def test_issue4_match_exec_killed_or_without_shell_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("SHELL", "/bin/sh")
    with pytest.raises(ConfigError, match="killed by signal"):
        resolve_in(tmp_path, 'Match exec "kill -9 $$"\n', "gpu")
    monkeypatch.setenv("SHELL", str(tmp_path / "no-such-shell"))
    with pytest.raises(ConfigError, match="not executable"):
        resolve_in(tmp_path, "Match exec true\n", "gpu")


def test_issue5_hostname_lower_cased_as_ssh_uses_it(tmp_path):
    s = resolve_in(tmp_path, "Host gpu\n  HostName GPU-Box.Example\n  Port 2222\n", "gpu")
    assert s.hostname == "gpu-box.example"
    assert s.known_hosts_name == "[gpu-box.example]:2222"
    # a typed name is lower-cased too; the alias match stays case-sensitive, as in ssh
    s = resolve_in(tmp_path, "Host gpu\n  Port 2222\n", "GPU")
    assert (s.alias, s.hostname, s.port) == ("GPU", "gpu", 22)
    # only ASCII letters, as OpenSSH's tolower() in the C locale; addresses get their canonical form
    assert resolve_in(tmp_path, "Host gpu\n  HostName ÜBER.Example\n", "gpu").hostname == "Über.example"
    assert resolve_in(tmp_path, "Host gpu\n  HostName 2001:DB8:0::1\n", "gpu").hostname == "2001:db8::1"


@pytest.mark.parametrize("line,fragment", [
    ("ConnectTimeout nan", "ConnectTimeout nan is not a time"),
    ("ConnectTimeout -1", "ConnectTimeout -1 is out of range"),
    ("ConnectTimeout 99999999999", "out of range"),
    ("ServerAliveInterval nan", "ServerAliveInterval nan is not a time"),
    ("ServerAliveCountMax -3", "ServerAliveCountMax -3 is out of range"),
    ("ServerAliveCountMax x", "ServerAliveCountMax x is not a whole number"),
    ("Port -5", "Port -5 is out of range"),
    ("Port 70000", "Port 70000 is out of range"),
    ("Port nope", "Port nope is not a port number"),
])
def test_issue9_bad_numbers_in_config_are_named(tmp_path, line, fragment):
    with pytest.raises(ConfigError) as e:
        resolve_in(tmp_path, f"Host gpu\n  {line}\n", "gpu")
    assert fragment in e.value.message and "config line 2" in e.value.message
    assert "\n" not in e.value.message and e.value.hint


@pytest.mark.parametrize("kw", [dict(port=-5), dict(port=0), dict(port=70000)])
def test_issue9_bad_port_option_is_named(tmp_path, kw):
    with pytest.raises(ConfigError, match="-p/--port .* is out of range"):
        resolve_in(tmp_path, "", "h", **kw)


@pytest.mark.parametrize("line,fragment", [
    ("ssh -p -5 h", "-p -5 is out of range"),
    ("ssh -o ConnectTimeout=nan h", "ConnectTimeout nan is not a time"),
    ("ssh -o ConnectTimeout=-1 h", "ConnectTimeout -1 is out of range"),
    ("ssh -o Foo=1 h", "Bad configuration option: Foo"),
])
def test_issue9_bad_numbers_in_pasted_line_are_named(tmp_path, line, fragment):
    with pytest.raises(ConfigError) as e:
        hosts.resolve_ssh_command(line, home=write_home(tmp_path, ""))
    assert fragment in e.value.message and "\n" not in e.value.message


def test_a_bad_line_anywhere_refuses_the_whole_config_like_ssh(tmp_path):
    with pytest.raises(ConfigError) as e:
        resolve_in(tmp_path, "Host gpu\n  Port 2\nHost other\n  HostName it's\n", "gpu")
    assert "config line 4: invalid quotes" in e.value.message
    with pytest.raises(ConfigError, match="Bad configuration option: Hostnme"):
        resolve_in(tmp_path, "Host other\n  Hostnme typo\n", "gpu")
    # IgnoreUnknown, newer OpenSSH keywords and Apple's UseKeychain are accepted
    s = resolve_in(tmp_path, "IgnoreUnknown Foo\nHost gpu\n  Foo 1\n  UseKeychain yes\n  ChannelTimeout session=5m\n"
                             "  Port 2\n", "gpu")
    assert s.port == 2


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
def test_config_writable_by_others_is_refused_like_ssh(tmp_path):
    home = write_home(tmp_path, "Host gpu\n  Port 2\n")
    (home / ".ssh" / "config").chmod(0o666)
    with pytest.raises(ConfigError, match="bad owner or permissions") as e:
        resolve("gpu", home=home)
    assert "chmod go-w" in e.value.hint


def test_proxycommand_is_refused_not_skipped(tmp_path):
    with pytest.raises(ConfigError, match="ProxyCommand"):
        resolve_in(tmp_path, "Host gpu\n  ProxyCommand nc %h %p\n", "gpu")
    # ProxyCommand none is no proxy; a ProxyJump written first wins over a later ProxyCommand
    assert resolve_in(tmp_path, "Host gpu\n  ProxyCommand none\n", "gpu").proxy_jump == ()
    assert resolve_in(tmp_path, "Host gpu\n  ProxyJump b\n  ProxyCommand nc %h %p\n", "gpu").proxy_jump == ("b",)


def test_tokens_and_tilde_in_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUMAGIC_T", "tv")
    s = resolve_in(tmp_path, "Host gpu\n  HostName Box\n  User r\n  IdentityFile ~/.ssh/%h_%r_%p_%%_%n\n"
                             "  IdentityFile ${GPUMAGIC_T}/k\n  UserKnownHostsFile %d/kh_%h\n", "gpu")
    home = tmp_path / "home"
    assert s.identity_files == (f"{home}/.ssh/box_r_22_%_gpu", "tv/k")
    assert s.known_hosts == f"{home}/kh_box"
    with pytest.raises(ConfigError, match="%z"):
        resolve_in(tmp_path, "Host gpu\n  IdentityFile ~/%z\n", "gpu")


def test_hosts_module_never_uses_paramiko_for_config():
    src = (hosts.__file__, hosts.__file__.replace("hosts.py", "config.py"))
    for path in src:
        assert "paramiko" not in open(path, encoding="utf-8").read(), path


def test_idna_unencodable_host_is_a_one_line_error():
    import gpumagic
    from gpumagic.errors import HostNotFound

    with pytest.raises(HostNotFound) as e:
        gpumagic.connect("ü..x")
    assert "'ü..x'" in e.value.message and "\n" not in e.value.message


def test_bad_alive_interval_fails_before_connect_says_connected(tmp_path, monkeypatch, ip, capsys, sshd):
    home = write_home(tmp_path, f"Host badalive\n  HostName {sshd.host}\n  Port {sshd.port}\n"
                                "  ServerAliveInterval nan\n")
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(ConfigError, match="ServerAliveInterval nan"):
        ip.run_line_magic("gpu", "connect badalive")
    assert "connected" not in capsys.readouterr().out


def test_connect_magic_negative_port_is_named(ip, sshd):
    from IPython.core.error import UsageError

    with pytest.raises((ConfigError, UsageError), match="port"):
        ip.run_line_magic("gpu", "connect testgpu -p -5")
    with pytest.raises(ConfigError, match="-p -5 is out of range"):
        ip.run_line_magic("gpu", "connect ssh -p -5 testgpu")


def test_match_exec_child_does_not_inherit_a_terminal(tmp_path, monkeypatch):
    """stdin and stdout of a Match exec command are /dev/null, as in ssh (stdfd_devnull)."""
    monkeypatch.setenv("SHELL", "/bin/sh")
    out = tmp_path / "out"
    resolve_in(tmp_path, f'Match exec "readlink /proc/$$/fd/0 /proc/$$/fd/1 | cat > {out}"\n', "gpu")
    if sys.platform.startswith("linux"):
        assert out.read_text(encoding="utf-8").split() == ["/dev/null", "/dev/null"]
