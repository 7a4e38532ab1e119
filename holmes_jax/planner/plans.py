"""The planner's front door: a run config in, the cost model's specs and a plan out.

One home for turning a :class:`holmes_jax.core.config.Config` into what the cost model
prices (:func:`specs_from_config`, :func:`memory_inputs_from_config`), for planning it on a
topology (:func:`make_plan`, with the alternative splits: :func:`alternatives`), for
resolving what the config leaves to the planner before the trainer compiles
(:func:`resolve_auto`: ``model.remat: auto``, ``parallel.layers_per_stage: auto``) and for
predicting the step of the config exactly as the trainer will run it, the naive
``parallel.enforce_islands: false`` placement included (:func:`predict_config`).
Pure Python; no jax import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from holmes_jax.core.config import Config, check_devices
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import REMAT_POLICIES, SCHEDULES, Degrees, Layout, ModelSpec
from holmes_jax.planner.memory import MemoryInputs
from holmes_jax.planner.placement import Calibration, naive_hardware, stage_hardware
from holmes_jax.planner.search import (
    METHODS,
    Plan,
    best_policy_plan,
    plan_for_layout,
    schedule_layouts,
    search_plan,
)
from holmes_jax.planner.stage_costs import RunSpec, memory_inputs, stage_costs
from holmes_jax.planner.step_time import Prediction, predict, with_lockstep
from holmes_jax.planner.topology import Topology, single_host_topology

_BYTES = {"fp32": (4, 4, 4, 8), "bf16": (2, 2, 4, 12)}  # act, param, grad, optimizer


def specs_from_config(cfg: Config, attention: str = "xla") -> tuple[ModelSpec, RunSpec]:
    """The cost model's view of a :class:`holmes_jax.core.config.Config`.

    Precision sets the byte sizes (fp32: 4-byte everything, Adam m and v; bf16: 2-byte
    weights and activations, fp32 gradients, fp32 master + Adam); ``model.remat`` is the
    activation policy (``auto``: priced as none, the planner searches);
    ``optimizer.zero1`` shards the optimizer state over ``data``; ``parallel.grad_buckets``
    goes as it is (``auto`` resolves with ``sync_collectives``). ``attention`` is the
    resolved kernel (:func:`holmes_jax.runtime.model.attention_kernel`).
    """
    m = cfg.model
    model = m.spec
    act, param, grad, opt = _BYTES.get(getattr(cfg.train, "precision", "fp32"), _BYTES["fp32"])
    run = RunSpec(
        cfg.train.global_batch_size,
        act,
        param,
        grad,
        opt,
        remat=m.remat if m.remat != "auto" else "none",  # auto: the planner searches
        attention=attention,
        zero1=cfg.optimizer.zero1,
        grad_buckets=cfg.parallel.grad_buckets,
        # auto prices as same (the exact base resolve_auto compares the formats against)
        cross_island_dtype=cfg.parallel.cross_island_dtype.replace("auto", "same"),
    )
    return model, run


def memory_inputs_from_config(cfg: Config, data: int, attention: str = "xla") -> MemoryInputs:
    """The memory model's inputs for ``cfg`` at data-parallel degree ``data``.

    Raises:
      ConfigError: a global batch that does not split into the micro-batches.
    """
    model, run = specs_from_config(cfg, attention)
    layout = cfg.parallel.layout(
        Degrees(cfg.parallel.stages, data, cfg.parallel.tensor, cfg.parallel.replica)
    )
    return memory_inputs(model, run, layout, layout.microbatch_size(run.global_batch_size))


def make_plan(
    cfg: Config,
    topology: Topology,
    method: str = "optimal",
    calibration: Calibration | None = None,
    keep_degrees: bool = False,
    *,
    sync_collectives: bool = False,
) -> Plan:
    """Plan a config on a topology: search everything, or keep the config's degrees.

    Args:
      cfg: a :class:`holmes_jax.core.config.Config`.
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
    model, run = specs_from_config(cfg)
    par = cfg.parallel
    if not keep_degrees:  # everything open: degrees, micro-batches, schedule, policy
        plan = search_plan(
            topology,
            model,
            run,
            method=method,
            schedule=par.schedule,
            calibration=calibration,
            remats=REMAT_POLICIES,
            schedules=SCHEDULES,
        )
    else:
        per = par.replica * par.stages * par.tensor
        data = par.data or topology.num_devices // per
        layout = par.layout(Degrees(par.stages, data, par.tensor, par.replica))
        if cfg.model.remat == "auto":
            plan = best_policy_plan(topology, model, run, layout, method, calibration)
        else:
            plan = plan_for_layout(topology, model, run, layout, method, calibration)
    if sync_collectives:
        plan = lockstep_split(cfg, topology, plan, calibration)
    by = schedule_alternatives(topology, model, run, plan, method, calibration)
    return dataclasses.replace(plan, by_schedule=by)


