"""Small local-file helpers shared by every module that writes user files."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Iterator


def atomic_write(path: str | os.PathLike, data: bytes | str, *, mode: int | None = None,
                 backup: str | os.PathLike | None = None) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new file, never half.

    The data goes to a temporary file in the same directory, is fsynced, then renamed over
    ``path``.  ``mode`` sets the permission bits (default: keep the old file's, else 0600).
    ``backup``, if given, receives a copy of the previous file first.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    if mode is None:
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o600
    if backup is not None and path.exists():
        shutil.copy2(path, backup)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def private_dir(path: str | os.PathLike) -> Path:
    """Create gpumagic's own directory ``path`` (and missing parents) for the user alone (0700).

    gpumagic's state (the budget ledger, the sandbox's home) is for the user alone; a
    directory an older version made 0755 is tightened to 0700.  Tightening only takes the
    group's and others' bits away: it never gives the owner a right the directory lacked (a
    directory the user made read-only, 0555, becomes 0500 and stays read-only).  Another
    user's directory is left as it is.  Returns the path.

    On Windows the mode bits say nothing (Python reports every folder as 0o777, and
    ``chmod`` only sets the read-only flag): the folder is made and left to the access list
    it inherits, which under the user's profile (``%LOCALAPPDATA%``, where platformdirs puts
    gpumagic's data) is the user's alone.
    """
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    getuid = getattr(os, "getuid", None)
    if getuid is None:  # Windows
        return path
    st = path.stat()
    if st.st_mode & 0o077 and st.st_uid == getuid():  # another user's directory: not ours to change
        os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
    return path


@contextlib.contextmanager
def locked(lock_path: str | os.PathLike, unwritable=None) -> Iterator[None]:
    """Hold the lock file ``lock_path`` exclusively (waiting for it) for the block: the lock
    of every read-modify-write of a file two notebooks may change at once (the budget ledger,
    ``rentals.json``).

    filelock takes it with ``flock`` on POSIX and ``msvcrt.locking`` on Windows, so two
    notebooks writing at once on either never lose a record.  ``unwritable`` turns an
    ``OSError`` taking it (a read-only folder) into the caller's error (called with it)."""
    import filelock

    lock = filelock.FileLock(os.fspath(lock_path), mode=0o600)
    try:
        lock.acquire()
    except OSError as e:
        if unwritable is None:
            raise
        raise unwritable(e) from None
    try:
        yield
    finally:
        lock.release()
