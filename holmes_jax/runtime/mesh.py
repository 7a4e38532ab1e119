"""Build the jax ``Mesh`` with axes (replica, stage, data, tensor) from the degrees and a
topology.

Devices are laid out island → host → device (the topology's order; on one CPU process the
topology assigns simulated devices to "hosts" in index order) and reshaped to ``[replica,
stage, data, tensor]`` (``replica``: one pipeline copy per island or group of islands, data
parallel across them with hierarchical reduction): tensor groups are runs of adjacent
devices inside one host, data groups the next level out inside one island, and every stage
a contiguous block inside one island, so a bigger island simply holds more stages and only
``stage`` crosses island boundaries. An impossible request (a data group spanning two
islands) is a :class:`~holmes_jax.core.errors.ConfigError`, never a silent fallback; the rules
themselves live in :func:`holmes_jax.planner.placement.stage_blocks`, shared with the planner.

Axis types are passed explicitly (``jax.make_mesh`` would default to Explicit); all are
Auto so GSPMD propagates the shardings that the logical rules put on parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from holmes_jax.core.axes import BATCH_AXES, MESH_AXES
from holmes_jax.core.config import Config, check_devices
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import Degrees
from holmes_jax.planner.placement import stage_blocks
from holmes_jax.planner.topology import Topology, load_topology


def load_mesh_topology(cfg: Config) -> Topology | None:
    """The topology named by ``parallel.mesh``, or None."""
    return load_topology(cfg.parallel.mesh) if cfg.parallel.mesh else None


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


def build_mesh(shape: Degrees, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh of ``shape.num_devices`` devices in the given (physical) order.

    Args:
      shape: resolved degrees (see :func:`resolve_shape`).
      devices: devices ordered island → host → device; defaults to ``jax.devices()``
        (its first ``shape.num_devices``).

    Returns:
      ``Mesh`` of shape (replica, stages, data, tensor) with Auto axis types.
    """
    devices = list(jax.devices() if devices is None else devices)[: shape.num_devices]
    grid = np.array(devices, dtype=object).reshape(
        shape.replica, shape.stages, shape.data, shape.tensor
    )
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def device_islands(mesh: Mesh, topology: Topology) -> dict[int, str]:
    """{device id: island name} for the devices of ``mesh`` (position in topology order)."""
    places = topology.device_places()
    flat = list(mesh.devices.flat)
    return {dev.id: places[n].island_name for n, dev in enumerate(flat)}


def describe(cfg: Config, topology: Topology) -> str:
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


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a [batch, seq] token array: rows split over ``replica`` × ``data``."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
