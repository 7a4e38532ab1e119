"""Supervised restarts and fault injection for the local launcher
(:func:`holmes_jax.cluster.local_launch.launch`).

:class:`Supervisor` runs a job (:class:`~holmes_jax.cluster.launcher.Launch`). When a worker
fails, it runs the job again, up to ``max_restarts`` times:

- Any failure is restarted except the exit codes in :data:`NOT_RETRIED` (2: a config or
  usage error; 4: a stop for non-finite steps). A job stopped by Ctrl-C or SIGTERM is not
  restarted.
- Every worker restarts, on a fresh coordinator port, with ``HOLMES_CONTINUE_RUN_DIR`` set to
  the job's run directory. The job resumes from the newest checkpoint of that run
  (:mod:`holmes_jax.runtime.rundir.paths`).
- The supervisor learns the job's progress from process 0's status channel
  (:mod:`holmes_jax.core.status`) and prints one line per failure and per resumption.

Fault injection (``--fail-host``, :class:`Fault`): a kill fault sends SIGKILL to a host's
worker and keeps the host away for a while. ``:nan`` and ``:abstain`` faults kill nothing:
the job is told to fail that way (:func:`fault_args`). ``on_step`` sees every reported step
(``--cut-islands``, :mod:`holmes_jax.cluster.linkcut`, listens there).

Hosts that stay away: before a restart the supervisor waits up to ``rejoin_timeout_s``
(``--rejoin-timeout``) for them. Those still away are left out, and the trainer re-plans for
the survivors (:mod:`holmes_jax.planner.failures`). When a left-out host is back, every host
starts again from a checkpoint; this re-expansion does not count as a restart. It waits until
every host can reach the others (``reachable``): the survivors train on meanwhile. A restart
across a cut link leaves out the hosts that cannot reach the first one, until then.
"""

from __future__ import annotations

import math
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

from holmes_jax.cluster.launcher import (
    DEFAULT_GRACE_S,
    Launch,
    Worker,
    _Stop,
    describe,
    exit_code,
)
from holmes_jax.cluster.restarts import RestartClock, resumed_line
from holmes_jax.cluster.warm import Measured
from holmes_jax.core import status as status_channel
from holmes_jax.core.errors import NONFINITE_EXIT, USAGE_EXIT, ConfigError

if TYPE_CHECKING:
    from holmes_jax.cluster.netns import Unreachable

DEFAULT_MAX_RESTARTS = 3
PROBE_EVERY_S = 1.0  # how often a re-expansion that found a host unreachable probes again
RESTART_GRACE_S = 1.0  # the others' time to exit when a restart follows a failure
DEFAULT_REJOIN_S = 60.0  # how long a restart waits for an away host before leaving it out
# Exit codes a restart cannot fix (the same command fails the same way), and why.
NOT_RETRIED = {
    USAGE_EXIT: "exit code 2 is a config or usage error",
    NONFINITE_EXIT: "exit code 4 is a stop for non-finite steps, which a restart replays",
}
# holmes_jax.runtime.rundir.paths.CONTINUE_VAR (not imported: the launcher's process runs no jax)
CONTINUE_VAR = "HOLMES_CONTINUE_RUN_DIR"

# the faults told to a job rather than done to it: kind -> the key that tells it
INJECTED = {"nan": "train.inject_nonfinite_steps", "abstain": "diloco.inject_abstain_steps"}
_FAULT = re.compile(r"([^@\s]+)@([^:\s]+)(?::(.*))?")


@dataclass(frozen=True)
class Fault:
    """One ``--fail-host``: SIGKILL ``host``'s worker once, at the first reported step >=
    ``step`` (the workers report it, logged or not: ``HOLMES_STATUS_STEPS``); it stays
    away ``away_s`` seconds after the kill (``inf``: for good). ``inject`` ``"nan"`` or
    ``"abstain"``: no kill; the job holding ``host`` is told to fail that way at ``step``
    (:func:`fault_args`)."""

    host: str
    step: int
    away_s: float = 0.0
    spec: str = ""
    inject: str = ""

    @property
    def permanent(self) -> bool:
        return math.isinf(self.away_s)


