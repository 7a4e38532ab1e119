"""Plans, and the search over placements (degrees, micro-batches, activation policy).

A :class:`Plan` is a placement, a layer split (:mod:`holmes_jax.planner.partition`) and
its predicted iteration. :func:`plan_for_layout` splits and predicts one fixed layout,
:func:`best_policy_plan` also picks its activation policy, :func:`split_layers` returns
only the split (what ``layers_per_stage: auto`` uses).

:func:`search_plan` enumerates placements (replica or not, tensor and data degrees hence
stages per island, micro-batch count), lower-bounds each one and solves them in bound
order (branch and bound). Placement conventions are in :mod:`holmes_jax.planner.placement`.
The exact split builds (stages, layers+1, layers+1) tables: a placement above
:data:`~holmes_jax.core.spec.SPLIT_CELLS` cells (far above any real model's, e.g. 96 layers
on 96 stages: 0.9M) is not searched, and asked for by itself it is a one-line error.
Pure Python + NumPy; no jax import.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from holmes_jax.core.errors import ConfigError
from holmes_jax.core.plan_request import RunSpec
from holmes_jax.core.spec import REMAT_POLICIES, SPLIT_CELLS, Layout, ModelSpec
from holmes_jax.planner.partition import holmes_split, optimal_split, slot_fits, uniform_split
from holmes_jax.planner.placement import (
    Calibration,
    stage_blocks,
    stage_hardware,
    stages_per_island,
)
from holmes_jax.planner.stage_costs import StageCosts, stage_costs, with_schedule
from holmes_jax.planner.step_time import Prediction, predict, schedule_terms
from holmes_jax.planner.topology import Topology

METHODS = ("uniform", "holmes", "optimal")
VIRTUAL_CHOICES = (2, 3, 4)  # chunks per device the search tries for interleaved


@dataclass(frozen=True)
class Plan:
    """A placement, a split and its predicted iteration."""

    method: str
    layout: Layout
    layers_per_stage: tuple[int, ...]
    stages_per_island: tuple[int, ...]
    stage_islands: tuple[str, ...]  # island name of each stage (replica 0)
    microbatch_size: int
    prediction: Prediction
    remat: str = "none"  # the activation policy the prediction (time and memory) assumes
    # The best plan of each schedule on this plan's degrees and micro-batches (make_plan):
    # {schedule: {"virtual_stages", "layers_per_stage", "predicted_step_s",
    # "bubble_fraction", "fits_in_memory"} or None when that schedule cannot run it}.
    by_schedule: dict | None = None

    @property
    def predicted_step_s(self) -> float:
        return self.prediction.step_s

    @property
    def breakdown(self) -> dict[str, float]:
        return self.prediction.breakdown

    @property
    def tflops_per_device(self) -> float:
        return self.prediction.tflops_per_device

    @property
    def memory_per_stage_gb(self) -> tuple[float, ...]:
        return self.prediction.memory_gb

    @property
    def replica(self) -> int:
        return self.layout.replica

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        lay, pr = self.layout, self.prediction
        return {
            "method": self.method,
            "layers_per_stage": list(self.layers_per_stage),
            "stages_per_island": list(self.stages_per_island),
            "stage_islands": list(self.stage_islands),
            "stages": lay.stages,
            "data": lay.data,
            "tensor": lay.tensor,
            "replica": lay.replica,
            "microbatches": lay.microbatches,
            "microbatch_size": self.microbatch_size,
            "remat": self.remat,
            "schedule": lay.schedule,
            "virtual_stages": lay.virtual_stages,
            "bubble_fraction": pr.bubble_fraction,
            "p2p_bytes_per_boundary": list(pr.p2p_bytes),
            "predicted_step_s": pr.step_s,
            "breakdown": {k: float(v) for k, v in pr.breakdown.items()},
            "tflops_per_device": pr.tflops_per_device,
            "model_tflops_per_device": pr.model_tflops_per_device,
            "samples_per_s": pr.samples_per_s,
            "memory_per_stage_gb": list(pr.memory_gb),
            "memory_limit_gb": list(pr.memory_limit_gb),
            "fits_in_memory": pr.fits,
            "stage_fwd_s": list(pr.stage_fwd_s),
            "stage_bwd_s": list(pr.stage_bwd_s),
            "stage_weight_s": list(pr.stage_weight_s),
            "schedules": self.by_schedule,
        }


def plan_for_layout(
    topology: Topology,
    model: ModelSpec,
    run: RunSpec,
    layout: Layout,
    method: str | Sequence[int] = "optimal",
    calibration: Calibration | None = None,
) -> Plan:
    """Split and predict one fixed layout.

    Args:
      method: ``uniform`` | ``holmes`` | ``optimal``, or an explicit split.

    Raises:
      ConfigError: a layout that does not fit the topology, an unknown method, or (for
        ``optimal``) no split that fits in device memory.
    """
    if method == "optimal" and _split_cells(layout, model) > SPLIT_CELLS.limit:
        raise ConfigError(
            f"parallel.stages={layout.stages}, model.num_layers={model.num_layers}: the exact "
            f"split needs {_split_cells(layout, model)} table cells; must be <= "
            f"{SPLIT_CELLS.text} ({SPLIT_CELLS.what}); try --partition holmes"
        )
    costs = _costs(topology, model, run, layout, calibration)
    if isinstance(method, str):
        split = _split(costs, method)
        if split is None:
            # the most even split's largest slot group (a stage, or with v chunks a chunk)
            need = -(-costs.model.num_layers // (layout.stages * layout.virtual_stages))
            raise ConfigError(
                f"layout stages={layout.stages} data={layout.data} tensor={layout.tensor} "
                f"microbatches={layout.microbatches}: no split fits in device memory (the "
                f"most even split needs {costs.memory[:, need].max() / 1e9:.1f} GB per "
                f"device, usable {costs.capacity.min() / 1e9:.1f} GB; try "
                f"model.remat=selective or full, or more parallel.microbatches)"
            )
        name = method
    else:
        split, name = list(method), "given"
    return _plan(topology, layout, costs, split, name)


def best_policy_plan(
    topology: Topology,
    model: ModelSpec,
    run: RunSpec,
    layout: Layout,
    method: str = "optimal",
    calibration: Calibration | None = None,
    remats: Sequence[str] = REMAT_POLICIES,
) -> Plan:
    """The fastest fitting plan of one fixed layout over activation policies.

    Raises:
      ConfigError: no policy fits (naming the last policy's shortfall).
    """
    best, error = None, None
    for remat in remats:
        try:
            plan = plan_for_layout(
                topology, model, dataclasses.replace(run, remat=remat), layout, method, calibration
            )
        except ConfigError as e:
            error = e
            continue
        if plan.prediction.fits and (best is None or plan.predicted_step_s < best.predicted_step_s):
            best = plan
    if best is None:
        raise error or ConfigError(f"layout {layout}: no activation policy fits in memory")
    return best


def split_layers(
    topology: Topology,
    model_spec: ModelSpec,
    run_spec: RunSpec,
    stages: int,
    data: int,
    tensor: int,
    microbatches: int,
    schedule: str = "1f1b",
    method: str = "optimal",
    *,
    replica: int = 1,
    calibration: Calibration | None = None,
) -> list[int]:
    """Layers per stage for fixed degrees (what ``layers_per_stage: auto`` uses).

    Returns:
      One layer count per stage, each >= 1, summing to ``model_spec.num_layers``.

    Raises:
      ConfigError: see :func:`plan_for_layout`.
    """
    layout = Layout(
        stages, data, tensor, microbatches=microbatches, schedule=schedule, replica=replica
    )
    plan = plan_for_layout(topology, model_spec, run_spec, layout, method, calibration)
    return list(plan.layers_per_stage)


def search_plan(topology: Topology, model: ModelSpec, run: RunSpec, **options: Any) -> Plan:
    """The best plan of :func:`search_plans` (``options`` are its keywords).

    Raises:
      ConfigError: unknown method, or no candidate placement fits in memory.
    """
    return search_plans(topology, model, run, **options)[0]


def search_plans(
    topology: Topology,
    model: ModelSpec,
    run: RunSpec,
    *,
    method: str = "optimal",
    schedule: str = "1f1b",
    calibration: Calibration | None = None,
    stages: int | None = None,
    data: int | None = None,
    tensor: int | None = None,
    microbatches: int | None = None,
    replica: int | None = None,
    remats: Sequence[str] | None = None,
    schedules: Sequence[str] | None = None,
    top: int = 1,
) -> list[Plan]:
    """Search placements (replica, tensor, data, hence stages per island, micro-batches
    and so the micro-batch size), the activation policy and the split, minimising the
    predicted step time among the plans that fit in memory.

    Args:
      topology, model, run: the problem.
      method: how each candidate placement is split (``uniform``, ``holmes``, ``optimal``).
      schedule: the pipeline schedule when ``schedules`` is None.
      calibration: device speed (default fraction of peak, or a profile's).
      stages, data, tensor, microbatches, replica: pin a degree; None searches it.
      remats: activation policies to consider (None: only ``run.remat``).
      schedules: schedules to consider (interleaved with v in :data:`VIRTUAL_CHOICES`);
        None: only ``schedule``.
      top: how many plans to keep.

    Returns:
      The ``top`` best plans that fit, fastest predicted first (fewer when fewer fit), each
      a distinct placement, schedule or activation policy; the branch and bound prunes
      against the ``top``-th best found so far.

    Raises:
      ConfigError: unknown method, or no candidate placement fits in memory.
    """
    _check_method(method)
    bounded, hardware, too_big = [], {}, 0
    for layout in candidate_layouts(
        topology, model, run, schedule, stages, data, tensor, microbatches, replica
    ):
        if method == "optimal" and _split_cells(layout, model) > SPLIT_CELLS.limit:
            too_big += 1
            continue
        key = (layout.replica, layout.data, layout.tensor)  # hardware does not depend on m
        if key not in hardware:
            hardware[key] = stage_hardware(topology, layout, calibration, run.memory_fraction)
        variants = schedule_layouts(layout, model.num_layers, schedules or (schedule,))
        for remat in remats or (run.remat,):
            policy_run = dataclasses.replace(run, remat=remat)
            base = None
            for variant in variants:
                if base is None:
                    costs = base = stage_costs(model, policy_run, variant, hardware[key])
                else:
                    costs = with_schedule(base, variant, hardware[key])
                bounded.append((_lower_bound(costs), id(costs), costs))
    bounded.sort(key=lambda x: x[:2])
    best: list[Plan] = []  # the fastest found, at most ``top``, fastest first
    for bound, _, costs in bounded:
        cutoff = best[-1].predicted_step_s if len(best) == top else math.inf
        if bound == math.inf or bound >= cutoff:
            break
        split = _split(costs, method, cutoff)
        if split is None:
            continue
        plan = _plan(topology, costs.layout, costs, split, method)
        if plan.prediction.fits and plan.predicted_step_s < cutoff:
            best = sorted([*best, plan], key=lambda p: p.predicted_step_s)[:top]
    if not best:
        over = f"; {too_big} skipped: over {SPLIT_CELLS.text} {SPLIT_CELLS.what}" if too_big else ""
        raise ConfigError(
            f"topology '{topology.name}': no placement of the {model.num_params / 1e9:.2f}B-"
            f"parameter model fits in device memory (method={method}{over})"
        )
    return best


def candidate_layouts(
    topology: Topology,
    model: ModelSpec,
    run: RunSpec,
    schedule: str = "1f1b",
    stages: int | None = None,
    data: int | None = None,
    tensor: int | None = None,
    microbatches: int | None = None,
    replica: int | None = None,
) -> list[Layout]:
    """Every layout that respects the placement rules and the pinned degrees."""
    # interleaved needs its v and >= 2 stages: such layouts come as 1F1B here and are
    # re-scheduled by schedule_layouts
    base = "1f1b" if schedule == "interleaved" else schedule
    islands = topology.islands
    sizes = [isl.num_devices for isl in islands]
    replicas = [1]
    if len(islands) > 1 and len(set(sizes)) == 1:
        replicas.append(len(islands))
    per_host = math.gcd(*(isl.devices_per_host for isl in islands))
    out = []
    for r in replicas:
        if replica is not None and r != replica:
            continue
        unit = sizes[0] if r > 1 else math.gcd(*sizes)  # d·t must divide this
        for t in _divisors(per_host):
            if model.num_heads % t or model.vocab_size % t or (tensor and t != tensor):
                continue
            for d in _divisors(unit // t):
                p = topology.num_devices // (r * d * t)
                if (data and d != data) or (stages and p != stages) or p > model.num_layers:
                    continue
                if run.global_batch_size % (r * d):
                    continue
                for m in _divisors(run.global_batch_size // (r * d)):
                    if microbatches and m != microbatches:
                        continue
                    out.append(Layout(p, d, t, microbatches=m, schedule=base, replica=r))
    return out


def schedule_layouts(layout: Layout, num_layers: int, schedules: Sequence[str]) -> list[Layout]:
    """``layout`` under each schedule it can run: interleaved with every v in
    :data:`VIRTUAL_CHOICES` that leaves each chunk a layer and whose micro-batches come in
    whole groups of ``min(p, m)``; GPipe only without 1F1B (same time, more memory); one
    stage runs one schedule (they all price alike)."""
    p, m = layout.stages, layout.microbatches
    out = []
    if "1f1b" in schedules:  # GPipe: 1F1B's time with more memory, never faster
        schedules = [x for x in schedules if x != "gpipe"]
    for name in schedules:
        if name == "interleaved":
            if p < 2 or m % min(p, m):
                continue
            for v in VIRTUAL_CHOICES:
                if p * v <= num_layers:
                    out.append(dataclasses.replace(layout, schedule=name, virtual_stages=v))
        else:
            out.append(dataclasses.replace(layout, schedule=name, virtual_stages=1))
    return out[:1] if p == 1 else out


def _lower_bound(costs: StageCosts) -> float:
    """A step time no split of this placement can beat; inf if no split fits in memory.

    Every table is affine in the layer count, so ``Σ_s h_s >= Σ_s h_s(0) + L·min slope``,
    ``max_s g_s >= Σ_s g_s / p`` likewise, and the tail >= stage 0's optimizer step and
    all-gather with one layer.
    """
    p, L = costs.layout.stages, costs.model.num_layers
    # Memory grows with the layer count, so stage s holds at most room[s] layers.
    room = slot_fits(costs)[:, 1:].sum(axis=1)
    if room.min() < 1 or room.sum() < L:
        return math.inf
    h, g, _, _ = schedule_terms(costs)
    least = lambda x: x[:, 0].sum() + L * ((x[:, L] - x[:, 0]) / L).min()  # noqa: E731
    after = costs.optimizer[0, 1] + costs.gather[0, 1]
    return float(least(h) + max(0.0, least(g)) / p + after)


def _split(costs: StageCosts, method: str, cutoff: float = math.inf) -> list[int] | None:
    _check_method(method)
    if method == "uniform":
        return uniform_split(costs.model.num_layers, costs.layout.stages * costs.chunks)
    if method == "holmes":
        return holmes_split(costs)
    return optimal_split(costs, cutoff)


def _costs(topology, model, run, layout, calibration) -> StageCosts:
    hw = stage_hardware(topology, layout, calibration, run.memory_fraction)
    return stage_costs(model, run, layout, hw)


def _plan(topology, layout, costs, split, method) -> Plan:
    return Plan(
        method=method,
        layout=layout,
        layers_per_stage=tuple(split),
        stages_per_island=stages_per_island(topology, layout),
        stage_islands=tuple(topology.islands[i].name for i, _ in stage_blocks(topology, layout)[0]),
        microbatch_size=costs.microbatch_size,
        prediction=predict(costs, split),
        remat=costs.run.remat,
    )


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ConfigError(f"--partition '{method}': must be one of {', '.join(METHODS)}")


def _split_cells(layout: Layout, model: ModelSpec) -> int:
    return layout.stages * (model.num_layers + 1) ** 2


def _divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order, in O(sqrt n) (a global batch may be 10^6)."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return small + [n // k for k in reversed(small) if k * k != n]
