"""known_hosts: matching, trusting, forgetting, revoked keys, host certificates; against a real sshd.

The whole kind of case, judged by the real ssh client, is in test_known_hosts_conformance.py;
the tests here name the issue's cases and the parts ssh cannot judge alone.
"""

import base64
import os
import shutil
import struct
import subprocess
import sys
import time
from dataclasses import replace

import paramiko
import pytest
from test_known_hosts_conformance import (
    RoutedConnection,
    gpumagic_verdict,
    keygen,
    sign_host_key,
    relay_path,
    ssh_verdict,
    start_server,
)

import gpumagic
from gpumagic.ssh import known_hosts
from gpumagic.errors import ChangedHostKey, RevokedHostKey, UnknownHostKey
from gpumagic.ssh.hosts import HostSpec
from gpumagic.ssh.connection import load_private_key
from gpumagic.ssh.sandbox import make_keypair


def other_key(tmp_path, name="other"):
    make_keypair(tmp_path / name)
    return load_private_key(str(tmp_path / name))


def server_key(sshd):
    parts = (sshd.host_key.parent / (sshd.host_key.name + ".pub")).read_text(encoding="utf-8").split()
    return f"{parts[0]} {parts[1]}"


def test_port_22_entry_is_never_used_for_another_port(sshd, tmp_path):
    # known_hosts holds the server's real key for port 22 of the address, and a different
    # key for [address]:port -> connecting to address:port must see the *changed* key (ssh
    # looks under the bare name only when nothing is stored for [address]:port).
    kh = tmp_path / "known_hosts"
    wrong = other_key(tmp_path)
    line22 = f"{sshd.host} {server_key(sshd)}\n"
    line_port = f"[{sshd.host}]:{sshd.port} {wrong.get_name()} {wrong.get_base64()}\n"
    kh.write_text(line22 + line_port, encoding="utf-8")
    spec = sshd.spec()
    spec = replace(spec, known_hosts=str(kh))
    m = gpumagic.Machine(spec)
    with pytest.raises(ChangedHostKey) as e:
        m.connect()
    assert f"{sshd.host}:{sshd.port}" in e.value.message
    assert f"%gpu forget {sshd.host}:{sshd.port}" in e.value.hint
    assert kh.read_text(encoding="utf-8") == line22 + line_port  # nothing rewritten


def test_trusting_a_new_port_leaves_other_lines_untouched(sshd, tmp_path):
    kh = tmp_path / "known_hosts"
    wrong = other_key(tmp_path)
    before = (f"# my hosts\n{sshd.host} {wrong.get_name()} {wrong.get_base64()}\n"
              f"|1|c2FsdHNhbHRzYWx0c2FsdHNhbHQ=|aGFzaGhhc2hoYXNoaGFzaGhhc2g= ssh-ed25519 AAAA\n")
    kh.write_text(before, encoding="utf-8")
    spec = replace(sshd.spec(), known_hosts=str(kh))
    with pytest.raises(UnknownHostKey) as e:
        gpumagic.Machine(spec).connect()
    assert e.value.fingerprint.startswith("SHA256:")
    assert "--trust-new-host" in e.value.hint
    assert kh.read_text(encoding="utf-8") == before  # refusing wrote nothing
    m = gpumagic.Machine(spec, trust_new_host=True).connect()
    m.close()
    after = kh.read_text(encoding="utf-8")
    assert after.startswith(before)
    assert after[len(before):] == f"[{sshd.host}]:{sshd.port} {server_key(sshd)}\n"
    assert "trusted new host" in m.connection.notes[0]


def test_unknown_host_message_shows_the_sha256_fingerprint_ssh_prints(sshd, tmp_path):
    spec = replace(sshd.spec(), known_hosts=str(tmp_path / "none"))
    with pytest.raises(UnknownHostKey) as e:
        gpumagic.Machine(spec).connect()
    want = known_hosts.fingerprint(load_private_key(str(sshd.host_key)))
    assert want in e.value.message
    if shutil.which("ssh-keygen"):
        out = subprocess.run(["ssh-keygen", "-lf", str(sshd.host_key) + ".pub"],
                             capture_output=True, text=True, encoding="utf-8").stdout
        assert want in out
    assert not (tmp_path / "none").exists()


