"""The stage axis: which stage holds which parameters, and the only traffic allowed along it.

Parameter layout (``PipelineLayout``). The logical parameters ``{'embed', 'blocks' [L, ...],
'head'}`` become, with a leading stage axis sharded over ``stage``:

    embed  [S, ...]            stage 0 uses its copy (and stage S-1 the tied wte)
    blocks [S, v·slots, ...]   chunk c of stage s uses slots c·slots .. c·slots + layers - 1
    head   [S, ...]            stage S-1 uses its copy

Unused copies and padded slots receive exactly zero gradient; checkpoints always hold the
logical layout (``to_logical`` / ``from_logical``), so a run can resume under another split.
``pipeline_shardings`` gives the pipeline layout's ``NamedSharding``s from the logical ones:
``stage`` on the new leading axis, then the logical spec (for blocks, the slot axis stays
unsharded in place of the layer axis).

Traffic between stages (inside the engine's ``shard_map``, where ``stage`` is manual) is
adjacent-stage ``ppermute`` only (the engine's per-tick sends name their pairs), and
``chain_sum`` sums over ``stage`` in 2(S−1) single-pair hops instead of a ``psum``, so
nothing but point-to-point traffic between neighbouring stages ever crosses an island
boundary.

The engine itself is :mod:`holmes_jax.runtime.engine.pipeline`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from holmes_jax.core.axes import STAGE
from holmes_jax.core.spec import even_split

# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class PipelineLayout:
    """Where each logical layer lives.

    ``layers_per_stage`` has one entry per virtual stage, in the order a micro-batch visits
    them (S·v entries; with ``virtual`` v = 1 one per stage). Chunk c of stage s is virtual
    stage ``c·S + s`` and occupies block slots ``c·slots .. c·slots + layers - 1`` of that
    stage, ``slots`` being the largest chunk (the rest is padding).
    """

    layers_per_stage: tuple[int, ...]
    virtual: int = 1

    @property
    def stages(self) -> int:
        return len(self.layers_per_stage) // self.virtual

    @property
    def slots(self) -> int:
        """Block slots per chunk (the largest chunk)."""
        return max(self.layers_per_stage)

    @property
    def num_layers(self) -> int:
        return sum(self.layers_per_stage)

    def chunk_layers(self) -> np.ndarray:
        """[stages, virtual]: layer count of chunk c on stage s."""
        return np.asarray(self.layers_per_stage, np.int32).reshape(self.virtual, self.stages).T

    def chunk_first_layer(self) -> np.ndarray:
        """[stages, virtual]: global index of the first layer of chunk c on stage s."""
        first = np.cumsum((0,) + self.layers_per_stage[:-1]).astype(np.int32)
        return first.reshape(self.virtual, self.stages).T

    def layer_table(self) -> np.ndarray:
        """[stages, virtual·slots] global layer index, or -1 for a padded slot."""
        S, n = self.stages, self.slots
        table = -np.ones((S, self.virtual * n), np.int32)
        first = 0
        for vs, count in enumerate(self.layers_per_stage):
            c, s = divmod(vs, S)
            table[s, c * n : c * n + count] = np.arange(first, first + count)
            first += count
        return table

    # Leaf-wise conversions; ``part`` is the top-level key: 'embed', 'blocks' or 'head'.

    def leaf_to_pipeline(self, x: jax.Array, part: str) -> jax.Array:
        if part != "blocks":
            return jnp.broadcast_to(x[None], (self.stages, *x.shape))
        table = self.layer_table()
        gathered = x[np.maximum(table, 0)]  # [S, slots, ...]
        mask = (table >= 0).reshape(table.shape + (1,) * (x.ndim - 1))
        return jnp.where(mask, gathered, jnp.zeros_like(gathered))

    def leaf_to_logical(self, x: jax.Array, part: str) -> jax.Array:
        if part == "embed":
            return x[0]
        if part == "head":
            return x[-1]
        table = self.layer_table()
        stage_of, slot_of = np.nonzero(table >= 0)
        order = np.argsort(table[stage_of, slot_of])  # layer order
        return x[stage_of[order], slot_of[order]]

    def map_parts(self, fn: Callable[[jax.Array, str], jax.Array], tree: Any) -> Any:
        """Apply ``fn(leaf, part)`` over a params-shaped dict."""
        return {part: jax.tree.map(lambda x, p=part: fn(x, p), sub) for part, sub in tree.items()}

    def parts_tree(self, params: Any) -> Any:
        """A params-shaped tree whose leaves are the part names (for optax.tree_map_params)."""
        return {part: jax.tree.map(lambda _, p=part: p, sub) for part, sub in params.items()}

    def spec(self, logical_spec: PartitionSpec, part: str) -> PartitionSpec:
        """Mesh spec of a pipeline leaf from its logical leaf's mesh spec."""
        if part == "blocks":
            return PartitionSpec(STAGE, None, *tuple(logical_spec)[1:])
        return PartitionSpec(STAGE, *tuple(logical_spec))


def layout_from_config(
    layers_per_stage, stages: int, num_layers: int, virtual: int = 1
) -> PipelineLayout:
    """Explicit split (one entry per virtual stage), or an even one (earlier virtual stages
    take the remainder)."""
    if isinstance(layers_per_stage, tuple):
        return PipelineLayout(tuple(layers_per_stage), virtual)
    return PipelineLayout(tuple(even_split(num_layers, stages * virtual)), virtual)


def pipeline_shardings(layout: PipelineLayout, logical_shardings, mesh: Mesh):
    """NamedShardings of the pipeline layout from the logical parameters' shardings."""
    return {
        part: jax.tree.map(
            lambda s, p=part: NamedSharding(mesh, layout.spec(s.spec, p)),
            sub,
            is_leaf=lambda x: isinstance(x, NamedSharding),
        )
        for part, sub in logical_shardings.items()
    }


# --------------------------------------------------------------------------- traffic


def chain_sum(x, stages: int):
    """Sum over ``stage`` using only adjacent-stage ppermutes: one hop per boundary and
    direction (2(S−1) sends in all).

    Accumulate downstream (hop k sends stage k's running sum to stage k+1, which adds its
    own), then broadcast the total upstream the same way. Used instead of ``psum`` so no
    all-reduce ever spans two islands; each hop names only its one pair, so a boundary
    carries the value once each way, never S−1 times.
    """
    if stages == 1:
        return x
    stage = lax.axis_index(STAGE)
    acc = x
    for k in range(stages - 1):
        got = jax.tree.map(lambda a, k=k: lax.ppermute(a, STAGE, [(k, k + 1)]), acc)
        acc = jax.tree.map(lambda a, v, g, k=k: jnp.where(stage == k + 1, v + g, a), acc, x, got)
    total = acc  # complete on stage S-1
    for k in reversed(range(stages - 1)):
        got = jax.tree.map(lambda a, k=k: lax.ppermute(a, STAGE, [(k + 1, k)]), total)
        total = jax.tree.map(lambda a, g, k=k: jnp.where(stage == k, g, a), total, got)
    return total
