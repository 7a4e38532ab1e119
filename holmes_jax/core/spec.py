"""The shape of a model and of a run's parallelism: one home for each fact.

Everything that more than one layer must agree on is defined here once:

- the names a config may choose from (:data:`SCHEDULES`, :data:`REMAT_POLICIES`, ...);
- :class:`ModelSpec`, the model's shape, with its parameter counts and the number of
  parameter leaves the trainer reduces one by one;
- the FLOP counts (L layers, hidden h, seq s, vocab V, MLP width f, b sequences, k the
  key/value width, m = 2 MLP matmuls for GELU, 3 for SwiGLU):

  - one layer forward ``2·b·s·(2h² + 2h·k) + 2·m·b·s·h·f + 4·b·s²·h``, attention over the
    full square; for GPT-2 (k = h, m = 2, f = r·h) ``2(4 + 2r)·b·s·h² + 4·b·s²·h``;
  - LM head forward ``2·b·s·h·V``; backward = 2x forward;
  - remat ``full`` reruns a forward per layer, ``selective`` the scores (``2·b·s²·h``);

- :class:`Degrees` (replica x stages x data x tensor) and :class:`Layout`, degrees plus
  micro-batches and schedule;
- the limits (:class:`Bound`): an upper bound on every number that sizes a loop or an
  allocation, so a typo (``hosts: 1000000000000``) is a one-line error, not an endless
  allocation. ``docs/configuration.md`` is generated from :data:`CONFIG_LIMITS`;
- the batch rule (:func:`check_batch`) and the split rules of ``parallel.layers_per_stage``
  (:func:`check_split`, :func:`even_split`).

The planner, the trainer's MFU (:func:`flops_per_token`) and the fidelity check
(:func:`megatron_flops`) share these counts. Plain Python; no jax import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any, Literal, get_args

from holmes_jax.core.errors import ConfigError

# The value sets, as types: a config field annotated with one takes only its values (the
# YAML reader checks them, holmes_jax.core.yamlio), and each tuple is the same set.
# pipeline schedules (holmes_jax.planner.schedule); auto: the planner picks schedule, v, split
Schedule = Literal["gpipe", "1f1b", "interleaved", "zb"]
ScheduleChoice = Literal[Schedule, "auto"]
RematPolicy = Literal["none", "full", "selective"]  # what the model runs
RematChoice = Literal[RematPolicy, "auto"]  # auto: the planner picks one that fits
AttentionKernel = Literal["auto", "xla", "cudnn"]
Arch = Literal["gpt2", "llama"]  # model.arch (holmes_jax.runtime.model.decoder)
Precision = Literal["fp32", "bf16"]
# What crosses the link at a DiLoCo outer step (the outer state itself stays fp32).
OuterDtype = Literal["fp32", "bf16", "int8", "sparse"]
OuterDtypeChoice = Literal[OuterDtype, "auto"]  # auto: the planner picks (planner.outer_formats)
# outer_dtype sparse (holmes_jax.diloco.sparse): value bits, and the chunk's bounds (powers
# of two; a chunk's count travels as uint16)
SPARSE_BITS, SPARSE_CHUNK_MIN, SPARSE_CHUNK_MAX = (2, 4, 8, 32), 16, 1 << 15
OUTER_DENSE_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0}  # per element (diloco.codec)


def outer_element_bytes(outer_dtype: str, chunk: int, k: int, bits: int) -> float:
    """Bytes a DiLoCo outer sync sends per parameter: the dense dtype's width, or for
    ``sparse`` an island's delta in a large tensor: per chunk, ``k`` positions of
    ``log2(chunk)`` bits and values of ``bits``, a uint16 count and an fp32 scale
    (:mod:`holmes_jax.diloco.sparse`)."""
    if outer_dtype != "sparse":
        return OUTER_DENSE_BYTES[outer_dtype]
    sent = min(k, chunk) * (chunk.bit_length() - 1 + bits) + 16 + 32
    return sent / chunk / 8


DilocoEnabled = Literal[True, False, "auto"]  # auto: the planner decides
# parallel.grad_buckets: when the data-parallel gradient reduction runs (runtime.engine.zero).
GradBuckets = Literal["layer", "step"]
GradBucketChoice = Literal[GradBuckets, "auto"]
# Wire formats of the pipeline sends that cross islands (holmes_jax.runtime.engine.compress).
CrossIslandDtype = Literal["same", "bf16", "int8", "fp8"]
CrossIslandChoice = Literal[CrossIslandDtype, "auto"]

# The sets code iterates over or checks against outside the config reader.
SCHEDULES = get_args(Schedule)
REMAT_POLICIES, REMAT_CHOICES = get_args(RematPolicy), get_args(RematChoice)
ARCHS, OUTER_DTYPES = get_args(Arch), get_args(OuterDtype)
GRAD_BUCKETS, GRAD_BUCKET_CHOICES = get_args(GradBuckets), get_args(GradBucketChoice)
CROSS_ISLAND_DTYPES = get_args(CrossIslandDtype)


def resolve_grad_buckets(value: str, blocking: bool) -> str:
    """``parallel.grad_buckets`` as run: ``auto`` is ``step`` where collectives block the
    device (CPU runtimes such as gloo: a per-layer reduction cannot overlap anything and
    each collective is one more rendezvous) and ``layer`` elsewhere (GPU: asynchronous
    collectives hide behind the rest of the backward)."""
    check_choice(value, "parallel.grad_buckets", GRAD_BUCKET_CHOICES)
    if value == "auto":
        return "step" if blocking else "layer"
    return value


def check_positive(key: str, value) -> None:
    """Raise a one-line :class:`ConfigError` unless ``value`` is an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}={value!r}: must be an integer >= 1")


