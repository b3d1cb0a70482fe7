"""Work cut by a lost connection goes on over a new one: one policy for cells, syncs and the
live session.

The connection notices that its path died (:meth:`Connection.in_flight`'s probes while work
is in flight, :meth:`Connection.ensure_alive` before new work).  What happens next is the same
for every kind of work, and it is here:

* try a new connection; after a try that fails, pause :attr:`Reconnect.pause` seconds,
  doubled after each failure up to :attr:`Reconnect.max_pause`;
* until :attr:`Reconnect.grace` seconds have passed since the old path last brought a packet
  (the time without the machine, not the time spent trying);
* once that takes longer than :attr:`Reconnect.say_after` seconds, say so once, with the grace
  left (a roam is over in one connect and says nothing);
* one piece of work reconnects at most :attr:`Reconnect.times` times;
* a failure of the path (refused, timed out, dropped, no route) is tried again; one that
  another try cannot mend (a changed host key, a refused login) ends the wait at once.

Each kind of work says only what it does once the new path is up, in the ``ready`` function
it hands to :meth:`Reconnects.again`:

* a cell takes a runner on the new connection and re-attaches to its kept cell
  (:mod:`gpumagic.remote.execution`);
* a sync stops the agents the old connection left and resumes: complete files stay, a large
  file goes on from its part (:mod:`gpumagic.sync.engine`);
* the session opens a channel to its keeper, which replays what came meanwhile, and sends
  again a request the keeper never got (:mod:`gpumagic.remote.kernel.client`).

A tunnel has no work in flight between two local connections: its next request takes the new
path that :meth:`Connection.ensure_alive` makes.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, TypeVar

import paramiko

from ..errors import ConnectionLost, ConnectionRefused, ConnectTimeout, GpumagicError, HostNotFound

if TYPE_CHECKING:
    from .connection import Connection

T = TypeVar("T")

#: The failures of a path that a later try may not meet (the network is back, the machine
#: rebooted): tried again until the grace is over.  Every other error ends the wait.
PATH_FAILURES: tuple[type[BaseException], ...] = (
    ConnectionLost, ConnectionRefused, ConnectTimeout, HostNotFound, paramiko.SSHException, EOFError, OSError)


@dataclass(frozen=True)
class Reconnect:
    """How work cut by a lost connection seeks a new one (see the module docstring)."""

    #: Seconds without the machine, counted from the old path's last packet, after which no
    #: new connection is sought (0: a single try).
    grace: float = 600.0
    #: Reconnects one piece of work makes at most (None: as many as the grace allows).
    times: int | None = None
    #: Seconds between two failed tries at first; doubled after each, up to ``max_pause``.
    pause: float = 0.5
    max_pause: float = 5.0
    #: Seconds of seeking after which it is said, once (a roam takes one connect); 0: said
    #: before each try (a progress bar, which shows the state it is in).
    say_after: float = 1.0

    def but(self, **changes) -> "Reconnect":
        """This policy with ``changes`` (``policy.but(grace=30)``)."""
        return dataclasses.replace(self, **changes)


class GaveUp(Exception):
    """No new path: the grace passed without a connection (``out_of`` is ``"grace"``), or
    the work used its :attr:`Reconnect.times` (``"times"``).  ``last`` says why the last try
    failed (empty for ``"times"``)."""

    def __init__(self, out_of: str, last: str = ""):
        super().__init__(out_of, last)
        self.out_of = out_of
        self.last = last


class Reconnects:
    """One piece of work's reconnects on ``conn`` under ``policy``.  ``say(left)`` is called
    once a wait for a new connection has taken :attr:`Reconnect.say_after` seconds, with the
    seconds of grace left (from a timer thread: a connect may block for its timeout)."""

    def __init__(self, conn: "Connection", policy: Reconnect,
                 say: Callable[[float], None] | None = None):
        self.conn = conn
        self.policy = policy
        self.say = say
        #: Reconnects made so far.
        self.count = 0
        #: While a new connection is sought: when the grace is over (``time.monotonic()``).
        self.ends: float | None = None
        #: Whether the last wait took long enough to be said.
        self.said = False

    def deadline(self) -> float:
        """When the grace would be over were the path dead now: ``grace`` seconds after the
        last packet the path brought."""
        return self.conn.last_heard() + self.policy.grace

    def again(self, ready: Callable[[], T | None], deadline: float | None = None,
              stop: threading.Event | None = None) -> T:
        """A new connection, and what ``ready()`` makes on it: its result, or None when the
        new connection cannot take the work yet (tried again 0.2 s later, within the grace).
        ``deadline``: when the grace is over (default :meth:`deadline`); ``stop``: an event
        that ends the wait (a closing kernel bridge).

        Raises
        ------
        GaveUp
            The grace passed first (``"grace"``), the work had its reconnects (``"times"``),
            or ``stop`` was set (``"stop"``).
        GpumagicError
            A failure another try cannot mend (a changed host key, a refused login).
        """
        policy = self.policy
        if policy.times is not None and self.count >= policy.times:
            raise GaveUp("times")
        ends = self.ends = self.deadline() if deadline is None else deadline
        said = threading.Event()

        def say() -> None:
            said.set()
            if self.say is not None:
                self.say(ends - time.monotonic())

        timer = threading.Timer(policy.say_after, say)
        timer.daemon = True
        if policy.say_after > 0:
            timer.start()
        pause, last = policy.pause, ""
        try:
            while True:
                if policy.say_after <= 0:
                    say()  # before each try: a progress bar shows the grace left as it runs
                try:
                    self.conn.ensure_alive()
                    got = ready()
                    if got is not None:
                        self.count += 1
                        return got
                    wait = 0.2
                except PATH_FAILURES as e:
                    last = e.message if isinstance(e, GpumagicError) else f"{type(e).__name__}: {e}"
                    wait, pause = pause, min(2 * pause, policy.max_pause)
                left = ends - time.monotonic()
                if left <= 0:
                    raise GaveUp("grace", last)
                if stop is None:
                    time.sleep(min(wait, left))
                elif stop.wait(min(wait, left)):
                    raise GaveUp("stop", last)
        finally:
            timer.cancel()
            self.ends = None
            self.said = said.is_set()


#: The policy: cells, syncs and the session use it, each with its own grace or count
#: (``RECONNECT.but(grace=30)``).
RECONNECT = Reconnect()

__all__ = ["GaveUp", "PATH_FAILURES", "RECONNECT", "Reconnect", "Reconnects"]
