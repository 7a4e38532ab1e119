"""This process's rows of each step's batch, read ahead of the step in a background thread.

:class:`Feed` reads the rows of steps ``s + 1 .. s + depth`` (``data.prefetch``) while step
``s`` runs, one step at a time in one thread (the reads are I/O: local page faults or a
remote store's byte ranges, which release the GIL). It counts the seconds the step waited
for rows that were not ready (``data_wait_s`` in the metrics) and the tokens of each
mixture source the batches held (``tokens_<name>``). A batch is a pure function of the
step (:class:`~holmes_jax.runtime.data.loader.BatchSampler`), so a prefetched step that is
never used costs its read and nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np


class Feed:
    """``get(step)``: the rows ``read(step)`` returns, read up to ``depth`` steps ahead.

    Args:
      read: ``(rows, counts)`` of one step (a pure function of it): this process's rows,
        and the batch's rows of each mixture source (or None: not a mixture).
      depth: steps read ahead (0: each read when asked).
      last: steps at or past it are never read ahead (the run ends there).
      before: the counts summed over the steps before a step (a resume's first), or None.
    """

    def __init__(
        self,
        read: Callable[[int], tuple[np.ndarray, np.ndarray | None]],
        depth: int,
        last: int,
        before: Callable[[int], np.ndarray] | None = None,
    ):
        self.read, self.depth, self.last, self.before = read, depth, last, before
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="read-ahead") if depth else None
        self.ahead: dict[int, Future] = {}
        self.waited = 0.0  # seconds the step waited for rows, since the last take()
        self.rows: np.ndarray | None = None  # each source's rows in steps 0 .. the last got
        self.counted = -1  # the last step counted (a step got twice counts once)

    def get(self, step: int) -> np.ndarray:
        """Step ``step``'s rows; the reads of the next steps are started."""
        began = time.perf_counter()
        future = self.ahead.pop(step, None)
        rows, counts = future.result() if future is not None else self.read(step)
        self.waited += time.perf_counter() - began
        if self.pool is not None:
            for stale in [s for s in self.ahead if s < step]:  # a jump back (a resume)
                self.ahead.pop(stale).cancel()
            for s in range(step + 1, min(step + 1 + self.depth, self.last)):
                if s not in self.ahead:
                    self.ahead[s] = self.pool.submit(self.read, s)
        if counts is not None and step != self.counted:
            if self.rows is None:  # the first step got (a resume's): steps before it count
                self.rows = self.before(step) if self.before else np.zeros_like(counts)
            self.rows, self.counted = self.rows + counts, step
        return rows

    def take_wait(self) -> float:
        """The seconds waited since the last call."""
        waited, self.waited = self.waited, 0.0
        return waited

    def close(self) -> None:
        """Drop the reads in flight (a read blocked on a store ends with the process)."""
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
