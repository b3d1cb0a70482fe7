"""The notebook side of torchrun jobs and fan-out (issue 18); the options live on the magics in
:mod:`gpumagic.notebook.magics`, which hand over here:

- ``%%remote --job NAME --torchrun N|auto [--torchrun-args "..."] [--hosts a,b]
  [--same-dir PATH [--same-dir-hash]]``: :func:`remote_cell` (torchrun, see
  :mod:`gpumagic.remote.distributed`);
- ``%%remote --job NAME --hosts a,b --each "LR=1" "LR=2"``: the same cell once per machine,
  each with its own environment values;
- with ``--then-shutdown MINUTES``: every machine of a torchrun run shuts down once every rank
  has ended successfully (each after its own job, for ``--each``); ``%gpu kill NAME
  --shutdown`` cancels that on every machine of a torchrun job;
- ``%gpu logs NAME --rank R`` / ``--all``: :func:`logs`;  ``%gpu kill NAME``: :func:`kill` ends
  every rank on every machine;  ``%gpu jobs --all``: :func:`jobs_all`;
  ``%gpu sync --from-all :runs/ results/``: :func:`sync_from_all`;  ``%gpu doctor --hosts a,b``:
  :func:`doctor_hosts`.
"""

from __future__ import annotations

from IPython.core.error import UsageError

from ...machine import start_distributed
from ...remote import distributed
from ...remote.jobs import NAME_RE
from ._args import job_options, keep_given, sync_options


def _hosts(magics, text: str | None, default_host: str | None = None) -> list:
    names = [h.strip() for h in (text or "").split(",") if h.strip()]
    if text is not None and not names:
        raise UsageError("--hosts takes connected machine names separated by commas, e.g. --hosts a,b")
    if len(set(names)) != len(names):
        raise UsageError(f"--hosts {text}: a machine is named twice")
    return [magics.fleet.get(n) for n in names] if names else [magics.fleet.get(default_host)]


def remote_cell(magics, args, cell: str):
    """``%%remote --job NAME`` with ``--torchrun``, ``--hosts`` or ``--each``."""
    if args.job is None or not NAME_RE.fullmatch(args.job):
        raise UsageError("--torchrun, --hosts and --each start a detached job: add --job NAME "
                         "(letters, digits, '-' and '_')")
    if args.timeout is not None:
        raise UsageError("--timeout does not apply to a detached job (--torchrun/--hosts/--each): "
                         "it runs until it ends; `%gpu kill NAME` stops it")
    if args.host and args.hosts:
        raise UsageError("--host and --hosts both name machines; use --hosts a,b alone")
    if keep_given(args):
        raise UsageError("--keep works with a job on one machine, not yet with --torchrun, --hosts or "
                         "--each: pull the checkpoints with `%gpu sync` instead")
    try:  # a quoted list: refused before any machine is asked
        torchrun_args = distributed.split_torchrun_args(args.torchrun_args or "")
    except distributed.JobError as e:
        raise UsageError(f"{e.message}; {e.hint}") from None
    try:
        each = distributed.parse_each(args.each) if args.each else []
    except distributed.JobError as e:
        raise UsageError(f"{e.message}; {e.hint}") from None
    machines = _hosts(magics, args.hosts, args.host)
    options = job_options(args)
    if args.each:
        if args.torchrun is not None:
            raise UsageError("--each runs one plain job per machine; it does not combine with --torchrun")
        started = distributed.fan_out(machines, args.job, cell, each, options)
        for j, e in zip(started, each):
            print(f"started job {args.job} on {j.machine.name} with "
                  + " ".join(f"{k}={v}" for k, v in e.items()))
        print("`%gpu jobs --all` lists them; `%gpu sync --from-all :PATH/ results/` pulls each "
              "machine's results into results/<machine>/")
        if args.then_shutdown is not None:
            print(f"each machine shuts down {args.then_shutdown:g} min after its own job succeeds; "
                  f"`%gpu kill {args.job} --shutdown --host NAME` cancels one")
        if args.out:
            magics.shell.user_ns[args.out] = started
        return
    if args.torchrun is None:
        raise UsageError("--hosts needs --torchrun N (one training run over all machines) or "
                         '--each "K=V" ... (one job per machine)')
    try:
        nproc = distributed.parse_nproc(args.torchrun)
    except distributed.JobError as e:
        raise UsageError(f"{e.message}; {e.hint}") from None
    if args.same_dir_hash and not args.same_dir:
        raise UsageError("--same-dir-hash needs --same-dir PATH (the data folder to compare)")
    run = distributed.TorchrunOptions(nproc=nproc, torchrun_args=torchrun_args, same_dir=args.same_dir,
                                      same_dir_hash=args.same_dir_hash)
    job = start_distributed(machines, args.job, cell, options.with_(python=False), run)
    world = job.nproc * len(job.parts)
    where = ", ".join(job.hosts)
    ep = f", rendezvous at {job.plan.endpoint}" if job.plan and job.plan.endpoint else ""
    print(f"started torchrun job {args.job}: {job.nproc} per machine on {where} (world size {world}{ep}); "
          f"`%gpu logs {args.job} --rank R` or `--all` shows the ranks, `%gpu kill {args.job}` ends them all")
    if args.then_shutdown is not None:
        print(f"once every rank has ended successfully, {where} shut{'s' if len(job.parts) == 1 else ''} down "
              f"{args.then_shutdown:g} min later; `%gpu kill {args.job} --shutdown` cancels that on every machine")
    if args.out:
        magics.shell.user_ns[args.out] = job


