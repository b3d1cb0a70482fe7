"""Alerts sent from the machine: a real SMTP server (aiosmtpd) and a real HTTP server on
127.0.0.1 receive them; the machine-side program runs on the test sshd."""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.server
import importlib.util
import json
import subprocess
import os
import re
import stat
import threading
import time
import urllib.parse
from pathlib import Path

import pytest
from IPython.utils.capture import capture_output

from gpumagic import budget
from gpumagic.budget import notify
from gpumagic.budget.guard import guard_log_path
from gpumagic.ssh.sandbox import free_port

from conftest import wait_until

PROGRAM = Path(notify.__file__).parent.parent / "remote" / "programs" / "budget-notifier.py"


def load_program():
    spec = importlib.util.spec_from_file_location("gpumagic_notify_program", PROGRAM)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUMAGIC_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


@pytest.fixture
def notify_dir(sshd):
    return sshd.dir / "home" / ".gpumagic" / "notify"


@pytest.fixture
def clean_notify(machine):
    yield machine
    notify.disable(machine)  # settings gone, spending watcher stopped


class SmtpSink:
    """aiosmtpd on 127.0.0.1 keeping every message it receives."""

    def __init__(self):
        from aiosmtpd.controller import Controller
        from aiosmtpd.smtp import AuthResult

        self.messages = []
        self.logins = []
        sink = self

        class Handler:
            async def handle_DATA(self, server, session, envelope):
                sink.messages.append(envelope)
                return "250 OK"

        def authenticator(server, session, envelope, mechanism, data):
            sink.logins.append((data.login.decode(), data.password.decode()))
            return AuthResult(success=True)

        self.port = free_port()
        # AUTH offered without TLS here: gpumagic must still refuse to log in unless told tls=none
        self.controller = Controller(Handler(), hostname="127.0.0.1", port=self.port,
                                     authenticator=authenticator, auth_require_tls=False)
        self.controller.start()

    def stop(self):
        self.controller.stop()


class HookServer:
    """A local HTTP server that records each POST (path and JSON body); ``delay`` seconds
    before answering; ``reply`` is the JSON it answers with."""

    def __init__(self, port: int | None = None, delay: float = 0.0, reply: dict | None = None):
        self.posts = []
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                n = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(n))
                if outer.delay:
                    time.sleep(outer.delay)
                outer.posts.append((self.path, body))
                data = json.dumps(outer.reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.delay = delay
        self.reply = reply or {"ok": True}
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port or 0), H)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def smtp():
    s = SmtpSink()
    yield s
    s.stop()


@pytest.fixture
def hook():
    s = HookServer()
    yield s
    s.stop()


# -- payloads (pure) ---------------------------------------------------------------------------


def test_payload_shapes_follow_each_services_webhook_api():
    prog = load_program()
    msg = {"event": "threshold", "machine": "gpu1", "title": "spent 10 CNY", "text": "x" * 5000,
           "time": "2025-01-01T00:00:00Z", "details": {"amount": "10 CNY"}}
    url = "https://example.invalid/hook"

    def body(fmt, **extra):
        u, data = prog.webhook_request(dict({"url": url, "format": fmt}, **extra), msg, now=1700000000.5)
        return u, json.loads(data)

    assert body("slack")[1].keys() == {"text"}
    assert len(body("discord")[1]["content"]) == 2000
    assert body("feishu")[1]["msg_type"] == "text" and "content" in body("lark")[1]
    assert body("dingtalk")[1]["msgtype"] == "text" and body("dingtalk")[1]["text"]["content"]
    assert len(body("wecom")[1]["text"]["content"].encode()) <= 2048
    u, b = body("telegram", chat_id="42")
    assert u == url + "/sendMessage" and b["chat_id"] == "42" and len(b["text"]) == 4096
    assert body("json")[1]["details"] == {"amount": "10 CNY"} and body("json")[1]["machine"] == "gpu1"
    # Feishu signing: base64(HMAC-SHA256(key="timestamp\nsecret", msg=""))
    _, b = body("feishu", secret="SECabc")
    key = "1700000000\nSECabc".encode()
    assert b["timestamp"] == "1700000000"
    assert b["sign"] == base64.b64encode(hmac.new(key, b"", hashlib.sha256).digest()).decode()
    # DingTalk signing: timestamp in ms and sign in the URL
    u, _ = body("dingtalk", secret="SECabc")
    q = urllib.parse.parse_qs(urllib.parse.urlsplit(u).query)
    mac = hmac.new(b"SECabc", b"1700000000500\nSECabc", hashlib.sha256).digest()
    assert q["timestamp"] == ["1700000000500"] and q["sign"] == [base64.b64encode(mac).decode()]


