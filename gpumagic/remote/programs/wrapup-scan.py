#!/usr/bin/env python3
"""gpumagic-wrapup: list (and, asked to, remove) the caches a machine image would carry.

Sent by gpumagic on each call (``python3 - scan REQUEST`` with this file on stdin; nothing is
installed) and run as the login user; standard library only, Python 3.6 or newer.  REQUEST
is a JSON object, base64-encoded (one word for any login shell): ``{"cwd": DIR, "system": true|false, "clean": [ids...]}``.  It prints one
JSON object: the caches found, the system disk, the Jupyter kernels running, and for
``clean`` what was removed.

The caches (each an item with an ``id``, a path, its apparent size -- the sum of the file
sizes, like ``du --apparent-size`` -- and whether ``clean`` may remove it):

* every top-level entry of ``~/.cache`` (``pip``, ``huggingface``, ``torch``, ...), each its
  own item;
* conda's package caches: ``pkgs/`` of the conda installations found (``$CONDA_EXE``'s,
  ``~/miniconda3``, ``~/anaconda3``, ``~/miniforge3``, ``~/mambaforge``, ``/opt/conda``);
  cleaned with ``conda clean --all --yes`` where that conda runs, otherwise by removing
  the folder's contents;
* the temporary folder (``$TMPDIR``, else ``/tmp``): entries owned by this user, except
  sockets and pipes, ``tmux-*``, ``ssh-*``, ``systemd-private-*``, the X11/ICE folders,
  and anything changed in the last :data:`RECENT` seconds (something may be using it);
* old VS Code server versions: all but the newest of ``~/.vscode-server/bin/*`` and of
  ``~/.vscode-server/cli/servers/Stable-*``;
* ``__pycache__`` folders under the home and working folders (one item for all), not those
  in gpumagic's own ``.gpumagic`` folders.

Items outside the home folder (conda under ``/opt``, the temporary folder) are only listed,
never removed, when ``system`` is false (the sandbox: the machine is your own computer).
``clean`` removes only items this very scan found and ids the request names: nothing
outside these caches is ever touched, and symbolic links are removed, never followed.
"""

import base64
import json
import os
import shutil
import stat
import subprocess
import sys
import time

RECENT = 600
TMP_KEEP_PREFIXES = ("tmux-", "ssh-", "systemd-private-", "snap-private-tmp", ".X", ".ICE-unix",
                     ".font-unix", ".Test-unix", "gpumagic")
WALK_SECONDS = 20.0


def size_of(path, deadline=None):
    """(bytes, files) under ``path`` without following links; stops at ``deadline``."""
    total = files = 0
    try:
        st = os.lstat(path)
    except OSError:
        return 0, 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size, 1
    for root, dirs, names in os.walk(path, onerror=lambda e: None):
        for n in names + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            try:
                total += os.lstat(os.path.join(root, n)).st_size
                files += 1
            except OSError:
                pass
        if deadline is not None and time.time() > deadline:
            break
    return total, files


def remove(path):
    """Remove a file, link or folder (links are never followed); returns an error or ""."""
    errors = []
    try:
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
        else:
            shutil.rmtree(path, onerror=lambda f, p, e: errors.append("%s: %s" % (p, e[1])))
    except OSError as e:
        errors.append("%s: %s" % (path, e.strerror))
    return "; ".join(errors[:3])


def conda_roots(home):
    roots = []
    exe = os.environ.get("CONDA_EXE")
    if exe:
        roots.append(os.path.dirname(os.path.dirname(exe)))
    for name in ("miniconda3", "anaconda3", "miniforge3", "mambaforge"):
        roots.append(os.path.join(home, name))
    roots.append("/opt/conda")
    seen, out = set(), []
    for r in roots:
        r = os.path.realpath(r)
        if r not in seen and os.path.isdir(os.path.join(r, "pkgs")):
            seen.add(r)
            out.append(r)
    return out


def tmp_entries(tmp, now):
    uid = os.getuid()
    out = []
    try:
        names = sorted(os.listdir(tmp))
    except OSError:
        return out
    for n in names:
        if n.startswith(TMP_KEEP_PREFIXES):
            continue
        p = os.path.join(tmp, n)
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if st.st_uid != uid or stat.S_ISSOCK(st.st_mode) or stat.S_ISFIFO(st.st_mode):
            continue
        if now - st.st_mtime < RECENT:
            continue
        out.append(p)
    return out


def pycache_dirs(roots, skip, deadline):
    found, partial = [], False
    for top in roots:
        for root, dirs, _ in os.walk(top, onerror=lambda e: None):
            if time.time() > deadline:
                partial = True
                break
            keep = []
            for d in dirs:
                p = os.path.join(root, d)
                # .gpumagic: gpumagic's own state in a home (its sync agent's bytecode)
                if os.path.islink(p) or p in skip or d in (".git", "node_modules", ".gpumagic"):
                    continue
                if d == "__pycache__":
                    found.append(p)
                else:
                    keep.append(d)
            dirs[:] = keep
    return sorted(set(found)), partial


