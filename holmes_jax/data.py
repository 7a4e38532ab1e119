"""``python -m holmes_jax.data``: make the trainer's token files.

    python -m holmes_jax.data prepare --tokenizer HF_DIR --input TEXT_FILE_OR_DIR --out FILE \\
        [--eos '<|endoftext|>']

``prepare`` tokenizes a text file, or every file of a directory, with the
``tokenizer.json`` of a Hugging Face model directory (or that file), and writes the raw
``uint16`` / ``uint32`` token file that ``data.source=tokens`` reads (the dtype follows the
vocabulary size), with a progress bar; it prints the ``--set`` flags that train on it. A bad
path, tokenizer or token prints one line and exits with code 2. The work is done by
:mod:`holmes_jax.runtime.data.prepare`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from holmes_jax.core.errors import run_cli


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    return run_cli(_run, _parser().parse_args(argv))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m holmes_jax.data", description=__doc__.split("\n\n")[0]
    )
    sub = ap.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="text -> token file, with an HF tokenizer")
    prep.add_argument("--tokenizer", required=True, help="HF model directory or tokenizer.json")
    prep.add_argument("--input", required=True, help="a text file or a directory of them")
    prep.add_argument("--out", required=True, help="token file to write (and FILE.json)")
    prep.add_argument("--eos", help="token appended after every document, e.g. '<|endoftext|>'")
    prep.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def _run(args: argparse.Namespace) -> int:
    from holmes_jax.runtime.data.prepare import prepare

    print(prepare(args.tokenizer, args.input, args.out, eos=args.eos, progress=not args.quiet))
    return 0


if __name__ == "__main__":
    sys.exit(main())
