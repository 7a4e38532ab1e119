"""The outer-sync protocol of independent DiLoCo islands (holmes_jax.diloco.sync),
in one process: several islands on localhost ports, fake numpy shards, no jax."""

import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from holmes_jax.core.config import DilocoConfig
from holmes_jax.core.errors import ConfigError
from holmes_jax.diloco.codec import decode, encode
from holmes_jax.diloco.rounds import SyncConfig
from holmes_jax.diloco.sync import OuterSync
from holmes_jax.diloco.transport import request
from holmes_jax.diloco.wire import pack, unpack
from tests.common import HANG_S

TIMEOUT = 1.0
CFG = SyncConfig(outer_lr=0.7, outer_momentum=0.9, quorum_timeout_s=TIMEOUT, probe_s=0.3)
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


@pytest.fixture
def islands():
    """A factory of n islands from one start state; closes them all at the end."""
    made = []

    def make(n, cfg=CFG):
        peers = free_ports(n)
        nodes = [OuterSync(i, peers, cfg, start_state()) for i in range(n)]
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


def sync_all(nodes, thetas, tokens):
    with ThreadPoolExecutor(len(nodes)) as pool:
        futures = [pool.submit(n.sync, t, k) for n, t, k in zip(nodes, thetas, tokens, strict=True)]
        return [f.result(timeout=30) for f in futures]


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


def test_dead_island_dropped_then_restart_heals_bit_for_bit(islands):
    make, made = islands
    nodes, peers = make(3)
    nodes[2].close()  # killed before it delivers round 1
    glob, mom = start_state()
    thetas = [inner(n, i) for i, n in enumerate(nodes[:2])]
    t0 = time.monotonic()
    sync_all(nodes[:2], thetas, [1, 1])
    first = time.monotonic() - t0
    assert first >= TIMEOUT  # waited for the dead one: the quorum timeout, then dropped it
    assert nodes[0].members == nodes[1].members == {0, 1}
    want_g, _ = expected(glob, mom, thetas, [1, 1])
    np.testing.assert_allclose(nodes[0].glob[KEYS[0]], want_g[KEYS[0]], rtol=1e-6)
    # the survivors keep stepping: a non-member is not waited for
    for r in range(2):
        sync_all(nodes[:2], [inner(n, 20 + r) for n in nodes[:2]], [1, 1])
    assert nodes[1].round == 3 and nodes[0].members == {0, 1}
    # restart island 2 without state: registered for the round open at its join (no delta),
    # it adopts that round's global and momentum from the leader, in step with it
    back = OuterSync(2, peers, CFG, None, shapes=SHAPES)
    made.append(back)
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(back.join)
        while 2 not in nodes[0].r.awaiting:
            time.sleep(0.01)
        assert not back.ready  # no state before the round closes
        sync_all(nodes[:2], [inner(n, 25 + i) for i, n in enumerate(nodes[:2])], [1, 1])
        joining.result(timeout=10)
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
    # several times the 0.1-s probe timeout and under the 2-s quorum timeout.
    cfg = SyncConfig(outer_lr=0.7, outer_momentum=0.9, quorum_timeout_s=2.0, probe_s=0.1)
    peers = free_ports(3)
    glob, mom = big_state()
    via = [peers, {**peers, 0: slow_relay(peers[0], 100_000)}, peers]
    nodes = [OuterSync(i, via[i], cfg, (glob, mom)) for i in range(3)]
    islands[1].extend(nodes)
    thetas = [inner(n, 15 + i) for i, n in enumerate(nodes)]

    def late(node, theta, delay):
        time.sleep(delay)
        return node.sync(theta, 1)

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(late, n, t, 1.2 * (i == 2)) for i, (n, t) in
                   enumerate(zip(nodes, thetas, strict=True))]  # fmt: skip
        [f.result(timeout=30) for f in futures]
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
    assert call(address, "POST", "/delta", pack(meta, delta), 5, island)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(address)
    ask = f"GET /result?round={meta['round']}&have={start} HTTP/1.0\r\nX-Island: {island}"
    sock.sendall(f"{ask}\r\n\r\n".encode())
    return sock


def test_a_reply_that_stalls_ends_after_the_timeout(islands):
    # 6 MB of state, over the kernel's send buffer (4 MB at most): the leader's write of
    # the step to a peer that stopped reading blocks, until the socket's timeout ends it.
    cfg = SyncConfig(outer_lr=0.7, outer_momentum=0.9, quorum_timeout_s=0.5, probe_s=0.3)
    glob = {k: np.zeros((1024, 512), np.float32) for k in KEYS}
    leader = OuterSync(0, free_ports(2), cfg, (glob, dict(glob)))
    islands[1].append(leader)
    thread = threading.Thread(target=leader.sync, args=(glob, 1), daemon=True)
    thread.start()
    stalled = stalled_participant(leader, 1)
    thread.join(timeout=HANG_S)  # ends by the socket's timeout, not by the close below
    stalled.close()
    assert not thread.is_alive()
    assert leader.r.took[1] == {1} and not leader.r.fetched.get(1)


