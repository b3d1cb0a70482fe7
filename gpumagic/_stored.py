"""Typed records kept as JSON files here: ``load``/``save`` of a dataclass with a format name
and a schema version (the keep records, the start, reach and push records of a move).

A record class is a dataclass that subclasses :class:`Stored` and gives ``FORMAT``, ``VERSION``,
``from_dict`` and ``to_dict``, and has the fields ``version`` and ``extra``.  A file written
before its format had a version field reads as version 0.  Fields a newer gpumagic added are
kept (``extra``) and written back, so an older copy that updates a record loses nothing of it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from ._fs import atomic_write, private_dir
from .errors import GpumagicError

_S = TypeVar("_S", bound="Stored")


def read_json(path: Path, fmt: str) -> dict | None:
    """The JSON object in ``path`` when its ``format`` is ``fmt``; None otherwise (missing, unreadable)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == fmt else None


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` atomically; the folder and the one above it for the user
    alone (``keep/`` and ``keep/MACHINE/`` under gpumagic's data directory)."""
    private_dir(path.parent.parent)
    private_dir(path.parent)
    atomic_write(path, json.dumps(data, indent=1, sort_keys=True))


def opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


class Stored:
    """``load``/``save`` for a record dataclass (see the module)."""

    FORMAT: ClassVar[str]
    #: The schema this code writes; a file without ``version`` is of version 0.
    VERSION: ClassVar[int]
    version: int
    extra: dict

    @classmethod
    def from_dict(cls: type[_S], data: dict) -> _S:  # pragma: no cover - each record has its own
        raise NotImplementedError

    def to_dict(self) -> dict:  # pragma: no cover - each record has its own
        raise NotImplementedError

    @classmethod
    def load(cls: type[_S], path: Path) -> _S | None:
        """The record in ``path``; None when there is none, or it is not of this format or cannot
        be read (a damaged file counts as none, as a missing one)."""
        data = read_json(path, cls.FORMAT)
        return None if data is None else cls.parse(data)

    @classmethod
    def parse(cls: type[_S], data: dict) -> _S | None:
        """The record ``data`` holds (a file's JSON object); None when it is damaged."""
        try:
            rec = cls.from_dict(data)
        except (KeyError, TypeError, ValueError, AttributeError, GpumagicError):
            return None
        known = {f.name for f in dataclasses.fields(rec)} | {"format", "version"}  # type: ignore[arg-type]
        rec.extra = {k: v for k, v in data.items() if k not in known}
        rec.version = int(data.get("version") or 0)
        return rec

    def save(self, path: Path) -> None:
        """Write the record to ``path`` (atomically; its folders for the user alone)."""
        write_json(path, {**self.extra, **self.to_dict(), "format": self.FORMAT, "version": self.VERSION})
