"""``python -m holmes_jax.train``: the command-line entry point, and ``run`` for notebooks.

    python -m holmes_jax.train --config configs/quickstart.yaml \\
        [--mesh meshes/cpu8-two-islands.yaml] [--set train.steps=100 --set parallel.tensor=2]
    python -m holmes_jax.train ... --coordinator host0:1234 --num-processes 4 --process-id 2
    python -m holmes_jax.train ... --profile 2:2     # a profiler trace of steps 3 and 4
    python -m holmes_jax.train ... --print-config    # the resolved config as YAML; no training

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

``--print-config`` resolves the config on the visible devices as a run would (the run
directory's outputs, DiLoCo, the planner's schedule, split and remat:
:func:`holmes_jax.runtime.loop.resolve`), prints it as the YAML the run writes to
``<run_dir>/config.yaml`` and exits 0; it compiles nothing and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from holmes_jax.cluster import detect, distributed, xla_flags
from holmes_jax.core import status
from holmes_jax.core.config import Config, load_config
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.plan_request import plan_request
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
    parser.add_argument(
        "--profile",
        metavar="START:N",
        help="write a jax.profiler trace of N steps after step START (START >= 1) to "
        "<run_dir>/profile/; sets logging.profile_steps",
    )
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="compile the train step and checkpoint layout conversions (a failure's "
        "survivors: each candidate plan's) into train.compilation_cache and exit without "
        "training",
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="with --compile-only and parallel.exclude_hosts: also time each candidate "
        "plan's train step (up to 3 steps on zeros, as a re-plan's trial) and report the "
        "times to the launcher (launch --warm-failures)",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (every auto decided on the visible devices) as "
        "YAML and exit without training",
    )
    detect.add_flags(parser)
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=8,
        help="simulated CPU devices when no accelerator is present (default 8)",
    )
    return parser.parse_args(argv)


def overrides_of(args: argparse.Namespace) -> list[str]:
    """The ``--set`` overrides the command line stands for: its ``--set`` items, then
    ``--mesh`` and ``--profile`` (a JSON string, so the value stays text)."""
    overrides = list(args.set)
    if args.mesh:
        overrides.append(f"parallel.mesh={args.mesh}")
    if args.profile is not None:
        overrides.append(f"logging.profile_steps={json.dumps(args.profile)}")
    return overrides


def print_config(cfg: Config) -> int:
    """``--print-config``: the resolved config on process 0's stdout."""
    import jax

    from holmes_jax.runtime.rundir.paths import config_yaml
    from holmes_jax.runtime.setup import resolve

    resolved = resolve(cfg)
    if jax.process_index() == 0:
        devices = resolved.devices
        print(
            f"# The resolved config ({len(devices)} {devices[0].platform} devices); "
            "a run writes the same to <train.run_dir>/config.yaml.\n" + config_yaml(resolved.cfg),
            end="",
        )
    return 0


def compile_only(cfg: Config, measure: bool = False) -> int:
    """``--compile-only``: :func:`holmes_jax.runtime.replan_trial.compile_ahead`."""
    import jax

    from holmes_jax.diloco.scope import island_outputs
    from holmes_jax.runtime.loop import program_of
    from holmes_jax.runtime.replan_trial import compile_ahead
    from holmes_jax.runtime.rundir.paths import choose_run_dir
    from holmes_jax.runtime.setup import resolve

    def say(line: str) -> None:
        if jax.process_index() == 0:
            print(line, file=sys.stderr if line.startswith("error:") else sys.stdout, flush=True)

    outputs = choose_run_dir(island_outputs(cfg))
    return compile_ahead(cfg, outputs, resolve, program_of, say, measure)


def main(argv: list[str] | None = None) -> int:
    status.report("started")  # to a launcher: imports done (a restart's phases)
    args = parse_args(argv)
    overrides = overrides_of(args)
    try:
        cfg = detect.apply_flags(load_config(args.config, overrides), args)
        load_mesh_topology(plan_request(cfg))  # a bad topology file fails here, not in jax
        if args.cpu_devices < 1:
            raise ConfigError(f"--cpu-devices={args.cpu_devices}: must be >= 1")
        DEVICES_PER_HOST.check("--cpu-devices", args.cpu_devices)
        if args.measure and not args.compile_only:
            raise ConfigError("--measure: only with --compile-only (it trains nothing)")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    xla_flags.request_cpu_devices(args.cpu_devices)
    xla_flags.apply_gpu_flags()  # async collectives on GPUs, validated (no-op on CPU)

    def body() -> int:
        if args.print_config:
            return print_config(cfg)
        if args.compile_only:
            return compile_only(cfg, args.measure)
        run(cfg)
        return 0

    return distributed.run_joined(cfg, body)


if __name__ == "__main__":
    sys.exit(main())
