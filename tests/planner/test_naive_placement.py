"""The naive placement (``parallel.enforce_islands: false``) and ``predict_run``."""

import pytest

from holmes_jax.core.config import load_config
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.plan_request import RunSpec, plan_request
from holmes_jax.core.spec import Degrees, Layout, ModelSpec
from holmes_jax.planner.placement import Calibration, naive_hardware, stage_hardware
from holmes_jax.planner.plans import make_plan, predict_run
from holmes_jax.planner.search import plan_for_layout
from holmes_jax.planner.stage_costs import stage_costs
from holmes_jax.planner.topology import Link, load_topology, topology_from_dict
from tests.common import config_path, mesh_path

# The bench_islands.py model: gradients ~400x one micro-batch's activations.
MODEL = [
    "model.num_layers=4",
    "model.hidden_size=256",
    "model.num_heads=4",
    "model.seq_len=32",
    "model.tied_embeddings=false",
    "train.global_batch_size=8",
]
NAIVE = ["parallel.stages=1", "parallel.data=4", "parallel.enforce_islands=false"]
HOLMES = ["parallel.stages=2", "parallel.data=2", "parallel.microbatches=4"]
HOLMES += ["parallel.schedule=1f1b", "parallel.layers_per_stage=auto"]


def island(name, gbps, hosts=2, per_host=1, latency_us=50):
    return {
        "name": name,
        "nic": "roce",
        "link": {"bandwidth_gbps": gbps, "latency_us": latency_us},
        "hosts": [f"{name}-{h}" for h in range(hosts)],
        "devices_per_host": per_host,
        "device_kind": "cpu",
        "peak_tflops": 0.05,
        "memory_gb": 4,
        "memory_bandwidth_gbs": 5,
    }


def topology(islands, inter_gbps=0.1, overrides=()):
    raw = {
        "name": "t",
        "intra_host": {"bandwidth_gbps": 100, "latency_us": 5},
        "islands": islands,
    }
    if len(islands) > 1:
        raw["inter_island"] = {
            "default": {"bandwidth_gbps": inter_gbps, "latency_us": 50},
            "overrides": [
                {"between": list(pair), "bandwidth_gbps": gbps, "latency_us": 50}
                for pair, gbps in overrides
            ],
        }
    return topology_from_dict(raw)


def two_islands(inter_gbps, nic_gbps=1.0):
    """bench_islands.py's emulated network: 2 islands of 2 single-device hosts."""
    return topology([island("a", nic_gbps), island("b", nic_gbps)], inter_gbps)


def config(extra):
    return plan_request(load_config(None, MODEL + extra))


# --------------------------------------------------------------------------- the ring


def test_naive_ring_runs_at_the_slowest_hop():
    topo = load_topology(mesh_path("cpu8-two-islands.yaml"))
    inter = topo.inter_island("ib", "roce")  # 1 Gbit/s Ethernet, 200 us
    hops = [inter, *(isl.link for isl in topo.islands), topo.intra_host]
    assert inter.bytes_per_s == min(h.bytes_per_s for h in hops)
    [hw] = naive_hardware(topo, Layout(1, 8, 1, microbatches=1))
    assert hw.data == (inter.bytes_per_s, max(h.latency_s for h in hops))
    assert hw.send == (float("inf"), 0.0) and hw.tie == (float("inf"), 0.0)
    # The island-respecting data rings never cross that link.
    respecting = stage_hardware(topo, Layout(2, 4, 1, microbatches=1))
    assert all(s.data[0] > inter.bytes_per_s for s in respecting)
    # Two tensor positions: two rings share every NIC and the inter-island link.
    [hw2] = naive_hardware(topo, Layout(1, 4, 2, microbatches=1))
    assert hw2.data[0] == inter.bytes_per_s / 2


