"""``python -m holmes_jax.data``: make the trainer's token shards.

    python -m holmes_jax.data prepare --tokenizer HF_DIR --input PATH [PATH ...] --out DIR \\
        [--eos '<|endoftext|>'] [--field text] [--shard-tokens N] [--workers N] [--skip-bad]

``prepare`` tokenizes text files, JSONL (the string at ``--field`` of each line) and
Parquet or Arrow tables (the column ``--field``), files or directories of them, with the
``tokenizer.json`` of a Hugging Face model directory (or that file), one worker per core,
and writes the shards, their sidecars and an index that ``data.source=tokens`` reads,
with a progress bar; it prints the ``--set`` flags that train on them. Run again with the
same arguments, it resumes where it stopped. Bad input prints one line and exits with code
2. The work is done by :mod:`holmes_jax.runtime.data.prepare`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from holmes_jax.core.errors import ConfigError, run_cli


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    return run_cli(_run, _parser().parse_args(argv))


def _parser() -> argparse.ArgumentParser:
    from holmes_jax.runtime.data.prepare import SHARD_TOKENS

    ap = argparse.ArgumentParser(
        prog="python -m holmes_jax.data", description=__doc__.split("\n\n")[0]
    )
    sub = ap.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="documents -> token shards, with an HF tokenizer")
    prep.add_argument("--tokenizer", required=True, help="HF model directory or tokenizer.json")
    prep.add_argument(
        "--input", required=True, nargs="+", help="text, .jsonl, .parquet or .arrow files, "
        "or directories of them",
    )  # fmt: skip
    prep.add_argument("--out", required=True, help="directory for the shards and index.json")
    prep.add_argument("--eos", help="token appended after every document, e.g. '<|endoftext|>'")
    prep.add_argument("--field", default="text", help="the text of a JSONL line or table row")
    prep.add_argument(
        "--shard-tokens", type=int, default=SHARD_TOKENS, help="tokens per shard (at least)"
    )
    prep.add_argument("--workers", type=int, help="tokenizing processes (default: one per core)")
    prep.add_argument("--skip-bad", action="store_true", help="skip and count bad JSONL lines")
    prep.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def _run(args: argparse.Namespace) -> int:
    from holmes_jax.runtime.data.prepare import Request, prepare

    req = Request(
        args.tokenizer, tuple(args.input), args.out, eos=args.eos, field=args.field,
        shard_tokens=args.shard_tokens, skip_bad=args.skip_bad,
    )  # fmt: skip
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers={args.workers}: must be >= 1")
    print(prepare(req, workers=args.workers, progress=not args.quiet))
    return 0


if __name__ == "__main__":
    sys.exit(main())
