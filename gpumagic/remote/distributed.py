"""torchrun jobs: one training script on several GPUs of one machine, or on several machines.

gpumagic starts PyTorch's own launcher, ``python -m torch.distributed.run`` (``torchrun``), as
a detached job (:mod:`gpumagic.remote.jobs`) on each machine; it never writes a rendezvous,
process group or scheduler of its own.

- One machine: ``torchrun --standalone --nproc-per-node N``.
- Several machines: one torchrun per machine with ``--nnodes K --rdzv-backend c10d``, a unique
  ``--rdzv-id`` (``NAME-`` and 8 random hex digits) and ``--rdzv-endpoint HOST:PORT`` on the
  first machine, at an address the others reached in the preflight.

Each torchrun runs with ``--log-dir DIR/logs --tee 3``, so every rank's stdout and stderr go to
its own files *and* to the job's log with torchrun's ``[defaultL]:`` prefix (``L`` the local
rank).  The worker program is ``torchrun_rank.py``, which records ``ranks/RANK`` (local rank
and pid) and then runs the script, so a global rank is found on its machine.  The per-job
folder is ``~/.gpumagic/torchrun/NAME/`` on every machine: ``script.py``, ``rank.py``,
``hosts`` (the machine names, in order), ``ranks/``, ``logs/``.

Preflight (:func:`preflight`), before anything starts: the torch / CUDA / NCCL versions, the
code tree (a SHA-256 per code file under the working directory), the ``same_dir`` files
(names and sizes, or content hashes), the GPU counts, and a TCP connect with a deadline from
every machine to a listener at the endpoint.  A mismatch raises :class:`JobError` with a table
naming, per host, the differing file or version; nothing is left running.
"""

from __future__ import annotations

import re
import secrets
import shlex
import time
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from ..errors import JobError
from . import jobs, program
from .execution import run_program
from .execution import cell_bytes, cell_text

if TYPE_CHECKING:
    from .._types import MachineLike

#: Per-job folder on each machine, relative to the remote HOME.
TORCHRUN_DIR = ".gpumagic/torchrun"
#: Seconds a machine gets to open a TCP connection to the rendezvous endpoint.
REACH_DEADLINE = 5.0
#: Python exception line (``ValueError: ...``, ``torch.OutOfMemoryError: ...``).
_EXC_RE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Warning)\b.*$|^[A-Za-z_][\w.]*: .+$")
_PREFIX_RE = re.compile(r"^\[default(\d+)\]:(.*)$")


def _prun(machine: MachineLike, name: str, *args, **kw):
    return run_program(machine.connection, name, *args, **kw)


def folder(name: str) -> str:
    return f"~/{TORCHRUN_DIR}/{name}"


