"""Lanes: how an island's processes split the outer sync of independent DiLoCo.

Each island's entry of ``diloco.peers`` lists ``L`` addresses, the same ``L`` for every
island (:meth:`~holmes_jax.core.diloco_config.DilocoConfig.lane_addresses`). Lane ``ℓ`` is one
:class:`~holmes_jax.diloco.sync.OuterSync` per island, at the island's ``ℓ``-th
address, and carries block ``ℓ`` of every parameter: the leaf flattened (row-major, the
logical layout), zero-padded to ``L · B`` elements and cut into ``L`` blocks of ``B``
(:func:`block_size`). The blocks depend on the leaf's size and ``L`` alone, not on the
island's plan or process count, so islands with different plans and host counts exchange
the same blocks.

With ``diloco.fragments`` F > 1 the unit cut into lanes is a *piece*: each ``blocks`` leaf
``[layers, ...]`` splits along its layer axis into F contiguous ranges
(:func:`~holmes_jax.diloco.schedule.split_ranges`), piece f keyed ``<path>@<f>``; every
``embed`` leaf is one piece of fragment 0, every other leaf (the head) one of fragment
F − 1 (:func:`piece_path`). Fragments are ranges of the logical model's layers, so islands
with different pipelines exchange the same pieces.

An island of ``P`` processes (``P`` divides ``L``) gives process ``p`` lanes
``[p·L/P, (p+1)·L/P)``: it serves them and sends and receives only their blocks. One jitted
reshard inside the island (:class:`LaneLayout`) moves the logical model to the blocks and
back, so no host ever holds the whole model, and the island's traffic to its peers leaves
from every host at once. Lanes run the protocol independently; process 0's lane 0 sets the
island's step.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from holmes_jax.core.errors import ConfigError
from holmes_jax.diloco.schedule import split_ranges

QUANTUM = 16  # a block's elements are a multiple of this: a host's devices (<= 16) split it


def block_size(size: int, lanes: int) -> int:
    """``B``: the elements of one lane's block of a ``size``-element leaf."""
    return QUANTUM * max(1, math.ceil(size / (lanes * QUANTUM)))


def lane_key(path: str, lane: int) -> str:
    """The outer sync's key of block ``lane`` of leaf ``path``."""
    return f"{path}#{lane}"


def piece_path(path: str, fragment: int, fragments: int) -> str:
    """The key of fragment ``fragment``'s piece of leaf ``path`` (module doc)."""
    return path if fragments == 1 else f"{path}@{fragment}"


def pieces(path: str, shape: tuple[int, ...], fragments: int) -> list[tuple[str, int, int]]:
    """Leaf ``path``'s pieces: ``(key, start, stop)``, the range of its leading axis each
    holds (module doc; ``start`` = ``stop`` = -1: the whole leaf)."""
    if fragments == 1:
        return [(path, -1, -1)]
    if path.startswith("blocks/"):
        return [
            (piece_path(path, f, fragments), a, b)
            for f, (a, b) in enumerate(split_ranges(shape[0], fragments))
        ]
    fragment = 0 if path.startswith("embed/") else fragments - 1
    return [(piece_path(path, fragment, fragments), -1, -1)]


def process_lanes(lanes: int, processes: int, index: int) -> range:
    """The lanes process ``index`` of ``processes`` serves.

    Raises:
      ConfigError: ``processes`` does not divide ``lanes``.
    """
    if lanes % processes:
        raise ConfigError(
            f"diloco.peers: {lanes} lane address(es) per island for an island of {processes} "
            f"processes: each process serves the same number of lanes, so list a multiple "
            f"of {processes} addresses per island (python -m holmes_jax.launch "
            "--independent-islands lists them)"
        )
    per = lanes // processes
    return range(index * per, (index + 1) * per)


