"""The remote half of ``%gpu sync``: a stdlib-only script run as ``python3 -c SOURCE OP ...``.

gpumagic sends this file's text in each exec request (nothing is installed on the machine),
and also imports it locally, so a pull writes files with the very same code a push uses on
the remote side.  It must run on any Python 3.6+ and import nothing outside the standard
library.

Operations (argv after the source)
----------------------------------
``serve ROOT CWD HASH NAMES``
    Writes the listing of ROOT (an 8-byte big-endian length, then the records), then reads
    one command from stdin on the same channel: a 4-byte big-endian length and a JSON
    header ``{"op": "recv", ...}`` (see below) or ``{"op": "send", "paths": [...]}``; EOF
    instead ends it.  So a push or a pull of small files costs one channel.

    The listing: NUL-terminated fields, :data:`FIELDS` per record (kind, path, size,
    mtime_ns, mode, link target or text, sha256).  Kinds: ``f``
    file, ``d`` directory, ``l`` symlink (never followed), ``p`` a partial transfer left
    beside its target, ``i`` the text of a ``.gitignore``/``.gpuignore``, ``e`` an
    unreadable directory.  ``HASH`` is ``1`` to add sha256 digests of files; ``NAMES`` is
    ``-`` or a JSON list that limits the listing to those entries of ROOT.
``recv`` (a ``serve`` command)
    ``{"op": "recv", "delete": [paths], "meta": [[path, mode, mtime_ns]]}`` (removals
    first; mode/mtime of files equal in content), then a tar stream follows on stdin.
    Every file is written to a temporary name beside its target and renamed into place
    when complete; directories get their mode and mtime last.
``put ROOT CWD REL SIZE MTIME_NS MODE OFFSET SHA256``
    One large file with resume: if the partial file holds OFFSET bytes whose sha256 is
    SHA256 they are kept; prints ``OFFSET n`` then reads SIZE - n bytes from stdin.
``send`` (a ``serve`` command)
    ``{"op": "send", "paths": [...]}``: stdout then carries a tar stream of those files.
``get ROOT CWD REL OFFSET SHA256``
    Prints ``OFFSET n`` (n = OFFSET when the first OFFSET bytes hash to SHA256, else 0),
    then the file's bytes from n.

Every operation first writes :data:`MARKER` on stdout (whatever a shell start-up file
printed before it is skipped).  Errors print one JSON line ``{"error": ..., "errno": ..., "path": ..., "mount": ...}`` on
stderr (stdout for ``recv``/``put``) and exit with status 3.
"""

import errno
import os
import stat
import struct
import sys

# json, hashlib, shutil and tarfile are imported where they are used: together they cost
# ~35 ms of interpreter start-up, which a no-change sync (list only) never needs.

FIELDS = 7
PART_SUFFIX = ".gpumagic-part"
IGNORE_FILES = (".gitignore", ".gpuignore")
CHUNK = 1 << 20
MAX_IGNORE_TEXT = 1 << 20


class AgentError(Exception):
    """An error to report as JSON (path and mount included for OSError)."""


def resolve(root, cwd):
    """Absolute path of ROOT: ``~`` expanded; relative paths joined to CWD (itself relative
    to the login directory)."""
    def expand(p):
        if p == "~" or p.startswith("~/"):
            return os.path.expanduser(p)
        return p
    root = expand(root)
    if os.path.isabs(root):
        return root
    base = expand(cwd) if cwd else ""
    return os.path.abspath(os.path.join(base, root))


def part_name(path):
    """The temporary name beside ``path`` used while it is written (also for resume)."""
    import hashlib
    d, name = os.path.split(path)
    if len(os.fsencode(name)) > 200:
        name = hashlib.sha1(os.fsencode(name)).hexdigest()
    return os.path.join(d, "." + name + PART_SUFFIX)


def real_name(part):
    """The target path of a part name, or None when ``part`` is not one (hashed names: None)."""
    d, name = os.path.split(part)
    if name.startswith(".") and name.endswith(PART_SUFFIX) and len(name) > len(PART_SUFFIX) + 1:
        return os.path.join(d, name[1:-len(PART_SUFFIX)])
    return None


