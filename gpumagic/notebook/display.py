"""Text and HTML renderings (no ipywidgets, no IPython).

Each view is a :class:`Rendered` (text/plain and text/html), which IPython displays through
``_repr_mimebundle_``; a front end without HTML shows the text, never a repr or JSON.
"""

from __future__ import annotations

import html
import re
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

from .._format import duration, format_bytes
from ..gpu.doctor import DoctorReport, Level
from ..gpu.smi import Gpu, GpuStatus, known


@dataclass(frozen=True)
class Rendered:
    """A view with a text/plain form and, optionally, a text/html form."""

    text: str
    html: str = ""

    def _repr_mimebundle_(self, include=None, exclude=None):
        data = {"text/plain": self.text}
        if self.html:
            data["text/html"] = self.html
        return data

    def __str__(self) -> str:
        return self.text

    __repr__ = __str__


def escape(x) -> str:
    """``str(x)`` made safe for HTML."""
    return html.escape(str(x))


_BACKTICKS = re.compile(r"`([^`\n]+)`")


def prose(x) -> str:
    """``str(x)`` as HTML text: escaped, each ```code``` span in ``<code>`` (as Markdown
    shows it), each line break a ``<br>`` (HTML joins lines into one)."""
    text = _BACKTICKS.sub(r"<code>\1</code>", html.escape(str(x)))
    return text.replace("\n", "<br>")


#: Table cells start at the left: JupyterLab's stylesheet right-aligns them, which puts each
#: value far from its label.
#: Said wherever a shutdown is armed on the sandbox, which is this computer.
SANDBOX_SHUTDOWN_NOTE = ("sandbox: its shutdown is a stand-in that only records the call (in the sandbox's "
                         "folder, shutdown-calls); this computer is not shut down")

TD = "<td style='text-align:left'>"
TH = "<th style='text-align:left'>"


# -- GPU status (%gpu status) ----------------------------------------------------------------

def reading(v, fmt="{}", unit="") -> str:
    """A reading, or ``n/a`` when unknown."""
    return (fmt.format(v) + unit) if known(v) else "n/a"


def watts(v) -> str:
    # nvidia-smi's own table truncates watts (691.68 W is shown as 691W).
    return str(int(v)) if known(v) else "n/a"


def gpu_line(gpu: Gpu) -> str:
    """``GPU0 NVIDIA H200 | util 100% | mem 20213/143771 MiB | 58C | 691/700 W``."""
    name = gpu.name if known(gpu.name) else "(name unknown)"
    mem = f"{reading(gpu.memory_used_mib)}/{reading(gpu.memory_total_mib)} MiB"
    return (f"{gpu.label} {name} | util {reading(gpu.utilization_gpu_pct, unit='%')} | mem {mem} | "
            f"{reading(gpu.temperature_c, unit='C')} | {watts(gpu.power_draw_w)}/{watts(gpu.power_limit_w)} W")


def process_lines(status: GpuStatus, gpu: Gpu) -> list[str]:
    """The processes on ``gpu``, or why none are listed."""
    procs = status.processes_on(gpu)
    out = [f"  {p.name} (pid {p.pid}) {reading(p.used_mib)} MiB" for p in procs]
    hidden = status.hidden_use_mib(gpu)
    if hidden:
        out.append(f"  {hidden} MiB in use by processes not visible here "
                   "(other containers on this GPU, or outside your namespace)")
    if not out:
        out.append("  no processes")
    return out


def status_header(status: GpuStatus) -> str:
    """``host: driver 580.159.04, CUDA 13.0 (driver maximum)``, or the failure kind and message."""
    who = status.host or "machine"
    if not status.ok:
        return f"{who}: {status.kind.value}: {status.message}"
    return f"{who}: driver {status.driver_version}, CUDA {status.cuda_version} (driver maximum)"


def status_text(status: GpuStatus) -> str:
    """Plain-text status: a header, one line per GPU, its processes."""
    lines = [status_header(status)]
    if not status.ok:
        if status.hint:
            lines.append(f"  hint: {status.hint}")
        return "\n".join(lines)
    lines += [f"  warning: {w}" for w in status.warnings]
    for g in status.gpus:
        lines.append(gpu_line(g))
        lines += process_lines(status, g)
    for bad in status.skipped:
        lines.append(f"  (unreadable line from nvidia-smi: {bad})")
    return "\n".join(lines)


