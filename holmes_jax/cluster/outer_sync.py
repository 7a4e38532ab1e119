"""The outer sync of independent DiLoCo islands over HTTP: rounds, quorum, heal, merge.

With ``diloco.mode: independent`` each island is its own job; between jobs only this
protocol runs (plain Python and numpy, no jax: the runtime moves shards device<->host).
An island's state is ``global`` and ``momentum`` (fp32 shards, keyed ``"<leaf path>#<shard>"``,
the logical layout, so islands may use different plans), the number ``round`` of outer
steps it has applied, ``tokens`` (the tokens its model has seen) and ``lineage`` (the id
of its history; ``"root"`` until a split).

Protocol (every island runs one :class:`OuterSync`, an HTTP server plus a client):

* **Leader.** Each round has one leader, which collects the deltas and computes the result;
  every island applies the leader's result, so the members agree by construction. The
  result of round r names the members (its participants plus islands that joined during
  it) and the leader of round r+1: the lowest member index. Start: every island, leader 0.
* **Round r.** An island sends ``Δ = global − θ`` (encoded in ``diloco.outer_dtype``) and
  its tokens since the last round to its leader, then long-polls the leader for the
  result. The leader waits for every member of round r−1, but at most ``quorum_timeout_s``
  after the first delta arrived; whoever delivered by then participates. Result:
  ``Δ̄ = Σ tokens_i·decode(Δ_i) / Σ tokens_i`` in fp32, encoded in ``outer_dtype`` too;
  every member, the leader included, takes the step with its decoded value ``D``:
  Nesterov ``m ← μm + D``, ``global ← global − lr(D + μm)`` (:func:`nesterov`); a warm-up
  round (``sync(..., average=True)``) takes ``global ← global − D`` and keeps ``m``. A
  member that still holds the state the round started from (its lineage, round and tokens
  match) fetches only the step (``D`` and the round's meta), half the whole state's
  bytes; the same arithmetic on the same state keeps the members equal bit for bit.
  Anyone else gets the whole state. A delta that arrives late, or for a round already
  closed, is dropped: its island adopts the latest state.
* **Lockstep.** A member acknowledges the result once it has it (``GET /ack``); the
  leader's own call returns when every other participant has, or when none has been sent
  anything for ``quorum_timeout_s``: the wait lasts while a result is on its way to one
  of them (until its TCP has it) and at most the timeout after the last arrived. So the
  members start their next inner steps together and a delta reaches the leader within its
  upload time of the leader's own. Without it the leader, which transfers nothing, would
  run ahead by its members' download time, and a member whose download plus upload
  exceeds the quorum timeout would miss every round. Replies go out in 64-KiB writes,
  each within ``quorum_timeout_s`` or the request ends, so a peer that dies or is cut off
  in the middle of a download is silent, and not waited for, after that long.
* **Dead leader.** An island that cannot reach its leader (connection refused, timeout)
  takes the lowest reachable member as leader, itself last, and tells it which members it
  found dead so that the new leader does not wait for them.
* **Split.** A cut link makes each side see the other as dead: both sides go on, each a
  group with its own leader. An island that takes over the lead from another forks: new
  ``lineage`` ``"<island>@<round>"`` whose ``parent`` is the old one, remembering
  ``fork_tokens`` (its tokens then, which the other side had too).
* **Heal / merge.** Before each round a group leader probes the configured islands with a
  lower index outside its group (so of two groups only the one with the higher leader
  looks); one that answers with another lineage is the primary. The probe runs in the
  background and the round waits for it at most ``PROBE_WAIT_S``: a peer on a live link
  answers within that, while a peer behind a cut link (whose connection hangs until
  ``probe_s``) costs the round nothing, its probe's answer being taken at a later round.
  The leader joins the primary (``POST /join`` with its global, tokens and fork point);
  the primary's leader merges token-weighted, ``global ← (w_p·g_p + w_j·g_j) / (w_p +
  w_j)`` with ``w = tokens − common`` per side, ``common`` the fork point of whichever
  lineage is the other's child (exact for one split; for deeper histories the joiner's
  fork point), keeps its own momentum and round, and merges each lineage once (later
  joiners of it adopt). The joiner adopts the merged state and sends its pending delta
  to the primary's open round; the rest of its group, refused by their old leader
  (another lineage now), join too and adopt. Nothing trained on either side is lost.
* **Late.** A delta refused because its round closed (dropped): the island re-joins its
  leader, which registers it for the round open at the join and answers without state
  (``POST /join`` with ``next``). The island then fetches that round's result, the whole
  state (its own is not the round's start), and acknowledges it; the leader's close waits
  for that acknowledgement as for a participant's (Lockstep). So it starts its next inner
  steps with the others and is a member from the round after. Without the wait it would
  start its inner steps a download behind the leader and be late again every round.
* **Restart.** An island restarted without state (:meth:`OuterSync.join`) asks any live
  peer for its leader and joins it as a late island does: registered for the round open
  at its join, to which it contributes nothing (a zero pseudo-gradient with no tokens), it
  fetches that round's result as the whole state and adopts ``global``, ``momentum``,
  ``round`` bit for bit (no checkpoint read), in step with the leader; it is a member
  from the next round on. The state is sent once, after the round closes: one sent at
  the join would be a round old on arrival, and the island would need the round's step
  as well.

HTTP (one JSON meta plus numpy arrays per body, :func:`pack`): ``GET /status``,
``POST /delta``, ``GET /result?round=r[&have=<lineage;round;tokens>]``, ``GET /ack?round=r``,
``POST /join``.
"""

