"""``%gpu status --watch``: a status refreshed from a background thread.

The thread only fetches and hands each new :class:`~gpumagic.gpu.smi.GpuStatus` to a
callback; what shows it (a widget's values, never an Output widget from the thread) is the
caller's business (gpumagic/notebook/magics/gpu.py).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from ..errors import ConnectionLost, ConnectTimeout, GpumagicError
from .smi import GpuStatus

#: Seconds a refresh may wait on a path that went quiet before the watch says it reconnects.
STALL_AFTER = 1.0
#: Seconds before the refresh after one that lost its connection (it makes the new one).
RETRY_AFTER = 1.0

class Watcher:
    """Refresh a status every ``interval`` seconds from a background thread.

    Parameters
    ----------
    fetch : callable
        ``fetch(previous) -> GpuStatus``; may raise (connection trouble).
    on_update : callable
        Called from the thread with each new status (update widget values here; never
        write to an Output widget from a thread).
    on_stop : callable
        Called once with the reason the watch ended: from the thread that called
        :meth:`stop` (so a ``%gpu status --stop`` cell shows what it stopped), or from the
        watch thread when the watch ends by itself.
    interval : float
        Seconds between refreshes.
    is_connected : callable
        Checked before each refresh; False ends the watch ("disconnected").
    max_failures : int
        Consecutive failed refreshes that end the watch.
    stalled : callable, optional
        ``stalled() -> bool``: the connection's path went quiet (a roam, a dead path being
        replaced).  Looked at every 0.25 s while a refresh runs for :data:`STALL_AFTER`.
    on_reconnecting : callable, optional
        ``on_reconnecting(True)`` (from a thread) when a refresh waits on a quiet path or
        lost its connection, so the view can say ``reconnecting...``;
        ``on_reconnecting(False)`` before the next status that came through.
    """

    def __init__(self, fetch: Callable, on_update: Callable, on_stop: Callable, *,
                 interval: float, is_connected: Callable[[], bool] = lambda: True,
                 max_failures: int = 3, previous: GpuStatus | None = None,
                 stalled: Callable[[], bool] | None = None,
                 on_reconnecting: Callable[[bool], None] | None = None):
        if not (isinstance(interval, (int, float)) and 0 < interval < float("inf")):
            raise ValueError("interval must be a positive number of seconds")
        self.fetch, self.on_update, self.on_stop = fetch, on_update, on_stop
        self.interval = interval
        self.is_connected = is_connected
        self.max_failures = max_failures
        self.previous = previous
        self.refreshes = 0
        self.failures = 0
        self.reason = ""
        self._stop_reason = "stopped (%gpu status --stop)"
        self._stop = threading.Event()
        self._stopped_by_caller = False
        self._stop_told = False
        self.stalled, self.on_reconnecting = stalled, on_reconnecting
        #: True while the view says ``reconnecting...``.
        self.reconnecting = False
        #: When the last status came (``time.time()``; the start for ``previous``).
        self.refreshed_at = time.time()
        self._fetching_since: float | None = None
        self._state = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="gpumagic-status-watch", daemon=True)

    def start(self) -> "Watcher":
        self._thread.start()
        if self.stalled is not None and self.on_reconnecting is not None:
            threading.Thread(target=self._look, name="gpumagic-status-watch-look", daemon=True).start()
        return self

    def _say_reconnecting(self, now: bool) -> None:
        """Tell the view (under ``_state``), once per change."""
        if self.reconnecting != now and self.on_reconnecting is not None:
            self.reconnecting = now
            self.on_reconnecting(now)

    def _look(self) -> None:
        """While the watch runs: a refresh waiting on a quiet path means it reconnects."""
        while self._thread.is_alive() and not self._stop.wait(0.25):
            with self._state:
                since = self._fetching_since
                if (since is not None and time.monotonic() - since >= STALL_AFTER and not self.reconnecting
                        and self.stalled is not None and self.stalled()):
                    self._say_reconnecting(True)

    def _fetch(self) -> GpuStatus:
        with self._state:
            self._fetching_since = time.monotonic()
        try:
            status = self.fetch(self.previous)
        except (GpumagicError, OSError) as e:
            with self._state:
                self._fetching_since = None
                if isinstance(e, (ConnectionLost, ConnectTimeout)):  # the next refresh reconnects
                    self._say_reconnecting(True)
            raise
        with self._state:
            self._fetching_since = None
            self.refreshed_at = time.time()
            self._say_reconnecting(False)
        return status

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, reason: str = "stopped (%gpu status --stop)", wait: float = 5.0) -> None:
        """Ask the thread to end, and wait for it (``wait`` seconds at most); ``on_stop``
        receives ``reason``."""
        self._stop_reason = reason
        self._stopped_by_caller = threading.current_thread() is not self._thread
        self._stop.set()
        if self._thread.is_alive() and self._stopped_by_caller:
            self._thread.join(wait)
        if self._stopped_by_caller and not self._thread.is_alive() and not self._stop_told:
            self._stop_told = True
            self.on_stop(self.reason or reason)

    def _loop(self) -> None:
        reason = "stopped"
        wait = self.interval
        try:
            while not self._stop.wait(wait):
                wait = self.interval
                if not self.is_connected():
                    reason = "stopped: the machine is disconnected"
                    break
                try:
                    status = self._fetch()
                except (GpumagicError, OSError) as e:
                    self.failures += 1
                    if self.failures >= self.max_failures:
                        msg = getattr(e, "message", str(e))
                        reason = f"stopped after {self.failures} failed refreshes in a row ({msg})"
                        break
                    if self.reconnecting:
                        wait = min(self.interval, RETRY_AFTER)
                    continue
                self.failures = 0
                self.refreshes += 1
                self.previous = status
                self.on_update(status)
            else:
                reason = self._stop_reason
        except Exception as e:  # a bug in on_update: say so instead of dying silently
            reason = f"stopped: {type(e).__name__}: {e}"
        self.reason = reason
        if not self._stopped_by_caller and not self._stop_told:
            self._stop_told = True
            self.on_stop(reason)

