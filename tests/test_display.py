"""HTML details a reader notices (issue 17 case 5): line breaks kept, `code` as <code>,
table cells at the left, the guard's action shown as an alert."""

import re
from types import SimpleNamespace

from gpumagic.budget import GuardStatus
from gpumagic.gpu.doctor import Check, DoctorReport, Level
from gpumagic.notebook import display


def test_prose_escapes_marks_code_and_keeps_line_breaks():
    assert display.prose("run `%gpu tunnel close 6006` <now>\nthen reload") == (
        "run <code>%gpu tunnel close 6006</code> &lt;now&gt;<br>then reload")
    assert display.prose("a `lone backtick") == "a `lone backtick"


def test_the_tunnel_message_keeps_its_line_break_in_html():
    t = SimpleNamespace(name="TensorBoard", target="localhost:6006", url="http://127.0.0.1:6007/",
                        local_port=6007)
    note = "TensorBoard started on m\nlocal port 6006 is taken; using 6007 instead"
    r = display.tunnel_opened(t, "m", note)
    assert "TensorBoard started on m<br>local port 6006 is taken" in r.html
    assert "<code>%gpu tunnel close 6007</code>" in r.html and "`" not in r.html
    assert r.text.splitlines()[:2] == note.splitlines()


def test_doctor_and_estimate_cells_are_left_aligned_near_their_labels():
    report = DoctorReport(status=None, host="m", checks=[
        Check("disks", Level.WARN, "/ is 95% full", "free space: `du -sh ~/.cache`"),
        Check("python", Level.OK, "Python 3.12"),
    ])
    html = display.render_doctor(report).html
    cells = re.findall(r"<t[dh][^>]*>", html)
    assert cells and all("text-align:left" in c for c in cells), cells
    assert "<code>du -sh ~/.cache</code>" in html
    est = display.EstimateView([SimpleNamespace(label="rent", cost=200.0, note="at `2.5`/h")], "CNY").html()
    cells = re.findall(r"<t[dh][^>]*>", est)
    assert cells and all("text-align:left" in c for c in cells), cells
    assert "<code>2.5</code>" in est


def test_backticks_are_code_in_html_views_and_the_widget_note():
    empty = display.jobs_table([], "m")
    assert "<code>%%remote --job NAME</code>" in empty.html and "`" in empty.text
    alert = display.AlertView("run `%gpu budget` again")
    assert "<code>%gpu budget</code>" in alert.html()
    from gpumagic.notebook import widgets
    from gpumagic.gpu.smi import GpuStatus, StatusKind

    view = widgets.status_widget(GpuStatus(kind=StatusKind.OK, host="m", driver_version="1", cuda_version="2"))
    view.set_note("refreshing every 2 s; `%gpu status --stop` stops it")
    assert view.note.value == "refreshing every 2 s; <code>%gpu status --stop</code> stops it"


def test_a_guard_that_acted_is_shown_as_an_alert_with_its_warning():
    log = ("2026-12-01 04:00:00 guard armed: deadline_in=3s grace=2s poll=1s; shutdown: shutdown -h now",
           "2026-12-01 04:00:03 WARNING: shutting down in 2s (deadline reached)",
           "2026-12-01 04:00:05 SHUTDOWN: deadline reached; running: shutdown -h now")
    g = GuardStatus(state="fired", reason="deadline reached", log=log, checked=100.0, remote_now=100.0)
    html = display.GuardView(g).html()
    assert html.startswith('<div style="border-left:6px solid #c62828')
    assert "the guard warned first: shutting down in 2s (deadline reached)" in html
    armed = GuardStatus(state="armed", settings={"idle_s": 1800})
    assert "border-left" not in display.GuardView(armed).html()


def test_an_alert_is_first_once_per_job_even_when_its_start_was_not_read_yet():
    # CI, with both suites at once: `%gpu attach` read the job's info before its `started` was
    # written (None), `%gpu jobs` then read it, and the alert was shown twice
    from gpumagic.notebook import display

    shown: dict = {}  # the notebook's (GpuMagics.state.alerts_shown)
    name = "first-alert"
    assert display.first_alert(shown, name, None, "nan")
    assert not display.first_alert(shown, name, 1000.0, "nan")  # the same job, its start now known
    assert not display.first_alert(shown, name, None, "nan")
    assert display.first_alert(shown, name, 1000.0, "oom")  # another kind: its own first time
    other = f"{name}-b"
    assert display.first_alert(shown, other, 1000.0, "nan") and not display.first_alert(shown, other, 1000.0, "nan")
    assert display.first_alert(shown, other, 2000.0, "nan")  # started again under that name: a new job
    assert display.first_alert({}, name, None, "nan")  # another notebook: its own first time