def lockstep_split(
    cfg: Config, topology: Topology, plan: Plan, calibration: Calibration | None = None
) -> Plan:
    """``plan`` or another split of its placement (:func:`alternatives`), whichever is
    fastest with blocking collectives, its prediction priced as trained (:func:`as_trained`).

    The searches rank splits by the closed form, which lets a send overlap the receiver's
    work; blocking sends run the ticks in lockstep, where the closed form's best split can
    be slower than the even one (e.g. 10 layers on 4 stages of
    meshes/emu-4host-2island-slow-compute.yaml, hidden 256, 24 x 32 tokens).
    Ties keep ``plan``.
    """
    others = [p for p in alternatives(cfg, topology, plan, calibration).values() if p]
    priced = [as_trained(cfg, topology, p, calibration, sync_collectives=True) for p in others]
    best = as_trained(cfg, topology, plan, calibration, sync_collectives=True)
    for candidate in priced:
        if candidate.predicted_step_s < best.predicted_step_s:
            best = candidate
    return best


def plan_overrides(plan: Plan) -> list[str]:
    """The ``--set`` overrides that make the trainer run ``plan``'s degrees, schedule,
    split and remat policy (benchmarks compile and run exactly what the planner chose)."""
    values = _run_values(plan.layout, plan.layers_per_stage, plan.remat, True)
    return [f"{k}={v}" for k, v in values.items()]


def run_overrides(cfg: Config, topology: Topology, plan: Plan) -> list[str]:
    """The :func:`plan_overrides` that change what ``cfg`` runs on ``topology``.

    An override is left out when the trainer resolves the config's own value to the same
    thing (``data: 0``, ``layers_per_stage: auto``, ``model.remat: auto``); all of them are
    kept when the config's own degrees cannot run on ``topology``.
    """
    wanted = _run_values(plan.layout, plan.layers_per_stage, plan.remat, True)
    try:
        shape = check_devices(cfg, topology.num_devices)
        own = resolve_auto(cfg, shape, topology)
    except ConfigError:
        return [f"{k}={v}" for k, v in wanted.items()]
    par = own.parallel
    have = _run_values(
        par.layout(shape), par.layers_per_stage, own.model.remat, par.enforce_islands
    )
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


def plan_config(cfg: Config, plan: Plan) -> Config:
    """``cfg`` set to run ``plan``: the values :func:`plan_overrides` gives on the command
    line (a plan's placement respects the islands)."""
    lay = plan.layout
    par = dataclasses.replace(
        cfg.parallel,
        replica=lay.replica,
        stages=lay.stages,
        data=lay.data,
        tensor=lay.tensor,
        microbatches=lay.microbatches,
        schedule=lay.schedule,
        virtual_stages=lay.virtual_stages,
        layers_per_stage=tuple(plan.layers_per_stage),
        enforce_islands=True,
    )
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, remat=plan.remat), parallel=par
    )


def platform_blocks(platform: str) -> bool:
    """Whether collectives block the devices of ``platform`` until done: ``cpu`` (the CPU
    runtimes, gloo across processes). The one rule for the trainer, which asks its first
    device (:func:`holmes_jax.runtime.mesh.collectives_block`), and the planner, which
    asks the topology (:func:`topology_blocks`)."""
    return platform.lower() == "cpu"


def topology_blocks(topology: Topology) -> bool:
    """:func:`platform_blocks` for the first island's ``device_kind`` (``cpu`` names the CPU
    platform; GPU kinds such as ``H100-SXM5-80GB`` do not block)."""
    return platform_blocks(topology.islands[0].device_kind)


