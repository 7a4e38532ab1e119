"""Pipeline parallelism over the ``stage`` axis: uneven stages, GPipe and 1F1B, one program.

Parameters arrive in the pipeline layout of :mod:`holmes_jax.runtime.stages` (a leading
stage axis; ``blocks [S, slots, ...]``, stage s using slots 0 .. layers[s]-1). The loop's
buffers and their in-place rules (``when``, uint16 bit patterns, ``Residuals``) are in
:mod:`holmes_jax.runtime.buffers`.

The step (``PipelineEngine.loss_and_grads``) is one ``shard_map``, manual over ``replica``,
``stage`` and ``data`` (``tensor`` stays automatic: GSPMD does tensor parallelism in a stage):

1. Split the local batch ``[B/d, T+1]`` into M microbatches ``[M, B/(dM), T+1]``.
2. Tick loop (``lax.scan`` over the tables of :mod:`holmes_jax.runtime.schedule`); per tick each
   stage runs the op its table names, each guarded by ``when`` (a 0-or-1-trip while loop,
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
   ``stages.chain_sum``: adjacent-stage ``ppermute`` only, so nothing but point-to-point
   traffic between neighbouring stages ever crosses an island boundary.

In code: ``_body`` is the ``shard_map`` body; ``_local`` traces what one stage holds,
``_carry0`` the loop state, ``_tick`` one tick (``_receive``, ``_forward``, ``_backward``),
``_reduce`` steps 3–4.

16-bit buffers (residuals, inbox, head cotangents) are stored as uint16 bit patterns
(``buffers.to_bits``): free on GPU, and it keeps XLA:CPU from holding f32 copies of them, so
the compiled memory analysis the memory model is checked against matches a GPU's.

Gradient clipping needs the global norm, which only exists after step 4: the engine
returns it beside the (unclipped) gradients and the program clips with it
(``optim.clip_by_global_norm``) instead of letting optax recompute a wrong norm from the
pipeline layout, where padded slots and a tied embedding's copies would distort it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from holmes_jax.core.axes import BATCH_AXES, DATA, REPLICA, STAGE
from holmes_jax.core.config import ModelConfig
from holmes_jax.runtime.buffers import (
    Residuals,
    dyn_index,
    dyn_set,
    from_bits,
    get,
    put,
    to_bits,
    when,
)
from holmes_jax.runtime.model import GPT, LOGICAL_RULES, remat_block
from holmes_jax.runtime.schedule import BWD, FWD, Schedule, make_schedule
from holmes_jax.runtime.stages import PipelineLayout, chain_sum, shift
from holmes_jax.runtime.zero import reduce_bucket, shard_shape, sharded_spec, squared_norm

# Inside the pipeline ``data`` is a manual axis: the batch is already split, so the
# activation constraints map ``batch`` to nothing; tensor rules stay.
PIPELINE_RULES = tuple((name, None if name == "batch" else axis) for name, axis in LOGICAL_RULES)


@dataclass(frozen=True, eq=False)
class _Local:
    """What one stage holds inside the ``shard_map`` for one step (traced values).

    Built once per trace by ``PipelineEngine._local``; every method of the tick loop
    reads it and none changes it.
    """

    stage: jax.Array  # int32 scalar: this device's stage s
    is_first: jax.Array  # bool scalar: s == 0
    is_last: jax.Array  # bool scalar: s == S-1
    n_layers: jax.Array  # int32 scalar: this stage's layer count (its fori_loop trip count)
    first_layer: jax.Array  # int32 scalar: global index of this stage's slot 0
    params: Any  # this stage's parameters, local stage axis dropped; blocks [slots, ...]
    tokens: jax.Array  # [M, mb, T] int32
    targets: jax.Array  # [M, mb, T] int32
    act: jax.ShapeDtypeStruct  # [mb, T, H] in the compute dtype
    base_key: jax.Array  # dropout key of this step
    dims: Any  # local ZeRO dims per leaf (stage axis gone), -1 = not scattered
    slot_dims: Any  # ZeRO dims of one block slot (the per-layer bucket)
    res: Residuals  # which leaves of a layer's vjp the residual buffers hold
    fill: float  # bubble value of the send / receive buffers (NaN with nan_bubbles)
    tables: dict  # schedule tables "op", "mb", "slot": [ticks, S] int32

    @property
    def embed(self):
        return self.params["embed"]

    @property
    def blocks(self):
        return self.params["blocks"]  # [slots, ...] per leaf

    @property
    def head(self):
        return self.params["head"]

    def key(self, i, layer):
        """Dropout key of microbatch ``i`` in global layer ``layer`` (the embedding's
        dropout is "layer" L, one past the last block)."""
        return _layer_key(self.base_key, i, layer)


def _layer_key(base_key, i, layer):
    """Dropout key of microbatch ``i`` in global layer ``layer``: from (seed, step, i, layer)."""
    return jax.random.fold_in(jax.random.fold_in(base_key, i), layer)


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

    def _embed(self, embed_params, tokens, key):
        rngs = {"dropout": key} if self.cfg.dropout > 0 else None
        variables = {"params": {"embed": embed_params}}
        return self.gpt.apply(variables, tokens, method=GPT.embed_tokens, rngs=rngs)

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

    # --------------------------------------------------------------- the shard_map body

    def _body(self, params, batch, step):
        """One device's step: ``(loss, grads, grad_norm)``, grads with a stage axis of 1."""
        st = self._local(params, batch, step)
        carry0 = self._carry0(st)
        c, _ = lax.scan(lambda c, t: self._tick(st, c, t), carry0, jnp.arange(self.schedule.ticks))
        return self._reduce(st, c)

    def _local(self, params, batch, step) -> _Local:
        """This stage's parameters, microbatches and constants (step 1)."""
        S, M = self.layout.stages, self.M
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
        local = batch.reshape(M, batch.shape[0] // M, batch.shape[1])  # [M, mb, T+1]
        tokens, targets = local[:, :, :-1], local[:, :, 1:]  # [M, mb, T]
        mb, T, H = tokens.shape[1], tokens.shape[2], self.cfg.hidden_size
        act = jax.ShapeDtypeStruct((mb, T, H), p["embed"]["wte"].dtype)  # compute dtype
        base_key = jax.random.fold_in(jax.random.key(self.seed + 1), step)

        # One trace of a layer's vjp fixes the residual layout (XLA drops this dead code).
        w0 = dyn_index(p["blocks"], 0)
        _, vjp0 = jax.vjp(
            lambda w, x: self._layer(w, x, _layer_key(base_key, 0, 0)),
            w0,
            jnp.zeros(act.shape, act.dtype),
        )
        return _Local(
            stage=stage,
            is_first=is_first,
            is_last=is_last,
            n_layers=n_layers,
            first_layer=first_layer,
            params=p,
            tokens=tokens,
            targets=targets,
            act=act,
            base_key=base_key,
            dims=dims,
            slot_dims=slot_dims,
            res=Residuals(vjp0, w0),
            fill=jnp.nan if self.nan_bubbles else 0.0,
            tables={k: jnp.asarray(getattr(self.schedule, k)) for k in ("op", "mb", "slot")},
        )

    def _carry0(self, st: _Local) -> dict:
        """The tick loop's state before tick 0."""
        K, L = self.schedule.buffer_slots, self.layout.slots
        act, fill = st.act, st.fill
        # Loop state. Big buffers are only ever updated in place: every "if" of the tick
        # loop is a 0-or-1-trip while loop (when), which XLA aliases, where lax.cond/switch
        # would copy each buffer that one branch writes and another passes through, every tick.
        return dict(
            # forward activations waiting for FWD
            inbox=to_bits(jnp.full((2, *act.shape), fill, act.dtype)),  # [2, mb, T, H]
            recv_x=jnp.full(act.shape, fill, act.dtype),  # [mb, T, H] from stage s-1
            recv_g=jnp.full(act.shape, fill, act.dtype),  # [mb, T, H] from stage s+1
            head_ct=to_bits(jnp.zeros((K, *act.shape), act.dtype)),  # last stage: dloss/dx
            # [K, slots, ...] per buffered residual
            res=[to_bits(jnp.zeros((K, L, *r.shape), r.dtype)) for r in st.res.buffered],
            grads=jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), st.params),  # fp32 sums
            # Reduced (1/d with ZeRO-1) block gradients, filled bucket by bucket.
            shards=jax.tree.map(
                lambda a, k: jnp.zeros(shard_shape(a.shape, k, self.data), jnp.float32),
                st.blocks,
                st.dims["blocks"],
            ),
            loss=jnp.zeros((), jnp.float32),
        )

    # --------------------------------------------------------------- one tick

    def _tick(self, st: _Local, c: dict, t):
        """Tick ``t``: receive, run this stage's op (FWD / BWD / IDLE), send both ways."""
        op, i, k = (st.tables[n][t, st.stage] for n in ("op", "mb", "slot"))
        inbox = self._receive(st, c, t)
        act = st.act
        c = dict(
            c,
            inbox=inbox,
            send_x=jnp.full(act.shape, st.fill, act.dtype),
            send_g=jnp.full(act.shape, st.fill, act.dtype),
        )
        c = when(op == FWD, lambda c: self._forward(st, c, i, k), c)  # IDLE ticks run neither
        c = when(op == BWD, lambda c: self._backward(st, c, i, k), c)
        c["recv_x"] = shift(c.pop("send_x"), self.layout.stages, +1)
        c["recv_g"] = shift(c.pop("send_g"), self.layout.stages, -1)
        return c, None

    def _receive(self, st: _Local, c: dict, t):
        """The inbox ``[2, mb, T, H]`` after this tick's arrival, if any."""
        # An activation sent by stage s-1 at tick t-1 lands in the inbox slot of its
        # microbatch (the tables guarantee it is not overwritten before use).
        prev_t, prev_s = jnp.maximum(t - 1, 0), jnp.maximum(st.stage - 1, 0)
        arrived = (st.stage > 0) & (t > 0) & (st.tables["op"][prev_t, prev_s] == FWD)
        arr_i = st.tables["mb"][prev_t, prev_s]
        return when(
            arrived,
            lambda box: lax.dynamic_update_index_in_dim(box, to_bits(c["recv_x"]), arr_i % 2, 0),
            c["inbox"],
        )

    # --------------------------------------------------------------- forward

    def _forward(self, st: _Local, c: dict, i, k) -> dict:
        """FWD of microbatch i: layers (residuals to slot k), then the head if last."""
        x = lax.cond(
            st.is_first,
            lambda: self._embed(st.embed, st.tokens[i], st.key(i, self.cfg.num_layers)),
            lambda: from_bits(c["inbox"][i % 2], st.act.dtype),
        )  # [mb, T, H]
        x, bufs = lax.fori_loop(
            0, st.n_layers, lambda j, s: self._forward_layer(st, i, k, j, s), (x, c["res"])
        )
        g = c["grads"]
        h = (c["loss"], g["embed"], g["head"], c["head_ct"])
        loss, g_embed, g_head, head_ct = when(
            st.is_last, lambda h, x: self._head(st, i, k, h, x), h, x
        )
        grads = dict(g, embed=g_embed, head=g_head)
        return dict(c, res=bufs, grads=grads, loss=loss, head_ct=head_ct, send_x=x)

    def _forward_layer(self, st: _Local, i, k, j, state):
        """Slot j's layer on x ``[mb, T, H]``; its residuals go to ``res[.][k, j]``."""
        x, bufs = state
        w = dyn_index(st.blocks, j)
        y, vjp_fn = jax.vjp(lambda w, x: self._layer(w, x, st.key(i, st.first_layer + j)), w, x)
        saved = st.res.split(vjp_fn, w)
        return y, [put(b, r, k, j) for b, r in zip(bufs, saved, strict=True)]

    def _head(self, st: _Local, i, k, h, x):
        """Last stage: loss of microbatch i and its gradients, each already divided by M.

        ``h`` = (loss, embed grads, head grads, head_ct ``[K, mb, T, H]``); dloss/dx goes to
        ``head_ct[k]``. Runs under ``when(is_last, ..., h, x)``: x comes in as the guard's
        operand, so XLA cannot hoist the head out of it onto every stage.
        """
        M = self.M
        loss, (g_embed, g_head, dx) = jax.value_and_grad(self._head_loss, argnums=(0, 1, 2))(
            st.embed, st.head, x, st.targets[i]
        )
        loss_acc, ge, gh, head_ct = h
        ge = jax.tree.map(lambda a, g: a + g / M, ge, g_embed)
        gh = jax.tree.map(lambda a, g: a + g / M, gh, g_head)
        head_ct = lax.dynamic_update_index_in_dim(head_ct, to_bits(dx / M), k, 0)
        return loss_acc + loss / M, ge, gh, head_ct

    # --------------------------------------------------------------- backward

    def _backward(self, st: _Local, c: dict, i, k) -> dict:
        """BWD of microbatch i from slot k's residuals; embedding backward on stage 0."""
        # dloss/dx of this microbatch [mb, T, H]: the head's (last stage) or from stage s+1
        ct = lax.select(st.is_last, from_bits(c["head_ct"][k], st.act.dtype), c["recv_g"])
        ct, g_blocks, shards = lax.fori_loop(
            0,
            st.n_layers,
            lambda n, s: self._backward_layer(st, c["res"], i, k, n, s),
            (ct, c["grads"]["blocks"], c["shards"]),
        )
        g_embed = when(
            st.is_first,
            lambda g, ct: self._embed_backward(st, i, g, ct),
            c["grads"]["embed"],
            ct,
        )
        grads = dict(c["grads"], blocks=g_blocks, embed=g_embed)
        return dict(c, grads=grads, shards=shards, send_g=ct)

    def _backward_layer(self, st: _Local, res, i, k, n, state):
        """The n-th layer from the top (slot j = n_layers-1-n), from ``res[.][k, j]``.

        ``state`` = (ct ``[mb, T, H]``, fp32 block grads ``[slots, ...]``, reduced shards).
        """
        ct, g_blocks, shards = state
        j = st.n_layers - 1 - n
        w = dyn_index(st.blocks, j)
        saved = [
            from_bits(get(b, k, j), r.dtype) for b, r in zip(res, st.res.buffered, strict=True)
        ]
        dw, dx = st.res.join(saved, w)(ct)
        g_j = jax.tree.map(jnp.add, dyn_index(g_blocks, j), dw)
        # Phase 1: the last microbatch completes layer j's gradient: reduce it now.
        shards = when(
            i == self.M - 1,
            lambda sh, g: dyn_set(sh, j, reduce_bucket(g, st.slot_dims, self.data, self.replica)),
            shards,
            g_j,
        )
        return dx, dyn_set(g_blocks, j, g_j), shards

    def _embed_backward(self, st: _Local, i, g_embed, ct):
        """Stage 0: embedding gradient of microbatch i added to ``g_embed``; ct [mb, T, H]."""
        # The same dropout key as the forward: the same mask.
        key = st.key(i, self.cfg.num_layers)
        _, vjp_fn = jax.vjp(lambda e: self._embed(e, st.tokens[i], key), st.embed)
        return jax.tree.map(jnp.add, g_embed, vjp_fn(ct)[0])

    # --------------------------------------------------------------- after the loop

    def _reduce(self, st: _Local, c: dict):
        """Steps 3–4: reduced gradients, mean loss over all stages and the global norm."""
        S, d, r, dims = self.layout.stages, self.data, self.replica, st.dims
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
        owned += jnp.where(st.is_first, squared_norm(grads["embed"], dims["embed"]), 0.0)
        owned += jnp.where(st.is_last, squared_norm(grads["head"], dims["head"]), 0.0)
        loss, norm = chain_sum((jnp.where(st.is_last, loss, 0.0), owned), S)
        norm = jnp.sqrt(norm)
        return loss, jax.tree.map(lambda g: g[None], grads), norm
