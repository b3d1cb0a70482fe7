# rent-stop.py: the budget guard's stop on a rented machine (gpumagic/rent/billstop.py).  From
# this machine it asks the platform's API to stop (or release) this instance, exactly once,
# then reads the instance's state until it says the bill stopped.  It works with the laptop
# closed: the guard (budget-guard.sh) or a job's --then-shutdown runs it as its stop command.
#
#   rent-stop.py install DIR   stdin: JSON {"program": TEXT, "config": {...}, "key": KEY or null}:
#                              write DIR/rent-stop.py, DIR/stop.json and (only with a key: the
#                              user agreed to place theirs) DIR/key, each 0600 in a 0700 DIR;
#                              clear DIR/claimed (a new guard may stop again); then as check
#   rent-stop.py check DIR     one line: "ok PYTHON PROGRAM SOURCE" (SOURCE: where the key was
#                              found), "nokey VARIABLE", or "wrongid VARIABLE=VALUE" (this machine
#                              is another instance than the one named)
#   rent-stop.py forget DIR    remove DIR/key (the user's key, placed with consent)
#   rent-stop.py stop DIR      claim DIR/claimed (O_CREAT|O_EXCL: a second guard finds it and
#                              exits 0 without a request), send the request, read the state
#
# DIR is absolute or relative to $HOME.  stop.json: provider, name, instance_id, base_url,
# method, path, body (the one request), status_path, field (keys to the state), done (states
# that mean stopped; after a release a 404 also does), action, spacing_s (least seconds between
# requests), key_env and id_env (the variables the platform injects: the instance-scoped key
# and the instance's id), env_files (where its images export them for SSH sessions), key_file
# (true: the key is DIR/key), reads and every_s (confirmation reads and seconds between them).
#
# The key is looked for, in order: DIR/key (key_file), this process's environment, each of
# env_files (NAME=VALUE or export NAME="VALUE" lines), PID 1's /proc/1/environ (the container's
# own environment).  It is sent only in the Authorization header, never printed.
#
# Exactly once: the request is sent again only after a 429 (Retry-After: the platform did not
# act) or when no answer came and the state read after it is not done.  Exit status 0: the
# bill stopped (or another guard claimed the stop); 2: the request was refused; 3: sent but not
# confirmed.
import json
import os
import sys
import time
import urllib.error
import urllib.request


def home_path(d):
    return d if d.startswith("/") else os.path.join(os.environ.get("HOME") or "/", d)


