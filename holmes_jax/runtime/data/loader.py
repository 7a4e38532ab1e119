"""Training data: a byte tokenizer, corpora, and deterministic, per-process batches.

Three sources, chosen by ``data.source``:

- ``stdlib`` (the embedded default): the running interpreter's standard-library ``.py``
  sources, read as raw bytes in sorted relative-path order, so every machine with Python
  has the same offline corpus. ``site-packages`` / ``dist-packages`` are skipped.
- ``text``: one text file (split by its tail) or a directory of text files (split by file).
  Byte tokenizer, like ``stdlib``.
- ``tokens``: a set of pre-tokenized shards, raw ``uint16`` / ``uint32`` ids with their
  sidecars (:mod:`holmes_jax.runtime.data.shards`: a file, a directory, a glob or a list,
  local or remote), never read whole into memory; eval is the last ``eval_fraction`` of
  the set's tokens. ``python -m holmes_jax.data prepare`` writes them from a Hugging Face
  tokenizer (:mod:`holmes_jax.runtime.data.prepare`). A sidecar's ``dtype`` must equal
  ``data.token_dtype``, because a uint32 file read as uint16 passes every other check.

Multi-file sources are split *by file*, so eval text is never seen in training: files are
ranked by the CRC-32 of their relative path and the lowest-ranked go to eval until they
hold ``eval_fraction`` of the bytes (at least one file, never all of them).

Batches are a pure function of ``(seed, step)`` (:class:`BatchSampler`): a resumed run only
needs the step to see exactly the batches an uninterrupted run sees. A window never crosses
a shard's end. Each process gathers only the rows of the global batch that its devices
hold (:func:`local_rows`) and :func:`make_batch` assembles the global ``jax.Array`` from
them.

Nothing happens at import time, and jax is imported only inside :func:`local_rows` and
:func:`global_array`.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from holmes_jax.core.errors import ConfigError
from holmes_jax.runtime.data.shards import TOKEN_DTYPES, ShardSet, check_shards, list_shards

if TYPE_CHECKING:
    import jax

    from holmes_jax.core.sections import DataConfig

SOURCES = ("stdlib", "text", "tokens")
TOKENS_SIDECAR = ".json"  # <token file>.json: {"dtype": ..., "tokens": ..., ...}
BYTE_VOCAB_SIZE = 256
# Directories under the stdlib that hold third-party packages, not the standard library.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


class ByteTokenizer:
    """UTF-8 bytes as token ids: ids 0..255, no special tokens."""

    vocab_size = BYTE_VOCAB_SIZE

    def encode(self, text: str) -> np.ndarray:
        """Encodes text as its UTF-8 bytes.

        Args:
            text: any string.

        Returns:
            uint16 ids, shape [num_bytes].
        """
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Any) -> str:
        """Decodes ids back to text; invalid UTF-8 becomes U+FFFD.

        Args:
            ids: integer ids, any shape (flattened). Ids outside 0..255 (a model with a
                padded vocabulary may sample them) decode to U+FFFD.

        Returns:
            The decoded string.
        """
        ids = np.asarray(ids, dtype=np.int64).ravel()
        # 0xFF never occurs in valid UTF-8, so it decodes to U+FFFD under errors="replace".
        ids = np.where((ids >= 0) & (ids < BYTE_VOCAB_SIZE), ids, 0xFF)
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


@dataclass(frozen=True, eq=False)
class Corpus:
    """A tokenized corpus split into train and eval.

    Attributes:
        train: 1-D token ids (np.ndarray or np.memmap, dtype uint8/uint16/uint32), or a
            shard set (``data.source=tokens``).
        eval: the same kind, disjoint text from ``train``.
        description: one human-readable line (source, size of each split).
        names: a mixture's source names (``data.mixture``); ``train`` is then a list of
            shard sets, one per source, in this order, and ``eval`` None.
        weights: a mixture's weight per source, summing to 1.
        evals: the named held-out sets, evaluated and logged by name: a mixture's
            sources' tails, then ``data.eval``'s sets.
    """

    train: np.ndarray | ShardSet | list[ShardSet]
    eval: np.ndarray | ShardSet | None
    description: str
    names: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()
    evals: dict[str, ShardSet] = field(default_factory=dict)


# ----------------------------------------------------------------------------- loading


def load_corpus(cfg: DataConfig, vocab_size: int) -> Corpus:
    """Loads the corpus named by a data config.

    Args:
        cfg: the ``data`` section: ``source`` ('stdlib' | 'text' | 'tokens'), ``path``,
            ``token_dtype`` ('uint16' | 'uint32'), ``eval_fraction`` (0 < f < 1) and
            ``max_bytes`` (cap on bytes read for the byte-level sources ``stdlib`` and
            ``text``; 0 = no cap; a ``tokens`` memmap costs nothing to open and is not
            capped).
        vocab_size: the model's vocabulary size; every token id must be below it.

    Returns:
        The train and eval token arrays and a one-line description.

    Raises:
        ConfigError: a bad source, dtype, fraction, cap or path; a missing, empty or
            misaligned file; a token id >= vocab_size; a byte corpus with vocab_size < 256.
    """
    source, path = cfg.source, cfg.path
    if source not in SOURCES:
        raise ConfigError(f"data.source={source!r}: must be one of {', '.join(SOURCES)}")
    frac = cfg.eval_fraction
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac < 1:
        raise ConfigError(f"data.eval_fraction={frac!r}: must be a number with 0 < f < 1")
    max_bytes = cfg.max_bytes
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ConfigError(f"data.max_bytes={max_bytes!r}: must be an integer >= 0 (0 = no cap)")

    if source == "tokens":
        if cfg.token_dtype not in TOKEN_DTYPES:
            raise ConfigError(
                f"data.token_dtype={cfg.token_dtype!r}: must be one of {', '.join(TOKEN_DTYPES)}"
            )
        if cfg.mixture:
            corpus = _load_mixture(cfg, vocab_size)
        elif not path:
            raise ConfigError(f"data.path={path!r}: must be set for data.source='tokens'")
        else:
            corpus = _load_tokens(path, cfg.token_dtype, frac, vocab_size)
        evals = {e.name: _load_tokens(e.path, cfg.token_dtype, None, vocab_size) for e in cfg.eval}
        held = {name: c.train for name, c in evals.items()}
        return replace(corpus, evals={**corpus.evals, **held})

    if vocab_size < BYTE_VOCAB_SIZE:
        raise ConfigError(
            f"model.vocab_size={vocab_size}: must be >= {BYTE_VOCAB_SIZE} for the byte "
            f"tokenizer of data.source={source!r}"
        )
    if source == "stdlib":
        if path is not None:
            raise ConfigError(
                f"data.path={path!r}: must be unset for data.source='stdlib' "
                "(the corpus is the interpreter's standard library)"
            )
        root = Path(sysconfig.get_paths()["stdlib"])
        files = _list_files(root, suffix=".py", skip_dirs=_STDLIB_SKIP_DIRS)
        return _load_byte_files(root, files, frac, max_bytes, label="stdlib")

    p = _existing_path(path, source)
    if p.is_file():
        return _load_text_file(p, frac, max_bytes)
    files = _list_files(p, suffix="", skip_dirs=frozenset())
    if not files:
        raise ConfigError(f"data.path={path!r}: directory holds no (non-hidden) files")
    if len(files) == 1:
        return _load_text_file(p / files[0], frac, max_bytes)
    return _load_byte_files(p, files, frac, max_bytes, label="text")


def _existing_path(path: str | None, source: str) -> Path:
    """The path of a text source, checked to exist."""
    if not path:
        raise ConfigError(f"data.path={path!r}: must be set for data.source={source!r}")
    if not isinstance(path, str):
        raise ConfigError(f"data.path={list(path)}: data.source={source!r} reads one path")
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"data.path={path!r}: file does not exist")
    return p


def token_dtype_for(vocab_size: int) -> str:
    """The token file dtype of a vocabulary: ``uint16`` when every id fits, else ``uint32``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def text_files(root: Path) -> list[str]:
    """The files ``data.source=text`` reads from a directory, in its order (sorted relative
    POSIX paths; hidden files and directories skipped)."""
    return _list_files(root, suffix="", skip_dirs=frozenset())


