"""``python -m holmes_jax.probe``: measure a layer and the links on the real devices.

    python -m holmes_jax.probe --mesh meshes/cpu8-two-islands.yaml \\
        [--config configs/quickstart.yaml] [--set model.hidden_size=256 ...] \\
        [--out runs/probe/profile.json] [--repeats 10] [--sizes-kib 4,64,1024,16384]
    python -m holmes_jax.plan --config C --mesh M --profile runs/probe/profile.json
    sudo python -m holmes_jax.launch --mesh meshes/emu-4host-2island.yaml --emulate \\
        --program probe -- --config C --out runs/probe/emu.json   # one process per host

Writes a profile (the schema of :mod:`holmes_jax.profile`) that replaces the topology's
analytic device speed and link figures in the planner, and prints what it measured.

What is timed (median of ``--repeats`` runs after two warm-up calls):

1. **Compute**, per island: one transformer layer (:class:`Block`, the config's model
   shape, fp32, no recompute) forward, and forward + backward (a ``jax.vjp`` giving the
   parameter and input gradients); backward = the difference. The batch is one
   micro-batch of the config, ``global_batch / (data × microbatches)``, on every device
   at once, as training runs them: islands held by one process (all of them, on one CPU
   process) run as one program, since they share its machine (8 simulated CPU devices
   each run ~8x slower than one alone); islands on other processes run theirs at the
   same time. The forward on each island's first device alone is printed, not written.
2. **Links**, each at several message sizes S (bytes per device), fitted by least squares
   on relative error to ``time = latency + bytes / bandwidth``:

   - ``tensor``: ``psum`` over the devices of one host (mesh ``1 × hosts × devices_per_host``
     of each island). A ring all-reduce moves ``2(n−1)/n·S`` bytes per rank in ``2(n−1)``
     steps, so bandwidth = those bytes / slope and latency = intercept / ``2(n−1)``: the
     cost model's ring formula then reproduces the measured times. Per device, as the
     topology's ``intra_host``; the slowest island's figure is written.
   - ``data:<island>``: ``psum`` across the island's hosts on the same mesh. Every host
     sends ``devices_per_host`` rings through its NIC at once, so the per-ring bandwidth is
     multiplied by that count to give the per-host NIC figure of the topology. Islands of
     one host have no NIC traffic inside and are skipped.
   - ``data:<island>:reduce-scatter`` and ``data:<island>:all-gather``: ZeRO-1's two
     collectives on the same rings, each fitted to its own cost-model formula (half an
     all-reduce's steps and bytes). A runtime need not run them at that rate: gloo on
     CPUs takes ~0.8 of an all-reduce's time for a reduce-scatter.
   - ``stage:<a>:<b>``: ``ppermute`` from the last stage of island a to the first stage of
     island b (one direction, nothing else sending) on the mesh ``stage × data × tensor``
     whose stages are the largest block that tiles every island. A host sends as many
     messages at once as it holds devices of the stage; the per-device bandwidth times that
     count is the per-host inter-island figure.

On one CPU process all islands are the same simulated devices (the numbers then describe
the machine, not a network), which is what the tests use. With several processes (the
``--coordinator/--num-processes/--process-id`` flags, a detected cluster, or
``holmes_jax.launch --program probe``) each one times the islands it holds and the results
are gathered; process 0 prints and writes. Through ``launch --emulate`` that measures the
shaped links and the compute of processes sharing this machine, as training meets them.
Bad input prints one line and exits with code 2. The entry point sets the simulated CPU
device count (default: the topology's) before jax is imported; the library functions here
import jax only when they measure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np

from holmes_jax import distributed
from holmes_jax.axes import DATA, MESH_AXES, STAGE, TENSOR
from holmes_jax.config import Config, MeshShape, ModelConfig, check_devices, load_config
from holmes_jax.cost import Layout, ModelSpec, layer_fwd_flops
from holmes_jax.errors import ConfigError, run_cli
from holmes_jax.placement import stage_blocks
from holmes_jax.profile import DATA_OPS, PROFILE_VERSION, link_dict
from holmes_jax.topology import Link, Topology, load_topology

KIB = 1024
DEFAULT_SIZES = (4 * KIB, 64 * KIB, 1024 * KIB, 16384 * KIB)  # bytes per device
DEFAULT_REPEATS = 10
DEFAULT_OUT = "runs/probe/profile.json"
_WARMUP = 2  # untimed calls: compile, then one run to settle caches and allocators
# Ring steps per (n - 1) ranks of each collective, as holmes_jax.cost counts them.
RING_STEPS = {"all-reduce": 2, "reduce-scatter": 1, "all-gather": 1}

Log = Callable[[str], None]


# --------------------------------------------------------------------------- results


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

    key: str  # profile key: tensor | data:<island> | stage:<a>:<b>
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
    model: ModelConfig
    microbatch_size: int
    repeats: int
    compute: tuple[ComputeTiming, ...]
    links: tuple[LinkTiming, ...]
    platform: str = ""

    @property
    def layer_fwd_flops(self) -> float:
        """FLOPs of the timed layer's forward (the cost model's count)."""
        return layer_fwd_flops(_spec(self.model), self.microbatch_size)


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


def microbatch_size(cfg: Config, topology: Topology) -> int:
    """The config's micro-batch on the topology: ``global_batch / (data × microbatches)``.

    Raises:
      ConfigError: degrees that do not divide the devices, or a batch they do not divide.
    """
    shape = check_devices(cfg, topology.num_devices)
    return cfg.train.global_batch_size // (shape.data * cfg.parallel.microbatches)


def pair_shape(topology: Topology) -> MeshShape:
    """Mesh for the stage-pair probe: stages as large as the block that tiles every island.

    Tensor groups are the devices of a host every island can hold (gcd of
    ``devices_per_host``); a stage is ``gcd`` of the island sizes, so each island hosts
    whole stages and the placement rules of :func:`holmes_jax.placement.stage_blocks` hold.
    """
    t = math.gcd(*(isl.devices_per_host for isl in topology.islands))
    k = math.gcd(*(isl.num_devices for isl in topology.islands))
    shape = MeshShape(stages=topology.num_devices // k, data=k // t, tensor=t)
    stage_blocks(topology, Layout(shape.stages, shape.data, shape.tensor, 1))  # checks
    return shape


def island_pairs(topology: Topology, shape: MeshShape) -> list[tuple[int, int, int]]:
    """(sending stage, receiving stage, senders per host) for every island pair a < b.

    The last stage of island a sends to the first stage of island b; for neighbouring
    islands that is the pipeline's own cross-island hop.
    """
    blocks = stage_blocks(topology, Layout(shape.stages, shape.data, shape.tensor, 1))[0]
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


def measure(
    cfg: Config,
    topology: Topology,
    *,
    repeats: int = DEFAULT_REPEATS,
    sizes: Sequence[int] = DEFAULT_SIZES,
    log: Log | None = None,
) -> Measurement:
    """Time one layer per island and the collectives along every mesh axis.

    Args:
      cfg: a validated config (its model shape and micro-batch are timed).
      topology: the cluster; ``jax.devices()`` must list its devices in topology order.
      repeats: timed runs per measurement (the median is kept).
      sizes: message sizes for the links, bytes per device (>= 2 distinct, multiples of 4).
      log: called with one progress line per measurement (None: silent).

    Returns:
      :class:`Measurement`.

    Raises:
      ConfigError: bad repeats or sizes, too few devices, or a config the topology's
        device count does not divide.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"--repeats={repeats!r}: must be an integer >= 1")
    sizes = tuple(int(s) for s in sizes)
    if len(set(sizes)) < 2 or any(s < 4 or s % 4 for s in sizes):
        raise ConfigError(
            f"--sizes-kib={[s / KIB for s in sizes]}: need >= 2 distinct sizes, each a "
            f"positive multiple of 4 bytes"
        )
    b = microbatch_size(cfg, topology)
    import jax

    devices = jax.devices()
    if len(devices) < topology.num_devices:
        raise ConfigError(
            f"--mesh: topology '{topology.name}' has {topology.num_devices} devices but only "
            f"{len(devices)} are visible"
        )
    devices = devices[: topology.num_devices]
    say = log or (lambda _: None)
    model = replace(cfg.model, remat=False)  # the cost model adds recompute itself
    me = jax.process_index()
    offsets = topology.island_offsets

    say(f"layer forward, forward+backward, micro-batch {b}, every device busy")
    compute = _time_layers(model, b, topology, devices, repeats)

    links = []
    for isl, off in zip(topology.islands, offsets, strict=True):
        group = devices[off : off + isl.num_devices]
        mesh = _mesh(MeshShape(1, isl.num_hosts, isl.devices_per_host), group)
        mine = any(d.process_index == me for d in group)
        data = f"{DATA}:{isl.name}"
        for key, axis, n, share, op in (
            (TENSOR, TENSOR, isl.devices_per_host, 1, "all-reduce"),
            (data, DATA, isl.num_hosts, isl.devices_per_host, "all-reduce"),
            # ZeRO-1's two collectives, as issued by the trainer (a runtime may not run
            # them as half an all-reduce each, e.g. gloo on CPUs).
            *((f"{data}:{op}", DATA, isl.num_hosts, isl.devices_per_host, op) for op in DATA_OPS),
        ):
            if n < 2:
                continue  # a one-device ring moves nothing
            if mine:
                say(f"{op} over {axis} on {isl.name} ({n} ranks), {_sizes_text(sizes)}")
            times = _time_collective(mesh, axis, op, sizes, repeats) if mine else None
            links.append(_link(key, isl.name, op, n, share, sizes, times))

    if len(topology.islands) > 1:
        shape = pair_shape(topology)
        mesh = _mesh(shape, devices)
        names = [isl.name for isl in topology.islands]
        for (src, dst, senders), (a, c) in zip(
            island_pairs(topology, shape), _name_pairs(names), strict=True
        ):
            say(f"point-to-point stage {src} ({a}) -> stage {dst} ({c}), {_sizes_text(sizes)}")
            times = _time_collective(mesh, STAGE, "p2p", sizes, repeats, perm=[(src, dst)])
            links.append(_link(f"{STAGE}:{a}:{c}", f"{a}->{c}", "p2p", 2, senders, sizes, times))

    if jax.process_count() > 1:
        compute, links = _gather(compute, links)
    return Measurement(
        topology=topology,
        model=model,
        microbatch_size=b,
        repeats=repeats,
        compute=tuple(compute),
        links=tuple(links),
        platform=devices[0].platform,
    )


