"""Run the machine-side settings program (``gpumagic/remote/programs/net-settings.py``).

It runs as a cell does (the user's ``python3``, the environment cells get), so ``python -m
pip`` is the pip the user's cells run, and answers one JSON object.
"""

from __future__ import annotations

import json

from ..errors import GpumagicError
from ..remote import program

#: The machine-side program.
PROGRAM = "net-settings.py"


def run(machine, command: str, *args: str, timeout: float = 120) -> dict:
    """Run ``net-settings.py COMMAND ARGS`` on ``machine`` (one round trip) and return its
    answer.

    Raises
    ------
    GpumagicError
        The machine has no ``python3``, or the program failed (its one-line reason).
    """
    r = machine.run(["python3", "-c", program.source(PROGRAM), command, *args], quiet=True, timeout=timeout)
    last = r.stdout.strip().splitlines()[-1:] if r.stdout.strip() else []
    try:
        answer = json.loads(last[0]) if last else None
    except ValueError:
        answer = None
    if r.exit_code == 127 and answer is None:
        raise GpumagicError(f"no python3 on {machine.name}'s PATH", "install Python 3 there (it is on every GPU image)")
    if not isinstance(answer, dict) or "error" in answer:
        why = answer.get("error") if isinstance(answer, dict) else (r.stderr.strip().splitlines() or ["no answer"])[-1]
        raise GpumagicError(f"could not change the network settings on {machine.name} ({command}): {why}",
                            "check the file it names on the machine (permissions, a full disk)")
    return answer
