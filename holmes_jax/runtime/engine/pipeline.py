"""Pipeline parallelism over the ``stage`` axis: uneven stages, four schedules, one program.

Parameters arrive in the pipeline layout of :mod:`holmes_jax.runtime.engine.stages`: a leading
stage axis, ``blocks [S, v·slots, ...]``, chunk c of stage s in slots c·slots ..
c·slots + layers - 1. The schedules' tables (GPipe, 1F1B, interleaved 1F1B, ZB-H1) come from
:mod:`holmes_jax.planner.schedule`, the loop's in-place buffers from
:mod:`holmes_jax.runtime.engine.buffers`, the per-tick ops from
:mod:`holmes_jax.runtime.engine.tick_ops`.

The step (``PipelineEngine.loss_and_grads``) is one ``shard_map``, manual over ``replica``,
``stage`` and ``data``. A ``tensor`` axis > 1 stays automatic (the partitioner does tensor
parallelism in a stage); one of size 1 is manual too, so the body's ops carry no shardings.

1. ``_local``: the local batch ``[B/d, T+1]`` as M microbatches ``[M, B/(dM), T+1]``.
2. ``_tick``, per tick: each stage runs the op its table names (FWD, BWD, WGT or nothing).
   Then ``_send`` runs one ``ppermute`` for activations and one for gradients, each naming
   exactly the stage pairs that send at this tick (``Schedule.fwd_pairs`` / ``bwd_pairs``).
   Each micro-batch so crosses each (virtual) stage boundary once forward and once backward.
3. ``_reduce``: embedding and head gradients (with ``grad_buckets="step"`` every block leaf
   too) reduced over ``data`` and ``replica`` (:mod:`holmes_jax.runtime.engine.zero` phases 1–3).
4. Sums across stages (loss, squared gradient norm, tied-embedding gradient) go through
   ``stages.chain_sum``. Only neighbour-to-neighbour sends ever cross an island boundary.

A tick's send pairs are static, so :func:`tick_segments` makes each run of ticks whose shape
repeats one ``lax.scan`` over its period and unrolls the rest. The engine returns the global
gradient norm beside the unclipped gradients, and the program clips with it: optax would
count padded slots and a tied embedding's copies in the pipeline layout.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from holmes_jax.core.axes import BATCH_AXES, DATA, REPLICA, STAGE, TENSOR
from holmes_jax.core.config import ModelConfig
from holmes_jax.core.spec import GRAD_BUCKETS
from holmes_jax.planner.schedule import BWD, FWD, IDLE, WGT, Schedule, make_schedule
from holmes_jax.runtime.engine.buffers import (
    Residuals,
    StashLayout,
    dyn_index,
    to_bits,
    when,
)
from holmes_jax.runtime.engine.compress import check_format, decode, encode
from holmes_jax.runtime.engine.stages import PipelineLayout, chain_sum
from holmes_jax.runtime.engine.tick_ops import StageLocal, TickOps, layer_key
from holmes_jax.runtime.engine.wgrad import split_backward
from holmes_jax.runtime.engine.zero import reduce_bucket, shard_shape, sharded_spec, squared_norm
from holmes_jax.runtime.model.decoder import GPT, LOGICAL_RULES, remat_block

# Inside the pipeline ``data`` is a manual axis: the batch is already split, so the
# activation constraints map ``batch`` to nothing; tensor rules stay.
PIPELINE_RULES = tuple((name, None if name == "batch" else axis) for name, axis in LOGICAL_RULES)


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs a step, beyond the model, the layout and the mesh."""

    microbatches: int  # M per step
    schedule: str  # gpipe, 1f1b, interleaved or zb (holmes_jax.planner.schedule)
    seed: int  # dropout keys come from (seed, step, micro-batch, layer)
    # "layer": each layer's gradient reduced by the op that completes it; "step": all of
    # them after the tick loop, one collective per leaf (zero.py phase 1).
    grad_buckets: str = "layer"
    # One collective per bucket (its leaves in one buffer) instead of one per leaf: for
    # runtimes that pay a rendezvous per call (zero.reduce_bucket).
    flat_buckets: bool = False
    # DiLoCo: every replica has its own parameters ([R, S, ...]) and nothing is reduced
    # over replica; loss and grad norm come back per replica.
    independent_replicas: bool = False
    # The wire format of sends between the stage pairs (src, dst) on two islands
    # (holmes_jax.runtime.engine.compress); "same" leaves the program unchanged.
    cross_island_dtype: str = "same"
    crossing: frozenset = frozenset()
    nan_bubbles: bool = False  # tests: bubble buffers hold NaN, so a leak poisons the loss


