"""One run directory per run: outputs resolved into it, never another run's records
overwritten, nothing compiled when there is nothing to train, the compile left out of the
progress bar.

The unit tests touch only the disk; the three end-to-end runs train the tiny model for one
or two steps each.
"""

import json
import os
import re
import time

import numpy as np
import pytest

from holmes_jax.core.config import load_config
from holmes_jax.runtime.loop import run
from holmes_jax.runtime.program import Program
from holmes_jax.runtime.rundir import paths as rundir
from holmes_jax.runtime.rundir.paths import choose_run_dir, outputs_line, resolve_outputs
from tests.common import TINY_RUN, config_path

# -- unit tests: resolution and the choice of directory ---------------------------------


def test_auto_outputs_resolve_into_the_run_dir_explicit_and_null_are_kept():
    cfg = resolve_outputs(load_config(None, ["train.run_dir=r"]))
    assert cfg.checkpoint.dir == os.path.join("r", "checkpoints")
    assert cfg.train.metrics_path == os.path.join("r", "metrics.jsonl")
    assert cfg.logging.tensorboard_dir == os.path.join("r", "tb")
    cfg = resolve_outputs(
        load_config(None, ["train.run_dir=r", "checkpoint.dir=/ck", "logging.tensorboard_dir=null"])
    )
    assert (cfg.checkpoint.dir, cfg.logging.tensorboard_dir) == ("/ck", None)
    assert cfg.train.metrics_path == os.path.join("r", "metrics.jsonl")
    none = resolve_outputs(load_config(None))  # the defaults: no run dir, nothing written
    assert (none.checkpoint.dir, none.train.metrics_path, none.logging.tensorboard_dir) == (
        None,
        None,
        None,
    )
    assert outputs_line(none) == "outputs: none written (train.run_dir is null)"


def test_the_quickstart_writes_into_its_run_dir():
    cfg = resolve_outputs(load_config(config_path("quickstart.yaml")))
    assert cfg.train.run_dir == "runs/quickstart"
    assert outputs_line(cfg) == (
        "run dir runs/quickstart: checkpoints/, metrics.jsonl, tb/ (TensorBoard), config.yaml"
    )


