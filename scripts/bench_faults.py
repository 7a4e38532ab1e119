"""Benchmark: training through faults on emulated islands (root).

    sudo .venv/bin/python scripts/bench_faults.py [--steps 30] [--every 5] [--at 12] \\
        [--only reference,kill] [--keep-logs DIR]
    sudo .venv/bin/python scripts/bench_faults.py --schedule random --seed 1 \\
        --mtbf-steps 100 [--steps 200] [--independent-islands]

The quickstart model on meshes/cpu8-two-islands.yaml (an InfiniBand and a RoCE island of
2 hosts x 2 devices, 1 Gbit/s between them), each host a process in its own network
namespace (``launch --emulate``), a checkpoint every ``--every`` steps, ``--max-restarts 3
--rejoin-timeout 10``, one compilation cache for all runs. ``--cpu-quota on`` holds each
host to its share of the cores (half of 2 cores here): without it, hosts that lost their
peers run on the freed cores, faster than the whole job would. First (unless ``--no-warm``)
``launch --warm-failures -- ... --compile-only`` fills it with the full program and the
survivors' programs of every one-host and one-island failure (the same config: the step
count is in the program), and times the latter (``warm_lines``). Runs, one after the other:

- ``reference``: no fault;
- ``kill`` (a): roce-1's worker gets SIGKILL at step ``--at`` and comes back at once;
- ``host`` (b): roce-1 is killed at step ``--at`` and never comes back;
- ``island`` (c): both RoCE hosts are killed at step ``--at`` and never come back;
- ``link`` (d): the link between the islands is cut for ``--cut`` seconds when step
  ``--at`` is done (IP forwarding off in the router namespace), then restored.

``--schedule random`` runs ``reference`` and ``random`` instead: a run with faults drawn
from a seeded schedule (:mod:`holmes_jax.cluster.fault_schedule`: workers killed, a host
away for ``2·--rejoin + 5`` s, a kill at a checkpoint step, one link cut) striking any host
but ib-0 (process 0, beside the launcher). With ``--independent-islands`` both runs are
independent DiLoCo islands (``launch --independent-islands``), the faults strike the RoCE
island only, and each island is reported on its own: the InfiniBand island is the
survivor, whose goodput says what the others' faults cost it.

Per run, from the launcher's output and the metrics file: seconds from the fault to the
next completed step, each restart's seconds by phase (``<run_dir>/restarts.jsonl``),
steps lost (steps computed twice), restarts, goodput (trained tokens per wall second of
the whole run over the reference's), the final eval loss against the
reference's, and the largest per-step loss difference from the reference. Beside them:
the planner's predicted step ratio of the survivors' plan (from the trainer's re-plan
line) and this machine's compute speed (an fp32 matmul), since emulated links have fixed
speeds while CPUs differ.

Targets: (a) training resumes within 30 s, steps lost <= ``--every``, per-step losses equal
to the reference's; (b), (c) every step finished, the first step after the fault within
60 s, final eval loss within 2%; (d) the job survives with <= ``--every`` steps lost.
Prints one JSON line; progress and the processes' output go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from holmes_jax.cluster import fault_schedule  # noqa: E402 (plain Python: no jax import)

MESH = "meshes/cpu8-two-islands.yaml"
STEP = re.compile(r"^\[ib-0\s*\] step (\d+) \|")
FAULT = re.compile(r"^launch: --fail-host \S+: SIGKILL to ")
RESUMED = "launch: training resumed: "
REPLAN = re.compile(r"predicted step ([0-9.e+-]+) s, ([0-9.]+)x the full topology's")
RUNS = ("reference", "kill", "host", "island", "link")
ISLAND_STEP = re.compile(r"^\[(ib|roce)-\d+\s*\] step (\d+) \|")
# an independent island's job (as bench_independent's rows): one stage, data parallel
INDEPENDENT = [
    "parallel.stages=1",
    "parallel.data=0",
    "parallel.microbatches=1",
    "parallel.layers_per_stage=null",
    "diloco.enabled=true",
]


def fault_flags(name: str, args) -> list[str]:
    if name == "random":
        return fault_schedule.flags(args.faults)
    at = args.at
    return {
        "kill": ["--fail-host", f"roce-1@{at}"],
        "host": ["--fail-host", f"roce-1@{at}:permanent"],
        "island": [
            "--fail-host",
            f"roce-0@{at}:permanent",
            "--fail-host",
            f"roce-1@{at}:permanent",
        ],
    }.get(name, [])


def set_forwarding(router: str, on: bool) -> None:
    value = "1" if on else "0"
    subprocess.run(
        ["ip", "netns", "exec", router, "sysctl", "-q", "-w", f"net.ipv4.ip_forward={value}"],
        check=True,
    )


def run_one(name: str, args, folder: str, cache: str) -> dict:
    """One launch; returns its timeline and metrics records."""
    run_dir = os.path.join(folder, name)
    cmd = [sys.executable, "-m", "holmes_jax.launch", "--mesh", MESH, "--emulate"]
    if name == "warm":
        cmd.append("--warm-failures")
    restarts = 3 + 2 * len(args.faults) if name == "random" else 3
    cmd += ["--max-restarts", str(restarts), "--rejoin-timeout", str(args.rejoin), "--grace", "5"]
    cmd += ["--cpu-quota", args.cpu_quota]
    cmd += fault_flags(name, args)
    if args.independent_islands:
        cmd.append("--independent-islands")
    train = ["--config", "configs/quickstart.yaml"]
    if name == "warm":
        train.append("--compile-only")
    for o in (
        f"train.steps={args.steps}",
        f"checkpoint.every={args.every}",
        f"train.eval_every={args.steps}",
        f"train.run_dir={run_dir}",
        f"train.compilation_cache={cache}",
        "logging.log_every=1",
        "logging.progress=plain",
        "distributed.heartbeat_timeout_s=10",
        *(INDEPENDENT if args.independent_islands else []),
        *args.set,
    ):
        train += ["--set", o]
    print(f"bench_faults: {name}: {' '.join(cmd[1:])} -- ...", file=sys.stderr, flush=True)
    began = time.monotonic()
    proc = subprocess.Popen(
        cmd + ["--", *train], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, bufsize=1,
    )  # fmt: skip
    router = f"hj{proc.pid}-r"  # netns.plan_network's name for the launcher's router
    fault_at, cut, lines = None, None, []
    log = open(os.path.join(folder, f"{name}.log"), "w")  # noqa: SIM115
    for raw in proc.stdout:
        now = time.monotonic()
        line = raw.rstrip("\n")
        lines.append((now, line))
        log.write(line + "\n")
        if args.verbose:
            print(line, file=sys.stderr, flush=True)
        if fault_at is None and FAULT.match(line):
            fault_at = now
        m = STEP.match(line)
        if name == "link" and m and int(m[1]) == args.at and cut is None:
            set_forwarding(router, False)
            fault_at = time.monotonic()
            print(f"bench_faults: link: cut at step {args.at}", file=sys.stderr, flush=True)

            def restore():
                time.sleep(args.cut)
                set_forwarding(router, True)
                print("bench_faults: link: restored", file=sys.stderr, flush=True)

            cut = threading.Thread(target=restore, daemon=True)
            cut.start()
    code = proc.wait()
    wall = time.monotonic() - began
    log.close()
    if cut is not None:
        cut.join()
    out = {"code": code, "wall": wall, "lines": lines, "fault_at": fault_at, "began": began}
    if name == "warm":  # nothing trained
        return out
    if not args.independent_islands:
        return {**out, **read_run(run_dir)}
    return {**out, "islands": {isl: read_run(os.path.join(run_dir, isl)) for isl in ISLANDS}}


ISLANDS = ("ib", "roce")


def read_run(run_dir: str) -> dict:
    """A job's metrics records and restart records (the launcher's phases per restart)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(x) for x in f]
    itemised = os.path.join(run_dir, "restarts.jsonl")
    phases = []
    if os.path.exists(itemised):
        with open(itemised) as f:
            phases = [json.loads(x) for x in f]
    return {"records": records, "phases": phases}


