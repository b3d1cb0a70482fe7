"""``%gpu doctor``: the machine preflight, as pure checks over gathered sections.

:func:`run_doctor` gathers the status sections (:mod:`gpumagic.gpu.smi`) and the doctor's
own (``torch``, ``env``, ``cwd``, ``df``, ``sample``) with ``gpu-sections.sh`` in one round
trip, through the login environment; :func:`diagnose` turns them into :class:`Check` lines.
Every check is a pure function over recorded text.  :func:`failure_hint` is the same kind of
advice for a failed ``%%remote`` cell.

Formats
-------
* ``df -P -B1``: POSIX df with 1-byte blocks (``df -Pk``: 1024-byte blocks).
* ``/proc/stat`` ``cpuN`` lines: jiffies in user, nice, system, idle, iowait, irq,
  softirq, steal (see proc(5)).
* The ``torch`` section: what ``gpu-python-probe.py`` prints (its docstring).
* The ``env`` section: ``NAME=value`` lines (``gpu-sections.sh``).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence, TYPE_CHECKING

from ..errors import RemoteCommandError
from ..remote import program
from .smi import (GPU_FIELDS, HIDDEN_USE_MIB, NVML_MISMATCH_HINT, GpuStatus, Section, Unknown, known,
                  read_value, sections_command, split_sections, status_from_sections, status_sections,
                  version_tuple)

if TYPE_CHECKING:
    from .._types import MachineLike

# -- checks -------------------------------------------------------------------------------------


class Level(str, enum.Enum):
    """A doctor check's result."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class Check:
    """One line of the doctor's table: what was checked, the result, and a one-line fix."""

    name: str
    level: Level
    summary: str
    fix: str = ""


@dataclass(frozen=True)
class Mount:
    """One filesystem from ``df -P``; sizes in bytes."""

    filesystem: str
    size: int
    used: int
    available: int
    mountpoint: str

    @property
    def percent_used(self) -> float:
        """Used share as df computes ``Capacity``: used / (used + available), in percent."""
        denom = self.used + self.available
        return 100.0 * self.used / denom if denom else 0.0


#: The program the ``torch`` section runs with the login's ``python3``
#: (``gpumagic/remote/programs/``): Python version, environment, PyTorch and its CUDA build.
PYTHON_PROBE = "gpu-python-probe.py"


def doctor_sections(sample: int = 0) -> list[str]:
    """The sections the doctor gathers in one round trip (``gpu-sections.sh`` arguments):
    those of a status snapshot, then ``torch``, ``env``, ``cwd``, ``df``, and with ``sample``
    (seconds, an int) ``sample``: utilisation read once a second for that long."""
    out = [*status_sections(), "torch=" + program.source(PYTHON_PROBE), "env", "cwd", "df"]
    if sample:
        out.append(f"sample={int(sample)}")
    return out


def parse_df(text: str) -> list[Mount]:
    """Parse ``df -P -B1`` (or ``df -Pk``, ``df -P``) output into mounts (sizes in bytes)."""
    lines = text.splitlines()
    head = next((i for i, ln in enumerate(lines) if ln.startswith("Filesystem")), None)
    if head is None:
        return []
    m = re.search(r"(\d+)-blocks", lines[head])
    block = int(m.group(1)) if m else 1024
    out = []
    for ln in lines[head + 1:]:
        parts = ln.split()
        if len(parts) < 6:
            continue
        try:
            size, used, avail = (int(x) * block for x in parts[1:4])
        except ValueError:
            continue
        # Mount points may contain spaces; the capacity column ends with "%".
        cap = next((i for i in range(4, len(parts)) if parts[i].endswith("%")), 4)
        out.append(Mount(parts[0], size, used, avail, " ".join(parts[cap + 1:])))
    return out


_PSEUDO_FS = {"tmpfs", "devtmpfs", "shm", "udev", "none", "proc", "sysfs", "cgroup", "cgroup2",
              "efivarfs", "overlay_tmpfs"}