def check_choice(value: Any, key: str, allowed: tuple[Any, ...]) -> None:
    """Raise a one-line :class:`ConfigError` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ConfigError(not_one_of(value, key, allowed))


def not_one_of(value: Any, key: str, allowed: tuple[Any, ...]) -> str:
    """The line that says ``value`` is not one of ``allowed``."""
    names = ", ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in allowed)
    return f"{key}={value!r}: must be one of {names}"


def check_pipeline(schedule: str, stages: int, virtual_stages: int) -> None:
    """The schedule / stages / virtual-stages rules, one line each.

    ``interleaved`` needs >= 2 stages and ``virtual_stages`` >= 2 (with 1 it is ``1f1b``);
    every other schedule runs one chunk per device (``virtual_stages`` 1).
    """
    if schedule == "interleaved":
        if stages < 2 or virtual_stages < 2:
            raise ConfigError(
                f"parallel.schedule='interleaved': needs parallel.stages >= 2 and "
                f"parallel.virtual_stages >= 2 (got stages={stages}, "
                f"virtual_stages={virtual_stages}; with 1 chunk per device use 1f1b)"
            )
    elif virtual_stages != 1:
        raise ConfigError(
            f"parallel.virtual_stages={virtual_stages}: only parallel.schedule='interleaved' "
            f"runs more than one chunk per device (schedule='{schedule}')"
        )


def check_split(
    layers_per_stage: Sequence[int], stages: int, num_layers: int, chunks: int = 1
) -> list[int]:
    """The ``parallel.layers_per_stage`` rules: one count >= 1 per stage (per virtual stage
    with ``chunks`` > 1; chunk c of stage s is entry ``c·stages + s``), summing to the layers.

    Returns:
      The split as a list of ints.

    Raises:
      ConfigError: naming the split and the rule it breaks.
    """
    split = [int(x) for x in layers_per_stage]
    if len(split) != stages * chunks:
        what = "stage" if chunks == 1 else f"stage x virtual stage ({stages} x {chunks})"
        raise ConfigError(
            f"parallel.layers_per_stage={split}: needs one entry per {what} (stages={stages})"
        )
    if min(split) < 1:
        raise ConfigError(f"parallel.layers_per_stage={split}: every stage needs >= 1 layer")
    if sum(split) != num_layers:
        raise ConfigError(
            f"parallel.layers_per_stage={split}: must sum to model.num_layers={num_layers}"
        )
    return split


def even_split(num_layers: int, parts: int) -> list[int]:
    """``layers_per_stage`` unset: ``num_layers`` as even as possible over ``parts`` (stages
    x virtual stages), the first ``num_layers % parts`` one layer more."""
    base, extra = divmod(num_layers, parts)
    return [base + (k < extra) for k in range(parts)]


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder of one of the :data:`ARCHS`.

    - ``gpt2``: learned positions, pre-LayerNorm (scale and bias), biases on every matmul,
      fused QKV, GELU MLP ``proj(gelu(fc(x)))``.
    - ``llama``: rotary positions (no position table), pre-RMSNorm (scale only), no
      biases, grouped-query attention (``num_kv_heads`` key/value heads), SwiGLU MLP
      ``down(silu(gate(x)) * up(x))``.

    ``num_kv_heads`` 0 means ``num_heads``; ``mlp_size`` 0 means ``mlp_ratio x hidden``
    (both resolved at construction, so the attributes always hold the real values).
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    seq_len: int
    vocab_size: int
    mlp_ratio: int = 4
    tied_embeddings: bool = True
    arch: str = "gpt2"
    num_kv_heads: int = 0
    mlp_size: int = 0  # MLP width f; 0 = mlp_ratio x hidden

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_heads", "seq_len", "vocab_size"):
            check_positive(f"model.{name}", getattr(self, name))
        check_positive("model.mlp_ratio", self.mlp_ratio)
        check_choice(self.arch, "model.arch", ARCHS)
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"model.num_heads={self.num_heads}: must divide model.hidden_size="
                f"{self.hidden_size}"
            )
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.mlp_size == 0:
            object.__setattr__(self, "mlp_size", self.mlp_ratio * self.hidden_size)
        check_positive("model.num_kv_heads", self.num_kv_heads)
        check_positive("model.mlp_size", self.mlp_size)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_kv_heads={self.num_kv_heads}: must divide model.num_heads="
                f"{self.num_heads}"
            )
        if self.arch == "gpt2" and self.num_kv_heads != self.num_heads:
            raise ConfigError(
                f"model.num_kv_heads={self.num_kv_heads}: grouped-query attention needs "
                f"model.arch=llama (gpt2 has num_heads={self.num_heads} key/value heads)"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection: num_kv_heads x head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def gated(self) -> bool:
        """SwiGLU (three MLP matmuls) rather than GELU (two)."""
        return self.arch == "llama"

    @property
    def mlp_matmuls(self) -> int:
        return 3 if self.gated else 2

    @property
    def layer_params(self) -> int:
        """Attention (q, k, v, output) + MLP weights (+ biases for gpt2) + two norms.

        gpt2: ``4h² + 2hf`` weights, ``3h + h + f + h`` biases, two LayerNorms ``4h``;
        llama: ``2h² + 2hk + 3hf`` weights, two RMSNorms ``2h``.
        """
        h, f, k = self.hidden_size, self.mlp_size, self.kv_size
        weights = 2 * h * h + 2 * h * k + self.mlp_matmuls * h * f
        if self.arch == "llama":
            return weights + 2 * h
        return weights + (h + 2 * k) + h + f + h + 4 * h

    @property
    def position_params(self) -> int:
        """Learned positions (gpt2); rotary positions have none."""
        return self.seq_len * self.hidden_size if self.arch == "gpt2" else 0

    @property
    def norm_params(self) -> int:
        """One norm: LayerNorm scale + bias (gpt2) or RMSNorm scale (llama)."""
        return (2 if self.arch == "gpt2" else 1) * self.hidden_size

    @property
    def embedding_params(self) -> int:
        """Token embedding (+ learned positions for gpt2)."""
        return self.vocab_size * self.hidden_size + self.position_params

    @property
    def head_params(self) -> int:
        """Final norm, plus the LM head matrix when it is not tied."""
        head = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return self.norm_params + head

    @property
    def num_params(self) -> int:
        """All parameters, a tied embedding counted once."""
        return self.num_layers * self.layer_params + self.embedding_params + self.head_params

    # Parameter leaves (one collective call each in the trainer's gradient reduction and
    # parameter all-gather), as runtime.model.decoder builds them. gpt2: QKV, attention output, MLP
    # in and out kernels, their biases, LayerNorm scale+bias x2 (12); token + position
    # embeddings; final LayerNorm (+ untied head). llama: q, k, v, output, gate, up, down,
    # two norm scales (9); token embedding; final norm scale (+ untied head).
    @property
    def layer_leaf_params(self) -> tuple[int, ...]:
        """Parameters of each leaf of one layer; they sum to :attr:`layer_params`."""
        h, f, k = self.hidden_size, self.mlp_size, self.kv_size
        if self.arch == "llama":
            return (h * h, h * k, h * k, h * h, h * f, h * f, f * h, h, h)
        return (h * (h + 2 * k), h * h, h * f, f * h, h + 2 * k, h, f, h, h, h, h, h)

    @property
    def embedding_leaf_params(self) -> tuple[int, ...]:
        """Parameters of each embedding leaf: tokens (+ learned positions for gpt2)."""
        positions = (self.position_params,) if self.arch == "gpt2" else ()
        return (self.vocab_size * self.hidden_size, *positions)

    @property
    def head_leaf_params(self) -> tuple[int, ...]:
        """Parameters of each head leaf: the final norm's (+ the untied LM head)."""
        h = self.hidden_size
        norm = (h, h) if self.arch == "gpt2" else (h,)
        return norm + (() if self.tied_embeddings else (self.vocab_size * h,))

    @property
    def layer_leaves(self) -> int:
        return len(self.layer_leaf_params)

    @property
    def embedding_leaves(self) -> int:
        return len(self.embedding_leaf_params)

    @property
    def head_leaves(self) -> int:
        return len(self.head_leaf_params)


