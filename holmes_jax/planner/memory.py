"""Per-device peak memory of one training step, priced the way the engine allocates it.

The planner uses it to pick a remat policy and micro-batch size that fit; the trainer, to
refuse a plan that will not fit before anything compiles. ``scripts/bench_memory.py`` and
``tests/test_memory.py`` check it against XLA's compiled memory analysis.

Notation: b sequences per micro-batch, s sequence, h hidden, f MLP width, a heads, k the
key/value width (num_kv_heads x head_dim), V vocabulary, t tensor, d data,
n = max(layers_per_stage) layer slots per device, K residual sets kept (1F1B: min(S, M),
GPipe: M), β bytes of the compute dtype.
Every device holds its n slots (padded) and a copy of the embedding and of the head:

- **state** (donated): parameters ``P·β``; AdamW moments ``8·P/d`` (ZeRO-1); under bf16
  the fp32 master ``4·P/d``.
- **tick loop** (alive through the pipeline): fp32 gradient accumulators ``4·P``; reduced
  block gradients ``4·P_blocks/d``; residuals ``K·n·R``, R a layer's residual bytes under
  the remat policy (:func:`layer_residual_bytes`; interleaved: K sets of n/v layers);
  inboxes, sends and head cotangents ``(6 + K)·b·s·h·β``;
  under ``zb`` the stash the residual slot cannot hold, ``min(S, M)·n`` times
  :func:`zb_stash_bytes`.
- **working set** of the largest single op: a layer's backward (its recompute, its fp32
  weight gradient, with XLA attention the ``[b, a/t, s, s]`` fp32 scores) or the head
  (fp32 logits over ``V/t`` and their gradient).
- **update** (after the loop): gradients, clipped gradients and AdamW updates on the 1/d
  shards, beside the state.

Peak = state + max(tick loop + working set, update). Pure Python (no jax).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import REMAT_POLICIES, ModelSpec


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device; ``peak`` is what must fit."""

    params: float
    optimizer: float  # AdamW moments (+ fp32 master), 1/d with ZeRO-1
    grads: float  # fp32 gradient accumulators + reduced shards (tick loop)
    residuals: float  # K x n x per-layer residuals
    buffers: float  # activation inbox / sends / receives / head cotangents
    working: float  # largest single op's temporaries
    update: float  # optimizer-step temporaries after the loop

    @property
    def state(self) -> float:
        return self.params + self.optimizer

    @property
    def loop(self) -> float:
        return self.grads + self.residuals + self.buffers + self.working

    @property
    def peak(self) -> float:
        return self.state + np.maximum(self.loop, self.update)

    def as_gb(self) -> dict[str, float]:
        names = ("params", "optimizer", "grads", "residuals", "buffers", "working", "update")
        out = {k: float(getattr(self, k)) / 1e9 for k in names}
        out["peak"] = float(self.peak) / 1e9
        return out


def buffer_depth(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1) -> int:
    """Residual sets the busiest device (stage 0) keeps in flight: micro-batches whose
    forward ran and whose backward (for ``zb`` its weight-gradient pass W) has not.

    - ``gpipe``: all M.
    - ``1f1b``: ``min(S, M)`` (S − s warm-up forwards on stage s).
    - ``zb`` (ZB-H1, Qi et al. 2023): the same ``min(S, M)``: ZB-H1 defers W only while
      the in-flight count stays within 1F1B's; the deferred W's own state (output
      cotangents) is priced by the cost model on top.
    - ``interleaved`` with v chunks: *chunk* residual sets (each holds one chunk's
      layers), Megatron-LM's interleaved 1F1B over groups of g = min(S, M) micro-batches:
      stage s runs ``2(S − s − 1) + (v − 1)·g`` warm-up chunk forwards and one more
      before its first backward, so stage 0 holds ``min(M·v, 2(S − 1) + (v − 1)·g + 1)``;
      for M >= S that is ``(v + 1)·S − 1``, ``S + (S − 1)/v`` devices' worth of layers
      against 1F1B's S.
    """
    if schedule == "gpipe":
        return microbatches
    if schedule == "interleaved" and virtual_stages > 1:
        g = min(stages, microbatches)
        warm = 2 * (stages - 1) + (virtual_stages - 1) * g
        return min(microbatches * virtual_stages, warm + 1)
    return min(stages, microbatches)


