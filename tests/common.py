"""Paths and shared constants for the tests (the fixtures are in ``conftest.py``).

Importable at collection time (parametrize lists need the file lists), so this module
holds plain values only; nothing here imports jax.
"""

import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
# How long a test waits for a process it started to do what it must (reach a step, finish,
# exit): a guard against a hang, not a time the test expects. A test waits on the event
# itself (a file written, a process exit), so a loaded machine only makes it slower.
HANG_S = 1800
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
MESHES = sorted(glob.glob(os.path.join(ROOT, "meshes", "*.yaml")))


def config_path(name: str) -> str:
    """``configs/<name>`` in the repository."""
    return os.path.join(ROOT, "configs", name)


def mesh_path(name: str) -> str:
    """``meshes/<name>`` in the repository."""
    return os.path.join(ROOT, "meshes", name)


# The tiny model of the tests (2 layers, hidden 32, 4 heads, 32 tokens).
TINY_MODEL = (
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_heads=4",
    "model.seq_len=32",
)
# The tiny run training tests share: every feature that changes the math is on (untied
# head, weight decay, clipping), so a wrong gradient cannot hide; a small corpus slice.
TINY_RUN = (
    *TINY_MODEL,
    "model.tied_embeddings=false",
    "train.global_batch_size=8",
    "optimizer.learning_rate=1e-2",
    "optimizer.warmup_steps=1",
    "optimizer.grad_clip=0.5",
    "data.max_bytes=400000",
)


def load_script(name: str):
    """``scripts/<name>.py`` imported as module ``name`` (scripts/ on the path while it loads,
    for its ``benchlib``; registered in ``sys.modules``, where its dataclasses look)."""
    import importlib.util
    import sys

    folder = os.path.join(ROOT, "scripts")
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(name, os.path.join(folder, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module


def as_flags(overrides) -> list[str]:
    """``["a=1", "b=2"]`` -> ``["--set", "a=1", "--set", "b=2"]`` for the CLIs."""
    return [arg for item in overrides for arg in ("--set", item)]


# pytest-xdist groups (``tests/conftest.py``). A group runs on one worker, in order. The tests
# that start several jax processes of their own (ports, cores, timeouts) share one group, so
# they run one at a time; they are named here, by node id prefix, because the scheduler sees
# node ids only. Every other test's group is its module.
PROCESSES = "processes"
PROCESS_TESTS = (
    "tests/cluster/test_multiprocess.py::",
    "tests/cluster/test_faults.py::",
    "tests/diloco/test_outer_step.py::test_four_processes_through_the_launcher_match_one",
    "tests/diloco/test_islands.py::test_killed_island_heals_from_its_peer",
    "tests/diloco/test_islands.py::test_a_nan_island_abstains",
)
# Tests (node ids, parameters left out) long enough to be a group of their own, when no
# module fixture ties them to the rest of their module.
OWN_GROUPS = (
    "tests/runtime/engine/test_pipeline.py::test_pipeline_loss_and_grads_equal_unpipelined",
)
# The groups that take longest, longest first: the workers start with these (the worker
# that starts the longest group last finishes last).
SLOW_GROUPS = (
    "tests/runtime/test_switches.py",
    PROCESSES,
    OWN_GROUPS[0],
    "tests/diloco/test_outer_step.py",
    "tests/runtime/engine/test_compress.py",
    "tests/runtime/engine/test_zero.py",
    "tests/runtime/engine/test_pipeline.py",
    "tests/runtime/model/test_model.py",
    "tests/runtime/test_loop.py",
    "tests/runtime/engine/test_memory.py",
    "tests/test_notebook.py",
)


def group_of(nodeid: str) -> str:
    """The pytest-xdist group of the test ``nodeid``."""
    if nodeid.startswith(PROCESS_TESTS):
        return PROCESSES
    if nodeid.split("[")[0] in OWN_GROUPS:
        return nodeid.split("[")[0]
    return nodeid.split("::")[0]
