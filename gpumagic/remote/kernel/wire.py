"""The wire format of gpumagic's live sessions, loaded by both sides.

The laptop imports it as :mod:`gpumagic.remote.kernel.wire`; the machine gets this same file
(as ``kernel_wire.py``) in the programs tar beside ``kernel_keeper.py`` (which imports it) and ``kernel_startup.py``
(which loads it from its own folder), so no line of it is copied between the two sides.
Standard library only, and Python 3.8, like every program run on the machine.

Two formats:

frames
    What the keeper and its clients send each other, and what its journal holds:
    ``!I body length``, then the body: ``!I part count``, then per part ``!I length`` and
    the bytes.  The first part is JSON (:func:`dumps`); the rest are a kernel message's
    parts (Jupyter's wire parts after ``<IDS|MSG>``) or raw buffers.
pickled variables
    What ``%gpu kernel push`` and ``pull`` move: each value pickled with protocol 5 and
    its contiguous buffers (a numpy array's data) kept out of band, so arrays travel as raw
    bytes::

        !I count, then per variable: !I name length, name (UTF-8), !Q pickle length,
        pickle, !I buffer count, then per buffer: !Q length, bytes
"""

import json
import pickle
import struct

# -- frames -------------------------------------------------------------------------------


def dumps(obj):
    """``obj`` as compact JSON bytes (what cannot be JSON is written as its ``str``)."""
    return json.dumps(obj, separators=(",", ":"), default=str).encode()


def frame(parts):
    """The frame of ``parts`` (byte strings), its length prefix included."""
    parts = list(parts)
    body = [struct.pack("!I", len(parts))]
    for p in parts:
        body.append(struct.pack("!I", len(p)))
        body.append(p)
    data = b"".join(body)
    return struct.pack("!I", len(data)) + data


def unframe(body):
    """The parts of one frame's body (without its length prefix), as bytes."""
    (n,), off, parts = struct.unpack_from("!I", body, 0), 4, []
    for _ in range(n):
        (size,) = struct.unpack_from("!I", body, off)
        off += 4
        parts.append(bytes(body[off:off + size]))
        off += size
    return parts


def take_frames(buf):
    """Every whole frame at the front of the bytearray ``buf``, as a list of ``(parts,
    size)`` with ``size`` the body's length, and removed from ``buf``; a partial frame at
    its end stays there for the next read."""
    start, out = 0, []
    while len(buf) - start >= 4:
        (size,) = struct.unpack_from("!I", buf, start)
        if len(buf) - start - 4 < size:
            break
        out.append((unframe(memoryview(buf)[start + 4:start + 4 + size]), size))
        start += 4 + size
    if start:
        del buf[:start]
    return out


# -- pickled variables --------------------------------------------------------------------


def pickle_value(value):
    """``(pickle bytes, [buffers])`` of ``value``: protocol 5, contiguous buffers out of band
    (one that is not contiguous stays in band)."""
    buffers = []

    def keep(buf):
        try:
            buffers.append(buf.raw())
        except BufferError:  # not contiguous: in band
            return True
        return False

    return pickle.dumps(value, protocol=5, buffer_callback=keep), buffers


def encode_values(items):
    """``[(name, pickle bytes, [buffers])]`` -> the byte strings to write, in order (buffers
    are not copied)."""
    out = [struct.pack("!I", len(items))]
    for name, main, buffers in items:
        raw = name.encode()
        out += [struct.pack("!I", len(raw)), raw, struct.pack("!Q", len(main)), main,
                struct.pack("!I", len(buffers))]
        for b in buffers:
            out += [struct.pack("!Q", b.nbytes), b]
    return out


def decode_values(data):
    """The inverse of :func:`encode_values` over one bytearray: ``{name: value}`` (buffers
    stay views of ``data``, so arrays are writable and not copied)."""
    view = memoryview(data)
    (count,), off = struct.unpack_from("!I", view, 0), 4
    values = {}
    for _ in range(count):
        (n,) = struct.unpack_from("!I", view, off)
        off += 4
        name = bytes(view[off:off + n]).decode()
        off += n
        (n,) = struct.unpack_from("!Q", view, off)
        off += 8
        main = view[off:off + n]
        off += n
        (nbuf,) = struct.unpack_from("!I", view, off)
        off += 4
        buffers = []
        for _ in range(nbuf):
            (n,) = struct.unpack_from("!Q", view, off)
            off += 8
            buffers.append(view[off:off + n])
            off += n
        values[name] = pickle.loads(main, buffers=buffers)
    return values
