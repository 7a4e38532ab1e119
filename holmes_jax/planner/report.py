"""A plan as text and as JSON, with the alternative splits of its placement.

What ``python -m holmes_jax.plan`` prints (:func:`format_plan`) and ``--json`` writes
(:func:`plan_json`); with ``--failures``, the survivors' plan of each failure
(:func:`format_failures`, :func:`failures_json`); what the trainer prints before training
(:func:`format_run_plan`: the islands, the mesh, stages per island, layers per stage,
schedule, micro-batches and the predicted step, with what the prediction assumes) and
after it (:func:`format_step_check`: the predicted against the measured median step and
their ratio). Pure Python; no jax import.
"""

from __future__ import annotations

import shlex
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import Degrees, resolve_grad_buckets
from holmes_jax.planner.failures import FailurePlan, survivor_overrides
from holmes_jax.planner.outer_formats import outer_report
from holmes_jax.planner.placement import stage_blocks, stages_per_island
from holmes_jax.planner.plans import (
    as_trained,
    make_plan,
    run_overrides,
    topology_blocks,
)
from holmes_jax.planner.search import Plan
from holmes_jax.planner.step_time import Prediction
from holmes_jax.planner.strategy import StrategyChoice, crossing_bytes_by_format
from holmes_jax.planner.topology import Topology

if TYPE_CHECKING:
    from holmes_jax.core.plan_request import PlanRequest


def plan_json(
    plan: Plan,
    topology: Topology,
    alts: dict[str, Plan | None],
    req: PlanRequest,
    choice: StrategyChoice | None = None,
    *,
    kept: bool = False,
) -> dict:
    """The plan as one JSON-ready object, with the alternative splits and, given
    ``choice``, the cross-island ``strategy`` chosen, why, and the ``strategies`` compared.

    ``keeps_config_degrees`` is ``kept`` (``--keep-degrees``); ``overrides`` are the
    ``--set`` values that make the trainer run ``plan`` (:func:`run_overrides`);
    ``collectives_block`` says how ``predicted_step_s`` priced the collectives
    (:func:`topology_blocks`)."""
    model, run = req.model, req.run
    out = plan.to_dict()
    out["keeps_config_degrees"] = kept
    out["overrides"] = run_overrides(req, topology, plan)
    out["collectives_block"] = topology_blocks(topology)
    out["topology"] = topology.name
    out["num_devices"] = topology.num_devices
    out["model_params"] = model.num_params
    out["global_batch_size"] = run.global_batch_size
    out["cross_island_dtype"] = req.parallel.cross_island_dtype
    # per format: what the plan's pipeline sends across islands each step in each
    out["cross_island_bytes_per_step"] = crossing_bytes_by_format(plan, model, run)
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
    if choice is not None:
        out["strategy"] = choice.chosen
        out["strategy_reason"] = choice.reason
        out["strategies"] = [p.to_dict() for p in choice.prices]
        outer = _outer_formats(req, topology, choice)
        if outer is not None:
            out["diloco_outer_formats"] = outer[1]
    return out


