"""A plan as text and as JSON, with the alternative splits of its placement.

What ``python -m holmes_jax.plan`` prints (:func:`format_plan`) and ``--json`` writes
(:func:`plan_json`). Pure Python; no jax import.
"""

from __future__ import annotations

from typing import Any

from holmes_jax.planner.plans import specs_from_config
from holmes_jax.planner.search import Plan
from holmes_jax.planner.topology import Topology


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
