"""ipywidgets views.  They only display; text comes from :mod:`gpumagic.display`.

Every view falls back to text where widgets cannot show (a terminal IPython, a script):
there tqdm draws a text bar on stderr.  Updates happen on the caller's thread, never with
``with out:`` from a background thread.
"""

from __future__ import annotations

import sys

from .display import sync_progress_text


def _in_kernel() -> bool:
    """True inside a Jupyter kernel (where a widget can render), as tqdm.autonotebook checks."""
    ip = sys.modules.get("IPython")
    if ip is None:
        return False
    shell = ip.get_ipython()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


# -- sync ------------------------------------------------------------------------------


class SyncProgressBar:
    """A sync progress bar: an ipywidgets ``IntProgress`` (bytes) and a text label.

    Call it with a :class:`gpumagic.sync.SyncProgress`; ``text`` always holds the same line
    as plain text (the widget's ``text/plain`` fallback).

    Parameters
    ----------
    display : bool
        Show the widget now (off in tests, which check the values).
    """

    def __init__(self, display: bool = True):
        import ipywidgets as w

        self.bar = w.IntProgress(value=0, min=0, max=1, description="sync",
                                 layout=w.Layout(width="40%"))
        self.label = w.Label("")
        self.box = w.HBox([self.bar, self.label])
        self.text = ""
        if display:
            from IPython.display import display as show

            show(self)

    def _repr_mimebundle_(self, **kwargs) -> dict:
        # The widget for Jupyter; readable text where widgets cannot render (the summary line
        # printed after the sync carries the numbers).
        bundle = self.box._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = f"sync progress: {self.text or 'starting'}"
        return bundle

    def __call__(self, p) -> None:
        self.bar.max = max(p.bytes_total, 1)
        self.bar.value = min(p.bytes_done, self.bar.max) if p.bytes_total else (1 if p.finished else 0)
        self.text = sync_progress_text(p)
        self.label.value = self.text
        if p.finished:
            self.bar.bar_style = "success"

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(self.text)


class SyncProgressText:
    """tqdm's text bar (bytes, rate, ETA) with files in the postfix; for terminals."""

    def __init__(self, file=None):
        self.file = file or sys.stderr
        self.bar = None
        self.text = ""

    def __call__(self, p) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=p.bytes_total, unit="B", unit_scale=True, unit_divisor=1024,
                            file=self.file, desc="sync", leave=False, dynamic_ncols=True)
        self.bar.update(p.bytes_done - self.bar.n)
        self.bar.set_postfix_str(f"{p.files_done}/{p.files_total} files", refresh=False)
        self.text = sync_progress_text(p)
        if p.finished:
            self.bar.close()


def sync_progress(display: bool = True):
    """The best progress view here: the widget in a Jupyter kernel, else tqdm text."""
    if _in_kernel():
        try:
            return SyncProgressBar(display=display)
        except ImportError:
            pass
    return SyncProgressText()
