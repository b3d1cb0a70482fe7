"""The pure half of a sync: where files go, what each side holds, and what differs.

* paths -- :class:`Endpoint` (``NAME:path`` or local) and rsync's trailing-slash rule
  (:func:`destination_root`);
* listings -- :class:`Entry` / :class:`Listing`, parsed from the agent's ``list`` records
  (:func:`parse_listing`) or walked locally (:func:`walk_local`), with ignored paths left
  out (:mod:`gpumagic.sync.ignore`);
* the plan -- :func:`make_plan` compares two listings as rsync ``-a`` does.

Nothing here opens a connection or writes a file.
"""

from __future__ import annotations

import os
import posixpath
import re
import stat
from dataclasses import dataclass, field
from typing import Callable, Iterable

from . import agent
from .. import localpath
from ..errors import ConfigError, SyncError
from .agent import IGNORE_FILES
from .ignore import IgnoreRules

# -- paths -----------------------------------------------------------------------------

_HOST_RE = re.compile(r"^([A-Za-z0-9._@-]*):(.*)$", re.S)


@dataclass(frozen=True)
class Endpoint:
    """One side of a sync: a local path, or a path on a machine.

    Attributes
    ----------
    path : str
        As typed (a trailing slash is kept: it matters for SRC).
    host : str or None
        ``None`` for a local path; ``""`` for the default machine (``:path``); else the
        machine's name (``NAME:path``).
    """

    path: str
    host: str | None = None

    @property
    def remote(self) -> bool:
        return self.host is not None


def parse_endpoint(text: str, *, windows: bool | None = None) -> Endpoint:
    """Parse ``:path`` / ``NAME:path`` (remote) or a local path, as rsync does.

    A colon makes the path remote unless a ``/`` (or, on Windows, a ``\\``) comes before it
    (``./a:b`` is local).  On Windows (``windows``, default this computer) a single letter
    before the colon is a drive, never a machine: ``C:\\Users\\me\\proj\\``, ``C:/data``
    and the drive-relative ``C:proj`` are local (name a one-letter machine with
    ``--host X`` and ``:path``); ``\\\\server\\share\\x`` (UNC) has no colon and is local.
    ``NAME:`` alone means the machine's working directory.
    """
    if not text:
        raise ConfigError("empty sync path", "write a local path, :REMOTE_PATH or NAME:REMOTE_PATH")
    m = _HOST_RE.match(text)
    if m is None or "/" in m.group(1):
        return Endpoint(text)
    name, path = m.groups()
    if localpath.on_windows(windows) and len(name) == 1 and name.isalpha():
        return Endpoint(text)
    return Endpoint(path or ".", name)


def _last_component(path: str, seps: str) -> str:
    if "\\" in seps:  # a Windows path: its drive or UNC share is no component (C:proj -> proj)
        path = localpath.strip_drive(path, windows=True)
    name = path.rstrip(seps)
    for sep in seps:
        name = name.rsplit(sep, 1)[-1]
    return name


def copies_contents(path: str, *, seps: str = "/") -> bool:
    """rsync's rule: a SRC ending in a slash (or naming ``.``/``..``/``/``) copies its
    contents, not the directory itself."""
    return path.endswith(tuple(seps)) or _last_component(path, seps) in ("", ".", "..")


def destination_root(src: str, dst: str, *, src_seps: str = "/", dst_join=posixpath.join) -> str:
    """Where SRC's directory lands: DST itself for ``src/``, ``DST/basename(src)`` for ``src``.

    ``sync source :/ws`` -> ``/ws/source``; ``sync source/ :/ws2`` -> ``/ws2``
    (rsync(1), "a trailing slash on the source").  ``src_seps`` are SRC's separators
    (``"/\\"`` for a Windows path); ``dst_join`` joins DST's kind of path.
    """
    if copies_contents(src, seps=src_seps):
        return dst
    return dst_join(dst, _last_component(src, src_seps))


