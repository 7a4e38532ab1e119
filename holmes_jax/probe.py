"""``python -m holmes_jax.probe``: measure a layer and the links on the real devices.

    python -m holmes_jax.probe --mesh meshes/cpu8-two-islands.yaml \\
        [--config configs/quickstart.yaml] [--set model.hidden_size=256 ...] \\
        [--out runs/probe/profile.json] [--repeats 10] [--sizes-kib 4,64,1024,16384]
    python -m holmes_jax.plan --config C --mesh M --profile runs/probe/profile.json
    sudo python -m holmes_jax.launch --mesh meshes/emu-4host-2island.yaml --emulate \\
        --program probe -- --config C --out runs/probe/emu.json   # one process per host

Writes a profile (the schema of :mod:`holmes_jax.planner.profiles`) that replaces the topology's
analytic device speed and link figures in the planner, and prints what it measured.

The measuring is :func:`holmes_jax.runtime.probe.measure.measure`; this module only parses and
writes. The entry point sets the simulated CPU device count (default: the topology's)
before jax is imported.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from holmes_jax.cluster import detect, distributed, xla_flags
from holmes_jax.core.config import load_config
from holmes_jax.core.errors import ConfigError, run_cli
from holmes_jax.core.spec import DEVICES_PER_HOST, MESSAGE_BYTES, REPEATS
from holmes_jax.planner.measurements import (
    DEFAULT_REPEATS,
    DEFAULT_SIZES,
    KIB,
    format_table,
    profile_dict,
    write_profile,
)
from holmes_jax.planner.topology import load_topology
from holmes_jax.runtime.probe.measure import measure

DEFAULT_OUT = "runs/probe/profile.json"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m holmes_jax.probe", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--mesh", help="topology (meshes/*.yaml); default: parallel.mesh")
    ap.add_argument("--config", help="run config (configs/*.yaml); defaults if omitted")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, e.g. model.hidden_size=256 (repeatable)",
    )
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"profile to write ({DEFAULT_OUT})")
    ap.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="timed runs (median)")
    ap.add_argument(
        "--sizes-kib",
        default=",".join(f"{s // KIB}" for s in DEFAULT_SIZES),
        help="message sizes per device in KiB, comma-separated",
    )
    ap.add_argument(
        "--cpu-devices",
        type=int,
        default=0,
        help="simulated CPU devices when no accelerator is present (0: the topology's)",
    )
    detect.add_flags(ap)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    return run_cli(_run, _parser().parse_args(argv))


def _run(args: argparse.Namespace) -> int:
    overrides = list(args.set) + ([f"parallel.mesh={args.mesh}"] if args.mesh else [])
    cfg = detect.apply_flags(load_config(args.config, overrides), args)
    if not cfg.parallel.mesh:
        raise ConfigError("--mesh=None: a topology is needed (--mesh or parallel.mesh)")
    topology = load_topology(cfg.parallel.mesh)
    try:
        sizes = [round(float(s) * KIB) for s in args.sizes_kib.split(",")]
    except (ValueError, OverflowError):  # not a number, nan, inf
        raise ConfigError(f"--sizes-kib='{args.sizes_kib}': must be numbers, e.g. 4,64") from None
    for size in sizes:  # measure() checks the least ones
        MESSAGE_BYTES.check("--sizes-kib (bytes)", size)
    REPEATS.check("--repeats", args.repeats)
    if args.cpu_devices < 0:
        raise ConfigError(f"--cpu-devices={args.cpu_devices}: must be >= 0 (0: the topology's)")
    DEVICES_PER_HOST.check("--cpu-devices", args.cpu_devices)
    xla_flags.request_cpu_devices(
        args.cpu_devices or topology.num_devices
    )  # before jax is imported

    def log(line: str) -> None:
        print(f"probe: {line}", file=sys.stderr, flush=True)

    def body() -> int:
        import jax

        main_process = jax.process_index() == 0
        result = measure(
            cfg, topology, repeats=args.repeats, sizes=sizes, log=log if main_process else None
        )
        if main_process:
            write_profile(profile_dict(result), args.out)
            print(format_table(result))
            print(f"wrote {args.out}  (use: python -m holmes_jax.plan --profile {args.out} ...)")
        return 0

    # One of several processes (the launcher's, or SLURM's ...): join, then measure.
    return distributed.run_joined(cfg, body)


if __name__ == "__main__":
    sys.exit(main())
