"""The cross-island strategy: pipeline, hierarchical data parallel or DiLoCo, priced side by side.

- ``pipeline``: the stage axis spans the islands (``replica = 1``); activations cross.
- ``hierarchical``: one pipeline copy per equal island (``replica = R``); each step the
  ZeRO-1 gradient shards are all-reduced across islands.
- ``pipeline+int8``: the pipeline with int8 activations across islands
  (``parallel.cross_island_dtype``), priced beside the others but never chosen: it changes
  the numerics, so a config asks for it.
- ``diloco``: one replica per island, each taking ``H = diloco.inner_steps`` steps alone;
  then the replicas average their parameter deltas.

DiLoCo's inner step ``t`` is the best plan with one copy per island on ``B / R`` of the
batch, the cross-island ring priced free. With ``P`` parameters, ``β`` bytes of
``diloco.outer_dtype`` (4, 2, 1; int8's per-tensor scales are left out), ``bw``/``lat``
the slowest inter-island link (per host) and ``h`` hosts of the smallest island::

    T_outer = 2(R-1)/R · P·β / (h · bw) + 2(R-1) · lat     # one outer all-reduce
    step    = t + T_outer · n                                # every outer sync blocks
    n       = (K + (N - K) / H) / N                          # outer syncs per step
    cross-island bytes per step (per replica) = 2(R-1)/R · P·β · n
    peak bytes of one sync = 2(R-1)/R · P·β / F              # F fragments, F syncs per H

K = ``diloco.warmup_steps`` full syncs start the run of N = ``train.steps`` steps
(K ≥ N: every step); without warm-up n = 1/H. Fragments cut the peak volume and the
longest pause F-fold, not the total.

``enabled: false`` picks the faster of pipeline and hierarchical, ``true`` DiLoCo, ``auto``
DiLoCo only when ``best synchronous step / DiLoCo step >= diloco.auto_min_speedup``.
DiLoCo changes the optimisation, so it must win clearly. Pure Python; no jax import.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import OUTER_DENSE_BYTES, REMAT_POLICIES, SCHEDULES, check_batch
from holmes_jax.planner.search import Plan, search_plan
from holmes_jax.planner.topology import Link, Topology

if TYPE_CHECKING:
    from holmes_jax.core.plan_request import DilocoSpec, PlanRequest, RunSpec
    from holmes_jax.core.spec import ModelSpec
    from holmes_jax.planner.placement import Calibration

STRATEGIES = ("pipeline", "hierarchical", "diloco")
FREE_GBPS = 1e12  # the inter-island link DiLoCo's inner plan is priced on (nothing crosses)
OUTER_BYTES = OUTER_DENSE_BYTES  # per element of a dense outer dtype (diloco.codec)


@dataclasses.dataclass(frozen=True)
class StrategyPrice:
    """One strategy's predicted step; ``plan`` is None when the topology cannot run it
    (``why`` says why). For DiLoCo ``plan`` is the plan inside one island."""

    name: str
    plan: Plan | None
    step_s: float = float("inf")
    tokens_per_s: float = 0.0
    cross_island_bytes_per_step: float = 0.0
    inner_steps: int = 1
    fragments: int = 1
    outer_dtype: str = ""
    outer_sync_s: float = 0.0  # one outer all-reduce (DiLoCo)
    exposed_s: float = 0.0  # per outer round, not hidden behind inner steps (DiLoCo)
    # (all of outer_sync_s: fragment syncs block; see the module doc)
    warmup_steps: int = 0  # DiLoCo: averaging syncs after each of the first K steps
    why: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready comparison row."""
        out: dict[str, Any] = {
            "strategy": self.name,
            "available": self.plan is not None,
            "predicted_step_s": self.step_s if self.plan is not None else None,
            "tokens_per_s": self.tokens_per_s,
            "cross_island_bytes_per_step": self.cross_island_bytes_per_step,
        }
        if self.plan is None:
            out["why"] = self.why
            return out
        lay = self.plan.layout
        out["plan"] = {
            "replica": lay.replica,
            "stages": lay.stages,
            "data": lay.data,
            "tensor": lay.tensor,
            "microbatches": lay.microbatches,
            "schedule": lay.schedule,
            "virtual_stages": lay.virtual_stages,
            "remat": self.plan.remat,
            "layers_per_stage": list(self.plan.layers_per_stage),
        }
        if self.name == "diloco":
            out.update(
                inner_steps=self.inner_steps,
                fragments=self.fragments,
                outer_dtype=self.outer_dtype,
                inner_step_s=self.plan.predicted_step_s,
                outer_sync_s=self.outer_sync_s,
                exposed_s_per_outer_step=self.exposed_s,
                warmup_steps=self.warmup_steps,
            )
        return out


