"""Benchmark: pipeline vs hierarchical data parallel vs DiLoCo across islands.

    sudo .venv/bin/python scripts/bench_strategies.py [--part speed|quality|both] \\
        [--speed-steps 11] [--inner-steps 50] [--quality-steps 300] [--png strategies.png] \\
        [--links 100mbit,10mbit,10mbit-20ms] [--quality-variants sync,H10,...] \\
        [--cpu-quota auto|on|off] [--keep-logs DIR [--reuse]]

**Speed** (root): the 4-host two-island emulation (``launch --emulate``), 1 Gbit/s inside
each island and 100 Mbit/s or 10 Mbit/s between them (``10mbit-20ms``: with 20 ms of round
trip as well), the quickstart model. Per link:

- (a) pipeline: the planner's best ``replica = 1`` plan;
- (b) hierarchical: the planner's best ``replica = 2`` plan;
- (c) diloco: (b)'s degrees with ``diloco.enabled=true``, ``H = --inner-steps``, with fp32
  and with int8 outer gradients;
- (d) pipeline-bf16, pipeline-int8, pipeline-fp8: (a)'s plan with
  ``parallel.cross_island_dtype`` bf16 / int8 / fp8 (activations and their gradients
  compressed across the islands only).

``--cpu-quota`` is ``launch --cpu-quota`` for every speed launch, the probes' too (``on``:
each host a fixed share of the cores, so a host that waits does not lend its time to the
others; the default ``auto`` applies none, the islands computing alike).

Time per step is the mean over the logged windows after the first. A DiLoCo run is
``2H + 1`` steps, so its windows hold its outer syncs in their true proportion. Each
prediction comes from a profile the probe measures through the same launch, once per plan
micro-batch: :func:`holmes_jax.planner.plans.predict_run` for (a) and (b),
:func:`holmes_jax.planner.strategy.predict_diloco` for (c).

**Quality** (no root, 8 simulated devices): ``--quality-steps`` steps of the quickstart
model, ``replica = 2`` x data 4, the same tokens for every variant. Synchronous against
DiLoCo with H = 10, 25, 50, H = 50 with 4 fragments and H = 50 with int8. Eval loss every
50 steps goes to ``--png``, the final losses to a table. On request (``--quality-variants
sync,pipe,pipe-bf16,pipe-int8,pipe-fp8``) the two-stage pipeline across the islands of
cpu8-two-islands, exact and with each ``parallel.cross_island_dtype``, against the exact
one (``gap_vs_pipeline``).

Targets: at 10 Mbit/s DiLoCo >= 3x the tokens/s of the best synchronous plan; final eval
loss within 3% of synchronous for some H >= 10; predictions within 25%.
Prints one JSON line; progress and the runs' output go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import benchlib

# 4 simulated devices in this process, as the emulated topology has (pricing only).
os.environ["XLA_FLAGS"] = benchlib.os.environ["XLA_FLAGS"].replace(
    "device_count=8", "device_count=4"
)

from holmes_jax.core.config import load_config  # noqa: E402
from holmes_jax.core.errors import ConfigError  # noqa: E402
from holmes_jax.core.plan_request import plan_request  # noqa: E402
from holmes_jax.planner.plans import plan_overrides, predict_run  # noqa: E402
from holmes_jax.planner.strategy import predict_diloco, price_strategies  # noqa: E402
from holmes_jax.planner.topology import load_topology  # noqa: E402

QUICKSTART = f"{benchlib.ROOT}/configs/quickstart.yaml"
MESHES = {
    "100mbit": f"{benchlib.ROOT}/meshes/emu-4host-2island.yaml",
    "10mbit": f"{benchlib.ROOT}/meshes/emu-4host-2island-slow.yaml",
    "10mbit-20ms": f"{benchlib.ROOT}/meshes/emu-4host-2island-slow-20ms.yaml",
}
# The quickstart model and batch, without its files, checkpoints or evaluation.
COMMON = ["train.run_dir=null", "logging.progress=plain"]
SPEED = COMMON + ["train.eval_every=0", "train.eval_batches=1", "data.max_bytes=2000000"]
QUALITY = COMMON + [
    "parallel.mesh=null",
    "parallel.replica=2",
    "parallel.stages=1",
    "parallel.data=4",
    "parallel.microbatches=1",
    "parallel.layers_per_stage=null",
    "train.eval_every=50",
    "logging.log_every=50",
]
# Plans the probe times a stage of (each its own micro-batch and layers per device); DiLoCo
# runs the hierarchical plan's inner step.
PROBED = ("pipeline", "hierarchical")
QUALITY_VARIANTS = {
    "sync": [],
    "H10": ["diloco.inner_steps=10"],
    "H25": ["diloco.inner_steps=25"],
    "H50": ["diloco.inner_steps=50"],
    "H50-F4": ["diloco.inner_steps=50", "diloco.fragments=4"],
    "H50-int8": ["diloco.inner_steps=50", "diloco.outer_dtype=int8"],
}
# The pipeline across the two islands of cpu8-two-islands (its topology says which stage
# boundary crosses), exact and with each cross-island format; compared with "pipe".
PIPE = [
    f"parallel.mesh={benchlib.ROOT}/meshes/cpu8-two-islands.yaml",
    "parallel.replica=1",
    "parallel.stages=2",
    "parallel.microbatches=4",
    "parallel.schedule=1f1b",
]
PIPELINE_VARIANTS = {
    "pipe": PIPE,
    **{f"pipe-{f}": [*PIPE, f"parallel.cross_island_dtype={f}"] for f in ("bf16", "int8", "fp8")},
}
# What else to try when the quality target is missed (--quality-variants): plain
# averaging of the replicas (outer lr 1, no momentum), less momentum, a larger outer step,
# a warm-up of averaging after every one of the first 50 steps (diloco.warmup_steps).
AVERAGING = ["diloco.outer_lr=1.0", "diloco.outer_momentum=0.0"]
WARMUP_50 = ["diloco.warmup_steps=50"]
QUALITY_TUNING = {
    "H10-avg-w50": ["diloco.inner_steps=10", *AVERAGING, *WARMUP_50],
    "H10-w50": ["diloco.inner_steps=10", *WARMUP_50],
    "H25-avg-w50": ["diloco.inner_steps=25", *AVERAGING, *WARMUP_50],
    "H50-avg-w50": ["diloco.inner_steps=50", *AVERAGING, *WARMUP_50],
    "H10-avg": ["diloco.inner_steps=10", *AVERAGING],
    "H25-avg": ["diloco.inner_steps=25", *AVERAGING],
    "H10-mu0.5": ["diloco.inner_steps=10", "diloco.outer_momentum=0.5"],
    "H10-lr1": ["diloco.inner_steps=10", "diloco.outer_lr=1.0"],
}


COMPRESSED = ("bf16", "int8", "fp8")  # (d): cross-island formats of the pipeline


def log(msg: str) -> None:
    print(f"bench_strategies: {msg}", file=sys.stderr, flush=True)


def speed_variants(mesh: str, inner_steps: int) -> dict[str, list[str]]:
    """(a), (b), (c) for one topology: the planner's best plans for each strategy."""
    cfg = load_config(QUICKSTART, SPEED + [f"parallel.mesh={mesh}", "diloco.enabled=false"])
    choice = price_strategies(plan_request(cfg), load_topology(mesh))
    out = {}
    for name in ("pipeline", "hierarchical"):
        price = choice.price(name)
        if price.plan is None:
            raise RuntimeError(f"{name} has no plan on {mesh}: {price.why}")
        out[name] = plan_overrides(price.plan)
    diloco = out["hierarchical"] + ["diloco.enabled=true", f"diloco.inner_steps={inner_steps}"]
    out["diloco"] = diloco
    out["diloco-int8"] = diloco + ["diloco.outer_dtype=int8"]
    for fmt in COMPRESSED:
        out[f"pipeline-{fmt}"] = out["pipeline"] + [f"parallel.cross_island_dtype={fmt}"]
    return out