def probe(cfg: Config, topology: Topology, **kwargs: Any) -> dict[str, Any]:
    """Measure and return the profile as a JSON-ready dict (for notebooks).

    Args:
      cfg, topology: as :func:`measure`.
      **kwargs: ``repeats``, ``sizes``, ``log`` (see :func:`measure`).

    Returns:
      The profile (:func:`profile_dict`), loadable by :func:`holmes_jax.profile.load_profile`.
    """
    return profile_dict(measure(cfg, topology, **kwargs))


def _time_layers(
    model: ModelConfig, b: int, topology: Topology, devices: list, repeats: int
) -> list[ComputeTiming]:
    """One layer on every device of each island at once, as training runs it, and on each
    island's first device alone for comparison."""
    import flax.linen as nn
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from holmes_jax.model import Block, block_apply

    det = model.dropout == 0.0
    rng = None if det else jax.random.key(0)
    spec = PartitionSpec(*MESH_AXES)  # [1, 1, n, 1, b, s, h]: one micro-batch each

    def fwd(params, x):  # x [b, s, h]
        return block_apply(model, params, x, deterministic=det, rng=rng)

    def fwd_bwd(params, x, dy):  # gradients for the parameters and the input, as a stage
        y, vjp = jax.vjp(fwd, params, x)
        return y, vjp(dy)

    def program(mesh, f, inputs: int):
        """``f`` on every device: params replicated, activations one block per device."""

        def body(params, *xs):  # drop, then restore, the [1, 1, 1, 1] mesh block
            out = f(params, *(x[0, 0, 0, 0] for x in xs))
            return jax.tree.map(lambda a: a[None, None, None, None], out)

        in_specs = (PartitionSpec(),) + (spec,) * inputs
        return jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=spec, check_vma=False)
        )

    # Random values from the host: only shapes matter for timing, and this skips a flax init.
    gen = np.random.default_rng(0)
    shape = (b, model.seq_len, model.hidden_size)  # [b, s, h]
    abstract = jax.eval_shape(Block(model).init, jax.random.key(0), np.zeros(shape, np.float32))
    params = jax.tree.map(
        lambda a: (0.02 * gen.standard_normal(a.shape)).astype(np.float32),
        nn.meta.unbox(abstract["params"]),
    )
    alone = jax.jit(fwd)
    me = jax.process_index()
    ranges = [
        range(off, off + isl.num_devices)
        for isl, off in zip(topology.islands, topology.island_offsets, strict=True)
    ]
    # Islands that share a process share its machine: they run as one program (the same
    # number for each); islands on other processes run theirs at the same time.
    group = next(g for g in _process_groups(topology, devices) if me in g["processes"])
    group_devices = [devices[k] for i in group["islands"] for k in ranges[i]]
    mesh = _mesh(MeshShape(1, len(group_devices), 1), group_devices)
    host_x = gen.standard_normal((*mesh.devices.shape, *shape)).astype(np.float32)
    x = jax.device_put(host_x, NamedSharding(mesh, spec))
    p = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    fwd_s = _median_time(partial(program(mesh, fwd, 1), p, x), repeats)
    fwd_bwd_s = _median_time(partial(program(mesh, fwd_bwd, 2), p, x, x), repeats)
    out = []
    for i, isl in enumerate(topology.islands):
        first = devices[ranges[i][0]]
        timing = ComputeTiming(isl.name, str(first), len(group_devices), *(math.nan,) * 3)
        if i in group["islands"]:
            timing = replace(timing, fwd_s=fwd_s, fwd_bwd_s=fwd_bwd_s)
        if first.process_index == me:
            one = jax.device_put((params, host_x[0, 0, 0, 0]), first)
            timing = replace(timing, alone_fwd_s=_median_time(partial(alone, *one), repeats))
        out.append(timing)
    return out


