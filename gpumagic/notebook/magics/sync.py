"""``%gpu sync``: copy files to or from a machine (the engine is :mod:`gpumagic.sync.engine`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

from ...errors import ConfigError, Interrupted, SyncIncomplete
from ...sync import engine as sync
from .. import widgets
from ._args import host_arg, parse, sync_options

if TYPE_CHECKING:
    from . import GpuMagics


@magic_arguments()
@argument("src", help="source: local path, or :REMOTE_PATH / NAME:REMOTE_PATH; a trailing / copies the contents")
@argument("dst", help="destination: the other side (exactly one side is remote)")
@argument("--delete", action="store_true",
          help="delete destination files the source lacks (listed); refused into a home, a folder holding "
               ".ssh or gpumagic's own, and past 1,000 paths without --yes; ignored paths are kept")
@argument("--yes", action="store_true", help="with --delete: remove more than 1,000 paths")
@argument("--exclude", metavar="PATTERN", action="append", default=[],
          help="leave out paths matching this gitignore-style pattern (repeatable)")
@argument("--no-ignore-files", dest="ignore_files", action="store_const", const=False, default=None,
          help="push: do not honour .gitignore / .gpuignore files (a pull never does unless --ignore-files)")
@argument("--ignore-files", dest="ignore_files", action="store_const", const=True,
          help="pull: leave out what the machine's .gitignore / .gpuignore files match (by default a pull "
               "brings everything, ignored results such as *.pt and runs/ included)")
@argument("--dry-run", action="store_true", help="change nothing; list what would be sent and deleted")
@argument("--checksum", action="store_true", help="compare files by content hash, not size and mtime")
@argument("--update", action="store_true", help="never replace a destination file that is newer")
@argument("--rename-clashes", action="store_true",
          help="pull: where this folder takes two of the machine's names for one (Model.pt, model.pt on "
               "Windows or macOS), write the later as 'model (2).pt' instead of refusing")
@argument("--compress", dest="compress", action="store_const", const=True, default=None,
          help="send the files' bytes compressed (xz, or bzip2 where it packs smaller; zlib where an end "
               "lacks lzma), whatever the link "
               "(data that does not compress "
               "still goes as it is); default: auto, from Compression in ~/.ssh/config, else the link's speed")
@argument("--no-compress", dest="compress", action="store_const", const=False,
          help="send the files' bytes as they are")
@host_arg("machine for :PATH (default: the current one)")
@argument("--from-all", action="store_true", help="pull :PATH from every connected machine into DST/<machine>/")
def _sync(magics: GpuMagics, line: str):
    args = parse(_sync, line, "sync")
    if args.from_all:
        from .torchrun import sync_from_all

        return sync_from_all(magics, args)
    try:
        t = sync.transfer(args.src, args.dst, host=args.host)
    except ConfigError as e:
        raise UsageError(e.message) from None
    try:
        sync.IgnoreRules(args.exclude)  # a malformed --exclude, named before anything starts
    except ConfigError as e:
        raise UsageError(f"{e.message}; {e.hint}") from None
    m = magics.fleet.get(t.host)
    if args.rename_clashes and not t.pull:
        raise UsageError("--rename-clashes is for a pull (the machine's names written here)")
    options = sync_options(args)
    root = sync.whole_file_system("pull" if t.pull else "push", m, t.src.path, t.dst.path)
    if root is not None and not (args.delete and root[0] == "destination"):  # that: the engine's error
        print(f"warning: the {root[0]} is {root[1]}: the whole file system is walked to compare, "
              "which can take minutes; Ctrl-C stops it at once, here and on the machine", file=sys.stderr)
    # a dry run shows progress only while a long walk of the machine's side goes on
    progress = widgets.LazySyncProgress() if args.dry_run else widgets.sync_progress()
    summary = incomplete = None
    try:
        sync_once = m.pull if t.pull else m.push
        summary = sync_once(t.src.path, t.dst.path, options, progress=progress)
    except SyncIncomplete as e:  # the rest was synced: its summary, then the error (Run All stops)
        summary, incomplete = e.summary, e
    except KeyboardInterrupt:
        raise Interrupted(INTERRUPTED) from None
    finally:  # the bar's line ends before an error is shown
        if progress is not None:
            progress.close(failed=summary is None or incomplete is not None)
    print(summary)
    if incomplete is not None:
        raise incomplete


#: What an interrupted sync says (one line, for IPython: :class:`Interrupted`).
INTERRUPTED = ("the sync was interrupted and stopped, here and on the machine; every file that "
               "arrived is whole, and a file of 8 MiB or more keeps its part: the same %gpu sync "
               "goes on from there")
