"""One cap on what a cell shows: ``GpuMagics.max_display_bytes`` characters.

A browser tab slows to a crawl on tens of megabytes of output.  :class:`OutputCap` counts what
a cell shows and passes on at most ``limit`` characters; past it the rest is not displayed
(``--out VAR`` still keeps it) and :meth:`OutputCap.finish` says, in one line, how much was
left out and how to raise the limit.  ``%%remote`` echoes through it (:meth:`OutputCap.stdout`,
:meth:`OutputCap.stderr`), and a live session's output (:class:`gpumagic.notebook.magics.kernel.NotebookOutput`)
counts its text and MIME data with it.
"""

from __future__ import annotations

import sys


class OutputCap:
    """At most ``limit`` characters of one cell's output shown (``None``: no limit).

    Parameters
    ----------
    limit : int or None
        Characters (text, and the string values of MIME bundles).
    kept : str
        What ``--out VAR`` keeps, for the closing line ("all output", "the text").
    """

    def __init__(self, limit: int | None, kept: str = "all output"):
        self.limit = limit
        self.kept = kept
        self.shown = 0
        self.dropped = 0

    def room(self, n: int) -> int:
        """How many of the next ``n`` characters to show (the rest count as dropped)."""
        room = n if self.limit is None else max(0, min(n, self.limit - self.shown))
        self.shown += room
        self.dropped += n - room
        return room

    def admit(self, n: int) -> bool:
        """Whether an ``n``-character whole (a MIME bundle) fits; it is shown whole or not at all."""
        if self.limit is not None and self.shown + n > self.limit:
            self.dropped += n
            return False
        self.shown += n
        return True

    def write(self, stream, text: str) -> None:
        """Write what fits of ``text`` to ``stream`` and flush it."""
        room = self.room(len(text))
        if room:
            stream.write(text[:room])
            stream.flush()

    def stdout(self, text: str) -> None:
        self.write(sys.stdout, text)

    def stderr(self, text: str) -> None:
        self.write(sys.stderr, text)

    def note(self) -> str:
        """The closing line ("" when nothing was dropped)."""
        if not self.dropped:
            return ""
        return (f"[gpumagic: {self.dropped:,} more characters were not displayed (limit {self.limit:,}); "
                f"--out VAR keeps {self.kept}; raise it with %config GpuMagics.max_display_bytes = N]")

    def finish(self) -> None:
        """Say on stderr what was not displayed, if anything."""
        if self.dropped:
            print(f"\n{self.note()}", file=sys.stderr, flush=True)