class PipelineEngine:
    """Loss and gradients of the GPT over a (stage, data, tensor) mesh.

    Args:
      model_cfg: the model section.
      layout: which stage holds which layers (:mod:`holmes_jax.runtime.engine.stages`).
      mesh: the ``[replica, stage, data, tensor]`` mesh; its stage axis matches ``layout``.
      options: the schedule and the reduction, crossing and DiLoCo choices.
      grad_dims: per leaf, the (pipeline-layout) dim ZeRO-1 scatters over data, or -1.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        layout: PipelineLayout,
        mesh: Mesh,
        options: EngineOptions,
        grad_dims: Any = None,
    ):
        if layout.stages != mesh.shape[STAGE]:
            raise ValueError(
                f"layout has {layout.stages} stages, mesh stage axis {mesh.shape[STAGE]}"
            )
        if options.grad_buckets not in GRAD_BUCKETS:
            raise ValueError(
                f"grad_buckets={options.grad_buckets!r}: must be one of {GRAD_BUCKETS}"
            )
        self.cfg, self.layout, self.mesh, self.options = model_cfg, layout, mesh, options
        self.M, self.v = options.microbatches, layout.virtual
        self.schedule: Schedule = make_schedule(options.schedule, layout.stages, self.M, self.v)
        self.segments = tick_segments(self.schedule)
        self.data = mesh.shape[DATA]
        self.independent = options.independent_replicas and mesh.shape[REPLICA] > 1
        self.replica = 1 if self.independent else mesh.shape[REPLICA]  # reduced over
        self.grad_dims = grad_dims
        # The body is manual over every axis but tensor, which the partitioner splits inside
        # it. A tensor axis of size 1 is manual too: left to the partitioner it puts a
        # sharding on every op of the body (15,600 in a 2-stage interleaved step of 52,000
        # HLO lines), which costs a quarter of its compile and changes nothing it computes.
        self.manual = {REPLICA, STAGE, DATA} | ({TENSOR} if mesh.shape[TENSOR] == 1 else set())
        unsplit = tuple((name, None) for name, _ in PIPELINE_RULES)
        self.rules = unsplit if TENSOR in self.manual else PIPELINE_RULES
        self.per_layer = options.grad_buckets == "layer"
        self.wire = check_format(options.cross_island_dtype)
        self.crossing = frozenset() if self.wire == "same" else frozenset(options.crossing)
        # The layer under the config's remat policy: its jax.vjp residuals, which the engine
        # buffers per layer and micro-batch, are exactly what the policy saves.
        deterministic = model_cfg.dropout == 0.0
        self.ops = TickOps(
            cfg=model_cfg,
            layout=layout,
            M=self.M,
            data=self.data,
            replica=self.replica,
            per_layer=self.per_layer,
            flat=options.flat_buckets,
            gpt=GPT(model_cfg, deterministic=deterministic),
            block=remat_block(model_cfg)(model_cfg, deterministic=deterministic),
        )

    def loss_and_grads(self, params, batch, step):
        """Returns ``(loss, grads, grad_norm)``: mean loss, reduced (unclipped) gradients in
        the pipeline layout (1/d shards with ZeRO-1) and their global norm. With
        ``independent_replicas`` (DiLoCo) each replica's own: loss and norm ``[R]`` over
        ``replica``, grads ``[R, S, ...]``, and no collective over ``replica``.

        Args:
          params: pipeline-layout parameters (leading stage axis; ``[R, S, ...]`` with
            ``independent_replicas``).
          batch: ``[B, T+1]`` int32 tokens sharded over ``data``.
          step: int32 scalar (dropout keys derive from seed, step, microbatch, layer).
        """
        dims = self._dims(params)
        lead = (REPLICA, STAGE) if self.independent else (STAGE,)  # [R,] S leading axes
        param_specs = jax.tree.map(lambda _: PartitionSpec(*lead), params)
        grad_specs = jax.tree.map(
            lambda a, dim: sharded_spec(
                PartitionSpec(*lead), dim + len(lead) - 1 if dim >= 0 else -1, a.ndim
            ),
            params,
            dims,
        )
        scalar = PartitionSpec(REPLICA) if self.independent else PartitionSpec()  # [R] or []
        fn = jax.shard_map(
            self._body,
            mesh=self.mesh,
            in_specs=(param_specs, PartitionSpec(BATCH_AXES), PartitionSpec()),
            out_specs=(scalar, grad_specs, scalar),
            axis_names=self.manual,
            # Off: checked, the vjp of parameters replicated over data would all-reduce each
            # layer's gradient (zero.py reduces per bucket); chain_sum's sums type as varying.
            check_vma=False,
        )
        with nn.logical_axis_rules(self.rules):
            return fn(params, batch, step)

    def _dims(self, params):
        if self.grad_dims is None:
            return jax.tree.map(lambda _: -1, params)
        return self.grad_dims

    # --------------------------------------------------------------- the shard_map body

    def _body(self, params, batch, step):
        """One device's step: ``(loss, grads, grad_norm)``, grads with a stage axis of 1."""
        st = self._local(params, batch, step)
        c = self._carry0(st)
        for start, period, repeats in self.segments:
            shapes = [tick_shape(self.schedule, start + q) for q in range(period)]

            def ticks(c, r, start=start, period=period, shapes=shapes):
                for q in range(period):
                    c = self._tick(st, c, start + r * period + q, shapes[q])
                return c, None

            if repeats == 1:
                c, _ = ticks(c, 0)
            else:
                c, _ = lax.scan(ticks, c, jnp.arange(repeats, dtype=jnp.int32))
        return self._reduce(st, c)

    def _local(self, params, batch, step) -> StageLocal:
        """This stage's parameters, microbatches and constants (step 1)."""
        S, M = self.layout.stages, self.M
        # Local ZeRO dims: the stage axis is gone inside the shard_map, and a block slot
        # (one layer, the bucket) also drops the slot axis.
        dims = jax.tree.map(lambda k: k - 1 if k >= 0 else -1, self._dims(params))
        slot_dims = jax.tree.map(lambda k: k - 1 if k >= 0 else -1, dims["blocks"])
        stage = lax.axis_index(STAGE)
        is_first, is_last = stage == 0, stage == S - 1
        n_layers = jnp.asarray(self.layout.chunk_layers())[stage]  # [v]
        first_layer = jnp.asarray(self.layout.chunk_first_layer())[stage]  # [v]

        # drop the local stage axis (size 1), and the replica axis (size 1) under DiLoCo
        p = jax.tree.map(lambda a: a[0, 0] if self.independent else a[0], params)
        local = batch.reshape(M, batch.shape[0] // M, batch.shape[1])  # [M, mb, T+1]
        tokens, targets = local[:, :, :-1], local[:, :, 1:]  # [M, mb, T]
        mb, T, H = tokens.shape[1], tokens.shape[2], self.cfg.hidden_size
        act = jax.ShapeDtypeStruct((mb, T, H), p["embed"]["wte"].dtype)  # compute dtype
        base_key = jax.random.fold_in(jax.random.key(self.options.seed + 1), step)

        # One trace of a layer's vjp fixes the residual layout (XLA drops this dead code).
        w0 = dyn_index(p["blocks"], 0)
        _, vjp0 = jax.vjp(
            lambda w, x: self.ops.layer(w, x, layer_key(base_key, 0, 0)),
            w0,
            jnp.zeros(act.shape, act.dtype),
        )
        res = Residuals(vjp0, w0)
        split = stash = None
        if self.schedule.split_backward:
            split = split_backward(
                lambda w, saved, ct: res.join(saved, w)(ct), w0, res.buffered, act
            )
            stash = StashLayout(res.buffered, split.w_reads, split.stash)
        sched = self.schedule
        names = ("op", "mb", "chunk", "slot", "wslot", "xin", "gin", "xarr", "garr", "last")
        return StageLocal(
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
            res=res,
            split=split,
            stash=stash,
            fill=jnp.nan if self.options.nan_bubbles else 0.0,
            tables={k: jnp.asarray(getattr(sched, k)) for k in names},
        )

    def _carry0(self, st: StageLocal) -> dict:
        """The tick loop's state before tick 0."""
        sched, L = self.schedule, self.layout.slots
        act, fill = st.act, st.fill
        # Loop state. Big buffers are only ever updated in place: every "if" of the tick
        # loop is a 0-or-1-trip while loop (when), which XLA aliases, where lax.cond/switch
        # would copy each buffer that one branch writes and another passes through, every tick.
        c = dict(
            # activations waiting for FWD / gradients waiting for BWD, by inbox slot
            xbox=to_bits(jnp.full((sched.x_slots, *act.shape), fill, act.dtype)),
            gbox=to_bits(jnp.full((sched.g_slots, *act.shape), fill, act.dtype)),
            send_x=jnp.full(act.shape, fill, act.dtype),  # this tick's activation out
            send_g=jnp.full(act.shape, fill, act.dtype),  # this tick's gradient out
            # last virtual stage: dloss/dx per residual slot
            head_ct=to_bits(jnp.zeros((sched.buffer_slots, *act.shape), act.dtype)),
            # [K, slots, ...] per buffered residual
            res=[
                to_bits(jnp.zeros((sched.buffer_slots, L, *r.shape), r.dtype))
                for r in st.res.buffered
            ],
            grads=jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), st.params),  # fp32 sums
            # Reduced (1/d with ZeRO-1) block gradients, filled bucket by bucket (per-layer
            # buckets; None with one bucket per step, reduced after the loop).
            shards=jax.tree.map(
                lambda a, k: jnp.zeros(shard_shape(a.shape, k, self.data), jnp.float32),
                st.blocks,
                st.dims["blocks"],
            )
            if self.per_layer
            else None,
            loss=jnp.zeros((), jnp.float32),
        )
        if st.split is not None:  # zb: [Kw, slots, ...] per value of B for W left over
            c["stash"] = st.stash.leftover_buffers(sched.stash_slots, L)
        return c

    # --------------------------------------------------------------- one tick

    def _tick(self, st: StageLocal, c: dict, t, shape: TickShape):
        """Tick ``t``: run this stage's op (FWD / BWD / WGT / IDLE), then the tick's sends.

        ``shape`` is what all stages do at this tick (static): ops that no stage runs are
        not traced, and only the stage pairs in ``shape`` send.
        """
        op = st.at("op", t)

        def run(c):
            if shape.forward:
                c = when(op == FWD, lambda c: self.ops.forward(st, c, t), c)
            if shape.backward:
                c = when(op == BWD, lambda c: self.ops.backward(st, c, t), c)
            if shape.weights:
                c = when(op == WGT, lambda c: self.ops.weights(st, c, t), c)
            return c

        # One guard around the tick's op carries the residual buffers a FWD writes, so the
        # next tick's op comes after every read of them in this one. Per-op guards alone
        # leave a reading BWD and a later writing FWD unordered when they share no other
        # state (an untied head), and XLA copies every residual buffer on every FWD.
        c = when(op != IDLE, run, c)
        return self._send(st, c, t, shape)

    def _send(self, st: StageLocal, c: dict, t, shape: TickShape) -> dict:
        """The tick's two ``ppermute``s (only the pairs that send); arrivals to their slot."""
        c = dict(c)
        for pairs, out, box, arr in (
            (shape.fwd_pairs, "send_x", "xbox", "xarr"),
            (shape.bwd_pairs, "send_g", "gbox", "garr"),
        ):
            if not pairs:
                continue
            got = self._permute(st, c[out], pairs)  # [mb, T, H]; zeros elsewhere
            k = st.at(arr, t)
            c[box] = when(
                k < c[box].shape[0],  # the scratch index: nothing arrives here
                lambda b, g, k=k: lax.dynamic_update_index_in_dim(b, to_bits(g), k, 0),
                c[box],
                got,
            )
        return c

    def _permute(self, st: StageLocal, x, pairs):
        """``ppermute`` of x ``[mb, T, H]`` over ``pairs``; the pairs that cross islands in
        a second one, encoded on the sender and decoded on the receiver (one dtype per
        collective)."""
        far = tuple(p for p in pairs if p in self.crossing)
        near = tuple(p for p in pairs if p not in self.crossing)
        got = lax.ppermute(x, STAGE, list(near)) if near else None
        if not far:
            return got
        wire = lax.ppermute(encode(x, self.wire), STAGE, list(far))
        got_far = decode(wire, self.wire, x.dtype)
        if got is None:
            return got_far
        from_far = functools.reduce(jnp.logical_or, [st.stage == b for _, b in far])
        return jnp.where(from_far, got_far, got)

    # --------------------------------------------------------------- after the loop

    def _reduce(self, st: StageLocal, c: dict):
        """Steps 3–4: reduced gradients, mean loss over all stages and the global norm."""
        S, d, r, dims = self.layout.stages, self.data, self.replica, st.dims
        # 3. gradients reduced over data (inside an island) and replicas (zero.py phases 1-3):
        #    per-layer buckets: the blocks layer by layer during the last backward, the
        #    embedding and head now, as one bucket; one bucket per step: all of it now.
        g = c["grads"]
        parts = ("embed", "head") if self.per_layer else ("embed", "blocks", "head")
        grads = reduce_bucket(
            {p: g[p] for p in parts}, {p: dims[p] for p in parts}, d, r, self.options.flat_buckets
        )
        if self.per_layer:
            grads = dict(grads, blocks=c["shards"])
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
        if self.independent:  # this replica's own: [1] each, [R] outside; grads [1, 1, ...]
            return loss[None], jax.tree.map(lambda g: g[None, None], grads), norm[None]
        return loss, jax.tree.map(lambda g: g[None], grads), norm


