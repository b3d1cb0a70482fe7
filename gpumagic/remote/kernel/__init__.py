"""A live Python session on the machine: a Jupyter kernel that outlives the laptop.

>>> k = machine.kernel("main")              # started on first use (ipykernel on the machine)
>>> k.execute("x = 41")
>>> k.execute("print(x + 1)")               # 42: the namespace persists between calls
>>> k.push({"lr": 3e-4}); k.pull("x")      # 41
>>> k.interrupt(); k.restart(); k.stop()

How it works
------------
The engine is Jupyter's own: ipykernel on the machine, spoken to with Jupyter messages
(protocol 5.3: ``execute_request``, ``stream``, ``display_data``, ``input_request``...).
On the machine, ``gpumagic/remote/programs/kernel_keeper.py`` (copied to
``~/.gpumagic/kernels/.programs/``) runs detached, like a job, with the kernel's Python.  It
starts ipykernel with a connection file (0600 in a 0700 directory) whose five sockets bind
to the machine's 127.0.0.1, talks to them with jupyter_client's ``Session`` (so the HMAC key
never leaves the machine) and writes every message the kernel sends to a journal on disk,
numbered, in arrival order: output printed while no laptop is connected is kept there.

The laptop reaches the keeper's one port (the machine's 127.0.0.1) through a
``direct-tcpip`` channel of the machine's SSH connection: nothing listens on the laptop at
all.  It presents a token (a 0600 file on the machine, read over SSH, never shown) and the
number of the last message it has shown; the keeper streams the journal from the next one.
So whatever a cell printed while the laptop was away comes first, once, in order (images
included), then the live output; what this process has shown is acknowledged, so a new
process starts after it.  Requests (execute, input replies, shutdown) are Jupyter messages
that the keeper signs and passes on; interrupt, restart and stop are the keeper's (SIGINT to
the kernel's process group, as jupyter_client does it for a local kernel).

Why one relayed port rather than ``ssh -L``-style forwards of the kernel's five ports: one
SSH channel instead of five local listening sockets; the HMAC key stays on the machine; one
numbered stream makes "shown exactly once, in order" a cursor instead of merging a live
subscription with a replay; a slow laptop only holds back its own cursor (the keeper sends
whole journal records as the channel takes them, so neither side's memory grows with the
output).  The price is one small relay hop on the machine (see
``benchmarks/kernel_vs_ssh.py``).

The package, as jupyter_client splits a kernel's life:

* :mod:`.wire`: the frames and the pickled-variable codec (shipped to the machine too);
* :mod:`.link`: the channel to a keeper, and the keeper's programs;
* :mod:`.client`: :class:`RemoteKernel`, one session;
* :mod:`.outputs`: where its output goes, and what a cell did;
* :mod:`.info`: the machine's list of sessions; :mod:`.registry`: this process's sessions.
"""

from ...errors import KernelConnectionLost, KernelError, RemoteKernelError
from .client import RemoteKernel
from .info import DEFAULT_NAME, KERNELS_DIR, KernelInfo, check_name, list_kernels, parse_listing
from .link import Message, program_text
from .outputs import ExecuteResult, Output, RemoteValue, TextOutput, default_output
from .registry import Kernels

__all__ = ["DEFAULT_NAME", "KERNELS_DIR", "ExecuteResult", "KernelConnectionLost", "KernelError", "KernelInfo",
           "Kernels", "Message", "Output", "RemoteKernel", "RemoteKernelError", "RemoteValue", "TextOutput", "check_name",
           "default_output", "list_kernels", "parse_listing", "program_text"]
