"""Benchmark: what authentication and validation add to an outer-sync round (host side).

    .venv/bin/python scripts/bench_trust.py [--rounds 20] [--big-params 1.3e9]
        [--big-dtypes int8,bf16,fp32]

Two parts, one JSON line each:

- ``quickstart``: two islands (:class:`~holmes_jax.diloco.sync.OuterSync`) on localhost
  with the quickstart model's parameters as one lane, fp32 deltas, ``--rounds`` rounds
  with a shared key and as many without, in alternating blocks of two. Each variant's
  median round (localhost: no transfer time to speak of) and the difference, set against
  the round of ``bench_independent`` at 10 Mbit/s (the round the key protects on a WAN).
- ``big``: a model of ``--big-params`` parameters as one body, per outer dtype: the
  seconds the key and the checks add to one round, measured on real bodies of that size.
  The key: each body is hashed as it is sent and as it arrives
  (:func:`~holmes_jax.diloco.transport.send_body`, :func:`~holmes_jax.diloco.transport.
  read_body`), so what it adds to a transfer is the wait from the last byte to the
  digest on each side, measured over a local socket pair (with the whole transfer's
  time hashed and not, for scale: on two shared cores the hashing also slows the copy,
  which a host with its own cores does not see). The checks: those of
  :mod:`holmes_jax.diloco.messages` beyond the decode the protocol does anyway. A round
  moves the delta to the leader (checked there) and the step back (checked by the
  member) one after the other: ``round_s`` = 2 × (send wait + read wait) + both checks.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from holmes_jax.core.config import load_config  # noqa: E402
from holmes_jax.diloco.auth import digest  # noqa: E402
from holmes_jax.diloco.codec import decode, encode  # noqa: E402
from holmes_jax.diloco.messages import Expect, parse_delta, parse_step  # noqa: E402
from holmes_jax.diloco.rounds import SyncConfig  # noqa: E402
from holmes_jax.diloco.sync import OuterSync  # noqa: E402
from holmes_jax.diloco.transport import Security, read_body, send_body  # noqa: E402
from holmes_jax.diloco.wire import pack, unpack  # noqa: E402

KEY = b"bench-trust-key-0123456789abcdef"
ROUND_AT_10MBIT_S = 5.3  # s: bench_independent's in-step round (docs/benchmarks.md)


def free_ports(n: int) -> dict[int, tuple[str, int]]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    out = {i: ("127.0.0.1", s.getsockname()[1]) for i, s in enumerate(socks)}
    for s in socks:
        s.close()
    return out


def quickstart(rounds: int) -> dict:
    cfg = load_config("configs/quickstart.yaml")
    n = cfg.model.spec.num_params
    rng = np.random.default_rng(0)
    glob = {"model#0": rng.standard_normal(n).astype(np.float32)}
    mom = {"model#0": np.zeros(n, np.float32)}
    sync_cfg = SyncConfig(quorum_timeout_s=30.0, probe_s=5.0)
    times: dict[str, list[float]] = {"key": [], "none": []}
    pairs = {}
    for name, security in (("key", Security(KEY)), ("none", Security())):
        peers = free_ports(2)
        pairs[name] = [
            OuterSync(i, peers, sync_cfg, (glob, mom), security=security) for i in range(2)
        ]
    try:
        with ThreadPoolExecutor(2) as pool:
            for r in range(rounds):
                for name in ("key", "none") if r % 4 < 2 else ("none", "key"):
                    nodes = pairs[name]
                    thetas = [
                        {k: v + np.float32(1e-3) * (i + 1) for k, v in n_.glob.items()}
                        for i, n_ in enumerate(nodes)
                    ]
                    began = time.perf_counter()
                    pairs_ = zip(nodes, thetas, strict=True)
                    futures = [pool.submit(nd.sync, t, 100) for nd, t in pairs_]
                    [f.result(timeout=120) for f in futures]
                    times[name].append(time.perf_counter() - began)
    finally:
        for nodes in pairs.values():
            for nd in nodes:
                nd.close()
    key, none = statistics.median(times["key"]), statistics.median(times["none"])
    return {
        "bench": "trust",
        "part": "quickstart",
        "params": n,
        "rounds": rounds,
        "round_key_s": round(key, 4),
        "round_none_s": round(none, 4),
        "added_s": round(key - none, 4),
        "added_vs_localhost_round": round((key - none) / none, 4),
        "added_vs_10mbit_round": round((key - none) / ROUND_AT_10MBIT_S, 5),
        "spread_key_s": [round(min(times["key"]), 4), round(max(times["key"]), 4)],
        "spread_none_s": [round(min(times["none"]), 4), round(max(times["none"]), 4)],
    }


def timed(fn, repeat: int = 5) -> float:
    """The fastest of ``repeat`` calls of ``fn`` (seconds): the cost without the noise of
    page faults and a shared machine, so that differences of two such times are stable."""
    out = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        out.append(time.perf_counter() - began)
    return min(out)


def moved(body: bytes, hashed: bool) -> dict[str, float]:
    """One transfer of ``body`` over a local socket pair, through the transport's
    :func:`send_body` and :func:`read_body`, hashed on both sides or on neither: seconds
    in all, and from each side's last byte to its digest (the wait hashing adds)."""
    a, b = socket.socketpair()
    last: dict[str, float] = {}

    def write(piece) -> None:
        a.sendall(piece)
        last["sent"] = time.perf_counter()

    def readinto(view) -> int:
        n = b.recv_into(view)
        last["read"] = time.perf_counter()
        return n

    def sender():
        dig = send_body(write, body, hashed)
        return dig, time.perf_counter()

    with ThreadPoolExecutor(1) as pool:
        began = time.perf_counter()
        sending = pool.submit(sender)
        got, read_dig = read_body(readinto, len(body), hashed)
        read_done = time.perf_counter()
        sent_dig, sent_done = sending.result()
    a.close()
    b.close()
    assert sent_dig == read_dig and len(got) == len(body)
    return {
        "total": read_done - began,
        "send_tail": sent_done - last["sent"],
        "read_tail": read_done - last["read"],
    }