def parse_nproc(value) -> int | str:
    """``2`` / ``"2"`` -> 2; ``"auto"`` -> ``"auto"``; anything else raises :class:`JobError`."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        n = int(str(value).strip())
    except ValueError:
        n = 0
    if n < 1 or n > 1024:
        raise JobError(f"--torchrun takes a number of processes per machine (1-1024) or auto, not {value!r}",
                       "e.g. --torchrun 2, or --torchrun auto for one per visible GPU")
    return n


@dataclass
class Probe:
    """What one machine reported (``torchrun_probe.sh``)."""

    host: str
    python: str = "none"
    torch: str = "none"
    cuda: str = "none"
    nccl: str = "none"
    gpus: int = 0
    visible: str = "all"
    code: dict[str, str] = field(default_factory=dict)
    data: dict[str, tuple[str, str]] | None = None
    addrs: list[str] = field(default_factory=list)

    @property
    def visible_gpus(self) -> int:
        """GPUs the job sees: ``CUDA_VISIBLE_DEVICES`` (comma-separated ids; empty: none)
        when set, else the ``nvidia-smi -L`` count."""
        if self.visible == "all":
            return self.gpus
        ids = [v for v in self.visible.split(",") if v.strip() and v.strip() != "-1"]
        return min(len(ids), self.gpus) if self.gpus else 0


def parse_probe(host: str, text: str) -> Probe:
    p = Probe(host)
    for line in text.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("python", "torch", "cuda", "nccl", "visible"):
            setattr(p, word, rest.strip())
        elif word == "gpus":
            p.gpus = int(rest) if rest.strip().isdigit() else 0
        elif word == "code":
            sha, _, path = rest.partition(" ")
            p.code[path] = sha
        elif word == "data":
            size, _, rest2 = rest.partition(" ")
            sha, _, path = rest2.partition(" ")
            if p.data is not None:
                p.data[path] = (size, sha)
        elif word == "datadir":
            p.data = {}
        elif word == "addr":
            p.addrs.append(rest.strip())
    return p


def _table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:{w}}}" for w in widths)
    return "\n".join(fmt.format(*r).rstrip() for r in [header, *rows])


def compare(probes: Sequence[Probe], same_dir: str | None = None) -> str:
    """The mismatch table (``what  host-a  host-b ...``), empty when every machine agrees.

    Rows: ``torch``/``cuda``/``nccl`` versions; each code file whose hash differs or that one
    machine lacks (``code PATH``, cells ``sha256:12 digits`` or ``missing``); each ``same_dir``
    file whose size (or hash) differs (``data PATH``, cells ``N bytes``).
    """
    hosts = [p.host for p in probes]
    rows: list[tuple[str, ...]] = []
    for key in ("torch", "cuda", "nccl"):
        vals = [getattr(p, key) for p in probes]
        if len(set(vals)) > 1:
            rows.append((key, *vals))
    for path in sorted(set().union(*(p.code for p in probes))):
        vals = [p.code.get(path) for p in probes]
        if len(set(vals)) > 1:
            rows.append((f"code {path}", *(f"sha256:{v[:12]}" if v else "missing" for v in vals)))
    if same_dir:
        if any(p.data is None for p in probes):
            rows.append((f"data {same_dir}", *("missing" if p.data is None else "present" for p in probes)))
        else:
            for path in sorted(set().union(*(p.data or {} for p in probes))):
                vals = [(p.data or {}).get(path) for p in probes]
                if len(set(vals)) > 1:
                    sizes = {v[0] for v in vals if v}
                    rows.append((f"data {path}", *(
                        "missing" if v is None else (f"{v[0]} bytes" if len(sizes) > 1 or v[1] == "-"
                                                     else f"sha256:{v[1][:12]}") for v in vals)))
    return _table(rows, ("differs", *hosts)) if rows else ""


def probe(machine: MachineLike, *, cwd: str | None = None, same_dir: str | None = None, same_dir_hash: bool = False,
          python: str = "") -> Probe:
    r = _prun(machine, "torchrun_probe.sh", python, cwd if cwd is not None else (machine.cwd or ""),
                    same_dir or "", "1" if same_dir_hash else "0", timeout=300)
    return parse_probe(machine.name, r.stdout)


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


@dataclass
class Plan:
    """The outcome of a passed preflight: per machine its probe, and the endpoint."""

    probes: list[Probe]
    endpoint: str = ""
    devs: dict[str, str] = field(default_factory=dict)
    nproc: int = 1
    took: float = 0.0


@dataclass(frozen=True)
class TorchrunOptions:
    """How one torchrun run spans its machines (``--torchrun``, ``--torchrun-args``,
    ``--same-dir``): what :func:`preflight` checks and :func:`start` launches.  The job's own
    options (cwd, env, alerts, shutdown) are a :class:`gpumagic.remote.jobs.JobOptions`.

    Attributes
    ----------
    nproc : int or "auto"
        Processes per machine; ``auto`` is the GPUs visible to the job (``CUDA_VISIBLE_DEVICES``,
        else ``nvidia-smi -L``), which must be the same non-zero count everywhere.
    torchrun_args : str or sequence of str
        More torchrun options (``"--max-restarts 1"``), split like a shell line.
    same_dir, same_dir_hash
        A data folder (relative to the job's ``cwd``) that must hold the same file names and
        sizes (with ``same_dir_hash``: the same SHA-256) on every machine.
    python : str
        The python whose torch runs the ranks (default: the one ``python3`` finds).
    endpoint_host, endpoint_port
        Where the rendezvous listens on the first machine (default: 127.0.0.1 when every machine
        is reached over loopback, else the first machine's first ``hostname -I`` address; port 0:
        one the first machine picks).
    deadline : float
        Seconds each machine gets for its TCP connect to the endpoint.
    """

    nproc: int | str = 1
    torchrun_args: str | Sequence[str] = ()
    same_dir: str | None = None
    same_dir_hash: bool = False
    python: str = ""
    endpoint_host: str | None = None
    endpoint_port: int = 0
    deadline: float = REACH_DEADLINE


#: The fields of :class:`TorchrunOptions`: what the plain-Python API takes as keywords.
TORCHRUN_OPTION_NAMES = frozenset(f.name for f in fields(TorchrunOptions))


def split_options(options: Mapping[str, object]) -> tuple[jobs.JobOptions, TorchrunOptions]:
    """Keywords of the plain-Python API (``gpumagic.start_distributed(..., nproc=2,
    cwd="proj")``) as the two option objects; ``TypeError`` names a keyword that is neither."""
    run = {k: v for k, v in options.items() if k in TORCHRUN_OPTION_NAMES}
    job = jobs.JobOptions().with_(**{k: v for k, v in options.items() if k not in TORCHRUN_OPTION_NAMES})
    return job, TorchrunOptions(**run)  # type: ignore[arg-type]


def preflight(machines: Sequence[MachineLike], options: TorchrunOptions = TorchrunOptions(),
              cwd: str | None = None) -> Plan:
    """Check that ``machines`` can run one torchrun job together, with the job's working
    directory ``cwd``; returns the :class:`Plan` (``options``: see :class:`TorchrunOptions`).

    Raises
    ------
    JobError
        No torch on a machine (naming its python and the install command); ``auto`` with no
        visible GPU; a mismatch (a table per host); an endpoint a machine cannot reach.
    """
    t0 = time.monotonic()
    nproc, same_dir, deadline = options.nproc, options.same_dir, options.deadline
    endpoint_host, endpoint_port = options.endpoint_host, options.endpoint_port
    probes = [probe(m, cwd=cwd, same_dir=same_dir, same_dir_hash=options.same_dir_hash, python=options.python)
              for m in machines]
    for p in probes:
        if p.torch == "none":
            py = p.python if p.python != "none" else "python3"
            raise JobError(f"{p.host} has no torch for {py}, so torchrun cannot start there",
                           f"install it there: `{py} -m pip install torch`")
    table = compare(probes, same_dir)
    if table:
        raise JobError("the machines differ, so the job was not started:\n" + table,
                       "sync the same code and data to every machine (`%gpu sync`), and install the same torch")
    if nproc == "auto":
        counts = {p.host: p.visible_gpus for p in probes}
        if len(set(counts.values())) > 1 or not any(counts.values()):
            detail = ", ".join(f"{h}: {n}" for h, n in counts.items())
            raise JobError(f"--torchrun auto counts the visible GPUs ({detail}), and needs the same "
                           "non-zero count on every machine",
                           "give a number instead (--torchrun 2 runs 2 processes per machine, on CPU with gloo)")
        nproc = next(iter(counts.values()))
    plan = Plan(probes, nproc=int(nproc))
    if len(machines) > 1:
        first = machines[0]
        if endpoint_host is None:
            hosts = [getattr(getattr(m, "spec", None), "hostname", "") or "" for m in machines]
            if all(_loopback(h) for h in hosts) or not probes[0].addrs:
                endpoint_host = "127.0.0.1"
            else:
                endpoint_host = probes[0].addrs[0]
        r = _prun(first, "torchrun_listen.py", endpoint_host, endpoint_port, deadline + 10, len(machines))
        m = re.search(r"^port (\d+)", r.stdout, re.M)
        if not m:
            raise JobError(f"could not listen on port {endpoint_port} on {first.name} for the rendezvous: "
                           f"{(r.stdout + r.stderr).strip().splitlines()[-1:] or ['no answer']}",
                           "pick another port (--torchrun-args \"--rdzv-endpoint HOST:PORT\" is not "
                           "needed: port 0 lets the machine pick)")
        port = int(m.group(1))
        plan.endpoint = f"{endpoint_host}:{port}"
        bad = []
        for mach in [*machines[1:], first]:  # the first last: its connect ends the listener
            rr = _prun(mach, "torchrun_reach.sh", probes[0].python if mach is first else "",
                             endpoint_host, port, deadline, timeout=deadline + 60)
            dev = re.search(r"^dev (\S+)", rr.stdout, re.M)
            if dev:
                plan.devs[mach.name] = dev.group(1)
            if not re.search(r"^ok$", rr.stdout, re.M):
                why = re.search(r"^error (.*)$", rr.stdout, re.M)
                bad.append((mach.name, why.group(1) if why else (rr.stderr.strip() or "no answer")))
        if bad:
            rows = [(h, plan.endpoint, w) for h, w in bad]
            raise JobError(f"the rendezvous endpoint {plan.endpoint} on {first.name} cannot be reached "
                           f"within {deadline:g} s, so the job was not started:\n"
                           + _table(rows, ("host", "endpoint", "error")),
                           "open that port between the machines (a firewall or security group), or give "
                           "endpoint_host/--rdzv-host an address every machine reaches")
    plan.took = time.monotonic() - t0
    return plan


# -- the job ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Failure:
    """The first rank that failed, from torchrun's ``Root Cause (first observed failure)``."""

    host: str
    rank: int
    local_rank: int
    exitcode: str
    line: str
    when: str = ""

    def __str__(self) -> str:
        return f"rank {self.rank} on {self.host} failed (exit {self.exitcode}): {self.line}"


def parse_failure(host: str, log: str, stderr: str = "") -> Failure | None:
    """Read torchrun's root-cause block (``rank : 3 (local_rank: 1)``, ``exitcode : 1``, ``time``)
    from a job log, and the rank's last exception line from ``stderr`` (its ``stderr.log``),
    else from its ``[defaultL]:`` lines in the log (torchrun's tee may print them after the
    block, or not at all when it stops)."""
    i = log.rfind("Root Cause (first observed failure)")
    if i < 0:
        return None
    block = log[i:i + 2000]
    m = re.search(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)", block)
    if not m:
        return None
    rank, local = int(m.group(1)), int(m.group(2))
    code = re.search(r"exitcode\s*:\s*(-?\d+)", block)
    when = re.search(r"time\s*:\s*(\S+)", block)
    lines = [ln for ln in rank_lines(log, local) if ln.strip()]
    lines += [ln for ln in stderr.splitlines() if ln.strip()]
    exc = next((ln.strip() for ln in reversed(lines) if _EXC_RE.match(ln.strip())), "")
    return Failure(host, rank, local, code.group(1) if code else "?", exc or (lines[-1].strip() if lines else ""),
                   when.group(1) if when else "")


def rank_lines(log: str, local_rank: int) -> list[str]:
    """The lines of local rank ``local_rank`` in a torchrun ``--tee 3`` log (prefix removed)."""
    out = []
    for ln in log.splitlines():
        m = _PREFIX_RE.match(ln)
        if m and int(m.group(1)) == local_rank:
            out.append(m.group(2))
    return out


@dataclass
class DistributedJob:
    """A handle over every rank of a torchrun job, on one or several machines.

    Attributes
    ----------
    name : str
    parts : list of Job
        One detached job per machine (same name), in host order (the first holds the endpoint).
    nproc : int
        Processes per machine; world size is ``nproc * len(parts)``.
    plan : Plan or None
        The preflight (None for a handle found by name).
    """

    name: str
    parts: list
    nproc: int = 0
    plan: Plan | None = None

    @property
    def hosts(self) -> list[str]:
        return [j.machine.name for j in self.parts]

    def infos(self) -> list:
        return [j.info() for j in self.parts]

    def ranks(self) -> dict[int, tuple[object, int]]:
        """Global rank -> (Job, local rank), from each machine's ``ranks/`` files."""
        found: dict[int, tuple[object, int]] = {}
        for j in self.parts:
            r = _prun(j.machine, "torchrun_ranks.sh", folder(self.name))
            for line in r.stdout.splitlines():
                parts = line.split()
                if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
                    found[int(parts[0])] = (j, int(parts[1]))
        return found

    def failure(self) -> Failure | None:
        """The rank that failed first (earliest torchrun ``time``), or None."""
        found = []
        for j in self.parts:
            log = j.logs(None)
            f = parse_failure(j.machine.name, log)
            if f is not None:
                err = _prun(j.machine, "torchrun_ranklog.sh", folder(self.name), f.local_rank, "stderr", 200).stdout
                found.append(parse_failure(j.machine.name, log, err))
        return min(found, key=lambda f: f.when) if found else None

    @property
    def state(self) -> str:
        """``running``; ``exited 0``; ``failed: rank 3 on b failed (exit 1): ValueError: ...``;
        ``killed (user)``; or per host when they differ (``a: exited 0, b: lost``)."""
        infos = self.infos()
        if any(i.running for i in infos):
            return "running"
        if any(i.exit_code not in (0, None) and not i.killed for i in infos):
            f = self.failure()
            if f:
                return f"failed: {f}"
        texts = {i.state_text for i in infos}
        if len(texts) == 1:
            return texts.pop()
        return ", ".join(f"{h}: {i.state_text}" for h, i in zip(self.hosts, infos))

    def logs(self, rank: int = 0, lines: int | None = 100) -> str:
        """The last ``lines`` lines (None: all) of global rank ``rank``'s output.

        Raises
        ------
        JobError
            No such rank (yet): the ranks found are named.
        """
        ranks = self.ranks()
        if rank not in ranks:
            raise JobError(f"job {self.name} has no rank {rank} "
                           f"({'ranks ' + ', '.join(map(str, sorted(ranks))) if ranks else 'no rank has started yet'})",
                           f"`%gpu logs {self.name} --rank R` with one of those")
        job, local = ranks[rank]
        out = rank_lines(job.logs(None), local)
        if lines is not None:
            out = out[-lines:] if lines else []
        return "".join(ln + "\n" for ln in out)

    def logs_all(self, lines: int | None = 100) -> str:
        """Every rank's lines, prefixed ``[host:rank]`` (each machine's ranks in log order)."""
        ranks = self.ranks()
        by = {(j.machine.name, local): r for r, (j, local) in ranks.items()}
        out = []
        for j in self.parts:
            for ln in j.logs(None).splitlines():
                m = _PREFIX_RE.match(ln)
                if m:
                    r = by.get((j.machine.name, int(m.group(1))), f"local{m.group(1)}")
                    out.append(f"[{j.machine.name}:{r}] {m.group(2)}")
        if lines is not None:
            out = out[-lines:] if lines else []
        return "".join(ln + "\n" for ln in out)

    def wait(self, timeout: float | None = None, poll: float = 2.0) -> str:
        """Block until every machine's torchrun has ended; returns :attr:`state`.

        When one machine's torchrun fails while another's still runs, the others are killed, so
        no rank waits for ever on a peer that is gone.

        Raises
        ------
        RemoteTimeout
            After ``timeout`` seconds (the job keeps running).
        """
        from ..errors import RemoteTimeout

        end = None if timeout is None else time.monotonic() + timeout
        while True:
            infos = self.infos()
            if not any(i.running for i in infos):
                return self.state
            if any(i.exit_code not in (0, None) for i in infos):
                for j, i in zip(self.parts, infos):
                    if i.running:
                        j.kill("peer")
                continue
            if end is not None and time.monotonic() > end:
                raise RemoteTimeout(f"job {self.name} still runs after {timeout:g} s",
                                    f"wait longer, or `%gpu kill {self.name}`")
            time.sleep(poll)

    def cancel_shutdown(self) -> dict[str, str]:
        """Cancel the shutdown ``then_shutdown`` armed on every machine of the run; returns
        machine name -> ``cancelled``, ``none`` or ``started`` (see
        :meth:`gpumagic.remote.jobs.Job.cancel_shutdown`)."""
        return {j.machine.name: j.cancel_shutdown() for j in self.parts}

    def kill(self, reason: str = "user") -> str:
        """End every rank on every machine (each machine's whole job process tree)."""
        for j in self.parts:
            j.kill(reason)
        return self.state


#: What chooses the network interface for each backend: NCCL, Gloo (the gloo process group),
#: TensorPipe (torch.distributed.rpc); each is set to the interface the rendezvous reached the
#: first machine by, unless the job's environment sets it.
SOCKET_IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


def command(name: str, *, python: str, nproc: int, nnodes: int, endpoint: str = "", rdzv_id: str = "",
            torchrun_args: Sequence[str] = (), exec_argv: Sequence[str] | None = None,
            socket_ifname: str = "", is_host: bool = True) -> str:
    """The job's bash command on one machine: ``exec PYTHON -m torch.distributed.run ...``."""
    d = f'"$HOME"/{TORCHRUN_DIR}/{name}'
    argv = [python, "-m", "torch.distributed.run"]
    if nnodes == 1 and not endpoint:
        argv += ["--standalone", "--nnodes", "1"]
    else:
        # is_host: only the first machine runs the c10d store (by default every machine whose
        # name matches the endpoint host would, which a loopback endpoint matches everywhere).
        argv += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-id", rdzv_id,
                 "--rdzv-endpoint", endpoint, "--rdzv-conf", f"is_host={1 if is_host else 0}"]
    argv += ["--nproc-per-node", str(nproc), "--tee", "3", *torchrun_args]
    tail = ["--exec", *exec_argv] if exec_argv else []
    q = " ".join(shlex.quote(a) for a in argv)
    # torchrun itself (its logs/ and the ranks/ files) runs private, umask 077; rank.py gives
    # the training script the user's umask back, so its checkpoints are made as in a plain cell.
    lines = [f"export GPUMAGIC_TORCHRUN_DIR={d}", 'export GPUMAGIC_UMASK="$(umask)"', "umask 077"]
    if socket_ifname:  # every backend that picks an interface by itself gets the rendezvous's
        lines += [f"export {v}=\"${{{v}:-{socket_ifname}}}\"" for v in SOCKET_IFNAME_VARS]
    lines.append(f"exec {q} --log-dir {d}/logs {d}/rank.py"
                 + ("" if exec_argv else f" {d}/script.py") + (" " + " ".join(shlex.quote(a) for a in tail)
                                                            if tail else ""))
    return "\n".join(lines) + "\n"