def test_forget_removes_only_that_host_and_port_like_ssh_keygen_R(tmp_path):
    k = other_key(tmp_path)
    kh = tmp_path / "known_hosts"
    a = f"203.0.113.10 {k.get_name()} {k.get_base64()}\n"
    b = f"[203.0.113.10]:41022 {k.get_name()} {k.get_base64()}\n"
    c = f"other {k.get_name()} {k.get_base64()}\n"
    kh.write_text(a + b + c, encoding="utf-8")
    assert known_hosts.forget(kh, "203.0.113.10", 41022) == 1
    assert kh.read_text(encoding="utf-8") == a + c
    assert (tmp_path / "known_hosts.old").read_text(encoding="utf-8") == a + b + c
    assert known_hosts.forget(kh, "203.0.113.10", 41022) == 0


def test_hashed_entries_are_matched_and_forgotten(tmp_path):
    k = other_key(tmp_path)
    name = "[203.0.113.10]:41022"
    hashed = paramiko.HostKeys.hash_host(name)
    kh = tmp_path / "known_hosts"
    kh.write_text(f"{hashed} {k.get_name()} {k.get_base64()}\n", encoding="utf-8")
    assert known_hosts.lookup(kh, "203.0.113.10", 41022)[0] == k
    assert known_hosts.lookup(kh, "203.0.113.10", 22) == []
    assert known_hosts.forget(kh, "203.0.113.10", 41022) == 1
    assert kh.read_text(encoding="utf-8") == ""


# -- OpenSSH 9.x conformance: the cases (the whole kind is in
#    test_known_hosts_conformance.py, judged by the real ssh client) ---------------------

needs_ssh = pytest.mark.skipif(not (shutil.which("ssh") and shutil.which("ssh-keygen")),
                               reason="needs the OpenSSH client")


@needs_ssh
def test_hostname_in_capitals_finds_the_line_ssh_wrote_for_it(sshd, tmp_path):
    # Issue 5: `HostName GPU-Box.example`, and the known_hosts line OpenSSH itself wrote on
    # first contact (ssh -o StrictHostKeyChecking=accept-new, reaching the test sshd
    # through a ProxyCommand, so the name needs no DNS).
    kh = tmp_path / "known_hosts"
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host box\n  HostName GPU-Box.example\n  Port 22\n  User {sshd.user}\n"
                   f"  IdentityFile {sshd.client_key}\n  IdentitiesOnly yes\n"
                   f"  UserKnownHostsFile {kh}\n  GlobalKnownHostsFile /dev/null\n"
                   f"  StrictHostKeyChecking accept-new\n  BatchMode yes\n"
                   f"  ProxyCommand {sys.executable} {relay_path()} 127.0.0.1 {sshd.port}\n", encoding="utf-8")
    r = subprocess.run(["ssh", "-F", str(cfg), "box", "true"], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, SHELL="/bin/sh"), encoding="utf-8")
    assert r.returncode == 0, r.stderr
    assert kh.read_text(encoding="utf-8").split()[0] == "gpu-box.example"  # what ssh wrote
    verdict, err = gpumagic_verdict(sshd, kh, "GPU-Box.example", 22)
    assert verdict == "accept", err
    assert known_hosts.lookup(kh, "GPU-Box.example", 22)


@needs_ssh
def test_trust_new_host_writes_the_line_ssh_finds_for_a_capitalised_name(sshd, tmp_path):
    # Issue 5: --trust-new-host with HostName GPU-Box.example on port 2222 must write
    # `[gpu-box.example]:2222 ...`, which ssh then accepts.
    kh = tmp_path / "known_hosts"
    assert ssh_verdict(sshd, kh, "GPU-Box.example", 2222)[0] == "unknown"
    spec = HostSpec(alias="box", hostname="GPU-Box.example", port=2222, user=sshd.user,
                    identity_files=(str(sshd.client_key),), identities_only=True,
                    connect_timeout=10, known_hosts=str(kh))
    c = RoutedConnection(spec, sshd.port, trust_new_host=True)
    c.open()
    c.close()
    assert kh.read_text(encoding="utf-8") == f"[gpu-box.example]:2222 {server_key(sshd)}\n"
    assert "trusted new host [gpu-box.example]:2222" in c.notes[0]
    assert ssh_verdict(sshd, kh, "GPU-Box.example", 2222)[0] == "accept"


