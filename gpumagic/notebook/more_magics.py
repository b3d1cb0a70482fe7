"""``%gpu fit``, ``%gpu wrapup`` and ``%gpu budget notify``: parse, call the API, display.

Each handler takes the :class:`gpumagic.notebook.magics.GpuMagics` instance and the argument line, as
the functions of ``gpumagic/magics.py`` do; that module's dispatch tables point here.  Bad
arguments raise exactly ``UsageError``.
"""

from __future__ import annotations

import getpass

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

from ..gpu import fit as fitmod
from ..budget import notify as notifymod
from .. import wrapup as wrapupmod
from .._format import duration
from .display import Rendered
from ..errors import ConfigError
from .magics import _show, parse


# -- %gpu fit ----------------------------------------------------------------------------------


@magic_arguments()
@argument("model", help="parameter count (7B, 350M, 1.5e9) or a Hugging Face config.json (file or its folder)")
@argument("--dtype", default="bf16", choices=tuple(fitmod.DTYPE_BYTES),
          help="weights and activations (bf16/fp16 training is mixed precision); default bf16")
@argument("--train", action="store_true", help="training (the default)")
@argument("--infer", action="store_true", help="inference: weights and KV cache")
@argument("--optimizer", default="adamw", choices=fitmod.OPTIMIZERS, help="default adamw")
@argument("--batch", type=int, default=1, metavar="B", help="micro-batch per GPU (default 1)")
@argument("--seq", type=int, metavar="S", help="tokens per sequence (default: the model's, at most 2048)")
@argument("--lora", type=int, default=0, metavar="R", help="LoRA rank (default: full fine-tuning)")
@argument("--checkpointing", action="store_true", help="gradient (activation) checkpointing per layer")
@argument("--card", metavar="NAME", help="compare with this card (4090, A100, a100-40, H100, H200, 24GB...) "
                                         "instead of the connected GPU's free memory")
@argument("--host", metavar="NAME", help="machine whose GPU to compare with (default: the current one)")
@argument("--out", metavar="VAR", help="store the FitReport in VAR")
def fit(magics, line: str):
    """Estimate the GPU memory a model needs and say whether it fits (an estimate).

    Splits it into weights, gradients, optimizer states and activations (or the KV cache),
    compares the total with the connected GPU's free memory or with `--card`, and says what
    to change first.  Method and sources: `gpumagic.gpu.fit`'s docstring.
    """
    args = parse(fit, line, "fit")
    if args is None:
        return None
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
    if target is None and (args.host or magics.session.default):
        m = magics.session.get(args.host)
        status = m.gpu_status()
        target = fitmod.target_from_status(status)
        if target is None:
            why = status.message or "no GPU reported its memory"
            note = f"{m.name}: {why}; compared with the card table only (or give --card NAME)"
    elif target is None:
        note = "no machine connected: compared with the card table only (or give --card NAME)"
    report = fitmod.check(est, target)
    text = fitmod.report_text(report) + (f"\n{note}" if note else "")
    _show(Rendered(text, fitmod.report_html(report) + (f"<p>{note}</p>" if note else "")))
    if args.out:
        magics.shell.user_ns[args.out] = report
    return None


# -- %gpu wrapup -------------------------------------------------------------------------------


def _ask(text: str) -> bool:
    """One yes/no question in the notebook (``input``); no stdin (nbclient, a script) is no."""
    try:
        answer = input(text + "\n[y/N] ")
    except (EOFError, OSError):
        return False
    except Exception as e:  # IPython's StdinNotImplementedError: a front end without input
        if type(e).__name__ == "StdinNotImplementedError":
            return False
        raise
    return answer.strip().lower() in ("y", "yes")


@magic_arguments()
@argument("--pull", nargs=2, action="append", metavar=("REMOTE", "LOCAL"),
          help="results folder to check and pull, as in %%gpu sync (`--pull :runs/ ./runs/`; repeatable; "
               "remembered for the next wrapup of this machine)")
@argument("--no-pull", action="store_true", help="only list what is not pulled yet")
@argument("--clean", action="store_true",
          help="remove the caches listed (pip, conda pkgs, ~/.cache, temporary files, old VS Code servers, "
               "__pycache__), after one confirmation")
@argument("--yes", action="store_true", help="with --clean: skip the confirmation")
@argument("--host", metavar="NAME", help="machine (default: the current one)")
@argument("--out", metavar="VAR", help="store the WrapupReport in VAR")
def wrapup(magics, line: str):
    """Before releasing a machine: pull the results not pulled yet, show (and --clean) the
    caches an image would carry, the image's size and price, and what still runs."""
    args = parse(wrapup, line, "wrapup")
    if args is None:
        return None
    from ..errors import ConfigError as _CE
    from ..sync.engine import parse_endpoint

    m = magics.session.get(args.host)
    pulls = []
    for src, dst in args.pull or []:
        try:
            a, b = parse_endpoint(src), parse_endpoint(dst)
        except _CE as e:
            raise UsageError(e.message) from None
        if not a.remote or b.remote:
            raise UsageError(f"--pull {src} {dst}: give the machine's folder first, then the local one "
                             "(`--pull :runs/ ./runs/`)")
        if a.host and a.host != m.name:
            raise UsageError(f"--pull {src}: that names machine {a.host!r}, but this wrapup is of {m.name!r} "
                             f"(use --host {a.host})")
        pulls.append((src, dst))
    if args.yes and not args.clean:
        raise UsageError("--yes only applies to --clean")
    confirm = (lambda _text: True) if args.yes else (lambda text: _ask(text))
    report = wrapupmod.wrapup(m, pulls or None, pull=not args.no_pull, clean=args.clean, confirm=confirm)
    _show(Rendered(wrapupmod.report_text(report), wrapupmod.report_html(report)))
    if args.out:
        magics.shell.user_ns[args.out] = report
    return None


