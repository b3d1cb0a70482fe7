"""The Binder environment, built the way repo2docker builds it from ``binder/``, runs every
tutorial as a plain user (issue 17, "Binder").

repo2docker's steps for a ``binder/`` folder with ``runtime.txt``, ``apt.txt`` and
``requirements.txt``: the Python that ``runtime.txt`` names (``python-3.10``), the Debian
packages of ``apt.txt``, then, as the notebook user (Binder's ``jovyan``) in the repository's
copy, ``pip install -r binder/requirements.txt`` (whose ``.[tutorials]`` installs this repository).
Here: a fresh venv of that Python, the same pip command in a copy of this working tree, and each
tutorial run with nbclient (``python -m gpumagic run-notebook``) by a plain user: as root, a
throwaway user made for the test; otherwise, yourself. The apt packages cannot be installed
into a venv, so their test checks they are installed here and skips with the install line.

Slow (minutes: pip downloads the requirements into an empty cache), so it runs only with
``GPUMAGIC_TEST_BINDER=1`` (``.ci/run`` sets it).
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import nbformat
import pytest
import tutorials
from filelock import FileLock

ROOT = Path(__file__).resolve().parent.parent
BINDER = ROOT / "binder"
ENABLE = "GPUMAGIC_TEST_BINDER"
IS_ROOT = os.geteuid() == 0

NOTEBOOKS = ROOT / "example-notebooks"
TUTORIALS = [str(p.relative_to(NOTEBOOKS)) for p in
             sorted(NOTEBOOKS.glob("*.ipynb")) + sorted((NOTEBOOKS / "zh-CN").glob("*.ipynb"))]


def runtime_version() -> str:
    """``binder/runtime.txt``'s Python version: ``python-3.10`` -> ``"3.10"`` (repo2docker's
    format, ``python-X.Y``)."""
    text = (BINDER / "runtime.txt").read_text(encoding="utf-8").strip()
    m = re.fullmatch(r"python-(\d+\.\d+)", text)
    assert m, f"binder/runtime.txt says {text!r}; repo2docker reads python-X.Y"
    return m.group(1)


def apt_packages() -> list[str]:
    return [line.split("#")[0].strip() for line in (BINDER / "apt.txt").read_text(encoding="utf-8").splitlines()
            if line.split("#")[0].strip()]


def test_runtime_txt_names_python_3_10():
    assert runtime_version() == "3.10"


def test_apt_txt_packages_are_installed():
    # What Binder's image gets from apt.txt; a venv cannot install them, so here they must be
    # on the machine already (scripts/_setup.sh installs them as root).
    missing = [p for p in apt_packages()
               if subprocess.run(["dpkg-query", "-W", "-f=${Status}", p], capture_output=True,
                                 text=True, encoding="utf-8").stdout != "install ok installed"]
    if missing:
        pytest.skip(f"binder/apt.txt packages not installed here: sudo apt-get install {' '.join(missing)}")


def test_requirements_install_this_repository_and_what_the_tutorials_import():
    reqs = [line.split("#")[0].strip() for line in (BINDER / "requirements.txt").read_text(encoding="utf-8").splitlines()]
    # the repository itself with what the tutorials import (the quickstart's extra: the README's
    # set-up and Binder's are one), and the proxy that opens TensorBoard in Binder's JupyterLab
    assert reqs[:2] == [".[tutorials]", "jupyter-server-proxy"], reqs


@pytest.mark.parametrize("readme, labpath", [("README.md", "example-notebooks"),
                                             ("README.zh-CN.md", "example-notebooks/zh-CN")])
def test_readme_binder_badge_opens_the_tutorials(readme, labpath):
    # pyproject's [project.urls] Repository (a regex: tomllib is Python 3.11+)
    slug = re.search(r'^Repository = "https://github\.com/([\w.-]+/[\w.-]+)"$',
                     (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.M).group(1)
    text = (ROOT / readme).read_text(encoding="utf-8")
    badges = re.findall(r"\[!\[Binder\]\((https://mybinder\.org/badge_logo\.svg)\)\]\((\S+?)\)", text)
    # Binder's URL scheme: /v2/gh/OWNER/REPO/REF, and ?labpath= opens that path in JupyterLab
    assert badges == [("https://mybinder.org/badge_logo.svg",
                       f"https://mybinder.org/v2/gh/{slug}/HEAD?labpath={labpath}")]
    assert any((ROOT / labpath).glob("*.ipynb"))


# -- the Python of runtime.txt ------------------------------------------------------------------


def _version_of(python: str) -> str | None:
    try:
        r = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                           capture_output=True, text=True, timeout=60, encoding="utf-8")
    except OSError:
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def find_python(version: str) -> tuple[str | None, list[str]]:
    """A Python ``version`` interpreter: ``GPUMAGIC_BINDER_PYTHON``, ``pythonX.Y`` on PATH, pyenv's
    versions, /usr/bin, /usr/local/bin. Returns (path or None, the places looked at)."""
    home = pwd.getpwuid(os.getuid()).pw_dir  # HOME is the suite's temp HOME
    pyenv = os.environ.get("PYENV_ROOT") or os.path.join(home, ".pyenv")
    candidates = [os.environ.get("GPUMAGIC_BINDER_PYTHON"), shutil.which(f"python{version}"),
                  *sorted(glob.glob(os.path.join(pyenv, "versions", f"{version}.*", "bin", f"python{version}")),
                          reverse=True),
                  f"/usr/local/bin/python{version}", f"/usr/bin/python{version}"]
    looked = [c for c in candidates if c]
    for c in looked:
        if os.path.exists(c) and _version_of(c) == version:
            return str(Path(c).resolve()), looked
    return None, looked


def _relocated_python(python: str, dest: Path) -> str:
    """A copy of ``python``'s installation under ``dest``, readable by any user (pyenv's lies in
    root's private home). Its executable's RUNPATH (pyenv's absolute ``PREFIX/lib``, where
    libpython is) is rewritten in place to ``$ORIGIN/../lib``, as patchelf does for a shorter path."""
    prefix = subprocess.run([python, "-c", "import sys; print(sys.base_prefix)"], capture_output=True,
                            text=True, check=True, encoding="utf-8").stdout.strip()
    shutil.copytree(prefix, dest, symlinks=True,
                    ignore=shutil.ignore_patterns("site-packages", "test", "__pycache__", "idlelib", "tkinter"))
    exe = dest / "bin" / Path(python).name
    data = exe.read_bytes()
    old = f"{prefix}/lib".encode() + b"\0"
    new = b"$ORIGIN/../lib"
    if data.count(old) == 1 and len(new) < len(old):
        exe.write_bytes(data.replace(old, new + b"\0" * (len(old) - len(new))))
    for d, dirs, _ in os.walk(dest):
        os.chmod(d, 0o755)
    return str(exe)


# -- the plain user -----------------------------------------------------------------------------


class PlainUser:
    """Who runs the build and the notebooks: as root, a throwaway user whose home is ``home``
    (``name``: one made already); otherwise this user, with HOME set to ``home``."""

    def __init__(self, home: Path, name: str | None = None):
        self.home = home
        if IS_ROOT:
            if name is None:
                name = "gmbinder" + secrets.token_hex(3)
                subprocess.run(["useradd", "--no-create-home", "--home-dir", str(home), "--shell", "/bin/sh",
                                "--user-group", name], check=True, capture_output=True)
            self.name = name
            self.uid = pwd.getpwnam(self.name).pw_uid
        else:
            self.name, self.uid = pwd.getpwuid(os.getuid()).pw_name, os.getuid()

    def env(self, path: str, **extra: str) -> dict[str, str]:
        """A clean environment, like a Binder container's: the pip settings of this machine kept."""
        env = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
        env.update(HOME=str(self.home), USER=self.name, LOGNAME=self.name, LANG="C.UTF-8",
                   PATH=f"{path}:/usr/local/bin:/usr/bin:/bin", **extra)
        return env

    def run(self, argv: list[str], env: dict[str, str], **kwargs) -> subprocess.CompletedProcess:
        prefix = ["runuser", "-u", self.name, "--"] if IS_ROOT else []
        # env -i: exactly this environment, whoever runs it
        return subprocess.run([*prefix, "env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv],
                              capture_output=True, text=True, encoding="utf-8", **kwargs)

    def processes(self) -> list[int]:
        r = subprocess.run(["pgrep", "-u", str(self.uid)], capture_output=True, text=True, encoding="utf-8")
        return [int(p) for p in r.stdout.split()]

    def remove(self) -> None:
        if IS_ROOT:
            for pid in self.processes():  # only ever the throwaway user's: the test's own
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 30  # userdel refuses while the user has processes
            while self.processes() and time.monotonic() < deadline:
                time.sleep(0.2)
            r = subprocess.run(["userdel", self.name], capture_output=True, text=True, encoding="utf-8")
            assert r.returncode == 0, f"userdel {self.name}: {r.stderr.strip()}"


def _build(base: Path, python: str, timings: dict) -> tuple[PlainUser, str, Path]:
    """The Binder environment in ``base`` (its home, a copy of this repository, the venv)."""
    home = base / "home"
    home.mkdir()
    user = PlainUser(home)
    (base / "made.json").write_text(json.dumps({"user": user.name if IS_ROOT else None}), encoding="utf-8")
    if IS_ROOT and user.run([python, "-c", "pass"], user.env("/usr/bin")).returncode != 0:
        started = time.monotonic()
        python = _relocated_python(python, base / "python")
        timings["copy python"] = time.monotonic() - started
    # repo2docker copies the repository into the image (REPO_DIR, the user's home)
    repo = home / "gpumagic"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True, encoding="utf-8").stdout.split("\0")
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, repo / f)
    if IS_ROOT:
        subprocess.run(["chown", "-R", f"{user.name}:{user.name}", str(home)], check=True)
    venv = home / "venv"
    env = user.env(str(venv / "bin"))
    started = time.monotonic()
    r = user.run([python, "-m", "venv", str(venv)], env, cwd=repo)
    assert r.returncode == 0, r.stderr
    r = user.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-r", "binder/requirements.txt"],
                 env, cwd=repo, timeout=1800)
    timings["pip install -r binder/requirements.txt"] = time.monotonic() - started
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return user, str(venv / "bin" / "python"), repo


