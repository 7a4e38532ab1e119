"""A checksum of each step's global batch, logged as ``data_digest``: two runs that log
the same digest at a step trained on the same tokens in the same places.

``digest = sum over tokens of mix(mix(position) ^ id) mod 2^32``, where ``position`` is
the token's index in the global ``[B, T + 1]`` batch and ``mix`` is MurmurHash3's 32-bit
finalizer (a bijection). It is computed inside the train step on the sharded batch, so it
costs an elementwise pass and a reduction, and an integer sum does not depend on how the
batch is sharded or over how many hosts: a resume, a restart on fewer hosts or a re-plan
logs the digests of the uninterrupted run when, and only when, it feeds the same batches.
Under DiLoCo each replica sums its own rows (``[R]``, no cross-island reduction in the
step) and the host adds them (:func:`combine`).
"""

from __future__ import annotations

import numpy as np

DIGEST = "data_digest"  # the metric's key


def _mix(x):
    """MurmurHash3's 32-bit finalizer, on uint32 (wrapping)."""
    import jax.numpy as jnp

    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def batch_digest(batch, replicas: int = 0):
    """The digest of the global batch ``[B, T + 1]`` (module doc): uint32 ``[]``, or
    ``[replicas]`` (each replica's ``B / replicas`` rows) when ``replicas`` > 0."""
    import jax.numpy as jnp

    rows, width = batch.shape
    where = jnp.arange(rows * width, dtype=jnp.uint32).reshape(rows, width)
    terms = _mix(_mix(where) ^ batch.astype(jnp.uint32))  # [B, T + 1]
    if replicas:
        return terms.reshape(replicas, -1).sum(axis=1, dtype=jnp.uint32)
    return terms.sum(dtype=jnp.uint32)


def combine(value) -> int:
    """The digest of a fetched value: a scalar, or the sum mod 2^32 of per-replica ones."""
    return int(np.asarray(value, np.uint64).sum() % (1 << 32))
