"""The pipeline equals the unpipelined model: loss, every gradient, training, resume."""

import os
import re
import shutil

import jax
import numpy as np
import pytest

from holmes_jax.core.config import load_config
from holmes_jax.core.spec import Degrees
from holmes_jax.planner.grid import load_mesh_topology, resolve_shape
from holmes_jax.planner.schedule import make_schedule
from holmes_jax.train import run
from tests import hlo
from tests.common import ROOT

MODEL = [
    "model.num_layers=8",
    "model.hidden_size=32",
    "model.num_heads=4",
    "model.seq_len=16",
    "train.global_batch_size=16",
]


def _batch(seed=0):
    return np.random.RandomState(seed).randint(0, 256, (16, 17)).astype(np.int32)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb"])
@pytest.mark.parametrize("stages,microbatches", [(1, 1), (2, 4), (4, 8), (4, 2), (3, 6), (4, 16)])
def test_schedule_tables(schedule, stages, microbatches):
    v = 2 if schedule == "interleaved" else 1
    if v > 1 and stages == 1:
        return
    sched = make_schedule(schedule, stages, microbatches, v)  # checks dependencies and slots
    live = sched.live_residuals()
    if schedule in ("1f1b", "zb"):
        # zb defers W's but keeps 1F1B's peak: at most S micro-batches in flight anywhere.
        bound = [stages - s if schedule == "1f1b" else stages for s in range(stages)]
        assert all(live[s] <= min(bound[s], microbatches) for s in range(stages)), live
    elif schedule == "gpipe":
        assert all(live == microbatches), live
    ops = (sched.op != 0).sum(axis=0)
    per_mb = 3 if schedule == "zb" else 2  # F, B (and W)
    assert (ops == per_mb * microbatches * v).all()
    # Bubble (F = 1, B = 2, or F = B = W = 1 for zb) against the closed forms.
    bubble = sched.bubble_fraction()
    onef1b = (stages - 1) / (microbatches + stages - 1)
    if schedule in ("1f1b", "gpipe"):
        assert bubble == pytest.approx(onef1b)
    elif schedule == "zb":
        # ZB-H1: (S-1)(F+B-W) idle against 1F1B's (S-1)(F+B+W): a third (Qi et al. 2023)
        zb = (stages - 1) / (3 * microbatches + stages - 1)
        assert bubble == pytest.approx(zb) or microbatches < stages
        assert bubble <= onef1b
    else:
        assert bubble < onef1b or stages == 1
    # Sends: each micro-batch once per virtual-stage hop and direction, nothing else.
    sends = sched.sends()
    assert sends.sum() == 2 * microbatches * (stages * v - 1)


@pytest.mark.parametrize(
    "schedule,stages,v",
    [
        ("1f1b", 4, 1),
        ("zb", 4, 1),
        ("interleaved", 4, 2),
        ("interleaved", 3, 3),
        ("interleaved", 8, 2),
    ],
)
def test_tick_loop_length_is_flat_in_microbatches(schedule, stages, v):
    """The traced program (unrolled ticks + one body per scan) stops growing once the
    steady state repeats; interleaved's repeats every 2·S·v ticks (wrap-around sends)."""
    from holmes_jax.runtime.engine.pipeline import tick_segments

    traced = {}
    for m in (4 * stages, 8 * stages, 16 * stages):
        sched = make_schedule(schedule, stages, m, v)
        segments = tick_segments(sched)
        covered = [start + i for start, period, reps in segments for i in range(period * reps)]
        assert covered == list(range(sched.ticks))  # every tick once, in order
        traced[m] = sum(period for _, period, _ in segments)
    assert len(set(traced.values())) == 1, traced
    # the old cap of 6 ticks unrolled interleaved's steady state: longer with every M
    if schedule == "interleaved":
        short = [
            sum(p for _, p, _ in tick_segments(make_schedule(schedule, stages, m, v), 6))
            for m in traced
        ]
        assert short[0] < short[1] < short[2], short


