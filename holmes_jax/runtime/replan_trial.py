"""The survivors' candidate plans, tried: a re-plan that checks its cost model.

When a restart re-plans for the survivors (``parallel.exclude_hosts``) and the planner
kept K > 1 candidates (``parallel.replan_candidates``,
:attr:`~holmes_jax.planner.failures.Replan.candidates`), :func:`choose` builds each
candidate's program, runs :data:`TRIAL_STEPS` train steps of it on a state of zeros and a
batch of zeros of the run's shape, and keeps the candidate whose step measured fastest
(:func:`fastest`). A step's time does not depend on the values it computes, and training's
own state is restored afterwards as it would be without a trial, so the trial changes
which plan trains, never what it trains. Each candidate's train step is compiled (loaded
from the compilation cache when warm) before its steps; the first step is not timed, the
fastest of the others counts, and a candidate stops as soon as a timed step shows it
:data:`GIVE_UP` times slower than the best before it. Every process measures; a step's
time is the slowest process's, so every process chooses the same. The winner's program
keeps its compiled step, so training does not compile it again.

One line reports each candidate's predicted and measured step, the choice, and where the
trial's seconds went (process 0's: building programs, making states, compiling, stepping).

:func:`compile_ahead` (``train --compile-only``, which ``launch --warm-failures`` runs
for the survivors of each failure) compiles the train step of each candidate, or of the run
itself, into the compilation cache and trains nothing, so a restart and its trial load
their programs rather than compile them. With ``--measure`` it also runs the trial and
keeps its times in the cache (:mod:`holmes_jax.runtime.rundir.measured`); a restart on
those survivors then trains the fastest measured candidate without a trial.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from holmes_jax.cluster.distributed import every_process
from holmes_jax.core import status
from holmes_jax.runtime.data.loader import global_array, local_rows
from holmes_jax.runtime.rundir import compile_cache, measured

TRIAL_STEPS = 3  # per candidate at most: the first is not timed, the fastest of the others counts
GIVE_UP = 1.5  # a candidate whose timed step is this many times the best so far stops there


def fastest(predicted: Sequence[float], measure: Callable[[int, float], float]) -> tuple[int, list]:
    """The index of the candidate that measures fastest and every measured step, each
    candidate measured once, in order (``measure(i, bound)`` -> seconds; it may stop once
    its step is over ``bound``, :data:`GIVE_UP` times the fastest before it). Ties keep the
    earlier candidate: the one predicted faster."""
    times: list[float] = []
    for i in range(len(predicted)):
        times.append(measure(i, min(times, default=float("inf")) * GIVE_UP))
    return min(range(len(times)), key=lambda i: (times[i], i)), times


@dataclasses.dataclass
class Tried:
    """One candidate's trial: its step (the slowest process's, the fastest timed one),
    the steps run, its train step's cache events, and this process's seconds building its
    program, making its state, compiling (or loading) its train step and stepping."""

    step_s: float = float("inf")
    steps: int = 0
    hits: int = 0  # its train step's compiles the compilation cache served, and asked
    asked: int = 0
    build_s: float = 0.0
    state_s: float = 0.0
    compile_s: float = 0.0
    steps_s: float = 0.0

    def parts(self) -> str:
        return (
            f"build {self.build_s:.1f}, state {self.state_s:.1f}, "
            f"compile {self.compile_s:.1f}, steps {self.steps_s:.1f}"
        )


def choose(cfg, outputs, r, resolve, make_program, cache=None, say=print):
    """``(resolved, program)``: the candidate that trains, its ``trial`` the line that
    reports the trial, and its program (None when it was measured ahead: the caller builds
    it); ``(r, None)`` when there is nothing to try.

    Args:
      cfg: the config as given to the run.
      outputs: the run directory (:func:`~holmes_jax.runtime.setup.resolve`'s).
      r: the resolved run, candidate 0.
      resolve: ``resolve(cfg, outputs, candidate=i)``.
      make_program: ``make_program(resolved)`` -> its :class:`~holmes_jax.runtime.program.
        Program` (nothing compiled).
      cache: the compilation cache directory, where these survivors' times may have been
        kept (:mod:`holmes_jax.runtime.rundir.measured`).
      say: where the lines of measured files ignored go.
    """
    replanned = r.replanned
    if replanned is None or len(replanned.candidates) < 2:
        return r, None
    candidates = replanned.candidates
    case, ignored = measured.load(cache, cfg)
    for line in ignored:
        say(line)
    ahead, problem = measured_ahead(case, [c.describe() for c in candidates])
    best = -1 if ahead is None else min(range(len(ahead)), key=lambda i: (ahead[i], i))
    if len(set(every_process(best))) > 1:  # a cache not shared alike: measure here, together
        ahead, problem = None, "the processes found different measured times: "
    if ahead is not None:
        run = r if best == 0 else resolve(cfg, outputs, candidate=best)
        line = (
            f"re-plan: {len(candidates)} candidates as measured before training (launch "
            f"--warm-failures): {_results(candidates, ahead)} -> candidate {best + 1} trains"
        )
        return dataclasses.replace(run, trial=line), None
    runs = [r] + [resolve(cfg, outputs, candidate=i) for i in range(1, len(candidates))]
    best, programs, line, _ = trial(runs, candidates, make_program)
    return dataclasses.replace(runs[best], trial=problem + line), programs[best]


def trial(runs, candidates, make_program) -> tuple[int, list, str, list[float]]:
    """Each of ``runs`` (the resolved candidates) built and stepped (:func:`step_seconds`)
    in order, each stopping once :data:`GIVE_UP` times the fastest before it: ``(best,
    programs, line, times)``, the line reporting the trial and each candidate's step."""
    programs: list = []
    tried: list[Tried] = []

    def measure(i: int, bound: float) -> float:
        began = time.perf_counter()
        program = make_program(runs[i])
        programs.append(program)
        built = time.perf_counter() - began
        one = step_seconds(program, runs[i], bound)
        one.build_s = built
        tried.append(one)
        return one.step_s

    began = time.perf_counter()
    best, times = fastest([c.step_s for c in candidates], measure)
    total = Tried(
        build_s=sum(t.build_s for t in tried),
        state_s=sum(t.state_s for t in tried),
        compile_s=sum(t.compile_s for t in tried),
        steps_s=sum(t.steps_s for t in tried),
    )
    served = compile_cache.describe(sum(t.hits for t in tried), sum(t.asked for t in tried))
    how = f", {served}" if served else ""
    line = (
        f"re-plan trial of {len(runs)} candidates (up to {TRIAL_STEPS} steps each{how}; "
        f"{time.perf_counter() - began:.1f} s: {total.parts()}): "
        + _results(candidates, times, [t.steps for t in tried])
        + f" -> candidate {best + 1} trains"
    )
    return best, programs, line, times


def _results(candidates, times, steps=None) -> str:
    """``1. <plan>: predicted X s, measured Y s; 2. ...`` (and where a trial stopped early)."""
    return "; ".join(
        f"{i + 1}. {c.describe()}: predicted {c.step_s:.3g} s, measured {m:.3g} s"
        + ("" if steps is None or steps[i] == TRIAL_STEPS else f" (stopped after {steps[i]} steps)")
        for i, (c, m) in enumerate(zip(candidates, times, strict=True))
    )


def measured_ahead(case: dict | None, plans: list[str]) -> tuple[list[float] | None, str]:
    """``(step seconds of each plan, "")`` from a measured ``case``
    (:func:`holmes_jax.runtime.rundir.measured.load`) that timed exactly ``plans``, in order;
    else ``(None, why)``, ``why`` empty without a case, else a clause for the trial's line."""
    if case is None:
        return None, ""
    if case["plans"] != plans:
        return None, "the plans measured before training are not these candidates: "
    return [float(t) for t in case["step_s"]], ""


def step_seconds(program, r, bound: float = float("inf")) -> Tried:
    """:data:`TRIAL_STEPS` train steps of ``program`` on a state and a batch of zeros, or
    fewer: it stops after a timed step once the fastest timed one is over ``bound``. The
    first step is not timed (it runs the freshly loaded executable); each timed step counts
    as the slowest process's, so every process stops alike. Nothing is kept."""
    out = Tried()
    rows = _rows(r)
    sharding = program.shardings.batch
    mine = local_rows(sharding, rows)
    zeros = np.zeros((len(mine), r.cfg.model.seq_len + 1), np.int32)
    batch = global_array(zeros, sharding, rows)
    began = time.perf_counter()
    state = jax.block_until_ready(_zeros(program))
    out.state_s, began = time.perf_counter() - began, time.perf_counter()
    hits = compile_cache.CacheHits()
    program.compile_train_step(state, batch)
    out.hits, out.asked = hits.hits, hits.requests
    out.compile_s, began = time.perf_counter() - began, time.perf_counter()
    for n in range(TRIAL_STEPS):
        start = time.perf_counter()
        state, metrics = program.train_step(state, batch)  # state donated: a new one each
        jax.block_until_ready((state, metrics))
        out.steps = n + 1
        if n:
            out.step_s = min(out.step_s, _slowest_process([time.perf_counter() - start])[0])
            if out.step_s > bound:
                break
    out.steps_s = time.perf_counter() - began
    del state, metrics
    return out


def _rows(r) -> int:
    """The rows of one step's batch of resolved run ``r``: an independent island's share,
    else the global batch."""
    return r.share.rows if r.share is not None else r.cfg.train.global_batch_size


def _zeros(program):
    """A state of zeros in ``program``'s layout: the values do not change a step's time, and
    zeros compile in a moment where the model's initialiser does not."""
    shapes = program.abstract_state
    shardings = jax.tree.map(lambda a: a.sharding, shapes)
    make = jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes),
                   out_shardings=shardings)  # fmt: skip
    return make()


