"""``%gpu wrapup``: before releasing a machine, pull what is left, clean caches, know the image.

A released disk is gone, and a saved image is billed by its size.  :func:`wrapup` does four
things, through the public APIs of the other modules:

1. **Results not pulled yet.**  For each ``(remote, local)`` pair -- given, or remembered
   from the last wrapup of the same machine (``wrapup.json`` in the user data directory,
   :func:`gpumagic.paths.data_dir`) -- a dry-run pull (:meth:`Machine.pull` with
   ``dry_run=True, update=True``: files missing locally or newer on the machine, compared by
   size and modification time as ``rsync -a`` does) lists what the local copy lacks, then
   the same pull without ``dry_run`` fetches it.  A newer local file is never replaced.
2. **Caches an image would carry**: pip and the rest of ``~/.cache``, conda's package
   caches, the temporary folder, old VS Code server versions, ``__pycache__`` folders, each
   with its size (the machine-side program ``gpumagic/remote/programs/wrapup-scan.py``, sent with
   each call).  ``clean=True`` removes them after one confirmation that lists them -- those
   caches only, never anything else.
3. **The system disk** (``/``): what an image of it would hold (used bytes, from
   ``statvfs``), and what that costs per month at the budget's image price (or its storage
   price), :class:`gpumagic.budget.Prices`.
4. **What still runs**: gpumagic jobs (:meth:`Machine.jobs`), Jupyter kernels, processes
   using the GPU (``nvidia-smi``), and any armed shutdown (a job's ``--then-shutdown``, the
   budget guard).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING

from ._format import format_bytes
from .errors import GpumagicError, WrapupError
from .paths import data_dir

if TYPE_CHECKING:
    from ._types import MachineLike

#: Size under which a cache is not worth listing (bytes).
MIN_LISTED = 1


def program_source() -> str:
    """The machine-side scanner (``gpumagic/remote/programs/wrapup-scan.py``)."""
    return (resources.files("gpumagic.remote") / "programs" / "wrapup-scan.py").read_text(encoding="utf-8")


# -- remembered result folders ---------------------------------------------------------------


def _store_path():
    return data_dir() / "wrapup.json"


def remembered(name: str) -> list[tuple[str, str]]:
    """The ``(remote, local)`` pairs last used by ``%gpu wrapup --pull`` for machine ``name``."""
    try:
        data = json.loads(_store_path().read_text(encoding="utf-8"))
        return [tuple(p) for p in data.get("machines", {}).get(name, [])]
    except (OSError, ValueError, AttributeError, TypeError):
        return []


def remember(name: str, pulls: list[tuple[str, str]]) -> None:
    """Store ``pulls`` for machine ``name`` (written atomically)."""
    from ._fs import atomic_write

    path = _store_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data.get("machines"), dict):
            raise ValueError
    except (OSError, ValueError, AttributeError):
        data = {"machines": {}}
    data["machines"][name] = [list(p) for p in pulls]
    atomic_write(path, json.dumps(data, indent=1))


# -- the report ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cache:
    """One cache on the machine: ``label``, apparent size in ``bytes``, ``files``, whether
    ``clean`` may remove it (``cleanable``, else ``note`` says why), and up to 20 ``paths``
    (``more`` not shown)."""

    id: str
    label: str
    bytes: int
    files: int
    cleanable: bool
    note: str = ""
    paths: tuple = ()
    more: int = 0


@dataclass
class PullResult:
    """One results folder: what the local copy lacked (``pending``, relative paths), the
    pull's :class:`gpumagic.sync.SyncSummary` (``None`` when nothing was pulled), or ``error``."""

    src: str
    dst: str
    pending: list = field(default_factory=list)
    summary: object = None
    error: str = ""
    #: Files here whose content differs from the machine's and that are newer here (kept).
    differs: list = field(default_factory=list)


