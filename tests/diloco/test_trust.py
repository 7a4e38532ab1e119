"""What a hostile or broken peer can do to the outer sync: nothing (holmes_jax.diloco).

Three islands on localhost share a key. Between rounds (and, for a member's delta, during
one) a third party sends requests of its own making: without a tag, with another key,
replayed, stale, garbage, truncated, lying about lengths, with wrong keys, shapes, dtypes,
NaN and Inf, absurd token counts, unknown islands and fake lineages. Each is refused with
its reason; then an honest round runs and every island's model equals the round computed
by hand from the state before the attack, so the attack changed nothing.
"""

import dataclasses
import functools
import http.client
import os
import socket
import subprocess
import time

import ml_dtypes
import numpy as np
import pytest

from holmes_jax.cluster import island_jobs
from holmes_jax.core.config import load_config
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.keyfile import read_key
from holmes_jax.diloco import auth, messages
from holmes_jax.diloco.auth import Signer, tag
from holmes_jax.diloco.messages import Delta, Expect, Refused, parse_delta
from holmes_jax.diloco.rounds import Rounds, SyncConfig
from holmes_jax.diloco.sync import OuterSync
from holmes_jax.diloco.transport import (
    Security,
    Unreachable,
    client_context,
    read_body,
    refuses,
    server_context,
)
from holmes_jax.diloco.wire import WireError, pack, unpack
from tests.diloco.test_sync import (
    KEYS,
    expected,
    free_ports,
    in_threads,
    inner,
    same,
    start_state,
    sync_all,
    wait_for,
)

KEY = b"0123456789abcdef0123456789abcdef"
CFG = SyncConfig(
    outer_lr=0.7, outer_momentum=0.9, quorum_timeout_s=1.0, probe_s=0.3, round_tokens=1000
)
# The trio's: a round that waited for its quorum timeout could not pass for a slow machine.
PATIENT = dataclasses.replace(CFG, quorum_timeout_s=120.0)


@pytest.fixture
def trio():
    """Three islands sharing :data:`KEY`; each one's printed lines are kept."""
    peers = free_ports(3)
    said = [[], [], []]
    nodes = [
        OuterSync(i, peers, PATIENT, start_state(), security=Security(KEY), say=said[i].append)
        for i in range(3)
    ]
    yield nodes, peers, said
    for node in nodes:
        node.close()