def _write(path, text="x\n"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_a_fresh_run_moves_to_the_first_dir_without_records(tmp_path):
    asked = str(tmp_path / "run")
    cfg = load_config(None, [f"train.run_dir={asked}"])
    assert choose_run_dir(cfg).cfg.train.run_dir == asked  # missing: used as is
    _write(f"{asked}/config.yaml")  # a run that wrote its config and no record
    assert choose_run_dir(cfg).moved_from is None
    _write(f"{asked}/tb/events.out")
    _write(f"{asked}-2/metrics.jsonl")  # -2 is taken too
    _write(f"{asked}-3/config.yaml")  # -3 holds no record: free
    chosen = choose_run_dir(cfg)
    assert (chosen.moved_from, chosen.cfg.train.run_dir) == (asked, f"{asked}-3")
    assert chosen.cfg.checkpoint.dir == f"{asked}-3/checkpoints"
    assert rundir.moved_line(chosen) == (
        f"train.run_dir={asked} holds another run's records (tb/) and this run starts "
        f"fresh: it writes to {asked}-3 instead (resume it with --set "
        f"train.run_dir={asked}-3)"
    )


def test_a_run_that_resumes_keeps_its_dir_one_that_does_not_moves(tmp_path):
    asked = str(tmp_path / "run")
    os.makedirs(f"{asked}/checkpoints/5")  # a step
    _write(f"{asked}/metrics.jsonl")
    resumes = load_config(None, [f"train.run_dir={asked}"])
    assert choose_run_dir(resumes).cfg.train.run_dir == asked
    for fresh in ("checkpoint.resume=false", "checkpoint.dir=null"):
        cfg = load_config(None, [f"train.run_dir={asked}", fresh])
        assert choose_run_dir(cfg).cfg.train.run_dir == f"{asked}-2", fresh


def test_every_process_takes_process_0s_choice(tmp_path, monkeypatch):
    """Process 1 sees an empty run dir, process 0 decided on -3: process 1 uses -3."""
    import jax
    from jax.experimental import multihost_utils

    sent = []

    def broadcast(value):
        sent.append(int(value))
        return np.int32(3)  # what process 0 sent

    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", broadcast)
    asked = str(tmp_path / "run")
    chosen = choose_run_dir(load_config(None, [f"train.run_dir={asked}"]))
    assert sent == [0]  # a process other than 0 does not decide
    assert chosen.cfg.train.run_dir == f"{asked}-3"
    assert chosen.cfg.train.metrics_path == f"{asked}-3/metrics.jsonl"


def test_a_restart_continues_its_dir_even_without_a_checkpoint(tmp_path, monkeypatch):
    """HOLMES_CONTINUE_RUN_DIR: a job killed before its first checkpoint left metrics and
    no checkpoint; its restart writes into the same directory (a fresh run would move to
    -2) and appends to the metrics, whatever train.run_dir the config names."""
    first = str(tmp_path / "run")
    _write(f"{first}/metrics.jsonl")
    cfg = load_config(None, [f"train.run_dir={first}"])
    assert choose_run_dir(cfg).cfg.train.run_dir == f"{first}-2"  # no restart: moves
    monkeypatch.setenv(rundir.CONTINUE_VAR, first)
    for asked in (first, str(tmp_path / "other")):
        chosen = choose_run_dir(load_config(None, [f"train.run_dir={asked}"]))
        assert chosen.continued and chosen.moved_from is None
        assert chosen.cfg.train.run_dir == first
        assert chosen.cfg.train.metrics_path == f"{first}/metrics.jsonl"
    monkeypatch.setenv(rundir.CONTINUE_VAR, " ")
    assert rundir.continued_run_dir() is None
    assert not choose_run_dir(cfg).continued


def test_the_compilation_cache_dir_and_its_precedence():
    """A path wins on any platform; then JAX_COMPILATION_CACHE_DIR (auto sets nothing);
    auto is <run_dir>/compile_cache on accelerators and nothing on CPU devices; null and no
    run dir set nothing."""
    from holmes_jax.runtime.rundir.compile_cache import cache_dir

    env, jax_env = {}, {"JAX_COMPILATION_CACHE_DIR": "/j"}
    auto = load_config(None, ["train.run_dir=r"])
    assert cache_dir(auto, "gpu", env) == os.path.join("r", "compile_cache")
    assert cache_dir(auto, "cpu", env) is None
    assert cache_dir(auto, "gpu", jax_env) is None
    assert cache_dir(load_config(None), "gpu", env) is None
    off = load_config(None, ["train.run_dir=r", "train.compilation_cache=null"])
    assert cache_dir(off, "gpu", env) is None
    path = load_config(None, ["train.run_dir=r", "train.compilation_cache=/c"])
    assert cache_dir(path, "cpu", jax_env) == "/c"
    with pytest.raises(Exception, match=r"train.compilation_cache='': must be auto, a path"):
        load_config(None, ["train.compilation_cache=''"])


def test_the_executable_store_loads_without_tracing_and_keys_on_what_shapes_the_program(
    tmp_path, monkeypatch
):
    """With train.executable_store in a job of several CPU processes (stood in for), a
    program stored once is loaded on the next call without calling ``lower`` (no trace, no
    lowering) and computes the same; another identity (another plan) traces again. The
    identity ignores the run's paths, not its plan."""
    import jax
    import jax.numpy as jnp

    from holmes_jax.runtime.rundir import compile_cache as cc

    monkeypatch.setattr(cc, "_STORE", str(tmp_path))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    f = jax.jit(lambda x: jnp.sin(x) * 2.0 + x)
    x = jnp.arange(6.0)
    lowered = []

    def lower():
        lowered.append(1)
        return f.lower(x)

    devices = np.array(jax.devices()[:1]).flat  # as a mesh gives them: an iterator
    first = cc.load_or_compile(lower, "f", devices, "plan A")
    devices = np.array(jax.devices()[:1]).flat
    again = cc.load_or_compile(lower, "f", devices, "plan A")
    assert len(lowered) == 1 and len(os.listdir(tmp_path / cc.STORE)) == 1
    np.testing.assert_array_equal(np.asarray(again(x)), np.asarray(first(x)))
    cc.load_or_compile(lower, "f", jax.devices()[:1], "plan B")
    assert len(lowered) == 2
    a = load_config(None, ["train.run_dir=a", "parallel.microbatches=2"])
    moved = load_config(None, ["train.run_dir=b", "parallel.microbatches=2"])
    other = load_config(None, ["train.run_dir=a", "parallel.microbatches=4"])
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    ids = [cc.identity(c, mesh, x) for c in (a, moved, other)]
    assert ids[0] == ids[1] != ids[2]
    assert cc.identity(a, mesh, None) != cc.identity(a, mesh, x)  # no batch: the state's
    # A Stored function: its first call's executable is stored; a fresh one (a restart)
    # loads it without tracing; arguments of another shape run the jitted function.
    traced = []

    def g(v):
        traced.append(v.shape)
        return jnp.cos(v) + 1.0

    stored = cc.Stored(jax.jit(g), "g", jax.devices()[:1], "plan A")
    np.testing.assert_allclose(np.asarray(stored(x)), np.cos(np.arange(6.0)) + 1, rtol=1e-6)
    restarted = cc.Stored(jax.jit(g), "g", jax.devices()[:1], "plan A")
    restarted.compile(jax.ShapeDtypeStruct(x.shape, x.dtype))
    assert len(traced) == 1 and isinstance(restarted.compiled, jax.stages.Compiled)
    np.testing.assert_array_equal(np.asarray(restarted(x)), np.asarray(stored(x)))
    assert len(traced) == 1
    np.testing.assert_allclose(np.asarray(restarted(jnp.zeros(3))), np.full(3, 2.0))
    assert traced == [(6,), (3,)]  # the other shape traced by jit, the stored one kept


# -- end to end: the tiny model, one or two steps per run --------------------------------

TINY = [*TINY_RUN, "train.eval_every=0", "train.eval_batches=1", "logging.log_every=1"]


def _steps(path) -> list[int]:
    with open(path) as f:
        return [json.loads(line)["step"] for line in f]


@pytest.mark.slow
def test_resume_appends_and_a_finished_run_has_nothing_to_train(
    tmp_path, tiny_config, capsys, monkeypatch
):
    run_dir = tmp_path / "run"
    cfg = tiny_config(*TINY, f"train.run_dir={run_dir}", "train.steps=2", "logging.progress=plain")
    assert [r["step"] for r in run(cfg, stop_at_step=1)] == [1]
    assert [r["step"] for r in run(cfg)] == [2]  # resumes, appends
    metrics = run_dir / "metrics.jsonl"
    assert _steps(metrics) == [1, 2]
    out = capsys.readouterr().out
    assert f"resumed from {run_dir}/checkpoints at step 1" in out
    for step in (1, 2):
        assert f"checkpoint step {step}: {run_dir}/checkpoints/{step}" in out.splitlines()

    # Again, from the config.yaml the run wrote: nothing compiles, nothing is written.
    written = load_config(run_dir / "config.yaml")
    assert written.train.run_dir == str(run_dir)
    assert written.checkpoint.dir == f"{run_dir}/checkpoints"
    assert written.model == cfg.model
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    for name in ("train_step", "init", "from_logical"):
        monkeypatch.setattr(Program, name, lambda *a, name=name: pytest.fail(f"{name} ran"))
    assert run(written) == []
    assert capsys.readouterr().out.splitlines() == [
        f"nothing to train: {run_dir}/checkpoints holds step 2 and train.steps=2; raise "
        f"train.steps (--set train.steps=4) or start a new run (--set "
        f"train.run_dir={run_dir}-2)"
    ]
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before
    assert not os.path.exists(f"{run_dir}-2")


@pytest.mark.slow
def test_a_fresh_run_keeps_anothers_metrics_and_its_bar_leaves_the_compile_out(
    tmp_path, tiny_config, capsys, monkeypatch
):
    """checkpoint.dir=null into a run dir holding metrics: the run goes to -2. The first
    step is made 1 s slower, as a longer compile: the bar starts after it."""
    import tqdm

    run_dir = tmp_path / "run"
    other = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (10, 20, 30))
    _write(f"{run_dir}/metrics.jsonl", other)

    compiled_at = []
    original = Program.train_step

    def slow_first(self, state, batch):
        out = original(self, state, batch)
        if not compiled_at:
            time.sleep(1.0)
            compiled_at.append(time.time())
        return out

    bars = []

    class Bar(tqdm.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(Program, "train_step", slow_first)
    monkeypatch.setattr(tqdm, "tqdm", Bar)
    cfg = tiny_config(
        *TINY,
        f"train.run_dir={run_dir}",
        "checkpoint.dir=null",
        "train.steps=2",
        "logging.progress=bar",
    )
    history = run(cfg)

    assert (run_dir / "metrics.jsonl").read_text() == other  # untouched
    assert _steps(f"{run_dir}-2/metrics.jsonl") == [1, 2]
    assert load_config(f"{run_dir}-2/config.yaml").train.run_dir == f"{run_dir}-2"
    lines = capsys.readouterr().out.splitlines()
    assert (
        f"train.run_dir={run_dir} holds another run's records (metrics.jsonl) and this run "
        f"starts fresh: it writes to {run_dir}-2 instead"
    ) in lines
    assert f"run dir {run_dir}-2: metrics.jsonl, tb/ (TensorBoard), config.yaml" in lines

    compiling = lines.index("compiling the train step ...")
    # The cache's verdict, where one is in use (JAX_COMPILATION_CACHE_DIR, or a path).
    cached = r"( \(compilation cache: (hit|miss|\d+ of \d+ hit)\))?"
    assert re.fullmatch(
        rf"compiled in {history[0]['compile_s']:.1f} s{cached}", lines[compiling + 1]
    )
    assert history[0]["compile_s"] >= 1.0
    assert history[0]["step_time_s"] < 1.0  # the compile is left out of the first step
    assert "compile_s" not in history[1]
    assert len(bars) == 1 and bars[0].start_t >= compiled_at[0]
