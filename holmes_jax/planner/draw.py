"""A plan drawn: the pipeline schedule as a timeline per stage, and the topology.

:func:`simulate_table` runs a schedule's tables (:mod:`holmes_jax.planner.schedule`) event
by event with each op's own duration; :func:`simulate_schedule` does it with the cost
model's per-stage times of one micro-batch (every schedule: GPipe, 1F1B, interleaved,
ZB-H1); :func:`draw_plan` draws it with the islands, hosts and links (what
``python -m holmes_jax.plan --png`` writes; needs matplotlib). No jax import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from holmes_jax.core.errors import ConfigError
from holmes_jax.planner.placement import stage_blocks
from holmes_jax.planner.schedule import BWD, FWD, WGT, Schedule, make_schedule, simulate_events
from holmes_jax.planner.search import Plan
from holmes_jax.planner.step_time import stage_totals
from holmes_jax.planner.topology import Topology

_KIND = {FWD: "F", BWD: "B", WGT: "W"}


def simulate_table(
    sched: Schedule, duration: Callable[[int, int, int], float]
) -> list[tuple[int, str, int, int, float, float]]:
    """Run each stage's table order back to back, every op as soon as its input exists.

    Dependencies: F after the previous virtual stage's F of the same micro-batch, B after
    the next virtual stage's B (the last virtual stage's after its own F), W after its own
    B; a stage runs one op at a time, in its table order. Transfers are inside the
    durations (the cost model charges each send to the op that sends it). The makespan is
    :func:`holmes_jax.planner.schedule.simulate_makespan`'s.

    Args:
      sched: the tables.
      duration: ``duration(stage, op, chunk)`` seconds (op FWD, BWD or WGT).

    Returns:
      Events ``(stage, "F" | "B" | "W", micro-batch, chunk, start, end)``.
    """
    return [
        (s, _KIND[op], i, c, start, end)
        for s, op, i, c, start, end in simulate_events(sched, duration)
    ]


def simulate_schedule(
    fwd: Sequence[float],
    bwd: Sequence[float],
    microbatches: int,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    weight: Sequence[float] | None = None,
) -> list[tuple[int, str, int, float, float]]:
    """Event-driven run of a pipeline schedule on per-stage times of one micro-batch.

    Args:
      fwd, bwd: per-stage time of one micro-batch's forward and backward (all chunks of
        the stage; each chunk takes 1/v of it).
      microbatches: m.
      schedule: ``gpipe``, ``1f1b``, ``interleaved`` (with ``virtual_stages`` chunks) or
        ``zb`` (the backward split into B = bwd − weight and the deferred W = weight).
      weight: per-stage weight-gradient part of ``bwd`` (zb; default a half).

    Returns:
      Events ``(stage, "F" | "B" | "W", micro-batch, start, end)``; the last end is the
      makespan (``Σ τ + (m−1)·max τ`` for equal 1F1B stages).
    """
    v = virtual_stages
    sched = make_schedule(schedule, len(fwd), microbatches, v)
    w = [b / 2 for b in bwd] if weight is None else list(weight)
    if sched.split_backward:
        times = {FWD: list(fwd), BWD: [b - x for b, x in zip(bwd, w, strict=True)], WGT: w}
    else:
        times = {FWD: [f / v for f in fwd], BWD: [b / v for b in bwd]}
    events = simulate_table(sched, lambda s, op, c: times[op][s])
    return [(s, k, i, start, end) for s, k, i, _, start, end in events]


def host_stage_labels(plan: Plan, topology: Topology) -> dict[tuple[int, int], list[str]]:
    """What each host runs: ``{(island index, host index in the island): ["stage 0", ...]}``.

    Every replica's stages are labelled (``"replica 1 stage 0"`` when the plan has
    replicas), so each island's hosts show the pipeline they hold.
    """
    lay = plan.layout
    k = lay.data * lay.tensor  # devices per stage
    labels: dict[tuple[int, int], list[str]] = {}
    for r, blocks in enumerate(stage_blocks(topology, lay)):
        for s, (i, off) in enumerate(blocks):
            name = f"replica {r} stage {s}" if lay.replica > 1 else f"stage {s}"
            per_host = topology.islands[i].devices_per_host
            for h in sorted({d // per_host for d in range(off, off + k)}):
                labels.setdefault((i, h), []).append(name)
    return labels


def draw_plan(plan: Plan, topology: Topology, path: str) -> None:
    """Draw the pipeline timeline per stage and the topology to a PNG file.

    Raises:
      ConfigError: matplotlib is not installed.
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
    except ImportError:
        raise ConfigError(
            f"--png {path}: needs matplotlib (pip install 'holmes_jax[plot]')"
        ) from None
    pr, lay = plan.prediction, plan.layout
    fig = Figure(figsize=(12, 4 + 0.35 * lay.stages))
    ax, topo_ax = fig.subplots(2, 1, height_ratios=[max(2, lay.stages), 3])
    colors = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
    events = simulate_schedule(
        pr.stage_fwd_s,
        pr.stage_bwd_s,
        lay.microbatches,
        lay.schedule,
        lay.virtual_stages,
        pr.stage_weight_s or None,
    )
    end = max(e[4] for e in events)
    for s, kind, _, start, stop in events:
        ax.broken_barh(
            [(start, stop - start)], (s - 0.4, 0.8), color=colors[kind], lw=0.3, edgecolor="white"
        )
    tail = pr.breakdown["grad_sync"] + pr.breakdown["optimizer"]
    ax.broken_barh([(end, tail)], (-0.5, lay.stages), color="#BBBBBB")
    ax.set_yticks(range(lay.stages))
    totals = stage_totals(plan.layers_per_stage, lay.stages, lay.virtual_stages)
    ax.set_yticklabels([f"{s}: {plan.stage_islands[s]} ({n}L)" for s, n in enumerate(totals)])
    ax.invert_yaxis()
    ax.set_xlabel(
        "seconds (blue forward, orange backward"
        + (", green weight gradient" if lay.schedule == "zb" else "")
        + ", grey gradient sync + optimizer)"
    )
    ax.set_title(
        f"{plan.method} plan: replica {lay.replica} x stage {lay.stages} x data "
        f"{lay.data} x tensor {lay.tensor}, {lay.microbatches} micro-batches, "
        f"{lay.schedule}{f' v{lay.virtual_stages}' if lay.virtual_stages > 1 else ''}; "
        f"predicted step {pr.step_s:.3g} s"
    )
    nic_color = {"infiniband": "#55A868", "roce": "#8172B2", "ethernet": "#C44E52"}
    width = 1.0 / len(topology.islands)
    hosts = host_stage_labels(plan, topology)
    for i, isl in enumerate(topology.islands):
        x0 = i * width + 0.02
        topo_ax.add_patch(
            Rectangle((x0, 0.1), width - 0.04, 0.75, fill=False, lw=2, edgecolor=nic_color[isl.nic])
        )
        topo_ax.text(
            x0 + 0.01,
            0.78,
            f"{isl.name} ({isl.nic}, "
            f"{isl.link.bandwidth_gbps:g} Gbit/s/host), stages: "
            f"{plan.stages_per_island[i]}",
            fontsize=8,
            va="top",
        )
        hw = (width - 0.06) / max(isl.num_hosts, 1)
        for h in range(isl.num_hosts):
            topo_ax.add_patch(
                Rectangle(
                    (x0 + 0.01 + h * hw, 0.2), hw * 0.85, 0.35, color=nic_color[isl.nic], alpha=0.3
                )
            )
            if isl.num_hosts <= 8:
                label = isl.hosts[h] + "".join(f"\n{x}" for x in hosts.get((i, h), []))
                topo_ax.text(
                    x0 + 0.01 + (h + 0.42) * hw, 0.37, label, ha="center", va="center", fontsize=7
                )
        if i + 1 < len(topology.islands):
            link = topology.inter_island(isl.name, topology.islands[i + 1].name)
            xe = (i + 1) * width
            topo_ax.annotate(
                "",
                (xe + 0.02, 0.45),
                (xe - 0.02, 0.45),
                arrowprops={"arrowstyle": "<->", "lw": 1.5},
            )
            topo_ax.text(xe, 0.05, f"{link.bandwidth_gbps:g} Gbit/s", ha="center", fontsize=8)
    topo_ax.set_xlim(0, 1)
    topo_ax.set_ylim(0, 0.9)
    topo_ax.axis("off")
    topo_ax.set_title(f"topology {topology.name}: hosts per island (shaded), links", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
