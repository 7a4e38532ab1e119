"""``python -m holmes_jax.data prepare``: documents -> the token shards the trainer reads.

The tokenizers are built here (a byte-level BPE trained in-process, a word-level one with
a vocabulary past 65536, a SentencePiece-style one), so nothing is downloaded. The shards
must hold the tokenizer's own encoding of each document (specials and ``--eos``
included), in order, in the dtype the vocabulary needs, whatever the input format, worker
count or interruptions, and load as ``data.source=tokens``.
"""

import json
from types import SimpleNamespace

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from holmes_jax.core.errors import ConfigError
from holmes_jax.data import main
from holmes_jax.runtime.data import prepare as prepare_module
from holmes_jax.runtime.data import tasks as tasks_module
from holmes_jax.runtime.data.loader import load_corpus

TEXT = (
    "def f(x):\n    return x * 2\n\nclass A:\n    pass\n"
    "Ünïcode text, numbers 12345 and emoji 😀 on a line.\n"
    "Another line\n  indented line\nlast line without newline"
)


def bpe_tokenizer(directory, bos: bool = False) -> Tokenizer:
    """A byte-level BPE (GPT-2's pre-tokenizer) trained on TEXT; saved as tokenizer.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT] * 20, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return tok


def documents(directory, count: int = 3) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    texts = [TEXT * (i + 1) for i in range(count)]
    for i, text in enumerate(texts):
        (directory / f"doc{i}.txt").write_text(text)
    (directory / ".hidden").write_text("never read")
    return texts


def tokens_of(out, dtype=np.uint16) -> list[int]:
    """Every id of the shard set in ``out``, in index order."""
    index = json.loads((out / "index.json").read_text())
    return [i for s in index["shards"] for i in np.fromfile(out / s["path"], dtype).tolist()]


def one_worker(argv) -> list[str]:
    """``argv`` with ``--workers 1`` unless it names a count (a pool costs seconds to start)."""
    return [*argv, "--quiet"] + ([] if "--workers" in argv else ["--workers", "1"])


def run_ok(capsys, *argv) -> str:
    assert main(["prepare", *one_worker(argv)]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_token_file_is_each_document_encoded(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(prepare_module, "PIECE_CHARS", 32)  # many cuts inside each file
    tok = bpe_tokenizer(tmp_path / "model", bos=True)
    texts = documents(tmp_path / "text")
    out = tmp_path / "train"
    said = run_ok(
        capsys, "--tokenizer", str(tmp_path / "model"), "--input", str(tmp_path / "text"),
        "--out", str(out), "--eos", "<|endoftext|>",
    )  # fmt: skip
    eos = tok.token_to_id("<|endoftext|>")
    want = [i for text in texts for i in [*tok.encode(text).ids, eos]]  # <s> + text + eos
    assert tokens_of(out) == want
    assert want[0] == tok.token_to_id("<s>")
    meta = json.loads((out / "index.json").read_text())
    assert meta["dtype"] == "uint16" and meta["tokens"] == len(want) and meta["documents"] == 3
    assert meta["shards"][0]["max_id"] == max(want)
    assert "--set data.token_dtype=uint16" in said and f"data.path={out}" in said

    corpus = load_corpus(_data(out, "uint16"), vocab_size=300)
    assert corpus.train.tokens + corpus.eval.tokens == len(want)
    with pytest.raises(ConfigError, match="holds uint16 tokens .* set data.token_dtype=uint16"):
        load_corpus(_data(out, "uint32"), vocab_size=300)


def _data(path, dtype):
    return SimpleNamespace(
        source="tokens", path=str(path), token_dtype=dtype, eval_fraction=0.1, max_bytes=0,
        mixture=(), eval=(),
    )  # fmt: skip


def test_a_vocabulary_past_65536_writes_uint32(tmp_path, capsys):
    words = [f"w{i}" for i in range(70_000)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "in.txt").write_text("w1 w69999 w65536\nw42")
    out = tmp_path / "big"
    run_ok(capsys, "--tokenizer", str(tmp_path / "tokenizer.json"), "--input",
           str(tmp_path / "in.txt"), "--out", str(out))  # fmt: skip
    assert tokens_of(out, np.uint32) == [1, 69999, 65536, 42]
    corpus = load_corpus(_data(out, "uint32"), vocab_size=70_000)
    read = [split.read(np.arange(split.tokens), 1)[:, 0] for split in (corpus.train, corpus.eval)]
    assert np.concatenate(read).tolist() == [1, 69999, 65536, 42]  # read back as uint32


def test_a_tokenizer_that_cuts_change_gets_whole_files(tmp_path, capsys, monkeypatch):
    """SentencePiece-style: a prefix space on every sequence, so pieces would differ."""
    monkeypatch.setattr(prepare_module, "PIECE_CHARS", 16)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tok.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(vocab_size=200))
    tok.save(str(tmp_path / "tokenizer.json"))
    assert not prepare_module._cuts_are_safe(tok)
    (tmp_path / "in.txt").write_text(TEXT * 3)
    out = tmp_path / "sp"
    run_ok(capsys, "--tokenizer", str(tmp_path), "--input", str(tmp_path / "in.txt"),
           "--out", str(out))  # fmt: skip
    assert tokens_of(out) == tok.encode(TEXT * 3).ids


def test_bad_input_is_one_line(tmp_path, capsys):
    bpe_tokenizer(tmp_path / "model")
    documents(tmp_path / "text", 1)
    (tmp_path / "binary.txt").write_bytes(b"ok\n\xff\xfe bad")

    def error(*argv) -> str:
        return error_of(capsys, *argv)

    model, text, out = str(tmp_path / "model"), str(tmp_path / "text"), str(tmp_path / "o")
    assert "no tokenizer.json there" in error("--tokenizer", text, "--input", text, "--out", out)
    assert "--eos='<nope>': not a token" in error(
        "--tokenizer", model, "--input", text, "--out", out, "--eos", "<nope>"
    )
    missing = str(tmp_path / "nowhere")
    assert "no such file or directory" in error(
        "--tokenizer", model, "--input", missing, "--out", out
    )
    assert "does not exist" in error("--tokenizer", model, "--input", text, "--out", f"{missing}/x")
    binary = str(tmp_path / "binary.txt")
    assert "is not UTF-8 text" in error("--tokenizer", model, "--input", binary, "--out", out)
    assert not (tmp_path / "o.tok").exists() and not (tmp_path / "o.tok.tmp").exists()


def formats(directory, texts) -> dict[str, str]:
    """``texts`` as text files, JSONL, Parquet and an Arrow stream (the file ``datasets``'
    ``save_to_disk`` writes), each under ``directory``; {format: path}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    paths = {"text": directory / "text", "jsonl": directory / "docs.jsonl"}
    paths["text"].mkdir()
    for i, text in enumerate(texts):
        (paths["text"] / f"doc{i}.txt").write_text(text)
    paths["jsonl"].write_text(
        "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts))
    )
    table = pa.table({"id": list(range(len(texts))), "text": texts})
    paths["parquet"] = directory / "docs.parquet"
    pq.write_table(table, paths["parquet"], row_group_size=2)
    paths["arrow"] = directory / "data-00000-of-00001.arrow"
    with pa.OSFile(str(paths["arrow"]), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        for batch in table.to_batches(max_chunksize=2):
            w.write_batch(batch)
    return {k: str(v) for k, v in paths.items()}


def test_every_format_and_worker_count_gives_the_same_tokens(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(prepare_module, "PIECE_CHARS", 64)  # long documents are cut
    tok = bpe_tokenizer(tmp_path / "model")
    texts = [TEXT * (i % 3 + 1) for i in range(7)]
    eos = tok.token_to_id("<|endoftext|>")
    want = [i for text in texts for i in [*tok.encode(text).ids, eos]]
    for name, path in formats(tmp_path / "in", texts).items():
        for workers in ("1", "2"):
            out = tmp_path / f"{name}-{workers}"
            run_ok(capsys, "--tokenizer", str(tmp_path / "model"), "--input", path, "--out",
                   str(out), "--eos", "<|endoftext|>", "--shard-tokens", "100",
                   "--workers", workers)  # fmt: skip
            assert tokens_of(out) == want, (name, workers)
            index = json.loads((out / "index.json").read_text())
            assert index["documents"] == 7 and len(index["shards"]) > 3, (name, workers)
            assert all(s["tokens"] >= 100 for s in index["shards"][:-1])


def test_a_stopped_prepare_resumes_to_the_same_shards(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(prepare_module, "PIECE_CHARS", 64)
    bpe_tokenizer(tmp_path / "model")
    inputs = formats(tmp_path / "in", [TEXT * (i % 3 + 1) for i in range(9)])
    argv = ["--tokenizer", str(tmp_path / "model"), "--input", inputs["jsonl"], inputs["text"],
            "--shard-tokens", "150", "--workers", "1"]  # fmt: skip
    run_ok(capsys, *argv, "--out", str(tmp_path / "whole"))
    real, written = prepare_module._Writer._write, []

    def stop_after_three(self):  # the run is killed as its fourth shard is written
        if len(written) == 3:
            raise KeyboardInterrupt
        written.append(1)
        real(self)

    monkeypatch.setattr(prepare_module._Writer, "_write", stop_after_three)
    with pytest.raises(KeyboardInterrupt):
        main(["prepare", *argv, "--out", str(tmp_path / "stopped"), "--quiet"])
    monkeypatch.setattr(prepare_module._Writer, "_write", real)
    stopped = tmp_path / "stopped"
    assert not (stopped / "index.json").exists() and len(list(stopped.glob("*.bin"))) == 3
    assert "--out" in error_of(capsys, *argv[:-4], "--out", str(stopped))  # other arguments
    said = run_ok(capsys, *argv, "--out", str(stopped))
    names = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert names == sorted(p.name for p in stopped.iterdir()) and "prepare-state.json" not in names
    for name in names:
        assert (tmp_path / "whole" / name).read_bytes() == (stopped / name).read_bytes(), name
    assert "data.source=tokens" in said


def error_of(capsys, *argv) -> str:
    assert main(["prepare", *one_worker(argv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_bad_jsonl_lines_stop_the_run_or_are_skipped_and_counted(tmp_path, capsys):
    tok = bpe_tokenizer(tmp_path / "model")
    lines = ['{"text": "one"}', "not json", '{"body": "no text"}', "[1, 2]", '{"text": "two"}']
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    argv = ["--tokenizer", str(tmp_path / "model"), "--input", str(tmp_path / "d.jsonl")]
    err = error_of(capsys, *argv, "--out", str(tmp_path / "a"))
    assert "d.jsonl:2: not JSON" in err and "--skip-bad" in err
    said = run_ok(capsys, *argv, "--out", str(tmp_path / "b"), "--skip-bad")
    assert "skipped 3 bad line(s)" in said and "d.jsonl:2" in said
    assert tokens_of(tmp_path / "b") == tok.encode("one").ids + tok.encode("two").ids
    assert "--field=body: not a column" in error_of(
        capsys, "--tokenizer", str(tmp_path / "model"), "--field", "body", "--input",
        formats(tmp_path / "in", ["x"])["parquet"], "--out", str(tmp_path / "c"),
    )  # fmt: skip


@pytest.mark.parametrize("text", [True, False], ids=["text", "jsonl"])
def test_tasks_end_at_the_first_safe_cut_past_their_size(tmp_path, monkeypatch, text):
    """Byte ranges tile the file; each ends at the first newline past ``task_bytes``
    (text: whose next line opens with a non-space character, multi-byte ones included),
    found across the scan's block edges."""
    monkeypatch.setattr(tasks_module, "SCAN", 5)  # many block edges
    rng = np.random.default_rng(0)
    heads = ["word", "  indented", "中文", "😀x", "\ttab", "", "\u3000wide space", "x = 1"]
    data = "".join(heads[i] + "\n" for i in rng.integers(0, len(heads), 300)).encode()
    path = tmp_path / "in.txt"
    path.write_bytes(data)

    def safe(cut: int) -> bool:
        if data[cut - 1 : cut] != b"\n":
            return False
        head = data[cut : cut + 4].decode("utf-8", "ignore")[:1]
        return not text or (head != "" and not head.isspace())

    ranges = list(tasks_module.ranges(path, len(data), 23, text=text))
    assert ranges[0][0] == 0 and ranges[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    for start, stop in ranges[:-1]:
        assert safe(stop), (start, stop)
        assert not any(safe(c) for c in range(start + 23, stop)), (start, stop)
    assert len(ranges) > 20
    (tmp_path / "empty.txt").write_bytes(b"")
    assert list(tasks_module.ranges(tmp_path / "empty.txt", 0, 23, text)) == [(0, 0)]
