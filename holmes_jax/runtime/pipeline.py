"""Pipeline parallelism over the ``stage`` axis: uneven stages, GPipe and 1F1B, one program.

Parameter layout (``PipelineLayout``). The logical parameters ``{'embed', 'blocks' [L, ...],
'head'}`` become, with a leading stage axis sharded over ``stage``:

    embed  [S, ...]          stage 0 uses its copy (and stage S-1 the tied wte)
    blocks [S, slots, ...]   stage s uses slots 0 .. layers[s]-1; slots = max(layers)
    head   [S, ...]          stage S-1 uses its copy

Unused copies and padded slots receive exactly zero gradient; checkpoints always hold the
logical layout (``to_logical`` / ``from_logical``), so a run can resume under another split.

The step (``PipelineEngine.loss_and_grads``) is one ``shard_map``, manual over ``replica``,
``stage`` and ``data`` (``tensor`` stays automatic: GSPMD does tensor parallelism in a stage):

1. Split the local batch ``[B/d, T+1]`` into M microbatches ``[M, B/(dM), T+1]``.
2. Tick loop (``lax.scan`` over the tables of :mod:`holmes_jax.runtime.schedule`); per tick each
   stage runs the op its table names, each guarded by ``_when`` (a 0-or-1-trip while loop,
   which XLA updates in place where ``lax.cond`` / ``lax.switch`` copied every buffer):
   - FWD: embed (stage 0) or take the activation from the inbox; run the stage's layers
     with a ``fori_loop`` whose trip count is this stage's layer count (padded slots are
     never executed), keeping each layer's ``jax.vjp`` residuals in the buffer slot —
     exactly what the ``model.remat`` policy saves; on the last stage also the head: loss
     and its gradient right away.
   - BWD: walk the layers backwards from the stored residuals (explicit vjp, recomputing
     only what the policy did not save), accumulating fp32 parameter gradients; in the
     last microbatch's backward each layer's gradient is reduced over ``data`` as soon as
     it is complete (ZeRO-1 reduce-scatter, :mod:`holmes_jax.runtime.zero` phase 1); embedding
     backward on stage 0.
   - IDLE: nothing. Bubble ticks cost no compute and never touch real data.
   Then ``ppermute`` the forward output to s+1 and the input gradient to s−1.
3. Embedding and head gradients reduced over ``data`` (and ``replica``), inside an island
   (:mod:`holmes_jax.runtime.zero` phases 2–3).
4. Sums across stages (loss, squared gradient norm, tied-embedding gradient) go through
   ``chain_sum``: adjacent-stage ``ppermute`` only, so nothing but point-to-point
   traffic between neighbouring stages ever crosses an island boundary.

16-bit buffers (residuals, inbox, head cotangents) are stored as uint16 bit patterns
(``_to_bits``): free on GPU, and it keeps XLA:CPU from holding f32 copies of them, so the
compiled memory analysis the memory model is checked against matches a GPU's.

Gradient clipping needs the global norm, which only exists after step 4: the engine
returns it beside the (unclipped) gradients and the program clips with it
(``optim.clip_by_global_norm``) instead of letting optax recompute a wrong norm from the
pipeline layout, where padded slots and a tied embedding's copies would distort it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from holmes_jax.core.axes import BATCH_AXES, DATA, REPLICA, STAGE
from holmes_jax.core.config import ModelConfig
from holmes_jax.runtime.model import GPT, LOGICAL_RULES, remat_block
from holmes_jax.runtime.schedule import BWD, FWD, Schedule, make_schedule
from holmes_jax.runtime.zero import reduce_bucket, shard_shape, sharded_spec, squared_norm

# Inside the pipeline ``data`` is a manual axis: the batch is already split, so the
# activation constraints map ``batch`` to nothing; tensor rules stay.
PIPELINE_RULES = tuple((name, None if name == "batch" else axis) for name, axis in LOGICAL_RULES)


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class PipelineLayout:
    """Where each logical layer lives: ``layers_per_stage`` padded to ``slots``."""

    layers_per_stage: tuple[int, ...]

    @property
    def stages(self) -> int:
        return len(self.layers_per_stage)

    @property
    def slots(self) -> int:
        return max(self.layers_per_stage)

    @property
    def num_layers(self) -> int:
        return sum(self.layers_per_stage)

    def layer_table(self) -> np.ndarray:
        """[stages, slots] global layer index, or -1 for a padded slot."""
        table = -np.ones((self.stages, self.slots), np.int32)
        first = 0
        for s, n in enumerate(self.layers_per_stage):
            table[s, :n] = np.arange(first, first + n)
            first += n
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
        stage_of, slot_of = np.nonzero(table >= 0)  # row-major = layer order
        return x[stage_of, slot_of]

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


def layout_from_config(layers_per_stage, stages: int, num_layers: int) -> PipelineLayout:
    """Explicit split, or an even one (earlier stages take the remainder)."""
    if isinstance(layers_per_stage, tuple):
        return PipelineLayout(tuple(layers_per_stage))
    base, extra = divmod(num_layers, stages)
    return PipelineLayout(tuple(base + (s < extra) for s in range(stages)))


# --------------------------------------------------------------------------- helpers


def _shift(x, stages: int, direction: int):
    """Send to the neighbouring stage (``+1`` downstream, ``-1`` upstream); ends get 0."""
    if direction > 0:
        perm = [(s, s + 1) for s in range(stages - 1)]
    else:
        perm = [(s + 1, s) for s in range(stages - 1)]
    return jax.tree.map(lambda a: lax.ppermute(a, STAGE, perm), x)


def chain_sum(x, stages: int):
    """Sum over ``stage`` using only adjacent-stage ppermutes (2(S−1) hops).

    Accumulate downstream (stage S−1 ends with the total), then broadcast it upstream.
    Used instead of ``psum`` so no all-reduce ever spans two islands.
    """
    if stages == 1:
        return x
    stage = lax.axis_index(STAGE)
    acc = x
    for _ in range(stages - 1):
        acc = jax.tree.map(jnp.add, x, _shift(acc, stages, +1))
    total = acc
    for _ in range(stages - 1):
        back = _shift(total, stages, -1)
        total = jax.tree.map(lambda a, b: jnp.where(stage == stages - 1, a, b), acc, back)
    return total


def _dyn_index(tree, i):
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _dyn_set(tree, i, value):
    return jax.tree.map(lambda a, v: lax.dynamic_update_index_in_dim(a, v, i, 0), tree, value)


class _Residuals:
    """Split a layer's ``jax.vjp`` function into bufferable arrays and the rest.

    The vjp function is a pytree whose leaves are its residuals. Leaves that *are* the
    layer's weights are not buffered (the backward takes the weights again); non-array
    leaves are static. The template comes from one trace of the layer; every later trace
    of the same layer has the same structure, which ``split`` checks.
    """

    def __init__(self, vjp_fn, weights):
        leaves, self.treedef = jax.tree.flatten(vjp_fn)
        self.kinds = self._classify(leaves, weights)
        self.static = [
            None if k[0] != "static" else leaf for k, leaf in zip(self.kinds, leaves, strict=True)
        ]
        self.buffered = [
            jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
            for k, leaf in zip(self.kinds, leaves, strict=True)
            if k[0] == "buf"
        ]

    @staticmethod
    def _classify(leaves, weights):
        ids = {id(w): n for n, w in enumerate(jax.tree.leaves(weights))}
        kinds = []
        for leaf in leaves:
            if id(leaf) in ids:
                kinds.append(("weight", ids[id(leaf)]))
            elif isinstance(leaf, jax.Array):
                kinds.append(("buf",))
            else:
                kinds.append(("static",))
        return kinds

    def split(self, vjp_fn, weights) -> list[jax.Array]:
        leaves = jax.tree.leaves(vjp_fn)
        if self._classify(leaves, weights) != self.kinds:
            raise RuntimeError("pipeline: layer vjp residual structure changed between traces")
        return [leaf for k, leaf in zip(self.kinds, leaves, strict=True) if k[0] == "buf"]

    def join(self, buffered: list[jax.Array], weights):
        w = jax.tree.leaves(weights)
        it = iter(buffered)
        leaves = [
            next(it) if k[0] == "buf" else w[k[1]] if k[0] == "weight" else s
            for k, s in zip(self.kinds, self.static, strict=True)
        ]
        return jax.tree.unflatten(self.treedef, leaves)


# --------------------------------------------------------------------------- engine


class PipelineEngine:
    """Loss and gradients of the GPT over a (stage, data, tensor) mesh."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        layout: PipelineLayout,
        mesh: Mesh,
        *,
        microbatches: int,
        schedule: str,
        seed: int,
        grad_dims: Any = None,
        nan_bubbles: bool = False,
    ):
        if layout.stages != mesh.shape[STAGE]:
            raise ValueError(
                f"layout has {layout.stages} stages, mesh stage axis {mesh.shape[STAGE]}"
            )
        self.cfg = model_cfg
        self.layout = layout
        self.mesh = mesh
        self.M = microbatches
        self.schedule: Schedule = make_schedule(schedule, layout.stages, microbatches)
        self.seed = seed
        self.data = mesh.shape[DATA]
        self.replica = mesh.shape[REPLICA]
        # Per leaf, the (pipeline-layout) dim that ZeRO-1 scatters over data, or -1.
        self.grad_dims = grad_dims
        self.nan_bubbles = nan_bubbles
        self.gpt = GPT(model_cfg, deterministic=model_cfg.dropout == 0.0)
        # The layer under the config's remat policy: its jax.vjp residuals, which the engine
        # buffers per layer and micro-batch, are exactly what the policy saves.
        self.block = remat_block(model_cfg)(model_cfg, deterministic=model_cfg.dropout == 0.0)

    # The three model parts as pure functions of their parameters.

    def _embed(self, embed_params, tokens):
        return self.gpt.apply({"params": {"embed": embed_params}}, tokens, method=GPT.embed_tokens)

    def _layer(self, weights, x, key):
        rngs = {"dropout": key} if self.cfg.dropout > 0 else None
        y, _ = self.block.apply({"params": weights}, x, rngs=rngs)
        return y

    def _head_loss(self, embed_params, head_params, x, targets):
        variables = {"params": {"embed": embed_params, "head": head_params}}
        return self.gpt.apply(variables, x, targets, method=GPT.head_loss)

    def loss_and_grads(self, params, batch, step):
        """Returns ``(loss, grads, grad_norm)``: mean loss, reduced (unclipped) gradients in
        the pipeline layout (1/d shards with ZeRO-1) and their global norm.

        Args:
          params: pipeline-layout parameters (leading stage axis).
          batch: ``[B, T+1]`` int32 tokens sharded over ``data``.
          step: int32 scalar (dropout keys derive from seed, step, microbatch, layer).
        """
        dims = self._dims(params)
        param_specs = jax.tree.map(lambda _: PartitionSpec(STAGE), params)
        grad_specs = jax.tree.map(
            lambda a, dim: sharded_spec(PartitionSpec(STAGE), dim, a.ndim), params, dims
        )
        fn = jax.shard_map(
            self._body,
            mesh=self.mesh,
            in_specs=(param_specs, PartitionSpec(BATCH_AXES), PartitionSpec()),
            out_specs=(PartitionSpec(), grad_specs, PartitionSpec()),
            axis_names={REPLICA, STAGE, DATA},
            check_vma=False,
        )
        with nn.logical_axis_rules(PIPELINE_RULES):
            return fn(params, batch, step)

    def _dims(self, params):
        if self.grad_dims is None:
            return jax.tree.map(lambda _: -1, params)
        return self.grad_dims

    def _body(self, params, batch, step):
        S, M, sched = self.layout.stages, self.M, self.schedule
        d, r = self.data, self.replica
        # Local ZeRO dims: the stage axis is gone inside the shard_map, and a block slot
        # (one layer, the bucket) also drops the slot axis.
        dims = jax.tree.map(lambda k: k - 1 if k >= 0 else -1, self._dims(params))
        slot_dims = jax.tree.map(lambda k: k - 1 if k >= 0 else -1, dims["blocks"])
        stage = lax.axis_index(STAGE)
        is_first, is_last = stage == 0, stage == S - 1
        n_layers = jnp.asarray(self.layout.layers_per_stage, jnp.int32)[stage]
        first_layer = jnp.asarray(np.cumsum((0,) + self.layout.layers_per_stage[:-1]), jnp.int32)[
            stage
        ]

        p = jax.tree.map(lambda a: a[0], params)  # drop the local stage axis (size 1)
        embed_p, blocks_p, head_p = p["embed"], p["blocks"], p["head"]
        local = batch.reshape(M, batch.shape[0] // M, batch.shape[1])  # [M, mb, T+1]
        tokens, targets = local[:, :, :-1], local[:, :, 1:]  # [M, mb, T]
        mb, T, H = tokens.shape[1], tokens.shape[2], self.cfg.hidden_size
        act = jax.ShapeDtypeStruct((mb, T, H), embed_p["wte"].dtype)  # compute dtype
        base_key = jax.random.fold_in(jax.random.key(self.seed + 1), step)

        def key_for(i, layer):
            return jax.random.fold_in(jax.random.fold_in(base_key, i), layer)

        # One trace of a layer's vjp fixes the residual layout (XLA drops this dead code).
        w0 = _dyn_index(blocks_p, 0)
        _, vjp0 = jax.vjp(
            lambda w, x: self._layer(w, x, key_for(0, 0)), w0, jnp.zeros(act.shape, act.dtype)
        )
        res = _Residuals(vjp0, w0)
        K, L = sched.buffer_slots, self.layout.slots
        fill = jnp.nan if self.nan_bubbles else 0.0
        # Loop state. Big buffers are only ever updated in place: every "if" below is a
        # 0-or-1-trip while loop (_when), which XLA aliases, where lax.cond/switch would
        # copy each buffer that one branch writes and another passes through, every tick.
        carry0 = dict(
            # forward activations waiting for FWD
            inbox=_to_bits(jnp.full((2, *act.shape), fill, act.dtype)),
            recv_x=jnp.full(act.shape, fill, act.dtype),
            recv_g=jnp.full(act.shape, fill, act.dtype),
            head_ct=_to_bits(jnp.zeros((K, *act.shape), act.dtype)),  # last stage: dloss/dx
            res=[_to_bits(jnp.zeros((K, L, *r.shape), r.dtype)) for r in res.buffered],
            grads=jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), p),  # fp32 sums
            # Reduced (1/d with ZeRO-1) block gradients, filled bucket by bucket.
            shards=jax.tree.map(
                lambda a, k: jnp.zeros(shard_shape(a.shape, k, d), jnp.float32),
                blocks_p,
                dims["blocks"],
            ),
            loss=jnp.zeros((), jnp.float32),
        )
        tables = {k: jnp.asarray(getattr(sched, k)) for k in ("op", "mb", "slot")}

        def forward(c, i, k):
            """FWD of microbatch i: layers (residuals to slot k), then the head if last."""

            def layer(j, state):
                x, bufs = state
                w = _dyn_index(blocks_p, j)
                y, vjp_fn = jax.vjp(
                    lambda w, x: self._layer(w, x, key_for(i, first_layer + j)), w, x
                )
                saved = res.split(vjp_fn, w)
                return y, [_put(b, r, k, j) for b, r in zip(bufs, saved, strict=True)]

            x = lax.cond(
                is_first,
                lambda: self._embed(embed_p, tokens[i]),
                lambda: _from_bits(c["inbox"][i % 2], act.dtype),
            )
            x, bufs = lax.fori_loop(0, n_layers, layer, (x, c["res"]))

            def head(h, x):
                loss, (g_embed, g_head, dx) = jax.value_and_grad(
                    self._head_loss, argnums=(0, 1, 2)
                )(embed_p, head_p, x, targets[i])
                loss_acc, ge, gh, head_ct = h
                ge = jax.tree.map(lambda a, g: a + g / M, ge, g_embed)
                gh = jax.tree.map(lambda a, g: a + g / M, gh, g_head)
                head_ct = lax.dynamic_update_index_in_dim(head_ct, _to_bits(dx / M), k, 0)
                return loss_acc + loss / M, ge, gh, head_ct

            g = c["grads"]
            h = (c["loss"], g["embed"], g["head"], c["head_ct"])
            loss, g_embed, g_head, head_ct = _when(is_last, head, h, x)
            grads = dict(g, embed=g_embed, head=g_head)
            return dict(c, res=bufs, grads=grads, loss=loss, head_ct=head_ct, send_x=x)

        def backward(c, i, k):
            """BWD of microbatch i from slot k's residuals; embedding backward on stage 0."""

            def layer(n, state):
                ct, g_blocks, shards = state
                j = n_layers - 1 - n
                w = _dyn_index(blocks_p, j)
                saved = [
                    _from_bits(_get(b, k, j), r.dtype)
                    for b, r in zip(c["res"], res.buffered, strict=True)
                ]
                dw, dx = res.join(saved, w)(ct)
                g_j = jax.tree.map(jnp.add, _dyn_index(g_blocks, j), dw)
                # Phase 1: the last microbatch completes layer j's gradient: reduce it now.
                shards = _when(
                    i == M - 1,
                    lambda sh, g: _dyn_set(sh, j, reduce_bucket(g, slot_dims, d, r)),
                    shards,
                    g_j,
                )
                return dx, _dyn_set(g_blocks, j, g_j), shards

            ct = lax.select(is_last, _from_bits(c["head_ct"][k], act.dtype), c["recv_g"])
            ct, g_blocks, shards = lax.fori_loop(
                0, n_layers, layer, (ct, c["grads"]["blocks"], c["shards"])
            )

            def embed_backward(g_embed, ct):
                _, vjp_fn = jax.vjp(lambda e: self._embed(e, tokens[i]), embed_p)
                return jax.tree.map(jnp.add, g_embed, vjp_fn(ct)[0])

            g_embed = _when(is_first, embed_backward, c["grads"]["embed"], ct)
            grads = dict(c["grads"], blocks=g_blocks, embed=g_embed)
            return dict(c, grads=grads, shards=shards, send_g=ct)

        def tick(c, t):
            op, i, k = tables["op"][t, stage], tables["mb"][t, stage], tables["slot"][t, stage]
            # An activation sent by stage s-1 at tick t-1 lands in the inbox slot of its
            # microbatch (the tables guarantee it is not overwritten before use).
            prev_t, prev_s = jnp.maximum(t - 1, 0), jnp.maximum(stage - 1, 0)
            arrived = (stage > 0) & (t > 0) & (tables["op"][prev_t, prev_s] == FWD)
            arr_i = tables["mb"][prev_t, prev_s]
            inbox = _when(
                arrived,
                lambda box: lax.dynamic_update_index_in_dim(
                    box, _to_bits(c["recv_x"]), arr_i % 2, 0
                ),
                c["inbox"],
            )
            c = dict(
                c,
                inbox=inbox,
                send_x=jnp.full(act.shape, fill, act.dtype),
                send_g=jnp.full(act.shape, fill, act.dtype),
            )
            c = _when(op == FWD, lambda c: forward(c, i, k), c)  # IDLE ticks run neither
            c = _when(op == BWD, lambda c: backward(c, i, k), c)
            c["recv_x"] = _shift(c.pop("send_x"), S, +1)
            c["recv_g"] = _shift(c.pop("send_g"), S, -1)
            return c, None

        c, _ = lax.scan(tick, carry0, jnp.arange(sched.ticks))

        # 3. gradients reduced over data (inside an island) and replicas (zero.py phases 1-3):
        #    the blocks bucket by bucket during the last backward, embedding and head now.
        g = c["grads"]
        grads = {
            "embed": reduce_bucket(g["embed"], dims["embed"], d, r),
            "blocks": c["shards"],
            "head": reduce_bucket(g["head"], dims["head"], d, r),
        }
        loss = lax.pmean(c["loss"], DATA)
        if r > 1:
            loss = lax.pmean(loss, REPLICA)
        # 4. cross-stage sums by neighbour-to-neighbour hops only, on the 1/d shards.
        if self.cfg.tied_embeddings:  # wte: embedding grad (stage 0) + head grad (stage S-1)
            wte = chain_sum(grads["embed"]["wte"], S)
            grads = dict(grads, embed=dict(grads["embed"], wte=wte))
        owned = squared_norm(grads["blocks"], dims["blocks"])
        owned += jnp.where(is_first, squared_norm(grads["embed"], dims["embed"]), 0.0)
        owned += jnp.where(is_last, squared_norm(grads["head"], dims["head"]), 0.0)
        loss, norm = chain_sum((jnp.where(is_last, loss, 0.0), owned), S)
        norm = jnp.sqrt(norm)
        return loss, jax.tree.map(lambda g: g[None], grads), norm


