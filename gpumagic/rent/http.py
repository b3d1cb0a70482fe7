"""The one HTTP door of the rental providers: auth, pacing, 429, errors, redaction.

A thin client over ``httpx`` (the ``[rent]`` extra).  Every error text that leaves this
module has the API key replaced by ``***``: a platform may echo a bad key back in its error
body, and a key must never reach a notebook, a log or the ledger.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from ..errors import BadKey, NoAnswer, RateLimited, RentError

#: 429s waited out and retried before :class:`RateLimited` is raised, and the longest
#: Retry-After (seconds) waited for.
RETRIES_429 = 2
MAX_RETRY_WAIT = 30.0


def _httpx():
    try:
        import httpx
    except ImportError:  # pragma: no cover - the extra is missing
        raise RentError("renting needs httpx", "pip install 'gpumagic[rent]'") from None
    return httpx


class Redactor:
    """Replaces every secret it was given by ``***`` in a text."""

    def __init__(self, *secrets: str):
        self.secrets = [s for s in secrets if s]

    def __call__(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, "***")
        return text


class Api:
    """Requests to one platform's API.

    Parameters
    ----------
    provider : str
        Name used in messages (``lambda``).
    base_url : str
        Root of the API; each request's path is appended (configurable, so the tests' local
        servers stand in for the platform).
    key : str
        The API key (sent as ``Authorization: Bearer KEY``).
    auth_scheme : str
        The word before the key in ``Authorization`` (``""``: the key alone, as AutoDL wants).
    spacing : dict
        ``{path prefix or "": seconds}``: the least time between two requests (``""``: all
        requests; a longer prefix wins) -- a platform's published rate limit kept on our side.
    timeout : float
        Seconds to wait for an answer.
    error_text : callable
        ``(status, body) -> (code, message)`` from a platform's error body.
    """

    def __init__(self, provider: str, base_url: str, key: str, *, spacing: dict[str, float] | None = None,
                 timeout: float = 30.0, error_text: Callable[[int, Any], tuple[str, str]] | None = None,
                 retries_429: int = RETRIES_429, sleep: Callable[[float], None] = time.sleep,
                 auth_scheme: str = "Bearer"):
        if not key:
            raise BadKey(f"no API key for {provider}", f"run `%gpu provider login {provider}` first")
        self.provider = provider
        self.base_url = base_url.rstrip("/")
        self.redact = Redactor(key)
        self.spacing = dict(spacing or {})
        self.timeout = timeout
        self.error_text = error_text or (lambda status, body: ("", str(body)[:300]))
        self.retries_429 = retries_429
        self._sleep = sleep
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()
        httpx = _httpx()
        self._client = httpx.Client(headers={"Authorization": f"{auth_scheme} {key}".strip(),
                                             "Accept": "application/json"},
                                    timeout=timeout)
        #: Requests sent (method, path), for tests and the report.
        self.sent: list[tuple[str, str]] = []

    def close(self) -> None:
        self._client.close()

    def _pace(self, path: str) -> None:
        """Wait so that the spacing of every rule that covers ``path`` is kept."""
        with self._lock:
            now = time.monotonic()
            wait = 0.0
            rules = [p for p in self.spacing if path.startswith(p)]
            for p in rules:
                wait = max(wait, self._last.get(p, -1e9) + self.spacing[p] - now)
            if wait > 0:
                self._sleep(wait)
            now = time.monotonic()
            for p in rules:
                self._last[p] = now

    def request(self, method: str, path: str, *, json: Any = None, params: dict | None = None,
                base_url: str | None = None, timeout: float | None = None) -> Any:
        """Send one request; the decoded JSON body (``None`` for an empty one).

        Raises
        ------
        BadKey
            401 or 403.
        RateLimited
            429 still after :data:`RETRIES_429` waits of its Retry-After.
        RentError
            Any other error status (the platform's message), or no answer
            (``httpx.TimeoutException`` and ``httpx.TransportError`` are re-raised as the
            cause, so a caller can tell "no answer" from "refused").
        """
        httpx = _httpx()
        url = (base_url or self.base_url).rstrip("/") + path
        for attempt in range(self.retries_429 + 1):
            self._pace(path)
            self.sent.append((method, path))
            try:
                r = self._client.request(method, url, json=json, params=params,
                                         timeout=self.timeout if timeout is None else timeout)
            except httpx.TimeoutException as e:
                raise NoAnswer(f"{self.provider}: no answer to {method} {path} within "
                               f"{self.timeout if timeout is None else timeout:g} s",
                               "the platform may be slow; check `%gpu rentals` before trying again") from e
            except httpx.TransportError as e:
                raise NoAnswer(f"{self.provider}: cannot reach {self.redact(url)}: {self.redact(str(e))}",
                               "check the network (and a proxy), then try again") from e
            if r.status_code == 429:
                wait = _retry_after(r.headers.get("Retry-After"))
                if attempt < self.retries_429 and wait is not None and wait <= MAX_RETRY_WAIT:
                    self._sleep(wait)
                    continue
                shown = f"{wait:g} s" if wait is not None else "a while"
                raise RateLimited(f"{self.provider}: rate-limited (429 Too Many Requests)",
                                  f"wait {shown} and run it again", retry_after=wait)
            return self._answer(method, path, r)
        raise AssertionError("unreachable")  # pragma: no cover

    def _answer(self, method: str, path: str, r) -> Any:
        body: Any
        try:
            body = r.json() if r.content else None
        except ValueError:
            body = r.text
        if r.status_code < 400:
            return body
        code, message = self.error_text(r.status_code, body)
        message = self.redact(message or r.reason_phrase or "")
        if r.status_code == 401 or (r.status_code == 403 and code in ("", "global/invalid-api-key")):
            raise BadKey(f"{self.provider} refused the API key ({r.status_code}: {message})",
                         f"make a new key in the {self.provider} console and run "
                         f"`%gpu provider login {self.provider}`")
        err = RentError(f"{self.provider}: {method} {path} failed ({r.status_code}: {message})",
                        "see the message; `%gpu rentals` shows what exists now")
        err.status = r.status_code  # type: ignore[attr-defined]
        err.code = code  # type: ignore[attr-defined]
        raise err


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds (RFC 9110 §10.2.3: delay-seconds; an HTTP date is not waited for)."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None
