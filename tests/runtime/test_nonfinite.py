"""Non-finite steps never reach the state: skipped, counted, and stopped past the limit.

The program's select (runtime/program.py with runtime/nonfinite.py), the loop's guard and
the entry point's one line and exit code 4. The launcher's ``:nan`` fault is in
``tests/cluster/test_supervisor.py``, the watchdog's exit code in ``test_distributed.py``.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from holmes_jax.core.config import CheckpointConfig, load_config
from holmes_jax.core.errors import NONFINITE_EXIT, ConfigError, NonFiniteError
from holmes_jax.core.spec import Degrees
from holmes_jax.runtime import nonfinite
from holmes_jax.runtime.data.loader import BatchSampler, load_corpus, make_batch
from holmes_jax.runtime.each_step import fetch_metrics
from holmes_jax.runtime.loop import run
from holmes_jax.runtime.nonfinite import SkipGuard
from holmes_jax.runtime.rundir.checkpoint import Checkpointer
from holmes_jax.train import main
from tests.common import TINY_RUN, as_flags

TINY = [*TINY_RUN, "train.eval_batches=2", "logging.progress=none"]
INJECT = "train.inject_nonfinite_steps=[2]"  # the second step is non-finite
# Plain GSPMD fp32 on one device; the pipeline engine with ZeRO-1 and a bf16 master.
LAYOUTS = {
    "plain": ((), Degrees(1, 1, 1)),
    "engine-bf16": (("parallel.stages=2", "train.precision=bf16"), Degrees(2, 2, 1)),
}


def _equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


def _batches(cfg, program, n):
    corpus = load_corpus(cfg.data, cfg.model.vocab_size)
    sampler = BatchSampler(corpus.train, cfg.model.seq_len, cfg.train.global_batch_size, 0)
    return [make_batch(sampler, k, program.shardings.batch) for k in range(n)]


def _host(state):
    return jax.device_get(state)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_non_finite_step_leaves_the_state_as_it_was(layout, tiny_config, make_program):
    """Step 2 is injected: its loss and grad norm are NaN, and parameters, master and AdamW
    state (moments and counts) after it equal those before it, bit for bit; the data
    position advances, the counters count it, and step 3 trains on."""
    overrides, degrees = LAYOUTS[layout]
    cfg = tiny_config(*TINY, *overrides, INJECT)
    program = make_program(cfg, degrees)
    batches = _batches(cfg, program, 3)
    state = program.init(0)
    states, metrics = [], []
    for batch in batches:
        state, m = program.train_step(state, batch)
        states.append(_host(state))
        metrics.append(jax.device_get(m))
    one, two, three = states
    assert np.isnan(metrics[1]["loss"]) and np.isnan(metrics[1]["grad_norm"])
    assert np.isfinite(metrics[0]["loss"]) and np.isfinite(metrics[2]["loss"])
    _equal(two.params, one.params)
    _equal(two.master, one.master)
    _equal(two.opt_state, one.opt_state)  # moments and step counts
    assert (one.step, two.step, three.step) == (1, 2, 3)
    assert [int(m["skipped_steps"]) for m in metrics] == [0, 1, 1]
    assert [int(m["skips_in_a_row"]) for m in metrics] == [0, 1, 0]
    assert (int(three.skips["total"]), int(three.skips["run"])) == (1, 0)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), three, two).params)
    assert max(moved) > 0 and all(np.isfinite(x).all() for x in jax.tree.leaves(three.params))


def test_after_a_skip_training_goes_on_as_if_the_batch_were_left_out(tiny_config, make_program):
    """The reference is a program without the injection: from the state after step 1, with
    the data position at 2 (batch 2 next), its step equals the injected run's step 3."""
    cfg = tiny_config(*TINY, INJECT)
    program, clean = (
        make_program(cfg, Degrees(1, 1, 1)),
        make_program(tiny_config(*TINY), Degrees(1, 1, 1)),
    )
    batches = _batches(cfg, program, 3)
    state = program.init(0)
    for batch in batches:
        state, metrics = program.train_step(state, batch)
    ref = clean.init(0)
    ref, _ = clean.train_step(ref, batches[0])
    ref, ref_metrics = clean.train_step(ref.replace(step=jnp.int32(2)), batches[2])
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=0, atol=1e-6)
    # The skip did not move the schedule: step 3 applies the rate of the second update.
    assert float(metrics["lr"]) == float(ref_metrics["lr"]) == float(program.schedule(1))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6),
        _host(state.params),
        _host(ref.params),
    )


