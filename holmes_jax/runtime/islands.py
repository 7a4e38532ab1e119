"""Independent DiLoCo islands (``diloco.mode: independent``): one job's side.

Each island of ``parallel.mesh`` (or each address of ``diloco.peers`` without a mesh) runs
as its own job: its own ``jax.distributed`` coordinator, its own plan on its own hardware
(:func:`holmes_jax.planner.grid.job_topology`), ``replica`` 1. Between jobs only the outer
sync runs (:mod:`holmes_jax.cluster.outer_sync`, HTTP), served by the job's process 0 at
``diloco.peers[diloco.island]``. ``python -m holmes_jax.launch --independent-islands``
starts one such job per island and sets ``diloco.island`` and ``diloco.peers``.

- Outputs (:func:`island_outputs`): the island's own run directory
  ``<train.run_dir>/<island>``; an explicit ``train.metrics_path`` ``M.jsonl`` becomes
  ``M.<island>.jsonl``, an explicit ``checkpoint.dir`` ``D`` becomes ``D/<island>``.
  Every metrics record names its island (``"island"``).
- Batch (:class:`Share`): island i trains on rows ``[offset_i, offset_i + rows_i)`` of
  each global batch, shares in proportion to the islands' compute
  (:func:`holmes_jax.planner.grid.island_batch_rows`); with equal shares those are the rows
  replica i trains on under ``spmd``. Evaluation covers the same windows as a whole-batch run.
- Outer step: after the steps where ``spmd`` takes one (each warm-up step, then every H),
  the job's fp32 parameters (the master under bf16), in the logical layout, go to process
  0's host, which calls :meth:`~holmes_jax.cluster.outer_sync.OuterSync.sync` with the
  tokens trained since its last round. The new global model comes back to every process
  and device as parameters and master; the AdamW moments and step count are kept, as
  under ``spmd``. So with nothing failing, fp32 and equal shares, the islands train what
  ``spmd`` trains.
- Overlap (``diloco.overlap_steps`` = τ > 0): after the warm-up (whose averaging rounds
  stay in step) each round goes out in a background thread while the next τ inner steps
  run; after them its result ``g`` is merged, ``θ ← g + (θ − θ_sent)`` (the progress since
  the send is kept), and the next round sends ``Δ = g − θ``, the progress since ``g``.
  After the last step the round is awaited and adopted, so the run ends on the global model.
- Start (:meth:`IslandSync.start`): a job that finds a live peer past round 0 heals from
  it: it adopts the global model, outer momentum and round bit for bit (no checkpoint
  read) and goes on at the step that round ended, with fresh AdamW moments and its step
  count set there. The heal runs in the background from the moment the peer is found
  (:meth:`IslandSync.peer_ahead`), while the job builds its state and compiles the train
  step, so the island starts its inner steps in step with its leader. Otherwise it starts
  from its own state: fresh, as round 0 of the global model, or from its own checkpoint
  with the outer state saved beside it (:meth:`IslandSync.save_outer`), so resuming
  across an outer step is exact (with ``diloco.overlap_steps`` a round in flight at the
  save is not part of it).
- Late: a round that came back as a later round (this island's delta missed its round)
  moves the island on to the step that round ended (with overlap, plus the steps since
  the send), as a heal does.

Several processes per island: each process reads the leaves it holds whole locally and
the sharded ones are gathered, so every process has the whole parameters; only process 0
talks to the peers, and the new global model is broadcast back.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any

import jax
import numpy as np
from etils import epath

from holmes_jax.cluster.distributed import barrier
from holmes_jax.cluster.outer_sync import OuterSync, SyncConfig, live_round, split_state, unpack
from holmes_jax.core.config import Config
from holmes_jax.planner.grid import island_batch_rows
from holmes_jax.planner.topology import load_topology
from holmes_jax.runtime.data import BatchSampler
from holmes_jax.runtime.diloco import due_fragments, in_warmup

PROBE_S = 1.0  # seconds to wait for a peer's /status at start
COMPILE_WAIT_S = 3600  # several processes: how long they wait for the slowest to compile
OUTER_DIR = "outer"  # beside the step directories of checkpoint.dir
OUTER_META = ("round", "tokens", "lineage", "parent", "fork_tokens")


def independent(cfg: Config) -> bool:
    """Whether ``cfg`` is one island's job of independent DiLoCo."""
    return cfg.diloco.mode == "independent"


