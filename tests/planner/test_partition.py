"""Partition and placement: DP vs brute force, known splits, placement rules, planner choices."""

import copy
import itertools
import os

import numpy as np
import pytest
import yaml

from holmes_jax.core.errors import ConfigError
from holmes_jax.core.plan_request import RunSpec
from holmes_jax.core.spec import Layout, ModelSpec
from holmes_jax.planner.partition import (
    bottleneck_split,
    layer_cube,
    min_sum_split,
    pipeline_split,
    proportional_split,
    uniform_split,
)
from holmes_jax.planner.placement import stage_blocks, stage_hardware, stages_per_island
from holmes_jax.planner.search import (
    best_policy_plan,
    candidate_layouts,
    plan_for_layout,
    search_plan,
    split_layers,
)
from holmes_jax.planner.stage_costs import stage_costs
from holmes_jax.planner.step_time import predict
from holmes_jax.planner.topology import load_topology, topology_from_dict
from tests.common import ROOT


def mesh(name):
    return load_topology(os.path.join(ROOT, "meshes", name))


def splits(L, p):
    """Every split of L layers into p contiguous stages of >= 1 layer."""
    for cuts in itertools.combinations(range(1, L), p - 1):
        bounds = (0, *cuts, L)
        yield [bounds[i + 1] - bounds[i] for i in range(p)]


def stage_values(cube, split):
    b = np.concatenate([[0], np.cumsum(split)])
    return [cube[s, b[s], b[s + 1]] for s in range(len(split))]


def objective_value(v, objective, m):
    if not np.isfinite(v).all():
        return np.inf
    return {"max": max(v), "sum": sum(v), "pipe": sum(v) + (m - 1) * max(v)}[objective]


def brute(cube, objective, m=1):
    return min(
        objective_value(stage_values(cube, split), objective, m)
        for split in splits(cube.shape[1] - 1, cube.shape[0])
    )


def test_dp_equals_brute_force_on_random_instances():
    rng = np.random.default_rng(0)
    for trial in range(150):
        L, p = int(rng.integers(1, 15)), int(rng.integers(1, 5))
        if p > L:
            continue
        layer = rng.uniform(0.1, 3.0, size=(p, L))  # stage-dependent, per-layer costs
        cube = layer_cube(layer, fixed=rng.uniform(0, 2, size=p))
        if trial % 3 == 0:  # memory-like holes: some (stage, range) pairs forbidden
            cube[rng.random(cube.shape) < 0.15] = np.inf
        m = int(rng.integers(1, 9))
        for objective, solve in (
            ("max", bottleneck_split),
            ("sum", min_sum_split),
            ("pipe", lambda c, m=m: pipeline_split(c, m)),
        ):
            value, split = solve(cube)
            expect = brute(cube, objective, m)
            if not np.isfinite(expect):
                assert split is None
                continue
            assert value == pytest.approx(expect, rel=1e-12), (trial, objective)
            assert len(split) == p and sum(split) == L and min(split) >= 1
            got = objective_value(stage_values(cube, split), objective, m)
            assert got == pytest.approx(expect, rel=1e-12)


def test_twelve_equal_layers_on_speeds_one_and_half():
    times = np.array([[1.0] * 12, [2.0] * 12])  # speeds [1, 0.5]
    cube = layer_cube(times)
    assert bottleneck_split(cube) == (8.0, [8, 4])
    assert pipeline_split(cube, 1) == (13.0, [11, 1])  # Σ τ only: the fast stage takes all
    assert proportional_split(12, [1, 0.5]) == [8, 4]


def test_48_layers_with_speed_ratio_26_to_22():
    # per-layer times 22:26 (speeds 26:22): balance at 26 * 22 = 22 * 26
    times = np.array([[22.0] * 48, [26.0] * 48])
    assert bottleneck_split(layer_cube(times))[1] == [26, 22]
    assert pipeline_split(layer_cube(times), 32)[1] == [26, 22]
    assert proportional_split(48, [26, 22]) == [26, 22]


