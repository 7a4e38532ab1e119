"""DiLoCo across the ``replica`` axis: the outer step, its wire format and its fragments.

With ``diloco.enabled`` and ``replica`` = R > 1, each replica (one per island) owns its
parameters, AdamW moments and master copy. Those leaves carry a leading ``[R]`` axis
sharded over ``replica`` (:func:`stack_spec`); the inner step runs no collective over
``replica``. The outer state ``outer = {'global', 'momentum'}`` is fp32, with no ``[R]``
axis, sharded like one replica's ZeRO-1 moments.

The outer step of fragment f (one jitted function per fragment), on each of its leaves:

1. ``Δ_r = global − θ_r`` in fp32 per replica (θ_r: its master, else its parameters).
2. Encode in ``diloco.outer_dtype`` (:func:`encode`, the contract of
   :mod:`holmes_jax.diloco.codec`): fp32; bf16; int8 with one scale per replica and tensor.
3. All-gather the encoded ``[R, ...]`` shards over ``replica`` in the encoded dtype, the
   only cross-island traffic (an explicit ``all_gather`` in a ``shard_map``).
4. Decode and average in fp32: ``Δ = mean_r decode(q_r, s_r)``.
5. Nesterov: ``m ← μ·m + Δ``; ``global ← global − lr·(Δ + μ·m)`` (``lr`` =
   ``diloco.outer_lr``, ``μ`` = ``diloco.outer_momentum``).
6. ``θ_r ← global`` for every replica. The AdamW moments and step counts are kept.

Warm-up: after each of the first K = ``diloco.warmup_steps`` steps every fragment takes
an averaging step instead (1–4, 6 with ``global ← global − Δ``, momentum untouched).
With H = 1, lr = 1, μ = 0 the outer step is the mean of the replicas' AdamW steps.

Fragments are F contiguous ranges of the block slots (embedding with fragment 0, head with
F−1). After the warm-up, fragment f is due after step n iff ``(n − K) mod H == ⌊f·H / F⌋``
(:func:`~holmes_jax.diloco.schedule.due_fragments`). The phase follows from the step, so
checkpoints need no field.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from holmes_jax.core.axes import REPLICA
from holmes_jax.core.config import DilocoConfig
from holmes_jax.core.errors import ConfigError
from holmes_jax.diloco.codec import int8_quantize, int8_scale, nesterov
from holmes_jax.diloco.schedule import split_ranges


def stack_spec(spec: PartitionSpec) -> PartitionSpec:
    """The spec of a leaf with the leading per-replica [R] axis over ``replica``."""
    return PartitionSpec(REPLICA, *tuple(spec))


def fragment_slots(slots: int, fragments: int) -> list[tuple[int, int]]:
    """F contiguous ``[start, stop)`` ranges of a stage's ``slots`` block slots
    (:func:`~holmes_jax.diloco.schedule.split_ranges`).

    Raises:
      ConfigError: more fragments than slots.
    """
    if fragments > slots:
        raise ConfigError(
            f"diloco.fragments={fragments}: must be <= the {slots} block slots of a pipeline "
            "stage (a fragment is a range of every stage's layers)"
        )
    return split_ranges(slots, fragments)


def encode(delta: jax.Array, dtype: str) -> tuple[jax.Array, jax.Array]:
    """``delta [R, ...]`` fp32 -> (payload [R, ...] in the wire dtype, scale [R] fp32).

    int8: one scale per replica and tensor (:func:`~holmes_jax.diloco.codec.int8_scale`);
    bf16 and fp32 carry scale 1.
    """
    R = delta.shape[0]
    ones = jnp.ones((R,), jnp.float32)
    if dtype == "fp32":
        return delta, ones
    if dtype == "bf16":
        return delta.astype(jnp.bfloat16), ones
    if dtype != "int8":
        raise ValueError(f"outer dtype {dtype!r}")
    # [R]: a max over the local shard, then over data (a reshape would gather the shards)
    scale = int8_scale(jnp.max(jnp.abs(delta), axis=tuple(range(1, delta.ndim))), jnp)
    return int8_quantize(delta, _per_replica(scale, delta.ndim), jnp), scale


def decode(payload: jax.Array, scale: jax.Array) -> jax.Array:
    """The fp32 ``[R, ...]`` deltas from :func:`encode`'s output."""
    return payload.astype(jnp.float32) * _per_replica(scale, payload.ndim)


