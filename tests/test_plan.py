"""``python -m holmes_jax.plan``: text and JSON output, options, errors, the profile, no jax."""

import json
import os
import subprocess
import sys

import pytest

from holmes_jax import plan as plan_cli
from tests.common import ROOT, as_flags

CONFIG = os.path.join(ROOT, "configs", "quickstart.yaml")
TWO = os.path.join(ROOT, "meshes", "cpu8-two-islands.yaml")
PAPER = os.path.join(ROOT, "meshes", "paper-ib-roce-8x8.yaml")
GPT13B = [
    "model.num_layers=40",
    "model.hidden_size=5120",
    "model.num_heads=40",
    "model.seq_len=2048",
    "model.vocab_size=51200",
    "train.global_batch_size=128",
    "model.remat=true",
]


def run(capsys, *args):
    code = plan_cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_text_report_shows_plan_breakdown_and_splits(capsys):
    code, out, err = run(capsys, "--config", CONFIG, "--mesh", TWO)
    assert code == 0, err
    for text in (
        "topology cpu8-two-islands",
        "stages per island",
        "predicted step",
        "TFLOP/s per device",
        "memory GB",
        "grad_sync",
        "uniform",
        "holmes",
        "optimal",
    ):
        assert text in out


def test_json_has_the_plan_fields(capsys):
    code, out, _ = run(capsys, "--config", CONFIG, "--mesh", PAPER, "--json", *as_flags(GPT13B))
    assert code == 0
    d = json.loads(out)
    for key in (
        "layers_per_stage",
        "stages_per_island",
        "predicted_step_s",
        "tflops_per_device",
        "breakdown",
        "alternatives",
    ):
        assert key in d
    assert sum(d["layers_per_stage"]) == 40
    assert sum(d["stages_per_island"]) == d["stages"] * (d["replica"] if d["replica"] > 1 else 1)
    assert sum(d["breakdown"].values()) == pytest.approx(d["predicted_step_s"])
    assert set(d["alternatives"]) == {"uniform", "holmes", "optimal"}
    assert d["alternatives"]["optimal"]["predicted_step_s"] == pytest.approx(d["predicted_step_s"])
    # slow Ethernet between the islands: the pipeline crosses them
    assert d["replica"] == 1 and set(d["stage_islands"]) == {"ib", "roce"}
    # every schedule priced on the chosen degrees; the plan's is the best of them
    assert set(d["schedules"]) == {"gpipe", "1f1b", "interleaved", "zb"}
    steps = {k: v["predicted_step_s"] for k, v in d["schedules"].items() if v}
    assert steps[d["schedule"]] == pytest.approx(d["predicted_step_s"])
    assert min(steps.values()) == pytest.approx(d["predicted_step_s"])
    assert 0 <= d["bubble_fraction"] < 1 and len(d["p2p_bytes_per_boundary"]) >= d["stages"] - 1
    # what the pipeline sends across the islands per step, in each cross_island_dtype
    b = d["cross_island_bytes_per_step"]
    assert d["cross_island_dtype"] == "same" and 0 < b["int8"] == b["fp8"] < b["bf16"] <= b["same"]