def env_file(path):
    """NAME=VALUE pairs of a file of such lines (``export`` and quotes allowed), or of
    /proc/1/environ (NUL-separated)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return {}
    out = {}
    for raw in data.replace(b"\0", b"\n").decode("utf-8", "replace").splitlines():
        line = raw.strip()
        if line.startswith("export "):
            line = line[len("export "):].strip()
        name, eq, value = line.partition("=")
        if not eq or not name or " " in name:
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        out[name] = value
    return out


def find(name, cfg):
    """(value, where) of the variable ``name``, or (None, None)."""
    if not name:
        return None, None
    if os.environ.get(name):
        return os.environ[name], "environment"
    for path in list(cfg.get("env_files") or []) + ["/proc/1/environ"]:
        value = env_file(home_path(path)).get(name)
        if value:
            return value, path
    return None, None


def key_of(d, cfg):
    if cfg.get("key_file"):
        try:
            with open(os.path.join(d, "key"), encoding="utf-8") as f:
                return f.read().strip() or None, "your key (%s)" % os.path.join(d, "key")
        except OSError:
            return None, None
    return find(cfg.get("key_env"), cfg)


def check(d):
    with open(os.path.join(d, "stop.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    own, _ = find(cfg.get("id_env"), cfg)
    if own and own != str(cfg["instance_id"]):
        print("wrongid %s=%s" % (cfg["id_env"], own))
        return 1
    key, where = key_of(d, cfg)
    if not key:
        print("nokey %s" % ("key" if cfg.get("key_file") else cfg.get("key_env") or "key"))
        return 1
    print("ok %s %s %s" % (sys.executable, os.path.join(d, "rent-stop.py"), where.replace(" ", "_")))
    return 0


def write_private(path, text):
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def install(d):
    payload = json.loads(sys.stdin.read())
    os.makedirs(d, mode=0o700, exist_ok=True)
    os.chmod(d, 0o700)
    write_private(os.path.join(d, "rent-stop.py"), payload["program"])
    write_private(os.path.join(d, "stop.json"), json.dumps(payload["config"], indent=1))
    if payload.get("key"):
        write_private(os.path.join(d, "key"), payload["key"] + "\n")
    else:
        forget(d)
    try:
        os.unlink(os.path.join(d, "claimed"))
    except FileNotFoundError:
        pass
    return check(d)


def forget(d):
    try:
        os.unlink(os.path.join(d, "key"))
    except FileNotFoundError:
        pass
    return 0


class Api(object):
    def __init__(self, cfg, key):
        self.base = cfg["base_url"].rstrip("/")
        self.key = key
        self.spacing = float(cfg.get("spacing_s") or 0)
        self.last = None

    def call(self, method, path, body=None):
        """(status, decoded body); status None when no answer came (the error text instead)."""
        for _ in range(4):
            if self.last is not None and self.spacing:
                time.sleep(max(0.0, self.last + self.spacing - time.monotonic()))
            self.last = time.monotonic()
            data = json.dumps(body).encode() if body is not None else None
            req = urllib.request.Request(self.base + path, data=data, method=method)
            req.add_header("Authorization", "Bearer " + self.key)
            req.add_header("Accept", "application/json")
            if data is not None:
                req.add_header("Content-Type", "application/json")
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return r.status, decode(r.read())
            except urllib.error.HTTPError as e:
                if e.code == 429:  # not acted on: wait as told, then the same request again
                    try:
                        wait = float(e.headers.get("Retry-After") or 5)
                    except ValueError:
                        wait = 5.0
                    time.sleep(min(max(wait, 0.0), 60.0))
                    continue
                return e.code, decode(e.read())
            except (urllib.error.URLError, OSError) as e:
                return None, str(getattr(e, "reason", e)).replace(self.key, "***")
        return 429, "still rate-limited"


def decode(raw):
    try:
        return json.loads(raw.decode("utf-8")) if raw else None
    except ValueError:
        return raw.decode("utf-8", "replace")[:200]


def state_of(cfg, api):
    """(done, text) from one read of the instance."""
    status, body = api.call("GET", cfg["status_path"])
    if status is None:
        return False, "no answer (%s)" % body
    if status >= 400:
        gone = cfg.get("action") == "release" and status in (400, 404)
        return gone, "gone (%d)" % status if gone else "read refused (%d)" % status
    value = body
    for k in cfg["field"]:
        value = value.get(k) if isinstance(value, dict) else None
    return value in cfg["done"], "%s=%s" % (cfg["field"][-1], value)


def say(text):
    print("%s bill-stop: %s" % (time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), text))
    sys.stdout.flush()


def stop(d):
    with open(os.path.join(d, "stop.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    what = "%s instance %s (%s)" % (cfg["provider"], cfg["instance_id"], cfg.get("name", ""))
    try:
        os.close(os.open(os.path.join(d, "claimed"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        say("%s: another guard has already asked for its %s; not asked again" % (what, cfg["action"]))
        return 0
    key, where = key_of(d, cfg)
    if not key:
        say("%s: no API key found (%s); stop it yourself" % (what, cfg.get("key_env") or "key"))
        return 2
    api = Api(cfg, key)
    for attempt in range(3):
        status, body = api.call(cfg["method"], cfg["path"], cfg.get("body"))
        say("%s: %s %s with %s -> %s" % (what, cfg["method"], cfg["path"], where,
                                          status if status is not None else "no answer: %s" % body))
        if status is not None and status >= 400:
            say("%s: the %s was refused: %s" % (what, cfg["action"], str(body).replace(key, "***")[:300]))
            return 2
        if status is not None:
            break
        done, text = state_of(cfg, api)  # no answer: did it act?
        if done:
            break
        time.sleep(5)
    else:
        return 3
    reads = int(cfg.get("reads") or 5)
    for n in range(1, reads + 1):
        done, text = state_of(cfg, api)
        if done:
            say("%s: confirmed through the API: %s (read %d)" % (what, text, n))
            with open(os.path.join(d, "result"), "w", encoding="utf-8") as f:
                f.write("%s %s\n" % (cfg["action"], text))
            return 0
        if n < reads:
            time.sleep(float(cfg.get("every_s") or 2))
    say("%s: asked, but the API still reads %s after %d reads" % (what, text, reads))
    return 3


def main():
    what, d = sys.argv[1], home_path(sys.argv[2])
    return {"install": install, "check": check, "forget": forget, "stop": stop}[what](d)


if __name__ == "__main__":
    sys.exit(main())
