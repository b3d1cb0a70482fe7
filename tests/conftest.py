"""Test bed: real OpenSSH sshd servers on 127.0.0.1 and an isolated client HOME.

Tests never read the developer's ~/.ssh: HOME points at a temp dir for the whole run, and
SSH_AUTH_SOCK is removed.  The main server ``sshd`` replays the H200 recordings through a
stand-in nvidia-smi (``sshd.set_gpu("h200-load")`` switches it).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from gpumagic.ssh.sandbox import SshServer

_TMP = tempfile.mkdtemp(prefix="gpumagic-tests-")
CLIENT_HOME = Path(_TMP) / "client-home"
_saved_env = {}


def pytest_configure(config):
    for var in ("HOME", "SSH_AUTH_SOCK"):
        _saved_env[var] = os.environ.get(var)
    CLIENT_HOME.mkdir(parents=True, exist_ok=True)
    os.environ["HOME"] = str(CLIENT_HOME)
    os.environ.pop("SSH_AUTH_SOCK", None)


def pytest_unconfigure(config):
    for var, value in _saved_env.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value
    shutil.rmtree(_TMP, ignore_errors=True)


def make_server(name: str, **kwargs) -> SshServer:
    """A started SshServer under the test temp dir with its own remote HOME."""
    base = Path(_TMP) / name
    remote_home = base / "home"
    remote_home.mkdir(parents=True, exist_ok=True)
    env = {"HOME": str(remote_home), **kwargs.pop("env", {})}
    return SshServer(base, env=env, alias=name, **kwargs).start()


def add_client_entry(server: SshServer, alias: str, extra: str = "") -> None:
    """Add a Host block for ``server`` to the client's ~/.ssh/config and trust its key in
    the client's ~/.ssh/known_hosts (the real OpenSSH files that gpumagic reads)."""
    ssh = CLIENT_HOME / ".ssh"
    ssh.mkdir(mode=0o700, exist_ok=True)
    with open(ssh / "config", "a", encoding="utf-8") as f:
        f.write(f"\nHost {alias}\n  HostName {server.host}\n  Port {server.port}\n"
                f"  User {server.user}\n  IdentityFile {server.client_key}\n  IdentitiesOnly yes\n{extra}")
    with open(ssh / "known_hosts", "a", encoding="utf-8") as f:
        f.write(server.known_hosts.read_text(encoding="utf-8"))


#: Where the suite does not run as root, a machine can shut itself down only through passwordless
#: sudo (gpumagic.budget.shutdown): the probe then finds ``sudo -n BIN/shutdown -h now``.
SUDO = "" if os.geteuid() == 0 else "sudo -n "
#: A stand-in ``sudo`` that only runs its command (after ``-n``).
SUDO_STAND_IN = '#!/bin/sh\n[ "$1" = -n ] && shift\nexec "$@"\n'


def install_shutdown(server: SshServer, script: str) -> str:
    """Make ``server`` a machine that can shut itself down, harmlessly, as root or not:
    ``script`` is its ``shutdown`` (first on its PATH) and, where the suite is not root, a
    stand-in ``sudo`` goes next to it.  Returns the command gpumagic's probe must find there
    (``BIN/shutdown -h now``, after ``sudo -n`` where not root): never a real shutdown."""
    server.install_bin("shutdown", script)
    if SUDO:
        server.install_bin("sudo", SUDO_STAND_IN)
    return f"{SUDO}{server.bin}/shutdown -h now"


@pytest.fixture(scope="session")
def client_home() -> Path:
    return CLIENT_HOME


@pytest.fixture(scope="session")
def sshd() -> SshServer:
    """The main test server, reachable as the alias ``testgpu``."""
    server = make_server("testgpu", fake_gpu="h200-idle")
    add_client_entry(server, "testgpu")
    yield server
    server.stop()


@pytest.fixture
def machine(sshd):
    import gpumagic

    m = gpumagic.connect("testgpu")
    yield m
    m.close()


@pytest.fixture
def make_link(sshd):
    """Factory of machines behind an emulated link (tests/linkemu.py): ``make_link(rtt_ms=40,
    up_mbit=20, down_mbit=50, queue=None, keepalive=300, connect=True)`` returns a
    :class:`linkemu.LinkedMachine` (``.machine`` connected through a :class:`linkemu.Link` in
    front of ``sshd``; ``blink``, ``hold``/``release``, ``roam``, ``counters``, ``settle``).
    Everything made is closed after the test."""
    from linkemu import Link, LinkedMachine

    made: list = []

    def make(*, rtt_ms: float = 40, up_mbit: float | None = 20, down_mbit: float | None = 50,
             queue: int | None = None, **options) -> LinkedMachine:
        link = Link(sshd.port, rtt_ms=rtt_ms, up_mbit=up_mbit, down_mbit=down_mbit, queue=queue).start()
        try:
            made.append(LinkedMachine(sshd, link, **options))
        except BaseException:
            link.close()
            raise
        return made[-1]

    yield make
    for linked in made:
        linked.close()


@pytest.fixture
def link(make_link, request):
    """A machine behind the default emulated link (40 ms RTT, 20 Mbit/s up, 50 down); other
    parameters through ``@pytest.mark.parametrize("link", [dict(rtt_ms=60)], indirect=True)``."""
    return make_link(**getattr(request, "param", {}))


@pytest.fixture(scope="session")
def _ipython():
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    c = Config()
    c.HistoryManager.hist_file = ":memory:"
    shell = InteractiveShell.instance(config=c)
    shell.run_line_magic("load_ext", "gpumagic")
    return shell


@pytest.fixture
def ip(_ipython, sshd):
    """A real InteractiveShell with gpumagic loaded and no machine connected."""
    _ipython._gpumagic.fleet.close_all()
    yield _ipython
    _ipython._gpumagic.fleet.close_all()


def session_sshd_pid(machine) -> int:
    """PID of the sshd process serving ``machine``'s connection (the cell shell's grandparent),
    for injecting faults: SIGSTOP it (peer stops answering) or SIGKILL it (connection drops)."""
    return int(machine.run("cut -d' ' -f4 /proc/$PPID/stat", quiet=True).stdout)


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until true or ``timeout`` seconds pass; returns the last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
