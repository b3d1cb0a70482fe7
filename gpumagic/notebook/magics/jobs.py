"""Detached jobs: ``%gpu jobs``, ``logs``, ``attach``, ``kill``, ``job move|resume``, and
``%%remote --job``."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display as ipy_display

from ...errors import ConfigError, Interrupted, NotConnected
from ...remote.keep import KeepOptions
from ...remote.jobs import NAME_RE, scan_alerts
from ...rent.rentals import OLD_RENTAL, is_new_rental, parse_new_rental
from .. import display
from ..display import (SANDBOX_SHUTDOWN_NOTE, job_alert, job_ended, job_started, jobs_table, keep_line,
                       keep_started)
from ._args import GB, LINES, MONEY, Subcommands, host_arg, job_options, keep_options, number, parse
from .rent import leave_old_rental, rent_and_connect, renter

if TYPE_CHECKING:
    from . import GpuMagics


def _job_name(name: str) -> str:
    if not NAME_RE.fullmatch(name):
        raise UsageError(f"{name!r} is not a job name: use letters, digits, '-' and '_' (see `%gpu jobs`)")
    return name


def _remote_job(magics: GpuMagics, args, cell: str):
    """``%%remote --job NAME ...``: start the cell detached and return at once."""
    if args.job is None:
        raise UsageError("--stop-on, --then-shutdown, --no-alerts, --keep, --resume-arg and --fallback need --job NAME "
                         "(e.g. --job train --keep ckpt/)")
    if not NAME_RE.fullmatch(args.job):
        raise UsageError(f"--job {args.job!r}: use letters, digits, '-' and '_' (e.g. --job train-1)")
    if args.timeout is not None:
        raise UsageError("--timeout does not apply to --job (a job runs until it ends or `%gpu kill NAME`)")
    options = job_options(args)
    keep = keep_options(args)
    machine = magics.fleet.get(args.host)
    fallback = _fallback(magics, args, keep, machine.name)
    job = machine.start_job(args.job, cell, options, keep=keep)
    if fallback is not None and job.keeper is not None:
        machine.moves.standby(args.job, fallback, _fallback_target(magics, fallback, args.job, machine.name),
                              _events(magics).append)
    if job.note and job.runner not in machine.notes_shown:
        machine.notes_shown.add(job.runner)
        print(job.note)
    print(job_started(job, machine.name))
    if job.keeper is not None:
        print(keep_started(job.keeper))
    if fallback is not None and not getattr(machine.moves.record(args.job), "src", None):
        print(f"standby: no project folder is recorded for job {args.job}'s folder (no `%gpu sync` to it): "
              f"its files must be on {fallback} already, for only its checkpoint goes there")
    if fallback is not None:
        print(f"standby: if {machine.name} is lost (no answer for {machine.moves.lost_after:g} s, or the job's process "
              f"gone), job {args.job} moves to {fallback} by itself, while this notebook runs")
    if args.then_shutdown is not None and machine.is_this_computer:
        print(SANDBOX_SHUTDOWN_NOTE)
    if args.out:
        magics.shell.user_ns[args.out] = job


def _fallback(magics: GpuMagics, args, keep: KeepOptions | None, here: str) -> str | None:
    """The ``--fallback`` machine's name (checked: connected, not the job's own; with --keep)."""
    name = getattr(args, "fallback", None)
    if name is None:
        return None
    if keep is None:
        raise UsageError(f"--fallback {name} needs --keep DIR: the job moves from its newest checkpoint "
                         "kept here (e.g. --keep ckpt/ --resume-arg \"--resume {checkpoint}\")")
    if name == here:
        raise UsageError(f"--fallback {name}: the job starts on {here} itself; name another connected machine")
    if is_new_rental(name):
        spec = parse_new_rental(name)
        if not spec.trust_new_host:
            raise UsageError(f"--fallback {name}: the standby rents and connects while nobody watches, and no "
                             "platform publishes its machines' host keys: add ,trust-new-host to trust the new "
                             "machine's key (it is recorded)")
        renter(magics).provider(spec.provider)  # a key is stored for it (else: a one-line error now, not then)
    elif name not in magics.fleet.machines:
        known = ", ".join(sorted(m for m in magics.fleet.machines if m != here)) or "none"
        raise UsageError(f"--fallback {name}: no machine of that name is connected (others connected: {known}); "
                         f"`%gpu connect ALIAS --name {name}` first")
    if getattr(args, "resume_arg", None) is None:
        raise UsageError(f"--fallback {name} needs --resume-arg: the job continues there from its newest "
                         'checkpoint (e.g. --resume-arg "--resume {checkpoint}")')
    return name


def _fallback_target(magics: GpuMagics, fallback: str, job: str, here: str):
    """What the standby of ``job`` calls when ``here`` is lost: the connected fallback machine,
    or (``new:PROVIDER...``) one rented then, after which the rental the job left is stopped,
    released or kept as the spec says (it is lost: its disk keeps what was there)."""
    if not is_new_rental(fallback):
        return lambda: magics.fleet.get(fallback)
    spec = parse_new_rental(fallback)

    def rent():
        say = _events(magics).append
        m = rent_and_connect(magics, spec.machine_name(job), provider=spec.provider, filters=spec.filters,
                             key=_rental_key(magics, here), trust=True, say=lambda line: None)
        say(f"job {job}: {here} was lost; rented {m.name} ({fallback.split(',')[0]}) for it")
        leave_old_rental(magics, here, spec.old, say=lambda line: say(f"job {job}: {line}"))
        return m

    return rent


def _rental_key(magics: GpuMagics, name: str) -> str | None:
    """The SSH key the rental ``name`` was reached with (a new rental for its job gets the same
    one); None (the default key) when ``name`` is no rental of gpumagic's."""
    try:
        return renter(magics).record(name).key or None
    except ConfigError:
        return None


