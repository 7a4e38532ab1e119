"""AdamW with linear warmup + cosine decay, global-norm clipping and a weight-decay mask.

Weight decay applies to matmul kernels and embeddings (2-D weights in GPT-2 terms; every
``*_kernel`` of either arch) and never to norm scales or biases; the mask goes by parameter
name, so it is the same for the stacked ``[L, ...]`` layout and any pipeline re-cut of it.
"""

from __future__ import annotations

import jax
import optax
from jax import lax

from holmes_jax.core.config import OptimizerConfig

# Parameter names (last path element) that receive weight decay.
DECAYED = frozenset(
    {"wte", "wpe", "qkv_kernel", "out_kernel", "fc_kernel", "proj_kernel", "lm_kernel"}
    | {"q_kernel", "k_kernel", "v_kernel", "gate_kernel", "up_kernel", "down_kernel"}  # llama
)


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to ``learning_rate``, cosine decay to ``min_lr_ratio`` of it."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=cfg.learning_rate * cfg.min_lr_ratio,
    )


def decay_mask(params):
    """Pytree of bools: True where weight decay applies."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) in DECAYED, params
    )


def clip_by_global_norm(grads, norm: jax.Array, max_norm: float):
    """Exactly optax.clip_by_global_norm's rule, given an externally computed norm."""
    if max_norm <= 0:
        return grads
    trigger = norm < max_norm
    return jax.tree.map(
        lambda g: lax.select(trigger, g, (g / norm.astype(g.dtype)) * max_norm), grads
    )


def step_count(opt_state) -> jax.Array:
    """The optimizer's step count (AdamW's; the schedule's is the same): steps applied, so
    the learning rate :func:`make_optimizer`'s next update uses is ``schedule(count)``."""
    counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    if not counts:
        raise ValueError("step_count: the optimizer state holds no step count")
    return counts[0][1]


def make_optimizer(
    cfg: OptimizerConfig, total_steps: int, *, clip: bool = True
) -> optax.GradientTransformation:
    """The optax chain used by the trainer (and by tests as the reference).

    Args:
      cfg: optimizer settings.
      total_steps: length of the schedule.
      clip: apply global-norm clipping here. The pipeline engine clips itself (the global
        norm spans stages) and passes ``clip=False``; the state structure is the same
        either way, so checkpoints move between pipelined and unpipelined runs.
    """
    schedule = learning_rate_schedule(cfg, total_steps)
    clipping = (
        optax.clip_by_global_norm(cfg.grad_clip) if clip and cfg.grad_clip > 0 else optax.identity()
    )
    adamw = optax.adamw(
        schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask
    )
    return optax.chain(clipping, adamw)
