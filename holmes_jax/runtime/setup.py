"""Everything the training loop (:func:`holmes_jax.runtime.loop.run`) does before its
first step, in the order it does it.

- :func:`resolve`: the mesh degrees and what the config leaves to the planner (``auto``:
  the split, remat, DiLoCo by :func:`holmes_jax.planner.strategy.resolve_diloco`), checked
  to fit in memory; ``train --print-config`` runs it alone, and the config it returns is
  the one the run trains and writes to ``config.yaml``. On a topology (``parallel.mesh``)
  :func:`describe_plan` predicts the step with the planner's cost model.
- :func:`restore`: the newest checkpoint in ``checkpoint.dir`` (:func:`nothing_to_train`
  when it holds ``train.steps`` steps already); :func:`initial_state`: the restored
  state, else ``checkpoint.init_from``'s parameters with a fresh optimizer at step 0,
  else a fresh one.
- :class:`Data`: the corpus, this process's part of each batch, the evaluation batches.
- :func:`announce`: the lines printed before training (process 0, through the metrics
  logger): the model and mesh, where the outputs go, the plan, DiLoCo, what was resumed.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from holmes_jax.core.config import Config
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.plan_request import apply_parallel, plan_request
from holmes_jax.core.spec import Degrees, flops_per_token
from holmes_jax.diloco.scope import eval_batch_count, independent, island_outputs, island_scope
from holmes_jax.planner.failures import replan
from holmes_jax.planner.grid import job_topology, load_mesh_topology, resolve_shape
from holmes_jax.planner.memory import check_fits
from holmes_jax.planner.outer_formats import resolve_outer_dtype
from holmes_jax.planner.plans import memory_inputs_of, predict_run, resolve_auto
from holmes_jax.planner.report import format_preference, format_run_plan
from holmes_jax.planner.strategy import predict_diloco, resolve_diloco
from holmes_jax.planner.topology import Topology, load_topology
from holmes_jax.runtime.data.feed import Feed
from holmes_jax.runtime.data.loader import (
    BatchSampler,
    eval_batches,
    global_array,
    load_corpus,
    local_rows,
)
from holmes_jax.runtime.engine.mesh import collectives_block
from holmes_jax.runtime.model.decoder import attention_kernel
from holmes_jax.runtime.rundir.checkpoint import init_state_from
from holmes_jax.runtime.rundir.devices import peak_tflops
from holmes_jax.runtime.rundir.metrics import MetricsLogger
from holmes_jax.runtime.rundir.paths import (
    CHECKPOINTS_NAME,
    RunDir,
    choose_run_dir,
    first_free,
    moved_line,
    outputs_line,
    sibling,
)
from holmes_jax.runtime.state import compute_dtype


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A config resolved against the visible devices (:func:`resolve`).

    Attributes:
      cfg: what the run trains: outputs in the run directory, DiLoCo decided, and the
        planner's ``auto`` (schedule, split, remat) resolved for ``shape``.
      outputs: the run directory chosen (:func:`~holmes_jax.runtime.rundir.paths.choose_run_dir`).
      devices: the devices the run sees (``jax.devices()``).
      topology: the cluster (``parallel.mesh``, without ``parallel.exclude_hosts``), or None.
      shape: the mesh degrees.
      replanned: the survivors' plan (:func:`~holmes_jax.planner.failures.replan`) when
        ``parallel.exclude_hosts`` names hosts, else None.
      asked: the config as given, outputs resolved (before the planner's choices).
      diloco_choice: :func:`~holmes_jax.planner.strategy.resolve_diloco`'s choice, or None.
      share: an independent DiLoCo island's rows of the global batch
        (:mod:`holmes_jax.diloco.scope`), else None.
      outer_why: why ``diloco.outer_dtype: auto`` resolved as it did, else empty.
      trial: the line of the survivors' candidates tried
        (:mod:`holmes_jax.runtime.replan_trial`), else empty.
    """

    cfg: Config
    outputs: RunDir
    devices: list
    topology: Topology | None
    shape: Degrees
    replanned: Any
    asked: Config
    diloco_choice: Any
    share: Any = None
    outer_why: str = ""
    trial: str = ""


