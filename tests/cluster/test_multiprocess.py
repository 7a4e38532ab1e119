"""Several processes (jax.distributed over gloo) train exactly like one; dead peers end runs.

Every multi-process run here starts real ``python -m holmes_jax.train`` processes on
localhost (or in network namespaces, root only) and compares their per-step losses with
an in-process run of the same config, global batch and plan (the reference, on the 8
simulated devices of conftest).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from holmes_jax.cluster.launcher import free_port
from holmes_jax.core.config import load_config
from holmes_jax.runtime.loop import run
from tests.common import ROOT, TINY_RUN, as_flags

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
EMULATED = TINY + [
    "parallel.mesh=meshes/emu-4host-2island.yaml",
    "parallel.stages=2",
    "parallel.microbatches=2",
    "train.steps=3",
]

pytestmark = pytest.mark.slow


def _reference(overrides):
    cfg = load_config(None, [o.replace("meshes/", f"{ROOT}/meshes/") for o in overrides])
    return {r["step"]: r["loss"] for r in run(cfg)}


@pytest.fixture(scope="module")
def two_reference():
    return _reference(TWO)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The test process's env without its device count (each process sets its own), and
    one persistent compilation cache for every process of this module."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = flags.strip()
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax_cache"))
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


def _start(pid, count, port, overrides, log_path, env, devices=4):
    cmd = [sys.executable, "-m", "holmes_jax.train", *as_flags(overrides)]
    cmd += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(count)]
    cmd += ["--process-id", str(pid), "--cpu-devices", str(devices)]
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _start_job(count, overrides, tmp_path, name, env):
    port = free_port()
    return [
        _start(pid, count, port, overrides, tmp_path / f"{name}-{pid}.log", env, 8 // count)
        for pid in range(count)
    ]


def _wait(procs, timeout=180):
    deadline = time.time() + timeout
    try:
        return [p.wait(timeout=max(1, deadline - time.time())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, open(path))}


def _compare(got, reference):
    steps = sorted(got)
    np.testing.assert_allclose(
        [got[s] for s in steps], [reference[s] for s in steps], rtol=0, atol=1e-5
    )


def test_four_processes_through_the_launcher_match_one(tmp_path, env):
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "holmes_jax.launch", "--mesh", "meshes/cpu8-two-islands.yaml"]
    train = [o for o in FOUR if not o.startswith("parallel.mesh")]
    cmd += ["--", *as_flags(train + [f"train.metrics_path={metrics}"])]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "[roce-1] " in done.stdout and "4 processes" in done.stdout
    got = _losses(metrics)
    assert sorted(got) == [1, 2, 3]
    _compare(got, _reference(FOUR))


def test_two_processes_stop_lose_a_peer_and_resume(tmp_path, two_reference, env):
    """Two processes (one pipeline stage each) match one process step for step; SIGTERM to
    one stops both after the same step (checkpoint, exit 0); a SIGKILLed peer ends the
    other within 60 s with a message naming it; the run then resumes and finishes with
    the uninterrupted run's losses."""
    ckpt = tmp_path / "ckpt"
    metrics = tmp_path / "m.jsonl"
    job = TWO + [
        f"checkpoint.dir={ckpt}",
        "checkpoint.every=1",
        "distributed.heartbeat_timeout_s=5",
        f"train.metrics_path={metrics}",
    ]

    def wait_for_step(procs, step):
        deadline = time.time() + 120
        while time.time() < deadline and all(p.poll() is None for p in procs):
            if metrics.exists() and any(
                json.loads(line)["step"] >= step for line in metrics.read_text().splitlines()
            ):
                return
            time.sleep(0.2)
        raise AssertionError(f"step {step} never logged")

    # 1. SIGTERM to process 1 only: both agree, save and exit 0.
    procs = _start_job(2, job, tmp_path, "term", env)
    try:
        wait_for_step(procs, 2)
        procs[1].send_signal(signal.SIGTERM)
        codes = _wait(procs, timeout=90)
    finally:
        _wait(procs, timeout=1)
    log0 = (tmp_path / "term-0.log").read_text()
    assert codes == [0, 0], log0[-3000:]
    assert "another process received a stop signal" in log0
    first = _losses(metrics)
    stopped = max(first)
    assert 2 <= stopped < 8 and sorted(first) == list(range(1, stopped + 1))
    _compare(first, two_reference)  # two processes == one process

    # 2. Resume; SIGKILL process 1: process 0 exits non-zero, naming it, within 60 s.
    procs = _start_job(2, job, tmp_path, "kill", env)
    try:
        wait_for_step(procs, stopped + 1)
        procs[1].kill()
        killed = time.time()
        code0 = procs[0].wait(timeout=60)
        took = time.time() - killed
    finally:
        _wait(procs, timeout=1)
    log0 = (tmp_path / "kill-0.log").read_text()
    assert code0 != 0 and took < 60, log0[-3000:]
    assert "lost peer process 1" in log0, log0[-3000:]
    assert f"resumed from {ckpt} at step {stopped}" in log0

    # 3. Resume again from the newest complete checkpoint and finish.
    procs = _start_job(2, job, tmp_path, "resume", env)
    codes = _wait(procs)
    log0 = (tmp_path / "resume-0.log").read_text()
    assert codes == [0, 0], log0[-3000:]
    resumed_at = int(re.search(r"resumed from .* at step (\d+)", log0).group(1))
    assert resumed_at >= stopped
    last = {}
    for line in metrics.read_text().splitlines():  # later records win (the resumed run)
        rec = json.loads(line)
        last[rec["step"]] = rec["loss"]
    assert sorted(last) == list(range(1, 9))
    _compare(last, two_reference)


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_emulated_islands_match_one(tmp_path, env):
    from holmes_jax.cluster.netns import list_namespaces

    metrics = tmp_path / "m.jsonl"
    before = set(list_namespaces())
    cmd = [sys.executable, "-m", "holmes_jax.launch", "--mesh", "meshes/emu-4host-2island.yaml"]
    train = [o for o in EMULATED if not o.startswith("parallel.mesh")]
    cmd += ["--emulate", "--", *as_flags(train + [f"train.metrics_path={metrics}"])]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "between islands 100 Mbit/s" in done.stdout
    assert set(list_namespaces()) == before  # everything it created is gone
    got = _losses(metrics)
    assert sorted(got) == [1, 2, 3]
    _compare(got, _reference(EMULATED))
