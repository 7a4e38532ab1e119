"""The pipeline tick loop's buffers: in-place guards, 16-bit bit patterns, slot access, residuals.

The engine (:mod:`holmes_jax.runtime.engine.pipeline`) carries its big buffers through a
tick loop; per stage, with K = ``Schedule.buffer_slots`` and an activation
``[mb, T, H]``:

    res      [K, slots, ...]   one per buffered leaf of a layer's vjp (``Residuals``)
    xbox     [Kx, mb, T, H]    activations waiting for FWD (slot from the schedule's tables)
    gbox     [Kg, mb, T, H]    gradients waiting for BWD
    head_ct  [K, mb, T, H]     last virtual stage: dloss/dx of each microbatch
    stash    [Kw, slots, ...]  zb: what of W's inputs from B the residual slot cannot
                               hold (``StashLayout``; none under remat none)

Invariant: they are only ever updated in place. What keeps them so:

- ``when``: every "if" in the loop is a 0-or-1-trip while loop, which XLA aliases, where
  ``lax.cond`` / ``lax.switch`` would copy each buffer that one branch writes and another
  passes through, every tick. Its ``operands`` keep XLA's loop-invariant code motion from
  hoisting guarded work out of the loop.
- ``put`` / ``get``: one ``[k, j]`` cell as one dynamic_update_slice / dynamic_slice,
  never a copy of ``buf[k]``; ``dyn_index`` / ``dyn_set`` do one index of a whole tree.
- ``to_bits`` / ``from_bits``: 16-bit floats are stored as their uint16 bit patterns: free
  on GPU, and it keeps XLA:CPU from holding f32 copies of them, so the compiled memory
  analysis the memory model is checked against matches a GPU's.

``Residuals`` decides what of a layer's ``jax.vjp`` goes into ``res``: its array leaves
that are not the layer's weights, i.e. exactly what the ``model.remat`` policy saves.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

# --------------------------------------------------------------------------- guards


def when(pred, body, carry, operands=None):
    """``body(carry)`` if ``pred`` else ``carry``, as a 0-or-1-trip while loop (in place).

    With ``operands``, ``body(carry, operands)``: every value the body computes from
    that is not in ``carry`` must come in ``operands``. XLA's loop-invariant code motion
    hoists work whose inputs are all loop-invariant out of a while loop, where it then
    runs whatever ``pred`` says (a gradient reduction on every micro-batch, the LM head on
    every stage). The loop zeroes ``operands`` after its one trip, so they are
    loop-variant and the work stays inside.
    """
    n = pred.astype(jnp.int32)
    if operands is None:
        return lax.fori_loop(0, n, lambda _, c: body(c), carry)

    def once(_, state):
        c, ops = state
        return body(c, ops), jax.tree.map(jnp.zeros_like, ops)

    return lax.fori_loop(0, n, once, (carry, operands))[0]


# --------------------------------------------------------------------------- storage


def to_bits(x):
    """16-bit floats as their uint16 bit patterns (other dtypes unchanged).

    The engine's big buffers (residuals, inbox, head cotangents) are stored this way:
    XLA:CPU rewrites a bf16 dynamic-update-slice into f32 and keeps an f32 copy of the whole
    buffer, which would double its bytes in the compiled memory analysis that the memory
    model is checked against. On GPU the bitcast is free.
    """
    if jnp.dtype(x.dtype).itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating):
        return lax.bitcast_convert_type(x, jnp.uint16)
    return x


def from_bits(x, dtype):
    """Inverse of :func:`to_bits` for a value of ``dtype``."""
    return lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def put(buf, value, k, j):
    """buf[k, j] = value, as one in-place dynamic_update_slice. buf [K, slots, ...]."""
    zeros = (0,) * value.ndim
    return lax.dynamic_update_slice(buf, to_bits(value)[None, None], (k, j, *zeros))


def get(buf, k, j):
    """buf[k, j] as one dynamic_slice (no copy of buf[k])."""
    zeros = (0,) * (buf.ndim - 2)
    return lax.dynamic_slice(buf, (k, j, *zeros), (1, 1, *buf.shape[2:]))[0, 0]


def dyn_index(tree, i):
    """``tree[i]`` on every leaf's leading axis (traced ``i``)."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def dyn_set(tree, i, value):
    """``tree[i] = value`` on every leaf's leading axis, in place (traced ``i``)."""
    return jax.tree.map(lambda a, v: lax.dynamic_update_index_in_dim(a, v, i, 0), tree, value)


# --------------------------------------------------------------------------- residuals


