"""Per-stage cost tables: the time and memory of every stage for every layer count.

Notation (``docs/design.md``): L layers, hidden h, seq s, vocab V, micro-batch b, m
micro-batches, p stages, v model chunks per device (interleaved), d data-parallel, t
tensor-parallel, r replicas (data parallel across islands), β bytes per element. Times
are seconds, sizes bytes, rates per second. :func:`stage_costs` combines the FLOP counts
(:mod:`holmes_jax.core.spec`), the closed-form collective times
(:mod:`holmes_jax.planner.formulas`) and the memory model (:mod:`holmes_jax.planner.memory`).
:mod:`holmes_jax.planner.step_time` turns the tables into one split's step.

- Compute per micro-batch: layer forward F, backward 2x forward plus what the remat policy
  reruns. Element-wise work is priced as memory traffic. The LM head runs on the last stage.
  The backward splits into the input-gradient part B and the weight-gradient part W (the
  weight matmuls and the gradient accumulation). Zero-bubble (``zb``) defers W.
- Point-to-point: each micro-batch crosses each stage boundary once forward (its
  activations, charged to the sender's F) and once backward (its input gradient, charged
  to the sender's B). Idle ticks send nothing. A tick's forward and backward transfers are
  issued together, and a full-duplex link carries both at once. With v chunks a micro-batch
  crosses the link s → s+1 v times per direction and the wrap link p−1 → 0 v−1 times.
- Collectives per stage: the tensor all-reduces, the gradient reduction over ``data`` (then
  ``replica``) and the ZeRO-1 all-gather, one call per leaf (and layer, per-layer buckets).
  On a layout a profile timed them on (the naive placement's data rings), each call is
  read off the measured times by its size instead of the fitted line.

Per-stage speeds and bandwidths come from :mod:`holmes_jax.planner.placement`; measured
ones from :mod:`holmes_jax.planner.profiles`. Pure Python + NumPy; no jax import.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from holmes_jax.core.plan_request import RunSpec
from holmes_jax.core.spec import (
    Layout,
    ModelSpec,
    head_fwd_flops,
    layer_fwd_flops,
    scores_fwd_flops,
)
from holmes_jax.planner.formulas import (
    all_gather_time,
    codec_time,
    layer_activation_bytes,
    p2p_time,
    reduce_scatter_time,
    ring_allreduce_time,
    wire_bytes,
)
from holmes_jax.planner.memory import (
    MemoryInputs,
    buffer_depth,
    deferred_weight_sets,
    device_memory,
    zb_stash_bytes,
)
from holmes_jax.planner.placement import StageHardware

VIRTUAL_MAX = 4  # most chunks per device the memory tables are priced for (v·L slots)


# --------------------------------------------------------------------------- tables


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
    p2p: np.ndarray  # (p,) sends to the neighbours per micro-batch (all chunks)
    shift_f: np.ndarray  # (p,) of which the forward sends (in fwd)
    shift_b: np.ndarray  # (p,) and the backward ones (in bwd)
    fwd: np.ndarray  # (p, L+1) forward part of compute + tensor + p2p (F)
    bwd: np.ndarray  # (p, L+1) backward part (B + W)
    weight: np.ndarray  # (p, L+1) the weight-gradient part W of bwd (zb defers it)
    reduce: np.ndarray  # (p, L+1) gradient reduction (may overlap the pipeline drain)
    optimizer: np.ndarray  # (p, L+1) optimizer step
    gather: np.ndarray  # (p, L+1) ZeRO-1 parameter all-gather
    # (p, L+1) bytes per device whose largest slot group holds n layers: a stage's n
    # layers (every stage pads to the largest), or with v chunks the largest chunk's n
    # (every chunk pads to it: v·n slots per device).
    memory: np.ndarray
    capacity: np.ndarray  # (p,) usable bytes per device
    islands: tuple[int, ...]  # island of each stage
    p2p_bytes: tuple[float, ...] = ()  # per step across each boundary (all data ranks), wrap last
    # the schedule-free memory breakdown the table came from (with_schedule re-prices it)
    memory_base: dict | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def tau(self) -> np.ndarray:
        """(p, L+1) stage time per micro-batch: compute + tensor + p2p."""
        return self.fwd + self.bwd

    @property
    def tail(self) -> np.ndarray:
        """(p, L+1) sync + optimizer after the stage's last backward, nothing overlapped."""
        return self.reduce + self.optimizer + self.gather

    @property
    def chunks(self) -> int:
        """Model chunks per device (v; 1 but for the interleaved schedule)."""
        return self.layout.virtual_stages

    def fits(self) -> np.ndarray:
        """(p, L+1) whether a stage may hold n layers in all: the engine pads every slot
        group (stage, or chunk) to the largest one, so n fits only if every device fits
        the largest group of the most even split of n (``⌈n/v⌉`` layers per chunk, and
        every chunk needs >= 1 layer)."""
        return self._fits

    @functools.cached_property
    def _fits(self) -> np.ndarray:
        v, L = self.chunks, self.model.num_layers
        every = (self.memory <= self.capacity[:, None]).all(axis=0)  # (L+1,) by group size
        n = np.arange(L + 1)
        ok = every[np.minimum(-(-n // v), L)] & (n >= v)
        return np.broadcast_to(ok, self.memory.shape)


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
    # (p, 1) columns of the stages' speeds: one pass over the hardware
    fwd_rate, bwd_rate, mem_bw = np.array(
        [(x.fwd_flops, x.bwd_flops, x.mem_bw) for x in hw], dtype=np.float64
    ).T[:, :, None]
    first = np.zeros((p, 1))
    first[0] = 1.0
    last = np.zeros((p, 1))
    last[-1] = 1.0

    # Compute per device per micro-batch (the t tensor ranks split every matmul).
    lf, hf = layer_fwd_flops(model, b) / t, head_fwd_flops(model, b) / t
    recompute = 1.0 if run.recompute else 0.0
    # Selective remat reruns the attention scores (q·kᵀ) and the element-wise ops.
    selective = 1.0 if run.remat == "selective" else 0.0
    scores_f = scores_fwd_flops(model, b) / t
    # Element-wise work (norms, softmax, dropout, GELU, residuals) is memory bound: it
    # moves `passes` bytes (its reads and writes) per activation byte the layer stores in
    # the forward, twice that in the backward, and again in a recomputed forward.
    passes = np.array([x.elementwise_passes for x in hw], dtype=np.float64)[:, None]
    stored = layer_activation_bytes(model, b, t, run.act_bytes, run.sequence_parallel)
    traffic = passes * stored / mem_bw
    layer_f = lf / fwd_rate + traffic
    layer_b = 2 * lf / bwd_rate + 2 * traffic + recompute * (lf / fwd_rate + traffic)
    # Megatron-LM's selective recompute reruns attention over V as well as q·kᵀ.
    rerun_scores = 2.0 if run.engine == "megatron" else 1.0
    layer_b = layer_b + selective * (rerun_scores * scores_f / fwd_rate + traffic)
    # The weight-gradient part W: the weight matmuls' gradients (the forward's matmul
    # FLOPs; the attention scores have no weights). The rest of the backward is B.
    layer_w = (lf - 2 * scores_f) / bwd_rate
    if run.engine == "holmes_jax":
        # The pipeline engine, per layer and micro-batch: the layer's weights are sliced out
        # of the stacked [slots, ...] array (read + write) in the forward and again in the
        # backward, and the backward adds the layer's gradient into its fp32 accumulator
        # (read + write). Megatron-LM uses weights in place and fuses the accumulation.
        weights = model.layer_params / t
        weight_slice = 2 * weights * run.param_bytes / mem_bw
        accumulate = 2 * weights * run.grad_bytes / mem_bw
        layer_f = layer_f + weight_slice
        layer_b = layer_b + weight_slice + accumulate
        layer_w = layer_w + accumulate
    head_f, head_b = hf / fwd_rate, 2 * hf / bwd_rate
    compute = n * (layer_f + layer_b) + last * (head_f + head_b)

    # Tensor parallel: 2 all-reduces of [b, s, h] per layer forward, 2 backward, 2 more in
    # a recomputed forward; 1 for the vocab-parallel embedding.
    act = b * s * h * run.act_bytes
    ar = ring_allreduce_time(act, t, *_paths(hw, "tensor")) + np.zeros((p, 1))
    tensor_f = n * 2 * ar + first * ar
    # tp_overlap: the backward's own two hide behind its weight-gradient matmuls.
    tensor_b = n * (2 * (not run.tp_overlap) + 2 * recompute) * ar

    # Point-to-point: a micro-batch crosses each boundary once forward (its [b, s, h]
    # activations, sent by the stage that ran the forward) and once backward (its input
    # gradient); with v chunks, v times over the link s -> s+1 and v-1 times over the wrap
    # link p-1 -> 0 (the last stage's chunk c feeds stage 0's chunk c+1).
    shift_f, shift_b, p2p_bytes = _sends(layout, hw, act, b * s, run)
    fwd = n * layer_f + last * head_f + tensor_f + shift_f[:, None]
    bwd = n * layer_b + last * head_b + tensor_b + shift_b[:, None]
    weight = n * layer_w + last * hf / bwd_rate

    # Parameters held by one device of each stage (tied head: a copy on the last stage).
    tie_copy = V * h if (model.tied_embeddings and p > 1) else 0
    params = (
        n * model.layer_params
        + first * model.embedding_params
        + last * (model.head_params + tie_copy)
    ) / t
    grads = params * run.grad_bytes
    shards = d if run.zero1 else 1
    # Collective calls per reduction: one per leaf and layer with per-layer buckets (the
    # embedding's and head's on the stages that use them); one per stacked leaf (all of a
    # device's layers at once) with one bucket per step, and for the ZeRO-1 all-gather
    # (GSPMD gathers each updated leaf whole, every stage its embedding and head copies).
    leaves = model.layer_leaves + model.embedding_leaves + model.head_leaves
    calls = n * model.layer_leaves + first * model.embedding_leaves + last * model.head_leaves
    if run.buckets == "step":
        calls = np.full_like(calls, leaves)
    gather_calls = np.full_like(calls, leaves)
    if run.sync_collectives and run.engine == "holmes_jax":
        # Where collectives block, the trainer reduces a bucket as one buffer
        # (runtime.engine.zero): per layer and one for embedding and head, or one per step.
        calls = np.zeros_like(calls) + (n + 1.0 if run.buckets == "layer" else 1.0)
    if run.engine == "megatron":  # one contiguous gradient buffer
        calls = gather_calls = np.ones_like(calls)
    reduce = _dp_reduce(grads, calls, layout, hw, run.zero1)
    if tie_copy:
        # First and last stage all-reduce the tied embedding's gradient; under ZeRO-1 each
        # rank only its 1/d shard, after the data-parallel reduce-scatter.
        tie_bytes = V * h / t * run.grad_bytes / shards
        tie = ring_allreduce_time(tie_bytes, 2, *_paths(hw, "tie"))
        reduce = reduce + (first + last) * tie
    gather = np.zeros_like(params)
    if run.zero1 and d > 1:
        gather = all_gather_time(
            params * run.param_bytes, d, *_paths(hw, "gather_path"), gather_calls
        )
    if any(x.measured for x in hw):  # timed on this layout: every call priced by its size
        reduce, gather = _measured_collectives(
            model, run, layout, hw, n, first, last, reduce, gather
        )
    touched = run.grad_bytes + 2 * run.optimizer_bytes + run.param_bytes  # read/write
    optimizer = params / shards * touched / mem_bw

    memory, memory_base = _memory_table(model, run, layout, b)
    return StageCosts(
        model=model,
        run=run,
        layout=layout,
        microbatch_size=b,
        compute=compute,
        tensor=tensor_f + tensor_b,
        p2p=shift_f + shift_b,
        shift_f=shift_f,
        shift_b=shift_b,
        fwd=fwd,
        bwd=bwd,
        weight=weight,
        reduce=reduce,
        optimizer=optimizer,
        gather=gather,
        memory=memory,
        capacity=np.array([x.memory_bytes for x in hw]),
        islands=tuple(x.island for x in hw),
        p2p_bytes=p2p_bytes,
        memory_base=memory_base,
    )


def _sends(layout: Layout, hw: list[StageHardware], act: float, rows: int, run: RunSpec):
    """Per stage, the forward and backward sends of one micro-batch (all its chunks), and
    the bytes per step across each boundary (wrap link last). A boundary between stages on
    two islands carries ``fmt`` (``parallel.cross_island_dtype``): its wire bytes, plus
    encoding on the sender and decoding on the receiver (:func:`codec_time`)."""
    p, v, t = layout.stages, layout.virtual_stages, layout.tensor
    fmt, act_bytes = run.cross_island_dtype, run.act_bytes
    hidden = round(act / (rows * act_bytes))

    def hop(a: int, b: int, path) -> tuple[float, float]:
        """(seconds, bytes) of one activation from stage a to stage b over ``path``."""
        if fmt == "same" or hw[a].island == hw[b].island:
            return p2p_time(act, *path), act
        wire = wire_bytes(fmt, rows, hidden, act_bytes)
        return p2p_time(wire, *path) + codec_time(act, wire, hw[a].mem_bw, hw[b].mem_bw), wire

    hops = [hop(s, s + 1, hw[s].send) for s in range(p - 1)]  # link s -> s+1
    # The wrap link: the last stage's path to stage 0 as one data replica's t slices see
    # it (the tie path is per rank: t times the senders).
    wrap_s, wrap_b = (
        hop(p - 1, 0, (hw[-1].tie[0] * t, hw[-1].tie[1])) if v > 1 and p > 1 else (0.0, 0.0)
    )
    link = [x for x, _ in hops]
    shift_f = np.array([v * link[i] if i < p - 1 else (v - 1) * wrap_s for i in range(p)])
    shift_b = np.array([v * link[i - 1] if i > 0 else (v - 1) * wrap_s for i in range(p)])
    crossings = [(v, b) for _, b in hops] + ([(v - 1, wrap_b)] if v > 1 else [])
    m, d, r = layout.microbatches, layout.data, layout.replica
    return shift_f, shift_b, tuple(2.0 * m * c * nbytes * d * r for c, nbytes in crossings)


def with_schedule(
    costs: StageCosts, layout: Layout, hardware: Sequence[StageHardware]
) -> StageCosts:
    """``costs`` re-priced for ``layout``, which differs only in its schedule and chunks:
    the sends and the memory change, compute and collectives do not."""
    old = costs.layout
    same = (old.replica, old.stages, old.data, old.tensor, old.microbatches)
    if same != (layout.replica, layout.stages, layout.data, layout.tensor, layout.microbatches):
        raise ValueError(f"with_schedule: {layout} differs from {old} beyond its schedule")
    m = costs.model
    act = costs.microbatch_size * m.seq_len * m.hidden_size * costs.run.act_bytes
    rows = costs.microbatch_size * m.seq_len
    shift_f, shift_b, p2p_bytes = _sends(layout, list(hardware), act, rows, costs.run)
    return dataclasses.replace(
        costs,
        layout=layout,
        fwd=costs.fwd + (shift_f - costs.shift_f)[:, None],
        bwd=costs.bwd + (shift_b - costs.shift_b)[:, None],
        p2p=shift_f + shift_b,
        shift_f=shift_f,
        shift_b=shift_b,
        p2p_bytes=p2p_bytes,
        memory=_memory_table(m, costs.run, layout, costs.microbatch_size, costs.memory_base)[0],
    )


def _dp_reduce(
    grads: np.ndarray, calls: np.ndarray, layout: Layout, hw: list[StageHardware], zero1: bool
):
    """Gradient reduction per stage, one call per leaf: reduce-scatter (ZeRO-1) or
    all-reduce over ``data``; with replicas, then an all-reduce of the 1/d shards across
    islands."""
    d, r = layout.data, layout.replica
    out = np.zeros_like(grads)  # the collectives return a scalar 0 over one rank
    if zero1 or r > 1:
        out = out + reduce_scatter_time(grads, d, *_paths(hw, "scatter_path"), calls)
    else:
        out = out + ring_allreduce_time(grads, d, *_paths(hw, "data"), calls)
    if r > 1:
        out = out + ring_allreduce_time(grads / d, r, *_paths(hw, "cross"), calls)
        if not zero1:  # plain hierarchical all-reduce: gather the reduced shards back
            out = out + all_gather_time(grads, d, *_paths(hw, "gather_path"), calls)
    return out


def _measured_collectives(model, run, layout, hw, n, first, last, reduce, gather):
    """``reduce`` and ``gather`` ((p, L+1) seconds) with every stage whose hardware timed
    the op on its own layout (:class:`~holmes_jax.planner.placement.MeasuredOp`) priced
    call by call: each call's buffer, as the trainer cuts them (the buckets and leaves
    :func:`stage_costs` counts), read off the measured times. ``n`` is the (1, L+1) layer
    count, ``first`` / ``last`` (p, 1) mark the stages holding the embedding / head. One
    replica only (the naive placement)."""
    t = layout.tensor
    layer = np.array(model.layer_leaf_params, dtype=np.float64) / t  # per device
    # (params per device, calls) of each call kind; arrays broadcast to (p, L+1)
    ends = [(first * x / t, 1.0) for x in model.embedding_leaf_params]
    ends += [(last * x / t, 1.0) for x in model.head_leaf_params]
    ends_total = sum(x for x, _ in ends)
    stacked = [(n * x, 1.0) for x in layer]  # GSPMD gathers each stacked leaf whole
    everything = [(n * layer.sum() + ends_total, 1.0)]
    flat = run.sync_collectives and run.engine == "holmes_jax"  # a bucket is one buffer
    if run.engine == "megatron" or (flat and run.buckets == "step"):
        grad_calls = everything
    elif flat:  # one bucket per layer, one for the embedding and head
        grad_calls = [(layer.sum(), n), (ends_total, 1.0)]
    elif run.buckets == "layer":  # every leaf of every layer
        grad_calls = [(x, n) for x in layer] + ends
    else:  # every stacked leaf
        grad_calls = stacked + ends
    gather_calls = everything if run.engine == "megatron" else stacked + ends

    def price(op, calls, nbytes):  # (p, L+1) seconds
        return sum(op.time(size * nbytes) * count for size, count in calls)

    reduce, gather = reduce.copy(), gather.copy()
    scatter_op = "reduce-scatter" if run.zero1 else "all-reduce"
    for s, x in enumerate(hw):
        measured = dict(x.measured)
        if (op := measured.get(scatter_op)) is not None and layout.replica == 1:
            reduce[s] = price(op, grad_calls, run.grad_bytes)[s]
        if (op := measured.get("all-gather")) is not None and run.zero1:
            gather[s] = price(op, gather_calls, run.param_bytes)[s]
    return reduce, gather


def _paths(hw: list[StageHardware], name: str) -> tuple[np.ndarray, np.ndarray]:
    """(p, 1) bandwidths and latencies of each stage's path ``name``."""
    pairs = np.array([getattr(x, name) for x in hw], dtype=np.float64)
    return pairs[:, :1], pairs[:, 1:]


def _memory_table(
    model: ModelSpec, run: RunSpec, layout: Layout, b: int, base: dict | None = None
) -> tuple[np.ndarray, dict]:
    """(p, L+1) per-device peak bytes when each device's largest slot group holds n layers
    (:func:`holmes_jax.planner.memory.device_memory`; a split pads every stage, or with v
    chunks every chunk, to its largest), and the schedule-free breakdown it came from
    (``base``: pass it back to price another schedule of the same layout).

    The breakdown is priced once for up to 4L slots under 1F1B's K residual sets; a
    schedule changes only the residual sets in flight (``K`` =
    :func:`holmes_jax.planner.memory.buffer_depth`; the residual bytes and activation
    buffers scale with it) and the slots (v·n):

    - interleaved: v·n layer slots; ``K_c`` chunk residual sets in flight, each of n layers.
    - zb (ZB-H1): 1F1B's residual sets (a micro-batch keeps its residuals until its W,
      and ZB-H1 keeps as many in flight as 1F1B), plus the deferred weight-gradient state:
      for each micro-batch whose B ran but whose W has not, what of each layer's stash
      (output cotangents of its weight matmuls) its B-only residuals cannot hold
      (:func:`~holmes_jax.planner.memory.zb_stash_bytes`: 0 under remat none), at most
      :func:`deferred_weight_sets` of them. Weight gradients are accumulated into the
      fp32 accumulators as W runs (never stashed per micro-batch).
    """
    p, v, m, L = layout.stages, layout.virtual_stages, layout.microbatches, model.num_layers
    if base is None or len(base[True].residuals) < v * L + 1:
        plain = dataclasses.replace(layout, schedule="1f1b", virtual_stages=1)
        x = memory_inputs(model, run, plain, b)
        slots = np.arange(max(VIRTUAL_MAX, v) * L + 1, dtype=np.float64)
        base = {last: device_memory(x, slots, last_stage=last) for last in (False, True)}
        base["k"] = buffer_depth("1f1b", p, m)
    k0, k = base["k"], buffer_depth(layout.schedule, p, m, v)
    n = np.arange(L + 1)
    extra = 0.0
    if layout.schedule == "zb":
        cot = zb_stash_bytes(model, b, layout.tensor, run.act_bytes, run.remat)
        extra = deferred_weight_sets(p, m) * n * cot
    peaks = {}
    for last in (False, True):
        br = base[last]
        # a field by layer slots (v·n of them); the ones that do not grow with slots as is
        at = lambda field, br=br: _by_slots(getattr(br, field), v * n)  # noqa: E731
        per_set = _by_slots(br.residuals, 1) / k0  # one residual set of one layer
        act = _by_slots(br.buffers, 0) / (6 + k0)  # one activation buffer
        row = dataclasses.replace(
            br,
            params=at("params"),
            optimizer=at("optimizer"),
            grads=at("grads"),
            residuals=k * n * per_set,
            buffers=(6 + k) * act + extra,
            working=at("working"),
            update=at("update"),
        )
        peaks[last] = row.peak
    return np.stack([peaks[st == p - 1] for st in range(p)]), base


def _by_slots(value, slots):
    """``value`` (a scalar or an array over slot counts) at ``slots``."""
    return value[slots] if np.ndim(value) else value


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
        virtual_stages=layout.virtual_stages,
    )