def layer_residual_bytes(
    remat: str,
    b: int,
    s: int,
    h: int,
    f: int,
    t: int,
    act_bytes: int,
    kv: int | None = None,
    gated: bool = False,
) -> float:
    """Bytes one layer keeps per device for its backward, per microbatch.

    What ``jax.vjp`` of :class:`holmes_jax.runtime.model.decoder.Block` keeps (the engine buffers
    exactly these; ``tests/runtime/engine/test_memory.py`` compares this formula with the traced
    residuals of both archs). ``kv``: the key/value width k (None: h); ``gated``: the
    SwiGLU MLP of llama (gate and up, two ``[b, s, f/t]`` matmul outputs, where GELU has one).

    - ``full``: the layer input ``[b, s, h]``.
    - ``selective``: the input, q ``[b, s, h/t]``, k and v ``2·[b, s, k/t]`` (before the
      rotary embedding, which is recomputed), the attention output ``[b, s, h/t]``, the
      attention projection ``[b, s, h]`` and the MLP input projections (gpt2: fc, llama:
      gate and up ``[b, s, f/t]`` each).
    - ``none``: six fp32 ``[b, s, h]`` norm values, two normalised inputs ``[b, s, h]``,
      q, k, v and the attention output, and six ``[b, s, f/t]`` MLP values (the
      tanh-GELU's intermediates; SwiGLU's gate, up, sigmoid and products).
    """
    bs, beta = b * s, act_bytes
    k = h if kv is None else kv
    attn = (2 * h + 2 * k) / t  # q, k, v, attention output
    if remat == "full":
        return bs * h * beta
    if remat == "selective":
        return bs * beta * (2 * h + attn + (2 if gated else 1) * f / t)
    if remat == "none":
        return bs * (h * (6 * 4 + 2 * beta) + attn * beta + 6 * f / t * beta)
    raise ValueError(f"remat='{remat}': must be one of {', '.join(REMAT_POLICIES)}")


def deferred_weight_sets(stages: int, microbatches: int) -> int:
    """Weight-gradient stashes (B done, W not yet) on the busiest device of ZB-H1
    (:attr:`holmes_jax.planner.schedule.Schedule.stash_slots`): stage s defers up to s
    W's and stashes its current B's, so the last stage holds ``min(p, m)``."""
    return min(stages, microbatches)


def weight_stash_bytes(m: ModelSpec, b: int, t: int, act_bytes: int, remat: str = "none") -> float:
    """What zb's B keeps of one layer for its deferred W, per microbatch, ``[b, s, ·]`` in
    the compute dtype (``holmes_jax.runtime.engine.wgrad``'s stash):

    - the output cotangents of the weight matmuls (gpt2: qkv ``3h/t``, attention
      projection ``h``, fc ``f/t``, its projection ``h``; llama: q ``h/t``, k and v
      ``2k/t``, o ``h``, gate and up ``2f/t``, down ``h``) and of the two norms ``2h``;
    - under ``remat: full``, the forward matmul outputs W reads that the residuals no
      longer hold: attention's value product ``h/t``, the attention projection ``h`` and
      the MLP input projections (``f/t``, llama ``2f/t``).
    """
    h, f, g = m.hidden_size, m.mlp_size, (2 if m.gated else 1)
    width = 4 * h + (h + 2 * m.kv_size + g * f) / t
    if remat == "full":
        width += h + (h + g * f) / t
    return b * m.seq_len * width * act_bytes


def b_only_bytes(m: ModelSpec, b: int, t: int, act_bytes: int, remat: str = "none") -> float:
    """Residual bytes of one layer that only zb's B reads (W reads the rest), per
    microbatch: after B they are dead, and the engine writes the stash there
    (``holmes_jax.runtime.engine.buffers.StashLayout``).

    - ``none``: all but the two norms' fp32 normalised values, their ``β`` casts, the
      attention output ``h/t`` and the MLP's activated value ``f/t``.
    - ``selective``: q, k and v ``(h + 2k)/t``.
    - ``full``: nothing (W reads the layer input).
    """
    h, f, s = m.hidden_size, m.mlp_size, m.seq_len
    if remat == "full":
        return 0.0
    if remat == "selective":
        return b * s * act_bytes * (h + 2 * m.kv_size) / t
    w_reads = b * s * (2 * 4 * h + act_bytes * (2 * h + (h + f) / t))
    return model_residual_bytes("none", m, b, t, act_bytes) - w_reads


def zb_stash_bytes(m: ModelSpec, b: int, t: int, act_bytes: int, remat: str = "none") -> float:
    """zb's stash of one layer beyond the residual slot it shares, per deferred microbatch:
    what of :func:`weight_stash_bytes` does not fit in :func:`b_only_bytes` (0 with
    ``remat: none``, where zb keeps 1F1B's activation memory)."""
    stash = weight_stash_bytes(m, b, t, act_bytes, remat)
    return max(0.0, stash - b_only_bytes(m, b, t, act_bytes, remat))


def model_residual_bytes(remat: str, m: ModelSpec, b: int, t: int, act_bytes: int) -> float:
    """:func:`layer_residual_bytes` of a layer of model ``m``."""
    return layer_residual_bytes(
        remat, b, m.seq_len, m.hidden_size, m.mlp_size, t, act_bytes, m.kv_size, m.gated
    )


