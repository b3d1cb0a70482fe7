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
