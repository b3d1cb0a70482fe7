"""The environment that cells, sessions and jobs on one machine start with (``machine.env``).

Three layers beyond the exec environment of a plain ``ssh host cmd``, later ones winning: what
an interactive login shell adds (conda's or pyenv's PATH, variables exported after
``~/.bashrc``'s "not interactive, return" line), gpumagic's own settings on the machine
(``~/.gpumagic/env``: ``HF_ENDPOINT`` from ``%gpu mirrors hf``), and what this computer lends
while it lends it (the proxy's variables of ``%gpu proxy on``, handed in as a function).  The
first two are read in one round trip (:func:`gpumagic.remote.execution.read_environment`)
once per connection; the third is asked each time, because it is true only while its
tunnel is.
"""

from __future__ import annotations

from typing import Callable, Mapping

from ..ssh.connection import Connection
from . import execution


def _nothing_lent() -> Mapping[str, str | None]:
    return {}


class Environment:
    """The environment of new cells, sessions and jobs on one machine (:attr:`Machine.env
    <gpumagic.Machine.env>`): :meth:`login` and :meth:`settings`, read once per
    connection, and :meth:`current`, what a new process gets.  A running session keeps the
    environment it started with.

    Parameters
    ----------
    connection : Connection
        The machine's connection (read again after each reconnect).
    lent : callable, optional
        The variables this computer lends the machine now (``None``: unset); the machine
        hands in its proxy's (:meth:`gpumagic.net.Net.environment`).
    """

    def __init__(self, connection: Connection, lent: Callable[[], Mapping[str, str | None]] = _nothing_lent):
        self.connection = connection
        self._lent = lent
        self._read: tuple[int, dict[str, str | None], dict[str, str]] | None = None

    def login(self) -> dict[str, str | None]:
        """The differences of an interactive ``ssh host`` login (``None``: unset), read once
        per connection; see :func:`gpumagic.remote.execution.read_environment`."""
        return self._environment()[1]

    def settings(self) -> dict[str, str]:
        """gpumagic's own settings for every cell, session and job on this machine
        (``~/.gpumagic/env`` there: ``HF_ENDPOINT`` from ``%gpu mirrors hf``), read with
        :meth:`login`."""
        return self._environment()[2]

    def forget(self) -> None:
        """Read the login environment and the settings again before the next cell (after a
        change to the machine's dotfiles or ``~/.gpumagic/env``)."""
        self._read = None

    def current(self) -> dict[str, str | None]:
        """What a new cell, session or job starts with beyond the exec environment
        (``None``: unset): :meth:`login`, then :meth:`settings`, then what is lent now (the
        proxy's variables while ``%gpu proxy on``), later ones winning."""
        _, login, settings = self._environment()
        return {**login, **settings, **self._lent()}

    def _environment(self) -> tuple[int, dict[str, str | None], dict[str, str]]:
        self.connection.ensure_alive()  # before every cell: a dead path is left here
        opened = self.connection.opened_count
        if self._read is None or self._read[0] != opened:
            execution.prestart_runner(self.connection)  # starts while the probe runs
            self._read = (opened, *execution.read_environment(self.connection))
        return self._read
