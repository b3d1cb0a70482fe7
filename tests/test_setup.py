"""First-time set-up: pasted ssh lines, keygen, add-host, install-key, tutorial 00.

Real OpenSSH servers throughout; the password-login server uses a throwaway local user
(created with useradd, password set through chpasswd's stdin) because sshd runs with
``UsePAM no`` and so checks the shadow password of a real account.
"""

from __future__ import annotations

import io
import os
import secrets
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import paramiko
import pytest

import gpumagic
from gpumagic import keys as setup
from gpumagic.errors import AuthenticationFailed, ConfigError, UnknownHostKey
from gpumagic.ssh.hosts import parse_ssh_command
from gpumagic.ssh.sandbox import SshServer

from conftest import CLIENT_HOME, make_server

REPO = Path(__file__).resolve().parent.parent


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


# -- case 3: pasted ssh command lines (pure) ---------------------------------------------

CASE3 = [
    ("ssh -p 41022 root@203.0.113.10", dict(host="203.0.113.10", port=41022, user="root", key=None, jump=None)),
    ("ssh root@203.0.113.10 -p 41022 -i ~/k", dict(host="203.0.113.10", port=41022, user="root", key="~/k", jump=None)),
    ("ssh -o Port=41022 -l root 203.0.113.10", dict(host="203.0.113.10", port=41022, user="root", key=None, jump=None)),
    ("ssh -J jump@198.51.100.5 ubuntu@10.0.0.7", dict(host="10.0.0.7", port=None, user="ubuntu", key=None, jump="jump@198.51.100.5")),
]


@pytest.mark.parametrize("line,want", CASE3, ids=[c[0] for c in CASE3])
def test_pasted_ssh_line_gives_host_port_user_key_jump_as_written(line, want):
    cmd = parse_ssh_command(line)
    assert dict(host=cmd.host, port=cmd.port, user=cmd.user, key=cmd.key, jump=cmd.jump) == want
    assert cmd.ignored == ()


def test_pasted_ssh_line_option_forms_and_first_value_wins():
    cmd = parse_ssh_command('$ ssh -o "Port 2200" -p41022 -tt -o ServerAliveInterval=60 '
                            "-i ~/a -i ~/b -o User=alice bob@h")
    assert (cmd.host, cmd.port, cmd.user) == ("h", 2200, "alice")  # OpenSSH: first value wins
    assert cmd.keys == ("~/a", "~/b") and cmd.key == "~/a"
    assert cmd.options == {"ServerAliveInterval": "60"}
    # user@ before a later -l: user@ wins, as in ssh.c
    assert parse_ssh_command("ssh bob@h -l alice").user == "bob"
    uri = parse_ssh_command("ssh ssh://carol@[2001:db8::1]:2222")
    assert (uri.host, uri.port, uri.user) == ("2001:db8::1", 2222, "carol")


def test_pasted_ssh_line_resolves_with_honoured_options(tmp_path):
    from gpumagic.ssh.hosts import resolve_ssh_command

    spec, notes = resolve_ssh_command(
        "ssh -o ConnectTimeout=5 -o ServerAliveCountMax=9 -o StrictHostKeyChecking=no "
        "-i ~/k -p 41022 root@2001:db8::1", home=tmp_path)
    assert (spec.hostname, spec.port, spec.user) == ("2001:db8::1", 41022, "root")
    assert spec.identity_files == (str(tmp_path / "k"),)
    assert (spec.connect_timeout, spec.server_alive_count_max) == (5, 9)
    assert notes == ["ignored -o StrictHostKeyChecking=no (gpumagic never accepts a host key "
                     "silently; compare the fingerprint and connect with --trust-new-host)"]


def test_pasted_ssh_line_lists_ignored_options_with_reason():
    cmd = parse_ssh_command("ssh -o StrictHostKeyChecking=no -L 8888:localhost:8888 -N -p 22 root@h")
    assert cmd.port == 22
    assert len(cmd.ignored) == 3
    assert "never accepts a host key silently" in cmd.ignored[0]
    assert cmd.ignored[1].startswith("-L 8888:localhost:8888")