def _when(pred, body, carry, operands=None):
    """``body(carry)`` if ``pred`` else ``carry``, as a 0-or-1-trip while loop (in place).

    With ``operands``, ``body(carry, operands)``: every value the body computes from
    that is not in ``carry`` must come in ``operands``. XLA's loop-invariant code motion
    hoists work whose inputs are all loop-invariant out of a while loop, where it then
    runs whatever ``pred`` says (a gradient reduction on every micro-batch, the LM head on
    every stage). The loop zeroes ``operands`` after its one trip, so they are
    loop-variant and the work stays inside.
    """
    n = pred.astype(jnp.int32)
    if operands is None:
        return lax.fori_loop(0, n, lambda _, c: body(c), carry)

    def once(_, state):
        c, ops = state
        return body(c, ops), jax.tree.map(jnp.zeros_like, ops)

    return lax.fori_loop(0, n, once, (carry, operands))[0]


def _to_bits(x):
    """16-bit floats as their uint16 bit patterns (other dtypes unchanged).

    The engine's big buffers (residuals, inbox, head cotangents) are stored this way:
    XLA:CPU rewrites a bf16 dynamic-update-slice into f32 and keeps an f32 copy of the whole
    buffer, which would double its bytes in the compiled memory analysis that the memory
    model is checked against. On GPU the bitcast is free.
    """
    if jnp.dtype(x.dtype).itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating):
        return lax.bitcast_convert_type(x, jnp.uint16)
    return x


def _from_bits(x, dtype):
    """Inverse of :func:`_to_bits` for a value of ``dtype``."""
    return lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def _put(buf, value, k, j):
    """buf[k, j] = value, as one in-place dynamic_update_slice. buf [K, slots, ...]."""
    zeros = (0,) * value.ndim
    return lax.dynamic_update_slice(buf, _to_bits(value)[None, None], (k, j, *zeros))


def _get(buf, k, j):
    """buf[k, j] as one dynamic_slice (no copy of buf[k])."""
    zeros = (0,) * (buf.ndim - 2)
    return lax.dynamic_slice(buf, (k, j, *zeros), (1, 1, *buf.shape[2:]))[0, 0]


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