def test_service_error_codes_in_a_200_reply_count_as_failures():
    prog = load_program()
    with pytest.raises(prog.Failed, match="code 19024"):
        prog._check_reply("feishu", 200, b'{"code": 19024, "msg": "Key Words Not Found"}')
    with pytest.raises(prog.Failed, match="errcode 310000"):
        prog._check_reply("dingtalk", 200, b'{"errcode": 310000, "errmsg": "sign not match"}')
    prog._check_reply("wecom", 200, b'{"errcode": 0, "errmsg": "ok"}')
    prog._check_reply("slack", 200, b"ok")


class BusyServer:
    """A local HTTP server that answers 429 (or ``status``) with ``Retry-After`` until the
    (test's) clock reaches ``free_at``, then 200; it records the clock at each POST."""

    def __init__(self, clock, free_at, status=429, header=None):
        self.arrivals = []
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                now = clock()
                outer.arrivals.append(now)
                if now < free_at:
                    self.send_response(status)
                    self.send_header("Retry-After", header(now) if header else str(round(free_at - now)))
                else:
                    self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = "http://127.0.0.1:%d/hook" % self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


class FakeTime:
    """A clock that only moves when slept on: the planned delays, without waiting them out."""

    def __init__(self):
        self.now = time.time()
        self.sleeps = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


MSG = {"event": "message", "machine": "gpu1", "title": "t", "text": "x", "time": "2026-01-01T00:00:00Z"}


@pytest.fixture
def fake_time():
    return FakeTime()


def test_a_429_with_retry_after_5_is_retried_once_after_5_seconds(fake_time):
    prog = load_program()
    server = BusyServer(fake_time, fake_time.now + 5)
    try:
        err = prog.deliver({"url": server.url, "format": "json"}, MSG, retries=5, backoff=2.0, timeout=5,
                           sleep=fake_time.sleep, clock=fake_time)
    finally:
        server.stop()
    assert err is None
    assert len(server.arrivals) == 2  # not a second 429 at +2.2 s: the first retry goes through
    assert fake_time.sleeps == [pytest.approx(5.0)]


def test_a_503_with_an_http_date_retry_after_waits_until_that_date(fake_time):
    from email.utils import formatdate
    prog = load_program()
    # The HTTP-date is read against the real clock, as a server's would be; whole seconds, so
    # the server answers 200 from one second before the date it named.
    date = int(time.time()) + 31
    server = BusyServer(fake_time, date - 1, status=503, header=lambda now: formatdate(date, usegmt=True))
    fake_time.now = time.time()
    try:
        err = prog.deliver({"url": server.url, "format": "json"}, MSG, retries=5, backoff=2.0, timeout=5,
                           sleep=fake_time.sleep, clock=fake_time)
    finally:
        server.stop()
    assert err is None and len(server.arrivals) == 2
    assert 29 <= fake_time.sleeps[0] <= 32


def test_retry_after_parses_seconds_and_http_dates():
    prog = load_program()
    assert prog.retry_after_seconds("120") == 120.0
    assert prog.retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412480 - 60) == 60.0
    assert prog.retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412480 + 60) == 0.0
    assert prog.retry_after_seconds("soon") is None and prog.retry_after_seconds(None) is None
    assert prog.retry_after_seconds("-5") is None


