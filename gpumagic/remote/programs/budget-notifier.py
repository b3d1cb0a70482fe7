#!/usr/bin/env python3
"""gpumagic-notify: send an alert by mail or webhook from this machine (standard library only).

Installed by gpumagic (``%gpu budget notify``) as ``~/.gpumagic/notify/notify.py`` next to
its settings, ``config.json`` (mode 0600, in a 0700 folder): the credentials live there and
nowhere else -- never in argv, never in a log.  Runs with any Python 3.6 or newer.

Usage (what the budget guard and the job runner call, in the background)::

    python3 ~/.gpumagic/notify/notify.py --event threshold --amount "10.20 CNY" --threshold "10.00 CNY"
    python3 ~/.gpumagic/notify/notify.py --event job-end --job train --job-dir ~/.gpumagic/jobs/train --log FILE
    python3 ~/.gpumagic/notify/notify.py --event shutdown --text "shutting down in 600s (GPU idle)" --log FILE
    python3 ~/.gpumagic/notify/notify.py --event-json - < event.json
    python3 ~/.gpumagic/notify/notify.py flush        # retry what is waiting in the outbox

It never raises into its caller and always exits 0 (the result is one JSON line on stdout):
each channel is tried with exponential backoff (``retries`` times, ``backoff`` x 2^k seconds
apart).  A server that answers 429 (Too Many Requests) or 503 (Service Unavailable) with a
``Retry-After`` header (delta-seconds or an HTTP-date, RFC 9110 section 10.2.3) is not asked
again before that time; a wait longer than what is left of the retry budget (the backoff
schedule's own sum) is not slept through.  A message that still cannot be sent is kept in
``outbox/`` with why it waits (and, after a Retry-After, ``not_before``: the time the server
named) and sent with the next message or ``flush`` once that time has passed; the failure is
recorded in ``log`` (and in ``--log FILE``: the job's or the guard's log).  ``--once KEY``
sends a message at most once per KEY.

Payloads (``format`` of a webhook), as each service documents its incoming-webhook API:

* ``json``: ``{"event", "machine", "title", "text", "time", "details"}`` (generic).
* ``slack``: ``{"text": ...}`` (Slack incoming webhooks).
* ``discord``: ``{"content": ...}``, at most 2000 characters (Discord "Execute Webhook").
* ``feishu`` / ``lark``: ``{"msg_type": "text", "content": {"text": ...}}``; with a signing
  secret also ``timestamp`` (seconds) and ``sign`` = base64(HMAC-SHA256(key =
  "timestamp\\nsecret", message = "")); success is ``"code": 0`` in the reply.
* ``dingtalk``: ``{"msgtype": "text", "text": {"content": ...}}``; with a secret,
  ``&timestamp=MS&sign=...`` (base64 HMAC-SHA256 of "timestamp\\nsecret" keyed by the
  secret, URL-encoded) is added to the URL; success is ``"errcode": 0``.
* ``wecom`` (WeChat Work group robot): ``{"msgtype": "text", "text": {"content": ...}}``, at
  most 2048 bytes; success is ``"errcode": 0``.
* ``telegram``: ``{"chat_id": ..., "text": ...}`` POSTed to ``.../bot<TOKEN>/sendMessage``,
  at most 4096 characters; success is ``"ok": true``.

Mail goes through ``smtplib``: SMTPS on port 465 (or ``tls: ssl``), otherwise STARTTLS
whenever the server offers it (certificates checked).  A password is only ever sent over
TLS, unless the settings say ``tls: none``.
"""

import argparse
import base64
import hashlib
import hmac
import json
import os
import random
import re
import signal
import smtplib
import socket
import ssl
import sys
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
from email.message import EmailMessage
from email.utils import formatdate, make_msgid, parsedate_to_datetime

HERE = os.path.dirname(os.path.abspath(__file__))
FORMATS = ("json", "slack", "discord", "feishu", "lark", "dingtalk", "wecom", "telegram")
LIMITS = {"discord": 2000, "telegram": 4096}
EVENTS = ("test", "threshold", "job-end", "job-failed", "stop", "shutdown", "guard", "message")
LAST_LINES = 20