def format_plan(
    plan: Plan,
    topology: Topology,
    alts: dict[str, Plan | None],
    req: PlanRequest,
    choice: StrategyChoice | None = None,
    *,
    kept: bool = False,
    command: str = "python -m holmes_jax.train --config CONFIG",
) -> str:
    """Human-readable report; given ``choice``, the cross-island strategies at the end.

    The plan is labelled as the config's degrees (``kept``) or the planner's choice, and
    followed by ``command`` with the ``--set`` overrides that run it
    (:func:`run_overrides`). ``plan``'s prediction is the trainer's
    (:func:`holmes_jax.planner.plans.as_trained`); the tables keep the searches' pricing.
    """
    model, run = req.model, req.run
    lay, pr = plan.layout, plan.prediction
    lines = _topology_lines(topology)
    lines.append(
        f"model: {model.num_layers} layers, hidden {model.hidden_size}, {model.num_heads} heads, "
        f"seq {model.seq_len}, vocab {model.vocab_size} ({model.num_params / 1e6:.2f}M "
        f"params); global batch {run.global_batch_size}"
    )
    whose = "the config's degrees" if kept else "the planner's choice"
    lines.append(
        f"plan ({whose}, {plan.method} split): replica {lay.replica} x stage {lay.stages} x "
        f"data {lay.data} "
        f"x tensor {lay.tensor}; {lay.microbatches} micro-batches of {plan.microbatch_size}, "
        f"{_schedule_name(lay.schedule, lay.virtual_stages)}, remat {plan.remat}"
    )
    per_island = " ".join(
        f"{isl.name}={n}" for isl, n in zip(topology.islands, plan.stages_per_island, strict=True)
    )
    lines.append(f"  stages per island: {per_island}")
    lines += _stage_table(pr, plan.stage_islands)
    lines.append(
        f"predicted step {pr.step_s:.4g} s: {pr.samples_per_s:.4g} samples/s, "
        f"{pr.tflops_per_device:.4g} TFLOP/s per device (model FLOPs "
        f"{pr.model_tflops_per_device:.4g})"
    )
    lines.append("  " + "  ".join(f"{k} {v:.4g}" for k, v in pr.breakdown.items()))
    lines.append(
        f"  bubble fraction {pr.bubble_fraction:.3f}; p2p per step across each stage "
        f"boundary (all data ranks): {_gb(pr.p2p_bytes)}"
    )
    if topology_blocks(topology):
        lines.append(
            "  priced as the trainer runs it on CPU devices: blocking collectives, the "
            "pipeline's ticks in lockstep (the tables below price the closed form)"
        )
    lines.append("run it: " + run_command(command, run_overrides(req, topology, plan)))
    if plan.by_schedule:
        lines.append("schedules on these degrees:")
        lines.append("  schedule        step s      bubble  layers per stage (per virtual stage)")
        for name, alt in plan.by_schedule.items():
            if alt is None:
                lines.append(f"  {name:<15} (cannot run these degrees or does not fit)")
                continue
            label = _schedule_name(name, alt["virtual_stages"])
            lines.append(
                f"  {label:<15} {alt['predicted_step_s']:<11.4g} "
                f"{alt['bubble_fraction']:<7.3f} {alt['layers_per_stage']}"
            )
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
    if choice is not None:
        lines.extend(format_strategies(choice))
        outer = _outer_formats(req, topology, choice)
        if outer is not None:
            lines.extend(outer[0])
    return "\n".join(lines)


def _outer_formats(req: PlanRequest, topology: Topology, choice: StrategyChoice):
    """The DiLoCo outer formats' table and JSON (:func:`outer_report`) when the planner
    priced DiLoCo, else None."""
    priced = [p for p in choice.prices if p.name == "diloco" and p.plan is not None]
    return outer_report(req, topology) if priced else None


def format_run_plan(
    req: PlanRequest,
    shape: Degrees,
    topology: Topology,
    prediction: Prediction,
    *,
    sync_collectives: bool,
    split: str,
) -> list[str]:
    """The plan the trainer is about to run, as lines for its log.

    Args:
      req: the resolved run (concrete ``parallel.layers_per_stage`` and ``remat``;
        :func:`holmes_jax.planner.plans.resolve_auto`).
      shape: the resolved degrees.
      topology: the cluster the run is placed on.
      prediction: :func:`holmes_jax.planner.plans.predict_run` of ``req`` on ``topology``.
      sync_collectives: what the prediction assumed about collectives (stated in the text).
      split: who chose the layers per stage, e.g. ``"the planner's optimal split
        (parallel.layers_per_stage: auto)"``.

    Returns:
      Lines: the topology, the mesh with the stages per island, the pipeline, the stage
      table, the predicted step with its terms, and what the prediction assumes.
    """
    par = req.parallel
    layout = par.layout(shape)
    mb = layout.microbatch_size(req.run.global_batch_size)
    topo = _topology_lines(topology)
    lines = [f"plan on {topo[0]}", *topo[1:]]
    if par.enforce_islands:
        islands = [topology.islands[i].name for i, _ in stage_blocks(topology, layout)[0]]
        counts = stages_per_island(topology, layout)
        where = "stages per island " + " ".join(
            f"{isl.name}={n}" for isl, n in zip(topology.islands, counts, strict=True)
        )
    else:  # the naive baseline: one stage whose data groups span the islands
        islands = ["all"] * layout.stages
        where = "naive placement (parallel.enforce_islands: false): data groups span islands"
    lines.append(
        f"  mesh replica {layout.replica} x stage {layout.stages} x data {layout.data} x "
        f"tensor {layout.tensor}; {where}"
    )
    buckets = resolve_grad_buckets(req.run.grad_buckets, sync_collectives)
    lines.append(
        f"  pipeline {layout.schedule}, {layout.microbatches} micro-batches of {mb} per data "
        f"rank, remat {par.remat}, gradient buckets per {buckets}; layers per stage "
        f"{list(par.layers_per_stage)}: {split}"
    )
    lines += _stage_table(prediction, islands)
    terms = ", ".join(f"{k} {v:.3g}" for k, v in prediction.breakdown.items() if v)
    lines.append(f"  predicted step {prediction.step_s:.3g} s ({terms})")
    collectives = (
        "collectives that block the device (CPU runtimes)"
        if sync_collectives
        else "collectives overlapping compute (GPU runtimes)"
    )
    lines.append(
        f"  the prediction assumes the topology's device speeds and links (no measured "
        f"profile) and {collectives}; it leaves out host work (batches, logging)"
    )
    return lines


