"""Text and HTML renderings (no IPython, no ipywidgets): the magics display these.

Each rendering is a :class:`Rendered` with a readable ``text/plain`` form (its ``repr``)
and an HTML form for notebooks.
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Rendered:
    """Something to display: ``text`` for terminals and logs, ``html`` for notebooks."""

    text: str
    html: str = ""

    def __repr__(self) -> str:
        return self.text

    def __str__(self) -> str:
        return self.text

    def _repr_html_(self) -> str | None:
        return self.html or None


def text_table(rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns separated by two spaces; the first row is the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


# -- jobs -----------------------------------------------------------------------------------

_STATE_COLOURS = {"running": "#1a7f37", "exited": "#57606a", "killed": "#cf222e", "lost": "#9a6700"}


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _local_time(epoch: float | None) -> str:
    return "-" if epoch is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def job_rows(jobs) -> list[list[str]]:
    """Header + one row per :class:`gpumagic.jobs.JobInfo`: name, state, started, run time,
    last log line."""
    from .jobs import format_duration

    rows = [["NAME", "STATE", "STARTED", "RUN TIME", "LAST LINE"]]
    for j in jobs:
        state = j.state_text
        if j.shutdown_text:
            state += f"; {j.shutdown_text}"
        rows.append([j.name, state, _local_time(j.started), format_duration(j.run_seconds),
                     _clip(j.last_line, 60)])
    return rows


def jobs_table(jobs, machine_name: str) -> Rendered:
    """The ``%gpu jobs`` table (or a sentence when there is no job)."""
    if not jobs:
        text = (f"no jobs on {machine_name}; start one with `%%remote --job NAME` "
                "(jobs live in ~/.gpumagic/jobs on the machine)")
        return Rendered(text, f"<p>{html.escape(text)}</p>")
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
    """A visible alert for a log line (:class:`gpumagic.jobs.Alert`)."""
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


def job_ended(info) -> str:
    """One line for the end of a followed job: state and run time."""
    from .jobs import format_duration

    line = f"job {info.name} {info.state_text} after {format_duration(info.run_seconds)}"
    if info.state == "lost":
        line = (f"job {info.name} is lost: its runner is gone without an exit code "
                "(the machine rebooted, or something killed it with SIGKILL)")
    elif info.state == "running":
        line = f"job {info.name} is still running ({format_duration(info.run_seconds)} so far)"
    if info.shutdown_text:
        line += f"; {info.shutdown_text}"
    return line