@pytest.fixture(scope="session")
def binder_env(tmp_path_factory):
    """(user, venv python, the repository copy, timings): the Binder environment, built once per
    test run by the first pytest-xdist worker that asks (a file lock; the others wait and use
    it), so the tutorials run in it on several workers at once.  The throwaway user and the
    folder go when the run ends (:func:`remove_made`, from tests/conftest.py)."""
    if os.environ.get(ENABLE) != "1":
        pytest.skip(f"building the Binder environment takes minutes: run it with {ENABLE}=1 (.ci/run sets it)")
    version = runtime_version()
    python, looked = find_python(version)
    if python is None:
        pytest.skip(f"binder/runtime.txt asks for Python {version} and none is here (looked at "
                    f"{', '.join(looked)}): install one (pyenv install {version}) or set GPUMAGIC_BINDER_PYTHON")
    shared = tutorials.shared_base(tmp_path_factory) / "binder"
    shared.mkdir(exist_ok=True)
    built = shared / "built.json"
    with FileLock(str(shared / "lock")):
        if not built.exists():
            base = Path(tempfile.mkdtemp(prefix="gpumagic-binder-", dir="/tmp"))
            os.chmod(base, 0o755)
            (shared / "base").write_text(str(base), encoding="utf-8")  # for remove_made, whatever happens
            timings: dict = {}
            try:
                user, python, repo = _build(base, python, timings)
                record = {"user": user.name, "home": str(user.home), "python": python, "repo": str(repo),
                          "timings": timings}
            except BaseException as e:
                record = {"error": f"{type(e).__name__}: {e}"[-4000:]}
                built.write_text(json.dumps(record), encoding="utf-8")
                raise
            built.write_text(json.dumps(record), encoding="utf-8")
    record = json.loads(built.read_text(encoding="utf-8"))
    if "error" in record:
        pytest.fail(f"building the Binder environment failed on another worker: {record['error']}")
    user = PlainUser(Path(record["home"]), record["user"])
    return user, record["python"], Path(record["repo"]), record["timings"]


