"""Benchmark: the quickstart model's train step, ours vs a minimal plain jax.jit + optax step.

    python scripts/bench_step.py [--steps 20] [--rounds 5]

Measures, side by side in one process on 8 simulated CPU devices:

- ``plain_1dev``: the same GPT module, a hand-written ``jax.jit`` step (value_and_grad +
  optax AdamW, no shardings, no logical rules), batches ``device_put`` from the sampler;
- ``ours_1dev``: holmes_jax's Program on a 1-device mesh, batches from ``make_batch``
  (the trainer's loop body);
- ``ours_8dev``: the same on all 8 devices, data 8/t x tensor t (t = the config's
  ``parallel.tensor``), ZeRO-1.

Rounds alternate between the variants so machine noise hits all of them; each reports the
median per-step time. MFU is against the peak measured here with a large fp32 matmul on
one device (the 8 simulated devices share the same cores, so their per-device peak is
that over 8). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import benchlib  # sets the simulated device count before jax loads
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from holmes_jax.core.config import load_config  # noqa: E402
from holmes_jax.core.spec import (
    Degrees,  # noqa: E402
    flops_per_token,  # noqa: E402
)
from holmes_jax.runtime.data.loader import BatchSampler, load_corpus, make_batch  # noqa: E402
from holmes_jax.runtime.engine.mesh import build_mesh  # noqa: E402
from holmes_jax.runtime.model.decoder import GPT  # noqa: E402
from holmes_jax.runtime.model.optim import make_optimizer  # noqa: E402
from holmes_jax.runtime.program import Program  # noqa: E402

ROOT = benchlib.ROOT


def matmul_peak_tflops(n: int = 2048, reps: int = 10) -> float:
    """Best-of fp32 matmul throughput on one device: the machine's practical peak."""
    a = jax.device_put(jnp.ones((n, n), jnp.float32), jax.devices()[0])
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e12


def plain_runner(cfg, sampler):
    """The minimal reference: GPT.apply + optax, one jit, one device."""
    model = GPT(cfg.model)
    tx = make_optimizer(cfg.optimizer, cfg.train.steps)
    tokens = jnp.zeros((1, cfg.model.seq_len), jnp.int32)
    params = jax.jit(lambda k: model.init(k, tokens)["params"])(jax.random.key(0))
    params = jax.tree.map(lambda x: x.unbox() if hasattr(x, "unbox") else x, params)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        def loss_fn(p):
            return model.apply({"params": p}, batch[:, :-1], batch[:, 1:])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    device = jax.devices()[0]
    state = [params, opt_state, 0]

    def run(n):
        p, o, s = state
        for _ in range(n):
            p, o, loss = step(p, o, jax.device_put(sampler.global_batch(s), device))
            s += 1
        loss.block_until_ready()
        state[:] = [p, o, s]

    return run


def ours_runner(cfg, sampler, shape: Degrees):
    program = Program(cfg, build_mesh(shape))
    state = [program.init(0), 0]

    def run(n):
        st, s = state
        for _ in range(n):
            st, metrics = program.train_step(st, make_batch(sampler, s, program.shardings.batch))
            s += 1
        metrics["loss"].block_until_ready()
        state[:] = [st, s]

    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "quickstart.yaml"))
    parser.add_argument("--steps", type=int, default=20, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)

    # The config's model as plain data parallelism (the quickstart itself is pipelined over
    # two islands): one stage, one micro-batch, no topology.
    flat = ["parallel.mesh=null", "parallel.stages=1", "parallel.layers_per_stage=null"]
    flat.append("parallel.microbatches=1")
    cfg = load_config(args.config, ["train.run_dir=null", *flat])
    corpus = load_corpus(cfg.data, cfg.model.vocab_size)
    sampler = BatchSampler(corpus.train, cfg.model.seq_len, cfg.train.global_batch_size, 0)
    p = cfg.parallel
    variants = {
        "plain_1dev": (plain_runner(cfg, sampler), 1),
        "ours_1dev": (ours_runner(cfg, sampler, Degrees(1, 1, 1)), 1),
        "ours_8dev": (ours_runner(cfg, sampler, Degrees(1, 8 // p.tensor, p.tensor)), 8),
    }
    medians = benchlib.interleaved_medians(
        {name: run for name, (run, _) in variants.items()}, args.steps, args.rounds, warmup=3
    )

    peak = matmul_peak_tflops()
    flops = flops_per_token(cfg.model.spec, cfg.model.remat)
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    result: dict = {
        "bench": "step",
        "model_params": sum(
            x.size
            for x in jax.tree.leaves(
                Program(cfg, build_mesh(Degrees(1, 1, 1))).abstract_state.params
            )
        ),
        "tokens_per_step": tokens,
        "machine_peak_tflops": round(peak, 4),
        "cpu_cores": os.cpu_count(),
    }
    for name, (_, ndev) in variants.items():
        step_s = medians[name]
        model_tflops = tokens * flops.model / step_s / 1e12  # whole machine
        result[name] = {
            "step_ms": round(step_s * 1e3, 2),
            "tokens_per_s": round(tokens / step_s, 1),
            "tflops_per_device": round(model_tflops / ndev, 5),
            "mfu": round(model_tflops / peak, 4),  # devices share the machine's cores
        }
    result["ratio_ours_over_plain_1dev"] = round(
        result["ours_1dev"]["step_ms"] / result["plain_1dev"]["step_ms"], 4
    )
    result["ratio_8dev_over_1dev"] = round(
        result["ours_8dev"]["step_ms"] / result["ours_1dev"]["step_ms"], 4
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
