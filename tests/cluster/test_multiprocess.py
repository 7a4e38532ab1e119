"""Several processes (jax.distributed over gloo) train exactly like one; dead peers end runs.

Every multi-process run here starts real ``python -m holmes_jax.train`` processes on
localhost (or in network namespaces, root only) and compares their per-step losses with
an in-process run of the same config, global batch and plan (the reference, on the 8
simulated devices of conftest).
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from holmes_jax.core.config import load_config
from holmes_jax.runtime.loop import run
from tests.cluster.procs import (
    FOUR,
    TINY,
    TWO,
    compare,
    digests,
    losses,
    start_job,
    wait,
    wait_for_step,
)
from tests.common import HANG_S, ROOT, as_flags

EMULATED = TINY + [
    "parallel.mesh=meshes/emu-4host-2island.yaml",
    "parallel.stages=2",
    "parallel.microbatches=2",
    "train.steps=3",
]
GLOO = "[Gloo] Rank"  # gloo's connection report, hidden by the launcher unless --verbose

pytestmark = pytest.mark.slow


def _history(overrides):
    cfg = load_config(None, [o.replace("meshes/", f"{ROOT}/meshes/") for o in overrides])
    return run(cfg)


def _reference(overrides):
    return {r["step"]: r["loss"] for r in _history(overrides)}


@pytest.fixture(scope="module")
def two_reference():
    return _reference(TWO)


@pytest.fixture
def env(proc_env):
    """The processes' environment (``tests/cluster/conftest.py``: a shared compile cache)."""
    return proc_env


def test_four_processes_through_the_launcher_match_one(tmp_path, env):
    """Four processes through ``launch`` match one. Only process 0 speaks: the others' lines
    were gloo's reports, which the launcher hides (``--verbose`` shows them; a unit test in
    test_launch.py). A ``--mesh`` after '--' naming the launcher's own file (another
    spelling of the same path) is accepted."""
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "holmes_jax.launch", "--max-restarts", "0"]
    cmd += ["--mesh", "meshes/cpu8-two-islands.yaml", "--"]
    cmd += ["--mesh", os.path.join(ROOT, "meshes", ".", "cpu8-two-islands.yaml")]
    train = [o for o in FOUR if not o.startswith("parallel.mesh")]
    cmd += as_flags(train + [f"train.metrics_path={metrics}"])
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "[ib-0  ] distributed: 4 processes" in done.stdout
    # Only process 0 speaks (the others' lines were gloo's), one prefixed line per event.
    lines = done.stdout.splitlines()
    assert all(line.startswith("[ib-0  ] ") for line in lines[:-1]), done.stdout
    assert GLOO not in done.stdout and "connected peer ranks" not in done.stdout
    assert re.fullmatch(r"launch: \d+ lines of library output hidden .*", lines[-1])
    got = losses(metrics)
    assert sorted(got) == [1, 2, 3]
    reference = _history(FOUR)
    compare(got, {r["step"]: r["loss"] for r in reference})
    # four hosts read the batches one process reads, token for token
    assert digests(metrics) == {r["step"]: r["data_digest"] for r in reference}


def test_two_processes_stop_lose_a_peer_and_resume(tmp_path, two_reference, env):
    """Two processes (one pipeline stage each) match one process step for step; SIGTERM to
    one stops both after the same step (checkpoint, exit 0); a SIGKILLed peer ends the
    other within 60 s with a message naming it; the run then resumes and finishes with
    the uninterrupted run's losses."""
    run_dir = tmp_path / "run"  # process 0 chooses it for both (rundir.choose_run_dir)
    ckpt, metrics = run_dir / "checkpoints", run_dir / "metrics.jsonl"
    job = TWO + [f"train.run_dir={run_dir}", "checkpoint.every=1"]
    job.append("distributed.heartbeat_timeout_s=5")

    # 1. SIGTERM to process 1 only: both agree, save and exit 0.
    procs = start_job(2, job, tmp_path, "term", env)
    try:
        wait_for_step(procs, metrics, 2)
        procs[1].send_signal(signal.SIGTERM)
        codes = wait(procs)
    finally:
        wait(procs, timeout=1)
    log0 = (tmp_path / "term-0.log").read_text()
    assert codes == [0, 0], log0[-3000:]
    # jax's preemption sync point owns SIGTERM in a multi-process job: both stop together.
    assert "(a process got SIGTERM; every process agreed on this step)" in log0
    first = losses(metrics)
    stopped = max(first)
    assert 2 <= stopped < 8 and sorted(first) == list(range(1, stopped + 1))
    compare(first, two_reference)  # two processes == one process

    # 2. Resume; SIGKILL process 1: process 0 exits non-zero, naming it, within 60 s.
    procs = start_job(2, job, tmp_path, "kill", env)
    try:
        wait_for_step(procs, metrics, stopped + 1)
        procs[1].kill()
        killed = time.time()
        code0 = procs[0].wait(timeout=60)
        took = time.time() - killed
    finally:
        wait(procs, timeout=1)
    log0 = (tmp_path / "kill-0.log").read_text()
    assert code0 != 0 and took < 60, log0[-3000:]
    assert "lost peer process 1" in log0, log0[-3000:]
    assert f"resumed from {ckpt} at step {stopped}" in log0

    # 3. Resume again from the newest complete checkpoint and finish.
    procs = start_job(2, job, tmp_path, "resume", env)
    codes = wait(procs)
    log0 = (tmp_path / "resume-0.log").read_text()
    assert codes == [0, 0], log0[-3000:]
    resumed_at = int(re.search(r"resumed from .* at step (\d+)", log0).group(1))
    assert resumed_at >= stopped
    last = losses(metrics)  # later records win (the resumed run)
    assert sorted(last) == list(range(1, 9))
    compare(last, two_reference)
    assert not os.path.exists(f"{run_dir}-2")  # every resume stayed in the run's directory


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_emulated_islands_match_one(tmp_path, env):
    from holmes_jax.cluster.netns import list_namespaces

    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "holmes_jax.launch", "--max-restarts", "0"]
    cmd += ["--mesh", "meshes/emu-4host-2island.yaml"]
    train = [o for o in EMULATED if not o.startswith("parallel.mesh")]
    cmd += ["--emulate", "--", *as_flags(train + [f"train.metrics_path={metrics}"])]
    launcher = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = launcher.communicate(timeout=HANG_S)
    assert launcher.returncode == 0, out[-3000:] + err[-2000:]
    assert "between islands 100 Mbit/s" in out
    # Everything it created is gone: its namespaces are named by its pid (other launches
    # on this machine, such as a second test suite, have their own).
    assert not [ns for ns in list_namespaces() if ns.startswith(f"hj{launcher.pid}-")]
    got = losses(metrics)
    assert sorted(got) == [1, 2, 3]
    compare(got, _reference(EMULATED))
