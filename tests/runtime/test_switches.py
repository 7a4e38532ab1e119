"""No switch combination crashes, and each trains exactly like the single-device reference.

The documented switches (stages, tensor, data, precision, ZeRO-1, remat, schedule, tied
embeddings, gradient buckets) have 2^7 * 3 * 3 = 1152 combinations, each its own compiled
program: too many for CI on two cores. So CI runs a covering array of strength 3 (every
triple of values of any three switches appears in some row), built greedily and
deterministically below; bugs that need a particular pair or triple of switches to show up
are caught without the full product.

    pytest tests/runtime/test_switches.py                          # the covering array
    HOLMES_FULL_MATRIX=1 pytest tests/runtime/test_switches.py     # all 1152 combinations

Every row runs two optimizer steps on the same batch and compares both losses with the plain
single-device fp32 program (stages=data=tensor=1, ZeRO-1 off, remat none) of the same model:
step 1 checks the forward pass, step 2 the gradients, clipping (which bites: grad_clip is
below the gradient norm) and the AdamW update, sharded over data when ZeRO-1 is on.
"""

import functools
import itertools
import os

import jax
import numpy as np
import pytest

from holmes_jax.core.config import load_config
from holmes_jax.core.spec import Degrees
from holmes_jax.runtime.engine.mesh import build_mesh
from holmes_jax.runtime.program import Program

# The switches and their values, in the order a row lists them.
SWITCHES: dict[str, tuple] = {
    "stages": (1, 2),
    "tensor": (1, 2),
    "data": (1, 2),
    "precision": ("fp32", "bf16"),
    "zero1": (False, True),
    "remat": ("none", "full", "selective"),
    "schedule": ("gpipe", "1f1b", "zb"),
    "tied": (True, False),
    "buckets": ("layer", "step"),  # parallel.grad_buckets
}

MODEL = [
    "model.num_layers=4",
    "model.hidden_size=32",
    "model.num_heads=4",
    "model.seq_len=16",
    "model.vocab_size=256",
    "model.attention=xla",
    "train.global_batch_size=8",
    "train.steps=2",
    "optimizer.warmup_steps=0",  # a nonzero learning rate on the first step
    "optimizer.learning_rate=1e-2",
    "optimizer.grad_clip=0.1",  # below the gradient norm (~1.5 at init): clipping bites
]

FP32_TOL = 1e-5
# bf16 keeps 8 significant bits (7 stored + 1 implicit), so around the loss (~ln 256 = 5.5,
# in [4, 8)) bf16 numbers are 2^(2-7) = 2^-5 apart and rounding moves a value by up to half
# that, 2^-6 ~= 0.016. The tolerance asks no more than that of a bf16 run: its loss is as
# close to the fp32 reference as rounding the reference to bf16 could be. Measured on 73 of
# the 192 bf16 rows (the covering array's 10 included): step 1 differs by at most 6e-5 (the
# loss is an fp32 mean over 128 tokens), step 2 by at most 3e-3 (Adam's first update is
# ~lr * sign(g), so bf16 noise that flips the sign of a tiny gradient entry moves that weight
# by 2 * lr). A broken bf16 update (say, params not refreshed from the fp32 master) misses by
# the whole step-2 drop of the loss, ~0.2.
BF16_TOL = 2.0**-6


def covering_array(levels: dict[str, tuple], strength: int = 3) -> list[dict]:
    """Rows (dicts switch -> value) in which every ``strength``-tuple of values appears.

    Greedy: among all combinations, repeatedly take the first one covering the most
    still-uncovered tuples. Deterministic, and near the optimum for a handful of switches.
    """
    names = list(levels)
    groups = list(itertools.combinations(range(len(names)), strength))
    candidates = list(itertools.product(*(range(len(levels[n])) for n in names)))
    uncovered = {
        (group, values)
        for group in groups
        for values in itertools.product(*(range(len(levels[names[i]])) for i in group))
    }

    def gain(row):
        return sum((g, tuple(row[i] for i in g)) in uncovered for g in groups)

    rows = []
    while uncovered:
        best = max(candidates, key=gain)  # max keeps the first of equals
        uncovered -= {(g, tuple(best[i] for i in g)) for g in groups}
        rows.append({n: levels[n][v] for n, v in zip(names, best, strict=True)})
    return rows


