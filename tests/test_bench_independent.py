"""scripts/bench_independent.py without root: its argument checks, the launch commands of
its rows (their overrides load through the real loader), and the pure helpers that read
step rates, outages and heal times from a time-stamped launcher log."""

import argparse

import pytest

from holmes_jax.core.config import load_config
from holmes_jax.core.errors import ConfigError
from tests.common import ROOT, load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_independent")


def _args(**kw):
    base = dict(steps=300, inner_steps=10, quorum_timeout=10.0, outage=30.0, rows="kill")
    base["overlap_steps"], base["set"] = 5, []
    base["keep_logs"], base["link_mbit"] = None, None
    return argparse.Namespace(**{**base, **kw})


def test_argument_checks_are_one_line_errors_and_faults_bring_their_baseline(bench):
    assert bench.check_args(_args()) == ["independent", "kill"]
    assert bench.check_args(_args(rows="cut,spmd")) == ["spmd", "independent", "cut"]
    for kw, message in [
        (dict(rows="kill,nope"), "--rows=kill,nope: must be a comma list of spmd"),
        (dict(inner_steps=0), "--inner-steps=0: must be >= 1"),
        (dict(steps=20), "--steps=20: must be >= 10 and >= 3 x --inner-steps (30)"),
        (dict(outage=0.0), "--outage=0: must be a number of seconds > 0"),
        (dict(quorum_timeout=-1.0), "--quorum-timeout=-1: must be a number"),
        (dict(link_mbit=0.0), "--link-mbit=0: must be > 0"),
    ]:
        with pytest.raises(
            ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")
        ):
            bench.check_args(_args(**kw))
    assert bench.main(["--steps", "5"]) == 2  # before any root check or run
    with pytest.raises(ConfigError, match=r"^--keep-logs=.*: must be a new or empty folder"):
        bench.check_args(_args(keep_logs=ROOT))


def test_rows_launch_what_they_say_and_their_overrides_load(bench):
    at = bench.fault_steps(300, seed=0)
    assert at == bench.fault_steps(300, seed=0) and all(60 <= s <= 150 for s in at.values())
    kill = bench.launch_cmd("kill", _args(), "/r", 77)
    assert kill[kill.index("--fail-host") + 1] == "roce-0@77:+30"
    assert "--independent-islands" in kill and "--emulate" in kill
    cut = bench.launch_cmd("cut", _args(), "/r", 88)
    assert cut[cut.index("--cut-islands") + 1] == "88:+30" and "--fail-host" not in cut
    spmd = bench.launch_cmd("spmd", _args(), "/r", None)
    assert "--independent-islands" not in spmd
    island = ["diloco.mode=independent", "diloco.island=1", "diloco.peers=[a:1,b:1]"]
    island.append("diloco.insecure=true")  # the launcher gives each job a key
    for cmd, extra in [(spmd, []), (kill, island)]:
        sets = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
        cfg = load_config(bench.QUICKSTART, sets + extra)
        assert cfg.diloco.enabled and cfg.diloco.inner_steps == 10 and cfg.train.steps == 300
    assert load_config(bench.QUICKSTART, [c for i, c in enumerate(spmd) if spmd[i - 1] == "--set"]
                       ).parallel.replica == 2  # fmt: skip


# A kill run: ib steps 1 per second, slower (0.5 s) while roce is away; roce killed at
# step 10 (t = 10), back at t = 40 (outage 30), healed, in an outer step at t = 52.
KILL_LOG = (
    [(float(s), f"[ib-0  ] step {s} | loss 3.0") for s in range(1, 11)]
    + [(10.1, "launch: --fail-host roce-0@10:+30: SIGKILL to roce-0 at step 10, away for 30 s")]
    + [(10.0 + 2 * k, f"[ib-0  ] step {10 + k} | loss 2.9") for k in range(1, 25)]
    + [(49.0, "[roce-0] diloco: healed from a live peer in 3.5 s: round 3, the global model")]
    + [(52.0, "[roce-0] diloco: outer step after step 30: round 4, islands [0, 1]")]
    + [(5.0, "[roce-0] diloco: outer step after step 5: round 1, islands [0, 1]")]
)


