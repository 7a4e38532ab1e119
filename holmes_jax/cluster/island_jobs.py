"""``launch --independent-islands``: one supervised job per island (independent DiLoCo).

Each island of the topology becomes its own job (:class:`Job`): its hosts only, its own
coordinator, its own :class:`~holmes_jax.cluster.supervisor.Supervisor` (restarts, the
``--fail-host`` faults on its hosts), and the train arguments that make it one island of
``diloco.mode=independent``: ``diloco.enabled=true``, ``diloco.island=<index>`` and
``diloco.peers``, every island's outer-sync lane addresses (:func:`lane_count` lanes per
island, split evenly over its hosts; from port :data:`OUTER_SYNC_PORT` on each host when
emulated, free local ports otherwise), and ``diloco.sync_key_file``, a key made for the
launch (:func:`run_key`) unless the train arguments name one. The jobs share
nothing else: one island's failure, restart or loss stops no other.

The launch's exit code: 0 when every job ended with 0 or lost every host for good (its
peers trained on without it, and at least one job finished); otherwise the first
non-zero code of a job, in island order.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from holmes_jax.core.errors import ConfigError
from holmes_jax.planner.topology import Topology, without_hosts

OUTER_SYNC_PORT = 29600  # emulated: free in each host's fresh namespace


@dataclass(frozen=True)
class Job:
    """One island's job: its hosts, the train arguments it adds, its faults."""

    topology: Topology
    args: tuple[str, ...]
    faults: Sequence = ()
    name: str = ""


@contextlib.contextmanager
def run_key(train_args: Sequence[str]):
    """A fresh key for the launch's islands, in a private temporary directory removed at
    the end (yields its path); None when ``train_args`` set ``diloco.sync_key_file``."""
    if any("diloco.sync_key_file=" in a for a in train_args):
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="holmes_jax-sync-") as folder:
        path = os.path.join(folder, "sync.key")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        yield path


class IslandGone(Exception):
    """Every host of an island's job is away for good."""


def lane_count(topology: Topology) -> int:
    """The outer sync's lanes: the least count every island's hosts split evenly (each
    host serves the same number of its island's lanes)."""
    return math.lcm(*(len(island.hosts) for island in topology.islands))


def plan_jobs(
    topology: Topology,
    faults: Sequence,
    address: Callable[[str, int], str],
    key_file: str | None = None,
) -> list[Job]:
    """One :class:`Job` per island (pure: nothing starts). ``address(host, k)``: the
    ``host:port`` of the ``k``-th lane that ``host`` serves. Faults go to the job of their
    host. ``key_file``: every job's ``diloco.sync_key_file``."""
    lanes = lane_count(topology)
    peers = [
        ",".join(
            address(host, k) for host in island.hosts for k in range(lanes // len(island.hosts))
        )
        for island in topology.islands
    ]
    jobs = []
    for index, island in enumerate(topology.islands):
        others = [h for isl in topology.islands if isl is not island for h in isl.hosts]
        args = (
            "--set", "diloco.enabled=true",
            "--set", "diloco.mode=independent",
            "--set", f"diloco.island={index}",
            "--set", f"diloco.peers=[{','.join(repr(p) for p in peers)}]",
        )  # fmt: skip
        if key_file is not None:
            args += ("--set", f"diloco.sync_key_file={key_file}")
        mine = [f for f in faults if f.host in island.hosts]
        jobs.append(Job(without_hosts(topology, others), args, mine, island.name))
    return jobs


def survivors(job: Job, excluded: Sequence[str]) -> Topology:
    """``job``'s hosts without ``excluded``.

    Raises:
      IslandGone: no host of the job is left.
    """
    hosts = [h for isl in job.topology.islands for h in isl.hosts]
    if set(hosts) <= set(excluded):
        raise IslandGone(job.name)
    try:
        return without_hosts(job.topology, excluded)
    except ConfigError as err:  # an excluded host of another island: not this job's
        raise IslandGone(job.name) from err


def run_all(runs: list[tuple[str, object]], out=None) -> int:
    """Run every island's supervisor at once, each in its own thread; the exit code is
    the module doc's."""
    codes: dict[str, int | None] = {}
    say = lambda line: print(f"launch: {line}", file=out or sys.stdout, flush=True)  # noqa: E731

    def one(name: str, supervisor) -> None:
        try:
            codes[name] = supervisor.run()
        except IslandGone:
            codes[name] = None
            say(f"island {name}: every host is away for good; the other islands train on")
        except Exception as err:  # noqa: BLE001 (a thread's error must reach the exit code)
            codes[name] = 1
            say(f"island {name}: the supervisor failed: {err}")

    names = ", ".join(name for name, _ in runs)
    say(f"independent islands: one job per island ({names}), each supervised on its own")
    threads = [threading.Thread(target=one, args=run, daemon=True) for run in runs]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(timeout=0.2)  # the main thread stays free for signals
    finished = [n for n, c in codes.items() if c == 0]
    failed = [c for _, c in sorted(codes.items(), key=lambda kv: _order(runs, kv[0])) if c]
    if failed:
        return failed[0]
    return 0 if finished else 1


def _order(runs, name: str) -> int:
    return [n for n, _ in runs].index(name)
