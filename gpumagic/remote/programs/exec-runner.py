# exec-runner.py GRACE CWD_MISSING: the cell runner, one per connection
# (gpumagic/remote/execution.py, _Runner).  Started once through the login shell, so its
# environment is the one every exec gets; it starts each cell as its own child with that
# environment (plus the cell's entries), so no shell start-up file runs again per cell.
#
# Protocol on stdin/stdout (the SSH channel), frames of one type byte, a 4-byte big-endian
# length and the payload:
#   client -> runner: "C" cwd NUL argc NUL argv... NUL entries... (NAME=VALUE, or NAME to
#                     unset it; NUL-separated, no field holds a NUL): start a cell;
#                     "A" (as "C"): start a program whose stdin is a pipe fed by the
#                     client's "I" frames (bytes) and closed by its "Z" (empty): the sync
#                     agent, which then starts with no login shell and no new channel;
#                     "S" (empty): stop it: SIGTERM to its process group, SIGKILL GRACE s later.
#                     "I"/"Z" for a program that has ended are dropped.  While more than
#                     PENDING bytes wait for the program's stdin, the channel is not read
#                     (its window closes: the client waits, nothing piles up here).
#   runner -> client: "H" version (once, at start); "P" PID (the cell started; its process
#                     group and session); "O"/"E" stdout/stderr bytes; "X" exit status
#                     (decimal; 128+N when ended by signal N).
# A cell runs in a new session (its PID is its process group), stdin /dev/null, its cwd
# entered like exec-cell.sh does ("~", "~/x" and relative paths from $HOME; CWD_MISSING and a
# message when it does not exist).  Its text arrives in the request, never through a shell.
#
# Shell functions: a cell's own `bash -c` no longer sources ~/.bashrc (that was the 200 ms);
# the functions it defined there (conda's `conda activate`) are read once at start into a
# private file that bash cells get as BASH_ENV (capture_functions).
#
# Kill on drop: a watchdog process, forked at start, holds the read end of a pipe on which the
# runner registers each running cell's process group.  When the runner ends for any reason
# (the channel closed: interrupt, dropped connection, killed sshd; or the runner was killed),
# the pipe reaches EOF and the watchdog sends SIGTERM to every registered group, then SIGKILL
# GRACE seconds later.  Nothing a cell started is left running.
import os
import select
import signal
import struct
import subprocess
import sys
import time

GRACE = float(sys.argv[1])
MISSING = int(sys.argv[2])
HEAD = struct.Struct(">cI")
#: Bytes of "I" frames held for a program's stdin before the channel is read again.
PENDING = 1 << 20


def watchdog(rfd, functions):
    groups = set()
    buf = b""
    while True:
        try:
            data = os.read(rfd, 4096)
        except InterruptedError:
            continue
        except OSError:
            data = b""
        if not data:
            break
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line[:1] == b"+":
                groups.add(int(line[1:]))
            elif line[:1] == b"-":
                groups.discard(int(line[1:]))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for g in groups:
            try:
                os.killpg(g, sig)
            except OSError:
                pass
        if sig == signal.SIGTERM and groups:
            time.sleep(GRACE)
    if functions:
        try:
            os.unlink(functions)
        except OSError:
            pass
    os._exit(0)


def start_watchdog(functions):
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(wfd)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # never hold the channel open
            os.dup2(null, fd)
        os.setsid()  # out of the runner's process group: a signal to it spares the watchdog
        try:
            watchdog(rfd, functions)
        finally:
            os._exit(0)
    os.close(rfd)
    return wfd


def capture_functions():
    """A private file of the shell functions a cell's ``bash -c`` got from ~/.bashrc on the old
    path (bash sources it for a command run by sshd while SHLVL is below 2: conda's and
    pyenv's ``init`` define ``conda activate`` that way), read once here; None when none.
    Cells that run bash get it as BASH_ENV, which it unsets, so nested scripts do not."""
    env = dict(os.environb)
    env[b"SHLVL"] = b"0"
    mark = b"\x1egpumagic-functions\n"
    path = os.path.join(os.environ.get("TMPDIR") or "/tmp",
                        "gpumagic-functions-%d-%s" % (os.getpid(), os.urandom(6).hex()))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "w+b") as f:
            # Output to a file, not a pipe: a daemon that ~/.bashrc starts (ssh-agent) may
            # keep its stdout open for good; only bash itself is waited for.
            subprocess.run([b"bash", b"-c", b"printf '\\036gpumagic-functions\\n'; declare -f"],
                           stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.DEVNULL,
                           env=env, timeout=30)
            f.seek(0)
            text = f.read().partition(mark)[2]
            if text.strip():
                f.seek(0)
                f.truncate()
                f.write(text + b"\nunset BASH_ENV\n")
                return path
    except (OSError, subprocess.SubprocessError):
        pass
    os.unlink(path)
    return None


