"""The body format between independent islands: a JSON meta and named numpy arrays.

    body = b"HJD1" | header length (uint32, little-endian) | header | arrays

The header is UTF-8 JSON ``{"meta": {...}, "arrays": [[name, dtype, shape], ...]}``. The
arrays follow in that order, raw and C-ordered, each starting at a multiple of
:data:`ALIGN` bytes from the start of the body (zero padding between). No pickle, no zip:
:func:`unpack` reads a body by arithmetic on its header, checks that the header says
exactly how long the body is, and returns read-only views into it.

:func:`unpack` trusts nothing: a bad magic, a header longer than the body or than
:data:`HEADER_MAX`, JSON that is not the shape above (or holds ``NaN``/``Infinity``), a
dtype outside :data:`DTYPES`, a negative or huge dimension, a repeated name, or a length
that disagrees with the header is a :class:`WireError` naming what was wrong. What the
meta and arrays mean is checked by :mod:`holmes_jax.diloco.messages`.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np

MAGIC = b"HJD1"
ALIGN = 64  # bytes: every array starts at a multiple of this (aligned views, SIMD loads)
HEADER_MAX = 16 << 20  # bytes of JSON header at most (a meta with a scale per key)
MAX_DIMS = 8
DTYPES = {name: np.dtype(name) for name in ("float32", "uint16", "int8", "uint8")}
Shards = dict[str, np.ndarray]  # "<leaf path>#<lane>" -> array


class WireError(ValueError):
    """A body that is not :func:`pack`'s format; the message says what was wrong."""


def _pad(n: int) -> int:
    return -n % ALIGN


def _layout(header_len: int, entries) -> tuple[list[int], int]:
    """Each array's offset in the body and the body's total length."""
    at = len(MAGIC) + 4 + header_len
    offsets = []
    for _, dtype, shape in entries:
        at += _pad(at)
        offsets.append(at)
        at += DTYPES[dtype].itemsize * math.prod(shape)
    return offsets, at


def pack(meta: dict, arrays: Shards | None = None) -> bytes:
    """One body of ``meta`` (JSON-able) and ``arrays`` (dtypes of :data:`DTYPES`)."""
    arrays = {k: np.ascontiguousarray(v) for k, v in (arrays or {}).items()}
    entries = [[k, v.dtype.name, list(v.shape)] for k, v in arrays.items()]
    header = json.dumps({"meta": meta, "arrays": entries}, allow_nan=False).encode()
    offsets, total = _layout(len(header), entries)
    parts: list = [MAGIC, struct.pack("<I", len(header)), header]
    at = len(MAGIC) + 4 + len(header)
    for offset, value in zip(offsets, arrays.values(), strict=True):
        parts += [bytes(offset - at), memoryview(value).cast("B")]
        at = offset + value.nbytes
    body = b"".join(parts)
    assert len(body) == total
    return body


def packed_size(meta_bytes: int, entries: list[tuple[str, str, tuple[int, ...]]]) -> int:
    """An upper bound on :func:`pack`'s length for ``entries`` ``(name, dtype, shape)``
    and a meta of at most ``meta_bytes`` bytes of JSON: what a server accepts before it
    reads a body."""
    header = len(json.dumps({"meta": {}, "arrays": [list(e) for e in entries]})) + meta_bytes
    return _layout(header, entries)[1] + ALIGN


def _reject_constant(name: str):
    raise WireError(f"header holds {name}: not JSON (finite numbers only)")


def unpack(body: bytes) -> tuple[dict, Shards]:
    """:func:`pack`'s ``(meta, arrays)``, the arrays read-only views into ``body``.

    Raises:
      WireError: ``body`` is not :func:`pack`'s format (module doc).
    """
    view = memoryview(body)
    if len(view) < len(MAGIC) + 4 or bytes(view[:4]) != MAGIC:
        raise WireError(f"not a holmes_jax body (magic {bytes(view[:4])!r}, {len(view)} bytes)")
    (header_len,) = struct.unpack("<I", view[4:8])
    if header_len > min(HEADER_MAX, len(view) - 8):
        raise WireError(f"header length {header_len} > the body's {len(view) - 8} bytes after it")
    try:
        header = json.loads(bytes(view[8 : 8 + header_len]), parse_constant=_reject_constant)
    except (UnicodeDecodeError, RecursionError, json.JSONDecodeError) as err:
        raise WireError(f"header is not JSON ({str(err).splitlines()[0][:80]})") from None
    if not isinstance(header, dict) or set(header) != {"meta", "arrays"}:
        raise WireError("header must be an object with exactly 'meta' and 'arrays'")
    meta, entries = header["meta"], header["arrays"]
    if not isinstance(meta, dict) or not isinstance(entries, list):
        raise WireError("header: 'meta' must be an object and 'arrays' a list")
    for entry in entries:
        _check_entry(entry)
    names = [e[0] for e in entries]
    if len(set(names)) != len(names):
        raise WireError("header names an array twice")
    offsets, total = _layout(header_len, entries)
    if total != len(view):
        raise WireError(f"header describes {total} bytes, the body has {len(view)}")
    arrays = {}
    for (name, dtype, shape), offset in zip(entries, offsets, strict=True):
        count = math.prod(shape)
        arr = np.frombuffer(body, DTYPES[dtype], count, offset).reshape(shape)
        arrays[name] = arr
    return meta, arrays


def _check_entry(entry) -> None:
    ok = isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
    if not ok:
        raise WireError(f"array entry {str(entry)[:60]}: must be [name, dtype, shape]")
    name, dtype, shape = entry
    if dtype not in DTYPES:
        raise WireError(f"array {name[:60]!r}: dtype {str(dtype)[:20]!r} not one of {list(DTYPES)}")
    dims_ok = isinstance(shape, list) and len(shape) <= MAX_DIMS
    if not dims_ok or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape):
        raise WireError(f"array {name[:60]!r}: shape {str(shape)[:60]} is not a list of sizes")