def test_keep_degrees_and_partition_choice(capsys):
    degrees = as_flags(
        [
            "parallel.stages=4",
            "parallel.data=2",
            "parallel.tensor=1",
            "parallel.microbatches=8",
            "parallel.schedule=1f1b",
            "model.num_layers=10",
        ]
    )
    code, out, _ = run(
        capsys,
        "--config",
        CONFIG,
        "--mesh",
        TWO,
        "--json",
        "--keep-degrees",
        "--partition",
        "uniform",
        *degrees,
    )
    assert code == 0
    d = json.loads(out)
    assert (d["stages"], d["data"], d["microbatches"], d["schedule"]) == (4, 2, 8, "1f1b")
    assert d["layers_per_stage"] == [3, 3, 2, 2] and d["method"] == "uniform"
    assert d["stages_per_island"] == [2, 2]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--mesh", "meshes/nope.yaml"], "mesh 'meshes/nope.yaml'"),
        (["--mesh", TWO, "--set", "model.num_heads=5"], "model.num_heads=5"),
        (["--mesh", TWO, "--set", "model.colour=1"], "model.colour"),
        (
            [
                "--mesh",
                TWO,
                "--keep-degrees",
                "--set",
                "parallel.tensor=4",
                "--set",
                "parallel.data=0",
            ],
            "parallel.tensor=4: must divide devices_per_host=2",
        ),
        (["--mesh", TWO, "--profile", "missing.json"], "--profile 'missing.json'"),
    ],
)
def test_errors_are_one_line_exit_2(capsys, args, needle):
    code, out, err = run(capsys, "--config", CONFIG, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err


def test_png_draws_timeline_and_topology(capsys, tmp_path):
    png = tmp_path / "plan.png"
    code, out, _ = run(capsys, "--config", CONFIG, "--mesh", TWO, "--png", str(png))
    assert code == 0 and f"wrote {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib_is_a_clear_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    code, _, err = run(capsys, "--config", CONFIG, "--mesh", TWO, "--png", str(tmp_path / "x.png"))
    assert code == 2 and "needs matplotlib" in err


def test_show_mesh_prints_each_stages_island_and_devices(capsys):
    """--show-mesh draws the grid from the topology alone (planner.grid, no jax): stage 0
    on the first island's devices 0-3, stage 1 on the second's, tensor pairs per host."""
    args = ("--config", CONFIG, "--mesh", TWO, "--show-mesh")
    code, out, _ = run(capsys, *args, *as_flags(["parallel.stages=2", "parallel.tensor=2"]))
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0].startswith("mesh replica=1 x stage=2 x data=2 x tensor=2")
    assert lines[1] == "stage 0  island ib (infiniband)"
    assert lines[2] == "  data 0: tensor [dev 0@ib-0, dev 1@ib-0]"
    assert lines[4] == "stage 1  island roce (roce)"
    assert lines[6] == "  data 1: tensor [dev 6@roce-1, dev 7@roce-1]"


def test_profile_overrides_speed_and_links(capsys, tmp_path):
    degrees = as_flags(
        [
            "parallel.stages=4",
            "parallel.data=0",
            "parallel.tensor=1",
            "parallel.microbatches=8",
            "model.num_layers=12",
        ]
    )
    base_code, base_out, _ = run(
        capsys, "--config", CONFIG, "--mesh", TWO, "--json", "--keep-degrees", *degrees
    )
    profile = {
        "version": 1,
        "topology": "cpu8-two-islands",
        "measured_with": {
            "hidden_size": 128,
            "seq_len": 128,
            "num_heads": 4,
            "mlp_ratio": 4,
            "microbatch_size": 1,
            "tensor": 1,
        },
        "compute": {"roce": {"layer_fwd_s": 0.05, "layer_bwd_s": 0.1}},  # a slow island
        "links": {"stage": {"bandwidth_gbps": 0.1, "latency_us": 500}},
    }
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    code, out, err = run(
        capsys,
        "--config",
        CONFIG,
        "--mesh",
        TWO,
        "--json",
        "--keep-degrees",
        "--profile",
        str(path),
        *degrees,
    )
    assert base_code == code == 0, err
    base, prof = json.loads(base_out), json.loads(out)
    assert prof["predicted_step_s"] > base["predicted_step_s"]
    assert base["layers_per_stage"] == [3, 3, 3, 3]
    # the measured-slow roce island (stages 2, 3) gets fewer layers
    assert sum(prof["layers_per_stage"][:2]) > sum(prof["layers_per_stage"][2:])
    profile["compute"]["mars"] = profile["compute"].pop("roce")
    path.write_text(json.dumps(profile))
    code, _, err = run(capsys, "--config", CONFIG, "--mesh", TWO, "--profile", str(path))
    assert code == 2 and "compute.mars" in err


