"""ipywidgets views.  They only display: formatting lives in :mod:`gpumagic.notebook.display`.

``ipywidgets`` is imported lazily; :func:`available` says whether it can be used.  Each
widget's ``text/plain`` form is the readable text (what a front end without widget support
shows), never the widget's repr or JSON; where widgets cannot show at all (a terminal
IPython, a script) tqdm draws a text bar on stderr.  Background refreshes only set widget
values (thread-safe traitlets), never ``with out:``.
"""

from __future__ import annotations

import html
import sys

from . import display
from .display import RATE_AFTER_S, listing_text, sync_progress_text
from ..gpu.smi import Gpu, GpuStatus, known


def available() -> bool:
    """True when ipywidgets can be imported."""
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def can_show(shell) -> bool:
    """True when ``shell`` belongs to a Jupyter kernel, whose front end can render widgets
    (a terminal IPython's or a plain ``InteractiveShell`` has no ``kernel``), and ipywidgets
    can be imported."""
    return getattr(shell, "kernel", None) is not None and available()


def _mem_pct(g: Gpu) -> float:
    if known(g.memory_used_mib) and known(g.memory_total_mib) and g.memory_total_mib:
        return 100.0 * g.memory_used_mib / g.memory_total_mib
    return 0.0


class _GpuRow:
    """Widgets for one GPU: name, memory bar, utilisation bar, temperature/power, processes."""

    def __init__(self, w):
        self.title = w.HTML()
        self.mem = w.FloatProgress(min=0, max=100, description="memory", bar_style="info")
        self.mem_label = w.Label()
        self.util = w.FloatProgress(min=0, max=100, description="util", bar_style="success")
        self.util_label = w.Label()
        self.sensors = w.Label()
        self.procs = w.HTML()
        self.box = w.VBox([self.title, w.HBox([self.mem, self.mem_label]),
                           w.HBox([self.util, self.util_label]), self.sensors, self.procs])

    def update(self, status: GpuStatus, g: Gpu) -> None:
        self.title.value = f"<b>{display.escape(g.label)}</b> {display.escape(g.name)}"
        self.mem.value = _mem_pct(g)
        self.mem_label.value = f"{display.reading(g.memory_used_mib)}/{display.reading(g.memory_total_mib)} MiB"
        self.util.value = float(g.utilization_gpu_pct) if known(g.utilization_gpu_pct) else 0.0
        self.util_label.value = display.reading(g.utilization_gpu_pct, unit="%")
        self.sensors.value = (f"{display.reading(g.temperature_c, unit=' C')}, "
                              f"{display.watts(g.power_draw_w)}/{display.watts(g.power_limit_w)} W, "
                              f"SM {display.reading(g.clock_sm_mhz, unit=' MHz')}, "
                              f"fan {display.reading(g.fan_pct, unit='%')}")
        self.procs.value = "<br>".join(display.escape(x.strip())
                                       for x in display.process_lines(status, g))


