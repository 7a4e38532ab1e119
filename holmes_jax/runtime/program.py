"""The compiled side of a run: sharded train state, the jitted train and eval steps.

A :class:`Program` is built once per (config, mesh). It owns

- the shardings of every parameter and optimizer-state leaf, derived from the logical
  axis names on the parameters and :data:`holmes_jax.runtime.model.decoder.LOGICAL_RULES`;
- ``init(seed)``: parameters and optimizer state created by one jitted function whose
  outputs are already sharded, so nothing is ever materialised whole on one device;
- ``train_step(state, batch)``: loss, gradients, AdamW update, in one jit with
  in/out shardings and the state donated;
- ``eval_loss(params, batch)``;
- with DiLoCo (``diloco.enabled`` true and ``replica`` > 1, :mod:`holmes_jax.diloco.outer_step`):
  a leading ``[R]`` axis sharded over ``replica`` on every parameter, optimizer-moment and
  master leaf (each island owns its own model and AdamW state; the step counts stay
  shared), the outer state ``outer = {'global', 'momentum'}`` (fp32, no ``[R]`` axis,
  sharded like the ZeRO-1 moments), an inner ``train_step`` with no collective over
  ``replica`` (loss and grad norm come back per replica, ``[R]`` sharded over
  ``replica``: the host averages them) and ``outer_step(state, fragment, steps_done)``
  (plain averaging within ``diloco.warmup_steps``).

A step whose loss or gradient norm is not finite changes no parameter or optimizer state;
``TrainState.skips`` counts it (:mod:`holmes_jax.runtime.nonfinite`).

Batches are ``[B, T + 1]`` int32 token windows sharded over ``data``: inputs are
``[:, :-1]`` and targets ``[:, 1:]``. Dropout keys derive from (seed, step), so a resumed
run draws the same masks as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from holmes_jax.core.axes import BATCH_AXES, DATA, REPLICA
from holmes_jax.core.config import Config
from holmes_jax.core.plan_request import plan_request
from holmes_jax.core.spec import resolve_grad_buckets
from holmes_jax.diloco.outer_step import OuterStep, stack_spec
from holmes_jax.diloco.schedule import due_fragments, in_warmup
from holmes_jax.planner.grid import load_mesh_topology
from holmes_jax.runtime.data.digest import DIGEST, batch_digest
from holmes_jax.runtime.engine.compress import crossing_pairs
from holmes_jax.runtime.engine.mesh import batch_sharding, collectives_block, replicated
from holmes_jax.runtime.engine.pipeline import EngineOptions, PipelineEngine
from holmes_jax.runtime.engine.stages import layout_from_config, pipeline_shardings
from holmes_jax.runtime.engine.zero import shard_dim, sharded_spec, zero1_split
from holmes_jax.runtime.model.decoder import GPT, LOGICAL_RULES, init_model
from holmes_jax.runtime.model.optim import (
    clip_by_global_norm,
    learning_rate_schedule,
    make_optimizer,
    step_count,
)
from holmes_jax.runtime.nonfinite import (
    count_skips,
    fresh_skips,
    inject_nonfinite,
    keep_finite,
    skip_metrics,
)
from holmes_jax.runtime.rundir import compile_cache
from holmes_jax.runtime.state import Shardings, TrainState, cast, compute_dtype


@dataclass
class _Jitted:
    """The program's jitted functions, some through the executable store."""

    init: Any
    train_step: Any
    eval: Any
    to_logical: Any
    from_logical: Any
    model_to_logical: Any
    with_model: Any
    compiled_step: Any = None  # compile_train_step's executable
    apply: Any = None  # apply_gradients', built on first use


