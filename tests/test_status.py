"""`%gpu status`, `%gpu doctor` and the %%remote failure hints, end to end over the test
sshd with the replaying nvidia-smi (``sshd.set_gpu``)."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from gpumagic.errors import RemoteCommandError
from gpumagic.gpu.doctor import Level
from gpumagic.gpu.smi import StatusKind

from conftest import make_server


@pytest.fixture
def set_gpu(sshd):
    """Switch the fake nvidia-smi; put back 'h200-idle' afterwards."""
    yield sshd.set_gpu
    sshd.set_gpu("h200-idle")


def _count_channels(machine) -> list:
    """Count the SSH channels the machine opens from now on (one per round trip)."""
    opened = []
    real = machine.connection.open_session

    def counting():
        opened.append(1)
        return real()

    machine.connection.open_session = counting
    return opened


def _count_runner_cells(monkeypatch) -> list:
    """Count the cells run on a connection's cell runner from now on (one round trip each,
    on the runner's open channel: no channel is opened for them)."""
    from gpumagic.remote import execution

    cells, real = [], execution._Runner.run

    def counting(self, *args, **kwargs):
        cells.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(execution._Runner, "run", counting)
    return cells


def test_status_on_h200_load_in_one_round_trip(machine, set_gpu):
    set_gpu("h200-load")
    machine.env.login()  # read once per connection (the PATH nvidia-smi is looked up in)
    opened = _count_channels(machine)
    status = machine.gpu_status()
    assert len(opened) == 1
    assert status.kind is StatusKind.OK and status.host == "testgpu"
    g, = status.gpus
    assert (g.name, g.utilization_gpu_pct, g.memory_used_mib, g.memory_total_mib) == (
        "NVIDIA H200", 100, 20213, 143771)
    assert (g.temperature_c, g.power_limit_w, g.fan_pct.raw) == (58, 700.0, "[N/A]")
    p, = status.processes
    assert (p.pid, p.name, p.used_mib) == (485, "python3", 20204)
    assert (status.driver_version, status.cuda_version) == ("580.159.04", "13.0")
    again = machine.gpu_status(cuda_version=status.known_cuda)  # what each --watch refresh does
    assert len(opened) == 2 and again.cuda_version == "13.0" and again.gpus == status.gpus


@pytest.mark.parametrize("state, kind", [("mismatch", StatusKind.MISMATCH),
                                         ("no-driver", StatusKind.NO_DRIVER)])
def test_status_driver_failures_become_kinds_over_ssh(machine, set_gpu, state, kind):
    set_gpu(state)
    status = machine.gpu_status()
    assert status.kind is kind and status.hint
    if kind is StatusKind.MISMATCH:
        assert status.library_version == "570.124"


def test_status_over_ssh_with_exit_14_lists_the_gpu_and_warns(ip, set_gpu, capsys):
    """Issue 7: nvidia-smi exits 14 (infoROM is corrupted) while printing valid rows."""
    set_gpu("inforom")
    ip.run_line_magic("gpu", "connect testgpu")
    status = ip._gpumagic.fleet.get().gpu_status()
    assert status.kind is StatusKind.OK and len(status.gpus) == 1
    assert status.warnings[0].startswith("nvidia-smi exited with status 14 (the infoROM is corrupted)")
    capsys.readouterr()
    ip.run_line_magic("gpu", "status --text")
    out = capsys.readouterr().out
    assert "warning: nvidia-smi exited with status 14 (the infoROM is corrupted)" in out
    assert "GPU0 NVIDIA H200 | util 0%" in out and "nvidia-smi failed" not in out


def test_status_over_ssh_with_one_gpu_of_four_lost_lists_the_other_three(machine, set_gpu):
    set_gpu("lost-gpu")
    status = machine.gpu_status()
    assert status.kind is StatusKind.OK
    assert [g.index for g in status.gpus] == [0, 1, 3]
    assert any("Unable to determine the device handle for GPU0000:00:08.0" in w for w in status.warnings)


def test_status_on_a_machine_without_nvidia_smi():
    import gpumagic

    server = make_server("nogpu")  # no fake nvidia-smi on its PATH
    try:
        with gpumagic.Machine(server.spec(), name="nogpu") as m:
            if m.exec("command -v nvidia-smi").exit_code == 0:
                pytest.skip("this host has a real nvidia-smi")
            status = m.gpu_status()
        assert status.kind is StatusKind.NO_NVIDIA_SMI
        assert "no nvidia-smi" in status.message and "driver" in status.hint
    finally:
        server.stop()