def send(kind, payload=b""):
    data = HEAD.pack(kind, len(payload)) + payload
    while data:
        n = os.write(1, data)
        data = data[n:]


def enter_dir(d):
    home = os.environ.get("HOME", "")
    if d == "~":
        d = home
    elif d.startswith("~/"):
        d = home + "/" + d[2:]
    elif d and not d.startswith("/"):
        d = home + "/" + d
    return d


def signal_name(n):
    """The description a shell prints for a job ended by signal ``n`` ("Killed")."""
    try:
        text = signal.strsignal(n)  # Python 3.8+
    except (AttributeError, ValueError):
        text = None
    return text or {9: "Killed", 15: "Terminated", 11: "Segmentation fault",
                    6: "Aborted"}.get(n, "Signal %d" % n)


def parse(payload):
    """(cwd, argv, env entries) of a request: NUL-separated cwd, argc, the argv, then the
    entries (NAME=VALUE sets one, a bare NAME unsets it); no field can hold a NUL."""
    fields = payload.split(b"\0")
    argc = int(fields[1])
    return fields[0], fields[2:2 + argc], fields[2 + argc:]


class Cell:
    def __init__(self, payload, wd, functions, piped=False):
        self.wd = wd
        #: The program's stdin (the write end of its pipe; None: /dev/null or closed), what
        #: waits to be written there, and whether the client's "Z" came.
        self.stdin = None
        self.pending = bytearray()
        self.eof = False
        cwd, argv, entries = parse(payload)
        env = dict(os.environb)
        for entry in entries:
            k, eq, v = entry.partition(b"=")
            if eq:
                env[k] = v
            else:
                env.pop(k, None)
        # bash sources ~/.bashrc for a command run by sshd (SSH_CLIENT set) when SHLVL is
        # below 2 after it counts itself; the runner's environment already holds what it set.
        try:
            level = int(env.get(b"SHLVL", b"0"))
        except ValueError:
            level = 0
        if level < 1:
            env[b"SHLVL"] = b"1"
        if functions and os.path.basename(argv[0]) == b"bash" and b"BASH_ENV" not in env:
            env[b"BASH_ENV"] = functions.encode("utf-8", "surrogateescape")
        d = enter_dir(cwd.decode("utf-8", "surrogateescape"))
        self.proc = None
        self.fds = {}
        self.code = None
        self.kill_at = None
        if d:
            if not os.path.isdir(d):
                send(b"E", ("gpumagic: cannot enter directory %s on this machine\n" % d)
                     .encode("utf-8", "surrogateescape"))
                self.code = MISSING
                return
            env[b"PWD"] = d.encode("utf-8", "surrogateescape")
        if not argv:  # as `"$@"` with no words: nothing runs, status 0
            self.code = 0
            return
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE if piped else subprocess.DEVNULL,
                                         stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, cwd=d or None, env=env,
                                         start_new_session=True)
        except OSError as e:
            send(b"E", b"gpumagic: %s: %s\n" % (argv[0], e.strerror.encode()))
            self.code = 127 if isinstance(e, FileNotFoundError) else 126
            return
        self.pid = self.proc.pid
        os.write(wd, b"+%d\n" % self.pid)
        send(b"P", b"%d" % self.pid)
        self.fds = {self.proc.stdout.fileno(): b"O", self.proc.stderr.fileno(): b"E"}
        if piped:
            self.stdin = self.proc.stdin
            os.set_blocking(self.stdin.fileno(), False)

    def feed(self, data):
        """Bytes for the program's stdin (an "I" frame), written as the pipe takes them."""
        if self.stdin is not None:
            self.pending += data

    def end_input(self):
        """The client's "Z": stdin is closed once what waits was written."""
        self.eof = True
        if not self.pending:
            self.close_input()

    def write(self):
        """Write what the pipe takes now (never blocks)."""
        if self.stdin is None:
            return
        try:
            n = os.write(self.stdin.fileno(), self.pending[:65536])
        except BlockingIOError:
            return
        except OSError:  # the program closed its stdin or ended: what waits is dropped
            self.pending = bytearray()
            self.close_input()
            return
        del self.pending[:n]
        if not self.pending and self.eof:
            self.close_input()

    def close_input(self):
        if self.stdin is not None:
            try:
                self.stdin.close()
            except OSError:
                pass
            self.stdin = None
        self.pending = bytearray()

    def read(self, fd):
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if data:
            send(self.fds[fd], data)
        else:
            del self.fds[fd]

    def reap(self):
        """The exit status once the cell ended and closed its output, else None."""
        if self.code is not None or self.fds:
            return self.code
        if hasattr(os, "waitid"):  # unregister before reaping: the PID stays taken till then
            try:
                if os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                    return None
            except ChildProcessError:
                pass
            os.write(self.wd, b"-%d\n" % self.pid)
        rc = self.proc.poll()
        if rc is None:
            return None
        if not hasattr(os, "waitid"):
            os.write(self.wd, b"-%d\n" % self.pid)
        self.proc.stdout.close()
        self.proc.stderr.close()
        self.close_input()
        if rc < 0 and -rc not in (signal.SIGINT, signal.SIGPIPE) and self.kill_at is None:
            # what the old path's wrapper sh said on stderr ("Killed": the OOM killer's mark)
            send(b"E", b"%s\n" % signal_name(-rc).encode())
        self.code = 128 - rc if rc < 0 else rc
        return self.code

    def stop(self):
        if self.proc is not None and self.kill_at is None:
            try:
                os.killpg(self.pid, signal.SIGTERM)
            except OSError:
                pass
            self.kill_at = time.monotonic() + GRACE

    def tick(self):
        if self.kill_at is not None and time.monotonic() >= self.kill_at:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except OSError:
                pass
            self.kill_at = float("inf")


