"""The outer sync's state and round logic, pure: no sockets, no threads, no clock.

One :class:`Rounds` per island and lane holds what the protocol of
:mod:`holmes_jax.diloco.sync` keeps: the outer state (``glob``, ``mom``: fp32 shards keyed
``"<leaf path>#<lane>"``), its history (``round``, ``tokens``, ``lineage``, ``parent``,
``fork_tokens``, ``merged``), the group (``leader``, ``members``) and, on a leader, the
round being collected (``open``: island -> its checked :class:`~holmes_jax.diloco.messages.Delta`).
Its methods take checked messages (:mod:`holmes_jax.diloco.messages`) and the time where a
rule needs it; the caller holds the lock that guards it. So every rule of membership,
quorum, merge and lineage is tested here without a socket.

The mean of a round (:meth:`Rounds.close`): ``Δ̄ = Σ tokens_i·Δ_i / Σ tokens_i`` over the
islands that sent a delta (an abstaining island counts for nothing; all tokens zero: the
plain mean), on the round's keys (its fragment's: :mod:`~holmes_jax.diloco.schedule`),
encoded in ``outer_dtype``; every member takes the step with its decoded value
(:meth:`Rounds.apply`). A round that no island contributed to takes a zero
averaging step: the model and momentum stay as they are.

A merge (:meth:`Rounds.merge`) weighs each lineage by its tokens since the common point;
the joiner's weight is at most ``(rounds since the fork + 2) · round_tokens`` (counted by
this island's round: no lineage can have trained more than every island's share of each
round since), else the join is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from holmes_jax.diloco import sparse
from holmes_jax.diloco.codec import decode, encode_tree, nesterov
from holmes_jax.diloco.messages import (
    Delta,
    Expect,
    Join,
    Refused,
    State,
    Step,
    fork_round,
    relay_key,
    weighted_mean,
)
from holmes_jax.diloco.schedule import Schedule
from holmes_jax.diloco.sparse import Sparse, nonzero
from holmes_jax.diloco.wire import pack, packed_size

Shards = dict[str, np.ndarray]
ROUNDS_KEPT = 4  # rounds whose participants and acknowledgements are remembered
META_BYTES = 1 << 16  # JSON meta besides the per-key scales a body may carry


@dataclass(frozen=True)
class SyncConfig:
    """The outer step's parameters (from the ``diloco`` section) and the protocol's timing.

    ``round_tokens``: the most tokens one round can count (the global batch's tokens over
    ``diloco.inner_steps`` steps), the bound on a delta's ``tokens``.
    """

    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_dtype: str = "fp32"
    quorum_timeout_s: float = 60.0
    probe_s: float = 1.0  # seconds to wait for a peer's /status or a connection
    # seconds after a round's first delta that the leader still waits for members whose
    # port refuses connections (their process is down); inf: as long as for a silent one
    down_wait_s: float = 0.0
    round_tokens: int = 1 << 40
    reply_timeout_s: float | None = None  # a socket silent this long ends (None: the quorum's)
    sparse: Sparse | None = None  # outer_dtype sparse: its chunk, k and bits
    schedule: Schedule = Schedule()  # which fragment each round carries

    @property
    def silence_s(self) -> float:
        """Seconds a peer's socket may stay silent before its request or reply ends."""
        return self.quorum_timeout_s if self.reply_timeout_s is None else self.reply_timeout_s

    def expect(self, shapes: dict[str, tuple[int, ...]], islands) -> Expect:
        """What an island with these settings takes from its peers on a lane of
        ``shapes``, among ``islands``."""
        return Expect(
            shapes=dict(shapes),
            outer_dtype=self.outer_dtype,
            islands=frozenset(islands),
            round_tokens=self.round_tokens,
            lr=self.outer_lr,
            mu=self.outer_momentum,
            sparse=self.sparse,
            schedule=self.schedule,
        )

    @classmethod
    def from_diloco(cls, diloco, round_tokens: int, probe_s: float = 1.0) -> SyncConfig:
        """The protocol's settings from a run's ``diloco`` section."""
        return cls(
            outer_lr=diloco.outer_lr,
            outer_momentum=diloco.outer_momentum,
            outer_dtype=diloco.outer_dtype,
            quorum_timeout_s=diloco.quorum_timeout_s,
            down_wait_s=diloco.down_wait_s,
            probe_s=min(probe_s, diloco.quorum_timeout_s),
            round_tokens=round_tokens,
            sparse=(
                Sparse(diloco.sparse_chunk, diloco.sparse_k, diloco.sparse_bits)
                if diloco.outer_dtype == "sparse"
                else None
            ),
            schedule=Schedule.of(diloco),
        )


