"""Independent DiLoCo islands (``diloco.mode: independent``) through the trainer: one job
per island, the outer sync between them over HTTP (:mod:`holmes_jax.diloco.islands`).

- Without faults the islands train what one ``spmd`` DiLoCo program trains: the mean of
  the islands' losses equals its loss at every step (fp32, equal shares, 1e-5).
- A peer that never answers is dropped after ``diloco.quorum_timeout_s`` and the island
  trains on alone (in this process, no launcher).
- ``launch --independent-islands`` with an island killed and restarted: the returning
  island heals from its live peer (no checkpoint read), takes part in the next outer step,
  and both end with the same global model.
- ``launch --independent-islands`` with one island's step made non-finite: it skips the
  step, abstains from the next round, takes its peer's model, and both end on one model.
"""

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from holmes_jax.cluster import island_jobs
from holmes_jax.cluster.launcher import free_port
from holmes_jax.cluster.supervisor import parse_fault
from holmes_jax.core.config import load_config
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.plan_request import plan_request
from holmes_jax.diloco.islands import IslandSync
from holmes_jax.diloco.messages import Expect
from holmes_jax.diloco.outer_files import load_outer
from holmes_jax.diloco.rounds import Rounds, SyncConfig, split_state
from holmes_jax.diloco.scope import island_outputs, island_scope
from holmes_jax.diloco.sparse import Feedback, Sparse
from holmes_jax.diloco.transport import Traffic
from holmes_jax.diloco.wire import pack, unpack
from holmes_jax.planner.grid import island_batch_rows
from holmes_jax.planner.topology import load_topology, without_hosts
from holmes_jax.runtime.loop import run
from tests.cluster.procs import two_host_mesh
from tests.common import HANG_S, ROOT, TINY_RUN, as_flags

pytestmark = pytest.mark.slow

# Two islands x data 4 (spmd: replica 2 x data 4), an outer step every 2 inner steps.
DILOCO = [
    *TINY_RUN,
    "diloco.enabled=true",
    "diloco.inner_steps=2",
    "parallel.data=4",
    "train.run_dir=null",
    "logging.progress=plain",
    "logging.log_every=1",
    "train.eval_every=4",
    "train.steps=8",
]
# The launched island jobs wait for each other's deltas as long as a test waits for anything
# (an island restarted on a loaded machine may take minutes to come back): the tests that
# drop a peer set their own timeout.
PATIENT = f"diloco.quorum_timeout_s={HANG_S}"
# and for an island whose process is down (restarting) too, not only a slow one
PATIENT_FOR_RESTARTS = f"diloco.down_wait_s={HANG_S}"
ROUND = re.compile(r"diloco: outer step after step (\d+): round (\d+), islands \[([\d, ]+)\]")


def records(path):
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        out.setdefault(rec["step"], rec)  # a restarted attempt's repeats: the first one
    return out


# Streaming: two fragments (one layer each, the embedding with the first, the head with the
# second), a round after every step, each fragment's every other step.
STREAM = "diloco.fragments=2"


@pytest.fixture(scope="module")
def spmd():
    """The same streaming DiLoCo run as one program (replica 2 x data 4): {step: record}."""
    cfg = load_config(None, [*DILOCO, STREAM, "parallel.replica=2"])
    return {r["step"]: r for r in run(cfg)}


