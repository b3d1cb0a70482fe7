"""gpumagic's folders on this computer (no IPython here).

:func:`data_dir` holds what gpumagic keeps between sessions: the budget ledger
(``ledger.json``), the keep records and kept checkpoints (``keep/MACHINE/``), the start
records of detached jobs, the wrap-up's remembered folders (``wrapup.json``).  Every layer
that keeps a file asks here, so that one setting (``$GPUMAGIC_DATA_DIR``) moves them all.
"""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    """Where gpumagic keeps local data: ``$GPUMAGIC_DATA_DIR``, else platformdirs' user data dir.

    Returns
    -------
    Path
        The folder (not created here: each writer makes its part, private to the user).
    """
    env = os.environ.get("GPUMAGIC_DATA_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("gpumagic", appauthor=False))