def test_uniform_split():
    assert uniform_split(10, 4) == [3, 3, 2, 2]
    assert uniform_split(4, 4) == [1, 1, 1, 1]
    with pytest.raises(ConfigError, match="parallel.stages=5"):
        uniform_split(4, 5)


def test_placement_blocks_follow_island_order():
    two = mesh("cpu8-two-islands.yaml")
    lay = Layout(4, 2, 1, microbatches=8)
    assert stage_blocks(two, lay) == [[(0, 0), (0, 2), (1, 0), (1, 2)]]
    assert stages_per_island(two, lay) == (2, 2)
    uneven = mesh("cpu8-three-islands-uneven.yaml")
    assert stages_per_island(uneven, Layout(4, 1, 2, microbatches=8)) == (2, 1, 1)
    assert stages_per_island(uneven, Layout(8, 1, 1, microbatches=8)) == (4, 2, 2)
    rep = stage_blocks(two, Layout(2, 2, 1, microbatches=4, replica=2))
    assert rep == [[(0, 0), (0, 2)], [(1, 0), (1, 2)]]


@pytest.mark.parametrize(
    "layout, match",
    [
        (Layout(2, 1, 4, microbatches=4), "parallel.tensor=4: must divide devices_per_host=2"),
        (Layout(1, 8, 1, microbatches=4), "data\\*tensor=8\\*1: must divide the 4 devices"),
        (Layout(2, 2, 1, microbatches=4), "must equal the 8 devices"),
    ],
)
def test_impossible_placements_are_one_line_errors(layout, match):
    with pytest.raises(ConfigError, match=match) as err:
        stage_blocks(mesh("cpu8-two-islands.yaml"), layout)
    assert "\n" not in str(err.value)


def test_replica_needs_equal_islands():
    with pytest.raises(ConfigError, match="replica=2: data parallel across islands"):
        stage_blocks(
            mesh("cpu8-three-islands-uneven.yaml"), Layout(2, 1, 2, microbatches=1, replica=2)
        )


def test_links_seen_by_stages():
    two = mesh("cpu8-two-islands.yaml")
    hw = stage_hardware(two, Layout(4, 2, 1, microbatches=8))
    ib, roce, eth = (two.islands[0].link, two.islands[1].link, two.inter_island_default)
    # a stage is one host: data ring on the intra-host link
    assert hw[0].data[0] == two.intra_host.bytes_per_s
    # stage 0 -> 1 crosses hosts in the ib island (2 replicas share the NIC), 1 -> 2 crosses
    # islands over Ethernet
    assert hw[0].send[0] == pytest.approx(ib.bytes_per_s / 2)
    assert hw[1].send[0] == pytest.approx(eth.bytes_per_s / 2)
    assert hw[2].send[0] == pytest.approx(roce.bytes_per_s / 2)
    assert hw[1].send[1] == pytest.approx(eth.latency_s)


def test_data_rings_share_the_host_nic():
    topo = mesh("paper-ib-roce-8x8.yaml")  # 8 GPUs per host, 4 hosts per island
    ib, roce = topo.islands[0].link.bytes_per_s, topo.islands[1].link.bytes_per_s
    # t = 8: each host holds one rank of each of the 8 data rings -> 1/8 of the NIC each
    hw = stage_hardware(topo, Layout(2, 4, 8, microbatches=8))
    assert hw[0].data[0] == pytest.approx(ib / 8)
    assert hw[1].data[0] == pytest.approx(roce / 8)
    # t = 1: one ring per host holds all 8 ranks there -> the whole NIC
    assert stage_hardware(topo, Layout(2, 32, 1, microbatches=8))[0].data[0] == pytest.approx(ib)
    # replicas: the cross-island ring of each rank gets 1/8 of the host's Ethernet
    rep = stage_hardware(topo, Layout(1, 32, 1, microbatches=1, replica=2))
    assert rep[0].cross[0] == pytest.approx(topo.inter_island_default.bytes_per_s / 8)
    assert rep[0].data[0] == pytest.approx(roce)  # the slower island's view


QUICK = ModelSpec(num_layers=4, hidden_size=128, num_heads=4, seq_len=128, vocab_size=256)
FP32 = RunSpec(32, act_bytes=4, param_bytes=4, grad_bytes=4, optimizer_bytes=8)


