"""Print the cost model's fidelity table against Megatron-LM's published throughput.

Narayanan et al. 2021 (arXiv 2104.04473) Table 1, A100-80GB: configuration, published
teraFLOP/s per GPU, prediction, error, source. Device efficiency is calibrated once over
the table (holmes_jax.planner.fidelity.calibrate) and shipped as cost.DEFAULT_EFFICIENCY.

    python scripts/fidelity_megatron.py [--json] [--recalibrate]
"""

import argparse
import json

from holmes_jax.planner.fidelity import SOURCE, calibrate, fidelity_table
from holmes_jax.planner.placement import DEFAULT_EFFICIENCY


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    ap.add_argument(
        "--recalibrate",
        action="store_true",
        help="fit the efficiency again instead of using the shipped one",
    )
    args = ap.parse_args()
    eff = calibrate() if args.recalibrate else DEFAULT_EFFICIENCY
    rows = fidelity_table(eff)
    if args.json:
        for row in rows:
            print(json.dumps({**row, "efficiency": eff}))
        return
    print(f"device efficiency {eff:.3f} of 312 TFLOP/s peak (calibrated once); source: {SOURCE}")
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
