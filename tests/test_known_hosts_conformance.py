"""known_hosts conformance: gpumagic's host-key verdict against the real OpenSSH client.

Each case is a known_hosts file, a host name and a port.  The judge is a real connection
``ssh -F /dev/null -o BatchMode=yes -o StrictHostKeyChecking=yes -o UserKnownHostsFile=FILE
-o GlobalKnownHostsFile=/dev/null -i KEY -p PORT user@NAME true`` to a test sshd; its verdict
(accept / unknown / changed / revoked) is read from its exit status and its last
"... you have requested strict checking" line.  gpumagic's verdict comes from a real
``Connection.open()`` to the same sshd with the same file, name and port.

How one sshd on 127.0.0.1:N is reached under any name and port (``GPU-Box.example`` port
22 included): both clients go through a relay.  ssh gets ``-o ProxyCommand=relay``; with a
ProxyCommand ssh never resolves or dials the name itself and uses NAME and ``-p PORT`` only
for the known_hosts lookup (CheckHostIP is off by default in 9.x and off for a ProxyCommand
anyway).  gpumagic's Connection gets the same route by overriding ``_open_socket`` (the TCP
route only; paramiko, the key exchange, the host-key check and the login are the real ones).
``-o HostKeyAlias`` was not used: it replaces the name looked up (no ``[host]:port`` form,
no port-less retry), so it would not test what a HostName does.

Cases are data (``CASES``): add a tuple.  A case whose gpumagic verdict differs from ssh's
on purpose carries the reason, and the test asserts both verdicts.
"""

from __future__ import annotations

import base64
import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import CLIENT_HOME, make_server
from gpumagic.ssh import known_hosts
from gpumagic.ssh.connection import Connection
from gpumagic.errors import ChangedHostKey, RevokedHostKey, UnknownHostKey
from gpumagic.ssh.hosts import HostSpec
from gpumagic.ssh.sandbox import make_keypair

pytestmark = pytest.mark.skipif(not all(map(__import__("shutil").which, ("ssh", "ssh-keygen"))),
                                reason="needs the OpenSSH client and ssh-keygen")

RELAY = """\
import os, socket, sys, threading
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
def up():
    while True:
        b = os.read(0, 65536)
        if not b:
            s.shutdown(socket.SHUT_WR)
            return
        s.sendall(b)
threading.Thread(target=up, daemon=True).start()
while True:
    b = s.recv(65536)
    if not b:
        break
    os.write(1, b)
"""


# -- servers, keys, the two judges ----------------------------------------------------------

def keygen(path: Path, kind: str) -> str:
    """A new key pair at ``path`` (``ssh-keygen -t kind``); returns ``type base64`` of its .pub."""
    if kind == "ed25519":
        make_keypair(path)
    else:
        subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(path)]
                       + (["-b", "2048"] if kind == "rsa" else []), check=True)
    return " ".join(Path(str(path) + ".pub").read_text(encoding="utf-8").split()[:2])


def sign_host_key(ca: Path, pub: Path, principals: str, validity: str) -> Path:
    """``ssh-keygen -s CA -h``: a host certificate for ``pub``; returns the -cert.pub path."""
    subprocess.run(["ssh-keygen", "-q", "-s", str(ca), "-I", "test-host", "-h",
                    "-n", principals, "-V", validity, str(pub)], check=True)
    return pub.with_name(pub.name[:-len(".pub")] + "-cert.pub")


def start_server(name: str, key_kinds=(), cert: tuple[Path, str, str] | None = None):
    """A test sshd with an ed25519 host key, plus ``key_kinds`` keys and a host certificate
    for the ed25519 key when ``cert`` = (CA private key, principals, validity) is given."""
    base = CLIENT_HOME.parent / name
    base.mkdir(parents=True, exist_ok=True)
    host_key = base / "host_ed25519"
    make_keypair(host_key, "gpumagic-sandbox-host")
    extra = []
    for kind in key_kinds:
        keygen(base / f"host_{kind}", kind)
        extra.append(f"HostKey {base / f'host_{kind}'}")
    if cert is not None:
        extra.append(f"HostCertificate {sign_host_key(cert[0], Path(str(host_key) + '.pub'), *cert[1:])}")
    return make_server(name, extra_config="\n".join(extra))


