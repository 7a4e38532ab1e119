"""The training loop: data → sharded step → metrics, eval, checkpoints, clean stops.

Read top to bottom, :func:`run` does:

0. choose the run directory (:func:`holmes_jax.runtime.rundir.choose_run_dir`) and the
   persistent compilation cache (:func:`holmes_jax.runtime.compile_cache.configure`);
1. resolve the mesh degrees and what the config leaves to the planner (``auto``: the split,
   remat, DiLoCo by :func:`holmes_jax.planner.strategy.resolve_diloco`), build the mesh,
   and on a topology (``parallel.mesh``) predict the step with the planner's cost model;
2. build the :class:`~holmes_jax.runtime.program.Program` (nothing compiles yet);
3. restore the newest checkpoint in ``checkpoint.dir``; when it holds ``train.steps``
   steps already, say so in one line and return;
4. load the corpus and the state: the restored one, else ``checkpoint.init_from``'s
   parameters with a fresh optimizer at step 0, else a fresh one; write ``config.yaml``;
5. loop: make this process's part of the batch, step (under DiLoCo: then the outer step of
   each fragment due), and on log steps fetch metrics (only then does the host wait for
   the device), evaluate, checkpoint. The first step compiles: the compile is announced,
   timed (``compile_s``; the line says whether the compilation cache served it) and left
   out of the progress bar and the step times. A non-finite step changes no state; the
   guard (:class:`holmes_jax.runtime.nonfinite.SkipGuard`) reads its counters a step late
   and stops the run past ``train.max_skipped_steps`` in a row, before any save;
6. on SIGTERM/SIGINT finish the current step, save, and return; at the end save. With
   several processes all stop after the same step: SIGTERM through jax's preemption sync
   point (asked every step), SIGINT by agreeing on log steps.

Steps 0 and 1 are :func:`resolve`, which ``train --print-config`` runs alone: the config
it returns is the one the run trains and writes to ``config.yaml``. With
``logging.profile_steps`` a window of steps is traced
(:class:`holmes_jax.runtime.profiling.StepProfiler`); the step, evaluation, checkpoint
saves, DiLoCo outer syncs and metric fetches are annotated for the trace viewer either way.

Printed through the metrics logger (process 0 only): before training, where the outputs
go and, on a topology, the plan (:func:`holmes_jax.planner.report.format_run_plan`); after
training, the predicted against the measured median step
(:func:`holmes_jax.planner.report.format_step_check`), measured as the logging windows'
mean step times (evaluation and checkpoints excluded, the first window left out).

``run`` returns the history: one dict per logged step (the same records as the JSON lines).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from typing import Any

import jax
import numpy as np

from holmes_jax.cluster.distributed import (
    any_process,
    barrier,
    preemption_service,
    reached_preemption_sync_point,
)
from holmes_jax.core.config import Config
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import Degrees, flops_per_token
from holmes_jax.diloco.islands import IslandSync
from holmes_jax.diloco.outer_step import in_warmup
from holmes_jax.diloco.scope import eval_batch_count, independent, island_outputs, island_scope
from holmes_jax.planner.failures import replan
from holmes_jax.planner.grid import job_topology, load_mesh_topology, resolve_shape
from holmes_jax.planner.memory import check_fits
from holmes_jax.planner.plans import (
    memory_inputs_from_config,
    plan_overrides,
    predict_config,
    resolve_auto,
)
from holmes_jax.planner.report import format_preference, format_run_plan, format_step_check
from holmes_jax.planner.strategy import predict_diloco_config, resolve_diloco
from holmes_jax.planner.topology import Topology
from holmes_jax.runtime import compile_cache
from holmes_jax.runtime.checkpoint import Checkpointer, init_state_from
from holmes_jax.runtime.data import BatchSampler, eval_batches, load_corpus, local_rows, make_batch
from holmes_jax.runtime.devices import peak_memory_gb, peak_tflops
from holmes_jax.runtime.mesh import build_mesh, collectives_block
from holmes_jax.runtime.metrics import MetricsLogger
from holmes_jax.runtime.model import attention_kernel
from holmes_jax.runtime.nonfinite import SKIPPED, SkipGuard
from holmes_jax.runtime.profiling import StepProfiler
from holmes_jax.runtime.program import Program, compute_dtype
from holmes_jax.runtime.rundir import (
    CHECKPOINTS_NAME,
    RunDir,
    choose_run_dir,
    first_free,
    moved_line,
    outputs_line,
    sibling,
    write_config,
)

# Several processes: how long the others wait for the slowest to compile the train step
# (a dead one is named by the watchdog's heartbeats long before).
COMPILE_WAIT_S = 3600


class StopRequest:
    """Turns the first SIGTERM/SIGINT into a flag checked between steps.

    A second SIGINT falls through to Python's default (KeyboardInterrupt), so a stuck run
    can still be killed from the terminal. Handlers are only installed from the main
    thread (signal's rule), so a notebook or a worker thread simply gets no handler.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, signals: tuple[int, ...] = SIGNALS):
        self.signum: int | None = None
        self.signals = signals
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        if signum == signal.SIGINT:  # a second Ctrl-C interrupts at once
            signal.signal(signal.SIGINT, signal.default_int_handler)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A config resolved against the visible devices (:func:`resolve`).

    Attributes:
      cfg: what the run trains: outputs in the run directory, DiLoCo decided, and the
        planner's ``auto`` (schedule, split, remat) resolved for ``shape``.
      outputs: the run directory chosen (:func:`~holmes_jax.runtime.rundir.choose_run_dir`).
      devices: the devices the run sees (``jax.devices()``).
      topology: the cluster (``parallel.mesh``, without ``parallel.exclude_hosts``), or None.
      shape: the mesh degrees.
      replanned: the survivors' plan (:func:`~holmes_jax.planner.failures.replan`) when
        ``parallel.exclude_hosts`` names hosts, else None.
      asked: the config as given, outputs resolved (before the planner's choices).
      diloco_choice: :func:`~holmes_jax.planner.strategy.resolve_diloco`'s choice, or None.
      share: an independent DiLoCo island's rows of the global batch
        (:mod:`holmes_jax.diloco.scope`), else None.
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


def resolve(cfg: Config, outputs: RunDir | None = None) -> Resolved:
    """Steps 0 and 1 of :func:`run`: choose the run directory (unless ``outputs`` is given),
    then resolve the degrees and what the config leaves to the planner, on the visible
    devices, and check the plan fits in memory. Compiles nothing and writes nothing.

    Raises:
      ConfigError: settings that are impossible on the visible devices.
    """
    outputs = outputs or choose_run_dir(island_outputs(cfg))
    cfg = outputs.cfg
    share = None
    if independent(cfg):  # this island's job: replica 1, its rows of the global batch
        cfg, share = island_scope(cfg)
    devices = jax.devices()
    topology = load_mesh_topology(cfg)  # without parallel.exclude_hosts
    replanned = None
    if cfg.parallel.exclude_hosts:  # a failure's survivors: the planner's degrees for them
        full = job_topology(cfg)
        sync = collectives_block(devices)
        replanned = replan(cfg, full, cfg.parallel.exclude_hosts, sync_collectives=sync)
        cfg = replanned.cfg
    asked = cfg
    diloco, choice = resolve_diloco(cfg, topology)
    cfg = dataclasses.replace(cfg, diloco=dataclasses.replace(cfg.diloco, enabled=diloco))
    shape = resolve_shape(cfg, len(devices), topology)
    cfg = resolve_auto(cfg, shape, topology)
    check_memory(cfg, shape, topology, devices)
    return Resolved(cfg, outputs, devices, topology, shape, replanned, asked, choice, share)


def run(cfg: Config, *, stop_at_step: int | None = None) -> list[dict[str, Any]]:
    """Train according to ``cfg``; returns one record per logged step.

    Args:
      cfg: a validated config (see :func:`holmes_jax.core.config.load_config`).
      stop_at_step: stop (and checkpoint, as on SIGTERM) once this many steps are done;
        for preemption tests and notebooks. The schedule still spans ``train.steps``.

    Raises:
      ConfigError: settings that are impossible on the visible devices or data.
      NonFiniteError: more than ``train.max_skipped_steps`` non-finite steps in a row
        (:mod:`holmes_jax.runtime.nonfinite`); no checkpoint was saved after them.
    """
    # 0. outputs: the run directory, decided before anything is written
    outputs = choose_run_dir(island_outputs(cfg))
    cache = compile_cache.configure(outputs.cfg)  # before the first compile

    # 1. mesh (and the layer split, when the planner is asked for it)
    r = resolve(cfg, outputs)
    cfg, devices, topology, shape, asked = r.cfg, r.devices, r.topology, r.shape, r.asked
    mesh = build_mesh(shape, devices)
    asked_split = asked.parallel.layers_per_stage
    plan_lines, predicted_s = describe_plan(cfg, shape, topology, devices, asked_split)
    is_main = jax.process_index() == 0
    multi_process = jax.process_count() > 1
    flops = flops_per_token(cfg.model.spec, cfg.model.remat)
    peak = cfg.logging.peak_tflops or peak_tflops(devices[0].device_kind, cfg.train.precision)
    logger = MetricsLogger(
        cfg, flops=flops, num_devices=shape.num_devices, peak_tflops=peak, is_main=is_main
    )

    # 2. program (nothing compiles yet)
    program = Program(cfg, mesh)

    # 3. the checkpoint to resume from, and nothing more when it has trained every step
    # (an independent DiLoCo island with a live peer past round 0 heals from it instead)
    island = IslandSync(cfg, program, r.share, logger.message) if r.share is not None else None
    heal = island is not None and island.peer_ahead()
    ckpt = Checkpointer(cfg.checkpoint) if cfg.checkpoint.dir else None
    logical, start = None, 0
    if ckpt is not None and cfg.checkpoint.resume and not heal:
        restored = ckpt.restore(program.abstract_logical_state, cfg)
        if restored is not None:
            logical, meta = restored
            start = int(meta["data_position"])
    resumed = logical is not None
    if resumed and start >= cfg.train.steps:
        ckpt.close()
        logger.message(nothing_to_train(cfg, start))
        return []

    # 4. data and state
    corpus = load_corpus(cfg.data, cfg.model.vocab_size)
    seq, batch_size = cfg.model.seq_len, cfg.train.global_batch_size
    sampler = BatchSampler(corpus.train, seq, batch_size, cfg.train.seed)
    n_eval = cfg.train.eval_batches
    if r.share is not None:  # an island: its rows of each batch; the whole batch's eval windows
        window = (r.share.offset, r.share.rows)  # the same draws as a whole-batch run's
        sampler = BatchSampler(corpus.train, seq, r.share.total, cfg.train.seed, window=window)
        n_eval = eval_batch_count(r.share, n_eval)
    eval_set = [
        _global_batch(rows, program.batch_sharding)
        for rows in eval_batches(corpus.eval, seq, batch_size, n_eval)
    ]
    state = program.from_logical(logical) if resumed else None
    del logical
    started_from = None  # checkpoint.init_from's step directory, when the run starts there
    if state is None and cfg.checkpoint.init_from:
        state, started_from = init_state_from(program, cfg.checkpoint.init_from)
    if state is None:
        state = program.init(cfg.train.seed)
    if island is not None:  # serve the outer sync (healed: at the peer's round, compiled first)
        resumed_from = cfg.checkpoint.dir if resumed else None

        def compile_step(s):  # called only by a healing island (IslandSync.start)
            program.compile_train_step(s, make_batch(sampler, start, program.batch_sharding))

        state, start = island.start(state, start, heal, resumed_from, compile_step)

    if is_main:
        write_config(cfg)
    logger.open(start, append=outputs.continued)
    logger.message(
        f"holmes_jax: {cfg.model.spec.num_params / 1e6:.2f}M params | mesh "
        + (f"replica={shape.replica} " if shape.replica > 1 else "")
        + f"stage={shape.stages} "
        f"data={shape.data} tensor={shape.tensor} on {shape.num_devices} "
        f"{devices[0].platform} devices | {corpus.description}"
    )
    if outputs.continued:
        logger.message(f"restart: continuing the run in {cfg.train.run_dir}")
    if r.replanned is not None:
        logger.message(r.replanned.line())
    for line in (moved_line(outputs), outputs_line(cfg)):
        if line:
            logger.message(line)
    for line in plan_lines:
        logger.message(line)
    if not plan_lines and (cfg.parallel.stages > 1 or cfg.parallel.microbatches > 1):
        logger.message(
            f"pipeline: layers per stage {list(cfg.parallel.layers_per_stage)}, "
            f"{cfg.parallel.microbatches} microbatches, {cfg.parallel.schedule}"
        )
    lines = diloco_lines(cfg, program, asked.diloco.enabled, r.diloco_choice)
    for line in [island.describe()] if island is not None else lines:
        logger.message(line)
    if program.diloco:
        began = time.perf_counter()
        program.compile_outer_steps()
        logger.message(
            f"diloco: {cfg.diloco.fragments} outer-sync program(s) compiled before "
            f"training ({time.perf_counter() - began:.1f} s)"
        )
    if asked.model.remat == "auto":
        logger.message(f"remat: auto -> {cfg.model.remat} (the fastest policy that fits)")
    if resumed:
        logger.message(f"resumed from {cfg.checkpoint.dir} at step {start}")
        if cfg.checkpoint.init_from:
            logger.message(
                f"checkpoint.init_from={cfg.checkpoint.init_from} not used: the run resumes "
                "from its own checkpoints"
            )
    if started_from:
        logger.message(f"initialised from {started_from} (fresh optimizer, step 0)")

    def report_saved(wait: bool = False) -> None:
        """Name the newest checkpoint once its save has committed: a restart then finds it.
        An asynchronous save commits in the background, steps after it started."""
        saved = ckpt.committed(wait)
        if saved is not None:
            logger.message(
                f"checkpoint step {saved}: {os.path.join(cfg.checkpoint.dir, str(saved))}"
            )

    def save(step: int, state) -> None:
        guard.settle()  # never save past train.max_skipped_steps non-finite steps in a row
        report_saved(wait=True)  # a save starts after the one before it committed
        with jax.profiler.TraceAnnotation("checkpoint_save", step=step):
            ckpt.save(step, program.to_logical(state), data_position=step, config=cfg)
            if island is not None:  # independent DiLoCo: the outer state beside it
                island.save_outer(cfg.checkpoint.dir, step)
        report_saved()

    # 5. loop
    history: list[dict[str, Any]] = []
    total = cfg.train.steps
    step = start
    last_saved = start if resumed else None
    window_start, window_steps, logged_at = time.perf_counter(), 0, start
    first, compile_s = True, 0.0
    # Simulated CPU devices: wait for each step before dispatching the next. XLA:CPU's
    # in-process collectives can miss a rendezvous when two steps overlap. GPUs overlap.
    one_step_at_a_time = devices[0].platform == "cpu" and jax.local_device_count() > 1
    local_devices = jax.local_devices()  # peak memory: only this process's can be asked
    # Non-finite steps: counted on the device, read a step late, stopped past the limit.
    guard = SkipGuard(
        cfg.train.max_skipped_steps,
        logger.message,
        lambda: (last_saved, cfg.checkpoint.dir if ckpt is not None else None),
        agree=multi_process and program.diloco,  # [R] counters: each process sees its own
        outer_sync=program.diloco or island is not None,
    )
    profiler = StepProfiler(cfg, start, logger.message, topology)
    try:
        # Several processes: jax's preemption sync point (when its service runs) owns
        # SIGTERM and makes every process stop after the same step, checked every step.
        preemption = multi_process and preemption_service()
        with StopRequest((signal.SIGINT,) if preemption else StopRequest.SIGNALS) as stop:
            while step < total:
                batch = make_batch(sampler, step, program.batch_sharding)
                if first:
                    logger.message("compiling the train step ...")
                    began, hits = time.perf_counter(), compile_cache.CacheHits()
                    if multi_process:  # every process compiled before any step runs
                        program.compile_train_step(state, batch)
                        barrier("holmes_jax/train_step_compiled", COMPILE_WAIT_S)
                # The first call traces and compiles before it dispatches the step.
                with jax.profiler.StepTraceAnnotation("train_step", step_num=step + 1):
                    state, metrics = program.train_step(state, batch)
                if first:
                    compile_s = time.perf_counter() - began
                    how = hits.describe() if cache else ""
                    logger.message(f"compiled in {compile_s:.1f} s" + (f" ({how})" if how else ""))
                    logger.start_progress(step)  # the bar's rate and ETA leave the compile out
                    window_start = time.perf_counter()
                if one_step_at_a_time:
                    jax.block_until_ready(state)
                step += 1
                window_steps += 1
                metrics = guard.after_step(step, metrics, done=one_step_at_a_time)
                if island is not None:  # independent DiLoCo: the outer sync between jobs
                    with jax.profiler.TraceAnnotation("diloco_outer_sync"):
                        state, step = island.after_step(state, step)
                for fragment in program.due_fragments(step):  # DiLoCo: the outer syncs
                    with jax.profiler.TraceAnnotation("diloco_outer_sync", fragment=fragment):
                        state = program.outer_step(state, fragment, step)
                        # Wait for it: an inner step dispatched during the outer step's
                        # all-gather can miss a collective rendezvous on simulated CPU
                        # devices. One host sync per outer step is cheap next to the sync
                        # itself, and the next inner step needs the new parameters anyway.
                        jax.block_until_ready(state)
                    warm = in_warmup(step, cfg.diloco.warmup_steps)
                    kind = "averaging (warm-up)" if warm else "outer"
                    logger.message(
                        f"diloco: {kind} step of fragment {fragment}/{cfg.diloco.fragments} "
                        f"after step {step}"
                    )

                evaluate = step == total or (
                    cfg.train.eval_every and step % cfg.train.eval_every == 0
                )
                log_step = first or evaluate or step % cfg.logging.log_every == 0
                requested = stop.signum is not None
                preempted = preemption and reached_preemption_sync_point(step)
                if multi_process:  # all must stop after the same step: agree on log steps
                    requested = preempted or (log_step and any_process(requested))
                stopping = requested or (stop_at_step is not None and step >= stop_at_step)
                if log_step or stopping:
                    guard.settle()  # waits for this step, as the metrics do
                    with jax.profiler.TraceAnnotation("metrics"):
                        values = fetch_metrics(metrics)  # waits for this step
                    elapsed = (time.perf_counter() - window_start) / window_steps
                    rec = logger.record(step, values, elapsed)
                    if island is not None:
                        rec["island"] = island.name
                    if first:
                        rec["compile_s"] = compile_s
                    memory = peak_memory_gb(local_devices)
                    if memory is not None:
                        rec["peak_memory_gb"] = memory
                    if evaluate:
                        with jax.profiler.TraceAnnotation("eval", step=step):
                            params = (island or program).eval_params(state)
                            rec["eval_loss"] = _evaluate(program, params, eval_set)
                    history.append(rec)
                    logger.write(rec, advance=step - logged_at)
                    logged_at, first = step, False

                if ckpt is not None and cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                    save(step, state)
                    last_saved = step
                elif ckpt is not None:
                    report_saved()
                # Starts or stops the trace; writing it takes seconds no step took.
                window_start += profiler.after_step(step, state)
                if log_step or stopping:  # the next window starts after eval and saving
                    window_start, window_steps = time.perf_counter(), 0
                if stopping:
                    why = f"received {stop.name}" if stop.signum else f"stop_at_step={stop_at_step}"
                    if requested and not stop.signum:
                        why = "another process received a stop signal"
                    if preempted:
                        why = "a process got SIGTERM; every process agreed on this step"
                    if ckpt is not None and last_saved != step:
                        save(step, state)
                        last_saved = step
                    if ckpt is not None:
                        report_saved(wait=True)
                    where = f"; checkpoint saved in {cfg.checkpoint.dir}" if ckpt else ""
                    logger.message(f"stopping after step {step} ({why}){where}")
                    break

        # 6. final save
        guard.settle()
        if ckpt is not None and last_saved != step:
            save(step, state)
        if ckpt is not None:
            report_saved(wait=True)
    finally:
        profiler.close(step, state)  # a run stopped inside the profiled window
        if island is not None:
            island.close()
        if ckpt is not None:
            ckpt.close()
        logger.close()
    if step >= total and history:
        final = history[-1]
        logger.message(
            f"done: step {step}, loss {final['loss']:.4f}"
            + (f", eval loss {final['eval_loss']:.4f}" if "eval_loss" in final else "")
        )
    if predicted_s is not None and history:
        measured = [r["step_time_s"] for r in history if "compile_s" not in r]
        logger.message(format_step_check(predicted_s, measured))
    return history


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


def diloco_lines(cfg: Config, program: Program, asked, choice) -> list[str]:
    """What the log says about DiLoCo: nothing when it was never asked for."""
    if asked is False:
        return []
    d = cfg.diloco
    why = f" (diloco.enabled=auto: {choice.reason})" if choice is not None else ""
    if asked == "auto" and choice is None:
        why = " (diloco.enabled=auto without parallel.mesh: no topology to price, so off)"
    if not program.diloco:
        if d.enabled:
            why += f"; off: parallel.replica={program.replicas} (DiLoCo needs >= 2 replicas)"
            if choice is not None and choice.plan is not None:  # the planner's DiLoCo plan
                sets = " ".join(f"--set {o}" for o in plan_overrides(choice.plan))
                why += f"; to run the planner's DiLoCo plan: {sets}"
        return [f"diloco: off{why}"]
    return [
        f"diloco: on across {program.replicas} replicas{why}: H={d.inner_steps} inner steps, "
        f"outer lr {d.outer_lr}, Nesterov momentum {d.outer_momentum}, {d.fragments} "
        f"fragment(s), outer deltas sent as {d.outer_dtype}"
        + (f"; averaging after each of the first {d.warmup_steps} steps" if d.warmup_steps else "")
    ]


def fetch_metrics(metrics: dict[str, jax.Array]) -> dict[str, Any]:
    """Device metrics to host numbers: waits for the step. Per-replica values (DiLoCo's
    loss and grad norm, ``[R]`` sharded over ``replica``) are averaged here, on the host,
    and the skipped steps summed; with several processes they are first gathered with
    ``process_allgather`` (only on the steps that log, so the inner steps between stay free
    of cross-island traffic)."""
    out = {}
    for key, value in metrics.items():
        if not value.is_fully_addressable and not value.is_fully_replicated:
            from jax.experimental import multihost_utils

            value = multihost_utils.process_allgather(value, tiled=True)
        value = np.asarray(jax.device_get(value))
        out[key] = (value.sum() if key == SKIPPED else value.mean()) if value.ndim else value
    return out


def describe_plan(
    cfg: Config,
    shape: Degrees,
    topology: Topology | None,
    devices: list,
    asked_split: tuple[int, ...] | str | None,
) -> tuple[list[str], float | None]:
    """The plan's lines for the log and its predicted step; nothing without a topology.

    The prediction is the planner's (:func:`holmes_jax.planner.plans.predict_config`) for
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
    try:
        prediction = predict_config(cfg, topology, sync_collectives=sync)
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
    lines = format_run_plan(cfg, shape, topology, prediction, sync_collectives=sync, split=split)
    lines += format_preference(cfg, topology, prediction.step_s, sync_collectives=sync)
    if cfg.diloco.enabled is True and shape.replica > 1:
        # The plan above prices replica > 1 as hierarchical (a cross-island gradient ring
        # every step); DiLoCo's inner steps send nothing across: price those instead.
        step, inner, outer = predict_diloco_config(cfg, topology, sync_collectives=sync)
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
        x = memory_inputs_from_config(cfg, shape.data, kernel)
        check_fits(x, cfg.parallel.layers_per_stage, limit)


def _evaluate(program: Program, params, eval_set: list[jax.Array]) -> float:
    losses = [program.eval_loss(params, b) for b in eval_set]
    return float(np.mean(jax.device_get(losses)))


def _global_batch(rows: np.ndarray, sharding) -> jax.Array:
    """A global [B, T+1] array from a host copy of all rows, each process giving its own."""
    mine = local_rows(sharding, rows.shape[0])
    return jax.make_array_from_process_local_data(sharding, rows[mine], rows.shape)
