"""Non-finite steps: skipped on the device, counted in the state, stopped on the host.

A step is *non-finite* when its loss or its global gradient norm is not finite:
``ok = isfinite(loss) & isfinite(grad_norm)``. An inf or NaN anywhere in the gradients makes
the norm non-finite. Such a step

- leaves the parameters, the fp32 master and the AdamW state as they were
  (:func:`keep_finite`, inside the jitted step);
- still consumes its batch: ``TrainState.step``, the data position, advances;
- is counted in ``TrainState.skips`` (int32, checkpointed with the state): ``total``, the
  skipped steps since step 0, and ``run``, the skipped steps in a row up to this one
  (:func:`count_skips`). The step returns them as the metrics :data:`SKIPPED` and
  :data:`IN_A_ROW` (:func:`skip_metrics`).

Under DiLoCo (``[R]`` replicas in one program) ``ok`` and both counters are ``[R]`` over
``replica``: a replica skips alone and the others update.

On the host, :class:`SkipGuard` reads the counters a step late and logs skipped steps. More
than ``train.max_skipped_steps`` in a row raise
:class:`~holmes_jax.core.errors.NonFiniteError` (exit code 4).

Fault injection: ``train.inject_nonfinite_steps`` (:func:`inject_nonfinite`). DiLoCo's outer
step asks whether a replica skipped since a given point with :func:`skipped_so_far`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from holmes_jax.core.errors import NonFiniteError

SKIPPED = "skipped_steps"  # recorded: skipped steps since step 0, summed over replicas
IN_A_ROW = "skips_in_a_row"  # metric the guard reads and removes; not recorded
LINE_EVERY = 100  # steps between two skip lines, at least


# --------------------------------------------------------------------------- in the step


def fresh_skips(replicas: int = 0) -> dict[str, jax.Array]:
    """Zero counters: scalars, or ``[replicas]`` under DiLoCo (``replicas`` > 0)."""
    shape = (replicas,) if replicas else ()
    return {"total": jnp.zeros(shape, jnp.int32), "run": jnp.zeros(shape, jnp.int32)}


def count_skips(skips: dict[str, jax.Array], ok: jax.Array) -> dict[str, jax.Array]:
    """The counters after a step whose finiteness is ``ok`` (scalar or ``[R]``). ``run`` is
    0 after a step that updated."""
    return {
        "total": skips["total"] + (~ok).astype(jnp.int32),
        "run": jnp.where(ok, 0, skips["run"] + 1).astype(jnp.int32),
    }


def keep_finite(ok: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``ok``, else ``old``, leaf by leaf.

    Args:
      ok: bool, a scalar, or ``[R]`` (DiLoCo) for leaves with a leading ``[R]`` axis.
      new, old: trees of the same structure and shapes.

    Returns:
      The selected tree. A leaf with fewer dimensions than ``ok`` (DiLoCo's shared step
      counts) takes ``new``.
    """

    def pick(n, o):
        # AdamW's step counts are shared by the replicas and advance every step: keeping them
        # for one replica would need a collective across islands every step. A replica that
        # skipped keeps its moments; only its bias correction runs a step ahead.
        if n.ndim < ok.ndim:
            return n
        if ok.ndim and n.shape[: ok.ndim] != ok.shape:
            raise ValueError(f"keep_finite: leaf {n.shape} does not lead with {ok.shape}")
        # A select, not a product with ok: 0 * NaN = NaN would reach the state.
        return jnp.where(ok.reshape(ok.shape + (1,) * (n.ndim - ok.ndim)), n, o)

    return jax.tree.map(pick, new, old)


def inject_nonfinite(params: Any, step: jax.Array, steps: tuple[int, ...]) -> Any:
    """``params`` with the embedding multiplied by NaN when ``step`` (from 1) is one of
    ``steps``, by 1 otherwise (exact). Every activation, the loss and every gradient are
    then NaN. The caller keeps the unscaled ``params`` for the update."""
    bad = jnp.isin(step, jnp.asarray(steps, jnp.int32))
    scale = jnp.where(bad, jnp.nan, 1.0)
    embed = jax.tree.map(lambda w: w * scale.astype(w.dtype), params["embed"])
    return {**params, "embed": embed}


