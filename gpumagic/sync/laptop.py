"""What the laptop's folder can hold: permission bits, names that differ only in case or in
Unicode normalisation, symlinks.

The machine is Linux (ext4, xfs): every name is its own bytes, every file has its mode.  A
laptop folder may not be: NTFS (as Windows shows it) keeps no modes (Python reports 0o666,
0o444 and 0o777) and ignores case; APFS ignores case and normalisation by default; HFS+
writes names as NFD; exFAT and FAT keep no modes and ignore case.  :func:`probe` asks the
folder itself (one small file made and removed), and the pure functions here turn the
answers into sync rules:

- a push from a folder without modes sends no mode it made up: a file that exists on the
  machine keeps its mode there; a new file is 0644, or 0755 when it starts with ``#!``;
  a new folder 0755 (:func:`machine_modes`, :func:`mode_by_content`);
- on a folder that ignores case or normalisation, two names the machine tells apart are
  one file here: a pull of both is refused before anything is written, naming them, or
  renames the later ones with ``rename_clashes`` (:func:`clashes`, :func:`renamed`); a
  push or pull compares each name with the other side's spelling of it, so ``A.txt`` here
  updates ``a.txt`` there, and neither is sent twice nor deleted (:func:`respelled`,
  :meth:`LocalFs.key`).
"""

from __future__ import annotations

import os
import posixpath
import secrets
import stat
import sys
import unicodedata
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterable, Mapping

if TYPE_CHECKING:
    from .plan import Entry

#: A file's mode when it is chosen by its content (a new file pushed from a folder without modes).
BY_CONTENT = -1
NEW_FILE_MODE, NEW_SCRIPT_MODE, NEW_DIR_MODE = 0o644, 0o755, 0o755


@dataclass(frozen=True)
class LocalFs:
    """What a laptop folder's file system keeps.

    Attributes
    ----------
    modes : bool
        Permission bits are kept (False: NTFS or FAT as Windows shows them, exFAT).
    case : bool
        Names that differ only in case are different files (False: NTFS, APFS, FAT).
    normalization : bool
        Names that differ only in Unicode normalisation (``café`` as NFC and as NFD) are
        different files (False: APFS, HFS+).
    """

    modes: bool = True
    case: bool = True
    normalization: bool = True

    @property
    def folds(self) -> bool:
        """Some names the machine tells apart are one name here."""
        return not (self.case and self.normalization)

    def key(self, path: str) -> str:
        """``path`` as this file system compares it: case-folded where it ignores case, NFD
        where it ignores normalisation (both: Unicode's caseless match, ``NFD(casefold(NFD(x)))``)."""
        if not self.normalization:
            path = unicodedata.normalize("NFD", path)
        if not self.case:
            path = path.casefold()
            if not self.normalization:
                path = unicodedata.normalize("NFD", path)
        return path


def platform_default(platform: str | None = None) -> LocalFs:
    """What a laptop folder usually keeps on ``platform`` (default ``sys.platform``): Windows'
    NTFS keeps no modes and ignores case; macOS' APFS ignores case and normalisation."""
    platform = sys.platform if platform is None else platform
    if platform == "win32":
        return LocalFs(modes=False, case=False)
    if platform == "darwin":
        return LocalFs(case=False, normalization=False)
    return LocalFs()

PROBE_PREFIX = ".gpumagic-probe-"  # the probe's own short-lived file; never a synced name


def probe(folder: str, *, platform: str | None = None) -> LocalFs:
    """Ask the file system of ``folder`` (or of its nearest existing parent) what it keeps:
    one small file, ``.gpumagic-probe-TOKEN-é``, is made, its mode set to 0640 and read
    back, its name looked up upper-cased and in NFD, and removed, and the folder's mtime is
    set back to what it was (a sync compares it).  Where nothing can be made there (a
    read-only folder), :func:`platform_default`."""
    d = os.path.abspath(folder)
    while not os.path.isdir(d):
        parent = os.path.dirname(d)
        if parent == d:
            return platform_default(platform)
        d = parent
    name = unicodedata.normalize("NFC", f"{PROBE_PREFIX}{secrets.token_hex(4)}-é")
    path = os.path.join(d, name)
    try:
        before = os.stat(d)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return platform_default(platform)
    try:
        os.close(fd)
        try:
            os.chmod(path, 0o640)
            modes = stat.S_IMODE(os.stat(path).st_mode) == 0o640
        except OSError:
            modes = False
        case = not os.path.lexists(os.path.join(d, name.upper()))
        normalization = not os.path.lexists(os.path.join(d, unicodedata.normalize("NFD", name)))
    finally:
        try:
            os.unlink(path)
            # the folder's mtime as it was: a sync compares folders' mtimes too
            os.utime(d, ns=(before.st_atime_ns, before.st_mtime_ns))
        except OSError:
            pass
    return LocalFs(modes=modes, case=case, normalization=normalization)


