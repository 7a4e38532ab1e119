"""The pieces a decoder layer is built from: norms, rotary positions, causal attention.

Shapes: x ``[B, T, H]``; q ``[B, T, nh, hd]``; k, v ``[B, T, nkv, hd]`` (nkv = nh, or
fewer key/value heads under grouped-query attention, each shared by nh/nkv query heads).

- :class:`LayerNorm` (gpt2: scale and bias) and :class:`RMSNorm` (llama: scale only),
  statistics in fp32 whatever the activation dtype.
- :func:`rope`: rotary position embedding in the Hugging Face ``rotate_half`` convention,
  so a ``LlamaForCausalLM``'s q_proj / k_proj weights map by a plain reshape, with no
  permutation of their rows::

      inv_freq = 1 / base^([0, 2, ..., hd-2] / hd)           # [hd/2]
      angle    = position x inv_freq                         # [T, hd/2]
      cos, sin = cos/sin(concat(angle, angle))               # [T, hd]
      rope(x)  = x·cos + rotate_half(x)·sin,   rotate_half(x) = concat(-x[hd/2:], x[:hd/2])

  computed in fp32, as ``transformers`` does. With Llama 3.1's ``rope_scaling``
  (``model.rope_scaling_factor`` > 0) inv_freq is first rescaled by wavelength
  (:func:`inv_freq`). It is linear in x and its tables depend only on the shape, so its
  backward (:func:`_rope_bwd`, the inverse rotation) keeps no residual at all.
- :func:`attention`: causal softmax attention by cuDNN's fused kernel or by XLA
  (grouped: query heads ``[nkv, nh/nkv]`` against their shared key/value head, never a
  repeated copy of k and v). Neither keeps ``[B, nh, T, T]`` scores for the backward.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from holmes_jax.core.config import ModelConfig
from holmes_jax.core.errors import ConfigError


def param(module: nn.Module, name: str, init, shape, names):
    """An fp32 parameter of ``module`` carrying logical axis ``names``."""
    return module.param(name, nn.with_logical_partitioning(init, names), shape, jnp.float32)


# --------------------------------------------------------------------------- norms


class LayerNorm(nn.Module):
    """LayerNorm over the hidden axis with logical names on scale and bias."""

    eps: float = 1e-5

    @nn.compact
    def __call__(self, x):  # x [B, T, H]
        h = x.shape[-1]
        scale = param(self, "scale", nn.initializers.ones, (h,), ("embed",))
        bias = param(self, "bias", nn.initializers.zeros, (h,), ("embed",))
        x32 = x.astype(jnp.float32)  # statistics in fp32 even for bf16 activations
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the hidden axis: ``x / sqrt(mean(x²) + eps) · scale`` (Llama)."""

    eps: float = 1e-5

    @nn.compact
    def __call__(self, x):  # x [B, T, H]
        scale = param(self, "scale", nn.initializers.ones, (x.shape[-1],), ("embed",))
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.eps)
        return (y * scale.astype(jnp.float32)).astype(x.dtype)


def norm(cfg: ModelConfig, name: str) -> nn.Module:
    """The arch's norm: LayerNorm (gpt2) or RMSNorm (llama), eps ``model.norm_eps``."""
    cls = RMSNorm if cfg.arch == "llama" else LayerNorm
    return cls(eps=cfg.norm_eps, name=name)


# --------------------------------------------------------------------------- rotary


class Rope(NamedTuple):
    """The rotary embedding's constants (hashable: a static argument of :func:`rope`).

    ``factor`` 0: plain RoPE. Otherwise Llama 3.1's ``rope_type: llama3`` scaling:
    wavelengths longer than ``original / low`` are stretched by ``factor``, shorter than
    ``original / high`` kept, and those between interpolated smoothly.
    """

    base: float = 10000.0
    factor: float = 0.0
    low: float = 1.0  # low_freq_factor
    high: float = 4.0  # high_freq_factor
    original: int = 8192  # original_max_position_embeddings

    @classmethod
    def of(cls, cfg: ModelConfig) -> Rope:
        return cls(
            cfg.rope_base,
            cfg.rope_scaling_factor,
            cfg.rope_low_freq_factor,
            cfg.rope_high_freq_factor,
            cfg.rope_original_max_positions,
        )