def server_pub(server, kind: str = "ed25519") -> str:
    return " ".join(Path(str(server.dir / f"host_{kind}") + ".pub").read_text(encoding="utf-8").split()[:2])


def relay_path() -> Path:
    path = CLIENT_HOME.parent / "known-hosts-relay.py"
    if not path.exists():
        path.write_text(RELAY, encoding="utf-8")
    return path


_STRICT = re.compile(r"(No \S+ host key is known for|Host key for .* has changed|"
                     r"host key for .* was revoked) .*requested strict checking")


def ssh_verdict(server, kh: Path, name: str, port: int) -> tuple[str, str]:
    """The real ssh client's verdict on ``kh`` for ``name`` on ``port``, and its stderr."""
    proxy = f"{shlex.quote(sys.executable)} {shlex.quote(str(relay_path()))} 127.0.0.1 {server.port}"
    r = subprocess.run(
        ["ssh", "-F", "/dev/null", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
         "-o", f"UserKnownHostsFile={kh}", "-o", "GlobalKnownHostsFile=/dev/null",
         "-o", "UpdateHostKeys=no", "-o", f"ProxyCommand={proxy}", "-o", "IdentitiesOnly=yes",
         "-i", str(server.client_key), "-p", str(port), f"{server.user}@{name}", "true"],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, SHELL="/bin/sh"), encoding="utf-8")
    if r.returncode == 0:
        return "accept", r.stderr
    decisive = _STRICT.findall(r.stderr)
    if not decisive:
        raise AssertionError(f"ssh failed for another reason (rc {r.returncode}):\n{r.stderr}")
    last = decisive[-1]
    verdict = ("unknown" if last.startswith("No ") else "changed" if "has changed" in last
               else "revoked")
    return verdict, r.stderr


class RoutedConnection(Connection):
    """A real Connection whose TCP route goes to ``real_port`` on 127.0.0.1, whatever
    spec.hostname and spec.port say (what the relay is for ssh)."""

    def __init__(self, spec: HostSpec, real_port: int, **kwargs):
        super().__init__(spec, use_agent=False, **kwargs)
        self.real_port = real_port

    def _open_socket(self, hops):
        sock = socket.create_connection(("127.0.0.1", self.real_port), timeout=10)
        sock.settimeout(None)
        return sock


def gpumagic_verdict(server, kh: Path, name: str, port: int, *, trust: bool = False):
    """gpumagic's verdict (a real open) on ``kh`` for ``name`` on ``port``, and the error."""
    spec = HostSpec(alias=name, hostname=name, port=port, user=server.user,
                    identity_files=(str(server.client_key),), identities_only=True,
                    connect_timeout=10, known_hosts=str(kh))
    c = RoutedConnection(spec, server.port, trust_new_host=trust)
    try:
        c.open()
    except UnknownHostKey as e:
        return "unknown", e
    except ChangedHostKey as e:
        return "changed", e
    except RevokedHostKey as e:
        return "revoked", e
    finally:
        c.close()
    return "accept", c


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    """Three servers and the keys the cases name."""
    d = tmp_path_factory.mktemp("kh-keys")
    keys = {"OTHER_ED": keygen(d / "other_ed", "ed25519"),
            "OTHER_ECDSA": keygen(d / "other_ecdsa", "ecdsa"),
            "CA": keygen(d / "ca", "ed25519"),
            "OTHER_CA": keygen(d / "other_ca", "ed25519")}
    try:
        keys["DSA"] = keygen(d / "dsa", "dsa")
    except subprocess.CalledProcessError:  # an OpenSSH built without DSA
        pass
    servers = {
        # ed25519, ecdsa and rsa host keys, no certificate
        "plain": start_server("kh-plain", ("ecdsa", "rsa")),
        # one ed25519 host key, with a certificate for gpu-box.example signed by CA
        "cert": start_server("kh-cert", cert=(d / "ca", "gpu-box.example", "-5m:+1d")),
        # the same, but the certificate expired in 2020
        "expired": start_server("kh-expired", cert=(d / "ca", "gpu-box.example", "20200101:20200102")),
        # one ed25519 host key only
        "ed25519": start_server("kh-ed25519"),
    }
    yield servers, keys
    for s in servers.values():
        s.stop()


