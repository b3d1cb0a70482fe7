"""``%gpu mirrors pip|hf|conda [NAME]`` and ``off``: set a well-known mirror on the machine,
show the change, undo it.

* pip: ``global.index-url`` per user, through the machine's own ``pip config --user`` (the
  per-user ``pip.conf`` where that pip has no ``config`` command);
* Hugging Face: ``HF_ENDPOINT`` in ``~/.gpumagic/env`` on the machine, which every cell,
  session and job gets before anything runs (:meth:`gpumagic.remote.environment.Environment.current`):
  ``huggingface_hub`` reads it once, when it is imported, so setting it later inside a
  notebook does nothing;
* conda: ``default_channels`` and ``channel_alias`` in ``~/.condarc`` (a marked block; the
  keys it replaces are kept and put back by ``off``).

What each change replaced is kept on the machine (``~/.gpumagic/net-state.json``), so ``off``
puts back what was there, also after a notebook restart; a value changed by hand since is
left alone and said so.  The mirrors are ``mirrors.json``'s (:mod:`gpumagic.net.catalog`).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import catalog, settings
from .catalog import Mirror
from .doctor import configured_mirrors


@dataclass
class MirrorChange:
    """One change ``%gpu mirrors`` made (or undid).

    Attributes
    ----------
    kind : str
        ``pip``, ``hf`` or ``conda``.
    mirror : Mirror or None
        The mirror set (None for ``off``).
    setting : str
        What changed (``global.index-url``, ``HF_ENDPOINT``, ``~/.condarc channels``).
    file : str
        Where, on the machine.
    before, after : str
        The value before and after ("(not set)" for none).
    note : str
        One more line ("" for none).
    """

    kind: str
    mirror: Mirror | None
    setting: str
    file: str
    before: str
    after: str
    note: str = ""

    @property
    def text(self) -> str:
        if self.mirror is None and self.before == self.after and self.note.startswith("gpumagic had not set"):
            return f"{self.kind} mirror off: nothing to undo ({self.note[len('gpumagic '):]})"
        head = (f"{self.kind} mirror {self.mirror.name} ({self.mirror.title}; source {self.mirror.source})"
                if self.mirror is not None else f"{self.kind} mirror off")
        lines = [head + ":", f"  {self.setting}: {self.before} -> {self.after}   ({self.file} on the machine)"]
        if self.note:
            lines.append(f"  {self.note}")
        if self.mirror is not None:
            lines.append(f"  undo: `%gpu mirrors {self.kind} off`")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text


def _shown(value) -> str:
    if isinstance(value, list):
        return " ".join(value) if value else "(none)"
    return value if value else "(not set)"


_HF_NOTE = ("huggingface_hub reads HF_ENDPOINT when it is imported: new cells, sessions and jobs get it; "
            "a session already running keeps its own: stop it and start it again (`%gpu kernel stop NAME`, "
            "`%gpu kernel start NAME`)")


def set_mirror(machine, kind: str, name: str | None = None) -> MirrorChange:
    """Make ``machine`` use mirror ``name`` of ``kind`` (default: the kind's first); one or
    two round trips.

    Raises
    ------
    ConfigError
        An unknown kind or name (naming those that exist).
    GpumagicError
        The machine's files could not be changed.
    """
    m = catalog.mirror(kind, name)
    if kind == "pip":
        r = settings.run(machine, "pip-set", m.url)
        note = "" if r.get("pip_config") else "this pip has no `pip config`: wrote the per-user pip.conf"
        return MirrorChange(kind, m, "pip's global.index-url", r["file"], _shown(r["before"]), _shown(r["after"]), note)
    if kind == "hf":
        before = machine.env.current().get("HF_ENDPOINT")
        r = settings.run(machine, "env-set", "HF_ENDPOINT", m.url)
        machine.env.forget()
        return MirrorChange(kind, m, "HF_ENDPOINT", r["file"], _shown(r["before"] or before), m.url, _HF_NOTE)
    r = settings.run(machine, "conda-set", m.url)
    return MirrorChange(kind, m, "~/.condarc channels", r["file"], _shown(r["before"]), _shown(r["after"]))


def unset_mirror(machine, kind: str) -> MirrorChange:
    """Undo :func:`set_mirror` for ``kind``: put back what was there before gpumagic changed
    it (nothing when it was changed by hand since; the note says so)."""
    if kind not in catalog.KINDS:
        catalog.mirror(kind)  # raises, naming the kinds
    if kind == "pip":
        r = settings.run(machine, "pip-off")
        return MirrorChange(kind, None, "pip's global.index-url", r["file"], _shown(r["before"]),
                            _shown(r["after"]), r.get("note", ""))
    if kind == "hf":
        r = settings.run(machine, "env-unset", "HF_ENDPOINT")
        machine.env.forget()
        after = machine.env.current().get("HF_ENDPOINT")  # the user's own, if any
        note = "" if r["before"] else "gpumagic had not set HF_ENDPOINT on this machine"
        return MirrorChange(kind, None, "HF_ENDPOINT", r["file"], _shown(r["before"]), _shown(after), note)
    r = settings.run(machine, "conda-off")
    return MirrorChange(kind, None, "~/.condarc channels", r["file"], _shown(r["before"]), _shown(r["after"]),
                        r.get("note", ""))


def in_use(machine) -> dict[str, str]:
    """What each kind uses on the machine now (kind -> URL, "(not set)" for the default);
    one round trip."""
    found = configured_mirrors(settings.run(machine, "read"), machine.env.current())
    return {k: found.get(k, "(not set: the upstream)") for k in catalog.KINDS}
