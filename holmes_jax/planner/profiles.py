"""Measured profiles: device speed and link figures that override a topology's numbers.

Analytic peak-FLOPs models are tens of percent off; a short measurement on the real
devices lands within a few percent. ``python -m holmes_jax.probe --mesh M`` times a stage
of layers and the collectives along each mesh axis and writes a JSON profile.
``python -m holmes_jax.plan --profile P`` reads it. The file is loaded strictly (version 1;
an unknown key is an error). The schema and the bounds: docs/planner.md, "Profiles".

- Compute: the measured times become the island's achieved FLOP/s, net of the cost
  model's memory-bound element-wise term. The model then reproduces the measured layer
  exactly and scales to other shapes by FLOPs.
- Links: a probe measuring per-ring bus bandwidth on an axis multiplies by the number of
  rings that shared the host NIC. ``tensor`` is per device and needs no conversion.
- A runtime may run a reduce-scatter or all-gather at nearly a whole all-reduce's cost
  (gloo on CPUs). The ``:reduce-scatter`` and ``:all-gather`` links then price ZeRO-1's
  collectives.
- ``data:*`` and ``data:*:<op>``: the three collectives over one data ring through every
  island (:data:`SPANNING`). They price the naive placement's data group
  (``Calibration.spanning_ops``), whose runtime algorithm and stalls no hop captures.
  Their ``points`` (the probe's sizes and times, and the ring's ranks and tensor degree)
  price each call of a plan on that very layout by its size
  (``Calibration.spanning_points``): the runtime's time can grow faster than the bytes.

Bounds have one home, :mod:`holmes_jax.core.spec`. Pure Python; no jax import.
"""

from __future__ import annotations

import dataclasses
import json
import os

from holmes_jax.core.axes import DATA, STAGE, TENSOR
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import (
    ACT_BYTES,
    ARCHS,
    BATCH,
    DEVICES,
    DEVICES_PER_HOST,
    HEADS,
    HIDDEN,
    LAYER_S,
    MESSAGE_BYTES,
    MLP,
    MLP_RATIO,
    SEQ,
    ModelSpec,
    check_choice,
    layer_fwd_flops,
)
from holmes_jax.core.yamlio import read_text
from holmes_jax.planner.formulas import layer_activation_bytes
from holmes_jax.planner.placement import Calibration, MeasuredOp
from holmes_jax.planner.topology import Link, Topology, TopologyReader

PROFILE_VERSION = 1
DATA_OPS = ("reduce-scatter", "all-gather")  # collectives a profile may time on their own
SPANNING = "*"  # the island name of a data ring through every island: data:* and data:*:<op>
DATA_RING_OPS = ("all-reduce", *DATA_OPS)  # the collectives timed on every data ring
_SHAPE = {  # measured_with: the key and its bound
    "hidden_size": HIDDEN,
    "seq_len": SEQ,
    "num_heads": HEADS,
    "mlp_ratio": MLP_RATIO,
    "microbatch_size": BATCH,
    "tensor": DEVICES_PER_HOST,
}


def load_profile(
    path: str | os.PathLike, topology: Topology, efficiency: float | None = None
) -> tuple[Topology, Calibration]:
    """Read a profile and apply it to a topology.

    Args:
      path: JSON profile file.
      topology: the topology named by ``--mesh``.
      efficiency: fraction of peak for islands the profile does not time (default: the
        cost model's calibrated one).

    Returns:
      (topology with measured links, calibration with measured island speeds).

    Raises:
      ConfigError: missing, unreadable or too long file, bad JSON, unknown key, wrong
        type, a value out of bounds, or an island/pair the topology does not have.
    """
    path = str(path)
    raw = read_text(path, f"--profile '{path}': file", json.load, "JSON")
    return profile_from_dict(raw, topology, source=path, efficiency=efficiency)


