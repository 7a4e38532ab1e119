"""One call that measures a GPU: the train step of configs/gpt-1.3b.yaml on one device.

    python scripts/gpu_check.py                # one GPU: seq 2048, bf16, batch 4
    python scripts/gpu_check.py --batch 2 --steps 3 --rounds 2
    python scripts/gpu_check.py --cpu-smoke    # tiny shapes on CPU, every row (CI runs it)

Uses whatever jax the machine has and installs nothing: run it from the repository root
(``holmes_jax`` is imported from there). Rows, each measured in a child process of its
own on a GPU (so that one row's out-of-memory ends only that row and its peak memory is
its own), in the same process with ``--cpu-smoke``:

- ``matmul``: a bf16 matrix product, the practical peak to set MFU beside;
- ``plain``: the same GPT module under a hand-written ``jax.jit`` step (value_and_grad
  in bf16 on fp32 masters, optax AdamW, no shardings): ``ours`` over ``plain`` is the
  engine's overhead;
- ``ours-<attention>-<remat>``: holmes_jax's Program on a one-device mesh, for each
  attention kernel (xla, cudnn) and remat policy (none, selective, full);
- ``ours-accum2``: the engine with two micro-batches (gradient accumulation);
- ``pipeline-2stage``: a 2-stage 1F1B pipeline; a stage is a mesh position, so it needs
  two devices and is reported as skipped on one.

Each row prints one JSON line: step time (median over rounds), tokens/s, model TFLOP/s,
MFU against the device kind's datasheet peak (``holmes_jax.runtime.rundir.devices``), compile
seconds, peak device memory (allocator high-water mark where the backend reports one)
and XLA's compiled estimate, first and last loss; ``status`` is ok, skipped (with
``why``) or error (with the error's last line). A table follows. Exit status 1 when a
row that should run errored.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIG = os.path.join(ROOT, "configs", "gpt-1.3b.yaml")
# The smoke model: the same code paths at shapes two CPU cores run in seconds.
SMOKE = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.seq_len=32",
    "model.vocab_size=256",
]
# A child's memory: jax preallocates 75% of the GPU; a row may need more.
CHILD_ENV = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}


def rows() -> list[dict[str, Any]]:
    """Every row, in the order they run: the ones that matter most first."""
    out: list[dict[str, Any]] = [
        {"row": "matmul"},
        {"row": "plain", "impl": "plain", "attention": "auto", "remat": "none"},
    ]
    ours = [("cudnn", "none"), ("xla", "none"), ("cudnn", "selective"), ("cudnn", "full")]
    ours += [("xla", "selective"), ("xla", "full")]
    for attention, remat in ours:
        out.append(
            {
                "row": f"ours-{attention}-{remat}",
                "impl": "ours",
                "attention": attention,
                "remat": remat,
            }
        )
    out.append(
        {
            "row": "ours-accum2",
            "impl": "ours",
            "attention": "auto",
            "remat": "none",
            "microbatches": 2,
        }
    )
    out.append(
        {
            "row": "pipeline-2stage",
            "impl": "ours",
            "attention": "auto",
            "remat": "none",
            "microbatches": 2,
            "stages": 2,
        }
    )
    return out


# --------------------------------------------------------------------------- one row


def row_config(spec: dict[str, Any], args):
    """The row's config: gpt-1.3b (or the smoke model) on a mesh of the row's stages."""
    from holmes_jax.core.config import load_config

    overrides = [
        "parallel.mesh=null",
        "parallel.tensor=1",
        f"parallel.stages={spec.get('stages', 1)}",
        "parallel.layers_per_stage=null",
        f"parallel.microbatches={spec.get('microbatches', 1)}",
        "parallel.schedule=1f1b",
        "train.precision=bf16",
        "train.run_dir=null",
        f"train.global_batch_size={args.batch}",
        f"model.attention={spec['attention']}",
        f"model.remat={spec['remat']}",
        f"model.seq_len={args.seq_len}",
    ]
    if args.smoke:  # the smoke model, at its own seq_len
        overrides = SMOKE + [o for o in overrides if not o.startswith("model.seq_len=")]
    return load_config(CONFIG, overrides)


def measure_matmul(args) -> dict[str, Any]:
    """bf16 [n, n] @ [n, n] on device 0, best of ``reps`` after a warm-up, random inputs."""
    import jax
    import jax.numpy as jnp

    n = 256 if args.smoke else 8192
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (n, n), jnp.bfloat16)
    b = jax.random.normal(key_b, (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(20):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return {"n": n, "tflops": round(2 * n**3 / best / 1e12, 2)}


def plain_step(cfg):
    """(init, step, lower, sharding) of the reference: GPT.apply + optax AdamW under one
    ``jax.jit``, params fp32, forward and backward in the compute dtype."""
    import jax
    import jax.numpy as jnp
    import optax

    from holmes_jax.runtime.model.decoder import GPT, init_model
    from holmes_jax.runtime.model.optim import make_optimizer
    from holmes_jax.runtime.state import compute_dtype

    model = GPT(cfg.model)
    tx = make_optimizer(cfg.optimizer, cfg.train.steps)
    dtype = compute_dtype(cfg.train.precision)

    @jax.jit
    def init(key):
        tokens = jnp.zeros((1, cfg.model.seq_len), jnp.int32)
        params = init_model(cfg.model).init(key, tokens)["params"]
        params = jax.tree.map(lambda x: x.unbox() if hasattr(x, "unbox") else x, params)
        return params, tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(state, batch):  # batch [B, T+1]
        params, opt_state = state

        def loss_fn(p):
            p = jax.tree.map(lambda a: a.astype(dtype), p)
            return model.apply({"params": p}, batch[:, :-1], batch[:, 1:])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

    return (lambda: init(jax.random.key(0))), step.lower, jax.devices()[0]


def ours_step(cfg):
    """(init, lower, batch sharding) of holmes_jax's Program on the first ``stages``
    devices; the train step is the trainer's, compiled ahead of time."""
    from holmes_jax.core.spec import Degrees
    from holmes_jax.runtime.engine.mesh import build_mesh
    from holmes_jax.runtime.program import Program

    program = Program(cfg, build_mesh(Degrees(cfg.parallel.stages, 1, 1)))
    return (
        (lambda: program.init(0)),
        (lambda *_: program.lower_train_step()),
        program.shardings.batch,
    )


