"""Local multi-process launches: one training process per host of a topology.

The library half of ``python -m holmes_jax.launch`` (:mod:`holmes_jax.launch` parses the
command line and calls :func:`holmes_jax.cluster.local_launch.launch`)::

    python -m holmes_jax.launch --mesh meshes/cpu8-two-islands.yaml -- \\
        --config configs/quickstart.yaml --set parallel.stages=2 --set train.steps=20

- Starts ``python -m holmes_jax.train <train arguments>`` once per host, in topology order
  (process ``i`` = host ``i``). Each gets its host's CPU device count, its transport
  profile (:mod:`holmes_jax.cluster.transport`) and ``--coordinator/--num-processes/
  --process-id``. ``--program probe`` runs ``python -m holmes_jax.probe`` the same way.
- Every output line is prefixed with the host name. Library chatter (:func:`quiet`) is
  hidden unless ``--verbose``; a closing line counts it.
- A ``--mesh`` among the train arguments must name the launcher's file (it is dropped).
- The first process to fail ends the attempt. The others get ``--grace`` seconds to report,
  then are killed. Then the job restarts (``--max-restarts``, default 3) or the launcher
  exits with the first one's code. Restarts and ``--fail-host`` fault injection:
  :mod:`holmes_jax.cluster.supervisor`.
- Ctrl-C or SIGTERM is forwarded as SIGTERM (stop, checkpoint, exit 0). A second Ctrl-C
  kills.
- ``--emulate`` (root) runs every host in its own network namespace, shaped with ``tc htb``
  at its island's rates times ``--scale`` (:mod:`holmes_jax.cluster.netns`), with the
  topology's latency between islands added by a delaying wire (:mod:`holmes_jax.cluster.delay`)
  and, where the islands' ``peak_tflops`` differ, a CPU quota per host in proportion to it
  (:mod:`holmes_jax.cluster.cgroups`). Everything it made is removed on exit; ``--cleanup``
  removes what a killed launcher left behind.

Bad input: one line, exit 2. More: docs/multihost.md, "The local launcher".
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO

from holmes_jax.cluster.host_memory import with_huge_pages
from holmes_jax.cluster.transport import host_environment
from holmes_jax.cluster.xla_flags import CPU_DEVICES_FLAG
from holmes_jax.core import status as status_channel
from holmes_jax.core.errors import ConfigError
from holmes_jax.planner.topology import Topology

OWNED_FLAGS = ("--mesh", "--coordinator", "--num-processes", "--process-id", "--cpu-devices")
DEFAULT_GRACE_S = 10.0
STOP_GRACE_S = 300.0  # after a forwarded stop: time to finish the step and checkpoint
EMULATED_PORT = 29500  # free in a fresh namespace
# What a launch can run: the trainer, or the probe (to measure the links as training sees them).
PROGRAMS = {"train": "holmes_jax.train", "probe": "holmes_jax.probe"}

# Library chatter, hidden without --verbose: what the processes' C++ side prints that the
# launch's own lines already say. gloo reports each communicator it connects (a line per
# rank and clique, on std::cout, no switch to turn it off), written in pieces by several
# threads, so two reports can interleave mid-line: a line of nothing but those pieces is
# chatter, and a whole report inside another line is cut out. jax's client logs the loss
# of the coordinator ("Polled an error", the preemption service's failed calls with their
# gRPC detail) just before the watchdog's one line naming the lost peer.
_GLOO_REPORT = re.compile(
    r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
    r"Expected number of connected peer ranks is : \d+"
)
_GLOO_PIECES = re.compile(
    r"(?:\[Gloo\] Rank | is connected to | peer ranks\. "
    r"|Expected number of connected peer ranks is : |\d+)+"
)
_JAX_ECHO = re.compile(
    r"E\d{4} .* coordination_service_agent\.cc:\d+\] Polled an error .*"
    r"|[WE]\d{4} .* preemption_sync_manager\.cc:\d+\] .*"
    r"|Additional GRPC error information from remote target coordination_service .*"
    r"|:UNKNOWN:Error received from peer .*"
)


def quiet(line: str, after_chatter: bool = False) -> str | None:
    """One output line (no newline) without library chatter; None when nothing is left.

    A line of bare digits is the tail of a gloo report cut by another thread's report
    (``...is : `` + another report + ``1``) when the same process's previous line was
    chatter (``after_chatter``); otherwise it is kept. So is an empty line after chatter:
    the newline of a report whose text went into the line before.
    """
    if _JAX_ECHO.fullmatch(line) or (
        _GLOO_PIECES.fullmatch(line) and (after_chatter or not line.isdigit())
    ):
        return None
    if not line and after_chatter:
        return None
    rest = _GLOO_REPORT.sub("", line)
    return rest if rest == line or rest.strip() else None


@dataclass(frozen=True)
class Worker:
    """One process to start: which host, the command and its environment."""

    host: str
    process_id: int
    command: list[str]
    env: dict[str, str] = field(repr=False)


def worker_env(topology: Topology, host: str, base: dict[str, str]) -> dict[str, str]:
    """``base`` plus the host's transport profile, CPU platform, huge pages for malloc's
    large blocks (:mod:`holmes_jax.cluster.host_memory`) and unbuffered output.

    An inherited device-count flag is dropped from ``XLA_FLAGS``: each process's count
    comes from its ``--cpu-devices``.
    """
    env = dict(base)
    for key, value in host_environment(topology, host).items():
        env.setdefault(key, value)
    flags = re.sub(rf"{CPU_DEVICES_FLAG}=\S*", "", env.get("XLA_FLAGS", "")).split()
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONUNBUFFERED"] = "1"
    return with_huge_pages(env)


def plan_workers(
    topology: Topology,
    mesh_path: str,
    train_args: Sequence[str],
    coordinator: str,
    *,
    base_env: dict[str, str] | None = None,
    python: str = sys.executable,
    prefix: Callable[[str], list[str]] | None = None,
    program: str = "train",
) -> list[Worker]:
    """The command and environment of every host's process (pure: nothing starts).

    Args:
      topology: the cluster; one process per host, in topology order.
      mesh_path: the topology file, passed on as ``--mesh``.
      train_args: arguments for ``holmes_jax.train`` (not the ones the launcher sets).
      coordinator: ``host:port`` of process 0.
      base_env: environment to extend (default ``os.environ``).
      python: interpreter.
      prefix: host name -> command prefix (``ip netns exec <ns>`` when emulating).
      program: a key of :data:`PROGRAMS` (``train`` or ``probe``).

    Returns:
      One :class:`Worker` per host.

    Raises:
      ConfigError: an unknown program, or an argument the launcher sets itself.
    """
    if program not in PROGRAMS:
        raise ConfigError(f"--program={program}: must be one of {', '.join(PROGRAMS)}")
    train_args = without_own_mesh(train_args, mesh_path)
    for arg in train_args:
        name = arg.split("=", 1)[0]
        if name in OWNED_FLAGS:
            raise ConfigError(
                f"train argument '{arg}': set by the launcher (put --mesh before '--')"
            )
    base = dict(os.environ if base_env is None else base_env)
    hosts = [(h, isl) for isl in topology.islands for h in isl.hosts]
    workers = []
    for pid, (host, island) in enumerate(hosts):
        command = [python, "-m", PROGRAMS[program], "--mesh", mesh_path]
        command += ["--coordinator", coordinator, "--num-processes", str(len(hosts))]
        command += ["--process-id", str(pid), "--cpu-devices", str(island.devices_per_host)]
        command += train_args
        if prefix is not None:
            command = prefix(host) + command
        workers.append(Worker(host, pid, command, worker_env(topology, host, base)))
    return workers


def without_own_mesh(train_args: Sequence[str], mesh_path: str) -> list[str]:
    """``train_args`` without ``--mesh M`` / ``--mesh=M`` repeating the launcher's file.

    Files compare by real path. ``--set parallel.mesh=M`` naming it stays (it agrees).

    Raises:
      ConfigError: a ``--mesh`` or ``parallel.mesh`` naming another file (the trainer's
        ``--mesh`` would override the latter without a word).
    """
    own, kept, args = os.path.realpath(mesh_path), [], list(train_args)
    while args:
        arg, given = args.pop(0), None
        if arg == "--mesh" and args:
            given = args.pop(0)
            arg = f"--mesh {given}"
        elif arg.startswith("--mesh="):
            given = arg.split("=", 1)[1]
        else:
            kept.append(arg)
            key, _, value = args[0].partition("=") if arg == "--set" and args else ("", "", "")
            if key.strip() == "parallel.mesh":
                given, arg = value.strip(), f"--set {args[0]}"
        if given is not None and os.path.realpath(given) != own:
            raise ConfigError(
                f"train argument '{arg}': the launcher runs --mesh {mesh_path}; a different "
                f"topology after '--' is refused (give one --mesh, before '--')"
            )
    return kept


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- running


class _Stop(Exception):
    """SIGTERM/SIGINT arrived before any process was started."""


class Launch:
    """Runs the workers once: prefixed output, first-failure propagation, signal forwarding.

    Args:
      workers: from :func:`plan_workers`.
      grace_s: how long the others may take to exit after the first failure.
      out: where prefixed lines go (default stdout).
      verbose: pass library chatter through (default: :func:`quiet` drops it).
      status: called with each event a worker reports on its status channel (worker,
        event; :mod:`holmes_jax.core.status`), outside the output lock. Without it the
        workers get no channel.
      failure_line: (worker, exit code) -> the line said on the first failure; default
        ``<host> (process <i>) exited with <code or signal>; stopping the others ...``.
      grace_for: (worker, exit code) -> the others' time to exit after that failure
        (default ``grace_s``).
      count_hidden: end with the line counting hidden chatter (off when a caller counts
        over several launches, from :attr:`hidden`).

    After :meth:`run`: :attr:`failure` is the first failure (worker, raw exit code) or
    None, :attr:`failed_at` its ``time.monotonic()`` (the kill's, for :meth:`kill`) and
    :attr:`detected_at` when this launch saw it; :attr:`started_at` when every worker had
    been started, :attr:`ended_at` when the last had exited.
    """

    def __init__(
        self,
        workers: list[Worker],
        *,
        grace_s: float = DEFAULT_GRACE_S,
        out=None,
        verbose: bool = False,
        status: Callable[[Worker, dict], None] | None = None,
        failure_line: Callable[[Worker, int], str] | None = None,
        grace_for: Callable[[Worker, int], float] | None = None,
        count_hidden: bool = True,
    ):
        self.workers = workers
        self.grace_s = grace_s
        self.out: IO[str] = out or sys.stdout
        self.verbose = verbose
        self.status = status
        self.failure_line = failure_line
        self.grace_for = grace_for
        self.count_hidden = count_hidden
        self.hidden = 0  # chatter lines dropped
        self.procs: list[subprocess.Popen | None] = [None] * len(workers)
        self.failure: tuple[Worker, int] | None = None
        self.failed_at: float | None = None
        self.detected_at: float | None = None
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self._killed_at: dict[int, float] = {}  # process id -> when kill() sent SIGKILL
        self._lock = threading.Lock()
        self._readers: list[threading.Thread] = []
        self._signals = 0
        self._stop_requested = False
        self._width = max(len(w.host) for w in workers)
        self._die_with_parent = _die_with_parent()

    def say(self, line: str) -> None:
        with self._lock:
            print(f"launch: {line}", file=self.out, flush=True)

    def _pump(self, worker: Worker, stream: IO[str]) -> None:
        tag = f"[{worker.host:<{self._width}}] "
        after_chatter = False
        for raw in stream:
            text = raw.rstrip("\n")
            line = text if self.verbose else quiet(text, after_chatter)
            after_chatter = line != text
            with self._lock:
                if line is None:
                    self.hidden += 1
                    continue
                self.out.write(tag + line + "\n")
                self.out.flush()

    def _read_status(self, worker: Worker, stream: IO[str]) -> None:
        limit = status_channel.MAX_LINE
        with stream:
            while line := stream.readline(limit + 1):
                if len(line.rstrip("\n")) > limit:  # read no more of it than the limit
                    while line and not line.endswith("\n"):
                        line = stream.readline(limit + 1)  # the rest, dropped
                    event, problem = None, f"a line over {limit} characters"
                else:  # a whole line, or the last one cut off by the worker's exit
                    event, problem = status_channel.parse(line.rstrip("\n"))
                if event is None:
                    who = f"{worker.host} (process {worker.process_id})"
                    self.say(f"{who}: status line ignored: {problem}")
                else:
                    self.status(worker, event)

    def _on_signal(self, signum, frame) -> None:
        self._signals += 1
        if not any(self.procs):
            raise _Stop
        if self._signals == 1:
            self.say(f"{signal.Signals(signum).name}: asking every process to stop")
            self._send(signal.SIGTERM)
        else:
            self.say("second signal: killing every process")
            self._send(signal.SIGKILL)

    @property
    def stopped(self) -> bool:
        """Whether a signal asked the launch to stop."""
        return self._signals > 0

    def request_stop(self) -> None:
        """SIGTERM to every worker: each finishes its step, checkpoints and exits 0. Neither
        a failure nor a user's stop (the supervisor's, to change the job's hosts)."""
        self._stop_requested = True
        self._send(signal.SIGTERM)

    def _send(self, sig: int) -> None:
        for p in self.procs:
            if p is not None and p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def kill(self, host: str) -> bool:
        """SIGKILL ``host``'s worker (fault injection); False when it is not running."""
        for w, p in zip(self.workers, self.procs, strict=True):
            if w.host == host and p is not None and p.poll() is None:
                self._killed_at[w.process_id] = time.monotonic()
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    return False
                return True
        return False

    def _start(self, index: int) -> None:
        w = self.workers[index]
        env, keep = w.env, ()
        if self.status is not None:  # the worker writes, a thread here reads
            read_end, write_end = os.pipe()
            env, keep = {**w.env, status_channel.STATUS_FD_VAR: str(write_end)}, (write_end,)
        p = subprocess.Popen(
            w.command,
            env=env,
            pass_fds=keep,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,  # signals reach it only through the launcher
            preexec_fn=self._die_with_parent,
        )
        self.procs[index] = p
        readers = [(self._pump, p.stdout)]
        if self.status is not None:
            os.close(write_end)  # the worker holds the only write end: its exit ends the stream
            readers.append((self._read_status, open(read_end, encoding="utf-8", errors="replace")))
        for target, stream in readers:
            t = threading.Thread(target=target, args=(w, stream), daemon=True)
            t.start()
            self._readers.append(t)

    def run(self) -> int:
        """Start every worker and wait; returns the launch's exit code.

        0 when every process exited 0; else the first failure's code (128 + signal for a
        process killed by a signal).
        """
        try:
            for i in range(len(self.workers)):
                self._start(i)
            self.started_at = time.monotonic()
            return self._wait()
        finally:
            self._send(signal.SIGKILL)
            for p in self.procs:
                try:
                    if p is not None:
                        p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            self.ended_at = time.monotonic()
            for t in self._readers:
                t.join(timeout=2)
            if self.hidden and self.count_hidden:
                self.say(f"{self.hidden} lines of library output hidden (--verbose shows them)")

    def _wait(self) -> int:
        deadline = None
        while True:
            codes = [p.poll() if p is not None else None for p in self.procs]
            running = any(
                p is not None and c is None for p, c in zip(self.procs, codes, strict=True)
            )
            if not running:
                break
            if self.failure is None:
                # a killed worker first: its peers may see it gone and exit before a poll
                order = sorted(
                    zip(self.workers, self.procs, codes, strict=True),
                    key=lambda item: item[0].process_id not in self._killed_at,
                )
                for w, p, c in order:
                    if p is not None and c not in (None, 0):
                        self.failure = (w, c)
                        self.detected_at = time.monotonic()
                        self.failed_at = self._killed_at.get(w.process_id, self.detected_at)
                        line = self.failure_line(w, c) if self.failure_line else None
                        self.say(
                            line
                            or f"{w.host} (process {w.process_id}) exited with {describe(c)}; "
                            f"stopping the others (in {self.grace_s:g} s at most)"
                        )
                        grace = self.grace_for(w, c) if self.grace_for else self.grace_s
                        deadline = time.monotonic() + grace
                        break
            if (self._signals == 1 or self._stop_requested) and deadline is None:
                deadline = time.monotonic() + STOP_GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                self._send(signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.1)
        if self.failure is None:
            bad = [
                (w, c)
                for w, p, c in zip(self.workers, self.procs, codes, strict=True)
                if p is not None and c != 0
            ]
            self.failure = bad[0] if bad else None
            if self.failure is not None:  # every process ended at once
                self.failed_at = self.detected_at = time.monotonic()
                if self.failure_line:
                    self.say(self.failure_line(*self.failure))
        if self.failure is None:
            return 0
        return exit_code(self.failure[1])


def exit_code(code: int) -> int:
    """A process's exit status as a shell reports it: 128 + signal for a signal."""
    return 128 - code if code < 0 else code


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when the launcher dies (Linux).

    libc is loaded here, in the parent: between fork and exec the child only makes one
    foreign call (no imports, no locks). None where prctl is unavailable.
    """
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def describe(code: int) -> str:
    """``code 3`` or ``signal SIGKILL`` for a ``Popen.returncode``."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"
