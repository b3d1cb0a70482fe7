"""Programs that run on the machine, kept as real files and run by name.

Every shell or Python program gpumagic runs on the machine is a file under
``gpumagic/remote/programs/`` (read with :mod:`importlib.resources`, checked by ``shellcheck``
in the tests), never text assembled in Python.  A shell program (``NAME.sh``) runs under the
machine's ``/bin/sh`` after the shared library ``lib.sh`` (zombie-aware ``gm_alive``,
``gm_find`` for tools outside a non-login PATH, ``gm_python``) with its arguments as ``$1``,
``$2``, ...; a Python program (``NAME.py``) runs under the machine's ``python3`` with its
arguments in ``sys.argv[1:]``.  The command travels to ``/bin/sh`` on the channel's stdin
(:func:`gpumagic.remote.execution.run_program`, :func:`~gpumagic.remote.execution.exec_simple`),
so no login shell (fish, tcsh) re-reads it, and arguments are quoted for ``/bin/sh`` alone.
This module is the programs' text only; running them is :mod:`gpumagic.remote.execution`'s.  Arguments are visible in the machine's
``/proc/PID/cmdline``: secrets go through ``stdin``, never as arguments.
"""

from __future__ import annotations

import shlex
from functools import lru_cache
from importlib import resources

#: The folder of the machine-side programs (a resources Traversable).
PROGRAMS = resources.files("gpumagic.remote") / "programs"


@lru_cache(maxsize=None)
def source(name: str) -> str:
    """The text of the program file ``gpumagic/remote/programs/NAME`` (``NAME`` with its
    ``.sh``/``.py`` suffix).

    Raises
    ------
    FileNotFoundError
        No such program in the package (a packaging fault, not a user error).
    """
    return (PROGRAMS / name).read_text(encoding="utf-8")


def command(name: str, *args: object) -> str:
    """The ``/bin/sh`` command text that runs program ``name`` with ``args``.

    ``NAME.sh``: ``lib.sh``, then ``set -- ARGS``, then the program.  ``NAME.py``: the
    library, then ``exec`` of ``gm_python`` with the program as ``-c`` text and ``ARGS``
    (status 127 with a message on stderr where the machine has no Python 3).  Each argument
    is ``str()``-ed and quoted for POSIX sh.
    """
    quoted = " ".join(shlex.quote(str(a)) for a in args)
    lib = source("lib.sh")
    if name.endswith(".py"):
        return (f"{lib}\n_gm_py=$(gm_python) || {{ echo 'gpumagic: no python3 on the machine' >&2; exit 127; }}\n"
                f"exec \"$_gm_py\" -c {shlex.quote(source(name))} {quoted}\n")
    if name.endswith(".sh"):
        return f"{lib}\nset -- {quoted}\n{source(name)}"
    raise ValueError(f"program {name!r} is neither .sh nor .py")
