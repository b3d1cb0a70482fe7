"""gpumagic's kernel keeper: one Jupyter kernel on this machine that outlives the laptop.

This program runs ON the rented machine, with the Python the kernel is to use.  gpumagic
(``gpumagic/remote/kernel/``, ``%gpu kernel start``) copies it to ``~/.gpumagic/kernels/.programs/``
and runs::

    python kernel_keeper.py start NAME [--cwd DIR] [--umask OCTAL] [--startup FILE] [--idle-stop SECONDS]

which prints one JSON line (``{"status": "started" | "running" | "no-ipykernel" | ...}``) and
returns, leaving the keeper detached (its own session: a closed laptop, a dropped connection
or a killed ``sshd`` do not reach it).  With ``--idle-stop SECONDS`` (gpumagic gives it on the
sandbox only, which is the laptop itself: nothing else ends a session there) the keeper stops
its kernel and exits, as ``stop`` does, once no client has been connected and no cell has run
for that long.  Standard library, plus ``jupyter_client`` and ``zmq``,
which come with ``ipykernel``.

What it keeps, in ``~/.gpumagic/kernels/NAME/`` (mode 0700; files 0600)
-----------------------------------------------------------------------
``lock``             held (``flock``) for the keeper's whole life: a second start finds it.
``connection.json``  the kernel's Jupyter connection file, written by jupyter_client: five
                     ports on 127.0.0.1 and the HMAC key.  The key is never printed or logged
                     and never leaves this machine: the keeper signs what it relays.
``token``            what a client presents to the keeper (the laptop reads it over SSH).
``state.json``       name, python, pids, the keeper's port, ``state`` (``starting``, ``idle``,
                     ``busy``, ``dead``), ``since`` (epoch seconds) and ``idle_stop`` (the
                     ``--idle-stop`` seconds, or null).
``busy``             exists while a cell executes (the budget guard counts the machine busy).
``journal``          every message the kernel sent (iopub, shell replies, stdin requests) and
                     the keeper's own events, numbered, in arrival order, as framed below.
``keeper.log``, ``kernel.log``, ``xfer-*`` (``%gpu kernel push/pull`` payloads in transit).

Wire (the keeper's port, 127.0.0.1 only; also the journal's record format)
--------------------------------------------------------------------------
A frame is ``!I`` length, then ``!I`` part count, then each part as ``!I`` length + bytes
(``kernel_wire.py`` beside this file, which the laptop imports too).
Part 0 is a small JSON object; for a kernel message it is ``{"seq": N, "ch": "iopub" |
"shell" | "stdin" | "control"}`` and parts 1-4 are the message's own header, parent header,
metadata and content (the JSON frames of the Jupyter wire protocol), the rest its buffers.
For a keeper event it is ``{"seq": N, "ch": "keeper"}`` and part 1 the event's JSON.

A client first sends ``{"op": "hello", "token": T, "since": S}``; the keeper answers
``{"op": "welcome", ...}`` and streams the journal from the first message after ``max(S,
acked)``: what a cell printed while no laptop was connected comes first, then live output.
Then the client sends ``{"op": "send", "ch": "shell" | "stdin" | "control"}`` + the four JSON
parts (+ buffers) of a Jupyter message (the keeper signs it and passes it to the kernel),
``{"op": "ack", "seq": N}`` (shown up to N), ``{"op": "sync"}`` (answered with the last
number), ``{"op": "interrupt"}`` (SIGINT to the kernel's process group), ``{"op":
"restart"}`` and ``{"op": "stop"}``.
"""

import array
import collections
import errno
import fcntl
import hmac
import json
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import time

from kernel_wire import dumps, frame, take_frames  # beside this file, in the programs tar

