"""A seeded random fault schedule, as ``launch`` flags (``bench_faults --schedule random``).

:func:`draw` places faults along a run of ``steps`` steps with gaps drawn from an
exponential distribution of mean ``mtbf_steps`` (rounded, at least one step), so a run sees
``steps / mtbf_steps`` faults on average, and gives each a kind and a host:

- ``kill``: the host's worker gets SIGKILL and comes back at once (``HOST@STEP``);
- ``away``: the host is lost and back ``away_s`` later (``HOST@STEP:+SECONDS``): longer than
  ``--rejoin-timeout``, the survivors re-plan without it, then every host starts again;
- ``checkpoint``: a kill right at a checkpoint step (the next multiple of
  ``checkpoint.every``), while the save may still be in flight;
- ``cut``: every link between islands is dropped for ``cut_s`` (``--cut-islands
  STEP:+SECONDS``); at most one per schedule, since the launcher takes one cut.

The same ``(seed, steps, mtbf_steps, hosts, every)`` give the same schedule on any machine
(:class:`random.Random`, no global state). Plain Python; no jax import.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from holmes_jax.core.errors import ConfigError

KINDS = ("kill", "away", "checkpoint", "cut")


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` (:data:`KINDS`) at ``step``; ``host`` (None for a cut) and the
    seconds it lasts (``away`` and ``cut``; 0 otherwise)."""

    kind: str
    step: int
    host: str | None
    seconds: float = 0.0

    def flags(self) -> list[str]:
        """The ``launch`` flags that inject it."""
        if self.kind == "cut":
            return ["--cut-islands", f"{self.step}:+{self.seconds:g}"]
        tail = f":+{self.seconds:g}" if self.kind == "away" else ""
        return ["--fail-host", f"{self.host}@{self.step}{tail}"]

    def to_dict(self) -> dict:
        return {"kind": self.kind, "step": self.step, "host": self.host, "seconds": self.seconds}


def draw(
    seed: int,
    steps: int,
    mtbf_steps: float,
    hosts: Sequence[str],
    every: int,
    *,
    away_s: float,
    cut_s: float,
    kinds: Sequence[str] = KINDS,
) -> list[Fault]:
    """The faults of one run, in step order, each at a distinct step in ``[1, steps)``
    (module doc).

    Args:
      seed: the schedule's seed.
      steps: the run's ``train.steps``.
      mtbf_steps: the mean steps between faults.
      hosts: the hosts a fault may strike.
      every: ``checkpoint.every`` (where a ``checkpoint`` fault lands).
      away_s: how long an ``away`` host stays away.
      cut_s: how long a ``cut`` lasts.
      kinds: the kinds to draw from, with equal chances.

    Raises:
      ConfigError: ``mtbf_steps`` not > 0, no hosts, ``every`` < 1, or an unknown kind.
    """
    if not mtbf_steps > 0 or math.isinf(mtbf_steps):
        raise ConfigError(f"--mtbf-steps={mtbf_steps}: must be a number of steps > 0")
    if not hosts:
        raise ConfigError("fault schedule: no hosts to strike")
    if every < 1:
        raise ConfigError(f"checkpoint.every={every}: must be >= 1 for a checkpoint fault")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ConfigError(f"fault kinds {list(kinds)}: each must be one of {', '.join(KINDS)}")
    rng = random.Random(seed)
    out: list[Fault] = []
    step, left = 0, list(kinds)
    while True:
        step += max(1, round(rng.expovariate(1.0 / mtbf_steps)))
        kind, host = rng.choice(left), rng.choice(list(hosts))
        at = math.ceil(step / every) * every if kind == "checkpoint" else step
        if out and at <= out[-1].step:  # a checkpoint fault rounded onto the last one
            at = out[-1].step + 1
        if at >= steps:
            return out
        if kind == "cut":
            out.append(Fault("cut", at, None, cut_s))
            left = [k for k in left if k != "cut"] or ["kill"]
        else:
            out.append(Fault(kind, at, host, away_s if kind == "away" else 0.0))
        step = at


def flags(faults: Sequence[Fault]) -> list[str]:
    """Every fault's ``launch`` flags, in step order."""
    return [f for fault in faults for f in fault.flags()]
