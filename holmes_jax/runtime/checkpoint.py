"""Orbax checkpoints: asynchronous, keep-last-N, resumed automatically from the newest.

A checkpoint at step k is a directory ``<checkpoint.dir>/<k>/`` holding two items:

- ``state``: the train state in its *logical* (mesh-independent) layout: parameters with
  blocks stacked ``[L, ...]``, the optimizer state mirroring them, and the step. Orbax
  writes each process's own shards and restores into whatever shardings the new run asks
  for, so a run may resume on another mesh.
- ``meta``: JSON with the step, the data position (the number of batches consumed;
  batches are a pure function of (seed, step)), and the full config used.

Saves are asynchronous: ``save`` returns once the arrays are copied off the devices and
the write continues in the background; :meth:`Checkpointer.close` waits for it.
"""

from __future__ import annotations

import os
from typing import Any

import orbax.checkpoint as ocp

from holmes_jax.core.config import CheckpointConfig, Config
from holmes_jax.core.errors import ConfigError


class Checkpointer:
    """Thin wrapper over ``ocp.CheckpointManager`` for one run directory."""

    def __init__(self, cfg: CheckpointConfig):
        if not cfg.dir:
            raise ValueError("Checkpointer needs checkpoint.dir")
        self.cfg = cfg
        self.directory = os.path.abspath(cfg.dir)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            create=True,
            enable_async_checkpointing=cfg.async_save,
        )
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta")
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, *, data_position: int, config: Config) -> None:
        """Start saving ``state`` (logical layout) as checkpoint ``step``."""
        meta = {"step": int(step), "data_position": int(data_position), "config": config.to_dict()}
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )

    def restore(self, abstract_state: Any, config: Config, step: int | None = None):
        """Restore into the shardings of ``abstract_state``.

        Args:
          abstract_state: pytree of ``jax.ShapeDtypeStruct`` with target shardings.
          config: the running config; its model section must match the checkpoint's.
          step: which checkpoint; default the newest.

        Returns:
          ``(state, meta)`` or ``None`` when the directory holds no checkpoint.

        Raises:
          ConfigError: the checkpoint was written for a different model shape.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"
        ]
        saved_model = meta["config"]["model"]
        running_model = config.to_dict()["model"]
        shape_keys = ("vocab_size", "seq_len", "num_layers", "num_heads", "hidden_size")
        shape_keys += ("mlp_ratio", "tied_embeddings")
        for key in shape_keys:
            if saved_model.get(key) != running_model[key]:
                raise ConfigError(
                    f"model.{key}={running_model[key]}: checkpoint {self.directory}/{step} was "
                    f"written with model.{key}={saved_model.get(key)}; use another "
                    f"checkpoint.dir or set checkpoint.resume=false"
                )
        restored = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
        )
        return restored["state"], meta

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