# Llama with grouped-query attention: 2 key/value heads for 4 query heads.
ARCH = {"gpt2": [], "llama": ["model.arch=llama", "model.num_kv_heads=2"]}


@pytest.fixture(scope="module")
def reference(make_program):
    """``reference(arch, tied)``: unpipelined loss and logical gradients on one device
    (computed on first use)."""
    out = {}

    def get(arch, tied):
        if (arch, tied) not in out:
            over = MODEL + ARCH[arch] + [f"model.tied_embeddings={str(tied).lower()}"]
            prog = make_program(load_config(None, over), Degrees(1, 1, 1))
            state = prog.init(0)
            batch = jax.device_put(_batch(), prog.shardings.batch)
            loss, grads = prog.loss_and_grads(state.params, batch)
            out[arch, tied] = (jax.device_get(state), float(loss), jax.device_get(grads))
        return out[arch, tied]

    return get


CASES = [
    # stages, data, tensor, split, microbatches, schedule, tied, arch
    (2, 4, 1, (1, 7), 2, "gpipe", True, "gpt2"),
    (2, 2, 2, (5, 3), 4, "1f1b", True, "gpt2"),
    (4, 2, 1, (1, 3, 2, 2), 8, "1f1b", True, "gpt2"),
    (4, 1, 2, (1, 1, 1, 5), 2, "1f1b", False, "gpt2"),
    (1, 4, 2, (8,), 2, "1f1b", True, "gpt2"),
    (2, 2, 2, (3, 5), 4, "1f1b", False, "llama"),  # GQA, kv heads split over tensor
    # interleaved/v: one split entry per virtual stage (chunk c of stage s = entry c*S + s)
    (4, 1, 2, (1, 1, 1, 1, 1, 1, 1, 1), 2, "interleaved/2", False, "gpt2"),
    (2, 4, 1, (2, 1, 1, 1, 2, 1), 2, "interleaved/3", False, "gpt2"),
    (2, 2, 1, (2, 1, 3, 2), 8, "interleaved/2", True, "gpt2"),  # steady state: 8-tick scan
    # zb: each backward split into input gradient (B) and deferred weight gradient (W)
    (2, 4, 1, (1, 7), 2, "zb", True, "gpt2"),
    (4, 2, 1, (1, 3, 2, 2), 8, "zb", False, "gpt2"),
    (4, 2, 1, (2, 2, 1, 3), 2, "zb", True, "gpt2"),  # fewer micro-batches than stages
    (2, 2, 2, (3, 5), 4, "zb", False, "llama"),  # stash over B-only residuals, GQA, rotary
]


@pytest.mark.parametrize("stages,data,tensor,split,microbatches,schedule,tied,arch", CASES)
def test_pipeline_loss_and_grads_equal_unpipelined(
    reference, make_program, stages, data, tensor, split, microbatches, schedule, tied, arch
):
    state, ref_loss, ref_grads = reference(arch, tied)
    schedule, _, virtual = schedule.partition("/")
    cfg = load_config(
        None,
        MODEL
        + ARCH[arch]
        + [
            f"model.tied_embeddings={str(tied).lower()}",
            f"parallel.stages={stages}",
            f"parallel.layers_per_stage={list(split)}",
            f"parallel.microbatches={microbatches}",
            f"parallel.schedule={schedule}",
            f"parallel.virtual_stages={virtual or 1}",
            f"parallel.tensor={tensor}",
            "optimizer.grad_clip=0",
        ],
    )
    # nan_bubbles: bubble buffers hold NaN, so any leak would poison loss or gradients.
    prog = make_program(cfg, Degrees(stages, data, tensor), nan_bubbles=True)
    pstate = prog.from_logical(jax.device_put(state, prog.shardings.logical_state))
    loss, grads = prog.loss_and_grads(pstate.params, jax.device_put(_batch(), prog.shardings.batch))
    assert abs(float(loss) - ref_loss) <= 1e-5
    grads = jax.device_get(grads)
    leaves = jax.tree.leaves(grads)
    assert all(np.isfinite(g).all() for g in leaves)
    logical = prog.layout.map_parts(prog.layout.leaf_to_logical, grads)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), logical, ref_grads
    )
    # Padded slots: exactly zero gradient.
    table = prog.layout.layer_table()
    for g in jax.tree.leaves(grads["blocks"]):
        assert np.all(g[table < 0] == 0)
        assert np.any(g[table >= 0] != 0)
    # Copies a stage does not use: exactly zero (wte, when tied, is summed onto all).
    for name, g in grads["embed"].items():
        if not (tied and name == "wte"):
            assert np.all(g[1:] == 0), name
    for g in jax.tree.leaves(grads["head"]):
        assert np.all(g[:-1] == 0)


