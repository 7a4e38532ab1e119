"""``launch --emulate --cut-islands STEP:+SECONDS``: cut the links between islands, then heal them.

Once any job reports step ``STEP`` (with ``--independent-islands``: any island's job), every
link between two islands is cut both ways for ``SECONDS``, then restored; links inside an
island stay up. The cut is a ``blackhole`` policy rule per ordered pair of island subnets in
the emulated router namespace (:func:`holmes_jax.cluster.netns.NetworkPlan.cut_commands`):
packets between islands are dropped silently, as on a real partition (peers see timeouts,
not refused connections), and open TCP connections survive the cut, as they would a
pulled cable that is plugged back in. Plain Python; no jax import.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from holmes_jax.core.errors import ConfigError

_CUT = re.compile(r"(-?\d+):\+(.+)")


@dataclass(frozen=True)
class Cut:
    """One ``--cut-islands``: from the first report of ``step``, ``seconds`` without links."""

    step: int
    seconds: float
    spec: str = ""


def parse_cut(spec: str) -> Cut:
    """``STEP:+SECONDS`` -> :class:`Cut`.

    Raises:
      ConfigError: a malformed spec, a step < 1, or seconds that are not a number > 0.
    """
    flag = f"--cut-islands={spec}"
    m = _CUT.fullmatch(spec)
    if not m:
        raise ConfigError(f"{flag}: must be STEP:+SECONDS (e.g. 40:+30)")
    step = int(m[1])
    if step < 1:
        raise ConfigError(f"{flag}: step {step} must be >= 1")
    try:
        seconds = float(m[2])
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or math.isinf(seconds):
        raise ConfigError(f"{flag}: '{m[2]}' must be a number of seconds > 0")
    return Cut(step, seconds, spec)


class IslandCutter:
    """Fires one :class:`Cut`: ``on_step`` from every job's step lines (any thread).

    ``cut()`` and ``restore()`` change the network (:class:`~holmes_jax.cluster.netns.
    EmulatedNetwork`'s ``cut_islands``/``restore_islands``); ``say`` prints a launcher line.
    """

    def __init__(
        self,
        cut: Cut,
        do_cut: Callable[[], None],
        do_restore: Callable[[], None],
        say: Callable[[str], None],
    ):
        self.cut = cut
        self._do_cut, self._do_restore, self._say = do_cut, do_restore, say
        self._lock = threading.Lock()
        self._fired = False
        self._timer: threading.Timer | None = None
        self._cut_at: float | None = None

    def on_step(self, step: int) -> None:
        """Cut the links the first time a step >= the cut's step is reported."""
        with self._lock:
            if self._fired or step < self.cut.step:
                return
            self._fired = True
            self._do_cut()
            self._cut_at = time.monotonic()
            self._say(
                f"--cut-islands {self.cut.spec}: links between islands cut at step {step} "
                f"for {self.cut.seconds:g} s"
            )
            self._timer = threading.Timer(self.cut.seconds, self.restore)
            self._timer.daemon = True
            self._timer.start()

    def restore(self) -> None:
        """Restore the links if they are cut (idempotent; also on the launcher's exit)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._cut_at is None:
                return
            took = time.monotonic() - self._cut_at
            self._cut_at = None
            self._do_restore()
            self._say(
                f"--cut-islands {self.cut.spec}: links between islands restored after {took:.1f} s"
            )