def test_kill_outage_rates_and_heal_times_from_the_log(bench):
    ev = bench.parse_events(KILL_LOG)
    assert ev.kills == [(10.1, "roce-0", 10)] and ev.heals == [(49.0, "roce-0", 3.5)]
    assert [r[2:] for r in ev.rounds] == [(30, (0, 1)), (5, (0, 1))]
    assert bench.step_seconds([(1.0, 1), (2.0, 2), (4.0, 3), (7.0, 4)]) == pytest.approx(2.5)
    with pytest.raises(ValueError):
        bench.step_seconds([(1.0, 1)])
    assert bench.window_rate(ev.steps["ib-0"], 10.1, 52.0) == (0.5, 11, 31)
    assert bench.window_rate(ev.steps["ib-0"], 100, 200) is None
    base = bench.parse_events([(float(s), f"[ib-0] step {s}") for s in range(1, 50)])
    row = bench.fault_row("kill", ev, base, outage=30.0)
    assert row["fault_step"] == 10 and row["heal_s"] == 3.5
    assert row["in_step_s"] == pytest.approx(49.0 - 40.1)  # its round taken in step
    assert row["rejoin_s"] == pytest.approx(52.0 - 40.1)  # from its start: kill + outage
    assert row["survivor_rate_ratio"] == pytest.approx(0.5)  # 0.5 steps/s against 1


def test_cut_window_is_the_cut_and_rejoin_needs_both_islands(bench):
    lines = [(float(t), f"[{h}] step {t}") for t in range(1, 40) for h in ("ib-0", "roce-0")]
    lines += [
        (10.0, "launch: --cut-islands 10:+20: links between islands cut at step 10 for 20 s"),
        (30.0, "launch: --cut-islands 10:+20: links between islands restored after 20.0 s"),
        (31.0, "[ib-0] diloco: outer step after step 30: round 3, islands [0]"),
        (33.5, "[ib-0] diloco: outer step after step 32: round 4, islands [0, 1]"),
    ]
    ev = bench.parse_events(lines)
    assert (ev.cut, ev.restored) == (10.0, 30.0)
    slow = [(10 + (t - 10) * 1.25 if t > 10 else t, s) for t, s in ev.steps["roce-0"]]  # roce 0.8x
    ev.steps["roce-0"] = slow
    row = bench.fault_row("cut", ev, bench.parse_events(lines), outage=20.0)
    assert row["rejoin_s"] == 3.5
    assert row["survivor_rate_ratio_by_host"]["ib-0"] == 1.0
    assert row["survivor_rate_ratio"] == pytest.approx(0.8)  # the slower survivor


def test_overlap_and_unequal_rows_launch_what_they_say(bench):
    assert bench.check_args(_args(rows="overlap", overlap_steps=5)) == ["independent", "overlap"]
    with pytest.raises(ConfigError, match=r"^--overlap-steps=10: must be > 0 and below"):
        bench.check_args(_args(rows="overlap", overlap_steps=10))
    for row in ("overlap", "unequal"):
        cmd = bench.launch_cmd(row, _args(overlap_steps=5), "/r", None)
        sets = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
        extra = ["diloco.mode=independent", "diloco.island=0", "diloco.peers=[a:1,b:1]"]
        extra.append("diloco.insecure=true")  # the launcher gives each job a key
        cfg = load_config(bench.QUICKSTART, sets + extra)
        if row == "overlap":
            assert cfg.diloco.overlap_steps == 5 and cmd[cmd.index("--mesh") + 1] == bench.MESH
        else:
            assert cmd[cmd.index("--mesh") + 1] == cfg.parallel.mesh == bench.UNEQUAL_MESH
            assert cfg.train.global_batch_size == bench.UNEQUAL_BATCH