@dataclass
class WrapupReport:
    """Everything ``%gpu wrapup`` found and did (sizes in bytes).

    Attributes
    ----------
    machine : str
    pulls : list of PullResult
    caches : list of Cache
    disk_used, disk_size : int or None
        The system disk (``/``).
    image : str
        What an image of it costs per month, or how to tell gpumagic the price.
    running : list of str
        Jobs, kernels and GPU processes still running, one phrase each.
    kernels_checked : bool
        False on the sandbox, whose processes are this computer's.
    shutdowns : list of str
        Armed shutdowns (jobs' ``--then-shutdown``, the guard).
    cleaned : list of dict or None
        With ``clean``: ``{"label", "freed", "errors"}`` per cache removed; ``None`` when
        nothing was removed (not asked, not confirmed, or nothing to remove).
    declined : bool
        The confirmation was refused.
    """

    machine: str
    pulls: list = field(default_factory=list)
    caches: list = field(default_factory=list)
    disk_used: int | None = None
    disk_size: int | None = None
    image: str = ""
    running: list = field(default_factory=list)
    shutdowns: list = field(default_factory=list)
    cleaned: list | None = None
    declined: bool = False
    kernels_checked: bool = True

    @property
    def cache_bytes(self) -> int:
        return sum(c.bytes for c in self.caches)


def scan(machine: MachineLike, *, clean_ids=(), timeout: float = 900) -> dict:
    """Run the machine-side scanner once (and remove the caches ``clean_ids`` names).

    Raises
    ------
    WrapupError
        When python3 is missing there or the answer cannot be read.
    """
    request = {"cwd": machine.cwd if machine.cwd and machine.cwd != "~" else None,
               "system": not machine.is_this_computer, "clean": list(clean_ids)}
    # base64 of the request: one word that every login shell (bash, zsh, fish, csh) passes as is
    word = base64.b64encode(json.dumps(request).encode("utf-8")).decode("ascii")
    r = machine.exec(f"python3 - scan {word}",
                     stdin=program_source().encode("utf-8"), timeout=timeout)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        if r.exit_code == 127 or "not found" in r.stderr:
            raise WrapupError(f"python3 is not available on {machine.name}",
                              "install it there (apt-get install python3), then run this again") from None
        raise WrapupError(f"could not read {machine.name}'s caches (exit {r.exit_code}: "
                          f"{r.stderr.strip()[-200:]})", "run `%gpu wrapup` again") from None


def caches_from(answer: dict) -> list[Cache]:
    """The caches of a scanner answer, largest first (empty ones left out)."""
    out = [Cache(it["id"], it["label"], int(it["bytes"]), int(it["files"]), bool(it["cleanable"]),
                 it.get("note", ""), tuple(it.get("paths", ())), int(it.get("more", 0)))
           for it in answer.get("items", [])]
    return sorted([c for c in out if c.bytes >= MIN_LISTED or not c.cleanable and c.note],
                  key=lambda c: -c.bytes)


def image_line(used: int | None, prices) -> str:
    """What an image of ``used`` bytes costs per month at ``prices``' image price (else its
    storage price), or how to set one.  GB are 10^9 bytes, as platforms bill."""
    from .budget.prices import MONTH_DAYS

    if used is None:
        return "the system disk's size could not be read"
    gb = used / 1e9
    if prices is not None:
        for kind in ("image", "storage"):
            rate, per = getattr(prices, f"{kind}_rate"), getattr(prices, f"{kind}_per")
            if rate:
                month = gb * rate * (1 if per == "month" else MONTH_DAYS)
                note = "" if kind == "image" else " (your storage price; set --image-rate-month for images)"
                return (f"an image of / would hold about {gb:.1f} GB: {prices.money(month)} per month "
                        f"at {rate:g} per GB-{per}{note}")
    return (f"an image of / would hold about {gb:.1f} GB; tell gpumagic the price to see its cost: "
            "`%gpu budget set --image-rate-month PRICE_PER_GB`")