def test_the_leader_waits_for_a_long_download_but_not_a_stalled_one(islands):
    # Island 1 downloads the 300-KB step at 200 KB/s (1.5 s, 2.5x the 0.6-s quorum
    # timeout): the leader waits for its acknowledgement, since the reply is being written
    # all along. Island 2 delivers its delta, then stops reading its result (a cut wire):
    # the leader's write to it stalls, ends after the timeout, and is not waited for.
    cfg = SyncConfig(outer_lr=0.7, outer_momentum=0.9, quorum_timeout_s=0.6, probe_s=0.3)
    peers = free_ports(3)
    rng = np.random.default_rng(4)
    glob = {k: rng.standard_normal((160, 160)).astype(np.float32) for k in KEYS}
    state = (glob, {k: np.zeros_like(v) for k, v in glob.items()})
    via = [peers, {**peers, 0: slow_relay(peers[0], None, 200_000)}]
    nodes = [OuterSync(i, via[i], cfg, state) for i in range(2)]
    islands[1].extend(nodes)
    done = {}

    def sync(node):
        node.sync(inner(node, 40 + node.island), 1)
        done[node.island] = time.monotonic()

    began = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(sync, n) for n in nodes]
        stalled = stalled_participant(nodes[0], 2)
        [f.result(timeout=30) for f in futures]
    stalled.close()
    assert nodes[0].r.took[1] == {1, 2} and nodes[0].r.fetched[1] == {1}
    assert done[1] - began > 1.2  # the download outlasted the timeout twice over
    assert done[0] >= done[1] - 0.1  # and was waited for
    assert done[0] - began < 1.5 + 2 * 0.6 + 1.0  # the stalled island was not
    assert same(nodes[0].glob, nodes[1].glob) and nodes[1].round == 1


def test_members_stay_in_step_when_their_download_is_slow(islands):
    # Island 1's link to the leader: ~0.8 s up (48-KB delta) and ~1.2 s down (96-KB global
    # and momentum) a round. Were the leader to go on as soon as it has the result, island
    # 1's next delta would reach it ~2 s after the leader's own, past the 1.5-s quorum
    # timeout, and be dropped; in step it is ~0.8 s behind.
    cfg = SyncConfig(outer_lr=0.7, outer_momentum=0.9, quorum_timeout_s=1.5, probe_s=0.3)
    peers = free_ports(2)
    via = [peers, {**peers, 0: slow_relay(peers[0], 60_000, 80_000)}]
    nodes = [OuterSync(i, via[i], cfg, big_state()) for i in range(2)]
    islands[1].extend(nodes)

    def rounds(node):  # each island goes on as soon as its sync returns
        return [(node.sync(inner(node, 20 + r), 1), sorted(node.members))[1] for r in range(2)]

    with ThreadPoolExecutor(2) as pool:
        members = [f.result(timeout=60) for f in [pool.submit(rounds, n) for n in nodes]]
    assert members == [[[0, 1]] * 2] * 2 and same(nodes[0].glob, nodes[1].glob)
    assert [(n.round, n.tokens, n.lineage) for n in nodes] == [(2, 4, "root")] * 2


def test_a_late_member_skips_a_round_and_is_in_step_after(islands):
    # Island 1's delta for round 1 comes 0.8 s after the leader's, past the 0.5-s quorum
    # timeout: refused, it rejoins and waits for round 2 without a delta, then both go on
    # together (1 s of inner steps each) and round 3 has both.
    cfg = SyncConfig(outer_lr=0.7, outer_momentum=0.9, quorum_timeout_s=0.5, probe_s=0.3)
    nodes, _ = islands[0](2, cfg)
    seen = {0: [], 1: []}

    def run(node, start):
        time.sleep(start)
        for r in range(3 if node.island == 0 else 2):
            node.sync(inner(node, 30 + r), 1)
            seen[node.island].append((node.round, sorted(node.members)))
            time.sleep(1.0)

    with ThreadPoolExecutor(2) as pool:
        [f.result(timeout=30) for f in [pool.submit(run, n, 0.8 * n.island) for n in nodes]]
    assert seen[1] == [(2, [0, 1]), (3, [0, 1])]  # skipped round 2's delta, took its result
    assert seen[0] == [(1, [0]), (2, [0, 1]), (3, [0, 1])]
    assert nodes[0].r.took[2] == {1} and nodes[0].r.took[3] == {1}  # in step: the leader waited
    assert same(nodes[0].glob, nodes[1].glob) and nodes[0].tokens == nodes[1].tokens == 4


def test_a_member_restarted_between_rounds_is_not_waited_for(islands):
    # Island 1 dies after round 1 and is back before round 2: still a member, but it sends
    # no delta for the round open at its join, so the leader must not wait for one (the
    # quorum timeout is long enough that waiting could not pass for a slow machine).
    cfg = SyncConfig(outer_lr=0.7, outer_momentum=0.9, quorum_timeout_s=120.0, probe_s=0.3)
    (a, b), peers = islands[0](2, cfg)
    sync_all([a, b], [inner(a, 1), inner(b, 2)], [1, 1])
    b.close()
    back = OuterSync(1, peers, cfg, None, shapes=SHAPES)
    islands[1].append(back)
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(back.join)
        while 1 not in a.r.awaiting:
            time.sleep(0.01)
        began = time.monotonic()
        a.sync(inner(a, 3), 1)
        assert time.monotonic() - began < 60.0
        joining.result(timeout=HANG_S)
    assert back.round == a.round == 2 and same(back.glob, a.glob) and a.members == {0, 1}


