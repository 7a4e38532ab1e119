"""Measure one layer and the links on the real devices (the probe's jax half).

``python -m holmes_jax.probe`` (:mod:`holmes_jax.probe`) parses the command line and calls
:func:`measure`; the results, the link fits and the profile writer are jax-free
(:mod:`holmes_jax.planner.measurements`).

What is timed (median of ``--repeats`` runs after two warm-up calls):

1. **Compute**, per island: one transformer layer (:class:`Block`, the config's model
   shape, fp32, no recompute) forward, and forward + backward (a ``jax.vjp`` giving the
   parameter and input gradients); backward = the difference. The batch is one
   micro-batch of the config, ``global_batch / (data × microbatches)``, on every device
   at once (each timed run starts after a barrier across processes), as training runs
   them: islands held by one process (all of them, on one CPU
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

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np

from holmes_jax.core.axes import DATA, MESH_AXES, STAGE, TENSOR
from holmes_jax.core.config import Config, ModelConfig
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import Degrees
from holmes_jax.planner.measurements import (
    DEFAULT_REPEATS,
    DEFAULT_SIZES,
    KIB,
    ComputeTiming,
    LinkTiming,
    Measurement,
    island_pairs,
    microbatch_size,
    name_pairs,
    pair_shape,
    profile_dict,
    sizes_text,
)
from holmes_jax.planner.profiles import DATA_OPS
from holmes_jax.planner.topology import Topology

_WARMUP = 2  # untimed calls: compile, then one run to settle caches and allocators
# Ring steps per (n - 1) ranks of each collective, as holmes_jax.planner.cost counts them.
Log = Callable[[str], None]


# --------------------------------------------------------------------------- results


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
        mesh = _mesh(Degrees(1, isl.num_hosts, isl.devices_per_host), group)
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
                say(f"{op} over {axis} on {isl.name} ({n} ranks), {sizes_text(sizes)}")
            times = _time_collective(mesh, axis, op, sizes, repeats) if mine else None
            links.append(_link(key, isl.name, op, n, share, sizes, times))

    if len(topology.islands) > 1:
        shape = pair_shape(topology)
        mesh = _mesh(shape, devices)
        names = [isl.name for isl in topology.islands]
        for (src, dst, senders), (a, c) in zip(
            island_pairs(topology, shape), name_pairs(names), strict=True
        ):
            say(f"point-to-point stage {src} ({a}) -> stage {dst} ({c}), {sizes_text(sizes)}")
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
      The profile (:func:`~holmes_jax.planner.measurements.profile_dict`), loadable by
      :func:`holmes_jax.planner.profiles.load_profile`.
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

    from holmes_jax.runtime.model import Block, block_apply

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
    mesh = _mesh(Degrees(1, len(group_devices), 1), group_devices)
    host_x = gen.standard_normal((*mesh.devices.shape, *shape)).astype(np.float32)
    x = jax.device_put(host_x, NamedSharding(mesh, spec))
    p = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    fwd_s = _median_time(partial(program(mesh, fwd, 1), p, x), repeats, together=True)
    fwd_bwd_s = _median_time(partial(program(mesh, fwd_bwd, 2), p, x, x), repeats, together=True)
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


def _median_time(call: Callable[[], Any], repeats: int, together: bool = False) -> float:
    """Median seconds of ``call()`` until its result is ready, after warm-up calls.

    ``together``: every process calls this at the same point (the layer programs), and
    each timed run starts after a barrier across all processes, so all of them compute at
    once as in training. Without it, processes that share a machine's cores (the emulated
    cluster) drift apart (each compiles at its own pace) and time their few-millisecond
    layers mostly alone: the profile then priced compute 2-3x faster than training ran.
    """
    import jax

    for _ in range(_WARMUP):
        jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        if together and jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("holmes_jax.probe: compute")
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _mesh(shape: Degrees, devices):
    from holmes_jax.runtime.mesh import build_mesh

    return build_mesh(shape, devices)


def _link(key, island, op, ranks, share, sizes, times) -> LinkTiming:
    times = tuple(times) if times is not None else (math.nan,) * len(sizes)
    return LinkTiming(key, island, op, ranks, share, tuple(sizes), times)


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
