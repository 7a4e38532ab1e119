"""An independent DiLoCo island's job (``diloco.mode: independent``): which island it is,
where its outputs go and its rows of each global batch.

- Outputs (:func:`island_outputs`): the island's own run directory
  ``<train.run_dir>/<island>``; an explicit ``train.metrics_path`` ``M.jsonl`` becomes
  ``M.<island>.jsonl``, an explicit ``checkpoint.dir`` ``D`` becomes ``D/<island>``.
- Batch (:class:`Share`): island i trains on rows ``[offset_i, offset_i + rows_i)`` of
  each global batch, shares in proportion to the islands' compute
  (:func:`holmes_jax.planner.grid.island_batch_rows`); with equal shares those are the rows
  replica i trains on under ``spmd``. Evaluation covers the same windows as a whole-batch
  run (:func:`eval_batch_count`).
- Rounds and the steps they follow: :mod:`holmes_jax.diloco.schedule`.
"""

from __future__ import annotations

import dataclasses
import os

from holmes_jax.core.config import Config
from holmes_jax.core.plan_request import plan_request
from holmes_jax.planner.grid import island_batch_rows
from holmes_jax.planner.topology import load_topology


def independent(cfg: Config) -> bool:
    """Whether ``cfg`` is one island's job of independent DiLoCo."""
    return cfg.diloco.mode == "independent"


def island_name(cfg: Config) -> str:
    """This job's island: its name in ``parallel.mesh``, else ``island<index>``."""
    if cfg.parallel.mesh:
        return load_topology(cfg.parallel.mesh).islands[cfg.diloco.island].name
    return f"island{cfg.diloco.island}"


def island_outputs(cfg: Config) -> Config:
    """``cfg`` with this island's own outputs (module doc); unchanged outside independent
    mode. Call before the run directory is chosen."""
    if not independent(cfg):
        return cfg
    name, train, ckpt = island_name(cfg), cfg.train, cfg.checkpoint
    run_dir = os.path.join(train.run_dir, name) if train.run_dir else train.run_dir
    metrics = train.metrics_path
    if metrics and metrics != "auto":
        metrics = f"{os.path.splitext(metrics)[0]}.{name}.jsonl"
    ckpt_dir = ckpt.dir
    if ckpt_dir and ckpt_dir != "auto":
        ckpt_dir = os.path.join(ckpt_dir, name)
    return cfg.replace(
        train=dataclasses.replace(train, run_dir=run_dir, metrics_path=metrics),
        checkpoint=dataclasses.replace(ckpt, dir=ckpt_dir),
    )


@dataclasses.dataclass(frozen=True)
class Share:
    """This island's part of each global batch: rows ``[offset, offset + rows)`` of
    ``total``."""

    island: int
    name: str
    offset: int
    rows: int
    total: int


def island_scope(cfg: Config) -> tuple[Config, Share]:
    """The island job's config (``replica`` 1, ``train.global_batch_size`` its rows) and
    its :class:`Share`."""
    rows = island_batch_rows(plan_request(cfg))
    i = cfg.diloco.island
    share = Share(i, island_name(cfg), sum(rows[:i]), rows[i], cfg.train.global_batch_size)
    cfg = cfg.replace(
        parallel=dataclasses.replace(cfg.parallel, replica=1),
        train=dataclasses.replace(cfg.train, global_batch_size=share.rows),
    )
    return cfg, share


def eval_batch_count(share: Share, eval_batches: int) -> int:
    """How many eval batches of ``share.rows`` rows cover the windows of ``eval_batches``
    batches of the whole global batch (exact when the rows divide them)."""
    return max(1, share.total * eval_batches // share.rows)
