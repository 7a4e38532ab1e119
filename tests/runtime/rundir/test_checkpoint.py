"""A damaged newest checkpoint costs only the steps after the previous one.

The unit tests save a small pytree (no training, seconds); the end-to-end tests train the
tiny run with ``checkpoint.every=1``, damage its newest checkpoint, and resume.
"""

import glob
import os
import re
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from holmes_jax.core.config import CheckpointConfig, load_config
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import Degrees
from holmes_jax.runtime.loop import run
from holmes_jax.runtime.rundir import checkpoint as checkpoint_module
from holmes_jax.runtime.rundir.checkpoint import Checkpointer, find_step, read_params
from holmes_jax.runtime.rundir.storage import committed_steps
from tests.common import TINY_MODEL, TINY_RUN


def _largest_array_file(step_dir: str) -> str:
    return max(glob.glob(f"{step_dir}/state/ocdbt.process_*/d/*"), key=os.path.getsize)


def truncate_array_file(step_dir: str) -> None:
    """Halve the largest array data file of a checkpoint (a write cut short)."""
    largest = _largest_array_file(step_dir)
    os.truncate(largest, os.path.getsize(largest) // 2)


def delete_array_file(step_dir: str) -> None:
    """Delete the largest array data file of a checkpoint (a file lost with a disk)."""
    os.remove(_largest_array_file(step_dir))


# What both do to a restore: tensorstore cannot read one of the arrays, and says which.
ARRAY_ERROR = r"state: ValueError: [A-Z_]+: Error reading \"(b|w|params|opt_state)[^\"]*\""
DAMAGE = {"truncate": truncate_array_file, "delete": delete_array_file}


# -- unit tests: a small pytree, saved and restored without training -------------------


@pytest.fixture(scope="module")
def cfg(tiny_config):
    return tiny_config()


def _state(step: int) -> dict:
    # 4096 floats per array: big enough that OCDBT keeps it in a data file, not inline.
    return {"w": jnp.full((64, 64), float(step)), "b": jnp.arange(4096.0) + step}


def _abstract() -> dict:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _state(0)
    )


def _saved(directory, cfg, steps, keep=3) -> Checkpointer:
    ckpt = Checkpointer(CheckpointConfig(dir=str(directory), keep=keep))
    for step in steps:
        ckpt.save(step, _state(step), data_position=step, config=cfg)
    ckpt.wait()
    return ckpt


def _entries(directory) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_committed_names_each_save_once_and_only_once_a_restart_finds_it(tmp_path, cfg, async_save):
    """The training log names a checkpoint when :meth:`Checkpointer.committed` returns its
    step: by then it must be on disk, committed, and each save is named once."""
    ckpt = Checkpointer(CheckpointConfig(dir=str(tmp_path), keep=3, async_save=async_save))
    for step in (1, 2):
        ckpt.save(step, _state(step), data_position=step, config=cfg)
        told = ckpt.committed()
        while told is None:  # an asynchronous save: poll until it has committed
            assert async_save, "a synchronous save has committed when save returns"
            time.sleep(0.005)
            told = ckpt.committed()
        assert told == step and step in committed_steps(ckpt.path)
        assert ckpt.committed() is None and ckpt.committed(wait=True) is None
    ckpt.save(3, _state(3), data_position=3, config=cfg)
    assert ckpt.committed(wait=True) == 3 and committed_steps(ckpt.path) == [1, 2, 3]
    ckpt.close()


def test_a_save_on_cpu_compiles_nothing_and_restores_every_replica(tmp_path, cfg):
    """Each shard is written whole by its first replica (``storage.whole_shards_on_cpu``):
    orbax's replica-parallel save would compile a slice per array shape (seconds at every
    process's first save) and does here without the switch."""
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a"))  # 4 replicas
    # shapes no other test compiles a slice of, so a compile would be this save's
    state = {"w": jax.device_put(np.arange(8 * 136.0).reshape(8, 136), spec)}
    compiles = []

    def listen(event, seconds, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        ckpt = Checkpointer(CheckpointConfig(dir=str(tmp_path)))
        ckpt.save(1, state, data_position=1, config=cfg)
        ckpt.wait()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []
    abstract = {"w": jax.ShapeDtypeStruct((8, 136), state["w"].dtype, sharding=spec)}
    restored, _ = Checkpointer(CheckpointConfig(dir=str(tmp_path))).restore(abstract, cfg)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(state["w"]))


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_newest_falls_back_with_one_line_and_saves_go_on(tmp_path, cfg, damage):
    _saved(tmp_path, cfg, [1, 2, 3]).close()
    DAMAGE[damage](f"{tmp_path}/3")

    ckpt = Checkpointer(CheckpointConfig(dir=str(tmp_path), keep=3))
    lines: list[str] = []
    state, meta = ckpt.restore(_abstract(), cfg, warn=lines.append)
    assert meta["data_position"] == 2
    np.testing.assert_array_equal(state["b"], np.arange(4096.0) + 2)
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith(f"warning: checkpoint step 3 in {tmp_path} is unusable (")
    assert lines[0].endswith(f"kept it as {tmp_path}/3.corrupt, resuming from step 2")
    assert len(lines[0]) < 500
    assert re.search(ARRAY_ERROR, lines[0]), lines[0]
    assert _entries(tmp_path) == ["1", "2", "3.corrupt"]

    # Later saves go on: step 3 is written afresh, keep-last-N ignores the renamed one.
    for step in (3, 4, 5):
        ckpt.save(step, _state(step), data_position=step, config=cfg)
    ckpt.close()
    assert _entries(tmp_path) == ["3", "3.corrupt", "4", "5"]
    again: list[str] = []
    ckpt = Checkpointer(CheckpointConfig(dir=str(tmp_path), keep=3))
    _, meta = ckpt.restore(_abstract(), cfg, warn=again.append)
    ckpt.close()
    assert meta["data_position"] == 5 and again == []


