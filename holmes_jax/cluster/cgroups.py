"""Islands that compute at different speeds on one machine: a CPU quota per emulated host.

Every emulated host shares this machine's cores, so they all compute at one speed. With the
cgroup v1 ``cpu`` controller (CFS bandwidth), each host's process gets a group
``/sys/fs/cgroup/cpu/hj<tag>-<host>`` whose quota is its share of the cores::

    share(host) = cores / hosts * peak_tflops(island) / max(peak_tflops)   (in cores)
    cpu.cfs_period_us = 10000,  cpu.cfs_quota_us = max(1000, round(share * 10000))

``cores`` is this process's CPU affinity. The worker enters its group before it execs
(:meth:`CpuQuota.prefix`), with ``HOLMES_JAX_CPU_QUOTA`` set to its share: the probe reads it
(:func:`own_share`).

A quota slows a steady computation exactly. It is not a slower chip for one that waits
between bursts, as a pipeline stage does (:func:`shares`; ``scripts/bench_emulation.py``
measures it).

``--cpu-quota``: ``auto`` (the default) applies quotas when the islands' ``peak_tflops``
differ; ``on`` applies them always; ``off`` never (:func:`plan_quotas`). Without the
controller ``auto`` warns and goes on without quotas, and ``on`` is an error
(:func:`resolve`). When the workers end, ``launch`` prints each group's throttling
(:class:`Throttling`). Groups are removed on teardown (:class:`CpuGroups`), and by
:func:`remove_stale` when a launcher was killed. Plain Python.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from holmes_jax.core.errors import ConfigError
from holmes_jax.planner.topology import Topology

CPU_ROOT = "/sys/fs/cgroup/cpu"
# 10 ms keeps the throttling smooth on a step of tens of ms; shorter periods cost more than
# they smooth (the probe timed layers and pipeline steps slower at 2 and 4 ms).
PERIOD_US = 10_000
MIN_QUOTA_US = 1_000  # the kernel's floor is 1000 µs
MODES = ("auto", "on", "off")
QUOTA_ENV = "HOLMES_JAX_CPU_QUOTA"  # a quota'd worker's share in cores
_STALE = re.compile(r"^hj(\d+)-")


@dataclass(frozen=True)
class CpuQuota:
    """One host's CPU group: its path, share in cores and the values written."""

    host: str
    group: str  # directory under the cpu controller
    share: float  # cores
    quota_us: int
    period_us: int = PERIOD_US

    def files(self) -> list[tuple[str, str]]:
        """(path, value) to write, in order (period first: the quota is checked against it)."""
        return [
            (os.path.join(self.group, "cpu.cfs_period_us"), str(self.period_us)),
            (os.path.join(self.group, "cpu.cfs_quota_us"), str(self.quota_us)),
        ]

    def prefix(self) -> list[str]:
        """Prepend to a command: it moves itself into the group, then execs the command
        with :data:`QUOTA_ENV` set to its share (``ip netns exec`` remounts ``/sys``, so
        inside a namespace the group's files cannot be read). Entering before the exec
        counts jax and every thread it starts."""
        procs = os.path.join(self.group, "cgroup.procs")
        enter = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', procs]
        return [*enter, "env", f"{QUOTA_ENV}={self.share:g}"]


def shares(topology: Topology, cores: float) -> dict[str, float]:
    """Cores per host: ``cores / hosts * peak_tflops / max(peak_tflops)`` (pure).

    The fastest island's hosts get a fair share of the machine: no more, or they would run
    ahead while the others wait. An island with half the ``peak_tflops`` computes at half
    that. The quota is refilled each period, and a group that idled wakes with all of it, so
    a burst of ``c`` seconds of CPU takes between ``c / share - 2 (1 - share) period`` and
    ``c / share`` of wall time, depending on where in its period the host wakes.
    """
    hosts = sum(i.num_hosts for i in topology.islands)
    fastest = max(i.peak_tflops for i in topology.islands)
    return {
        h: cores / hosts * isl.peak_tflops / fastest for isl in topology.islands for h in isl.hosts
    }


def plan_quotas(
    topology: Topology, tag: str, mode: str, cores: float, root: str = CPU_ROOT
) -> list[CpuQuota]:
    """The groups ``mode`` asks for (pure; [] for ``off``, or ``auto`` with equal islands).
    ``on`` gives a uniform topology a fair share per host.

    Raises:
      ConfigError: an unknown mode.
    """
    if mode not in MODES:
        raise ConfigError(f"--cpu-quota={mode}: must be one of {', '.join(MODES)}")
    peaks = {i.peak_tflops for i in topology.islands}
    if mode == "off" or (mode == "auto" and len(peaks) == 1):
        return []
    return [
        CpuQuota(h, os.path.join(root, f"hj{tag}-{h}"), s, max(MIN_QUOTA_US, round(s * PERIOD_US)))
        for h, s in shares(topology, cores).items()
    ]


