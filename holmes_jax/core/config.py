"""Frozen dataclass configs, loaded strictly from YAML, with dotted ``--set`` overrides.

A run is described by one :class:`Config` holding nine sections (model, data, parallel,
optimizer, diloco, train, checkpoint, logging, distributed). YAML is loaded strictly: an unknown
key, a wrong type or an impossible value raises :class:`~holmes_jax.core.errors.ConfigError`
whose one-line message names the key, the value and the rule; every number that sizes a
loop or an allocation has an upper bound (:data:`holmes_jax.core.spec.CONFIG_LIMITS`,
quoted in the field comments below), checked first. Derived values are properties, never
stored twice. Checks that need the device count (``parallel.devices``,
the data-parallel size) live in :func:`check_devices`, which the trainer calls once devices
are known.

Example::

    cfg = load_config("configs/quickstart.yaml", ["train.steps=100", "parallel.tensor=2"])
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any

from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import (
    ARCHS,
    ATTENTION_KERNELS,
    CONFIG_LIMITS,
    DILOCO_CHOICES,
    GRAD_BUCKET_CHOICES,
    OUTER_DTYPES,
    PRECISIONS,
    REMAT_CHOICES,
    SCHEDULE_CHOICES,
    Degrees,
    Layout,
    ModelSpec,
    check_choice,
    check_pipeline,
)
from holmes_jax.core.yamlio import apply_override, build_dataclass, plain, read_yaml

DATA_SOURCES = ("stdlib", "text", "tokens")
TOKEN_DTYPES = ("uint16", "uint32")
PROGRESS_MODES = ("auto", "bar", "plain", "none")


@dataclass(frozen=True)
class ModelConfig:
    """The decoder: ``gpt2`` (learned positions, pre-LayerNorm, GELU MLP, biases) or
    ``llama`` (rotary positions, pre-RMSNorm, SwiGLU MLP, grouped-query attention, no
    biases). ``num_kv_heads`` 0, ``mlp_size`` 0 and ``tied_embeddings`` null are resolved
    at construction (to num_heads, mlp_ratio x hidden_size and the arch's default)."""

    arch: str = "gpt2"  # gpt2 | llama
    vocab_size: int = 256  # <= 16777216
    # Embedding and head rows padded to a multiple of this (GPT-2's 50257 with 128: 50304,
    # which tensor 2, 4 or 8 divides); the padded logits are masked out.
    vocab_multiple: int = 1  # 1 = no padding; <= 65536
    seq_len: int = 128  # tokens per sequence (gpt2: also the learned positions); <= 16777216
    num_layers: int = 4  # <= 4096
    num_heads: int = 4  # <= 16384
    num_kv_heads: int = 0  # key/value heads (llama); 0 = num_heads; <= 16384
    hidden_size: int = 128  # <= 262144
    mlp_ratio: int = 4  # MLP width = mlp_ratio * hidden_size unless mlp_size is set; <= 64
    mlp_size: int = 0  # explicit MLP width; 0 = mlp_ratio * hidden_size; <= 16777216
    rope_base: float = 10000.0  # llama: rotary base theta (inv_freq = base^(-2i/head_dim))
    # Llama 3.1 rope_scaling (rope_type llama3); factor 0 = off.
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192  # original_max_position_embeddings
    norm_eps: float = 1e-5  # epsilon of every LayerNorm (gpt2) / RMSNorm (llama)
    dropout: float = 0.0
    # LM head reuses the token embedding; null = the arch's default (gpt2 true, llama false)
    tied_embeddings: bool | None = None
    # What a layer keeps for its backward: none (everything), full (only its input; the
    # forward is recomputed) or selective (matmul and attention outputs; norms, GELU and
    # softmax are recomputed); auto lets the planner pick the fastest that fits. YAML
    # true / false are read as full / none.
    remat: str | bool = "none"
    attention: str = "auto"  # auto (cuDNN on a CUDA device where it can run) | xla | cudnn

    def __post_init__(self):
        if isinstance(self.remat, bool):  # the old boolean switch
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        if self.tied_embeddings is None:
            object.__setattr__(self, "tied_embeddings", self.arch != "llama")
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.mlp_size == 0:
            object.__setattr__(self, "mlp_size", self.mlp_ratio * self.hidden_size)

    @property
    def spec(self) -> ModelSpec:
        """The model's shape (:class:`~holmes_jax.core.spec.ModelSpec`): the one home of
        its parameter and FLOP counts, shared with the planner."""
        return ModelSpec(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            seq_len=self.seq_len,
            vocab_size=self.padded_vocab,
            mlp_ratio=self.mlp_ratio,
            tied_embeddings=self.tied_embeddings,
            arch=self.arch,
            num_kv_heads=self.num_kv_heads,
            mlp_size=self.mlp_size,
        )

    @property
    def head_dim(self) -> int:
        return self.spec.head_dim

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding and columns of the head: ``vocab_size`` rounded up to a
        multiple of ``vocab_multiple`` (the extra logits are masked; no token uses them)."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    def validate(self) -> None:
        check_choice(self.arch, "model.arch", ARCHS)
        _positive(self, "model", ("vocab_size", "seq_len", "num_layers", "num_heads"))
        _positive(self, "model", ("vocab_multiple",))
        _positive(self, "model", ("num_kv_heads", "hidden_size", "mlp_ratio", "mlp_size"))
        _ = self.spec  # the shape's own rules (heads divide the hidden size, kv the heads)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout}: must be in [0, 1)")
        if self.rope_base <= 1.0:
            raise ConfigError(f"model.rope_base={self.rope_base}: must be > 1")
        if self.rope_scaling_factor:
            if self.rope_scaling_factor < 1.0:
                raise ConfigError(
                    f"model.rope_scaling_factor={self.rope_scaling_factor}: must be >= 1 "
                    f"(0 = no scaling)"
                )
            if not 0.0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
                raise ConfigError(
                    f"model.rope_low_freq_factor={self.rope_low_freq_factor}: must be > 0 and "
                    f"< model.rope_high_freq_factor={self.rope_high_freq_factor}"
                )
            _positive(self, "model", ("rope_original_max_positions",))
        if not 0.0 < self.norm_eps < 1.0:
            raise ConfigError(f"model.norm_eps={self.norm_eps}: must be in (0, 1)")
        if self.arch == "llama" and self.head_dim % 2:
            raise ConfigError(
                f"model.num_heads={self.num_heads}: llama's rotary embedding needs an even "
                f"head_dim, got hidden_size/num_heads = {self.head_dim}"
            )
        check_choice(self.remat, "model.remat", REMAT_CHOICES)
        check_choice(self.attention, "model.attention", ATTENTION_KERNELS)


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from. ``stdlib`` is the embedded offline corpus."""

    source: str = "stdlib"  # stdlib | text | tokens
    path: str | None = None  # text file/dir, or raw token file (memmap)
    token_dtype: str = "uint16"  # dtype of a raw token file
    eval_fraction: float = 0.05
    max_bytes: int = 16_000_000  # text read (stdlib/text); 0 = no cap; <= 1000000000000000

    def validate(self) -> None:
        check_choice(self.source, "data.source", DATA_SOURCES)
        check_choice(self.token_dtype, "data.token_dtype", TOKEN_DTYPES)
        if not 0.0 < self.eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction={self.eval_fraction}: must be in (0, 1)")
        if self.max_bytes < 0:
            raise ConfigError(f"data.max_bytes={self.max_bytes}: must be >= 0 (0 = no cap)")
        if self.source in ("text", "tokens"):
            # Existence is checked when the corpus is loaded (holmes_jax.runtime.data), so configs
            # for clusters validate on machines that do not hold their data.
            if not self.path:
                raise ConfigError(f"data.path=None: required when data.source='{self.source}'")
        elif self.path:
            raise ConfigError(
                f"data.path='{self.path}': only used with data.source=text or tokens "
                f"(data.source='{self.source}')"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """Mesh degrees and the pipeline. ``data: 0`` means "all remaining devices"."""

    mesh: str | None = None  # topology file (meshes/*.yaml); None = one host, one island
    devices: int = 0  # devices to use; 0 = all visible devices; <= 1048576
    data: int = 0  # data-parallel degree; 0 = devices / (stages * tensor); <= 1048576
    tensor: int = 1  # tensor-parallel degree (inside one host); <= 1024
    stages: int = 1  # pipeline stages; <= 4096
    layers_per_stage: tuple[int, ...] | str | None = None  # e.g. [1, 3] or "auto"
    microbatches: int = 1  # <= 1048576
    schedule: str = "gpipe"  # gpipe | 1f1b | interleaved | zb | auto (the planner picks)
    virtual_stages: int = 1  # model chunks per device (interleaved only, >= 2); <= 64
    replica: int = 1  # data-parallel copies across islands (hierarchical reduction); <= 256
    enforce_islands: bool = True  # false: allow data groups across islands (naive baseline)
    # When gradients are reduced over data (and replica): "layer" each layer's as soon as
    # its last backward completes (overlaps the backward with asynchronous collectives),
    # "step" every leaf once, all layers at a time, after the backward (a few collectives
    # per step); auto: step where collectives block (CPU), else layer.
    grad_buckets: str = "auto"  # auto | layer | step

    def layout(self, degrees: Degrees) -> Layout:
        """The resolved degrees with this config's micro-batches and schedule (``auto``:
        1F1B, the base the planner re-schedules; the trainer resolves ``auto`` first)."""
        return Layout(
            degrees.stages,
            degrees.data,
            degrees.tensor,
            replica=degrees.replica,
            microbatches=self.microbatches,
            schedule="1f1b" if self.schedule == "auto" else self.schedule,
            virtual_stages=self.virtual_stages,
        )

    def validate(self, model: ModelConfig) -> None:
        if self.devices < 0:
            raise ConfigError(f"parallel.devices={self.devices}: must be >= 0 (0 = all)")
        if self.data < 0:
            raise ConfigError(f"parallel.data={self.data}: must be >= 0 (0 = auto)")
        _positive(
            self, "parallel", ("tensor", "stages", "microbatches", "replica", "virtual_stages")
        )
        check_choice(self.schedule, "parallel.schedule", SCHEDULE_CHOICES)
        check_choice(self.grad_buckets, "parallel.grad_buckets", GRAD_BUCKET_CHOICES)
        if self.schedule == "auto":
            if self.virtual_stages != 1 or isinstance(self.layers_per_stage, tuple):
                raise ConfigError(
                    f"parallel.schedule='auto': the planner chooses virtual_stages and "
                    f"layers_per_stage too (got virtual_stages={self.virtual_stages}, "
                    f"layers_per_stage={self.layers_per_stage}; leave them unset or auto)"
                )
        else:
            check_pipeline(self.schedule, self.stages, self.virtual_stages)
        # Interleaved: one entry per virtual stage (chunk c of stage s is virtual stage
        # c*stages + s, the order a micro-batch visits them).
        chunks = self.stages * self.virtual_stages
        lps = self.layers_per_stage
        if isinstance(lps, str) and lps != "auto":
            raise ConfigError(
                f"parallel.layers_per_stage='{lps}': must be a list of ints or 'auto'"
            )
        if isinstance(lps, tuple):
            if len(lps) != chunks:
                what = "stage" if self.virtual_stages == 1 else "stage x virtual stage"
                raise ConfigError(
                    f"parallel.layers_per_stage={list(lps)}: needs one entry per {what} ({chunks})"
                )
            if min(lps) < 1:
                raise ConfigError(
                    f"parallel.layers_per_stage={list(lps)}: every stage needs >= 1 layer"
                )
            if sum(lps) != model.num_layers:
                raise ConfigError(
                    f"parallel.layers_per_stage={list(lps)}: must sum to "
                    f"model.num_layers={model.num_layers}"
                )
        elif chunks > model.num_layers:
            raise ConfigError(
                f"parallel.stages={self.stages} x virtual_stages={self.virtual_stages}: more "
                f"pipeline chunks than model.num_layers={model.num_layers}"
            )
        if model.num_heads % self.tensor or model.mlp_size % self.tensor:
            raise ConfigError(
                f"parallel.tensor={self.tensor}: must divide model.num_heads="
                f"{model.num_heads} and the MLP width {model.mlp_size}"
            )
        if model.num_kv_heads % self.tensor:
            raise ConfigError(
                f"parallel.tensor={self.tensor}: must divide model.num_kv_heads="
                f"{model.num_kv_heads} (each tensor rank holds whole key/value heads)"
            )
        if model.padded_vocab % self.tensor:
            padded = (
                f" padded to {model.padded_vocab} (model.vocab_multiple={model.vocab_multiple})"
                if model.padded_vocab != model.vocab_size
                else ""
            )
            raise ConfigError(
                f"parallel.tensor={self.tensor}: must divide model.vocab_size="
                f"{model.vocab_size}{padded}; set model.vocab_multiple to a multiple of "
                f"{self.tensor} (e.g. 128) to pad the vocabulary"
            )


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup, cosine decay, global-norm clipping, masked weight decay."""

    learning_rate: float = 1e-3  # peak
    min_lr_ratio: float = 0.1  # final lr = learning_rate * min_lr_ratio
    warmup_steps: int = 100  # <= 1000000000
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # applied to matmul kernels and embeddings only
    grad_clip: float = 1.0  # global-norm clip; 0 = off
    zero1: bool = True  # shard optimizer state over data; reduce-scatter gradients

    def validate(self) -> None:
        if self.learning_rate <= 0:
            raise ConfigError(f"optimizer.learning_rate={self.learning_rate}: must be > 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optimizer.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        if self.warmup_steps < 0:
            raise ConfigError(f"optimizer.warmup_steps={self.warmup_steps}: must be >= 0")
        for name in ("b1", "b2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ConfigError(f"optimizer.{name}={value}: must be in [0, 1)")
        for name in ("eps", "weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise ConfigError(f"optimizer.{name}={getattr(self, name)}: must be >= 0")


@dataclass(frozen=True)
class DilocoConfig:
    """DiLoCo across the ``replica`` axis (one replica per island or group of islands).

    Each replica takes ``inner_steps`` AdamW steps on its own; then the replicas average
    their parameter deltas (the outer gradient, sent as ``outer_dtype``) and apply an
    outer Nesterov-momentum SGD step to the last global parameters. With ``fragments`` > 1
    (streaming DiLoCo) the layers are cut into that many fragments, each synchronised on
    its own step offset inside the H steps, so the peak cross-island volume drops by that
    factor. ``enabled: auto`` lets the planner choose DiLoCo only when its predicted
    speedup over the best synchronous plan is at least ``auto_min_speedup``. With
    ``warmup_steps`` = K the first K steps each end with plain averaging of the replicas
    (the DiLoCo paper starts from a synchronously trained model; averaging every step is
    the nearest thing across a slow link), and the H-step rounds start after step K.
    """

    enabled: bool | str = False  # true | false | auto
    inner_steps: int = 50  # H: inner steps per outer step; <= 1000000
    outer_lr: float = 0.7
    outer_momentum: float = 0.9  # Nesterov
    fragments: int = 1  # >= 1: streaming DiLoCo; <= inner_steps and num_layers; <= 4096
    outer_dtype: str = "fp32"  # fp32 | bf16 | int8: what crosses the link (state stays fp32)
    auto_min_speedup: float = 1.5  # enabled=auto picks DiLoCo only at this predicted speedup
    # The first K steps each end with plain averaging of the replicas (every fragment,
    # outer lr 1, momentum untouched: a synchronous-like start); then rounds of H steps.
    warmup_steps: int = 0  # K; <= 1000000000

    def validate(self, model: ModelConfig, parallel: ParallelConfig) -> None:
        if (
            self.enabled not in DILOCO_CHOICES
            or isinstance(self.enabled, int)
            and not (isinstance(self.enabled, bool))
        ):
            raise ConfigError(f"diloco.enabled={self.enabled!r}: must be true, false or auto")
        _positive(self, "diloco", ("inner_steps", "fragments"))
        check_choice(self.outer_dtype, "diloco.outer_dtype", OUTER_DTYPES)
        if self.outer_lr <= 0:
            raise ConfigError(f"diloco.outer_lr={self.outer_lr}: must be > 0")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"diloco.outer_momentum={self.outer_momentum}: must be in [0, 1)")
        if self.warmup_steps < 0:
            raise ConfigError(
                f"diloco.warmup_steps={self.warmup_steps}: must be >= 0 (0 = no warm-up)"
            )
        if self.auto_min_speedup < 1:
            raise ConfigError(
                f"diloco.auto_min_speedup={self.auto_min_speedup}: must be >= 1 (a speedup)"
            )
        if self.fragments > self.inner_steps:
            raise ConfigError(
                f"diloco.fragments={self.fragments}: must be <= diloco.inner_steps="
                f"{self.inner_steps} (each fragment syncs on its own inner step)"
            )
        if self.fragments > model.num_layers:
            raise ConfigError(
                f"diloco.fragments={self.fragments}: must be <= model.num_layers="
                f"{model.num_layers} (a fragment holds whole layers)"
            )
        if self.enabled is True and parallel.replica < 2 and parallel.mesh is None:
            raise ConfigError(
                f"diloco.enabled=true: needs parallel.replica >= 2 (got {parallel.replica}) "
                "or a parallel.mesh with several islands: DiLoCo runs across replicas"
            )


@dataclass(frozen=True)
class TrainConfig:
    """Loop length, batch, evaluation, and the run directory where outputs go."""

    steps: int = 1000  # <= 1000000000
    global_batch_size: int = 32  # sequences per optimizer step, all devices; <= 1048576
    seed: int = 0  # >= 0, <= 4294967295
    precision: str = "fp32"  # fp32 | bf16 (bf16 params and compute, fp32 master and reduction)
    eval_every: int = 100  # 0 = only at the end; <= 1000000000
    eval_batches: int = 8  # <= 100000
    run_dir: str | None = None  # holds the auto outputs and config.yaml; null = none
    metrics_path: str | None = "auto"  # JSON lines; auto = <train.run_dir>/metrics.jsonl

    def validate(self) -> None:
        _positive(self, "train", ("steps", "global_batch_size", "eval_batches"))
        check_choice(self.precision, "train.precision", PRECISIONS)
        if self.seed < 0:
            raise ConfigError(f"train.seed={self.seed}: must be >= 0")
        if self.eval_every < 0:
            raise ConfigError(f"train.eval_every={self.eval_every}: must be >= 0 (0 = at end)")
        if self.run_dir is not None and not self.run_dir.strip():
            raise ConfigError("train.run_dir='': must be a path, or null for none")


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints; a run resumes from the newest one in ``dir``, or else starts from
    the parameters in ``init_from`` (fine-tuning: a fresh optimizer at step 0)."""

    dir: str | None = "auto"  # auto = <train.run_dir>/checkpoints; null = no checkpoints
    every: int = 0  # steps between saves; 0 = at the end (and on SIGTERM); <= 1000000000
    keep: int = 3  # keep the newest N; <= 10000
    async_save: bool = True
    resume: bool = True
    # Parameters to start from: `python -m holmes_jax.hf import`'s output, or another run's
    # checkpoint directory (its newest step) or step. A run whose dir already holds
    # checkpoints resumes from them instead. Read when the run starts.
    init_from: str | None = None

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError(f"checkpoint.every={self.every}: must be >= 0 (0 = at end)")
        _positive(self, "checkpoint", ("keep",))
        if self.init_from is not None and not self.init_from.strip():
            raise ConfigError("checkpoint.init_from='': must be a path, or null for none")


@dataclass(frozen=True)
class LoggingConfig:
    """Terminal output, TensorBoard, and the peak used for MFU."""

    log_every: int = 10  # <= 1000000000
    progress: str = "auto"  # auto (bar on a terminal) | bar | plain | none
    tensorboard_dir: str | None = "auto"  # event files; auto = <train.run_dir>/tb; null = none
    peak_tflops: float | None = None  # per device; MFU is reported when set; <= 1e+09

    def validate(self) -> None:
        _positive(self, "logging", ("log_every",))
        check_choice(self.progress, "logging.progress", PROGRESS_MODES)
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"logging.peak_tflops={self.peak_tflops}: must be > 0")


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-process (multi-host) launch; all unset = a single process or auto-detection."""

    coordinator_address: str | None = None  # host:port of process 0; None = auto-detect
    num_processes: int = 0  # 0 = auto-detect (SLURM / Open MPI / Kubernetes); <= 1048576
    process_id: int = -1  # -1 = auto-detect; <= 1048576
    heartbeat_timeout_s: int = 30  # a silent peer is declared dead after this; <= 1000000
    initialization_timeout_s: int = 300  # waiting for all processes to join; <= 1000000

    def validate(self) -> None:
        if self.num_processes < 0:
            raise ConfigError(f"distributed.num_processes={self.num_processes}: must be >= 0")
        if self.process_id < -1:
            raise ConfigError(f"distributed.process_id={self.process_id}: must be >= -1")
        if self.num_processes and self.process_id >= self.num_processes:
            raise ConfigError(
                f"distributed.process_id={self.process_id}: must be < "
                f"distributed.num_processes={self.num_processes}"
            )
        _positive(self, "distributed", ("heartbeat_timeout_s", "initialization_timeout_s"))


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def validate(self) -> None:
        """Checks that need no devices. Raises ConfigError."""
        for key, bound in CONFIG_LIMITS.items():  # first: nothing below sizes anything huge
            value = getattr(getattr(self, key.split(".")[0]), key.split(".")[1])
            if value is not None:
                bound.check(key, value)
        self.model.validate()
        self.data.validate()
        self.parallel.validate(self.model)
        self.optimizer.validate()
        self.diloco.validate(self.model, self.parallel)
        self.train.validate()
        self.checkpoint.validate()
        self.logging.validate()
        self.distributed.validate()
        if self.data.source != "tokens" and self.model.vocab_size < 256:
            raise ConfigError(
                f"model.vocab_size={self.model.vocab_size}: the byte tokenizer of "
                f"data.source='{self.data.source}' needs >= 256"
            )
        if self.parallel.data:
            _check_batch(self, self.parallel.data * self.parallel.replica)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (lists for tuples), the inverse of :func:`config_from_dict`."""
        return plain(dataclasses.asdict(self))

    def replace(self, **sections: Any) -> Config:
        return dataclasses.replace(self, **sections)


# --------------------------------------------------------------------------- devices


def check_devices(cfg: Config, available: int) -> Degrees:
    """Resolve ``parallel.devices`` and ``parallel.data`` against the visible devices.

    Args:
      cfg: a validated config.
      available: number of devices visible to the job (all processes).

    Returns:
      The mesh degrees (stages, data, tensor).

    Raises:
      ConfigError: more devices asked for than exist, degrees that do not multiply to the
        device count, or a global batch the data-parallel size does not divide.
    """
    p = cfg.parallel
    devices = p.devices or available
    if devices > available:
        raise ConfigError(
            f"parallel.devices={devices}: more devices asked for than exist ({available})"
        )
    fixed = p.replica * p.stages * p.tensor
    if p.data:
        if p.data * fixed != devices:
            raise ConfigError(
                f"parallel.data={p.data}: replica*stages*data*tensor = {p.replica}*{p.stages}*"
                f"{p.data}*{p.tensor} = {p.data * fixed} must equal the {devices} devices used "
                f"(set parallel.devices or parallel.data: 0 for auto)"
            )
        data = p.data
    else:
        if devices % fixed:
            raise ConfigError(
                f"parallel.replica*stages*tensor={fixed}: must divide the {devices} devices used"
            )
        data = devices // fixed
    _check_batch(cfg, data * p.replica)
    return Degrees(stages=p.stages, data=data, tensor=p.tensor, replica=p.replica)


def _check_batch(cfg: Config, data: int) -> None:
    batch = cfg.train.global_batch_size
    if batch % data:
        raise ConfigError(
            f"train.global_batch_size={batch}: must be divisible by the data-parallel size {data}"
        )
    if batch % (data * cfg.parallel.microbatches):
        raise ConfigError(
            f"train.global_batch_size={batch}: must be divisible by data-parallel size * "
            f"parallel.microbatches = {data}*{cfg.parallel.microbatches}"
        )


# --------------------------------------------------------------------------- loading


def load_config(path: str | os.PathLike | None, overrides: typing.Sequence[str] = ()) -> Config:
    """Load a YAML config strictly and apply dotted ``key=value`` overrides.

    Args:
      path: YAML file, or None for the built-in defaults.
      overrides: strings like ``"train.steps=100"`` or ``"parallel.layers_per_stage=[1,3]"``;
        values are parsed as YAML and then type-checked like file values.

    Returns:
      A validated :class:`Config`.

    Raises:
      ConfigError: unreadable file, unknown key, wrong type or impossible value.
    """
    raw: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        loaded = read_yaml(path, f"--config '{path}': file")
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
        raw = loaded
    for item in overrides:
        apply_override(raw, item)
    return config_from_dict(raw, source)


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> Config:
    """Build and validate a Config from nested plain data (YAML or checkpoint metadata)."""
    try:
        cfg = build_dataclass(Config, raw, "")
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    cfg.validate()
    return cfg


def _positive(obj: Any, section: str, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise ConfigError(f"{section}.{name}={value}: must be > 0")
