"""The training loop: data → sharded step → metrics, eval, checkpoints, clean stops.

:func:`run` reads top to bottom: set up (:mod:`holmes_jax.runtime.setup`), restore, the
step loop, finish. Around each step every decision belongs to one object with one call:
the non-finite guard and the first compile (:class:`~holmes_jax.runtime.each_step.
Stepper`), the cross-island outer step, whatever the mode (:mod:`holmes_jax.diloco.modes`),
the stop every process agrees on (``Stops``), the log and the evaluation (``Logbook``),
the checkpoint (``Saves``) and the profiler's window
(:class:`~holmes_jax.runtime.rundir.profiling.StepProfiler`). The step, evaluation, checkpoint
saves, DiLoCo outer syncs and metric fetches are annotated for the trace viewer.

``run`` returns the history: one dict per logged step (the same records as the JSON lines).
"""

from __future__ import annotations

from typing import Any

import jax

from holmes_jax.core.config import Config
from holmes_jax.diloco.modes import outer_steps
from holmes_jax.diloco.scope import island_outputs
from holmes_jax.runtime import replan_trial
from holmes_jax.runtime.each_step import Logbook, Saves, Stepper, Stops
from holmes_jax.runtime.engine.mesh import build_mesh
from holmes_jax.runtime.nonfinite import SkipGuard
from holmes_jax.runtime.program import Program
from holmes_jax.runtime.rundir import compile_cache, measured
from holmes_jax.runtime.rundir.checkpoint import Checkpointer
from holmes_jax.runtime.rundir.paths import choose_run_dir, write_config
from holmes_jax.runtime.rundir.profiling import StepProfiler
from holmes_jax.runtime.setup import (
    Data,
    announce,
    describe_plan,
    initial_state,
    make_logger,
    nothing_to_train,
    resolve,
    restore,
)


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
    # 1. the run directory (before anything is written), the compilation cache (before the
    # first compile), the degrees and the planner's choices, the plan's prediction
    outputs = choose_run_dir(island_outputs(cfg))
    cache = compile_cache.configure(outputs.cfg)
    r = resolve(cfg, outputs)
    # a failure's survivors: their candidate plans tried (or measured before training), the
    # fastest measured kept; the full job tells the launcher which failures were measured
    r, program = replan_trial.choose(cfg, outputs, r, resolve, program_of, cache, _on_process_0)
    if not cfg.parallel.exclude_hosts and jax.process_index() == 0:
        for line in measured.report_all(cache, cfg):
            _on_process_0(line)
    cfg, asked = r.cfg, r.asked
    plan_lines, predicted_s = describe_plan(
        cfg, r.shape, r.topology, r.devices, asked.parallel.layers_per_stage
    )
    logger = make_logger(cfg, r)
    if program is None:  # nothing compiles yet
        program = program_of(r)
    outer = outer_steps(
        cfg, program, r.share, logger.message, asked.diloco.enabled, r.diloco_choice
    )

    # 2. the checkpoint to resume from, and nothing more when it has trained every step (an
    # independent island with a live peer past round 0 heals from the peer instead)
    heal = outer.heals()
    ckpt = Checkpointer(cfg.checkpoint) if cfg.checkpoint.dir else None
    logical, start = restore(ckpt, program, cfg) if not heal else (None, 0)
    resumed = logical is not None
    if resumed and start >= cfg.train.steps:
        ckpt.close()
        logger.message(nothing_to_train(cfg, start))
        return []
    data = Data(cfg, program, r.share)
    state, started_from = initial_state(program, cfg, logical)
    del logical
    compile_step = lambda s: program.compile_train_step(s, data.batch(start))  # noqa: E731
    resumed_from = cfg.checkpoint.dir if resumed else None
    state, start = outer.start(state, start, heal, resumed_from, compile_step)
    if jax.process_index() == 0:
        write_config(cfg)
    logger.open(start, append=outputs.continued)
    announce(logger, r, data, plan_lines, outer.lines(), resumed, start, started_from)
    outer.prepare()

    # 3. the loop
    several = jax.process_count() > 1  # a DiLoCo program's [R] counters differ by process
    guard = SkipGuard(
        cfg.train.max_skipped_steps, logger.message, lambda: saves.newest(),
        agree=several and program.diloco, outer_sync=outer.syncs,
    )  # fmt: skip
    last_saved = start if resumed else None
    # The guard settles before every save: never past train.max_skipped_steps in a row.
    saves = Saves(cfg, ckpt, program, outer, logger.message, last_saved, guard.settle)
    stepper = Stepper(program, guard, logger, cache)
    book = Logbook(cfg, logger, program, outer, data, stepper, start)
    profiler = StepProfiler(cfg, start, logger.message, r.topology)
    step = start
    try:
        with Stops(stop_at_step) as stops:
            while step < cfg.train.steps:
                state, metrics = stepper(state, data.batch(step), step)
                state, step = outer.after_step(state, step + 1)
                logged = book.due(step)
                why = stops.reason(step, logged)
                book.after_step(step, state, metrics, logged or why is not None)
                saves.after_step(step, state)
                book.leave_out(profiler.after_step(step, state))  # writing a trace takes s
                if why is not None:
                    saves.finish(step, state)
                    logger.message(f"stopping after step {step} ({why}){saves.where}")
                    break

        # 4. the end: the last step saved, the outer sync and the profiler closed
        guard.settle()
        saves.finish(step, state)
    finally:
        profiler.close(step, state)  # a run stopped inside the profiled window
        data.feed.close()
        outer.close()
        saves.close()
        logger.close()
    book.summary(step, predicted_s)
    return book.history


def _on_process_0(line: str) -> None:
    """A line before the logger exists, from process 0 alone."""
    if jax.process_index() == 0:
        print(line, flush=True)


def program_of(r) -> Program:
    """The program of a resolved run (:func:`~holmes_jax.runtime.setup.resolve`)."""
    return Program(r.cfg, build_mesh(r.shape, r.devices))