def island_name(cfg: Config) -> str:
    """This job's island: its name in ``parallel.mesh``, else ``island<index>``."""
    if cfg.parallel.mesh:
        return load_topology(cfg.parallel.mesh).islands[cfg.diloco.island].name
    return f"island{cfg.diloco.island}"


def island_outputs(cfg: Config) -> Config:
    """``cfg`` with this island's own outputs (module doc); unchanged outside independent
    mode. Call before the run directory is chosen."""
    if not independent(cfg):
        return cfg
    name, train, ckpt = island_name(cfg), cfg.train, cfg.checkpoint
    run_dir = os.path.join(train.run_dir, name) if train.run_dir else train.run_dir
    metrics = train.metrics_path
    if metrics and metrics != "auto":
        metrics = f"{os.path.splitext(metrics)[0]}.{name}.jsonl"
    ckpt_dir = ckpt.dir
    if ckpt_dir and ckpt_dir != "auto":
        ckpt_dir = os.path.join(ckpt_dir, name)
    return cfg.replace(
        train=dataclasses.replace(train, run_dir=run_dir, metrics_path=metrics),
        checkpoint=dataclasses.replace(ckpt, dir=ckpt_dir),
    )


@dataclasses.dataclass(frozen=True)
class Share:
    """This island's part of each global batch: rows ``[offset, offset + rows)`` of
    ``total``."""

    island: int
    name: str
    offset: int
    rows: int
    total: int


def island_scope(cfg: Config) -> tuple[Config, Share]:
    """The island job's config (``replica`` 1, ``train.global_batch_size`` its rows) and
    its :class:`Share`."""
    rows = island_batch_rows(cfg)
    i = cfg.diloco.island
    share = Share(i, island_name(cfg), sum(rows[:i]), rows[i], cfg.train.global_batch_size)
    cfg = cfg.replace(
        parallel=dataclasses.replace(cfg.parallel, replica=1),
        train=dataclasses.replace(cfg.train, global_batch_size=share.rows),
    )
    return cfg, share


def share_sampler(tokens: np.ndarray, seq_len: int, share: Share, seed: int) -> BatchSampler:
    """The sampler of ``share``'s rows of the global batches (the same draws as a
    whole-batch run's)."""
    return BatchSampler(tokens, seq_len, share.total, seed, window=(share.offset, share.rows))


