"""ipywidgets views.  They only display: formatting lives in :mod:`gpumagic.display`.

``ipywidgets`` is imported lazily; :func:`available` says whether it can be used.  Each
widget's ``text/plain`` form is the readable status text (what a front end without widget
support shows), never the widget's repr or JSON.  Background refreshes only set widget
values (thread-safe traitlets), never ``with out:``.
"""

from __future__ import annotations

from . import display
from .gpu import Gpu, GpuStatus, known


def available() -> bool:
    """True when ipywidgets can be imported."""
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


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
                header += f"<br>hint: {display.escape(status.hint)}"
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
            self.note.value = display.escape(text)

        @property
        def text(self) -> str:
            """The text/plain form: the status text, then the note."""
            return display.status_text(self.status) + (f"\n{self.note_text}" if self.note_text else "")

        def _repr_mimebundle_(self, **kwargs):
            data = super()._repr_mimebundle_(**kwargs)
            data["text/plain"] = self.text
            return data

    return StatusWidget(status)