def remove_made(shared_base: Path) -> None:
    """Remove the throwaway user and the folder that :func:`binder_env` made in this test run
    (called once every worker is done)."""
    shared = shared_base / "binder"
    try:
        base = Path((shared / "base").read_text(encoding="utf-8"))
    except OSError:
        return
    try:
        made = json.loads((base / "made.json").read_text(encoding="utf-8"))
        if made.get("user"):
            PlainUser(base / "home", made["user"]).remove()
    except (OSError, ValueError, KeyError):
        pass
    finally:
        shutil.rmtree(base, ignore_errors=True)
        (shared / "base").unlink(missing_ok=True)


#: Building the environment (pip downloads into an empty cache) counts in the first test's time.
BUILD_TIMEOUT = 2400


@pytest.mark.timeout(BUILD_TIMEOUT)
def test_binder_environment_has_the_runtime_python(binder_env):
    user, python, repo, timings = binder_env
    r = user.run([python, "-c", "import sys, gpumagic, tensorboard, jupyter_server_proxy, nbclient; "
                  "print('%d.%d' % sys.version_info[:2]); print(gpumagic.__file__)"],
                 user.env(str(Path(python).parent)), cwd="/")
    assert r.returncode == 0, r.stderr
    version, where = r.stdout.split()
    assert version == runtime_version()
    assert "site-packages" in where  # installed by requirements.txt, not imported from a checkout
    print("binder build:", {k: f"{v:.0f} s" for k, v in timings.items()})


