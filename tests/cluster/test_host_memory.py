"""Huge pages for malloc's large blocks in the CPU processes holmes_jax starts."""

import os
import subprocess
import sys

import pytest

from holmes_jax.cluster import host_memory, launcher
from holmes_jax.cluster.host_memory import HUGE_PAGES, TUNABLES, with_huge_pages
from holmes_jax.planner.topology import load_topology
from tests.common import mesh_path

# A program whose temporaries (~120 MB: reversed and rolled copies of a 40 MB array) are
# malloc'd and freed on every call. Prints their bytes and the page faults per call of its
# third to fifth call.
FAULTS = """
import resource
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.sum(jnp.flip(x, 0) + jnp.roll(x, 3, 1))).lower(
    jnp.zeros((2048, 5120), jnp.float32)).compile()
x = jnp.ones((2048, 5120), jnp.float32)
for _ in range(2):
    f(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    f(x).block_until_ready()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 3
print(f.memory_analysis().temp_size_in_bytes, faults)
"""


def _cpu(monkeypatch):
    monkeypatch.setattr(host_memory, "gpu_present", lambda: False)


def test_tunable_is_added_to_the_users(monkeypatch):
    _cpu(monkeypatch)
    assert with_huge_pages({"A": "1"}) == {"A": "1", TUNABLES: HUGE_PAGES}
    mine = "glibc.malloc.arena_max=2"
    assert with_huge_pages({TUNABLES: mine})[TUNABLES] == f"{mine}:{HUGE_PAGES}"
    off = {TUNABLES: f"{mine}:glibc.malloc.hugetlb=0"}
    assert with_huge_pages(off) == off  # the user's choice stands
    env = {"A": "1"}
    with_huge_pages(env)
    assert env == {"A": "1"}  # a copy


def test_gpu_hosts_keep_glibc_defaults_unless_jax_runs_on_cpu(monkeypatch):
    monkeypatch.setattr(host_memory, "gpu_present", lambda: True)
    assert with_huge_pages({"A": "1"}) == {"A": "1"}
    assert with_huge_pages({"JAX_PLATFORMS": "cpu"})[TUNABLES] == HUGE_PAGES


def test_launcher_workers_get_huge_pages(monkeypatch):
    _cpu(monkeypatch)
    topology = load_topology(mesh_path("cpu8-two-islands.yaml"))
    env = launcher.worker_env(topology, "ib-0", {TUNABLES: "glibc.malloc.arena_max=2"})
    assert env[TUNABLES] == f"glibc.malloc.arena_max=2:{HUGE_PAGES}"


def _huge_pages_work() -> str:
    """Why huge pages cannot take effect on this machine, or ''."""
    version = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else None
    if not version or not version.startswith("glibc "):
        return "not glibc"
    major, minor = (int(v) for v in version.split()[1].split(".")[:2])
    if (major, minor) < (2, 35):
        return f"{version}: glibc.malloc.hugetlb needs 2.35"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return "transparent huge pages are off"
    except OSError:
        return "no transparent huge pages"
    return ""


def _faults(tunables: str) -> tuple[int, float]:
    """(temporary bytes, page faults per call) of :data:`FAULTS` under ``tunables``."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{TUNABLES: tunables})
    out = subprocess.run(
        [sys.executable, "-c", FAULTS], env=env, capture_output=True, text=True, check=True
    )
    temp, faults = out.stdout.split()[-2:]
    return int(temp), float(faults)


@pytest.mark.skipif(bool(_huge_pages_work()), reason=_huge_pages_work() or "")
def test_huge_pages_cut_the_faults_of_each_calls_temporaries():
    temp, default = _faults("glibc.malloc.hugetlb=0")
    _, huge = _faults(with_huge_pages({"JAX_PLATFORMS": "cpu"})[TUNABLES])
    assert temp > 64 << 20  # over glibc's largest mmap threshold: mapped on each call
    assert default > temp / 4096 / 2, default  # every call faults its 4 KiB pages again
    assert huge < default / 10, (huge, default)
