"""Pipeline schedules as tables: for every tick and stage, which op on which micro-batch.

The engine (:mod:`holmes_jax.runtime.engine.pipeline`) runs one tick loop for every schedule and
only looks up these tables; the planner prices the same tables. One tick is at most one
op per stage (the sends and inboxes: :class:`Schedule`):

- ``IDLE``: nothing (a bubble; control flow skips it);
- ``FWD``: micro-batch ``mb`` through chunk ``chunk``, residuals kept in slot ``slot``;
- ``BWD``: backward from those residuals; under ``zb`` only the input gradient, with the
  weight-gradient half stashed in slot ``wslot``;
- ``WGT`` (``zb`` only): the deferred weight gradient from ``slot`` and ``wslot``; frees both.

Schedules (S stages, M micro-batches, :func:`make_schedule`):

- ``gpipe``: every forward, then every backward; M residual sets per stage.
- ``1f1b`` (PipeDream-flush): stage s runs min(S − s, M) warm-up forwards, then one
  backward and one forward alternately, then drains; at most S − s residual sets on stage s.
- ``interleaved`` (Narayanan et al. 2021): v chunks per device. Forwards visit micro-batches
  in groups of g = min(S, M) (M a multiple of g), chunk by chunk. The bubble shrinks about
  v-fold.
- ``zb`` (ZB-H1, Qi et al. 2023): 1F1B's order, the backward split in B and W
  (:func:`_zb_ticks`). With F = B = W the bubble is a third of 1F1B's.

Ticks are an order, not a timing; :mod:`holmes_jax.planner.step_time` prices each op. Pure NumPy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import SCHEDULES, check_pipeline

IDLE, FWD, BWD, WGT = 0, 1, 2, 3
OP_NAMES = {IDLE: "idle", FWD: "F", BWD: "B", WGT: "W"}


@dataclass(frozen=True)
class Schedule:
    """Tick tables, each ``[ticks, stages]`` int32, the buffer depths and the sends.

    With v chunks per device, chunk c of stage s is virtual stage ``c·S + s``. Stage S−1
    hands chunk c's output to stage 0's chunk c+1 (the ring wrap). A value made at tick t
    is sent at the end of tick t. ``xarr`` / ``garr`` name the inbox slot that receives it,
    or the scratch slot (index ``x_slots`` / ``g_slots``) when nothing arrives there.
    ``fwd_pairs[t]`` / ``bwd_pairs[t]`` list exactly the stage pairs that send at tick t, so
    each micro-batch crosses each boundary once each way.
    """

    name: str
    virtual: int  # chunks per device (v)
    op: np.ndarray  # IDLE / FWD / BWD / WGT
    mb: np.ndarray  # micro-batch (0 where IDLE)
    chunk: np.ndarray  # chunk of the stage (virtual stage chunk*S + s)
    slot: np.ndarray  # residual slot of (mb, chunk) on that stage
    wslot: np.ndarray  # zb: stash slot written by BWD, read by WGT
    xin: np.ndarray  # FWD: inbox slot holding its input activation
    gin: np.ndarray  # BWD: inbox slot holding its output gradient
    xarr: np.ndarray  # inbox slot an activation lands in at the end of tick t
    garr: np.ndarray  # inbox slot a gradient lands in at the end of tick t
    last: np.ndarray  # 1 where the op completes its chunk's weight gradients
    buffer_slots: int  # residual sets per stage (max over stages)
    stash_slots: int  # zb: weight-gradient stashes per stage (0 otherwise)
    x_slots: int  # activation inbox depth
    g_slots: int  # gradient inbox depth
    fwd_pairs: tuple = field(repr=False)  # per tick: ((src, dst), ...) activation sends
    bwd_pairs: tuple = field(repr=False)  # per tick: ((src, dst), ...) gradient sends

    @property
    def ticks(self) -> int:
        return self.op.shape[0]

    @property
    def stages(self) -> int:
        return self.op.shape[1]

    @property
    def microbatches(self) -> int:
        return int(self.mb.max()) + 1

    @property
    def split_backward(self) -> bool:
        """True when BWD is only the input-gradient half (zb)."""
        return self.name == "zb"

    def live_residuals(self) -> np.ndarray:
        """[stages]: the most (micro-batch, chunk) residual sets alive at once on each stage."""
        free = WGT if self.split_backward else BWD
        peak = np.zeros(self.stages, dtype=np.int64)
        for s in range(self.stages):
            live = 0
            for t in range(self.ticks):
                live += int(self.op[t, s] == FWD) - int(self.op[t, s] == free)
                peak[s] = max(peak[s], live)
        return peak

    def order(self, stage: int) -> list[tuple[int, int, int]]:
        """Stage ``stage``'s ops in execution order: ``(op, mb, chunk)``."""
        return [
            (int(self.op[t, stage]), int(self.mb[t, stage]), int(self.chunk[t, stage]))
            for t in range(self.ticks)
            if self.op[t, stage] != IDLE
        ]

    def bubble_fraction(self, durations: dict[int, float] | None = None) -> float:
        """Idle share of the stages' time when every op of a kind takes the same time.

        ``durations`` maps FWD / BWD / WGT to a time per chunk (default 1, 2, 0 for
        unsplit schedules and 1, 1, 1 for zb: F, B, W each a third of a layer's work with
        a backward twice a forward). The makespan comes from the tables' order with those
        durations (dependencies and order kept), not from the tick count.
        """
        if durations is None:
            durations = (
                {FWD: 1.0, BWD: 1.0, WGT: 1.0}
                if self.split_backward
                else {FWD: 1.0, BWD: 2.0, WGT: 0.0}
            )
        span = simulate_makespan(self, lambda s, op, c: durations[op])
        busy = sum(durations[op] for s in range(self.stages) for op, _, _ in self.order(s))
        return 1.0 - busy / (span * self.stages)

    def sends(self) -> np.ndarray:
        """[S, S] int: activations plus gradients sent from stage a to stage b per step."""
        n = np.zeros((self.stages, self.stages), np.int64)
        for pairs in (*self.fwd_pairs, *self.bwd_pairs):
            for a, b in pairs:
                n[a, b] += 1
        return n