_PSEUDO_MOUNT = ("/dev", "/run", "/sys", "/proc", "/boot", "/snap", "/etc/")
#: Mounts smaller than this (bytes) are not data disks (config bind mounts, /boot/efi).
MIN_DISK = 1 << 30


def data_mounts(mounts: Iterable[Mount]) -> list[Mount]:
    """Mounts that can hold data: no tmpfs, /dev, /run, /boot, /snap, nor tiny bind mounts."""
    out = []
    for m in mounts:
        if m.filesystem in _PSEUDO_FS or m.size < MIN_DISK:
            continue
        if any(m.mountpoint == p or m.mountpoint.startswith(p.rstrip("/") + "/") for p in _PSEUDO_MOUNT):
            continue
        out.append(m)
    return out


def mount_of(path: str, mounts: Iterable[Mount]) -> Mount | None:
    """The mount holding absolute ``path`` (longest mount-point prefix)."""
    best = None
    for m in mounts:
        mp = m.mountpoint.rstrip("/") or "/"
        if path == mp or path.startswith(mp.rstrip("/") + "/") or mp == "/":
            if best is None or len(mp) > len(best.mountpoint.rstrip("/") or "/"):
                best = m
    return best


def gb(n: int) -> str:
    """Bytes as decimal GB, as disk vendors and rental platforms quote them."""
    return f"{n / 1e9:.0f} GB" if n >= 10e9 else f"{n / 1e9:.1f} GB"


#: A disk holding the working directory and smaller than this (bytes), beside a data disk
#: at least twice as large, gets a warning.
SMALL_SYSTEM_DISK = 100 * 10**9
FULL_PERCENT = 90.0


def check_disks(df_text: str, cwd: str) -> list[Check]:
    """Disks: size and free space per mount, the largest data disk, full or small disks.

    Parameters
    ----------
    df_text : str
        ``df -P -B1`` output.
    cwd : str
        The working directory cells run in (``pwd -P`` on the machine).
    """
    mounts = data_mounts(parse_df(df_text))
    if not mounts:
        return [Check("disks", Level.WARN, "could not read the disks (df printed nothing usable)",
                      "run `df -h` in a %%remote cell")]
    largest = max(mounts, key=lambda m: m.size)
    listing = ", ".join(f"{m.mountpoint} {gb(m.available)} free of {gb(m.size)}" for m in mounts)
    checks = [Check("disks", Level.OK, f"{listing}; largest data disk: {largest.mountpoint}")]
    here = mount_of(cwd, mounts) if cwd else None
    if here is not None and here is not largest and here.size < SMALL_SYSTEM_DISK \
            and largest.size >= 2 * here.size:
        checks.append(Check(
            "working directory", Level.WARN,
            f"{cwd} is on {here.mountpoint} ({gb(here.size)}), a small system disk; "
            f"the data disk is {largest.mountpoint} ({gb(largest.size)})",
            f"`%gpu cd {largest.mountpoint}` and keep data, checkpoints and caches there"))
    elif here is not None:
        checks.append(Check("working directory", Level.OK,
                            f"{cwd} is on {here.mountpoint} ({gb(here.available)} free)"))
    for m in mounts:
        if m.percent_used > FULL_PERCENT:
            checks.append(Check(f"disk {m.mountpoint}", Level.WARN,
                                f"{m.mountpoint} is {m.percent_used:.0f}% full ({gb(m.available)} free)",
                                f"free space on {m.mountpoint} (old checkpoints, ~/.cache/pip, "
                                "~/.cache/huggingface) before writing more"))
    return checks


