"""zb's stash packed over a residual slot's B-only cells: words, round trip, leftovers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from holmes_jax.runtime.engine.buffers import StashLayout, to_bits

S = jax.ShapeDtypeStruct


@pytest.mark.parametrize(
    "res_dtype, stash_dtype, word",
    [
        (jnp.float32, jnp.float32, jnp.uint32),  # fp32 training: free bitcasts
        (jnp.bfloat16, jnp.bfloat16, jnp.uint16),
        (jnp.float32, jnp.bfloat16, jnp.uint16),  # mixed: the common 2-byte word
    ],
)
def test_stash_round_trips_through_the_b_only_cells(res_dtype, stash_dtype, word):
    # Residual leaves 0..3; W reads leaf 1, so 0, 2, 3 are bins (3 is below _MIN_BIN).
    buffered = [
        S((4, 8), res_dtype),
        S((4, 8), res_dtype),
        S((4, 12), res_dtype),
        S((2,), res_dtype),
    ]
    stash = [S((4, 10), stash_dtype), S((3, 4), stash_dtype), S((40, 40), stash_dtype)]
    lay = StashLayout(buffered, {1}, stash)
    assert lay.word == word
    assert [n for n, _ in lay.bins] == [0, 2]
    assert lay.leftover == [2]  # 3200 or 6400 B cannot fit in the 80-word bins
    res = [
        to_bits(jnp.full((3, 2, *b.shape), 7, b.dtype)) for b in buffered
    ]  # as the engine stores them
    rng = np.random.default_rng(0)
    values = [jnp.asarray(rng.normal(size=s.shape), s.dtype) for s in stash]
    res = lay.write(res, values, 1, 1)
    kept = lay.read(res, 1, 1)
    assert sorted(kept) == [0, 1]
    for n in (0, 1):
        assert kept[n].dtype == stash_dtype
        np.testing.assert_array_equal(np.asarray(kept[n]), np.asarray(values[n]))
    # Only cell [1, 1] of the bins changed; W's leaf and the other cells kept their 7s.
    np.testing.assert_array_equal(
        np.asarray(res[1]), np.asarray(to_bits(jnp.full((3, 2, 4, 8), 7, res_dtype)))
    )
    for n in (0, 2):
        mask = np.ones((3, 2), bool)
        mask[1, 1] = False
        seven = np.asarray(to_bits(jnp.full(res[n].shape, 7, res_dtype)))
        np.testing.assert_array_equal(np.asarray(res[n])[mask], seven[mask])
    packed = sum(np.prod(stash[n].shape) * jnp.dtype(stash_dtype).itemsize for n in (0, 1))
    assert lay.packed_bytes == packed
