"""Stand-ins for the internet, for the sandbox, the tutorials and the tests: nothing here ever
resolves a name or reaches another computer.

* :class:`StandInProxy` stands in for the laptop's proxy (Clash, v2rayN): an HTTP proxy on
  127.0.0.1 (absolute-URI requests and ``CONNECT``) that counts the requests it gets by host
  and answers them from a table of stand-in sites (``routes``: host -> a local port), or,
  for a host not in the table, with a short page of its own.
* :class:`StandInSite` is a web server on 127.0.0.1 of one of three kinds, for
  ``%gpu doctor --net``: ``fast`` (serves a few MB at once), ``slow`` (a trickle), ``silent``
  (accepts, then never answers).
* :class:`StandInNet` is the sandbox's :class:`gpumagic.net.Net`: its default targets are
  stand-in sites named as the real ones.
"""

from __future__ import annotations

import collections
import socket
import socketserver
import threading

from . import Net
from .catalog import Target, mirror

_MAX_HEADER = 64 * 1024


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class StandInProxy:
    """An HTTP proxy on this computer's 127.0.0.1 that never reaches the internet.

    Parameters
    ----------
    routes : dict of str to int, optional
        Host name -> a port on 127.0.0.1 that serves it (a request for ``pypi.example.test``
        goes to that local server).  Other hosts get :meth:`page` (``answer_others``) or a
        502.
    port : int
        Port to listen on (0: any free one; see :attr:`port`).
    answer_others : bool
        Answer a host not in ``routes`` with a short page of the proxy's own.

    Attributes
    ----------
    requests : collections.Counter
        Requests by host (``CONNECT`` ones too), since start.
    log : list of (str, str)
        (method, target) of each request, in order.
    """

    def __init__(self, routes: dict[str, int] | None = None, port: int = 0, answer_others: bool = True):
        self.routes = {k.lower(): v for k, v in (routes or {}).items()}
        self.answer_others = answer_others
        self.requests: collections.Counter = collections.Counter()
        self.log: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._wanted = port
        self._server: _Server | None = None
        self.port = 0

    def start(self) -> "StandInProxy":
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                proxy._handle(self.request)

        self._server = _Server(("127.0.0.1", self._wanted), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True, name="gpumagic-standin-proxy").start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "StandInProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def total(self) -> int:
        """Requests so far, every host."""
        with self._lock:
            return sum(self.requests.values())

    @staticmethod
    def page(host: str) -> bytes:
        """What a host without a route gets."""
        return f"stand-in for {host}: this request went through the proxy on this computer\n".encode()

    # -- one connection ------------------------------------------------------------------

    def _handle(self, sock: socket.socket) -> None:
        head = b""
        while b"\r\n\r\n" not in head and len(head) < _MAX_HEADER:
            data = sock.recv(65536)
            if not data:
                return
            head += data
        head, _, rest = head.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, target, _version = (lines[0].split(" ", 2) + ["", ""])[:3]
        if method == "CONNECT":
            host, _, port = target.rpartition(":")
        else:
            after = target.split("://", 1)[-1]
            hostport, _, path = after.partition("/")
            host, _, port = hostport.partition(":")
            target_path = "/" + path
        host = host.strip("[]").lower()
        with self._lock:
            self.requests[host] += 1
            self.log.append((method, target))
        route = self.routes.get(host)
        if route is None:
            if not self.answer_others:
                sock.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                return
            if method == "CONNECT":
                sock.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                return
            body = self.page(host)
            sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
            return
        upstream = socket.create_connection(("127.0.0.1", route))
        with upstream:
            if method == "CONNECT":
                sock.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                if rest:
                    upstream.sendall(rest)
            else:
                headers = [ln for ln in lines[1:] if ln.split(":", 1)[0].strip().lower()
                           not in ("proxy-connection", "connection", "keep-alive")]
                request = "\r\n".join([f"{method} {target_path} HTTP/1.1", *headers, "Connection: close", "", ""])
                upstream.sendall(request.encode("latin-1") + rest)
            _relay(sock, upstream)


