"""Text and HTML renderings of gpumagic's results (no IPython, no ipywidgets here).

Each view is a small object with ``_repr_html_`` for notebooks and ``__repr__`` giving the
readable ``text/plain`` fallback (terminals, nbconvert to text, logs).  The magics layer
passes them to IPython's ``display``.
"""

from __future__ import annotations

import html
import time


def duration(seconds: float) -> str:
    """``3540`` -> ``"59 min"``; ``10740`` -> ``"2 h 59 min"``; ``42`` -> ``"42 s"``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    m = s // 60 if s < 3600 else round(s / 60)
    if m < 60:
        return f"{m} min"
    d, rem = divmod(m, 24 * 60)
    h, m = divmod(rem, 60)
    parts = ([f"{d} d"] if d else []) + ([f"{h} h"] if h else []) + ([f"{m} min"] if m else [])
    return " ".join(parts)


class _View:
    """Base: ``text()`` and ``html()``; displayed as HTML with a text/plain fallback."""

    def text(self) -> str:  # pragma: no cover - overridden
        raise NotImplementedError

    def html(self) -> str:
        return f"<pre>{html.escape(self.text())}</pre>"

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        return self.html()


# -- budget -------------------------------------------------------------------------------


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


def meter_text(r) -> str:
    """The meter (a :class:`gpumagic.budget.MeterReading`) as plain text."""
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
        lines.append(f"  limit {p.money(r.limit)}: {_bar_text(frac)} {frac:.0%}; {when}")
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
    text = esc("\n".join(meter_text(r).splitlines()[1:]))
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
                f'<b>gpumagic budget alert</b>: {html.escape(self.message)}</div>')


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


class EstimateView(_View):
    """``%gpu budget estimate``: a small table."""

    def __init__(self, rows, currency: str = ""):
        self.rows = rows
        self.currency = currency

    def _cells(self):
        from .budget import money

        return [("OPTION", "COST", "NOTE")] + [
            (r.label, "" if r.cost is None else money(r.cost, self.currency), r.note) for r in self.rows]

    def text(self) -> str:
        return _table(self._cells())

    def html(self) -> str:
        cells = self._cells()
        head = "".join(f"<th>{html.escape(c)}</th>" for c in cells[0])
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in cells[1:])
        return f"<table><tr>{head}</tr>{body}</table>"


class HistoryView(_View):
    """``%gpu budget history``: spending per machine and day, with bars as a small plot."""

    def __init__(self, rows):
        self.rows = rows  # (machine, day, cost, currency)

    def text(self) -> str:
        from .budget import money

        if not self.rows:
            return "no spending recorded yet (the ledger fills as `%gpu budget` reads machines)"
        top = max(r[2] for r in self.rows) or 1
        cells = [("MACHINE", "DAY", "SPENT", "")]
        cells += [(m, d, money(c, cur), "#" * max(1, int(round(20 * c / top)))) for m, d, c, cur in self.rows]
        totals: dict[tuple[str, str], float] = {}
        for m, _, c, cur in self.rows:
            totals[(m, cur)] = totals.get((m, cur), 0) + c
        cells += [(m, "total", money(c, cur), "") for (m, cur), c in sorted(totals.items())]
        return _table(cells)

    def html(self) -> str:
        from .budget import money

        if not self.rows:
            return f"<p>{html.escape(self.text())}</p>"
        top = max(r[2] for r in self.rows) or 1
        body = "".join(
            f"<tr><td>{html.escape(m)}</td><td>{d}</td><td>{html.escape(money(c, cur))}</td>"
            f'<td><div style="width:{160 * c / top:.0f}px;height:10px;background:#1565c0"></div></td></tr>'
            for m, d, c, cur in self.rows)
        return f"<table><tr><th>machine</th><th>day</th><th>spent</th><th></th></tr>{body}</table>"


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
