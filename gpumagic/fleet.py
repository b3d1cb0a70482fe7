"""A set of named machines with a default: what one notebook kernel is connected to.

No module-level state: the IPython extension owns one :class:`Fleet`; scripts may make
their own.  (A fleet, not a "session": in gpumagic a session is a live Python session on a
machine, ``%gpu kernel``; a ledger's stretch of billing is a :class:`~gpumagic.budget.ledger.Rental`.)
"""

from __future__ import annotations

import atexit
import weakref
from typing import TYPE_CHECKING, Callable

from .errors import NotConnected
from .machine import Machine, connect
from .remote.move import Start, StartRecord, check_move, find_start

if TYPE_CHECKING:
    from .remote.kernel import Output


class Fleet:
    """Named machines, the last connected being the default.

    ``close_all`` runs when the interpreter exits (stopping a sandbox sshd too).
    """

    def __init__(self, kernel_output: Callable[[], Output] | None = None):
        self.machines: dict[str, Machine] = {}
        #: Makes the output of a session call that names none, for each machine connected
        #: here (the magics hand in the notebook's display); None: each machine's own (printed).
        self.kernel_output = kernel_output
        self.default: str | None = None
        #: How to connect again to a machine that was disconnected (a sandbox is not a target).
        self._again: dict[str, str] = {}
        atexit.register(_close_at_exit, weakref.ref(self))

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
        return self.add(m)

    def add(self, machine: Machine) -> Machine:
        if self.kernel_output is not None:
            machine.kernels.output = self.kernel_output
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

    def job_record(self, job: str, started_on: str | None = None) -> StartRecord:
        """What this computer recorded of the start of detached job ``job`` on machine
        ``started_on`` (default: the newest record of any machine's that was not moved away;
        its ``machine`` names where it runs), for a move or resume
        (:meth:`gpumagic.remote.move.Moves.take`); the machine need not be connected.

        Raises
        ------
        JobError
            When no record of that job is here.
        """
        return find_start(job, started_on)

    def check_move(self, job: str, rec: StartRecord, to: str, *, yes: bool = False, src: str | None = None,
                   torchrun: int | str | None = None, from_start: bool = False, no_src: bool = False) -> None:
        """What a move of ``job`` (started as ``rec`` says) to ``to`` would refuse, checked
        before that machine exists (``new:PROVIDER...``, yet to be rented; the messages name
        it so, and the commands they suggest work as typed): it reads only
        (:func:`gpumagic.remote.move.check_move`).

        Raises
        ------
        JobError
            As the move would (one line that says what to do).
        """
        check_move(self.machines.get(rec.machine), to, job, rec=rec, yes=yes, src=src, torchrun=torchrun,
                   how=Start(from_start=from_start, no_src=no_src))

    def close_all(self) -> None:
        for m in list(self.machines.values()):
            try:
                m.close()
            except Exception:
                pass
        self.machines.clear()
        self.default = None


def _close_at_exit(ref: "weakref.ref[Fleet]") -> None:
    """Close a fleet's machines when the interpreter exits (stopping a sandbox sshd too),
    unless the fleet is gone already."""
    fleet = ref()
    if fleet is not None:
        fleet.close_all()
