"""The GPU: ``%gpu status`` (``--watch``), ``%gpu doctor`` and ``%gpu fit``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display as ipy_display

from ...errors import ConfigError
from ...gpu import fit as fitmod
from ...gpu.watch import Watcher
from .. import widgets
from ..display import Rendered, render_doctor, render_status
from ._args import host_arg, number, out_arg, parse

if TYPE_CHECKING:
    from . import GpuMagics


@magic_arguments()
@argument("--watch", metavar="SECONDS", type=number(1, 86400, what="seconds"), help="refresh in place every SECONDS (>= 1)")
@argument("--stop", action="store_true", help="stop a running --watch")
@argument("--text", action="store_true", help="plain text instead of the widget")
@host_arg()
def _status(magics: GpuMagics, line: str):
    """Per GPU: memory and utilisation bars, temperature, power, and the processes using it.

    One SSH round trip per refresh.  With --watch the widget refreshes in place from a background
    thread until `%gpu status --stop`, a disconnect, or three failed refreshes in a row.
    """
    args = parse(_status, line, "status")
    for name, watcher in list(magics.status_watchers.items()):  # one that ended by itself
        if not watcher.running:                                  # (a disconnect) is gone
            del magics.status_watchers[name]
    if args.stop:
        names = [args.host] if args.host else list(magics.status_watchers)
        stopped = []
        for name in names:
            watcher = magics.status_watchers.pop(name, None)
            if watcher is not None and watcher.running:
                watcher.stop()
                stopped.append(name)
        print(f"stopped watching {', '.join(stopped)}" if stopped else "no --watch is running")
        return
    if args.watch is not None and args.text:
        raise UsageError("--watch updates a widget in place: drop --text")
    m = magics.fleet.get(args.host)
    status = m.gpu_status()
    if args.text:
        print(render_status(status).text)
        return
    if args.watch is None or not widgets.available() or not widgets.can_show(magics.shell):
        ipy_display(render_status(status))
        if args.watch is not None:  # no thread refreshing a view nobody sees
            why = ("ipywidgets is not installed (pip install ipywidgets)" if not widgets.available()
                   else "this front end (no Jupyter kernel) cannot show one")
            print(f"not watching: --watch refreshes a widget, and {why}; "
                  "run `%gpu status --text` again, or use a notebook")
        return
    view = widgets.status_widget(status)
    view.show()
    if args.watch is not None:
        old = magics.status_watchers.pop(m.name, None)
        if old is not None:
            old.stop("stopped: a newer `%gpu status --watch` took over")
        magics.status_watchers[m.name] = _watch(magics, m, view, args.watch, status)


def _watch(magics: GpuMagics, m, view, every: float, status) -> Watcher:
    """The thread behind ``%gpu status --watch``.  A refresh counts as work in flight on
    the connection (a dead path is noticed within seconds, not after the keepalives); while
    one waits on a quiet path (a roam: the connection is being replaced) or lost its
    connection, the note says ``reconnecting...``; the next status that comes through puts
    the note back.  Only ``%gpu disconnect`` (the machine leaves the fleet) ends the watch
    as disconnected: a path that died by itself is reconnected by the next refresh."""
    normal = f"refreshing every {every:g} s; `%gpu status --stop` stops it"
    view.set_note(normal)

    def fetch(prev):
        with m.connection.in_flight():
            return m.gpu_status(cuda_version=prev.known_cuda if prev else None)

    def reconnecting(now: bool) -> None:
        if now:
            since = time.strftime("%H:%M:%S", time.localtime(watcher.refreshed_at))
            view.set_note(f"reconnecting... (the status above is from {since}); `%gpu status --stop` stops it")
        else:
            view.set_note(normal)

    watcher = Watcher(fetch, view.update, view.finish, interval=every,
                      is_connected=lambda: magics.fleet.machines.get(m.name) is m, previous=status,
                      stalled=lambda: not m.connection.heard_recently, on_reconnecting=reconnecting)
    return watcher.start()


@magic_arguments()
@argument("--expect-gpu", metavar="NAME", help='GPU model rented, e.g. "H200" (matched in the name)')
@argument("--expect-count", metavar="N", type=number(1, 1024, integer=True, what="a number of GPUs"), help="number of GPUs rented")
@argument("--sample", metavar="SECONDS", type=number(0, 600, integer=True, what="seconds"), default=0,
          help="also sample GPU and CPU utilisation for SECONDS (run it while training runs)")
@host_arg()
@argument("--hosts", metavar="A,B", help="run the torchrun preflight across these machines instead")
@argument("--net", action="store_true",
          help="instead: what the machine can reach (PyPI, the PyTorch wheels, Hugging Face, GitHub, "
               "conda-forge, the mirrors), how fast, and what to do")
@out_arg("with --net: the NetReport (.results, each .status, .rate, .hint)")
def _doctor(magics: GpuMagics, line: str):
    """Preflight checks, each ok / WARN / FAIL with a one-line fix, gathered in one round trip.

    GPU model and count against what was rented, GPU memory already in use, the remote
    PyTorch's CUDA build against the driver, disks (the largest data disk, a small system
    disk holding the working directory, disks over 90% full), Python, venv/conda, tmux, rsync.
    """
    args = parse(_doctor, line, "doctor")
    if args.hosts is not None:
        from .torchrun import doctor_hosts

        return doctor_hosts(magics, args)
    m = magics.fleet.get(args.host)
    if args.net:
        report = m.net.doctor()
        print(report.text)
        if args.out:
            magics.shell.user_ns[args.out] = report
        return
    ipy_display(render_doctor(m.doctor(expect_gpu=args.expect_gpu, expect_count=args.expect_count,
                                       sample=args.sample)))


# -- fit ----------------------------------------------------------------------------------


@magic_arguments()
@argument("model", help="parameter count (7B, 350M, 1.5e9) or a Hugging Face config.json (file or its folder)")
@argument("--dtype", default="bf16", choices=tuple(fitmod.DTYPE_BYTES),
          help="weights and activations (bf16/fp16 training is mixed precision); default bf16")
@argument("--train", action="store_true", help="training (the default)")
@argument("--infer", action="store_true", help="inference: weights and KV cache")
@argument("--optimizer", default="adamw", choices=fitmod.OPTIMIZERS, help="default adamw")
@argument("--batch", type=number(1, 10**6, integer=True, what="a micro-batch size"), default=1, metavar="B",
          help="micro-batch per GPU (default 1)")
@argument("--seq", type=number(1, 10**7, integer=True, what="a number of tokens"), metavar="S",
          help="tokens per sequence (default: the model's, at most 2048)")
@argument("--lora", type=number(0, 65536, integer=True, what="a LoRA rank (0: none)"), default=0, metavar="R",
          help="LoRA rank (default: full fine-tuning)")
@argument("--checkpointing", action="store_true", help="gradient (activation) checkpointing per layer")
@argument("--card", metavar="NAME", help="compare with this card (4090, A100, a100-40, H100, H200, 24GB...) "
                                         "instead of the connected GPU's free memory")
@host_arg("machine whose GPU to compare with (default: the current one)")
@out_arg("the FitReport")
def _fit(magics: GpuMagics, line: str):
    """Estimate the GPU memory a model needs and say whether it fits (an estimate).

    Splits it into weights, gradients, optimizer states and activations (or the KV cache),
    compares the total with the connected GPU's free memory or with `--card`, and says what
    to change first.  Method and sources: `gpumagic.gpu.fit`'s docstring.
    """
    args = parse(_fit, line, "fit")
    if args.train and args.infer:
        raise UsageError("give --train or --infer, not both")
    try:
        shape = fitmod.load_model(args.model)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    try:
        est = fitmod.estimate(shape, dtype=args.dtype, train=not args.infer, optimizer=args.optimizer,
                              batch=args.batch, seq=args.seq, lora=args.lora, checkpointing=args.checkpointing)
        target = None
        if args.card:
            label, size = fitmod.card_or_size(args.card)
            target = fitmod.Target(label, size, size)
    except ValueError as e:
        raise UsageError(str(e)) from None
    note = ""
    if target is None and (args.host or magics.fleet.default):
        m = magics.fleet.get(args.host)
        status = m.gpu_status()
        target = fitmod.target_from_status(status)
        if target is None:
            why = status.message or "no GPU reported its memory"
            note = f"{m.name}: {why}; compared with the card table only (or give --card NAME)"
    elif target is None:
        note = "no machine connected: compared with the card table only (or give --card NAME)"
    report = fitmod.check(est, target)
    text = fitmod.report_text(report) + (f"\n{note}" if note else "")
    ipy_display(Rendered(text, fitmod.report_html(report) + (f"<p>{note}</p>" if note else "")))
    if args.out:
        magics.shell.user_ns[args.out] = report
