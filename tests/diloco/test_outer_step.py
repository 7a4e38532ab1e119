"""DiLoCo across replicas: independent inner steps, the outer step, its wire, fragments, resume.

Two replicas (islands) of 2 data ranks each on the 8 simulated devices, the tiny fp32 model.
The batch's rows are split over (replica, data): rows 0–3 go to replica 0, rows 4–7 to
replica 1.
"""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

from holmes_jax.core.config import load_config
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import Degrees
from holmes_jax.diloco.modes import diloco_lines
from holmes_jax.diloco.outer_step import OuterStep, decode, encode, fragment_slots
from holmes_jax.diloco.schedule import due_fragments, in_warmup
from holmes_jax.runtime.data.digest import DIGEST, batch_digest, combine
from holmes_jax.runtime.engine.mesh import build_mesh
from holmes_jax.runtime.loop import run
from holmes_jax.runtime.model.decoder import GPT
from holmes_jax.runtime.model.optim import make_optimizer
from holmes_jax.runtime.program import Program
from holmes_jax.runtime.rundir.checkpoint import (
    Checkpointer,
    find_step,
    init_state_from,
    read_params,
    save_params,
)
from tests import hlo
from tests.cluster.procs import TINY
from tests.common import HANG_S, ROOT, as_flags

DEGREES = Degrees(stages=1, data=2, tensor=1, replica=2)
# H = 1, outer lr 1, no momentum: every replica restarts from the mean of their AdamW steps.
AVERAGE = (
    "parallel.replica=2",
    "diloco.enabled=true",
    "diloco.inner_steps=1",
    "diloco.outer_lr=1",
    "diloco.outer_momentum=0",
)
STEPS = 3  # the first step has lr 0 (warm-up): two that move


def _rows(step: int, same_halves: bool) -> np.ndarray:
    rows = np.random.RandomState(step).randint(0, 256, (8, 33)).astype(np.int32)
    if same_halves:
        rows[4:] = rows[:4]  # both replicas see the same rows
    return rows


def _train(program, steps: int, same_halves: bool, outer=None):
    """Inner steps, each followed by the due outer steps; per step the mean loss and the
    logical state (numpy)."""
    state, out = program.init(0), []
    for n in range(steps):
        batch = jax.device_put(_rows(n, same_halves), program.shardings.batch)
        state, metrics = program.train_step(state, batch)
        for f in program.due_fragments(n + 1):
            state = program.outer_step(state, f, n + 1) if outer is None else outer(state, f)
        out.append((float(np.mean(metrics["loss"])), jax.device_get(program.to_logical(state))))
    return state, out


def _close(a, b, atol=1e-5):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=0, atol=atol), a, b)


@pytest.fixture(scope="module")
def average(tiny_config, make_program):
    program = make_program(tiny_config(*AVERAGE), DEGREES)
    assert program.diloco and program.zero1
    return program


@pytest.fixture(scope="module")
def hierarchical(tiny_config, make_program):
    program = make_program(tiny_config("parallel.replica=2"), DEGREES)
    assert not program.diloco and program.abstract_state.outer is None
    return program


def test_state_has_a_replica_axis_only_under_diloco(average, hierarchical):
    a, h = average.abstract_state, hierarchical.abstract_state
    for got, ref in zip(jax.tree.leaves(a.params), jax.tree.leaves(h.params), strict=True):
        assert got.shape == (2, *ref.shape)
        assert got.sharding.spec[0] == "replica"
    mu_a, mu_h = a.opt_state[1][0].mu, h.opt_state[1][0].mu
    for got, ref in zip(jax.tree.leaves(mu_a), jax.tree.leaves(mu_h), strict=True):
        assert got.shape == (2, *ref.shape) and tuple(got.sharding.spec) == (
            "replica",
            *ref.sharding.spec,
        )
    assert a.opt_state[1][0].count.shape == ()  # the step count stays shared
    # the global model: one replica's moments' shape and sharding (1/d over data)
    shapes = [
        jax.tree.map(lambda s: (s.shape, s.sharding.spec), t) for t in (a.outer["global"], mu_h)
    ]
    assert shapes[0] == shapes[1]


