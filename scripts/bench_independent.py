"""Benchmark: independent DiLoCo islands against spmd DiLoCo, and under faults (root).

    sudo .venv/bin/python scripts/bench_independent.py [--steps 300] [--inner-steps 10] \\
        [--quorum-timeout 10] [--outage 30] [--seed 0] [--overlap-steps 5] \\
        [--rows spmd,independent,overlap,kill,cut,unequal] [--set KEY=VALUE] [--keep-logs DIR]

On ``meshes/emu-4host-2island-slow.yaml`` (``launch --emulate``: 1 Gbit/s inside each island,
10 Mbit/s between them, or ``--link-mbit``), the quickstart model, data 2 per island,
``H = --inner-steps``:

- spmd: one program, ``diloco.enabled=true``, ``parallel.replica=2``;
- independent: ``launch --independent-islands`` (one job per island, outer sync over HTTP);
- overlap: independent with ``diloco.overlap_steps = --overlap-steps`` (each round travels
  during the next inner steps and merges after them);
- kill: independent, island roce killed at a seeded random step S and back ``--outage``
  seconds later (``--fail-host roce-0@S:+30 --max-restarts 1``); ib is the survivor;
- cut: independent, the links between the islands cut at a seeded random step for
  ``--outage`` seconds (``--cut-islands S:+30``); both islands are survivors;
- unequal: independent on ``meshes/emu-4host-2island-slow-compute.yaml`` (roce at half
  ib's CPU quota, 100 Mbit/s between), a 48-row global batch so the planner's shares are
  exactly 32 and 16 rows. An island's per-step costs (its gradient all-reduce, the
  optimizer, the host's work) run at its island's speed too, so the slow island pays them
  twice over for half the rows; at 24 rows they cap what the two do together at ~0.90x the
  sum of each alone even in perfect lockstep, at 48 rows at ~0.94x.

Every run is ``python -m holmes_jax.launch`` in a subprocess whose output lines this script
time-stamps as they arrive (one clock for every event). Step time: the wall time between
process 0's ``step N`` lines from step 2 to the last, per step (outer syncs included).
Under a fault: the survivor's step rate during the outage (from the kill to the returning
island's first outer step; for the cut, while the links are down) against its rate over
the same steps of the independent run without faults; from the returning island's start
(the kill plus ``--outage``: the supervisor starts it when its time away ends), the
seconds to its heal line (``in_step_s``: it holds the global model of the round open at
its join, taken in step with its peers, to which it contributed a zero pseudo-gradient)
and to the first outer step with its own delta (``rejoin_s``; for the cut: from the
restore to the first outer step both islands take part in), and the heal time the island
reports; the final eval loss (mean of the islands') against the run without faults.

The inner step alone: the median wall time between consecutive steps (an outer step is
one slow interval in H, so the median is the step without it); ``over_inner`` is a row's
mean step over it. The overlap row's loss is set against the independent (in-step) row's.
The wire (independent and overlap rows): the bytes each island's records say it sent per
round (``outer_bytes_sent``, counted at the socket: median and peak), the bytes every island
sent over the tokens trained (``bytes_per_token``) against per-step data parallelism's
``2(R−1)·P·4`` over a batch's tokens (a ring all-reduce of fp32 gradients), and the compute
utilisation, the inner step over the mean step.

Unequal islands: each island alone does ``rows / inner step`` rows per second (its CPU
quota, not the other island, bounds its speed); together they do ``48 rows / mean step``
of the slower island; ``joint_over_sum`` is the second over the sum of the first.
``steady_joint_over_sum``: the same from the first round both islands take part in
(``steady_from_step``) to the step before the last (``steady_to_step``), without the
start-up where one island compiles or heals while the other trains on alone, and without
the end, where the last step awaits the final round in full and evaluates.

Targets: survivor rate >= 0.9 of no-fault; a returning island in an outer step (its
zero pseudo-gradient round, ``in_step_s``) within 30 s of its start; final eval loss
within 3% of no-fault (at 300 steps); with overlap, the step <= 1.05x the inner step alone
(at H = 50) and the loss within 1% of in-step; unequal islands >= 0.9x the sum of what
each does alone.
Prints one JSON line; progress and the runs' output go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import benchlib

from holmes_jax.core.errors import ConfigError

MESH = f"{benchlib.ROOT}/meshes/emu-4host-2island-slow.yaml"
UNEQUAL_MESH = f"{benchlib.ROOT}/meshes/emu-4host-2island-slow-compute.yaml"
UNEQUAL_BATCH = 48  # 24 units of data 2: shares 16 and 8 units at compute 2:1
QUICKSTART = f"{benchlib.ROOT}/configs/quickstart.yaml"
ROWS = ("spmd", "independent", "overlap", "kill", "cut", "unequal")
FAULT_ROWS = ("kill", "cut")
SURVIVOR, RETURNING = "ib-0", "roce-0"  # process 0 of island 0 / of island 1 (killed)
TARGETS = {
    "survivor_rate_ratio": 0.9,
    "in_step_s": 30.0,
    "loss_ratio": 1.03,
    "overlap_over_inner": 1.05,
    "overlap_loss_ratio": 1.01,
    "unequal_joint_over_sum": 0.9,
}
# The quickstart model, one stage, data 2 per island; a step line per step, eval at the end.
COMMON = [
    "parallel.stages=1",
    "parallel.data=2",
    "parallel.microbatches=1",
    "parallel.layers_per_stage=null",
    "data.max_bytes=2000000",
    "logging.progress=plain",
    "logging.log_every=1",
    "checkpoint.every=0",
    "diloco.enabled=true",
]

_HOST_LINE = re.compile(r"^\[(\S+?)\s*\] (.*)$")
_STEP = re.compile(r"step (\d+)(?: \||$)")
_ROUND = re.compile(r"diloco: outer step after step (\d+): round (\d+), islands \[([\d, ]*)\]")
_HEALED = re.compile(r"diloco: healed from a live peer in ([0-9.]+) s")
_KILL = re.compile(r"--fail-host \S+: SIGKILL to (\S+) at step (\d+)")
_CUT = re.compile(r"--cut-islands \S+: links between islands cut at step (\d+)")
_RESTORED = re.compile(r"--cut-islands \S+: links between islands restored")
_ROWS_OF = re.compile(r"diloco: independent island \S+ \(\d+ of \d+\): rows (\d+)-(\d+) of")


def log(msg: str) -> None:
    print(f"bench_independent: {msg}", file=sys.stderr, flush=True)


@dataclass
class Events:
    """What a run's time-stamped launcher output says (times in the bench's clock, s)."""

    steps: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # host -> (t, step)
    rounds: list[tuple[float, str, int, tuple[int, ...]]] = field(default_factory=list)
    heals: list[tuple[float, str, float]] = field(default_factory=list)  # (t, host, seconds)
    kills: list[tuple[float, str, int]] = field(default_factory=list)  # (t, host, step)
    cut: float | None = None
    restored: float | None = None
    rows: dict[str, int] = field(default_factory=dict)  # host -> rows of the global batch


def parse_events(lines: list[tuple[float, str]]) -> Events:
    """:class:`Events` from ``(time, line)`` pairs of ``launch``'s output (pure)."""
    ev = Events()
    for t, line in lines:
        if m := _HOST_LINE.match(line):
            host, text = m[1], m[2]
            if s := _STEP.match(text):
                ev.steps.setdefault(host, []).append((t, int(s[1])))
            elif r := _ROUND.search(text):
                islands = tuple(int(i) for i in r[3].split(",") if i.strip())
                ev.rounds.append((t, host, int(r[1]), islands))
            elif h := _HEALED.search(text):
                ev.heals.append((t, host, float(h[1])))
            elif w := _ROWS_OF.search(text):
                ev.rows[host] = int(w[2]) - int(w[1]) + 1
        elif line.startswith("launch: "):
            if k := _KILL.search(line):
                ev.kills.append((t, k[1], int(k[2])))
            elif _CUT.search(line):
                ev.cut = t
            elif _RESTORED.search(line):
                ev.restored = t
    return ev