@pytest.mark.parametrize("trust", [False, True], ids=["plain", "trust-new-host"])
def test_revoked_host_key_is_refused_naming_the_line(sshd, tmp_path, trust):
    # Issue 6: a normal line for the server's key plus `@revoked * <that key>`: OpenSSH
    # refuses ("REVOKED HOST KEY DETECTED"), and so must gpumagic, even with --trust-new-host.
    kh = tmp_path / "known_hosts"
    text = (f"# mine\n[{sshd.host}]:{sshd.port} {server_key(sshd)}\n"
            f"@revoked * {server_key(sshd)}\n")
    kh.write_text(text, encoding="utf-8")
    spec = replace(sshd.spec(), known_hosts=str(kh))
    with pytest.raises(RevokedHostKey) as e:
        gpumagic.Machine(spec, trust_new_host=trust).connect()
    assert f"{kh}:3" in e.value.message and e.value.line == f"{kh}:3"
    assert "REVOKED" in e.value.message and "\n" not in e.value.message
    assert e.value.fingerprint == sshd.host_key_fingerprint
    assert "@revoked" in e.value.hint and "hint:" in str(e.value)
    assert kh.read_text(encoding="utf-8") == text


def test_revoked_line_for_another_host_does_not_apply(sshd, tmp_path):
    kh = tmp_path / "known_hosts"
    kh.write_text(f"[{sshd.host}]:{sshd.port} {server_key(sshd)}\n@revoked other.example {server_key(sshd)}\n", encoding="utf-8")
    m = gpumagic.Machine(replace(sshd.spec(), known_hosts=str(kh))).connect()
    assert m.run("echo ok", quiet=True).stdout.strip() == "ok"
    m.close()


def test_cert_authority_line_is_never_taken_as_the_host_key(sshd, tmp_path):
    # Issue 6: the server's plain key, listed only as a @cert-authority key, is unknown,
    # with a one-line note saying why; --trust-new-host then adds a normal line.
    kh = tmp_path / "known_hosts"
    text = f"@cert-authority * {server_key(sshd)}\n"
    kh.write_text(text, encoding="utf-8")
    spec = replace(sshd.spec(), known_hosts=str(kh))
    with pytest.raises(UnknownHostKey) as e:
        gpumagic.Machine(spec).connect()
    assert f"{kh}:1 is a @cert-authority line" in e.value.message
    assert "sent no certificate" in e.value.message and "\n" not in e.value.message
    assert kh.read_text(encoding="utf-8") == text


def test_changed_key_message_names_the_offending_line(sshd, tmp_path):
    kh = tmp_path / "known_hosts"
    wrong = other_key(tmp_path)
    kh.write_text(f"# x\n[{sshd.host}]:{sshd.port} {wrong.get_name()} {wrong.get_base64()}\n", encoding="utf-8")
    with pytest.raises(ChangedHostKey) as e:
        gpumagic.Machine(replace(sshd.spec(), known_hosts=str(kh))).connect()
    assert f"{kh}:2 holds a different ssh-ed25519 key" in e.value.message


def test_key_stored_under_another_type_is_changed_not_unknown(sshd, tmp_path):
    # OpenSSH: any other key stored for the name, whatever its type, is "CHANGED" (it
    # names the "Offending ECDSA key"); --trust-new-host must not add the new one.
    kh = tmp_path / "known_hosts"
    ecdsa = keygen(tmp_path / "ecdsa", "ecdsa")
    text = f"[{sshd.host}]:{sshd.port} {ecdsa}\n"
    kh.write_text(text, encoding="utf-8")
    with pytest.raises(ChangedHostKey) as e:
        gpumagic.Machine(replace(sshd.spec(), known_hosts=str(kh)), trust_new_host=True).connect()
    assert "ecdsa-sha2-nistp256 key" in e.value.message
    assert kh.read_text(encoding="utf-8") == text


