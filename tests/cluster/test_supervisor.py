"""Supervised restarts and fault injection, on stand-in workers (no jax, seconds).

Each stand-in is a small Python process that behaves like a trainer of a job as the
supervisor sees it: every process of an attempt waits for the others to join (and fails
with exit 1 after a timeout), process 0 reports ``run_dir``, ``resumed``, ``compiled`` and
``step`` (every ``FAKE_LOG`` steps and the watched ones) on its status channel and saves a
"checkpoint" every 2 steps, and a process whose peer died exits 3. The real trainer under
the same supervisor: ``test_faults.py``.
"""

import io
import json
import os
import signal
import sys

import pytest

from holmes_jax import launch
from holmes_jax.cluster import local_launch, restarts, supervisor
from holmes_jax.cluster.launcher import Worker
from holmes_jax.cluster.netns import Unreachable
from holmes_jax.runtime.rundir import paths as rundir
from tests.common import ROOT

# A job of FAKE_HOSTS processes in FAKE_DIR, attempt FAKE_ATTEMPT.
FAKE = r"""
import os, signal, sys, time, pathlib
from holmes_jax.core.status import report, watched_steps
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
d, pid = pathlib.Path(os.environ["FAKE_DIR"]), int(os.environ["FAKE_PID"])
report("started")
n, attempt = int(os.environ["FAKE_HOSTS"]), os.environ["FAKE_ATTEMPT"]
steps, code = int(os.environ["FAKE_STEPS"]), int(os.environ.get("FAKE_EXIT", "0"))
every, watched = int(os.environ.get("FAKE_LOG", "1")), watched_steps()
def put(name, text):  # whole or absent: a peer may read it the moment it exists
    (d / f".{name}.{os.getpid()}").write_text(text)
    os.replace(d / f".{name}.{os.getpid()}", d / name)
put(f"env-{attempt}-{pid}", os.environ.get("HOLMES_CONTINUE_RUN_DIR", "-"))
put(f"pid-{attempt}-{pid}", str(os.getpid()))
deadline = time.time() + float(os.environ.get("FAKE_JOIN_S", "3"))
while len(list(d.glob(f"pid-{attempt}-*"))) < n:
    if time.time() > deadline:
        print("error: the job could not be joined", flush=True)
        sys.exit(1)
    time.sleep(0.02)
peers = {p: int((d / f"pid-{attempt}-{p}").read_text()) for p in range(n) if p != pid}
report("joined")
def alive(p):  # running, or finished its steps
    if (d / f"fin-{attempt}-{p}").exists():
        return True
    try:
        return open(f"/proc/{peers[p]}/stat").read().split()[2] != "Z"
    except OSError:
        return False
start = int((d / "ckpt").read_text()) if (d / "ckpt").exists() else 0
if pid == 0:
    (d / "run").mkdir(exist_ok=True)
    report("run_dir", path=f"{d}/run")
    report("resumed", step=start)
    report("compiled", seconds=0.5, detail="compilation cache: hit")
    if code:
        sys.exit(code)
for step in range(start + 1, steps + 1):
    time.sleep(0.15)
    if not all(alive(p) for p in peers):
        print("error: lost peer", flush=True)
        sys.exit(3)
    if pid == 0:
        if step % every == 0 or step in watched:  # logged, or a fault's step
            print(f"step {step} | loss 1.0", flush=True)  # for the user; the supervisor reads:
            report("step", step=step)
        if step % 2 == 0 or stop:
            put("ckpt", str(step))
    if stop:  # as the trainer: checkpoint, then exit 0
        break
put(f"fin-{attempt}-{pid}", "")
"""


def fake_job(tmp_path, hosts=("a", "b"), steps=6, exit_code=0, join_s=10.0, log_every=1):
    """make_workers for the supervisor: the stand-in job, one attempt per call."""
    attempts = []

    def make_workers(extra, excluded):
        attempts.append({**extra, **({"excluded": ",".join(excluded)} if excluded else {})})
        workers = []
        kept = [h for h in hosts if h not in excluded]
        for pid, host in enumerate(kept):
            env = dict(os.environ, **extra)
            env.update(
                FAKE_DIR=str(tmp_path), FAKE_PID=str(pid), FAKE_HOSTS=str(len(kept)),
                FAKE_ATTEMPT=str(len(attempts)), FAKE_STEPS=str(steps),
                FAKE_EXIT=str(exit_code), FAKE_JOIN_S=str(join_s), FAKE_LOG=str(log_every),
            )  # fmt: skip
            workers.append(Worker(host, pid, [sys.executable, "-c", FAKE], env))
        return workers

    return make_workers, attempts


