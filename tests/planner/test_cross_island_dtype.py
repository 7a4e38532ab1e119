"""The planner's price of compressed sends across islands (parallel.cross_island_dtype):
wire bytes per format, the encode/decode passes, ``auto`` and the strategy row. No jax."""

import pytest

from holmes_jax.core.config import load_config
from holmes_jax.core.plan_request import plan_request
from holmes_jax.planner.formulas import codec_time, wire_bytes
from holmes_jax.planner.plans import AUTO_MIN_GAIN, predict_run, resolve_auto
from holmes_jax.planner.strategy import price_strategies
from holmes_jax.planner.topology import load_topology
from tests.common import config_path, mesh_path

SLOW = mesh_path("emu-4host-2island-slow.yaml")  # 10 Mbit/s between the islands
# the quickstart model as a two-stage pipeline, one stage per island
PIPE = ("parallel.stages=2", "parallel.microbatches=4", "parallel.schedule=1f1b")


def cfg(*sets, mesh=SLOW):
    sets = [f"parallel.mesh={mesh}", *PIPE, *sets]
    return plan_request(load_config(config_path("quickstart.yaml"), sets))


def test_wire_bytes_by_hand():
    rows, h = 10, 64
    assert wire_bytes("same", rows, h, 4) == 10 * 64 * 4
    assert wire_bytes("bf16", rows, h, 4) == 10 * 64 * 2
    assert wire_bytes("int8", rows, h, 4) == wire_bytes("fp8", rows, h, 2) == 10 * (64 + 4)
    assert codec_time(100.0, 30.0, 10.0, 20.0) == pytest.approx(130 / 10 + 130 / 20)


def test_prediction_prices_the_formats():
    """Only the boundary between the islands shrinks; int8 ~ a quarter of fp32 plus a scale
    per row, and the step gets shorter on a 10 Mbit/s link despite the codec passes."""
    topology = load_topology(SLOW)
    pr = {
        f: predict_run(cfg(f"parallel.cross_island_dtype={f}"), topology)
        for f in ("same", "bf16", "int8", "fp8")
    }
    same = pr["same"].p2p_bytes[0]
    h = 128  # quickstart hidden size
    assert pr["bf16"].p2p_bytes[0] == pytest.approx(same / 2)
    assert pr["int8"].p2p_bytes[0] == pytest.approx(same * (h + 4) / (4 * h))
    assert pr["fp8"].p2p_bytes == pr["int8"].p2p_bytes
    assert pr["int8"].step_s < pr["bf16"].step_s < pr["same"].step_s


def test_auto_picks_bf16_only_for_a_clear_gain():
    """auto: bf16 on a 10 Mbit/s link (the pipeline waits on it), same when the link is
    fast enough that bf16 gains < AUTO_MIN_GAIN; never int8."""
    for mesh, want in ((SLOW, "bf16"), (mesh_path("cpu8-two-islands.yaml"), "same")):
        c = cfg("parallel.cross_island_dtype=auto", mesh=mesh)
        topology = load_topology(mesh)
        shape = c.degrees(topology.num_devices)
        got = resolve_auto(c, shape, topology).cross_island_dtype
        assert got == want, mesh
        steps = {
            f: predict_run(c.with_parallel(cross_island_dtype=f), topology).step_s
            for f in ("same", "bf16")
        }
        assert (steps["bf16"] <= (1 - AUTO_MIN_GAIN) * steps["same"]) == (want == "bf16")


def test_strategy_row_for_the_compressed_pipeline():
    choice = price_strategies(cfg("diloco.enabled=false"), load_topology(SLOW))
    rows = {p.name: p for p in choice.prices}
    assert choice.chosen != "pipeline+int8"
    pipe, comp = rows["pipeline"], rows["pipeline+int8"]
    assert comp.plan is not None and comp.step_s < pipe.step_s
    assert 0 < comp.cross_island_bytes_per_step < pipe.cross_island_bytes_per_step / 3