def test_the_model_alone_converts_both_ways_compiled_ahead(tiny_config, make_program):
    """An outer step converts only the model (ZeRO-1, so the pipeline layout): the same
    parameters as the whole state's conversion; set back with a step, the parameters, step
    and optax counts change and the AdamW moments do not. Compiled ahead first, as a
    multi-process island does."""
    import jax

    from holmes_jax.core.spec import Degrees

    program = make_program(tiny_config("parallel.data=8", "optimizer.zero1=true"), Degrees(1, 8, 1))
    state = program.init(0)
    program.compile_layout_conversions()
    for fn in (program._jit.model_to_logical, program._jit.with_model):  # compiled ahead
        assert isinstance(fn.compiled, jax.stages.Compiled)
    model = program.model_to_logical(state)
    jax.tree.map(np.testing.assert_array_equal, model, program.to_logical(state).params)
    bumped = jax.tree.map(lambda a: a + 1.0, model)
    new = program.with_logical_model(state, bumped, step=7)
    jax.tree.map(np.testing.assert_array_equal, program.to_logical(new).params, bumped)
    assert int(new.step) == 7
    counts = [x for p, x in jax.tree_util.tree_leaves_with_path(new.opt_state)
              if getattr(p[-1], "name", None) == "count"]  # fmt: skip
    assert counts and all(int(c) == 7 for c in counts)

    def moments(st):
        leaves = jax.tree_util.tree_leaves_with_path(st.opt_state)
        return [x for p, x in leaves if getattr(p[-1], "name", None) != "count"]

    for a, b in zip(moments(new), moments(state), strict=True):
        np.testing.assert_array_equal(a, b)
    unchanged = program.with_logical_model(state, model)  # no step: step and counts kept
    assert int(unchanged.step) == int(state.step)


def test_each_island_writes_its_own_outputs():
    cfg = load_config(
        None,
        [
            *DILOCO,
            "diloco.mode=independent",
            "diloco.island=1",
            "diloco.peers=[127.0.0.1:1,127.0.0.1:2]",
            "train.run_dir=runs/x",
            "train.metrics_path=out/m.jsonl",
        ],
    )
    got = island_outputs(cfg)
    assert got.train.run_dir == "runs/x/island1"
    assert got.train.metrics_path == "out/m.island1.jsonl"


def test_islands_get_batch_rows_in_proportion_to_their_compute():
    """roce computes at half ib's peak on the slow-compute mesh: a third of the batch."""
    peers = "diloco.peers=[127.0.0.1:1,127.0.0.1:2]"
    slow = f"parallel.mesh={ROOT}/meshes/emu-4host-2island-slow-compute.yaml"
    base = [*DILOCO, "diloco.mode=independent", "diloco.island=1", peers]

    def rows(overrides):
        return island_batch_rows(plan_request(load_config(None, overrides)))

    assert rows([*base, slow, "train.global_batch_size=24"]) == [16, 8]
    one = [*base, "parallel.data=1", "train.global_batch_size=9"]
    assert rows(one) == [5, 4]
    units = [*base, slow, "train.global_batch_size=32"]  # 8 units of data 4: 5.33 and 2.67
    assert rows(units) == [20, 12]
    cfg, share = island_scope(load_config(None, [*base, slow, "train.global_batch_size=24"]))
    assert (share.offset, share.rows, share.total, share.name) == (16, 8, 24, "roce")
    assert cfg.train.global_batch_size == 8 and cfg.parallel.replica == 1
    with pytest.raises(ConfigError, match=r"train.global_batch_size=1: too small"):
        rows([*one[:-1], "train.global_batch_size=1"])


def test_the_launcher_plans_one_job_per_island_and_routes_faults():
    topology = load_topology(f"{ROOT}/meshes/cpu8-two-islands.yaml")
    hosts = [h for isl in topology.islands for h in isl.hosts]
    faults = [parse_fault("roce-1@3", hosts), parse_fault("ib-0@5:permanent", hosts)]
    jobs = island_jobs.plan_jobs(topology, faults, lambda host, k: f"{host}:{7 + k}", "k.key")
    assert [j.name for j in jobs] == ["ib", "roce"]
    assert [[h for i in j.topology.islands for h in i.hosts] for j in jobs] == [
        ["ib-0", "ib-1"],
        ["roce-0", "roce-1"],
    ]
    assert [[f.spec for f in j.faults] for j in jobs] == [["ib-0@5:permanent"], ["roce-1@3"]]
    assert jobs[1].args == (
        "--set", "diloco.enabled=true", "--set", "diloco.mode=independent",
        "--set", "diloco.island=1", "--set", "diloco.peers=['ib-0:7,ib-1:7','roce-0:7,roce-1:7']",
        "--set", "diloco.sync_key_file=k.key",
    )  # fmt: skip
    # ib on 2 hosts, roce on 1: 2 lanes, both served by roce-0 (two ports)
    uneven = without_hosts(topology, ["roce-1"])
    (job, _) = island_jobs.plan_jobs(uneven, [], lambda host, k: f"{host}:{7 + k}")
    args = (a for a in job.args if a != "--set")
    cfg = load_config(None, [*DILOCO, *args, "diloco.insecure=true"])
    assert cfg.diloco.lane_addresses() == [
        [("ib-0", 7), ("ib-1", 7)],
        [("roce-0", 7), ("roce-0", 8)],
    ]
    assert island_jobs.survivors(jobs[0], ["ib-1"]).num_hosts == 1
    with pytest.raises(island_jobs.IslandGone):
        island_jobs.survivors(jobs[0], ["ib-0", "ib-1"])


