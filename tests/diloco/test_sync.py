"""The outer-sync protocol of independent DiLoCo islands (holmes_jax.diloco.sync),
in one process: several islands on localhost ports, fake numpy shards, no jax.

Waits are events, not margins: the quorum timeout is long (:data:`CFG`), and a test that
needs it to pass (a dead or cut island) advances that island's clock (:func:`expire`)
once the round holds every delta it will get; a connection to a dead island is refused at
once. So a loaded machine makes the tests slower, never different.
"""

import dataclasses
import functools
import socket
import sys
import threading
import time
import traceback
import urllib.parse

import numpy as np
import pytest

from holmes_jax.core.config import DilocoConfig
from holmes_jax.core.errors import ConfigError
from holmes_jax.diloco.codec import decode, encode
from holmes_jax.diloco.messages import Delta, Refused, parse_step
from holmes_jax.diloco.rounds import Rounds, SyncConfig
from holmes_jax.diloco.schedule import Schedule
from holmes_jax.diloco.sparse import PARTS, Sparse
from holmes_jax.diloco.sync import OuterSync
from holmes_jax.diloco.transport import refuses, request
from holmes_jax.diloco.wire import pack, unpack
from tests.common import HANG_S

# Timeouts no live island reaches however loaded the machine; a dead one's runs out by
# expire(). probe_s bounds a request to a live peer (a dead one refuses at once).
# down_wait_s: a test's island without a server (a raw client) is waited for like a live one
CFG = SyncConfig(
    outer_lr=0.7, outer_momentum=0.9, quorum_timeout_s=120.0, probe_s=30.0, down_wait_s=120.0
)
KEYS = ("blocks/w#0", "blocks/w#1", "embed#0")
SHAPES = dict.fromkeys(KEYS, (4, 3))


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return {i: ("127.0.0.1", p) for i, p in enumerate(ports)}


def call(address, method, path, body=b"", timeout=5.0, island=1):
    """One request as island ``island``: the 200 reply's body, else None."""
    resp = request(address, method, path, body, timeout, island)
    return resp.body if resp is not None and resp.status == 200 else None


def start_state(seed=0):
    rng = np.random.default_rng(seed)
    glob = {k: rng.standard_normal((4, 3)).astype(np.float32) for k in KEYS}
    return glob, {k: np.zeros((4, 3), np.float32) for k in KEYS}


class Clock:
    """An island's clock: real seconds plus the seconds a test added (:func:`expire`)."""

    def __init__(self):
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.ahead


def expire(node):
    """``node``'s quorum timeout passes now: its clock jumps past it, its waiters wake."""
    node.clock.ahead += node.cfg.quorum_timeout_s + node.cfg.probe_s + 1.0
    with node.cond:
        node.cond.notify_all()


def in_threads(*calls, until=None, then=None):
    """Runs each call (no arguments) in a thread of its own; their results, in order.
    Once ``until()`` holds, ``then()`` runs (a fault or an expiry the calls wait for).

    Raises AssertionError if the calls all end before ``until()`` held, or if any is
    still running after ``HANG_S`` (with its stack): a hang fails, it never blocks."""
    results, errors = [None] * len(calls), [None] * len(calls)

    def one(i):
        try:
            results[i] = calls[i]()
        except BaseException as err:  # noqa: BLE001 (raised below)
            errors[i] = err

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    end = time.monotonic() + HANG_S
    while until is not None:
        if until():
            then()
            break
        if not any(t.is_alive() for t in threads):
            raise AssertionError(f"the calls ended before {until.__name__} held")
        if time.monotonic() > end:
            raise AssertionError(f"{until.__name__} never held in {HANG_S} s")
        time.sleep(0.005)
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    stuck = [t for t in threads if t.is_alive()]
    if stuck:
        frames = sys._current_frames()
        stacks = ["".join(traceback.format_stack(frames[t.ident])) for t in stuck]
        raise AssertionError(
            f"{len(stuck)} calls still running after {HANG_S} s:\n" + "\n".join(stacks)
        )
    for err in errors:
        if err is not None:
            raise err
    return results


@pytest.fixture
def islands():
    """A factory of n islands from one start state; closes them all at the end."""
    made = []

    def make(n, cfg=CFG):
        peers = free_ports(n)
        nodes = [OuterSync(i, peers, cfg, start_state(), clock=Clock()) for i in range(n)]
        made.extend(nodes)
        return nodes, peers

    yield make, made
    for node in made:
        try:
            node.close()
        except OSError:
            pass


def inner(node, seed):
    """A fake inner phase: θ = global + noise."""
    rng = np.random.default_rng(seed)
    return {
        k: v + 0.1 * rng.standard_normal(v.shape).astype(np.float32) for k, v in node.glob.items()
    }


def sync_all(nodes, thetas, tokens, until=None, then=None):
    """Every node's :meth:`~OuterSync.sync` at once (:func:`in_threads`); the new globals."""
    calls = [functools.partial(n.sync, t, k) for n, t, k in zip(nodes, thetas, tokens, strict=True)]
    return in_threads(*calls, until=until, then=then)


