# exec-runner.py GRACE CWD_MISSING SPOOL: the cell runner, one per cell running at once on a
# connection (gpumagic/remote/execution.py, _Runner, _Pool: most connections need one; a
# second runs beside it while both cells run).  Started once through the login shell, so its
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
#                     "S" WAIT: stop it (an interrupt, a timeout): SIGINT to its processes (a
#                     terminal's Ctrl-C: the program's KeyboardInterrupt handler and `finally:`
#                     run), SIGTERM WAIT seconds later (at once when the cell's own process has
#                     ended and only what it started is left), SIGKILL GRACE s after that; a
#                     later "S" sends the next signal at once.  Each "S" is answered "s" (the
#                     client learns that its path lives and waits for the program's handler).  A cell's processes: its process
#                     group, and every process whose environment holds its mark
#                     (GPUMAGIC_CELL, set for each cell), also one that left the group
#                     (setsid, a daemon) and was re-parented away.
#                     "I"/"Z" for a program that has ended are dropped.  While more than
#                     PENDING bytes wait for the program's stdin, the channel is not read
#                     (its window closes: the client waits, nothing piles up here).
#                     "K" ID NUL GRACE NUL OUT NUL ERR NUL + a "C" request: a kept cell (below);
#                     "F" ID: its exit status reached the client, its spool is removed;
#                     "h" (empty): the client is there (sent while a kept cell runs).
#   runner -> client: "H" version (once, at start); "P" PID (the cell started; its process
#                     group and session); "O"/"E" stdout/stderr bytes; "X" exit status
#                     (decimal; 128+N when ended by signal N); "s" (an "S" was heard); for a
#                     kept cell also "Q" OUT ERR
#                     (how many stdout and stderr bytes came before the next frame), "R"
#                     (re-attached to a cell another runner started) and "G" GRACE (stopped
#                     because no client was heard for GRACE seconds).
# A cell runs in a new session (its PID is its process group), stdin /dev/null, its cwd
# entered like exec-cell.sh does ("~", "~/x" and relative paths from $HOME; CWD_MISSING and a
# message when it does not exist).  Its text arrives in the request, never through a shell.
#
# Shell functions: a cell's own `bash -c` no longer sources ~/.bashrc (that was the 200 ms);
# the functions it defined there (conda's `conda activate`) are read once at start into a
# private file that bash cells get as BASH_ENV (capture_functions).
#
# A Python started ahead: a --python cell (argv exactly PYTHON -u -c TEXT) pays the
# interpreter's start-up (8 ms here, more on a busy machine) before its first line runs.
# Once such a cell ended, the runner starts the same PYTHON -u -c STUB, in a new session, with
# the environment and directory that cell had (its mark aside): STUB waits on a private pipe.
# The next Python cell whose PYTHON, environment (mark aside) and directory are the same is
# handed to it: the pipe brings its mark (set in os.environ, so what it starts carries it) and
# its text.  What start-up read is looked at first (the interpreter, the user site, each
# sys.path entry and .pth file: a `pip install` meanwhile changes one): when any changed, STUB
# execs `PYTHON -u -c TEXT` (a cold start).  Else it compiles TEXT as "<string>" and runs it in
# __main__ as `python -c` does: sys.argv is ["-c"] (sys.orig_argv ends in TEXT), __main__
# holds only its own names, an uncaught exception prints the traceback `-c` prints (STUB's
# frame left out) and exits 1, SystemExit exits as it does, and an uncaught KeyboardInterrupt
# ends the process by SIGINT once threads and atexit ran.  What differs: the command line in
# /proc and ps shows STUB, and the start time is earlier.  A Python cell of another key
# discards it (its pipe's EOF ends it), and it ends with the runner the same way.
#
# Kill on drop: a watchdog process, forked at start, holds the read end of a pipe on which the
# runner registers each running cell's process group.  When the runner ends for any reason
# (the channel closed: interrupt, dropped connection, killed sshd; or the runner was killed),
# the pipe reaches EOF and the watchdog sends SIGTERM to every registered cell's processes (its
# group and its marked ones), then SIGKILL GRACE seconds later.  Nothing a cell started is left
# running.
#
# Kept cells ("K", issue 28): a cell that must outlive a dead path for GRACE seconds.  Its ID
# is claimed with mkdir(2) of ~/.gpumagic/cells/ID (atomic: a request that arrives twice, the
# first one late through a path that came back, never runs twice).  The owner runner tees
# every frame of the cell (P, O, E, X) into the cell's spool there, segment files of frames,
# each starting with a "Q" frame; past SPOOL bytes the oldest segment is dropped (a reader
# that was in it goes on at the oldest kept one: its "Q" says how much it missed).  The
# channel is fed from the spool as it takes bytes, never blocking: while it moves, the cell
# is held back once the channel lags AHEAD bytes (a fast printer is paced by the link as
# before); once it took nothing for STALL seconds, the cell runs on into the spool.  A "K"
# whose ID exists already re-attaches: this runner follows the spool from the client's
# OUT and ERR byte counts to the exit status, so nothing is shown twice.  The client's "h"
# frames (on any runner) touch the cell's lease file; when it is older than GRACE the owner
# stops the cell ("G", then its "X").  An owner whose channel closed or went quiet keeps the
# cell (no kill on drop) and exits once it ended.
import os
import select
import signal
import struct
import subprocess
import sys
import time

