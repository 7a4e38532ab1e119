"""The device grid of a run on a topology: its degrees, checked, and its picture.

:func:`resolve_shape` turns a run's requested degrees into the resolved
:class:`~holmes_jax.core.spec.Degrees` on the visible devices, checked against the
topology's placement rules (:func:`holmes_jax.planner.placement.stage_blocks`: tensor
groups inside a host, data groups and stages inside an island); :func:`describe_grid`
prints which island, host and device each stage and data rank lands on (``python -m
holmes_jax.plan --show-mesh``). :func:`holmes_jax.runtime.engine.mesh.build_mesh` then lays the
devices out in that order. Pure Python; no jax import.
"""

from __future__ import annotations

import dataclasses

from holmes_jax.core.errors import ConfigError
from holmes_jax.core.plan_request import PlanRequest
from holmes_jax.core.spec import Degrees
from holmes_jax.planner.placement import stage_blocks
from holmes_jax.planner.topology import Topology, load_topology, without_hosts


def load_mesh_topology(req: PlanRequest) -> Topology | None:
    """The topology named by ``parallel.mesh`` without ``parallel.exclude_hosts`` (the
    hosts this run has), or None. An independent DiLoCo island's job
    (``diloco.mode=independent``) has only its island (:func:`job_topology`)."""
    par = req.parallel
    if not par.mesh:
        return None
    topology = job_topology(req)
    if par.exclude_hosts:
        topology = without_hosts(topology, par.exclude_hosts, "parallel.exclude_hosts")
    return topology


def job_topology(req: PlanRequest) -> Topology:
    """The hosts of this job before failures: ``parallel.mesh``'s whole topology, or under
    ``diloco.mode=independent`` only island ``diloco.island``.

    Raises:
      ConfigError: ``diloco.peers`` does not name one address per island of the mesh.
    """
    mesh, d = req.parallel.mesh, req.diloco
    topology = load_topology(mesh)
    if d.mode != "independent":
        return topology
    if len(d.peers) != len(topology.islands):
        raise ConfigError(
            f"diloco.peers={list(d.peers)}: needs one address per island of "
            f"parallel.mesh='{mesh}' ({len(topology.islands)} islands)"
        )
    others = [h for i, isl in enumerate(topology.islands) if i != d.island for h in isl.hosts]
    island = without_hosts(topology, others, "diloco.island")
    name = f"{topology.name}, island {topology.islands[d.island].name}"
    return dataclasses.replace(island, name=name)


def island_batch_rows(req: PlanRequest) -> list[int]:
    """Independent DiLoCo: the rows of ``train.global_batch_size`` each island trains on,
    by island index. In proportion to an island's compute (devices x ``peak_tflops``) on
    ``parallel.mesh``, else equal; in whole units of ``parallel.data`` x ``microbatches``
    rows (what one island's step splits evenly), rounded by largest remainder so they sum
    to the batch.

    Raises:
      ConfigError: an island would get no unit.
    """
    batch, n, p = req.run.global_batch_size, len(req.diloco.peers), req.parallel
    unit = max(p.data, 1) * p.microbatches
    weights = [1.0] * n
    if p.mesh:
        islands = load_topology(p.mesh).islands
        weights = [isl.num_devices * isl.peak_tflops for isl in islands]
    exact = [batch // unit * w / sum(weights) for w in weights]
    units = [int(x) for x in exact]
    by_remainder = sorted(range(n), key=lambda i: (units[i] - exact[i], i))
    for i in by_remainder[: batch // unit - sum(units)]:
        units[i] += 1
    if min(units) < 1 or batch % unit:
        raise ConfigError(
            f"train.global_batch_size={batch}: too small to give each of {n} independent "
            f"islands whole units of parallel.data*microbatches = {unit} rows (units "
            f"{units}, in proportion to each island's compute)"
        )
    return [u * unit for u in units]


def resolve_shape(req: PlanRequest, available: int, topology: Topology | None) -> Degrees:
    """Mesh degrees for ``req`` on ``available`` devices, checked against the topology.

    Raises:
      ConfigError: too few devices for the topology, or degrees that break placement.
    """
    par = req.parallel
    if topology is not None:
        if topology.num_devices > available:
            raise ConfigError(
                f"parallel.mesh='{par.mesh}': topology '{topology.name}' has "
                f"{topology.num_devices} devices but only {available} are visible"
            )
        if par.devices and par.devices != topology.num_devices:
            raise ConfigError(
                f"parallel.devices={par.devices}: must equal the "
                f"{topology.num_devices} devices of topology '{topology.name}' (or 0)"
            )
        available = topology.num_devices
    shape = req.degrees(available)
    if topology is not None and par.enforce_islands:
        layout = par.layout(shape)
        stage_blocks(topology, layout)  # raises ConfigError when placement is impossible
    return shape


def describe_grid(req: PlanRequest, topology: Topology) -> str:
    """The device grid: each stage's island and, per data rank, the devices and hosts."""
    shape = resolve_shape(req, topology.num_devices, topology)
    places = topology.device_places()
    k = shape.data * shape.tensor
    lines = [
        f"mesh replica={shape.replica} x stage={shape.stages} x data={shape.data} x "
        f"tensor={shape.tensor} on topology '{topology.name}' ({topology.num_devices} devices)"
    ]
    for n in range(shape.replica * shape.stages):
        block = places[n * k : (n + 1) * k]
        r, s = divmod(n, shape.stages)
        where = f"replica {r} " if shape.replica > 1 else ""
        lines.append(
            f"{where}stage {s}  island {block[0].island_name} "
            f"({topology.islands[block[0].island].nic})"
        )
        for d in range(shape.data):
            row = block[d * shape.tensor : (d + 1) * shape.tensor]
            cells = ", ".join(f"dev {p.index}@{p.host_name}" for p in row)
            lines.append(f"  data {d}: tensor [{cells}]")
    return "\n".join(lines)