def alone_config(run_dir, *extra):
    """Island 0 of two whose peer never answers, checkpoints every 4 steps in ``run_dir``;
    two lanes, both served by this one process."""
    return load_config(
        None,
        [
            *DILOCO,
            "diloco.mode=independent",
            "diloco.island=0",
            "diloco.peers=["
            + ",".join(f"'127.0.0.1:{free_port()},127.0.0.1:{free_port()}'" for _ in range(2))
            + "]",
            "diloco.quorum_timeout_s=1",
            "parallel.devices=4",  # the island's 4 of this process's 8
            f"train.run_dir={run_dir}",
            "checkpoint.every=4",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """The uninterrupted run of :func:`alone_config`: (history, run dir)."""
    run_dir = tmp_path_factory.mktemp("alone") / "run"
    return run(alone_config(run_dir)), run_dir


def test_a_silent_peer_is_dropped_and_the_island_trains_on(alone):
    """Its first outer step waits ``quorum_timeout_s`` for the peer, then every round is its
    own, to the last step; the metrics name the island."""
    history, run_dir = alone
    assert [r["step"] for r in history] == list(range(1, 9))
    assert all(r["island"] == "island0" for r in history)
    assert history[1]["step_time_s"] >= 1.0  # step 2 held the first round: the timeout
    written = records(run_dir / "island0" / "metrics.jsonl")
    assert sorted(written) == list(range(1, 9))
    assert sorted(p.name for p in (run_dir / "island0" / "checkpoints" / "outer").iterdir()) == [
        "4.lane0.outer",
        "4.lane1.outer",
        "8.lane0.outer",
        "8.lane1.outer",
    ]
    for lane in (0, 1):  # the last round was its own: island 0 alone, leading
        meta, _ = unpack(
            (run_dir / "island0" / "checkpoints" / "outer" / f"8.lane{lane}.outer").read_bytes()
        )
        assert (meta["round"], meta["members"], meta["leader"]) == (4, [0], 0)


def test_resume_across_an_outer_step_is_exact(alone, tmp_path):
    """Resumed from the uninterrupted run's checkpoint at step 4 (an outer step) with the
    outer state saved beside it (global model, momentum 0.9, round): the losses after the
    resume are the uninterrupted run's."""
    history, run_dir = alone
    src, dst = run_dir / "island0" / "checkpoints", tmp_path / "run" / "island0" / "checkpoints"
    shutil.copytree(src / "4", dst / "4")  # the uninterrupted run's checkpoint at step 4
    (dst / "outer").mkdir()
    for lane in (0, 1):
        shutil.copy(src / "outer" / f"4.lane{lane}.outer", dst / "outer" / f"4.lane{lane}.outer")
    rest = run(alone_config(tmp_path / "run"))
    assert [r["step"] for r in rest] == [5, 6, 7, 8]
    for got, want in zip(rest, history[4:], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6), got["step"]
    assert rest[-1]["eval_loss"] == pytest.approx(history[-1]["eval_loss"], rel=1e-6)


def test_a_sparse_island_resumes_with_its_error_feedback_exactly(tmp_path):
    """outer_dtype sparse (8 of each 64 values, 2 bits): the buffer of what the island has
    not sent is saved with each checkpoint's outer state; resumed at step 4, the run sends
    the uninterrupted run's deltas and logs its losses (the buffer holds mass, so a resume
    without it would send other deltas at step 6)."""
    sparse = ["diloco.outer_dtype=sparse", "diloco.sparse_chunk=64", "diloco.sparse_k=8"]
    whole = run(alone_config(tmp_path / "a", *sparse))
    src = tmp_path / "a" / "island0" / "checkpoints"
    dst = tmp_path / "b" / "island0" / "checkpoints"
    shutil.copytree(src / "4", dst / "4")
    (dst / "outer").mkdir()
    for lane in (0, 1):
        for kind in ("outer", "residual"):
            name = f"4.lane{lane}.{kind}"
            shutil.copy(src / "outer" / name, dst / "outer" / name)
        kept = unpack((src / "outer" / f"4.lane{lane}.residual").read_bytes())[1]
        assert kept and all(np.abs(v).max() > 0 for v in kept.values())
    rest = run(alone_config(tmp_path / "b", *sparse))
    assert [r["step"] for r in rest] == [5, 6, 7, 8]
    for got, want in zip(rest, whole[4:], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6), got["step"]
    assert whole[1]["outer_bytes_sent"] == 0  # alone: its rounds never leave it


def test_killed_island_heals_from_its_peer_and_matches_spmd_before(tmp_path, spmd, proc_env):
    """``launch --independent-islands`` with ib on one host and roce on two: two lanes,
    both served by ib's process, one by each of roce's; two fragments (:data:`STREAM`).
    roce-1 is killed at step 4 and the roce job restarts at once (ib waits for it:
    ``diloco.down_wait_s``). Before the kill the mean
    of the islands' losses is spmd's; roce comes back healed from ib on both lanes (no
    checkpoint), joins the next outer step, and both end with one global model, bit for bit
    in every lane."""
    mesh = two_host_mesh(tmp_path, roce_hosts=2)
    run_dir = tmp_path / "run"  # each island's checkpoints in run/<island>: not read to heal
    cache = f"train.compilation_cache={tmp_path / 'cache'}"
    env = {k: v for k, v in proc_env.items() if not k.startswith("JAX_")}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "holmes_jax.launch", "--mesh", str(mesh), "--grace", "1"]
    cmd += ["--independent-islands", "--max-restarts", "1", "--fail-host", "roce-1@4"]
    job = [*DILOCO, STREAM, PATIENT, PATIENT_FOR_RESTARTS, f"train.run_dir={run_dir}"]
    job += ["checkpoint.every=2", cache]
    cmd += ["--", *as_flags(job)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-2000:]
    assert "in 2 lanes, 2 per process" in out and "in 2 lanes, 1 per process" in out
    ib, roce = (records(run_dir / island / "metrics.jsonl") for island in ("ib", "roce"))
    assert sorted(ib) == list(range(1, 9)), out[-3000:]
    for step in range(1, 5):  # both islands' first attempts: one spmd program's math
        mean = (ib[step]["loss"] + roce[step]["loss"]) / 2
        assert mean == pytest.approx(spmd[step]["loss"], rel=1e-5, abs=1e-5), step
    assert ib[4]["eval_loss"] == pytest.approx(spmd[4]["eval_loss"], rel=1e-5)
    assert "[roce-0] diloco: healed from a live peer" in out, out[-3000:]
    assert "[roce-0] resumed from" not in out  # its own checkpoint at step 4 is not read
    rounds = [(int(s), int(r), m) for s, r, m in ROUND.findall(out)]
    assert (8, 8, "0, 1") in rounds, rounds  # the last round: both islands again
    for lane in (0, 1):  # the outer state saved at step 8: one global model, bit for bit
        ib_g, roce_g = (
            split_state(unpack((run_dir / i / "checkpoints" / "outer" / f"8.lane{lane}.outer")
                               .read_bytes())[1])[0]
            for i in ("ib", "roce")
        )  # fmt: skip
        assert sorted(ib_g) == sorted(roce_g) and all(k.endswith(f"#{lane}") for k in ib_g)
        for key in ib_g:
            np.testing.assert_array_equal(ib_g[key], roce_g[key])
    assert ib[8]["eval_loss"] == pytest.approx(roce[8]["eval_loss"], rel=1e-6)
    # each round's bytes, counted at the transport, on the record of its step (a round after
    # every step: the two fragments take turns)
    assert ib[7]["outer_bytes_sent"] > 0 and roce[7]["outer_bytes_received"] > 0
    # round 8: roce's delta up, ib's step back, each fragment 0 in fp32 over both lanes
    # (roce's record sums its two processes' lanes; one alone would be half)
    assert 0.8 < roce[8]["outer_bytes_sent"] / ib[8]["outer_bytes_sent"] < 1.25


class _Sync:
    """OuterSync's surface for IslandSync: each round ``global ← global − Δ + 10`` (the +10
    stands for the other islands' progress)."""

    def __init__(self, glob):
        self.cond, self.round, self.members = threading.Condition(), 0, {0, 1}
        self.glob, self.sent, self.skip = dict(glob), [], 0
        self.traffic = Traffic()  # nothing crosses a socket here

    def sync_delta(self, delta, tokens, average=False):
        self.sent.append(float(delta["w"][0]))
        self.glob = {k: self.glob[k] - delta[k] + 10 for k in self.glob}
        self.round += 1 + self.skip
        return dict(self.glob)

    def abstain(self, average=False):  # sends nothing: the others' progress alone
        self.sent.append(None)
        self.glob = {k: v + 10 for k, v in self.glob.items()}
        self.round += 1
        return dict(self.glob)

    def sync(self, theta, tokens, average=False):  # in step; ``skip`` rounds closed without it
        self.sent.append(float(theta["w"][0]))
        self.glob = {k: v + 10 for k, v in self.glob.items()}
        self.round += 1 + self.skip
        return dict(self.glob)


def test_a_lane_address_of_another_host_is_refused_in_one_line():
    """An island restarted without the host of one of its lane addresses cannot serve that
    lane: a ConfigError names the address (TEST-NET-1: on no interface here)."""
    job = ["diloco.mode=independent", "diloco.island=0", "diloco.insecure=true"]
    job.append(f"diloco.peers=['192.0.2.1:{free_port()}','127.0.0.1:{free_port()}']")
    cfg, share = island_scope(load_config(None, [*DILOCO, *job]))
    island = IslandSync(cfg, None, share, say=lambda line: None)
    island._expect = lambda lane: Expect({}, "fp32", frozenset({0, 1}), 1, 0.7, 0.9)  # no program
    with pytest.raises(ConfigError, match=r"diloco.peers\[0\]: lane 0's address 192.0.2.1:"):
        island._serve(0, None)


def test_the_error_feedback_buffer_is_saved_and_restored_exactly(tmp_path):
    """outer_dtype sparse: the buffer is saved beside the outer state and comes back bit
    for bit with it; a buffer of another shape is one line naming the file."""
    job = ["diloco.mode=independent", "diloco.island=0", "diloco.peers=[127.0.0.1:1,127.0.0.1:2]"]
    job.append("diloco.outer_dtype=sparse")
    cfg, share = island_scope(load_config(None, [*DILOCO, *job]))
    island = IslandSync(cfg, None, share, say=lambda line: None)
    sp = Sparse(16, 2, 2)
    glob = {"w#0": np.arange(12, dtype=np.float32).reshape(4, 3)}
    rounds = Rounds(0, [0, 1], SyncConfig(outer_dtype="sparse", sparse=sp), (glob, glob))
    feedback = Feedback(sp)
    feedback.encode("w#0", np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32))
    sync = SimpleNamespace(snapshot=rounds.state_body, feedback=feedback, cond=threading.Lock())
    island.syncs = {0: sync}
    island.save_outer(str(tmp_path), 6)
    expect = rounds.expect
    (g, _), meta = load_outer(str(tmp_path), 6, 0, expect)
    assert np.array_equal(g["w#0"], glob["w#0"]) and meta["residual"].keys() == {"w#0"}
    assert np.array_equal(meta["residual"]["w#0"], feedback.buffers["w#0"])
    # 10 values unsent, 1 sent with its 2-bit error (the largest decodes exactly)
    assert np.count_nonzero(feedback.buffers["w#0"]) == 11
    bad = tmp_path / "outer" / "6.lane0.residual"
    bad.write_bytes(pack({}, {"w#0": np.zeros(5, np.float32)}))
    with pytest.raises(ConfigError, match=r"6.lane0.residual: array w#0 is not a finite fp32"):
        load_outer(str(tmp_path), 6, 0, expect)


