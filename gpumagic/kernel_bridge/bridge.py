"""The kernel process a gpumagic kernelspec starts: a Jupyter kernel to its front end whose
cells run in a live session on the machine.

It binds the five sockets of the connection file the front end wrote (shell, control and
stdin as ROUTER, iopub as PUB, heartbeat as REP), checks and signs with that file's key
(:class:`jupyter_client.session.Session`), and relays the front end's requests, as they
are, to the session's keeper (:class:`gpumagic.remote.kernel.relay.Relay`); what the kernel
on the machine sends comes back signed with the front end's key, replies routed to the
socket identity that asked.  So message ids, parent headers and execution counts are the
machine's kernel's own, and ``kernel_info_reply`` carries its language info.

What the bridge answers itself (the rest is the kernel's):

``kernel_info_request`` on shell while the machine runs a cell of this bridge's
    The machine's kernel's last reply (its own comes only after the cell): a page reloaded
    mid-cell connects at once.

``interrupt_request`` (control; the kernelspec's ``interrupt_mode`` is ``message``)
    SIGINT to the kernel's process group on the machine (the keeper's ``interrupt``).
``shutdown_request``
    Detach: the bridge exits, the session runs on (``gpumagic kernel stop HOST`` stops it).
    With ``restart``, the keeper restarts the kernel first (a fresh namespace).
``execute_request`` of a cell made only of ``%gpu`` line magics
    Run here, on the laptop (:mod:`.local`).
``execute_request`` of a cell ``%gpu kernel attach``
    The output of the machine's running cell (or of its last one) from its first line, then
    what follows until it ends, shown in this cell (:meth:`Bridge.attach_cell`): after the
    front end's page was reloaded, the old cell's output has nowhere else to go.

After a reload
--------------
JupyterLab (4.x) shows a message's output only in a cell whose request that page sent: a
``KernelConnection`` feeds an output area through the future of its own ``execute_request``
(``@jupyterlab/services`` ``src/kernel/default.ts``, ``_handleMessage``: an iopub message whose
``parent_header.msg_id`` names no future of the page's goes only to the ``iopubMessage``
signal, which the notebook does not render).  A reloaded page has no futures, and a new client
id (``clientId = options.clientId ?? UUID.uuid4()``, not kept across a reload), so
jupyter_server does not hand it what it buffered while no page was connected either: its
buffer is keyed by ``kernel_id:session_id`` and dropped for another session id
(``services/kernels/connection/channels.py`` ``connect``; ``kernelmanager.py``
``get_buffer``).  The running cell's output keeps coming from the bridge, and the page drops
it; nothing a kernel sends can name the old cell again.  So the bridge keeps each cell's
output as it went out (:class:`CellRecord`), and a cell ``%gpu kernel attach`` shows it.

Threads: the main one owns every front-end socket (ZeroMQ sockets are not thread-safe); one
reads the session (connecting, and after a lost path connecting again) and hands each
message over through an ``inproc`` pair; one echoes heartbeats.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import io
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from ..errors import GpumagicError, KernelConnectionLost, KernelError
from ..remote.kernel import DEFAULT_NAME, wire
from ..remote.kernel.relay import Relay

log = logging.getLogger("gpumagic.kernel_bridge")

DELIM = b"<IDS|MSG>"
#: How many request ids the bridge remembers to route their replies (oldest forgotten first).
IDENTS_KEPT = 2000
#: Seconds an interrupt_request waits before it is sent on: jupyter_client's shutdown_kernel
#: (and so jupyter_server's, JupyterLab's "Shut Down Kernel") interrupts the kernel, then asks it
#: to shut down; under the detach rule that shutdown must not stop the running cell.
INTERRUPT_GRACE = 0.5
#: The machine's cells whose output the bridge keeps for ``%gpu kernel attach`` (newest).
CELLS_KEPT = 8
#: Bytes of one cell's output kept (its oldest outputs go first beyond it; a clear_output
#: empties it).
CELL_OUTPUT_KEPT = 16 * 2**20
#: The iopub messages that are a cell's output.
OUTPUTS = frozenset({"stream", "display_data", "update_display_data", "execute_result", "error"})
#: Seconds after a front end's first shell request with no iopub subscription heard, after
#: which the bridge publishes anyway (a front end that kept its sockets through a restart).
SUBSCRIBED_AFTER = 2.0
#: Seconds a restart asked by the front end may take before the bridge replies anyway.
RESTART_WAIT = 60.0
#: What ``kernel_info_reply`` says while the machine cannot be reached (the machine's kernel
#: answers with its own once it can).
FALLBACK_INFO = {
    "status": "ok", "protocol_version": "5.3", "implementation": "gpumagic-bridge",
    "implementation_version": "0", "banner": "gpumagic: the machine is not reachable yet",
    "language_info": {"name": "python", "mimetype": "text/x-python", "file_extension": ".py",
                      "version": "%d.%d.%d" % sys.version_info[:3],
                      "codemirror_mode": {"name": "ipython", "version": 3},
                      "pygments_lexer": "ipython3", "nbconvert_exporter": "python"},
    "help_links": [],
}


@dataclass
class BridgeOptions:
    """Where the session is: ``host`` (or the local ``sandbox``), the session's name, and
    the machine's Python to start it with when it does not run."""

    host: str | None = None
    sandbox: bool = False
    session: str = DEFAULT_NAME
    python: str | None = None


