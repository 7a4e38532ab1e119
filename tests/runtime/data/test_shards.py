"""Token shard sets (holmes_jax.runtime.data.shards): files, directories, globs and lists,
local and on an in-memory remote store, their checks, and the windows read from them."""

import json
import uuid

import fsspec
import numpy as np
import pytest

from holmes_jax.core.config import load_config
from holmes_jax.core.errors import ConfigError
from holmes_jax.runtime.data import loader
from holmes_jax.runtime.data.shards import INDEX, DataError, ShardSet, check_shards, list_shards

LENGTHS = (300, 40, 517)  # tokens per shard; the 40-token one holds no window of 64
VOCAB = 1000


def write_shard(fs, path, ids, **meta):
    """A shard and its sidecar on ``fs`` (``meta`` overrides the sidecar's fields)."""
    with fs.open(path, "wb") as f:
        f.write(ids.tobytes())
    side = {"dtype": str(ids.dtype), "tokens": len(ids), "max_id": int(ids.max()), **meta}
    with fs.open(path + ".json", "wb") as f:
        f.write(json.dumps(side).encode())


def shard_ids(i, n):
    """Shard ``i``'s ids: ``i`` in the top digits, the offset below (each id says where it
    is), all < VOCAB."""
    return (i * 300 + np.arange(n) % 300).astype(np.uint16)


def make_set(fs, root, index=False):
    """Three shards under ``root``; with ``index`` an index.json and no sidecars."""
    fs.makedirs(root, exist_ok=True)
    entries = []
    for i, n in enumerate(LENGTHS):
        path = f"{root}/part-{i:05d}.bin"
        write_shard(fs, path, shard_ids(i, n))
        entries.append(
            {"path": f"part-{i:05d}.bin", "tokens": n, "max_id": int(shard_ids(i, n).max())}
        )
        if index:
            fs.rm(path + ".json")
    if index:
        with fs.open(f"{root}/{INDEX}", "wb") as f:
            f.write(json.dumps({"dtype": "uint16", "shards": entries}).encode())


@pytest.fixture
def local(tmp_path):
    fs = fsspec.filesystem("file")
    make_set(fs, str(tmp_path / "set"))
    return tmp_path / "set"


@pytest.fixture
def remote():
    """The same set on an in-memory store (what gs:// or s3:// would be), its URL."""
    fs = fsspec.filesystem("memory")
    root = f"/{uuid.uuid4().hex}"
    make_set(fs, root)
    yield f"memory://{root}"
    fs.rm(root, recursive=True)


def urls(found):
    return [s.url.rsplit("/", 1)[1] for s in found]


NAMES = [f"part-{i:05d}.bin" for i in range(3)]


def test_files_directories_globs_and_lists_name_the_same_shards(local):
    as_dir = list_shards(str(local), "uint16")
    assert urls(as_dir) == NAMES and [s.tokens for s in as_dir] == list(LENGTHS)
    assert list_shards(str(local / "part-*.bin"), "uint16") == as_dir
    files = [str(local / n) for n in NAMES]
    assert list_shards(files, "uint16") == as_dir
    assert list_shards((files[2], str(local / "part-0000[01].bin")), "uint16") == [
        as_dir[2],
        *as_dir[:2],
    ]
    (local / "README").write_text("not a shard")  # a directory's shards are its *.bin files
    assert list_shards(str(local), "uint16") == as_dir


def test_an_index_is_the_only_file_opened(tmp_path, monkeypatch):
    fs = fsspec.filesystem("file")
    make_set(fs, str(tmp_path / "set"), index=True)
    opened = []
    real = type(fs).open
    monkeypatch.setattr(
        type(fs), "open", lambda self, p, *a, **k: opened.append(p) or real(self, p, *a, **k)
    )
    found = list_shards(str(tmp_path / "set"), "uint16")
    assert [s.tokens for s in found] == list(LENGTHS) and urls(found) == NAMES
    assert [p.rsplit("/", 1)[1] for p in opened] == [INDEX]


def test_a_thousand_shards_open_by_their_sidecars_alone(monkeypatch):
    fs = fsspec.filesystem("memory")
    root = f"/{uuid.uuid4().hex}"
    for i in range(1000):
        write_shard(fs, f"{root}/s{i:04d}.bin", np.full(8, i % VOCAB, np.uint16))
    opened = []
    real = type(fs).open
    monkeypatch.setattr(
        type(fs), "open", lambda self, p, *a, **k: opened.append(p) or real(self, p, *a, **k)
    )
    found = list_shards(f"memory://{root}", "uint16")
    assert len(found) == 1000 and sum(s.tokens for s in found) == 8000
    assert len(opened) == 1000 and all(p.endswith(".bin.json") for p in opened)
    fs.rm(root, recursive=True)


def windows(spec, seq_len=63, steps=5, batch=16):
    """The batches of a sampler over the shard set ``spec``, steps 0..steps-1."""
    found = check_shards(list_shards(spec, "uint16"), VOCAB)
    sampler = loader.BatchSampler(ShardSet.of_shards(found, VOCAB, "test"), seq_len, batch, seed=3)
    return [sampler.global_batch(step) for step in range(steps)]


def test_a_remote_set_reads_the_windows_a_local_one_does(local, remote):
    got, want = windows(remote), windows(str(local))
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_window_never_crosses_a_shard_end(local):
    for batch in windows(str(local), steps=20):
        shard, offset = batch // 300, batch % 300
        assert (shard == shard[:, :1]).all()  # one shard per row
        assert (np.diff(offset, axis=1) % 300 == 1).all()  # consecutive ids within it
        assert not (shard == 1).any()  # the 40-token shard holds no 64-token window