def supervise(tmp_path, specs=(), **kwargs):
    job = {k: kwargs.pop(k) for k in ("steps", "exit_code", "join_s", "log_every") if k in kwargs}
    make_workers, attempts = fake_job(tmp_path, **job)
    faults = [supervisor.parse_fault(s, ["a", "b"]) for s in specs]
    out = io.StringIO()
    sup = supervisor.Supervisor(make_workers, faults=faults, grace_s=0.5, out=out, **kwargs)
    code = sup.run()
    return code, out.getvalue(), attempts


def launcher_lines(text):
    return [line for line in text.splitlines() if line.startswith("launch: ")]


# The launcher forks (to arm PR_SET_PDEATHSIG); jax, loaded in this test process by other
# tests, warns about any fork. The launcher's own process never imports jax.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")


def test_a_killed_worker_restarts_the_job_from_its_checkpoint(tmp_path):
    code, out, attempts = supervise(tmp_path, ["b@3"], max_restarts=2)
    assert code == 0, out
    lines = launcher_lines(out)
    assert lines[0] == "launch: --fail-host b@3: SIGKILL to b at step 3"
    assert lines[1] == (
        "launch: b (process 1) exited with signal SIGKILL at step 3; stopping the others "
        "(in 0.5 s at most), then restart 1 of 2"
    )
    assert lines[2].startswith("launch: training resumed: step 3 done ")
    assert (
        " s after the failure (restart 1 from checkpoint step 2, 1 step lost; compile 0.5 s, "
        "compilation cache: hit): " in lines[2]
    )
    assert len(lines) == 3, out
    # the restart's record: its phases add up to the total the line says
    (record,) = [json.loads(x) for x in (tmp_path / "run" / "restarts.jsonl").open()]
    assert record["total_s"] == pytest.approx(
        sum(record[f"{p}_s"] for p in restarts.PHASES), abs=0.01
    )
    assert f"done {record['total_s']:.1f} s after" in lines[2]
    assert (record["failed_step"], record["resumed_from"], record["steps_lost"]) == (3, 2, 1)
    assert record["restart"] == 1 and record["cause"] == "failure" and record["first_step"] == 3
    assert "cache: hit" in record["compile"]
    assert all(record[f"{p}_s"] >= 0 for p in restarts.PHASES)
    # The first attempt watches the fault's step; the restart continues the run directory
    # the first attempt reported.
    watch = supervisor.status_channel.STEPS_VAR
    assert attempts == [{watch: "3"}, {rundir.CONTINUE_VAR: f"{tmp_path}/run"}]
    assert (tmp_path / "env-2-1").read_text() == f"{tmp_path}/run"
    steps = [line.split()[2] for line in out.splitlines() if line.startswith("[a] step ")]
    assert steps == ["1", "2", "3", "3", "4", "5", "6"]
    assert supervisor.CONTINUE_VAR == rundir.CONTINUE_VAR


def test_a_fault_fires_at_its_step_whatever_the_logging_interval(tmp_path):
    """Logged every 4 steps, a fault at step 3 fires at step 3: the job reports the steps
    the launcher watches (its faults') whether logged or not."""
    code, out, _ = supervise(tmp_path, ["b@3"], max_restarts=1, log_every=4)
    assert code == 0, out
    assert launcher_lines(out)[0] == "launch: --fail-host b@3: SIGKILL to b at step 3"


def test_a_fault_that_cannot_fire_says_so_in_one_line(tmp_path):
    """A fault past the run's last step, and one a resume has already passed: each is one
    line, and neither kills anything."""
    (tmp_path / "a").mkdir()
    code, out, _ = supervise(tmp_path / "a", ["b@9"], steps=4)
    assert code == 0 and launcher_lines(out) == [
        "launch: --fail-host b@9: did not fire, the job ended after step 4 (train.steps or "
        "an earlier stop) before step 9"
    ], out
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "ckpt").write_text("4")  # a run directory past step 3 already
    code, out, _ = supervise(tmp_path / "b", ["b@3"], steps=6)
    assert code == 0 and launcher_lines(out) == [
        "launch: --fail-host b@3: does not fire, step 3 is already past (the run resumed "
        "from step 4)"
    ], out


