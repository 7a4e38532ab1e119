"""The cross-island outer step behind one interface, whatever the mode.

Three modes, one class each, chosen by :func:`outer_steps`:

- :class:`Alone`: no DiLoCo (one job, gradients cross islands every step);
- :class:`OneProgram`: ``diloco.mode: spmd``, the islands are replicas of one program and
  the outer step is a collective inside it (:mod:`holmes_jax.diloco.outer_step`);
- :class:`OwnJob`: ``diloco.mode: independent``, this island's job syncs with its peers'
  over HTTP (:class:`~holmes_jax.diloco.islands.IslandSync`).

The training loop calls, in this order:

- ``heals()``: whether the island takes a live peer's state instead of its checkpoint;
- ``start(state, step, heal, resumed_from, compile_step)`` -> ``(state, step)``;
- ``lines()``: what the log says about the mode before training; ``prepare()``;
- ``after_step(state, step)`` -> ``(state, step)`` after every inner step (the outer
  step when one is due; an island may move the step on to its peers' round);
- ``eval_params(state)``: the parameters evaluation runs on;
- ``save(directory, step)`` beside each checkpoint; ``close()`` at the end.

``name`` is the island a record names (None outside independent islands); ``syncs``
whether a replica's skipped steps matter to an outer step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax

from holmes_jax.core.config import Config
from holmes_jax.diloco.islands import IslandSync
from holmes_jax.diloco.schedule import in_warmup
from holmes_jax.planner.plans import plan_overrides


class Alone:
    """No outer step: ``program`` trains the whole model every step."""

    name: str | None = None
    syncs = False

    def __init__(self, cfg: Config, program, say: Callable[[str], None], asked, choice):
        self.cfg, self.program, self.say = cfg, program, say
        self.asked, self.choice = asked, choice

    def heals(self) -> bool:
        return False

    def start(self, state, step: int, heal: bool, resumed_from, compile_step) -> tuple[Any, int]:
        return state, step

    def lines(self) -> list[str]:
        """What the log says about DiLoCo: nothing when it was never asked for."""
        return diloco_lines(self.cfg, self.program, self.asked, self.choice)

    def prepare(self) -> None:
        pass

    def after_step(self, state, step: int) -> tuple[Any, int]:
        return state, step

    def eval_params(self, state):
        return self.program.eval_params(state)

    def save(self, directory: str, step: int) -> None:
        pass

    def report(self) -> dict[str, int]:
        """Metrics of the outer sync for a record (none here)."""
        return {}

    def close(self) -> None:
        pass


class OneProgram(Alone):
    """``diloco.mode: spmd``: the outer step of each fragment due, inside the program."""

    syncs = True

    def prepare(self) -> None:
        began = time.perf_counter()
        self.program.compile_outer_steps()
        self.say(
            f"diloco: {self.cfg.diloco.fragments} outer-sync program(s) compiled before "
            f"training ({time.perf_counter() - began:.1f} s)"
        )

    def after_step(self, state, step: int) -> tuple[Any, int]:
        d = self.cfg.diloco
        for fragment in self.program.due_fragments(step):
            with jax.profiler.TraceAnnotation("diloco_outer_sync", fragment=fragment):
                state = self.program.outer_step(state, fragment, step)
                # Wait for it: an inner step dispatched during the outer step's all-gather
                # can miss a collective rendezvous on simulated CPU devices. One host sync
                # per outer step is cheap next to the sync itself, and the next inner step
                # needs the new parameters anyway.
                jax.block_until_ready(state)
            kind = "averaging (warm-up)" if in_warmup(step, d.warmup_steps) else "outer"
            self.say(f"diloco: {kind} step of fragment {fragment}/{d.fragments} after step {step}")
        return state, step


class OwnJob:
    """``diloco.mode: independent``: :class:`~holmes_jax.diloco.islands.IslandSync` with
    the interface of the module doc."""

    syncs = True

    def __init__(self, island: IslandSync):
        self.island = island
        self.name: str | None = island.name

    def heals(self) -> bool:
        return self.island.peer_ahead()

    def start(self, state, step: int, heal: bool, resumed_from, compile_step) -> tuple[Any, int]:
        return self.island.start(state, step, heal, resumed_from, compile_step)

    def lines(self) -> list[str]:
        return [self.island.describe()]

    def prepare(self) -> None:
        pass

    def after_step(self, state, step: int) -> tuple[Any, int]:
        with jax.profiler.TraceAnnotation("diloco_outer_sync"):
            return self.island.after_step(state, step)

    def eval_params(self, state):
        return self.island.eval_params(state)

    def save(self, directory: str, step: int) -> None:
        self.island.save_outer(directory, step)

    def report(self) -> dict[str, int]:
        return self.island.report()

    def close(self) -> None:
        self.island.close()


def outer_steps(cfg: Config, program, share, say, asked=False, choice=None):
    """The mode's object: :class:`OwnJob` for an independent island (``share``, its rows
    of the global batch), :class:`OneProgram` when ``program`` runs DiLoCo, else
    :class:`Alone`. ``asked`` is ``diloco.enabled`` as given, ``choice`` the planner's
    (:func:`~holmes_jax.planner.strategy.resolve_diloco`), for the log's lines."""
    if share is not None:
        return OwnJob(IslandSync(cfg, program, share, say))
    mode = OneProgram if program.diloco else Alone
    return mode(cfg, program, say, asked, choice)


def diloco_lines(cfg: Config, program, asked, choice) -> list[str]:
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