def check_driver(status: GpuStatus) -> Check:
    """The driver answered (its version and CUDA maximum), or what is wrong and the fix; a
    warning when nvidia-smi listed the GPUs but reported a problem (see GpuStatus.warnings)."""
    if status.ok:
        what = f"driver {status.driver_version}, supports CUDA up to {status.cuda_version}"
        if status.warnings:
            first, _, fix = status.warnings[0].partition("; ")
            more = f" (and {len(status.warnings) - 1} more warning(s))" if len(status.warnings) > 1 else ""
            return Check("driver", Level.WARN, f"{what}; but {first}{more}", fix)
        return Check("driver", Level.OK, what)
    return Check("driver", Level.FAIL, status.message, status.hint)


def _normal(s: str) -> str:
    return re.sub(r"[\s_-]+", "", s).lower()


def check_gpu_model(status: GpuStatus, expect: str | None = None,
                    expect_count: int | None = None) -> list[Check]:
    """The GPU model and count against what was rented (``expect`` matches inside the name,
    ignoring case, spaces and dashes: "H200", "A100 80GB", "rtx4090")."""
    if not status.ok:
        return []
    names = [str(g.name) for g in status.gpus]
    have = ", ".join(dict.fromkeys(names))
    out = []
    if expect:
        wrong = [n for n in names if _normal(expect) not in _normal(n)]
        if wrong:
            out.append(Check("GPU model", Level.FAIL,
                             f"expected {expect}, the machine has {have}",
                             f"this is not the {expect} you rented: stop the instance and ask "
                             "the platform for a refund or a new machine"))
        else:
            out.append(Check("GPU model", Level.OK, f"{have} (expected {expect})"))
    else:
        out.append(Check("GPU model", Level.OK, have))
    if expect_count is not None:
        n = len(status.gpus)
        if n != expect_count:
            out.append(Check("GPU count", Level.FAIL, f"expected {expect_count} GPU(s), nvidia-smi lists {n}",
                             "check CUDA_VISIBLE_DEVICES, then the instance you rented"))
        else:
            out.append(Check("GPU count", Level.OK, f"{n} GPU(s)"))
    return out


def check_memory_in_use(status: GpuStatus) -> list[Check]:
    """GPU memory already used at start: by visible processes, or by others (shared GPU)."""
    if not status.ok:
        return []
    out = []
    for g in status.gpus:
        if not known(g.memory_used_mib) or not known(g.memory_total_mib):
            out.append(Check(f"{g.label} memory", Level.WARN,
                             f"memory use unknown ({getattr(g.memory_used_mib, 'reason', '')})"))
            continue
        procs = status.processes_on(g)
        hidden = status.hidden_use_mib(g)
        used = g.memory_used_mib
        if used < HIDDEN_USE_MIB and not procs:
            out.append(Check(f"{g.label} memory", Level.OK,
                             f"free: {used}/{g.memory_total_mib} MiB in use"))
            continue
        who = ", ".join(f"{p.name} (pid {p.pid}, {p.used_mib} MiB)" for p in procs)
        if hidden:
            who = (who + "; " if who else "") + f"{hidden} MiB by processes not visible here (another container?)"
        out.append(Check(f"{g.label} memory", Level.WARN,
                         f"{used}/{g.memory_total_mib} MiB already in use: {who}",
                         "stop your own leftover processes (`kill PID`); memory held by others means "
                         "a shared GPU: ask the platform for a dedicated one"))
    return out


#: PyTorch wheel indexes (download.pytorch.org/whl/cuXYZ), newest first.
TORCH_CUDA_BUILDS = ("13.0", "12.9", "12.8", "12.6", "12.4", "12.1", "11.8")