def _process_groups(topology: Topology, devices: list) -> list[dict[str, set[int]]]:
    """Islands joined when one process holds devices of both (connected components).

    Every process computes the same groups from ``device.process_index``; each group runs
    one layer program over all its devices.
    """
    groups: list[dict[str, set[int]]] = []
    for i, (isl, off) in enumerate(zip(topology.islands, topology.island_offsets, strict=True)):
        new = {
            "islands": {i},
            "processes": {d.process_index for d in devices[off : off + isl.num_devices]},
        }
        for g in [g for g in groups if g["processes"] & new["processes"]]:
            groups.remove(g)
            new["islands"] |= g["islands"]
            new["processes"] |= g["processes"]
        groups.append(new)
    return groups


def _time_collective(
    mesh, axis: str, op: str, sizes: Sequence[int], repeats: int, perm=None
) -> list[float]:
    """Median seconds of ``op`` over ``axis`` at each size (bytes of the full buffer per
    device: a reduce-scatter's input, an all-gather's output)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    spec = PartitionSpec(*MESH_AXES)  # block [1, 1, 1, 1, n] per device
    n = mesh.shape[axis]
    bodies = {
        "all-reduce": lambda x: jax.lax.psum(x, axis),
        "reduce-scatter": lambda x: jax.lax.psum_scatter(x, axis, scatter_dimension=4, tiled=True),
        "all-gather": lambda x: jax.lax.all_gather(x, axis, axis=4, tiled=True),
        "p2p": lambda x: jax.lax.ppermute(x, axis, perm),
    }
    fn = jax.jit(
        jax.shard_map(bodies[op], mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    )
    times = []
    for size in sizes:
        elements = size // 4  # 4 B/element
        if op == "reduce-scatter":
            elements -= elements % n  # the scattered dimension splits evenly
        elif op == "all-gather":
            elements //= n  # each rank's part of the gathered buffer
        ones = jax.jit(
            partial(jnp.ones, (*mesh.devices.shape, elements), jnp.float32),
            out_shardings=NamedSharding(mesh, spec),
        )
        times.append(_median_time(partial(fn, ones()), repeats))
    return times


def _median_time(call: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``call()`` until its result is ready, after warm-up calls."""
    import jax

    for _ in range(_WARMUP):
        jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _mesh(shape: MeshShape, devices):
    from holmes_jax.mesh import build_mesh

    return build_mesh(shape, devices)


