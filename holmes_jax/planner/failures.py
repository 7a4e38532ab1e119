"""Plans for the survivors of a failure: the topology without some hosts, planned again.

:func:`replan` is what the trainer runs when ``parallel.exclude_hosts`` names hosts (the
launcher sets it when a host does not come back): the planner searches degrees,
micro-batches, schedule, split and activation policy for the hosts that are left, with
the run's global batch, so the optimisation is the same and only its speed changes.
:func:`failure_plans` does the same ahead of time for the loss of one host of each island
and of each whole island (``python -m holmes_jax.plan --failures``); hosts of one island
are interchangeable, so one search covers them all. Both compare the survivors' step with
:func:`full_step`, the run as written on the whole topology (what the job runs once
every host is back). The survivors' decision comes back as a
:class:`~holmes_jax.core.plan_request.ParallelSpec` (:attr:`Replan.parallel`), which the
trainer applies to its config.

With ``parallel.replan_candidates`` K > 1 the search keeps its K fastest predicted plans
(:attr:`Replan.candidates`, ranked by the step as the trainer runs it); the trainer runs a
few steps of each and trains on the fastest measured
(:mod:`holmes_jax.runtime.replan_trial`). Pure Python; no jax import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from holmes_jax.core.errors import ConfigError
from holmes_jax.core.plan_request import ParallelSpec, PlanRequest
from holmes_jax.planner.placement import Calibration
from holmes_jax.planner.plans import (
    as_trained,
    plan_overrides,
    predict_run,
    top_plans,
    topology_blocks,
    with_plan,
    with_schedules,
)
from holmes_jax.planner.search import Plan
from holmes_jax.planner.topology import Topology, without_hosts

EXCLUDE_KEY = "parallel.exclude_hosts"


@dataclass(frozen=True)
class Candidate:
    """One plan for the survivors: the parallelism that runs it, the plan and its step
    predicted as the trainer runs it."""

    parallel: ParallelSpec
    plan: Plan
    step_s: float

    def describe(self) -> str:
        """Its degrees, micro-batches, schedule and remat, in a few words."""
        lay = self.plan.layout
        replica = f"replica={lay.replica} " if lay.replica > 1 else ""
        schedule = f" {lay.schedule}" if lay.stages > 1 else ""
        return (
            f"{replica}stage={lay.stages} data={lay.data} tensor={lay.tensor} "
            f"m={lay.microbatches}{schedule} remat {self.plan.remat}"
        )


@dataclass(frozen=True)
class Replan:
    """The survivors' run: who is gone, their topology, the parallelism set to their plan."""

    excluded: tuple[str, ...]
    topology: Topology  # the survivors
    # The survivors' degrees, pipeline, split and remat (parallel.devices 0,
    # parallel.exclude_hosts the lost hosts): apply_parallel sets a config to run it.
    parallel: ParallelSpec
    plan: Plan
    step_s: float  # predicted, as the trainer runs it
    full_step_s: float | None  # the run on the whole topology; None: not priceable
    # the K fastest predicted plans, fastest first; the first is the one above
    candidates: tuple[Candidate, ...] = ()

    def choose(self, index: int) -> Replan:
        """This re-plan with candidate ``index`` as its plan."""
        c = self.candidates[index]
        return dataclasses.replace(self, parallel=c.parallel, plan=c.plan, step_s=c.step_s)

    def spread(self) -> float | None:
        """How much slower the second candidate is predicted than the first (0.05: 5%);
        None with one candidate."""
        if len(self.candidates) < 2:
            return None
        return self.candidates[1].step_s / self.candidates[0].step_s - 1

    def line(self) -> str:
        """One line: what was re-planned and the predicted step."""
        lay = self.plan.layout
        replica = f"replica={lay.replica} " if lay.replica > 1 else ""
        schedule = f", {lay.schedule}" if lay.stages > 1 else ""
        relative = ""
        if self.full_step_s:
            relative = f", {self.step_s / self.full_step_s:.2f}x the full topology's"
        return (
            f"re-planned for the survivors without {', '.join(self.excluded)} "
            f"({_count(self.topology.num_hosts, 'host')}, "
            f"{_count(self.topology.num_devices, 'device')}): "
            f"{replica}stage={lay.stages} data={lay.data} tensor={lay.tensor}, "
            f"{_count(lay.microbatches, 'micro-batch', 'es')}{schedule}, remat {self.plan.remat}; "
            f"predicted step {self.step_s:.3g} s{relative}"
        )


def _count(n: int, noun: str, plural: str = "s") -> str:
    return f"{n} {noun}{plural * (n != 1)}"


