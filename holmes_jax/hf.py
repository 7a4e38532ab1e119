"""``python -m holmes_jax.hf``: Hugging Face models in and out.

    python -m holmes_jax.hf import HF_DIR OUT_DIR [--set model.seq_len=1024 ...]
    python -m holmes_jax.hf export CKPT_DIR HF_DIR [--dtype bfloat16] [--max-shard-size 5GB]

``import`` reads a model directory (``config.json`` + ``model.safetensors`` or a sharded
index; ``GPT2LMHeadModel`` or ``LlamaForCausalLM``) and writes ``OUT_DIR/checkpoint`` (the
parameters, logical layout) and ``OUT_DIR/config.yaml`` (the matching run config, with
``checkpoint.init_from`` pointing at the checkpoint; ``--set`` overrides go into it).
``export`` writes ``config.json`` + safetensors that ``transformers`` loads, from an
import, a run's ``checkpoint.dir`` (its newest step, local or ``gs://``) or one step
directory: ``model.safetensors`` when the weights fit in one ``--max-shard-size`` shard,
else ``model-00001-of-0000N.safetensors`` ... and ``model.safetensors.index.json``, as
``save_pretrained`` writes them.

Both run on the host alone (no accelerator is touched: ``JAX_PLATFORMS=cpu`` unless set).
An unsupported architecture, a missing tensor or one of another shape prints one line and
exits with code 2. The work is done by :mod:`holmes_jax.runtime.hf.convert`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from holmes_jax.core.errors import run_cli


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    return run_cli(_run, _parser().parse_args(argv))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m holmes_jax.hf", description=__doc__.split("\n\n")[0]
    )
    sub = ap.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF model directory -> holmes_jax checkpoint + config")
    imp.add_argument("hf_dir", metavar="HF_DIR", help="config.json + safetensors")
    imp.add_argument(
        "out_dir", metavar="OUT_DIR", help="new directory for checkpoint/ + config.yaml"
    )
    imp.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override in the written config, e.g. model.seq_len=512 (repeatable)",
    )
    exp = sub.add_parser("export", help="holmes_jax checkpoint -> HF model directory")
    exp.add_argument("ckpt", metavar="CKPT_DIR", help="an import, a checkpoint.dir or a step")
    exp.add_argument("hf_dir", metavar="HF_DIR", help="new directory for config.json + safetensors")
    exp.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="tensor dtype"
    )
    exp.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest safetensors file: bytes or e.g. 500MB, 5GB, 2GiB (default 5GB); a "
        "tensor larger than SIZE goes alone in its own file",
    )
    for p in (imp, exp):
        p.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def _run(args: argparse.Namespace) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax is imported (by the library)
    from holmes_jax.runtime.hf.convert import export_hf, import_hf

    if args.command == "import":
        print(import_hf(args.hf_dir, args.out_dir, args.set, progress=not args.quiet))
    else:
        said = export_hf(
            args.ckpt,
            args.hf_dir,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            progress=not args.quiet,
        )
        print(said)
    return 0


if __name__ == "__main__":
    sys.exit(main())
