"""``python -m holmes_jax.probe``: fitting, unit conversion, the written profile, errors.

One probe run of a tiny model on ``cpu8-two-islands`` (through the CLI) is shared by the
tests that need real measurements; the unit tests use synthetic timings.
"""

import contextlib
import dataclasses
import io
import json
import math
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from holmes_jax import probe as probe_cli
from holmes_jax.core.config import load_config
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.plan_request import RunSpec, plan_request
from holmes_jax.core.spec import Layout, ModelSpec
from holmes_jax.plan import main as plan_main
from holmes_jax.planner.formulas import (
    all_gather_time,
    p2p_time,
    reduce_scatter_time,
    ring_allreduce_time,
)
from holmes_jax.planner.measurements import (
    ComputeTiming,
    LinkTiming,
    Measurement,
    fit_link,
    island_pairs,
    microbatch_size,
    pair_shape,
    profile_dict,
    stage_layers,
)
from holmes_jax.planner.placement import naive_hardware, stage_hardware
from holmes_jax.planner.profiles import (
    DATA_OPS,
    DATA_RING_OPS,
    SPANNING,
    data_key,
    load_profile,
    profile_from_dict,
)
from holmes_jax.planner.stage_costs import stage_costs
from holmes_jax.planner.topology import load_topology
from holmes_jax.runtime.probe import measure
from tests.common import ROOT, TINY_MODEL, as_flags

TWO = os.path.join(ROOT, "meshes", "cpu8-two-islands.yaml")
THREE = os.path.join(ROOT, "meshes", "cpu8-three-islands-uneven.yaml")
CONFIG = os.path.join(ROOT, "configs", "quickstart.yaml")
# 2 layers, hidden 32, seq 16; global batch 8 over 8 devices: micro-batch 1.
TINY = [*TINY_MODEL, "model.num_heads=2", "model.seq_len=16", "train.global_batch_size=8"]
SIZES = (4 * 1024, 64 * 1024)


