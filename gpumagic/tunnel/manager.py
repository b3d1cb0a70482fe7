"""The tunnels of one machine (``machine.tunnels``), and the loop guard for a machine that is
this computer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import GpumagicError, TunnelError
from .forward import Tunnel
from .ports import is_loopback, machine_is_this_computer
from .reverse import ReverseTunnel
from .services import open_service_tunnel, start_jupyter, start_tensorboard, stop_remote_service

if TYPE_CHECKING:
    from .._types import MachineLike


class TunnelManager:
    """The tunnels of one machine: local forwards by local port (the ID shown by ``%gpu
    tunnel list``), reverse ones (:attr:`reverse`) by the machine's port (ID ``R`` and it),
    and the TensorBoard and Jupyter servers reached through them (:meth:`tensorboard`,
    :meth:`jupyter`).

    Parameters
    ----------
    machine : MachineLike
        The machine; new tunnels forward over its connection.
    """

    def __init__(self, machine: MachineLike):
        self.machine = machine
        self.connection = machine.connection
        self.tunnels: dict[int, Tunnel] = {}
        #: Reverse tunnels (``ssh -R``) by ID (``R7890``).
        self.reverse: dict[str, ReverseTunnel] = {}

    def open(self, remote_port: int, *, remote_host: str = "localhost",
             local_port: int | None = None, **options) -> Tunnel:
        """Start a :class:`Tunnel` (options as its constructor) and keep it listed.

        An open tunnel to the same ``remote_host:remote_port`` is returned instead of a new
        one, unless another ``local_port`` is asked for than the one it has or was moved
        from (0: a new one on any free port).  A wanted local port held by another of these
        tunnels moves the new one to a free port, :attr:`Tunnel.moved_reason` naming the
        holder.  When the machine is this computer (its SSH address is loopback: the
        sandbox), a loopback target's own port and the targets of the other loopback
        tunnels are never bound: the machine's side would connect back into gpumagic's own
        listener and forward in a loop.
        """
        same = self.find(remote_host, int(remote_port))
        if same is not None and local_port in (None, same.local_port, same.moved_from):
            return same
        wanted = int(remote_port if local_port is None else local_port)
        avoid = {}
        if machine_is_this_computer(self.connection) and is_loopback(remote_host):
            here = f"({self.connection.spec.address} is this computer)"
            avoid = {o.remote_port: f"is the target of tunnel {o.local_port} {here}: listening there "
                                    "would forward in a loop"
                     for o in self if is_loopback(o.remote_host)}
            avoid[int(remote_port)] = (f"is {remote_host}:{remote_port} on the machine too {here}: "
                                       "listening there, the tunnel would forward to itself in a loop")
        for o in self:
            if o.local_port == wanted and wanted not in avoid:
                avoid[wanted] = f"is used by gpumagic's tunnel {o.local_port} -> {o.target} ({o.name})"
        t = Tunnel(self.connection, remote_port, remote_host=remote_host, local_port=local_port,
                   avoid_ports=avoid, **options).start()
        self.tunnels[t.local_port] = t
        return t

    def open_reverse(self, local_port: int, *, remote_port: int | None = None,
                     name: str = "") -> ReverseTunnel:
        """Make the machine's ``127.0.0.1:remote_port`` reach this computer's
        ``127.0.0.1:local_port`` (like ``ssh -N -R P:127.0.0.1:L``): a started
        :class:`ReverseTunnel`, kept listed; it listens again after a reconnect.

        Parameters
        ----------
        local_port : int
            Port on this computer (a local proxy's, 7890).
        remote_port : int, optional
            Port on the machine's 127.0.0.1 (default: the same number; when that one is
            taken there, one the server picks: ``tunnel.remote_port``, ``tunnel.moved_from``).
            A port given here that is taken is refused, also one held by another of these
            tunnels (one not given moves).
        name : str
            Label for listings.

        Returns
        -------
        ReverseTunnel
            Already listening on the machine's loopback only; ``with`` closes it.  An open
            one to the same local port is returned as it is, unless another
            ``remote_port`` is asked for than the one it has.

        Raises
        ------
        TunnelError
            Refused by the server, with why (taken, AllowTcpForwarding, GatewayPorts yes).
        ConnectionLost
        """
        for r in self.reverse_tunnels():
            if r.local_port == int(local_port) and remote_port in (None, r.remote_port):
                return r
        taken = {r.remote_port: f"gpumagic's reverse tunnel {r.id} (-> this computer's {r.target}, {r.name})"
                 for r in self.reverse_tunnels() if r.remote_port is not None}
        r = ReverseTunnel(self.connection, local_port, remote_port=remote_port, name=name,
                          taken=taken).start()
        self.reverse[r.id] = r
        return r

    def tensorboard(self, logdir: str = "runs", *, local_port: int | None = 6006) -> Tunnel:
        """Open TensorBoard on ``logdir`` through a tunnel, starting it on the machine if no
        TensorBoard serves that directory yet (bound to the machine's 127.0.0.1).

        Returns
        -------
        Tunnel
            ``.url`` opens TensorBoard; ``.service`` tells its remote port and pid.

        Raises
        ------
        TunnelError
            TensorBoard missing on the machine (the hint has the pip command) or not starting.
        """
        return open_service_tunnel(self.machine, lambda: start_tensorboard(self.machine, logdir),
                                   local_port=local_port, name=f"tensorboard {logdir}")

    def jupyter(self, *, local_port: int | None = 8888) -> Tunnel:
        """Open the machine's Jupyter server through a tunnel (starting JupyterLab detached,
        bound to the machine's 127.0.0.1, when none runs); ``.url`` includes the token.

        Raises
        ------
        TunnelError
            Jupyter missing on the machine (the hint has the pip command) or not starting.
        """
        return open_service_tunnel(self.machine, lambda: start_jupyter(self.machine), local_port=local_port,
                                   name="jupyter")

    def reverse_tunnels(self) -> list[ReverseTunnel]:
        """The open reverse tunnels (one stopped directly leaves the list); their IDs follow a
        move after a reconnect."""
        for key, r in list(self.reverse.items()):
            if r.stopped:
                self.reverse.pop(key, None)
            elif key != r.id:
                self.reverse[r.id] = self.reverse.pop(key)
        return list(self.reverse.values())

    def close_reverse(self, id: str) -> ReverseTunnel:
        """Stop and forget one reverse tunnel (ID ``R7890``, or the machine's port alone).

        Raises
        ------
        TunnelError
            When no reverse tunnel has that ID.
        """
        self.reverse_tunnels()
        key = id if id.upper().startswith("R") else f"R{id}"
        r = self.reverse.pop(key.upper(), None)
        if r is None:
            known = ", ".join(sorted(self.reverse)) or "none"
            raise TunnelError(f"no reverse tunnel {key} (open: {known})",
                              "`%gpu tunnel list` shows the IDs")
        r.stop(raise_errors=False)
        return r

    def find(self, remote_host: str, remote_port: int) -> Tunnel | None:
        """An open tunnel to that target, if there is one."""
        for t in self.tunnels.values():
            if t.is_open and t.remote_port == remote_port and t.remote_host == remote_host:
                return t
        return None

    def close(self, local_port: int, stop_service: bool = False) -> Tunnel:
        """Stop and forget one tunnel; its unreported faults stay on the returned object.

        With ``stop_service``, also stop the remote TensorBoard/Jupyter that gpumagic
        started for it (one that was already running is left alone).

        Raises
        ------
        TunnelError
            When no tunnel uses that local port.
        """
        t = self.tunnels.pop(local_port, None)
        if t is None:
            known = ", ".join(str(p) for p in sorted(self.tunnels)) or "none"
            raise TunnelError(f"no tunnel on local port {local_port} (open: {known})",
                              "`%gpu tunnel list` shows the IDs (local ports)")
        t.stop(raise_errors=False)
        if stop_service and t.service is not None and self.connection.is_connected:
            try:
                stop_remote_service(self.connection, t.service)
            except GpumagicError as e:  # closing must go on; the caller shows the fault
                t._fault(None, f"could not stop its server (pid {t.service.pid}): {e.message}", e)
        return t

    def close_all(self, stop_service: bool = False) -> list[Tunnel | ReverseTunnel]:
        """Stop every tunnel, local and reverse (on disconnect and when the kernel exits)."""
        closed: list[Tunnel | ReverseTunnel] = []
        for port in list(self.tunnels):
            closed.append(self.close(port, stop_service=stop_service))
        for r in self.reverse_tunnels():
            closed.append(self.close_reverse(r.id))
        return closed

    def __iter__(self):
        # A tunnel stopped directly (``with machine.tunnel(...)``) leaves the list.
        for port, t in list(self.tunnels.items()):
            if t._state == "closed":
                self.tunnels.pop(port, None)
        return iter(list(self.tunnels.values()))

    def __len__(self) -> int:
        return len(self.tunnels)
