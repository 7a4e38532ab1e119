"""The plan drawing's data: which host runs which stage (``planner.draw``)."""

from holmes_jax.core.plan_request import RunSpec
from holmes_jax.core.spec import Layout, ModelSpec
from holmes_jax.planner.draw import host_stage_labels
from holmes_jax.planner.search import plan_for_layout
from holmes_jax.planner.topology import load_topology
from tests.common import mesh_path

MODEL = ModelSpec(8, 128, 4, 128, 256)


def _labels(layout):
    topology = load_topology(mesh_path("cpu8-two-islands.yaml"))
    plan = plan_for_layout(topology, MODEL, RunSpec(16), layout, "uniform")
    return host_stage_labels(plan, topology)


def test_every_host_of_every_replica_is_labelled():
    """With replicas each island holds a whole pipeline: the second island's hosts carry
    replica 1's stages (they used to be drawn with no label)."""
    labels = _labels(Layout(2, 2, 1, replica=2, microbatches=2))
    assert labels == {
        (0, 0): ["replica 0 stage 0"],
        (0, 1): ["replica 0 stage 1"],
        (1, 0): ["replica 1 stage 0"],
        (1, 1): ["replica 1 stage 1"],
    }


def test_pipeline_across_islands_labels_stages_by_island():
    labels = _labels(Layout(4, 2, 1, microbatches=4))
    assert labels == {
        (0, 0): ["stage 0"],
        (0, 1): ["stage 1"],
        (1, 0): ["stage 2"],
        (1, 1): ["stage 3"],
    }
    # a stage spanning two hosts labels both; two stages on one host, both
    assert _labels(Layout(2, 4, 1, microbatches=4))[(0, 1)] == ["stage 0"]
    assert _labels(Layout(8, 1, 1, microbatches=8))[(1, 1)] == ["stage 6", "stage 7"]


def test_every_schedule_is_simulated_and_drawn(tmp_path):
    """The timeline follows the schedule's tables: ZB-H1 draws its deferred W's, the
    interleaved schedule its chunks; the last event ends near the predicted pipeline."""
    import pytest

    pytest.importorskip("matplotlib")
    from holmes_jax.planner.draw import draw_plan, simulate_schedule

    topology = load_topology(mesh_path("cpu8-two-islands.yaml"))
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)):
        layout = Layout(4, 2, 1, microbatches=4, schedule=schedule, virtual_stages=v)
        plan = plan_for_layout(topology, MODEL, RunSpec(16), layout, "optimal")
        pr = plan.prediction
        events = simulate_schedule(
            pr.stage_fwd_s, pr.stage_bwd_s, 4, schedule, v, pr.stage_weight_s
        )
        kinds = {e[1] for e in events}
        assert kinds == ({"F", "B", "W"} if schedule == "zb" else {"F", "B"})
        assert len(events) == len(kinds) * 4 * 4 * v
        pipe = pr.step_s - pr.breakdown["grad_sync"] - pr.breakdown["optimizer"]
        assert max(e[4] for e in events) == pytest.approx(pipe, rel=0.1)
        path = tmp_path / f"{schedule}.png"
        draw_plan(plan, topology, str(path))
        assert path.stat().st_size > 1000