def test_training_equals_single_device(make_program):
    base = MODEL + ["optimizer.warmup_steps=1", "optimizer.grad_clip=0.5"]
    piped = base + [
        "parallel.stages=4",
        "parallel.layers_per_stage=[1,3,2,2]",
        "parallel.microbatches=4",
        "parallel.schedule=1f1b",
    ]
    results = []
    for over, shape in ((base, Degrees(1, 1, 1)), (piped, Degrees(4, 2, 1))):
        prog = make_program(load_config(None, over), shape)
        state, losses = prog.init(0), []
        for step in range(3):
            batch = jax.device_put(_batch(step), prog.shardings.batch)
            state, metrics = prog.train_step(state, batch)
            losses.append(float(metrics["loss"]))
        results.append((losses, jax.device_get(prog.to_logical(state).params)))
    (ref_losses, ref_params), (losses, params) = results
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert losses[2] < losses[0]
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), params, ref_params
    )


@pytest.mark.slow
def test_resume_under_another_split(tmp_path):
    base = MODEL + [
        "train.steps=4",
        "optimizer.warmup_steps=1",
        "logging.log_every=1",
        "logging.progress=none",
        "train.eval_every=0",
        "train.eval_batches=1",
        "data.max_bytes=300000",
    ]
    # Interleaved (2 chunks per device) first, then resume under ZB-H1 on 4 stages.
    split_a = [
        "parallel.stages=2",
        "parallel.virtual_stages=2",
        "parallel.layers_per_stage=[1,3,2,2]",
        "parallel.microbatches=2",
        "parallel.schedule=interleaved",
    ]
    split_b = [
        "parallel.stages=4",
        "parallel.layers_per_stage=[1,1,3,3]",
        "parallel.microbatches=4",
        "parallel.schedule=zb",
    ]
    saved = [f"checkpoint.dir={tmp_path}/a", "checkpoint.every=2", "checkpoint.keep=2"]
    uninterrupted = run(load_config(None, base + split_a + saved))
    # The uninterrupted run's step-2 checkpoint, alone in a directory: resumed under B.
    shutil.copytree(tmp_path / "a" / "2", tmp_path / "b" / "2")
    second = run(load_config(None, base + split_b + [f"checkpoint.dir={tmp_path}/b"]))
    assert [r["step"] for r in second] == [3, 4]
    np.testing.assert_allclose(
        [r["loss"] for r in second], [r["loss"] for r in uninterrupted[2:]], rtol=0, atol=1e-5
    )


# --------------------------------------------------------------------------- HLO placement


