"""Checkpoints in a bucket: ``checkpoint.dir`` and ``checkpoint.init_from`` as ``gs://``.

No bucket is reachable here, so ``gs://`` is a fake bucket on local disk, faked where orbax's
own code meets the network and nowhere else:

- epath opens ``gs://`` with fsspec's ``gcs`` filesystem: registered here as a local
  filesystem rooted in a temporary directory (what ``gcsfs`` would be);
- orbax hands tensorstore a ``{"driver": "gcs", "bucket", "path"}`` store for the arrays:
  replaced by the ``file`` store of the same directory;
- orbax asks ``google-cloud-storage`` whether the bucket has a hierarchical namespace: no.

Everything else is the code a real bucket runs: orbax takes its GCS branch (a step is
written in place and committed by ``commit_success.txt``, not renamed), and our listing,
metadata reads, renames and keep-last-N go through epath. What is not tested is the wire:
gcsfs and tensorstore's GCS driver talking to Google.
"""

import importlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath
from etils.epath import backend as epath_backend
from fsspec.implementations.local import LocalFileSystem
from orbax.checkpoint._src.path import gcs_utils

from holmes_jax.core.config import CheckpointConfig, load_config
from holmes_jax.core.errors import ConfigError
from holmes_jax.runtime.rundir.checkpoint import Checkpointer, find_step, read_params
from holmes_jax.runtime.rundir.paths import choose_run_dir, newest_step
from holmes_jax.runtime.rundir.storage import storage_path
from tests.common import TINY_RUN

BUCKET = "gs://holmes-test"


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    """``gs://holmes-test/...`` stored under ``tmp_path/holmes-test/...``; yields that root."""
    root = str(tmp_path)

    class FakeGCS(LocalFileSystem):
        protocol = ("gcs", "gs")

        @classmethod
        def _strip_protocol(cls, path):
            path = str(path)
            if path.startswith("gs://"):
                path = os.path.join(root, path.removeprefix("gs://"))
            return super()._strip_protocol(path)

        def glob(self, path, **kwargs):  # as gcsfs: "bucket/key", no protocol
            return [os.path.relpath(p, root) for p in super().glob(path, **kwargs)]

    def file_store(path):
        name, key = gcs_utils.parse_gcs_path(path, add_trailing_slash=False)
        return {"driver": "file", "path": os.path.join(root, name, key)}

    registered = importlib.import_module("fsspec.registry")._registry  # undone after the test
    for protocol in FakeGCS.protocol:
        monkeypatch.setitem(registered, protocol, FakeGCS)
    monkeypatch.setattr(gcs_utils, "get_kvstore_for_gcs", file_store)
    monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)
    epath_backend.fsspec_backend._get_filesystem.cache_clear()  # epath keeps one per scheme
    yield tmp_path
    epath_backend.fsspec_backend._get_filesystem.cache_clear()


@pytest.fixture(scope="module")
def cfg(tiny_config):
    return tiny_config()


def _state(step: int) -> dict:
    return {"params": {"w": jnp.full((64, 64), float(step)), "b": jnp.arange(4096.0) + step}}


def test_checkpoints_in_a_bucket_save_list_keep_restore_and_set_aside(bucket, cfg):
    where = f"{BUCKET}/run/checkpoints"
    ckpt = Checkpointer(CheckpointConfig(dir=where, keep=2))
    assert ckpt.directory == where
    for step in (1, 2, 3):
        ckpt.save(step, _state(step), data_position=step, config=cfg)
    ckpt.close()
    local = bucket / "holmes-test" / "run" / "checkpoints"
    assert sorted(os.listdir(local)) == ["2", "3"]  # keep=2 deleted step 1, in the bucket
    assert (local / "3" / "commit_success.txt").exists()  # orbax's GCS commit, not a rename

    # A save cut off on GCS leaves its step directory without the commit file.
    epath.Path(f"{where}/4/state").mkdir(parents=True)
    epath.Path(f"{where}/4/meta").mkdir()
    assert newest_step(where) == 3  # the listing the run directory and "nothing to train" use
    step_dir, meta = find_step(where, "checkpoint.init_from")
    assert (step_dir, meta["step"]) == (f"{where}/3", 3)
    np.testing.assert_array_equal(read_params(step_dir, key="x")["b"], np.arange(4096.0) + 3)

    # Damage step 3: restore falls back to 2, renames 3 aside in the bucket, names step 4.
    (local / "3" / "meta" / "metadata").write_text('{"step": 3, "data_pos')
    lines: list[str] = []
    ckpt = Checkpointer(CheckpointConfig(dir=where, keep=2))
    abstract = jax.tree.map(jnp.zeros_like, _state(0))
    state, meta = ckpt.restore(abstract, cfg, warn=lines.append)
    ckpt.close()
    assert meta["data_position"] == 2
    np.testing.assert_array_equal(state["params"]["w"], np.full((64, 64), 2.0))
    assert lines[0] == (
        f"warning: an unfinished save in {where} is ignored (4, left by an interrupted "
        "save); resuming from step 2"
    )
    assert lines[1].endswith(f"kept it as {where}/3.corrupt, resuming from step 2")
    assert sorted(os.listdir(local)) == ["2", "3.corrupt", "4"]


@pytest.mark.slow
def test_a_run_in_a_bucket_resumes_and_exports(bucket, capsys, tmp_path):
    """The trainer with checkpoint.dir=gs://...: it saves there; run again, it finds the
    step through epath, keeps its (local) run directory and has nothing to train; the
    export reads the step back from the bucket."""
    from holmes_jax.runtime.hf.convert import export_hf
    from holmes_jax.runtime.loop import run

    where = f"{BUCKET}/tiny"
    overrides = [*TINY_RUN, "train.steps=1", "train.eval_batches=1", "parallel.devices=1"]
    overrides += [f"checkpoint.dir={where}", "logging.progress=plain"]
    overrides += ["data.max_bytes=100000", f"train.run_dir={tmp_path / 'run'}"]
    assert len(run(load_config(None, overrides))) == 1
    assert (bucket / "holmes-test" / "tiny" / "1" / "commit_success.txt").exists()
    capsys.readouterr()
    assert run(load_config(None, overrides)) == []
    said = capsys.readouterr().out
    assert f"nothing to train: {where} holds step 1 and train.steps=1" in said
    assert choose_run_dir(load_config(None, overrides)).moved_from is None  # it resumes there

    said = export_hf(where, str(tmp_path / "hf"), progress=False)
    assert f"from {where}/1 to" in said and (tmp_path / "hf" / "model.safetensors").exists()


def test_paths_local_and_remote(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert storage_path("ckpt", "checkpoint.dir") == epath.Path(tmp_path / "ckpt")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert str(storage_path("~/x", "checkpoint.dir")) == f"{tmp_path}/x"
    with pytest.raises(ConfigError) as e:
        storage_path("s3://bucket/ckpt", "checkpoint.dir")
    assert str(e.value).startswith(
        "checkpoint.dir=s3://bucket/ckpt: orbax-checkpoint writes local paths and gs:// only"
    )
    with pytest.raises(ConfigError, match="^checkpoint.dir=s3://b/c: orbax-checkpoint"):
        choose_run_dir(load_config(None, ["checkpoint.dir=s3://b/c"]))  # on every process
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=r"gs://b/c: gs:// needs the gcsfs package"):
            storage_path("gs://b/c", "checkpoint.init_from")