def failures_json(
    plans: Sequence[FailurePlan], topology: Topology, full_step_s: float | None, why: str = ""
) -> dict:
    """``--failures --json``: the whole topology's predicted step (``full_step_s``; None,
    with ``full_why``, when the config's own degrees do not run there) and one
    :meth:`FailurePlan.to_dict` per failure under ``failures``."""
    out = {
        "topology": topology.name,
        "hosts": topology.num_hosts,
        "devices": topology.num_devices,
        "collectives_block": topology_blocks(topology),
        "full_step_s": full_step_s,
    }
    if full_step_s is None:
        out["full_why"] = why
    out["failures"] = [p.to_dict() for p in plans]
    return out


def format_failures(
    plans: Sequence[FailurePlan],
    topology: Topology,
    full_step_s: float | None,
    why: str = "",
    *,
    command: str = "python -m holmes_jax.train --config CONFIG",
) -> str:
    """``--failures`` as text: the whole topology's step, one row per failure (what is
    lost, the hosts and devices left, the survivors' degrees, micro-batches, schedule,
    remat, predicted step and its ratio to the whole topology's, how much slower the next
    candidate is predicted (``parallel.replan_candidates``: close candidates are where the
    trainer's trial decides), or why there is no plan), then ``command`` with the ``--set``
    overrides that run each plan by hand."""
    hosts = f"{topology.num_hosts} host" + ("s" if topology.num_hosts > 1 else "")
    head = f"topology {topology.name}: {hosts}, {topology.num_devices} devices"
    if full_step_s is None:
        lines = [f"{head}; the config as written does not run on it ({why})"]
    else:
        lines = [f"{head}; the config as written: predicted step {full_step_s:.3g} s"]
    if not plans:
        lines.append("no failure leaves survivors: the topology has one host")
        return "\n".join(lines)
    labels = [failure_label(p) for p in plans]
    width = max(len("lost"), *(len(label) for label in labels))
    lines.append(
        "survivors' plans (a restart with the lost hosts in parallel.exclude_hosts plans the same):"
    )
    lines.append(
        f"  {'lost':<{width}}  hosts  devices  replica  stage  data  tensor  micro-batches  "
        "schedule        remat      step s  vs full  next"
    )
    for label, p in zip(labels, plans, strict=True):
        left = f"  {label:<{width}}  {p.survivors.num_hosts:<5}  {p.survivors.num_devices:<7}"
        if p.replan is None:
            lines.append(f"{left}  no plan: {p.why}")
            continue
        r = p.replan
        lay = r.plan.layout
        schedule = _schedule_name(lay.schedule, lay.virtual_stages) if lay.stages > 1 else "-"
        relative = f"{r.step_s / r.full_step_s:.2f}x" if r.full_step_s else "-"
        spread = r.spread()
        after = "-" if spread is None else f"+{100 * spread:.1f}%"
        lines.append(
            f"{left}  {lay.replica:<7}  {lay.stages:<5}  {lay.data:<4}  {lay.tensor:<6}  "
            f"{lay.microbatches:<13}  {schedule:<14}  {r.plan.remat:<9}  {r.step_s:<6.3g}  "
            f"{relative:<7}  {after}"
        )
    runnable = [(label, p.replan) for label, p in zip(labels, plans, strict=True) if p.replan]
    if runnable:
        lines.append("run one by hand:")
        for label, r in runnable:
            lines.append(f"  {label}: " + run_command(command, survivor_overrides(r)))
    return "\n".join(lines)


def failure_label(plan: FailurePlan) -> str:
    """What a failure loses: ``one host of ib (ib-0)`` or ``island roce (roce-0, roce-1)``."""
    hosts = ", ".join(plan.excluded)
    if plan.what == "host":
        return f"one host of {plan.island} ({hosts})"
    return f"island {plan.island} ({hosts})"


def run_command(command: str, overrides: Sequence[str]) -> str:
    """``command`` followed by one ``--set`` per override, quoted for a POSIX shell."""
    return " ".join([command, *(f"--set {shlex.quote(o)}" for o in overrides)])


