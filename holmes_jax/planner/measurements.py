"""What a probe measured, fitted to the cost model's terms, and written as a profile.

:mod:`holmes_jax.runtime.probe.measure` times the devices and links and returns a
:class:`Measurement`; this module holds the results, fits each link to
``time = latency + bytes / bandwidth`` (:func:`fit_link`) in the cost model's ring terms
(:meth:`LinkTiming.path`), chooses the shapes the probe runs (:func:`pair_shape`,
:func:`island_pairs`), and writes the profile that :mod:`holmes_jax.planner.profiles`
reads back (:func:`profile_dict`, :func:`write_profile`, :func:`format_table`).
Pure Python + NumPy; no jax import.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from holmes_jax.core.axes import DATA, TENSOR
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.plan_request import PlanRequest
from holmes_jax.core.spec import Degrees, Layout, ModelSpec, layer_fwd_flops
from holmes_jax.planner.placement import naive_hops, stage_blocks
from holmes_jax.planner.profiles import PROFILE_VERSION, SPANNING, link_dict
from holmes_jax.planner.topology import Link, Topology

KIB = 1024
DEFAULT_SIZES = (4 * KIB, 64 * KIB, 1024 * KIB, 16384 * KIB)  # bytes per device
DEFAULT_REPEATS = 10
RING_STEPS = {"all-reduce": 2, "reduce-scatter": 1, "all-gather": 1}


@dataclass(frozen=True)
class ComputeTiming:
    """One layer on the devices of an island, seconds per micro-batch on each device."""

    island: str
    device: str  # the island's first device
    devices: int  # devices that ran the layer at once (this island's and its process group's)
    fwd_s: float  # per micro-batch, every device of the island busy
    fwd_bwd_s: float
    alone_fwd_s: float  # forward on the first device with the others idle (for reference)

    @property
    def bwd_s(self) -> float:
        """Backward alone: forward + backward minus forward (floored at 1 ns)."""
        return max(self.fwd_bwd_s - self.fwd_s, 1e-9)


@dataclass(frozen=True)
class LinkTiming:
    """One collective timed at several sizes, and how it maps to a topology link.

    ``op`` is ``all-reduce`` (a ring of ``ranks``) or ``p2p``; ``share`` is how many rings
    or senders went through one host's NIC at once (1 for the per-device ``tensor`` link).
    """

    key: str  # profile key: tensor | data:<island>[:<op>] | data:*[:<op>] | stage:<a>:<b>
    island: str  # where it ran ("a->b" for a p2p pair)
    op: str
    ranks: int
    share: int
    sizes: tuple[int, ...]  # bytes per device
    times_s: tuple[float, ...]  # median seconds at each size

    def path(self) -> tuple[float, float]:
        """(bytes/s, latency s) seen by one ring or one sender, in the cost model's terms.

        The inverse of the cost model's formula for ``op`` (:data:`RING_STEPS`): a ring
        all-reduce moves ``2(n−1)/n·S`` bytes per rank in ``2(n−1)`` steps, a reduce-scatter
        or all-gather of an S-byte buffer half of both; a p2p sends S once.
        """
        n = self.ranks
        if self.op == "p2p":
            return fit_link(self.sizes, self.times_s)
        steps = RING_STEPS[self.op] * (n - 1)
        bus = [steps / n * s for s in self.sizes]
        bw, lat = fit_link(bus, self.times_s)
        return bw, lat / steps

    def link(self) -> Link:
        """The fitted link in the topology's units (per device or per host NIC)."""
        bw, lat = self.path()
        return Link(bandwidth_gbps=bw * self.share * 8 / 1e9, latency_us=lat * 1e6)


@dataclass(frozen=True)
class Measurement:
    """Everything one probe run measured."""

    topology: Topology
    model: ModelSpec  # the timed layer's shape
    microbatch_size: int
    repeats: int
    compute: tuple[ComputeTiming, ...]
    links: tuple[LinkTiming, ...]
    platform: str = ""

    @property
    def layer_fwd_flops(self) -> float:
        """FLOPs of the timed layer's forward (the cost model's count)."""
        return layer_fwd_flops(self.model, self.microbatch_size)


# --------------------------------------------------------------------------- fitting