def test_exit_code_2_is_not_retried(tmp_path):
    code, out, attempts = supervise(tmp_path, exit_code=2, max_restarts=3)
    assert code == 2 and len(attempts) == 1
    assert launcher_lines(out) == [
        "launch: a (process 0) exited with code 2 before its first step; stopping the others "
        "(in 0.5 s at most); not restarting: exit code 2 is a config or usage error"
    ]


def test_max_restarts_0_runs_once_and_ends_with_the_failure(tmp_path):
    code, out, attempts = supervise(tmp_path, ["a@2"], max_restarts=0)
    assert code == 128 + signal.SIGKILL and len(attempts) == 1
    assert launcher_lines(out)[1] == (
        "launch: a (process 0) exited with signal SIGKILL at step 2; stopping the others "
        "(in 0.5 s at most)"
    )


def test_restarts_run_out(tmp_path):
    """Every attempt fails (exit 1, a step error): the last line gives up."""
    code, out, attempts = supervise(tmp_path, exit_code=1, max_restarts=2)
    assert code == 1 and len(attempts) == 3
    assert launcher_lines(out)[-1] == (
        "launch: a (process 0) exited with code 1 before its first step; stopping the others "
        "(in 0.5 s at most); giving up after 2 restarts"
    )


def test_a_host_away_for_less_than_the_rejoin_timeout_is_waited_for(tmp_path):
    code, out, attempts = supervise(tmp_path, ["b@3:+1.5"], max_restarts=1, rejoin_timeout_s=30)
    assert code == 0, out
    lines = launcher_lines(out)
    assert lines[0] == "launch: --fail-host b@3:+1.5: SIGKILL to b at step 3, away for 1.5 s"
    assert (
        lines[2] == "launch: b is away: waiting up to 30 s for it to come back (--rejoin-timeout)"
    )
    assert lines[3].startswith("launch: training resumed: step 3 done ")
    took = float(lines[3].split(" done ")[1].split(" s ")[0])
    assert took >= 1.5  # it waited for b
    assert [a.get("excluded") for a in attempts] == [None, None]  # every host, both times


def test_a_host_lost_for_good_is_left_out_and_the_survivors_finish(tmp_path):
    code, out, attempts = supervise(
        tmp_path, ["b@3:permanent"], max_restarts=1, rejoin_timeout_s=0.5
    )
    assert code == 0, out
    lines = launcher_lines(out)
    assert lines[0] == "launch: --fail-host b@3:permanent: SIGKILL to b at step 3, for good"
    assert lines[3] == (
        "launch: b did not come back within 0.5 s: the others go on without it, re-planned "
        "for the survivors, from the newest checkpoint"
    )
    assert lines[4].startswith("launch: training resumed: step 3 done ")
    assert attempts[1]["excluded"] == "b"
    assert not (tmp_path / "pid-2-1").exists()  # b never started again
    steps = [line.split()[2] for line in out.splitlines() if line.startswith("[a] step ")]
    assert steps[-1] == "6"


def test_a_host_back_after_the_rejoin_timeout_rejoins_at_a_checkpoint(tmp_path):
    """b is left out, comes back while the survivors train: they stop with a checkpoint
    (SIGTERM, exit 0) and every host starts again from it, without using a restart."""
    code, out, attempts = supervise(
        tmp_path, ["b@3:+1.5"], max_restarts=1, rejoin_timeout_s=0.2, steps=40
    )
    assert code == 0, out
    lines = launcher_lines(out)
    assert any(line.startswith("launch: b did not come back within 0.2 s") for line in lines)
    back = [n for n, line in enumerate(lines) if line.startswith("launch: b is back: ")]
    assert len(back) == 1, out
    resumed = lines[back[0] + 1]
    assert resumed.startswith("launch: training resumed: step ")
    assert "after the re-expansion (every host from checkpoint step " in resumed
    assert ", 0 steps lost" in resumed, resumed
    assert [a.get("excluded") for a in attempts] == [None, "b", None]
    assert (tmp_path / "pid-3-1").exists()  # b runs again in the third attempt
    steps = [line.split()[2] for line in out.splitlines() if line.startswith("[a] step ")]
    assert steps[-1] == "40"


