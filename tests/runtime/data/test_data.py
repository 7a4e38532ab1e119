"""Tests for holmes_jax.runtime.data.loader: tokenizer, corpora, deterministic sampling, batches."""

import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from holmes_jax.core.errors import ConfigError
from holmes_jax.runtime.data import loader as data
from holmes_jax.runtime.data import shards


@dataclass(frozen=True)
class DataCfg:
    """Stand-in for DataConfig (its attribute names; no checks before the loader's)."""

    source: str = "stdlib"
    path: str | None = None
    token_dtype: str = "uint16"
    eval_fraction: float = 0.05
    max_bytes: int = 2_000_000
    mixture: tuple = ()
    eval: tuple = ()


@pytest.fixture(scope="module")
def stdlib_corpus() -> data.Corpus:
    return data.load_corpus(DataCfg(), vocab_size=256)


# ----------------------------------------------------------------------------- tokenizer


def test_byte_tokenizer_round_trip():
    tok = data.ByteTokenizer()
    text = "def f(x):\n    return 'héllo ✓ 🚀'\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint16
    assert len(ids) == len(text.encode("utf-8"))
    assert ids.max() < tok.vocab_size == 256
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text
    # Invalid UTF-8 and ids outside 0..255 become U+FFFD instead of raising.
    assert tok.decode([0x68, 0xC3, 0x69]) == "h\ufffdi"
    assert tok.decode([0x68, 300, 0x69]) == "h\ufffdi"


# ----------------------------------------------------------------------------- stdlib


def test_stdlib_corpus_deterministic_and_capped(stdlib_corpus):
    again = data.load_corpus(DataCfg(), vocab_size=256)
    assert np.array_equal(stdlib_corpus.train, again.train)
    assert np.array_equal(stdlib_corpus.eval, again.eval)
    assert stdlib_corpus.description == again.description
    n_train, n_eval = len(stdlib_corpus.train), len(stdlib_corpus.eval)
    assert n_train > 0 and n_eval > 0
    assert n_train + n_eval == 2_000_000  # the stdlib is far larger: exactly at the cap
    assert stdlib_corpus.train.dtype == np.uint8
    assert "stdlib" in stdlib_corpus.description

    small = data.load_corpus(DataCfg(max_bytes=300_000), vocab_size=256)
    assert len(small.train) + len(small.eval) == 300_000


