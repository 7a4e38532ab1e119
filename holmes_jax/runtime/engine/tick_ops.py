"""The ops one pipeline stage runs at a tick: FWD, BWD and zb's WGT.

:class:`TickOps` holds them, with the three model parts they call (embedding, one layer,
head and loss) as pure functions of their parameters.
:class:`~holmes_jax.runtime.engine.pipeline.PipelineEngine` builds one and runs its ops from
the tick loop, one op per stage and tick, each under a ``when`` guard. :class:`StageLocal`
is what one stage holds inside the ``shard_map`` (traced once per step, read by every op).

- FWD: embed (first virtual stage) or take the activation from the inbox. Run the chunk's
  layers with a ``fori_loop`` whose trip count is the chunk's layer count (padded slots
  never run). Each layer's ``jax.vjp`` residuals go to the residual slot, exactly what the
  ``model.remat`` policy saves. The last virtual stage also runs the head: the loss and its
  gradient right away.
- BWD: walk the chunk's layers backwards from the stored residuals, accumulating fp32
  parameter gradients. With per-layer buckets the op that completes a layer's gradient
  (the table's ``last``) reduces it over ``data`` (:mod:`holmes_jax.runtime.engine.zero` phase 1).
  The first virtual stage then runs the embedding backward.
- Under ``zb`` BWD is the input gradient only, and WGT, later, the weight gradient
  (:mod:`holmes_jax.runtime.engine.wgrad`). What WGT needs from BWD waits in the micro-batch's
  residual slot, over the residuals only BWD read, and what does not fit in the stash.

Every op returns the loop carry with its buffers updated in place
(:mod:`holmes_jax.runtime.engine.buffers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from holmes_jax.core.config import ModelConfig
from holmes_jax.runtime.engine.buffers import (
    Residuals,
    StashLayout,
    dyn_index,
    dyn_set,
    from_bits,
    get,
    put,
    to_bits,
    when,
)
from holmes_jax.runtime.engine.stages import PipelineLayout
from holmes_jax.runtime.engine.wgrad import SplitBackward
from holmes_jax.runtime.engine.zero import reduce_bucket
from holmes_jax.runtime.model.decoder import GPT


@dataclass(frozen=True, eq=False)
class StageLocal:
    """What one stage holds inside the ``shard_map`` for one step (traced values).

    Built once per trace by ``PipelineEngine._local``; every method of the tick loop
    reads it and none changes it.
    """

    stage: jax.Array  # int32 scalar: this device's stage s
    is_first: jax.Array  # bool scalar: s == 0
    is_last: jax.Array  # bool scalar: s == S-1
    n_layers: jax.Array  # [v] int32: layer count of each chunk (its fori_loop trip count)
    first_layer: jax.Array  # [v] int32: global index of each chunk's first layer
    params: Any  # this stage's parameters, local stage axis dropped; blocks [v*slots, ...]
    tokens: jax.Array  # [M, mb, T] int32
    targets: jax.Array  # [M, mb, T] int32
    act: jax.ShapeDtypeStruct  # [mb, T, H] in the compute dtype
    base_key: jax.Array  # dropout key of this step
    dims: Any  # local ZeRO dims per leaf (stage axis gone), -1 = not scattered
    slot_dims: Any  # ZeRO dims of one block slot (the per-layer bucket)
    res: Residuals  # which leaves of a layer's vjp the residual buffers hold
    split: SplitBackward | None  # zb: the layer's backward as B and W
    stash: StashLayout | None  # zb: where B keeps W's inputs (B-only residuals, leftovers)
    fill: float  # bubble value of the send / receive buffers (NaN with nan_bubbles)
    tables: dict  # schedule tables (Schedule fields "op", "mb", ...): [ticks, S] int32

    def at(self, name: str, t):
        """This stage's entry of table ``name`` at tick ``t``."""
        return self.tables[name][t, self.stage]

    def first_vs(self, chunk):
        """Whether (this stage, ``chunk``) is virtual stage 0 (embeds)."""
        return self.is_first & (chunk == 0)

    def last_vs(self, chunk, v: int):
        """Whether (this stage, ``chunk``) is the last virtual stage (the head)."""
        return self.is_last & (chunk == v - 1)

    @property
    def embed(self):
        return self.params["embed"]

    @property
    def blocks(self):
        return self.params["blocks"]  # [v*slots, ...] per leaf

    @property
    def head(self):
        return self.params["head"]

    def key(self, i, layer):
        """Dropout key of microbatch ``i`` in global layer ``layer`` (the embedding's
        dropout is "layer" L, one past the last block)."""
        return layer_key(self.base_key, i, layer)


