"""The mirrors, direct hosts and upstreams of ``gpumagic/net/mirrors.json``, as objects.

The list is data, not code: each mirror names its own documentation (``source``).  Pure
functions: nothing here reaches the network or the machine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from urllib.parse import urlsplit

from ..errors import ConfigError

#: The kinds of mirror ``%gpu mirrors`` sets, each with what it changes on the machine.
KINDS = {"pip": "pip's global.index-url (per user, `pip config --user`)",
         "hf": "HF_ENDPOINT in the environment of new cells, sessions and jobs",
         "conda": "default_channels and channel_alias in ~/.condarc"}


@dataclass(frozen=True)
class Mirror:
    """One well-known mirror.

    Attributes
    ----------
    kind : str
        ``pip``, ``hf`` or ``conda``.
    name : str
        What ``%gpu mirrors KIND NAME`` takes (``tuna``).
    title : str
        Who runs it.
    url : str
        pip: the simple index; hf: the endpoint; conda: the base (``BASE/pkgs/main``,
        ``BASE/cloud``).
    source : str
        The mirror's own documentation, where ``url`` was read.
    """

    kind: str
    name: str
    title: str
    url: str
    source: str

    @property
    def host(self) -> str:
        return host_of(self.url)


@dataclass(frozen=True)
class Target:
    """One thing ``%gpu doctor --net`` measures from the machine.

    Attributes
    ----------
    name : str
        What its line starts with (``huggingface.co``, ``hf-mirror.com``).
    url : str
        What is fetched (a page or file of a few MB at most is read).
    kind : str
        The mirror kind that can stand in for it (``hf``), or "" (GitHub: only a proxy helps).
    mirror : str
        For a mirror: its ``%gpu mirrors`` name (``hf-mirror``); "" for an upstream.
    configured : bool
        A mirror the machine is set to use now.
    """

    name: str
    url: str
    kind: str = ""
    mirror: str = ""
    configured: bool = False


@lru_cache(maxsize=None)
def _data() -> dict:
    return json.loads((resources.files("gpumagic.net") / "mirrors.json").read_text(encoding="utf-8"))


def host_of(url: str) -> str:
    """The host name of ``url`` (lower case, no port), or "" for none."""
    try:
        return (urlsplit(url).hostname or "").lower()
    except ValueError:
        return ""


def mirrors(kind: str | None = None) -> list[Mirror]:
    """Every known mirror (of ``kind`` alone when given), the default of each kind first."""
    data = _data()["mirrors"]
    return [Mirror(k, m["name"], m["title"], m["url"], m["source"])
            for k, entries in data.items() if kind in (None, k) for m in entries]


def mirror(kind: str, name: str | None = None) -> Mirror:
    """The mirror ``name`` of ``kind`` (default: that kind's first).

    Raises
    ------
    ConfigError
        An unknown kind or name, naming those that exist.
    """
    if kind not in KINDS:
        raise ConfigError(f"no mirror kind {kind!r}", f"use one of: {', '.join(KINDS)}")
    found = mirrors(kind)
    if name is None:
        return found[0]
    for m in found:
        if m.name == name.lower():
            return m
    raise ConfigError(f"no {kind} mirror named {name!r}",
                      f"use one of: {', '.join(m.name for m in found)} (gpumagic/net/mirrors.json lists them)")


def direct_hosts() -> list[str]:
    """Hosts a proxy never carries: this machine and the cloud metadata endpoints."""
    return [h["host"] for h in _data()["direct"]["hosts"]]


def upstream_targets() -> list[Target]:
    """The upstreams ``%gpu doctor --net`` measures (PyPI, the PyTorch wheel index, Hugging
    Face, GitHub, conda-forge)."""
    return [Target(t["name"], t["url"], t["kind"]) for t in _data()["upstreams"]["targets"]]


def mirror_target(m: Mirror, configured: bool = False) -> Target:
    """What to measure on mirror ``m``: its copy of the upstream's page or file."""
    path = _data()["upstreams"]["mirror_paths"][m.kind]
    return Target(m.host, m.url.rstrip("/") + path, m.kind, m.name, configured)