def resolve(cfg: Config, outputs: RunDir | None = None, candidate: int = 0) -> Resolved:
    """Choose the run directory (unless ``outputs`` is given), then resolve the degrees and
    what the config leaves to the planner, on the visible devices, and check the plan fits
    in memory. Compiles nothing and writes nothing. A failure's survivors run their
    ``candidate``-th plan (:attr:`~holmes_jax.planner.failures.Replan.candidates`).

    Raises:
      ConfigError: settings that are impossible on the visible devices.
    """
    outputs = outputs or choose_run_dir(island_outputs(cfg))
    cfg, outer_why = _outer_dtype(outputs.cfg)  # for the whole run, before an island's share
    share = None
    if independent(cfg):  # this island's job: replica 1, its rows of the global batch
        cfg, share = island_scope(cfg)
    devices = jax.devices()
    req = plan_request(cfg)  # the planner's view of the run; its decisions come back as data
    topology = load_mesh_topology(req)  # without parallel.exclude_hosts
    replanned = None
    if req.parallel.exclude_hosts:  # a failure's survivors: the planner's degrees for them
        full = job_topology(req)
        sync = collectives_block(devices)
        replanned = replan(req, full, req.parallel.exclude_hosts, sync_collectives=sync)
        replanned = replanned.choose(candidate)
        req = req.with_parallel(replanned.parallel)
        cfg = apply_parallel(cfg, replanned.parallel)
    asked = cfg
    diloco, choice = resolve_diloco(req, topology)
    req = dataclasses.replace(req, diloco=dataclasses.replace(req.diloco, enabled=diloco))
    cfg = dataclasses.replace(cfg, diloco=dataclasses.replace(cfg.diloco, enabled=diloco))
    shape = resolve_shape(req, len(devices), topology)
    cfg = apply_parallel(cfg, resolve_auto(req, shape, topology))
    check_memory(cfg, shape, topology, devices)
    return Resolved(
        cfg, outputs, devices, topology, shape, replanned, asked, choice, share, outer_why
    )


def _outer_dtype(cfg: Config) -> tuple[Config, str]:
    """``cfg`` with ``diloco.outer_dtype: auto`` resolved on the whole run's mesh
    (:func:`~holmes_jax.planner.outer_formats.resolve_outer_dtype`) and why; else as it is."""
    if cfg.diloco.outer_dtype != "auto":
        return cfg, ""
    req = plan_request(cfg)
    mesh = cfg.parallel.mesh  # the whole mesh: an island's job alone has no link to price
    fmt, why = resolve_outer_dtype(req, load_topology(mesh) if mesh else None)
    return cfg.replace(diloco=dataclasses.replace(cfg.diloco, outer_dtype=fmt)), why


def restore(ckpt, program, cfg: Config) -> tuple[Any, int]:
    """The newest checkpoint's logical state and its step, or ``(None, 0)`` (no
    checkpoint, ``checkpoint.resume`` off, or none saved yet)."""
    if ckpt is None or not cfg.checkpoint.resume:
        return None, 0
    restored = ckpt.restore(program.abstract_logical_state, cfg)
    if restored is None:
        return None, 0
    logical, meta = restored
    return logical, int(meta["data_position"])


def initial_state(program, cfg: Config, logical) -> tuple[Any, str | None]:
    """The state to train from: the restored ``logical`` one, else ``checkpoint.init_from``'s
    parameters with a fresh optimizer at step 0, else a fresh one; and ``init_from``'s step
    directory when the run starts there."""
    if logical is not None:
        return program.from_logical(logical), None
    if cfg.checkpoint.init_from:
        state, started_from = init_state_from(program, cfg.checkpoint.init_from)
        if state is not None:
            return state, started_from
    return program.init(cfg.train.seed), None