def test_a_re_expansion_waits_until_the_hosts_reach_each_other(tmp_path, monkeypatch):
    """b is back while the links are cut (the first two probes fail): the survivors train
    on, the reason is said once, and the re-expansion follows the first probe that passes."""
    monkeypatch.setattr(supervisor, "PROBE_EVERY_S", 0.0)
    probes = []

    def reachable(excluded):
        probes.append(excluded)
        return Unreachable("a cannot reach b", ()) if len(probes) <= 2 else None

    code, out, attempts = supervise(
        tmp_path, ["b@3:+1.5"], max_restarts=1, rejoin_timeout_s=0.2, steps=40,
        reachable=reachable,
    )  # fmt: skip
    assert code == 0, out
    lines = launcher_lines(out)
    said = [n for n, line in enumerate(lines) if "cannot reach" in line or " is back" in line]
    assert [lines[n] for n in said] == [
        "launch: b is back, but a cannot reach b: the survivors train on until every host "
        "can reach the others",
        "launch: a cannot reach b: the links are back",
        "launch: b is back: the survivors stop at a step they agree on (with a checkpoint), "
        "then every host starts again",
    ], out
    # the restart without b, the survivors' steps (the next attempt leaves nobody out),
    # the re-expansion's start
    assert probes == [("b",), (), (), ()]
    assert [a.get("excluded") for a in attempts] == [None, "b", None]


