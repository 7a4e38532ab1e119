"""The compiled side of a run: sharded train state, the jitted train and eval steps.

A :class:`Program` is built once per (config, mesh). It owns

- the shardings of every parameter and optimizer-state leaf, derived from the logical
  axis names on the parameters and :data:`holmes_jax.model.LOGICAL_RULES`;
- ``init(seed)``: parameters and optimizer state created by one jitted function whose
  outputs are already sharded, so nothing is ever materialised whole on one device;
- ``train_step(state, batch)``: loss, gradients, AdamW update, in one jit with
  in/out shardings and the state donated;
- ``eval_loss(params, batch)``.

Batches are ``[B, T + 1]`` int32 token windows sharded over ``data``: inputs are
``[:, :-1]`` and targets ``[:, 1:]``. Dropout keys derive from (seed, step), so a resumed
run draws the same masks as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from holmes_jax.config import Config
from holmes_jax.errors import ConfigError
from holmes_jax.mesh import batch_sharding, replicated
from holmes_jax.model import GPT, LOGICAL_RULES
from holmes_jax.optim import learning_rate_schedule, make_optimizer


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: Any  # {'embed', 'blocks' (every leaf [L, ...]), 'head'}
    opt_state: Any  # optax state mirroring params


class Program:
    """Jitted, sharded functions for one config on one mesh."""

    def __init__(self, cfg: Config, mesh: Mesh):
        if cfg.parallel.stages > 1:
            raise ConfigError(
                f"parallel.stages={cfg.parallel.stages}: the pipeline engine is not built yet; "
                "use parallel.stages=1"
            )
        self.cfg = cfg
        self.mesh = mesh
        m = cfg.model
        self.model = GPT(m, deterministic=True)
        self.train_model = GPT(m, deterministic=m.dropout == 0.0)
        self.tx = make_optimizer(cfg.optimizer, cfg.train.steps)
        self.schedule = learning_rate_schedule(cfg.optimizer, cfg.train.steps)
        self.batch_sharding = batch_sharding(mesh)

        # Abstract shapes + logical names -> NamedShardings, without allocating anything.
        boxed = jax.eval_shape(self._init_boxed, jax.random.key(0))
        self.param_logical = nn.get_partition_spec(boxed)
        self.param_sharding = nn.logical_to_mesh_sharding(self.param_logical, mesh, LOGICAL_RULES)
        abstract_params = nn.unbox(boxed)
        abstract_opt = jax.eval_shape(self.tx.init, abstract_params)
        opt_sharding = optax.tree_map_params(
            self.tx,
            lambda _, sharding: sharding,
            abstract_opt,
            self.param_sharding,
            transform_non_params=lambda _: replicated(mesh),
        )
        self.state_sharding = TrainState(
            step=replicated(mesh), params=self.param_sharding, opt_state=opt_sharding
        )
        self.abstract_state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            TrainState(
                step=jax.ShapeDtypeStruct((), jnp.int32),
                params=abstract_params,
                opt_state=abstract_opt,
            ),
            self.state_sharding,
        )

        self._init = jax.jit(self._init_state, out_shardings=self.state_sharding)
        self._train_step = jax.jit(
            self._step,
            in_shardings=(self.state_sharding, self.batch_sharding),
            out_shardings=(self.state_sharding, replicated(mesh)),
            donate_argnums=(0,),
        )
        self._eval = jax.jit(
            self._eval_loss,
            in_shardings=(self.param_sharding, self.batch_sharding),
            out_shardings=replicated(mesh),
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
            return self._init(jax.random.key(seed))

    def train_step(self, state: TrainState, batch: jax.Array) -> tuple[TrainState, dict]:
        """One optimizer step. ``state`` is donated; metrics stay on device."""
        with self.context():
            return self._train_step(state, batch)

    def eval_loss(self, params: Any, batch: jax.Array) -> jax.Array:
        with self.context():
            return self._eval(params, batch)

    def lower_train_step(self):
        """The lowered train step (for HLO inspection and memory analysis)."""
        batch = jax.ShapeDtypeStruct(
            (self.cfg.train.global_batch_size, self.cfg.model.seq_len + 1),
            jnp.int32,
            sharding=self.batch_sharding,
        )
        with self.context():
            return self._train_step.lower(self.abstract_state, batch)

    # ------------------------------------------------------------------ traced bodies

    def _init_boxed(self, key):
        tokens = jnp.zeros((1, self.cfg.model.seq_len), jnp.int32)
        return self.model.init({"params": key}, tokens)["params"]

    def _init_state(self, key) -> TrainState:
        params = nn.unbox(self._init_boxed(key))
        return TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params)
        )

    def _loss(self, params, batch, rng):
        inputs, targets = batch[:, :-1], batch[:, 1:]  # [B, T] each
        rngs = {"dropout": rng} if self.cfg.model.dropout > 0 else None
        return self.train_model.apply({"params": params}, inputs, targets, rngs=rngs)

    def _step(self, state: TrainState, batch):
        rng = jax.random.fold_in(jax.random.key(self.cfg.train.seed + 1), state.step)
        loss, grads = jax.value_and_grad(self._loss)(state.params, batch, rng)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "lr": self.schedule(state.step),
        }
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    def _eval_loss(self, params, batch):
        return self.model.apply({"params": params}, batch[:, :-1], batch[:, 1:])


def sharding_summary(shardings: Any) -> dict[str, str]:
    """{'path': 'PartitionSpec(...)'} for logging and tests."""
    flat = jax.tree_util.tree_flatten_with_path(
        shardings, is_leaf=lambda x: isinstance(x, NamedSharding)
    )[0]
    return {
        jax.tree_util.keystr(path): str(s.spec if isinstance(s, NamedSharding) else PartitionSpec())
        for path, s in flat
    }
