"""GPU status and the machine preflight: nvidia-smi queries, pure parsers, doctor checks.

Everything here is either a *query* (a shell script sent in one SSH round trip whose
output is split into named sections) or a *pure function* over the text those commands
print, so every parser and check is tested on recorded output from real machines
(``gpumagic/gpu/fake/recordings``, ``tests/recordings``).

Formats
-------
* ``nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits``: one line per GPU,
  values separated by ``", "``, in the order of FIELDS.  A value nvidia-smi cannot read is
  printed in brackets (``[N/A]``, ``[Not Supported]``, ``[Unknown Error]``,
  ``[Insufficient Permissions]``, ``[GPU is lost]``); with ``nounits`` absent a unit
  follows the number (``143771 MiB``, ``0 %``, ``127.87 W``, ``1980 MHz``).  Field names
  are those of ``nvidia-smi --help-query-gpu``.
* ``nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid``: one line per
  process holding a CUDA context.  Processes of other containers are not listed.
* ``nvidia-smi --version``: ``CUDA Version : 13.0`` is the newest CUDA the driver
  supports (also in the banner of plain ``nvidia-smi``: ``CUDA Version: 13.0``).
* ``df -P -B1``: POSIX df with 1-byte blocks (``df -Pk``: 1024-byte blocks).
* ``/proc/stat`` ``cpuN`` lines: jiffies in user, nice, system, idle, iowait, irq,
  softirq, steal (see proc(5)).
"""

from __future__ import annotations

import enum
import re
import shlex
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

from ..errors import GpumagicError, RemoteCommandError

# -- query strings --------------------------------------------------------------------------

#: ``--query-gpu`` fields read for the status, in this order (names from ``--help-query-gpu``).
GPU_FIELDS = ("index", "uuid", "name", "driver_version", "memory.total", "memory.used",
              "memory.free", "utilization.gpu", "utilization.memory", "temperature.gpu",
              "power.draw", "power.limit", "clocks.sm", "clocks.max.sm", "pstate",
              "mig.mode.current", "fan.speed")
#: ``--query-compute-apps`` fields, in this order.
APP_FIELDS = ("pid", "process_name", "used_memory", "gpu_uuid")


def query_gpu_command(fields: Sequence[str] = GPU_FIELDS, program: str = "nvidia-smi") -> str:
    """``nvidia-smi --query-gpu=... --format=csv,noheader,nounits`` for ``fields``."""
    return f"{program} --query-gpu={','.join(fields)} --format=csv,noheader,nounits"


def query_apps_command(fields: Sequence[str] = APP_FIELDS, program: str = "nvidia-smi") -> str:
    """``nvidia-smi --query-compute-apps=... --format=csv,noheader,nounits``."""
    return f"{program} --query-compute-apps={','.join(fields)} --format=csv,noheader,nounits"


#: Seconds one nvidia-smi call may take in a gathered script; a GPU in a bad state can
#: make nvidia-smi hang for minutes, and the remote call must not outlive the query.
SMI_TIMEOUT = 20

#: Defines ``smi``: nvidia-smi under ``timeout`` (exit 124 when it hangs) where coreutils
#: has it, found also in the directories container images put it in without a login PATH.
SMI_PREAMBLE = (
    'PATH="$PATH:/usr/local/nvidia/bin:/usr/lib/wsl/lib"; export PATH\n'
    "if command -v timeout >/dev/null 2>&1; then smi() { timeout %d nvidia-smi \"$@\"; }\n"
    'else smi() { nvidia-smi "$@"; }; fi\n' % SMI_TIMEOUT)

#: Prints the newest CUDA version the driver supports; old drivers lack ``--version``, so
#: the banner of plain ``nvidia-smi`` is the fallback.
VERSION_COMMAND = "smi --version || smi | head -n 4"

# -- sections: several commands, one round trip ---------------------------------------------

_MARK = "\x1egpumagic-section"
_END = "\x1egpumagic-rc"


@dataclass(frozen=True)
class Section:
    """What one command of a gathered script printed (stdout and stderr merged) and its status."""

    text: str
    rc: int

    @property
    def missing(self) -> bool:
        """The shell could not find the program (exit status 127)."""
        return self.rc == 127


