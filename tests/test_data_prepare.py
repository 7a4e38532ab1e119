"""``python -m holmes_jax.data prepare``: text -> the token file the trainer reads.

The tokenizers are built here (a byte-level BPE trained in-process, a word-level one with
a vocabulary past 65536, a SentencePiece-style one), so nothing is downloaded. The token
file must equal the tokenizer's own encoding of each document (specials and ``--eos``
included), in the dtype the vocabulary needs, and load as ``data.source=tokens``.
"""

import json
from types import SimpleNamespace

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from holmes_jax.core.errors import ConfigError
from holmes_jax.data import main
from holmes_jax.runtime.data import prepare as prepare_module
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


def run_ok(capsys, *argv) -> str:
    assert main(["prepare", *argv, "--quiet"]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_token_file_is_each_document_encoded(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(prepare_module, "PIECE_BYTES", 32)  # many cuts inside each file
    tok = bpe_tokenizer(tmp_path / "model", bos=True)
    texts = documents(tmp_path / "text")
    out = tmp_path / "train.tokens"
    said = run_ok(
        capsys, "--tokenizer", str(tmp_path / "model"), "--input", str(tmp_path / "text"),
        "--out", str(out), "--eos", "<|endoftext|>",
    )  # fmt: skip
    eos = tok.token_to_id("<|endoftext|>")
    want = [i for text in texts for i in [*tok.encode(text).ids, eos]]  # <s> + text + eos
    got = np.fromfile(out, np.uint16)
    assert got.tolist() == want
    assert want[0] == tok.token_to_id("<s>")
    meta = json.loads((tmp_path / "train.tokens.json").read_text())
    assert meta["dtype"] == "uint16" and meta["tokens"] == len(want) and meta["files"] == 3
    assert "--set data.token_dtype=uint16" in said

    corpus = load_corpus(_data(out, "uint16"), vocab_size=300)
    assert corpus.train.tokens + corpus.eval.tokens == len(want)
    with pytest.raises(ConfigError, match="holds uint16 tokens .* set data.token_dtype=uint16"):
        load_corpus(_data(out, "uint32"), vocab_size=300)


def _data(path, dtype):
    return SimpleNamespace(
        source="tokens", path=str(path), token_dtype=dtype, eval_fraction=0.1, max_bytes=0
    )


def test_a_vocabulary_past_65536_writes_uint32(tmp_path, capsys):
    words = [f"w{i}" for i in range(70_000)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "in.txt").write_text("w1 w69999 w65536\nw42")
    out = tmp_path / "big.tokens"
    run_ok(capsys, "--tokenizer", str(tmp_path / "tokenizer.json"), "--input",
           str(tmp_path / "in.txt"), "--out", str(out))  # fmt: skip
    assert np.fromfile(out, np.uint32).tolist() == [1, 69999, 65536, 42]
    corpus = load_corpus(_data(out, "uint32"), vocab_size=70_000)
    read = [split.read(np.arange(split.tokens), 1)[:, 0] for split in (corpus.train, corpus.eval)]
    assert np.concatenate(read).tolist() == [1, 69999, 65536, 42]  # read back as uint32


def test_a_tokenizer_that_cuts_change_gets_whole_files(tmp_path, capsys, monkeypatch):
    """SentencePiece-style: a prefix space on every sequence, so pieces would differ."""
    monkeypatch.setattr(prepare_module, "PIECE_BYTES", 16)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tok.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(vocab_size=200))
    tok.save(str(tmp_path / "tokenizer.json"))
    assert not prepare_module._cuts_are_safe(tok)
    (tmp_path / "in.txt").write_text(TEXT * 3)
    out = tmp_path / "sp.tokens"
    run_ok(capsys, "--tokenizer", str(tmp_path), "--input", str(tmp_path / "in.txt"),
           "--out", str(out))  # fmt: skip
    assert np.fromfile(out, np.uint16).tolist() == tok.encode(TEXT * 3).ids


def test_bad_input_is_one_line(tmp_path, capsys):
    bpe_tokenizer(tmp_path / "model")
    documents(tmp_path / "text", 1)
    (tmp_path / "binary.txt").write_bytes(b"ok\n\xff\xfe bad")

    def error(*argv) -> str:
        assert main(["prepare", *argv, "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        return err

    model, text, out = str(tmp_path / "model"), str(tmp_path / "text"), str(tmp_path / "o.tok")
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
