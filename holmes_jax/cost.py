"""Analytic cost model of one training iteration: FLOPs, bytes, collectives, pipeline, memory.

Notation (../shared/DESIGN.md): L layers, hidden h, seq s, vocab V, micro-batch b, m
micro-batches, p stages, d data-parallel, t tensor-parallel, r replicas (data parallel
across islands), β bytes per element. Times are seconds, sizes bytes, rates per second.

- FLOPs per layer forward: ``2(4 + 2·mlp_ratio)·b·s·h² + 4·b·s²·h`` (= 24bsh² + 4bs²h for
  mlp_ratio 4); backward 2x forward; full recompute adds one forward. LM head ``2·b·s·h·V``.
- Collectives over n ranks, bandwidth B, latency α, issued as c calls (one per
  parameter leaf, as the trainer does): ring all-reduce ``2(n−1)/n·S/B + c·2(n−1)·α``;
  reduce-scatter and all-gather each half of that (a profile may give them their own B, α).
- Pipeline (GPipe and 1F1B): ``Σ τ_s + (m−1)·max τ_s`` with τ_s a stage's time per
  micro-batch (compute + tensor all-reduces + point-to-point shifts). The engine
  (:mod:`holmes_jax.pipeline`) shifts activations forward and gradients backward on every
  tick, 2 ticks per micro-batch, so each tick pays both shifts over the stage's slower link
  (``RunSpec.engine="megatron"``, for the fidelity check: one send per micro-batch and
  direction, and one flat gradient buffer, so one collective call).
- Iteration: pipeline + ``max_s [(rs_s − slack_s)⁺ + opt_s + ag_s]`` where rs is the
  gradient reduction, overlapped with the last backward and the pipeline drain
  (``slack_s = Σ_{k<=s} bwd_k``, one micro-batch's backward per stage), opt the optimizer
  step and ag the ZeRO-1 parameter all-gather. With synchronous collectives (CPU
  runtimes) each stage reduces inside its own last backward tick and the lockstep ticks
  add the stages' reductions up: ``Σ_s rs_s + max_s (opt_s + ag_s)``.

Per-stage speeds and bandwidths come from :mod:`holmes_jax.placement` (which also holds
the placement conventions); measured ones from :mod:`holmes_jax.profile`. Pure Python +
NumPy; no jax import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from holmes_jax.errors import ConfigError
from holmes_jax.memory import REMAT_POLICIES, MemoryInputs, device_memory

if TYPE_CHECKING:
    from holmes_jax.placement import StageHardware

# Fraction of peak FLOP/s that matmul-heavy transformer layers reach, calibrated once on
# Megatron-LM's published A100 runs (holmes_jax.fidelity, scripts/fidelity_megatron.py).
DEFAULT_EFFICIENCY = 0.58
SCHEDULES = ("gpipe", "1f1b")
ENGINES = ("holmes_jax", "megatron")


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a GPT model (learned positions, pre-LayerNorm, biases, GELU MLP)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    seq_len: int
    vocab_size: int
    mlp_ratio: int = 4
    tied_embeddings: bool = True

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_heads", "seq_len", "vocab_size"):
            _check_positive(f"model.{name}", getattr(self, name))
        _check_positive("model.mlp_ratio", self.mlp_ratio)
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"model.num_heads={self.num_heads}: must divide model.hidden_size="
                f"{self.hidden_size}"
            )

    @property
    def layer_params(self) -> int:
        """QKV + output projection + MLP weights and biases + two LayerNorms."""
        h, r = self.hidden_size, self.mlp_ratio
        return (4 + 2 * r) * h * h + (9 + r) * h

    @property
    def embedding_params(self) -> int:
        """Token and learned position embeddings."""
        return (self.vocab_size + self.seq_len) * self.hidden_size

    @property
    def head_params(self) -> int:
        """Final LayerNorm, plus the LM head matrix when it is not tied."""
        head = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return 2 * self.hidden_size + head

    @property
    def num_params(self) -> int:
        return self.num_layers * self.layer_params + self.embedding_params + self.head_params

    # Parameter leaves (one collective call each in the trainer's gradient reduction and
    # parameter all-gather): LayerNorm scale+bias x2, QKV, attention output, MLP in and out
    # kernels+biases; token + position embeddings; final LayerNorm (+ untied head).
    layer_leaves = 12
    embedding_leaves = 2

    @property
    def head_leaves(self) -> int:
        return 2 + (0 if self.tied_embeddings else 1)


@dataclass(frozen=True)
class RunSpec:
    """Batch and numerics of a run (everything but the layout)."""

    global_batch_size: int  # sequences per optimizer step
    act_bytes: int = 2  # activations, p2p and tensor all-reduces (β)
    param_bytes: int = 2  # working copy of the parameters
    grad_bytes: int = 4  # gradients as reduced over data-parallel ranks
    optimizer_bytes: int = 12  # per parameter: fp32 master + Adam m, v (8 without master)
    remat: str = "none"  # activation policy (holmes_jax.memory): none | full | selective
    attention: str = "xla"  # xla (fp32 [b, a/t, s, s] transients) | cudnn (fused)
    zero1: bool = True  # optimizer state sharded over data-parallel ranks
    overlap_grad_sync: bool = True  # gradient reduction overlapped with the pipeline drain
    # Collectives block the device until done (CPU runtimes such as gloo): the stages'
    # in-loop reductions add up instead of hiding behind each other (module doc).
    sync_collectives: bool = False
    # The implementation priced: "holmes_jax" (this trainer: a collective per parameter
    # leaf, both shifts on every pipeline tick) or "megatron" (Megatron-LM, for the
    # fidelity check: one flat gradient buffer, a send per micro-batch and direction).
    engine: str = "holmes_jax"
    memory_fraction: float = 0.9  # usable fraction of device memory

    def __post_init__(self):
        _check_positive("train.global_batch_size", self.global_batch_size)
        if self.engine not in ENGINES:
            raise ConfigError(f"engine='{self.engine}': must be one of {', '.join(ENGINES)}")
        if not 0 < self.memory_fraction <= 1:
            raise ConfigError(f"memory_fraction={self.memory_fraction}: must be in (0, 1]")
        if self.remat not in REMAT_POLICIES:
            raise ConfigError(
                f"model.remat='{self.remat}': must be one of {', '.join(REMAT_POLICIES)}"
            )

    @property
    def recompute(self) -> bool:
        """Full recomputation: the backward reruns every layer's forward."""
        return self.remat == "full"