GRACE = float(sys.argv[1])
MISSING = int(sys.argv[2])
#: Most bytes of spool kept per cell (the oldest segment goes first past it).
SPOOL = int(sys.argv[3]) if len(sys.argv) > 3 else 64 << 20
SEGMENTS = 4
CELLS = os.path.join(os.environ.get("HOME") or "/", ".gpumagic", "cells")
#: While a cell runs, the empty file RUNNING/RUNNERPID-CELLPID says so: the budget guard's idle
#: measure (budget-guard.sh) reads it, since a cell that only uses the CPU is not idle either.
RUNNING = os.path.join(os.environ.get("HOME") or "/", ".gpumagic", "running")
#: Seconds without progress after which a stalled channel stops holding a kept cell back...
STALL = 2.0
#: ...and the bytes the channel may lag behind the spool while it moves.
AHEAD = 1 << 20
HEAD = struct.Struct(">cI")
#: Bytes of "I" frames held for a program's stdin before the channel is read again.
PENDING = 1 << 20


#: The environment entry that marks every process of a cell (its value is the cell's mark).
MARK = b"GPUMAGIC_CELL"


def private_dirs(path):
    """Make ``path`` and ~/.gpumagic above it, each 0700 (os.makedirs gives only the last one
    its mode: ~/.gpumagic came out 0755 when a cell made it first)."""
    for d in (os.path.dirname(path), path):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass


def running(pid, on):
    """Make (``on``) or remove the file that says the cell ``pid`` runs (see RUNNING)."""
    path = os.path.join(RUNNING, "%d-%d" % (os.getpid(), pid))
    try:
        if not on:
            os.unlink(path)
            return
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
        except FileNotFoundError:
            private_dirs(RUNNING)
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    except OSError:
        pass


def marked(mark):
    """PIDs of the processes whose environment (as they were started) holds ``mark``."""
    entry = MARK + b"=" + mark
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/%s/environ" % name, "rb") as f:
                    if entry in f.read().split(b"\0"):
                        pids.append(int(name))
            except OSError:  # gone, or another user's
                pass
    return pids


def signal_cell(group, mark, sig):
    """Send ``sig`` to a cell's processes: its process group, and each marked process outside
    it (once each: a second SIGINT would interrupt the program's own handler); how many
    marked processes outside the group there were."""
    if group:
        try:
            os.killpg(group, sig)
        except OSError:
            pass
    outside = 0
    for pid in marked(mark) if mark else ():
        try:
            if os.getpgid(pid) != group:
                outside += 1
                os.kill(pid, sig)
        except OSError:
            pass
    return outside


