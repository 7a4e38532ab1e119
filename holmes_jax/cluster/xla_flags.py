"""XLA flags set by entry points before jax is imported: simulated CPU devices, and the
flags that overlap collectives with compute on GPUs (validated before use).

ZeRO-1's per-layer reduce-scatters (:mod:`holmes_jax.runtime.engine.zero`) only overlap
the remaining backward work when XLA schedules collectives asynchronously: the latency-hiding
scheduler and pipelined (async) reduce-scatter / all-gather / all-reduce. XLA *aborts the
process* on an XLA_FLAGS entry it does not know, and flag names move between jaxlib
releases, so each candidate is tried in a throwaway subprocess first (all together, then
one by one if that fails) and only the accepted ones are set. Results are cached per
jaxlib version in ``~/.cache/holmes_jax/xla_flags.json``.

On a CPU-only machine :func:`request_cpu_devices` asks XLA for simulated devices (the
flag is spelled only here). Only entry points call :func:`request_cpu_devices` and
:func:`apply_gpu_flags`, before jax is imported; nothing here imports jax.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Sequence

GPU_OVERLAP_FLAGS: tuple[str, ...] = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
    "--xla_gpu_enable_highest_priority_async_stream=true",
)

_PROBE = "import jax; jax.devices()"
CPU_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def request_cpu_devices(count: int) -> None:
    """Ask XLA for ``count`` host devices unless XLA_FLAGS already says how many.

    Must run before jax is imported; only entry points call it (never library code).
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if CPU_DEVICES_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {CPU_DEVICES_FLAG}={count}".strip()


def gpu_present() -> bool:
    """A CUDA jax plugin is installed and a GPU device node exists (no jax import)."""
    plugin = any(
        importlib.util.find_spec(name) is not None
        for name in ("jax_cuda12_plugin", "jax_cuda13_plugin")
    )
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1")
    return plugin and not hidden and os.path.exists("/dev/nvidiactl")


def _accepts(flags: Sequence[str], python: str) -> bool:
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    try:
        proc = subprocess.run(
            [python, "-c", _PROBE], env=env, capture_output=True, timeout=120, check=False
        )
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0


def accepted_flags(candidates: Sequence[str], python: str = sys.executable) -> list[str]:
    """The subset of ``candidates`` that this jaxlib's XLA parses without aborting.

    Args:
      candidates: ``--name=value`` entries.
      python: interpreter whose jaxlib is checked.

    Returns:
      The accepted entries, in the given order.
    """
    if not candidates:
        return []
    if _accepts(candidates, python):
        return list(candidates)
    return [flag for flag in candidates if _accepts([flag], python)]


def _cache_path() -> str:
    root = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    return os.path.join(root, "holmes_jax", "xla_flags.json")


def cached_accepted_flags(candidates: Sequence[str]) -> list[str]:
    """:func:`accepted_flags`, remembered per jaxlib version and candidate list."""
    try:
        version = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    key = f"{version}|{' '.join(candidates)}"
    path = _cache_path()
    cache: dict[str, list[str]] = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                cache = json.load(f)
        except (OSError, ValueError):
            cache = {}
    if key not in cache:
        cache[key] = accepted_flags(candidates)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump(cache, f, indent=1)
        except OSError:
            pass  # a read-only home only costs the check next time
    return cache[key]


def apply_gpu_flags(candidates: Sequence[str] = GPU_OVERLAP_FLAGS) -> list[str]:
    """On a GPU host, add the accepted overlap flags to XLA_FLAGS (before jax loads).

    Flags the user already set (same ``--name``) are left as the user set them.

    Returns:
      The flags added (empty on CPU-only hosts).
    """
    if not gpu_present():
        return []
    current = os.environ.get("XLA_FLAGS", "")
    set_names = {f.split("=", 1)[0] for f in current.split()}
    wanted = [f for f in candidates if f.split("=", 1)[0] not in set_names]
    added = cached_accepted_flags(wanted)
    if added:
        os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added
