"""Split layers over pipeline stages, and search the placement (degrees, micro-batches).

Three ways to split L layers over p stage slots (embedding pinned to the first stage, the
final norm + head + loss to the last; every stage >= 1 layer):

- ``uniform``: L/p each, the remainder to the first stages.
- ``holmes``: the Holmes paper's rule, layers in proportion to stage speed, where a
  stage's speed is 1 / (its busy time per layer per iteration: m micro-batches of
  compute and communication plus its share of gradient sync over its island's NIC).
- ``optimal``: exact dynamic programme over contiguous splits. Bottleneck form
  ``F[s][j] = min_i max(F[s−1][i], cost(i..j, s))`` in O(p·L²); the bubble-aware form
  minimises ``Σ τ_s + (m−1)·max τ_s`` by enumerating the bottleneck value T (each T a
  min-sum DP over stage costs <= T), stopping once ``f_∞ + (m−1)·T`` cannot win.
  Memory limits mask infeasible (stage, layer count) pairs. Gradient sync enters through
  a cap G on each stage's post-pipeline tail (reduction + optimizer + all-gather),
  enumerated the same way, so the DP minimises ``pipeline + max_s tail_s`` exactly; the
  candidates are then ranked by :func:`holmes_jax.planner.cost.predict`, which also credits the
  overlap of the reduction with the pipeline drain.

:func:`search_plan` enumerates placements (replica or not, tensor and data degrees hence
stages per island, micro-batch count), lower-bounds each one and solves them in bound
order (branch and bound). Placement conventions are in :mod:`holmes_jax.planner.placement`.
Pure Python + NumPy; no jax import.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import REMAT_POLICIES, Layout, ModelSpec
from holmes_jax.planner.cost import Prediction, RunSpec, StageCosts, predict, stage_costs
from holmes_jax.planner.placement import (
    Calibration,
    stage_blocks,
    stage_hardware,
    stages_per_island,
)
from holmes_jax.planner.topology import Topology

METHODS = ("uniform", "holmes", "optimal")
_MAX_CAPS = 256  # safety bound on enumerated sync caps per solve


# --------------------------------------------------------------------------- simple rules


def uniform_split(num_layers: int, stages: int) -> list[int]:
    """As even as possible; the first ``num_layers % stages`` stages get one more."""
    if not 1 <= stages <= num_layers:
        raise ConfigError(f"parallel.stages={stages}: must be in [1, num_layers={num_layers}]")
    q, r = divmod(num_layers, stages)
    return [q + (1 if s < r else 0) for s in range(stages)]


def proportional_split(num_layers: int, speeds: Sequence[float]) -> list[int]:
    """Layers in proportion to ``speeds`` (largest remainder), every stage >= 1."""
    p = len(speeds)
    if not 1 <= p <= num_layers or min(speeds) <= 0:
        raise ConfigError(f"speeds={list(speeds)}: need 1..{num_layers} positive speeds")
    total = float(sum(speeds))
    spare = num_layers - p  # one layer per stage is fixed; share the rest
    ideal = [spare * v / total for v in speeds]
    split = [1 + math.floor(x) for x in ideal]
    order = sorted(range(p), key=lambda s: (-(ideal[s] - math.floor(ideal[s])), s))
    for s in order[: num_layers - sum(split)]:
        split[s] += 1
    return split


def holmes_split(costs: StageCosts) -> list[int]:
    """The Holmes paper's self-adapting rule on a placement's cost tables."""
    L, m = costs.model.num_layers, costs.layout.microbatches
    busy = m * costs.tau + costs.tail  # (p, L+1) per-iteration busy time of each stage
    per_layer = (busy[:, L] - busy[:, 0]) / L
    return proportional_split(L, list(1.0 / per_layer))


# --------------------------------------------------------------------------- exact DP


def cost_cube(table: np.ndarray) -> np.ndarray:
    """``cube[s, i, j] = table[s, j − i]`` (layers i..j−1 on stage s), inf where j <= i.

    Args:
      table: (p, L+1) cost of stage s holding n layers (inf = not allowed).
    """
    L = table.shape[1] - 1
    n = np.arange(L + 1)[None, :] - np.arange(L + 1)[:, None]  # (i, j) -> j - i
    cube = table[:, np.clip(n, 0, L)]
    cube[:, n <= 0] = np.inf
    return cube


def layer_cube(layer_costs: np.ndarray, fixed: Sequence[float] | None = None) -> np.ndarray:
    """Cube from per-layer costs that may differ by layer: (p, L) -> (p, L+1, L+1)."""
    p, L = layer_costs.shape
    prefix = np.concatenate([np.zeros((p, 1)), np.cumsum(layer_costs, axis=1)], axis=1)
    cube = prefix[:, None, :] - prefix[:, :, None]
    if fixed is not None:
        cube = cube + np.asarray(fixed, dtype=np.float64)[:, None, None]
    n = np.arange(L + 1)[None, :] - np.arange(L + 1)[:, None]
    cube[:, n <= 0] = np.inf
    return cube


def bottleneck_split(cube: np.ndarray) -> tuple[float, list[int] | None]:
    """Minimise ``max_s cost(stage s)`` over contiguous splits; O(p·L²).

    Returns:
      (optimal value, layers per stage), or (inf, None) when nothing is feasible.
    """
    return _dp(cube, np.maximum)


def min_sum_split(cube: np.ndarray) -> tuple[float, list[int] | None]:
    """Minimise ``Σ_s cost(stage s)`` over contiguous splits; O(p·L²)."""
    return _dp(cube, np.add)


def pipeline_split(cube: np.ndarray, microbatches: int) -> tuple[float, list[int] | None]:
    """Minimise the bubble-aware pipeline time ``Σ τ_s + (m−1)·max_s τ_s`` exactly.

    Enumerates the bottleneck T upward from the bottleneck optimum; for each T solves the
    min-sum DP with stage costs capped at T.

    Returns:
      (optimal value, layers per stage), or (inf, None) when nothing is feasible.
    """
    f_inf, split_inf = min_sum_split(cube)
    if split_inf is None or microbatches == 1:
        return f_inf, split_inf
    k = microbatches - 1
    t_star, split = bottleneck_split(cube)
    best, best_split = _objective(cube, split, k), split
    hi = (best - f_inf) / k  # T above this cannot beat the incumbent
    values = cube[(cube >= t_star) & (cube <= hi)]
    for T in np.unique(values):
        if f_inf + k * T >= best:
            break
        val, split = min_sum_split(np.where(cube <= T, cube, np.inf))
        if split is None:
            continue
        obj = _objective(cube, split, k)
        if obj < best:
            best, best_split = obj, split
        if val <= f_inf:
            break
    return best, best_split


def _objective(cube: np.ndarray, split: list[int], k: int) -> float:
    taus = _stage_values(cube, split)
    return float(sum(taus) + k * max(taus))


def _stage_values(cube: np.ndarray, split: Sequence[int]) -> list[float]:
    bounds = np.concatenate([[0], np.cumsum(split)])
    return [float(cube[s, bounds[s], bounds[s + 1]]) for s in range(len(split))]


def _dp(cube: np.ndarray, combine) -> tuple[float, list[int] | None]:
    p, L1, _ = cube.shape
    best = cube[0, 0, :].copy()  # stage 0 holds layers [0, j)
    cols = np.arange(L1)
    back = []
    for s in range(1, p):
        cand = combine(best[:, None], cube[s])  # (i, j): stages < s end at i, s at j
        arg = np.argmin(cand, axis=0)
        best = cand[arg, cols]
        back.append(arg)
    value = float(best[L1 - 1])
    if not math.isfinite(value):
        return math.inf, None
    split, j = [], L1 - 1
    for arg in reversed(back):
        i = int(arg[j])
        split.append(j - i)
        j = i
    split.append(j)
    return value, split[::-1]


def slot_fits(costs: StageCosts) -> np.ndarray:
    """(p, L+1) whether a stage may hold n layers: the engine pads every stage to the
    largest one, so n layers fit only if *every* device fits n layer slots."""
    every = (costs.memory <= costs.capacity[:, None]).all(axis=0)
    return np.broadcast_to(every, costs.memory.shape)


def optimal_split(costs: StageCosts) -> list[int] | None:
    """Exact memory-feasible split minimising ``pipeline + max_s tail_s``.

    Returns:
      The split with the lowest :func:`~holmes_jax.planner.cost.predict` step time among the
      enumerated optima (and the uniform and holmes splits when they fit), or None when
      no split fits in memory.
    """
    m = costs.layout.microbatches
    fits = slot_fits(costs)
    tau = np.where(fits, costs.tau, np.inf)
    tail = np.where(fits, costs.tail, np.inf)
    cube, tail_cube = cost_cube(tau), cost_cube(tail)
    g_min, _ = bottleneck_split(tail_cube)
    caps = np.unique(tail[np.isfinite(tail) & (tail >= g_min)])
    # The solution under cap G stays optimal for every cap down to its own max tail g, so
    # jump straight to the next cap below g; later caps cost >= this pipeline + g_min.
    candidates, best, masked = [], math.inf, cube
    for _ in range(_MAX_CAPS):
        val, split = pipeline_split(masked, m)
        if split is None:
            break
        g = max(_stage_values(tail_cube, split))
        candidates.append(split)
        best = min(best, val + g)
        below = np.searchsorted(caps, g) - 1  # index of the largest cap < g
        if val + g_min >= best or below < 0:
            break
        masked = np.where(tail_cube <= caps[below], cube, np.inf)
    if not candidates:
        return None
    # predict() also credits the reduction's overlap with the drain, which the DP bounds
    # from above; ranking by it, the baselines join so optimal is never predicted worse.
    L, p = costs.model.num_layers, costs.layout.stages
    for split in (uniform_split(L, p), holmes_split(costs)):
        if all(fits[s, n] for s, n in enumerate(split)):
            candidates.append(split)
    return min(candidates, key=lambda sp: predict(costs, sp).step_s)


# --------------------------------------------------------------------------- plans


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
    costs = _costs(topology, model, run, layout, calibration)
    if isinstance(method, str):
        split = _split(costs, method)
        if split is None:
            need = -(-costs.model.num_layers // layout.stages)  # the most even split
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


def search_plan(
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
) -> Plan:
    """Search placements (replica, tensor, data, hence stages per island, micro-batches
    and so the micro-batch size), the activation policy and the split, minimising the
    predicted step time among the plans that fit in memory.

    Args:
      topology, model, run: the problem.
      method: how each candidate placement is split (``uniform``, ``holmes``, ``optimal``).
      schedule: ``1f1b`` or ``gpipe``.
      calibration: device speed (default fraction of peak, or a profile's).
      stages, data, tensor, microbatches, replica: pin a degree; None searches it.
      remats: activation policies to consider (None: only ``run.remat``).

    Returns:
      The best :class:`Plan` that fits in memory.

    Raises:
      ConfigError: unknown method, or no candidate placement fits in memory.
    """
    _check_method(method)
    bounded, hardware = [], {}
    for layout in candidate_layouts(
        topology, model, run, schedule, stages, data, tensor, microbatches, replica
    ):
        key = (layout.replica, layout.data, layout.tensor)  # hardware does not depend on m
        if key not in hardware:
            hardware[key] = stage_hardware(topology, layout, calibration, run.memory_fraction)
        for remat in remats or (run.remat,):
            policy_run = dataclasses.replace(run, remat=remat)
            costs = stage_costs(model, policy_run, layout, hardware[key])
            bounded.append((_lower_bound(costs), id(costs), costs))
    bounded.sort(key=lambda x: x[:2])
    best: Plan | None = None
    for bound, _, costs in bounded:
        if bound == math.inf or (best is not None and bound >= best.predicted_step_s):
            break
        split = _split(costs, method)
        if split is None:
            continue
        plan = _plan(topology, costs.layout, costs, split, method)
        if plan.prediction.fits and (best is None or plan.predicted_step_s < best.predicted_step_s):
            best = plan
    if best is None:
        raise ConfigError(
            f"topology '{topology.name}': no placement of the {model.num_params / 1e9:.2f}B-"
            f"parameter model fits in device memory (method={method})"
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
                    out.append(Layout(p, d, t, microbatches=m, schedule=schedule, replica=r))
    return out


def _lower_bound(costs: StageCosts) -> float:
    """A step time no split of this placement can beat; inf if no split fits in memory."""
    p, m, L = costs.layout.stages, costs.layout.microbatches, costs.model.num_layers
    # Memory grows with the layer count, so stage s holds at most room[s] layers.
    room = slot_fits(costs)[:, 1:].sum(axis=1)
    if room.min() < 1 or room.sum() < L:
        return math.inf
    tau = costs.tau
    slope = ((tau[:, L] - tau[:, 0]) / L).min()
    total = tau[:, 0].sum() + L * slope  # Σ τ_s >= fixed parts + L cheapest layers
    pipe = total * (1 + (m - 1) / p)  # max_s τ_s >= Σ τ_s / p
    first_tail = costs.reduce[0, 1] + costs.optimizer[0, 1] + costs.gather[0, 1]
    return float(pipe + first_tail)


def _split(costs: StageCosts, method: str) -> list[int] | None:
    _check_method(method)
    if method == "uniform":
        return uniform_split(costs.model.num_layers, costs.layout.stages)
    if method == "holmes":
        return holmes_split(costs)
    return optimal_split(costs)


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


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]
