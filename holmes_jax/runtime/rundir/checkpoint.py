"""Orbax checkpoints: asynchronous, keep-last-N, resumed from the newest usable one.

A checkpoint at step k is a directory ``<checkpoint.dir>/<k>/`` with two items:

- ``state``: the train state in its logical, mesh-independent layout. Blocks are stacked
  ``[L, ...]`` and the optimizer state mirrors the parameters. It restores into any
  shardings, so a run may resume on another mesh.
- ``meta``: JSON (``meta/metadata``) with the step, the data position and the full config.

:meth:`Checkpointer.save` returns once the arrays are copied off the devices. The write
goes on in the background; :meth:`Checkpointer.close` waits for it.

:meth:`Checkpointer.restore` reads the newest step in full. A step that fails to read is
renamed ``<k>.corrupt``, named in one warning line, and the next older step is tried.
No usable step is a one-line :class:`ConfigError` that changes nothing on disk. An empty or
missing directory returns None. A checkpoint of another model shape is a ConfigError at once.
With several processes a step is used only if every process read it.

:func:`save_params` writes a parameters-only checkpoint (``meta.params_only``, step 0), as
``python -m holmes_jax.hf import`` does. It cannot be resumed; ``checkpoint.init_from``
starts a run from it. :func:`read_params` reads the parameters alone from either kind.

The directory may be local or ``gs://``: every path goes through ``etils.epath``
(:mod:`holmes_jax.runtime.rundir.storage`). ``checkpoint.init_from`` may also name a Hugging Face
model directory, read on the fly (:func:`init_state_from`).

Why restore never falls back to a fresh run, and how processes agree on a step:
docs/design.md, "Checkpoints".
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from holmes_jax.cluster.distributed import every_process as _gather  # tests replace it
from holmes_jax.core.config import CheckpointConfig, Config, ModelConfig
from holmes_jax.core.errors import ConfigError, one_line
from holmes_jax.core.yamlio import plain
from holmes_jax.runtime.hf.files import is_hf_dir, read_hf_for_run
from holmes_jax.runtime.program import Program
from holmes_jax.runtime.rundir.storage import committed_steps, storage_path, whole_shards_on_cpu
from holmes_jax.runtime.state import TrainState

_OK, _UNUSABLE, _WRONG_MODEL = 0, 1, 2  # outcome of reading one step on one process
# The model keys that decide parameter shapes (and the architecture); a checkpoint must
# agree on all of them to be resumed.
_SHAPE_KEYS = ("arch", "vocab_size", "seq_len", "num_layers", "num_heads", "num_kv_heads")
_SHAPE_KEYS += ("hidden_size", "mlp_size", "tied_embeddings")
_REASON_CHARS = 240  # an error's text is cut here, so that a warning stays one short line
_UNFINISHED = ".orbax-checkpoint-tmp"  # orbax's suffix for a save not yet committed


class Checkpointer:
    """Thin wrapper over ``ocp.CheckpointManager`` for one run directory."""

    def __init__(self, cfg: CheckpointConfig):
        if not cfg.dir or cfg.dir == "auto":
            raise ValueError(f"Checkpointer needs a resolved checkpoint.dir, got {cfg.dir!r}")
        self.cfg = cfg
        whole_shards_on_cpu()
        self.path = storage_path(cfg.dir, "checkpoint.dir")
        self.directory = str(self.path)  # as messages name it
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            create=True,
            enable_async_checkpointing=cfg.async_save,
        )
        self.manager = ocp.CheckpointManager(
            self.path, options=options, item_names=("state", "meta")
        )
        # The handlers the manager uses for these items, called directly by restore.
        self._state_handler = ocp.StandardCheckpointHandler()
        self._meta_handler = ocp.JsonCheckpointHandler()
        self._pending: int | None = None  # the step whose save may not have committed yet

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(
        self,
        step: int,
        state: Any,
        *,
        data_position: int,
        config: Config,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Start saving ``state`` (logical layout) as checkpoint ``step``; ``extra`` goes
        into ``meta`` beside the step, the data position and the config. With
        ``checkpoint.async_save`` the save commits in the background: :meth:`committed` says
        when. A save waits for the one before it to commit."""
        meta = {"step": int(step), "data_position": int(data_position), "config": config.to_dict()}
        meta.update(extra or {})
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )
        self._pending = int(step)

    def restore(
        self,
        abstract_state: Any,
        config: Config,
        step: int | None = None,
        *,
        warn: Callable[[str], None] | None = None,
    ):
        """Restore the newest usable checkpoint into the shardings of ``abstract_state``.

        Unusable newer steps are renamed aside with one warning line each; see the module
        docstring for the rules and for how several processes agree. Every process must
        call this.

        Args:
          abstract_state: pytree of ``jax.ShapeDtypeStruct`` with target shardings.
          config: the running config; its model section must match the checkpoint's.
          step: restore exactly this step, with no fallback; default the newest usable.
          warn: where warning lines go (default: stderr).

        Returns:
          ``(state, meta)``, or ``None`` when the directory holds no checkpoint.

        Raises:
          ConfigError: the checkpoint was written for a different model shape; or no
            checkpoint in the directory (or not ``step``) can be read.
        """
        warn = warn or _to_stderr
        listed = sorted(self.manager.all_steps(), reverse=True) if step is None else [step]
        unusable: list[tuple[int, str, list[int]]] = []  # step, my reason, failed processes
        below = None
        while True:
            # 1. the candidate: the newest step below the last one tried, on any process
            mine = next((s for s in listed if below is None or s < below), -1)
            candidate = max(_gather(mine))
            if candidate < 0:
                break
            # 2. every process reads it; 3. it is used only if every process could
            outcome, value = self._read(candidate, abstract_state, config)
            outcomes = _gather(outcome)
            if _WRONG_MODEL in outcomes:
                if outcome == _WRONG_MODEL:
                    raise value
                raise ConfigError(
                    f"checkpoint.dir={self.directory}: step {candidate} was written for "
                    "another model shape (another process says why)"
                )
            failed = [p for p, o in enumerate(outcomes) if o != _OK]
            if not failed:
                self._set_aside(unusable, candidate, warn)
                return value
            unusable.append((candidate, value if outcome != _OK else "", failed))
            del value  # a state read here but not elsewhere: free it before the next read
            below = candidate
            if step is not None:
                break
        if unusable:
            reasons = "; ".join(f"step {k}: {_why(why, failed)}" for k, why, failed in unusable)
            raise ConfigError(
                f"checkpoint.dir={self.directory}: no checkpoint in it can be restored "
                f"({reasons}); nothing was changed on disk: repair or move them, or point "
                "checkpoint.dir at an empty directory to start from scratch"
            )
        return None

    def _read(self, step: int, abstract_state: Any, config: Config) -> tuple[int, Any]:
        """Read one step on this process: ``(_OK, (state, meta))``, ``(_UNUSABLE, reason)``
        or ``(_WRONG_MODEL, ConfigError)``. Never raises for a damaged checkpoint."""
        path = self.path / str(step)
        item = "meta/metadata"
        try:
            meta = self._meta_handler.restore(path / "meta", args=ocp.args.JsonRestore())
            if meta.get("params_only"):
                raise ConfigError(
                    f"checkpoint.dir={self.directory}: step {step} holds parameters only "
                    f"(written by {meta.get('written_by', 'an import')}), nothing to resume; "
                    f"start from it with checkpoint.init_from={self.directory} and point "
                    "checkpoint.dir at another directory"
                )
            self._check_model(meta, config, step)
            item = "state"
            state = self._restore_state(path / "state", abstract_state)
            return _OK, (state, meta)
        except ConfigError as e:
            return _WRONG_MODEL, e
        except Exception as e:  # noqa: BLE001 (any failed read makes the step unusable)
            _quiet_abandoned_reads()
            return _UNUSABLE, f"{item}: {_reason(e, str(path))}"

    def _restore_state(self, path, abstract_state: Any) -> Any:
        """The ``state`` item into ``abstract_state``. A train state written before the
        skip counters existed (no ``skips`` in it) restores with them at zero."""
        try:
            return self._state_handler.restore(path, args=ocp.args.StandardRestore(abstract_state))
        except Exception:
            if not isinstance(abstract_state, TrainState) or abstract_state.skips is None:
                raise
            stored = self._state_handler.metadata(path).tree
            if stored.get("skips") is not None or "params" not in stored:
                raise
        names = [f.name for f in dataclasses.fields(TrainState) if f.name != "skips"]
        older = {name: getattr(abstract_state, name) for name in names}  # as it was saved
        state = self._state_handler.restore(path, args=ocp.args.StandardRestore(older))
        return TrainState(**state, skips=jax.tree.map(_zeros, abstract_state.skips))

    def _check_model(self, meta: dict, config: Config, step: int) -> None:
        saved_model = resolved_model(meta["config"]["model"])
        running_model = config.to_dict()["model"]
        for key in _SHAPE_KEYS:
            if saved_model.get(key) != running_model[key]:
                raise ConfigError(
                    f"model.{key}={running_model[key]}: checkpoint {self.directory}/{step} was "
                    f"written with model.{key}={saved_model.get(key)}; use another "
                    f"checkpoint.dir or set checkpoint.resume=false"
                )

    def _set_aside(self, unusable: list, resumed: int, warn: Callable[[str], None]) -> None:
        """Rename the unusable steps (process 0), wait for it, reload, and say so."""
        me = jax.process_index()
        for name in _unfinished_saves(self.path, resumed) if me == 0 else ():
            warn(
                f"warning: an unfinished save in {self.directory} is ignored "
                f"({name}, left by an interrupted save); resuming from step {resumed}"
            )
        if not unusable:
            return
        kept = {k: _rename_aside(self.path, k) for k, _, _ in unusable} if me == 0 else {}
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("holmes_jax: unusable checkpoints set aside")
        self.manager.reload()
        for k, why, failed in unusable:
            if me == 0:
                where = f"kept it as {kept[k]}" if kept[k] else "process 0 does not see it"
                warn(
                    f"warning: checkpoint step {k} in {self.directory} is unusable "
                    f"({_why(why, failed)}); {where}, resuming from step {resumed}"
                )
            elif why and 0 not in failed:
                warn(f"warning: process {me}: checkpoint step {k} is unusable ({why})")

    def committed(self, wait: bool = False) -> int | None:
        """The step of the last :meth:`save` once it has committed (a restart finds it), at
        most once per save; None while it is still being written, or when already told.
        ``wait``: wait for it to commit first."""
        if self._pending is None:
            return None
        if wait:
            self.manager.wait_until_finished()
        elif self.manager.is_saving_in_progress():
            return None
        step, self._pending = self._pending, None
        return step

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
        self._state_handler.close()


