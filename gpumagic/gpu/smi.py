"""GPU status: the nvidia-smi queries, pure parsers into typed records, one snapshot.

A snapshot is gathered by one program on the machine, ``gpu-sections.sh`` (in
``gpumagic/remote/programs/``, run through :mod:`gpumagic.remote.program`): it runs each
named *section* in turn and frames what it printed, read back by :func:`split_sections`.
Everything else here is a *pure function* over that text, so every parser is tested on
recorded output from real machines (``gpumagic/gpu/fake/recordings``, ``tests/recordings``).
The doctor's checks are in :mod:`gpumagic.gpu.doctor`, the ``--watch`` thread in
:mod:`gpumagic.gpu.watch`.

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
"""

from __future__ import annotations

import enum
import re
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence, TYPE_CHECKING

from ..remote import program

if TYPE_CHECKING:
    from .._types import MachineLike

# -- what is gathered, in one round trip ------------------------------------------------------

#: ``--query-gpu`` fields read for the status, in this order (names from ``--help-query-gpu``).
GPU_FIELDS = ("index", "uuid", "name", "driver_version", "memory.total", "memory.used",
              "memory.free", "utilization.gpu", "utilization.memory", "temperature.gpu",
              "power.draw", "power.limit", "clocks.sm", "clocks.max.sm", "pstate",
              "mig.mode.current", "fan.speed")
#: ``--query-compute-apps`` fields, in this order.
APP_FIELDS = ("pid", "process_name", "used_memory", "gpu_uuid")

#: Seconds one nvidia-smi call may take in a gathered program; a GPU in a bad state can
#: make nvidia-smi hang for minutes, and the remote call must not outlive the query.
SMI_TIMEOUT = 20

#: The machine-side program that gathers sections (``gpumagic/remote/programs/``).
SECTIONS_PROGRAM = "gpu-sections.sh"


def sections_command(sections: Sequence[str], login_path: str = "") -> str:
    """The ``/bin/sh`` command text that gathers ``sections`` on the machine.

    Parameters
    ----------
    sections : sequence of str
        ``NAME`` or ``NAME=ARG``, run in this order; the names (``gpus=FIELDS``,
        ``apps=FIELDS``, ``version``, ``torch=SOURCE``, ``env``, ``cwd``, ``df``,
        ``sample=SECONDS``) are those of ``gpu-sections.sh``, whose header says what each
        runs.  Build them with :func:`status_sections` and
        :func:`gpumagic.gpu.doctor.doctor_sections`.
    login_path : str
        The login shell's ``PATH`` (where ``~/.bashrc`` puts nvidia-smi); ``""`` keeps the
        PATH the command runs with.

    Returns
    -------
    str
        Text for ``/bin/sh``; parse what it prints with :func:`split_sections`.  Each
        nvidia-smi call runs under ``timeout`` :data:`SMI_TIMEOUT` (status 124 when it hangs).
    """
    return program.command(SECTIONS_PROGRAM, SMI_TIMEOUT, login_path, *sections)


def status_sections(with_version: bool = True, fields: Sequence[str] = GPU_FIELDS) -> list[str]:
    """The sections of one status snapshot (see :func:`status_from_sections`): ``gpus``,
    ``apps``, and ``version`` (the driver's CUDA version) unless already known.

    nvidia-smi takes one ``--query-*`` switch per call ("Only one --query-* switch can be
    used at a time.", driver 580), so GPUs and processes are two calls in the same program;
    on an H200 the whole program runs in 0.06 s (0.08 s with ``--version``).
    """
    out = ["gpus=" + ",".join(fields), "apps=" + ",".join(APP_FIELDS)]
    if with_version:
        out.append("version")
    return out


# -- sections: what each part printed -------------------------------------------------------

_MARK = "\x1egpumagic-section"
_END = "\x1egpumagic-rc"


@dataclass(frozen=True)
class Section:
    """What one section of ``gpu-sections.sh`` printed (stdout and stderr merged) and its status."""

    text: str
    rc: int

    @property
    def missing(self) -> bool:
        """The shell could not find the program (exit status 127)."""
        return self.rc == 127


def split_sections(text: str) -> dict[str, Section]:
    """Parse the output of ``gpu-sections.sh`` (:func:`sections_command`) into ``{name: Section}``.

    The format: a line ``\\x1egpumagic-section NAME``, what the section printed, then
    ``\\x1egpumagic-rc NAME STATUS`` on a line of its own.  A section cut short (connection
    dropped, program killed) gets ``rc = -1``.
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


#: What to do about "Failed to initialize NVML: Driver/library version mismatch" (nvidia-smi, and
#: every program that loads NVML): the kernel module and the user-space libraries differ.
NVML_MISMATCH_HINT = ("the driver was upgraded but the old kernel module is still loaded: reboot the "
                      "machine (or reload the nvidia kernel modules)")


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
                NVML_MISMATCH_HINT, lib)
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


def query_status(machine: MachineLike, *, cuda_version: str | Unknown | None = None,
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
    # The login PATH (read once per connection): where ~/.bashrc or /etc/profile put
    # nvidia-smi, as over `ssh host`.
    login_path = machine.env.login().get("PATH") or ""
    command = sections_command(status_sections(with_version=cuda_version is None), login_path)
    r = machine.exec(command, timeout=timeout)
    return status_from_sections(split_sections(r.stdout), host=machine.name,
                                cuda_version=cuda_version)
