"""The work of ``python -m holmes_jax.launch``: one process per host of a topology, on this
machine, supervised.

:func:`launch` checks the arguments, then runs the topology as one job, or with
``independent`` as one job per island (:mod:`holmes_jax.cluster.island_jobs`), each under
its own :class:`~holmes_jax.cluster.supervisor.Supervisor` (restarts, faults). With
``emulate`` every host runs in its own network namespace, shaped to the topology's links
(:mod:`holmes_jax.cluster.netns`), with a CPU quota from its island's speed
(:mod:`holmes_jax.cluster.cgroups`) and, with ``cut_islands``, links cut between islands
for a while (:mod:`holmes_jax.cluster.linkcut`). SIGINT and SIGTERM reach every job's
supervisor.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from holmes_jax.cluster import island_jobs, linkcut
from holmes_jax.cluster.launcher import (
    DEFAULT_GRACE_S,
    EMULATED_PORT,
    Launch,
    Worker,
    _Stop,
    describe,
    free_port,
    plan_workers,
)
from holmes_jax.cluster.supervisor import (
    DEFAULT_REJOIN_S,
    Supervisor,
    fault_args,
    parse_fault,
)
from holmes_jax.cluster.warm import Measured
from holmes_jax.core.errors import ConfigError
from holmes_jax.planner.failures import failure_cases
from holmes_jax.planner.topology import Topology, load_topology

if TYPE_CHECKING:
    from holmes_jax.cluster.netns import Unreachable


def launch(
    mesh_path: str,
    train_args: Sequence[str],
    *,
    emulate: bool = False,
    scale: float = 1.0,
    grace_s: float = DEFAULT_GRACE_S,
    out=None,
    env: dict[str, str] | None = None,
    program: str = "train",
    verbose: bool = False,
    max_restarts: int = 0,
    fail_hosts: Sequence[str] = (),
    rejoin_timeout_s: float = DEFAULT_REJOIN_S,
    cpu_quota: str = "auto",
    latency: bool = True,
    independent: bool = False,
    cut_islands: str | None = None,
    warm_failures: bool = False,
) -> int:
    """Run one process per host of the topology on this machine (see the module doc).

    Args:
      mesh_path: topology file.
      train_args: arguments for ``holmes_jax.train``.
      emulate: run each host in its own shaped network namespace (root only).
      scale: multiplies every emulated rate.
      grace_s: time the others get after the first failure.
      out: where the prefixed output goes (default stdout).
      env: base environment of the processes (default ``os.environ``).
      program: ``train`` (default) or ``probe`` (:data:`~holmes_jax.cluster.launcher.PROGRAMS`).
      verbose: show library chatter (:func:`~holmes_jax.cluster.launcher.quiet`) too.
      max_restarts: restarts after failures (:class:`~holmes_jax.cluster.supervisor.Supervisor`);
        0 runs the job once.
      fail_hosts: ``--fail-host`` specs (:func:`~holmes_jax.cluster.supervisor.parse_fault`).
      rejoin_timeout_s: how long a restart waits for an away host before the others go on
        without it (:class:`~holmes_jax.cluster.supervisor.Supervisor`).
      cpu_quota: with ``emulate``, a CPU quota per host from its island's ``peak_tflops``:
        ``auto``, ``on`` or ``off`` (:mod:`holmes_jax.cluster.cgroups`).
      latency: with ``emulate``, delay packets between islands by the topology's latency.
      independent: one job per island, each supervised on its own, as independent DiLoCo
        islands (:mod:`holmes_jax.cluster.island_jobs`).
      cut_islands: with ``emulate``, ``STEP:+SECONDS``: cut the links between islands
        (:mod:`holmes_jax.cluster.linkcut`).
      warm_failures: before training, compile the survivors' programs of every failure
        into the compilation cache (:meth:`_Jobs.warm`).

    Returns:
      The exit code of the last attempt (see :meth:`~holmes_jax.cluster.launcher.Launch.run`);
      130 when stopped before anything started.

    Raises:
      ConfigError: bad topology, arguments, fault specs, or ``--emulate`` without root.
    """
    topology = load_topology(mesh_path)
    hosts = [h for isl in topology.islands for h in isl.hosts]
    faults = [parse_fault(spec, hosts) for spec in fail_hosts]
    cut = linkcut.parse_cut(cut_islands) if cut_islands is not None else None
    _check(topology, cut_islands, emulate, max_restarts, rejoin_timeout_s, independent, program)
    if warm_failures and (independent or program != "train"):
        why = "--independent-islands" if independent else f"--program={program}"
        raise ConfigError(
            f"--warm-failures: not with {why} (it compiles the survivors of one training job)"
        )
    plan_workers(topology, mesh_path, train_args, "127.0.0.1:1", base_env={}, program=program)
    say = lambda line: print(f"launch: {line}", file=out or sys.stdout, flush=True)  # noqa: E731
    jobs = _Jobs(
        topology, mesh_path, train_args, faults, dict(os.environ if env is None else env),
        program, say,
        dict(max_restarts=max_restarts, grace_s=grace_s, out=out, verbose=verbose,
             rejoin_timeout_s=rejoin_timeout_s),
    )  # fmt: skip
    jobs.warm_failures = warm_failures
    try:
        with _signals_to(jobs.supervisors):
            if not emulate:
                local = lambda hosts: f"127.0.0.1:{free_port()}"  # noqa: E731
                return jobs.run(local, lambda host, k: f"127.0.0.1:{free_port()}", independent)
            return _emulated(jobs, topology, scale, latency, cpu_quota, cut, independent, say)
    except _Stop:
        return 130


def _check(topology, cut_islands, emulate, max_restarts, rejoin_timeout_s, independent, program):
    """The launch's arguments against each other and the topology (ConfigError)."""
    if cut_islands is not None and not emulate:
        raise ConfigError(
            f"--cut-islands={cut_islands}: only with --emulate (the cut is a rule in the "
            "emulated router)"
        )
    if cut_islands is not None and len(topology.islands) < 2:
        raise ConfigError(f"--cut-islands={cut_islands}: topology '{topology.name}' has one island")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts={max_restarts}: must be >= 0 (0 = no restarts)")
    if not rejoin_timeout_s >= 0 or math.isinf(rejoin_timeout_s):
        raise ConfigError(
            f"--rejoin-timeout={rejoin_timeout_s:g}: must be a number of seconds >= 0"
        )
    if independent and program != "train":
        raise ConfigError(f"--independent-islands: runs holmes_jax.train, not --program={program}")
    if independent and len(topology.islands) < 2:
        raise ConfigError(
            f"--independent-islands: topology '{topology.name}' has one island; independent "
            "DiLoCo islands need at least 2"
        )