def layer_key(base_key, i, layer):
    """Dropout key of microbatch ``i`` in global layer ``layer``: from (seed, step, i, layer)."""
    return jax.random.fold_in(jax.random.fold_in(base_key, i), layer)


@dataclass(frozen=True, eq=False)
class TickOps:
    """FWD (:meth:`forward`), BWD (:meth:`backward`) and WGT (:meth:`weights`) of one stage,
    each on the tick loop's carry ``c`` (a dict of buffers), returning it updated."""

    cfg: ModelConfig
    layout: PipelineLayout
    M: int  # micro-batches per step
    data: int  # data-parallel ranks a gradient is reduced over
    replica: int  # replicas a gradient is reduced over (1 under DiLoCo)
    per_layer: bool  # per-layer gradient buckets: the op that completes a layer reduces it
    flat: bool  # a bucket's leaves reduced as one buffer (zero.reduce_bucket)
    gpt: GPT  # the whole model: embedding and head
    block: nn.Module  # one layer under the remat policy

    @property
    def v(self) -> int:
        """Model chunks per device."""
        return self.layout.virtual

    # The three model parts as pure functions of their parameters.

    def _embed(self, embed_params, tokens, key):
        rngs = {"dropout": key} if self.cfg.dropout > 0 else None
        variables = {"params": {"embed": embed_params}}
        return self.gpt.apply(variables, tokens, method=GPT.embed_tokens, rngs=rngs)

    def layer(self, weights, x, key):
        rngs = {"dropout": key} if self.cfg.dropout > 0 else None
        y, _ = self.block.apply({"params": weights}, x, rngs=rngs)
        return y

    def _head_loss(self, embed_params, head_params, x, targets):
        variables = {"params": {"embed": embed_params, "head": head_params}}
        return self.gpt.apply(variables, x, targets, method=GPT.head_loss)

    # --------------------------------------------------------------- forward

    def forward(self, st: StageLocal, c: dict, t) -> dict:
        """FWD of (micro-batch, chunk) at tick t: layers (residuals to their slot), then the
        head on the last virtual stage."""
        i, ch, k = st.at("mb", t), st.at("chunk", t), st.at("slot", t)
        x = lax.cond(
            st.first_vs(ch),
            lambda: self._embed(st.embed, st.tokens[i], st.key(i, self.cfg.num_layers)),
            lambda: from_bits(c["xbox"][st.at("xin", t)], st.act.dtype),
        )  # [mb, T, H]
        x, bufs = lax.fori_loop(
            0, st.n_layers[ch], lambda j, s: self._forward_layer(st, i, ch, k, j, s), (x, c["res"])
        )
        g = c["grads"]
        h = (c["loss"], g["embed"], g["head"], c["head_ct"])
        loss, g_embed, g_head, head_ct = when(
            st.last_vs(ch, self.v), lambda h, x: self._head(st, i, k, h, x), h, x
        )
        grads = dict(g, embed=g_embed, head=g_head)
        return dict(c, res=bufs, grads=grads, loss=loss, head_ct=head_ct, send_x=x)

    def _forward_layer(self, st: StageLocal, i, ch, k, j, state):
        """Chunk ch's layer j on x ``[mb, T, H]``; its residuals go to ``res[.][k, j]``."""
        x, bufs = state
        w = dyn_index(st.blocks, ch * self.layout.slots + j)
        layer = st.first_layer[ch] + j
        y, vjp_fn = jax.vjp(lambda w, x: self.layer(w, x, st.key(i, layer)), w, x)
        saved = st.res.split(vjp_fn, w)
        return y, [put(b, r, k, j) for b, r in zip(bufs, saved, strict=True)]

    def _head(self, st: StageLocal, i, k, h, x):
        """Last virtual stage: loss of microbatch i and its gradients, each divided by M.

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

    def backward(self, st: StageLocal, c: dict, t) -> dict:
        """BWD of (micro-batch, chunk) at tick t from its residuals; embedding backward on
        the first virtual stage. Under zb only the input gradient (the rest to the stash)."""
        i, ch, k = st.at("mb", t), st.at("chunk", t), st.at("slot", t)
        # dloss/dx of this micro-batch [mb, T, H]: the head's or from the next virtual stage
        ct = lax.select(
            st.last_vs(ch, self.v),
            from_bits(c["head_ct"][k], st.act.dtype),
            from_bits(c["gbox"][st.at("gin", t)], st.act.dtype),
        )
        if st.split is None:
            ct, g_blocks, shards = lax.fori_loop(
                0,
                st.n_layers[ch],
                lambda n, s: self._backward_layer(st, c["res"], t, n, s),
                (ct, c["grads"]["blocks"], c["shards"]),
            )
            c = dict(c, grads=dict(c["grads"], blocks=g_blocks), shards=shards)
        else:
            ct, res, stash = lax.fori_loop(
                0,
                st.n_layers[ch],
                lambda n, s: self._input_grad_layer(st, t, n, s),
                (ct, c["res"], c["stash"]),
            )
            c = dict(c, res=res, stash=stash)
        g_embed = when(
            st.first_vs(ch),
            lambda g, ct: self._embed_backward(st, i, g, ct),
            c["grads"]["embed"],
            ct,
        )
        return dict(c, grads=dict(c["grads"], embed=g_embed), send_g=ct)

    def _saved(self, st: StageLocal, res, k, j):
        """The residuals of slot j's layer in residual slot k."""
        return [from_bits(get(b, k, j), r.dtype) for b, r in zip(res, st.res.buffered, strict=True)]

    def _backward_layer(self, st: StageLocal, res, t, n, state):
        """The n-th layer from the top of the chunk (j = layers-1-n), from ``res[.][k, j]``.

        ``state`` = (ct ``[mb, T, H]``, fp32 block grads ``[v*slots, ...]``, reduced shards).
        """
        ct, g_blocks, shards = state
        ch, k = st.at("chunk", t), st.at("slot", t)
        j = st.n_layers[ch] - 1 - n
        w = dyn_index(st.blocks, ch * self.layout.slots + j)
        dw, dx = st.res.join(self._saved(st, res, k, j), w)(ct)
        slot = ch * self.layout.slots + j
        g_blocks, shards = self._add_layer_grad(st, t, slot, dw, g_blocks, shards)
        return dx, g_blocks, shards

    def _add_layer_grad(self, st: StageLocal, t, slot, dw, g_blocks, shards):
        """Add a layer's gradient; the op that completes it reduces it (ZeRO-1 phase 1)
        with per-layer buckets (``shards`` is None with one bucket per step)."""
        g_j = jax.tree.map(jnp.add, dyn_index(g_blocks, slot), dw)
        if not self.per_layer:
            return dyn_set(g_blocks, slot, g_j), shards
        shards = when(
            st.at("last", t) == 1,
            lambda sh, g: dyn_set(
                sh, slot, reduce_bucket(g, st.slot_dims, self.data, self.replica, self.flat)
            ),
            shards,
            g_j,
        )
        return dyn_set(g_blocks, slot, g_j), shards

    def _input_grad_layer(self, st: StageLocal, t, n, state):
        """zb B: the n-th layer from the top, input gradient only. W's inputs go over this
        layer's B-only residuals (now dead) in ``res[.][k, j]``, the rest to the stash."""
        ct, res, stash = state
        ch, k, kw = st.at("chunk", t), st.at("slot", t), st.at("wslot", t)
        j = st.n_layers[ch] - 1 - n
        w = dyn_index(st.blocks, ch * self.layout.slots + j)
        dx, kept = st.split.input_grad(w, self._saved(st, res, k, j), ct)
        res, stash = st.stash.store(res, stash, kept, k, kw, j)
        return dx, res, stash

    def weights(self, st: StageLocal, c: dict, t) -> dict:
        """zb W of (micro-batch, chunk) at tick t: every layer's weight gradient from its
        residuals and stash."""
        ch, k, kw = st.at("chunk", t), st.at("slot", t), st.at("wslot", t)

        def layer(j, state):
            g_blocks, shards, res = state
            slot = ch * self.layout.slots + j
            w = dyn_index(st.blocks, slot)
            kept = st.stash.load(res, c["stash"], k, kw, j)
            # W reads only its own residual leaves (the B-only ones now hold the stash)
            dw = st.split.weight_grad(w, self._saved(st, res, k, j), kept)
            return *self._add_layer_grad(st, t, slot, dw, g_blocks, shards), res

        # res is carried through the loop unchanged, not read from outside it. As a live-in
        # of the loop XLA cannot order it before the next tick's writes, and copies it.
        g_blocks, shards, res = lax.fori_loop(
            0, st.n_layers[ch], layer, (c["grads"]["blocks"], c["shards"], c["res"])
        )
        return dict(c, grads=dict(c["grads"], blocks=g_blocks), shards=shards, res=res)

    def _embed_backward(self, st: StageLocal, i, g_embed, ct):
        """Stage 0: embedding gradient of microbatch i added to ``g_embed``; ct [mb, T, H]."""
        # The same dropout key as the forward: the same mask.
        key = st.key(i, self.cfg.num_layers)
        _, vjp_fn = jax.vjp(lambda e: self._embed(e, st.tokens[i], key), st.embed)
        return jax.tree.map(jnp.add, g_embed, vjp_fn(ct)[0])
