"""What the metrics know of the devices: datasheet peaks, for MFU when
``logging.peak_tflops`` is not given, and the peak memory the runtime reports.

Dense (no structured sparsity) matrix-unit TFLOP/s per device, by ``device_kind``: bf16
for bf16 compute, and what XLA runs an fp32 matmul at by default (TF32 on NVIDIA
Ampere and later, bf16 passes on TPU). An unknown kind has no peak: MFU is then left out
rather than guessed.
"""

from __future__ import annotations

# (substring of the lower-cased device_kind, bf16 peak, fp32 peak). First match wins, so
# variants come before their family.
PEAKS: tuple[tuple[str, float, float], ...] = (
    ("h100 pcie", 756.0, 378.0),
    ("h100 nvl", 835.0, 418.0),
    ("h100", 989.0, 495.0),  # SXM ("NVIDIA H100 80GB HBM3")
    ("h200", 989.0, 495.0),
    ("gh200", 989.0, 495.0),
    ("b200", 2250.0, 1100.0),
    ("a100", 312.0, 156.0),
    ("l40s", 362.0, 183.0),
    ("l40", 181.0, 90.0),
    ("l4", 121.0, 60.0),
    ("tpu v4", 275.0, 275.0),
    ("tpu v5 lite", 197.0, 197.0),  # v5e
    ("tpu v5p", 459.0, 459.0),
    ("tpu v5", 459.0, 459.0),
    ("tpu v6 lite", 918.0, 918.0),  # v6e
)


def peak_tflops(device_kind: str, precision: str) -> float | None:
    """Datasheet dense TFLOP/s of one device of ``device_kind`` computing in ``precision``
    (``bf16`` or ``fp32``); None for a kind not in :data:`PEAKS` (CPUs included)."""
    kind = device_kind.lower()
    for key, bf16, fp32 in PEAKS:
        if key in kind:
            return bf16 if precision == "bf16" else fp32
    return None


def peak_memory_gb(devices) -> float | None:
    """The most memory any of ``devices`` has held at once since the process started, in
    GB (1e9 bytes): the largest ``memory_stats()["peak_bytes_in_use"]``. None when a
    device does not report it (XLA:CPU returns no stats), so a record leaves it out.

    Args:
      devices: this process's devices (``jax.local_devices()``); others cannot be asked.
    """
    peaks = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 (a runtime that refuses has no number to give)
            return None
        if not stats or "peak_bytes_in_use" not in stats:
            return None
        peaks.append(stats["peak_bytes_in_use"])
    return max(peaks) / 1e9 if peaks else None