@pytest.mark.parametrize("line,fragment", [
    ("ssh", "names no machine"),
    ("ssh -p", "-p needs a value"),
    ("ssh root@h nvidia-smi", "remote command"),
    ("ssh -o Port root@h", "has no value"),
    ("ssh -p 70000 root@h", "out of range"),
    ("ssh -Z root@h", "no option -Z"),
    ("scp root@h:x .", "not an ssh command"),
])
def test_pasted_ssh_line_errors_say_what_to_do(line, fragment):
    with pytest.raises(ConfigError) as e:
        parse_ssh_command(line)
    assert fragment in e.value.message and e.value.hint


# -- case 1: add-host --------------------------------------------------------------------

CONFIG_BEFORE = (b"# my laptop's ssh settings\n"
                 b"Include config.d/*\n"
                 b"\n"
                 b"Host *\n"
                 b"  AddKeysToAgent yes\n"
                 b"\n"
                 b"Host old\n"
                 b"  HostName 198.51.100.9\n"
                 b"  User ubuntu")  # no newline at the end, as editors sometimes leave it


def _home_with_config(tmp_path, data: bytes) -> Path:
    home = tmp_path / "home"
    (home / ".ssh" / "config.d").mkdir(parents=True)
    (home / ".ssh" / "config").write_bytes(data)
    return home


def _ssh_G(config: Path, name: str) -> dict:
    """What the real OpenSSH client makes of ``name`` (``ssh -G``: resolved options)."""
    out = subprocess.run(["ssh", "-G", "-F", str(config), name], capture_output=True, text=True,
                         check=True, encoding="utf-8").stdout
    return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)


def test_add_host_keeps_every_earlier_byte_and_appends_one_block_once(tmp_path):
    home = _home_with_config(tmp_path, CONFIG_BEFORE)
    cfg = home / ".ssh" / "config"
    r = setup.add_host("new", "203.0.113.10", port=41022, user="root", key="~/.ssh/id_ed25519",
                       home=home)
    after = cfg.read_bytes()
    assert r.action == "added" and r.notes == []
    assert after.startswith(CONFIG_BEFORE)
    assert after[len(CONFIG_BEFORE):] == (b"\n\nHost new\n  HostName 203.0.113.10\n  Port 41022\n"
                                          b"  User root\n  IdentityFile ~/.ssh/id_ed25519\n"
                                          b"  IdentitiesOnly yes\n  ServerAliveInterval 30\n"
                                          b"  ServerAliveCountMax 3\n")
    assert (home / ".ssh" / "config.bak").read_bytes() == CONFIG_BEFORE
    assert _mode(home / ".ssh") == 0o700
    again = setup.add_host("new", "203.0.113.10", port=41022, user="root", key="~/.ssh/id_ed25519",
                           home=home)
    assert again.action == "unchanged"
    assert cfg.read_bytes() == after
    assert after.count(b"Host new") == 1
    # The same block works for plain ssh (and so for VS Code Remote-SSH, which runs ssh).
    g = _ssh_G(cfg, "new")
    assert (g["hostname"], g["port"], g["user"]) == ("203.0.113.10", "41022", "root")
    assert (g["serveraliveinterval"], g["serveralivecountmax"]) == ("30", "3")
    assert g["identityfile"] == str(home / ".ssh" / "id_ed25519") or g["identityfile"].endswith("/.ssh/id_ed25519")


def test_add_host_different_block_same_name_refused_file_unchanged(tmp_path):
    home = _home_with_config(tmp_path, CONFIG_BEFORE)
    with pytest.raises(setup.HostExists) as e:
        setup.add_host("old", "203.0.113.99", home=home)
    assert "HostName 198.51.100.9" in e.value.message and "--replace" in e.value.hint
    assert (home / ".ssh" / "config").read_bytes() == CONFIG_BEFORE


def test_add_host_replace_shows_old_block_and_swaps_it_in_place(tmp_path):
    data = CONFIG_BEFORE + b"\n\nHost later\n  HostName 192.0.2.1\n"
    home = _home_with_config(tmp_path, data)
    r = setup.add_host("old", "203.0.113.99", port=2222, replace=True, server_alive_interval=None,
                       server_alive_count_max=None, home=home)
    assert r.action == "replaced"
    assert r.old_block == "Host old\n  HostName 198.51.100.9\n  User ubuntu\n"
    text = (home / ".ssh" / "config").read_text(encoding="utf-8")
    assert text == data.decode().replace("Host old\n  HostName 198.51.100.9\n  User ubuntu\n",
                                         "Host old\n  HostName 203.0.113.99\n  Port 2222\n")
    assert (home / ".ssh" / "config.bak").read_bytes() == data