class Failed(Exception):
    """A send that did not go through (the message is safe to record: no secrets).

    ``retry_after``: seconds the server asked to wait before the next try (its
    ``Retry-After``), or None.  ``not_before``: for :func:`deliver`'s result, the time
    (``time.time()``) before which the message is not sent again, or None.
    """

    def __init__(self, text, retry_after=None, not_before=None):
        Exception.__init__(self, text)
        self.retry_after = retry_after
        self.not_before = not_before


# -- files ---------------------------------------------------------------------------------


def _now_text():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def append_line(path, line):
    """Append one line to ``path``; never raises."""
    try:
        # a new log is private (0600): it names the channels and what was sent
        with open(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a", encoding="utf-8") as f:
            f.write("%s %s\n" % (_now_text(), line))
    except Exception:
        pass


def write_private(path, data):
    """Write ``data`` (bytes) to ``path`` atomically with mode 0600."""
    tmp = "%s.tmp%d" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def load_config(path):
    """The settings, refusing a file that others can read (like OpenSSH with a key file)."""
    st = os.stat(path)
    if st.st_mode & 0o077:
        raise Failed("%s is readable by others (mode %o); run: chmod 600 %s"
                     % (path, st.st_mode & 0o777, path))
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# -- the message -----------------------------------------------------------------------------


def _read(path, default=""):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return default


def tail(path, n=LAST_LINES, max_bytes=64 * 1024):
    """The last ``n`` non-blank lines of a file (after each line's last carriage return)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    lines = [ln.rsplit("\r", 1)[-1] for ln in data.splitlines()]
    return [ln for ln in lines if ln.strip()][-n:]


def _tail_text(path, max_bytes=64 * 1024):
    """The last ``max_bytes`` of a file, decoded (empty when unreadable)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _duration(seconds):
    seconds = int(max(0, seconds))
    return "%d:%02d:%02d" % (seconds // 3600, seconds // 60 % 60, seconds % 60)


_RANK_PREFIX = re.compile(r"^\[default(\d+)\]:")
_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\).*?rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)",
                         re.S)


def torchrun_ranks(name, job_dir):
    """For one machine's part of a torchrun job (its command exports GPUMAGIC_TORCHRUN_DIR;
    gpumagic/remote/distributed.py): local rank -> global rank, from the ``ranks/`` files
    torchrun_rank.py writes in its torchrun folder; None for a plain job."""
    if "GPUMAGIC_TORCHRUN_DIR" not in _read(os.path.join(job_dir, "command")):
        return None
    folder = os.path.join(os.path.expanduser("~"), ".gpumagic", "torchrun", name, "ranks")
    ranks = {}
    try:
        names = os.listdir(folder)
    except OSError:
        names = []
    for n in names:
        if n.isdigit():
            local = _read(os.path.join(folder, n)).split(" ")[0]
            if local.isdigit():
                ranks[int(local)] = int(n)
    return ranks


def rank_of(line, ranks, machine):
    """``rank 3 on box-b`` for a torchrun log line (``[defaultL]:`` prefix), else ``""``."""
    m = _RANK_PREFIX.match(line or "")
    if ranks is None or not m:
        return ""
    local = int(m.group(1))
    return ("rank %d on %s" % (ranks[local], machine) if local in ranks
            else "local rank %d on %s" % (local, machine))


