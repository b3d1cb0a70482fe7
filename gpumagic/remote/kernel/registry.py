"""The sessions this process has used on one machine (``machine.kernels``), as
jupyter_client's MultiKernelManager keeps a process's kernels."""

from __future__ import annotations

import atexit
import weakref
from typing import TYPE_CHECKING, Callable

from ...errors import KernelError
from .client import RemoteKernel
from .info import DEFAULT_NAME, check_name, list_kernels
from .outputs import Output, default_output

if TYPE_CHECKING:
    from ..._types import MachineLike


class Kernels:
    """The sessions of one machine that this process has used (``machine.kernel(NAME)``);
    each :class:`gpumagic.Machine` has one, as ``machine.kernels``."""

    def __init__(self, machine: MachineLike):
        self.machine = machine
        #: Makes the output of a call that names none: printed by default; the notebook's
        #: magics set theirs (rich display in the notebook) when the machine joins their fleet.
        self.output: Callable[[], Output] = default_output
        self.handles: dict[str, RemoteKernel] = {}
        #: The session used last: what ``%%remote --kernel`` without a name means.
        self.last: str | None = None
        ref = weakref.ref(self)  # acknowledge what was shown when this process exits
        atexit.register(lambda: (k := ref()) is not None and k.close())

    def handle(self, name: str) -> RemoteKernel:
        k = self.handles.get(name)
        if k is None:
            k = self.handles[name] = RemoteKernel(self.machine, name, lambda: self.output())
        return k

    def resolve(self, name: str | None) -> str:
        """``name``, or the one this process used last, or the machine's only one, or
        :data:`DEFAULT_NAME` when it has none.

        Raises
        ------
        KernelError
            Several sessions run and none was used yet: which one is meant?
        """
        if name:
            return check_name(name)
        if self.last:
            return self.last
        running = [k.name for k in list_kernels(self.machine) if k.running]
        if len(running) == 1:
            return running[0]
        if not running:
            return DEFAULT_NAME
        raise KernelError(f"{len(running)} sessions run on {self.machine.name} ({', '.join(running)})",
                          "name one: --kernel NAME")

    def get(self, name: str | None = None, *, start: bool = True, **options) -> RemoteKernel:
        """The session ``name`` (see :meth:`resolve`), started first when ``start`` and it
        does not run yet (``options``: see :meth:`RemoteKernel.start`)."""
        k = self.handle(self.resolve(name))
        if start:
            k.ensure(**options)
        self.last = k.name
        return k

    def forget(self, name: str) -> None:
        k = self.handles.pop(name, None)
        if k is not None:
            k.close()
        if self.last == name:
            self.last = None

    def close(self) -> None:
        for k in self.handles.values():
            k.close()
