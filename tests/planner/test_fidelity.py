"""Fidelity of the cost model on deep and interleaved pipelines (issue 12, item 4).

The calibration (efficiency and element-wise passes) stays as fitted on Narayanan et al.
2021 Table 1; these tests check that the deep-pipeline table is built from data not used
to calibrate it, that the transcribed numbers are self-consistent, where the model stands
on each row (so a model change that moves a row shows here and in docs/planner.md), the
issue's target (mean <= 5%, worst <= 10%), and that the one-number model before it missed
that target (the test can fail).
"""

import dataclasses

import pytest

from holmes_jax.core.spec import ModelSpec, megatron_flops
from holmes_jax.planner import fidelity
from holmes_jax.planner.placement import Calibration

# Table 1 under the shipped calibration (docs/planner.md, "Fidelity against Megatron-LM").
TABLE_1_ERRORS = (0.052, 0.023, -0.050, -0.053, 0.010, 0.052, 0.034, 0.025, 0.006, 0.010)

# Where the model stands on each deep row (throughput error), as documented.
DEEP_ERRORS = {
    "GPT-3 175B, full recompute": 0.005,
    "GPT-3 175B, selective + SP": 0.039,
    "530B, full recompute": -0.060,
    "530B, selective + SP": -0.032,
    "530B, selective + SP, d8": -0.013,
    "1T, full recompute": -0.096,
    "1T, selective + SP": -0.089,
    "GPT-3 175B, PTD-P, 384 GPUs": 0.041,
    "GPT-3 175B, PTD-P, 768 GPUs": 0.046,
    "GPT-3 175B, PTD-P, 1536 GPUs": 0.059,
    "530B, PTD-P, 560 GPUs": -0.003,
    "530B, PTD-P, 1120 GPUs": 0.008,
    "530B, PTD-P, 2240 GPUs": 0.032,
    "MT-NLG 530B, DeepSpeed PP, 2240 GPUs": 0.204,
    "MT-NLG 530B, DeepSpeed PP, 2800 GPUs": 0.216,
    "MT-NLG 530B, DeepSpeed PP, 3360 GPUs": 0.251,
    "Llama 3 405B, 8192 H100": -0.106,
    "Llama 3 405B, 16384 H100": -0.114,
}


@pytest.fixture(scope="module")
def deep_rows():
    return fidelity.deep_fidelity_table(Calibration())


@pytest.fixture(scope="module")
def lower_rows():
    return fidelity.deep_fidelity_table(Calibration(), fidelity.DEEP_RUNS_LOWER)


def test_table_1_under_the_shipped_calibration():
    rows = fidelity.fidelity_table(Calibration())
    got = [r["error"] for r in rows]
    assert got == pytest.approx(TABLE_1_ERRORS, abs=0.005), got
    assert max(abs(e) for e in got) <= 0.10


def test_deep_rows_are_deep_and_not_calibration_data():
    calibrated = {(r.hidden_size, r.num_layers, r.gpus, r.batch) for r in fidelity.TABLE_1}
    for run in fidelity.DEEP_RUNS + fidelity.DEEP_RUNS_LOWER:
        assert run.stages >= 8 or run.virtual_stages > 1, run.name
        assert (run.hidden_size, run.num_layers, run.gpus, run.batch) not in calibrated
        assert run.batch % (run.data * run.microbatch) == 0, run.name
        assert run.source and run.metric in ("step_s", "tflops", "palm_tflops")


def test_every_row_reported(deep_rows, lower_rows):
    rows = deep_rows + lower_rows
    assert [r["model"] for r in rows] == list(DEEP_ERRORS)
    for r in rows:
        assert r["predicted"] > 0 and r["published"] > 0
        assert r["source"]


def test_where_the_model_stands(deep_rows, lower_rows):
    got = {r["model"]: r["error"] for r in deep_rows + lower_rows}
    assert got == pytest.approx(DEEP_ERRORS, abs=0.01), got


def test_published_numbers_are_self_consistent():
    # Korthikanti et al. Table 5: MFU from the iteration time with the paper's model FLOPs
    # (72·B·s·L·h²·(1 + s/6h + V/12Lh)) on 312 TFLOP/s A100s: 51.4%, 56.0%, 56.3%.
    for name, mfu in (
        ("GPT-3 175B, selective + SP", 0.514),
        ("530B, selective + SP", 0.560),
        ("1T, selective + SP", 0.563),
    ):
        run = next(r for r in fidelity.DEEP_RUNS if r.name == name)
        model = ModelSpec(run.num_layers, run.hidden_size, run.num_heads, 2048, 51200)
        got = megatron_flops(model, run.batch, False) / (run.published * run.gpus * 312e12)
        assert got == pytest.approx(mfu, abs=0.001), name
    # MT-NLG: 60.1, 50.2, 44.4 s are 126, 121, 113 teraFLOP/s per GPU with eq. 3.
    for run, tflops in zip(fidelity.DEEP_RUNS_LOWER[:3], (126, 121, 113), strict=True):
        model = ModelSpec(run.num_layers, run.hidden_size, run.num_heads, 2048, 50257)
        got = megatron_flops(model, run.batch) / (run.published * run.gpus) / 1e12
        assert got == pytest.approx(tflops, abs=1.0), run.name


def test_same_generation_as_calibration_meets_target(deep_rows):
    # Narayanan et al. Table 2 (PTD-P): the runs of the software and the paper the
    # efficiency was calibrated on, at 12 and 35 stages.
    rows = [r for r in deep_rows if "PTD-P" in r["model"]]
    mean, worst = fidelity.summary(rows)
    assert len(rows) == 6
    assert mean <= 0.05 and worst <= 0.10, rows


def test_deep_target(deep_rows):
    mean, worst = fidelity.summary(deep_rows)
    assert mean <= 0.05 and worst <= 0.10, (mean, worst)


def test_the_one_number_model_missed_the_deep_target():
    """Before: efficiency alone (0.58, element-wise work at one pass) and the runs priced
    without their tensor all-reduce overlap and sequence parallelism: 10.1% mean, 20.3%
    worst. Either change alone is not enough; the target needs both."""
    plain = tuple(
        dataclasses.replace(r, tp_overlap=False, sequence_parallel=False)
        for r in fidelity.DEEP_RUNS
    )
    old = fidelity.summary(fidelity.deep_fidelity_table(Calibration(0.58, 1.0), plain))
    assert old == pytest.approx((0.101, 0.203), abs=0.002)
    calibrated_only = fidelity.summary(fidelity.deep_fidelity_table(Calibration(), plain))
    mechanisms_only = fidelity.summary(
        fidelity.deep_fidelity_table(Calibration(0.58, 1.0), fidelity.DEEP_RUNS)
    )
    for mean, worst in (calibrated_only, mechanisms_only):
        assert mean > 0.05 or worst > 0.10
