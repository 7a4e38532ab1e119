"""Process faults: process 0 (the coordinator) killed, kill -9 at random steps then resume,
and the launcher's supervised restarts after injected faults (``--fail-host``).

Real ``python -m holmes_jax.train`` processes on localhost (``tests/cluster/procs.py``). A
survivor of a dead peer exits non-zero within 60 s with one line naming it; a run killed
and restarted until it finishes logs, at every step, the loss of the run that was never
interrupted. That run (the ``straight`` fixture) is one, shared by the fault tests of one
job, and its compilation cache serves their attempts.
"""

import json
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from holmes_jax.cluster.launcher import free_port
from holmes_jax.cluster.restarts import PHASES
from tests.cluster.procs import (
    FOUR,
    TWO,
    compare,
    start_job,
    two_host_mesh,
    wait,
    wait_for_step,
)
from tests.common import HANG_S, ROOT, as_flags

pytestmark = pytest.mark.slow

ABORT_TRACE = re.compile(
    r"^(F\d{4} |\*\*\* Check failure|terminate called|\s+@\s+0x)|std::bad_cast", re.M
)


# Process 0: jax's own join, nothing else (it holds the coordination service).
COORDINATOR = """
import sys, time, jax
jax.distributed.initialize(sys.argv[1], 2, 0, initialization_timeout=60)
jax.process_index()  # the CPU backend's start is itself a rendezvous of the processes
time.sleep(300)
"""
# Process 1: joined the way the trainer joins (client callback, terminate handler, watchdog).
MEMBER = """
import sys, time
from holmes_jax.cluster import distributed
from holmes_jax.core.config import load_config
cfg = load_config(None, [f"distributed.coordinator_address={sys.argv[1]}",
    "distributed.num_processes=2", "distributed.process_id=1",
    "distributed.initialization_timeout_s=60"])
distributed.initialize(cfg)
print("joined", flush=True)
time.sleep(300)
"""


def test_a_killed_coordinator_is_named_in_one_line(tmp_path, proc_env):
    """The mechanism alone, no training (seconds): SIGKILL the process holding jax's
    coordination service; the other, joined by :func:`distributed.initialize`, prints one
    line naming it and exits 3 instead of jax's ``LOG(FATAL)`` trace (exit 134)."""
    address = f"127.0.0.1:{free_port()}"
    log = tmp_path / "member.log"

    def run(code, path):
        with open(path, "w") as out:
            return subprocess.Popen(
                [sys.executable, "-c", code, address], cwd=ROOT, env=proc_env, stdout=out,
                stderr=subprocess.STDOUT,
            )  # fmt: skip

    coordinator, member = run(COORDINATOR, tmp_path / "coordinator.log"), run(MEMBER, log)
    try:
        deadline = time.time() + HANG_S
        while "joined" not in log.read_text() and member.poll() is None:
            assert time.time() < deadline, log.read_text()
            time.sleep(0.1)
        coordinator.kill()
        code = member.wait(timeout=30)
    finally:
        wait([coordinator, member], timeout=1)
    out = log.read_text()
    assert code == 3, out
    named = [line for line in out.splitlines() if "lost peer" in line]
    # (process 0 ran no watchdog here, so it published no label naming its host)
    assert named == [
        f"error: lost peer process 0: the coordination service it held at {address} is gone"
    ], out
    assert not ABORT_TRACE.search(out), out