def watchdog(rfd, functions):
    cells = {}  # process group -> mark
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
            words = line[1:].split()
            if line[:1] == b"+" and words:
                cells[int(words[0])] = words[1] if len(words) > 1 else None
            elif line[:1] == b"-" and words:
                cells.pop(int(words[0]), None)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for g, mark in cells.items():
            signal_cell(g, mark, sig)
        if sig == signal.SIGTERM and cells:
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
    """Write one frame to the channel, waiting for it (fd 1 is non-blocking: kept cells feed it
    only what it takes)."""
    data = HEAD.pack(kind, len(payload)) + payload
    while data:
        try:
            n = os.write(1, data)
        except BlockingIOError:
            select.select([], [1], [])
            continue
        data = data[n:]


def beat(grace):
    """Seconds between the client's "h" frames for a kept cell of ``grace`` seconds (the
    client computes the same)."""
    return min(10.0, max(0.5, grace / 4))


def remove_dir(d):
    try:
        names = os.listdir(d)
    except OSError:
        return
    for name in names:
        try:
            os.unlink(os.path.join(d, name))
        except OSError:
            pass
    try:
        os.rmdir(d)
    except OSError:
        pass


def read_words(path):
    try:
        with open(path, "rb") as f:
            return f.read().split()
    except OSError:
        return []


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def sweep():
    """Make the spools' folder; remove the spools no client can want: ended or orphaned
    (their owner runner is gone), with a lease older than their grace plus a minute."""
    try:
        private_dirs(CELLS)
        names = os.listdir(CELLS)
    except OSError:
        return
    now = time.time()
    for name in names:
        d = os.path.join(CELLS, name)
        meta = read_words(os.path.join(d, "lease"))
        try:
            owner, grace = int(meta[0]), float(meta[1])
        except (IndexError, ValueError):
            owner, grace = 0, 0.0
        try:
            age = now - os.stat(os.path.join(d, "lease")).st_mtime
        except OSError:
            try:
                age = now - os.stat(d).st_mtime
            except OSError:
                continue
        ended = os.path.exists(os.path.join(d, "end")) or not owner or not pid_alive(owner)
        if ended and age > grace + 60:
            remove_dir(d)


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


class Stoppable(object):
    """A cell's processes, stopped as a terminal and then a supervisor would: ``stop(WAIT)``
    (an interrupt) sends SIGINT, SIGTERM follows WAIT seconds later, SIGKILL GRACE seconds
    after that; ``stop()`` (no client left) starts at SIGTERM; a stop while one is under way
    sends the next signal at once.  ``tick`` sends what is due."""

    #: Signals sent so far (of SIGINT, SIGTERM, SIGKILL), and when (monotonic) the next is due.
    sent = ()
    next_at = None
    mark = None

    def group(self):
        """The process group to stop; None when there is none (not started, or ended)."""
        return None

    def leader_ended(self):
        """Whether the cell's own process ended (what is left is what it started)."""
        return False

    def stop(self, wait=None):
        if self.group() is None:
            return
        if not self.sent:
            self.signal(signal.SIGINT if wait is not None else signal.SIGTERM,
                        GRACE if wait is None else max(0.0, wait))
        else:
            self.escalate()

    def signal(self, sig, then):
        self.sent += (sig,)
        signal_cell(self.group(), self.mark, sig)
        self.next_at = float("inf") if sig == signal.SIGKILL else time.monotonic() + then

    def escalate(self):
        last = self.sent[-1] if self.sent else None
        if last == signal.SIGINT:
            self.signal(signal.SIGTERM, GRACE)
        elif last == signal.SIGTERM:
            self.signal(signal.SIGKILL, 0)

    def tick(self):
        if self.next_at is None or self.group() is None:
            return
        now = time.monotonic()
        if now >= self.next_at or (self.sent[-1] == signal.SIGINT and self.leader_ended()):
            self.escalate()