from __future__ import annotations

import array
import fcntl
import http.client
import io
import json
import termios
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import ml_dtypes
import numpy as np

INT8_MAX = 127.0
CHUNK = 1 << 16  # bytes per write of a reply: each must pass within the socket timeout
DRAIN_POLL_S = 0.02  # how often a reply's unsent bytes are read while it drains
PROBE_WAIT_S = 0.25  # how long a round waits for the split probe (Heal / merge)
Shards = dict[str, np.ndarray]  # "<leaf path>#<shard>" -> array


@dataclass(frozen=True)
class SyncConfig:
    """The outer step's parameters (from the ``diloco`` section) and the protocol's timing."""

    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_dtype: str = "fp32"
    quorum_timeout_s: float = 60.0
    probe_s: float = 1.0  # seconds to wait for a peer's /status or a connection

    @classmethod
    def from_diloco(cls, diloco, probe_s: float = 1.0) -> SyncConfig:
        """The protocol's settings from a run's ``diloco`` section."""
        return cls(
            outer_lr=diloco.outer_lr,
            outer_momentum=diloco.outer_momentum,
            outer_dtype=diloco.outer_dtype,
            quorum_timeout_s=diloco.quorum_timeout_s,
            probe_s=min(probe_s, diloco.quorum_timeout_s),
        )


def encode(delta: np.ndarray, dtype: str) -> tuple[np.ndarray, float]:
    """fp32 ``delta`` -> (wire payload, scale); int8: ``s = max|Δ| / 127`` (1 if all zero),
    ``q = round(Δ / s)``; bf16 travels as the upper 16 bits (uint16); fp32 as is."""
    delta = np.asarray(delta, np.float32)
    if dtype == "fp32":
        return delta, 1.0
    if dtype == "bf16":  # rounded to nearest even; its bits travel
        return delta.astype(ml_dtypes.bfloat16).view(np.uint16), 1.0
    if dtype != "int8":
        raise ValueError(f"outer dtype {dtype!r}")
    absmax = float(np.max(np.abs(delta))) if delta.size else 0.0
    scale = absmax / INT8_MAX if absmax > 0 else 1.0
    q = np.clip(np.round(delta / np.float32(scale)), -INT8_MAX, INT8_MAX)
    return q.astype(np.int8), scale


def decode(payload: np.ndarray, scale: float) -> np.ndarray:
    """The fp32 delta from :func:`encode`'s output."""
    if payload.dtype == np.uint16:
        return payload.view(ml_dtypes.bfloat16).astype(np.float32)
    return payload.astype(np.float32) * np.float32(scale)


