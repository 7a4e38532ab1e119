"""Print the cost model's fidelity table against Megatron-LM's published throughput.

Narayanan et al. 2021 (arXiv 2104.04473) Table 1, A100-80GB: configuration, published
teraFLOP/s per GPU, prediction, error, source. The device efficiency and the element-wise
passes are calibrated together over the table (holmes_jax.planner.fidelity.calibrate,
minimax relative error) and shipped as placement.DEFAULT_EFFICIENCY and
placement.DEFAULT_ELEMENTWISE_PASSES.

    python scripts/fidelity_megatron.py [--json] [--recalibrate]
"""

import argparse
import json

from holmes_jax.planner.fidelity import SOURCE, calibrate, fidelity_table
from holmes_jax.planner.placement import Calibration


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    ap.add_argument(
        "--recalibrate",
        action="store_true",
        help="fit the calibration again (~15 s) instead of using the shipped one",
    )
    args = ap.parse_args()
    cal = calibrate() if args.recalibrate else Calibration()
    rows = fidelity_table(cal)
    fit = {"efficiency": cal.efficiency, "elementwise_passes": cal.elementwise_passes}
    if args.json:
        for row in rows:
            print(json.dumps({**row, **fit}))
        return
    print(
        f"device efficiency {cal.efficiency:.3f} of 312 TFLOP/s peak, element-wise work "
        f"{cal.elementwise_passes:.2f} bytes per stored activation byte (calibrated together); "
        f"source: {SOURCE}"
    )
    print(f"| {'configuration':<44} | published | predicted | error  |")
    print(f"|{'-' * 46}|-----------|-----------|--------|")
    for r in rows:
        print(
            f"| {r['configuration']:<44} | {r['published_tflops']:>9.0f} | "
            f"{r['predicted_tflops']:>9.1f} | {r['error']:+6.1%} |"
        )
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst |error| {worst:.1%} (bar: 10%)")


if __name__ == "__main__":
    main()