def job_message(event, machine):
    """Title, text and details of a job's end, read from its directory (gpumagic/remote/jobs.py)."""
    name = event.get("job") or "?"
    d = os.path.expanduser(event.get("job_dir") or os.path.join("~", ".gpumagic", "jobs", name))
    code = event.get("exit_code")
    if code is None:
        code = _read(os.path.join(d, "exit_code"), "")
    killed = _read(os.path.join(d, "killed"))
    stopped_by = _read(os.path.join(d, "stopped_by"))
    try:
        code = int(code)
    except (TypeError, ValueError):
        code = None
    try:
        ran = float(_read(os.path.join(d, "ended"))) - float(_read(os.path.join(d, "started")))
        took = " after %s" % _duration(ran)
    except ValueError:
        took = ""
    ranks = torchrun_ranks(name, d)
    lines = event.get("lines") or tail(os.path.join(d, "log"), int(event.get("n_lines") or LAST_LINES))
    where = rank_of(stopped_by, ranks, machine)
    failed = ""  # a torchrun job: the rank torchrun names as the first to fail
    if ranks is not None and code not in (0, None) and not killed:
        found = None
        for found in _ROOT_CAUSE.finditer(_tail_text(os.path.join(d, "log"))):
            pass  # the last block: this run's
        if found:
            g, local = int(found.group(1)), int(found.group(2))
            failed = "rank %d on %s" % (g, machine)
            ranks.setdefault(local, g)
    if ranks is not None:  # torchrun's [defaultL]: becomes [rank G]:
        def relabel(ln):
            return _RANK_PREFIX.sub(lambda m: "[rank %s]:" % ranks.get(int(m.group(1)), "local " + m.group(1)), ln)
        lines, stopped_by = [relabel(ln) for ln in lines], relabel(stopped_by)
    if killed and killed != "user":
        title = "job %s stopped (%s%s)" % (name, killed, ", " + where if where else "")
        why = ("stopped by --stop-on %s%s at: %s" % (killed, " from " + where if where else "", stopped_by)
               if stopped_by else "stopped (%s)" % killed)
    elif killed:
        title, why = "job %s was killed" % name, "killed by the user"
    elif code == 0:
        title, why = "job %s finished" % name, "exit code 0"
    elif code in (137, -9):
        title, why = "job %s failed" % name, "exit code 137: killed by the system (often out of host memory)"
    elif code is None:
        title, why = "job %s ended" % name, "exit code unknown"
    else:
        title, why = "job %s failed" % name, "exit code %d" % code
    if failed:
        title, why = "%s (%s)" % (title, failed), "%s failed first, %s" % (failed, why)
    text = "%s on %s: %s%s." % (title, machine, why, took)
    if lines:
        text += "\nlast lines of its log:\n" + "\n".join(lines)
    return title, text, {"job": name, "exit_code": code, "killed": killed or None, "last_lines": lines,
                         "rank": where or failed or None}


def compose(event, machine):
    """``(title, text, details)`` for an event dict (see the module docstring)."""
    kind = event.get("event") or "message"
    extra = event.get("text") or ""
    if kind == "test":
        return ("test message", "gpumagic on %s: this is a test; alerts will arrive like this." % machine,
                {})
    if kind == "threshold":
        amount, threshold = event.get("amount", "?"), event.get("threshold", "?")
        return ("spent %s" % amount,
                "%s has spent %s, past your alert at %s.%s" % (machine, amount, threshold,
                                                               (" " + extra) if extra else ""),
                {"amount": amount, "threshold": threshold})
    if kind in ("job-end", "job-failed", "stop"):
        return job_message(event, machine)
    if kind == "shutdown":
        return ("shutting down", "%s: the guard will shut it down: %s" % (machine, extra or "soon"), {})
    return (kind, "%s: %s" % (machine, extra or kind), {})


# -- channels --------------------------------------------------------------------------------


def _sign(secret, string_to_sign, key_is_string):
    if key_is_string:  # Feishu: the string is the key, the message is empty
        mac = hmac.new(string_to_sign.encode("utf-8"), b"", hashlib.sha256)
    else:  # DingTalk: keyed by the secret
        mac = hmac.new(secret.encode("utf-8"), string_to_sign.encode("utf-8"), hashlib.sha256)
    return base64.b64encode(mac.digest()).decode("ascii")


def _clip(text, limit, by_bytes=False):
    if by_bytes:
        data = text.encode("utf-8")
        if len(data) <= limit:
            return text
        return data[:limit - 3].decode("utf-8", "ignore") + "..."
    return text if len(text) <= limit else text[:limit - 3] + "..."


