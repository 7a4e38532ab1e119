"""Profiler traces of a window of training steps (``logging.profile_steps: START:N``).

    python -m holmes_jax.train --config configs/quickstart.yaml --profile 2:2

Every process traces the same steps, START+1 .. START+N, into a directory of its own,
``<logging.profile_dir>/<name>/`` (:func:`trace_name`: the host in a one-process run,
``process_<i>-<host>`` with several). ``jax.profiler`` writes there the layout TensorBoard's
profile plugin and xprof read, ``plugins/profile/<timestamp>/<host>.xplane.pb`` (with
``<host>.trace.json.gz``), and beside them ``perfetto_trace.json.gz`` for
https://ui.perfetto.dev::

    tensorboard --logdir <run_dir>/profile   # the Profile tab: one run per process

START counts completed steps and must be >= 1, so the first step, which compiles, is never
inside. The trace starts once the steps before it have finished on the device and stops
once step START+N has, with its evaluation, checkpoint save and DiLoCo outer syncs
(:func:`jax.block_until_ready` on the state both times): it holds those steps and nothing
else. A run that resumes at or after step START traces nothing and says so; a run that
stops inside the window writes what it traced.

The loop names its phases for the trace viewer with :class:`jax.profiler.TraceAnnotation`
(``train_step`` through :class:`jax.profiler.StepTraceAnnotation` with ``step_num``,
``eval``, ``checkpoint_save``, ``diloco_outer_sync``, ``metrics``). They are always on: with
no trace running each costs one check of a flag in the profiler's C++ library.
"""

from __future__ import annotations

import glob
import os
import re
import socket
import time
from collections.abc import Callable
from typing import Any

import jax

from holmes_jax.cluster.transport import HOST_VAR, host_of_process
from holmes_jax.core.config import Config
from holmes_jax.planner.topology import Topology

PERFETTO_NAME = "perfetto_trace.json.gz"


def trace_name(
    process_index: int, process_count: int, topology: Topology | None = None, environ=None
) -> str:
    """The directory name of one process's trace: its host (``HOLMES_HOST``, set by the
    launcher, else the topology's host of the process, else the machine's hostname),
    prefixed with ``process_<i>-`` when the job has several processes (which may share a
    host). Characters other than letters, digits, ``.``, ``_`` and ``-`` become ``_``."""
    environ = os.environ if environ is None else environ
    host = environ.get(HOST_VAR)
    if host is None and topology is not None and process_count > 1:
        host = host_of_process(topology, process_index, process_count)
    host = re.sub(r"[^A-Za-z0-9._-]", "_", host or socket.gethostname()) or "host"
    return host if process_count == 1 else f"process_{process_index}-{host}"


def steps_text(first: int, last: int) -> str:
    """``step 3`` or ``steps 3-4``."""
    return f"step {first}" if first == last else f"steps {first}-{last}"


class StepProfiler:
    """Starts and stops one ``jax.profiler`` trace around a window of steps.

    The loop calls :meth:`after_step` once a step is over (its evaluation, checkpoint save
    and outer syncs included) and :meth:`close` when it leaves, however it leaves.

    Args:
      cfg: the run's config, outputs resolved (``logging.profile_dir`` a path).
      first_step: the steps already done when this run starts (a resumed run's step).
      say: where the one-line messages go (the metrics logger's, process 0 only).
      topology: the run's topology, to name hosts (optional).
    """

    def __init__(
        self,
        cfg: Config,
        first_step: int,
        say: Callable[[str], None],
        topology: Topology | None = None,
    ):
        self.say = say
        self.window = cfg.logging.profile_window
        self.directory: str | None = None
        self.tracing = False
        self._began = 0.0
        if self.window is None:
            return
        start, count = self.window
        if start <= first_step:  # the window's first step would be this run's compile
            say(
                f"profile: no trace: logging.profile_steps={cfg.logging.profile_steps} starts "
                f"at or before step {first_step}, where this run resumed"
            )
            self.window = None
            return
        name = trace_name(jax.process_index(), jax.process_count(), topology)
        self.directory = os.path.join(cfg.logging.profile_dir, name)
        self.several = jax.process_count() > 1

    def after_step(self, step: int, state: Any) -> float:
        """Start the trace after step START, stop it after step START+N (``step``: the
        steps done so far).

        Returns:
          The seconds spent starting or stopping the profiler (writing the trace takes
          seconds), which the loop leaves out of its step times; 0 on other steps.
        """
        if self.window is None:
            return 0.0
        start, count = self.window
        if step == start and not self.tracing:
            jax.block_until_ready(state)  # the steps before the window stay out of it
            began = time.perf_counter()
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.tracing, self._began = True, time.perf_counter()
            each = " (one directory per process)" if self.several else ""
            self.say(
                f"profile: tracing {steps_text(start + 1, start + count)} into "
                f"{self.directory}/{each}"
            )
            return self._began - began
        if step == start + count and self.tracing:
            return self._stop(step, state)
        return 0.0

    def close(self, step: int, state: Any) -> None:
        """Write the trace of a run that stops inside the window (``step``: steps done)."""
        if not self.tracing:
            return
        try:
            self._stop(step, state)
        except Exception as e:  # noqa: BLE001 (called on the way out: never hide why)
            self.tracing = False
            self.say(f"profile: the trace could not be written ({type(e).__name__}: {e})")

    def _stop(self, step: int, state: Any) -> float:
        """Stop and write the trace; returns the seconds that took."""
        jax.block_until_ready(state)  # the last traced step's device work is in
        ended = time.perf_counter()
        seconds = ended - self._began
        jax.profiler.stop_trace()
        wrote = time.perf_counter() - ended
        start, count = self.window
        first, early = start + 1, step < start + count
        self.tracing, self.window = False, None
        runs = sorted(glob.glob(os.path.join(self.directory, "plugins", "profile", "*")))
        where = runs[-1] if runs else self.directory
        perfetto = (
            f"; {PERFETTO_NAME}: ui.perfetto.dev"
            if os.path.exists(os.path.join(where, PERFETTO_NAME))
            else ""
        )
        self.say(
            f"profile: {steps_text(first, step)} traced in {seconds:.2f} s"
            + (" (the run stopped inside the window)" if early else "")
            + f", written in {wrote:.1f} s to {where}/ (.xplane.pb: TensorBoard/xprof{perfetto})"
        )
        return time.perf_counter() - ended
