"""The wire between the sandbox's referee (trusted, runs the tests) and its candidate (untrusted).

Both sides are standalone scripts started with ``python -I`` and load this file by path; it imports
only the standard library.

Frames: a 4-byte big-endian length, then that many bytes of UTF-8 JSON (at most ``MAX_FRAME``).

Values cross as *data*, never as objects: ``encode`` maps exactly the builtin types (``type(x) is
int``, not ``isinstance``) to tagged JSON, and ``decode`` rebuilds fresh builtins. Whatever the
candidate's objects claim about themselves (an ``__eq__`` that always answers True, an ``int``
subclass, a ``__reduce__``), the referee compares only builtins it built itself. Anything else
crosses as a handle (``{"h": id}``): an opaque number the referee can call or read attributes
through, but never compare.

    None, bool, int, float, str        JSON scalars (non-finite floats as {"F": "nan" | "inf" | "-inf"})
    list, tuple, set, frozenset        {"l" | "t" | "s" | "z": [items]}
    dict                               {"d": [[key, value], ...]}
    bytes, bytearray, complex          {"b": latin-1 text}, {"y": latin-1 text}, {"c": [re, im]}
    anything else                      {"h": handle id}
"""

import json
import math
import os
import struct

MAX_FRAME = 64 << 20  # one frame: larger values are refused, not streamed
MAX_DEPTH = 200  # nesting depth of one value (also stops reference cycles)
MAX_ITEMS = 2_000_000  # containers' items per value


class WireError(Exception):
    """A frame or value that breaks the protocol (too large, too deep, not decodable)."""


def _read_exact(fd, n):
    chunks, got = [], 0
    while got < n:
        b = os.read(fd, min(n - got, 1 << 20))
        if not b:
            raise EOFError("the other side closed the channel")
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def send(fd, obj):
    data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
    if len(data) > MAX_FRAME:
        raise WireError(f"a message of {len(data)} bytes exceeds the {MAX_FRAME} byte limit")
    buf = memoryview(struct.pack(">I", len(data)) + data)
    while buf:
        n = os.write(fd, buf)
        buf = buf[n:]


def recv(fd):
    (n,) = struct.unpack(">I", _read_exact(fd, 4))
    if n > MAX_FRAME:
        raise WireError(f"a message of {n} bytes exceeds the {MAX_FRAME} byte limit")
    try:
        return json.loads(_read_exact(fd, n).decode("utf-8", "surrogatepass"))
    except ValueError as e:
        raise WireError(f"undecodable message: {e}") from None


def encode(x, to_handle, _depth=0, _count=None):
    """``x`` as tagged JSON; ``to_handle(obj)`` gives the handle for what is not plain data (it may
    raise TypeError to refuse)."""
    if _count is None:
        _count = [0]
    _count[0] += 1
    if _depth > MAX_DEPTH or _count[0] > MAX_ITEMS:
        raise WireError("value too deep or too large to send (or it contains itself)")
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if t is int:
        if -(1 << 62) < x < (1 << 62):
            return x
        return {"i": hex(x)}  # no decimal digit limit, exact
    if t is float:
        return x if math.isfinite(x) else {"F": repr(x)}
    d = _depth + 1
    if t is list:
        return {"l": [encode(v, to_handle, d, _count) for v in x]}
    if t is tuple:
        return {"t": [encode(v, to_handle, d, _count) for v in x]}
    if t is set:
        return {"s": [encode(v, to_handle, d, _count) for v in x]}
    if t is frozenset:
        return {"z": [encode(v, to_handle, d, _count) for v in x]}
    if t is dict:
        return {"d": [[encode(k, to_handle, d, _count), encode(v, to_handle, d, _count)] for k, v in x.items()]}
    if t is bytes:
        return {"b": x.decode("latin-1")}
    if t is bytearray:
        return {"y": bytes(x).decode("latin-1")}
    if t is complex:
        return {"c": [encode(x.real, to_handle, d, _count), encode(x.imag, to_handle, d, _count)]}
    if t.__module__ == "numpy" and getattr(x, "shape", None) == () and hasattr(x, "item"):
        return encode(x.item(), to_handle, d, _count)  # a numpy scalar: its Python value
    return {"h": to_handle(x)}


def decode(v, from_handle, _depth=0):
    """Rebuild builtins from tagged JSON; ``from_handle(id)`` resolves handles."""
    if _depth > MAX_DEPTH:
        raise WireError("value too deep")
    if v is None or isinstance(v, (bool, str, int, float)):
        return v
    if isinstance(v, dict) and len(v) == 1:
        (tag, body), d = next(iter(v.items())), _depth + 1
        if tag == "l":
            return [decode(e, from_handle, d) for e in body]
        if tag == "t":
            return tuple(decode(e, from_handle, d) for e in body)
        if tag == "s":
            return {decode(e, from_handle, d) for e in body}
        if tag == "z":
            return frozenset(decode(e, from_handle, d) for e in body)
        if tag == "d":
            return {decode(k, from_handle, d): decode(e, from_handle, d) for k, e in body}
        if tag == "b":
            return str(body).encode("latin-1")
        if tag == "y":
            return bytearray(str(body).encode("latin-1"))
        if tag == "c":
            return complex(float(decode(body[0], from_handle, d)), float(decode(body[1], from_handle, d)))
        if tag == "i":
            return int(str(body), 16)
        if tag == "F":
            return float(str(body))
        if tag == "h":
            return from_handle(int(body))
    raise WireError(f"not a value of the sandbox wire format: {str(v)[:80]}")


# ---------------------------------------------------------------------------------------------------
# judging (the referee, and the SandboxFusion client in trainer/rewards/sandbox_fusion.py)
def same_output(got, expected) -> bool:
    """Whitespace-insensitive comparison of program output (token by token)."""
    if isinstance(expected, list):
        expected = "\n".join(str(x) for x in expected)
    return str(got).split() == str(expected).split()


def same_value(got, expected) -> bool:
    """A returned value against the expected one (decoded builtins on both sides)."""
    if got == expected:
        return True
    if isinstance(got, tuple):  # JSON round-trips tuples as lists
        got = list(got)
    if got == expected:
        return True
    return isinstance(expected, list) and len(expected) == 1 and got == expected[0]