def test_one_replica_skips_alone_under_diloco(tiny_config, make_program):
    """DiLoCo's replicas: a NaN in replica 1's rows (a token past the vocabulary embeds as
    NaN) skips replica 1's step, while replica 0's update equals the one it takes when both
    rows are clean. The shared step counts advance."""
    cfg = tiny_config(*TINY, "parallel.replica=2", "diloco.enabled=true", "diloco.inner_steps=4")
    program = make_program(cfg, Degrees(stages=1, data=2, tensor=1, replica=2))
    assert program.diloco
    rows = np.random.RandomState(0).randint(0, 256, (8, 33)).astype(np.int32)
    poisoned = rows.copy()
    poisoned[4:, 5] = 10**6  # replica 1 trains on rows 4-7
    results = []
    for second in (rows, poisoned):
        state = program.init(0)
        state, _ = program.train_step(state, jax.device_put(rows, program.shardings.batch))
        before = _host(state)
        state, m = program.train_step(state, jax.device_put(second, program.shardings.batch))
        results.append((before, _host(state), jax.device_get(m)))
    (_, clean, _), (before, got, metrics) = results
    assert np.isfinite(metrics["loss"][0]) and np.isnan(metrics["loss"][1])
    mine = lambda tree, r: jax.tree.map(lambda a: a[r], tree)  # noqa: E731
    _equal(mine(got.params, 0), mine(clean.params, 0))
    _equal(mine(got.opt_state[1][0].mu, 0), mine(clean.opt_state[1][0].mu, 0))
    _equal(mine(got.params, 1), mine(before.params, 1))
    _equal(mine(got.opt_state[1][0].mu, 1), mine(before.opt_state[1][0].mu, 1))
    _equal(mine(got.opt_state[1][0].nu, 1), mine(before.opt_state[1][0].nu, 1))
    assert got.skips["total"].tolist() == [0, 1] and got.skips["run"].tolist() == [0, 1]
    assert int(got.opt_state[1][0].count) == int(before.opt_state[1][0].count) + 1
    assert metrics["skipped_steps"].tolist() == [0, 1]
    assert nonfinite.skipped_so_far(program.init(0)) == {0: 0, 1: 0}


def test_a_run_with_one_non_finite_step_finishes_and_records_it(tmp_path, make_program):
    cfg = load_config(
        None,
        [*TINY, "train.steps=5", "logging.log_every=1", "train.inject_nonfinite_steps=[3]"]
        + [f"train.run_dir={tmp_path}/run"],
    )
    history = run(cfg)
    assert [r["step"] for r in history] == [1, 2, 3, 4, 5]
    assert [r["skipped_steps"] for r in history] == [0, 0, 1, 1, 1]
    assert np.isnan(history[2]["loss"]) and np.isfinite(history[4]["loss"])
    assert history[4]["loss"] < history[0]["loss"]
    lines = [json.loads(x) for x in open(f"{tmp_path}/run/metrics.jsonl")]
    assert [r["skipped_steps"] for r in lines] == [0, 0, 1, 1, 1]
    assert "skips_in_a_row" not in lines[0]
    # The final checkpoint carries the counter, so a resumed run counts on from it.
    program = make_program(cfg, Degrees(1, 1, 1))
    ckpt = Checkpointer(CheckpointConfig(dir=f"{tmp_path}/run/checkpoints"))
    state, meta = ckpt.restore(program.abstract_state, cfg)
    ckpt.close()
    assert meta["step"] == 5 and int(state.skips["total"]) == 1 and int(state.skips["run"]) == 0


