"""``python -m holmes_jax.sample``: text from a trained checkpoint.

    python -m holmes_jax.sample --checkpoint runs/quickstart --prompt "def " \\
        [--max-new-tokens 200] [--temperature 0.8] [--top-k 200] [--seed 0] [--num-samples 1] \\
        [--config C] [--tokenizer HF_DIR]

``--checkpoint`` is a run directory, a checkpoint directory (its newest step) or one step
directory, of a run under any plan. Each sample is printed as the prompt and its
continuation, followed by a ``---`` line; one line on stderr says what was loaded. A bad
path or number prints one line and exits with code 2. The work is done by
:mod:`holmes_jax.runtime.model.generate`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from holmes_jax.core.errors import run_cli

SEPARATOR = "---"


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    return run_cli(_run, _parser().parse_args(argv))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m holmes_jax.sample", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--checkpoint", required=True, metavar="DIR", help="run, checkpoint or step directory"
    )
    ap.add_argument(
        "--prompt", default="\n", metavar="TEXT", help="text to continue (default: a newline)"
    )
    ap.add_argument(
        "--max-new-tokens", type=int, default=200, metavar="N", help="tokens to draw (default 200)"
    )
    ap.add_argument(
        "--temperature", type=float, default=0.8, metavar="T", help="0: greedy (default 0.8)"
    )
    ap.add_argument(
        "--top-k",
        type=int,
        default=200,
        metavar="K",
        help="draw among the k likeliest; 0: all (default 200)",
    )
    ap.add_argument("--seed", type=int, default=0, metavar="S", help="same seed, same samples")
    ap.add_argument(
        "--num-samples", type=int, default=1, metavar="N", help="samples, drawn side by side"
    )
    ap.add_argument("--config", metavar="C", help="config to use instead of the run's own")
    ap.add_argument(
        "--tokenizer", metavar="PATH", help="HF model directory or tokenizer.json of a token run"
    )
    return ap


def _run(args: argparse.Namespace) -> int:
    from holmes_jax.runtime.model.generate import Sampling, sample

    sampling = Sampling(
        args.max_new_tokens, args.temperature, args.top_k, args.seed, args.num_samples
    )
    texts, line = sample(
        args.checkpoint, args.prompt, sampling, config=args.config, tokenizer=args.tokenizer
    )
    print(line, file=sys.stderr)
    for text in texts:
        print(args.prompt + text)
        print(SEPARATOR)
    return 0


if __name__ == "__main__":
    sys.exit(main())