def test_h1_lr1_equals_hierarchical_data_parallel_on_equal_rows(average, hierarchical):
    """With AdamW inner steps DiLoCo (H=1, lr 1, μ 0) equals synchronous data parallelism
    only when the replicas' gradients agree (AdamW is not linear in the gradient): both
    replicas get the same rows here; the next test covers different rows."""
    _, diloco = _train(average, STEPS, same_halves=True)
    _, sync = _train(hierarchical, STEPS, same_halves=True)
    for (loss, got), (ref_loss, ref) in zip(diloco, sync, strict=True):
        assert loss == pytest.approx(ref_loss, abs=1e-5)
        _close(got.outer["global"], ref.params)
        for r in range(2):
            _close(jax.tree.map(lambda a, r=r: a[r], got.params), ref.params)
    assert sync[-1][0] != sync[0][0]  # the steps moved the model


def test_each_batch_shard_digests_its_rows_and_they_add_up_to_the_batch_s(average, hierarchical):
    """The batch digest is one partial sum per shard of the batch's rows (no collective in
    the step); the host's sum is the same with DiLoCo and without."""
    rows = _rows(0, same_halves=False)
    digests = []
    for program in (average, hierarchical):
        batch = jax.device_put(rows, program.shardings.batch)
        _, metrics = program.train_step(program.init(0), batch)
        digests.append(np.asarray(metrics[DIGEST]))
    shards = average.batch_shards
    assert shards > 1 and digests[0].shape == digests[1].shape == (shards,)
    assert combine(digests[0]) == combine(digests[1]) == combine(batch_digest(rows))


def test_h1_lr1_is_the_mean_of_each_replicas_adamw_step(average, tiny_config):
    """Different rows: each replica takes its own AdamW step (its own moments) from the
    global model, and the global model becomes their mean (optax on one device)."""
    cfg = tiny_config(*AVERAGE)
    model = GPT(cfg.model)
    tx = make_optimizer(cfg.optimizer, cfg.train.steps)  # clip by the replica's norm + AdamW
    grad_fn = jax.jit(jax.grad(lambda p, b: model.apply({"params": p}, b[:, :-1], b[:, 1:])))
    glob = jax.device_get(average.to_logical(average.init(0)).outer["global"])
    opt = [tx.init(glob), tx.init(glob)]
    _, got = _train(average, STEPS, same_halves=False)
    moved = 0.0
    for n in range(STEPS):
        rows, new = _rows(n, same_halves=False), []
        for r in range(2):
            updates, opt[r] = tx.update(grad_fn(glob, rows[4 * r : 4 * r + 4]), opt[r], glob)
            new.append(optax.apply_updates(glob, updates))
        moved = max(moved, float(optax.tree.norm(jax.tree.map(lambda a, b: a - b, *new))))
        glob = jax.tree.map(lambda a, b: (a + b) / 2, *new)
        _close(got[n][1].outer["global"], glob)
    assert moved > 1e-3  # the replicas' own steps differ: the mean is not trivially either


def test_outer_nesterov_step_equals_hand_computed_reference(average):
    """Two consecutive outer steps (lr 0.7, μ 0.9, so the momentum matters), each after an
    inner step, against numpy from the replicas' parameters and the previous outer state.
    The outer step is built on the same program with another diloco section (its inner
    step does not depend on the outer settings)."""
    cfg = dataclasses.replace(average.cfg.diloco, outer_lr=0.7, outer_momentum=0.9)
    outer = OuterStep(cfg, average.layout, average.mesh, average.shardings.state, average.dtype)
    before = []

    def step(state, f):
        before.append(jax.device_get(average.to_logical(state)))
        with average.context():
            return outer(state, f)

    _, got = _train(average, 3, same_halves=False, outer=step)
    for n in (1, 2):  # step 0 has lr 0: the replicas did not move yet
        b, after = before[n], got[n][1]
        assert float(optax.tree.norm(after.outer["momentum"])) > 0
        delta = jax.tree.map(lambda g, p: np.mean(g[None] - p, axis=0), b.outer["global"], b.params)
        m = jax.tree.map(lambda m, d: 0.9 * m + d, b.outer["momentum"], delta)
        g = jax.tree.map(lambda g, d, m: g - 0.7 * (d + 0.9 * m), b.outer["global"], delta, m)
        _close(after.outer["momentum"], m, atol=1e-6)
        _close(after.outer["global"], g, atol=1e-6)
        for r in range(2):
            jax.tree.map(
                np.testing.assert_array_equal,
                jax.tree.map(lambda a, r=r: a[r], after.params),
                after.outer["global"],
            )
    assert float(optax.tree.norm(before[2].outer["momentum"])) > 0  # μ·m entered step 2