def step_seconds(points: list[tuple[float, int]], first: int = 2, last: int | None = None) -> float:
    """Wall seconds per step from step ``first`` to step ``last`` (default: the last step)
    (pure).

    Raises:
      ValueError: fewer than two steps from ``first`` on.
    """
    pts = sorted((s, t) for t, s in points if s >= first and (last is None or s <= last))
    if len(pts) < 2 or pts[-1][0] == pts[0][0]:
        raise ValueError(f"fewer than two steps from step {first}: {pts}")
    return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])


def inner_step_seconds(points: list[tuple[float, int]], first: int = 2) -> float:
    """The median wall seconds between consecutive steps from step ``first`` (pure): the
    inner step alone, an outer step being one slow interval in every H.

    Raises:
      ValueError: fewer than two consecutive steps from ``first`` on.
    """
    at = {s: t for t, s in sorted(points) if s >= first}
    gaps = [at[s + 1] - at[s] for s in at if s + 1 in at]
    if not gaps:
        raise ValueError(f"no two consecutive steps from step {first}: {sorted(at)}")
    return statistics.median(gaps)


def unequal_row(ev: Events, batch: int) -> dict:
    """What two islands of unequal speed do together against the sum of what each does
    alone, in rows of the global batch per second (pure).

    Raises:
      RuntimeError: an island's rows or steps are missing from the output.
    """
    hosts = (SURVIVOR, RETURNING)
    if any(h not in ev.rows or h not in ev.steps for h in hosts):
        raise RuntimeError(f"unequal: rows or steps missing for {hosts} in the output")
    inner = {h: inner_step_seconds(ev.steps[h]) for h in hosts}
    alone = {h: ev.rows[h] / inner[h] for h in hosts}
    joint = batch / max(step_seconds(ev.steps[h]) for h in hosts)
    out = {
        "rows": {h: ev.rows[h] for h in hosts},
        "inner_step_ms": {h: round(inner[h] * 1e3, 1) for h in hosts},
        "alone_rows_per_s": {h: round(r, 2) for h, r in alone.items()},
        "joint_rows_per_s": round(joint, 2),
        "joint_over_sum": round(joint / sum(alone.values()), 3),
    }
    # steady state: from the first round both islands took part in (the start-up, where
    # one island compiles or heals while the other trains alone, left out) to the step
    # before the last (the last step awaits the final round in full, then evaluates)
    both = [step for _, _, step, islands in ev.rounds if len(islands) >= len(hosts)]
    end = min(max(s for _, s in ev.steps[h]) for h in hosts) - 1
    if both and end > min(both):
        steady = batch / max(step_seconds(ev.steps[h], first=min(both), last=end) for h in hosts)
        out["steady_from_step"] = min(both)
        out["steady_to_step"] = end
        out["steady_joint_rows_per_s"] = round(steady, 2)
        out["steady_joint_over_sum"] = round(steady / sum(alone.values()), 3)
    return out


