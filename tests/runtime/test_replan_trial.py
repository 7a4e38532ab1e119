"""The re-plan trial's choice: the fastest measured candidate, whatever was predicted."""

from holmes_jax.runtime.replan_trial import GIVE_UP, fastest


def test_the_trial_picks_the_faster_measured_of_plans_whose_speeds_swap_their_predictions():
    predicted = [1.0, 1.1, 1.2]  # candidate 0 predicted fastest ...
    measured = {0: 3.8, 1: 0.9, 2: 1.3}  # ... candidate 1 runs fastest
    tried = []

    def measure(i, bound):
        tried.append((i, bound))
        return measured[i]

    best, times = fastest(predicted, measure)
    assert best == 1 and times == [3.8, 0.9, 1.3]
    # each candidate may stop once it is GIVE_UP times the fastest before it
    assert tried == [(0, float("inf")), (1, 3.8 * GIVE_UP), (2, 0.9 * GIVE_UP)]
    assert fastest([1.0, 1.1], lambda i, bound: 2.0)[0] == 0  # a tie keeps the predicted faster