def render(text: str, server, keys: dict) -> str:
    ed = server_pub(server)
    blob = ed.split()[1]
    raw = base64.b64decode(blob)
    values = dict(keys, ED=ed, ED_BLOB=blob,
                  ED_BROKEN_B64=f"ssh-ed25519 {blob[:30]}!!{blob[32:]}",
                  ED_CUT=f"ssh-ed25519 {blob[:40]}",
                  ED_CUT_ALIGNED=f"ssh-ed25519 {base64.b64encode(raw[:-4]).decode()}",
                  ED_TRAILING=f"ssh-ed25519 {base64.b64encode(raw + bytes(4)).decode()}",
                  ED_AS_RSA=f"ssh-rsa {blob}")
    if (server.dir / "host_ecdsa.pub").exists():
        values.update(ECDSA=server_pub(server, "ecdsa"), RSA=server_pub(server, "rsa"),
                      RSA_AS_SHA512="rsa-sha2-512 " + server_pub(server, "rsa").split()[1])
    return text.format(**values)


@dataclass(frozen=True)
class Case:
    id: str
    server: str                 # key of bed's servers
    lines: str                  # the file, {KEY} placeholders (see render)
    name: str
    port: int
    expect: str                 # ssh's verdict, and gpumagic's unless `differs`
    hashed: bool = False        # run `ssh-keygen -H -f` over the file first
    differs: tuple[str, str] | None = None  # (gpumagic's verdict, why)


H = "gpu-box.example"
P = 2222

