"""The sharded train step equals the single-device step; resume reproduces a run."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from holmes_jax.core.config import load_config
from holmes_jax.core.spec import Degrees
from holmes_jax.runtime.data.loader import BatchSampler, load_corpus, make_batch
from holmes_jax.runtime.loop import run
from holmes_jax.runtime.rundir.checkpoint import Checkpointer
from tests.common import ROOT, TINY_RUN, as_flags, mesh_path

# A tiny model with every feature that changes the math: untied head, weight decay, clipping
# that bites (grad_clip small), dropout off (dropout masks depend on the sharding).
TINY = [*TINY_RUN, "train.eval_batches=2", "logging.progress=none"]


@pytest.fixture(scope="module")
def tiny_cfg(tiny_config):
    return tiny_config(base=TINY)


def _train(make_program, cfg, shape: Degrees, steps: int):
    program = make_program(cfg, shape)
    corpus = load_corpus(cfg.data, cfg.model.vocab_size)
    sampler = BatchSampler(corpus.train, cfg.model.seq_len, cfg.train.global_batch_size, 0)
    state = program.init(cfg.train.seed)
    losses = []
    for step in range(steps):
        state, metrics = program.train_step(
            state, make_batch(sampler, step, program.shardings.batch)
        )
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(program.to_logical(state).params), state


def test_sharded_step_equals_single_device(tiny_cfg, make_program):
    ref_losses, ref_params, _ = _train(make_program, tiny_cfg, Degrees(1, 1, 1), 3)
    losses, params, state = _train(make_program, tiny_cfg, Degrees(1, 4, 2), 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert losses[2] < losses[0]  # it trains
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), params, ref_params
    )
    # Really sharded: the MLP kernel is split over tensor, the batch over data.
    fc = state.params["blocks"]["fc_kernel"]
    assert fc.sharding.spec[-1] == "tensor"
    assert fc.addressable_shards[0].data.shape[-1] == fc.shape[-1] // 2


def _read_final(make_program, cfg, directory):
    program = make_program(cfg, Degrees(1, 1, 1))
    state, meta = Checkpointer(cfg.checkpoint.__class__(dir=str(directory))).restore(
        program.abstract_state, cfg
    )
    return jax.device_get(state.params), meta


@pytest.mark.slow
def test_resume_reproduces_uninterrupted_run(tmp_path, make_program):
    base = TINY + ["train.steps=6", "train.eval_every=3", "logging.log_every=1"]
    full = load_config(None, base + [f"checkpoint.dir={tmp_path}/full"])
    interrupted = load_config(
        None,
        base + [f"checkpoint.dir={tmp_path}/resumed", f"train.metrics_path={tmp_path}/m.jsonl"],
    )
    full_hist = run(full)
    first = run(interrupted, stop_at_step=2)  # as if preempted after step 2
    second = run(interrupted)  # picks up the checkpoint at step 2
    assert [r["step"] for r in first] == [1, 2]
    assert [r["step"] for r in second] == [3, 4, 5, 6]
    np.testing.assert_allclose(
        [r["loss"] for r in first + second], [r["loss"] for r in full_hist], rtol=0, atol=1e-6
    )
    digests = [r["data_digest"] for r in full_hist]  # the batches, token for token
    assert [r["data_digest"] for r in first + second] == digests and len(set(digests)) == 6
    assert second[0]["eval_loss"] == pytest.approx(full_hist[2]["eval_loss"], abs=1e-6)
    ref, meta_full = _read_final(make_program, full, f"{tmp_path}/full")
    got, meta = _read_final(make_program, interrupted, f"{tmp_path}/resumed")
    assert meta["data_position"] == meta_full["data_position"] == 6
    assert meta["config"]["train"]["steps"] == 6
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), got, ref)
    # The metrics file holds the whole run, both halves.
    lines = [json.loads(x) for x in open(f"{tmp_path}/m.jsonl")]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "tokens_per_s", "tflops_per_device"):
        assert all(key in r for r in lines)
    assert "eval_loss" in lines[2] and "eval_loss" in lines[5]


@pytest.mark.slow
def test_sigterm_finishes_step_saves_and_exits_zero(tmp_path):
    """SIGTERM mid-run: the step finishes, a checkpoint is written, exit code 0, a message."""
    import signal
    import subprocess
    import sys
    import time

    metrics = tmp_path / "m.jsonl"
    args = as_flags(TINY) + [
        "--set", "train.steps=100000",
        "--set", "logging.log_every=1",
        "--set", "logging.progress=plain",
        "--set", f"train.metrics_path={metrics}",
        "--set", f"checkpoint.dir={tmp_path}/ckpt",
    ]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "holmes_jax.train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.stdout.read()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "received SIGTERM" in out and "checkpoint saved" in out
    saved = sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit())
    last_logged = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert saved == [last_logged] and last_logged >= 3


def test_forced_cudnn_attention_is_refused_before_compiling(tiny_cfg, monkeypatch):
    """model.attention=cudnn on CPU: one-line ConfigError from the trainer, no program built."""
    import holmes_jax.runtime.loop as trainer
    from holmes_jax.core.errors import ConfigError

    monkeypatch.setattr(trainer, "Program", None)  # any compile attempt would fail loudly
    cfg = tiny_cfg.replace(model=dataclasses.replace(tiny_cfg.model, attention="cudnn"))
    with pytest.raises(ConfigError, match=r"^model\.attention=cudnn: needs a CUDA GPU") as err:
        trainer.run(cfg)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- plan printout

TWO_ISLANDS = [
    f"parallel.mesh={mesh_path('cpu8-two-islands.yaml')}",
    "parallel.stages=2",
    "parallel.layers_per_stage=auto",
    "parallel.microbatches=2",
    "parallel.schedule=1f1b",
]


def test_plan_before_training_and_predicted_vs_measured_after(tiny_config, capsys):
    """On a topology the trainer prints the plan it runs, then predicted vs measured step."""
    from holmes_jax.core.plan_request import plan_request
    from holmes_jax.planner.grid import load_mesh_topology
    from holmes_jax.planner.plans import predict_run

    cfg = tiny_config(
        *TWO_ISLANDS,
        "train.steps=3",
        "train.eval_every=0",
        "logging.log_every=1",
        "logging.progress=plain",
    )
    history = run(cfg)
    out = capsys.readouterr().out
    lines = out.splitlines()

    for text in (
        "plan on topology cpu8-two-islands: 2 islands, 4 hosts, 8 devices",
        "mesh replica 1 x stage 2 x data 4 x tensor 1; stages per island ib=1 roce=1",
        "pipeline 1f1b, 2 micro-batches of 1 per data rank",
        "layers per stage [1, 1]: the planner's optimal split",
        "collectives that block the device (CPU runtimes)",
    ):
        assert text in out, text
    assert any(x.split()[:3] == ["0", "ib", "1"] for x in lines)  # stage table: stage 0 on ib
    assert any(x.split()[:3] == ["1", "roce", "1"] for x in lines)

    # The predicted step is the planner's with blocking collectives (CPU), not the GPU one.
    req = plan_request(cfg)
    topo = load_mesh_topology(req)
    sync = predict_run(req, topo, sync_collectives=True).step_s
    overlapped = predict_run(req, topo).step_s
    assert f"{sync:.3g}" != f"{overlapped:.3g}"
    assert f"  predicted step {sync:.3g} s (" in out

    # After training: the median of the logged windows after the compiling first step.
    measured = sorted(r["step_time_s"] for r in history[1:])
    assert [r["step"] for r in history] == [1, 2, 3] and len(measured) == 2
    median = (measured[0] + measured[1]) / 2
    check = (
        f"step time: predicted {sync:.3g} s, measured {median:.3g} s (median of 2 logging "
        f"windows, the compiling first step left out); measured/predicted {median / sync:.2f}"
    )
    assert check in lines
    order = [
        next(i for i, x in enumerate(lines) if x.startswith(prefix))
        for prefix in ("plan on topology", "step 1 |", "done:", "step time:")
    ]
    assert order == sorted(order)


def test_plan_lines_without_a_topology_or_a_prediction(tiny_config):
    """No topology: nothing (the trainer keeps its one pipeline line). A placement the cost
    model cannot price (the naive one with two stages): one line saying why."""
    import jax

    from holmes_jax.core.plan_request import plan_request
    from holmes_jax.planner.grid import load_mesh_topology
    from holmes_jax.planner.report import format_step_check
    from holmes_jax.runtime.setup import describe_plan

    cfg = tiny_config("parallel.stages=2")
    assert describe_plan(cfg, Degrees(2, 4, 1), None, jax.devices(), None) == ([], None)
    naive = tiny_config(*TWO_ISLANDS, "parallel.enforce_islands=false")
    lines, predicted = describe_plan(
        naive, Degrees(2, 4, 1), load_mesh_topology(plan_request(naive)), jax.devices(), "auto"
    )
    assert predicted is None and len(lines) == 1
    assert lines[0].startswith("plan on topology cpu8-two-islands: no prediction (")
    assert "nothing measured" in format_step_check(1.0, [])


def test_a_watched_step_is_reported_whether_logged_or_not(monkeypatch):
    """``HOLMES_STATUS_STEPS`` (a launcher's fault steps): a step not logged is reported on
    the status channel once done when it is watched, and only then."""
    from types import SimpleNamespace

    from holmes_jax.core import status
    from holmes_jax.runtime.each_step import Logbook

    monkeypatch.setenv(status.STEPS_VAR, "3,x,0")  # what is not a step is ignored
    reported = []
    logger = SimpleNamespace(report=lambda event, **f: reported.append((event, f["step"])))
    stepper = SimpleNamespace(began=0.0)
    book = Logbook(load_config(None, TINY), logger, None, None, None, stepper, 0)
    for step in (1, 2, 3, 4):
        book.after_step(step, None, {"loss": jax.numpy.zeros(())}, log=False)
    assert reported == [("step", 3)]