def test_split_layers_for_fixed_degrees():
    two = mesh("cpu8-two-islands.yaml")
    for method in ("uniform", "holmes", "optimal"):
        split = split_layers(two, QUICK, FP32, 4, 2, 1, 8, "1f1b", method)
        assert len(split) == 4 and sum(split) == 4
    with pytest.raises(ConfigError, match="--partition 'best'"):
        split_layers(two, QUICK, FP32, 4, 2, 1, 8, "1f1b", "best")


GPT13B = ModelSpec(40, 5120, 40, 2048, 51200)
BIG_RUN = RunSpec(128, remat="full")


@pytest.mark.parametrize("name", ["paper-ib-roce-8x8.yaml", "paper-ib-roce-4x8.yaml"])
def test_slow_inter_island_links_pipeline_across_islands(name):
    topo = mesh(name)
    plan = search_plan(topo, GPT13B, BIG_RUN)
    assert plan.replica == 1 and plan.layout.stages >= 2
    assert set(plan.stage_islands) == {"ib", "roce"}  # a stage boundary crosses islands
    # data parallel across islands would be slower
    across = search_plan(topo, GPT13B, BIG_RUN, replica=2)
    assert across.predicted_step_s > 1.2 * plan.predicted_step_s


def test_uniformly_fast_links_choose_data_parallel():
    plan = search_plan(mesh("paper-ib-8x8.yaml"), GPT13B, BIG_RUN)
    assert plan.layout.stages == 1 and plan.replica == 1 and plan.layout.data > 1


def test_fast_inter_island_links_choose_data_parallel():
    raw = yaml.safe_load(open(os.path.join(ROOT, "meshes", "paper-ib-roce-8x8.yaml")))
    raw["inter_island"]["default"]["bandwidth_gbps"] = 800  # as fast as InfiniBand
    plan = search_plan(topology_from_dict(raw), GPT13B, BIG_RUN)
    assert plan.layout.stages == 1 and plan.layout.data * plan.replica > 1


def _slow_nic_pair():
    raw = yaml.safe_load(open(os.path.join(ROOT, "meshes", "paper-ib-roce-4x8.yaml")))
    raw = copy.deepcopy(raw)
    raw["islands"][1]["link"]["bandwidth_gbps"] = 25  # RoCE island on slow NICs
    return topology_from_dict(raw)


def test_optimal_gives_fewer_layers_to_the_slow_nic_island():
    topo = _slow_nic_pair()
    model, run = ModelSpec(32, 4096, 32, 2048, 51200), RunSpec(512, remat="full")
    layout = Layout(2, 16, 1, microbatches=32)
    plans = {
        m: plan_for_layout(topo, model, run, layout, m) for m in ("uniform", "holmes", "optimal")
    }
    assert plans["uniform"].layers_per_stage == (16, 16)
    assert plans["optimal"].layers_per_stage[1] < 16
    assert plans["holmes"].layers_per_stage[1] < 16
    assert plans["optimal"].predicted_step_s < plans["uniform"].predicted_step_s
    assert plans["optimal"].predicted_step_s <= plans["holmes"].predicted_step_s


def test_optimal_respects_memory():
    """Every stage pads to the largest one's layer count (the pipeline layout), so memory
    bounds max(split) on every device: a slow RoCE island would get few layers and the
    fast one many, until the fast one's devices run out of memory."""
    raw = yaml.safe_load(open(os.path.join(ROOT, "meshes", "paper-ib-roce-4x8.yaml")))
    raw["islands"][1]["peak_tflops"] = 100  # slow island: the time-optimal split is uneven
    model, run = ModelSpec(40, 5120, 40, 2048, 51200), RunSpec(128, remat="full")
    layout = Layout(2, 16, 1, microbatches=8)
    free = plan_for_layout(topology_from_dict(raw), model, run, layout, "optimal")
    assert max(free.layers_per_stage) > 24
    for island in raw["islands"]:
        island["memory_gb"] = 64  # 57.6 GB usable: 22 layer slots fit, 23 do not
    topo = topology_from_dict(raw)
    costs = stage_costs(model, run, layout, stage_hardware(topo, layout))
    assert (costs.memory[:, 22] <= costs.capacity).all()
    assert (costs.memory[:, 23] > costs.capacity).all()
    assert not predict(costs, free.layers_per_stage).fits
    plan = plan_for_layout(topo, model, run, layout, "optimal")
    assert plan.prediction.fits and max(plan.layers_per_stage) == 22
    tiny = topology_from_dict({**raw, "islands": [{**i, "memory_gb": 1} for i in raw["islands"]]})
    with pytest.raises(ConfigError, match="no split fits in device memory"):
        plan_for_layout(tiny, model, run, layout, "optimal")


