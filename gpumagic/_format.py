"""Plain-text formats shared by every layer (no IPython here): lengths of time, sizes, counts."""

from __future__ import annotations


def duration(seconds: float | None) -> str:
    """A length of time as people say it, as precise as is useful at its size.

    Parameters
    ----------
    seconds : float or None
        Seconds; a negative length reads as 0, ``None`` (not known) as ``"-"``.

    Returns
    -------
    str
        Under 10 s to a tenth (``"4.2 s"``); under a minute in seconds (``"42 s"``); under
        10 min in minutes and seconds (``"1 min 15 s"``, ``"2 min"``); under an hour in whole
        minutes, rounded down (``3599`` -> ``"59 min"``: what is left is never overstated);
        from an hour on in days, hours and minutes, rounded to the minute, zero parts left
        out (``"2 h 59 min"``, ``"1 d 3 h"``).
    """
    if seconds is None:
        return "-"
    seconds = max(0.0, float(seconds))
    if seconds < 9.95:  # what rounds to 10.0 reads "10 s"
        return f"{seconds:.1f} s"
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 600:
        m, s = divmod(s, 60)
        return f"{m} min {s} s" if s else f"{m} min"
    m = s // 60 if s < 3600 else round(s / 60)
    d, rem = divmod(m, 24 * 60)
    h, m = divmod(rem, 60)
    parts = ([f"{d} d"] if d else []) + ([f"{h} h"] if h else []) + ([f"{m} min"] if m else [])
    return " ".join(parts)


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: ``count(1, "file")`` -> ``"1 file"``,
    ``count(3, "cache", "caches")`` -> ``"3 caches"`` (default plural: ``noun + "s"``)."""
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"


def rough_duration(seconds: float) -> str:
    """A length of time to the unit that matters, for a sentence that says roughly how long:
    under 10 s to a tenth unless whole (``"3 s"``, ``"0.5 s"``), whole seconds under a minute
    (``"40 s"``), whole minutes under two hours (``"3 min"``, ``"90 min"``), hours beyond, to a
    tenth unless whole (``"2 h"``, ``"2.5 h"``).  A negative length reads as 0.  Where the exact
    length matters, :func:`duration`."""
    seconds = max(0.0, float(seconds))
    if seconds < 9.95:
        return f"{round(seconds, 1):g} s"
    if seconds < 59.5:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f}".removesuffix(".0") + " h"


def format_bytes(n: float) -> str:
    """A size in binary units, as ``ls -h`` and ``du -h`` print it: ``1536`` -> ``"1.5 KiB"``,
    ``200`` -> ``"200 B"``, ``14 * 2**30`` -> ``"14.0 GiB"`` (one decimal from KiB on)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
