"""The sparse outer format (``diloco.outer_dtype: sparse``): per chunk, the largest values
in a few bits, and what is not sent kept for the next round (error feedback).

A tensor of ``n`` values (flattened, C-order) is cut into ``C = ceil(n / chunk)`` chunks
of ``chunk`` values (the last may be shorter). An island's delta sends ``k`` values of
each whole chunk and ``ceil(k·length/chunk)`` of a shorter last one, so a tensor's bytes
follow its size, however finely fragments and lanes cut the model (:meth:`Sparse.counts`).
Each chunk sends ``count`` of its values:

- ``idx``: their positions in the chunk, increasing, ``log2(chunk)`` bits each;
- ``val``: ``bits``-bit codes ``q`` of the values, ``v ≈ (q − L)·s`` with
  ``L = (2^bits − 1)/2`` and one scale per chunk ``s = max|v| / L`` (``s = 1`` where the
  chunk sends only zeros), so ``|v − (q − L)·s| ≤ s/2``; ``bits = 32`` sends the fp32
  values themselves (``s = 1``);
- ``count`` (uint16 per chunk) and ``scale`` (fp32 per chunk).

``idx`` and ``val`` are bit-packed, little-endian, ``count.sum()`` entries each, so an
island's delta at the default (chunk 4096, k 1024, 4 bits) is
``(1024·(12 + 4) + 16 + 32) / 4096`` bits a value, 8x fewer bytes than fp32; at k 64 and
2 bits ``(64·(12 + 2) + 16 + 32) / 4096``, 139x. A message
carries every tensor's parts as four arrays (:func:`join`: each part concatenated over
the tensors in key order, each tensor's ``idx`` and ``val`` whole bytes), so its framing
does not grow with the tensor count; :func:`split` cuts them apart again.

An island's delta sends the ``k`` values of largest magnitude of each chunk
(:func:`top_k`). A leader's step relays the other islands' deltas as they were sent, or
sends every nonzero of the mean at ``max(bits, 8)`` bits (:func:`nonzero`), or the mean
dense in ``int8`` / ``fp32``, whichever is smallest (:mod:`holmes_jax.diloco.rounds`).

Error feedback (:class:`Feedback`): an island sends the encoding of ``u = Δ + e`` and
keeps ``e ← u − decode(sent)``; what it sends over the rounds sums to the sum of its
deltas minus its last buffer.

:func:`decode` trusts its input's structure; :func:`holmes_jax.diloco.messages` checks a
peer's arrays (:func:`check`) before any is decoded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

PARTS = ("count", "idx", "val", "scale")
SEP = "|"  # how a refusal names a key's part: "<lane key>|<part>"


@dataclass(frozen=True)
class Sparse:
    """The format's parameters (``diloco.sparse_chunk``, ``sparse_k``, ``sparse_bits``)."""

    chunk: int = 4096
    k: int = 1024
    bits: int = 4

    @property
    def index_bits(self) -> int:
        return self.chunk.bit_length() - 1

    @property
    def step_bits(self) -> int:
        """The value bits of a leader's step (the mean of several islands' values)."""
        return max(self.bits, 8)

    def lengths(self, n: int) -> np.ndarray:
        """Each chunk's length, int64 ``[C]``."""
        c = max(math.ceil(n / self.chunk), 1)
        out = np.full(c, self.chunk, np.int64)
        out[-1] = n - (c - 1) * self.chunk
        return out

    def counts(self, n: int) -> np.ndarray:
        """The values an island's delta sends of each chunk, int64 ``[C]``: ``k`` of a whole
        chunk, ``ceil(k·length/chunk)`` of a shorter one (``length`` at ``k = chunk``)."""
        return -(-self.k * self.lengths(n) // self.chunk)

    def bits_per_value(self, n: int = 1 << 24) -> float:
        """An island's delta: bits sent per value of a tensor of ``n`` values."""
        sent = self.counts(n)
        per_chunk = 16 + 32  # count, scale
        total = sent.sum() * (self.index_bits + self.bits) + len(sent) * per_chunk
        return float(total / n)


def levels(bits: int) -> float:
    """``L = (2^bits − 1) / 2``: codes ``0 .. 2L`` stand for ``(q − L)·s``."""
    return (2**bits - 1) / 2


def part_shapes(n: int, sp: Sparse, counts: np.ndarray, bits: int) -> dict[str, tuple]:
    """Each part's dtype name and shape for a tensor of ``n`` values sending ``counts``."""
    total = int(counts.sum())
    c = len(counts)
    val = ("float32", (total,)) if bits == 32 else ("uint8", (math.ceil(total * bits / 8),))
    return {
        "count": ("uint16", (c,)),
        "idx": ("uint8", (math.ceil(total * sp.index_bits / 8),)),
        "val": val,
        "scale": ("float32", (c,)),
    }


def join(by_key: dict[str, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Every key's parts as one array per part, concatenated in sorted key order."""
    keys = sorted(by_key)
    return {p: np.concatenate([by_key[k][p] for k in keys]) for p in PARTS} if keys else {}


def split(
    joined: dict[str, np.ndarray], shapes: dict[str, tuple], sp: Sparse, bits: int
) -> dict[str, dict[str, np.ndarray]] | str:
    """:func:`join`'s arrays cut into each key's parts (``shapes``: the keys and their
    tensors' shapes), or what is wrong with them: a part's dtype, or lengths that are not
    what the chunks and counts make. Each key's parts are then for :func:`check`."""
    chunks = {k: len(sp.lengths(math.prod(shapes[k]))) for k in sorted(shapes)}
    count = joined["count"]
    total_c = sum(chunks.values())
    for name, dtype in (("count", np.uint16), ("scale", np.float32)):
        got = joined[name]
        if got.dtype != dtype or got.shape != (total_c,):
            want = np.dtype(dtype).name
            return f"{name}: {got.dtype.name}{list(got.shape)}, must be {want}[{total_c}]"
    val_dtype = np.float32 if bits == 32 else np.uint8
    for name, dtype in (("idx", np.uint8), ("val", val_dtype)):
        got = joined[name]
        if got.dtype != dtype or got.ndim != 1:
            return f"{name}: {got.dtype.name}{list(got.shape)}, must be 1-D {np.dtype(dtype).name}"
    out, c0, at = {}, 0, {"idx": 0, "val": 0}
    for k, c in chunks.items():
        counts = count[c0 : c0 + c].astype(np.int64)
        sizes = part_shapes(math.prod(shapes[k]), sp, counts, bits)
        parts = {"count": count[c0 : c0 + c], "scale": joined["scale"][c0 : c0 + c]}
        for name in at:
            (size,) = sizes[name][1]
            parts[name] = joined[name][at[name] : at[name] + size]
            at[name] += size
        out[k], c0 = parts, c0 + c
    for name, used in at.items():
        if joined[name].size != used:
            return f"{name}: {joined[name].size} entries, the counts make {used}"
    return out


def pack_bits(codes: np.ndarray, width: int) -> np.ndarray:
    """Unsigned ``codes`` < 2^width, ``width`` bits each, little-endian, as uint8."""
    shifts = np.arange(width, dtype=np.uint32)
    bits = ((codes.astype(np.uint32)[:, None] >> shifts) & 1).astype(np.uint8)
    return np.packbits(bits.reshape(-1), bitorder="little")


def unpack_bits(data: np.ndarray, width: int, count: int) -> np.ndarray:
    """:func:`pack_bits`'s ``count`` codes, uint32."""
    bits = np.unpackbits(data, count=count * width, bitorder="little").reshape(count, width)
    return bits.astype(np.uint32) @ (np.uint32(1) << np.arange(width, dtype=np.uint32))


def _padded(u: np.ndarray, sp: Sparse) -> np.ndarray:
    """``u`` flattened, zero-padded to whole chunks: ``[C, chunk]``."""
    flat = np.asarray(u, np.float32).reshape(-1)
    c = max(math.ceil(flat.size / sp.chunk), 1)
    out = np.zeros(c * sp.chunk, np.float32)
    out[: flat.size] = flat
    return out.reshape(c, sp.chunk)


def top_k(u: np.ndarray, sp: Sparse) -> dict[str, np.ndarray]:
    """An island's delta: each chunk's :meth:`Sparse.counts` values of largest magnitude."""
    chunks = _padded(u, sp)
    lengths = sp.lengths(np.size(u))
    keep = min(sp.k, sp.chunk)
    magnitude = np.abs(chunks)
    magnitude.reshape(-1)[np.size(u) :] = -1  # the padding: never chosen over a value
    pick = np.argpartition(-magnitude, keep - 1, axis=1)[:, :keep]  # [C, k]
    pick.sort(axis=1)
    counts = sp.counts(np.size(u))
    if counts[-1] < keep:  # the short last chunk: its own share, of its first ``length``
        last = np.argsort(-np.abs(chunks[-1, : lengths[-1]]), kind="stable")[: counts[-1]]
        rows = [pick[i] for i in range(len(pick) - 1)] + [np.sort(last)]
        positions = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    else:
        positions = pick.reshape(-1)
    return _encode(chunks, counts, positions, sp, sp.bits)


def nonzero(u: np.ndarray, sp: Sparse) -> dict[str, np.ndarray]:
    """A leader's step: every nonzero value, at :attr:`Sparse.step_bits` (module doc)."""
    chunks = _padded(u, sp)
    mask = chunks != 0
    counts = mask.sum(axis=1)
    positions = np.nonzero(mask)[1]  # row-major: chunk by chunk, increasing
    return _encode(chunks, counts, positions, sp, sp.step_bits)


def _encode(chunks, counts, positions, sp: Sparse, bits: int) -> dict[str, np.ndarray]:
    rows = np.repeat(np.arange(len(chunks)), counts)
    values = chunks[rows, positions]  # [total]
    out = {"count": counts.astype(np.uint16)}
    out["idx"] = pack_bits(positions, sp.index_bits)
    if bits == 32:
        out["val"], out["scale"] = values.astype(np.float32), np.ones(len(chunks), np.float32)
        return out
    lv = levels(bits)
    absmax = np.zeros(len(chunks), np.float32)
    full = counts > 0
    if full.any():  # each chunk's max |value|: one reduction per nonempty segment
        starts = (np.cumsum(counts) - counts)[full]
        absmax[full] = np.maximum.reduceat(np.abs(values), starts)
    scale = np.where(absmax > 0, absmax / np.float32(lv), np.float32(1)).astype(np.float32)
    codes = np.clip(np.round(values / scale[rows] + lv), 0, 2 * lv)
    out["val"], out["scale"] = pack_bits(codes.astype(np.uint32), bits), scale
    return out


def decode(parts: dict[str, np.ndarray], shape: tuple, sp: Sparse, bits: int) -> np.ndarray:
    """The fp32 tensor of ``shape`` that ``parts`` encode (unsent values zero)."""
    n = math.prod(shape)
    counts = parts["count"].astype(np.int64)
    total = int(counts.sum())
    rows = np.repeat(np.arange(len(counts)), counts)
    positions = unpack_bits(parts["idx"], sp.index_bits, total)
    if bits == 32:
        values = parts["val"].astype(np.float32)
    else:
        codes = unpack_bits(parts["val"], bits, total).astype(np.float32)
        values = (codes - np.float32(levels(bits))) * parts["scale"][rows]
    out = np.zeros(len(counts) * sp.chunk, np.float32)
    out[rows * sp.chunk + positions] = values
    return out[:n].reshape(shape)


def check(parts: dict[str, np.ndarray], shape: tuple, sp: Sparse, bits: int, delta: bool) -> str:
    """What is wrong with a peer's ``parts`` of a tensor of ``shape`` ("" when nothing):
    each part's dtype and size; ``count`` exactly :meth:`Sparse.counts` for a delta,
    at most the chunk's length for a step; positions increasing inside each chunk and
    before its end; scales finite, positive and small enough to decode finite; 32-bit
    values finite."""
    n = math.prod(shape)
    lengths = sp.lengths(n)
    counts = parts["count"]
    if counts.dtype != np.uint16 or counts.shape != (len(lengths),):
        return f"count: {counts.dtype.name}{list(counts.shape)}, must be uint16[{len(lengths)}]"
    counts = counts.astype(np.int64)
    if delta and not np.array_equal(counts, sp.counts(n)):
        return f"count: must be ceil(k={sp.k}·length/chunk={sp.chunk}) in every chunk"
    if (counts > lengths).any():
        return "count: more values than the chunk holds"
    for name, (dtype, want) in part_shapes(n, sp, counts, bits).items():
        got = parts[name]
        if got.dtype != np.dtype(dtype) or got.shape != want:
            return f"{name}: {got.dtype.name}{list(got.shape)}, must be {dtype}{list(want)}"
    scale = parts["scale"]
    top = np.finfo(np.float32).max / max(levels(bits), 1.0)
    if not (np.isfinite(scale).all() and (scale > 0).all() and (scale <= top).all()):
        return "scale: must be finite, > 0 and decode within fp32's range"
    if bits == 32 and not np.isfinite(parts["val"]).all():
        return "val: holds non-finite values"
    total = int(counts.sum())
    rows = np.repeat(np.arange(len(counts)), counts)
    positions = unpack_bits(parts["idx"], sp.index_bits, total).astype(np.int64)
    if (positions >= lengths[rows]).any():
        return "idx: a position past its chunk's end"
    same = rows[1:] == rows[:-1]
    if (positions[1:][same] <= positions[:-1][same]).any():
        return "idx: positions must increase inside each chunk"
    return ""


class Feedback:
    """One island's error-feedback buffer on one lane: ``encode(key, Δ)`` sends
    ``u = Δ + e`` and keeps ``e ← u − decode(sent)``; :meth:`unsent` puts a round's values
    back when the round closed without them."""

    def __init__(self, sp: Sparse, buffers: dict[str, np.ndarray] | None = None):
        self.sp = sp
        self.buffers: dict[str, np.ndarray] = dict(buffers or {})
        self.generation = 0  # counts clears: values of a cleared buffer never come back

    def encode(self, key: str, delta: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """``(parts, decoded)``: the parts to send for ``delta`` and what they decode to."""
        u = np.asarray(delta, np.float32)
        if key in self.buffers:
            u = u + self.buffers[key]
        parts = top_k(u, self.sp)
        sent = decode(parts, u.shape, self.sp, self.sp.bits)
        self.buffers[key] = u - sent
        return parts, sent

    def encode_tree(self, delta: dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray]]:
        """:meth:`encode` of every key: the parts to send (:func:`join`'s four arrays) and
        the values they decode to."""
        by_key, values = {}, {}
        for k, d in delta.items():
            by_key[k], values[k] = self.encode(k, d)
        return join(by_key), values

    def unsent(self, values: dict[str, np.ndarray]) -> None:
        """A round closed without this island's values: they go back into the buffer."""
        for key, v in values.items():
            self.buffers[key] = self.buffers.get(key, 0) + v

    def clear(self) -> None:
        """A heal or a join: the island's progress (and what it kept of it) is dropped."""
        self.buffers = {}
        self.generation += 1