def what_runs(machine: MachineLike, answer: dict) -> tuple[list[str], list[str]]:
    """(running, shutdowns): jobs, Jupyter kernels and GPU processes still running, and the
    armed shutdowns."""
    from ._format import duration
    from .budget import read_status

    running, shutdowns = [], []
    for info in machine.jobs():
        if info.running:
            running.append(f"job {info.name} is running ({info.last_line[:60] or 'no output yet'})")
        if info.shutdown_state in ("pending", "armed"):
            shutdowns.append(f"job {info.name}: {info.shutdown_text} "
                             f"(`%gpu kill {info.name} --shutdown` cancels it)")
    for k in answer.get("kernels") or []:
        running.append(f"a Jupyter kernel or server (pid {k['pid']}): {k['command'][:80]}")
    try:
        status = machine.gpu_status()
    except GpumagicError:
        status = None
    if status is not None and status.ok:
        from .gpu.smi import known

        for p in status.processes:
            mem = f", {p.used_mib} MiB" if known(p.used_mib) else ""
            running.append(f"{p.name if known(p.name) else 'a process'} is using the GPU (pid {p.pid}{mem})")
    _, guard = read_status(machine)
    if guard.state == "armed":
        when = f" in {duration(guard.fires_in)}" if guard.fires_in is not None else ""
        why = guard.reason or "when its rule fires"
        shutdowns.append(f"the budget guard will shut the machine down{when} ({why}); "
                         "`%gpu budget guard --cancel` disarms it")
    return running, shutdowns


def confirm_text(caches: list[Cache]) -> str:
    """The one confirmation ``clean`` asks: every cache it would remove, with its size."""
    lines = ["remove these caches (nothing else is touched)?"]
    for c in caches:
        lines.append(f"  {format_bytes(c.bytes):>10}  {c.label}")
    return "\n".join(lines)


def wrapup(machine: MachineLike, pulls: list[tuple[str, str]] | None = None, *, pull: bool = True, clean: bool = False,
           confirm=None, ledger=None) -> WrapupReport:
    """Examine ``machine`` before it is released; pull, and optionally clean (see the module).

    Parameters
    ----------
    pulls : list of (remote, local), optional
        Results folders, as in ``%gpu sync`` (``:runs/`` ``./runs/``); default: the ones
        remembered for this machine.  Given ones are remembered.
    pull : bool
        Fetch what the local copies lack (``False``: only list it).
    clean : bool
        Remove the cleanable caches after ``confirm(text)`` returns True.
    confirm : callable, optional
        Gets :func:`confirm_text`; default: nothing is removed (pass ``lambda _: True``).
    ledger : gpumagic.budget.Ledger, optional
        Where the prices are (default: the user's).

    Returns
    -------
    WrapupReport

    Raises
    ------
    WrapupError, ConnectionLost
        Sync errors are kept per folder in the report, not raised.
    """
    from .budget import Ledger

    report = WrapupReport(machine.name)
    if pulls:
        remember(machine.name, pulls)
    for src, dst in (pulls if pulls else remembered(machine.name)):
        res = PullResult(src, dst)
        try:
            # every file under the folder, whatever ignore files say there, by size and sha256:
            # "everything is already here" is the last thing read before a machine is released
            dry = machine.pull(src, dst, dry_run=True, update=True, checksum=True, ignore_files=False)
            res.pending = list(dry.would_send)
            res.differs = list(dry.newer)
            if pull and res.pending:
                res.summary = machine.pull(src, dst, update=True, checksum=True, ignore_files=False)
        except GpumagicError as e:
            res.error = e.message + (f" ({e.hint})" if e.hint else "")
        report.pulls.append(res)
    answer = scan(machine)
    report.caches = caches_from(answer)
    disk = answer.get("disk") or {}
    report.disk_used, report.disk_size = disk.get("used"), disk.get("size")
    rec = (ledger or Ledger()).machine(machine.name)
    prices = rec.prices if rec is not None else None
    report.image = image_line(report.disk_used, prices)
    report.running, report.shutdowns = what_runs(machine, answer)
    report.kernels_checked = answer.get("kernels") is not None
    if clean:
        targets = [c for c in report.caches if c.cleanable and c.bytes > 0]
        if targets:
            if confirm is not None and confirm(confirm_text(targets)):
                after = scan(machine, clean_ids=[c.id for c in targets])
                report.cleaned = after.get("cleaned", [])
                report.caches = caches_from(after)
            else:
                report.declined = True
    return report