def _bar(pct: float, color: str) -> str:
    pct = max(0.0, min(100.0, pct))
    return (f'<div style="display:inline-block;width:160px;height:10px;background:#e5e5e5;'
            f'vertical-align:middle"><div style="width:{pct:.0f}%;height:100%;background:{color}">'
            "</div></div>")


def status_html(status: GpuStatus) -> str:
    """HTML status: per GPU, memory and utilisation bars, temperature, power, processes."""
    if not status.ok:
        return (f"<div><b>{escape(status_header(status))}</b><br>"
                f"<span>hint: {prose(status.hint)}</span></div>")
    rows = []
    for g in status.gpus:
        mem_pct = (100.0 * g.memory_used_mib / g.memory_total_mib
                   if known(g.memory_used_mib) and known(g.memory_total_mib) and g.memory_total_mib else 0.0)
        util = g.utilization_gpu_pct if known(g.utilization_gpu_pct) else 0
        procs = "<br>".join(escape(x.strip()) for x in process_lines(status, g))
        rows.append(
            f"<tr>{TD}<b>{escape(g.label)}</b> {escape(g.name)}</td>"
            f"{TD}{_bar(mem_pct, '#4a90d9')} {escape(reading(g.memory_used_mib))}/"
            f"{escape(reading(g.memory_total_mib))} MiB</td>"
            f"{TD}{_bar(util, '#5cb85c')} {escape(reading(g.utilization_gpu_pct, unit='%'))}</td>"
            f"{TD}{escape(reading(g.temperature_c, unit=' C'))}</td>"
            f"{TD}{escape(watts(g.power_draw_w))}/{escape(watts(g.power_limit_w))} W</td>"
            f"{TD}{procs}</td></tr>")
    warnings = "".join(f"<br><span style=\"color:#b26a00\">warning: {prose(w)}</span>"
                       for w in status.warnings)
    head = "".join(f"{TH}{c}</th>" for c in ("GPU", "memory", "utilisation", "temp", "power", "processes"))
    return (f"<div><b>{escape(status_header(status))}</b>{warnings}<table>"
            f"<tr>{head}</tr>" + "".join(rows) + "</table></div>")


def render_status(status: GpuStatus, note: str = "") -> Rendered:
    """The status as text/plain and text/html (static: it renders from a saved notebook with
    no kernel and no widget state); ``note`` is a line under it (why a --watch stopped)."""
    if not note:
        return Rendered(status_text(status), status_html(status))
    return Rendered(f"{status_text(status)}\n{note}",
                    f"{status_html(status)}<div><i>{escape(note)}</i></div>")


# -- doctor (%gpu doctor) ----------------------------------------------------------------------

_LEVEL_TEXT = {Level.OK: "ok", Level.WARN: "WARN", Level.FAIL: "FAIL"}
_LEVEL_COLOR = {Level.OK: "#2e7d32", Level.WARN: "#b26a00", Level.FAIL: "#c62828"}


def doctor_summary(report: DoctorReport) -> str:
    """``host doctor: 1 fail, 2 warn, 7 ok``."""
    counts = {lv: sum(c.level is lv for c in report.checks) for lv in Level}
    return (f"{report.host or 'machine'} doctor: {counts[Level.FAIL]} fail, "
            f"{counts[Level.WARN]} warn, {counts[Level.OK]} ok")


def doctor_text(report: DoctorReport) -> str:
    """The checks as a text table; each warning or failure followed by its fix."""
    width = max((len(c.name) for c in report.checks), default=4)
    lines = [doctor_summary(report)]
    for c in report.checks:
        lines.append(f"  {_LEVEL_TEXT[c.level]:<4}  {c.name:<{width}}  {c.summary}")
        if c.fix and c.level is not Level.OK:
            lines.append(f"  {'':<4}  {'':<{width}}  fix: {c.fix}")
    return "\n".join(lines)