def test_add_host_warns_when_an_earlier_host_star_block_wins(tmp_path):
    home = _home_with_config(tmp_path, b"Host *\n  User ubuntu\n")
    r = setup.add_host("gpu", "203.0.113.10", user="root", home=home)
    assert any("sets User ubuntu" in n and "first value" in n for n in r.notes), r.notes


def test_add_host_writes_through_a_symlinked_config_and_keeps_crlf(tmp_path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    real = tmp_path / "dotfiles" / "ssh_config"
    real.parent.mkdir()
    real.write_bytes(b"Host a\r\n  HostName 192.0.2.5\r\n")
    (home / ".ssh" / "config").symlink_to(real)
    setup.add_host("b", "192.0.2.6", home=home)
    assert (home / ".ssh" / "config").is_symlink()
    assert real.read_bytes() == (b"Host a\r\n  HostName 192.0.2.5\r\n\r\nHost b\r\n  HostName 192.0.2.6\r\n"
                                 b"  ServerAliveInterval 30\r\n  ServerAliveCountMax 3\r\n")


@pytest.mark.parametrize("name", ["two words", "gpu*", "", "-x"])
def test_add_host_rejects_names_ssh_would_read_as_patterns(tmp_path, name):
    with pytest.raises(ConfigError):
        setup.add_host(name, "192.0.2.1", home=tmp_path)
    assert not (tmp_path / ".ssh" / "config").exists()


# -- case 2: keygen ----------------------------------------------------------------------


def test_keygen_refuses_existing_key_and_leaves_it_unchanged(tmp_path):
    key = tmp_path / "id_ed25519"
    key.write_bytes(b"precious")
    with pytest.raises(setup.KeyExists):
        setup.keygen(key)
    assert key.read_bytes() == b"precious"
    assert not Path(str(key) + ".pub").exists()
    pub_only = tmp_path / "other"
    Path(str(pub_only) + ".pub").write_text("ssh-ed25519 AAAA x\n", encoding="utf-8")
    with pytest.raises(setup.KeyExists):
        setup.keygen(pub_only)
    assert not pub_only.exists()


@pytest.fixture(scope="module")
def keygen_server():
    server = make_server("keygen-server")
    yield server
    server.stop()


def test_keygen_new_key_mode_0600_and_logs_in_once_authorized(tmp_path, keygen_server):
    home = tmp_path / "home"
    home.mkdir()
    pair = setup.keygen(comment="student@laptop", home=home)
    assert pair.path == home / ".ssh" / "id_ed25519"
    assert _mode(pair.path) == 0o600 and _mode(home / ".ssh") == 0o700
    assert pair.public_key.startswith("ssh-ed25519 ") and pair.public_key.endswith(" student@laptop")
    assert pair.path.read_bytes().startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----")
    # OpenSSH itself derives the same public key (the file is in its format).
    derived = subprocess.run(["ssh-keygen", "-y", "-f", str(pair.path)], capture_output=True,
                             text=True, check=True, encoding="utf-8").stdout.split()
    assert derived[:2] == pair.public_key.split()[:2]
    fp = subprocess.run(["ssh-keygen", "-l", "-f", str(pair.public_path)], capture_output=True,
                        text=True, check=True, encoding="utf-8").stdout.split()[1]
    assert fp == pair.fingerprint
    s = keygen_server
    spec = s.spec().with_options(identity_files=(str(pair.path),))
    m = gpumagic.Machine(spec, name="keygen")
    with pytest.raises(AuthenticationFailed):
        m.connect()  # not authorized yet
    with open(s.authorized_keys, "a", encoding="utf-8") as f:
        f.write(pair.public_key + "\n")
    with gpumagic.Machine(spec, name="keygen") as m:
        assert m.exec("echo in").stdout == "in\n"


def test_keygen_passphrase_encrypts_the_private_key(tmp_path):
    pair = setup.keygen(tmp_path / "k", passphrase="correct horse", comment="c")
    with pytest.raises(paramiko.PasswordRequiredException):
        paramiko.Ed25519Key.from_private_key(io.StringIO(pair.path.read_text(encoding="ascii")))
    k = paramiko.Ed25519Key.from_private_key(io.StringIO(pair.path.read_text(encoding="ascii")), password="correct horse")
    assert k.get_base64() == pair.public_key.split()[1]
    out = subprocess.run(["ssh-keygen", "-y", "-P", "correct horse", "-f", str(pair.path)],
                         capture_output=True, text=True, check=True, encoding="utf-8").stdout
    assert out.split()[1] == pair.public_key.split()[1]


def test_keygen_magic_prints_the_public_key_to_paste(ip, capsys, tmp_path):
    path = tmp_path / "magic_key"
    ip.run_line_magic("gpu", f"keygen --path {path} --comment me@laptop")
    out = capsys.readouterr().out
    pub = Path(str(path) + ".pub").read_text(encoding="utf-8").strip()
    assert pub in out.splitlines()
    assert "mode 0600" in out
    with pytest.raises(setup.KeyExists):
        ip.run_line_magic("gpu", f"keygen --path {path}")
    assert Path(str(path) + ".pub").read_text(encoding="utf-8").strip() == pub


def test_keygen_to_an_unwritable_path_is_one_line_error_with_hint(ip, capsys):
    # /proc takes no new files, even for root (tests may run as root, where modes do not stop it).
    ip.run_cell("%gpu keygen --path /proc/key")
    out = capsys.readouterr().out
    assert out == ("LocalFileError: cannot write the key to /proc/key: No such file or directory\n"
                   "  hint: choose a path in a directory you can write, e.g. --path ~/.ssh/id_ed25519 "
                   "(the default)\n"), out
    assert not Path("/proc/key.pub").exists()


def test_keygen_under_a_file_names_the_directory_it_cannot_make(tmp_path):
    (tmp_path / "afile").write_text("x", encoding="utf-8")
    with pytest.raises(setup.LocalFileError) as info:
        setup.keygen(tmp_path / "afile" / "id_ed25519")
    assert info.value.message == (f"cannot write the key to {tmp_path}/afile/id_ed25519: cannot make "
                                  f"the directory {tmp_path}/afile: File exists")
    assert (tmp_path / "afile").read_text(encoding="utf-8") == "x"


def test_add_host_with_ssh_dir_a_file_says_it_cannot_read_the_config(tmp_path):
    (tmp_path / ".ssh").write_text("not a directory", encoding="utf-8")
    with pytest.raises(setup.LocalFileError) as info:
        setup.add_host("gpu", "203.0.113.10", home=tmp_path)
    assert info.value.message == f"cannot read {tmp_path}/.ssh/config: Not a directory"
    assert "ls -ld ~/.ssh ~/.ssh/config" in info.value.hint
    assert (tmp_path / ".ssh").read_text(encoding="utf-8") == "not a directory"


def test_add_host_to_an_unwritable_config_is_one_line_error_with_hint(tmp_path):
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "config").symlink_to("/proc/gpumagic-no-such-config")
    with pytest.raises(setup.LocalFileError) as info:
        setup.add_host("gpu", "203.0.113.10", home=tmp_path)
    assert info.value.message == "cannot write /proc/gpumagic-no-such-config: No such file or directory"
    assert info.value.hint.startswith("check that you own /proc and can write there")


