"""What each DiLoCo outer format costs between islands, and ``diloco.outer_dtype: auto``.

A round carries ``P/F`` parameters (F = ``diloco.fragments``). With R islands, the slowest
inter-island link ``bw`` per host and ``h`` hosts in the smallest island (lanes spread a
round over them), per round:

    delta = P/F · β                     # one island's upload (core.spec.outer_element_bytes)
    step  = P/F · β_step                # the answer; dense: β; sparse: the other R − 1
                                        # deltas relayed, the union of the R deltas'
                                        # positions in 8 bits, or int8, the smallest
    independent: round = (R−1)·(delta + step) / (h·bw) + 2·lat   # the leader's link
    spmd:        round = 2(R−1)/R · delta / (h·bw) + 2(R−1)·lat  # a ring, no step back
    hidden:      round <= τ·t            # τ = diloco.overlap_steps (independent), t the
                                         # inner step; in step (τ = 0) all of it is exposed
    bytes per token = (R−1)·(delta + step) / (span·B·S)   # independent; spmd 2(R−1)·delta
                                         # span = H/F steps between rounds, B·S a batch

``outer_dtype: auto`` (:func:`choose`): fp32 when its exposed time is at most
:data:`AUTO_EXPOSED` of the compute between two rounds; else the first of bf16, int8 and
(independent islands only) sparse that is; else the smallest. The quality each format
costs, as measured on the quickstart model (docs/benchmarks.md), is :data:`QUALITY`. The
choice reads the mesh's specs only (no probe), so every island of a run resolves the
same format. Pure Python; no jax import.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from holmes_jax.core.spec import OUTER_DENSE_BYTES, outer_element_bytes

if TYPE_CHECKING:
    from holmes_jax.core.plan_request import PlanRequest
    from holmes_jax.planner.topology import Topology

# auto keeps a format whose round leaves at most this fraction of the compute between two
# rounds exposed
AUTO_EXPOSED = 0.05
# The eval-loss cost of each format against fp32 DiLoCo on the quickstart model at 500
# steps, measured (docs/benchmarks.md, "DiLoCo over a WAN"): what the plan table prints.
QUALITY = {
    "fp32": "exact",
    "bf16": "~exact",
    "int8": "+0.1% (H 30)",
    "sparse": "-0.3% (k 1024, 4 bits, H 10) to +20% (k 64, 2 bits, H 30)",
}


@dataclasses.dataclass(frozen=True)
class FormatCost:
    """One outer format's round (module doc), per island."""

    fmt: str  # fp32, bf16, int8 or sparse
    delta_bytes: float  # one island's upload per round
    step_bytes: float  # the step back per round
    round_s: float  # on the link
    exposed_s: float  # of it, not hidden behind inner steps
    bytes_per_token: float  # crossing between islands, per trained token

    @property
    def hidden(self) -> bool:
        return self.exposed_s <= 0.0


def step_element_bytes(fmt: str, sparse: tuple[int, int, int], islands: int) -> float:
    """Bytes per parameter of a round's step back to one member (module doc); ``sparse``
    is ``(chunk, k, bits)``: the smallest of the other islands' deltas relayed, the
    union of every island's positions with values in 8 bits, and dense int8."""
    if fmt != "sparse":
        return OUTER_DENSE_BYTES[fmt]
    chunk, k, bits = sparse
    relay = (islands - 1) * outer_element_bytes(fmt, chunk, k, bits)
    union = min(chunk, islands * k) * (chunk.bit_length() - 1 + max(bits, 8)) + 16 + 32
    return min(relay, union / chunk / 8, OUTER_DENSE_BYTES["int8"] + 4 / chunk)


def format_costs(req: PlanRequest, topology: Topology, inner_s: float) -> list[FormatCost]:
    """The cost of each outer format the run's mode allows (sparse: independent islands
    only), at the run's fragments, H and overlap, for an inner step of ``inner_s``."""
    from holmes_jax.planner.strategy import slowest_inter_island

    dl = req.diloco
    independent = dl.mode == "independent"
    islands = len(topology.islands)
    hosts = min(isl.num_hosts for isl in topology.islands)
    link = slowest_inter_island(topology)
    bw = hosts * link.bytes_per_s
    per_round = req.model.num_params / dl.fragments
    span = dl.inner_steps / dl.fragments
    tokens = span * req.run.global_batch_size * req.model.seq_len
    overlap = dl.overlap_steps * inner_s if independent else 0.0
    out = []
    for fmt in ("fp32", "bf16", "int8", "sparse")[: 4 if independent else 3]:
        delta = per_round * outer_element_bytes(fmt, *dl.sparse)
        if independent:  # R − 1 deltas up to the leader, R − 1 steps back
            step = per_round * step_element_bytes(fmt, dl.sparse, islands)
            round_s = (islands - 1) * (delta + step) / bw + 2 * link.latency_s
            crossing = (islands - 1) * (delta + step)
        else:  # a ring all-gather of the deltas: no step crosses
            step, ring = 0.0, 2 * (islands - 1) / islands
            round_s = ring * delta / bw + 2 * (islands - 1) * link.latency_s
            crossing = islands * ring * delta
        exposed = max(0.0, round_s - overlap)
        out.append(FormatCost(fmt, delta, step, round_s, exposed, crossing / tokens))
    return out