def scan(req):
    home = os.path.expanduser("~")
    now = time.time()
    system = bool(req.get("system", True))
    deadline = now + WALK_SECONDS
    items = []

    def add(id_, label, paths, *, cleanable=True, note="", how="remove"):
        total = files = 0
        for p in paths:
            b, f = size_of(p, deadline + WALK_SECONDS)
            total += b
            files += f
        items.append({"id": id_, "label": label, "paths": paths, "bytes": total, "files": files,
                      "cleanable": cleanable, "note": note, "how": how})

    cache = os.path.join(home, ".cache")
    if os.path.isdir(cache) and not os.path.islink(cache):
        for n in sorted(os.listdir(cache)):
            add("cache:" + n, "~/.cache/" + n, [os.path.join(cache, n)])
    for root in conda_roots(home):
        pkgs = os.path.join(root, "pkgs")
        inside = (root + os.sep).startswith(home + os.sep)
        conda = os.path.join(root, "bin", "conda")
        add("conda:" + root, "conda packages " + pkgs.replace(home, "~", 1),
            [os.path.join(pkgs, n) for n in sorted(os.listdir(pkgs))],
            cleanable=inside or system, note="" if inside or system else "outside the home folder; left alone here",
            how="conda" if os.access(conda, os.X_OK) else "remove")
    tmp = os.environ.get("TMPDIR") or "/tmp"
    if system:
        add("tmp", "temporary files in %s (yours, unchanged for %d min)" % (tmp, RECENT // 60),
            tmp_entries(tmp, now))
    else:
        items.append({"id": "tmp", "label": "temporary files in %s" % tmp, "paths": [], "bytes": 0, "files": 0,
                      "cleanable": False, "note": "not looked at: this machine is your own computer",
                      "how": "remove"})
    vs = []
    for base in (os.path.join(home, ".vscode-server", "bin"),
                 os.path.join(home, ".vscode-server", "cli", "servers")):
        try:
            entries = [os.path.join(base, n) for n in os.listdir(base)]
        except OSError:
            continue
        entries = [p for p in entries if os.path.isdir(p) and not os.path.islink(p)]
        entries.sort(key=lambda p: os.lstat(p).st_mtime)
        vs += entries[:-1]
    if vs:
        add("vscode", "old VS Code server versions (%d)" % len(vs), vs)
    skip = {cache, os.path.join(home, ".vscode-server"), tmp}
    skip.update(conda_roots(home))
    roots = [home] + [r for r in [req.get("cwd")] if r and os.path.isdir(r)
                      and not (os.path.realpath(r) + os.sep).startswith(home + os.sep)]
    dirs, partial = pycache_dirs(roots, skip, deadline)
    add("pycache", "__pycache__ folders (%d)" % len(dirs), dirs,
        note="the search stopped after %d s: more may exist" % WALK_SECONDS if partial else "")
    return items


def disk():
    try:
        st = os.statvfs("/")
    except OSError:
        return None
    return {"mount": "/", "size": st.f_blocks * st.f_frsize, "used": (st.f_blocks - st.f_bfree) * st.f_frsize}


def kernels():
    out = []
    me = os.getuid()
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not pid.isdigit():
            continue
        try:
            if os.stat("/proc/" + pid).st_uid != me:
                continue
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        text = " ".join(a.decode("utf-8", "replace") for a in argv if a)
        if "ipykernel" in text or "jupyter-lab" in text or "jupyter-notebook" in text or "jupyter lab" in text:
            out.append({"pid": int(pid), "command": text[:160]})
    return out


def clean(items, ids):
    done = []
    for it in items:
        if it["id"] not in ids or not it["cleanable"]:
            continue
        errors = []
        if it["how"] == "conda":
            conda = os.path.join(it["id"][len("conda:"):], "bin", "conda")
            try:
                r = subprocess.run([conda, "clean", "--all", "--yes"], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, timeout=600)
                if r.returncode != 0:
                    errors.append("conda clean exited %d" % r.returncode)
            except (OSError, subprocess.SubprocessError) as e:
                errors.append("conda clean: %s" % e)
        else:
            for p in it["paths"]:
                e = remove(p)
                if e:
                    errors.append(e)
        left = sum(size_of(p)[0] for p in it["paths"] if os.path.lexists(p))
        done.append({"id": it["id"], "label": it["label"], "freed": max(0, it["bytes"] - left),
                     "errors": errors[:3]})
    return done


def main():
    req = json.loads(base64.b64decode(sys.argv[2]).decode("utf-8")) if len(sys.argv) > 2 else {}
    items = scan(req)
    # on the sandbox (system false) the machine is this computer: its kernels are not the machine's
    out = {"disk": disk(), "kernels": kernels() if req.get("system", True) else None,
           "home": os.path.expanduser("~")}
    if req.get("clean"):
        out["cleaned"] = clean(items, set(req["clean"]))
        items = scan(req)  # what is left
    # the listing names at most 20 paths per item (a home can hold thousands of __pycache__)
    out["items"] = [dict(it, paths=it["paths"][:20], more=max(0, len(it["paths"]) - 20)) for it in items]
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