def test_damaged_meta_falls_back_and_a_second_rename_does_not_overwrite(tmp_path, cfg):
    _saved(tmp_path, cfg, [1, 2]).close()
    os.makedirs(f"{tmp_path}/2.corrupt")  # left by an earlier fallback
    with open(f"{tmp_path}/2/meta/metadata", "w") as f:
        f.write('{"step": 2, "data_pos')
    lines: list[str] = []
    _, meta = Checkpointer(CheckpointConfig(dir=str(tmp_path))).restore(
        _abstract(), cfg, warn=lines.append
    )
    assert meta["data_position"] == 1
    assert len(lines) == 1 and "(meta/metadata: JSONDecodeError: " in lines[0]
    assert lines[0].endswith(f"kept it as {tmp_path}/2.corrupt-2, resuming from step 1")
    assert _entries(tmp_path) == ["1", "2.corrupt", "2.corrupt-2"]


def test_no_usable_checkpoint_is_a_one_line_error_and_changes_nothing(tmp_path, cfg):
    _saved(tmp_path, cfg, [1, 2]).close()
    truncate_array_file(f"{tmp_path}/2")
    delete_array_file(f"{tmp_path}/1")
    before = _entries(tmp_path)
    lines: list[str] = []
    with pytest.raises(ConfigError) as err:
        Checkpointer(CheckpointConfig(dir=str(tmp_path))).restore(
            _abstract(), cfg, warn=lines.append
        )
    message = str(err.value)
    assert "\n" not in message and lines == []
    assert message.startswith(f"checkpoint.dir={tmp_path}: no checkpoint in it can be restored")
    assert "step 2: state: ValueError" in message and "step 1: state: ValueError" in message
    assert "point checkpoint.dir at an empty directory to start from scratch" in message
    assert _entries(tmp_path) == before


def test_empty_directory_starts_fresh(tmp_path, cfg):
    lines: list[str] = []
    ckpt = Checkpointer(CheckpointConfig(dir=str(tmp_path / "new")))
    assert ckpt.restore(_abstract(), cfg, warn=lines.append) is None
    assert lines == []


def test_other_model_shape_is_refused_not_skipped(tmp_path, cfg, tiny_config):
    _saved(tmp_path, cfg, [1, 2]).close()
    wider = tiny_config(base=[*TINY_MODEL, "model.hidden_size=64"])
    with pytest.raises(ConfigError, match=r"^model\.hidden_size=64: checkpoint .*/2 was written"):
        Checkpointer(CheckpointConfig(dir=str(tmp_path))).restore(_abstract(), wider)
    assert _entries(tmp_path) == ["1", "2"]


def test_unfinished_save_is_named(tmp_path, cfg):
    _saved(tmp_path, cfg, [1]).close()
    os.makedirs(f"{tmp_path}/2.orbax-checkpoint-tmp-1234")  # a save cut off by a crash
    lines: list[str] = []
    _, meta = Checkpointer(CheckpointConfig(dir=str(tmp_path))).restore(
        _abstract(), cfg, warn=lines.append
    )
    assert meta["data_position"] == 1
    assert lines == [
        f"warning: an unfinished save in {tmp_path} is ignored "
        "(2.orbax-checkpoint-tmp-1234, left by an interrupted save); resuming from step 1"
    ]


def test_a_step_another_process_cannot_read_is_skipped_by_all(tmp_path, cfg, monkeypatch):
    """Two processes simulated: process 1 fails on step 3, which this process reads fine.
    Both must fall back to step 2, and the warning names process 1."""
    _saved(tmp_path, cfg, [1, 2, 3]).close()
    calls = []

    def gather(value):  # called alternately for the candidate and for the outcome
        calls.append(value)
        other = checkpoint_module._UNUSABLE if len(calls) == 2 else value
        return [value, other]

    monkeypatch.setattr(checkpoint_module, "_gather", gather)
    lines: list[str] = []
    _, meta = Checkpointer(CheckpointConfig(dir=str(tmp_path))).restore(
        _abstract(), cfg, warn=lines.append
    )
    assert calls == [3, checkpoint_module._OK, 2, checkpoint_module._OK]
    assert meta["data_position"] == 2
    assert lines == [
        f"warning: checkpoint step 3 in {tmp_path} is unusable (unreadable on process(es) 1; "
        f"their stderr says why); kept it as {tmp_path}/3.corrupt, resuming from step 2"
    ]


