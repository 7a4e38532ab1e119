"""Benchmark: ZeRO-1 memory. Per-device bytes of parameters + gradients + optimizer state,
zero1 on vs off, for the 350M config on a (stage 2, data 4) mesh of 8 simulated devices.

    python scripts/bench_optimizer.py [--config configs/gpt-350m.yaml]

Nothing is run: the train step is compiled for abstract inputs and measured with XLA's
memory analysis. Parameters + optimizer state are the step's (donated) arguments minus
the token batch; gradients are the full-size fp32 accumulators, measured as the output of
the compiled gradient function with zero1 off (ZeRO-1 shards the optimizer state, not the
accumulation). The measured ratio on/off is compared with (P + G + O/d) / (P + G + O).
Sequence length and batch are shrunk (they change activations, not these bytes).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys

import benchlib
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from holmes_jax.core.config import load_config  # noqa: E402
from holmes_jax.core.spec import Degrees  # noqa: E402
from holmes_jax.runtime.engine.mesh import build_mesh  # noqa: E402
from holmes_jax.runtime.program import Program  # noqa: E402

SHAPE = Degrees(stages=2, data=4, tensor=1)


def compiled_program(config: str, zero1: bool) -> tuple[Program, object]:
    cfg = load_config(
        config,
        [
            "data.source=stdlib",
            "data.path=null",
            "model.vocab_size=50304",
            "model.seq_len=128",
            "train.global_batch_size=8",
            "parallel.stages=2",
            "parallel.layers_per_stage=null",
            "parallel.microbatches=2",
            "parallel.tensor=1",
            "train.precision=fp32",  # the formula below is for fp32 parameters and state
            f"optimizer.zero1={str(zero1).lower()}",
        ],
    )
    program = Program(cfg, build_mesh(SHAPE))
    return program, program.lower_train_step().compile().memory_analysis()


def grads_bytes(program: Program) -> int:
    """Per-device output bytes of the compiled gradient function (zero1 off: full size)."""
    cfg = program.cfg
    batch = jax.ShapeDtypeStruct(
        (cfg.train.global_batch_size, cfg.model.seq_len + 1),
        jnp.int32,
        sharding=program.shardings.batch,
    )
    step = jax.ShapeDtypeStruct((), jnp.int32)
    with program.context():
        lowered = jax.jit(program.engine.loss_and_grads).lower(
            program.abstract_state.params, batch, step
        )
    return lowered.compile().memory_analysis().output_size_in_bytes


def local_bytes(tree) -> int:
    """Per-device bytes of an abstract, sharded pytree (from its shardings)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += int(jnp.dtype(leaf.dtype).itemsize * max(1, int(jnp.prod(jnp.array(shard)))))
    return total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=f"{benchlib.ROOT}/configs/gpt-350m.yaml")
    args = parser.parse_args(argv)

    measured = {}
    for zero1 in (False, True):
        program, stats = compiled_program(args.config, zero1)
        batch_bytes = (
            (program.cfg.train.global_batch_size // SHAPE.data)
            * (program.cfg.model.seq_len + 1)
            * 4
        )
        state_bytes = stats.argument_size_in_bytes - batch_bytes  # params + opt (+ step)
        measured[zero1] = {"program": program, "state": state_bytes}
    grads = grads_bytes(measured[False]["program"])

    off_prog = measured[False]["program"]
    params = local_bytes(off_prog.abstract_state.params)  # P per device
    opt = local_bytes(off_prog.abstract_state.opt_state)  # O per device (zero1 off)
    d = SHAPE.data
    on = measured[True]["state"] + grads
    off = measured[False]["state"] + grads
    formula = (params + grads + opt / d) / (params + grads + opt)
    result = {
        "bench": "optimizer",
        "config": args.config.split("/")[-1],
        "mesh": "stage 2 x data 4",
        "params_mb": round(params / 2**20, 1),
        "grads_mb": round(grads / 2**20, 1),
        "optimizer_mb_zero1_off": round(opt / 2**20, 1),
        "per_device_mb_zero1_off": round(off / 2**20, 1),
        "per_device_mb_zero1_on": round(on / 2**20, 1),
        "ratio_measured": round(on / off, 4),
        "ratio_formula": round(formula, 4),
        "relative_error": round(abs(on / off - formula) / formula, 4),
        "target": "relative_error <= 0.05",
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
