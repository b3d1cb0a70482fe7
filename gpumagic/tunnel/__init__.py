"""Tunnels: local port forwards over the machine's SSH connection (ssh -L)."""

from .forward import Tunnel, TunnelManager

__all__ = ['Tunnel', 'TunnelManager']
