"""One session on a machine (:class:`RemoteKernel`): start, execute, follow its output
across reconnects, interrupt, restart, stop, and move variables both ways."""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping


from ...errors import (GpumagicError, Interrupted, KernelConnectionLost, KernelError,
                       RemoteKernelError, RemoteTimeout)
from ..._format import duration
from ...ssh import reconnect
from . import wire
from .info import KERNELS_DIR, KernelInfo, check_name, list_kernels
from .link import Message, _Link, _Lost, _programs_tar, _q
from .outputs import ExecuteResult, Output, default_output
from . import variables

if TYPE_CHECKING:
    from ..._types import MachineLike

#: Seconds to wait for a cell to stop after an interrupt before saying it ignores SIGINT.
INTERRUPT_WAIT = 5.0
#: Seconds a kernel may take to start (imports on a slow disk).
START_TIMEOUT = 120.0
#: Seconds between acknowledgements while output streams.
ACK_INTERVAL = 0.5
#: Seconds after a cell ends before what it showed is acknowledged (unless a request
#: carries the acknowledgement first).
ACK_DELAY = 0.2
#: How a running cell's new connection is sought when its path is lost while it is followed
#: (:mod:`gpumagic.ssh.reconnect`): within the grace, at most 3 times a cell.  The keeper
#: keeps its output, which is shown once, in order, after each reconnect.
RECONNECT = reconnect.RECONNECT.but(times=3)
#: Seconds a widget's message (a slider moved) is followed for what the session shows in answer.
COMM_WAIT = 30.0
#: Jupyter messaging protocol version spoken.
PROTOCOL_VERSION = "5.3"


class _Waiter:
    """What one request still waits for: its shell/control reply and its iopub idle."""

    def __init__(self, msg_id: str, reply_type: str, need_idle: bool = True):
        self.msg_id = msg_id
        self.reply_type = reply_type
        self.reply: Message | None = None
        self.idle = not need_idle
        #: Any message of the request's came (the kernel took it).
        self.seen = False
        #: The request as sent (its frames), to send again when it may not have arrived.
        self.parts: list[bytes] = []

    @property
    def done(self) -> bool:
        return self.reply is not None and self.idle


