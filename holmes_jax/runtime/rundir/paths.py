"""Where a run writes: one run directory for its checkpoints, metrics, TensorBoard events
and resolved config.

``train.run_dir`` names the directory. An output whose value is ``auto`` (the default)
goes inside it (:func:`resolve_outputs`):

- ``checkpoint.dir``: ``<run_dir>/checkpoints``
- ``train.metrics_path``: ``<run_dir>/metrics.jsonl``
- ``logging.tensorboard_dir``: ``<run_dir>/tb``
- ``logging.profile_dir``: ``<run_dir>/profile`` (written only with ``logging.profile_steps``)
- the resolved config, always: ``<run_dir>/config.yaml`` (``load_config`` reads it back)

An explicit path overrides ``auto``, and null turns that output off. With ``run_dir: null``
the ``auto`` outputs are off and no config is written. The run directory is local;
``checkpoint.dir`` may be a ``gs://`` bucket (:mod:`holmes_jax.runtime.rundir.storage`).

A run never writes over another run's records: a run that will not resume moves to the
first free ``<run_dir>-n`` (:func:`choose_run_dir`). A restart continues its run: with
``HOLMES_CONTINUE_RUN_DIR=<path>`` in the environment, ``train.run_dir`` is ``<path>``
whatever the config says (:func:`continued_run_dir`). The launcher sets it when it restarts
a job (:mod:`holmes_jax.cluster.launcher`); a requeued batch job can set it the same way.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import yaml

from holmes_jax.core.config import Config, DistributedConfig
from holmes_jax.runtime.rundir.storage import committed_steps, storage_path

AUTO = "auto"  # the value of an output that goes into the run directory
CONFIG_NAME = "config.yaml"
METRICS_NAME = "metrics.jsonl"
CHECKPOINTS_NAME = "checkpoints"
TENSORBOARD_NAME = "tb"
PROFILE_NAME = "profile"
COMPILE_CACHE_NAME = "compile_cache"
# A restart of the run in this directory: write there, resume or start over, append.
CONTINUE_VAR = "HOLMES_CONTINUE_RUN_DIR"


def continued_run_dir(environ=None) -> str | None:
    """The run directory a restart continues (``HOLMES_CONTINUE_RUN_DIR``), or None.

    The run never moves off it. It resumes from the newest checkpoint there, else it starts
    at step 0 in the same directory. It appends to the metrics either way; a later record of
    a step supersedes an earlier one.
    """
    value = (os.environ if environ is None else environ).get(CONTINUE_VAR, "").strip()
    return value or None


def resolve_outputs(cfg: Config) -> Config:
    """``cfg`` with each ``auto`` output replaced by its path in ``train.run_dir``, or by
    None when there is no run directory. Explicit paths and nulls are kept."""
    run_dir = cfg.train.run_dir

    def inside(value: str | None, name: str) -> str | None:
        if value != AUTO:
            return value
        return os.path.join(run_dir, name) if run_dir else None

    return cfg.replace(
        train=dataclasses.replace(
            cfg.train, metrics_path=inside(cfg.train.metrics_path, METRICS_NAME)
        ),
        checkpoint=dataclasses.replace(
            cfg.checkpoint, dir=inside(cfg.checkpoint.dir, CHECKPOINTS_NAME)
        ),
        logging=dataclasses.replace(
            cfg.logging,
            tensorboard_dir=inside(cfg.logging.tensorboard_dir, TENSORBOARD_NAME),
            profile_dir=inside(cfg.logging.profile_dir, PROFILE_NAME),
        ),
    )


def newest_step(directory: str | None) -> int | None:
    """The newest step orbax has committed in a checkpoint directory (local or ``gs://``,
    :func:`~holmes_jax.runtime.rundir.storage.committed_steps`), None when it holds none (or is
    missing)."""
    if not directory:
        return None
    steps = committed_steps(storage_path(directory, "checkpoint.dir"))
    return max(steps) if steps else None


def will_resume(cfg: Config) -> bool:
    """Whether a run of ``cfg`` (outputs resolved) resumes from its checkpoint directory."""
    return cfg.checkpoint.resume and newest_step(cfg.checkpoint.dir) is not None


def records_in(run_dir: str) -> list[str]:
    """The records of a run that ``run_dir`` holds: its metrics file, TensorBoard events
    and checkpoints, by name; empty when there are none (a lone ``config.yaml`` is no
    record)."""
    found = []
    metrics = os.path.join(run_dir, METRICS_NAME)
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        found.append(METRICS_NAME)
    for name in (TENSORBOARD_NAME, CHECKPOINTS_NAME):
        path = os.path.join(run_dir, name)
        if os.path.isdir(path) and os.listdir(path):
            found.append(f"{name}/")
    return found


def sibling(run_dir: str, n: int) -> str:
    """``<run_dir>-n``."""
    return f"{run_dir.rstrip('/')}-{n}"


def first_free(run_dir: str) -> int:
    """The smallest n >= 2 such that ``<run_dir>-n`` holds no records."""
    n = 2
    while records_in(sibling(run_dir, n)):
        n += 1
    return n


def free_suffix(cfg: Config, continued: bool = False) -> int:
    """Process 0's choice: 0 to write into ``train.run_dir`` as given (it holds no records,
    the run resumes there, or it is ``continued``: a restart), else :func:`first_free`."""
    run_dir = cfg.train.run_dir
    if run_dir is None or continued:
        return 0
    if will_resume(resolve_outputs(cfg)) or not records_in(run_dir):
        return 0
    return first_free(run_dir)


@dataclasses.dataclass(frozen=True)
class RunDir:
    """The outputs a run writes to.

    Attributes:
      cfg: the config with ``train.run_dir`` final and every ``auto`` output resolved.
      moved_from: the ``train.run_dir`` asked for, when it held another run's records and
        this run writes elsewhere; else None.
      records: what ``moved_from`` holds (``metrics.jsonl``, ``tb/``, ``checkpoints/``).
      continued: a restart of the run in ``train.run_dir`` (:func:`continued_run_dir`).
    """

    cfg: Config
    moved_from: str | None = None
    records: tuple[str, ...] = ()
    continued: bool = False


def choose_run_dir(cfg: Config) -> RunDir:
    """Resolve the outputs, moving off a run directory that holds another run's records.

    A run that will not resume (:func:`will_resume`: checkpoints off,
    ``checkpoint.resume: false``, or no step in its checkpoint directory) and whose run
    directory holds records (:func:`records_in`) moves to the first of ``<run_dir>-2``,
    ``<run_dir>-3``, ... that holds none. A resuming run keeps its directory and appends to
    its metrics. A restart (:func:`continued_run_dir`) takes the directory it continues, as
    is.

    Every process of a job must call this at the same point: process 0 decides and the
    others take its choice (one broadcast integer). Nothing is written here.
    """
    continued = continued_run_dir()
    if continued is not None:
        cfg = cfg.replace(train=dataclasses.replace(cfg.train, run_dir=continued))
    checkpoints = resolve_outputs(cfg).checkpoint.dir
    if checkpoints:  # on every process: a path orbax cannot write fails all alike
        storage_path(checkpoints, "checkpoint.dir")
    suffix = free_suffix(cfg, continued is not None) if jax.process_index() == 0 else 0
    if jax.process_count() > 1 and cfg.train.run_dir is not None:
        # The checkpoint directory is shared and written by every process, so all must
        # agree before anyone writes; each process's own look at the disk could differ
        # (a step committed between two listings, a stale NFS cache).
        from jax.experimental import multihost_utils

        suffix = int(multihost_utils.broadcast_one_to_all(np.int32(suffix)))
    if suffix == 0:
        return RunDir(resolve_outputs(cfg), continued=continued is not None)
    asked = cfg.train.run_dir
    moved = cfg.replace(train=dataclasses.replace(cfg.train, run_dir=sibling(asked, suffix)))
    return RunDir(resolve_outputs(moved), asked, tuple(records_in(asked)))


def moved_line(run: RunDir) -> str | None:
    """The one line saying that a run moved off its asked directory, or None."""
    if run.moved_from is None:
        return None
    new = run.cfg.train.run_dir
    line = (
        f"train.run_dir={run.moved_from} holds another run's records "
        f"({', '.join(run.records)}) and this run starts fresh: it writes to {new} instead"
    )
    if run.cfg.checkpoint.dir:
        line += f" (resume it with --set train.run_dir={new})"
    return line


def outputs_line(cfg: Config) -> str:
    """Where a run's outputs go, in one line: names inside the run directory, full paths
    for outputs elsewhere."""
    run_dir = cfg.train.run_dir
    outputs = [
        ("checkpoints", cfg.checkpoint.dir, "/"),
        ("metrics", cfg.train.metrics_path, ""),
        ("TensorBoard", cfg.logging.tensorboard_dir, "/"),
        ("profiler traces", cfg.logging.profile_steps and cfg.logging.profile_dir, "/"),
    ]
    inside, elsewhere = [], []
    for what, path, slash in outputs:
        if not path:
            continue
        if run_dir and os.path.dirname(os.path.normpath(path)) == os.path.normpath(run_dir):
            name = os.path.basename(os.path.normpath(path)) + slash
            inside.append(name + (" (TensorBoard)" if what == "TensorBoard" else ""))
        else:
            elsewhere.append(f"{what} to {path}")
    if run_dir:
        line = f"run dir {run_dir}: " + ", ".join([*inside, CONFIG_NAME])
        return line + "".join(f"; {x}" for x in elsewhere)
    if elsewhere:
        return "outputs: " + ", ".join(elsewhere)
    return "outputs: none written (train.run_dir is null)"


def config_yaml(cfg: Config) -> str:
    """``cfg`` (resolved) as the YAML that ``load_config`` reads back: what ``config.yaml``
    holds below its header, and what ``train --print-config`` prints.

    The ``distributed`` section is written as its defaults (auto-detection): the launch
    decides how processes join, and one file serves every process of the job.
    """
    cfg = cfg.replace(distributed=DistributedConfig())
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def write_config(cfg: Config) -> str | None:
    """Write ``cfg`` (resolved) as ``<run_dir>/config.yaml`` (:func:`config_yaml`); returns
    its path, or None without a run directory. Call on one process."""
    if cfg.train.run_dir is None:
        return None
    os.makedirs(cfg.train.run_dir, exist_ok=True)
    path = os.path.join(cfg.train.run_dir, CONFIG_NAME)
    header = (
        "# The resolved config of the run in this directory, written when it started.\n"
        f"#   python -m holmes_jax.train --config {path}\n"
    )
    with open(path, "w") as f:
        f.write(header + config_yaml(cfg))
    return path