def test_warmup_steps_average_whatever_the_outer_optimizer(average):
    """diloco.warmup_steps: the outer steps after the first K inner steps average the
    replicas (the states of H = 1, lr 1, μ 0) although lr is 0.7 and μ 0.9, and leave the
    momentum at zero for the rounds after step K."""
    cfg = dataclasses.replace(
        average.cfg.diloco, outer_lr=0.7, outer_momentum=0.9, inner_steps=2, warmup_steps=2
    )
    outer = OuterStep(cfg, average.layout, average.mesh, average.shardings.state, average.dtype)

    def warm(state, f):
        with average.context():
            return outer(state, f, average=True)

    _, plain = _train(average, 3, same_halves=False)  # H = 1, lr 1, μ 0
    _, got = _train(average, 3, same_halves=False, outer=warm)
    for n in range(3):
        _close(got[n][1].params, plain[n][1].params, atol=1e-6)
        _close(got[n][1].outer["global"], plain[n][1].outer["global"], atol=1e-6)
        assert float(optax.tree.norm(got[n][1].outer["momentum"])) == 0.0
    assert float(optax.tree.norm(plain[2][1].outer["momentum"])) > 0  # μ 0 still stores Δ


def test_warmup_schedule_then_rounds_from_step_k():
    # K = 3, H = 4, F = 2: every fragment after steps 1-3, then fragment 1 at phase 2 and
    # fragment 0 at phase 0 of (n - 3) mod 4
    got = [due_fragments(n, 4, 2, 3) for n in range(12)]
    assert got == [[], [0, 1], [0, 1], [0, 1], [], [1], [], [0], [], [1], [], [0]]
    assert [in_warmup(n, 3) for n in range(5)] == [False, True, True, True, False]
    assert [due_fragments(n, 4, 2) for n in range(5)] == [
        due_fragments(n, 4, 2, 0) for n in range(5)
    ]


# --------------------------------------------------------------------------- the wire


def _replica_of(program):
    """HLO device number -> replica index."""
    mesh = program.mesh
    replica = {d.id: r for r in range(mesh.shape["replica"]) for d in mesh.devices[r].flat}
    return [replica[d.id] for d in mesh.devices.flat]


def _collectives(text: str, replica_of) -> list[tuple[str, str, bool]]:
    """(kind, result type text, spans two replicas) of every collective in HLO text."""
    out = []
    for line in text.splitlines():
        op = re.search(hlo.REDUCTIONS, line) or re.search(
            r" (collective-permute)(?:-start)?\(", line
        )
        if not op:
            continue
        name = "source_target_pairs" if op.group(1) == "collective-permute" else "replica_groups"
        groups = hlo.replica_groups(hlo.attr(line, name))
        spans = any(len({replica_of[n] for n in g}) > 1 for g in groups)
        out.append((op.group(1), line.split("=", 1)[1].split(op.group(1))[0].strip(), spans))
    return out


def test_hlo_inner_step_never_crosses_replicas(average, hierarchical):
    """The compiled inner step has collectives (ZeRO-1 inside each replica) but none whose
    group spans two replicas; the hierarchical step (the control) does."""
    found = _collectives(average.lower_train_step().compile().as_text(), _replica_of(average))
    assert any(kind == "reduce-scatter" for kind, _, _ in found), found
    assert not [c for c in found if c[2]], [c for c in found if c[2]]
    control = _collectives(
        hierarchical.lower_train_step().compile().as_text(), _replica_of(hierarchical)
    )
    assert [c for c in control if c[2]]