# -- %gpu budget notify ------------------------------------------------------------------------


@magic_arguments()
@argument("--mail", metavar="ADDRESS", help="send alerts to this mail address (needs --smtp)")
@argument("--smtp", metavar="HOST[:PORT]", help="the SMTP server the machine sends through (port 465: SMTPS; "
                                                "otherwise STARTTLS when offered; default port 587)")
@argument("--user", metavar="U", help="SMTP login; the password is asked (not echoed), never in this line")
@argument("--from", dest="sender", metavar="ADDRESS", help="From: address (default: --user or --mail)")
@argument("--tls", default="auto", choices=notifymod.TLS_MODES,
          help="auto (STARTTLS when offered), ssl, starttls (required), none (never: plain text)")
@argument("--webhook", metavar="URL", help="a chat service's incoming-webhook URL (`ask`: type it, not echoed)")
@argument("--format", default="json", choices=notifymod.FORMATS, help="webhook payload form (default json)")
@argument("--chat-id", metavar="ID", help="--format telegram: the chat to send to")
@argument("--sign", action="store_true", help="ask for the bot's signing secret (feishu/lark, dingtalk)")
@argument("--test", action="store_true", help="send a test message now")
@argument("--no-test", action="store_true", help="do not send a test message after setting up")
@argument("--off", action="store_true", help="remove the settings (and credentials) from the machine")
@argument("--retries", type=int, default=5, help="attempts after the first failure (default 5)")
@argument("--backoff", type=float, default=2.0, metavar="S", help="first pause between attempts, doubled each time")
@argument("--host", metavar="NAME", help="machine (default: the current one)")
def budget_notify(magics, line: str):
    """Alerts by mail or webhook, sent from the machine itself (works with the laptop closed):
    when spending passes each alert threshold of `%gpu budget set --alert`.

    Without options: the settings (no secrets), the thresholds armed (re-armed from the
    current prices and thresholds: run it after `%gpu budget set`), the last log lines.
    """
    args = parse(budget_notify, line, "budget notify")
    if args is None:
        return None
    m = magics.session.get(args.host)
    if args.off:
        if args.mail or args.webhook:
            raise UsageError("--off removes the settings: give it alone")
        notifymod.disable(m)
        print(f"{m.name}: notifications off; the settings and credentials were deleted from the machine")
        return None
    if args.mail and not args.smtp:
        raise UsageError("--mail needs the server to send through: --smtp HOST[:PORT] (e.g. smtp.qq.com:465)")
    if (args.smtp or args.user or args.sender) and not args.mail:
        raise UsageError("--smtp, --user and --from go with --mail ADDRESS")
    if (args.chat_id or args.sign) and not args.webhook:
        raise UsageError("--chat-id and --sign go with --webhook URL")
    if args.retries < 0 or args.backoff < 0:
        raise UsageError("--retries and --backoff take numbers >= 0")
    channels = []
    try:
        if args.mail:
            password = None
            if args.user:
                password = getpass.getpass(f"SMTP password for {args.user} at {args.smtp}: ")
            channels.append(notifymod.mail_channel(args.mail, args.smtp, user=args.user, password=password,
                                                   sender=args.sender, tls=args.tls))
        if args.webhook:
            url = getpass.getpass("webhook URL: ") if args.webhook == "ask" else args.webhook
            secret = getpass.getpass("signing secret: ") if args.sign else None
            channels.append(notifymod.webhook_channel(url.strip(), args.format, secret=secret,
                                                      chat_id=args.chat_id))
    except ValueError as e:
        raise UsageError(str(e)) from None
    if channels:
        config = notifymod.configure(m, channels, retries=args.retries, backoff=args.backoff)
        print(f"{m.name}: alerts go to " + "; ".join(notifymod.describe(c) for c in config["channels"]))
        print(f"  settings and credentials: ~/{notifymod.NOTIFY_DIR}/config.json on {m.name} (mode 0600), "
              "never in a command line or a log")
        _print_schedule(m, notifymod.schedule_thresholds(m))
        if not args.no_test:
            _print_test(m)
        return None
    if args.test:
        _print_test(m)
        return None
    config = notifymod.read_config(m)
    if config is None:
        print(f"{m.name}: no alerts set up; `%gpu budget notify --mail ADDRESS --smtp HOST[:PORT]` or "
              "`%gpu budget notify --webhook URL --format slack|discord|feishu|dingtalk|wecom|telegram|json`")
        return None
    print(f"{m.name}: alerts go to " + "; ".join(notifymod.describe(c) for c in config.get("channels", [])))
    _print_schedule(m, notifymod.schedule_thresholds(m))  # thresholds changed since? armed as they are now
    lines, waiting = notifymod.log_tail(m)
    if waiting:
        print(f"  {waiting} message(s) waiting in the outbox (sent with the next one)")
    for ln in lines:
        print(f"  {ln}")
    return None


def _print_schedule(m, sched) -> None:
    if sched.items:
        parts = ", ".join(f"{it['threshold']} in {duration(it['in_s'])}" for it in sched.items)
        print(f"  spending alerts armed on {m.name}: {parts} (sent from there, laptop closed or not)")
    else:
        print(f"  no spending alert armed: {sched.reason}")


def _print_test(m) -> None:
    r = notifymod.send_from_machine(m, "test", retries=1, keep=False)
    if r.ok:
        print(f"  test message sent: {', '.join(r.sent)}")
    elif r.skipped:
        print(f"  test message not sent: {r.skipped}")
    else:
        for f in r.failed:
            print(f"  test message FAILED: {f}")
        print("  check the address, server or URL, then `%gpu budget notify --test`")