def measure_speed(args, folder: str) -> dict:
    from holmes_jax.cluster.netns import check_privileges

    check_privileges()
    rows = {}
    for link in args.links.split(","):
        mesh = MESHES[link]
        variants = speed_variants(mesh, args.inner_steps)
        profiles = {}  # the links, and a stage timed at each plan's micro-batch
        for plan in PROBED:
            log(f"{link}: probe the links and a stage of the {plan} plan (emulated launch)")
            probe_set = SPEED + variants[plan] + [f"parallel.mesh={mesh}"]
            profiles[plan] = benchlib.emulated_probe(
                mesh,
                probe_set,
                folder,
                f"profile-{link}-{plan}",
                "bench_strategies",
                QUICKSTART,
                args.cpu_quota,
            )
        table = {}
        for name, extra in variants.items():
            probed = "pipeline" if name.startswith("pipeline") else "hierarchical"
            topology, calibration, _ = profiles[probed]
            steps = 2 * args.inner_steps + 1 if name.startswith("diloco") else args.speed_steps
            window = 10 if name.startswith("diloco") else 5
            overrides = SPEED + extra + [f"parallel.mesh={mesh}", f"logging.log_every={window}"]
            req = plan_request(load_config(QUICKSTART, overrides + [f"train.steps={steps}"]))
            if name.startswith("diloco"):
                predicted = predict_diloco(req, topology, calibration, sync_collectives=True)[0]
            else:
                predicted = predict_run(req, topology, calibration, sync_collectives=True).step_s
            log(f"{link}: {name}: {steps} steps")
            records = benchlib.emulated_run(
                mesh,
                overrides,
                steps,
                folder,
                f"{link}-{name}",
                "bench_strategies",
                QUICKSTART,
                args.cpu_quota,
            )
            step_s = benchlib.steady_step_s(records)
            model, run = req.model, req.run
            tokens = run.global_batch_size * model.seq_len
            table[name] = {
                "step_ms": round(step_s * 1e3, 1),
                "tokens_per_s": round(tokens / step_s, 1),
                "predicted_ms": round(predicted * 1e3, 1),
                "prediction_error": round(float((predicted - step_s) / step_s), 3),
                "plan": [o for o in extra if o.startswith(("parallel.", "diloco."))],
            }
        sync = min(table["pipeline"]["step_ms"], table["hierarchical"]["step_ms"])
        best = min(table["diloco"]["step_ms"], table["diloco-int8"]["step_ms"])
        rows[link] = {
            "variants": table,
            "cpu_quota": args.cpu_quota,
            "diloco_over_best_sync_tokens": round(sync / best, 2),
            "pipeline_int8_over_pipeline_tokens": round(
                table["pipeline"]["step_ms"] / table["pipeline-int8"]["step_ms"], 2
            ),
            "probe_layer_fwd_bwd_ms": {plan: profiles[plan][2] for plan in PROBED},
        }
    return rows