def holding(node, islands):
    """``node``'s open round holds the deltas of ``islands`` (it waits for the rest)."""

    def holds():
        with node.cond:
            return set(node.r.open) == set(islands)

    holds.__name__ = f"island {node.island}'s round holding {sorted(islands)}"
    return holds


def expected(glob, mom, thetas, tokens):
    """The outer step by hand: token-weighted mean delta, then Nesterov."""
    out_g, out_m = {}, {}
    for k in glob:
        avg = sum(t * (glob[k] - th[k]) for th, t in zip(thetas, tokens, strict=True)) / sum(tokens)
        m = 0.9 * mom[k] + avg
        out_g[k], out_m[k] = glob[k] - 0.7 * (avg + 0.9 * m), m
    return out_g, out_m


def same(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_codec_bounds():
    x = np.random.default_rng(1).standard_normal((5, 7)).astype(np.float32)
    q, s = encode(x, "int8")
    assert q.dtype == np.int8 and np.max(np.abs(decode(q, s) - x)) <= s / 2 + 1e-7
    b, s = encode(x, "bf16")
    assert b.dtype == np.uint16 and np.allclose(decode(b, s), x, rtol=2**-8, atol=0)
    assert np.array_equal(decode(*encode(x, "fp32")), x)


def test_round_agrees_and_is_token_weighted(islands):
    nodes, peers = islands[0](3)
    glob, mom = start_state()
    thetas = [inner(n, 10 + i) for i, n in enumerate(nodes)]
    tokens = [100, 300, 600]
    start = urllib.parse.quote(nodes[1].r.key())
    out = sync_all(nodes, thetas, tokens)
    # a member that holds the round's start fetches the mean delta only: half the state
    step = call(peers[0], "GET", f"/result?round=1&have={start}", timeout=5)
    whole = call(peers[0], "GET", "/result?round=1", timeout=5)
    assert unpack(step)[0]["kind"] == "step" and unpack(step)[1].keys() == set(KEYS)
    nbytes = lambda body: sum(a.nbytes for a in unpack(body)[1].values())  # noqa: E731
    assert len(unpack(whole)[1]) == 2 * len(KEYS) and 2 * nbytes(step) == nbytes(whole)
    want_g, want_m = expected(glob, mom, thetas, tokens)
    for n, g in zip(nodes, out, strict=True):
        assert same(g, nodes[0].glob) and same(n.mom, nodes[0].mom) and n.round == 1
        for k in KEYS:
            np.testing.assert_allclose(g[k], want_g[k], rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(n.mom[k], want_m[k], rtol=1e-6, atol=1e-6)


def wait_for(holds):
    """Returns once ``holds()`` is true (an event another thread brings about)."""
    end = time.monotonic() + HANG_S
    while not holds():
        assert time.monotonic() < end, f"{holds.__name__} never held"
        time.sleep(0.005)


def awaiting(node, island):
    """``island`` has joined ``node`` and waits for the round open at its join."""

    def joined():
        with node.cond:
            return island in node.r.awaiting

    joined.__name__ = f"island {island} awaiting island {node.island}'s round"
    return joined


def test_dead_island_dropped_then_restart_heals_bit_for_bit(islands):
    make, made = islands
    nodes, peers = make(3)
    nodes[2].close()  # killed before it delivers round 1
    glob, mom = start_state()
    thetas = [inner(n, i) for i, n in enumerate(nodes[:2])]

    def the_dead_one_is_waited_for():
        with nodes[0].cond:  # not due with island 2 missing, until the timeout passes
            assert nodes[0].r.open and not nodes[0].r.due(nodes[0].clock())
        expire(nodes[0])

    sync_all(nodes[:2], thetas, [1, 1], until=holding(nodes[0], {0, 1}),
             then=the_dead_one_is_waited_for)  # fmt: skip
    assert nodes[0].members == nodes[1].members == {0, 1}
    want_g, _ = expected(glob, mom, thetas, [1, 1])
    np.testing.assert_allclose(nodes[0].glob[KEYS[0]], want_g[KEYS[0]], rtol=1e-6)
    # the survivors keep stepping: a non-member is not waited for
    for r in range(2):
        sync_all(nodes[:2], [inner(n, 20 + r) for n in nodes[:2]], [1, 1])
    assert nodes[1].round == 3 and nodes[0].members == {0, 1}
    # restart island 2 without state: registered for the round open at its join (no delta),
    # it adopts that round's global and momentum from the leader, in step with it
    back = OuterSync(2, peers, CFG, None, shapes=SHAPES, clock=Clock())
    made.append(back)

    def round_with_the_joiner():
        assert not back.ready  # no state before the round closes
        sync_all(nodes[:2], [inner(n, 25 + i) for i, n in enumerate(nodes[:2])], [1, 1])

    in_threads(back.join, until=awaiting(nodes[0], 2), then=round_with_the_joiner)
    assert same(back.glob, nodes[0].glob) and same(back.mom, nodes[0].mom)
    assert back.round == nodes[0].round == 4 and back.lineage == nodes[0].lineage
    assert nodes[0].r.took[4] == {1, 2}  # the leader's round waited for the joiner's ack too
    everyone = [nodes[0], nodes[1], back]
    before = dict(nodes[0].glob), dict(nodes[0].mom)
    thetas = [inner(n, 30 + i) for i, n in enumerate(everyone)]
    sync_all(everyone, thetas, [1, 2, 3])  # the rejoined island takes part again
    want_g, _ = expected(*before, thetas, [1, 2, 3])
    assert all(same(n.glob, back.glob) for n in everyone) and nodes[0].members == {0, 1, 2}
    np.testing.assert_allclose(back.glob[KEYS[1]], want_g[KEYS[1]], rtol=1e-6)


def test_a_down_island_is_not_waited_for_by_default(islands):
    # After a round of three, island 2's process is gone: its port refuses. The leader's
    # probe finds it down and closes the round with islands 0 and 1, no quorum timeout
    # passed (a wait would be a hang, which fails); island 2 leaves the members.
    nodes, _ = islands[0](3, dataclasses.replace(CFG, down_wait_s=0.0))  # the default
    sync_all(nodes, [inner(n, 10 + i) for i, n in enumerate(nodes)], [1, 1, 1])
    nodes[2].close()
    glob, mom = dict(nodes[0].glob), dict(nodes[0].mom)
    thetas = [inner(n, i) for i, n in enumerate(nodes[:2])]
    sync_all(nodes[:2], thetas, [1, 1])
    assert nodes[0].round == nodes[1].round == 2 and nodes[0].members == {0, 1}
    want_g, _ = expected(glob, mom, thetas, [1, 1])
    np.testing.assert_allclose(nodes[1].glob[KEYS[0]], want_g[KEYS[0]], rtol=1e-6)


def own_delta(island, lineage):
    """Island ``island``'s delta of zeros for round 1 (for a :class:`Rounds` without sockets)."""
    values = {k: np.zeros((4, 3), np.float32) for k in KEYS}
    return Delta(island, 1, lineage, 1, frozenset(), False, values)


def test_the_leader_finds_down_members_by_a_refused_connection(islands):
    # _find_down marks the missing member whose port refuses, not one that accepts and
    # is silent (a hung or slow process: waited for up to the quorum timeout), and only
    # once this island has heard from it (before, it may not have started yet)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    peers = free_ports(3)
    peers[1] = silent.getsockname()
    a = OuterSync(0, peers, CFG, start_state(), clock=Clock())
    islands[1].append(a)
    try:
        assert refuses(peers[2], 1.0) and not refuses(peers[1], 1.0)
        with a.cond:
            assert a.r.accept(own_delta(0, a.lineage), a.clock())
            a._find_down()
            assert a.r.down == set()  # never heard from: perhaps not started
        assert call(peers[0], "GET", "/status", island=1) and call(
            peers[0], "GET", "/status", island=2
        )
        with a.cond:
            a._find_down()
            assert a.r.missing() == {1, 2} and a.r.down == {2}
            assert not a.r.due(a.clock())  # island 1 may still come
    finally:
        silent.close()


def test_down_wait_s_bounds_the_wait_for_down_members():
    r = Rounds(0, [0, 1, 2], dataclasses.replace(CFG, down_wait_s=5.0), start_state())
    assert r.accept(own_delta(0, r.lineage), 100.0)
    r.down = {2}
    assert not r.due(200.0)  # island 1 is missing and not down: the quorum timeout rules
    r.down = {1, 2}
    assert not r.due(104.9) and r.due(105.0)
    r.close()
    assert r.members == {0} and r.down == set()


def slow_relay(target, up, down=None):
    """A TCP relay to ``target`` that carries what a client sends at ``up`` bytes a second
    and the replies at ``down`` (None: at full speed): a slow link in one process, whose
    small buffer toward ``target`` holds back the server's writes as a slow wire does.
    Returns its address."""
    listener = socket.create_server(("127.0.0.1", 0))

    def pump(src, dst, rate):
        try:
            while data := src.recv(4096 if rate else 1 << 16):
                dst.sendall(data)
                time.sleep(len(data) / rate if rate else 0)
        except OSError:
            pass
        finally:
            dst.close()

    def serve():
        while True:
            client, _ = listener.accept()
            server = socket.socket()
            server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
            server.connect(target)
            threading.Thread(target=pump, args=(client, server, up), daemon=True).start()
            threading.Thread(target=pump, args=(server, client, down), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()


def big_state(seed=3):
    """48 KB of global model: transfers that take a visible time through a slow relay."""
    rng = np.random.default_rng(seed)
    glob = {k: rng.standard_normal((64, 64)).astype(np.float32) for k in KEYS}
    return glob, {k: np.zeros_like(v) for k, v in glob.items()}


def test_slow_uploads_and_late_rounds_are_not_a_dead_leader(islands):
    # Island 1 reaches the leader over a slow link: its 48-KB delta takes ~0.5 s to upload.
    # Island 2 arrives 1.2 s late, so island 1 then waits ~0.7 s for the result. Both are
    # several times the 0.1-s probe timeout: neither makes island 1 take the lead.
    cfg = SyncConfig(outer_lr=0.7, outer_momentum=0.9, quorum_timeout_s=120.0, probe_s=0.1)
    peers = free_ports(3)
    glob, mom = big_state()
    via = [peers, {**peers, 0: slow_relay(peers[0], 100_000)}, peers]
    nodes = [OuterSync(i, via[i], cfg, (glob, mom)) for i in range(3)]
    islands[1].extend(nodes)
    thetas = [inner(n, 15 + i) for i, n in enumerate(nodes)]

    def late(node, theta, delay):
        time.sleep(delay)  # the fault: a late island
        return node.sync(theta, 1)

    in_threads(*[functools.partial(late, n, t, 1.2 * (i == 2))
                 for i, (n, t) in enumerate(zip(nodes, thetas, strict=True))])  # fmt: skip
    assert all(n.round == 1 and n.lineage == "root" and same(n.glob, nodes[0].glob) for n in nodes)
    assert nodes[0].members == {0, 1, 2}
    want_g, _ = expected(glob, mom, thetas, [1, 1, 1])
    np.testing.assert_allclose(nodes[1].glob[KEYS[0]], want_g[KEYS[0]], rtol=1e-6, atol=1e-6)


def stalled_participant(leader, island):
    """Island ``island`` delivers a delta for ``leader``'s round, asks for the result, and
    never reads it (a cut wire). Returns its socket."""
    meta = {"island": island, "round": leader.round + 1, "tokens": 1, "dead": []}
    meta.update(lineage=leader.lineage, scales=dict.fromkeys(leader.glob, 1.0))
    delta = {k: np.full_like(v, 0.01) for k, v in leader.glob.items()}
    address, start = leader.peers[leader.island], urllib.parse.quote(leader.r.key())
    assert call(address, "POST", "/delta", pack(meta, delta), HANG_S, island)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(address)
    ask = f"GET /result?round={meta['round']}&have={start} HTTP/1.0\r\nX-Island: {island}"
    sock.sendall(f"{ask}\r\n\r\n".encode())
    return sock


def writing(node, island, now):
    """``node``'s reply of a result to ``island`` is being written (``now`` True) or was,
    and has ended (False)."""

    def state():
        with node.cond:
            return node.sending.get(island) == (1 if now else 0)

    state.__name__ = f"island {node.island}'s reply to {island} {'in flight' if now else 'ended'}"
    return state


# A socket silent 0.5 s ends (the stalled replies below); no live island meets the quorum
# timeout, which the tests pass with expire() once the reply they wait for is in flight.
STALLS = dataclasses.replace(CFG, probe_s=0.3, reply_timeout_s=0.5)


def test_a_reply_that_stalls_ends_after_the_timeout(islands):
    # 6 MB of state, over the kernel's send buffer (4 MB at most): the leader's write of
    # the step to a peer that stopped reading blocks, until the socket's timeout ends it.
    glob = {k: np.zeros((1024, 512), np.float32) for k in KEYS}
    leader = OuterSync(0, free_ports(2), STALLS, (glob, dict(glob)), clock=Clock())
    islands[1].append(leader)
    stalled = []

    def stall():
        stalled.append(stalled_participant(leader, 1))
        wait_for(writing(leader, 1, now=False))  # ended by the socket's timeout
        expire(leader)  # then it is not waited for

    in_threads(functools.partial(leader.sync, glob, 1), stall)
    stalled[0].close()
    assert leader.r.took[1] == {1} and not leader.r.fetched.get(1)


def test_the_leader_waits_for_a_long_download_but_not_a_stalled_one(islands):
    # Island 1 downloads the 300-KB step at 200 KB/s (1.5 s); the leader's quorum timeout
    # passes meanwhile, and it still waits for island 1's acknowledgement, since the reply
    # is being written all along. Island 2 delivers its delta, then stops reading its
    # result (a cut wire): the leader's write to it stalls, ends after the socket's
    # timeout, and is not waited for.
    peers = free_ports(3)
    rng = np.random.default_rng(4)
    glob = {k: rng.standard_normal((160, 160)).astype(np.float32) for k in KEYS}
    state = (glob, {k: np.zeros_like(v) for k, v in glob.items()})
    via = [peers, {**peers, 0: slow_relay(peers[0], None, 200_000)}]
    nodes = [OuterSync(i, via[i], STALLS, state, clock=Clock()) for i in range(2)]
    islands[1].extend(nodes)
    acked = {}

    def sync(node):
        node.sync(inner(node, 40 + node.island), 1)
        with node.cond:
            acked[node.island] = set(node.r.fetched.get(1, ()))

    stalled = []
    in_threads(functools.partial(sync, nodes[0]), functools.partial(sync, nodes[1]),
               lambda: stalled.append(stalled_participant(nodes[0], 2)),
               until=writing(nodes[0], 1, now=True), then=lambda: expire(nodes[0]))  # fmt: skip
    stalled[0].close()
    assert nodes[0].r.took[1] == {1, 2}
    assert acked[0] == {1}  # the leader returned with island 1's acknowledgement, not 2's
    assert same(nodes[0].glob, nodes[1].glob) and nodes[1].round == 1


def test_members_stay_in_step_when_their_download_is_slow(islands):
    # Island 1's link to the leader: ~0.8 s up (48-KB delta) and ~1.2 s down (96-KB global
    # and momentum) a round. The leader goes on only once island 1 has the result (its
    # acknowledgement), so island 1's next delta follows the leader's by its upload time,
    # not by its download time too (which would have it dropped at a shorter timeout).
    peers = free_ports(2)
    via = [peers, {**peers, 0: slow_relay(peers[0], 60_000, 80_000)}]
    nodes = [OuterSync(i, via[i], CFG, big_state(), clock=Clock()) for i in range(2)]
    islands[1].extend(nodes)
    acked = []

    def rounds(node):  # each island goes on as soon as its sync returns
        members = []
        for r in range(2):
            node.sync(inner(node, 20 + r), 1)
            members.append(sorted(node.members))
            if node.island == 0:
                with node.cond:
                    acked.append(set(node.r.fetched.get(node.round, ())))
        return members

    members = in_threads(*[functools.partial(rounds, n) for n in nodes])
    assert acked == [{1}, {1}]  # each round's sync returned with island 1's acknowledgement
    assert members == [[[0, 1]] * 2] * 2 and same(nodes[0].glob, nodes[1].glob)
    assert [(n.round, n.tokens, n.lineage) for n in nodes] == [(2, 4, "root")] * 2


def test_a_late_member_skips_a_round_and_is_in_step_after(islands):
    # Island 1's delta for round 1 comes after the leader closed it (its quorum timeout
    # passed with island 0's delta alone): refused, island 1 rejoins and waits for round 2
    # without a delta; round 3 has both.
    (lead, late), _ = islands[0](2)
    seen = {0: [], 1: []}

    def step(node, r):
        node.sync(inner(node, 30 + r), 1)
        seen[node.island].append((node.round, sorted(node.members)))

    def leader():
        step(lead, 0)
        wait_for(awaiting(lead, 1))  # island 1 has rejoined for round 2
        step(lead, 1)
        step(lead, 2)

    def member():
        wait_for(lambda: lead.round >= 1)  # round 1 is closed: island 1 is late
        step(late, 0)
        step(late, 1)

    in_threads(leader, member, until=holding(lead, {0}), then=lambda: expire(lead))
    assert seen[1] == [(2, [0, 1]), (3, [0, 1])]  # skipped round 2's delta, took its result
    assert seen[0] == [(1, [0]), (2, [0, 1]), (3, [0, 1])]
    assert lead.r.took[2] == {1} and lead.r.took[3] == {1}  # in step: the leader waited
    assert same(lead.glob, late.glob) and lead.tokens == late.tokens == 4


def test_a_member_restarted_between_rounds_is_not_waited_for(islands):
    # Island 1 dies after round 1 and is back before round 2: still a member, but it sends
    # no delta for the round open at its join, so the leader must not wait for one (the
    # quorum timeout is never passed here: a wait would be a hang, which fails).
    (a, b), peers = islands[0](2)
    sync_all([a, b], [inner(a, 1), inner(b, 2)], [1, 1])
    b.close()
    back = OuterSync(1, peers, CFG, None, shapes=SHAPES, clock=Clock())
    islands[1].append(back)
    took = []

    def round_with_the_joiner():
        began = time.monotonic()
        a.sync(inner(a, 3), 1)
        took.append(time.monotonic() - began)

    in_threads(back.join, until=awaiting(a, 1), then=round_with_the_joiner)
    assert took[0] < CFG.quorum_timeout_s / 2  # not waited for
    assert back.round == a.round == 2 and same(back.glob, a.glob) and a.members == {0, 1}


def test_leader_death_survivors_agree(islands):
    nodes, _ = islands[0](3)
    sync_all(nodes, [inner(n, i) for i, n in enumerate(nodes)], [1, 1, 1])
    nodes[0].close()  # the leader dies
    live = nodes[1:]
    for r in range(2):
        sync_all(live, [inner(n, 40 + r + i) for i, n in enumerate(live)], [1, 1])
    assert same(live[0].glob, live[1].glob) and live[0].leader == live[1].leader == 1


def heal(node):
    """``node``, a group's leader, probes for another lineage and joins the one it finds,
    as its next round would (the probe runs in the background; on a loaded machine it
    may outlast one round's wait, and the next call takes its answer)."""
    node._heal_if_split()
    while node.prober is not None:
        node.prober.join(HANG_S)
        node._heal_if_split()


def test_split_goes_on_and_heal_merges_token_weighted(islands):
    nodes, _ = islands[0](2)
    a, b = nodes
    sync_all(nodes, [inner(a, 1), inner(b, 2)], [1, 1])
    fork = a.tokens
    a.cut, b.cut = {1}, {0}  # the link is cut both ways: each sees the other as dead
    # island 0 waits for island 1 until its quorum timeout; island 1 cannot reach its
    # leader, takes the lead of a group of its own and closes its rounds alone
    sync_all(nodes, [inner(a, 50), inner(b, 60)], [10, 30], until=holding(a, {0}),
             then=lambda: expire(a))  # fmt: skip
    sync_all(nodes, [inner(a, 51), inner(b, 61)], [10, 30])
    assert a.round == b.round == 3 and not same(a.glob, b.glob) and a.lineage != b.lineage
    w_a, w_b = a.tokens - fork, b.tokens - fork
    assert (w_a, w_b) == (20, 60)
    merged = {
        k: ((w_a * a.glob[k] + w_b * b.glob[k]) / (w_a + w_b)).astype(np.float32) for k in KEYS
    }
    momentum = dict(a.mom)
    a.cut, b.cut = set(), set()  # healed: b (the higher leader) finds a before its next round
    heal(b)
    assert same(a.glob, merged) and same(b.glob, merged) and same(b.mom, momentum)
    assert a.lineage == b.lineage == "root" and a.tokens == b.tokens == fork + w_a + w_b
    sync_all(nodes, [inner(a, 70), inner(b, 71)], [1, 1])  # one model again
    assert same(a.glob, b.glob) and a.members == {0, 1} and a.round == b.round == 4


def test_a_probe_behind_a_cut_link_costs_a_round_nothing(islands):
    """Island 1 leads a group of its own; island 0's address accepts connections and never
    answers (a cut link: the connection hangs until ``probe_s``). The round's probe returns
    after ``PROBE_WAIT_S``; the next round takes the finished probe's answer (nothing)."""
    from holmes_jax.diloco import leader as outer_sync

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # connections queue, no reply
    peers = free_ports(2)
    peers[0] = silent.getsockname()
    cfg = SyncConfig(quorum_timeout_s=120.0, probe_s=120.0)  # the probe never times out here
    b = OuterSync(1, peers, cfg, start_state())
    try:
        b.r.leader, b.r.members = 1, {1}
        began = time.monotonic()
        b._heal_if_split()
        took = time.monotonic() - began
        assert outer_sync.PROBE_WAIT_S <= took < 60.0 and b.prober.is_alive()
        silent.close()  # the hanging connection is reset: the background probe ends
        b.prober.join(HANG_S)
        b._heal_if_split()
        assert b.prober is None and b.lineage == "root"
    finally:
        b.close()
        silent.close()


def test_split_of_a_group_heals_into_one_model(islands):
    nodes, _ = islands[0](3)
    a, b, c = nodes
    a.cut, b.cut, c.cut = {1, 2}, {0}, {0}  # island 0 alone | islands 1 and 2
    for r in range(2):  # island 0 waits for the others once, until its quorum timeout
        sync_all(nodes, [inner(n, 80 + r + i) for i, n in enumerate(nodes)], [1, 1, 1],
                 until=holding(a, {0}) if r == 0 else None, then=lambda: expire(a))  # fmt: skip
    assert same(b.glob, c.glob) and not same(a.glob, b.glob) and b.leader == c.leader == 1
    a.cut, b.cut, c.cut = set(), set(), set()
    heal(b)  # the group's leader finds island 0's lineage and merges into it
    assert b.lineage == "root" and b.leader == 0 and c.lineage != "root"
    # island 2 learns at its next sync: its leader refuses its delta (another lineage now),
    # so it joins island 0 and sends the delta there, where the next round takes it
    in_threads(lambda: c.sync(inner(c, 90), 1), until=holding(a, {2}),
               then=lambda: sync_all([a, b], [inner(a, 91), inner(b, 92)], [1, 1]))  # fmt: skip
    assert all(same(n.glob, a.glob) and n.lineage == "root" for n in nodes)
    assert a.members == {0, 1, 2} and a.round == b.round == c.round


def test_int8_wire_agrees_within_the_quantisation(islands):
    cfg = SyncConfig(outer_lr=1.0, outer_momentum=0.0, outer_dtype="int8", quorum_timeout_s=120.0)
    nodes, _ = islands[0](2, cfg)
    glob = dict(nodes[0].glob)
    thetas = [inner(n, 5 + i) for i, n in enumerate(nodes)]
    sync_all(nodes, thetas, [1, 1])
    assert same(nodes[0].glob, nodes[1].glob)
    for k in KEYS:  # lr 1, μ 0: global = the mean θ, up to half an int8 step per island
        step = max(np.abs(glob[k] - th[k]).max() for th in thetas) / 127
        np.testing.assert_allclose(nodes[0].glob[k], (thetas[0][k] + thetas[1][k]) / 2, atol=step)


def test_sparse_rounds_are_bit_identical_and_lose_nothing(islands):
    """Sparse deltas (one chunk of a key's 12 values, 2 sent at 32 bits; lr 1, μ 0): every
    island applies the same step bit for bit, and over three rounds the global model moved
    by the mean of what the islands' deltas summed to minus what their buffers still keep
    (error feedback: dropped values are sent later, none is lost)."""
    sp = Sparse(chunk=16, k=2, bits=32)
    cfg = dataclasses.replace(CFG, outer_lr=1.0, outer_momentum=0.0, outer_dtype="sparse")
    nodes, _ = islands[0](3, dataclasses.replace(cfg, sparse=sp))
    start = dict(nodes[0].glob)
    total = [dict.fromkeys(KEYS, 0.0) for _ in nodes]
    for r in range(3):
        thetas = [inner(n, 40 + 3 * r + i) for i, n in enumerate(nodes)]
        for t, n, theta in zip(total, nodes, thetas, strict=True):
            for k in KEYS:
                t[k] = t[k] + (n.glob[k] - theta[k])
        sync_all(nodes, thetas, [1, 1, 1])
        assert all(same(n.glob, nodes[0].glob) for n in nodes)
    for n in nodes:  # two of twelve values sent a round: most are still kept
        assert all(np.count_nonzero(n.feedback.buffers[k]) > 6 for k in KEYS)
    for k in KEYS:
        kept = [t[k] - n.feedback.buffers[k] for t, n in zip(total, nodes, strict=True)]
        np.testing.assert_allclose(start[k] - nodes[0].glob[k], sum(kept) / 3, atol=1e-5)


def test_sparse_sending_every_value_at_32_bits_is_fp32_diloco(islands):
    sp = Sparse(chunk=16, k=16, bits=32)  # k = chunk: nothing dropped
    dense, _ = islands[0](2)
    sparse_nodes, _ = islands[0](2, dataclasses.replace(CFG, outer_dtype="sparse", sparse=sp))
    for r in range(2):
        for nodes in (dense, sparse_nodes):
            sync_all(nodes, [inner(n, 60 + 2 * r + i) for i, n in enumerate(nodes)], [1, 3])
    for k in KEYS:
        np.testing.assert_allclose(sparse_nodes[1].glob[k], dense[1].glob[k], rtol=0, atol=1e-6)
        np.testing.assert_allclose(sparse_nodes[1].mom[k], dense[1].mom[k], rtol=0, atol=1e-6)


def test_fragments_take_turns_and_only_their_keys_move(islands):
    """Two fragments (H 4): round 1 carries fragment 1's keys, round 2 fragment 0's; each
    round's step moves only its keys, as the hand-computed outer step says (the keys not in
    it keep their global and momentum), on both islands alike. A delta for round 3 that
    carries fragment 0's keys is refused in one line naming a missing key."""
    made = islands[1]
    keys = ("blocks/w@0#0", "blocks/w@1#0", "embed@0#0", "head@1#0")
    rng = np.random.default_rng(3)
    glob = {k: rng.standard_normal((4, 3)).astype(np.float32) for k in keys}
    mom = {k: np.zeros((4, 3), np.float32) for k in keys}
    cfg = dataclasses.replace(CFG, schedule=Schedule(inner_steps=4, fragments=2))
    peers = free_ports(2)
    nodes = [OuterSync(i, peers, cfg, (glob, mom), clock=Clock()) for i in range(2)]
    made.extend(nodes)
    for rnd, fragment in ((1, 1), (2, 0)):
        mine = [k for k in keys if k.split("#")[0].endswith(f"@{fragment}")]
        before = [dict(nodes[0].glob), dict(nodes[0].mom)]
        thetas = [{k: inner(n, 70 + rnd + i)[k] for k in mine} for i, n in enumerate(nodes)]
        sync_all(nodes, thetas, [1, 3])
        want_g, want_m = expected(*({k: d[k] for k in mine} for d in before), thetas, [1, 3])
        for n in nodes:
            assert n.round == rnd and same(n.glob, nodes[0].glob)
            for k in keys:
                g, m = (want_g[k], want_m[k]) if k in mine else (before[0][k], before[1][k])
                np.testing.assert_allclose(n.glob[k], g, rtol=1e-6, atol=1e-6)
                np.testing.assert_allclose(n.mom[k], m, rtol=1e-6, atol=1e-6)
    wrong = {k: glob[k] for k in ("blocks/w@0#0", "embed@0#0")}  # round 3 is fragment 1's
    meta = {"island": 1, "round": 3, "tokens": 1, "dead": [], "lineage": "root"}
    meta["scales"] = dict.fromkeys(wrong, 1.0)
    resp = request(peers[0], "POST", "/delta", pack(meta, wrong), 5.0, 1)
    assert resp.status == 400 and "keys missing ['blocks/w@1#0'" in resp.reason


def test_the_bytes_each_island_sends_are_counted_at_the_transport(islands):
    """Two islands, one round, 512x512 keys: what the member sent is what the leader
    received (bodies and trailers, counted where they cross the socket), and a sparse
    delta (64 of 4096 values, 2 bits; 139x on the arrays alone) is over 120x fewer bytes
    than fp32 on the wire, its meta included."""
    made = islands[1]
    rng = np.random.default_rng(8)
    glob = {k: rng.standard_normal((512, 512)).astype(np.float32) for k in KEYS}
    sent, back = {}, {}
    for dtype in ("fp32", "sparse"):
        cfg = dataclasses.replace(
            CFG, outer_dtype=dtype, sparse=Sparse(k=64, bits=2) if dtype == "sparse" else None
        )
        peers = free_ports(2)
        nodes = [
            OuterSync(
                i, peers, cfg, ({k: v.copy() for k, v in glob.items()}, _zeros(glob)), clock=Clock()
            )
            for i in range(2)
        ]
        made.extend(nodes)
        thetas = [{k: v + 0.01 * (i + 1) for k, v in glob.items()} for i in range(2)]
        sync_all(nodes, thetas, [1, 1])
        wait_for(served(nodes))  # a reply's bytes count once its server thread has sent it
        (lead_sent, lead_got), (member_sent, member_got) = (n.traffic.totals() for n in nodes)
        assert member_sent == lead_got and lead_sent == member_got > 0, dtype
        sent[dtype] = member_sent
        back[dtype] = lead_sent
    assert sent["fp32"] > 3 * 512 * 512 * 4 and sent["fp32"] / sent["sparse"] > 120, sent
    # the sparse step back relays the leader's own delta: one delta's bytes, not the mean's
    assert back["sparse"] < 1.05 * sent["sparse"], (back, sent)


def test_a_sparse_step_relays_the_deltas_and_every_island_takes_the_same_mean(islands):
    """Three islands, sparse deltas (8 of each 64 values, 2 bits), lr 1, μ 0: the leader
    relays the deltas as they were sent rather than re-encoding their mean, each member
    fetching the others'; every island decodes them and takes the token-weighted mean of
    the values the islands sent (their deltas minus what their buffers kept), bit for bit
    alike. A relayed delta that breaks a delta's rules is refused in one line."""
    sp = Sparse(chunk=64, k=8, bits=2)
    cfg = dataclasses.replace(CFG, outer_lr=1.0, outer_momentum=0.0, outer_dtype="sparse")
    rng = np.random.default_rng(9)
    start = {k: rng.standard_normal((64, 64)).astype(np.float32) for k in KEYS}
    peers = free_ports(3)
    state = lambda: ({k: v.copy() for k, v in start.items()}, _zeros(start))  # noqa: E731
    sparse_cfg = dataclasses.replace(cfg, sparse=sp)
    nodes = [OuterSync(i, peers, sparse_cfg, state(), clock=Clock()) for i in range(3)]
    islands[1].extend(nodes)
    thetas = [inner(n, 90 + i) for i, n in enumerate(nodes)]
    sync_all(nodes, thetas, [1, 2, 3])
    assert nodes[0].r.step[1]["encoding"] == "relay"
    assert all(same(n.glob, nodes[0].glob) for n in nodes)
    for k in KEYS:
        sent = [
            start[k] - th[k] - n.feedback.buffers[k] for th, n in zip(thetas, nodes, strict=True)
        ]
        want = (1 * sent[0] + 2 * sent[1] + 3 * sent[2]) / 6
        np.testing.assert_allclose(start[k] - nodes[0].glob[k], want, rtol=0, atol=1e-6)
    body = nodes[0].r.step_body(1)  # what island 1 fetches: islands 0 and 2's deltas
    meta, arrays = unpack(body)
    assert {name.split("/")[0] for name in arrays} == {"i0", "i2"}
    assert sorted(arrays) == [f"i{i}/{p}" for i in (0, 2) for p in sorted(PARTS)]  # 4 each
    bad = dict(arrays)
    bad["i2/count"] = bad["i2/count"].copy()
    bad["i2/count"][:2] = [9, 7]  # the same total, not k in each chunk
    expect = nodes[1].r.expect
    with pytest.raises(Refused, match=r"^island 2's array .*\|count: must be ceil\(k=8"):
        parse_step(meta, bad, expect, 1, _zeros(start))
    with pytest.raises(Refused, match="which sent nothing this round"):
        parse_step(meta, arrays, expect, 1, None)


def served(nodes):
    """No request is being served by any of ``nodes`` (every reply counted)."""

    def idle():
        return all(n.server.active == 0 for n in nodes)

    idle.__name__ = "every request served"
    return idle


def _zeros(tree):
    return {k: np.zeros_like(v) for k, v in tree.items()}


def test_config_keys():
    assert DilocoConfig().mode == "spmd"
    with pytest.raises(ConfigError, match="diloco.mode=independent"):
        DilocoConfig(mode="independent").validate(None, None)
    with pytest.raises(ConfigError, match="diloco.quorum_timeout_s=0"):
        DilocoConfig(quorum_timeout_s=0).validate(None, None)
    cfg = SyncConfig.from_diloco(DilocoConfig(outer_dtype="int8", quorum_timeout_s=0.5), 640)
    assert (cfg.outer_dtype, cfg.quorum_timeout_s, cfg.probe_s) == ("int8", 0.5, 0.5)
    assert cfg.round_tokens == 640