def status_widget(status: GpuStatus):
    """A :class:`StatusWidget` for ``status`` (requires ipywidgets)."""
    import ipywidgets as w

    class StatusWidget(w.VBox):
        """The GPU status as widgets; :meth:`update` refreshes it in place."""

        def __init__(self, first: GpuStatus):
            self._w = w
            self.header = w.HTML()
            self.note = w.HTML()
            self.note_text = ""
            self.rows: list[_GpuRow] = []
            self.rows_box = w.VBox()
            self.status = first
            super().__init__([self.header, self.rows_box, self.note])
            self.update(first)

        def update(self, status: GpuStatus) -> None:
            """Show ``status`` (safe to call from a background thread)."""
            self.status = status
            header = display.escape(display.status_header(status))
            if not status.ok and status.hint:
                header += f"<br>hint: {display.prose(status.hint)}"
            header += "".join(f"<br>warning: {display.prose(w)}" for w in status.warnings)
            self.header.value = f"<b>{header}</b>"
            gpus = status.gpus if status.ok else []
            if len(self.rows) != len(gpus):
                self.rows = [_GpuRow(self._w) for _ in gpus]
                self.rows_box.children = [r.box for r in self.rows]
            for row, g in zip(self.rows, gpus):
                row.update(status, g)

        def set_note(self, text: str) -> None:
            """A line under the status (e.g. why a --watch stopped)."""
            self.note_text = text
            self.note.value = display.prose(text)  # `%gpu status --stop` as <code>

        def show(self) -> None:
            """Display the live widget under a display id, so :meth:`finish` can replace it."""
            from IPython.display import display as show

            self.handle = show(self, display_id=True)

        def finish(self, reason: str) -> None:
            """The watch ended: replace the live widget by its last state as static HTML and
            text (what a saved notebook shows with no kernel), then close the widget models."""
            self.set_note(reason)
            if getattr(self, "handle", None) is not None:
                self.handle.update(self.static())
                self.close_all()

        def static(self) -> display.Rendered:
            """The current state as static text/plain and text/html."""
            return display.render_status(self.status, self.note_text)

        def close_all(self) -> None:
            for row in self.rows:
                for child in (row.title, row.mem, row.mem_label, row.util, row.util_label,
                              row.sensors, row.procs):
                    child.close()
                row.box.close()
            for child in (self.header, self.note, self.rows_box):
                child.close()
            self.close()

        @property
        def text(self) -> str:
            """The text/plain form: the status text, then the note."""
            return display.status_text(self.status) + (f"\n{self.note_text}" if self.note_text else "")

        def _repr_mimebundle_(self, **kwargs):
            # The live widget, with the same state as static HTML and text beside it: what a
            # front end without the widget's model (a reopened notebook, GitHub) shows.
            data = super()._repr_mimebundle_(**kwargs)
            data["text/plain"] = self.text
            data["text/html"] = self.static().html
            return data

    return StatusWidget(status)


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
        self.label = w.Label("starting")
        self.box = w.HBox([self.bar, self.label])
        self.text = ""
        self.last = None  # the last SyncProgress reported
        self.handle = None
        if display:
            from IPython.display import display as show

            self.handle = show(self, display_id=True)

    def static(self, failed: bool = False) -> "display.Rendered":
        """The bar's state as static text/plain and text/html (no widget model needed)."""
        return display.render_sync_bar(self.last, failed)

    def _repr_mimebundle_(self, **kwargs) -> dict:
        # The widget for Jupyter, its state as static HTML and text beside it for a front end
        # without the widget's model; :meth:`close` replaces it by the static form.
        bundle = self.box._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = f"sync progress: {self.text or 'starting'}"
        bundle["text/html"] = self.static().html
        return bundle

    def __call__(self, p) -> None:
        self.last = p
        self.bar.max = max(p.bytes_total, 1)
        self.bar.value = min(p.bytes_done, self.bar.max) if p.bytes_total else (1 if p.finished else 0)
        self.text = sync_progress_text(p)
        self.label.value = self.text if p.files_total or p.bytes_total or p.listing or not p.finished \
            else "nothing to transfer (everything is up to date)"
        if p.finished:
            self.bar.bar_style = "success"

    def close(self, failed: bool = False) -> None:
        """The sync ended (``failed``: with an error): the live widget is replaced, through
        its display id, by its final state as static HTML and text, and its models closed."""
        if failed:
            self.bar.bar_style = "danger"
        if self.handle is not None:
            self.handle.update(self.static(failed))
            self.handle = None
            for w in (self.bar, self.label, self.box):
                w.close()

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(self.text)


