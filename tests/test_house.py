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


#: The most public methods (properties counted) ``Machine`` may have: the verbs; every other
#: capability is an object on it (``m.env``, ``m.tunnels``, ``m.net``, ``m.budget``...).
MOST_MACHINE_METHODS = 20


def _public_methods(cls) -> list[str]:
    """The public functions and properties of ``cls`` and its gpumagic bases."""
    names = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        names |= {n for n, v in vars(klass).items()
                  if not n.startswith("_") and (callable(v) or isinstance(v, (property, staticmethod, classmethod)))}
    return sorted(names)


def test_machine_keeps_the_verbs_and_its_capabilities_are_objects_on_it():
    # issue 45 item 6: a flat facade of prefixed method groups (budget_*, proxy_*, net_*)
    # grows with every feature; a capability is one object with its own small class
    from gpumagic.budget import Budget
    from gpumagic.machine import Machine, SandboxMachine
    from gpumagic.net import Net
    from gpumagic.remote.environment import Environment
    from gpumagic.tunnel import TunnelManager

    for cls in (Machine, SandboxMachine):
        methods = _public_methods(cls)
        assert len(methods) <= MOST_MACHINE_METHODS, methods
        assert not [n for n in methods if n.startswith(("budget_", "proxy_", "net_", "mirrors"))], methods
    assert "is_connected" in _public_methods(Machine)  # a property counts
    m = gpumagic.connect("u@127.0.0.1:2222", lazy=True)  # never opened
    assert (type(m.env), type(m.net), type(m.budget), type(m.tunnels)) == (Environment, Net, Budget, TunnelManager)
    m.close()


#: Modules the magics reach only through ``Machine``/``Fleet`` and the objects on them (issue 45).
BEHIND_THE_MACHINE = ("gpumagic.remote.move", "gpumagic.budget.prices")


def test_the_magics_import_neither_the_move_package_nor_the_prices_module():
    graph = _import_graph()
    reached = [f"{name} -> {target} (line {line})" for name, targets in graph.items()
               if _layer(name) == _layer("gpumagic.notebook.magics")
               for target, line in targets.items()
               if any(target == b or target.startswith(b + ".") for b in BEHIND_THE_MACHINE)]
    assert reached == []


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


# -- arrows point down, no cycles, no module-level state (issue 45) --------------------------

#: The layers, lowest first: a module may import its own layer and those below, never one
#: above.  A module is in the layer of its longest listed prefix.  The package itself
#: (``gpumagic/__init__``: ``connect``, ``load_ipython_extension``) and the command line sit
#: on top.  Within a layer, imports go any way the cycle test allows.
LAYERS = (
    ("base", ("gpumagic.errors", "gpumagic._format", "gpumagic._fs", "gpumagic._options",
              "gpumagic._types", "gpumagic.localpath", "gpumagic.paths", "gpumagic._stored")),
    ("ssh", ("gpumagic.ssh",)),
    ("runner", ("gpumagic.remote", "gpumagic.remote.execution", "gpumagic.remote.program")),  # cells, programs
    ("capabilities", ("gpumagic.sync", "gpumagic.tunnel", "gpumagic.gpu", "gpumagic.net", "gpumagic.budget",
                      "gpumagic.remote.kernel", "gpumagic.rent")),
    ("jobs", ("gpumagic.remote.jobs", "gpumagic.remote.keep", "gpumagic.remote.move",
              "gpumagic.remote.distributed")),  # jobs keep their checkpoints with sync, guard with budget
    ("session", ("gpumagic.machine", "gpumagic.fleet", "gpumagic.wrapup", "gpumagic.keys",
                 "gpumagic.kernel_bridge.spec")),  # kernelspecs: files here, for the CLI and %gpu kernel install
    ("notebook", ("gpumagic.notebook",)),  # display, widgets, links, comms: no magics
    ("magics", ("gpumagic.notebook.magics",)),
    ("top", ("gpumagic", "gpumagic.__main__", "gpumagic.kernel_bridge")),  # the kernel bridge: a front end's kernel
)


def _module_files() -> dict[str, "object"]:
    """``{"gpumagic.x.y": Path}`` of every module of the package (machine-side programs left out)."""
    from pathlib import Path

    root = Path(gpumagic.__file__).parent
    found = {}
    for p in root.rglob("*.py"):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        if "programs" in parts or "fake" in parts:
            continue  # machine-side programs and the stand-in nvidia-smi: run on their own
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = p
    return found


def _imports(name: str, path, modules) -> dict[str, int]:
    """The package's modules ``name`` imports, each with a line: at the top and inside
    functions, absolute and relative (``from . import x`` names the module ``x``).  Imports
    under ``if TYPE_CHECKING:`` are for mypy only and not counted."""
    import ast

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}

    def visit(node) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test).endswith("TYPE_CHECKING"):
                for c in child.orelse:
                    visit(c)
            elif isinstance(child, ast.Import):
                for a in child.names:
                    if a.name.split(".")[0] == "gpumagic":
                        found.setdefault(a.name, child.lineno)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[:len(package.split(".")) - child.level + 1]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                if mod.split(".")[0] != "gpumagic":
                    continue
                for a in child.names:
                    target = f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod
                    found.setdefault(target, child.lineno)
            else:
                visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    found.pop(name, None)
    return found