# bf16 crosses as its bit pattern (u16): XLA:CPU would widen a bf16 all-gather to f32.
@pytest.mark.parametrize("dtype, element", [("int8", "s8"), ("bf16", "u16"), ("fp32", "f32")])
def test_hlo_outer_step_all_gathers_over_replicas_in_the_wire_dtype(average, dtype, element):
    """The outer step crosses the replicas only by all-gathers of the encoded deltas (and
    the R per-replica scales): the link carries ``outer_dtype``."""
    cfg = dataclasses.replace(average.cfg.diloco, outer_dtype=dtype)
    outer = OuterStep(cfg, average.layout, average.mesh, average.shardings.state, average.dtype)
    with average.context():
        text = outer.jitted(0).lower(average.abstract_state).compile().as_text()
    crossing = [c for c in _collectives(text, _replica_of(average)) if c[2]]
    deltas = [c for c in crossing if not c[1].startswith("f32[2]")]  # not the scales
    assert deltas, crossing
    for kind, result, _ in deltas:
        assert kind == "all-gather" and result.startswith(f"{element}["), (kind, result)


def test_int8_round_trip_within_half_a_step():
    rng = np.random.RandomState(0)
    delta = rng.standard_normal((2, 64, 48)).astype(np.float32)
    delta[1] *= 100.0  # each replica has its own scale
    delta[0, 0, 0] = 0.0
    payload, scale = jax.jit(lambda d: encode(d, "int8"))(delta)
    assert payload.dtype == np.int8 and scale.shape == (2,)
    scale = np.asarray(scale)
    np.testing.assert_allclose(scale, np.abs(delta).reshape(2, -1).max(1) / 127, rtol=1e-6)
    err = np.abs(np.asarray(decode(payload, scale)) - delta)
    bound = scale[:, None, None] / 2 * (1 + 1e-5)
    assert np.all(err <= bound)
    assert err.max() > scale[0] / 4  # a real quantisation, not a copy
    zero, s0 = encode(np.zeros((2, 4), np.float32), "int8")  # all zero: scale 1, no NaN
    assert np.all(np.asarray(zero) == 0) and np.all(np.asarray(s0) == 1)


# --------------------------------------------------------------------------- fragments


def test_fragments_are_due_on_their_own_offsets():
    assert [due_fragments(n, 4, 2) for n in range(9)] == [[], [], [1], [], [0], [], [1], [], [0]]
    assert [due_fragments(n, 1, 1) for n in range(3)] == [[], [0], [0]]
    assert [due_fragments(n, 3, 3) for n in range(1, 7)] == [[1], [2], [0], [1], [2], [0]]
    assert fragment_slots(5, 2) == [(0, 3), (3, 5)]
    with pytest.raises(ConfigError, match=r"diloco\.fragments=3: must be <= the 2 block slots"):
        fragment_slots(2, 3)


def test_more_fragments_than_slots_is_a_config_error(tiny_config, make_program):
    cfg = tiny_config(
        "parallel.replica=2",
        "parallel.stages=2",
        "diloco.enabled=true",
        "diloco.inner_steps=2",
        "diloco.fragments=2",
    )  # 2 layers on 2 stages: one slot per stage
    with pytest.raises(ConfigError, match=r"diloco\.fragments=2: must be <= the 1 block slots"):
        make_program(cfg, Degrees(stages=2, data=1, tensor=1, replica=2))


