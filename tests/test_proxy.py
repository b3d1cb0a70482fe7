"""``%gpu proxy on|off`` (``machine.net.proxy_on``) against a real sshd, with a stand-in proxy on
this computer that counts requests (:class:`gpumagic.net.standin.StandInProxy`).

Nothing leaves this computer: the sites the machine asks for (``example.test``,
``pypi.example.test``: the reserved ``.test`` names, which never resolve) are answered by the
stand-in proxy or by local servers it routes to, so a request that did not go through the
proxy fails to resolve instead of reaching anything.  The machine gets its own sshd (its own
HOME), so its pip and dotfiles are its own.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import os
import signal
import socket
import threading
import zipfile

import pytest

from conftest import add_client_entry, make_server, session_sshd_pid, wait_until
from gpumagic.errors import GpumagicError
from gpumagic.net.proxy import ALL_VARS
from gpumagic.net.standin import StandInProxy


def tiny_wheel() -> bytes:
    """A valid, empty wheel: tinypkg 1.0."""
    files = {"tinypkg/__init__.py": b"",
             "tinypkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
             "tinypkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},sha256={hashlib.sha256(b).hexdigest()},{len(b)}\n" for n, b in files.items())
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for n, b in files.items():
            z.writestr(n, b)
        z.writestr("tinypkg-1.0.dist-info/RECORD", record + "tinypkg-1.0.dist-info/RECORD,,\n")
    return buf.getvalue()


WHEEL = tiny_wheel()


class Site:
    """A local HTTP server (any address on 127.0.0.0/8) that counts its requests: a PyPI
    simple index with tinypkg, and ``/`` answering "direct"."""

    def __init__(self, host: str = "127.0.0.1"):
        wheel = WHEEL
        site = self
        self.requests = 0

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                site.requests += 1
                if self.path.rstrip("/") == "/simple/tinypkg":
                    body = b'<a href="/files/tinypkg-1.0-py3-none-any.whl">tinypkg-1.0-py3-none-any.whl</a>'
                elif self.path == "/files/tinypkg-1.0-py3-none-any.whl":
                    body = wheel
                else:
                    body = b"direct\n"
                self.send_response(200)
                self.send_header("Content-Type", "text/html" if b"<a " in body else "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer((host, 0), H)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def proxied():
    """A machine of its own (sshd, HOME), and the ``proxied`` alias for it."""
    server = make_server("proxied")
    add_client_entry(server, "proxied")
    yield server
    server.stop()


@pytest.fixture
def index():
    s = Site()
    yield s
    s.close()


@pytest.fixture
def standin(index):
    with StandInProxy(routes={"pypi.example.test": index.port}) as p:
        yield p


@pytest.fixture
def m(proxied):
    import gpumagic

    machine = gpumagic.connect("proxied")
    yield machine
    machine.net.proxy_off()
    machine.close()


def remote_env(machine) -> dict[str, str]:
    out = machine.run("env", quiet=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_curl_and_pip_download_go_through_the_proxy_and_no_proxy_hosts_do_not(m, standin, index, proxied, tmp_path):
    # a mirror the machine is set to use (pip.conf), served on 127.0.0.2: it must stay direct
    mirror = Site("127.0.0.2")
    conf = proxied.dir / "home" / ".config" / "pip" / "pip.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(f"[global]\nindex-url = http://127.0.0.2:{mirror.port}/simple\n", encoding="utf-8")
    try:
        p = m.net.proxy_on(standin.port)
        env = remote_env(m)
        for var in ALL_VARS[:6]:
            assert env[var] == p.url == f"http://127.0.0.1:{p.tunnel.remote_port}"
        no_proxy = env["no_proxy"].split(",")
        assert env["NO_PROXY"] == env["no_proxy"]
        for host in ("localhost", "127.0.0.1", "100.100.100.200", "169.254.169.254",
                     "pypi.tuna.tsinghua.edu.cn", "hf-mirror.com", "127.0.0.2"):
            assert host in no_proxy

        r = m.run("curl -sS http://example.test/hello", quiet=True)
        assert r.stdout == StandInProxy.page("example.test").decode(), r.stderr
        assert standin.requests["example.test"] == 1

        dest = proxied.dir / "home" / "wheels"
        r = m.run(f"python3 -m pip --disable-pip-version-check download --no-deps --no-cache-dir -q -d {dest} "
                  "--index-url http://pypi.example.test/simple --trusted-host pypi.example.test tinypkg",
                  quiet=True, timeout=120)
        assert r.exit_code == 0, r.stderr
        assert (dest / "tinypkg-1.0-py3-none-any.whl").read_bytes() == WHEEL
        assert standin.requests["pypi.example.test"] == 2  # the index page, then the wheel
        assert index.requests == 2

        before = standin.total
        r = m.run(f"curl -sS http://127.0.0.1:{index.port}/ http://127.0.0.2:{mirror.port}/", quiet=True)
        assert r.stdout == "direct\ndirect\n", r.stderr
        assert standin.total == before  # no_proxy hosts went direct
        assert mirror.requests == 1 and index.requests == 3
    finally:
        conf.unlink()
        mirror.close()


def test_a_job_started_after_it_gets_the_proxy(m, standin):
    p = m.net.proxy_on(standin.port)
    job = m.start_job("proxied-env", "curl -sS http://example.test/job; echo \"https_proxy=$https_proxy\"")
    try:
        assert job.wait(timeout=60).exit_code == 0
        log = job.logs(10)
        assert StandInProxy.page("example.test").decode().strip() in log
        assert f"https_proxy={p.url}" in log
        assert standin.requests["example.test"] == 1
    finally:
        job.kill()


def test_the_proxy_comes_back_after_a_reconnect(m, standin):
    m.net.proxy_on(standin.port)
    assert m.run("curl -sS http://example.test/1", quiet=True).exit_code == 0
    os.kill(session_sshd_pid(m), signal.SIGKILL)  # the connection drops
    assert wait_until(lambda: not m.is_connected, 10)
    r = m.run("curl -sS http://example.test/2", quiet=True)  # reconnects, the tunnel listens again
    assert r.stdout == StandInProxy.page("example.test").decode(), r.stderr
    assert standin.requests["example.test"] == 2
    assert m.net.proxy.tunnel.reconnects == 1


def test_off_leaves_no_variable_behind_in_new_cells(m, standin):
    m.net.proxy_on(standin.port)
    off = m.net.proxy_off()
    assert off.tunnel is not None and off.removed == []
    env = remote_env(m)
    assert [v for v in ALL_VARS if v in env] == []
    r = m.run("curl -sS --max-time 5 http://example.test/", quiet=True)
    assert r.exit_code != 0  # no proxy: the .test name does not resolve
    assert standin.total == 0
    assert m.tunnels.reverse_tunnels() == []


def test_closing_the_proxys_tunnel_drops_its_variables(m, standin):
    p = m.net.proxy_on(standin.port)
    m.tunnels.close_reverse(p.tunnel.id)
    assert "https_proxy" not in remote_env(m) and m.net.proxy is None


def test_persist_writes_a_marked_block_that_off_removes(m, standin, proxied):
    rc = proxied.dir / "home" / ".bashrc"
    rc.write_text("# the user's own\nexport MINE=1\n", encoding="utf-8")
    before = rc.read_bytes()
    login_shell = os.path.basename(m.run("echo $SHELL", quiet=True).stdout.strip())
    p = m.net.proxy_on(standin.port, persist=True)
    written = p.persisted
    if login_shell == "bash":
        assert written == str(rc)
    text = open(written, encoding="utf-8").read()
    assert "# >>> gpumagic proxy >>>" in text and f"https_proxy='{p.url}'" in text
    assert m.net.proxy_off().removed == [written]
    assert rc.read_bytes() == before
    if written != str(rc):
        assert "gpumagic proxy" not in open(written, encoding="utf-8").read() if os.path.exists(written) else True


def test_nothing_listening_on_the_local_port_is_a_one_line_error(m):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(GpumagicError) as e:
        m.net.proxy_on(port)
    assert str(e.value).splitlines()[0].startswith(f"nothing accepts connections on this computer's 127.0.0.1:{port}")
    assert "Clash" in e.value.hint and m.net.proxy is None


def test_gpu_proxy_on_and_off(ip, proxied, standin, capsys):
    ip.run_line_magic("gpu", "connect proxied")
    capsys.readouterr()
    ip.run_line_magic("gpu", f"proxy on --local {standin.port}")
    out = capsys.readouterr().out
    m = ip._gpumagic.fleet.get(None)
    url = m.net.proxy.url
    assert out.startswith(f"proxy on for proxied: the machine's {url[7:]} -> this computer's 127.0.0.1:{standin.port}")
    assert f"= {url} in new cells, sessions and jobs" in out and "%gpu kernel stop NAME" in out
    ip.run_line_magic("gpu", "tunnel list")
    assert "reverse: proxy" in capsys.readouterr().out
    ip.run_line_magic("gpu", "proxy off")
    out = capsys.readouterr().out
    assert out.startswith(f"proxy off for proxied: closed reverse tunnel R{url.rsplit(':', 1)[1]}")
    ip.run_line_magic("gpu", "proxy")
    assert capsys.readouterr().out.startswith("no proxy on for proxied")
