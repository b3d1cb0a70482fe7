"""A laptop's file system on Linux: case-insensitive, as NTFS and APFS are by default.

``python casefold_fs.py [OPTIONS] BACKING MOUNTPOINT`` mounts BACKING at MOUNTPOINT with FUSE
(mfusepy over Debian's fuse3) and serves until unmounted (``fusermount3 -u MOUNTPOINT``).  A
name is looked up by its case-folded form: ``A.txt`` opens ``a.txt``.  Names keep the
spelling they were made with (case-preserving), and creating ``Model.pt`` beside
``model.pt`` opens ``model.pt``, as on a laptop.  Options:

``--unicode``
    names are also normalisation-insensitive, as on APFS (Unicode's caseless match,
    ``NFD(casefold(NFD(name)))``): ``café`` in NFC opens the NFD ``café``;
``--nfd``
    new names are stored in NFD, as macOS HFS+ writes them;
``--windows``
    what Windows' Python sees of NTFS: every file 0o666, every folder 0o777, ``chmod``
    keeps nothing, and a symlink cannot be made (EPERM, as without Developer Mode).

Used by tests/test_windows.py, through the ``casefold_dir`` fixture there.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import threading
import time
import unicodedata

import mfusepy as fuse


def fold(name: str, unicode: bool = False) -> str:
    """The name as the file system compares it (Unicode's canonical caseless match with
    ``unicode``)."""
    if not unicode:
        return name.casefold()
    return unicodedata.normalize("NFD", unicodedata.normalize("NFD", name).casefold())


class CaseFold(fuse.Operations):
    use_ns = True

    def __init__(self, root: str, *, unicode: bool = False, nfd: bool = False, windows: bool = False):
        self.root = os.path.realpath(root)
        self.unicode, self.nfd, self.windows = unicode, nfd, windows

    # -- names ------------------------------------------------------------------------------

    def _real(self, path: str) -> str:
        """The backing path of ``path``: each existing component in its stored spelling."""
        real = self.root
        parts = [p for p in path.split("/") if p]
        for i, part in enumerate(parts):
            key = fold(part, self.unicode)
            found = None
            try:
                with os.scandir(real) as it:
                    for e in it:
                        if fold(e.name, self.unicode) == key:
                            found = e.name
                            break
            except (NotADirectoryError, FileNotFoundError):
                pass
            if found is None:
                new = unicodedata.normalize("NFD", part) if self.nfd else part
                return os.path.join(real, new, *parts[i + 1:])
            real = os.path.join(real, found)
        return real

    # -- operations -----------------------------------------------------------------------------

    def getattr(self, path, fh=None):
        st = os.lstat(self._real(path))
        keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_ino", "st_dev")
        out = {k: getattr(st, k) for k in keys}
        out.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        if self.windows:
            kind = stat.S_IFMT(st.st_mode)
            out["st_mode"] = kind | (0o777 if kind == stat.S_IFDIR else 0o666)
        return out

    def readdir(self, path, fh):
        return [".", ".."] + os.listdir(self._real(path))

    def readlink(self, path):
        return os.readlink(self._real(path))

    def access(self, path, amode):
        if not os.access(self._real(path), amode):
            raise fuse.FuseOSError(errno.EACCES)

    def chmod(self, path, mode):
        if not self.windows:
            os.chmod(self._real(path), mode)

    def chown(self, path, uid, gid):
        os.lchown(self._real(path), uid, gid)

    def utimens(self, path, times=None):
        os.utime(self._real(path), ns=times, follow_symlinks=False)

    def mkdir(self, path, mode):
        os.mkdir(self._real(path), mode)

    def rmdir(self, path):
        os.rmdir(self._real(path))

    def unlink(self, path):
        os.unlink(self._real(path))

    def symlink(self, target, source):
        if self.windows:
            raise fuse.FuseOSError(errno.EPERM)
        os.symlink(source, self._real(target))

    def link(self, target, source):
        os.link(self._real(source), self._real(target))

    def rename(self, old, new):
        real_old = self._real(old)
        real_new = self._real(new)
        if fold(os.path.basename(real_old), self.unicode) == fold(os.path.basename(new.rstrip("/")), self.unicode) and \
                os.path.dirname(real_old) == os.path.dirname(real_new):
            # a rename to another spelling of the same name changes the spelling
            real_new = os.path.join(os.path.dirname(real_old), os.path.basename(new.rstrip("/")))
        os.rename(real_old, real_new)

    def statfs(self, path):
        st = os.statvfs(self._real(path))
        return {k: getattr(st, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                                            "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")}

    def open(self, path, flags):
        return os.open(self._real(path), flags)

    def create(self, path, mode, fi=None):
        return os.open(self._real(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

    def read(self, path, size, offset, fh):
        return os.pread(fh, size, offset)

    def write(self, path, data, offset, fh):
        return os.pwrite(fh, data, offset)

    def truncate(self, path, length, fh=None):
        if fh is not None:
            os.ftruncate(fh, length)
        else:
            os.truncate(self._real(path), length)

    def flush(self, path, fh):
        return 0

    def release(self, path, fh):
        os.close(fh)

    def fsync(self, path, datasync, fh):
        os.fsync(fh)


def main(argv: list[str]) -> None:
    flags = {a for a in argv if a.startswith("--")}
    root, mountpoint = [a for a in argv if not a.startswith("--")]
    fs = CaseFold(root, unicode="--unicode" in flags, nfd="--nfd" in flags, windows="--windows" in flags)
    parent = os.getppid()

    def orphaned() -> None:  # the test run is gone: end, and auto_unmount takes the mount away
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=orphaned, daemon=True).start()
    fuse.FUSE(fs, mountpoint, foreground=True, nothreads=True, auto_unmount=True)


if __name__ == "__main__":
    main(sys.argv[1:])
