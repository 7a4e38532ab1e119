"""Pipeline schedules as tables: for every tick and stage, which op on which microbatch.

Pure NumPy (no jax): the pipeline engine (:mod:`holmes_jax.runtime.pipeline`) runs the same SPMD
tick loop for every schedule and only looks up these tables. One tick is one op per stage:

- ``IDLE``: nothing (a bubble; costs no compute, control flow skips it);
- ``FWD``: forward of microbatch ``mb`` through the stage, residuals kept in buffer ``slot``;
- ``BWD``: backward of microbatch ``mb`` from the residuals in buffer ``slot``.

Every tick, each stage sends its forward output to stage s+1 and its input gradient to
stage s−1 (``ppermute``), so a value produced at tick t is available at tick t+1.

Schedules (S stages, M microbatches; both take 2(M + S − 1) ticks):

- ``gpipe``: all forwards (stage s runs microbatch i at tick i + s), then all backwards;
  M residual sets live per stage.
- ``1f1b`` (PipeDream-flush): stage s runs K = S − s warm-up forwards, then alternates one
  backward and one forward, then drains; at most S − s residual sets live on stage s.
  F(i) at tick i + s for i < K, else 2i + s; B(i) at tick 2S − 1 − s + 2i.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IDLE, FWD, BWD = 0, 1, 2


@dataclass(frozen=True)
class Schedule:
    """Tick tables, each ``[ticks, stages]`` int32, and the residual buffer depth."""

    name: str
    op: np.ndarray  # IDLE / FWD / BWD
    mb: np.ndarray  # microbatch index (0 where IDLE)
    slot: np.ndarray  # residual-buffer slot of that microbatch on that stage
    buffer_slots: int  # residual sets each stage must hold (max over stages)

    @property
    def ticks(self) -> int:
        return self.op.shape[0]

    @property
    def stages(self) -> int:
        return self.op.shape[1]

    def live_residuals(self) -> np.ndarray:
        """[stages]: the most microbatches whose residuals are alive at once on each stage."""
        peak = np.zeros(self.stages, dtype=np.int64)
        for s in range(self.stages):
            live = 0
            for t in range(self.ticks):
                if self.op[t, s] == FWD:
                    live += 1
                    peak[s] = max(peak[s], live)
                elif self.op[t, s] == BWD:
                    live -= 1
        return peak


def make_schedule(name: str, stages: int, microbatches: int) -> Schedule:
    """Build and check the tables for ``gpipe`` or ``1f1b``.

    Raises:
      ValueError: unknown name or non-positive sizes.
    """
    S, M = stages, microbatches
    if S < 1 or M < 1:
        raise ValueError(f"stages={S}, microbatches={M}: both must be >= 1")
    ticks = 2 * (M + S - 1)
    op = np.zeros((ticks, S), np.int32)
    mb = np.zeros((ticks, S), np.int32)
    slot = np.zeros((ticks, S), np.int32)

    def put(t, s, kind, i, k):
        assert op[t, s] == IDLE, f"{name}: two ops on stage {s} at tick {t}"
        op[t, s], mb[t, s], slot[t, s] = kind, i, k

    if name == "gpipe":
        for s in range(S):
            for i in range(M):
                put(i + s, s, FWD, i, i)
                put(M + S - 1 + (S - 1 - s) + i, s, BWD, i, i)
        depth = M
    elif name == "1f1b":
        for s in range(S):
            k = S - s  # in-flight limit on this stage
            for i in range(M):
                put(i + s if i < k else 2 * i + s, s, FWD, i, i % k)
                put(2 * S - 1 - s + 2 * i, s, BWD, i, i % k)
        depth = min(S, M)
    else:
        raise ValueError(f"schedule '{name}': must be one of gpipe, 1f1b")
    sched = Schedule(name, op, mb, slot, depth)
    _check(sched)
    return sched


def _check(sched: Schedule) -> None:
    """Dependencies hold, slots never clash, and the 2-slot forward inbox suffices."""
    S, T = sched.stages, sched.ticks
    when = {}
    for t in range(T):
        for s in range(S):
            if sched.op[t, s] != IDLE:
                when[(int(sched.op[t, s]), s, int(sched.mb[t, s]))] = t
    M = 1 + max(i for (_, _, i) in when)
    for s in range(S):
        for i in range(M):
            f, b = when[(FWD, s, i)], when[(BWD, s, i)]
            assert f < b, (sched.name, s, i)
            if s > 0:
                assert when[(FWD, s - 1, i)] < f, (sched.name, "fwd dep", s, i)
            if s < S - 1:
                assert when[(BWD, s + 1, i)] < b, (sched.name, "bwd dep", s, i)
                # Input gradients are not buffered: B(i) on s runs right after s+1's.
                assert when[(BWD, s + 1, i)] == b - 1, (sched.name, "bwd arrival", s, i)
    # Residual slots: a slot is reused only after its microbatch's backward.
    for s in range(S):
        owner: dict[int, int] = {}
        for t in range(T):
            k, i = int(sched.slot[t, s]), int(sched.mb[t, s])
            if sched.op[t, s] == FWD:
                assert k not in owner, (sched.name, "slot clash", s, t)
                owner[k] = i
            elif sched.op[t, s] == BWD:
                assert owner.pop(k) == i, (sched.name, "slot owner", s, t)
    # Forward inbox: activation i arrives at F(i, s-1) + 1 and waits in inbox slot i % 2.
    for s in range(1, S):
        for i in range(M):
            arrive, use = when[(FWD, s - 1, i)] + 1, when[(FWD, s, i)]
            if i + 2 < M:
                assert when[(FWD, s - 1, i + 2)] + 1 > use, (sched.name, "inbox overwrite", s, i)
            assert arrive <= use
