"""When independent islands sync what: rounds, steps and fragments, pure arithmetic.

With K = ``diloco.warmup_steps``, H = ``diloco.inner_steps`` and F = ``diloco.fragments``,
the outer sync's rounds are numbered 1, 2, … in the order of the steps they follow:

- rounds 1..K follow steps 1..K, one each, and carry every fragment (warm-up averaging);
- after them, fragment f is due after step n iff ``(n − K) mod H == o_f``, with offset
  ``o_f = ⌊f·H/F⌋`` (:func:`due_fragments`, as under ``spmd``), and each such step is one
  round carrying fragment f alone: round ``K + e`` (e >= 1) is fragment ``e mod F``, after
  step ``K + ⌊e/F⌋·H + o_{e mod F}``.

F = 1 is one round every H steps carrying the whole model. Every island derives a round's
fragment from its number, so a delta or a step whose keys are not its round's fragment is
refused (:meth:`~holmes_jax.diloco.messages.Expect.for_round`).

A lane key (:func:`~holmes_jax.diloco.lanes.lane_key`) names its fragment when F > 1,
``<path>@<f>#<lane>`` (:func:`key_fragment`), and is ``<path>#<lane>`` when F = 1.
"""

from __future__ import annotations

from dataclasses import dataclass


def due_fragments(
    steps_done: int, inner_steps: int, fragments: int, warmup_steps: int = 0
) -> list[int]:
    """The fragments whose outer step follows inner step ``steps_done`` (0: none). During
    the warm-up (``steps_done <= warmup_steps``) every fragment after every step (as plain
    averaging, :func:`in_warmup`); after it the H-step rounds count from step K."""
    if steps_done <= 0:
        return []
    if in_warmup(steps_done, warmup_steps):
        return list(range(fragments))
    phase = (steps_done - warmup_steps) % inner_steps
    return [f for f in range(fragments) if phase == (f * inner_steps) // fragments]


def in_warmup(steps_done: int, warmup_steps: int) -> bool:
    """Whether the outer steps after inner step ``steps_done`` are warm-up averaging."""
    return 0 < steps_done <= warmup_steps


def split_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[start, stop)`` ranges of ``range(n)``, the earlier ones
    taking the remainder (``parts <= n``)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for f in range(parts):
        stop = start + base + (f < extra)
        out.append((start, stop))
        start = stop
    return out


@dataclass(frozen=True)
class Schedule:
    """The round arithmetic of one run's ``diloco`` section (module doc)."""

    inner_steps: int = 1
    warmup_steps: int = 0
    fragments: int = 1

    @classmethod
    def of(cls, d) -> Schedule:
        """The schedule of a ``diloco`` section."""
        return cls(d.inner_steps, d.warmup_steps, d.fragments)

    def offset(self, fragment: int) -> int:
        """``o_f``: the step of fragment ``fragment``'s rounds inside each H."""
        return fragment * self.inner_steps // self.fragments

    def due(self, step: int) -> list[int]:
        """The fragments whose round follows step ``step`` (every one in the warm-up)."""
        return due_fragments(step, self.inner_steps, self.fragments, self.warmup_steps)

    def fragment(self, rnd: int) -> int | None:
        """The fragment round ``rnd`` carries; None: every fragment (a warm-up round)."""
        if rnd <= self.warmup_steps:
            return None
        return (rnd - self.warmup_steps) % self.fragments

    def step_of(self, rnd: int) -> int:
        """The step after which round ``rnd`` closes (0 for round 0)."""
        if rnd <= self.warmup_steps:
            return rnd
        cycles, fragment = divmod(rnd - self.warmup_steps, self.fragments)
        return self.warmup_steps + cycles * self.inner_steps + self.offset(fragment)

    def rounds_by(self, step: int) -> int:
        """The rounds closed by step ``step`` (the inverse of :meth:`step_of` at round
        steps)."""
        if step <= self.warmup_steps:
            return max(step, 0)
        since, h = step - self.warmup_steps, self.inner_steps
        done = since // h  # fragment 0: after H, 2H, …
        for f in range(1, self.fragments):
            o = self.offset(f)
            done += (since - o) // h + 1 if since >= o else 0
        return self.warmup_steps + done

    def span(self, rnd: int) -> int:
        """The inner steps round ``rnd``'s delta covers: since the fragment's previous
        round (since the warm-up, or since step 0, for its first)."""
        if rnd <= self.warmup_steps:
            return 1
        before = rnd - self.fragments
        return self.step_of(rnd) - self.step_of(max(before, self.warmup_steps))


def key_fragment(key: str) -> int:
    """The fragment of a lane key (module doc): ``<path>@<f>#<lane>`` -> f, else 0."""
    path = key.rpartition("#")[0] or key
    head, at, tail = path.rpartition("@")
    return int(tail) if at and tail.isdigit() else 0
