"""Test setup and shared fixtures.

8 simulated CPU devices, set before jax is imported anywhere (this file is loaded first).

Fixtures:

- ``tiny_config(*overrides, base=TINY_RUN)``: a validated config of the tiny model that
  training tests share (:data:`tests.common.TINY_RUN`), with dotted overrides on top.
- ``make_program(cfg, degrees, **kwargs)``: the compiled side of a run
  (:class:`holmes_jax.runtime.program.Program`) on a mesh of those degrees.

Paths and override lists live in :mod:`tests.common`, HLO readers in :mod:`tests.hlo`.
"""

import os

import pytest

from tests.common import TINY_RUN

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


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
    from holmes_jax.runtime.mesh import build_mesh
    from holmes_jax.runtime.program import Program

    def build(cfg, degrees, **kwargs):
        return Program(cfg, build_mesh(degrees), **kwargs)

    return build