def test_a_restart_across_a_cut_leaves_out_the_hosts_cut_off_until_the_links_are_back(
    tmp_path, monkeypatch
):
    """b is killed and back at once, but cannot reach a (the first probe, at the restart):
    a trains alone (its join would otherwise stall), and b rejoins once a probe passes."""
    monkeypatch.setattr(supervisor, "PROBE_EVERY_S", 0.0)
    probes = []

    def reachable(excluded):
        probes.append(excluded)
        return Unreachable("a cannot reach b", ("b",)) if len(probes) <= 2 else None

    code, out, attempts = supervise(
        tmp_path, ["b@3"], max_restarts=1, steps=40, reachable=reachable
    )  # fmt: skip
    assert code == 0, out
    lines = launcher_lines(out)
    said = [n for n, line in enumerate(lines) if "reach" in line or " is back" in line]
    assert [lines[n] for n in said] == [
        "launch: a cannot reach b: b sits out until every host can reach the others",
        "launch: a cannot reach b: the links are back",
        "launch: b is back: the survivors stop at a step they agree on (with a checkpoint), "
        "then every host starts again",
    ], out
    assert probes == [(), (), (), ()]  # the restart, a's steps twice, the re-expansion
    assert [a.get("excluded") for a in attempts] == [None, "b", None]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--fail-host", "ib-9@3"], "--fail-host=ib-9@3: 'ib-9' is not a host of the topology"),
        (["--fail-host", "ib-0@0"], "--fail-host=ib-0@0: step 0 must be >= 1"),
        (["--fail-host", "ib-0@-2"], "--fail-host=ib-0@-2: step -2 must be >= 1"),
        (["--fail-host", "ib-0@3:+-5"], "--fail-host=ib-0@3:+-5: '-5' must be a number of sec"),
        (["--fail-host", "ib-0@3:+x"], "--fail-host=ib-0@3:+x: 'x' must be a number of seconds"),
        (
            ["--fail-host", "ib-0"],
            "--fail-host=ib-0: must be HOST@STEP, HOST@STEP:permanent, HOST@STEP:+SECONDS, "
            "HOST@STEP:nan or HOST@STEP:abstain",
        ),
        (["--fail-host", "ib-0@3:NaN"], "--fail-host=ib-0@3:NaN: must be HOST@STEP"),
        (["--fail-host", "ib-0@0:nan"], "--fail-host=ib-0@0:nan: step 0 must be >= 1"),
        (["--fail-host", "ib-9@3:nan"], "--fail-host=ib-9@3:nan: 'ib-9' is not a host of the"),
        (["--fail-host", "ib-0@x"], "--fail-host=ib-0@x: must be HOST@STEP"),
        (["--fail-host", "ib-0@3:forever"], "--fail-host=ib-0@3:forever: must be HOST@STEP"),
        (["--max-restarts", "-1"], "--max-restarts=-1: must be >= 0 (0 = no restarts)"),
        (["--rejoin-timeout", "-1"], "--rejoin-timeout=-1: must be a number of seconds >= 0"),
        (["--rejoin-timeout", "inf"], "--rejoin-timeout=inf: must be a number of seconds >= 0"),
    ],
)
def test_bad_fault_and_restart_flags_are_one_line_errors(args, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    argv = ["--mesh", "meshes/cpu8-two-islands.yaml", *args, "--", "--set", "train.steps=1"]
    assert launch.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_fault_specs_parse():
    hosts = ["a", "b"]
    assert supervisor.parse_fault("a@3", hosts) == supervisor.Fault("a", 3, 0.0, "a@3")
    assert supervisor.parse_fault("b@1:+2.5", hosts).away_s == 2.5
    assert supervisor.parse_fault("b@7:permanent", hosts).permanent
    nan = supervisor.parse_fault("b@7:nan", hosts)
    assert nan == supervisor.Fault("b", 7, 0.0, "b@7:nan", inject="nan") and not nan.permanent
    faults = [nan, supervisor.parse_fault("a@3:nan", hosts), supervisor.parse_fault("a@5", hosts)]
    assert supervisor.fault_args(faults) == ["--set", "train.inject_nonfinite_steps=[3,7]"]
    assert supervisor.fault_args(faults[2:]) == []
    faults.append(supervisor.parse_fault("b@4:abstain", hosts))
    assert supervisor.fault_args(faults[1:]) == [
        "--set", "train.inject_nonfinite_steps=[3]", "--set", "diloco.inject_abstain_steps=[4]",
    ]  # fmt: skip


def test_exit_code_4_is_not_retried(tmp_path):
    """A run stopped by non-finite steps: a restart would replay the same batches."""
    code, out, attempts = supervise(tmp_path, exit_code=4, max_restarts=3)
    assert code == 4 and len(attempts) == 1
    assert launcher_lines(out) == [
        "launch: a (process 0) exited with code 4 before its first step; stopping the others "
        "(in 0.5 s at most); not restarting: exit code 4 is a stop for non-finite steps, "
        "which a restart replays"
    ]


def test_a_nan_fault_kills_nothing(tmp_path):
    code, out, attempts = supervise(tmp_path, ["b@3:nan"], max_restarts=1)
    assert code == 0 and len(attempts) == 1 and launcher_lines(out) == [], out


@pytest.mark.parametrize("independent", [False, True])
def test_a_nan_fault_reaches_every_worker_of_the_job_holding_its_host(independent, monkeypatch):
    """Every worker of the job holding the host gets the step (they run one program);
    with independent islands only that island's job does."""
    planned = {}
    real = local_launch.plan_workers

    def plan(topology, mesh, args, coordinator, **kwargs):
        workers = real(topology, mesh, args, coordinator, **kwargs)
        if coordinator != "127.0.0.1:1":  # not the launcher's check of the arguments
            planned.update((w.host, w.command) for w in workers)
        return [Worker(w.host, w.process_id, [sys.executable, "-c", ""], w.env) for w in workers]

    monkeypatch.setattr(local_launch, "plan_workers", plan)
    out = io.StringIO()
    specs = ["roce-1@5:nan", "roce-0@3:nan", "ib-0@9"]
    code = local_launch.launch(
        os.path.join(ROOT, "meshes", "cpu8-two-islands.yaml"), ["--set", "train.steps=1"],
        fail_hosts=specs, independent=independent, out=out,
    )  # fmt: skip
    assert code == 0, out.getvalue()
    injected = ["--set", "train.inject_nonfinite_steps=[3,5]"]
    told = {h for h, cmd in planned.items() if cmd[-2:] == injected}
    assert sorted(planned) == ["ib-0", "ib-1", "roce-0", "roce-1"]
    assert told == ({"roce-0", "roce-1"} if independent else set(planned))
    whose = "island roce's job" if independent else "the job"
    assert (
        f"launch: --fail-host roce-1@5:nan roce-0@3:nan: every worker of {whose} gets "
        "--set train.inject_nonfinite_steps=[3,5]"
    ) in launcher_lines(out.getvalue())


def test_a_restart_s_phases_add_up_and_a_missing_mark_goes_to_the_next(tmp_path):
    clock = restarts.RestartClock(2, "failure", failed_step=9, fault=100.0)
    for phase, at in (("detect", 100.5), ("stop", 102.0), ("init", 104.0), ("join", 104.5)):
        clock.mark(phase, at)
    clock.mark("join", 200.0)  # a second mark of a phase is ignored
    clock.resumed_from = 6
    for phase, at in (("restore", 106.0), ("compile", 111.0), ("first_step", 112.0)):
        clock.mark(phase, at)
    phases = clock.phases()
    assert phases["wait"] == phases["start"] == 0.0  # never marked: in init's 2 s
    assert (phases["init"], phases["compile"]) == (2.0, 5.0) and clock.total() == 12.0
    clock.write(str(tmp_path), 13)
    (record,) = [json.loads(x) for x in (tmp_path / restarts.RECORDS).open()]
    assert record["steps_lost"] == 3 and record["total_s"] == 12.0 and record["stop_s"] == 1.5
    assert clock.line().startswith("detect 0.5 s, stop 1.5 s, init 2.0 s, join 0.5 s")
    with pytest.raises(ValueError, match="restart phase 'nap'"):
        clock.mark("nap")


def test_a_restart_may_leave_out_more_hosts_and_they_start_again_with_the_away_one(tmp_path):
    """``widen`` (what ``--warm-failures`` measured) leaves c out beside the away b: the
    survivors run without both, and b's return, not c's presence, brings every host back."""
    seen = []

    class Measured:  # stands in for holmes_jax.cluster.warm.Measured
        def record(self, event):
            raise AssertionError(event)  # the stand-in job reports no measured event

        def widen(self, away):
            seen.append(away)
            return ("b", "c"), "b and c sit out"

    make_workers, attempts = fake_job(tmp_path, hosts=("a", "b", "c"), steps=40)
    faults = [supervisor.parse_fault("b@3:+1.5", ["a", "b", "c"])]
    out = io.StringIO()
    sup = supervisor.Supervisor(
        make_workers, faults=faults, grace_s=0.5, out=out, max_restarts=1,
        rejoin_timeout_s=0.2, measured=Measured(),
    )  # fmt: skip
    assert sup.run() == 0, out.getvalue()
    lines = launcher_lines(out.getvalue())
    assert seen == [("b",)] and "launch: b and c sit out" in lines, lines
    assert [a.get("excluded") for a in attempts] == [None, "b,c", None]
    assert [line.startswith("launch: b is back: ") for line in lines].count(True) == 1, lines
    assert not (tmp_path / "pid-2-1").exists()  # attempt 2: a alone
    assert (tmp_path / "pid-3-2").exists()  # attempt 3: every host again


def test_the_measured_survivors_of_an_island_s_loss_widen_a_host_s_loss_only_when_faster():
    from holmes_jax.cluster.warm import Measured
    from holmes_jax.planner.topology import load_topology

    measured = Measured(load_topology(os.path.join(ROOT, "meshes", "cpu8-two-islands.yaml")))
    assert measured.widen(("roce-1",)) == (("roce-1",), None)  # nothing measured
    host = {"event": "measured", "excluded": ["roce-1"], "plans": ["stage=3 data=2",
            "stage=3 tensor=2"], "step_s": [0.585, 2.66]}  # fmt: skip
    measured.record(host)
    assert measured.widen(("roce-1",)) == (("roce-1",), None)  # the island's loss unmeasured
    measured.record({"event": "measured", "excluded": ["roce-1", "roce-0"], "plans": ["data=4"],
                     "step_s": [0.375]})  # fmt: skip
    hosts, line = measured.widen(("roce-1",))
    assert hosts == ("roce-0", "roce-1"), hosts  # in topology order, as the warm-up's
    assert line == (
        "measured before training: without roce-1 the fastest plan steps 0.585 s, without "
        "island roce 0.375 s: roce-0 sits out too, until it is back"
    )
    measured.record({**host, "step_s": [0.3, 2.66]})
    assert measured.widen(("roce-1",)) == (("roce-1",), None)  # the host's loss is faster
    assert measured.widen(("roce-0", "roce-1")) == (("roce-0", "roce-1"), None)  # whole
    assert measured.widen(("roce-1", "ib-0")) == (("roce-1", "ib-0"), None)  # two islands