def test_a_late_round_moves_the_island_on_to_the_step_it_adopted():
    """H = 2, in step: a round that closed without this island's delta leaves it holding
    a later round (round 4, which ended at step 8): it goes on from step 8, with the
    optimizer's step counts set there, as a healed island does."""
    job = ["diloco.mode=independent", "diloco.island=0", "diloco.peers=[127.0.0.1:1,127.0.0.1:2]"]
    job.append("train.steps=20")
    cfg, share = island_scope(load_config(None, [*DILOCO, *job]))
    island = IslandSync(cfg, None, share, say=lambda line: None)
    island.syncs = {0: _Sync({"w": np.zeros(1, np.float32)})}
    island._theta = lambda state: {"w": np.asarray([state], np.float32)}
    island._skipped = lambda state: 0
    counts = []
    island._with_global = lambda state, glob, step, add=False: counts.append(step) or state
    assert island.after_step(1.0, 2) == (1.0, 2)  # round 1, in step
    island.sync.skip = 2  # rounds 2 and 3 closed without it
    assert island.after_step(1.0, 4) == (1.0, 8) and island.sync.round == 4
    assert counts == [None, 8] and island.last_step == 8
    # with overlap (τ = 1): the round sent after step 10 comes back as round 7 (ended at
    # step 14), merged after step 11: on from step 15, the last round's step 14
    island.d = dataclasses.replace(island.d, overlap_steps=1)
    island.snap = {"w": np.zeros(1, np.float32)}
    assert island.after_step(1.0, 10) == (1.0, 10) and island.merge_at == 11
    assert island.after_step(1.0, 11)[1] == 15 and island.sync.round == 7
    assert counts[-1] == 15 and island.last_step == 14


