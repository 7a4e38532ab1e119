"""The outer sync of independent DiLoCo islands over HTTP: rounds, quorum, heal, merge.

With ``diloco.mode: independent`` each island is its own job, and between jobs only this
protocol runs (plain Python and numpy): one :class:`OuterSync` per island and lane. Its state
and rules are :class:`~holmes_jax.diloco.rounds.Rounds`'s (logical layout: plans may differ).

* **Round.** A round's leader is its lowest member (island 0 at first). Each island sends
  ``Δ = global − θ`` and its tokens to the leader, which waits for every member at most
  ``quorum_timeout_s`` after the first delta, or ``down_wait_s`` for members it has heard
  from whose port now refuses connections (down, not slow); every member applies the
  leader's result.
* **Lockstep.** The leader goes on once the other participants have the result, so the
  members start their next inner steps together (:meth:`OuterSync._await_fetched`).
* **Split.** An island that cannot reach its leader follows the lowest reachable member, so
  both sides of a cut link go on (:meth:`OuterSync._fail_over`). Taking over the lead forks:
  new ``lineage`` ``"<island>@<round>"``, ``parent`` the old one, ``fork_tokens`` its tokens then.
* **Heal / merge.** A group leader that finds a lower island of another lineage joins it;
  that leader merges the two token-weighted, so nothing trained on either side is lost
  (:meth:`OuterSync._heal_if_split`, :meth:`OuterSync._serve_join`).
* **Late, restart, abstain.** Such an island takes the round's result with the others
  (:meth:`OuterSync._await_next`, :meth:`OuterSync.join`, :meth:`OuterSync.abstain`).
* **Trust.** Nothing a peer sends changes state unchecked (:mod:`~holmes_jax.diloco.messages`,
  :mod:`~holmes_jax.diloco.auth`, :mod:`~holmes_jax.diloco.transport`).

HTTP (bodies in :mod:`holmes_jax.diloco.wire`'s format): ``GET /status``, ``POST /delta``,
``GET /result?round=r[&have=<lineage;round;tokens>]``, ``GET /ack?round=r``, ``POST /join``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable

import numpy as np

from holmes_jax.diloco.auth import TRAILER, Signer, Verifier
from holmes_jax.diloco.codec import encode_tree
from holmes_jax.diloco.leader import PROBE_WAIT_S, Leading
from holmes_jax.diloco.messages import (
    Delta,
    Refused,
    finite,
    parse_state,
    parse_status,
    parse_step,
)
from holmes_jax.diloco.rounds import Rounds, Shards, SyncConfig
from holmes_jax.diloco.sparse import Feedback
from holmes_jax.diloco.transport import (
    PeerRefused,
    Security,
    Server,
    Traffic,
    Unreachable,
    request,
)
from holmes_jax.diloco.wire import WireError, pack, unpack


class OuterSync(Leading):
    """One island's end of the protocol (module doc) on one lane: a :class:`Rounds`
    served at ``peers[island]`` and the client calls of :meth:`sync` and :meth:`join`.

    Args:
      island: this island's index.
      peers: every island's ``(host, port)``, by index (this one's included).
      cfg: the outer step and timing.
      state: ``(global, momentum)`` fp32 shards to start from; None for a restarted island,
        which must :meth:`join` before :meth:`sync`.
      shapes: the lane's keys and shapes (required when ``state`` is None).
      security: the shared key and TLS (default: neither).
      say: prints one line (refusals, once per peer and reason); default stderr.
      clock: the seconds the quorum timeout and the acknowledgement waits count in
        (default :func:`time.monotonic`); a waiter re-reads it when :attr:`cond` is
        notified, so a test that advances it need not sleep.
    """

    def __init__(
        self,
        island: int,
        peers: dict[int, tuple[str, int]],
        cfg: SyncConfig,
        state,
        *,
        shapes=None,
        security: Security | None = None,
        say: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        residual: Shards | None = None,
    ):
        self.island, self.peers, self.cfg = island, dict(peers), cfg
        self.clock = clock
        self.security = security or Security()
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.cut: set[int] = set()  # islands whose link to this one is cut (tests)
        self.cond = threading.Condition()
        self.r = Rounds(island, self.peers, cfg, state, shapes)
        # outer_dtype sparse: what this island's deltas have not sent yet (error feedback)
        self.feedback = Feedback(cfg.sparse, residual) if cfg.sparse is not None else None
        self.prober: threading.Thread | None = None  # the split probe in flight (Heal / merge)
        self.primary: int | None = None  # what it found: an island of another lineage
        self.sending: dict[int, int] = {}  # island -> results being written to it
        self.sent_at: dict[int, float] = {}  # island -> when the last one was received
        self.told: set[tuple] = set()  # kinds of refusal printed here (:meth:`_tell`)
        self.heard: set[int] = set()  # islands whose authenticated request reached this one
        key = self.security.key
        self.signer = Signer(key, island) if key else None
        self.traffic = Traffic()  # the bytes this island's outer sync sent and received
        self.server = Server(
            self.peers[island],
            self._handle,
            self.r.max_body,
            cfg.silence_s,  # a reply stalled this long ends: its peer is not waited for
            self.say,
            Verifier(key) if key else None,
            self.security.tls_server,
            self._on_send,
            self.traffic,
        )

    # the protocol state, read by the island's runtime and tests
    glob = property(lambda self: self.r.glob)
    mom = property(lambda self: self.r.mom)
    round = property(lambda self: self.r.round)
    tokens = property(lambda self: self.r.tokens)
    lineage = property(lambda self: self.r.lineage)
    leader = property(lambda self: self.r.leader)
    members = property(lambda self: self.r.members)
    ready = property(lambda self: self.r.ready)

    @property
    def refused(self) -> int:
        """Requests this island's server refused so far."""
        return sum(self.server.refused.values())

    def close(self, grace_s: float = 0.0) -> None:
        """Stop serving (the island is gone to its peers), after up to ``grace_s`` seconds
        for the requests being served to finish (peers fetching the last result)."""
        self.server.close(grace_s)

    def snapshot(self) -> bytes:
        """This island's whole state, packed (:func:`~holmes_jax.diloco.rounds.split_state`
        reads its arrays)."""
        with self.cond:
            return self.r.state_body()

    # ---- the caller's side -------------------------------------------------------------

    def sync(self, theta: Shards, tokens: int, average: bool = False) -> Shards:
        """The outer step after the inner steps that took ``global`` to ``theta`` (the next
        round's keys) on ``tokens`` tokens: returns the new global (the caller sets θ ←
        global on those keys). Never waits for a dead island longer than ``quorum_timeout_s``
        (plus ``probe_s`` per probe). ``average``: a warm-up round, ``global ← global − Δ̄``
        with the momentum kept (the same on every island: it follows from the step)."""
        assert self.r.ready, "a restarted island joins before it syncs"
        with self.cond:
            delta = {k: self.r.glob[k] - np.asarray(theta[k], np.float32) for k in theta}
        if not all(finite(d) for d in delta.values()):  # never sent: the peers see nothing
            self.say(f"diloco: island {self.island}: non-finite parameters; it abstains")
            return self.abstain(average)
        return self.sync_delta(delta, tokens, average)

    def abstain(self, average: bool = False) -> Shards:
        """Take part in the next round with nothing: the leader counts this island for nothing
        in the mean and does not wait for it, and its values never leave it. Returns the new
        global model, from which the caller restarts its inner steps."""
        return self.sync_delta(None, 0, average)

    def sync_delta(self, delta: Shards | None, tokens: int, average: bool = False) -> Shards:
        """:meth:`sync` with the outer gradient ``Δ`` given (fp32 shards), not derived from
        ``global``: a delayed merge sends the local progress of the last inner steps.
        ``delta`` None: abstain (:meth:`abstain`)."""
        assert self.r.ready, "a restarted island joins before it syncs"
        self._heal_if_split()  # the delta is inner progress: it goes to the merged lineage
        with self.cond:
            want, lineage = self.r.round + 1, self.r.lineage
        # sparse: encoded once, via the buffer (a leader's own too); dense: when first posted
        payload, values, parts = None, delta, None
        if self.feedback is not None and delta is not None:
            parts, values = self.feedback.encode_tree(delta)
            payload = (parts, {})
        kept = self.feedback.generation if self.feedback is not None else 0
        delivered = False  # taken into a round (by this island as leader, or a peer)
        dead: set[int] = set()
        try:
            while True:
                with self.cond:
                    if self.r.round >= want or self.r.lineage != lineage:
                        if self.r.lineage == lineage:  # closed, with us or without (late)
                            return dict(self.r.glob)
                        want, lineage = self.r.round + 1, self.r.lineage  # joined another
                    if values is not None and not self.r.carries(want, values):
                        return dict(self.r.glob)  # that round is another fragment's: late
                    leader = self.r.leader
                if leader == self.island:
                    gone = frozenset(dead)
                    mine = Delta(self.island, want, lineage, tokens, gone, average, values, parts)
                    with self.cond:
                        accepted = self.r.accept(mine, self.clock())
                        self.cond.notify_all()
                    delivered |= accepted
                    if accepted and self._await_result(want, watch=True):
                        self._await_fetched(want)
                    continue
                if payload is None and delta is not None:
                    arrays, scales = encode_tree(delta, self.cfg.outer_dtype)
                    payload = (arrays, {"scales": scales})
                try:
                    meta = self._post_delta(leader, want, payload, tokens, dead, lineage, average)
                except Unreachable:
                    dead.add(leader)
                    self._fail_over(dead)
                    continue
                except PeerRefused:  # absent from the round: the round's result, as the others'
                    meta = {}
                delivered |= bool(meta) and not meta.get("refused")
                try:
                    if meta.get("refused"):  # another lineage or a closed round: join it
                        self._join_via(leader, then_next=bool(meta.get("late")))
                        continue
                    self._fetch_result(leader, want, values)
                    self._acknowledge(leader, want)
                except Unreachable:
                    dead.add(leader)
                    self._fail_over(dead)
        finally:  # not taken: sent with the next round's, unless a join cleared the buffer
            if not delivered and values is not None and self.feedback is not None:
                if self.feedback.generation == kept:
                    self.feedback.unsent(values)

    def join(self) -> None:
        """A restarted island (no state) asks any live peer for its leader and joins it as a
        late island does (:meth:`_await_next`): registered for the round open at the join,
        to which it contributes nothing, it adopts that round's result (``global``,
        ``momentum``, ``round``) bit for bit, with no checkpoint read, and is a member from
        the next round. The state is sent once, after the round closes: one sent at the join
        would be a round old on arrival, and the island would need the round's step too."""
        while not self.r.ready:
            for j in sorted(self.peers):
                if j == self.island:
                    continue
                try:
                    self._join_via(j, weight=False, then_next=True)
                    return
                except Unreachable:
                    continue
            time.sleep(self.cfg.probe_s)

    # ---- client helpers ----------------------------------------------------------------

    def _request(self, j: int, method: str, path: str, body: bytes = b"", long=False) -> bytes:
        """Peer ``j``'s 200 reply to one request.

        Raises:
          Unreachable: no answer, or an answer that failed authentication or was longer
            than any reply can be (:meth:`~holmes_jax.diloco.rounds.Rounds.max_reply`).
          PeerRefused: ``j`` refused the request (4xx): the reason is printed once.
        """
        if j in self.cut:
            raise Unreachable(j)
        wait = self.cfg.quorum_timeout_s + 2 * self.cfg.probe_s if long else self.cfg.probe_s
        resp = request(
            self.peers[j], method, path, body, wait, self.island, self.signer,
            self.security.tls_client, self.r.max_reply(),
        )  # fmt: skip
        if resp is not None:
            signed = TRAILER if self.signer is not None else 0
            self.traffic.add(sent=len(body) + signed, received=len(resp.body) + signed)
        if resp is None or resp.status in (404, 500, 503, 504):
            raise Unreachable(j)
        if resp.status != 200:
            self._tell(j, f"refused {method} {path.split('?')[0]}", resp.reason)
            raise PeerRefused(resp.reason)
        return resp.body

    def _tell(self, j: int, what: str, reason: str) -> None:
        """Print that peer ``j`` did ``what`` for ``reason``, once per peer, ``what`` and
        the reason's first field."""
        kind = (j, what, reason.split(":")[0])
        if kind not in self.told:
            self.told.add(kind)
            self.say(f"diloco: island {j} {what}: {reason}")

    def _checked(self, j: int, parse, *args):
        """``parse(*args)``, a peer's answer checked; a bad one is an unreachable peer."""
        try:
            return parse(*args)
        except (Refused, WireError) as err:
            self._tell(j, "answered what this island refuses", str(err))
            raise Unreachable(j) from None

    def _status(self, j: int) -> dict:
        body = self._request(j, "GET", "/status")
        try:
            status = json.loads(body)
        except ValueError:
            status = None
        return self._checked(j, parse_status, status, self.r.expect)

    def _fetch_result(self, j: int, want: int, own: Shards | None = None) -> None:
        """Round ``want``'s result from leader ``j``: only the step (half the whole state's
        bytes, or a sparse run's relayed deltas, with ``own``, the values this island sent)
        when this island still holds the state the round started from (its lineage, round
        and tokens match), else the whole state."""
        with self.cond:
            have = self.r.key() if self.r.ready else ""
        query = f"round={want}&have={urllib.parse.quote(have)}"
        meta, arrays = self._checked(j, unpack, self._get_result(j, query))
        if meta.get("kind") != "step":
            self._adopt(j, meta, arrays)
            return
        step = self._checked(j, parse_step, meta, arrays, self.r.expect, self.island, own)
        with self.cond:
            if self.r.key() == have:  # unchanged while it travelled
                self.r.apply(step)
                self.r.clear()
                self.cond.notify_all()
                return
        self._adopt(j, *self._checked(j, unpack, self._get_result(j, f"round={want}")))

    def _get_result(self, j: int, query: str) -> bytes:
        try:
            return self._request(j, "GET", f"/result?{query}", long=True)
        except PeerRefused:
            raise Unreachable(j) from None

    def _adopt(self, j: int, meta: dict, arrays: Shards) -> None:
        state = self._checked(j, parse_state, meta, arrays, self.r.expect)
        with self.cond:
            self.r.adopt(state)
            self.cond.notify_all()

    def _acknowledge(self, j: int, want: int) -> None:
        """Tell leader ``j`` this island has round ``want``'s result (lost: it waits less)."""
        try:
            self._request(j, "GET", f"/ack?round={want}")
        except (Unreachable, PeerRefused):
            pass

    def _post_delta(self, j, want, payload, tokens, dead, lineage, average=False) -> dict:
        meta = {"island": self.island, "round": want, "tokens": tokens, "dead": sorted(dead)}
        meta.update(lineage=lineage, average=average)
        arrays: Shards = {}
        if payload is None:
            meta["abstain"] = True
        else:
            arrays, extra = payload
            meta.update(extra)
        body = self._request(j, "POST", "/delta", pack(meta, arrays), long=True)
        try:
            reply = json.loads(body)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise Unreachable(j)
        return reply

    def _join_via(self, j: int, weight: bool = True, then_next: bool = False) -> None:
        """Join the leader that island ``j`` follows (or ``j``); with ``weight`` this
        island's progress since its fork is merged (another lineage's), else it only
        adopts. ``then_next``: then wait, without a delta, for the round open at the join
        to close and take its result in step with the others (:meth:`_await_next`)."""
        status = self._status(j)
        if self.feedback is not None:  # the global it adopts drops the progress kept here
            self.feedback.clear()
        with self.cond:
            r = self.r
            meta = {"island": self.island, "lineage": r.lineage, "next": then_next}
            meta.update(parent=r.parent, fork_tokens=r.fork_tokens, tokens=r.tokens)
            # 1: merge my progress since the fork (nothing to merge within one lineage)
            meta["weight"] = int(weight and r.ready and status["lineage"] != r.lineage)
            arrays = dict(r.glob) if meta["weight"] else {}
        for target in (status["leader"], j):
            try:
                body = self._request(target, "POST", "/join", pack(meta, arrays), True)
            except (Unreachable, PeerRefused):
                continue
            reply, got = self._checked(target, unpack, body)
            if reply.get("kind") == "awaiting":  # registered: the state comes with the round
                rnd = reply.get("round")
                if type(rnd) is not int:
                    raise Unreachable(target)
                self._await_next(target, rnd)
            else:
                self._adopt(target, reply, got)
            return
        raise Unreachable(j)

    def _await_next(self, j: int, want: int) -> None:
        """After a join registered at island ``j`` for round ``want`` (the round open at the
        join): that round's result, the whole state, acknowledged. The leader's close waits
        for the acknowledgement as for a participant's, so this island starts its next inner
        steps with its leader's and is a member from the round after; without the wait it
        would start a download behind the leader and be late again every round. Waits as
        long as ``j`` answers; returns if it does not (a later call fails over)."""
        while True:
            try:
                self._fetch_result(j, want)
                self._acknowledge(j, want)
                return
            except Unreachable:  # the round is still open (a long phase), or the leader died
                try:
                    self._status(j)
                except (Unreachable, PeerRefused):
                    return

    def _heal_if_split(self) -> None:
        """A group leader joins the primary when its probe has found one: the first island
        below it, outside its group, that answers with another lineage (so of two groups only
        the one with the higher leader looks). The round waits for the probe in flight at
        most :data:`PROBE_WAIT_S`: a peer on a live link answers within that, and one behind a
        cut link (its connection hangs until ``probe_s``) costs the round nothing. The rest of
        this group, refused by this island (another lineage now), join the primary too."""
        with self.cond:
            if self.r.leader != self.island:
                return
            outside = [j for j in sorted(self.peers) if j < self.island and j not in self.r.members]
        if not outside:
            return
        if self.prober is None:
            self.prober = threading.Thread(target=self._probe, args=(outside,), daemon=True)
            self.prober.start()
        self.prober.join(PROBE_WAIT_S)
        if self.prober.is_alive():  # a cut link: its answer is taken at a later round
            return
        found, self.prober, self.primary = self.primary, None, None
        if found is not None:
            try:
                self._join_via(found)
            except PeerRefused:
                pass

    def _probe(self, outside: list[int]) -> None:
        """Sets :attr:`primary` to the first of ``outside`` that answers ready with another
        lineage."""
        for j in outside:
            try:
                status = self._status(j)
            except (Unreachable, PeerRefused):
                continue
            if status["lineage"] != self.r.lineage and status["ready"]:
                self.primary = j
                return

    def _fail_over(self, dead: set[int]) -> None:
        """The lowest reachable member becomes the leader (this island if none answers);
        taking over from lower islands forks the lineage. ``dead`` goes with the next delta,
        so the new leader does not wait for those members."""
        with self.cond:
            candidates = sorted(self.r.members - dead - {self.island})
        for j in candidates:
            if j > self.island:
                break
            try:
                self._status(j)
            except (Unreachable, PeerRefused):
                dead.add(j)
                continue
            with self.cond:  # a refused delta (it forked first) makes this island join it
                self.r.leader = j
            return
        with self.cond:
            self.r.take_lead(dead)