def test_a_retry_after_beyond_the_retry_budget_keeps_the_message_with_why_it_waits(fake_time, tmp_path):
    prog = load_program()
    server = BusyServer(fake_time, fake_time.now + 3600)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"channels": [{"url": server.url, "format": "json"}], "retries": 3,
                                  "backoff": 1.0, "timeout": 5}), encoding="utf-8")
    config.chmod(0o600)
    try:
        result = prog.send_event({"event": "message", "text": "hi"}, base=str(tmp_path), config_path=str(config),
                                 sleep=fake_time.sleep, clock=fake_time)
        # one try, then no sleep through an hour (the budget is 1+2+4 s) and no tries it would refuse
        assert len(server.arrivals) == 1 and fake_time.sleeps == []
        assert result["queued"] == 1 and "Retry-After" in result["failed"][0]
        item, = [json.loads(p.read_text(encoding="utf-8")) for p in (tmp_path / "outbox").glob("*.json")]
        assert item["not_before"] == pytest.approx(fake_time.now + 3600, abs=2)
        assert item["why"].startswith("HTTP 429 Too Many Requests; the server asked to wait 3600 s (Retry-After)")
        log = (tmp_path / "log").read_text(encoding="utf-8")
        assert "kept in" in log and "(the server's Retry-After)" in log
        # a flush before that time sends nothing; after it, the message goes
        assert prog.flush(str(tmp_path), json.loads(config.read_text(encoding="utf-8")), [], 5, fake_time.sleep, fake_time) == (0, 1)
        assert len(server.arrivals) == 1
        fake_time.now += 3601
        assert prog.flush(str(tmp_path), json.loads(config.read_text(encoding="utf-8")), [], 5, fake_time.sleep, fake_time) == (1, 0)
        assert len(server.arrivals) == 2 and not list((tmp_path / "outbox").glob("*.json"))
    finally:
        server.stop()


def test_threshold_schedule_is_when_spending_reaches_each_threshold():
    p = budget.Prices(rate=12, billing="hour", currency="CNY")
    start, now = 1000.0, 1000.0 + 3590
    items = notify.threshold_items("gpu1", p, start, now, [10, 20, 30])
    # 10 is already spent (the first hour is billed in full); 20 when the second hour starts
    assert [(i["threshold"], i["amount"], i["in_s"]) for i in items] == [
        ("20.00 CNY", "24.00 CNY", 11.0), ("30.00 CNY", "36.00 CNY", 3611.0)]
    assert items[0]["once"] == "threshold:gpu1:1000:20"


# -- on the test machine ----------------------------------------------------------------------


def test_threshold_mail_arrives_once_with_machine_amount_and_threshold(ip, smtp, data_dir, notify_dir, sshd):
    ip.run_line_magic("gpu", "connect testgpu")
    m = ip._gpumagic.fleet.get()
    try:
        # billed by the hour at 12/h, started 3596 s ago: 12 spent; the next hour (24) passes 20
        budget.set_prices(budget.Ledger(), "testgpu", budget.Prices(rate=12, billing="hour", currency="CNY"),
                          alerts=[10, 20, 1000], started_at=time.time() - 3596)
        with capture_output() as cap:
            ip.run_line_magic("gpu", f"budget notify --mail me@example.com --smtp 127.0.0.1:{smtp.port} --no-test")
        assert "alerts go to mail to me@example.com via 127.0.0.1" in cap.stdout
        assert re.search(r"spending alerts armed on testgpu: 20.00 CNY in \d(\.\d)? s, 1,000.00 CNY in 3 d 10 h", cap.stdout)
        assert wait_until(lambda: smtp.messages, 30), "no mail arrived"
        time.sleep(2)
        assert len(smtp.messages) == 1
        env = smtp.messages[0]
        text = env.content.decode()
        assert env.rcpt_tos == ["me@example.com"]
        assert "Subject: [gpumagic] testgpu: spent 24.00 CNY" in text
        assert "testgpu has spent 24.00 CNY, past your alert at 20.00 CNY." in text
        # once: arming again does not resend it, nor does the same once-key by hand
        with capture_output():
            ip.run_line_magic("gpu", f"budget notify --mail me@example.com --smtp 127.0.0.1:{smtp.port} --no-test")
        key = notify.threshold_items("testgpu", budget.Prices(rate=12, billing="hour"), 0, 0, [20])[0]["once"]
        start = budget.Ledger().machine("testgpu").started_at
        r = notify.send_from_machine(m, {"event": "threshold", "amount": "24", "threshold": "20",
                                         "once": key.replace(":0:", f":{start:.0f}:")})
        assert r.skipped.startswith("already sent")
        time.sleep(1)
        assert len(smtp.messages) == 1
        assert "sent threshold by mail to me@example.com" in (notify_dir / "log").read_text(encoding="utf-8")
    finally:
        notify.disable(m)


