"""Fidelity check: the cost model against published Megatron-LM throughput.

Reference: Narayanan et al. 2021 (arXiv 2104.04473), Table 1. GPT models from 1.7B to 1T
parameters on up to 3072 A100-80GB GPUs (DGX A100 nodes: 8 GPUs on NVSwitch, 8 x 200
Gbit/s HDR InfiniBand per node), sequence 2048, vocabulary 51200, mixed precision, full
recomputation. Throughput is counted with eq. 3 (:func:`holmes_jax.core.spec.megatron_flops`).

The prediction models those runs as they were made: fp16 parameters and activations,
fp32 gradients all-reduced after the backward pass (no overlap, no ZeRO), fp32 master
weights and Adam state, tied embeddings, micro-batch 1 and 1F1B. :func:`calibrate` fits
two numbers together (minimax relative error over the table):

- the fraction of peak the matmuls reach (:data:`~holmes_jax.planner.placement.DEFAULT_EFFICIENCY`);
- the bytes element-wise work moves per stored activation byte
  (:data:`~holmes_jax.planner.placement.DEFAULT_ELEMENTWISE_PASSES`). The memory-bound
  share of a layer falls as 1/h, so the efficiency alone cannot fit every model size.

Deep pipelines: :data:`DEEP_RUNS` are published runs with 8 or more stages or interleaving
that the calibration did not see. :data:`DEEP_RUNS_LOWER` rest on an unstated detail or on
unseen hardware. :func:`deep_fidelity_table` prices each with the same calibration and the
mechanisms each run had (``DeepRun.tp_overlap``, ``DeepRun.sequence_parallel``), and
reports the throughput error beside the error under the row's alternative reading
(``python scripts/fidelity_deep.py``). Pure Python; no jax import.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from holmes_jax.core.plan_request import RunSpec
from holmes_jax.core.spec import Layout, ModelSpec
from holmes_jax.planner.partition import uniform_split
from holmes_jax.planner.placement import Calibration
from holmes_jax.planner.search import plan_for_layout
from holmes_jax.planner.step_time import even_chunks
from holmes_jax.planner.topology import Topology, topology_from_dict

SOURCE = "Narayanan et al. 2021 (arXiv 2104.04473), Table 1"
A100_PEAK_TFLOPS = 312.0


@dataclass(frozen=True)
class MegatronRun:
    """One row of Table 1."""

    params_b: float  # billions, as published
    num_heads: int
    hidden_size: int
    num_layers: int
    tensor: int
    stages: int
    gpus: int
    batch: int
    tflops_per_gpu: float  # published achieved teraFLOP/s per GPU
    # The 2022 mechanisms (DeepRun's switches); the 2021 Table 1 runs had neither.
    tp_overlap: bool = False
    sequence_parallel: bool = False

    @property
    def data(self) -> int:
        return self.gpus // (self.tensor * self.stages)

    @property
    def virtual_stages(self) -> int:
        """Interleaving factor: the smallest v > 1 dividing the layers per stage (1 for
        p <= 2, where Megatron-LM does not interleave)."""
        per_stage = self.num_layers // self.stages
        if self.stages <= 2:
            return 1
        return min(v for v in range(2, per_stage + 1) if per_stage % v == 0)

    @property
    def label(self) -> str:
        v = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        return (
            f"{self.params_b:g}B h={self.hidden_size} L={self.num_layers} "
            f"{self.gpus} GPUs t{self.tensor} p{self.stages}{v} B{self.batch}"
        )


TABLE_1 = (
    MegatronRun(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    MegatronRun(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    MegatronRun(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    MegatronRun(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    MegatronRun(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    MegatronRun(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    MegatronRun(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    MegatronRun(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    MegatronRun(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    MegatronRun(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def selene(gpus: int) -> Topology:
    """A Selene slice of ``gpus`` A100-80GB GPUs as one InfiniBand island."""
    return topology_from_dict(
        {
            "name": f"selene-{gpus}",
            "intra_host": {"bandwidth_gbps": 2400, "latency_us": 5},  # NVSwitch, per GPU
            "islands": [
                {
                    "name": "selene",
                    "nic": "infiniband",
                    "link": {"bandwidth_gbps": 1600, "latency_us": 5},  # 8 x 200 HDR
                    "hosts": gpus // 8,
                    "devices_per_host": 8,
                    "device_kind": "A100-SXM4-80GB",
                    "peak_tflops": A100_PEAK_TFLOPS,
                    "memory_gb": 80,
                    "memory_bandwidth_gbs": 2039,
                }
            ],
        },
        source="<selene>",
    )


def predict_run(run: MegatronRun, calibration: Calibration | None = None) -> float:
    """Predicted teraFLOP/s per GPU (eq. 3 FLOPs / predicted iteration time)."""
    model = ModelSpec(run.num_layers, run.hidden_size, run.num_heads, 2048, 51200)
    plan = _megatron_plan(
        selene(run.gpus),
        model,
        run,
        microbatches=run.batch // run.data,
        totals=uniform_split(run.num_layers, run.stages),
        remat="full",
        zero1=False,
        overlap_grad_sync=False,
        calibration=calibration,
    )
    return plan.tflops_per_device


def _chunked(totals: list[int], chunks: int) -> list[int]:
    """A split with ``chunks`` entries per stage (the interleaved schedule's virtual stages,
    each stage's layers as even as possible), or ``totals`` itself without interleaving."""
    return even_chunks(totals, chunks) if chunks > 1 else list(totals)


def calibrate(
    runs: tuple[MegatronRun, ...] = TABLE_1, elementwise_passes: float | None = None
) -> Calibration:
    """The calibration minimising the worst relative error over ``runs``.

    For a given ``elementwise_passes`` the efficiency is a golden-section search: predicted
    throughput rises monotonically with it, so the worst-error curve is unimodal on
    [0.3, 0.95]. Without one, the passes are searched the same way on [0.5, 4] around that
    inner search (each a few hundred predictions; about 15 s in all).
    """

    def fit_efficiency(passes: float) -> tuple[float, Calibration]:
        def worst(eff: float) -> float:
            cal = Calibration(eff, passes)
            return max(abs(predict_run(r, cal) / r.tflops_per_gpu - 1) for r in runs)

        eff = _golden(worst, 0.3, 0.95, 30)
        return worst(eff), Calibration(eff, passes)

    if elementwise_passes is not None:
        return fit_efficiency(elementwise_passes)[1]
    passes = _golden(lambda k: fit_efficiency(k)[0], 0.5, 4.0, 20)
    return fit_efficiency(passes)[1]


def _golden(f, lo: float, hi: float, iters: int) -> float:
    """The minimiser of a unimodal ``f`` on [lo, hi] (golden-section search)."""
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = f(a), f(b)
    for _ in range(iters):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = f(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = f(b)
    return (lo + hi) / 2


def fidelity_table(calibration: Calibration | None = None) -> list[dict]:
    """One row per Table 1 entry: configuration, published, predicted, relative error."""
    rows = []
    for run in TABLE_1:
        pred = predict_run(run, calibration)
        rows.append(
            {
                "configuration": run.label,
                "published_tflops": run.tflops_per_gpu,
                "predicted_tflops": round(pred, 1),
                "error": pred / run.tflops_per_gpu - 1,
                "source": SOURCE,
            }
        )
    return rows


# --------------------------------------------------------------------------- deep pipelines
#
# The same model, calibrated on Table 1 only, against published runs with 8 or more
# pipeline stages or interleaving. Every row states where its numbers come from and what
# it assumes. A row whose answer moves a lot under a plausible alternative assumption goes
# to DEEP_RUNS_LOWER (reported separately), never tuned.

KORTHIKANTI = "Korthikanti et al. 2022 (arXiv 2205.05198)"
NARAYANAN = "Narayanan et al. 2021 (arXiv 2104.04473)"
MTNLG = "Smith et al. 2022 (arXiv 2201.11990)"
LLAMA3 = "Llama 3 herd, Dubey et al. 2024 (arXiv 2407.21783)"

# NVIDIA H100 SXM5 (datasheet): 989.4 TFLOP/s dense BF16 (1,979 with 2:4 sparsity), 80 GB
# HBM3 at 3.35 TB/s, NVLink 4 at 900 GB/s per GPU in both directions together (450 GB/s =
# 3600 Gbit/s each way, the unit `intra_host` uses, as `selene()`'s 2400 for A100's 600).
H100_PEAK_TFLOPS = 989.4


def grand_teton(gpus: int) -> Topology:
    """Meta's Llama 3 405B cluster: Grand Teton hosts of 8 H100-80GB on NVLink, one RoCE
    fabric with a 400 Gbit/s interconnect per GPU (Llama 3 paper §3.3.1), as one island."""
    return topology_from_dict(
        {
            "name": f"grand-teton-{gpus}",
            "intra_host": {"bandwidth_gbps": 3600, "latency_us": 5},  # NVLink 4, each way
            "islands": [
                {
                    "name": "roce",
                    "nic": "roce",
                    "link": {"bandwidth_gbps": 3200, "latency_us": 10},  # 8 x 400 Gbit/s
                    "hosts": gpus // 8,
                    "devices_per_host": 8,
                    "device_kind": "H100-SXM5-80GB",
                    "peak_tflops": H100_PEAK_TFLOPS,
                    "memory_gb": 80,
                    "memory_bandwidth_gbs": 3350,
                }
            ],
        },
        source="<grand-teton>",
    )


TOPOLOGIES = {"selene": selene, "grand-teton": grand_teton}


@dataclass(frozen=True)
class DeepRun:
    """One published training run (or benchmark iteration) of a deep or interleaved pipeline.

    ``metric`` says what ``published`` is: ``step_s`` (seconds per iteration), ``tflops``
    (teraFLOP/s per GPU counted with Megatron's eq. 3, i.e. with the recomputed forward), or
    ``palm_tflops`` (model teraFLOP/s per GPU counted as in PaLM, Chowdhery et al. 2022:
    ``6N + 12·L·h·s`` per token, with ``n_params`` = N). The error is always on throughput:
    predicted / published − 1 (for ``step_s``: published step / predicted step − 1).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    tensor: int
    stages: int
    data: int
    virtual_stages: int
    batch: int  # sequences per iteration
    published: float
    metric: str
    source: str  # where the number is, precisely
    microbatch: int = 1
    remat: str = "full"  # full | selective (what the run recomputed)
    seq_len: int = 2048
    vocab_size: int = 51200
    tied_embeddings: bool = True
    hardware: str = "selene"
    zero1: bool = False  # optimizer state sharded over data (ZeRO-1 / FSDP)
    overlap_grad_sync: bool = False
    split: tuple[int, ...] | None = None  # layers per stage; None: uniform
    # Megatron-LM 2022 (Korthikanti et al.): the backward's tensor all-reduces overlapped
    # with its weight-gradient matmuls; sequence parallelism (core.plan_request.RunSpec).
    tp_overlap: bool = False
    sequence_parallel: bool = False
    n_params: float = 0.0  # only for palm_tflops
    assumptions: str = ""
    # An alternative reading of what the source leaves open: field -> value. The table
    # reports the error under it too, so a reader sees how much the assumption carries.
    alternative: tuple[tuple[str, object], ...] = ()

    @property
    def gpus(self) -> int:
        return self.tensor * self.stages * self.data

    @property
    def microbatches(self) -> int:
        return self.batch // (self.data * self.microbatch)


# Rows whose layout their source states, but for what each names in `assumptions` (for
# Narayanan et al. Table 2 the schedule, read as for Table 1, which §5.2 compares with).
# Positional fields: name, L, h, heads, t, p, d, v, batch, published, metric, source.
# fmt: off
DEEP_RUNS = (
    # Korthikanti et al. 2022: Table 3 (configuration: t, p, GPUs, global and micro batch),
    # §6 ("interleaving schedule with three interleaving stages for the 175B and 530B
    # models"; s = 2048, V = 51200; no data parallelism; Selene A100-80GB), Table 5
    # (end-to-end iteration time, full recompute without sequence parallelism, and "present
    # work" = selective recompute + sequence parallelism). Their Megatron-LM overlaps the
    # backward's tensor all-reduces with the weight-gradient matmuls (tp_overlap, every row).
    DeepRun("GPT-3 175B, full recompute", 96, 12288, 96, 8, 8, 1, 3, 64, 18.13, "step_s",
            f"{KORTHIKANTI}, Tables 3 and 5", tp_overlap=True),
    DeepRun("GPT-3 175B, selective + SP", 96, 12288, 96, 8, 8, 1, 3, 64, 13.75, "step_s",
            f"{KORTHIKANTI}, Tables 3 and 5", remat="selective", tp_overlap=True,
            sequence_parallel=True),
    DeepRun("530B, full recompute", 105, 20480, 128, 8, 35, 1, 3, 280, 49.05, "step_s",
            f"{KORTHIKANTI}, Tables 3 and 5", tp_overlap=True),
    DeepRun("530B, selective + SP", 105, 20480, 128, 8, 35, 1, 3, 280, 37.83, "step_s",
            f"{KORTHIKANTI}, Tables 3 and 5", remat="selective", tp_overlap=True,
            sequence_parallel=True),
    DeepRun("530B, selective + SP, d8", 105, 20480, 128, 8, 35, 8, 3, 2240, 39.15,
            "step_s", f"{KORTHIKANTI}, §6.3 (8-way data parallel, 2240 GPUs)",
            remat="selective", tp_overlap=True, sequence_parallel=True,
            assumptions="gradient all-reduce not overlapped"),
    # 1T: 2 layers per stage and interleaving named only for 175B and 530B, so 1F1B.
    DeepRun("1T, full recompute", 128, 25600, 160, 8, 64, 1, 1, 512, 94.42, "step_s",
            f"{KORTHIKANTI}, Tables 3 and 5", tp_overlap=True,
            assumptions="not interleaved (§6)", alternative=(("virtual_stages", 2),)),
    DeepRun("1T, selective + SP", 128, 25600, 160, 8, 64, 1, 1, 512, 71.49, "step_s",
            f"{KORTHIKANTI}, Tables 3 and 5", remat="selective", tp_overlap=True,
            sequence_parallel=True, assumptions="not interleaved (§6)",
            alternative=(("virtual_stages", 2),)),
    # Narayanan et al. 2021, Table 2 (PTD parallelism rows: model-parallel size 96 and 280,
    # batch 1536 and 2240, micro-batch 1, teraFLOP/s per GPU) with t = 8 (§4.1: "t = 8 in
    # our experiments"), so p = 12 and 35; the same setup as Table 1 (§5.1).
    *(
        DeepRun(f"GPT-3 175B, PTD-P, {n} GPUs", 96, 12288, 96, 8, 12, n // 96, 2, 1536, tf,
                "tflops", f"{NARAYANAN}, Table 2 and §4.1",
                assumptions="t = 8; interleaved v = 2 as for Table 1 (schedule not stated)",
                alternative=(("virtual_stages", 1),))
        for n, tf in ((384, 153), (768, 149), (1536, 141))
    ),
    *(
        DeepRun(f"530B, PTD-P, {n} GPUs", 105, 20480, 128, 8, 35, n // 280, 3, 2240, tf,
                "tflops", f"{NARAYANAN}, Table 2 and §4.1",
                assumptions="t = 8; interleaved v = 3 as for Table 1 (schedule not stated)",
                alternative=(("virtual_stages", 1),))
        for n, tf in ((560, 171), (1120, 167), (2240, 159))
    ),
)

# Lower confidence, reported separately: an unstated detail moves the answer by more than
# the 10% bar (MT-NLG's micro-batch), or the stack is not the one the efficiency was
# calibrated on and the layout is partly inferred (Llama 3 on H100).
DEEP_RUNS_LOWER = (
    # MT-NLG 530B trained with DeepSpeed's pipeline engine (1F1B, no interleaving) and
    # Megatron tensor slicing on Selene: t = 8, p = 35, global batch 1920; iteration time
    # on 280, 350, 420 DGX A100 nodes (§2.4 of the paper, quoted as 60.1, 50.2, 44.4 s and
    # 126, 121, 113 teraFLOP/s per GPU; the 2240-GPU row is also PaLM's Appendix B figure,
    # 65.43K tokens/s = 1920 x 2048 / 60.1 s). Micro-batch size is not in what we could read.
    *(
        DeepRun(f"MT-NLG 530B, DeepSpeed PP, {nodes * 8} GPUs", 105, 20480, 128, 8, 35,
                nodes * 8 // 280, 1, 1920, step, "step_s",
                f"{MTNLG}, §2.4 (via PaLM, Chowdhery et al. 2022, App. B, for 2240 GPUs)",
                assumptions="micro-batch 1, full recompute, vocab padded to 51200",
                alternative=(("microbatch", 2),))
        for nodes, step in ((280, 60.1), (350, 50.2), (420, 44.4))
    ),
    # Llama 3 405B pre-training, Table 4: TP 8, CP 1, PP 16, DP 64 / 128, sequence 8192,
    # batch per DP group 32 / 16 (16M tokens per batch), 430 / 400 TFLOP/s per GPU (BF16
    # MFU 43% / 41%, counted as in PaLM). §3.3.2: interleaved schedule (V not stated), one
    # transformer layer fewer on the first and last stage, no activation checkpointing at
    # 8K, FSDP sharding optimizer state and gradients. Shape (Table 3): 126 layers, h
    # 16384, 128 heads, vocabulary 128K (untied) -- priced as a GPT of that shape (GQA and
    # SwiGLU change the layer FLOPs by ~1%).
    *(
        DeepRun(f"Llama 3 405B, {dp * 128} H100", 126, 16384, 128, 8, 16, dp, 7, per_dp * dp, tf,
                "palm_tflops", f"{LLAMA3}, Table 4, §3.3.2, Table 3", seq_len=8192,
                vocab_size=128256, tied_embeddings=False, hardware="grand-teton", remat="none",
                zero1=True, overlap_grad_sync=True, split=(7, *([8] * 14), 7), n_params=405e9,
                assumptions="V = 8 read from §3.3.2 (the first chunk holds only the "
                "embedding, so chunks of one layer), priced as v = 7 because every chunk "
                "here needs a layer (bubble 1/7 instead of 1/8 of 1F1B's); GPT-shaped "
                "proxy; A100-calibrated efficiency on H100",
                alternative=(("virtual_stages", 4),))
        for dp, per_dp, tf in ((64, 32, 430), (128, 16, 400))
    ),
)
# fmt: on


def predict_deep(run: DeepRun, calibration: Calibration | None = None, **override):
    """The planner's prediction for ``run`` (a :class:`holmes_jax.planner.search.Plan`),
    with fields of the run replaced by ``override`` (the table's alternative readings)."""
    if override:
        run = dataclasses.replace(run, **override)
    model = ModelSpec(
        run.num_layers,
        run.hidden_size,
        run.num_heads,
        run.seq_len,
        run.vocab_size,
        tied_embeddings=run.tied_embeddings,
    )
    totals = list(run.split) if run.split else uniform_split(run.num_layers, run.stages)
    return _megatron_plan(
        TOPOLOGIES[run.hardware](run.gpus),
        model,
        run,
        microbatches=run.microbatches,
        totals=totals,
        remat=run.remat,
        zero1=run.zero1,
        overlap_grad_sync=run.overlap_grad_sync,
        calibration=calibration,
    )


def _megatron_plan(
    topology, model, run, *, microbatches, totals, remat, zero1, overlap_grad_sync, calibration
):
    """The plan of a published Megatron-LM run (either table): its batch, degrees and
    chunks (``run``: batch, stages, data, tensor, virtual_stages), bf16 with fp32 Adam, the
    engine priced as Megatron's, each stage's layer total split into its chunks."""
    spec = RunSpec(
        global_batch_size=run.batch,
        act_bytes=2,
        param_bytes=2,
        grad_bytes=4,
        optimizer_bytes=12,
        remat=remat,
        zero1=zero1,
        overlap_grad_sync=overlap_grad_sync,
        engine="megatron",
        memory_fraction=1.0,
        tp_overlap=run.tp_overlap,
        sequence_parallel=run.sequence_parallel,
    )
    v = run.virtual_stages
    layout = Layout(
        run.stages,
        run.data,
        run.tensor,
        microbatches=microbatches,
        schedule="interleaved" if v > 1 else "1f1b",
        virtual_stages=v,
    )
    split = _chunked(totals, v)
    return plan_for_layout(topology, model, spec, layout, split, calibration or Calibration())


def _predicted_metric(run: DeepRun, plan) -> float:
    """The prediction in the unit ``run.published`` is in."""
    step = plan.prediction.step_s
    if run.metric == "step_s":
        return step
    if run.metric == "tflops":
        return plan.prediction.tflops_per_device  # eq. 3 (full recompute) FLOPs per step
    if run.metric == "palm_tflops":
        per_token = 6 * run.n_params + 12 * run.num_layers * run.hidden_size * run.seq_len
        return run.batch * run.seq_len * per_token / run.gpus / step / 1e12
    raise ValueError(f"metric='{run.metric}': must be step_s, tflops or palm_tflops")


def _throughput_error(run: DeepRun, predicted: float) -> float:
    if run.metric == "step_s":
        return run.published / predicted - 1
    return predicted / run.published - 1


def deep_fidelity_table(
    calibration: Calibration | None = None, runs: tuple[DeepRun, ...] = DEEP_RUNS
) -> list[dict]:
    """One row per run: layout, published, predicted, throughput error, and the error under
    the run's alternative reading (None when it has none)."""
    rows = []
    for run in runs:
        pred = _predicted_metric(run, predict_deep(run, calibration))
        alt = None
        if run.alternative:
            other = dict(run.alternative)
            alt_run = dataclasses.replace(run, **other)
            alt_pred = _predicted_metric(alt_run, predict_deep(alt_run, calibration))
            alt = _throughput_error(alt_run, alt_pred)
        rows.append(
            {
                "model": run.name,
                "gpus": run.gpus,
                "t": run.tensor,
                "p": run.stages,
                "d": run.data,
                "v": run.virtual_stages,
                "batch": run.batch,
                "microbatch": run.microbatch,
                "seq": run.seq_len,
                "remat": run.remat,
                "hardware": run.hardware,
                "metric": run.metric,
                "published": run.published,
                "predicted": pred,
                "error": _throughput_error(run, pred),
                "alternative": ", ".join(f"{k}={v}" for k, v in run.alternative) or None,
                "error_alternative": alt,
                "assumptions": run.assumptions,
                "source": run.source,
            }
        )
    return rows


def summary(rows: list[dict]) -> tuple[float, float]:
    """(mean |error|, worst |error|) of table rows."""
    errors = [abs(r["error"]) for r in rows]
    return sum(errors) / len(errors), max(errors)
