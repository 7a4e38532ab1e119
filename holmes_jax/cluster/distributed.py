"""Multi-process runs: join the job (``jax.distributed``), and never hang on a dead peer.

:func:`holmes_jax.cluster.detect.resolve` decides who joins. Process ``i`` holds host
``i``'s devices, in the topology's island → host order.

- **Dead peers.** A :class:`~holmes_jax.cluster.watchdog.Watchdog` in every process
  beats through the coordination service's key-value store. A peer silent for
  ``distributed.heartbeat_timeout_s`` is lost. Every survivor prints one line naming it
  and exits with code 3. A process whose collective failed waits one timeout for the
  verdict, so the blame goes to the process that went silent, not to its victims.
  jax's own heartbeat timeout, :func:`backstop_timeout` (3x + 10 s), stays behind it.
- **A dead coordinator.** jax's client reacts with ``LOG(FATAL)`` (exit 134).
  :func:`initialize` gives the client a ``missed_heartbeat_callback`` instead, through a
  wrapper of jaxlib's module (:class:`_WithCallback`). It calls
  :meth:`Watchdog.coordinator_lost`: one line, exit 3. jaxlib 0.10 throws
  ``std::bad_cast`` instead of calling it, so a ``std::set_terminate`` handler
  (:func:`_on_terminate`) turns exactly that exception into the same call. Where the
  handler cannot be installed, the callback is not passed and jax's abort remains.
- **Leaving.** jax's shutdown is a barrier of every process. A process that failed skips
  it and exits with its code at once (:func:`_leave`). A barrier that fails because a peer
  is gone ends the process with its watchdog's code, not a traceback.

The full behaviour, with the lines printed: docs/multihost.md, "When a peer dies".
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from holmes_jax.cluster.detect import Settings, resolve
from holmes_jax.cluster.watchdog import FAILED_EXIT, NONFINITE_REASON, PEER_LOST_EXIT, Watchdog
from holmes_jax.core import status
from holmes_jax.core.errors import NONFINITE_EXIT, ConfigError, NonFiniteError, one_line

if TYPE_CHECKING:
    from holmes_jax.core.config import Config
    from holmes_jax.planner.topology import Topology


class JoinError(RuntimeError):
    """The job could not be joined (no coordinator, or peers missing) in time."""


def start(cfg: Config, environ: MutableMapping[str, str] | None = None):
    """Everything an entry point does before jax starts, when one of several processes.

    1. :func:`resolve` who joins (None: a single process, nothing happens);
    2. set this host's NCCL profile from the topology (:mod:`holmes_jax.cluster.transport`) for
       the variables the environment does not already set;
    3. :func:`initialize` (join, start the watchdog) and :func:`check_layout`.

    Args:
      cfg: a :class:`holmes_jax.core.config.Config`.
      environ: the environment to read and extend (default ``os.environ``).

    Returns:
      The running :class:`Watchdog`, or None.

    Raises:
      ConfigError: incomplete settings or a process layout that contradicts the topology.
      JoinError: the job could not be joined.
    """
    from holmes_jax.cluster import transport
    from holmes_jax.core.plan_request import plan_request
    from holmes_jax.planner.grid import load_mesh_topology

    env = os.environ if environ is None else environ
    settings = resolve(cfg, env)
    if settings is None:
        return None
    # the hosts of this run (parallel.exclude_hosts left out)
    topology = load_mesh_topology(plan_request(cfg))
    if topology is not None and settings.process_id is not None and settings.num_processes:
        host = env.get(transport.HOST_VAR) or transport.host_of_process(
            topology, settings.process_id, settings.num_processes
        )
        if host is not None:
            transport.apply(transport.host_environment(topology, host), env)
    watchdog = initialize(cfg, topology, settings=settings)
    try:
        check_layout(topology)
    except ConfigError as e:
        watchdog.abort(f"ConfigError: {e}")
        raise
    return watchdog


def run_joined(cfg: Config, body: Callable[[], int], environ=None) -> int:
    """:func:`start`, then ``body()``, mapping failures to the entry points' exit codes.

    A :class:`ConfigError` prints one line and returns 2 (peers are told, so they name
    this process instead of waiting on it); a :class:`NonFiniteError` (every process
    raises it after the same step) likewise returns 4; a failed join returns 1; any other error of
    one of several processes goes to :meth:`Watchdog.fail` (a lost peer is named and the
    process exits 3; its own error returns 1). A single process re-raises it.

    Returns:
      ``body()``'s exit code, or the failure's.
    """
    watchdog = None
    try:
        watchdog = start(cfg, environ)
        status.report("joined")  # to a launcher: a restart's phases
        code = body()
    except ConfigError as e:
        if watchdog is not None:
            watchdog.abort(f"ConfigError: {e}")
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        if watchdog is not None:
            watchdog.abort(f"{NONFINITE_REASON}{e}", exit_code=NONFINITE_EXIT)
        print(f"error: {e}", file=sys.stderr)
        return NONFINITE_EXIT
    except JoinError as e:
        print(f"error: {e}", file=sys.stderr)
        return FAILED_EXIT
    except Exception as e:
        if watchdog is None:
            raise
        return watchdog.fail(e)
    if watchdog is not None:
        watchdog.close(exit_code=code)
    return code


def process_label(
    process_id: int, topology: Topology | None = None, num_processes: int | None = None
) -> str:
    """How messages name a process: ``process 1 (host ib-1)``.

    The host is ``HOLMES_HOST`` (set by the launcher), else the topology's host for this
    process id (one process per host or per device), else the machine's hostname.
    """
    import socket

    from holmes_jax.cluster.transport import HOST_VAR, host_of_process

    host = os.environ.get(HOST_VAR)
    if host is None and topology is not None and num_processes:
        host = host_of_process(topology, process_id, num_processes)
    return f"process {process_id} (host {host or socket.gethostname()})"


def initialize(
    cfg: Config,
    topology: Topology | None = None,
    *,
    settings: Settings | None = None,
    log: Callable[[str], None] | None = None,
):
    """Join the job when launched as one of several processes; start the watchdog.

    Must run before anything touches jax devices. Call once per process.

    Args:
      cfg: a :class:`holmes_jax.core.config.Config`.
      topology: the run's topology, to name hosts in messages (optional).
      settings: from :func:`resolve` (default: resolved here).
      log: where the one-line start message goes (default: stderr, process 0 only).

    Returns:
      The running :class:`Watchdog`, or None for a single-process run.

    Raises:
      ConfigError: incomplete settings.
      JoinError: the job could not be joined in ``distributed.initialization_timeout_s``
        (the message names the coordinator).
    """
    settings = settings or resolve(cfg)
    if settings is None:
        return None
    import jax

    d = cfg.distributed
    kwargs: dict[str, Any] = dict(
        coordinator_address=settings.coordinator_address,
        num_processes=settings.num_processes,
        process_id=settings.process_id,
        initialization_timeout=d.initialization_timeout_s,
        # A backstop well behind the watchdog: the service may count a dead peer's silence
        # from up to half its timeout before the watchdog saw the peer's last beat.
        heartbeat_timeout_seconds=backstop_timeout(d.heartbeat_timeout_s),
        shutdown_timeout_seconds=max(30, 2 * d.heartbeat_timeout_s),
    )
    if settings.local_device_ids is not None:
        kwargs["local_device_ids"] = settings.local_device_ids
    if not settings.detect:
        kwargs["cluster_detection_method"] = "deactivate"
    # A peer that never comes makes jax abort after the timeout with its own long log;
    # say first, in one line, what this process is waiting for.
    where = settings.coordinator_address or f"the {settings.source} coordinator"
    waiting = threading.Timer(
        min(10.0, d.initialization_timeout_s / 2),
        lambda: print(
            f"distributed: process {settings.process_id} of {settings.num_processes} still "
            f"waiting to join at {where} (gives up after distributed.initialization_timeout_s"
            f"={d.initialization_timeout_s})",
            file=sys.stderr,
            flush=True,
        ),
    )
    waiting.daemon = True
    waiting.start()
    guard = _CoordinatorGuard(where)
    try:
        _join(kwargs, guard)
    except Exception as e:  # jax raises several types; name the settings instead
        raise JoinError(
            f"could not join the job at {where} as process {settings.process_id} of "
            f"{settings.num_processes} within distributed.initialization_timeout_s="
            f"{d.initialization_timeout_s}: {one_line(e)}"
        ) from None
    finally:
        waiting.cancel()
    from jax._src import distributed as jax_distributed  # the client holds the KV store

    pid, count = jax.process_index(), jax.process_count()
    watchdog = Watchdog(
        jax_distributed.global_state.client,
        pid,
        count,
        timeout_s=d.heartbeat_timeout_s,
        label=process_label(pid, topology, count),
        coordinator=jax_distributed.global_state.coordinator_address or "?",
    )
    guard.watchdog = watchdog
    atexit.register(_leave, watchdog)  # runs before jax's own shutdown (last in, first out)
    watchdog.start()
    if pid == 0:
        say = log or (lambda line: print(line, file=sys.stderr, flush=True))
        say(
            f"distributed: {count} processes ({settings.source}), coordinator "
            f"{watchdog.coordinator}, peer timeout {d.heartbeat_timeout_s} s"
        )
    return watchdog


class _CoordinatorGuard:
    """What jax's client calls when it loses the coordination service (not jax's abort)."""

    def __init__(self, where: str):
        self.where = where
        self.watchdog: Watchdog | None = None  # set once joined

    def __call__(self, *status: Any) -> None:
        if self.watchdog is not None:
            self.watchdog.coordinator_lost()  # does not return
            return
        print(f"error: lost the coordinator at {self.where} while joining", file=sys.stderr)
        sys.stderr.flush()
        os._exit(PEER_LOST_EXIT)


class _WithCallback:
    """jaxlib's ``_jax`` module as ``jax.distributed`` sees it; clients get ``callback``."""

    def __init__(self, module: Any, callback: Callable[..., None]):
        self._module, self._callback = module, callback

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def get_distributed_runtime_client(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("missed_heartbeat_callback", self._callback)
        return self._module.get_distributed_runtime_client(*args, **kwargs)


def _join(kwargs: dict[str, Any], guard: _CoordinatorGuard) -> None:
    """``jax.distributed.initialize(**kwargs)``, its client calling ``guard`` on a lost
    service (see the module doc); plain jax where jax's internals or the terminate handler
    are not what this expects."""
    import jax
    from jax._src import distributed as jax_distributed

    module = getattr(jax_distributed, "_jax", None)
    if not hasattr(module, "get_distributed_runtime_client") or not _on_terminate(guard):
        jax.distributed.initialize(**kwargs)
        return
    jax_distributed._jax = _WithCallback(module, guard)
    try:
        jax.distributed.initialize(**kwargs)
    finally:
        jax_distributed._jax = module


def _leave(watchdog: Watchdog) -> None:
    """At exit: jax's shutdown (a barrier of every process), quietly, and only if it can work.

    A process that failed (its watchdog closed with a non-zero code) has told its peers,
    who are ending: it exits with its code at once instead of waiting in a barrier they
    will not reach. Otherwise a failed barrier (a peer gone) would end in a traceback from
    jax's exit hook (the client's callback, in this thread a ``RuntimeError``): exit
    with the watchdog's code instead; the process has said what there was to say.
    """
    import jax

    try:
        if watchdog.exit_code == 0:
            jax.distributed.shutdown()
            return
    except Exception:  # noqa: BLE001, S110 (any failure here means a peer did not come)
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(watchdog.exit_code)


_HOOKS: list[Any] = []  # the installed terminate handler, alive as long as the process


def _on_terminate(callback: Callable[[], None]) -> bool:
    """Make ``std::terminate`` for a ``bad_cast`` call ``callback``; True once installed.

    The one ``bad_cast`` a joined process expects is jaxlib's failed call of the client's
    callback (module doc). Any other exception goes to the previous handler.
    """
    if _HOOKS:
        return True
    try:
        import ctypes

        libstdcxx = ctypes.CDLL("libstdc++.so.6")
        set_terminate = libstdcxx._ZSt13set_terminatePFvvE  # std::set_terminate
        exception_type = libstdcxx.__cxa_current_exception_type
    except (OSError, AttributeError):
        return False
    handler = ctypes.CFUNCTYPE(None)
    set_terminate.restype, set_terminate.argtypes = ctypes.c_void_p, [handler]
    exception_type.restype = ctypes.c_void_p
    previous: list[int | None] = []

    def on_terminate() -> None:  # runs in the throwing C++ thread (ctypes takes the GIL)
        info = exception_type()  # a std::type_info*: [vtable, const char* mangled name]
        word = ctypes.sizeof(ctypes.c_void_p)
        name = ctypes.c_char_p.from_address(info + word).value if info else None
        if name and (b"bad_cast" in name or b"cast_error" in name):
            callback()
        if previous[0]:
            handler(previous[0])()  # libstdc++'s default: name the exception, abort
        os.abort()

    hook = handler(on_terminate)
    previous.append(set_terminate(hook))
    _HOOKS.append(hook)
    return True


def check_layout(topology: Topology) -> None:
    """With one process per host, each must hold exactly its host's devices.

    Raises:
      ConfigError: a process with a different device count than its topology host, or a
        launcher-given ``HOLMES_HOST`` that is not this process's host in topology order.
    """
    import jax

    from holmes_jax.cluster.transport import HOST_VAR, host_of_process

    count, pid = jax.process_count(), jax.process_index()
    if topology is None or count == 1 or count != topology.num_hosts:
        return
    host = host_of_process(topology, pid, count)
    given = os.environ.get(HOST_VAR)
    if given is not None and given != host:
        raise ConfigError(
            f"{HOST_VAR}={given}: process {pid} runs topology host '{host}' (processes are "
            f"numbered in the topology's host order)"
        )
    island = next(isl for isl in topology.islands if host in isl.hosts)
    have = jax.local_device_count()
    if have != island.devices_per_host:
        raise ConfigError(
            f"devices_per_host={island.devices_per_host} (island '{island.name}'): process "
            f"{pid} (host {host}) has {have} local devices (--cpu-devices or visible GPUs)"
        )


def backstop_timeout(timeout_s: int) -> int:
    """jax's own heartbeat timeout behind a watchdog timeout: 3x + 10 s."""
    return 3 * timeout_s + 10


def preemption_service() -> bool:
    """Whether jax's preemption sync manager runs in this job (several processes joined
    through ``jax.distributed`` and ``jax_enable_preemption_service`` on, jax's default).
    It installs its own SIGTERM handler: a SIGTERM to any process becomes a step every
    process agrees on (:func:`reached_preemption_sync_point`)."""
    import jax

    return jax.process_count() > 1 and bool(jax.config.jax_enable_preemption_service)


def reached_preemption_sync_point(step: int) -> bool:
    """True on every process at the same step once any process got SIGTERM; every process
    must call it at every step, with the same step numbers."""
    from jax.experimental import multihost_utils

    return multihost_utils.reached_preemption_sync_point(step)


def barrier(name: str, timeout_s: float) -> None:
    """Return once every process has called ``barrier(name, ...)``. It goes through jax's
    coordination service, not a collective, so it needs no gloo or NCCL context and may
    wait long: the first collective's context waits only 30 s for its peers (gloo), while
    a slower host may take minutes longer to compile."""
    from jax._src import distributed as jax_distributed

    jax_distributed.global_state.client.wait_at_barrier(name, int(timeout_s * 1000))


def every_process(value: int) -> list[int]:
    """``value`` from every process, in process order: the same list on all of them; every
    process must call it."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return [int(value)]
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.asarray(value, np.int32))  # [P]
    return [int(v) for v in np.ravel(gathered)]


def any_process(flag: bool) -> bool:
    """True on every process when ``flag`` is true on any; every process must call it."""
    return any(every_process(int(bool(flag))))