def mount_of(path):
    """The mount point holding ``path`` (its nearest existing ancestor)."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    while not os.path.ismount(p):
        p = os.path.dirname(p)
    return p


def error_record(exc, path=None):
    """A JSON-ready dict for an exception: message, errno name, path, mount, free bytes."""
    rec = {"error": str(exc)}
    if isinstance(exc, OSError):
        path = exc.filename or path
        rec["error"] = exc.strerror or str(exc)
        rec["errno"] = errno.errorcode.get(exc.errno, str(exc.errno))
    if path:
        path = os.fsdecode(path)
        rec["path"] = path
        try:
            mnt = mount_of(path)
            rec["mount"] = mnt
            st = os.statvfs(mnt)
            rec["free"] = st.f_bavail * st.f_frsize
        except OSError:
            pass
    return rec


# -- listing ---------------------------------------------------------------------------


def _sha256(path, limit=None):
    import hashlib
    h = hashlib.sha256()
    left = limit
    with open(path, "rb") as f:
        while left is None or left > 0:
            n = CHUNK if left is None else min(CHUNK, left)
            b = f.read(n)
            if not b:
                break
            h.update(b)
            if left is not None:
                left -= len(b)
    return h.hexdigest()


def _record(out, kind, rel, size=0, mtime_ns=0, mode=0, text="", digest=""):
    """Append one record: FIELDS fields, NUL-separated (the caller NUL-terminates it)."""
    out.append(b"%s\0%s\0%d\0%d\0%o\0%s\0%s" % (
        kind.encode(), os.fsencode(rel), size, mtime_ns, mode, os.fsencode(text), digest.encode()))


def _stat_record(out, kind_path, rel, st, want_hash):
    m = st.st_mode
    if stat.S_ISLNK(m):
        _record(out, "l", rel, st.st_size, st.st_mtime_ns, 0, os.readlink(kind_path))
    elif stat.S_ISDIR(m):
        _record(out, "d", rel, 0, st.st_mtime_ns, stat.S_IMODE(m))
    elif stat.S_ISREG(m):
        digest = _sha256(kind_path) if want_hash else ""
        _record(out, "f", rel, st.st_size, st.st_mtime_ns, stat.S_IMODE(m), "", digest)
        name = os.path.basename(rel)
        if name in IGNORE_FILES and st.st_size <= MAX_IGNORE_TEXT:
            with open(kind_path, "rb") as f:
                data = f.read()
            # Bytes as they are (git reads them so); a NUL ends its line's pattern in git, and
            # would end the record here, so each line is cut at its first NUL.
            _record(out, "i", rel, 0, 0, 0, b"\n".join(line.split(b"\0", 1)[0] for line in data.split(b"\n")))


def list_tree(root, want_hash=False, names=None):
    """Records (a list of bytes fields) for ROOT and everything under it; symlinks not followed."""
    out = []
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return out
    _stat_record(out, root, ".", st, want_hash)
    if not stat.S_ISDIR(st.st_mode):
        return out
    if names is not None:
        for name in names:
            p = os.path.join(root, name)
            try:
                _stat_record(out, p, name, os.lstat(p), want_hash)
            except FileNotFoundError:
                pass
            try:
                st = os.stat(part_name(p))
                _record(out, "p", name, st.st_size)
            except FileNotFoundError:
                pass
        return out
    stack = [(root, "")]
    while stack:
        d, rel = stack.pop()
        try:
            it = list(os.scandir(d))
        except OSError as e:
            _record(out, "e", rel or ".", 0, 0, 0, e.strerror or str(e))
            continue
        for ent in it:
            r = rel + "/" + ent.name if rel else ent.name
            target = real_name(ent.name)
            if target is not None:
                try:
                    _record(out, "p", (rel + "/" + target) if rel else target, ent.stat(follow_symlinks=False).st_size)
                except OSError:
                    pass
                continue
            try:
                st = ent.stat(follow_symlinks=False)
                _stat_record(out, ent.path, r, st, want_hash)
            except OSError as e:
                _record(out, "e", r, 0, 0, 0, e.strerror or str(e))
                continue
            if stat.S_ISDIR(st.st_mode):
                stack.append((ent.path, r))
    return out


# -- writing ---------------------------------------------------------------------------


def check_rel(rel):
    """Refuse a path that is absolute or climbs out of the root."""
    if not rel or rel.startswith("/") or any(p in ("..", "") for p in rel.split("/")):
        raise AgentError("refusing unsafe path %r" % rel)
    return rel


def remove(path):
    """Remove a file, symlink or directory tree (absent is fine)."""
    import shutil
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _make_parent(path):
    d = os.path.dirname(path)
    if not os.path.isdir(d):
        if os.path.lexists(d):
            remove(d)
        os.makedirs(d, exist_ok=True)


def _replace(tmp, path):
    import shutil
    try:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path)
    except FileNotFoundError:
        pass
    os.replace(tmp, path)


def write_file(path, src, size, mode, mtime, on_bytes=None):
    """Copy ``size`` bytes from ``src`` into a temp name beside ``path``, then rename.

    ``mtime`` is seconds (float) or, when an int above 1e15, nanoseconds.
    """
    _make_parent(path)
    tmp = part_name(path)
    done = False
    try:
        with open(tmp, "wb") as f:
            left = size
            while left > 0:
                b = src.read(min(CHUNK, left))
                if not b:
                    raise EOFError("stream ended %d bytes before the end of %s" % (left, path))
                f.write(b)
                left -= len(b)
                if on_bytes is not None:
                    on_bytes(len(b))
        set_meta(tmp, mode, mtime)
        _replace(tmp, path)
        done = True
    finally:
        if not done:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def set_meta(path, mode, mtime):
    os.chmod(path, mode & 0o7777)
    if isinstance(mtime, int) and mtime > 10 ** 15:
        os.utime(path, ns=(mtime, mtime))
    else:
        os.utime(path, (mtime, mtime))


def make_link(path, target):
    _make_parent(path)
    tmp = part_name(path)
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    os.symlink(target, tmp)
    _replace(tmp, path)


def make_dir(path, mode):
    if os.path.lexists(path) and not os.path.isdir(path) or os.path.islink(path):
        remove(path)
    os.makedirs(path, mode=0o700 | (mode & 0o777), exist_ok=True)


def stamp_dirs(dirs):
    """Set (path, mode, mtime) on directories, deepest first (children change parents' mtime)."""
    for path, mode, mtime in sorted(dirs, key=lambda d: -d[0].count(os.sep)):
        try:
            set_meta(path, mode, mtime)
        except FileNotFoundError:
            pass


def extract(root, stream, on_file=None, on_bytes=None, allowed=None):
    """Apply a tar stream under ``root``: files via temp names, links, dirs stamped last.

    ``allowed``, when given, is the set of regular-file names that may arrive (a pull takes
    only the files it asked for; anything else in the stream is refused).
    Returns the number of regular files written.
    """
    import tarfile
    n = 0
    dirs = []
    os.makedirs(root, exist_ok=True)
    with tarfile.open(fileobj=stream, mode="r|", encoding="utf-8", errors="surrogateescape") as tf:
        for m in tf:
            if m.name == ".":
                dirs.append((root, m.mode, m.mtime))
                continue
            path = os.path.join(root, check_rel(m.name))
            if allowed is not None and not (m.isreg() and m.name in allowed):
                raise AgentError("unexpected entry %r in the file stream" % m.name)
            if m.isdir():
                make_dir(path, m.mode)
                dirs.append((path, m.mode, m.mtime))
            elif m.issym():
                make_link(path, m.linkname)
            elif m.isreg():
                write_file(path, tf.extractfile(m), m.size, m.mode, m.mtime, on_bytes)
                n += 1
                if on_file is not None:
                    on_file(m.name)
    stamp_dirs(dirs)
    return n


def _lock(f):
    try:
        import fcntl
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    except (ImportError, OSError):
        pass


def open_resumable(path, offset, digest):
    """Open the partial file of ``path`` for appending; keep ``offset`` bytes when they hash
    to ``digest``, else start over.  Returns (file, kept_bytes); the file is flock-ed so an
    earlier writer that is still draining finishes first."""
    _make_parent(path)
    tmp = part_name(path)
    f = open(tmp, "a+b")
    _lock(f)
    keep = 0
    if offset > 0 and os.fstat(f.fileno()).st_size >= offset and _sha256(tmp, offset) == digest:
        keep = offset
    f.truncate(keep)
    f.seek(keep)
    return f, keep


def receive_large(path, src, size, mode, mtime, offset, digest, announce, on_bytes=None):
    """Write one large file with resume; ``announce(kept)`` is called before reading data."""
    f, keep = open_resumable(path, offset, digest)
    with f:
        announce(keep)
        left = size - keep
        while left > 0:
            b = src.read(min(CHUNK, left))
            if not b:
                f.flush()
                raise EOFError("stream ended %d bytes before the end of %s; the part is kept "
                               "for resume" % (left, path))
            f.write(b)
            left -= len(b)
            if on_bytes is not None:
                on_bytes(len(b))
        f.flush()
    tmp = part_name(path)
    set_meta(tmp, mode, mtime)
    _replace(tmp, path)


# -- main ------------------------------------------------------------------------------


def _fail(rec, stream):
    import json
    stream.write((json.dumps(rec) + "\n").encode())
    stream.flush()
    sys.exit(3)


#: Written first on stdout so that anything a chatty shell start-up file prints is skipped.
MARKER = b"\x1egpumagic-sync\n"


def apply_push(root, head, inp, out):
    """The ``recv`` command: removals, metadata, then the tar stream from ``inp``."""
    import json
    import tarfile

    current = [root]
    try:
        for rel in head.get("delete", []):
            current[0] = os.path.join(root, check_rel(rel))
            remove(current[0])
        for rel, mode, mtime in head.get("meta", []):
            current[0] = os.path.join(root, check_rel(rel))
            set_meta(current[0], mode, mtime)

        def on_file(name):
            current[0] = os.path.join(root, name)

        written = extract(root, inp, on_file)
        out.write((json.dumps({"ok": True, "files": written}) + "\n").encode())
    except (OSError, AgentError, tarfile.TarError, EOFError, ValueError) as e:
        _fail(error_record(e, current[0]), out)


def send_tar(root, rels, out):
    """The ``send`` command: a tar stream of the files ``rels`` (whole-second mtimes)."""
    import tarfile
    path = root
    try:
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT, bufsize=CHUNK,
                          encoding="utf-8", errors="surrogateescape") as tf:
            for rel in rels:
                path = os.path.join(root, check_rel(rel))
                with open(path, "rb") as f:
                    st = os.fstat(f.fileno())
                    ti = tarfile.TarInfo(rel)
                    ti.size, ti.mode, ti.mtime = st.st_size, stat.S_IMODE(st.st_mode), int(st.st_mtime)
                    tf.addfile(ti, f)
    except (OSError, AgentError) as e:
        _fail(error_record(e, path), sys.stderr.buffer)


