"""Pure parsers and checks of gpumagic.gpu, on recorded nvidia-smi/df/torch output and on the
hand-written lines of issue 3.  No SSH here (see test_status.py for end to end)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumagic.gpu import doctor, smi, watch
from gpumagic.notebook.display import gpu_line, render_doctor, render_status, status_text
from gpumagic.errors import ConnectionLost
from gpumagic.gpu.doctor import Level
from gpumagic.gpu.smi import Section, StatusKind, known
from gpumagic.remote import program

ROOT = Path(__file__).resolve().parents[1]
PACKAGED = ROOT / "gpumagic" / "gpu" / "fake" / "recordings"
FAKE = ROOT / "gpumagic" / "gpu" / "fake" / "nvidia_smi.py"
SHARED = ROOT.parent / "shared" / "fixtures"
#: The same recordings: packaged copies and, when this checkout sits beside it, ../shared.
NVSMI_DIRS = [PACKAGED] + ([SHARED / "nvidia-smi"] if (SHARED / "nvidia-smi").is_dir() else [])
HOST_DIRS = [PACKAGED / "host"] + ([SHARED / "host"] if (SHARED / "host").is_dir() else [])

#: The ``$Q`` the recordings were made with (recordings/README.md).
RECORDED_Q = ("index,uuid,name,driver_version,pci.bus_id,memory.total,memory.used,memory.free,"
              "utilization.gpu,utilization.memory,temperature.gpu,power.draw,power.limit,"
              "clocks.sm,clocks.max.sm,pstate,compute_mode,mig.mode.current,fan.speed,"
              "persistence_mode").split(",")


def read(d: Path, *parts: str) -> str:
    return d.joinpath(*parts).read_text(encoding="utf-8")


def sections_for(d: Path, recording: str) -> dict[str, Section]:
    """What the status/doctor script would gather on the recorded machine."""
    rec = d / recording
    apps = rec / "query-compute-apps-noheader-nounits.csv"
    return {
        "gpus": Section(read(rec, "query-gpu-noheader-nounits.csv"), 0),
        "apps": Section(apps.read_text(encoding="utf-8") if apps.exists() else "", 0),
        "version": Section(read(d / "h200-idle", "nvidia-smi-version.txt"), 0),
    }


# -- issue case 1: bracketed values ---------------------------------------------------------

CASE1_FIELDS = "memory.total,memory.free,memory.used,temperature.gpu,fan.speed,utilization.gpu,utilization.memory".split(",")
CASE1 = ("2004, 2004, 0, 44, [N/A], 0, 0\n"
         "2004, 2004, 0, 44, [Not Supported], 0, 0\n"
         "2004, 2004, 0, 44, [Unknown Error], 0, 0\n")


def test_fan_unknown_with_its_reason_and_every_other_value_read():
    gpus = smi.parse_gpus(CASE1, CASE1_FIELDS)
    assert len(gpus) == 3
    reasons = [g.fan_pct.reason for g in gpus]
    assert reasons == ["not available on this GPU", "not supported on this GPU",
                       "nvidia-smi reported an unknown error"]
    for g in gpus:
        assert not known(g.fan_pct)
        assert (g.memory_total_mib, g.memory_free_mib, g.memory_used_mib) == (2004, 2004, 0)
        assert (g.temperature_c, g.utilization_gpu_pct, g.utilization_memory_pct) == (44, 0, 0)
        assert g.power_draw_w == smi.NOT_QUERIED  # not asked for: unknown, not an error


def test_permission_and_lost_gpu_values_become_unknown_with_reason():
    line = "0, [Insufficient Permissions], [GPU is lost], 12 %"
    g, = smi.parse_gpus(line, ["index", "power.draw", "temperature.gpu", "utilization.gpu"])
    assert g.index == 0 and g.utilization_gpu_pct == 12
    assert g.power_draw_w.reason == "insufficient permissions to read it"
    assert "reboot" in g.temperature_c.reason
    assert str(g.temperature_c) == "unknown"


# -- issue case 2: several GPUs, a vGPU/MIG-style name, clock unknown ---------------------------


def test_two_gpus_in_order_second_with_clock_unknown():
    text = "2100, 49140, NVIDIA RTX A6000\n[N/A], 24576, NVIDIA H100L-2-24C\n"
    a, b = smi.parse_gpus(text, ["clocks.max.sm", "memory.total", "name"])
    assert (a.clock_max_sm_mhz, a.memory_total_mib, a.name) == (2100, 49140, "NVIDIA RTX A6000")
    assert (b.memory_total_mib, b.name) == (24576, "NVIDIA H100L-2-24C")
    assert not known(b.clock_max_sm_mhz) and b.clock_max_sm_mhz.reason == "not available on this GPU"


def test_mig_enabled_gpu_parsed_with_its_mode():
    text = "0, NVIDIA A100-SXM4-80GB, 81920, 0, Enabled\n1, NVIDIA A100-SXM4-80GB, 81920, 0, Disabled\n"
    gpus = smi.parse_gpus(text, ["index", "name", "memory.total", "memory.used", "mig.mode.current"])
    assert [(g.index, g.mig_mode) for g in gpus] == [(0, "Enabled"), (1, "Disabled")]


def test_line_with_wrong_number_of_values_is_reported_not_guessed():
    rows, bad = smi.parse_csv("0, NVIDIA H200, 143771\n1, NVIDIA H200\n", ["index", "name", "memory.total"],
                              smi._GPU_MAP)
    assert len(rows) == 1 and bad == ["1, NVIDIA H200"]
    status = smi.status_from_sections({"gpus": Section("garbage line\n", 0)}, host="h")
    assert status.kind is StatusKind.FAILED and "garbage line" in status.message


def test_process_name_containing_comma_space_kept_whole():
    procs = smi.parse_processes("77, /opt/my, app/bin/python, 1024, GPU-abc\n")
    assert [(p.pid, p.name, p.used_mib, p.gpu_uuid) for p in procs] == [
        (77, "/opt/my, app/bin/python", 1024, "GPU-abc")]


# -- recordings ---------------------------------------------------------------------------------


@pytest.mark.parametrize("d", NVSMI_DIRS, ids=lambda d: d.parent.name)
def test_recorded_values_with_and_without_units_read_the_same(d):
    nounits, = smi.parse_gpus(read(d, "h200-idle", "query-gpu-noheader-nounits.csv"), RECORDED_Q)
    units, = smi.parse_gpus(read(d, "h200-idle", "query-gpu.csv"), RECORDED_Q)  # header skipped
    for g in (nounits, units):
        assert (g.index, g.name, g.memory_total_mib, g.memory_used_mib, g.memory_free_mib) == (
            0, "NVIDIA H200", 143771, 0, 143156)
        assert (g.clock_max_sm_mhz, g.pstate, g.mig_mode, g.power_limit_w) == (1980, "P0", "Disabled", 700.0)
        assert g.fan_pct.raw == "[N/A]"
    assert units.power_draw_w == 127.87 and nounits.power_draw_w == 127.85  # two samples


@pytest.mark.parametrize("d", NVSMI_DIRS, ids=lambda d: d.parent.name)
def test_h200_load_recording_util_memory_and_one_process(d):
    status = smi.status_from_sections(sections_for(d, "h200-load"), host="h200", fields=RECORDED_Q)
    assert status.kind is StatusKind.OK
    g, = status.gpus
    assert g.utilization_gpu_pct == 100
    assert (g.memory_used_mib, g.memory_total_mib) == (20213, 143771)
    p, = status.processes
    assert (p.pid, p.name, p.used_mib) == (485, "python3", 20204)
    assert status.processes_on(g) == [p]
    assert (status.driver_version, status.cuda_version) == ("580.159.04", "13.0")
    assert status.hidden_use_mib(g) == 0
    assert gpu_line(g) == "GPU0 NVIDIA H200 | util 100% | mem 20213/143771 MiB | 58C | 691/700 W"


@pytest.mark.parametrize("d", NVSMI_DIRS, ids=lambda d: d.parent.name)
def test_cuda_version_from_version_output_and_from_banner(d):
    assert smi.parse_cuda_version(read(d, "h200-idle", "nvidia-smi-version.txt")) == "13.0"
    assert smi.parse_cuda_version(read(d, "h200-load", "nvidia-smi.txt")) == "13.0"
    assert not known(smi.parse_cuda_version("NVIDIA-SMI has failed"))


def test_memory_in_use_without_visible_process_is_said_not_no_processes():
    load = sections_for(PACKAGED, "h200-load")
    hidden = smi.status_from_sections({**load, "apps": Section("", 0)}, host="h", fields=RECORDED_Q)
    text = status_text(hidden)
    assert "20213 MiB in use by processes not visible here" in text
    assert "no processes" not in text
    idle = smi.status_from_sections(sections_for(PACKAGED, "h200-idle"), host="h", fields=RECORDED_Q)
    assert status_text(idle).splitlines()[-1] == "  no processes"


# -- issue case 3 and other whole-call failures -----------------------------------------------

MISMATCH = ("Failed to initialize NVML: Driver/library version mismatch\n"
            "NVML library version: 570.124\n")


def test_driver_library_mismatch_becomes_a_status_kind_with_library_version():
    status = smi.status_from_sections({"gpus": Section(MISMATCH, 18), "apps": Section(MISMATCH, 18)},
                                      host="h")
    assert status.kind is StatusKind.MISMATCH and status.kind.value == "driver/library mismatch"
    assert status.library_version == "570.124"
    assert "reboot" in status.hint
    assert status.gpus == [] and not status.ok
    assert "driver/library mismatch" in render_status(status).text


@pytest.mark.parametrize("text, rc, kind", [
    ("sh: 1: nvidia-smi: not found\n", 127, StatusKind.NO_NVIDIA_SMI),
    ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure "
     "that the latest NVIDIA driver is installed and running.\n\n", 9, StatusKind.NO_DRIVER),
    ("No devices were found\n", 6, StatusKind.FAILED),
    ("", 124, StatusKind.HUNG),  # `timeout 20 nvidia-smi` stopped it
])
def test_whole_call_failures_become_kinds_with_hints(text, rc, kind):
    status = smi.status_from_sections({"gpus": Section(text, rc)})
    assert status.kind is kind
    assert status.hint and status.message


# -- sections ----------------------------------------------------------------------------------


def gather_here(sections, *, path: str = "", env: dict | None = None, smi_seconds: int | None = None,
                login_path: str = "") -> str:
    """Run gpu-sections.sh here under /bin/sh (the machine's kind of shell) and return what it
    printed; ``path`` replaces PATH (``""`` keeps it)."""
    env = {**os.environ, **(env or {})}
    if path:
        env["PATH"] = path
    if smi_seconds is None:
        command = smi.sections_command(sections, login_path)
    else:
        command = program.command(smi.SECTIONS_PROGRAM, smi_seconds, login_path, *sections)
    return subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, env=env,
                          timeout=60, encoding="utf-8").stdout


def bin_dir(tmp_path, **scripts: str) -> Path:
    """A folder of executable /bin/sh scripts ``{name: body}``."""
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    for name, body in scripts.items():
        f = d / name.replace("_", "-")
        f.write_text("#!/bin/sh\n" + body, encoding="utf-8")
        f.chmod(0o755)
    return d


def test_sections_keep_output_and_status_of_each_command(tmp_path):
    # Only this folder on the login PATH: an nvidia-smi that fails (3) after printing on
    # both streams, except for --version (no newline at the end); no python3, no timeout.
    d = bin_dir(tmp_path, nvidia_smi='case "$1" in --version) printf x ;; '
                                     '*) echo out; echo err >&2; exit 3 ;; esac\n')
    out = gather_here(["gpus=index", "version", "torch=print(1)", "nope"], login_path=str(d))
    s = smi.split_sections(out)
    assert s["gpus"] == Section("out\nerr\n", 3)
    assert s["version"] == Section("x", 0)
    assert s["torch"].missing
    assert s["nope"] == Section("gpu-sections.sh: no section named 'nope'\n", 2)
    cut = smi.split_sections(out[: out.index("\x1egpumagic-rc version")])
    assert cut["version"].rc == -1


def test_missing_nvidia_smi_is_status_127_and_no_nvidia_smi(tmp_path):
    d = bin_dir(tmp_path)  # empty: nvidia-smi is not on PATH
    found = subprocess.run(["/bin/sh", "-c", program.source("lib.sh") + "\ngm_find nvidia-smi"],
                           env={**os.environ, "PATH": str(d)}, capture_output=True, text=True, encoding="utf-8")
    if found.returncode == 0:
        pytest.skip(f"this computer has an nvidia-smi off PATH: {found.stdout.strip()}")
    secs = smi.split_sections(gather_here(smi.status_sections(), login_path=str(d)))
    assert secs["gpus"].rc == 127
    assert smi.status_from_sections(secs).kind is StatusKind.NO_NVIDIA_SMI


def test_a_hung_nvidia_smi_is_stopped_after_the_given_seconds_with_status_124(tmp_path):
    if shutil.which("timeout") is None:
        pytest.skip("no coreutils timeout here")
    d = bin_dir(tmp_path, nvidia_smi="sleep 30\n")
    start = time.monotonic()
    out = gather_here(["gpus=index"], path=f"{d}:{os.environ['PATH']}", smi_seconds=1)
    assert time.monotonic() - start < 20
    secs = smi.split_sections(out)
    assert secs["gpus"].rc == 124
    assert smi.status_from_sections(secs).kind is StatusKind.HUNG


def test_the_program_gathers_what_the_recorded_doctor_script_gathered(tmp_path):
    """tests/recordings/h200-sections/doctor-sample3.sh is the script `%gpu doctor --sample 3`
    sent when the H200 recordings were made (Python text then); gpu-sections.sh, run here
    beside it with the fake nvidia-smi replaying h200-load, prints the same sections."""
    state = tmp_path / "state"
    state.write_text("h200-load", encoding="utf-8")
    d = bin_dir(tmp_path, nvidia_smi=f'exec {sys.executable} {FAKE} "$@"\n')
    env = {**os.environ, "PATH": f"{d}:{os.environ['PATH']}", "GPUMAGIC_FAKE_GPU_STATE": str(state)}
    old = subprocess.Popen(["/bin/sh", str(LIVE / "doctor-sample3.sh")], stdout=subprocess.PIPE,
                           text=True, env=env, cwd=tmp_path, encoding="utf-8")
    new = subprocess.Popen(["/bin/sh", "-c", smi.sections_command(doctor.doctor_sections(sample=3))],
                           stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path, encoding="utf-8")
    was, now = (smi.split_sections(p.communicate(timeout=60)[0]) for p in (old, new))
    assert list(now) == list(was) == ["gpus", "apps", "version", "torch", "env", "cwd", "df", "sample"]
    for name in was:
        assert now[name].rc == was[name].rc == 0, name
        if name in ("df", "sample"):  # disk use and CPU time move between the two runs
            assert re.sub(r"\d+", "N", now[name].text) == re.sub(r"\d+", "N", was[name].text), name
        else:
            assert now[name].text == was[name].text, name
    assert doctor.parse_sample(now["sample"].text).gpu_mean_pct == 100
    assert [m.mountpoint for m in doctor.parse_df(now["df"].text)] == [
        m.mountpoint for m in doctor.parse_df(was["df"].text)]
    assert smi.parse_gpus(now["gpus"].text)[0].memory_used_mib == 20213


# -- issue case 4: doctor on the load recording, --expect-gpu A100 ------------------------------


def test_doctor_expect_a100_on_h200_fails_naming_both_models():
    report = doctor.diagnose(sections_for(PACKAGED, "h200-load"), host="h", expect_gpu="A100",
                           fields=RECORDED_Q)
    model = next(c for c in report.checks if c.name == "GPU model")
    assert model.level is Level.FAIL
    assert "A100" in model.summary and "NVIDIA H200" in model.summary
    assert report.worst is Level.FAIL
    mem = next(c for c in report.checks if c.name == "GPU0 memory")
    assert mem.level is Level.WARN and "python3 (pid 485, 20204 MiB)" in mem.summary
    assert "FAIL  GPU model" in render_doctor(report).text


def test_doctor_expect_matching_model_and_count():
    status = smi.status_from_sections(sections_for(PACKAGED, "h200-idle"), fields=RECORDED_Q)
    checks = doctor.check_gpu_model(status, "h200", expect_count=2)
    assert [(c.name, c.level) for c in checks] == [("GPU model", Level.OK), ("GPU count", Level.FAIL)]
    assert "expected 2 GPU(s), nvidia-smi lists 1" in checks[1].summary


# -- issue case 5: torch CUDA build against the driver -----------------------------------------


def test_torch_cuda_13_on_driver_12_2_fails_with_the_fix():
    c = doctor.check_torch_cuda("3.12.3 (main)\n2.11.0+cu130 13.0\n", "12.2")
    assert c.level is Level.FAIL
    assert "CUDA driver version is insufficient" in c.summary
    assert c.fix == ("install the build for CUDA <= 12.2: pip install torch --index-url "
                     "https://download.pytorch.org/whl/cu121")


def test_torch_cuda_12_1_on_driver_13_0_is_ok():
    c = doctor.check_torch_cuda("3.10.12\n2.5.1+cu121 12.1\n", "13.0")
    assert c.level is Level.OK and "CUDA 12.1" in c.summary


def test_torch_newer_minor_same_major_is_a_warning():
    c = doctor.check_torch_cuda("3.10.12\n2.6.0+cu124 12.4\n", "12.2")
    assert c.level is Level.WARN and "minor-version compatibility" in c.summary


@pytest.mark.parametrize("d", HOST_DIRS, ids=lambda d: d.parent.name)
def test_recorded_torch_version_against_recorded_driver_is_ok(d):
    text = read(d, "h200-ubuntu2404", "torch-version.txt")
    info = doctor.parse_torch_probe(text)
    assert (info["python"], info["torch"], info["cuda"]) == ("3.12.3", "2.11.0+cu130", "13.0")
    assert doctor.check_torch_cuda(text, "13.0").level is Level.OK


def test_torch_missing_or_cpu_only_is_a_warning():
    missing = doctor.check_torch_cuda("3.11.7\nno-torch ModuleNotFoundError: No module named 'torch'\n", "13.0")
    assert missing.level is Level.WARN and "No module named 'torch'" in missing.summary
    cpu = doctor.check_torch_cuda("3.11.7\n2.5.1+cpu None\n", "13.0")
    assert cpu.level is Level.WARN and "CPU-only" in cpu.summary and "cu130" in cpu.fix


# -- issue case 6: disks -------------------------------------------------------------------------


@pytest.mark.parametrize("d", HOST_DIRS, ids=lambda d: d.parent.name)
def test_recorded_df_single_root_disk(d):
    mounts = doctor.parse_df(read(d, "h200-ubuntu2404", "df-PB1.txt"))
    assert [(m.mountpoint, m.size) for m in mounts] == [("/dev/shm", 137438953472), ("/", 270553174016)]
    assert [m.mountpoint for m in doctor.data_mounts(mounts)] == ["/"]
    checks = doctor.check_disks(read(d, "h200-ubuntu2404", "df-PB1.txt"), "/root")
    assert [(c.name, c.level) for c in checks] == [("disks", Level.OK), ("working directory", Level.OK)]
    assert "/ 69 GB free of 271 GB; largest data disk: /" == checks[0].summary


AUTODL_DF = """\
Filesystem                1-blocks         Used    Available Capacity Mounted on
overlay                30000000000  12000000000  18000000000      40% /
tmpfs                     67108864            0     67108864       0% /dev
shm                     2147483648            0   2147483648       0% /dev/shm
/dev/md0              500000000000 100000000000 400000000000      20% /root/autodl-tmp
"""


def test_small_system_disk_holding_cwd_warns_naming_the_data_disk():
    checks = doctor.check_disks(AUTODL_DF, "/root")
    assert "largest data disk: /root/autodl-tmp" in checks[0].summary
    cwd = next(c for c in checks if c.name == "working directory")
    assert cwd.level is Level.WARN
    assert cwd.summary == ("/root is on / (30 GB), a small system disk; "
                           "the data disk is /root/autodl-tmp (500 GB)")
    assert cwd.fix.startswith("`%gpu cd /root/autodl-tmp`")
    ok = next(c for c in doctor.check_disks(AUTODL_DF, "/root/autodl-tmp/run1") if c.name == "working directory")
    assert ok.level is Level.OK


def test_disk_over_90_percent_full_warns():
    df = ("Filesystem 1024-blocks Used Available Capacity Mounted on\n"
          "/dev/vda1 104857600 99614720 5242880 95% /\n")
    mounts = doctor.parse_df(df)
    assert mounts[0].size == 104857600 * 1024  # 1024-byte blocks read as such
    full = [c for c in doctor.check_disks(df, "/root") if c.name == "disk /"]
    assert len(full) == 1 and full[0].level is Level.WARN and "95% full" in full[0].summary


# -- python, env, tools --------------------------------------------------------------------------


def test_python_env_and_tools_checks():
    probe = "3.12.3 (main)\nenv\tconda\t/opt/conda\n2.11.0+cu130 13.0\n"
    env = "VIRTUAL_ENV=\nCONDA_DEFAULT_ENV=base\npython3=/opt/conda/bin/python3\ntmux=/usr/bin/tmux\nrsync=\n"
    checks = {c.name: c for c in doctor.check_python_env(probe, env)}
    assert checks["python"].level is Level.OK and "3.12.3" in checks["python"].summary
    assert checks["environment"].summary == "conda env base"
    assert checks["tmux"].level is Level.OK
    assert checks["rsync"].level is Level.WARN and checks["rsync"].fix == "apt-get install -y rsync"
    none = {c.name: c for c in doctor.check_python_env("3.8.10\nenv\tsystem\t/usr\n", "")}
    assert none["python"].level is Level.WARN and none["environment"].level is Level.WARN


# -- --sample ----------------------------------------------------------------------------------

STAT0 = "cpu  200 0 100 1700 0 0 0 0 0 0\ncpu0 100 0 50 850 0 0 0 0 0 0\ncpu1 100 0 50 850 0 0 0 0 0 0\n"
#: cpu0: +190 busy of +200 (95 %); cpu1: +10 of +200.
STAT1 = "cpu  390 0 110 1900 0 0 0 0 0 0\ncpu0 280 0 60 860 0 0 0 0 0 0\ncpu1 110 0 50 1040 0 0 0 0 0 0\n"


def test_gpu_idle_while_a_core_is_busy_says_waiting_for_data_loading():
    sample = doctor.parse_sample(f"{STAT0}--gpu\n5\n0\n10\n--end\n{STAT1}")
    assert sample.gpu_mean_pct == 5 and sample.cores == 2
    assert sample.busiest_core_pct == pytest.approx(95.0) and sample.cpu_pct == pytest.approx(50.0)
    c = doctor.check_sample(sample, 3)
    assert c.level is Level.WARN and "waiting for data loading" in c.summary
    assert "DataLoader workers" in c.fix


def test_gpu_busy_sample_is_ok():
    c = doctor.check_sample(doctor.parse_sample(f"{STAT0}--gpu\n100\n98\n--end\n{STAT1}"), 2)
    assert c.level is Level.OK and "GPU 99% busy" in c.summary


# -- failure hints for %%remote ------------------------------------------------------------------


@pytest.mark.parametrize("stderr, code, expect", [
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", 1, "halve the batch size"),
    ("RuntimeError: CUDA driver version is insufficient for CUDA runtime version", 1, "%gpu doctor"),
    ("OSError: [Errno 28] No space left on device: '/root/ckpt.pt'", 1, "the disk holding /root/ckpt.pt is full"),
    ("bash: line 1:  4242 Killed                  python3 train.py", 137, "host RAM"),
])
def test_failure_hint_for_known_messages(stderr, code, expect):
    assert expect in doctor.failure_hint("Traceback ...\n" + stderr + "\n", code)


# The exact wordings, as the projects' own sources print them (PyTorch c10/cuda/CUDAFunctions.cpp,
# torch/cuda/__init__.py, cudart's cudaGetErrorString, NCCL's ncclGetErrorString, nvidia-smi).
TORCH_OLD_DRIVER = (
    "RuntimeError: The NVIDIA driver on your system is too old (found version {v}). Please update your "
    "GPU driver by downloading and installing a new version from the URL: "
    "http://www.nvidia.com/Download/index.aspx Alternatively, go to: https://pytorch.org to install a "
    "PyTorch version that has been compiled with your version of the CUDA driver.")
TORCH_NO_KERNEL = (
    "/usr/local/lib/python3.10/dist-packages/torch/cuda/__init__.py:235: UserWarning: \n"
    "NVIDIA GeForce RTX 5090 with CUDA capability sm_120 is not compatible with the current PyTorch installation.\n"
    "The current PyTorch install supports CUDA capabilities sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90.\n"
    "If you want to use the NVIDIA GeForce RTX 5090 GPU with PyTorch, please check the instructions at "
    "https://pytorch.org/get-started/locally/\n\n  warnings.warn(\n"
    "Traceback (most recent call last):\n  File \"<stdin>\", line 1, in <module>\n"
    "RuntimeError: CUDA error: no kernel image is available for execution on the device\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
    "might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n")
TORCH_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
    "139.81 GiB of which 1.23 GiB is free. Including non-PyTorch memory, this process has 138.57 GiB memory "
    "in use. Of the allocated memory 137.10 GiB is allocated by PyTorch, and 682.00 MiB is reserved by "
    "PyTorch but unallocated.")
NCCL_SYSTEM = (
    "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, "
    "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n"
    "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error. \n"
    "Last error:\n")
NVML_MISMATCH = "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 535.183\n"


def test_pytorch_old_driver_message_names_the_drivers_cuda_version():
    hint = doctor.failure_hint(TORCH_OLD_DRIVER.format(v=11040), 1)
    assert hint is not None and "supports CUDA up to 11.4 (found version 11040)" in hint
    assert "rent a machine with a newer driver" in hint  # no current PyTorch build runs on CUDA 11.4
    hint = doctor.failure_hint(TORCH_OLD_DRIVER.format(v=12080), 1)
    assert "CUDA up to 12.8" in hint and "https://download.pytorch.org/whl/cu128" in hint


@pytest.mark.parametrize("v, text", [(11040, "11.4"), (12080, "12.8"), (12060, "12.6"), (13000, "13.0"),
                                     (9020, "9.2")])
def test_cuda_driver_version_number_decodes(v, text):
    assert doctor.cuda_version_text(v) == text


def test_missing_kernel_image_names_the_card_and_its_architecture():
    hint = doctor.failure_hint(TORCH_NO_KERNEL, 1)
    assert hint.startswith("this PyTorch build has no kernels for the NVIDIA GeForce RTX 5090's sm_120 "
                           "(it has sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90)")
    assert "torch.cuda.get_arch_list() includes sm_120" in hint
    # Without the warning (an extension's kernel, or the warning went to another stream)
    hint = doctor.failure_hint("RuntimeError: CUDA error: no kernel image is available for execution on "
                               "the device\n", 1)
    assert "TORCH_CUDA_ARCH_LIST" in hint


@pytest.mark.parametrize("stderr, expect", [
    (TORCH_OOM, "GPU memory ran out: halve the batch size"),
    ("RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported", "GPU memory ran out"),
    ("RuntimeError: CUDA error: CUDA driver version is insufficient for CUDA runtime version",
     "built for a newer CUDA than the driver supports"),
    (NCCL_SYSTEM, "rerun with NCCL_DEBUG=INFO"),
    (NVML_MISMATCH, "reboot the machine"),
    ("AssertionError: Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU and "
     "installed a driver from http://www.nvidia.com/Download/index.aspx", "found no NVIDIA driver"),
])
def test_cuda_and_driver_messages_get_their_hint(stderr, expect):
    hint = doctor.failure_hint("Traceback (most recent call last):\n" + stderr + "\n", 1)
    assert hint is not None and expect in hint


def test_python_cell_killed_silently_with_137_gets_the_host_ram_hint():
    assert "OOM killer" in doctor.failure_hint("", 137)  # a killed python3 -c prints nothing


def test_no_failure_hint_for_other_errors():
    assert doctor.failure_hint("ValueError: bad\n", 1) is None
    assert doctor.failure_hint("Killed\n", 1) is None  # "Killed" needs exit 137
    assert doctor.failure_hint("", 2) is None


# -- watch loop (a plain thread; fetch functions stand in for the machine) ---------------------


def _watch(fetch, **kw):
    updates, stops = [], []
    w = watch.Watcher(fetch, updates.append, stops.append, interval=0.01, **kw).start()
    return w, updates, stops


def test_watch_stops_after_repeated_failures_saying_so():
    def fetch(prev):
        raise ConnectionLost("lost the connection", "reconnect")

    w, updates, stops = _watch(fetch, max_failures=3)
    w._thread.join(10)
    assert not w.running and updates == []
    assert stops == ["stopped after 3 failed refreshes in a row (lost the connection)"]


def test_watch_stops_when_disconnected_and_on_stop():
    ok = smi.status_from_sections(sections_for(PACKAGED, "h200-idle"), fields=RECORDED_Q)
    w, updates, stops = _watch(lambda prev: ok, is_connected=lambda: False)
    w._thread.join(10)
    assert stops == ["stopped: the machine is disconnected"] and updates == []
    w2, updates2, stops2 = _watch(lambda prev: ok)
    while not updates2:
        w2._thread.join(0.01)
    w2.stop()
    assert not w2.running and stops2 == ["stopped (%gpu status --stop)"]


def test_watch_keeps_running_through_a_mismatch_status():
    bad = smi.status_from_sections({"gpus": Section(MISMATCH, 18)})
    w, updates, stops = _watch(lambda prev: bad)
    while len(updates) < 3:
        w._thread.join(0.01)
    assert w.running and updates[0].kind is StatusKind.MISMATCH
    w.stop()


# -- widgets ---------------------------------------------------------------------------------


def test_status_widget_values_and_plain_text_form():
    from gpumagic.notebook import display, widgets

    load = smi.status_from_sections(sections_for(PACKAGED, "h200-load"), host="h", fields=RECORDED_Q)
    view = widgets.status_widget(load)
    row, = view.rows
    assert row.mem.value == pytest.approx(100 * 20213 / 143771)
    assert row.util.value == 100 and row.mem_label.value == "20213/143771 MiB"
    assert "python3 (pid 485) 20204 MiB" in row.procs.value
    bundle = view._repr_mimebundle_()
    assert bundle["text/plain"] == status_text(load)
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/html"] == display.status_html(load)  # the fallback without a model
    bad = smi.status_from_sections({"gpus": Section(MISMATCH, 18)}, host="h")
    view.update(bad)
    assert view.rows == [] and "driver/library mismatch" in view.header.value
    view.update(load)
    assert len(view.rows) == 1 and view.rows[0].util.value == 100


# -- sections gathered on a real H200 by the doctor's own script (tests/recordings) -------------

LIVE = ROOT / "tests" / "recordings" / "h200-sections"


def test_live_idle_h200_doctor_sections():
    secs = smi.split_sections(read(LIVE, "idle.txt"))
    assert sorted(secs) == ["apps", "cwd", "df", "env", "gpus", "sample", "torch", "version"]
    assert all(s.rc == 0 for s in secs.values())
    report = doctor.diagnose(secs, host="h200", expect_gpu="H200", expect_count=1, sample=3)
    g, = report.status.gpus
    assert (g.name, g.memory_used_mib, g.memory_total_mib, g.clock_sm_mhz, g.mig_mode) == (
        "NVIDIA H200", 0, 143771, 345, "Disabled")
    assert g.fan_pct.raw == "[N/A]" and report.status.processes == []
    checks = {c.name: c for c in report.checks}
    assert checks["PyTorch CUDA"].level is Level.OK
    assert checks["PyTorch CUDA"].summary == ("torch 2.11.0+cu130 built for CUDA 13.0, "
                                              "driver supports up to 13.0")
    assert checks["environment"].summary == "venv /opt/torch/.venv"
    assert checks["rsync"].level is Level.WARN and checks["tmux"].level is Level.OK
    assert [m.mountpoint for m in doctor.data_mounts(doctor.parse_df(secs["df"].text))] == ["/"]
    assert checks["utilisation"].level is Level.WARN and "mostly idle" in checks["utilisation"].summary
    assert "data loading" not in checks["utilisation"].summary  # CPUs were idle too


def test_live_loaded_h200_status_process_and_sample():
    secs = smi.split_sections(read(LIVE, "load.txt"))
    report = doctor.diagnose(secs, host="h200", expect_gpu="A100", sample=3)
    g, = report.status.gpus
    assert (g.utilization_gpu_pct, g.memory_used_mib, g.power_draw_w) == (95, 11251, 694.05)
    p, = report.status.processes
    assert (p.pid, p.name, p.used_mib) == (529, "python3", 11242)
    checks = {c.name: c for c in report.checks}
    assert checks["GPU model"].summary == "expected A100, the machine has NVIDIA H200"
    sample = doctor.parse_sample(secs["sample"].text)
    assert sample.gpu_mean_pct == 95 and sample.cores == 16
    assert sample.busiest_core_pct > 90  # the matmul loop's thread, spinning on synchronize()
    assert checks["utilisation"].level is Level.OK


def test_live_cuda_oom_message_gets_the_oom_hint():
    hint = doctor.failure_hint(read(LIVE, "oom.txt"), 1)
    assert hint.startswith("GPU memory ran out: halve the batch size")


def test_processes_are_matched_to_their_gpu_by_uuid_on_a_two_gpu_machine():
    gpus = "0, GPU-aaa, NVIDIA A100-SXM4-80GB, 81920, 600\n1, GPU-bbb, NVIDIA A100-SXM4-80GB, 81920, 40000\n"
    apps = "900, python3, 39990, GPU-bbb\n"
    status = smi.status_from_sections({"gpus": Section(gpus, 0), "apps": Section(apps, 0)},
                                      fields=["index", "uuid", "name", "memory.total", "memory.used"])
    g0, g1 = status.gpus
    assert status.processes_on(g0) == [] and [p.pid for p in status.processes_on(g1)] == [900]
    assert status.hidden_use_mib(g0) == 600 and status.hidden_use_mib(g1) == 0
    text = status_text(status)
    assert "600 MiB in use by processes not visible here" in text and "python3 (pid 900) 39990 MiB" in text


# -- issue 7: rows printed beside a non-zero exit status ------------------------------------



def fake_sections(tmp_path, mode: str) -> dict[str, Section]:
    """What gpu-sections.sh gathers for a status (``gpus``, ``apps``) here, with the fake
    nvidia-smi replaying ``mode`` first on PATH."""
    state = tmp_path / "state"
    state.write_text(mode, encoding="utf-8")
    d = bin_dir(tmp_path, nvidia_smi=f'exec {sys.executable} {FAKE} "$@"\n')
    return smi.split_sections(gather_here(smi.status_sections(with_version=False),
                                          path=f"{d}:{os.environ['PATH']}",
                                          env={"GPUMAGIC_FAKE_GPU_STATE": str(state)}))


def test_exit_14_with_valid_rows_lists_the_gpu_and_warns_what_the_code_means(tmp_path):
    sections = fake_sections(tmp_path, "inforom")
    assert sections["gpus"].rc == 14 and sections["gpus"].text.startswith("WARNING: infoROM is corrupted")
    status = smi.status_from_sections(sections, host="h")
    assert status.kind is StatusKind.OK
    assert [(g.index, g.name, g.memory_total_mib) for g in status.gpus] == [(0, "NVIDIA H200", 143771)]
    assert status.skipped == []
    assert status.warnings[0].startswith("nvidia-smi exited with status 14 (the infoROM is corrupted) "
                                         "while listing 1 GPU(s); the GPU still works")
    assert "nvidia-smi: WARNING: infoROM is corrupted at gpu 00000000:00:06.0" in status.warnings
    text = render_status(status).text
    assert "warning: nvidia-smi exited with status 14 (the infoROM is corrupted)" in text
    assert "GPU0 NVIDIA H200" in text and "nvidia-smi failed" not in text
    assert "warning: nvidia-smi exited with status 14" in render_status(status).html


def test_one_lost_gpu_among_four_leaves_the_other_three_listed(tmp_path):
    status = smi.status_from_sections(fake_sections(tmp_path, "lost-gpu"), host="h")
    assert status.kind is StatusKind.OK
    assert [g.index for g in status.gpus] == [0, 1, 3]
    assert status.warnings == [
        "nvidia-smi exited with status 15 (the GPU has fallen off the bus or has otherwise become "
        "inaccessible) while listing 3 GPU(s); a GPU is inaccessible: reboot the machine; if it "
        "stays lost, ask the platform for another machine",
        "nvidia-smi: Unable to determine the device handle for GPU0000:00:08.0: Unknown Error"]
    assert status.skipped == []  # the message is a warning, not an unreadable line


def test_lost_gpu_row_with_bracketed_values_is_listed_and_named(tmp_path):
    status = smi.status_from_sections(fake_sections(tmp_path, "lost-gpu-fields:h200-load"), host="h")
    assert [g.index for g in status.gpus] == [0, 1, 2, 3]
    lost = status.gpus[2]
    assert not known(lost.memory_used_mib) and "reboot" in lost.memory_used_mib.reason
    assert status.gpus[3].memory_used_mib == 20213
    assert status.warnings == ["GPU2: nvidia-smi cannot read it ([GPU is lost]): reboot the machine; "
                               "if it stays so, ask the platform for another machine"]
    assert "GPU2 (name unknown) | util n/a" in status_text(status)


def test_doctor_warns_on_exit_14_instead_of_failing_the_driver(tmp_path):
    report = doctor.diagnose({**fake_sections(tmp_path, "inforom"),
                           "version": Section(read(PACKAGED / "h200-idle", "nvidia-smi-version.txt"), 0)},
                          host="h", expect_gpu="H200", expect_count=1)
    driver = next(c for c in report.checks if c.name == "driver")
    assert driver.level is Level.WARN
    assert driver.summary.startswith("driver 580.159.04, supports CUDA up to 13.0; but nvidia-smi exited "
                                     "with status 14 (the infoROM is corrupted)")
    assert "replace the card" in driver.fix
    assert [c.level for c in report.checks if c.name in ("GPU model", "GPU count")] == [Level.OK, Level.OK]


@pytest.mark.parametrize("rc, meaning", [
    (0, "success"), (2, "a supplied argument or flag is invalid"),
    (3, "the requested operation is not available on the target device"),
    (4, "the current user does not have permission to access this device or perform this operation"),
    (6, "a query to find an object was unsuccessful"),
    (8, "a device's external power cables are not properly attached"),
    (9, "the NVIDIA driver is not loaded"), (10, "the NVIDIA kernel detected an interrupt issue with a GPU"),
    (12, "the NVML shared library couldn't be found or loaded"),
    (13, "the local version of NVML doesn't implement this function"), (14, "the infoROM is corrupted"),
    (15, "the GPU has fallen off the bus or has otherwise become inaccessible"),
    (255, "other error or internal driver error"), (77, "exit status 77"),
])
def test_every_documented_exit_status_has_its_meaning(rc, meaning):
    assert smi.exit_meaning(rc) == meaning


def test_failure_without_rows_says_what_the_exit_status_means():
    status = smi.status_from_sections({"gpus": Section("Unable to determine the device handle for "
                                                       "GPU0000:0B:00.0: Unknown Error\n", 15)})
    assert status.kind is StatusKind.FAILED
    assert status.message == ("Unable to determine the device handle for GPU0000:0B:00.0: Unknown Error "
                              "(exit status 15: the GPU has fallen off the bus or has otherwise become "
                              "inaccessible)")
