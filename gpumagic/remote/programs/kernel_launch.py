"""Starts a session's kernel as ``python -m ipykernel_launcher -f CONNECTION_FILE`` does, with
one change: its IOPub socket queues every message for the keeper, however far behind it is.

ZeroMQ's PUB socket drops what it cannot queue for a subscriber once ``SNDHWM`` messages wait
(1000 by default), and ipykernel leaves it there.  A cell that prints in a loop while the
keeper is slowed down (a busy machine, a keeper writing its journal) then loses lines from the
middle of its output with no sign of it.  The keeper takes everything the kernel sends
(its own receive queue has no limit either), so with no limit here every message arrives;
what waits is held in memory for as long as the keeper is behind.

This program runs ON the machine, beside ``kernel_keeper.py``, with the kernel's Python.
"""

import sys

if __name__ == "__main__":
    # as ipykernel_launcher does: this folder leaves sys.path (the kernel adds its cwd back)
    del sys.path[0]

    import zmq
    from ipykernel import kernelapp

    class IPKernelApp(kernelapp.IPKernelApp):  # the same name: the same config sections
        def init_iopub(self, context):
            # sockets made from now on (IOPub and its pipe for subprocesses) queue without limit
            context.setsockopt(zmq.SNDHWM, 0)
            context.setsockopt(zmq.RCVHWM, 0)
            super().init_iopub(context)

    IPKernelApp.launch_instance()