def main():
    functions = capture_functions()
    wd = start_watchdog(functions)
    # SIGCHLD wakes the select loop (through the wakeup fd) when a cell ends.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.signal(signal.SIGCHLD, lambda *a: None)
    signal.set_wakeup_fd(wake_w)
    send(b"H", b"gpumagic-runner 1")
    buf = b""
    cell = None
    while True:
        fds = [0, wake_r] + (list(cell.fds) if cell is not None else [])
        timeout = None
        if cell is not None and cell.kill_at is not None and cell.kill_at != float("inf"):
            timeout = max(0.0, cell.kill_at - time.monotonic())
        elif cell is not None and not cell.fds:
            timeout = 0.05  # output closed, the process not ended yet: look again soon
        if cell is not None and len(cell.pending) >= PENDING:
            fds.remove(0)  # the program's stdin is full: the client waits on the window
        out = [cell.stdin] if cell is not None and cell.stdin is not None and cell.pending else []
        try:
            ready, writable, _ = select.select(fds, out, [], timeout)
        except InterruptedError:
            ready, writable = [], []
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except OSError:
                pass
        if 0 in ready:
            data = os.read(0, 65536)
            if not data:
                return  # the channel closed: the watchdog stops what still runs
            buf += data
            while len(buf) >= HEAD.size:
                kind, n = HEAD.unpack_from(buf)
                if len(buf) < HEAD.size + n:
                    break
                payload, buf = buf[HEAD.size:HEAD.size + n], buf[HEAD.size + n:]
                if kind in (b"C", b"A") and cell is None:
                    cell = Cell(payload, wd, functions, piped=kind == b"A")
                elif kind == b"S" and cell is not None:
                    cell.stop()
                elif kind == b"I" and cell is not None:
                    cell.feed(payload)
                elif kind == b"Z" and cell is not None:
                    cell.end_input()
        if cell is not None:
            if writable or (cell.stdin is not None and cell.pending):
                cell.write()
            for fd in ready:
                if fd in cell.fds:
                    cell.read(fd)
            cell.tick()
            code = cell.reap()
            if code is not None:
                send(b"X", b"%d" % code)
                cell = None


try:
    main()
except (BrokenPipeError, ConnectionResetError):
    pass