def choose(costs: list[FormatCost], inner_s: float, span: float) -> tuple[str, str]:
    """``outer_dtype: auto``'s format among ``costs`` (module doc) and the reason, one line."""
    compute = span * inner_s
    budget = AUTO_EXPOSED * compute
    rule = f"{AUTO_EXPOSED:.0%} of the {compute:.3g} s of compute between rounds"
    first = costs[0]
    for cost in costs:
        if cost.exposed_s <= budget:
            hides = "hides" if cost.hidden else f"is exposed {cost.exposed_s:.3g} s,"
            why = f"{cost.fmt}: its round ({cost.round_s:.3g} s on the link) {hides} within {rule}"
            if cost is not first:
                why += f" ({first.fmt} would be exposed {first.exposed_s:.3g} s)"
            return cost.fmt, why
    smallest = min(costs, key=lambda c: c.delta_bytes + c.step_bytes)
    return smallest.fmt, (
        f"{smallest.fmt}: no format's round is exposed within {rule}; the smallest "
        f"({smallest.round_s:.3g} s on the link, exposed {smallest.exposed_s:.3g} s)"
    )


def format_table(req: PlanRequest, costs: list[FormatCost], chosen: str | None) -> list[str]:
    """The plan's lines: one per outer format (module doc), ``chosen`` marked."""
    dl = req.diloco
    tau = f"overlap {dl.overlap_steps} steps" if dl.overlap_steps else "in step"
    lines = [
        f"diloco outer formats (a round every {dl.inner_steps / dl.fragments:g} steps carries "
        f"1/{dl.fragments} of the model, {tau}; quality against fp32, measured):",
        "  format   delta/round   step/round   bytes/token   round s   exposed s   quality",
    ]
    for c in costs:
        mark = " <-" if c.fmt == chosen else ""
        step = _mb(c.step_bytes) if c.step_bytes else "-"  # spmd: no step crosses
        lines.append(
            f"  {c.fmt:<8} {_mb(c.delta_bytes):>11}   {step:>10}   "
            f"{c.bytes_per_token:>11.4g}   {c.round_s:>7.3g}   {c.exposed_s:>9.3g}   "
            f"{QUALITY[c.fmt]}{mark}"
        )
    return lines


def _mb(n: float) -> str:
    return f"{n / 1e6:.4g} MB" if n >= 1e5 else f"{n / 1e3:.4g} kB"


def resolve_outer_dtype(req: PlanRequest, topology: Topology | None) -> tuple[str, str]:
    """``diloco.outer_dtype: auto`` for the whole run (before an island takes its share):
    the format and one line saying why (module doc). No topology: fp32."""
    from holmes_jax.core.errors import ConfigError

    if topology is None or len(topology.islands) < 2:
        return "fp32", "fp32: no parallel.mesh with two islands to price the link on"
    try:
        costs, inner_s = price_formats(req, topology)
    except ConfigError as err:
        return "fp32", f"fp32: the planner cannot price the inner step ({err})"
    return choose(costs, inner_s, req.diloco.inner_steps / req.diloco.fragments)


def price_formats(req: PlanRequest, topology: Topology) -> tuple[list[FormatCost], float]:
    """:func:`format_costs` at the inner step the planner predicts for DiLoCo (every island
    priced alone, from the mesh's specs), and that step."""
    from holmes_jax.planner.strategy import predict_diloco

    inner_s = predict_diloco(req, topology)[1]
    return format_costs(req, topology, inner_s), inner_s


def outer_report(req: PlanRequest, topology: Topology) -> tuple[list[str], dict] | None:
    """The plan's DiLoCo outer-format table (:func:`format_table`) and its JSON, the
    configured format marked (``auto``: the one it resolves to, and why); None when the
    planner cannot price DiLoCo's inner step on ``topology``."""
    from holmes_jax.core.errors import ConfigError

    if len(topology.islands) < 2:
        return None
    try:
        costs, inner_s = price_formats(req, topology)
    except ConfigError:
        return None
    dl = req.diloco
    chosen, why = dl.outer_dtype, ""
    if chosen == "auto":
        chosen, why = choose(costs, inner_s, dl.inner_steps / dl.fragments)
    lines = format_table(req, costs, chosen)
    if why:
        lines.append(f"  diloco.outer_dtype=auto: {why}")
    data = {
        "inner_step_s": inner_s,
        "chosen": chosen,
        "formats": [dataclasses.asdict(c) for c in costs],
    }
    return lines, data
