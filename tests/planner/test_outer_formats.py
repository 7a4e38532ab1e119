"""The planner's price of each DiLoCo outer format (:mod:`holmes_jax.planner.outer_formats`):
bytes per round and per token, the round's time on the link, whether it hides behind the
overlapped inner steps, and ``diloco.outer_dtype: auto``'s rule."""

import dataclasses

import pytest

from holmes_jax.core.config import load_config
from holmes_jax.core.plan_request import plan_request
from holmes_jax.planner.outer_formats import (
    AUTO_EXPOSED,
    choose,
    format_costs,
    resolve_outer_dtype,
    step_element_bytes,
)
from holmes_jax.planner.topology import load_topology
from tests.common import ROOT

SLOW = f"{ROOT}/meshes/emu-4host-2island-slow.yaml"  # 10 Mbit/s between the islands
FAST = f"{ROOT}/meshes/emu-4host-2island-fast.yaml"
INDEPENDENT = [
    "diloco.enabled=true",
    "diloco.mode=independent",
    "diloco.island=0",
    "diloco.peers=[127.0.0.1:1,127.0.0.1:2]",
    "diloco.inner_steps=30",
]


def request(*sets, mesh=SLOW):
    cfg = load_config(f"{ROOT}/configs/quickstart.yaml", [f"parallel.mesh={mesh}", *sets])
    return plan_request(cfg), load_topology(mesh)


def test_bytes_shrink_with_the_format_and_fragments_keep_bytes_per_token():
    req, topo = request(*INDEPENDENT, "diloco.sparse_k=64", "diloco.sparse_bits=2")
    costs = {c.fmt: c for c in format_costs(req, topo, inner_s=0.5)}
    p = req.model.num_params
    assert costs["fp32"].delta_bytes == 4 * p and costs["int8"].delta_bytes == p
    assert costs["fp32"].step_bytes == costs["fp32"].delta_bytes  # dense: the same width back
    sizes = [costs[f].delta_bytes for f in ("fp32", "bf16", "int8", "sparse")]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] / sizes[-1] > 100
    # the sparse step back: the other islands' deltas relayed, or dense int8 once they
    # would be larger (eight islands sending 1024 of each 4096)
    assert step_element_bytes("sparse", (4096, 64, 2), 2) == (64 * 14 + 48) / 4096 / 8
    assert step_element_bytes("sparse", (4096, 64, 2), 8) == 7 * (64 * 14 + 48) / 4096 / 8
    assert step_element_bytes("sparse", (4096, 1024, 2), 8) == 1 + 4 / 4096
    assert step_element_bytes("sparse", (4096, 4096, 32), 2) <= 1 + 4 / 4096
    # a fragment round carries half the model as often again: the same bytes per token
    req2 = dataclasses.replace(req, diloco=dataclasses.replace(req.diloco, fragments=2))
    halves = {c.fmt: c for c in format_costs(req2, topo, inner_s=0.5)}
    for f, c in costs.items():
        assert halves[f].delta_bytes == pytest.approx(c.delta_bytes / 2)
        assert halves[f].bytes_per_token == pytest.approx(c.bytes_per_token)
        assert halves[f].round_s < c.round_s


def test_a_round_hides_behind_the_overlapped_inner_steps_it_fits_in():
    req, topo = request(*INDEPENDENT, "diloco.overlap_steps=10")
    fp32 = format_costs(req, topo, inner_s=0.4)[0]
    # 10 Mbit/s a host, 2 hosts: 6.5 MB up and back is over 5 s, more than 10 steps of 0.4 s
    assert fp32.round_s > 5 and fp32.exposed_s == pytest.approx(fp32.round_s - 4.0)
    assert format_costs(req, topo, inner_s=fp32.round_s / 10)[0].hidden
    spmd, _ = request("diloco.enabled=true", "diloco.overlap_steps=0")
    assert [c.fmt for c in format_costs(spmd, topo, 0.5)] == ["fp32", "bf16", "int8"]


def test_auto_stays_exact_on_a_fast_link_and_shrinks_on_a_slow_one():
    fast = resolve_outer_dtype(*request(*INDEPENDENT, "diloco.outer_dtype=auto", mesh=FAST))
    assert fast[0] == "fp32" and "within 5%" in fast[1]
    slow = resolve_outer_dtype(*request(*INDEPENDENT, "diloco.outer_dtype=auto"))
    assert slow[0] in ("int8", "sparse") and "fp32 would be exposed" in slow[1]
    assert resolve_outer_dtype(request(*INDEPENDENT)[0], None)[0] == "fp32"


def test_auto_picks_the_first_format_within_its_budget():
    req, topo = request(*INDEPENDENT)
    costs = format_costs(req, topo, inner_s=1.0)
    budget = AUTO_EXPOSED * 30  # H = 30 steps of 1 s
    fmt, why = choose(costs, inner_s=1.0, span=30)
    first = next(c for c in costs if c.exposed_s <= budget)
    assert fmt == first.fmt and f"{AUTO_EXPOSED:.0%} of the 30 s" in why
    tiny = [dataclasses.replace(c, exposed_s=1e9) for c in costs]  # nothing fits: smallest
    assert choose(tiny, inner_s=1.0, span=30)[0] == "sparse"


def test_the_trainer_resolves_auto_on_the_whole_mesh_before_an_island_takes_its_share():
    """An island's job resolves ``auto`` on the whole mesh (its own island alone has no
    link to price), the same on every island; a run without a mesh sends fp32."""
    from holmes_jax.runtime.setup import _outer_dtype

    got = []
    for island in (0, 1):
        sets = [*INDEPENDENT, f"diloco.island={island}", "diloco.outer_dtype=auto"]
        cfg = load_config(f"{ROOT}/configs/quickstart.yaml", [f"parallel.mesh={SLOW}", *sets])
        resolved, why = _outer_dtype(cfg)
        got.append((resolved.diloco.outer_dtype, why))
    assert got[0] == got[1] and got[0][0] in ("int8", "sparse") and "fp32 would be" in got[0][1]
    bare = load_config(None, ["diloco.outer_dtype=auto"])
    assert _outer_dtype(bare)[0].diloco.outer_dtype == "fp32"