# --------------------------------------------------------------------------- parameters only


def resolved_model(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's ``model`` section with its defaults resolved as the running config's
    are (keys older checkpoints lack take their defaults: ``arch`` gpt2, ...)."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    try:
        model = ModelConfig(**{k: v for k, v in saved.items() if k in names})
    except (TypeError, ValueError):  # unreadable: compare as written
        return dict(saved)
    return plain(dataclasses.asdict(model))


def save_params(
    directory: str, params: Any, config: Config, *, extra: dict[str, Any] | None = None
) -> None:
    """Write ``params`` (logical layout; numpy or jax arrays) as step 0 of ``directory``,
    a parameters-only checkpoint (``meta``: ``params_only``, ``written_by`` and ``extra``).
    Waits for it."""
    ckpt = Checkpointer(CheckpointConfig(dir=directory, keep=1, async_save=False))
    try:
        ckpt.save(
            0,
            {"step": np.zeros((), np.int32), "params": params},
            data_position=0,
            config=config,
            extra={"params_only": True, "written_by": IMPORT_WRITER, **(extra or {})},
        )
    finally:
        ckpt.close()


IMPORT_WRITER = "python -m holmes_jax.hf import"


def find_step(path: str, key: str) -> tuple[str, dict[str, Any]]:
    """The step directory ``path`` names, and its ``meta``.

    Args:
      path: an import's output directory (its ``checkpoint``), a checkpoint directory (its
        newest committed step) or one step directory (holding ``state`` and ``meta``);
        local or ``gs://``.
      key: what the path is called in messages (``checkpoint.init_from``, ``CKPT_DIR``).

    Returns:
      (the step directory, local ones absolute; its ``meta``).

    Raises:
      ConfigError: no such directory, no step in it, or an unreadable ``meta``.
    """
    p = storage_path(path, key)
    if not p.is_dir():
        raise ConfigError(f"{key}={path}: no such directory")
    if not _is_step(p) and (p / "checkpoint").is_dir():
        p = p / "checkpoint"
    if not _is_step(p):
        steps = [k for k in committed_steps(p) if _is_step(p / str(k))]
        if not steps:
            raise ConfigError(
                f"{key}={path}: holds no checkpoint (a step directory with state and meta)"
            )
        p = p / str(max(steps))
    try:
        meta = json.loads((p / "meta" / "metadata").read_text())
        _ = meta["config"]["model"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{key}={path}: {p}/meta cannot be read ({_reason(e, str(p))})") from None
    return str(p), meta


def _is_step(path: epath.Path) -> bool:
    return (path / "state").is_dir() and (path / "meta").is_dir()


def read_params(
    step_dir: str,
    target: Any = None,
    *,
    key: str,
    saved_model: dict[str, Any] | None = None,
    running_model: dict[str, Any] | None = None,
) -> Any:
    """The parameters of one checkpoint step, restored alone (the fp32 ``master`` of a bf16
    run when it has one; a DiLoCo run's global model, ``outer.global``).

    Args:
      step_dir: a step directory (:func:`find_step`).
      target: pytree of ``jax.ShapeDtypeStruct`` with shardings to restore into (dtype
        converted on the way); None: host numpy arrays as stored.
      key: what the path is called in messages.
      saved_model, running_model: the two ``model`` sections, to say in which keys they
        differ when the shapes do.

    Raises:
      ConfigError: an unreadable checkpoint; a parameter of the target missing, extra, or
        of another shape there.
    """
    handler = ocp.PyTreeCheckpointHandler()
    state_dir = epath.Path(step_dir) / "state"
    try:
        stored = handler.metadata(state_dir).tree
        if (stored.get("outer") or {}).get("global"):  # DiLoCo: the global model
            part, sub = "outer", "global"
        else:
            part, sub = ("master" if stored.get("master") else "params"), None
        stored = stored[part] if sub is None else stored[part][sub]
    except Exception as e:  # noqa: BLE001 (any unreadable checkpoint is one line)
        raise ConfigError(f"{key}={step_dir}: cannot be read ({_reason(e, step_dir)})") from None
    if target is None:
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), stored)
        restore_args = jax.tree.map(
            lambda s: ocp.RestoreArgs(restore_type=np.ndarray, dtype=s.dtype), target
        )
    else:
        _check_params(stored, target, f"{key}={step_dir}", saved_model, running_model)
        restore_args = jax.tree.map(
            lambda s: ocp.ArrayRestoreArgs(
                sharding=s.sharding, dtype=s.dtype, global_shape=s.shape
            ),
            target,
        )
    item, args = ({part: target}, {part: restore_args})
    if sub is not None:
        item, args = ({part: {sub: target}}, {part: {sub: restore_args}})
    try:
        out = handler.restore(
            state_dir,
            args=ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True),
        )
    except Exception as e:  # noqa: BLE001
        _quiet_abandoned_reads()
        raise ConfigError(f"{key}={step_dir}: cannot be read ({_reason(e, step_dir)})") from None
    finally:
        handler.close()
    return out[part] if sub is None else out[part][sub]


