"""Split L layers over p pipeline stage slots, given a placement's cost tables.

Three ways (embedding pinned to the first stage, the final norm + head + loss to the last;
every stage >= 1 layer):

- ``uniform``: L/p each, the remainder to the first stages.
- ``holmes``: the Holmes paper's rule, layers in proportion to stage speed, where a
  stage's speed is 1 / (its busy time per layer per iteration: m micro-batches of
  compute and communication plus its share of gradient sync over its island's NIC).
- ``optimal``: the split whose :func:`holmes_jax.planner.step_time.predict` step is the least
  of all compositions that fit in memory, exactly (:func:`optimal_split`; the search
  itself, a label-correcting DP with branch and bound over each stage's layer total, is
  :mod:`holmes_jax.planner.exact`'s). With v chunks per device each stage's total is cut
  into even chunks, which price the same and need the least memory. The earlier
  bubble-aware forms stay as building blocks: bottleneck
  ``F[s][j] = min_i max(F[s−1][i], cost(i..j, s))`` and min-sum DPs in O(p·L²), and
  ``Σ τ_s + (m−1)·max τ_s`` by enumerating the bottleneck (:func:`pipeline_split`).
  Memory limits mask infeasible (stage, layer count) pairs (:func:`slot_fits`).
  ``tests/planner/test_optimal.py`` checks exactness against brute force on 500 random
  instances.

Which placement to split, and the plans built from the splits, are
:mod:`holmes_jax.planner.search`'s. Pure Python + NumPy; no jax import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import even_split
from holmes_jax.planner.exact import exact_totals, least_sums, split_value, step_tables, walk_split
from holmes_jax.planner.stage_costs import StageCosts
from holmes_jax.planner.step_time import even_chunks, stage_totals

# --------------------------------------------------------------------------- simple rules


def uniform_split(num_layers: int, stages: int) -> list[int]:
    """As even as possible; the first ``num_layers % stages`` stages get one more."""
    if not 1 <= stages <= num_layers:
        raise ConfigError(f"parallel.stages={stages}: must be in [1, num_layers={num_layers}]")
    return even_split(num_layers, stages)


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
    v = costs.chunks  # interleaved: every chunk in proportion to its stage's speed
    return proportional_split(
        L, [1.0 / per_layer[s] for _ in range(v) for s in range(len(per_layer))]
    )


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
    """(p, L+1) whether a stage may hold n layers in all: the engine pads every stage (or
    chunk) to the largest one, so n layers fit only if *every* device fits the largest
    slot group of the most even split of n (:meth:`StageCosts.fits`)."""
    return costs.fits()


def optimal_split(costs: StageCosts, cutoff: float = math.inf) -> list[int] | None:
    """Exact memory-feasible split minimising the step :func:`predict` reports.

    The stages' layer totals come from :func:`holmes_jax.planner.exact.exact_totals` on
    :func:`holmes_jax.planner.exact.step_tables` (which price a split exactly as
    ``predict`` does), started with the best of the uniform, holmes, least-Σh and
    least-max-g splits as incumbent; with v chunks per device each
    stage's layers are cut as evenly as possible (:func:`~holmes_jax.planner.step_time.even_chunks`:
    time depends only on the totals, memory on the largest chunk, which the even cut
    minimises).

    Args:
      costs: the placement's tables.
      cutoff: a step the caller already has (the search's best plan so far): splits not
        below it need not be found, so the exact search only runs for a better one and
        otherwise the best seed split comes back (None if none fits).

    Returns:
      One entry per virtual stage (per stage but for interleaved), or None when no split
      fits in memory.
    """
    tables = step_tables(costs)
    v = costs.chunks
    best, best_totals = math.inf, None
    h, g = tables["h"], tables["g"]
    least = [least_sums(h), least_sums(np.where(np.isfinite(h), g, np.inf), np.maximum)]
    more = [walk_split(arg) for value, arg in least if np.isfinite(value[0, 0])]
    for totals in _seed_totals(costs, more):
        val = split_value(tables, totals)
        if val < best:
            best, best_totals = val, totals
    val, totals = exact_totals(tables, min(best, cutoff))
    if totals is not None and val < best:
        best_totals = totals
    if best_totals is None:
        return None
    return even_chunks(best_totals, v) if v > 1 else list(best_totals)


def _seed_totals(costs: StageCosts, more: list[list[int]]) -> list[list[int]]:
    """Cheap splits whose best value starts the exact search as incumbent: uniform,
    holmes and ``more`` (the least-Σ h and least-max-g splits)."""
    p, L = costs.layout.stages, costs.model.num_layers
    out = []
    v = costs.chunks
    if p * v <= L:
        out.append(stage_totals(uniform_split(L, p * v), p, v))
        try:
            out.append(stage_totals(holmes_split(costs), p, v))
        except ConfigError:
            pass
    fits = costs.fits()
    return [sp for sp in out + more if all(n >= 1 and fits[s, n] for s, n in enumerate(sp))]