def test_overlap_merges_each_round_after_its_overlap_steps():
    """H = 2, overlap_steps = 1, on numbers: the round sent after step 2 merges after step
    3 as θ ← g + (θ − θ_sent); the next Δ is the progress since g; the last round is
    awaited and adopted."""
    cfg = load_config(
        None,
        [
            *DILOCO,
            "diloco.mode=independent",
            "diloco.island=0",
            "diloco.peers=[127.0.0.1:1,127.0.0.1:2]",
            "diloco.overlap_steps=1",
            "train.steps=6",
        ],
    )
    cfg, share = island_scope(cfg)
    island = IslandSync(cfg, None, share, say=lambda line: None)
    island.syncs = {0: _Sync({"w": np.zeros(1, np.float32)})}
    island.snap = {"w": np.zeros(1, np.float32)}
    island._theta = lambda state: {"w": np.asarray([state], np.float32)}
    island._with_global = lambda state, glob, step, add=False: add * state + float(glob["w"][0])
    island._skipped = lambda state: 0
    got = [island.after_step(1.0, 2)]  # sends Δ = 0 − 1, in flight: θ unchanged
    got.append(island.after_step(1.5, 3))  # g1 = 11: θ = 11 + (1.5 − 1)
    got.append(island.after_step(12.5, 4))  # sends Δ = 11 − 12.5
    got.append(island.after_step(13.0, 5))  # g2 = 22.5: θ = 22.5 + (13 − 12.5)
    got.append(island.after_step(24.0, 6))  # sends Δ = 22.5 − 24; the last: g3 = 34 adopted
    assert island.sync.sent == [-1.0, -1.5, -1.5]
    assert got == [(1.0, 2), (11.5, 3), (12.5, 4), (23.0, 5), (34.0, 6)]
    assert island.pending is None and island.merge_at is None
    with pytest.raises(ConfigError, match=r"diloco.overlap_steps=2: must be in \[0, diloco"):
        load_config(None, [*DILOCO, "diloco.mode=independent", "diloco.overlap_steps=2"])
    job = [*DILOCO, "diloco.mode=independent", "diloco.inner_steps=10", "diloco.fragments=3"]
    with pytest.raises(ConfigError, match=r"overlap_steps=3: must be in \[0, 3, the fewest"):
        load_config(None, [*job, "diloco.overlap_steps=3"])  # rounds after steps 3, 6, 10


