"""scripts/gpu_check.py at tiny shapes on CPU: every row runs or says why it cannot, and
our step computes what the plain jax.jit step computes."""

import json
import os
import subprocess
import sys

from tests.common import ROOT


def test_gpu_check_cpu_smoke():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--cpu-smoke"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    rows = {r["row"]: r for r in lines}
    assert rows["env"]["platform"] == "cpu" and rows["env"]["devices"] == 2
    assert rows["summary"]["errors"] == []
    skipped = {name for name, r in rows.items() if r.get("status") == "skipped"}
    assert skipped == {"ours-cudnn-none", "ours-cudnn-selective", "ours-cudnn-full"}
    assert all("needs a CUDA GPU" in rows[name]["why"] for name in skipped)
    steps = [r for r in lines if r.get("status") == "ok" and "step_ms" in r]
    assert {r["row"] for r in steps} == {
        "plain",
        "ours-xla-none",
        "ours-xla-selective",
        "ours-xla-full",
        "ours-accum2",
        "pipeline-2stage",
    }
    for r in steps:
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["compile_s"] > 0, r
        assert r["mfu"] is None  # no datasheet peak for a CPU
        assert r["loss_last"] < r["loss_first"], r  # the same two batches, trained on
    # Same init, same first batch: every variant's first loss is the plain step's.
    for r in steps:
        assert abs(r["loss_first"] - rows["plain"]["loss_first"]) < 2e-3, r
    assert rows["pipeline-2stage"]["stages"] == 2
    assert "table" not in rows and "matmul" in rows and rows["matmul"]["tflops"] > 0
