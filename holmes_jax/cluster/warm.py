"""Failures measured before training (``launch --warm-failures``), and what a restart
does with them.

Before the first step, the survivors of each failure the planner lists
(:func:`~holmes_jax.planner.failures.failure_cases`: each host, each whole island) run
``train --compile-only --measure``: their candidate plans' train steps are compiled into
the compilation cache and timed, a few steps each on zeros, as a re-plan's trial times
them (:mod:`holmes_jax.runtime.replan_trial`). The times are kept in the cache
(:mod:`holmes_jax.runtime.rundir.measured`), so a restart on those survivors trains the
fastest measured candidate without a trial of its own, in this launch or a later one
with the same cache.

Process 0 reports each case to the launcher (a ``measured`` status event: when it is
timed, and from the full job at its start, for every case the cache holds), and
:class:`Measured` keeps them. A restart whose lost hosts lie in one island leaves that
island's other hosts out too when the survivors of the whole island's loss measured
faster (:meth:`Measured.widen`): the re-plan is never slower than dropping the island,
and the hosts that sit out start again with the lost ones.

The times are the hosts' before training, not at the failure: a host that slowed down
since is not seen. Without them a restart tries its candidates itself.
"""

from __future__ import annotations

from holmes_jax.planner.topology import Topology


class Measured:
    """The candidate plans' step times of each failure's survivors, by the hosts left out."""

    def __init__(self, topology: Topology):
        self.topology = topology
        self.times: dict[frozenset[str], list[float]] = {}  # lost hosts -> each plan's step

    def record(self, event: dict) -> None:
        """Keep a ``measured`` status event (checked by the status channel)."""
        self.times[frozenset(event["excluded"])] = list(event["step_s"])

    def best(self, excluded) -> float | None:
        """The fastest measured step of the survivors without ``excluded``, or None."""
        got = self.times.get(frozenset(excluded))
        return min(got) if got else None

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
