"""Text -> the token file ``data.source=tokens`` reads, with a Hugging Face tokenizer.

    python -m holmes_jax.data prepare --tokenizer HF_DIR --input TEXT_FILE_OR_DIR --out FILE

- **Tokenizer**: the ``tokenizer.json`` of a model directory (or that file itself), read
  by the ``tokenizers`` package (no ``transformers``, no network).
- **Documents**: a file, or every regular non-hidden file of a directory in the order
  ``data.source=text`` reads them (sorted relative paths). Each file is one document,
  wrapped the way the tokenizer's post-processor wraps one sequence (Llama 3:
  ``<|begin_of_text|>`` before it; GPT-2: nothing), and followed by ``--eos TOKEN`` when
  given (GPT-2's documents are usually separated by ``<|endoftext|>``).
- **Output**: raw ids, native little-endian, ``uint16`` when the vocabulary (added tokens
  included) has at most 65536 ids, else ``uint32``
  (:func:`holmes_jax.runtime.data.loader.token_dtype_for`), written to ``FILE.tmp`` and renamed
  when complete; and ``FILE.json`` (dtype, token and file counts, vocabulary size,
  tokenizer), which the reader checks against ``data.token_dtype``.

Large files are encoded in pieces of about :data:`PIECE_BYTES`, cut after a newline whose
next line starts with a non-space character, in parallel batches (the tokenizer's own
threads). For regex pre-tokenizers (GPT-2, Llama 3) such a cut is a pre-token boundary, so
the ids equal those of encoding the whole file; a tokenizer for which a probe shows
otherwise (a SentencePiece normalizer that prefixes every sequence) gets each file whole.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from holmes_jax.core.errors import ConfigError, one_line
from holmes_jax.runtime.data.loader import TOKENS_SIDECAR, text_files, token_dtype_for

PIECE_BYTES = 1 << 18  # text per encoded piece (256 KiB)
BATCH_PIECES = 16  # pieces per encode_batch call
# Cuts the probe checks: (text before the cut, text after it), each cut after a newline.
_PROBES = (
    ("Hello, world.\n", "Second line, 2 numbers: 12345."),
    ("  indented  \n", "x = f(1)\n"),
    ("ünïcödé 😀\n", "# done"),
)


def load_tokenizer(path: str):
    """A ``tokenizers.Tokenizer`` from a model directory (its ``tokenizer.json``) or the
    file itself.

    Raises:
      ConfigError: no tokenizer.json there, or one the package cannot read.
    """
    from tokenizers import Tokenizer

    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ConfigError(
            f"--tokenizer={path}: no tokenizer.json there (give a Hugging Face model "
            "directory or the tokenizer.json file)"
        )
    try:
        return Tokenizer.from_file(file)
    except Exception as e:  # noqa: BLE001 (any unreadable file is one line)
        raise ConfigError(f"--tokenizer={path}: {file} cannot be read ({one_line(e)})") from None


def prepare(
    tokenizer: str, source: str, out: str, *, eos: str | None = None, progress: bool = True
) -> str:
    """Tokenize ``source`` (file or directory) into the token file ``out``.

    Returns:
      One line: what was written and the settings that train on it.

    Raises:
      ConfigError: a bad tokenizer, input, ``--eos`` token or output path; text that is
        not UTF-8; no tokens at all.
    """
    tok = load_tokenizer(tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype_name = token_dtype_for(vocab)
    dtype = np.dtype(dtype_name)
    root, files = _inputs(source)
    prefix, suffix = wrap_ids(tok)
    if eos is not None:
        eos_id = tok.token_to_id(eos)
        if eos_id is None:
            raise ConfigError(f"--eos={eos!r}: not a token of {tokenizer}")
        suffix = [*suffix, eos_id]
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise ConfigError(f"--out={out}: directory {parent} does not exist")
    whole_files = not _cuts_are_safe(tok)
    total_bytes = sum((root / f).stat().st_size for f in files)
    count = 0
    tmp = out + ".tmp"
    try:
        with (
            open(tmp, "wb") as f,
            tqdm(
                total=total_bytes,
                desc="tokenizing",
                unit="B",
                unit_scale=True,
                disable=not progress,
            ) as bar,
        ):
            for rel in files:
                np.asarray(prefix, dtype).tofile(f)
                count += len(prefix)
                pieces = _pieces(root / rel, whole_files)
                for batch in _batches(pieces):
                    encoded = tok.encode_batch(
                        [text for text, _ in batch], add_special_tokens=False
                    )
                    for enc in encoded:
                        np.asarray(enc.ids, dtype).tofile(f)
                        count += len(enc.ids)
                    bar.update(sum(size for _, size in batch))
                np.asarray(suffix, dtype).tofile(f)
                count += len(suffix)
        if count == 0:
            raise ConfigError(f"--input={source}: holds no text (0 tokens)")
        os.replace(tmp, out)
    except OSError as e:
        raise ConfigError(f"--out={out}: cannot be written ({one_line(e)})") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    meta = {
        "dtype": dtype_name,
        "tokens": count,
        "files": len(files),
        "vocab_size": vocab,
        "tokenizer": os.path.abspath(tokenizer),
        "eos": eos,
    }
    with open(out + TOKENS_SIDECAR, "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    return (
        f"wrote {count:,} tokens ({dtype_name}, vocabulary {vocab}) from {len(files)} file(s) "
        f"to {out}; train on it with --set data.source=tokens --set data.path={out} "
        f"--set data.token_dtype={dtype_name} (model.vocab_size >= {vocab})"
    )


def _inputs(source: str) -> tuple[Path, list[str]]:
    """(root, relative file names) of ``--input``."""
    p = Path(source).expanduser()
    if p.is_file():
        return p.parent, [p.name]
    if not p.is_dir():
        raise ConfigError(f"--input={source}: no such file or directory")
    files = text_files(p)
    if not files:
        raise ConfigError(f"--input={source}: directory holds no (non-hidden) files")
    return p, files


def wrap_ids(tok) -> tuple[list[int], list[int]]:
    """The ids the post-processor puts before and after one sequence."""
    core = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    for i in range(len(full) - len(core) + 1):
        if full[i : i + len(core)] == core:
            return full[:i], full[i + len(core) :]
    return [], []


def _cuts_are_safe(tok) -> bool:
    """Whether cutting text after a newline (next line not starting with white space)
    leaves the ids unchanged, on the probe texts."""
    for before, after in _PROBES:
        whole = tok.encode(before + after, add_special_tokens=False).ids
        parts = tok.encode_batch([before, after], add_special_tokens=False)
        if whole != parts[0].ids + parts[1].ids:
            return False
    return True


def _pieces(path: Path, whole: bool) -> Iterator[tuple[str, int]]:
    """(text, bytes) pieces of one file, cut after newlines (see the module docstring)."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            if whole:
                text = f.read()
                yield text, len(text.encode("utf-8"))
                return
            lines: list[str] = []
            size = 0
            for line in f:
                if size >= PIECE_BYTES and line[:1].strip():
                    yield "".join(lines), size
                    lines, size = [], 0
                lines.append(line)
                size += len(line.encode("utf-8"))
            if lines:
                yield "".join(lines), size
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"--input: {path} is not UTF-8 text (byte {e.start} of a block: {e.reason})"
        ) from None


def _batches(pieces: Iterator[tuple[str, int]]) -> Iterator[list[tuple[str, int]]]:
    batch = []
    for piece in pieces:
        batch.append(piece)
        if len(batch) == BATCH_PIECES:
            yield batch
            batch = []
    if batch:
        yield batch
