"""Benchmark: plan a 96-layer GPT (GPT-3 175B shape) on the 1024-GPU, 4-island topology.

Times the whole search as ``python -m holmes_jax.plan`` runs it (every placement: replica or
not, tensor/data degrees hence stages per island, micro-batch count, schedule: 1F1B,
interleaved with v = 2, 3, 4, ZB-H1; the exact optimal split of each by branch and
bound) and prints one JSON line; ``one_schedule_s`` is the same search over 1F1B alone.
Target: under 2 s on a 2-core machine.

    python scripts/bench_plan.py [--mesh meshes/gpu1024-four-islands.yaml] [--repeat 3]
"""

import argparse
import json
import os
import time

from holmes_jax.core.plan_request import RunSpec
from holmes_jax.core.spec import SCHEDULES, ModelSpec
from holmes_jax.planner.search import candidate_layouts, search_plan
from holmes_jax.planner.topology import load_topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mesh", default=os.path.join(ROOT, "meshes", "gpu1024-four-islands.yaml"))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    model = ModelSpec(
        num_layers=96, hidden_size=12288, num_heads=96, seq_len=2048, vocab_size=51200
    )
    run = RunSpec(global_batch_size=1536, remat="full")
    times, one = [], []
    for _ in range(args.repeat):
        start = time.perf_counter()
        topology = load_topology(args.mesh)
        plan = search_plan(topology, model, run, schedules=SCHEDULES)
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        search_plan(load_topology(args.mesh), model, run)
        one.append(time.perf_counter() - start)
    print(
        json.dumps(
            {
                "bench": "plan",
                "mesh": os.path.basename(args.mesh),
                "devices": topology.num_devices,
                "islands": len(topology.islands),
                "layers": model.num_layers,
                "placements": len(candidate_layouts(topology, model, run)),
                "first_s": round(times[0], 3),
                "best_s": round(min(times), 3),
                "one_schedule_s": round(min(one), 3),
                "target_s": 2.0,
                "ok": times[0] < 2.0,
                "plan": {
                    k: plan.to_dict()[k]
                    for k in (
                        "replica",
                        "stages",
                        "data",
                        "tensor",
                        "microbatches",
                        "schedule",
                        "virtual_stages",
                        "bubble_fraction",
                        "stages_per_island",
                        "layers_per_stage",
                        "predicted_step_s",
                        "tflops_per_device",
                    )
                },
            }
        )
    )


if __name__ == "__main__":
    main()