def test_overlapped_fragments_merge_only_their_own_parameters():
    """Two fragments, H = 4, overlap_steps = 1, on numbers (``a`` in fragment 0, ``b`` in
    fragment 1; each round adds 10 to what it carries): fragment 1's round is sent after
    step 2 with b's progress alone and merged after step 3 into b alone; fragment 0's, sent
    after step 4, carries a's progress since the start and merges into a alone."""
    job = ["diloco.mode=independent", "diloco.island=0", "diloco.peers=[127.0.0.1:1,127.0.0.1:2]"]
    job += ["diloco.inner_steps=4", "diloco.fragments=2", "diloco.overlap_steps=1"]
    cfg, share = island_scope(load_config(None, [*DILOCO, *job, "train.steps=8"]))
    island = IslandSync(cfg, None, share, say=lambda line: None)
    zero = {"a@0#0": np.zeros(1, np.float32), "b@1#0": np.zeros(1, np.float32)}
    sync = island.syncs[0] = _Sync(zero)
    sync.sync_delta = lambda delta, tokens, average=False: (
        sync.sent.append(sorted(delta))
        or sync.glob.update({k: sync.glob[k] - delta[k] + 10 for k in delta})
        or dict(sync.glob)
    )
    island.snap = dict(zero)
    island._theta = lambda state: {k: np.asarray([v], np.float32) for k, v in state.items()}
    island._with_global = lambda state, glob, step, add=False: {
        k: (state[k] if add else 0.0) + float(glob[k][0]) for k in state
    }
    island._skipped = lambda state: 0
    theta = {"a@0#0": 1.0, "b@1#0": 1.0}
    assert island.after_step(theta, 2) == (theta, 2)  # sends Δb = 0 − 1
    moved, _ = island.after_step({"a@0#0": 1.5, "b@1#0": 1.5}, 3)  # gb = 11
    assert moved == {"a@0#0": 1.5, "b@1#0": 11.5}
    island.after_step({"a@0#0": 2.0, "b@1#0": 12.0}, 4)  # sends Δa = 0 − 2
    moved, _ = island.after_step({"a@0#0": 2.5, "b@1#0": 12.5}, 5)  # ga = 12
    assert moved == {"a@0#0": 12.5, "b@1#0": 12.5}
    assert sync.sent == [["b@1#0"], ["a@0#0"]]
    assert float(island.snap["a@0#0"][0]) == 12.0 and float(island.snap["b@1#0"][0]) == 11.0


