"""The batch digest (``data_digest``): the same tokens in the same places give the same
digest however the batch is sharded, and a moved token or row changes it."""

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from holmes_jax.runtime.data.digest import batch_digest, combine

M32 = (1 << 32) - 1


def mix(x: int) -> int:
    """MurmurHash3's finalizer in Python integers (the reference the jax code must match)."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def reference(batch: np.ndarray) -> int:
    flat = batch.reshape(-1).tolist()
    return sum(mix(mix(p) ^ int(t)) for p, t in enumerate(flat)) & M32


def test_the_digest_is_the_reference_sum_under_any_sharding():
    batch = np.random.default_rng(0).integers(0, 50304, (16, 33)).astype(np.int32)
    want = reference(batch)
    digest = jax.jit(batch_digest, static_argnums=1)
    mesh = jax.make_mesh(
        (4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )  # as the program's
    for spec, parts in (
        (PartitionSpec(), 1),
        (PartitionSpec(("a", "b")), 8),
        (PartitionSpec("b"), 2),
    ):
        sharded = jax.device_put(batch, NamedSharding(mesh, spec))
        got = digest(sharded, parts)
        assert got.shape == (parts,) and combine(got) == want, spec
    assert combine(np.uint32(want)) == want


def test_a_moved_token_or_row_changes_the_digest():
    batch = np.random.default_rng(1).integers(0, 256, (8, 17)).astype(np.int32)
    base = combine(batch_digest(batch))
    swapped = batch.copy()
    swapped[2, [3, 4]] = swapped[2, [4, 3]]
    rows = batch[[1, 0, *range(2, 8)]]
    changed = batch.copy()
    changed[7, 16] ^= 1
    assert batch[2, 3] != batch[2, 4] and not np.array_equal(batch[0], batch[1])
    for other in (swapped, rows, changed):
        assert combine(batch_digest(other)) != base
    assert combine(batch_digest(batch.copy())) == base