def test_profile_reproduces_the_measured_layer():
    from holmes_jax.core.plan_request import RunSpec
    from holmes_jax.core.spec import Layout, ModelSpec
    from holmes_jax.planner.placement import stage_hardware
    from holmes_jax.planner.profiles import profile_from_dict
    from holmes_jax.planner.stage_costs import stage_costs
    from holmes_jax.planner.topology import load_topology

    measured = {
        "hidden_size": 128,
        "seq_len": 128,
        "num_heads": 4,
        "mlp_ratio": 4,
        "microbatch_size": 2,
        "tensor": 1,
    }
    raw = {
        "version": 1,
        "measured_with": measured,
        "compute": {"ib": {"layer_fwd_s": 0.02, "layer_bwd_s": 0.045}},
    }
    topo, cal = profile_from_dict(raw, load_topology(TWO))
    model = ModelSpec(4, 128, 4, 128, 256)
    layout = Layout(4, 2, 1, microbatches=4)  # 16 sequences / (2 data x 4 micro-batches) = 2 each
    # the bare layer, as the probe timed it (engine "megatron": no per-layer weight slice or
    # gradient accumulation on top; tests/test_probe.py checks those)
    run = RunSpec(16, act_bytes=2, engine="megatron")
    costs = stage_costs(model, run, layout, stage_hardware(topo, layout, cal))
    layer_f = costs.fwd[1, 2] - costs.fwd[1, 1]  # stage 1 lives in the ib island
    layer_b = costs.bwd[1, 2] - costs.bwd[1, 1]
    assert layer_f == pytest.approx(0.02) and layer_b == pytest.approx(0.045)


