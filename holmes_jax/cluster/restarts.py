"""Where a restart's seconds go: its phases, from the fault to the next completed step.

The supervisor marks the end of each phase on its own clock (``time.monotonic()`` of the
launcher; a worker's events are marked as they arrive on its status channel,
:mod:`holmes_jax.core.status`):

========== ==============================================================================
phase      ends when
========== ==============================================================================
detect     the launcher sees the failure (0 for a failure it noticed itself; from the
           SIGKILL of an injected fault)
stop       every process of the failed attempt has exited
wait       the hosts away are back, or ``--rejoin-timeout`` passed (re-plan)
start      the next attempt's processes are started
init       process 0 runs ``main`` (Python and holmes_jax imported)
join       it has joined ``jax.distributed`` (jax imported, the coordinator reached)
restore    its state is ready: plan, program, checkpoint or heal (``resumed``)
compile    the first train step is compiled or loaded (``compiled``)
first_step the first step is done (``step``)
========== ==============================================================================

A phase whose mark never came (an event not sent) counts as 0 and its time goes to the
next one, so the phases always add up to ``total_s``. One JSON line per restart goes to
``<run_dir>/restarts.jsonl`` (:meth:`RestartClock.record`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

PHASES = (
    "detect", "stop", "wait", "start", "init", "join", "restore", "compile", "first_step",
)  # fmt: skip
RECORDS = "restarts.jsonl"


@dataclass
class RestartClock:
    """One restart's marks (module doc): ``fault`` when it began, then each phase's end."""

    number: int  # the restart's count (re-expansions count as 0: they are no failure)
    cause: str  # "failure" or "re-expansion"
    failed_step: int  # the last step reported before it
    fault: float  # when it began
    marks: dict[str, float] = field(default_factory=dict)
    resumed_from: int = 0
    compile: str = ""  # the compile event's detail: cache hits or misses

    def mark(self, phase: str, at: float | None = None) -> None:
        """Phase ``phase`` ended ``at`` (now); a later mark of it is ignored."""
        if phase not in PHASES:
            raise ValueError(f"restart phase {phase!r}: one of {PHASES}")
        self.marks.setdefault(phase, time.monotonic() if at is None else at)

    def phases(self) -> dict[str, float]:
        """Each phase's seconds (module doc); they add up to :meth:`total`."""
        out, last = {}, self.fault
        for phase in PHASES:
            at = self.marks.get(phase)
            out[phase] = 0.0 if at is None else max(0.0, at - last)
            last = last if at is None else max(last, at)
        return out

    def total(self) -> float:
        return sum(self.phases().values())

    def record(self, step: int) -> dict:
        """The JSON record: the restart, its cause, the steps lost and every phase."""
        lost = max(0, self.failed_step - self.resumed_from)
        return {
            "restart": self.number,
            "cause": self.cause,
            "failed_step": self.failed_step,
            "resumed_from": self.resumed_from,
            "first_step": step,
            "steps_lost": lost,
            "total_s": round(self.total(), 3),
            **{f"{p}_s": round(s, 3) for p, s in self.phases().items()},
            "compile": self.compile,
        }

    def line(self) -> str:
        """The phases in one line, the ones that took time: ``detect 0.1 s, stop 1.0 s, …``."""
        parts = [f"{p.replace('_', ' ')} {s:.1f} s" for p, s in self.phases().items() if s >= 0.05]
        return ", ".join(parts) or "no phase took 0.1 s"

    def write(self, run_dir: str | None, step: int) -> None:
        """Append :meth:`record` to ``<run_dir>/restarts.jsonl`` (one line, written whole)."""
        if not run_dir or not os.path.isdir(run_dir):
            return
        with open(os.path.join(run_dir, RECORDS), "a", encoding="utf-8") as f:
            f.write(json.dumps(self.record(step)) + "\n")


def resumed_line(clock: RestartClock, step: int) -> str:
    """The launcher's line for a restart's first step: the seconds since the fault, where
    it resumed, the steps lost, the compile, and the phases (:meth:`RestartClock.line`)."""
    rec = clock.record(step)
    lost, start = rec["steps_lost"], clock.resumed_from
    where = f"from checkpoint step {start}" if start else "from step 0 (no checkpoint)"
    why = "re-expansion (every host"
    if clock.cause == "failure":
        why = f"failure (restart {clock.number}"
    compiled = f"; {clock.compile}" if clock.compile else ""
    return (
        f"training resumed: step {step} done {clock.total():.1f} s after the {why} {where}, "
        f"{lost} step{'s' * (lost != 1)} lost{compiled}): {clock.line()}"
    )
