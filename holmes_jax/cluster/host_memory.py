"""Huge pages for a CPU run's large host buffers, so a step does not fault them in 4 KiB at a time.

XLA:CPU allocates an executable's temporaries (tens of MB per device for a pipeline
stage) with ``malloc`` on every call and frees them after it. glibc serves a block over its
mmap threshold (32 MB at most) with a fresh ``mmap`` and returns it with ``munmap``, so
each step faults all of it in again, a 4 KiB page at a time. For the six-stage
program of ``scripts/bench_ablation.py``, run in one process on six devices, that is
123,000 faults and a quarter of the process's CPU time per step spent in the kernel, which
``launch --emulate``'s CPU quotas charge to a host's share like compute.

With glibc's tunable ``glibc.malloc.hugetlb=1`` (glibc 2.35 or newer, and transparent
huge pages not ``never``) malloc asks for huge pages on the memory it maps: one fault per
2 MiB. The same step then takes 3,000 faults and 12% less CPU time. Keeping freed blocks in
the process instead (one arena, no ``mmap``) removes the faults, but the device threads
then queue on that arena's lock, which cost more than the faults did.

glibc reads its tunables when a process starts, so :func:`with_huge_pages` goes into the
environment of the processes holmes_jax starts: the launcher's workers, ``bootstrap.py``'s
quickstart and tests, and the test suite's own processes. A process started by hand gets it
from ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` in its environment. Other C libraries and
older glibc ignore the variable. Nothing here imports jax.
"""

from __future__ import annotations

from collections.abc import Mapping

from holmes_jax.cluster.xla_flags import gpu_present

TUNABLES = "GLIBC_TUNABLES"
HUGE_PAGES = "glibc.malloc.hugetlb=1"


def with_huge_pages(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with :data:`HUGE_PAGES` added to ``GLIBC_TUNABLES``, for a process that
    computes on CPU devices.

    Unchanged where the tunables already set ``glibc.malloc.hugetlb`` (the user's choice
    stands) and on a host with a GPU unless ``JAX_PLATFORMS`` is ``cpu``.
    """
    out = dict(env)
    if gpu_present() and out.get("JAX_PLATFORMS") != "cpu":
        return out
    current = [t for t in out.get(TUNABLES, "").split(":") if t]
    name = HUGE_PAGES.split("=", 1)[0]
    if any(t.split("=", 1)[0] == name for t in current):
        return out
    out[TUNABLES] = ":".join([*current, HUGE_PAGES])
    return out
