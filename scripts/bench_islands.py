"""Benchmark: Holmes placement vs naive data parallelism on an emulated 2-island network.

    sudo .venv/bin/python scripts/bench_islands.py [--steps 6] [--keep-logs DIR] \\
        [--set model.hidden_size=512] [--only holmes,fast] [--links 100mbit-20ms] \\
        [--cpu-quota auto|on|off]

Four single-device hosts in two islands, each a process in its own network namespace
(``launch --emulate``). Links are 1 Gbit/s inside each island and 100 Mbit/s between them
(meshes/emu-4host-2island.yaml; ``--links 100mbit-20ms``: with 20 ms of round trip between
the islands, meshes/emu-4host-2island-20ms.yaml), real gloo traffic through ``tc htb``.
The model's gradients (13 MB fp32) are ~400x one micro-batch's activations (32 KiB), so
where the gradient traffic flows decides the step time. Variants, a few steps each:

- (a) holmes: 2 stages (one per island) x data 2, 1F1B, 4 micro-batches;
- (b) naive: data parallel 4 across both islands (``parallel.enforce_islands=false``);
- (c) fast: (a) with every link 1 Gbit/s (emu-4host-2island-fast.yaml);
- (d) zb: (a) with the ZB-H1 schedule.

Each pipeline variant also reports the bytes per step that cross the island boundary, read
from its compiled HLO (:mod:`holmes_jax.runtime.engine.traffic`). Step times are medians of
5-step logging windows after the first. Predictions are
:func:`holmes_jax.planner.plans.predict_run` on a profile the probe measures through
the same emulated launch (docs/multihost.md, "Benchmark"). A diagnostic runs (a)'s plan on
4 devices of this one process, next to its prediction from the in-process probe.

``--cpu-quota`` is ``launch --cpu-quota`` for every launch, the probes' too (``on``: each
host a fixed share of the cores, so a host that waits does not lend its time to the
others; the default ``auto`` applies none here, the islands computing alike).

Targets: (b)/(a) >= 2, (a)/(c) <= 1.25, every prediction within 25% of its measurement.
Needs root. Prints one JSON line; progress and the processes' output go to stderr.
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

# 4 simulated devices in this process, as the topology has (the probe and the one-process
# diagnostic); each launched process sets its own count.
os.environ["XLA_FLAGS"] = benchlib.os.environ["XLA_FLAGS"].replace(
    "device_count=8", "device_count=4"
)

from holmes_jax.core.config import load_config  # noqa: E402
from holmes_jax.core.errors import ConfigError  # noqa: E402
from holmes_jax.core.plan_request import plan_request  # noqa: E402
from holmes_jax.planner.plans import predict_run  # noqa: E402
from holmes_jax.planner.topology import load_topology  # noqa: E402

SLOW = f"{benchlib.ROOT}/meshes/emu-4host-2island.yaml"
LINKS = {"100mbit": SLOW, "100mbit-20ms": f"{benchlib.ROOT}/meshes/emu-4host-2island-20ms.yaml"}
FAST = f"{benchlib.ROOT}/meshes/emu-4host-2island-fast.yaml"
MODEL = [
    "model.num_layers=4",
    "model.hidden_size=256",
    "model.num_heads=4",
    "model.seq_len=32",
    "model.tied_embeddings=false",
    "train.global_batch_size=8",
    "data.max_bytes=400000",
    "train.eval_every=0",
    "train.eval_batches=1",
    "logging.log_every=5",
    "logging.progress=plain",
]
HOLMES = ["parallel.stages=2", "parallel.data=2", "parallel.microbatches=4"]
HOLMES += ["parallel.schedule=1f1b", "parallel.layers_per_stage=[2,2]"]
NAIVE = ["parallel.stages=1", "parallel.data=4", "parallel.enforce_islands=false"]
ZB = [o for o in HOLMES if not o.startswith("parallel.schedule")] + ["parallel.schedule=zb"]
VARIANTS = {
    "holmes": (SLOW, HOLMES),
    "naive": (SLOW, NAIVE),
    "fast": (FAST, HOLMES),
    "zb": (SLOW, ZB),
}


def config(steps: int, extra: list[str], mesh: str):
    return load_config(None, MODEL + extra + [f"train.steps={steps}", f"parallel.mesh={mesh}"])


def calibrate(cfg, topology):
    """Device speed from the probe in this process: one layer on every device at once."""
    from holmes_jax.planner.measurements import profile_dict
    from holmes_jax.planner.profiles import profile_from_dict
    from holmes_jax.runtime.probe.measure import measure

    m = measure(cfg, topology, repeats=10, sizes=(4096, 65536))
    profile = profile_dict(m)
    profile.pop("links")  # no network in one process: the links are the topology's
    return profile_from_dict(profile, topology, source="<probe>")[1]


def probe_launch(mesh: str, extra: list[str], folder: str, name: str, cpu_quota: str):
    """Profile measured by ``launch --program probe --emulate`` (benchlib.emulated_probe)."""
    return benchlib.emulated_probe(
        mesh, MODEL + extra, folder, f"profile-{name}", "bench_islands", cpu_quota=cpu_quota
    )


def predicted_step(cfg, topology, calibration) -> float:
    """Cost-model step time of a config, as the trainer runs it on CPUs (module doc)."""
    return predict_run(plan_request(cfg), topology, calibration, sync_collectives=True).step_s


def single_process(cfg, topology, calibration, steps: int) -> tuple[float, float]:
    """Diagnostic: (a)'s plan on 4 devices of this one process (in-process collectives, no
    network): measured and predicted (every link as fast as the intra-host one) step."""
    from holmes_jax.core.spec import Degrees

    par = cfg.parallel
    shape = Degrees(par.stages, par.data, par.tensor)
    runner = benchlib.program_runner(cfg, shape)
    measured = benchlib.interleaved_medians({"single": runner}, steps, rounds=3)["single"]
    fast = topology.intra_host
    local = dataclasses.replace(
        topology,
        islands=tuple(dataclasses.replace(i, link=fast) for i in topology.islands),
        inter_island_default=fast,
    )
    return measured, predicted_step(cfg, local, calibration)


def island_bytes(cfg, topology) -> int:
    """Point-to-point bytes per step crossing islands in ``cfg``'s compiled train step (this
    process's 4 simulated devices stand in for the 4 hosts; the program is the same)."""
    from holmes_jax.core.spec import Degrees
    from holmes_jax.runtime.engine.mesh import build_mesh
    from holmes_jax.runtime.engine.traffic import cross_island_bytes
    from holmes_jax.runtime.program import Program

    par = cfg.parallel
    mesh = build_mesh(Degrees(par.stages, par.data, par.tensor))
    text = Program(cfg, mesh).lower_train_step().compile().as_text()
    return cross_island_bytes(text, mesh, topology)


