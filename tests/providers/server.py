"""A local HTTP server that answers as a rental platform, checked against its published document.

Every request gpumagic sends and every answer the stand-in gives is validated with
``openapi-core`` against the vendored OpenAPI document (``tests/providers/*-openapi.*``):
a field gpumagic invents, a missing required one, a wrong type, or an answer the stand-in
shapes wrongly is recorded in :attr:`SpecServer.violations`, and the tests assert there are
none.  Status codes a document does not list (its rate limit's 429, where only the prose
documents it) are recorded in :attr:`SpecServer.undocumented` for the tests to name.

Each "created" instance is a real sandbox sshd (:class:`gpumagic.ssh.sandbox.SshServer`), so a
rental can be connected to and run cells.
"""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from openapi_core import Config, OpenAPI
from openapi_core.testing import MockRequest, MockResponse

HERE = Path(__file__).resolve().parent


def load_spec(name: str) -> OpenAPI:
    """The vendored document ``name`` (``runpod-openapi.json``...).  The published RunPod v1
    document repeats an operationId (``UpdatePod``), so documents are not linted first."""
    text = (HERE / name).read_text(encoding="utf-8")
    if name.endswith(".json"):
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    return OpenAPI.from_dict(data, config=Config(spec_validator_cls=None,
                                                extra_media_type_deserializers={"application/problem+json": json.loads}))


class Reply(Exception):
    """Raised by a handler to answer with ``status`` and ``body`` (an error, a 429)."""

    def __init__(self, status: int, body=None, headers: dict | None = None, content_type: str = "application/json"):
        self.status, self.body, self.headers, self.content_type = status, body, headers or {}, content_type


class SpecServer:
    """Routes ``(METHOD, local path prefix)`` to handlers, validating both ways.

    Parameters
    ----------
    mounts : list of (local_prefix, spec_host_url, spec_prefix, OpenAPI)
        A request under ``local_prefix`` is validated as ``spec_host_url + spec_prefix + rest``.
    keys : set of str
        API keys accepted (a Bearer token outside it gets the platform's 401).
    limits : dict
        ``{path prefix or "": seconds}`` the platform allows between requests; a faster one gets
        429 with Retry-After.
    """

    allowed_undocumented: tuple[int, ...] = (429,)

    def __init__(self, mounts, *, keys=("good-key",), limits: dict | None = None):
        self.mounts = mounts
        self.keys = set(keys)
        self.limits = dict(limits or {})
        self._last: dict[str, float] = {}
        self.violations: list[str] = []
        self.undocumented: list[tuple[int, str]] = []
        self.requests: list[tuple[str, str]] = []
        self.too_many = 0          # answer this many next requests with 429
        self.retry_after = 1
        self.delay: dict[str, float] = {}  # "METHOD path" prefix -> seconds to wait before answering
        self.lock = threading.RLock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _any(self):
                server._serve(self)

            do_GET = do_POST = do_DELETE = do_PATCH = do_PUT = _any

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- one request -----------------------------------------------------------------------

    def route(self, method: str, path: str, query: dict, body, token: str):  # pragma: no cover
        raise NotImplementedError

    def authorized(self, token: str, method: str, path: str) -> bool:
        """Whether ``token`` may send this request: an account key (:attr:`keys`) may send any;
        a platform's instance-scoped key only what it allows (see the platforms' stand-ins)."""
        return token in self.keys

    def unauthorized(self, token: str) -> Reply:  # pragma: no cover
        raise NotImplementedError

    def rate_limited(self) -> Reply:
        return Reply(429, {"error": "too many requests"}, {"Retry-After": str(self.retry_after)})

    def _mount(self, path: str):
        for local, host, spec_prefix, api in self.mounts:
            if path.startswith(local):
                return host, spec_prefix + path[len(local):], api, path[len(local):]
        return None

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(h.path)
        raw = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        method = h.command
        mount = self._mount(parts.path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        headers = {k: v for k, v in h.headers.items()}
        with self.lock:
            self.requests.append((method, parts.path))
        if mount is None:
            self.violations.append(f"{method} {parts.path}: not under any mounted document")
            return self._send(h, 404, b"", {}, "text/plain")
        host, spec_path, api, rest = mount
        req = MockRequest(host, method.lower(), spec_path, args=query, headers=headers, data=raw or None,
                          content_type=h.headers.get("Content-Type", "application/json").split(";")[0])
        result = api.unmarshal_request(req)
        token = (headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        try:
            if result.errors:
                self._violation(f"request {method} {spec_path}: {_explain(result.errors)}")
                raise Reply(400, self.bad_request(_explain(result.errors)))
            if not self.authorized(token, method, rest):
                raise self.unauthorized(token)
            with self.lock:
                if self.too_many > 0:
                    self.too_many -= 1
                    raise self.rate_limited()
                self._limit(rest)
            body = json.loads(raw) if raw else None
            status, answer = self.route(method, rest, query, body, token)
            reply = Reply(status, answer)
        except Reply as r:
            reply = r
        for prefix, seconds in self.delay.items():  # a slow answer: done (or refused), but late
            if f"{method} {rest}".startswith(prefix):
                time.sleep(seconds)
        data = b"" if reply.body is None else json.dumps(reply.body).encode()
        resp = MockResponse(data, status_code=reply.status, headers=reply.headers,
                            content_type=reply.content_type if data else None)
        try:
            checked = api.unmarshal_response(req, resp)
            errors = checked.errors
        except Exception as e:  # pragma: no cover - openapi-core raising, not returning
            errors = [e]
        if errors:
            names = {type(e).__name__ for e in errors}
            if names <= {"ResponseNotFound"} and reply.status in self.allowed_undocumented:
                self.undocumented.append((reply.status, f"{method} {spec_path}"))
            else:
                self._violation(f"response {reply.status} to {method} {spec_path}: {_explain(errors)}")
        self._send(h, reply.status, data, reply.headers, reply.content_type)

    def bad_request(self, text: str):
        return {"error": text}

    def _limit(self, rest: str) -> None:
        now = time.monotonic()
        for prefix, seconds in self.limits.items():
            if rest.startswith(prefix):
                last = self._last.get(prefix)
                if last is not None and now - last < seconds:
                    r = self.rate_limited()
                    r.headers["Retry-After"] = str(math.ceil(seconds - (now - last)))
                    raise r
        for prefix in self.limits:
            if rest.startswith(prefix):
                self._last[prefix] = now

    def _violation(self, text: str) -> None:
        with self.lock:
            self.violations.append(text)

    @staticmethod
    def _send(h, status: int, data: bytes, headers: dict, content_type: str) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        if data:
            h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)


def _explain(errors) -> str:
    out = []
    for e in errors:
        inner = getattr(e, "__cause__", None) or e
        details = getattr(inner, "schema_errors", None)
        if details:
            out.append("; ".join(f"{'/'.join(map(str, d.path))}: {d.message}" for d in details))
        else:
            out.append(f"{type(e).__name__}: {inner}")
    return " | ".join(out)
