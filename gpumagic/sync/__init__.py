"""Sync: push and pull a tree to and from the machine (rsync semantics)."""

from .engine import push, pull, SyncProgress, SyncSummary

__all__ = ['push', 'pull', 'SyncProgress', 'SyncSummary']
