"""Tunnels: local port forwards over the machine's SSH connection (ssh -L), and reverse ones
(ssh -R).

``forward`` moves the bytes (:class:`Tunnel`), ``reverse`` the other way
(:class:`ReverseTunnel`), ``manager`` keeps a machine's tunnels
(:class:`TunnelManager`, the loop guard), ``ports`` checks and binds local ports, and
``services`` finds or starts TensorBoard and Jupyter on the machine for a tunnel.
"""

from .forward import Tunnel, TunnelFault
from .manager import TunnelManager
from .reverse import ReverseTunnel
from .services import RemoteService, start_jupyter, start_tensorboard

__all__ = ['RemoteService', 'ReverseTunnel', 'Tunnel', 'TunnelFault', 'TunnelManager', 'start_jupyter', 'start_tensorboard']
