"""Build the jax ``Mesh`` with axes (stage, data, tensor) from the resolved degrees.

Devices are laid out in the order given (island → host → device once a topology is
named), reshaped to ``[stage, data, tensor]``: tensor groups are runs of adjacent devices,
data groups the next level out, and every stage a contiguous block. Axis types are passed
explicitly (``jax.make_mesh`` would default to Explicit); all axes are Auto so GSPMD
propagates the shardings that the logical rules put on parameters and activations.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from holmes_jax.axes import DATA, MESH_AXES
from holmes_jax.config import MeshShape


def build_mesh(shape: MeshShape, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh of ``shape.num_devices`` devices, axes ``MESH_AXES``.

    Args:
      shape: resolved degrees (see :func:`holmes_jax.config.check_devices`).
      devices: devices in physical order; defaults to ``jax.devices()`` (its first
        ``shape.num_devices``).

    Returns:
      ``Mesh`` of shape (stages, data, tensor) with Auto axis types.
    """
    devices = list(jax.devices() if devices is None else devices)[: shape.num_devices]
    grid = np.array(devices, dtype=object).reshape(shape.stages, shape.data, shape.tensor)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a [batch, seq] token array: rows split over ``data``."""
    return NamedSharding(mesh, PartitionSpec(DATA, None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