def _link(key, island, op, ranks, share, sizes, times) -> LinkTiming:
    times = tuple(times) if times is not None else (math.nan,) * len(sizes)
    return LinkTiming(key, island, op, ranks, share, tuple(sizes), times)


def _name_pairs(names: list[str]) -> list[tuple[str, str]]:
    return [(a, c) for i, a in enumerate(names) for c in names[i + 1 :]]


def _sizes_text(sizes: Sequence[int]) -> str:
    return "sizes " + ", ".join(_kib(s) for s in sizes)


def _kib(nbytes: float) -> str:
    return f"{nbytes / KIB:g} KiB" if nbytes < KIB * KIB else f"{nbytes / KIB / KIB:g} MiB"


def _gather(compute: list[ComputeTiming], links: list[LinkTiming]):
    """Merge what each process measured (NaN where it measured nothing) over processes."""
    from jax.experimental import multihost_utils

    flat = [v for c in compute for v in (c.fwd_s, c.fwd_bwd_s, c.alone_fwd_s)]
    flat += [t for lk in links for t in lk.times_s]
    every = np.asarray(multihost_utils.process_allgather(np.asarray(flat, np.float64)))
    merged = iter(np.fmax.reduce(every.reshape(-1, len(flat)), axis=0).tolist())
    compute = [
        replace(c, fwd_s=next(merged), fwd_bwd_s=next(merged), alone_fwd_s=next(merged))
        for c in compute
    ]
    links = [replace(lk, times_s=tuple(next(merged) for _ in lk.times_s)) for lk in links]
    return compute, links


