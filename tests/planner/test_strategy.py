"""The cross-island strategy: pipeline, hierarchical data parallel and DiLoCo priced side
by side (holmes_jax.planner.strategy), the outer-sync formula and the choice rules."""

import dataclasses

import pytest

from holmes_jax.core.config import load_config
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.plan_request import plan_request
from holmes_jax.core.spec import outer_element_bytes
from holmes_jax.diloco.sparse import Sparse
from holmes_jax.planner.strategy import (
    OUTER_BYTES,
    exposed_outer_s,
    outer_sync_s,
    price_strategies,
    resolve_diloco,
)
from holmes_jax.planner.topology import load_topology
from tests.common import config_path, mesh_path

SLOW = load_topology(mesh_path("emu-4host-2island-slow.yaml"))
MID = load_topology(mesh_path("emu-4host-2island.yaml"))


def cfg(*sets, name="quickstart"):
    return plan_request(load_config(config_path(name + ".yaml"), list(sets)))


def test_outer_sync_formula_by_hand():
    # 2 replicas, 1e6 params fp32 over 1.25e6 B/s (10 Mbit/s), 100 us: ring 1 -> 3.2 s
    fp32 = OUTER_BYTES["fp32"]
    assert outer_sync_s(1e6, fp32, 2, 1.25e6, 1e-4) == pytest.approx(4e6 / 1.25e6 + 2e-4)
    # 4 replicas: ring 2*3/4
    assert outer_sync_s(1e6, OUTER_BYTES["bf16"], 4, 1e6, 0.0) == pytest.approx(1.5 * 2e6 / 1e6)
    assert outer_sync_s(1e6, OUTER_BYTES["fp32"], 1, 1e6, 0.0) == 0.0
    assert OUTER_BYTES["int8"] < OUTER_BYTES["bf16"] < OUTER_BYTES["fp32"]
    # sparse: 64 of 4096 values, 12-bit positions, 2-bit values, per chunk a uint16 count
    # and an fp32 scale: 139x fewer bytes than fp32; the default (1024, 4 bits) 8x
    sparse = outer_element_bytes("sparse", 4096, 64, 2)
    assert sparse == pytest.approx((64 * 14 + 48) / 4096 / 8)
    assert 4.0 / sparse == pytest.approx(138.8, abs=0.1)
    assert sparse == pytest.approx(Sparse(k=64, bits=2).bits_per_value() / 8, rel=1e-4)
    default = outer_element_bytes("sparse", 4096, 1024, 4)
    assert default == pytest.approx(Sparse().bits_per_value() / 8, rel=1e-4)


def test_fragment_syncs_block_so_fragments_cut_the_pause_not_the_total():
    assert exposed_outer_s(10.0, 1) == (10.0, 10.0)  # blocking: all exposed, one pause
    assert exposed_outer_s(10.0, 4) == (10.0, 2.5)  # four pauses of a quarter each


def test_diloco_price_matches_the_hand_computation():
    choice = price_strategies(cfg("diloco.enabled=true"), SLOW)
    d = choice.price("diloco")
    model, run = cfg().model, cfg().run
    link = SLOW.inter_island("ib", "roce")
    hosts = 2
    sync = model.num_params * 4 / (hosts * link.bytes_per_s) + 2 * link.latency_s
    assert d.outer_sync_s == pytest.approx(sync)
    t = d.plan.predicted_step_s
    assert d.step_s == pytest.approx(t + sync / 50)
    assert d.cross_island_bytes_per_step == pytest.approx(model.num_params * 4 / 50)
    assert d.tokens_per_s == pytest.approx(run.global_batch_size * model.seq_len / d.step_s)