def parse_torch_probe(text: str) -> dict:
    """Parse what :data:`PYTHON_PROBE` prints (and the recorded ``torch-version.txt``).

    Returns ``{"python": "3.12.3", "torch": "2.11.0+cu130" | None, "cuda": "13.0" | None,
    "error": str, "env": "venv" | "conda" | "system" | None, "prefix": sys.prefix}``;
    ``cuda`` is None for a CPU-only build.
    """
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    info = {"python": None, "torch": None, "cuda": None, "error": "", "env": None, "prefix": ""}
    for ln in lines:
        if info["python"] is None and re.match(r"\d+\.\d+\.\d+", ln):
            info["python"] = ln.split()[0]
            continue
        if ln.startswith("env\t"):
            _, info["env"], info["prefix"] = (ln.split("\t", 2) + [""])[:3]
            continue
        if ln.startswith("no-torch"):
            info["error"] = ln[len("no-torch"):].strip()
            break
        parts = ln.split()
        if info["python"] is not None and parts and re.match(r"\d+\.\d+", parts[0]):
            info["torch"] = parts[0]
            if len(parts) > 1 and re.match(r"\d+\.\d+$", parts[1]):
                info["cuda"] = parts[1]
            break
    if info["python"] is None and lines:
        info["error"] = lines[-1]
    return info


def check_torch_cuda(torch_text: str, driver_cuda: str | Unknown) -> Check:
    """PyTorch's CUDA build (``torch.version.cuda``) against the driver's newest CUDA.

    A newer major version than the driver fails (every CUDA call raises "CUDA driver
    version is insufficient for CUDA runtime version"); a newer minor version of the same
    major is a warning (CUDA minor-version compatibility runs it, except for code that
    JIT-compiles PTX).
    """
    info = parse_torch_probe(torch_text)
    if info["torch"] is None:
        why = info["error"] or "python3 printed nothing"
        return Check("PyTorch CUDA", Level.WARN, f"torch is not importable by python3 ({why})",
                     "pip install torch (pick the CUDA build at pytorch.org/get-started)")
    if info["cuda"] is None:
        return Check("PyTorch CUDA", Level.WARN, f"torch {info['torch']} is a CPU-only build",
                     _torch_fix(driver_cuda))
    if not known(driver_cuda):
        return Check("PyTorch CUDA", Level.WARN,
                     f"torch {info['torch']} built for CUDA {info['cuda']}; the driver's CUDA "
                     "version is unknown", "fix the driver first (see the driver line)")
    built, drv = version_tuple(info["cuda"]), version_tuple(driver_cuda)
    what = f"torch {info['torch']} built for CUDA {info['cuda']}, driver supports up to {driver_cuda}"
    if built[:1] > drv[:1]:
        return Check("PyTorch CUDA", Level.FAIL,
                     f"{what}: CUDA calls will fail with \"CUDA driver version is insufficient "
                     "for CUDA runtime version\"", _torch_fix(driver_cuda))
    if built > drv:
        return Check("PyTorch CUDA", Level.WARN,
                     f"{what}: runs through CUDA minor-version compatibility, except code that "
                     "JIT-compiles PTX", _torch_fix(driver_cuda))
    return Check("PyTorch CUDA", Level.OK, what)


def _torch_fix(driver_cuda) -> str:
    if not known(driver_cuda):
        return "install a PyTorch build for the driver's CUDA version"
    drv = version_tuple(driver_cuda)
    tag = next((b for b in TORCH_CUDA_BUILDS if version_tuple(b) <= drv), None)
    if tag is None:
        return f"the driver (CUDA {driver_cuda}) is older than any current PyTorch build: update the driver"
    return (f"install the build for CUDA <= {driver_cuda}: pip install torch --index-url "
            f"https://download.pytorch.org/whl/cu{tag.replace('.', '')}")


def parse_env_probe(text: str) -> dict[str, str]:
    """``NAME=value`` lines of the ``env`` section -> dict."""
    out = {}
    for ln in text.splitlines():
        k, sep, v = ln.partition("=")
        if sep:
            out[k.strip()] = v.strip()
    return out


