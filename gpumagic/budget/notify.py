"""Alerts that reach you away from the notebook: mail or a chat webhook, sent *from the machine*.

A notebook alert reaches nobody while the laptop is closed, so the sending happens on the
rented machine.  :func:`configure` installs the machine-side program
(``gpumagic/remote/programs/budget-notifier.py``, standard library only) as
``~/.gpumagic/notify/notify.py`` with its settings in ``config.json`` beside it: the folder
is 0700 and the file 0600, written by ``budget-notify-install.py``, which reads everything from
the SSH channel's stdin, so no credential ever appears in a command line (``/proc/*/cmdline``)
or a log.  ``budget-notify.sh`` reads the settings and the log and runs the installed program.

Who sends what:

* **Spending thresholds**: :func:`schedule_thresholds` computes, from the ledger's prices
  and alert thresholds (:mod:`gpumagic.budget`), when spending will pass each threshold, and
  arms a small detached watcher on the machine (``notify.py watch``) that sends one message
  per threshold at that moment -- laptop closed or not.  Each threshold of a rental
  is sent once (a ``--once`` key).
* **Anything else** (a job's end, a NaN/OOM stop, the guard's warning before a shutdown
  and its failed shutdown -- ``budget-guard.sh`` calls it for those two): the program on the
  machine is called by whoever sees the event there, detached from the caller's process
  tree (the job runner and the guard use lib.sh's ``gm_detach``), e.g.::

      gm_detach python3 "$HOME/.gpumagic/notify/notify.py" --event job-end --job train \\
          --job-dir "$HOME/.gpumagic/jobs/train" --log "$HOME/.gpumagic/jobs/train/log"

  (:func:`notify_command` builds such a line that stands alone, for a script or crontab of
  your own).  From Python, :func:`send_from_machine`.

A send that fails is retried with exponential backoff (at least the server's ``Retry-After``
apart after a 429 or 503), then kept in the machine's outbox with why it waits and recorded in
its log (and in the caller's ``--log`` file); it is sent with the next message (not before the
time a ``Retry-After`` named).
The program never raises into its caller and always exits 0.
"""

from __future__ import annotations

import json
import re
import shlex
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import ConfigError, NotifyError  # noqa: F401 (NotifyError: its old home)
from ..remote import program
from ..remote.execution import run_program
from .guard import read_status
from .ledger import Ledger
from .prices import limit_deadline, spent

if TYPE_CHECKING:
    from .._types import MachineLike

#: Where the program and its settings live on the machine (relative to $HOME).
NOTIFY_DIR = ".gpumagic/notify"
#: Webhook payload formats (see the machine-side program's docstring for each shape).
FORMATS = ("json", "slack", "discord", "feishu", "lark", "dingtalk", "wecom", "telegram")
#: Events the program knows (``--event``).
EVENTS = ("test", "threshold", "job-end", "job-failed", "stop", "shutdown", "guard", "message")
TLS_MODES = ("auto", "ssl", "starttls", "none")

#: The installed program as ``notify_command`` lines call it (``$HOME`` expanded there).
_PROGRAM = f'python3 "$HOME/{NOTIFY_DIR}/notify.py"'


def program_source() -> str:
    """The machine-side program's source (``gpumagic/remote/programs/budget-notifier.py``)."""
    return program.source("budget-notifier.py")


# -- channels (pure) ---------------------------------------------------------------------------