def test_killing_process_0_names_it_on_every_survivor(tmp_path, proc_env):
    """Four processes (the launcher's topology); SIGKILL process 0, which holds jax's
    coordination service: the other three exit with code 3 within 60 s, each with one line
    naming process 0, and none with jax's C++ abort trace."""
    metrics = tmp_path / "m.jsonl"
    job = [o for o in FOUR if not o.startswith("train.steps")] + [
        "train.steps=200",
        "distributed.heartbeat_timeout_s=5",
        f"train.metrics_path={metrics}",
    ]
    procs = start_job(4, job, tmp_path, "p", proc_env)
    try:
        wait_for_step(procs, metrics, 2)
        procs[0].kill()
        killed = time.time()
        codes = wait(procs[1:], timeout=60)
        took = time.time() - killed
    finally:
        wait(procs, timeout=1)
    for pid, code in enumerate(codes, start=1):
        log = (tmp_path / f"p-{pid}.log").read_text()
        named = [line for line in log.splitlines() if "lost peer" in line]
        assert code == 3, f"process {pid}: exit {code}\n{log[-3000:]}"
        assert len(named) == 1 and named[0].startswith(
            "error: lost peer process 0 (host ib-0): the coordination service it held at "
        ), log[-3000:]
        assert not ABORT_TRACE.search(log), log[-3000:]
    assert took < 60


# The job of the fault tests below: two hosts (one per island of cpu8-two-hosts), a
# pipeline stage each, ZeRO-1, 6 steps.
JOB = [o for o in TWO if not o.startswith("train.steps")]
JOB += ["train.steps=6", "checkpoint.every=3", "distributed.heartbeat_timeout_s=5"]
SYNC_SAVES = "checkpoint.async_save=false"  # a checkpoint has committed when its line prints


@dataclass(frozen=True)
class Straight:
    """The uninterrupted run of JOB through ``launch``: what every fault test compares with."""

    mesh: Path  # cpu8-two-hosts.yaml
    flags: list  # the --sets of every run: its compilation cache, and data from shards
    env: dict  # proc_env without jax's cache variables: the config's cache is the one used
    out: str  # launch's stdout
    records: list  # its metrics records
    losses: dict  # {step: loss}
    digests: dict  # {step: data_digest}: its batches


def launch(mesh, env, run_dir, flags, overrides=()):
    """``launch`` of JOB on ``mesh``'s two hosts into ``run_dir``; its stdout (it must exit 0)."""
    cmd = [sys.executable, "-m", "holmes_jax.launch", "--mesh", str(mesh), "--grace", "1"]
    cmd += [*flags, "--", *as_flags([*JOB, f"train.run_dir={run_dir}", *overrides])]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    return done.stdout


def restart_of(line: str) -> tuple[int, int, int]:
    """``(restart, checkpoint step (0: none), steps lost)`` of a "training resumed" line."""
    m = re.search(r"\(restart (\d+) from (?:checkpoint step (\d+)|step 0 \(no checkpoint\)), "
                  r"(\d+) steps? lost; ", line)  # fmt: skip
    assert m, line
    return int(m[1]), int(m[2] or 0), int(m[3])


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, proc_env):
    """Run JOB once, uninterrupted, on a directory of token shards, with the compilation
    cache in its own directory (a path: ``auto`` is off on CPU): the fault tests compare
    with its losses and batch digests, and their attempts compile from its cache instead
    of cold."""
    root = tmp_path_factory.mktemp("straight")
    mesh = two_host_mesh(root)
    env = {k: v for k, v in proc_env.items() if not k.startswith("JAX_")}
    env["JAX_PLATFORMS"] = "cpu"
    (root / "shards").mkdir()
    rng = np.random.default_rng(6)
    for i in range(3):  # raw uint16 shards without sidecars (read as data.token_dtype)
        rng.integers(0, 256, 30_000).astype(np.uint16).tofile(root / "shards" / f"{i}.bin")
    flags = [f"train.compilation_cache={root / 'compile_cache'}", "data.source=tokens"]
    flags.append(f"data.path={root / 'shards'}")
    out = launch(mesh, env, root / "run", ["--max-restarts", "0"], flags)
    recs = records(root / "run" / "metrics.jsonl")
    got = {r["step"]: r["loss"] for r in recs}
    assert sorted(got) == list(range(1, 7)), out[-3000:]
    assert "tokens (3 shards from " in out, out[-3000:]
    digests = {r["step"]: r["data_digest"] for r in recs}
    return Straight(mesh, flags, env, out, recs, got, digests)