def test_status_text_magic_prints_one_line_per_gpu(ip, set_gpu, capsys):
    set_gpu("h200-load")
    ip.run_line_magic("gpu", "connect testgpu")
    capsys.readouterr()
    ip.run_line_magic("gpu", "status --text")
    out = capsys.readouterr().out
    assert "GPU0 NVIDIA H200 | util 100% | mem 20213/143771 MiB | 58C | 691/700 W\n" in out
    assert "python3 (pid 485) 20204 MiB" in out


def test_status_widget_plain_text_is_the_status_not_a_repr(ip, capsys):
    ip.run_line_magic("gpu", "connect testgpu")
    capsys.readouterr()
    ip.run_line_magic("gpu", "status")  # a terminal shell prints the widget's text/plain
    out = capsys.readouterr().out
    assert "GPU0 NVIDIA H200 | util 0% | mem 0/143771 MiB | 37C | 127/700 W" in out
    assert "  no processes" in out
    assert "VBox" not in out and "model_id" not in out


def test_status_bad_arguments_are_usage_errors(ip):
    ip.run_line_magic("gpu", "connect testgpu")
    with pytest.raises(UsageError, match="--watch: '0.2' is out of range; give seconds, from 1 to"):
        ip.run_line_magic("gpu", "status --watch 0.2")
    with pytest.raises(UsageError, match="drop --text"):
        ip.run_line_magic("gpu", "status --watch 2 --text")
    with pytest.raises(UsageError, match="--sample"):
        ip.run_line_magic("gpu", "doctor --sample 9999")


def _wait(thread_owner, predicate, limit=60.0):
    """Wait for ``predicate()`` while the watch thread runs (bounded, not a timing assertion)."""
    waited = 0.0
    while not predicate() and waited < limit:
        thread_owner._thread.join(0.05)
        waited += 0.05
    return predicate()


@pytest.fixture
def kernel_ip(ip, monkeypatch):
    """``ip`` as a Jupyter kernel's shell would be: one with a ``kernel``, where widgets show."""
    monkeypatch.setattr(ip, "kernel", object(), raising=False)
    return ip


def test_watch_without_widget_support_says_so_and_starts_no_thread(ip, capsys):
    import threading

    ip.run_line_magic("gpu", "connect testgpu")
    capsys.readouterr()
    for _ in range(2):  # the second time too: nothing is watching
        ip.run_line_magic("gpu", "status --watch 1")
        out = capsys.readouterr().out
        assert "GPU0 NVIDIA H200 | util 0%" in out
        assert out.endswith("not watching: --watch refreshes a widget, and this front end (no Jupyter "
                            "kernel) cannot show one; run `%gpu status --text` again, or use a notebook\n")
    assert ip._gpumagic.status_watchers == {}
    assert not [t for t in threading.enumerate() if t.name == "gpumagic-status-watch" and t.is_alive()]


def test_watch_keeps_running_through_a_mismatch_and_stops_on_stop(kernel_ip, set_gpu, capsys):
    ip = kernel_ip
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", "status --watch 1")
    watcher = ip._gpumagic.status_watchers["testgpu"]
    view = watcher.on_update.__self__
    assert view.status.kind is StatusKind.OK and "refreshing every 1 s" in view.note_text
    set_gpu("mismatch")
    assert _wait(watcher, lambda: view.status.kind is StatusKind.MISMATCH)
    assert view.rows == [] and "driver/library mismatch" in view.header.value
    set_gpu("h200-load")
    assert _wait(watcher, lambda: view.status.ok and view.rows)
    assert watcher.running and view.rows[0].util.value == 100
    capsys.readouterr()
    ip.run_line_magic("gpu", "status --stop")
    # the watch's last state replaces the widget (a terminal shell prints it), then the line
    assert capsys.readouterr().out.endswith("  python3 (pid 485) 20204 MiB\n"
                                            "stopped (%gpu status --stop)\nstopped watching testgpu\n")
    assert not watcher.running
    assert view.note_text == "stopped (%gpu status --stop)"
    ip.run_line_magic("gpu", "status --stop")
    assert capsys.readouterr().out == "no --watch is running\n"


