"""Failures measured before training (``launch --warm-failures``).

Before the first step, the survivors of each failure the planner lists
(:func:`~holmes_jax.planner.failures.failure_cases`: each host, each whole island) run
``train --compile-only --measure``: their candidate plans' train steps are compiled into
the compilation cache and timed, a few steps each on zeros, as a re-plan's trial times
them (:mod:`holmes_jax.runtime.replan_trial`). Process 0 reports the times (a ``measured``
status event) and :class:`Measured` keeps them, by the hosts left out.

A restart on survivors that were measured then:

- leaves out the rest of a damaged island too when the survivors of that whole island's
  loss measured faster (:meth:`Measured.widen`): the re-plan is never slower than
  dropping the island, and the hosts that sit out start again with the lost one;
- hands the times to the trainer (:meth:`Measured.env`,
  :data:`~holmes_jax.runtime.replan_trial.MEASURED_VAR`), which trains the fastest
  candidate without a trial of its own.

The times are those of the hosts before training, not at the failure: a host that slowed
down since is not seen. Without ``--warm-failures`` a restart tries its candidates itself.
"""

from __future__ import annotations

import json

from holmes_jax.planner.topology import Topology

# holmes_jax.runtime.replan_trial.MEASURED_VAR (not imported: the launcher runs no jax)
MEASURED_VAR = "HOLMES_MEASURED_PLANS"


class Measured:
    """The candidate plans' step times of each failure's survivors, by the hosts left out."""

    def __init__(self, topology: Topology):
        self.topology = topology
        self.times: dict[frozenset[str], dict] = {}  # left out -> {"plans": [...], "step_s": [...]}

    def record(self, excluded: tuple[str, ...], event: dict) -> None:
        """Keep a ``measured`` status event (checked by the status channel) of the
        survivors without ``excluded``."""
        self.times[frozenset(excluded)] = {"plans": event["plans"], "step_s": event["step_s"]}

    def best(self, excluded) -> float | None:
        """The fastest measured step of the survivors without ``excluded``, or None."""
        got = self.times.get(frozenset(excluded))
        return min(got["step_s"]) if got else None

    def env(self, excluded: tuple[str, ...]) -> dict[str, str]:
        """The environment that gives a restart without ``excluded`` its measured times."""
        got = self.times.get(frozenset(excluded))
        return {MEASURED_VAR: json.dumps(got)} if got else {}

    def widen(self, excluded: tuple[str, ...]) -> tuple[tuple[str, ...], str | None]:
        """The hosts a restart leaves out when ``excluded`` are away: their whole island
        when ``excluded`` lie in one island, leave others there, and the survivors of that
        island's loss measured faster than the survivors of ``excluded``'s; else
        ``excluded``. The line says why, or is None."""
        islands = [i for i in self.topology.islands if set(excluded) & set(i.hosts)]
        if len(islands) != 1 or set(islands[0].hosts) <= set(excluded):
            return excluded, None
        island = islands[0]
        without = self.best(excluded)
        dropped = self.best(island.hosts)
        if without is None or dropped is None or not dropped < without:
            return excluded, None
        rest = [h for h in island.hosts if h not in excluded]
        line = (
            f"measured before training: without {', '.join(excluded)} the fastest plan steps "
            f"{without:.3g} s, without island {island.name} {dropped:.3g} s: "
            f"{', '.join(rest)} {'sits' if len(rest) == 1 else 'sit'} out too, until "
            f"{'it is' if len(excluded) == 1 else 'they are'} back"
        )
        return tuple(island.hosts), line  # in topology order, as the warm-up left them out