def run_row(spec: dict[str, Any], args) -> dict[str, Any]:
    """Measure one row; never raises (a failure is the row's ``error``)."""
    import jax

    out: dict[str, Any] = {"row": spec["row"]}
    try:
        if spec["row"] == "matmul":
            out.update(measure_matmul(args), status="ok")
            return out
        out.update(measure_step(spec, args))
    except Exception as e:  # noqa: BLE001 - a row reports its failure and the next runs
        skip = skip_reason(e)
        if skip:
            out.update(status="skipped", why=skip)
        else:
            lines = [x for x in str(e).strip().splitlines() if x.strip()] or [type(e).__name__]
            out.update(status="error", error=f"{type(e).__name__}: {lines[-1][:300]}")
    out["peak_gb"] = peak_gb(jax.devices()[0])
    return out


def skip_reason(e: Exception) -> str | None:
    """Why a row cannot run on this machine (rather than failed), or None."""
    from holmes_jax.core.errors import ConfigError

    if isinstance(e, (ConfigError, NeedsDevices)):  # e.g. cudnn attention on CPU
        return str(e)
    return None


class NeedsDevices(Exception):
    """The row needs more devices than the machine has."""


def measure_step(spec: dict[str, Any], args) -> dict[str, Any]:
    """Compile the row's train step, run ``warmup`` steps, then ``rounds`` x ``steps``
    timed steps on two alternating random batches."""
    import jax
    import numpy as np

    from holmes_jax.core.spec import flops_per_token
    from holmes_jax.runtime.model.decoder import attention_kernel
    from holmes_jax.runtime.rundir.devices import peak_tflops
    from holmes_jax.runtime.state import compute_dtype

    stages = spec.get("stages", 1)
    if len(jax.devices()) < stages:
        raise NeedsDevices(
            f"a {stages}-stage pipeline puts each stage on its own device (a mesh position); "
            f"this machine has {len(jax.devices())}"
        )
    cfg = row_config(spec, args)
    kernel = attention_kernel(cfg.model, compute_dtype(cfg.train.precision))
    init, lower, sharding = (plain_step if spec["impl"] == "plain" else ours_step)(cfg)

    rows_shape = (cfg.train.global_batch_size, cfg.model.seq_len + 1)
    rng = np.random.RandomState(0)
    batches = [
        jax.device_put(rng.randint(0, cfg.model.vocab_size, rows_shape).astype(np.int32), sharding)
        for _ in range(2)
    ]
    state = init()
    t = time.perf_counter()
    step = lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - t
    m = step.memory_analysis()
    compiled_gb = None
    if m is not None:
        compiled_gb = (
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            - m.alias_size_in_bytes
            + m.temp_size_in_bytes
        ) / 1e9

    state, metrics = step(state, batches[0])
    first_loss = float(metrics["loss"])
    n = 1
    for _ in range(args.warmup):
        state, metrics = step(state, batches[n % 2])
        n += 1
    float(metrics["loss"])
    times = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        for _ in range(args.steps):
            state, metrics = step(state, batches[n % 2])
            n += 1
        last_loss = float(metrics["loss"])  # blocks
        times.append((time.perf_counter() - t) / args.steps)
    step_s = statistics.median(times)

    flops = flops_per_token(cfg.model.spec, cfg.model.remat)
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    peak = peak_tflops(jax.devices()[0].device_kind, cfg.train.precision)
    model_tflops = tokens / step_s * flops.model / stages / 1e12  # per device
    return {
        "status": "ok",
        "impl": spec["impl"],
        "attention": kernel,
        "remat": cfg.model.remat,
        "microbatches": cfg.parallel.microbatches,
        "stages": stages,
        "batch": cfg.train.global_batch_size,
        "seq_len": cfg.model.seq_len,
        "step_ms": round(step_s * 1e3, 2),
        "step_ms_spread": [round(min(times) * 1e3, 2), round(max(times) * 1e3, 2)],
        "tokens_per_s": round(tokens / step_s, 1),
        "model_tflops": round(model_tflops, 3),
        "hw_tflops": round(tokens / step_s * flops.hardware / stages / 1e12, 3),
        "mfu": round(model_tflops / peak, 4) if peak else None,
        "compile_s": round(compile_s, 2),
        "compiled_gb": round(compiled_gb, 3) if compiled_gb is not None else None,
        "loss_first": round(first_loss, 4),
        "loss_last": round(last_loss, 4),
    }