CASES = [
    # names and ports
    Case("plain-22", "plain", f"{H} {{ED}}\n", H, 22, "accept"),
    Case("plain-port", "plain", f"[{H}]:{P} {{ED}}\n", H, P, "accept"),
    Case("upper-hostname-line-ssh-wrote", "plain", f"{H} {{ED}}\n", "GPU-Box.example", 22, "accept"),
    Case("upper-hostname-port", "plain", f"[{H}]:{P} {{ED}}\n", "GPU-Box.example", P, "accept"),
    Case("upper-case-in-file", "plain", "GPU-Box.EXAMPLE {ED}\n", H, 22, "accept"),
    Case("port-22-written-with-port", "plain", f"[{H}]:22 {{ED}}\n", H, 22, "unknown"),
    Case("other-port-entry", "plain", f"[{H}]:2223 {{ED}}\n", H, P, "unknown"),
    Case("bare-name-used-for-other-port", "plain", f"{H} {{ED}}\n", H, P, "accept"),
    Case("bare-name-other-key-not-changed", "plain", f"{H} {{OTHER_ED}}\n", H, P, "unknown"),
    Case("port-entry-decides-over-bare", "plain", f"{H} {{ED}}\n[{H}]:{P} {{OTHER_ED}}\n", H, P, "changed"),
    Case("no-file-content", "plain", "", H, 22, "unknown"),
    Case("other-host-only", "plain", "other.example {ED}\n", H, 22, "unknown"),
    # hashed names (ssh-keygen -H)
    Case("hashed-22", "plain", f"{H} {{ED}}\n", H, 22, "accept", hashed=True),
    Case("hashed-port-upper", "plain", f"[{H}]:{P} {{ED}}\n", "GPU-Box.example", P, "accept", hashed=True),
    Case("hashed-other-port", "plain", f"[{H}]:{P} {{ED}}\n", H, 2223, "unknown", hashed=True),
    Case("hashed-changed", "plain", f"{H} {{OTHER_ED}}\n", H, 22, "changed", hashed=True),
    Case("hashed-broken-salt", "plain", "|1|AAAA|BBBB {OTHER_ED}\n", H, 22, "unknown"),
    # patterns
    Case("comma-list", "plain", f"other.example,{H},10.0.0.1 {{ED}}\n", H, 22, "accept"),
    Case("star", "plain", "*.example {ED}\n", H, 22, "accept"),
    Case("question-mark", "plain", "gpu-bo?.example {ED}\n", H, 22, "accept"),
    Case("bracketed-port-pattern", "plain", f"[*.example]:{P} {{ED}}\n", H, P, "accept"),
    Case("star-covers-port-form", "plain", "* {OTHER_ED}\n", H, P, "changed"),
    Case("negation-vetoes", "plain", f"*.example,!{H} {{ED}}\n", H, 22, "unknown"),
    Case("negation-vetoes-changed", "plain", f"*.example,!{H} {{OTHER_ED}}\n", H, 22, "unknown"),
    Case("negation-of-another", "plain", "*.example,!cpu-box.example {ED}\n", H, 22, "accept"),
    Case("negation-alone", "plain", "!other.example {ED}\n", H, 22, "unknown"),
    # several keys, several types
    Case("changed-same-type", "plain", f"{H} {{OTHER_ED}}\n", H, 22, "changed"),
    Case("one-of-two-same-type", "plain", f"{H} {{OTHER_ED}}\n{H} {{ED}}\n", H, 22, "accept"),
    Case("ecdsa-known-negotiated", "plain", f"{H} {{ECDSA}}\n", H, 22, "accept"),
    Case("rsa-known-negotiated", "plain", f"[{H}]:{P} {{RSA}}\n", H, P, "accept"),
    Case("rsa-sha2-512-type-name", "plain", f"{H} {{RSA_AS_SHA512}}\n", H, 22, "accept"),
    Case("ed25519-wrong-ecdsa-right", "plain", f"{H} {{OTHER_ED}}\n{H} {{ECDSA}}\n", H, 22, "changed"),
    Case("other-type-stored", "ed25519", f"{H} {{OTHER_ECDSA}}\n", H, 22, "changed"),
    Case("dsa-stored", "ed25519", f"{H} {{DSA}}\n", H, 22, "changed"),
    # broken lines are skipped
    Case("broken-base64", "plain", f"{H} {{ED_BROKEN_B64}}\n", H, 22, "unknown"),
    Case("broken-base64-then-good", "plain", f"{H} {{ED_BROKEN_B64}}\n{H} {{ED}}\n", H, 22, "accept"),
    Case("cut-short", "plain", f"{H} {{ED_CUT}}\n", H, 22, "unknown"),
    Case("cut-short-aligned", "plain", f"{H} {{ED_CUT_ALIGNED}}\n", H, 22, "unknown"),
    Case("trailing-bytes", "plain", f"{H} {{ED_TRAILING}}\n", H, 22, "unknown"),
    Case("type-mismatch", "plain", f"{H} {{ED_AS_RSA}}\n", H, 22, "unknown"),
    Case("no-key", "plain", f"{H} ssh-ed25519\n{H}\n", H, 22, "unknown"),
    Case("short-type-name", "plain", f"{H} ED25519 {{ED_BLOB}}\n", H, 22, "unknown"),
    Case("unknown-marker", "plain", f"@bogus {H} {{OTHER_ED}}\n", H, 22, "unknown"),
    Case("comment", "plain", f"# {H} {{ED}}\n", H, 22, "unknown"),
    Case("tabs-spaces-comment-crlf", "plain", f"  \t{H}\t {{ED}} my server\r\n", H, 22, "accept"),
    # @revoked
    Case("revoked", "plain", f"{H} {{ED}}\n@revoked * {{ED}}\n", H, 22, "revoked"),
    Case("revoked-alone", "plain", f"@revoked {H} {{ED}}\n", H, 22, "revoked"),
    Case("revoked-port", "plain", f"[{H}]:{P} {{ED}}\n@revoked [*]:* {{ED}}\n", H, P, "revoked"),
    Case("revoked-for-other-host", "plain", f"{H} {{ED}}\n@revoked other.example {{ED}}\n", H, 22, "accept"),
    Case("revoked-other-key", "plain", f"{H} {{ED}}\n@revoked * {{OTHER_ED}}\n", H, 22, "accept"),
    Case("revoked-under-bare-name", "plain", f"{H} {{ED}}\n@revoked {H} {{ED}}\n", H, P, "unknown",
         differs=("revoked", "ssh's port-less retry ignores what it finds there unless it accepts, "
                  "so it only says 'unknown' (and accept-new would add the key); gpumagic "
                  "refuses a key revoked for the host, so --trust-new-host cannot add it")),
    # @cert-authority
    Case("ca-key-is-not-a-host-key", "plain", f"@cert-authority {H} {{ED}}\n", H, 22, "unknown"),
    Case("certificate-accepted", "cert", "@cert-authority *.example {CA}\n", H, 22, "accept"),
    Case("certificate-bare-name-other-port", "cert", "@cert-authority *.example {CA}\n", H, P, "accept"),
    Case("certificate-port-pattern", "cert", "@cert-authority [*.example]:* {CA}\n", "GPU-Box.example", P, "accept"),
    Case("certificate-not-for-this-name", "cert", "@cert-authority * {CA}\n", "other.example", 22, "unknown"),
    Case("certificate-wrong-name-plain-key-known", "cert", "@cert-authority * {CA}\nother.example {ED}\n",
         "other.example", 22, "accept"),
    Case("certificate-other-ca", "cert", "@cert-authority * {OTHER_CA}\n", H, 22, "unknown"),
    Case("certificate-other-ca-plain-known", "cert", f"@cert-authority * {{OTHER_CA}}\n{H} {{ED}}\n", H, 22, "accept"),
    Case("certificate-ca-for-other-names", "cert", "@cert-authority *.nomatch {CA}\n", H, 22, "unknown"),
    Case("certificate-beats-stale-plain-key", "cert", f"{H} {{OTHER_ED}}\n@cert-authority * {{CA}}\n", H, 22, "accept"),
    Case("certificate-host-key-as-ca", "cert", "@cert-authority * {ED}\n", H, 22, "unknown"),
    Case("certificate-ca-revoked", "cert", "@cert-authority * {CA}\n@revoked * {CA}\n", H, 22, "revoked"),
    Case("certificate-key-revoked", "cert", "@cert-authority * {CA}\n@revoked * {ED}\n", H, 22, "revoked"),
    Case("certificate-expired", "expired", "@cert-authority * {CA}\n", H, 22, "unknown"),
    Case("certificate-expired-plain-known", "expired", f"@cert-authority * {{CA}}\n{H} {{ED}}\n", H, 22, "accept"),
]


