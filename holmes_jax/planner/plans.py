"""The planner's front door: a run's request in, a plan and its predicted step out.

A :class:`~holmes_jax.core.plan_request.PlanRequest` (what the caller converted its config
into) is planned on a topology (:func:`make_plan`, with the alternative splits:
:func:`alternatives`); what it leaves to the planner is resolved before the trainer
compiles (:func:`resolve_auto`: ``model.remat: auto``, ``parallel.layers_per_stage: auto``,
schedule, cross-island format), returned as a
:class:`~holmes_jax.core.plan_request.ParallelSpec`; and its step is predicted exactly as
the trainer will run it, the naive ``parallel.enforce_islands: false`` placement included
(:func:`predict_run`).
Pure Python; no jax import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from holmes_jax.core.errors import ConfigError
from holmes_jax.core.plan_request import ParallelSpec, PlanRequest, RunSpec
from holmes_jax.core.spec import (
    REMAT_POLICIES,
    SCHEDULES,
    Degrees,
    Layout,
    ModelSpec,
    even_split,
)
from holmes_jax.planner.memory import MemoryInputs
from holmes_jax.planner.placement import Calibration, naive_hardware, stage_hardware
from holmes_jax.planner.search import (
    METHODS,
    Plan,
    best_policy_plan,
    plan_for_layout,
    schedule_layouts,
    search_plans,
)
from holmes_jax.planner.stage_costs import memory_inputs, stage_costs
from holmes_jax.planner.step_time import Prediction, predict, with_lockstep
from holmes_jax.planner.topology import Topology, single_host_topology


def memory_inputs_of(req: PlanRequest, data: int) -> MemoryInputs:
    """The memory model's inputs for ``req`` at data-parallel degree ``data``.

    Raises:
      ConfigError: a global batch that does not split into the micro-batches.
    """
    par = req.parallel
    layout = par.layout(Degrees(par.stages, data, par.tensor, par.replica))
    return memory_inputs(
        req.model, req.run, layout, layout.microbatch_size(req.run.global_batch_size)
    )


def make_plan(
    req: PlanRequest,
    topology: Topology,
    method: str = "optimal",
    calibration: Calibration | None = None,
    keep_degrees: bool = False,
    *,
    sync_collectives: bool = False,
) -> Plan:
    """Plan a run on a topology: search everything, or keep the run's degrees.

    Args:
      req: the run (:func:`holmes_jax.core.plan_request.plan_request`).
      topology: the cluster.
      method: ``uniform`` | ``holmes`` | ``optimal`` split.
      calibration: device speed (e.g. from a profile).
      keep_degrees: use ``parallel.replica/stages/data/tensor/microbatches`` (``data: 0`` = the
        remaining devices) and only choose the split.
      sync_collectives: collectives block the device (CPU runtimes): the split is the one
        of :func:`lockstep_split`, and the prediction is priced as trained that way.

    Raises:
      ConfigError: impossible degrees for the topology or nothing fits in memory.
    """
    model, run, par = req.model, req.run, req.parallel
    if not keep_degrees:  # everything open: degrees, micro-batches, schedule, policy
        plan = top_plans(req, topology, 1, method, calibration)[0]
    else:
        per = par.replica * par.stages * par.tensor
        data = par.data or topology.num_devices // per
        layout = par.layout(Degrees(par.stages, data, par.tensor, par.replica))
        if par.remat == "auto":
            plan = best_policy_plan(topology, model, run, layout, method, calibration)
        else:
            plan = plan_for_layout(topology, model, run, layout, method, calibration)
    if sync_collectives:
        plan = lockstep_split(req, topology, plan, calibration)
    return with_schedules(req, topology, plan, method, calibration)


def with_schedules(
    req: PlanRequest,
    topology: Topology,
    plan: Plan,
    method: str = "optimal",
    calibration: Calibration | None = None,
) -> Plan:
    """``plan`` with every schedule priced on its degrees (``by_schedule``)."""
    by = schedule_alternatives(topology, req.model, req.run, plan, method, calibration)
    return dataclasses.replace(plan, by_schedule=by)


def top_plans(
    req: PlanRequest,
    topology: Topology,
    top: int,
    method: str = "optimal",
    calibration: Calibration | None = None,
) -> list[Plan]:
    """The ``top`` fastest predicted plans of the open search (degrees, micro-batches,
    schedule, policy), fastest first (:func:`~holmes_jax.planner.search.search_plans`).

    Raises:
      ConfigError: nothing fits in memory.
    """
    return search_plans(
        topology, req.model, req.run, method=method, schedule=req.parallel.schedule,
        calibration=calibration, remats=REMAT_POLICIES, schedules=SCHEDULES, top=top,
    )  # fmt: skip


def lockstep_split(
    req: PlanRequest, topology: Topology, plan: Plan, calibration: Calibration | None = None
) -> Plan:
    """``plan`` or another split of its placement (:func:`alternatives`), whichever is
    fastest with blocking collectives, its prediction priced as trained (:func:`as_trained`).

    The searches rank splits by the closed form, which lets a send overlap the receiver's
    work; blocking sends run the ticks in lockstep, where the closed form's best split can
    be slower than the even one (e.g. 10 layers on 4 stages of
    meshes/emu-4host-2island-slow-compute.yaml, hidden 256, 24 x 32 tokens).
    Ties keep ``plan``.
    """
    others = [p for p in alternatives(req, topology, plan, calibration).values() if p]
    priced = [as_trained(req, topology, p, calibration, sync_collectives=True) for p in others]
    best = as_trained(req, topology, plan, calibration, sync_collectives=True)
    for candidate in priced:
        if candidate.predicted_step_s < best.predicted_step_s:
            best = candidate
    return best


def plan_overrides(plan: Plan) -> list[str]:
    """The ``--set`` overrides that make the trainer run ``plan``'s degrees, schedule,
    split and remat policy (benchmarks compile and run exactly what the planner chose)."""
    values = _run_values(plan.layout, plan.layers_per_stage, plan.remat, True)
    return [f"{k}={v}" for k, v in values.items()]


def run_overrides(req: PlanRequest, topology: Topology, plan: Plan) -> list[str]:
    """The :func:`plan_overrides` that change what ``req`` runs on ``topology``.

    An override is left out when the trainer resolves the run's own value to the same
    thing (``data: 0``, ``layers_per_stage: auto``, ``model.remat: auto``); all of them are
    kept when the run's own degrees cannot run on ``topology``.
    """
    wanted = _run_values(plan.layout, plan.layers_per_stage, plan.remat, True)
    try:
        shape = req.degrees(topology.num_devices)
        own = resolve_auto(req, shape, topology)
    except ConfigError:
        return [f"{k}={v}" for k, v in wanted.items()]
    have = _run_values(own.layout(shape), own.layers_per_stage, own.remat, own.enforce_islands)
    return [f"{k}={v}" for k, v in wanted.items() if have[k] != v]


def _run_values(
    layout: Layout, layers_per_stage: Sequence[int], remat: str, islands: bool
) -> dict[str, str]:
    """The config keys (as ``--set`` writes their values) that fix what the trainer runs."""
    split = ",".join(str(n) for n in layers_per_stage)
    return {
        "parallel.enforce_islands": str(islands).lower(),
        "parallel.replica": str(layout.replica),
        "parallel.stages": str(layout.stages),
        "parallel.data": str(layout.data),
        "parallel.tensor": str(layout.tensor),
        "parallel.microbatches": str(layout.microbatches),
        "parallel.schedule": layout.schedule,
        "parallel.virtual_stages": str(layout.virtual_stages),
        "parallel.layers_per_stage": f"[{split}]",
        "model.remat": remat,
    }


def with_plan(parallel: ParallelSpec, plan: Plan) -> ParallelSpec:
    """``parallel`` set to run ``plan``: the values :func:`plan_overrides` gives on the
    command line (a plan's placement respects the islands)."""
    lay = plan.layout
    return dataclasses.replace(
        parallel,
        replica=lay.replica,
        stages=lay.stages,
        data=lay.data,
        tensor=lay.tensor,
        microbatches=lay.microbatches,
        schedule=lay.schedule,
        virtual_stages=lay.virtual_stages,
        layers_per_stage=tuple(plan.layers_per_stage),
        remat=plan.remat,
        enforce_islands=True,
    )


def platform_blocks(platform: str) -> bool:
    """Whether collectives block the devices of ``platform`` until done: ``cpu`` (the CPU
    runtimes, gloo across processes). The one rule for the trainer, which asks its first
    device (:func:`holmes_jax.runtime.engine.mesh.collectives_block`), and the planner, which
    asks the topology (:func:`topology_blocks`)."""
    return platform.lower() == "cpu"


def topology_blocks(topology: Topology) -> bool:
    """:func:`platform_blocks` for the first island's ``device_kind`` (``cpu`` names the CPU
    platform; GPU kinds such as ``H100-SXM5-80GB`` do not block)."""
    return platform_blocks(topology.islands[0].device_kind)


def as_trained(
    req: PlanRequest,
    topology: Topology,
    plan: Plan,
    calibration: Calibration | None = None,
    *,
    sync_collectives: bool | None = None,
) -> Plan:
    """``plan`` with the prediction the trainer prints when it runs it.

    That is :func:`predict_run` of :func:`with_plan`, with collectives blocking as
    ``sync_collectives`` says (None: as :func:`topology_blocks` says). Where they block,
    the pipeline's ticks run in lockstep; the searches price the closed form.
    """
    if sync_collectives is None:
        sync_collectives = topology_blocks(topology)
    planned = req.with_parallel(with_plan(req.parallel, plan))
    prediction = predict_run(planned, topology, calibration, sync_collectives=sync_collectives)
    return dataclasses.replace(plan, prediction=prediction)


def schedule_alternatives(
    topology: Topology,
    model: ModelSpec,
    run: RunSpec,
    plan: Plan,
    method: str = "optimal",
    calibration: Calibration | None = None,
) -> dict[str, dict | None]:
    """The best plan of every schedule on ``plan``'s degrees, micro-batches and activation
    policy (interleaved: the best v), as ``{schedule: {virtual_stages, layers_per_stage,
    predicted_step_s, bubble_fraction, fits_in_memory}}``; None where the schedule cannot
    run those degrees or nothing fits."""
    run = dataclasses.replace(run, remat=plan.remat)
    out: dict[str, dict | None] = {}
    for name in SCHEDULES:
        best = None
        base = dataclasses.replace(plan.layout, schedule="1f1b", virtual_stages=1)
        for layout in schedule_layouts(base, model.num_layers, (name,)):
            try:
                alt = plan_for_layout(topology, model, run, layout, method, calibration)
            except ConfigError:
                continue
            if alt.prediction.fits and (
                best is None or alt.predicted_step_s < best.predicted_step_s
            ):
                best = alt
        out[name] = (
            None
            if best is None
            else {
                "virtual_stages": best.layout.virtual_stages,
                "layers_per_stage": list(best.layers_per_stage),
                "predicted_step_s": best.predicted_step_s,
                "bubble_fraction": best.prediction.bubble_fraction,
                "fits_in_memory": best.prediction.fits,
            }
        )
    return out


def resolve_auto(req: PlanRequest, shape: Degrees, topology: Topology | None) -> ParallelSpec:
    """Resolve what the run leaves to the planner, for the trainer.

    - ``model.remat: auto``: the fastest activation policy that fits under the run's
      degrees and micro-batches (:func:`holmes_jax.planner.search.best_policy_plan`).
    - ``parallel.layers_per_stage: auto``: the optimal split under those degrees; unset
      means an even split.
    - ``parallel.schedule: auto`` and ``parallel.cross_island_dtype: auto``: the fastest
      schedule that fits, bf16 across islands where it pays (:data:`AUTO_MIN_GAIN`).

    All on the topology (one simulated host when none is named).

    Args:
      req: the run (:func:`holmes_jax.core.plan_request.plan_request`).
      shape: the resolved :class:`holmes_jax.core.spec.Degrees`.
      topology: the cluster, or None.

    Returns:
      ``req.parallel`` with a concrete ``remat``, ``layers_per_stage`` tuple, schedule and
      cross-island format (:func:`holmes_jax.core.plan_request.apply_parallel` writes it
      into a config).

    Raises:
      ConfigError: nothing fits in memory
        (see :func:`holmes_jax.planner.search.plan_for_layout`).
    """
    if req.parallel.cross_island_dtype == "auto":  # last: the rest resolved first
        rest = resolve_auto(req.with_parallel(cross_island_dtype="same"), shape, topology)
        return _resolve_cross_island_dtype(req.with_parallel(rest), topology)
    if req.parallel.schedule == "auto":
        req = req.with_parallel(_resolve_schedule(req, shape, topology))
    par = req.parallel
    lps, remat = par.layers_per_stage, par.remat
    if isinstance(lps, tuple):
        method = list(lps)
    elif lps == "auto" and shape.stages > 1:
        method = "optimal"
    else:  # unset (or one stage): an even split, one entry per virtual stage
        method = even_split(req.model.num_layers, shape.stages * par.virtual_stages)
    if remat != "auto" and not isinstance(method, str):  # nothing left to plan
        return dataclasses.replace(par, layers_per_stage=tuple(method))
    topo = topology or single_host_topology(shape.num_devices)
    layout = par.layout(shape)
    if remat == "auto":
        plan = best_policy_plan(topo, req.model, req.run, layout, method, None)
        remat = plan.remat
    else:
        plan = plan_for_layout(topo, req.model, req.run, layout, method, None)
    return dataclasses.replace(par, remat=remat, layers_per_stage=tuple(plan.layers_per_stage))


# parallel.cross_island_dtype: auto sends bf16 across islands only when that is predicted
# to shorten the step by at least this fraction; it never picks int8 or fp8 (they change
# the numerics more: asked for explicitly only).
AUTO_MIN_GAIN = 0.05


def _resolve_cross_island_dtype(req: PlanRequest, topology: Topology | None) -> ParallelSpec:
    """``req.parallel`` (everything else resolved) with ``same`` or ``bf16`` across islands."""
    pick = "same"
    if topology is not None:
        steps = {}
        for fmt in ("same", "bf16"):
            steps[fmt] = predict_run(req.with_parallel(cross_island_dtype=fmt), topology).step_s
        if steps["bf16"] <= (1 - AUTO_MIN_GAIN) * steps["same"]:
            pick = "bf16"
    return dataclasses.replace(req.parallel, cross_island_dtype=pick)


def _resolve_schedule(req: PlanRequest, shape: Degrees, topology: Topology | None) -> ParallelSpec:
    """``parallel.schedule: auto``: the fastest schedule that fits on the run's degrees
    and micro-batches (:func:`schedule_alternatives`: its v and exact split come with it).
    One stage has no pipeline: gpipe (the plain micro-batched step)."""
    par = req.parallel
    if shape.stages == 1:
        return dataclasses.replace(par, schedule="gpipe")
    base = req.with_parallel(schedule="1f1b")
    if par.remat == "auto":  # the policy first, under 1F1B
        policy = resolve_auto(base.with_parallel(layers_per_stage=None), shape, topology)
        base = base.with_parallel(policy)
    topo = topology or single_host_topology(shape.num_devices)
    layout = base.parallel.layout(shape)
    plan = plan_for_layout(topo, base.model, base.run, layout, "optimal", None)
    options = schedule_alternatives(topo, base.model, base.run, plan)
    fits = {k: v for k, v in options.items() if v is not None and v["fits_in_memory"]}
    if not fits:
        raise ConfigError(
            f"parallel.schedule='auto': no schedule fits in device memory on degrees "
            f"{shape} with {par.microbatches} micro-batches"
        )
    name = min(fits, key=lambda k: fits[k]["predicted_step_s"])
    best = fits[name]
    return dataclasses.replace(
        base.parallel,
        schedule=name,
        virtual_stages=best["virtual_stages"],
        layers_per_stage=tuple(best["layers_per_stage"]),
    )


def predict_run(
    req: PlanRequest,
    topology: Topology,
    calibration: Calibration | None = None,
    *,
    sync_collectives: bool = False,
) -> Prediction:
    """The predicted step of ``req`` on ``topology``, as the trainer will run it.

    The trainer's degrees (:meth:`~holmes_jax.core.plan_request.PlanRequest.degrees` on the
    topology's devices: ``data: 0`` = the remaining ones), micro-batches and schedule; its
    split and activation policy (:func:`resolve_auto`: ``layers_per_stage`` given, ``auto``
    or even; ``model.remat`` given or ``auto``); ``optimizer.zero1``; and its placement:
    ``parallel.enforce_islands: true`` the island-respecting one
    (:func:`holmes_jax.planner.placement.stage_hardware`), false the naive one
    (:func:`holmes_jax.planner.placement.naive_hardware`).

    Args:
      req: the run (:func:`holmes_jax.core.plan_request.plan_request`).
      topology: the cluster (links possibly replaced by a profile).
      calibration: device speed (e.g. from a profile).
      sync_collectives: collectives block the device (CPU runtimes such as gloo; see
        :class:`holmes_jax.core.plan_request.RunSpec`): the reductions are priced that way,
        and the pipeline by running the schedule's ticks in lockstep
        (:func:`holmes_jax.planner.step_time.lockstep_pipeline`) instead of the closed form
        the split searches use.

    Raises:
      ConfigError: degrees that do not fit the topology or its placement rules (the naive
        placement: more than one stage or replica), a batch the degrees do not divide, or
        nothing that fits in memory where the planner must choose.
    """
    shape = req.degrees(topology.num_devices)
    req = req.with_parallel(resolve_auto(req, shape, topology))
    par = req.parallel
    run = dataclasses.replace(req.run, sync_collectives=sync_collectives)
    layout = par.layout(shape)
    place = stage_hardware if par.enforce_islands else naive_hardware
    hardware = place(topology, layout, calibration, run.memory_fraction)
    costs = stage_costs(req.model, run, layout, hardware)
    prediction = predict(costs, par.layers_per_stage)
    if sync_collectives:  # the tick loop runs in lockstep (step_time.lockstep_pipeline)
        prediction = with_lockstep(prediction, costs)
    return prediction


def alternatives(
    req: PlanRequest, topology: Topology, plan: Plan, calibration: Calibration | None = None
) -> dict[str, Plan | None]:
    """The uniform, holmes and optimal splits of the plan's placement and activation
    policy (None: no fit)."""
    run = dataclasses.replace(req.run, remat=plan.remat)
    out: dict[str, Plan | None] = {}
    for method in METHODS:
        try:
            out[method] = plan_for_layout(
                topology, req.model, run, plan.layout, method, calibration
            )
        except ConfigError:
            out[method] = None
    return out