def _slowest_process(local: list[float]) -> list[float]:
    """Each candidate's slowest time over the processes (the same on every process)."""
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils

    every = multihost_utils.process_allgather(np.asarray(local, np.float64))  # [P, K]
    return [float(x) for x in np.asarray(every).reshape(-1, len(local)).max(axis=0)]


def compile_ahead(cfg, outputs, resolve, make_program, say, measure: bool = False) -> int:
    """``train --compile-only``: the train step and checkpoint layout conversions of every
    candidate plan (or of the run) compiled into the compilation cache; nothing trained,
    nothing written but the cache.
    With ``measure`` (``--measure``, a failure's survivors only) each candidate is also
    timed as a re-plan's trial times it (:func:`trial`); process 0 keeps the times in the
    cache for a restart on these survivors (:mod:`holmes_jax.runtime.rundir.measured`)
    and reports them to the launcher (a ``measured`` status event). Returns the exit
    code: 2 (one line) without a cache directory to fill, or when ``measure`` has no
    candidates to time."""
    directory = compile_cache.configure(outputs.cfg)
    if directory is None:
        say(
            "error: --compile-only: no compilation cache to fill (set "
            "train.compilation_cache to a path)"
        )
        return 2
    r = resolve(cfg, outputs)
    if measure:
        if r.replanned is None:
            say(
                "error: --measure: times the candidate plans of a failure's survivors; "
                "parallel.exclude_hosts is empty"
            )
            return 2
        candidates = r.replanned.candidates
        runs = [r] + [resolve(cfg, outputs, candidate=i) for i in range(1, len(candidates))]
        _, programs, line, times = trial(runs, candidates, make_program)
        for program in programs:
            program.compile_layout_conversions()  # a restart's from_logical, a save's to_logical
        say(f"--compile-only --measure: {line}")
        if jax.process_index() == 0:
            plans = [c.describe() for c in candidates]
            measured.save(directory, cfg, plans, times)
            excluded = list(cfg.parallel.exclude_hosts)
            status.report("measured", excluded=excluded, plans=plans, step_s=times)
        return 0
    count = len(r.replanned.candidates) if r.replanned is not None else 1
    for i in range(count):
        run = r if i == 0 else resolve(cfg, outputs, candidate=i)
        program = make_program(run)
        batch = jax.ShapeDtypeStruct(
            (_rows(run), run.cfg.model.seq_len + 1), np.int32, sharding=program.shardings.batch
        )
        began = time.perf_counter()
        hits = compile_cache.CacheHits()
        program.compile_train_step(program.abstract_state, batch)
        program.compile_layout_conversions()  # a restart's from_logical, a save's to_logical
        how = hits.describe() or "compiled"
        which = f"candidate {i + 1} of {count}" if r.replanned is not None else "the train step"
        say(f"--compile-only: {which}: {time.perf_counter() - began:.1f} s ({how}) in {directory}")
    return 0