def inv_freq(hd: int, r: Rope):
    """Rotation frequencies ``[hd/2]`` fp32 (``transformers``' ``_compute_llama3_parameters``
    when scaled)."""
    freq = 1.0 / (r.base ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    if not r.factor:
        return freq
    wavelen = 2 * math.pi / freq
    scaled = jnp.where(wavelen > r.original / r.low, freq / r.factor, freq)
    smooth = (r.original / wavelen - r.low) / (r.high - r.low)
    smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
    medium = (wavelen >= r.original / r.high) & (wavelen <= r.original / r.low)
    return jnp.where(medium, smoothed, scaled)


def rope_tables(t: int, hd: int, r: Rope):
    """cos, sin ``[T, hd]`` fp32 of positions 0..t-1 (see the module docstring)."""
    angle = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq(hd, r)[None, :]  # [T, hd/2]
    angle = jnp.concatenate([angle, angle], axis=-1)  # [T, hd]
    return jnp.cos(angle), jnp.sin(angle)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _rotate(x, r: Rope, sign: float):
    """x·cos + sign·rotate_half(x)·sin in fp32, x [B, T, n, hd]."""
    cos, sin = rope_tables(x.shape[1], x.shape[-1], r)
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, hd]: broadcast over heads
    x32 = x.astype(jnp.float32)
    return (x32 * cos + sign * _rotate_half(x32) * sin).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def rope(x, r: Rope):
    """Rotary position embedding of q or k, x ``[B, T, n, hd]`` -> same shape and dtype."""
    return _rotate(x, r, 1.0)


def _rope_fwd(x, r):
    return _rotate(x, r, 1.0), None  # linear, tables from the shape: nothing to keep


def _rope_bwd(r, _, g):
    # The transpose of a rotation by +angle is the rotation by -angle:
    # cos·g + rotate_halfᵀ(sin·g) with rotate_halfᵀ = -rotate_half.
    return (_rotate(g, r, -1.0),)


rope.defvjp(_rope_fwd, _rope_bwd)


# --------------------------------------------------------------------------- attention


def attention_kernel(cfg: ModelConfig, dtype) -> str:
    """The attention implementation a run uses: ``'xla'`` or ``'cudnn'``.

    ``auto`` takes cuDNN's fused kernel on a CUDA device when it can run (bf16/fp16,
    head_dim a multiple of 8 up to 128), else XLA.

    Raises:
      ConfigError: ``model.attention=cudnn`` where cuDNN cannot run.
    """
    if cfg.attention == "xla":
        return "xla"
    why = _cudnn_unavailable(cfg, dtype)
    if cfg.attention == "cudnn" and why:
        raise ConfigError(f"model.attention=cudnn: {why} (use auto or xla)")
    return "xla" if why else "cudnn"


def _cudnn_unavailable(cfg: ModelConfig, dtype) -> str | None:
    """Why cuDNN attention cannot run here, or None."""
    devices = jax.devices()
    if devices[0].platform != "gpu" or "cuda" not in devices[0].client.platform_version.lower():
        return f"needs a CUDA GPU, this run has {devices[0].platform} devices"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"needs bf16 or fp16 compute, this run computes in {jnp.dtype(dtype).name}"
    if cfg.head_dim % 8 or cfg.head_dim > 128:
        return f"needs head_dim a multiple of 8 and <= 128, got {cfg.head_dim}"
    return None


def attention(q, k, v, kernel: str):
    """Causal softmax attention. q [B, T, nh, hd], k, v [B, T, nkv, hd] -> [B, T, nh, hd].

    Query head j attends with key/value head ``j // (nh/nkv)`` (Hugging Face's
    ``repeat_kv`` order). Never keeps ``[B, nh, T, T]`` scores for the backward: cuDNN's
    fused kernel stores only its output and the softmax statistics; the XLA path is
    wrapped in a checkpoint that keeps q, k, v and recomputes scores and softmax (in fp32)
    in the backward.
    """
    if kernel == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return _xla_attention(q, k, v)


@jax.checkpoint
def _xla_attention(q, k, v):
    b, t, nh, hd = q.shape
    nkv = k.shape[2]
    q = q.reshape(b, t, nkv, nh // nkv, hd)  # [B, T, nkv, g, hd]: g query heads per kv head
    scale = 1.0 / math.sqrt(hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k).astype(jnp.float32) * scale  # [B,nkv,g,T,T]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # softmax in fp32
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, nh, hd)
