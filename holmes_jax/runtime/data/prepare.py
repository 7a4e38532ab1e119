"""Documents -> the token shards ``data.source=tokens`` reads, with a Hugging Face
tokenizer, one worker per core.

    python -m holmes_jax.data prepare --tokenizer HF_DIR --input PATH [PATH ...] --out DIR

- **Tokenizer**: the ``tokenizer.json`` of a model directory (or that file itself), read
  by the ``tokenizers`` package (no ``transformers``, no network).
- **Documents**: each ``--input`` is a file or a directory (its regular non-hidden files,
  recursively, in sorted order). A ``.jsonl`` file holds one document per line, the
  string at ``--field``; a ``.parquet`` or ``.arrow`` file (what Hugging Face ``datasets``
  writes with ``to_parquet`` and ``save_to_disk``) one per row of the column ``--field``,
  read with pyarrow; any other file is one UTF-8 document. Each is wrapped the way the
  tokenizer's post-processor wraps one sequence (Llama 3: ``<|begin_of_text|>`` before
  it) and followed by ``--eos TOKEN`` when given.
- **Tasks**: the main process cuts the input into tasks of about :data:`TASK_BYTES` (at
  most ``--shard-tokens`` bytes): a byte range of a JSONL file (whole lines) or of a text
  file (ending after a newline whose next line starts with a non-space character), or a
  record batch of a table's column. A worker reads, parses and tokenizes its task itself
  and sends back ids in the output dtype, so the main process only plans, orders and
  writes, and the workers scale with the cores. Tasks come back in order, at most two per
  worker in flight; they do not depend on the worker count, and neither do the shards.
- **Output**: ``DIR/shard-00000.bin``, ... of at least ``--shard-tokens`` tokens each (a
  shard ends at a task boundary), raw ids in the dtype the vocabulary needs
  (:func:`~holmes_jax.runtime.data.loader.token_dtype_for`), each written whole then
  renamed, with its sidecar (:mod:`~holmes_jax.runtime.data.shards`: dtype, tokens,
  documents, largest id, vocabulary, tokenizer); then ``DIR/index.json``, which lists them
  all, so a reader opens the set with one read.
- **Resume**: ``DIR/prepare-state.json`` records the finished shards and how many tasks
  they hold; a run stopped at any point and started again with the same arguments skips
  those tasks (planned, not read or tokenized) and writes exactly the shards an
  uninterrupted run writes. Other arguments on a directory with a state are a one-line
  error.
- **Bad input**: a ``.jsonl`` line that is not JSON or lacks a string ``--field`` is a
  one-line error naming the file and line; with ``--skip-bad`` it is skipped, and the
  lines skipped are counted in the last line printed. Text that is not UTF-8 is a
  one-line error naming the file and byte.

Inside a task, long documents are encoded in pieces of about :data:`PIECE_CHARS`
characters (tokenizers slow down on megabyte strings), cut like text ranges. For regex
pre-tokenizers (GPT-2, Llama 3) such a cut is a pre-token boundary, so the ids equal those
of encoding the whole document; a tokenizer for which a probe shows otherwise (a
SentencePiece normalizer that prefixes every sequence) gets each document whole, and each
text file as one task.
"""

from __future__ import annotations

import collections
import itertools
import json
import multiprocessing
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from holmes_jax.core.errors import ConfigError, one_line
from holmes_jax.runtime.data import tasks as planned
from holmes_jax.runtime.data.loader import token_dtype_for
from holmes_jax.runtime.data.shards import INDEX, SIDECAR
from holmes_jax.runtime.data.tasks import Task, inputs, line_at

TASK_BYTES = 1 << 20  # input per task sent to a worker (1 MiB)
PIECE_CHARS = 1 << 18  # text per encoded piece (256 Ki characters)
SHARD_TOKENS = 1 << 26  # default --shard-tokens: 67M tokens, 128 MiB of uint16
STATE = "prepare-state.json"
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


@dataclass(frozen=True)
class _Settings:
    """What every task is tokenized with (sent to each worker once)."""

    tokenizer: str
    prefix: tuple[int, ...]  # ids before each document (the post-processor's)
    suffix: tuple[int, ...]  # ids after it (the post-processor's, then --eos)
    field: str
    skip_bad: bool
    whole: bool  # documents are never cut (the cut probe failed)
    piece_chars: int
    dtype: str


