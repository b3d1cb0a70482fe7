"""Widgets made on the machine, shown and moved in this notebook: a comm bridge.

ipywidgets (and ``tqdm.notebook``, ``interact``) talk to the front end over comms (Jupyter's
``comm_open``, ``comm_msg``, ``comm_close``): a widget is a comm whose id is its model id.
A session on the machine opens its comms towards its keeper, where no front end listens.
The bridge gives each of them a twin in this notebook's kernel, with the same id and target:

* the session opens a comm -> this kernel opens its twin (``comm.create_comm`` with that
  ``comm_id``), so the front end gets the model, and the ``display_data`` that names its
  model id renders it; the notebook's saved widget state holds it as it holds local ones;
* the session sends on it (a value changed, a progress bar advanced) -> the twin sends the
  same data and buffers; the session closes it -> the twin closes;
* the front end sends on the twin (a slider dragged to 7) -> the bridge passes the message
  to the session with the front end's own message id (:meth:`RemoteKernel.comm_send`), and
  shows what the session did in answer.  An Output widget there captured that output under
  the id, and the front end puts it in the widget here; the front end closing the twin
  closes the comm there.

A comm the front end opens itself (``jupyter.widget.control``, asking for every widget's
state after a page reload) is this kernel's, not the session's: widgets made on the machine
come back with the saved widget state of the notebook, not live.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, MutableMapping


def bridge(bridges: MutableMapping[Any, "CommBridge"], kernel, new_output: Callable[[], Any]) -> "CommBridge":
    """The bridge of ``kernel`` (a :class:`gpumagic.remote.kernel.RemoteKernel`) in
    ``bridges`` (the notebook's, by session: a ``weakref.WeakKeyDictionary``), made on first
    use: one per session for the notebook's life, since its widgets outlive the cell that made
    them.  ``new_output()`` makes the output that shows what the session does in answer to the
    front end (the magics' ``NotebookOutput``)."""
    b = bridges.get(kernel)
    if b is None:
        b = bridges[kernel] = CommBridge(kernel, new_output)
    return b


class CommBridge:
    """The twins of one session's comms in this kernel (see the module docstring)."""

    def __init__(self, kernel, new_output: Callable[[], Any]):
        self._kernel = weakref.ref(kernel)
        self._new_output = new_output
        self.comms: dict[str, Any] = {}

    def from_session(self, kind: str, content: dict, metadata: dict, buffers: list) -> None:
        """A ``comm_open``, ``comm_msg`` or ``comm_close`` the session sent."""
        comm_id = content.get("comm_id")
        if not comm_id:
            return
        data, buffers = content.get("data") or {}, list(buffers or [])
        if kind == "comm_open":
            self._open(comm_id, content, metadata, buffers)
            return
        twin = self.comms.get(comm_id)
        if twin is None:  # opened before this process followed the session
            return
        if kind == "comm_msg":
            twin.send(data=data, metadata=metadata, buffers=buffers)
        elif kind == "comm_close":  # (closing here calls no on_close: that is the front end's)
            del self.comms[comm_id]
            twin.close(data=data, metadata=metadata, buffers=buffers)

    def _open(self, comm_id: str, content: dict, metadata: dict, buffers: list) -> None:
        import comm

        old = self.comms.pop(comm_id, None)
        if old is not None:  # the session opened the same id again (a replay): the new one wins
            old.close()
        twin = comm.create_comm(comm_id=comm_id, target_name=content.get("target_name", "comm"),
                                target_module=content.get("target_module"),
                                data=content.get("data") or {}, metadata=metadata, buffers=buffers)
        twin.on_msg(lambda msg: self._from_front_end("comm_msg", comm_id, msg))
        twin.on_close(lambda msg: self._closed_here(comm_id, msg))
        self.comms[comm_id] = twin

    def _from_front_end(self, kind: str, comm_id: str, msg: dict) -> None:
        kernel = self._kernel()
        if kernel is None:
            return
        out = self._new_output()
        try:
            kernel.comm_send(comm_id, (msg.get("content") or {}).get("data") or {},
                             buffers=[bytes(b) for b in msg.get("buffers") or []], msg_type=kind,
                             msg_id=(msg.get("header") or {}).get("msg_id"), output=out)
        finally:
            out.finish()

    def _closed_here(self, comm_id: str, msg: dict) -> None:
        """The front end closed a twin (comm's on_close runs for the front end's comm_close
        only, never for our own close()): close the session's comm too."""
        self.comms.pop(comm_id, None)
        self._from_front_end("comm_close", comm_id, msg)