def _per_replica(scale, ndim: int):
    return scale.reshape((-1,) + (1,) * (ndim - 1))


class OuterStep:
    """The jitted outer steps of one program, one per fragment (built on first use).

    Args:
      cfg: the ``diloco`` section.
      layout: the pipeline layout (fragments are ranges of its ``v·slots`` block slots).
      mesh: the program's mesh.
      state_sharding: the program's ``TrainState`` of shardings (``outer`` set).
      dtype: the compute dtype of the parameters.

    Raises:
      ConfigError: ``diloco.fragments`` larger than a stage's block slots.
    """

    def __init__(self, cfg: DilocoConfig, layout, mesh: Mesh, state_sharding, dtype):
        self.cfg = cfg
        self.mesh = mesh
        self.dtype = dtype
        self.state_sharding = state_sharding
        self.ranges = fragment_slots(layout.virtual * layout.slots, cfg.fragments)
        self._jitted: dict[tuple[int, bool], Any] = {}

    def __call__(self, state, fragment: int, average: bool = False):
        return self.jitted(fragment, average)(state)

    def jitted(self, fragment: int, average: bool = False):
        """The jitted outer step of ``fragment`` (state donated); ``average``: the warm-up's
        plain averaging (outer lr 1, momentum untouched)."""
        key = (fragment, average)
        if key not in self._jitted:
            self._jitted[key] = jax.jit(
                lambda state: self.step(state, fragment, average),
                in_shardings=(self.state_sharding,),
                out_shardings=self.state_sharding,
                donate_argnums=(0,),
            )
        return self._jitted[key]

    def compile_all(self, abstract_state) -> None:
        """Compile every fragment's outer step now (ahead of time) for ``abstract_state``
        (ShapeDtypeStructs with shardings): otherwise the first outer step of each
        fragment compiles in the middle of training, a pause of seconds that a benchmark
        would count as sync time."""
        kinds = (False, True) if self.cfg.warmup_steps else (False,)
        for fragment in range(self.cfg.fragments):
            for average in kinds:
                compiled = self.jitted(fragment, average).lower(abstract_state).compile()
                self._jitted[fragment, average] = compiled

    def step(self, state, fragment: int, average: bool = False):
        """Steps 1–6 on fragment ``fragment``'s leaves (traced); the rest passes through.
        ``average``: the warm-up's averaging step (module doc)."""
        last = self.cfg.fragments - 1
        start, stop = self.ranges[fragment]
        parts = ["blocks"] + ["embed"] * (fragment == 0) + ["head"] * (fragment == last)
        params, glob, mom = (
            dict(state.params),
            dict(state.outer["global"]),
            dict(state.outer["momentum"]),
        )
        master = None if state.master is None else dict(state.master)
        for part in parts:
            # blocks: slots [start, stop) of the slot axis (1 in the outer trees, 2 with [R])
            cut = (slice(None), slice(start, stop)) if part == "blocks" else ()
            lead = (slice(None), *cut)
            treedef = jax.tree.structure(state.params[part])
            p_leaves = treedef.flatten_up_to(state.params[part])
            w_leaves = p_leaves if master is None else treedef.flatten_up_to(master[part])
            g_leaves = treedef.flatten_up_to(glob[part])
            m_leaves = treedef.flatten_up_to(mom[part])
            specs = [
                s.spec for s in treedef.flatten_up_to(self.state_sharding.outer["global"][part])
            ]
            out = [[], [], [], []]  # params, master, global, momentum
            for p, w, g, m, spec in zip(p_leaves, w_leaves, g_leaves, m_leaves, specs, strict=True):
                theta, g_new, m_new = self._sync(w[lead], g[cut], m[cut], spec, average)
                out[0].append(p.at[lead].set(theta.astype(p.dtype)))
                out[1].append(w.at[lead].set(theta))
                out[2].append(g.at[cut].set(g_new))
                out[3].append(m.at[cut].set(m_new))
            params[part], glob[part], mom[part] = (treedef.unflatten(out[k]) for k in (0, 2, 3))
            if master is not None:
                master[part] = treedef.unflatten(out[1])
        return state.replace(params=params, master=master, outer={"global": glob, "momentum": mom})

    def _sync(self, mine, g, m, spec: PartitionSpec, average: bool = False):
        """Steps 1–6 for one leaf (slice): ``mine`` ``[R, ...]`` (the replicas' master or
        parameters), ``g``/``m`` ``[...]`` fp32 sharded by ``spec`` (1/d over data inside an
        island). Returns (the replicas' new fp32 ``[R, ...]``, global, momentum).
        ``average``: ``global − mean Δ``, momentum unchanged (the warm-up)."""
        lr, mu = self.cfg.outer_lr, self.cfg.outer_momentum
        # 1. per replica, each device on its own 1/d shard (no traffic)
        delta = g[None] - mine.astype(jnp.float32)  # [R, ...]
        delta = lax.with_sharding_constraint(delta, self._sharding(stack_spec(spec)))
        # 2.-3. encode; all-gathered across islands in the wire dtype
        payload, scale = self._gather(*encode(delta, self.cfg.outer_dtype), spec)
        # 4. decode and average in fp32: [...] sharded like g
        avg = jnp.mean(decode(payload, scale), axis=0)
        # 5. Nesterov momentum (warm-up: plain averaging, the momentum kept for later)
        if average:
            g = g - avg
        else:
            g, m = nesterov(g, m, avg, lr, mu)
        # 6. every replica restarts from the global model (the barrier: one value of g, not
        #    two fusions that could round differently)
        g = lax.optimization_barrier(g)
        return jnp.broadcast_to(g, mine.shape), g, m

    def _gather(self, payload, scale, spec: PartitionSpec):
        """Step 3: ``payload [R, ...]`` (each device its replica's 1/d shard) all-gathered
        over ``replica`` in its own dtype, with the int8 ``scale [R]`` (fp32 and bf16
        carry none: their scales are ones).

        An explicit ``all_gather`` in a ``shard_map`` (manual over every axis, the layout
        as ``spec`` says), not a sharding constraint: given ``convert`` → constraint →
        ``convert``, XLA folded the int8 / bf16 round trip into the producer and gathered
        fp32, four times the bytes on the slowest link.
        """
        int8 = self.cfg.outer_dtype == "int8"

        def gather(q, s):  # local [1, ...] and [1] -> [R, ...] and [R]
            if q.dtype == jnp.bfloat16:  # XLA:CPU widens bf16 collectives to f32: send bits
                bits = lax.all_gather(lax.bitcast_convert_type(q, jnp.uint16), REPLICA, tiled=True)
                q = lax.bitcast_convert_type(bits, jnp.bfloat16)
            else:
                q = lax.all_gather(q, REPLICA, tiled=True)
            return q, (
                lax.all_gather(s, REPLICA, tiled=True)
                if int8
                else jnp.ones_like(s, shape=(payload.shape[0],))
            )

        return jax.shard_map(
            gather,
            mesh=self.mesh,
            in_specs=(stack_spec(spec), PartitionSpec(REPLICA)),
            out_specs=(PartitionSpec(None, *spec), PartitionSpec()),
            # Off: all_gather's result types as varying over replica; out_specs say replicated.
            check_vma=False,
        )(payload, scale)

    def _sharding(self, spec: PartitionSpec) -> NamedSharding:
        return NamedSharding(self.mesh, spec)