def check_python_env(torch_text: str, env_text: str) -> list[Check]:
    """Python version, an active venv/conda env, and whether tmux and rsync exist."""
    info, env = parse_torch_probe(torch_text), parse_env_probe(env_text)
    out = []
    if info["python"] is None:
        out.append(Check("python", Level.FAIL, f"python3 did not run ({info['error'] or 'no output'})",
                         "install python3 (apt-get install -y python3) or activate your env in ~/.bashrc"))
    else:
        v = version_tuple(info["python"])
        where = env.get("python3", "")
        out.append(Check("python", Level.OK if v >= (3, 9) else Level.WARN,
                         f"Python {info['python']} ({where})" if where else f"Python {info['python']}",
                         "" if v >= (3, 9) else "current PyTorch needs Python >= 3.9: use a newer python or conda env"))
    if env.get("CONDA_DEFAULT_ENV") or info["env"] == "conda":
        out.append(Check("environment", Level.OK,
                         f"conda env {env.get('CONDA_DEFAULT_ENV') or info['prefix']}"))
    elif env.get("VIRTUAL_ENV") or info["env"] == "venv":
        out.append(Check("environment", Level.OK, f"venv {env.get('VIRTUAL_ENV') or info['prefix']}"))
    else:
        out.append(Check("environment", Level.WARN, "no venv or conda env is active: pip installs go "
                         "into the system python", "python3 -m venv ~/venv, and activate it in ~/.bashrc"))
    for tool, why in (("tmux", "keeps a shell running when you disconnect"),
                      ("rsync", "makes `%gpu sync` incremental")):
        if env.get(tool):
            out.append(Check(tool, Level.OK, env[tool]))
        else:
            out.append(Check(tool, Level.WARN, f"{tool} is not installed ({why})",
                             f"apt-get install -y {tool}"))
    return out


def parse_proc_stat(text: str) -> dict[str, tuple[int, int]]:
    """``cpu``/``cpuN`` lines of /proc/stat -> ``{name: (busy_jiffies, total_jiffies)}``.

    Idle time is ``idle + iowait`` (proc(5)); guest time is already inside user.
    """
    out = {}
    for ln in text.splitlines():
        parts = ln.split()
        if not parts or not parts[0].startswith("cpu"):
            continue
        vals = [int(x) for x in parts[1:9] if x.isdigit()]
        if len(vals) < 4:
            continue
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        out[parts[0]] = (sum(vals) - idle, sum(vals))
    return out


@dataclass(frozen=True)
class Sample:
    """Utilisation measured over a run: GPU mean in percent; CPU busy share of all cores
    and of the busiest core, in percent; ``cores`` counted from /proc/stat."""

    gpu_mean_pct: float | Unknown
    cpu_pct: float | Unknown
    busiest_core_pct: float | Unknown
    cores: int


def parse_sample(text: str) -> Sample:
    """Parse the ``sample`` section: /proc/stat, ``--gpu``, util lines, ``--end``, /proc/stat."""
    before, _, rest = text.partition("--gpu")
    gpu_text, _, after = rest.partition("--end")
    utils = [v for v in (read_value(x, int) for x in gpu_text.split()) if known(v)]
    s0, s1 = parse_proc_stat(before), parse_proc_stat(after)

    def pct(name):
        if name not in s0 or name not in s1:
            return None
        busy, total = s1[name][0] - s0[name][0], s1[name][1] - s0[name][1]
        return 100.0 * busy / total if total > 0 else None

    cores = [k for k in s1 if k != "cpu"]
    cpu = pct("cpu")
    per = [p for p in (pct(k) for k in cores) if p is not None]
    none = Unknown("/proc/stat was not readable twice")
    return Sample(gpu_mean_pct=sum(utils) / len(utils) if utils else Unknown("no GPU samples"),
                  cpu_pct=cpu if cpu is not None else none,
                  busiest_core_pct=max(per) if per else none, cores=len(cores))


