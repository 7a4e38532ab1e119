"""Placement: which devices each pipeline stage runs on, and what that costs.

Conventions (the mesh builder follows the same ones):

- Devices are ordered island → host → device (:meth:`Topology.device_places`).
- Without replicas the mesh is (stage, data, tensor) reshaped from that order: stage s is
  the contiguous block ``[s·d·t, (s+1)·d·t)``; tensor groups are t adjacent devices and
  must stay inside one host (t divides devices_per_host); data groups and stages stay
  inside one island (each island's device count is divisible by d·t). Island i therefore
  hosts ``num_devices_i / (d·t)`` consecutive stages, in island order, and only the
  ``stage`` axis crosses island boundaries (pipeline across islands).
- With ``replica = r > 1`` (data parallel across islands) each of the r equal islands
  holds one whole pipeline of p stages, laid out the same way inside the island; the
  gradient reduction becomes hierarchical (reduce-scatter inside the island, all-reduce
  the 1/d shards across islands, all-gather inside).

- The naive placement (``parallel.enforce_islands: false``, the baseline these rules
  exist to beat; :func:`naive_hardware`): one stage, every device data parallel, so the
  gradient ring runs through every host in device order and crosses the islands.

Bandwidth sharing: a host NIC is shared by every ring or sender leaving the host at the
same time; NVLink-style intra-host bandwidth is per device. Python + NumPy; no jax import.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import Layout
from holmes_jax.planner.topology import Link, Topology

# Device speed, calibrated together (minimax relative error) on Megatron-LM's published A100
# runs (holmes_jax.planner.fidelity.calibrate, scripts/fidelity_megatron.py --recalibrate):
# the fraction of peak FLOP/s the layers' matmuls reach, and the bytes the element-wise work
# (norms, softmax, dropout, GELU, residual adds) moves through device memory per activation
# byte a layer stores: each such op reads its input and writes its output, so about 2.
DEFAULT_EFFICIENCY = 0.658
DEFAULT_ELEMENTWISE_PASSES = 1.82
Path = tuple[float, float]  # (bytes/s, latency s)
_NONE: Path = (math.inf, 0.0)


@dataclass(frozen=True)
class MeasuredOp:
    """One collective timed at several buffer sizes on a data ring through every island (a
    profile's ``points``). Where a plan runs it on a ring of the same layout, each call is
    priced from these times: a runtime's own algorithm can take time that grows faster
    than its bytes (gloo's all-gather across the emulated islands: 1 MiB in 0.24 s, 8 MiB
    in 4.2 s), which no one line through every size reproduces."""

    ranks: int  # data ranks of the ring it was timed on
    tensor: int  # rings that ran at once, one per tensor position, sharing each NIC
    sizes: tuple[float, ...]  # bytes of the full buffer per device, ascending
    times_s: tuple[float, ...]  # seconds of one call at each size

    def time(self, nbytes):
        """Seconds of one call moving ``nbytes`` per device (array-wise): piecewise linear
        through the points; below the smallest size that size's time (latency-bound);
        above the largest, the last segment extended; 0 for no bytes."""
        x, y = np.asarray(self.sizes), np.asarray(self.times_s)
        nb = np.asarray(nbytes, dtype=np.float64)
        slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
        t = np.where(nb > x[-1], y[-1] + (nb - x[-1]) * slope, np.interp(nb, x, y))
        return np.where(nb > 0, np.maximum(t, 0.0), 0.0)


@dataclass(frozen=True)
class Calibration:
    """Achieved device speed: a fraction of peak, or measured FLOP/s per island."""

    efficiency: float = DEFAULT_EFFICIENCY
    # Memory traffic of the element-wise work per stored activation byte (module constant).
    elementwise_passes: float = DEFAULT_ELEMENTWISE_PASSES
    # {island name: (forward FLOP/s, backward FLOP/s)} per device, from a profile.
    island_flops: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    # {island name: {"reduce-scatter" | "all-gather": per-host Link}}, from a profile.
    data_ops: Mapping[str, Mapping[str, Link]] = field(default_factory=dict)
    # {"all-reduce" | "reduce-scatter" | "all-gather": per-host Link} of one data ring
    # through every island in device order (a profile's data:* links); naive placement only.
    spanning_ops: Mapping[str, Link] = field(default_factory=dict)
    # {op: MeasuredOp} of the same rings at each size timed (a profile's data:* points):
    # they price a naive placement on the probed layout call by call.
    spanning_points: Mapping[str, MeasuredOp] = field(default_factory=dict)

    def flops_per_s(self, topology: Topology, island: int) -> tuple[float, float]:
        """(forward, backward) FLOP/s of one device of ``island``."""
        isl = topology.islands[island]
        if isl.name in self.island_flops:
            return self.island_flops[isl.name]
        rate = isl.peak_tflops * 1e12 * self.efficiency
        return rate, rate


@dataclass(frozen=True)
class StageHardware:
    """What one pipeline stage runs on (built by :func:`stage_hardware`).

    Paths are (bytes/s, latency s) as seen by one ring or one sender, host-NIC sharing
    already divided out.
    """

    island: int
    fwd_flops: float  # per device FLOP/s
    bwd_flops: float
    memory_bytes: float  # usable device memory
    mem_bw: float  # device memory bytes/s (optimizer step, element-wise work)
    tensor: tuple[float, float]  # one tensor all-reduce ring (inside a host)
    data: tuple[float, float]  # one data-parallel ring of this stage
    send: tuple[float, float]  # one data replica's activations to the next stage
    tie: tuple[float, float] = (math.inf, 0.0)  # one rank to the other pipeline end
    cross: tuple[float, float] = (math.inf, 0.0)  # one rank's cross-island ring (replica)
    # ZeRO-1's reduce-scatter and all-gather rings when measured on their own (a profile's
    # data:<island>:<op> links); None: the data ring's all-reduce figures.
    scatter: tuple[float, float] | None = None
    gather: tuple[float, float] | None = None
    # Bytes the element-wise work moves per stored activation byte (Calibration).
    elementwise_passes: float = DEFAULT_ELEMENTWISE_PASSES
    # (op, MeasuredOp) timed on exactly this stage's data rings: they price each call of
    # that op by its size instead of the path's line (naive placement on the probed layout).
    measured: tuple[tuple[str, MeasuredOp], ...] = ()

    @property
    def scatter_path(self) -> tuple[float, float]:
        """The ring ZeRO-1's reduce-scatter runs on (measured, else the data ring's)."""
        return self.scatter or self.data

    @property
    def gather_path(self) -> tuple[float, float]:
        """The ring ZeRO-1's all-gather runs on (measured, else the data ring's)."""
        return self.gather or self.data


def stage_blocks(topology: Topology, layout: Layout) -> list[list[tuple[int, int]]]:
    """(island index, first device inside that island) of every stage, per replica.

    Args:
      topology: the cluster.
      layout: the degrees.

    Returns:
      ``blocks[replica][stage] = (island, offset)``.

    Raises:
      ConfigError: degrees that do not multiply to the device count, tensor groups that
        would leave a host, stages that would straddle islands, or replicas that do not
        match equal islands one to one.
    """
    p, d, t, r = layout.stages, layout.data, layout.tensor, layout.replica
    n = topology.num_devices
    if layout.num_devices != n:
        raise ConfigError(
            f"replica*stages*data*tensor = {r}*{p}*{d}*{t} = {layout.num_devices}: must "
            f"equal the {n} devices of topology '{topology.name}'"
        )
    k = d * t
    for isl in topology.islands:
        if isl.devices_per_host % t:
            raise ConfigError(
                f"parallel.tensor={t}: must divide devices_per_host={isl.devices_per_host} "
                f"of island '{isl.name}' (tensor groups stay inside one host)"
            )
        if isl.num_devices % k:
            raise ConfigError(
                f"data*tensor={d}*{t}: must divide the {isl.num_devices} devices of island "
                f"'{isl.name}' (data groups and stages stay inside one island)"
            )
    if r == 1:
        return [
            [
                (i, j * k)
                for i, isl in enumerate(topology.islands)
                for j in range(isl.num_devices // k)
            ]
        ]
    sizes = [isl.num_devices for isl in topology.islands]
    if r != len(sizes) or len(set(sizes)) != 1:
        raise ConfigError(
            f"replica={r}: data parallel across islands needs one replica per island and "
            f"equal islands (topology '{topology.name}' has island sizes {sizes})"
        )
    return [[(i, s * k) for s in range(p)] for i in range(r)]


def stages_per_island(topology: Topology, layout: Layout) -> tuple[int, ...]:
    """How many stages each island hosts (per replica in replica mode: p everywhere)."""
    counts = [0] * len(topology.islands)
    for i, _ in stage_blocks(topology, layout)[0]:
        counts[i] += 1
    if layout.replica > 1:
        return tuple(layout.stages for _ in topology.islands)
    return tuple(counts)


def stage_hardware(
    topology: Topology,
    layout: Layout,
    calibration: Calibration | None = None,
    memory_fraction: float = 0.9,
) -> list[StageHardware]:
    """Per-stage device speed, memory and the bandwidth of each path it uses.

    Args:
      topology: the cluster (links possibly replaced by a profile).
      layout: the degrees.
      calibration: device speed; default ``DEFAULT_EFFICIENCY`` of peak.
      memory_fraction: usable fraction of device memory.

    Returns:
      One :class:`StageHardware` per stage; in replica mode the slowest replica's figures.

    Raises:
      ConfigError: see :func:`stage_blocks`.
    """
    cal = calibration or Calibration()
    blocks = stage_blocks(topology, layout)
    replicas = [
        [_stage(topology, layout, cal, memory_fraction, rep, s) for s in range(layout.stages)]
        for rep in blocks
    ]
    if layout.replica == 1:
        return replicas[0]
    out = []
    for s in range(layout.stages):
        islands = [rep[s][0] for rep in blocks]
        cross = _slowest_path(
            [
                _per(_between(topology, a, b), topology.islands[a].devices_per_host)
                for a in islands
                for b in islands
                if a != b
            ]
        )
        hw = [rep[s] for rep in replicas]
        out.append(
            StageHardware(
                island=min(hw, key=lambda x: x.fwd_flops).island,
                fwd_flops=min(x.fwd_flops for x in hw),
                bwd_flops=min(x.bwd_flops for x in hw),
                memory_bytes=min(x.memory_bytes for x in hw),
                mem_bw=min(x.mem_bw for x in hw),
                tensor=_slowest_path([x.tensor for x in hw]),
                data=_slowest_path([x.data for x in hw]),
                send=_slowest_path([x.send for x in hw]),
                tie=_slowest_path([x.tie for x in hw]),
                cross=cross,
                scatter=_slowest_path([x.scatter_path for x in hw]),
                gather=_slowest_path([x.gather_path for x in hw]),
                elementwise_passes=max(x.elementwise_passes for x in hw),
            )
        )
    return out


def naive_hardware(
    topology: Topology,
    layout: Layout,
    calibration: Calibration | None = None,
    memory_fraction: float = 0.9,
) -> list[StageHardware]:
    """The one stage of the naive placement (``parallel.enforce_islands: false``).

    Every device is data parallel: t flat rings (one per tensor position) through every
    host in device order, crossing the islands. A ring runs at its slowest hop: the
    inter-island links between consecutive islands (and from the last back to the first),
    the NIC of every island with more than one host, and the intra-host link where a host
    holds two ranks of one ring; the t rings share every NIC and inter-island link.

    Where a profile timed ZeRO-1's reduce-scatter / all-gather on their own
    (``Calibration.data_ops``), the time they take beyond the island's all-reduce ring rate
    is a per-byte runtime cost (gloo's copies and reductions on shared cores), not wire
    time: the largest such extra is added per byte to the ring.

    Where a profile timed a collective over data rings through every island
    (``Calibration.spanning_ops``), that fit prices it instead of the hops, its NIC figure
    shared by the t rings: the runtime's own algorithm and stalls are measured, not
    modelled. The price reproduces the probe's times for its layout (data = the probed
    ranks, tensor = the gcd of ``devices_per_host``) and follows the ring formula elsewhere.
    On that layout the probe's sizes and times (``Calibration.spanning_points``) go into
    :attr:`StageHardware.measured`, and :mod:`holmes_jax.planner.stage_costs` prices each call
    from them by its size.

    Device speed, memory and memory bandwidth are the slowest island's (data parallel ranks
    step in lockstep).

    Args:
      topology: the cluster (links possibly replaced by a profile).
      layout: the degrees: one stage, one replica.
      calibration: device speed; default ``DEFAULT_EFFICIENCY`` of peak.
      memory_fraction: usable fraction of device memory.

    Returns:
      A list of one :class:`StageHardware` (as :func:`stage_hardware` returns).

    Raises:
      ConfigError: more than one stage or replica, degrees that do not multiply to the
        device count, or tensor groups that would leave a host.
    """
    t, islands, n = layout.tensor, topology.islands, len(topology.islands)
    if layout.stages != 1 or layout.replica != 1:
        raise ConfigError(
            f"parallel.enforce_islands=false: the naive placement is one stage data parallel "
            f"across islands; got stages={layout.stages} replica={layout.replica} (use "
            f"stages=1 replica=1, or enforce_islands=true)"
        )
    if layout.num_devices != topology.num_devices:
        raise ConfigError(
            f"data*tensor = {layout.data}*{t} = {layout.num_devices}: must equal the "
            f"{topology.num_devices} devices of topology '{topology.name}'"
        )
    for isl in islands:
        if isl.devices_per_host % t:
            raise ConfigError(
                f"parallel.tensor={t}: must divide devices_per_host={isl.devices_per_host} "
                f"of island '{isl.name}' (tensor groups stay inside one host)"
            )
    cal = calibration or Calibration()
    intra = (topology.intra_host.bytes_per_s, topology.intra_host.latency_s)
    paths = [_per(link, t) for link in naive_hops(topology)]
    if any(isl.devices_per_host // t > 1 for isl in islands):
        paths.append(intra)
    ring = _slowest_path(paths) if layout.data > 1 else _NONE
    spanning = {  # measured on one ring through every island; t rings share its NICs
        op: _per(link, t) for op, link in cal.spanning_ops.items() if layout.data > 1
    }
    measured = tuple(  # timed on this very layout: each call priced from the times
        (op, m)
        for op, m in sorted(cal.spanning_points.items())
        if (m.ranks, m.tensor) == (layout.data, t)
    )

    def op_path(op: str) -> Path | None:
        if op in spanning:
            return spanning[op]
        extra = [  # seconds per byte beyond the island's all-reduce ring rate
            (1 / ops[op].bytes_per_s - 1 / isl.link.bytes_per_s, ops[op].latency_s)
            for isl in islands
            if op in (ops := cal.data_ops.get(isl.name, {}))
        ]
        if not extra or layout.data == 1:
            return None
        per_byte = max(0.0, *(e for e, _ in extra))
        return (1 / (1 / ring[0] + per_byte), max(ring[1], *(lat for _, lat in extra)))

    speeds = [cal.flops_per_s(topology, i) for i in range(n)]
    return [
        StageHardware(
            island=min(range(n), key=lambda i: speeds[i][0]),
            fwd_flops=min(f for f, _ in speeds),
            bwd_flops=min(b for _, b in speeds),
            memory_bytes=min(isl.memory_gb for isl in islands) * 1e9 * memory_fraction,
            mem_bw=min(isl.memory_bytes_per_s for isl in islands),
            tensor=intra,
            data=spanning.get("all-reduce", ring),
            send=_NONE,
            scatter=op_path("reduce-scatter"),
            gather=op_path("all-gather"),
            elementwise_passes=cal.elementwise_passes,
            measured=measured,
        )
    ]


def naive_hops(topology: Topology) -> list[Link]:
    """The per-host links the naive placement's data rings cross (device order): between
    consecutive islands, from the last back to the first, and every multi-host island's NIC."""
    n = len(topology.islands)
    hops = [_between(topology, i, (i + 1) % n) for i in range(n)] if n > 1 else []
    return hops + [isl.link for isl in topology.islands if isl.num_hosts > 1]


