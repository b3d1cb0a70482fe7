#!/usr/bin/env python3
"""gpumagic tunnel-service: find or start TensorBoard or Jupyter on the machine for a tunnel.

Run by gpumagic (``gpumagic/tunnel/services.py``) under the machine's ``python3``, in the
cell directory, as::

    tunnel-service.py tensorboard TIMEOUT LOGDIR
    tunnel-service.py jupyter TIMEOUT

``TIMEOUT`` is the seconds to wait for a new server to serve.  It prints one JSON line:

* a server found or started: ``{"port", "pid", "started", "log", "ours", ...}`` (TensorBoard
  adds ``logdir`` and ``path_prefix``; Jupyter adds ``token`` and ``base_url``);
* ``{"missing": PYTHON}``: the package is not installed for this interpreter;
* ``{"failed": LAST_LOG_LINES, "log": PATH}``: it was started but did not serve in time.

TensorBoard: reuse the one serving LOGDIR (found through TensorBoard's own info files,
``tensorboard.manager.get_all()``, as its notebook magic does), else start one bound to
127.0.0.1; TensorBoard itself picks 6006 or the next free port when ``--port`` is not given.

Jupyter: reuse a running Jupyter server (its runtime files,
``jupyter_server.serverapp.list_running_servers()``), else start JupyterLab (or Notebook 7,
or a bare Jupyter Server) bound to 127.0.0.1 on 8888 or the next free port
(``port_retries``), without a browser.

A new server starts detached in its own session with output to ``~/.gpumagic/NAME-MS.log``
(0600, in a 0700 directory).  Every service gpumagic starts is recorded at once in
``~/.gpumagic/services/PID.json`` (its name, log, and its start time in clock ticks after
boot from ``/proc/PID/stat`` field 22, proc(5), so a later process given the same pid is not
taken for it).  A service found running later is reported ``ours`` when its record matches,
whichever kernel started it; records of processes that are gone are removed.
"""

import importlib.util
import json
import os
import subprocess
import sys
import time

SERVICES = os.path.expanduser("~/.gpumagic/services")


def started_ticks(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def record(name, pid, log):
    os.makedirs(SERVICES, 0o700, exist_ok=True)
    path = os.path.join(SERVICES, "%d.json" % pid)
    with open(os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump({"name": name, "pid": pid, "log": log, "ticks": started_ticks(pid)}, f)
    os.replace(path + ".tmp", path)


def recorded(pid):
    """The record of a service gpumagic started with this pid, or None; stale ones removed."""
    try:
        names = os.listdir(SERVICES)
    except OSError:
        return None
    found = None
    for n in names:
        path = os.path.join(SERVICES, n)
        try:
            with open(path) as f:
                rec = json.load(f)
            stale = not alive(int(rec["pid"])) or rec.get("ticks") not in (None, started_ticks(int(rec["pid"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if stale:
            try:
                os.remove(path)
            except OSError:
                pass
        elif int(rec["pid"]) == pid:
            found = rec
    return found


def start_and_report(name, argv, running, pid_of, report, timeout):
    """Start ``argv`` detached, wait until ``running()`` lists its pid (``pid_of(info)``),
    then ``report`` it; else print the log's last lines as "failed"."""
    state = os.path.expanduser("~/.gpumagic")
    os.makedirs(state, 0o700, exist_ok=True)
    os.chmod(state, 0o700)  # private: Jupyter's log holds its token
    log = os.path.join(state, "%s-%d.log" % (name, int(time.time() * 1000)))
    with open(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as out:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                             start_new_session=True, close_fds=True)
    record(name, p.pid, log)
    deadline = time.time() + timeout
    while time.time() < deadline:
        for info in running():
            if pid_of(info) == p.pid:
                report(info, True, log)
                sys.exit(0)
        if p.poll() is not None:
            break
        time.sleep(0.2)
    with open(log, "rb") as f:
        tail = f.read().decode("utf-8", "replace").strip().splitlines()[-3:]
    if p.poll() is None:
        p.kill()
    print(json.dumps({"failed": " | ".join(tail) or "no output", "log": log}))


def report_found(report, info, pid):
    rec = recorded(pid)
    report(info, False, rec.get("log") if rec else None, rec is not None)


def tensorboard(timeout, logdir):
    logdir = os.path.abspath(os.path.expanduser(logdir))
    try:
        from tensorboard import manager
    except ImportError:
        print(json.dumps({"missing": sys.executable}))
        sys.exit(0)

    def serving():
        for info in manager.get_all():
            if os.path.abspath(info.logdir or "") == logdir:
                return info

    def report(info, started, log=None, ours=True):
        print(json.dumps({"port": info.port, "pid": info.pid, "logdir": logdir, "ours": ours,
                          "path_prefix": info.path_prefix, "started": started, "log": log}))

    info = serving()
    if info is not None:
        report_found(report, info, info.pid)
        sys.exit(0)
    os.makedirs(logdir, exist_ok=True)
    start_and_report("tensorboard", [sys.executable, "-m", "tensorboard.main", "--logdir", logdir,
                                     "--host", "127.0.0.1"], manager.get_all, lambda info: info.pid,
                     report, timeout)


def jupyter(timeout):
    try:
        from jupyter_server.serverapp import list_running_servers
    except ImportError:
        print(json.dumps({"missing": sys.executable}))
        sys.exit(0)

    def report(info, started, log=None, ours=True):
        print(json.dumps({"port": info["port"], "pid": info["pid"], "token": info.get("token", ""),
                          "base_url": info.get("base_url", "/"), "started": started, "log": log,
                          "ours": ours}))

    for info in list_running_servers():
        report_found(report, info, info["pid"])
        sys.exit(0)
    app = next((m for m in ("jupyterlab", "notebook") if importlib.util.find_spec(m)), "jupyter_server")
    start_and_report("jupyter", [sys.executable, "-m", app, "--no-browser", "--ServerApp.ip=127.0.0.1",
                                 "--ServerApp.port=8888", "--ServerApp.open_browser=False"]
                     # rented machines often log in as root; the server stays on 127.0.0.1
                     # behind its token
                     + (["--allow-root"] if hasattr(os, "getuid") and os.getuid() == 0 else []),
                     list_running_servers, lambda info: info["pid"], report, timeout)


if __name__ == "__main__":
    if sys.argv[1:2] == ["tensorboard"] and len(sys.argv) == 4:
        tensorboard(float(sys.argv[2]), sys.argv[3])
    elif sys.argv[1:2] == ["jupyter"] and len(sys.argv) == 3:
        jupyter(float(sys.argv[2]))
    else:
        sys.exit("usage: tunnel-service.py tensorboard TIMEOUT LOGDIR | jupyter TIMEOUT")