def check_sample(sample: Sample, seconds: float) -> Check:
    """GPU mostly idle while CPUs are busy -> the GPU is waiting for data loading.

    Busy CPUs means over 70 % of all cores, or one core over 90 % (a single-process loader,
    ``num_workers=0``).  GPU mostly idle: mean utilisation under 50 %.
    """
    if not known(sample.gpu_mean_pct):
        return Check("utilisation", Level.WARN, f"no GPU utilisation sampled ({sample.gpu_mean_pct.reason})")
    gpu = sample.gpu_mean_pct
    cpu_txt = (f"CPU {sample.cpu_pct:.0f}% of {sample.cores} cores, busiest core "
               f"{sample.busiest_core_pct:.0f}%") if known(sample.cpu_pct) else "CPU unknown"
    what = f"over {seconds:g} s: GPU {gpu:.0f}% busy, {cpu_txt}"
    cpu_busy = known(sample.cpu_pct) and (sample.cpu_pct > 70 or
                                          (known(sample.busiest_core_pct) and sample.busiest_core_pct > 90))
    if gpu < 50 and cpu_busy:
        return Check("utilisation", Level.WARN, f"{what}: the GPU is waiting for data loading",
                     "more DataLoader workers (num_workers=8, pin_memory=True), data on the local "
                     "disk, preprocessing done once before training instead of in the loop")
    if gpu < 50:
        return Check("utilisation", Level.WARN, f"{what}: the GPU is mostly idle",
                     "run the sample while your training runs (as a job, or in another notebook)")
    return Check("utilisation", Level.OK, what)


@dataclass(frozen=True)
class DoctorReport:
    """The doctor's checks for one machine, and the status it gathered."""

    host: str
    checks: list[Check]
    status: GpuStatus

    @property
    def worst(self) -> Level:
        levels = {c.level for c in self.checks}
        return Level.FAIL if Level.FAIL in levels else Level.WARN if Level.WARN in levels else Level.OK


def diagnose(sections: Mapping[str, Section], *, host: str = "", expect_gpu: str | None = None,
             expect_count: int | None = None, sample: float = 0,
             fields: Sequence[str] = GPU_FIELDS) -> DoctorReport:
    """All doctor checks over the sections :func:`doctor_sections` gathered (pure)."""
    status = status_from_sections(sections, host=host, fields=fields)
    text = lambda name: sections[name].text if name in sections else ""  # noqa: E731
    checks = [check_driver(status)]
    if not status.ok and (expect_gpu or expect_count is not None):
        checks.append(Check("GPU model", Level.FAIL, "cannot read the GPUs (see the driver line)",
                            status.hint))
    checks += check_gpu_model(status, expect_gpu, expect_count)
    checks += check_memory_in_use(status)
    checks.append(check_torch_cuda(text("torch"), status.cuda_version if status.ok else
                                   Unknown(status.message)))
    checks += check_disks(text("df"), text("cwd").strip())
    checks += check_python_env(text("torch"), text("env"))
    if sample:
        checks.append(check_sample(parse_sample(text("sample")), sample))
    return DoctorReport(host, checks, status)


def run_doctor(machine: MachineLike, *, expect_gpu: str | None = None, expect_count: int | None = None,
               sample: int = 0, timeout: float = 120) -> DoctorReport:
    """Gather everything in one round trip (through the login environment, so the python,
    venv and conda the user gets) and run :func:`diagnose`.

    Raises
    ------
    ConnectionLost, RemoteTimeout
    RemoteCommandError
        When the program printed nothing to check (e.g. the working directory is gone).
    """
    command = sections_command(doctor_sections(sample))
    r = machine.run(["/bin/sh", "-c", command], quiet=True, timeout=timeout + sample)
    sections = split_sections(r.stdout)
    if not sections:
        last = (r.stderr.strip().splitlines() or [f"exit status {r.exit_code}"])[-1]
        raise RemoteCommandError(f"the doctor's checks did not run on {machine.name}: {last}",
                                 exit_code=r.exit_code, stdout=r.stdout, stderr=r.stderr,
                                 hint="fix the working directory with `%gpu cd DIR`, then run "
                                      "`%gpu doctor` again")
    return diagnose(sections, host=machine.name, expect_gpu=expect_gpu,
                    expect_count=expect_count, sample=sample)


