"""Where checkpoints live: a local directory or a ``gs://`` bucket, through ``etils.epath``.

Every read, listing, rename and existence check on ``checkpoint.dir`` and
``checkpoint.init_from`` goes through an :class:`epath.Path`, the path type orbax itself
takes, so a bucket works wherever a local directory does. The run directory (metrics,
TensorBoard, ``config.yaml``) stays local.

Which paths orbax-checkpoint 0.12 can write:

- local paths, including a mounted bucket (gcsfuse, mountpoint-s3);
- ``gs://``: the arrays go through tensorstore's GCS driver and the rest through epath, which
  needs ``gcsfs`` (it brings ``google-cloud-storage``, which orbax uses to list steps);
- not ``s3://`` or any other scheme: orbax hands tensorstore such a path as a relative
  local one and the first save fails, so :func:`storage_path` refuses it up front.

A step is committed when orbax says so (:func:`committed_steps`). On a local disk that is a
directory named by the step alone (a save in flight is ``<k>.orbax-checkpoint-tmp-*``); on
GCS, where nothing is renamed, a step directory holding ``commit_success.txt``.

How the arrays are written: on CPU devices each shard whole, by its first replica
(:func:`whole_shards_on_cpu`).
"""

from __future__ import annotations

import os

import fsspec
import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint.path import step as orbax_step

from holmes_jax.core.errors import ConfigError

REMOTE_SCHEMES = ("gs",)  # what orbax-checkpoint 0.12 writes besides local paths


def scheme_of(path: str) -> str | None:
    """``"gs"`` for ``gs://bucket/dir``; None for a local path."""
    head, sep, _ = path.partition("://")
    return head if sep and head.isalnum() else None


def is_remote(path: str) -> bool:
    return scheme_of(path) is not None


def storage_path(path: str, key: str) -> epath.Path:
    """``path`` as an :class:`epath.Path`: a local one made absolute (``~`` expanded), a
    ``gs://`` one as it is.

    Args:
      path: a local path or a ``gs://`` URI.
      key: what the path is called in messages (``checkpoint.dir``, ``checkpoint.init_from``).

    Raises:
      ConfigError: a scheme orbax cannot write, or ``gs://`` without ``gcsfs`` installed.
    """
    scheme = scheme_of(path)
    if scheme is None:
        return epath.Path(os.path.abspath(os.path.expanduser(path)))
    if scheme not in REMOTE_SCHEMES:
        raise ConfigError(
            f"{key}={path}: orbax-checkpoint writes local paths and gs:// only ({scheme}:// "
            "reaches tensorstore as a relative local path); mount the bucket and give the "
            "mount's path"
        )
    try:
        fsspec.get_filesystem_class("gcs")  # what epath opens gs:// with
    except ImportError:
        raise ConfigError(
            f"{key}={path}: gs:// needs the gcsfs package (pip install gcsfs; it brings "
            "google-cloud-storage)"
        ) from None
    return epath.Path(path)


def committed_steps(directory: epath.Path) -> list[int]:
    """The steps orbax has committed in ``directory``, ascending; [] when it is missing."""
    return sorted(orbax_step.checkpoint_steps(directory))


def whole_shards_on_cpu() -> None:
    """On CPU devices, have each array shard written whole by its first replica (orbax's
    way on GPUs) rather than sliced across its replicas: each slice is a compiled program
    per array shape and sharding (41 for the quickstart, 4.5 s at the first save of every
    process's life: each restart pays them again), and on CPU the bytes are in host memory
    already. Replaces orbax's global ``jax.Array`` handler, once; the format is the same."""
    current = ocp.type_handlers.get_type_handler(jax.Array)
    if jax.devices()[0].platform != "cpu" or not current._use_replica_parallel:
        return
    handler = ocp.type_handlers.ArrayHandler(
        array_metadata_store=current._array_metadata_store, use_replica_parallel=False
    )
    ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
