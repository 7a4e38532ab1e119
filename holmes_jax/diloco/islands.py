"""Independent DiLoCo islands (``diloco.mode: independent``): one job's side.

Each island of ``parallel.mesh`` (or each entry of ``diloco.peers`` without a mesh) runs
as its own job: its own ``jax.distributed`` coordinator, its own plan on its own hardware
(:func:`holmes_jax.planner.grid.job_topology`), ``replica`` 1. Between jobs only the outer
sync runs (:mod:`holmes_jax.diloco.sync`, HTTP), served by the job's processes at the
addresses of ``diloco.peers[diloco.island]``, one lane each (:mod:`holmes_jax.diloco.lanes`);
process 0 (lane 0) sets the island's step and prints its lines.
``python -m holmes_jax.launch --independent-islands`` starts one such job per island and
sets ``diloco.island`` and ``diloco.peers``.

- Which island, its outputs and its rows of each batch: :mod:`holmes_jax.diloco.scope`.
  Every metrics record names its island (``"island"``).
- Outer step (:meth:`IslandSync.after_step`): after each step where ``spmd`` takes one, the
  fp32 parameters go to the lanes, each of which calls
  :meth:`~holmes_jax.diloco.sync.OuterSync.sync`; the new global model comes back as
  parameters and master. With ``diloco.fragments`` F > 1 (streaming) each round carries
  one fragment's pieces (:mod:`~holmes_jax.diloco.schedule`,
  :mod:`~holmes_jax.diloco.lanes`) and only those parameters take the global model. The
  AdamW moments and step count are kept, so with nothing failing, fp32 and equal shares,
  the islands train what ``spmd`` trains.
- Overlap (``diloco.overlap_steps``): :meth:`IslandSync._send_overlapped`.
- Start (:meth:`IslandSync.start`): heal from a live peer past round 0, else resume from this
  island's own checkpoint and outer state (:meth:`IslandSync.save_outer`), else fresh.
- Late and abstaining islands: :meth:`IslandSync.after_step`, :meth:`IslandSync._diverged`.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
from etils import epath

from holmes_jax.cluster.distributed import barrier
from holmes_jax.core.config import Config
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.keyfile import read_key
from holmes_jax.diloco.lanes import LaneLayout, process_lanes
from holmes_jax.diloco.messages import Expect, finite
from holmes_jax.diloco.outer_files import OUTER_DIR, load_outer, save_lane
from holmes_jax.diloco.rounds import SyncConfig
from holmes_jax.diloco.schedule import Schedule, in_warmup, key_fragment
from holmes_jax.diloco.scope import Share
from holmes_jax.diloco.sync import OuterSync, Shards
from holmes_jax.diloco.transport import Security, client_context, live_round, server_context

PROBE_S = 1.0  # seconds to wait for a peer's /status at start
COMPILE_WAIT_S = 3600  # several processes: how long they wait for the slowest to compile


class IslandSync:
    """This job's end of the outer sync (module doc): one
    :class:`~holmes_jax.diloco.sync.OuterSync` per lane this process serves.

    Args:
      cfg: the island job's config (:func:`island_scope`'s).
      program: the job's program (``replica`` 1).
      share: this island's rows.
      say: prints one line (process 0's logger).

    Raises:
      ConfigError: the island's process count does not divide the lanes of ``diloco.peers``.
    """

    def __init__(self, cfg: Config, program, share: Share, say):
        self.cfg, self.program, self.share, self.say = cfg, program, share, say
        self.d = cfg.diloco
        self.schedule = Schedule.of(self.d)
        islands = self.d.lane_addresses()
        self.lanes = len(islands[0])
        mine = process_lanes(self.lanes, jax.process_count(), jax.process_index())
        # lane -> every island's address of it, by island index
        self.peers = {lane: {i: lanes[lane] for i, lanes in enumerate(islands)} for lane in mine}
        self.main = jax.process_index() == 0  # serves lane 0, speaks for the island
        self.syncs: dict[int, OuterSync] = {}  # this process's lanes
        self.last_step = 0  # the step of this island's last round (of any fragment)
        self.snap: Shards = {}  # the global model the inner steps started from (own lanes)
        self.sent: Shards = {}  # overlap: θ when the round in flight was sent
        self.pending: threading.Thread | None = None  # overlap: the round in flight
        self.result: Any = None  # overlap: its new global model (or its error)
        self.merge_at: int | None = None  # overlap: the step after which it is merged
        self.send_s = 0.0  # overlap: the training loop's seconds for the round in flight's send
        self.healing: threading.Thread | None = None  # a restart: the heal, from peer_ahead on
        self.healed: float | BaseException = 0.0  # its seconds (or its error)
        self.security = security(self.d)
        self.skipped = 0  # the state's skipped steps at the last round (abstain when it grows)
        self.counted = (0, 0)  # the lanes' (sent, received) bytes when the last round ended
        self.round_bytes: tuple[int, int] | None = None  # the rounds' since the last report

    @property
    def name(self) -> str:
        return self.share.name

    @functools.cached_property
    def layout(self) -> LaneLayout:
        """The reshard between the program's logical model and this process's blocks."""
        sharding = self.program.logical_model_sharding()
        abstract = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, np.float32, sharding=s),
            self.program.abstract_logical_state.params,
            sharding,
        )
        devices = self.program.mesh.devices.flat
        return LaneLayout(devices, abstract, sharding, self.lanes, self.d.fragments)

    @property
    def sync(self) -> OuterSync:
        """Lane 0's sync (process 0): its round is the island's."""
        return self.syncs[0]

    def describe(self) -> str:
        """The line the run prints about this island."""
        sh, d, lanes = self.share, self.d, self.lanes
        warm = f" after {d.warmup_steps} warm-up averaging steps" if d.warmup_steps else ""
        if d.fragments > 1:
            warm += f", one of {d.fragments} fragments every {d.round_gap()}+ steps"
        split = ""
        if lanes > 1:
            split = f" in {lanes} lanes, {len(self.peers)} per process"
        return (
            f"diloco: independent island {sh.name} ({sh.island} of {len(d.peers)}): rows "
            f"{sh.offset}-{sh.offset + sh.rows - 1} of the {sh.total}-row global batch; outer "
            f"sync with its peers every {d.inner_steps} steps{warm} (outer lr {d.outer_lr}, "
            f"momentum {d.outer_momentum}, {d.outer_dtype}), served at "
            f"{d.peers[sh.island]}{split}, quorum timeout {d.quorum_timeout_s:g} s"
        )

    # ---- start ------------------------------------------------------------------------

    def peer_ahead(self) -> bool:
        """Whether a live peer is past round 0 (process 0 asks, every process learns):
        then this island heals from it and reads no checkpoint. The heal (:meth:`start`)
        begins now, in the background on every lane, so its transfer overlaps the start-up
        and the compile of the layout conversions (several processes: then every process
        waits for the others, so that the collectives after it start together)."""
        several = jax.process_count() > 1
        if several:  # in step for the first collective, the broadcast below
            barrier("holmes_jax/island_sync_started", COMPILE_WAIT_S)
        live = 0
        if self.main:  # lane 0's peers: process 0 serves it
            live = live_round(self.peers[0], self.share.island, PROBE_S, self.security)
        heal = bool(self._broadcast(np.bool_(live > 0)))
        if heal:  # the transfer needs no device: it runs while the programs compile
            self.syncs = {lane: self._serve(lane, None) for lane in self.peers}
            self.healing = threading.Thread(target=self._heal, daemon=True)
            self.healing.start()
        if several:  # a program's first collective waits only 30 s for its peers
            self.program.compile_layout_conversions()
            self.layout.compile()
            barrier("holmes_jax/island_sync_compiled", COMPILE_WAIT_S)
        return heal

    @functools.cached_property
    def _sync_config(self) -> SyncConfig:
        """The protocol's settings; a round counts at most the global batch's tokens over
        ``inner_steps``."""
        round_tokens = self.d.inner_steps * self.share.total * self.cfg.model.seq_len
        return SyncConfig.from_diloco(self.d, round_tokens)

    def _expect(self, lane: int) -> Expect:
        """What this island takes from its peers (and its own saved files) on ``lane``."""
        shapes = {k: v for k, v in self.layout.block_shapes().items() if _lane(k) == lane}
        return self._sync_config.expect(shapes, range(len(self.d.peers)))

    def _serve(self, lane: int, state, residual: Shards | None = None) -> OuterSync:
        """Lane ``lane``'s protocol, served at this island's address of it.

        Raises:
          ConfigError: this process cannot listen there (another host's address: lane
            addresses are fixed for the run, so an island that lost that host for good
            cannot serve the lane).
        """
        shapes = self._expect(lane).shapes
        say = self.say if self.main else _stderr(f"process {jax.process_index()}: ")
        try:
            return OuterSync(
                self.share.island,
                self.peers[lane],
                self._sync_config,
                state,
                shapes=shapes,
                security=self.security,
                say=say,
                residual=residual,
            )
        except OSError as err:
            host, port = self.peers[lane][self.share.island]
            raise ConfigError(
                f"diloco.peers[{self.share.island}]: lane {lane}'s address {host}:{port} "
                f"cannot be served by process {jax.process_index()} ({err.strerror}); each "
                "process serves its lanes at its own host's addresses"
            ) from err

    def _heal(self) -> None:
        began = time.monotonic()
        try:
            self._each(lambda lane, sync: sync.join())
            self.healed = time.monotonic() - began
        except BaseException as err:  # noqa: BLE001 (raised in the training thread)
            self.healed = err

    def start(
        self, state, step: int, heal: bool, resumed_from: str | None, compile_step=None
    ) -> tuple[Any, int]:
        """Serve the outer sync. ``heal`` (:meth:`peer_ahead`): ``compile_step(state)``
        compiles the train step (every process), then the island waits for the heal begun
        in :meth:`peer_ahead` and adopts a live peer's round, global model and momentum bit
        for bit, in step with the peer, with no checkpoint read; it goes on at the step that
        round ended, with fresh AdamW moments and the step count set there. Else the outer
        state saved with checkpoint ``step`` in ``resumed_from`` (:meth:`save_outer`), or
        the global model starts from ``state``. Returns the state and step to train from."""
        if not heal:
            self._start_own(state, step, resumed_from)
            return state, step
        compiled = 0.0
        if compile_step is not None:  # compiled before the island is in step
            began = time.perf_counter()
            compile_step(state)
            compiled = time.perf_counter() - began
        self.healing.join()
        took = self.healed
        if isinstance(took, BaseException):
            raise took
        self.snap = self._glob()
        rounds = int(self._broadcast(np.int32(self.sync.round if self.main else 0)))
        step = self.schedule.step_of(rounds)
        state = self._with_global(state, self.snap, step)
        self.last_step = step
        self.skipped = self._skipped(state)
        self.say(
            f"diloco: healed from a live peer in {took:.1f} s (train step compiled meanwhile in "
            f"{compiled:.1f} s): round {rounds} taken in step with it, the global model and "
            f"outer momentum adopted (no checkpoint read); training on from step {step} with "
            "fresh AdamW moments"
        )
        return state, step

    def _start_own(self, state, step: int, resumed_from: str | None) -> None:
        """Serve from this island's own state: the outer state saved with checkpoint
        ``step`` when every lane of the island has it, else ``state`` as the global model
        with outer momentum zero."""
        theta = self._theta(state)  # a reshard: every process takes part
        saved = {
            lane: load_outer(resumed_from, step, lane, self._expect(lane)) for lane in self.peers
        }
        found = self._everywhere(None not in saved.values()) if resumed_from else False
        if resumed_from and not found:
            self.say(
                f"diloco: no outer state saved with checkpoint step {step}: the global "
                "model restarts from this island's parameters, outer momentum zero"
            )
        rounds = self.schedule.rounds_by(step)
        for lane in self.peers:
            own = self._part(theta, lane)
            outer, meta = saved[lane] if found else ((own, _zeros(own)), {})
            sync = self.syncs[lane] = self._serve(lane, outer, meta.pop("residual", None))
            sync.r.restore({"round": rounds, **meta})  # round, tokens, lineage, parent, fork
        self.snap = theta
        self.last_step = step
        self.skipped = self._skipped(state)

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
        if not self.schedule.due(step):
            return state, step
        began = _settled(state)
        average = in_warmup(step, self.d.warmup_steps)
        theta = self._theta(state)
        rnd = self.schedule.rounds_by(step)
        tokens = self.schedule.span(rnd) * self.share.rows * self.cfg.model.seq_len
        abstain = self._diverged(state, theta, step)
        self.last_step = step
        theta_f = self._fragment(theta, rnd)  # what this round carries
        if self.d.overlap_steps and not average:  # warm-up averaging stays in step
            return self._send_overlapped(state, step, theta_f, tokens, began, abstain)
        if abstain:  # it sends nothing; the new global model replaces its parameters
            parts = self._each(lambda lane, sync: sync.abstain(average))
        else:
            parts = self._each(
                lambda lane, sync: sync.sync(self._part(theta_f, lane), tokens, average=average)
            )
        union = _union(parts)  # abstain: the whole global model replaces the parameters
        fresh = union if abstain else {k: union[k] for k in theta_f}
        self.snap.update(fresh)  # the global model the round's next inner steps start from
        glob = {**theta, **fresh}  # the other fragments keep their progress
        self._count_round()
        ended, line = step, ""
        if self.main:
            ended = self._round_end()
            line = self._round_line(step, average)
        moved = self._moved_on(state, glob, step, ended)
        if self.main:
            self.say(f"{line} ({time.perf_counter() - began:.2f} s{_late(step, ended)})")
        return moved

    def _diverged(self, state, theta: Shards, step: int) -> bool:
        """Whether the inner steps since the last round skipped a non-finite step or left
        non-finite parameters, on any process of the island, or a test told it to
        (``diloco.inject_abstain_steps``): then it abstains
        (:meth:`~holmes_jax.diloco.sync.OuterSync.abstain`) and its parameters become the
        new global model; says so in one line."""
        skipped = self._skipped(state)
        since, self.skipped = skipped - self.skipped, skipped
        bad_theta = not all(finite(v) for v in theta.values())
        told = any(self.last_step < s <= step for s in self.d.inject_abstain_steps)
        if self._everywhere(not (since or bad_theta or told)):
            return False
        if self.main:
            why = f"{since} non-finite step(s) skipped" if since else "non-finite parameters"
            why = "diloco.inject_abstain_steps" if told else why
            self.say(
                f"diloco: island {self.name}: {why} since step {self.last_step}: it sends "
                "nothing this round and takes the global model from its peers"
            )
        return True

    @staticmethod
    def _skipped(state) -> int:
        """The non-finite steps ``state`` has skipped so far (a replicated scalar)."""
        return int(np.asarray(state.skips["total"].addressable_shards[0].data))

    def _round_end(self) -> int:
        """The step at which this island's current round (lane 0's) ended."""
        return self.schedule.step_of(self.sync.round)

    def _fragment(self, tree: Shards, rnd: int) -> Shards:
        """``tree``'s blocks that round ``rnd`` carries (every block in a warm-up round or
        with one fragment)."""
        fragment = self.schedule.fragment(rnd)
        if fragment is None or self.d.fragments == 1:
            return tree
        return {k: v for k, v in tree.items() if key_fragment(k) == fragment}

    def _moved_on(
        self, state, glob: Shards, step: int, ended: int, add: bool = False
    ) -> tuple[Any, int]:
        """``state`` with every process's ``glob`` (``add``: added to its model) and, when
        process 0's ``ended`` is past ``step``, the step count moved on to it (the last
        round's step by as much)."""
        ended = max(step, int(self._broadcast(np.int32(ended))))
        self.last_step += ended - step
        return self._with_global(state, glob, ended if ended > step else None, add), ended

    def _send_overlapped(
        self, state, step: int, theta: Shards, tokens: int, began: float, abstain: bool
    ):
        """Send ``Δ = θ_base − θ`` (the progress since the last merge) in the background
        while the next ``overlap_steps`` inner steps run (after the warm-up only); the merge
        (:meth:`_merge`) follows then, or now after the last step.
        ``began``: when the training loop stopped for this send (its time is reported
        with the merge). ``abstain``: send nothing; the merge then takes the global model
        alone (the progress since the send started from a non-finite state)."""
        self.sent = None if abstain else theta
        delta = None if abstain else {k: self.snap[k] - theta[k] for k in theta}
        self.pending = threading.Thread(target=self._send, args=(delta, tokens), daemon=True)
        self.pending.start()
        self.send_s = time.perf_counter() - began
        self.merge_at = step + self.d.overlap_steps
        if step >= self.cfg.train.steps:  # the end: one global model, nothing in flight
            return self._merge(state, step)
        return state, step

    def _merge(self, state, step: int) -> tuple[Any, int]:
        """``θ ← g + (θ − θ_sent)``: the round's global model plus the progress since its
        send, computed on the devices as ``θ + (g − θ_sent)`` (θ stays there), on the keys
        the round carried; the next round's progress counts from ``g``."""
        began = _settled(state)
        ended, sent, line = step, self.merge_at - self.d.overlap_steps, ""
        waited = time.perf_counter()
        glob = self._await_pending()
        waited = time.perf_counter() - waited
        self._count_round()
        abstained = self.sent is None
        shift = glob  # abstained: the global model replaces the parameters
        if not abstained:  # the fragments not in the round shift by nothing
            shift = {
                k: glob[k] - self.sent[k] if k in self.sent else np.zeros_like(g)
                for k, g in glob.items()
            }
            glob = {k: glob[k] for k in self.sent}
        self.snap.update(glob)
        if self.main:
            ended = self._round_end() + step - sent
            line = f"{self._round_line(step, False)} (sent after step {sent}, merged now"
            line += f"{_late(step, ended)}; send {self.send_s:.2f} s, merge "
        self.merge_at = None
        moved = self._moved_on(state, shift, step, ended, add=not abstained)
        if self.main:
            took = time.perf_counter() - began
            self.say(f"{line}{took:.2f} s of which {waited:.2f} s waiting for the round)")
        return moved

    def _count_round(self) -> None:
        """The bytes this process's lanes sent and received since the last round ended
        (counted at the transport: bodies and their trailers, in both roles)."""
        totals = [sync.traffic.totals() for sync in self.syncs.values()]
        now = (sum(t[0] for t in totals), sum(t[1] for t in totals))
        last = self.round_bytes or (0, 0)  # not reported yet (a record skipped): added
        self.round_bytes = (last[0] + now[0] - self.counted[0], last[1] + now[1] - self.counted[1])
        self.counted = now

    def report(self) -> dict[str, int]:
        """``outer_bytes_sent`` and ``outer_bytes_received`` of the rounds ended since the
        last report, summed over the island's processes (every process calls it, at the
        same records): on the first record after a round only."""
        if self.round_bytes is None:
            return {}
        counts, self.round_bytes = self.round_bytes, None
        if jax.process_count() > 1:  # int32 pieces: jax's arrays hold no int64 by default
            from jax.experimental import multihost_utils

            pieces = np.array([[n >> 30, n & (1 << 30) - 1] for n in counts], np.int32)
            every = np.asarray(multihost_utils.process_allgather(pieces)).astype(np.int64)
            counts = tuple(int(n) for n in (every[..., 0] << 30 | every[..., 1]).sum(axis=0))
        return {"outer_bytes_sent": counts[0], "outer_bytes_received": counts[1]}

    def _send(self, delta: Shards | None, tokens: int) -> None:
        try:
            if delta is None:
                parts = self._each(lambda lane, sync: sync.abstain())
            else:
                send = lambda lane, sync: sync.sync_delta(self._part(delta, lane), tokens)  # noqa: E731
                parts = self._each(send)
            self.result = _union(parts)
        except BaseException as err:  # noqa: BLE001 (raised in the training thread)
            self.result = err

    def _await_pending(self) -> Shards:
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
        """Every process: the outer state of each of its lanes (:meth:`OuterSync.snapshot`:
        global model, momentum, round, tokens, lineage) beside checkpoint ``step``, as
        ``<directory>/outer/<step>.lane<l>.outer`` (:mod:`~holmes_jax.diloco.wire`'s
        format; written whole, then renamed), and with ``outer_dtype`` sparse the lane's
        error-feedback buffer as ``<step>.lane<l>.residual``, so a resume without a live
        peer continues the global model, and what the island has not sent yet, exactly.
        With ``diloco.overlap_steps`` a round in flight at the save is not part of it."""
        folder = epath.Path(directory) / OUTER_DIR
        folder.mkdir(parents=True, exist_ok=True)
        for lane, sync in self.syncs.items():
            kept = None
            if sync.feedback is not None:
                with sync.cond:
                    kept = dict(sync.feedback.buffers)
            save_lane(folder, step, lane, sync.snapshot(), kept)

    def eval_params(self, state):
        """The global model in the program's layout (what evaluation runs on, as under
        ``spmd``): after an outer step the island's own parameters are that model."""
        return self._with_global(state, self._glob(), None).params

    def close(self) -> None:
        """Stop serving (the peers see this island as gone)."""
        for sync in self.syncs.values():  # peers still fetching the last result get it
            sync.close(grace_s=self.d.quorum_timeout_s)

    # ---- lanes ------------------------------------------------------------------------

    def _each(self, fn) -> dict[int, Any]:
        """``fn(lane, sync)`` for every lane of this process, at once (each may wait on
        its peers); the results by lane. The first error is raised."""
        if len(self.syncs) == 1:
            ((lane, sync),) = self.syncs.items()
            return {lane: fn(lane, sync)}
        results: dict[int, Any] = {}

        def one(lane, sync):
            try:
                results[lane] = fn(lane, sync)
            except BaseException as err:  # noqa: BLE001 (raised below)
                results[lane] = err

        threads = [
            threading.Thread(target=one, args=item, daemon=True) for item in self.syncs.items()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for value in results.values():
            if isinstance(value, BaseException):
                raise value
        return results

    def _part(self, tree: Shards, lane: int) -> Shards:
        """``tree``'s blocks of ``lane`` (keyed :func:`~holmes_jax.diloco.lanes.lane_key`)."""
        if len(self.peers) == 1:
            return tree
        return {k: v for k, v in tree.items() if _lane(k) == lane}

    def _glob(self) -> Shards:
        """The global model's blocks of this process's lanes."""
        glob: Shards = {}
        for sync in self.syncs.values():
            with sync.cond:  # a background round may be closing
                glob.update(sync.glob)
        return glob

    # ---- device <-> host --------------------------------------------------------------

    def _theta(self, state) -> Shards:
        """This process's blocks of the fp32 parameters (master under bf16), logical
        layout; every process calls it."""
        return self.layout.to_host(self.program.model_to_logical(state))

    def _with_global(self, state, glob: Shards, step: int | None, add: bool = False):
        """``state`` with parameters and master set from every process's blocks ``glob``
        (``add``: to the fp32 model plus ``glob``); with ``step``, the step and the
        optimizer's step counts set to it too."""
        model = self.layout.from_host(glob)
        if add:
            model = self.layout.add(self.program.model_to_logical(state), model)
        return self.program.with_logical_model(state, model, step)

    def _broadcast(self, value):
        """Process 0's ``value`` (an array) on every process."""
        if jax.process_count() == 1:
            return value
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.broadcast_one_to_all(value))

    def _everywhere(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every process of the island."""
        if jax.process_count() == 1:
            return flag
        from jax.experimental import multihost_utils

        return bool(np.min(multihost_utils.process_allgather(np.int32(flag))))


def _settled(state) -> float:
    """The time once ``state``'s step has finished computing (its dispatch returned
    before), so that what follows is timed without it."""
    jax.block_until_ready(state)
    return time.perf_counter()


def _late(step: int, ended: int) -> str:
    return f"; late: a later round adopted, on from step {ended}" if ended > step else ""


def security(d) -> Security:
    """The shared key and TLS contexts of a ``diloco`` section (checked when it loaded)."""
    key = read_key(d.sync_key_file) if d.sync_key_file else None
    if d.tls_cert is None:
        return Security(key)
    return Security(
        key,
        server_context(d.tls_cert, d.tls_key, d.tls_ca),
        client_context(d.tls_cert, d.tls_key, d.tls_ca),
    )


def _lane(key: str) -> int:
    """The lane of a block's key (:func:`~holmes_jax.diloco.lanes.lane_key`)."""
    return int(key.rpartition("#")[2])


def _stderr(prefix: str):
    return lambda line: print(prefix + line, file=sys.stderr, flush=True)


def _zeros(tree: Shards) -> Shards:
    return {k: np.zeros_like(v) for k, v in tree.items()}


def _union(parts: dict[int, Shards]) -> Shards:
    out: Shards = {}
    for part in parts.values():
        out.update(part)
    return out
