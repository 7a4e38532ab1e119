"""Starting real training processes for the multi-process tests (not a test module).

Each process is ``python -m holmes_jax.train`` on localhost, joined through
``jax.distributed`` (gloo over TCP), its output in its own log file. The ``proc_env``
fixture (``tests/cluster/conftest.py``) gives them one persistent compilation cache.
"""

import json
import subprocess
import sys
import time

import numpy as np

from holmes_jax.cluster.launcher import free_port
from tests.common import HANG_S, ROOT, TINY_RUN, as_flags

TINY = [
    *TINY_RUN,
    "train.eval_batches=1",
    "train.eval_every=0",
    "logging.log_every=1",
    "logging.progress=plain",
]
# Two stages, one per process: the pipeline's ppermutes cross the process boundary.
TWO = TINY + ["parallel.stages=2", "parallel.microbatches=2", "train.steps=8"]
# cpu8-two-islands: 4 hosts of 2 devices, stages across islands, data inside, tensor in a host.
FOUR = TINY + [
    "parallel.mesh=meshes/cpu8-two-islands.yaml",
    "parallel.stages=2",
    "parallel.tensor=2",
    "parallel.microbatches=2",
    "parallel.schedule=1f1b",
    "train.steps=3",
]


def two_host_mesh(directory, roce_hosts=1):
    """cpu8-two-islands with 4 devices per island: ib on one host, roce on ``roce_hosts``
    (1: a two-process launch). Written to ``directory``; returns its path."""
    import yaml

    with open(f"{ROOT}/meshes/cpu8-two-islands.yaml") as f:
        raw = yaml.safe_load(f)
    raw["name"] = f"cpu8-{1 + roce_hosts}-hosts"
    for island, hosts in zip(raw["islands"], (1, roce_hosts), strict=True):
        island["hosts"], island["devices_per_host"] = island["hosts"][:hosts], 4 // hosts
    path = directory / f"{raw['name']}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def start(pid, count, port, overrides, log_path, env, devices=4):
    """Process ``pid`` of ``count`` (coordinator on ``port``), output to ``log_path``."""
    cmd = [sys.executable, "-m", "holmes_jax.train", *as_flags(overrides)]
    cmd += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(count)]
    cmd += ["--process-id", str(pid), "--cpu-devices", str(devices)]
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def start_job(count, overrides, tmp_path, name, env):
    """``count`` processes sharing 8 devices; logs ``<tmp_path>/<name>-<pid>.log``."""
    port = free_port()
    return [
        start(pid, count, port, overrides, tmp_path / f"{name}-{pid}.log", env, 8 // count)
        for pid in range(count)
    ]


def wait(procs, timeout=HANG_S):
    """Exit codes of ``procs`` (killing any still running after ``timeout`` s)."""
    deadline = time.time() + timeout
    try:
        return [p.wait(timeout=max(1, deadline - time.time())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def losses(path):
    """``{step: loss}`` of a metrics JSON-lines file (a later record of a step wins)."""
    return {r["step"]: r["loss"] for r in map(json.loads, open(path))}


def digests(path):
    """``{step: data_digest}`` (its batch) of a metrics JSON-lines file (later wins)."""
    return {r["step"]: r["data_digest"] for r in map(json.loads, open(path))}


def wait_for_step(procs, metrics, step, timeout=HANG_S):
    """Return once ``metrics`` logs ``step`` (or later); fail if a process exits first.

    Reads only whole lines: the trainer may be writing the last one."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = metrics.read_text() if metrics.exists() else ""
        whole = text[: text.rfind("\n") + 1].splitlines()
        if any(json.loads(line)["step"] >= step for line in whole):
            return
        if exited := [(i, p.returncode) for i, p in enumerate(procs) if p.poll() is not None]:
            raise AssertionError(f"step {step} never logged in {metrics}: exited {exited}")
        time.sleep(0.1)  # the poll interval; the wait ends on the file or an exit
    raise AssertionError(f"step {step} never logged in {metrics} after {timeout} s (hung)")


def compare(got, reference, atol=1e-5):
    """Per-step losses equal to the reference's at ``atol``."""
    steps = sorted(got)
    np.testing.assert_allclose(
        [got[s] for s in steps], [reference[s] for s in steps], rtol=0, atol=atol
    )