def test_naive_ring_crosses_consecutive_islands_and_multi_host_nics_only():
    # Device order a, b, c, d: the ring's inter-island hops are a-b, b-c, c-d and d-a.
    islands = [island("a", 25), island("b", 25), island("c", 25), island("d", 0.5, hosts=1)]
    overrides = [(("a", "c"), 0.1), (("a", "d"), 2.0)]  # a-c is no hop; d's NIC is unused
    topo = topology(islands, inter_gbps=4.0, overrides=overrides)
    [hw] = naive_hardware(topo, Layout(1, 7, 1, microbatches=1))
    assert hw.data[0] == Link(2.0, 50).bytes_per_s
    slow_nic = topology([island("a", 1.5), island("b", 25)], inter_gbps=4.0)
    [hw] = naive_hardware(slow_nic, Layout(1, 4, 1, microbatches=1))
    assert hw.data[0] == Link(1.5, 50).bytes_per_s


def test_naive_zero1_paths_add_the_measured_per_byte_extra():
    topo = load_topology(mesh_path("cpu8-two-islands.yaml"))  # NICs 25 and 10 Gbit/s
    ops = {"ib": {"reduce-scatter": Link(12.5, 30)}, "roce": {"reduce-scatter": Link(5, 40)}}
    [hw] = naive_hardware(topo, Layout(1, 8, 1, microbatches=1), Calibration(data_ops=ops))
    extra = max(8 / 12.5e9 - 8 / 25e9, 8 / 5e9 - 8 / 10e9)  # s/byte beyond the all-reduce
    assert hw.scatter_path[0] == pytest.approx(1 / (1 / hw.data[0] + extra), rel=1e-12)
    assert hw.scatter_path[1] == hw.data[1]  # 200 us inter-island > 30, 40 us
    assert hw.gather is None and hw.gather_path == hw.data  # not measured: the ring's


def test_naive_grad_sync_follows_the_spanning_measurement():
    """Collectives measured through every island (``Calibration.spanning_ops``) price the
    naive data group, not the hops: twice the measured time is twice the priced reduction
    and gather, and a faster inter-island link changes nothing. Without them the slowest
    hop prices it."""
    three = [island("ib", 1), island("roce", 1), island("eth", 1)]  # 6 single-device hosts
    slow, fast = topology(three, inter_gbps=0.1), topology(three, inter_gbps=0.5)
    model, layout = ModelSpec(4, 256, 4, 32, 512), Layout(1, 6, 1, microbatches=1)
    run = RunSpec(12, sync_collectives=True)

    def sync(topo, spanning):  # (reduce-scatter, all-gather) seconds of 4 layers' gradients
        [hw] = naive_hardware(topo, layout, Calibration(spanning_ops=spanning))
        costs = stage_costs(model, run, layout, [hw])
        return costs.reduce[0, 4], costs.gather[0, 4]

    measured = {op: Link(0.05, 800) for op in ("all-reduce", "reduce-scatter", "all-gather")}
    twice = {op: Link(0.025, 1600) for op in measured}  # half the bandwidth, twice the latency
    base = sync(slow, measured)
    assert sync(slow, twice) == pytest.approx((2 * base[0], 2 * base[1]), rel=1e-12)
    assert sync(fast, measured) == base
    [hw] = naive_hardware(slow, layout, Calibration(spanning_ops=measured))
    link = measured["all-reduce"]
    assert hw.data == (link.bytes_per_s, link.latency_s)  # t = 1: one ring per NIC
    # Not measured: the 100 Mbit/s inter-island hop, and a faster one prices faster.
    [plain] = naive_hardware(slow, layout)
    assert plain.data == pytest.approx((0.1e9 / 8, 50e-6), rel=1e-12)
    assert sync(fast, {})[0] < sync(slow, {})[0]


def test_naive_takes_the_slowest_island_devices():
    topo = two_islands(1.0)
    cal = Calibration(island_flops={"a": (4e10, 3e10), "b": (2e10, 3.5e10)})
    [hw] = naive_hardware(topo, Layout(1, 4, 1, microbatches=1), cal, memory_fraction=0.5)
    assert (hw.fwd_flops, hw.bwd_flops, hw.island) == (2e10, 3e10, 1)
    assert hw.memory_bytes == 4e9 * 0.5