def measured_step(
    mesh: str, extra: list[str], steps: int, folder: str, name: str, cpu_quota: str
) -> float:
    """Median step time (after the first) of an emulated launch."""
    records = benchlib.emulated_run(
        mesh, MODEL + extra, steps, folder, name, "bench_islands", cpu_quota=cpu_quota
    )
    times = [r["step_time_s"] for r in records if "compile_s" not in r]
    if not times:
        raise RuntimeError(f"{name}: no step after the first was logged (--steps >= 2)")
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=11, help="steps per variant (>= 6)")
    parser.add_argument("--keep-logs", help="keep the metrics files in this folder")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for every variant, e.g. model.hidden_size=512 (repeatable)",
    )
    parser.add_argument(
        "--only", default="holmes,naive,fast,zb", help="comma-separated variants to run"
    )
    parser.add_argument(
        "--links",
        default="100mbit",
        choices=sorted(LINKS),
        help="the link between the islands of variants a, b, d (default 100mbit: 100 µs)",
    )
    benchlib.add_cpu_quota_arg(parser)
    args = parser.parse_args(argv)
    MODEL.extend(args.set)
    slow_mesh = LINKS[args.links]
    for name, (mesh, extra) in VARIANTS.items():
        VARIANTS[name] = (slow_mesh if mesh == SLOW else mesh, extra)
    for name in set(VARIANTS) - set(args.only.split(",")):
        del VARIANTS[name]
    if args.steps < 6:
        print(
            f"error: --steps={args.steps}: must be >= 6 (the first compiles; then windows of 5)",
            file=sys.stderr,
        )
        return 2
    from holmes_jax.cluster.netns import check_privileges

    try:
        check_privileges()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    slow = load_topology(slow_mesh)
    folder = args.keep_logs or tempfile.mkdtemp(prefix="bench_islands_")
    os.makedirs(folder, exist_ok=True)
    cfgs = {name: config(args.steps, extra, mesh) for name, (mesh, extra) in VARIANTS.items()}
    # The probe times a stage at its plan's micro-batch: naive data parallel runs 2
    # sequences of 4 layers per device, the Holmes plans 1 sequence of 2 layers.
    profiled = {"slow": probe_launch(slow_mesh, HOLMES, folder, "slow", args.cpu_quota)}
    if "naive" in VARIANTS:
        profiled["naive"] = probe_launch(slow_mesh, NAIVE, folder, "naive", args.cpu_quota)
    if "fast" in VARIANTS:
        profiled["fast"] = probe_launch(FAST, HOLMES, folder, "fast", args.cpu_quota)
    which = {"holmes": "slow", "naive": "naive", "fast": "fast", "zb": "slow"}
    predicted = {
        name: predicted_step(cfg, *profiled[which[name]][:2]) for name, cfg in cfgs.items()
    }

    holmes_cfg = config(args.steps, HOLMES, slow_mesh)
    one_measured, one_predicted = single_process(
        holmes_cfg, slow, calibrate(holmes_cfg, slow), args.steps
    )

    measured = {
        name: measured_step(mesh, extra, args.steps, folder, name, args.cpu_quota)
        for name, (mesh, extra) in VARIANTS.items()
    }
    p2p = {name: island_bytes(cfg, slow) for name, cfg in cfgs.items() if name in ("holmes", "zb")}
    ratio = lambda a, b: measured[a] / measured[b] if a in measured and b in measured else 0.0
    b_a, a_c = ratio("naive", "holmes"), ratio("holmes", "fast")
    errors = {k: (predicted[k] - measured[k]) / measured[k] for k in measured}
    model = plan_request(config(args.steps, HOLMES, slow_mesh)).model
    act = 1 * model.seq_len * model.hidden_size * 4  # one micro-batch of 1 row, fp32
    result = {
        "bench": "islands",
        "topology": {
            "intra_island_mbit": slow.islands[0].link.bandwidth_gbps * 1e3,
            "inter_island_mbit": slow.inter_island_default.bandwidth_gbps * 1e3,
            "inter_island_rtt_ms": slow.inter_island_default.latency_us * 2e-3,
            "hosts": slow.num_hosts,
        },
        "model": {
            "params_m": round(model.num_params / 1e6, 2),
            "grad_mb": round(model.num_params * 4 / 1e6, 1),
            "microbatch_act_kib": act / 1024,
        },
        "cpu_quota": args.cpu_quota,
        "steps_timed": args.steps - 1,
        "step_ms": {k: round(v * 1e3, 1) for k, v in measured.items()},
        "predicted_ms": {k: round(v * 1e3, 1) for k, v in predicted.items()},
        "prediction_error": {k: round(v, 3) for k, v in errors.items()},
        "zb_over_holmes": round(ratio("zb", "holmes"), 3),
        "cross_island_p2p_bytes_per_step": p2p,
        "cross_island_p2p_activations_per_step": {
            # expected 16: 2 data ranks x (forward + backward) x 4 micro-batches of one row
            k: round(v / act, 2)
            for k, v in p2p.items()
        },
        "probe_layer_fwd_bwd_ms": {k: v[2] for k, v in profiled.items()},
        "diagnostic_holmes_plan_one_process": {
            "step_ms": round(one_measured * 1e3, 1),
            "predicted_ms": round(one_predicted * 1e3, 1),
            "error": round((one_predicted - one_measured) / one_measured, 3),
        },
        "naive_over_holmes": round(b_a, 3),
        "holmes_over_fast": round(a_c, 3),
        "targets": {
            "naive_over_holmes >= 2": b_a >= 2,
            "holmes_over_fast <= 1.25": a_c <= 1.25,
            "predictions within 25%": all(abs(e) <= 0.25 for e in errors.values()),
        },
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
