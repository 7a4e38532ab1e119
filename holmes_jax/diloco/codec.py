"""The outer step's numeric contract, written once for numpy (host) and jax (device).

A delta ``Δ`` (fp32) travels in ``diloco.outer_dtype``:

- ``fp32``: as is;
- ``bf16``: rounded to nearest even; on the host its 16 bits travel as ``uint16``;
- ``int8``: ``s = max|Δ| / 127`` (``s = 1`` where ``Δ`` is all zero) and
  ``q = clip(round(Δ / s), −127, 127)``, so ``|Δ − q·s| ≤ s/2``. The host takes one ``s``
  per tensor; the device one per replica and tensor (:func:`int8_scale` over the axes
  after the leading ones).

Decoding is ``q·s`` in fp32 (bf16: widened). The outer optimizer is Nesterov SGD
(:func:`nesterov`): ``m ← μm + Δ``, ``global ← global − lr(Δ + μm)``.

Every function takes its array module (``xp``: ``numpy`` or ``jax.numpy``), so the host
protocol (:mod:`holmes_jax.diloco.sync`) and the device program
(:mod:`holmes_jax.diloco.outer_step`) compute the same values.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

INT8_MAX = 127.0
OUTER_DTYPES = ("fp32", "bf16", "int8")
# the host's wire dtype of each outer dtype (bf16 travels as its bits)
WIRE_DTYPES = {"fp32": np.dtype(np.float32), "bf16": np.dtype(np.uint16), "int8": np.dtype(np.int8)}


def int8_scale(absmax, xp=np):
    """``s = absmax / 127`` where ``absmax > 0``, else 1 (fp32)."""
    absmax = xp.asarray(absmax, xp.float32)
    return xp.where(absmax > 0, absmax / xp.float32(INT8_MAX), xp.float32(1.0))


def int8_quantize(x, scale, xp=np):
    """``clip(round(x / s), −127, 127)`` as int8; ``scale`` broadcasts against ``x``."""
    q = xp.round(x / scale)
    return xp.clip(q, -INT8_MAX, INT8_MAX).astype(xp.int8)


def nesterov(glob, mom, delta, lr: float, mu: float):
    """One outer Nesterov step on arrays (numpy or jax): ``m ← μm + Δ``,
    ``global ← global − lr(Δ + μm)``. Returns (global, momentum)."""
    mom = mu * mom + delta
    return glob - lr * (delta + mu * mom), mom


def encode(delta: np.ndarray, dtype: str) -> tuple[np.ndarray, float]:
    """Host: fp32 ``delta`` -> (wire payload, its one scale); module doc."""
    delta = np.asarray(delta, np.float32)
    if dtype == "fp32":
        return delta, 1.0
    if dtype == "bf16":
        return delta.astype(ml_dtypes.bfloat16).view(np.uint16), 1.0
    if dtype != "int8":
        raise ValueError(f"outer dtype {dtype!r}: one of {OUTER_DTYPES}")
    absmax = np.max(np.abs(delta)) if delta.size else np.float32(0)
    scale = int8_scale(absmax)
    return int8_quantize(delta, scale), float(scale)


def decode(payload: np.ndarray, scale: float) -> np.ndarray:
    """Host: the fp32 delta of :func:`encode`'s output."""
    if payload.dtype == np.uint16:
        return payload.view(ml_dtypes.bfloat16).astype(np.float32)
    if payload.dtype == np.float32:
        return payload
    return payload.astype(np.float32) * np.float32(scale)


def encode_tree(tree: dict[str, np.ndarray], dtype: str) -> tuple[dict, dict[str, float]]:
    """Host: :func:`encode` of every array of ``tree``: ``(payloads, scales)`` by key."""
    payloads, scales = {}, {}
    for k, v in tree.items():
        payloads[k], scales[k] = encode(v, dtype)
    return payloads, scales
