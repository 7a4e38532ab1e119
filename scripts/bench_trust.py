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
  seconds of each host-side step the key and the checks add to one round, measured on
  real bodies of that size: the digest of a body (the sender signs its delta, the
  receiver checks it; the same on the way back for the step), and the checks of
  :mod:`holmes_jax.diloco.messages` beyond the decode the protocol does anyway. A
  member's round: digest of its delta + digest of the step + the step's checks; a leader's
  with one member: digest and checks of the member's delta + digest of its step.
"""

from __future__ import annotations

import argparse
import json
import os
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
from holmes_jax.diloco.transport import Security  # noqa: E402
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


def timed(fn, repeat: int = 3) -> float:
    out = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        out.append(time.perf_counter() - began)
    return statistics.median(out)


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
    return {
        "bench": "trust",
        "part": "big",
        "params": n,
        "outer_dtype": dtype,
        "body_gb": round(len(body) / 1e9, 3),
        "digest_s": round(digest_s, 3),
        "digest_gb_per_s": round(len(body) / digest_s / 1e9, 2),
        "decode_s": round(decode_s, 3),
        "checks_delta_s": round(checks_delta, 3),
        "checks_step_s": round(checks_step, 3),
        "member_round_s": round(2 * digest_s + checks_step, 3),
        "leader_round_s": round(2 * digest_s + checks_delta, 3),
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