def run_cli(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = probe_cli.main(list(args))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """The CLI run once: (exit code, stdout, stderr, profile path)."""
    path = tmp_path_factory.mktemp("probe") / "profile.json"
    code, out, err = run_cli(
        "--mesh", TWO, "--config", CONFIG, "--out", str(path), "--repeats", "2",
        "--sizes-kib", "4,64", *as_flags(TINY),
    )  # fmt: skip
    return code, out, err, path


# --------------------------------------------------------------------------- fitting


def test_fit_recovers_latency_and_bandwidth():
    sizes = [4e3, 6.4e4, 1e6, 1.6e7]
    bw, lat = 2.5e9, 30e-6  # bytes/s, s
    times = [lat + s / bw for s in sizes]
    got_bw, got_lat = fit_link(sizes, times)
    assert got_bw == pytest.approx(bw, rel=1e-9) and got_lat == pytest.approx(lat, rel=1e-9)
    # 2% multiplicative noise: the relative-error fit stays within a few percent
    noise = np.random.default_rng(0).uniform(0.98, 1.02, len(sizes))
    got_bw, got_lat = fit_link(sizes, np.array(times) * noise)
    assert got_bw == pytest.approx(bw, rel=0.05) and got_lat == pytest.approx(lat, rel=0.1)


def test_fit_never_returns_negative_latency_or_bandwidth():
    sizes = [1e3, 1e4, 1e5]
    # pure bandwidth with a time below the line at the small end: intercept would be < 0
    bw, lat = fit_link(sizes, [0.5e-6, 1e-5, 1e-4])
    assert lat == 0.0 and bw > 0
    # noise swamps the sizes (time falls as size grows): largest message, no latency
    bw, lat = fit_link(sizes, [3e-4, 2e-4, 1e-4])
    assert (bw, lat) == (pytest.approx(1e5 / 1e-4), 0.0)
    with pytest.raises(ConfigError, match="two distinct"):
        fit_link([1e3, 1e3], [1e-6, 1e-6])
    with pytest.raises(ConfigError, match="finite and > 0"):
        fit_link([1e3, 1e4], [1e-6, float("nan")])


# --------------------------------------------------------------------------- units


def _synthetic(topo, per_ring, per_sender):
    """A Measurement whose links follow exact laws (per-ring / per-sender bytes/s, s)."""
    sizes = (4096, 65536, 1 << 20)

    def ring(n, bw, lat):
        return tuple(ring_allreduce_time(s, n, bw, lat) for s in sizes)

    links = (
        LinkTiming("tensor", "ib", "all-reduce", 2, 1, sizes, ring(2, 12.5e9, 5e-6)),
        LinkTiming("data:ib", "ib", "all-reduce", 2, 2, sizes, ring(2, *per_ring)),
        LinkTiming("data:roce", "roce", "all-reduce", 2, 2, sizes, ring(2, *per_ring)),
        LinkTiming(
            "stage:ib:roce",
            "ib->roce",
            "p2p",
            2,
            2,
            sizes,
            tuple(p2p_time(s, *per_sender) for s in sizes),
        ),
    )
    compute = tuple(ComputeTiming(i.name, "cpu:0", 8, 0.02, 0.06, 0.005) for i in topo.islands)
    model = load_config(None).model.spec  # hidden 128, 4 heads, seq 128
    return Measurement(topo, model, 2, 3, compute, links, "cpu")


def test_profile_units_are_the_planners():
    """Per-ring and per-sender figures, scaled to per-host NICs in the profile, come back
    out of the planner's placement as the same per-ring and per-sender paths."""
    topo = load_topology(TWO)
    per_ring, per_sender = (1.5e9, 40e-6), (0.9e9, 120e-6)  # bytes/s, s
    raw = profile_dict(_synthetic(topo, per_ring, per_sender))
    assert set(raw["links"]) == {"tensor", "data:ib", "data:roce", "stage:ib:roce"}
    # 2 rings (one per tensor position) share each host's NIC
    assert raw["links"]["data:ib"]["bandwidth_gbps"] == pytest.approx(2 * 1.5e9 * 8 / 1e9)
    profiled, cal = profile_from_dict(raw, topo)
    # The probe's own layouts: island = one stage of data 2 x tensor 2; stage pair 0 -> 1.
    hw = stage_hardware(profiled, Layout(2, 2, 2, microbatches=1), cal)
    assert hw[0].data == pytest.approx(per_ring, rel=1e-5)
    assert hw[1].data == pytest.approx(per_ring, rel=1e-5)
    assert hw[0].tensor == pytest.approx((12.5e9, 5e-6), rel=1e-5)
    # a replica of t=2 ranks sends 2 x 64 KiB per device's 64 KiB: as long as one device's
    assert p2p_time(2 * 65536, *hw[0].send) == pytest.approx(p2p_time(65536, *per_sender))


def test_zero1_collectives_get_their_own_measured_paths():
    """A reduce-scatter and an all-gather timed on their own are fitted to their formulas
    and price ZeRO-1's collectives; the all-reduce still prices the data ring."""
    topo = load_topology(TWO)
    per_ring = (1.5e9, 40e-6)
    rs, ag = (0.6e9, 70e-6), (0.8e9, 50e-6)  # slower than half an all-reduce
    m = _synthetic(topo, per_ring, (0.9e9, 120e-6))
    sizes = m.links[0].sizes
    extra = tuple(
        LinkTiming(f"data:{isl}:{op}", isl, op, 2, 2, sizes, tuple(f(s, 2, *p) for s in sizes))
        for isl in ("ib", "roce")
        for op, f, p in (
            ("reduce-scatter", reduce_scatter_time, rs),
            ("all-gather", all_gather_time, ag),
        )
    )
    raw = profile_dict(dataclasses.replace(m, links=m.links + extra))
    assert "data:roce:all-gather" in raw["links"]
    profiled, cal = profile_from_dict(raw, topo)
    assert set(cal.data_ops["ib"]) == {"reduce-scatter", "all-gather"}
    hw = stage_hardware(profiled, Layout(2, 2, 2, microbatches=1), cal)
    assert hw[0].data == pytest.approx(per_ring, rel=1e-5)
    assert hw[0].scatter == pytest.approx(rs, rel=1e-5)
    assert hw[1].gather == pytest.approx(ag, rel=1e-5)
    model, layout = ModelSpec(4, 128, 4, 128, 256), Layout(2, 2, 2, microbatches=8)
    costs = stage_costs(model, RunSpec(16), layout, hw)
    plain = stage_costs(model, RunSpec(16), layout, stage_hardware(profiled, layout))
    assert np.all(costs.reduce[:, 1:] > plain.reduce[:, 1:])  # the slower measured paths
    assert np.all(costs.gather[:, 1:] > plain.gather[:, 1:])


def test_spanning_collectives_price_the_naive_data_group():
    """Collectives timed over one data group through every island (``data:*``), whatever
    their shape in size (gloo's own algorithms), come back out of the naive placement as
    the times that were measured, at the probed layout."""
    topo = load_topology(TWO)  # 2 islands x 2 hosts x 2 devices: data 4 x tensor 2
    m = _synthetic(topo, (1.5e9, 40e-6), (0.9e9, 120e-6))
    sizes = m.links[0].sizes
    measured = {  # seconds = a + S / b, S bytes per device
        "all-reduce": (3e-3, 2e8),
        "reduce-scatter": (5e-3, 1.5e8),
        "all-gather": (2e-3, 3e8),
    }
    spanning = tuple(
        LinkTiming(
            data_key(SPANNING, op), "all islands", op, 4, 2, sizes, tuple(a + s / b for s in sizes)
        )
        for op, (a, b) in measured.items()
    )
    raw = profile_dict(dataclasses.replace(m, links=m.links + spanning))
    assert {"data:*", "data:*:reduce-scatter", "data:*:all-gather"} <= set(raw["links"])
    profiled, cal = profile_from_dict(raw, topo)
    assert set(cal.spanning_ops) == set(DATA_RING_OPS) and cal.data_ops == {}
    [hw] = naive_hardware(profiled, Layout(1, 4, 2, microbatches=1), cal)
    for op, price, path in (
        ("all-reduce", ring_allreduce_time, hw.data),
        ("reduce-scatter", reduce_scatter_time, hw.scatter_path),
        ("all-gather", all_gather_time, hw.gather_path),
    ):
        a, b = measured[op]
        for s in sizes:
            assert price(s, 4, *path) == pytest.approx(a + s / b, rel=1e-5), (op, s)


def test_spanning_points_price_each_call_of_the_probed_layout_by_its_size():
    """A collective whose time grows faster than its bytes (gloo's all-gather across the
    emulated islands) is priced, on the layout the probe timed, call by call through the
    measured points: ZeRO-1's all-gather is each stacked parameter leaf's time, summed; the
    flat per-layer gradient buckets are one layer's reduce-scatter each. Another layout
    keeps the fitted line, as a profile without points does."""
    topo = load_topology(TWO)  # 8 devices: the probe's spanning ring is data 4 x tensor 2
    m = _synthetic(topo, (1.5e9, 40e-6), (0.9e9, 120e-6))
    sizes = (4096, 65536, 1 << 20, 1 << 23)

    def seconds(op, size):  # superlinear: 1 MiB in 0.05 s, 8 MiB in ~2.2 s
        return (2e-3 if op == "all-gather" else 3e-3) + size / 2e8 + (size / 2**23) ** 2 * 2

    spanning = tuple(
        LinkTiming(
            data_key(SPANNING, op),
            "all islands",
            op,
            4,
            2,
            sizes,
            tuple(seconds(op, x) for x in sizes),
        )
        for op in DATA_RING_OPS
    )
    raw = profile_dict(dataclasses.replace(m, links=m.links + spanning))
    points = raw["links"]["data:*:all-gather"]["points"]
    assert points == {"ranks": 4, "tensor": 2, "bytes": list(sizes), "seconds": pytest.approx(
        [seconds("all-gather", x) for x in sizes], rel=1e-5)}  # fmt: skip
    assert "points" not in raw["links"]["data:ib"]
    profiled, cal = profile_from_dict(raw, topo)
    lined = dataclasses.replace(cal, spanning_points={})
    model = ModelSpec(6, 256, 4, 32, 512, tied_embeddings=False)
    run = RunSpec(8, param_bytes=4, sync_collectives=True, grad_buckets="layer")

    def interp(op, nbytes):  # the points, read independently of the planner
        xs, ys = sizes, [seconds(op, x) for x in sizes]
        if nbytes <= 0:
            return 0.0
        if nbytes > xs[-1]:
            return ys[-1] + (nbytes - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return float(np.interp(nbytes, xs, ys))

    layout = Layout(1, 4, 2, microbatches=1)
    [hw] = naive_hardware(profiled, layout, cal)
    costs = stage_costs(model, run, layout, [hw])
    L = model.num_layers
    ends = model.embedding_leaf_params + model.head_leaf_params
    gather = sum(interp("all-gather", L * x / 2 * 4) for x in model.layer_leaf_params)
    gather += sum(interp("all-gather", x / 2 * 4) for x in ends)
    assert costs.gather[0, L] == pytest.approx(gather, rel=1e-5)
    reduce = L * interp("reduce-scatter", model.layer_params / 2 * 4)
    reduce += interp("reduce-scatter", sum(ends) / 2 * 4)
    assert costs.reduce[0, L] == pytest.approx(reduce, rel=1e-5)
    [line] = naive_hardware(profiled, layout, lined)
    assert costs.gather[0, L] > 1.5 * stage_costs(model, run, layout, [line]).gather[0, L]
    # Data 8 x tensor 1 was not timed: the line prices it, points or not.
    other = Layout(1, 8, 1, microbatches=1)
    priced = [
        stage_costs(model, run, other, naive_hardware(profiled, other, c)) for c in (cal, lined)
    ]
    assert priced[0].gather[0, L] == priced[1].gather[0, L]
    assert priced[0].reduce[0, L] == priced[1].reduce[0, L]


@pytest.mark.parametrize(
    "points, rule",
    [
        ({"ranks": 4, "tensor": 2, "bytes": [2, 1], "seconds": [1, 2]}, "strictly ascending"),
        ({"ranks": 4, "tensor": 2, "bytes": [1, 2], "seconds": [1]}, "at least two"),
        ({"ranks": 4, "tensor": 2, "bytes": [1, 2, 3], "seconds": [1, 2]}, "one time per size"),
        ({"ranks": 4, "tensor": 2, "bytes": [1, 2], "seconds": [1, 0]}, "must be > 0"),
        ({"ranks": 1, "tensor": 2, "bytes": [1, 2], "seconds": [1, 2]}, "must be >= 2"),
    ],
)
def test_bad_points_are_one_line_errors(points, rule):
    topo = load_topology(TWO)
    raw = profile_dict(_synthetic(topo, (1.5e9, 40e-6), (0.9e9, 120e-6)))
    raw["links"]["data:*"] = {"bandwidth_gbps": 1.0, "latency_us": 10.0, "points": points}
    with pytest.raises(ConfigError, match=rule) as e:
        profile_from_dict(raw, topo)
    assert "links.data:*.points" in str(e.value) and "\n" not in str(e.value)
    raw["links"]["data:ib"]["points"] = points  # only a ring through every island has them
    del raw["links"]["data:*"]
    with pytest.raises(ConfigError, match="unknown key"):
        profile_from_dict(raw, topo)


def test_profile_reproduces_the_measured_fp32_layer():
    topo = load_topology(TWO)
    raw = profile_dict(_synthetic(topo, (1e9, 1e-5), (1e9, 1e-5)))
    assert raw["measured_with"]["act_bytes"] == 4
    profiled, cal = profile_from_dict(raw, topo)
    model = ModelSpec(4, 128, 4, 128, 256)
    layout = Layout(4, 2, 1, microbatches=4)  # 16 / (2 data x 4 micro-batches) = 2 = measured size
    run = RunSpec(16, act_bytes=4, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    hw = stage_hardware(profiled, layout, cal)
    costs = stage_costs(model, run, layout, hw)
    for s in range(4):  # stages 0, 1 on ib, 2, 3 on roce
        # the probe times the bare layer; the engine adds its per-layer weight slice (read +
        # write) to each pass and the fp32 gradient accumulation to the backward
        moved = 2 * model.layer_params * 4 / hw[s].mem_bw
        assert costs.fwd[s, 2] - costs.fwd[s, 1] == pytest.approx(0.02 + moved)
        assert costs.bwd[s, 2] - costs.bwd[s, 1] == pytest.approx(0.04 + 2 * moved)
    bare = stage_costs(model, dataclasses.replace(run, engine="megatron"), layout, hw)
    assert bare.fwd[0, 2] - bare.fwd[0, 1] == pytest.approx(0.02)


def test_pair_layout_on_uneven_islands():
    topo = load_topology(THREE)  # 4 + 2 + 2 devices, 2 per host
    shape = pair_shape(topo)
    assert (shape.stages, shape.data, shape.tensor) == (4, 1, 2)
    # last stage of a -> first of b, etc.; each stage is one host's 2 devices
    assert island_pairs(topo, shape) == [(1, 2, 2), (1, 3, 2), (2, 3, 2)]


def test_islands_sharing_a_process_are_timed_together():
    topo = load_topology(THREE)
    devs = lambda procs: [SimpleNamespace(process_index=p) for p in procs]  # noqa: E731
    one = measure._process_groups(topo, devs([0] * 8))
    assert [g["islands"] for g in one] == [{0, 1, 2}]
    # one process per host: every island alone
    split = measure._process_groups(topo, devs([0, 0, 1, 1, 2, 2, 3, 3]))
    assert sorted(min(g["islands"]) for g in split) == [0, 1, 2]
    # a process holding the last host of island 0 and island 1
    joined = measure._process_groups(topo, devs([0, 0, 1, 1, 1, 1, 2, 2]))
    assert sorted(sorted(g["islands"]) for g in joined) == [[0, 1], [2]]


def test_gather_merges_what_each_process_measured(monkeypatch):
    from jax.experimental import multihost_utils

    nan = math.nan
    compute = [ComputeTiming("ib", "cpu:0", 4, 1.0, 3.0, 0.5)]
    compute.append(ComputeTiming("roce", "cpu:4", 4, nan, nan, nan))
    links = [LinkTiming("data:roce", "roce", "all-reduce", 2, 2, (4, 8), (nan, nan))]
    other = np.array([nan, nan, nan, 2.0, 5.0, 0.7, 1e-3, 2e-3])  # process 1: roce

    def allgather(x):
        return np.stack([x, other])

    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    compute, links = measure._gather(compute, links)
    assert (compute[0].fwd_s, compute[1].fwd_s, compute[1].alone_fwd_s) == (1.0, 2.0, 0.7)
    assert links[0].times_s == (1e-3, 2e-3)


def test_gather_takes_the_fair_share_of_an_islands_processes(monkeypatch):
    """Two processes of one island ran the layer at once, one favoured by the scheduler
    (1 s and 3 s per call): the island's figure is the time per call at their summed rate
    (the harmonic mean, 1.5 s), not the faster or slower one; links keep the slowest."""
    from jax.experimental import multihost_utils

    compute = [ComputeTiming("ib", "cpu:0", 2, 1.0, 2.0, 0.5)]
    links = [LinkTiming("data:ib", "ib", "all-reduce", 2, 1, (4, 8), (1e-3, 3e-3))]
    other = np.array([3.0, 6.0, 0.6, 2e-3, 1e-3])

    def allgather(x):
        return np.stack([x, other])

    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    (ib,), (link,) = measure._gather(compute, links)
    assert (ib.fwd_s, ib.fwd_bwd_s) == (pytest.approx(1.5), pytest.approx(3.0))
    assert ib.alone_fwd_s == 0.6
    assert link.times_s == (2e-3, 3e-3)


def test_shared_times_alternate_the_calls_in_every_window(monkeypatch):
    """Every process runs the programs in turn for the same windows, each after a barrier:
    both are called equally often, for at least the windows, and each figure is per call."""
    from jax.experimental import multihost_utils

    barriers = []
    monkeypatch.setattr(multihost_utils, "sync_global_devices", barriers.append)
    monkeypatch.setattr(measure, "CHAIN_S", 0.002)
    monkeypatch.setattr(measure, "LOAD_FACTOR", 1)
    calls = {"fast": 0, "slow": 0}

    def call(name, seconds):
        def run():
            calls[name] += 1
            time.sleep(seconds)
            return np.zeros(())

        return run

    start = time.perf_counter()
    # 1 ms against 20 ms: a loaded machine oversleeps the short one by a few ms at most
    fast, slow = measure._shared_times([call("fast", 0.001), call("slow", 0.02)], repeats=5)
    assert time.perf_counter() - start >= 5 * 2 * 0.002
    assert len(barriers) == measure.WINDOWS  # one before each window
    assert calls["fast"] == calls["slow"] >= measure.WINDOWS + measure._WARMUP
    assert 0.02 <= slow and 0.001 <= fast < slow


def test_processes_meet_at_a_barrier_before_a_collective(monkeypatch):
    """With several processes, each agreement first waits at a coordination-service barrier
    (a gloo context waits only 30 s for a peer still compiling under a small CPU quota),
    with a name of its own and the long wait."""
    import jax
    from jax.experimental import multihost_utils

    from holmes_jax.cluster import distributed

    events = []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(
        distributed, "barrier", lambda name, timeout_s: events.append(("barrier", name, timeout_s))
    )

    def allgather(x):
        events.append(("allgather",))
        return np.stack([x, x + 3])

    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    assert measure._agreed_max(4) == 7
    assert measure._agreed_max(1) == 4
    kinds = [e[0] for e in events]
    assert kinds == ["barrier", "allgather", "barrier", "allgather"]
    names = [e[1] for e in events if e[0] == "barrier"]
    assert len(set(names)) == 2
    assert all(e[2] == measure.PEER_WAIT_S for e in events if e[0] == "barrier")


def test_probe_times_one_micro_batch_of_a_replicated_plan():
    """Every replica trains its own share of the global batch: 32 sequences over replica 2 x
    data 4 x 1 micro-batch is 4 per micro-batch (the probe once timed 8)."""
    topo = load_topology(TWO)
    cfg = load_config(
        CONFIG,
        [f"parallel.mesh={TWO}", "parallel.replica=2", "parallel.stages=1", "parallel.data=4",
         "parallel.microbatches=1", "parallel.layers_per_stage=null"],
    )  # fmt: skip
    assert microbatch_size(plan_request(cfg), topo) == 4


# --------------------------------------------------------------------------- real run


def test_probe_writes_a_profile_the_planner_reads(probed, capsys):
    code, out, err, path = probed
    assert code == 0, err
    raw = json.loads(path.read_text())
    assert raw["topology"] == "cpu8-two-islands"
    assert raw["measured_with"] == {
        "hidden_size": 32,
        "seq_len": 16,
        "num_heads": 2,
        "mlp_ratio": 4,
        "microbatch_size": 1,
        "tensor": 1,
        "act_bytes": 4,
    }
    assert set(raw["compute"]) == {"ib", "roce"}
    zero1 = {f"data:{i}:{op}" for i in ("ib", "roce") for op in DATA_OPS}
    spanning = {"data:*", "data:*:reduce-scatter", "data:*:all-gather"}
    assert (
        set(raw["links"]) == {"tensor", "data:ib", "data:roce", "stage:ib:roce"} | zero1 | spanning
    )
    numbers = [v for item in raw["compute"].values() for v in item.values()]
    assert all(math.isfinite(v) and v > 0 for v in numbers)
    for link in raw["links"].values():
        assert math.isfinite(link["bandwidth_gbps"]) and link["bandwidth_gbps"] > 0
        assert math.isfinite(link["latency_us"]) and link["latency_us"] >= 0
    load_profile(path, load_topology(TWO))  # the loader accepts every key
    code = plan_main(
        ["--config", CONFIG, "--mesh", TWO, "--profile", str(path), "--json", *as_flags(TINY)]
    )
    plan_out, plan_err = capsys.readouterr()
    assert code == 0, plan_err
    assert json.loads(plan_out)["predicted_step_s"] > 0


def test_probe_prints_table_and_progress(probed):
    code, out, err, path = probed
    assert code == 0
    for text in (
        "probe of topology cpu8-two-islands",
        "micro-batch 1",
        "data:roce",
        "data:*:all-gather",
        "ib->roce",
    ):
        assert text in out
    assert f"wrote {path}" in out
    assert "probe: point-to-point stage 0 (ib) -> stage 1 (roce)" in err
    for op in DATA_RING_OPS:  # 2 islands x 2 hosts x 2 devices: 2 rings of 4 ranks
        assert f"probe: {op} over data across islands (4 ranks)" in err


def test_probe_function_on_one_island():
    """``probe()`` for notebooks; one island: no stage pair to time."""
    cfg = load_config(CONFIG, TINY)
    topo = load_topology(os.path.join(ROOT, "meshes", "cpu8-one-island.yaml"))
    lines = []
    raw = measure.probe(cfg, topo, repeats=1, sizes=SIZES, log=lines.append)
    island = topo.islands[0].name
    ops = {f"data:{island}:{op}" for op in DATA_OPS}
    assert set(raw["links"]) == {"tensor", f"data:{island}"} | ops
    assert set(raw["compute"]) == {island} and lines
    profile_from_dict(raw, topo)


def test_under_a_cpu_quota_links_are_timed_after_compute(monkeypatch):
    """A process with a CPU quota makes every process time each link right after a burst
    of compute and subtract the burst alone (a throttled host stalls a collective); without
    one the links are timed alone."""
    cfg = load_config(CONFIG, TINY)
    topo = load_topology(os.path.join(ROOT, "meshes", "cpu8-one-island.yaml"))
    seen = []

    def fake(mesh, axis, op, sizes, repeats, perm=None, after=False):
        seen.append(after)
        return [1e-3 * (i + 1) for i in range(len(sizes))]

    monkeypatch.setattr(measure, "_time_collective", fake)
    monkeypatch.setattr(measure, "own_share", lambda: 0.25)
    lines = []
    measure.probe(cfg, topo, repeats=1, sizes=SIZES, log=lines.append)
    assert seen and all(seen)
    assert any("after a burst of compute" in line for line in lines)
    seen.clear()
    monkeypatch.setattr(measure, "own_share", lambda: None)
    measure.probe(cfg, topo, repeats=1, sizes=SIZES, log=lines.append)
    assert seen and not any(seen)


def test_a_link_timed_after_compute_is_the_difference(monkeypatch):
    """Burst then collective, less the burst alone, per size; never below the call alone."""
    import jax

    from holmes_jax.core.spec import Degrees

    mesh = measure._mesh(Degrees(1, 8, 1), jax.devices())
    times = iter([1e-3, 5e-3, 3e-3, 1e-3, 2e-3, 4e-3])  # (alone, both, burst) per size
    monkeypatch.setattr(measure, "_median_time", lambda call, repeats: next(times))
    got = measure._time_collective(mesh, "data", "all-reduce", SIZES, 1, after=True)
    assert got == [pytest.approx(2e-3), 1e-3]


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--mesh", "meshes/nope.yaml"], "mesh 'meshes/nope.yaml'"),
        ([], "--mesh=None"),
        (["--mesh", TWO, "--set", "model.num_heads=5"], "model.num_heads=5"),
        (["--mesh", TWO, "--sizes-kib", "4,x"], "--sizes-kib='4,x'"),
        (["--mesh", TWO, "--sizes-kib", "4"], "need >= 2 distinct sizes"),
        (["--mesh", TWO, "--repeats", "0"], "--repeats=0"),
        (["--mesh", TWO, "--set", "train.global_batch_size=12"], "global_batch_size=12"),
    ],
)
def test_errors_are_one_line_exit_2(args, needle):
    code, out, err = run_cli(*args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err


def test_module_imports_no_jax_and_entry_point_reports_errors():
    code = (
        "import sys\n"
        "import holmes_jax.probe\n"
        "assert 'jax' not in sys.modules, 'importing the probe must not import jax'\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    res = subprocess.run(
        [sys.executable, "-m", "holmes_jax.probe", "--mesh", "meshes/nope.yaml"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert res.returncode == 2 and res.stderr.count("\n") == 1


def test_the_timed_stage_has_the_layers_one_device_runs():
    """A stage of the plan: the largest layers_per_stage entry, else the even split over
    stages x virtual stages rounded up, capped."""
    base = [f"parallel.mesh={TWO}", "parallel.stages=2"]
    cases = [
        (["parallel.layers_per_stage=[3,5]"], 8, 5),
        (["parallel.layers_per_stage=auto"], 8, 4),
        (["model.num_layers=7", "parallel.layers_per_stage=auto"], 8, 4),
        (["parallel.layers_per_stage=[3,5]"], 2, 2),
    ]
    for extra, most, want in cases:
        assert stage_layers(plan_request(load_config(CONFIG, base + extra)), most) == want, extra