def start(machines: Sequence[MachineLike], name: str, script: str,
          job: jobs.JobOptions = jobs.JobOptions(), torchrun: TorchrunOptions = TorchrunOptions(), *,
          record: Callable[[Sequence[MachineLike], str, str, int | str, list[str]], None] | None = None
          ) -> DistributedJob:
    """Start ``script`` under torchrun on every machine of ``machines``; returns at once.

    Parameters
    ----------
    machines : sequence of Machine
        One or more connected machines; the first holds the rendezvous endpoint.
    name : str
        Job name (:data:`gpumagic.remote.jobs.NAME_RE`), the same on every machine.
    script : str
        Python source of the training script, or a command line starting with ``!``
        (``!python train.py --lr 1e-3``), run by each rank.
    job : JobOptions
        The job on each machine (``cwd``, ``env``, ``stop_on``, ``alerts``, ``then_shutdown``;
        ``python`` is not used: the script is Python, or the ``!`` command line).
    torchrun : TorchrunOptions
        Processes per machine (``auto``: the visible GPUs, see :func:`preflight`), torchrun's
        own options, the data folder that must be the same everywhere, the rendezvous.
    record : callable, optional
        Called once every rank started, with ``(machines, name, script, nproc, torchrun
        args)``: what a later move starts again (the machine and the magics hand in
        :func:`gpumagic.remote.move.record_torchrun`).

    ``job.then_shutdown``
        Minutes after which *every* machine of the run shuts down once the run has succeeded:
        each machine's job arms its own shutdown (as a plain job's ``then_shutdown``), which
        starts when that machine's torchrun exits 0.  torchrun exits only after every rank of
        the run has ended (its exit barrier waits for the agents of all machines), so no
        machine goes down under a running rank.  A failed or killed run shuts nothing down.
        Every machine's shutdown is checked before anything starts.

    Raises
    ------
    JobError
        A bad name or ``nproc``; a job of that name runs on one of the machines; one of them
        cannot shut itself down (with ``then_shutdown``); the preflight refused (see
        :func:`preflight`).
    """
    jobs.check_name(name)
    torchrun = replace(torchrun, nproc=parse_nproc(torchrun.nproc))
    torchrun_args = torchrun.torchrun_args
    machines = list(machines)
    if not machines:
        raise JobError("no machine to run on", "connect one first: `%gpu connect NAME`")
    names = [m.name for m in machines]
    if len(set(names)) != len(names):
        raise JobError(f"--hosts names a machine twice ({', '.join(names)})", "name each machine once")
    extra = split_torchrun_args(torchrun_args) if isinstance(torchrun_args, str) else list(torchrun_args)
    exec_argv = None
    script = cell_text(script)  # CRLF -> LF, no NUL
    text = script.lstrip()
    if text.startswith("!"):
        first = text[1:].partition("\n")[0].strip()
        try:
            exec_argv = shlex.split(text[1:].strip())
        except ValueError as e:
            raise JobError(f"cannot split the cell's command line after '!' ({first[:60]!r}): {e}",
                           "close the quote (write a quote inside a word as \\' or \"'\")") from None
        if not exec_argv:
            raise JobError("the cell's command line after '!' is empty", "e.g. `!python train.py`")
    data = cell_bytes(script, python=exec_argv is None)  # Python source must be UTF-8
    for m in machines:
        if jobs.list_jobs(m, only=name) and any(i.running for i in jobs.list_jobs(m, only=name)):
            raise JobError(f"a job named {name!r} is already running on {m.name}",
                           f"pick another name, or `%gpu kill {name}` first")
    for m in machines:  # before anything starts: one machine that cannot shut down refuses all
        jobs.shutdown_arming(m, job.then_shutdown)
    plan = preflight(machines, torchrun, cwd=job.cwd)
    rdzv_id = f"{name}-{secrets.token_hex(4)}"
    d = folder(name)
    for m, p in zip(machines, plan.probes):
        _prun(m, "torchrun_stage.sh", d, "rank.py", "1", stdin=program.source("torchrun_rank.py").encode())
        _prun(m, "torchrun_stage.sh", d, "script.py", stdin=data)
        _prun(m, "torchrun_stage.sh", d, "hosts", stdin=("\n".join(names) + "\n").encode())
    parts = []
    try:
        for m, p in zip(machines, plan.probes):
            cmd = command(name, python=p.python, nproc=plan.nproc, nnodes=len(machines),
                          endpoint=plan.endpoint, rdzv_id=rdzv_id, torchrun_args=extra, exec_argv=exec_argv,
                          socket_ifname=plan.devs.get(m.name, "") if len(machines) > 1 else "",
                          is_host=m is machines[0])
            parts.append(m.start_job(name, cmd, replace(job, python=False)))
    except BaseException:
        for j in parts:  # nothing half-started: one machine's torchrun would wait for the others
            try:
                j.kill("start failed")
            except Exception:
                pass
        raise
    if record is not None:
        record(machines, name, script, torchrun.nproc, extra)  # what a move starts again
    return DistributedJob(name, parts, nproc=plan.nproc, plan=plan)