def _events(magics: GpuMagics) -> list[str]:
    """What happened to jobs in the background (a move by --fallback, a machine cleaned after a
    move), said after the next cell (:func:`_moves_post_run_cell`)."""
    return magics.state.job_events


def _moves_post_run_cell(magics: GpuMagics):
    """After each cell: arm again the standbys (``--fallback``) of jobs whose machine and fallback
    are both connected but whose keeper does not run here (the notebook restarted:
    :meth:`gpumagic.remote.move.Moves.rearm`), say what the standby keepers did, and see to the
    machines that jobs moved away from once they are connected again
    (:meth:`gpumagic.remote.move.Moves.clean_up`: in a thread, waited for a few seconds)."""
    import threading

    tried: dict[str, tuple[int, int, float]] = {}  # machine -> (id, opened_count, when) of the last try

    def clean(m) -> None:
        try:
            m.moves.clean_up(_events(magics).append)  # False: it did not answer after all (tried again later)
        except Exception as e:  # tried again at a later connect
            _events(magics).append(f"gpumagic: could not see to the jobs that moved away from {m.name}: "
                                   f"{getattr(e, 'message', None) or e} (tried again when it is connected again)")

    def hook(*_):
        if magics.closed:  # the extension was unloaded (see GpuMagics.close)
            return
        threads = []
        for name, m in list(magics.fleet.machines.items()):
            # a --fallback armed before the notebook restarted (or before m was connected anew)
            m.moves.rearm(magics.fleet.machines.get, _events(magics).append,
                          renting=lambda fallback, job, m=m: None if not is_new_rental(fallback) else
                          _fallback_target(magics, fallback, job, m.name))
            if not m.is_connected or not m.moves.cleanups_pending():
                continue
            key = (id(m), m.connection.opened_count)
            last = tried.get(name)
            if last is not None and last[:2] == key and time.monotonic() - last[2] < m.moves.lost_after:
                continue
            tried[name] = (*key, time.monotonic())
            t = threading.Thread(target=clean, args=(m,), daemon=True, name=f"gpumagic-clean-{name}")
            t.start()
            threads.append(t)
        for t in threads:
            t.join(CLEAN_WAIT)
        events = _events(magics)
        while events:
            print(events.pop(0))
    return hook


#: Seconds the cell hook waits for a machine's cleaning after a move (the rest is said later).
CLEAN_WAIT = 10.0