# -- rendering -------------------------------------------------------------------------------


def report_text(r: WrapupReport) -> str:
    """The report as plain text, in the order of the steps."""
    lines = [f"wrapup of {r.machine}:"]
    if not r.pulls:
        lines.append("results: none named; `%gpu wrapup --pull :runs/ ./runs/` checks and pulls a folder "
                     "(remembered for next time)")
    for p in r.pulls:
        head = f"results {p.src} -> {p.dst}: "
        if p.error:
            lines.append(head + f"could not check: {p.error}")
        elif not p.pending and not p.differs:
            lines.append(head + "everything is already here (every file, by size and content)")
        elif not p.pending:
            lines.append(head + f"{len(p.differs)} differ from the machine's and are newer here (kept, "
                                "not replaced):")
            lines += [f"  {name}" for name in p.differs[:20]]
        else:
            done = (f"pulled {p.summary.files_sent} files ({format_bytes(p.summary.bytes_sent)})"
                    if p.summary is not None else "not pulled (--no-pull)")
            lines.append(head + f"{len(p.pending)} not pulled yet; {done}")
            lines += [f"  {name}" for name in p.pending[:20]]
            if len(p.pending) > 20:
                lines.append(f"  ... and {len(p.pending) - 20} more")
            if p.differs:
                lines.append(f"  and {len(p.differs)} differ from the machine's and are newer here (kept): "
                             + ", ".join(p.differs[:5]) + (" ..." if len(p.differs) > 5 else ""))
    if r.cleaned is not None:
        freed = sum(c["freed"] for c in r.cleaned)
        lines.append(f"cleaned {len(r.cleaned)} cache{'' if len(r.cleaned) == 1 else 's'}, "
                     f"{format_bytes(freed)} freed:")
        for c in r.cleaned:
            errs = f" (not all: {'; '.join(c['errors'])})" if c["errors"] else ""
            lines.append(f"  {format_bytes(c['freed']):>10}  {c['label']}{errs}")
    cleanable = [c for c in r.caches if c.cleanable and c.bytes > 0]
    lines.append(f"caches an image would carry: {format_bytes(sum(c.bytes for c in cleanable))}"
                 + ("" if r.cleaned is not None or not cleanable else "; `%gpu wrapup --clean` removes them"))
    for c in r.caches:
        note = f"  ({c.note})" if c.note else ""
        lines.append(f"  {format_bytes(c.bytes):>10}  {c.label}{note}")
    if r.declined:
        lines.append("  nothing removed: the confirmation was not given (add --yes to skip it)")
    if r.disk_used is not None:
        lines.append(f"system disk /: {r.disk_used / 1e9:.1f} GB used of {(r.disk_size or 0) / 1e9:.1f} GB")
    lines.append(r.image)
    if r.running:
        lines.append("still running:")
        lines += [f"  {x}" for x in r.running]
    elif r.kernels_checked:
        lines.append("nothing of yours is running (no gpumagic job, Jupyter kernel or GPU process)")
    else:
        lines.append("no gpumagic job or GPU process is running (Jupyter kernels are not looked for on "
                     "the sandbox: it is this computer)")
    if r.shutdowns:
        lines.append("shutdown armed:")
        lines += [f"  {x}" for x in r.shutdowns]
    else:
        lines.append("no shutdown is armed")
    return "\n".join(lines)


def report_html(r: WrapupReport) -> str:
    """The report as an HTML fragment (the text, in a ``<pre>``, with the headings bold)."""
    from html import escape

    out = []
    for line in report_text(r).splitlines():
        text = escape(line)
        out.append(f"<b>{text}</b>" if not line.startswith(" ") else text)
    return "<pre>" + "\n".join(out) + "</pre>"
