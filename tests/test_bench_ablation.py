"""scripts/bench_ablation.py: every ablation row's config loads through the real loader and
the planner prices it; ``--plan-only`` runs in seconds and its rows keep the relations the
cost model implies (not its numbers)."""

import json
import os
import subprocess
import sys

import pytest

from tests.common import ROOT, load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_ablation")


@pytest.mark.parametrize("label", ["two", "three"])
def test_rows_load_and_differ_where_the_component_matters(bench, label):
    mesh = bench.EMULATED_MESHES[label]
    rows = bench.ablation_rows(bench.EMULATED, mesh)
    assert set(rows) == {
        "full",
        "partition-off",
        "nic-off",
        "overlap-off",
        "all-off",
        "homogeneous",
    }
    for name, extra in rows.items():
        keys = [o.split("=", 1)[0] for o in extra]
        assert len(keys) == len(set(keys)), name  # one value per key: the table names it
        cfg = bench.row_config(bench.EMULATED, mesh, extra)  # the real loader, every override
        assert cfg.parallel.mesh == mesh
        assert cfg.parallel.enforce_islands == (name not in ("nic-off", "all-off")), name
    full = bench.row_config(bench.EMULATED, mesh, rows["full"]).parallel
    uniform = bench.row_config(bench.EMULATED, mesh, rows["partition-off"]).parallel
    assert full.stages > 1 and full.layers_per_stage != uniform.layers_per_stage
    assert uniform.layers_per_stage is None
    priced = bench.price_rows(bench.EMULATED, mesh, sync=True)
    t = {name: r["predicted_ms"] for name, r in priced.items()}
    # The slow island gets fewer layers, and the split the planner chose for blocking
    # collectives beats the even one as run; the fast twin (the same plan on the cluster
    # at its fastest) beats the real cluster; gradients on the 100 Mbit/s link cost more
    # than activations on it.
    assert t["homogeneous"] < t["full"] < t["partition-off"]
    assert t["nic-off"] > 2 * t["full"]
    assert "gpu_predicted_ms" in priced["overlap-off"]
    summary = bench.summary(priced, "predicted_ms")
    share = summary["shares"]
    assert abs(sum(share.values()) - 1) < 1e-2 and share["nic"] > share["partition"] > 0
    if label == "two":  # what EMULATED is chosen for: the targets, with a margin to measure
        assert summary["full_over_partition_off"] >= 1.25
        assert summary["nic_off_over_full"] >= 3


def test_the_fast_twin_runs_every_island_at_the_fastest_measured_speed(bench):
    """A profile measures each island by name: the twin takes the fastest island's
    measurement for all of them, so it prices as if the slow island were never slow."""
    from holmes_jax.core.plan_request import plan_request
    from holmes_jax.planner.placement import Calibration
    from holmes_jax.planner.plans import predict_run
    from holmes_jax.planner.topology import load_topology

    mesh = bench.EMULATED_MESHES["two"]
    topology = load_topology(mesh)
    cfg = bench.row_config(bench.EMULATED, mesh, bench.ablation_rows(bench.EMULATED, mesh)["full"])
    fast = Calibration(island_flops={"ib": (2e10, 1e10), "roce": (2e10, 1e10)})
    slow = Calibration(island_flops={"ib": (2e10, 1e10), "roce": (1e10, 5e9)})

    def step(topo, calibration):
        return predict_run(plan_request(cfg), topo, calibration, sync_collectives=True).step_s

    twin, twin_calibration = bench.fast_twin(topology, slow)
    assert twin_calibration.island_flops == fast.island_flops
    assert step(twin, twin_calibration) == pytest.approx(step(*bench.fast_twin(topology, fast)))
    assert step(twin, twin_calibration) < step(topology, slow)
    assert bench.fast_twin(topology) == (twin, None)


def test_shares_and_ranking_arithmetic(bench):
    times = {"full": 1.0, "partition-off": 1.5, "nic-off": 3.0, "overlap-off": 1.5}
    assert bench.shares(times) == {"partition": 0.167, "nic": 0.667, "overlap": 0.167}
    assert bench.shares({k: 1.0 for k in times}) == dict.fromkeys(bench.COMPONENTS)
    assert bench.ranking(times)[0] == "full" and bench.ranking(times)[-1] == "nic-off"
    assert bench.component_ranking(bench.shares(times))[0] == "nic"
    assert bench.component_ranking({"partition": 0.2, "nic": None, "overlap": 0.8}) == [
        "overlap",
        "partition",
        "nic",
    ]


def test_plan_only_prices_the_paper_shape():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_ablation.py"), "--plan-only"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    by = {(r["mesh"], r["row"]): r for r in lines}
    for mesh in ("paper-4x8", "paper-8x8"):
        t = {row: by[(mesh, row)]["tflops_per_gpu"] for (m, row) in by if m == mesh}
        assert len(t) == 6 and all(v > 0 for v in t.values())
        # Data groups across the 25 Gbit/s Ethernet cost far more than stage boundaries on it;
        # turning everything off is worst; the planner's split is never worse than even.
        assert t["nic-off"] < 0.8 * t["full"]
        assert t["all-off"] <= min(t["nic-off"], t["overlap-off"])
        assert t["partition-off"] <= t["full"] <= t["homogeneous"]
        assert t["full"] < 312  # below the A100's peak


