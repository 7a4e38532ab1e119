"""The re-plan trial's choice: the fastest measured candidate, whatever was predicted."""

from holmes_jax.runtime.replan_trial import fastest


def test_the_trial_picks_the_faster_measured_of_plans_whose_speeds_swap_their_predictions():
    predicted = [1.0, 1.1, 1.2]  # candidate 0 predicted fastest ...
    measured = {0: 3.8, 1: 0.9, 2: 1.3}  # ... candidate 1 runs fastest
    tried = []

    def measure(i):
        tried.append(i)
        return measured[i]

    best, times = fastest(predicted, measure)
    assert best == 1 and times == [3.8, 0.9, 1.3] and tried == [0, 1, 2]
    assert fastest([1.0, 1.1], lambda i: 2.0)[0] == 0  # a tie keeps the predicted faster
