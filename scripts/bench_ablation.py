"""Benchmark: the Holmes ablation, each component of the plan turned off in turn.

    sudo .venv/bin/python scripts/bench_ablation.py [--meshes two,three] [--steps 21] \\
        [--rows full,partition-off,...] [--cpu-quota auto|on|off] [--keep-logs DIR] \\
        [--rounds N] [--compile-cache DIR] [--reuse-profile]
    python scripts/bench_ablation.py --plan-only

Rows, each one set of config overrides that the trainer runs and the planner prices
(:func:`holmes_jax.planner.plans.predict_run`), so measured and predicted are one plan:

- full: the planner's plan (its degrees and split, island-aware placement), gradients reduced
  per layer during the backward (``parallel.grad_buckets=layer``) and ZeRO-1;
- partition-off: full with an even split (``parallel.layers_per_stage=null``);
- nic-off: ``parallel.enforce_islands=false``: data groups span the islands. The naive
  placement is one stage (:func:`holmes_jax.planner.placement.naive_hardware`), so the row
  keeps full's tensor degree and makes every other device data parallel;
- overlap-off: full with one reduction after the backward (``grad_buckets=step``) and
  ``optimizer.zero1=false``. On CPUs gloo's collectives block the device, so nothing
  overlaps in a measured run whatever the setting (its prediction is priced that way);
  ``gpu_predicted_ms`` beside it is the same row priced with asynchronous collectives;
- all-off: nic-off with overlap-off (Megatron-LM-like: one stage, so no split to turn off;
  on CPUs the engine reduces the step's gradients as one buffer, as Megatron-LM's
  contiguous gradient buffer does);
- homogeneous: full on the all-fast twin (every island at the fastest island's speed and
  link, the inter-island links too): the reference the components try to approach.

A component's share of the gain: ``(t_off - t_full) / sum over components of (t_off - t_full)``
for the components partition, nic and overlap (shares sum to 1; a negative one means turning
it off helped). The component ranking orders the components by share (the target:
measured equal to predicted); the row ranking orders the rows by step time.

Measured mode (root): ``launch --emulate`` on meshes/emu-4host-2island-slow-compute.yaml
("two": roce computes at half ib's speed through its hosts' CPU quota, 100 Mbit/s between
the islands) and meshes/emu-6host-3island-slow-compute.yaml ("three"); predictions from a
profile the probe measures through the same launch. The planner plans these CPU meshes for
blocking collectives (``make_plan(sync_collectives=True)``: the split that runs fastest in
lockstep), the way the rows are priced and run. The model (``EMULATED``): 12 layers, so
every stage count the planner uses can give the slow island half the layers of a fast one
(two: 4 stages x data 1, [4, 4, 2, 2] against the even [3, 3, 3, 3], 1.5x in compute on
the slow stages; three: [5, 2, 5] against [4, 4, 4]); 6 layers on 4 stages split [2, 2, 1, 1],
which is the even split. Hidden 192 gives ~22 MB of fp32 gradients, which NIC-off's 4-rank
ring across the islands moves in ~2.7 s at 100 Mbit/s, while full on "two" (data 1)
reduces none and sends a micro-batch's activations (4 x 32 x 192 fp32, 96 KiB) across in
~8 ms. The slow island's memory bandwidth is halved with its compute in both meshes: a CPU
quota slows every op, and the probe measured roce's layer 2.0-2.2x slower than ib's.
The batch (36 x 32 tokens, divisible by 4 and 6 data ranks) sets compute against those
bytes: more tokens favour the split and dilute NIC-off (the two targets pull it in opposite
directions). Priced at the meshes' nominal speeds (``--plan-only``): on "two" full 0.78 s,
partition-off 1.31x and NIC-off 4.35x slower; on "three" 1.35x and 5.64x.

``--plan-only`` (no root, seconds): the same rows priced for the GPT-7.5B shape (36 layers,
hidden 4096, 32 heads, seq 2048, bf16, batch 512) on meshes/paper-ib-roce-4x8.yaml and
meshes/paper-ib-roce-8x8.yaml, plus the emulated meshes at their nominal speeds; each row
a JSON line with ``row``, ``predicted_ms`` and ``tflops_per_gpu`` (model FLOPs, 6 x weights x
tokens, no attention or recompute term), then the tables on stderr.

A launch's step time is the mean over steps 6 to ``--steps`` (the trainer logs every 5
steps; the compiling first step and the window after it, the first steps after
compilation, are left out). ``--rounds N`` launches every row N times, interleaved (round
k runs the rows in order, odd rounds in reverse), and a row's step time is its fastest
round's: under the quotas a launch's level can sit a third above another launch of the
same program for its whole run, so the slower rounds measure the machine, not the row
(``round_ms`` lists every round; ``median_ms`` is the median round, and with several
rounds ``measured_median`` gives the shares, rankings and ratios from those).
``window_ms`` lists each round's logged windows (the spread within a launch), and
``thp_fallbacks`` each round's page faults that asked for a huge page and got small ones
(each costs a quota'd host kernel time; docs/training.md, "CPU runs: huge pages").
``--rows`` runs some rows only (no shares or rankings then);
``--cpu-quota`` is ``launch --cpu-quota`` for every launch (``auto``: quotas where the
islands' speeds differ, and for the homogeneous row every host the fastest island's share,
as priced: its hosts would otherwise lend each other the cores they idle on in bubbles;
``on``: every host its fixed share; ``off``: none, that row included).
``--compile-cache DIR`` gives every run that compilation cache: a slow island compiles at
its quota's pace, minutes for each row, and a row whose program an earlier run compiled
(the homogeneous row runs full's; a rerun with the same cache runs all of them) loads it
instead. It is off by default, as ``train.compilation_cache`` is on CPUs, because XLA:CPU
in jaxlib 0.10.2 aborts on some programs read back from the cache
(:mod:`holmes_jax.runtime.rundir.compile_cache`). Compilation is never in the step times.
``--reuse-profile`` prices the rows with the profile an earlier run's probe left in
``--keep-logs`` (``profile-<mesh>.json``), where there is one, instead of probing again
(minutes under the quotas).

Targets: full >= 1.25x faster than partition-off with one island 2x slower; nic-off >= 3x
slower than full at 100 Mbit/s; each measured row within 25% of prediction; equal rankings.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile

import benchlib

from holmes_jax.core.config import load_config
from holmes_jax.core.plan_request import plan_request
from holmes_jax.planner.placement import Calibration
from holmes_jax.planner.plans import make_plan, plan_overrides, predict_run, topology_blocks
from holmes_jax.planner.topology import Topology, load_topology

MESH_DIR = f"{benchlib.ROOT}/meshes"
ROWS = ("full", "partition-off", "nic-off", "overlap-off", "all-off", "homogeneous")
EMULATED_MESHES = {
    "two": f"{MESH_DIR}/emu-4host-2island-slow-compute.yaml",
    "three": f"{MESH_DIR}/emu-6host-3island-slow-compute.yaml",
}
PAPER_MESHES = {
    "paper-4x8": f"{MESH_DIR}/paper-ib-roce-4x8.yaml",
    "paper-8x8": f"{MESH_DIR}/paper-ib-roce-8x8.yaml",
}
EMULATED = [
    "model.num_layers=12",
    "model.hidden_size=192",
    "model.num_heads=4",
    "model.seq_len=32",
    "model.tied_embeddings=false",
    "train.global_batch_size=36",
    "data.max_bytes=400000",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.run_dir=null",
    "logging.log_every=5",
    "logging.progress=plain",
]
GPT_7_5B = [
    "model.num_layers=36",
    "model.hidden_size=4096",
    "model.num_heads=32",
    "model.seq_len=2048",
    "model.vocab_size=51200",
    "train.global_batch_size=512",
    "train.precision=bf16",
    "train.run_dir=null",
]
COMPONENTS = ("partition", "nic", "overlap")
FULL = ["parallel.grad_buckets=layer", "optimizer.zero1=true"]
OVERLAP_OFF = ["parallel.grad_buckets=step", "optimizer.zero1=false"]


def log(msg: str) -> None:
    print(f"bench_ablation: {msg}", file=sys.stderr, flush=True)


def fast_twin(
    topology: Topology, calibration: Calibration | None = None
) -> tuple[Topology, Calibration | None]:
    """The homogeneous reference of ``topology``: every island at the fastest island's
    device speed and link, the inter-island links too; and ``calibration`` (a profile's,
    which measures each island by name) with every island at that island's measured speed
    and reduction links, else the twin would keep the slow island's measured speed. The
    collectives measured through every island (``spanning_ops``) are dropped: they ran on
    the slow islands."""
    best = max(topology.islands, key=lambda i: (i.peak_tflops, i.link.bandwidth_gbps))
    islands = tuple(
        dataclasses.replace(i, link=best.link, peak_tflops=best.peak_tflops)
        for i in topology.islands
    )
    twin = dataclasses.replace(
        topology,
        name=f"{topology.name}-fast",
        islands=islands,
        inter_island_default=best.link,
        inter_island_overrides=(),
    )
    if calibration is None:
        return twin, None
    per_island = {}
    for field, table in (
        ("island_flops", calibration.island_flops),
        ("data_ops", calibration.data_ops),
    ):
        per_island[field] = (
            {i.name: table[best.name] for i in islands} if best.name in table else {}
        )
    return twin, dataclasses.replace(calibration, **per_island, spanning_ops={})


def ablation_rows(
    base: list[str], mesh: str, calibration=None, topology: Topology | None = None
) -> dict[str, list[str]]:
    """The rows' overrides (besides ``base`` and ``parallel.mesh``): the planner's plan for
    ``base`` on ``mesh`` (or ``topology``, e.g. a profile's) with every component on, then
    each turned off (module doc)."""
    cfg = load_config(None, base + FULL + [f"parallel.mesh={mesh}"])
    topology = topology or load_topology(mesh)
    sync = topology_blocks(topology)  # CPU islands: priced and run with blocking collectives
    plan = make_plan(plan_request(cfg), topology, calibration=calibration, sync_collectives=sync)
    full = plan_overrides(plan) + FULL
    tensor = plan.layout.tensor
    naive = [
        "parallel.enforce_islands=false",
        "parallel.replica=1",
        "parallel.stages=1",
        "parallel.data=0",
        f"parallel.tensor={tensor}",
        "parallel.microbatches=1",
        "parallel.schedule=gpipe",
        "parallel.virtual_stages=1",
        "parallel.layers_per_stage=null",
        f"model.remat={plan.remat}",
    ]
    return {
        "full": full,
        "partition-off": replaced(full, ["parallel.layers_per_stage=null"]),
        "nic-off": naive + FULL,
        "overlap-off": replaced(full, OVERLAP_OFF),
        "all-off": naive + OVERLAP_OFF,
        "homogeneous": full,
    }


def run_order(rows: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, row) in the order they run: every row once a round, the odd rounds in
    reverse, so that a drift of the machine over the run weighs on every row alike."""
    return [(k, name) for k in range(rounds) for name in (rows[::-1] if k % 2 else rows)]


def replaced(overrides: list[str], changes: list[str]) -> list[str]:
    """``overrides`` with the keys ``changes`` sets replaced by them (one value per key)."""
    keys = {c.split("=", 1)[0] for c in changes}
    return [o for o in overrides if o.split("=", 1)[0] not in keys] + changes


def row_config(base: list[str], mesh: str, extra: list[str]):
    """The config a row names, through the real loader."""
    return load_config(None, base + extra + [f"parallel.mesh={mesh}"])


def price_rows(base: list[str], mesh: str, calibration=None, sync: bool = False) -> dict:
    """Predicted step (s), tokens/s and TFLOP/s per device of every row on ``mesh``."""
    topology = load_topology(mesh)
    rows = ablation_rows(base, mesh, calibration)
    out = {}
    for name, extra in rows.items():
        cfg = row_config(base, mesh, extra)
        req = plan_request(cfg)
        topo, cal = (
            fast_twin(topology, calibration) if name == "homogeneous" else (topology, calibration)
        )
        step = predict_run(req, topo, cal, sync_collectives=sync).step_s
        entry = {"predicted_ms": round(step * 1e3, 2), "overrides": extra}
        if sync and name == "overlap-off":  # what a GPU would do with the same row
            gpu = predict_run(req, topo, cal).step_s
            entry["gpu_predicted_ms"] = round(gpu * 1e3, 2)
        model, run = req.model, req.run
        tokens = run.global_batch_size * model.seq_len
        flops = 6 * model_params(cfg) * tokens  # fwd + bwd, no attention term
        entry["tokens_per_s"] = round(tokens / step, 1)
        tflops = flops / step / topology.num_devices / 1e12
        entry["tflops_per_gpu"] = round(tflops, 2 if tflops >= 1 else 5)
        out[name] = entry
    return out


def model_params(cfg) -> int:
    """Weights of a GPT block stack and its embeddings (12 h^2 per layer)."""
    m = cfg.model
    return 12 * m.num_layers * m.hidden_size**2 + 2 * m.padded_vocab * m.hidden_size


def shares(times: dict[str, float]) -> dict[str, float | None]:
    """Each component's share of the gain over full (module doc); None when no component
    costs anything."""
    gains = {c: times[f"{c}-off"] - times["full"] for c in COMPONENTS}
    total = sum(gains.values())
    return {c: (round(g / total, 3) if total > 0 else None) for c, g in gains.items()}


def ranking(times: dict[str, float]) -> list[str]:
    """The rows, fastest first."""
    return sorted(times, key=times.get)


def component_ranking(share: dict[str, float | None]) -> list[str]:
    """The components, largest share of the gain first (the ranking the targets compare)."""
    return sorted(share, key=lambda c: -(share[c] or 0.0))


def summary(rows: dict, key: str) -> dict:
    times = {name: r[key] for name, r in rows.items()}
    share = shares(times)
    return {
        "shares": share,
        "component_ranking": component_ranking(share),
        "ranking": ranking(times),
        "full_over_partition_off": round(times["partition-off"] / times["full"], 2),
        "nic_off_over_full": round(times["nic-off"] / times["full"], 2),
    }


def plan_only() -> dict:
    result = {}
    for label, mesh in {**PAPER_MESHES, **EMULATED_MESHES}.items():
        base = GPT_7_5B if label.startswith("paper") else EMULATED
        rows = price_rows(base, mesh, sync=not label.startswith("paper"))
        for name, r in rows.items():
            line = {"mesh": label, "row": name}
            line.update({k: v for k, v in r.items() if k != "overrides"})
            print(json.dumps(line), flush=True)
        result[label] = {"rows": rows, **summary(rows, "predicted_ms")}
    return result


def measure(args, folder: str) -> dict:
    from holmes_jax.cluster.netns import check_privileges

    check_privileges()
    result = {}
    for label in args.meshes.split(","):
        mesh = EMULATED_MESHES[label]
        fast = f"{folder}/{label}-fast.yaml"
        log(f"{label}: probe the links and each island's layer (emulated launch)")
        topology, calibration, layer_ms = benchlib.emulated_probe(
            mesh,
            EMULATED,
            folder,
            f"profile-{label}",
            "bench_ablation",
            cpu_quota=args.cpu_quota,
            reuse=args.reuse_profile,
        )
        rows = ablation_rows(EMULATED, mesh, calibration, topology)
        rows = {name: extra for name, extra in rows.items() if name in args.rows.split(",")}
        table = {}
        cache = [f"train.compilation_cache={args.compile_cache}"] if args.compile_cache else []
        runs: dict[str, list[dict]] = {name: [] for name in rows}
        for k, name in run_order(list(rows), args.rounds):
            extra = rows[name]
            run_mesh, topo, cal, quota = mesh, topology, calibration, args.cpu_quota
            if name == "homogeneous":
                run_mesh = write_fast_mesh(mesh, fast)
                topo, cal = fast_twin(topology, calibration)
                quota = homogeneous_quota(args.cpu_quota)
            fallbacks = benchlib.thp_fallbacks()
            records = benchlib.emulated_run(
                run_mesh,
                EMULATED + extra + cache,
                args.steps,
                folder,
                f"{label}-{name}" + (f"-r{k}" if k else ""),
                "bench_ablation",
                cpu_quota=quota,
            )
            step = benchlib.steady_step_s(records, warmup_windows=1)
            if fallbacks is not None:
                fallbacks = benchlib.thp_fallbacks() - fallbacks
            runs[name].append(
                {
                    "step_s": step,
                    "window_ms": [round(t * 1e3, 1) for _, t in benchlib.windows(records)],
                    "thp_fallbacks": fallbacks,
                }
            )
            log(f"{label} {name} round {k + 1}/{args.rounds}: {step * 1e3:.1f} ms a step")
            if len(runs[name]) < args.rounds:
                continue
            req = plan_request(row_config(EMULATED, run_mesh, extra))
            predicted = predict_run(req, topo, cal, sync_collectives=True).step_s
            step = min(r["step_s"] for r in runs[name])
            model, run = req.model, req.run
            tokens = run.global_batch_size * model.seq_len
            table[name] = {
                "step_ms": round(step * 1e3, 1),
                "tokens_per_s": round(tokens / step, 1),
                "predicted_ms": round(predicted * 1e3, 1),
                "prediction_error": round((predicted - step) / step, 3),
                "round_ms": [round(r["step_s"] * 1e3, 1) for r in runs[name]],
                "median_ms": round(statistics.median(r["step_s"] for r in runs[name]) * 1e3, 1),
                "window_ms": [r["window_ms"] for r in runs[name]],
                "cpu_quota": quota,
                "thp_fallbacks": [r["thp_fallbacks"] for r in runs[name]],
                "overrides": extra,
            }
            line = {"mesh": label, "row": name, **table[name]}
            print(json.dumps(line), flush=True)
        table = {name: table[name] for name in rows}  # the rows' order, not the last round's
        result[label] = block = {
            "rows": table,
            "cpu_quota": args.cpu_quota,
            "worst_prediction_error": max(abs(r["prediction_error"]) for r in table.values()),
            "probe_layer_fwd_bwd_ms": layer_ms,
        }
        if set(table) == set(ROWS):  # the shares and rankings need every row
            block["measured"] = summary(table, "step_ms")
            block["predicted"] = summary(table, "predicted_ms")
            if args.rounds > 1:  # the same from each row's median round, for comparison
                block["measured_median"] = summary(table, "median_ms")
            block["component_ranking_equal"] = (
                block["measured"]["component_ranking"] == block["predicted"]["component_ranking"]
            )
    return result


def homogeneous_quota(mode: str) -> str:
    """``--cpu-quota`` for the homogeneous row: ``auto`` becomes ``on`` where the cgroup
    controller exists, so every host of the all-fast twin computes at the fastest island's
    share, as the other rows' fast hosts do and as the row is priced (its profile's fastest
    island); without a quota its hosts would lend each other the cores they idle on."""
    from holmes_jax.cluster import cgroups

    return "on" if mode == "auto" and cgroups.available() else mode


def write_fast_mesh(mesh: str, path: str) -> str:
    """The YAML of ``mesh``'s all-fast twin (:func:`fast_twin`), for ``launch --emulate``."""
    import yaml

    with open(mesh) as f:
        raw = yaml.safe_load(f)
    best = max(raw["islands"], key=lambda i: (i["peak_tflops"], i["link"]["bandwidth_gbps"]))
    for island in raw["islands"]:
        island["link"] = dict(best["link"])
        island["peak_tflops"] = best["peak_tflops"]
    raw["name"] = f"{raw['name']}-fast"
    raw["inter_island"] = {"default": dict(best["link"])}
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    return path


def print_table(result: dict, measured: bool) -> None:
    for label, block in result.items():
        print(f"\n{label}", file=sys.stderr)
        head = f"{'row':14} {'pred ms':>10} {'tok/s':>10} {'TFLOP/s/dev':>11}"
        if measured:
            head = f"{'row':14} {'step ms':>10} {'tok/s':>10} {'pred ms':>10} {'error':>7}"
        print(head, file=sys.stderr)
        for name, r in block["rows"].items():
            if measured:
                cells = f"{r['step_ms']:>10} {r['tokens_per_s']:>10} {r['predicted_ms']:>10}"
                cells += f" {r['prediction_error']:>7}"
            else:
                cells = f"{r['predicted_ms']:>10} {r['tokens_per_s']:>10} {r['tflops_per_gpu']:>11}"
            print(f"{name:14} {cells}", file=sys.stderr)
        if measured and "measured" not in block:  # some rows only: no shares or rankings
            continue
        for key in ("measured", "predicted") if measured else (None,):
            s = block[key] if key else block
            print(f"  {key or 'predicted'}: shares {s['shares']}", file=sys.stderr)
            print(f"  {key or 'predicted'}: rows fastest first {s['ranking']}", file=sys.stderr)
            print(f"  {key or 'predicted'}: components {s['component_ranking']}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan-only", action="store_true", help="price the rows, run nothing")
    parser.add_argument("--meshes", default="two,three", help="emulated topologies: two,three")
    parser.add_argument("--steps", type=int, default=21, help="steps per row; timed from step 6 on")
    parser.add_argument("--keep-logs", default=None, help="folder for the runs' files")
    parser.add_argument(
        "--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}"
    )
    parser.add_argument(
        "--compile-cache",
        default=None,
        help="jax's compilation cache for every run (default: none; see the module doc)",
    )
    parser.add_argument(
        "--reuse-profile",
        action="store_true",
        help="take <keep-logs>/profile-<mesh>.json where an earlier run's probe wrote it",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="launches per row, interleaved (odd rounds in reverse); a row's step is its "
        "fastest round's",
    )
    benchlib.add_cpu_quota_arg(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds={args.rounds}: must be at least 1")
    unknown = set(args.rows.split(",")) - set(ROWS)
    if unknown:
        parser.error(f"--rows={args.rows}: {', '.join(sorted(unknown))} unknown")
    if args.plan_only:
        result = plan_only()
        print_table(result, measured=False)
        return 0
    folder = args.keep_logs or tempfile.mkdtemp(prefix="bench_ablation-")
    os.makedirs(folder, exist_ok=True)
    if args.compile_cache:
        args.compile_cache = os.path.abspath(args.compile_cache)
    result = measure(args, folder)
    print_table(result, measured=True)
    print(
        json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "rows"} for k, v in result.items()})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