def sections_script(commands: Mapping[str, str], preamble: str = SMI_PREAMBLE) -> str:
    """A POSIX sh script running each command in turn, framing its output as a section.

    Each command's stdout and stderr are merged; its exit status follows it.  Parse the
    output with :func:`split_sections`.  ``preamble`` runs first (by default it defines
    ``smi``, see :data:`SMI_PREAMBLE`).
    """
    parts = [preamble.rstrip("\n")] if preamble else []
    for name, cmd in commands.items():
        if not re.fullmatch(r"[\w.-]+", name):
            raise ValueError(f"section name {name!r}")
        parts.append(f"printf '\\036gpumagic-section %s\\n' {name}\n"
                     f"( {cmd}\n) </dev/null 2>&1\n"
                     f"printf '\\n\\036gpumagic-rc %s %s\\n' {name} \"$?\"")
    return "\n".join(parts) + "\n"


def split_sections(text: str) -> dict[str, Section]:
    """Parse the output of a :func:`sections_script` into ``{name: Section}``.

    A section cut short (connection dropped, script killed) gets ``rc = -1``.
    """
    out: dict[str, Section] = {}
    for chunk in text.split(_MARK + " ")[1:]:
        name, _, body = chunk.partition("\n")
        end = body.rfind("\n" + _END + " ")
        if end < 0:
            out[name.strip()] = Section(body, -1)
            continue
        tail = body[end + len(_END) + 2:].split()
        try:
            rc = int(tail[1])
        except (IndexError, ValueError):
            rc = -1
        out[name.strip()] = Section(body[:end], rc)
    return out


def shell(script: str) -> list[str]:
    """argv running ``script`` with ``/bin/sh`` whatever the login shell is."""
    return ["/bin/sh", "-c", script]


# -- values that may be unknown ---------------------------------------------------------------


@dataclass(frozen=True)
class Unknown:
    """A value nvidia-smi (or another tool) could not give, and why.

    ``reason`` is a short phrase ("not supported on this GPU"); ``raw`` is what was printed.
    Falsy, so ``value or default`` works.
    """

    reason: str
    raw: str = ""

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        return "unknown"


#: What each bracketed nvidia-smi value means.
_BRACKETED = {
    "n/a": "not available on this GPU",
    "not supported": "not supported on this GPU",
    "unknown error": "nvidia-smi reported an unknown error",
    "insufficient permissions": "insufficient permissions to read it",
    "gpu is lost": "the GPU is lost (fell off the bus): the machine needs a reboot",
    "requires pro": "needs a professional driver",
}

_UNITS = ("MiB", "MHz", "%", "W", "C")
NOT_QUERIED = Unknown("not queried")


def read_value(raw: str, kind: type = str):
    """One value printed by ``--query-gpu``/``--query-compute-apps`` -> ``kind`` or Unknown.

    Accepts values with or without units (``143771 MiB`` and ``143771``).
    """
    s = raw.strip()
    low = s.lower()
    if low.startswith("[") and low.endswith("]"):
        inner = low[1:-1].strip()
        return Unknown(_BRACKETED.get(inner, inner or "empty"), s)
    if low in ("n/a", ""):
        return Unknown(_BRACKETED["n/a"] if s else "empty", s)
    if kind is str:
        return s
    for unit in _UNITS:
        if s.endswith(unit):
            s = s[: -len(unit)].strip()
            break
    try:
        return kind(float(s)) if kind is int else kind(s)
    except (ValueError, OverflowError):  # OverflowError: int(float("inf"))
        return Unknown(f"not a number: {raw.strip()!r}", raw.strip())


def known(value) -> bool:
    """True when ``value`` is a real reading (not :class:`Unknown`)."""
    return not isinstance(value, Unknown)