def webhook_request(channel, msg, now=None):
    """``(url, body bytes)`` for a webhook channel and a message dict."""
    fmt = channel.get("format", "json")
    url = channel["url"]
    full = "[gpumagic] %s\n%s" % (msg["title"], msg["text"])
    now = time.time() if now is None else now
    secret = channel.get("secret") or ""
    if fmt == "slack":
        body = {"text": full}
    elif fmt == "discord":
        body = {"content": _clip(full, LIMITS["discord"])}
    elif fmt in ("feishu", "lark"):
        body = {"msg_type": "text", "content": {"text": full}}
        if secret:
            ts = str(int(now))
            body["timestamp"] = ts
            body["sign"] = _sign(secret, "%s\n%s" % (ts, secret), True)
    elif fmt == "dingtalk":
        body = {"msgtype": "text", "text": {"content": full}}
        if secret:
            ts = str(int(now * 1000))
            sign = urllib.parse.quote_plus(_sign(secret, "%s\n%s" % (ts, secret), False))
            url += ("&" if "?" in url else "?") + "timestamp=%s&sign=%s" % (ts, sign)
    elif fmt == "wecom":
        body = {"msgtype": "text", "text": {"content": _clip(full, 2048, by_bytes=True)}}
    elif fmt == "telegram":
        if not url.rstrip("/").endswith("/sendMessage"):
            url = url.rstrip("/") + "/sendMessage"
        body = {"chat_id": channel.get("chat_id"), "text": _clip(full, LIMITS["telegram"])}
    else:
        body = {"event": msg["event"], "machine": msg["machine"], "title": msg["title"],
                "text": msg["text"], "time": msg["time"], "details": msg.get("details", {})}
    return url, json.dumps(body, ensure_ascii=False).encode("utf-8")


def where(channel):
    """A channel named without its secrets: ``mail to a@b via smtp.x:587``, ``slack webhook
    (hooks.slack.com)``."""
    if channel.get("kind") == "mail":
        return "mail to %s via %s:%s" % (channel.get("to"), channel.get("host"), channel.get("port"))
    host = urllib.parse.urlsplit(channel.get("url", "")).hostname or "?"
    return "%s webhook (%s)" % (channel.get("format", "json"), host)


def _check_reply(fmt, status, data):
    try:
        reply = json.loads(data.decode("utf-8", "replace")) if data.strip() else None
    except ValueError:
        reply = None
    if not isinstance(reply, dict):
        return
    if fmt in ("feishu", "lark"):
        code = reply.get("code", reply.get("StatusCode", 0))
        if code not in (0, None):
            raise Failed("the service answered code %s: %s" % (code, reply.get("msg") or reply.get("StatusMessage")))
    elif fmt in ("dingtalk", "wecom"):
        if reply.get("errcode", 0) != 0:
            raise Failed("the service answered errcode %s: %s" % (reply.get("errcode"), reply.get("errmsg")))
    elif fmt == "telegram" and reply.get("ok") is False:
        raise Failed("Telegram answered: %s" % reply.get("description"))


#: HTTP statuses whose Retry-After says when to ask again (RFC 9110 section 10.2.3, RFC 6585 section 4).
RETRY_AFTER_STATUSES = (429, 503)