@pytest.mark.slow
def test_pipeline_inside_each_replica_trains_and_syncs_fragments(tiny_config, make_program):
    """2 stages x 2 data ranks per replica, 2 fragments (slot 0 + embedding, slot 1 + head)
    each synced every H = 2 steps on its own offset, int8 on the wire: the loss falls on a
    repeated batch, and each outer step changes exactly its fragment's global leaves."""
    cfg = tiny_config(
        "model.num_layers=4",
        "parallel.replica=2",
        "parallel.stages=2",
        "parallel.microbatches=2",
        "diloco.enabled=true",
        "diloco.inner_steps=2",
        "diloco.fragments=2",
        "diloco.outer_dtype=int8",
    )
    program = make_program(cfg, Degrees(stages=2, data=2, tensor=1, replica=2))
    batch = jax.device_put(_rows(0, same_halves=False), program.shardings.batch)
    state, losses = program.init(0), []
    for n in range(1, 7):
        state, metrics = program.train_step(state, batch)
        losses.append(float(np.mean(metrics["loss"])))
        due = program.due_fragments(n)
        assert due == [0 if n % 2 == 0 else 1]  # H=2, F=2: fragment 1 at odd n, 0 at even
        before = jax.device_get(state.outer["global"])
        state = program.outer_step(state, due[0], n)
        after = jax.device_get(state.outer["global"])
        slot = due[0]  # one slot per fragment: 2 slots per stage
        for part in ("embed", "blocks", "head"):
            for b, a in zip(
                jax.tree.leaves(before[part]), jax.tree.leaves(after[part]), strict=True
            ):
                moved = n > 1  # step 1 has lr 0: the replicas are still the global model
                if part == "blocks":
                    assert moved != np.array_equal(b[:, slot], a[:, slot]), (n, part)
                    np.testing.assert_array_equal(b[:, 1 - slot], a[:, 1 - slot])
                elif (part == "embed") == (slot == 0):
                    assert moved != np.array_equal(b, a), (n, part)
                else:
                    np.testing.assert_array_equal(b, a)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.05, losses
    # The pipeline's sends and stage sums stay inside each replica too.
    found = _collectives(program.lower_train_step().compile().as_text(), _replica_of(program))
    assert any(kind == "collective-permute" for kind, _, _ in found), found
    assert not [c for c in found if c[2]], [c for c in found if c[2]]


def test_the_log_says_whether_diloco_runs_and_what_auto_became(average, hierarchical):
    assert diloco_lines(hierarchical.cfg, hierarchical, False, None) == []
    [line] = diloco_lines(hierarchical.cfg, hierarchical, "auto", None)  # loop.run's false
    assert line == (
        "diloco: off (diloco.enabled=auto without parallel.mesh: no topology to price, so off)"
    )
    [line] = diloco_lines(average.cfg, average, True, None)
    assert line == (
        "diloco: on across 2 replicas: H=1 inner steps, outer lr 1.0, Nesterov momentum 0.0, "
        "1 fragment(s), outer deltas sent as fp32"
    )
    # auto picks DiLoCo on the 10 Mbit/s emulated mesh, but this config's replica is 1:
    # the log says so and gives the planner's DiLoCo degrees to run it.
    from holmes_jax.core.plan_request import plan_request
    from holmes_jax.planner.strategy import resolve_diloco
    from holmes_jax.planner.topology import load_topology

    mesh = os.path.join(ROOT, "meshes", "emu-4host-2island-slow.yaml")
    cfg = load_config(os.path.join(ROOT, "configs", "quickstart.yaml"), [f"parallel.mesh={mesh}"])
    on, choice = resolve_diloco(
        plan_request(
            dataclasses.replace(cfg, diloco=dataclasses.replace(cfg.diloco, enabled="auto"))
        ),
        load_topology(mesh),
    )
    assert on and choice.chosen == "diloco"
    cfg = dataclasses.replace(cfg, diloco=dataclasses.replace(cfg.diloco, enabled=True))
    one_replica = type("Program", (), {"diloco": False, "replicas": 1})()
    [line] = diloco_lines(cfg, one_replica, "auto", choice)
    assert "off: parallel.replica=1 (DiLoCo needs >= 2 replicas)" in line, line
    assert "to run the planner's DiLoCo plan: --set " in line, line
    assert " --set parallel.replica=2 " in line, line


# --------------------------------------------------------------------------- resume


