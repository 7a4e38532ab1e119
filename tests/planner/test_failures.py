"""A failure's survivors: ``without_hosts``, ``replan`` and ``failure_plans`` (pure planner)."""

import dataclasses

import pytest

from holmes_jax.core.config import config_from_dict, load_config
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.plan_request import apply_parallel, plan_request
from holmes_jax.planner.failures import EXCLUDE_KEY, failure_plans, full_step, replan
from holmes_jax.planner.grid import load_mesh_topology
from holmes_jax.planner.report import failure_label
from holmes_jax.planner.topology import load_topology, without_hosts
from tests.common import config_path, mesh_path

TWO = mesh_path("cpu8-two-islands.yaml")
THREE = mesh_path("cpu8-three-islands-uneven.yaml")


def quickstart(*overrides):
    return load_config(config_path("quickstart.yaml"), [f"parallel.mesh={TWO}", *overrides])


def request(*overrides):
    return plan_request(quickstart(*overrides))


def hosts(topology):
    return [h for isl in topology.islands for h in isl.hosts]


@pytest.mark.parametrize(
    "gone, needle",
    [
        (["ib-9"], "'ib-9' is not a host of topology 'cpu8-two-islands'"),
        (["ib-0", "roce-1", "ib-0"], "names a host twice"),
        (["ib-0", "ib-1", "roce-0", "roce-1"], "leaves no host of topology 'cpu8-two-islands'"),
    ],
)
def test_without_hosts_errors_name_the_key_and_value(gone, needle):
    with pytest.raises(ConfigError) as e:
        without_hosts(load_topology(TWO), gone, key=EXCLUDE_KEY)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{EXCLUDE_KEY}={gone}: ") and needle in msg


def test_an_island_that_loses_every_host_drops_out_with_its_links():
    three = load_topology(THREE)
    assert [{a, b} for a, b, _ in three.inter_island_overrides] == [{"roce", "eth"}]
    no_roce = without_hosts(three, ["roce-0"])
    assert [isl.name for isl in no_roce.islands] == ["ib", "eth"]
    assert no_roce.inter_island_overrides == ()  # the roce-eth link went with roce
    assert no_roce.inter_island_default == three.inter_island_default
    no_ib = without_hosts(three, ["ib-0", "ib-1"])
    assert no_ib.inter_island_overrides == three.inter_island_overrides  # roce-eth stays
    one = without_hosts(three, ["roce-0", "eth-0"])
    assert [isl.name for isl in one.islands] == ["ib"] and one.inter_island_default is None
    # a host lost inside an island: the island stays, its other hosts and links kept
    part = without_hosts(three, ["ib-1"])
    assert hosts(part) == ["ib-0", "roce-0", "eth-0"] and part.num_devices == 6
    assert part.islands[0].link == three.islands[0].link
    assert part.name == "cpu8-three-islands-uneven without ib-1"


@pytest.mark.parametrize("gone", [["ib-0"], ["roce-0", "roce-1"], ["ib-1", "roce-0"]])
def test_replan_keeps_the_global_batch_and_its_config_validates(gone):
    cfg = quickstart()
    r = replan(plan_request(cfg), load_topology(TWO), gone, sync_collectives=True)
    applied = apply_parallel(cfg, r.parallel)
    assert applied.train.global_batch_size == cfg.train.global_batch_size
    assert applied.parallel.exclude_hosts == tuple(gone)
    assert applied.model == dataclasses.replace(cfg.model, remat=r.plan.remat)
    # the survivors' config is a valid config as written down (every check that needs no
    # devices), and its degrees resolve on the survivors' devices to the plan's
    again = plan_request(config_from_dict(applied.to_dict(), "<survivors>"))
    survivors = load_mesh_topology(again)
    assert hosts(survivors) == hosts(r.topology) and gone[0] not in hosts(survivors)
    shape = again.degrees(survivors.num_devices)
    lay = r.plan.layout
    assert (shape.replica, shape.stages, shape.data, shape.tensor) == (
        lay.replica,
        lay.stages,
        lay.data,
        lay.tensor,
    )
    assert shape.num_devices == survivors.num_devices
    assert r.plan.predicted_step_s == r.step_s  # the plan is priced as the trainer runs it
    assert r.full_step_s == full_step(plan_request(cfg), load_topology(TWO), sync_collectives=True)
    line = r.line()
    assert f"without {', '.join(gone)}" in line and f"{r.step_s:.3g} s" in line


def test_replan_of_an_unknown_host_is_one_line():
    with pytest.raises(ConfigError, match=r"^parallel\.exclude_hosts=\['mars-0'\]: 'mars-0'"):
        replan(request(), load_topology(TWO), ["mars-0"])


def test_failure_plans_cover_one_host_and_the_whole_of_each_island():
    plans = failure_plans(request(), load_topology(THREE), sync_collectives=True)
    assert [failure_label(p) for p in plans] == [
        "one host of ib (ib-0)",
        "island ib (ib-0, ib-1)",
        "island roce (roce-0)",  # one host: losing it is losing the island
        "island eth (eth-0)",
    ]
    assert all(p.replan is not None for p in plans)
    d = plans[1].to_dict()
    assert (d["lost"], d["island"], d["excluded"], d["hosts"], d["devices"]) == (
        "island",
        "ib",
        ["ib-0", "ib-1"],
        2,
        4,
    )
    assert d["overrides"][0] == "parallel.exclude_hosts=[ib-0,ib-1]"
    # the config's own degrees (4 data ranks) do not fit the 2-device roce island
    assert d["relative_step"] is None and plans[1].replan.full_step_s is None
    one_host = load_topology(mesh_path("gpu8-one-host.yaml"))
    assert failure_plans(request(), one_host) == []


def test_a_failure_the_survivors_cannot_run_says_why():
    big = ("model.hidden_size=1024", "model.num_layers=24", "model.num_heads=8")
    plans = failure_plans(request(*big), load_topology(TWO), sync_collectives=True)
    by = {failure_label(p): p for p in plans}
    assert by["one host of ib (ib-0)"].replan is not None
    lost = by["island ib (ib-0, ib-1)"]
    assert lost.replan is None and "fits in device memory" in lost.why
    assert lost.why.startswith("parallel.exclude_hosts=['ib-0', 'ib-1']: no plan")
    d = lost.to_dict()
    assert d["plan"] is None and d["why"] == lost.why and (d["hosts"], d["devices"]) == (2, 4)


def test_the_survivors_candidates_are_the_fastest_predicted_plans_ranked_as_trained():
    """``parallel.replan_candidates`` K: K distinct plans, fastest predicted first (as the
    trainer prices them), the first the re-plan's own; ``choose`` runs another; K = 1 is
    the one plan of the search. A search that keeps more never predicts a slower best."""
    full = load_mesh_topology(request())
    one = replan(request("parallel.replan_candidates=1"), full, ["roce-0"], sync_collectives=True)
    four = replan(request("parallel.replan_candidates=4"), full, ["roce-0"], sync_collectives=True)
    assert len(one.candidates) == 1 and one.spread() is None
    steps = [c.step_s for c in four.candidates]
    assert len(steps) == 4 and steps == sorted(steps) and four.step_s == steps[0]
    assert len({c.parallel for c in four.candidates}) == 4
    assert four.step_s <= one.step_s
    assert four.spread() == pytest.approx(steps[1] / steps[0] - 1)
    second = four.choose(1)
    assert (second.parallel, second.step_s) == (four.candidates[1].parallel, steps[1])
    assert second.candidates == four.candidates and second.excluded == four.excluded