def send(address, method, path, body=b"", headers=None, timeout=5.0):
    """One raw request: (status, body)."""
    conn = http.client.HTTPConnection(*address, timeout=timeout)
    try:
        conn.request(method, path, body, headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def read_all(sock) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while data := sock.recv(65536):
        out += data
    sock.close()
    return out


def signed(address, method, path, body=b"", island=1, key=KEY, tamper=None, headers=None):
    """One request signed with ``key`` (or sent with ``headers``), its body followed by
    its trailer; ``tamper``: a body of the same length sent in place of the signed one."""
    signer = Signer(key, island)
    headers = headers or signer.request(method, path, len(body))
    trailer = signer.trailer("req", headers["X-Nonce"], auth.digest(body))
    return send(address, method, path, (body if tamper is None else tamper) + trailer, headers)


def honest_round(nodes, seed=40):
    """Every island syncs with θ = global + noise; asserts the result is the hand-computed
    round from the state before, the same on every island."""
    glob, mom = dict(nodes[0].glob), dict(nodes[0].mom)
    thetas = [inner(n, seed + i) for i, n in enumerate(nodes)]
    tokens = [100, 200, 300]
    sync_all(nodes, thetas, tokens)
    want_g, want_m = expected(glob, mom, thetas, tokens)
    for n in nodes:
        assert same(n.glob, nodes[0].glob) and same(n.mom, nodes[0].mom)
        for k in KEYS:
            np.testing.assert_allclose(n.glob[k], want_g[k], rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(n.mom[k], want_m[k], rtol=1e-6, atol=1e-6)


def delta_body(node, **change):
    """A well-formed delta for ``node``'s next round from island 1, with ``change``: meta
    keys to replace, or ``arrays`` for the arrays."""
    arrays = change.pop("arrays", {k: np.full((4, 3), 0.01, np.float32) for k in KEYS})
    meta = {"island": 1, "round": node.round + 1, "tokens": 10, "dead": [], "average": False}
    meta.update(lineage=node.lineage, scales=dict.fromkeys(arrays, 1.0))
    meta.update(change)
    return pack(meta, arrays)


def raw_body(meta: dict, arrays: dict, header_json: bytes | None = None) -> bytes:
    """A body in the wire format with a header of our own making."""
    body = pack(meta, arrays)
    if header_json is None:
        return body
    return b"HJD1" + len(header_json).to_bytes(4, "little") + header_json


ZEROS = {k: np.zeros((4, 3), np.float32) for k in KEYS}

# (name, how to build the body from the leader node, status, words of the reason)
DELTAS = [
    ("garbage", lambda n: b"\x00garbage" * 10, 400, "not a holmes_jax body"),
    ("lying header length", lambda n: b"HJD1\xff\xff\x00\x00{}", 400, "header length"),
    ("header not JSON", lambda n: raw_body({}, {}, b"{not json"), 400, "not JSON"),
    ("deep JSON", lambda n: raw_body({}, {}, b"[" * 20000), 400, "not JSON"),
    ("NaN constant", lambda n: raw_body({}, {}, b'{"meta": NaN, "arrays": []}'), 400, "NaN"),
    (
        "header lies about the arrays' bytes",
        lambda n: delta_body(n)[:-64],
        400,
        "header describes",
    ),
    (
        "a key missing",
        lambda n: delta_body(n, arrays={k: ZEROS[k] for k in KEYS[:2]}),
        400,
        "missing",
    ),
    (
        "an unknown key",
        lambda n: delta_body(n, arrays={**ZEROS, "evil#0": ZEROS[KEYS[0]]}),
        400,
        "unknown",
    ),
    (
        "wrong shape",
        lambda n: delta_body(n, arrays={**ZEROS, KEYS[0]: np.zeros((3, 4), np.float32)}),
        400,
        "float32[3, 4], the lane's is float32[4, 3]",
    ),
    (
        "wrong dtype",
        lambda n: delta_body(n, arrays={**ZEROS, KEYS[0]: np.zeros((4, 3), np.int8)}),
        400,
        "int8[4, 3]",
    ),
    (
        "NaN values",
        lambda n: delta_body(n, arrays={**ZEROS, KEYS[1]: np.full((4, 3), np.nan, np.float32)}),
        400,
        "non-finite",
    ),
    (
        "Inf values",
        lambda n: delta_body(n, arrays={**ZEROS, KEYS[2]: np.full((4, 3), np.inf, np.float32)}),
        400,
        "non-finite",
    ),
    ("scale not 1", lambda n: delta_body(n, scales=dict.fromkeys(KEYS, 2.0)), 400, "must be 1"),
    (
        "negative scale",
        lambda n: delta_body(n, scales=dict.fromkeys(KEYS, -1.0)),
        400,
        "finite and > 0",
    ),
    ("scales missing", lambda n: delta_body(n, scales={}), 400, "one scale for each"),
    ("negative tokens", lambda n: delta_body(n, tokens=-5), 400, "tokens=-5"),
    ("absurd tokens", lambda n: delta_body(n, tokens=10**15), 400, "tokens=1000000000000000"),
    ("float tokens", lambda n: delta_body(n, tokens=1.5), 400, "tokens=1.5"),
    ("bool tokens", lambda n: delta_body(n, tokens=True), 400, "tokens=True"),
    ("unknown island", lambda n: delta_body(n, island=7), 400, "not an island of the run"),
    ("another island's name", lambda n: delta_body(n, island=2), 400, "sent by island 1"),
    ("fake lineage", lambda n: delta_body(n, lineage="evil"), 400, "lineage=evil"),
    ("lineage of no island", lambda n: delta_body(n, lineage="9@1"), 400, "lineage=9@1"),
    ("round not a number", lambda n: delta_body(n, round="1"), 400, "round=1"),
    ("dead not islands", lambda n: delta_body(n, dead=[99]), 400, "dead=[99]"),
    ("abstain with arrays", lambda n: delta_body(n, abstain=True, tokens=0), 400, "no arrays"),
]


@pytest.mark.parametrize("case", DELTAS, ids=[c[0] for c in DELTAS])
def test_a_malformed_delta_is_refused_and_changes_nothing(trio, case):
    nodes, peers, said = trio
    name, build, status, words = case
    got, reason = signed(peers[0], "POST", "/delta", build(nodes[0]))
    assert (got, words in reason.decode()) == (status, True), reason
    assert nodes[0].refused == 1 and not nodes[0].r.open
    assert len(said[0]) == 1 and words in said[0][0]  # printed once, with its reason
    honest_round(nodes)


JOINS = [
    ("unknown island", {"island": 5}, None, "not an island of the run"),
    (
        "weight with NaN",
        {"weight": 1},
        {k: np.full((4, 3), np.nan, np.float32) for k in KEYS},
        "non-finite",
    ),
    (
        "weight of the wrong shape",
        {"weight": 1},
        {k: np.zeros((2, 2), np.float32) for k in KEYS},
        "float32[2, 2]",
    ),
    ("arrays without weight", {}, ZEROS, "no arrays"),
    ("fake lineage", {"lineage": "x@y"}, None, "lineage=x@y"),
    ("negative tokens", {"tokens": -1}, None, "tokens=-1"),
    (
        "a big fork's tokens",
        {"weight": 1, "lineage": "1@0", "tokens": 10**9},
        "ones",
        "since the fork",
    ),
]


@pytest.mark.parametrize("case", JOINS, ids=[c[0] for c in JOINS])
def test_a_malformed_join_is_refused_and_changes_nothing(trio, case):
    nodes, peers, said = trio
    name, change, arrays, words = case
    meta = {"island": 1, "lineage": "root", "next": False, "parent": "", "fork_tokens": 0}
    meta.update(tokens=0, weight=0)
    meta.update(change)
    if isinstance(arrays, str):
        arrays = {k: np.full((4, 3), 100.0, np.float32) for k in KEYS}
    got, reason = signed(peers[0], "POST", "/join", pack(meta, arrays or {}))
    assert (got, words in reason.decode()) == (400, True), reason
    assert nodes[0].tokens == 0 and nodes[0].r.merged == set()
    honest_round(nodes)


def test_the_made_up_join_of_the_issue_moves_no_model(trio):
    """An island not in the run, with a made-up lineage and a large token count (what an
    unauthenticated /join did before): refused without a key, and with one."""
    nodes, peers, _ = trio
    meta = {"island": 9, "lineage": "9@3", "next": False, "parent": "root", "fork_tokens": 0}
    meta.update(tokens=10**12, weight=1)
    body = pack(meta, {k: np.full((4, 3), 500.0, np.float32) for k in KEYS})
    before = dict(nodes[0].glob)
    assert send(peers[0], "POST", "/join", body, {"X-Island": "9"})[0] == 401
    assert signed(peers[0], "POST", "/join", body, island=9)[0] == 403
    assert signed(peers[0], "POST", "/join", body, island=1)[0] == 400
    assert same(before, nodes[0].glob)
    honest_round(nodes)


def test_authentication_refuses_before_the_body_and_once_per_peer(trio):
    nodes, peers, said = trio
    body = delta_body(nodes[0])
    cases = [
        (send(peers[0], "POST", "/delta", body, {"X-Island": "1"}), "no authentication headers"),
        (
            signed(peers[0], "POST", "/delta", body, key=b"another key of 32 bytes........"),
            "wrong tag",
        ),
        (
            signed(peers[0], "POST", "/delta", body, tamper=delta_body(nodes[0], tokens=99)),
            "request body does not match its tag",
        ),
        (send(peers[0], "GET", "/status", b"", {"X-Island": "1"}), "no authentication headers"),
        (
            send(peers[0], "GET", "/status", b"", Signer(KEY, 1).request("GET", "/status", -64)),
            "no room for the body's 64-byte tag",
        ),
    ]
    for (status, reason), words in cases:
        assert status == 401 and words in reason.decode(), reason
    # replayed: the same signed headers twice; stale: a time outside the window
    headers = Signer(KEY, 1).request("GET", "/status", 0)
    assert signed(peers[0], "GET", "/status", headers=headers)[0] == 200
    status, reason = signed(peers[0], "GET", "/status", headers=headers)
    assert status == 401 and b"replayed" in reason
    stale = Signer(KEY, 1).request("GET", "/status", 0)
    stale["X-Time"] = f"{time.time() - 3600:.3f}"
    stale["X-Tag"] = tag(KEY, "req", "GET", "/status", "1", stale["X-Time"], stale["X-Nonce"], "64")
    status, reason = signed(peers[0], "GET", "/status", headers=stale)
    assert status == 401 and b"stale" in reason
    # a tag of other than ASCII is a wrong tag, not an error inside the server
    bad = {**Signer(KEY, 1).request("GET", "/status", 0), "X-Tag": "\xe9" * 64}
    status, reason = signed(peers[0], "GET", "/status", headers=bad)
    assert status == 401 and b"wrong tag" in reason
    # an oversized body is refused from its declared length: the server reads none of it
    sock = socket.create_connection(peers[0])
    head = Signer(KEY, 1).request("POST", "/delta", 10_000_000_000)
    lines = [f"{k}: {v}" for k, v in head.items()]
    sock.sendall(("POST /delta HTTP/1.1\r\n" + "\r\n".join(lines) + "\r\n\r\n").encode())
    reply = read_all(sock)
    assert b" 413 " in reply.split(b"\r\n")[0] and b"body too large" in reply
    # a body cut short: fewer bytes than declared, then the sender closes
    sock = socket.create_connection(peers[0])
    head = Signer(KEY, 1).request("POST", "/delta", len(body))
    lines = [f"{k}: {v}" for k, v in head.items()]
    sock.sendall(("POST /delta HTTP/1.1\r\n" + "\r\n".join(lines) + "\r\n\r\n").encode())
    sock.sendall(body[: len(body) // 2])
    sock.shutdown(socket.SHUT_WR)
    reply = read_all(sock)
    assert b" 400 " in reply.split(b"\r\n")[0] and b"truncated" in reply
    # one line per peer address and kind, however many requests
    kinds = [line for line in said[0] if "refused a request from 127.0.0.1" in line]
    assert len(kinds) == len({line.split("): ")[1].split(":")[0] for line in kinds}) == 3
    assert nodes[0].refused == 10
    honest_round(nodes)


def test_queries_and_endpoints_are_checked(trio):
    nodes, peers, _ = trio
    for path, status, words in [
        ("/result?round=abc", 400, "one round"),
        ("/ack?round=-1", 400, "one round"),
        ("/ack", 400, "one round"),
        ("/result?round=99999999999", 400, "one round"),
        ("/nothing", 404, "no such endpoint"),
    ]:
        got, reason = signed(peers[0], "GET", path)
        assert (got, words in reason.decode()) == (status, True), (path, reason)
    honest_round(nodes)


def test_a_member_s_nan_delta_leaves_it_out_of_the_round(trio):
    """Island 2's delta holds NaN: refused, the round closes without waiting for it, and
    island 2 takes the result (its peers' mean) as a late island does; every model is the
    mean of islands 0 and 1 alone, and the next rounds have all three again."""
    nodes, peers, said = trio
    glob, mom = dict(nodes[0].glob), dict(nodes[0].mom)
    thetas = [inner(n, 50 + i) for i, n in enumerate(nodes)]
    thetas[2] = {k: np.full_like(v, np.nan) if k == KEYS[0] else v for k, v in thetas[2].items()}
    # the island's own check would abstain: send its delta as a buggy peer would
    delta = {k: nodes[2].glob[k] - thetas[2][k] for k in KEYS}
    began = time.monotonic()

    def round_open():  # sent during the round (before it, it would be waited for)
        with nodes[0].cond:
            return bool(nodes[0].r.open)

    def buggy_peer():
        wait_for(round_open)
        nodes[2].sync_delta(delta, 300)

    in_threads(*[functools.partial(nodes[i].sync, thetas[i], 100 * (i + 1)) for i in range(2)],
               buggy_peer)  # fmt: skip
    assert time.monotonic() - began < PATIENT.quorum_timeout_s / 2  # not waited for
    want_g, want_m = expected(glob, mom, thetas[:2], [100, 200])
    for n in nodes:
        assert same(n.glob, nodes[0].glob) and n.round == 1
        np.testing.assert_allclose(n.glob[KEYS[0]], want_g[KEYS[0]], rtol=1e-6, atol=1e-6)
    assert any("non-finite" in line for line in said[0])  # the leader said why, once
    assert any("refused POST /delta" in line for line in said[2])  # and so did island 2
    honest_round(nodes)
    assert nodes[0].members == {0, 1, 2}


def test_an_abstaining_island_equals_an_absent_one(trio):
    """An island whose inner steps were not finite abstains: the round is the others' mean
    (as if it had not sent), nobody waits for it, and it ends on the same global model."""
    nodes, _, said = trio
    glob, mom = dict(nodes[0].glob), dict(nodes[0].mom)
    thetas = [inner(n, 60 + i) for i, n in enumerate(nodes)]
    thetas[1] = {k: v * np.float32(np.inf) for k, v in thetas[1].items()}  # diverged
    began = time.monotonic()
    sync_all(nodes, thetas, [100] * 3)
    assert time.monotonic() - began < PATIENT.quorum_timeout_s / 2
    want_g, _ = expected(glob, mom, [thetas[0], thetas[2]], [100, 100])
    for n in nodes:
        assert same(n.glob, nodes[0].glob) and same(n.mom, nodes[0].mom)
        np.testing.assert_allclose(n.glob[KEYS[2]], want_g[KEYS[2]], rtol=1e-6, atol=1e-6)
    assert any("abstains" in line for line in said[1])
    honest_round(nodes)


def test_the_leader_abstaining_alone_keeps_the_model():
    """No island sent anything: a zero averaging step, model and momentum unchanged."""
    rounds = Rounds(0, [0], CFG, start_state())
    before = dict(rounds.glob), dict(rounds.mom)
    assert rounds.accept(Delta(0, 1, "root", 0, frozenset(), False, None), 0.0)
    rounds.close()
    assert rounds.round == 1 and same(rounds.glob, before[0]) and same(rounds.mom, before[1])


def test_messages_are_checked_without_sockets():
    """The rules of :mod:`holmes_jax.diloco.messages` on their own (no server)."""
    ex = Expect(dict.fromkeys(KEYS, (4, 3)), "int8", frozenset({0, 1}), 100, 0.7, 0.9)
    q = {k: np.ones((4, 3), np.int8) for k in KEYS}
    meta = {"island": 1, "round": 1, "tokens": 100, "dead": [], "lineage": "root"}
    good = parse_delta({**meta, "scales": dict.fromkeys(KEYS, 0.5)}, q, 1, ex)
    assert good.values[KEYS[0]][0, 0] == 0.5 and good.tokens == 100
    for scales, words in [
        (dict.fromkeys(KEYS, float("nan")), "finite"),
        (dict.fromkeys(KEYS, 0.0), "> 0"),
        (dict.fromkeys(KEYS, 1e38), "fp32's range"),
        (dict.fromkeys(KEYS, "1"), "finite"),
    ]:
        with pytest.raises(Refused, match=words):
            parse_delta({**meta, "scales": scales}, q, 1, ex)
    with pytest.raises(Refused, match="tokens=101"):
        parse_delta({**meta, "tokens": 101, "scales": dict.fromkeys(KEYS, 0.5)}, q, 1, ex)
    with pytest.raises(WireError, match="dtype 'float64'"):
        body = pack({}, {"x": np.zeros(2, np.float32)}).replace(b"float32", b"float64")
        unpack(body)


def test_bf16_bits_are_finite_exactly_when_their_values_are(monkeypatch):
    """All 65,536 bf16 bit patterns: the finite ones together pass, each of the others
    (inf, NaN) fails alone and behind finite ones in a later piece."""
    monkeypatch.setattr(messages, "BITS_PIECE", 3)
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    want = np.isfinite(bits.view(ml_dtypes.bfloat16).astype(np.float32))
    assert messages.finite(bits[want]) and (~want).sum() == 2 * 128  # ±inf and 254 NaNs
    ones = np.full(4, 0x3F80, np.uint16)  # 1.0
    for b in bits[~want]:
        assert not messages.finite(np.array([b])), hex(b)
        assert not messages.finite(np.concatenate([ones, [b]])), hex(b)


def test_replies_are_authenticated_too(trio):
    """A client with the key takes no reply that was not made for its request with it."""
    nodes, peers, _ = trio
    impostor = OuterSync(
        0, {0: free_ports(1)[0], 1: peers[1]}, CFG, start_state(), security=Security(b"x" * 32)
    )
    try:
        client = OuterSync(1, {0: impostor.peers[0], 1: free_ports(1)[0]}, CFG, start_state(),
                           security=Security(KEY), say=lambda line: None)  # fmt: skip
        with pytest.raises(Unreachable):
            client._status(0)  # the impostor refuses it (401), and its reply fails the tag
        client.close()
    finally:
        impostor.close()


def test_a_reply_longer_than_any_reply_is_not_read():
    """A peer declaring a reply larger than a lane's whole state gets no buffer for it: the
    client gives up on the headers (a lying server cannot make an island allocate)."""
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()

    def answer():
        conn, _ = listener.accept()
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(4096)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n{}" % (1 << 40))

    def ask():
        client = OuterSync(1, {0: address, 1: free_ports(1)[0]}, CFG, start_state())
        try:
            assert client.r.max_reply() < 1 << 20
            with pytest.raises(Unreachable):
                client._status(0)
        finally:
            client.close()

    in_threads(answer, ask)
    listener.close()


def test_a_body_hashed_as_it_arrives_has_the_digest_of_the_whole(monkeypatch):
    """:func:`read_body` hashes pieces while reading: whatever sizes the reads return,
    the digest is that of the whole body, and a short body is None."""
    monkeypatch.setattr(auth, "PIECE", 1000)
    body = np.random.default_rng(0).integers(0, 256, 10_007, np.uint8).tobytes()
    sizes = iter([1, 999, 1, 3000, 17, 4096] * 10)

    def reader(data):
        at = 0

        def readinto(view):
            nonlocal at
            n = min(len(view), next(sizes), len(data) - at)
            view[:n] = data[at : at + n]
            at += n
            return n

        return readinto

    got, dig = read_body(reader(body), len(body), hashed=True)
    assert bytes(got) == body and dig == auth.digest(body)
    assert read_body(reader(body[:-1]), len(body), hashed=True) is None
    assert read_body(reader(body), len(body), hashed=False)[1] is None


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA and one certificate for 127.0.0.1 it signed (openssl)."""
    d = tmp_path_factory.mktemp("tls")
    run = lambda *a: subprocess.run(a, cwd=d, check=True, capture_output=True)  # noqa: E731
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=holmes_jax test CA")  # fmt: skip
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "island.key",
        "-out", "island.csr", "-subj", "/CN=127.0.0.1")  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("openssl", "x509", "-req", "-in", "island.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "island.pem", "-days", "2", "-extfile", "san.ext")  # fmt: skip
    return {name: str(d / name) for name in ("ca.pem", "island.pem", "island.key")}


def test_a_tls_round_trip_with_mutual_certificates(certs):
    """Two islands over TLS (each presents a certificate the CA signed) and the key: a
    round agrees; a leader's probe of a port is no refusal; a plain-HTTP client gets
    nothing."""
    tls = (certs["island.pem"], certs["island.key"], certs["ca.pem"])
    security = Security(KEY, server_context(*tls), client_context(*tls))
    peers, said = free_ports(2), []
    nodes = [
        OuterSync(i, peers, PATIENT, start_state(), security=security, say=said.append)
        for i in range(2)
    ]
    try:
        assert not refuses(peers[0], 5.0)  # connects, and closes before the handshake
        glob, mom = start_state()
        thetas = [inner(n, 70 + i) for i, n in enumerate(nodes)]
        sync_all(nodes, thetas, [1, 1])
        want_g, _ = expected(glob, mom, thetas, [1, 1])
        assert same(nodes[0].glob, nodes[1].glob) and nodes[1].round == 1
        np.testing.assert_allclose(nodes[1].glob[KEYS[0]], want_g[KEYS[0]], rtol=1e-6)
        assert said == []
        with pytest.raises((http.client.HTTPException, OSError)):
            send(peers[0], "GET", "/status", b"", {"X-Island": "1"}, timeout=2)
        wait_for(lambda: said)  # the plain client's failed handshake: one refusal line
        assert "connection failed before a request" in said[0]
    finally:
        for n in nodes:
            n.close()


def test_the_new_keys_are_checked_in_one_line(tmp_path):
    base = ["diloco.enabled=true", "diloco.mode=independent", "diloco.island=0"]
    loop = "diloco.peers=['127.0.0.1:1','127.0.0.1:2']"
    far = "diloco.peers=['10.1.0.1:1','10.2.0.1:2']"
    empty, short, good = tmp_path / "empty", tmp_path / "short", tmp_path / "good"
    empty.write_bytes(b"\n")
    short.write_bytes(b"abc")
    good.write_bytes(KEY)
    cases = [
        ([far], r"diloco.sync_key_file=None: peers off loopback \(10.1.0.1, 10.2.0.1\)"),
        ([loop, f"diloco.sync_key_file={tmp_path}/none"], "No such file"),
        ([loop, f"diloco.sync_key_file={empty}"], "holds 0 bytes, a key needs at least 16"),
        ([loop, f"diloco.sync_key_file={short}"], "holds 3 bytes"),
        ([loop, f"diloco.tls_cert={good}"], "TLS needs both"),
        (
            [loop, f"diloco.tls_cert={tmp_path}/x", f"diloco.tls_key={good}"],
            "tls_cert=.*: no such file",
        ),
        ([loop, f"diloco.tls_ca={good}"], "TLS needs both"),
    ]
    for extra, words in cases:
        with pytest.raises(ConfigError, match=words) as err:
            load_config(None, [*base, *extra])
        assert "\n" not in str(err.value)
    assert load_config(None, [*base, far, "diloco.insecure=true"]).diloco.insecure
    assert load_config(None, [*base, far, f"diloco.sync_key_file={good}"])


def test_the_launcher_makes_a_key_for_the_run():
    with island_jobs.run_key(["--set", "train.steps=2"]) as path:
        assert len(read_key(path)) == 64 and os.stat(path).st_mode & 0o777 == 0o600
    assert not os.path.exists(path)  # removed with the launch
    with island_jobs.run_key(["--set", "diloco.sync_key_file=/mine"]) as path:
        assert path is None  # the user's own key is kept