@dataclass(frozen=True)
class Layout:
    """Parallel degrees: r replicas x p stages x d data x t tensor, and the schedule."""

    stages: int
    data: int
    tensor: int
    microbatches: int
    schedule: str = "1f1b"
    replica: int = 1  # data parallel across islands (one pipeline per island)
    # Interleaved 1F1B (Narayanan et al. 2021): v model chunks per device shrink the bubble
    # v-fold and multiply p2p traffic by v. Modelled for fidelity; the planner uses 1.
    virtual_stages: int = 1

    def __post_init__(self):
        for name in ("stages", "data", "tensor", "microbatches", "replica", "virtual_stages"):
            _check_positive(f"parallel.{name}", getattr(self, name))
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"parallel.schedule='{self.schedule}': must be one of {', '.join(SCHEDULES)}"
            )
        if self.virtual_stages > 1 and (self.schedule != "1f1b" or self.stages < 2):
            raise ConfigError(
                f"virtual_stages={self.virtual_stages}: needs schedule 1f1b and >= 2 stages"
            )

    @property
    def num_devices(self) -> int:
        return self.replica * self.stages * self.data * self.tensor

    def microbatch_size(self, global_batch_size: int) -> int:
        """Sequences per micro-batch per data-parallel rank.

        Raises:
          ConfigError: the global batch does not split evenly.
        """
        parts = self.replica * self.data * self.microbatches
        if global_batch_size % parts:
            raise ConfigError(
                f"train.global_batch_size={global_batch_size}: must be divisible by "
                f"replica*data*microbatches = {self.replica}*{self.data}*{self.microbatches}"
            )
        return global_batch_size // parts


# --------------------------------------------------------------------------- formulas


def layer_fwd_flops(model: ModelSpec, b: int) -> float:
    """Forward FLOPs of one transformer layer on ``b`` sequences (whole layer, all t)."""
    h, s, r = model.hidden_size, model.seq_len, model.mlp_ratio
    return 2 * (4 + 2 * r) * b * s * h * h + 4 * b * s * s * h