def _show_alerts(magics: GpuMagics, info, alerts=None) -> None:
    seen = set()
    for a in (info.alerts if alerts is None else alerts):
        if a.kind not in seen and display.first_alert(magics.state.alerts_shown, info.name, info.started, a.kind):
            seen.add(a.kind)
            ipy_display(job_alert(info.name, a, stopped=(info.killed == a.kind)))


@magic_arguments()
@host_arg()
@argument("--all", action="store_true", help="one table over every connected machine")
def _jobs(magics: GpuMagics, line: str):
    args = parse(_jobs, line, "jobs")
    if args.all:
        from .torchrun import jobs_all

        return jobs_all(magics)
    machine = magics.fleet.get(args.host)
    found = machine.moves.jobs()  # jobs recorded here: a machine that is gone is said so
    if not isinstance(found, list):  # the verdict on a machine that did not answer
        print(f"{machine.name} has not answered since {time.strftime('%H:%M:%S', time.localtime(found.since))} "
              f"({found.why}); its jobs as recorded on this computer:")
    else:
        ipy_display(jobs_table(found, machine.name))
        for info in found:
            _show_alerts(magics, info)
    texts, lost = machine.moves.lost_report(found)
    for text in texts:
        print(text)
    for view, live in machine.moves.kept(lost):
        print(keep_line(view, live=live))


def _with_earlier(machine, name: str, text: str, lines: int | None) -> str:
    """``text`` (the last ``lines`` lines of the job's log there) after the logs kept here of
    its runs before a move or resume, so that ``lines`` lines (None: all) of one log show."""
    count = len(text.splitlines())
    if lines is not None and count >= lines:
        return text
    return machine.moves.earlier_log(name, None if lines is None else lines - count) + text


def _follow(magics: GpuMagics, name: str, host: str | None, lines: int | None) -> None:
    machine = magics.fleet.get(host)
    job = machine.job(_job_name(name))
    before = job.info()
    if machine.moves.earlier_log(name, 1):  # a moved job: its runs before first, as one log
        shown = job.logs(lines)
        print(machine.moves.earlier_log(name, None if lines is None else max(0, lines - len(shown.splitlines()))),
              end="")
    seen: set[str] = set()

    def alert(a):
        if a.kind not in seen and display.first_alert(magics.state.alerts_shown, name, before.started, a.kind):  # once per kind
            seen.add(a.kind)
            ipy_display(job_alert(name, a, stopped=a.kind in before.stop_on))

    try:
        info = job.follow(alert=alert, lines=lines)
    except KeyboardInterrupt:
        raise Interrupted(f"stopped following {name}; the job keeps running on {machine.name} "
                          f"(`%gpu attach {name}` follows it again)") from None
    print(job_ended(info))


@magic_arguments()
@argument("name", help="job name (see `%%gpu jobs`)")
@argument("-n", "--lines", type=LINES, default=100, help="how many last lines to show (default 100; 0: all)")
@argument("-f", "--follow", action="store_true",
          help="keep printing new output until the job ends (interrupting stops following, never the job)")
@host_arg()
@argument("--rank", metavar="R", type=number(0, 1 << 20, integer=True, what="a rank"), help="a torchrun job: show global rank R's lines (default 0)")
@argument("--all", action="store_true", help="a torchrun job: every rank's lines, prefixed [host:rank]")
def _logs(magics: GpuMagics, line: str):
    args = parse(_logs, line, "logs")
    if args.rank is not None or args.all:
        from .torchrun import logs as torchrun_logs

        return torchrun_logs(magics, args)
    lines = args.lines or None
    if args.follow:
        return _follow(magics, args.name, args.host, lines)
    machine = magics.fleet.get(args.host)
    job = machine.job(_job_name(args.name))
    text = job.logs(lines)
    text = _with_earlier(machine, args.name, text, lines)
    print(text, end="" if text.endswith("\n") or not text else "\n")
    info = job.info()
    if info.alerts_enabled:
        _show_alerts(magics, info, scan_alerts(text.splitlines()))