@pytest.mark.parametrize("broken", ["{t} AAAAC3NzaC1lZDI1NTE5AAAAI!!!notbase64", "{t} {b40}", "{t}",
                                    "{t} AAAAC3NzaC1lZDI1NTE5", "{t} ssh-rsa {b}"],
                         ids=["bad-base64", "cut-short", "no-key", "cut-after-type", "type-mismatch"])
def test_broken_line_for_the_target_is_skipped_as_ssh_skips_it(sshd, tmp_path, broken):
    # Issue 7: a broken or cut-short line used to raise a traceback; ssh skips it.
    kh = tmp_path / "known_hosts"
    typ, blob = server_key(sshd).split()
    line = broken.format(t=f"[{sshd.host}]:{sshd.port} {typ}", b40=blob[:40], b=blob)
    kh.write_text(line + "\n", encoding="utf-8")
    spec = replace(sshd.spec(), known_hosts=str(kh))
    with pytest.raises(UnknownHostKey):
        gpumagic.Machine(spec).connect()
    kh.write_text(line + "\n" + f"[{sshd.host}]:{sshd.port} {server_key(sshd)}\n", encoding="utf-8")
    gpumagic.Machine(spec).connect().close()


def test_garbage_files_never_raise(tmp_path):
    import random

    rnd = random.Random(7)
    k = other_key(tmp_path)
    good = f"h {k.get_name()} {k.get_base64()}"
    kh = tmp_path / "known_hosts"
    alphabet = "h|1@![]*?,: \t\r#=+/AZaz09-" + "\x00\xff"
    for i in range(300):
        lines = [good[:rnd.randrange(len(good) + 1)] + "".join(rnd.choice(alphabet) for _ in range(rnd.randrange(12)))
                 for _ in range(4)]
        data = "\n".join(lines).encode("latin-1") + bytes(rnd.randrange(256) for _ in range(rnd.randrange(4)))
        kh.write_bytes(data)
        for port in (22, 2222):
            v = known_hosts.check(kh, "h", port, k)
            assert v.status in ("accept", "unknown", "changed", "revoked")
            known_hosts.host_key_algorithms(kh, "h", port, ("ssh-ed25519", "rsa-sha2-512"))
        known_hosts.forget(kh, "h", 22)
    kh.write_bytes(b"\xff\xfe h ssh-ed25519 \x00\n" * 3)
    assert known_hosts.check(kh, "h", 22, k).status == "unknown"
    kh.unlink()
    kh.mkdir()  # unreadable as a file: ssh reads nothing from it, and so does gpumagic
    assert known_hosts.check(kh, "h", 22, k).status == "unknown"


@pytest.mark.parametrize("name,patterns,want", [
    ("gpu-box.example", "gpu-box.example", 1),
    ("gpu-box.example", "GPU-Box.Example", 1),
    ("gpu-box.example", "a,b,gpu-box.example", 1),
    ("gpu-box.example", "*.example", 1),
    ("gpu-box.example", "*", 1),
    ("gpu-box.example", "gpu-bo?.example", 1),
    ("gpu-box.example", "gpu-bo?.exampl", 0),
    ("gpu-box.example", "*.example,!gpu-box.example", -1),
    ("gpu-box.example", "!gpu-box.example,*.example", -1),
    ("gpu-box.example", "!other", 0),
    ("[gpu-box.example]:2222", "[*.example]:2222", 1),
    ("[gpu-box.example]:2222", "[*.example]:22", 0),
    ("[gpu-box.example]:2222", "gpu-box.example", 0),
    ("gpu-box.example", "[gpu-box.example]:22", 0),
    ("a.b", "a?b", 1),   # '.' is literal, '?' is one character
    ("axb", "a.b", 0),
])
def test_patterns_follow_match_c(name, patterns, want):
    assert known_hosts.match_hostname(name, patterns) == want