def head_fwd_flops(model: ModelSpec, b: int) -> float:
    """Forward FLOPs of the LM head (logits) on ``b`` sequences."""
    return 2 * b * model.seq_len * model.hidden_size * model.vocab_size


def scores_fwd_flops(model: ModelSpec, b: int) -> float:
    """Forward FLOPs of one layer's attention scores q·kᵀ on ``b`` sequences (what
    selective remat reruns in the backward)."""
    return 2 * b * model.seq_len * model.seq_len * model.hidden_size


def iteration_flops(model: ModelSpec, batch: int, recompute: bool | str) -> float:
    """FLOPs of one iteration: 3 passes per unit, plus what the remat policy reruns.

    ``recompute``: a policy (``none``, ``selective``: the attention scores q·kᵀ,
    ``2·b·s²·h`` per layer; ``full``: a whole forward per layer) or a bool (True = full).
    Full is the hardware count Megatron-LM and Holmes report and equals
    :func:`megatron_flops` for mlp_ratio 4; none is the model FLOPs.
    """
    policy = {True: "full", False: "none"}.get(recompute, recompute)
    L = model.num_layers
    extra = {
        "full": L * layer_fwd_flops(model, batch),
        "selective": L * scores_fwd_flops(model, batch),
    }
    base = 3 * L * layer_fwd_flops(model, batch) + 3 * head_fwd_flops(model, batch)
    return base + extra.get(policy, 0.0)


def megatron_flops(model: ModelSpec, batch: int, recompute: bool = True) -> float:
    """Narayanan et al. 2021, eq. 3: ``96·B·s·L·h²·(1 + s/6h + V/16Lh)`` (recompute).

    Without recompute: ``72·B·s·L·h²·(1 + s/6h + V/12Lh)``. Assumes mlp_ratio 4.
    """
    L, h, s, V = model.num_layers, model.hidden_size, model.seq_len, model.vocab_size
    if recompute:
        return 96 * batch * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return 72 * batch * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))


def layer_activation_bytes(model: ModelSpec, b: int, t: int, act_bytes: int = 2) -> float:
    """Activation bytes one layer stores per device for its backward, without recompute:
    ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` at 2 bytes per element (Korthikanti et al. 2022,
    tensor parallel without sequence parallelism; the 1-byte dropout masks included),
    scaled to ``act_bytes``."""
    h, s, a = model.hidden_size, model.seq_len, model.num_heads
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) * act_bytes / 2


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


def exposed_tail(
    reduce_s: Sequence[float],
    after_s: Sequence[float],
    bwd_s: Sequence[float],
    overlap: bool,
    sync: bool = False,
) -> tuple[float, int]:
    """Time the iteration runs past the pipeline, and the stage that sets it.

    Stage s finishes its last backward ``Σ_{k<s} bwd_k`` before the pipeline ends, and its
    reduction can start layer by layer during that last backward, so with ``overlap`` it
    hides behind ``slack_s = Σ_{k<=s} bwd_k``; then ``after_s`` (optimizer step +
    parameter all-gather) follows. With ``sync`` (collectives that block the device) each
    stage reduces inside its own lockstep tick, so the reductions add up:
    ``Σ_s reduce_s + max_s after_s``.
    """
    if sync:
        arg = int(np.argmax(after_s))
        return float(np.sum(reduce_s) + after_s[arg]), arg
    slack, best, arg = 0.0, -math.inf, 0
    for s, (red, after) in enumerate(zip(reduce_s, after_s, strict=True)):
        slack += bwd_s[s]
        tail = max(0.0, red - (slack if overlap else 0.0)) + after
        if tail > best:
            best, arg = tail, s
    return best, arg


def _check_positive(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}={value!r}: must be an integer >= 1")


# --------------------------------------------------------------------------- per stage


