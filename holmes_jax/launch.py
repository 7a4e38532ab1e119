"""``python -m holmes_jax.launch``: one training process per host of a topology, locally.

The entry point: it parses the command line and calls
:func:`holmes_jax.cluster.local_launch.launch`, which does the work (see there).

    python -m holmes_jax.launch --mesh meshes/cpu8-two-islands.yaml -- \\
        --config configs/quickstart.yaml --set parallel.stages=2 --set train.steps=20
    python -m holmes_jax.launch --mesh meshes/emu-4host-2island.yaml --emulate [--scale 1] \\
        [--cpu-quota auto|on|off] [--no-latency] -- ...
    python -m holmes_jax.launch --verbose --mesh ...   # with gloo's and jax's own chatter
    python -m holmes_jax.launch --max-restarts 3 --fail-host roce-0@20:+30 --mesh ... -- ...
    sudo python -m holmes_jax.launch --emulate --independent-islands --cut-islands 40:+30 \
        --mesh meshes/emu-4host-2island-slow.yaml -- ...
    sudo python -m holmes_jax.launch --mesh meshes/emu-4host-2island.yaml --emulate \\
        --program probe -- --set train.global_batch_size=8 --out runs/probe/emu.json
    python -m holmes_jax.launch --print-env --mesh meshes/paper-ib-roce-4x8.yaml --host roce-0
    python -m holmes_jax.launch --cleanup
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from holmes_jax.cluster.launcher import DEFAULT_GRACE_S, PROGRAMS
from holmes_jax.cluster.local_launch import launch
from holmes_jax.cluster.supervisor import DEFAULT_MAX_RESTARTS, DEFAULT_REJOIN_S, RESTART_GRACE_S
from holmes_jax.cluster.transport import format_exports, host_environment
from holmes_jax.core.errors import ConfigError
from holmes_jax.planner.topology import load_topology


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """Split ``argv`` at ``--`` into launcher options and train arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, train_args = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m holmes_jax.launch",
        description="One holmes_jax.train process per topology host on this machine.",
        epilog="Arguments after '--' go to python -m holmes_jax.train (or .probe).",
    )
    parser.add_argument("--mesh", help="topology file (meshes/*.yaml)")
    parser.add_argument(
        "--emulate", action="store_true", help="a shaped network namespace per host (root)"
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply every emulated link rate (default 1)"
    )
    parser.add_argument(
        "--cpu-quota",
        choices=("auto", "on", "off"),
        default="auto",
        help="with --emulate: a CPU quota per host in proportion to its island's peak_tflops "
        "(auto: when the islands differ and cgroup v1 cpu exists; default auto)",
    )
    parser.add_argument(
        "--no-latency",
        action="store_true",
        help="with --emulate: do not delay packets between islands by the topology's latency",
    )
    parser.add_argument(
        "--program",
        choices=sorted(PROGRAMS),
        default="train",
        help="what each process runs: holmes_jax.train (default) or holmes_jax.probe",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE_S,
        help=f"seconds the others get after a failure (default {DEFAULT_GRACE_S:g}; at most "
        f"{RESTART_GRACE_S:g} when a restart follows)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=DEFAULT_MAX_RESTARTS,
        help="restart every worker from the newest checkpoint after a failure, up to N times "
        f"(default {DEFAULT_MAX_RESTARTS}; 0 = none; exit code 2 is never retried)",
    )
    parser.add_argument(
        "--fail-host",
        action="append",
        default=[],
        metavar="HOST@STEP[:permanent|:+SECONDS|:nan|:abstain]",
        help="fault injection: SIGKILL HOST's worker when the job reaches STEP; permanent: "
        "it never comes back; +SECONDS: it comes back after that long; nan: no kill, step "
        "STEP of the job holding HOST is non-finite instead; abstain: no kill, the island "
        "holding HOST sends nothing in the round after STEP (repeatable)",
    )
    parser.add_argument(
        "--rejoin-timeout",
        type=float,
        default=DEFAULT_REJOIN_S,
        metavar="SECONDS",
        help="before a restart, wait this long for a host that is away; then the others go "
        f"on without it, re-planned for the survivors (default {DEFAULT_REJOIN_S:g})",
    )
    parser.add_argument(
        "--replan-candidates",
        type=int,
        default=None,
        metavar="K",
        help="when survivors re-plan, try the planner's K fastest predicted plans for a few "
        "steps each and train on the fastest measured (sets parallel.replan_candidates; "
        "default 2, 1: trust the prediction)",
    )
    parser.add_argument(
        "--warm-failures",
        action="store_true",
        help="before training, compile and time the survivors' candidate plans of every "
        "one-host and one-island failure (train --compile-only --measure), so a re-plan "
        "loads the fastest measured without a trial, and a host's loss drops its island "
        "when that measured faster",
    )
    parser.add_argument(
        "--independent-islands",
        action="store_true",
        help="one job per island, supervised on its own, as independent DiLoCo islands "
        "(sets diloco.mode=independent, diloco.island and diloco.peers for each)",
    )
    parser.add_argument(
        "--cut-islands",
        metavar="STEP:+SECONDS",
        help="with --emulate, fault injection: once any job reaches STEP, drop every packet "
        "between islands, both ways, for SECONDS, then restore the links",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also show library chatter (gloo's connection reports, jax's error echoes)",
    )
    parser.add_argument(
        "--print-env", action="store_true", help="print --host's transport profile and exit"
    )
    parser.add_argument("--host", help="with --print-env: the host")
    parser.add_argument(
        "--cleanup", action="store_true", help="remove namespaces a killed launcher left"
    )
    return parser.parse_args(argv), train_args


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    args, train_args = parse_args(argv)
    try:
        if args.cleanup:
            from holmes_jax.cluster import netns

            netns.check_privileges("--cleanup")
            from holmes_jax.cluster import cgroups

            removed = netns.remove_stale() + cgroups.remove_stale()
            print(
                f"removed {len(removed)} namespaces and cpu groups"
                + (f": {' '.join(removed)}" if removed else "")
            )
            return 0
        if not args.mesh:
            raise ConfigError("--mesh=None: a topology file is required")
        if args.print_env:
            if not args.host:
                raise ConfigError("--host=None: --print-env needs the host to print")
            topology = load_topology(args.mesh)
            print(format_exports(host_environment(topology, args.host)))
            return 0
        if args.host:
            raise ConfigError(f"--host={args.host}: only used with --print-env")
        if args.scale != 1.0 and not args.emulate:
            raise ConfigError(f"--scale={args.scale}: only used with --emulate")
        if not args.emulate and (args.cpu_quota != "auto" or args.no_latency):
            flag = "--no-latency" if args.no_latency else f"--cpu-quota={args.cpu_quota}"
            raise ConfigError(f"{flag}: only used with --emulate")
        if args.grace < 0:
            raise ConfigError(f"--grace={args.grace}: must be >= 0")
        if args.replan_candidates is not None:
            if args.replan_candidates < 1:
                raise ConfigError(f"--replan-candidates={args.replan_candidates}: must be >= 1")
            train_args = [
                *train_args,
                "--set",
                f"parallel.replan_candidates={args.replan_candidates}",
            ]
        if not train_args:
            load_topology(args.mesh)  # a bad --mesh is the first thing to fix
            raise ConfigError(
                f"--config=None: a config is required after '--' (python -m holmes_jax.launch "
                f"--mesh {args.mesh} -- --config configs/quickstart.yaml)"
            )
        return launch(
            args.mesh,
            train_args,
            emulate=args.emulate,
            scale=args.scale,
            grace_s=args.grace,
            program=args.program,
            verbose=args.verbose,
            max_restarts=args.max_restarts,
            fail_hosts=args.fail_host,
            rejoin_timeout_s=args.rejoin_timeout,
            cpu_quota=args.cpu_quota,
            latency=not args.no_latency,
            independent=args.independent_islands,
            cut_islands=args.cut_islands,
            warm_failures=args.warm_failures,
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # an ip/tc command failed while building the network
        print(f"error: --emulate: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
