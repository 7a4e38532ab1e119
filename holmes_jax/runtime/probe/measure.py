"""Measure a stage's layers and the links on the real devices (the probe's jax half).

``python -m holmes_jax.probe`` parses the command line and calls :func:`measure`. The
results, the link fits and the profile writer are jax-free
(:mod:`holmes_jax.planner.measurements`). ``docs/planner.md`` ("Measured profiles") says
why each measurement is made the way it is.

1. **Compute**, per island (:func:`_time_layers`): a stage of the config's plan, ``n`` distinct
   layers, forward, and forward then backward. Per layer = the time / ``n``.
2. **Links**, each at several message sizes per device (:func:`_time_collective`), fitted
   to ``time = latency + bytes / bandwidth`` in the cost model's ring terms
   (:meth:`~holmes_jax.planner.measurements.LinkTiming.path`):
   - ``tensor``: ``psum`` over one host's devices.
   - ``data:<island>``: ``psum`` across the island's hosts. ``data:<island>:reduce-scatter``
     and ``:all-gather``: ZeRO-1's two.
   - ``stage:<a>:<b>``: ``ppermute`` from island a's last stage to island b's first.
   - ``data:*`` and ``data:*:<op>``: the three collectives over one ``data`` axis through
     every device in topology order, as the naive placement's data group runs them.
   Where any process runs under a CPU quota (:func:`holmes_jax.cluster.cgroups.own_share`:
   the emulated cluster's ``--cpu-quota``), every link is also timed right after a burst of
   compute, as training meets it.

With several processes each one times the islands it holds and process 0 writes. The
library functions import jax only when they measure.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np

from holmes_jax.cluster.cgroups import own_share
from holmes_jax.core.axes import DATA, MESH_AXES, STAGE, TENSOR
from holmes_jax.core.config import Config, ModelConfig
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.plan_request import plan_request
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
    stage_layers,
)
from holmes_jax.planner.profiles import DATA_RING_OPS, SPANNING, data_key
from holmes_jax.planner.topology import Topology

_WARMUP = 2  # untimed calls: compile, then one run to settle caches and allocators
CHAIN_S = 0.05  # seconds one timed layer program lasts on a device alone
LOAD_FACTOR = 6  # seconds per timed call and CHAIN_S when processes share cores
WINDOWS = 3  # timed windows of _shared_times (the median is kept)
MAX_CHAIN = 512  # most stage passes repeated in one timed program
MAX_STACK = 8  # most distinct layers in the timed stage
MAX_STACK_BYTES = 4 << 30  # most fp32 weight bytes of the timed stage
PEER_WAIT_S = 3600  # how long a process waits at a barrier for the slowest (compiling) one
BUSY_DIM = 256  # under a CPU quota a collective is timed after products of this square
BUSY_ITERS = 6  # this many of them: ~10 ms of one core, several quota periods' worth
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
    req = plan_request(cfg)  # the planner's view of the run: its micro-batch and stage
    b = microbatch_size(req, topology)
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

    # A stage, but no more than MAX_STACK layers and MAX_STACK_BYTES of fp32 weights (and as
    # much again of weight gradients): a 70B layer alone is 3.2 GB.
    most = max(1, min(MAX_STACK, MAX_STACK_BYTES // (4 * cfg.model.spec.layer_params)))
    layers = stage_layers(req, most)
    say(f"layer forward, forward+backward, micro-batch {b}, a stage of {layers}, every device busy")
    compute = _time_layers(model, b, layers, topology, devices, repeats)

    # Under a CPU quota (the emulated cluster's slower islands) a host that has just
    # computed is throttled until its quota refills, stalling any collective it is in. The
    # kernel charges a burst's overrun (up to a scheduler tick) to the next periods: on a
    # host with a sixth of a core a collective right after compute waits tens of ms.
    after = bool(_agreed_max(int(own_share() is not None)))
    timed = " (each after a burst of compute, less the burst: CPU quotas)" if after else ""
    links = []
    for isl, off in zip(topology.islands, offsets, strict=True):
        _together()  # before this island's processes set up their collectives
        group = devices[off : off + isl.num_devices]
        mesh = _mesh(Degrees(1, isl.num_hosts, isl.devices_per_host), group)
        mine = any(d.process_index == me for d in group)
        for key, axis, n, share, op in (
            (TENSOR, TENSOR, isl.devices_per_host, 1, "all-reduce"),  # per device
            # The all-reduce, and ZeRO-1's two collectives as issued by the trainer (a
            # runtime may not run them as half an all-reduce each, e.g. gloo on CPUs).
            # devices_per_host rings go through each host's NIC at once.
            *(
                (data_key(isl.name, op), DATA, isl.num_hosts, isl.devices_per_host, op)
                for op in DATA_RING_OPS
            ),
        ):
            if n < 2:
                continue  # a one-device ring moves nothing
            if mine:
                say(f"{op} over {axis} on {isl.name} ({n} ranks), {sizes_text(sizes)}{timed}")
            times = _time_collective(mesh, axis, op, sizes, repeats, after=after) if mine else None
            links.append(_link(key, isl.name, op, n, share, sizes, times))

    if len(topology.islands) > 1:
        # One data group through every island, as the naive placement's (gloo's own
        # algorithms and the stalls of every process in one collective are in the times).
        # tensor = the gcd of devices_per_host; t rings go through each host's NIC at once.
        t = math.gcd(*(isl.devices_per_host for isl in topology.islands))
        n = topology.num_devices // t
        mesh = _mesh(Degrees(1, n, t), devices)
        _together()
        for op in DATA_RING_OPS:
            say(f"{op} over {DATA} across islands ({n} ranks), {sizes_text(sizes)}{timed}")
            times = _time_collective(mesh, DATA, op, sizes, repeats, after=after)
            links.append(_link(data_key(SPANNING, op), "all islands", op, n, t, sizes, times))

        shape = pair_shape(topology)
        mesh = _mesh(shape, devices)
        names = [isl.name for isl in topology.islands]
        # senders: the messages a host sends at once (the link's share)
        for (src, dst, senders), (a, c) in zip(
            island_pairs(topology, shape), name_pairs(names), strict=True
        ):
            _together()
            say(f"point-to-point stage {src} ({a}) -> stage {dst} ({c}), {sizes_text(sizes)}")
            pair = [(src, dst)]
            times = _time_collective(mesh, STAGE, "p2p", sizes, repeats, pair, after)
            links.append(_link(f"{STAGE}:{a}:{c}", f"{a}->{c}", "p2p", 2, senders, sizes, times))

    if jax.process_count() > 1:
        _together()
        compute, links = _gather(compute, links)
    return Measurement(
        topology=topology,
        model=model.spec,
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
    model: ModelConfig, b: int, layers: int, topology: Topology, devices: list, repeats: int
) -> list[ComputeTiming]:
    """Per layer, a stage of ``layers`` layers on every device of each island at once, as
    training runs it, and one layer's forward on each island's first device alone for
    comparison.

    The stage is ``layers`` distinct :class:`Block` layers in fp32, without recompute, on
    one micro-batch of the config per device. Each timed program runs the stage ``r`` times,
    ``r`` chosen so one call lasts about :data:`CHAIN_S` on a device alone. Processes time
    together in windows (:func:`_shared_times`), and an island's processes are combined at
    their fair share (:func:`_fair_share`).
    """
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from holmes_jax.runtime.model.decoder import Block, block_apply

    det = model.dropout == 0.0
    rng = None if det else jax.random.key(0)
    spec = PartitionSpec(*MESH_AXES)  # [1, 1, n, 1, b, s, h]: one micro-batch each

    def fwd(params, x):  # x [b, s, h]
        return block_apply(model, params, x, deterministic=det, rng=rng)

    def stack(params, x):  # the n layers of a stage, params stacked [n, ...]
        return jax.lax.scan(lambda a, p: (fwd(p, a), None), x, params)[0]

    def repeated(r: int, backward: bool):
        """The stage run ``r`` times in one program, each pass on the last one's output:
        forward only, or forward through every layer then backward through every layer
        (as a stage's micro-batch), the input gradient the next output gradient and the
        weight gradients summed."""
        if not backward:
            return lambda params, x: jax.lax.fori_loop(0, r, lambda _, a: stack(params, a), x)

        def run(params, x, dy):
            def step(_, carry):
                x, dy, total = carry
                y, vjp = jax.vjp(stack, params, x)
                g, dx = vjp(dy)
                return y, dx, jax.tree.map(jnp.add, total, g)

            zero = jax.tree.map(jnp.zeros_like, params)
            y, dx, total = jax.lax.fori_loop(0, r, step, (x, dy, zero))
            return y, (total, dx)

        return run

    def program(mesh, f, inputs: int):
        """``f`` on every device: params replicated, activations one block per device."""

        def body(params, *xs):  # drop, then restore, the [1, 1, 1, 1] mesh block
            out = f(params, *(x[0, 0, 0, 0] for x in xs))
            return jax.tree.map(lambda a: a[None, None, None, None], out)

        in_specs = (PartitionSpec(),) + (spec,) * inputs
        # check_vma off: checked, the vjp of the replicated params adds an all-reduce of their
        # gradient to the timed compute.
        return jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=spec, check_vma=False)
        )

    # Random values from the host: only shapes matter for timing, and this skips a flax init.
    gen = np.random.default_rng(0)
    shape = (b, model.seq_len, model.hidden_size)  # [b, s, h]
    abstract = jax.eval_shape(Block(model).init, jax.random.key(0), np.zeros(shape, np.float32))
    params = jax.tree.map(
        lambda a: (0.02 * gen.standard_normal((layers, *a.shape))).astype(np.float32),
        nn.meta.unbox(abstract["params"]),
    )  # [layers, ...]: a stage's distinct layers
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
    # Stage passes per timed program: from one, the most any process needs.
    once = _median_time(partial(program(mesh, repeated(1, True), 2), p, x, x), 3)
    r = _agreed_max(min(MAX_CHAIN, max(1, math.ceil(CHAIN_S / max(once, 1e-9)))))
    calls = (
        partial(program(mesh, repeated(r, False), 1), p, x),
        partial(program(mesh, repeated(r, True), 2), p, x, x),
    )
    if jax.process_count() > 1:
        times = _shared_times(calls, repeats)
    else:
        times = [_median_time(call, repeats) for call in calls]
    fwd_s, fwd_bwd_s = (t / (r * layers) for t in times)  # per layer
    out = []
    for i, isl in enumerate(topology.islands):
        first = devices[ranges[i][0]]
        timing = ComputeTiming(isl.name, str(first), len(group_devices), *(math.nan,) * 3)
        if i in group["islands"]:
            timing = replace(timing, fwd_s=fwd_s, fwd_bwd_s=fwd_bwd_s)
        if first.process_index == me:
            one = jax.device_put((jax.tree.map(lambda a: a[0], params), host_x[0, 0, 0, 0]), first)
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
    mesh, axis: str, op: str, sizes: Sequence[int], repeats: int, perm=None, after: bool = False
) -> list[float]:
    """Median seconds of ``op`` over ``axis`` at each size (bytes of the full buffer per
    device: a reduce-scatter's input, an all-gather's output). ``after``: also each call
    right after a burst of compute (:func:`_busy`), less the burst alone, and the larger of
    the two figures kept."""
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

    def program(body):  # check_vma off as in the compute program (same HLO for these)
        return jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
        )

    fn = program(bodies[op])
    busy = program(_busy) if after else None
    then = program(lambda x: bodies[op](_busy(x))) if after else None
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
        x = ones()
        took = _median_time(partial(fn, x), repeats)
        if after:  # never less than alone: the burst's own time varies by more than a call
            both = _median_time(partial(then, x), repeats)
            took = max(took, both - _median_time(partial(busy, x), repeats))
        times.append(took)
    return times


def _busy(x):
    """``x`` after :data:`BUSY_ITERS` products of a :data:`BUSY_DIM`-square matrix (about 10
    ms of one core), on which the result depends, so a collective on it waits for them."""
    import jax
    import jax.numpy as jnp

    z = jnp.full((BUSY_DIM, BUSY_DIM), 1.0 / BUSY_DIM, jnp.float32) + x.ravel()[0] * 1e-9
    z = jax.lax.fori_loop(0, BUSY_ITERS, lambda _, z: jnp.tanh(z @ z), z)
    return jnp.where(z[0, 0] > 1e30, x + 1.0, x)  # never true; keeps the dependency


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


def _shared_times(calls: Sequence[Callable[[], Any]], repeats: int) -> list[float]:
    """Seconds per call of each of ``calls`` while every process runs them at once.

    Every process calls this at the same point. After warm-up calls, :data:`WINDOWS`
    times: a barrier, then each process calls them in turn, back to back, for the same
    wall-clock window (``repeats`` x :data:`CHAIN_S` x :data:`LOAD_FACTOR` per call, over
    the windows), so processes that share a machine's cores (the emulated cluster) contend
    for all of it but the start skew, and the calls alternate under the same load. Each
    window gives the mean per call, not the median: a process sharing cores runs some
    calls at full speed and others mostly preempted, and its throughput is what a training
    step meets. The median over windows is kept, so one stalled window does not set the
    figure. Processes leave a barrier tens of milliseconds apart (it crosses the shaped
    links), so a barrier per call of a few milliseconds would not make them overlap.
    """
    import jax
    from jax.experimental import multihost_utils

    for call in calls:
        for _ in range(_WARMUP):
            jax.block_until_ready(call())
    means = []  # [window][call]
    _together()  # some processes may still be compiling the calls
    for _ in range(WINDOWS):
        multihost_utils.sync_global_devices("holmes_jax.probe: compute")
        totals, counts = [0.0] * len(calls), [0] * len(calls)
        window = repeats * len(calls) * CHAIN_S * LOAD_FACTOR / WINDOWS
        deadline = time.perf_counter() + window
        while not counts[-1] or time.perf_counter() < deadline:
            for i, call in enumerate(calls):
                start = time.perf_counter()
                jax.block_until_ready(call())
                totals[i] += time.perf_counter() - start
                counts[i] += 1
        means.append([t / n for t, n in zip(totals, counts, strict=True)])
    return [statistics.median(column) for column in zip(*means, strict=True)]


def _mesh(shape: Degrees, devices):
    from holmes_jax.runtime.engine.mesh import build_mesh

    return build_mesh(shape, devices)


def _link(key, island, op, ranks, share, sizes, times) -> LinkTiming:
    times = tuple(times) if times is not None else (math.nan,) * len(sizes)
    return LinkTiming(key, island, op, ranks, share, tuple(sizes), times)


_BARRIERS = itertools.count()


def _together() -> None:
    """Wait, up to :data:`PEER_WAIT_S`, until every process is here (every process calls
    this at the same points). Each group of processes' first collective sets up a gloo
    context that waits only 30 s for its peers, and a host under a small CPU quota can be
    minutes behind after compiling; the barrier goes through jax's coordination service
    instead (:func:`holmes_jax.cluster.distributed.barrier`)."""
    import jax

    if jax.process_count() > 1:
        from holmes_jax.cluster.distributed import barrier

        barrier(f"holmes_jax/probe/{next(_BARRIERS)}", PEER_WAIT_S)


def _agreed_max(value: int) -> int:
    """The largest ``value`` any process passed (every process calls this at one point)."""
    import jax

    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    _together()
    return int(np.max(multihost_utils.process_allgather(np.asarray([value], np.int64))))


def _gather(compute: list[ComputeTiming], links: list[LinkTiming]):
    """Merge what each process measured (NaN where it measured nothing) over processes."""
    from jax.experimental import multihost_utils

    flat = [v for c in compute for v in (c.fwd_s, c.fwd_bwd_s, c.alone_fwd_s)]
    flat += [t for lk in links for t in lk.times_s]
    every = np.asarray(multihost_utils.process_allgather(np.asarray(flat, np.float64)))
    every = every.reshape(-1, len(flat))  # [processes, values]
    most = np.fmax.reduce(every, axis=0)
    fair = _fair_share(every[:, : 3 * len(compute)])  # layer times all measured at once
    compute = [
        replace(c, fwd_s=fair[3 * i], fwd_bwd_s=fair[3 * i + 1], alone_fwd_s=most[3 * i + 2])
        for i, c in enumerate(compute)
    ]
    rest = iter(most[3 * len(compute) :].tolist())
    links = [replace(lk, times_s=tuple(next(rest) for _ in lk.times_s)) for lk in links]
    return compute, links


def _fair_share(times: np.ndarray) -> np.ndarray:
    """Per column, the harmonic mean of the processes' times (NaN: not measured there).

    The processes of an island ran the same program at once. Over a window of seconds a
    time-sharing scheduler favours some of them, which a training run evens out, its steps
    waiting for every process. The island's figure is the time per call had all progressed
    at their summed rate: the harmonic mean.
    """
    counts = (~np.isnan(times)).sum(axis=0)
    rates = np.nansum(1.0 / times, axis=0)  # 0 where no process measured
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(counts > 0, counts / rates, np.nan)


# --------------------------------------------------------------------------- output