def _all_rows() -> list[dict]:
    return [
        dict(zip(SWITCHES, values, strict=True)) for values in itertools.product(*SWITCHES.values())
    ]


ROWS = _all_rows() if os.environ.get("HOLMES_FULL_MATRIX") == "1" else covering_array(SWITCHES)


def _row_id(row: dict) -> str:
    return (
        f"s{row['stages']}-t{row['tensor']}-d{row['data']}-{row['precision']}"
        f"-zero1{'on' if row['zero1'] else 'off'}-remat{row['remat']}-{row['schedule']}"
        f"-{'tied' if row['tied'] else 'untied'}-{row['buckets']}"
    )


def _overrides(row: dict) -> list[str]:
    stages = row["stages"]
    # Microbatches: 2 with a pipeline; with one stage 2 under 1f1b and 1 under gpipe, so the
    # single-stage microbatched engine is covered too (the schedule alone means nothing there).
    microbatches = 2 if stages > 1 or row["schedule"] != "gpipe" else 1
    split = [1, 3] if stages == 2 else [4]  # uneven: stage 0 holds one layer, stage 1 three
    return MODEL + [
        f"parallel.stages={stages}",
        f"parallel.layers_per_stage={split}",
        f"parallel.microbatches={microbatches}",
        f"parallel.schedule={row['schedule']}",
        f"parallel.tensor={row['tensor']}",
        f"parallel.data={row['data']}",
        f"parallel.devices={stages * row['data'] * row['tensor']}",
        f"train.precision={row['precision']}",
        f"optimizer.zero1={str(row['zero1']).lower()}",
        f"model.remat={row['remat']}",
        f"model.tied_embeddings={str(row['tied']).lower()}",
        f"parallel.grad_buckets={row['buckets']}",
    ]


def _batch() -> np.ndarray:
    return np.random.RandomState(0).randint(0, 256, (8, 17)).astype(np.int32)


@functools.cache
def _two_steps(overrides: tuple[str, ...], shape: Degrees) -> tuple[float, float]:
    """Step-1 and step-2 losses of a fresh run (seed 0) trained twice on the same batch.

    Cached: the references compile once per tied/untied, and a row that is a reference
    reuses it.
    """
    prog = Program(load_config(None, overrides), build_mesh(shape))
    state, losses = prog.init(0), []
    batch = jax.device_put(_batch(), prog.shardings.batch)
    for _ in range(2):
        state, metrics = prog.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return tuple(losses)


def _losses(row: dict) -> tuple[float, float]:
    return _two_steps(tuple(_overrides(row)), Degrees(row["stages"], row["data"], row["tensor"]))


def _reference(tied: bool) -> tuple[float, float]:
    """The plain single-device fp32 program: one device, ZeRO-1 off, no remat, one microbatch."""
    row = dict(
        stages=1, tensor=1, data=1, precision="fp32", zero1=False, remat="none",
        schedule="gpipe", tied=tied, buckets="layer",
    )  # fmt: skip
    losses = _losses(row)
    assert losses[1] < losses[0]  # it trains (so step 2 really tests the update)
    return losses


def test_covering_array_has_strength_3():
    rows = covering_array(SWITCHES)
    assert len(rows) < len(_all_rows()) // 10
    for names in itertools.combinations(SWITCHES, 3):
        seen = {tuple(row[n] for n in names) for row in rows}
        assert seen == set(itertools.product(*(SWITCHES[n] for n in names))), names
    assert covering_array(SWITCHES) == rows  # deterministic


@pytest.mark.parametrize("row", ROWS, ids=_row_id)
def test_switch_combination_trains_like_reference(row):
    losses = _losses(row)
    reference = _reference(row["tied"])
    if row["precision"] == "fp32":
        np.testing.assert_allclose(losses, reference, rtol=0, atol=FP32_TOL)
    else:
        np.testing.assert_allclose(losses, reference, rtol=0, atol=BF16_TOL)
        assert losses[0] != reference[0]  # the row really computed in bf16