def _check_params(stored: Any, target: Any, where: str, saved_model, running_model) -> None:
    """Every leaf of ``target`` is in ``stored`` with the same shape, and nothing more."""
    have, want = _by_name(stored), _by_name(target)
    differ = ""
    if saved_model is not None and running_model is not None:
        saved = resolved_model(saved_model)
        keys = [k for k in _SHAPE_KEYS if saved.get(k) != running_model.get(k)]
        differ = "; ".join(
            f"model.{k}={saved.get(k)} there, {running_model.get(k)} here" for k in keys
        )
        differ = f" ({differ})" if differ else ""
    for name, leaf in want.items():
        if name not in have:
            raise ConfigError(f"{where}: has no parameter {name}{differ}")
        if tuple(have[name].shape) != tuple(leaf.shape):
            raise ConfigError(
                f"{where}: parameter {name} is {list(have[name].shape)} there, "
                f"{list(leaf.shape)} in this run{differ}"
            )
    extra = sorted(set(have) - set(want))
    if extra:
        raise ConfigError(f"{where}: parameter {extra[0]} has no place in this run's model{differ}")


def _by_name(tree: Any) -> dict[str, Any]:
    """{"blocks.fc_kernel": leaf, ...} of a params tree."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(str(getattr(k, "key", k)) for k in path): leaf for path, leaf in flat}


def init_state_from(program: Program, path: str) -> tuple[TrainState, str]:
    """A fresh train state (step 0, fresh optimizer) with the parameters of a checkpoint or
    of a Hugging Face model directory, in the program's layout and shardings
    (``checkpoint.init_from``).

    A checkpoint's parameters are restored straight into the logical parameters' shardings
    in fp32. A Hugging Face directory (``config.json`` + safetensors, sharded or not) is
    imported on the fly as ``python -m holmes_jax.hf import`` does
    (:func:`~holmes_jax.runtime.hf.files.read_hf_for_run`, the whole model once in host
    memory), after its ``config.json`` is checked against the run's model section, and put
    into the same shardings. Then one jitted function builds the logical state
    (compute-dtype copies, optimizer moments, fp32 master for bf16) with its shardings, and
    the program converts it to its own layout (the pipeline's ``[stage, slot, ...]`` when
    it has one). Under DiLoCo every replica starts from these parameters, and so does the
    global model (:meth:`Program.fresh_state`).

    Returns:
      (state, the step directory or Hugging Face directory read).

    Raises:
      ConfigError: see :func:`find_step`, :func:`read_params` and
        :func:`~holmes_jax.runtime.hf.files.read_hf_for_run`.
    """
    key = "checkpoint.init_from"
    logical = program.abstract_logical_state
    # DiLoCo: the parameters without the per-replica axis (as the global model holds them)
    one = logical.outer["global"] if program.diloco else logical.params
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32, sharding=a.sharding), one
    )
    if is_hf_dir(path):
        source = os.path.abspath(os.path.expanduser(path))
        host = read_hf_for_run(source, program.cfg.model, key)  # numpy, logical layout
        _check_params(host, target, f"{key}={path}", None, None)
        params = jax.tree.map(_to_global, host, target)
        del host
    else:
        source, meta = find_step(path, key)
        params = read_params(
            source,
            target,
            key=key,
            saved_model=meta["config"]["model"],
            running_model=program.cfg.to_dict()["model"],
        )
    with program.context():
        state = jax.jit(program.fresh_state, out_shardings=program.shardings.logical_state)(params)
    return program.from_logical(state), source


def _to_global(host: np.ndarray, target: jax.ShapeDtypeStruct) -> jax.Array:
    """A host array (the same on every process) as a global array of ``target``'s dtype
    and sharding; each process puts only its own shards on its devices."""
    return jax.make_array_from_callback(
        target.shape, target.sharding, lambda index: np.asarray(host[index], target.dtype)
    )


def _quiet_abandoned_reads() -> None:
    """From now on, drop the tracebacks of the array reads orbax abandons on a failure.

    orbax 0.12 runs all array reads in an event loop that it closes as soon as one read
    fails (``asyncio_utils.run_sync``), leaving the others in flight. Each then prints a
    page-long traceback through ``sys.unraisablehook``, later, from another thread or at
    exit: the read's coroutine when collected (``_read_array_index_and_device_put``
    turns even GeneratorExit into an error) and tensorstore's callback into the closed
    loop (``RuntimeError: Event loop is closed``, no object). Those two, and only those,
    are dropped; everything else goes on to the hook installed before. Installed once,
    only after a read has failed.
    """
    previous = sys.unraisablehook
    if getattr(previous, "drops_abandoned_reads", False):
        return

    def hook(unraisable) -> None:
        what, exc = unraisable.object, unraisable.exc_value
        if getattr(what, "__qualname__", "") == "_read_array_index_and_device_put":
            return
        if what is None and isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        previous(unraisable)

    hook.drops_abandoned_reads = True
    sys.unraisablehook = hook
    gc.collect()  # the reads that are already finished go now


def _reason(e: BaseException, step_dir: str) -> str:
    """The root cause of a failed read as one short line, paths relative to the step."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    text = one_line(e).split(" [tensorstore_spec=")[0].split(" See full TensorStore")[0]
    text = f"{type(e).__name__}: {text.replace(step_dir + os.sep, '')}"
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 3] + "..."


