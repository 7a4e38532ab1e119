"""Compressed sends across islands (parallel.cross_island_dtype, runtime/engine/compress.py).

One compile per case: each format once and each schedule once (not their product); the
compiled train step is both read (the bytes crossing the islands) and run (two steps).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from holmes_jax.core.config import load_config
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.plan_request import plan_request
from holmes_jax.core.spec import Degrees
from holmes_jax.planner.formulas import wire_bytes
from holmes_jax.planner.grid import load_mesh_topology
from holmes_jax.planner.plans import predict_run
from holmes_jax.runtime.engine.compress import crossing_pairs, decode, encode
from holmes_jax.runtime.engine.mesh import build_mesh, device_islands
from holmes_jax.runtime.engine.traffic import permute_traffic
from holmes_jax.runtime.program import Program
from tests.common import TINY_RUN, mesh_path

BIGGER = ("model.num_layers=4", "train.global_batch_size=16")  # 4 virtual stages, data 4
TWO = f"parallel.mesh={mesh_path('cpu8-two-islands.yaml')}"


def test_round_trip_error_bounds():
    """int8: |x - q·s| <= s/2 per element; fp8 (e4m3, 3 mantissa bits): within 1/16 of the
    value plus half a subnormal step; bf16: 1/256 of the value. Zero rows stay zero."""
    rng = np.random.default_rng(0)
    # rows of very different magnitude (as in a residual stream), one row all zero
    x = rng.standard_normal((3, 5, 48)) * np.logspace(-3, 3, 5)[None, :, None]
    x[1, 2] = 0.0
    x = jnp.asarray(x, jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    err = {f: jnp.abs(decode(encode(x, f), f, jnp.float32) - x) for f in ("int8", "fp8", "bf16")}
    s = amax / 127
    assert bool(jnp.all(err["int8"] <= s / 2 * (1 + 1e-6)))
    assert float(jnp.nanmax(err["int8"] / s)) > 0.4  # the bound is tight: rounding happened
    s8 = amax / 448
    assert bool(jnp.all(err["fp8"] <= jnp.abs(x) / 16 + s8 * 2.0**-10))
    assert bool(jnp.all(err["bf16"] <= jnp.abs(x) / 256))
    for f in ("int8", "fp8", "bf16"):
        assert float(jnp.max(err[f][1, 2])) == 0.0
    assert encode(x, "int8").dtype == jnp.uint8 and encode(x, "int8").shape == (3, 5, 52)
    assert encode(x, "bf16").dtype == jnp.uint16


def test_bad_value_is_one_line():
    with pytest.raises(ConfigError) as e:
        load_config(None, [*TINY_RUN, "parallel.cross_island_dtype=int4"])
    msg = str(e.value)
    assert "parallel.cross_island_dtype" in msg and "int4" in msg and "\n" not in msg


def test_crossing_pairs_follow_the_mesh():
    """Two islands, two stages: both directions of the one boundary cross; two replicas
    (one per island): the stage axis stays inside an island and nothing crosses."""
    cfg = load_config(None, [*TINY_RUN, TWO])
    topology = load_mesh_topology(plan_request(cfg))
    assert crossing_pairs(build_mesh(Degrees(2, 4, 1)), topology) == {(0, 1), (1, 0)}
    assert crossing_pairs(build_mesh(Degrees(2, 2, 1, replica=2)), topology) == frozenset()
    assert crossing_pairs(build_mesh(Degrees(2, 4, 1)), None) == frozenset()


def _batch(cfg, step):
    rng = np.random.default_rng(step)
    return rng.integers(
        0,
        cfg.model.vocab_size,
        (cfg.train.global_batch_size, cfg.model.seq_len + 1),
        dtype=np.int32,
    )


def _train(cfg, degrees, steps=2):
    """Compile the train step once; returns (HLO text, mesh, losses of ``steps`` steps)."""
    mesh = build_mesh(degrees)
    prog = Program(cfg, mesh)
    compiled = prog.lower_train_step().compile()
    state, losses = prog.init(0), []
    with prog.context():
        for step in range(steps):
            batch = jax.device_put(_batch(cfg, step), prog.shardings.batch)
            state, metrics = compiled(state, batch)
            losses.append(float(metrics["loss"]))
    return compiled.as_text(), mesh, losses


@pytest.fixture(scope="module")
def exact():
    """Losses of the unpipelined model on one device (the reference)."""
    cfg = load_config(None, [*TINY_RUN, *BIGGER])
    return _train(cfg, Degrees(1, 1, 1))[2]


# format, schedule, split, (stages, data, tensor), precision, loss tolerance (relative)
CASES = [
    ("bf16", "gpipe", "[2,2]", (2, 4, 1), "fp32", 2e-3),
    ("int8", "1f1b", "[1,3]", (2, 2, 2), "fp32", 5e-3),  # uneven, tensor 2
    ("fp8", "interleaved", "[1,1,1,1]", (2, 4, 1), "bf16", 3e-2),  # wrap-around hop
    ("int8", "zb", "[3,1]", (2, 4, 1), "fp32", 5e-3),
]


@pytest.mark.parametrize("fmt,schedule,split,degrees,precision,tol", CASES)
def test_compressed_sends(exact, fmt, schedule, split, degrees, precision, tol):
    """The bytes between the islands are the wire format's (read off the compiled step),
    and two steps train to within ``tol`` of the exact losses."""
    S, M, T, H = 2, 2, 32, 32
    v = 2 if schedule == "interleaved" else 1
    cfg = load_config(
        None,
        [
            *TINY_RUN,
            TWO,
            *BIGGER,
            f"train.precision={precision}",
            f"parallel.stages={S}",
            f"parallel.virtual_stages={v}",
            f"parallel.layers_per_stage={split}",
            f"parallel.microbatches={M}",
            f"parallel.schedule={schedule}",
            f"parallel.cross_island_dtype={fmt}",
        ],
    )
    text, mesh, losses = _train(cfg, Degrees(*degrees))
    # per device pair: M micro-batches per chunk hop, mb rows of T tokens each
    mb = cfg.train.global_batch_size // (degrees[1] * M)
    hops = {(0, 1): v, (1, 0): v}  # interleaved: wrap-around 1 -> 0 (and back) v-1 times
    hops = {k: n + (v - 1) for k, n in hops.items()}
    req = plan_request(cfg)
    islands = device_islands(mesh, load_mesh_topology(req))
    flat = [d.id for d in mesh.devices.flat]
    per_stage = degrees[1] * degrees[2]
    sent = permute_traffic(text)
    crossing = {p: n for p, n in sent.items() if islands[flat[p[0]]] != islands[flat[p[1]]]}
    assert len(crossing) == 2 * per_stage
    for (a, b), n in crossing.items():
        want = M * hops[(a // per_stage, b // per_stage)] * wire_bytes(fmt, mb * T, H, 4)
        assert want <= n <= want * 1.05, (a, b, n, want)  # + the loss and norm scalars
    if fmt == "int8":  # about a quarter of fp32, plus 4 bytes of scale per row
        assert n / (M * hops[(0, 1)] * mb * T * H * 4) < 0.3
    # the planner's figure: both directions, all data ranks (each of the t tensor devices
    # of a rank sends its own copy in the program)
    planned = sum(predict_run(req, load_mesh_topology(req)).p2p_bytes) * degrees[2]
    assert planned <= sum(crossing.values()) <= planned * 1.05
    assert all(np.isfinite(losses))
    np.testing.assert_allclose(losses, exact, rtol=tol)
