"""gpumagic: drive a rented GPU machine from a notebook on your laptop, over SSH.

Plain Python::

    import gpumagic
    m = gpumagic.connect("mygpu")
    m.run("nvidia-smi")

IPython / Jupyter::

    %load_ext gpumagic
    %gpu connect mygpu
    %%remote
    nvidia-smi
"""

import functools as _functools
import logging as _logging

from . import machine as _machine
from .errors import GpumagicError
from .machine import Machine
from .remote.distributed import split_options as _split_options
from .remote.keep import KeepOptions

__version__ = "0.1.0"

# A library never prints through logging's last-resort handler (paramiko's transport logs
# go under "gpumagic.ssh"); an application that configures logging sees everything.
_logging.getLogger("gpumagic").addHandler(_logging.NullHandler())
__all__ = ["connect", "current_machine", "Machine", "GpumagicError", "KeepOptions", "start_distributed",
           "load_ipython_extension", "__version__"]


@_functools.wraps(_machine.connect)
def connect(*args, **kwargs) -> Machine:
    machine = _machine.connect(*args, **kwargs)
    _sessions_display_here(machine)
    return machine


def _sessions_display_here(machine: Machine) -> None:
    """In IPython (a notebook), a machine connected from Python shows its sessions' rich output
    there (figures, tables, widgets), as one connected by ``%gpu connect`` does: this package's
    top hands the notebook's output in (``machine.kernels.output``); below it nothing looks
    for IPython.  Elsewhere the output stays printed."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return
    magics = getattr(shell, "_gpumagic", None)
    if magics is not None:  # the loaded extension's: its widgets' bridges live with the notebook
        machine.kernels.output = magics._kernel_output
    else:
        from .notebook.magics.kernel import NotebookOutput

        machine.kernels.output = NotebookOutput


def current_machine(name=None):
    """The :class:`Machine` that ``%gpu connect`` connected in this notebook: the default one
    (the last connected, or the one ``%gpu connect`` made default), or the one named ``name``;
    for what the magics do not say (``machine.job("train").logs(3)``).

    Raises
    ------
    NotConnected
        Outside IPython, before ``%load_ext gpumagic``, or with no such machine connected
        (naming those that are).
    """
    from .errors import NotConnected

    try:
        from IPython import get_ipython
    except ImportError:
        get_ipython = None  # type: ignore[assignment]
    state = getattr(get_ipython() if get_ipython is not None else None, "_gpumagic", None)
    if state is None:
        raise NotConnected("gpumagic.current_machine() reads what %gpu connect connected in a notebook, and "
                           "gpumagic is not loaded here",
                           "run `%load_ext gpumagic` and `%gpu connect ALIAS` first, or use gpumagic.connect(ALIAS)")
    return state.fleet.get(name)


def start_distributed(machines, name, script, **options):
    """Start ``script`` under PyTorch's torchrun on every machine of ``machines`` (connected
    :class:`Machine` objects; the first holds the c10d rendezvous endpoint); returns a
    :class:`gpumagic.remote.distributed.DistributedJob` over all ranks (``state``,
    ``logs(rank=)``, ``wait()``, ``kill()``).  ``options``: the fields of
    :class:`gpumagic.remote.distributed.TorchrunOptions` (``nproc``, ``torchrun_args``,
    ``same_dir``...) and of :class:`gpumagic.remote.jobs.JobOptions` (``cwd``, ``env``,
    ``stop_on``, ``then_shutdown``...), as keywords.

    Raises
    ------
    JobError
        The preflight refused (a table of what differs per host), or a bad name or nproc.
    TypeError
        A keyword that names no option.
    """
    return _machine.start_distributed(machines, name, script, *_split_options(options))


_SUBMODULES = ("budget", "gpu", "keys", "notebook", "remote", "ssh", "sync", "tunnel")


def __getattr__(name):
    # `import gpumagic` then `gpumagic.keys.keygen()`: import submodules on first use.
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'gpumagic' has no attribute {name!r}")


def load_ipython_extension(ipython):
    """Register ``%gpu`` and ``%%remote`` (called by ``%load_ext gpumagic``)."""
    from .notebook import magics

    magics.load(ipython)


def unload_ipython_extension(ipython):
    """Unregister gpumagic's post-cell hooks and close every connection (``%unload_ext``;
    ``%reload_ext gpumagic`` calls it before loading again)."""
    from .notebook import magics

    magics.unload(ipython)
