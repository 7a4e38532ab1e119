"""What islands send each other, parsed into typed values and checked before any state.

Every field that arrives from a peer is checked here (:class:`Expect` says against what),
and a message that breaks a rule raises :class:`Refused` naming the field, the value and
the rule, in one line. The protocol (:mod:`holmes_jax.diloco.rounds`) only ever sees the
typed values.

The rules:

- the sender is a configured island and the one the request's authenticated
  ``X-Island`` names; ``island`` fields and member lists name configured islands;
- ``round`` is an integer in ``[0, 2**31)``; ``lineage`` is ``root`` or
  ``<island>@<round>`` (a fork by a configured island), ``parent`` one of those or empty;
- a delta's arrays are exactly its round's keys (the lane's, or with ``diloco.fragments``
  > 1 those of the round's fragment, :mod:`~holmes_jax.diloco.schedule`), each of the
  lane's shape and of the wire dtype of ``diloco.outer_dtype``; its scales are one per
  key, finite and positive (``int8``; exactly 1 for ``fp32`` and ``bf16``, whose payload
  carries its own range); the decoded values are finite. A ``sparse`` delta holds each
  key's four parts, each checked by :func:`~holmes_jax.diloco.sparse.check` (sizes,
  counts of ``sparse_k`` a whole chunk, positions increasing inside their chunk, scales
  that decode finite);
- a delta's ``tokens`` is an integer in ``[0, round_tokens]``, where ``round_tokens`` is
  the tokens of the whole global batch over ``diloco.inner_steps`` steps: no island's
  share of one round can be larger;
- a join's ``tokens`` and ``fork_tokens`` are integers in ``[0, 2**62)`` (their weight in a
  merge is bounded by :meth:`holmes_jax.diloco.rounds.Rounds.merge`), and its global
  model, when it sends one, is the lane's keys and shapes in finite fp32;
- a result from a leader: its step's ``lr`` and ``mu`` equal this island's own
  ``diloco.outer_lr`` and ``outer_momentum``, its arrays are the lane's in the wire dtype
  with finite values (a sparse run's step: the islands' deltas relayed as they were sent,
  each checked as a delta is, with their tokens as ``weights``; or sparse parts at most a
  chunk's length each; or dense in ``int8`` / ``fp32``, as ``encoding`` says); a whole
  state is the lane's keys twice (``g/``, ``m/``), finite fp32.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import numpy as np

from holmes_jax.diloco import sparse
from holmes_jax.diloco.codec import WIRE_DTYPES, decode
from holmes_jax.diloco.schedule import Schedule, key_fragment
from holmes_jax.diloco.sparse import PARTS, SEP, Sparse

Shards = dict[str, np.ndarray]
ROUND_MAX = 1 << 31
TOKENS_MAX = 1 << 62
LINEAGE = re.compile(r"(\d{1,9})@(\d{1,10})")
BF16_EXPONENT = np.uint16(0x7F80)  # a bf16's exponent bits: all ones for inf and NaN
BITS_PIECE = 1 << 22  # bf16 values checked at a time (:func:`finite`), 8 MiB


class Refused(Exception):
    """A message that breaks a rule (module doc); ``str(err)`` is the one-line reason."""


@dataclass(frozen=True)
class Expect:
    """What this island accepts from its peers on one lane.

    Attributes:
      shapes: the lane's keys and the shape of each (this island's own global model's).
      outer_dtype: ``diloco.outer_dtype``.
      islands: the configured islands' indices.
      round_tokens: the most tokens one island may count for one round.
      lr, mu: this island's outer learning rate and momentum.
      sparse: the sparse format's parameters (``outer_dtype`` sparse).
      schedule: which fragment each round carries.
    """

    shapes: dict[str, tuple[int, ...]]
    outer_dtype: str
    islands: frozenset[int]
    round_tokens: int
    lr: float
    mu: float
    sparse: Sparse | None = None
    schedule: Schedule = Schedule()

    def for_round(self, rnd: int) -> Expect:
        """What a delta or step of round ``rnd`` holds: the lane's keys of the round's
        fragment (every key in a warm-up round, or with one fragment)."""
        fragment = self.schedule.fragment(rnd)
        if fragment is None or self.schedule.fragments == 1:
            return self
        shapes = {k: s for k, s in self.shapes.items() if key_fragment(k) == fragment}
        return replace(self, shapes=shapes)

    @property
    def dense_dtype(self) -> str:
        """The dense dtype of a step: ``outer_dtype``, or for sparse the step's other
        encoding (``int8`` up to 8 value bits, else ``fp32``)."""
        if self.outer_dtype != "sparse":
            return self.outer_dtype
        return "int8" if self.sparse.step_bits <= 8 else "fp32"

    def delta_entries(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """``(name, dtype, shape)`` of each array of a delta (a sparse delta's parts)."""
        if self.outer_dtype != "sparse":
            name = WIRE_DTYPES[self.outer_dtype].name
            return [(k, name, shape) for k, shape in self.shapes.items()]
        joined: dict[str, tuple[str, int]] = {}  # part -> dtype, length (sparse.join)
        for shape in self.shapes.values():
            n = math.prod(shape)
            counts = self.sparse.counts(n)
            parts = sparse.part_shapes(n, self.sparse, counts, self.sparse.bits)
            for p, (dtype, (size,)) in parts.items():
                joined[p] = (dtype, joined.get(p, (dtype, 0))[1] + size)
        return [(p, dtype, (size,)) for p, (dtype, size) in joined.items()]


@dataclass(frozen=True)
class Delta:
    """An island's outer gradient for round ``round`` (decoded, fp32), or its abstention."""

    island: int
    round: int
    lineage: str
    tokens: int
    dead: frozenset[int]
    average: bool
    values: Shards | None  # None: abstains (its inner steps were not finite)
    parts: Shards | None = None  # a sparse delta's checked arrays, as sent (to relay)


@dataclass(frozen=True)
class Join:
    """A request to join this island's group (module doc of :mod:`~holmes_jax.diloco.sync`)."""

    island: int
    lineage: str
    parent: str
    fork_tokens: int
    tokens: int
    weight: bool  # merge the sender's global model (another lineage's)
    next: bool  # register for the open round's result (a restart or a late island)
    glob: Shards | None


@dataclass(frozen=True)
class Step:
    """A round's result as a step: the decoded mean delta and the round's meta."""

    round: int
    tokens: int
    average: bool
    leader: int
    members: frozenset[int]
    values: Shards  # decoded fp32


@dataclass(frozen=True)
class State:
    """A whole outer state: global model, momentum and the history that names it."""

    round: int
    tokens: int
    lineage: str
    parent: str
    fork_tokens: int
    leader: int
    members: frozenset[int]
    merged: frozenset[str]
    glob: Shards
    mom: Shards


def _int(meta: dict, key: str, lo: int, hi: int) -> int:
    value = meta.get(key)
    if type(value) is not int or not lo <= value < hi:
        raise Refused(f"{key}={str(value)[:40]}: must be an integer in [{lo}, {hi})")
    return value


def _bool(meta: dict, key: str) -> bool:
    value = meta.get(key, False)
    if type(value) is not bool:
        raise Refused(f"{key}={str(value)[:40]}: must be true or false")
    return value


def _island(meta: dict, key: str, ex: Expect) -> int:
    value = meta.get(key)
    if type(value) is not int or value not in ex.islands:
        raise Refused(f"{key}={str(value)[:40]}: not an island of the run {sorted(ex.islands)}")
    return value


def _islands(meta: dict, key: str, ex: Expect, empty: bool = True) -> frozenset[int]:
    value = meta.get(key)
    ok = isinstance(value, list) and all(type(i) is int and i in ex.islands for i in value)
    if not ok or (not empty and not value):
        raise Refused(f"{key}={str(value)[:60]}: must list islands of the run {sorted(ex.islands)}")
    return frozenset(value)


def check_lineage(value, ex: Expect, key: str = "lineage", empty: bool = False) -> str:
    """``value`` if it is ``root`` or ``<island>@<round>`` with a configured island."""
    if value == "" and empty:
        return value
    if value == "root":
        return value
    match = LINEAGE.fullmatch(value) if isinstance(value, str) else None
    if match is None or int(match[1]) not in ex.islands or int(match[2]) >= ROUND_MAX:
        raise Refused(f"{key}={str(value)[:40]}: must be 'root' or '<island>@<round>'")
    return value


def fork_round(lineage: str) -> int:
    """The round at which ``lineage`` forked (0 for ``root``)."""
    match = LINEAGE.fullmatch(lineage)
    return int(match[2]) if match else 0


def _sender(meta: dict, sender: int, ex: Expect) -> int:
    island = _island(meta, "island", ex)
    if island != sender:
        raise Refused(f"island={island}: the request was sent by island {sender}")
    return island


def _exact_keys(arrays: Shards, want: set[str]) -> None:
    if arrays.keys() != want:
        missing, extra = sorted(want - arrays.keys()), sorted(arrays.keys() - want)
        raise Refused(
            f"arrays: {len(missing)} of the lane's keys missing {missing[:2]}, "
            f"{len(extra)} unknown {[k[:40] for k in extra[:2]]}"
        )


def _shaped(arrays: Shards, ex: Expect, dtype: np.dtype, prefix: str = "") -> None:
    _exact_keys(arrays, {prefix + k for k in ex.shapes})
    for k, shape in ex.shapes.items():
        a = arrays[prefix + k]
        if a.shape != shape or a.dtype != dtype:
            raise Refused(
                f"array {prefix + k}: {a.dtype.name}{list(a.shape)}, the lane's is "
                f"{dtype.name}{list(shape)}"
            )


def finite(x: np.ndarray) -> bool:
    """Whether every value of ``x`` is finite: a float array (a min and a max: NaN and
    inf propagate), or bf16 as its ``uint16`` bits (the wire's; all-ones exponent bits are
    inf or NaN), read in cache-sized pieces; int8 always is."""
    if x.size == 0 or x.dtype.kind == "i":
        return True
    if x.dtype == np.uint16:
        flat, piece = x.reshape(-1), np.empty(min(x.size, BITS_PIECE), np.uint16)
        for at in range(0, flat.size, BITS_PIECE):
            part = piece[: min(BITS_PIECE, flat.size - at)]
            np.bitwise_and(flat[at : at + BITS_PIECE], BF16_EXPONENT, out=part)
            if part.max() == BF16_EXPONENT:
                return False
        return True
    return bool(np.isfinite(x.min()) and np.isfinite(x.max()))


def _finite(arrays: Shards, what: str) -> None:
    for k, v in arrays.items():
        if not finite(v):
            raise Refused(f"{what} {k}: holds non-finite values")


def _decoded(meta: dict, arrays: Shards, ex: Expect, step: bool = False) -> Shards:
    """A delta's (or with ``step``, a leader's step's) arrays, checked and decoded: the
    lane's arrays in the wire dtype with ``meta['scales']``, or a sparse delta's parts; a
    sparse run's step in either encoding (``meta['encoding']``)."""
    dtype = ex.outer_dtype
    if dtype == "sparse":
        encoding = meta.get("encoding") if step else "sparse"
        if encoding == "sparse":
            return _sparse_decoded(arrays, ex, step)
        if encoding != ex.dense_dtype:
            raise Refused(
                f"encoding={str(encoding)[:40]}: a step of this run is sparse or {ex.dense_dtype}"
            )
        dtype = encoding
    _shaped(arrays, ex, WIRE_DTYPES[dtype])
    scales = meta.get("scales")
    if not isinstance(scales, dict) or scales.keys() != ex.shapes.keys():
        raise Refused("scales: must hold one scale for each of the lane's keys")
    for k, s in scales.items():
        if type(s) not in (int, float) or not (math.isfinite(s) and s > 0):
            raise Refused(f"scales[{k}]={str(s)[:40]}: must be finite and > 0")
        if dtype != "int8" and s != 1:
            raise Refused(f"scales[{k}]={s}: must be 1 for outer dtype {dtype}")
        if s > np.finfo(np.float32).max / 127:
            raise Refused(f"scales[{k}]={s}: decodes past fp32's range")
    if dtype != "int8":  # int8: |q·s| <= 127·s, finite by the scale's bound
        _finite(arrays, "delta")  # bf16: its bits, before the decode doubles them
    return {k: decode(arrays[k], scales[k]) for k in ex.shapes}


def _sparse_decoded(arrays: Shards, ex: Expect, step: bool, who: str = "") -> Shards:
    """A sparse delta's or step's four arrays (:func:`~holmes_jax.diloco.sparse.join`),
    cut into each key's parts, checked and decoded; ``who`` names whose they are."""
    sp = ex.sparse
    bits = sp.step_bits if step else sp.bits
    _exact_keys(arrays, set(PARTS))
    by_key = sparse.split(arrays, ex.shapes, sp, bits)
    if isinstance(by_key, str):
        raise Refused(f"{who}arrays {by_key}")
    out = {}
    for k, shape in ex.shapes.items():
        why = sparse.check(by_key[k], shape, sp, bits, delta=not step)
        if why:
            raise Refused(f"{who}array {k}{SEP}{why}")
        out[k] = sparse.decode(by_key[k], shape, sp, bits)
    return out


def parse_delta(meta: dict, arrays: Shards, sender: int, ex: Expect) -> Delta:
    """A ``POST /delta`` body, checked (module doc).

    Raises:
      Refused: a rule broken (the one-line reason).
    """
    island = _sender(meta, sender, ex)
    rnd = _int(meta, "round", 1, ROUND_MAX)
    abstain = _bool(meta, "abstain")
    values = None
    if not abstain:
        values = _decoded(meta, arrays, ex.for_round(rnd))
    elif arrays:
        raise Refused("abstain=true: carries no arrays")
    sparse_parts = dict(arrays) if ex.outer_dtype == "sparse" and not abstain else None
    tokens = _int(meta, "tokens", 0, ex.round_tokens + 1)
    if abstain and tokens:
        raise Refused(f"tokens={tokens}: an abstaining island counts none")
    return Delta(
        island=island,
        round=rnd,
        lineage=check_lineage(meta.get("lineage"), ex),
        tokens=tokens,
        dead=_islands(meta, "dead", ex),
        average=_bool(meta, "average"),
        values=values,
        parts=sparse_parts,
    )


def weighted_mean(values: dict[int, Shards], weights: dict[int, int], keys) -> Shards:
    """``Σ w_i·v_i / Σ w_i`` on each of ``keys`` in fp32 (all weights zero: the plain
    mean), in island order: the leader and every member that relays compute it alike."""
    order, total = sorted(values), sum(weights[i] for i in values)
    out = {}
    for k in keys:
        if total > 0:
            out[k] = sum(weights[i] * values[i][k] for i in order) / total
        else:
            out[k] = sum(values[i][k] for i in order) / len(order)
        out[k] = out[k].astype(np.float32)
    return out


def relay_key(island: int, part: str) -> str:
    """The name of island ``island``'s array ``part`` (of its delta's four) in a relayed
    step."""
    return f"i{island}/{part}"


def _relayed(meta: dict, arrays: Shards, ex: Expect, me: int, own: Shards | None) -> Shards:
    """A ``relay`` step: the deltas of the islands ``meta['weights']`` names, as they sent
    them (island ``me``'s own left out: ``own``, the values it sent), each checked and
    decoded, then their weighted mean (:func:`weighted_mean`)."""
    weights = meta.get("weights")
    ok = isinstance(weights, dict) and 0 < len(weights) <= len(ex.islands)
    if ok:
        try:
            weights = {int(i): w for i, w in weights.items()}
        except ValueError:
            ok = False
    bad = lambda i, w: i not in ex.islands or type(w) is not int or w < 0  # noqa: E731
    if not ok or any(bad(i, w) for i, w in weights.items()):
        raise Refused("weights: must map islands of the run to their tokens")
    values, wanted = {}, set()
    for i in weights:
        if i == me:
            if own is None or own.keys() != ex.shapes.keys():
                raise Refused(f"weights: name island {me}, which sent nothing this round")
            values[i] = own
            continue
        wanted |= {relay_key(i, p) for p in PARTS}
    _exact_keys(arrays, wanted)
    for i in weights:
        if i not in values:
            parts = {p: arrays[relay_key(i, p)] for p in PARTS}
            values[i] = _sparse_decoded(parts, ex, False, f"island {i}'s ")
    return weighted_mean(values, weights, ex.shapes)


def parse_join(meta: dict, arrays: Shards, sender: int, ex: Expect) -> Join:
    """A ``POST /join`` body, checked (module doc).

    Raises:
      Refused: a rule broken (the one-line reason).
    """
    island = _sender(meta, sender, ex)
    weight = bool(_int(meta, "weight", 0, 2))
    glob = None
    if weight:
        _shaped(arrays, ex, np.dtype(np.float32))
        _finite(arrays, "global")
        glob = dict(arrays)
    elif arrays:
        raise Refused("weight=0: a join without weight carries no arrays")
    return Join(
        island=island,
        lineage=check_lineage(meta.get("lineage"), ex),
        parent=check_lineage(meta.get("parent"), ex, "parent", empty=True),
        fork_tokens=_int(meta, "fork_tokens", 0, TOKENS_MAX),
        tokens=_int(meta, "tokens", 0, TOKENS_MAX),
        weight=weight,
        next=_bool(meta, "next"),
        glob=glob,
    )


def parse_step(
    meta: dict, arrays: Shards, ex: Expect, me: int = -1, own: Shards | None = None
) -> Step:
    """A leader's ``kind: step`` result, checked (module doc); a sparse run's ``relay``
    step is decoded with island ``me``'s ``own`` delta, the values it sent.

    Raises:
      Refused: a rule broken (the one-line reason).
    """
    for key, mine in (("lr", ex.lr), ("mu", ex.mu)):
        if meta.get(key) != mine:
            raise Refused(f"{key}={str(meta.get(key))[:40]}: this island's outer {key} is {mine}")
    rnd = _int(meta, "round", 1, ROUND_MAX)
    return Step(
        round=rnd,
        tokens=_int(meta, "tokens", 0, TOKENS_MAX),
        average=_bool(meta, "average"),
        leader=_island(meta, "leader", ex),
        members=_islands(meta, "members", ex, empty=False),
        values=(
            _relayed(meta, arrays, ex.for_round(rnd), me, own)
            if ex.outer_dtype == "sparse" and meta.get("encoding") == "relay"
            else _decoded(meta, arrays, ex.for_round(rnd), step=True)
        ),
    )


def parse_state(meta: dict, arrays: Shards, ex: Expect) -> State:
    """A whole outer state (a result, a join's reply, or a saved file), checked.

    Raises:
      Refused: a rule broken (the one-line reason).
    """
    _exact_keys(arrays, {p + k for p in ("g/", "m/") for k in ex.shapes})
    glob = {k[2:]: v for k, v in arrays.items() if k.startswith("g/")}
    mom = {k[2:]: v for k, v in arrays.items() if k.startswith("m/")}
    for part in (glob, mom):
        _shaped(part, ex, np.dtype(np.float32))
        _finite(part, "state")
    merged = meta.get("merged")
    if not isinstance(merged, list) or len(merged) > 1024:
        raise Refused("merged: must be a list of lineages")
    return State(
        round=_int(meta, "round", 0, ROUND_MAX),
        tokens=_int(meta, "tokens", 0, TOKENS_MAX),
        lineage=check_lineage(meta.get("lineage"), ex),
        parent=check_lineage(meta.get("parent"), ex, "parent", empty=True),
        fork_tokens=_int(meta, "fork_tokens", 0, TOKENS_MAX),
        leader=_island(meta, "leader", ex),
        members=_islands(meta, "members", ex, empty=False),
        merged=frozenset(check_lineage(m, ex, "merged") for m in merged),
        glob={k: np.array(v) for k, v in glob.items()},
        mom={k: np.array(v) for k, v in mom.items()},
    )


def parse_status(status, ex: Expect) -> dict:
    """A ``GET /status`` reply, checked: ``island``, ``round``, ``leader``, ``lineage``,
    ``ready``, ``tokens``.

    Raises:
      Refused: a rule broken (the one-line reason).
    """
    if not isinstance(status, dict):
        raise Refused("status: must be an object")
    return {
        "island": _island(status, "island", ex),
        "round": _int(status, "round", 0, ROUND_MAX),
        "leader": _island(status, "leader", ex),
        "lineage": check_lineage(status.get("lineage"), ex),
        "ready": _bool(status, "ready"),
        "tokens": _int(status, "tokens", 0, TOKENS_MAX),
    }


def parse_round(query: dict[str, list[str]], key: str = "round") -> int:
    """The round of a ``/result`` or ``/ack`` query.

    Raises:
      Refused: absent or not an integer in range.
    """
    values = query.get(key, [])
    if len(values) != 1 or not values[0].isdigit() or len(values[0]) > 10:
        raise Refused(f"{key}={str(values)[:40]}: the query must name one round")
    value = int(values[0])
    if value >= ROUND_MAX:
        raise Refused(f"{key}={value}: must be < {ROUND_MAX}")
    return value