def skip_metrics(skips: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The step's metrics of the counters after it."""
    return {SKIPPED: skips["total"], IN_A_ROW: skips["run"]}


# --------------------------------------------------------------------------- on the host


def local_values(x: jax.Array) -> dict[int, float]:
    """``{replica: value}`` of the copies of ``x`` this process holds: a scalar is
    ``{0: value}``, an ``[R]`` array one entry per replica held here. Reads each distinct
    shard once; never a collective."""
    out: dict[int, float] = {}
    for shard in _distinct_shards(x):
        data = np.asarray(shard.data).reshape(-1)
        start = (shard.index[0].start or 0) if x.ndim else 0
        for j, v in enumerate(data):
            out[start + j] = v.item()
    return out


def skipped_so_far(state) -> dict[int, int]:
    """``{replica: steps skipped since step 0}`` that this process holds (``{0: n}`` without
    DiLoCo replicas): one device read of ``state.skips['total']``. A replica skipped a step
    between two points when the value grew. Read before the state is donated to the next
    step."""
    return {r: int(v) for r, v in local_values(state.skips["total"]).items()}


def _distinct_shards(x: jax.Array) -> list:
    seen, out = set(), []
    for shard in x.addressable_shards:
        key = tuple((s.start, s.stop) for s in shard.index)
        if key not in seen:
            seen.add(key)
            out.append(shard)
    return out


class SkipGuard:
    """Reads the step's skip counters a step late, says what was skipped, and stops the run
    after more than ``limit`` non-finite steps in a row.

    :func:`holmes_jax.runtime.loop.run` calls :meth:`after_step` once per step. The copy of
    step k's counters to the host starts at k and is read at k+1, so the device never waits
    for the host. Where the loop already waits (log steps, before every checkpoint save, the
    end), :meth:`settle` reads the step just run. No checkpoint is saved after a stop, and
    the stop line says which checkpoint holds the last good parameters.

    Args:
      limit: ``train.max_skipped_steps``.
      say: where the skip lines go (the metrics logger's ``message``).
      newest_checkpoint: () -> (the step of the newest checkpoint saved or resumed from, or
        None; the checkpoint directory, or None without checkpoints), for the stop line.
      agree: several processes that hold different replicas (DiLoCo): a process that sees
        the limit passed keeps stepping, and every process stops at the next
        :meth:`settle`, which they all call at the same steps.
      outer_sync: DiLoCo's outer steps also set the parameters, so the stop line names
        the skipped steps, not the step whose parameters are kept.
    """

    def __init__(
        self,
        limit: int,
        say: Callable[[str], None],
        newest_checkpoint: Callable[[], tuple[int | None, str | None]],
        *,
        agree: bool = False,
        outer_sync: bool = False,
    ):
        self.limit = limit
        self.say = say
        self.newest_checkpoint = newest_checkpoint
        self.agree = agree
        self.outer_sync = outer_sync
        self._pending: tuple[int, dict] | None = None  # a step whose counters are unread
        self._exceeded: tuple | None = None  # (step, replica, run, loss, grad norm)
        self._last_line: int | None = None  # the step of the last skip line
        self._hidden = 0  # skipped steps since that line, not shown

    def after_step(self, step: int, metrics: dict, *, done: bool = False) -> dict:
        """Note step ``step`` (1-based, just dispatched) and read the step before it.

        Args:
          step: the step's number.
          metrics: the step's metrics (device arrays).
          done: the caller already waited for the step: read it now.

        Returns:
          ``metrics`` without ``skips_in_a_row``.

        Raises:
          NonFiniteError: a step read here ended more than ``limit`` skips in a row.
        """
        metrics = dict(metrics)
        current = (step, {IN_A_ROW: metrics.pop(IN_A_ROW), **metrics})
        previous, self._pending = self._pending, current
        if previous is not None:
            self._read(*previous)
        if done:
            self._pending = None
            self._read(*current)
        else:
            for shard in _distinct_shards(current[1][IN_A_ROW]):
                shard.data.copy_to_host_async()
        return metrics

    def settle(self) -> None:
        """Read the step last noted (waiting for it). Every process calls it at the same
        steps: log steps, before a checkpoint save, at the end.

        Raises:
          NonFiniteError: more than ``limit`` skips in a row, here or (``agree``) on
            another process.
        """
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._read(*pending)
        if not self.agree:
            return
        from holmes_jax.cluster.distributed import any_process

        if any_process(self._exceeded is not None):
            if self._exceeded is None:
                raise NonFiniteError(
                    f"a replica held by another process had more than "
                    f"train.max_skipped_steps={self.limit} non-finite steps in a row (that "
                    "process's line names the step)"
                )
            raise NonFiniteError(self._stop_line(*self._exceeded))

    def _read(self, step: int, metrics: dict) -> None:
        runs = local_values(metrics[IN_A_ROW])
        skipped = {r: int(n) for r, n in runs.items() if n > 0}
        if not skipped:
            return
        loss, norm = local_values(metrics["loss"]), local_values(metrics["grad_norm"])
        total = local_values(metrics[SKIPPED])
        worst = max(skipped, key=skipped.get)
        several = metrics[IN_A_ROW].ndim > 0  # DiLoCo: name the replica
        if skipped[worst] > self.limit and self._exceeded is None:
            replica = worst if several else None
            self._exceeded = (step, replica, skipped[worst], loss[worst], norm[worst])
            if not self.agree:
                raise NonFiniteError(self._stop_line(*self._exceeded))
        # One line per skipped step, at most one per LINE_EVERY steps; the next line counts
        # the skips not shown.
        if self._last_line is not None and step - self._last_line < LINE_EVERY:
            self._hidden += 1
            return
        parts = [
            (f"replica {r}: " if several else "")
            + f"loss {loss[r]:.4g}, grad norm {norm[r]:.4g}, {int(total[r])} skipped so far, "
            f"{n} in a row"
            for r, n in sorted(skipped.items())
        ]
        hidden = (
            f"; {self._hidden} more since step {self._last_line} not shown" if self._hidden else ""
        )
        self.say(
            f"step {step}: non-finite, skipped (parameters and optimizer state unchanged): "
            + "; ".join(parts)
            + f" (train.max_skipped_steps={self.limit}){hidden}"
        )
        self._last_line, self._hidden = step, 0

    def _stop_line(self, step: int, replica: int | None, run: int, loss: float, norm: float) -> str:
        good = step - run  # the last step whose update was applied
        who = "" if replica is None else f"replica {replica}: "
        saved, directory = self.newest_checkpoint()
        if directory is None:
            where = "checkpoints are off (checkpoint.dir=null)"
        elif saved is None:
            where = f"no checkpoint was saved in {directory}"
        elif saved <= good or self.outer_sync:
            where = f"the newest checkpoint is step {saved} in {directory}"
        else:  # saved during the run of skips: the state had not changed since ``good``
            where = (
                f"the newest checkpoint, step {saved} in {directory}, holds them (steps "
                f"{good + 1}-{saved} were skipped)"
            )
        kept = (
            f"steps {good + 1}-{step} were skipped"
            if self.outer_sync  # an outer step may have set the parameters since ``good``
            else f"the parameters are those after step {good}"
        )
        return (
            f"step {step}: {who}{run} consecutive non-finite steps (loss {loss:.4g}, grad norm "
            f"{norm:.4g}) > train.max_skipped_steps={self.limit}; {kept}; {where}; a restart "
            "replays the same batches (lower optimizer.learning_rate, or raise "
            "train.max_skipped_steps to skip more)"
        )
