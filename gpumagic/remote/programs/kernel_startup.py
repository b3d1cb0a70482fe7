"""Run silently in each gpumagic kernel when it starts (and after each restart), by the
keeper (``kernel_keeper.py --startup``), in a namespace of its own: the user's namespace
only gets what the user defines.

1. ``tqdm.auto`` gives tqdm's text bar, which updates in place (``\\r``) and reads the same
   in a notebook saved to GitHub; ``tqdm.notebook`` still gives its widget (the laptop's comm
   bridge shows widgets made here).
2. The module ``_gpumagic_kernel`` holds what ``%gpu kernel push`` / ``pull`` run:
   ``load(path)`` and ``dump(path, names)``.  A payload is pickled (protocol 5) with
   numpy-style buffers kept out of band, so arrays travel as raw bytes, in the layout of
   ``kernel_wire.py`` (beside this file in the programs tar; the laptop imports the same
   file as ``gpumagic.remote.kernel.wire``).
"""

import importlib.abc
import importlib.util
import json
import os
import sys
import types


class _TextTqdm(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``tqdm.autonotebook`` (what ``tqdm.auto`` asks) as tqdm's plain text bar."""

    def find_spec(self, name, path=None, target=None):
        if name == "tqdm.autonotebook":
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        from tqdm.std import tqdm, trange

        module.tqdm, module.trange, module.__all__ = tqdm, trange, ["tqdm", "trange"]


if not any(isinstance(f, _TextTqdm) for f in sys.meta_path):
    sys.meta_path.insert(0, _TextTqdm())


def _load_wire():
    """``kernel_wire.py`` from this file's folder, as a module of its own: nothing is put on
    the user's ``sys.path``, and a module of theirs named ``kernel_wire`` is not touched."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_wire.py")
    spec = importlib.util.spec_from_file_location("_gpumagic_kernel_wire", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wire = _load_wire()


def _user_ns():
    from IPython import get_ipython

    return get_ipython().user_ns


def load(path):
    """Set the variables pushed in ``path`` (then removed) in the user's namespace."""
    mod.result = ""
    try:
        size = os.path.getsize(path)
        data = bytearray(size)
        with open(path, "rb") as f:
            f.readinto(data)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    try:
        values = wire.decode_values(data)
    except Exception as e:
        mod.result = json.dumps({"error": "load", "message": "%s: %s" % (type(e).__name__, e)})
        return
    _user_ns().update(values)
    mod.result = json.dumps({"ok": sorted(values)})


def dump(path, names):
    """Pickle the user's variables ``names`` into ``path`` (0600)."""
    ns = _user_ns()
    items, sizes = [], {}
    for name in names:
        if name not in ns:
            mod.result = json.dumps({"error": "missing", "name": name})
            return
        try:
            main, buffers = wire.pickle_value(ns[name])
        except Exception as e:
            mod.result = json.dumps({"error": "pickle", "name": name, "type": type(ns[name]).__name__,
                                     "message": "%s: %s" % (type(e).__name__, e)})
            return
        items.append((name, main, buffers))
        sizes[name] = len(main) + sum(b.nbytes for b in buffers)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        for part in wire.encode_values(items):
            f.write(part)
    mod.result = json.dumps({"ok": names, "sizes": sizes})


mod = types.ModuleType("_gpumagic_kernel")
mod.__doc__ = "gpumagic's helpers for %gpu kernel push/pull (see kernel_startup.py)."
mod.load, mod.dump, mod.result = load, dump, ""
sys.modules["_gpumagic_kernel"] = mod
