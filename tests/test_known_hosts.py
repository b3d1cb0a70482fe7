"""known_hosts: exact [host]:port matching, trusting, forgetting; against a real sshd."""

import shutil

import paramiko
import pytest

import gpumagic
from gpumagic import known_hosts
from gpumagic.errors import ChangedHostKey, UnknownHostKey
from gpumagic.sandbox import make_keypair


def other_key(tmp_path, name="other"):
    make_keypair(tmp_path / name)
    return paramiko.Ed25519Key.from_private_key_file(str(tmp_path / name))


def server_key(sshd):
    parts = (sshd.host_key.parent / (sshd.host_key.name + ".pub")).read_text().split()
    return f"{parts[0]} {parts[1]}"


def test_port_22_entry_is_never_used_for_another_port(sshd, tmp_path):
    # known_hosts holds the server's real key for port 22 of the address, and a different
    # key for [address]:port -> connecting to address:port must see the *changed* key.
    kh = tmp_path / "known_hosts"
    wrong = other_key(tmp_path)
    line22 = f"{sshd.host} {server_key(sshd)}\n"
    line_port = f"[{sshd.host}]:{sshd.port} {wrong.get_name()} {wrong.get_base64()}\n"
    kh.write_text(line22 + line_port)
    spec = sshd.spec()
    from dataclasses import replace
    spec = replace(spec, known_hosts=str(kh))
    m = gpumagic.Machine(spec)
    with pytest.raises(ChangedHostKey) as e:
        m.connect()
    assert f"{sshd.host}:{sshd.port}" in e.value.message
    assert f"%gpu forget {sshd.host}:{sshd.port}" in e.value.hint
    assert kh.read_text() == line22 + line_port  # nothing rewritten


def test_trusting_a_new_port_leaves_other_lines_untouched(sshd, tmp_path):
    kh = tmp_path / "known_hosts"
    wrong = other_key(tmp_path)
    before = (f"# my hosts\n{sshd.host} {wrong.get_name()} {wrong.get_base64()}\n"
              f"|1|c2FsdHNhbHRzYWx0c2FsdHNhbHQ=|aGFzaGhhc2hoYXNoaGFzaGhhc2g= ssh-ed25519 AAAA\n")
    kh.write_text(before)
    from dataclasses import replace
    spec = replace(sshd.spec(), known_hosts=str(kh))
    with pytest.raises(UnknownHostKey) as e:
        gpumagic.Machine(spec).connect()
    assert e.value.fingerprint.startswith("SHA256:")
    assert "--trust-new-host" in e.value.hint
    assert kh.read_text() == before  # refusing wrote nothing
    m = gpumagic.Machine(spec, trust_new_host=True).connect()
    m.close()
    after = kh.read_text()
    assert after.startswith(before)
    assert after[len(before):] == f"[{sshd.host}]:{sshd.port} {server_key(sshd)}\n"
    assert "trusted new host" in m.connection.notes[0]


def test_unknown_host_message_shows_the_sha256_fingerprint_ssh_prints(sshd, tmp_path):
    from dataclasses import replace
    spec = replace(sshd.spec(), known_hosts=str(tmp_path / "none"))
    with pytest.raises(UnknownHostKey) as e:
        gpumagic.Machine(spec).connect()
    want = known_hosts.fingerprint(paramiko.Ed25519Key.from_private_key_file(str(sshd.host_key)))
    assert want in e.value.message
    if shutil.which("ssh-keygen"):
        import subprocess
        out = subprocess.run(["ssh-keygen", "-lf", str(sshd.host_key) + ".pub"],
                             capture_output=True, text=True).stdout
        assert want in out
    assert not (tmp_path / "none").exists()


def test_forget_removes_only_that_host_and_port_like_ssh_keygen_R(tmp_path):
    k = other_key(tmp_path)
    kh = tmp_path / "known_hosts"
    a = f"203.0.113.10 {k.get_name()} {k.get_base64()}\n"
    b = f"[203.0.113.10]:41022 {k.get_name()} {k.get_base64()}\n"
    c = f"other {k.get_name()} {k.get_base64()}\n"
    kh.write_text(a + b + c)
    assert known_hosts.forget(kh, "203.0.113.10", 41022) == 1
    assert kh.read_text() == a + c
    assert (tmp_path / "known_hosts.old").read_text() == a + b + c
    assert known_hosts.forget(kh, "203.0.113.10", 41022) == 0


def test_hashed_entries_are_matched_and_forgotten(tmp_path):
    k = other_key(tmp_path)
    name = "[203.0.113.10]:41022"
    hashed = paramiko.HostKeys.hash_host(name)
    kh = tmp_path / "known_hosts"
    kh.write_text(f"{hashed} {k.get_name()} {k.get_base64()}\n")
    assert known_hosts.lookup(kh, "203.0.113.10", 41022)[0] == k
    assert known_hosts.lookup(kh, "203.0.113.10", 22) == []
    assert known_hosts.forget(kh, "203.0.113.10", 41022) == 1
    assert kh.read_text() == ""