@dataclass
class _Done:
    """A task's ids and what it met."""

    ids: np.ndarray  # (tokens,) in the output dtype
    documents: int = 0
    max_id: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> JSONL lines
    bad: tuple[int, str] | None = None  # (byte offset of the first bad line, reason)
    error: str | None = None  # the task cannot be read: the one line to raise


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
    prefix, suffix = wrap_ids(tok)
    if req.eos is not None:
        eos_id = tok.token_to_id(req.eos)
        if eos_id is None:
            raise ConfigError(f"--eos={req.eos!r}: not a token of {req.tokenizer}")
        suffix = [*suffix, eos_id]
    settings = _Settings(
        req.tokenizer, tuple(prefix), tuple(suffix), req.field, req.skip_bad,
        whole=not _cuts_are_safe(tok), piece_chars=PIECE_CHARS, dtype=token_dtype_for(vocab),
    )  # fmt: skip
    files = inputs(req.inputs)
    out = Path(req.out)
    if not out.parent.is_dir():
        raise ConfigError(f"--out={req.out}: directory {out.parent} does not exist")
    if (out / INDEX).exists():
        raise ConfigError(f"--out={req.out}: holds a finished shard set ({INDEX}); use another")
    plan = {"task_bytes": min(TASK_BYTES, req.shard_tokens), "piece_chars": PIECE_CHARS}
    state = _resume_state(out, req, plan)
    writer = _Writer(out, req, settings.dtype, vocab, state)
    tasks = planned.tasks(files, req.field, settings.whole, plan["task_bytes"])
    total = sum(os.path.getsize(f) for f in files)
    bar = tqdm(total=total, desc="tokenizing", unit="B", unit_scale=True, disable=not progress)
    bar.update(state["bytes"])
    began, tokens = time.perf_counter(), 0
    with _Workers(settings, workers) as run:
        for task, done in run(itertools.islice(tasks, state["tasks"], None)):
            if done.error:
                raise ConfigError(done.error)
            if done.bad and not (req.skip_bad and writer.first_skipped):
                where = f"{task.path}:{line_at(task.path, done.bad[0])}"
                if not req.skip_bad:
                    raise ConfigError(
                        f"--input: {where}: {done.bad[1]} (--field={req.field}; --skip-bad "
                        "skips such lines)"
                    )
                writer.first_skipped = where
            writer.add(done, task.size)
            tokens += len(done.ids)
            bar.update(task.size)
            bar.set_postfix_str(f"{tokens / max(time.perf_counter() - began, 1e-9):,.0f} tokens/s")
    bar.close()
    return writer.finish()


def _resume_state(out: Path, req: Request, plan: dict) -> dict:
    """The state of a stopped run in ``out`` with these arguments, else a fresh one."""
    fresh = {"request": req.key(), "plan": plan, "shards": [], "tasks": 0, "bytes": 0}
    fresh.update(skipped={}, first_skipped="")
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
    if state.get("plan") != plan:
        raise ConfigError(
            f"--out={req.out}: holds a prepare stopped by another version, with tasks "
            f"{state.get('plan')} where this one makes {plan}; start it again in another --out"
        )
    return state


class _Writer:
    """Fills shards in task order and writes each whole, with its sidecar and the state."""

    def __init__(self, out: Path, req: Request, dtype: str, vocab: int, state: dict):
        self.out, self.req, self.dtype, self.vocab, self.state = out, req, dtype, vocab, state
        self.shard = _Shard()
        self.tasks, self.bytes = state["tasks"], state["bytes"]
        self.skipped: dict[str, int] = dict(state["skipped"])
        self.first_skipped: str = state["first_skipped"]

    def add(self, done: _Done, size: int) -> None:
        s = self.shard
        s.parts.append(done.ids)
        s.tokens += len(done.ids)
        s.documents += done.documents
        s.max_id = max(s.max_id, done.max_id)
        for reason, n in done.skipped.items():
            self.skipped[reason] = self.skipped.get(reason, 0) + n
        self.tasks += 1
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
                    f.write(part.tobytes())
            os.replace(tmp, self.out / name)
        except OSError as e:
            raise ConfigError(f"--out={self.req.out}: cannot be written ({one_line(e)})") from None
        entry = {"path": name, "tokens": s.tokens, "documents": s.documents, "max_id": s.max_id}
        side = {"dtype": self.dtype, **entry, "vocab_size": self.vocab}
        side.update(tokenizer=os.path.abspath(self.req.tokenizer), eos=self.req.eos)
        del side["path"]
        _write_json(self.out / (name + SIDECAR), side)
        self.state["shards"].append(entry)
        self.state.update(tasks=self.tasks, bytes=self.bytes, skipped=self.skipped)
        self.state["first_skipped"] = self.first_skipped
        _write_json(self.out / STATE, self.state)  # after the shard: a resume never loses one
        self.shard = _Shard()

    def finish(self) -> str:
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
        skipped = ""
        if self.skipped:
            kinds = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items()))
            lines = sum(self.skipped.values())
            skipped = f"; skipped {lines} bad line(s) ({kinds}; the first {self.first_skipped})"
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


# ----------------------------------------------------------------------------- workers

_SET: _Settings | None = None  # each worker's settings and tokenizer (_load_worker)
_TOKENIZER = None


def _load_worker(settings: _Settings) -> None:
    global _SET, _TOKENIZER
    _SET, _TOKENIZER = settings, load_tokenizer(settings.tokenizer)


