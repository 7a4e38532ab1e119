"""Documents -> the token shards ``data.source=tokens`` reads, with a Hugging Face
tokenizer, one worker per core.

    python -m holmes_jax.data prepare --tokenizer HF_DIR --input PATH [PATH ...] --out DIR

- **Tokenizer**: the ``tokenizer.json`` of a model directory (or that file itself), read
  by the ``tokenizers`` package (no ``transformers``, no network).
- **Documents**: each ``--input`` is a file or a directory (its regular non-hidden files,
  recursively, in sorted order). A ``.jsonl`` file holds one document per line, the
  string at ``--field``; a ``.parquet`` or ``.arrow`` file (what Hugging Face ``datasets``
  writes with ``to_parquet`` and ``save_to_disk``) one per row of the column ``--field``,
  read with pyarrow a record batch at a time; any other file is one UTF-8 document. Each
  is wrapped the way the tokenizer's post-processor wraps one sequence (Llama 3:
  ``<|begin_of_text|>`` before it) and followed by ``--eos TOKEN`` when given.
- **Output**: ``DIR/shard-00000.bin``, ... of at least ``--shard-tokens`` tokens each (a
  shard ends at a piece boundary, below), raw ids in the dtype the vocabulary needs
  (:func:`~holmes_jax.runtime.data.loader.token_dtype_for`), each written whole then
  renamed, with its sidecar (:mod:`~holmes_jax.runtime.data.shards`: dtype, tokens,
  documents, largest id, vocabulary, tokenizer); then ``DIR/index.json``, which lists them
  all, so a reader opens the set with one read.
- **Resume**: ``DIR/prepare-state.json`` records the finished shards and how many pieces
  they hold; a run stopped at any point and started again with the same arguments skips
  those pieces (read, not tokenized) and writes exactly the shards an uninterrupted run
  writes. Other arguments on a directory with a state are a one-line error.
- **Bad input**: a ``.jsonl`` line that is not JSON or lacks a string ``--field`` is a
  one-line error naming the file and line; with ``--skip-bad`` it is skipped, and the
  lines skipped are counted in the last line printed.

Large text documents are encoded in pieces of about :data:`PIECE_BYTES`, cut after a
newline whose next line starts with a non-space character. For regex pre-tokenizers
(GPT-2, Llama 3) such a cut is a pre-token boundary, so the ids equal those of encoding the
whole document; a tokenizer for which a probe shows otherwise (a SentencePiece normalizer
that prefixes every sequence) gets each document whole. Pieces go to the workers in
batches of :data:`BATCH_PIECES` and come back in order, so the shards do not depend on
the worker count.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from holmes_jax.core.errors import ConfigError, one_line
from holmes_jax.runtime.data.loader import text_files, token_dtype_for
from holmes_jax.runtime.data.shards import INDEX, SIDECAR

PIECE_BYTES = 1 << 18  # text per encoded piece (256 KiB)
BATCH_PIECES = 16  # pieces per task sent to a worker
SHARD_TOKENS = 1 << 26  # default --shard-tokens: 67M tokens, 128 MiB of uint16
STATE = "prepare-state.json"
TABLE_SUFFIXES = (".parquet", ".arrow")
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


@dataclass(frozen=True)
class Request:
    """What ``prepare`` was asked (the resume state must match it)."""

    tokenizer: str
    inputs: tuple[str, ...]
    out: str
    eos: str | None = None
    field: str = "text"
    shard_tokens: int = SHARD_TOKENS
    skip_bad: bool = False

    def key(self) -> dict:
        """The arguments a resumed run must repeat (the tokenizer by its absolute path)."""
        return {
            "tokenizer": os.path.abspath(self.tokenizer),
            "inputs": [os.path.abspath(p) for p in self.inputs],
            "eos": self.eos,
            "field": self.field,
            "shard_tokens": self.shard_tokens,
            "skip_bad": self.skip_bad,
        }


@dataclass
class _Shard:
    """The shard being filled."""

    parts: list[np.ndarray] = field(default_factory=list)
    tokens: int = 0
    documents: int = 0
    max_id: int = 0


def prepare(req: Request, workers: int | None = None, progress: bool = True) -> str:
    """Tokenize ``req.inputs`` into shards in ``req.out`` (module doc); resumes a stopped
    run there.

    Returns:
      One line: what was written and the settings that train on it.

    Raises:
      ConfigError: a bad tokenizer, input, ``--eos`` token, field, shard size or output
        directory; text that is not UTF-8; a bad JSONL line without ``--skip-bad``; no
        tokens at all.
    """
    if isinstance(req.shard_tokens, bool) or req.shard_tokens < 1:
        raise ConfigError(f"--shard-tokens={req.shard_tokens}: must be >= 1")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the workers are the parallelism
    tok = load_tokenizer(req.tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype_name = token_dtype_for(vocab)
    prefix, suffix = wrap_ids(tok)
    if req.eos is not None:
        eos_id = tok.token_to_id(req.eos)
        if eos_id is None:
            raise ConfigError(f"--eos={req.eos!r}: not a token of {req.tokenizer}")
        suffix = [*suffix, eos_id]
    files = _inputs(req.inputs)
    out = Path(req.out)
    if not out.parent.is_dir():
        raise ConfigError(f"--out={req.out}: directory {out.parent} does not exist")
    if (out / INDEX).exists():
        raise ConfigError(f"--out={req.out}: holds a finished shard set ({INDEX}); use another")
    state = _resume_state(out, req)
    writer = _Writer(out, req, dtype_name, vocab, state)
    whole = not _cuts_are_safe(tok)
    pieces = _Pieces(files, req, whole, skip=state["pieces"])
    total = sum(os.path.getsize(f) for f in files)
    bar = tqdm(total=total, desc="tokenizing", unit="B", unit_scale=True, disable=not progress)
    bar.update(state["bytes"])
    began, tokens = time.perf_counter(), 0
    with _encoder(req.tokenizer, workers) as encode:
        for batch, ids in encode(_batches(pieces), prefix, suffix):
            for (size, _first, last), piece_ids in zip(batch, ids, strict=True):
                writer.add(piece_ids, last, size)
                tokens += len(piece_ids)
            bar.update(sum(size for size, _, _ in batch))
            bar.set_postfix_str(f"{tokens / max(time.perf_counter() - began, 1e-9):,.0f} tokens/s")
    bar.close()
    return writer.finish(pieces)


def _resume_state(out: Path, req: Request) -> dict:
    """The state of a stopped run in ``out`` with these arguments, else a fresh one."""
    fresh = {"request": req.key(), "shards": [], "pieces": 0, "bytes": 0}
    path = out / STATE
    if not path.exists():
        out.mkdir(exist_ok=True)
        return fresh
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--out={req.out}: its {STATE} cannot be read ({one_line(e)})") from None
    if state.get("request") != req.key():
        raise ConfigError(
            f"--out={req.out}: holds a stopped prepare of other arguments ({STATE}); give "
            "the same ones to resume it, or another --out"
        )
    return state


class _Writer:
    """Fills shards in order and writes each whole, with its sidecar and the state."""

    def __init__(self, out: Path, req: Request, dtype: str, vocab: int, state: dict):
        self.out, self.req, self.dtype, self.vocab, self.state = out, req, dtype, vocab, state
        self.shard = _Shard()
        self.pieces, self.bytes = state["pieces"], state["bytes"]

    def add(self, ids: np.ndarray, last: bool, size: int) -> None:
        s = self.shard
        s.parts.append(ids)
        s.tokens += len(ids)
        s.documents += last
        s.max_id = max(s.max_id, int(ids.max()) if len(ids) else 0)
        self.pieces += 1
        self.bytes += size
        if s.tokens >= self.req.shard_tokens:
            self._write()

    def _write(self) -> None:
        s = self.shard
        name = f"shard-{len(self.state['shards']):05d}.bin"
        tmp = self.out / (name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                for part in s.parts:
                    f.write(part.astype(self.dtype).tobytes())
            os.replace(tmp, self.out / name)
        except OSError as e:
            raise ConfigError(f"--out={self.req.out}: cannot be written ({one_line(e)})") from None
        entry = {"path": name, "tokens": s.tokens, "documents": s.documents, "max_id": s.max_id}
        side = {"dtype": self.dtype, **entry, "vocab_size": self.vocab}
        side.update(tokenizer=os.path.abspath(self.req.tokenizer), eos=self.req.eos)
        del side["path"]
        _write_json(self.out / (name + SIDECAR), side)
        self.state["shards"].append(entry)
        self.state.update(pieces=self.pieces, bytes=self.bytes)
        _write_json(self.out / STATE, self.state)  # after the shard: a resume never loses one
        self.shard = _Shard()

    def finish(self, pieces: _Pieces) -> str:
        if self.shard.tokens:
            self._write()
        shards = self.state["shards"]
        total = sum(s["tokens"] for s in shards)
        if total == 0:
            raise ConfigError(f"--input={' '.join(self.req.inputs)}: holds no text (0 tokens)")
        docs = sum(s["documents"] for s in shards)
        index = {"dtype": self.dtype, "tokens": total, "documents": docs, "vocab_size": self.vocab}
        index.update(tokenizer=os.path.abspath(self.req.tokenizer), eos=self.req.eos, shards=shards)
        _write_json(self.out / INDEX, index)
        (self.out / STATE).unlink()
        skipped = f"; skipped {pieces.skipped_summary()}" if pieces.skipped else ""
        return (
            f"wrote {total:,} tokens ({self.dtype}, vocabulary {self.vocab}) of {docs:,} "
            f"documents in {len(shards)} shard(s) to {self.req.out}{skipped}; train on them "
            f"with --set data.source=tokens --set data.path={self.req.out} --set "
            f"data.token_dtype={self.dtype} (model.vocab_size >= {self.vocab})"
        )


def _write_json(path: Path, value) -> None:
    """``value`` to ``path``, whole or not at all (written beside it, then renamed)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- inputs