def nesterov(glob, mom, delta, lr: float, mu: float):
    """One outer Nesterov step on arrays (numpy or jax): ``m ← μm + Δ``,
    ``global ← global − lr(Δ + μm)``. Returns (global, momentum)."""
    mom = mu * mom + delta
    return glob - lr * (delta + mu * mom), mom


def pack(meta: dict, arrays: Shards | None = None) -> bytes:
    """One body: ``meta`` (JSON) and ``arrays`` in an npz (no pickle)."""
    buf = io.BytesIO()
    blob = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    np.savez(buf, __meta__=blob, **(arrays or {}))
    return buf.getvalue()


def unpack(body: bytes) -> tuple[dict, Shards]:
    """:func:`pack`'s (meta, arrays)."""
    with np.load(io.BytesIO(body), allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    meta = json.loads(arrays.pop("__meta__").tobytes())
    return meta, arrays


def split_state(arrays: Shards) -> tuple[Shards, Shards]:
    """A packed state's arrays (:meth:`OuterSync.snapshot`) -> (global, momentum)."""
    glob = {k[2:]: v for k, v in arrays.items() if k.startswith("g/")}
    mom = {k[2:]: v for k, v in arrays.items() if k.startswith("m/")}
    return glob, mom


def _drain(sock, timeout: float) -> bool:
    """Wait until the peer has received what was written to ``sock`` (Linux: the socket's
    send queue is empty; elsewhere at once): the kernel's buffer holds megabytes, seconds
    of a slow link. False if the queue made no progress for ``timeout`` seconds."""
    if not hasattr(termios, "TIOCOUTQ"):
        return True
    left, last, since = array.array("i", [0]), -1, time.monotonic()
    while True:
        fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, left)
        now = time.monotonic()
        if left[0] == 0:
            return True
        if left[0] != last:
            last, since = left[0], now
        elif now - since >= timeout:
            return False
        time.sleep(DRAIN_POLL_S)


class Unreachable(Exception):
    """A peer did not answer (refused, timed out, or its link is cut)."""


def call(
    address: tuple[str, int],
    method: str,
    path: str,
    body: bytes = b"",
    timeout: float = 1.0,
    headers: dict[str, str] | None = None,
) -> bytes | None:
    """One request to a peer's server: the body of its 200 reply, or None when the peer
    refused, timed out, cut the reply short or answered anything but 200."""
    conn = http.client.HTTPConnection(*address, timeout=timeout)
    try:
        conn.request(method, path, body, headers or {})
        resp = conn.getresponse()
        data = resp.read()
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()
    return data if resp.status == 200 else None


def live_round(peers: dict[int, tuple[str, int]], me: int, timeout: float) -> int:
    """The highest round a live, ready peer other than island ``me`` reports (0: none)."""
    best = 0
    for j, address in peers.items():
        if j == me or (data := call(address, "GET", "/status", timeout=timeout)) is None:
            continue
        status = json.loads(data)
        if status.get("ready"):
            best = max(best, int(status["round"]))
    return best