@pytest.mark.timeout(BUILD_TIMEOUT + 900)
@pytest.mark.parametrize("name", TUTORIALS)
@pytest.mark.slow(300, reason="one tutorial in the Binder environment: a kernel and a sandbox of its own")
def test_tutorial_runs_in_the_binder_environment_as_a_plain_user(binder_env, name):
    user, python, repo, _ = binder_env
    env = user.env(str(Path(python).parent))
    if name.endswith("08-several-gpus.ipynb") and user.run([python, "-c", "import torch"], env).returncode:
        pytest.skip("tutorial 08 runs torchrun and binder/requirements.txt has no torch "
                    "(on Binder, pip's default torch is a CUDA build of several GB)")
    if name.endswith("12-rent-a-machine.ipynb"):
        pytest.skip("tutorial 12 rents from RunPod: its stand-in's machines are sshd servers that log in only "
                    "this test's own user, not Binder's plain user; tests/test_notebook_outputs.py runs it "
                    "against the stand-in")
    # Tutorials run on several workers at once: each from a copy in a folder of its own, with a
    # data dir of its own (its own sandbox, as a student who opens only this one has)
    safe = name.replace("/", "--").removesuffix(".ipynb")
    run_dir = user.home / "runs" / safe
    user.run(["mkdir", "-p", str(run_dir)], env, check=True)
    user.run(["cp", str(repo / "example-notebooks" / name), str(run_dir)], env, check=True)
    notebook = run_dir / Path(name).name
    out = user.home / "executed" / Path(name).parent
    env = dict(env, XDG_DATA_HOME=str(user.home / "data" / safe))
    r = user.run([python, "-m", "gpumagic", "run-notebook", str(notebook), "--output-dir", str(out)],
                 env, cwd=run_dir, timeout=840)
    executed = out / Path(name).name
    errors = []
    if executed.exists():
        nb = nbformat.read(executed, as_version=4)
        errors = [(c.source.splitlines()[0], o.ename, o.evalue) for c in nb.cells if c.cell_type == "code"
                  for o in c.get("outputs", []) if o.output_type == "error"
                  and "raises-exception" not in c.metadata.get("tags", [])]
    assert r.returncode == 0, (r.stderr[-3000:], errors)
    assert errors == []