def fit_link(nbytes: Sequence[float], times_s: Sequence[float]) -> tuple[float, float]:
    """Fit ``time = latency + bytes / bandwidth`` by least squares on relative error.

    Relative error weighs the latency-bound small messages as much as the bandwidth-bound
    large ones (sizes span decades). A negative intercept is refitted through the origin;
    a non-positive slope (noise swamping the sizes) falls back to the largest message.

    Args:
      nbytes: message sizes in bytes (at least two distinct).
      times_s: measured seconds at each size (all > 0).

    Returns:
      (bandwidth in bytes/s, latency in seconds), bandwidth > 0 and latency >= 0.

    Raises:
      ConfigError: fewer than two distinct sizes, or a non-positive time.
    """
    x = np.asarray(nbytes, dtype=np.float64)
    t = np.asarray(times_s, dtype=np.float64)
    if x.shape != t.shape or len(set(x.tolist())) < 2:
        raise ConfigError(f"sizes={list(nbytes)}: need at least two distinct message sizes")
    if not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise ConfigError(f"times={list(times_s)}: every time must be finite and > 0")
    w = 1.0 / t  # rows scaled by 1/t: minimise sum(((a + b·x - t) / t)^2)
    (lat, inv_bw), *_ = np.linalg.lstsq(np.stack([w, w * x], 1), np.ones_like(t), rcond=None)
    if lat < 0:
        lat, inv_bw = 0.0, float(np.sum(w * w * x * t) / np.sum(w * w * x * x))
    if not inv_bw > 0:
        k = int(np.argmax(x))
        return float(x[k] / t[k]), 0.0
    return float(1.0 / inv_bw), float(lat)


# --------------------------------------------------------------------------- what to run


def microbatch_size(req: PlanRequest, topology: Topology) -> int:
    """The run's micro-batch on the topology:
    ``global_batch / (replica × data × microbatches)`` (every replica trains its own share).

    Raises:
      ConfigError: degrees that do not divide the devices, or a batch they do not divide.
    """
    shape = req.degrees(topology.num_devices)
    return req.run.global_batch_size // (shape.replica * shape.data * req.parallel.microbatches)


def stage_layers(req: PlanRequest, most: int) -> int:
    """Layers one device runs per micro-batch pass under the run's plan (the largest
    entry of ``parallel.layers_per_stage``, else an even split over stages x virtual
    stages, rounded up), at most ``most``: the probe times a stage of that many distinct
    layers, whose weights and stored activations the training step also streams through."""
    p = req.parallel
    if isinstance(p.layers_per_stage, tuple):
        n = max(p.layers_per_stage)
    else:
        n = math.ceil(req.model.num_layers / (p.stages * p.virtual_stages))
    return max(1, min(most, n))


