"""The exact split search: the per-stage layer totals with the least predicted step.

:func:`holmes_jax.planner.step_time.predict` prices a split through each stage's layer total as
``Σ_s h_s + max_s g_s + max_s [(r_s − Σ_{k<s} σ_k − ω_s)⁺ + a_s]`` (:func:`step_tables`:
the schedule's pipeline terms, each stage's gradient reduction r overlapped with the
drain, the optimizer step and all-gather a). :func:`exact_totals` minimises it over every
composition, exactly: a label-correcting DP over the stages with dominance and branch and
bound (:func:`_joint_labels`), or, when its label sets grow, the same per bottleneck cap
(:func:`_labels`). :func:`holmes_jax.planner.partition.optimal_split` is its front door;
``tests/planner/test_optimal.py`` checks both searches against brute force. Pure NumPy; no
jax import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from holmes_jax.planner.stage_costs import StageCosts
from holmes_jax.planner.step_time import schedule_terms


def step_tables(costs: StageCosts) -> dict[str, np.ndarray]:
    """The per-stage (p, L+1) tables :func:`optimal_split` combines, exactly as
    :func:`holmes_jax.planner.step_time.predict` does: step = ``Σ_s h_s + max_s g_s + X`` with
    the tail X = ``max_s [(r_s − Σ_{k<s} σ_k − ω_s)⁺ + a_s]`` (overlapped reduction),
    ``max_s (r_s + a_s)`` (not overlapped) or ``Σ_s r_s + max_s a_s`` (synchronous; the
    sum then joins h). Infeasible (stage, n) pairs are inf in h."""
    h, g, sigma, omega = schedule_terms(costs)
    r, a = costs.reduce, costs.optimizer + costs.gather
    run = costs.run
    if run.reduction == "sync":  # the stages' reductions add up
        h, r, sigma, omega = h + r, np.zeros_like(r), 0 * sigma, 0 * omega
    elif run.reduction == "exposed":  # nothing hides the reduction
        a, r, sigma, omega = a + r, np.zeros_like(r), 0 * sigma, 0 * omega
    h = np.where(costs.fits(), h, np.inf)
    h[:, 0] = np.inf  # every stage holds >= 1 layer
    return {"h": h, "g": g, "sigma": sigma, "omega": omega, "r": r, "a": a}


def split_value(tables: dict, totals: Sequence[int]) -> float:
    """The step :func:`step_tables` prices for per-stage totals (inf if infeasible)."""
    idx = (np.arange(len(totals)), np.asarray(totals))
    h, g = tables["h"][idx], tables["g"][idx]
    r, a, sg, om = (tables[k][idx] for k in ("r", "a", "sigma", "omega"))
    prefix = np.concatenate([[0.0], np.cumsum(sg)[:-1]])
    tail = np.maximum(0.0, r - prefix - om) + a
    return float(h.sum() + g.max() + tail.max())


def least_sums(h: np.ndarray, combine=np.add) -> tuple[np.ndarray, np.ndarray]:
    """Per (stage s, layers done j): the least Σ h of stages s..p−1 on layers j..L−1
    (inf: none fits; with ``combine=np.maximum`` the least max h), and the end of stage s
    that reaches it."""
    p, L1 = h.shape
    L = L1 - 1
    sub = np.arange(L1)[None, :] - np.arange(L1)[:, None]  # (j, j') -> j' − j
    n = np.clip(sub, 0, L)
    out = np.full((p + 1, L1), np.inf)
    out[p, L] = 0.0 if combine is np.add else -np.inf
    arg = np.zeros((p, L1), dtype=np.int64)
    rows = np.arange(L1)
    for s in range(p - 1, -1, -1):
        c = combine(np.where(sub >= 1, h[s][n], np.inf), out[s + 1][None, :])
        arg[s] = c.argmin(axis=1)
        out[s] = c[rows, arg[s]]
    return out, arg


def walk_split(arg: np.ndarray) -> list[int]:
    """The layer counts a :func:`least_sums` argmin table picks from layer 0."""
    j, split = 0, []
    for s in range(arg.shape[0]):
        split.append(int(arg[s, j]) - j)
        j = int(arg[s, j])
    return split


def _tail_reach(tables: dict) -> tuple[np.ndarray, np.ndarray]:
    """(p,) each: over the stages after s and their feasible layer counts, the largest a
    and the largest ``r − ω + a``: a later tail is at most ``max(A_s, B_s − P)``."""
    ok = np.isfinite(tables["h"])
    a = np.where(ok, tables["a"], -np.inf).max(axis=1)
    b = np.where(ok, tables["r"] - tables["omega"] + tables["a"], -np.inf).max(axis=1)
    after = lambda x: np.append(np.maximum.accumulate(x[::-1])[::-1][1:], -np.inf)  # noqa: E731
    return after(a), after(b)


def _canonical(X, P, s, reach, a_low):
    """Labels that differ only where it cannot matter are made equal (so one dominates):
    P when no later tail can exceed X whatever P is (``max(A_s, B_s − P) <= X``: P then
    inf), X when a later stage's tail is sure to exceed it (``X <= a*``: X then a*)."""
    A, B = reach
    P = np.where(np.maximum(A[s], B[s] - P) <= X, np.inf, P)
    X = np.maximum(X, a_low[s + 1])
    return X, P