@pytest.mark.parametrize("overlap", [0, 1])
def test_a_round_with_a_skipped_step_abstains_and_takes_the_global_model(overlap):
    """H = 2: the inner steps of the second round skip a non-finite step (the state's
    counter grows), or leave θ non-finite: the island sends nothing, and its parameters
    become the new global model (with overlap: the global model alone, not plus the
    progress since the send)."""
    job = ["diloco.mode=independent", "diloco.island=0", "diloco.peers=[127.0.0.1:1,127.0.0.1:2]"]
    job += [f"diloco.overlap_steps={overlap}", "train.steps=20"]
    cfg, share = island_scope(load_config(None, [*DILOCO, *job]))
    said = []
    island = IslandSync(cfg, None, share, say=said.append)
    island.syncs = {0: _Sync({"w": np.zeros(1, np.float32)})}
    island.snap = {"w": np.zeros(1, np.float32)}
    island._theta = lambda state: {"w": np.asarray([state], np.float32)}
    island._with_global = lambda state, glob, step, add=False: (
        (state if add else 0.0) + float(glob["w"][0])
    )
    skipped = {2: 0, 3: 0, 4: 1, 5: 1, 6: 1, 7: 1, 8: 1}
    island._skipped = lambda state: skipped[step]
    got = []
    for step, theta in [(2, 1.0), (3, 1.5), (4, 12.0), (5, 13.0), (6, np.nan), (7, 1.0), (8, 2.0)]:
        got.append(island.after_step(theta, step)[0])
    sent = island.sync.sent
    assert sent[1] is None and sent[2] is None and sent[0] is not None and sent[3] is not None
    assert sum("non-finite step(s) skipped since step 2" in line for line in said) == 1
    assert sum("non-finite parameters since step 4" in line for line in said) == 1
    if not overlap:  # θ ← the global model after each round: 10, then 20, 30 (abstained)
        assert got[2] == 20.0 and got[4] == 30.0
    else:  # merged one step later: the abstained rounds take g alone (21, 31), no NaN
        assert got[3] == 21.0 and got[5] == 31.0