class OuterSync:
    """One island's end of the protocol (module doc): an HTTP server on ``peers[island]``
    and the client calls of :meth:`sync` and :meth:`join`.

    Args:
      island: this island's index.
      peers: every island's ``(host, port)``, by index (this one's included).
      cfg: the outer step and timing.
      state: ``(global, momentum)`` fp32 shards to start from; None for a restarted island,
        which must :meth:`join` before :meth:`sync`.
    """

    def __init__(self, island: int, peers: dict[int, tuple[str, int]], cfg: SyncConfig, state):
        self.island, self.peers, self.cfg = island, dict(peers), cfg
        self.cut: set[int] = set()  # islands whose link to this one is cut (tests)
        self.cond = threading.Condition()
        self.glob: Shards = {}
        self.mom: Shards = {}
        self.round, self.tokens, self.lineage, self.fork_tokens = 0, 0, "root", 0
        self.parent = ""  # the lineage this one forked from ("" for root)
        self.leader, self.members = min(peers), set(peers)
        self.merged: set[str] = set()  # lineages merged into this one
        self.open: dict[int, tuple[Shards, int]] = {}  # round+1: island -> (Δ fp32, tokens)
        self.first_arrival: float | None = None
        self.average = False  # the open round is a warm-up averaging round
        self.active = 0  # requests being served
        self.joined: set[int] = set()  # joined during the open round
        self.dead: set[int] = set()  # reported dead during the open round
        self.step: tuple[str, bytes] | None = None  # the last round's (base key, packed step)
        self.prober: threading.Thread | None = None  # the split probe in flight (Heal / merge)
        self.primary: int | None = None  # what it found: an island of another lineage
        self.took: dict[int, set[int]] = {}  # the last rounds' participants but this island
        self.fetched: dict[int, set[int]] = {}  # round -> islands that acknowledged its result
        self.awaiting: set[int] = set()  # joined to take the open round's result in step
        self.sending: dict[int, int] = {}  # island -> results being written to it
        self.sent_at: dict[int, float] = {}  # island -> when the last one was received
        if state is not None:
            self.glob = {k: np.asarray(v, np.float32) for k, v in state[0].items()}
            self.mom = {k: np.asarray(v, np.float32) for k, v in state[1].items()}
        self.ready = state is not None
        node = self

        class Handler(BaseHTTPRequestHandler):
            timeout = cfg.quorum_timeout_s  # a socket silent this long ends the request

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                node._serve(self, "GET")

            def do_POST(self):
                node._serve(self, "POST")

        self.server = ThreadingHTTPServer(self.peers[island], Handler)
        self.server.daemon_threads = True
        serve = lambda: self.server.serve_forever(poll_interval=0.05)  # noqa: E731
        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()

    def close(self, grace_s: float = 0.0) -> None:
        """Stop serving (the island is gone to its peers), after up to ``grace_s`` seconds
        for the requests being served to finish (peers fetching the last result)."""
        end = time.monotonic() + grace_s
        with self.cond:
            while self.active and time.monotonic() < end:
                self.cond.wait(min(0.1, end - time.monotonic()))
        self.server.shutdown()
        self.server.server_close()

    # ---- the caller's side -------------------------------------------------------------

    def sync(self, theta: Shards, tokens: int, average: bool = False) -> Shards:
        """The outer step after the inner steps that took ``global`` to ``theta`` on
        ``tokens`` tokens: returns the new global (the caller sets θ ← global). Never waits
        for a dead island longer than ``quorum_timeout_s`` (plus ``probe_s`` per probe).
        ``average``: a warm-up round, ``global ← global − Δ̄`` with the momentum kept (every
        island passes the same value for a round: it follows from the step)."""
        assert self.ready, "a restarted island joins before it syncs"
        with self.cond:
            delta = {k: self.glob[k] - np.asarray(theta[k], np.float32) for k in self.glob}
        return self.sync_delta(delta, tokens, average)

    def sync_delta(self, delta: Shards, tokens: int, average: bool = False) -> Shards:
        """:meth:`sync` with the outer gradient ``Δ`` given (fp32 shards), not derived from
        ``global``: a delayed merge sends the local progress of the last inner steps."""
        assert self.ready, "a restarted island joins before it syncs"
        self._heal_if_split()  # the delta is inner progress: it goes to the merged lineage
        with self.cond:
            want, lineage = self.round + 1, self.lineage
        dead: set[int] = set()
        while True:
            with self.cond:
                if self.round >= want or self.lineage != lineage:
                    if self.lineage == lineage:  # closed without us (late): dropped
                        return dict(self.glob)
                    want, lineage = self.round + 1, self.lineage  # joined another lineage
                leader = self.leader
            if leader == self.island:
                if not self._accept(self.island, want, delta, tokens, dead, lineage, average):
                    continue
                if self._await_result(want):
                    self._await_fetched(want)
                continue
            try:
                meta = self._post_delta(leader, want, delta, tokens, dead, lineage, average)
                if meta.get("refused"):  # another lineage or a closed round: join it
                    self._join_via(leader, then_next=bool(meta.get("late")))
                    continue
                self._fetch_result(leader, want)
                self._acknowledge(leader, want)
            except Unreachable:
                dead.add(leader)
                self._fail_over(dead)

    def join(self) -> None:
        """A restarted island (no state) adopts a live peer's state (module doc, Restart)."""
        while not self.ready:
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
        if j in self.cut:
            raise Unreachable(j)
        wait = self.cfg.quorum_timeout_s + 2 * self.cfg.probe_s if long else self.cfg.probe_s
        data = call(self.peers[j], method, path, body, wait, {"X-Island": str(self.island)})
        if data is None:
            raise Unreachable(j)
        return data

    def _get(self, j: int, path: str, long=False) -> bytes:
        return self._request(j, "GET", path, long=long)

    def _status(self, j: int) -> dict:
        return json.loads(self._get(j, "/status"))

    def _fetch_result(self, j: int, want: int) -> None:
        """Round ``want``'s result from leader ``j``: only the step when this island still
        holds the state the round started from, else the whole state."""
        with self.cond:
            have = self._key() if self.ready else ""
        query = f"round={want}&have={urllib.parse.quote(have)}"
        meta, arrays = unpack(self._get(j, f"/result?{query}", long=True))
        if meta.get("kind") != "step":
            self._adopt(meta, arrays)
            return
        with self.cond:
            if self._key() == have:  # unchanged while it travelled
                self._apply(meta, arrays)
                self._clear_round()
                self.cond.notify_all()
                return
        self._adopt(*unpack(self._get(j, f"/result?round={want}", long=True)))

    def _acknowledge(self, j: int, want: int) -> None:
        """Tell leader ``j`` this island has round ``want``'s result (lost: it waits less)."""
        try:
            self._get(j, f"/ack?round={want}")
        except Unreachable:
            pass

    def _post_delta(self, j, want, delta, tokens, dead, lineage, average=False) -> dict:
        meta = {"island": self.island, "round": want, "tokens": tokens, "dead": sorted(dead)}
        meta.update(lineage=lineage, average=average)
        arrays, scales = {}, {}
        for k, d in delta.items():
            arrays[k], scales[k] = encode(d, self.cfg.outer_dtype)
        meta["scales"] = scales
        return json.loads(self._request(j, "POST", "/delta", pack(meta, arrays), long=True))

    def _join_via(self, j: int, weight: bool = True, then_next: bool = False) -> None:
        """Join the leader that island ``j`` follows (or ``j``); with ``weight`` this
        island's progress since its fork is merged (another lineage's), else it only
        adopts. ``then_next``: then wait, without a delta, for the round open at the join
        to close and take its result in step with the others (:meth:`_await_next`)."""
        status = self._status(j)
        with self.cond:
            meta = {"island": self.island, "lineage": self.lineage, "next": then_next}
            meta.update(parent=self.parent, fork_tokens=self.fork_tokens, tokens=self.tokens)
            # 1: merge my progress since the fork (nothing to merge within one lineage)
            meta["weight"] = int(weight and self.ready and status["lineage"] != self.lineage)
            arrays = dict(self.glob) if meta["weight"] else {}
        for target in (status["leader"], j):
            try:
                reply = unpack(self._request(target, "POST", "/join", pack(meta, arrays), True))
            except Unreachable:
                continue
            if reply[0].get("kind") == "awaiting":  # registered: the state comes with the round
                self._await_next(target, reply[0]["round"])
            else:
                self._adopt(*reply)
            return
        raise Unreachable(j)

    def _await_next(self, j: int, want: int) -> None:
        """After a join registered at island ``j`` for round ``want`` (the round open at the
        join): that round's result, acknowledged, so this island's next inner steps start
        with its leader's (module doc, Restart). Waits as long as ``j`` answers; returns if
        it does not (a later call fails over)."""
        while True:
            try:
                self._fetch_result(j, want)
                self._acknowledge(j, want)
                return
            except Unreachable:  # the round is still open (a long phase), or the leader died
                try:
                    self._status(j)
                except Unreachable:
                    return

    def _heal_if_split(self) -> None:
        """A group leader joins the primary when its probe has found one (module doc, Heal /
        merge); waits for the probe in flight at most :data:`PROBE_WAIT_S`."""
        with self.cond:
            if self.leader != self.island:
                return
            outside = [j for j in sorted(self.peers) if j < self.island and j not in self.members]
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
            self._join_via(found)

    def _probe(self, outside: list[int]) -> None:
        """Sets :attr:`primary` to the first of ``outside`` that answers ready with another
        lineage."""
        for j in outside:
            try:
                status = self._status(j)
            except Unreachable:
                continue
            if status["lineage"] != self.lineage and status["ready"]:
                self.primary = j
                return

    def _fail_over(self, dead: set[int]) -> None:
        """The lowest reachable member becomes the leader (this island if none answers);
        taking over from lower islands forks the lineage."""
        with self.cond:
            candidates = sorted(self.members - dead - {self.island})
            me, rnd = self.island, self.round
        for j in candidates:
            if j > me:
                break
            try:
                self._status(j)
            except Unreachable:
                dead.add(j)
                continue
            with self.cond:  # a refused delta (it forked first) makes this island join it
                self.leader = j
            return
        with self.cond:
            if self.leader != me:  # taking over from another leader: a new lineage
                self.parent, self.lineage = self.lineage, f"{me}@{rnd}"
                self.fork_tokens = self.tokens
            self.leader = me
            self.members -= dead
            self.dead |= dead

    def _adopt(self, meta: dict, arrays: Shards) -> None:
        with self.cond:
            if self.ready and meta["round"] < self.round and meta["lineage"] == self.lineage:
                return
            self.glob, self.mom = split_state(arrays)
            for key in ("round", "tokens", "lineage", "parent", "fork_tokens", "leader"):
                setattr(self, key, meta[key])
            self.members, self.merged = set(meta["members"]), set(meta["merged"])
            self._clear_round()
            self.ready = True
            self.cond.notify_all()

    def snapshot(self) -> bytes:
        """This island's whole state, packed (:func:`pack`; :func:`split_state` reads it)."""
        with self.cond:
            return self._state_body()

    # ---- the leader's side -------------------------------------------------------------

    def _state_body(self) -> bytes:
        """This island's state, packed (call with the lock held)."""
        meta = {
            "round": self.round,
            "tokens": self.tokens,
            "lineage": self.lineage,
            "parent": self.parent,
            "fork_tokens": self.fork_tokens,
            "leader": self.leader,
            "members": sorted(self.members),
            "merged": sorted(self.merged),
        }
        arrays = {f"g/{k}": v for k, v in self.glob.items()}
        arrays.update({f"m/{k}": v for k, v in self.mom.items()})
        return pack(meta, arrays)

    def _accept(self, island, want, delta, tokens, dead, lineage, average=False) -> bool:
        """Take ``island``'s delta for round ``want`` into the open round (False: refused,
        another lineage or not the open round); ``average``: a warm-up round."""
        with self.cond:
            if lineage != self.lineage or want != self.round + 1 or not self.ready:
                return False
            if self.first_arrival is None:
                self.first_arrival = time.monotonic()
            self.open[island] = (delta, tokens)
            self.average = average
            self.dead |= set(dead) - {self.island}
            self.cond.notify_all()
            return True

    def _await_result(self, want: int) -> bool:
        """Wait until round ``want`` is closed, closing it here if this island leads
        (all members in, or the quorum timeout passed). False: not closed in time."""
        end = time.monotonic() + self.cfg.quorum_timeout_s + self.cfg.probe_s
        with self.cond:
            while self.round < want:
                now = time.monotonic()
                if self.leader == self.island and self.open:
                    waiting = self.members - self.dead - set(self.open)
                    late = now >= self.first_arrival + self.cfg.quorum_timeout_s
                    if not waiting or late:
                        self._close_round()
                        break
                    wait = self.first_arrival + self.cfg.quorum_timeout_s - now
                else:
                    wait = end - now
                if now >= end:
                    return False
                self.cond.wait(min(wait, end - now))
            return True

    def _await_fetched(self, want: int) -> None:
        """Wait until the other participants of round ``want`` have acknowledged its result
        (module doc, Lockstep): while a result is on its way to one of them, and then at
        most ``quorum_timeout_s`` after the last one arrived (or after the wait began)."""
        began = time.monotonic()
        with self.cond:
            while waiting := self.took.get(want, set()) - self.fetched.get(want, set()):
                if any(self.sending.get(i) for i in waiting):
                    self.cond.wait(self.cfg.quorum_timeout_s)
                    continue
                last = max([began] + [self.sent_at.get(i, 0.0) for i in waiting])
                now = time.monotonic()
                if now >= last + self.cfg.quorum_timeout_s:
                    return
                self.cond.wait(last + self.cfg.quorum_timeout_s - now)

    def _close_round(self) -> None:
        """Average the delivered deltas token-weighted, encode the mean in
        ``outer_dtype``, apply its decoded value (:meth:`_apply`, as every member will),
        name the next round's members and leader (lock held)."""
        weights = {i: max(t, 0) for i, (_, t) in self.open.items()}
        total = sum(weights.values())
        base, arrays, scales = self._key(), {}, {}
        for k in self.glob:
            if total > 0:
                avg = sum(weights[i] * d[k] for i, (d, _) in self.open.items()) / total
            else:
                avg = sum(d[k] for d, _ in self.open.values()) / len(self.open)
            arrays[k], scales[k] = encode(avg.astype(np.float32), self.cfg.outer_dtype)
        meta = {"round": self.round + 1, "tokens": self.tokens + total, "average": self.average}
        meta.update(scales=scales, lr=self.cfg.outer_lr, mu=self.cfg.outer_momentum)
        self.members = set(self.open) | self.joined
        self.leader = min(self.members)
        meta.update(leader=self.leader, members=sorted(self.members))
        self._apply(meta, arrays)
        self.step = (base, pack({**meta, "kind": "step"}, arrays))
        self.took[self.round] = (set(self.open) | self.awaiting) - {self.island}
        self._clear_round()
        self.awaiting = set()
        for old in (self.took, self.fetched):
            old.pop(self.round - 4, None)
        self.cond.notify_all()

    def _apply(self, meta: dict, arrays: Shards) -> None:
        """Take a round's step (:meth:`_close_round`'s ``meta`` and encoded mean delta) from
        this island's state of the round before: the same arithmetic on every member, so
        they stay equal bit for bit (lock held)."""
        for k, payload in arrays.items():
            avg = decode(payload, meta["scales"][k])
            if meta["average"]:  # warm-up: plain averaging, the momentum kept for later
                self.glob[k] = self.glob[k] - avg
            else:
                self.glob[k], self.mom[k] = nesterov(
                    self.glob[k], self.mom[k], avg, meta["lr"], meta["mu"]
                )
        self.round, self.tokens, self.leader = meta["round"], meta["tokens"], meta["leader"]
        self.members = set(meta["members"])

    def _clear_round(self) -> None:
        """No round open: no deltas, arrivals, joiners or dead reported (lock held)."""
        self.open, self.first_arrival, self.joined, self.dead = {}, None, set(), set()

    def _key(self) -> str:
        """What names this island's global model: lineage, round and tokens (a merge
        changes the tokens), as sent with ``/result?have=`` (lock held)."""
        return f"{self.lineage};{self.round};{self.tokens}"

    def _merge(self, meta: dict, arrays: Shards) -> None:
        """Merge a joiner's lineage token-weighted into this one, once (lock held)."""
        if meta["lineage"] == self.lineage or meta["lineage"] in self.merged:
            return
        # the common point: where the younger of the two lineages forked from the other
        common = self.fork_tokens if meta["lineage"] == self.parent else meta["fork_tokens"]
        w_j = meta["weight"] and max(meta["tokens"] - common, 0)
        w_p = max(self.tokens - common, 0)
        if w_j <= 0:
            return
        for k in self.glob:
            self.glob[k] = ((w_p * self.glob[k] + w_j * arrays[k]) / (w_p + w_j)).astype(np.float32)
        self.tokens += w_j
        self.merged.add(meta["lineage"])

    def _serve(self, req: BaseHTTPRequestHandler, method: str) -> None:
        with self.cond:
            self.active += 1
        try:
            self._handle(req, method)
        finally:
            with self.cond:
                self.active -= 1
                self.cond.notify_all()

    def _handle(self, req: BaseHTTPRequestHandler, method: str) -> None:
        peer = int(req.headers.get("X-Island", "-1"))
        if peer in self.cut:
            req.send_error(503)
            return
        path, _, query = req.path.partition("?")
        body = (
            req.rfile.read(int(req.headers.get("Content-Length", 0))) if method == "POST" else b""
        )
        if path == "/status":
            with self.cond:
                out = {"island": self.island, "round": self.round, "leader": self.leader}
                out.update(lineage=self.lineage, ready=self.ready, tokens=self.tokens)
            self._reply(req, json.dumps(out).encode())
        elif path == "/delta":
            meta, arrays = unpack(body)
            delta = {k: decode(v, meta["scales"][k]) for k, v in arrays.items()}
            args = (meta["island"], meta["round"], delta, meta["tokens"], meta["dead"])
            ok = self._accept(*args, meta["lineage"], meta.get("average", False))
            with self.cond:  # late: for a round of this lineage already closed
                late = not ok and meta["lineage"] == self.lineage and meta["round"] <= self.round
            self._reply(req, json.dumps({"refused": not ok, "late": late}).encode())
        elif path == "/result":
            args = urllib.parse.parse_qs(query)
            want, have = int(args["round"][0]), args.get("have", [""])[0]
            closed = self._await_result(want)
            with self.cond:
                body = None
                if closed and self.round == want and self.step and self.step[0] == have:
                    body = self.step[1]  # the asker holds the round's start: the step only
                elif closed:  # else the whole state, of the latest round
                    body = self._state_body()
            if body is None:
                req.send_error(504)
            else:
                self._reply(req, body, peer)
        elif path == "/ack":
            want = int(urllib.parse.parse_qs(query)["round"][0])
            with self.cond:
                self.fetched.setdefault(want, set()).add(peer)
                self.cond.notify_all()
            self._reply(req, b"{}")
        elif path == "/join":
            meta, arrays = unpack(body)
            with self.cond:
                if not self.ready:
                    req.send_error(503)
                    return
                self._merge(meta, arrays)
                # between rounds a member at once; during one, or when it waits for the
                # next result (then in step: the round's close waits for its ack), not
                # waited for until the round after
                (self.joined if self.open or meta["next"] else self.members).add(meta["island"])
                if meta["next"]:  # a restart may still be a member: it sends no delta now
                    self.members.discard(meta["island"])
                    self.awaiting.add(meta["island"])
                    self.cond.notify_all()
                    # registered: it fetches that round's result (the state it needs) next
                    out = pack({"kind": "awaiting", "round": self.round + 1})
                else:
                    out = self._state_body()
            self._reply(req, out)
        else:
            req.send_error(404)

    def _reply(self, req: BaseHTTPRequestHandler, body: bytes, peer: int | None = None) -> None:
        """Send ``body`` in chunks, each within the socket's timeout (a stalled peer ends the
        reply). For ``peer`` (a result's): count the reply as being written until the peer
        has received it, and note when it had (:meth:`_await_fetched`)."""
        req.send_response(200)
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        if peer is None:
            self._write(req, body)
            return
        with self.cond:
            self.sending[peer] = self.sending.get(peer, 0) + 1
        done = False
        try:
            done = self._write(req, body) and _drain(req.connection, self.cfg.quorum_timeout_s)
        finally:
            with self.cond:
                self.sending[peer] -= 1
                if done:  # a reply cut short is silence: the wait does not restart
                    self.sent_at[peer] = time.monotonic()
                self.cond.notify_all()

    @staticmethod
    def _write(req: BaseHTTPRequestHandler, body: bytes) -> bool:
        """Write ``body`` in :data:`CHUNK`-byte pieces; False if the peer stalled past the
        socket's timeout or closed (then the connection ends)."""
        view = memoryview(body)
        try:
            for at in range(0, len(body), CHUNK):
                req.wfile.write(view[at : at + CHUNK])
        except OSError:
            req.close_connection = True
            return False
        return True
