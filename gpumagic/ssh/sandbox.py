"""A throwaway local OpenSSH ``sshd`` on 127.0.0.1: the embedded default machine.

:class:`SshServer` starts a real ``sshd`` as the current user with its own ed25519 host
and client keys in a private directory.  The sandbox uses it so that every tutorial can
run without renting anything; the test suite uses the same class for its servers.

The sandbox is trusted automatically *because gpumagic made its host key*: its key goes
into the sandbox's own known_hosts file, never into the user's ``~/.ssh/known_hosts``.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from importlib import resources
from pathlib import Path
from typing import Callable, Iterable

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..errors import SandboxError
from .config import local_user
from .hosts import HostSpec

SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd", "/opt/homebrew/sbin/sshd",
                   "/sbin/sshd")
FAKE_DIR = Path(__file__).resolve().parent.parent / "gpu" / "fake"
INSTALL_HINT = ("install OpenSSH's server: `sudo apt-get install openssh-server` "
                "(Debian/Ubuntu), `brew install openssh` (macOS)")
#: macOS ships OpenSSH's server as /usr/sbin/sshd (what System Settings' Remote Login starts);
#: the sandbox runs its own copy of it with its own config, as the user, on 127.0.0.1.
MACOS_SSHD = "/usr/sbin/sshd"
MACOS_HINT = (f"macOS has OpenSSH's server at {MACOS_SSHD} (Remote Login need not be on); if it is "
              "gone, `brew install openssh` puts one at /opt/homebrew/sbin/sshd")
#: The sandbox is an sshd on this computer, and the machine side is Linux's (sh, /proc,
#: process groups): Windows has neither, and says so before anything is made.
WINDOWS_MESSAGE = ("the sandbox needs a Linux machine (it runs OpenSSH's sshd and Linux programs on this "
                   "computer): on Windows install WSL with `wsl --install`, then run Jupyter inside it, "
                   "or open the tutorials on Binder")
WINDOWS_HINT = ("in WSL's Ubuntu: `pip install gpumagic jupyterlab && jupyter lab`, then `%gpu connect "
                "--sandbox` there; Binder: the badge in README.md; a rented machine works from Windows "
                "as it is: `%gpu connect HOST`")


def check_platform(platform: str | None = None) -> None:
    """Refuse, in one line, a computer the sandbox cannot run on (``platform``: default
    ``sys.platform``): Windows, where there is no sshd to run as the user and no Linux
    machine side; macOS and Linux pass.

    Raises
    ------
    SandboxError
        On Windows, saying what to use instead (WSL, Binder).
    """
    if (sys.platform if platform is None else platform) == "win32":
        raise SandboxError(WINDOWS_MESSAGE, WINDOWS_HINT)


def find_sshd(platform: str | None = None) -> str:
    """Path of the ``sshd`` binary.

    Raises
    ------
    SandboxError
        With the install command when no sshd exists (on macOS: naming /usr/sbin/sshd).
    """
    for c in SSHD_CANDIDATES:
        if os.access(c, os.X_OK):
            return c
    found = shutil.which("sshd")
    if found:
        return found
    if (sys.platform if platform is None else platform) == "darwin":
        raise SandboxError(f"no sshd found on this Mac ({MACOS_SSHD} is missing), so the sandbox machine "
                           "cannot start", MACOS_HINT)
    raise SandboxError("no sshd found on this computer, so the sandbox machine cannot start",
                       INSTALL_HINT)


def make_keypair(path: Path, comment: str = "gpumagic") -> str:
    """Write an ed25519 private key (OpenSSH format, mode 0600) and ``.pub``; returns the pub line."""
    key = Ed25519PrivateKey.generate()
    priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                             serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                        serialization.PublicFormat.OpenSSH).decode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(priv)
    line = f"{pub} {comment}"
    Path(str(path) + ".pub").write_text(line + "\n", encoding="utf-8")
    return line


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recordings() -> list[str]:
    """Names of the recorded GPUs the fake ``nvidia-smi`` can replay (``h200-idle``, ...)."""
    base = FAKE_DIR / "recordings"
    return sorted(p.name for p in base.iterdir() if p.is_dir() and p.name != "host")


class SshServer:
    """A real OpenSSH sshd on 127.0.0.1 with throwaway keys, run as the current user.

    Parameters
    ----------
    directory : path
        Where keys, config, log and ``bin/`` live (created).
    extra_config : str
        More sshd_config lines (e.g. ``"MaxStartups 1"``).
    env : dict
        Environment for sessions, through sshd_config ``SetEnv`` (``PATH`` defaults to
        ``DIR/bin`` then this process's PATH, so stand-in programs in ``bin/`` win).
    fake_gpu : str, optional
        Put the replaying ``nvidia-smi`` in ``bin/`` with this recording
        (``h200-idle``, ``h200-load``; change later with :meth:`set_gpu`).
    log_level : str
        sshd ``LogLevel`` (``DEBUG1`` logs forwarded connections, e.g. ProxyJump hops).
    """

    def __init__(self, directory: str | os.PathLike, *, extra_config: str = "",
                 env: dict | None = None, fake_gpu: str | None = None, alias: str = "sandbox",
                 log_level: str = "VERBOSE"):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.bin = self.dir / "bin"
        self.bin.mkdir(exist_ok=True)
        self.alias = alias
        self.extra_config = extra_config
        self.log_level = log_level
        self.env = dict(env or {})
        self.user = local_user()
        self.host = "127.0.0.1"
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.host_key = self.dir / "host_ed25519"
        self.client_key = self.dir / "client_ed25519"
        self.known_hosts = self.dir / "known_hosts"
        self.log = self.dir / "sshd.log"
        self.gpu_state = self.dir / "gpu-state"
        if not self.host_key.exists():
            make_keypair(self.host_key, "gpumagic-sandbox-host")
        if not self.client_key.exists():
            self.client_pub = make_keypair(self.client_key, "gpumagic-sandbox-client")
        else:
            self.client_pub = Path(str(self.client_key) + ".pub").read_text(encoding="utf-8").strip()
        self.authorized_keys = self.dir / "authorized_keys"
        if not self.authorized_keys.exists():
            self.authorized_keys.write_text(self.client_pub + "\n", encoding="utf-8")
            os.chmod(self.authorized_keys, 0o600)
        if fake_gpu:
            self.install_fake_gpu(fake_gpu)
        self._finalizer = weakref.finalize(self, _kill, None)

    # -- keys -------------------------------------------------------------------------

    def authorize(self, public_key: str) -> None:
        """Accept logins with ``public_key`` (one ``.pub`` line): what a platform's SSH-key page does.

        Appends it to this server's authorized_keys unless the same key is there already.
        """
        fields = public_key.strip().split()
        if len(fields) < 2 or "\n" in public_key.strip():
            raise ValueError("expected one OpenSSH public key line (ssh-ed25519 AAAA... comment)")
        text = self.authorized_keys.read_text(encoding="utf-8")
        if any(line.split()[1:2] == [fields[1]] for line in text.splitlines() if line.strip()):
            return
        with open(self.authorized_keys, "a", encoding="utf-8") as f:
            f.write(("" if not text or text.endswith("\n") else "\n") + public_key.strip() + "\n")

    @property
    def host_key_fingerprint(self) -> str:
        """``SHA256:...`` of the host key, as ``ssh`` shows it on first contact."""
        import base64

        from .known_hosts import fingerprint

        blob = Path(str(self.host_key) + ".pub").read_text(encoding="utf-8").split()[1]
        return fingerprint(base64.b64decode(blob))

    # -- programs on the server's PATH -------------------------------------------------

    def install_bin(self, name: str, script: str) -> Path:
        """Put an executable ``script`` named ``name`` first on the sessions' PATH."""
        p = self.bin / name
        p.write_text(script, encoding="utf-8")
        p.chmod(0o755)
        return p

    def install_fake_gpu(self, recording: str = "h200-idle") -> None:
        """Install the replaying ``nvidia-smi`` (see ``gpumagic/gpu/fake/nvidia_smi.py``).

        Raises
        ------
        SandboxError
            For a recording that does not exist (naming those that do).
        """
        known = recordings() + ["mismatch", "no-driver", "inforom", "lost-gpu", "lost-gpu-fields"]
        if recording not in known and not os.path.isabs(recording):
            raise SandboxError(f"no GPU recording named {recording!r}",
                               f"use one of: {', '.join(known)}")
        self.install_bin("nvidia-smi",
                         f"#!/bin/sh\nexec {sys.executable} {FAKE_DIR / 'nvidia_smi.py'} \"$@\"\n")
        self.env.setdefault("GPUMAGIC_FAKE_GPU_STATE", str(self.gpu_state))
        self.set_gpu(recording)

    def set_gpu(self, recording: str) -> None:
        """Choose what the fake nvidia-smi replays: a recording name or dir, ``mismatch``, ``no-driver``."""
        self.gpu_state.write_text(recording + "\n", encoding="utf-8")

    # -- life cycle -------------------------------------------------------------------

    def config_text(self) -> str:
        # bin/ (stand-ins) first, then this Python's own bin (the venv that runs gpumagic, so the
        # sandbox's python3 has what this environment has), then this process's PATH.
        pybin = os.path.dirname(sys.executable)
        env = {"PATH": f"{self.bin}:{pybin}:{os.environ.get('PATH', '/usr/bin:/bin')}",
               "TMUX_TMPDIR": str(self.tmux_dir()), **self.env}
        setenv = " ".join(f'"{k}={v}"' for k, v in env.items())
        lines = [
            f"Port {self.port}",
            f"ListenAddress {self.host}",
            f"HostKey {self.host_key}",
            f"PidFile {self.dir / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.authorized_keys}",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password",
            "StrictModes no",
            "UsePAM no",
            "AllowTcpForwarding yes",
            "PermitTunnel no",
            "X11Forwarding no",
            "PrintMotd no",
            f"LogLevel {self.log_level}",
            "MaxSessions 64",
            "MaxStartups 64:30:128",
            "Subsystem sftp internal-sftp",
            f"SetEnv {setenv}",
        ]
        return "\n".join(lines) + "\n" + self.extra_config + "\n"

    def tmux_dir(self) -> Path:
        """This server's own ``TMUX_TMPDIR`` (made, 0700): its jobs' tmux server is its own, so two
        sandboxes (or two test servers) never share one, kill each other's sessions of the same
        name, or start panes with the other's environment (tmux's default socket is per user:
        ``/tmp/tmux-UID/default``).  ``DIR/tmux`` where the socket path fits a Unix socket's 107
        bytes, else a short, stable folder in /tmp named after ``DIR``."""
        d = self.dir / "tmux"
        if len(os.fsencode(str(d))) + len("/tmux-4294967295/default") > 100:
            import hashlib

            digest = hashlib.sha256(os.fsencode(str(self.dir.resolve()))).hexdigest()[:16]
            d = Path(tempfile.gettempdir()) / f"gpumagic-tmux-{digest}"
        d.mkdir(mode=0o700, exist_ok=True)
        return d

    def start(self, timeout: float = 10.0) -> "SshServer":
        """Start sshd and wait until it accepts connections.

        Raises
        ------
        SandboxError
            When sshd is missing or exits (its log's last lines are in the message).
        """
        if self.proc and self.proc.poll() is None:
            return self
        check_platform()
        sshd = find_sshd()
        if sys.platform.startswith("linux") and os.geteuid() == 0:
            # Debian's sshd run as root wants its privilege-separation directory; macOS's
            # uses /var/empty, which is there (and / is read-only there).
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        last = ""
        for _attempt in range(3):
            self.port = self.port or free_port()
            cfg = self.dir / "sshd_config"
            cfg.write_text(self.config_text(), encoding="utf-8")
            log = open(self.log, "ab")
            self.proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(cfg)], stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log, start_new_session=True,
                                         preexec_fn=_parent_death_signal())
            log.close()
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _kill, self.proc)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                        s.settimeout(2)
                        if s.recv(4).startswith(b"SSH-"):
                            self._write_known_hosts()
                            return self
                except OSError:
                    time.sleep(0.05)
            last = self.log.read_text(errors="replace", encoding="utf-8").strip().splitlines()[-3:]
            self.stop()
            self.port = 0  # maybe the port was taken in between: try another
        raise SandboxError(f"sshd did not start: {' | '.join(last)}",
                           f"see {self.log}; {INSTALL_HINT}")

    def _write_known_hosts(self) -> None:
        pub = Path(str(self.host_key) + ".pub").read_text(encoding="utf-8").split()
        self.known_hosts.write_text(f"[{self.host}]:{self.port} {pub[0]} {pub[1]}\n", encoding="utf-8")

    def stop(self) -> None:
        """Stop sshd (safe to call twice)."""
        if self.proc is not None:
            _kill(self.proc)
            self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> "SshServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- how clients reach it ---------------------------------------------------------

    def spec(self, alias: str | None = None) -> HostSpec:
        """A :class:`HostSpec` for this server, trusted through its own known_hosts."""
        return HostSpec(alias=alias or self.alias, hostname=self.host, port=self.port,
                        user=self.user, identity_files=(str(self.client_key),),
                        identities_only=True, server_alive_interval=15,
                        server_alive_count_max=3, connect_timeout=10,
                        known_hosts=str(self.known_hosts))

    def ssh_config_block(self, alias: str | None = None) -> str:
        """A ``Host`` block for ``~/.ssh/config`` (uses this server's own known_hosts)."""
        return (f"Host {alias or self.alias}\n"
                f"  HostName {self.host}\n  Port {self.port}\n  User {self.user}\n"
                f"  IdentityFile {self.client_key}\n  IdentitiesOnly yes\n"
                f"  UserKnownHostsFile {self.known_hosts}\n")

    def ssh_command(self, *remote: str) -> list[str]:
        """argv for the OpenSSH client reaching this server (``-i`` passed explicitly)."""
        return ["ssh", "-F", "/dev/null", "-i", str(self.client_key), "-p", str(self.port),
                "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "StrictHostKeyChecking=yes",
                "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
                f"{self.user}@{self.host}", *remote]