def simulate_makespan(sched: Schedule, duration) -> float:
    """Time of the last op when each stage runs its table order back to back
    (:func:`simulate_events`)."""
    return max((end for *_, end in simulate_events(sched, duration)), default=0.0)


def simulate_events(sched: Schedule, duration) -> list[tuple[int, int, int, int, float, float]]:
    """Each stage's table order run back to back: ``(stage, op, mb, chunk, start, end)``.

    ``duration(stage, op, chunk)`` gives an op's time. An op starts when its stage is free
    and its input exists: F after the previous virtual stage's F of the same micro-batch,
    B after the next virtual stage's B (or its own F on the last virtual stage), W after
    its own B. Transfers are free here (the cost model adds them).
    """
    S, v = sched.stages, sched.virtual
    done: dict[tuple[int, int, int], float] = {}  # (op, mb, virtual stage) -> finish time
    free = [0.0] * S
    events = []
    for t in range(sched.ticks):  # the tables order ops so that inputs come first
        for s in range(S):
            op = int(sched.op[t, s])
            if op == IDLE:
                continue
            i, c = int(sched.mb[t, s]), int(sched.chunk[t, s])
            vs = c * S + s
            if op == FWD:
                ready = done[(FWD, i, vs - 1)] if vs > 0 else 0.0
            elif op == BWD:
                ready = done[(BWD, i, vs + 1)] if vs < S * v - 1 else done[(FWD, i, vs)]
            else:
                ready = done[(BWD, i, vs)]
            start = max(free[s], ready)
            free[s] = done[(op, i, vs)] = start + duration(s, op, c)
            events.append((s, op, i, c, start, free[s]))
    return events


# --------------------------------------------------------------------------- building


