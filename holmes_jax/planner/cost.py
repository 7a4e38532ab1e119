"""Analytic cost model of one training iteration: per-stage time and memory tables.

Notation (``docs/design.md``): L layers, hidden h, seq s, vocab V, micro-batch b, m
micro-batches, p stages, d data-parallel, t tensor-parallel, r replicas (data parallel
across islands), β bytes per element. Times are seconds, sizes bytes, rates per second.
The FLOP counts live in :mod:`holmes_jax.core.spec`, the closed-form collective and
pipeline times in :mod:`holmes_jax.planner.formulas`, the memory model in
:mod:`holmes_jax.planner.memory`; this module combines them per stage and layer count
(:func:`stage_costs`) and predicts one split's step (:func:`predict`).

- Compute per micro-batch: layer forward, backward 2x forward, plus what the remat
  policy reruns; element-wise work priced as memory traffic; the LM head on the last
  stage.
- Pipeline (GPipe and 1F1B): ``Σ τ_s + (m−1)·max τ_s`` with τ_s a stage's time per
  micro-batch (compute + tensor all-reduces + point-to-point shifts). The engine
  (:mod:`holmes_jax.runtime.pipeline`) shifts activations forward and gradients backward
  on every tick, 2 ticks per micro-batch, so each tick pays both shifts over the stage's
  slower link (``RunSpec.engine="megatron"``, for the fidelity check: one send per
  micro-batch and direction, and one flat gradient buffer, so one collective call).
- Iteration: pipeline + ``max_s [(rs_s − slack_s)⁺ + opt_s + ag_s]`` where rs is the
  gradient reduction, overlapped with the last backward and the pipeline drain
  (``slack_s = Σ_{k<=s} bwd_k``, one micro-batch's backward per stage), opt the optimizer
  step and ag the ZeRO-1 parameter all-gather. With synchronous collectives (CPU
  runtimes) each stage reduces inside its own last backward tick and the lockstep ticks
  add the stages' reductions up: ``Σ_s rs_s + max_s (opt_s + ag_s)``.

Per-stage speeds and bandwidths come from :mod:`holmes_jax.planner.placement` (which also
holds the placement conventions); measured ones from :mod:`holmes_jax.planner.profiles`.
Pure Python + NumPy; no jax import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import (
    REMAT_POLICIES,
    Layout,
    ModelSpec,
    check_positive,
    head_fwd_flops,
    iteration_flops,
    layer_fwd_flops,
    scores_fwd_flops,
)
from holmes_jax.planner.formulas import (
    all_gather_time,
    exposed_tail,
    layer_activation_bytes,
    p2p_time,
    pipeline_time,
    reduce_scatter_time,
    ring_allreduce_time,
)
from holmes_jax.planner.memory import MemoryInputs, device_memory
from holmes_jax.planner.placement import StageHardware

ENGINES = ("holmes_jax", "megatron")


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class RunSpec:
    """Batch and numerics of a run (everything but the layout)."""

    global_batch_size: int  # sequences per optimizer step
    act_bytes: int = 2  # activations, p2p and tensor all-reduces (β)
    param_bytes: int = 2  # working copy of the parameters
    grad_bytes: int = 4  # gradients as reduced over data-parallel ranks
    optimizer_bytes: int = 12  # per parameter: fp32 master + Adam m, v (8 without master)
    remat: str = "none"  # activation policy (holmes_jax.planner.memory): none | full | selective
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
        check_positive("train.global_batch_size", self.global_batch_size)
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
      hardware: one entry per stage (:func:`holmes_jax.planner.placement.stage_hardware`).

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
    (:func:`holmes_jax.planner.memory.device_memory`; a split pads every stage to its largest)."""
    x = memory_inputs(model, run, layout, b)
    n = np.arange(model.num_layers + 1, dtype=np.float64)
    p = layout.stages
    return np.stack([device_memory(x, n, last_stage=s == p - 1).peak for s in range(p)])


def memory_inputs(model: ModelSpec, run: RunSpec, layout: Layout, b: int) -> MemoryInputs:
    """The memory model's inputs for a run with ``b`` sequences per microbatch."""
    return MemoryInputs(
        model=model,
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
