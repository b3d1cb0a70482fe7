"""Sync: push and pull a tree to and from the machine (rsync semantics).

:mod:`.plan` (pure: paths, listings, the diff), :mod:`.ignore` (git's ignore rules),
:mod:`.engine` (the transfer, :func:`push` and :func:`pull`), :mod:`.agent` (the half that
runs on the machine).
"""

from .engine import push, pull, SyncOptions, SyncProgress, SyncSummary

__all__ = ['push', 'pull', 'SyncOptions', 'SyncProgress', 'SyncSummary']
