"""The sparse outer format: its round trip and bound per chunk, its checks of a peer's
arrays, and error feedback (nothing lost over rounds)."""

import math

import numpy as np
import pytest

from holmes_jax.diloco import sparse
from holmes_jax.diloco.sparse import Feedback, Sparse, check, decode, nonzero, top_k

SHAPES = [(4096,), (3, 1000), (7,), (64, 65)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bits", [2, 4, 8, 32])
def test_top_k_keeps_each_chunk_s_largest_within_half_a_step(shape, bits):
    sp = Sparse(chunk=256, k=16, bits=bits)
    u = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    parts = top_k(u, sp)
    assert check(parts, shape, sp, bits, delta=True) == ""
    got = decode(parts, shape, sp, bits)
    flat, dec = u.reshape(-1), got.reshape(-1)
    for c, length in enumerate(sp.lengths(flat.size)):
        part, back = flat[c * 256 : c * 256 + length], dec[c * 256 : c * 256 + length]
        kept = np.argsort(-np.abs(part), kind="stable")[: math.ceil(16 * length / 256)]
        assert set(np.flatnonzero(back)) <= set(kept)  # only the k largest are sent
        scale = parts["scale"][c]
        bound = 0 if bits == 32 else scale / 2 * (1 + 1e-6)
        assert np.abs(back[kept] - part[kept]).max() <= bound
        if bits != 32:
            assert scale == pytest.approx(np.abs(part[kept]).max() / sparse.levels(bits))


def test_every_value_at_32_bits_is_exact_and_the_default_is_8x_and_k_64_139x_smaller():
    u = np.random.default_rng(1).standard_normal((5, 300)).astype(np.float32)
    sp = Sparse(chunk=64, k=64, bits=32)  # k = chunk: nothing dropped
    assert np.array_equal(decode(top_k(u, sp), u.shape, sp, 32), u)
    big = np.random.default_rng(2).standard_normal(1 << 20).astype(np.float32)
    for sp, ratio in [(Sparse(), 7.97), (Sparse(k=64, bits=2), 138.8)]:
        sent = sum(a.nbytes for a in top_k(big, sp).values())
        assert big.nbytes / sent == pytest.approx(32 / sp.bits_per_value(big.size), rel=1e-3)
        assert big.nbytes / sent == pytest.approx(ratio, abs=0.1)


@pytest.mark.parametrize("pieces", [2, 4, 8])
def test_a_tensor_cut_into_fragments_sends_what_it_sends_whole(pieces):
    """A fragment's delta costs its share of the parameters: a short chunk sends
    ceil(k·length/chunk) values, so cutting a (8, 128) norm or an (8, 128, 512) kernel
    into layer ranges adds at most one value per piece, not k."""
    sp = Sparse(chunk=4096, k=64, bits=2)
    for shape in [(8, 128), (8, 128, 512), (8, 3, 4, 32)]:
        whole = int(sp.counts(math.prod(shape)).sum())
        per = math.prod(shape) // pieces
        cut = int(sum(sp.counts(per).sum() for _ in range(pieces)))
        assert whole <= cut <= whole + pieces
        u = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
        assert int(top_k(u, sp)["count"].astype(np.int64).sum()) == whole


def test_a_step_sends_every_nonzero_of_the_mean():
    sp = Sparse(chunk=32, k=4, bits=2)
    mean = np.zeros(100, np.float32)
    mean[[0, 3, 31, 32, 99]] = [1.0, -2.0, 0.5, 4.0, -0.25]
    parts = nonzero(mean, sp)
    assert parts["count"].tolist() == [3, 1, 0, 1]
    assert check(parts, (100,), sp, sp.step_bits, delta=False) == ""
    assert check(parts, (100,), sp, sp.step_bits, delta=True).startswith("count:")
    got = decode(parts, (100,), sp, sp.step_bits)
    assert np.array_equal(np.flatnonzero(got), [0, 3, 31, 32, 99])
    assert np.abs(got - mean).max() <= 2.0 / sparse.levels(8) / 2 * (1 + 1e-6)


def test_bad_parts_are_named():
    sp = Sparse(chunk=16, k=4, bits=4)
    u = np.arange(40, dtype=np.float32)
    good = top_k(u, sp)

    def broken(**change):
        return check({**good, **change}, (40,), sp, 4, delta=True)

    assert broken(count=good["count"].astype(np.int32)).startswith("count: int32")
    assert "ceil(k=4" in broken(count=np.array([4, 4, 3], np.uint16))
    assert broken(val=good["val"][:-1]).startswith("val: uint8")
    assert broken(scale=np.array([1, np.nan, 1], np.float32)).startswith("scale:")
    assert broken(scale=np.array([1, -1, 1], np.float32)).startswith("scale:")
    positions = sparse.unpack_bits(good["idx"], 4, 10)  # 4 + 4 + ceil(4·8/16)
    backwards = positions.copy()
    backwards[[0, 1]] = backwards[[1, 0]]
    assert "increase" in broken(idx=sparse.pack_bits(backwards, 4))
    past = positions.copy()
    past[-1] = 15  # the last chunk holds 8 values
    assert "past its chunk" in broken(idx=sparse.pack_bits(past, 4))
    fp32 = top_k(u, Sparse(16, 4, 32))
    fp32["val"] = fp32["val"].copy()
    fp32["val"][0] = np.inf
    assert "non-finite" in check(fp32, (40,), Sparse(16, 4, 32), 32, delta=True)


def test_error_feedback_loses_nothing_over_rounds():
    """Dropped mass reappears: the values sent over the rounds sum to the deltas' sum
    minus the last buffer, and a round closed without the island puts its values back."""
    sp = Sparse(chunk=64, k=4, bits=2)
    rng = np.random.default_rng(3)
    fb = Feedback(sp)
    deltas, sent = [], []
    for _ in range(30):
        d = rng.standard_normal((3, 50)).astype(np.float32)
        parts, values = fb.encode("w#0", d)
        deltas.append(d)
        sent.append(values)
    np.testing.assert_allclose(sum(sent) + fb.buffers["w#0"], sum(deltas), rtol=0, atol=1e-4)
    before = fb.buffers["w#0"].copy()
    _, values = fb.encode("w#0", np.zeros((3, 50), np.float32))
    fb.unsent({"w#0": values})  # the round closed without it
    np.testing.assert_allclose(fb.buffers["w#0"], before, rtol=0, atol=1e-6)
    fb.clear()
    assert fb.buffers == {}


def test_bits_pack_and_unpack():
    codes = np.random.default_rng(4).integers(0, 1 << 12, 1001).astype(np.uint32)
    packed = sparse.pack_bits(codes, 12)
    assert packed.size == math.ceil(1001 * 12 / 8)
    assert np.array_equal(sparse.unpack_bits(packed, 12, 1001), codes)


def test_a_peer_s_sparse_delta_is_checked_before_it_is_decoded():
    """The messages' rules for a sparse delta and step: four arrays (every key's parts
    joined), cut by the counts into each key's parts, each checked (one line naming the
    array), the step's encoding named; the bound on a delta's body
    (:meth:`Rounds.max_body`) holds the largest a real delta packs to."""
    from holmes_jax.diloco.messages import Expect, Refused, parse_delta, parse_step
    from holmes_jax.diloco.rounds import Rounds, SyncConfig
    from holmes_jax.diloco.wire import pack

    sp = Sparse(chunk=16, k=3, bits=2)
    shapes = {"w#0": (5, 7), "b#0": (3,)}
    ex = Expect(shapes, "sparse", frozenset({0, 1}), 100, 0.7, 0.9, sp)
    rng = np.random.default_rng(5)
    deltas = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    arrays = sparse.join({k: top_k(d, sp) for k, d in deltas.items()})
    assert sorted(arrays) == ["count", "idx", "scale", "val"]
    meta = {"island": 1, "round": 1, "lineage": "root", "tokens": 10, "dead": []}
    got = parse_delta(meta, arrays, 1, ex)
    for k, d in deltas.items():
        assert np.array_equal(got.values[k], decode(top_k(d, sp), d.shape, sp, 2))
    cfg = SyncConfig(outer_dtype="sparse", sparse=sp)
    state = ({k: np.zeros(s, np.float32) for k, s in shapes.items()},) * 2
    assert len(pack(meta, arrays)) <= Rounds(0, [0, 1], cfg, state).max_body("/delta")

    counts = np.array([1, 4, 2, 1], np.uint16)  # b#0's chunk, then w#0's three: total kept
    with pytest.raises(Refused, match=r"array w#0\|count: must be ceil"):
        parse_delta(meta, {**arrays, "count": counts}, 1, ex)
    short = {**arrays, "idx": arrays["idx"][:-1]}
    with pytest.raises(Refused, match=r"arrays idx: \d+ entries, the counts make \d+"):
        parse_delta(meta, short, 1, ex)
    bad = dict(arrays)
    del bad["scale"]
    with pytest.raises(Refused, match=r"arrays: 1 of the lane's keys missing \['scale'\]"):
        parse_delta(meta, bad, 1, ex)
    step = {"round": 1, "tokens": 10, "average": False, "leader": 0, "members": [0, 1]}
    step.update(lr=0.7, mu=0.9, encoding="fp16")
    with pytest.raises(Refused, match="encoding=fp16: a step of this run is sparse or int8"):
        parse_step(step, arrays, ex)