def test_leader_death_survivors_agree(islands):
    nodes, _ = islands[0](3)
    sync_all(nodes, [inner(n, i) for i, n in enumerate(nodes)], [1, 1, 1])
    nodes[0].close()  # the leader dies
    live = nodes[1:]
    for r in range(2):
        sync_all(live, [inner(n, 40 + r + i) for i, n in enumerate(live)], [1, 1])
    assert same(live[0].glob, live[1].glob) and live[0].leader == live[1].leader == 1


def test_split_goes_on_and_heal_merges_token_weighted(islands):
    nodes, _ = islands[0](2)
    a, b = nodes
    sync_all(nodes, [inner(a, 1), inner(b, 2)], [1, 1])
    fork = a.tokens
    a.cut, b.cut = {1}, {0}  # the link is cut both ways: each sees the other as dead
    for r in range(2):
        sync_all(nodes, [inner(a, 50 + r), inner(b, 60 + r)], [10, 30])
    assert a.round == b.round == 3 and not same(a.glob, b.glob) and a.lineage != b.lineage
    w_a, w_b = a.tokens - fork, b.tokens - fork
    assert (w_a, w_b) == (20, 60)
    merged = {
        k: ((w_a * a.glob[k] + w_b * b.glob[k]) / (w_a + w_b)).astype(np.float32) for k in KEYS
    }
    momentum = dict(a.mom)
    a.cut, b.cut = set(), set()  # healed: b (the higher leader) finds a before its next round
    b._heal_if_split()  # its probe runs in the background; a live peer answers at once
    assert b.prober is None
    assert same(a.glob, merged) and same(b.glob, merged) and same(b.mom, momentum)
    assert a.lineage == b.lineage == "root" and a.tokens == b.tokens == fork + w_a + w_b
    sync_all(nodes, [inner(a, 70), inner(b, 71)], [1, 1])  # one model again
    assert same(a.glob, b.glob) and a.members == {0, 1} and a.round == b.round == 4


def test_a_probe_behind_a_cut_link_costs_a_round_nothing(islands):
    """Island 1 leads a group of its own; island 0's address accepts connections and never
    answers (a cut link: the connection hangs until ``probe_s``). The round's probe returns
    after ``PROBE_WAIT_S``; the next round takes the finished probe's answer (nothing)."""
    from holmes_jax.diloco import sync as outer_sync

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # connections queue, no reply
    peers = free_ports(2)
    peers[0] = silent.getsockname()
    cfg = SyncConfig(quorum_timeout_s=TIMEOUT, probe_s=120.0)  # the probe never times out here
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
    for r in range(2):
        sync_all(nodes, [inner(n, 80 + r + i) for i, n in enumerate(nodes)], [1, 1, 1])
    assert same(b.glob, c.glob) and not same(a.glob, b.glob) and b.leader == c.leader == 1
    a.cut, b.cut, c.cut = set(), set(), set()
    for r in range(2):  # the heal round (late deltas may drop), then one with everyone
        sync_all(nodes, [inner(n, 90 + r + i) for i, n in enumerate(nodes)], [1, 1, 1])
    assert all(same(n.glob, a.glob) and n.lineage == "root" for n in nodes)
    assert a.members == {0, 1, 2} and a.round == b.round == c.round


def test_int8_wire_agrees_within_the_quantisation(islands):
    cfg = SyncConfig(outer_lr=1.0, outer_momentum=0.0, outer_dtype="int8", quorum_timeout_s=TIMEOUT)
    nodes, _ = islands[0](2, cfg)
    glob = dict(nodes[0].glob)
    thetas = [inner(n, 5 + i) for i, n in enumerate(nodes)]
    sync_all(nodes, thetas, [1, 1])
    assert same(nodes[0].glob, nodes[1].glob)
    for k in KEYS:  # lr 1, μ 0: global = the mean θ, up to half an int8 step per island
        step = max(np.abs(glob[k] - th[k]).max() for th in thetas) / 127
        np.testing.assert_allclose(nodes[0].glob[k], (thetas[0][k] + thetas[1][k]) / 2, atol=step)


def test_config_keys():
    assert DilocoConfig().mode == "spmd"
    with pytest.raises(ConfigError, match="diloco.mode=independent"):
        DilocoConfig(mode="independent").validate(None, None)
    with pytest.raises(ConfigError, match="diloco.quorum_timeout_s=0"):
        DilocoConfig(quorum_timeout_s=0).validate(None, None)
    cfg = SyncConfig.from_diloco(DilocoConfig(outer_dtype="int8", quorum_timeout_s=0.5), 640)
    assert (cfg.outer_dtype, cfg.quorum_timeout_s, cfg.probe_s) == ("int8", 0.5, 0.5)
    assert cfg.round_tokens == 640