@dataclass(frozen=True)
class StageCosts:
    """Per-stage cost tables indexed ``[stage, n]`` for n = 0..L layers on that stage.

    Every entry is per device per micro-batch (times) or per iteration (sync, optimizer),
    and includes the embedding on stage 0 and the head on the last stage.
    """

    model: ModelSpec
    run: RunSpec
    layout: Layout
    microbatch_size: int
    compute: np.ndarray  # (p, L+1) fwd + bwd (+ recompute) seconds per micro-batch
    tensor: np.ndarray  # (p, L+1) tensor all-reduces per micro-batch
    p2p: np.ndarray  # (p,) sends to the neighbours per micro-batch
    fwd: np.ndarray  # (p, L+1) forward part of compute + tensor + p2p
    bwd: np.ndarray  # (p, L+1) backward part
    reduce: np.ndarray  # (p, L+1) gradient reduction (may overlap the pipeline drain)
    optimizer: np.ndarray  # (p, L+1) optimizer step
    gather: np.ndarray  # (p, L+1) ZeRO-1 parameter all-gather
    memory: np.ndarray  # (p, L+1) bytes per device
    capacity: np.ndarray  # (p,) usable bytes per device
    islands: tuple[int, ...]  # island of each stage

    @property
    def tau(self) -> np.ndarray:
        """(p, L+1) stage time per micro-batch: compute + tensor + p2p."""
        return self.fwd + self.bwd

    @property
    def tail(self) -> np.ndarray:
        """(p, L+1) sync + optimizer after the stage's last backward, nothing overlapped."""
        return self.reduce + self.optimizer + self.gather


