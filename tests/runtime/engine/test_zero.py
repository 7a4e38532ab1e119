"""ZeRO-1: sharded optimizer state, reduce-scattered gradients, cross-island replicas."""

import os
import re

import jax
import numpy as np
import optax
import pytest

from holmes_jax.core.config import load_config
from holmes_jax.core.plan_request import plan_request
from holmes_jax.core.spec import Degrees
from holmes_jax.planner.grid import load_mesh_topology, resolve_shape
from holmes_jax.runtime.model.decoder import GPT
from holmes_jax.runtime.model.optim import make_optimizer
from tests import hlo
from tests.common import ROOT

MODEL = [
    "model.num_layers=4",
    "model.hidden_size=32",
    "model.num_heads=4",
    "model.seq_len=16",
    "model.tied_embeddings=false",
    "train.global_batch_size=16",
    "optimizer.learning_rate=1e-2",
    "optimizer.warmup_steps=1",
    "optimizer.weight_decay=0.1",
    "optimizer.grad_clip=0.3",  # small enough to clip on every step
]


def _batch(step):
    return np.random.RandomState(step).randint(0, 256, (16, 17)).astype(np.int32)


def _train(program, steps):
    state, losses, params = program.init(0), [], []
    for step in range(steps):
        state, metrics = program.train_step(
            state, jax.device_put(_batch(step), program.shardings.batch)
        )
        losses.append(float(metrics["loss"]))
        params.append(jax.device_get(program.to_logical(state).params))
    return state, losses, params


@pytest.fixture(scope="module")
def zero_run(make_program):
    cfg = load_config(None, MODEL + ["optimizer.zero1=true", "parallel.stages=2"])
    program = make_program(cfg, Degrees(stages=2, data=4, tensor=1))
    assert program.zero1
    return cfg, program, _train(program, 5)


def test_sharded_optimizer_equals_optax_adamw(zero_run):
    """Fed the same gradients, the ZeRO-1 update (optimizer state split 4 ways, clip with
    the sharded global norm, all-gather of the new parameters) equals optax AdamW on one
    device, step by step."""
    cfg, program, _ = zero_run
    model = GPT(cfg.model)
    tx = make_optimizer(cfg.optimizer, cfg.train.steps)  # clip_by_global_norm + adamw
    state = program.init(0)
    ref = jax.device_get(program.to_logical(state).params)
    opt_state = tx.init(ref)
    grad_fn = jax.jit(jax.grad(lambda p, b: model.apply({"params": p}, b[:, :-1], b[:, 1:])))
    to_pipeline = jax.jit(lambda g: program.layout.map_parts(program.layout.leaf_to_pipeline, g))
    clipped = 0
    for n in range(5):
        grads = grad_fn(ref, _batch(n))
        clipped += float(optax.tree.norm(grads)) > cfg.optimizer.grad_clip
        state = program.apply_gradients(state, to_pipeline(grads))
        updates, opt_state = tx.update(grads, opt_state, ref)
        ref = optax.apply_updates(ref, updates)
        got = jax.device_get(program.to_logical(state).params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), got, ref)
    assert clipped == 5, "the test must exercise clipping"


def test_zero1_training_tracks_the_reference(zero_run, make_program):
    """End to end (its own gradients): losses within fp32 noise of one-device optax."""
    cfg, _, (_, losses, _) = zero_run
    ref_cfg = load_config(None, MODEL + ["optimizer.zero1=false"])
    _, ref_losses, _ = _train(make_program(ref_cfg, Degrees(1, 1, 1)), 5)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)


def _moment_bytes_per_device(state):
    adam = state.opt_state[1][0]
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves((adam.mu, adam.nu)))


def test_optimizer_state_is_one_over_d_per_device(zero_run, make_program):
    cfg, program, (state, _, _) = zero_run
    off_cfg = load_config(None, MODEL + ["optimizer.zero1=false", "parallel.stages=2"])
    off = make_program(off_cfg, Degrees(stages=2, data=4, tensor=1))
    # Read from the arrays' own shardings: on stage 2 x data 4, each device holds its
    # stage's moments split 4 ways with ZeRO-1, whole without.
    assert _moment_bytes_per_device(state) * 4 == _moment_bytes_per_device(off.init(0))
    for p in jax.tree.leaves(state.params):  # parameters stay replicated over data
        assert p.addressable_shards[0].data.nbytes == p.nbytes // 2


def test_zero1_on_and_off_train_alike(zero_run, make_program):
    _, _, (_, losses, params) = zero_run
    cfg = load_config(None, MODEL + ["optimizer.zero1=false", "parallel.stages=2"])
    program = make_program(cfg, Degrees(stages=2, data=4, tensor=1))
    assert not program.zero1
    _, off_losses, off_params = _train(program, 5)
    np.testing.assert_allclose(losses, off_losses, rtol=0, atol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), params[-1], off_params[-1]
    )