@magic_arguments()
@argument("name", help="job name (see `%%gpu jobs`)")
@argument("-n", "--lines", type=LINES, default=1000, help="earlier lines to show first (default 1000; 0: all)")
@host_arg()
def _attach(magics: GpuMagics, line: str):
    args = parse(_attach, line, "attach")
    _follow(magics, args.name, args.host, args.lines or None)


@magic_arguments()
@argument("name", help="job name (see `%%gpu jobs`)")
@argument("--shutdown", action="store_true",
          help="cancel the shutdown armed by --then-shutdown instead (the job itself is left alone)")
@host_arg()
def _kill(magics: GpuMagics, line: str):
    args = parse(_kill, line, "kill")
    machine = magics.fleet.get(args.host)
    job = machine.job(_job_name(args.name))
    from .torchrun import kill as torchrun_kill

    if torchrun_kill(magics, machine, args.name, shutdown=args.shutdown):
        return
    if args.shutdown:
        what = job.cancel_shutdown()
        print({"cancelled": f"cancelled the shutdown of {machine.name} armed by job {args.name}",
               "none": f"job {args.name} armed no shutdown; nothing to cancel",
               "started": f"too late: the shutdown armed by job {args.name} has already run"}[what])
        return
    info = job.info()
    if not info.running:
        extra = (f"; its {info.shutdown_text} (`%gpu kill {args.name} --shutdown` cancels it)"
                 if info.shutdown_state == "pending" else "")
        print(f"job {args.name} is not running ({info.state_text}); nothing to kill{extra}")
        return
    info = job.kill()
    print(f"killed job {args.name} on {machine.name}: {info.state_text}; "
          "its whole process tree was stopped")


# -- %gpu job move|resume: a run continued from its newest kept checkpoint ---------------------


def _connected(magics: GpuMagics, name: str):
    """The connected machine called ``name``, or None (it is not connected here)."""
    try:
        return magics.fleet.get(name)
    except NotConnected:
        return None


def _torchrun(value: str | None):
    if value is None or value == "auto":
        return value
    if not value.isdigit() or not 1 <= int(value) <= 1024:
        raise UsageError(f"--torchrun {value!r}: give a number of processes from 1 to 1024, or auto")
    return int(value)


#: ``--src`` and ``--host``, as `%gpu job move` and `%gpu job resume` take them.
_SRC_ARG = argument("--src", metavar="DIR",
                    help="the project folder here to push (default: the folder gpumagic pushed to the job's folder)")
_STARTED_ON_ARG = host_arg("the machine it was started on (default: the one this computer's records name)")


@magic_arguments()
@argument("name", help="the job (see `%%gpu jobs`)")
@argument("--to", metavar="MACHINE", required=True,
          help="the connected machine to continue it on, or new:PROVIDER to rent one: the cheapest offer "
               "that fits --gpu, --vram and --max-price (see --old)")
@argument("--gpu", help="with --to new:PROVIDER: GPU model, any part of its name (4090, H100)")
@argument("--vram", type=GB, metavar="GB", help="with --to new:PROVIDER: at least this much memory per GPU")
@argument("--max-price", type=MONEY, metavar="PER_HOUR", help="with --to new:PROVIDER: at most this price per hour (USD)")
@argument("--name-new", metavar="NAME", help="with --to new:PROVIDER: the new machine's name (default JOB-PROVIDER)")
@argument("--old", choices=OLD_RENTAL,
          help="with --to new:PROVIDER: what becomes of the rental the job left: stop (the default: the GPU's bill "
               "ends, the disk is kept), release (after the wrap-up check) or keep")
@argument("--trust-new-host", action="store_true",
          help="with --to new:PROVIDER: trust the new machine's host key (no platform publishes them)")
@argument("--yes", action="store_true",
          help="the job still runs where it is: stop it there (after a last checkpoint pull), then move it")
@_SRC_ARG
@argument("--torchrun", metavar="N|auto", help="start it under torchrun with N processes there (then without --keep)")
@argument("--from-start", action="store_true",
          help="start it from the beginning there, on purpose (no --resume-arg, or no checkpoint kept)")
@argument("--no-src", action="store_true",
          help="push no project folder: the job's files are on the other machine already")