def _why(reason: str, failed: list[int]) -> str:
    """This process's reason, or which other processes could not read the step."""
    if reason:
        return reason
    return f"unreadable on process(es) {', '.join(map(str, failed))}; their stderr says why"


def _rename_aside(directory: epath.Path, step: int) -> str:
    """``<dir>/<step>`` -> ``<dir>/<step>.corrupt`` (``-2``, ``-3``, ... if taken); returns
    the new path, or "" when the step directory is not there (another process's listing)."""
    source = directory / str(step)
    if not source.is_dir():
        return ""
    target, n = directory / f"{step}.corrupt", 1
    while target.exists():
        n += 1
        target = directory / f"{step}.corrupt-{n}"
    source.rename(target)
    return str(target)


def _unfinished_saves(directory: epath.Path, resumed: int) -> list[str]:
    """The leftovers of interrupted saves of steps after ``resumed``, by name: orbax's
    ``<k>.orbax-checkpoint-tmp-*`` on a local disk, a step without its commit file on GCS."""
    if not directory.is_dir():
        return []
    names = [p.name for p in directory.iterdir()]
    committed = set(committed_steps(directory))
    stems = {n: n.split(_UNFINISHED)[0] for n in names}
    return sorted(
        n
        for n, s in stems.items()
        if s.isdigit() and int(s) > resumed and (n != s or int(s) not in committed)
    )


def _zeros(abstract: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros of ``abstract``'s shape and dtype, in its sharding (every process its part)."""
    return jax.make_array_from_callback(
        abstract.shape,
        abstract.sharding,
        lambda index: np.zeros(abstract.shape, abstract.dtype)[index],
    )


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