class Data:
    """The corpus, this process's rows of each training batch (read ahead: ``feed``) and
    the evaluation batches by set name ("" for the held-out tail of ``data.path``).

    An independent DiLoCo island (``share``) takes its rows of each global batch, and the
    whole batch's evaluation windows: the same draws as a whole-batch run's.
    """

    def __init__(self, cfg: Config, program, share=None):
        corpus = load_corpus(cfg.data, cfg.model.vocab_size)
        seq, batch_size, seed = cfg.model.seq_len, cfg.train.global_batch_size, cfg.train.seed
        window = (share.offset, share.rows) if share is not None else None
        drawn = share.total if share is not None else batch_size
        n_eval = (
            eval_batch_count(share, cfg.train.eval_batches) if share else cfg.train.eval_batches
        )
        self.sampler = BatchSampler(
            corpus.train, seq, drawn, seed, window=window, weights=list(corpus.weights) or None
        )
        self.sharding = program.shardings.batch
        sets = {"": corpus.eval} if corpus.eval is not None else {}
        self.eval_sets = {
            name: [
                _global_batch(rows, self.sharding)
                for rows in eval_batches(s, seq, batch_size, n_eval)
            ]
            for name, s in {**sets, **corpus.evals}.items()
        }
        self.names, self.weights, self.description = (
            corpus.names,
            corpus.weights,
            corpus.description,
        )
        mine = local_rows(self.sharding, self.sampler.global_batch_size)

        def read(step: int) -> tuple[np.ndarray, np.ndarray | None]:
            if not corpus.names:  # one source: no counts to keep
                return self.sampler.rows(step, mine), None
            return self.sampler.rows_and_sources(step, mine)

        self.feed = Feed(read, cfg.data.prefetch, cfg.train.steps, self.sampler.source_rows_before)

    def batch(self, step: int) -> jax.Array:
        """Step ``step + 1``'s batch, this process's rows of it on its devices."""
        return global_array(self.feed.get(step), self.sharding, self.sampler.global_batch_size)

    def report(self, steps: int) -> dict[str, float]:
        """Metrics of the last ``steps`` steps: the mean seconds a step waited for its rows,
        and each mixture source's tokens so far (``tokens_<name>``)."""
        out = {"data_wait_s": self.feed.take_wait() / max(steps, 1)}
        if self.feed.rows is not None:
            tokens = self.feed.rows * self.sampler.seq_len
            out.update({f"tokens_{n}": int(t) for n, t in zip(self.names, tokens, strict=True)})
        return out


def make_logger(cfg: Config, r: Resolved) -> MetricsLogger:
    """The metrics logger (it prints on process 0 only), with the model's FLOPs per token
    and the devices' peak for the utilisation it reports."""
    flops = flops_per_token(cfg.model.spec, cfg.model.remat)
    peak = cfg.logging.peak_tflops or peak_tflops(r.devices[0].device_kind, cfg.train.precision)
    return MetricsLogger(
        cfg, flops=flops, num_devices=r.shape.num_devices, peak_tflops=peak,
        is_main=jax.process_index() == 0,
    )  # fmt: skip


def announce(log, r: Resolved, data: Data, plan_lines, outer_lines, resumed, start, started_from):
    """The lines before training: model, mesh and data; where the outputs go; the plan
    (or the pipeline as configured); DiLoCo; remat's choice; what the run starts from."""
    cfg, shape, devices, say = r.cfg, r.shape, r.devices, log.message
    say(
        f"holmes_jax: {cfg.model.spec.num_params / 1e6:.2f}M params | mesh "
        + (f"replica={shape.replica} " if shape.replica > 1 else "")
        + f"stage={shape.stages} data={shape.data} tensor={shape.tensor} on "
        f"{shape.num_devices} {devices[0].platform} devices | {data.description}"
    )
    lines = []
    if r.outputs.continued:
        lines.append(f"restart: continuing the run in {cfg.train.run_dir}")
    if r.replanned is not None:
        lines += [r.replanned.line(), r.trial]
    lines += [moved_line(r.outputs), outputs_line(cfg), *plan_lines]
    if not plan_lines and (cfg.parallel.stages > 1 or cfg.parallel.microbatches > 1):
        lines.append(
            f"pipeline: layers per stage {list(cfg.parallel.layers_per_stage)}, "
            f"{cfg.parallel.microbatches} microbatches, {cfg.parallel.schedule}"
        )
    lines += outer_lines
    runs = cfg.diloco.enabled is True and (r.share is not None or shape.replica > 1)
    if r.outer_why and runs:
        lines.append(f"diloco.outer_dtype=auto -> {r.outer_why}")
    if r.asked.model.remat == "auto":
        lines.append(f"remat: auto -> {cfg.model.remat} (the fastest policy that fits)")
    if resumed:
        lines.append(f"resumed from {cfg.checkpoint.dir} at step {start}")
        if cfg.checkpoint.init_from:
            lines.append(
                f"checkpoint.init_from={cfg.checkpoint.init_from} not used: the run resumes "
                "from its own checkpoints"
            )
    if started_from:
        lines.append(f"initialised from {started_from} (fresh optimizer, step 0)")
    for line in lines:
        if line:
            say(line)
    if cfg.train.run_dir:
        log.report("run_dir", path=cfg.train.run_dir)
    log.report("resumed", step=start if resumed else 0)


