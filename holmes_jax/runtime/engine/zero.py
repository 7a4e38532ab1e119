"""ZeRO-1: the optimizer state sharded over ``data``, gradients reduce-scattered into it.

Each data-parallel rank owns 1/d of every gradient, of the AdamW moments and, with bf16
parameters, of the fp32 master copy. The engine (:mod:`holmes_jax.runtime.engine.pipeline`)
runs these phases in order:

1. Per-layer buckets, during the backward of a stage's last micro-batch: layer j's
   gradient is reduced over ``data`` inside the island as soon as it is complete
   (reduce-scatter with ZeRO-1, all-reduce without). On a GPU this overlaps the backward
   of layer j−1, and each stage reduces at its own tick. That is
   ``parallel.grad_buckets: layer``. With ``step``, the default where collectives block
   the device (gloo on CPU), the loop only accumulates. Each block leaf is then reduced
   once after it, all ``[slots, ...]`` at a time, with the embedding and head. Where
   collectives block, the engine packs each bucket into one buffer per collective
   (:func:`reduce_bucket` ``flat``): XLA:CPU makes one call, a rendezvous of every rank,
   per operand.
2. After the tick loop, the embedding and head bucket (per-layer buckets).
3. With ``parallel.replica > 1``: all-reduce of each 1/d shard across islands over
   ``replica``, the only bytes that cross an island for it.
4. Cross-stage sums (tied embedding, the global gradient norm) by neighbour hops
   (``stages.chain_sum``), on the 1/d shards.
5. Outside the ``shard_map``: AdamW updates the 1/d shard, and GSPMD all-gathers the
   updated parameters over ``data``.

A leaf is split on its first dimension that is not already sharded (not stage, slot or a
tensor-parallel axis) and that ``data`` divides. A leaf with none (a small bias) stays
replicated and is all-reduced.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from holmes_jax.core.axes import DATA, REPLICA


def shard_dim(
    shape: tuple[int, ...],
    spec: PartitionSpec,
    data: int,
    skip: int,
    axis_sizes: dict[str, int] | None = None,
) -> int:
    """The dimension of a leaf to split over ``data`` (-1: keep it replicated).

    Args:
      shape: the leaf's global shape.
      spec: its mesh PartitionSpec (dims really sharded are not candidates).
      data: the data-parallel degree.
      skip: leading dims never split (the stage axis, and the slot axis of blocks).
      axis_sizes: mesh axis sizes; a dim mapped only to size-1 axes counts as free.
    """
    if data == 1:
        return -1
    sizes = axis_sizes or {}
    entries = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    for dim in range(skip, len(shape)):
        axes = entries[dim] if isinstance(entries[dim], tuple) else (entries[dim],)
        free = all(a is None or sizes.get(a, 0) == 1 for a in axes)
        if free and shape[dim] % data == 0:
            return dim
    return -1


def sharded_spec(spec: PartitionSpec, dim: int, ndim: int) -> PartitionSpec:
    """``spec`` with ``data`` added on ``dim`` (the optimizer-state / gradient sharding)."""
    entries = list(tuple(spec)) + [None] * (ndim - len(tuple(spec)))
    if dim >= 0:
        entries[dim] = DATA
    return PartitionSpec(*entries)


def zero1_split(abstract_params: dict, param_sharding: dict, mesh, enabled: bool):
    """ZeRO-1 for the engine's parameter parts (``blocks``, ...): which dim of each leaf
    is split over ``data`` (-1: none; never the stage axis, nor the slot axis of blocks),
    and the sharding of the optimizer state and fp32 master that follows from it.

    Returns:
      (dims, optimizer-state shardings), trees like ``param_sharding``.
    """
    data, axes = mesh.shape[DATA], dict(mesh.shape)
    dims = {
        part: jax.tree.map(
            lambda a, s, skip=(2 if part == "blocks" else 1): (
                shard_dim(a.shape, s.spec, data, skip, axes) if enabled else -1
            ),
            abstract_params[part],
            param_sharding[part],
        )
        for part in abstract_params
    }
    shardings = jax.tree.map(
        lambda s, a, dim: NamedSharding(mesh, sharded_spec(s.spec, dim, len(a.shape))),
        param_sharding,
        abstract_params,
        dims,
    )
    return dims, shardings


def reduce_bucket(grads: Any, dims: Any, data: int, replica: int, flat: bool = False) -> Any:
    """Phases 1–3 for one bucket: mean over ``data`` (and ``replica``) of local gradients.

    Args:
      grads: local gradient leaves (inside the shard_map; no stage axis).
      dims: matching tree of the local dimension to scatter over ``data``, or -1.
      data: data-parallel degree; replica: cross-island copies.
      flat: one collective for all the scattered leaves and one for the whole ones
        (:func:`_reduce_flat`), instead of one per leaf. Same result.

    Returns:
      Leaves reduced to their 1/d shard along ``dim`` (or whole, where dim is -1),
      averaged over all data-parallel ranks of all replicas.
    """
    if flat and data > 1:
        return _reduce_flat(grads, dims, data, replica)
    scale = 1.0 / (data * replica)

    def one(g, dim):
        g = g.astype(jnp.float32)  # reductions always in fp32
        if data == 1:  # no collective over a size-1 axis (XLA's SPMD partitioner rejects
            out = g  # a manual all-reduce beside an automatic tensor axis there)
        elif dim < 0:
            out = lax.psum(g, DATA)
        else:
            out = lax.psum_scatter(g, DATA, scatter_dimension=dim, tiled=True)
        if replica > 1:
            out = lax.psum(out, REPLICA)  # 1/d-sized shards cross the islands
        return out * scale

    return jax.tree.map(one, grads, dims)


def _reduce_flat(grads: Any, dims: Any, data: int, replica: int) -> Any:
    """:func:`reduce_bucket` with one buffer per collective, for runtimes that make one
    call per operand (XLA:CPU's gloo collectives: a call costs a rendezvous of every rank).

    A scattered leaf goes in as ``[data, n/data * rest]`` (its ``dim`` first, split in
    ``data`` rows: row r is what rank r keeps); the leaves' rows are concatenated into
    ``[data, W]`` and reduce-scattered over its rows, so each rank gets ``[1, W]``, every
    leaf's shard side by side. The whole leaves are concatenated flat and all-reduced."""
    leaves, tree = jax.tree.flatten(grads)
    dim_of = jax.tree.leaves(dims)
    g32 = [g.astype(jnp.float32) for g in leaves]  # reductions always in fp32
    scale = 1.0 / (data * replica)
    out: list = [None] * len(leaves)

    def across_replicas(x):
        return lax.psum(x, REPLICA) if replica > 1 else x  # 1/d-sized shards cross

    scattered = [i for i, dim in enumerate(dim_of) if dim >= 0]
    if scattered:
        moved = [jnp.moveaxis(g32[i], dim_of[i], 0) for i in scattered]  # [n, rest...]
        rows = [m.reshape(data, -1) for m in moved]
        mine = lax.psum_scatter(jnp.concatenate(rows, axis=1), DATA, tiled=True)  # [1, W]
        mine = across_replicas(mine)[0]
        cuts = list(itertools.accumulate(r.shape[1] for r in rows))[:-1]
        for i, m, part in zip(scattered, moved, jnp.split(mine, cuts), strict=True):
            shard = part.reshape(m.shape[0] // data, *m.shape[1:])
            out[i] = jnp.moveaxis(shard, 0, dim_of[i]) * scale
    whole = [i for i, dim in enumerate(dim_of) if dim < 0]
    if whole:
        summed = across_replicas(
            lax.psum(jnp.concatenate([g32[i].reshape(-1) for i in whole]), DATA)
        )
        cuts = list(itertools.accumulate(g32[i].size for i in whole))[:-1]
        for i, part in zip(whole, jnp.split(summed, cuts), strict=True):
            out[i] = part.reshape(g32[i].shape) * scale
    return jax.tree.unflatten(tree, out)


def shard_shape(shape: tuple[int, ...], dim: int, data: int) -> tuple[int, ...]:
    if dim < 0:
        return shape
    return tuple(n // data if k == dim else n for k, n in enumerate(shape))


def squared_norm(shards: Any, dims: Any) -> jax.Array:
    """Sum of squares of the full gradient from its shards (scattered leaves are summed
    over ``data``; replicated leaves count once)."""
    split = jnp.zeros((), jnp.float32)
    whole = jnp.zeros((), jnp.float32)
    for g, dim in zip(
        jax.tree.leaves(shards),
        jax.tree.leaves(dims),
        strict=True,
    ):
        if dim < 0:
            whole += jnp.sum(jnp.square(g))
        else:
            split += jnp.sum(jnp.square(g))
    return lax.psum(split, DATA) + whole
