#!/usr/bin/env python3
"""gpumagic-keep-watch: tell gpumagic at once when a file is renamed into a job's checkpoint
folder (Linux inotify through ctypes; standard library only, Python 3.6 or newer).

Run with ``ROOT`` (an absolute folder, perhaps not made yet).  It prints one JSON object a
line: ``{"k": "watching"}`` once ROOT and its folders are watched; ``{"k": "moved", "rel":
REL, "size": N, "mtime_ns": NS, "ino": I}`` for each file renamed (or moved) into ROOT or a
folder below it, each file of a moved folder too (a file that appears by a rename appears
whole); ``{"k": "overflow"}`` when the kernel dropped events; ``{"k": "nowatch", "why":
TEXT}`` where inotify cannot be used (then gpumagic relies on the settle time alone).  It
ends when its stdin ends (gpumagic closed the channel).
"""

import ctypes
import ctypes.util
import json
import os
import select
import stat
import struct
import sys

IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_Q_OVERFLOW = 0x4000
IN_ISDIR = 0x40000000
IN_IGNORED = 0x8000
MASK = IN_MOVED_TO | IN_CREATE
HEADER = struct.Struct("iIII")


def say(kind, **fields):
    sys.stdout.write(json.dumps(dict(k=kind, **fields)) + "\n")
    sys.stdout.flush()


def stdin_ended(timeout):
    r, _, _ = select.select([0], [], [], timeout)
    return bool(r) and not os.read(0, 4096)


class Watcher:
    def __init__(self, root):
        self.root = root
        self.paths = {}
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self.add = libc.inotify_add_watch
        self.add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))

    def watch_tree(self, top, report):
        for folder, _dirs, files in os.walk(top):
            wd = self.add(self.fd, os.fsencode(folder), MASK)
            if wd >= 0:
                self.paths[wd] = folder
            if report:
                for name in files:
                    self.moved(os.path.join(folder, name))

    def moved(self, path):
        try:
            st = os.lstat(path)
        except OSError:
            return
        if stat.S_ISREG(st.st_mode):
            rel = os.path.relpath(path, self.root).replace(os.sep, "/")
            say("moved", rel=rel, size=st.st_size, mtime_ns=st.st_mtime_ns, ino=st.st_ino)
        elif stat.S_ISDIR(st.st_mode):
            self.watch_tree(path, True)

    def events(self):
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        at = 0
        while at + HEADER.size <= len(data):
            wd, mask, _cookie, size = HEADER.unpack_from(data, at)
            name = data[at + HEADER.size:at + HEADER.size + size].rstrip(b"\0")
            at += HEADER.size + size
            if mask & IN_Q_OVERFLOW:
                say("overflow")
                continue
            if mask & IN_IGNORED:
                self.paths.pop(wd, None)
                continue
            folder = self.paths.get(wd)
            if folder is None or not name:
                continue
            path = os.path.join(folder, os.fsdecode(name))
            if mask & IN_MOVED_TO:
                self.moved(path)
            elif mask & IN_CREATE and mask & IN_ISDIR:
                self.watch_tree(path, False)


def main():
    root = sys.argv[1]
    try:
        w = Watcher(root)
    except (OSError, AttributeError) as e:  # not Linux, or no inotify left
        say("nowatch", why=str(e))
        while not stdin_ended(None):
            pass
        return
    while not os.path.isdir(root):  # the job has not made it yet
        if stdin_ended(1.0):
            return
    w.watch_tree(root, False)
    say("watching")
    while True:
        r, _, _ = select.select([0, w.fd], [], [], None if w.paths else 1.0)
        if 0 in r and not os.read(0, 4096):
            return
        if w.fd in r:
            w.events()
        if not w.paths and os.path.isdir(root):  # the folder was removed and made again
            w.watch_tree(root, False)


main()