def window_rate(
    points: list[tuple[float, int]], t0: float, t1: float
) -> tuple[float, int, int] | None:
    """Steps per second between the first and last step reported in ``[t0, t1]``, and
    those two steps; None with fewer than two steps there (pure)."""
    inside = [(t, s) for t, s in points if t0 <= t <= t1]
    if len(inside) < 2 or inside[-1][0] == inside[0][0]:
        return None
    (ta, a), (tb, b) = inside[0], inside[-1]
    return (b - a) / (tb - ta), a, b


def steps_rate(points: list[tuple[float, int]], a: int, b: int) -> float:
    """Steps per second from step ``a`` to step ``b`` (the first report of each; pure)."""
    first: dict[int, float] = {}
    for t, s in points:
        first.setdefault(s, t)
    if a not in first or b not in first or b <= a:
        raise ValueError(f"steps {a}..{b} are not both reported")
    return (b - a) / (first[b] - first[a])


def first_round(ev: Events, after: float, host: str | None = None, both: bool = False):
    """Time of the first outer step after ``after`` (by ``host``; ``both``: with every
    island); None when there is none (pure)."""
    for t, h, _step, islands in ev.rounds:
        if t > after and (host is None or h == host) and (not both or len(islands) >= 2):
            return t
    return None


def fault_steps(steps: int, seed: int) -> dict[str, int]:
    """The seeded random step of each fault, in the run's second fifth to half (pure)."""
    rng = random.Random(seed)
    lo, hi = max(2, steps // 5), max(2, steps // 2)
    return {row: rng.randint(lo, hi) for row in FAULT_ROWS}


def check_args(args) -> list[str]:
    """The rows to run, the independent baseline added for a fault row.

    Raises:
      ConfigError: one line naming the flag, its value and the rule.
    """
    rows = [r for r in args.rows.split(",") if r]
    bad = [r for r in rows if r not in ROWS]
    if bad or not rows:
        raise ConfigError(f"--rows={args.rows}: must be a comma list of {', '.join(ROWS)}")
    if args.inner_steps < 1:
        raise ConfigError(f"--inner-steps={args.inner_steps}: must be >= 1")
    if "overlap" in rows and not 0 < args.overlap_steps < args.inner_steps:
        raise ConfigError(
            f"--overlap-steps={args.overlap_steps}: must be > 0 and below --inner-steps "
            f"({args.inner_steps}) for the overlap row"
        )
    if args.steps < max(10, 3 * args.inner_steps):
        raise ConfigError(
            f"--steps={args.steps}: must be >= 10 and >= 3 x --inner-steps "
            f"({3 * args.inner_steps}), so a fault has outer steps around it"
        )
    if args.link_mbit is not None and not 0 < args.link_mbit <= 1e5:
        raise ConfigError(f"--link-mbit={args.link_mbit:g}: must be > 0 and <= 100000 (Mbit/s)")
    for flag, value in (("--quorum-timeout", args.quorum_timeout), ("--outage", args.outage)):
        if not 0 < value < 1e6:
            raise ConfigError(f"{flag}={value:g}: must be a number of seconds > 0")
    if args.keep_logs and os.path.isdir(args.keep_logs) and os.listdir(args.keep_logs):
        raise ConfigError(
            f"--keep-logs={args.keep_logs}: must be a new or empty folder (a run directory "
            "that holds records moves to <dir>-2, and its metrics would be the old ones)"
        )
    if any(r in FAULT_ROWS + ("overlap",) for r in rows) and "independent" not in rows:
        rows.insert(0, "independent")  # the no-fault / in-step rates and loss to compare with
    return [r for r in ROWS if r in rows]


def launch_cmd(row: str, args, run_dir: str, fault_step: int | None, mesh: str = MESH) -> list[str]:
    """The ``python -m holmes_jax.launch`` command of a row (pure)."""
    mesh = UNEQUAL_MESH if row == "unequal" else mesh
    cmd = [sys.executable, "-m", "holmes_jax.launch", "--mesh", mesh, "--emulate"]
    sets = COMMON + [
        f"parallel.mesh={mesh}",
        f"diloco.inner_steps={args.inner_steps}",
        f"train.steps={args.steps}",
        f"train.eval_every={args.steps}",
        f"train.run_dir={run_dir}",
    ]
    if row == "spmd":
        sets.append("parallel.replica=2")
    else:
        cmd.append("--independent-islands")
        sets.append(f"diloco.quorum_timeout_s={args.quorum_timeout:g}")
    if row == "overlap":
        sets.append(f"diloco.overlap_steps={args.overlap_steps}")
    elif row == "unequal":
        sets.append(f"train.global_batch_size={UNEQUAL_BATCH}")
    if row == "kill":
        cmd += ["--fail-host", f"{RETURNING}@{fault_step}:+{args.outage:g}", "--max-restarts", "1"]
    elif row == "cut":
        cmd += ["--cut-islands", f"{fault_step}:+{args.outage:g}"]
    cmd += ["--", "--config", QUICKSTART]
    return cmd + [a for s in sets + list(args.set) for a in ("--set", s)]


def wire_row(run_dir: str, tokens_per_step: int, steps: int, params: int) -> dict:
    """The wire numbers of an independent row (module doc) from the islands' metrics."""
    sent: dict[str, list[int]] = {}
    for isl in ("ib", "roce"):
        with open(os.path.join(run_dir, isl, "metrics.jsonl")) as f:
            recs = [json.loads(x) for x in f if '"outer_bytes_sent"' in x]
        sent[isl] = [r["outer_bytes_sent"] for r in recs if r["outer_bytes_sent"] > 0]
    total = sum(sum(v) for v in sent.values())
    per_token = total / (steps * tokens_per_step)
    dp = 2 * (len(sent) - 1) * params * 4 / tokens_per_step
    out = {f"{isl}_bytes_per_round": round(statistics.median(v)) for isl, v in sent.items() if v}
    out.update({f"{isl}_peak_bytes_per_round": max(v) for isl, v in sent.items() if v})
    out["bytes_per_token"] = round(per_token, 3)
    out["dp_bytes_per_token"] = round(dp, 1)
    out["fewer_than_dp"] = round(dp / per_token, 1) if per_token else None
    return out


def link_mesh(mbit: float, folder: str) -> str:
    """A copy of :data:`MESH` with ``mbit`` Mbit/s between the islands, in ``folder``."""
    import yaml

    with open(MESH) as f:
        mesh = yaml.safe_load(f)
    mesh["name"] = f"{mesh['name']}-{mbit:g}mbit"
    mesh["inter_island"]["default"]["bandwidth_gbps"] = mbit / 1000
    path = os.path.join(folder, f"{mesh['name']}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(mesh, f)
    return path


def model_params(args) -> int:
    """P: the parameters of the model the rows train, ``--set`` overrides included."""
    from holmes_jax.core.config import load_config

    sets = [s for s in args.set if not s.startswith("diloco.")]
    return load_config(QUICKSTART, sets).model.spec.num_params


def tokens_per_step(row: str, args) -> int:
    """The tokens of one global batch of ``row``, ``--set`` overrides included."""
    from holmes_jax.core.config import load_config

    sets = [s for s in args.set if not s.startswith("diloco.")]  # need the island's job
    cfg = load_config(QUICKSTART, sets)
    batch = UNEQUAL_BATCH if row == "unequal" else cfg.train.global_batch_size
    return batch * cfg.model.seq_len


def run_logged(cmd: list[str], path: str) -> list[tuple[float, str]]:
    """Run ``cmd``; every output line time-stamped as it arrives, echoed to stderr and
    written to ``path``.

    Raises:
      RuntimeError: a non-zero exit.
    """
    lines = []
    with open(path, "w") as f:
        f.write(" ".join(cmd) + "\n")
        p = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=benchlib.ROOT
        )
        for raw in p.stdout:
            t, line = time.monotonic(), raw.rstrip("\n")
            lines.append((t, line))
            f.write(f"{t:.3f} {line}\n")
            print(line, file=sys.stderr, flush=True)
        code = p.wait()
    if code:
        raise RuntimeError(f"'{' '.join(cmd[:8])} ...' exited with code {code} (log: {path})")
    return lines


def final_eval_loss(run_dir: str, row: str) -> float:
    """The last ``eval_loss`` in the run's metrics; for independent rows the mean of the
    islands' (``<run_dir>/<island>/metrics.jsonl``)."""
    paths = [os.path.join(run_dir, "metrics.jsonl")]
    if row != "spmd":
        paths = [os.path.join(run_dir, isl, "metrics.jsonl") for isl in ("ib", "roce")]
    losses = []
    for path in paths:
        with open(path) as f:
            evals = [json.loads(x)["eval_loss"] for x in f if '"eval_loss"' in x]
        if not evals:
            raise RuntimeError(f"{path}: no eval_loss")
        losses.append(evals[-1])
    return statistics.fmean(losses)


def fault_row(row: str, ev: Events, base: Events, outage: float) -> dict:
    """The outage numbers of a fault row against the run without faults (pure)."""
    if row == "kill":
        if not ev.kills:
            raise RuntimeError("kill: no --fail-host line in the output")
        t_kill, _host, step = ev.kills[0]
        start = t_kill + outage  # the supervisor starts the island when its time away ends
        back = first_round(ev, start, host=RETURNING)
        end = back if back is not None else max(t for t, _ in ev.steps[SURVIVOR])
        heal = [(t, s) for t, h, s in ev.heals if h == RETURNING and t > t_kill]
        survivors = [SURVIVOR]
        out = {"fault_step": step, "rejoin_s": None if back is None else round(back - start, 1)}
        out["heal_s"] = heal[0][1] if heal else None
        out["in_step_s"] = round(heal[0][0] - start, 1) if heal else None
    else:
        if ev.cut is None or ev.restored is None:
            raise RuntimeError("cut: no cut or restore line in the output")
        start, end = ev.cut, ev.restored
        back = first_round(ev, ev.restored, both=True)
        survivors = [SURVIVOR, RETURNING]
        out = {"rejoin_s": None if back is None else round(back - ev.restored, 1)}
    ratios = {}
    for host in survivors:
        got = window_rate(ev.steps.get(host, []), start if row == "cut" else t_kill, end)
        if got is None:
            ratios[host] = None
            continue
        rate, a, b = got
        ratios[host] = round(rate / steps_rate(base.steps[host], a, b), 3)
    known = [r for r in ratios.values() if r is not None]
    out["survivor_rate_ratio"] = min(known) if known else None
    out["survivor_rate_ratio_by_host"] = ratios
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="steps of every run")
    parser.add_argument("--inner-steps", type=int, default=10, help="DiLoCo's H (default 10)")
    parser.add_argument(
        "--quorum-timeout", type=float, default=10.0, help="diloco.quorum_timeout_s (s)"
    )
    parser.add_argument("--outage", type=float, default=30.0, help="seconds down per fault")
    parser.add_argument("--seed", type=int, default=0, help="draws the fault steps")
    parser.add_argument(
        "--overlap-steps", type=int, default=5, help="diloco.overlap_steps of the overlap row"
    )
    parser.add_argument("--rows", default=",".join(ROWS), help=f"any of {', '.join(ROWS)}")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for every row, after the bench's own (repeatable), e.g. "
        "diloco.warmup_steps=50",
    )
    parser.add_argument("--keep-logs", help="keep the runs' logs and metrics in this folder")
    parser.add_argument(
        "--link-mbit", type=float, help="Mbit/s between the islands (default: the mesh's 10)"
    )
    args = parser.parse_args(argv)
    try:
        rows = check_args(args)
        from holmes_jax.cluster.netns import check_privileges

        check_privileges()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    folder = args.keep_logs or tempfile.mkdtemp(prefix="bench_independent_")
    os.makedirs(folder, exist_ok=True)
    at = fault_steps(args.steps, args.seed)
    table, events = {}, {}
    mesh = link_mesh(args.link_mbit, folder) if args.link_mbit else MESH
    for row in rows:
        run_dir = os.path.join(folder, row)
        cmd = launch_cmd(row, args, run_dir, at.get(row), mesh)
        log(f"{row}: {' '.join(cmd[2:])}")
        try:
            lines = run_logged(cmd, os.path.join(folder, f"{row}.log"))
        except RuntimeError as e:
            print(f"error: {row}: {e}", file=sys.stderr)
            return 1
        events[row] = ev = parse_events(lines)
        step = step_seconds(ev.steps[SURVIVOR])
        table[row] = {
            "step_ms": round(step * 1e3, 1),
            "tokens_per_s": round(tokens_per_step(row, args) / step),
            "final_eval_loss": round(final_eval_loss(run_dir, row), 4),
        }
        if row in ("independent", "overlap"):
            inner = inner_step_seconds(ev.steps[SURVIVOR])
            table[row]["inner_step_ms"] = round(inner * 1e3, 1)
            table[row]["over_inner"] = round(step / inner, 3)
            table[row]["utilisation"] = round(inner / step, 3)
            table[row].update(
                wire_row(run_dir, tokens_per_step(row, args), args.steps, model_params(args))
            )
        if row == "overlap":
            ratio = table[row]["final_eval_loss"] / table["independent"]["final_eval_loss"]
            table[row]["loss_vs_in_step"] = round(ratio, 4)
        elif row == "unequal":
            table[row].update(unequal_row(ev, UNEQUAL_BATCH))
            table[row]["mesh"] = os.path.basename(UNEQUAL_MESH)
        if row in FAULT_ROWS:
            table[row].update(fault_row(row, ev, events["independent"], args.outage))
            ratio = table[row]["final_eval_loss"] / table["independent"]["final_eval_loss"]
            table[row]["loss_vs_no_fault"] = round(ratio, 4)
    result = {
        "mesh": os.path.basename(mesh),
        "link_mbit": args.link_mbit or 10,
        "steps": args.steps,
        "inner_steps": args.inner_steps,
        "quorum_timeout_s": args.quorum_timeout,
        "outage_s": args.outage,
        "overlap_steps": args.overlap_steps,
        "seed": args.seed,
        "set": args.set,
        "rows": table,
        "targets": TARGETS,
    }
    if "spmd" in table and "independent" in table:
        result["independent_over_spmd_step"] = round(
            table["independent"]["step_ms"] / table["spmd"]["step_ms"], 3
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