def doctor_html(report: DoctorReport) -> str:
    """The checks as an HTML table, the level coloured."""
    rows = "".join(
        f"<tr><td style='text-align:left;color:{_LEVEL_COLOR[c.level]};font-weight:bold'>"
        f"{_LEVEL_TEXT[c.level]}</td>{TD}{escape(c.name)}</td>{TD}{prose(c.summary)}"
        + (f"<br><i>fix: {prose(c.fix)}</i>" if c.fix and c.level is not Level.OK else "")
        + "</td></tr>" for c in report.checks)
    return f"<div><b>{escape(doctor_summary(report))}</b><table>{rows}</table></div>"


def render_doctor(report: DoctorReport) -> Rendered:
    """The doctor's table as text/plain and text/html."""
    return Rendered(doctor_text(report), doctor_html(report))
# -- sync ------------------------------------------------------------------------------


#: Seconds of a transfer before a rate and an ETA are shown: over the first fraction of a
#: second (channel set-up, a few header bytes) they are noise, like "87.8 B/s, ETA 31h".
RATE_AFTER_S = 1.0


def sync_progress_text(p) -> str:
    """One line for a :class:`gpumagic.sync.SyncProgress`: files, bytes, rate and ETA.

    Rate is bytes per second of wall time since the transfer started; ETA assumes it holds.
    Both appear only after :data:`RATE_AFTER_S` seconds with bytes moved (and at the end).
    While the totals still grow (``counting``: the walk goes on), they end in ``+`` and no
    ETA is shown.
    """
    if getattr(p, "listing", ""):  # the machine's walk of a large tree, before any totals
        return listing_text(p)
    elapsed = max(p.elapsed, 1e-6)
    rate = p.bytes_done / elapsed
    more = "+" if getattr(p, "counting", False) and not p.finished else ""  # totals still grow
    text = (f"{p.files_done}/{p.files_total}{more} files  "
            f"{format_bytes(p.bytes_done)}/{format_bytes(p.bytes_total)}{more}")
    if p.finished:
        return text + f"  {format_bytes(rate)}/s  done in {duration(elapsed)}"
    if elapsed < RATE_AFTER_S or rate <= 0:
        return text
    text += f"  {format_bytes(rate)}/s"
    if p.bytes_total > p.bytes_done and not more:
        text += f"  ETA {duration((p.bytes_total - p.bytes_done) / rate)}"
    return text


def listing_text(p) -> str:
    """A long listing as one line: ``listing testgpu:/: 48,213 entries so far (12 s)``, and
    once it is whole, ``listed 48,213 entries of testgpu:/ in 21 s``."""
    if p.finished:
        return f"listed {p.listed:,} entries of {p.listing} in {duration(p.elapsed)}"
    return f"listing {p.listing}: {p.listed:,} entries so far ({duration(p.elapsed)})"


def sync_bar_text(p, failed: bool = False) -> str:
    """The sync bar as one line of text: ``sync: 4/4 files ...``; a sync with nothing to
    transfer says so instead of showing an empty bar."""
    if p is None:
        return "sync: failed before anything was sent" if failed else "sync: starting"
    if p.finished and not p.files_total and not p.bytes_total and not getattr(p, "listing", ""):
        return "sync: nothing to transfer (everything is up to date)"
    return f"sync{' FAILED' if failed else ''}: {sync_progress_text(p)}"


def sync_bar_html(p, failed: bool = False) -> str:
    """The sync bar as static HTML (a bar coloured by outcome and its line), for a saved
    notebook: no widget model is needed to show it."""
    text = sync_bar_text(p, failed)
    if p is None or getattr(p, "listing", "") or (p.finished and not p.files_total and not p.bytes_total):
        return f"<div>{escape(text)}</div>"
    frac = (p.bytes_done / p.bytes_total) if p.bytes_total else (1.0 if p.finished else 0.0)
    colour = "#c62828" if failed else "#2e7d32" if p.finished else "#4a90d9"
    return f"<div>{_bar(100 * frac, colour)} {escape(text)}</div>"


def render_sync_bar(p, failed: bool = False) -> Rendered:
    """A sync bar's state (a :class:`gpumagic.sync.SyncProgress`, or None before the first
    report) as text/plain and text/html."""
    return Rendered(sync_bar_text(p, failed), sync_bar_html(p, failed))


