"""A set of named machines with a default: what one notebook kernel is connected to.

No module-level state: the IPython extension owns one :class:`Fleet`; scripts may make
their own.  (A fleet, not a "session": in gpumagic a session is a live Python session on a
machine, ``%gpu kernel``; a ledger's stretch of billing is a :class:`~gpumagic.budget.ledger.Rental`.)
"""

from __future__ import annotations

import atexit
import weakref

from .errors import NotConnected
from .machine import Machine, connect


class Fleet:
    """Named machines, the last connected being the default.

    ``close_all`` runs when the interpreter exits (stopping a sandbox sshd too).
    """

    def __init__(self):
        self.machines: dict[str, Machine] = {}
        self.default: str | None = None
        #: How to connect again to a machine that was disconnected (a sandbox is not a target).
        self._again: dict[str, str] = {}
        ref = weakref.ref(self)
        atexit.register(lambda: (s := ref()) is not None and s.close_all())

    def connect(self, target: str | None = None, **options) -> Machine:
        """Connect (see :func:`gpumagic.connect`) and make the machine the default.

        Connecting again under a name already used replaces (and closes) the old one.
        """
        m = connect(target, **options)
        old = self.machines.pop(m.name, None)
        if old is not None and old is not m:
            was = "sandbox (stopped)" if old.sandbox is not None else old.spec.address
            old.close()
            m.connection.notes.append(f"replaced the earlier {m.name}: {was}")
        self.machines[m.name] = m
        self.default = m.name
        return m

    def add(self, machine: Machine) -> Machine:
        self.machines[machine.name] = machine
        self.default = machine.name
        return machine

    def get(self, name: str | None = None) -> Machine:
        """The named machine, or the default.

        Raises
        ------
        NotConnected
            Naming the machines that are connected.
        """
        if name is None:
            if self.default is None:
                raise NotConnected("no machine is connected",
                                   "run `%gpu connect ALIAS` (or `%gpu connect --sandbox` to try it locally)")
            name = self.default
        try:
            return self.machines[name]
        except KeyError:
            known = ", ".join(sorted(self.machines)) or "none"
            raise NotConnected(f"no machine named {name!r} is connected (connected: {known})",
                               f"run `{self._again.get(name, f'%gpu connect {name}')}` first")

    def disconnect(self, name: str | None = None) -> Machine:
        """Close and forget one machine (default: the default one)."""
        m = self.get(name)
        if m.sandbox is not None:  # (closing forgets it)
            self._again[m.name] = ("%gpu connect --sandbox" if m.name == "sandbox"
                                   else f"%gpu connect --sandbox --name {m.name}")
        m.close()
        del self.machines[m.name]
        if self.default == m.name:
            self.default = next(reversed(self.machines), None) if self.machines else None
        return m

    def close_all(self) -> None:
        for m in list(self.machines.values()):
            try:
                m.close()
            except Exception:
                pass
        self.machines.clear()
        self.default = None