def as_trained(
    cfg: Config,
    topology: Topology,
    plan: Plan,
    calibration: Calibration | None = None,
    *,
    sync_collectives: bool | None = None,
) -> Plan:
    """``plan`` with the prediction the trainer prints when it runs it.

    That is :func:`predict_config` of :func:`plan_config`, with collectives blocking as
    ``sync_collectives`` says (None: as :func:`topology_blocks` says). Where they block,
    the pipeline's ticks run in lockstep; the searches price the closed form.
    """
    if sync_collectives is None:
        sync_collectives = topology_blocks(topology)
    prediction = predict_config(
        plan_config(cfg, plan), topology, calibration, sync_collectives=sync_collectives
    )
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


def resolve_auto(cfg: Config, shape: Degrees, topology: Topology | None) -> Config:
    """Resolve what the config leaves to the planner, for the trainer.

    - ``model.remat: auto``: the fastest activation policy that fits under the config's
      degrees and micro-batches (:func:`holmes_jax.planner.search.best_policy_plan`).
    - ``parallel.layers_per_stage: auto``: the optimal split under those degrees; unset
      means an even split.

    Both on the topology (one simulated host when none is named).

    Args:
      cfg: a :class:`holmes_jax.core.config.Config`.
      shape: the resolved :class:`holmes_jax.core.spec.Degrees`.
      topology: the cluster, or None.

    Returns:
      ``cfg`` with a concrete ``model.remat`` and ``parallel.layers_per_stage`` tuple.

    Raises:
      ConfigError: nothing fits in memory
        (see :func:`holmes_jax.planner.search.plan_for_layout`).
    """
    if cfg.parallel.cross_island_dtype == "auto":  # last: the rest resolved first
        cfg = resolve_auto(
            dataclasses.replace(
                cfg, parallel=dataclasses.replace(cfg.parallel, cross_island_dtype="same")
            ),
            shape,
            topology,
        )
        return _resolve_cross_island_dtype(cfg, topology)
    par = cfg.parallel
    if par.schedule == "auto":
        cfg = _resolve_schedule(cfg, shape, topology)
        par = cfg.parallel
    lps, remat = par.layers_per_stage, cfg.model.remat
    L, S = cfg.model.num_layers, shape.stages
    if isinstance(lps, tuple):
        method = list(lps)
    elif lps == "auto" and S > 1:
        method = "optimal"
    else:  # unset (or one stage): an even split, one entry per virtual stage
        parts = S * par.virtual_stages
        base, extra = divmod(L, parts)
        method = [base + (s < extra) for s in range(parts)]
    if remat != "auto" and not isinstance(method, str):  # nothing left to plan
        return dataclasses.replace(
            cfg, parallel=dataclasses.replace(par, layers_per_stage=tuple(method))
        )
    model, run = specs_from_config(cfg)
    topo = topology or single_host_topology(shape.num_devices)
    layout = par.layout(shape)
    if remat == "auto":
        plan = best_policy_plan(topo, model, run, layout, method, None)
        remat = plan.remat
    else:
        plan = plan_for_layout(topo, model, run, layout, method, None)
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, remat=remat),
        parallel=dataclasses.replace(par, layers_per_stage=tuple(plan.layers_per_stage)),
    )


# parallel.cross_island_dtype: auto sends bf16 across islands only when that is predicted
# to shorten the step by at least this fraction; it never picks int8 or fp8 (they change
# the numerics more: asked for explicitly only).
AUTO_MIN_GAIN = 0.05


def _resolve_cross_island_dtype(cfg: Config, topology: Topology | None) -> Config:
    """``cfg`` (everything else resolved) with ``same`` or ``bf16`` across islands."""
    pick = "same"
    if topology is not None:
        steps = {}
        for fmt in ("same", "bf16"):
            par = dataclasses.replace(cfg.parallel, cross_island_dtype=fmt)
            steps[fmt] = predict_config(dataclasses.replace(cfg, parallel=par), topology).step_s
        if steps["bf16"] <= (1 - AUTO_MIN_GAIN) * steps["same"]:
            pick = "bf16"
    return dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, cross_island_dtype=pick)
    )