class RemoteKernel:
    """One named Jupyter kernel on a machine, kept by a detached keeper.

    Get one with :meth:`gpumagic.Machine.kernel`.  Every method reconnects by itself when
    the SSH connection dropped; output that arrived meanwhile is shown first, once.

    Parameters
    ----------
    machine : Machine
    name : str
        Session name (letters, digits, ``-``, ``_``).
    default_output : callable, optional
        Makes the :class:`Output` of a call that names none (default: printed,
        :class:`TextOutput`); the notebook's magics hand in theirs through ``machine.kernels``.
    """

    def __init__(self, machine: MachineLike, name: str,
                 default_output: Callable[[], Output] = default_output):
        self.machine = machine
        self.default_output = default_output
        self.name = check_name(name)
        self.session_id = uuid.uuid4().hex
        self.python: str | None = None
        #: The kernel's working directory on the machine (from its state, once connected).
        self.cwd: str | None = None
        self._link: _Link | None = None
        #: The keeper's ``state.json`` as read at the last connect (its pid and port name it).
        self.keeper_state: dict = {}
        self._last_seq = 0          # the last message shown by this process
        self._acked = 0
        self._ack_time = 0.0
        self._welcome: dict = {}
        self._away_parents: set[str] = set()
        self._restarting = False
        self._lock = threading.RLock()
        #: The ids of the requests sent lately (insertion-ordered), so that no id is used twice.
        self._sent_ids: dict[str, None] = {}
        self._sent_parts: list[bytes] = []
        #: Requests sent again after a lost path (the keeper runs each once).
        self.resent = 0
        #: Bytes per variable of the last :meth:`pull`.
        self.last_pull_sizes: dict[str, int] = {}
        #: Where the session's comms (widgets) go between cells: the output of the last
        #: request that carried one; its listener thread (:meth:`_listen`) once there is one.
        self._comm_output: Output | None = None
        self._closed = False
        self._listener: threading.Thread | None = None
        #: Comm messages passed on between cells (counted for the tests).
        self.comms_between_cells = 0

    @property
    def where(self) -> str:
        """``machine:session``, for messages."""
        return f"{self.machine.name}:{self.name}"

    @property
    def remote_dir(self) -> str:
        """The session's folder on the machine, where its keeper keeps the kernel's state,
        token and logs (``$HOME`` left for the remote shell to expand)."""
        return f"$HOME/{KERNELS_DIR}/{self.name}"

    def __repr__(self) -> str:
        return f"<RemoteKernel {self.where}{' linked' if self._link else ''}>"

    # -- life cycle -----------------------------------------------------------------------

    def start(self, *, python: str | None = None, cwd: str | None = None,
              env: Mapping[str, str] | None = None, install: bool = False,
              output: Output | None = None) -> dict:
        """Start the kernel on the machine unless it already runs; returns the keeper's
        answer (``status``: ``started`` or ``running``, plus the state).

        Parameters
        ----------
        python : str, optional
            The machine's Python for the kernel (default ``python3`` on the login PATH).
        cwd : str, optional
            The kernel's working directory (default: the machine's, see ``%gpu cd``).
        env : mapping, optional
            Extra environment variables (on top of the login environment).  ``MPLBACKEND``
            defaults to the inline backend (plots come back as PNG).
        install : bool
            Where ``python`` lacks ipykernel, run ``python -m pip install ipykernel`` first.

        Raises
        ------
        KernelError
            No such python, no ipykernel in it (naming the exact pip command), no such
            directory, or the kernel failed to start (with the end of its log).
        """
        py = python or "python3"
        answer = self._launch(py, cwd, env)
        if answer.get("status") == "no-ipykernel" and install:
            where = answer.get("python") or py
            out = output or self.default_output()
            out.note(f"installing ipykernel into {where} on {self.machine.name} ...")
            r = self.machine.run([where, "-m", "pip", "install", "ipykernel"],
                                 stdout=lambda t: out.stream("stdout", t),
                                 stderr=lambda t: out.stream("stderr", t))
            if r.exit_code != 0:
                raise KernelError(f"`{where} -m pip install ipykernel` failed on {self.machine.name} "
                                  f"(exit code {r.exit_code})",
                                  "see its output above; a python without pip needs "
                                  "`python -m ensurepip` or the system's python3-pip first")
            answer = self._launch(py, cwd, env)
        status = answer.get("status")
        if status == "no-ipykernel":
            where = answer.get("python") or py
            raise KernelError(f"{where} on {self.machine.name} has no ipykernel: install it with "
                              f"`{where} -m pip install ipykernel` (or add --install)")
        if status == "no-cwd":
            raise KernelError(f"no directory {answer.get('cwd')} on {self.machine.name}",
                              "create it first (`mkdir -p DIR` in a %%remote cell), or fix --cwd")
        if status == "running":
            self.python = (answer.get("state") or {}).get("python")
        elif status == "started":
            self.python = answer.get("python")
            self._last_seq = self._acked = 0
        else:
            raise KernelError(f"the kernel {self.where} did not start: "
                              f"{answer.get('why') or answer.get('error') or answer}",
                              f"check `{py}` on the machine (`{py} -m ipykernel --version`)")
        return answer

    def ensure(self, **options) -> dict | None:
        """Connect to the session, starting it first (``options``: see :meth:`start`) when
        it does not run; returns the start's answer, or None when it was running."""
        try:
            self._connect()
            return None
        except KernelError:
            pass
        answer = self.start(**options)
        self._connect()
        return answer

    def _launch(self, python: str, cwd: str | None, env: Mapping[str, str] | None) -> dict:
        digest, tar = _programs_tar()
        progs = f"$HOME/{KERNELS_DIR}/.programs/{digest}"
        full_env = {**self.machine.env.current(), **(env or {})}
        full_env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        unset = [a for k, v in full_env.items() if v is None for a in ("-u", k)]
        assigns = [f"{k}={v}" for k, v in full_env.items() if v is not None]
        workdir = cwd if cwd is not None else (self.machine.cwd or "")
        # the sandbox's sessions stop by themselves once left idle (the sandbox is this
        # computer: no release ends them); a rented machine's run until stopped
        idle = self.machine.session_idle_stop
        idle_arg = f" --idle-stop {idle:g}" if idle else ""
        # `~` is expanded by the keeper (os.path.expanduser), relative paths start at HOME.
        # The keeper's files are private (umask 077); the kernel gets the login umask (`um`),
        # so what a cell creates has the modes a local kernel or a --python cell gives.
        command = (
            f'um=$(umask) && umask 077 && mkdir -p "$HOME/{KERNELS_DIR}" && chmod 700 "$HOME/{KERNELS_DIR}" && '
            f'mkdir -p "{progs}" && tar -xf - -C "{progs}" && cd && '
            f"exec env {_q(*unset, *assigns)} {_q(python)} "
            f'"{progs}/kernel_keeper.py" start {_q(self.name)} --cwd {_q(workdir)} --umask "$um" '
            f'--startup "{progs}/kernel_startup.py"{idle_arg}')
        r = self.machine.exec(command, stdin=tar, timeout=START_TIMEOUT)
        line = r.stdout.strip().splitlines()[-1:] if r.stdout.strip() else []
        if line:
            try:
                return json.loads(line[0])
            except ValueError:
                pass
        err = r.stderr.strip()
        last = (err or r.stdout).strip().splitlines()[-1] if (err or r.stdout).strip() else ""
        if r.exit_code in (126, 127) and last.startswith("env:") and python in last:
            raise KernelError(f"no python {python!r} on {self.machine.name} ({last})",
                              "give --python the path of a Python 3 there (`which python3` in a %%remote cell)")
        raise KernelError(f"the kernel {self.where} did not start (exit code {r.exit_code}): {last}",
                          f"check `{python}` on the machine (`{python} -m ipykernel --version`), and "
                          "that it has `tar` and a writable ~/.gpumagic")

    def info(self) -> KernelInfo | None:
        """This session's entry in :func:`list_kernels` (None when there is none)."""
        return next((k for k in list_kernels(self.machine) if k.name == self.name), None)

    def _connect(self) -> _Link:
        """The channel to the keeper, (re)opened as needed: also when the connection's path
        went dead without a word (a roam), which :meth:`Connection.ensure_alive` finds out
        and replaces; the keeper then replays what this client has not seen."""
        self.machine.connection.ensure_alive()
        link = self._link
        if link is not None and link.lost is None and not link.closed \
                and self.machine.connection.is_connected and link.opened == self.machine.connection.opened_count:
            return link
        if link is not None:
            link.close()
            self._link = None
        r = self.machine.exec(f'cd "{self.remote_dir}" 2>/dev/null && cat state.json && '
                              f"printf '\\n\\036\\n' && cat token", timeout=30)
        state_text, sep, token = r.stdout.partition("\n\x1e\n")
        if r.exit_code != 0 or not sep:
            raise KernelError(f"no session {self.name!r} on {self.machine.name}",
                              f"start it: `%gpu kernel start {self.name}` (machine.kernel({self.name!r}))")
        state = self.keeper_state = json.loads(state_text)
        self.python, self.cwd = state.get("python"), state.get("cwd")
        try:
            link = _Link(self.machine, int(state["port"]), token.strip(), self._last_seq)
        except _Lost:
            raise KernelError(f"the session {self.name!r} on {self.machine.name} is gone (its keeper "
                              "is not running: the machine restarted, or it was killed); its "
                              "variables are lost",
                              f"`%gpu kernel start {self.name}` starts a new one") from None
        self._link = link
        msg = self._next(link, 30)
        if msg is None or msg.op != "welcome":
            link.close()
            self._link = None
            raise KernelError(f"the keeper of {self.where} did not answer", "try again; "
                              f"`%gpu kernel stop {self.name}` then start, if it repeats")
        self._welcome = msg.content
        # the keeper streams from after what was acknowledged (by any client): what came
        # before is shown already, so a sync waits for nothing of it
        self._last_seq = max(self._last_seq, int(msg.content.get("acked") or 0))
        return link

    def _next(self, link: _Link, timeout: float) -> Message | None:
        try:
            return link.get(timeout)
        except _Lost:
            self._lost()

    def _lost(self):
        link, self._link = self._link, None
        why = (link.lost if link else None) or "the channel closed"
        if link:
            link.close()
        if self.machine.connection.is_connected and link and link.opened == self.machine.connection.opened_count:
            # the SSH connection is fine: the keeper itself went away
            raise KernelError(f"the session {self.where} ended ({why})",
                              f"`%gpu kernel list` shows its state; `%gpu kernel start {self.name}` "
                              "starts a new one")
        raise KernelConnectionLost(
            f"lost the connection to {self.machine.name} while following session {self.name} "
            f"({why}); a running cell keeps running there and its output is kept",
            f"`%gpu kernel attach {self.name}` shows what it printed meanwhile, then follows it "
            "(gpumagic reconnects by itself)")

    # -- requests -------------------------------------------------------------------------

    def _message(self, msg_type: str, content: dict, msg_id: str | None = None) -> tuple[str, list[bytes]]:
        msg_id = msg_id or uuid.uuid4().hex
        header = {"msg_id": msg_id, "msg_type": msg_type, "username": "gpumagic",
                  "session": self.session_id, "date": datetime.now(timezone.utc).isoformat(),
                  "version": PROTOCOL_VERSION}
        return msg_id, [wire.dumps(header), b"{}", b"{}", wire.dumps(content)]

    def _send(self, link: _Link, ch: str, msg_type: str, content: dict, *, msg_id: str | None = None,
              buffers: Iterable[bytes] = ()) -> str:
        if msg_id in self._sent_ids:  # a request's id names one request
            msg_id = None
        msg_id, parts = self._message(msg_type, content, msg_id)
        self._sent_parts = [*parts, *buffers]
        self._sent_ids[msg_id] = None
        while len(self._sent_ids) > 1000:
            del self._sent_ids[next(iter(self._sent_ids))]
        try:
            link.send({"op": "send", "ch": ch, "ack": self._last_seq}, [*parts, *buffers])
        except _Lost:
            self._lost()
        self._acked = max(self._acked, self._last_seq)
        return msg_id

    def _op(self, link: _Link, op: str) -> None:
        try:
            link.send({"op": op})
        except _Lost:
            self._lost()

    def _ack_soon(self, link: _Link) -> None:
        """Acknowledge what was shown ACK_DELAY seconds from now (from a timer thread), unless
        a request carries it first: not in the way of the cell that just ended."""
        if self._last_seq <= self._acked:
            return
        timer = threading.Timer(ACK_DELAY, self._ack, (link,), {"force": True})
        timer.daemon = True
        timer.start()

    def _ack(self, link: _Link, force: bool = False) -> None:
        now = time.monotonic()
        seq = self._last_seq
        if seq > self._acked and (force or now - self._ack_time >= ACK_INTERVAL) and not link.closed:
            try:
                link.send({"op": "ack", "seq": seq})
                self._acked, self._ack_time = max(self._acked, seq), now
            except _Lost:
                pass  # not acknowledged: a new process shows it again, this one skips it

    def execute(self, code: str, *, output: Output | None = None, silent: bool = False,
                store_history: bool = True, allow_stdin: bool = True,
                timeout: float | None = None, capture: bool = True, raise_error: bool = True,
                user_expressions: Mapping[str, str] | None = None) -> ExecuteResult:
        """Run ``code`` in the session, showing its output as it comes.

        Output of earlier cells that was not shown yet (printed while the laptop was away)
        is shown first, once, after a note.

        Parameters
        ----------
        code : str
        output : Output, optional
            Where output goes (default: :attr:`default_output`'s: the notebook's display for a
            machine connected in one, else printed).
        silent, store_history, allow_stdin, user_expressions
            As in Jupyter's ``execute_request``.
        timeout : float, optional
            Seconds; then the cell is interrupted and :class:`RemoteTimeout` raised.
        capture : bool
            Keep stdout/stderr text and display bundles in the result (off: flat memory
            for huge outputs).
        raise_error : bool
            Raise :class:`RemoteKernelError` when the cell raised (else show its traceback
            and return the result with ``status == "error"``).

        Returns
        -------
        ExecuteResult

        Raises
        ------
        RemoteKernelError
            The cell raised; its traceback is the machine's.
        Interrupted
            A KeyboardInterrupt here interrupted the cell (the session and its variables
            are kept); the message says when the cell ignored SIGINT.
        KernelConnectionLost
            The SSH connection dropped; the cell keeps running (``attach`` shows it).
        KernelError
            No such session, or the kernel died (the message says how).
        RemoteTimeout
        """
        with self._lock:
            out = output or self.default_output()
            link = self._connect()
            if self._welcome.get("state") == "dead":
                self._catch_up(link, out)
                raise self._died_error({"event": "died", "exit_code": self._welcome.get("exit_code")})
            content = {"code": code, "silent": silent, "store_history": store_history,
                       "user_expressions": dict(user_expressions or {}), "allow_stdin": allow_stdin,
                       "stop_on_error": True}
            start = time.monotonic()
            # the notebook's own request id where there is one: output the session sends in
            # answer then names it as its parent, as a widget made there (an Output widget,
            # interact) expects of the front end that shows it
            msg_id = self._send(link, "shell", "execute_request", content, msg_id=out.request_id())
            waiter = _Waiter(msg_id, "execute_reply")
            waiter.parts = self._sent_parts
            result = ExecuteResult()
            deadline = start + timeout if timeout is not None else None
            try:
                with self.machine.connection.in_flight():
                    link = self._follow(link, out, waiter, result, capture, deadline)
            except _Deadline:
                self._interrupt_and_wait(link, out, waiter, result, capture)
                raise RemoteTimeout(f"the cell ran past its timeout of {timeout:g} s in session "
                                    f"{self.where} and was interrupted (the session is kept)",
                                    "raise --timeout, or run long work as a job (%%remote --job)")
            except KeyboardInterrupt:
                if self._interrupt_and_wait(link, out, waiter, result, capture):
                    raise Interrupted(f"interrupted the cell in session {self.where}; the session "
                                      "and its variables are kept") from None
                raise Interrupted(
                    f"the cell in session {self.where} did not stop within {INTERRUPT_WAIT:g} s of "
                    "an interrupt (it ignores SIGINT, or runs C code that does not check for it) "
                    f"and still runs there; `%gpu kernel restart {self.name}` stops it "
                    "(its variables are lost)") from None
            finally:
                self._ack_soon(link)
                result._join()
            result.seconds = time.monotonic() - start
            reply = waiter.reply.content
            self._show_payloads(out, reply, result if capture else None)
            result.status = reply.get("status", "error")
            result.execution_count = reply.get("execution_count")
            result.user_expressions = reply.get("user_expressions") or {}
            if result.status == "aborted":
                raise KernelError(f"the cell was not run in session {self.where}: an earlier "
                                  "cell failed and Jupyter skips the cells queued after it",
                                  "run it again")
            if result.status == "error":
                result.error = RemoteKernelError.named(reply.get("ename", "Error"), reply.get("evalue", ""),
                                                       reply.get("traceback", []), self.where)
                if raise_error:
                    raise result.error
                out.stream("stderr", "\n".join(result.error.traceback) + "\n")
            return result

    def comm_send(self, comm_id: str, data: dict, *, buffers: Iterable[bytes] = (),
                  msg_type: str = "comm_msg", msg_id: str | None = None,
                  output: Output | None = None, timeout: float = COMM_WAIT) -> None:
        """Pass a front end's message for a comm (a widget) to the session: a ``comm_msg``
        (a slider moved) or ``comm_close``; then show what the session did in answer (an
        ``interact`` function's output, widget updates) until it is idle again, or for at
        most ``timeout`` seconds (the rest is shown with the next cell).

        ``msg_id`` is the front end's own message id: the session names it as the parent of
        what it sends in answer, so an Output widget there captures that output here.
        """
        with self._lock:
            out = output or self.default_output()
            link = self._connect()
            rid = self._send(link, "shell", msg_type, {"comm_id": comm_id, "data": data},
                             msg_id=msg_id, buffers=buffers)
            try:
                self._pump(link, out, own=rid, until_idle=True, deadline=time.monotonic() + timeout)
            except _Deadline:
                pass
            finally:
                self._ack_soon(link)

    def _follow(self, link: _Link, out: Output, waiter: _Waiter, result: ExecuteResult,
                capture: bool, deadline: float | None) -> _Link:
        """Show the cell's output until its reply and idle (:meth:`_pump`).  When the SSH
        connection is lost meanwhile (a roam: noticed within seconds, the cell being in
        flight), connect again as :data:`RECONNECT` says, and go on: the keeper replays what
        came meanwhile, shown once, in order.  Returns the link in use.

        Raises
        ------
        KernelConnectionLost
            No new connection could be made within the grace (or the cell had its
            reconnects), or the request had not reached the session (the kernel is idle and
            knows nothing of it: run it again).
        """
        lost: KernelConnectionLost | None = None

        def say(left: float) -> None:
            out.note(f"[gpumagic: reconnecting to {self.machine.name} ({lost.message if lost else ''}); "
                     f"grace left {duration(left)}, the session runs on there meanwhile]")

        seeking = reconnect.Reconnects(self.machine.connection, RECONNECT, say)
        while True:
            try:
                self._pump(link, out, own=waiter.msg_id, waiter=waiter, result=result,
                           capture=capture, deadline=deadline)
                return link
            except KernelConnectionLost as e:
                lost = e
            try:
                link = seeking.again(self._connect)
            except KernelError:
                raise
            except (reconnect.GaveUp, GpumagicError):  # no new connection: the loss is the news
                raise lost from None  # (set: the only way here)
            if seeking.said:
                out.note(f"[gpumagic: reconnected to {self.machine.name}; the cell's output goes on]")
            sync = self._sync(link, out, own=waiter.msg_id, waiter=waiter, result=result,
                              capture=capture)
            if waiter.done:
                return link
            if not waiter.seen and sync.get("state") == "idle" and waiter.parts:
                # the path went as the request was sent, and nothing of it came: sent again,
                # with its id (the keeper passes on a request it had already once only)
                try:
                    link.send({"op": "send", "ch": "shell", "ack": self._last_seq}, waiter.parts)
                except _Lost:
                    self._lost()
                self.resent += 1

    def _interrupt_and_wait(self, link, out, waiter, result, capture) -> bool:
        """Interrupt the kernel, then show output until the cell's reply (True) or until
        INTERRUPT_WAIT seconds or a second KeyboardInterrupt (False)."""
        try:
            self._op(link, "interrupt")
            self._pump(link, out, own=waiter.msg_id, waiter=waiter, result=result, capture=capture,
                       deadline=time.monotonic() + INTERRUPT_WAIT)
            return True
        except (_Deadline, KeyboardInterrupt):
            return False

    def _pump(self, link: _Link, out: Output, *, own: str | None = None,
              waiter: _Waiter | None = None, result: ExecuteResult | None = None,
              capture: bool = False, deadline: float | None = None,
              until_seq: int | None = None, until_idle: bool = False) -> None:
        """Show messages, in order, until ``waiter`` is done, or (without one) until message
        ``until_seq`` was handled and, with ``until_idle``, the cell ``own`` went idle.

        Raises
        ------
        _Deadline
            Past ``deadline`` (``time.monotonic()``).
        KernelError
            The kernel died or the session was stopped.
        """
        idle = False
        while True:
            if waiter is not None:
                if waiter.done:
                    return
            elif (until_seq is None or self._last_seq >= until_seq) and (idle or not until_idle):
                return
            if deadline is not None and time.monotonic() > deadline:
                raise _Deadline()
            wait = 0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
            msg = self._next(link, wait)
            if msg is None:
                continue
            if self._dispatch(link, out, msg, own, waiter, result, capture) == "idle":
                idle = True
                if waiter is not None:
                    waiter.idle = True

    def _dispatch(self, link: _Link, out: Output, msg: Message, own: str | None,
                  waiter: _Waiter | None = None, result: ExecuteResult | None = None,
                  capture: bool = False, death_is_news: bool = False) -> str | None:
        """Handle one message; returns ``"idle"`` when the cell ``own`` went idle, or the
        keeper event's name.  A kernel's death raises, or with ``death_is_news`` is noted."""
        if msg.seq is None or msg.seq <= self._last_seq:
            return None  # a reply to this client, or shown before the connection dropped
        self._last_seq = msg.seq
        if msg.ch == "keeper":
            ev = msg.content
            if ev.get("event") in ("died", "restarted"):
                self._welcome["state"] = "dead" if ev["event"] == "died" else "idle"
            if ev.get("event") == "stopped" or (ev.get("event") == "died" and not death_is_news):
                self._ack(link, force=True)
                raise self._died_error(ev)
            if ev.get("event") == "died":
                out.note(f"[gpumagic: {self._died_error(ev).message}]")
            if ev.get("event") == "restarted":
                self._away_parents.clear()
                if not self._restarting:  # someone else restarted it
                    out.note(f"[gpumagic: session {self.where} was restarted; its variables are gone]")
            self._ack(link)
            return ev.get("event")
        pid, kind, said = msg.parent_id, msg.msg_type, None
        if waiter is not None and pid == waiter.msg_id:
            waiter.seen = True
        if msg.ch == "iopub":
            if kind in _COMM_TYPES:
                out.comm(self, kind, msg.content, msg.metadata, msg.buffers)
                self._listen_between_cells(out)
            elif kind == "status":
                if own is not None and pid == own and msg.content.get("execution_state") == "idle":
                    said = "idle"
            elif kind in _OUTPUT_TYPES:
                mine = own is not None and pid == own
                if not mine and pid and pid not in self._away_parents:
                    self._away_parents.add(pid)
                    out.note(f"[gpumagic: output of an earlier cell in session {self.where}, kept "
                             "on the machine while no notebook was following it:]")
                self._render(out, msg, result if mine else None, capture, show_error=not mine)
        elif msg.ch in ("shell", "control"):
            if waiter is not None and pid == waiter.msg_id and kind == waiter.reply_type:
                waiter.reply = msg
        elif msg.ch == "stdin" and kind == "input_request":
            self._answer_input(link, out, msg)
        self._ack(link)
        return said

    def _render(self, out: Output, msg: Message, result: ExecuteResult | None, capture: bool,
                show_error: bool) -> None:
        c, t = msg.content, msg.msg_type
        if t == "stream":
            text = c.get("text", "")
            out.stream(c.get("name", "stdout"), text)
            if result is not None and capture:
                result._collect(c.get("name", "stdout"), text)
        elif t in ("display_data", "execute_result", "update_display_data"):
            data, md = c.get("data", {}), c.get("metadata", {})
            display_id = (c.get("transient") or {}).get("display_id")
            if t == "execute_result" and not show_error:  # the value of the cell followed
                out.result(data, md)
            else:  # a display, or an earlier cell's value replayed: shown, not this cell's value
                out.display(data, md, display_id, update=t == "update_display_data")
            if result is not None:
                if t == "execute_result":
                    result.result = {"data": data, "metadata": md}
                if capture:
                    result.outputs.append({"data": data, "metadata": md})
        elif t == "clear_output":
            out.clear(bool(c.get("wait")))
        elif t == "error" and show_error:
            lines = c.get("traceback") or [f"{c.get('ename')}: {c.get('evalue')}"]
            out.stream("stderr", "\n".join(lines) + "\n")

    @staticmethod
    def _show_payloads(out: Output, reply: dict, result: ExecuteResult | None) -> None:
        """Show the execute_reply's pager payloads (``source: page``: what ``len?``,
        ``%pinfo`` and ``%page`` show) as a local kernel's frontend does: in the pager
        (:meth:`Output.page`); kept in ``result.outputs`` when captured.  Other payloads
        (``set_next_input``, ``ask_exit``, ``edit_magic``) act on a frontend and are dropped."""
        for payload in reply.get("payload") or []:
            if not isinstance(payload, dict) or payload.get("source") != "page":
                continue
            data = payload.get("data")
            if not isinstance(data, dict) or not data:
                continue
            out.page(data)
            if result is not None:
                result.outputs.append({"data": data, "metadata": {}})

    def _answer_input(self, link: _Link, out: Output, msg: Message) -> None:
        c = msg.content
        try:
            value = out.ask(c.get("prompt", ""), bool(c.get("password")))
        except (EOFError, KernelError, RuntimeError, OSError):
            value = ""  # nothing here can answer: the machine's input() gets an empty line
            out.note("[gpumagic: the machine asked for input and nothing here can answer it; "
                     "it got an empty line]")
        self._send(link, "stdin", "input_reply", {"value": value, "status": "ok"})

    def _died_error(self, ev: dict) -> KernelError:
        if ev.get("event") == "stopped":
            return KernelError(f"the session {self.where} was stopped",
                               f"`%gpu kernel start {self.name}` starts a new one")
        code = ev.get("exit_code")
        how = "exited"
        if isinstance(code, int) and code < 0:
            how = f"killed by signal {-code}{_signal_words(-code, ev.get('signal'), ev.get('signal_text'))}"
        elif code is not None:
            how = f"exit code {code}"
        # the keeper sends only what the kernel logged after it was ready (not its start-up
        # warnings); a fatal error's own line says most
        lines = [ln.strip() for ln in (ev.get("log") or ev.get("why") or "").strip().splitlines() if ln.strip()]
        tail = next((ln for ln in lines if ln.startswith("Fatal Python error")), lines[-1] if lines else "")
        detail = f"; its log ends: {tail}" if tail else ""
        return KernelError(f"the kernel of session {self.where} died ({how}); its variables are "
                           f"lost{detail}", f"`%gpu kernel restart {self.name}` starts a new one")

    def _sync(self, link: _Link, out: Output, own: str | None = None,
              death_is_news: bool = False, waiter: _Waiter | None = None,
              result: ExecuteResult | None = None, capture: bool = False) -> dict:
        """Ask the keeper where its journal ends, show everything up to there (what
        ``waiter``'s request got on the way, recorded there), return its status
        (``state``, ``busy_msg``, ``since``, ``last``...)."""
        self._op(link, "sync")
        sync = None
        while sync is None or self._last_seq < sync.get("last", 0):
            msg = self._next(link, 30)
            if msg is None:
                raise KernelError(f"the keeper of {self.where} did not answer", "try again")
            if msg.seq is None and msg.op == "sync":
                sync = msg.content
                self._welcome["state"] = sync.get("state")
            elif self._dispatch(link, out, msg, own, waiter, result, capture,
                                death_is_news=death_is_news) == "idle" and waiter is not None:
                waiter.idle = True
        return sync

    def _catch_up(self, link: _Link, out: Output, death_is_news: bool = False) -> dict:
        try:
            return self._sync(link, out, death_is_news=death_is_news)
        finally:
            self._ack(link, force=True)

    def attach(self, *, output: Output | None = None, follow: bool = True) -> dict:
        """Show what the session printed that was not shown yet (once, in order), then,
        when a cell is running and ``follow``, its output live until it ends.

        A KeyboardInterrupt stops following, never the cell (:meth:`interrupt` does that).

        Returns
        -------
        dict
            The keeper's status at the end (``state``, ``busy_msg``, ``since``...).

        Raises
        ------
        KernelError, KernelConnectionLost
        """
        with self._lock:
            out = output or self.default_output()
            link = self._connect()
            try:
                sync = self._sync(link, out)
                if sync.get("state") == "dead":
                    raise self._died_error({"event": "died", "exit_code": sync.get("exit_code")})
                busy = sync.get("busy_msg") if sync.get("state") == "busy" else None
                if busy and follow:
                    since = sync.get("since")
                    clock = time.strftime("%H:%M:%S", time.localtime(since)) if since else "?"
                    self._away_parents.add(busy)  # its output needs no "earlier cell" note
                    out.note(f"[gpumagic: following the cell running in session {self.where} since "
                             f"{clock}; interrupting stops following, not the cell]")
                    try:
                        self._pump(link, out, own=busy, until_idle=True)
                    except KeyboardInterrupt:
                        out.note(f"[gpumagic: stopped following; the cell still runs in session "
                                 f"{self.where} (`%gpu kernel interrupt {self.name}` stops it)]")
                    sync = self._sync(link, out)
                return sync
            finally:
                self._ack(link, force=True)

    def interrupt(self) -> None:
        """Send SIGINT to the kernel's process group (what Jupyter's stop button does); the
        running cell gets KeyboardInterrupt, the session and its variables stay."""
        with self._lock:
            self._op(self._connect(), "interrupt")

    def restart(self, *, output: Output | None = None) -> None:
        """Stop the kernel (all of its processes) and start a new one with the same
        python, directory and environment; every variable is lost.

        Raises
        ------
        KernelError
            When the new kernel does not start.
        """
        with self._lock:
            out = output or self.default_output()
            link = self._connect()
            self._catch_up(link, out, death_is_news=True)
            self._op(link, "restart")
            deadline = time.monotonic() + START_TIMEOUT
            self._restarting = True
            try:
                while time.monotonic() < deadline:
                    msg = self._next(link, 1.0)
                    if msg is not None and self._dispatch(link, out, msg, None) == "restarted":
                        self._ack(link, force=True)
                        return
            finally:
                self._restarting = False
            raise KernelError(f"the kernel of {self.where} did not restart within {START_TIMEOUT:g} s",
                              "`%gpu kernel list` shows its state")

    def stop(self) -> None:
        """Stop the kernel and its keeper and remove its files on the machine (the session's
        variables are lost).  Safe when it already stopped."""
        self._closed = True
        with self._lock:
            try:
                link = self._connect()
            except KernelError:
                # no keeper: remove what a dead one left behind
                self.machine.exec(f'rm -rf "{self.remote_dir}"', timeout=30)
                return
            self._op(link, "stop")
            deadline = time.monotonic() + 15
            try:
                while time.monotonic() < deadline:
                    msg = link.get(0.5)
                    if msg is not None and msg.ch == "keeper" and msg.content.get("event") == "stopped":
                        break
            except _Lost:
                pass
            link.close()
            self._link = None
            # the keeper removes its directory as it exits; wait for that, briefly
            self.machine.exec(f'for i in 1 2 3 4 5 6 7 8 9 10; do [ -d "{self.remote_dir}" ] || exit 0; '
                              "sleep 0.5; done", timeout=30)

    def _listen_between_cells(self, out: Output) -> None:
        """Pass the session's comm messages on as they come, also while no cell runs (a
        widget a thread there updates: a local kernel's front end sees each change at once;
        here they waited for the next cell)."""
        self._comm_output = out
        self._closed = False
        if self._listener is None or not self._listener.is_alive():
            self._listener = threading.Thread(target=self._listen, daemon=True,
                                              name=f"gpumagic-kernel-comms-{self.name}")
            self._listener.start()

    def _listen(self) -> None:
        """While no request holds the session, each comm message at the head of the link's
        queue is dispatched here; anything else waits for the next request, which shows it
        first, as output that came between cells (a thread's print, with its note)."""
        looked: Message | None = None
        while not self._closed:
            link = self._link
            if link is None or link.closed:
                time.sleep(0.2)
                continue
            head = link.wait_head(0.5, after=looked)
            if head is None:
                continue
            if head.ch != "iopub" or head.msg_type not in _COMM_TYPES:
                looked = head  # for the next request: wait for what comes after it
                continue
            if not self._lock.acquire(blocking=False):  # a request runs: it shows them
                time.sleep(0.05)
                continue
            try:
                while link is self._link and self._comm_output is not None:
                    head = link.wait_head(0)
                    if head is None or head.ch != "iopub" or head.msg_type not in _COMM_TYPES:
                        break
                    msg = link.get(0)
                    if msg is not None:
                        self._dispatch(link, self._comm_output, msg, None)
                        self.comms_between_cells += 1
                looked = head
            except Exception:  # noqa: BLE001 - the next request finds a lost link and says so
                looked = None
            finally:
                self._lock.release()

    def close(self) -> None:
        """Acknowledge what was shown and close the channel to the keeper (the kernel keeps
        running); safe twice."""
        self._closed = True
        link, self._link = self._link, None
        if link is not None:
            self._ack(link, force=True)
            link.close()

    # -- variables --------------------------------------------------------------------------

    def push(self, values: Mapping[str, Any]) -> dict[str, int]:
        """Set variables in the session: ``push({"lr": 3e-4, "data": array})``.

        Objects are pickled (protocol 5); numpy arrays and other buffer-backed objects
        travel as their raw bytes (no text detour), over a channel of their own.

        Returns
        -------
        dict
            Name -> bytes sent for it.

        Raises
        ------
        KernelError
            A value cannot be pickled here or unpickled there (naming it), or a name is not
            a Python identifier.
        """
        return variables.push(self, values)

    def pull(self, names: str | Iterable[str]):
        """Copy variables from the session: ``pull("x")`` -> the value,
        ``pull(["x", "y"])`` -> ``{"x": ..., "y": ...}``.

        Raises
        ------
        KernelError
            No such variable there, a value that cannot be pickled there or unpickled here
            (naming it and what to convert it to).
        """
        return variables.pull(self, names)

    def _home(self) -> str:
        home = getattr(self, "_home_dir", None)
        if home is None:
            home = self._home_dir = self.machine.exec('printf %s "$HOME"', timeout=30).stdout
        return home


def _signal_words(number: int, name: str | None = None, text: str | None = None) -> str:
    """``, SIGSEGV: segmentation fault`` for a signal number, named by the machine (the
    keeper's ``signal.Signals(n).name`` and ``signal.strsignal(n)``) or, when it did not say,
    here; SIGKILL gets its usual cause instead."""
    if not name:
        try:
            name, text = signal.Signals(number).name, signal.strsignal(number)
        except ValueError:
            return ""
    if name == "SIGKILL":
        return ", SIGKILL: often out of host memory"
    return f", {name}: {text[:1].lower() + text[1:]}" if text else f", {name}"


class _Deadline(Exception):
    pass


#: A widget's traffic (ipywidgets, tqdm.notebook): passed to the front end (:meth:`Output.comm`).
_COMM_TYPES = ("comm_open", "comm_msg", "comm_close")
_OUTPUT_TYPES = ("stream", "display_data", "execute_result", "update_display_data", "error",
                 "clear_output")
