"""What a run asks the planner, converted once from its config.

No planner function reads a :class:`~holmes_jax.core.config.Config`. Where a run enters the
planner (``python -m holmes_jax.plan``, the trainer's setup, the probe, the launcher, the
scripts), :func:`plan_request` converts its config once into a :class:`PlanRequest`:

- :class:`~holmes_jax.core.spec.ModelSpec`: the model's shape;
- :class:`RunSpec`: batch and numerics, what the cost model prices;
- :class:`ParallelSpec`: the degrees, pipeline, split and activation policy as asked (each
  possibly ``auto``: left to the planner) and the topology they are placed on;
- :class:`DilocoSpec`: the DiLoCo settings its strategy is priced and placed with.

The planner returns its decisions as data: a :class:`ParallelSpec` with nothing left
``auto`` (:func:`holmes_jax.planner.plans.resolve_auto`), a survivors' one
(:func:`holmes_jax.planner.failures.replan`). :func:`apply_parallel` writes one into the
config the trainer runs. Plain Python; no jax import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import (
    GRAD_BUCKET_CHOICES,
    REMAT_POLICIES,
    Degrees,
    Layout,
    ModelSpec,
    check_batch,
    check_choice,
    check_positive,
    outer_element_bytes,
    resolve_grad_buckets,
)

if TYPE_CHECKING:
    from holmes_jax.core.config import Config

ENGINES = ("holmes_jax", "megatron")
_BYTES = {"fp32": (4, 4, 4, 8), "bf16": (2, 2, 4, 12)}  # act, param, grad, optimizer


@dataclass(frozen=True)
class RunSpec:
    """Batch and numerics of a run (everything but the layout)."""

    global_batch_size: int  # sequences per optimizer step
    act_bytes: int = 2  # activations, p2p and tensor all-reduces (β)
    param_bytes: int = 2  # working copy of the parameters
    grad_bytes: int = 4  # gradients as reduced over data-parallel ranks
    optimizer_bytes: int = 12  # per parameter: fp32 master + Adam m, v (8 without master)
    remat: str = "none"  # activation policy (holmes_jax.planner.memory): none | full | selective
    attention: str = "xla"  # xla (fp32 [b, a/t, s, s] transients) | cudnn (fused)
    zero1: bool = True  # optimizer state sharded over data-parallel ranks
    overlap_grad_sync: bool = True  # gradient reduction overlapped with the pipeline drain
    # Collectives block the device until done (CPU runtimes such as gloo): the stages'
    # in-loop reductions add up instead of hiding behind each other (planner.step_time).
    sync_collectives: bool = False
    # parallel.grad_buckets: "layer" (each layer's gradient reduced as it completes, in
    # the loop), "step" (each leaf once, all layers at a time, after the loop), auto: step
    # with sync_collectives, else layer (holmes_jax.core.spec.resolve_grad_buckets).
    grad_buckets: str = "auto"
    # The implementation priced: "holmes_jax" (this trainer: a collective per parameter
    # leaf, the layer weights sliced out of the stacked slots) or "megatron" (Megatron-LM,
    # for the fidelity check: one flat gradient buffer, weights used in place). Both send
    # each micro-batch once per stage boundary and direction.
    engine: str = "holmes_jax"
    memory_fraction: float = 0.9  # usable fraction of device memory
    # Mechanisms of Megatron-LM 2022 (Korthikanti et al.), priced in time only, for the
    # fidelity check's runs that had them; holmes_jax's runtime has neither. tp_overlap:
    # the backward's tensor all-reduces hidden behind the weight-gradient matmuls.
    # sequence_parallel: the element-wise work outside attention and MLP split over t too.
    tp_overlap: bool = False
    sequence_parallel: bool = False
    # parallel.cross_island_dtype (resolved): the wire format of the sends between stages
    # on two islands (holmes_jax.runtime.engine.compress).
    cross_island_dtype: str = "same"

    def __post_init__(self):
        check_positive("train.global_batch_size", self.global_batch_size)
        if self.engine not in ENGINES:
            raise ConfigError(f"engine='{self.engine}': must be one of {', '.join(ENGINES)}")
        if not 0 < self.memory_fraction <= 1:
            raise ConfigError(f"memory_fraction={self.memory_fraction}: must be in (0, 1]")
        check_choice(self.grad_buckets, "parallel.grad_buckets", GRAD_BUCKET_CHOICES)
        if self.remat not in REMAT_POLICIES:
            raise ConfigError(
                f"model.remat='{self.remat}': must be one of {', '.join(REMAT_POLICIES)}"
            )

    @property
    def buckets(self) -> str:
        """``grad_buckets`` as run: ``layer`` or ``step`` (``auto`` by ``sync_collectives``)."""
        return resolve_grad_buckets(self.grad_buckets, self.sync_collectives)

    @property
    def reduction(self) -> str:
        """How the gradient reduction meets the pipeline: ``overlap`` (per-layer buckets,
        hidden behind the drain), ``sync`` (per-layer buckets on blocking collectives: the
        stages' reductions add up), ``exposed`` (after the loop, nothing hides it: one
        bucket per step, or ``overlap_grad_sync`` off)."""
        if self.buckets == "step":
            return "exposed"
        if self.sync_collectives:
            return "sync"
        return "overlap" if self.overlap_grad_sync else "exposed"

    @property
    def recompute(self) -> bool:
        """Full recomputation: the backward reruns every layer's forward."""
        return self.remat == "full"