def transfers(body: bytes, repeat: int = 3) -> dict[str, list[float]]:
    """:func:`moved` ``repeat`` times hashed and as many not, alternating: each try's
    figures by name (``total_key``, ``total_none``, ``send_tail``, ``read_tail``)."""
    out: dict[str, list[float]] = {}
    for r in range(repeat):
        for hashed in (True, False) if r % 2 == 0 else (False, True):
            m = moved(body, hashed)
            out.setdefault("total_key" if hashed else "total_none", []).append(m["total"])
            if hashed:
                out.setdefault("send_tail", []).append(m["send_tail"])
                out.setdefault("read_tail", []).append(m["read_tail"])
    return out


def big(params: float, dtype: str) -> dict:
    n = int(params)
    shapes = {"model#0": (n,)}
    ex = Expect(shapes, dtype, frozenset({0, 1}), 10**12, 0.7, 0.9)
    delta = np.full(n, 1e-3, np.float32)
    delta[:: 1 << 20] = -2e-3
    payload, scale = encode(delta, dtype)
    del delta
    meta = {"island": 1, "round": 1, "tokens": 1000, "dead": [], "lineage": "root"}
    meta.update(average=False, scales={"model#0": scale})
    body = pack(meta, {"model#0": payload})
    del payload
    step_meta = {"kind": "step", "round": 1, "tokens": 2000, "average": False, "lr": 0.7}
    step_meta.update(mu=0.9, leader=0, members=[0, 1], scales={"model#0": scale})
    digest_s = timed(lambda: digest(body))
    m, arrays = unpack(body)
    decode_s = timed(lambda: decode(arrays["model#0"], scale))
    delta_s = timed(lambda: parse_delta(*unpack(body), 1, ex))
    step_s = timed(lambda: parse_step(step_meta, arrays, ex))
    checks_delta = max(delta_s - decode_s, 0.0)
    checks_step = max(step_s - decode_s, 0.0)
    tries = transfers(body)
    t = {k: statistics.median(v) for k, v in tries.items()}
    transfer_tail = t["send_tail"] + t["read_tail"]
    return {
        "bench": "trust",
        "part": "big",
        "params": n,
        "outer_dtype": dtype,
        "body_gb": round(len(body) / 1e9, 3),
        "digest_s": round(digest_s, 3),
        "digest_gb_per_s": round(len(body) / digest_s / 1e9, 2),
        "transfer_s": {k: [round(x, 3) for x in tries[f"total_{k}"]] for k in ("key", "none")},
        "send_tail_s": round(t["send_tail"], 4),
        "read_tail_s": round(t["read_tail"], 4),
        "decode_s": round(decode_s, 3),
        "checks_delta_s": round(checks_delta, 3),
        "checks_step_s": round(checks_step, 3),
        "round_s": round(2 * transfer_tail + checks_delta + checks_step, 3),
        "cores": len(os.sched_getaffinity(0)),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--big-params", type=float, default=1.3e9)
    p.add_argument("--big-dtypes", default="int8,bf16,fp32")
    p.add_argument("--skip-quickstart", action="store_true")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.big_params < 1:
        print("bench_trust: --rounds and --big-params must be >= 1", file=sys.stderr)
        return 2
    print(f"load average {os.getloadavg()[0]:.2f} at the start", file=sys.stderr)
    if not args.skip_quickstart:
        print(json.dumps(quickstart(args.rounds)), flush=True)
    for dtype in args.big_dtypes.split(","):
        if dtype:
            print(json.dumps(big(args.big_params, dtype)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