def test_module_entry_point_and_no_jax_import():
    code = (
        "import sys, runpy\n"
        f"sys.argv = ['plan', '--config', {CONFIG!r}, '--mesh', {TWO!r}, '--json']\n"
        "try:\n"
        "    runpy.run_module('holmes_jax.plan', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "assert 'jax' not in sys.modules, 'planning must not import jax'\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["topology"] == "cpu8-two-islands"


def test_json_names_the_strategy_and_compares_all_three(capsys):
    slow = os.path.join(ROOT, "meshes", "emu-4host-2island-slow.yaml")
    code, out, err = run(
        capsys, "--config", CONFIG, "--mesh", slow, "--set", "diloco.enabled=auto", "--json"
    )
    assert code == 0, err
    d = json.loads(out)
    assert d["strategy"] == "diloco"
    rows = {row["strategy"]: row for row in d["strategies"]}
    assert set(rows) == {"pipeline", "hierarchical", "diloco", "pipeline+int8"}
    assert rows["diloco"]["predicted_step_s"] < min(
        rows[k]["predicted_step_s"] for k in ("pipeline", "hierarchical")
    )
    assert rows["diloco"]["inner_steps"] == 50
    assert rows["diloco"]["plan"]["replica"] == 2  # one copy per island
    outer = d["diloco_outer_formats"]  # the table of formats, the configured one chosen
    assert [f["fmt"] for f in outer["formats"]] == ["fp32", "bf16", "int8"]  # spmd: dense
    assert outer["chosen"] == "fp32" and outer["inner_step_s"] > 0
    code, out, err = run(
        capsys, "--config", CONFIG, "--mesh", slow, "--set", "diloco.enabled=auto",
        "--set", "diloco.outer_dtype=auto",
    )  # fmt: skip
    assert "strategy: diloco" in out and "auto_min_speedup" in out
    assert "diloco outer formats" in out and "diloco.outer_dtype=auto: " in out


def test_keep_degrees_prices_what_the_trainer_prints(capsys):
    import jax

    from holmes_jax.core.config import load_config
    from holmes_jax.core.plan_request import apply_parallel, plan_request
    from holmes_jax.planner.plans import resolve_auto
    from holmes_jax.planner.topology import load_topology
    from holmes_jax.runtime.setup import describe_plan

    cfg = load_config(CONFIG, [f"parallel.mesh={TWO}"])
    req = plan_request(cfg)
    topology = load_topology(TWO)
    shape = req.degrees(topology.num_devices)
    resolved = apply_parallel(cfg, resolve_auto(req, shape, topology))
    lines, trainer_s = describe_plan(
        resolved, shape, topology, jax.devices(), cfg.parallel.layers_per_stage
    )
    assert f"predicted step {trainer_s:.3g} s" in "\n".join(lines)
    code, out, err = run(capsys, "--config", CONFIG, "--mesh", TWO, "--keep-degrees", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["keeps_config_degrees"] and d["collectives_block"]
    assert d["predicted_step_s"] == pytest.approx(trainer_s, rel=1e-12)
    assert d["overrides"] == []  # the config as shipped runs this plan
    code, out, err = run(capsys, "--config", CONFIG, "--mesh", TWO, "--keep-degrees")
    assert "plan (the config's degrees, optimal split)" in out
    assert f"predicted step {trainer_s:.4g} s" in out


def test_printed_overrides_run_the_plan_shown(capsys):
    from holmes_jax.core.config import load_config
    from holmes_jax.core.plan_request import plan_request
    from holmes_jax.planner.plans import predict_run
    from holmes_jax.planner.topology import load_topology

    code, out, err = run(capsys, "--config", CONFIG, "--mesh", TWO, "--json")
    assert code == 0, err
    d = json.loads(out)
    assert not d["keeps_config_degrees"] and d["overrides"]
    cfg = load_config(CONFIG, [f"parallel.mesh={TWO}", *d["overrides"]])
    req = plan_request(cfg)
    topology = load_topology(TWO)
    shape = req.degrees(topology.num_devices)
    assert (shape.replica, shape.stages, shape.data, shape.tensor) == (
        d["replica"],
        d["stages"],
        d["data"],
        d["tensor"],
    )
    assert (cfg.parallel.microbatches, cfg.parallel.schedule) == (d["microbatches"], d["schedule"])
    assert d["predicted_step_s"] == pytest.approx(
        predict_run(req, topology, sync_collectives=True).step_s, rel=1e-12
    )
    code, out, _ = run(capsys, "--config", CONFIG, "--mesh", TWO)
    assert "plan (the planner's choice, optimal split)" in out
    assert "run it: python -m holmes_jax.train --config " in out
    for o in d["overrides"]:
        assert f"--set {o}" in out or f"--set '{o}'" in out


def test_trainer_line_names_the_faster_plan_and_its_overrides():
    from holmes_jax.core.config import load_config
    from holmes_jax.core.plan_request import plan_request
    from holmes_jax.planner.plans import make_plan, predict_run, resolve_auto, with_plan
    from holmes_jax.planner.report import format_preference
    from holmes_jax.planner.topology import load_topology

    topology = load_topology(TWO)
    req = plan_request(load_config(CONFIG, [f"parallel.mesh={TWO}"]))
    resolved = req.with_parallel(resolve_auto(req, req.degrees(topology.num_devices), topology))
    step = predict_run(resolved, topology, sync_collectives=True).step_s
    best = make_plan(req, topology)
    planned = req.with_parallel(with_plan(req.parallel, best))
    best_step = predict_run(planned, topology, sync_collectives=True).step_s
    assert best_step < step  # the planner's hierarchical plan beats the shipped pipeline
    (line,) = format_preference(resolved, topology, step, sync_collectives=True)
    assert f"replica {best.layout.replica} x stage {best.layout.stages}" in line
    assert f"(predicted {best_step:.3g} s)" in line and "--set parallel.stages=1" in line
    # the planner's own plan, or a run predicted as fast: nothing to say
    assert format_preference(planned, topology, best_step, sync_collectives=True) == []
    assert format_preference(resolved, topology, best_step, sync_collectives=True) == []


# The quickstart shows the Holmes placement (a pipeline with one stage per island) on a
# model small enough that the planner prefers a replica per island; its header says so.
KEEPS_ITS_OWN_DEGREES = {"quickstart.yaml"}


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(ROOT, "configs"))))
def test_shipped_configs_run_the_planners_choice_and_fit(name, monkeypatch):
    from holmes_jax.core.config import load_config
    from holmes_jax.core.plan_request import plan_request
    from holmes_jax.planner.plans import make_plan, predict_run, run_overrides
    from holmes_jax.planner.topology import load_topology

    monkeypatch.chdir(ROOT)  # parallel.mesh is read from the working directory
    req = plan_request(load_config(os.path.join("configs", name)))
    assert req.parallel.mesh, f"{name}: parallel.mesh names the topology it is planned for"
    topology = load_topology(req.parallel.mesh)
    assert predict_run(req, topology).fits
    differ = run_overrides(req, topology, make_plan(req, topology))
    if name in KEEPS_ITS_OWN_DEGREES:
        with open(os.path.join(ROOT, "configs", name)) as f:
            header = f.read().split("\nmodel:", 1)[0]
        assert differ and "planner prefers" in header
    else:
        assert differ == [], f"{name}: the planner would add {differ}"