@pytest.mark.slow
@pytest.mark.parametrize("warmup", [0, 1])
def test_resume_across_an_outer_step_is_exact(tmp_path, tiny_config, capsys, warmup):
    """Resumed from the uninterrupted run's step-3 checkpoint (between the outer steps
    after 2 and 4; with a warm-up of 1 step: after the averaging after 1 and the outer step
    after 3): the same losses, eval losses (of the global model) and final state."""
    base = [
        "parallel.replica=2",
        "diloco.enabled=true",
        "diloco.inner_steps=2",
        f"diloco.warmup_steps={warmup}",
        "train.steps=5",
        "train.eval_every=2",
        "logging.log_every=1",
    ]
    full = tiny_config(*base, f"checkpoint.dir={tmp_path}/full", "checkpoint.every=3")
    cut = tiny_config(*base, f"checkpoint.dir={tmp_path}/cut")
    whole = run(full)
    log = capsys.readouterr().out
    assert "diloco: on across 2 replicas: H=2 inner steps" in log
    outer = [line for line in log.splitlines() if "step of fragment" in line]
    if warmup:
        assert outer == [
            "diloco: averaging (warm-up) step of fragment 0/1 after step 1",
            "diloco: outer step of fragment 0/1 after step 3",
            "diloco: outer step of fragment 0/1 after step 5",
        ]
    else:
        assert outer == [f"diloco: outer step of fragment 0/1 after step {n}" for n in (2, 4)]
    shutil.copytree(tmp_path / "full" / "3", tmp_path / "cut" / "3")  # that step alone
    second = run(cut)
    assert [r["step"] for r in second] == [4, 5]
    np.testing.assert_array_equal([r["loss"] for r in second], [r["loss"] for r in whole[3:]])
    evals = [r.get("eval_loss") for r in second]
    assert evals == [r.get("eval_loss") for r in whole[3:]] and evals[0] is not None

    program = Program(full, build_mesh(DEGREES))
    states = []
    for cfg in (full, cut):
        ckpt = Checkpointer(cfg.checkpoint)
        states.append(jax.device_get(ckpt.restore(program.abstract_logical_state, cfg)[0]))
        ckpt.close()
    jax.tree.map(np.testing.assert_array_equal, *states)
    # The export / init_from reader takes the global model of a DiLoCo checkpoint.
    step_dir, _ = find_step(f"{tmp_path}/full", "test")
    jax.tree.map(
        np.testing.assert_array_equal, read_params(step_dir, key="test"), states[0].outer["global"]
    )


def test_init_from_starts_every_replica_and_the_global_model(average, tmp_path):
    """checkpoint.init_from: the loaded parameters go to every replica and to global."""
    params = jax.device_get(average.to_logical(average.init(3)).outer["global"])
    save_params(f"{tmp_path}/import", params, average.cfg)
    state, _ = init_state_from(average, f"{tmp_path}/import")
    got = jax.device_get(average.to_logical(state))
    jax.tree.map(np.testing.assert_array_equal, got.outer["global"], params)
    for r in range(2):
        jax.tree.map(
            np.testing.assert_array_equal, jax.tree.map(lambda a, r=r: a[r], got.params), params
        )
    assert not any(np.any(m) for m in jax.tree.leaves(got.outer["momentum"]))
    assert int(got.step) == 0


@pytest.mark.slow
def test_four_processes_through_the_launcher_match_one(tmp_path):
    """One process per host of cpu8-two-islands (replica 2 = the two islands, data 2 inside
    each): the same per-step losses (the islands' mean, gathered on log steps) and final
    eval loss as one process with the 8 devices."""
    overrides = [
        *TINY,
        "parallel.mesh=meshes/cpu8-two-islands.yaml",
        "parallel.replica=2",
        "diloco.enabled=true",
        "diloco.inner_steps=2",
        "diloco.outer_dtype=int8",
        "train.steps=4",
    ]
    reference = run(load_config(None, [o.replace("meshes/", f"{ROOT}/meshes/") for o in overrides]))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env["XLA_FLAGS"] = re.sub(
        r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", "")
    )
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "holmes_jax.launch", "--max-restarts", "0"]
    cmd += ["--mesh", "meshes/cpu8-two-islands.yaml"]
    train = [o for o in overrides if not o.startswith("parallel.mesh")]
    cmd += ["--", *as_flags([*train, f"train.metrics_path={metrics}"])]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "diloco: outer step of fragment 0/1 after step 4" in done.stdout
    got = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    np.testing.assert_allclose(
        [r["loss"] for r in got], [r["loss"] for r in reference], rtol=0, atol=1e-5
    )
    assert got[-1]["eval_loss"] == pytest.approx(reference[-1]["eval_loss"], abs=1e-5)