# -- jobs (%%remote --job, %gpu jobs/logs/attach/kill) --------------------------------------


def text_table(rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns separated by two spaces; the first row is the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


_STATE_COLOURS = {"running": "#1a7f37", "exited": "#57606a", "killed": "#cf222e", "lost": "#9a6700"}


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _local_time(epoch: float | None) -> str:
    return "-" if epoch is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def first_alert(shown_before: dict[tuple[str, str], set[float | None]], job_name: str,
                started: float | None, kind: str) -> bool:
    """True the first time the alert ``kind`` of the job ``job_name`` started at ``started``
    (epoch seconds; a job started again under the same name is a new job) is offered in this
    notebook, then False: an alert box is shown once, with its job, not under every later
    ``%gpu jobs``.  A start time not known on one of the two occasions (a job that ended before
    its start was read) is the same job, not a new one.

    ``shown_before`` is the notebook's memory of the alerts shown (its
    ``GpuMagics.state.alerts_shown``): (job name, alert kind) -> the start times of the jobs
    of that name it was shown for (None: not known when shown); this call adds to it."""
    shown = shown_before.setdefault((job_name, kind), set())
    if shown and (started is None or None in shown or started in shown):
        return False
    shown.add(started)
    return True


def _alert_labels(j) -> list[str]:
    if not getattr(j, "alerts_enabled", True):
        return []
    return list(dict.fromkeys(a.label for a in j.alerts))


def job_rows(jobs) -> list[list[str]]:
    """Header + one row per :class:`gpumagic.remote.jobs.JobInfo`: name, state (with its
    pending shutdown and the alerts its log raised), started, run time, last log line."""
    rows = [["NAME", "STATE", "STARTED", "RUN TIME", "LAST LINE"]]
    for j in jobs:
        state = j.state_text
        if j.shutdown_text:
            state += f"; {j.shutdown_text}"
        for label in _alert_labels(j):
            state += f"; alert: {label}"
        rows.append([j.name, state, _local_time(j.started), duration(j.run_seconds),
                     _clip(j.last_line, 60)])
    return rows


def jobs_table(jobs, machine_name: str) -> Rendered:
    """The ``%gpu jobs`` table (or a sentence when there is no job)."""
    if not jobs:
        text = (f"no jobs on {machine_name}; start one with `%%remote --job NAME` "
                "(jobs live in ~/.gpumagic/jobs on the machine)")
        return Rendered(text, f"<p>{prose(text)}</p>")
    rows = job_rows(jobs)
    cell = "<td style='text-align:left{}'>{}</td>"
    head = "".join(f"<th style='text-align:left'>{html.escape(c)}</th>" for c in rows[0])
    body = "".join(
        "<tr>" + "".join(cell.format(f";color:{_STATE_COLOURS.get(j.state, 'inherit')}" if i == 1 else "",
                                     html.escape(c)) for i, c in enumerate(r)) + "</tr>"
        for j, r in zip(jobs, rows[1:]))
    return Rendered(f"jobs on {machine_name}:\n" + text_table(rows),
                    f"<p>jobs on <b>{html.escape(machine_name)}</b></p>"
                    f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def job_alert(job_name: str, alert, stopped: bool = False) -> Rendered:
    """A visible alert for a log line (:class:`gpumagic.remote.jobs.Alert`)."""
    action = " -- --stop-on stops the job" if stopped else ""
    text = f"!! ALERT job {job_name}: {alert.label} in the log{action}\n   {alert.line}"
    return Rendered(text, (
        "<div style='border-left:4px solid #cf222e;background:#ffebe9;padding:4px 8px;margin:4px 0'>"
        f"<b>&#9888; job {html.escape(job_name)}: {html.escape(alert.label)} in the log{html.escape(action)}</b>"
        f"<br><code>{html.escape(alert.line)}</code></div>"))


def job_started(job, machine_name: str) -> str:
    """One line: the job started, how to watch it."""
    how = f"tmux session gpumagic-{job.name}" if job.runner == "tmux" else "setsid nohup"
    kept = f"; the earlier finished job of that name is kept as {job.archived}" if job.archived else ""
    return (f"started job {job.name} on {machine_name} ({how}){kept}; "
            f"`%gpu logs {job.name} --follow` to watch, `%gpu jobs` to list")


def keep_started(keeper) -> str:
    """One line: what ``--keep`` keeps, where, how often."""
    o = keeper.options
    last = f", the newest {o.last}" if o.last else ""
    return (f"keeping {o.path} of job {keeper.job} in {keeper.to}{last}: a look every {duration(o.every)}, "
            f"while this notebook runs (`%gpu jobs` says what was kept)")


def keep_line(rec: dict, live: bool) -> str:
    """One line of ``%gpu jobs`` for a job's keep record (:mod:`gpumagic.remote.keep`):
    the last checkpoint kept and when (laptop time), how many, where; whether it is kept now."""
    job, path = rec.get("job", "?"), rec.get("path", "")
    last = rec.get("last_kept") or None
    where = rec.get("local", "")
    held = sum(1 for f in (rec.get("files") or {}).values() if not f.get("pruned"))
    if last:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last.get("at") or 0))
        what = (f"job {job}: last checkpoint {path.rstrip('/')}/{last.get('path')} kept at {at} "
                f"({held} file{'s' if held != 1 else ''} in {where})")
    else:
        what = f"job {job}: nothing of {path} kept yet (into {where})"
    if live:
        state = f"keeping, a look every {duration(rec.get('every') or 0)}"
    elif rec.get("state") == "keeping":
        state = "not kept now: the notebook that kept it stopped"
    else:
        state = f"not kept now: {rec.get('state')}"
    err = f"; last look failed: {rec['error']}" if rec.get("error") and live else ""
    return f"{what}; {state}{err}"


