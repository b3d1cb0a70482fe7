"""The house rules of the package layout (issue 15): one home for errors, a typed machine."""

from __future__ import annotations

import importlib
import pkgutil

import gpumagic
from gpumagic import errors


def _modules():
    for info in pkgutil.walk_packages(gpumagic.__path__, "gpumagic."):
        if ".programs" in info.name or info.name.endswith("__main__"):
            continue  # machine-side programs, and the command line's entry point
        yield importlib.import_module(info.name)


def test_every_gpumagic_error_is_defined_in_errors_py():
    # Defined elsewhere, an error class is found only by reading that module; the old names
    # stay importable from where they were (re-exported), and are the same classes.
    elsewhere = []
    for mod in _modules():
        for name, obj in vars(mod).items():
            if isinstance(obj, type) and issubclass(obj, errors.GpumagicError):
                if obj.__module__ != "gpumagic.errors" and not name.startswith("_"):
                    elsewhere.append(f"{obj.__module__}.{name}")
                elif obj.__module__ == "gpumagic.errors":
                    assert getattr(errors, name, None) is obj or name != obj.__name__
    assert elsewhere == []


def test_the_moved_errors_keep_their_old_homes():
    from gpumagic import keys
    from gpumagic.budget import ledger, notify, prices
    from gpumagic.remote import kernel

    assert ledger.LedgerError is errors.LedgerError
    assert prices.BudgetError is errors.BudgetError
    assert notify.NotifyError is errors.NotifyError
    assert kernel.RemoteKernelError is errors.RemoteKernelError
    assert kernel.KernelConnectionLost is errors.KernelConnectionLost
    assert keys.KeyExists is errors.KeyExists and keys.HostExists is errors.HostExists


def test_capability_modules_ask_the_machine_not_its_sandbox():
    # The sandbox is a Machine subclass that overrides what differs (shutdown_plan,
    # scratch_dir, is_this_computer); no capability module looks for its sandbox object.
    import re
    from pathlib import Path

    from gpumagic.machine import Machine, SandboxMachine

    assert SandboxMachine.is_this_computer and not Machine.is_this_computer
    root = Path(gpumagic.__file__).parent
    leaks = [str(p.relative_to(root)) for p in root.rglob("*.py")
             if p.name not in ("machine.py", "fleet.py") and "notebook" not in p.parts
             and re.search(r"getattr\(\w*machine\w*, \"sandbox\"|\bmachine\.sandbox\b", p.read_text(encoding="utf-8"))]
    assert leaks == []


def test_machine_like_names_what_the_capability_modules_use():
    # The Protocol's members exist on Machine (mypy checks the signatures: tool.mypy files).
    from gpumagic._types import MachineLike
    from gpumagic.machine import Machine

    members = {n for n in [*vars(MachineLike), *MachineLike.__annotations__] if not n.startswith("_")}
    assert {"run", "exec", "name", "connection", "shutdown_plan", "is_this_computer"} <= members
    for n in members:
        if n in MachineLike.__annotations__:
            continue  # instance attributes, set in Machine.__init__
        assert hasattr(Machine, n), n


def test_the_docs_layout_names_every_module_and_folder():
    # The docs' layout page (docs/how-it-works/layout.md, linked from the README) is how a
    # newcomer finds each idea: a module or folder added, moved or renamed must show there.
    import re
    from pathlib import Path

    root = Path(gpumagic.__file__).parent
    page = (root.parent / "docs" / "how-it-works" / "layout.md").read_text(encoding="utf-8")
    layout = page.split("# Layout", 1)[1].split("```")[1]
    words = set(re.findall(r"[\w.-]+/?", layout))
    missing = [str(p.relative_to(root)) for p in sorted(root.rglob("*"))
               if "programs" not in p.parts[len(root.parts):-1] and "recordings" not in p.parts
               and "__pycache__" not in p.parts and p.name != "__init__.py" and p.suffix != ".pyc"
               and (p.name + "/" if p.is_dir() else p.stem if p.suffix == ".py" else p.name) not in words]
    assert missing == []


def test_the_ssh_config_reader_has_a_handler_for_every_keyword_kind():
    # readconf.c's switch is a table from keyword kind to a handler (issue 25): a kind added to
    # KEYWORDS without its handler would otherwise fail only when a config uses that keyword.
    from gpumagic.ssh.config import KEYWORDS, _Reader

    assert {kind for kind, _attr in KEYWORDS.values()} <= set(_Reader.HANDLERS)


def test_no_function_is_over_150_lines_or_13_parameters():
    # issue 25: a long signature is an option object waiting (JobOptions, SyncOptions), and a
    # function past 150 lines is several named steps in one
    import ast
    from pathlib import Path

    over = []
    for path in Path(gpumagic.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                params = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
                lines = node.end_lineno - node.lineno + 1
                if lines > 150 or params > 13:
                    over.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines, {params} parameters)")
    assert over == []


# -- the test suite's own time budget (issue 42) ---------------------------------------------

#: Most tests that may take over 60 s.  Raising it is a decision to say in the commit: each
#: such test lengthens the critical path of every CI run.
MOST_SLOW_TESTS = 12


def _slow_marks() -> dict[str, float]:
    """``{"tests/FILE.py::FUNCTION": ceiling}`` of every ``@pytest.mark.slow(CEILING, ...)`` in tests/."""
    import ast
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    found = {}
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef):
                continue
            for d in node.decorator_list:
                if (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "slow"
                        and ast.unparse(d.func.value) == "pytest.mark"):
                    assert d.args and isinstance(d.args[0], ast.Constant), f"{path.name}::{node.name}: slow(CEILING, reason=...)"
                    assert [k.arg for k in d.keywords] == ["reason"], f"{path.name}::{node.name}: slow(CEILING, reason=...)"
                    found[f"tests/{path.name}::{node.name}"] = float(d.args[0].value)
    return found


def _slow_budget() -> dict[str, float]:
    from pathlib import Path

    listed = {}
    for line in (Path(__file__).resolve().parent / "slow-budget.txt").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            test, ceiling, reason = line.split(None, 2)
            assert reason.strip(), line
            listed[test] = float(ceiling)
    return listed


def test_every_slow_test_is_marked_and_listed_with_the_same_ceiling_and_the_list_has_a_cap():
    marks, listed = _slow_marks(), _slow_budget()
    assert marks == listed
    assert len(listed) <= MOST_SLOW_TESTS, sorted(listed)
    assert all(60 < c <= 900 for c in listed.values()), listed  # over the 60 s limit, under any timeout
