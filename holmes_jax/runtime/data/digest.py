"""A checksum of each step's global batch, logged as ``data_digest``: two runs that log
the same digest at a step trained on the same tokens in the same places.

``digest = sum over tokens of mix(mix(position) ^ id) mod 2^32``, where ``position`` is
the token's index in the global ``[B, T + 1]`` batch and ``mix`` is MurmurHash3's 32-bit
finalizer (a bijection). The train step sums each batch shard's rows on the devices that
hold them (``[P]``, one partial sum per shard of the batch's rows: no collective in the
step, nothing crosses an island); the host adds the parts on the steps it logs
(:func:`combine`). An integer sum does not depend on how the batch is sharded or over how
many hosts: a resume, a restart on fewer hosts or a re-plan logs the digests of the
uninterrupted run when, and only when, it feeds the same batches.
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


def batch_digest(batch, parts: int = 1):
    """The digest of the global batch ``[B, T + 1]`` (module doc) in ``parts`` partial
    sums, uint32 ``[parts]``: part ``p`` sums rows ``[p·B/parts, (p + 1)·B/parts)``, so
    with ``parts`` = the batch's row shards each is computed where its rows are."""
    import jax.numpy as jnp

    rows, width = batch.shape
    where = jnp.arange(rows * width, dtype=jnp.uint32).reshape(rows, width)
    terms = _mix(_mix(where) ^ batch.astype(jnp.uint32))  # [B, T + 1]
    return terms.reshape(parts, -1).sum(axis=1, dtype=jnp.uint32)


def combine(value) -> int:
    """The digest of fetched partial sums: their sum mod 2^32."""
    return int(np.asarray(value, np.uint64).sum() % (1 << 32))