def parse_smtp(text: str) -> tuple[str, int]:
    """``HOST[:PORT]`` of an SMTP server; the port defaults to 587 (submission, STARTTLS).

    Raises
    ------
    ValueError
        For an empty host or a port outside 1-65535.
    """
    host, port = text.strip(), "587"
    if host.count(":") == 1:
        host, port = host.split(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--smtp {text!r}: write it as HOST[:PORT], e.g. --smtp smtp.qq.com:465")
    return host, int(port)


_ADDRESS = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$|^[^@\s]+@localhost$")


def mail_channel(to: str, smtp: str, *, user: str | None = None, password: str | None = None,
                 sender: str | None = None, tls: str = "auto") -> dict:
    """A mail channel for the settings file.

    Parameters
    ----------
    to : str
        Recipient address.
    smtp : str
        ``HOST[:PORT]`` (port 465: SMTPS; otherwise STARTTLS whenever offered).
    user, password : str, optional
        SMTP login (the password only ever travels over TLS unless ``tls="none"``).
    sender : str, optional
        ``From:`` (default: ``user`` when it is an address, else ``to``).
    tls : {"auto", "ssl", "starttls", "none"}

    Raises
    ------
    ValueError
        A malformed address, server or TLS mode.
    """
    if not _ADDRESS.match(to or ""):
        raise ValueError(f"--mail {to!r} is not a mail address (name@example.com)")
    if tls not in TLS_MODES:
        raise ValueError(f"--tls {tls!r}: use one of {', '.join(TLS_MODES)}")
    host, port = parse_smtp(smtp)
    if sender is None:
        sender = user if user and "@" in user else to
    ch = {"kind": "mail", "to": to, "host": host, "port": port, "from": sender, "tls": tls}
    if user:
        ch["user"] = user
        ch["password"] = password or ""
    return ch


def webhook_channel(url: str, fmt: str = "json", *, secret: str | None = None,
                    chat_id: str | None = None) -> dict:
    """A webhook channel for the settings file; ``fmt`` is one of :data:`FORMATS`.

    Raises
    ------
    ValueError
        Not an http(s) URL, an unknown format, or Telegram without ``chat_id``.
    """
    parts = urllib.parse.urlsplit(url or "")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("--webhook takes the service's http(s) URL "
                         "(e.g. https://hooks.slack.com/services/...)")
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    if fmt == "telegram" and not chat_id:
        raise ValueError("--format telegram needs --chat-id (the chat that gets the messages)")
    ch = {"kind": "webhook", "url": url, "format": fmt}
    if secret:
        ch["secret"] = secret
    if chat_id:
        ch["chat_id"] = str(chat_id)
    return ch


def describe(channel: dict) -> str:
    """A channel without its secrets: ``mail to a@b.c via smtp.b.c:587 (login a@b.c)``,
    ``slack webhook to hooks.slack.com``."""
    if channel.get("kind") == "mail":
        login = f" (login {channel['user']})" if channel.get("user") else ""
        return f"mail to {channel.get('to')} via {channel.get('host')}:{channel.get('port')}{login}"
    host = urllib.parse.urlsplit(channel.get("url", "")).hostname or "?"
    signed = ", signed" if channel.get("secret") else ""
    return f"{channel.get('format', 'json')} webhook to {host}{signed}"


def merge_channels(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with each channel of ``new`` replacing the one of the same kind (one mail
    channel and one webhook at most)."""
    kinds = {c["kind"] for c in new}
    return [c for c in old if c.get("kind") not in kinds] + list(new)


# -- on the machine ----------------------------------------------------------------------------


def _json_line(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return {}


def _run_program(machine: MachineLike, name: str, *args: str, payload: dict, timeout: float) -> dict:
    """Run machine-side program ``name`` with ``args``, ``payload`` as JSON on its stdin (where
    credentials travel), and return the JSON line it answers with."""
    r = run_program(machine.connection, name, *args, stdin=json.dumps(payload).encode("utf-8"), timeout=timeout)
    out = _json_line(r.stdout)
    if out:
        return out
    if r.exit_code == 127 or "not found" in r.stderr:
        raise NotifyError(f"python3 is not available on {machine.name}, so it cannot send alerts",
                          "install it there (apt-get install python3), then run this again")
    if "notify.py" in r.stderr and ("No such file" in r.stderr or "can't open" in r.stderr):
        raise NotifyError(f"notifications are not set up on {machine.name}",
                          "run `%gpu budget notify --mail ADDRESS --smtp HOST` or "
                          "`%gpu budget notify --webhook URL` first")
    raise NotifyError(f"the notify program on {machine.name} gave no answer "
                          f"(exit {r.exit_code}: {r.stderr.strip()[-200:]})",
                          "run `%gpu budget notify` again; if it persists, check python3 there")


def read_config(machine: MachineLike) -> dict | None:
    """The settings on the machine (``None`` when notifications are not set up)."""
    r = run_program(machine.connection, "budget-notify.sh", "config", timeout=30)
    if r.exit_code != 0 or not r.stdout.strip():
        return None
    try:
        cfg = json.loads(r.stdout)
    except ValueError:
        return None
    return cfg if isinstance(cfg, dict) else None


def configure(machine: MachineLike, channels: list[dict], *, keep_others: bool = True, retries: int = 5,
              backoff: float = 2.0, timeout: float = 15.0) -> dict:
    """Install the program and write its settings on ``machine``.

    Parameters
    ----------
    channels : list of dict
        From :func:`mail_channel` / :func:`webhook_channel`.
    keep_others : bool
        Keep a configured channel of another kind (a webhook when setting mail).
    retries, backoff, timeout : int, float, float
        Attempts after the first, the first pause (seconds, doubled each time), and the
        seconds one attempt may take.

    Returns
    -------
    dict
        The settings written (with secrets; do not print it: see :func:`describe`).

    Raises
    ------
    NotifyError
        No python3 on the machine, or the files could not be written.
    """
    old = (read_config(machine) or {}).get("channels", []) if keep_others else []
    config = {"version": 1, "machine": machine.name, "channels": merge_channels(old, channels),
              "retries": retries, "backoff": backoff, "timeout": timeout}
    payload = {"program": program_source(), "config": config, "dir": f"~/{NOTIFY_DIR}"}
    _run_program(machine, "budget-notify-install.py", payload=payload, timeout=60)
    return config


def disable(machine: MachineLike) -> None:
    """Remove the settings (credentials included) and stop the spending watcher; the log
    and the program stay."""
    payload = {"program": program_source(), "config": None, "dir": f"~/{NOTIFY_DIR}"}
    _run_program(machine, "budget-notify-install.py", payload=payload, timeout=60)


@dataclass(frozen=True)
class SendResult:
    """What the machine-side program did with one event.

    Attributes
    ----------
    sent : list of str
        Channels that took it (described without secrets).
    failed : list of str
        ``channel: why`` for each that did not (after the retries).
    queued : int
        Messages kept in the outbox for a later attempt.
    skipped : str
        Why nothing was tried (not configured, already sent for this ``once`` key).
    """

    sent: list = field(default_factory=list)
    failed: list = field(default_factory=list)
    queued: int = 0
    skipped: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.sent) and not self.failed


def send_from_machine(machine: MachineLike, event: dict | str, *, retries: int | None = None, keep: bool = True,
                      timeout: float = 180) -> SendResult:
    """Have ``machine`` send ``event`` on every configured channel, and wait for the result.

    Parameters
    ----------
    event : dict or str
        ``{"event": "job-end", "job": "train", ...}`` (keys as the program's options:
        ``text``, ``job``, ``job_dir``, ``exit_code``, ``amount``, ``threshold``, ``once``,
        ``log``), or just the event name.
    retries : int, optional
        Override the configured retries (0: one attempt).
    keep : bool
        Keep a failed message in the outbox for a later attempt.

    Raises
    ------
    NotifyError
        No python3 on the machine.  A failed send is not an error: see ``failed``.
    """
    ev = {"event": event} if isinstance(event, str) else dict(event)
    if ev.get("event") not in EVENTS:
        raise ConfigError(f"unknown event {ev.get('event')!r}", f"use one of {', '.join(EVENTS)}")
    if retries is not None:
        ev["retries"] = retries
    if not keep:
        ev["no_keep"] = True
    out = _run_program(machine, "budget-notify.sh", "run", "--event-json", "-", payload=ev, timeout=timeout)
    return SendResult(list(out.get("sent", [])), list(out.get("failed", [])), int(out.get("queued", 0) or 0),
                      str(out.get("skipped", "")))


def notify_command(event: str, *, log: str | None = None, background: bool = True, **fields) -> str:
    """The ``sh`` line that sends ``event`` from the machine, standing alone (no lib.sh):
    for a script or crontab of the user's own (gpumagic's job runner and guard detach the
    same program with lib.sh's ``gm_detach``).

    ``fields`` become options (``job="train"`` -> ``--job train``); values are quoted, and
    ones holding ``$`` are left for the shell to expand, inside double quotes.  With
    ``background`` the line never blocks its caller: detached (``setsid nohup``, stdio on
    /dev/null, ``&``), outside the caller's process tree.
    It does nothing when notifications are not set up.
    """
    def word(v) -> str:
        v = str(v)
        return f'"{v}"' if "$" in v and not set('"`\\') & set(v) else shlex.quote(v)

    args = [f"--event {shlex.quote(event)}"]
    for k, v in fields.items():
        if v is not None:
            args.append(f"--{k.replace('_', '-')} {word(v)}")
    if log:
        args.append(f"--log {word(log)}")
    line = f'{_PROGRAM} {" ".join(args)}'
    guard = f'[ -f "$HOME/{NOTIFY_DIR}/config.json" ] && '
    # Detached as lib.sh's gm_detach does it (this line stands alone, without lib.sh): out of
    # the caller's process tree, group and session (setsid where it exists), so that a job's
    # kill.sh or a tmux pane's SIGHUP never ends a send still retrying.
    detached = ("( ( trap '' HUP; if command -v setsid >/dev/null 2>&1; then exec setsid nohup "
                f"{line}; fi; exec nohup {line} ) </dev/null >/dev/null 2>&1 & )")
    return guard + (detached if background else line)


def log_tail(machine: MachineLike, lines: int = 5) -> tuple[list[str], int]:
    """The last lines of the machine's notify log and the number of messages waiting in its
    outbox."""
    r = run_program(machine.connection, "budget-notify.sh", "log", int(lines), timeout=30)
    out = r.stdout.splitlines()
    waiting = 0
    if out and out[-1].startswith("outbox "):
        waiting = int(out.pop()[7:] or 0)
    return out, waiting


# -- spending thresholds -----------------------------------------------------------------------


def crossing_elapsed(prices, threshold: float) -> float | None:
    """Seconds after billing started when spending first reaches ``threshold`` (``None``:
    never, nothing is billed).  See :func:`gpumagic.budget.prices.limit_deadline`."""
    dl = limit_deadline(prices, threshold)
    if dl is None:
        return None
    return dl if spent(prices, dl) >= threshold else dl + 1


def threshold_items(name: str, prices, start: float, now: float, thresholds, *,
                    log: str | None = None) -> list[dict]:
    """The watcher's schedule: one ``threshold`` event per threshold not yet reached, with
    ``in_s`` (seconds from ``now``), the amount at that moment, and a once-key for this
    rental (``start``, epoch seconds).  Pure."""
    elapsed = max(0.0, now - start)
    items = []
    for t in sorted({float(x) for x in thresholds}):
        at = crossing_elapsed(prices, t)
        if at is None or at <= elapsed:
            continue
        item = {"event": "threshold", "in_s": at - elapsed, "machine": name,
                "amount": prices.money(spent(prices, at)), "threshold": prices.money(t),
                "once": f"threshold:{name}:{start:.0f}:{t:g}"}
        if log:
            item["log"] = [log]
        items.append(item)
    return items


@dataclass(frozen=True)
class Scheduled:
    """Thresholds armed on the machine: ``items`` (each with ``in_s``, ``threshold``,
    ``amount``) and ``reason`` when none could be (no prices, no thresholds, all passed)."""

    items: list
    reason: str = ""


def schedule_thresholds(machine: MachineLike, ledger=None, *, now: float | None = None) -> Scheduled:
    """Arm the machine-side watcher that sends each spending threshold still ahead.

    Reads the machine's prices, thresholds and billing start from the ledger (one round trip
    for the machine's clock), replaces any earlier schedule, and returns what was armed.

    Raises
    ------
    NotifyError
        No python3 on the machine.
    """
    ledger = ledger or Ledger()
    rec = ledger.machine(machine.name)
    if rec is None or rec.prices is None:
        items, reason = [], f"no prices are set for {machine.name} (`%gpu budget set --rate ...`)"
    elif not rec.alerts:
        items, reason = [], "no alert thresholds are set (`%gpu budget set --alert 10,20`)"
    else:
        clock, _ = read_status(machine)
        local_now = time.time() if now is None else now
        start = rec.billing_start(clock, local_now)
        items = threshold_items(machine.name, rec.prices, start, local_now, rec.alerts)
        reason = "" if items else "every alert threshold has already been passed"
    payload = {"items": items, "alive_path": machine.scratch_dir()}
    _run_program(machine, "budget-notify.sh", "run", "schedule", payload=payload, timeout=60)
    return Scheduled(items, reason)
