"""Fixtures of the DiLoCo tests: the multi-process ones share ``tests/cluster``'s."""

from tests.cluster.conftest import proc_env  # noqa: F401 (a fixture, used by name)