def test_watch_stops_on_disconnect_saying_so(kernel_ip):
    ip = kernel_ip
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", "status --watch 1")
    watcher = ip._gpumagic.status_watchers["testgpu"]
    view = watcher.on_update.__self__
    ip.run_line_magic("gpu", "disconnect")
    watcher._thread.join(30)
    assert not watcher.running
    assert view.note_text == "stopped: the machine is disconnected"


def test_doctor_expect_a100_on_h200_load_fails_naming_both_in_one_round_trip(machine, set_gpu,
                                                                            monkeypatch):
    set_gpu("h200-load")
    machine.env.login()  # read once per connection by every run()
    opened, cells = _count_channels(machine), _count_runner_cells(monkeypatch)
    report = machine.doctor(expect_gpu="A100")
    assert len(opened) + len(cells) == 1
    checks = {c.name: c for c in report.checks}
    assert checks["GPU model"].level is Level.FAIL
    assert checks["GPU model"].summary == "expected A100, the machine has NVIDIA H200"
    assert checks["driver"].level is Level.OK and "CUDA up to 13.0" in checks["driver"].summary
    assert checks["GPU0 memory"].level is Level.WARN
    # The test server's python3 is this venv's: without torch that is said, not guessed; with
    # the CPU build (installed for the torchrun tests) it is named as CPU-only.
    assert checks["PyTorch CUDA"].level is Level.WARN
    try:
        import torch  # noqa: F401
    except ImportError:
        assert "not importable" in checks["PyTorch CUDA"].summary
    else:
        assert "is a CPU-only build" in checks["PyTorch CUDA"].summary
    assert checks["disks"].level is Level.OK and "largest data disk" in checks["disks"].summary
    assert checks["python"].level is Level.OK
    assert report.worst is Level.FAIL


def test_doctor_on_a_mismatched_driver_fails_the_driver_check(machine, set_gpu):
    set_gpu("mismatch")
    report = machine.doctor(expect_gpu="H200", expect_count=1)
    checks = {c.name: c for c in report.checks}
    assert checks["driver"].level is Level.FAIL and "570.124" in checks["driver"].summary
    assert "reboot" in checks["driver"].fix
    assert checks["GPU model"].level is Level.FAIL


def test_doctor_sample_reads_gpu_utilisation(ip, set_gpu, capsys):
    set_gpu("h200-load")
    ip.run_line_magic("gpu", "connect testgpu")
    capsys.readouterr()
    ip.run_line_magic("gpu", "doctor --expect-gpu H200 --expect-count 1 --sample 1")
    out = capsys.readouterr().out
    assert "0 fail" in out.splitlines()[0]
    assert "ok    GPU model" in out and "NVIDIA H200 (expected H200)" in out
    assert "utilisation" in out and "GPU 100% busy" in out


def test_failed_cell_with_cuda_oom_gets_a_hint_line(ip, capsys):
    ip.run_line_magic("gpu", "connect testgpu")
    cell = "echo 'torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB' >&2; exit 1"
    with pytest.raises(RemoteCommandError) as e:
        ip.run_cell_magic("remote", "", cell)
    assert "halve the batch size" in e.value.hint
    assert e.value._render_traceback_()[-1].startswith("  hint: GPU memory ran out")
    capsys.readouterr()
    ip.run_cell_magic("remote", "--no-raise-error", cell)
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("hint: GPU memory ran out")