def _collectives(cfg, hlo_out=None):
    text, _, island = hlo.compiled_train_step(cfg)
    if hlo_out is not None:
        hlo_out.append(text)
    found = []
    for line in text.splitlines():
        op = re.search(r" (all-reduce|reduce-scatter|all-gather)(?:-start)?\(", line)
        if op:
            groups = hlo.replica_groups(hlo.attr(line, "replica_groups"))
            crosses = any(len({island(n) for n in g}) > 1 for g in groups)
            shape_txt = line.split("=", 1)[1].split(op.group(1))[0]
            found.append((op.group(1), crosses, shape_txt, groups))
    return found


FOUR_STAGES = [
    f"parallel.mesh={ROOT}/meshes/cpu8-two-islands.yaml",
    "parallel.stages=4",
    "parallel.microbatches=4",
    "parallel.schedule=1f1b",
    "optimizer.zero1=true",
]


def test_hlo_reduce_scatter_inside_islands_then_all_gather():
    cfg = load_config(
        os.path.join(ROOT, "configs", "quickstart.yaml"),
        FOUR_STAGES + ["parallel.grad_buckets=layer"],
    )
    texts = []
    found = _collectives(cfg, texts)
    kinds = {k for k, *_ in found}
    assert {"reduce-scatter", "all-gather"} <= kinds, kinds
    assert not any(crosses for _, crosses, *_ in found)  # stage 4 x data 2: all inside islands
    # Phase 1 runs on the last micro-batch only: every reduce-scatter inside the tick loop
    # sits in the 0-or-1-trip loop (no known trip count), not hoisted into the layer loop
    # (trip count = layers), where it would run on every micro-batch.
    loops = _while_loops(texts[0])
    inner = [c for c, ops in _computation_ops(texts[0]).items() if "reduce-scatter" in ops]
    assert inner and all(c == "ENTRY" or c in loops for c in inner), inner
    assert not [c for c in inner if c != "ENTRY" and loops[c]], "reduce-scatter in a counted loop"
    assert any(c != "ENTRY" for c in inner)  # the blocks' buckets: inside the tick loop


def test_hlo_step_buckets_reduce_once_after_the_loop():
    """``grad_buckets: step`` (auto on CPU): no collective inside any loop but the tick
    loop's sends; the whole step's gradients (every stacked leaf of the blocks, [slots,
    ...] at once, with the embedding's and head's) in one buffer and one reduce-scatter,
    since on CPU each collective call is a rendezvous of every rank."""
    cfg = load_config(os.path.join(ROOT, "configs", "quickstart.yaml"), FOUR_STAGES)
    texts = []
    found = _collectives(cfg, texts)
    assert not any(crosses for _, crosses, *_ in found)
    ops = _computation_ops(texts[0])
    assert set(ops) == {"ENTRY"}, ops  # every reduction and gather outside the loops
    scatters = [shape for kind, _, shape, _ in found if kind == "reduce-scatter"]
    assert len(scatters) == 1, scatters
    assert re.match(r"\s*f32\[1,\d+\]", scatters[0]), scatters  # [1, W]: this rank's rows


def _computation_ops(text: str) -> dict[str, set[str]]:
    """{computation name: the collective kinds in it} of compiled HLO text."""
    out: dict[str, set[str]] = {}
    name = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            name = "ENTRY" if line.startswith("ENTRY") else line.split(" ")[0].lstrip("%")
        op = re.search(r" (all-reduce|reduce-scatter|all-gather)(?:-start)?\(", line)
        if op and name:
            out.setdefault(name, set()).add(op.group(1))
    return out


def _while_loops(text: str) -> dict[str, bool]:
    """{while body computation: whether XLA knows its trip count}."""
    loops = {}
    for line in text.splitlines():
        body = re.search(r" while\(.*body=%?([\w.\-]+)", line)
        if body:
            loops[body.group(1)] = "known_trip_count" in line
    return loops


def test_replica_all_reduce_crosses_islands_on_shards():
    """replica 2 (one pipeline per island): only 1/d shards are all-reduced across."""
    cfg = load_config(
        os.path.join(ROOT, "configs", "quickstart.yaml"),
        [
            f"parallel.mesh={ROOT}/meshes/cpu8-two-islands.yaml",
            "parallel.replica=2",
            "parallel.stages=2",
            "parallel.microbatches=2",
            "optimizer.zero1=true",
        ],
    )
    found = _collectives(cfg)
    cross = [f for f in found if f[1]]
    assert cross, "expected the cross-island reduction"
    for kind, _, _shape, groups in cross:
        assert kind == "all-reduce"
        assert all(len(g) == 2 for g in groups)  # one rank per island
    # What crosses is what the reduce-scatter inside the island left this rank: the step's
    # bucket (one buffer on CPU), [1, W] with W a half (data 2) of the stage's gradients.
    scattered = [s.strip() for kind, crosses, s, _ in found if kind == "reduce-scatter"]
    assert len(scattered) == 1 and len(cross) == 1, found
    assert scattered[0] in cross[0][2], found  # XLA may combine the loss' mean into it