def _stage(topology, layout, cal, memory_fraction, rep, s) -> StageHardware:
    i, off = rep[s]
    isl = topology.islands[i]
    t, k, D = layout.tensor, layout.data * layout.tensor, isl.devices_per_host
    intra = (topology.intra_host.bytes_per_s, topology.intra_host.latency_s)
    counts = _host_counts(off, k, D)
    busiest = max(counts.values())  # devices of this stage on its fullest host

    def ring(link: Link) -> Path:
        if layout.data == 1:
            return _NONE
        if len(counts) == 1:
            return intra
        # Each data ring leaving a host carries min(counts)/t of its ranks there; the D/that
        # rings of all tensor positions (and other stages) on the host share its NIC.
        per_ring = link.bytes_per_s * min(counts.values()) / t / D
        return (min(intra[0], per_ring), link.latency_s)

    data = ring(isl.link)
    ops = {op: ring(link) for op, link in cal.data_ops.get(isl.name, {}).items()}

    def to(other: tuple[int, int], senders: float, same_host: Path) -> Path:
        j, off2 = other
        if j == i and len(counts) == 1 and _host_counts(off2, k, D).keys() == counts.keys():
            return same_host
        return _per(_between(topology, i, j), senders)

    # Each data replica sends its activations as t slices, one per tensor rank: over
    # NVLink the t slices travel in parallel; through a NIC the busiest host's busiest/t
    # replicas share it.
    send = _NONE
    if s + 1 < len(rep):
        send = to(rep[s + 1], busiest / t, (intra[0] * t, intra[1]))
    tie = _NONE  # every rank of the first and last stage all-reduces its embedding shard
    if s in (0, len(rep) - 1) and len(rep) > 1:
        tie = to(rep[-1] if s == 0 else rep[0], busiest, intra)
    fwd, bwd = cal.flops_per_s(topology, i)
    return StageHardware(
        island=i,
        fwd_flops=fwd,
        bwd_flops=bwd,
        memory_bytes=isl.memory_gb * 1e9 * memory_fraction,
        mem_bw=isl.memory_bytes_per_s,
        tensor=intra,
        data=data,
        send=send,
        tie=tie,
        scatter=ops.get("reduce-scatter"),
        gather=ops.get("all-gather"),
        elementwise_passes=cal.elementwise_passes,
    )


def _between(topology: Topology, a: int, b: int) -> Link:
    """The link hosts of island a use to reach island b (their NIC when a == b)."""
    if a == b:
        return topology.islands[a].link
    return topology.inter_island(topology.islands[a].name, topology.islands[b].name)


def _per(link: Link, senders: float) -> Path:
    """Bandwidth one of ``senders`` concurrent flows gets through a per-host link."""
    return link.bytes_per_s / max(senders, 1e-12), link.latency_s


def _slowest_path(paths: list[Path]) -> Path:
    return min(p[0] for p in paths), max(p[1] for p in paths)


def _host_counts(offset: int, size: int, devices_per_host: int) -> dict[int, int]:
    """{host inside the island: devices of block [offset, offset + size) on it}."""
    first, last = offset // devices_per_host, (offset + size - 1) // devices_per_host
    return {
        h: min(offset + size, (h + 1) * devices_per_host) - max(offset, h * devices_per_host)
        for h in range(first, last + 1)
    }
