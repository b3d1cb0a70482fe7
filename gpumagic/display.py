"""Text and HTML renderings of gpumagic's results (no IPython, no ipywidgets here).

Each rendering is a plain function returning ``str``; :class:`Rich` pairs a text form with an
HTML form so that Jupyter shows the HTML and a terminal (or a saved ``text/plain`` output)
shows the text.
"""

from __future__ import annotations

import html
from typing import Iterable, Sequence


class Rich:
    """An object IPython displays as HTML with a ``text/plain`` fallback.

    Parameters
    ----------
    text : str
        What a terminal shows.
    html : str
        What a notebook shows.
    """

    def __init__(self, text: str, html_: str):
        self.text = text
        self.html = html_

    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"text/plain": self.text, "text/html": self.html}

    def __repr__(self) -> str:
        return self.text


def text_table(rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns separated by two spaces; the first row is the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def format_bytes(n: int) -> str:
    """``n`` bytes as B, KiB, MiB or GiB (powers of 1024)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


# -- tunnels ------------------------------------------------------------------------------


def tunnel_rows(tunnels: Iterable[tuple[str, object]]) -> list[tuple[str, ...]]:
    """Rows of ``%gpu tunnel list`` for (machine name, :class:`gpumagic.tunnel.Tunnel`) pairs.

    Columns: ID (the local port, what ``%gpu tunnel close`` takes), MACHINE, WHAT, LOCAL URL,
    REMOTE (host:port as the machine sees it), CONNS (active/total), DOWN and UP (bytes
    from and to the remote service), STATE (with the number of faults and the last one).
    """
    rows = [("ID", "MACHINE", "WHAT", "LOCAL URL", "REMOTE", "CONNS", "DOWN", "UP", "STATE")]
    for machine, t in tunnels:
        state = t.state
        if t.faults:
            last = t.faults[-1]
            state += f"; {len(t.faults)} error(s), last: {last.message}"
        rows.append((str(t.local_port), machine, t.name, t.url, t.target,
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
    rows = tunnel_rows(tunnels)
    if len(rows) == 1:
        return f"<p>{html.escape(tunnel_table([]))}</p>"
    head = "".join(f"<th style='text-align:left'>{html.escape(c)}</th>" for c in rows[0])
    body = []
    for r in rows[1:]:
        cells = [html.escape(c) for c in r]
        cells[3] = f"<a href='{cells[3]}' target='_blank'>{cells[3]}</a>"
        body.append("<tr>" + "".join(f"<td style='text-align:left'>{c}</td>" for c in cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def tunnel_opened(t, machine: str, note: str = "", inline: bool = False,
                  height: int = 600) -> Rich:
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
    what = f"{t.name} on {machine} ({t.target})"
    text = f"{what} -> {t.url}\n  (ID {t.local_port}; `%gpu tunnel close {t.local_port}` closes it)"
    if note:
        text = note + "\n" + text
    url = html.escape(t.url, quote=True)
    parts = []
    if note:
        parts.append(f"<div>{html.escape(note)}</div>")
    parts.append(f"<div>{html.escape(what)}: <a href='{url}' target='_blank'>{url}</a> "
                 f"<small>(ID {t.local_port})</small></div>")
    if inline:
        parts.append(f"<iframe src='{url}' width='100%' height='{int(height)}' "
                     "style='border:1px solid #ccc'></iframe>")
    return Rich(text, "".join(parts))