@dataclass
class CellRecord:
    """One machine cell's output as the bridge handed it on, for ``%gpu kernel attach``."""

    #: Its execution count (None: it began before this bridge, which saw only its end).
    count: int | None = None
    outputs: collections.deque = field(default_factory=collections.deque)
    size: int = 0
    #: Outputs left out: the oldest, beyond :data:`CELL_OUTPUT_KEPT`.
    dropped: int = 0
    done: bool = False

    def add(self, kind: str, content: dict, metadata: dict) -> None:
        if kind == "clear_output":
            self.outputs.clear()
            self.size = self.dropped = 0
            return
        size = len(json.dumps(content, default=str))
        self.outputs.append((kind, content, metadata, size))
        self.size += size
        while self.size > CELL_OUTPUT_KEPT and len(self.outputs) > 1:
            self.size -= self.outputs.popleft()[3]
            self.dropped += 1


@dataclass
class Follower:
    """A ``%gpu kernel attach`` cell that shows machine cells' output until they end."""

    idents: list
    header: dict
    cells: set
    count: int


def _no_passphrase(path: str) -> str:
    raise GpumagicError(f"the key {path} needs a passphrase and a kernel cannot ask for one",
                        "add it to ssh-agent (`ssh-add " + path + "`), then restart the kernel")