def test_more_skips_in_a_row_than_allowed_stop_the_run_before_any_save(
    tmp_path, capsys, make_program
):
    """Steps 3-5 are non-finite and 2 are allowed: the entry point stops after step 5 with
    one line and exit code 4; checkpoints are saved every step up to step 4, none at 5,
    and the newest holds step 2's finite state."""
    ckpt = tmp_path / "ckpt"
    overrides = [
        *TINY, "train.steps=8", "logging.log_every=1", "train.max_skipped_steps=2",
        "train.inject_nonfinite_steps=[3,4,5]", "checkpoint.every=1", "checkpoint.keep=10",
        f"checkpoint.dir={ckpt}", f"train.metrics_path={tmp_path}/m.jsonl",
    ]  # fmt: skip
    assert main(as_flags(overrides)) == NONFINITE_EXIT
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(
        "error: step 5: 3 consecutive non-finite steps (loss nan, grad norm nan) > "
        "train.max_skipped_steps=2; the parameters are those after step 2; the newest "
        f"checkpoint, step 4 in {ckpt}, holds them (steps 3-4 were skipped); a restart replays"
    ), err
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [1, 2, 3, 4]
    cfg = load_config(None, overrides)
    program = make_program(cfg, Degrees(1, 1, 1))
    ckpts = Checkpointer(cfg.checkpoint)
    newest, _ = ckpts.restore(program.abstract_state, cfg)
    two, _ = ckpts.restore(program.abstract_state, cfg, step=2)
    ckpts.close()
    newest, two = _host(newest), _host(two)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves((newest.params, newest.opt_state)))
    _equal((newest.params, newest.opt_state), (two.params, two.opt_state))
    assert (int(newest.skips["total"]), int(newest.skips["run"])) == (2, 2)
    records = [json.loads(x) for x in open(tmp_path / "m.jsonl")]
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 2]


def test_where_steps_overlap_the_limit_is_read_a_step_late_but_before_a_save(
    tmp_path, capsys, monkeypatch
):
    """As on GPUs, the loop does not wait for each step (one device, so nothing to wait
    for on CPU either): step 5's counter is due a step late, but step 5 is a save step, so
    the save reads it first and stops the run without writing step 5."""
    import holmes_jax.runtime.each_step as each_step

    monkeypatch.setattr(each_step.jax, "local_device_count", lambda: 1)
    ckpt = tmp_path / "ckpt"
    overrides = [
        *TINY, "parallel.devices=1", "train.steps=8", "logging.log_every=100",
        "train.max_skipped_steps=2", "train.inject_nonfinite_steps=[3,4,5]",
        "checkpoint.every=5", f"checkpoint.dir={ckpt}", "train.metrics_path=null",
    ]  # fmt: skip
    assert main(as_flags(overrides)) == NONFINITE_EXIT
    err = capsys.readouterr().err
    assert err.startswith(
        "error: step 5: 3 consecutive non-finite steps (loss nan, grad norm nan) > "
        f"train.max_skipped_steps=2; the parameters are those after step 2; no checkpoint "
        f"was saved in {ckpt}; a restart"
    ), err
    assert not [p for p in ckpt.iterdir() if p.name.isdigit()]


def test_a_checkpoint_without_skip_counters_restores_them_at_zero(tmp_path, make_program):
    """A train state saved before the counters existed still resumes."""
    cfg = load_config(None, TINY)
    program = make_program(cfg, Degrees(1, 1, 1))
    state = program.to_logical(program.init(0))
    ckpt = Checkpointer(CheckpointConfig(dir=str(tmp_path), async_save=False))
    fields = ("step", "params", "opt_state", "master", "outer")  # the state before `skips`
    ckpt.save(3, {k: getattr(state, k) for k in fields}, data_position=3, config=cfg)
    restored, meta = ckpt.restore(program.abstract_logical_state, cfg)
    ckpt.close()
    assert meta["data_position"] == 3
    _equal(_host(restored.params), _host(state.params))
    assert jax.device_get(restored.skips) == {"total": 0, "run": 0}
    assert restored.skips["total"].sharding == program.shardings.logical_state.skips["total"]


# --------------------------------------------------------------------------- the guard


def _metrics(run, total=None, loss=float("nan")):
    """A step's metrics as the program returns them (device arrays)."""
    run = jnp.asarray(run, jnp.int32)
    total = run if total is None else jnp.asarray(total, jnp.int32)
    return {
        "loss": jnp.where(run > 0, loss, 1.0),
        "grad_norm": jnp.where(run > 0, jnp.nan, 0.5),
        "skipped_steps": total,
        "skips_in_a_row": run,
    }


def _guard(limit=2, saved=(None, "ckpt"), agree=False):
    lines = []
    guard = SkipGuard(limit, lines.append, lambda: saved, agree=agree, outer_sync=agree)
    return guard, lines