# -- failure hints for %%remote cells ------------------------------------------------------------
#
# Each well-known failure is one pattern over the cell's stderr and one function that words the
# hint from the match.  The patterns are the projects' own wordings:
#
# * PyTorch ``c10/cuda/CUDAFunctions.cpp`` (``cudaErrorInsufficientDriver`` from
#   ``cudaGetDeviceCount``): "The NVIDIA driver on your system is too old (found version 11040)"
#   -- the number is ``cudaDriverGetVersion``'s, 1000 x major + 10 x minor; and "Found no NVIDIA
#   driver on your system".
# * cudart's ``cudaGetErrorString``: "CUDA driver version is insufficient for CUDA runtime
#   version", "no kernel image is available for execution on the device", "out of memory"
#   (PyTorch prefixes "CUDA error: ").
# * PyTorch ``torch/cuda/__init__.py`` ``_check_capability``: "NVIDIA GeForce RTX 5090 with CUDA
#   capability sm_120 is not compatible with the current PyTorch installation. The current
#   PyTorch install supports CUDA capabilities sm_50 ... sm_90."
# * PyTorch's caching allocator: "CUDA out of memory. Tried to allocate 2.00 GiB", raised as
#   ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` before 2.4).
# * NCCL ``ncclGetErrorString(ncclSystemError)``: "unhandled system error (run with
#   NCCL_DEBUG=INFO for details)", after PyTorch's "NCCL error in: ...ProcessGroupNCCL.cpp:N, ".
# * NVML (nvidia-smi, pynvml, PyTorch's memory queries): "Failed to initialize NVML:
#   Driver/library version mismatch".

_NOSPACE_PATH = re.compile(r"No space left on device: '([^']+)'")