def nothing_to_train(cfg: Config, held: int) -> str:
    """The one line of a run whose checkpoint already holds ``train.steps`` steps."""
    again = f"raise train.steps (--set train.steps={max(2 * held, held + 1)})"
    run_dir = cfg.train.run_dir
    if run_dir and cfg.checkpoint.dir == os.path.join(run_dir, CHECKPOINTS_NAME):
        other = sibling(run_dir, first_free(run_dir))
        new = f"start a new run (--set train.run_dir={other})"
    else:
        new = "start a new run in another checkpoint.dir"
    return (
        f"nothing to train: {cfg.checkpoint.dir} holds step {held} and "
        f"train.steps={cfg.train.steps}; {again} or {new}"
    )


def describe_plan(
    cfg: Config,
    shape: Degrees,
    topology: Topology | None,
    devices: list,
    asked_split: tuple[int, ...] | str | None,
) -> tuple[list[str], float | None]:
    """The plan's lines for the log and its predicted step; nothing without a topology.

    The prediction is the planner's (:func:`holmes_jax.planner.plans.predict_run`) for
    ``cfg`` as resolved, with blocking collectives on CPU runtimes, where a collective
    occupies the device until it is done. A run the cost model cannot price (the naive
    placement with stages) still trains: its plan is one line saying why.

    Args:
      cfg: the config after :func:`~holmes_jax.planner.plans.resolve_auto`.
      shape: the resolved degrees.
      topology: the cluster (``parallel.mesh``), or None.
      devices: the visible devices (their platform decides the collectives priced).
      asked_split: ``parallel.layers_per_stage`` as the user gave it (before resolving).

    Returns:
      (lines, predicted step in seconds or None).
    """
    if topology is None:
        return [], None
    sync = collectives_block(devices)
    req = plan_request(cfg)
    try:
        prediction = predict_run(req, topology, sync_collectives=sync)
    except ConfigError as e:
        return [f"plan on topology {topology.name}: no prediction ({e})"], None
    if cfg.parallel.stages == 1:
        split = "one stage"
    elif asked_split == "auto":
        split = "the planner's optimal split (parallel.layers_per_stage: auto)"
    elif isinstance(asked_split, tuple):
        split = "as configured (parallel.layers_per_stage)"
    else:
        split = "even (parallel.layers_per_stage unset)"
    lines = format_run_plan(req, shape, topology, prediction, sync_collectives=sync, split=split)
    lines += format_preference(req, topology, prediction.step_s, sync_collectives=sync)
    if cfg.diloco.enabled is True and shape.replica > 1:
        # The plan above prices replica > 1 as hierarchical (a cross-island gradient ring
        # every step); DiLoCo's inner steps send nothing across: price those instead.
        step, inner, outer = predict_diloco(req, topology, sync_collectives=sync)
        lines.append(
            f"diloco: predicted inner step {inner:.4g}s (islands alone) + one outer sync "
            f"{outer:.4g}s every {cfg.diloco.inner_steps} steps = {step:.4g}s per step"
        )
        return lines, step
    return lines, prediction.step_s


def device_limit_bytes(topology, devices) -> float | None:
    """Memory of one device: the smallest island's ``memory_gb`` when a topology names it,
    else what the runtime reports (GPUs), else None (CPU: no limit to check)."""
    if topology is not None:
        return min(isl.memory_gb for isl in topology.islands) * 1e9
    local = [d for d in devices if d.process_index == jax.process_index()]
    try:  # only this process's devices can be asked; CPU runtimes may not answer
        stats = local[0].memory_stats() if local else None
    except Exception:  # noqa: BLE001 (any runtime refusal means: no limit known)
        stats = None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    return None


def check_memory(cfg: Config, shape, topology, devices) -> None:
    """Before compiling: resolve the attention kernel (a forced ``cudnn`` that cannot run is
    a one-line ConfigError) and refuse a plan the memory model says will not fit
    (:func:`holmes_jax.planner.memory.check_fits`). ``cfg`` comes from :func:`resolve_auto`, so
    its split is concrete."""
    kernel = attention_kernel(cfg.model, compute_dtype(cfg.train.precision))
    limit = device_limit_bytes(topology, devices)
    if limit is not None:
        x = memory_inputs_of(plan_request(cfg, kernel), shape.data)
        check_fits(x, cfg.parallel.layers_per_stage, limit)


def _global_batch(rows: np.ndarray, sharding) -> jax.Array:
    """A global [B, T+1] array from a host copy of all rows, each process giving its own."""
    return global_array(rows[local_rows(sharding, rows.shape[0])], sharding, rows.shape[0])