def profile_from_dict(
    raw, topology: Topology, source: str = "<profile>", efficiency: float | None = None
) -> tuple[Topology, Calibration]:
    """:func:`load_profile` on already-parsed data."""
    r = TopologyReader(source)
    top = r.mapping(
        raw, "", required=("version", "measured_with"), optional=("topology", "compute", "links")
    )
    if type(top["version"]) is not int or top["version"] != PROFILE_VERSION:
        r.fail("version", top["version"], f"must be {PROFILE_VERSION}")
    if "topology" in top and top["topology"] != topology.name:
        r.fail(
            "topology", top["topology"], f"profile is for another topology than '{topology.name}'"
        )
    shape = r.mapping(
        top["measured_with"],
        "measured_with",
        required=tuple(_SHAPE),
        optional=("act_bytes", "arch", "num_kv_heads", "mlp_size"),
    )
    dims = {k: r.integer(shape[k], f"measured_with.{k}", 1, b) for k, b in _SHAPE.items()}
    # The timed layer's element-wise traffic is subtracted at the precision it ran in
    # (fp32: 4); the cost model adds it back at the planned run's precision.
    act_bytes = r.integer(shape.get("act_bytes", 2), "measured_with.act_bytes", 1, ACT_BYTES)
    names = [isl.name for isl in topology.islands]

    base = Calibration() if efficiency is None else Calibration(efficiency)
    arch = r.string(shape.get("arch", "gpt2"), "measured_with.arch")
    kv = r.integer(shape.get("num_kv_heads", 0), "measured_with.num_kv_heads", 0, HEADS)
    mlp = r.integer(shape.get("mlp_size", 0), "measured_with.mlp_size", 0, MLP)
    try:
        check_choice(arch, "measured_with.arch", ARCHS)
        measured = ModelSpec(
            1,
            dims["hidden_size"],
            dims["num_heads"],
            dims["seq_len"],
            1,
            dims["mlp_ratio"],
            arch=arch,
            num_kv_heads=kv,
            mlp_size=mlp,
        )
    except ConfigError as e:  # heads that do not divide the hidden size
        raise ConfigError(f"{source}: measured_with: {e}") from None
    b, t = dims["microbatch_size"], dims["tensor"]
    flops = layer_fwd_flops(measured, b) / t
    traffic = base.elementwise_passes * layer_activation_bytes(measured, b, t, act_bytes)
    speeds = {}
    compute = top.get("compute", {})
    r.mapping(compute, "compute", optional=tuple(names))
    for name, item in compute.items():
        key = f"compute.{name}"
        m = r.mapping(item, key, required=("layer_fwd_s", "layer_bwd_s"))
        fwd_s = r.number(m["layer_fwd_s"], f"{key}.layer_fwd_s", bound=LAYER_S)
        bwd_s = r.number(m["layer_bwd_s"], f"{key}.layer_bwd_s", bound=LAYER_S)
        mem_bw = topology.islands[names.index(name)].memory_bytes_per_s
        # Net of the element-wise term the cost model adds (1x forward, 2x backward).
        fwd_net = max(fwd_s - traffic / mem_bw, 0.25 * fwd_s)
        bwd_net = max(bwd_s - 2 * traffic / mem_bw, 0.25 * bwd_s)
        speeds[name] = (flops / fwd_net, 2 * flops / bwd_net)

    links = top.get("links", {})
    allowed = (
        (TENSOR, STAGE)
        + tuple(data_key(n, op) for n in (*names, SPANNING) for op in DATA_RING_OPS)
        + tuple(f"{STAGE}:{a}:{c}" for a in names for c in names if a != c)
    )
    r.mapping(links, "links", optional=allowed)
    spanning_keys = {data_key(SPANNING, op): op for op in DATA_RING_OPS}
    new = {
        key: r.link(value, f"links.{key}", extra=("points",) if key in spanning_keys else ())
        for key, value in links.items()
    }
    points = {
        spanning_keys[key]: _points(r, value["points"], f"links.{key}.points")
        for key, value in links.items()
        if key in spanning_keys and "points" in value
    }
    islands = tuple(
        dataclasses.replace(isl, link=new.get(f"{DATA}:{isl.name}", isl.link))
        for isl in topology.islands
    )
    overrides = {(a, c): link for a, c, link in topology.inter_island_overrides}
    data_ops = {  # islands with a ZeRO-1 collective of their own
        n: ops
        for n in names
        if (ops := {o: new[k] for o in DATA_OPS if (k := data_key(n, o)) in new})
    }
    spanning = {op: new[k] for k, op in spanning_keys.items() if k in new}
    for key, link in new.items():
        if key.startswith(f"{STAGE}:"):
            _, a, c = key.split(":")
            overrides[tuple(sorted((a, c)))] = link
    profiled = dataclasses.replace(
        topology,
        islands=islands,
        intra_host=new.get(TENSOR, topology.intra_host),
        inter_island_default=new.get(STAGE, topology.inter_island_default),
        inter_island_overrides=tuple((a, c, link) for (a, c), link in sorted(overrides.items())),
    )
    calibration = dataclasses.replace(
        base,
        island_flops=speeds,
        data_ops=data_ops,
        spanning_ops=spanning,
        spanning_points=points,
    )
    return profiled, calibration


def _points(r: TopologyReader, raw, key: str) -> MeasuredOp:
    """A ``points`` entry: ``{ranks, tensor, bytes: [...], seconds: [...]}``, at least two
    distinct sizes in ascending order, one positive time each."""
    m = r.mapping(raw, key, required=("ranks", "tensor", "bytes", "seconds"))
    ranks = r.integer(m["ranks"], f"{key}.ranks", 2, DEVICES)
    tensor = r.integer(m["tensor"], f"{key}.tensor", 1, DEVICES_PER_HOST)
    sizes, times = m["bytes"], m["seconds"]
    for name, v in (("bytes", sizes), ("seconds", times)):
        if not isinstance(v, list) or len(v) < 2:
            r.fail(f"{key}.{name}", v, "must be a list of at least two numbers")
    if len(times) != len(sizes):
        r.fail(f"{key}.seconds", times, f"must hold one time per size ({len(sizes)})")
    x = [r.number(v, f"{key}.bytes[{i}]", bound=MESSAGE_BYTES) for i, v in enumerate(sizes)]
    y = [r.number(v, f"{key}.seconds[{i}]", bound=LAYER_S) for i, v in enumerate(times)]
    if any(b <= a for a, b in zip(x, x[1:], strict=False)):
        r.fail(f"{key}.bytes", sizes, "must be strictly ascending")
    return MeasuredOp(ranks, tensor, tuple(x), tuple(y))


def data_key(island: str, op: str) -> str:
    """The profile key of ``op`` over an island's data ring (``SPANNING``: every island's):
    ``data:<island>`` for the all-reduce, ``data:<island>:<op>`` for ZeRO-1's two."""
    return f"{DATA}:{island}" if op == "all-reduce" else f"{DATA}:{island}:{op}"


def link_dict(link: Link) -> dict[str, float]:
    """A link as the profile (and topology) files write it."""
    return {"bandwidth_gbps": link.bandwidth_gbps, "latency_us": link.latency_us}
