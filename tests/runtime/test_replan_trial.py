"""The re-plan trial's choice: the fastest measured candidate, whatever was predicted."""

import json
import os

import pytest

from holmes_jax.core.config import load_config
from holmes_jax.runtime.replan_trial import GIVE_UP, fastest, measured_ahead
from holmes_jax.runtime.rundir import measured
from tests.common import ROOT


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
MESH = "meshes/cpu8-two-islands.yaml"


def survivors(*lost, **sets):
    """The quickstart config on the two-island mesh without ``lost`` (and ``sets``)."""
    overrides = [f"parallel.mesh={os.path.join(ROOT, MESH)}"]
    if lost:
        overrides.append(f"parallel.exclude_hosts=[{','.join(lost)}]")
    overrides += [f"{k.replace('__', '.')}={v}" for k, v in sets.items()]
    return load_config(os.path.join(ROOT, "configs", "quickstart.yaml"), overrides)


def test_times_kept_in_the_cache_serve_the_same_run_s_survivors_only(tmp_path):
    """``--measure`` keeps each failure's times; a restart of those survivors finds its own
    case, the full job finds every case, another run (its step count) finds none."""
    measured.save(str(tmp_path), survivors("roce-1"), PLANS, [0.585, 2.66])
    measured.save(str(tmp_path), survivors("roce-0", "roce-1"), ["data=4"], [0.375])
    case, ignored = measured.load(str(tmp_path), survivors("roce-1", train__run_dir="elsewhere"))
    assert case == {"excluded": ["roce-1"], "plans": PLANS, "step_s": [0.585, 2.66]}
    assert ignored == []
    every, _ = measured.load_all(str(tmp_path), survivors())
    assert sorted(c["step_s"][0] for c in every) == [0.375, 0.585]
    assert measured.load(str(tmp_path), survivors("ib-0"))[0] is None  # not measured
    assert measured.load_all(str(tmp_path), survivors(train__steps=7)) == ([], [])
    assert measured.load_all(None, survivors()) == ([], [])
    # the case's times choose the plan: exactly these candidates, in this order
    assert measured_ahead(case, PLANS) == ([0.585, 2.66], "")
    assert measured_ahead(None, PLANS) == (None, "")
    times, why = measured_ahead(case, PLANS[::-1])
    assert times is None and why.startswith("the plans measured before training are not")


@pytest.mark.parametrize(
    "text, why",
    [
        ("{not json", "unreadable"),
        ("[1, 2]", "not a JSON object"),
        (json.dumps({"excluded": ["roce-1"], "plans": PLANS, "step_s": [1.0]}), "2 plans and 1"),
        (json.dumps({"excluded": ["roce-1"], "plans": PLANS, "step_s": [1, -1]}), "> 0"),
        (json.dumps({"excluded": ["ib-0"], "plans": PLANS, "step_s": [1, 2]}), "not those its"),
    ],
)
def test_a_measured_file_that_does_not_fit_is_ignored_with_one_line(tmp_path, text, why):
    path = measured.save(str(tmp_path), survivors("roce-1"), PLANS, [0.585, 2.66])
    with open(path, "w") as f:
        f.write(text)
    case, ignored = measured.load(str(tmp_path), survivors("roce-1"))
    assert case is None and len(ignored) == 1 and why in ignored[0], ignored
    assert ignored[0].startswith(f"measured times ignored: {path}: ")


def test_the_full_job_reports_every_measured_case_to_the_launcher(tmp_path, monkeypatch):
    sent = []
    monkeypatch.setattr(measured.status, "report", lambda event, **f: sent.append((event, f)))
    measured.save(str(tmp_path), survivors("roce-1"), PLANS, [0.585, 2.66])
    assert measured.report_all(str(tmp_path), survivors()) == []
    assert sent == [("measured", {"excluded": ["roce-1"], "plans": PLANS, "step_s": [0.585, 2.66]})]


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
