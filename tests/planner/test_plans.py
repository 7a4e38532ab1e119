"""The planner's front door (``planner.plans``): a run's request in, a plan out."""

import pytest

from holmes_jax.core.config import load_config
from holmes_jax.core.plan_request import plan_request
from holmes_jax.planner.plans import make_plan
from holmes_jax.planner.topology import load_topology
from tests.common import TINY_MODEL, mesh_path


def test_keep_degrees_keeps_the_replica_degree():
    """--keep-degrees with parallel.replica=2 plans one pipeline per island (the replica
    degree used to be dropped, and the degrees then did not cover the devices)."""
    topology = load_topology(mesh_path("cpu8-two-islands.yaml"))
    over = ["parallel.replica=2", "parallel.stages=2", "parallel.microbatches=2"]
    req = plan_request(load_config(None, [*TINY_MODEL, "train.global_batch_size=8", *over]))
    plan = make_plan(req, topology, keep_degrees=True)
    lay = plan.layout
    assert (lay.replica, lay.stages, lay.data, lay.tensor) == (2, 2, 2, 1)
    assert plan.stages_per_island == (2, 2)
    assert plan.stage_islands == ("ib", "ib")  # replica 0's pipeline; replica 1 on roce


def test_resolve_auto_splits_every_virtual_stage():
    """Interleaved: one entry per virtual stage, auto (optimal, even chunks) or unset
    (even); the search reports every schedule on the chosen degrees."""
    from holmes_jax.planner.plans import predict_run, resolve_auto

    topology = load_topology(mesh_path("cpu8-two-islands.yaml"))
    inter = ["parallel.schedule=interleaved", "parallel.virtual_stages=2"]
    for lps in ("auto", "null"):
        sets = [*TINY_MODEL, "model.num_layers=6", "parallel.stages=2", *inter]
        req = plan_request(load_config(None, [*sets, f"parallel.layers_per_stage={lps}"]))
        shape = req.degrees(topology.num_devices)
        split = resolve_auto(req, shape, topology).layers_per_stage
        assert len(split) == 4 and sum(split) == req.model.num_layers
        assert predict_run(req, topology).step_s > 0
    plan = make_plan(req, topology, keep_degrees=True)
    assert plan.layout.virtual_stages == 2 and set(plan.by_schedule) == {
        "gpipe",
        "1f1b",
        "interleaved",
        "zb",
    }


def test_search_over_schedules():
    """search_plan with one schedule (interleaved: its v searched too) or all of them;
    the best of all is no slower than the best 1F1B plan."""
    from holmes_jax.core.plan_request import RunSpec
    from holmes_jax.core.spec import SCHEDULES, ModelSpec
    from holmes_jax.planner.search import search_plan

    topology = load_topology(mesh_path("cpu8-two-islands.yaml"))
    model, run = ModelSpec(8, 128, 4, 128, 256), RunSpec(32)
    inter = search_plan(topology, model, run, schedule="interleaved")
    lay = inter.layout
    assert lay.schedule == "interleaved" and lay.virtual_stages in (2, 3, 4)
    assert len(inter.layers_per_stage) == lay.stages * lay.virtual_stages
    one = search_plan(topology, model, run, stages=2)
    every = search_plan(topology, model, run, stages=2, schedules=SCHEDULES)
    assert every.predicted_step_s <= one.predicted_step_s


def test_schedule_auto_picks_the_fastest_schedule_that_fits():
    from holmes_jax.core.config import load_config
    from holmes_jax.core.errors import ConfigError
    from holmes_jax.planner.grid import load_mesh_topology, resolve_shape
    from holmes_jax.planner.plans import resolve_auto, schedule_alternatives
    from holmes_jax.planner.search import plan_for_layout
    from tests.common import config_path

    sets = ["parallel.schedule=auto", "parallel.microbatches=4"]
    req = plan_request(load_config(config_path("quickstart.yaml"), sets))
    topology = load_mesh_topology(req)
    shape = resolve_shape(req, 8, topology)
    got = resolve_auto(req, shape, topology)
    assert got.schedule in ("gpipe", "1f1b", "interleaved", "zb")
    assert len(got.layers_per_stage) == shape.stages * got.virtual_stages
    # The pick is the fastest of the per-schedule alternatives on the same degrees.
    model, run = req.model, req.run
    base = plan_for_layout(topology, model, run, req.parallel.layout(shape), "optimal", None)
    options = {k: v for k, v in schedule_alternatives(topology, model, run, base).items() if v}
    assert options[got.schedule]["predicted_step_s"] == min(
        v["predicted_step_s"] for v in options.values() if v["fits_in_memory"]
    )
    with pytest.raises(ConfigError, match="the planner chooses virtual_stages"):
        load_config(
            config_path("quickstart.yaml"),
            ["parallel.schedule=auto", "parallel.virtual_stages=2"],
        )


def test_blocking_collectives_plan_the_split_fastest_in_lockstep():
    """The searches rank splits by the closed form, where a send overlaps the receiver's
    work. With blocking collectives (CPU) the stages wait for each other at every tick
    that sends (:func:`~holmes_jax.planner.step_time.lockstep_pipeline`):
    ``sync_collectives=True`` keeps the searched degrees, prices the plan that way and
    takes the split fastest as trained (10 layers on 4 stages, roce at half ib's speed)."""
    from holmes_jax.planner.plans import alternatives, predict_run, with_plan

    topology = load_topology(mesh_path("emu-4host-2island-slow-compute.yaml"))
    model = ["model.num_layers=10", "model.hidden_size=256", "model.tied_embeddings=false"]
    run = ["train.global_batch_size=24", "parallel.grad_buckets=layer", "optimizer.zero1=true"]
    cfg = plan_request(load_config(None, [*TINY_MODEL, *model, *run]))

    def lockstep(plan):
        planned = cfg.with_parallel(with_plan(cfg.parallel, plan))
        return predict_run(planned, topology, sync_collectives=True).step_s

    closed = make_plan(cfg, topology)
    assert closed.predicted_step_s != pytest.approx(lockstep(closed))  # the pricing differs
    plan = make_plan(cfg, topology, sync_collectives=True)
    assert plan.layout == closed.layout
    assert plan.predicted_step_s == pytest.approx(lockstep(plan))  # priced as trained
    for other in alternatives(cfg, topology, plan).values():
        assert plan.predicted_step_s <= lockstep(other)
