"""The device grid of a run on a topology: its degrees, checked, and its picture.

:func:`resolve_shape` turns a config's requested degrees into the resolved
:class:`~holmes_jax.core.spec.Degrees` on the visible devices, checked against the
topology's placement rules (:func:`holmes_jax.planner.placement.stage_blocks`: tensor
groups inside a host, data groups and stages inside an island); :func:`describe_grid`
prints which island, host and device each stage and data rank lands on (``python -m
holmes_jax.plan --show-mesh``). :func:`holmes_jax.runtime.mesh.build_mesh` then lays the
devices out in that order. Pure Python; no jax import.
"""

from __future__ import annotations

from holmes_jax.core.config import Config, check_devices
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import Degrees
from holmes_jax.planner.placement import stage_blocks
from holmes_jax.planner.topology import Topology, load_topology, without_hosts


def load_mesh_topology(cfg: Config) -> Topology | None:
    """The topology named by ``parallel.mesh`` without ``parallel.exclude_hosts`` (the
    hosts this run has), or None."""
    if not cfg.parallel.mesh:
        return None
    topology = load_topology(cfg.parallel.mesh)
    if cfg.parallel.exclude_hosts:
        topology = without_hosts(topology, cfg.parallel.exclude_hosts, "parallel.exclude_hosts")
    return topology


def resolve_shape(cfg: Config, available: int, topology: Topology | None) -> Degrees:
    """Mesh degrees for ``cfg`` on ``available`` devices, checked against the topology.

    Raises:
      ConfigError: too few devices for the topology, or degrees that break placement.
    """
    if topology is not None:
        if topology.num_devices > available:
            raise ConfigError(
                f"parallel.mesh='{cfg.parallel.mesh}': topology '{topology.name}' has "
                f"{topology.num_devices} devices but only {available} are visible"
            )
        if cfg.parallel.devices and cfg.parallel.devices != topology.num_devices:
            raise ConfigError(
                f"parallel.devices={cfg.parallel.devices}: must equal the "
                f"{topology.num_devices} devices of topology '{topology.name}' (or 0)"
            )
        available = topology.num_devices
    shape = check_devices(cfg, available)
    if topology is not None and cfg.parallel.enforce_islands:
        layout = cfg.parallel.layout(shape)
        stage_blocks(topology, layout)  # raises ConfigError when placement is impossible
    return shape


def describe_grid(cfg: Config, topology: Topology) -> str:
    """The device grid: each stage's island and, per data rank, the devices and hosts."""
    shape = resolve_shape(cfg, topology.num_devices, topology)
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
