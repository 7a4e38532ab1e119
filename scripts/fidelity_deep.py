"""Print the cost model's fidelity on deep and interleaved pipelines.

Published runs with 8 or more pipeline stages and/or interleaving that the model was not
calibrated on (holmes_jax.planner.fidelity.DEEP_RUNS; lower-confidence rows, resting
on an unstated detail or on hardware not calibrated on, in DEEP_RUNS_LOWER). The
calibration (device efficiency and element-wise passes) stays as fitted on Narayanan et
al. 2021 Table 1 (placement.DEFAULT_EFFICIENCY, DEFAULT_ELEMENTWISE_PASSES); nothing is
refitted here. Each run is priced with the mechanisms its source names (Korthikanti et
al.'s backward tensor all-reduce overlap and sequence parallelism). Error is on
throughput: predicted / published − 1.

    python scripts/fidelity_deep.py [--json]
"""

import argparse
import json

from holmes_jax.planner import fidelity
from holmes_jax.planner.placement import Calibration


def table(runs) -> list[dict]:
    return fidelity.deep_fidelity_table(Calibration(), runs)


def _fmt(x: float, metric: str) -> str:
    return f"{x:.2f} s" if metric == "step_s" else f"{x:.0f} TF" if x >= 100 else f"{x:.1f} TF"


def show(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(
        "| model | GPUs | t/p/d/v | batch (mb) | seq | remat | published | predicted | error "
        "| alt. reading: error |"
    )
    print("|" + "---|" * 10)
    for r in rows:
        alt = (
            f"{r['alternative']}: {r['error_alternative']:+.1%}"
            if r["error_alternative"] is not None
            else ""
        )
        print(
            f"| {r['model']} | {r['gpus']} | {r['t']}/{r['p']}/{r['d']}/{r['v']} | "
            f"{r['batch']} ({r['microbatch']}) | {r['seq']} | {r['remat']} | "
            f"{_fmt(r['published'], r['metric'])} | {_fmt(r['predicted'], r['metric'])} | "
            f"{r['error']:+.1%} | {alt} |"
        )
    mean, worst = fidelity.summary(rows)
    print(f"mean |error| {mean:.1%}, worst {worst:.1%} (target: 5% mean, 10% worst)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    args = ap.parse_args()
    cal = Calibration()
    main_rows = table(fidelity.DEEP_RUNS)
    lower_rows = table(fidelity.DEEP_RUNS_LOWER)
    if args.json:
        for group, rows in (("deep", main_rows), ("lower_confidence", lower_rows)):
            for row in rows:
                fit = {"efficiency": cal.efficiency, "elementwise_passes": cal.elementwise_passes}
                print(json.dumps({**row, "group": group, **fit}))
        return
    print(
        f"device efficiency {cal.efficiency:.3f} of peak, element-wise work "
        f"{cal.elementwise_passes:.2f} bytes per stored activation byte, as calibrated on "
        f"{fidelity.SOURCE} (not refitted)"
    )
    show("Deep pipelines (layout from the source; what is assumed is named per row)", main_rows)
    show("Lower confidence (an unstated detail, or a stack not calibrated on)", lower_rows)
    print("\nsources and assumptions:")
    for r in main_rows + lower_rows:
        extra = f"; assumed: {r['assumptions']}" if r["assumptions"] else ""
        print(f"- {r['model']}: {r['source']}{extra}")


if __name__ == "__main__":
    main()