def test_layer_and_step_buckets_train_alike(make_program):
    """Per-layer buckets (the GPU default) and one bucket per step (the CPU default) reduce
    the same sums: identical parameters after two steps, under ZB-H1 (its deferred weight
    passes complete the gradients) with a replica across islands."""
    two = f"{ROOT}/meshes/cpu8-two-islands.yaml"
    base = MODEL + [f"parallel.mesh={two}", "parallel.replica=2", "parallel.stages=2"]
    base += ["parallel.microbatches=2", "parallel.schedule=zb", "optimizer.zero1=true"]
    params = {}
    for buckets in ("layer", "step"):
        cfg = load_config(None, base + [f"parallel.grad_buckets={buckets}"])
        program = make_program(cfg, Degrees(stages=2, data=2, tensor=1, replica=2))
        assert program.grad_buckets == buckets
        params[buckets] = _train(program, 2)[2][-1]
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-7),
        params["layer"],
        params["step"],
    )


def test_replica_run_equals_single_device(make_program):
    base = MODEL + ["optimizer.zero1=true"]
    two = f"{ROOT}/meshes/cpu8-two-islands.yaml"
    cfg = load_config(
        None, base + [f"parallel.mesh={two}", "parallel.replica=2", "parallel.stages=2"]
    )
    req = plan_request(cfg)
    shape = resolve_shape(req, 8, load_mesh_topology(req))
    assert (shape.replica, shape.stages, shape.data, shape.tensor) == (2, 2, 2, 1)
    _, losses, params = _train(make_program(cfg, shape), 3)
    ref_cfg = load_config(None, MODEL + ["optimizer.zero1=false"])
    _, ref_losses, ref_params = _train(make_program(ref_cfg, Degrees(1, 1, 1)), 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), params[-1], ref_params[-1]
    )


def test_flat_buckets_reduce_as_one_call_per_leaf():
    """One buffer per collective (where collectives block) and one collective per leaf (the
    GPU path) give every rank the same thing: the mean over all 8 ranks, scattered leaves
    cut to the rank's 1/4 along their dim (data 4 x replica 2)."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from holmes_jax.core.axes import DATA, REPLICA
    from holmes_jax.runtime.engine.zero import reduce_bucket

    mesh = jax.make_mesh((2, 4), (REPLICA, DATA), axis_types=(AxisType.Explicit,) * 2)
    shapes = {"a": (8, 6), "b": (3, 8, 5), "c": (7,), "d": (4,), "e": (2, 3)}
    dims = {"a": 0, "b": 1, "c": -1, "d": 0, "e": -1}
    rng = np.random.RandomState(0)
    local = {k: rng.randn(8, *s).astype(np.float32) for k, s in shapes.items()}  # per rank
    ranks = PartitionSpec((REPLICA, DATA))

    def reduced(flat):
        def body(g):
            out = reduce_bucket(jax.tree.map(lambda x: x[0], g), dims, 4, 2, flat)
            return jax.tree.map(lambda x: x[None], out)

        fn = jax.shard_map(body, mesh=mesh, in_specs=ranks, out_specs=ranks, check_vma=False)
        return jax.device_get(jax.jit(fn)(jax.device_put(local, NamedSharding(mesh, ranks))))

    flat, per_leaf = reduced(True), reduced(False)
    for k, dim in dims.items():
        mean = local[k].mean(axis=0)
        for rank in range(8):
            want = mean if dim < 0 else np.split(mean, 4, axis=dim)[rank % 4]
            np.testing.assert_allclose(per_leaf[k][rank], want, rtol=0, atol=1e-6)
            np.testing.assert_allclose(flat[k][rank], want, rtol=0, atol=1e-6)


def test_plain_data_parallel_on_cpu_runs_through_the_engine(make_program):
    """On CPU (blocking collectives) data parallelism without a pipeline or ZeRO-1 still
    goes through the engine, which reduces each bucket as one buffer; one device alone
    stays the plain GSPMD reference."""
    cfg = load_config(None, MODEL + ["optimizer.zero1=false"])
    program = make_program(cfg, Degrees(stages=1, data=4, tensor=1))
    assert program.pipelined and program.engine.options.flat_buckets
    assert not make_program(cfg, Degrees(1, 1, 1)).pipelined