def _write_case(case: Case, bed, tmp_path: Path) -> tuple[object, Path]:
    servers, keys = bed
    server = servers[case.server]
    if "{DSA}" in case.lines and "DSA" not in keys:
        pytest.skip("this OpenSSH cannot make DSA keys")
    kh = tmp_path / "known_hosts"
    kh.write_bytes(render(case.lines, server, keys).encode())
    if case.hashed:
        subprocess.run(["ssh-keygen", "-H", "-f", str(kh)], check=True, capture_output=True)
        assert "|1|" in kh.read_text(encoding="utf-8")
    return server, kh


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_verdict_agrees_with_ssh(case, bed, tmp_path):
    server, kh = _write_case(case, bed, tmp_path)
    before = kh.read_bytes()
    ssh, stderr = ssh_verdict(server, kh, case.name, case.port)
    assert ssh == case.expect, stderr
    ours, err = gpumagic_verdict(server, kh, case.name, case.port)
    want = case.differs[0] if case.differs else case.expect
    assert ours == want, f"{err}"
    assert kh.read_bytes() == before  # neither client wrote to the file
    if ours == "revoked":
        assert f"{kh}:" in err.message and err.line.startswith(f"{kh}:")
    if ours in ("revoked", "changed", "unknown"):
        assert "\n" not in err.message and err.hint


@pytest.mark.parametrize("case", [c for c in CASES if (c.differs[0] if c.differs else c.expect)
                                  in ("unknown", "revoked")],
                         ids=lambda c: c.id)
def test_trust_new_host_writes_what_ssh_finds_and_never_trusts_a_revoked_key(case, bed, tmp_path):
    server, kh = _write_case(case, bed, tmp_path)
    before = kh.read_bytes()
    ours, err = gpumagic_verdict(server, kh, case.name, case.port, trust=True)
    if (case.differs[0] if case.differs else case.expect) == "revoked":
        assert ours == "revoked" and kh.read_bytes() == before
        return
    assert ours == "accept", f"{err}"
    added = kh.read_bytes()[len(before):].decode()
    assert added.startswith(known_hosts.known_name(case.name, case.port) + " ")
    assert ssh_verdict(server, kh, case.name, case.port)[0] == "accept"
    assert gpumagic_verdict(server, kh, case.name, case.port)[0] == "accept"