@dataclass(frozen=True)
class ParallelSpec:
    """The parallelism a run asks for: the ``parallel`` keys and ``model.remat``.

    ``devices`` 0 is every visible device, ``data`` 0 the devices the other degrees leave.
    ``schedule``, ``layers_per_stage``, ``remat`` and ``cross_island_dtype`` may be ``auto``:
    the planner chooses. ``layers_per_stage`` None is an even split.
    """

    devices: int
    replica: int
    stages: int
    data: int
    tensor: int
    microbatches: int
    schedule: str
    virtual_stages: int
    layers_per_stage: tuple[int, ...] | str | None
    remat: str
    cross_island_dtype: str
    enforce_islands: bool  # false: the naive placement, data groups across islands
    mesh: str | None  # the topology file; None: one host, one island
    exclude_hosts: tuple[str, ...]  # hosts of ``mesh`` the run goes without
    replan_candidates: int = 1  # survivors' plans tried by the trainer (planner.failures)

    def layout(self, degrees: Degrees) -> Layout:
        """``degrees`` with these micro-batches and schedule (``auto``: 1F1B, the base the
        planner re-schedules)."""
        return Layout(
            degrees.stages,
            degrees.data,
            degrees.tensor,
            replica=degrees.replica,
            microbatches=self.microbatches,
            schedule="1f1b" if self.schedule == "auto" else self.schedule,
            virtual_stages=self.virtual_stages,
        )

    def degrees(self, available: int, global_batch_size: int) -> Degrees:
        """Resolve ``devices`` and ``data`` against the visible devices.

        Args:
          available: number of devices visible to the job (all processes).
          global_batch_size: sequences per step, which the data-parallel ranks must split.

        Returns:
          The mesh degrees (stages, data, tensor, replica).

        Raises:
          ConfigError: more devices asked for than exist, degrees that do not multiply to
            the device count, or a global batch the data-parallel size does not divide.
        """
        devices = self.devices or available
        if devices > available:
            raise ConfigError(
                f"parallel.devices={devices}: more devices asked for than exist ({available})"
            )
        fixed = self.replica * self.stages * self.tensor
        if self.data:
            if self.data * fixed != devices:
                raise ConfigError(
                    f"parallel.data={self.data}: replica*stages*data*tensor = {self.replica}*"
                    f"{self.stages}*{self.data}*{self.tensor} = {self.data * fixed} must equal "
                    f"the {devices} devices used (set parallel.devices or parallel.data: 0 for "
                    f"auto)"
                )
            data = self.data
        else:
            if devices % fixed:
                raise ConfigError(
                    f"parallel.replica*stages*tensor={fixed}: must divide the {devices} devices "
                    f"used"
                )
            data = devices // fixed
        check_batch(global_batch_size, self.replica, data, self.microbatches)
        return Degrees(stages=self.stages, data=data, tensor=self.tensor, replica=self.replica)


@dataclass(frozen=True)
class DilocoSpec:
    """DiLoCo as the planner prices and places it: the ``diloco`` keys of the same names."""

    enabled: bool | str  # true, false or auto (the planner decides)
    inner_steps: int  # H: inner steps per outer step
    fragments: int  # streaming DiLoCo above 1
    outer_dtype: str  # what crosses the link at an outer step
    outer_bytes: float  # bytes per parameter an outer sync sends (outer_element_bytes)
    warmup_steps: int  # K: the first K steps each end with an averaging sync
    auto_min_speedup: float  # enabled=auto picks DiLoCo only at this predicted speedup
    mode: str  # spmd: one job; independent: one job per island
    island: int  # independent: this job's island
    peers: tuple[str, ...]  # independent: every island's outer-sync addresses
    overlap_steps: int = 0  # independent: inner steps a round may travel during
    sparse: tuple[int, int, int] = (4096, 64, 2)  # outer_dtype sparse: chunk, k, bits