ROOT = os.path.join(os.path.expanduser("~"), ".gpumagic", "kernels")
#: Seconds a kernel gets to answer its first kernel_info_request.
READY_TIMEOUT = 90.0
#: Starts of the kernel on new ports when one of them was taken before it bound it.
PORT_TRIES = 3
#: Seconds between the shutdown request and SIGTERM, and between SIGTERM and SIGKILL.
SHUTDOWN_GRACE = 3.0
#: Bytes queued to one client before the rest waits in the journal.
CLIENT_BUFFER = 1 << 20
#: Seconds of quiet after which a changed state is written to its files.
STATE_DELAY = 0.05
#: How many request ids the keeper remembers to run a request sent again only once.
FORWARDED_KEPT = 1000
#: The journal is started afresh once it is this large and everything in it was delivered.
JOURNAL_RESET = 64 << 20
DELIM = b"<IDS|MSG>"


def write_private(path, data):
    """Write ``data`` to ``path`` atomically, mode 0600."""
    tmp = "%s.tmp%d" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def log(msg):
    sys.stderr.write("%s %s\n" % (time.strftime("%Y-%m-%dT%H:%M:%S"), msg))
    sys.stderr.flush()


# -- the keeper -----------------------------------------------------------------------------


class Client:
    def __init__(self, sock, addr):
        self.sock = sock
        self.addr = addr
        self.inbuf = bytearray()
        self.out = bytearray()
        self.pos = None  # journal byte offset of the next record to send; None before hello