def test_kill_at_random_steps_then_resume_matches_uninterrupted(tmp_path, straight):
    """JOB's processes started directly (no launcher), a checkpoint every step. SIGKILL at
    three seeded random steps: both processes, process 0 (the coordinator) and process 1
    (each of which ends the other), in a seeded order; the same command restarted until it
    finishes. Every loss any attempt logged equals the uninterrupted run's at that step."""
    job = JOB + [f"parallel.mesh={straight.mesh}", "checkpoint.every=1", *straight.flags]
    job += [f"checkpoint.dir={tmp_path / 'chaos'}"]
    rng = random.Random(15)
    kill_at = sorted(rng.sample(range(2, 6), 3))
    victims = rng.sample(["all", 0, 1], 3)  # each kind of death once, in a random order
    attempts = []
    for attempt in range(len(kill_at) + 1):
        metrics = tmp_path / f"chaos-{attempt}.jsonl"  # one file per attempt, one checkpoint dir
        procs = start_job(
            2, job + [f"train.metrics_path={metrics}"], tmp_path, f"chaos-{attempt}", straight.env
        )
        if attempt < len(kill_at):
            try:
                wait_for_step(procs, metrics, kill_at[attempt])
                for p in procs if victims[attempt] == "all" else [procs[victims[attempt]]]:
                    p.kill()
                codes = wait(procs)
            finally:
                wait(procs, timeout=1)
            assert all(c != 0 for c in codes), (attempt, codes)
        else:
            codes = wait(procs)
            log = (tmp_path / f"chaos-{attempt}-0.log").read_text()
            assert codes == [0, 0], log[-3000:]
        attempts.append(records(metrics) if metrics.exists() else [])
    logged = {r["step"] for got in attempts for r in got}
    assert logged == set(range(1, 7)), (kill_at, victims, attempts)
    for got in attempts:
        compare({r["step"]: r["loss"] for r in got}, straight.losses, atol=1e-6)
        assert all(r["data_digest"] == straight.digests[r["step"]] for r in got), got


def test_launch_restarts_after_sigkills_and_matches_the_uninterrupted_run(tmp_path, straight):
    """``launch`` on two hosts, a checkpoint every 3 steps, two injected faults: roce-0 killed
    at step 2 (before any checkpoint) and away for 2 s, then ib-0 (the coordinator) at
    step 4. The job restarts twice, continues its run directory (no ``-2``), its restarts
    compile from the run's compilation cache (filled by the uninterrupted run, which
    compiled cold), and every loss any attempt logged equals the uninterrupted run's at that
    step, bitwise. Saves are synchronous: the kill one step after the step-3 checkpoint must
    find it committed (an asynchronous save may still be writing then), and its line comes
    before the kill."""
    assert "compiled in " in straight.out and "(compilation cache: miss)" in straight.out
    chaos = tmp_path / "chaos"
    flags = ["--fail-host", "roce-0@2:+2", "--fail-host", "ib-0@4"]
    out = launch(straight.mesh, straight.env, chaos, flags, [*straight.flags, SYNC_SAVES])
    saved = out.index(f"] checkpoint step 3: {chaos}/checkpoints/3\n")
    assert saved < out.index("launch: --fail-host ib-0@4: SIGKILL"), out[-4000:]
    lines = [line for line in out.splitlines() if line.startswith("launch: ")]
    resumed = [line for line in lines if line.startswith("launch: training resumed")]
    assert "launch: --fail-host roce-0@2:+2: SIGKILL to roce-0 at step 2, away for 2 s" in lines
    assert "launch: --fail-host ib-0@4: SIGKILL to ib-0 at step 4" in lines
    # A SIGKILL lands a moment after the launcher reads the step it was due at: a busy
    # machine may finish one more step first, so steps lost are at least those up to it.
    exited = [re.match(r"launch: roce-0 \(process 1\) exited with signal SIGKILL at step (\d+); "
                       r".*then restart 1 of 3$", line) for line in lines]  # fmt: skip
    assert any(m and int(m[1]) >= 2 for m in exited), out[-4000:]
    assert len(resumed) == 2, out[-4000:]
    (first, none, lost_1), (second, ckpt, lost_2) = map(restart_of, resumed)
    assert (first, none, second, ckpt) == (1, 0, 2, 3) and lost_1 >= 2 and lost_2 >= 1, resumed
    assert all("compilation cache: hit): " in line for line in resumed), resumed
    # each restart's record: phases that add up to its total, the compile a cache hit
    itemised = records(chaos / "restarts.jsonl")
    assert [(r["restart"], r["resumed_from"]) for r in itemised] == [(1, 0), (2, 3)]
    for r in itemised:
        assert abs(sum(r[f"{p}_s"] for p in PHASES) - r["total_s"]) < 0.01, r
        assert "hit" in r["compile"] and r["join_s"] > 0 and r["compile_s"] > 0, r
    assert out.count("restart: continuing the run in ") == 2
    assert not (tmp_path / "chaos-2").exists()
    recs = records(chaos / "metrics.jsonl")
    assert {r["step"] for r in recs} == set(range(1, 7))
    assert [r["step"] for r in recs if "compile_s" in r] == [1, 1, 4]  # three attempts
    for r in recs:  # bitwise: the same plan and data order on every attempt
        assert r["loss"] == straight.losses[r["step"]], (r, straight.losses)
        assert r["data_digest"] == straight.digests[r["step"]], (r, straight.digests)