def job_ended(info) -> str:
    """One line for the end of a followed job: state and run time."""
    line = f"job {info.name} {info.state_text} after {duration(info.run_seconds)}"
    if info.state == "lost":
        line = (f"job {info.name} is lost: its runner is gone without an exit code "
                "(the machine rebooted, or something killed it with SIGKILL)")
    elif info.state == "running":
        line = f"job {info.name} is still running ({duration(info.run_seconds)} so far)"
    if info.shutdown_text:
        line += f"; {info.shutdown_text}"
    return line


# -- budget (%gpu budget) -------------------------------------------------------------------


class _View:
    """Base: ``text()`` and ``html()``; displayed as HTML with a text/plain fallback."""

    def text(self) -> str:  # pragma: no cover - overridden
        raise NotImplementedError

    def html(self) -> str:
        return f"<pre>{prose(self.text()).replace('<br>', chr(10))}</pre>"

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        return self.html()


def _bar_text(fraction: float, width: int = 30) -> str:
    f = min(max(fraction, 0.0), 1.0)
    full = int(round(f * width))
    return "[" + "#" * full + "-" * (width - full) + "]"


def guard_text(g, *, local_now: float | None = None) -> str:
    """One line on the remote guard (a :class:`gpumagic.budget.GuardStatus`)."""
    if g is None or g.state == "none":
        return "guard: not armed (`%gpu budget guard --idle 30m` shuts the machine down when idle)"
    if g.state == "armed":
        parts = []
        if g.settings.get("idle_s"):
            parts.append(f"idle {duration(g.settings['idle_s'])}")
        if g.settings.get("limit_in"):
            parts.append("at the limit")
        if g.settings.get("deadline_in"):
            parts.append("at the deadline")
        line = f"guard: armed ({', '.join(parts) or '-'})"
        if g.fires_in is not None:
            line += f"; would shut down in {duration(g.fires_in)} ({g.reason})"
        elif g.idle:
            line += f"; GPU now {g.idle}"
        if g.warning:
            line += f"\nWARNING from the guard: {g.warning}"
        return line
    if g.state == "gone":
        return "guard: not running any more (the machine restarted?); arm it again"
    at = ""
    if g.checked:
        ago = max(0.0, g.remote_now - g.checked)
        at = f" {duration(ago)} ago" if ago >= 60 else " just now"
    if g.state in ("fired", "firing"):
        return f"guard: shut the machine down{at} ({g.reason})"
    if g.state == "failed":
        return f"guard: FAILED to shut the machine down{at} ({g.reason}): stop it from the platform"
    if g.state == "cancelled":
        return "guard: not armed (cancelled)"
    return f"guard: {g.state}"