def logs(magics, args) -> None:
    """``%gpu logs NAME --rank R`` / ``--all``."""
    machine = magics.fleet.get(args.host)
    job = distributed.find(magics.fleet.get, machine, args.name)
    if job is None:
        raise UsageError(f"job {args.name} on {machine.name} is not a torchrun job; "
                         f"`%gpu logs {args.name}` shows its log")
    lines = args.lines or None
    text = job.logs_all(lines) if args.all else job.logs(rank=args.rank or 0, lines=lines)
    print(text, end="" if text.endswith("\n") or not text else "\n")


def kill(magics, machine, name: str, shutdown: bool = False) -> bool:
    """``%gpu kill NAME`` of a torchrun job: end every rank on every machine (``--shutdown``:
    cancel the shutdown armed on every machine instead); False when ``name`` is a plain job (the
    caller kills it as one)."""
    job = distributed.find(magics.fleet.get, machine, name)
    if job is None:
        return False
    if shutdown:
        said = {"cancelled": "cancelled", "none": "none was armed", "started": "too late: it has already run"}
        print(f"shutdown of torchrun job {name}: "
              + "; ".join(f"{host}: {said.get(w, w)}" for host, w in job.cancel_shutdown().items()))
        return True
    state = job.kill()
    print(f"killed torchrun job {name} on {', '.join(job.hosts)}: {state}; every rank was stopped")
    return True


def jobs_all(magics) -> None:
    """``%gpu jobs --all``: one table over every connected machine (a MACHINE column first)."""
    from IPython.display import display as ipy_display

    from ..display import Rendered, job_rows, text_table

    rows = [["MACHINE", *job_rows([])[0]]]
    for name, m in magics.fleet.machines.items():
        rows += [[name, *r] for r in job_rows(m.jobs())[1:]]
    if len(rows) == 1:
        text = "no jobs on any connected machine"
    else:
        text = "jobs on all connected machines:\n" + text_table(rows)
    import html

    ipy_display(Rendered(text, f"<pre>{html.escape(text)}</pre>"))


def sync_from_all(magics, args) -> None:
    """``%gpu sync --from-all :PATH/ DEST/``: pull PATH from every connected machine into
    ``DEST/<machine>/``."""
    from ...errors import ConfigError
    from ...sync import engine as sync

    try:
        src, dst = sync.parse_endpoint(args.src), sync.parse_endpoint(args.dst)
    except ConfigError as e:
        raise UsageError(e.message) from None
    if not src.remote or dst.remote or src.host:
        raise UsageError("--from-all pulls :REMOTE_PATH from every machine into a local folder: "
                         "`%gpu sync --from-all :runs/ results/`")
    if not magics.fleet.machines:
        raise UsageError("no machine is connected; `%gpu connect NAME` first")
    import os

    options = sync_options(args)
    for name, m in magics.fleet.machines.items():
        dest = os.path.join(dst.path, name) + "/"
        summary = m.pull(src.path, dest, options)
        print(f"{name}: {summary}")


def doctor_hosts(magics, args) -> None:
    """``%gpu doctor --hosts a,b``: the torchrun preflight alone (nothing is started)."""
    machines = _hosts(magics, args.hosts)
    plan = distributed.preflight(machines)
    p = plan.probes
    rows = [("host", "python", "torch", "cuda", "nccl", "gpus")]
    rows += [(x.host, x.python, x.torch, x.cuda, x.nccl, str(x.visible_gpus)) for x in p]
    print(distributed._table(rows[1:], rows[0]))
    print(f"preflight passed in {plan.took:.1f} s: same torch/CUDA/NCCL and code on "
          f"{', '.join(m.name for m in machines)}"
          + (f"; every machine reached the rendezvous endpoint {plan.endpoint}" if plan.endpoint else ""))
