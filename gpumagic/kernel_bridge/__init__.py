"""The machine's live session as a Jupyter kernel that a front end picks from its list.

``gpumagic kernel install HOST`` (:mod:`.spec`, :mod:`.cli`) writes a kernelspec
``gpumagic-HOST`` shown as "Python 3 on HOST (gpumagic)"; JupyterLab, Notebook, VS Code,
nbclient and any Jupyter client then start ``python -m gpumagic.kernel_bridge -f
{connection_file} --host HOST`` (:mod:`.bridge`): a kernel to them, whose cells run in the
session ``main`` on the machine (``%gpu kernel``: the same one ``%%remote --kernel`` uses),
started there on first use.

Surviving the front end
-----------------------
The session is kept by its keeper on the machine, not by the bridge: closing JupyterLab,
reloading VS Code, a killed bridge or a laptop asleep leave it running, a cell too.  The
next bridge for the kernelspec attaches to it: the variables are there, a running cell goes
on, and what it printed meanwhile comes first, once, in order (the keeper's journal from
after what was acknowledged).  A lost path (a roam) is made again by itself; the front end
sees the cell busy until it is idle, no error.

Shutdown rule (in every kernelspec's ``metadata.gpumagic.shutdown``)
--------------------------------------------------------------------
A front end's "shut down kernel" detaches: the bridge exits, the session runs on (on the
sandbox it stops by itself after 30 minutes with nothing attached and no cell running).
``gpumagic kernel stop HOST`` stops the session.  "Restart kernel" restarts the kernel on
the machine: a fresh namespace.

``%gpu`` magics
---------------
A cell whose lines are all ``%gpu ...`` line magics (``%gpu status``, ``%gpu sync``,
``%gpu tunnel``, ``%gpu kernel list``...) runs on the laptop, in the bridge, against this
machine (:mod:`.local`); any other cell runs on the machine, ``!cmd`` and ``%timeit`` too.
A cell ``%gpu kernel attach`` shows the running cell's output from its first line, then
follows it (:meth:`.bridge.Bridge.attach_cell`): what a JupyterLab page reloaded mid-cell
needs, since it renders no output of a request it did not send itself.

Layering: the bridge is a front-end-side program beside :mod:`gpumagic.notebook`; it uses
:mod:`gpumagic.remote.kernel` and :mod:`gpumagic.machine`, and nothing below it imports it.
"""