# -- typed records ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    """One GPU as ``nvidia-smi --query-gpu`` reports it.

    Memory in MiB, utilisation in percent, temperature in degrees C, power in W, clocks in
    MHz.  Any value may be :class:`Unknown` (with the reason).
    """

    index: int | Unknown = NOT_QUERIED
    uuid: str | Unknown = NOT_QUERIED
    name: str | Unknown = NOT_QUERIED
    driver_version: str | Unknown = NOT_QUERIED
    memory_total_mib: int | Unknown = NOT_QUERIED
    memory_used_mib: int | Unknown = NOT_QUERIED
    memory_free_mib: int | Unknown = NOT_QUERIED
    utilization_gpu_pct: int | Unknown = NOT_QUERIED
    utilization_memory_pct: int | Unknown = NOT_QUERIED
    temperature_c: int | Unknown = NOT_QUERIED
    power_draw_w: float | Unknown = NOT_QUERIED
    power_limit_w: float | Unknown = NOT_QUERIED
    clock_sm_mhz: int | Unknown = NOT_QUERIED
    clock_max_sm_mhz: int | Unknown = NOT_QUERIED
    pstate: str | Unknown = NOT_QUERIED
    mig_mode: str | Unknown = NOT_QUERIED
    fan_pct: int | Unknown = NOT_QUERIED

    @property
    def label(self) -> str:
        """``GPU0`` (``GPU?`` when the index was not read)."""
        return f"GPU{self.index}" if known(self.index) else "GPU?"


@dataclass(frozen=True)
class GpuProcess:
    """A process holding a CUDA context (``--query-compute-apps``); memory in MiB."""

    pid: int | Unknown
    name: str | Unknown
    used_mib: int | Unknown
    gpu_uuid: str | Unknown


#: query field -> (Gpu attribute, type)
_GPU_MAP = {
    "index": ("index", int), "uuid": ("uuid", str), "gpu_uuid": ("uuid", str),
    "name": ("name", str), "gpu_name": ("name", str), "driver_version": ("driver_version", str),
    "memory.total": ("memory_total_mib", int), "memory.used": ("memory_used_mib", int),
    "memory.free": ("memory_free_mib", int), "utilization.gpu": ("utilization_gpu_pct", int),
    "utilization.memory": ("utilization_memory_pct", int),
    "temperature.gpu": ("temperature_c", int), "power.draw": ("power_draw_w", float),
    "power.limit": ("power_limit_w", float), "clocks.sm": ("clock_sm_mhz", int),
    "clocks.current.sm": ("clock_sm_mhz", int), "clocks.max.sm": ("clock_max_sm_mhz", int),
    "pstate": ("pstate", str), "mig.mode.current": ("mig_mode", str), "fan.speed": ("fan_pct", int),
}
_APP_MAP = {"pid": ("pid", int), "process_name": ("name", str), "used_memory": ("used_mib", int),
            "used_gpu_memory": ("used_mib", int), "gpu_uuid": ("gpu_uuid", str)}
_HEADER_COL = re.compile(r"([a-z_.]+)( \[[^\]]*\])?")


def _is_header(line: str, fields: Sequence[str], mapping: Mapping) -> bool:
    """``index, memory.total [MiB], ...``: every column a field name (nvidia-smi's header
    may spell a field differently, e.g. ``clocks.current.sm`` for ``clocks.sm``)."""
    for col in line.split(","):
        m = _HEADER_COL.fullmatch(col.strip())
        if not m or (m.group(1) not in fields and m.group(1) not in mapping):
            return False
    return True


def _split_line(line: str, fields: Sequence[str]) -> list[str] | None:
    cols = line.split(", ")
    extra = len(cols) - len(fields)
    if extra == 0:
        return cols
    # A process name is a command path, which may contain ", "; nothing else may.
    if extra > 0 and fields.count("process_name") == 1:
        i = list(fields).index("process_name")
        return cols[:i] + [", ".join(cols[i:i + extra + 1])] + cols[i + extra + 1:]
    return None


def parse_csv(text: str, fields: Sequence[str], mapping: Mapping[str, tuple[str, type]]
              ) -> tuple[list[dict], list[str]]:
    """Rows of a query as ``{attribute: value}`` plus the lines that could not be read.

    A header line (``index, memory.total [MiB], ...``, printed without ``noheader``) is
    skipped; a line with the wrong number of values is returned as unreadable.
    """
    rows, bad = [], []
    for line in text.splitlines():
        if not line.strip():
            continue
        if _is_header(line, fields, mapping):
            continue
        cols = _split_line(line.strip(), fields)
        if cols is None:
            bad.append(line.strip())
            continue
        row = {}
        for f, raw in zip(fields, cols):
            if f in mapping:
                attr, kind = mapping[f]
                row[attr] = read_value(raw, kind)
        rows.append(row)
    return rows, bad


def parse_gpus(text: str, fields: Sequence[str] = GPU_FIELDS) -> list[Gpu]:
    """Parse ``nvidia-smi --query-gpu=FIELDS --format=csv,noheader[,nounits]`` output.

    Parameters
    ----------
    text : str
        What nvidia-smi printed, one line per GPU (in nvidia-smi's order).
    fields : sequence of str
        The field names given to ``--query-gpu``, in order.  Fields not asked for are
        ``Unknown("not queried")``.

    Returns
    -------
    list of Gpu
        One per line that has as many values as ``fields``; other lines are skipped (see
        :func:`parse_csv` for the skipped ones).
    """
    return [Gpu(**row) for row in parse_csv(text, fields, _GPU_MAP)[0]]


def parse_processes(text: str, fields: Sequence[str] = APP_FIELDS) -> list[GpuProcess]:
    """Parse ``nvidia-smi --query-compute-apps=FIELDS --format=csv,noheader[,nounits]``."""
    out = []
    for row in parse_csv(text, fields, _APP_MAP)[0]:
        out.append(GpuProcess(pid=row.get("pid", NOT_QUERIED), name=row.get("name", NOT_QUERIED),
                              used_mib=row.get("used_mib", NOT_QUERIED),
                              gpu_uuid=row.get("gpu_uuid", NOT_QUERIED)))
    return out


def parse_cuda_version(text: str) -> str | Unknown:
    """The newest CUDA version the driver supports, from ``nvidia-smi --version`` or its banner."""
    m = re.search(r"CUDA Version\s*:\s*(\d+\.\d+)", text)
    return m.group(1) if m else Unknown("nvidia-smi did not print a CUDA version")


def version_tuple(v: str) -> tuple[int, ...]:
    """``"12.2"`` -> ``(12, 2)``; non-numeric parts end the tuple."""
    out = []
    for part in v.split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
    return tuple(out)


# -- status -------------------------------------------------------------------------------------


#: What nvidia-smi's exit status means (nvidia-smi(1), RETURN VALUE).
SMI_EXIT_CODES = {
    0: "success",
    2: "a supplied argument or flag is invalid",
    3: "the requested operation is not available on the target device",
    4: "the current user does not have permission to access this device or perform this operation",
    6: "a query to find an object was unsuccessful",
    8: "a device's external power cables are not properly attached",
    9: "the NVIDIA driver is not loaded",
    10: "the NVIDIA kernel detected an interrupt issue with a GPU",
    12: "the NVML shared library couldn't be found or loaded",
    13: "the local version of NVML doesn't implement this function",
    14: "the infoROM is corrupted",
    15: "the GPU has fallen off the bus or has otherwise become inaccessible",
    255: "other error or internal driver error",
}

#: What to do about an exit status that came with usable rows.
_SMI_EXIT_HINTS = {
    14: "the GPU still works, but its infoROM (the card's settings and error log) is damaged: "
        "ask the platform to replace the card, or rent another machine",
    15: "a GPU is inaccessible: reboot the machine; if it stays lost, ask the platform for another machine",
    10: "reboot the machine; if it happens again, ask the platform for another machine",
    8: "the card lacks power: ask the platform to fix or replace the machine",
}

#: Lines nvidia-smi prints among the rows of a query about one GPU or the whole call
#: ("WARNING: infoROM is corrupted at gpu 0000:B3:00.0", "Unable to determine the device
#: handle for GPU0000:1B:00.0: Unknown Error").
_SMI_MESSAGE = re.compile(r"^(WARNING|ERROR)\b|^(Unable to|Failed to|Could not)\b|Unknown Error|GPU is lost",
                          re.IGNORECASE)


def exit_meaning(rc: int) -> str:
    """What nvidia-smi's exit status ``rc`` means (nvidia-smi(1)); ``"exit status N"`` otherwise."""
    if rc == 124:
        return f"stopped after {SMI_TIMEOUT} s without an answer"
    return SMI_EXIT_CODES.get(rc, f"exit status {rc}")


class StatusKind(str, enum.Enum):
    """How a status query went, as a whole."""

    OK = "ok"
    NO_NVIDIA_SMI = "no nvidia-smi"
    MISMATCH = "driver/library mismatch"
    NO_DRIVER = "driver not reachable"
    HUNG = "nvidia-smi hung"
    FAILED = "nvidia-smi failed"


#: MiB in use on a GPU, beyond the visible processes, that is reported as "used by
#: processes not visible here".  An idle data-centre GPU shows 0-5 MiB; consumer cards
#: reserve a few hundred MiB for the driver.
HIDDEN_USE_MIB = 512


@dataclass(frozen=True)
class GpuStatus:
    """A snapshot of a machine's GPUs.

    Attributes
    ----------
    kind : StatusKind
        ``OK`` when nvidia-smi answered; otherwise what went wrong as a whole.
    gpus, processes : list
        Parsed records (empty unless ``kind`` is ``OK``).
    driver_version, cuda_version : str or Unknown
        The driver version and the newest CUDA version the driver supports.
    message, hint : str
        For a non-OK kind: what nvidia-smi said (one line) and what to do.
    library_version : str or Unknown
        For ``MISMATCH``: the NVML library version nvidia-smi loaded.
    skipped : list of str
        Output lines that could not be parsed.
    warnings : list of str
        For an ``OK`` status: what nvidia-smi reported beside the rows it printed (a non-zero
        exit status and its meaning, a GPU it could not reach, a lost GPU), each with what to do.
    host : str
        The machine's name.
    taken_at : float
        ``time.time()`` when the output was parsed.
    """

    kind: StatusKind
    gpus: list[Gpu] = field(default_factory=list)
    processes: list[GpuProcess] = field(default_factory=list)
    driver_version: str | Unknown = NOT_QUERIED
    cuda_version: str | Unknown = NOT_QUERIED
    message: str = ""
    hint: str = ""
    library_version: str | Unknown = NOT_QUERIED
    skipped: list[str] = field(default_factory=list)
    host: str = ""
    taken_at: float = 0.0
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.kind is StatusKind.OK

    @property
    def known_cuda(self) -> str | None:
        """The driver's CUDA version when read (to skip ``nvidia-smi --version`` next time)."""
        return self.cuda_version if self.ok and known(self.cuda_version) else None

    def processes_on(self, gpu: Gpu) -> list[GpuProcess]:
        """Processes whose ``gpu_uuid`` is this GPU's (all of them on a one-GPU machine)."""
        if len(self.gpus) == 1:
            return list(self.processes)
        return [p for p in self.processes if known(gpu.uuid) and p.gpu_uuid == gpu.uuid]

    def hidden_use_mib(self, gpu: Gpu) -> int:
        """MiB in use on ``gpu`` that no visible process accounts for (0 when below
        :data:`HIDDEN_USE_MIB` or unknown): other containers' processes."""
        if not known(gpu.memory_used_mib):
            return 0
        seen = sum(p.used_mib for p in self.processes_on(gpu) if known(p.used_mib))
        rest = gpu.memory_used_mib - seen
        return rest if rest >= HIDDEN_USE_MIB else 0


def classify_failure(text: str, rc: int) -> tuple[StatusKind, str, str, str | Unknown]:
    """Kind, message, hint and NVML library version for an nvidia-smi call that failed.

    ``text`` is what it printed (stdout and stderr); ``rc`` its exit status (127: the
    shell found no ``nvidia-smi``).
    """
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    first = lines[0] if lines else f"nvidia-smi exited with status {rc} and printed nothing"
    if rc == 127 or re.search(r"nvidia-smi: (command )?not found|No such file", text):
        return (StatusKind.NO_NVIDIA_SMI, "this machine has no nvidia-smi (no NVIDIA driver installed)",
                "rent an instance with a GPU, or install the NVIDIA driver "
                "(on a container platform, pick a CUDA image)", NOT_QUERIED)
    if rc == 124:
        return (StatusKind.HUNG, f"nvidia-smi did not answer within {SMI_TIMEOUT} s and was stopped",
                "the GPU or its driver is stuck (often after an Xid error, see `dmesg`): reboot the "
                "machine", NOT_QUERIED)
    if "Driver/library version mismatch" in text:
        m = re.search(r"NVML library version:\s*([\d.]+)", text)
        lib = m.group(1) if m else Unknown("nvidia-smi did not print it")
        return (StatusKind.MISMATCH,
                f"Failed to initialize NVML: Driver/library version mismatch (NVML library {lib})",
                "the driver was upgraded but the old kernel module is still loaded: reboot the "
                "machine (or reload the nvidia kernel modules)", lib)
    if "couldn't communicate with the NVIDIA driver" in text:
        return (StatusKind.NO_DRIVER, "nvidia-smi couldn't communicate with the NVIDIA driver",
                "the driver is not loaded: reboot the machine; if that does not help, "
                "reinstall the driver (or ask the platform for a working instance)", NOT_QUERIED)
    if "No devices were found" in text:
        return (StatusKind.FAILED, "nvidia-smi found no GPU", "the instance (or container) has no GPU "
                "attached: check the rental, or restart the instance", NOT_QUERIED)
    if rc > 0 and rc != 127:
        first = f"{first} (exit status {rc}: {exit_meaning(rc)})"
    return StatusKind.FAILED, first, "run `nvidia-smi` in a %%remote cell to see the whole message", NOT_QUERIED


def status_commands(with_version: bool = True) -> dict[str, str]:
    """The sections gathered for one status snapshot (see :func:`status_from_sections`).

    nvidia-smi takes one ``--query-*`` switch per call ("Only one --query-* switch can be
    used at a time.", driver 580), so GPUs and processes are two calls in the same script;
    on an H200 the whole script runs in 0.06 s (0.08 s with ``--version``).
    """
    cmds = {"gpus": query_gpu_command(program="smi"), "apps": query_apps_command(program="smi")}
    if with_version:
        cmds["version"] = VERSION_COMMAND
    return cmds


def status_from_sections(sections: Mapping[str, Section], *, host: str = "",
                         cuda_version: str | Unknown | None = None,
                         taken_at: float | None = None,
                         fields: Sequence[str] = GPU_FIELDS) -> GpuStatus:
    """Build a :class:`GpuStatus` from gathered sections ``gpus``, ``apps``, ``version``.

    Never raises: a failed call becomes a status of the matching kind.  ``cuda_version``
    is used when no ``version`` section was gathered (known from an earlier snapshot);
    ``fields`` are the ``--query-gpu`` fields the ``gpus`` section was printed for.

    Rows are used whenever nvidia-smi printed them, whatever its exit status: it exits 14
    when a card's infoROM is corrupted, and 15 when one GPU of several is lost, while still
    listing the others.  The exit status, what it means (nvidia-smi(1)) and the messages
    printed among the rows then become :attr:`GpuStatus.warnings`.
    """
    now = time.time() if taken_at is None else taken_at
    g = sections.get("gpus")
    if g is None:
        return GpuStatus(StatusKind.FAILED, message="nothing was gathered", host=host, taken_at=now,
                         hint="run `%gpu status` again")
    rows, skipped = parse_csv(g.text, fields, _GPU_MAP)
    if g.rc != 0 and (not rows or g.rc in (124, 127, -1)):
        kind, message, hint, lib = classify_failure(g.text, g.rc)
        return GpuStatus(kind, message=message, hint=hint, library_version=lib, host=host,
                         taken_at=now)
    gpus = [Gpu(**row) for row in rows]
    messages = [ln for ln in skipped if _SMI_MESSAGE.search(ln)]
    skipped = [ln for ln in skipped if ln not in messages]
    warnings = _smi_warnings(g.rc, messages, gpus)
    procs: list[GpuProcess] = []
    a = sections.get("apps")
    if a is not None and (a.rc == 0 or (gpus and a.rc not in (124, 127, -1))):
        procs = parse_processes(a.text)
        if a.rc not in (0, g.rc):
            warnings.append(f"the process list may be incomplete: nvidia-smi --query-compute-apps "
                            f"exited with status {a.rc} ({exit_meaning(a.rc)})")
    cuda = cuda_version if cuda_version is not None else NOT_QUERIED
    if "version" in sections:
        cuda = parse_cuda_version(sections["version"].text)
    driver = next((x.driver_version for x in gpus if known(x.driver_version)),
                  Unknown("no GPU reported it"))
    if not gpus:
        message = (f"could not read nvidia-smi's output: {skipped[0]!r}" if skipped
                   else "nvidia-smi listed no GPU")
        return GpuStatus(StatusKind.FAILED, message=message, host=host,
                         hint="check CUDA_VISIBLE_DEVICES and the instance's GPU count",
                         driver_version=driver, cuda_version=cuda, skipped=skipped, taken_at=now)
    return GpuStatus(StatusKind.OK, gpus=gpus, processes=procs, driver_version=driver,
                     cuda_version=cuda, skipped=skipped, host=host, taken_at=now, warnings=warnings)


def _smi_warnings(rc: int, messages: Sequence[str], gpus: Sequence[Gpu]) -> list[str]:
    """Warnings for rows that came with a non-zero exit status, messages, or lost GPUs."""
    out = []
    if rc != 0:
        hint = _SMI_EXIT_HINTS.get(rc, "run `nvidia-smi` in a %%remote cell to see the whole message")
        out.append(f"nvidia-smi exited with status {rc} ({exit_meaning(rc)}) while listing "
                   f"{len(gpus)} GPU(s); {hint}")
    for msg in dict.fromkeys(messages):
        out.append(f"nvidia-smi: {msg}")
    for gpu in gpus:
        lost = [v for v in vars(gpu).values()
                if isinstance(v, Unknown) and v.raw.lower() == "[gpu is lost]"]
        if lost:
            out.append(f"{gpu.label}: nvidia-smi cannot read it ({lost[0].raw}): reboot the machine; "
                       "if it stays so, ask the platform for another machine")
    return out


def query_status(machine, *, cuda_version: str | Unknown | None = None,
                 timeout: float = 30) -> GpuStatus:
    """One snapshot of ``machine``'s GPUs in one SSH round trip.

    Parameters
    ----------
    machine : Machine
    cuda_version : str, optional
        The driver's CUDA version if already known (then ``nvidia-smi --version`` is not run).
    timeout : float
        Seconds.

    Raises
    ------
    ConnectionLost, RemoteTimeout
        Only for the connection; whatever nvidia-smi says becomes the status kind.
    """
    script = sections_script(status_commands(with_version=cuda_version is None))
    login_path = machine.login_env().get("PATH")  # read once per connection
    if login_path:  # where ~/.bashrc or /etc/profile put nvidia-smi, as over `ssh host`
        script = f"PATH={shlex.quote(login_path)}; export PATH\n{script}"
    r = machine.exec(shlex.join(shell(script)), timeout=timeout)
    return status_from_sections(split_sections(r.stdout), host=machine.name,
                                cuda_version=cuda_version)


# -- the --watch refresher ----------------------------------------------------------------------


class Watcher:
    """Refresh a status every ``interval`` seconds from a background thread.

    Parameters
    ----------
    fetch : callable
        ``fetch(previous) -> GpuStatus``; may raise (connection trouble).
    on_update : callable
        Called from the thread with each new status (update widget values here; never
        write to an Output widget from a thread).
    on_stop : callable
        Called once with the reason the watch ended: from the thread that called
        :meth:`stop` (so a ``%gpu status --stop`` cell shows what it stopped), or from the
        watch thread when the watch ends by itself.
    interval : float
        Seconds between refreshes.
    is_connected : callable
        Checked before each refresh; False ends the watch ("disconnected").
    max_failures : int
        Consecutive failed refreshes that end the watch.
    """

    def __init__(self, fetch: Callable, on_update: Callable, on_stop: Callable, *,
                 interval: float, is_connected: Callable[[], bool] = lambda: True,
                 max_failures: int = 3, previous: GpuStatus | None = None):
        if not (isinstance(interval, (int, float)) and 0 < interval < float("inf")):
            raise ValueError("interval must be a positive number of seconds")
        self.fetch, self.on_update, self.on_stop = fetch, on_update, on_stop
        self.interval = interval
        self.is_connected = is_connected
        self.max_failures = max_failures
        self.previous = previous
        self.refreshes = 0
        self.failures = 0
        self.reason = ""
        self._stop_reason = "stopped (%gpu status --stop)"
        self._stop = threading.Event()
        self._stopped_by_caller = False
        self._stop_told = False
        self._thread = threading.Thread(target=self._loop, name="gpumagic-status-watch", daemon=True)

    def start(self) -> "Watcher":
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, reason: str = "stopped (%gpu status --stop)", wait: float = 5.0) -> None:
        """Ask the thread to end, and wait for it (``wait`` seconds at most); ``on_stop``
        receives ``reason``."""
        self._stop_reason = reason
        self._stopped_by_caller = threading.current_thread() is not self._thread
        self._stop.set()
        if self._thread.is_alive() and self._stopped_by_caller:
            self._thread.join(wait)
        if self._stopped_by_caller and not self._thread.is_alive() and not self._stop_told:
            self._stop_told = True
            self.on_stop(self.reason or reason)

    def _loop(self) -> None:
        reason = "stopped"
        try:
            while not self._stop.wait(self.interval):
                if not self.is_connected():
                    reason = "stopped: the machine is disconnected"
                    break
                try:
                    status = self.fetch(self.previous)
                except (GpumagicError, OSError) as e:
                    self.failures += 1
                    if self.failures >= self.max_failures:
                        msg = getattr(e, "message", str(e))
                        reason = f"stopped after {self.failures} failed refreshes in a row ({msg})"
                        break
                    continue
                self.failures = 0
                self.refreshes += 1
                self.previous = status
                self.on_update(status)
            else:
                reason = self._stop_reason
        except Exception as e:  # a bug in on_update: say so instead of dying silently
            reason = f"stopped: {type(e).__name__}: {e}"
        self.reason = reason
        if not self._stopped_by_caller and not self._stop_told:
            self._stop_told = True
            self.on_stop(reason)