@dataclass(frozen=True)
class Transfer:
    """One copy between this computer and a machine: what ``%gpu sync SRC DST`` means.

    Attributes
    ----------
    src, dst : Endpoint
        Exactly one of them is remote.
    host : str or None
        The machine's name: from ``NAME:PATH``, else the one the caller named, else None
        (the current machine).
    """

    src: Endpoint
    dst: Endpoint
    host: str | None = None

    @property
    def pull(self) -> bool:
        """True when the source is on the machine (a pull), False for a push."""
        return self.src.remote


def transfer(src: str, dst: str, *, host: str | None = None, windows: bool | None = None) -> Transfer:
    """Read SRC and DST as rsync does (:func:`parse_endpoint`): one side local, one remote.

    Parameters
    ----------
    src, dst : str
        ``:PATH`` or ``NAME:PATH`` on the machine, or a local path.
    host : str, optional
        The machine named otherwise (``%gpu sync --host``); must agree with a ``NAME:``.
    windows : bool, optional
        Read local paths as Windows writes them (default: this computer's rule).

    Raises
    ------
    ConfigError
        An empty path; both sides local or both remote; ``NAME:`` and ``host`` naming
        different machines.
    """
    a, b = parse_endpoint(src, windows=windows), parse_endpoint(dst, windows=windows)
    if a.remote == b.remote:
        raise ConfigError("exactly one side must be remote: `%gpu sync ./project/ :/workspace/project/` "
                          "pushes, `%gpu sync :/workspace/runs/ ./runs/` pulls",
                          "write the machine's side as :PATH or NAME:PATH")
    remote = a if a.remote else b
    if remote.host and host and remote.host != host:
        raise ConfigError(f"{remote.host}:... and --host {host} name different machines; use one",
                          f"drop {remote.host}: or --host {host}")
    return Transfer(a, b, remote.host or host)


def local_seps(windows: bool | None = None) -> str:
    """Separators of local paths: ``/``, plus ``\\`` on Windows (``windows``, default this
    computer): a trailing ``\\`` means what rsync's trailing ``/`` means."""
    return localpath.seps(windows)