def test_budget_set_re_arms_the_spending_alerts_where_notifications_are_set_up(ip, hook, data_dir, sshd):
    ip.run_line_magic("gpu", "connect testgpu")
    m = ip._gpumagic.fleet.get()
    try:
        notify.configure(m, [notify.webhook_channel(f"http://127.0.0.1:{hook.port}/h", "json")])  # arms nothing
        # 1 CNY a second from 2 s ago: 2 spent; the alert at 5 falls about 3 s from now
        with capture_output():
            ip.run_line_magic("gpu", "budget set --rate 3600 --currency CNY --started-at -2s --alert 5")
        assert wait_until(lambda: hook.posts, 30), "the threshold was not sent"
        body = hook.posts[0][1]
        assert body["event"] == "threshold" and "past your alert at 5.00 CNY" in body["text"]
    finally:
        notify.disable(m)


def _start_failing_job(m, name):
    job = m.start_job(name, "for i in $(seq 1 30); do echo step $i; done; echo 'RuntimeError: boom' >&2; exit 3")
    info = job.wait(timeout=60)
    assert info.exit_code == 3
    return job


def test_webhook_gets_the_job_failed_message_with_its_last_lines(clean_notify, hook, sshd):
    m = clean_notify
    notify.configure(m, [notify.webhook_channel(f"http://127.0.0.1:{hook.port}/hook/T0KEN", "json")])
    _start_failing_job(m, "notify-fail")
    # what the job runner runs when a job ends (in the background: it never blocks the runner)
    line = notify.notify_command("job-end", job="notify-fail", job_dir="$HOME/.gpumagic/jobs/notify-fail",
                                 log="$HOME/.gpumagic/jobs/notify-fail/notify.log")
    r = m.exec(line, timeout=30)
    assert r.exit_code == 0 and r.seconds < 5
    assert wait_until(lambda: hook.posts, 30), "nothing was posted"
    path, body = hook.posts[0]
    assert path == "/hook/T0KEN"
    assert body["event"] == "job-end" and body["machine"] == "testgpu"
    assert body["title"] == "job notify-fail failed"
    assert "exit code 3" in body["text"]
    assert body["details"]["last_lines"][-2:] == ["step 30", "RuntimeError: boom"]
    assert len(body["details"]["last_lines"]) == 20 and "step 12" in body["text"]
    log = sshd.dir / "home" / ".gpumagic" / "jobs" / "notify-fail" / "notify.log"
    assert wait_until(lambda: log.exists() and "sent job-end by json webhook" in log.read_text(encoding="utf-8"), 10)


def test_a_down_server_loses_nothing_and_stops_nothing(clean_notify, notify_dir, sshd):
    m = clean_notify
    port = free_port()  # nothing listens here yet
    notify.configure(m, [notify.webhook_channel(f"http://127.0.0.1:{port}/hook/SECRET-PATH", "slack")],
                     retries=2, backoff=0.2, timeout=5)
    guard_log = sshd.dir / "home" / "guard-test.log"
    line = notify.notify_command("shutdown", text="shutting down in 600s (GPU idle)", log=str(guard_log))
    # a guard-like loop calls it three times; the loop itself is never held up
    r = m.exec(f"for i in 1 2 3; do {line}; echo tick $i; done; echo loop-done", timeout=30)
    assert r.stdout.split() == ["tick", "1", "tick", "2", "tick", "3", "loop-done"] and r.seconds < 5
    outbox = notify_dir / "outbox"
    assert wait_until(lambda: outbox.exists() and len(list(outbox.glob("*.json"))) == 3, 60)
    text = guard_log.read_text(encoding="utf-8")
    assert text.count("notify: shutdown by slack webhook (127.0.0.1) FAILED") == 3
    assert "(3 attempts); kept in" in text and "SECRET-PATH" not in text
    # a direct send fails too, and says so, without raising
    res = notify.send_from_machine(m, "message", retries=0)
    assert res.failed and res.queued == 1 and not res.sent
    server = HookServer(port=port, reply={})
    try:
        res = notify.send_from_machine(m, {"event": "message", "text": "back"})
        assert res.sent == ["slack webhook (127.0.0.1)"]
        texts = [b["text"] for _, b in server.posts]
        assert len(texts) == 5  # the 4 kept in the outbox first, then the new one
        assert sum("shutting down in 600s (GPU idle)" in t for t in texts) == 3
        assert texts[-1].endswith("testgpu: back")
        assert not list(outbox.glob("*.json"))
    finally:
        server.stop()


