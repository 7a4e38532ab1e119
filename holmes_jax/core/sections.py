"""The sections of a run's config, one frozen dataclass each (``diloco``:
:mod:`holmes_jax.core.diloco_config`).

Each field is documented once, where it is defined:

- its meaning is its comment: the ``#`` lines directly above the field, then the ``#``
  comment on its line;
- its upper bound is in :data:`holmes_jax.core.spec.CONFIG_LIMITS`;
- its allowed values, where it has a fixed set, are its type: a ``Literal`` of
  :mod:`holmes_jax.core.spec` (collected in :data:`holmes_jax.core.config.CONFIG_CHOICES`).

``docs/configuration.md`` is generated from these (:mod:`holmes_jax.core.configdoc`).

A section's ``validate`` checks the rules of its own fields (and of the sections it names).
It assumes :meth:`Config.validate <holmes_jax.core.config.Config.validate>` has checked the
bounds and the choices first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import (
    INJECTED,
    STEPS,
    Arch,
    AttentionKernel,
    CrossIslandChoice,
    GradBucketChoice,
    ModelSpec,
    Precision,
    RematChoice,
    ScheduleChoice,
    check_pipeline,
    check_split,
)

DataSource = Literal["stdlib", "text", "tokens"]
TokenDtype = Literal["uint16", "uint32"]
ProgressMode = Literal["auto", "bar", "plain", "none"]


@dataclass(frozen=True)
class ModelConfig:
    """The decoder: ``gpt2`` (learned positions, pre-LayerNorm, GELU MLP, biases) or
    ``llama`` (rotary positions, pre-RMSNorm, SwiGLU MLP, grouped-query attention, no
    biases). ``num_kv_heads`` 0, ``mlp_size`` 0 and ``tied_embeddings`` null are resolved
    at construction (to num_heads, mlp_ratio x hidden_size and the arch's default)."""

    arch: Arch = "gpt2"  # the decoder family (see above)
    vocab_size: int = 256  # token ids are 0 .. vocab_size - 1
    # Embedding and head rows are padded to a multiple of this; 1 = no padding. The padded
    # logits are masked out. GPT-2's 50257 with 128 gives 50304, which tensor 2, 4 or 8 divides.
    vocab_multiple: int = 1
    seq_len: int = 128  # tokens per sequence (gpt2: also the learned positions)
    num_layers: int = 4  # transformer layers
    num_heads: int = 4  # attention (query) heads
    num_kv_heads: int = 0  # key/value heads (llama); 0 = num_heads
    hidden_size: int = 128  # width of the residual stream
    mlp_ratio: int = 4  # MLP width = mlp_ratio * hidden_size unless mlp_size is set
    mlp_size: int = 0  # explicit MLP width; 0 = mlp_ratio * hidden_size
    rope_base: float = 10000.0  # llama: rotary base theta (inv_freq = base^(-2i/head_dim))
    rope_scaling_factor: float = 0.0  # Llama 3.1 rope_scaling (rope_type llama3); 0 = off
    rope_low_freq_factor: float = 1.0  # Llama 3.1 rope_scaling: low_freq_factor
    rope_high_freq_factor: float = 4.0  # Llama 3.1 rope_scaling: high_freq_factor
    rope_original_max_positions: int = 8192  # rope_scaling: original_max_position_embeddings
    norm_eps: float = 1e-5  # epsilon of every LayerNorm (gpt2) / RMSNorm (llama)
    dropout: float = 0.0  # dropout probability of the embedding and every layer; 0 = off
    # The LM head reuses the token embedding; null = the arch's default (gpt2 true, llama false).
    tied_embeddings: bool | None = None
    # What a layer keeps for its backward: none (everything), full (only its input; the
    # forward is recomputed) or selective (matmul and attention outputs; norms, GELU and
    # softmax are recomputed); auto lets the planner pick the fastest that fits. YAML
    # true / false are read as full / none.
    remat: RematChoice | bool = "none"
    # attention kernel; auto = cuDNN on a CUDA device where it can run
    attention: AttentionKernel = "auto"

    def __post_init__(self):
        if isinstance(self.remat, bool):  # YAML true / false
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


NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a mixture source's or eval set's name (a metric key)


@dataclass(frozen=True)
class MixSource:
    """One source of ``data.mixture``: a shard set (as ``data.path``) and its weight."""

    name: str
    path: str | tuple[str, ...]
    weight: float = 1.0  # its share of every batch's rows, relative to the others'


@dataclass(frozen=True)
class EvalSet:
    """One of ``data.eval``: a held-out shard set (as ``data.path``), logged by name."""

    name: str
    path: str | tuple[str, ...]


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from: ``stdlib``, the running interpreter's standard library (an
    offline corpus every machine has); ``text``, a text file or a directory of them (both
    byte-tokenized); or ``tokens``, token shards that ``python -m holmes_jax.data prepare``
    writes: a file, a directory, a glob or a list of them, local or a URL (``gs://``,
    ``s3://``)."""

    source: DataSource = "stdlib"  # the corpus (see above)
    # text: a file or directory; tokens: shard file(s), directory, glob, or a list of them
    path: str | tuple[str, ...] | None = None
    token_dtype: TokenDtype = "uint16"  # dtype of a raw token file
    eval_fraction: float = 0.05  # share of the corpus held out for evaluation
    max_bytes: int = 16_000_000  # bytes of text read (stdlib, text); 0 = no cap
    # tokens, instead of data.path: [{name, path, weight}], each source its weight's share
    # of every batch's rows; each one's held-out tail is evaluated as eval/<name>/loss
    mixture: tuple[MixSource, ...] = ()
    # tokens: [{name, path}], held-out shard sets, each evaluated as eval/<name>/loss
    eval: tuple[EvalSet, ...] = ()
    prefetch: int = 2  # batches each process reads ahead of the step

    def validate(self) -> None:
        if not 0.0 < self.eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction={self.eval_fraction}: must be in (0, 1)")
        if self.max_bytes < 0:
            raise ConfigError(f"data.max_bytes={self.max_bytes}: must be >= 0 (0 = no cap)")
        if self.prefetch < 0:
            raise ConfigError(f"data.prefetch={self.prefetch}: must be >= 0 (0 = no read-ahead)")
        for key, sets in (("data.mixture", self.mixture), ("data.eval", self.eval)):
            if sets and self.source != "tokens":
                raise ConfigError(f"{key}: needs data.source=tokens (data.source={self.source!r})")
            names = [s.name for s in sets]
            for i, name in enumerate(names):
                if not NAME.fullmatch(name) or name in names[:i]:
                    raise ConfigError(
                        f"{key}[{i}].name={name!r}: must be unique, of letters, digits, "
                        "'_', '.' and '-'"
                    )
        if self.mixture:
            weights = [m.weight for m in self.mixture]
            if min(weights) < 0 or not sum(weights) > 0:
                raise ConfigError(
                    f"data.mixture weights {weights}: each must be >= 0 and their sum > 0"
                )
            if self.path:
                raise ConfigError(
                    f"data.path={self.path!r}: unset it with data.mixture (each source has its own)"
                )
            return
        if self.source in ("text", "tokens"):
            # Existence is checked when the corpus is loaded (runtime/data/loader.py), so
            # configs for clusters validate on machines that do not hold their data.
            if not self.path:
                raise ConfigError(
                    f"data.path={self.path!r}: required when data.source='{self.source}'"
                )
            if self.source == "text" and not isinstance(self.path, str):
                raise ConfigError(
                    f"data.path={list(self.path)}: data.source='text' reads one file or directory"
                )
        elif self.path:
            raise ConfigError(
                f"data.path='{self.path}': only used with data.source=text or tokens "
                f"(data.source='{self.source}')"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """Mesh degrees and the pipeline. ``data: 0`` means "all remaining devices"."""

    mesh: str | None = None  # topology file (meshes/*.yaml); null = one host, one island
    devices: int = 0  # devices to use; 0 = all visible devices
    data: int = 0  # data-parallel degree; 0 = devices / (replica * stages * tensor)
    tensor: int = 1  # tensor-parallel degree (inside one host)
    stages: int = 1  # pipeline stages
    # Layers of each stage (interleaved: of each virtual stage), e.g. [1, 3]; null = an even
    # split; auto = the planner's split.
    layers_per_stage: tuple[int, ...] | str | None = None
    microbatches: int = 1  # micro-batches per step and data-parallel rank (the pipeline's)
    schedule: ScheduleChoice = "gpipe"  # pipeline schedule; auto = the planner picks it
    virtual_stages: int = 1  # model chunks per device (interleaved only, >= 2)
    replica: int = 1  # data-parallel copies across islands (hierarchical reduction)
    enforce_islands: bool = True  # false: allow data groups across islands (naive baseline)
    # Hosts of parallel.mesh to run without (a failure's survivors): the trainer re-plans
    # degrees, micro-batches, schedule, split and remat for the rest, same global batch.
    exclude_hosts: tuple[str, ...] = ()
    # With exclude_hosts: the planner's fastest plans for the survivors that each run a few
    # steps before training (runtime/replan_trial.py); the fastest measured trains. 1: the
    # fastest predicted trains, untried.
    replan_candidates: int = 2
    # When gradients are reduced over data (and replica): "layer" each layer's as soon as
    # its last backward completes (overlaps the backward with asynchronous collectives),
    # "step" every leaf once, all layers at a time, after the backward (a few collectives
    # per step); auto: step where collectives block (CPU), else layer.
    grad_buckets: GradBucketChoice = "auto"
    # Wire format of pipeline activations and their gradients sent between stages on two
    # islands (same: the compute dtype; int8 / fp8: one fp32 scale per token row); auto: the
    # planner's pick, bf16 when it predicts a step >= 5% shorter, else same.
    cross_island_dtype: CrossIslandChoice = "same"

    def validate(self, model: ModelConfig) -> None:
        if self.exclude_hosts and not self.mesh:
            raise ConfigError(
                f"parallel.exclude_hosts={list(self.exclude_hosts)}: needs parallel.mesh "
                "(the topology whose hosts it names)"
            )
        if self.devices < 0:
            raise ConfigError(f"parallel.devices={self.devices}: must be >= 0 (0 = all)")
        if self.data < 0:
            raise ConfigError(f"parallel.data={self.data}: must be >= 0 (0 = auto)")
        _positive(
            self,
            "parallel",
            ("tensor", "stages", "microbatches", "replica", "virtual_stages", "replan_candidates"),
        )
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
            check_split(lps, self.stages, model.num_layers, self.virtual_stages)
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

    learning_rate: float = 1e-3  # peak learning rate, reached after the warmup
    min_lr_ratio: float = 0.1  # final lr = learning_rate * min_lr_ratio
    warmup_steps: int = 100  # steps of linear warmup from 0
    b1: float = 0.9  # Adam's first-moment decay
    b2: float = 0.95  # Adam's second-moment decay
    eps: float = 1e-8  # Adam's denominator epsilon
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
class TrainConfig:
    """Loop length, batch, evaluation, and the run directory where outputs go."""

    steps: int = 1000  # the step the run ends at; a resumed run trains up to it
    global_batch_size: int = 32  # sequences per optimizer step, all devices
    seed: int = 0  # seeds the initial parameters and the batches; >= 0
    precision: Precision = "fp32"  # bf16: bf16 params and compute, fp32 master and reduction
    eval_every: int = 100  # steps between evaluations; 0 = only at the end
    eval_batches: int = 8  # batches per evaluation
    # The run's directory: checkpoints, metrics, TensorBoard events and config.yaml go
    # inside it (the outputs set to auto). A run that starts fresh never writes into one
    # holding another run's records: it moves to <run_dir>-2, -3, ...; null = none.
    run_dir: str | None = None
    # JSON lines, one object per logged step; auto = <train.run_dir>/metrics.jsonl
    metrics_path: str | None = "auto"
    # jax's persistent compilation cache, so a restart skips the compile; auto =
    # <train.run_dir>/compile_cache on GPUs and TPUs, none on CPU devices (XLA:CPU can
    # abort on a cached program), and JAX_COMPILATION_CACHE_DIR wins over it; null = none
    # of ours (JAX_COMPILATION_CACHE_DIR still applies); a path wins over both.
    compilation_cache: str | None = "auto"
    # With several CPU processes and a cache: each process keeps its own executables there
    # (train step, eval, checkpoint layout), which a restart loads without tracing (jax
    # caches process 0's alone); jax's own cache is then off in the job (XLA:CPU in jaxlib
    # 0.10.2 fails to run some of its executables serialized again)
    executable_store: bool = True
    # A step whose loss or gradient norm is not finite changes no parameter or optimizer
    # state and is counted (skipped_steps in the metrics); more than this many in a row
    # stop the run with one line and exit code 4, before any checkpoint past them is saved.
    max_skipped_steps: int = 5
    # Fault injection for tests: these steps (as logged, from 1) get a non-finite loss and
    # gradients; launch --fail-host HOST@STEP:nan sets it for the job holding HOST. Compiled
    # in only when set, so the default run's program is unchanged; [] = none.
    inject_nonfinite_steps: tuple[int, ...] = ()

    def validate(self) -> None:
        _positive(self, "train", ("steps", "global_batch_size", "eval_batches"))
        if self.max_skipped_steps < 0:
            raise ConfigError(
                f"train.max_skipped_steps={self.max_skipped_steps}: must be >= 0 "
                "(0 = stop at the first non-finite step)"
            )
        steps = self.inject_nonfinite_steps
        if len(steps) > INJECTED.limit:
            raise ConfigError(
                f"train.inject_nonfinite_steps=[{steps[0]}, ...]: {len(steps)} steps, must be "
                f"<= {INJECTED.text} ({INJECTED.what})"
            )
        for step in steps:
            if not 1 <= step <= STEPS.limit:
                raise ConfigError(
                    f"train.inject_nonfinite_steps={list(steps)}: step {step} must be >= 1 "
                    f"and <= {STEPS.text} (steps count from 1, as logged)"
                )
        if self.seed < 0:
            raise ConfigError(f"train.seed={self.seed}: must be >= 0")
        if self.eval_every < 0:
            raise ConfigError(f"train.eval_every={self.eval_every}: must be >= 0 (0 = at end)")
        if self.run_dir is not None and not self.run_dir.strip():
            raise ConfigError("train.run_dir='': must be a path, or null for none")
        if self.compilation_cache is not None and not self.compilation_cache.strip():
            raise ConfigError("train.compilation_cache='': must be auto, a path, or null for none")


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints; a run resumes from the newest one in ``dir``, or else starts from
    the parameters in ``init_from`` (fine-tuning: a fresh optimizer at step 0)."""

    # a local path or gs://bucket/path; auto = <train.run_dir>/checkpoints; null = none
    dir: str | None = "auto"
    every: int = 0  # steps between saves; 0 = at the end (and on SIGTERM)
    keep: int = 3  # how many of the newest checkpoints are kept
    async_save: bool = True  # write in the background while training goes on
    resume: bool = True  # start from the newest checkpoint in dir when there is one
    # Parameters to start from: `python -m holmes_jax.hf import`'s output, a Hugging Face
    # model directory (imported on the fly; its config.json must match the model section),
    # or another run's checkpoint directory (its newest step) or step, local or gs://. A run
    # whose dir already holds checkpoints resumes from them instead. Read when it starts.
    init_from: str | None = None

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError(f"checkpoint.every={self.every}: must be >= 0 (0 = at end)")
        _positive(self, "checkpoint", ("keep",))
        if self.init_from is not None and not self.init_from.strip():
            raise ConfigError("checkpoint.init_from='': must be a path, or null for none")


@dataclass(frozen=True)
class LoggingConfig:
    """Terminal output, TensorBoard, Weights & Biases, the peak used for MFU, and profiler
    traces (``profile_steps``: ``START:N`` traces steps START+1 .. START+N on every process;
    START >= 1 keeps the compiling first step out)."""

    log_every: int = 10  # steps between printed and recorded metrics
    progress: ProgressMode = "auto"  # how progress prints; auto = a bar on a terminal, else plain
    tensorboard_dir: str | None = "auto"  # event files; auto = <train.run_dir>/tb; null = none
    peak_tflops: float | None = None  # per device, for MFU; null = the device kind's datasheet peak
    # A jax.profiler trace of N steps after step START, as "START:N" (e.g. 2:2: steps 3 and
    # 4); train --profile START:N sets it; null = none.
    profile_steps: str | None = None
    # Profiler traces, one directory per process; auto = <train.run_dir>/profile; null = none.
    profile_dir: str | None = "auto"
    # Weights & Biases project the metrics also go to (WANDB_MODE=offline works; needs the
    # wandb package); null = off.
    wandb: str | None = None

    @property
    def profile_window(self) -> tuple[int, int] | None:
        """``profile_steps`` as (START, N), or None; call after :meth:`validate`."""
        if self.profile_steps is None:
            return None
        start, count = self.profile_steps.split(":")
        return int(start), int(count)

    def validate(self, train: TrainConfig) -> None:
        _positive(self, "logging", ("log_every",))
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"logging.peak_tflops={self.peak_tflops}: must be > 0")
        for name in ("profile_dir", "wandb"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ConfigError(f"logging.{name}='': must be a non-empty string, or null")
        if self.profile_steps is not None:
            self._check_profile(train)

    def _check_profile(self, train: TrainConfig) -> None:
        key = f"logging.profile_steps='{self.profile_steps}'"
        parts = re.fullmatch(r"([0-9]{1,10}):([0-9]{1,10})", self.profile_steps)
        if parts is None:
            raise ConfigError(f"{key}: must be START:N (trace N steps after step START, e.g. 2:2)")
        start, count = int(parts[1]), int(parts[2])
        if start < 1:
            raise ConfigError(f"{key}: START must be >= 1 (step 1 compiles: it is never traced)")
        if count < 1:
            raise ConfigError(f"{key}: N must be >= 1 (the number of steps traced)")
        if start + count > train.steps:
            raise ConfigError(
                f"{key}: START+N={start + count} must be <= train.steps={train.steps}"
            )
        if self.profile_dir is None:
            raise ConfigError(f"{key}: needs logging.profile_dir (null: nowhere to write)")
        if self.profile_dir == "auto" and train.run_dir is None:
            raise ConfigError(
                f"{key}: needs train.run_dir (logging.profile_dir=auto is "
                "<train.run_dir>/profile) or a logging.profile_dir path"
            )


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-process (multi-host) launch; all unset = a single process or auto-detection."""

    coordinator_address: str | None = None  # host:port of process 0; null = auto-detect
    num_processes: int = 0  # processes in the job; 0 = auto-detect (SLURM, Open MPI, k8s)
    process_id: int = -1  # this process's rank; -1 = auto-detect
    heartbeat_timeout_s: int = 30  # a silent peer is declared dead after this many seconds
    initialization_timeout_s: int = 300  # seconds to wait for all processes to join

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


def _positive(obj: Any, section: str, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise ConfigError(f"{section}.{name}={value}: must be > 0")