def test_public_key_widget_holds_the_key_and_a_copy_button(tmp_path):
    from gpumagic.notebook.widgets import public_key_widget

    pair = setup.keygen(tmp_path / "w", comment='a<b>"c"')
    view = public_key_widget(pair)
    heading, box, button = view.children
    assert box.value == pair.public_key
    assert "navigator.clipboard.writeText" in button.value
    assert 'a&lt;b&gt;&quot;c&quot;' in button.value  # the comment cannot break out of the HTML


# -- case 3 against real servers: %gpu connect with a pasted line ------------------------


def test_connect_pasted_ssh_line_reaches_test_server(sshd):
    line = f"ssh -p {sshd.port} -i {sshd.client_key} -o ServerAliveInterval=7 {sshd.user}@{sshd.host}"
    with gpumagic.connect(line) as m:
        assert (m.spec.hostname, m.spec.port, m.spec.user) == (sshd.host, sshd.port, sshd.user)
        assert m.spec.identity_files[0] == str(sshd.client_key)
        assert m.spec.server_alive_interval == 7
        assert m.exec("echo reached").stdout == "reached\n"


def test_connect_pasted_ssh_line_with_jump_goes_through_the_jump_host(sshd):
    # -J testgpu: the hop is the main server itself (alias from ~/.ssh/config), which then
    # opens a direct-tcpip channel to the target (the same server, by address).
    line = f"ssh -J testgpu {sshd.user}@{sshd.host} -p {sshd.port} -i {sshd.client_key}"
    with gpumagic.connect(line) as m:
        assert m.spec.proxy_jump == ("testgpu",)
        assert m.exec("echo via-jump").stdout == "via-jump\n"
        assert len(m.connection._hops) == 1 and m.connection._hops[0].is_connected


