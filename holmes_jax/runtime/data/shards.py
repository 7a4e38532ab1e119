"""Token shard sets: raw token files, local or remote, opened by their sidecars and read
a window at a time.

A shard is a raw token file (native little-endian ``uint16`` / ``uint32`` ids, nothing
else), usually with a sidecar ``<shard>.json``: ``dtype``, ``tokens``, and where known
``max_id`` (its largest id), ``vocab_size`` and ``tokenizer`` (of the tokenizer that wrote
it) and ``documents``. ``python -m holmes_jax.data prepare`` writes them, and an
``index.json`` (the same fields for every shard) beside a directory of shards.

``data.path`` names a set (:func:`open_shards`): a file; a directory (the shards its
``index.json`` lists, else its ``*.bin`` files, recursively, in sorted order); a glob
(``data/*.bin``); or a list of these, in order. Each may be a local path or an fsspec URL:
``gs://`` (with gcsfs installed), ``s3://`` (s3fs), ``memory://`` (tests). Opening a set
reads its index or its sidecars (never a shard); local shards are memory-mapped, remote
ones read by byte ranges, a window at a time.

Checked when the set is opened, before anything compiles, each a one-line
:class:`~holmes_jax.core.errors.ConfigError` naming the shard: nothing matches; a shard
missing or unreadable; a sidecar that is not JSON, or whose ``dtype`` is not
``data.token_dtype``; a size that is not a whole number of ids or disagrees with the
sidecar; a ``max_id`` >= ``model.vocab_size``; two tokenizers in one set. A local shard
without a sidecar is read as ``data.token_dtype`` and scanned once for its largest id; a
remote one is checked window by window. Every window read is checked again
(:meth:`ShardSet.read`), so an id changed after the open never reaches the model.
"""

from __future__ import annotations

import json
import posixpath
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from holmes_jax.core.errors import ConfigError, one_line

SIDECAR = ".json"  # <shard>.json
INDEX = "index.json"  # a directory's list of shards (prepare writes it)
SHARD_SUFFIX = ".bin"  # what a directory without an index holds
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_GLOB = frozenset("*?[")
_SCAN_CHUNK = 1 << 22  # ids per chunk when scanning a local shard for its largest id
_SIDECAR_READERS = 16  # sidecars read at once from a remote store


class DataError(RuntimeError):
    """Tokens read during training that break a rule checked at the open (a shard
    changed or truncated since)."""


@dataclass(frozen=True)
class Shard:
    """One token file and what its sidecar (or index entry) says of it."""

    url: str  # a local path or an fsspec URL
    tokens: int
    dtype: str
    max_id: int | None = None
    vocab_size: int | None = None
    tokenizer: str | None = None
    documents: int | None = None