def test_read_params_takes_a_bf16_runs_master_and_checks_shapes(tmp_path, cfg):
    """The parameters alone (``init_from``, export): the fp32 master when there is one,
    as numpy or into a sharding; a target of another shape is one line naming the leaf."""
    master = {"blocks": {"w": jnp.full((2, 64, 64), 1 + 2.0**-10)}}  # not a bf16 number
    state = {
        "step": jnp.int32(3),
        "params": jax.tree.map(lambda a: a.astype(jnp.bfloat16), master),
        "opt_state": {"mu": master},
        "master": master,
    }
    ckpt = Checkpointer(CheckpointConfig(dir=str(tmp_path)))
    ckpt.save(3, state, data_position=3, config=cfg)
    ckpt.close()
    step_dir, meta = find_step(str(tmp_path), "key")
    assert step_dir == f"{tmp_path}/3" and meta["step"] == 3
    got = read_params(step_dir, key="key")["blocks"]["w"]
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got[0, 0, 0] == 1 + 2.0**-10

    sharding = jax.sharding.NamedSharding(
        jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,)),
        jax.sharding.PartitionSpec(None, "x"),
    )
    target = {"blocks": {"w": jax.ShapeDtypeStruct((2, 64, 64), jnp.float32, sharding=sharding)}}
    got = read_params(step_dir, target, key="key")["blocks"]["w"]
    assert got.sharding == sharding
    np.testing.assert_array_equal(got, master["blocks"]["w"])
    target = {"blocks": {"w": jax.ShapeDtypeStruct((2, 64, 32), jnp.float32, sharding=sharding)}}
    with pytest.raises(ConfigError, match=r"^key=.*/3: parameter blocks.w is \[2, 64, 64\] there"):
        read_params(step_dir, target, key="key")
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        find_step(str(tmp_path / "3" / "state"), "key")


# -- end to end: train, damage the newest checkpoint, resume ---------------------------

RUN = [*TINY_RUN, "train.steps=4", "logging.log_every=1", "logging.progress=none"]
RUN += ["checkpoint.every=1", "checkpoint.keep=3"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: 4 steps, a checkpoint after each (steps 2, 3, 4 kept)."""
    directory = tmp_path_factory.mktemp("full")
    history = run(load_config(None, [*RUN, f"checkpoint.dir={directory}"]))
    return directory, [r["loss"] for r in history]


def _final(make_program, cfg, directory):
    program = make_program(cfg, Degrees(1, 1, 1))
    state, meta = Checkpointer(CheckpointConfig(dir=str(directory))).restore(
        program.abstract_state, cfg
    )
    return jax.device_get(state), meta


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGE)
def test_resume_past_damaged_newest_equals_uninterrupted_run(
    tmp_path, uninterrupted, make_program, capfd, damage
):
    full_dir, full_losses = uninterrupted
    directory = tmp_path / "ckpt"
    shutil.copytree(full_dir, directory)
    shutil.rmtree(directory / "4")  # as if stopped after step 3: 3 is the newest ...
    DAMAGE[damage](f"{directory}/3")  # ... and it is damaged
    cfg = load_config(None, [*RUN, f"checkpoint.dir={directory}"])
    capfd.readouterr()

    history = run(cfg)
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning")]
    assert len(warnings) == 1, err
    assert warnings[0].startswith(f"warning: checkpoint step 3 in {directory} is unusable (")
    assert warnings[0].endswith(f"kept it as {directory}/3.corrupt, resuming from step 2")
    assert re.search(ARRAY_ERROR, warnings[0]), warnings[0]
    assert [r["step"] for r in history] == [3, 4]  # only the steps after 2 are recomputed
    np.testing.assert_allclose([r["loss"] for r in history], full_losses[2:], rtol=0, atol=1e-6)
    got, meta = _final(make_program, cfg, directory)
    ref, _ = _final(make_program, cfg, full_dir)
    assert meta["data_position"] == 4
    jax.tree.map(np.testing.assert_array_equal, got, ref)
    assert _entries(directory) == ["2", "3", "3.corrupt", "4"]


@pytest.mark.slow
def test_run_refuses_when_no_checkpoint_is_usable(tmp_path, uninterrupted):
    full_dir, _ = uninterrupted
    directory = tmp_path / "ckpt"
    shutil.copytree(full_dir, directory)
    for step in (2, 3, 4):
        delete_array_file(f"{directory}/{step}")
    with pytest.raises(ConfigError, match=f"^checkpoint.dir={directory}: no checkpoint in it"):
        run(load_config(None, [*RUN, f"checkpoint.dir={directory}"]))
    assert _entries(directory) == ["2", "3", "4"]
