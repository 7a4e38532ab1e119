"""Test setup and shared fixtures.

8 simulated CPU devices, set before jax is imported anywhere (this file is loaded first).

Fixtures:

- ``tiny_config(*overrides, base=TINY_RUN)``: a validated config of the tiny model that
  training tests share (:data:`tests.common.TINY_RUN`), with dotted overrides on top.
- ``make_program(cfg, degrees, **kwargs)``: the compiled side of a run
  (:class:`holmes_jax.runtime.program.Program`) on a mesh of those degrees.

Parallel runs (pytest-xdist, ``-n N``; ``bootstrap.py test`` picks N): each test belongs to
one group (:func:`tests.common.group_of`), and one worker runs a whole group in collection
order. A test's group is its module, so module fixtures and cached programs are built once;
the tests that start several jax processes of their own share the group
:data:`tests.common.PROCESSES`, so they run one at a time: they share neither ports nor cores
with each other, and their timeouts hold on two cores. Workers take the groups of
:data:`tests.common.SLOW_GROUPS` first, in that order.

Paths and override lists live in :mod:`tests.common`, HLO readers in :mod:`tests.hlo`.
"""

import os

import pytest

from holmes_jax.cluster.host_memory import with_huge_pages
from tests.common import PROCESSES, SLOW_GROUPS, TINY_RUN, group_of

# The suite compiles a few hundred tiny programs on two cores: compiling, not running,
# is its cost, so XLA:CPU's backend (LLVM) optimisation is off. Tiny models barely run
# slower; every program still compiles through the same HLO passes. The processes the
# tests start inherit the flag.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The processes the suite starts (pytest-xdist workers, multi-process tests) use huge pages
# for malloc's large blocks, as the launcher's workers do; glibc reads this at their start.
os.environ.update(with_huge_pages(os.environ))


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook; absent under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    """Hand out whole groups (:func:`tests.common.group_of`), in the workers' order, for
    every ``--dist`` mode but ``each``."""
    if config.getvalue("dist") == "each":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return group_of(nodeid)

    config.option.loadscopereorder = False  # keep the workers' order: slow groups first
    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Tests that start jax processes (``proc_env``) are in the group ``PROCESSES``; on a
    pytest-xdist worker, the groups of :data:`tests.common.SLOW_GROUPS` come first."""
    for item in items:
        if "proc_env" in getattr(item, "fixturenames", ()) and group_of(item.nodeid) != PROCESSES:
            raise pytest.UsageError(
                f"{item.nodeid}: uses proc_env (starts jax processes), so it must be in "
                "tests.common.PROCESS_TESTS (its processes would share cores and ports)"
            )
    if not hasattr(config, "workerinput"):
        return
    rank = {name: i for i, name in enumerate(SLOW_GROUPS)}
    order = {item: (rank.get(group_of(item.nodeid), len(rank)), i) for i, item in enumerate(items)}
    items.sort(key=order.__getitem__)


@pytest.fixture(scope="session")
def tiny_config():
    """Builder: ``tiny_config("parallel.stages=2", ...)`` -> a validated Config."""
    from holmes_jax.core.config import load_config

    def build(*overrides: str, base=TINY_RUN):
        return load_config(None, [*base, *overrides])

    return build


@pytest.fixture(scope="session")
def make_program():
    """Builder: ``make_program(cfg, Degrees(2, 4, 1))`` -> a Program on that mesh."""
    from holmes_jax.runtime.engine.mesh import build_mesh
    from holmes_jax.runtime.program import Program

    def build(cfg, degrees, **kwargs):
        return Program(cfg, build_mesh(degrees), **kwargs)

    return build