class Residuals:
    """Split a layer's ``jax.vjp`` function into bufferable arrays and the rest.

    The vjp function is a pytree whose leaves are its residuals. Leaves that *are* the
    layer's weights are not buffered (the backward takes the weights again); non-array
    leaves are static. A dropout PRNG key (kept when the remat policy recomputes the
    dropout) is buffered as its raw ``uint32`` key data and wrapped again on the way out.
    The template comes from one trace of the layer; every later trace of the same layer
    has the same structure, which ``split`` checks.
    """

    def __init__(self, vjp_fn, weights):
        leaves, self.treedef = jax.tree.flatten(vjp_fn)
        self.kinds = self._classify(leaves, weights)
        self.static = [
            None if k[0] != "static" else leaf for k, leaf in zip(self.kinds, leaves, strict=True)
        ]
        # Per buffered leaf: its PRNG implementation when it is a key, else None.
        self.key_impls = [
            jax.random.key_impl(leaf) if _is_key(leaf) else None
            for k, leaf in zip(self.kinds, leaves, strict=True)
            if k[0] == "buf"
        ]
        self.buffered = [
            jax.ShapeDtypeStruct(r.shape, r.dtype)
            for r in self._raw(
                [leaf for k, leaf in zip(self.kinds, leaves, strict=True) if k[0] == "buf"]
            )
        ]

    @staticmethod
    def _raw(leaves):
        """Buffered leaves as plain arrays: PRNG keys as their key data."""
        return [jax.random.key_data(x) if _is_key(x) else x for x in leaves]

    @staticmethod
    def _classify(leaves, weights):
        ids = {id(w): n for n, w in enumerate(jax.tree.leaves(weights))}
        kinds = []
        for leaf in leaves:
            if id(leaf) in ids:
                kinds.append(("weight", ids[id(leaf)]))
            elif isinstance(leaf, jax.Array):
                kinds.append(("buf",))
            else:
                kinds.append(("static",))
        return kinds

    def split(self, vjp_fn, weights) -> list[jax.Array]:
        """The buffered leaves of ``vjp_fn`` (``buffered``'s shapes, in order)."""
        leaves = jax.tree.leaves(vjp_fn)
        if self._classify(leaves, weights) != self.kinds:
            raise RuntimeError("pipeline: layer vjp residual structure changed between traces")
        return self._raw(
            [leaf for k, leaf in zip(self.kinds, leaves, strict=True) if k[0] == "buf"]
        )

    def join(self, buffered: list[jax.Array], weights):
        """The vjp function again from its buffered leaves and the layer's weights."""
        w = jax.tree.leaves(weights)
        it = iter(
            x if impl is None else jax.random.wrap_key_data(x, impl=impl)
            for x, impl in zip(buffered, self.key_impls, strict=True)
        )
        leaves = [
            next(it) if k[0] == "buf" else w[k[1]] if k[0] == "weight" else s
            for k, s in zip(self.kinds, self.static, strict=True)
        ]
        return jax.tree.unflatten(self.treedef, leaves)


def _is_key(x) -> bool:
    """A typed PRNG key array (``jax.random.key``), which cannot be stored as bits."""
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


# --------------------------------------------------------------------------- zb stash


