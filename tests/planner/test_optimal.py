"""``optimal`` is exactly optimal: its split's own predicted step is the brute-force minimum.

500 seeded random instances (random per-stage speeds, memory bandwidths and capacities,
links, gradient-sync modes; up to 12 layers and 4 stages; every schedule, interleaved
with every v that leaves each chunk a layer): the step :func:`predict` reports for the
split :func:`optimal_split` returns equals the least ``predict`` over every composition
of the layers into the virtual stages that fits in memory (relative 1e-9), and the split
itself fits.
"""

import dataclasses
import itertools
import math

import numpy as np
import pytest

from holmes_jax.core.plan_request import RunSpec
from holmes_jax.core.spec import Layout, ModelSpec
from holmes_jax.planner import exact
from holmes_jax.planner.partition import optimal_split
from holmes_jax.planner.placement import StageHardware
from holmes_jax.planner.stage_costs import stage_costs
from holmes_jax.planner.step_time import predict


def compositions(total: int, parts: int):
    """Every way to write ``total`` as ``parts`` ordered positive integers."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def _instance(rng):
    L = int(rng.integers(2, 13))
    p = int(rng.integers(1, min(4, L) + 1))
    schedule = str(rng.choice(["gpipe", "1f1b", "zb", "interleaved"]))
    v = 1
    if schedule == "interleaved":
        choices = [k for k in (2, 3, 4) if p >= 2 and p * k <= L]
        if not choices:
            schedule = "1f1b"
        else:
            v = int(rng.choice(choices))
    m = int(rng.choice([1, 2, 3, 4, 6, 8, 12]))
    if schedule == "interleaved" and m % min(p, m):
        m = p * int(rng.integers(1, 4))
    h = int(rng.choice([64, 128, 256]))
    model = ModelSpec(
        L, h, 4, int(rng.choice([64, 128, 512])), 512, tied_embeddings=bool(rng.random() < 0.5)
    )
    d = int(rng.choice([1, 2, 4]))
    run = RunSpec(
        global_batch_size=d * m * int(rng.integers(1, 4)),
        remat=str(rng.choice(["none", "selective", "full"])),
        overlap_grad_sync=bool(rng.random() < 0.8),
        sync_collectives=bool(rng.random() < 0.25),
    )
    hw = []
    for _ in range(p):
        speed = 10 ** rng.uniform(9, 11)
        hw.append(
            StageHardware(
                island=0,
                fwd_flops=speed,
                bwd_flops=speed * rng.uniform(0.7, 1.0),
                memory_bytes=1e15,  # replaced below from the memory table
                mem_bw=10 ** rng.uniform(9, 11),
                tensor=(1e12, 0.0),
                data=(10 ** rng.uniform(7, 10), 10 ** rng.uniform(-6, -3)),
                send=(10 ** rng.uniform(6, 9), 10 ** rng.uniform(-6, -3)),
                tie=(10 ** rng.uniform(6, 9), 10 ** rng.uniform(-6, -4)),
            )
        )
    layout = Layout(p, d, 1, microbatches=m, schedule=schedule, virtual_stages=v)
    costs = stage_costs(model, run, layout, hw)
    # Memory: each device fits a random number of layer slots (sometimes none).
    k = rng.integers(1, L + 1) + rng.integers(0, 3, size=p)  # the padding: every device counts
    k = np.minimum(k, L) * (rng.random() > 0.05)
    room = costs.memory[np.arange(p), k] * rng.uniform(1.0, 1.01, size=p)
    return dataclasses.replace(costs, capacity=np.where(k > 0, room, 0.0))


def _brute(costs):
    """(least predicted step over every composition that fits, that composition)."""
    lay = costs.layout
    best, arg = math.inf, None
    for split in compositions(costs.model.num_layers, lay.stages * lay.virtual_stages):
        pred = predict(costs, split)
        if pred.fits and pred.step_s < best:
            best, arg = pred.step_s, split
    return best, arg


@pytest.mark.parametrize("path", ["joint", "per-cap"])
def test_optimal_equals_brute_force_on_500_random_instances(path, monkeypatch):
    """Both exact searches: the joint label DP (small label sets) and, forced here, the
    per-bottleneck-cap one it falls back to on heterogeneous stages."""
    if path == "per-cap":
        monkeypatch.setattr(exact, "_joint_labels", lambda *a, **k: None)
    rng = np.random.default_rng(12)
    seen, infeasible = set(), 0
    for trial in range(500):
        costs = _instance(rng)
        lay = costs.layout
        seen.add((lay.schedule, lay.virtual_stages))
        expect, _ = _brute(costs)
        split = optimal_split(costs)
        if not math.isfinite(expect):
            assert split is None, trial
            infeasible += 1
            continue
        assert split is not None, trial
        got = predict(costs, split)
        assert got.fits, (trial, split)
        assert got.step_s == pytest.approx(expect, rel=1e-9), (trial, lay, split)
    assert {s for s, _ in seen} == {"gpipe", "1f1b", "zb", "interleaved"}
    assert {v for s, v in seen if s == "interleaved"} >= {2, 3}
    assert 20 < infeasible < 250, infeasible  # the memory limits bite, most instances fit
