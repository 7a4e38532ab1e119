"""Fidelity check: the cost model against published Megatron-LM throughput.

Reference: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC 2021 (arXiv 2104.04473), Table 1: GPT models from 1.7B to 1T
parameters on up to 3072 A100-80GB GPUs of NVIDIA Selene (DGX A100 nodes: 8 GPUs on
NVSwitch, 8 x 200 Gbit/s HDR InfiniBand per node), sequence 2048, vocabulary 51200,
mixed precision, full activation recomputation, achieved teraFLOP/s per GPU counted with
eq. 3 (:func:`holmes_jax.planner.cost.megatron_flops`).

The prediction models those runs as they were made: fp16 parameters and activations,
fp32 gradients all-reduced after the backward pass (no overlap, no ZeRO), fp32 master
weights and Adam state, tied embeddings all-reduced between the first and last stage,
micro-batch size 1 with the 1F1B schedule. One number is calibrated: the fraction of
peak the device reaches on transformer layers (:data:`holmes_jax.planner.cost.DEFAULT_EFFICIENCY`,
chosen by :func:`calibrate`). Pure Python; no jax import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from holmes_jax.core.spec import Layout, ModelSpec
from holmes_jax.planner.cost import RunSpec
from holmes_jax.planner.partition import uniform_split
from holmes_jax.planner.placement import DEFAULT_EFFICIENCY, Calibration
from holmes_jax.planner.search import plan_for_layout
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


def predict_run(run: MegatronRun, efficiency: float = DEFAULT_EFFICIENCY) -> float:
    """Predicted teraFLOP/s per GPU (eq. 3 FLOPs / predicted iteration time)."""
    model = ModelSpec(run.num_layers, run.hidden_size, run.num_heads, 2048, 51200)
    spec = RunSpec(
        global_batch_size=run.batch,
        act_bytes=2,
        param_bytes=2,
        grad_bytes=4,
        optimizer_bytes=12,
        remat="full",
        zero1=False,
        overlap_grad_sync=False,
        engine="megatron",
        memory_fraction=1.0,
    )
    layout = Layout(
        run.stages,
        run.data,
        run.tensor,
        microbatches=run.batch // run.data,
        schedule="interleaved" if run.virtual_stages > 1 else "1f1b",
        virtual_stages=run.virtual_stages,
    )
    split = uniform_split(run.num_layers, run.stages)
    plan = plan_for_layout(selene(run.gpus), model, spec, layout, split, Calibration(efficiency))
    return plan.tflops_per_device


def calibrate(runs: tuple[MegatronRun, ...] = TABLE_1) -> float:
    """The efficiency minimising the worst relative error over ``runs`` (golden section).

    Predicted throughput scales almost linearly with efficiency, so the worst-error
    curve is unimodal on [0.3, 0.9].
    """

    def worst(eff: float) -> float:
        return max(abs(predict_run(r, eff) / r.tflops_per_gpu - 1) for r in runs)

    lo, hi = 0.3, 0.9
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = worst(a), worst(b)
    for _ in range(40):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = worst(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = worst(b)
    return (lo + hi) / 2


def fidelity_table(efficiency: float = DEFAULT_EFFICIENCY) -> list[dict]:
    """One row per Table 1 entry: configuration, published, predicted, relative error."""
    rows = []
    for run in TABLE_1:
        pred = predict_run(run, efficiency)
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
