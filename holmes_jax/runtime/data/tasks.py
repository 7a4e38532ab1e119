"""``prepare``'s input cut into tasks: byte ranges of text and JSONL files, record
batches of Parquet and Arrow tables (:mod:`~holmes_jax.runtime.data.prepare`'s module doc
says how they are cut and why).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from holmes_jax.core.errors import ConfigError, one_line
from holmes_jax.runtime.data.loader import text_files

TABLE_SUFFIXES = (".parquet", ".arrow")
SCAN = 1 << 16  # bytes read at a time looking for a task's end


@dataclass(frozen=True)
class Task:
    """One worker's input: ``kind`` "text" or "jsonl" with the byte range [start, stop)
    of ``path``, or "table" with ``column`` (a pyarrow array of strings). ``size`` is the
    input bytes it stands for (the progress bar's unit)."""

    kind: str
    path: str
    size: int
    start: int = 0
    stop: int = 0
    first: bool = True  # text: the range opens its file's document
    last: bool = True  # text: the range closes it
    column: Any = None


def inputs(inputs: tuple[str, ...]) -> list[Path]:
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


def tasks(files: list[Path], key: str, whole: bool, task_bytes: int) -> Iterator[Task]:
    """The tasks of ``files``, in order (module doc)."""
    for path in files:
        suffix = path.suffix.lower()
        if suffix in TABLE_SUFFIXES:
            yield from _table_tasks(path, key, task_bytes)
            continue
        kind = "jsonl" if suffix == ".jsonl" else "text"
        size = path.stat().st_size
        if kind == "text" and whole:
            yield Task(kind, str(path), size, 0, size)
            continue
        for start, stop in ranges(path, size, task_bytes, text=kind == "text"):
            yield Task(kind, str(path), stop - start, start, stop, start == 0, stop == size)


def ranges(path: Path, size: int, task_bytes: int, text: bool) -> Iterator[tuple[int, int]]:
    """Byte ranges covering ``path``, each ending at its first cut (:func:`next_cut`)
    after ``task_bytes``; an empty file is one empty range."""
    start = 0
    with open(path, "rb") as f:
        while True:
            far = start + task_bytes
            stop = size if far >= size else next_cut(f, far, size, text)
            yield start, stop
            if stop >= size:
                return
            start = stop


def next_cut(f, pos: int, size: int, text: bool) -> int:
    """The first offset >= ``pos`` just after a newline (``text``: one whose next line
    starts with a non-space character), or ``size``."""
    at = pos - 1
    while at < size:
        f.seek(at)
        block = f.read(SCAN + 4)  # 4 bytes past the scan: the next line's first character
        i = block.find(b"\n")
        while 0 <= i < SCAN:
            cut = at + i + 1
            if not text or cut >= size or _opens_line(block[i + 1 : i + 5]):
                return min(cut, size)
            i = block.find(b"\n", i + 1)
        at += SCAN
    return size


def _opens_line(head: bytes) -> bool:
    """Whether the UTF-8 ``head`` starts with a non-space character (a safe cut)."""
    char = head.decode("utf-8", "replace")[:1]
    return char not in ("", "\ufffd") and not char.isspace()


def line_at(path: str, offset: int) -> int:
    """The 1-based line of ``path`` holding byte ``offset``."""
    lines, read = 1, 0
    with open(path, "rb") as f:
        while read < offset:
            block = f.read(min(SCAN * 16, offset - read))
            if not block:
                break
            lines += block.count(b"\n")
            read += len(block)
    return lines


def _table_tasks(path: Path, key: str, task_bytes: int) -> Iterator[Task]:
    """Record batches of column ``key`` of a Parquet or Arrow file, about ``task_bytes``
    of text each (a Parquet file's, by its metadata; an Arrow file's as written)."""
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
            rows = pf.metadata.num_rows
            batch_rows = max(1, rows * task_bytes // max(_text_bytes(pf.metadata, key), 1))
            batches = pf.iter_batches(batch_size=batch_rows, columns=[key])
        else:
            batches = list(_arrow_batches(pa, path, key))  # memory-mapped: headers only
            rows = sum(b.num_rows for b in batches)
        size, read, told = path.stat().st_size, 0, 0
        for batch in batches:
            read += batch.num_rows
            share = size * read // max(rows, 1) - told
            told += share
            yield Task("table", str(path), share, column=batch.column(0))
    except (OSError, pa.ArrowException) as e:
        raise ConfigError(f"--input: {path} cannot be read ({one_line(e)})") from None


def _text_bytes(meta, key: str) -> int:
    """The uncompressed bytes of column ``key`` in a Parquet file's metadata."""
    leaves = [i for i in range(meta.num_columns) if meta.schema.column(i).path == key]
    return sum(
        meta.row_group(g).column(i).total_uncompressed_size
        for g in range(meta.num_row_groups)
        for i in leaves
    )


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
