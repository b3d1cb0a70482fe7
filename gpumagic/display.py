"""Plain-text renderings shared by the magics and the widgets (no ipywidgets here)."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units, as ``ls -h`` and ``du -h`` print)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_seconds(s: float) -> str:
    """``75`` -> ``"1m15s"``; below a minute ``"4.2 s"``."""
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(int(round(s)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


# -- sync ------------------------------------------------------------------------------


def sync_progress_text(p) -> str:
    """One line for a :class:`gpumagic.sync.SyncProgress`: files, bytes, rate and ETA.

    Rate is bytes per second of wall time since the transfer started; ETA assumes it holds.
    """
    elapsed = max(p.elapsed, 1e-6)
    rate = p.bytes_done / elapsed
    text = (f"{p.files_done}/{p.files_total} files  "
            f"{format_bytes(p.bytes_done)}/{format_bytes(p.bytes_total)}  "
            f"{format_bytes(rate)}/s")
    if p.finished:
        return text + f"  done in {format_seconds(elapsed)}"
    if rate > 0 and p.bytes_total > p.bytes_done:
        text += f"  ETA {format_seconds((p.bytes_total - p.bytes_done) / rate)}"
    return text


def _paths(label: str, paths: list[str], limit: int = 20) -> list[str]:
    if not paths:
        return []
    lines = [f"{label} ({len(paths)}):"] + [f"  {p}" for p in paths[:limit]]
    if len(paths) > limit:
        lines.append(f"  ... and {len(paths) - limit} more")
    return lines


def sync_summary_text(s) -> str:
    """The summary of a :class:`gpumagic.sync.SyncSummary`: one line, then the paths deleted
    (or, for a dry run, those that would be sent and deleted)."""
    arrow = f"{s.source} -> {s.destination}"
    if s.dry_run:
        head = (f"dry run, nothing changed: {arrow}: would send {len(s.would_send)} files, "
                f"delete {len(s.deleted)}, {s.skipped} unchanged")
        lines = [head] + _paths("would send", s.would_send) + _paths("would delete", s.deleted)
        return "\n".join(lines + _unreadable(s))
    head = (f"{s.direction} {arrow}: {s.files_sent} files, {format_bytes(s.bytes_sent)} sent"
            + (f" (+{format_bytes(s.bytes_resumed)} resumed)" if s.bytes_resumed else "")
            + f", {s.skipped} unchanged"
            + (f", {len(s.deleted)} deleted" if s.deleted else "")
            + (f", {len(s.newer)} newer at destination kept" if s.newer else "")
            + f" in {format_seconds(s.seconds)}")
    return "\n".join([head] + _paths("deleted", s.deleted) + _unreadable(s))


def _unreadable(s) -> list[str]:
    return _paths("could not read, not synced", [f"{p}: {why}" for p, why in s.unreadable.items()])