def test_a_rows_step_weights_every_step_and_leaves_out_the_warm_up(bench):
    """The trainer logs a window's mean at its last step: the step at 11 is one step's time,
    the one at 10 five steps'; the compiling first step and the first window are not timed."""
    benchlib = bench.benchlib
    records = [
        {"step": 1, "step_time_s": 9.0, "compile_s": 60.0},
        {"step": 5, "step_time_s": 4.0},  # steps 2-5: warming, left out
        {"step": 10, "step_time_s": 1.0},  # steps 6-10
        {"step": 11, "step_time_s": 7.0},  # step 11
    ]
    assert benchlib.windows(records) == [(4, 4.0), (5, 1.0), (1, 7.0)]
    assert benchlib.steady_step_s(records, warmup_windows=1) == pytest.approx((5 + 7) / 6)
    assert benchlib.steady_step_s(records) == pytest.approx((16 + 5 + 7) / 10)
    assert benchlib.steady_step_s(records[:2], warmup_windows=1) == 4.0  # the only window
    with pytest.raises(RuntimeError, match="steps >= 2"):
        benchlib.steady_step_s(records[:1])


def test_the_homogeneous_row_runs_at_the_fastest_islands_share(bench, monkeypatch):
    from holmes_jax.cluster import cgroups

    monkeypatch.setattr(cgroups, "available", lambda root=cgroups.CPU_ROOT: True)
    assert bench.homogeneous_quota("auto") == "on"  # equal islands would get none under auto
    assert bench.homogeneous_quota("off") == "off"
    assert bench.homogeneous_quota("on") == "on"
    monkeypatch.setattr(cgroups, "available", lambda root=cgroups.CPU_ROOT: False)
    assert bench.homogeneous_quota("auto") == "auto"  # launch warns and runs without


def test_rounds_interleave_and_every_row_runs_once_a_round(bench):
    rows = ["full", "nic-off", "homogeneous"]
    assert bench.run_order(rows, 3) == [
        *[(0, "full"), (0, "nic-off"), (0, "homogeneous")],
        *[(1, "homogeneous"), (1, "nic-off"), (1, "full")],
        *[(2, "full"), (2, "nic-off"), (2, "homogeneous")],
    ]
    assert bench.run_order(rows, 1) == [(0, r) for r in rows]
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])


def test_a_rows_figure_is_its_fastest_round_and_the_medians_are_kept(bench, monkeypatch, tmp_path):
    """``measure`` with the launches faked: each row's step is its fastest round, its
    median round is kept beside it, and the summary is given for both; the launches run
    in the interleaved order and each round keeps its own log name."""
    from types import SimpleNamespace

    from holmes_jax.cluster import netns
    from holmes_jax.planner.topology import load_topology

    mesh = bench.EMULATED_MESHES["two"]
    monkeypatch.setattr(netns, "check_privileges", lambda: None)
    monkeypatch.setattr(
        bench.benchlib, "emulated_probe", lambda *a, **k: (load_topology(mesh), None, {})
    )
    rounds = {  # seconds a step, by row and round
        "full": [1.3, 1.1, 1.2],
        "partition-off": [1.5, 1.6, 1.4],
        "nic-off": [4.0, 4.4, 4.2],
        "overlap-off": [1.2, 1.25, 1.3],
        "all-off": [3.0, 3.1, 3.2],
        "homogeneous": [1.0, 1.05, 0.9],
    }
    launched = []

    def run(run_mesh, overrides, steps, folder, name, tag, cpu_quota):
        launched.append(name)
        row, _, k = name.removeprefix("two-").partition("-r")
        t = rounds[row][int(k or 0)]
        return [
            {"step": 1, "step_time_s": 9.0, "compile_s": 60.0},
            {"step": 5, "step_time_s": 2 * t},  # the warm-up window: left out
            {"step": 10, "step_time_s": t},
        ]

    monkeypatch.setattr(bench.benchlib, "emulated_run", run)
    args = SimpleNamespace(
        meshes="two", rows=",".join(bench.ROWS), rounds=3, cpu_quota="off",
        compile_cache=None, reuse_profile=False, steps=10,
    )  # fmt: skip
    block = bench.measure(args, str(tmp_path))["two"]
    assert launched[5:8] == ["two-homogeneous", "two-homogeneous-r1", "two-all-off-r1"]
    assert len(launched) == 18 and launched[-1] == "two-homogeneous-r2"
    table = block["rows"]
    assert list(table) == list(bench.ROWS)
    assert table["full"]["round_ms"] == [1300.0, 1100.0, 1200.0]
    assert table["full"]["step_ms"] == 1100.0 and table["full"]["median_ms"] == 1200.0
    assert block["measured"]["full_over_partition_off"] == round(1.4 / 1.1, 2)
    assert block["measured_median"]["full_over_partition_off"] == round(1.5 / 1.2, 2)
    assert block["measured_median"]["nic_off_over_full"] == round(4.2 / 1.2, 2)