#: The program a Python started ahead runs (%d: when it was started, less 20 ms, in ns;
#: then the pipe's fd, twice); see the header.
STUB = """\
def _gm_run():
    import os, sys
    if sys.version_info < (3,):
        os._exit(0)  # (a cell for it starts cold)
    def mtime(path):
        try:
            return os.stat(path).st_mtime_ns
        except (OSError, ValueError):
            return None
    def listed(d):
        try:
            return [os.path.join(d, n) for n in os.listdir(d) if n.endswith(".pth")]
        except (OSError, ValueError):
            return []
    site = sys.modules.get("site")
    paths = [sys.executable, getattr(site, "USER_SITE", None)] + sys.path
    paths = [p for p in paths if p] + [f for d in sys.path if d for f in listed(d)]
    started = [mtime(p) for p in paths]
    since = %d  # when the runner started it, less the file clock's lag: start-up read after
    data = b""
    while True:
        chunk = os.read(%d, 65536)
        if not chunk:
            break
        data += chunk
    os.close(%d)
    mark, sep, text = data.partition(b"\\0")
    if not sep:
        os._exit(0)
    os.environb[b"GPUMAGIC_CELL"] = mark
    text = text.decode("utf-8", "surrogateescape")
    now = [mtime(p) for p in paths]
    if now != started or any(t is not None and t >= since for t in now):  # a package or .pth came or went: start as `python -c` would
        os.execv(sys.executable, [getattr(sys, "orig_argv", [sys.executable])[0], "-u", "-c", text])
    if hasattr(sys, "orig_argv"):
        sys.orig_argv = sys.orig_argv[:3] + [text]
    main = sys.modules["__main__"].__dict__
    del main["_gm_run"]
    try:
        exec(compile(text, "<string>", "exec", dont_inherit=True), main)
    except SystemExit:
        raise
    except BaseException as e:
        tb = e.__traceback__.tb_next
        e.__traceback__ = tb
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e, tb
        if sys.version_info >= (3, 12):
            sys.last_exc = e
        sys.excepthook(type(e), e, tb)
        if not isinstance(e, KeyboardInterrupt):
            raise SystemExit(1)
        del e, tb
        import atexit, signal
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
        atexit._run_exitfuncs()
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:
                pass
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        os._exit(130)
_gm_run()
"""


def python_cell(argv, piped):
    """Whether ``argv`` is a cell a Python started ahead can run: PYTHON -u -c TEXT."""
    return not piped and len(argv) == 4 and argv[1] == b"-u" and argv[2] == b"-c"


