"""``python -m holmes_jax.train``: the command-line entry point, and ``run`` for notebooks.

    python -m holmes_jax.train --config configs/quickstart.yaml \\
        [--mesh meshes/cpu8-two-islands.yaml] [--set train.steps=100 --set parallel.tensor=2]
    python -m holmes_jax.train ... --coordinator host0:1234 --num-processes 4 --process-id 2

On a CPU-only machine the entry point asks XLA for ``--cpu-devices`` simulated devices
(default 8) before jax is imported; on GPU hosts the flag only adds unused CPU devices.
A bad setting prints one line naming the key, the value and the rule, and exits with 2,
before jax is imported: the config, the topology it names and the flags are all read
first. This module imports jax lazily, so setting the flag here still works.

One of several processes (explicit flags, or SLURM / Open MPI / Kubernetes detected; see
:mod:`holmes_jax.cluster.distributed`): the entry point sets this host's NCCL profile from the
topology (:mod:`holmes_jax.cluster.transport`; variables already set win), joins the job, and
runs. A lost peer ends the process with one line naming it (exit code 3); a step that
raised for another reason exits with 1.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from holmes_jax.cluster import detect, distributed, xla_flags
from holmes_jax.core.config import Config, load_config
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import DEVICES_PER_HOST
from holmes_jax.planner.grid import load_mesh_topology


def run(config: Config, **kwargs) -> list[dict[str, Any]]:
    """Train; returns the per-logged-step history. See :func:`holmes_jax.runtime.loop.run`."""
    from holmes_jax.runtime.loop import run as _run

    return _run(config, **kwargs)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m holmes_jax.train",
        description="Train a GPT on a (possibly heterogeneous) device mesh.",
    )
    parser.add_argument("--config", help="YAML config (configs/*.yaml); defaults if omitted")
    parser.add_argument("--mesh", help="topology file (meshes/*.yaml); sets parallel.mesh")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value, e.g. --set train.steps=100 (repeatable)",
    )
    detect.add_flags(parser)
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=8,
        help="simulated CPU devices when no accelerator is present (default 8)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = list(args.set)
    if args.mesh:
        overrides.append(f"parallel.mesh={args.mesh}")
    try:
        cfg = detect.apply_flags(load_config(args.config, overrides), args)
        load_mesh_topology(cfg)  # a bad topology file fails here, not after jax starts
        if args.cpu_devices < 1:
            raise ConfigError(f"--cpu-devices={args.cpu_devices}: must be >= 1")
        DEVICES_PER_HOST.check("--cpu-devices", args.cpu_devices)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    xla_flags.request_cpu_devices(args.cpu_devices)
    xla_flags.apply_gpu_flags()  # async collectives on GPUs, validated (no-op on CPU)

    def body() -> int:
        run(cfg)
        return 0

    return distributed.run_joined(cfg, body)


if __name__ == "__main__":
    sys.exit(main())
