"""Benchmark: what the emulated islands deliver against what their topology asks for.

    sudo .venv/bin/python scripts/bench_emulation.py [--latencies-us 0,100,1000,5000,25000] \\
        [--burst-periods-us 10000,4000] [--probe [--probe-latencies-us 100,2500]]

``launch --emulate`` builds the network of :mod:`holmes_jax.cluster.netns`: ``tc htb`` for
bandwidth, the delaying wire (:mod:`holmes_jax.cluster.delay`) for latency, and cgroup CPU
quotas (:mod:`holmes_jax.cluster.cgroups`) for islands of different speed. This measures
each against its setting, on meshes/emu-4host-2island.yaml (100 Mbit/s between islands)
with the inter-island one-way latency set to each value of ``--latencies-us`` (0: the
wire off, as ``--no-latency``):

- ``rtt``: median TCP round trip of one byte (TCP_NODELAY, 30 round trips) from ib-0 to
  roce-0 (another island) and to ib-1 (the same island), against ``2 x latency_us``
  (the island's own 50 µs is below the wire's floor, ``delay.INTRA_FLOOR_US``, so its
  bridge switches it undelayed: the veths' own tens of µs are all it gets);
- ``bulk``: Mbit/s of a 16 MiB one-way TCP transfer ib-0 -> roce-0 against the htb rate;
- ``probe`` (with ``--probe``): ``launch --emulate --program probe`` at each of
  ``--probe-latencies-us`` (about a minute each): the latency the probe fits to the
  pipeline's link between the islands (``stage:ib:roce``), which the planner then prices,
  against the topology's one-way ``latency_us``. A ``ppermute`` between CPU processes is a
  gloo send and receive, which pays the wire more than once, so the fit exceeds the
  topology's figure: the analytic cost model (``planner/formulas.py``) charges one latency
  per send, a probed profile what was measured;
- ``quota``: on meshes/emu-4host-2island-slow-compute.yaml, a busy loop in each host's
  CPU group, all four at once, against the share the quota gives (cores / hosts x
  peak_tflops / max peak_tflops);
- ``burst``: the same quotas as a pipeline stage meets them: a burst of 10 ms of CPU after
  an idle gap of three periods or more, in an ib and a roce group alone, at each CFS period
  of ``--burst-periods-us`` (the launcher's 10 ms, and shorter). CFS bandwidth control
  refills a group's quota every period and a group that idled has its whole quota when it
  wakes, so a burst runs faster than ``burst / share``, by up to ``2 x (1 - share) x
  period`` of wall time (its first and last periods need not wait), depending on where in
  the period it wakes (min / median / max over 8 phases). A quota gives a steady
  computation exactly its share; a stage that waits between computations gets up to that
  much back per computation, and by how much is set by the phases of the hosts' periods.

Targets: round trips within 10% (+0.3 ms for the veths and the wire) of twice the latency;
bulk within 10% of the rate; each busy loop within 0.05 core of its share (``burst`` has
none: it measures how far the emulation is from a slower chip). Needs root.
Prints one JSON line per measurement, then a table on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from holmes_jax.cluster import cgroups, netns  # noqa: E402
from holmes_jax.planner.topology import load_topology, topology_from_dict  # noqa: E402

MESH = os.path.join(ROOT, "meshes", "emu-4host-2island.yaml")
SLOW_MESH = os.path.join(ROOT, "meshes", "emu-4host-2island-slow-compute.yaml")
SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5599)); s.listen(1); print("up", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
mode = c.recv(1)
if mode == b"p":  # ping-pong: echo single bytes
    while (d := c.recv(1)):
        c.sendall(d)
else:  # bulk: read everything, answer with one byte at the end
    n = int.from_bytes(c.recv(8), "big")
    got = 0
    while got < n:
        got += len(c.recv(1 << 20))
    c.sendall(b"k")
"""
CLIENT = """
import socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], 5599))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
if sys.argv[2] == "rtt":
    c.sendall(b"p")
    ts = []
    for _ in range(30):
        t = time.perf_counter(); c.sendall(b"x"); c.recv(1); ts.append(time.perf_counter() - t)
    print(statistics.median(ts[5:]))
else:
    n = int(sys.argv[3]); c.sendall(b"b" + n.to_bytes(8, "big"))
    t = time.perf_counter(); c.sendall(bytes(n)); c.recv(1)
    print(n * 8 / (time.perf_counter() - t) / 1e6)
"""
BUSY = """
import time
t0, c0 = time.monotonic(), time.process_time()
while time.monotonic() - t0 < 3.0:
    pass
print((time.process_time() - c0) / (time.monotonic() - t0))
"""
# A burst of argv[1] ms of CPU after each idle gap of argv[2:] ms; prints each burst's wall ms.
BURSTS = """
import sys, time
burst, gaps = float(sys.argv[1]) / 1e3, [float(g) / 1e3 for g in sys.argv[2:]]
def spin(seconds):  # this thread's CPU time, not the wall's
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
for gap in gaps:
    time.sleep(gap)
    start = time.monotonic()
    spin(burst)
    print(1e3 * (time.monotonic() - start))
"""
BURST_MS = 10.0  # CPU per burst: a few stage computations' worth at the emulated sizes


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def with_latency(inter_us: float):
    """emu-4host-2island with the inter-island one-way latency set to ``inter_us``."""
    with open(MESH) as f:
        raw = yaml.safe_load(f)
    raw["inter_island"]["default"]["latency_us"] = max(inter_us, 1)
    return topology_from_dict(raw)