def split_torchrun_args(text: str) -> list[str]:
    """``--torchrun-args`` as torchrun's own words, split as a shell would
    (``"--max-restarts 1 --rdzv-conf 'timeout=900'"``).

    Raises
    ------
    JobError
        For an unclosed quote (naming the option and the text).
    """
    try:
        return shlex.split(text)
    except ValueError as e:
        raise JobError(f"--torchrun-args {text!r}: cannot split it ({e})",
                       'close the quote, e.g. --torchrun-args "--max-restarts 1"') from None


def find(machine_named: Callable[[str], MachineLike], machine: MachineLike, name: str) -> DistributedJob | None:
    """The torchrun job ``name`` that ``machine`` took part in (its ``hosts`` file names the
    machines), or None when it is a plain job.  ``machine_named``: a callable name ->
    Machine (``Fleet.get``)."""
    r = machine.exec(f"cat \"$HOME\"/{TORCHRUN_DIR}/{shlex.quote(name)}/hosts 2>/dev/null")
    hosts = [h.strip() for h in r.stdout.splitlines() if h.strip()]
    if not hosts:
        return None
    machines = [machine if h == machine.name else machine_named(h) for h in hosts]
    return DistributedJob(name, [m.job(name) for m in machines])


# -- fan-out: one experiment, one setting per machine -------------------------------------------


