"""Option objects that travel as one value (asyncssh's ``SSHClientConnectionOptions``, STYLE
point 20): :class:`Options`, what :class:`gpumagic.remote.jobs.JobOptions` and
:class:`gpumagic.sync.engine.SyncOptions` share.  No IPython here."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, TypeVar

_O = TypeVar("_O", bound="Options")


class Options:
    """A frozen dataclass of options that the plain-Python API also takes as keywords, one
    per field, merged by :meth:`with_`.  A subclass names itself in :attr:`kind` (``"job"``,
    ``"sync"``), which the error for a misspelt keyword shows."""

    #: What the options are called in messages: ``unknown job option ...``.
    kind: ClassVar[str] = ""

    @classmethod
    def names(cls) -> frozenset[str]:
        """The field names: what the plain-Python API takes as keywords."""
        return frozenset(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    def with_(self: _O, **changes) -> _O:
        """These options with ``changes`` (field names as keywords; a misspelt one raises
        ``TypeError`` naming the valid ones)."""
        valid = self.names()
        unknown = sorted(set(changes) - valid)
        if unknown:
            raise TypeError(f"unknown {self.kind} option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                            f"(valid: {', '.join(sorted(valid))})")
        return dataclasses.replace(self, **changes) if changes else self  # type: ignore[type-var]
