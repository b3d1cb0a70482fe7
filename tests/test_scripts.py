"""The set-up scripts (issue 31, item 10): the quickstart installs only what the main job needs
(the sandbox's sshd, ssh, rsync, tmux, a venv, and the package with its [tutorials] extra); the
tools only the tests use stay with scripts/test.sh.  Read off what scripts/_packages.sh asks for
on a machine that has none of them (an empty PATH, as a plain user: it prints the list).  What
the [tutorials] extra must hold is read off the tutorials themselves: every module a tutorial
imports, here or on the sandbox machine."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEST_ONLY = {"git", "curl", "fish", "tcsh", "zsh", "shellcheck", "fuse3", "chromium"}


def missing(for_: str, tmp_path) -> set[str]:
    empty = tmp_path / "bin"
    empty.mkdir(exist_ok=True)
    (empty / "id").write_text("#!/bin/sh\necho 1000\n", encoding="utf-8")  # a plain user
    (empty / "id").chmod(0o755)
    r = subprocess.run(["/bin/bash", "-c", f"source {ROOT}/scripts/_packages.sh"], capture_output=True,
                       text=True, encoding="utf-8", env={"PATH": str(empty), "GPUMAGIC_FOR": for_})
    assert r.returncode == 1, r.stderr
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("gpumagic: missing "))
    return set(line.removeprefix("gpumagic: missing ").split(";")[0].split())


def test_quickstart_asks_only_for_what_the_main_job_needs(tmp_path):
    got = missing("main", tmp_path)
    assert {"openssh-client", "rsync", "tmux", "python3", "python3-venv"} <= got
    assert not got & TEST_ONLY, got & TEST_ONLY


def test_tests_ask_for_their_own_tools_too(tmp_path):
    got = missing("test", tmp_path)
    assert {"openssh-client", "rsync", "tmux", "git", "curl"} <= got


# -- what the tutorials import ------------------------------------------------------------------

#: Imports a tutorial may make that the README's set-up does not provide, and where that is said.
NOT_PROVIDED = {"torch": "tutorial 08 needs PyTorch"}


def _requirements(extra: str | None) -> set[str]:
    """The distribution names pyproject.toml lists: the dependencies, or an extra's."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    if extra is None:
        block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    else:
        block = re.search(rf"^{extra} = \[(.*?)\]$", text, re.S | re.M).group(1)
    return {_norm(re.split(r"[<>=!~\[ ;]", name, maxsplit=1)[0]) for name in re.findall(r'"([^"]+)"', block)}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imports(source: str) -> set[str]:
    """Top-level modules a cell's Python imports, unless inside a try that catches ImportError
    (the tutorial says what it does without it).  Magics and shell lines are dropped; a cell that
    is not Python then (a %%remote shell cell) imports nothing."""
    lines = [ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!"))]
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return set()
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                h.type is None or "ImportError" in ast.unparse(h.type) or "ModuleNotFoundError" in ast.unparse(h.type)
                for h in node.handlers):
            guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_quickstart_provides_every_module_the_tutorials_import():
    """Tutorial 05 failed after the README's set-up ('No module named tensorboard' on the
    machine), 07 (numpy there), 09 (matplotlib here): the quickstart installed only [notebook]."""
    provided = _requirements(None) | _requirements("tutorials")
    by_module = importlib.metadata.packages_distributions()
    stdlib = set(sys.stdlib_module_names)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    setup_page = " ".join((ROOT / "docs" / "guide" / "setup.md").read_text(encoding="utf-8").split())
    wanted: dict[str, set[str]] = {}
    notebooks = sorted((ROOT / "example-notebooks").glob("**/*.ipynb"))
    assert len(notebooks) >= 22
    for path in notebooks:
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] == "code":
                for module in _imports("".join(cell["source"])):
                    wanted.setdefault(module, set()).add(path.name)
    assert {"numpy", "matplotlib", "tensorboard", "pandas"} <= set(wanted)  # the check sees them
    missing = {}
    for module, where in sorted(wanted.items()):
        if module in stdlib or module in ("gpumagic", "IPython"):
            continue
        if module in NOT_PROVIDED:
            assert NOT_PROVIDED[module] in readme, module
            assert NOT_PROVIDED[module] in setup_page, module
            continue
        dists = {_norm(d) for d in by_module.get(module, [module])}
        if not dists & provided:
            missing[module] = sorted(where)
    assert not missing, f"imported by a tutorial, not in the [tutorials] extra: {missing}"
    assert "GPUMAGIC_FOR=main" in (ROOT / "scripts" / "quickstart.sh").read_text(encoding="utf-8")
    assert "extra=tutorials" in (ROOT / "scripts" / "_setup.sh").read_text(encoding="utf-8")