@dataclass(frozen=True)
class PlanRequest:
    """Everything the planner reads of a run (the module doc).

    ``run``'s ``remat`` and ``cross_island_dtype`` follow ``parallel``'s, set at construction
    (``auto`` priced as ``none`` and ``same``, the bases the planner compares against), so a
    request with another ``parallel`` is priced with its choices.
    """

    model: ModelSpec
    run: RunSpec
    parallel: ParallelSpec
    diloco: DilocoSpec
    steps: int  # train.steps: the run DiLoCo's warm-up syncs are spread over

    def __post_init__(self):
        p = self.parallel
        run = dataclasses.replace(
            self.run,
            remat="none" if p.remat == "auto" else p.remat,
            cross_island_dtype="same" if p.cross_island_dtype == "auto" else p.cross_island_dtype,
        )
        object.__setattr__(self, "run", run)

    def degrees(self, available: int) -> Degrees:
        """:meth:`ParallelSpec.degrees` with this run's global batch."""
        return self.parallel.degrees(available, self.run.global_batch_size)

    def with_parallel(self, parallel: ParallelSpec | None = None, **changes) -> PlanRequest:
        """This request with ``parallel`` (default: its own), ``changes`` applied to it."""
        parallel = dataclasses.replace(parallel or self.parallel, **changes)
        return dataclasses.replace(self, parallel=parallel)


def plan_request(cfg: Config, attention: str = "xla") -> PlanRequest:
    """The planner's view of ``cfg``: the one conversion from a config (module doc).

    Precision sets the byte sizes (fp32: 4-byte everything, Adam m and v; bf16: 2-byte
    weights and activations, fp32 gradients, fp32 master + Adam); ``optimizer.zero1``
    shards the optimizer state over ``data``; ``parallel.grad_buckets`` goes as it is
    (``auto`` resolves with ``sync_collectives``). ``attention`` is the resolved kernel
    (:func:`holmes_jax.runtime.model.decoder.attention_kernel`).
    """
    m, p, d = cfg.model, cfg.parallel, cfg.diloco
    act, param, grad, opt = _BYTES.get(cfg.train.precision, _BYTES["fp32"])
    run = RunSpec(
        cfg.train.global_batch_size,
        act,
        param,
        grad,
        opt,
        attention=attention,
        zero1=cfg.optimizer.zero1,
        grad_buckets=p.grad_buckets,
    )
    parallel = ParallelSpec(
        devices=p.devices,
        replica=p.replica,
        stages=p.stages,
        data=p.data,
        tensor=p.tensor,
        microbatches=p.microbatches,
        schedule=p.schedule,
        virtual_stages=p.virtual_stages,
        layers_per_stage=p.layers_per_stage,
        remat=m.remat,
        cross_island_dtype=p.cross_island_dtype,
        enforce_islands=p.enforce_islands,
        mesh=p.mesh,
        exclude_hosts=p.exclude_hosts,
        replan_candidates=p.replan_candidates,
    )
    diloco = DilocoSpec(
        enabled=d.enabled,
        inner_steps=d.inner_steps,
        fragments=d.fragments,
        outer_dtype=d.outer_dtype,
        outer_bytes=outer_element_bytes(
            "fp32" if d.outer_dtype == "auto" else d.outer_dtype,  # auto: priced as fp32
            d.sparse_chunk,
            d.sparse_k,
            d.sparse_bits,
        ),
        warmup_steps=d.warmup_steps,
        auto_min_speedup=d.auto_min_speedup,
        mode=d.mode,
        island=d.island,
        peers=d.peers,
        overlap_steps=d.overlap_steps,
        sparse=(d.sparse_chunk, d.sparse_k, d.sparse_bits),
    )
    return PlanRequest(m.spec, run, parallel, diloco, cfg.train.steps)


# The ParallelSpec fields that are ParallelConfig keys of the same name (remat is model's).
_PARALLEL_KEYS = tuple(f.name for f in dataclasses.fields(ParallelSpec) if f.name != "remat")


def apply_parallel(cfg: Config, parallel: ParallelSpec) -> Config:
    """``cfg`` set to run ``parallel``, a decision of the planner (degrees, pipeline, split,
    remat, cross-island format): the inverse of :func:`plan_request` for those keys."""
    keys = {k: getattr(parallel, k) for k in _PARALLEL_KEYS}
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, remat=parallel.remat),
        parallel=dataclasses.replace(cfg.parallel, **keys),
    )
