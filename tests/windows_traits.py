"""The laptop side with Windows' traits: run as ``python windows_traits.py WORKDIR``.

Before gpumagic is imported, an import hook takes from gpumagic's own modules (importers
whose ``__name__`` is ``gpumagic`` or ``gpumagic.*``) what Windows' Python lacks: ``fcntl``,
``pwd``, ``grp``, ``termios``, ``resource`` cannot be imported, and their ``os`` has no
``getuid``/``geteuid``/``killpg``/``setsid``/``fork``, their ``select`` no ``poll``, their
``signal`` no ``SIGKILL``/``SIGHUP``.  The standard library and third-party modules keep
theirs (subprocess, getpass, platformdirs and filelock take their Linux branches here).

Then it connects to the alias ``testgpu`` (the test sshd, from ``$HOME/.ssh/config``), runs a
cell, pushes and pulls a folder, records the budget (``$GPUMAGIC_DATA_DIR``) and opens a
tunnel, and prints one JSON line with what it saw.
"""

from __future__ import annotations

import builtins
import json
import os
import select
import signal
import socket
import sys
import types
from pathlib import Path

REFUSED = {"fcntl", "pwd", "grp", "termios", "resource"}
HIDDEN = {"os": {"getuid", "geteuid", "killpg", "setsid", "fork"}, "select": {"poll"},
          "signal": {"SIGKILL", "SIGHUP"}}
asked: list[str] = []  # what gpumagic reached for and Windows would not have given


class _Without(types.ModuleType):
    """A module as gpumagic's modules see it on Windows: ``real`` less ``hidden``."""

    def __init__(self, real: types.ModuleType, hidden: set[str]):
        super().__init__(real.__name__)
        self._real, self._hidden = real, hidden

    def __getattr__(self, name: str):
        if name in self._hidden:
            asked.append(f"{self.__name__}.{name}")
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r} (Windows)")
        return getattr(self._real, name)


PROXIES = {"os": _Without(os, HIDDEN["os"]), "select": _Without(select, HIDDEN["select"]),
           "signal": _Without(signal, HIDDEN["signal"])}
_import = builtins.__import__


def _ours(globals_) -> bool:
    name = (globals_ or {}).get("__name__", "")
    return name == "gpumagic" or name.startswith("gpumagic.")


def _windows_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and _ours(globals):
        top = name.partition(".")[0]
        if top in REFUSED:
            asked.append(f"import {name}")
            raise ModuleNotFoundError(f"No module named {name!r} (Windows)", name=name)
        if top in PROXIES:
            module = _import(name, globals, locals, fromlist, level)
            return PROXIES[top] if name == top or not fromlist else module
    return _import(name, globals, locals, fromlist, level)


builtins.__import__ = _windows_import


def main(work: Path) -> dict:
    assert "gpumagic" not in sys.modules
    import gpumagic
    from gpumagic.sync import agent

    seen = {}
    with open(work / "probe", "wb") as f:
        seen["agent_lock"] = agent._try_lock(f)  # no fcntl: "this file system has no such locks"
    m = gpumagic.connect("testgpu")
    try:
        seen["cell"] = m.run("echo cell-ran; echo err >&2", quiet=True).stdout
        src = work / "proj"
        (src / "sub").mkdir(parents=True)
        (src / "train.py").write_text("print('train')\n", encoding="utf-8")
        (src / "sub" / "数据.txt").write_bytes(b"x" * 70000)
        remote = f"win-smoke-{os.getpid()}/proj"
        push = m.push(f"{src}/", f":{remote}/")
        seen["pushed"] = push.files_sent
        seen["remote"] = m.run(f"cd {remote} && find . -type f | sort && cat train.py", quiet=True).stdout
        m.run(f"echo from-machine > {remote}/result.txt", quiet=True)
        m.pull(f":{remote}/", f"{work}/back/")
        back = work / "back"
        seen["pulled"] = sorted(p.relative_to(back).as_posix() for p in back.rglob("*") if p.is_file())
        seen["pulled_result"] = (back / "result.txt").read_text(encoding="utf-8")
        m.budget.set(2.5, currency="CNY")
        reading = m.budget.meter()
        seen["budget_rate"] = reading.prices.rate
        seen["rentals"] = len(json.loads((Path(os.environ["GPUMAGIC_DATA_DIR"]) / "ledger.json").read_text(encoding="utf-8"))["machines"]["testgpu"]["sessions"])
        ledger = Path(os.environ["GPUMAGIC_DATA_DIR"]) / "ledger.json"
        seen["ledger_machines"] = sorted(json.loads(ledger.read_text(encoding="utf-8"))["machines"])
        port = int(os.environ["SMOKE_SSHD_PORT"])
        with m.tunnel(port, remote_host="127.0.0.1", local_port=0) as t:
            with socket.create_connection(("127.0.0.1", t.local_port), timeout=10) as s:
                s.settimeout(10)
                seen["tunnel_banner"] = s.recv(8).decode("ascii", "replace")
        m.run(f"rm -rf {remote.split('/')[0]}", quiet=True)
    finally:
        m.close()
    seen["asked"] = sorted(set(asked))
    return seen


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