class Keeper:
    def __init__(self, name, directory, cwd, startup, umask=None, idle_stop=None):
        # What the keeper was started with: the session's name and folder, the kernel's cwd
        # and start-up code, the user's login umask for the kernel (None: the keeper's own,
        # which keeps its files private), and the seconds with no client connected and no cell
        # running after which the keeper stops (``--idle-stop``; None: never).
        self.name, self.dir, self.cwd, self.startup = name, directory, cwd, startup
        self.umask, self.idle_stop = umask, idle_stop
        #: Since when (monotonic) no client has been connected and no cell has run.
        self.quiet_since = time.monotonic()
        self.cf = os.path.join(directory, "connection.json")
        self.proc = None
        self.state = "starting"
        self.since = time.time()
        self.started = time.time()
        self.busy_msg = None
        self.exit_code = None
        self.clients = []
        self.next_seq = 1
        self.first_seq = 1
        self.offsets = array.array("q")
        self.jsize = 0
        self.acked = 0
        self.stopping = False
        self.dirty = False
        #: The ids of the last requests passed to the kernel: a client that lost its path as it
        #: sent one sends it again, and a request that had come is not run twice.
        self.forwarded = collections.OrderedDict()
        #: Where ``kernel.log`` stood when the kernel last started or became ready: what its
        #: death is explained with comes after it (not its start-up warnings).
        self.log_mark = 0

    # -- files --

    def path(self, *names):
        return os.path.join(self.dir, *names)

    def write_state(self):
        info = {"name": self.name, "python": sys.executable, "keeper_pid": os.getpid(),
                "kernel_pid": self.proc.pid if self.proc else None, "port": self.port,
                "state": self.state, "since": self.since, "started": self.started,
                "cwd": self.cwd, "exit_code": self.exit_code, "busy_msg": self.busy_msg,
                "last_seq": self.next_seq - 1, "acked": self.acked, "idle_stop": self.idle_stop,
                "python_version": "%d.%d.%d" % sys.version_info[:3]}
        write_private(self.path("state.json"), dumps(info))
        return info

    def set_state(self, state, busy_msg=None, now=True):
        """Change the state; its files (``state.json``, ``busy``) are written now, or with
        ``now=False`` (a cell starting) once the loop is quiet for STATE_DELAY seconds, so
        that writing them is not in the way of the cell's first messages."""
        if state != self.state or busy_msg != self.busy_msg:
            self.state, self.busy_msg, self.since = state, busy_msg, time.time()
            self.dirty = True
        if now:
            self.flush_state()

    def flush_state(self):
        if not self.dirty:
            return
        self.dirty = False
        busy = self.path("busy")
        if self.state == "busy":
            write_private(busy, dumps({"since": self.since, "msg_id": self.busy_msg}))
        else:
            try:
                os.unlink(busy)
            except OSError:
                pass
        self.write_state()

    # -- the kernel --

    def setup(self):
        import zmq
        from jupyter_client.connect import write_connection_file
        from jupyter_client.session import Session, new_id_bytes

        key = new_id_bytes()
        write_connection_file(self.cf, ip="127.0.0.1", key=key, transport="tcp",
                              kernel_name="python3")
        os.chmod(self.cf, 0o600)
        os.chmod(self.dir, 0o700)  # jupyter_client adds the sticky bit to the directory
        with open(self.cf) as f:
            info = json.load(f)
        self.ports = {ch: info[ch + "_port"] for ch in ("shell", "iopub", "stdin", "control", "hb")}
        self.session = Session(key=key, signature_scheme=info["signature_scheme"],
                               username="gpumagic-keeper")
        self.zmq = zmq
        self.ctx = zmq.Context()
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.token = secrets.token_hex(32)
        write_private(self.path("token"), self.token.encode())
        self.jfd = os.open(self.path("journal"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.connect_sockets()

    def connect_sockets(self):
        zmq = self.zmq
        ident = self.session.bsession
        self.socks = {}
        for ch in ("shell", "control", "stdin"):
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.RCVHWM, 0)
            s.setsockopt(zmq.IDENTITY, ident)  # stdin requests are routed to the shell's identity
            s.setsockopt(zmq.LINGER, 1000)
            s.connect("tcp://127.0.0.1:%d" % self.ports[ch])
            self.socks[ch] = s
        s = self.ctx.socket(zmq.SUB)
        # no limit on what waits to be read: ZeroMQ drops what a full queue cannot take (1000
        # messages by default), and a cell printing in a loop outruns a busy keeper;
        # kernel_launch.py lifts the kernel's side of the same limit
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.setsockopt(zmq.LINGER, 0)
        s.connect("tcp://127.0.0.1:%d" % self.ports["iopub"])
        self.socks["iopub"] = s
        self.by_sock = {s: ch for ch, s in self.socks.items()}

    def close_sockets(self):
        for s in self.socks.values():
            s.close(linger=0)
        self.socks, self.by_sock = {}, {}

    def start_kernel(self):
        """Start the kernel and wait until it is ready.  Its ports were free when the
        connection file was written, and another process may take one before the kernel
        binds it (a busy host): then the file gets new ports and the kernel starts again, up
        to :data:`PORT_TRIES` times."""
        for attempt in range(PORT_TRIES):
            try:
                return self._start_kernel()
            except RuntimeError as e:
                if "Address already in use" not in str(e) or attempt == PORT_TRIES - 1:
                    raise
                log("a port of the kernel was taken before it bound it; new ports (%s)" % e)
                self.new_ports()

    def new_ports(self):
        """The connection file again, with the same key and new free ports; the keeper's
        sockets connect to them."""
        from jupyter_client.connect import write_connection_file

        write_connection_file(self.cf, ip="127.0.0.1", key=self.session.key, transport="tcp",
                              kernel_name="python3")
        os.chmod(self.cf, 0o600)
        with open(self.cf) as f:
            info = json.load(f)
        self.ports = {ch: info[ch + "_port"] for ch in ("shell", "iopub", "stdin", "control", "hb")}
        self.close_sockets()
        self.connect_sockets()

    def _start_kernel(self):
        env = dict(os.environ)
        env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        env["JPY_PARENT_PID"] = str(os.getpid())  # the kernel exits if the keeper dies
        env.pop("JPY_SESSION_NAME", None)
        logf = open(self.path("kernel.log"), "ab")
        self.log_mark = logf.seek(0, 2)
        # the kernel is started with the user's umask (the child inherits it); the keeper goes
        # back to its own at once (Popen's umask= needs Python 3.9)
        own = os.umask(self.umask) if self.umask is not None else None
        try:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_launch.py"),
                 "-f", self.cf],
                cwd=self.cwd, env=env, stdin=subprocess.DEVNULL, stdout=logf,
                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        finally:
            if own is not None:
                os.umask(own)
            logf.close()
        self.exit_code = None
        self.started = time.time()
        self.wait_ready()
        if self.startup:
            self.run_silently(self.startup)
        self.log_mark = self.log_size()
        self.set_state("idle")

    def log_size(self):
        try:
            return os.path.getsize(self.path("kernel.log"))
        except OSError:
            return 0

    def kernel_log_tail(self, lines=5, since=0):
        """The last ``lines`` lines of ``kernel.log`` written after byte ``since``."""
        try:
            with open(self.path("kernel.log"), "rb") as f:
                f.seek(0, 2)
                f.seek(max(since, f.tell() - 4000))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def send_kernel(self, ch, msg_type, content):
        msg = self.session.msg(msg_type, content)
        self.session.send(self.socks[ch], msg)
        return msg["header"]["msg_id"]

    def recv_kernel(self, sock):
        """(channel, [header, parent, metadata, content], buffers) or None for a bad signature."""
        frames = sock.recv_multipart()
        try:
            i = frames.index(DELIM)
        except ValueError:
            return None
        sig, parts, buffers = frames[i + 1], frames[i + 2:i + 6], frames[i + 6:]
        if len(parts) < 4 or not hmac.compare_digest(sig, self.session.sign(parts)):
            log("dropped a message with a bad signature on %s" % self.by_sock.get(sock))
            return None
        return self.by_sock[sock], parts, buffers

    def wait_ready(self):
        """Until the kernel answers kernel_info and iopub has delivered a message (so the
        subscription is live), discarding both; raises RuntimeError when it dies first."""
        zmq = self.zmq
        poller = zmq.Poller()
        for s in self.socks.values():
            poller.register(s, zmq.POLLIN)
        deadline = time.monotonic() + READY_TIMEOUT
        replied = heard = False
        asked = 0.0
        while not (replied and heard):
            if self.proc.poll() is not None:
                raise RuntimeError("the kernel exited with code %s while starting: %s"
                                   % (self.proc.returncode, self.kernel_log_tail(since=self.log_mark)))
            if time.monotonic() > deadline:
                raise RuntimeError("the kernel did not answer within %d s: %s"
                                   % (READY_TIMEOUT, self.kernel_log_tail(since=self.log_mark)))
            if time.monotonic() - asked > 0.5:
                self.send_kernel("shell", "kernel_info_request", {})
                asked = time.monotonic()
            for s, _ in poller.poll(100):
                got = self.recv_kernel(s)
                if got is None:
                    continue
                ch, parts, _ = got
                if ch == "iopub":
                    heard = True
                elif ch == "shell" and json.loads(parts[0]).get("msg_type") == "kernel_info_reply":
                    replied = True
        # drain the answers to the extra requests, so they do not reach the journal
        end = time.monotonic() + 0.2
        while time.monotonic() < end:
            for s, _ in poller.poll(50):
                self.recv_kernel(s)

    def run_silently(self, code):
        msg_id = self.send_kernel("shell", "execute_request", {
            "code": code, "silent": True, "store_history": False, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": False})
        deadline = time.monotonic() + READY_TIMEOUT
        sock = self.socks["shell"]
        while time.monotonic() < deadline and self.proc.poll() is None:
            if sock.poll(100):
                got = self.recv_kernel(sock)
                if got and json.loads(got[1][1]).get("msg_id") == msg_id:
                    content = json.loads(got[1][3])
                    if content.get("status") != "ok":
                        log("the startup code failed: %s: %s" % (content.get("ename"), content.get("evalue")))
                    return
        log("the startup code did not finish")

    def stop_kernel(self):
        """Ask the kernel to shut down, then SIGTERM and SIGKILL its whole process group."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self.send_kernel("control", "shutdown_request", {"restart": False})
            except Exception:
                pass
            for sig in (None, signal.SIGTERM, signal.SIGKILL):
                if sig is not None:
                    try:
                        os.killpg(self.proc.pid, sig)
                    except OSError:
                        pass
                try:
                    self.proc.wait(SHUTDOWN_GRACE)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:  # whatever the cells started in the kernel's group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.exit_code = self.proc.returncode

    def restart(self):
        self.stop_kernel()
        self.close_sockets()
        self.connect_sockets()
        self.set_state("starting")
        try:
            self.start_kernel()
        except RuntimeError as e:
            self.kernel_died(str(e))
            return
        self.event({"event": "restarted", "kernel_pid": self.proc.pid})

    def kernel_died(self, why=""):
        self.exit_code = self.proc.returncode if self.proc else None
        self.set_state("dead")
        event = {"event": "died", "exit_code": self.exit_code, "why": why,
                 "log": self.kernel_log_tail(since=self.log_mark)}
        if isinstance(self.exit_code, int) and self.exit_code < 0:  # named here: numbers differ by OS
            try:
                event["signal"] = signal.Signals(-self.exit_code).name
                event["signal_text"] = signal.strsignal(-self.exit_code) or ""
            except ValueError:
                pass
        self.event(event)

    def interrupt(self):
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
            except OSError:
                os.kill(self.proc.pid, signal.SIGINT)

    # -- the journal --

    def append(self, ch, parts, buffers=()):
        seq = self.next_seq
        self.next_seq += 1
        rec = frame([dumps({"seq": seq, "ch": ch})] + list(parts) + list(buffers))
        offset = self.jsize
        self.offsets.append(offset)
        view = memoryview(rec)
        while view:
            n = os.write(self.jfd, view)
            view = view[n:]
        self.jsize += len(rec)
        for c in self.clients:
            if c.pos == offset and len(c.out) < CLIENT_BUFFER:  # live: no need to read it back
                c.out += rec
                c.pos = self.jsize
            self.flush(c)

    def event(self, obj):
        obj.setdefault("time", time.time())
        self.append("keeper", [dumps(obj)])

    def offset_of(self, seq):
        if seq < self.first_seq:
            return 0
        i = seq - self.first_seq
        return self.offsets[i] if i < len(self.offsets) else self.jsize

    def maybe_reset_journal(self):
        last = self.next_seq - 1
        if (self.jsize >= JOURNAL_RESET and self.acked >= last
                and all(c.pos is None or c.pos == self.jsize for c in self.clients)):
            os.ftruncate(self.jfd, 0)
            os.lseek(self.jfd, 0, os.SEEK_SET)
            self.jsize = 0
            self.offsets = array.array("q")
            self.first_seq = self.next_seq
            for c in self.clients:
                if c.pos is not None:
                    c.pos = 0

    # -- clients --

    def accept(self):
        while True:
            try:
                sock, addr = self.listener.accept()
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    return
                raise
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.clients.append(Client(sock, addr))

    def drop(self, c):
        if c in self.clients:
            self.clients.remove(c)
        try:
            c.sock.close()
        except OSError:
            pass

    def flush(self, c):
        """Send what ``c`` has queued, topping it up from the journal (whole records only)."""
        if c.pos is not None:
            while len(c.out) < CLIENT_BUFFER and c.pos < self.jsize:
                (size,) = struct.unpack("!I", os.pread(self.jfd, 4, c.pos))
                c.out += os.pread(self.jfd, 4 + size, c.pos)
                c.pos += 4 + size
        while c.out:
            try:
                n = c.sock.send(c.out)
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    return
                self.drop(c)
                return
            del c.out[:n]
            if c.pos is not None and len(c.out) < CLIENT_BUFFER // 2 and c.pos < self.jsize:
                while len(c.out) < CLIENT_BUFFER and c.pos < self.jsize:
                    (size,) = struct.unpack("!I", os.pread(self.jfd, 4, c.pos))
                    c.out += os.pread(self.jfd, 4 + size, c.pos)
                    c.pos += 4 + size

    def reply(self, c, obj):
        c.out += frame([dumps(obj)])
        self.flush(c)

    def seen_before(self, header):
        """Whether a request with this header's msg_id was passed on already (then it is not
        again); else it is remembered (the last FORWARDED_KEPT)."""
        try:
            msg_id = json.loads(header).get("msg_id")
        except (ValueError, AttributeError):
            return False
        if not msg_id:
            return False
        if msg_id in self.forwarded:
            log("a request sent again (%s) had come before: not run twice" % msg_id)
            return True
        self.forwarded[msg_id] = None
        while len(self.forwarded) > FORWARDED_KEPT:
            self.forwarded.popitem(last=False)
        return False

    def status(self):
        return {"name": self.name, "state": self.state, "since": self.since,
                "busy_msg": self.busy_msg, "last": self.next_seq - 1, "acked": self.acked,
                "python": sys.executable, "kernel_pid": self.proc.pid if self.proc else None,
                "exit_code": self.exit_code, "started": self.started}

    def read_client(self, c):
        try:
            data = c.sock.recv(1 << 20)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return
            data = b""
        if not data:
            self.drop(c)
            return
        c.inbuf += data
        for parts, _ in take_frames(c.inbuf):
            if not self.handle(c, parts) or c not in self.clients:
                return

    def handle(self, c, parts):
        try:
            meta = json.loads(parts[0])
            op = meta["op"]
        except (ValueError, KeyError, IndexError):
            self.drop(c)
            return False
        if c.pos is None:
            if op != "hello" or not hmac.compare_digest(str(meta.get("token", "")).encode(),
                                                        self.token.encode()):
                log("refused a client from %s:%s (no valid token)" % c.addr[:2])
                self.drop(c)
                return False
            since = max(int(meta.get("since") or 0), self.acked)
            c.pos = self.offset_of(since + 1)
            welcome = self.status()
            welcome["op"] = "welcome"
            self.reply(c, welcome)
        if "ack" in meta:  # any request may carry an acknowledgement
            self.acked = max(self.acked, min(int(meta["ack"] or 0), self.next_seq - 1))
        if op == "hello":
            pass
        elif op == "send":
            ch = meta.get("ch")
            if ch in ("shell", "stdin", "control") and len(parts) >= 5 and self.socks:
                body = parts[1:5]
                if ch == "shell" and self.seen_before(body[0]):
                    return True
                self.socks[ch].send_multipart([DELIM, self.session.sign(body)] + body + parts[5:])
        elif op == "ack":
            self.acked = max(self.acked, min(int(meta.get("seq") or 0), self.next_seq - 1))
            self.maybe_reset_journal()
        elif op == "sync":
            info = self.status()
            info["op"] = "sync"
            self.reply(c, info)
        elif op == "interrupt":
            self.interrupt()
        elif op == "restart":
            self.restart()
        elif op == "stop":
            self.stopping = True
        return True

    # -- main loop --

    def serve(self):
        zmq = self.zmq
        poller, watched, kernel_socks = None, None, None
        self.quiet_since = time.monotonic()  # the client that started it connects next
        while not self.stopping:
            # the poller is rebuilt only when what it watches changes
            wanted = tuple((c.sock.fileno(), zmq.POLLIN | (zmq.POLLOUT if c.out or (
                c.pos is not None and c.pos < self.jsize) else 0)) for c in self.clients)
            if poller is None or wanted != watched or kernel_socks != list(self.socks.values()):
                poller = zmq.Poller()
                kernel_socks = list(self.socks.values())
                for s in kernel_socks:
                    poller.register(s, zmq.POLLIN)
                poller.register(self.listener.fileno(), zmq.POLLIN)
                for fd, flags in wanted:  # zmq's poller answers plain sockets by their fd
                    poller.register(fd, flags)
                watched = wanted
            by_fd = {c.sock.fileno(): c for c in self.clients}
            try:
                ready = poller.poll(STATE_DELAY * 1000 if self.dirty else 1000)
            except zmq.ZMQError as e:
                if e.errno == errno.EINTR:
                    continue
                raise
            if self.dirty and (not ready or time.time() - self.since > 1.0):
                self.flush_state()
            for obj, flags in ready:
                if obj == self.listener.fileno():
                    self.accept()
                elif obj in self.by_sock:
                    while obj.poll(0):
                        got = self.recv_kernel(obj)
                        if got is not None:
                            self.from_kernel(*got)
                else:
                    c = by_fd.get(obj)
                    if c is None or c not in self.clients:
                        continue
                    if flags & zmq.POLLIN:
                        self.read_client(c)
                    if flags & zmq.POLLOUT and c in self.clients:
                        self.flush(c)
                if self.stopping:
                    break
            if self.proc is not None and self.state != "dead" and self.proc.poll() is not None:
                self.drain_kernel()  # what it sent before dying comes before the news
                self.kernel_died()
            self.check_idle()
        self.shutdown()

    def check_idle(self):
        """With ``idle_stop``: stop (as ``stop`` does) once no client has been connected and
        the kernel has not been busy (nor starting) for that many seconds."""
        if self.idle_stop is None or self.stopping:
            return
        now = time.monotonic()
        attached = any(c.pos is not None for c in self.clients)  # said hello with the token
        if attached or self.state in ("busy", "starting"):
            self.quiet_since = now
        elif now - self.quiet_since >= self.idle_stop:
            log("stopping: no client and no cell for %g s (--idle-stop)" % self.idle_stop)
            self.stopping = True

    def drain_kernel(self, seconds=0.2):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            busy = False
            for s in list(self.socks.values()):
                while s.poll(0):
                    busy = True
                    got = self.recv_kernel(s)
                    if got is not None:
                        self.from_kernel(*got)
            if not busy:
                time.sleep(0.02)

    def from_kernel(self, ch, parts, buffers):
        header = json.loads(parts[0])
        msg_type = header.get("msg_type")
        if msg_type == "iopub_welcome":
            return
        if ch == "iopub" and msg_type == "status" and self.state != "dead":
            parent = json.loads(parts[1])
            if parent.get("msg_type") == "execute_request":
                state = json.loads(parts[3]).get("execution_state")
                if state == "busy":
                    self.set_state("busy", parent.get("msg_id"), now=False)
                elif state == "idle" and self.busy_msg == parent.get("msg_id"):
                    # written before the idle reaches a client: a state read after a cell
                    # ended says idle (%gpu kernel list, the idle stop), never a stale busy
                    self.set_state("idle")
        self.append(ch, parts, buffers)

    def shutdown(self):
        self.event({"event": "stopped"})  # (no client to hear it when stopped for --idle-stop)
        deadline = time.monotonic() + 2
        while any(c.out for c in self.clients) and time.monotonic() < deadline:
            for c in list(self.clients):
                self.flush(c)
            time.sleep(0.01)
        self.stop_kernel()
        for c in list(self.clients):
            self.drop(c)
        self.close_sockets()
        self.ctx.term()
        for name in os.listdir(self.dir):
            if name != "lock":
                try:
                    os.unlink(self.path(name))
                except OSError:
                    pass
        os.unlink(self.path("lock"))
        os.rmdir(self.dir)


# -- start ----------------------------------------------------------------------------------


def check_name(name):
    ok = name and len(name) <= 64 and name[0].isalnum() and all(
        ch.isalnum() or ch in "-_" for ch in name) and name.isascii()
    if not ok:
        raise SystemExit("bad kernel name %r" % name)
    return name


def answer(obj, code=0):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()
    return code


def start(argv):
    import argparse

    p = argparse.ArgumentParser(prog="kernel_keeper.py start")
    p.add_argument("name")
    p.add_argument("--cwd", default="")
    p.add_argument("--startup", default="")
    p.add_argument("--umask", default="", help="the kernel's umask, octal (default: the keeper's)")
    p.add_argument("--idle-stop", type=float, default=None, metavar="SECONDS",
                   help="stop once no client has been connected and no cell has run for this long")
    args = p.parse_args(argv)
    name = check_name(args.name)
    os.makedirs(ROOT, mode=0o700, exist_ok=True)
    directory = os.path.join(ROOT, name)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    os.chmod(directory, 0o700)
    lock = os.open(os.path.join(directory, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        try:
            with open(os.path.join(directory, "state.json")) as f:
                state = json.load(f)
        except (OSError, ValueError):
            state = {}
        return answer({"status": "running", "state": state})
    try:
        import ipykernel  # noqa: F401
        import jupyter_client  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as e:
        return answer({"status": "no-ipykernel", "python": sys.executable, "detail": str(e)}, 3)
    cwd = os.path.expanduser(args.cwd) if args.cwd else os.getcwd()
    if not os.path.isdir(cwd):
        return answer({"status": "no-cwd", "cwd": cwd}, 4)
    startup = ""
    if args.startup:
        with open(args.startup) as f:
            startup = ("exec(compile(%r, %r, 'exec'), {'__name__': '_gpumagic_startup', '__file__': %r})"
                       % (f.read(), args.startup, args.startup))
    for stale in ("journal", "busy", "token", "state.json", "connection.json"):
        try:
            os.unlink(os.path.join(directory, stale))
        except OSError:
            pass
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(w)
        chunks = []
        while True:
            data = os.read(r, 65536)
            if not data:
                break
            chunks.append(data)
        os.waitpid(pid, 0)
        text = b"".join(chunks).decode("utf-8", "replace").strip()
        try:
            result = json.loads(text)
        except ValueError:
            result = {"status": "failed", "why": text or "the keeper exited before the kernel started"}
        return answer(result, 0 if result.get("status") == "started" else 5)
    # the child: a new session, then a grandchild that nobody waits for
    os.close(r)
    os.setsid()
    if os.fork():
        os._exit(0)
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        devnull = os.open(os.devnull, os.O_RDWR)
        logfd = os.open(os.path.join(directory, "keeper.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(devnull, 0)
        os.dup2(logfd, 1)
        os.dup2(logfd, 2)
        os.close(devnull)
        os.close(logfd)
        sys.stdout = os.fdopen(1, "w")
        sys.stderr = os.fdopen(2, "w")
        umask = int(args.umask, 8) if args.umask.isdigit() else None
        idle_stop = args.idle_stop if args.idle_stop is not None and args.idle_stop > 0 else None
        keeper = Keeper(name, directory, cwd, startup, umask, idle_stop)

        def on_term(*_):
            keeper.stopping = True

        signal.signal(signal.SIGTERM, on_term)
        keeper.setup()
        keeper.write_state()
        try:
            keeper.start_kernel()
        except RuntimeError as e:
            keeper.stop_kernel()
            os.write(w, dumps({"status": "failed", "why": str(e)}))
            os.close(w)
            keeper.shutdown()
            os._exit(1)
        log("kernel %s started: pid %d, keeper port %d" % (name, keeper.proc.pid, keeper.port))
        info = keeper.write_state()
        info["status"] = "started"
        os.write(w, dumps(info))
        os.close(w)
        keeper.serve()
        log("stopped")
    except BaseException as e:  # noqa: BLE001 - the keeper's last word goes to its log
        log("keeper failed: %r" % (e,))
        try:
            os.write(w, dumps({"status": "failed", "why": repr(e)}))
        except OSError:
            pass
        os._exit(1)
    os._exit(0)


def main(argv):
    if len(argv) >= 2 and argv[1] == "start":
        return start(argv[2:])
    sys.stderr.write("usage: kernel_keeper.py start NAME [--cwd DIR] [--umask OCTAL] [--startup FILE]"
                     " [--idle-stop SECONDS]\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