def test_warmup_adds_a_full_sync_per_warmup_step():
    """diloco.warmup_steps = K: n = (K + (N - K) / H) / N outer syncs per step (N steps)."""
    plain = price_strategies(cfg("diloco.enabled=true", "train.steps=300"), SLOW).price("diloco")
    sets = ("diloco.enabled=true", "train.steps=300", "diloco.inner_steps=10")
    warm = price_strategies(cfg(*sets, "diloco.warmup_steps=50"), SLOW).price("diloco")
    n = (50 + 250 / 10) / 300
    assert warm.step_s == pytest.approx(warm.plan.predicted_step_s + warm.outer_sync_s * n)
    assert warm.cross_island_bytes_per_step == pytest.approx(
        plain.cross_island_bytes_per_step * 50 * n
    )
    every = price_strategies(cfg(*sets, "diloco.warmup_steps=400"), SLOW).price("diloco")
    assert every.step_s == pytest.approx(every.plan.predicted_step_s + every.outer_sync_s)
    with pytest.raises(ConfigError, match=r"diloco\.warmup_steps=-1: must be >= 0"):
        cfg("diloco.warmup_steps=-1")


def test_slow_link_auto_picks_diloco_and_mid_link_keeps_sync():
    on, choice = resolve_diloco(cfg("diloco.enabled=auto"), SLOW)
    assert on and choice.chosen == "diloco"
    speed = choice.price("pipeline").step_s, choice.price("hierarchical").step_s
    assert min(speed) / choice.price("diloco").step_s >= 1.5
    on, choice = resolve_diloco(cfg("diloco.enabled=auto"), MID)
    assert not on and choice.chosen in ("pipeline", "hierarchical")


def test_enabled_false_never_true_always_and_auto_threshold():
    assert price_strategies(cfg("diloco.enabled=false"), SLOW).chosen != "diloco"
    assert price_strategies(cfg("diloco.enabled=true"), MID).chosen == "diloco"
    auto = price_strategies(cfg("diloco.enabled=auto"), SLOW)
    sync = min(auto.price(n).step_s for n in ("pipeline", "hierarchical"))
    speedup = sync / auto.price("diloco").step_s
    just_over = cfg("diloco.enabled=auto", f"diloco.auto_min_speedup={speedup * 1.01}")
    assert price_strategies(just_over, SLOW).chosen != "diloco"
    just_under = cfg("diloco.enabled=auto", f"diloco.auto_min_speedup={max(1.0, speedup * 0.99)}")
    assert price_strategies(just_under, SLOW).chosen == "diloco"
    assert resolve_diloco(cfg("diloco.enabled=true"), None) == (True, None)
    assert resolve_diloco(cfg("diloco.enabled=auto"), None) == (False, None)


def test_outer_dtype_orders_bytes_and_fragments_change_neither_bytes_nor_step():
    rows = {
        dt: price_strategies(cfg("diloco.enabled=true", f"diloco.outer_dtype={dt}"), SLOW).price(
            "diloco"
        )
        for dt in ("fp32", "bf16", "int8")
    }
    b = {dt: r.cross_island_bytes_per_step for dt, r in rows.items()}
    assert b["int8"] < b["bf16"] < b["fp32"]
    one = rows["fp32"]
    four = price_strategies(cfg("diloco.enabled=true", "diloco.fragments=4"), SLOW).price("diloco")
    assert four.cross_island_bytes_per_step == one.cross_island_bytes_per_step
    assert four.exposed_s == pytest.approx(one.exposed_s) and four.step_s == pytest.approx(
        one.step_s
    )


def test_unequal_islands_have_no_diloco_and_true_is_an_error():
    uneven = load_topology(mesh_path("cpu8-three-islands-uneven.yaml"))
    choice = price_strategies(cfg("diloco.enabled=auto"), uneven)
    assert choice.price("diloco").plan is None and choice.chosen != "diloco"
    with pytest.raises(ConfigError, match="diloco.enabled=true"):
        price_strategies(cfg("diloco.enabled=true"), uneven)


def test_gpu_cluster_keeps_a_synchronous_strategy():
    paper = load_topology(mesh_path("paper-ib-roce-8x8.yaml"))
    choice = price_strategies(cfg("diloco.enabled=auto", name="gpt-7b"), paper)
    assert choice.chosen in ("pipeline", "hierarchical")
    assert dataclasses.asdict(choice.price("diloco"))["inner_steps"] == 50