def cuda_version_text(version: int) -> str:
    """``cudaDriverGetVersion``'s number as CUDA's version: 11040 -> ``"11.4"``, 12080 ->
    ``"12.8"`` (1000 x major + 10 x minor, CUDA Runtime API "Version Management")."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def _old_driver_hint(m: re.Match, tail: str) -> str:
    cuda = cuda_version_text(int(m.group(1)))
    what = (f"the machine's NVIDIA driver supports CUDA up to {cuda} (found version {m.group(1)}), "
            "older than this PyTorch's build")
    if not any(version_tuple(b) <= version_tuple(cuda) for b in TORCH_CUDA_BUILDS):
        return (f"{what}, and than every current PyTorch build: rent a machine with a newer driver "
                "(or update the driver); `%gpu doctor` shows both versions")
    return f"{what}: {_torch_fix(cuda)} (`%gpu doctor` shows both versions)"


def _no_driver_hint(m: re.Match, tail: str) -> str:
    return ("PyTorch found no NVIDIA driver on the machine: `%gpu doctor` checks nvidia-smi; rent an "
            "instance with a GPU (on a container platform, one started with the GPU attached)")


def _insufficient_driver_hint(m: re.Match, tail: str) -> str:
    return ("this PyTorch was built for a newer CUDA than the driver supports: "
            "`%gpu doctor` shows both versions and which build to install")


_ARCH = re.compile(r"([^\n:]+?) with CUDA capability (sm_\d+) is not compatible with the current PyTorch "
                   r"installation\.?(?:\s*The current PyTorch install supports CUDA capabilities ([^\n.]*))?")


def _no_kernel_hint(m: re.Match, tail: str) -> str:
    arch = _ARCH.search(tail)
    if arch:
        card, sm, has = arch.group(1).strip(), arch.group(2), (arch.group(3) or "").strip()
        built = f" (it has {has})" if has else ""
        return (f"this PyTorch build has no kernels for the {card}'s {sm}{built}: install a PyTorch "
                f"build whose torch.cuda.get_arch_list() includes {sm} (a newer release, or the "
                "build for a newer CUDA); `%gpu doctor` shows the card and the build")
    return ("this PyTorch build (or a compiled extension) has no kernels for this GPU's architecture: "
            "install a build whose torch.cuda.get_arch_list() includes the card's sm_XX "
            "(torch.cuda.get_device_capability()), or rebuild the extension with TORCH_CUDA_ARCH_LIST set")


def _oom_hint(m: re.Match, tail: str) -> str:
    return ("GPU memory ran out: halve the batch size, use mixed precision "
            "(torch.autocast(\"cuda\", dtype=torch.bfloat16)), or gradient checkpointing; "
            "`%gpu status` shows what holds the memory")


def _nccl_system_hint(m: re.Match, tail: str) -> str:
    return ("NCCL failed in a system call (a socket, shared memory or a device): rerun with "
            "NCCL_DEBUG=INFO to see which; in a container /dev/shm is often too small (`df -h /dev/shm`), "
            "and NCCL_SOCKET_IFNAME=<interface> picks the network between the machines")


def _nvml_mismatch_hint(m: re.Match, tail: str) -> str:
    return f"NVML: Driver/library version mismatch: {NVML_MISMATCH_HINT}"


def _nospace_hint(m: re.Match, tail: str) -> str:
    path = _NOSPACE_PATH.search(tail)
    where = f"the disk holding {path.group(1)}" if path else "a disk"
    return (f"{where} is full: `%gpu doctor` lists each mount with its free space "
            "(write large files to the data disk)")


#: (pattern, hint) in the order they are tried: the more precise wording first (a missing
#: kernel image is reported with the architecture warning above it; an old driver by PyTorch
#: before cudart's own words).
FAILURE_HINTS: tuple[tuple[re.Pattern, Callable[[re.Match, str], str]], ...] = (
    (re.compile(r"The NVIDIA driver on your system is too old \(found version (\d+)\)"), _old_driver_hint),
    (re.compile(r"Found no NVIDIA driver on your system"), _no_driver_hint),
    (re.compile(r"CUDA driver version is insufficient for CUDA runtime version"), _insufficient_driver_hint),
    (re.compile(r"no kernel image is available for execution on the device|with CUDA capability sm_\d+ "
                r"is not compatible with the current PyTorch installation"), _no_kernel_hint),
    (re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory"), _oom_hint),
    (re.compile(r"unhandled system error \(run with NCCL_DEBUG=INFO for details\)|NCCL error[^\n]*"
                r"unhandled system error|ncclSystemError"), _nccl_system_hint),
    (re.compile(r"Failed to initialize NVML: Driver/library version mismatch"), _nvml_mismatch_hint),
    (re.compile(r"No space left on device"), _nospace_hint),
)


def failure_hint(stderr: str, exit_code: int) -> str | None:
    """One line of advice for a failed cell whose stderr shows a well-known failure.

    Looks at the last 64 KiB of ``stderr`` for each of :data:`FAILURE_HINTS` (CUDA out of
    memory, a driver older than PyTorch's build, a build without kernels for the card, NCCL's
    system errors, an NVML driver/library mismatch, a full disk); and at ``exit_code`` 137
    (killed by SIGKILL, usually the OOM killer).  Returns None when nothing is recognised.
    """
    tail = stderr[-65536:]
    for pattern, hint in FAILURE_HINTS:
        m = pattern.search(tail)
        if m:
            return hint(m, tail)
    if exit_code == 137:
        # SIGKILL from outside: gpumagic's own stops raise KeyboardInterrupt/RemoteTimeout
        # instead.  The shell usually prints "Killed", but not every shell does.
        return ("the process was killed (SIGKILL, exit 137), most often by the kernel's OOM killer "
                "when host RAM ran out: use fewer DataLoader workers, load data lazily, or check "
                "`free -g` and `dmesg | tail`")
    return None
