"""Each tutorial in ``example-notebooks/`` executed once per test run, for every test that reads
its outputs (``executed[name]``), whichever pytest-xdist worker asks first.

A tutorial is run with nbclient (:func:`gpumagic.__main__.run_notebook`) from a copy of the
folder (``.src``: tutorials write there, e.g. 08's ``results/``), in a data directory of its
own (``GPUMAGIC_DATA_DIR`` and ``XDG_DATA_HOME``: its own sandbox, ledger and jobs, so what
another tutorial left never changes what this one shows, as for a student who opens only
this one).  The executed copy is kept in a folder shared by the run's workers (the parent of
each worker's base temp), behind a file lock per tutorial: the first worker to ask runs it,
the others wait and read the file.  A run that failed is not kept; the next ask runs it again
and fails the same way, with nbclient's message.

Tutorial 12 rents a machine from RunPod: it runs against the RunPod stand-in of
tests/providers/ (:func:`stand_in`), which its login cell reaches through the environment
variables every real user may set too (``GPUMAGIC_RUNPOD_API_KEY``, ``GPUMAGIC_RUNPOD_BASE_URL``...),
so the notebook is run as it is saved.  What the stand-in saw is kept beside the executed copy
(:data:`STAND_IN`) for the tests to read: every request and answer checked against RunPod's
published documents, the pods, and each stop with the kind of key that sent it.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import shutil
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import nbformat
from filelock import FileLock

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "example-notebooks"
ENGLISH = sorted(NOTEBOOKS.glob("*.ipynb"))
CHINESE = sorted((NOTEBOOKS / "zh-CN").glob("*.ipynb"))
ALL = [str(p.relative_to(NOTEBOOKS)) for p in ENGLISH + CHINESE]
#: Seconds one cell may run (nbclient's timeout).
CELL_TIMEOUT = 300
#: The tutorial that rents a machine (run against the RunPod stand-in), and the file beside
#: its executed copy that says what the stand-in saw.
RENT_TUTORIAL = "12-rent-a-machine.ipynb"
STAND_IN = "stand-in.json"


def runnable() -> list[str]:
    """The tutorials this Python can run: 08 runs torchrun, which needs torch here
    (``GPUMAGIC_TEST_TORCH=1`` installs it)."""
    import importlib.util

    torch = importlib.util.find_spec("torch") is not None
    return [n for n in ALL if torch or not n.endswith("08-several-gpus.ipynb")]


def shared_base(tmp_path_factory) -> Path:
    """A folder every xdist worker of this run sees (the workers' base temps share a parent)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


class Executed(Mapping):
    """``{tutorial path relative to example-notebooks: executed notebook}``, each run on first
    use.  ``src`` is the folder the copies ran in."""

    def __init__(self, base: Path, names: list[str] | None = None):
        self.base = base
        self.names = list(ALL if names is None else names)
        self.src = base / "src"
        self._read: dict[str, nbformat.NotebookNode] = {}

    def __getitem__(self, name: str) -> nbformat.NotebookNode:
        if name not in self.names:
            raise KeyError(name)
        if name not in self._read:
            self._read[name] = nbformat.read(self.path(name), as_version=4)
        return self._read[name]

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def data(self, name: str) -> Path:
        """The data directory ``name`` ran with (its ``GPUMAGIC_DATA_DIR`` is ``gpumagic``
        there, its ``XDG_DATA_HOME`` ``xdg``)."""
        return self.base / "data" / name.replace("/", "--")

    def sandbox_home(self, name: str) -> Path:
        """The ``$HOME`` of the sandbox that ``name`` ran against (where its jobs, sessions and
        settings on the machine are); :func:`gpumagic.ssh.sandbox.sandbox_home` under its data."""
        return self.data(name) / "xdg" / "gpumagic" / "sandbox-home"

    def path(self, name: str) -> Path:
        """The executed copy of ``name``, run now unless a worker ran it already."""
        safe = name.replace("/", "--")
        out = self.base / "out" / safe
        done = out / "done"
        (self.base / "locks").mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.base / "locks" / (safe + ".lock"))):
            if not done.exists():
                self._copy_sources()
                shutil.rmtree(out, ignore_errors=True)
                executed = _run(self.src / name, out, self.data(name))
                done.write_text(str(executed), encoding="utf-8")
            return Path(done.read_text(encoding="utf-8"))

    def _copy_sources(self) -> None:
        with FileLock(str(self.base / "locks" / "src.lock")):
            if not (self.src / ".copied").exists():
                shutil.rmtree(self.src, ignore_errors=True)
                shutil.copytree(NOTEBOOKS, self.src, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "results"))
                (self.src / ".copied").touch()