# --------------------------------------------------------------------------- tick shapes


@dataclass(frozen=True)
class TickShape:
    """What a tick does across all stages (static, part of the program)."""

    fwd_pairs: tuple  # ((src, dst), ...) stages sending an activation
    bwd_pairs: tuple  # ((src, dst), ...) stages sending a gradient
    forward: bool  # some stage runs FWD
    backward: bool  # some stage runs BWD
    weights: bool  # some stage runs WGT (zb)


def tick_shape(sched: Schedule, t: int) -> TickShape:
    ops = set(int(o) for o in sched.op[t])
    return TickShape(sched.fwd_pairs[t], sched.bwd_pairs[t], FWD in ops, BWD in ops, WGT in ops)


def tick_segments(sched: Schedule, max_period: int | None = None) -> list[tuple[int, int, int]]:
    """The tick loop as ``(start, period, repeats)`` runs covering every tick once.

    Greedy: from each tick, the period (<= ``max_period``) whose tick shapes repeat the
    most ticks; a run of ``repeats`` >= 2 becomes one ``lax.scan`` over a ``period``-tick
    body, a single tick is unrolled. Any cover is correct (tables drive each tick); this
    one keeps the program short: O(S·v) bodies for warm-up and drain, one for steady state.

    ``max_period`` defaults to ``max(6, 2·S·v)``: the steady state repeats every 2 ticks
    under 1F1B, 3 under ZB-H1, but every 2·S·v under interleaved 1F1B, whose wrap-around
    sends (last stage to first, and back) recur once per S·v micro-batches. A shorter cap
    unrolls that steady state tick by tick, and the program and its temporaries grow with M.
    """
    if max_period is None:
        max_period = max(6, 2 * sched.stages * sched.virtual)
    # Each tick's shape as a small int, so comparing runs of ticks is comparing int lists.
    ids: dict[TickShape, int] = {}
    code = [ids.setdefault(tick_shape(sched, t), len(ids)) for t in range(sched.ticks)]
    T, out, t = sched.ticks, [], 0
    while t < T:
        best = (1, 1)  # (period, repeats)
        for p in range(1, max_period + 1):
            r = 1
            while t + (r + 1) * p <= T and code[t + r * p : t + (r + 1) * p] == code[t : t + p]:
                r += 1
            if r >= 2 and p * r > best[0] * best[1]:
                best = (p, r)
        out.append((t, *best))
        t += best[0] * best[1]
    return out