# -- host certificates (checked by gpumagic: paramiko negotiates and parses them only) -----

def _string(b: bytes) -> bytes:
    return struct.pack(">I", len(b)) + b


def make_cert(ca: paramiko.PKey, key: paramiko.PKey, *, cert_type=2, principals=("h",),
              after=0, before=2**64 - 1, critical=b"") -> bytes:
    """An ssh-ed25519 certificate built field by field (PROTOCOL.certkeys), signed by ``ca``."""
    pk = paramiko.Message(key.asbytes())
    pk.get_text()
    body = (_string(b"ssh-ed25519-cert-v01@openssh.com") + _string(b"n" * 32) + _string(pk.get_binary())
            + struct.pack(">QI", 1, cert_type) + _string(b"id")
            + _string(b"".join(_string(p.encode()) for p in principals))
            + struct.pack(">QQ", after, before) + _string(critical) + _string(b"") + _string(b"")
            + _string(ca.asbytes()))
    return body + _string(ca.sign_ssh_data(body).asbytes())


@pytest.fixture
def ca_and_key(tmp_path):
    make_keypair(tmp_path / "ca")
    make_keypair(tmp_path / "host")
    ca = load_private_key(str(tmp_path / "ca"))
    host = load_private_key(str(tmp_path / "host"))
    kh = tmp_path / "known_hosts"
    kh.write_text(f"@cert-authority * {ca.get_name()} {ca.get_base64()}\n", encoding="utf-8")
    return ca, host, kh


@pytest.mark.parametrize("fields,reason", [
    ({}, None),
    ({"principals": ()}, None),  # no principals: valid for any name (ssh warns, accepts)
    ({"principals": ("other",)}, "h is not among its principals (other)"),
    ({"principals": ("H",)}, "h is not among its principals (H)"),  # exact, after ssh lower-cases the name
    ({"cert_type": 1}, "it is not a host certificate"),
    ({"after": int(time.time()) + 3600}, "it is not yet valid"),
    ({"before": int(time.time()) - 3600}, "it has expired"),
    ({"critical": _string(b"force-command") + _string(_string(b"true"))}, "it has critical options"),
])
def test_host_certificate_checks(ca_and_key, fields, reason):
    ca, host, kh = ca_and_key
    cert = make_cert(ca, host, **fields)
    problem = known_hosts.Certificate.parse(cert).problem("h")
    assert problem is None if reason is None else reason in problem
    v = known_hosts.check(kh, "H", 22, host, cert)
    assert v.status == ("accept" if reason is None else "unknown")
    assert v.by_certificate == (reason is None)
    if reason is not None:
        assert any(reason in n for n in v.notes)


def test_host_certificate_with_a_forged_signature_or_for_another_key_is_not_used(ca_and_key, tmp_path):
    ca, host, kh = ca_and_key
    cert = bytearray(make_cert(ca, host))
    cert[-5] ^= 1
    v = known_hosts.check(kh, "h", 22, host, bytes(cert))
    assert v.status == "unknown" and "does not verify" in v.notes[0]
    other = other_key(tmp_path)
    v = known_hosts.check(kh, "h", 22, other, make_cert(ca, host))
    assert v.status == "unknown" and "certifies another key" in v.notes[0]


@needs_ssh
def test_sha1_rsa_ca_signature_is_refused_as_ssh_does(tmp_path):
    # CASignatureAlgorithms (OpenSSH >= 8.2) no longer includes ssh-rsa (SHA-1).
    keygen(tmp_path / "ca", "rsa")
    keygen(tmp_path / "host", "ed25519")
    r = subprocess.run(["ssh-keygen", "-q", "-s", str(tmp_path / "ca"), "-t", "ssh-rsa", "-I", "x", "-h",
                        "-n", "h", str(tmp_path / "host.pub")], capture_output=True)
    if r.returncode != 0:
        pytest.skip("this ssh-keygen cannot sign with ssh-rsa")
    blob = base64.b64decode((tmp_path / "host-cert.pub").read_text(encoding="utf-8").split()[1])
    assert "ssh-rsa, which ssh no longer accepts" in known_hosts.Certificate.parse(blob).problem("h")