@dataclasses.dataclass(frozen=True)
class StrategyChoice:
    """The priced strategies and the one the config allows (``chosen``), with the reason."""

    prices: tuple[StrategyPrice, ...]
    chosen: str
    reason: str

    def price(self, name: str) -> StrategyPrice:
        return next(p for p in self.prices if p.name == name)

    @property
    def plan(self) -> Plan | None:
        """The chosen strategy's plan (DiLoCo: the plan inside one island)."""
        return self.price(self.chosen).plan


def outer_sync_s(
    params: float, element_bytes: float, replicas: int, link_bytes_per_s: float, lat_s: float
) -> float:
    """One outer all-reduce: ``2(R-1)/R · P·β / bw + 2(R-1)·lat`` (see the module doc),
    ``β`` = ``element_bytes``."""
    if replicas <= 1:
        return 0.0
    ring = 2 * (replicas - 1) / replicas
    return ring * params * element_bytes / link_bytes_per_s + 2 * (replicas - 1) * lat_s


def exposed_outer_s(sync_s: float, fragments: int) -> tuple[float, float]:
    """(exposed time per outer round, longest single pause): the runtime's fragment syncs
    block (module doc), so all of ``sync_s`` is exposed, in ``fragments`` pauses."""
    return sync_s, sync_s / max(1, fragments)


def price_strategies(
    req: PlanRequest,
    topology: Topology,
    method: str = "optimal",
    calibration: Calibration | None = None,
    plan: Plan | None = None,
) -> StrategyChoice:
    """Price pipeline, hierarchical and DiLoCo for ``req`` on ``topology``; choose one.

    ``plan`` (from :func:`holmes_jax.planner.plans.make_plan`) is reused for its own
    strategy (replica 1: pipeline, else hierarchical), so only the other is searched.
    """
    model, run = req.model, req.run
    tokens = run.global_batch_size * model.seq_len
    search = dict(
        method=method, calibration=calibration, remats=REMAT_POLICIES, schedules=SCHEDULES
    )
    islands = topology.islands
    R = len(islands)
    equal = R > 1 and len({isl.num_devices for isl in islands}) == 1
    prices = []
    for name, replica in (("pipeline", 1), ("hierarchical", R)):
        why = ""
        found = plan if plan is not None and (plan.layout.replica == 1) == (replica == 1) else None
        if found is None:
            if name == "hierarchical" and not equal:
                why = "needs >= 2 islands of equal size"
            else:
                try:
                    found = search_plan(topology, model, run, replica=replica, **search)
                except ConfigError as e:
                    why = str(e)
        if found is None:
            prices.append(StrategyPrice(name, None, why=why))
            continue
        prices.append(
            StrategyPrice(
                name,
                found,
                found.predicted_step_s,
                tokens / found.predicted_step_s,
                _sync_cross_bytes(found, model, run),
            )
        )
    prices.append(_price_diloco(req, topology, tokens, search, equal))
    prices.extend(_price_compressed(prices[0], topology, model, run, tokens, search))
    return _choose(req.diloco, tuple(prices))


def _price_compressed(pipe, topology, model, run, tokens, search) -> list[StrategyPrice]:
    """The pipeline with int8 crossings (``parallel.cross_island_dtype: int8``), searched
    anew. Shown, never chosen: it changes the numerics, so a config asks for it."""
    if pipe.plan is None or run.cross_island_dtype != "same":
        return []
    fmt = "int8"
    try:
        found = search_plan(
            topology, model, dataclasses.replace(run, cross_island_dtype=fmt), replica=1, **search
        )
    except ConfigError as e:
        return [StrategyPrice(f"pipeline+{fmt}", None, why=str(e))]
    step = found.predicted_step_s
    cross = crossing_bytes_by_format(found, model, run)[fmt]
    return [StrategyPrice(f"pipeline+{fmt}", found, step, tokens / step, cross)]


