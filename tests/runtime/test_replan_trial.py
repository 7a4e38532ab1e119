"""The re-plan trial's choice: the fastest measured candidate, whatever was predicted."""

import json

import pytest

from holmes_jax.runtime.replan_trial import GIVE_UP, MEASURED_VAR, fastest, measured_ahead


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


PLANS = ["stage=3 data=2 m=16", "stage=3 tensor=2 m=16"]


def test_times_measured_ahead_are_used_only_for_exactly_these_candidates():
    """The launcher's times (``launch --warm-failures``) replace a trial when they measured
    these candidates, in this order; anything else is one clause and the trial runs."""
    good = json.dumps({"plans": PLANS, "step_s": [2.66, 0.585]})
    assert measured_ahead(good, PLANS) == ([2.66, 0.585], "")
    assert measured_ahead(None, PLANS) == (None, "")
    assert measured_ahead("", PLANS) == (None, "")


@pytest.mark.parametrize(
    "raw, why",
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        (json.dumps({"plans": PLANS, "step_s": [1.0]}), "2 plans and 1 step times"),
        (json.dumps({"plans": PLANS, "step_s": [1.0, -1]}), "finite and > 0"),
        (json.dumps({"plans": PLANS[::-1], "step_s": [1.0, 2.0]}), "other plans"),
        (json.dumps({"plans": PLANS, "step_s": [1.0, 2.0], "x": 1}), "unknown field(s) ['x']"),
    ],
)
def test_times_measured_ahead_that_do_not_fit_are_named(raw, why):
    times, clause = measured_ahead(raw, PLANS)
    assert times is None and clause.startswith(f"{MEASURED_VAR} ignored") and why in clause


def test_measure_is_a_one_line_error_without_compile_only_or_a_failure(capsys, tmp_path):
    from holmes_jax import train

    assert train.main(["--set", "train.steps=5", "--measure"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --measure: only with --compile-only (it trains nothing)\n"
    cache = f"train.compilation_cache={tmp_path}"
    assert train.main(["--set", cache, "--compile-only", "--measure"]) == 2
    assert capsys.readouterr().err == (
        "error: --measure: times the candidate plans of a failure's survivors; "
        "parallel.exclude_hosts is empty\n"
    )
