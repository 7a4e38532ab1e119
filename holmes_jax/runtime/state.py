"""What a program's step carries and where it lives: the train state, its shardings, the
compute dtype."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: batches consumed (steps run, skipped ones included)
    params: Any  # {'embed', 'blocks' (every leaf [L, ...]), 'head'}, compute dtype
    opt_state: Any  # optax state mirroring the fp32 parameters
    master: Any = None  # bf16 runs: the fp32 master parameters (sharded like opt_state)
    # DiLoCo: {'global': fp32 params (no [R] axis), 'momentum': the same}; None otherwise.
    outer: Any = None
    # Non-finite steps skipped, int32: {'total': since step 0, 'run': in a row up to now};
    # [R] over replica under DiLoCo (runtime.nonfinite). Set by every Program.
    skips: Any = None


@dataclass(frozen=True)
class Shardings:
    """Where a program's state and a step's inputs and outputs live on the mesh."""

    params: Any  # the parameters, in the program's layout
    state: TrainState  # the train state, in the program's layout
    logical_state: TrainState  # the train state in the logical layout (checkpoints)
    batch: NamedSharding  # [B, T + 1] token windows over data
    eval: Any  # what eval runs on: the global model under DiLoCo, else the parameters
    metrics: Any  # loss and grad norm ([R] over replica under DiLoCo), lr, skip counters


def compute_dtype(precision: str):
    """The dtype parameters and activations are computed in for ``train.precision``."""
    return jnp.bfloat16 if precision == "bf16" else jnp.float32


def cast(tree, dtype):
    """Every leaf of ``tree`` as ``dtype``."""
    return jax.tree.map(lambda a: a.astype(dtype), tree)