def format_preference(
    req: PlanRequest, topology: Topology, step_s: float, *, sync_collectives: bool
) -> list[str]:
    """A line for the trainer's log when the planner's own plan is predicted faster.

    Args:
      req: the resolved run the trainer runs.
      topology: the cluster.
      step_s: the run's predicted step (:func:`holmes_jax.planner.plans.predict_run`).
      sync_collectives: what that prediction assumed about collectives.

    Returns:
      One line with the planner's degrees, its predicted step priced the same way, and the
      ``--set`` overrides that run it; nothing when the run is the planner's plan, is as
      fast, nothing fits, or DiLoCo is on (the synchronous search does not price it).
    """
    if req.diloco.enabled is True:
        return []
    try:
        best = as_trained(
            req, topology, make_plan(req, topology), sync_collectives=sync_collectives
        )
    except ConfigError:
        return []
    overrides = run_overrides(req, topology, best)
    if not overrides or best.predicted_step_s >= step_s:
        return []
    lay = best.layout
    return [
        f"  the planner prefers replica {lay.replica} x stage {lay.stages} x data {lay.data} "
        f"x tensor {lay.tensor}, {_schedule_name(lay.schedule, lay.virtual_stages)}, "
        f"{lay.microbatches} micro-batches, remat {best.remat} (predicted "
        f"{best.predicted_step_s:.3g} s): "
        + run_command("add", overrides)
        + " (python -m holmes_jax.plan compares the two)"
    ]


def format_step_check(predicted_s: float, measured_s: list[float]) -> str:
    """One line: the predicted step against the median of the measured ones.

    Args:
      predicted_s: the predicted step time.
      measured_s: measured step times, the compiling first step already left out (the
        trainer's logging windows: each the mean step of the steps since the last log).
    """
    if not measured_s:
        return (
            f"step time: predicted {predicted_s:.3g} s; nothing measured (only the "
            f"compiling first step ran)"
        )
    median = statistics.median(measured_s)
    return (
        f"step time: predicted {predicted_s:.3g} s, measured {median:.3g} s (median of "
        f"{len(measured_s)} logging windows, the compiling first step left out); "
        f"measured/predicted {median / predicted_s:.2f}"
    )


def _gb(sizes) -> str:
    return ", ".join(f"{b / 1e9:.4g}" for b in sizes) + " GB" if sizes else "none"


def _schedule_name(schedule: str, virtual_stages: int) -> str:
    return f"{schedule} v{virtual_stages}" if virtual_stages > 1 else schedule


def _topology_lines(topology: Topology) -> list[str]:
    """The topology's header, one line per island, and the links between islands."""
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
    return lines


def _stage_table(pr: Prediction, islands: Sequence[str]) -> list[str]:
    """Per stage: its island, layers (with v chunks: the total and each chunk's), forward
    and backward time of one micro-batch, memory."""
    lines = ["  stage  island      layers   fwd ms   bwd ms   memory GB (limit)"]
    p, v = len(pr.stage_fwd_s), pr.virtual_stages
    for s in range(p):
        n = str(sum(pr.layers_per_stage[c * p + s] for c in range(v)))
        if v > 1:
            n += " (" + "+".join(str(pr.layers_per_stage[c * p + s]) for c in range(v)) + ")"
        lines.append(
            f"  {s:<6} {islands[s]:<11} {n:<8} {pr.stage_fwd_s[s] * 1e3:<8.2f} "
            f"{pr.stage_bwd_s[s] * 1e3:<8.2f} {pr.memory_gb[s]:.2f} ({pr.memory_limit_gb[s]:.1f})"
        )
    return lines


def format_strategies(choice: StrategyChoice) -> list[str]:
    """One line per cross-island strategy (step, tokens/s, cross-island bytes per step,
    the plan inside), then the chosen one and why."""
    lines = ["cross-island strategies:"]
    for p in choice.prices:
        if p.plan is None:
            lines.append(f"  {p.name:<13} unavailable: {p.why}")
            continue
        lay = p.plan.layout
        inner = (
            f"replica {lay.replica} x stage {lay.stages} x data {lay.data} x tensor "
            f"{lay.tensor}, {_schedule_name(lay.schedule, lay.virtual_stages)}, "
            f"{lay.microbatches} micro-batches"
        )
        extra = ""
        if p.name == "diloco":
            inner = f"one copy per island ({lay.replica}): " + inner.split(" x ", 1)[1]
            extra = (
                f"; H={p.inner_steps}, fragments {p.fragments}, outer {p.outer_dtype}, "
                + (
                    f"averaging after each of the first {p.warmup_steps} steps, "
                    if p.warmup_steps
                    else ""
                )
                + f"outer sync {p.outer_sync_s:.3g}s, exposed {p.exposed_s:.3g}s per outer step"
            )
        lines.append(
            f"  {p.name:<13} step {p.step_s:.4g}s, {p.tokens_per_s:,.0f} tokens/s, "
            f"{p.cross_island_bytes_per_step / 1e6:.4g} MB/step across islands ({inner}{extra})"
        )
    lines.append(f"strategy: {choice.chosen} ({choice.reason})")
    return lines
