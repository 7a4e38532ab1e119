"""A delaying wire for emulated islands: latency between islands without ``tc netem``.

This machine's kernel has no ``netem``, ``fq`` or ``etf`` qdisc (only ``htb``, ``tbf``,
``clsact`` and ``fifo``), so no qdisc can hold a packet for a set time, and an eBPF program
setting departure times needs ``fq`` to honour them. What remains is userspace: in the router
namespace (:mod:`holmes_jax.cluster.netns`) every packet a bridge receives for another island
is routed into one TUN device, ``dly``; this module's process reads it, keeps it in a heap of
release times (arrival + the one-way latency of its island pair, read from the IPv4 source
and destination addresses ``10.77.<island>.<host>``) and writes it back at that time. A
packet written to ``dly`` comes in with ``iif dly`` and is routed by the main table to its
island's bridge, so it passes the wire once per direction: a round trip pays the topology's
``latency_us`` twice. Delays are constant per island pair, so each flow keeps its order.
NFQUEUE was the alternative; it needs iptables userspace and a binding (system packages),
where this needs only ``/dev/net/tun`` and the standard library.

Bandwidth shaping stays ``htb`` on each host's ``eth0``; the wire adds its delay after it.
Packets between hosts of one island are switched by their bridge and not delayed when the
island link's ``latency_us`` is under :data:`INTRA_FLOOR_US` (the emulated topologies have
50 µs): that is of the order of what the veths and bridge already cost, and a pass through
this process costs ~25 µs more. From the floor up, the island's hosts get ``/32`` addresses,
so they reach each other through the router too, and the wire holds those packets for the
island's own latency. With 64 KiB packets, 1 Gbit/s is ~2000 packets a second.

    ip netns exec hjT-r python -m holmes_jax.cluster.delay --dev dly --delay 0:1:100 ...

prints ``ready`` once attached, runs until SIGTERM/SIGKILL (the launcher starts and ends it
with the network, by pid; it dies with the launcher; ``remove_stale`` kills what is left in
the router namespace). Plain Python; no jax import.
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import os
import select
import signal
import struct
import sys
import time
from collections.abc import Callable, Sequence

from holmes_jax.core.errors import ConfigError
from holmes_jax.planner.topology import Topology

DEVICE = "dly"  # the TUN device in the router namespace
TABLE = "100"  # routing table that sends inter-island packets into DEVICE
RULE_PREF = "100"  # before the main table (32766)
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
PR_SET_TIMERSLACK = 29
READ_BYTES = 65536
INTRA_FLOOR_US = 200  # island links this slow or slower are delayed too (see the module doc)

Delays = dict[tuple[int, int], float]  # (source island, destination island) -> one-way seconds


def plan_delays(topology: Topology) -> Delays:
    """One-way delay in seconds of every ordered pair of islands that gets one (pure).

    Between islands: the ``inter_island`` ``latency_us``, which is one-way (a round trip
    pays it twice). Inside island i, the pair (i, i): its ``link`` ``latency_us`` when that
    is at least :data:`INTRA_FLOOR_US`. Pairs with zero latency are left out.
    """
    islands = topology.islands
    delays = {}
    for i, a in enumerate(islands):
        for j, b in enumerate(islands):
            us = topology.inter_island(a.name, b.name).latency_us if i != j else a.link.latency_us
            if us > 0 and (i != j or us >= INTRA_FLOOR_US):
                delays[(i, j)] = us / 1e6
    return delays


def routing_commands(router: str, bridges: Sequence[str], subnet: str, mtu: int) -> list[list[str]]:
    """``ip`` commands that send what a bridge receives for another island through ``dly``.

    Intra-island traffic is switched on the bridge and never routed; packets to the router's
    own addresses match the local table first. Reverse-path filtering is off, since a packet
    from island i comes back in on ``dly``, not on island i's bridge.
    """
    ip = ["ip", "-n", router]
    sysctl = ["ip", "netns", "exec", router, "sysctl", "-q", "-w"]
    cmds = [
        ip + ["tuntap", "add", "dev", DEVICE, "mode", "tun"],
        ip + ["link", "set", DEVICE, "mtu", str(mtu), "txqueuelen", "10000", "up"],
        sysctl + ["net.ipv4.conf.all.rp_filter=0"],
        sysctl + [f"net.ipv4.conf.{DEVICE}.rp_filter=0"],
        ip + ["route", "add", f"{subnet}.0.0/16", "dev", DEVICE, "table", TABLE],
    ]
    for bridge in bridges:
        cmds.append(ip + ["rule", "add", "pref", RULE_PREF, "iif", bridge, "lookup", TABLE])
    return cmds


def delayer_command(router: str, delays: Delays, python: str = sys.executable) -> list[str]:
    """The command that runs the wire inside the router namespace (pure)."""
    cmd = ["ip", "netns", "exec", router, python, "-m", "holmes_jax.cluster.delay"]
    cmd += ["--dev", DEVICE]
    for (i, j), seconds in sorted(delays.items()):
        cmd += ["--delay", f"{i}:{j}:{seconds * 1e6:.6g}"]
    return cmd


def parse_delay(spec: str) -> tuple[tuple[int, int], float]:
    """``SRC:DST:MICROSECONDS`` -> ((src, dst), seconds)."""
    try:
        src, dst, us = spec.split(":")
        pair, seconds = (int(src), int(dst)), float(us) / 1e6
    except ValueError:
        raise ConfigError(
            f"--delay={spec}: must be SRC:DST:MICROSECONDS (island indices)"
        ) from None
    if not seconds >= 0 or min(pair) < 0:
        raise ConfigError(f"--delay={spec}: islands and microseconds must be >= 0")
    return pair, seconds


def delay_of(packet: bytes, delays: Delays) -> float:
    """One-way delay of an IPv4 packet between ``10.77.<i>.x`` and ``10.77.<j>.y`` (0 else)."""
    if len(packet) < 20 or packet[0] >> 4 != 4:
        return 0.0
    return delays.get((packet[14], packet[18]), 0.0)


class Wire:
    """Holds each packet read from ``fd`` until its release time, then writes it back.

    ``read``/``write``/``clock``/``wait`` are injected for tests. Order: a heap of
    (release time, arrival number), so equal delays keep arrival order.
    """

    def __init__(
        self,
        fd: int,
        delays: Delays,
        clock: Callable[[], float] = time.monotonic,
        read: Callable[[int, int], bytes] = os.read,
        write: Callable[[int, bytes], int] = os.write,
        wait: Callable[[int, float | None], bool] | None = None,
    ):
        self.fd, self.delays, self.clock = fd, delays, clock
        self._read, self._write = read, write
        self._wait = wait or _readable
        self.heap: list[tuple[float, int, bytes]] = []
        self.count = 0
        self.dropped = 0

    def receive(self) -> None:
        """Read every packet waiting on the device (non-blocking fd)."""
        while True:
            try:
                packet = self._read(self.fd, READ_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            if not packet:
                return
            release = self.clock() + delay_of(packet, self.delays)
            heapq.heappush(self.heap, (release, self.count, packet))
            self.count += 1

    def release(self) -> None:
        """Write every packet whose time has come."""
        now = self.clock()
        while self.heap and self.heap[0][0] <= now:
            packet = heapq.heappop(self.heap)[2]
            try:
                self._write(self.fd, packet)
            except OSError:  # a full queue or a vanished route: a lossy wire drops it
                self.dropped += 1

    def step(self) -> None:
        """Wait for a packet or the next release time, then do both."""
        timeout = max(0.0, self.heap[0][0] - self.clock()) if self.heap else None
        if self._wait(self.fd, timeout):
            self.receive()
        self.release()


def _readable(fd: int, timeout: float | None) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def open_tun(name: str) -> int:
    """Attach to the TUN device ``name`` (raw IP packets, non-blocking)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def _fine_timers() -> None:
    """Timer slack 1 µs instead of 50 µs: sub-millisecond delays stay sub-millisecond."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1000, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m holmes_jax.cluster.delay")
    parser.add_argument("--dev", default=DEVICE, help="TUN device to serve")
    parser.add_argument("--delay", action="append", default=[], metavar="SRC:DST:US")
    args = parser.parse_args(argv)
    try:
        delays = dict(parse_delay(s) for s in args.delay)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _fine_timers()
    wire = Wire(open_tun(args.dev), delays)
    print("ready", flush=True)
    while True:
        wire.step()


if __name__ == "__main__":
    sys.exit(main())