def _stdlib_files() -> tuple[Path, list[str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return root, data._list_files(root, ".py", data._STDLIB_SKIP_DIRS)


def test_stdlib_listing_sorted_without_site_packages():
    _, files = _stdlib_files()
    assert files == sorted(files)
    assert len(files) > 100
    assert not any("site-packages" in f or "dist-packages" in f for f in files)
    assert "os.py" in files


def test_stdlib_eval_files_disjoint_from_train(stdlib_corpus):
    """Rebuild the split from the files: each file lies wholly in train or wholly in eval."""
    root, files = _stdlib_files()
    train, ev = stdlib_corpus.train.tobytes(), stdlib_corpus.eval.tobytes()
    pos_train = pos_eval = total = 0
    n_eval_files = 0
    for rel in files:
        if total >= 2_000_000:
            break
        blob = (root / rel).read_bytes()[: 2_000_000 - total]
        total += len(blob)
        if train[pos_train : pos_train + len(blob)] == blob:
            pos_train += len(blob)
        else:
            assert ev[pos_eval : pos_eval + len(blob)] == blob, rel
            pos_eval += len(blob)
            n_eval_files += 1
    assert (pos_train, pos_eval) == (len(train), len(ev))
    assert n_eval_files >= 1
    # The eval split is about eval_fraction of the bytes, by file.
    assert 0.05 <= len(ev) / total < 0.2


def test_eval_split_rule_picks_lowest_crc_files(tmp_path):
    names = [f"f{i:02d}.txt" for i in range(20)]
    for i, n in enumerate(names):
        (tmp_path / n).write_bytes(bytes([65 + i]) * 100)
    corpus = data.load_corpus(
        DataCfg(source="text", path=str(tmp_path), eval_fraction=0.1), vocab_size=256
    )
    lowest = sorted(names, key=lambda n: zlib.crc32(n.encode()))[:2]
    expected_eval = b"".join(bytes([65 + names.index(n)]) * 100 for n in sorted(lowest))
    assert corpus.eval.tobytes() == expected_eval
    assert len(corpus.train) == 1800


# ----------------------------------------------------------------------------- sampler


def test_sampler_is_a_pure_function_of_seed_and_step(stdlib_corpus):
    s = data.BatchSampler(stdlib_corpus.train, seq_len=64, global_batch_size=8, seed=3)
    b5 = s.global_batch(5)
    assert b5.shape == (8, 65) and b5.dtype == np.int32
    # A fresh sampler (a resumed run) sees the same batch, in any call order.
    s2 = data.BatchSampler(stdlib_corpus.train, seq_len=64, global_batch_size=8, seed=3)
    s2.global_batch(9)
    assert np.array_equal(s2.global_batch(5), b5)
    assert not np.array_equal(s.global_batch(6), b5)
    other_seed = data.BatchSampler(stdlib_corpus.train, seq_len=64, global_batch_size=8, seed=4)
    assert not np.array_equal(other_seed.global_batch(5), b5)
    idx = np.array([1, 4, 7])
    assert np.array_equal(s.rows(5, idx), b5[idx])


def test_targets_are_inputs_shifted_by_one():
    tokens = np.arange(1000, dtype=np.uint16)  # each window is a run of consecutive ids
    s = data.BatchSampler(tokens, seq_len=16, global_batch_size=4, seed=0)
    batch = s.global_batch(0)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    assert np.array_equal(targets, inputs + 1)
    assert np.array_equal(inputs[:, 1:], targets[:, :-1])
    # Windows reach the last token and never past it.
    big = data.BatchSampler(
        np.arange(18, dtype=np.uint16), seq_len=16, global_batch_size=64, seed=0
    )
    starts = big.global_batch(0)[:, 0]
    assert set(starts.tolist()) == {0, 1}


def test_eval_batches_fixed_and_spread():
    tokens = np.arange(10_000, dtype=np.uint32)
    batches = data.eval_batches(tokens, seq_len=31, batch_size=4, num_batches=3)
    assert len(batches) == 3
    assert all(b.shape == (4, 32) and b.dtype == np.int32 for b in batches)
    starts = np.concatenate([b[:, 0] for b in batches])
    assert starts[0] == 0 and starts[-1] == 10_000 - 32  # covers the whole split
    assert np.all(np.diff(starts) >= 32)  # non-overlapping
    again = data.eval_batches(tokens, seq_len=31, batch_size=4, num_batches=3)
    assert all(np.array_equal(a, b) for a, b in zip(batches, again, strict=True))


# ----------------------------------------------------------------------------- files


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_memmap_round_trip(tmp_path, dtype):
    vocab = 1000 if dtype == "uint16" else 100_000
    tokens = np.random.default_rng(0).integers(0, vocab, size=5000).astype(dtype)
    path = tmp_path / f"tokens.{dtype}.bin"
    tokens.tofile(path)
    corpus = data.load_corpus(
        DataCfg(source="tokens", path=str(path), token_dtype=dtype, eval_fraction=0.1), vocab
    )
    assert (corpus.train.tokens, corpus.eval.tokens) == (4500, 500)
    each = [split.read(np.arange(split.tokens), 1)[:, 0] for split in (corpus.train, corpus.eval)]
    assert np.array_equal(np.concatenate(each), tokens)  # windows of 1: every token, in order
    batch = data.BatchSampler(corpus.train, seq_len=8, global_batch_size=2, seed=0).global_batch(0)
    assert batch.max() < vocab


def test_token_file_out_of_vocab(tmp_path):
    path = tmp_path / "t.bin"
    tokens = np.zeros(3 * shards._SCAN_CHUNK // 2, dtype=np.uint16)
    tokens[-1] = 512  # in the second scan chunk
    tokens.tofile(path)
    cfg = DataCfg(source="tokens", path=str(path))
    assert data.load_corpus(cfg, vocab_size=513).train.tokens > 0
    with pytest.raises(ConfigError, match="512") as err:
        data.load_corpus(cfg, vocab_size=512)
    _assert_one_line(err, "model.vocab_size")


def test_text_file(tmp_path):
    path = tmp_path / "book.txt"
    text = "It was the best of times, it was the worst of times. " * 40
    path.write_text(text)
    corpus = data.load_corpus(DataCfg(source="text", path=str(path), eval_fraction=0.25), 256)
    n = len(text)
    assert len(corpus.eval) == round(n * 0.25)
    assert data.ByteTokenizer().decode(np.concatenate([corpus.train, corpus.eval])) == text
    capped = data.load_corpus(
        DataCfg(source="text", path=str(path), eval_fraction=0.25, max_bytes=1000), 256
    )
    assert len(capped.train) + len(capped.eval) == 1000


def test_text_dir(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".hidden").write_text("never read")
    contents = {"a.txt": "alpha " * 50, "b.txt": "bravo " * 50, "sub/c.md": "charlie " * 50}
    for rel, text in contents.items():
        (tmp_path / rel).write_text(text)
    corpus = data.load_corpus(DataCfg(source="text", path=str(tmp_path)), 256)
    tok = data.ByteTokenizer()
    train, ev = tok.decode(corpus.train), tok.decode(corpus.eval)
    assert "never" not in train + ev
    assert len(train) + len(ev) == sum(len(t) for t in contents.values())
    for text in contents.values():  # split by file: each file wholly in one split
        assert (text in train) != (text in ev)
    assert train and ev
    assert data.load_corpus(DataCfg(source="text", path=str(tmp_path)), 256).eval.tobytes() == (
        corpus.eval.tobytes()
    )

    single = tmp_path / "single"
    single.mkdir()
    (single / "only.txt").write_text("x" * 100)
    one = data.load_corpus(DataCfg(source="text", path=str(single), eval_fraction=0.1), 256)
    assert (len(one.train), len(one.eval)) == (90, 10)


# ----------------------------------------------------------------------------- errors


def _assert_one_line(err: pytest.ExceptionInfo, key: str) -> None:
    msg = str(err.value)
    assert "\n" not in msg, msg
    assert key in msg, msg


def _bad_inputs(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00\x01\x02")
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    empty_dir = tmp_path / "empty_dir"
    empty_dir.mkdir()
    return [
        (DataCfg(source="foo"), 256, "data.source"),
        (DataCfg(source="tokens", path=str(tmp_path / "x" / "y.bin")), 256, "data.path"),
        (DataCfg(source="tokens", path=None), 256, "data.path"),
        (DataCfg(source="tokens", path=str(odd), token_dtype="int8"), 256, "data.token_dtype"),
        (DataCfg(source="tokens", path=str(odd)), 256, "data.path"),  # 3 bytes: not uint16
        (DataCfg(source="tokens", path=str(tmp_path)), 256, "data.path"),  # a directory
        (DataCfg(source="text", path=str(empty)), 256, "data.path"),
        (DataCfg(source="text", path=str(empty_dir)), 256, "data.path"),
        (DataCfg(eval_fraction=0.0), 256, "data.eval_fraction"),
        (DataCfg(eval_fraction=1.0), 256, "data.eval_fraction"),
        (DataCfg(max_bytes=-1), 256, "data.max_bytes"),
        (DataCfg(max_bytes=10), 256, "data.max_bytes"),  # one file: no split by file
        (DataCfg(path="/tmp"), 256, "data.path"),  # stdlib takes no path
        (DataCfg(), 128, "model.vocab_size"),  # bytes need 256 ids
    ]


def test_bad_inputs_raise_one_line_config_error(tmp_path):
    for cfg, vocab, key in _bad_inputs(tmp_path):
        with pytest.raises(ConfigError) as err:
            data.load_corpus(cfg, vocab)
        _assert_one_line(err, key)


def test_split_too_short_for_one_sequence():
    tokens = np.arange(64, dtype=np.uint16)
    data.BatchSampler(tokens, seq_len=63, global_batch_size=2, seed=0)  # exactly fits
    with pytest.raises(ConfigError) as err:
        data.BatchSampler(tokens, seq_len=64, global_batch_size=2, seed=0)
    _assert_one_line(err, "seq_len")
    with pytest.raises(ConfigError) as err:
        data.eval_batches(tokens, seq_len=64, batch_size=2, num_batches=1)
    _assert_one_line(err, "seq_len")
    assert "eval" in str(err.value)


# ----------------------------------------------------------------------------- sharding


@pytest.fixture(scope="module")
def mesh() -> jax.sharding.Mesh:
    assert jax.device_count() == 8, "tests/conftest.py sets 8 simulated CPU devices"
    return jax.make_mesh(
        (4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
    )


def test_local_rows_single_process_holds_every_row(mesh):
    sharding = NamedSharding(mesh, P("data", None))
    rows = data.local_rows(sharding, 16)
    assert np.array_equal(rows, np.arange(16))


def test_local_rows_of_a_device_subset(mesh):
    """A sharding whose addressable devices are a subset stands in for one host of many."""

    class OneHost:
        def __init__(self, inner, devices):
            self.inner, self.devices = inner, set(devices)
            self.device_set = inner.device_set

        def addressable_devices_indices_map(self, shape):
            full = self.inner.devices_indices_map(shape)
            return {d: i for d, i in full.items() if d in self.devices}

    sharding = NamedSharding(mesh, P("data", None))
    grid = mesh.devices  # [data=4, tensor=2]
    # "Host" = data rows 1 and 3 (both tensor devices each): rows 4..7 and 12..15 of 16.
    host = OneHost(sharding, list(grid[1]) + list(grid[3]))
    assert np.array_equal(data.local_rows(host, 16), np.r_[4:8, 12:16])


def test_make_batch_equals_global_batch(mesh):
    sharding = NamedSharding(mesh, P("data", None))
    tokens = np.random.default_rng(1).integers(0, 256, size=10_000).astype(np.uint8)
    sampler = data.BatchSampler(tokens, seq_len=32, global_batch_size=8, seed=7)
    for step in (0, 3):
        batch = data.make_batch(sampler, step, sharding)
        assert batch.shape == (8, 33) and batch.dtype == np.int32
        assert batch.sharding == sharding
        np.testing.assert_array_equal(np.asarray(batch), sampler.global_batch(step))
        # Each device holds its 2 rows (4 data shards), replicated over tensor.
        for shard in batch.addressable_shards:
            assert shard.data.shape == (2, 33)
            np.testing.assert_array_equal(
                np.asarray(shard.data), sampler.global_batch(step)[shard.index]
            )