def _undominated(group: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Indices of the rows of ``keys`` (N, 4) = (H, G, X, −P) that no other row of the
    same ``group`` dominates (<= in every column; of equal rows the first is kept)."""
    order = np.lexsort((*keys.T[::-1], group))
    grp, k = group[order], keys[order]
    starts = np.flatnonzero(np.r_[True, grp[1:] != grp[:-1]])
    sizes = np.diff(np.r_[starts, len(grp)])
    keep = np.ones(len(k), dtype=bool)
    lo = 1
    for width in (2, 4, 8, 16, 32):  # groups of similar sizes at once, padded to ``width``
        pick = (sizes > lo) & (sizes <= width)
        lo = width
        if not pick.any():
            continue
        first, size = starts[pick], sizes[pick]
        rows = first[:, None] + np.arange(width)[None, :]
        valid = rows < (first + size)[:, None]
        rows = np.where(valid, rows, first[:, None])
        blk = np.where(valid[..., None], k[rows], np.inf)
        keep[rows[valid]] = ~_dominated(blk, valid)[valid]
    for start, size in zip(starts[sizes > lo], sizes[sizes > lo], strict=True):
        blk = k[start : start + size][None]
        keep[start : start + size] = ~_dominated(blk, np.ones((1, size), dtype=bool))[0]
    return order[keep]


def _dominated(blk: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """(G, K) whether row b of each group is dominated by another valid row a (rows sorted
    lexicographically, so an equal row dominates only the ones after it)."""
    le = (blk[:, :, None, :] <= blk[:, None, :, :]).all(axis=3)  # [g, a, b]: a <= b
    K = blk.shape[1]
    earlier = np.arange(K)[:, None] < np.arange(K)[None, :]
    eq = (blk[:, :, None, :] == blk[:, None, :, :]).all(axis=3)
    le &= ~eq | earlier[None]
    le &= valid[:, :, None]
    return le.any(axis=1)


def _suffix_bounds(tables: dict, p: int, L: int):
    """Per (stage s, layers done j): the least Σ h and max g that stages s..p−1 can reach
    on layers j..L−1 (each minimised on its own), and ``max_{k>=s} a_k(1)`` (a grows with
    the layer count): admissible bounds; and the layer counts that reach the least Σ h
    and the least max g (seed splits)."""
    h, g, a = tables["h"], tables["g"], tables["a"]
    sub = np.arange(L + 1)[None, :] - np.arange(L + 1)[:, None]  # (j, j') -> j' − j
    n = np.clip(sub, 0, L)
    sum_h = np.full((p + 1, L + 1), np.inf)
    max_g = np.full((p + 1, L + 1), np.inf)
    max_a = np.full((p + 1, L + 1), np.inf)
    arg_h = np.zeros((p, L + 1), dtype=np.int64)
    arg_g = np.zeros((p, L + 1), dtype=np.int64)
    sum_h[p, L] = 0.0
    max_g[p, L] = max_a[p, L] = -np.inf
    rows = np.arange(L + 1)
    for s in range(p - 1, -1, -1):
        hs = np.where(sub >= 1, h[s][n], np.inf)  # inf: empty or infeasible
        bad = ~np.isfinite(hs)
        c = hs + sum_h[s + 1][None, :]
        arg_h[s] = c.argmin(axis=1)
        sum_h[s] = c[rows, arg_h[s]]
        c = np.where(bad, np.inf, np.maximum(g[s][n], max_g[s + 1][None, :]))
        arg_g[s] = c.argmin(axis=1)
        max_g[s] = c[rows, arg_g[s]]
        # a grows with the layer count: each later stage holds >= 1 layer
        max_a[s] = np.maximum(a[s, 1], max_a[s + 1, L])
    seeds = []
    for value, arg in ((sum_h, arg_h), (max_g, arg_g)):
        if np.isfinite(value[0, 0]):
            j, split = 0, []
            for s in range(p):
                split.append(int(arg[s, j]) - j)
                j = int(arg[s, j])
            seeds.append(split)
    return sum_h, max_g, max_a, seeds


def _joint_labels(
    tables: dict, incumbent: float = math.inf, bounds: tuple | None = None, cap: int = 500
) -> tuple[float, list[int] | None] | None:
    """One label-correcting DP over the stages with labels ``(H, G, X, P)`` (Σ h, max g,
    tail so far, Σ σ), for :func:`exact_totals`: dominated labels (H, G, X no larger, P no
    smaller) and labels whose bound ``H + Σh* + max(G, g*) + max(X, a*)`` (the suffix's
    least Σ h and least max g, each on its own, and the largest one-layer a left) does not
    beat the incumbent go. Exact when it finishes; None when a stage holds more than
    ``cap`` labels (heterogeneous stages: the H-G trade-off has too many steps)."""
    h, g, r, a = tables["h"], tables["g"], tables["r"], tables["a"]
    sigma, omega = tables["sigma"], tables["omega"]
    p, L1 = h.shape
    L = L1 - 1
    sum_h, max_g, max_a, _ = bounds or _suffix_bounds(tables, p, L)
    reach = _tail_reach(tables)
    a_low_all = np.append(np.maximum.accumulate(a[::-1, 1])[::-1], -np.inf)
    best = incumbent
    if sum_h[0, 0] + max(max_g[0, 0], 0.0) + max_a[0, 0] >= best * (1 + 1e-12):
        return math.inf, None  # not even the bound beats the incumbent
    # labels: j, H, G, X, P and the back-pointer (previous label index, its layer count)
    lab = {k: np.zeros(1) for k in "HGXP"}
    lab["j"] = np.zeros(1, dtype=np.int64)
    history = []
    nn = np.arange(1, L + 1)
    for s in range(p):
        j, src, n, H, X, P = _extend(lab, s, nn, h, r, a, sigma, omega, reach, a_low_all)
        G = np.maximum(lab["G"][src], g[s, n])
        bound = (
            H + sum_h[s + 1, j] + np.maximum(G, max_g[s + 1, j]) + np.maximum(X, max_a[s + 1, j])
        )
        ok = bound < best * (1 + 1e-12)
        if s == p - 1:
            ok &= j == L
        j, src, n, H, G, X, P = (x[ok] for x in (j, src, n, H, G, X, P))
        if len(j) == 0:
            return math.inf, None
        if len(j) > 8 * cap:  # too many to sort out cheaply: the per-T search instead
            return None
        keep = _undominated(j, np.stack([H, G, X, -P], axis=1))
        if len(keep) > cap:
            return None
        lab = {"j": j[keep], "H": H[keep], "G": G[keep], "X": X[keep], "P": P[keep]}
        history.append((src[keep], n[keep]))
    total = lab["H"] + lab["G"] + lab["X"]
    i = int(np.argmin(total))
    return float(total[i]), _backtrack(history, i)


def exact_totals(tables: dict, incumbent: float = math.inf) -> tuple[float, list[int] | None]:
    """Per-stage layer totals minimising :func:`split_value`, exactly.

    The step is ``Σ_s h_s + max_s g_s + X`` (:func:`step_tables`). First one joint label
    DP (:func:`_joint_labels`, labels (Σ h, max g, tail, Σ σ)), exact when it finishes,
    which it does when the label sets stay small (stages of similar speed); when they
    grow (very uneven stages trade Σ h against max g at many steps) this search, in
    which the max g is a fixed cap and labels carry one criterion fewer. The bottleneck value T
    is enumerated upward over the distinct g values; for each T a label-correcting DP
    over the stages, with every stage held to ``g_s <= T``, minimises ``Σ h + T + X``.
    The least of these is the optimum: the optimal split's own max g is one of the T
    tried, where it is priced exactly, and any other (split, T) pair prices its split at
    or above its true step (T >= its max g).

    Inside one T, a label at (stage s done, layers j used) is ``(H, X, P)`` = (Σ h, the
    tail so far, Σ σ). A label with H and X no larger and P no smaller than another's is
    at least as good under every completion (H adds, X takes maxima, and a later stage's
    tail ``(r − P − ω)⁺ + a`` falls as P grows), so dominated labels go; a label whose
    bound ``H + Σh*_T + T + max(X, a*)`` (the least Σ h of the remaining stages under the
    cap, and the largest one-layer a among them: a grows with the layer count) does not
    beat the incumbent goes too. Both keep an optimal label. The caps are tried from the
    largest that ``min Σ h + T + max_s a_s(1)`` allows down; the least Σ h under a cap T
    is a lower bound for every lower cap, so the caps it rules out are skipped.

    Returns:
      (value, totals), or (inf, None) when nothing beats ``incumbent`` or nothing is
      feasible.
    """
    h, g, r, a = tables["h"], tables["g"], tables["r"], tables["a"]
    sigma, omega = tables["sigma"], tables["omega"]
    joint = _joint_labels(tables, incumbent)
    if joint is not None:  # finished within its label cap: exact already
        return joint
    least_all, _ = least_sums(h)
    reach = _tail_reach(tables)
    # a grows with the layer count and every stage holds >= 1 layer
    a_low = np.maximum.accumulate(a[::-1, 1])[::-1]  # (p,) max_{k>=s} a_k(1)
    a_low = np.append(a_low, -np.inf)
    if not np.isfinite(least_all[0, 0]):
        return math.inf, None
    best, best_totals = incumbent, None
    caps = np.unique(g[np.isfinite(h)])
    # Caps from the top down. The least Σ h under a cap only grows as the cap falls, so
    # the least found under T bounds every cap T' <= T: those with
    # least_T + T' + a* >= best are skipped unseen.
    tol = 1 + 1e-12
    i = int(np.searchsorted(caps, best * tol - a_low[0] - least_all[0, 0], "left")) - 1
    while i >= 0:
        T = caps[i]
        h_T = np.where(g <= T, h, np.inf)
        least, _ = least_sums(h_T)
        if not np.isfinite(least[0, 0]):
            break  # no split keeps every stage under T, nor under any lower cap
        if least[0, 0] + T + a_low[0] < best * tol:
            val, totals = _labels(h_T, r, a, sigma, omega, least, a_low, T, best, reach)
            if totals is not None and val < best:
                best, best_totals = val, totals
        limit = best * tol - a_low[0] - least[0, 0]  # a cap T' <= T must be below this
        i = min(i - 1, int(np.searchsorted(caps, limit, "left")) - 1)
    if best_totals is None:
        return math.inf, None
    return split_value(tables, best_totals), best_totals


def _labels(h, r, a, sigma, omega, least, a_low, T, best, reach):
    """The label-correcting DP of :func:`exact_totals` for one cap T."""
    p, L1 = h.shape
    L = L1 - 1
    lab = {"j": np.zeros(1, dtype=np.int64), "H": np.zeros(1), "X": np.zeros(1), "P": np.zeros(1)}
    history = []
    nn = np.arange(1, L + 1)
    for s in range(p):
        j, src, n, H, X, P = _extend(lab, s, nn, h, r, a, sigma, omega, reach, a_low)
        bound = H + least[s + 1, j] + T + np.maximum(X, a_low[s + 1])
        ok = bound < best * (1 + 1e-12)
        j, src, n, H, X, P = (x[ok] for x in (j, src, n, H, X, P))
        if len(j) == 0:
            return math.inf, None
        keep = _undominated(j, np.stack([H, X, -P], axis=1))
        lab = {"j": j[keep], "H": H[keep], "X": X[keep], "P": P[keep]}
        history.append((src[keep], n[keep]))
    total = lab["H"] + T + lab["X"]  # every label ends at j = L (least[p] is inf elsewhere)
    i = int(np.argmin(total))
    return float(total[i]), _backtrack(history, i)


def _extend(lab, s, nn, h, r, a, sigma, omega, reach, a_low):
    """Every label extended by stage s taking n = 1.. layers (finite h, j <= L):
    ``(j, src, n, H, X, P)``, src the label extended (both label DPs share this step)."""
    L = len(nn)
    j = (lab["j"][:, None] + nn[None, :]).ravel()
    src = np.repeat(np.arange(len(lab["j"])), L)
    n = np.tile(nn, len(lab["j"]))
    ok = j <= L
    j, src, n = j[ok], src[ok], n[ok]
    H = lab["H"][src] + h[s, n]
    ok = np.isfinite(H)
    j, src, n, H = j[ok], src[ok], n[ok], H[ok]
    P0 = lab["P"][src]
    X = np.maximum(lab["X"][src], np.maximum(0.0, r[s, n] - P0 - omega[s, n]) + a[s, n])
    P = P0 + sigma[s, n]
    X, P = _canonical(X, P, s, reach, a_low)
    return j, src, n, H, X, P


def _backtrack(history, i: int) -> list[int]:
    """Per-stage layer totals of final label i, from the (src, n) pairs of each stage."""
    totals = []
    for src, n in reversed(history):
        totals.append(int(n[i]))
        i = int(src[i])
    return totals[::-1]