# --------------------------------------------------------------------------- FLOPs


def layer_fwd_flops(model: ModelSpec, b: int) -> float:
    """Forward FLOPs of one transformer layer on ``b`` sequences (whole layer, all t):
    ``2·b·s·(2h² + 2h·k) + 2·m·b·s·h·f + 4·b·s²·h`` (k: key/value width, m: MLP matmuls)."""
    h, s, f, k = model.hidden_size, model.seq_len, model.mlp_size, model.kv_size
    projections = 2 * b * s * (2 * h * h + 2 * h * k)
    mlp = 2 * model.mlp_matmuls * b * s * h * f
    return projections + mlp + 4 * b * s * s * h


def head_fwd_flops(model: ModelSpec, b: int) -> float:
    """Forward FLOPs of the LM head (logits) on ``b`` sequences."""
    return 2 * b * model.seq_len * model.hidden_size * model.vocab_size


def scores_fwd_flops(model: ModelSpec, b: int) -> float:
    """Forward FLOPs of one layer's attention scores q·kᵀ on ``b`` sequences (what
    selective remat reruns in the backward)."""
    return 2 * b * model.seq_len * model.seq_len * model.hidden_size


def iteration_flops(model: ModelSpec, batch: int, recompute: bool | str) -> float:
    """FLOPs of one iteration: 3 passes per unit, plus what the remat policy reruns.

    ``recompute``: a policy (``none``, ``selective``: the attention scores q·kᵀ,
    ``2·b·s²·h`` per layer; ``full``: a whole forward per layer) or a bool (True = full).
    Full is the hardware count Megatron-LM and Holmes report and equals
    :func:`megatron_flops` for mlp_ratio 4; none is the model FLOPs.
    """
    policy = {True: "full", False: "none"}.get(recompute, recompute)
    L = model.num_layers
    extra = {
        "full": L * layer_fwd_flops(model, batch),
        "selective": L * scores_fwd_flops(model, batch),
    }
    base = 3 * L * layer_fwd_flops(model, batch) + 3 * head_fwd_flops(model, batch)
    return base + extra.get(policy, 0.0)


