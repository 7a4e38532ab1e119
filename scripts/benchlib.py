"""Shared pieces of the benchmarks: simulated devices, side-by-side timing, step runners.

Benchmarks compare variants in one process, alternating rounds so that machine noise
hits every variant alike, and report medians. Import this module before jax.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()


def interleaved_medians(
    runners: dict[str, Callable[[int], None]], steps: int, rounds: int, warmup: int = 2
) -> dict[str, float]:
    """Median seconds per step of each runner; ``runner(n)`` runs n steps and blocks."""
    for run in runners.values():
        run(warmup)  # compile + warm caches
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            t = time.perf_counter()
            run(steps)
            times[name].append((time.perf_counter() - t) / steps)
    return {name: statistics.median(v) for name, v in times.items()}


def program_runner(cfg, shape, batch_rows: Callable[[int], object] | None = None):
    """A runner over holmes_jax's Program: ``run(n)`` does n train steps and blocks."""
    import jax
    import numpy as np

    from holmes_jax.runtime.mesh import build_mesh
    from holmes_jax.runtime.program import Program

    program = Program(cfg, build_mesh(shape))
    rows = (cfg.train.global_batch_size, cfg.model.seq_len + 1)
    fixed = np.random.RandomState(0).randint(0, cfg.model.vocab_size, rows).astype(np.int32)
    batch = jax.device_put(fixed, program.batch_sharding)
    state = [program.init(0)]

    def run(n: int) -> None:
        st = state[0]
        for _ in range(n):
            st, metrics = program.train_step(st, batch)
        metrics["loss"].block_until_ready()
        state[0] = st

    run.program = program
    return run