def resolve_diloco(
    req: PlanRequest, topology: Topology | None
) -> tuple[bool, StrategyChoice | None]:
    """For the trainer: does ``diloco.enabled`` (true | false | auto) mean DiLoCo here?

    ``true``/``false`` are returned as they are (no pricing; ``None`` choice); ``auto``
    prices the strategies on ``topology`` and returns ``(chosen == "diloco", choice)``;
    ``choice.plan`` is then the plan inside one island. No topology: auto means false.
    """
    enabled = req.diloco.enabled
    if enabled is True or enabled is False:
        return enabled, None
    if topology is None:
        return False, None
    choice = price_strategies(req, topology)
    return choice.chosen == "diloco", choice


def predict_diloco(
    req: PlanRequest,
    topology: Topology,
    calibration: Calibration | None = None,
    *,
    sync_collectives: bool = False,
) -> tuple[float, float, float]:
    """``(step, inner step, one outer sync)`` in seconds for ``req`` as the trainer runs it
    with DiLoCo on (its own degrees, ``parallel.replica`` = islands), by the module doc's
    formula: the inner step priced by :func:`~holmes_jax.planner.plans.predict_run` with
    the inter-island link free (nothing crosses between outer syncs), plus the blocking
    outer syncs spread over ``H`` steps."""
    from holmes_jax.planner.plans import predict_run

    inner = predict_run(
        req, _islands_alone(topology), calibration, sync_collectives=sync_collectives
    ).step_s
    sync, exposed = _outer_cost(req.diloco, topology, req.model.num_params)
    return inner + exposed * outer_syncs_per_step(req.diloco, req.steps), inner, sync


def _outer_cost(dl: DilocoSpec, topology: Topology, params: int) -> tuple[float, float]:
    """(one outer sync, its exposed time per outer round) of DiLoCo ``dl`` across the
    islands: every host of the smallest island sends over the slowest inter-island link."""
    slow = slowest_inter_island(topology)
    hosts = min(isl.num_hosts for isl in topology.islands)
    replicas = len(topology.islands)
    sync = outer_sync_s(params, dl.outer_bytes, replicas, hosts * slow.bytes_per_s, slow.latency_s)
    return sync, exposed_outer_s(sync, dl.fragments)[0]


def outer_syncs_per_step(dl: DilocoSpec, steps: int) -> float:
    """Full outer syncs per step over a run of ``steps`` (``train.steps``) steps (module
    doc's ``n``): ``1/H``, plus one after each of the first ``diloco.warmup_steps``."""
    steps = max(1, steps)
    warm = min(dl.warmup_steps, steps)
    return (warm + (steps - warm) / dl.inner_steps) / steps


def _islands_alone(topology: Topology) -> Topology:
    """``topology`` with every inter-island link free: DiLoCo's inner steps send nothing
    across, so its inner plan is priced as if the islands stood alone."""
    free = Link(FREE_GBPS, 0.0)
    return dataclasses.replace(topology, inter_island_default=free, inter_island_overrides=())


def slowest_inter_island(topology: Topology) -> Link:
    islands = topology.islands
    links = [
        topology.inter_island(a.name, b.name) for a in islands for b in islands if a.name < b.name
    ]
    return min(links, key=lambda x: x.bytes_per_s)


def _sync_cross_bytes(plan: Plan, model: ModelSpec, run: RunSpec) -> float:
    """Bytes crossing islands per step: hierarchical, the ring all-reduce of the
    gradients (``2(R-1)/R · P · grad bytes``); pipeline, the activations over every stage
    boundary whose two stages sit on different islands (the interleaved wrap link too)."""
    lay = plan.layout
    if lay.replica > 1:
        r = lay.replica
        return 2 * (r - 1) / r * model.num_params * run.grad_bytes
    return crossing_bytes_by_format(plan, model, run)[run.cross_island_dtype]