# -- failure hints for %%remote cells ------------------------------------------------------------

_NOSPACE_PATH = re.compile(r"No space left on device: '([^']+)'")


def failure_hint(stderr: str, exit_code: int) -> str | None:
    """One line of advice for a failed cell whose stderr shows a well-known failure.

    Looks at the last 64 KiB of ``stderr``: CUDA out of memory, a CUDA driver older than
    PyTorch's build, a full disk; and at ``exit_code`` 137 (killed by SIGKILL, usually the
    OOM killer).  Returns None when nothing is recognised.
    """
    tail = stderr[-65536:]
    if re.search(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory", tail):
        return ("GPU memory ran out: halve the batch size, use mixed precision "
                "(torch.autocast(\"cuda\", dtype=torch.bfloat16)), or gradient checkpointing; "
                "`%gpu status` shows what holds the memory")
    if "CUDA driver version is insufficient" in tail:
        return ("this PyTorch was built for a newer CUDA than the driver supports: "
                "`%gpu doctor` shows both versions and which build to install")
    if "No space left on device" in tail:
        m = _NOSPACE_PATH.search(tail)
        where = f"the disk holding {m.group(1)}" if m else "a disk"
        return (f"{where} is full: `%gpu doctor` lists each mount with its free space "
                "(write large files to the data disk)")
    if exit_code == 137:
        # SIGKILL from outside: gpumagic's own stops raise KeyboardInterrupt/RemoteTimeout
        # instead.  The shell usually prints "Killed", but not every shell does.
        return ("the process was killed (SIGKILL, exit 137), most often by the kernel's OOM killer "
                "when host RAM ran out: use fewer DataLoader workers, load data lazily, or check "
                "`free -g` and `dmesg | tail`")
    return None


# -- doctor ----------------------------------------------------------------------------------


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


#: Prints ``sys.version``; ``env<TAB>venv|conda|system<TAB>sys.prefix``; then
#: ``torch.__version__ torch.version.cuda`` (``2.11.0+cu130 13.0``), or ``no-torch ERROR``.
#: The same shape as the recorded ``torch-version.txt`` (which lacks the env line).
PYTHON_PROBE = (
    "import os, sys\n"
    "print(sys.version.replace('\\n', ' '))\n"
    "kind = ('conda' if os.path.isdir(os.path.join(sys.prefix, 'conda-meta')) else\n"
    "        'venv' if sys.prefix != sys.base_prefix else 'system')\n"
    "print('env', kind, sys.prefix, sep='\\t')\n"
    "try:\n"
    "    import torch\n"
    "except Exception as e:\n"
    "    print('no-torch', type(e).__name__ + ':', e)\n"
    "else:\n"
    "    print(torch.__version__, torch.version.cuda)\n"
)

ENV_PROBE = ('printf "VIRTUAL_ENV=%s\\nCONDA_DEFAULT_ENV=%s\\npython3=%s\\ntmux=%s\\nrsync=%s\\n" '
             '"$VIRTUAL_ENV" "$CONDA_DEFAULT_ENV" "$(command -v python3)" "$(command -v tmux)" '
             '"$(command -v rsync)"')


def sample_command(seconds: int) -> str:
    """Read ``/proc/stat`` before and after ``seconds`` of GPU utilisation samples (1 per s)."""
    return (f"grep '^cpu' /proc/stat; echo '--gpu'; i=0; while [ $i -lt {int(seconds)} ]; do "
            "smi --query-gpu=utilization.gpu --format=csv,noheader,nounits; sleep 1; "
            "i=$((i+1)); done; echo '--end'; grep '^cpu' /proc/stat")


def doctor_commands(sample: int = 0) -> dict[str, str]:
    """Sections gathered for the doctor, in one round trip."""
    cmds = {**status_commands(), "torch": f"python3 -c {shlex.quote(PYTHON_PROBE)}",
            "env": ENV_PROBE, "cwd": "pwd -P", "df": "df -P -B1 2>/dev/null || df -Pk"}
    if sample:
        cmds["sample"] = sample_command(sample)
    return cmds


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
    """Parse :data:`PYTHON_PROBE` output (and the recorded ``torch-version.txt``).

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
    """``NAME=value`` lines of :data:`ENV_PROBE` -> dict."""
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
    """Parse :func:`sample_command` output: /proc/stat, ``--gpu``, util lines, ``--end``, /proc/stat."""
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
    """All doctor checks over the sections :func:`doctor_commands` gathered (pure)."""
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


def run_doctor(machine, *, expect_gpu: str | None = None, expect_count: int | None = None,
               sample: int = 0, timeout: float = 120) -> DoctorReport:
    """Gather everything in one round trip (through the login environment, so the python,
    venv and conda the user gets) and run :func:`diagnose`.

    Raises
    ------
    ConnectionLost, RemoteTimeout
    RemoteCommandError
        When the script printed nothing to check (e.g. the working directory is gone).
    """
    script = sections_script(doctor_commands(sample))
    r = machine.run(shell(script), quiet=True, timeout=timeout + sample)
    sections = split_sections(r.stdout)
    if not sections:
        last = (r.stderr.strip().splitlines() or [f"exit status {r.exit_code}"])[-1]
        raise RemoteCommandError(f"the doctor's checks did not run on {machine.name}: {last}",
                                 exit_code=r.exit_code, stdout=r.stdout, stderr=r.stderr,
                                 hint="fix the working directory with `%gpu cd DIR`, then run "
                                      "`%gpu doctor` again")
    return diagnose(sections, host=machine.name, expect_gpu=expect_gpu,
                    expect_count=expect_count, sample=sample)