def _run(notebook: Path, out: Path, data: Path) -> Path:
    from gpumagic.__main__ import run_notebook

    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "GPUMAGIC_DATA_DIR": str(data / "gpumagic"), "XDG_DATA_HOME": str(data / "xdg")}
    with contextlib.ExitStack() as stack:
        if notebook.name == RENT_TUTORIAL:
            env.update(stack.enter_context(stand_in(data, out / STAND_IN)))
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return Path(run_notebook(notebook, out, timeout=CELL_TIMEOUT))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            remove_tutorial_jobs(data / "xdg")


@contextlib.contextmanager
def stand_in(data: Path, record: Path) -> Iterator[dict[str, str]]:
    """The RunPod stand-in (tests/providers/platforms.py) for a run of tutorial 12: yields the
    environment its kernel needs, and at the end writes ``record`` (JSON: ``violations`` and
    ``undocumented`` answers of the checked documents, ``pods`` as ``{id: desiredStatus}``,
    ``stops`` as ``[pod id, "stop"|"release", "instance"|"account"]``, ``requests`` as
    ``[method, path]``) and stops it and its machines.

    The kernel gets a home of its own (``data/home``: the SSH key the tutorial makes, and
    its known hosts, stay there) and no keychain (``PYTHON_KEYRING_BACKEND``: the key goes to
    the 0600 file in its data dir, never this user's keychain).  Its machines' sshd runs as
    this user, so the SSH user is this user's name, not RunPod's ``root``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "providers"))
    from platforms import RunPodServer

    server = RunPodServer(data / "runpod")
    (data / "home").mkdir(parents=True, exist_ok=True)
    try:
        yield {"HOME": str(data / "home"), "PYTHON_KEYRING_BACKEND": "keyring.backends.null.Keyring",
               "GPUMAGIC_RUNPOD_API_KEY": sorted(server.keys)[0], "GPUMAGIC_RUNPOD_BASE_URL": server.rest_url,
               "GPUMAGIC_RUNPOD_CATALOG_URL": server.url, "GPUMAGIC_RUNPOD_USER": getpass.getuser()}
    finally:
        server.close()
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({
            "violations": server.violations, "undocumented": server.undocumented,
            "pods": {pid: pod["desiredStatus"] for pid, pod in server.pods.items()},
            "stops": server.stops, "requests": server.requests}, indent=1), encoding="utf-8")


def remove_tutorial_jobs(xdg_data: Path | None = None):
    """Notebook 04's and 09's jobs (``tutorial-*``): ended and removed, a pending shutdown
    cancelled, as tests/test_jobs.py does after running it; in this user's home and in the
    sandbox homes under ``xdg_data`` (a tutorial's own ``XDG_DATA_HOME``)."""
    import pwd
    import subprocess

    from gpumagic.remote import program

    homes = [Path(pwd.getpwuid(os.getuid()).pw_dir)]
    if xdg_data is not None:
        homes += sorted((xdg_data / "gpumagic").glob("sandbox-home*"))
    for d in homes:
        for job in (d / ".gpumagic" / "jobs").glob("tutorial-*"):
            env = dict(os.environ, HOME=str(d))
            subprocess.run(["/bin/sh", "-c", program.command("job-cancel-shutdown.sh", job.name)],
                           capture_output=True, env=env)
            if (job / "kill.sh").exists():
                subprocess.run(["/bin/sh", "./kill.sh", "cleanup"], cwd=job, capture_output=True, env=env)
            shutil.rmtree(job, ignore_errors=True)