class Spares(object):
    """At most one Python started ahead (see the header): ``key`` names the cell it can run
    (PYTHON, the environment without the mark, the directory)."""

    def __init__(self):
        self.key = None
        self.proc = None
        self.control = None

    def start(self, key, exe, env, cwd):
        """Start one for ``key`` (after a Python cell ended), unless one for it is ready."""
        if self.key == key and self.proc is not None and self.proc.poll() is None:
            return
        self.discard()
        r, w = os.pipe()
        env = dict(env)
        env[MARK] = b"%d.spare" % os.getpid()
        since = int(time.time() * 1e9) - 20000000  # (a file's time comes from a coarse clock)
        try:
            self.proc = subprocess.Popen([exe, b"-u", b"-c", (STUB % (since, r, r)).encode()],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, cwd=cwd or None, env=env,
                                         start_new_session=True, pass_fds=(r,))
        except OSError:
            os.close(w)
            self.proc = None
            return
        finally:
            os.close(r)
        self.key, self.control = key, w

    def take(self, key, mark, text):
        """The ready process, now running ``text`` with ``mark``; None when there is none
        for ``key`` (a cold start then)."""
        proc = self.proc if self.key == key else None
        if proc is None or proc.poll() is not None:
            self.discard()
            return None
        try:
            os.write(self.control, mark + b"\0" + text)  # (a cell's text: at most 120 KiB)
        except OSError:
            self.discard()
            return None
        os.close(self.control)
        self.key = self.proc = self.control = None
        return proc

    def discard(self):
        """End the one that is ready (its pipe's EOF), if any."""
        if self.control is not None:
            os.close(self.control)
        if self.proc is not None:
            try:
                self.proc.wait(1.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc.stdout.close()
            self.proc.stderr.close()
        self.key = self.proc = self.control = None


class Cell(Stoppable):
    #: Cells started by this runner (a part of each one's mark).
    started = 0

    #: (key, PYTHON, environment, directory) of a Python cell: what a Python started ahead
    #: for the next one gets (Spares.start); None for another cell.
    python = None

    def __init__(self, payload, wd, functions, piped=False, emit=send, mark=None, spares=None):
        self.wd = wd
        # the mark every process of the cell inherits: a kept cell's is its id (which
        # exec-stop-kept.py knows), another's this runner's PID and the cell's number
        Cell.started += 1
        self.mark = mark or b"%d.%d" % (os.getpid(), Cell.started)
        #: Where its frames go: the channel, or a kept cell's spool.
        self.emit = emit
        self.spool = None
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
        env[MARK] = self.mark
        if functions and os.path.basename(argv[0]) == b"bash" and b"BASH_ENV" not in env:
            env[b"BASH_ENV"] = functions.encode("utf-8", "surrogateescape")
        d = enter_dir(cwd.decode("utf-8", "surrogateescape"))
        self.proc = None
        self.fds = {}
        self.code = None
        if d:
            if not os.path.isdir(d):
                emit(b"E", ("gpumagic: cannot enter directory %s on this machine\n" % d)
                     .encode("utf-8", "surrogateescape"))
                self.code = MISSING
                return
            env[b"PWD"] = d.encode("utf-8", "surrogateescape")
        if not argv:  # as `"$@"` with no words: nothing runs, status 0
            self.code = 0
            return
        if spares is not None and python_cell(argv, piped):
            key = (argv[0], d, sorted((k, v) for k, v in env.items() if k != MARK))
            self.python = (key, argv[0], env, d)
            self.proc = spares.take(key, self.mark, argv[3])
        try:
            if self.proc is None:
                self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE if piped else subprocess.DEVNULL,
                                             stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, cwd=d or None, env=env,
                                             start_new_session=True)
        except OSError as e:
            emit(b"E", b"gpumagic: %s: %s\n" % (argv[0], e.strerror.encode()))
            self.code = 127 if isinstance(e, FileNotFoundError) else 126
            return
        self.pid = self.proc.pid
        os.write(wd, b"+%d %s\n" % (self.pid, self.mark))
        running(self.pid, True)
        emit(b"P", b"%d" % self.pid)
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
            self.emit(self.fds[fd], data)
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
        running(self.pid, False)
        self.proc.stdout.close()
        self.proc.stderr.close()
        self.close_input()
        if rc < 0 and -rc not in (signal.SIGINT, signal.SIGPIPE) and not self.sent:
            # what the old path's wrapper sh said on stderr ("Killed": the OOM killer's mark)
            self.emit(b"E", b"%s\n" % signal_name(-rc).encode())
        self.code = 128 - rc if rc < 0 else rc
        return self.code

    def group(self):
        return self.pid if self.proc is not None and self.code is None else None

    def leader_ended(self):
        return self.proc is not None and self.proc.poll() is not None


class Leased(object):
    """A kept cell's folder ``dir`` as its owner and a re-attach both see it: the mtime of its
    ``lease`` file is when a client was last heard."""

    dir = ""
    touched = 0.0

    def touch(self):
        """The client was heard: the lease starts again (at most once a second)."""
        now = time.monotonic()
        if now - self.touched >= 1.0:
            self.touched = now
            try:
                os.utime(os.path.join(self.dir, "lease"))
            except OSError:
                pass

    def lease_age(self):
        try:
            return time.time() - os.stat(os.path.join(self.dir, "lease")).st_mtime
        except OSError:
            return float("inf")


