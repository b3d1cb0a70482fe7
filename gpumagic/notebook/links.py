"""Which address a browser uses to reach a tunnel's local port.

A tunnel listens on ``127.0.0.1:PORT`` of the computer that runs the kernel.  When the
notebook server runs on the user's own computer, that is the browser's computer too and
``http://127.0.0.1:PORT/`` is the link.  On Binder, a JupyterHub or a lab server the browser
is elsewhere: ``127.0.0.1`` would be the user's laptop.  There the link goes through
jupyter-server-proxy, the ecosystem's standard, as ``<base_url>proxy/PORT/``.

The environment variable ``GPUMAGIC_LINKS`` overrides the guess: ``local`` (always
``127.0.0.1``), ``proxy`` (always through the server), ``auto`` (the default).
"""

from __future__ import annotations

import os
from typing import Mapping
from urllib.parse import urlsplit

from ..errors import ConfigError

#: Set by JupyterHub's spawners (``/user/NAME/``) and Binder (which runs a JupyterHub), or by
#: Binder itself: each means the notebook server is not on the user's computer.
REMOTE_SERVER_VARS = ("JUPYTERHUB_SERVICE_PREFIX", "BINDER_SERVICE_HOST", "BINDER_LAUNCH_HOST",
                      "BINDER_REPO_URL", "BINDER_REQUEST", "BINDER_REF_URL")
LOOPBACK = {"localhost", "127.0.0.1", "::1", "[::1]"}


def _server_info(env: Mapping[str, str]) -> dict | None:
    """The running Jupyter server that started this kernel (``JPY_PARENT_PID``), from its
    runtime file (jupyter_server's ``list_running_servers``), or None."""
    pid = env.get("JPY_PARENT_PID", "")
    if not pid.isdigit():
        return None
    try:
        from jupyter_server.serverapp import list_running_servers
    except ImportError:
        return None
    try:
        return next((s for s in list_running_servers() if str(s.get("pid")) == pid), None)
    except Exception:  # an unreadable runtime file: no guess from it
        return None


def mode(env: Mapping[str, str] | None = None, server: dict | None = None) -> str:
    """``"proxy"`` or ``"local"`` for this kernel (see the module docstring).

    Parameters
    ----------
    env : mapping, optional
        The environment (default ``os.environ``).
    server : dict, optional
        The server's runtime info (``hostname``/``ip``, ``base_url``); default: looked up.

    Raises
    ------
    gpumagic.errors.ConfigError
        ``GPUMAGIC_LINKS`` set to something else than ``auto``, ``local`` or ``proxy``.
    """
    env = os.environ if env is None else env
    choice = env.get("GPUMAGIC_LINKS", "auto").strip().lower() or "auto"
    if choice not in ("auto", "local", "proxy"):
        raise ConfigError(f"GPUMAGIC_LINKS={choice!r} is not a link mode",
                          "set it to auto (the default), local (http://127.0.0.1:PORT/) or proxy "
                          "(<base_url>proxy/PORT/ through jupyter-server-proxy)")
    if choice != "auto":
        return choice
    if any(env.get(v) for v in REMOTE_SERVER_VARS):
        return "proxy"
    server = _server_info(env) if server is None else server
    if server is not None:
        host = str(server.get("hostname") or server.get("ip") or "")
        if host and host not in LOOPBACK:  # listening for other computers: a lab server
            return "proxy"
    return "local"


def base_url(env: Mapping[str, str] | None = None, server: dict | None = None) -> str:
    """The notebook server's base URL path, ending in ``/``: ``JUPYTERHUB_SERVICE_PREFIX``,
    else the running server's ``base_url``, else ``/``."""
    env = os.environ if env is None else env
    base = env.get("JUPYTERHUB_SERVICE_PREFIX") or ""
    if not base:
        server = _server_info(env) if server is None else server
        base = (server or {}).get("base_url") or "/"
    return "/" + base.strip("/") + "/" if base.strip("/") else "/"


def browser_url(url: str, env: Mapping[str, str] | None = None, server: dict | None = None) -> str:
    """The address a browser uses for a tunnel's local ``url`` (``http://127.0.0.1:PORT/path``):
    the same, or ``<base_url>proxy/PORT/path`` through jupyter-server-proxy."""
    env = os.environ if env is None else env
    if mode(env, server) == "local":
        return url
    parts = urlsplit(url)
    path = parts.path.lstrip("/")
    query = f"?{parts.query}" if parts.query else ""
    return f"{base_url(env, server)}proxy/{parts.port}/{path}{query}"
