"""What crosses an island boundary in the pipeline: activations and their gradients, encoded.

``parallel.cross_island_dtype`` picks the wire format of the engine's sends between two
stages on different islands (:meth:`PipelineEngine._send
<holmes_jax.runtime.engine.pipeline.PipelineEngine._send>`); sends inside an island stay in the
compute dtype. The sender encodes just before the ``ppermute``, the receiver decodes right
after; nothing is kept between steps (resume needs nothing).

- ``same``: the compute dtype (no encoding; the program is the one without this module).
- ``bf16``: a cast, sent as its uint16 bits.
- ``int8``: ``q = round(x / s)`` with one fp32 scale ``s = max|x| / 127`` per token row
  (over hidden), so ``|x - q·s| <= s/2``.
- ``fp8``: ``float8_e4m3fn`` of ``x / s``, ``s = max|x| / 448`` per token row.

Why per token row: the residual stream's magnitude differs from token to token by orders of
magnitude (the first token, delimiters), so one scale per tensor would round the rows of
small norm to nothing; a row is also what one micro-batch's attention and MLP read together.
A scale per row costs 4 bytes per ``hidden`` values (6% at hidden 64, 0.1% at 4096); blocks
inside a row would cost more scales for outliers that sit in fixed channels anyway.

Wire: int8 / fp8 rows go as ``uint8 [mb, T, H + 4]``: the H codes then the row's fp32 scale
as 4 bytes, so one ``ppermute`` of one 1-byte dtype carries both (a collective has one
dtype; a second one for the scales would add a latency per tick). 16-bit floats go as
uint16 bits: XLA:CPU widens bf16 collectives to f32 (see :mod:`holmes_jax.diloco.outer_step`),
and a bitcast is free on GPU. ``tests/runtime/engine/test_compress.py`` reads the bytes off the
compiled program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from holmes_jax.core.spec import CROSS_ISLAND_DTYPES
from holmes_jax.planner.formulas import SCALE_BYTES
from holmes_jax.runtime.engine.buffers import from_bits, to_bits

_QMAX = {"int8": 127.0, "fp8": 448.0}


def encode(x: jax.Array, fmt: str) -> jax.Array:
    """``x [..., H]`` (any float dtype) in wire format ``fmt`` (not ``same``)."""
    if fmt == "bf16":
        return to_bits(x.astype(jnp.bfloat16))
    xf = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / _QMAX[fmt]  # [..., 1]
    safe = jnp.where(scale > 0, scale, 1.0)  # an all-zero row: codes 0, scale 0
    if fmt == "int8":
        codes = lax.bitcast_convert_type(
            jnp.clip(jnp.round(xf / safe), -127, 127).astype(jnp.int8), jnp.uint8
        )
    else:
        codes = lax.bitcast_convert_type((xf / safe).astype(jnp.float8_e4m3fn), jnp.uint8)
    scale_bytes = lax.bitcast_convert_type(scale, jnp.uint8)  # [..., 1, 4]
    return jnp.concatenate([codes, scale_bytes.reshape(*scale.shape[:-1], SCALE_BYTES)], -1)


def decode(wire: jax.Array, fmt: str, dtype) -> jax.Array:
    """Inverse of :func:`encode`: ``[..., H]`` in ``dtype``."""
    if fmt == "bf16":
        return from_bits(wire, jnp.bfloat16).astype(dtype)
    codes, scale_bytes = wire[..., :-SCALE_BYTES], wire[..., -SCALE_BYTES:]
    scale = lax.bitcast_convert_type(scale_bytes, jnp.float32)[..., None]  # [..., 1]
    kind = jnp.int8 if fmt == "int8" else jnp.float8_e4m3fn
    values = lax.bitcast_convert_type(codes, kind).astype(jnp.float32)
    return (values * scale).astype(dtype)


def crossing_pairs(mesh: Mesh, topology) -> frozenset[tuple[int, int]]:
    """Stage pairs ``(a, b)`` (either direction, wrap-around included) some of whose
    devices sit on different islands, from the mesh's own placement (its devices in
    topology order, :func:`holmes_jax.runtime.engine.mesh.device_islands`). Empty without a
    topology. Replicas' stage axes never cross, so with replica > 1 this is usually empty.
    """
    if topology is None:
        return frozenset()
    from holmes_jax.runtime.engine.mesh import device_islands

    islands = device_islands(mesh, topology)
    grid = np.vectorize(lambda d: islands[d.id], otypes=[object])(mesh.devices)
    stages = grid.shape[1]  # [replica, stage, data, tensor]
    return frozenset(
        (a, b)
        for a in range(stages)
        for b in range(stages)
        if a != b and np.any(grid[:, a] != grid[:, b])
    )


def check_format(fmt: str) -> str:
    """``fmt`` if the engine can send it (``auto`` must be resolved first)."""
    if fmt == "auto":
        raise ValueError(
            "cross_island_dtype='auto': resolve it first (holmes_jax.planner.plans.resolve_auto)"
        )
    if fmt not in CROSS_ISLAND_DTYPES:
        raise ValueError(f"cross_island_dtype={fmt!r}: must be one of {CROSS_ISLAND_DTYPES}")
    return fmt