def test_group_parsing():
    assert hlo.replica_groups("{{0,1},{2,3}}") == [[0, 1], [2, 3]]
    assert hlo.replica_groups("[2,2]<=[2,2]T(1,0)") == [[0, 2], [1, 3]]
    assert (
        hlo.attr(
            "x = f32[2] all-reduce(y), replica_groups=[4,2]<=[8], to_apply=z", "replica_groups"
        )
        == "[4,2]<=[8]"
    )
    assert hlo.replica_groups("mesh['axis_0'=4,'axis_1'=2] {'axis_1'}") == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
    ]
    assert hlo.replica_groups("mesh['axis_0'=4,'axis_1'=2] {'axis_0'}") == [
        [0, 2, 4, 6],
        [1, 3, 5, 7],
    ]


def test_compiled_collectives_respect_islands():
    cfg = load_config(
        os.path.join(ROOT, "configs", "quickstart.yaml"),
        [
            f"parallel.mesh={os.path.join(ROOT, 'meshes', 'cpu8-two-islands.yaml')}",
            "parallel.stages=4",
            "parallel.layers_per_stage=[1,3,2,2]",
            "parallel.microbatches=8",
            "parallel.schedule=1f1b",
        ],
    )
    text, shape, isl = hlo.compiled_train_step(cfg)
    assert (shape.stages, shape.data, shape.tensor) == (4, 2, 1)
    per_stage = shape.data * shape.tensor

    seen = {"reduce": 0, "cross_permute": 0}
    for line in text.splitlines():
        op = re.search(hlo.REDUCTIONS, line)
        if op:
            groups = hlo.replica_groups(hlo.attr(line, "replica_groups"))
            for g in groups:
                assert len({isl(n) for n in g}) == 1, f"{op.group(1)} crosses islands: {line[:200]}"
            seen["reduce"] += 1
        if re.search(r"collective-permute(?:-start)?\(", line):
            pairs = hlo.replica_groups(
                re.search(r"source_target_pairs=(\{[\d,{}]*\})", line).group(1)
            )
            for a, b in pairs:
                if isl(a) != isl(b):
                    assert abs(a // per_stage - b // per_stage) == 1, f"non-adjacent: {line[:200]}"
                    seen["cross_permute"] += 1
    assert seen["reduce"] > 0, "expected data-parallel gradient reductions"
    assert seen["cross_permute"] > 0, "expected stage-to-stage traffic across islands"


def test_show_mesh_and_placement_errors(capsys):
    from holmes_jax.plan import main as plan_main
    from holmes_jax.train import main as train_main

    quick = os.path.join(ROOT, "configs", "quickstart.yaml")
    two = os.path.join(ROOT, "meshes", "cpu8-two-islands.yaml")
    assert (
        plan_main(["--config", quick, "--mesh", two, "--show-mesh", "--set", "parallel.stages=4"])
        == 0
    )
    out = capsys.readouterr().out
    assert "stage 1  island ib" in out and "stage 2  island roce" in out
    assert "dev 5@roce-0" in out
    # A data-parallel group of 8 would span both islands: one line, exit 2.
    flat = ["--set", "parallel.stages=1", "--set", "parallel.data=8"]
    assert train_main(["--config", quick, "--mesh", two, *flat]) == 2
    err = capsys.readouterr().err
    assert "must divide the 4 devices of island 'ib'" in err and err.count("\n") == 1


def test_auto_split_comes_from_the_planner():
    from holmes_jax.core.plan_request import plan_request
    from holmes_jax.planner.plans import resolve_auto

    two = os.path.join(ROOT, "meshes", "cpu8-two-islands.yaml")
    cfg = load_config(
        os.path.join(ROOT, "configs", "quickstart.yaml"),
        [f"parallel.mesh={two}", "parallel.stages=4", "parallel.layers_per_stage=auto"],
    )
    req = plan_request(cfg)
    topology = load_mesh_topology(req)
    shape = resolve_shape(req, 8, topology)
    split = resolve_auto(req, shape, topology).layers_per_stage
    assert isinstance(split, tuple) and len(split) == 4
    assert sum(split) == 8 and min(split) >= 1
    # Unset means an even split; an explicit split is kept.
    even = plan_request(
        load_config(None, ["model.num_layers=7", "parallel.stages=3", "parallel.devices=6"])
    )
    assert resolve_auto(even, resolve_shape(even, 8, None), None).layers_per_stage == (3, 2, 2)


def test_dropout_in_the_pipeline(tiny_config, make_program):
    """With dropout on, the engine runs (it crashed: no key for the embedding's dropout, and
    a key residual cannot be stored as bits); every remat policy sees the same masks (keys
    from seed, step, microbatch, layer), so losses and gradients agree; and the masks
    change with the step."""
    batch = np.random.RandomState(0).randint(0, 256, (8, 33)).astype(np.int32)  # TINY_RUN
    out = {}
    for remat in ("none", "full"):
        cfg = tiny_config(
            "parallel.stages=2",
            "parallel.microbatches=2",
            f"model.remat={remat}",
            "model.dropout=0.1",
        )
        prog = make_program(cfg, Degrees(2, 4, 1))
        params = prog.init(0).params
        tokens = jax.device_put(batch, prog.shardings.batch)
        for step in (0, 1):
            loss, grads = prog.loss_and_grads(params, tokens, step)
            out[remat, step] = float(loss), jax.device_get(grads)
    (loss, grads), (full_loss, full_grads) = out["none", 0], out["full", 0]
    assert np.isfinite(loss) and abs(loss - full_loss) <= 1e-6
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), grads, full_grads
    )
    assert abs(loss - out["none", 1][0]) > 1e-4  # step 1 draws other masks
    assert abs(out["none", 1][0] - out["full", 1][0]) <= 1e-6