def test_a_host_lost_for_good_is_left_out_and_the_survivors_finish_the_run(tmp_path, straight):
    """``launch`` on two hosts (one per island), a checkpoint every 2 steps; roce-0 is killed
    at step 3 and never comes back. After ``--rejoin-timeout`` the supervisor starts ib-0
    alone with ``parallel.exclude_hosts=[roce-0]``; the trainer re-plans for one island (no
    pipeline across islands any more) and trains the faster measured of its two fastest
    predicted plans (both compiled and timed before training by ``--warm-failures``),
    resumes from the step-2 checkpoint and finishes. The
    global batch is unchanged, so every step's loss equals the uninterrupted run's up to the
    reduction order. Saves are synchronous, so the step-2 checkpoint has committed when
    roce-0 dies."""
    survivors = tmp_path / "survivors"
    flags = ["--fail-host", "roce-0@3:permanent", "--rejoin-timeout", "1", "--warm-failures"]
    overrides = [*straight.flags, "checkpoint.every=2", SYNC_SAVES]
    out = launch(straight.mesh, straight.env, survivors, flags, overrides)
    lines = [line for line in out.splitlines() if line.startswith("launch: ")]
    for lost in ("ib", "roce"):  # before training: each island's loss, its survivors timed
        head = f"launch: --warm-failures: the survivors of island {lost}: compiled and measured"
        assert any(x.startswith(head + " (fastest plan ") for x in lines), out[-4000:]
    assert (
        "launch: roce-0 did not come back within 1 s: the others go on without it, "
        "re-planned for the survivors, from the newest checkpoint" in lines
    ), out[-4000:]
    resumed = [line for line in lines if line.startswith("launch: training resumed")]
    assert len(resumed) == 1, resumed
    restart, ckpt, lost = restart_of(resumed[0])  # the SIGKILL at step 3 may land after 4
    assert (restart, ckpt) == (1, 2) and lost >= 1, resumed
    (itemised,) = records(survivors / "restarts.jsonl")  # the rejoin wait is its own phase
    assert itemised["wait_s"] >= 1.0 and itemised["steps_lost"] == lost, itemised
    replanned = [x.split("] ", 1)[1] for x in out.splitlines() if "] re-planned for" in x]
    assert len(replanned) == 1 and replanned[0].startswith("re-planned for the survivors "
        "without roce-0 (1 host, 4 devices): stage=1 "), replanned  # fmt: skip
    # before training, the planner's 2 fastest predicted plans each ran up to 3 steps; the
    # restart trains the faster measured, its program loaded from the cache
    (trial,) = [
        x.split("] ", 1)[1]
        for x in out.splitlines()
        if x.startswith("[ib-0")
        and "] --compile-only --measure: re-plan trial of 2 candidates (up to 3 steps each" in x
    ]  # the survivors of island roce's loss: ib-0
    (chose,) = [x.split("] ", 1)[1] for x in out.splitlines() if "] re-plan: " in x]
    assert chose.startswith("re-plan: 2 candidates as measured before training (launch "
                            "--warm-failures): 1. "), chose  # fmt: skip
    measured = [float(x) for x in re.findall(r"measured ([0-9.e+-]+) s", trial)]
    chosen = int(re.search(r"-> candidate (\d+) trains", chose)[1])
    assert len(measured) == 2 and measured[chosen - 1] == min(measured), (trial, chose)
    assert re.findall(r"measured ([0-9.e+-]+) s", chose) == re.findall(
        r"measured ([0-9.e+-]+) s", trial), (trial, chose)  # fmt: skip
    assert "hit" in itemised["compile"], itemised
    recs = records(survivors / "metrics.jsonl")
    assert {r["step"] for r in recs} == set(range(1, 7))
    for r in recs:  # one host of 4 devices now: the same batches, token for token
        assert abs(r["loss"] - straight.losses[r["step"]]) < 1e-4, (r, straight.losses)
        assert r["data_digest"] == straight.digests[r["step"]], (r, straight.digests)
    final = [r for r in recs if r["step"] == 6 and "eval_loss" in r][-1]
    straight_eval = [r for r in straight.records if "eval_loss" in r][-1]["eval_loss"]
    assert abs(final["eval_loss"] - straight_eval) < 0.02 * straight_eval