class Spool(Leased):
    """The owner's side of a kept cell: its frames appended to segment files in ``d`` (see the
    header), and the channel fed from them as it takes bytes."""

    def __init__(self, d, grace):
        self.dir = d
        self.grace = grace
        self.seg_max = max(SPOOL // SEGMENTS, 4096)
        self.fds = {}  # segment number -> fd (read and append)
        self.cur = -1
        self.size = 0
        self.counts = [0, 0]  # stdout, stderr bytes spooled
        self.chan = [0, 0]  # the channel's place: segment, offset
        self.chan_gone = False
        self.moved = time.monotonic()  # when the channel last took bytes or had all
        self.ended = False
        self.graced = False
        self.touched = time.monotonic()
        self.rotate()

    def lease(self, pgid):
        """Write the lease file: this runner, the grace and the cell's process group (read by
        a re-attach, ``exec-stop-kept.py`` and the sweep); its mtime is the lease."""
        with open(os.path.join(self.dir, "lease"), "w") as f:
            f.write("%d %g %d\n" % (os.getpid(), self.grace, pgid))


    def rotate(self):
        self.cur += 1
        self.fds[self.cur] = os.open(os.path.join(self.dir, "%d" % self.cur),
                                     os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        self.size = 0
        while len(self.fds) > SEGMENTS:  # past the bound: the oldest part goes
            n = min(self.fds)
            os.close(self.fds.pop(n))
            try:
                os.unlink(os.path.join(self.dir, "%d" % n))
            except OSError:
                pass
        self.add(b"Q", b"%d %d" % tuple(self.counts))

    def emit(self, kind, payload=b""):
        while kind in (b"O", b"E") and payload:  # in pieces that fit: SPOOL holds
            if self.size >= self.seg_max:
                self.rotate()
            piece, payload = payload[:self.seg_max - self.size], payload[self.seg_max - self.size:]
            self.counts[kind == b"E"] += len(piece)
            self.add(kind, piece)
        if kind in (b"O", b"E"):
            return
        self.add(kind, payload)
        if kind == b"X":
            self.ended = True
            with open(os.path.join(self.dir, "end"), "w") as f:
                f.write(payload.decode() + "\n")

    def add(self, kind, payload):
        data = HEAD.pack(kind, len(payload)) + payload
        fd = self.fds[self.cur]
        while data:
            n = os.write(fd, data)
            data = data[n:]
            self.size += n

    def lag(self):
        seg, off = self.chan
        return (self.cur - seg) * self.seg_max + self.size - off

    def feed(self):
        """Write to the channel what it takes now, never blocking; True when it has all."""
        if self.chan_gone:
            return True
        seg, off = self.chan
        if seg not in self.fds:  # dropped past the bound: on at the oldest kept segment
            seg, off = min(self.fds), 0
        try:
            while True:
                data = os.pread(self.fds[seg], 65536, off)
                if not data:
                    if seg < self.cur:
                        seg, off = seg + 1, 0
                        continue
                    self.moved = time.monotonic()
                    return True
                try:
                    n = os.write(1, data)
                except BlockingIOError:
                    return False
                off += n
                self.moved = time.monotonic()
        except OSError:  # the channel closed: the spool keeps everything for a re-attach
            self.chan_gone = True
            return True
        finally:
            self.chan = [seg, off]

    def hold_back(self):
        """Hold the cell back (do not read its output): the channel moves but lags."""
        return (not self.chan_gone and self.lag() > AHEAD
                and time.monotonic() - self.moved < STALL)

    def close(self):
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


class Follow(Leased, Stoppable):
    """A re-attach: this runner streams the spool of a cell another runner started (in ``d``)
    to its channel, from the client's stdout and stderr byte counts ``want``, to its exit
    status; the client's "h" frames touch its lease, its "S" stops the cell's group."""

    def __init__(self, d, want):
        self.dir = d
        self.mark = os.path.basename(d).encode("ascii", "replace")  # the kept cell's id
        self.want = want
        self.at = [0, 0]
        self.seg = None
        self.file = None
        self.buf = b""
        self.pgid = None
        self.done = False
        self.touched = 0.0
        self.checked = time.monotonic()
        send(b"R")

    def segments(self):
        try:
            return sorted(int(n) for n in os.listdir(self.dir) if n.isdigit())
        except OSError:
            return []

    def step(self):
        """Send what the spool holds now; True once the exit status was sent."""
        while not self.done:
            if self.file is None:
                segs = [n for n in self.segments() if self.seg is None or n >= self.seg]
                if not segs:
                    return self.orphaned()
                self.seg = segs[0]
                try:
                    self.file = open(os.path.join(self.dir, "%d" % self.seg), "rb")
                except OSError:
                    continue  # dropped meanwhile: the next one
                self.buf = b""
            data = self.file.read(65536)
            if not data:
                if os.path.exists(os.path.join(self.dir, "%d" % (self.seg + 1))):
                    data = self.file.read(65536)  # what was written before the next began
                    if not data:
                        self.file.close()
                        self.file, self.seg = None, self.seg + 1
                        continue
                else:
                    return self.orphaned()
            self.buf += data
            while len(self.buf) >= HEAD.size and not self.done:
                kind, n = HEAD.unpack_from(self.buf)
                if len(self.buf) < HEAD.size + n:
                    break
                payload, self.buf = self.buf[HEAD.size:HEAD.size + n], self.buf[HEAD.size + n:]
                self.frame(kind, payload)
        return True

    def frame(self, kind, payload):
        if kind in (b"O", b"E"):
            i = kind == b"E"
            start, self.at[i] = self.at[i], self.at[i] + len(payload)
            if self.at[i] <= self.want[i]:
                return  # the client has it
            payload = payload[max(0, self.want[i] - start):]
            self.want[i] = self.at[i]
        elif kind == b"Q":
            self.at = [int(w) for w in payload.split()]
        elif kind == b"P":
            self.pgid = int(payload)
        elif kind == b"X":
            self.done = True
        send(kind, payload)

    def orphaned(self):
        """Caught up.  Whether the owner runner is gone without an exit status (killed: its
        watchdog stopped the cell), looked at once a second; then the end is sent."""
        now = time.monotonic()
        if now - self.checked < 1.0:
            return False
        self.checked = now
        meta = read_words(os.path.join(self.dir, "lease"))
        end = read_words(os.path.join(self.dir, "end"))
        if end and not self.segments():  # claimed by a stop before it ever started
            send(b"X", end[0])
            self.done = True
        elif meta and not pid_alive(int(meta[0])) and not os.path.exists(os.path.join(self.dir, "end")):
            send(b"E", b"gpumagic: the cell's runner on the machine ended; its processes were stopped\n")
            send(b"X", b"255")
            self.done = True
        return self.done

    def group(self):
        return None if self.done else self.pgid

    def close(self):
        if self.file is not None:
            self.file.close()


def kept(payload, wd, functions, spares):
    """A "K" request: (the cell it started, or None; the Follow of a re-attach, or None)."""
    ident, grace, out, err, rest = payload.split(b"\0", 4)
    name = ident.decode("ascii", "replace")
    if not name or "/" in name or name.startswith("."):
        return Cell(rest, wd, functions, spares=spares), None
    d = os.path.join(CELLS, name)
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        return None, Follow(d, [int(out), int(err)])
    except OSError:  # no spool here (a read-only HOME): an ordinary cell
        return Cell(rest, wd, functions, spares=spares), None
    try:
        spool = Spool(d, float(grace))
    except OSError:
        remove_dir(d)
        return Cell(rest, wd, functions, spares=spares), None
    cell = Cell(rest, wd, functions, emit=spool.emit, mark=ident, spares=spares)
    cell.spool = spool
    spool.lease(cell.pid if cell.proc is not None else 0)
    if cell.code is not None:  # never started (no such directory...): its end is spooled
        spool.emit(b"X", b"%d" % cell.code)
    return cell, None


def main():
    functions = capture_functions()
    wd = start_watchdog(functions)
    sweep()
    # SIGCHLD wakes the select loop (through the wakeup fd) when a cell ends.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.signal(signal.SIGCHLD, lambda *a: None)
    signal.set_wakeup_fd(wake_w)
    os.set_blocking(1, False)  # a kept cell's spool feeds the channel only what it takes
    send(b"H", b"gpumagic-runner 1")
    spares = Spares()
    buf = b""
    cell = follow = None
    eof = False  # the channel closed (only a kept cell or a re-attach outlives that)
    heard = time.monotonic()  # when the client was last heard
    while True:
        spool = cell.spool if cell is not None else None
        fds = [wake_r] + ([] if eof else [0])
        if cell is not None and not (spool is not None and spool.hold_back()):
            fds += list(cell.fds)
        timeout = None
        if cell is not None and cell.next_at is not None and cell.next_at != float("inf"):
            timeout = max(0.0, cell.next_at - time.monotonic())  # (SIGCHLD wakes it sooner)
        elif cell is not None and not cell.fds:
            timeout = 0.05  # output closed, the process not ended yet: look again soon
        if follow is not None:
            timeout = 0.1  # new frames in the spool are looked for this often
        elif spool is not None:
            timeout = min(0.5, 0.5 if timeout is None else timeout)  # the lease, a stall
        if cell is not None and len(cell.pending) >= PENDING and 0 in fds:
            fds.remove(0)  # the program's stdin is full: the client waits on the window
        out = [cell.stdin] if cell is not None and cell.stdin is not None and cell.pending else []
        if spool is not None and not spool.chan_gone and spool.lag() > 0:
            out.append(1)
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
                if spool is None and follow is None:
                    return  # the channel closed: the watchdog stops what still runs
                eof = True  # a kept cell lives on (its lease decides); a re-attach ends
                if follow is not None:
                    return
            else:
                heard = time.monotonic()
                for one in (spool, follow):
                    if one is not None:
                        one.touch()
            buf += data
            while len(buf) >= HEAD.size:
                kind, n = HEAD.unpack_from(buf)
                if len(buf) < HEAD.size + n:
                    break
                payload, buf = buf[HEAD.size:HEAD.size + n], buf[HEAD.size + n:]
                if kind in (b"C", b"A") and cell is None and follow is None:
                    cell = Cell(payload, wd, functions, piped=kind == b"A", spares=spares)
                elif kind == b"K" and cell is None and follow is None:
                    cell, follow = kept(payload, wd, functions, spares)
                elif kind == b"S" and (cell or follow) is not None:
                    try:
                        wait = float(payload) if payload else None
                    except ValueError:
                        wait = None
                    (cell or follow).stop(wait)
                    (cell.emit if cell is not None else send)(b"s")  # heard: the path lives
                elif kind == b"I" and cell is not None:
                    cell.feed(payload)
                elif kind == b"Z" and cell is not None:
                    cell.end_input()
                elif kind == b"F" and payload and b"/" not in payload and not payload.startswith(b"."):
                    d = os.path.join(CELLS, payload.decode("ascii", "replace"))
                    if os.path.exists(os.path.join(d, "end")):
                        remove_dir(d)
        if follow is not None:
            follow.tick()
            if follow.step():
                follow.close()
                follow = None
        if cell is not None:
            spool = cell.spool
            if writable or (cell.stdin is not None and cell.pending):
                cell.write()
            for fd in ready:
                if fd in cell.fds:
                    cell.read(fd)
            cell.tick()
            if (spool is not None and not spool.ended and not spool.graced
                    and time.monotonic() - heard > spool.grace and spool.lease_age() > spool.grace):
                spool.graced = True  # no client for the grace: stopped, as a cut cell was
                spool.emit(b"G", b"%g" % spool.grace)
                cell.stop()
            code = cell.reap()
            if code is not None and cell.python is not None:
                ended, cell.python = cell.python, None
            else:
                ended = None
            if code is not None and spool is None:
                send(b"X", b"%d" % code)
                cell = None
            elif spool is not None:
                if code is not None and not spool.ended:
                    spool.emit(b"X", b"%d" % code)
                if spool.feed() and spool.ended:
                    spool.close()  # its spool stays until the client's "F" (or a sweep)
                    cell = None
                elif spool.ended and (eof or time.monotonic() - heard > 3 * beat(spool.grace) + STALL):
                    return  # ended while its client is away: a re-attach reads the spool
            if ended is not None and not eof:
                spares.start(*ended)  # after its "X": the next Python cell starts in it
        if eof and cell is None and follow is None:
            return

try:
    main()
except (BrokenPipeError, ConnectionResetError):
    pass