class Program:
    """Jitted, sharded functions for one config on one mesh.

    The loss and gradients come from the :class:`~holmes_jax.runtime.engine.pipeline.PipelineEngine`
    (state in the pipeline layout, a single stage included) whenever there is a pipeline,
    microbatching, ZeRO-1, a cross-island replica, bf16, or data parallelism where
    collectives block the device (CPU); only with all of them off does GSPMD run the whole
    model (the plain reference). Either way checkpoints use the logical
    layout: :meth:`to_logical` / :meth:`from_logical` convert. With ZeRO-1 the optimizer
    state (and the gradients leaving the engine) are sharded over ``data``
    (:mod:`holmes_jax.runtime.engine.zero`).
    """

    def __init__(self, cfg: Config, mesh: Mesh, *, nan_bubbles: bool = False):
        self.cfg, self.mesh, self.nan_bubbles = cfg, mesh, nan_bubbles
        m, par = cfg.model, cfg.parallel
        self.dtype = compute_dtype(cfg.train.precision)
        self.data_size = mesh.shape[DATA]
        self.zero1 = cfg.optimizer.zero1 and self.data_size > 1
        # Where collectives block the device (CPU runtimes, gloo: a rendezvous per call)
        # the engine reduces each bucket as one buffer, and reduces data-parallel gradients
        # even without a pipeline: XLA's partitioner would all-reduce every leaf of every
        # layer on its own, inside the backward's layer loop.
        blocking = collectives_block(list(mesh.devices.flat))
        self.pipelined = (
            par.stages > 1
            or par.microbatches > 1
            or self.zero1
            or mesh.shape[REPLICA] > 1
            or self.dtype != jnp.float32  # fp32 accumulation and reduction of bf16 grads
            or (blocking and self.data_size > 1)
        )
        self.replicas = mesh.shape[REPLICA]
        # When the engine reduces gradients (auto: one bucket per step where collectives
        # block the device, as on CPU; per layer elsewhere).
        self.grad_buckets = resolve_grad_buckets(par.grad_buckets, blocking)
        # DiLoCo: each replica trains on its own (loop.run resolves ``auto`` to a bool).
        self.diloco = cfg.diloco.enabled is True and self.replicas > 1
        self.model = GPT(m, deterministic=True)
        self.train_model = GPT(m, deterministic=m.dropout == 0.0)
        self.init_model = init_model(m)
        self.tx = make_optimizer(cfg.optimizer, cfg.train.steps, clip=not self.pipelined)
        self.schedule = learning_rate_schedule(cfg.optimizer, cfg.train.steps)
        batch = batch_sharding(mesh)

        # Abstract shapes + logical names -> NamedShardings, without allocating anything.
        boxed = jax.eval_shape(self._init_boxed, jax.random.key(0))
        param_logical = nn.get_partition_spec(boxed)
        logical_sharding = nn.logical_to_mesh_sharding(param_logical, mesh, LOGICAL_RULES)
        abstract_logical = nn.unbox(boxed)
        logical_state = self._state_sharding(
            logical_sharding, abstract_logical, self._zero(logical_sharding, abstract_logical, 0)
        )
        self.abstract_logical_state = self._abstract_state(abstract_logical, logical_state)

        if self.pipelined:
            self.layout = layout_from_config(
                par.layers_per_stage, par.stages, m.num_layers, par.virtual_stages
            )
            param_sharding = pipeline_shardings(self.layout, logical_sharding, mesh)
            abstract_params = jax.eval_shape(self._params_from_logical, abstract_logical)
            self.grad_dims, opt_param_sharding = zero1_split(
                abstract_params, param_sharding, mesh, self.zero1
            )
            options = EngineOptions(
                microbatches=par.microbatches,
                schedule=par.schedule,
                seed=cfg.train.seed,
                grad_buckets=self.grad_buckets,
                flat_buckets=blocking,
                independent_replicas=self.diloco,
                cross_island_dtype=par.cross_island_dtype,
                crossing=(
                    frozenset()
                    if par.cross_island_dtype == "same"
                    else crossing_pairs(mesh, load_mesh_topology(plan_request(cfg)))
                ),
                nan_bubbles=nan_bubbles,
            )
            self.engine = PipelineEngine(m, self.layout, mesh, options, self.grad_dims)
        else:
            param_sharding = logical_sharding
            abstract_params = abstract_logical
            opt_param_sharding = logical_sharding
        state = self._state_sharding(param_sharding, abstract_params, opt_param_sharding)
        self.abstract_state = self._abstract_state(abstract_params, state)

        # Metrics: loss and grad norm per replica under DiLoCo ([R] over replica: a mean
        # here would be a cross-island collective every step), else replicated scalars.
        # The batch digest: one partial sum per shard of the batch's rows, where they are.
        per_replica = NamedSharding(mesh, PartitionSpec(REPLICA))
        each = per_replica if self.diloco else replicated(mesh)
        metrics = (
            {"loss": each, "grad_norm": each, "lr": replicated(mesh)}
            | skip_metrics({"total": each, "run": each})
            | {DIGEST: NamedSharding(mesh, PartitionSpec(BATCH_AXES))}
        )
        self.batch_shards = math.prod(mesh.shape[a] for a in BATCH_AXES)  # the digest's parts
        self.shardings = sh = Shardings(
            params=param_sharding,
            state=state,
            logical_state=logical_state,
            batch=batch,
            # the global model (fp32, sharded like the moments) under DiLoCo
            eval=opt_param_sharding if self.diloco else param_sharding,
            metrics=metrics,
        )
        self.outer = (
            OuterStep(cfg.diloco, self.layout, mesh, sh.state, self.dtype) if self.diloco else None
        )
        ident = compile_cache.identity(cfg, mesh, None, nan_bubbles)
        store = lambda name, f: compile_cache.Stored(f, name, mesh.devices.flat, ident)  # noqa: E731
        self._jit = _Jitted(
            init=jax.jit(self._init_state, out_shardings=sh.state),
            train_step=jax.jit(
                self._step,
                in_shardings=(sh.state, sh.batch),
                out_shardings=(sh.state, sh.metrics),
                donate_argnums=(0,),
            ),
            # the store's (a restart loads them): eval and the checkpoint layout conversions
            eval=store("eval", jax.jit(
                self._eval_loss, in_shardings=(sh.eval, sh.batch), out_shardings=replicated(mesh)
            )),
            to_logical=store("to_logical", jax.jit(
                self._state_to_logical, in_shardings=(sh.state,), out_shardings=sh.logical_state
            )),
            from_logical=store("from_logical", jax.jit(
                self._state_from_logical, in_shardings=(sh.logical_state,), out_shardings=sh.state
            )),
            model_to_logical=store("model_to_logical", jax.jit(
                self._params_to_logical, out_shardings=self.logical_model_sharding()
            )),
            with_model=store("with_model", jax.jit(self._set_model, out_shardings=sh.state)),
        )  # fmt: skip

    def _zero(self, param_sharding, abstract_params, skip: int):
        """Parameter shardings with ``data`` added where ZeRO-1 splits the leaf."""
        if not self.zero1:
            return param_sharding
        return jax.tree.map(
            lambda s, a: NamedSharding(
                self.mesh,
                sharded_spec(
                    s.spec,
                    shard_dim(a.shape, s.spec, self.data_size, skip, dict(self.mesh.shape)),
                    a.ndim,
                ),
            ),
            param_sharding,
            abstract_params,
        )

    def _state_sharding(self, param_sharding, abstract_params, opt_param_sharding) -> TrainState:
        """Shardings of the train state; the optimizer's moments follow ``opt_param_sharding``.
        Under DiLoCo what each replica owns gets the leading [R] axis over ``replica``
        (:func:`~holmes_jax.diloco.outer_step.stack_spec`); the outer state, like the moments
        of one replica, has none."""
        outer = None
        if self.diloco:
            outer = {"global": opt_param_sharding, "momentum": opt_param_sharding}
            param_sharding, opt_param_sharding = (
                jax.tree.map(
                    lambda s: NamedSharding(self.mesh, stack_spec(s.spec)),
                    t,
                    is_leaf=lambda x: isinstance(x, NamedSharding),
                )
                for t in (param_sharding, opt_param_sharding)
            )
        abstract_opt = jax.eval_shape(self.tx.init, abstract_params)
        opt_sharding = optax.tree_map_params(
            self.tx,
            lambda _, sharding: sharding,
            abstract_opt,
            opt_param_sharding,
            transform_non_params=lambda _: replicated(self.mesh),  # step counts: shared
        )
        master = opt_param_sharding if self.dtype != jnp.float32 else None
        counts = PartitionSpec(REPLICA) if self.diloco else PartitionSpec()  # the skip counters
        counter = NamedSharding(self.mesh, counts)
        return TrainState(
            step=replicated(self.mesh),
            params=param_sharding,
            opt_state=opt_sharding,
            master=master,
            outer=outer,
            skips={"total": counter, "run": counter},
        )

    def _abstract_state(self, abstract_params, sharding: TrainState) -> TrainState:
        fp32 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), abstract_params)
        shapes = jax.eval_shape(self.fresh_state, fp32)
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, sharding
        )

    # ------------------------------------------------------------------ public

    def context(self) -> contextlib.AbstractContextManager:
        """Mesh + logical-rules context that tracing needs (constraints inside the model)."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(nn.logical_axis_rules(LOGICAL_RULES))
        return stack

    def init(self, seed: int) -> TrainState:
        """Fresh parameters and optimizer state, created sharded."""
        with self.context():
            return self._jit.init(jax.random.key(seed))

    def train_step(self, state: TrainState, batch: jax.Array) -> tuple[TrainState, dict]:
        """One optimizer step (DiLoCo: one inner step of every replica, nothing crossing
        ``replica``). ``state`` is donated; metrics stay on device."""
        with self.context():
            if self._jit.compiled_step is not None:
                try:
                    return self._jit.compiled_step(state, batch)
                except (TypeError, ValueError):  # other shapes or shardings: jit's own path
                    self._jit.compiled_step = None
            return self._jit.train_step(state, batch)

    def compile_train_step(self, state: TrainState, batch: jax.Array) -> None:
        """Compile the train step for these arguments without running it (once); a later
        :meth:`train_step` with the same shapes and shardings runs that executable."""
        if self._jit.compiled_step is None:
            with self.context():
                self._jit.compiled_step = compile_cache.load_or_compile(
                    lambda: self._jit.train_step.lower(state, batch),
                    "train_step",
                    self.mesh.devices.flat,
                    compile_cache.identity(self.cfg, self.mesh, batch, self.nan_bubbles),
                )

    def due_fragments(self, steps_done: int) -> list[int]:
        """DiLoCo: the fragments whose outer step is due after ``steps_done`` inner steps."""
        if not self.diloco:
            return []
        d = self.cfg.diloco
        return due_fragments(steps_done, d.inner_steps, d.fragments, d.warmup_steps)

    def outer_step(self, state: TrainState, fragment: int, steps_done: int) -> TrainState:
        """DiLoCo: the outer step of ``fragment`` due after ``steps_done`` inner steps
        (:mod:`holmes_jax.diloco.outer_step`; within ``diloco.warmup_steps``: averaging);
        ``state`` is donated."""
        with self.context():
            return self.outer(state, fragment, in_warmup(steps_done, self.cfg.diloco.warmup_steps))

    def compile_outer_steps(self) -> None:
        """DiLoCo: compile the outer steps before training (see ``OuterStep.compile_all``)."""
        if self.diloco:
            with self.context():
                self.outer.compile_all(self.abstract_state)

    def eval_params(self, state: TrainState) -> Any:
        """The parameters eval runs on: the global model under DiLoCo, else ``params``."""
        return state.outer["global"] if self.diloco else state.params

    def eval_loss(self, params: Any, batch: jax.Array) -> jax.Array:
        """Mean loss of ``params`` (:meth:`eval_params`) on ``batch``."""
        with self.context():
            return self._jit.eval(params, batch)

    def to_logical(self, state: TrainState) -> TrainState:
        """The mesh-independent state (blocks stacked [L, ...]) that checkpoints hold."""
        if not self.pipelined:
            return state
        with self.context():
            return self._jit.to_logical(state)

    def from_logical(self, state: TrainState) -> TrainState:
        if not self.pipelined:
            return state
        with self.context():
            return self._jit.from_logical(state)

    def model_to_logical(self, state: TrainState):
        """The fp32 model (the master under bf16, else the parameters) in the logical
        layout; the optimizer state is not converted (cheaper than :meth:`to_logical`)."""
        model = state.master if state.master is not None else state.params
        if not self.pipelined:
            return model
        with self.context():
            return self._jit.model_to_logical(model)

    def with_logical_model(self, state: TrainState, model, step: int | None = None):
        """``state`` with its parameters (and master under bf16) set from ``model`` (fp32,
        the logical layout, sharded as :meth:`model_to_logical` returns it); with ``step``,
        the step and every optax step count set to it. AdamW moments stay as they are."""
        with self.context():
            return self._jit.with_model(state, model, np.int32(-1 if step is None else step))

    def logical_model_sharding(self):
        """The shardings of :meth:`model_to_logical`'s tree."""
        logical = self.shardings.logical_state
        return logical.master if self.dtype != jnp.float32 else logical.params

    def _set_model(self, state: TrainState, model, step) -> TrainState:
        """:meth:`with_logical_model`'s program (``step`` < 0: counts kept)."""
        if self.pipelined:
            model = self._params_from_logical(model)
        master = model if state.master is not None else None

        def count(path, x):
            if getattr(path[-1] if path else None, "name", None) == "count":
                return jnp.where(step >= 0, step, x).astype(x.dtype)
            return x

        return state.replace(
            params=cast(model, self.dtype),
            master=master,
            step=jnp.where(step >= 0, step, state.step).astype(state.step.dtype),
            opt_state=jax.tree_util.tree_map_with_path(count, state.opt_state),
        )

    def compile_layout_conversions(self) -> None:
        """Compile (or load) :meth:`to_logical`, :meth:`from_logical`, :meth:`model_to_logical`
        and :meth:`with_logical_model` now, ahead of their first call (a multi-process caller
        then waits for every process: a new program's first collective waits 30 s at most)."""
        if self.pipelined:
            state, logical = self.abstract_state, self.abstract_logical_state
            bf16 = self.dtype != jnp.float32
            j = self._jit
            with self.context():
                j.to_logical.compile(state)
                j.from_logical.compile(logical)
                j.model_to_logical.compile(state.master if bf16 else state.params)
                step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated(self.mesh))
                j.with_model.compile(state, logical.master if bf16 else logical.params, step)

    def apply_gradients(self, state: TrainState, grads) -> TrainState:
        """One optimizer step from given pipeline-layout gradients (for tests and tools).

        The same clip + AdamW (+ ZeRO-1 sharding) as the train step; the global norm is
        taken over the logical gradients.
        """
        if self._jit.apply is None:
            state_sharding = self.shardings.state
            grad_sharding = jax.tree.map(
                lambda s, a: NamedSharding(self.mesh, s.spec),
                state_sharding.opt_state[1][0].mu,
                self.abstract_state.params,
            )
            self._jit.apply = jax.jit(
                self._apply_gradients,
                in_shardings=(state_sharding, grad_sharding),
                out_shardings=state_sharding,
            )
        with self.context():
            return self._jit.apply(state, grads)

    def loss_and_grads(self, params, batch, step=0):
        """(loss, unclipped grads) for tests, in the program's parameter layout."""
        with self.context():
            if self.pipelined:
                loss, grads, _ = jax.jit(self.engine.loss_and_grads)(params, batch, step)
                return loss, grads
            rng = jax.random.key(0)
            return jax.jit(jax.value_and_grad(self._loss))(params, batch, rng)

    def lower_train_step(self):
        """The lowered train step (for HLO inspection and memory analysis)."""
        batch = jax.ShapeDtypeStruct(
            (self.cfg.train.global_batch_size, self.cfg.model.seq_len + 1),
            jnp.int32,
            sharding=self.shardings.batch,
        )
        with self.context():
            return self._jit.train_step.lower(self.abstract_state, batch)

    def compiled_memory(self) -> dict[str, int]:
        """Per-device bytes of the compiled train step (XLA's memory analysis; nothing is
        allocated). ``peak`` = arguments + outputs − donated aliases + temporaries."""
        m = self.lower_train_step().compile().memory_analysis()
        out = {
            "arguments": m.argument_size_in_bytes,
            "outputs": m.output_size_in_bytes,
            "aliased": m.alias_size_in_bytes,
            "temp": m.temp_size_in_bytes,
        }
        out["peak"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temp"]
        return out

    # ------------------------------------------------------------------ traced bodies

    def _init_boxed(self, key):
        tokens = jnp.zeros((1, self.cfg.model.seq_len), jnp.int32)
        return self.init_model.init({"params": key}, tokens)["params"]

    def _init_state(self, key) -> TrainState:
        params = nn.unbox(self._init_boxed(key))
        if self.pipelined:
            params = self._params_from_logical(params)
        return self.fresh_state(params)

    def fresh_state(self, params) -> TrainState:
        """Step 0 from fp32 ``params`` (either layout): compute-dtype copies, fresh AdamW
        moments, the fp32 master under bf16; under DiLoCo every replica starts from
        ``params`` ([R] axis) and so does the global model, with zero outer momentum."""
        outer = None
        if self.diloco:
            outer = {"global": params, "momentum": jax.tree.map(jnp.zeros_like, params)}
            params = jax.tree.map(lambda a: jnp.broadcast_to(a, (self.replicas, *a.shape)), params)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=cast(params, self.dtype),
            opt_state=self.tx.init(params),
            master=params if self.dtype != jnp.float32 else None,
            outer=outer,
            skips=fresh_skips(self.replicas if self.diloco else 0),
        )

    def _params_from_logical(self, params):
        return self.layout.map_parts(self.layout.leaf_to_pipeline, params)

    def _params_to_logical(self, params):
        return self.layout.map_parts(self.layout.leaf_to_logical, params)

    def _convert_state(self, state: TrainState, fn, params_template) -> TrainState:
        parts = self.layout.parts_tree(params_template)
        outer = None
        if self.diloco:  # the outer trees convert like master; the [R] trees per replica
            outer = {k: self.layout.map_parts(fn, v) for k, v in state.outer.items()}
            one = fn
            fn = lambda x, part: jax.vmap(lambda y: one(y, part))(x)  # noqa: E731
        opt_state = optax.tree_map_params(
            self.tx, fn, state.opt_state, parts, transform_non_params=lambda x: x
        )
        master = None if state.master is None else self.layout.map_parts(fn, state.master)
        return TrainState(
            step=state.step,
            params=self.layout.map_parts(fn, state.params),
            opt_state=opt_state,
            master=master,
            outer=outer,
            skips=state.skips,
        )

    def _state_to_logical(self, state: TrainState) -> TrainState:
        return self._convert_state(state, self.layout.leaf_to_logical, state.params)

    def _state_from_logical(self, state: TrainState) -> TrainState:
        return self._convert_state(state, self.layout.leaf_to_pipeline, state.params)

    def _loss(self, params, batch, rng):
        inputs, targets = batch[:, :-1], batch[:, 1:]  # [B, T] each
        rngs = {"dropout": rng} if self.cfg.model.dropout > 0 else None
        return self.train_model.apply({"params": params}, inputs, targets, rngs=rngs)

    def _step(self, state: TrainState, batch):
        params = state.params
        injected = self.cfg.train.inject_nonfinite_steps
        if injected:  # fault injection: compiled in only when set; the update uses state's
            params = inject_nonfinite(params, state.step + 1, injected)
        if self.pipelined:
            loss, grads, grad_norm = self.engine.loss_and_grads(params, batch, state.step)
        else:
            rng = jax.random.fold_in(jax.random.key(self.cfg.train.seed + 1), state.step)
            loss, grads = jax.value_and_grad(self._loss)(params, batch, rng)
            grad_norm = optax.tree.norm(grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)  # [R] under DiLoCo
        # The rate this step applies: the schedule at the optimizer's count, which skipped
        # steps do not advance (DiLoCo's shared count: state.step).
        lr = self.schedule(step_count(state.opt_state))
        state = self._update(state, grads, grad_norm, ok)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, **skip_metrics(state.skips)}
        metrics[DIGEST] = batch_digest(batch, self.batch_shards)
        return state, metrics

    def _update(self, state: TrainState, grads, grad_norm, ok) -> TrainState:
        """AdamW on (1/d shards of) the fp32 gradients and master parameters; GSPMD then
        all-gathers the new parameters (in bf16 when the run computes in bf16). Where ``ok``
        (scalar, or ``[R]`` under DiLoCo) is false the old values are kept."""
        grads = cast(grads, jnp.float32)
        clip = self.cfg.optimizer.grad_clip
        if self.diloco:  # grads [R, ...], norm [R]: each replica clips by its own norm
            grads = jax.vmap(lambda g, n: clip_by_global_norm(g, n, clip))(grads, grad_norm)
        elif self.pipelined:  # optax's own clip would see the pipeline layout: clip here
            grads = clip_by_global_norm(grads, grad_norm, clip)
        # AdamW is elementwise: on [R, ...] leaves it is R independent optimizers.
        target = state.params if state.master is None else state.master
        updates, opt_state = self.tx.update(grads, state.opt_state, target)
        new = optax.apply_updates(target, updates)
        # A non-finite step keeps every old value: a select, so its NaN cannot leak through.
        new, opt_state = keep_finite(ok, (new, opt_state), (target, state.opt_state))
        skips = count_skips(state.skips, ok)
        if state.master is None:
            return TrainState(
                step=state.step + 1,
                params=new,
                opt_state=opt_state,
                outer=state.outer,
                skips=skips,
            )
        return TrainState(
            step=state.step + 1,
            params=keep_finite(ok, cast(new, self.dtype), state.params),
            opt_state=opt_state,
            master=new,
            outer=state.outer,
            skips=skips,
        )

    def _apply_gradients(self, state: TrainState, grads) -> TrainState:
        norm = optax.tree.norm(self.layout.map_parts(self.layout.leaf_to_logical, grads))
        return self._update(state, grads, norm, jnp.isfinite(norm))

    def _eval_loss(self, params, batch):
        params = cast(params, self.dtype)  # DiLoCo's global model is fp32
        if self.pipelined:  # gathers the stages' layers: fine for periodic eval
            params = self.layout.map_parts(self.layout.leaf_to_logical, params)
        return self.model.apply({"params": params}, batch[:, :-1], batch[:, 1:])