def test_oom_killed_cell_exit_137_gets_the_host_ram_hint(ip, capsys):
    ip.run_line_magic("gpu", "connect testgpu")
    with pytest.raises(RemoteCommandError) as e:
        ip.run_cell_magic("remote", "", "python3 -c 'import os, signal; os.kill(os.getpid(), signal.SIGKILL)'")
    assert e.value.exit_code == 137
    assert "Killed" in e.value.stderr
    assert "host RAM" in e.value.hint
    with pytest.raises(RemoteCommandError) as e:  # a python cell killed itself
        ip.run_cell_magic("remote", "--python", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert e.value.exit_code == 137
    assert "host RAM" in e.value.hint


def test_failed_cell_without_known_message_gets_no_hint(ip):
    ip.run_line_magic("gpu", "connect testgpu")
    with pytest.raises(RemoteCommandError) as e:
        ip.run_cell_magic("remote", "", "echo 'ValueError: nope' >&2; exit 3")
    assert e.value.hint == ""


def test_doctor_in_a_vanished_working_directory_says_what_to_do(machine):
    machine.cwd = "/no/such/dir"
    with pytest.raises(RemoteCommandError) as e:
        machine.doctor()
    assert e.value.message == "no directory /no/such/dir on testgpu"
    assert "%gpu cd" in e.value.hint


def test_a_second_watch_replaces_the_first_saying_so(kernel_ip):
    ip = kernel_ip
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", "status --watch 5")
    first = ip._gpumagic.status_watchers["testgpu"]
    first_view = first.on_update.__self__
    ip.run_line_magic("gpu", "status --watch 5")
    second = ip._gpumagic.status_watchers["testgpu"]
    assert second is not first and not first.running and second.running
    assert first_view.note_text == "stopped: a newer `%gpu status --watch` took over"
    ip.run_line_magic("gpu", "status --stop")
    assert not second.running


def test_watch_refreshes_while_cells_run_on_the_same_connection(kernel_ip, capsys):
    ip = kernel_ip
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", "status --watch 1")
    watcher = ip._gpumagic.status_watchers["testgpu"]
    outputs = []
    for i in range(60):  # cells keep running until the thread has refreshed twice
        ip.run_cell_magic("remote", "--out r", f"sleep 0.5; echo cell {i}")
        outputs.append(ip.user_ns["r"].stdout)
        if watcher.refreshes >= 2:
            break
    assert watcher.refreshes >= 2 and watcher.failures == 0
    assert outputs == [f"cell {i}\n" for i in range(len(outputs))]
    ip.run_line_magic("gpu", "status --stop")


@pytest.fixture
def published(ip, monkeypatch):
    """What the shell publishes: (data, transient, update, thread name) per display."""
    import threading

    out = []

    def publish(data, metadata=None, source=None, *, transient=None, update=False, **kw):
        out.append((data, transient or {}, update, threading.current_thread().name))

    monkeypatch.setattr(ip.display_pub, "publish", publish)
    return out


def test_one_shot_status_in_a_kernel_is_static_html_and_text_with_no_widget(kernel_ip, published):
    # issue 17 case 1: a one-shot `%gpu status` needs no widget model.
    kernel_ip.run_line_magic("gpu", "connect testgpu")
    published.clear()
    kernel_ip.run_line_magic("gpu", "status")
    (data, _, _, _), = published
    assert set(data) == {"text/plain", "text/html"}
    assert "<table>" in data["text/html"] and "NVIDIA H200" in data["text/html"]
    assert kernel_ip._gpumagic.status_watchers == {}


def test_a_stopped_watch_is_replaced_by_its_static_state_through_its_display_id(kernel_ip, published):
    # issue 17 case 1: a live widget only while it updates, then its final static state.
    ip = kernel_ip
    ip.run_line_magic("gpu", "connect testgpu")
    published.clear()
    ip.run_line_magic("gpu", "status --watch 1")
    (live, transient, update, _), = published
    widget = "application/vnd.jupyter.widget-view+json"
    assert widget in live and "<table>" in live["text/html"] and "GPU0" in live["text/plain"]
    display_id = transient["display_id"]
    watcher = ip._gpumagic.status_watchers["testgpu"]
    ip.run_line_magic("gpu", "status --stop")
    data, transient, update, thread = published[-1]
    assert update and transient == {"display_id": display_id}
    assert widget not in data and set(data) == {"text/plain", "text/html"}
    assert data["text/plain"].endswith("\nstopped (%gpu status --stop)")
    assert "stopped (%gpu status --stop)" in data["text/html"] and "<table>" in data["text/html"]
    assert thread == "MainThread"  # in the --stop cell, so a saved notebook records it
    assert watcher.reason == "stopped (%gpu status --stop)" and not watcher.running


def test_a_watch_that_ends_by_itself_replaces_itself_once(kernel_ip, published):
    ip = kernel_ip
    ip.run_line_magic("gpu", "connect testgpu")
    published.clear()
    ip.run_line_magic("gpu", "status --watch 1")
    watcher = ip._gpumagic.status_watchers["testgpu"]
    ip.run_line_magic("gpu", "disconnect")
    watcher._thread.join(30)
    watcher.stop()  # after it ended: nothing more is shown
    updates = [p for p in published if p[2]]
    assert len(updates) == 1
    assert updates[0][0]["text/plain"].endswith("\nstopped: the machine is disconnected")