# --------------------------------------------------------------------------- output


def profile_dict(m: Measurement) -> dict[str, Any]:
    """The profile file's content (schema: :mod:`holmes_jax.profile`).

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
        },
        "compute": {
            c.island: {"layer_fwd_s": _round(c.fwd_s), "layer_bwd_s": _round(c.bwd_s)}
            for c in m.compute
        },
        "links": {k: {n: _round(v) for n, v in link_dict(lk).items()} for k, lk in links.items()},
    }


def format_table(m: Measurement) -> str:
    """Human-readable report of a measurement, next to the topology's own figures."""
    topo, model = m.topology, m.model
    flops = m.layer_fwd_flops
    lines = [
        f"probe of topology {topo.name}: {topo.num_devices} {m.platform or 'jax'} devices, "
        f"{len(topo.islands)} islands; median of {m.repeats} runs",
        f"layer: hidden {model.hidden_size}, {model.num_heads} heads, seq {model.seq_len}, "
        f"mlp x{model.mlp_ratio}, micro-batch {m.microbatch_size}, fp32 "
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
    lines.append(f"  sizes per device: {', '.join(_kib(s) for s in m.links[0].sizes)}")
    return "\n".join(lines)


def _topology_link(topo: Topology, key: str) -> Link:
    if key == TENSOR:
        return topo.intra_host
    kind, *names = key.split(":")
    if kind == DATA:
        return next(isl.link for isl in topo.islands if isl.name == names[0])
    return topo.inter_island(*names)


def _spec(model: ModelConfig) -> ModelSpec:
    return ModelSpec(
        1, model.hidden_size, model.num_heads, model.seq_len, model.vocab_size, model.mlp_ratio
    )


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


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m holmes_jax.probe", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--mesh", help="topology (meshes/*.yaml); default: parallel.mesh")
    ap.add_argument("--config", help="run config (configs/*.yaml); defaults if omitted")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, e.g. model.hidden_size=256 (repeatable)",
    )
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"profile to write ({DEFAULT_OUT})")
    ap.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="timed runs (median)")
    ap.add_argument(
        "--sizes-kib",
        default=",".join(f"{s // KIB}" for s in DEFAULT_SIZES),
        help="message sizes per device in KiB, comma-separated",
    )
    ap.add_argument(
        "--cpu-devices",
        type=int,
        default=0,
        help="simulated CPU devices when no accelerator is present (0: the topology's)",
    )
    distributed.add_flags(ap)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    return run_cli(_run, _parser().parse_args(argv))


def _run(args: argparse.Namespace) -> int:
    overrides = list(args.set) + ([f"parallel.mesh={args.mesh}"] if args.mesh else [])
    cfg = distributed.apply_flags(load_config(args.config, overrides), args)
    if not cfg.parallel.mesh:
        raise ConfigError("--mesh=None: a topology is needed (--mesh or parallel.mesh)")
    topology = load_topology(cfg.parallel.mesh)
    try:
        sizes = [round(float(s) * KIB) for s in args.sizes_kib.split(",")]
    except ValueError:
        raise ConfigError(f"--sizes-kib='{args.sizes_kib}': must be numbers, e.g. 4,64") from None
    from holmes_jax.train import request_cpu_devices

    request_cpu_devices(args.cpu_devices or topology.num_devices)  # before jax is imported

    def log(line: str) -> None:
        print(f"probe: {line}", file=sys.stderr, flush=True)

    def body() -> int:
        import jax

        main_process = jax.process_index() == 0
        result = measure(
            cfg, topology, repeats=args.repeats, sizes=sizes, log=log if main_process else None
        )
        if main_process:
            write_profile(profile_dict(result), args.out)
            print(format_table(result))
            print(f"wrote {args.out}  (use: python -m holmes_jax.plan --profile {args.out} ...)")
        return 0

    # One of several processes (the launcher's, or SLURM's ...): join, then measure.
    return distributed.run_joined(cfg, body)


if __name__ == "__main__":
    sys.exit(main())
