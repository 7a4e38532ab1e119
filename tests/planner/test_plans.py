"""The planner's front door (``planner.plans``): a config in, a plan out."""

from holmes_jax.core.config import load_config
from holmes_jax.planner.plans import make_plan
from holmes_jax.planner.topology import load_topology
from tests.common import TINY_MODEL, mesh_path


def test_keep_degrees_keeps_the_replica_degree():
    """--keep-degrees with parallel.replica=2 plans one pipeline per island (the replica
    degree used to be dropped, and the degrees then did not cover the devices)."""
    topology = load_topology(mesh_path("cpu8-two-islands.yaml"))
    over = ["parallel.replica=2", "parallel.stages=2", "parallel.microbatches=2"]
    cfg = load_config(None, [*TINY_MODEL, "train.global_batch_size=8", *over])
    plan = make_plan(cfg, topology, keep_degrees=True)
    lay = plan.layout
    assert (lay.replica, lay.stages, lay.data, lay.tensor) == (2, 2, 2, 1)
    assert plan.stages_per_island == (2, 2)
    assert plan.stage_islands == ("ib", "ib")  # replica 0's pipeline; replica 1 on roce