def test_a_nan_island_abstains_and_the_others_train_as_if_it_missed_the_round(tmp_path, proc_env):
    """``launch --independent-islands --fail-host roce-0@3:nan``: roce's step 3 is not
    finite, so it is skipped and roce sends nothing in the round after step 4 (it abstains:
    the round is ib's delta alone) and takes ib's global model; both islands train on, take
    part in every later round, and end with one global model, bit for bit.

    Against a reference run where roce missed that round with every value finite
    (``roce-0@4:abstain``), ib's losses are the same at every step and roce's from its heal
    on: nothing of the NaN reached anyone. The inner optimizer has no memory here (AdamW
    with b1 = b2 = 0 and a constant rate), so the skipped step leaves no trace in roce's
    optimizer state either: the two runs differ only in roce's steps 3 and 4."""
    mesh = two_host_mesh(tmp_path)
    env = {k: v for k, v in proc_env.items() if not k.startswith("JAX_")}
    env["JAX_PLATFORMS"] = "cpu"
    memoryless = ["optimizer.b1=0", "optimizer.b2=0", "optimizer.warmup_steps=0"]
    memoryless.append("optimizer.min_lr_ratio=1")

    def launch(fault: str, run_dir):
        cmd = [sys.executable, "-m", "holmes_jax.launch", "--mesh", str(mesh), "--grace", "1"]
        cmd += ["--independent-islands", "--fail-host", fault]
        job = [*DILOCO, *memoryless, PATIENT, f"train.run_dir={run_dir}", "checkpoint.every=4"]
        cmd += ["--", *as_flags(job)]
        done = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S
        )
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
        runs = (records(run_dir / island / "metrics.jsonl") for island in ("ib", "roce"))
        return done.stdout, *runs

    run_dir = tmp_path / "run"
    out, ib, roce = launch("roce-0@3:nan", run_dir)
    assert "[roce-0] diloco: island roce: 1 non-finite step(s) skipped since step 2" in out, out
    assert sorted(ib) == sorted(roce) == list(range(1, 9))
    assert roce[3]["skipped_steps"] == 1 and roce[8]["skipped_steps"] == 1
    assert ib[8]["skipped_steps"] == 0 and np.isfinite(roce[8]["loss"])
    rounds = {(int(s), m) for s, r, m in ROUND.findall(out)}
    assert (4, "0, 1") in rounds and (8, "0, 1") in rounds, rounds  # abstained, still a member
    saved = [run_dir / i / "checkpoints" / "outer" / "8.lane0.outer" for i in ("ib", "roce")]
    glob = [split_state(unpack(path.read_bytes())[1])[0] for path in saved]
    assert glob[0].keys() == glob[1].keys()
    for key in glob[0]:
        np.testing.assert_array_equal(glob[0][key], glob[1][key])
    assert ib[8]["eval_loss"] == pytest.approx(roce[8]["eval_loss"], rel=1e-6)
    # the last round's bytes, counted at the transport, on its record only
    assert ib[8]["outer_bytes_sent"] > 0 and roce[8]["outer_bytes_received"] > 0
    assert "outer_bytes_sent" not in ib[7]

    ref_out, ref_ib, ref_roce = launch("roce-0@4:abstain", tmp_path / "reference")
    assert "island roce: diloco.inject_abstain_steps since step" in ref_out, ref_out
    assert ref_roce[8]["skipped_steps"] == 0
    for step in range(1, 9):
        assert ib[step]["loss"] == pytest.approx(ref_ib[step]["loss"], rel=1e-5, abs=1e-5), step
        if step >= 5:
            want = ref_roce[step]["loss"]
            assert roce[step]["loss"] == pytest.approx(want, rel=1e-5, abs=1e-5), step
    assert ib[8]["eval_loss"] == pytest.approx(ref_ib[8]["eval_loss"], rel=1e-5)
    assert roce[4]["loss"] != pytest.approx(ref_roce[4]["loss"], rel=1e-5)  # it did differ