@dataclass(frozen=True)
class MemoryInputs:
    """Everything the memory model needs: the model's shape, the layout, the numerics."""

    model: ModelSpec
    stages: int
    data: int
    tensor: int
    microbatches: int
    schedule: str
    microbatch_size: int  # sequences per microbatch per data rank (b)
    remat: str = "none"
    attention: str = "xla"  # xla keeps fp32 [b, a/t, s, s] transients; cudnn does not
    act_bytes: int = 2  # β: compute dtype
    zero1: bool = True
    master: bool = True  # fp32 master copy (bf16 runs)
    virtual_stages: int = 1  # interleaved: chunks per device (slots are v chunks of n)


def device_memory(x: MemoryInputs, slots, last_stage: bool = True) -> MemoryBreakdown:
    """Per-device peak of a pipeline device holding ``slots`` layer slots.

    Args:
      x: model, layout and numerics.
      slots: layer slots per device (``max(layers_per_stage)``: every stage pads to it);
        an int or a NumPy array of them (every field then is an array).
      last_stage: whether the head's working set applies (the head runs on the last stage;
        its parameters are on every stage).
    """
    m = x.model
    h, s, V, t, d = m.hidden_size, m.seq_len, m.vocab_size, x.tensor, x.data
    b, beta = x.microbatch_size, x.act_bytes
    zd = d if x.zero1 else 1  # ZeRO-1 shards the optimizer state and reduced gradients

    # Parameters per device: tensor splits matmuls, the vocabulary and (approximately) all
    # else; the pipeline layout keeps an embedding and a head copy on every stage.
    blocks = slots * m.layer_params / t
    embed = V / t * h + m.position_params  # gpt2's learned positions are not split
    head = m.norm_params + (0 if m.tied_embeddings else V * h / t)
    P = blocks + embed + head
    params = P * beta
    optimizer = P / zd * (8 + (4 if x.master else 0))

    grads = 4 * P + 4 * blocks / zd
    # K residual sets in flight, each of one chunk's slots / v layers (v = 1: all slots)
    K = buffer_depth(x.schedule, x.stages, x.microbatches, x.virtual_stages)
    R = model_residual_bytes(x.remat, m, b, t, beta)
    residuals = K * slots / x.virtual_stages * R
    act = b * s * h * beta
    buffers = (6 + K) * act
    if x.schedule == "zb":  # the deferred W's inputs that B-only residuals cannot hold
        stash = zb_stash_bytes(m, b, t, beta, x.remat)
        buffers = buffers + deferred_weight_sets(x.stages, x.microbatches) * slots * stash

    # Working set: one layer's backward (recomputed activations when remat, the fp32
    # gradient of its weights, its weights in fp32) or, on the last stage, the head.
    recompute = model_residual_bytes("none", m, b, t, beta) if x.remat != "none" else 0.0
    scores = 3 * b * (m.num_heads / t) * s * s * 4 if x.attention == "xla" else 0.0
    layer_grad = 2 * 4 * m.layer_params / t
    working = recompute + scores + layer_grad
    if last_stage:
        logits = 3 * b * s * V / t * 4  # fp32 logits, softmax, their gradient
        working = np.maximum(working, logits)

    update = 3 * 4 * P / zd  # reduced grads, clipped grads, AdamW updates (fp32 shards)
    return MemoryBreakdown(
        params=params,
        optimizer=optimizer,
        grads=grads,
        residuals=residuals,
        buffers=buffers,
        working=working,
        update=update,
    )


def stage_peaks(x: MemoryInputs, layers_per_stage) -> list[float]:
    """Predicted peak bytes of a device of each stage. ``layers_per_stage`` has one entry
    per virtual stage (S·v with interleaving); every device pads to v times the largest."""
    v = x.virtual_stages
    stages, slots = len(layers_per_stage) // v, v * max(layers_per_stage)
    return [float(device_memory(x, slots, last_stage=s == stages - 1).peak) for s in range(stages)]


def check_fits(x: MemoryInputs, layers_per_stage, limit_bytes: float) -> list[float]:
    """Refuse a run whose predicted per-device peak exceeds the device memory.

    Args:
      x: the run's memory inputs (:func:`holmes_jax.planner.plans.memory_inputs_of`).
      layers_per_stage: the split (every stage pads to its largest entry).
      limit_bytes: memory of one device.

    Returns:
      The predicted peak bytes of a device of each stage.

    Raises:
      ConfigError: one line naming the first stage that does not fit, its predicted GB,
        the limit and the switches that lower it.
    """
    peaks = stage_peaks(x, layers_per_stage)
    slots = x.virtual_stages * max(layers_per_stage)
    for s, peak in enumerate(peaks):
        if peak > limit_bytes:
            raise ConfigError(
                f"stage {s}: predicted {peak / 1e9:.1f} GB per device > the device limit "
                f"{limit_bytes / 1e9:.1f} GB (model.remat={x.remat}, {x.microbatch_size} "
                f"sequences per microbatch, {slots} layers per device); lower it with "
                f"model.remat=selective or full, more parallel.microbatches, a larger "
                f"parallel.tensor or more parallel.stages (python -m holmes_jax.plan)"
            )
    return peaks