def _hosts_are(hosts: Sequence[str]) -> str:
    """``"a is"`` or ``"a, b are"``, for launcher lines."""
    return f"{', '.join(hosts)} {'is' if len(hosts) == 1 else 'are'}"


def parse_fault(spec: str, hosts: Sequence[str]) -> Fault:
    """``HOST@STEP``, ``HOST@STEP:permanent``, ``HOST@STEP:+SECONDS``, ``HOST@STEP:nan`` or
    ``HOST@STEP:abstain`` -> :class:`Fault`.

    Raises:
      ConfigError: a malformed spec, a host not in ``hosts``, a step < 1, or seconds that
        are not a number >= 0.
    """
    flag = f"--fail-host={spec}"
    form = (
        "must be HOST@STEP, HOST@STEP:permanent, HOST@STEP:+SECONDS, HOST@STEP:nan or "
        "HOST@STEP:abstain"
    )
    m = _FAULT.fullmatch(spec)
    if not m or not re.fullmatch(r"-?\d+", m[2]):
        raise ConfigError(f"{flag}: {form}")
    host, step, tail = m[1], int(m[2]), m[3]
    if host not in hosts:
        raise ConfigError(f"{flag}: '{host}' is not a host of the topology ({', '.join(hosts)})")
    if step < 1:
        raise ConfigError(f"{flag}: step {step} must be >= 1")
    away = 0.0
    if tail in INJECTED:
        return Fault(host, step, 0.0, spec, inject=tail)
    if tail == "permanent":
        away = math.inf
    elif tail is not None:
        if not tail.startswith("+"):
            raise ConfigError(f"{flag}: {form}")
        try:
            away = float(tail[1:])
        except ValueError:
            away = -1.0
        if not away >= 0 or math.isinf(away):
            raise ConfigError(f"{flag}: '{tail[1:]}' must be a number of seconds >= 0")
    return Fault(host, step, away, spec)


def fault_args(faults: Sequence[Fault]) -> list[str]:
    """The train arguments that give one job its injected faults: ``--set KEY=[STEP, ...]``
    per kind (:data:`INJECTED`), or none.

    - ``nan``: step STEP of the job computes a non-finite loss and gradients.
    - ``abstain`` (independent islands): the island sends nothing in the round after STEP.

    Every worker of the job gets the same arguments, since all of a job's processes run one
    program. The fault is in the workers' arguments, so it fires again in a restart that
    resumes from before STEP.
    """
    out = []
    for kind, key in INJECTED.items():
        steps = sorted({f.step for f in faults if f.inject == kind})
        if steps:
            out += ["--set", f"{key}=[{','.join(map(str, steps))}]"]
    return out


