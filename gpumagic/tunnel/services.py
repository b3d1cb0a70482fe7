"""TensorBoard and Jupyter on the machine, reached through a tunnel: find or start, record, stop.

The machine side is two programs (``gpumagic/remote/programs/``): ``tunnel-service.py``
finds a server already running or starts one detached and records it in
``~/.gpumagic/services/PID.json``; ``tunnel-stop-service.sh`` stops a recorded one.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..errors import GpumagicError, TunnelError
from ..remote import program
from ..remote.execution import run_program
from .ports import check_local_port

if TYPE_CHECKING:
    from .._types import MachineLike
    from .forward import Tunnel


@dataclass
class RemoteService:
    """A web service on the machine that a tunnel reaches.

    Attributes
    ----------
    port : int
        Its port on the machine (bound to the machine's 127.0.0.1).
    path : str
        URL path and query (a token) to open.
    pid : int
        Its process id on the machine.
    started : bool
        True when gpumagic started it now, False when it was already serving.
    log : str or None
        Its output file on the machine (when gpumagic started it).
    ours : bool
        True when gpumagic started it, now or earlier (from any kernel: the machine keeps a
        record of each service gpumagic starts, ``~/.gpumagic/services/PID.json``); only
        such a service is stopped by ``%gpu tunnel close ID --stop``.
    """

    port: int
    path: str
    pid: int
    started: bool
    log: str | None = None
    ours: bool = False

    def __post_init__(self):
        self.ours = self.ours or self.started

    @property
    def origin(self) -> str:
        """``started by gpumagic now`` / ``started by gpumagic earlier`` / ``not started by gpumagic``."""
        if self.started:
            return "started by gpumagic now"
        return "started by gpumagic earlier" if self.ours else "not started by gpumagic"


def start_tensorboard(machine: MachineLike, logdir: str = "runs", timeout: float = 90.0) -> RemoteService:
    """Find the TensorBoard serving ``logdir`` on the machine, or start one detached.

    Parameters
    ----------
    machine : gpumagic.Machine
    logdir : str
        Event-file directory, relative to the machine's working directory (``machine.cwd``)
        or absolute; created when missing.
    timeout : float
        Seconds to wait for a new TensorBoard to serve.

    Raises
    ------
    TunnelError
        TensorBoard is not installed for the machine's ``python3`` (hint: the pip command),
        or it did not start (the last lines of its log).
    """
    info = _find_or_start(machine, "TensorBoard", "tensorboard", timeout, "tensorboard", logdir)
    prefix = (info.get("path_prefix") or "").rstrip("/")
    return _service(info, path=prefix + "/")


def start_jupyter(machine: MachineLike, timeout: float = 90.0) -> RemoteService:
    """Find a running Jupyter server on the machine, or start one detached.

    Returns
    -------
    RemoteService
        ``path`` is ``BASE_URL?token=TOKEN`` (the token from the server's runtime file).

    Raises
    ------
    TunnelError
        Jupyter is not installed for the machine's ``python3`` (hint: the pip command), or
        it did not start (the last lines of its log).
    """
    info = _find_or_start(machine, "Jupyter", "jupyter", timeout, "jupyterlab")
    base = info.get("base_url") or "/"
    return _service(info, path=base + (f"?token={info['token']}" if info.get("token") else ""))


def _service(info: dict, path: str) -> RemoteService:
    return RemoteService(port=int(info["port"]), path=path, pid=int(info["pid"]),
                         started=bool(info["started"]), log=info.get("log"), ours=bool(info.get("ours")))


def _find_or_start(machine: MachineLike, what: str, kind: str, timeout: float, package: str, *args: str) -> dict:
    """Run ``tunnel-service.py KIND TIMEOUT ARGS`` with the machine's python3, in the cell
    directory and the login environment (as a cell runs); its JSON answer or a TunnelError."""
    command = program.command("tunnel-service.py", kind, float(timeout), *args)
    r = machine.run(["/bin/sh", "-c", command], quiet=True, timeout=timeout + 30)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.exit_code != 0 or not lines:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise TunnelError(f"could not start {what} on {machine.name}: {last}",
                          "check that `python3` works on the machine (`%%remote python3 -V`)")
    info = json.loads(lines[-1])
    if "missing" in info:
        raise TunnelError(f"{what} is not installed for {info['missing']} on {machine.name}",
                          f"install it there: a %%remote cell with `{shlex.quote(info['missing'])} -m pip install {package}`")
    if "failed" in info:
        raise TunnelError(f"{what} did not start on {machine.name}: {info['failed']}",
                          f"its log on the machine: {info['log']}")
    return info


def stop_remote_service(connection, service: RemoteService) -> None:
    """Stop a service gpumagic started, now or earlier (its whole process group: TensorBoard's
    data server too), and remove its record (``tunnel-stop-service.sh``); a service gpumagic
    did not start is left alone."""
    if service.ours:
        run_program(connection, "tunnel-stop-service.sh", int(service.pid), timeout=30)


def open_service_tunnel(machine: MachineLike, start: Callable[[], RemoteService], *, local_port: int | None,
                        name: str) -> Tunnel:
    """Check ``local_port``, find or start the service (``start()``), and return the tunnel to
    it (reused when one is open), keeping what gpumagic knows of the service.

    A service started just now (``service.started``) is stopped again when its tunnel cannot
    open, so a failed command leaves nothing running on the machine that nobody asked for.

    Raises
    ------
    TunnelError
        A bad ``local_port`` (before anything starts on the machine), and as ``start`` and
        :meth:`gpumagic.tunnel.manager.TunnelManager.open`.
    """
    check_local_port(local_port)  # before anything starts on the machine
    service = start()
    t = machine.tunnels.find("127.0.0.1", service.port)
    if t is None:
        try:
            t = machine.tunnels.open(service.port, remote_host="127.0.0.1", local_port=local_port,
                                     name=name, path=service.path)
        except BaseException:
            if service.started:
                try:
                    stop_remote_service(machine.connection, service)
                except (GpumagicError, OSError):
                    pass  # the error that stopped us is the one to show
            raise
    if t.service is None or t.service.pid != service.pid:  # keep "started by gpumagic now"
        t.service = service
    return t
