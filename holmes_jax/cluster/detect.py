"""Who joins a multi-process run, and how: explicit settings or a detected cluster.

:func:`resolve` decides, in this order:

1. **Explicit settings**: ``distributed.coordinator_address`` / ``num_processes`` /
   ``process_id`` (CLI ``--coordinator``, ``--num-processes``, ``--process-id``).
   ``JAX_COORDINATOR_ADDRESS`` counts as a coordinator. Missing pieces are auto-detected.
2. **Auto-detection**, through ``jax.distributed.initialize``'s cluster detection:

   - SLURM (``srun``): id ``SLURM_PROCID``, count ``SLURM_NTASKS``;
   - Open MPI (``mpirun``): id ``OMPI_COMM_WORLD_RANK``, count ``OMPI_COMM_WORLD_SIZE``;
   - Kubernetes Indexed Job: id ``JOB_COMPLETION_INDEX``, count the Job's parallelism
     (needs the ``kubernetes`` package).

   The variables that detect each, and where the coordinator is: docs/multihost.md,
   "Starting a process of a multi-process run". ``JAX_COORDINATOR_PORT`` overrides the
   derived port. With one task per node every local device stays visible.
3. Otherwise a single process: nothing is initialised.

Processes are numbered in the topology's host order (island → host). Process ``i`` holds
host ``i``'s devices, the order the mesh builder expects.
:func:`holmes_jax.cluster.distributed.start` joins with what :func:`resolve` decides.
No jax import.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from holmes_jax.core.errors import ConfigError

if TYPE_CHECKING:
    from holmes_jax.core.config import Config


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--coordinator``, ``--num-processes`` and ``--process-id`` to an argparse parser
    (every entry point that can run as one of several processes has them)."""
    parser.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="process 0's address; sets distributed.coordinator_address",
    )
    parser.add_argument(
        "--num-processes", type=int, help="processes in the job; sets distributed.num_processes"
    )
    parser.add_argument(
        "--process-id", type=int, help="this process, 0-based; sets distributed.process_id"
    )


def apply_flags(cfg: Config, args: argparse.Namespace) -> Config:
    """The config with :func:`add_flags`' values over ``distributed.*`` (unset: unchanged).

    Set directly rather than through ``--set`` so an address is never read as YAML.

    Raises:
      ConfigError: an impossible combination (e.g. a process id >= the process count).
    """
    flags = {
        "coordinator_address": args.coordinator,
        "num_processes": args.num_processes,
        "process_id": args.process_id,
    }
    flags = {key: value for key, value in flags.items() if value is not None}
    if not flags:
        return cfg
    cfg = cfg.replace(distributed=replace(cfg.distributed, **flags))
    cfg.distributed.validate()
    return cfg


@dataclass(frozen=True)
class Settings:
    """What to pass to ``jax.distributed.initialize`` (None = let jax detect it)."""

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    source: str  # "explicit" | "slurm" | "ompi" | "k8s"
    local_device_ids: list[int] | None = None  # [] = every local device visible
    detect: bool = True  # run jax's cluster detection for the unset values


def detect_cluster(environ: Mapping[str, str] | None = None) -> str | None:
    """The cluster manager that launched this process: slurm, ompi, k8s or None.

    Uses the same environment markers as jax's own detection (see the module table).
    """
    env = os.environ if environ is None else environ
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID")
    if all(k in env for k in slurm + ("SLURM_LOCALID",)):
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env:
        return "ompi"
    if "KUBERNETES_SERVICE_HOST" in env and "JOB_COMPLETION_INDEX" in env:
        try:
            import kubernetes  # noqa: F401  (jax's detection needs it)
        except ImportError:
            return None
        return "k8s"
    return None


def _one_task_per_node(cluster: str, env: Mapping[str, str]) -> bool:
    if cluster == "slurm":
        # e.g. "1(x4)" or "1,1,1": every node runs one task
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", ""))
        counts = re.findall(r"(\d+)(?:\(x\d+\))?", per_node)
        return bool(counts) and all(c == "1" for c in counts)
    if cluster == "ompi":
        return env.get("OMPI_COMM_WORLD_LOCAL_SIZE") == "1"
    return False


def _env_int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ConfigError(f"{key}={env[key]!r}: expected an integer") from None


def resolve(cfg: Config, environ: Mapping[str, str] | None = None) -> Settings | None:
    """Decide whether this process is one of several, and how it joins.

    Args:
      cfg: a :class:`holmes_jax.core.config.Config`.
      environ: the environment (default ``os.environ``).

    Returns:
      :class:`Settings`, or None for a single-process run.

    Raises:
      ConfigError: explicit settings that are incomplete with no cluster to fill them in.
    """
    env = os.environ if environ is None else environ
    d = cfg.distributed
    if d.num_processes == 1:
        return None
    cluster = detect_cluster(env)
    coordinator = d.coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
    count = d.num_processes or None
    pid = d.process_id if d.process_id >= 0 else None
    if cluster == "slurm":
        count = count or _env_int(env, "SLURM_NTASKS")
        pid = _env_int(env, "SLURM_PROCID") if pid is None else pid
    elif cluster == "ompi":
        count = count or _env_int(env, "OMPI_COMM_WORLD_SIZE")
        pid = _env_int(env, "OMPI_COMM_WORLD_RANK") if pid is None else pid
    elif cluster == "k8s":
        pid = _env_int(env, "JOB_COMPLETION_INDEX") if pid is None else pid

    explicit = bool(d.coordinator_address or d.num_processes or d.process_id >= 0)
    if explicit or (coordinator and cluster is None):
        missing = [
            key
            for key, value in (
                ("distributed.coordinator_address (--coordinator)", coordinator),
                ("distributed.num_processes (--num-processes)", count),
                ("distributed.process_id (--process-id)", pid),
            )
            if value is None
        ]
        if missing and cluster is None:
            raise ConfigError(
                f"{missing[0]}=None: needed for a multi-process run when no cluster "
                f"(SLURM, Open MPI, Kubernetes) is detected"
            )
        if count == 1:
            return None
        if count is not None and pid is not None and not 0 <= pid < count:
            raise ConfigError(
                f"distributed.process_id={pid}: must be in [0, num_processes={count})"
            )
        complete = not missing
        return Settings(
            coordinator,
            count,
            pid,
            "explicit",
            local_device_ids=[] if cluster and _one_task_per_node(cluster, env) else None,
            detect=not complete,
        )
    if cluster is None or count == 1:
        return None
    local = [] if _one_task_per_node(cluster, env) else None
    return Settings(coordinator, count, pid, cluster, local_device_ids=local)


# --------------------------------------------------------------------------- joining