class SyncProgressText:
    """tqdm's text bar (bytes, rate, ETA) with files in the postfix; for terminals.

    :meth:`close` must run when the sync ends, also when it fails (``%gpu sync`` calls it in
    a ``finally``): a bar left open makes the error start on its line and clears itself
    later, over whatever was printed next.
    """

    #: tqdm's format without the rate and ETA, for the first :data:`RATE_AFTER_S` seconds.
    EARLY_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"

    def __init__(self, file=None):
        self.file = file or sys.stderr
        self.bar = None
        self.text = ""

    def __call__(self, p) -> None:
        from tqdm import tqdm

        more = "+" if getattr(p, "counting", False) and not p.finished else ""
        files = listing_text(p) if p.listing else f"{p.files_done}/{p.files_total}{more} files"
        if self.bar is None:
            # miniters=1: each call draws (the sync calls at most 10 times a second); tqdm's
            # own dynamic miniters stopped drawing after one large step in bytes
            self.bar = tqdm(total=p.bytes_total, unit="B", unit_scale=True, unit_divisor=1024,
                            file=self.file, desc="sync", leave=False, dynamic_ncols=True,
                            bar_format=self.EARLY_FORMAT, miniters=1, postfix=files)
        if self.bar.bar_format is not None and p.elapsed >= RATE_AFTER_S and p.bytes_done:
            self.bar.bar_format = None  # tqdm's own: with rate and ETA
        if self.bar.total != p.bytes_total:  # a push into an empty folder counts as it goes
            self.bar.total = p.bytes_total
        self.bar.update(p.bytes_done - self.bar.n)
        self.bar.set_postfix_str(files, refresh=False)
        self.text = sync_progress_text(p)
        if p.finished:
            self.close()

    def close(self, failed: bool = False) -> None:
        """End the bar (safe twice): cleared after a sync that finished; after one that
        ``failed``, left where it stopped with its line ended, so the error starts on the
        next line."""
        bar, self.bar = self.bar, None
        if bar is None:
            return
        if failed:
            bar.leave = True
        bar.close()


class LazySyncProgress:
    """A progress view made at its first report: a dry run shows one only when the
    machine's walk takes long enough to report (see ``SyncProgress.listing``)."""

    def __init__(self, make=None):
        self.make = make or sync_progress
        self.view = None

    def __call__(self, p) -> None:
        if self.view is None:
            self.view = self.make()
        self.view(p)

    def close(self, failed: bool = False) -> None:
        if self.view is not None:
            self.view.close(failed)


def sync_progress(display: bool = True):
    """The best progress view here: the widget in a Jupyter kernel, else tqdm text."""
    if _in_kernel():
        try:
            return SyncProgressBar(display=display)
        except ImportError:
            pass
    return SyncProgressText()


# -- setup (%gpu keygen) -----------------------------------------------------------------


def public_key_html(pair) -> str:
    """The new key as static HTML (heading and the key in a ``<pre>``): what a saved notebook
    shows without the widget's model."""
    return (f"<div><b>New SSH key</b> {html.escape(str(pair.path))} "
            f"<code>{html.escape(pair.fingerprint)}</code><br>"
            "Paste this public key into your GPU platform's SSH-key settings:"
            f"<pre style='white-space:pre-wrap;word-break:break-all'>{html.escape(pair.public_key)}</pre></div>")


def public_key_widget(pair):
    """An ipywidgets ``VBox``: heading, read-only-looking text box with the key, copy button.

    The copy button uses the browser's ``navigator.clipboard``; where a front end blocks it,
    the text box still lets the user select the line.  Returns None without ipywidgets.
    """
    try:
        import ipywidgets as w
    except ImportError:
        return None
    heading = w.HTML(f"<b>New SSH key</b> {html.escape(str(pair.path))} "
                     f"<code>{html.escape(pair.fingerprint)}</code><br>"
                     "Paste this public key into your GPU platform's SSH-key settings:")
    box = w.Textarea(value=pair.public_key, layout=w.Layout(width="100%", height="4.5em"))
    key_attr = html.escape(pair.public_key, quote=True)
    button = w.HTML(
        f'<button class="jupyter-button" data-key="{key_attr}" '
        "onclick=\"navigator.clipboard.writeText(this.dataset.key)"
        ".then(()=>{this.textContent='copied'})\">copy public key</button>")
    return w.VBox([heading, box, button])
