"""Fixtures of the multi-process tests (helpers to start processes: ``procs.py``)."""

import os
import re

import pytest


@pytest.fixture(scope="session")
def proc_env(tmp_path_factory):
    """The test process's env without its device count (each process sets its own), and
    one persistent compilation cache for every process the session starts."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = flags.strip()
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax_cache"))
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env