def _cmdlines() -> str:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                out.append((p / "cmdline").read_bytes().decode("utf-8", "replace"))
            except OSError:
                pass
    return "\n".join(out)


def test_credentials_are_in_a_0600_file_and_never_in_a_command_line(clean_notify, notify_dir, smtp):
    m = clean_notify
    secrets = ("pAss-W0rd-6f1c", "T0KEN-a8e2c1")
    seen = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            text = _cmdlines()
            seen.extend(s for s in secrets if s in text)
            time.sleep(0.01)

    slow = HookServer(delay=2.0)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        notify.configure(m, [notify.mail_channel("me@example.com", f"127.0.0.1:{smtp.port}", user="me",
                                                 password=secrets[0], tls="none"),
                             notify.webhook_channel(f"http://127.0.0.1:{slow.port}/{secrets[1]}", "discord")],
                         retries=0)
        r = notify.send_from_machine(m, "test")  # 2 s inside the send: the watcher looks meanwhile
        assert r.sent == ["mail to me@example.com via 127.0.0.1:%d" % smtp.port, "discord webhook (127.0.0.1)"]
        assert smtp.logins == [("me", secrets[0])]
    finally:
        stop.set()
        t.join()
        slow.stop()
    assert seen == []
    cfg = notify_dir / "config.json"
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o600
    assert stat.S_IMODE(notify_dir.stat().st_mode) == 0o700
    assert secrets[0] in cfg.read_text(encoding="utf-8")
    assert all(s not in (notify_dir / "log").read_text(encoding="utf-8") for s in secrets)
    # a settings file others can read is refused, as OpenSSH refuses such a key
    os.chmod(cfg, 0o644)
    r = notify.send_from_machine(m, "test")
    assert not r.sent and "readable by others" in r.skipped and "chmod 600" in r.skipped


def test_notify_magic_shows_settings_without_secrets_and_off_deletes_them(ip, hook, data_dir, notify_dir,
                                                                          monkeypatch):
    ip.run_line_magic("gpu", "connect testgpu")
    monkeypatch.setattr("getpass.getpass", lambda prompt="": f"http://127.0.0.1:{hook.port}/hook/S3CRET")
    with capture_output() as cap:
        ip.run_line_magic("gpu", "budget notify --webhook ask --format slack")
    assert "alerts go to slack webhook to 127.0.0.1" in cap.stdout
    assert "no spending alert armed: no prices are set for testgpu" in cap.stdout
    assert "test message sent: slack webhook (127.0.0.1)" in cap.stdout
    assert hook.posts[-1][1]["text"].startswith("[gpumagic] test message\n")
    with capture_output() as cap:
        ip.run_line_magic("gpu", "budget notify")
    assert "S3CRET" not in cap.stdout and "sent test by slack webhook (127.0.0.1)" in cap.stdout
    with capture_output() as cap:
        ip.run_line_magic("gpu", "budget notify --off")
    assert "notifications off" in cap.stdout
    assert not (notify_dir / "config.json").exists()
    with capture_output() as cap:
        ip.run_line_magic("gpu", "budget notify")
    assert "no alerts set up" in cap.stdout
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="--smtp"):
        ip.run_line_magic("gpu", "budget notify --mail me@example.com")
    with pytest.raises(UsageError, match="not a mail address"):
        ip.run_line_magic("gpu", "budget notify --mail nobody --smtp x:25")
    with pytest.raises(UsageError, match="chat-id"):
        ip.run_line_magic("gpu", "budget notify --webhook https://api.telegram.org/botX --format telegram")
    r = notify.send_from_machine(ip._gpumagic.fleet.get(), "test")  # the program stays, settings gone
    assert r.skipped == "notifications are not set up on this machine (`%gpu budget notify`)" and not r.sent