class Rounds:
    """One island's protocol state on one lane (module doc).

    Args:
      island: this island's index.
      islands: every configured island's index.
      cfg: the outer step and timing.
      state: ``(global, momentum)`` fp32 shards to start from; None for a restarted island
        (not ``ready`` until it adopts a peer's state).
      shapes: the lane's keys and shapes, what peers' messages must hold; by default the
        shapes of ``state`` (required without one).
    """

    def __init__(self, island: int, islands, cfg: SyncConfig, state, shapes=None):
        self.island, self.cfg = island, cfg
        self.glob: Shards = {}
        self.mom: Shards = {}
        self.round, self.tokens, self.lineage, self.fork_tokens = 0, 0, "root", 0
        self.parent = ""  # the lineage this one forked from ("" for root)
        self.leader, self.members = min(islands), set(islands)
        self.merged: set[str] = set()  # lineages merged into this one
        self.open: dict[int, Delta] = {}  # the round being collected
        self.first_arrival: float | None = None
        self.average = False  # the open round is a warm-up averaging round
        self.joined: set[int] = set()  # joined during the open round
        self.dead: set[int] = set()  # reported dead during the open round
        self.excused: set[int] = set()  # refused during the open round: alive, not waited for
        self.down: set[int] = set()  # the open round's missing members whose port refuses
        self.awaiting: set[int] = set()  # joined to take the open round's result in step
        # the last round's step: (base key, meta, arrays, the deltas it relays by island)
        self.step: tuple[str, dict, Shards, dict[int, Shards]] | None = None
        self.bodies: dict[int | None, bytes] = {}  # its packed bodies (relay: per asker)
        self.took: dict[int, set[int]] = {}  # round -> its participants but this island
        self.fetched: dict[int, set[int]] = {}  # round -> islands that acknowledged it
        if state is not None:
            self.glob = {k: np.array(v, np.float32) for k, v in state[0].items()}
            self.mom = {k: np.array(v, np.float32) for k, v in state[1].items()}
        self.ready = state is not None
        if state is None and shapes is None:
            raise ValueError("a restarted island (no state) needs its lane's shapes")
        own = {k: v.shape for k, v in self.glob.items()}
        self.expect = cfg.expect(shapes if shapes is not None else own, islands)

    def max_body(self, path: str) -> int:
        """The most body bytes a POST to ``path`` may carry: the lane's arrays in the wire
        dtype (a delta) or fp32 (a join's global model), with their meta."""
        ex = self.expect
        if path == "/delta":
            entries = ex.delta_entries()
        elif path == "/join":
            entries = [(k, "float32", shape) for k, shape in ex.shapes.items()]
        else:
            return 0
        return packed_size(META_BYTES + 64 * len(entries), entries)

    def max_reply(self) -> int:
        """The most body bytes a peer's reply may carry: a lane's whole state in fp32 (the
        answer to a join, the largest there is), with its meta."""
        shapes = self.expect.shapes.items()
        entries = [(f"{p}/{k}", "float32", shape) for p in "gm" for k, shape in shapes]
        return packed_size(META_BYTES + 64 * len(entries), entries)

    def carries(self, rnd: int, values: Shards) -> bool:
        """Whether round ``rnd`` carries exactly the keys of ``values`` (its fragment's)."""
        return values.keys() == self.expect.for_round(rnd).shapes.keys()

    def key(self) -> str:
        """What names this island's global model: lineage, round and tokens (a merge
        changes the tokens), as sent with ``/result?have=``."""
        return f"{self.lineage};{self.round};{self.tokens}"

    def restore(self, meta: dict) -> None:
        """Take saved history (``round``, ``tokens``, ``lineage``, ``parent``,
        ``fork_tokens``) with the state given at construction."""
        for key in ("round", "tokens", "lineage", "parent", "fork_tokens"):
            if key in meta:
                setattr(self, key, meta[key])

    # ---- the leader's side ---------------------------------------------------------------

    def accept(self, delta: Delta, now: float) -> bool:
        """Take ``delta`` into the open round; False (refused): another lineage, not the
        open round, or not ready."""
        if delta.lineage != self.lineage or delta.round != self.round + 1 or not self.ready:
            return False
        if self.first_arrival is None:
            self.first_arrival = now
        self.open[delta.island] = delta
        self.average = delta.average
        self.dead |= set(delta.dead) - {self.island}
        return True

    def absent(self, island: int) -> None:
        """``island``'s delta was refused while a round is open: the round does not wait
        for it (it takes the result as a late island does). Between rounds: nothing."""
        if self.open and island != self.island:
            self.dead.add(island)
            self.excused.add(island)  # alive: still a member of the next round

    def is_late(self, delta: Delta) -> bool:
        """Whether a refused ``delta`` was for a round of this lineage already closed."""
        return delta.lineage == self.lineage and delta.round <= self.round

    def missing(self) -> set[int]:
        """The members the open round still waits for (none when no round is open)."""
        return self.members - self.dead - set(self.open) if self.open else set()

    def due(self, now: float) -> bool:
        """Whether the open round closes now: every member in, or the quorum timeout
        passed since the first delta, or every missing member is :attr:`down` and
        ``down_wait_s`` passed. Members that are not in leave the next round's members."""
        if not self.open:
            return False
        waiting, since = self.missing(), now - self.first_arrival
        if not waiting or since >= self.cfg.quorum_timeout_s:
            return True
        return waiting <= self.down and since >= self.cfg.down_wait_s

    def close(self) -> None:
        """Average the deltas token-weighted, encode the mean in ``outer_dtype``, take the
        step with its decoded value (:meth:`apply`, as every member will), and name the
        next round's members and leader."""
        sent = {i: d for i, d in self.open.items() if d.values is not None}
        weights = {i: d.tokens for i, d in sent.items()}
        total = sum(weights.values())
        average = self.average or not sent  # nothing sent: a zero averaging step
        keys = self.expect.for_round(self.round + 1).shapes  # the round's fragment
        means = {k: np.zeros_like(self.glob[k]) for k in keys}
        if sent:
            means = weighted_mean({i: d.values for i, d in sent.items()}, weights, keys)
        relayed = {i: d.parts for i, d in sent.items()}
        arrays, encoding = self._encode_step(means, relayed)
        if encoding.get("encoding") == "relay":
            encoding["weights"] = {str(i): w for i, w in weights.items()}
        else:
            relayed = {}
        self.members = set(self.open) | self.joined | self.excused
        self.leader = min(self.members)
        meta = {"round": self.round + 1, "tokens": self.tokens + total, "average": average}
        meta.update(encoding, lr=self.cfg.outer_lr, mu=self.cfg.outer_momentum)
        meta.update(leader=self.leader, members=sorted(self.members))
        base = self.key()
        values = means if relayed else self._decode_step(arrays, meta)
        self.apply(
            Step(
                meta["round"], meta["tokens"], average, self.leader, frozenset(self.members), values
            )
        )
        self.step = (base, {**meta, "kind": "step"}, arrays, relayed)
        self.bodies = {}
        self.took[self.round] = (set(self.open) | self.awaiting) - {self.island}
        self.clear()
        self.awaiting = set()
        for old in (self.took, self.fetched):
            old.pop(self.round - ROUNDS_KEPT, None)

    def step_body(self, asker: int) -> bytes:
        """The last round's step, packed for island ``asker``: a relay step leaves out
        ``asker``'s own delta (it holds what it sent). Packed once for every asker it
        serves alike."""
        _, meta, arrays, relayed = self.step
        who = asker if relayed else None
        if who not in self.bodies:
            if relayed:
                arrays = {
                    relay_key(i, name): a
                    for i, parts in sorted(relayed.items())
                    if i != asker
                    for name, a in parts.items()
                }
            self.bodies[who] = pack(meta, arrays)
        return self.bodies[who]

    def _encode_step(self, means: Shards, relayed: dict[int, Shards | None]) -> tuple[Shards, dict]:
        """A step's arrays and their meta: ``means`` in ``outer_dtype``; for sparse, the
        smallest of: the islands' deltas relayed as they were sent (``relayed``: every
        island then takes the same weighted mean of the same decoded values), every
        nonzero of the mean (:func:`~holmes_jax.diloco.sparse.nonzero`), or the mean
        dense in the expected dense dtype."""
        dense = self.expect.dense_dtype
        arrays, scales = encode_tree(means, dense)
        if self.cfg.outer_dtype != "sparse":
            return arrays, {"scales": scales}
        size = lambda tree: sum(a.nbytes for a in tree.values())  # noqa: E731
        candidates = [(size(arrays), arrays, {"encoding": dense, "scales": scales})]
        if relayed and None not in relayed.values():  # what one island fetches, at most
            relay = sum(size(p) for p in relayed.values()) - min(map(size, relayed.values()))
            candidates.append((relay, {}, {"encoding": "relay"}))
        parts = sparse.join({k: nonzero(avg, self.cfg.sparse) for k, avg in means.items()})
        candidates.append((size(parts), parts, {"encoding": "sparse"}))
        _, arrays, meta = min(candidates, key=lambda c: c[0])  # the first of equal sizes
        return arrays, meta

    def _decode_step(self, arrays: Shards, meta: dict) -> Shards:
        """The values of :meth:`_encode_step`'s output, decoded as every member decodes
        them (the same functions, after their checks)."""
        if meta.get("encoding") != "sparse":
            return {k: decode(a, meta["scales"][k]) for k, a in arrays.items()}
        sp, shapes = self.cfg.sparse, self.expect.for_round(meta["round"]).shapes
        by_key = sparse.split(arrays, shapes, sp, sp.step_bits)
        return {k: sparse.decode(by_key[k], shape, sp, sp.step_bits) for k, shape in shapes.items()}

    def clear(self) -> None:
        """No round open: no deltas, arrivals, joiners or dead reported."""
        self.open, self.first_arrival, self.joined, self.dead = {}, None, set(), set()
        self.excused, self.down = set(), set()

    def merge(self, join: Join) -> None:
        """Merge a joiner's lineage token-weighted into this one, once (module doc).

        Raises:
          Refused: the joiner claims more tokens since the fork than the rule allows.
        """
        if not join.weight or join.lineage == self.lineage or join.lineage in self.merged:
            return
        # the common point: where the younger of the two lineages forked from the other
        younger = self.lineage if join.lineage == self.parent else join.lineage
        common = self.fork_tokens if join.lineage == self.parent else join.fork_tokens
        w_j = max(join.tokens - common, 0)
        w_p = max(self.tokens - common, 0)
        most = (max(self.round - fork_round(younger), 0) + 2) * self.cfg.round_tokens
        if w_j > most:
            raise Refused(
                f"tokens={join.tokens}: {w_j} since the fork at round {fork_round(younger)}, "
                f"more than {most} ((rounds since + 2) x {self.cfg.round_tokens} a round)"
            )
        if w_j <= 0:
            return
        for k in self.glob:
            merged = (w_p * self.glob[k] + w_j * join.glob[k]) / (w_p + w_j)
            self.glob[k] = merged.astype(np.float32)
        self.tokens += w_j
        self.merged.add(join.lineage)

    def register(self, join: Join) -> int | None:
        """Add a joiner to the group. Between rounds it is a member at once; during one,
        or when it waits for the next result (``join.next``: then in step, the round's
        close waits for its acknowledgement), not waited for until the round after.
        Returns the round whose result it is to fetch (``join.next``), else None."""
        (self.joined if self.open or join.next else self.members).add(join.island)
        if not join.next:
            return None
        self.members.discard(join.island)  # a restart may still be a member: it sends nothing
        self.awaiting.add(join.island)
        return self.round + 1

    def acknowledged(self, island: int, rnd: int) -> None:
        self.fetched.setdefault(rnd, set()).add(island)

    def unacknowledged(self, rnd: int) -> set[int]:
        """Round ``rnd``'s other participants that have not acknowledged its result."""
        return self.took.get(rnd, set()) - self.fetched.get(rnd, set())

    # ---- every member's side -------------------------------------------------------------

    def apply(self, step: Step) -> None:
        """Take a round's step from this island's state of the round before: the same
        arithmetic on every member, so they stay equal bit for bit."""
        for k, avg in step.values.items():
            if step.average:  # warm-up: plain averaging, the momentum kept for later
                self.glob[k] = self.glob[k] - avg
            else:
                self.glob[k], self.mom[k] = nesterov(
                    self.glob[k], self.mom[k], avg, self.cfg.outer_lr, self.cfg.outer_momentum
                )
        self.round, self.tokens, self.leader = step.round, step.tokens, step.leader
        self.members = set(step.members)

    def adopt(self, state: State) -> bool:
        """Take a whole state (a result or a join's reply); False: an older round of this
        lineage, ignored."""
        if self.ready and state.round < self.round and state.lineage == self.lineage:
            return False
        self.glob, self.mom = dict(state.glob), dict(state.mom)
        self.round, self.tokens, self.lineage = state.round, state.tokens, state.lineage
        self.parent, self.fork_tokens, self.leader = state.parent, state.fork_tokens, state.leader
        self.members, self.merged = set(state.members), set(state.merged)
        self.clear()
        self.ready = True
        return True

    def take_lead(self, dead: set[int]) -> None:
        """This island leads, without ``dead``; taking over from another leader forks
        the lineage (module doc of :mod:`holmes_jax.diloco.sync`, Split)."""
        if self.leader != self.island:
            self.parent, self.lineage = self.lineage, f"{self.island}@{self.round}"
            self.fork_tokens = self.tokens
        self.leader = self.island
        self.members -= dead
        self.dead |= dead

    def state_meta(self) -> dict:
        return {
            "round": self.round,
            "tokens": self.tokens,
            "lineage": self.lineage,
            "parent": self.parent,
            "fork_tokens": self.fork_tokens,
            "leader": self.leader,
            "members": sorted(self.members),
            "merged": sorted(self.merged),
        }

    def state_body(self) -> bytes:
        """This island's whole state, packed (``g/``, ``m/`` arrays)."""
        arrays = {f"g/{k}": v for k, v in self.glob.items()}
        arrays.update({f"m/{k}": v for k, v in self.mom.items()})
        return pack(self.state_meta(), arrays)


def split_state(arrays: Shards) -> tuple[Shards, Shards]:
    """A packed state's arrays (:meth:`OuterSync.snapshot`) -> (global, momentum)."""
    glob = {k[2:]: v for k, v in arrays.items() if k.startswith("g/")}
    mom = {k[2:]: v for k, v in arrays.items() if k.startswith("m/")}
    return glob, mom