def megatron_flops(model: ModelSpec, batch: int, recompute: bool = True) -> float:
    """Narayanan et al. 2021, eq. 3: ``96·B·s·L·h²·(1 + s/6h + V/16Lh)`` (recompute).

    Without recompute: ``72·B·s·L·h²·(1 + s/6h + V/12Lh)``. Assumes mlp_ratio 4.
    """
    L, h, s, V = model.num_layers, model.hidden_size, model.seq_len, model.vocab_size
    if recompute:
        return 96 * batch * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return 72 * batch * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))


@dataclass(frozen=True)
class FlopsPerToken:
    """Training FLOPs per token of one optimizer step (forward + backward)."""

    model: float  # 6N + attention, no recompute (what MFU counts)
    hardware: float  # what runs: model + what the remat policy reruns
    megatron: float  # Megatron's 96·L·h²·(1 + s/6h + V/16Lh) (full recompute), per token


def flops_per_token(model: ModelSpec, remat: str) -> FlopsPerToken:
    """Model, hardware (under ``remat``) and Megatron FLOPs per trained token: the
    per-sequence counts of :func:`iteration_flops` and :func:`megatron_flops` over s."""
    s = model.seq_len
    return FlopsPerToken(
        model=iteration_flops(model, 1, "none") / s,
        hardware=iteration_flops(model, 1, remat) / s,
        megatron=megatron_flops(model, 1) / s,
    )