def test_failures_json_holds_the_plans_replan_gives(capsys, monkeypatch):
    """``--failures --json`` on the quickstart: each case's plan is ``replan``'s for that
    topology, and its ``--set`` overrides, run by hand, give the same plan again."""
    from holmes_jax.core.config import load_config
    from holmes_jax.core.plan_request import plan_request
    from holmes_jax.planner.failures import full_step, replan
    from holmes_jax.planner.topology import load_topology

    monkeypatch.chdir(ROOT)  # parallel.mesh is read from the working directory
    code, out, err = run(capsys, "--config", CONFIG, "--failures", "--json")
    assert code == 0, err
    d = json.loads(out)
    req = plan_request(load_config(CONFIG))
    topology = load_topology(req.parallel.mesh)
    assert d["topology"] == "cpu8-two-islands" and d["collectives_block"]
    assert d["full_step_s"] == pytest.approx(full_step(req, topology), rel=1e-12)
    assert [(f["lost"], f["excluded"]) for f in d["failures"]] == [
        ("host", ["ib-0"]),
        ("island", ["ib-0", "ib-1"]),
        ("host", ["roce-0"]),
        ("island", ["roce-0", "roce-1"]),
    ]
    degrees = ("replica", "stages", "data", "tensor", "microbatches", "schedule")
    for f in d["failures"]:
        for base in (req, plan_request(load_config(CONFIG, f["overrides"]))):  # as written; by hand
            r = replan(base, topology, f["excluded"])
            plan = r.plan.to_dict()
            assert [f["plan"][k] for k in degrees] == [plan[k] for k in degrees]
            assert f["plan"]["virtual_stages"] == plan["virtual_stages"]
            assert f["plan"]["layers_per_stage"] == plan["layers_per_stage"]
            assert f["plan"]["remat"] == plan["remat"]
            assert f["predicted_step_s"] == pytest.approx(r.step_s, rel=1e-12)
            assert f["plan"]["predicted_step_s"] == pytest.approx(r.step_s, rel=1e-12)
        assert (f["hosts"], f["devices"]) == (r.topology.num_hosts, r.topology.num_devices)
        assert f["relative_step"] == pytest.approx(r.step_s / d["full_step_s"], rel=1e-12)
    # the text shows the same rows, and each runnable plan's command
    code, out, err = run(capsys, "--config", CONFIG, "--failures")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("topology cpu8-two-islands: 4 hosts, 8 devices")
    assert f"predicted step {d['full_step_s']:.3g} s" in lines[0]
    for f, label in zip(
        d["failures"],
        [
            "one host of ib (ib-0)",
            "island ib (ib-0, ib-1)",
            "one host of roce (roce-0)",
            "island roce (roce-0, roce-1)",
        ],
        strict=True,
    ):
        (row,) = [line for line in lines if line.startswith(f"  {label} ")]
        assert f"{f['predicted_step_s']:.3g}" in row and f"{f['relative_step']:.2f}x" in row
        (by_hand,) = [line for line in lines if line.startswith(f"  {label}: python -m ")]
        assert f"--set 'parallel.exclude_hosts=[{','.join(f['excluded'])}]'" in by_hand


def test_failures_on_one_host_say_nothing_survives(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    one = os.path.join(ROOT, "configs", "gpt-1.3b-1node.yaml")
    code, out, err = run(capsys, "--config", one, "--failures")
    assert code == 0, err
    assert out.splitlines()[1] == "no failure leaves survivors: the topology has one host"
    code, out, err = run(capsys, "--config", one, "--failures", "--json")
    assert code == 0 and json.loads(out)["failures"] == []


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--keep-degrees"], "--keep-degrees"),
        (["--png", "plan.png"], "--png"),
        (["--show-mesh"], "--show-mesh"),
        (["--partition", "holmes"], "--partition"),
        (["--profile", "profile.json"], "--profile"),
    ],
)
def test_failures_with_a_flag_it_cannot_use_is_one_line(capsys, extra, flag):
    code, out, err = run(capsys, "--config", CONFIG, "--mesh", TWO, "--failures", *extra)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"error: --failures with {flag}: ")