def measure_quality(args, folder: str) -> dict:
    curves = {}
    known = {**QUALITY_VARIANTS, **QUALITY_TUNING, **PIPELINE_VARIANTS}
    for name in args.quality_variants.split(","):
        extra = known[name]
        metrics = os.path.join(folder, f"quality-{name}.jsonl")
        is_diloco = any(x.startswith("diloco.") for x in extra)
        diloco = ["diloco.enabled=true"] if is_diloco else ["diloco.enabled=false"]
        sets = QUALITY + diloco + extra
        sets += [f"train.steps={args.quality_steps}", f"train.metrics_path={metrics}"]
        cmd = [sys.executable, "-m", "holmes_jax.train", "--config", QUICKSTART]
        cmd += [a for s in sets for a in ("--set", s)]
        records = _finished(metrics, args.quality_steps) if args.reuse else None
        if records is not None:
            log(f"quality: {name}: reusing {metrics} (finished, {args.quality_steps} steps)")
        else:
            log(f"quality: {name}: {args.quality_steps} steps")
            env = dict(os.environ)  # the trainer's own 8 devices, not this process's 4
            env["XLA_FLAGS"] = env["XLA_FLAGS"].replace("device_count=4", "device_count=8")
            if os.path.exists(metrics):
                os.remove(metrics)  # the trainer appends
            code = subprocess.call(cmd, cwd=benchlib.ROOT, stdout=sys.stderr, env=env)
            if code:
                raise RuntimeError(f"quality run {name} exited with code {code}")
            with open(metrics) as f:
                records = [json.loads(line) for line in f]
        curves[name] = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    sync = curves["sync"][-1][1]
    final = {k: round(v[-1][1], 4) for k, v in curves.items()}
    gap = {k: round(v / sync - 1, 4) for k, v in final.items()}
    if args.png:
        draw(curves, args.png)
    out = {}
    if "pipe" in final:  # the compressed crossings against the exact pipeline
        pipe = curves["pipe"][-1][1]
        out["gap_vs_pipeline"] = {
            k: round(v / pipe - 1, 4) for k, v in final.items() if k.startswith("pipe-")
        }
    return {
        **out,
        "steps": args.quality_steps,
        "tokens": args.quality_steps * 32 * 128,
        "final_eval_loss": final,
        "gap_vs_sync": gap,
        "curves": curves,
        "png": args.png,
    }


def _finished(metrics: str, steps: int) -> list[dict] | None:
    """The records of an earlier run in ``metrics`` if it evaluated at step ``steps``."""
    if not os.path.exists(metrics):
        return None
    with open(metrics) as f:
        records = [json.loads(line) for line in f]
    done = any(r.get("step") == steps and "eval_loss" in r for r in records)
    return records if done else None