def _inputs(inputs: tuple[str, ...]) -> list[Path]:
    """Every file of ``inputs``, in order (a directory's sorted, hidden ones skipped)."""
    files: list[Path] = []
    for source in inputs:
        p = Path(source).expanduser()
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            found = text_files(p)
            if not found:
                raise ConfigError(f"--input={source}: directory holds no (non-hidden) files")
            files += [p / f for f in found]
        else:
            raise ConfigError(f"--input={source}: no such file or directory")
    return files


class _Pieces:
    """The pieces of every document of ``files`` in order, as ``(text, bytes, first,
    last)``; the first ``skip`` are read and dropped (a resume)."""

    def __init__(self, files: list[Path], req: Request, whole: bool, skip: int):
        self.files, self.req, self.whole, self.skip = files, req, whole, skip
        self.skipped: dict[str, int] = {}  # reason -> lines (--skip-bad)
        self.first_skipped = ""

    def __iter__(self) -> Iterator[tuple[str, int, bool, bool]]:
        n = 0
        for path in self.files:
            for item in self._of(path):
                n += 1
                if n > self.skip:
                    yield item

    def _of(self, path: Path) -> Iterator[tuple[str, int, bool, bool]]:
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            for text in self._jsonl(path):
                yield from _cut(text, self.whole)
        elif suffix in TABLE_SUFFIXES:
            for text in _table_texts(path, self.req.field):
                yield from _cut(text, self.whole)
        else:
            yield from _text_pieces(path, self.whole)

    def _jsonl(self, path: Path) -> Iterator[str]:
        key = self.req.field
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    text = json.loads(raw)
                    reason = None if isinstance(text, dict) else "not a JSON object"
                except ValueError:
                    reason = "not JSON"
                if reason is None:
                    text = text.get(key)
                    reason = None if isinstance(text, str) else f"no string {key!r}"
                if reason is not None:
                    self._bad(path, number, reason)
                    continue
                yield text

    def _bad(self, path: Path, number: int, reason: str) -> None:
        if not self.req.skip_bad:
            raise ConfigError(
                f"--input: {path}:{number}: {reason} (--field={self.req.field}; --skip-bad "
                "skips such lines)"
            )
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.first_skipped = self.first_skipped or f"{path}:{number}"

    def skipped_summary(self) -> str:
        kinds = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items()))
        return f"{sum(self.skipped.values())} bad line(s) ({kinds}; the first {self.first_skipped})"