@pytest.mark.parametrize(
    "layout, match",
    [
        (Layout(2, 2, 1, microbatches=1), "enforce_islands=false.*stages=2"),
        (Layout(1, 2, 1, microbatches=1, replica=2), "enforce_islands=false.*replica=2"),
        (Layout(1, 2, 1, microbatches=1), "must equal the 4 devices"),
        (Layout(1, 2, 2, microbatches=1), "parallel.tensor=2"),
    ],
)
def test_undefined_naive_placements_are_one_line_errors(layout, match):
    with pytest.raises(ConfigError, match=match) as e:
        naive_hardware(two_islands(1.0), layout)
    assert "\n" not in str(e.value)


def test_multi_stage_naive_config_is_a_one_line_error():
    cfg = config(["parallel.stages=2", "parallel.data=2", "parallel.enforce_islands=false"])
    with pytest.raises(ConfigError, match="naive placement is one stage") as e:
        predict_run(cfg, two_islands(1.0))
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- the step


def test_naive_step_is_slower_than_the_island_plan_on_a_slow_link():
    topo = two_islands(0.1)  # bench_islands.py's 100 Mbit/s between islands
    naive = predict_run(config(NAIVE), topo).step_s
    assert naive > 2 * predict_run(config(HOLMES), topo).step_s
    assert naive > 2 * make_plan(config(NAIVE), topo).predicted_step_s  # the searched plan


def test_naive_step_speeds_up_with_the_link_until_the_nics_bound_it():
    steps = [predict_run(config(NAIVE), two_islands(g)).step_s for g in (0.03, 0.1, 0.3, 1)]
    assert all(a > b for a, b in zip(steps, steps[1:], strict=False))
    for faster in (3.0, 100.0):  # past the 1 Gbit/s NICs the inter-island link is no hop
        assert predict_run(config(NAIVE), two_islands(faster)).step_s == steps[-1]


def test_naive_step_converges_to_one_island_when_the_link_is_as_fast():
    """Inter-island link as fast as the NICs: exactly data parallel inside one island."""
    one = topology([island("a", 1.0, hosts=4)])
    for sync in (False, True):
        naive = predict_run(config(NAIVE), two_islands(1.0), sync_collectives=sync)
        island_dp = predict_run(
            config(["parallel.stages=1", "parallel.data=4"]), one, sync_collectives=sync
        )
        assert naive == island_dp
        slower = predict_run(config(NAIVE), two_islands(0.5), sync_collectives=sync)
        assert slower.step_s > island_dp.step_s


# --------------------------------------------------------------------------- predict_run


@pytest.mark.parametrize("mesh", ["cpu8-two-islands.yaml", "cpu8-three-islands-uneven.yaml"])
def test_predict_run_with_islands_is_the_planners_prediction(mesh):
    topo = load_topology(mesh_path(mesh))
    extra = ["parallel.stages=4", "parallel.microbatches=4", "parallel.schedule=1f1b"]
    auto = plan_request(
        load_config(config_path("quickstart.yaml"), extra + ["parallel.layers_per_stage=auto"])
    )
    assert predict_run(auto, topo) == make_plan(auto, topo, keep_degrees=True).prediction
    cfg = plan_request(
        load_config(config_path("quickstart.yaml"), extra + ["parallel.layers_per_stage=[1,3,2,2]"])
    )
    cal = Calibration(efficiency=0.3)
    model, run = cfg.model, cfg.run
    layout = cfg.parallel.layout(Degrees(4, topo.num_devices // 4, 1))
    given = plan_for_layout(topo, model, run, layout, [1, 3, 2, 2], cal).prediction
    assert predict_run(cfg, topo, cal) == given
    assert given.layers_per_stage == (1, 3, 2, 2)


def test_predict_run_prices_zero1_and_sync_collectives():
    topo = two_islands(0.1)
    base = predict_run(config(NAIVE), topo)
    assert predict_run(config([*NAIVE, "optimizer.zero1=false"]), topo) != base
    holmes = config(["parallel.stages=2", "parallel.data=2", "parallel.layers_per_stage=[2,2]"])
    assert (
        predict_run(holmes, topo, sync_collectives=True).step_s > predict_run(holmes, topo).step_s
    )
