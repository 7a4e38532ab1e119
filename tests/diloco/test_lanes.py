"""Lanes of the independent outer sync (:mod:`holmes_jax.diloco.lanes`): block ``ℓ`` of a
leaf is the same slice of its flattened, padded values whatever the plan, and the blocks
convert back to the model bit for bit."""

import math

import numpy as np
import pytest

from holmes_jax.core.errors import ConfigError
from holmes_jax.diloco.lanes import (
    QUANTUM,
    LaneLayout,
    block_size,
    lane_key,
    pieces,
    process_lanes,
)
from holmes_jax.diloco.schedule import key_fragment


def test_blocks_split_evenly_padded_to_the_quantum():
    assert block_size(1, 1) == QUANTUM
    assert block_size(100, 3) == 3 * QUANTUM  # 34 per lane, rounded up to 48
    for n in (1, 17, 4096, 10**6):
        assert all(block_size(n, lanes) * lanes >= n for lanes in (1, 2, 3, 8))
    assert list(process_lanes(4, 2, 1)) == [2, 3]
    assert list(process_lanes(2, 1, 0)) == [0, 1]
    with pytest.raises(ConfigError, match="list a multiple of 3 addresses"):
        process_lanes(4, 3, 0)


@pytest.fixture(scope="module")
def pipelined(tiny_config, make_program):
    """A 2-stage x data-4 program with ZeRO-1 (the logical model spread over the mesh) and a
    state whose every parameter is distinct."""
    import jax

    from holmes_jax.core.spec import Degrees

    cfg = tiny_config("parallel.stages=2", "parallel.data=4", "optimizer.zero1=true")
    program = make_program(cfg, Degrees(2, 4, 1))
    state = program.init(0)
    return program, program.model_to_logical(state), jax


@pytest.mark.parametrize("lanes,fragments", [(1, 1), (2, 1), (3, 1), (2, 2)])
def test_blocks_are_the_flattened_leaf_and_convert_back_exactly(pipelined, lanes, fragments):
    """Each block is its slice of the flattened, padded leaf (with fragments: of the
    leaf's piece, its range of layers), and the blocks convert back bit for bit."""
    program, model, jax = pipelined
    sharding = program.logical_model_sharding()
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, np.float32, sharding=s), model, sharding
    )
    layout = LaneLayout(program.mesh.devices.flat, abstract, sharding, lanes, fragments)
    layout.compile()
    assert list(layout.mine) == list(range(lanes))  # one process serves every lane
    host = layout.to_host(model)
    leaves = jax.tree_util.tree_flatten_with_path(model)[0]
    cut = [
        (key, np.asarray(leaf) if a < 0 else np.asarray(leaf)[a:b])
        for path, leaf in leaves
        for key, a, b in pieces(jax.tree_util.keystr(path, simple=True, separator="/"),
                                leaf.shape, fragments)
    ]  # fmt: skip
    stacked = sum(1 for path, _ in leaves if str(path[0].key) == "blocks")
    assert len(cut) == len(leaves) + (fragments - 1) * stacked == len(layout.paths)
    assert len(host) == lanes * len(cut)
    assert {key_fragment(k) for k in host} == set(range(fragments))
    for key, piece in cut:
        flat = piece.reshape(-1)
        b = block_size(flat.size, lanes)
        padded = np.zeros(lanes * b, np.float32)
        padded[: flat.size] = flat
        for lane in range(lanes):
            block = host[lane_key(key, lane)]
            np.testing.assert_array_equal(block, padded[lane * b : (lane + 1) * b])
    assert math.prod(np.shape(host[lane_key(layout.paths[0], 0)])) % QUANTUM == 0
    back = layout.from_host({k: v + 1.0 for k, v in host.items()})
    for got, want, s in zip(
        jax.tree.leaves(back), jax.tree.leaves(model), jax.tree.leaves(sharding), strict=True
    ):
        assert got.sharding == s
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want) + 1.0)
    summed = jax.tree.leaves(layout.add(model, back))
    for got, want in zip(summed, jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want + (np.asarray(want) + 1.0))


def test_peers_list_the_same_lane_count_for_every_island():
    from holmes_jax.core.config import load_config

    job = [
        "diloco.enabled=true",
        "diloco.mode=independent",
        "diloco.island=0",
        "diloco.insecure=true",
    ]
    cfg = load_config(None, [*job, "diloco.peers=['a:1,b:2','c:3,c:4']"])
    assert cfg.diloco.lane_addresses() == [[("a", 1), ("b", 2)], [("c", 3), ("c", 4)]]
    with pytest.raises(ConfigError, match=r"lane addresses \(island 0: 2, island 1: 1\)"):
        load_config(None, [*job, "diloco.peers=['a:1,b:2',c:3]"])
    with pytest.raises(ConfigError, match=r"diloco.peers\[0\]='a:1,b': each address must be"):
        load_config(None, [*job, "diloco.peers=['a:1,b',c:3]"])
