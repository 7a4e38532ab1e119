"""Automatic NIC selection: each host's NCCL environment from its island's NIC type.

The Holmes rule "every data-parallel group lives on one NIC type" needs each GPU process to
open its RDMA devices the way its island's fabric wants. NCCL reads that from environment
variables when the first communicator is created, so they must be set before jax starts;
:func:`host_environment` derives them from the topology (``meshes/*.yaml``):

| island ``nic`` | variables |
|---|---|
| ``infiniband`` | ``NCCL_NET=IB``, ``NCCL_IB_DISABLE=0``, ``NCCL_IB_HCA==<hcas>`` |
| ``roce`` | as infiniband, plus ``NCCL_IB_GID_INDEX=<gid_index>`` (RoCE v2 is usually 3) |
| ``ethernet`` | ``NCCL_NET=Socket``, ``NCCL_IB_DISABLE=1`` |

``NCCL_SOCKET_IFNAME=<interface>`` is set whenever the island names one: the socket
transport of Ethernet-only hosts, and NCCL's bootstrap connections everywhere, use it.
``NCCL_IB_HCA`` uses the ``=`` prefix (exact names: ``mlx5_1`` must not also select
``mlx5_10``). Every profile also carries ``HOLMES_HOST`` and ``HOLMES_ISLAND`` so the
process knows where it sits. Settings already in the environment win over the profile
(:func:`apply`), so a site can always override one variable.

Known gap: XLA opens the NCCL communicators itself, so one environment per process governs
all of them, including the cross-island ones of the ``stage`` ppermute. NCCL can pick a
network per communicator (``ncclConfig_t.netName``) but XLA does not expose it; islands on
RDMA fabrics that cannot reach each other therefore need a route NCCL's IB transport can
use between them (or ``NCCL_IB_DISABLE=1`` on the process side that must fall back).
Pure Python; no jax import.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, MutableMapping

from holmes_jax.core.errors import ConfigError
from holmes_jax.planner.topology import Island, Topology

HOST_VAR = "HOLMES_HOST"  # the topology host this process runs as
ISLAND_VAR = "HOLMES_ISLAND"


def island_environment(island: Island) -> dict[str, str]:
    """The NCCL variables of one island's NIC type (see the module table).

    Args:
      island: an island of a validated topology.

    Returns:
      ``{variable: value}``, insertion-ordered as printed.
    """
    env: dict[str, str] = {}
    if island.nic in ("infiniband", "roce"):
        env["NCCL_NET"] = "IB"
        env["NCCL_IB_DISABLE"] = "0"
        if island.hcas:
            env["NCCL_IB_HCA"] = "=" + ",".join(island.hcas)
        if island.nic == "roce" and island.gid_index is not None:
            env["NCCL_IB_GID_INDEX"] = str(island.gid_index)
    else:  # ethernet: sockets only
        env["NCCL_NET"] = "Socket"
        env["NCCL_IB_DISABLE"] = "1"
    if island.interface:
        env["NCCL_SOCKET_IFNAME"] = island.interface
    return env


def find_host(topology: Topology, host: str) -> Island:
    """The island holding ``host``.

    Raises:
      ConfigError: the topology has no such host.
    """
    for island in topology.islands:
        if host in island.hosts:
            return island
    names = [h for isl in topology.islands for h in isl.hosts]
    raise ConfigError(
        f"--host '{host}': not a host of topology '{topology.name}' (hosts: {', '.join(names)})"
    )


def host_environment(topology: Topology, host: str) -> dict[str, str]:
    """Everything a process on ``host`` needs in its environment before jax starts.

    Args:
      topology: the cluster.
      host: one of its host names.

    Returns:
      ``HOLMES_HOST``, ``HOLMES_ISLAND`` and the island's NCCL variables.

    Raises:
      ConfigError: unknown host.
    """
    island = find_host(topology, host)
    return {HOST_VAR: host, ISLAND_VAR: island.name, **island_environment(island)}


def host_of_process(topology: Topology, process_id: int, num_processes: int) -> str | None:
    """The topology host of a process, when processes map one to one onto hosts.

    Processes are numbered in the topology's host order (island → host), the order the mesh
    builder lays devices out in. With one process per device the host is the device's.

    Returns:
      The host name, or None when the process count matches neither hosts nor devices.
    """
    if num_processes == topology.num_hosts:
        return [h for isl in topology.islands for h in isl.hosts][process_id]
    if num_processes == topology.num_devices:
        return topology.device_places()[process_id].host_name
    return None


def apply(env: Mapping[str, str], environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Set the profile's variables that the environment does not already set.

    Args:
      env: a profile from :func:`host_environment`.
      environ: where to set them (default ``os.environ``).

    Returns:
      The names that were set (the others were left as the site configured them).
    """
    target = os.environ if environ is None else environ
    changed = []
    for key, value in env.items():
        if key not in target:
            target[key] = value
            changed.append(key)
    return changed


def format_exports(env: Mapping[str, str]) -> str:
    """``export KEY=VALUE`` lines a shell can ``eval``."""
    return "\n".join(f"export {key}={shlex.quote(value)}" for key, value in env.items())