@needs_ssh
def test_server_with_a_host_certificate_signed_by_a_known_ca_is_accepted(tmp_path):
    # Issue 6: a @cert-authority line trusts host certificates signed by its key.  paramiko
    # 5 negotiates *-cert-v01 host keys and checks the exchange signature with the certified
    # key; gpumagic checks the certificate itself (CA signature, host type, validity,
    # principals) as OpenSSH's sshkey_cert_check_host does.
    keygen(tmp_path / "ca", "ed25519")
    ca_pub = " ".join((tmp_path / "ca.pub").read_text(encoding="utf-8").split()[:2])
    server = start_server("kh-direct-cert", cert=(tmp_path / "ca", "127.0.0.1", "-5m:+1d"))
    try:
        kh = tmp_path / "known_hosts"
        kh.write_text(f"@cert-authority 127.0.0.1,[127.0.0.1]:* {ca_pub}\n", encoding="utf-8")
        m = gpumagic.Machine(replace(server.spec(), known_hosts=str(kh))).connect()
        assert m.connection.transport.host_key_type == "ssh-ed25519-cert-v01@openssh.com"
        assert m.run("echo ok", quiet=True).stdout.strip() == "ok"
        m.close()
        assert ssh_verdict(server, kh, "127.0.0.1", server.port)[0] == "accept"
        # the same certificate does not vouch for another name: unknown, with the reason
        kh.write_text(f"@cert-authority * {ca_pub}\n", encoding="utf-8")
        v, err = gpumagic_verdict(server, kh, "other.example", 22)
        assert v == "unknown" and "other.example is not among its principals (127.0.0.1)" in err.message
    finally:
        server.stop()


def test_forget_keeps_revoked_and_cert_authority_lines(tmp_path):
    k = other_key(tmp_path)
    kh = tmp_path / "known_hosts"
    pub = f"{k.get_name()} {k.get_base64()}"
    text = (f"GPU-Box.example {pub}\n@revoked gpu-box.example {pub}\n@cert-authority *.example {pub}\n"
            f"|1|{'A' * 27}=|x {pub}\nother {pub}\n")
    kh.write_text(text, encoding="utf-8")
    assert known_hosts.forget(kh, "gpu-box.EXAMPLE", 22) == 1
    assert kh.read_text(encoding="utf-8") == text.split("\n", 1)[1]


def test_add_writes_lower_case_and_the_port_form(tmp_path):
    k = other_key(tmp_path)
    kh = tmp_path / "known_hosts"
    assert known_hosts.add(kh, "GPU-Box.example", 22, k).startswith("gpu-box.example ssh-ed25519 ")
    assert known_hosts.add(kh, "GPU-Box.example", 2222, k).startswith("[gpu-box.example]:2222 ssh-ed25519 ")
    assert known_hosts.check(kh, "gpu-box.example", 2222, k).status == "accept"


@needs_ssh
@pytest.mark.parametrize("kind", ["ed25519", "ecdsa", "rsa"])
def test_certificates_signed_by_each_kind_of_ca_verify(tmp_path, kind):
    # ssh-keygen signs (RSA CAs with rsa-sha2-512 by default); gpumagic checks the signature.
    keygen(tmp_path / "ca", kind)
    keygen(tmp_path / "host", "ecdsa")
    sign_host_key(tmp_path / "ca", tmp_path / "host.pub", "h", "-5m:+1h")
    blob = base64.b64decode((tmp_path / "host-cert.pub").read_text(encoding="utf-8").split()[1])
    cert = known_hosts.Certificate.parse(blob)
    assert cert.problem("h") is None
    assert cert.key == base64.b64decode((tmp_path / "host.pub").read_text(encoding="utf-8").split()[1])
    assert cert.key_type == "ecdsa-sha2-nistp256"