# -- modes ------------------------------------------------------------------------------------


def mode_by_content(head: bytes) -> int:
    """A new file's mode on the machine when the laptop keeps none: 0755 for a script
    (``#!``), else 0644."""
    return NEW_SCRIPT_MODE if head[:2] == b"#!" else NEW_FILE_MODE


def machine_modes(src: Mapping[str, "Entry"], dst: Mapping[str, "Entry"]) -> dict[str, "Entry"]:
    """A push's source entries from a folder without modes, with the modes the machine
    should end with: those of the machine's entry of the same path and kind (kept), else
    :data:`BY_CONTENT` for a file (0644/0755 decided when it is read: :func:`mode_by_content`)
    and 0755 for a folder.  Symlinks have no mode of their own."""
    out = {}
    for rel, e in src.items():
        d = dst.get(rel)
        if e.kind == "l":
            out[rel] = e
        elif d is not None and d.kind == e.kind:
            out[rel] = e if e.mode == d.mode else replace(e, mode=d.mode)
        else:
            out[rel] = replace(e, mode=BY_CONTENT if e.kind == "f" else NEW_DIR_MODE)
    return out


# -- names ------------------------------------------------------------------------------------


def clashes(paths: Iterable[str], fs: LocalFs) -> list[list[str]]:
    """Groups of paths (two or more, sorted) that are one name on ``fs``; only the top-most
    of a clash is named (``Data/`` and ``data/`` clash, not each file below them)."""
    groups: dict[str, list[str]] = {}
    for p in paths:
        if p != ".":
            groups.setdefault(fs.key(p), []).append(p)
    clashing = {k: sorted(v) for k, v in groups.items() if len(v) > 1}
    top = []
    for k, v in sorted(clashing.items(), key=lambda kv: kv[1][0]):
        parent = fs.key(posixpath.dirname(v[0]))
        if any(parent == c or parent.startswith(c + "/") for c in clashing if c != k):
            continue
        top.append(v)
    return top


def _numbered(name: str, n: int) -> str:
    stem, dot, ext = name.rpartition(".")
    if not stem:  # no extension (or a dotfile: .bashrc)
        return f"{name} ({n})"
    return f"{stem} ({n}){dot}{ext}"


def renamed(paths: Iterable[str], fs: LocalFs) -> dict[str, str]:
    """For names that clash on ``fs``: machine path -> the laptop path to write it to.  In
    each clash the first path (sorted) keeps its name; the others get `` (2)``, `` (3)``
    before the extension (``model (2).pt``), a name no other path takes; what lies under
    a renamed folder follows it.  Paths that do not clash are left out."""
    ordered = sorted(paths)
    taken = {fs.key(p) for p in ordered}
    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for p in ordered:
        if p == ".":
            continue
        parent, _, name = p.rpartition("/")
        local_parent = out.get(parent, parent)
        local = f"{local_parent}/{name}" if local_parent else name
        key = fs.key(local)
        if key in seen and seen[key] != p:
            n = 2
            while True:
                candidate = _numbered(name, n)
                local = f"{local_parent}/{candidate}" if local_parent else candidate
                if fs.key(local) not in taken:
                    break
                n += 1
            taken.add(fs.key(local))
        seen.setdefault(fs.key(local), p)
        if local != p:
            out[p] = local
    return out


def respelled(laptop: Mapping[str, "Entry"], machine: Iterable[str], fs: LocalFs) -> dict[str, "Entry"]:
    """The laptop's entries, each under the machine's spelling of its name where ``fs`` makes
    the two one name (``A.txt`` here, ``a.txt`` there; ``café`` in NFD here, NFC there) and
    the machine has no entry spelled as the laptop's.  The laptop path still opens the file
    here: on ``fs`` both spellings are one name."""
    if not fs.folds:
        return dict(laptop)
    exact = set(machine)
    by_key: dict[str, str] = {}
    for p in sorted(exact):
        by_key.setdefault(fs.key(p), p)
    out = {}
    for rel, e in laptop.items():
        if rel in exact:
            out[rel] = e
            continue
        other = by_key.get(fs.key(rel))
        if other is None or other in laptop:
            out[rel] = e
        else:
            out[other] = replace(e, path=other)
    return out