def own_share(proc: str = "/proc/self/cgroup", root: str = CPU_ROOT) -> float | None:
    """This process's CPU quota in cores: :data:`QUOTA_ENV` where the launcher set it, else
    its cgroup v1 ``cpu`` group's ``cfs_quota_us / cfs_period_us``; None where it has none
    (no controller, no group, or an unlimited quota)."""
    if os.environ.get(QUOTA_ENV):
        return float(os.environ[QUOTA_ENV])
    try:
        with open(proc) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and "cpu" in parts[1].split(","):
            group = os.path.join(root, parts[2].lstrip("/"))
            try:
                with open(os.path.join(group, "cpu.cfs_quota_us")) as f:
                    quota = int(f.read())
                with open(os.path.join(group, "cpu.cfs_period_us")) as f:
                    period = int(f.read())
            except (OSError, ValueError):
                return None
            return quota / period if quota > 0 and period > 0 else None
    return None


def available(root: str = CPU_ROOT) -> bool:
    """Whether the cgroup v1 ``cpu`` controller with CFS bandwidth is mounted at ``root``."""
    return os.path.exists(os.path.join(root, "cpu.cfs_quota_us"))


def resolve(mode: str, root: str = CPU_ROOT, warn: Callable[[str], None] = print) -> str:
    """``mode`` as it can run here: ``auto`` without the controller (e.g. on a cgroup
    v2-only machine) warns and becomes ``off``.

    Raises:
      ConfigError: ``on`` without the controller.
    """
    if mode == "off" or available(root):
        return mode
    if mode == "on":
        raise ConfigError(
            f"--cpu-quota=on: no cgroup v1 cpu controller at {root} (use --cpu-quota off)"
        )
    warn(f"launch: warning: no cgroup v1 cpu controller at {root}; islands compute at one speed")
    return "off"


@dataclass(frozen=True)
class Throttling:
    """A group's CFS bandwidth record (``cpu.stat``): the periods in which it ran, those
    that ended with it throttled (its quota spent, work left), and the time it waited."""

    periods: int
    throttled: int
    throttled_s: float

    def __str__(self) -> str:
        share = self.throttled / self.periods if self.periods else 0.0
        return f"{share:.0%} of {self.periods} periods ({self.throttled_s:.1f} s)"


def format_throttling(stats: dict[str, Throttling]) -> str:
    """One line: each host's throttling (``launch`` prints it when the workers end)."""
    return "CPU quota throttled " + ", ".join(f"{h} {t}" for h, t in stats.items())


class CpuGroups:
    """Creates the groups of a plan and removes them again (context manager, idempotent)."""

    def __init__(self, quotas: list[CpuQuota], rmdir: Callable[[str], None] = os.rmdir):
        self.quotas = {q.host: q for q in quotas}
        self._rmdir = rmdir

    def __enter__(self) -> CpuGroups:
        try:
            for q in self.quotas.values():
                os.makedirs(q.group, exist_ok=True)
                for path, value in q.files():
                    with open(path, "w") as f:
                        f.write(value)
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def destroy(self) -> None:
        """Remove every group (their processes have ended); ignores what is gone."""
        for q in self.quotas.values():
            _remove(q.group, self._rmdir)

    def throttling(self) -> dict[str, Throttling]:
        """Each group's ``cpu.stat`` so far, by host; hosts whose file cannot be read are
        left out."""
        out = {}
        for host, q in self.quotas.items():
            try:
                with open(os.path.join(q.group, "cpu.stat")) as f:
                    stat = dict(line.split() for line in f if line.strip())
                out[host] = Throttling(
                    int(stat["nr_periods"]),
                    int(stat["nr_throttled"]),
                    int(stat["throttled_time"]) / 1e9,
                )
            except (OSError, KeyError, ValueError):
                pass
        return out

    def wrap(self, prefix: Callable[[str], list[str]] | None) -> Callable[[str], list[str]]:
        """``prefix`` (host -> command prefix) with each quota'd host entering its group first."""

        def wrapped(host: str) -> list[str]:
            inner = prefix(host) if prefix else []
            q = self.quotas.get(host)
            return (q.prefix() if q else []) + inner

        return wrapped


def _remove(group: str, rmdir: Callable[[str], None]) -> None:
    try:
        rmdir(group)
    except FileNotFoundError:
        pass
    except OSError:  # still has processes: end them (they are ours), then retry for 2 s
        for pid in _tasks(group):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for _ in range(40):
            time.sleep(0.05)
            try:
                rmdir(group)
                return
            except FileNotFoundError:
                return
            except OSError:
                pass


def _tasks(group: str) -> list[int]:
    try:
        with open(os.path.join(group, "cgroup.procs")) as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def remove_stale(root: str = CPU_ROOT, alive: Callable[[int], bool] | None = None) -> list[str]:
    """Remove ``hj<pid>-*`` groups whose launcher (``pid``) is gone; returns their names."""
    from holmes_jax.cluster.netns import _alive

    alive = alive or _alive
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    removed = []
    for name in names:
        m = _STALE.match(name)
        path = os.path.join(root, name)
        if m and os.path.isdir(path) and not alive(int(m.group(1))):
            _remove(path, os.rmdir)
            if not os.path.exists(path):
                removed.append(name)
    return removed