def parse_each(items: Sequence[str]) -> list[dict[str, str]]:
    """``["LR=1e-3", "LR=3e-4 BS=64"]`` -> ``[{"LR": "1e-3"}, {"LR": "3e-4", "BS": "64"}]``
    (each item: ``K=V`` pairs separated by spaces, split like a shell line).

    Raises
    ------
    JobError
        An item without ``=`` or with a name that is not a shell variable name.
    """
    out = []
    for item in items:
        env = {}
        try:
            pairs = shlex.split(item)
        except ValueError as e:
            raise JobError(f"--each {item!r}: cannot split it ({e})",
                           'close the quote, e.g. --each "LR=1e-3" "LR=3e-4 BS=64"') from None
        for pair in pairs:
            k, eq, v = pair.partition("=")
            if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                raise JobError(f"--each {item!r}: {pair!r} is not NAME=VALUE",
                               'e.g. --each "LR=1e-3" "LR=3e-4 BS=64"')
            env[k] = v
        out.append(env)
    return out


def fan_out(machines: Sequence[MachineLike], name: str, command: str, each: Sequence[Mapping[str, str] | str],
            job: jobs.JobOptions = jobs.JobOptions()) -> list:
    """Start the same ``command`` as job ``name`` on every machine, machine ``i`` with the
    environment values ``each[i]`` on top of ``job.env``; returns the
    :class:`gpumagic.remote.jobs.Job` handles in machine order.

    Raises
    ------
    JobError
        ``each`` and ``machines`` differ in length (nothing started); a job of that name runs on
        one of them (nothing started); a start failed (the jobs already started are killed).
    """
    machines = list(machines)
    envs = [parse_each([e])[0] if isinstance(e, str) else dict(e) for e in each]
    if len(envs) != len(machines):
        raise JobError(f"--each gives {len(envs)} settings for {len(machines)} machines "
                       f"({', '.join(m.name for m in machines)})", "give one setting per machine, in --hosts order")
    jobs.check_name(name)
    for m in machines:
        if any(i.running for i in jobs.list_jobs(m, only=name)):
            raise JobError(f"a job named {name!r} is already running on {m.name}",
                           f"pick another name, or `%gpu kill {name}` first")
    for m in machines:  # each machine shuts down after its own job: all must be able to
        jobs.shutdown_arming(m, job.then_shutdown)
    started: list = []
    try:
        for m, e in zip(machines, envs):
            started.append(m.start_job(name, command, replace(job, env={**(job.env or {}), **e})))
    except BaseException:
        for j in started:
            try:
                j.kill("start failed")
            except Exception:
                pass
        raise
    return started
