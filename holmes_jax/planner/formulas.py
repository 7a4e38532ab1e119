"""Closed-form times: point-to-point, ring collectives, the pipeline, the exposed tail.

Notation (``docs/design.md``): n ranks, S bytes, bandwidth B (bytes/s), latency α (s), c
calls (one collective per parameter leaf, as the trainer issues them).

- point-to-point ``S/B + α``;
- ring all-reduce ``2(n−1)/n·S/B + c·2(n−1)·α``; reduce-scatter and all-gather each half;
  hierarchical: reduce-scatter inside, all-reduce the 1/n_inner shards across, all-gather;
- pipeline (GPipe, 1F1B) ``Σ τ_s + (m−1)·max τ_s``; interleaved with v chunks per device
  ``m·max τ_s + (Σ τ_s − max τ_s)/v``; every schedule as ``Σ_s h_s + max_s g_s``
  (:func:`pipeline_terms`, ZB-H1 included);
- the iteration's tail past the pipeline (:func:`exposed_tail`);
- a layer's stored activations (Korthikanti et al. 2022, :func:`layer_activation_bytes`).

Pure Python + NumPy; no jax import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from holmes_jax.core.spec import ModelSpec


def layer_activation_bytes(
    model: ModelSpec, b: int, t: int, act_bytes: int = 2, sequence_parallel: bool = False
) -> float:
    """Activation bytes one layer stores per device for its backward, without recompute:
    ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` at 2 bytes per element (Korthikanti et al. 2022,
    tensor parallel; the 1-byte dropout masks included), scaled to ``act_bytes``. With
    sequence parallelism the 10 bytes outside attention and MLP are split over t too:
    ``34/t + 5·a·s/(h·t)``."""
    h, s, a = model.hidden_size, model.seq_len, model.num_heads
    outside = 10 / t if sequence_parallel else 10
    return s * b * h * (outside + 24 / t + 5 * a * s / (h * t)) * act_bytes / 2


SCALE_BYTES = 4  # int8 / fp8 crossings: one fp32 scale per token row


def wire_bytes(fmt: str, rows: int, hidden: int, act_bytes: int) -> int:
    """Bytes of ``rows`` token rows of ``hidden`` values sent in ``parallel.cross_island_dtype``
    ``fmt`` (``same``: ``act_bytes`` each; bf16: 2; int8 / fp8: 1 plus a 4-byte scale per row)."""
    if fmt == "same":
        return rows * hidden * act_bytes
    if fmt == "bf16":
        return rows * hidden * 2
    return rows * (hidden + SCALE_BYTES)


def codec_time(act: float, wire: float, send_bw: float, recv_bw: float) -> float:
    """Encode on the sender and decode on the receiver: each a memory-bound pass that reads
    one form of the activation and writes the other (``act`` and ``wire`` bytes)."""
    return (act + wire) / send_bw + (act + wire) / recv_bw


def p2p_time(nbytes: float, bytes_per_s: float, latency_s: float = 0.0) -> float:
    """One point-to-point transfer."""
    return nbytes / bytes_per_s + latency_s if nbytes > 0 else 0.0


def ring_allreduce_time(nbytes: float, n: int, bytes_per_s: float, latency_s=0.0, calls=1) -> float:
    """Ring all-reduce of ``nbytes`` in total, split over ``calls`` collectives:
    ``2(n−1)/n·S/B + calls·2(n−1)·α``."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bytes_per_s + calls * 2 * (n - 1) * latency_s


def reduce_scatter_time(nbytes: float, n: int, bytes_per_s: float, latency_s=0.0, calls=1) -> float:
    """Ring reduce-scatter of ``nbytes`` (the full buffer): half an all-reduce."""
    return 0.5 * ring_allreduce_time(nbytes, n, bytes_per_s, latency_s, calls)


def all_gather_time(nbytes: float, n: int, bytes_per_s: float, latency_s=0.0, calls=1) -> float:
    """Ring all-gather producing ``nbytes`` per rank: half an all-reduce."""
    return 0.5 * ring_allreduce_time(nbytes, n, bytes_per_s, latency_s, calls)


def hierarchical_allreduce_time(
    nbytes: float, inner: tuple[int, float, float], outer: tuple[int, float, float]
) -> float:
    """Reduce-scatter inside, all-reduce the 1/n_inner shards across, all-gather inside.

    Args:
      nbytes: buffer size per rank.
      inner, outer: (ranks, bytes/s, latency s) of the inner and outer level.
    """
    n_in, bw_in, lat_in = inner
    n_out, bw_out, lat_out = outer
    return (
        reduce_scatter_time(nbytes, n_in, bw_in, lat_in)
        + ring_allreduce_time(nbytes / n_in, n_out, bw_out, lat_out)
        + all_gather_time(nbytes, n_in, bw_in, lat_in)
    )


def pipeline_time(
    stage_times: Sequence[float], microbatches: int, virtual_stages: int = 1
) -> float:
    """GPipe / 1F1B makespan ``Σ τ_s + (m−1)·max τ_s``; interleaved with v chunks per
    device, the fill and drain shrink v-fold: ``m·max τ_s + (Σ τ_s − max τ_s)/v``."""
    peak = max(stage_times)
    return float(microbatches * peak + (sum(stage_times) - peak) / virtual_stages)


def pipeline_terms(
    schedule: str,
    fwd: np.ndarray,
    bwd_input: np.ndarray,
    weight: np.ndarray,
    microbatches: int,
    stages: int,
    virtual_stages: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-stage ``(h, g)`` with pipeline makespan ``Σ_s h_s + max_s g_s``.

    F, B, W are one micro-batch's forward, input-gradient and weight-gradient times of a
    stage (any array shape; each stage's chunks together), τ = F + B + W, m micro-batches,
    p stages, v chunks:

    - ``gpipe``, ``1f1b``: ``h = τ``, ``g = (m−1)·τ``: ``Σ τ + (m−1)·max τ``.
    - ``interleaved``, m >= p: ``h = τ/v``, ``g = (m − 1/v)·τ``: ``m·max τ + (Σ τ − max τ)/v``;
      m < p (groups of m micro-batches): ``h = τ``, ``g = (m−1)·τ/v``.
    - ``zb`` (ZB-H1), m >= p: ``h = τ − 2W``, ``g = (m−1)·τ + 2W``; for equal stages
      ``m·τ + (p−1)(F + B − W)`` (Qi et al. 2023); m < p (too few micro-batches to defer
      every W into the drain): ``h = F + B``, ``g = (m−1)(F + B) + W``.

    Exact against the schedule tables (:func:`holmes_jax.planner.schedule.simulate_makespan`)
    for equal stages, and for GPipe on uneven ones; for 1F1B on uneven stages an upper
    bound (the bottleneck stage's warm-up forwards partly cover the first micro-batch's
    round trip through the stages behind it), interleaved and ZB-H1 within 15% both ways
    for speeds within 4x; ``tests/planner/test_schedule_cost.py``.
    """
    m, p, v = microbatches, stages, virtual_stages
    tau = fwd + bwd_input + weight
    if schedule == "interleaved":
        if m >= p:
            return tau / v, (m - 1 / v) * tau
        return tau, (m - 1) * tau / v
    if schedule == "zb":
        if m >= p:
            return tau - 2 * weight, (m - 1) * tau + 2 * weight
        return fwd + bwd_input, (m - 1) * (fwd + bwd_input) + weight
    return tau, (m - 1) * tau


def exposed_tail(
    reduce_s: Sequence[float],
    after_s: Sequence[float],
    bwd_s: Sequence[float],
    overlap: bool,
    sync: bool = False,
    own_s: Sequence[float] | None = None,
) -> tuple[float, int]:
    """Time the iteration runs past the pipeline, and the stage that sets it.

    Stage s finishes its last backward ``Σ_{k<s} bwd_k`` before the pipeline ends, and its
    reduction can start layer by layer during that last backward (``own_s``, default
    ``bwd_s``), so with ``overlap`` it hides behind ``slack_s = Σ_{k<s} bwd_k + own_s``;
    then ``after_s`` (optimizer step + parameter all-gather) follows. With ``sync``
    (collectives that block the device) each stage reduces inside its own lockstep tick,
    so the reductions add up: ``Σ_s reduce_s + max_s after_s``.
    """
    if sync:
        arg = int(np.argmax(after_s))
        return float(np.sum(reduce_s) + after_s[arg]), arg
    own = bwd_s if own_s is None else own_s
    prefix, best, arg = 0.0, -math.inf, 0
    for s, (red, after) in enumerate(zip(reduce_s, after_s, strict=True)):
        slack = prefix + own[s]
        prefix += bwd_s[s]
        tail = max(0.0, red - (slack if overlap else 0.0)) + after
        if tail > best:
            best, arg = tail, s
    return float(best), arg