# --------------------------------------------------------------------------- traffic


@pytest.mark.parametrize(
    "schedule,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)]
)
def test_each_microbatch_crosses_each_boundary_once_per_direction(schedule, virtual):
    """Compiled HLO: the bytes between the two islands' stages are exactly 2·M activations
    per chunk hop (one forward, one backward), plus a few scalars (loss and norm sums)."""
    S, M, mb, T, H = 2, 4, 2, 16, 32  # data 4 per stage on cpu8-two-islands
    cfg = load_config(
        os.path.join(ROOT, "configs", "quickstart.yaml"),
        MODEL
        + [
            f"parallel.mesh={os.path.join(ROOT, 'meshes', 'cpu8-two-islands.yaml')}",
            "model.tied_embeddings=false",  # tied: the wte gradient sum crosses too
            "train.global_batch_size=32",
            f"parallel.stages={S}",
            f"parallel.virtual_stages={virtual}",
            f"parallel.layers_per_stage={[8 // (S * virtual)] * (S * virtual)}",
            f"parallel.microbatches={M}",
            f"parallel.schedule={schedule}",
        ],
    )
    text, shape, isl = hlo.compiled_train_step(cfg)
    assert (shape.stages, shape.data, shape.tensor) == (S, 4, 1)
    act = mb * T * H * 4  # one micro-batch's activation, fp32
    # From first principles: a micro-batch visits virtual stages 0 .. vS-1; hop vs -> vs+1
    # goes stage vs % S -> (vs+1) % S forward and back the other way.
    hops = {}
    for vs in range(S * virtual - 1):
        a, b = vs % S, (vs + 1) % S
        hops[(a, b)] = hops.get((a, b), 0) + M * act
        hops[(b, a)] = hops.get((b, a), 0) + M * act
    sent = hlo.permute_traffic(text)
    per_stage = shape.data * shape.tensor
    for (a, b), n in sent.items():
        assert isl(a) != isl(b) or a // per_stage == b // per_stage or n == 0
    for (sa, sb), want in hops.items():
        pairs = [(a, b) for a, b in sent if a // per_stage == sa and b // per_stage == sb]
        assert len(pairs) == per_stage, (sa, sb, pairs)
        for p in pairs:
            assert want <= sent[p] <= want + 64, (schedule, sa, sb, sent[p], want)
