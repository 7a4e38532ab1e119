"""What the training loop decides around each step, one object per decision.

- :class:`Stepper` runs the train step. The first call compiles: announced, timed
  (``compile_s``; the line says whether the compilation cache served it), and with
  several processes every one has compiled before any step runs.
- :class:`Logbook` logs, on log steps (the first, every ``logging.log_every``, every
  evaluation, a stop): it fetches the metrics (only then does the host wait for the
  device), evaluates, and writes the record. A record's step time is its window's
  (the steps since the last record) mean, evaluation and checkpoints left out. A step the
  launcher watches (its faults': :func:`~holmes_jax.core.status.watched_steps`) is
  reported on the status channel once done, logged or not.
- :class:`Saves` checkpoints every ``checkpoint.every`` steps, at a stop and at the end,
  and names each checkpoint once its (asynchronous) save has committed.
- :class:`Stops` says when the run stops early: SIGTERM/SIGINT, ``stop_at_step``. With
  several processes all stop after the same step: SIGTERM through jax's preemption sync
  point (asked every step), SIGINT by agreeing on log steps.

Non-finite steps change no state: :class:`~holmes_jax.runtime.nonfinite.SkipGuard`
reads their counters a step late and stops the run past ``train.max_skipped_steps`` in a
row, before any save (it settles before every save and every record).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from holmes_jax.cluster.distributed import (
    any_process,
    barrier,
    preemption_service,
    reached_preemption_sync_point,
)
from holmes_jax.core import status
from holmes_jax.core.config import Config
from holmes_jax.planner.report import format_step_check
from holmes_jax.runtime.data.digest import DIGEST, combine
from holmes_jax.runtime.nonfinite import SKIPPED, SkipGuard
from holmes_jax.runtime.rundir import compile_cache
from holmes_jax.runtime.rundir.devices import peak_memory_gb

# Several processes: how long the others wait for the slowest to compile the train step
# (a dead one is named by the watchdog's heartbeats long before).
COMPILE_WAIT_S = 3600


class Stepper:
    """Runs ``program``'s train step and notes each step with ``guard`` (module doc).

    On simulated CPU devices each step is waited for before the next is dispatched:
    XLA:CPU's in-process collectives can miss a rendezvous when two steps overlap. GPUs
    overlap them.
    """

    def __init__(self, program, guard: SkipGuard, logger, cache: bool):
        self.program, self.guard, self.logger, self.cache = program, guard, logger, cache
        devices = jax.devices()
        self.wait = devices[0].platform == "cpu" and jax.local_device_count() > 1
        self.compile_s: float | None = None  # the first step's, once run
        self.began = 0.0  # when the last step was dispatched (after the compile)

    def __call__(self, state, batch, step: int) -> tuple[Any, dict]:
        """Step ``step + 1``: the new state and its metrics (device arrays)."""
        first = self.compile_s is None
        self.began = time.perf_counter()
        if first:
            self.logger.message("compiling the train step ...")
            hits = compile_cache.CacheHits()
            self.program.compile_train_step(state, batch)  # as --compile-only does
            if jax.process_count() > 1:  # every process compiled before any step runs
                barrier("holmes_jax/train_step_compiled", COMPILE_WAIT_S)
        # The first call runs the executable compiled (or loaded) above.
        with jax.profiler.StepTraceAnnotation("train_step", step_num=step + 1):
            state, metrics = self.program.train_step(state, batch)
        if first:
            self.compile_s = time.perf_counter() - self.began
            how = hits.describe() if self.cache else ""
            self.logger.message(
                f"compiled in {self.compile_s:.1f} s" + (f" ({how})" if how else "")
            )
            self.logger.report("compiled", seconds=self.compile_s, detail=how)
            self.logger.start_progress(step)  # the bar's rate and ETA leave the compile out
            self.began = time.perf_counter()
        if self.wait:
            jax.block_until_ready(state)
        return state, self.guard.after_step(step + 1, metrics, done=self.wait)


class Logbook:
    """Records log steps (module doc); ``history`` holds the records, as returned by
    :func:`holmes_jax.runtime.loop.run`."""

    def __init__(self, cfg: Config, logger, program, outer, data, stepper: Stepper, start):
        self.cfg, self.logger, self.program, self.outer = cfg, logger, program, outer
        self.data, self.stepper = data, stepper
        self.history: list[dict[str, Any]] = []
        self.window_start: float | None = None  # the window's first step's dispatch
        self.window_steps = 0
        self.logged_at, self.first = start, True
        self.local_devices = jax.local_devices()  # peak memory: only this process's
        self.watched = status.watched_steps()  # the launcher's fault steps, logged or not

    def due(self, step: int) -> bool:
        """Whether step ``step`` is logged: the first, every ``log_every``, evaluations."""
        every = self.cfg.logging.log_every
        return self.first or self.evaluates(step) or step % every == 0

    def evaluates(self, step: int) -> bool:
        t = self.cfg.train
        return step == t.steps or bool(t.eval_every and step % t.eval_every == 0)

    def after_step(self, step: int, state, metrics: dict, log: bool) -> None:
        """Note step ``step``; record it when ``log`` (:meth:`due`, or a stop)."""
        if self.window_start is None:
            self.window_start = self.stepper.began
        self.window_steps += 1
        if not log:
            if step in self.watched:  # a launcher's fault step: reported once it is done
                jax.block_until_ready(metrics)
                self.logger.report("step", step=step)
            return
        self.stepper.guard.settle()  # waits for this step, as the metrics do
        with jax.profiler.TraceAnnotation("metrics"):
            values = fetch_metrics(metrics)  # waits for this step
        elapsed = (time.perf_counter() - self.window_start) / self.window_steps
        rec = self.logger.record(step, values, elapsed)
        rec.update(self.data.report(self.window_steps))
        if self.outer.name is not None:
            rec["island"] = self.outer.name
            rec.update(self.outer.report())
        if self.first:
            rec["compile_s"] = self.stepper.compile_s
        memory = peak_memory_gb(self.local_devices)
        if memory is not None:
            rec["peak_memory_gb"] = memory
        if self.evaluates(step):
            with jax.profiler.TraceAnnotation("eval", step=step):
                rec.update(self._evaluate(state))
        self.history.append(rec)
        self.logger.write(rec, advance=step - self.logged_at)
        self.logged_at, self.first = step, False
        self.window_start, self.window_steps = None, 0  # the next starts at its first step

    def _evaluate(self, state) -> dict[str, float]:
        """``eval_loss`` (the held-out tail's, or a mixture's sources' weighted mean) and
        ``eval/<name>/loss`` of each named set."""
        params = self.outer.eval_params(state)
        losses = {
            name: evaluate(self.program, params, b) for name, b in self.data.eval_sets.items()
        }
        out = {f"eval/{name}/loss": loss for name, loss in losses.items() if name}
        if "" in losses:
            out["eval_loss"] = losses[""]
        elif self.data.weights:
            pairs = zip(self.data.names, self.data.weights, strict=True)
            out["eval_loss"] = sum(w * losses[n] for n, w in pairs)
        return out

    def leave_out(self, seconds: float) -> None:
        """Leave ``seconds`` (the profiler writing its trace) out of the window's time."""
        if self.window_start is not None:
            self.window_start += seconds

    def summary(self, step: int, predicted_s: float | None) -> None:
        """The last lines: the final loss, and the predicted against the measured step."""
        if not self.history:
            return
        if step >= self.cfg.train.steps:
            final = self.history[-1]
            self.logger.message(
                f"done: step {step}, loss {final['loss']:.4f}"
                + (f", eval loss {final['eval_loss']:.4f}" if "eval_loss" in final else "")
            )
        if predicted_s is not None:
            measured = [r["step_time_s"] for r in self.history if "compile_s" not in r]
            self.logger.message(format_step_check(predicted_s, measured))


class Saves:
    """Checkpoints into ``ckpt`` (None: none), each with ``outer``'s state beside it
    (module doc). ``settle`` runs before every save (the non-finite guard's)."""

    def __init__(
        self, cfg: Config, ckpt, program, outer, say, last_saved: int | None, settle: Callable
    ):
        self.cfg, self.ckpt, self.program, self.outer, self.say = cfg, ckpt, program, outer, say
        self.last_saved, self.settle = last_saved, settle

    def newest(self) -> tuple[int | None, str | None]:
        """The last saved step and the checkpoint directory (None: no checkpoints)."""
        return self.last_saved, (self.cfg.checkpoint.dir if self.ckpt is not None else None)

    @property
    def where(self) -> str:
        return f"; checkpoint saved in {self.cfg.checkpoint.dir}" if self.ckpt else ""

    def after_step(self, step: int, state) -> None:
        every = self.cfg.checkpoint.every
        if self.ckpt is not None and every and step % every == 0:
            self.save(step, state)
        elif self.ckpt is not None:
            self.report()

    def finish(self, step: int, state) -> None:
        """At a stop and at the end: save ``step`` unless it is, and wait for the commit."""
        if self.ckpt is not None and self.last_saved != step:
            self.save(step, state)
        if self.ckpt is not None:
            self.report(wait=True)

    def save(self, step: int, state) -> None:
        self.settle()  # never save past train.max_skipped_steps non-finite steps in a row
        self.report(wait=True)  # a save starts after the one before it committed
        with jax.profiler.TraceAnnotation("checkpoint_save", step=step):
            logical = self.program.to_logical(state)
            self.ckpt.save(step, logical, data_position=step, config=self.cfg)
            self.outer.save(self.cfg.checkpoint.dir, step)
        self.last_saved = step
        self.report()

    def report(self, wait: bool = False) -> None:
        """Name the newest checkpoint once its save has committed: a restart then finds it.
        An asynchronous save commits in the background, steps after it started."""
        saved = self.ckpt.committed(wait)
        if saved is not None:
            self.say(
                f"checkpoint step {saved}: {os.path.join(self.cfg.checkpoint.dir, str(saved))}"
            )

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()


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


class Stops:
    """Whether and why the run stops after a step (module doc); a context manager that
    holds the signal handlers."""

    def __init__(self, stop_at_step: int | None):
        self.stop_at_step = stop_at_step
        self.several = jax.process_count() > 1
        # Several processes: jax's preemption sync point (when its service runs) owns
        # SIGTERM and makes every process stop after the same step, checked every step.
        self.preemption = self.several and preemption_service()
        self.signal = StopRequest((signal.SIGINT,) if self.preemption else StopRequest.SIGNALS)

    def __enter__(self) -> Stops:
        self.signal.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.signal.__exit__(*exc)

    def reason(self, step: int, log_step: bool) -> str | None:
        """Why the run stops after step ``step`` (every process the same), or None."""
        received = self.signal.signum is not None
        preempted = self.preemption and reached_preemption_sync_point(step)
        requested = received
        if self.several:  # all must stop after the same step: agree on log steps
            requested = preempted or (log_step and any_process(received))
        if preempted:
            return "a process got SIGTERM; every process agreed on this step"
        if requested and received:
            return f"received {self.signal.name}"
        if requested:
            return "another process received a stop signal"
        if self.stop_at_step is not None and step >= self.stop_at_step:
            return f"stop_at_step={self.stop_at_step}"
        return None


def fetch_metrics(metrics: dict[str, jax.Array]) -> dict[str, Any]:
    """Device metrics to host numbers: waits for the step. Per-replica values (DiLoCo's
    loss and grad norm, ``[R]`` sharded over ``replica``) are averaged here, on the host,
    and the skipped steps summed; with several processes they are first gathered with
    ``process_allgather`` (only on the steps that log, so the inner steps between stay free
    of cross-island traffic). The batch digest comes back an int
    (:mod:`~holmes_jax.runtime.data.digest`)."""
    out = {}
    for key, value in metrics.items():
        if not value.is_fully_addressable and not value.is_fully_replicated:
            from jax.experimental import multihost_utils

            value = multihost_utils.process_allgather(value, tiled=True)
        value = np.asarray(jax.device_get(value))
        if key == DIGEST:
            out[key] = combine(value)
            continue
        out[key] = (value.sum() if key == SKIPPED else value.mean()) if value.ndim else value
    return out


def evaluate(program, params, eval_set: list[jax.Array]) -> float:
    """The mean loss of ``params`` over the evaluation batches."""
    losses = [program.eval_loss(params, b) for b in eval_set]
    return float(np.mean(jax.device_get(losses)))
