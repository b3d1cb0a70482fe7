"""A syntax-tree check: no POSIX-only call on the laptop side without a platform guard.

The laptop side of gpumagic runs on Windows too, where Python has no ``pwd``, ``grp``,
``fcntl``, ``termios``, ``resource``, no ``os.getuid``/``killpg``/``fork``, no
``select.poll``, no ``signal.SIGKILL``.  :func:`unguarded` reads a module's syntax tree and
returns each use of one of those that Windows would reach.  A use is guarded when, with
Windows' facts (``sys.platform == "win32"``, ``os.name == "nt"``, ``hasattr(os, "getuid")``
false, ...), the code around it cannot reach it:

- an ``if``/``elif``/conditional expression/``while`` whose test is false on Windows (the use
  in its body) or true (the use in its ``else``), the test read through module-level names
  (``_FD_META = hasattr(os, "fchmod") and ...``);
- ``A and USE`` with ``A`` false on Windows, ``A or USE`` with ``A`` true;
- an earlier statement of the same block ``if WINDOWS_TRUE: ... return/raise/continue/break``;
- a ``try`` whose handlers catch what Windows raises there (``ImportError`` for a module,
  ``AttributeError`` for a name), which is then the Windows branch.

Uses of ``fcntl``/``pwd``/... attributes count once, at the ``import``; names that Windows
lacks count at each use.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

#: Modules Windows' Python does not have.
POSIX_MODULES = frozenset({"pwd", "grp", "fcntl", "termios", "tty", "pty", "resource", "posix",
                           "syslog", "crypt", "spwd", "nis"})

#: Names of standard modules that Windows' Python lacks (its documentation's "Availability: Unix"
#: for the names gpumagic could reach for).
POSIX_NAMES = {
    "os": frozenset({
        "getuid", "geteuid", "getgid", "getegid", "getgroups", "getresuid", "setuid", "seteuid",
        "killpg", "setsid", "getsid", "setpgid", "getpgid", "getpgrp", "setpgrp", "tcgetpgrp",
        "fork", "forkpty", "wait3", "wait4", "WNOHANG", "chown", "lchown", "fchown", "mkfifo",
        "mknod", "getloadavg", "sysconf", "statvfs", "fstatvfs", "uname", "sync", "nice",
        "sched_getaffinity", "openpty", "ttyname", "pipe2", "posix_fadvise", "pread", "pwrite",
        "sendfile", "O_NOFOLLOW", "O_DIRECTORY", "O_CLOEXEC", "O_NONBLOCK", "O_NOCTTY",
        "copy_file_range", "splice", "memfd_create", "eventfd", "getxattr", "setxattr",
        "listxattr", "fchdir", "chroot", "ctermid", "getlogin_r", "initgroups", "setgroups",
    }),
    "signal": frozenset({
        "SIGKILL", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGUSR1", "SIGUSR2", "SIGCHLD", "SIGPIPE",
        "SIGWINCH", "SIGCONT", "SIGSTOP", "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGPROF", "SIGXCPU",
        "alarm", "setitimer", "getitimer", "pause", "pthread_kill", "pthread_sigmask",
        "siginterrupt", "sigwait", "sigpending", "ITIMER_REAL",
    }),
    "select": frozenset({"poll", "epoll", "kqueue", "kevent", "devpoll", "POLLIN", "POLLOUT",
                         "POLLERR", "POLLHUP", "POLLPRI", "EPOLLIN", "EPOLLOUT"}),
    "socket": frozenset({"AF_UNIX", "SO_REUSEPORT", "SOCK_CLOEXEC", "SOCK_NONBLOCK", "sethostname",
                         "if_nameindex", "CMSG_LEN", "sendmsg", "recvmsg"}),
    "shutil": frozenset({"chown"}),
    "time": frozenset({"tzset", "clock_gettime", "clock_settime", "CLOCK_MONOTONIC_RAW"}),
}

#: Where the laptop side is not: the machine-side programs (Linux, sent over the channel) and
#: the sandbox's sshd (which says on Windows that it needs a Linux machine before it gets there).
EXEMPT = ("remote/programs/", "ssh/sandbox.py", "gpu/fake/")

_UNKNOWN = object()


@dataclass(frozen=True)
class Use:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what} is POSIX-only and not behind a platform guard"


def _module_aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> module for every ``import M [as N]`` of a module we know of."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in POSIX_NAMES or a.name in ("sys", "platform"):
                    names[a.asname or a.name] = a.name
    return names


class _Windows:
    """Evaluates an expression as Windows would: True, False or _UNKNOWN."""

    def __init__(self, aliases: dict[str, str], constants: dict[str, ast.expr]):
        self.aliases = aliases
        self.constants = constants
        self._busy: set[str] = set()

    def value(self, node: ast.expr):  # noqa: C901 - one case per node type
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            mod = self.aliases.get(node.value.id)
            if mod == "sys" and node.attr == "platform":
                return "win32"
            if mod == "os" and node.attr == "name":
                return "nt"
            if mod == "os" and node.attr == "sep":
                return "\\"
            return _UNKNOWN
        if isinstance(node, ast.Name):
            if node.id in self.constants and node.id not in self._busy:
                self._busy.add(node.id)
                try:
                    return self.value(self.constants[node.id])
                finally:
                    self._busy.discard(node.id)
            return _UNKNOWN
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            v = self.value(node.operand)
            return _UNKNOWN if v is _UNKNOWN else not v
        if isinstance(node, ast.BoolOp):
            values = [self.value(v) for v in node.values]
            if isinstance(node.op, ast.And):
                if any(v is not _UNKNOWN and not v for v in values):
                    return False
                return True if all(v is not _UNKNOWN for v in values) else _UNKNOWN
            if any(v is not _UNKNOWN and v for v in values):
                return True
            return False if all(v is not _UNKNOWN for v in values) else _UNKNOWN
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            left, right = self.value(node.left), self.value(node.comparators[0])
            if left is _UNKNOWN or right is _UNKNOWN:
                return _UNKNOWN
            op = node.ops[0]
            try:
                if isinstance(op, ast.Eq):
                    return left == right
                if isinstance(op, ast.NotEq):
                    return left != right
                if isinstance(op, ast.In):
                    return left in right
                if isinstance(op, ast.NotIn):
                    return left not in right
            except TypeError:
                return _UNKNOWN
            return _UNKNOWN
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = [self.value(e) for e in node.elts]
            return _UNKNOWN if any(i is _UNKNOWN for i in items) else tuple(items)
        if isinstance(node, ast.Call):
            return self._call(node)
        return _UNKNOWN

    def _call(self, node: ast.Call):
        f = node.func
        if isinstance(f, ast.Name) and f.id == "hasattr" and len(node.args) == 2:
            mod = node.args[0]
            name = self.value(node.args[1])
            if isinstance(mod, ast.Name) and isinstance(name, str):
                module = self.aliases.get(mod.id)
                if module in POSIX_NAMES and name in POSIX_NAMES[module]:
                    return False
            return _UNKNOWN
        if isinstance(f, ast.Attribute) and f.attr in ("startswith", "endswith"):
            base, args = self.value(f.value), [self.value(a) for a in node.args]
            if isinstance(base, str) and args and all(isinstance(a, (str, tuple)) for a in args):
                return getattr(base, f.attr)(*args)
            return _UNKNOWN
        if (isinstance(f, ast.Attribute) and f.attr == "system" and isinstance(f.value, ast.Name)
                and self.aliases.get(f.value.id) == "platform"):
            return "Windows"
        return _UNKNOWN


def _terminates(body: list[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[-1], (ast.Return, ast.Raise, ast.Continue, ast.Break))


def _catches(handler: ast.ExceptHandler, wanted: str) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    ok = {"Exception", "BaseException", wanted}
    if wanted == "ImportError":
        ok.add("ModuleNotFoundError")
    return any(isinstance(t, ast.Name) and t.id in ok for t in types)


class _Checker:
    def __init__(self, tree: ast.Module, path: str):
        self.path = path
        self.aliases = _module_aliases(tree)
        constants = {}
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                constants[stmt.targets[0].id] = stmt.value
        self.windows = _Windows(self.aliases, constants)
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.tree = tree

    def uses(self):
        """(node, what, exception Windows raises there) for each POSIX-only use."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in POSIX_MODULES:
                        yield node, f"import {a.name}", "ImportError"
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] in POSIX_MODULES:
                    yield node, f"from {node.module} import ...", "ImportError"
                elif node.module in POSIX_NAMES:
                    for a in node.names:
                        if a.name in POSIX_NAMES[node.module]:
                            yield node, f"from {node.module} import {a.name}", "ImportError"
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                module = self.aliases.get(node.value.id)
                if module in POSIX_NAMES and node.attr in POSIX_NAMES[module]:
                    yield node, f"{module}.{node.attr}", "AttributeError"

    def guarded(self, node: ast.AST, raises: str) -> bool:
        child, parent = node, self.parents.get(node)
        while parent is not None:
            if self._guards(parent, child, raises):
                return True
            child, parent = parent, self.parents.get(parent)
        return False

    def _guards(self, parent: ast.AST, child: ast.AST, raises: str) -> bool:
        win = self.windows.value
        if isinstance(parent, (ast.If, ast.IfExp, ast.While)):
            test = win(parent.test)
            if test is _UNKNOWN or child is parent.test:
                return False
            body = parent.body if isinstance(parent.body, list) else [parent.body]
            return (child in body and not test) or (child not in body and bool(test))
        if isinstance(parent, ast.BoolOp):
            i = parent.values.index(child)
            before = [win(v) for v in parent.values[:i]]
            if isinstance(parent.op, ast.And):
                return any(v is not _UNKNOWN and not v for v in before)
            return any(v is not _UNKNOWN and v for v in before)
        if isinstance(parent, ast.Try) and child in parent.body:
            if any(_catches(h, raises) for h in parent.handlers):
                return True
        for field in ("body", "orelse", "finalbody"):
            block = getattr(parent, field, None)
            if isinstance(block, list) and child in block:
                for earlier in block[:block.index(child)]:
                    if isinstance(earlier, ast.If) and _terminates(earlier.body) and win(earlier.test) is True:
                        return True
        return False


def unguarded(source: str, path: str = "<string>") -> list[Use]:
    """Each POSIX-only use in ``source`` that Windows would reach (see the module docstring)."""
    checker = _Checker(ast.parse(source, path), path)
    return [Use(path, node.lineno, what) for node, what, raises in checker.uses()
            if not checker.guarded(node, raises)]


def laptop_modules(package: Path) -> list[Path]:
    """The package's modules that run on the laptop (all but :data:`EXEMPT`)."""
    return sorted(p for p in package.rglob("*.py")
                  if not any(p.relative_to(package).as_posix().startswith(e) for e in EXEMPT))