def test_optimal_never_predicted_worse_than_baselines():
    topo = mesh("gpu1024-four-islands.yaml")
    model, run = ModelSpec(96, 12288, 96, 2048, 51200), RunSpec(1536, remat="full")
    layout = Layout(16, 16, 4, microbatches=96)
    opt = plan_for_layout(topo, model, run, layout, "optimal")
    for method in ("uniform", "holmes"):
        assert (
            opt.predicted_step_s
            <= plan_for_layout(topo, model, run, layout, method).predicted_step_s
        )


def test_search_respects_pins_and_rules():
    two = mesh("cpu8-two-islands.yaml")
    plan = search_plan(two, QUICK, FP32, stages=4, microbatches=8, replica=1)
    assert (plan.layout.stages, plan.layout.microbatches, plan.replica) == (4, 8, 1)
    assert plan.stages_per_island == (2, 2)
    across = search_plan(two, QUICK, FP32, stages=2, replica=2)
    assert across.stages_per_island == (2, 2)
    assert across.layout.data * across.layout.tensor == 2
    for lay in candidate_layouts(two, QUICK, FP32):
        assert lay.num_devices == 8 and lay.stages <= QUICK.num_layers
        assert 2 % lay.tensor == 0 and 4 % (lay.data * lay.tensor) == 0
        assert 32 % (lay.replica * lay.data * lay.microbatches) == 0
    d = plan.to_dict()
    for key in (
        "layers_per_stage",
        "stages_per_island",
        "predicted_step_s",
        "tflops_per_device",
        "breakdown",
    ):
        assert key in d


def test_policy_search_picks_the_fastest_policy_that_fits():
    """Roomy devices: no recompute (fastest). Tight devices: the planner trades recompute
    for memory instead of failing, and every policy it could have picked is priced."""
    model, run = ModelSpec(32, 4096, 32, 2048, 50304), RunSpec(256)
    raw = yaml.safe_load(open(os.path.join(ROOT, "meshes", "paper-ib-roce-8x8.yaml")))
    layout = Layout(2, 4, 8, microbatches=32)
    by_policy = {}
    for remat in ("none", "selective", "full"):
        one = RunSpec(256, remat=remat)
        by_policy[remat] = plan_for_layout(topology_from_dict(raw), model, one, layout, [16, 16])
    steps = {k: p.predicted_step_s for k, p in by_policy.items()}
    peaks = {k: max(p.memory_per_stage_gb) for k, p in by_policy.items()}
    assert steps["none"] < steps["selective"] < steps["full"], steps
    assert peaks["none"] > peaks["selective"] > peaks["full"], peaks
    roomy = best_policy_plan(topology_from_dict(raw), model, run, layout)
    assert roomy.remat == "none" and roomy.to_dict()["remat"] == "none"
    for island in raw["islands"]:  # usable memory between selective's and none's peaks
        island["memory_gb"] = (peaks["selective"] + peaks["none"]) / 2 / 0.9
    tight = best_policy_plan(topology_from_dict(raw), model, run, layout)
    assert tight.remat == "selective" and tight.prediction.fits
    searched = search_plan(
        topology_from_dict(raw), model, run, remats=("none", "selective", "full")
    )
    assert searched.prediction.fits and searched.remat in ("none", "selective", "full")
    assert searched.predicted_step_s <= tight.predicted_step_s