def job_row(job: dict, args) -> dict:
    """What one job's records say: steps done and lost, each restart by phase (as the
    launcher measured them, restarts.jsonl) and their sum by phase, the final eval loss."""
    records = job["records"]
    steps = [r["step"] for r in records]
    done = sorted(set(steps))
    phases = [
        {k: v for k, v in r.items() if k.endswith("_s") or k in ("compile", "cause")}
        for r in job["phases"]
    ]
    lost: dict[str, float] = {}
    for r in phases:
        for k, v in r.items():
            if k.endswith("_s"):
                lost[k] = round(lost.get(k, 0.0) + v, 2)
    final = [r for r in records if r["step"] == args.steps and "eval_loss" in r]
    return {
        "steps_finished": bool(done) and len(done) == args.steps and done[-1] == args.steps,
        "steps_lost": len(steps) - len(done),
        "restart_phases": phases,
        "seconds_lost_by_phase": lost,
        "eval_loss": round(final[-1]["eval_loss"], 5) if final else None,
    }


def summarize(name: str, run: dict, ref: dict | None, args) -> dict:
    records, lines = run["records"], run["lines"]
    out: dict = {
        "exit_code": run["code"],
        "wall_s": round(run["wall"], 1),
        "restarts": sum("then restart" in x for _, x in lines),
        **job_row(run, args),
    }
    if run["fault_at"] is not None:  # to the restart's first step (a step line may still
        # come from the survivors' steps in flight when the fault lands)
        after = [t for t, x in lines if t > run["fault_at"] and x.startswith(RESUMED)]
        after = after or [t for t, x in lines if t > run["fault_at"] and STEP.match(x)]
        out["fault_to_next_step_s"] = round(after[0] - run["fault_at"], 1) if after else None
    replans = [REPLAN.search(x) for _, x in lines if "re-planned for the survivors" in x]
    replans = [m for m in replans if m]
    if replans:
        out["predicted_step_ratio"] = float(replans[-1][2])
    # the trainer's trial or the choice among times measured by --warm-failures, and the
    # launcher's line when those times left a damaged island's other hosts out
    out["replan_trials"] = [x.split("] ", 1)[1] for _, x in lines if "] re-plan" in x]
    out["widened"] = [x for _, x in lines if x.startswith("launch: measured before training")]
    tokens = args.steps * args.tokens_per_step
    out["tokens_per_s"] = round(tokens / run["wall"], 1)
    if ref is not None:
        out["goodput"] = round(out["tokens_per_s"] / ref["tokens_per_s"], 3)
        if out["eval_loss"] and ref["eval_loss"]:
            out["eval_loss_vs_reference"] = round(out["eval_loss"] / ref["eval_loss"] - 1, 5)
        last = {r["step"]: r["loss"] for r in records}  # the last attempt's loss of each step
        diffs = [abs(last[s] - ref["losses"][s]) for s in last if s in ref["losses"]]
        out["max_loss_diff"] = float(f"{max(diffs):.3g}") if diffs else None
    else:
        out["losses"] = {r["step"]: r["loss"] for r in records}
    return out


