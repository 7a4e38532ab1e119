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


def add_cpu_quota_arg(parser) -> None:
    """``--cpu-quota``: ``launch --cpu-quota`` for every emulated launch of a benchmark."""
    from holmes_jax.cluster.cgroups import MODES

    parser.add_argument(
        "--cpu-quota",
        choices=MODES,
        default="auto",
        help="launch --cpu-quota for every emulated launch, the probes' too (on: a fixed CPU "
        "share per host, so a host that waits lends its time to no other; auto: quotas "
        "where the islands' speeds differ)",
    )


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

    from holmes_jax.runtime.engine.mesh import build_mesh
    from holmes_jax.runtime.program import Program

    program = Program(cfg, build_mesh(shape))
    rows = (cfg.train.global_batch_size, cfg.model.seq_len + 1)
    fixed = np.random.RandomState(0).randint(0, cfg.model.vocab_size, rows).astype(np.int32)
    batch = jax.device_put(fixed, program.shardings.batch)
    state = [program.init(0)]

    def run(n: int) -> None:
        st = state[0]
        for _ in range(n):
            st, metrics = program.train_step(st, batch)
        metrics["loss"].block_until_ready()
        state[0] = st

    run.program = program
    return run


def emulated_probe(
    mesh: str,
    overrides: list[str],
    folder: str,
    name: str,
    tag: str,
    config: str | None = None,
    cpu_quota: str = "auto",
    reuse: bool = False,
):
    """Profile measured by ``launch --program probe --emulate`` on ``mesh`` (root): the
    topology with its links as gloo sees them through the namespaces, the calibration and
    the per-island layer fwd+bwd times (ms). ``config``: a YAML the overrides apply to;
    ``cpu_quota``: ``launch --cpu-quota`` (:mod:`holmes_jax.cluster.cgroups`); ``reuse``:
    read ``<folder>/<name>.json`` where an earlier probe wrote it instead of probing."""
    import json

    from holmes_jax.cluster.local_launch import launch
    from holmes_jax.planner.profiles import load_profile
    from holmes_jax.planner.topology import load_topology

    out = os.path.join(folder, f"{name}.json")
    args = ["--config", config] if config else []  # else the built-in defaults
    args += [a for o in overrides for a in ("--set", o)]
    args += ["--out", out, "--repeats", "10", "--sizes-kib", "4,64,1024,8192"]
    if reuse and os.path.exists(out):
        print(f"{tag}: the profile of an earlier probe, {out}", file=sys.stderr)
    else:
        base = os.path.basename(mesh)
        print(f"{tag}: probe {base} through the emulated network", file=sys.stderr)
        code = launch(
            mesh, args, emulate=True, out=sys.stderr, program="probe", cpu_quota=cpu_quota
        )
        if code:
            raise RuntimeError(f"probe on {mesh}: the emulated launch exited with code {code}")
    with open(out) as f:
        compute = json.load(f)["compute"]
    topology, calibration = load_profile(out, load_topology(mesh))
    layer_ms = {
        k: round((v["layer_fwd_s"] + v["layer_bwd_s"]) * 1e3, 2) for k, v in compute.items()
    }
    return topology, calibration, layer_ms


def thp_fallbacks() -> int | None:
    """Page faults so far that asked for a transparent huge page and got small pages
    (``/proc/vmstat`` ``thp_fault_fallback``): under quotas those cost a host its share in
    the kernel; None where the kernel does not count them."""
    try:
        with open("/proc/vmstat") as f:
            stats = dict(line.split() for line in f)
        return int(stats["thp_fault_fallback"])
    except (OSError, KeyError, ValueError):
        return None


def windows(records: list[dict]) -> list[tuple[int, float]]:
    """(steps, mean step s) of each logging window after the compiling first step: the
    trainer logs a window's mean (``step_time_s``) at its last step, so a window holds the
    steps since the record before it."""
    done = [r["step"] for r in records]
    return [
        (b - a, r["step_time_s"])
        for a, b, r in zip(done[:-1], done[1:], records[1:], strict=True)
        if "compile_s" not in r
    ]


def steady_step_s(records: list[dict], warmup_windows: int = 0) -> float:
    """Mean step time of a run's records, every step weighted alike, the compiling first
    step left out and the ``warmup_windows`` windows after it too where a later one exists.

    Raises:
      RuntimeError: no step after the compiling one was logged.
    """
    spans = windows(records)
    if not spans:
        raise RuntimeError("no step after the compiling first step was logged (steps >= 2)")
    spans = spans[warmup_windows:] or spans[-1:]
    return sum(n * t for n, t in spans) / sum(n for n, _ in spans)


def emulated_run(
    mesh: str,
    overrides: list[str],
    steps: int,
    folder: str,
    name: str,
    tag: str,
    config: str | None = None,
    cpu_quota: str = "auto",
) -> list[dict]:
    """The metrics records of a training run through ``launch --emulate`` on ``mesh``
    (``cpu_quota``: ``launch --cpu-quota``)."""
    import json

    from holmes_jax.cluster.local_launch import launch

    metrics = os.path.join(folder, f"{name}.jsonl")
    args = ["--config", config] if config else []  # else the built-in defaults
    args += [a for o in overrides for a in ("--set", o)]
    args += ["--set", f"train.steps={steps}", "--set", f"train.metrics_path={metrics}"]
    print(f"{tag}: {name}: launch --mesh {os.path.basename(mesh)} --emulate", file=sys.stderr)
    code = launch(mesh, args, emulate=True, out=sys.stderr, cpu_quota=cpu_quota)
    if code:
        raise RuntimeError(f"{name}: the emulated launch exited with code {code}")
    with open(metrics) as f:
        return [json.loads(line) for line in f]