def test_one_shard_draws_the_batches_of_its_array(tmp_path):
    ids = np.random.default_rng(0).integers(0, VOCAB, 5000).astype(np.uint16)
    write_shard(fsspec.filesystem("file"), str(tmp_path / "one.bin"), ids)
    array = loader.BatchSampler(ids, 31, 8, seed=3)  # windows()' seed
    assert all(
        np.array_equal(a, array.global_batch(step))
        for step, a in enumerate(windows(str(tmp_path / "one.bin"), seq_len=31, batch=8))
    )


def test_the_tail_split_crosses_shard_ends(local):
    found = list_shards(str(local), "uint16")
    whole = ShardSet.of_shards(found, VOCAB, "test")
    head, tail = whole.split_tail(0.1)  # 86 of 857 tokens: the last shard's last 86
    assert (head.tokens, tail.tokens) == (771, 86)
    head, tail = whole.split_tail(0.7)  # 600: all of shard 2, 40 of 1, 43 of 0
    assert [r.length for r in tail.ranges] == [43, 40, 517] and tail.ranges[0].start == 257
    every = lambda s: s.read(np.arange(s.tokens), 1)[:, 0]  # noqa: E731 (windows of 1)
    assert np.array_equal(np.concatenate([every(head), every(tail)]), every(whole))


def one_line(err, *words):
    msg = str(err.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_bad_sets_are_one_line_errors(local):
    fs = fsspec.filesystem("file")
    cases = [
        (str(local / "*.tokens"), "uint16", "matches no file"),
        (str(local / "gone.bin"), "uint16", "no such file"),
        ([], "uint16", "at least one"),
        (str(local), "uint32", "data.token_dtype=uint16"),  # the sidecars say uint16
    ]
    for spec, dtype, words in cases:
        with pytest.raises(ConfigError) as err:
            list_shards(spec, dtype)
        one_line(err, "data.", words)
    empty = local / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError) as err:
        list_shards(str(empty), "uint16")
    one_line(err, "no index.json and no *.bin")
    (local / "part-00001.bin.json").write_text("{not json")
    with pytest.raises(ConfigError) as err:
        list_shards(str(local), "uint16")
    one_line(err, "part-00001.bin.json", "cannot be read")
    write_shard(fs, str(local / "part-00001.bin"), shard_ids(1, 40), tokens=41)
    with pytest.raises(ConfigError) as err:
        list_shards(str(local), "uint16")
    one_line(err, "part-00001.bin", "80 bytes", "41", "truncated")
    write_shard(fs, str(local / "part-00001.bin"), shard_ids(1, 40), tokenizer="/a/gpt2")
    write_shard(fs, str(local / "part-00002.bin"), shard_ids(2, 517), tokenizer="/a/llama")
    with pytest.raises(ConfigError) as err:
        check_shards(list_shards(str(local), "uint16"), VOCAB)
    one_line(err, "two tokenizers", "gpt2", "llama")
    write_shard(fs, str(local / "part-00002.bin"), shard_ids(2, 517))
    with pytest.raises(ConfigError) as err:
        check_shards(list_shards(str(local), "uint16"), 600)  # shard 2 holds ids 600..899
    one_line(err, "part-00002.bin", "token id 899", "model.vocab_size=600")


def test_a_local_shard_without_a_sidecar_is_scanned(tmp_path):
    ids = np.arange(100, dtype=np.uint16)
    ids.tofile(tmp_path / "raw.bin")
    (found,) = check_shards(list_shards(str(tmp_path / "raw.bin"), "uint16"), VOCAB)
    assert (found.tokens, found.max_id) == (100, 99)
    with pytest.raises(ConfigError) as err:
        check_shards(list_shards(str(tmp_path / "raw.bin"), "uint16"), 99)
    one_line(err, "token id 99")
    (tmp_path / "odd.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ConfigError) as err:
        list_shards(str(tmp_path / "odd.bin"), "uint16")
    one_line(err, "3 bytes", "whole number")


def test_every_window_is_checked_as_it_is_read(remote):
    found = check_shards(list_shards(remote, "uint16"), VOCAB)
    whole = ShardSet.of_shards(found, VOCAB, "test")
    fs, root = fsspec.filesystem("memory"), remote[len("memory://") :]
    changed = shard_ids(2, 517)
    changed[100] = VOCAB + 5  # after the open: the sidecar's max_id is stale
    with fs.open(f"{root}/part-00002.bin", "wb") as f:
        f.write(changed.tobytes())
    with pytest.raises(DataError, match=f"token id {VOCAB + 5}"):
        whole.read(np.arange(whole.positions(64)), 64)
    with fs.open(f"{root}/part-00002.bin", "wb") as f:
        f.write(changed[:200].tobytes())  # truncated
    with pytest.raises(DataError, match="part-00002.bin: tokens .* could not be read whole"):
        whole.read(np.arange(whole.positions(64)), 64)


def test_the_corpus_of_a_set_from_the_config(local):
    spec = [str(local / "part-00000.bin"), str(local / "part-0000[12].bin")]
    cfg = load_config(None, ["data.source=tokens", f"data.path={spec}", "data.eval_fraction=0.1"])
    corpus = loader.load_corpus(cfg.data, VOCAB)
    assert (corpus.train.tokens, corpus.eval.tokens) == (771, 86)
    assert "3 shards" in corpus.description and "771 train tokens" in corpus.description


def test_a_scheme_without_its_package_is_one_line():
    with pytest.raises(ConfigError) as err:
        list_shards("nosuchscheme://bucket/x.bin", "uint16")
    one_line(err, "nosuchscheme://bucket/x.bin", "cannot be opened")