def _table_texts(path: Path, key: str) -> Iterator[str]:
    """The strings of column ``key`` of a Parquet or Arrow file, a record batch at a time."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            f"--input: {path} needs pyarrow (pip install 'holmes_jax[data]')"
        ) from None
    try:
        if path.suffix.lower() == ".parquet":
            pf = pq.ParquetFile(path)
            names = pf.schema_arrow.names
            if key not in names:
                raise ConfigError(f"--field={key}: not a column of {path} ({names})")
            batches = pf.iter_batches(columns=[key])
        else:
            batches = _arrow_batches(pa, path, key)
        for batch in batches:
            for text in batch.column(0).to_pylist():
                if isinstance(text, str):
                    yield text
    except (OSError, pa.ArrowException) as e:
        raise ConfigError(f"--input: {path} cannot be read ({one_line(e)})") from None


def _arrow_batches(pa, path: Path, key: str):
    """Column ``key`` of an Arrow IPC stream (``datasets``' ``save_to_disk``) or file."""
    source = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(source)
        reader = (reader.get_batch(i) for i in range(reader.num_record_batches))
        schema = None
    else:
        schema = reader.schema
    if schema is not None and key not in schema.names:
        raise ConfigError(f"--field={key}: not a column of {path} ({schema.names})")
    for batch in reader:
        yield batch.select([key])


def _text_pieces(path: Path, whole: bool) -> Iterator[tuple[str, int, bool, bool]]:
    try:
        with open(path, encoding="utf-8", newline="") as f:
            yield from _cut(f, whole)
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"--input: {path} is not UTF-8 text (byte {e.start} of a block: {e.reason})"
        ) from None