def meter_text(r, ascii_bar: bool = True) -> str:
    """The meter (a :class:`gpumagic.budget.MeterReading`) as plain text; ``ascii_bar=False``
    leaves the ``[###---]`` bar out of the limit line (the HTML meter draws its own)."""
    p = r.prices
    lines = [f"{r.machine}: spent {p.money(r.spent)} in {duration(r.elapsed_s)} "
             f"(since {time.strftime('%Y-%m-%d %H:%M', time.localtime(r.started_at))}, "
             f"billed per {p.billing})"]
    parts = ", ".join(f"{k} {p.money(v)}" for k, v in r.breakdown.items() if v)
    lines.append(f"  rate: {p.money(r.per_hour)}/h ({parts or 'nothing billed'})")
    if r.next_boundary_s is not None:
        lines.append(f"  stopping now costs the same as stopping in {duration(r.next_boundary_s)} "
                     f"(the next {p.billing} starts then)")
    if r.limit is not None:
        frac = r.spent / r.limit if r.limit else 1.0
        when = ("LIMIT REACHED" if r.limit_in_s == 0
                else f"stop within {duration(r.limit_in_s)} to stay within it" if r.limit_in_s is not None
                else "never reached")
        bar = f"{_bar_text(frac)} " if ascii_bar else ""
        lines.append(f"  limit {p.money(r.limit)}: {bar}{frac:.0%}; {when}")
    lines.append(f"  the rest of today (to midnight) costs {p.money(r.rest_of_today)} more if it stays on")
    if r.alerts:
        lines.append("  alerts at " + ", ".join(p.money(a) for a in r.alerts))
    lines.append("  " + guard_text(r.guard))
    return "\n".join(lines)


def meter_html(r) -> str:
    p = r.prices
    esc = html.escape
    rows = [f"<b>{esc(r.machine)}</b>: spent <b>{esc(p.money(r.spent))}</b> in "
            f"{esc(duration(r.elapsed_s))} at {esc(p.money(r.per_hour))}/h"]
    if r.limit is not None:
        frac = min(r.spent / r.limit if r.limit else 1.0, 1.0)
        colour = "#c62828" if frac >= 1 else "#f9a825" if frac >= 0.8 else "#2e7d32"
        rows.append(f'<div style="width:320px;border:1px solid #999;height:12px">'
                    f'<div style="width:{frac * 100:.1f}%;height:100%;background:{colour}"></div></div>')
    body = "<br>".join(rows)
    text = prose("\n".join(meter_text(r, ascii_bar=False).splitlines()[1:])).replace("<br>", "\n")
    return f'<div class="gpumagic-budget">{body}<pre style="margin:4px 0">{text}</pre></div>'


class MeterView(_View):
    """``%gpu budget``: the meter, HTML with a text fallback."""

    def __init__(self, reading):
        self.reading = reading

    def text(self) -> str:
        return meter_text(self.reading)

    def html(self) -> str:
        return meter_html(self.reading)


class AlertView(_View):
    """A visible budget alert (a crossed threshold, or the guard's warning)."""

    def __init__(self, message: str):
        self.message = message

    def text(self) -> str:
        return f"!! gpumagic budget alert: {self.message}"

    def html(self) -> str:
        return ('<div style="border-left:6px solid #c62828;background:#ffebee;padding:6px 10px">'
                f'<b>gpumagic budget alert</b>: {prose(self.message)}</div>')


class EstimateView(_View):
    """``%gpu budget estimate``: a small table."""

    def __init__(self, rows, currency: str = ""):
        self.rows = rows
        self.currency = currency

    def _cells(self):
        from ..budget.prices import money

        return [("OPTION", "COST", "NOTE")] + [
            (r.label, "" if r.cost is None else money(r.cost, self.currency), r.note) for r in self.rows]

    def text(self) -> str:
        return text_table(self._cells())

    def html(self) -> str:
        cells = self._cells()
        head = "".join(f"{TH}{html.escape(c)}</th>" for c in cells[0])
        body = "".join("<tr>" + "".join(f"{TD}{prose(c)}</td>" for c in r) + "</tr>" for r in cells[1:])
        return f"<table><tr>{head}</tr>{body}</table>"


