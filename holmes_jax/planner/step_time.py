"""Step prediction of one split: the pipeline, then the gradient reduction and optimizer.

Notation as in :mod:`holmes_jax.planner.stage_costs`, whose per-stage tables
(:class:`~holmes_jax.planner.stage_costs.StageCosts`) this module combines. τ_s = F_s + B_s +
W_s is stage s's time per micro-batch.

- Pipeline, for every schedule ``Σ_s h_s + max_s g_s`` (:func:`schedule_terms`,
  :func:`holmes_jax.planner.formulas.pipeline_terms`):
  GPipe and 1F1B ``Σ τ_s + (m−1)·max τ_s``; interleaved (chunks priced through their
  stage's total) ``m·max τ_s + (Σ τ_s − max τ_s)/v``; ZB-H1 (Qi et al. 2023)
  ``Σ_s (τ_s − 2W_s) + max_s [(m−1)·τ_s + 2W_s]``, which for equal stages is
  ``m·τ + (p−1)(F + B − W)`` against 1F1B's ``m·τ + (p−1)(F + B + W)``.
  :func:`holmes_jax.planner.draw.simulate_table` checks each against the schedule tables.
- Iteration: pipeline + ``max_s [(rs_s − slack_s)⁺ + opt_s + ag_s]``. rs is the gradient
  reduction, overlapped with the stage's last backward and the pipeline drain, opt the
  optimizer step, ag the ZeRO-1 parameter all-gather. ``slack_s = Σ_{k<s} σ_k + ω_s``.
  Under 1F1B and GPipe σ = ω = one micro-batch's backward, interleaved a chunk's (bwd/v).
  Under ZB σ, ω are the earlier stages' input-gradient passes and stage 0's last W, less
  the W's stage s defers past its last B.
- Synchronous collectives (CPU runtimes) reduce each stage inside its own last backward
  tick, and the lockstep ticks add the reductions up: ``Σ_s rs_s + max_s (opt_s + ag_s)``.
  With one gradient bucket per step (``parallel.grad_buckets``) all stages reduce after
  the loop: ``max_s (rs_s + opt_s + ag_s)``.
- With blocking sends :func:`with_lockstep` re-prices the pipeline part of one chosen split
  tick by tick (:func:`lockstep_pipeline`: the stages a tick's sends link wait for each
  other). The searches keep the closed forms.

Pure Python + NumPy; no jax import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from holmes_jax.core.spec import check_split, iteration_flops
from holmes_jax.planner.formulas import exposed_tail, pipeline_terms
from holmes_jax.planner.schedule import BWD, FWD, WGT, make_schedule
from holmes_jax.planner.stage_costs import StageCosts

# --------------------------------------------------------------------------- prediction


@dataclass(frozen=True)
class Prediction:
    """Predicted iteration of one split; ``breakdown`` terms sum to ``step_s``."""

    layers_per_stage: tuple[int, ...]
    step_s: float
    breakdown: dict[str, float]
    stage_fwd_s: tuple[float, ...]  # per micro-batch
    stage_bwd_s: tuple[float, ...]
    memory_gb: tuple[float, ...]  # per device of each stage
    memory_limit_gb: tuple[float, ...]
    tflops_per_device: float  # hardware FLOPs (Megatron's formula when recomputing)
    model_tflops_per_device: float  # model FLOPs (no recompute)
    samples_per_s: float
    schedule: str = "1f1b"
    virtual_stages: int = 1
    stage_weight_s: tuple[float, ...] = ()  # the weight-gradient part W of stage_bwd_s
    bubble_fraction: float = 0.0  # idle share of the stages' pipeline time
    p2p_bytes: tuple[float, ...] = ()  # per step across each stage boundary (wrap last)

    @property
    def fits(self) -> bool:
        return all(m <= c for m, c in zip(self.memory_gb, self.memory_limit_gb, strict=True))


def lockstep_pipeline(costs: StageCosts, layers_per_stage: Sequence[int]) -> float:
    """The pipeline part of a step when every send blocks (CPU runtimes such as gloo).

    The engine runs the schedule's tables tick by tick, each stage its own op, then the
    tick's sends as ``ppermute``s that neither side of a pair leaves before the bytes have
    arrived. Each stage keeps a clock: a tick adds its op; the stages that a tick's sends
    link (directly or through a chain of pairs) leave together at the latest of their
    clocks plus the slowest of their sends (one tick's sends run at once). A stage that
    sends and receives nothing at a tick waits for no one, so between two sends a stage
    runs its ops back to back: under 1F1B a fast forward on one stage and a slow backward
    on the other do not each cost the backward. The closed forms of :func:`predict` let a
    send overlap the receiver's other work, which blocking sends do not allow; this
    matters most under ZB-H1, whose forward and backward sends fall on different ticks.
    Per op: a stage's forward (backward) micro-batch time less its sends
    (``shift_f``/``shift_b``), over v chunks. Under ZB-H1 B and W are priced separately.
    """
    lay = costs.layout
    p, v = lay.stages, lay.virtual_stages
    split = check_split(layers_per_stage, p, costs.model.num_layers, v)
    idx = (np.arange(p), np.array(stage_totals(split, p, v)))
    sched = make_schedule(lay.schedule, p, lay.microbatches, v)
    send_f, send_b = costs.shift_f / v, costs.shift_b / v  # (p,) per op
    weight = costs.weight[idx] / v
    fwd = costs.fwd[idx] / v - send_f
    bwd = costs.bwd[idx] / v - send_b - (weight if sched.split_backward else 0.0)
    ops = sched.op  # [ticks, p]
    run = np.select([ops == FWD, ops == BWD, ops == WGT], [fwd, bwd, weight], 0.0)
    clock = np.zeros(p)  # when each stage is done with the ticks so far
    for t, (pairs_f, pairs_b) in enumerate(zip(sched.fwd_pairs, sched.bwd_pairs, strict=True)):
        clock += run[t]
        sends = [(a, b, send_f[a]) for a, b in pairs_f] + [(a, b, send_b[a]) for a, b in pairs_b]
        for group, send in _linked(p, sends):
            clock[group] = clock[group].max() + send
    return float(clock.max())


def _linked(p: int, sends: list[tuple[int, int, float]]) -> list[tuple[list[int], float]]:
    """The groups of stages that one tick's sends ``(src, dst, seconds)`` link (directly or
    through other sends), each with its slowest send; stages that send nothing are in none."""
    group = list(range(p))

    def root(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i

    for a, b, _ in sends:
        group[root(a)] = root(b)
    slowest: dict[int, float] = {}
    for a, _, sec in sends:
        slowest[root(a)] = max(slowest.get(root(a), 0.0), sec)
    return [([i for i in range(p) if root(i) == r], sec) for r, sec in slowest.items()]


def with_lockstep(prediction: Prediction, costs: StageCosts) -> Prediction:
    """``prediction`` with its pipeline part priced by :func:`lockstep_pipeline` (what a
    run on blocking collectives gets): the gradient sync and optimizer after it are kept,
    the difference goes to the bubble term."""
    lay = costs.layout
    b = prediction.breakdown
    tail = b["grad_sync"] + b["optimizer"]
    pipe = lockstep_pipeline(costs, prediction.layers_per_stage)
    busy = b["compute"] + b["tensor_comm"] + b["p2p"]
    breakdown = dict(b, bubble=float(pipe - busy))
    step = float(pipe + tail)
    tau = np.array(prediction.stage_fwd_s) + np.array(prediction.stage_bwd_s)
    scale = prediction.step_s / step
    return dataclasses.replace(
        prediction,
        step_s=step,
        breakdown=breakdown,
        tflops_per_device=prediction.tflops_per_device * scale,
        model_tflops_per_device=prediction.model_tflops_per_device * scale,
        samples_per_s=prediction.samples_per_s * scale,
        bubble_fraction=float(1.0 - lay.microbatches * tau.sum() / (lay.stages * pipe)),
    )


def schedule_terms(costs: StageCosts) -> tuple[np.ndarray, ...]:
    """The schedule's per-stage tables ``(h, g, σ, ω)``, each (p, L+1) by the stage's layers.

    Pipeline makespan ``Σ_s h_s + max_s g_s``
    (:func:`holmes_jax.planner.formulas.pipeline_terms`); the reduction of stage s hides
    behind ``slack_s = Σ_{k<s} σ_k + ω_s`` (:func:`holmes_jax.planner.formulas.exposed_tail`).
    """
    lay = costs.layout
    f, b, w = costs.fwd, costs.bwd, costs.weight
    h, g = pipeline_terms(
        lay.schedule, f, b - w, w, lay.microbatches, lay.stages, lay.virtual_stages
    )
    v = lay.virtual_stages
    if lay.schedule == "zb":
        # ZB-H1 fills the drain with deferred W's: stage 0 ends with its last B and W; stage
        # s >= 1 ends with its last B and up to min(s, m−1) deferred W's after it, so its
        # reduction hides behind Σ_{k<s} B_k + W_0 − min(s, m−1)·W_s (its own last W
        # included).
        sigma = b - w
        sigma[0] = b[0]
        d = np.minimum(np.arange(lay.stages), lay.microbatches - 1)[:, None]
        omega = -d * w
        omega[0] = w[0]
    else:  # the last (chunk's) backward propagates to stage 0 after stage s's
        sigma = omega = b / v
    return h, g, sigma, omega


def stage_totals(split: Sequence[int], stages: int, chunks: int) -> list[int]:
    """Layers on each stage of a split with one entry per virtual stage (chunk c of stage s
    is entry ``c·stages + s``)."""
    return [sum(split[c * stages + s] for c in range(chunks)) for s in range(stages)]


def even_chunks(totals: Sequence[int], chunks: int) -> list[int]:
    """The split with ``chunks`` chunks per stage, each stage's layers as even as possible
    (the first chunks one more), in virtual-stage order."""
    stages = len(totals)
    out = [0] * (stages * chunks)
    for s, n in enumerate(totals):
        q, r = divmod(int(n), chunks)
        for c in range(chunks):
            out[c * stages + s] = q + (1 if c < r else 0)
    return out


def predict(costs: StageCosts, layers_per_stage: Sequence[int]) -> Prediction:
    """Predicted step time of a split, broken into named terms.

    Args:
      costs: tables from :func:`stage_costs`.
      layers_per_stage: one count per stage, each >= 1, summing to L; with v chunks per
        device one per virtual stage (chunk c of stage s is entry ``c·p + s``). Time
        depends on each stage's total; memory on the largest entry (every chunk pads to it).

    Returns:
      :class:`Prediction` whose breakdown has compute, tensor_comm, p2p (the bottleneck
      stage's m micro-batches), bubble (the rest of the pipeline: fill and drain), grad_sync
      (exposed gradient reduction + parameter all-gather) and optimizer.

    Raises:
      ConfigError: a split with the wrong length, an empty stage or the wrong total.
    """
    lay = costs.layout
    p, v = lay.stages, lay.virtual_stages
    split = check_split(layers_per_stage, p, costs.model.num_layers, v)
    totals = stage_totals(split, p, v)
    idx = (np.arange(p), np.array(totals))
    fwd, bwd = costs.fwd[idx], costs.bwd[idx]
    tau = fwd + bwd
    m = lay.microbatches
    h, g, sigma, omega = (x[idx] for x in schedule_terms(costs))
    pipe = float(h.sum() + g.max())
    after = costs.optimizer[idx] + costs.gather[idx]
    run = costs.run
    tail, s_tail = exposed_tail(
        costs.reduce[idx],
        after,
        sigma,
        run.reduction == "overlap",
        sync=run.reduction == "sync",
        own_s=omega,
    )
    step = pipe + tail
    k = int(np.argmax(tau))
    opt = float(costs.optimizer[idx][s_tail])
    breakdown = {
        "compute": m * float(costs.compute[idx][k]),
        "tensor_comm": m * float(costs.tensor[idx][k]),
        "p2p": m * float(costs.p2p[k]),
        "bubble": pipe - m * float(tau[k]),
        "grad_sync": float(tail - opt),
        "optimizer": opt,
    }
    n_dev = lay.num_devices
    batch = costs.run.global_batch_size
    hw_flops = iteration_flops(costs.model, batch, costs.run.remat)
    model_flops = iteration_flops(costs.model, batch, False)
    return Prediction(
        layers_per_stage=tuple(split),
        step_s=float(step),
        breakdown=breakdown,
        stage_fwd_s=tuple(float(x) for x in fwd),
        stage_bwd_s=tuple(float(x) for x in bwd),
        memory_gb=tuple(float(x) / 1e9 for x in costs.memory[:, max(split)]),
        memory_limit_gb=tuple(float(x) / 1e9 for x in costs.capacity),
        tflops_per_device=float(hw_flops / n_dev / step / 1e12),
        model_tflops_per_device=float(model_flops / n_dev / step / 1e12),
        samples_per_s=float(batch / step),
        schedule=lay.schedule,
        virtual_stages=v,
        stage_weight_s=tuple(float(x) for x in costs.weight[idx]),
        bubble_fraction=float(1.0 - m * tau.sum() / (p * pipe)),
        p2p_bytes=costs.p2p_bytes,
    )
