"""The leader's side of :class:`~holmes_jax.diloco.sync.OuterSync`, and every island's
server: closing a round (waiting for its members, probing those that are missing),
following the result to the participants, and answering peers' requests. Every message is
checked before any state changes (:mod:`~holmes_jax.diloco.messages`)."""

from __future__ import annotations

import json
import urllib.parse

from holmes_jax.diloco.messages import Refused, parse_delta, parse_join, parse_round
from holmes_jax.diloco.transport import Reply, Request, refusal, refuses
from holmes_jax.diloco.wire import WireError, pack, unpack

PROBE_WAIT_S = 0.25  # how long a round waits for the split probe, or a connect to a member
DOWN_POLL_S = 0.5  # how often a leader probes the members it waits for
HAVE_MAX = 200  # characters of a /result query's have=


class Leading:
    """The methods of :class:`~holmes_jax.diloco.sync.OuterSync` that close rounds and
    serve peers (its ``r``, ``cfg``, ``cond``, ``clock``, ``server`` and bookkeeping)."""

    def _await_result(self, want: int, watch: bool = False) -> bool:
        """Wait until round ``want`` is closed, closing it here if this island leads
        (:meth:`Rounds.due`). ``watch`` (the leader's own call): probe the missing members
        every :data:`DOWN_POLL_S` for a port that refuses. False: not closed in time."""
        end = self.clock() + self.cfg.quorum_timeout_s + self.cfg.probe_s
        with self.cond:
            while self.r.round < want:
                if watch and self.r.leader == self.island and self.r.open:
                    self._find_down()  # the lock is released meanwhile: look again
                    if self.r.round >= want:
                        break
                now = self.clock()
                if self.r.leader == self.island and self.r.open:
                    if self.r.due(now):
                        self.r.close()
                        self.cond.notify_all()
                        break
                    wait = self.r.first_arrival + self.cfg.quorum_timeout_s - now
                    wait = min(wait, DOWN_POLL_S) if watch else wait
                else:
                    wait = end - now
                if now >= end:
                    return False
                self.cond.wait(min(wait, end - now))
            return True

    def _find_down(self) -> None:
        """Set :attr:`Rounds.down` to the open round's missing members whose port refuses
        connections (:func:`~holmes_jax.diloco.transport.refuses`), of those heard from
        since this island started: one never heard from may not have started yet (islands
        start at different times). The lock is released while it probes."""
        missing = (self.r.missing() & self.heard) - self.cut
        self.cond.release()
        try:
            down = {j for j in missing if refuses(self.peers[j], PROBE_WAIT_S)}
        finally:
            self.cond.acquire()
        self.r.down = down & self.r.missing()

    def _await_fetched(self, want: int) -> None:
        """Wait until the other participants of round ``want`` have acknowledged its result:
        while a result is on its way to one of them, and then at most ``quorum_timeout_s``
        after the last one arrived (or after the wait began). So a delta reaches the leader
        within its upload time of the leader's own. Without the wait the leader, which
        transfers nothing, would run ahead by its members' download time, and a member whose
        download plus upload exceeds ``quorum_timeout_s`` would miss every round."""
        began = self.clock()
        with self.cond:
            while waiting := self.r.unacknowledged(want):
                if any(self.sending.get(i) for i in waiting):
                    self.cond.wait(self.cfg.quorum_timeout_s)
                    continue
                last = max([began] + [self.sent_at.get(i, 0.0) for i in waiting])
                now = self.clock()
                if now >= last + self.cfg.quorum_timeout_s:
                    return
                self.cond.wait(last + self.cfg.quorum_timeout_s - now)

    def _on_send(self, peer: int, change: int, done: bool = False) -> None:
        """A result's reply to ``peer`` starts (+1) or ends (-1; ``done``: received)."""
        with self.cond:
            self.sending[peer] = self.sending.get(peer, 0) + change
            if change < 0 and done:  # a reply cut short is silence: the wait does not restart
                self.sent_at[peer] = self.clock()
            self.cond.notify_all()

    def _handle(self, req: Request) -> Reply:
        """Answer one authenticated request; every message is checked before any state
        changes, and a refusal names its reason."""
        peer = f"{req.peer} (island {req.sender})"
        if req.sender in self.cut:
            return refusal(503, "link cut (test)")
        if req.sender not in self.peers or req.sender == self.island:
            return self.server.refuse(peer, 403, f"island {req.sender}: not a peer of this run")
        self.heard.add(req.sender)
        try:
            if req.method == "GET" and req.path == "/status":
                return self._serve_status()
            if req.method == "POST" and req.path == "/delta":
                return self._serve_delta(req)
            if req.method == "GET" and req.path == "/result":
                return self._serve_result(req)
            if req.method == "GET" and req.path == "/ack":
                rnd = parse_round(urllib.parse.parse_qs(req.query))
                with self.cond:
                    self.r.acknowledged(req.sender, rnd)
                    self.cond.notify_all()
                return Reply(b"{}")
            if req.method == "POST" and req.path == "/join":
                return self._serve_join(req)
        except (Refused, WireError) as err:
            return self.server.refuse(peer, 400, f"{req.path}: {err}")
        return refusal(404, f"{req.method} {req.path}: no such endpoint")

    def _serve_status(self) -> Reply:
        with self.cond:
            r = self.r
            out = {"island": self.island, "round": r.round, "leader": r.leader}
            out.update(lineage=r.lineage, ready=r.ready, tokens=r.tokens)
        return Reply(json.dumps(out).encode())

    def _serve_delta(self, req: Request) -> Reply:
        try:
            delta = parse_delta(*unpack(req.body), req.sender, self.r.expect)
        except (Refused, WireError):
            with self.cond:  # an authenticated member: absent from the round, not waited for
                self.r.absent(req.sender)
                self.cond.notify_all()
            raise
        with self.cond:
            ok = self.r.accept(delta, self.clock())
            late = not ok and self.r.is_late(delta)  # for a round of this lineage closed
            self.cond.notify_all()
        return Reply(json.dumps({"refused": not ok, "late": late}).encode())

    def _serve_result(self, req: Request) -> Reply:
        args = urllib.parse.parse_qs(req.query)
        want, have = parse_round(args), args.get("have", [""])[0][:HAVE_MAX]
        closed = self._await_result(want)
        with self.cond:
            body = None
            step = self.r.step
            if closed and self.r.round == want and step and step[0] == have:
                body = self.r.step_body(req.sender)  # the asker holds the round's start
            elif closed:  # else the whole state, of the latest round
                body = self.r.state_body()
        if body is None:
            return refusal(504, f"round {want} not closed in time")
        return Reply(body, track=req.sender)

    def _serve_join(self, req: Request) -> Reply:
        """Merge a joiner's lineage if it asks (:meth:`Rounds.merge`: each side weighs its
        tokens since the younger lineage forked; each lineage once, later joiners adopt) and
        add it to the group (:meth:`Rounds.register`), keeping this island's momentum and
        round. The reply is the merged state, or ``awaiting`` for a join with ``next``."""
        join = parse_join(*unpack(req.body), req.sender, self.r.expect)
        with self.cond:
            if not self.r.ready:
                return refusal(503, "not ready (restarting)")
            self.r.merge(join)
            rnd = self.r.register(join)
            self.cond.notify_all()
            if rnd is not None:  # registered: it fetches that round's result next
                return Reply(pack({"kind": "awaiting", "round": rnd}))
            return Reply(self.r.state_body())