def draw(curves: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in curves.items():
        steps, losses = zip(*points, strict=True)
        style = "k-" if name == "sync" else "-"
        ax.plot(steps, losses, style, marker="o", markersize=3, label=name)
    ax.set_xlabel("step (32 x 128 tokens each)")
    ax.set_ylabel("eval loss (global model)")
    ax.set_title("Synchronous vs DiLoCo across 2 replicas, quickstart model")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"curves drawn to {path}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("speed", "quality", "both"), default="both")
    parser.add_argument("--speed-steps", type=int, default=11, help="steps of (a), (b) (>= 6)")
    parser.add_argument("--inner-steps", type=int, default=50, help="DiLoCo's H in the speed part")
    parser.add_argument("--quality-steps", type=int, default=300, help="steps of each quality run")
    parser.add_argument("--png", default="docs/strategies.png", help="eval-loss curves")
    parser.add_argument(
        "--links",
        default="100mbit,10mbit",
        help="comma-separated: 100mbit, 10mbit, 10mbit-20ms (10 Mbit/s, 20 ms round trip)",
    )
    parser.add_argument(
        "--quality-variants",
        default=",".join(QUALITY_VARIANTS),
        help=f"comma-separated, 'sync' first; also: {', '.join(QUALITY_TUNING)}, "
        f"{', '.join(PIPELINE_VARIANTS)}",
    )
    parser.add_argument("--keep-logs", help="keep the metrics and profiles in this folder")
    benchlib.add_cpu_quota_arg(parser)
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="quality: reuse a variant's finished metrics in --keep-logs instead of rerunning",
    )
    args = parser.parse_args(argv)
    names = args.quality_variants.split(",")
    unknown = [
        n for n in names if n not in {**QUALITY_VARIANTS, **QUALITY_TUNING, **PIPELINE_VARIANTS}
    ]
    if names[0] != "sync" or unknown:
        print(
            f"error: --quality-variants={args.quality_variants}: must start with 'sync' and "
            f"name only {', '.join([*QUALITY_VARIANTS, *QUALITY_TUNING, *PIPELINE_VARIANTS])}",
            file=sys.stderr,
        )
        return 2
    bad_links = [link for link in args.links.split(",") if link not in MESHES]
    if bad_links:
        print(
            f"error: --links={args.links}: {', '.join(bad_links)} unknown; "
            f"known: {', '.join(MESHES)}",
            file=sys.stderr,
        )
        return 2
    if args.speed_steps < 6:
        print(f"error: --speed-steps={args.speed_steps}: must be >= 6", file=sys.stderr)
        return 2
    if args.quality_steps < 50 or args.quality_steps % 50:
        print(
            f"error: --quality-steps={args.quality_steps}: must be a positive multiple of 50 "
            "(eval every 50 steps)",
            file=sys.stderr,
        )
        return 2
    folder = args.keep_logs or tempfile.mkdtemp(prefix="bench_strategies_")
    os.makedirs(folder, exist_ok=True)
    result: dict = {"bench": "strategies"}
    try:
        if args.part in ("speed", "both"):
            result["speed"] = measure_speed(args, folder)
        if args.part in ("quality", "both"):
            result["quality"] = measure_quality(args, folder)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    targets = {}
    if "speed" in result:
        ratio = result["speed"].get("10mbit", {}).get("diloco_over_best_sync_tokens", 0.0)
        errors = [
            abs(v["prediction_error"])
            for row in result["speed"].values()
            for v in row["variants"].values()
        ]
        targets["diloco >= 3x best sync tokens/s at 10 Mbit/s"] = bool(ratio >= 3)
        targets["predictions within 25%"] = bool(max(errors) <= 0.25)
        fast = result["speed"].get("10mbit", {}).get("pipeline_int8_over_pipeline_tokens", 0.0)
        targets["pipeline int8 >= 1.8x exact pipeline tokens/s at 10 Mbit/s"] = bool(fast >= 1.8)
    if "quality" in result:
        gap = result["quality"]["gap_vs_sync"]
        targets["some H >= 10 within 3% of sync"] = any(
            v <= 0.03 for k, v in gap.items() if k.startswith("H")
        )
        if "pipe-int8" in result["quality"].get("gap_vs_pipeline", {}):
            pipe_gap = result["quality"]["gap_vs_pipeline"]["pipe-int8"]
            targets["int8 crossings within 1% of the exact pipeline"] = bool(pipe_gap <= 0.01)
    result["targets"] = targets
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