def stage_costs(
    model: ModelSpec, run: RunSpec, layout: Layout, hardware: Sequence[StageHardware]
) -> StageCosts:
    """Build the cost tables of every stage for every possible layer count.

    Args:
      model, run, layout: what is trained and how it is split.
      hardware: one entry per stage (:func:`holmes_jax.placement.stage_hardware`).

    Returns:
      :class:`StageCosts`.

    Raises:
      ConfigError: the global batch does not split into the layout's micro-batches.
    """
    p, t, d = layout.stages, layout.tensor, layout.data
    b = layout.microbatch_size(run.global_batch_size)
    L, h, s, V = model.num_layers, model.hidden_size, model.seq_len, model.vocab_size
    n = np.arange(L + 1, dtype=np.float64)[None, :]  # (1, L+1)
    hw = list(hardware)
    col = lambda f: np.array([f(x) for x in hw], dtype=np.float64)[:, None]
    first = np.zeros((p, 1))
    first[0] = 1.0
    last = np.zeros((p, 1))
    last[-1] = 1.0

    # Compute per device per micro-batch (the t tensor ranks split every matmul).
    lf, hf = layer_fwd_flops(model, b) / t, head_fwd_flops(model, b) / t
    fwd_rate, bwd_rate = col(lambda x: x.fwd_flops), col(lambda x: x.bwd_flops)
    recompute = 1.0 if run.recompute else 0.0
    # Selective remat reruns the attention scores (q·kᵀ) and the element-wise ops.
    selective = 1.0 if run.remat == "selective" else 0.0
    scores_f = scores_fwd_flops(model, b) / t
    # Element-wise work (norms, softmax, dropout, GELU, residuals) is memory bound: each
    # activation byte a layer stores is written in the forward, read and its gradient
    # written in the backward, and written again by a recomputed forward.
    traffic = layer_activation_bytes(model, b, t, run.act_bytes) / col(lambda x: x.mem_bw)
    layer_f = lf / fwd_rate + traffic
    layer_b = 2 * lf / bwd_rate + 2 * traffic + recompute * (lf / fwd_rate + traffic)
    layer_b = layer_b + selective * (scores_f / fwd_rate + traffic)
    if run.engine == "holmes_jax":
        # The pipeline engine, per layer and micro-batch: the layer's weights are sliced out
        # of the stacked [slots, ...] array (read + write) in the forward and again in the
        # backward, and the backward adds the layer's gradient into its fp32 accumulator
        # (read + write). Megatron-LM uses weights in place and fuses the accumulation.
        weights = model.layer_params / t
        mem_bw = col(lambda x: x.mem_bw)
        weight_slice = 2 * weights * run.param_bytes / mem_bw
        layer_f = layer_f + weight_slice
        layer_b = layer_b + weight_slice + 2 * weights * run.grad_bytes / mem_bw
    head_f, head_b = hf / fwd_rate, 2 * hf / bwd_rate
    compute = n * (layer_f + layer_b) + last * (head_f + head_b)

    # Tensor parallel: 2 all-reduces of [b, s, h] per layer forward, 2 backward, 2 more in
    # a recomputed forward; 1 for the vocab-parallel embedding.
    act = b * s * h * run.act_bytes
    ar = col(lambda x: ring_allreduce_time(act, t, *x.tensor))
    tensor_f = n * 2 * ar + first * ar
    tensor_b = n * (2 + 2 * recompute) * ar

    # Point-to-point: every tick (forward or backward) shifts activations s -> s+1 and
    # gradients s -> s-1, each a [b, s, h] buffer; stage s waits for its slower link.
    v = layout.virtual_stages  # every model chunk boundary sends
    send = np.array([v * p2p_time(act, *x.send) if i < p - 1 else 0.0 for i, x in enumerate(hw)])
    recv_grad = np.concatenate([[0.0], send[:-1]])  # stage s sends gradients over link s-1
    if run.engine == "megatron":  # a send per micro-batch and direction
        shift_f, shift_b = send, recv_grad
    else:
        shift_f = shift_b = 2 * np.maximum(send, recv_grad)  # both links, every tick
    fwd = n * layer_f + last * head_f + tensor_f + shift_f[:, None]
    bwd = n * layer_b + last * head_b + tensor_b + shift_b[:, None]

    # Parameters held by one device of each stage (tied head: a copy on the last stage).
    tie_copy = V * h if (model.tied_embeddings and p > 1) else 0
    params = (
        n * model.layer_params
        + first * model.embedding_params
        + last * (model.head_params + tie_copy)
    ) / t
    grads = params * run.grad_bytes
    shards = d if run.zero1 else 1
    calls = (
        n * model.layer_leaves + first * model.embedding_leaves + last * model.head_leaves
    )  # (p, L+1) collectives per reduction or all-gather
    if run.engine == "megatron":  # one contiguous gradient buffer
        calls = np.ones_like(calls)
    reduce = _dp_reduce(grads, calls, layout, hw, run.zero1)
    if tie_copy:
        # First and last stage all-reduce the tied embedding's gradient; under ZeRO-1 each
        # rank only its 1/d shard, after the data-parallel reduce-scatter.
        tie_bytes = V * h / t * run.grad_bytes / shards
        tie = np.array([ring_allreduce_time(tie_bytes, 2, *x.tie) for x in hw])[:, None]
        reduce = reduce + (first + last) * tie
    gather = np.zeros_like(params)
    if run.zero1 and d > 1:
        gather = np.stack(
            [
                all_gather_time(params[i] * run.param_bytes, d, *x.gather_path, calls[i])
                for i, x in enumerate(hw)
            ]
        )
    touched = run.grad_bytes + 2 * run.optimizer_bytes + run.param_bytes  # read/write
    optimizer = params / shards * touched / col(lambda x: x.mem_bw)

    memory = _memory_table(model, run, layout, b)
    return StageCosts(
        model=model,
        run=run,
        layout=layout,
        microbatch_size=b,
        compute=compute,
        tensor=tensor_f + tensor_b,
        p2p=shift_f + shift_b,
        fwd=fwd,
        bwd=bwd,
        reduce=reduce,
        optimizer=optimizer,
        gather=gather,
        memory=memory,
        capacity=np.array([x.memory_bytes for x in hw]),
        islands=tuple(x.island for x in hw),
    )


def _dp_reduce(
    grads: np.ndarray, calls: np.ndarray, layout: Layout, hw: list[StageHardware], zero1: bool
):
    """Gradient reduction per stage, one call per leaf: reduce-scatter (ZeRO-1) or
    all-reduce over ``data``; with replicas, then an all-reduce of the 1/d shards across
    islands."""
    d, r = layout.data, layout.replica
    rows = []
    for i, x in enumerate(hw):
        g, c = grads[i], calls[i]
        row = np.zeros_like(g)
        if zero1 or r > 1:
            row = row + reduce_scatter_time(g, d, *x.scatter_path, c)
        else:
            row = row + ring_allreduce_time(g, d, *x.data, c)
        if r > 1:
            row = row + ring_allreduce_time(g / d, r, *x.cross, c)
            if not zero1:  # plain hierarchical all-reduce: gather the reduced shards back
                row = row + all_gather_time(g, d, *x.gather_path, c)
        rows.append(row)
    return np.stack(rows)