def summarize_islands(run: dict, ref: dict | None, args) -> dict:
    """Independent islands: each island's row (:func:`job_row`), its seconds from the
    launch to its last step, and its goodput (the reference island's seconds over its own:
    an island trains the same tokens in either run) and eval loss against the reference."""
    out: dict = {"exit_code": run["code"], "wall_s": round(run["wall"], 1)}
    for isl in ISLANDS:
        last = [t for t, x in run["lines"] if (m := ISLAND_STEP.match(x)) and m[1] == isl]
        row = job_row(run["islands"][isl], args)
        row["island_s"] = round(last[-1] - run["began"], 1) if last else None
        if ref is not None and row["island_s"]:
            row["goodput"] = round(ref[isl]["island_s"] / row["island_s"], 3)
            if row["eval_loss"] and ref[isl]["eval_loss"]:
                row["eval_loss_vs_reference"] = round(
                    row["eval_loss"] / ref[isl]["eval_loss"] - 1, 5
                )
        out[isl] = row
    return out


def compute_gflops() -> float:
    """This machine's fp32 matmul speed, one device (a fresh process: no jax here)."""
    code = (
        "import time, jax, jax.numpy as jnp\n"
        "a = jnp.ones((1024, 1024)); f = jax.jit(lambda x: x @ x); f(a).block_until_ready()\n"
        "b = float('inf')\n"
        "for _ in range(10):\n"
        "    t = time.perf_counter(); f(a).block_until_ready()\n"
        "    b = min(b, time.perf_counter() - t)\n"
        "print(2 * 1024**3 / b / 1e9)\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    return round(float(done.stdout.split()[-1]), 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="30; 200 with --schedule random")
    parser.add_argument("--every", type=int, default=5, help="checkpoint.every")
    parser.add_argument("--at", type=int, default=12, help="the step the fault comes at")
    parser.add_argument("--cut", type=float, default=20.0, help="seconds the link is cut")
    parser.add_argument("--rejoin", type=float, default=10.0, help="--rejoin-timeout")
    parser.add_argument("--only", default=None, help=f"comma-separated runs of {RUNS}")
    parser.add_argument("--set", action="append", default=[], help="config override")
    parser.add_argument("--keep-logs", default=None, help="folder for the logs and run dirs")
    parser.add_argument("--verbose", action="store_true", help="echo the launcher's output")
    parser.add_argument("--no-warm", dest="warm", action="store_false", help="no --warm-failures")
    parser.add_argument(
        "--cpu-quota", choices=("auto", "on", "off"), default="auto",
        help="launch --cpu-quota; on: each host keeps its share of the cores, so survivors "
        "do not run faster on the cores of the hosts they lost",
    )  # fmt: skip
    parser.add_argument("--schedule", choices=("fixed", "random"), default="fixed")
    parser.add_argument("--seed", type=int, default=0, help="--schedule random's seed")
    parser.add_argument("--mtbf-steps", type=float, default=100.0, help="mean steps between faults")
    parser.add_argument(
        "--independent-islands", action="store_true", help="--schedule random on DiLoCo islands"
    )
    args = parser.parse_args(argv)
    args.steps = args.steps or (200 if args.schedule == "random" else 30)
    if os.geteuid() != 0:
        parser.error("needs root (network namespaces): sudo .venv/bin/python ...")
    names = args.only.split(",") if args.only else list(RUNS)
    bad = [n for n in names if n not in RUNS]
    if bad:
        parser.error(f"--only: unknown run {bad[0]!r}; runs are {', '.join(RUNS)}")
    if "reference" not in names:
        names.insert(0, "reference")
    if not 1 <= args.at < args.steps:
        parser.error(f"--at={args.at}: must be in [1, --steps)")
    if args.independent_islands and args.schedule != "random":
        parser.error("--independent-islands: only with --schedule random")
    from holmes_jax.core.config import load_config
    from holmes_jax.core.errors import ConfigError

    args.faults = []
    if args.schedule == "random":
        names = ["reference", "random"]
        hosts = ("roce-0", "roce-1") if args.independent_islands else ("ib-1", "roce-0", "roce-1")
        try:
            args.faults = fault_schedule.draw(
                args.seed, args.steps, args.mtbf_steps, hosts, args.every,
                away_s=2 * args.rejoin + 5, cut_s=args.cut,
            )  # fmt: skip
        except ConfigError as e:
            parser.error(str(e))
    cfg = load_config(os.path.join(ROOT, "configs", "quickstart.yaml"), args.set)
    args.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len

    folder = args.keep_logs or tempfile.mkdtemp(prefix="bench_faults-")
    os.makedirs(folder, exist_ok=True)
    cache = os.path.join(folder, "compile_cache")
    result: dict = {
        "bench": "faults",
        "mesh": MESH,
        "steps": args.steps,
        "checkpoint_every": args.every,
        "fault_at_step": args.at,
        "rejoin_timeout_s": args.rejoin,
        "link_cut_s": args.cut,
        "schedule": args.schedule,
        "independent_islands": args.independent_islands,
        "compute_gflops_fp32": compute_gflops(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpu_cores": os.cpu_count(),
    }
    if args.schedule == "random":
        result.update(seed=args.seed, mtbf_steps=args.mtbf_steps)
        result["faults"] = [f.to_dict() for f in args.faults]
    if (
        args.warm and not args.independent_islands
    ):  # the survivors' programs, compiled ahead (not timed as a run)
        began = time.monotonic()
        warm = run_one("warm", args, folder, cache)
        result["warm_s"] = round(time.monotonic() - began, 1)
        result["warm_lines"] = [x for _, x in warm["lines"] if "--warm-failures" in x]
    ref = None
    for name in names:
        run = run_one(name, args, folder, cache)
        if args.independent_islands:
            row = summarize_islands(run, ref, args)
        else:
            row = summarize(name, run, ref, args)
        row["load_avg_1m_after"] = round(os.getloadavg()[0], 2)  # others sharing the cores
        if name == "reference":
            ref = row
            row = {k: v for k, v in row.items() if k != "losses"}
        result[name] = row
        print(f"bench_faults: {name}: {json.dumps(row)}", file=sys.stderr, flush=True)
    result["logs"] = folder
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