def _resolve_schedule(cfg: Config, shape: Degrees, topology: Topology | None) -> Config:
    """``parallel.schedule: auto``: the fastest schedule that fits on the config's degrees
    and micro-batches (:func:`schedule_alternatives`: its v and exact split come with it).
    One stage has no pipeline: gpipe (the plain micro-batched step)."""
    par = cfg.parallel
    if shape.stages == 1:
        return dataclasses.replace(cfg, parallel=dataclasses.replace(par, schedule="gpipe"))
    base = dataclasses.replace(cfg, parallel=dataclasses.replace(par, schedule="1f1b"))
    if cfg.model.remat == "auto":  # the policy first, under 1F1B
        base = resolve_auto(
            dataclasses.replace(
                base, parallel=dataclasses.replace(base.parallel, layers_per_stage=None)
            ),
            shape,
            topology,
        )
    model, run = specs_from_config(base)
    topo = topology or single_host_topology(shape.num_devices)
    plan = plan_for_layout(topo, model, run, base.parallel.layout(shape), "optimal", None)
    options = schedule_alternatives(topo, model, run, plan)
    fits = {k: v for k, v in options.items() if v is not None and v["fits_in_memory"]}
    if not fits:
        raise ConfigError(
            f"parallel.schedule='auto': no schedule fits in device memory on degrees "
            f"{shape} with {par.microbatches} micro-batches"
        )
    name = min(fits, key=lambda k: fits[k]["predicted_step_s"])
    best = fits[name]
    return dataclasses.replace(
        base,
        parallel=dataclasses.replace(
            base.parallel,
            schedule=name,
            virtual_stages=best["virtual_stages"],
            layers_per_stage=tuple(best["layers_per_stage"]),
        ),
    )


def predict_config(
    cfg: Config,
    topology: Topology,
    calibration: Calibration | None = None,
    *,
    sync_collectives: bool = False,
) -> Prediction:
    """The predicted step of ``cfg`` on ``topology``, as the trainer will run it.

    The trainer's degrees (:func:`holmes_jax.core.config.check_devices` on the topology's
    devices: ``data: 0`` = the remaining ones), micro-batches and schedule; its split and
    activation policy (:func:`resolve_auto`: ``layers_per_stage`` given, ``auto`` or even;
    ``model.remat`` given or ``auto``); ``optimizer.zero1``; and its placement:
    ``parallel.enforce_islands: true`` the island-respecting one
    (:func:`holmes_jax.planner.placement.stage_hardware`), false the naive one
    (:func:`holmes_jax.planner.placement.naive_hardware`).

    Args:
      cfg: a :class:`holmes_jax.core.config.Config`.
      topology: the cluster (links possibly replaced by a profile).
      calibration: device speed (e.g. from a profile).
      sync_collectives: collectives block the device (CPU runtimes such as gloo; see
        :class:`holmes_jax.planner.stage_costs.RunSpec`): the reductions are priced that way, and
        the pipeline by running the schedule's ticks in lockstep
        (:func:`holmes_jax.planner.step_time.lockstep_pipeline`) instead of the closed form
        the split searches use.

    Raises:
      ConfigError: degrees that do not fit the topology or its placement rules (the naive
        placement: more than one stage or replica), a batch the degrees do not divide, or
        nothing that fits in memory where the planner must choose.
    """
    shape = check_devices(cfg, topology.num_devices)
    cfg = resolve_auto(cfg, shape, topology)
    model, run = specs_from_config(cfg)
    run = dataclasses.replace(run, sync_collectives=sync_collectives)
    layout = cfg.parallel.layout(shape)
    place = stage_hardware if cfg.parallel.enforce_islands else naive_hardware
    hardware = place(topology, layout, calibration, run.memory_fraction)
    costs = stage_costs(model, run, layout, hardware)
    prediction = predict(costs, cfg.parallel.layers_per_stage)
    if sync_collectives:  # the tick loop runs in lockstep (step_time.lockstep_pipeline)
        prediction = with_lockstep(prediction, costs)
    return prediction


def alternatives(
    cfg: Config, topology: Topology, plan: Plan, calibration: Calibration | None = None
) -> dict[str, Plan | None]:
    """The uniform, holmes and optimal splits of the plan's placement and activation
    policy (None: no fit)."""
    model, run = specs_from_config(cfg)
    run = dataclasses.replace(run, remat=plan.remat)
    out: dict[str, Plan | None] = {}
    for method in METHODS:
        try:
            out[method] = plan_for_layout(topology, model, run, plan.layout, method, calibration)
        except ConfigError:
            out[method] = None
    return out
