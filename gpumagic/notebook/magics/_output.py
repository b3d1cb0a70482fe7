"""The cap on what a cell shows: ``GpuMagics.max_display_bytes`` characters of text and
``GpuMagics.max_image_bytes`` bytes of images, each its own limit.

A browser tab slows to a crawl on tens of megabytes of text; images it draws natively, so a
cell's figures get a limit of their own (three 3600x3600-pixel figures, about 2.5 MB of PNG
each, show as in a local kernel).  :class:`OutputCap` counts what a cell shows and passes on at
most ``limit`` characters of text and ``image_limit`` bytes of images; past either the rest is
not displayed (``--out VAR`` still keeps it) and :meth:`OutputCap.finish` says, one line per
limit, what was left out, how to get it and how to raise the limit.  ``%%remote`` echoes
through it (:meth:`OutputCap.stdout`, :meth:`OutputCap.stderr`), and a live session's output
(:class:`gpumagic.notebook.magics.kernel.NotebookOutput`) counts its text and MIME bundles
with it (:meth:`OutputCap.admit_bundle`).
"""

from __future__ import annotations

import sys

#: MIME types counted as images (their own limit, in bytes as the notebook holds them: base64
#: for binary formats): what a browser draws or plays natively rather than lays out as text.
MEDIA_PREFIXES = ("image/", "video/", "audio/")
MEDIA_TYPES = frozenset({"application/pdf"})


def is_media(mime: str) -> bool:
    """Whether a MIME type counts against the image limit (``image/png``, ``image/svg+xml``,
    ``video/mp4``, ...) rather than the text limit (``text/plain``, ``text/html``, ...)."""
    return mime.startswith(MEDIA_PREFIXES) or mime in MEDIA_TYPES


def bundle_size(data: dict) -> int:
    """Characters of a MIME bundle's string values (base64 images count as they are sent)."""
    return sum(len(v) for v in data.values() if isinstance(v, str))


def megabytes(n: int) -> str:
    """``2_500_000`` -> ``"2.5 MB"`` (decimal, as the limits are given); small sizes in kB or bytes."""
    if n >= 1_000_000:
        return f"{n / 1e6:.3g} MB"
    if n >= 1_000:
        return f"{n / 1e3:.3g} kB"
    return f"{n} bytes"


class OutputCap:
    """At most ``limit`` characters of text and ``image_limit`` bytes of images of one cell's
    output shown (``None``: no limit).

    Parameters
    ----------
    limit : int or None
        Characters of text (streams, and MIME bundles with no image in them).
    kept : str
        What ``--out VAR`` keeps of the text, for the closing line ("all output", "the text").
    image_limit : int or None
        Bytes of images: a bundle with an image (:func:`is_media`) counts here, whole.
    """

    def __init__(self, limit: int | None, kept: str = "all output", image_limit: int | None = None):
        self.limit = limit
        self.kept = kept
        self.shown = 0
        self.dropped = 0
        self.image_limit = image_limit
        self.images_shown = 0
        #: Images held back: how many, and their bytes.
        self.images_dropped = 0
        self.image_bytes_dropped = 0
        #: display id -> (whether it counts as an image, its size): what an update replaces
        self._held: dict[str, tuple[bool, int]] = {}
        self._dropped_ids: set[str] = set()

    def clear(self) -> None:
        """The cell's output was cleared (``clear_output``): nothing it held counts any more,
        shown or held back (a live plot that redraws its figure ends holding the last one,
        as in a local kernel)."""
        self.shown = self.dropped = 0
        self.images_shown = self.images_dropped = self.image_bytes_dropped = 0
        self._held.clear()
        self._dropped_ids.clear()

    def admit_display(self, data: dict, display_id: str | None = None, update: bool = False) -> bool:
        """Whether a display (``display_data``, or ``update_display_data`` with ``update``) is
        shown.  A display with an id is held under it: its update replaces it, so what counts
        is the update's size instead of the one before; an update of an id this cell held back
        is held back too; one of an id shown before this cell (or never) passes uncounted."""
        media = any(is_media(mime) for mime in data)
        n = bundle_size(data)
        if update:
            if display_id in self._dropped_ids:
                return False
            if display_id not in self._held:
                return True
            was_media, old = self._held.pop(display_id)
            if was_media:
                self.images_shown -= old
            else:
                self.shown -= old
            if not self.admit_bundle(data):  # too big now: the old one stays shown and counted
                if was_media:
                    self.images_shown += old
                else:
                    self.shown += old
                self._held[display_id] = (was_media, old)
                return False
            self._held[display_id] = (media, n)
            return True
        if not self.admit_bundle(data):
            if display_id:
                self._dropped_ids.add(display_id)
            return False
        if display_id:
            self._held[display_id] = (media, n)
        return True

    def room(self, n: int) -> int:
        """How many of the next ``n`` characters to show (the rest count as dropped)."""
        room = n if self.limit is None else max(0, min(n, self.limit - self.shown))
        self.shown += room
        self.dropped += n - room
        return room

    def admit(self, n: int) -> bool:
        """Whether an ``n``-character whole (a text MIME bundle) fits; it is shown whole or not at all."""
        if self.limit is not None and self.shown + n > self.limit:
            self.dropped += n
            return False
        self.shown += n
        return True

    def admit_bundle(self, data: dict) -> bool:
        """Whether a MIME bundle fits, shown whole or not at all: one with an image in it
        counts against the image limit (its text alternatives, ``<Figure size ...>``, with
        it), any other against the text limit."""
        n = bundle_size(data)
        if not any(is_media(mime) for mime in data):
            return self.admit(n)
        if self.image_limit is not None and self.images_shown + n > self.image_limit:
            self.images_dropped += 1
            self.image_bytes_dropped += n
            return False
        self.images_shown += n
        return True

    def admit_value(self, data: dict) -> bool:
        """Whether a cell's value (its ``execute_result`` bundle) is shown: whenever it fits
        its limit by itself, however much output came before it (a local kernel always
        shows it, and it is one item, not a stream); counted as shown either way."""
        media = any(is_media(mime) for mime in data)
        n, limit = bundle_size(data), self.image_limit if media else self.limit
        if limit is not None and n > limit:
            return self.admit_bundle(data)  # held back, and said so
        if media:
            self.images_shown += n
        else:
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

    @property
    def held_back(self) -> bool:
        """Whether anything was not displayed."""
        return bool(self.dropped or self.images_dropped)

    def note(self) -> str:
        """The closing lines, one per limit reached ("" when nothing was dropped)."""
        lines = []
        if self.dropped:
            lines.append(f"[gpumagic: {self.dropped:,} more characters were not displayed (limit {self.limit:,}); "
                         f"--out VAR keeps {self.kept}; raise it with %config GpuMagics.max_display_bytes = N]")
        if self.images_dropped:
            n = self.images_dropped
            what = "1 image" if n == 1 else f"{n:,} images"
            were, them = ("was", "it") if n == 1 else ("were", "them")
            limit = megabytes(self.image_limit or 0)
            lines.append(f"[gpumagic: {what} ({megabytes(self.image_bytes_dropped)}) {were} not displayed "
                         f"(image limit {limit}); --out VAR keeps {them} in VAR.outputs; raise the limit "
                         f"with %config GpuMagics.max_image_bytes = N]")
        return "\n".join(lines)

    def finish(self) -> None:
        """Say on stderr what was not displayed, if anything."""
        if self.held_back:
            print(f"\n{self.note()}", file=sys.stderr, flush=True)
