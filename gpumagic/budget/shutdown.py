"""Can this machine shut itself down, and how: shared by jobs (``--then-shutdown``) and the
budget guard, through :meth:`gpumagic.machine.Machine.shutdown_plan` (the sandbox answers
with its stand-in instead).

Many rented "machines" are containers where ``shutdown`` exists but cannot work (PID 1 is
not an init system) or the user is not root.  :func:`find_shutdown` answers in one round
trip, before anything is armed, so a student is told at once instead of paying all night.

Rules, in order:

1. privilege: root, or ``sudo -n true`` succeeds (then the command is prefixed ``sudo -n``);
   otherwise the answer says which: no ``sudo`` on PATH, or the first line ``sudo -n true``
   printed (its exit code where it printed nothing);
2. a command, on PATH or where images keep it off a non-login PATH (``/sbin``, ``/usr/sbin``:
   ``gm_find`` of ``lib.sh``): ``shutdown`` (run as ``shutdown -h now``), else ``poweroff``;
3. it can act: PID 1 is an init system (``systemd``, ``init``), or the command found is not
   the distribution's own (not under ``/sbin``, ``/usr/sbin``, ``/bin``, ``/usr/bin``): a
   wrapper the user or platform put earlier on PATH is trusted to know what it does.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The machine-side probe (``gpumagic/remote/programs/shutdown-find.sh``): it prints one line,
#: ``ok COMMAND``, ``noroot nosudo``, ``noroot sudo exit CODE LINE``, ``nocmd`` or
#: ``noinit INIT``, read by :func:`parse_probe`.
PROBE = "shutdown-find.sh"

CONTAINER_HINT = ("this machine looks like a container (PID 1 is {init!r}, not an init system), "
                  "so it cannot power itself off; stop the instance from the platform's console "
                  "or CLI (AutoDL: 关机 in the console; vast.ai: `vastai stop instance ID`; "
                  "RunPod: `runpodctl stop pod ID`)")


@dataclass(frozen=True)
class ShutdownPlan:
    """How the machine can shut down.

    Attributes
    ----------
    command : str or None
        The shell command that powers the machine off (``None`` when none can).
    reason : str
        Why none can, with what to do instead (empty when ``command`` is set).
    """

    command: str | None
    reason: str = ""

    @property
    def possible(self) -> bool:
        return self.command is not None


def parse_probe(output: str) -> ShutdownPlan:
    """Read the output of ``shutdown-find.sh`` (its last line)."""
    line = output.strip().splitlines()[-1] if output.strip() else ""
    word, _, rest = line.partition(" ")
    if word == "ok" and rest:
        return ShutdownPlan(rest)
    if word == "noroot":
        return ShutdownPlan(None, f"{_not_root(rest)}, so no shutdown command can run; run as root, "
                                  "allow passwordless sudo for shutdown, or stop the instance from "
                                  "the platform's console")
    if word == "nocmd":
        return ShutdownPlan(None, "neither `shutdown` nor `poweroff` exists on this machine; "
                                  "stop the instance from the platform's console")
    if word == "noinit":
        return ShutdownPlan(None, CONTAINER_HINT.format(init=rest or "?"))
    return ShutdownPlan(None, f"could not tell whether this machine can shut down ({line!r})")


def _not_root(detail: str) -> str:
    """Why a user who is not root cannot shut down, from the probe's ``noroot`` detail:
    ``nosudo``, or ``sudo exit CODE LINE`` (LINE: the first line ``sudo -n true`` printed)."""
    if detail == "nosudo":
        return "not root, and sudo is not installed"
    kind, _, rest = detail.partition(" ")
    if kind == "sudo":
        _, code, said = (rest.split(" ", 2) + ["", ""])[:3]
        said = said.strip() or f"it exited with code {code or '?'}"
        return f"not root, and `sudo -n true` failed ({said})"
    return "not root, and passwordless sudo was not available"


def find_shutdown(machine) -> ShutdownPlan:
    """Ask ``machine`` (a :class:`gpumagic.Machine`) how it can shut down; one round trip.

    The probe runs as a cell does, in the login environment, so a ``shutdown`` wrapper that
    ``~/.bashrc`` puts on PATH is found as the user would find it over ``ssh host``.
    """
    from ..remote import program

    r = machine.run(["sh", "-c", program.command(PROBE)], quiet=True)
    return parse_probe(r.stdout)