def test_notify_command_is_one_guarded_background_line():
    line = notify.notify_command("job-end", job="train", job_dir="$HOME/.gpumagic/jobs/train", log="/tmp/x y")
    send = ('python3 "$HOME/.gpumagic/notify/notify.py" --event job-end --job train '
            '--job-dir "$HOME/.gpumagic/jobs/train" --log \'/tmp/x y\'')
    assert line == ('[ -f "$HOME/.gpumagic/notify/config.json" ] && ( ( trap \'\' HUP; if command -v setsid >/dev/null 2>&1; '
                    f'then exec setsid nohup {send}; fi; exec nohup {send} ) </dev/null >/dev/null 2>&1 & )')


def test_a_password_is_never_sent_without_tls(clean_notify, smtp):
    m = clean_notify
    notify.configure(m, [notify.mail_channel("me@example.com", f"127.0.0.1:{smtp.port}", user="me",
                                             password="never-in-clear")], retries=0)
    r = notify.send_from_machine(m, "test", keep=False)
    assert r.sent == [] and smtp.logins == [] and smtp.messages == []
    assert r.failed == [f"mail to me@example.com via 127.0.0.1:{smtp.port}: 127.0.0.1:{smtp.port} offers no TLS; "
                        "the password is not sent in clear (use port 465, or a server with STARTTLS) (1 attempt)"]


# -- the call sites: the job runner's, tried here by patching its script; the guard's is wired --

#: What the job runner (programs/job-run.sh) starts, detached, after exit_code is written.
JOB_END = 'gm_job_end_notify "$jd" "$GPUMAGIC_JOB" "$rc"'


def test_job_runner_call_site_sends_failure_and_nan_stop(clean_notify, hook, monkeypatch, sshd):
    from gpumagic.remote import jobs

    m = clean_notify
    assert JOB_END in jobs.job_file("run.sh")  # the runner sends it itself
    notify.configure(m, [notify.webhook_channel(f"http://127.0.0.1:{hook.port}/h", "json")])
    _start_failing_job(m, "notify-site-fail")
    stopped = m.start_job("notify-site-nan", "echo step 1; echo 'step 2 loss nan'; sleep 60", stop_on="nan")
    assert stopped.wait(timeout=60).killed == "nan"
    home = sshd.dir / "home" / ".gpumagic"
    if not wait_until(lambda: len(hook.posts) == 2, 120):  # what the machine said, if not
        ps = subprocess.run(["ps", "-eww", "-o", "pid,pgid,sid,stat,etime,args"], capture_output=True, text=True, encoding="utf-8").stdout
        detail = [p.read_text(encoding="utf-8")[-1500:] if p.exists() else f"no {p}"
                  for p in (home / "notify" / "log", home / "jobs" / "notify-site-fail" / "log")]
        jobdirs = {d.name: sorted(x.name for x in d.iterdir()) for d in (home / "jobs").glob("notify-site-*")}
        print("POSTS", hook.posts, "\nNOTIFYLOG\n", detail[0], "\nJOBLOG\n", detail[1], "\nDIRS", jobdirs,
              "\nPS\n", "\n".join(ln for ln in ps.splitlines() if "notify" in ln or "gpumagic" in ln))
        raise AssertionError(f"{len(hook.posts)} posts")
    by_job = {b["details"]["job"]: b for _, b in hook.posts}
    failed, nan = by_job["notify-site-fail"], by_job["notify-site-nan"]
    assert failed["title"] == "job notify-site-fail failed" and "exit code 3" in failed["text"]
    assert failed["details"]["last_lines"][-1] == "RuntimeError: boom"
    assert nan["title"] == "job notify-site-nan stopped (nan)"
    assert "stopped by --stop-on nan at: step 2 loss nan" in nan["text"]
    log = sshd.dir / "home" / ".gpumagic" / "jobs" / "notify-site-fail" / "log"
    assert wait_until(lambda: "notify: sent job-end by json webhook (127.0.0.1)" in log.read_text(encoding="utf-8"), 10)
    # that line is gpumagic's, not the job's: the job table's last line stays the job's own
    assert m.job("notify-site-fail").info().last_line == "RuntimeError: boom"