# --------------------------------------------------------------------------- degrees


@dataclass(frozen=True)
class Degrees:
    """Parallel degrees: r replicas x p stages x d data x t tensor, outermost first.

    ``replica`` is data parallelism across islands (one pipeline per island), ``stage``
    the pipeline, ``data`` data parallelism (ZeRO-1) inside an island, ``tensor`` tensor
    parallelism inside a host.
    """

    stages: int
    data: int
    tensor: int
    replica: int = 1

    def __post_init__(self):
        for name in ("stages", "data", "tensor", "replica"):
            check_positive(f"parallel.{name}", getattr(self, name))

    @property
    def num_devices(self) -> int:
        return self.replica * self.stages * self.data * self.tensor


@dataclass(frozen=True)
class Layout(Degrees):
    """Degrees plus the pipeline: micro-batches per step and the schedule.

    The pipeline fields are keyword-only: ``Layout(4, 2, 1, microbatches=8)``.
    """

    _: KW_ONLY
    microbatches: int
    schedule: str = "1f1b"
    # Interleaved 1F1B (Narayanan et al. 2021): v model chunks per device shrink the bubble
    # v-fold and multiply p2p traffic by v. Only with schedule "interleaved" (v >= 2).
    virtual_stages: int = 1

    def __post_init__(self):
        super().__post_init__()
        for name in ("microbatches", "virtual_stages"):
            check_positive(f"parallel.{name}", getattr(self, name))
        check_choice(self.schedule, "parallel.schedule", SCHEDULES)
        check_pipeline(self.schedule, self.stages, self.virtual_stages)

    def microbatch_size(self, global_batch_size: int) -> int:
        """Sequences per micro-batch per data-parallel rank (:func:`check_batch`)."""
        return check_batch(global_batch_size, self.replica, self.data, self.microbatches)


def check_batch(
    global_batch_size: int, replica: int = 1, data: int = 1, microbatches: int = 1
) -> int:
    """The batch rule: every replica x data rank takes an equal share of every micro-batch.

    Returns:
      Sequences per micro-batch per rank: ``global_batch_size / (replica·data·microbatches)``.

    Raises:
      ConfigError: the global batch does not split evenly; the one message of this rule.
    """
    parts = replica * data * microbatches
    if global_batch_size % parts:
        raise ConfigError(
            f"train.global_batch_size={global_batch_size}: must be divisible by "
            f"parallel.replica*data*microbatches = {replica}*{data}*{microbatches} = {parts} "
            f"(each data-parallel rank takes an equal share of each micro-batch)"
        )
    return global_batch_size // parts


# --------------------------------------------------------------------------- limits


@dataclass(frozen=True)
class Bound:
    """An inclusive upper bound (and, for measured figures, a least value), named in errors:
    ``islands[0].hosts=1000000000000: must be <= 100000 (hosts per island)``."""

    limit: int | float
    what: str  # the words that name the bound in an error
    least: float | None = None  # smallest positive value a figure may take (floats only)

    @property
    def text(self) -> str:
        """The limit as errors and docs write it: ``100000``, ``1e+09``."""
        return f"{self.limit:g}" if isinstance(self.limit, float) else str(self.limit)

    def check(self, key: str, value) -> None:
        """Raise a one-line :class:`ConfigError` unless ``value`` (a number) is in bounds.
        Zero and negative values are the caller's rule (``must be > 0`` and the like)."""
        if value > self.limit:
            raise ConfigError(f"{key}={value!r}: must be <= {self.text} ({self.what})")
        if self.least is not None and 0 < value < self.least:
            raise ConfigError(f"{key}={value!r}: must be >= {self.least:g} ({self.what})")


