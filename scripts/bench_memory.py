"""Per-device memory of the shipped GPU configs, measured from the compiled program.

For each shipped GPU config on the topology its header names, the train step is compiled
at the real per-device shapes on simulated CPU devices (nothing is allocated) and XLA's
memory analysis gives the per-device peak; the memory model (holmes_jax.planner.memory) predicts
it beside. Topologies with more than MAX_DEVICES devices are compiled with the
data-parallel degree shrunk (same microbatch size, so the same activations per device);
the prediction is then given at both degrees. Then the same for the plan that
``python -m holmes_jax.plan`` proposes for each config on its topology (its own search over
degrees, schedule and remat), beside the memory the planner printed for it: the planner's
choice is proved to fit, not only the config's own degrees. Then a validation grid (model sizes,
tensor 1/2/8, stages 1/2/4, schedules, remat policies, microbatch sizes, fp32/bf16)
with its worst error.

    python scripts/bench_memory.py            # ~10 min on 2 cores
    python scripts/bench_memory.py --no-planned  # not the planner's plans
    python scripts/bench_memory.py --no-grid  # shipped configs only
    python scripts/bench_memory.py --no-grid --only llama  # shipped configs named *llama*

Prints a table and one JSON line. Targets: every shipped config <= 90% of 80 GB, every
prediction within 15%.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

MAX_DEVICES = 64
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={MAX_DEVICES}"

import jax  # noqa: E402

from holmes_jax.core.config import load_config  # noqa: E402
from holmes_jax.core.plan_request import apply_parallel, plan_request  # noqa: E402
from holmes_jax.core.spec import Degrees  # noqa: E402
from holmes_jax.planner.grid import load_mesh_topology, resolve_shape  # noqa: E402
from holmes_jax.planner.memory import device_memory, stage_peaks  # noqa: E402
from holmes_jax.planner.plans import (  # noqa: E402
    make_plan,
    memory_inputs_of,
    plan_overrides,
    resolve_auto,
)
from holmes_jax.runtime.engine.mesh import build_mesh  # noqa: E402
from holmes_jax.runtime.engine.stages import layout_from_config  # noqa: E402
from holmes_jax.runtime.model.decoder import attention_kernel  # noqa: E402
from holmes_jax.runtime.program import Program  # noqa: E402
from holmes_jax.runtime.state import compute_dtype  # noqa: E402

SHIPPED = [
    ("configs/gpt-124m.yaml", "meshes/paper-ib-8x8.yaml"),
    ("configs/gpt-350m.yaml", "meshes/paper-ib-8x8.yaml"),
    ("configs/gpt-1.3b.yaml", "meshes/paper-ib-8x8.yaml"),
    ("configs/gpt-1.3b-1node.yaml", "meshes/gpu8-one-host.yaml"),
    ("configs/gpt-7b.yaml", "meshes/paper-ib-roce-8x8.yaml"),
    ("configs/llama-1b.yaml", "meshes/paper-ib-8x8.yaml"),
    ("configs/llama-8b.yaml", "meshes/paper-ib-roce-8x8.yaml"),
]
LIMIT_GB = 80.0
TARGET_FRACTION = 0.9

# Validation grid: (config, overrides). Degrees, schedules, policies, microbatch sizes.
_350M = "configs/gpt-350m.yaml"
GRID = [
    (_350M, "parallel.tensor=1 parallel.stages=1 parallel.data=2 model.remat=none"),
    (
        _350M,
        "parallel.tensor=1 parallel.stages=1 parallel.data=2 parallel.microbatches=4 "
        "model.remat=full",
    ),
    (
        _350M,
        "parallel.tensor=2 parallel.stages=1 parallel.data=1 parallel.microbatches=2 "
        "model.remat=selective",
    ),
    (
        _350M,
        "parallel.tensor=2 parallel.stages=2 parallel.data=2 parallel.microbatches=4 "
        "model.remat=selective parallel.schedule=1f1b",
    ),
    (
        _350M,
        "parallel.tensor=2 parallel.stages=2 parallel.data=2 parallel.microbatches=4 "
        "model.remat=none parallel.schedule=gpipe",
    ),
    (
        _350M,
        "parallel.tensor=8 parallel.stages=2 parallel.data=1 parallel.microbatches=8 "
        "model.remat=full",
    ),
    (_350M, "parallel.tensor=8 parallel.stages=1 parallel.data=1 model.remat=none"),
    (
        _350M,
        "parallel.tensor=1 parallel.stages=4 parallel.data=2 parallel.microbatches=8 "
        "model.remat=full",
    ),
    (
        _350M,
        "parallel.tensor=1 parallel.stages=4 parallel.data=1 parallel.microbatches=4 "
        "model.remat=selective parallel.schedule=gpipe",
    ),
    (
        _350M,
        "parallel.tensor=2 parallel.stages=4 parallel.data=2 parallel.microbatches=8 "
        "model.remat=none",
    ),
    (
        _350M,
        "parallel.tensor=1 parallel.stages=2 parallel.data=4 parallel.microbatches=4 "
        "model.remat=full train.precision=fp32",
    ),
    (
        _350M,
        "parallel.tensor=2 parallel.stages=2 parallel.data=2 parallel.microbatches=4 "
        "model.remat=selective train.precision=fp32",
    ),
    (
        _350M,
        "parallel.tensor=1 parallel.stages=1 parallel.data=8 model.remat=none train.precision=fp32",
    ),
    (
        "configs/gpt-1.3b.yaml",
        "parallel.tensor=2 parallel.stages=2 parallel.data=2 "
        "parallel.microbatches=8 model.remat=selective train.global_batch_size=64",
    ),
    (
        "configs/gpt-1.3b.yaml",
        "parallel.tensor=8 parallel.stages=1 parallel.data=1 "
        "parallel.microbatches=2 model.remat=none train.global_batch_size=8",
    ),
    (
        "configs/gpt-7b.yaml",
        "parallel.replica=1 parallel.tensor=8 parallel.stages=2 parallel.data=1 "
        "parallel.microbatches=4 model.remat=full train.global_batch_size=16",
    ),
    (
        "configs/gpt-7b.yaml",
        "parallel.replica=1 parallel.tensor=8 parallel.stages=2 parallel.data=1 "
        "parallel.microbatches=4 model.remat=none train.global_batch_size=4",
    ),
    (
        "configs/llama-1b.yaml",
        "parallel.tensor=2 parallel.stages=2 parallel.data=2 parallel.microbatches=4 "
        "model.remat=none model.seq_len=1024",
    ),
    (
        "configs/llama-1b.yaml",
        "parallel.tensor=8 parallel.stages=1 parallel.data=1 parallel.microbatches=2 "
        "model.remat=selective model.seq_len=2048 model.tied_embeddings=false",
    ),
]
GRID_BATCH = "train.global_batch_size=32 train.precision=bf16"


def measure(cfg, shape: Degrees, split) -> tuple[float, float, dict]:
    """(measured peak bytes, predicted peak bytes, predicted breakdown in GB)."""
    program = Program(cfg, build_mesh(shape, jax.devices()[: shape.num_devices]))
    measured = program.compiled_memory()["peak"]
    dtype = compute_dtype(cfg.train.precision)
    x = memory_inputs_of(plan_request(cfg, attention_kernel(cfg.model, dtype)), shape.data)
    v = x.virtual_stages
    stages, slots = len(split) // v, v * max(split)
    peaks = [device_memory(x, slots, last_stage=s == stages - 1) for s in range(stages)]
    worst = max(peaks, key=lambda b: b.peak)
    return float(measured), float(worst.peak), worst.as_gb()


def shipped_row(config: str, mesh: str, planned: bool = False) -> dict:
    """Compile one shipped config on its topology (data degree shrunk if needed): its own
    degrees, or with ``planned`` the plan ``python -m holmes_jax.plan`` prints for it (the
    planner's search over degrees, schedule and remat), beside the planner's figure."""
    cfg = load_config(config, [f"parallel.mesh={mesh}"])
    topology = load_mesh_topology(plan_request(cfg))
    planner_gb, sets = None, []
    if planned:
        plan = make_plan(plan_request(cfg), topology)
        planner_gb, sets = max(plan.memory_per_stage_gb), plan_overrides(plan)
        cfg = load_config(config, [f"parallel.mesh={mesh}", *sets])
    req = plan_request(cfg)
    real = resolve_shape(req, topology.num_devices, topology)
    cfg = apply_parallel(cfg, resolve_auto(req, real, topology))
    data = real.data
    while real.replica * real.stages * data * real.tensor > MAX_DEVICES:
        data //= 2  # shrink only the data degree, keeping sequences per microbatch
    mb = cfg.train.global_batch_size // (real.replica * real.data * cfg.parallel.microbatches)
    shape = Degrees(real.stages, data, real.tensor, real.replica)
    small = cfg.replace(
        parallel=dataclasses.replace(
            cfg.parallel,
            mesh=None,
            devices=shape.num_devices,
            data=data,
            enforce_islands=False,
        ),
        train=dataclasses.replace(
            cfg.train,
            global_batch_size=mb * cfg.parallel.microbatches * data * real.replica,
        ),
    )
    split = small.parallel.layers_per_stage
    measured, predicted, parts = measure(small, shape, split)
    at_real = max(stage_peaks(memory_inputs_of(plan_request(cfg), real.data), split))
    return {
        "config": os.path.basename(config),
        "mesh": os.path.basename(mesh),
        "source": "plan" if planned else "config",
        "degrees": f"s{real.stages} d{real.data} t{real.tensor}"
        + (f" r{real.replica}" if real.replica > 1 else ""),
        "compiled_data": data,
        "split": list(split),
        "remat": cfg.model.remat,
        "microbatch": mb,
        "measured_gb": measured / 1e9,
        "predicted_gb": predicted / 1e9,
        "error": predicted / measured - 1,
        "predicted_real_gb": at_real / 1e9,
        "planner_gb": planner_gb,
        "plan": sets,
        "limit_gb": LIMIT_GB,
        "parts_gb": parts,
    }


def grid_row(config: str, overrides: str) -> dict:
    sets = GRID_BATCH.split() + overrides.split()
    cfg = load_config(config, sets + ["parallel.layers_per_stage=null"])
    p = cfg.parallel
    split = list(layout_from_config(None, p.stages, cfg.model.num_layers).layers_per_stage)
    cfg = load_config(
        config,
        sets
        + [
            f"parallel.layers_per_stage={split}",
            f"parallel.devices={p.stages * p.data * p.tensor}",
        ],
    )
    measured, predicted, _ = measure(cfg, Degrees(p.stages, p.data, p.tensor), split)
    return {
        "config": os.path.basename(config),
        "overrides": overrides,
        "measured_gb": measured / 1e9,
        "predicted_gb": predicted / 1e9,
        "error": predicted / measured - 1,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-grid", action="store_true", help="shipped configs only")
    parser.add_argument(
        "--no-planned", action="store_true", help="skip compiling the planner's plan of each"
    )
    parser.add_argument(
        "--only", default="", help="only configs whose file name contains this (e.g. llama)"
    )
    args = parser.parse_args()
    t0 = time.perf_counter()
    print("shipped GPU configs (per device; limit 80 GB, target <= 72 GB):", flush=True)
    print(
        f"  {'config':<15} {'mesh':<24} {'degrees':<12} {'remat':<9} {'mb':>3} "
        f"{'measured':>9} {'predicted':>9} {'error':>7}",
        flush=True,
    )
    shipped = []
    rows = [(c, m, False) for c, m in SHIPPED]
    if not args.no_planned:  # then what `python -m holmes_jax.plan` proposes for each
        rows += [(c, m, True) for c, m in SHIPPED]
    for config, mesh, planned in rows:
        if args.only not in os.path.basename(config):
            continue
        if planned and not any(r["source"] == "plan" for r in shipped):
            print("the planner's plan for each (python -m holmes_jax.plan):", flush=True)
        r = shipped_row(config, mesh, planned)
        shipped.append(r)
        note = (
            ""
            if r["compiled_data"] == int(r["degrees"].split("d")[1].split()[0])
            else (
                f"  (compiled at data {r['compiled_data']}; predicted at real data: "
                f"{r['predicted_real_gb']:.2f} GB)"
            )
        )
        print(
            f"  {r['config']:<15} {r['mesh']:<24} {r['degrees']:<12} {r['remat']:<9} "
            f"{r['microbatch']:>3} {r['measured_gb']:>8.2f}G {r['predicted_gb']:>8.2f}G "
            f"{r['error']:>+7.1%}{note}",
            flush=True,
        )
        if planned:
            print(
                f"    plan: {' '.join(r['plan'])}; the planner printed {r['planner_gb']:.2f} GB",
                flush=True,
            )
    grid = []
    if not args.no_grid:
        print("validation grid (bf16 unless noted, global batch 32 unless noted):", flush=True)
        for config, overrides in GRID:
            if args.only not in os.path.basename(config):
                continue
            r = grid_row(config, overrides)
            grid.append(r)
            print(
                f"  {r['config']:<15} {overrides:<95} {r['measured_gb']:>8.3f}G "
                f"{r['predicted_gb']:>8.3f}G {r['error']:>+7.1%}",
                flush=True,
            )
    errors = [abs(r["error"]) for r in shipped + grid]
    summary = {
        "bench": "memory",
        "shipped": shipped,
        "grid": grid,
        "worst_abs_error": max(errors),
        "max_shipped_fraction_of_80gb": max(r["measured_gb"] for r in shipped) / LIMIT_GB,
        "seconds": time.perf_counter() - t0,
    }
    print(
        f"worst |error| {summary['worst_abs_error']:.1%} (target 15%); largest shipped "
        f"config {summary['max_shipped_fraction_of_80gb']:.0%} of 80 GB (target 90%)"
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
