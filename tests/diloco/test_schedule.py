"""The round arithmetic of independent islands (:mod:`holmes_jax.diloco.schedule`): rounds
follow the steps where ``spmd`` takes an outer step, one fragment each, and the functions
that map rounds, steps and fragments agree with each other."""

import pytest

from holmes_jax.diloco.lanes import lane_key, piece_path, pieces
from holmes_jax.diloco.schedule import Schedule, key_fragment


def test_one_fragment_is_a_round_every_h_steps_after_the_warm_up():
    s = Schedule(inner_steps=5, warmup_steps=2)
    assert [s.step_of(r) for r in range(5)] == [0, 1, 2, 7, 12]
    assert [s.rounds_by(n) for n in (0, 1, 2, 7, 11, 12)] == [0, 1, 2, 3, 3, 4]
    assert [s.span(r) for r in (1, 2, 3, 4)] == [1, 1, 5, 5]
    assert {s.fragment(r) for r in range(3, 9)} == {0} and s.fragment(2) is None


@pytest.mark.parametrize("h,k,f", [(4, 0, 2), (7, 2, 3), (3, 1, 3), (10, 0, 4), (6, 3, 1)])
def test_rounds_steps_and_fragments_agree(h, k, f):
    """Walking the steps: a round closes exactly where a fragment is due, it carries that
    fragment, each fragment's spans add up to its steps, and step_of inverts rounds_by."""
    s = Schedule(inner_steps=h, warmup_steps=k, fragments=f)
    covered = dict.fromkeys(range(f), 0)  # fragment -> steps its rounds covered
    last = dict.fromkeys(range(f), 0)  # fragment -> the step of its last round
    for n in range(1, 8 * h + k):
        due, rnd = s.due(n), s.rounds_by(n)
        assert rnd - s.rounds_by(n - 1) == (1 if due else 0)
        if not due:
            continue
        assert s.step_of(rnd) == n
        if n <= k:  # warm-up: every fragment, one step each
            assert due == list(range(f)) and s.fragment(rnd) is None and s.span(rnd) == 1
            for g in range(f):
                covered[g], last[g] = covered[g] + 1, n
            continue
        (g,) = due
        assert s.fragment(rnd) == g
        covered[g] += s.span(rnd)
        last[g] = n
        assert covered[g] == last[g], (g, n)  # no step counted twice or missed
    assert len({s.offset(g) for g in range(f)}) == f


def test_a_key_names_its_fragment_and_pieces_cut_the_layers():
    assert key_fragment(lane_key(piece_path("blocks/fc_kernel", 2, 3), 1)) == 2
    assert key_fragment(lane_key("head/lm_kernel", 0)) == 0  # one fragment: no mark
    assert pieces("blocks/w", (5, 3), 1) == [("blocks/w", -1, -1)]
    assert pieces("blocks/w", (5, 3), 2) == [("blocks/w@0", 0, 3), ("blocks/w@1", 3, 5)]
    assert pieces("embed/wte", (9, 3), 3) == [("embed/wte@0", -1, -1)]
    assert pieces("head/lm_kernel", (3, 9), 3) == [("head/lm_kernel@2", -1, -1)]
