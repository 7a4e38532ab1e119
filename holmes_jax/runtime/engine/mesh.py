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
themselves live in :func:`holmes_jax.planner.placement.stage_blocks`, shared with the planner,
and the degrees are resolved and checked by :func:`holmes_jax.planner.grid.resolve_shape`.

Axis types are passed explicitly (``jax.make_mesh`` would default to Explicit); all are
Auto so GSPMD propagates the shardings that the logical rules put on parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from holmes_jax.core.axes import BATCH_AXES, MESH_AXES
from holmes_jax.core.spec import Degrees
from holmes_jax.planner.plans import platform_blocks
from holmes_jax.planner.topology import Topology


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


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a [batch, seq] token array: rows split over ``replica`` × ``data``."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, None))


def collectives_block(devices: Sequence[jax.Device]) -> bool:
    """Whether collectives on these devices block them until done (the CPU runtimes, gloo
    across processes): the planner then prices them that way (``sync_collectives``) and
    ``parallel.grad_buckets: auto`` reduces once per step."""
    return platform_blocks(devices[0].platform)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
