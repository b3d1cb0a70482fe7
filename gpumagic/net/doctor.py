"""``%gpu doctor --net``: what the machine can reach, how fast, and what to do about it.

From the machine (``remote/programs/net-doctor.py``, run as a cell so the proxy variables
apply as they do to pip), every target at once: the time to the first byte and the
throughput while it reads, each within a timeout of a few seconds, so the whole check ends
within ``timeout + read_time`` seconds.  The targets are the upstreams of ``mirrors.json``
(PyPI, the PyTorch wheel index, Hugging Face, GitHub, conda-forge), the mirrors the machine
is set to use, and each kind's default mirror.  Each result becomes one line with a verdict
and what to do (:func:`verdicts`, pure): "huggingface.co timed out; hf-mirror.com 12 MB/s:
`%gpu mirrors hf`", or "try `%gpu proxy on`".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..errors import GpumagicError
from ..remote import program
from . import catalog
from .catalog import Target

#: The machine-side program.
PROGRAM = "net-doctor.py"
#: Seconds a target has to send its first byte.
TIMEOUT = 4.0
#: Seconds of reading after the first byte (the throughput's sample).
READ_TIME = 2.0
#: Most bytes read from one target.
MAX_BYTES = 8 * 1024 * 1024
#: Below this rate (bytes per second) a site is slow: a 2 GB checkpoint takes over half an hour.
SLOW_RATE = 1_000_000
#: A first byte later than this (seconds) is slow too.
SLOW_FIRST_BYTE = 2.0
#: Bodies smaller than this (bytes) say nothing about throughput: judged by the first byte alone.
MIN_SAMPLE = 256 * 1024


@dataclass
class Result:
    """One target's measurement and verdict.

    Attributes
    ----------
    target : Target
    status : str
        ``ok``, ``slow``, ``timeout``, ``http`` (an HTTP error status) or ``error``.
    first_byte : float or None
        Seconds to the first byte of the body.
    rate : float or None
        Bytes per second after the first byte (None: too little to tell).
    detail : str
        The verdict in words ("timed out", "12 MB/s", "HTTP 403", "Name or service not known").
    hint : str
        What to do ("" when nothing).
    """

    target: Target
    status: str
    first_byte: float | None = None
    rate: float | None = None
    detail: str = ""
    hint: str = ""

    @property
    def good(self) -> bool:
        return self.status == "ok"

    @property
    def line(self) -> str:
        """``NAME VERDICT[; HINT]``, one line."""
        what = f"{self.target.name} {self.detail}"
        if self.target.mirror:
            what += f" ({self.target.kind} mirror{', in use' if self.target.configured else ''})"
        return f"{what}; {self.hint}" if self.hint else what


@dataclass
class NetReport:
    """What ``%gpu doctor --net`` found.

    Attributes
    ----------
    machine : str
    results : list of Result
        In the targets' order.
    seconds : float
        How long the check took on the machine (bounded by ``timeout + read_time``).
    proxy : str
        The ``https_proxy`` the check ran with ("" for none).
    turbo : bool
        The machine has AutoDL's accelerator script (``/etc/network_turbo``).
    """

    machine: str
    results: list[Result] = field(default_factory=list)
    seconds: float = 0.0
    proxy: str = ""
    turbo: bool = False

    @property
    def text(self) -> str:
        head = f"network from {self.machine} ({self.seconds:.1f} s" + (f", through {self.proxy})" if self.proxy else ")")
        return "\n".join([head, *("  " + r.line for r in self.results)])

    def __str__(self) -> str:
        return self.text


def rate_text(rate: float) -> str:
    """``12 MB/s``, ``340 KB/s`` (decimal units, as download tools show them)."""
    if rate >= 1e6:
        return f"{rate / 1e6:.0f} MB/s" if rate >= 1e7 else f"{rate / 1e6:.1f} MB/s"
    return f"{rate / 1e3:.0f} KB/s"


def judge(target: Target, raw: dict, timeout: float) -> Result:
    """One measurement (``net-doctor.py``'s entry) as a :class:`Result` without a hint. Pure."""
    status = raw.get("status", "timeout")
    if status == "timeout":
        return Result(target, "timeout", detail=f"timed out (no answer within {timeout:g} s)")
    if status == "error":
        return Result(target, "error", detail=f"unreachable ({raw.get('error') or 'no connection'})")
    if status == "http":
        return Result(target, "http", raw.get("ttfb"), detail=f"answered HTTP {raw.get('http')}")
    ttfb = float(raw.get("ttfb") or 0.0)
    got, secs = int(raw.get("bytes") or 0), float(raw.get("seconds") or 0.0)
    small = got < MIN_SAMPLE and raw.get("complete")
    rate = None if small or secs <= 0 else got / secs
    slow = ttfb > SLOW_FIRST_BYTE or (rate is not None and rate < SLOW_RATE)
    speed = rate_text(rate) if rate is not None else f"{got:,} bytes"
    detail = (f"slow ({speed}, first byte {ttfb:.2f} s)" if slow else f"{speed}, first byte {ttfb:.2f} s")
    return Result(target, "slow" if slow else "ok", ttfb, rate, detail)


def verdicts(targets: list[Target], raw: list[dict], *, timeout: float, proxy_on: bool,
             turbo: bool = False) -> list[Result]:
    """Each target's result with what to do. Pure.

    An upstream that is not good gets, in this order: the fastest good mirror of its kind
    that the machine does not use yet (``hf-mirror.com 12 MB/s: `%gpu mirrors hf```); nothing
    when a mirror of its kind in use is good; else the proxy (``try `%gpu proxy on```, or,
    with the proxy on, to check it), and AutoDL's accelerator where it exists.  A mirror in
    use that is not good gets another good one, or ``%gpu mirrors KIND off``.
    """
    results = [judge(t, r, timeout) for t, r in zip(targets, raw)]
    for res in results:
        if res.good:
            continue
        t = res.target
        mirrors = sorted((r for r in results if r.target.mirror and r.target.kind == t.kind and t.kind
                          and r.good and r is not res), key=lambda r: -(r.rate or 0))
        in_use = [r for r in mirrors if r.target.configured]
        if t.mirror:  # a mirror itself
            other = [r for r in mirrors if not r.target.configured]
            res.hint = (_use(other[0]) if other else
                        f"`%gpu mirrors {t.kind} off` goes back to the upstream" if t.configured else "")
            continue
        if in_use:
            res.hint = f"{t.kind} uses {in_use[0].target.name} ({in_use[0].detail.split(',')[0]}): nothing to do"
        elif mirrors:
            best = mirrors[0]
            res.hint = f"{best.target.name} {best.detail.split(',')[0]}: {_command(best.target)}"
        else:
            res.hint = ("the proxy is on: check that it reaches this site from your computer" if proxy_on
                        else "try `%gpu proxy on`" + (" (or AutoDL's `source /etc/network_turbo` in the cell)"
                                                      if turbo else ""))
    return results


def _command(t: Target) -> str:
    default = catalog.mirrors(t.kind)[0].name if t.kind in catalog.KINDS else ""
    return f"`%gpu mirrors {t.kind}`" if t.mirror == default else f"`%gpu mirrors {t.kind} {t.mirror}`"


def _use(r: Result) -> str:
    return f"{r.target.name} {r.detail.split(',')[0]}: {_command(r.target)}"


def default_targets(configured: dict[str, str]) -> list[Target]:
    """The upstreams, then for each mirror kind the mirror in use (``configured``: kind ->
    URL, from the machine) and the kind's default mirror."""
    targets = catalog.upstream_targets()
    for kind in catalog.KINDS:
        url = configured.get(kind)
        used = None
        for m in catalog.mirrors(kind):
            if url and catalog.host_of(url) == m.host:
                used = m
        if url and used is None:  # a mirror gpumagic does not know: measured as it is
            name = catalog.host_of(url) or url
            targets.append(Target(name, url, kind, name, configured=True))
        if used is not None:
            targets.append(catalog.mirror_target(used, configured=True))
        default = catalog.mirrors(kind)[0]
        if used is None or used.name != default.name:
            targets.append(catalog.mirror_target(default))
    return targets


def configured_mirrors(found: dict, env: dict) -> dict[str, str]:
    """The mirror each kind uses on the machine (kind -> URL), from ``net-settings.py
    read`` (``found``) and the environment cells get (``env``: ``HF_ENDPOINT``). Pure."""
    out: dict[str, str] = {}
    index = found.get("pip_index") or ""
    if index and catalog.host_of(index) not in ("pypi.org", "pypi.python.org", ""):
        out["pip"] = index
    if env.get("HF_ENDPOINT") and catalog.host_of(env["HF_ENDPOINT"]) != "huggingface.co":
        out["hf"] = env["HF_ENDPOINT"]
    for url in found.get("conda_urls", []):
        for tail in ("/cloud", "/pkgs/main"):
            if url.rstrip("/").endswith(tail):
                out.setdefault("conda", url.rstrip("/")[:-len(tail)])
    return out


def machine_targets(machine) -> list[Target]:
    """:func:`default_targets` with the mirrors ``machine`` uses (one round trip)."""
    from . import settings

    return default_targets(configured_mirrors(settings.run(machine, "read"), machine.env.current()))


def run(machine, targets: list[Target] | None = None, *, timeout: float = TIMEOUT,
        read_time: float = READ_TIME, max_bytes: int = MAX_BYTES) -> NetReport:
    """Measure ``targets`` (default: :meth:`machine.net.targets() <gpumagic.net.Net.targets>`) from ``machine`` (one
    round trip, at most ``timeout + read_time`` seconds there).

    Raises
    ------
    GpumagicError
        The machine has no Python 3, or the check gave no answer.
    """
    targets = list(targets if targets is not None else machine.net.targets())
    spec = json.dumps([{"name": t.name, "url": t.url} for t in targets])
    r = machine.run(["python3", "-c", program.source(PROGRAM), spec, str(timeout), str(read_time),
                     str(max_bytes)], quiet=True, timeout=timeout + read_time + 30)
    try:
        report = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise GpumagicError(f"the network check on {machine.name} gave no answer: {last}",
                            "it needs python3 on the machine (`which python3` in a %%remote cell)") from None
    results = verdicts(targets, report["results"], timeout=timeout, proxy_on=bool(report.get("proxy")),
                       turbo=bool(report.get("turbo")))
    return NetReport(machine.name, results, float(report.get("seconds", 0.0)), report.get("proxy", ""),
                     bool(report.get("turbo")))