def eval_batch_count(share: Share, eval_batches: int) -> int:
    """How many eval batches of ``share.rows`` rows cover the windows of ``eval_batches``
    batches of the whole global batch (exact when the rows divide them)."""
    return max(1, share.total * eval_batches // share.rows)


def steps_after_round(rounds: int, inner_steps: int, warmup_steps: int) -> int:
    """The step count at which ``rounds`` outer steps are done (one per warm-up step, then
    one every ``inner_steps``)."""
    if rounds <= warmup_steps:
        return rounds
    return warmup_steps + (rounds - warmup_steps) * inner_steps


def _leaf_key(path) -> str:
    names = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    return "/".join(names) + "#0"  # one shard: the whole leaf


class IslandSync:
    """This job's end of the outer sync (module doc).

    Args:
      cfg: the island job's config (:func:`island_scope`'s).
      program: the job's program (``replica`` 1).
      share: this island's rows.
      say: prints one line (process 0's logger).
    """

    def __init__(self, cfg: Config, program, share: Share, say):
        self.cfg, self.program, self.share, self.say = cfg, program, share, say
        self.d = cfg.diloco
        self.peers = {i: _address(p) for i, p in enumerate(self.d.peers)}
        self.main = jax.process_index() == 0
        self.sync: OuterSync | None = None
        self.last_step = 0  # the step of this island's last round
        self.snap: dict[str, np.ndarray] = {}  # the global model the inner steps started from
        self.sent: dict[str, np.ndarray] = {}  # overlap: θ when the round in flight was sent
        self.pending: threading.Thread | None = None  # overlap: the round in flight
        self.result: Any = None  # overlap: its new global model (or its error)
        self.merge_at: int | None = None  # overlap: the step after which it is merged
        self.send_s = 0.0  # overlap: the training loop's seconds for the round in flight's send
        self.healing: threading.Thread | None = None  # a restart: the heal, from peer_ahead on
        self.healed: float | BaseException = 0.0  # its seconds (or its error)

    @property
    def name(self) -> str:
        return self.share.name

    def describe(self) -> str:
        """The line the run prints about this island."""
        sh, d = self.share, self.d
        warm = f" after {d.warmup_steps} warm-up averaging steps" if d.warmup_steps else ""
        return (
            f"diloco: independent island {sh.name} ({sh.island} of {len(d.peers)}): rows "
            f"{sh.offset}-{sh.offset + sh.rows - 1} of the {sh.total}-row global batch; outer "
            f"sync with its peers every {d.inner_steps} steps{warm} (outer lr {d.outer_lr}, "
            f"momentum {d.outer_momentum}, {d.outer_dtype}), served at "
            f"{d.peers[sh.island]}, quorum timeout {d.quorum_timeout_s:g} s"
        )

    # ---- start ------------------------------------------------------------------------

    def peer_ahead(self) -> bool:
        """Whether a live peer is past round 0 (process 0 asks, every process learns):
        then this island heals from it and reads no checkpoint. The heal (:meth:`start`)
        begins now, in the background, so its transfer overlaps the start-up and compile."""
        if jax.process_count() > 1:  # compiled, then in step: the first collectives follow
            self.program.compile_layout_conversions()
            barrier("holmes_jax/island_sync_compiled", COMPILE_WAIT_S)
        live = live_round(self.peers, self.share.island, PROBE_S) if self.main else 0
        if live > 0:
            self.sync = self._serve(None)
            self.healing = threading.Thread(target=self._heal, daemon=True)
            self.healing.start()
        return bool(self._broadcast(np.bool_(live > 0)))

    def _serve(self, state) -> OuterSync:
        return OuterSync(self.share.island, self.peers, SyncConfig.from_diloco(self.d), state)

    def _heal(self) -> None:
        began = time.monotonic()
        try:
            self.sync.join()
            self.healed = time.monotonic() - began
        except BaseException as err:  # noqa: BLE001 (raised in the training thread)
            self.healed = err

    def start(
        self, state, step: int, heal: bool, resumed_from: str | None, compile_step=None
    ) -> tuple[Any, int]:
        """Serve the outer sync. ``heal`` (:meth:`peer_ahead`): ``compile_step(state)``
        compiles the train step (every process), then the island waits for the heal begun
        in :meth:`peer_ahead` and adopts a live peer's round, global model and momentum,
        in step with the peer (module doc); else the outer state saved with checkpoint
        ``step`` in ``resumed_from`` (:meth:`save_outer`), or the global model starts from
        ``state``. Returns the state and step to train from."""
        took = compiled = 0.0
        theta = None if heal else self._theta(state)  # a gather: every process takes part
        if heal and compile_step is not None:  # compiled before the island is in step
            began = time.perf_counter()
            compile_step(state)
            compiled = time.perf_counter() - began
        if self.main and heal:
            self.healing.join()
            took = self.healed
            if isinstance(took, BaseException):
                raise took
            self.snap = dict(self.sync.glob)
        elif self.main:
            saved = load_outer(resumed_from, step) if resumed_from else None
            if resumed_from and saved is None:
                self.say(
                    f"diloco: no outer state saved with checkpoint step {step}: the global "
                    "model restarts from this island's parameters, outer momentum zero"
                )
            outer, meta = saved or ((theta, _zeros(theta)), {})
            self.snap = theta
            self.sync = self._serve(outer)
            self.sync.round = steps_to_rounds(step, self.d.inner_steps, self.d.warmup_steps)
            for key, value in meta.items():  # round, tokens, lineage, parent, fork_tokens
                setattr(self.sync, key, value)
        if not heal:
            self.last_step = step
            return state, step
        rounds = int(self._broadcast(np.int32(self.sync.round if self.main else 0)))
        step = steps_after_round(rounds, self.d.inner_steps, self.d.warmup_steps)
        glob = self.sync.glob if self.main else None
        state = self._with_global(state, glob, step)
        self.last_step = step
        self.say(
            f"diloco: healed from a live peer in {took:.1f} s (train step compiled meanwhile in "
            f"{compiled:.1f} s): round {rounds} taken in step with it, the global model and "
            f"outer momentum adopted (no checkpoint read); training on from step {step} with "
            "fresh AdamW moments"
        )
        return state, step

    # ---- the outer step ---------------------------------------------------------------

    def after_step(self, state, step: int) -> tuple[Any, int]:
        """The outer step when one follows inner step ``step``, and with
        ``diloco.overlap_steps`` the merge of the round sent that many steps before.
        Returns the state and the step count to go on from: ``step``, or later when a
        round came back as a later one (this island's delta missed its round): the island
        goes on at the step that round ended (plus the steps since the send, with
        overlap), as a healed island does."""
        if self.merge_at is not None and step >= self.merge_at:
            state, step = self._merge(state, step)
        if not due_fragments(step, self.d.inner_steps, 1, self.d.warmup_steps):
            return state, step
        began = _settled(state)
        average = in_warmup(step, self.d.warmup_steps)
        theta = self._theta(state)
        tokens = (step - self.last_step) * self.share.rows * self.cfg.model.seq_len
        self.last_step = step
        if self.d.overlap_steps and not average:  # warm-up averaging stays in step
            return self._send_overlapped(state, step, theta, tokens, began)
        glob, ended, line = None, step, ""
        if self.main:
            glob = self.sync.sync(theta, tokens, average=average)
            self.snap = glob  # the next inner steps start from it
            ended = self._round_end()
            line = self._round_line(step, average)
        moved = self._moved_on(state, glob, step, ended)
        if self.main:
            self.say(f"{line} ({time.perf_counter() - began:.2f} s{_late(step, ended)})")
        return moved

    def _round_end(self) -> int:
        """The step at which this island's current round ended."""
        return steps_after_round(self.sync.round, self.d.inner_steps, self.d.warmup_steps)

    def _moved_on(self, state, glob, step: int, ended: int) -> tuple[Any, int]:
        """``state`` with process 0's ``glob`` and, when process 0's ``ended`` is past
        ``step``, the step count moved on to it (the last round's step by as much)."""
        ended = max(step, int(self._broadcast(np.int32(ended))))
        self.last_step += ended - step
        return self._with_global(state, glob, ended if ended > step else None), ended

    def _send_overlapped(self, state, step: int, theta, tokens: int, began: float):
        """Send ``Δ = θ_base − θ`` (the progress since the last merge) in the background;
        the merge follows ``overlap_steps`` steps later, or now after the last step.
        ``began``: when the training loop stopped for this send (its time is reported
        with the merge)."""
        if self.main:
            self.sent = theta
            delta = {k: self.snap[k] - theta[k] for k in theta}
            self.pending = threading.Thread(target=self._send, args=(delta, tokens), daemon=True)
            self.pending.start()
        self.send_s = time.perf_counter() - began
        self.merge_at = step + self.d.overlap_steps
        if step >= self.cfg.train.steps:  # the end: one global model, nothing in flight
            return self._merge(state, step)
        return state, step

    def _merge(self, state, step: int) -> tuple[Any, int]:
        """``θ ← g + (θ − θ_sent)``: the round's global model plus the progress since its
        send; the next round's progress counts from ``g``."""
        began = _settled(state)
        theta = self._theta(state)
        merged, ended, sent, line = None, step, self.merge_at - self.d.overlap_steps, ""
        if self.main:
            waited = time.perf_counter()
            glob = self._await_pending()
            waited = time.perf_counter() - waited
            merged = {k: glob[k] + (theta[k] - self.sent[k]) for k in theta}
            self.snap = glob
            ended = self._round_end() + step - sent
            line = f"{self._round_line(step, False)} (sent after step {sent}, merged now"
            line += f"{_late(step, ended)}; send {self.send_s:.2f} s, merge "
        self.merge_at = None
        moved = self._moved_on(state, merged, step, ended)
        if self.main:
            took = time.perf_counter() - began
            self.say(f"{line}{took:.2f} s of which {waited:.2f} s waiting for the round)")
        return moved

    def _send(self, delta, tokens: int) -> None:
        try:
            self.result = self.sync.sync_delta(delta, tokens)
        except BaseException as err:  # noqa: BLE001 (raised in the training thread)
            self.result = err

    def _await_pending(self) -> dict:
        self.pending.join()
        self.pending, result = None, self.result
        if isinstance(result, BaseException):
            raise result
        return result

    def _round_line(self, step: int, average: bool) -> str:
        kind = "averaging (warm-up)" if average else "outer"
        with self.sync.cond:  # a background round may be closing
            rounds, members = self.sync.round, sorted(self.sync.members)
        return f"diloco: {kind} step after step {step}: round {rounds}, islands {members}"

    def save_outer(self, directory: str, step: int) -> None:
        """Process 0: the outer state (:meth:`OuterSync.snapshot`: global model, momentum,
        round, tokens, lineage) beside checkpoint ``step``, as ``<directory>/outer/<step>.npz``
        (written whole, then renamed), so a resume without a live peer continues the global
        model exactly."""
        if not self.main:
            return
        body = self.sync.snapshot()
        folder = epath.Path(directory) / OUTER_DIR
        folder.mkdir(parents=True, exist_ok=True)
        part = folder / f"{step}.npz.partial"
        with part.open("wb") as f:
            f.write(body)
        part.rename(folder / f"{step}.npz")

    def eval_params(self, state):
        """The global model in the program's layout (what evaluation runs on, as under
        ``spmd``): after an outer step the island's own parameters are that model."""
        glob = None
        if self.main:
            with self.sync.cond:  # a background round may be closing
                glob = dict(self.sync.glob)
        return self._with_global(state, glob, None).params

    def close(self) -> None:
        """Stop serving (the peers see this island as gone)."""
        if self.sync is not None:  # peers still fetching the last result get it
            self.sync.close(grace_s=self.d.quorum_timeout_s)

    # ---- device <-> host --------------------------------------------------------------

    def _theta(self, state) -> dict[str, np.ndarray]:
        """The fp32 parameters (master under bf16), logical layout, whole, on every host."""
        host = _gather(self.program.model_to_logical(state))
        return {_leaf_key(p): np.asarray(v, np.float32) for p, v in _flat(host)}

    def _with_global(self, state, glob: dict[str, np.ndarray] | None, step: int | None):
        """``state`` with parameters and master set to ``glob`` (process 0's, broadcast);
        with ``step``, the step and the optimizer's step counts set to it too."""
        shardings = self.program.logical_model_sharding()
        shapes = jax.tree.leaves(self.program.abstract_logical_state.params)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(shardings)
        if self.main:
            host = [glob[_leaf_key(path)] for path, _ in leaves]
        else:
            host = [np.zeros(a.shape, np.float32) for a in shapes]
        host = self._broadcast(host)  # one collective for the whole model
        new = treedef.unflatten(
            [
                jax.make_array_from_callback(a.shape, sharding, lambda i, h=h: h[i])
                for (_, sharding), a, h in zip(leaves, shapes, host, strict=True)
            ]
        )
        return self.program.with_logical_model(state, new, step)

    def _broadcast(self, value):
        """Process 0's ``value`` (an array or a list of arrays) on every process."""
        if jax.process_count() == 1:
            return value
        from jax.experimental import multihost_utils

        out = multihost_utils.broadcast_one_to_all(value)
        return [np.asarray(v) for v in out] if isinstance(value, list) else np.asarray(out)


def _settled(state) -> float:
    """The time once ``state``'s step has finished computing (its dispatch returned
    before), so that what follows is timed without it."""
    jax.block_until_ready(state)
    return time.perf_counter()


def _late(step: int, ended: int) -> str:
    return f"; late: a later round adopted, on from step {ended}" if ended > step else ""


def steps_to_rounds(step: int, inner_steps: int, warmup_steps: int) -> int:
    """The outer steps done by step ``step`` (inverse of :func:`steps_after_round` at round
    boundaries)."""
    if step <= warmup_steps:
        return step
    return warmup_steps + (step - warmup_steps) // inner_steps


def load_outer(directory: str, step: int):
    """:meth:`IslandSync.save_outer`'s ``((global, momentum), meta)`` for ``step``, or None."""
    path = epath.Path(directory) / OUTER_DIR / f"{step}.npz"
    if not path.exists():
        return None
    meta, arrays = unpack(path.read_bytes())
    return split_state(arrays), {k: meta[k] for k in OUTER_META}


def _address(peer: str) -> tuple[str, int]:
    host, _, port = peer.rpartition(":")
    return host, int(port)


def _zeros(tree: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.zeros_like(v) for k, v in tree.items()}


def _gather(tree):
    """``tree`` whole on this host as numpy: a leaf this process holds whole (fully
    addressable, or replicated on every device) is read locally; the others come in one
    gather across processes (every process calls this with the same tree)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out = [_local(x) for x in leaves]  # None: sharded across processes
    spread = [x for x, o in zip(leaves, out, strict=True) if o is None]
    if spread:
        from jax.experimental import multihost_utils

        gathered = iter(multihost_utils.process_allgather(spread, tiled=True))
        out = [np.asarray(next(gathered)) if o is None else o for o in out]
    return treedef.unflatten(out)


def _local(x) -> np.ndarray | None:
    """``x`` whole from this process's devices, or None if other processes hold parts."""
    if x.is_fully_addressable:
        return np.asarray(x)
    if x.sharding.is_fully_replicated:
        return np.asarray(x.addressable_shards[0].data)
    return None


def _flat(tree):
    return jax.tree_util.tree_flatten_with_path(tree)[0]
