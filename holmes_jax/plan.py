"""``python -m holmes_jax.plan``: choose a placement and a layer split, and predict the step.

Examples::

    python -m holmes_jax.plan --config configs/quickstart.yaml --mesh meshes/cpu8-two-islands.yaml
    python -m holmes_jax.plan --config C --mesh M --partition holmes --json
    python -m holmes_jax.plan --config C --mesh M --keep-degrees --png plan.png
    python -m holmes_jax.plan --config C --mesh M --profile runs/probe/profile.json
    python -m holmes_jax.plan --config C --mesh M --failures

Prints the planner's plan (replica/stage/data/tensor degrees, stages per island, layers per
stage, micro-batches), the predicted step time and its breakdown, TFLOP/s per device and
memory per stage, the ``--set`` overrides that train it, and the uniform, holmes and
optimal splits of that placement side by side. ``--keep-degrees`` plans the config's own
degrees instead and prints the step the trainer prints for them. ``--json`` prints one
machine-readable object; ``--png`` draws the pipeline schedule as a timeline per stage
and the topology with its islands and links (needs matplotlib). ``--failures`` plans ahead
for the survivors of the loss of one host of each island and of each whole island, one row
each, with the ``--set`` overrides that run them; the trainer computes the same plan itself
when a restart names the lost hosts in ``parallel.exclude_hosts``.
Errors in the config, topology or profile print one line to stderr and exit with code 2.
The work is done by :mod:`holmes_jax.planner` (``plans``, ``report``, ``draw``) on the
config converted once (:func:`holmes_jax.core.plan_request.plan_request`); this module only
parses and prints.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence

from holmes_jax.core.errors import ConfigError, one_line, run_cli
from holmes_jax.core.plan_request import PlanRequest, plan_request
from holmes_jax.planner.draw import draw_plan
from holmes_jax.planner.failures import failure_plans, full_step
from holmes_jax.planner.grid import describe_grid
from holmes_jax.planner.plans import alternatives, as_trained, make_plan
from holmes_jax.planner.report import failures_json, format_failures, format_plan, plan_json
from holmes_jax.planner.search import METHODS
from holmes_jax.planner.strategy import price_strategies
from holmes_jax.planner.topology import Topology, load_topology


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    return run_cli(_run, _parser().parse_args(argv))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m holmes_jax.plan", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--config", required=True, help="run config (configs/*.yaml)")
    ap.add_argument("--mesh", help="topology (meshes/*.yaml); default: parallel.mesh")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, e.g. model.num_layers=24 (repeatable)",
    )
    ap.add_argument(
        "--partition",
        choices=METHODS,
        help="how layers are split over stages (default: optimal)",
    )
    ap.add_argument("--profile", help="measured profile (JSON) overriding topology numbers")
    ap.add_argument(
        "--keep-degrees",
        action="store_true",
        help="keep the config's replica/stages/data/tensor/microbatches/schedule; only split",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--png", help="draw the schedule timeline and the topology to this file")
    ap.add_argument(
        "--show-mesh",
        action="store_true",
        help="print the device grid with each device's host and island",
    )
    ap.add_argument(
        "--failures",
        action="store_true",
        help="the survivors' plan after losing one host of each island or a whole island, "
        "computed ahead like Oobleck's templates (the trainer computes the same plan itself "
        "when a restart sets parallel.exclude_hosts)",
    )
    return ap


# What --failures cannot be combined with, and why: its rows are what the trainer runs.
_NOT_WITH_FAILURES = {
    "keep_degrees": ("--keep-degrees", "the survivors' degrees are always planned again"),
    "png": ("--png", "it draws one plan and --failures prints several"),
    "show_mesh": ("--show-mesh", "it shows one mesh and --failures plans several"),
    "partition": ("--partition", "the trainer splits the survivors' layers optimally"),
    "profile": ("--profile", "the trainer plans the survivors from the topology file alone"),
}


def _run(args: argparse.Namespace) -> int:
    from holmes_jax.core.config import load_config

    if args.failures:
        for attr, (flag, why) in _NOT_WITH_FAILURES.items():
            if getattr(args, attr):
                raise ConfigError(f"--failures with {flag}: they do not combine ({why})")
    cfg = load_config(args.config, args.set)
    req = plan_request(cfg)
    mesh = args.mesh or cfg.parallel.mesh
    if not mesh:
        raise ConfigError("--mesh=None: a topology is needed (--mesh or parallel.mesh)")
    topology = load_topology(mesh)
    if args.show_mesh:
        print(describe_grid(req, topology))
        return 0
    if args.failures:
        return _failures(args, req, topology)
    calibration = None
    if args.profile:
        from holmes_jax.planner.profiles import load_profile

        topology, calibration = load_profile(args.profile, topology)
    partition = args.partition or "optimal"
    searched = make_plan(req, topology, partition, calibration, args.keep_degrees)
    alts = alternatives(req, topology, searched, calibration)
    choice = price_strategies(req, topology, partition, calibration, searched)
    plan = as_trained(req, topology, searched, calibration)
    kept = args.keep_degrees
    if args.png:
        try:
            draw_plan(plan, topology, args.png)
        except OSError as e:  # a missing folder, no permission
            raise ConfigError(f"--png '{args.png}': cannot be written ({one_line(e)})") from None
    if args.json:
        print(json.dumps(plan_json(plan, topology, alts, req, choice, kept=kept)))
    else:
        command = _train_command(args)
        print(format_plan(plan, topology, alts, req, choice, kept=kept, command=command))
        if args.png:
            print(f"wrote {args.png}")
    return 0


def _failures(args: argparse.Namespace, req: PlanRequest, topology: Topology) -> int:
    """``--failures``: the survivors' plan of each failure, as text or JSON."""
    plans = failure_plans(req, topology)
    try:
        full_s, why = full_step(req, topology), ""
    except ConfigError as e:
        full_s, why = None, str(e)
    if args.json:
        print(json.dumps(failures_json(plans, topology, full_s, why)))
    else:
        print(format_failures(plans, topology, full_s, why, command=_train_command(args)))
    return 0


def _train_command(args: argparse.Namespace) -> str:
    """The train command of this config, mesh and overrides (the ``--set``s that run a plan
    are added after it)."""
    command = f"python -m holmes_jax.train --config {shlex.quote(args.config)}"
    if args.mesh:
        command += f" --mesh {shlex.quote(args.mesh)}"
    return command + "".join(f" --set {shlex.quote(o)}" for o in args.set)


if __name__ == "__main__":
    sys.exit(main())