def retry_after_seconds(value, now=None):
    """Seconds to wait from a ``Retry-After`` value: delta-seconds (``"120"``) or an
    HTTP-date (``"Wed, 21 Oct 2026 07:28:00 GMT"``, from ``now``); None when absent or
    unreadable.  Never negative."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None:
        return None
    now = time.time() if now is None else now
    try:
        return max(0.0, when.timestamp() - now)
    except (OverflowError, OSError, ValueError):
        return None


def send_webhook(channel, msg, timeout):
    url, body = webhook_request(channel, msg)
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json; charset=utf-8",
                                          "User-Agent": "gpumagic-notify"})
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ssl.create_default_context()) as r:
            _check_reply(channel.get("format", "json"), r.status, r.read(65536))
    except urllib.error.HTTPError as e:
        wait = retry_after_seconds(e.headers.get("Retry-After")) if e.code in RETRY_AFTER_STATUSES else None
        raise Failed("HTTP %s %s" % (e.code, e.reason), retry_after=wait)
    except urllib.error.URLError as e:
        raise Failed("cannot reach the server (%s)" % (e.reason,))
    except (socket.timeout, TimeoutError):
        raise Failed("no answer within %g s" % timeout)
    except (OSError, ValueError) as e:
        raise Failed("%s: %s" % (type(e).__name__, e))


def mail_message(channel, msg):
    m = EmailMessage()
    m["From"] = channel.get("from") or channel.get("user") or "gpumagic@%s" % socket.gethostname()
    m["To"] = channel["to"]
    m["Subject"] = "[gpumagic] %s: %s" % (msg["machine"], msg["title"])
    m["Date"] = formatdate(localtime=False)
    m["Message-ID"] = make_msgid("gpumagic")
    m.set_content(msg["text"] + "\n\n-- sent by gpumagic from %s at %s\n" % (msg["machine"], msg["time"]))
    return m


def send_mail(channel, msg, timeout):
    host, port = channel["host"], int(channel.get("port") or 587)
    tls = channel.get("tls", "auto")
    context = ssl.create_default_context()
    try:
        if tls == "ssl" or (port == 465 and tls == "auto"):
            server = smtplib.SMTP_SSL(host, port, timeout=timeout, context=context)
            secure = True
        else:
            server = smtplib.SMTP(host, port, timeout=timeout)
            server.ehlo()
            secure = False
            if tls != "none" and server.has_extn("starttls"):
                server.starttls(context=context)
                server.ehlo()
                secure = True
            elif tls == "starttls":
                server.quit()
                raise Failed("%s:%s does not offer STARTTLS" % (host, port))
        try:
            if channel.get("user"):
                if not secure and tls != "none":
                    raise Failed("%s:%s offers no TLS; the password is not sent in clear "
                                 "(use port 465, or a server with STARTTLS)" % (host, port))
                server.login(channel["user"], channel.get("password") or "")
            server.send_message(mail_message(channel, msg))
        finally:
            try:
                server.quit()
            except Exception:
                pass
    except Failed:
        raise
    except smtplib.SMTPAuthenticationError as e:
        raise Failed("login refused (%s)" % e.smtp_code)
    except smtplib.SMTPException as e:
        raise Failed("SMTP: %s" % (type(e).__name__,) + (" %s" % getattr(e, "smtp_code", "")).rstrip())
    except ssl.SSLError as e:
        raise Failed("TLS: %s" % (e.reason or e,))
    except (socket.timeout, TimeoutError):
        raise Failed("no answer within %g s" % timeout)
    except OSError as e:
        raise Failed("cannot reach %s:%s (%s)" % (host, port, e.strerror or e))


def scrub(text, channel):
    """``text`` with every secret of ``channel`` replaced (for logs)."""
    for key in ("url", "password", "secret"):
        v = channel.get(key)
        if v:
            text = text.replace(v, "***")
    return text


def retry_budget(retries, backoff):
    """Seconds that ``retries`` tries after the first may wait in all: the backoff schedule's
    own sum, ``backoff`` x (2^retries - 1), with its 10 % jitter."""
    return backoff * (2 ** retries - 1) * 1.1


def deliver(channel, msg, retries, backoff, timeout, sleep=time.sleep, clock=time.time):
    """Send ``msg`` on ``channel``, retrying with exponential backoff.

    A failure that carries the server's ``Retry-After`` waits at least that long before the
    next try; when that is more than what is left of :func:`retry_budget`, no more tries are
    made (the server said they would be refused) and the result's ``not_before`` is the time
    it named.

    Returns None when sent, else a :class:`Failed` whose text is the last error (secrets
    scrubbed) and the number of attempts.
    """
    last = ""
    budget = retry_budget(retries, backoff)
    waited = 0.0
    attempts = 0
    not_before = None
    for attempt in range(retries + 1):
        if attempt:
            delay = backoff * (2 ** (attempt - 1)) * (1 + random.random() / 10)
            if not_before is not None:
                asked = not_before - clock()
                if waited + asked > budget:
                    last += "; the server asked to wait %d s (Retry-After), more than the retry budget" % round(asked)
                    break
                delay = max(delay, asked)
            sleep(delay)
            waited += delay
        attempts += 1
        not_before = None
        try:
            if channel.get("kind") == "mail":
                send_mail(channel, msg, timeout)
            else:
                send_webhook(channel, msg, timeout)
            return None
        except Failed as e:
            last = str(e)
            if e.retry_after is not None:
                not_before = clock() + e.retry_after
        except Exception as e:  # a bug here must not stop the caller either
            last = "%s: %s" % (type(e).__name__, e)
    return Failed(scrub(last, channel) + " (%d attempt%s)" % (attempts, "" if attempts == 1 else "s"),
                  not_before=not_before)


# -- the outbox and once-keys -----------------------------------------------------------------


def _key_path(base, key):
    return os.path.join(base, "sent", hashlib.sha256(key.encode("utf-8")).hexdigest()[:32])


def claim_once(base, key):
    """True the first time ``key`` is claimed (a file under ``sent/``), False after."""
    os.makedirs(os.path.join(base, "sent"), mode=0o700, exist_ok=True)
    try:
        fd = os.open(_key_path(base, key), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    os.write(fd, (key + "\n").encode("utf-8"))
    os.close(fd)
    return True


def _waits(err):
    """The outbox's fields for why a message waits (``deliver``'s result)."""
    item = {"why": str(err)}
    if getattr(err, "not_before", None) is not None:
        item["not_before"] = err.not_before
    return item


def queue(base, channel_id, msg, err=None):
    """Keep ``msg`` in the outbox, with why it waits (``err``: :func:`deliver`'s result)."""
    out = os.path.join(base, "outbox")
    os.makedirs(out, mode=0o700, exist_ok=True)
    name = "%d-%d-%06d.json" % (time.time() * 1000, os.getpid(), random.randrange(10 ** 6))
    item = {"channel": channel_id, "message": msg}
    if err is not None:
        item.update(_waits(err))
    write_private(os.path.join(out, name), json.dumps(item).encode())
    return name


def waits_until(err):
    """`` until HH:MM:SSZ (the server's Retry-After)`` for a result with ``not_before``, else ``""``."""
    when = getattr(err, "not_before", None)
    if when is None:
        return ""
    return " after %s (the server's Retry-After)" % time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))