def measure(net, plan, src: str, dst: str, what: str, size: int = 0) -> float:
    """One client/server measurement from host ``src`` to host ``dst``."""
    address = plan.host(dst).address
    server = subprocess.Popen(
        net.exec_prefix(dst) + [sys.executable, "-c", SERVER, address],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stdout.readline().strip() == "up"
        cmd = net.exec_prefix(src) + [sys.executable, "-c", CLIENT, address, what, str(size)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120)
        return float(out.stdout)
    finally:
        server.kill()
        server.wait()


def network_rows(latencies_us: list[float]) -> list[dict]:
    rows = []
    for inter_us in latencies_us:
        topology = with_latency(inter_us)
        plan = netns.plan_network(topology, tag=str(os.getpid()), latency=inter_us > 0)
        inter = topology.inter_island("ib", "roce")
        with netns.EmulatedNetwork(plan) as net:
            row = {
                "bench": "emulation",
                "what": "network",
                "latency_us": inter_us,
                "rtt_expected_ms": 2 * inter_us / 1e3,
                "rtt_inter_ms": 1e3 * measure(net, plan, "ib-0", "roce-0", "rtt"),
                "rtt_intra_ms": 1e3 * measure(net, plan, "ib-0", "ib-1", "rtt"),
                "rate_mbit": inter.bandwidth_gbps * 1e3,
                "bulk_mbit": measure(net, plan, "ib-0", "roce-0", "bulk", 16 << 20),
            }
        emit(row)
        rows.append(row)
    return rows


def probe_rows(latencies_us: list[float]) -> list[dict]:
    import tempfile

    import benchlib

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for inter_us in latencies_us:
            with open(MESH) as f:
                raw = yaml.safe_load(f)
            raw["inter_island"]["default"]["latency_us"] = inter_us
            mesh = os.path.join(folder, f"emu-{inter_us:.0f}us.yaml")
            with open(mesh, "w") as f:
                yaml.safe_dump(raw, f)
            name, config = f"probe-{inter_us:.0f}", os.path.join(ROOT, "configs", "quickstart.yaml")
            overrides = ["train.global_batch_size=8"]
            benchlib.emulated_probe(mesh, overrides, folder, name, "probe", config=config)
            with open(os.path.join(folder, f"{name}.json")) as f:
                links = json.load(f)["links"]
            fitted = {k: v["latency_us"] for k, v in links.items() if k.startswith("stage:")}
            row = {"bench": "emulation", "what": "probe", "latency_us": inter_us,
                   "fitted_latency_us": fitted}  # fmt: skip
            emit(row)
            rows.append(row)
    return rows


def quota_rows() -> list[dict]:
    topology = load_topology(SLOW_MESH)
    cores = len(os.sched_getaffinity(0))
    quotas = cgroups.plan_quotas(topology, str(os.getpid()), "on", cores=cores)
    rows = []
    with cgroups.CpuGroups(quotas) as groups:
        wrap = groups.wrap(None)
        procs = {
            q.host: subprocess.Popen(
                wrap(q.host) + [sys.executable, "-c", BUSY], stdout=subprocess.PIPE, text=True
            )
            for q in quotas
        }
        for q in quotas:
            share = float(procs[q.host].communicate(timeout=30)[0])
            row = {"bench": "emulation", "what": "quota", "host": q.host, "cores": q.share,
                   "measured_cores": share}  # fmt: skip
            emit(row)
            rows.append(row)
    return rows


def burst_rows(periods_us: list[int]) -> list[dict]:
    """A burst of :data:`BURST_MS` of CPU after an idle gap, in one ib and one roce group
    alone, at each CFS period: the gap is 3 periods (the group's quota is back) plus an
    eighth of a period more each time, 3 bursts at each of the 8 phases."""
    topology = load_topology(SLOW_MESH)
    cores = len(os.sched_getaffinity(0))
    planned = cgroups.plan_quotas(topology, str(os.getpid()), "on", cores=cores)
    rows = []
    for period in periods_us:
        for host in ("ib-0", "roce-0"):
            (q,) = [q for q in planned if q.host == host]
            quota = dataclasses.replace(
                q, period_us=period, quota_us=max(cgroups.MIN_QUOTA_US, round(q.share * period))
            )
            gaps = [(3 + k / 8) * period / 1e3 for k in range(8) for _ in range(3)]
            with cgroups.CpuGroups([quota]) as groups:
                cmd = groups.wrap(None)(host) + [sys.executable, "-c", BURSTS, str(BURST_MS)]
                out = subprocess.run(
                    cmd + [f"{g:.3f}" for g in gaps], capture_output=True, text=True,
                    check=True, timeout=120,
                )  # fmt: skip
                throttled = groups.throttling()[host].throttled
            walls = sorted(float(x) for x in out.stdout.split())
            row = {
                "bench": "emulation",
                "what": "burst",
                "host": host,
                "cores": q.share,
                "period_us": period,
                "quota_us": quota.quota_us,
                "burst_cpu_ms": BURST_MS,
                "at_share_ms": BURST_MS * period / quota.quota_us,
                "wall_ms_min": walls[0],
                "wall_ms_median": statistics.median(walls),
                "wall_ms_max": walls[-1],
                "throttled_periods": throttled,
            }
            emit(row)
            rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latencies-us", default="0,100,1000,5000,25000")
    parser.add_argument("--probe", action="store_true", help="also fit latencies by the probe")
    parser.add_argument("--probe-latencies-us", default="100,2500")
    parser.add_argument(
        "--burst-periods-us",
        default=f"{cgroups.PERIOD_US},4000",
        help="CFS periods at which to time a CPU burst after an idle gap",
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("error: bench_emulation needs root (namespaces, cgroups)", file=sys.stderr)
        return 2
    netns.remove_stale()
    start = time.time()
    load = os.getloadavg()[0]
    latencies = [float(x) for x in args.latencies_us.split(",")]
    net = network_rows(latencies)
    quota = quota_rows() if cgroups.available() else []
    periods = [int(x) for x in args.burst_periods_us.split(",")]
    bursts = burst_rows(periods) if cgroups.available() else []
    probe = probe_rows([float(x) for x in args.probe_latencies_us.split(",")]) if args.probe else []
    print(f"load average at start {load:.2f}; {time.time() - start:.0f} s", file=sys.stderr)
    print("| one-way latency | expected RTT | RTT to roce-0 | RTT to ib-1 | bulk / rate |",
          file=sys.stderr)  # fmt: skip
    for r in net:
        print(
            f"| {r['latency_us']:.0f} µs | {r['rtt_expected_ms']:.2f} ms "
            f"| {r['rtt_inter_ms']:.3f} ms | {r['rtt_intra_ms']:.3f} ms "
            f"| {r['bulk_mbit']:.1f} / {r['rate_mbit']:.0f} Mbit/s |",
            file=sys.stderr,
        )
    for r in quota:
        print(f"| quota {r['host']} | {r['cores']:.3f} cores | measured "
              f"{r['measured_cores']:.3f} |", file=sys.stderr)  # fmt: skip
    for r in bursts:
        print(f"| burst {r['host']} ({r['cores']:.2f} core, period {r['period_us'] / 1e3:g} ms) "
              f"| {r['burst_cpu_ms']:g} ms of CPU: {r['at_share_ms']:.1f} ms at the share "
              f"| measured {r['wall_ms_min']:.1f} / {r['wall_ms_median']:.1f} / "
              f"{r['wall_ms_max']:.1f} ms (min / median / max) |", file=sys.stderr)  # fmt: skip
    for r in probe:
        fits = ", ".join(f"{k} {v:.0f} µs" for k, v in r["fitted_latency_us"].items())
        print(f"| probe at {r['latency_us']:.0f} µs one-way | fitted {fits} |", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
