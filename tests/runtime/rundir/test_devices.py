"""The datasheet peaks MFU falls back on when ``logging.peak_tflops`` is not given, and the
units the progress line gives achieved FLOP/s in."""

import pytest

from holmes_jax.runtime.rundir.devices import peak_tflops


@pytest.mark.parametrize(
    "kind, precision, want",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),  # SXM, as jax names it
        ("NVIDIA H100 80GB HBM3", "fp32", 495.0),  # TF32, XLA's default for fp32 dots
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H200", "bf16", 989.0),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA L40S", "bf16", 362.0),
        ("NVIDIA L4", "bf16", 121.0),
        ("TPU v5 lite", "bf16", 197.0),
        ("TPU v4", "fp32", 275.0),
        ("cpu", "bf16", None),
        ("NVIDIA GeForce RTX 4090", "bf16", None),  # unknown: no MFU rather than a guess
    ],
)
def test_peak_by_device_kind(kind, precision, want):
    assert peak_tflops(kind, precision) == want


def test_the_progress_line_gives_gflops_on_cpus_and_tflops_on_accelerators():
    from holmes_jax.runtime.rundir.metrics import format_record

    rec = {"step": 3, "loss": 2.0, "step_time_s": 0.5, "tokens_per_s": 1000.0}
    assert "| 8.79 GFLOP/s/dev" in format_record({**rec, "tflops_per_device": 0.00879})
    gpu = format_record({**rec, "tflops_per_device": 198.49, "mfu": 0.2})
    assert "| 198.5 TFLOP/s/dev | MFU 20.0%" in gpu and "GFLOP" not in gpu