def test_nan_faults_stop_every_worker_with_exit_4_and_no_restart(tmp_path, straight):
    """``launch --fail-host HOST@STEP:nan`` on two hosts: steps 2 and 3 are non-finite in
    both processes (one program), one skip in a row is allowed. Step 2 is skipped and
    recorded; after step 3 every worker stops with one line and exit code 4, before the
    step-3 checkpoint, and the supervisor does not restart the job."""
    run_dir = tmp_path / "nan"
    cmd = [sys.executable, "-m", "holmes_jax.launch", "--mesh", str(straight.mesh)]
    cmd += ["--grace", "1", "--fail-host", "roce-0@3:nan", "--fail-host", "ib-0@2:nan", "--"]
    cmd += as_flags(
        [*JOB, *straight.flags, f"train.run_dir={run_dir}", "train.max_skipped_steps=1"]
    )
    done = subprocess.run(cmd, cwd=ROOT, env=straight.env, capture_output=True, text=True,
                          timeout=HANG_S)  # fmt: skip
    out = done.stdout
    assert done.returncode == 4, out[-4000:] + done.stderr[-2000:]
    lines = [line for line in out.splitlines() if line.startswith("launch: ")]
    assert lines[0] == (
        "launch: --fail-host roce-0@3:nan ib-0@2:nan: every worker of the job gets --set "
        "train.inject_nonfinite_steps=[2,3]"
    ), out[-4000:]
    assert any(
        line.endswith("not restarting: exit code 4 is a stop for non-finite steps, which a "
                      "restart replays") for line in lines
    ), out[-4000:]  # fmt: skip
    assert "training resumed" not in out
    # Each process's one line: its own stop, or a peer's (then from the store, exit 4 too).
    stop = "step 3: 2 consecutive non-finite steps (loss nan, grad norm nan) > "
    stop += "train.max_skipped_steps=1; the parameters are those after step 1; no checkpoint"
    for host in ("ib-0", "roce-0"):
        said = [x for x in out.splitlines() if x.startswith(f"[{host}") and "error: " in x]
        assert len(said) == 1 and stop in said[0], out[-4000:]
    recs = records(run_dir / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2] and recs[1]["skipped_steps"] == 1
    assert abs(recs[0]["loss"] - straight.losses[1]) < 1e-6 and recs[1]["loss"] != recs[1]["loss"]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]