@_STARTED_ON_ARG
def _job_move(magics: GpuMagics, line: str):
    """Continue a job on another machine from its newest checkpoint kept here: its project
    folder and that checkpoint are pushed there, and the same command starts with its
    --resume-arg, environment, working directory, stop-on rules and alerts, under the same name."""
    args = parse(_job_move, line, "job move")
    name = _job_name(args.name)
    torchrun = _torchrun(args.torchrun)
    rec = magics.fleet.job_record(name, args.host)
    spec = _new_rental(args)
    if spec is not None:
        new = spec.machine_name(name)
        if new in magics.fleet.machines:
            raise UsageError(f"--to {args.to}: a machine named {new} is connected already; "
                             "--name-new NAME names the new one")
        # what the move would refuse, refused before anything is rented
        magics.fleet.check_move(name, rec, args.to, yes=args.yes, src=args.src, torchrun=torchrun,
                                from_start=args.from_start, no_src=args.no_src)
        target = rent_and_connect(magics, new, provider=spec.provider, filters=spec.filters,
                                  key=_rental_key(magics, rec.machine), trust=spec.trust_new_host)
    else:
        target = magics.fleet.get(args.to)
    source = _connected(magics, rec.machine)
    if source is target:
        raise UsageError(f"job {name} was started on {target.name} already: `%gpu job resume {name}` "
                         "starts it again there")
    job = target.moves.take(name, rec, source=source, yes=args.yes, src=args.src, torchrun=torchrun,
                            from_start=args.from_start, no_src=args.no_src)
    print(f"job {name} moved from {rec.machine} to {target.name} and started there; "
          f"`%gpu logs {name} --host {target.name}` shows the seam, `%gpu jobs --host {target.name}` lists it")
    if getattr(job, "keeper", None) is not None:
        print(keep_started(job.keeper))
    if spec is not None:
        leave_old_rental(magics, rec.machine, spec.old)


def _new_rental(args):
    """``--to new:PROVIDER...`` with the flags that refine it, or None for a connected machine."""
    refined = dict(gpu=args.gpu, vram_gb=args.vram, max_price=args.max_price, name=args.name_new, old=args.old,
                   trust_new_host=args.trust_new_host or None)
    if not is_new_rental(args.to):
        given = [f for f, v in (("--gpu", args.gpu), ("--vram", args.vram), ("--max-price", args.max_price),
                                ("--name-new", args.name_new), ("--old", args.old),
                                ("--trust-new-host", args.trust_new_host)) if v]
        if given:
            raise UsageError(f"{', '.join(given)} go with --to new:PROVIDER (a machine to rent), not with a "
                             f"connected machine ({args.to})")
        return None
    return dataclasses.replace(parse_new_rental(args.to), **{k: v for k, v in refined.items() if v is not None})


@magic_arguments()
@argument("name", help="the job (see `%%gpu jobs`)")
@_SRC_ARG
@argument("--from-start", action="store_true",
          help="start it from the beginning, on purpose (no --resume-arg, or no checkpoint kept)")
@_STARTED_ON_ARG
def _job_resume(magics: GpuMagics, line: str):
    """Start a lost job again on its own machine (after a restart) from its newest checkpoint
    kept here, as `%gpu job move` does."""
    args = parse(_job_resume, line, "job resume")
    name = _job_name(args.name)
    rec = magics.fleet.job_record(name, args.host)
    machine = magics.fleet.get(rec.machine)
    job = machine.moves.take(name, rec, source=machine, src=args.src, from_start=args.from_start)
    print(f"job {name} resumed on {machine.name}; `%gpu logs {name} --host {machine.name}` shows the seam")
    if getattr(job, "keeper", None) is not None:
        print(keep_started(job.keeper))


#: ``%gpu job SUB``: a job continued elsewhere or again.
JOB = Subcommands("%gpu job", {
    "move": (_job_move, "continue a job on another machine from its newest kept checkpoint"),
    "resume": (_job_resume, "start a lost job again on its own machine from its newest kept checkpoint"),
}, intro="A job started with `%%remote --job NAME --keep DIR --resume-arg \"--resume {checkpoint}\"` "
         "continues from the newest checkpoint kept on this computer.")