class LaneLayout:
    """The island's logical model <-> this process's lane blocks (module doc).

    Args:
      devices: the island program's devices (every process the same count).
      abstract: the logical model's shapes (``jax.ShapeDtypeStruct`` leaves).
      sharding: the logical model's shardings (the same tree).
      lanes: ``L``, the lane count of ``diloco.peers``.
      fragments: F, ``diloco.fragments`` (module doc).

    Raises:
      ConfigError: the island's process count does not divide ``lanes``.
    """

    def __init__(self, devices, abstract, sharding, lanes: int, fragments: int = 1):
        by_process: dict[int, list] = {}
        for d in sorted(devices, key=lambda d: (d.process_index, d.id)):
            by_process.setdefault(d.process_index, []).append(d)
        local = {len(ds) for ds in by_process.values()}
        if len(local) != 1:
            raise ValueError(f"lanes: processes hold different device counts {sorted(local)}")
        order = sorted(by_process)
        processes, k = len(order), local.pop()
        self.lanes = lanes
        self.mine = process_lanes(lanes, processes, order.index(jax.process_index()))
        self.per = len(self.mine)
        mesh = Mesh(np.array([by_process[p] for p in order]), ("proc", "local"))
        leaves, self.treedef = jax.tree_util.tree_flatten_with_path(abstract)
        shapes = [a.shape for _, a in leaves]
        # every piece: (leaf index, key, start, stop), in leaf order
        cut = [
            (i, key, a, b)
            for i, (path, leaf) in enumerate(leaves)
            for key, a, b in pieces(
                jax.tree_util.keystr(path, simple=True, separator="/"), leaf.shape, fragments
            )
        ]
        self.paths = [key for _, key, _, _ in cut]  # the pieces' keys
        sizes = [
            math.prod(shapes[i]) if a < 0 else math.prod(shapes[i]) // shapes[i][0] * (b - a)
            for i, _, a, b in cut
        ]
        self.blocks = [block_size(n, lanes) for n in sizes]
        self.block_sharding = [
            NamedSharding(mesh, PartitionSpec("proc", "local" if b % k == 0 else None))
            for b in self.blocks
        ]
        block_tree = list(self.block_sharding)
        blocks = self.blocks

        def to_blocks(model):  # each piece [*shape] -> [L, B]
            flat = jax.tree.leaves(model)
            out = []
            for (i, _, a, b), n in zip(cut, blocks, strict=True):
                x = (flat[i] if a < 0 else flat[i][a:b]).reshape(-1)
                out.append(jnp.pad(x, (0, lanes * n - x.size)).reshape(lanes, n))
            return out

        def from_blocks(tree):  # each piece [L, B] -> its leaf's rows; the leaves
            parts: list[list] = [[] for _ in shapes]
            for (i, _, a, b), x in zip(cut, tree, strict=True):
                rows = shapes[i] if a < 0 else (b - a, *shapes[i][1:])
                parts[i].append(x.reshape(-1)[: math.prod(rows)].reshape(rows))
            return self.treedef.unflatten(
                [p[0] if len(p) == 1 else jnp.concatenate(p) for p in parts]
            )

        self._to = jax.jit(to_blocks, in_shardings=(sharding,), out_shardings=block_tree)
        self._from = jax.jit(from_blocks, in_shardings=(block_tree,), out_shardings=sharding)
        self._add = jax.jit(
            lambda a, b: jax.tree.map(jnp.add, a, b),
            in_shardings=(sharding, sharding),
            out_shardings=sharding,
        )
        self.abstract = abstract
        self.abstract_blocks = [
            jax.ShapeDtypeStruct((lanes, b), jnp.float32, sharding=s)
            for b, s in zip(self.blocks, self.block_sharding, strict=True)
        ]

    def block_shapes(self) -> dict[str, tuple[int]]:
        """This process's blocks: each key (:func:`lane_key`) and its shape ``(B,)``."""
        return {
            lane_key(path, lane): (b,)
            for path, b in zip(self.paths, self.blocks, strict=True)
            for lane in self.mine
        }

    def compile(self) -> None:
        """Compile both reshards and :meth:`add` now (a multi-process island, ahead of
        their first call)."""
        self._to = self._to.lower(self.abstract).compile()
        self._from = self._from.lower(self.abstract_blocks).compile()
        self._add = self._add.lower(self.abstract, self.abstract).compile()

    def add(self, a, b):
        """``a + b`` for two logical models (their shardings), on the devices."""
        return self._add(a, b)

    def to_host(self, model) -> dict[str, np.ndarray]:
        """This process's blocks of ``model`` (the logical model, fp32), keyed
        :func:`lane_key`; every process of the island calls it."""
        out = {}
        first = self.mine.start
        for path, x in zip(self.paths, self._to(model), strict=True):
            rows = np.empty((self.per, x.shape[1]), np.float32)
            for shard in x.addressable_shards:
                r, c = shard.index
                start, stop, _ = r.indices(self.lanes)
                rows[start - first : stop - first, c] = np.asarray(shard.data)
            for n, lane in enumerate(self.mine):
                out[lane_key(path, lane)] = rows[n]
        return out

    def from_host(self, blocks: dict[str, np.ndarray]):
        """The logical model (its shardings) from every process's own :meth:`to_host`
        blocks; every process of the island calls it."""
        first = self.mine.start
        leaves = []
        for path, b, sharding in zip(self.paths, self.blocks, self.block_sharding, strict=True):
            rows = np.stack([blocks[lane_key(path, lane)] for lane in self.mine])

            def part(index, rows=rows):
                r, c = index
                start, stop, _ = r.indices(self.lanes)
                return rows[start - first : stop - first, c]

            leaves.append(jax.make_array_from_callback((self.lanes, b), sharding, part))
        return self._from(leaves)
