"""The watchdog of a multi-process run: heartbeats through jax's key-value store.

Every process of a job runs one (:func:`holmes_jax.cluster.distributed.initialize` starts it).
A peer whose heartbeat stops for the timeout is lost, and every remaining process ends
with one line naming it instead of hanging in a collective. When jax's client loses the
coordination service itself (process 0 died: its sockets closed), the distributed layer
calls :meth:`Watchdog.coordinator_lost`, which names process 0 at once. See
:class:`Watchdog` for the keys and the verdicts, and :mod:`holmes_jax.cluster.distributed`
for how it is wired in.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from holmes_jax.core.errors import NONFINITE_EXIT, one_line

PEER_LOST_EXIT = 3  # exit code when a peer died or failed
FAILED_EXIT = 1  # this process's own step failed
# How a process that stopped for non-finite steps publishes its reason: a peer that learns
# it from the store exits with NONFINITE_EXIT too (it would have stopped at the same step).
NONFINITE_REASON = "NonFiniteError: "
_PREFIX = "holmes_jax/"


class Watchdog:
    """Heartbeats through the coordination service's key-value store; names lost peers.

    Two daemon threads: *beat* writes ``beat/<id>`` and reads every key under the prefix
    each ``interval_s``; *judge* turns what *beat* saw into a verdict and, on one, prints
    a single line and ends the process. Keys (under ``holmes_jax/``): ``beat/<id>`` a
    counter; ``label/<id>`` how to name the process; ``failing/<id>`` its step raised and
    it is waiting for a verdict (it may be a victim of another's death); ``failed/<id>``
    its own error, published once no peer was found lost; ``done/<id>`` it finished.

    Verdicts, in order: the coordinator (which holds the store) has not answered for
    ``timeout_s``; a peer published ``failed``; a peer that is not done has been silent
    for ``timeout_s``. Process 0 lingers a few beats before exiting so the others, who
    lose the store with it, reach their own verdict first. A process whose jax client
    loses the store says so through :meth:`coordinator_lost` (process 0 is gone).

    Args:
      client: jax's distributed runtime client (``key_value_set``, ``key_value_dir_get``).
      process_id, num_processes: this process and the job size.
      timeout_s: silence after which a peer (or the coordinator) is lost.
      label: how peers name this process in messages.
      coordinator: the coordinator address, for messages.
      interval_s: beat period (default ``min(1, timeout_s / 10)``).
      exit: called with the exit code after the message (default ``os._exit``: the main
        thread may be stuck inside a collective).
      clock: monotonic seconds.
      stream: where the message goes (default stderr).
    """

    def __init__(
        self,
        client: Any,
        process_id: int,
        num_processes: int,
        *,
        timeout_s: float,
        label: str,
        coordinator: str,
        interval_s: float | None = None,
        exit: Callable[[int], None] = os._exit,
        clock: Callable[[], float] = time.monotonic,
        stream: Any = None,
    ):
        self.client = client
        self.process_id = process_id
        self.num_processes = num_processes
        self.timeout_s = float(timeout_s)
        self.interval_s = interval_s if interval_s is not None else min(1.0, timeout_s / 10)
        self.label = label
        self.coordinator = coordinator
        self._exit = exit
        self._clock = clock
        self._stream = stream
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        now = clock()
        self._contact = now  # last successful round trip to the store
        self._contact_error = ""
        self._beats: dict[int, str] = {}
        self._changed = {p: now for p in range(num_processes) if p != process_id}
        self._labels: dict[int, str] = {}
        self._failing: set[int] = set()
        self._failed: dict[int, str] = {}
        self._done: set[int] = set()
        self._counter = 0
        self._dying = threading.Lock()  # one verdict line, whichever thread gets there first
        self._dead = threading.Event()  # set only when ``exit`` returns (a test's)
        self.exit_code = FAILED_EXIT  # what the process exits with, once closed
        self.verdict_message: str | None = None

    # -- threads

    def start(self) -> None:
        """Publish this process's label and start both threads."""
        self._set(f"label/{self.process_id}", self.label)
        for name, target in (("beat", self._beat_loop), ("judge", self._judge_loop)):
            t = threading.Thread(target=target, name=f"holmes-watchdog-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _beat_loop(self) -> None:
        while not self._stop.is_set():
            self.beat()
            self._stop.wait(self.interval_s)

    def _judge_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            message = self.verdict()
            if message is not None:
                self._die(message, self._verdict_exit(message))
                return

    # -- one round (public for tests)

    def beat(self) -> None:
        """Write this process's counter, read everyone's keys, note who moved."""
        try:
            self._counter += 1
            self.client.key_value_set(
                f"{_PREFIX}beat/{self.process_id}", str(self._counter), allow_overwrite=True
            )
            entries = self.client.key_value_dir_get(_PREFIX)
        except Exception as e:  # the coordinator is gone or unreachable
            with self._lock:
                self._contact_error = one_line(e)
            return
        now = self._clock()
        with self._lock:
            self._contact, self._contact_error = now, ""
            for key, value in entries:
                kind, _, who = key[len(_PREFIX) :].partition("/")
                if not who.isdigit() or int(who) == self.process_id:
                    continue
                p = int(who)
                if kind == "beat" and self._beats.get(p) != value:
                    self._beats[p] = value
                    self._changed[p] = now
                elif kind == "label":
                    self._labels[p] = value
                elif kind == "failing":
                    self._failing.add(p)
                elif kind == "failed":
                    self._failed[p] = value
                elif kind == "done":
                    self._done.add(p)

    def verdict(self) -> str | None:
        """The message naming a lost or failed peer, or None while everyone is fine."""
        now = self._clock()
        with self._lock:
            quiet_store = now - self._contact
            if quiet_store >= self.timeout_s and self.process_id != 0:
                why = f" ({self._contact_error})" if self._contact_error else ""
                return (
                    f"lost the coordinator, {self._name(0)} at {self.coordinator}: no answer "
                    f"for {quiet_store:.0f} s{why}"
                )
            failed = sorted(p for p in self._failed if p not in self._done)
            if failed:
                return f"peer {self._name(failed[0])} failed: {self._failed[failed[0]]}"
            lost = [
                p
                for p, t in sorted(self._changed.items())
                if p not in self._done and now - t >= self.timeout_s
            ]
            if lost:
                names = ", ".join(self._name(p) for p in lost)
                quiet = min(now - self._changed[p] for p in lost)
                peers = "peer" if len(lost) == 1 else "peers"
                return f"lost {peers} {names}: no heartbeat for {quiet:.0f} s"
        return None

    def _verdict_exit(self, message: str) -> int:
        """The exit code of a verdict: a peer that stopped for non-finite steps ends this
        process with the same code (every process stops after that step), else 3."""
        with self._lock:
            failed = [self._failed[p] for p in sorted(self._failed) if p not in self._done]
        first = failed[0] if failed else ""
        if first.startswith(NONFINITE_REASON) and message.endswith(first):
            return NONFINITE_EXIT
        return PEER_LOST_EXIT

    def _name(self, p: int) -> str:
        return self._labels.get(p, f"process {p}")

    def coordinator_lost(self) -> None:
        """jax's client lost the coordination service: one line, exit (does not return).

        Called from jax's client thread (see :mod:`holmes_jax.cluster.distributed`) the
        moment a call to the service fails. A closed watchdog exits silently with the code
        it was closed with (the process already said its piece; jax's shutdown barrier
        failed because a peer is gone). Else the verdict already reached, if any, wins
        (a peer that failed, then process 0 exiting); else a coordinator that no longer
        accepts connections is the lost peer: process 0, which held the service. A
        coordinator still there means the service itself reported an error.
        """
        if self._stop.is_set():  # closed: its line is said, it is on its way out (jax's
            self._exit(self.exit_code)  # shutdown barrier failed): exit as it meant to
            return
        message = self.verdict()
        if message is None and self.process_id != 0 and not reachable(self.coordinator):
            message = (
                f"lost peer {self._name(0)}: the coordination service it held at "
                f"{self.coordinator} is gone"
            )
        if message is None:
            message = (
                f"{self.label}: jax's coordination service reported an error before any "
                f"peer was found lost (its log line above says which)"
            )
        if not self._die(message, PEER_LOST_EXIT):  # another thread is printing and exiting:
            self._dead.wait(self.timeout_s + 10)  # returning now would let jax abort first

    # -- the main thread's side

    def fail(self, error: BaseException | str, *, exit_code: int = FAILED_EXIT) -> int:
        """This process's step raised: wait for a verdict on the peers, else own up.

        A collective whose peer vanished raises at once, before anyone can tell which
        peer it was; so first wait up to ``timeout_s`` for the judge (which ends the
        process when it names a lost peer). Only then is the error this process's own:
        publish it (peers exit naming this process), print it on one line.

        Args:
          error: the exception (or its text).
          exit_code: returned for this process's own error.

        Returns:
          ``exit_code`` (when no peer was lost; otherwise the judge ended the process).
        """
        reason = error if isinstance(error, str) else one_line(error)
        self._set(f"failing/{self.process_id}", "1")
        deadline = self._clock() + self.timeout_s + 3 * self.interval_s
        while self._clock() < deadline and self.verdict_message is None:
            with self._lock:
                waiting_on = set(self._changed) - self._done - self._failing - set(self._failed)
            if not waiting_on:  # every peer raised too (the same bug everywhere)
                break
            time.sleep(self.interval_s)
        if self.verdict_message is not None:  # the judge has already ended the process
            return PEER_LOST_EXIT
        self.publish_failure(reason)
        self._print(f"error: {self.label} failed: {reason}")
        self._linger()
        self.close(done=False, exit_code=exit_code)
        return exit_code

    def publish_failure(self, reason: str) -> None:
        """Tell peers this process stops for its own error (they exit naming it)."""
        self._set(f"failed/{self.process_id}", reason[:400])

    def abort(self, reason: str, exit_code: int = 2) -> None:
        """Stop at once for an error known to be this process's own (default: a bad
        setting, exit code 2)."""
        self.publish_failure(reason)
        self._linger()
        self.close(done=False, exit_code=exit_code)

    def close(self, done: bool = True, exit_code: int = 0) -> None:
        """Stop both threads; with ``done``, tell peers this process finished normally.
        ``exit_code``: what the process is about to exit with."""
        self.exit_code = exit_code
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=2 * self.interval_s + 1)
        if done:
            self._set(f"done/{self.process_id}", "1")

    def _die(self, message: str, code: int) -> bool:
        """Print the verdict and exit; False when another thread already does."""
        if not self._dying.acquire(blocking=False):
            return False
        self.verdict_message = message
        self._print(f"error: {message}")
        self._linger()
        self._exit(code)
        self._dead.set()
        return True

    def _linger(self) -> None:
        """Process 0 holds the store: give the others a few beats to read it first."""
        if self.process_id != 0:
            return
        deadline = self._clock() + min(self.timeout_s, 5 * self.interval_s + 2)
        while self._clock() < deadline:
            with self._lock:
                now = self._clock()
                alive = [
                    p
                    for p, t in self._changed.items()
                    if p not in self._done and now - t < 2 * self.interval_s + 0.5
                ]
            if not alive:
                return
            time.sleep(self.interval_s / 2)

    def _set(self, key: str, value: str) -> None:
        try:
            self.client.key_value_set(_PREFIX + key, value, allow_overwrite=True)
        except Exception:
            pass  # the coordinator is gone; the verdict will say so

    def _print(self, line: str) -> None:
        stream = self._stream or sys.stderr
        try:
            sys.stdout.flush()
            print(line, file=stream, flush=True)
        except Exception:
            pass


def reachable(address: str, tries: int = 4, spacing_s: float = 0.25) -> bool:
    """Whether ``host:port`` accepts TCP connections ``tries`` times, ``spacing_s`` apart.

    One success proves little: a process being killed may still complete a handshake on
    its listening socket while the kernel closes its connections (the moment jax's client
    reports the loss).
    """
    host, _, port = address.rpartition(":")
    for i in range(tries):
        if i:
            time.sleep(spacing_s)
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2.0):
                pass
        except (OSError, ValueError):
            return False
    return True
