"""Fixtures of the multi-process tests (helpers to start processes: ``procs.py``)."""

import os
import re

import pytest


@pytest.fixture(scope="session")
def proc_env():
    """The test process's env without its device count (each process sets its own), with
    the test run's persistent compilation cache (``tests/conftest.py``)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = flags.strip()
    return env