class _Jobs:
    """The launch's jobs: the whole topology, or one per island, each supervised."""

    def __init__(self, topology, mesh_path, train_args, faults, base_env, program, say, opts):
        self.topology, self.mesh_path, self.train_args = topology, mesh_path, train_args
        self.faults, self.base_env, self.program, self.say = faults, base_env, program, say
        self.opts = opts  # Supervisor's keyword arguments
        self.warm_failures = False  # --warm-failures
        self.measured = Measured(topology)  # what --warm-failures measured
        self.supervisors: list[Supervisor] = []
        self.on_step: Callable | None = None  # --cut-islands' cutter, once the network is up
        # emulated: hosts -> None when they reach each other, else which pair does not
        self.unreachable: Callable[[list[str]], Unreachable | None] | None = None

    def run(self, coordinator, peer_address, independent: bool, prefix=None) -> int:
        """Run the job(s) to the end; the exit code (independent: the worst island's).

        Args:
          coordinator: ``Topology -> "host:port"`` of a job's process 0.
          peer_address: ``(host, k) -> "host:port"`` of the host's k-th outer-sync lane.
          prefix: the command prefix that runs a host's process in its namespace, or None.
        """
        if not independent:
            if self.warm_failures:
                self.warm(coordinator, prefix)
            return self.supervise(coordinator, prefix).run()
        with island_jobs.run_key(self.train_args) as key:  # every island authenticates
            jobs = island_jobs.plan_jobs(self.topology, self.faults, peer_address, key)
            runs = [(job.name, self.supervise(coordinator, prefix, job)) for job in jobs]
            return island_jobs.run_all(runs, self.opts["out"])

    def workers(self, job, coordinator, prefix, extra, excluded, more=()) -> list[Worker]:
        """``job``'s processes (without ``excluded``: the survivors, whose trainer re-plans),
        with ``extra`` in their environment and ``more`` train arguments."""
        hosts, args = job.topology, [*self.train_args, *job.args, *fault_args(job.faults)]
        if excluded:
            hosts = island_jobs.survivors(job, excluded)
            args += ["--set", f"parallel.exclude_hosts=[{','.join(excluded)}]"]
        return plan_workers(
            hosts, self.mesh_path, [*args, *more], coordinator(hosts),
            base_env={**self.base_env, **extra}, program=self.program, prefix=prefix,
        )  # fmt: skip

    def warm(self, coordinator, prefix=None) -> None:
        """``--warm-failures``: before training, the survivors of each failure
        (:func:`~holmes_jax.planner.failures.failure_cases`) run ``train --compile-only
        --measure`` one after the other, so a restart on them loads its candidate plans'
        programs and knows their steps (:mod:`holmes_jax.cluster.warm`)."""
        job = island_jobs.Job(self.topology, (), ())
        out = self.opts["out"]
        for what, island, excluded in failure_cases(self.topology, every_host=True):
            what = excluded[0] if what == "host" else f"island {island}"
            began = time.monotonic()
            more = ["--compile-only", "--measure"]
            workers = self.workers(job, coordinator, prefix, {}, excluded, more)

            def on_status(worker, event):
                if worker.process_id == 0 and event["event"] == "measured":
                    self.measured.record(event)

            code = Launch(workers, out=out, count_hidden=False, status=on_status).run()
            best = self.measured.best(excluded)
            done = "compiled" if code == 0 else f"not compiled ({describe(code)})"
            if code == 0 and best is not None:
                done += f" and measured (fastest plan {best:.3g} s a step)"
            self.say(
                f"--warm-failures: the survivors of {what}: {done} in "
                f"{time.monotonic() - began:.1f} s"
            )

    def supervise(self, coordinator, prefix=None, job=None) -> Supervisor:
        job = job or island_jobs.Job(self.topology, (), self.faults)  # the whole topology

        def make_workers(extra: dict[str, str], excluded: tuple[str, ...]) -> list[Worker]:
            return self.workers(job, coordinator, prefix, extra, excluded)

        if injected := fault_args(job.faults):
            specs = " ".join(f.spec for f in job.faults if f.inject)
            whose = f"island {job.name}'s job" if job.name else "the job"
            self.say(f"--fail-host {specs}: every worker of {whose} gets {' '.join(injected)}")

        def reachable(excluded: tuple[str, ...]) -> Unreachable | None:
            try:
                hosts = island_jobs.survivors(job, excluded)
            except island_jobs.IslandGone:
                return None
            return self.unreachable([h for isl in hosts.islands for h in isl.hosts])

        supervisor = Supervisor(
            make_workers, faults=job.faults, on_step=self.on_step, measured=self.measured,
            reachable=reachable if self.unreachable is not None else None, **self.opts,
        )  # fmt: skip
        self.supervisors.append(supervisor)
        return supervisor