class HistoryView(_View):
    """``%gpu budget history``: spending per machine and day, with bars as a small plot."""

    def __init__(self, rows):
        self.rows = rows  # (machine, day, cost, currency)

    def text(self) -> str:
        from ..budget.prices import money

        if not self.rows:
            return "no spending recorded yet (the ledger fills as `%gpu budget` reads machines)"
        top = max(r[2] for r in self.rows) or 1
        cells = [("MACHINE", "DAY", "SPENT", "")]
        cells += [(m, d, money(c, cur), "#" * max(1, int(round(20 * c / top)))) for m, d, c, cur in self.rows]
        totals: dict[tuple[str, str], float] = {}
        for m, _, c, cur in self.rows:
            totals[(m, cur)] = totals.get((m, cur), 0) + c
        cells += [(m, "total", money(c, cur), "") for (m, cur), c in sorted(totals.items())]
        return text_table(cells)

    def html(self) -> str:
        from ..budget.prices import money

        if not self.rows:
            return f"<p>{prose(self.text())}</p>"
        top = max(r[2] for r in self.rows) or 1
        body = "".join(
            f"<tr>{TD}{html.escape(m)}</td>{TD}{d}</td>{TD}{html.escape(money(c, cur))}</td>"
            f'{TD}<div style="width:{160 * c / top:.0f}px;height:10px;background:#1565c0"></div></td></tr>'
            for m, d, c, cur in self.rows)
        head = "".join(f"{TH}{c}</th>" for c in ("machine", "day", "spent", ""))
        return f"<table><tr>{head}</tr>{body}</table>"


class GuardView(_View):
    """``%gpu budget guard``: the guard's status."""

    def __init__(self, status, note: str = ""):
        self.status = status
        self.note = note

    def text(self) -> str:
        out = guard_text(self.status)
        if self.status.state in ("fired", "failed", "firing", "gone") and self.status.log:
            out += "\n  its log on the machine ends with:\n" + "\n".join(f"    {ln}" for ln in self.status.log)
        return out + (f"\n{self.note}" if self.note else "")

    def html(self) -> str:
        """As text, but a guard that acted (or failed to) is shown as an alert, with the
        warning it gave first, which it logged as ``WARNING: ...``."""
        pre = super().html()
        if self.status.state not in ("fired", "failed", "firing"):
            return pre
        warned = [ln.split("WARNING: ", 1)[1] for ln in self.status.log if "WARNING: " in ln]
        head = guard_text(self.status)
        return ('<div style="border-left:6px solid #c62828;background:#ffebee;padding:6px 10px">'
                f"<b>{prose(head)}</b>"
                + "".join(f"<br>the guard warned first: {prose(w)}" for w in warned[-1:])
                + f"</div>{pre}")


# -- tunnels ------------------------------------------------------------------------------


def tunnel_rows(tunnels: Iterable[tuple[str, object]]) -> list[tuple[str, ...]]:
    """Rows of ``%gpu tunnel list`` for (machine name, tunnel) pairs, local
    (:class:`gpumagic.tunnel.Tunnel`) and reverse (:class:`gpumagic.tunnel.ReverseTunnel`).

    Columns: ID (what ``%gpu tunnel close`` takes: the local port, or ``R`` and the machine's
    port), MACHINE, WHAT, LOCAL (the URL here; for a reverse tunnel the local ``host:port`` its
    connections reach), REMOTE (host:port as the machine sees it; for a reverse tunnel where
    the machine listens), CONNS (active/total), DOWN and UP (bytes towards this computer and
    towards the machine), STATE (with the number of faults and the last one).
    """
    from ..tunnel import ReverseTunnel

    rows = [("ID", "MACHINE", "WHAT", "LOCAL", "REMOTE", "CONNS", "DOWN", "UP", "STATE")]
    for machine, t in tunnels:
        state = t.state
        if t.faults:
            last = t.faults[-1]
            state += f"; {len(t.faults)} error(s), last: {last.message}"
        if isinstance(t, ReverseTunnel):
            local, remote, what = t.target, f"listens on {t.listen}", f"reverse: {t.name}"
        else:
            local, remote, what = t.url, t.target, t.name
        rows.append((t.id, machine, what, local, remote,
                     f"{t.active_connections}/{t.connections_total}",
                     format_bytes(t.bytes_down), format_bytes(t.bytes_up), state))
    return rows