# Topologies (holmes_jax.planner.topology): the largest clusters today hold ~10^5 devices.
ISLANDS = Bound(256, "islands per topology")
HOSTS = Bound(100_000, "hosts per island")
DEVICES_PER_HOST = Bound(1024, "devices per host")  # also simulated CPU devices
DEVICES = Bound(1_048_576, "devices in all")
BANDWIDTH = Bound(1e9, "Gbit/s per link", least=1e-6)
LATENCY = Bound(1e9, "microseconds of latency")
TFLOPS = Bound(1e9, "TFLOP/s per device", least=1e-9)
MEMORY_GB = Bound(1e9, "GB per device", least=1e-6)
MEMORY_GBS = Bound(1e9, "GB/s of memory bandwidth per device", least=1e-6)
GID_INDEX = Bound(65_535, "RoCE GID table index")
# Models and runs (holmes_jax.core.config): the largest models today have ~10^2 layers,
# hidden ~3x10^4, vocabularies ~3x10^5, contexts ~10^7 tokens.
LAYERS = Bound(4096, "layers")
STAGES = Bound(LAYERS.limit, "pipeline stages: one layer each at least")
HIDDEN = Bound(262_144, "hidden size")
HEADS = Bound(16_384, "attention heads")
MLP_RATIO = Bound(64, "MLP width per hidden unit")
MLP = Bound(HIDDEN.limit * MLP_RATIO.limit, "MLP width")
SEQ = Bound(16_777_216, "tokens per sequence")
VOCAB = Bound(16_777_216, "vocabulary size")
VOCAB_MULTIPLE = Bound(65_536, "vocabulary padding multiple")
BATCH = Bound(1_048_576, "sequences per step")
VIRTUAL_STAGES = Bound(64, "model chunks per device")
INNER_STEPS = Bound(1_000_000, "inner steps per DiLoCo outer step")
STEPS = Bound(1_000_000_000, "steps")
EVAL_BATCHES = Bound(100_000, "evaluation batches")
INJECTED = Bound(10_000, "injected non-finite steps")  # train.inject_nonfinite_steps
KEEP = Bound(10_000, "checkpoints kept")
DATA_BYTES = Bound(10**15, "bytes of text read")
SEED = Bound(4_294_967_295, "a 32-bit seed")
TIMEOUT_S = Bound(1_000_000, "seconds; jax counts timeouts in 32-bit milliseconds")
# Profiles (holmes_jax.planner.profiles) and the probe (python -m holmes_jax.probe).
LAYER_S = Bound(1e6, "seconds per layer", least=1e-12)
ACT_BYTES = Bound(8, "bytes per activation")
REPEATS = Bound(100_000, "timed runs")
MESSAGE_BYTES = Bound(1 << 36, "bytes per device per message")
# Files and the planner.
FILE_BYTES = Bound(16_777_216, "bytes per config, topology or profile file")
DEPTH = Bound(100, "levels of YAML nesting")  # the parser recurses per level
# The exact split (holmes_jax.planner.partition) builds (stages, layers+1, layers+1) float
# tables, several at once: a placement above this many cells is not split exactly.
SPLIT_CELLS = Bound(1 << 24, "cells of the exact split's stages x (layers+1)^2 cost table")

# The config keys each bound applies to (holmes_jax.core.config checks them first).
CONFIG_LIMITS: dict[str, Bound] = {
    "model.vocab_size": VOCAB,
    "model.vocab_multiple": VOCAB_MULTIPLE,
    "model.seq_len": SEQ,
    "model.num_layers": LAYERS,
    "model.num_heads": HEADS,
    "model.hidden_size": HIDDEN,
    "model.mlp_ratio": MLP_RATIO,
    "model.num_kv_heads": HEADS,
    "model.mlp_size": MLP,
    "data.max_bytes": DATA_BYTES,
    "parallel.devices": DEVICES,
    "parallel.data": DEVICES,
    "parallel.tensor": DEVICES_PER_HOST,
    "parallel.stages": STAGES,
    "parallel.microbatches": BATCH,
    "parallel.virtual_stages": VIRTUAL_STAGES,
    "parallel.replica": ISLANDS,
    "diloco.inner_steps": INNER_STEPS,
    "diloco.fragments": LAYERS,
    "diloco.warmup_steps": STEPS,
    "diloco.quorum_timeout_s": TIMEOUT_S,
    "diloco.down_wait_s": TIMEOUT_S,
    "optimizer.warmup_steps": STEPS,
    "train.steps": STEPS,
    "train.global_batch_size": BATCH,
    "train.seed": SEED,
    "train.eval_every": STEPS,
    "train.eval_batches": EVAL_BATCHES,
    "train.max_skipped_steps": STEPS,
    "checkpoint.every": STEPS,
    "checkpoint.keep": KEEP,
    "logging.log_every": STEPS,
    "logging.peak_tflops": TFLOPS,
    "distributed.num_processes": DEVICES,
    "distributed.process_id": DEVICES,
    "distributed.heartbeat_timeout_s": TIMEOUT_S,
    "distributed.initialization_timeout_s": TIMEOUT_S,
}