def replan(
    req: PlanRequest,
    topology: Topology,
    excluded: Sequence[str],
    calibration: Calibration | None = None,
    *,
    sync_collectives: bool | None = None,
) -> Replan:
    """Plan ``req`` on ``topology`` without the hosts ``excluded``.

    Args:
      req: the run (its degrees are replaced; its global batch is kept;
        ``parallel.replan_candidates`` plans are kept, module doc).
      topology: the whole cluster (``parallel.mesh``).
      excluded: host names to leave out.
      calibration: device speed (e.g. from a profile).
      sync_collectives: collectives block the devices (CPU runtimes); None: as the
        topology's device kind says (:func:`holmes_jax.planner.plans.topology_blocks`).

    Raises:
      ConfigError: an unknown host, no host left, or no plan of the survivors that fits
        in memory and divides the global batch.
    """
    if sync_collectives is None:
        sync_collectives = topology_blocks(topology)
    excluded = tuple(excluded)
    survivors = without_hosts(topology, excluded, key=EXCLUDE_KEY)
    # Degrees that the planner chooses, not the ones written for the whole topology.
    base = req.with_parallel(devices=0, exclude_hosts=excluded)
    try:
        top = req.parallel.replan_candidates
        searched = top_plans(base, survivors, top, calibration=calibration)
    except ConfigError as e:
        raise ConfigError(
            f"{EXCLUDE_KEY}={list(excluded)}: no plan for the survivors ({e})"
        ) from None
    # Each plan priced as the trainer runs it (plan.predicted_step_s is step_s), fastest first.
    priced = [
        as_trained(base, survivors, p, calibration, sync_collectives=sync_collectives)
        for p in searched
    ]
    priced.sort(key=lambda p: p.predicted_step_s)
    priced[0] = with_schedules(base, survivors, priced[0], calibration=calibration)
    candidates = tuple(
        Candidate(with_plan(base.parallel, p), p, p.predicted_step_s) for p in priced
    )
    try:
        full_s = full_step(req, topology, calibration, sync_collectives=sync_collectives)
    except ConfigError:
        full_s = None
    first = candidates[0]
    return Replan(excluded, survivors, first.parallel, first.plan, first.step_s, full_s, candidates)


def full_step(
    req: PlanRequest,
    topology: Topology,
    calibration: Calibration | None = None,
    *,
    sync_collectives: bool | None = None,
) -> float:
    """The predicted step of ``req`` as written (its own degrees) on the whole ``topology``:
    what the job runs once every host is back, the step the survivors' is compared with.

    Raises:
      ConfigError: the run's degrees do not run on ``topology`` or do not fit.
    """
    if sync_collectives is None:
        sync_collectives = topology_blocks(topology)
    full = req.with_parallel(exclude_hosts=())
    return predict_run(full, topology, calibration, sync_collectives=sync_collectives).step_s


@dataclass(frozen=True)
class FailurePlan:
    """The plan after one failure: ``what`` is ``host`` (any one host of ``island``) or
    ``island`` (all of its hosts)."""

    what: str
    island: str
    excluded: tuple[str, ...]
    survivors: Topology
    replan: Replan | None  # None: the survivors cannot run the job
    why: str = ""

    def to_dict(self) -> dict:
        out = {
            "lost": self.what,
            "island": self.island,
            "excluded": list(self.excluded),
            "hosts": self.survivors.num_hosts,
            "devices": self.survivors.num_devices,
        }
        if self.replan is None:
            return {**out, "plan": None, "why": self.why}
        r = self.replan
        return {
            **out,
            "plan": r.plan.to_dict(),
            "predicted_step_s": r.step_s,
            "relative_step": r.step_s / r.full_step_s if r.full_step_s else None,
            "candidates": [
                {"plan": c.plan.to_dict(), "predicted_step_s": c.step_s} for c in r.candidates
            ],
            "overrides": survivor_overrides(r),
        }


def failure_plans(
    req: PlanRequest,
    topology: Topology,
    calibration: Calibration | None = None,
    *,
    sync_collectives: bool | None = None,
) -> list[FailurePlan]:
    """The survivors' plan for the loss of one host of each island (its first: the
    hosts of an island plan alike) and of each whole island, in topology order."""
    out = []
    for what, island, gone in failure_cases(topology):
        survivors = without_hosts(topology, gone, key=EXCLUDE_KEY)
        try:
            r = replan(req, topology, gone, calibration, sync_collectives=sync_collectives)
            out.append(FailurePlan(what, island, gone, survivors, r))
        except ConfigError as e:
            out.append(FailurePlan(what, island, gone, survivors, None, str(e)))
    return out


def failure_cases(
    topology: Topology, every_host: bool = False
) -> list[tuple[str, str, tuple[str, ...]]]:
    """``(what, island, lost hosts)`` of each failure that leaves survivors, in topology
    order: one host of each island of several (``host``; its first, or each with
    ``every_host``: the plans are alike, the programs differ by device) and each whole
    island when there are several (``island``)."""
    out = []
    for isl in topology.islands:
        if isl.num_hosts > 1:  # else losing its host is losing the island
            out += [("host", isl.name, (h,)) for h in isl.hosts[: None if every_host else 1]]
        if len(topology.islands) > 1:  # else nothing would be left
            out.append(("island", isl.name, tuple(isl.hosts)))
    return out


def survivor_overrides(r: Replan) -> list[str]:
    """The ``--set`` overrides that run the survivors' plan by hand."""
    return [f"{EXCLUDE_KEY}=[{','.join(r.excluded)}]", *plan_overrides(r.plan)]