def make_schedule(name: str, stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Build and check the tables of ``name`` (one of :data:`SCHEDULES`).

    Raises:
      ConfigError: unknown name, non-positive sizes, or an interleaved micro-batch count that
        is not a multiple of min(stages, microbatches).
    """
    S, M, v = stages, microbatches, virtual_stages
    if S < 1 or M < 1 or v < 1:
        raise ConfigError(
            f"schedule: stages={S}, microbatches={M}, virtual_stages={v}: all must be >= 1"
        )
    if name not in SCHEDULES:
        raise ConfigError(f"parallel.schedule='{name}': must be one of {', '.join(SCHEDULES)}")
    if name == "interleaved" and S == 1 and v == 1:
        name = "1f1b"
    check_pipeline(name, S, v)
    if name == "zb":
        ops = _zb_ticks(S, M)
    else:
        ops = _ticks(_orders(name, S, M, v), S, v)
    sched = _tables(name, S, M, v, ops)
    _check(sched)
    return sched


def _orders(name: str, S: int, M: int, v: int) -> list[list[tuple[int, int, int]]]:
    """Per stage, the op order ``(op, mb, chunk)`` of an unsplit schedule."""
    if name == "gpipe":
        return [[(FWD, i, 0) for i in range(M)] + [(BWD, i, 0) for i in range(M)]] * S
    if name == "1f1b":
        v = 1
    g = min(S, M) if v > 1 else 1
    if M % g:
        raise ConfigError(
            f"parallel.microbatches={M}: the interleaved schedule needs a multiple of "
            f"min(stages, microbatches)={g}"
        )

    def visit(k: int, backward: bool) -> tuple[int, int]:  # k-th (mb, chunk) of a stage
        group, r = divmod(k, g * v)
        c = r // g
        return group * g + r % g, (v - 1 - c if backward else c)

    total = M * v
    orders = []
    for s in range(S):
        if v == 1:
            warm = min(S - s, M)
        else:
            warm = min(total, 2 * (S - s - 1) + (v - 1) * g)  # Megatron's interleaved warm-up
        fwd = [(FWD, *visit(k, False)) for k in range(total)]
        bwd = [(BWD, *visit(k, True)) for k in range(total)]
        order = fwd[:warm]
        for k in range(total - warm):
            if v == 1:  # 1F1B: backward, then the next forward
                order += [bwd[k], fwd[warm + k]]
            else:  # Megatron's interleaved steady state: forward, then backward
                order += [fwd[warm + k], bwd[k]]
        orders.append(order + bwd[total - warm :])
    return orders


def _ready(op, i, c, s, S, v, done, t) -> bool:
    """Whether (op, mb i, chunk c) on stage s may run at tick t (inputs sent before t)."""
    vs = c * S + s
    if op == FWD:
        return vs == 0 or done.get((FWD, i, vs - 1), t) < t
    if op == BWD:
        dep = (BWD, i, vs + 1) if vs < S * v - 1 else (FWD, i, vs)
        return done.get(dep, t) < t
    return done.get((BWD, i, vs), t) < t


def _ticks(orders, S: int, v: int) -> list[list[tuple[int, int, int] | None]]:
    """Place each stage's order on ticks: an op runs at the first tick its input exists."""
    pos = [0] * S
    done: dict[tuple[int, int, int], int] = {}
    ticks = []
    while any(pos[s] < len(orders[s]) for s in range(S)):
        t = len(ticks)
        row: list = [None] * S
        for s in range(S):
            if pos[s] < len(orders[s]) and _ready(*orders[s][pos[s]], s, S, v, done, t):
                row[s] = orders[s][pos[s]]
        for s, o in enumerate(row):
            if o is not None:
                pos[s] += 1
                done[(o[0], o[1], o[2] * S + s)] = t
        if all(o is None for o in row):
            raise RuntimeError(f"schedule deadlock at tick {t}: {pos}")
        ticks.append(row)
    return ticks


def _zb_ticks(S: int, M: int) -> list[list[tuple[int, int, int] | None]]:
    """ZB-H1: 1F1B's order of F and B, each B's W deferred into what would be bubbles.

    Stage s keeps at most s weight gradients pending (B done, W not yet): it runs W first
    when more are pending (unless its next op is a B that is ready: B is the critical
    path), else its next F/B once the input is there, else its oldest pending W. The last
    stage defers most, stage 0 none; in-flight micro-batches (F done, W not yet) stay
    <= S on every stage, 1F1B's peak. With F = B = W the idle time per stage is S - 1
    op-times, a third of 1F1B's 3(S - 1) (Qi et al. 2023, ZB-H1).
    """
    orders = _orders("1f1b", S, M, 1)
    done: dict[tuple[int, int, int], int] = {}
    pos = [0] * S
    pending: list[list[int]] = [[] for _ in range(S)]  # B done, W not yet
    ticks = []
    while any(pending[s] or pos[s] < len(orders[s]) for s in range(S)):
        t = len(ticks)
        row: list = [None] * S
        for s in range(S):
            nxt = orders[s][pos[s]] if pos[s] < len(orders[s]) else None
            ready = nxt is not None and _ready(*nxt, s, S, 1, done, t)
            if len(pending[s]) > s and not (ready and nxt[0] == BWD):
                row[s] = (WGT, pending[s][0], 0)
            elif ready:
                row[s] = nxt
            elif pending[s]:
                row[s] = (WGT, pending[s][0], 0)
        for s, o in enumerate(row):
            if o is None:
                continue
            op, i, _ = o
            done[(op, i, s)] = t
            if op == WGT:
                pending[s].pop(0)
            else:
                pos[s] += 1
                if op == BWD:
                    pending[s].append(i)
        if all(o is None for o in row):
            raise RuntimeError(f"zb schedule deadlock at tick {t}")
        ticks.append(row)
    return ticks


class _Slots:
    """Smallest-free-index allocator (a slot freed at tick t is reusable at tick t)."""

    def __init__(self):
        self.free: list[int] = []
        self.size = 0

    def take(self) -> int:
        if self.free:
            self.free.sort()
            return self.free.pop(0)
        self.size += 1
        return self.size - 1

    def give(self, k: int) -> None:
        self.free.append(k)


def _tables(name, S, M, v, ops) -> Schedule:
    """Tables, slots, inboxes and sends of a placed schedule ``ops[t][s]``."""
    T = len(ops)
    z = lambda: np.zeros((T, S), np.int32)  # noqa: E731
    op, mb, chunk, slot, wslot, xin, gin, last = (z() for _ in range(8))
    xarr, garr = -np.ones((T, S), np.int32), -np.ones((T, S), np.int32)
    split = name == "zb"
    res = [_Slots() for _ in range(S)]
    stash = [_Slots() for _ in range(S)]
    xbox = [_Slots() for _ in range(S)]
    gbox = [_Slots() for _ in range(S)]
    held: dict = {}  # (stage, mb, chunk) -> residual slot / stash slot / inbox slots
    fwd_pairs, bwd_pairs = [], []
    n_last = M  # the op of micro-batch M-1 completes a chunk's gradients
    for t in range(T):
        fp, bp = [], []
        for s in range(S):  # reads first: a slot read at tick t is free for tick t's arrival
            o = ops[t][s]
            if o is None:
                continue
            kind, i, c = o
            vs = c * S + s
            op[t, s], mb[t, s], chunk[t, s] = kind, i, c
            if kind == FWD:
                if vs > 0:
                    xin[t, s] = held.pop(("x", s, i, c))
                    xbox[s].give(xin[t, s])
                slot[t, s] = held[("r", s, i, c)] = res[s].take()
                if vs < S * v - 1:
                    fp.append((s, (s + 1) % S, i, c if s < S - 1 else c + 1))
            elif kind == BWD:
                if vs < S * v - 1:
                    gin[t, s] = held.pop(("g", s, i, c))
                    gbox[s].give(gin[t, s])
                slot[t, s] = held[("r", s, i, c)]
                if split:
                    wslot[t, s] = held[("w", s, i, c)] = stash[s].take()
                else:
                    res[s].give(held.pop(("r", s, i, c)))
                    last[t, s] = int(i == n_last - 1)
                if vs > 0:
                    bp.append((s, (s - 1) % S, i, c if s > 0 else c - 1))
            else:  # WGT
                slot[t, s] = held.pop(("r", s, i, c))
                wslot[t, s] = held.pop(("w", s, i, c))
                res[s].give(slot[t, s])
                stash[s].give(wslot[t, s])
                last[t, s] = int(i == n_last - 1)
        for _, dst, i, c in fp:  # lands at the end of tick t
            xarr[t, dst] = held[("x", dst, i, c)] = xbox[dst].take()
        for _, dst, i, c in bp:
            garr[t, dst] = held[("g", dst, i, c)] = gbox[dst].take()
        fwd_pairs.append(tuple((a, b) for a, b, _, _ in fp))
        bwd_pairs.append(tuple((a, b) for a, b, _, _ in bp))
    kx = max(1, max(b.size for b in xbox))
    kg = max(1, max(b.size for b in gbox))
    xarr[xarr < 0], garr[garr < 0] = kx, kg  # scratch slot
    return Schedule(
        name=name,
        virtual=v,
        op=op,
        mb=mb,
        chunk=chunk,
        slot=slot,
        wslot=wslot,
        xin=xin,
        gin=gin,
        xarr=xarr,
        garr=garr,
        last=last,
        buffer_slots=max(r.size for r in res),
        stash_slots=max(st.size for st in stash),
        x_slots=kx,
        g_slots=kg,
        fwd_pairs=tuple(fwd_pairs),
        bwd_pairs=tuple(bwd_pairs),
    )


def _check(sched: Schedule) -> None:
    """Every (op, mb, virtual stage) runs once, after its inputs; slots never clash."""
    S, T, v = sched.stages, sched.ticks, sched.virtual
    M = sched.microbatches
    when: dict[tuple[int, int, int], int] = {}
    for t in range(T):
        for s in range(S):
            if sched.op[t, s] != IDLE:
                key = (int(sched.op[t, s]), int(sched.mb[t, s]), int(sched.chunk[t, s]) * S + s)
                assert key not in when, (sched.name, "op twice", key)
                when[key] = t
    kinds = (FWD, BWD, WGT) if sched.split_backward else (FWD, BWD)
    assert len(when) == len(kinds) * M * S * v, (sched.name, "missing ops")
    for (kind, i, vs), t in when.items():
        if kind == FWD and vs > 0:
            assert when[(FWD, i, vs - 1)] < t, (sched.name, "fwd dep", i, vs)
        if kind == BWD:
            dep = (BWD, i, vs + 1) if vs < S * v - 1 else (FWD, i, vs)
            assert when[dep] < t, (sched.name, "bwd dep", i, vs)
        if kind == WGT:
            assert when[(BWD, i, vs)] < t, (sched.name, "wgt dep", i, vs)
    # A chunk's gradient completes with its last op on micro-batch M-1, after all others.
    done_kind = WGT if sched.split_backward else BWD
    for vs in range(S * v):
        assert max(when[(done_kind, i, vs)] for i in range(M)) == when[(done_kind, M - 1, vs)]
    # Buffers: a slot is written only when free and read back by its owner.
    for s in range(S):
        owner: dict[tuple[str, int], tuple[int, int]] = {}
        for t in range(T):
            kind, i, c = int(sched.op[t, s]), int(sched.mb[t, s]), int(sched.chunk[t, s])
            vs = c * S + s
            if kind == FWD:
                if vs > 0:
                    assert owner.pop(("x", int(sched.xin[t, s]))) == (i, c), (sched.name, "xin")
                assert ("r", int(sched.slot[t, s])) not in owner, (sched.name, "slot clash")
                owner[("r", int(sched.slot[t, s]))] = (i, c)
            elif kind == BWD:
                if vs < S * v - 1:
                    assert owner.pop(("g", int(sched.gin[t, s]))) == (i, c), (sched.name, "gin")
                assert owner[("r", int(sched.slot[t, s]))] == (i, c), (sched.name, "slot owner")
                if sched.split_backward:
                    assert ("w", int(sched.wslot[t, s])) not in owner, (sched.name, "stash")
                    owner[("w", int(sched.wslot[t, s]))] = (i, c)
                else:
                    owner.pop(("r", int(sched.slot[t, s])))
            elif kind == WGT:
                assert owner.pop(("r", int(sched.slot[t, s]))) == (i, c), (sched.name, "w res")
                assert owner.pop(("w", int(sched.wslot[t, s]))) == (i, c), (sched.name, "w st")
            # Arrivals at the end of tick t (from this tick's sends).
            for box, arr, pairs, size, step in (
                ("x", sched.xarr, sched.fwd_pairs, sched.x_slots, +1),
                ("g", sched.garr, sched.bwd_pairs, sched.g_slots, -1),
            ):
                srcs = [a for a, b in pairs[t] if b == s]
                assert (int(arr[t, s]) == size) == (not srcs), (sched.name, "arrival", box, t, s)
                if srcs:
                    a = srcs[0]
                    ai, ac = int(sched.mb[t, a]), int(sched.chunk[t, a])
                    nxt = ac * S + a + step  # the virtual stage the value is for
                    assert nxt // S * S + s == nxt, (sched.name, "wrong target", t, a, s)
                    assert (box, int(arr[t, s])) not in owner, (sched.name, "inbox clash", box)
                    owner[(box, int(arr[t, s]))] = (ai, nxt // S)