def pair_shape(topology: Topology) -> Degrees:
    """Mesh for the stage-pair probe: stages as large as the block that tiles every island.

    Tensor groups are the devices of a host every island can hold (gcd of
    ``devices_per_host``); a stage is ``gcd`` of the island sizes, so each island hosts
    whole stages and the placement rules of :func:`holmes_jax.planner.placement.stage_blocks` hold.
    """
    t = math.gcd(*(isl.devices_per_host for isl in topology.islands))
    k = math.gcd(*(isl.num_devices for isl in topology.islands))
    shape = Degrees(stages=topology.num_devices // k, data=k // t, tensor=t)
    stage_blocks(topology, Layout(shape.stages, shape.data, shape.tensor, microbatches=1))  # checks
    return shape


def island_pairs(topology: Topology, shape: Degrees) -> list[tuple[int, int, int]]:
    """(sending stage, receiving stage, senders per host) for every island pair a < b.

    The last stage of island a sends to the first stage of island b; for neighbouring
    islands that is the pipeline's own cross-island hop.
    """
    blocks = stage_blocks(topology, Layout(shape.stages, shape.data, shape.tensor, microbatches=1))[
        0
    ]
    stages_of: dict[int, list[int]] = {}
    for s, (i, _) in enumerate(blocks):
        stages_of.setdefault(i, []).append(s)
    places = topology.device_places()
    k = shape.data * shape.tensor
    out = []
    for a in range(len(topology.islands)):
        for b in range(a + 1, len(topology.islands)):
            src, dst = stages_of[a][-1], stages_of[b][0]
            hosts = [p.host for p in places[src * k : (src + 1) * k]]
            out.append((src, dst, max(hosts.count(h) for h in set(hosts))))
    return out


# --------------------------------------------------------------------------- measuring


def profile_dict(m: Measurement) -> dict[str, Any]:
    """The profile file's content (schema: :mod:`holmes_jax.planner.profiles`).

    Links with the same key (``tensor``, timed on every island) keep the slowest figure.
    """
    links: dict[str, Link] = {}
    for lt in m.links:
        new, old = lt.link(), links.get(lt.key)
        if old is not None:
            new = Link(
                min(old.bandwidth_gbps, new.bandwidth_gbps), max(old.latency_us, new.latency_us)
            )
        links[lt.key] = new
    return {
        "version": PROFILE_VERSION,
        "topology": m.topology.name,
        "measured_with": {
            "hidden_size": m.model.hidden_size,
            "seq_len": m.model.seq_len,
            "num_heads": m.model.num_heads,
            "mlp_ratio": m.model.mlp_ratio,
            "microbatch_size": m.microbatch_size,
            "tensor": 1,  # the whole layer on one device
            "act_bytes": 4,  # fp32 activations
            **(
                {
                    "arch": m.model.arch,
                    "num_kv_heads": m.model.num_kv_heads,
                    "mlp_size": m.model.mlp_size,
                }
                if m.model.arch != "gpt2"
                else {}
            ),
        },
        "compute": {
            c.island: {"layer_fwd_s": _round(c.fwd_s), "layer_bwd_s": _round(c.bwd_s)}
            for c in m.compute
        },
        "links": {
            k: {n: _round(v) for n, v in link_dict(lk).items()} | _points(k, m.links)
            for k, lk in links.items()
        },
    }


def _points(key: str, timings: Sequence[LinkTiming]) -> dict[str, Any]:
    """``{"points": ...}`` for a data ring through every island (the sizes and times the
    planner prices that layout's calls from, :class:`~holmes_jax.planner.placement.
    MeasuredOp`); {} for any other link."""
    timed = [x for x in timings if x.key == key]
    if not key.startswith(f"{DATA}:{SPANNING}") or not timed:
        return {}
    x = timed[0]
    if not all(math.isfinite(v) and v > 0 for v in x.times_s):
        return {}
    return {
        "points": {
            "ranks": x.ranks,
            "tensor": x.share,
            "bytes": list(x.sizes),
            "seconds": [_round(v) for v in x.times_s],
        }
    }


def format_table(m: Measurement) -> str:
    """Human-readable report of a measurement, next to the topology's own figures."""
    topo, model = m.topology, m.model
    flops = m.layer_fwd_flops
    lines = [
        f"probe of topology {topo.name}: {topo.num_devices} {m.platform or 'jax'} devices, "
        f"{len(topo.islands)} islands; median of {m.repeats} runs (with several processes "
        f"the layers: mean per call in shared windows)",
        f"layer: hidden {model.hidden_size}, {model.num_heads} heads, seq {model.seq_len}, "
        f"mlp {model.mlp_size} ({model.arch}), micro-batch {m.microbatch_size}, fp32 "
        f"({flops / 1e9:.3g} GFLOP forward)",
        "  island      devices  fwd ms   bwd ms   fwd GFLOP/s  bwd GFLOP/s  peak GFLOP/s"
        "  fwd ms alone",
    ]
    peak = {isl.name: isl.peak_tflops * 1e3 for isl in topo.islands}
    for c in m.compute:
        lines.append(
            f"  {c.island:<11} {c.devices:<8} {c.fwd_s * 1e3:<8.3f} {c.bwd_s * 1e3:<8.3f} "
            f"{flops / c.fwd_s / 1e9:<12.4g} {2 * flops / c.bwd_s / 1e9:<12.4g} "
            f"{peak[c.island]:<13.4g} {c.alone_fwd_s * 1e3:.3f} ({c.device})"
        )
    if not m.links:
        return "\n".join(lines)
    lines.append(
        "  link            where        op          ranks  x share  ms per size"
        "                       -> Gbit/s    latency us  (topology Gbit/s, us)"
    )
    for lt in m.links:
        lk, ref = lt.link(), _topology_link(topo, lt.key)
        per_size = " ".join(f"{t * 1e3:.3g}" for t in lt.times_s)
        lines.append(
            f"  {lt.key:<15} {lt.island:<12} {lt.op:<11} {lt.ranks:<6} {lt.share:<8} "
            f"{per_size:<33} {lk.bandwidth_gbps:<11.4g} {lk.latency_us:<11.4g} "
            f"({ref.bandwidth_gbps:g}, {ref.latency_us:g})"
        )
    lines.append(f"  sizes per device: {', '.join(kib(s) for s in m.links[0].sizes)}")
    return "\n".join(lines)


def _topology_link(topo: Topology, key: str) -> Link:
    if key == TENSOR:
        return topo.intra_host
    kind, *names = key.split(":")
    if kind == DATA and names[0] == SPANNING:  # the naive ring's slowest hop
        hops = naive_hops(topo)
        return Link(min(h.bandwidth_gbps for h in hops), max(h.latency_us for h in hops))
    if kind == DATA:
        return next(isl.link for isl in topo.islands if isl.name == names[0])
    return topo.inter_island(*names)


def _round(x: float) -> float:
    return float(f"{x:.6g}")


def write_profile(profile: dict[str, Any], path: str) -> None:
    """Write a profile as indented JSON, creating the directory."""
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(profile, f, indent=2)
        f.write("\n")


# --------------------------------------------------------------------------- CLI


def name_pairs(names: list[str]) -> list[tuple[str, str]]:
    return [(a, c) for i, a in enumerate(names) for c in names[i + 1 :]]


def sizes_text(sizes: Sequence[int]) -> str:
    return "sizes " + ", ".join(kib(s) for s in sizes)


def kib(nbytes: float) -> str:
    return f"{nbytes / KIB:g} KiB" if nbytes < KIB * KIB else f"{nbytes / KIB / KIB:g} MiB"