# -- forget against ssh-keygen -R ----------------------------------------------------------

FORGET_CASES = [
    # (id, file lines, host, port)
    ("plain", f"{H} {{ED}}\nother.example {{ED}}\n", H, 22),
    ("upper-case-name", f"{H} {{ED}}\nGPU-BOX.example {{OTHER_ED}}\n", "GPU-Box.example", 22),
    ("port", f"{H} {{ED}}\n[{H}]:{P} {{ED}}\n[{H}]:2223 {{ED}}\n", H, P),
    ("comma-list-and-wildcard", f"a.example,{H} {{ED}}\n*.example {{ED}}\n*.other {{ED}}\n", H, 22),
    ("negated", f"*.example,!{H} {{ED}}\n*.example {{OTHER_ED}}\n", H, 22),
    ("markers-stay", f"{H} {{ED}}\n@revoked {H} {{OTHER_ED}}\n@cert-authority * {{CA}}\n", H, 22),
    ("broken-key-of-the-host", f"{H} {{ED_BROKEN_B64}}\nother.example {{ED}}\n", H, 22),
    ("comments-and-blank-lines", f"# {H}\n\n{H} {{ED}}\n  # x\n", H, 22),
]


@pytest.mark.parametrize("lines,host,port", [c[1:] for c in FORGET_CASES], ids=[c[0] for c in FORGET_CASES])
@pytest.mark.parametrize("hashed", [False, True], ids=["clear", "hashed"])
def test_forget_agrees_with_ssh_keygen_R(lines, host, port, hashed, bed, tmp_path):
    servers, keys = bed
    text = render(lines, servers["plain"], keys)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    theirs.write_text(text, encoding="utf-8")
    if hashed:
        subprocess.run(["ssh-keygen", "-H", "-f", str(theirs)], check=True, capture_output=True)
        text = theirs.read_text(encoding="utf-8")
    ours.write_text(text, encoding="utf-8")
    # ssh-keygen -R is given the lower-case name: it hashes the name as typed, so
    # `ssh-keygen -R GPU-Box.example` misses the hashed line that ssh itself finds (ssh looks
    # up gpu-box.example).  gpumagic forgets what ssh finds, whatever the case typed.
    name = known_hosts.known_name(host, port)
    r = subprocess.run(["ssh-keygen", "-R", name, "-f", str(theirs)], capture_output=True, text=True, encoding="utf-8")
    assert r.returncode == 0, r.stderr
    removed = known_hosts.forget(ours, host, port)
    assert ours.read_text(encoding="utf-8").splitlines() == theirs.read_text(encoding="utf-8").splitlines(), name
    assert removed == r.stdout.count("found: line")


def test_forget_cleans_a_file_that_ssh_keygen_R_refuses(bed, tmp_path):
    # Deliberate difference: ssh-keygen -R rewrites nothing when any line of the file is
    # invalid ("is not a valid known_hosts file"); gpumagic removes the host's lines and
    # keeps the invalid ones byte for byte.
    servers, keys = bed
    text = render(f"{H} {{ED}}\nnot a key line\n{H} ssh-ed25519\nother.example {{ED}}\n", servers["plain"], keys)
    kh = tmp_path / "known_hosts"
    kh.write_text(text, encoding="utf-8")
    r = subprocess.run(["ssh-keygen", "-R", H, "-f", str(kh)], capture_output=True, text=True, encoding="utf-8")
    assert r.returncode != 0 and kh.read_text(encoding="utf-8") == text
    assert known_hosts.forget(kh, H, 22) == 1
    assert kh.read_text(encoding="utf-8") == text.split("\n", 1)[1]


def test_default_algorithm_lists_are_the_ssh_clients():
    # The orders gpumagic asks for host keys in, and the CA signatures it accepts, are the
    # installed ssh's defaults (ssh -G prints them).
    out = subprocess.run(["ssh", "-G", "-F", "/dev/null", "example"], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, encoding="utf-8").stdout
    opts = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    assert tuple(opts["hostkeyalgorithms"].split(",")) == known_hosts.DEFAULT_HOST_KEY_ALGORITHMS
    assert set(opts["casignaturealgorithms"].split(",")) == known_hosts.CA_SIGNATURE_ALGORITHMS