def _list_files(root: Path, suffix: str, skip_dirs: frozenset[str]) -> list[str]:
    """Regular files under root as sorted relative POSIX paths (hidden entries skipped)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk never descends into skipped or hidden directories.
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        rel = Path(dirpath).relative_to(root)
        for name in filenames:
            if name.endswith(suffix) and not name.startswith("."):
                if os.path.isfile(os.path.join(dirpath, name)):
                    out.append((rel / name).as_posix())
    return sorted(out)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _load_byte_files(
    root: Path, files: list[str], frac: float, max_bytes: int, label: str
) -> Corpus:
    """Reads files in order up to max_bytes (the last one truncated) and splits by file."""
    chunks: list[bytes] = []
    total = 0
    for rel in files:
        if max_bytes and total >= max_bytes:
            break
        data = (root / rel).read_bytes()
        if max_bytes:
            data = data[: max_bytes - total]
        chunks.append(data)
        total += len(data)
    names = files[: len(chunks)]
    if len(chunks) < 2:
        raise ConfigError(
            f"data.max_bytes={max_bytes}: reads only {len(chunks)} file(s) of {root}; "
            "need at least 2 to split train and eval by file"
        )

    # Eval = the files with the lowest CRC-32 of their path, until they hold frac of the
    # bytes; at least one file, never all. Deterministic and independent of the OS.
    order = sorted(range(len(names)), key=lambda i: (zlib.crc32(names[i].encode()), names[i]))
    is_eval = [False] * len(names)
    eval_bytes = 0
    for i in order[:-1]:
        if eval_bytes >= frac * total:
            break
        is_eval[i] = True
        eval_bytes += len(chunks[i])
    if eval_bytes == 0 or eval_bytes == total:
        raise ConfigError(
            f"data.max_bytes={max_bytes}: the {len(names)} file(s) read from {root} give an "
            "empty train or eval split"
        )

    train = b"".join(c for c, e in zip(chunks, is_eval, strict=True) if not e)
    ev = b"".join(c for c, e in zip(chunks, is_eval, strict=True) if e)
    n_eval_files = sum(is_eval)
    description = (
        f"{label} ({root}): {len(names)} files ({len(names) - n_eval_files} train, "
        f"{n_eval_files} eval), {_mb(len(train))} train, {_mb(len(ev))} eval"
    )
    return Corpus(
        train=np.frombuffer(train, dtype=np.uint8),
        eval=np.frombuffer(ev, dtype=np.uint8),
        description=description,
    )


def _tail_split(tokens: np.ndarray, frac: float) -> tuple[np.ndarray, np.ndarray]:
    """Splits off the last frac of tokens as eval (both parts non-empty; views, no copy)."""
    n = len(tokens)
    n_eval = min(max(int(round(n * frac)), 1), n - 1)
    return tokens[: n - n_eval], tokens[n - n_eval :]


def _load_text_file(path: Path, frac: float, max_bytes: int) -> Corpus:
    """One text file as bytes via memmap (capped at max_bytes), eval = its tail."""
    size = path.stat().st_size
    if size < 2:
        raise ConfigError(f"data.path='{path}': file has {size} bytes, needs at least 2")
    tokens = np.memmap(path, dtype=np.uint8, mode="r")  # [size]
    if max_bytes:
        tokens = tokens[:max_bytes]
    train, ev = _tail_split(tokens, frac)
    description = f"text ({path}): {_mb(len(train))} train, {_mb(len(ev))} eval (tail)"
    return Corpus(train=train, eval=ev, description=description)


def _load_tokens(path, dtype_name: str, frac: float | None, vocab_size: int) -> Corpus:
    """A shard set (``path``: :func:`~holmes_jax.runtime.data.shards.list_shards`); eval =
    the tail of its tokens (``frac`` None: no eval, the whole set is ``train``). Checks
    every shard against the dtype and the vocabulary."""
    shards = check_shards(list_shards(path, dtype_name), vocab_size)
    total = sum(s.tokens for s in shards)
    if total < 2:
        raise ConfigError(f"data.path={path}: holds {total} tokens, needs >= 2")
    where = shards[0].url if len(shards) == 1 else f"{len(shards)} shards from {path}"
    whole = ShardSet.of_shards(shards, vocab_size, where)
    if frac is None:
        return Corpus(train=whole, eval=None, description=f"{where}: {whole.tokens:,} tokens")
    train, ev = whole.split_tail(frac)
    description = (
        f"tokens ({where}, {dtype_name}): {train.tokens:,} train tokens, {ev.tokens:,} eval tokens"
    )
    return Corpus(train=train, eval=ev, description=description)


def _load_mixture(cfg: DataConfig, vocab_size: int) -> Corpus:
    """``data.mixture``: each source's shard set, its tail held out as ``evals[name]``."""
    parts = [
        _load_tokens(m.path, cfg.token_dtype, cfg.eval_fraction, vocab_size) for m in cfg.mixture
    ]
    total = sum(m.weight for m in cfg.mixture)
    weights = tuple(m.weight / total for m in cfg.mixture)
    names = tuple(m.name for m in cfg.mixture)
    each = ", ".join(
        f"{n} {w:.0%} ({p.train.tokens:,})" for n, w, p in zip(names, weights, parts, strict=True)
    )
    return Corpus(
        train=[p.train for p in parts], eval=None, names=names, weights=weights,
        evals={n: p.eval for n, p in zip(names, parts, strict=True)},
        description=f"tokens ({cfg.token_dtype}): a mixture of {each} train tokens",
    )  # fmt: skip