class Supervisor:
    """Runs a job, restarting it after failures and injecting faults (see the module doc).

    Args:
      make_workers: (extra environment, hosts left out) -> the workers of one attempt (a
        fresh coordinator each call; the hosts left out get no worker and the others are
        told to run without them, ``--set parallel.exclude_hosts=[...]``).
      max_restarts: restarts allowed after failures; 0 runs the job once.
      faults: the ``--fail-host`` faults.
      on_step: called with every step process 0 reports (under the supervisor's lock).
      rejoin_timeout_s: how long a restart waits for an away host before leaving it out.
      measured: the failures measured before training (:class:`holmes_jax.cluster.warm.
        Measured`): it keeps process 0's ``measured`` events, and a restart may leave out
        more hosts than the away ones (its ``widen``); those start again with them.
      reachable: (hosts the next attempt leaves out) -> None when its hosts can reach each
        other, else a :class:`~holmes_jax.cluster.netns.Unreachable` (a pair that cannot,
        and the hosts cut off from the first). A re-expansion waits for None, and a restart
        leaves the cut-off hosts out until then: across a cut link a join stalls.
      grace_s, out, verbose: as :class:`~holmes_jax.cluster.launcher.Launch`'s.
    """

    def __init__(
        self,
        make_workers: Callable[[dict[str, str], tuple[str, ...]], list[Worker]],
        *,
        max_restarts: int = DEFAULT_MAX_RESTARTS,
        faults: Sequence[Fault] = (),
        on_step: Callable[[int], None] | None = None,
        rejoin_timeout_s: float = DEFAULT_REJOIN_S,
        measured: Measured | None = None,
        reachable: Callable[[tuple[str, ...]], Unreachable | None] | None = None,
        grace_s: float = DEFAULT_GRACE_S,
        out=None,
        verbose: bool = False,
    ):
        self.make_workers = make_workers
        self.on_step = on_step
        self.max_restarts = max_restarts
        self.faults = [f for f in faults if not f.inject]  # the kills; fault_args the rest
        self.rejoin_timeout_s = rejoin_timeout_s
        self.excluded: tuple[str, ...] = ()  # hosts the running attempt is without
        self.measured = measured
        self._sitting_out: set[str] = set()  # excluded though not away (measured.widen)
        self._reexpand = False  # the survivors were asked to stop: start every host again
        self.reachable = reachable
        self._probing = False  # a reachability probe is running
        self._probe_at = 0.0  # monotonic time the next probe may start
        self._unreachable: str | None = None  # what the last probe found, said once
        self.grace_s = grace_s
        self.out: IO[str] | None = out
        self.verbose = verbose
        self.current: Launch | None = None
        self.restarts = 0
        self.step = 0  # the last step the job reported, over every attempt
        # The run directory the first attempt reported. Every restart continues this run
        # (CONTINUE_VAR), even when the first attempt died before its first checkpoint.
        self.run_dir: str | None = None
        self._fired: set[int] = set()  # indices of the faults that fired
        self._away_until: dict[str, float] = {}  # host -> monotonic time it may start
        self._lock = threading.Lock()
        self._signals = 0
        # per attempt
        self._clock: RestartClock | None = None  # the restart not announced yet
        self._reexpand_at = 0.0  # when the survivors were asked to stop

    # -- signals ----------------------------------------------------------------

    def on_signal(self, signum, frame) -> None:
        """Forward Ctrl-C / SIGTERM to the running attempt; no restart follows."""
        self._signals += 1
        if self.current is None:
            raise _Stop
        self.current._on_signal(signum, frame)

    # -- the job's output -------------------------------------------------------

    def _on_status(self, worker: Worker, event: dict) -> None:
        """Process 0's status events: the run directory, the checkpoint step a restart
        resumed from, the first compile, each logged or watched step, whatever
        ``logging.progress``, and the failures measured before training."""
        if worker.process_id != 0:  # process 0 speaks for the job
            return
        with self._lock:
            kind, clock = event["event"], self._clock
            if kind == "step":
                self._on_step(event["step"])
            elif kind in ("started", "joined") and clock is not None:
                clock.mark("init" if kind == "started" else "join")
            elif kind == "resumed":
                self._past(event["step"])
                if clock is not None:
                    clock.resumed_from = event["step"]
                    clock.mark("restore")
            elif kind == "compiled" and clock is not None:
                detail = f", {event['detail']}" if event["detail"] else ""
                clock.compile = f"compile {event['seconds']:.1f} s{detail}"
                clock.mark("compile")
            elif kind == "run_dir" and self.run_dir is None:
                self.run_dir = event["path"]
            elif kind == "measured" and self.measured is not None:
                self.measured.record(event)

    def _on_step(self, step: int) -> None:
        self.step = step
        if self.on_step is not None:
            self.on_step(step)
        launch = self.current
        if self._clock is not None:  # the first step after a restart: its line and record
            clock, self._clock = self._clock, None
            clock.mark("first_step")
            launch.say(resumed_line(clock, step))
            clock.write(self.run_dir, step)
        now = time.monotonic()
        back = [
            h
            for h in self.excluded
            if h not in self._sitting_out and self._away_until.get(h, 0.0) <= now
        ]
        if back and not self._reexpand and not self._probing and now >= self._probe_at:
            if self.reachable is None:
                self._reexpand_now(launch, back)
            else:  # probed off the status thread: a cut link answers only after a timeout
                self._probing = True
                threading.Thread(target=self._probe, args=(launch, back), daemon=True).start()
        for i, fault in enumerate(self.faults):
            if i in self._fired or step < fault.step:
                continue
            self._fired.add(i)
            away = ""
            if fault.permanent:
                away = ", for good"
            elif fault.away_s:
                away = f", away for {fault.away_s:g} s"
            self._away_until[fault.host] = time.monotonic() + fault.away_s
            launch.say(f"--fail-host {fault.spec}: SIGKILL to {fault.host} at step {step}{away}")
            launch.kill(fault.host)

    def _reexpand_now(self, launch: Launch, back: list[str]) -> None:
        """Ask the survivors to stop so that every host starts again (under the lock)."""
        self._reexpand = True
        launch.say(
            f"{_hosts_are(back)} back: the survivors "
            "stop at a step they agree on (with a checkpoint), then every host starts again"
        )
        # SIGTERM: the survivors checkpoint at the step they agree on and exit 0.
        self._reexpand_at = time.monotonic()
        launch.request_stop()

    def _probe(self, launch: Launch, back: list[str]) -> None:
        """Re-expand if the next attempt's hosts reach each other; else say why once and
        let a later step probe again (at most every ``PROBE_EVERY_S``)."""
        still_away = set(self._away())
        found = self.reachable(tuple(h for h in self.excluded if h in still_away))
        why = found.why if found is not None else None
        with self._lock:
            self._probing = False
            if self.current is not launch or self._reexpand or self._signals:
                return
            if why is None:
                if self._unreachable:
                    launch.say(f"{self._unreachable}: the links are back")
                self._reexpand_now(launch, back)
                return
            if why != self._unreachable:
                launch.say(
                    f"{_hosts_are(back)} back, but {why}: "
                    "the survivors train on until every host can reach the others"
                )
            self._unreachable = why
            self._probe_at = time.monotonic() + PROBE_EVERY_S

    def _cut_off(self) -> str | None:
        """Before a restart: leave out the hosts that cannot reach the next attempt's first
        host (across a cut link their join would stall the job); they come back as a
        re-expansion once every host reaches the others. Returns why, or None."""
        found = self.reachable(self.excluded) if self.reachable is not None else None
        if found is None or not found.cut_off:
            return None
        self.excluded += tuple(h for h in found.cut_off if h not in self.excluded)
        n = len(found.cut_off)
        self._say(
            f"{found.why}: {', '.join(found.cut_off)} {'sits' if n == 1 else 'sit'} out until "
            "every host can reach the others"
        )
        return found.why

    def _past(self, resumed: int) -> None:
        """The faults not fired yet whose step a resume at ``resumed`` has passed: each
        said in one line and never fired."""
        for i, fault in enumerate(self.faults):
            if i not in self._fired and fault.step <= resumed:
                self._fired.add(i)
                self._say(
                    f"--fail-host {fault.spec}: does not fire, step {fault.step} is already "
                    f"past (the run resumed from step {resumed})"
                )

    def _unfired(self) -> None:
        """One line for each fault the job ended before."""
        for i, fault in enumerate(self.faults):
            if i not in self._fired:
                last = f"after step {self.step}" if self.step else "before any step"
                self._say(
                    f"--fail-host {fault.spec}: did not fire, the job ended {last} "
                    f"(train.steps or an earlier stop) before step {fault.step}"
                )

    def _watch_env(self) -> dict[str, str]:
        """The workers' ``HOLMES_STATUS_STEPS``: the steps of the faults not fired yet, so
        each fires at its step whatever ``logging.log_every``."""
        steps = sorted({f.step for i, f in enumerate(self.faults) if i not in self._fired})
        return {status_channel.STEPS_VAR: ",".join(map(str, steps))} if steps else {}

    # -- the failure line -------------------------------------------------------

    def _restarts_after(self, code: int) -> bool:
        """Whether a failure with exit ``code`` now is followed by a restart."""
        stopped = self.current is not None and self.current.stopped
        retried = exit_code(code) not in NOT_RETRIED and not stopped
        return retried and self.restarts < self.max_restarts

    def _grace_for(self, worker: Worker, code: int) -> float:
        """The others' time to exit after a failure: short when a restart follows (they
        cannot go on without the failed process, and every second delays the restart)."""
        return min(self.grace_s, RESTART_GRACE_S) if self._restarts_after(code) else self.grace_s

    def _failure_line(self, worker: Worker, code: int) -> str:
        """The line that reports a failure: host, process, exit code or signal, the last step
        the job reached, and what happens next."""
        at = f"at step {self.step}" if self.step else "before its first step"
        head = f"{worker.host} (process {worker.process_id}) exited with {describe(code)} {at}"
        stopping = f"stopping the others (in {self._grace_for(worker, code):g} s at most)"
        if exit_code(code) in NOT_RETRIED:
            return f"{head}; {stopping}; not restarting: {NOT_RETRIED[exit_code(code)]}"
        if self.current is not None and self.current.stopped:
            return f"{head}; {stopping}"
        if self._restarts_after(code):
            n = self.restarts + 1
            return f"{head}; {stopping}, then restart {n} of {self.max_restarts}"
        if self.max_restarts == 0:
            return f"{head}; {stopping}"
        used = f"{self.max_restarts} restart{'s' * (self.max_restarts != 1)}"
        return f"{head}; {stopping}; giving up after {used}"

    # -- the attempts -----------------------------------------------------------

    def _say(self, line: str) -> None:
        print(f"launch: {line}", file=self.out or sys.stdout, flush=True)

    def _away(self) -> list[str]:
        now = time.monotonic()
        return [h for h, t in self._away_until.items() if t > now]

    def _wait_for_away_hosts(self) -> tuple[str, ...]:
        """Wait up to ``rejoin_timeout_s`` for the away hosts; returns those still away."""
        away = self._away()
        if not away:
            return ()
        limit = self.rejoin_timeout_s
        self._say(
            f"{_hosts_are(away)} away: waiting up to "
            f"{limit:g} s for {'it' if len(away) == 1 else 'them'} to come back (--rejoin-timeout)"
        )
        deadline = time.monotonic() + limit
        while away and time.monotonic() < deadline and not self._signals:
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            away = self._away()
        if away:
            self._say(
                f"{', '.join(away)} did not come back within {limit:g} s: the others go on "
                f"without {'it' if len(away) == 1 else 'them'}, re-planned for the survivors, "
                "from the newest checkpoint"
            )
        return tuple(away)

    def run(self) -> int:
        """Run the job, restarting it as the module doc says; returns the exit code of its
        last attempt."""
        hidden = 0
        env: dict[str, str] = {}
        first = True
        try:
            while True:
                if self._signals:  # a stop between two attempts
                    return 130
                away = () if first else self._wait_for_away_hosts()
                self.excluded, why = (away, None)
                if away and self.measured is not None:
                    self.excluded, why = self.measured.widen(away)
                if why:
                    self._say(why)
                self._sitting_out = set(self.excluded) - set(away)
                cut = None if first else self._cut_off()
                first = False
                if self._clock is not None:
                    self._clock.mark("wait")
                if self._signals:
                    return 130
                workers = self.make_workers({**env, **self._watch_env()}, self.excluded)
                launch = Launch(
                    workers,
                    grace_s=self.grace_s,
                    out=self.out,
                    verbose=self.verbose,
                    status=self._on_status,
                    failure_line=self._failure_line,
                    grace_for=self._grace_for,
                    count_hidden=False,
                )
                self.current = launch
                self._unreachable, self._probe_at = cut, 0.0
                if self._clock is not None:
                    self._clock.mark("start")
                try:
                    code = launch.run()
                finally:
                    hidden += launch.hidden
                # Re-expansion: every host starts again from the survivors' last checkpoint.
                # It does not count as a restart.
                if self._reexpand and code == 0 and not self._signals:
                    self._reexpand = False
                    self._clock = RestartClock(0, "re-expansion", self.step, self._reexpand_at)
                    self._clock.mark("stop", launch.ended_at)
                    if self.run_dir is not None:
                        env = {CONTINUE_VAR: self.run_dir}
                    continue
                if code == 0 or launch.failure is None or launch.stopped or self._signals:
                    if not self._signals:
                        self._unfired()
                    return code
                worker, raw = launch.failure
                if not self._restarts_after(raw):
                    return code
                self.restarts += 1  # a restart on the survivors counts like any other
                self._clock = RestartClock(self.restarts, "failure", self.step, launch.failed_at)
                self._clock.mark("detect", launch.detected_at)
                self._clock.mark("stop", launch.ended_at)
                if self.run_dir is not None:
                    env = {CONTINUE_VAR: self.run_dir}
        finally:
            if hidden and self.current is not None:
                self.current.say(f"{hidden} lines of library output hidden (--verbose shows them)")
