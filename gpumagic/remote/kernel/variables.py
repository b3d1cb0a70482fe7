"""Variables moved between this process and a session (``%gpu kernel push`` / ``pull``).

A value goes as the wire format's pickled variables (:func:`.wire.encode_values`: protocol
5, a numpy array's data out of band as raw bytes), through a private file under the
session's folder on the machine that a ``cat`` channel of its own writes or reads, so the
keeper's channel never carries bulk data.  The session's helper (``_gpumagic_kernel``,
loaded by the startup code) loads or dumps that file.
"""

from __future__ import annotations

import ast
import json
import uuid
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import paramiko

from ...errors import KernelConnectionLost, KernelError
from ...ssh.pump import ChannelPump
from . import wire
from .info import KERNELS_DIR
from .link import _q
from .outputs import _Quiet

if TYPE_CHECKING:
    from .client import RemoteKernel


def push(k: RemoteKernel, values: Mapping[str, Any]) -> dict[str, int]:
    """See :meth:`RemoteKernel.push`."""
    items, sizes = [], {}
    for name, value in values.items():
        if not str(name).isidentifier():
            raise KernelError(f"{name!r} is not a Python variable name", "push variables by name")
        try:
            main, buffers = wire.pickle_value(value)
        except Exception as e:
            raise KernelError(
                f"cannot push {name} ({type(value).__name__}): it cannot be pickled ({type(e).__name__}: {e})",
                "push data (numbers, strings, lists, dicts, arrays, DataFrames); define functions "
                "and classes in a %%remote --kernel cell instead") from None
        items.append((name, main, buffers))
        sizes[name] = len(main) + sum(b.nbytes for b in buffers)
    with k._lock:
        link = k._connect()
        path = f"{KERNELS_DIR}/{k.name}/xfer-{uuid.uuid4().hex}"
        code, _, err = _cat(k, f'umask 077 && cat > "$HOME/{path}"', wire.encode_values(items), "push")
        if code != 0:
            raise KernelError(f"cannot write the pushed data on {k.machine.name}: {err.strip()}",
                              "check the free space in ~/.gpumagic there (`df -h ~`)")
        home = k._home()
        res = _helper_result(k, f"__import__('_gpumagic_kernel').load({home + '/' + path!r})")
        k._ack(link, force=True)
    if "error" in res:
        raise KernelError(f"the session {k.where} could not load what was pushed: {res.get('message')}",
                          "push plain data, or install the same packages on the machine")
    return sizes


def pull(k: RemoteKernel, names: str | Iterable[str]):
    """See :meth:`RemoteKernel.pull`."""
    single = isinstance(names, str)
    wanted = [names] if isinstance(names, str) else list(names)
    for n in wanted:
        if not str(n).isidentifier():
            raise KernelError(f"{n!r} is not a Python variable name", "pull variables by name")
    with k._lock:
        link = k._connect()
        path = f"{k._home()}/{KERNELS_DIR}/{k.name}/xfer-{uuid.uuid4().hex}"
        res = _helper_result(k, f"__import__('_gpumagic_kernel').dump({path!r}, {wanted!r})")
        k._ack(link, force=True)
        if res.get("error") == "missing":
            raise KernelError(f"no variable {res['name']!r} in session {k.where}",
                              "check the name (a %%remote --kernel cell defines it)")
        if res.get("error") == "pickle":
            raise KernelError(
                f"cannot pull {res['name']} ({res.get('type')}): it cannot be pickled on the "
                f"machine ({res.get('message')})",
                "convert it there first (e.g. list(gen), tensor.cpu().numpy(), float(x)) and "
                "pull that")
        code, data, _ = _cat(k, f"cat {_q(path)} && rm -f {_q(path)}", [], "pull")
        if code != 0:
            raise KernelError(f"cannot read the pulled data on {k.machine.name}", "pull again")
    k.last_pull_sizes = res.get("sizes", {})
    try:
        values = wire.decode_values(data)
    except Exception as e:
        raise KernelError(f"cannot load what was pulled from {k.where} here: {type(e).__name__}: {e}",
                          "install the same package here, or convert the value on the machine "
                          "first (tensor.cpu().numpy(), df.to_dict())") from None
    return values[wanted[0]] if single else {n: values[n] for n in wanted}


def _silent(k: RemoteKernel, code: str, expressions: Mapping[str, str] | None = None) -> dict:
    r = k.execute(code, output=_Quiet(), silent=True, store_history=False,
                  allow_stdin=False, capture=False, raise_error=False,
                  user_expressions=expressions)
    if r.status != "ok":
        ename, evalue = (r.error.ename, r.error.evalue) if r.error is not None else (r.status, "")
        raise KernelError(f"gpumagic's helper failed in session {k.where}: {ename}: {evalue}",
                          f"`%gpu kernel restart {k.name}` if the session was started by "
                          "an older gpumagic")
    return r.user_expressions


def _helper_result(k: RemoteKernel, code: str) -> dict:
    expr = _silent(k, code, {"r": "__import__('_gpumagic_kernel').result"})
    value = expr.get("r", {})
    if value.get("status") != "ok":
        raise KernelError(f"gpumagic's helper is missing in session {k.where}: "
                          f"{value.get('ename')}: {value.get('evalue')}",
                          f"`%gpu kernel restart {k.name}` reloads it (variables are lost)")
    return json.loads(ast.literal_eval(value["data"]["text/plain"]))


def _cat(k: RemoteKernel, command: str, parts: list, verb: str) -> tuple[int, bytearray, str]:
    """Run ``command`` (a ``cat`` to or from a file) with ``parts`` on its stdin, through the
    channel pump: (exit status, stdout, stderr)."""
    conn = k.machine.connection
    out, err = bytearray(), bytearray()

    def watch() -> None:
        if not conn.is_connected:
            raise OSError(conn.lost_reason or "the connection closed")

    chan = conn.open_session()
    try:
        chan.exec_command(command)
        pump = ChannelPump(chan, out.extend, err.extend, chunk=1 << 20)
        for p in parts:
            pump.send(p)
        pump.send_eof()
        pump.run(lambda: pump.finished, watch=watch)
        code = chan.recv_exit_status()
    except (paramiko.SSHException, EOFError, OSError) as e:
        raise KernelConnectionLost(f"lost the connection to {k.machine.name} while {verb}ing ({e})",
                                   f"{verb} again: gpumagic reconnects by itself") from None
    finally:
        chan.close()
    return code, out, err.decode("utf-8", "replace")