# ----------------------------------------------------------------------------- batches


def as_shards(tokens: np.ndarray | ShardSet, seq_len: int, split: str) -> ShardSet:
    """``tokens`` as a shard set, checked to hold a window of ``seq_len + 1`` tokens."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ConfigError(f"model.seq_len={seq_len!r}: must be an integer >= 1")
    if not isinstance(tokens, ShardSet):
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        tokens = ShardSet.of_array(tokens, split)
    if tokens.positions(seq_len + 1) < 1:
        longest = max((r.length for r in tokens.ranges), default=0)
        raise ConfigError(
            f"model.seq_len={seq_len}: the {split} split has {tokens.tokens} tokens, "
            f"{longest} in its longest shard, fewer than seq_len + 1 = {seq_len + 1}"
        )
    return tokens


GOLDEN = 0.6180339887498949  # the offsets of mixture_rows: a low-discrepancy sequence


def mixture_rows(
    weights: np.ndarray, rows: int, step: int, seed: int, steps: int = 1
) -> np.ndarray:
    """Rows of each source in step ``step``'s batch of ``rows``: every source its quota
    ``rows·w`` rounded down, and the leftover rows by systematic sampling over the quotas'
    fractions at the offset ``frac((step + seed)·φ)``, so each gets its quota rounded down
    or up, the counts sum to ``rows``, and over N steps every source's rows are within
    O(log N) of ``N·rows·w`` (a Weyl sequence visits each fraction's arc in proportion).

    Args:
      weights: [S] non-negative, summing to 1.
      steps: the counts of steps ``[step, step + steps)``, summed (vectorised).
    Returns:
      int64 [S].
    """
    quota = rows * weights
    base = np.floor(quota).astype(np.int64)
    left = rows - int(base.sum())
    total = base * steps
    if left == 0:
        return total
    ends = np.cumsum(quota - base)
    ends[-1] = left  # the fractions sum to ``left`` up to rounding
    for first in range(step, step + steps, _STEPS_AT_ONCE):
        at = np.arange(first, min(first + _STEPS_AT_ONCE, step + steps), dtype=np.int64)
        offset = ((at + seed) * GOLDEN) % 1.0  # [n]
        hits = np.searchsorted(ends, (offset[:, None] + np.arange(left)).ravel(), side="right")
        total += np.bincount(hits, minlength=len(weights))
    return total


_STEPS_AT_ONCE = 1 << 14  # mixture_rows: steps per vectorised chunk (memory: this x sources)


class BatchSampler:
    """Random windows of a token array, a shard set or a weighted mixture of them, a pure
    function of (seed, step).

    Batches have no hidden state, so resuming at step k sees exactly the batches an
    uninterrupted run sees; the data position in a checkpoint is just the step. A mixture's
    batch holds each source's rows in proportion to its weight (:func:`mixture_rows`), in
    an order shuffled per step, so any window of it (a DiLoCo island's) is a mixture too.
    """

    def __init__(
        self,
        tokens: np.ndarray | ShardSet | list[ShardSet],
        seq_len: int,
        global_batch_size: int,
        seed: int,
        *,
        split: str = "train",
        window: tuple[int, int] | None = None,
        weights: list[float] | None = None,
    ):
        """Creates a sampler.

        Args:
            tokens: 1-D token ids (may be a memmap), a shard set, or a list of shard sets
                (a mixture, with ``weights``).
            seq_len: tokens per input row; each row holds seq_len + 1 tokens.
            global_batch_size: rows in the global batch B.
            seed: non-negative data seed.
            split: name used in error messages.
            window: ``(offset, rows)``: this sampler's batch is rows ``[offset, offset +
                rows)`` of the B-row batch (an independent DiLoCo island's share); its
                ``global_batch_size`` is then ``rows``.
            weights: a mixture's weight per set (non-negative, a positive sum).

        Raises:
            ConfigError: the split is shorter than seq_len + 1 tokens, or a bad
                batch size or seed.
        """
        sets = tokens if isinstance(tokens, list) else [tokens]
        self.sets = [as_shards(t, seq_len, split) for t in sets]
        w = np.asarray(weights if weights is not None else [1.0] * len(sets), np.float64)
        if len(w) != len(sets) or (w < 0).any() or not w.sum() > 0:
            raise ConfigError(f"data.mixture weights {w.tolist()}: must be >= 0, sum > 0")
        self.weights = w / w.sum()
        if global_batch_size < 1:
            raise ConfigError(f"train.global_batch_size={global_batch_size}: must be >= 1")
        if seed < 0:
            raise ConfigError(f"train.seed={seed}: must be >= 0")
        self.seq_len = int(seq_len)
        self.drawn = int(global_batch_size)  # rows drawn per step
        self.offset, self.global_batch_size = window or (0, self.drawn)
        self.seed = int(seed)

    def draws(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(set, window position) of each row at ``step`` (of the window's rows), int64
        [B] each; with one set, the positions alone are what they always were."""
        if step < 0:
            raise ValueError(f"step={step}: must be >= 0")
        rng = np.random.default_rng((self.seed, step))
        width = self.seq_len + 1
        if len(self.sets) == 1:
            pos = rng.integers(0, self.sets[0].positions(width), size=self.drawn)
            src = np.zeros(self.drawn, np.int64)
        else:
            counts = mixture_rows(self.weights, self.drawn, step, self.seed)
            src = np.repeat(np.arange(len(self.sets)), counts)
            pos = np.concatenate(
                [
                    rng.integers(0, s.positions(width), size=c)
                    for s, c in zip(self.sets, counts, strict=True)
                ]
            )
            order = rng.permutation(self.drawn)
            src, pos = src[order], pos[order]
        cut = slice(self.offset, self.offset + self.global_batch_size)
        return src[cut], pos[cut]

    def source_rows(self, step: int) -> np.ndarray:
        """Rows of each set in this sampler's batch at ``step``, int64 [sets]."""
        return np.bincount(self.draws(step)[0], minlength=len(self.sets))

    def source_rows_before(self, step: int) -> np.ndarray:
        """Rows of each set in this sampler's batches at steps ``[0, step)``, int64 [sets]:
        summed in closed form for the whole batch, one draw a step for a window of it."""
        if len(self.sets) == 1:
            return np.array([self.global_batch_size * step], np.int64)
        if self.global_batch_size == self.drawn:
            return mixture_rows(self.weights, self.drawn, 0, self.seed, steps=step)
        return sum((self.source_rows(s) for s in range(step)), np.zeros(len(self.sets), np.int64))

    def rows_and_sources(self, step: int, row_indices: np.ndarray):
        """``(rows(step, row_indices), source_rows(step))``, from one draw."""
        src, pos = self.draws(step)
        pick = np.asarray(row_indices, dtype=np.int64)  # [R]
        return self._read(src[pick], pos[pick]), np.bincount(src, minlength=len(self.sets))

    def rows(self, step: int, row_indices: np.ndarray) -> np.ndarray:
        """Selected rows of the global batch at step.

        Args:
            step: training step (>= 0).
            row_indices: indices into the global batch, shape [R].

        Returns:
            int32 [R, seq_len + 1]; inputs are [:, :-1], targets [:, 1:].
        """
        return self.rows_and_sources(step, row_indices)[0]

    def global_batch(self, step: int) -> np.ndarray:
        """All rows at step: int32 [B, seq_len + 1]."""
        return self._read(*self.draws(step))

    def _read(self, src: np.ndarray, pos: np.ndarray) -> np.ndarray:
        out = np.empty((len(src), self.seq_len + 1), np.int32)
        for i in np.unique(src):
            rows = np.flatnonzero(src == i)
            out[rows] = self.sets[i].read(pos[rows], self.seq_len + 1)
        return out


def eval_batches(
    tokens: np.ndarray | ShardSet, seq_len: int, batch_size: int, num_batches: int
) -> list[np.ndarray]:
    """Fixed eval batches spread evenly over a split.

    The num_batches * batch_size windows start at evenly spaced offsets from the first to
    the last possible start, so they cover the split and do not overlap where it is long
    enough.

    Args:
        tokens: 1-D eval token ids, or a shard set.
        seq_len: tokens per input row.
        batch_size: rows per batch.
        num_batches: number of batches.

    Returns:
        num_batches arrays, each int32 [batch_size, seq_len + 1].

    Raises:
        ConfigError: the split is shorter than seq_len + 1 tokens, or a count is < 1.
    """
    tokens = as_shards(tokens, seq_len, "eval")
    if batch_size < 1 or num_batches < 1:
        raise ConfigError(
            f"eval batch_size={batch_size}, num_batches={num_batches}: both must be >= 1"
        )
    n = batch_size * num_batches
    starts = np.linspace(0, tokens.positions(seq_len + 1) - 1, n).astype(np.int64)  # [n]
    windows = tokens.read(starts, seq_len + 1)  # [n, seq_len + 1]
    return list(windows.reshape(num_batches, batch_size, seq_len + 1))


# ----------------------------------------------------------------------------- sharding


def local_rows(sharding: jax.sharding.Sharding, global_batch_size: int) -> np.ndarray:
    """Global-batch rows this process must supply for a [B, T] array with this sharding.

    The union of the row ranges of this process's addressable devices, sorted: exactly the
    rows ``jax.make_array_from_process_local_data`` expects as local data, in its order.

    Args:
        sharding: sharding of the [B, T] batch.
        global_batch_size: B.

    Returns:
        int64 [R] sorted unique row indices (R = B on a single process).
    """
    # Any T works for the row indices; the device count is divisible by any sharding of it.
    shape = (global_batch_size, len(sharding.device_set))
    rows = np.arange(global_batch_size)
    index_map = sharding.addressable_devices_indices_map(shape)
    return np.unique(np.concatenate([rows[index[0]] for index in index_map.values()]))


def make_batch(sampler: BatchSampler, step: int, sharding: jax.sharding.Sharding) -> jax.Array:
    """The global batch at step as a sharded array, built from this process's rows only.

    Args:
        sampler: the batch sampler.
        step: training step.
        sharding: sharding of the [B, seq_len + 1] batch.

    Returns:
        int32 jax.Array [B, seq_len + 1] with the given sharding.
    """
    rows = sampler.global_batch_size
    return global_array(sampler.rows(step, local_rows(sharding, rows)), sharding, rows)


def global_array(local: np.ndarray, sharding: jax.sharding.Sharding, rows: int) -> jax.Array:
    """The global ``[rows, T + 1]`` batch as a sharded array, from this process's rows
    (int32 ``[R, T + 1]``, in :func:`local_rows`' order)."""
    import jax

    return jax.make_array_from_process_local_data(sharding, local, (rows, local.shape[1]))