def test_host_fields_of_a_pasted_line_and_of_a_target():
    from gpumagic.keys import host_fields

    assert host_fields("ssh -p 41022 -i ~/.ssh/k -J bastion -o HostName=10.0.0.5 -o ServerAliveInterval=15 root@gpu") == dict(
        hostname="10.0.0.5", port=41022, user="root", key="~/.ssh/k", jump="bastion",
        options={"ServerAliveInterval": "15"})
    assert host_fields("ubuntu@203.0.113.10:2222") == dict(hostname="203.0.113.10", port=2222, user="ubuntu",
                                                            key=None, jump=None, options={})
    assert host_fields("203.0.113.10")["port"] is None


def test_connect_magic_pasted_unquoted_with_save_writes_block_and_connects_by_name(ip, capsys, sshd):
    ip.run_line_magic("gpu", f"connect ssh -p {sshd.port} -i {sshd.client_key} "
                             f"{sshd.user}@{sshd.host} -o StrictHostKeyChecking=no --save pasted")
    out = capsys.readouterr().out
    assert "ignored -o StrictHostKeyChecking=no" in out
    assert "connected to pasted" in out
    cfg = CLIENT_HOME / ".ssh" / "config"
    g = _ssh_G(cfg, "pasted")
    assert (g["hostname"], g["port"], g["user"]) == (sshd.host, str(sshd.port), sshd.user)
    assert g["identityfile"] == str(sshd.client_key)
    assert out.index("connected to pasted") < out.index("added to")  # saved once it worked
    m = ip._gpumagic.fleet.get("pasted")
    assert m.name == "pasted" and m.spec.port == sshd.port
    ip.run_cell_magic("remote", "--out r", "echo saved-host")
    assert ip.user_ns["r"].stdout == "saved-host\n"
    # The real OpenSSH client logs in with the saved block (as VS Code Remote-SSH would).
    plain = subprocess.run(["ssh", "-F", str(cfg), "-o", "BatchMode=yes",
                            "-o", f"UserKnownHostsFile={CLIENT_HOME / '.ssh' / 'known_hosts'}",
                            "pasted", "echo", "plain-ssh"], capture_output=True, text=True, timeout=30, encoding="utf-8")
    assert plain.stdout == "plain-ssh\n", plain.stderr
    # Saving again the same way changes nothing.
    before = cfg.read_bytes()
    ip.run_line_magic("gpu", f'connect "ssh -p {sshd.port} -i {sshd.client_key} {sshd.user}@{sshd.host}" --save pasted')
    assert "nothing changed" in capsys.readouterr().out
    assert cfg.read_bytes() == before


def test_connect_save_keeps_the_pasted_lines_o_options_over_gpumagics_defaults(ip, capsys, sshd):
    """``-o ServerAliveInterval=10`` pasted with ``--save`` is what ``ssh -G`` reads from the
    block (it wrote gpumagic's default 30), as are the other keywords that have a default."""
    ip.run_line_magic("gpu", f"connect ssh -p {sshd.port} -i {sshd.client_key} {sshd.user}@{sshd.host} "
                             "-o ServerAliveInterval=10 -o ServerAliveCountMax=5 -o IdentitiesOnly=no "
                             "-o ConnectTimeout=20 --save withopts")
    assert "connected to withopts" in capsys.readouterr().out
    g = _ssh_G(CLIENT_HOME / ".ssh" / "config", "withopts")
    assert (g["serveraliveinterval"], g["serveralivecountmax"], g["identitiesonly"], g["connecttimeout"]) == (
        "10", "5", "no", "20")
    assert (g["port"], g["identityfile"]) == (str(sshd.port), str(sshd.client_key))


def test_connect_save_writes_no_block_when_the_pasted_line_fails(ip, sshd):
    from gpumagic.errors import ConnectionRefused
    from gpumagic.ssh.sandbox import free_port

    cfg = CLIENT_HOME / ".ssh" / "config"
    before = cfg.read_bytes()
    with pytest.raises(ConnectionRefused):
        ip.run_line_magic("gpu", f"connect ssh -p {free_port()} {sshd.user}@{sshd.host} --save typo")
    assert cfg.read_bytes() == before