@contextlib.contextmanager
def _signals_to(supervisors: list[Supervisor]) -> Iterator[None]:
    """SIGINT and SIGTERM go to every supervisor (before any: stop the launch)."""

    def on_signal(signum, frame):
        if not supervisors:
            raise _Stop
        for supervisor in supervisors:
            supervisor.on_signal(signum, frame)

    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            handlers[sig] = signal.signal(sig, on_signal)
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _emulated(jobs: _Jobs, topology, scale, latency, cpu_quota, cut, independent, say) -> int:
    """Run ``jobs`` with each host in its own shaped namespace and CPU group (module doc)."""
    from holmes_jax.cluster import cgroups, netns

    netns.check_privileges()
    netns.remove_stale()
    cgroups.remove_stale()
    tag = str(os.getpid())
    plan = netns.plan_network(topology, tag=tag, scale=scale, latency=latency)
    mode = cgroups.resolve(
        cpu_quota, warn=lambda line: print(line, file=jobs.opts["out"] or sys.stdout)
    )
    quotas = cgroups.plan_quotas(topology, tag, mode, len(os.sched_getaffinity(0)))
    with netns.EmulatedNetwork(plan) as network, cgroups.CpuGroups(quotas) as groups:

        def coordinator(hosts: Topology) -> str:  # process 0's namespace
            return f"{plan.host(hosts.islands[0].hosts[0]).address}:{EMULATED_PORT}"

        def peer_address(host: str, k: int) -> str:  # the host's k-th outer-sync lane
            return f"{plan.host(host).address}:{island_jobs.OUTER_SYNC_PORT + k}"

        say(_emulation_summary(topology, len(plan.hosts), scale, plan.delays, quotas))
        jobs.unreachable = lambda hosts: network.unreachable(hosts, EMULATED_PORT)
        cutter = None
        if cut is not None:
            cutter = linkcut.IslandCutter(cut, network.cut_islands, network.restore_islands, say)
            jobs.on_step = cutter.on_step
        try:
            return jobs.run(
                coordinator, peer_address, independent, groups.wrap(network.exec_prefix)
            )
        finally:
            if cutter is not None:
                cutter.restore()
            if stats := groups.throttling():
                say(cgroups.format_throttling(stats))


def _emulation_summary(
    topology: Topology, namespaces: int, scale: float, delays=None, quotas=()
) -> str:
    islands = topology.islands
    rates = ", ".join(f"{i.name} {i.link.bandwidth_gbps * 1e3 * scale:g} Mbit/s" for i in islands)
    inter = sorted(
        {
            topology.inter_island(a.name, b.name).bandwidth_gbps * 1e3 * scale
            for n, a in enumerate(islands)
            for b in islands[n + 1 :]
        }
    )
    between = f", between islands {'/'.join(f'{r:g}' for r in inter)} Mbit/s" if inter else ""
    rtts = sorted({2e3 * d for d in (delays or {}).values()})
    if rtts:
        between += f", round trip {'/'.join(f'{r:g}' for r in rtts)} ms"
    if quotas:
        cpu = ", ".join(f"{q.host} {q.share:.2g}" for q in quotas)
        between += f"; CPU quota (cores): {cpu}"
    return f"emulating '{topology.name}': {namespaces} namespaces, {rates}{between}"