def channel_id(channel):
    """A stable name for a channel that holds no secret (for the outbox)."""
    raw = json.dumps({k: channel.get(k) for k in ("kind", "format", "url", "to", "host", "port", "chat_id")},
                     sort_keys=True)
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()[:16]


def flush(base, config, log_paths, timeout, sleep=time.sleep, clock=time.time):
    """Try once more everything in the outbox whose ``not_before`` has passed; returns (sent,
    still waiting)."""
    out = os.path.join(base, "outbox")
    try:
        names = sorted(n for n in os.listdir(out) if n.endswith(".json"))
    except OSError:
        return 0, 0
    channels = {channel_id(c): c for c in config.get("channels", [])}
    sent = waiting = 0
    down = set()  # channels that failed in this round: their other messages wait for the next
    for name in names:
        path = os.path.join(out, name)
        mine = "%s.sending%d" % (path, os.getpid())
        try:
            os.rename(path, mine)  # claimed: no other process sends it too
        except OSError:
            continue
        item = {}
        try:
            with open(mine, encoding="utf-8") as f:
                item = json.load(f)
            channel = channels.get(item.get("channel"))
            if channel is None:  # that channel was removed since: nothing to send it to
                os.unlink(mine)
                continue
            if item["channel"] in down:
                err = "skipped"
            elif (item.get("not_before") or 0) > clock():
                err = "not before"  # the server's Retry-After has not passed: it would refuse it
            else:
                err = deliver(channel, item["message"], 0, 0, timeout, sleep, clock)
                if err is not None:
                    down.add(item["channel"])
                    item.pop("not_before", None)
                    item.update(_waits(err))
                    write_private(mine, json.dumps(item).encode())
        except Exception as e:
            err = "unreadable outbox item (%s)" % type(e).__name__
            channel = {}
        if err is None:
            os.unlink(mine)
            sent += 1
            for p in log_paths:
                append_line(p, "notify: sent the earlier %s message by %s" % (item["message"]["event"], where(channel)))
        else:
            os.rename(mine, path)
            waiting += 1
    return sent, waiting


# -- install, schedule, watch ----------------------------------------------------------------


def install(payload):
    """Write the program and its settings (called through ``python3 -c`` by gpumagic, with the
    payload on stdin: ``{"program": source, "config": {...} or null, "dir": "~/.gpumagic/notify"}``).

    The folder is 0700 and both files 0600; a ``null`` config removes the settings (and stops
    a spending watcher).  Prints one JSON line.
    """
    base = os.path.expanduser(payload.get("dir") or "~/.gpumagic/notify")
    old = os.umask(0o077)
    try:
        os.makedirs(base, mode=0o700, exist_ok=True)
        os.chmod(base, 0o700)
        write_private(os.path.join(base, "notify.py"), payload["program"].encode("utf-8"))
        cfg_path = os.path.join(base, "config.json")
        if payload.get("config") is None:
            for p in (cfg_path, os.path.join(base, "schedule.json")):
                try:
                    os.unlink(p)
                except OSError:
                    pass
            stop_watcher(base)
        else:
            write_private(cfg_path, json.dumps(payload["config"], indent=1).encode("utf-8"))
    finally:
        os.umask(old)
    print(json.dumps({"dir": base, "python": sys.version.split()[0]}))