def test_connect_save_refuses_a_different_existing_block_before_connecting(ip, sshd):
    cfg = CLIENT_HOME / ".ssh" / "config"
    before = cfg.read_bytes()
    with pytest.raises(setup.HostExists):  # Host testgpu exists with other settings
        ip.run_line_magic("gpu", f"connect ssh -p {sshd.port} root@192.0.2.1 --save testgpu")
    assert cfg.read_bytes() == before
    assert ip._gpumagic.fleet.machines == {}


def test_connect_pasted_line_to_unknown_host_key_hints_the_same_line(keygen_server):
    s = keygen_server  # its host key is not in the client's known_hosts
    with pytest.raises(UnknownHostKey) as e:
        gpumagic.connect(f"ssh -p {s.port} -i {s.client_key} {s.user}@{s.host}")
    assert "same line again with --trust-new-host" in e.value.hint
    assert e.value.fingerprint == s.host_key_fingerprint


def test_keygen_magic_passphrase_is_asked_twice_without_echo(ip, capsys, monkeypatch, tmp_path):
    answers = iter(["s3cret pass", "s3cret pass"])
    monkeypatch.setattr("getpass.getpass", lambda prompt="": next(answers))
    path = tmp_path / "enc"
    ip.run_line_magic("gpu", f"keygen --path {path} --passphrase")
    assert "s3cret" not in capsys.readouterr().out
    paramiko.Ed25519Key.from_private_key(io.StringIO(Path(path).read_text(encoding="ascii")), password="s3cret pass")
    answers = iter(["one", "two"])
    from IPython.core.error import UsageError

    with pytest.raises(UsageError):
        ip.run_line_magic("gpu", f"keygen --path {tmp_path / 'other'} --passphrase")
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("sub", ["keygen", "add-host", "install-key", "connect"])
def test_subcommand_dash_h_prints_its_options(ip, capsys, sub):
    ip.run_line_magic("gpu", f"{sub} -h")
    out = capsys.readouterr().out
    assert out.startswith(f"usage: %gpu {sub}")
    assert {"keygen": "--passphrase", "add-host": "--hostname", "install-key": "--trust-new-host",
            "connect": "--save"}[sub] in out


def test_split_pasted_ssh_separates_gpumagic_options_on_either_side():
    from gpumagic.notebook.magics import split_pasted_ssh

    assert split_pasted_ssh("--trust-new-host ssh -p 41022 root@h --save gpu") == (
        "ssh -p 41022 root@h", "--trust-new-host --save gpu")
    assert split_pasted_ssh('"ssh -p 41022 -i \'~/my key\' root@h" --name g') == (
        "ssh -p 41022 -i '~/my key' root@h", "--name g")
    assert split_pasted_ssh("mygpu --cwd /data") == (None, "mygpu --cwd /data")


def test_add_host_magic_then_connect_by_name(ip, capsys, sshd):
    ip.run_line_magic("gpu", f"add-host byname --hostname {sshd.host} -p {sshd.port} "
                             f"-l {sshd.user} -i {sshd.client_key}")
    out = capsys.readouterr().out
    assert "Host byname" in out and "ServerAliveInterval 30" in out
    ip.run_line_magic("gpu", "connect byname")
    m = ip._gpumagic.fleet.get("byname")
    assert m.exec("echo named").stdout == "named\n"
    assert (m.spec.server_alive_interval, m.spec.server_alive_count_max) == (30, 3)


# -- case 4: install-key over a password login -------------------------------------------


