#!/usr/bin/env python3
"""gpumagic-keep-list: the files of a job's checkpoint folder, for ``--keep`` (one JSON object).

Run by gpumagic with ``WORK KEEP JOB`` (standard library only, Python 3.6 or newer): ``WORK``
is the job's working directory ("" for the login directory; ``~/...`` and relative paths
start at ``$HOME``), ``KEEP`` the folder to keep (relative to ``WORK``), ``JOB`` the job's
name.  It prints ``{"now": NS, "root": ABS, "ended": BOOL, "missing": BOOL,
"files": [[REL, SIZE, MTIME_NS, INODE], ...]}``: ``now`` the machine's clock (nanoseconds),
``ended`` whether the job wrote its ``exit_code``, ``files`` the regular files under the
folder (``REL`` with ``/``).  Names of temporary files (a leading ``.``, ``tmp-``, ``tmp_``
or ``tmp.``, as Hugging Face's ``tmp-checkpoint-500/``; a ``.tmp``, ``.part``, ``.partial``,
``.incomplete`` or ``~`` ending), and everything in folders so named, are left out: they are checkpoints being written before a rename.
"""

import json
import os
import stat
import sys
import time

TEMP_ENDINGS = (".tmp", ".part", ".partial", ".incomplete", "~")
TEMP_STARTS = (".", "tmp-", "tmp_", "tmp.")


def temporary(name):
    return name.startswith(TEMP_STARTS) or name.endswith(TEMP_ENDINGS)


def absolute(path, base, home):
    if path == "~" or path.startswith("~/"):
        path = home + path[1:]
    return os.path.normpath(os.path.join(base, path))


def main():
    work, keep, job = sys.argv[1:4]
    home = os.path.expanduser("~")
    base = absolute(work, home, home) if work else home
    root = absolute(keep, base, home)
    now = time.time_ns() if hasattr(time, "time_ns") else int(time.time() * 1e9)  # 3.6: no time_ns
    out = {"now": now, "root": root, "missing": not os.path.isdir(root),
           "ended": os.path.exists(os.path.join(home, ".gpumagic", "jobs", job, "exit_code")),
           "files": []}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not temporary(d)]
        for name in files:
            if temporary(name):
                continue
            path = os.path.join(folder, name)
            try:
                st = os.lstat(path)
            except OSError:  # gone since the folder was read
                continue
            if stat.S_ISREG(st.st_mode):
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                out["files"].append([rel, st.st_size, st.st_mtime_ns, st.st_ino])
    sys.stdout.write(json.dumps(out) + "\n")


main()