def _watcher_pid(base):
    try:
        pid = int(_read(os.path.join(base, "watch.pid")))
    except ValueError:
        return None
    try:
        if os.path.exists("/proc/self"):  # Linux: a reused pid, or a zombie, is not ours
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                if b"notify.py" not in f.read():
                    return None
        os.kill(pid, 0)
    except OSError:
        return None
    return pid


def stop_watcher(base):
    pid = _watcher_pid(base)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass


def schedule(base, payload):
    """Arm the spending watcher: ``payload["items"]`` are events with ``in_s`` (seconds from
    now, this machine's clock) and a ``once`` key; an optional ``alive_path`` stops the watcher
    when it disappears (the sandbox).  Replaces an earlier schedule.  Prints one JSON line."""
    now = time.time()
    items = []
    for it in payload.get("items", []):
        ev = dict(it)
        ev["at"] = now + float(ev.pop("in_s"))
        items.append(ev)
    sid = "%d-%d" % (now * 1000, os.getpid())
    sched = {"id": sid, "items": sorted(items, key=lambda e: e["at"]), "alive_path": payload.get("alive_path")}
    write_private(os.path.join(base, "schedule.json"), json.dumps(sched).encode("utf-8"))
    stop_watcher(base)
    pid = None
    if items:
        pid = os.fork()
        if pid == 0:  # detach: new session, stdio on /dev/null, survives the SSH channel
            try:
                os.setsid()
                if os.fork():
                    os._exit(0)
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                os.execv(sys.executable, [sys.executable, os.path.join(base, "notify.py"), "watch", sid])
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        for _ in range(50):
            if _watcher_pid(base):
                break
            time.sleep(0.05)
    print(json.dumps({"scheduled": len(items), "watcher": _watcher_pid(base)}))


def watch(base, sid, send):
    """The spending watcher: sleep until each item is due, send it (once), exit when done or
    when the schedule is replaced or removed."""
    write_private(os.path.join(base, "watch.pid"), str(os.getpid()).encode())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    path = os.path.join(base, "schedule.json")
    while True:
        try:
            with open(path, encoding="utf-8") as f:
                sched = json.load(f)
        except (OSError, ValueError):
            return
        if sched.get("id") != sid:
            return
        alive = sched.get("alive_path")
        if alive and not os.path.exists(alive):
            return
        pending = [e for e in sched["items"] if not e.get("done")]
        if not pending:
            return
        due = pending[0]
        wait = due["at"] - time.time()
        if wait > 0:
            time.sleep(min(wait, 30))
            continue
        due["done"] = True
        write_private(path, json.dumps(sched).encode("utf-8"))
        send(due)


# -- main ------------------------------------------------------------------------------------