class Bridge:
    """One kernel process: the front end's sockets and the relay to the session."""

    def __init__(self, connection_file: str, options: BridgeOptions):
        import zmq
        from jupyter_client.session import Session

        with open(connection_file, encoding="utf-8") as f:
            info = json.load(f)
        self.options = options
        self.zmq = zmq
        self.session = Session(key=info["key"].encode(), signature_scheme=info.get("signature_scheme", "hmac-sha256"),
                               username="gpumagic-bridge")
        self.ctx = zmq.Context()
        transport, ip = info.get("transport", "tcp"), info.get("ip", "127.0.0.1")

        def url(port: int) -> str:
            return f"ipc://{ip}-{port}" if transport == "ipc" else f"tcp://{ip}:{port}"

        self.socks = {}
        for ch in ("shell", "control", "stdin"):
            s = self.ctx.socket(zmq.ROUTER)
            s.setsockopt(zmq.LINGER, 1000)
            s.bind(url(info[f"{ch}_port"]))
            self.socks[ch] = s
        # XPUB: the front end's subscription is heard, and nothing of the session's is published
        # before it (a PUB socket drops what it sends before a subscriber has joined)
        self.iopub = self.ctx.socket(zmq.XPUB)
        self.iopub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.iopub.setsockopt(zmq.SNDHWM, 0)
        self.iopub.setsockopt(zmq.LINGER, 1000)
        self.iopub.bind(url(info["iopub_port"]))
        self.hb_url = url(info["hb_port"])
        self.wake_recv = self.ctx.socket(zmq.PAIR)
        self.wake_recv.bind("inproc://gpumagic-bridge-wake")
        self.inbox: collections.deque = collections.deque()
        #: msg_id of a request -> the socket identities that sent it (where its reply goes).
        self.idents: collections.OrderedDict = collections.OrderedDict()
        self.last_shell: list[bytes] | None = None
        self.stop = threading.Event()
        #: The front end that started this process: when it is gone (killed, crashed), so is
        #: the bridge, as ipykernel's parent poller does (POSIX; the session runs on).
        self.parent = os.getppid() if os.name == "posix" else None
        self.relay: Relay | None = None
        #: Requests that came before the session was reached (sent through the relay once made).
        self.early: list[tuple[str, list[bytes], str | None]] = []
        self.lock = threading.Lock()
        self.machine = None
        #: Why the machine cannot be reached (answered to each request), or None.
        self.failed: GpumagicError | None = None
        self.retry = threading.Event()
        #: The session went away (stopped): none is started until the front end asks again.
        self.gone = False
        #: Local cells (``%gpu`` magics) waiting for the machine's cells before them.
        self.local_queue: collections.deque = collections.deque()
        self.local = None
        self.execution_count = 0
        #: A restart asked by the front end: (idents, header, deadline), answered once done.
        self.restarting: tuple | None = None
        #: When the front end's interrupt goes to the machine (monotonic), or None.
        self.interrupt_at: float | None = None
        #: A front end has subscribed to iopub: the session's messages may go out.
        self.subscribed = False
        #: When a front end first asked on shell while no subscription was heard (see
        #: :data:`SUBSCRIBED_AFTER`).
        self.asked_unsubscribed: float | None = None
        #: The machine's cells' output as it went out, by execute request id, oldest first.
        self.cells: collections.OrderedDict[str, CellRecord] = collections.OrderedDict()
        #: ``%gpu kernel attach`` cells still following a running cell.
        self.followers: list[Follower] = []
        #: The machine's kernel's last kernel_info_reply: what a kernel_info_request that comes
        #: while it runs a cell is answered with here.
        self.kernel_info: dict | None = None

    # -- the front end's side ------------------------------------------------------------

    def publish(self, msg_type: str, content: dict, parent: dict | None, metadata: dict | None = None) -> None:
        msg = self.session.msg(msg_type, content, parent={"header": parent} if parent else None,
                               metadata=metadata)
        self.session.send(self.iopub, msg, ident=f"kernel.gpumagic.{msg_type}".encode())

    def reply(self, ch: str, idents: list[bytes], parent: dict, msg_type: str, content: dict) -> None:
        self.session.send(self.socks[ch], msg_type, content, parent={"header": parent}, ident=idents)

    def forward(self, msg) -> None:
        """Hand one message of the session's to the front end, signed with its key."""
        if msg.ch == "keeper":
            self.keeper_event(msg.content)
            return
        parts = [wire.dumps(msg.header), wire.dumps(msg.parent), wire.dumps(msg.metadata),
                 wire.dumps(msg.content)]
        frames = [DELIM, self._sign(parts), *parts, *msg.buffers]
        kind, pid = msg.msg_type, msg.parent_id
        if kind in ("execute_input", "execute_reply") and isinstance(msg.content.get("execution_count"), int):
            self.execution_count = msg.content["execution_count"]
        if kind == "kernel_info_reply" and msg.content.get("status", "ok") == "ok":
            self.kernel_info = msg.content
        if msg.ch == "iopub":
            self.iopub.send_multipart([f"kernel.gpumagic.{kind}".encode(), *frames])
            self.record(kind, pid, msg)
        elif msg.ch in ("shell", "control"):
            idents = self.idents.pop(pid, None) if kind.endswith("_reply") else self.idents.get(pid)
            if idents is not None:  # else: a request of an earlier bridge's, or of another client
                self.socks[msg.ch].send_multipart([*idents, *frames])
        elif msg.ch == "stdin":
            idents = self.idents.get(pid) or self.last_shell
            if idents is not None:
                self.socks["stdin"].send_multipart([*idents, *frames])

    # -- %gpu kernel attach: a cell's output shown again ----------------------------------

    def record(self, kind: str, pid: str | None, msg) -> None:
        """Keep what a machine cell's request ``pid`` output (and show it to the attach cells
        following it); its idle status ends it."""
        if not pid or (msg.parent or {}).get("msg_type") != "execute_request":
            return
        cell = self.cells.get(pid)
        if cell is None:
            if kind not in ("execute_input", *OUTPUTS, "clear_output"):
                return
            cell = self.cells[pid] = CellRecord()
            while len(self.cells) > CELLS_KEPT:
                self.cells.popitem(last=False)
        if kind == "execute_input":
            cell.count = msg.content.get("execution_count")
        elif kind == "status" and msg.content.get("execution_state") == "idle":
            cell.done = True
            self.release_followers()
        elif kind in OUTPUTS or kind == "clear_output":
            cell.add(kind, msg.content, msg.metadata)
            for f in self.followers:
                if pid in f.cells:
                    self.publish(kind, msg.content, f.header, msg.metadata)

    def attach_cell(self, idents: list[bytes], header: dict, content: dict) -> None:
        """A cell ``%gpu kernel attach``: the output of the machine's cells still running (or
        of the last one, ended) from their first line, once, after one line that says whose it
        is; then what they output until they end, when this cell ends too."""
        count = self.execution_count
        self.publish("status", {"execution_state": "busy"}, header)
        self.publish("execute_input", {"code": content.get("code", ""), "execution_count": count}, header)
        running = [pid for pid, c in self.cells.items() if not c.done]
        shown = running or list(self.cells)[-1:]
        if not shown:
            self.publish("stream", {"name": "stderr", "text": f"[gpumagic: no cell of session "
                                    f"{self.options.session} has run since this kernel started]\n"}, header)
        for pid in shown:
            c = self.cells[pid]
            which = f"In [{c.count}]" if c.count is not None else "a cell started before this kernel process"
            state = "ended" if c.done else "is running"
            more = f"; its {c.dropped} oldest outputs were left out (over {CELL_OUTPUT_KEPT >> 20} MiB)" if c.dropped else ""
            self.publish("stream", {"name": "stderr", "text": f"[gpumagic: {which} {state}: its output from the "
                                    f"first line{'' if c.count is not None else ' this kernel saw'}{more}]\n"}, header)
            for kind, out, md, _ in c.outputs:
                self.publish(kind, out, header, md)
        if running:
            self.followers.append(Follower(idents, header, set(running), count))
        else:
            self._end_attach(idents, header, count)

    def end_cells(self) -> None:
        """The session's kernel died or was stopped: no cell of it runs on."""
        for c in self.cells.values():
            c.done = True
        self.release_followers()

    def release_followers(self) -> None:
        for f in [f for f in self.followers if all(self.cells.get(p) is None or self.cells[p].done for p in f.cells)]:
            self.followers.remove(f)
            self._end_attach(f.idents, f.header, f.count)

    def _end_attach(self, idents: list[bytes], header: dict, count: int) -> None:
        self.reply("shell", idents, header, "execute_reply",
                   {"status": "ok", "execution_count": count, "user_expressions": {}, "payload": []})
        self.publish("status", {"execution_state": "idle"}, header)

    def keeper_event(self, ev: dict) -> None:
        event = ev.get("event")
        log.info("session event: %s", event)
        if event == "restarted":
            self.end_cells()  # a cell that ran is gone with its kernel
        if event == "restarted" and self.restarting is not None:
            self.finish_restart()
        elif event in ("died", "stopped"):
            why = {"died": "the kernel on the machine died; its variables are lost",
                   "stopped": "the session was stopped"}[event]
            self.publish("stream", {"name": "stderr", "text": f"[gpumagic: {why}]\n"}, None)
            self.abandon_pending(why)
            self.end_cells()

    def abandon_pending(self, why: str) -> None:
        """Answer this front end's requests that the machine will never answer (its kernel
        died, the session was stopped) with an error, so that no cell waits for ever."""
        if self.relay is None:
            return
        for msg_id, parts in self.relay.forget_pending().items():
            idents = self.idents.pop(msg_id, None)
            if idents is None:
                continue
            header = json.loads(parts[0])
            kind = header.get("msg_type", "execute_request").replace("_request", "_reply")
            err = {"status": "error", "ename": "KernelDied", "evalue": why, "traceback": [f"KernelDied: {why}"],
                   "execution_count": self.execution_count}
            if kind == "execute_reply":
                self.publish("error", {k: err[k] for k in ("ename", "evalue", "traceback")}, header)
            self.reply("shell", idents, header, kind, err)
            self.publish("status", {"execution_state": "idle"}, header)

    def recv_request(self, ch: str) -> None:
        frames = self.socks[ch].recv_multipart()
        try:
            i = frames.index(DELIM)
        except ValueError:
            return
        idents, sig, parts, buffers = frames[:i], frames[i + 1], frames[i + 2:i + 6], frames[i + 6:]
        if len(parts) < 4 or not hmac.compare_digest(sig, self._sign(parts)):
            log.warning("dropped a message with a bad signature on %s", ch)
            return
        header = json.loads(parts[0])
        msg_id, kind = header.get("msg_id"), header.get("msg_type", "")
        self.idents[msg_id] = idents
        while len(self.idents) > IDENTS_KEPT:
            self.idents.popitem(last=False)
        if ch == "shell":
            self.last_shell = idents
            if not self.subscribed and self.asked_unsubscribed is None:
                self.asked_unsubscribed = time.monotonic()
        if ch == "control" and kind == "interrupt_request":
            # sent on after INTERRUPT_GRACE, unless a shutdown comes first (jupyter_client's
            # shutdown_kernel interrupts first: a detach must leave the running cell alone)
            self.interrupt_at = time.monotonic() + INTERRUPT_GRACE
            self.reply(ch, idents, header, "interrupt_reply", {"status": "ok"})
            return
        if ch == "control" and kind == "shutdown_request":
            self.shutdown_request(idents, header, json.loads(parts[3]))
            return
        if ch == "shell" and kind == "execute_request":
            from . import local

            content = json.loads(parts[3])
            if local.attaches(content.get("code", ""), self.options.session):
                self.attach_cell(idents, header, content)
                return
            if local.handles(content.get("code", "")):
                self.local_queue.append((idents, header, content))
                return
        # (a copy: the session's thread changes it; list() of a dict's values runs under the GIL)
        pending = list(self.relay.pending.values()) if self.relay is not None else []
        if ch == "shell" and kind == "kernel_info_request" and self.kernel_info is not None and pending:
            # the machine's kernel answers it only after the cell it runs: a page reloaded
            # meanwhile (JupyterLab sends nothing before this reply) could not run `%gpu kernel
            # attach` until then.  Busy, as the machine is, said for the request it runs
            # (JupyterLab ignores a status whose parent is a kernel_info_request, jupyter_server's
            # untracked_message_types); that request's idle says when it is not.
            running = json.loads(pending[0][0])
            self.reply("shell", idents, header, "kernel_info_reply", self.kernel_info)
            self.publish("status", {"execution_state": "busy"}, running)
            return
        if self.failed is not None and ch == "shell":
            self.answer_failed(idents, header, kind, json.loads(parts[3]))
            return
        if self.gone:
            self.retry.set()  # the session was stopped: this request starts a new one
        with self.lock:
            if self.relay is None:  # the machine is being reached: sent once it is
                self.early.append((ch, [*parts, *buffers], msg_id if ch == "shell" else None))
                return
        self.relay.send(ch, [*parts, *buffers], msg_id if ch == "shell" else None)

    def _sign(self, parts: list[bytes]) -> bytes:
        sig = self.session.sign(parts)
        return sig.encode() if isinstance(sig, str) else sig

    def answer_failed(self, idents, header, kind: str, content: dict) -> None:
        """Answer a request here while the machine cannot be reached: kernel_info with a
        plain Python's info, a cell with the error that says why (and try again)."""
        assert self.failed is not None
        self.publish("status", {"execution_state": "busy"}, header)
        if kind == "kernel_info_request":
            self.reply("shell", idents, header, "kernel_info_reply", FALLBACK_INFO)
        elif kind == "execute_request":
            err = self.failed
            where = "the sandbox" if self.options.sandbox else self.options.host
            evalue = f"cannot reach {where}: {err}"
            tb = [f"{type(err).__name__}: {evalue}"]
            self.publish("error", {"ename": type(err).__name__, "evalue": evalue, "traceback": tb}, header)
            self.reply("shell", idents, header, "execute_reply",
                       {"status": "error", "ename": type(err).__name__, "evalue": evalue, "traceback": tb,
                        "execution_count": self.execution_count})
            self.retry.set()
        else:
            self.reply("shell", idents, header, kind.replace("_request", "_reply"),
                       {"status": "error", "ename": type(self.failed).__name__, "evalue": str(self.failed)})
        self.publish("status", {"execution_state": "idle"}, header)

    def send_interrupt(self) -> None:
        """The front end's interrupt, once its grace passed: SIGINT on the machine."""
        self.interrupt_at = None
        with self.lock:
            if self.relay is not None:
                self.relay.op("interrupt")

    def shutdown_request(self, idents, header, content: dict) -> None:
        self.interrupt_at = None  # the interrupt before a shutdown: not the cell's end
        if content.get("restart") and self.relay is not None:
            self.relay.op("restart")
            self.restarting = (idents, header, time.monotonic() + RESTART_WAIT)
            return
        self.reply("control", idents, header, "shutdown_reply", {"status": "ok", "restart": False})
        self.stop.set()

    def finish_restart(self) -> None:
        assert self.restarting is not None
        idents, header, _ = self.restarting
        self.restarting = None
        self.reply("control", idents, header, "shutdown_reply", {"status": "ok", "restart": True})
        self.stop.set()

    # -- the session's side (its own thread) ---------------------------------------------

    def connect_machine(self):
        import gpumagic

        if self.options.sandbox:
            return gpumagic.connect(sandbox=True, passphrase_prompt=_no_passphrase)
        return gpumagic.connect(self.options.host, passphrase_prompt=_no_passphrase)

    def open_session(self) -> None:
        """Connect to the machine and attach to the session (started when it does not run)."""
        if self.machine is None:
            self.machine = self.connect_machine()
        k = self.machine.kernels.handle(self.options.session)
        with self.lock:
            if self.relay is None:
                self.relay = Relay(k, self.cursor_file())
                for ch, parts, msg_id in self.early:
                    self.relay.send(ch, parts, msg_id)
                self.early = []
        self.relay.ensure(python=self.options.python)

    def cursor_file(self) -> str:
        """Where this computer's bridges to the session keep what they handed on (the
        Jupyter runtime directory, which holds the connection files too)."""
        from jupyter_core.paths import jupyter_runtime_dir

        from .spec import _slug

        where = os.path.join(jupyter_runtime_dir(), "gpumagic-bridge")
        os.makedirs(where, mode=0o700, exist_ok=True)
        host = "sandbox" if self.options.sandbox else _slug(self.options.host or "")
        return os.path.join(where, f"{host}-{self.options.session}.cursor")

    def remote_loop(self) -> None:
        wake = self.ctx.socket(self.zmq.PAIR)
        wake.connect("inproc://gpumagic-bridge-wake")
        flight: list = []  # the in_flight() block held while a request waits, entered
        try:
            while not self.stop.is_set():
                if self.relay is None or not self.relay.connected:
                    if self.gone:  # stopped: a new session only when the front end asks again
                        self.retry.wait()
                        self.retry.clear()
                        self.gone = False
                        continue
                    if not self._attach(wake):
                        continue
                self._in_flight(flight)
                try:
                    msg = self.relay.next(0.2)
                except KernelConnectionLost as e:
                    log.info("lost the path to the session (%s); connecting again", e)
                    try:
                        self.relay.reconnect(self.stop)
                    except KernelError as gone:
                        self._gone(gone, wake)
                    except GpumagicError:
                        pass  # stopped while waiting
                    continue
                except KernelError as gone:
                    self._gone(gone, wake)
                    continue
                if msg is not None:
                    self.inbox.append(msg)
                    wake.send(b"")
        finally:
            if flight:
                flight.pop().__exit__(None, None, None)
            wake.close(linger=0)

    def _in_flight(self, flight: list) -> None:
        """While a request of this front end's waits for its reply (a cell runs), the path is
        watched as a running cell's is (:meth:`Connection.in_flight`): a roam is noticed
        within seconds and the path made again, not after the keepalives give up."""
        assert self.relay is not None and self.machine is not None
        busy = bool(self.relay.pending)
        if busy and not flight:
            block = self.machine.connection.in_flight()
            block.__enter__()
            flight.append(block)
        elif flight and not busy:
            flight.pop().__exit__(None, None, None)

    def _attach(self, wake) -> bool:
        try:
            self.open_session()
        except GpumagicError as e:
            log.warning("cannot reach the session: %s", e)
            self.failed = e
            wake.send(b"")
            self.retry.clear()
            self.retry.wait()  # a cell asks again
            return False
        if self.failed is not None:
            self.failed = None
        return True

    def _gone(self, why: KernelError, wake) -> None:
        """The session's keeper went away (stopped, the machine restarted): a new session
        is started for the next requests, and the front end told."""
        log.warning("the session went away: %s", why)
        self.gone = True
        self.inbox.append(("note", f"[gpumagic: {why}; the next cell starts a new session]\n"))
        wake.send(b"")
        if self.relay is not None:
            self.relay.kernel._link = None
            self.inbox.append(("abandon", str(why)))

    # -- the main loop -------------------------------------------------------------------

    def heartbeat(self) -> None:
        s = self.ctx.socket(self.zmq.REP)
        s.setsockopt(self.zmq.LINGER, 0)
        s.bind(self.hb_url)
        try:
            self.zmq.proxy(s, s)
        except self.zmq.ZMQError:
            pass  # the context was ended
        finally:
            s.close(linger=0)

    def drain_inbox(self) -> None:
        handed = False
        while self.inbox and self.subscribed:
            item = self.inbox.popleft()
            if isinstance(item, tuple):
                if item[0] == "abandon":
                    self.abandon_pending(item[1])
                    self.end_cells()
                else:
                    self.publish("stream", {"name": "stderr", "text": item[1]}, None)
                continue
            self.forward(item)
            if item.seq is not None and self.relay is not None:
                self.relay.delivered(item.seq)
                handed = True
        if handed and self.relay is not None:
            self.relay.ack()

    def run_local_cells(self) -> None:
        """Run the waiting ``%gpu`` cells once no cell of this front end's is queued on the
        machine (in order with them)."""
        from . import local

        while self.local_queue and (self.relay is None or not self.relay.pending):
            idents, header, content = self.local_queue.popleft()
            if self.local is None:
                self.local = local.LocalMagics(self)
            self.local.execute(idents, header, content)

    def serve(self) -> int:
        zmq = self.zmq
        threading.Thread(target=self.heartbeat, daemon=True, name="gpumagic-bridge-hb").start()
        remote = threading.Thread(target=self.remote_loop, daemon=True, name="gpumagic-bridge-session")
        remote.start()
        poller = zmq.Poller()
        by_sock = {s: ch for ch, s in self.socks.items()}
        for s in by_sock:
            poller.register(s, zmq.POLLIN)
        poller.register(self.wake_recv, zmq.POLLIN)
        poller.register(self.iopub, zmq.POLLIN)
        while not self.stop.is_set():
            for s, _ in poller.poll(50 if self.interrupt_at is not None else 200):
                if s is self.iopub:
                    while self.iopub.poll(0):
                        if self.iopub.recv()[:1] == b"\x01":
                            log.info("a front end subscribed to iopub")
                            self.subscribed = True
                elif s is self.wake_recv:
                    while self.wake_recv.poll(0):
                        self.wake_recv.recv()
                    self.drain_inbox()
                else:
                    self.recv_request(by_sock[s])
            if (not self.subscribed and self.asked_unsubscribed is not None
                    and time.monotonic() - self.asked_unsubscribed >= SUBSCRIBED_AFTER):
                # a front end that kept its sockets through a restart asks, and its SUB
                # socket's subscription never reached this new process: publish, as
                # ipykernel always does (it would wait for kernel_info's status for good)
                log.info("a front end asks on shell and no iopub subscription came: publishing")
                self.subscribed = True
            self.drain_inbox()
            if self.interrupt_at is not None and time.monotonic() >= self.interrupt_at:
                self.send_interrupt()
            self.run_local_cells()
            if self.restarting is not None and time.monotonic() > self.restarting[2]:
                self.finish_restart()
            if self.parent not in (None, 1) and os.getppid() != self.parent:
                log.info("the front end that started this kernel is gone: detaching")
                break
        self.close()
        return 0

    def close(self) -> None:
        """Detach: acknowledge what was handed on, close the path (the session runs on)."""
        self.stop.set()
        self.retry.set()
        if self.relay is not None:
            try:
                self.relay.close()
            except Exception:  # noqa: BLE001 - leaving anyway
                pass
        if self.machine is not None:
            # (a sandbox says on stdout which sessions it leaves running: the front end's
            # kernel log is no place for it, and detaching leaves them by design)
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                self.machine.close()
        for s in [*self.socks.values(), self.iopub, self.wake_recv]:
            s.close(linger=1000)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m gpumagic.kernel_bridge", allow_abbrev=False,
                                description="A Jupyter kernel whose cells run in a live session on a machine "
                                            "(started by a kernelspec that `gpumagic kernel install` wrote).")
    p.add_argument("-f", dest="connection_file", required=True, help="the connection file the front end wrote")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--host", help="a ~/.ssh/config alias or user@host[:port]")
    where.add_argument("--sandbox", action="store_true", help="the local sandbox machine")
    p.add_argument("--session", default=DEFAULT_NAME, help="the session's name on the machine")
    p.add_argument("--python", help="the machine's Python to start the session with")
    args = p.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[gpumagic bridge %(levelname)s] %(message)s"))
    log.addHandler(handler)
    log.setLevel(os.environ.get("GPUMAGIC_BRIDGE_LOG", "WARNING").upper())
    # as ipykernel: Ctrl-C in the terminal that started the front end does not end the kernel
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    bridge = Bridge(args.connection_file, BridgeOptions(args.host, args.sandbox, args.session, args.python))

    def on_term(*_):
        bridge.stop.set()

    signal.signal(signal.SIGTERM, on_term)
    return bridge.serve()