def tunnel_table(tunnels: Iterable[tuple[str, object]]) -> str:
    """Text table of tunnels (see :func:`tunnel_rows`), or a line saying there are none."""
    rows = tunnel_rows(tunnels)
    if len(rows) == 1:
        return "no tunnels open; `%gpu tunnel PORT` or `%gpu tunnel tensorboard` opens one"
    return text_table(rows)


def tunnel_table_html(tunnels: Iterable[tuple[str, object]]) -> str:
    """HTML table of tunnels with clickable local URLs."""
    from .links import browser_url

    rows = tunnel_rows(tunnels)
    if len(rows) == 1:
        return f"<p>{prose(tunnel_table([]))}</p>"
    head = "".join(f"<th style='text-align:left'>{html.escape(c)}</th>" for c in rows[0])
    body = []
    for r in rows[1:]:
        cells = [html.escape(c) for c in r]
        if r[3].startswith("http"):  # a reverse tunnel's local end is no web page
            link = html.escape(browser_url(r[3]), quote=True)
            cells[3] = f"<a href='{link}' target='_blank'>{link}</a>"
        body.append("<tr>" + "".join(f"<td style='text-align:left'>{c}</td>" for c in cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def reverse_tunnel_opened(t, machine: str, note: str = "") -> Rendered:
    """The message after a reverse tunnel ``t`` (a :class:`gpumagic.tunnel.ReverseTunnel`)
    opened on ``machine``: where the machine listens, where that reaches here, and how to
    close it; ``note`` is one more line above (e.g. "port 7890 on the machine is taken ...;
    using 41234 instead")."""
    return _opened(t.id, note, f"{t.name} on {machine}: the machine's {t.listen} -> this computer's {t.target}",
                   f"{html.escape(t.name)} on {html.escape(machine)}: the machine's "
                   f"<code>{html.escape(t.listen)}</code> -&gt; this computer's "
                   f"<code>{html.escape(t.target)}</code>")


def tunnel_opened(t, machine: str, note: str = "", inline: bool = False,
                  height: int = 600) -> Rendered:
    """The message after a tunnel opened: a clickable link (and the page inline if asked).

    Parameters
    ----------
    t : gpumagic.tunnel.Tunnel
    machine : str
        The machine's name.
    note : str
        One more line (e.g. "local port 6006 was taken by another program").
    inline : bool
        Also show the page in an iframe (height in pixels).
    """
    from .links import browser_url

    what = f"{t.name} on {machine} ({t.target})"
    link = browser_url(t.url)
    via = "" if link == t.url else f" (through the notebook server's proxy; {t.url} on the server)"
    url = html.escape(link, quote=True)
    frame = (f"<iframe src='{url}' width='100%' height='{int(height)}' "
             "style='border:1px solid #ccc'></iframe>") if inline else ""
    return _opened(t.local_port, note, f"{what} -> {link}{via}",
                   f"{html.escape(what)}: <a href='{url}' target='_blank'>{url}</a>", frame)


def _opened(tunnel_id: object, note: str, text: str, html_text: str, more_html: str = "") -> Rendered:
    """The message after a tunnel opened: ``note`` (if any) above ``text``, then the tunnel's
    ID and the command that closes it; as HTML, ``html_text`` (escaped already) in their
    place, then ``more_html``."""
    tid = html.escape(str(tunnel_id))
    text += f"\n  (ID {tunnel_id}; `%gpu tunnel close {tunnel_id}` closes it)"
    parts = [f"<div>{prose(note)}</div>"] if note else []
    parts.append(f"<div>{html_text} <small>(ID {tid}; <code>%gpu tunnel close {tid}</code> "
                 "closes it)</small></div>")
    return Rendered(f"{note}\n{text}" if note else text, "".join(parts) + more_html)