def _fs(url: str):
    """(fsspec file system, path on it) of a local path or URL; a one-line error for a
    scheme whose package is not installed."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        raise ConfigError(f"data.path={url}: cannot be opened ({one_line(e)})") from None


def _is_local(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _url(fs, path: str) -> str:
    """The URL of ``path`` on ``fs`` (a plain path for the local file system)."""
    return path if _is_local(fs) else fs.unstrip_protocol(path)


# ----------------------------------------------------------------------------- opening


def list_shards(spec: str | tuple[str, ...] | list[str], token_dtype: str) -> list[Shard]:
    """The shards ``spec`` names (module doc), in order, with their sidecars read.

    Raises:
      ConfigError: nothing there, an unreadable sidecar or index, a sidecar that
        disagrees with ``token_dtype`` or with the file's size.
    """
    entries = [spec] if isinstance(spec, str) else list(spec)
    if not entries:
        raise ConfigError("data.path=[]: must name at least one shard, directory or glob")
    shards: list[Shard] = []
    for entry in entries:
        if not isinstance(entry, str) or not entry:
            raise ConfigError(f"data.path={entry!r}: must be a path, a glob or a URL")
        shards += _entry(entry, token_dtype)
    return shards


def _entry(entry: str, token_dtype: str) -> list[Shard]:
    fs, path = _fs(entry)
    if _GLOB & set(path):
        found = fs.glob(path, detail=True)
        files = {p: info["size"] for p, info in found.items() if _is_shard_name(p, glob=True)}
        if not files:
            raise ConfigError(f"data.path={entry}: the glob matches no file")
        return _with_sidecars(fs, files, token_dtype)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise ConfigError(
            f"data.path={entry}: no such file or directory; python -m holmes_jax.data prepare "
            f"--tokenizer HF_DIR --input TEXT --out {entry} writes token shards there"
        ) from None
    except OSError as e:
        raise ConfigError(f"data.path={entry}: cannot be read ({one_line(e)})") from None
    if info["type"] != "directory":
        return _with_sidecars(fs, {path: info["size"]}, token_dtype)
    index = posixpath.join(path, INDEX)
    if fs.exists(index):
        return _from_index(fs, path, index, token_dtype)
    found = fs.find(path, detail=True)
    files = {p: i["size"] for p, i in sorted(found.items()) if _is_shard_name(p, glob=False)}
    if not files:
        raise ConfigError(
            f"data.path={entry}: the directory holds no {INDEX} and no *{SHARD_SUFFIX} shard "
            "(python -m holmes_jax.data prepare writes both)"
        )
    return _with_sidecars(fs, files, token_dtype)


def _is_shard_name(path: str, glob: bool) -> bool:
    name = posixpath.basename(path)
    if name.startswith(".") or name.endswith(SIDECAR):
        return False
    return glob or name.endswith(SHARD_SUFFIX)


def _read_json(fs, path: str, what: str):
    try:
        with fs.open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        where = _url(fs, path)
        raise ConfigError(f"data.path: {what} {where} cannot be read ({one_line(e)})") from None


def _with_sidecars(fs, files: dict[str, int], token_dtype: str) -> list[Shard]:
    """Shards of ``files`` ({path: bytes}), each with its sidecar when it has one."""
    paths = list(files)
    if _is_local(fs) or len(paths) < 2:
        metas = [_read_json(fs, p + SIDECAR, "sidecar") for p in paths]
    else:  # one request each: many at once hide the store's latency
        with ThreadPoolExecutor(_SIDECAR_READERS) as pool:
            metas = list(pool.map(lambda p: _read_json(fs, p + SIDECAR, "sidecar"), paths))
    return [_shard(fs, p, files[p], m, token_dtype) for p, m in zip(paths, metas, strict=True)]


def _from_index(fs, root: str, index: str, token_dtype: str) -> list[Shard]:
    meta = _read_json(fs, index, "index")
    where = _url(fs, index)
    if not isinstance(meta, dict) or not isinstance(meta.get("shards"), list):
        raise ConfigError(f"data.path: index {where} must hold a list 'shards'")
    out = []
    for i, entry in enumerate(meta["shards"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise ConfigError(f"data.path: index {where}: shards[{i}] must name its 'path'")
        fields = {**{k: meta.get(k) for k in ("dtype", "vocab_size", "tokenizer")}, **entry}
        out.append(_shard(fs, posixpath.join(root, entry["path"]), None, fields, token_dtype))
    if not out:
        raise ConfigError(f"data.path: index {where} lists no shard")
    return out


def _shard(fs, path: str, size: int | None, meta, token_dtype: str) -> Shard:
    """A shard from its size in bytes (None: trust ``meta``'s count) and its sidecar or
    index entry ``meta`` (None: no sidecar)."""
    url = _url(fs, path)
    itemsize = np.dtype(TOKEN_DTYPES[token_dtype]).itemsize
    if meta is None:
        if size % itemsize:
            raise ConfigError(
                f"data.path: {url} has {size} bytes, not a whole number of "
                f"{token_dtype} ids (data.token_dtype)"
            )
        return Shard(url, size // itemsize, token_dtype)
    if not isinstance(meta, dict):
        raise ConfigError(f"data.path: the sidecar of {url} must be a JSON object")
    dtype = meta.get("dtype", token_dtype)
    if dtype != token_dtype:
        raise ConfigError(
            f"data.token_dtype={token_dtype!r}: {url} holds {dtype} tokens (its sidecar says "
            f"so); set data.token_dtype={dtype}"
        )
    tokens = meta.get("tokens", None if size is None else size // itemsize)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ConfigError(f"data.path: the sidecar of {url}: tokens={tokens!r} must be >= 0")
    if size is not None and size != tokens * itemsize:
        raise ConfigError(
            f"data.path: {url} has {size} bytes, its sidecar says {tokens} {dtype} tokens "
            f"({tokens * itemsize} bytes): truncated, or not the file it describes"
        )
    ints = {k: meta.get(k) for k in ("max_id", "vocab_size", "documents")}
    for k, v in ints.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ConfigError(f"data.path: the sidecar of {url}: {k}={v!r} must be >= 0")
    tokenizer = meta.get("tokenizer")
    return Shard(url, tokens, dtype, tokenizer=tokenizer if isinstance(tokenizer, str) else None,
                 **ints)  # fmt: skip


def check_shards(shards: list[Shard], vocab_size: int) -> list[Shard]:
    """``shards`` with every largest id known and below ``vocab_size`` (a local shard
    without one is scanned; a remote one is left to the window checks); one tokenizer.

    Raises:
      ConfigError: an id >= ``vocab_size``; shards of two tokenizers.
    """
    named = {s.tokenizer: s for s in shards if s.tokenizer}
    if len(named) > 1:
        (a, sa), (b, sb) = list(named.items())[:2]
        raise ConfigError(
            f"data.path: shards of two tokenizers in one set: {sa.url} ({a}) and {sb.url} ({b})"
        )
    out = []
    for s in shards:
        if s.max_id is None and s.tokens:
            fs, path = _fs(s.url)
            if _is_local(fs):
                ids = np.memmap(path, dtype=TOKEN_DTYPES[s.dtype], mode="r", shape=(s.tokens,))
                chunks = range(0, s.tokens, _SCAN_CHUNK)  # streamed once, never held whole
                s = replace(s, max_id=max(int(ids[i : i + _SCAN_CHUNK].max()) for i in chunks))
        if s.max_id is not None and s.max_id >= vocab_size:
            raise ConfigError(
                f"data.path: {s.url} holds token id {s.max_id}, must be < "
                f"model.vocab_size={vocab_size}"
            )
        out.append(s)
    return out


# ----------------------------------------------------------------------------- reading


class _ArrayPart:
    """Tokens held in memory or memory-mapped: windows by fancy indexing."""

    def __init__(self, ids: np.ndarray, name: str):
        self.ids, self.name = ids, name

    def windows(self, offsets: np.ndarray, width: int) -> np.ndarray:
        idx = offsets[:, None] + np.arange(width, dtype=np.int64)  # [n, width]
        return np.asarray(self.ids[idx], dtype=np.int32)


class _RangePart:
    """A remote shard: one byte-range request per window (fsspec's ``cat_ranges``, which
    async stores such as gcsfs and s3fs send at once)."""

    def __init__(self, shard: Shard):
        self.fs, self.path = _fs(shard.url)
        self.dtype = np.dtype(TOKEN_DTYPES[shard.dtype])
        self.name = shard.url

    def windows(self, offsets: np.ndarray, width: int) -> np.ndarray:
        size = self.dtype.itemsize
        starts = [int(o) * size for o in offsets]
        ends = [s + width * size for s in starts]
        try:
            bodies = self.fs.cat_ranges([self.path] * len(starts), starts, ends)
        except OSError as e:
            raise DataError(f"{self.name}: read failed ({one_line(e)})") from None
        out = np.empty((len(starts), width), np.int32)
        for i, body in enumerate(bodies):
            if isinstance(body, BaseException) or len(body) != width * size:
                raise DataError(
                    f"{self.name}: tokens {offsets[i]}..{offsets[i] + width} could not be read "
                    "whole (the shard is shorter than its sidecar says)"
                )
            out[i] = np.frombuffer(body, self.dtype)
        return out


@dataclass(frozen=True)
class _Range:
    part: _ArrayPart | _RangePart
    start: int  # first token of the range in the part
    length: int


class ShardSet:
    """Token ranges read as one sequence of windows that never cross a range's end.

    Positions (:meth:`positions`) number every window start of every range in order:
    range r holds ``max(0, length_r - width + 1)`` of them. A set of one range is a plain
    token array, its positions its offsets.
    """

    def __init__(self, ranges: list[_Range], vocab_size: int | None, description: str):
        self.ranges, self.vocab_size, self.description = ranges, vocab_size, description
        self.tokens = sum(r.length for r in ranges)

    @classmethod
    def of_array(cls, ids: np.ndarray, name: str, vocab_size: int | None = None) -> ShardSet:
        return cls([_Range(_ArrayPart(ids, name), 0, len(ids))], vocab_size, name)

    @classmethod
    def of_shards(cls, shards: list[Shard], vocab_size: int, description: str) -> ShardSet:
        ranges = []
        for s in shards:
            fs, path = _fs(s.url)
            if _is_local(fs):
                ids = np.memmap(path, dtype=TOKEN_DTYPES[s.dtype], mode="r", shape=(s.tokens,))
                part: _ArrayPart | _RangePart = _ArrayPart(ids, s.url)
            else:
                part = _RangePart(s)
            if s.tokens:
                ranges.append(_Range(part, 0, s.tokens))
        return cls(ranges, vocab_size, description)

    def positions(self, width: int) -> int:
        """How many windows of ``width`` tokens start in the set."""
        return sum(max(0, r.length - width + 1) for r in self.ranges)

    def read(self, positions: np.ndarray, width: int) -> np.ndarray:
        """The windows at ``positions`` (each < :meth:`positions`), int32 [n, width].

        Raises:
          DataError: a window holds an id >= the vocabulary, or could not be read whole.
        """
        positions = np.asarray(positions, dtype=np.int64)
        counts = np.array([max(0, r.length - width + 1) for r in self.ranges], np.int64)
        ends = np.cumsum(counts)  # [ranges]
        which = np.searchsorted(ends, positions, side="right")  # [n]
        out = np.empty((len(positions), width), np.int32)
        for r in np.unique(which):
            rows = np.flatnonzero(which == r)
            rng = self.ranges[r]
            offsets = positions[rows] - (ends[r] - counts[r]) + rng.start
            out[rows] = rng.part.windows(offsets, width)
        if self.vocab_size is not None and out.size and int(out.max()) >= self.vocab_size:
            row = int(np.argmax(out.max(axis=1)))
            raise DataError(
                f"data.path: a window at position {int(positions[row])} holds token id "
                f"{int(out[row].max())}, >= model.vocab_size={self.vocab_size} (a shard "
                "changed since it was opened?)"
            )
        return out

    def split_tail(self, frac: float) -> tuple[ShardSet, ShardSet]:
        """(head, tail): the tail holds the last ``frac`` of the tokens (at least one,
        never all), across range ends where it must."""
        n = self.tokens
        keep = n - min(max(int(round(n * frac)), 1), n - 1)
        head, tail, seen = [], [], 0
        for r in self.ranges:
            cut = min(max(keep - seen, 0), r.length)
            if cut:
                head.append(_Range(r.part, r.start, cut))
            if r.length - cut:
                tail.append(_Range(r.part, r.start + cut, r.length - cut))
            seen += r.length
        return (
            ShardSet(head, self.vocab_size, self.description),
            ShardSet(tail, self.vocab_size, self.description),
        )