def test_unequal_islands_together_against_each_alone(bench):
    # ib: 16 rows, 1 s a step; roce: 8 rows, 1 s a step; an outer step every 5 steps costs
    # roce 0.5 s and ib waits for it; the last step awaits the final round and evaluates
    # (4 s more): 19 steps of 24 rows in 25 s against 24 rows/s alone.
    lines = [
        (0.0, "[ib-0  ] diloco: independent island ib (0 of 2): rows 0-15 of the 24-row g"),
        (0.0, "[roce-0] diloco: independent island roce (1 of 2): rows 16-23 of the 24-r"),
    ]
    for host in ("ib-0  ", "roce-0"):
        t = 0.0
        for s in range(1, 22):
            t += 1.0 + (0.5 if s % 5 == 1 and s > 1 else 0.0) + (4.0 if s == 21 else 0.0)
            lines.append((t, f"[{host}] step {s} | loss 3.0"))
    ev = bench.parse_events(lines)
    assert ev.rows == {"ib-0": 16, "roce-0": 8}
    assert bench.inner_step_seconds(ev.steps["ib-0"]) == 1.0
    row = bench.unequal_row(ev, 24)
    assert row["alone_rows_per_s"] == {"ib-0": 16.0, "roce-0": 8.0}
    assert row["joint_over_sum"] == pytest.approx(19 / 25, abs=1e-3)  # steps 2-21 in 25 s
    assert "steady_joint_over_sum" not in row  # no round with both islands: no steady state
    # roce joins at the round after step 10: from there to the step before the last, steps
    # 10-20 take 10 x 1 s + 2 x 0.5 s
    lines.append((10.5, "[ib-0  ] diloco: outer step after step 5: round 1, islands [0]"))
    lines.append((11.0, "[ib-0  ] diloco: outer step after step 10: round 2, islands [0, 1]"))
    row = bench.unequal_row(bench.parse_events(lines), 24)
    assert (row["steady_from_step"], row["steady_to_step"]) == (10, 20)
    assert row["steady_joint_over_sum"] == pytest.approx(10 / 11, abs=1e-3)
    with pytest.raises(RuntimeError, match="rows or steps missing"):
        bench.unequal_row(bench.parse_events(lines[2:]), 24)


def test_overrides_reach_every_row_and_its_tokens(bench):
    # diloco.overlap_steps alone is no valid config outside an island's job: tokens need none
    args = _args(set=["diloco.overlap_steps=5", "model.seq_len=64"])
    cmd = bench.launch_cmd("overlap", args, "/r", None)
    assert cmd[-4:] == ["--set", "diloco.overlap_steps=5", "--set", "model.seq_len=64"]
    assert bench.tokens_per_step("overlap", args) == 32 * 64
    assert bench.tokens_per_step("unequal", args) == bench.UNEQUAL_BATCH * 64


def test_the_wire_row_reads_the_bytes_each_island_sent(bench, tmp_path):
    """Per island the median and peak of its rounds' bytes, and every island's bytes over
    the tokens trained against per-step data parallelism's ring of fp32 gradients."""
    import json

    for isl, rounds in (("ib", [30, 50, 40]), ("roce", [10, 10, 12])):
        (tmp_path / isl).mkdir()
        recs = [{"step": 1, "loss": 1.0}] + [{"outer_bytes_sent": b} for b in rounds]
        (tmp_path / isl / "metrics.jsonl").write_text("\n".join(map(json.dumps, recs)))
    row = bench.wire_row(str(tmp_path), tokens_per_step=100, steps=2, params=1000)
    assert row["ib_bytes_per_round"] == 40 and row["ib_peak_bytes_per_round"] == 50
    assert row["roce_bytes_per_round"] == 10 and row["roce_peak_bytes_per_round"] == 12
    assert row["bytes_per_token"] == pytest.approx(152 / 200)
    assert row["dp_bytes_per_token"] == 2 * 1000 * 4 / 100
    assert row["fewer_than_dp"] == pytest.approx(80 / 0.76, abs=0.1)


def test_a_link_speed_writes_a_mesh_with_that_speed_between_islands(bench, tmp_path):
    from holmes_jax.planner.topology import load_topology

    path = bench.link_mesh(1.0, str(tmp_path))
    topo = load_topology(path)
    assert topo.inter_island("ib", "roce").bandwidth_gbps == pytest.approx(0.001)
    assert topo.islands == load_topology(bench.MESH).islands