@pytest.fixture(scope="module")
def password_server():
    """An sshd that allows a password login for a throwaway local user (root only)."""
    if os.geteuid() != 0:
        pytest.skip("install-key tests create a local user with a password; that needs root")
    if not (shutil.which("useradd") and shutil.which("chpasswd")):
        pytest.skip("install-key tests need useradd and chpasswd to make a password-login user")
    name = f"gpmk{os.getpid()}"
    base = Path(tempfile.mkdtemp(prefix="gpumagic-pwuser-"))
    base.chmod(0o755)  # the user's session must reach its home
    home = base / "home"
    if not _retry_locked(["useradd", "-m", "-d", str(home), "-s", "/bin/sh", name]):
        shutil.rmtree(base, ignore_errors=True)
        pytest.skip(f"useradd could not create the password-login user {name}")
    password = secrets.token_urlsafe(18)
    server = None
    try:
        subprocess.run(["chpasswd"], input=f"{name}:{password}\n".encode(), check=True)
        server = SshServer(base / "server", alias="pwlogin", extra_config=(
            f"Match User {name}\n  PasswordAuthentication yes\n"
            "  AuthorizedKeysFile .ssh/authorized_keys\n")).start()
        yield server, name, password, home
    finally:
        if server is not None:
            server.stop()
        _end_processes_of(name)
        if not _retry_locked(["userdel", "-f", "-r", name]):
            print(f"warning: could not remove test user {name}; run `userdel -r {name}`")
        shutil.rmtree(base, ignore_errors=True)