def _json(data):
    import json
    return json.loads(data)


def main(argv):
    op, root, cwd = argv[0], argv[1], argv[2]
    root = resolve(root, cwd)
    out = sys.stdout.buffer
    out.write(MARKER)
    inp = sys.stdin.buffer
    if op == "serve":
        names = None if argv[4] == "-" else _json(argv[4])
        try:
            data = b"".join(r + b"\0" for r in list_tree(root, argv[3] == "1", names))
        except OSError as e:
            _fail(error_record(e, root), sys.stderr.buffer)
        out.write(struct.pack(">Q", len(data)) + data)
        out.flush()
        raw = inp.read(4)
        if len(raw) < 4:
            return
        (n,) = struct.unpack(">I", raw)
        head = _json(inp.read(n).decode("ascii"))
        if head["op"] == "recv":
            apply_push(root, head, inp, out)
        elif head["op"] == "send":
            send_tar(root, head["paths"], out)
        return
    if op == "put":
        rel = check_rel(argv[3])
        size, mtime, mode, offset = int(argv[4]), int(argv[5]), int(argv[6], 8), int(argv[7])
        path = os.path.join(root, rel)

        def announce(kept):
            out.write(("OFFSET %d\n" % kept).encode())
            out.flush()
        try:
            receive_large(path, inp, size, mode, mtime, offset, argv[8], announce)
            out.write(b'{"ok": true}\n')
        except (OSError, AgentError, EOFError) as e:
            _fail(error_record(e, path), out)
        return
    if op == "get":
        rel = check_rel(argv[3])
        offset, digest = int(argv[4]), argv[5]
        path = os.path.join(root, rel)
        try:
            with open(path, "rb") as f:
                if offset > 0 and _sha256(path, offset) == digest:
                    f.seek(offset)
                else:
                    offset = 0
                out.write(("OFFSET %d\n" % offset).encode())
                while True:
                    b = f.read(CHUNK)
                    if not b:
                        break
                    out.write(b)
        except OSError as e:
            _fail(error_record(e, path), sys.stderr.buffer)
        return
    _fail({"error": "unknown operation %r" % op}, sys.stderr.buffer)


if __name__ == "__main__":
    main([os.fsdecode(a) if isinstance(a, bytes) else a for a in sys.argv[1:]])