class StashLayout:
    """Where zb's B keeps what W needs: in the residual slot's B-only leaves, where it can.

    Between a micro-batch's B and W (ZB-H1), its residual slot stays held for W, but the
    leaves only B reads (``SplitBackward.w_reads`` names the others) are dead once B has
    run that layer. B writes the stash there, in the same ``res[.][k, j]`` cells: the
    B-only leaves of a layer are one stream (each leaf's contents, in order) and the
    stash values are laid out along it, a value possibly spanning two leaves. W reads them
    back from the same cells. The stream is made of words of the widest unsigned type
    whose size divides every leaf's and value's item size (``uint32`` when all are 4-byte
    floats, ``uint16`` with bf16 among them): a bitcast between equal widths is free, where
    one to bytes is a shift per byte on XLA:CPU. Values that do not fit go to a separate
    ``[Kw, slots, ...]`` buffer per value (``leftover``), indexed by the schedule's stash
    slot.

    With ``remat: none`` a layer's B-only leaves are ~3x its stash: nothing is left over
    and zb keeps 1F1B's activation memory. Under ``selective`` / ``full`` the policy saved
    little that only B reads (the stash, the cotangents of every weight matmul, is then
    larger than the residuals), so most of it is left over: zb costs memory there.
    """

    def __init__(self, buffered, w_reads, stash):
        """``buffered``: the residual leaves' shapes (``Residuals.buffered``); ``w_reads``:
        indices of those W reads; ``stash``: B's values for W (``SplitBackward.stash``)."""
        self.stash = list(stash)
        kept = [n for n, r in enumerate(buffered) if n not in w_reads and _nbytes(r) >= _MIN_BIN]
        self.buffered = list(buffered)
        self.word = _word([buffered[n] for n in kept] + self.stash)  # the stream's dtype
        self.bins = [(n, self._words(buffered[n])) for n in kept]  # (leaf, words)
        capacity = sum(size for _, size in self.bins)
        self.offsets: dict[int, int] = {}  # stash index -> word offset in the stream
        used = 0
        for n in sorted(range(len(self.stash)), key=lambda n: -_nbytes(self.stash[n])):
            if used + self._words(self.stash[n]) <= capacity:
                self.offsets[n] = used
                used += self._words(self.stash[n])
        self.packed_bytes = used * jnp.dtype(self.word).itemsize  # per layer, in the slot
        self.leftover = [n for n in range(len(self.stash)) if n not in self.offsets]
        self.pieces: list[_Piece] = []  # where each value's words lie, in stream order
        start = 0
        for leaf, size in self.bins:
            for n, off in sorted(self.offsets.items(), key=lambda item: item[1]):
                lo, hi = max(off, start), min(off + self._words(self.stash[n]), start + size)
                if lo < hi:
                    self.pieces.append(_Piece(n, lo - off, hi - off, leaf, lo - start))
            start += size

    def _words(self, s) -> int:
        """Words of the stream that ``s`` (a shape with a dtype) takes."""
        return _nbytes(s) // jnp.dtype(self.word).itemsize

    def write(self, res, values, k, j):
        """B: the packed stash ``values`` (all of them, in ``stash`` order) into the B-only
        cells ``res[.][k, j]``; returns ``res``. Bins beyond the packed bytes are left as
        they are."""
        if not self.offsets:
            return res
        # Every value exists before any bin is written: fused into the writes, each would
        # read the others' cells (the values come from this layer's residuals), a cycle
        # XLA breaks by copying whole residual buffers.
        words = lax.optimization_barrier({n: _as_words(values[n], self.word) for n in self.offsets})
        res = list(res)
        for leaf, size in self.bins:
            # the pieces of the values that fall in this bin, in stream order; one bin's
            # concatenation is the update of its one in-place write
            parts = [words[p.value][p.lo : p.hi] for p in self.pieces if p.leaf == leaf]
            if not parts:
                break
            filled = sum(p.shape[0] for p in parts)
            if filled < size:
                parts.append(jnp.zeros((size - filled,), self.word))
            content = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
            cell = jax.ShapeDtypeStruct(self.buffered[leaf].shape, res[leaf].dtype)  # as stored
            res[leaf] = put(res[leaf], _from_words(content, cell), k, j)
        return res

    def leftover_buffers(self, slots: int, layers: int) -> list:
        """Zeroed ``[slots, layers, ...]`` buffers (as bits) of the values that do not fit,
        in ``leftover`` order: the ``stash`` argument of :meth:`store` and :meth:`load`."""
        return [
            to_bits(jnp.zeros((slots, layers, *self.stash[n].shape), self.stash[n].dtype))
            for n in self.leftover
        ]

    def store(self, res, stash, values, k, kw, j):
        """B: all of a layer's stash ``values`` (in ``stash`` order) kept for W: the packed
        ones over the B-only cells ``res[.][k, j]``, the leftovers at ``[kw, j]`` of their
        buffers. Returns ``(res, stash)``."""
        res = self.write(res, values, k, j)
        left = [values[n] for n in self.leftover]
        return res, [put(b, x, kw, j) for b, x in zip(stash, left, strict=True)]

    def load(self, res, stash, k, kw, j) -> list:
        """W: the values :meth:`store` kept for layer ``j``, in ``stash`` order."""
        kept = self.read(res, k, j)
        for b, n in zip(stash, self.leftover, strict=True):
            kept[n] = from_bits(get(b, kw, j), self.stash[n].dtype)
        return [kept[n] for n in range(len(self.stash))]

    def read(self, res, k, j) -> dict:
        """W: the packed stash values from ``res[.][k, j]``, by stash index."""
        out = {}
        cells: dict[int, jax.Array] = {}
        for n in self.offsets:
            pieces = []
            for p in self.pieces:
                if p.value == n:
                    if p.leaf not in cells:
                        cells[p.leaf] = _as_words(get(res[p.leaf], k, j), self.word)
                    pieces.append(cells[p.leaf][p.at : p.at + p.hi - p.lo])
            data = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)
            out[n] = _from_words(data, self.stash[n])
        return out


class _Piece(NamedTuple):
    """Words ``lo:hi`` of stash value ``value`` (flat, as words), stored in B-only leaf
    ``leaf`` from its word ``at`` on."""

    value: int
    lo: int
    hi: int
    leaf: int
    at: int


_MIN_BIN = 64  # bytes: scalar leaves (a dropout rate, a key) are not worth a bin


def _nbytes(s) -> int:
    return int(math.prod(s.shape)) * jnp.dtype(s.dtype).itemsize


_WORDS = {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}


def _word(arrays):
    """The widest of ``uint32``/``uint16``/``uint8`` whose size divides every item size of
    ``arrays`` (shapes with dtypes): the word a stream of all of them is made of."""
    size = math.gcd(4, *(jnp.dtype(a.dtype).itemsize for a in arrays))
    return _WORDS[size]


def _as_words(x, word):
    """Any array as flat ``[n] word`` (a bitcast and a reshape; ``word``'s size divides
    ``x``'s item size)."""
    x = x.reshape(-1)
    if x.dtype != word:
        x = lax.bitcast_convert_type(x, word).reshape(-1)
    return x


def _from_words(data, like):
    """Flat ``[n]`` words as an array of ``like``'s shape and dtype."""
    ratio = jnp.dtype(like.dtype).itemsize // jnp.dtype(data.dtype).itemsize
    if ratio > 1:
        data = data.reshape(-1, ratio)
    return lax.bitcast_convert_type(data, like.dtype).reshape(like.shape)