def _relay(a: socket.socket, b: socket.socket) -> None:
    """Copy both ways until both sides have ended."""
    def pump(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    t = threading.Thread(target=pump, args=(b, a), daemon=True)
    t.start()
    pump(a, b)
    t.join()


class StandInSite:
    """A web server on 127.0.0.1 that stands in for a site ``%gpu doctor --net`` measures.

    Parameters
    ----------
    kind : str
        ``fast``: ``size`` bytes at once; ``slow``: the headers, then ``rate`` bytes a second
        (for as long as the client reads); ``silent``: accepts the connection, never answers.
    size : int
        Bytes a ``fast`` site serves (and a ``slow`` one announces), any path.
    rate : int
        Bytes per second of a ``slow`` site.
    """

    def __init__(self, kind: str = "fast", *, size: int = 4 * 1024 * 1024, rate: int = 20_000):
        if kind not in ("fast", "slow", "silent"):
            raise ValueError(f"no stand-in site kind {kind!r}: fast, slow or silent")
        self.kind, self.size, self.rate = kind, size, rate
        self.requests = 0
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._held: list[socket.socket] = []
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def start(self) -> "StandInSite":
        self._sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name=f"gpumagic-standin-{self.kind}").start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._sock is not None:
            self._sock.close()
        for s in self._held:
            s.close()

    def __enter__(self) -> "StandInSite":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                c, _ = self._sock.accept()
            except OSError:
                return
            self.requests += 1
            if self.kind == "silent":
                self._held.append(c)  # never answered, closed at stop()
                continue
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        with c:
            try:
                c.recv(65536)
                c.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {self.size}\r\nConnection: close\r\n\r\n".encode())
                block = b"x" * 65536
                if self.kind == "fast":
                    left = self.size
                    while left > 0:
                        n = min(left, len(block))
                        c.sendall(block[:n])
                        left -= n
                    return
                piece = max(1, self.rate // 10)
                sent = 0
                while sent < self.size and not self._stop.wait(0.1):
                    c.sendall(block[:piece])
                    sent += piece
            except OSError:
                pass


class StandInNet(Net):
    """The sandbox's way out (:attr:`SandboxMachine.net <gpumagic.machine.SandboxMachine>`):
    as :class:`gpumagic.net.Net`, but what :meth:`doctor` measures by default are stand-ins
    for the internet on this computer (:class:`StandInSite`, started on first use, stopped
    by :meth:`close`), so ``%gpu doctor --net`` shows each verdict and nothing leaves the
    computer."""

    def __init__(self, machine):
        super().__init__(machine)
        self._sites: dict[str, StandInSite] = {}

    def targets(self) -> list[Target]:
        """Named as the real targets are: a fast pypi.org and conda-forge, a slow PyTorch
        wheel index and GitHub, a huggingface.co that never answers and a fast hf-mirror.com."""
        if not self._sites:
            self._sites = {k: StandInSite(k).start() for k in ("fast", "slow", "silent")}
        site = {k: s.url for k, s in self._sites.items()}
        hf = mirror("hf")
        return [Target("pypi.org", site["fast"] + "simple/torch/", "pip"),
                Target("download.pytorch.org", site["slow"] + "whl/torch/"),
                Target("huggingface.co", site["silent"] + "gpt2/resolve/main/vocab.json", "hf"),
                Target("github.com", site["slow"] + "pytorch/pytorch/archive/v2.0.0.tar.gz"),
                Target("conda-forge", site["fast"] + "conda-forge/noarch/repodata.json", "conda"),
                Target(hf.host, site["fast"] + "gpt2/resolve/main/vocab.json", "hf", hf.name)]

    def close(self) -> None:
        """Stop the stand-in sites and forget the proxy."""
        for s in self._sites.values():
            s.stop()
        self._sites = {}
        super().close()