def test_a_runner_killed_before_it_could_tell_is_told_once_by_kill_sh(clean_notify, hook):
    # The command ignores SIGTERM, so after kill_grace kill.sh SIGKILLs the whole tree, the
    # runner with it, before the runner reaches its message: kill.sh sends it (before, nothing
    # was sent; the same happened to a nan stop on a loaded machine in a full test run).
    m = clean_notify
    notify.configure(m, [notify.webhook_channel(f"http://127.0.0.1:{hook.port}/h", "json")])
    job = m.start_job("notify-stubborn", "trap '' TERM; echo up; sleep 60")
    assert wait_until(lambda: job.logs(5).strip().endswith("up"), 30)
    info = job.kill()
    assert info.exit_code == 137 and info.killed == "user"
    assert wait_until(lambda: len(hook.posts) >= 1, 60), hook.posts
    time.sleep(3)  # and only once
    assert len(hook.posts) == 1
    body = hook.posts[0][1]
    assert body["details"]["job"] == "notify-stubborn" and body["details"]["exit_code"] == 137
    assert body["title"] == "job notify-stubborn was killed"


def test_guard_call_site_warns_once_before_the_shutdown(hook, monkeypatch, tmp_path):
    import gpumagic

    monkeypatch.setenv("GPUMAGIC_DATA_DIR", str(tmp_path / "data"))
    m = gpumagic.connect(sandbox=True)
    try:
        notify.configure(m, [notify.webhook_channel(f"http://127.0.0.1:{hook.port}/h", "json")])
        budget.arm_guard(m, budget.GuardSettings(deadline_in=4, grace_s=3, poll_s=1))
        assert wait_until(lambda: hook.posts, 30)
        time.sleep(4)  # the shutdown (the sandbox's stand-in) has run by now; no second warning
        assert len(hook.posts) == 1
        body = hook.posts[0][1]
        assert body["event"] == "shutdown" and body["machine"] == "sandbox"
        assert re.search(r"the guard will shut it down: shutting down in \d+s \(deadline reached\)", body["text"])
        log = Path(guard_log_path(m)).read_text(encoding="utf-8")
        assert "notify: sent shutdown by json webhook" in log and "shutdown command succeeded" in log
    finally:
        m.close()


def test_guard_call_site_says_when_the_shutdown_failed(hook, monkeypatch, tmp_path):
    import gpumagic
    from gpumagic.budget.shutdown import ShutdownPlan

    monkeypatch.setenv("GPUMAGIC_DATA_DIR", str(tmp_path / "data"))
    m = gpumagic.connect(sandbox=True)
    try:
        notify.configure(m, [notify.webhook_channel(f"http://127.0.0.1:{hook.port}/h", "json")])
        budget.arm_guard(m, budget.GuardSettings(deadline_in=2, grace_s=1, poll_s=1), plan=ShutdownPlan("exit 3"))
        assert wait_until(lambda: len(hook.posts) == 2, 30), hook.posts
        time.sleep(2)
        events = {b["event"]: b for _, b in hook.posts}
        assert len(hook.posts) == 2 and set(events) == {"shutdown", "guard"}
        assert events["guard"]["text"] == ("sandbox: the guard could not shut down (exit code 3): "
                                           "stop the instance yourself")
        assert m.budget.guard_status().state == "failed"
        assert "notify: sent guard by json webhook" in Path(guard_log_path(m)).read_text(encoding="utf-8")
    finally:
        m.close()