# -- listings --------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One thing in a tree, relative to the sync root.

    Attributes
    ----------
    path : str
        Relative path with ``/`` separators; ``"."`` is the root itself.
    kind : str
        ``"f"`` file, ``"d"`` directory, ``"l"`` symlink.
    size : int
        Bytes (files).
    mtime_ns : int
        Modification time, nanoseconds since the epoch (``st_mtime_ns``).
    mode : int
        Permission bits (``S_IMODE``).
    target : str
        A symlink's target, as stored (never followed).
    digest : str
        sha256 hex of a file's content, when asked for (``checksum``).
    """

    path: str
    kind: str
    size: int = 0
    mtime_ns: int = 0
    mode: int = 0
    target: str = ""
    digest: str = ""

    @property
    def mtime_s(self) -> int:
        return self.mtime_ns // 1_000_000_000


@dataclass
class Listing:
    """A tree as listed.

    Attributes
    ----------
    entries : dict of str to Entry
    partials : dict of str to int
        Target path -> bytes of its largest part file (what a resume may keep, when its
        writer is gone by then).
    parts : dict of str to str
        Every abandoned part file (relative path) -> its target, for removal when the
        target is not resumed.
    ignore_texts : dict of str to str
        ``.gitignore``/``.gpuignore`` path -> text (``surrogateescape``).
    errors : dict of str to str
        Unreadable path -> reason.
    vanished : dict of str to str
        Path that was gone by the time it was looked at (listed by its folder, then no longer
        there: rsync's "file has vanished") -> reason.
    specials : dict of str to str
        Device, socket or FIFO -> which (never synced: rsync ``-a`` skips them).
    """

    entries: dict[str, Entry] = field(default_factory=dict)
    partials: dict[str, int] = field(default_factory=dict)
    parts: dict[str, str] = field(default_factory=dict)
    ignore_texts: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    vanished: dict[str, str] = field(default_factory=dict)
    specials: dict[str, str] = field(default_factory=dict)

    @property
    def root(self) -> Entry | None:
        return self.entries.get(".")


def tree_order(path: str) -> str:
    """Sort key that orders paths component by component (a directory before the files of
    its siblings whose names extend its name: ``a/b`` before ``a-x``), as sorting by
    ``path.split("/")`` does, but as one string: ``/`` becomes NUL, which no name holds."""
    return path.replace("/", "\0")


def parse_listing(data: bytes) -> Listing:
    """Parse the agent's ``list`` output (see :mod:`gpumagic.sync.agent`).

    Records are :data:`gpumagic.sync.agent.FIELDS` NUL-terminated fields: kind, path,
    size, mtime_ns, mode (octal), link target or text, sha256 (a ``p`` record's text is
    the part file's name).  Names are decoded as UTF-8
    with ``surrogateescape`` so that any byte string survives the round trip.

    Raises
    ------
    SyncError
        When the text is not a whole number of records.
    """
    # One decode of the whole (UTF-8 keeps NUL a NUL): fields are str from here on.
    fields = data.decode("utf-8", "surrogateescape").split("\0")
    if fields and fields[-1] == "":
        fields.pop()
    if len(fields) % agent.FIELDS:
        raise SyncError("the remote listing was cut short", "run the sync again")
    out = _Collect()
    entries = out.entries
    it = iter(fields)
    for kind, path, size, mtime, mode, text, digest in zip(it, it, it, it, it, it, it):
        if kind == "f" or kind == "d" or kind == "l":  # _Collect.add's first case, inline
            entries[path] = Entry(path, kind, int(size), int(mtime), int(mode, 8), text, digest)
        else:
            out.add(kind, path, int(size), int(mtime), int(mode, 8), text, digest)
    return out.listing()



class SourceWalk(agent.Listed):
    """A local source tree as walked: each record's fields, and the rows its
    :func:`gpumagic.sync.agent.fingerprint` is made of, for a no-change sync that builds no
    :class:`Entry` at all.  Part files are dropped (a source's are nobody's business)."""

    parts = False

    @property
    def unchanged(self) -> int:
        """Files and symlinks: what a no-change sync counts as unchanged."""
        return self.plain_count() + sum(1 for f in self.fields if f[0] == "f" or f[0] == "l")

    def listing(self) -> Listing:
        """The :class:`Listing` of these records (as :func:`walk_local` returns it)."""
        out = _Collect()
        entries = out.entries
        for f in self.all_fields():
            kind = f[0]
            if kind == "f" or kind == "d" or kind == "l":  # _Collect.add's first case, inline
                entries[f[1]] = Entry(f[1], kind, f[2], f[3], f[4], f[5], f[6])
            else:
                out.add(*f)
        return out.listing()


def walk_source(root: str | os.PathLike, rules: IgnoreRules | None = None, *,
                digests: bool = False, each_dir: Callable[[], None] | None = None,
                out: SourceWalk | None = None) -> SourceWalk:
    """:func:`walk_local` kept as a :class:`SourceWalk` (its ``listing()`` is that Listing).

    ``each_dir`` is called as each directory is entered, before its entries are listed
    (what it raises ends the walk); ``out``: the sink (a :class:`SourceWalk` subclass)."""
    out = SourceWalk() if out is None else out
    root = os.fspath(root)
    agent.list_tree(root, digests, None, _pruner(rules, each_dir), out)
    return out


def _pruner(rules: IgnoreRules | None, each_dir: Callable[[], None] | None = None):
    """The ``prune`` of :func:`gpumagic.sync.agent.list_tree` for ``rules``: at each
    directory, ``each_dir()``, its ignore files read, and, while any rule exists, a judge of
    its entries."""
    if rules is None and each_dir is None:
        return None

    def prune(rel: str, path: str) -> Callable[[list[os.DirEntry]], set[str]] | None:
        if each_dir is not None:
            each_dir()
        if rules is None:
            return None
        if rules.use_files:
            _read_ignore_files(rules, path, rel)
        judge = rules.folder(rel)
        return None if judge is None else lambda items: _ignored_names(judge, items)
    return prune


def walk_local(root: str | os.PathLike, rules: IgnoreRules | None = None, *,
               digests: bool = False) -> Listing:
    """List a local tree as the agent lists a remote one, skipping ignored paths.

    The walk is the agent's own :func:`gpumagic.sync.agent.list_tree`; ``rules`` prune it:
    each directory's ``.gitignore``/``.gpuignore`` files are read (``rules.use_files``)
    before its entries are judged, and ignored directories are not entered.  Symlinks are
    listed, never followed; sockets/FIFOs and part files are skipped; unreadable paths land
    in :attr:`Listing.errors`.
    """
    return walk_source(root, rules, digests=digests).listing()  # part files dropped there


class _Collect(Listing):
    """A :class:`Listing` filled record by record through :meth:`add`: by
    :func:`parse_listing` from the agent's records, and by :func:`gpumagic.sync.agent.list_tree`
    field by field (a local walk: no encoding and parsing)."""

    def add(self, kind: str, rel: str, size: int, mtime_ns: int, mode: int, text, digest: str) -> None:
        """One record's fields (see :func:`parse_listing`), typed: what each kind adds."""
        if kind in ("f", "d", "l"):
            self.entries[rel] = Entry(rel, kind, size, mtime_ns, mode, text, digest)
        elif kind == "p":  # mode 1: its writer may still be running
            self.partials[rel] = max(self.partials.get(rel, 0), size)
            if text and not mode:
                d = posixpath.dirname(rel)
                self.parts[f"{d}/{text}" if d else text] = rel
        elif kind == "i":
            self.ignore_texts[rel] = text.decode("utf-8", "surrogateescape") if isinstance(text, bytes) else text
        elif kind == "e":
            self.errors[rel] = text
        elif kind == "v":
            self.vanished[rel] = text
        elif kind == "s":
            self.specials[rel] = text

    def listing(self) -> Listing:
        """These entries as a plain :class:`Listing`."""
        return Listing(self.entries, self.partials, self.parts, self.ignore_texts, self.errors,
                       self.vanished, self.specials)


def list_local(root: str, digests: bool = False, names: list[str] | None = None,
               prune=None) -> Listing:
    """A local tree listed by the agent's own walk (:func:`gpumagic.sync.agent.list_tree`),
    the same :class:`Listing` that :func:`parse_listing` makes of its records; part files
    included.  Raises what the walk raises (OSError)."""
    out = _Collect()
    agent.list_tree(root, digests, names, prune, out)
    return out.listing()


#: Whether ``os.access`` can look at a symlink itself (not on Windows): a name that is
#: not there is then told without an exception.
_ACCESS_NOFOLLOW = os.access in os.supports_follow_symlinks


def _read_ignore_files(rules: IgnoreRules, path: str, rel: str) -> None:
    """Add the rules of the ignore files of directory ``rel`` (at ``path``).  Each is asked
    for by its name (git reads it so, and it costs less than looking at each name of a folder
    of 1,000: 6 ms of a 100,000-file walk); one that is not a plain file is skipped, as git
    skips a symlinked one."""
    for name in IGNORE_FILES:
        p = os.path.join(path, name)
        if not (os.access(p, os.F_OK, follow_symlinks=False) if _ACCESS_NOFOLLOW else os.path.lexists(p)):
            continue
        try:
            if not stat.S_ISREG(os.lstat(p).st_mode):
                continue
            with open(p, "rb") as f:
                data = f.read()
        except OSError:
            continue
        rules.add_file(f"{rel}/{name}" if rel else name, data)


def _ignored_names(judge: Callable[[str, bool], bool], items: list[os.DirEntry]) -> set[str]:
    """Names of a directory's ``items`` that ``judge`` (:meth:`IgnoreRules.folder`) ignores."""
    out = set()
    for item in items:
        try:
            is_dir = item.is_dir(follow_symlinks=False)
        except OSError:
            continue  # the walk records why it cannot be read
        if judge(item.name, is_dir):
            out.add(item.name)
    return out


def filter_listing(listing: Listing, rules: IgnoreRules) -> Listing:
    """Drop ignored entries from a listing (used for remote sources), pruning ignored dirs."""
    for rel, text in listing.ignore_texts.items():
        if rel in listing.entries:
            rules.add_file(rel, text)
    keep: dict[str, Entry] = {}
    pruned: list[str] = []
    for rel in sorted(listing.entries, key=tree_order):
        e = listing.entries[rel]
        if pruned and (rel + "/").startswith(pruned[-1]):
            continue
        if rules.ignored(rel, e.kind == "d"):
            if e.kind == "d":
                pruned.append(rel + "/")
            continue
        keep[rel] = e
    listing.entries = keep
    return listing


# -- plan ------------------------------------------------------------------------------


@dataclass
class Plan:
    """What a sync will do, from two listings.  Paths are relative to the roots.

    Attributes
    ----------
    send : list of Entry
        Files whose content goes over (new or different).
    links : list of Entry
        Symlinks to (re)create.
    dirs : list of Entry
        Directories to create, or whose mode/mtime to set (parents of changed entries too).
    meta : list of (path, mode, mtime_ns)
        Files equal in content whose mode or mtime differ (``checksum``).
    replace : list of str
        Destination paths of another type, removed first (a dir where a file goes).
    delete : list of str
        Extra destination paths (only with ``delete``), every one listed, parents first.
    unchanged : int
        Files and links that already match.
    newer : list of str
        Files skipped because the destination is newer (``update``).
    kept_dirs : list of str
        Destination folders kept where the source has a file or link of that name: the folder
        holds something (without ``delete``: anything; with it: a path the rules protect),
        so the file is not sent (rsync: "cannot delete non-empty directory").
    """

    send: list[Entry] = field(default_factory=list)
    links: list[Entry] = field(default_factory=list)
    dirs: list[Entry] = field(default_factory=list)
    meta: list[tuple[str, int, int]] = field(default_factory=list)
    replace: list[str] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    unchanged: int = 0
    newer: list[str] = field(default_factory=list)
    kept_dirs: list[str] = field(default_factory=list)

    @property
    def bytes_to_send(self) -> int:
        return sum(e.size for e in self.send)

    @property
    def removals(self) -> list[str]:
        """Top-most paths to remove (replacements and deletions; children go with them)."""
        out: list[str] = []
        for p in sorted(set(self.replace) | set(self.delete), key=tree_order):
            if not out or not p.startswith(out[-1] + "/"):
                out.append(p)
        return out

    @property
    def empty(self) -> bool:
        return not (self.send or self.links or self.dirs or self.meta or self.replace or self.delete)


def make_plan(src: dict[str, Entry], dst: dict[str, Entry], *, delete: bool = False,
              checksum: bool = False, update: bool = False,
              rules: IgnoreRules | None = None, unreadable: Iterable[str] = (),
              fold: Callable[[str], str] | None = None, whole_dest: bool = True) -> Plan:
    """Compare two listings as rsync ``-a`` does.

    A file is unchanged when size and mtime (whole seconds) match, or with ``checksum``
    when the sha256 digests match; ``update`` never replaces a newer destination file.
    With ``delete``, destination paths absent from the source are deleted, except those the
    rules ignore (rsync: excluded files are protected from deletion), except what lies
    under a source path that could not be read (``unreadable``), and, with ``fold`` (how
    the laptop's folder compares names: :meth:`gpumagic.sync.laptop.LocalFs.key`), except
    a path that is one name there with a source path (``a.txt`` is not deleted for ``A.txt``).
    ``whole_dest``: ``dst`` lists what its folders hold (False for a one-file sync, which lists
    only that name: a folder there is then taken to hold files).
    """
    spared = tuple(p + "/" for p in unreadable if p != ".")
    plan = Plan()
    touched_dirs: set[str] = set()
    # A folder where the source has a file or link is replaced only when nothing in it would
    # be lost: it is empty, or (--delete) nothing in it is protected by the rules
    holding: set[str] = set()
    for rel, d in dst.items():
        if d.kind == "d" and rel in src and src[rel].kind != "d" and rel != ".":
            inside = [r for r in dst if r.startswith(rel + "/")]
            if not whole_dest or inside and (not delete or rules is not None and any(
                    rules.covers(r, dst[r].kind == "d") for r in inside)):
                holding.add(rel)
    for rel in sorted(src, key=tree_order):
        s, d = src[rel], dst.get(rel)
        changed = False
        if rel in holding:
            plan.kept_dirs.append(rel)
            continue
        if d is not None and d.kind != s.kind and not (s.kind == "d" and d.kind == "d"):
            if rel != ".":
                plan.replace.append(rel)
            d = None
        if s.kind == "d":
            if d is None or d.mode != s.mode or d.mtime_s != s.mtime_s:
                plan.dirs.append(s)
            changed = d is None
        elif s.kind == "l":
            if d is None or d.target != s.target:
                plan.links.append(s)
                changed = True
            else:
                plan.unchanged += 1
        else:
            if d is None:
                plan.send.append(s)
                changed = True
            elif update and d.mtime_s > s.mtime_s:
                if checksum and s.digest == d.digest:
                    plan.unchanged += 1  # newer here, the same bytes: nothing differs
                else:
                    plan.newer.append(rel)
            elif (s.digest == d.digest) if checksum else (
                    s.size == d.size and s.mtime_ns // 1_000_000_000 == d.mtime_ns // 1_000_000_000):
                plan.unchanged += 1
                if d.mode != s.mode or s.mtime_ns // 1_000_000_000 != d.mtime_ns // 1_000_000_000:
                    plan.meta.append((rel, s.mode, s.mtime_ns))
            else:
                plan.send.append(s)
                changed = True
        if changed and rel != ".":
            touched_dirs.add(posixpath.dirname(rel) or ".")
    if delete:
        src_keys = {fold(p) for p in src} if fold is not None else None
        kept: list[str] = []  # destination-only paths that stay: their folders stay too
        for rel in sorted(dst, key=tree_order):
            if rel == "." or rel in src and rel not in holding:
                continue
            if rel in holding:
                kept.append(rel)
                continue
            if (src_keys is not None and fold(rel) in src_keys
                    or rules is not None and rules.covers(rel, dst[rel].kind == "d")
                    or "." in unreadable or (rel + "/").startswith(spared)):
                kept.append(rel)
                continue
            plan.delete.append(rel)
        # A folder gone from the source is not deleted whole while something under it is
        # protected (rsync: a protected file keeps its parent directories; mutagen#114):
        # ``old/runs/ckpt.pt`` under an ignored ``runs/`` keeps ``old/`` and ``old/runs/``,
        # and only the rest of ``old/`` goes.
        holders = {"/".join(parts[:i]) for parts in (r.split("/") for r in kept) for i in range(1, len(parts))}
        plan.delete = [r for r in plan.delete if r not in holders]
        for rel in plan.delete:
            touched_dirs.add(posixpath.dirname(rel) or ".")
    for rel in plan.replace:
        touched_dirs.add(posixpath.dirname(rel) or ".")
    listed = {e.path for e in plan.dirs}
    for rel in sorted(touched_dirs, key=tree_order):
        if rel not in listed and rel in src and src[rel].kind == "d":
            plan.dirs.append(src[rel])
    return plan