def _memory_table(model: ModelSpec, run: RunSpec, layout: Layout, b: int) -> np.ndarray:
    """(p, L+1) per-device peak bytes when each device holds n layer slots
    (:func:`holmes_jax.memory.device_memory`; a split pads every stage to its largest)."""
    x = memory_inputs(model, run, layout, b)
    n = np.arange(model.num_layers + 1, dtype=np.float64)
    p = layout.stages
    return np.stack([device_memory(x, n, last_stage=s == p - 1).peak for s in range(p)])


def memory_inputs(model: ModelSpec, run: RunSpec, layout: Layout, b: int) -> MemoryInputs:
    """The memory model's inputs for a run with ``b`` sequences per microbatch."""
    return MemoryInputs(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_heads=model.num_heads,
        mlp_size=model.mlp_ratio * model.hidden_size,
        seq_len=model.seq_len,
        vocab_size=model.vocab_size,
        tied_embeddings=model.tied_embeddings,
        layer_params=model.layer_params,
        stages=layout.stages,
        data=layout.data,
        tensor=layout.tensor,
        microbatches=layout.microbatches,
        schedule=layout.schedule,
        microbatch_size=b,
        remat=run.remat,
        attention=run.attention,
        act_bytes=run.act_bytes,
        zero1=run.zero1 and layout.data > 1,
        master=run.optimizer_bytes > 8,
    )


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

    @property
    def fits(self) -> bool:
        return all(m <= c for m, c in zip(self.memory_gb, self.memory_limit_gb, strict=True))


def predict(costs: StageCosts, layers_per_stage: Sequence[int]) -> Prediction:
    """Predicted step time of a split, broken into named terms.

    Args:
      costs: tables from :func:`stage_costs`.
      layers_per_stage: one count per stage, each >= 1, summing to L.

    Returns:
      :class:`Prediction` whose breakdown has compute, tensor_comm, p2p (the bottleneck
      stage's m micro-batches), bubble (the other stages' fill and drain), grad_sync
      (exposed gradient reduction + parameter all-gather) and optimizer.

    Raises:
      ConfigError: a split with the wrong length, an empty stage or the wrong total.
    """
    split = check_split(layers_per_stage, costs.layout.stages, costs.model.num_layers)
    idx = (np.arange(len(split)), np.array(split))
    fwd, bwd = costs.fwd[idx], costs.bwd[idx]
    tau = fwd + bwd
    m = costs.layout.microbatches
    v = costs.layout.virtual_stages
    pipe = pipeline_time(tau, m, v)
    after = costs.optimizer[idx] + costs.gather[idx]
    run = costs.run
    tail, s_tail = exposed_tail(
        costs.reduce[idx], after, bwd, run.overlap_grad_sync, sync=run.sync_collectives
    )
    step = pipe + tail
    k = int(np.argmax(tau))
    opt = float(costs.optimizer[idx][s_tail])
    breakdown = {
        "compute": m * float(costs.compute[idx][k]),
        "tensor_comm": m * float(costs.tensor[idx][k]),
        "p2p": m * float(costs.p2p[k]),
        "bubble": float(tau.sum() - tau[k]) / v,
        "grad_sync": float(tail - opt),
        "optimizer": opt,
    }
    n_dev = costs.layout.num_devices
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
    )


def check_split(layers_per_stage: Sequence[int], stages: int, num_layers: int) -> list[int]:
    """Validate a split: one count >= 1 per stage, summing to the layer count.

    Raises:
      ConfigError: naming the split and the rule it breaks.
    """
    split = [int(x) for x in layers_per_stage]
    if len(split) != stages:
        raise ConfigError(
            f"parallel.layers_per_stage={split}: needs one entry per stage (stages={stages})"
        )
    if min(split) < 1:
        raise ConfigError(f"parallel.layers_per_stage={split}: every stage needs >= 1 layer")
    if sum(split) != num_layers:
        raise ConfigError(
            f"parallel.layers_per_stage={split}: must sum to model.num_layers={num_layers}"
        )
    return split