def _parent_death_signal():
    """A ``preexec_fn`` that makes the child get SIGTERM when its parent dies, however it dies
    (SIGKILL, SIGTERM, a closed terminal), so no sshd is left behind.  Linux only (prctl
    PR_SET_PDEATHSIG); elsewhere None, and the atexit/finalizer clean-up is all there is.
    The function is looked up here, in the parent, so the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, 15)  # PR_SET_PDEATHSIG, SIGTERM


def _kill(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, 15)
    except (ProcessLookupError, PermissionError):
        proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait(5)


def sandbox_home() -> Path:
    """The sandbox machine's ``$HOME``: ``gpumagic/sandbox-home`` in the user data directory.

    Kept between sandboxes (a job started in one is seen by the next, as on a rented
    machine), and apart from the user's real home, so tutorials never write there.
    """
    import platformdirs

    from .._fs import private_dir

    data = private_dir(platformdirs.user_data_dir("gpumagic"))
    return private_dir(data / "sandbox-home")


#: A sandbox's temporary directory is named ``gpumagic-sandbox-PID-START-RANDOM``: the pid of
#: the Python process that made it and that process's start time (clock ticks after boot,
#: ``/proc/PID/stat`` field 22, proc(5); 0 where there is no /proc), so a later sandbox can
#: tell that its owner is gone even when the pid was given to another process since.
SANDBOX_PREFIX = "gpumagic-sandbox-"
_SANDBOX_NAME = re.compile(re.escape(SANDBOX_PREFIX) + r"([0-9]+)-([0-9]+)-[^/]+", re.ASCII)


def process_start(pid: int) -> int:
    """When process ``pid`` started, in clock ticks after boot (0 where /proc cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def process_running(pid: int, start: int) -> bool:
    """True when process ``pid`` exists, is not a zombie, and (when ``start`` is known) is the
    process that started at ``start`` ticks, not a later one given the same pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's: it cannot be ours unless /proc says so
        pass
    except OverflowError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return True  # no /proc (macOS): the pid exists, so keep its directory
    if fields[:1] == [b"Z"]:
        return False
    return start == 0 or fields[19:20] == [str(start).encode()]


def stale_sandbox_dirs(entries: Iterable[tuple[str, int]], uid: int,
                       running: Callable[[int, int], bool] = process_running) -> list[str]:
    """The sandbox directories among ``entries`` whose owning Python process is gone (pure).

    Parameters
    ----------
    entries : iterable of (name, owner uid)
        The directories in the temp directory (never symlinks) and who owns each.
    uid : int
        This user: directories owned by anyone else are never chosen.
    running : callable
        ``running(pid, start) -> bool`` (see :func:`process_running`).

    Returns
    -------
    list of str
        Names of the form ``gpumagic-sandbox-PID-START-RANDOM``, owned by ``uid``, whose
        process ``PID`` (started at ``START``) no longer runs.
    """
    out = []
    for name, owner in entries:
        m = _SANDBOX_NAME.fullmatch(name)
        if m and owner == uid and not running(int(m[1]), int(m[2])):
            out.append(name)
    return out


def remove_stale_sandbox_dirs(tmp: str | os.PathLike | None = None) -> list[Path]:
    """Remove the temp directories of this user's earlier sandboxes whose process died without
    cleaning up (a kernel killed with SIGKILL): they hold the sandbox's private keys.
    Returns the directories removed."""
    base = Path(tmp or tempfile.gettempdir())
    entries = []
    try:
        with os.scandir(base) as it:
            for e in it:
                if e.name.startswith(SANDBOX_PREFIX) and e.is_dir(follow_symlinks=False):
                    try:
                        entries.append((e.name, e.stat(follow_symlinks=False).st_uid))
                    except OSError:
                        continue
    except OSError:
        return []
    removed = []
    for name in stale_sandbox_dirs(entries, os.getuid()):
        shutil.rmtree(base / name, ignore_errors=True)
        removed.append(base / name)
    return removed


class Sandbox:
    """The embedded default machine: an :class:`SshServer` in a temp dir, removed on stop.

    Sessions run as the current user with ``HOME`` set to :func:`sandbox_home` (cells start
    there), so nothing a tutorial does lands in the user's own home directory.  Starting one
    first removes the temp directories of this user's earlier sandboxes whose Python process
    is gone (see :func:`remove_stale_sandbox_dirs`).

    Parameters
    ----------
    fake_gpu : str, optional
        Replay a recorded GPU (``h200-idle`` / ``h200-load``) through a stand-in
        ``nvidia-smi``.  Off by default: the sandbox has no GPU and says so.
    home_name : str, optional
        Give this sandbox its own ``$HOME`` (``sandbox-home-NAME`` beside the shared one), so
        two sandboxes stand for two machines.
    """

    def __init__(self, *, fake_gpu: str | None = None, directory: str | None = None,
                 home_name: str | None = None):
        self._tmp = None
        check_platform()  # on Windows: one line naming WSL and Binder, before anything is made
        remove_stale_sandbox_dirs()
        if directory is None:
            pid = os.getpid()
            self._tmp = tempfile.TemporaryDirectory(prefix=f"{SANDBOX_PREFIX}{pid}-{process_start(pid)}-")
            directory = self._tmp.name
        self.home = sandbox_home()
        if home_name:  # a separate machine: its own home beside the shared one
            from .._fs import private_dir

            safe = re.sub(r"[^A-Za-z0-9_.-]", "_", home_name)
            self.home = private_dir(self.home.parent / f"sandbox-home-{safe}")
        self.server = SshServer(directory, fake_gpu=fake_gpu, env={"HOME": str(self.home)})

    def start(self) -> "Sandbox":
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def spec(self) -> HostSpec:
        return self.server.spec("sandbox")

    def running_sessions(self) -> list[tuple[str, float | None]]:
        """The sessions (``%gpu kernel``) whose keeper runs in this sandbox's home, as
        ``(name, idle_stop)`` sorted by name: they outlive the sandbox (their keepers are
        detached), until their idle time passes (``idle_stop`` seconds; None: never).  Read
        from the files here, the sandbox being this computer: no round trip."""
        import json

        root = self.home / ".gpumagic" / "kernels"  # remote.kernel.info.KERNELS_DIR
        found = []
        try:
            entries = sorted(os.listdir(root))
        except OSError:
            return []
        for name in entries:
            try:
                state = json.loads((root / name / "state.json").read_text(encoding="utf-8"))
                pid = int(state["keeper_pid"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if not process_running(pid, 0):
                continue
            try:  # a pid given to another process since (kernel_list.sh checks the same)
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"kernel_keeper" not in f.read():
                        continue
            except OSError:
                pass
            idle = state.get("idle_stop")
            found.append((name, float(idle) if isinstance(idle, (int, float)) else None))
        return found

    def shutdown_stand_in(self) -> Path:
        """The ``shutdown`` first on the sandbox's PATH, in its ``bin/``, which powers nothing
        off (the sandbox is this computer): one put there before (tutorial 04 puts its own),
        else gpumagic's ``sandbox-shutdown.sh``, which records each call as ``EPOCH shutdown
        ARGS`` in ``DIR/shutdown-calls``."""
        path = self.server.bin / "shutdown"
        if not path.exists():
            stand_in = resources.files("gpumagic.remote") / "programs" / "sandbox-shutdown.sh"
            self.server.install_bin("shutdown", stand_in.read_text(encoding="utf-8"))
        return path

    def __enter__(self) -> "Sandbox":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