def _work(task: Task) -> _Done:
    """Read, parse and tokenize one task (in a worker)."""
    s = _SET
    skipped, bad = {}, None
    if task.kind == "table":
        docs = [text for text in task.column.to_pylist() if isinstance(text, str)]
    else:
        with open(task.path, "rb") as f:
            f.seek(task.start)
            data = f.read(task.stop - task.start)
        if task.kind == "jsonl":
            docs, skipped, bad = _jsonl(data, task.start, s.field)
            if bad and not s.skip_bad:
                return _Done(np.zeros(0, s.dtype), bad=bad)
        else:
            try:
                docs = [data.decode("utf-8")]
            except UnicodeDecodeError as e:
                return _Done(np.zeros(0, s.dtype), error=(
                    f"--input: {task.path} is not UTF-8 text (byte {task.start + e.start}: "
                    f"{e.reason})"
                ))  # fmt: skip
    pieces = [
        (text, first, last)
        for doc in docs
        for text, first, last in _cut(doc, s.whole, s.piece_chars)
    ]
    if task.kind == "text":  # a range is part of its file's one document
        pieces = [(text, first and task.first, last and task.last) for text, first, last in pieces]
    ids = _encode(pieces, s)
    return _Done(
        ids, documents=sum(last for *_, last in pieces),
        max_id=int(ids.max()) if len(ids) else 0, skipped=skipped, bad=bad,
    )  # fmt: skip


def _encode(pieces: list[tuple[str, bool, bool]], s: _Settings) -> np.ndarray:
    """The ids of ``pieces``, with the prefix on a document's first piece and the suffix
    on its last, a few pieces at a time (long strings encode slower)."""
    encode = getattr(_TOKENIZER, "encode_batch_fast", _TOKENIZER.encode_batch)
    group = max(1, TASK_BYTES // s.piece_chars)
    ids: list[int] = []
    for i in range(0, len(pieces), group):
        chunk = pieces[i : i + group]
        for (_, first, last), enc in zip(
            chunk, encode([text for text, *_ in chunk], add_special_tokens=False), strict=True
        ):
            if first:
                ids += s.prefix
            ids += enc.ids
            if last:
                ids += s.suffix
    return np.array(ids, dtype=s.dtype)


def _jsonl(data: bytes, start: int, key: str):
    """The documents of whole JSONL lines ``data`` (at byte ``start`` of their file), the
    bad lines by reason, and the first bad line's (offset, reason)."""
    docs, skipped, bad = [], {}, None
    at = start
    for raw in data.split(b"\n"):
        offset, at = at, at + len(raw) + 1
        if not raw.strip():
            continue
        try:
            value = json.loads(raw)
            reason = None if isinstance(value, dict) else "not a JSON object"
        except ValueError:
            reason = "not JSON"
        if reason is None:
            value = value.get(key)
            reason = None if isinstance(value, str) else f"no string {key!r}"
        if reason is not None:
            skipped[reason] = skipped.get(reason, 0) + 1
            bad = bad or (offset, reason)
            continue
        docs.append(value)
    return docs, skipped, bad


def _cut(text: str, whole: bool, piece_chars: int) -> Iterator[tuple[str, bool, bool]]:
    """(text, first, last) pieces of one document, cut after newlines whose next line
    starts with a non-space character (module doc). An empty document is one empty
    piece."""
    if whole or len(text) <= piece_chars:
        yield text, True, True
        return
    lines = text.split("\n")
    lines = [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
    pieces, piece, size = [], [], 0
    for line in lines:
        if size >= piece_chars and line[:1].strip():
            pieces.append("".join(piece))
            piece, size = [], 0
        piece.append(line)
        size += len(line)
    pieces.append("".join(piece))
    for i, p in enumerate(pieces):
        yield p, i == 0, i == len(pieces) - 1


class _Workers:
    """``run(tasks)``: yields ``(task, done)`` in task order, from ``workers`` processes
    (None: one per core; 1: this process), with at most two tasks per worker in flight
    (a table's batches are read no faster than they are tokenized)."""

    def __init__(self, settings: _Settings, workers: int | None):
        self.settings = settings
        self.workers = workers or len(os.sched_getaffinity(0))
        self.pool = None

    def __enter__(self):
        if self.workers > 1:
            # spawned, not forked: the tokenizer's threads (or jax's, in a notebook) would
            # hold locks a forked child can never take
            ctx = multiprocessing.get_context("spawn")
            self.pool = ctx.Pool(self.workers, _load_worker, (self.settings,))
        else:
            _load_worker(self.settings)
        return self.run

    def run(self, tasks: Iterable[Task]) -> Iterator[tuple[Task, _Done]]:
        if self.pool is None:
            for task in tasks:
                yield task, _work(task)
            return
        window = collections.deque()
        for task in tasks:
            window.append((task, self.pool.apply_async(_work, (task,))))
            if len(window) > 2 * self.workers:
                done, result = window.popleft()
                yield done, result.get()
        while window:
            done, result = window.popleft()
            yield done, result.get()

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
