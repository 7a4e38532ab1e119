"""Orbax checkpoints: asynchronous, keep-last-N, resumed from the newest usable one.

A checkpoint at step k is a directory ``<checkpoint.dir>/<k>/`` holding two items:

- ``state``: the train state in its *logical* (mesh-independent) layout: parameters with
  blocks stacked ``[L, ...]``, the optimizer state mirroring them, and the step. Orbax
  writes each process's own shards and restores into whatever shardings the new run asks
  for, so a run may resume on another mesh.
- ``meta``: JSON (``meta/metadata``) with the step, the data position (the number of
  batches consumed; batches are a pure function of (seed, step)), and the full config.

Saves are asynchronous: ``save`` returns once the arrays are copied off the devices and
the write continues in the background; :meth:`Checkpointer.close` waits for it.

Resuming past a damaged checkpoint (:meth:`Checkpointer.restore`)
------------------------------------------------------------------

Restoring step k reads it in full: ``meta`` (and its model shape is checked), then every
array of ``state``. A read that fails (a file truncated or deleted by a crash, a full
disk or a bad copy: invalid JSON, a missing ``_METADATA`` or manifest, a short array
file) makes k *unusable*, and restore tries the next older step. Once one succeeds:

- every unusable newer step is renamed ``<dir>/<k>.corrupt`` (``.corrupt-2``, ... when
  taken): kept for inspection, never deleted. Orbax only counts integer names as steps,
  so the renamed one neither counts towards ``checkpoint.keep`` nor collides with the
  re-save of step k; later saves and keep-last-N go on as before;
- one warning line per unusable step goes to stderr: the step, what was wrong (the
  error folded to one line, naming the item and the array, file or JSON position), where
  it was kept, and the step the run resumes from. Only the steps after that one are lost,
  and recomputing them reproduces them exactly (batches depend on (seed, step) only).

A save interrupted mid-write never becomes a step at all: orbax writes into
``<k>.orbax-checkpoint-tmp-*`` and renames on commit. Such a leftover newer than the
restored step gets a one-line note too (it is left where it is, untouched).

When no checkpoint is usable, restore raises a one-line :class:`ConfigError` naming the
directory and each step's error, and changes nothing on disk. It does not start from
scratch, because what a user with a checkpoint directory expects is their run back, not a
new one: (1) all of several checkpoints unreadable at once is rarely bit rot; it is a
wrong or half-mounted directory, a filesystem outage or a changed state layout, which a
person must look at before compute is spent; (2) a fresh run there would throw away all
the training those checkpoints hold, and its own saves would then collide with the old
step numbers (orbax refuses to overwrite a step) or be pruned by keep-last-N in favour
of the higher-numbered unreadable ones. An empty or missing directory is the normal first
start: restore returns None and the run starts fresh.

A checkpoint written for another model shape is a ConfigError at once, never a fallback:
every older step in the same directory would be the same mistake.

Several processes
-----------------

The directory must be shared, but each process reads only its own shards, so one process
can fail on a step that another reads without error. The decision cannot diverge:

1. agree on the candidate: the newest step below the last one tried that any process
   lists (an all-gather of one integer);
2. every process reads it with orbax's item handlers directly; they hold no barrier
   (``CheckpointManager.restore`` ends in one), so a process that fails never leaves the
   others waiting inside orbax;
3. all-gather every process's outcome: the step is used only if all read it.

Process 0 alone renames the unusable steps and prints the summary (a process whose own
read failed when process 0's did not prints its own error); a barrier, then every process
reloads its list of steps.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from holmes_jax.core.config import CheckpointConfig, Config
from holmes_jax.core.errors import ConfigError, one_line

_OK, _UNUSABLE, _WRONG_MODEL = 0, 1, 2  # outcome of reading one step on one process
_SHAPE_KEYS = ("vocab_size", "seq_len", "num_layers", "num_heads", "hidden_size")
_SHAPE_KEYS += ("mlp_ratio", "tied_embeddings")
_REASON_CHARS = 240  # an error's text is cut here, so that a warning stays one short line
_UNFINISHED = ".orbax-checkpoint-tmp"  # orbax's suffix for a save not yet committed


class Checkpointer:
    """Thin wrapper over ``ocp.CheckpointManager`` for one run directory."""

    def __init__(self, cfg: CheckpointConfig):
        if not cfg.dir:
            raise ValueError("Checkpointer needs checkpoint.dir")
        self.cfg = cfg
        self.directory = os.path.abspath(cfg.dir)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            create=True,
            enable_async_checkpointing=cfg.async_save,
        )
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta")
        )
        # The handlers the manager uses for these items, called directly by restore.
        self._state_handler = ocp.StandardCheckpointHandler()
        self._meta_handler = ocp.JsonCheckpointHandler()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, *, data_position: int, config: Config) -> None:
        """Start saving ``state`` (logical layout) as checkpoint ``step``."""
        meta = {"step": int(step), "data_position": int(data_position), "config": config.to_dict()}
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )

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
        path = epath.Path(self.directory) / str(step)
        item = "meta/metadata"
        try:
            meta = self._meta_handler.restore(path / "meta", args=ocp.args.JsonRestore())
            self._check_model(meta, config, step)
            item = "state"
            state = self._state_handler.restore(
                path / "state", args=ocp.args.StandardRestore(abstract_state)
            )
            return _OK, (state, meta)
        except ConfigError as e:
            return _WRONG_MODEL, e
        except Exception as e:  # noqa: BLE001 (any failed read makes the step unusable)
            _quiet_abandoned_reads()
            return _UNUSABLE, f"{item}: {_reason(e, str(path))}"

    def _check_model(self, meta: dict, config: Config, step: int) -> None:
        saved_model = meta["config"]["model"]
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
        for name in _unfinished_saves(self.directory, resumed) if me == 0 else ():
            warn(
                f"warning: an unfinished save in {self.directory} is ignored "
                f"({name}, left by an interrupted save); resuming from step {resumed}"
            )
        if not unusable:
            return
        kept = {k: _rename_aside(self.directory, k) for k, _, _ in unusable} if me == 0 else {}
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

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
        self._state_handler.close()


def _gather(value: int) -> list[int]:
    """``value`` from every process, in process order: the same list on all of them."""
    if jax.process_count() == 1:
        return [int(value)]
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.asarray(value, np.int32))
    return [int(v) for v in np.ravel(gathered)]


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


def _rename_aside(directory: str, step: int) -> str:
    """``<dir>/<step>`` -> ``<dir>/<step>.corrupt`` (``-2``, ``-3``, ... if taken); returns
    the new path, or "" when the step directory is not there (another process's listing)."""
    source = os.path.join(directory, str(step))
    if not os.path.isdir(source):
        return ""
    target, n = f"{source}.corrupt", 1
    while os.path.exists(target):
        n += 1
        target = f"{source}.corrupt-{n}"
    os.rename(source, target)
    return target


def _unfinished_saves(directory: str, resumed: int) -> list[str]:
    """orbax's leftovers of interrupted saves of steps after ``resumed``, by name."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    stems = {n: n.split(_UNFINISHED)[0] for n in names if _UNFINISHED in n}
    return sorted(n for n, s in stems.items() if s.isdigit() and int(s) > resumed)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