def _end_processes_of(user: str) -> None:
    """Stop what this test's logins left running as ``user`` (session shells still exiting)."""
    import pwd
    import signal

    uid = pwd.getpwnam(user).pw_uid
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    os.kill(int(entry), signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                pass


def _retry_locked(argv) -> bool:
    """Run useradd/userdel, retrying while another process holds /etc/passwd's lock."""
    import time

    for attempt in range(20):
        r = subprocess.run(argv, capture_output=True, text=True, encoding="utf-8")
        if r.returncode == 0 or not any(w in r.stderr for w in ("lock", "currently used")):
            return r.returncode == 0
        time.sleep(0.1 * (attempt + 1))
    return False


@pytest.fixture
def client(tmp_path, password_server):
    """A client HOME with a fresh key and the password server's host key trusted."""
    server = password_server[0]
    home = tmp_path / "client"
    pair = setup.keygen(comment="install-key-test", home=home)
    (home / ".ssh" / "known_hosts").write_text(server.known_hosts.read_text(encoding="utf-8"), encoding="utf-8")
    return home, pair


class Prompt:
    def __init__(self, answer):
        self.answer, self.calls = answer, 0

    def __call__(self, text):
        self.calls += 1
        return self.answer


def test_install_key_twice_one_line_mode_0600_and_key_login_works(password_server, client):
    server, user, password, rhome = password_server
    home, pair = client
    target = f"{user}@{server.host}:{server.port}"
    shutil.rmtree(rhome / ".ssh", ignore_errors=True)
    ask = Prompt(password)
    first = setup.install_key(target, password_prompt=ask, home=home)
    assert (first.state, first.used_password, ask.calls) == ("added", True, 1)
    second = setup.install_key(target, password_prompt=ask, home=home)
    assert (second.state, second.used_password, ask.calls) == ("present", False, 1)
    third = setup.install_key(target, password_prompt=ask, home=home, try_key_first=False)
    assert (third.state, third.used_password, ask.calls) == ("present", True, 2)
    ak = rhome / ".ssh" / "authorized_keys"
    blob = pair.public_key.split()[1]
    assert ak.read_text(encoding="utf-8").count(blob) == 1
    assert _mode(ak) == 0o600 and _mode(rhome / ".ssh") == 0o700
    assert os.stat(ak).st_uid == os.stat(rhome).st_uid != 0  # written as that user
    with gpumagic.connect(target, key=str(pair.path), home=str(home)) as m:
        assert m.exec("id -un").stdout.strip() == user


def test_install_key_appends_after_a_last_line_without_newline(password_server, client):
    server, user, password, rhome = password_server
    home, pair = client
    ak = rhome / ".ssh" / "authorized_keys"
    ak.parent.mkdir(mode=0o700, exist_ok=True)
    shutil.chown(ak.parent, user, user)  # the user's, whichever test made it first (the login chmods it)
    other = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIEhXdfgdsIfmHK+9ysqALkyJJSkiWpBKa5W1B1JmJsPX other"
    ak.write_text(other, encoding="utf-8")  # no trailing newline
    shutil.chown(ak, user, user)
    r = setup.install_key(f"{user}@{server.host}:{server.port}", password_prompt=Prompt(password),
                          home=home)
    assert r.state == "added"
    assert ak.read_text(encoding="utf-8") == other + "\n" + pair.public_key + "\n"


def test_install_key_wrong_password_refused_without_echoing_it(password_server, client):
    server, user, _, _ = password_server
    home, _ = client
    wrong = "not-the-password-" + secrets.token_hex(4)
    with pytest.raises(AuthenticationFailed) as e:
        setup.install_key(f"{user}@{server.host}:{server.port}", password_prompt=Prompt(wrong),
                          home=home, try_key_first=False)
    assert "refused the password" in str(e.value)
    assert wrong not in str(e.value)


@pytest.mark.parametrize("raised", [EOFError, NotImplementedError])
def test_install_key_where_no_password_can_be_asked_says_so_in_one_line(password_server, client, raised):
    # IPython with stdin at EOF (getpass -> EOFError), a notebook frontend without an input box
    # (ipykernel's StdinNotImplementedError): a traceback before
    server, user, _, _ = password_server
    home, _ = client

    def prompt(text):
        raise raised("no input")

    with pytest.raises(AuthenticationFailed) as e:
        setup.install_key(f"{user}@{server.host}:{server.port}", password_prompt=prompt, home=home,
                          try_key_first=False)
    assert e.value.message == (f"cannot ask for the password of {user}@{server.host}:{server.port}: "
                               "there is no terminal or input box here")
    assert "console" in e.value.hint


def test_install_key_asks_no_password_before_the_host_key_is_trusted(password_server, tmp_path):
    server, user, password, _ = password_server
    home = tmp_path / "fresh"
    setup.keygen(home=home)
    ask = Prompt(password)
    with pytest.raises(UnknownHostKey):
        setup.install_key(f"{user}@{server.host}:{server.port}", password_prompt=ask, home=home)
    assert ask.calls == 0


def test_install_key_magic_uses_getpass_once_and_never_prints_it(ip, capsys, monkeypatch,
                                                                   password_server, client):
    server, user, password, rhome = password_server
    home, pair = client
    monkeypatch.setenv("HOME", str(home))
    ask = Prompt(password)
    monkeypatch.setattr("getpass.getpass", ask)
    shutil.rmtree(rhome / ".ssh", ignore_errors=True)
    ip.run_line_magic("gpu", f'install-key "ssh -p {server.port} {user}@{server.host}"')
    out = capsys.readouterr()
    assert ask.calls == 1
    assert f"added key {pair.fingerprint}" in out.out and "key login" in out.out
    assert password not in out.out + out.err
    assert password not in "".join(str(v) for v in ip.user_ns.get("_oh", {}).values())


# -- tutorial ----------------------------------------------------------------------------


def test_tutorial_00_first_setup_runs_and_shows_each_step(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    from gpumagic.__main__ import run_notebook

    # The kernel runs in example-notebooks/: make this checkout importable there.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))

    out = run_notebook(REPO / "example-notebooks" / "00-first-setup.ipynb", tmp_path)
    nb = nbformat.read(out, as_version=4)
    text = "\n".join(o.get("text", "") or o.get("data", {}).get("text/plain", "")
                     for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "public key:" in text and "ssh-ed25519 " in text
    keygen_out = [o for c in nb.cells if c.source.startswith("%gpu keygen") for o in c.outputs]
    assert "application/vnd.jupyter.widget-view+json" in keygen_out[0]["data"]
    assert "added to" in text and "Host mybox" in text
    assert "connected to mybox" in text
    assert "hello from mybox" in text
    assert "connected to pasted" in text
    assert not any(o.get("output_type") == "error" for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []))


def test_keygen_path_expands_environment_variables(tmp_path, monkeypatch, ip):
    # IPython leaves "$HOME" in a magic's line as typed (no Python variable of that name).
    monkeypatch.setenv("GM_KEYDIR", str(tmp_path))
    ip.run_line_magic("gpu", "keygen --path $GM_KEYDIR/k1")
    assert (tmp_path / "k1").stat().st_mode & 0o777 == 0o600
    assert not Path("$GM_KEYDIR").exists()


def test_local_file_wrapup_and_kernel_errors_live_in_errors_and_keep_their_old_names():
    # issue 15 item 5: one exception family in gpumagic/errors.py; old imports still work.
    from gpumagic import errors, wrapup
    from gpumagic.remote import kernel

    for name, module in (("LocalFileError", setup), ("WrapupError", wrapup), ("KernelError", kernel)):
        cls = getattr(errors, name)
        assert cls.__module__ == "gpumagic.errors" and issubclass(cls, errors.GpumagicError)
        assert getattr(module, name) is cls