def crossing_bytes_by_format(plan: Plan, model: ModelSpec, run: RunSpec) -> dict[str, float]:
    """Pipeline activations and their gradients crossing islands per step, for each
    ``parallel.cross_island_dtype`` (the plan's boundaries between stages on two islands,
    the interleaved wrap link included; 0 with replicas: their stage axes stay inside)."""
    from holmes_jax.core.spec import CROSS_ISLAND_DTYPES
    from holmes_jax.planner.formulas import wire_bytes

    isl, p2p = plan.stage_islands, plan.prediction.p2p_bytes
    p = len(isl)
    crosses = [isl[s] != isl[s + 1] for s in range(p - 1)] + [isl[-1] != isl[0]]
    now = float(sum(b for b, c in zip(p2p, crosses, strict=False) if c))
    rows, h = plan.microbatch_size * model.seq_len, model.hidden_size
    wire = {f: wire_bytes(f, rows, h, run.act_bytes) for f in CROSS_ISLAND_DTYPES}
    per_act = now / wire[run.cross_island_dtype]  # activations crossing per step
    return {f: per_act * w for f, w in wire.items()}


def _price_diloco(req, topology, tokens, search, equal) -> StrategyPrice:
    dl, model, run = req.diloco, req.model, req.run
    R = len(topology.islands)
    base = dict(
        inner_steps=dl.inner_steps,
        fragments=dl.fragments,
        outer_dtype=dl.outer_dtype,
        warmup_steps=dl.warmup_steps,
    )
    if not equal:
        return StrategyPrice("diloco", None, why="needs >= 2 islands of equal size", **base)
    try:
        check_batch(run.global_batch_size, replica=R)
    except ConfigError as e:
        return StrategyPrice("diloco", None, why=str(e), **base)
    # The inner plan: one pipeline copy per island (replica = R, each on B/R of the batch,
    # the slowest island setting the pace) with the cross-island gradient ring priced free,
    # since DiLoCo sends nothing across between outer steps: one search instead of R.
    try:
        inner = search_plan(_islands_alone(topology), model, run, replica=R, **search)
    except ConfigError as e:
        return StrategyPrice("diloco", None, why=str(e), **base)
    sync, exposed = _outer_cost(dl, topology, model.num_params)
    t = inner.predicted_step_s
    n = outer_syncs_per_step(dl, req.steps)
    step = t + exposed * n
    cross = 2 * (R - 1) / R * model.num_params * dl.outer_bytes * n
    return StrategyPrice(
        "diloco", inner, step, tokens / step, cross, outer_sync_s=sync, exposed_s=exposed, **base
    )


def _choose(dl: DilocoSpec, prices: tuple[StrategyPrice, ...]) -> StrategyChoice:
    sync = [p for p in prices[:2] if p.plan is not None]
    best = min(sync, key=lambda p: p.step_s) if sync else None
    diloco = prices[2]
    enabled = dl.enabled
    if enabled is True:
        if diloco.plan is None:
            raise ConfigError(
                f"diloco.enabled=true: DiLoCo cannot run on this topology ({diloco.why})"
            )
        return StrategyChoice(prices, "diloco", "diloco.enabled=true")
    if best is None:
        raise ConfigError("no synchronous strategy fits: " + "; ".join(p.why for p in prices[:2]))
    if enabled is False or diloco.plan is None:
        why = "diloco.enabled=false" if enabled is False else f"diloco unavailable ({diloco.why})"
        return StrategyChoice(prices, best.name, f"{why}: the faster synchronous strategy")
    speedup = best.step_s / diloco.step_s
    need = dl.auto_min_speedup
    if speedup >= need:
        reason = (
            f"diloco.enabled=auto: DiLoCo predicted {speedup:.2f}x faster than {best.name} "
            f">= auto_min_speedup {need} (it changes the optimisation, so it must win clearly)"
        )
        return StrategyChoice(prices, "diloco", reason)
    reason = (
        f"diloco.enabled=auto: DiLoCo predicted {speedup:.2f}x vs {best.name} < "
        f"auto_min_speedup {need}; kept synchronous (DiLoCo changes the optimisation)"
    )
    return StrategyChoice(prices, best.name, reason)
