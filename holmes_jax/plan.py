"""``python -m holmes_jax.plan``: choose a placement and a layer split, and predict the step.

Examples::

    python -m holmes_jax.plan --config configs/quickstart.yaml --mesh meshes/cpu8-two-islands.yaml
    python -m holmes_jax.plan --config C --mesh M --partition holmes --json
    python -m holmes_jax.plan --config C --mesh M --keep-degrees --png plan.png
    python -m holmes_jax.plan --config C --mesh M --profile runs/probe/profile.json

Prints the chosen plan (replica/stage/data/tensor degrees, stages per island, layers per
stage, micro-batches), the predicted step time and its breakdown, TFLOP/s per device and
memory per stage, with the uniform, holmes and optimal splits of that placement side by
side. ``--json`` prints one machine-readable object; ``--png`` draws the pipeline schedule
as a timeline per stage and the topology with its islands and links (needs matplotlib).
Errors in the config, topology or profile print one line to stderr and exit with code 2.
The functions here (``specs_from_config``, ``make_plan``) also serve the trainer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from holmes_jax.config import REMAT_POLICIES
from holmes_jax.cost import Layout, ModelSpec, RunSpec, memory_inputs
from holmes_jax.errors import ConfigError, run_cli
from holmes_jax.memory import MemoryInputs
from holmes_jax.partition import (
    METHODS,
    Plan,
    best_policy_plan,
    plan_for_layout,
    search_plan,
)
from holmes_jax.placement import Calibration, stage_blocks
from holmes_jax.topology import Topology, load_topology, single_host_topology

_BYTES = {"fp32": (4, 4, 4, 8), "bf16": (2, 2, 4, 12)}  # act, param, grad, optimizer


def specs_from_config(cfg: Any, attention: str = "xla") -> tuple[ModelSpec, RunSpec]:
    """The cost model's view of a :class:`holmes_jax.config.Config`.

    Precision sets the byte sizes (fp32: 4-byte everything, Adam m and v; bf16: 2-byte
    weights and activations, fp32 gradients, fp32 master + Adam); ``model.remat`` is the
    activation policy (``auto``: priced as none, the planner searches);
    ``optimizer.zero1`` shards the optimizer state over ``data``. ``attention`` is the
    resolved kernel (:func:`holmes_jax.model.attention_kernel`).
    """
    m = cfg.model
    model = ModelSpec(
        m.num_layers,
        m.hidden_size,
        m.num_heads,
        m.seq_len,
        m.vocab_size,
        m.mlp_ratio,
        m.tied_embeddings,
    )
    act, param, grad, opt = _BYTES.get(getattr(cfg.train, "precision", "fp32"), _BYTES["fp32"])
    run = RunSpec(
        cfg.train.global_batch_size,
        act,
        param,
        grad,
        opt,
        remat=m.remat if m.remat != "auto" else "none",  # auto: the planner searches
        attention=attention,
        zero1=cfg.optimizer.zero1,
    )
    return model, run


def memory_inputs_from_config(cfg: Any, data: int, attention: str = "xla") -> MemoryInputs:
    """The memory model's inputs for ``cfg`` at data-parallel degree ``data``.

    Raises:
      ConfigError: a global batch that does not split into the micro-batches.
    """
    model, run = specs_from_config(cfg, attention)
    p = cfg.parallel
    layout = Layout(p.stages, data, p.tensor, p.microbatches, p.schedule, p.replica)
    return memory_inputs(model, run, layout, layout.microbatch_size(run.global_batch_size))


def make_plan(
    cfg: Any,
    topology: Topology,
    method: str = "optimal",
    calibration: Calibration | None = None,
    keep_degrees: bool = False,
) -> Plan:
    """Plan a config on a topology: search everything, or keep the config's degrees.

    Args:
      cfg: a :class:`holmes_jax.config.Config`.
      topology: the cluster.
      method: ``uniform`` | ``holmes`` | ``optimal`` split.
      calibration: device speed (e.g. from a profile).
      keep_degrees: use ``parallel.stages/data/tensor/microbatches`` (``data: 0`` = the
        remaining devices) and only choose the split.

    Raises:
      ConfigError: impossible degrees for the topology or nothing fits in memory.
    """
    model, run = specs_from_config(cfg)
    par = cfg.parallel
    if not keep_degrees:  # everything open: degrees, micro-batches, activation policy
        return search_plan(
            topology,
            model,
            run,
            method=method,
            schedule=par.schedule,
            calibration=calibration,
            remats=REMAT_POLICIES,
        )
    per = par.stages * par.tensor
    data = par.data or topology.num_devices // per
    layout = Layout(par.stages, data, par.tensor, par.microbatches, par.schedule)
    if cfg.model.remat == "auto":
        return best_policy_plan(topology, model, run, layout, method, calibration)
    return plan_for_layout(topology, model, run, layout, method, calibration)


def resolve_auto(cfg: Any, shape: Any, topology: Topology | None) -> Any:
    """Resolve what the config leaves to the planner, for the trainer.

    - ``model.remat: auto``: the fastest activation policy that fits under the config's
      degrees and micro-batches (:func:`holmes_jax.partition.best_policy_plan`).
    - ``parallel.layers_per_stage: auto``: the optimal split under those degrees; unset
      means an even split.

    Both on the topology (one simulated host when none is named).

    Args:
      cfg: a :class:`holmes_jax.config.Config`.
      shape: the resolved :class:`holmes_jax.config.MeshShape`.
      topology: the cluster, or None.

    Returns:
      ``cfg`` with a concrete ``model.remat`` and ``parallel.layers_per_stage`` tuple.

    Raises:
      ConfigError: nothing fits in memory (see :func:`holmes_jax.partition.plan_for_layout`).
    """
    par = cfg.parallel
    lps, remat = par.layers_per_stage, cfg.model.remat
    L, S = cfg.model.num_layers, shape.stages
    if isinstance(lps, tuple):
        method = list(lps)
    elif lps == "auto" and S > 1:
        method = "optimal"
    else:  # unset (or one stage): an even split
        base, extra = divmod(L, S)
        method = [base + (s < extra) for s in range(S)]
    if remat != "auto" and not isinstance(method, str):  # nothing left to plan
        return dataclasses.replace(
            cfg, parallel=dataclasses.replace(par, layers_per_stage=tuple(method))
        )
    model, run = specs_from_config(cfg)
    topo = topology or single_host_topology(shape.num_devices)
    layout = Layout(S, shape.data, shape.tensor, par.microbatches, par.schedule, shape.replica)
    if remat == "auto":
        plan = best_policy_plan(topo, model, run, layout, method, None)
        remat = plan.remat
    else:
        plan = plan_for_layout(topo, model, run, layout, method, None)
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, remat=remat),
        parallel=dataclasses.replace(par, layers_per_stage=tuple(plan.layers_per_stage)),
    )


def alternatives(
    cfg: Any, topology: Topology, plan: Plan, calibration: Calibration | None = None
) -> dict[str, Plan | None]:
    """The uniform, holmes and optimal splits of the plan's placement and activation
    policy (None: no fit)."""
    model, run = specs_from_config(cfg)
    run = dataclasses.replace(run, remat=plan.remat)
    out: dict[str, Plan | None] = {}
    for method in METHODS:
        try:
            out[method] = plan_for_layout(topology, model, run, plan.layout, method, calibration)
        except ConfigError:
            out[method] = None
    return out


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
        default="optimal",
        help="how layers are split over stages (default: optimal)",
    )
    ap.add_argument("--profile", help="measured profile (JSON) overriding topology numbers")
    ap.add_argument(
        "--keep-degrees",
        action="store_true",
        help="keep the config's stages/data/tensor/microbatches; only split",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--png", help="draw the schedule timeline and the topology to this file")
    ap.add_argument(
        "--show-mesh",
        action="store_true",
        help="print the device grid with each device's host and island",
    )
    return ap


def _run(args: argparse.Namespace) -> int:
    from holmes_jax.config import load_config

    cfg = load_config(args.config, args.set)
    mesh = args.mesh or cfg.parallel.mesh
    if not mesh:
        raise ConfigError("--mesh=None: a topology is needed (--mesh or parallel.mesh)")
    topology = load_topology(mesh)
    if args.show_mesh:
        from holmes_jax.mesh import describe  # needs jax: imported only here

        print(describe(cfg, topology))
        return 0
    calibration = None
    if args.profile:
        from holmes_jax.profile import load_profile

        topology, calibration = load_profile(args.profile, topology)
    plan = make_plan(cfg, topology, args.partition, calibration, args.keep_degrees)
    alts = alternatives(cfg, topology, plan, calibration)
    if args.png:
        draw_plan(plan, topology, args.png)
    if args.json:
        print(json.dumps(plan_json(plan, topology, alts, cfg)))
    else:
        print(format_plan(plan, topology, alts, cfg))
        if args.png:
            print(f"wrote {args.png}")
    return 0


def plan_json(plan: Plan, topology: Topology, alts: dict[str, Plan | None], cfg: Any) -> dict:
    """The plan as one JSON-ready object, with the alternative splits."""
    model, run = specs_from_config(cfg)
    out = plan.to_dict()
    out["topology"] = topology.name
    out["num_devices"] = topology.num_devices
    out["model_params"] = model.num_params
    out["global_batch_size"] = run.global_batch_size
    out["alternatives"] = {
        k: None
        if p is None
        else {
            "layers_per_stage": list(p.layers_per_stage),
            "predicted_step_s": p.predicted_step_s,
            "tflops_per_device": p.tflops_per_device,
            "fits_in_memory": p.prediction.fits,
        }
        for k, p in alts.items()
    }
    return out


def format_plan(plan: Plan, topology: Topology, alts: dict[str, Plan | None], cfg: Any) -> str:
    """Human-readable report."""
    model, run = specs_from_config(cfg)
    lay, pr = plan.layout, plan.prediction
    lines = [
        f"topology {topology.name}: {len(topology.islands)} islands, "
        f"{topology.num_hosts} hosts, {topology.num_devices} devices"
    ]
    for isl in topology.islands:
        lines.append(
            f"  {isl.name:<10} {isl.nic:<10} {isl.link.bandwidth_gbps:g} Gbit/s/host  "
            f"{isl.num_hosts} hosts x {isl.devices_per_host} {isl.device_kind} "
            f"({isl.peak_tflops:g} TFLOP/s, {isl.memory_gb:g} GB)"
        )
    if topology.inter_island_default is not None:
        link = topology.inter_island_default
        extra = "".join(
            f"; {a}-{b} {lk.bandwidth_gbps:g} Gbit/s"
            for a, b, lk in topology.inter_island_overrides
        )
        lines.append(
            f"  between islands: {link.bandwidth_gbps:g} Gbit/s/host, {link.latency_us:g} us{extra}"
        )
    lines.append(
        f"model: {model.num_layers} layers, hidden {model.hidden_size}, {model.num_heads} heads, "
        f"seq {model.seq_len}, vocab {model.vocab_size} ({model.num_params / 1e6:.2f}M "
        f"params); global batch {run.global_batch_size}"
    )
    lines.append(
        f"plan ({plan.method}): replica {lay.replica} x stage {lay.stages} x data {lay.data} "
        f"x tensor {lay.tensor}; {lay.microbatches} micro-batches of {plan.microbatch_size}, "
        f"{lay.schedule}, remat {plan.remat}"
    )
    per_island = " ".join(
        f"{isl.name}={n}" for isl, n in zip(topology.islands, plan.stages_per_island, strict=True)
    )
    lines.append(f"  stages per island: {per_island}")
    lines.append("  stage  island      layers   fwd ms   bwd ms   memory GB (limit)")
    for s, n in enumerate(plan.layers_per_stage):
        lines.append(
            f"  {s:<6} {plan.stage_islands[s]:<11} {n:<8} {pr.stage_fwd_s[s] * 1e3:<8.2f} "
            f"{pr.stage_bwd_s[s] * 1e3:<8.2f} {pr.memory_gb[s]:.2f} ({pr.memory_limit_gb[s]:.1f})"
        )
    lines.append(
        f"predicted step {pr.step_s:.4g} s: {pr.samples_per_s:.4g} samples/s, "
        f"{pr.tflops_per_device:.4g} TFLOP/s per device (model FLOPs "
        f"{pr.model_tflops_per_device:.4g})"
    )
    lines.append("  " + "  ".join(f"{k} {v:.4g}" for k, v in pr.breakdown.items()))
    lines.append("splits of this placement:")
    lines.append("  method    step s      TFLOP/s/dev  fits  layers per stage")
    for name, p in alts.items():
        if p is None:
            lines.append(f"  {name:<9} (no split fits in memory)")
            continue
        lines.append(
            f"  {name:<9} {p.predicted_step_s:<11.4g} {p.tflops_per_device:<12.4g} "
            f"{'yes' if p.prediction.fits else 'NO':<5} {list(p.layers_per_stage)}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- drawing


def simulate_schedule(
    fwd: Sequence[float], bwd: Sequence[float], microbatches: int, schedule: str = "1f1b"
) -> list[tuple[int, str, int, float, float]]:
    """Event-driven run of a GPipe or 1F1B pipeline.

    Args:
      fwd, bwd: per-stage time of one micro-batch's forward and backward.
      microbatches: m.
      schedule: ``gpipe`` (all forwards, then backwards in reverse) or ``1f1b`` (stage s
        runs p−s−1 warm-up forwards, then alternates one forward and one backward).

    Returns:
      Events ``(stage, "F" | "B", microbatch, start, end)``; the last end is the makespan
      (``Σ τ + (m−1)·max τ`` for equal stages).
    """
    p, m = len(fwd), microbatches
    orders = []
    for s in range(p):
        if schedule == "gpipe":
            ops = [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]
        else:
            warm = min(p - s - 1, m)
            ops = [("F", i) for i in range(warm)]
            for i in range(m - warm):
                ops += [("F", warm + i), ("B", i)]
            ops += [("B", i) for i in range(m - warm, m)]
        orders.append(ops)
    done: dict[tuple[int, str, int], float] = {}
    free, nxt, events = [0.0] * p, [0] * p, []
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while nxt[s] < len(orders[s]):
                kind, i = orders[s][nxt[s]]
                dep = (s - 1, "F", i) if kind == "F" else (s + 1, "B", i)
                if kind == "B" and s == p - 1:
                    dep = (s, "F", i)
                if (kind == "F" and s == 0) or dep in done:
                    start = max(free[s], done.get(dep, 0.0))
                    end = start + (fwd[s] if kind == "F" else bwd[s])
                    done[(s, kind, i)] = free[s] = end
                    events.append((s, kind, i, start, end))
                    nxt[s] += 1
                    progress = True
                else:
                    break
    return events


def draw_plan(plan: Plan, topology: Topology, path: str) -> None:
    """Draw the pipeline timeline per stage and the topology to a PNG file.

    Raises:
      ConfigError: matplotlib is not installed.
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
    except ImportError:
        raise ConfigError(
            f"--png {path}: needs matplotlib (pip install 'holmes_jax[plot]')"
        ) from None
    pr, lay = plan.prediction, plan.layout
    fig = Figure(figsize=(12, 4 + 0.35 * lay.stages))
    ax, topo_ax = fig.subplots(2, 1, height_ratios=[max(2, lay.stages), 3])
    colors = {"F": "#4C72B0", "B": "#DD8452"}
    events = simulate_schedule(pr.stage_fwd_s, pr.stage_bwd_s, lay.microbatches, lay.schedule)
    end = max(e[4] for e in events)
    for s, kind, _, start, stop in events:
        ax.broken_barh(
            [(start, stop - start)], (s - 0.4, 0.8), color=colors[kind], lw=0.3, edgecolor="white"
        )
    tail = pr.breakdown["grad_sync"] + pr.breakdown["optimizer"]
    ax.broken_barh([(end, tail)], (-0.5, lay.stages), color="#BBBBBB")
    ax.set_yticks(range(lay.stages))
    ax.set_yticklabels(
        [f"{s}: {plan.stage_islands[s]} ({n}L)" for s, n in enumerate(plan.layers_per_stage)]
    )
    ax.invert_yaxis()
    ax.set_xlabel("seconds (blue forward, orange backward, grey gradient sync + optimizer)")
    ax.set_title(
        f"{plan.method} plan: replica {lay.replica} x stage {lay.stages} x data "
        f"{lay.data} x tensor {lay.tensor}, {lay.microbatches} micro-batches, "
        f"{lay.schedule}; predicted step {pr.step_s:.3g} s"
    )
    nic_color = {"infiniband": "#55A868", "roce": "#8172B2", "ethernet": "#C44E52"}
    width = 1.0 / len(topology.islands)
    hosts: dict[tuple[int, int], list[int]] = {}  # (island, host) -> stages (replica 0)
    k = lay.data * lay.tensor
    for s, (i, off) in enumerate(stage_blocks(topology, lay)[0]):
        per_host = topology.islands[i].devices_per_host
        for h in sorted({d // per_host for d in range(off, off + k)}):
            hosts.setdefault((i, h), []).append(s)
    for i, isl in enumerate(topology.islands):
        x0 = i * width + 0.02
        topo_ax.add_patch(
            Rectangle((x0, 0.1), width - 0.04, 0.75, fill=False, lw=2, edgecolor=nic_color[isl.nic])
        )
        topo_ax.text(
            x0 + 0.01,
            0.78,
            f"{isl.name} ({isl.nic}, "
            f"{isl.link.bandwidth_gbps:g} Gbit/s/host), stages: "
            f"{plan.stages_per_island[i]}",
            fontsize=8,
            va="top",
        )
        hw = (width - 0.06) / max(isl.num_hosts, 1)
        for h in range(isl.num_hosts):
            topo_ax.add_patch(
                Rectangle(
                    (x0 + 0.01 + h * hw, 0.2), hw * 0.85, 0.35, color=nic_color[isl.nic], alpha=0.3
                )
            )
            if isl.num_hosts <= 8:
                label = isl.hosts[h] + "".join(f"\nstage {s}" for s in hosts.get((i, h), []))
                topo_ax.text(
                    x0 + 0.01 + (h + 0.42) * hw, 0.37, label, ha="center", va="center", fontsize=7
                )
        if i + 1 < len(topology.islands):
            link = topology.inter_island(isl.name, topology.islands[i + 1].name)
            xe = (i + 1) * width
            topo_ax.annotate(
                "",
                (xe + 0.02, 0.45),
                (xe - 0.02, 0.45),
                arrowprops={"arrowstyle": "<->", "lw": 1.5},
            )
            topo_ax.text(xe, 0.05, f"{link.bandwidth_gbps:g} Gbit/s", ha="center", fontsize=8)
    topo_ax.set_xlim(0, 1)
    topo_ax.set_ylim(0, 0.9)
    topo_ax.axis("off")
    topo_ax.set_title(f"topology {topology.name}: hosts per island (shaded), links", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