def peak_gb(device) -> float | None:
    """The allocator's high-water mark on ``device`` (None where the backend keeps none)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - CPU backends may not implement it
        return None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return round(stats["peak_bytes_in_use"] / 1e9, 3)


# --------------------------------------------------------------------------- driver


def environment() -> dict[str, Any]:
    import importlib.metadata as md

    import jax

    from holmes_jax.runtime.rundir.devices import peak_tflops

    versions = {}
    for name in ("jax", "jaxlib", "flax", "optax", "numpy"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    d = jax.devices()[0]
    return {
        "row": "env",
        "platform": d.platform,
        "device_kind": d.device_kind,
        "devices": len(jax.devices()),
        "peak_tflops_bf16": peak_tflops(d.device_kind, "bf16"),
        "versions": versions,
        "date": time.strftime("%Y-%m-%d"),
    }


def child(spec: dict[str, Any], args) -> dict[str, Any]:
    """Run one row in a fresh process; its last JSON line is the row."""
    cmd = [sys.executable, os.path.abspath(__file__), "--row", spec["row"], *passthrough(args)]
    env = dict(os.environ)
    env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)  # the parent's own setting, below
    env.update(CHILD_ENV)
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.row_timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {
        "row": spec["row"],
        "status": "error",
        "error": f"exit {proc.returncode} after {time.perf_counter() - t:.0f} s: {tail[:300]}",
    }


def passthrough(args) -> list[str]:
    out = [
        "--batch",
        str(args.batch),
        "--seq-len",
        str(args.seq_len),
        "--steps",
        str(args.steps),
        "--rounds",
        str(args.rounds),
        "--warmup",
        str(args.warmup),
    ]
    return out + (["--smoke"] if args.smoke else [])


def table(results: list[dict[str, Any]]) -> str:
    head = (
        f"{'row':<20} {'status':<8} {'step ms':>9} {'tokens/s':>10} {'MFU':>6} "
        f"{'peak GB':>8} {'XLA GB':>7} {'compile s':>9}"
    )
    lines = [head]

    def f(x, fmt):
        return format(x, fmt) if isinstance(x, (int, float)) else "-"

    for r in results:
        if r["row"] == "matmul":
            lines.append(f"{'matmul':<20} {r['status']:<8} {f(r.get('tflops'), '.1f'):>9} TFLOP/s")
            continue
        lines.append(
            f"{r['row']:<20} {r['status']:<8} {f(r.get('step_ms'), '.1f'):>9} "
            f"{f(r.get('tokens_per_s'), '.0f'):>10} {f(r.get('mfu'), '.3f'):>6} "
            f"{f(r.get('peak_gb'), '.1f'):>8} {f(r.get('compiled_gb'), '.1f'):>7} "
            f"{f(r.get('compile_s'), '.1f'):>9}"
        )
        if r["status"] != "ok":
            lines.append(f"    {r.get('why') or r.get('error')}")
    return "\n".join(lines)


def summary(results: list[dict[str, Any]], env: dict[str, Any]) -> dict[str, Any]:
    by = {r["row"]: r for r in results}
    out: dict[str, Any] = {"row": "summary", "device_kind": env["device_kind"]}
    plain = by.get("plain", {})
    if plain.get("status") == "ok":
        kernel = plain["attention"]
        same = by.get(f"ours-{kernel}-none", {})
        if same.get("status") == "ok":
            out["ours_over_plain"] = round(same["step_ms"] / plain["step_ms"], 4)
    ok = [r for r in results if r.get("status") == "ok" and "tokens_per_s" in r]
    if ok:
        best = max(ok, key=lambda r: r["tokens_per_s"])
        out["fastest"] = best["row"]
        out["fastest_tokens_per_s"] = best["tokens_per_s"]
        out["fastest_mfu"] = best.get("mfu")
    if by.get("matmul", {}).get("status") == "ok":
        out["matmul_tflops"] = by["matmul"]["tflops"]
    out["errors"] = [r["row"] for r in results if r["status"] == "error"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny shapes on 2 simulated CPU devices, rows in this process",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on this backend")
    parser.add_argument(
        "--batch", type=int, default=4, help="sequences per step (gpt-1.3b's per-device 4)"
    )
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", default=None, help="comma-separated row names")
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)  # a child's row
    parser.add_argument("--row-timeout", type=float, default=600)
    parser.add_argument(
        "--in-process", action="store_true", help="run the rows in this process (default on CPU)"
    )
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.smoke = args.in_process = True
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
        ).strip()
    if args.smoke:
        args.steps, args.rounds, args.warmup = min(args.steps, 2), min(args.rounds, 2), 1

    specs = {s["row"]: s for s in rows()}
    if args.row is not None:  # a child: one row, one line
        print(json.dumps(run_row(specs[args.row], args)), flush=True)
        return 0
    chosen = list(specs.values())
    if args.only:
        names = args.only.split(",")
        unknown = [n for n in names if n not in specs]
        if unknown:
            parser.error(f"--only: unknown row {unknown[0]!r}; rows are {', '.join(specs)}")
        chosen = [specs[n] for n in names]

    if not (args.in_process or args.cpu_smoke):
        # The rows run in children; this process only asks what the device is. jax would
        # otherwise take 75% of the GPU's memory here.
        CHILD_ENV.update(
            {k: os.environ[k] for k in ("XLA_PYTHON_CLIENT_PREALLOCATE",) if k in os.environ}
        )
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env = environment()
    in_process = args.in_process or env["platform"] == "cpu"
    print(json.dumps(env), flush=True)
    results = []
    for spec in chosen:
        r = run_row(spec, args) if in_process else child(spec, args)
        results.append(r)
        print(json.dumps(r), flush=True)
    print(table(results), flush=True)
    out = summary(results, env)
    print(json.dumps(out), flush=True)
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