def send_event(event, base=HERE, config_path=None, log_paths=(), retries=None, keep=True, sleep=time.sleep,
               clock=time.time):
    """Send one event on every configured channel; returns a result dict.  Never raises."""
    result = {"sent": [], "failed": [], "queued": 0, "skipped": "", "flushed": 0}
    logs = [os.path.join(base, "log")] + [os.path.expanduser(p) for p in log_paths if p]
    try:
        config = load_config(config_path or os.path.join(base, "config.json"))
    except Exception as e:
        if isinstance(e, Failed):
            why = str(e)
        elif isinstance(e, FileNotFoundError):
            why = "notifications are not set up on this machine (`%gpu budget notify`)"
        else:
            why = "the notification settings cannot be read (%s)" % type(e).__name__
        result["skipped"] = why
        for p in logs:
            append_line(p, "notify: not sent (%s): %s" % (event.get("event"), why))
        return result
    try:
        timeout = float(config.get("timeout", 15))
        if event.get("once") and not claim_once(base, event["once"]):
            result["skipped"] = "already sent (%s)" % event["once"]
            return result
        result["flushed"] = flush(base, config, logs, timeout, sleep, clock)[0]
        machine = event.get("machine") or config.get("machine") or socket.gethostname()
        title, text, details = compose(event, machine)
        msg = {"event": event.get("event") or "message", "machine": machine, "title": title, "text": text,
               "time": _now_text(), "details": details}
        retries = int(config.get("retries", 5) if retries is None else retries)
        backoff = float(config.get("backoff", 2.0))
        for channel in config.get("channels", []):
            err = deliver(channel, msg, retries, backoff, timeout, sleep, clock)
            if err is None:
                result["sent"].append(where(channel))
                for p in logs:
                    append_line(p, "notify: sent %s by %s" % (msg["event"], where(channel)))
                continue
            line = "notify: %s by %s FAILED: %s" % (msg["event"], where(channel), err)
            if keep:
                queue(base, channel_id(channel), msg, err)
                result["queued"] += 1
                line += "; kept in %s, sent with the next message%s" % (os.path.join(base, "outbox"),
                                                                         waits_until(err))
            result["failed"].append("%s: %s" % (where(channel), err))
            for p in logs:
                append_line(p, line)
        if not config.get("channels"):
            result["skipped"] = "no channel is configured"
    except Exception as e:  # never into the caller
        result["failed"].append("internal error: %s" % type(e).__name__)
        for p in logs:
            append_line(p, "notify: internal error %s: %s" % (type(e).__name__,
                                                              traceback.format_exc(limit=1).strip().splitlines()[-1]))
    return result


def main(argv=None):
    try:  # a caller's terminal closing (tmux pane of a job that ended) must not end a send
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    except (AttributeError, ValueError):
        pass
    p = argparse.ArgumentParser(prog="notify.py", description="send a gpumagic alert by mail or webhook")
    p.add_argument("command", nargs="?", default="send", choices=("send", "flush", "watch", "schedule"))
    p.add_argument("arg", nargs="?")
    p.add_argument("--event", choices=EVENTS, default="message")
    p.add_argument("--event-json", metavar="FILE", help="read the event as JSON ('-': stdin)")
    p.add_argument("--text", default="")
    p.add_argument("--machine")
    p.add_argument("--job")
    p.add_argument("--job-dir")
    p.add_argument("--exit-code", type=int)
    p.add_argument("--amount")
    p.add_argument("--threshold")
    p.add_argument("--once", metavar="KEY", help="send at most once for this key")
    p.add_argument("--log", action="append", default=[], metavar="FILE", help="also record the result here")
    p.add_argument("--retries", type=int, help="override the configured number of retries")
    p.add_argument("--no-keep", action="store_true", help="do not keep a failed message in the outbox")
    try:
        a = p.parse_args(argv)
    except SystemExit:
        print(json.dumps({"failed": ["bad arguments"], "sent": []}))
        return 0
    base = HERE
    try:
        if a.command == "flush":
            cfg = load_config(os.path.join(base, "config.json"))
            sent, waiting = flush(base, cfg, [os.path.join(base, "log")] + a.log, float(cfg.get("timeout", 15)))
            print(json.dumps({"flushed": sent, "waiting": waiting}))
            return 0
        if a.command == "schedule":
            schedule(base, json.load(sys.stdin))
            return 0
        if a.command == "watch":
            watch(base, a.arg, lambda ev: send_event(ev, base, log_paths=ev.get("log") or ()))
            return 0
        if a.event_json:
            raw = sys.stdin.read() if a.event_json == "-" else open(a.event_json, encoding="utf-8").read()
            event = json.loads(raw)
        else:
            event = {"event": a.event, "text": a.text, "machine": a.machine, "job": a.job, "job_dir": a.job_dir,
                     "exit_code": a.exit_code, "amount": a.amount, "threshold": a.threshold, "once": a.once}
        logs = list(a.log) + list(event.get("log") or [])
        result = send_event(event, base, log_paths=logs, retries=a.retries if a.retries is not None
                            else event.get("retries"), keep=not (a.no_keep or event.get("no_keep")))
    except Exception as e:
        append_line(os.path.join(base, "log"), "notify: %s failed: %s" % (a.command, type(e).__name__))
        result = {"sent": [], "failed": ["%s: %s" % (a.command, type(e).__name__)]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BaseException:  # never a traceback or a non-zero exit into a guard loop
        sys.exit(0)