def _cut(text, whole: bool) -> Iterator[tuple[str, int, bool, bool]]:
    """(text, bytes, first, last) pieces of one document: ``text`` a string or an open
    text file; cut after newlines (module doc). An empty document is one empty piece."""
    pieces = _raw_pieces(text, whole)
    last, first = next(pieces), True
    for piece in pieces:
        yield *last, first, False
        last, first = piece, False
    yield *last, first, True


def _raw_pieces(text, whole: bool) -> Iterator[tuple[str, int]]:
    if isinstance(text, str):
        size = len(text.encode("utf-8"))
        if whole or size <= PIECE_BYTES:
            yield text, size
            return
        text = text.splitlines(keepends=True)
    elif whole:
        body = text.read()
        yield body, len(body.encode("utf-8"))
        return
    lines: list[str] = []
    size = 0
    for line in text:
        if size >= PIECE_BYTES and line[:1].strip():
            yield "".join(lines), size
            lines, size = [], 0
        lines.append(line)
        size += len(line.encode("utf-8"))
    yield "".join(lines), size


def _batches(pieces) -> Iterator[list[tuple[str, int, bool, bool]]]:
    batch = []
    for piece in pieces:
        batch.append(piece)
        if len(batch) == BATCH_PIECES:
            yield batch
            batch = []
    if batch:
        yield batch


# ----------------------------------------------------------------------------- encoding

_TOKENIZER = None  # each worker's, loaded once (_load_worker)


def _load_worker(path: str) -> None:
    global _TOKENIZER
    _TOKENIZER = load_tokenizer(path)


def _encode(task) -> tuple[list[tuple[int, bool, bool]], list[np.ndarray]]:
    """A batch's ``(bytes, first, last)`` and ids: each piece's, with the wrap's prefix on
    a document's first piece and its suffix (and ``--eos``) on its last."""
    batch, prefix, suffix = task
    encoded = _TOKENIZER.encode_batch([text for text, *_ in batch], add_special_tokens=False)
    out = []
    for (_, _, first, last), enc in zip(batch, encoded, strict=True):
        ids = [*(prefix if first else ()), *enc.ids, *(suffix if last else ())]
        out.append(np.asarray(ids, np.int64))
    return [meta for _, *meta in batch], out


class _encoder:
    """``encode(batches, prefix, suffix)``: yields ``(meta, ids)`` per batch, in order,
    from ``workers`` processes (None: one per core; 1: this process)."""

    def __init__(self, tokenizer: str, workers: int | None):
        self.tokenizer = tokenizer
        self.workers = workers or len(os.sched_getaffinity(0))
        self.pool = None

    def __enter__(self):
        if self.workers > 1:
            # spawned, not forked: the tokenizer's threads (or jax's, in a notebook) would
            # hold locks a forked child can never take
            ctx = multiprocessing.get_context("spawn")
            self.pool = ctx.Pool(self.workers, _load_worker, (self.tokenizer,))
        else:
            _load_worker(self.tokenizer)
        return self.encode

    def encode(self, batches, prefix, suffix):
        tasks = ((batch, prefix, suffix) for batch in batches)
        yield from self.pool.imap(_encode, tasks) if self.pool else map(_encode, tasks)

    def __exit__(self, *exc):
        if self.pool is None:
            return
        if exc[0] is None:
            self.pool.close()
        else:  # an error or an interrupt: the workers' queued work is dropped
            self.pool.terminate()
        self.pool.join()


# ----------------------------------------------------------------------------- probes


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