def _import_graph() -> dict[str, dict[str, int]]:
    modules = _module_files()
    return {name: {t: n for t, n in _imports(name, path, modules).items() if t in modules}
            for name, path in modules.items()}


def _layer(module: str) -> int:
    best, level = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, level = len(p), i
    return level


def test_every_module_has_a_layer():
    assert [m for m in _module_files() if _layer(m) < 0] == []


def test_imports_point_down_the_layers():
    # Formatting lives below the notebook, gpumagic's folders in paths.py, the notebook's
    # output is handed in by the magics (imports inside functions are counted).
    up = []
    for name, targets in _import_graph().items():
        for target, line in targets.items():
            if _layer(target) > _layer(name):
                up.append(f"{name}:{line} -> {target} ({LAYERS[_layer(name)][0]} -> {LAYERS[_layer(target)][0]})")
    assert sorted(up) == []


def test_no_import_cycles():
    # Tarjan's strongly connected components of the module graph: each of more than one
    # module is a cycle (imports inside functions counted).
    graph = _import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    assert cycles == []


#: Module-level values that are mutable and stay, each with why.  Everything else that holds
#: state lives on an object: per connection on the Connection, per notebook on GpuMagics'
#: state (issue 45).
STATE_ALLOWED = {
    "gpumagic.tunnel.forward._buffers": "each thread's scratch buffer for the channel copy: holds no state",
    "gpumagic.sync.agent._SERIAL": "the machine-side program's process: the next part-file token",
    "gpumagic.sync.agent._ACTIVE": "the part files this process writes now, which no other sync may take over",
    "gpumagic.ssh.config.KEYWORDS": "readconf.c's keyword table, filled once at import by _kw",
    # left to their owners (issue 45): remote/move.py is being split by job (item 4)
    "gpumagic.remote.move.store.lock": "one writer at a time of the start records (a process-wide lock)",
    "gpumagic.remote.move.standby._moving": "one move at a time in this process (a process-wide lock)",
}

#: Calls that make a mutable object (the literals ``{}``, ``[]``, ``{x}`` and comprehensions are too).
MUTABLE_CALLS = frozenset({
    "dict", "list", "set", "bytearray", "defaultdict", "OrderedDict", "Counter", "deque", "WeakKeyDictionary",
    "WeakValueDictionary", "WeakSet", "ContextVar", "local", "Lock", "RLock", "Condition", "Event", "Semaphore",
    "Queue", "count"})
#: Methods that change a dict, list or set in place.
MUTATORS = frozenset({
    "add", "append", "clear", "discard", "extend", "insert", "pop", "popitem", "remove", "setdefault",
    "update", "difference_update", "intersection_update", "symmetric_difference_update", "sort", "reverse"})


def _mutable(value) -> bool:
    import ast

    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    return isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] in MUTABLE_CALLS


def _changed_names(trees) -> set[str]:
    """Names (``X`` or ``mod.X``) of which some module changes the contents: ``X[k] = v``,
    ``del X[k]``, ``X += ...``, ``X.add(...)``..., or rebinds with ``global X``."""
    import ast

    def name(node) -> str | None:
        return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None

    changed: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
                changed.add(name(node.value) or "")
            elif isinstance(node, ast.AugAssign):
                changed.add(name(node.target) or "")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                changed.add(name(node.func.value) or "")
            elif isinstance(node, ast.Global):
                changed.update(node.names)
    return changed


def test_no_module_level_mutable_state():
    # A registry at module level outlives the notebook that filled it, is shared by every
    # connection, and needs a reset hook in tests.  A table is a constant: an ALL_CAPS name
    # that no module changes (a tuple, a frozenset, or a dict/set literal never written to).
    import ast

    trees = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in _module_files().items()}
    changed = _changed_names(trees.values())
    found, allowed = [], set()
    for name, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            for t in targets:
                if not isinstance(t, ast.Name) or t.id == "__all__" or not _mutable(value):
                    continue
                constant = t.id.lstrip("_").isupper() and not isinstance(value, ast.Call) and t.id not in changed
                if constant:
                    continue
                if f"{name}.{t.id}" in STATE_ALLOWED:
                    allowed.add(f"{name}.{t.id}")
                else:
                    found.append(f"{name}.{t.id} (line {node.lineno})")
    assert sorted(found) == []
    assert allowed == set(STATE_ALLOWED)  # the list names only what is still there


def test_the_state_test_finds_a_registry_and_a_table_written_to():
    # the rule above, on text: a cache at module level, and an ALL_CAPS table changed later
    import ast

    tree = ast.parse("_SEEN = {}\nTABLE = {'a': 1}\nTABLE['b'] = 2\nKINDS = {'x': 'y'}\n"
                     "def f(k):\n    _SEEN.setdefault(k, set())\n")
    changed = _changed_names([tree])
    assert {"_SEEN", "TABLE"} <= changed and "KINDS" not in changed