def test_the_guard_reads_a_step_once_the_next_is_dispatched():
    guard, lines = _guard(limit=1)
    out = guard.after_step(1, _metrics(1))
    assert "skips_in_a_row" not in out and lines == []  # step 1 not read yet
    guard.after_step(2, _metrics(0, total=1))
    assert lines == [
        "step 1: non-finite, skipped (parameters and optimizer state unchanged): loss nan, "
        "grad norm nan, 1 skipped so far, 1 in a row (train.max_skipped_steps=1)"
    ]
    guard.after_step(3, _metrics(1, total=2))
    guard.after_step(4, _metrics(2, total=3))  # reads step 3: one in a row is allowed
    with pytest.raises(NonFiniteError, match=r"^step 4: 2 consecutive non-finite steps"):
        guard.settle()  # step 4, read where the loop waits anyway


def test_the_guard_reads_at_once_when_the_loop_waited():
    guard, lines = _guard(limit=0, saved=(None, None))
    with pytest.raises(NonFiniteError) as err:
        guard.after_step(7, _metrics(1, total=3, loss=float("inf")), done=True)
    assert str(err.value) == (
        "step 7: 1 consecutive non-finite steps (loss inf, grad norm nan) > "
        "train.max_skipped_steps=0; the parameters are those after step 6; checkpoints are "
        "off (checkpoint.dir=null); a restart replays the same batches (lower "
        "optimizer.learning_rate, or raise train.max_skipped_steps to skip more)"
    )


@pytest.mark.parametrize(
    "saved, where",
    [
        ((None, "d"), "no checkpoint was saved in d"),
        ((5, "d"), "the newest checkpoint is step 5 in d"),
        ((10, "d"), "the newest checkpoint, step 10 in d, holds them (steps 9-10 were skipped)"),
    ],
)
def test_the_stop_line_names_the_checkpoint_to_go_back_to(saved, where):
    guard, _ = _guard(limit=2, saved=saved)
    with pytest.raises(NonFiniteError, match=re.escape(f"after step 8; {where};")):
        guard.after_step(11, _metrics(3), done=True)


def test_skip_lines_are_rate_limited_and_count_what_they_hid():
    guard, lines = _guard(limit=10**6)
    for step in range(1, 2 * nonfinite.LINE_EVERY + 2):
        guard.after_step(step, _metrics(step % 2, total=step), done=True)  # odd steps skip
    assert [line.split(":")[0] for line in lines] == ["step 1", "step 101", "step 201"]
    assert lines[1].endswith(f"; {nonfinite.LINE_EVERY // 2 - 1} more since step 1 not shown")


def test_replicas_are_named_and_a_process_stops_with_the_others():
    """DiLoCo: [R] counters; with ``agree`` the limit stops the run only at ``settle``."""
    guard, lines = _guard(limit=1, agree=True)
    guard.after_step(3, _metrics([0, 2], total=[0, 2]), done=True)  # replica 1: 2 in a row
    assert lines[0].startswith("step 3: non-finite, skipped (parameters and optimizer state")
    assert ": replica 1: loss nan, grad norm nan, 2 skipped so far, 2 in a row" in lines[0]
    with pytest.raises(NonFiniteError) as err:
        guard.settle()
    assert str(err.value).startswith(
        "step 3: replica 1: 2 consecutive non-finite steps (loss nan, grad norm nan) > "
        "train.max_skipped_steps=1; steps 2-3 were skipped; no checkpoint was saved in ckpt; "
    )


def test_the_records_sum_the_replicas_skips_and_average_the_rest():
    got = fetch_metrics({"skipped_steps": jnp.array([0, 3]), "loss": jnp.array([1.0, 3.0])})
    assert got == {"skipped_steps": 3, "loss": 2.0}


def test_max_skipped_steps_and_injected_steps_are_checked():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.max_skipped_steps=-1"])
    assert str(err.value) == (
        "train.max_skipped_steps=-1: must be >= 0 (0 = stop at the first non-finite step)"
    )
    with pytest.raises(ConfigError, match=r"^train.inject_nonfinite_steps=\[2, 0\]: step 0 m"):
        load_config(None, ["train.inject_nonfinite_steps=[2,0]"])
    assert load_config(None, []).train.max_skipped_steps == 5


def test_a_bad_max_skipped_steps_is_one_line_and_exit_2(capsys):
    assert main(["--set", "train.max_skipped_steps=-1"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: train.max_skipped_steps=-1: must be >= 0 (0 = stop at the first non-finite step)\n"
    )
