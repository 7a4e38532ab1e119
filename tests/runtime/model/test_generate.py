"""Text generation (``holmes_jax.runtime.model.generate``, ``python -m holmes_jax.sample``).

Greedy decoding must equal the argmax of the model's own forward pass over the unpadded,
growing (then sliding) sequence; sampling must be a function of the seed; the command must
print text from a checkpoint a pipelined run saved, and one line for every bad input.
"""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from holmes_jax.core.config import load_config
from holmes_jax.core.errors import ConfigError
from holmes_jax.runtime.data.prepare import Request, prepare
from holmes_jax.runtime.loop import run
from holmes_jax.runtime.model.decoder import GPT, init_model
from holmes_jax.runtime.model.generate import (
    Generator,
    HFTokenizer,
    Sampling,
    _choose,
    text_tokenizer,
)
from holmes_jax.runtime.rundir.checkpoint import save_params
from holmes_jax.sample import SEPARATOR, main
from tests.common import TINY_MODEL, TINY_RUN
from tests.test_data_prepare import TEXT, bpe_tokenizer

T = 8  # a short window, so that few prompt lengths are compiled and the window slides
ARCHS = {
    "gpt2": (*TINY_MODEL, f"model.seq_len={T}", "model.tied_embeddings=false"),
    "llama": (*TINY_MODEL, f"model.seq_len={T}", "model.arch=llama", "model.num_kv_heads=2"),
}


def random_params(cfg, seed=0):
    """Initial parameters, scaled up so that the logits are far from uniform."""
    tokens = jnp.zeros((1, cfg.model.seq_len), jnp.int32)
    init = jax.jit(lambda k: init_model(cfg.model).init({"params": k}, tokens)["params"])
    return jax.tree.map(lambda a: a * 8, nn.unbox(init(jax.random.key(seed))))


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request):
    cfg = load_config(None, ARCHS[request.param])
    return cfg, random_params(cfg), Generator(cfg.model)


def test_greedy_equals_argmax_of_the_full_forward_on_the_growing_sequence(tiny):
    cfg, params, gen = tiny
    forward = jax.jit(lambda p, x: GPT(cfg.model).apply({"params": p}, x))  # [1, n, V]
    next_logits = jax.jit(gen.next_logits)
    prompt = np.array([10, 200, 3])
    new = gen.generate(params, prompt, Sampling(max_new_tokens=2 * T, temperature=0))
    assert new.shape == (1, 2 * T)
    seq = list(prompt)
    for i, token in enumerate(new[0]):
        context = np.array(seq[-T:])  # the prompt, grown, then sliding once past T tokens
        logits = forward(params, context[None])[0, -1]  # [V]
        assert token == int(jnp.argmax(logits)), f"token {i} after {len(seq)}"
        window = np.zeros((1, T), np.int32)
        window[0, : len(context)] = context
        padded = next_logits(params, jnp.asarray(window), len(context))[0]
        np.testing.assert_allclose(padded, logits, rtol=1e-5, atol=1e-5)
        seq.append(int(token))
    assert len(set(new[0].tolist())) > 1  # a model that repeats one token proves little


def test_sampling_is_a_function_of_the_seed_and_top_k_1_is_greedy(tiny):
    cfg, params, gen = tiny
    prompt = np.array([5, 6, 7, 8, 9, 10, 11, 12, 13, 14])  # longer than T: cropped
    base = Sampling(max_new_tokens=12, temperature=1.0, top_k=0, seed=3)

    def draw(**changes):
        return gen.generate(params, prompt, Sampling(**{**base.__dict__, **changes}))

    first = draw()
    np.testing.assert_array_equal(draw(), first)
    assert not np.array_equal(draw(seed=4), first)
    np.testing.assert_array_equal(draw(top_k=1, seed=9), draw(temperature=0))
    np.testing.assert_array_equal(gen.generate(params, prompt[-T:], base), first)  # cropped
    several = draw(num_samples=3)
    np.testing.assert_array_equal(several[0], first[0])  # sample s does not depend on S
    assert not np.array_equal(several[1], several[2])
    # Prompt length, count, temperature, top-k and seed change no shape: one compile for
    # S = 1 (and one for S = 3).
    assert gen.step._cache_size() == 2


def test_top_k_draws_only_the_k_likeliest():
    logits = jnp.array([0.0, 3.0, 1.0, 2.9, -1.0, 2.8])
    keys = jax.random.split(jax.random.key(0), 2000)
    draw = jax.jit(jax.vmap(_choose, in_axes=(None, 0, None, None)))
    assert set(np.asarray(draw(logits, keys, 1.0, 3)).tolist()) == {1, 3, 5}
    assert set(np.asarray(draw(logits, keys, 5.0, 0)).tolist()) == set(range(6))
    assert set(np.asarray(draw(logits, keys, 0.0, 0)).tolist()) == {1}


# --------------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A parameters-only checkpoint of the tiny byte-level model (no training)."""
    directory = tmp_path_factory.mktemp("saved")
    cfg = load_config(None, ARCHS["gpt2"])
    save_params(str(directory), random_params(cfg), cfg)
    return directory


@pytest.fixture(scope="module")
def pipelined_run(tmp_path_factory):
    """A tiny run trained 2 steps as 2 pipeline stages (saved in the logical layout)."""
    run_dir = tmp_path_factory.mktemp("run")
    steps = ["train.steps=2", "train.eval_batches=1", "logging.progress=none"]
    pipeline = ["parallel.stages=2", "parallel.devices=2"]
    run(load_config(None, [*TINY_RUN, *steps, *pipeline, f"train.run_dir={run_dir}"]))
    return run_dir


def sample_ok(capsys, *argv) -> tuple[list[str], str]:
    """The samples the command prints (each followed by the separator line) and stderr."""
    assert main(list(argv)) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    samples = captured.out.split(f"\n{SEPARATOR}\n")
    assert samples[-1] == ""
    return samples[:-1], captured.err


@pytest.mark.slow
def test_the_command_prints_text_from_a_pipelined_run(pipelined_run, capsys):
    greedy = ["--prompt", "def ", "--max-new-tokens", "40", "--temperature", "0"]
    texts, err = sample_ok(capsys, "--checkpoint", str(pipelined_run), *greedy)
    where = f"step 2 of {pipelined_run}/checkpoints/2"
    assert err == f"{where}: gpt2, 0.04M params, bytes, fp32 on cpu\n"
    assert len(texts) == 1 and texts[0].startswith("def ") and len(texts[0]) > len("def ")
    # The checkpoint directory and the step directory name the same step.
    for path in (pipelined_run / "checkpoints", pipelined_run / "checkpoints" / "2"):
        assert sample_ok(capsys, "--checkpoint", str(path), *greedy)[0] == texts
    drawn, _ = sample_ok(
        capsys, "--checkpoint", str(pipelined_run), "--num-samples", "2", "--seed", "1"
    )
    assert len(drawn) == 2 and all(t.startswith("\n") for t in drawn)  # the default prompt


def test_the_command_decodes_with_the_token_files_tokenizer(tmp_path, capsys):
    """A checkpoint of a model for ``data.source=tokens``: the prompt and the samples go
    through the tokenizer that ``prepare`` recorded beside the token file."""
    tok = bpe_tokenizer(tmp_path / "tok", bos=True)
    (tmp_path / "text.txt").write_text(TEXT)
    out = tmp_path / "tokens"
    prepare(Request(str(tmp_path / "tok"), (str(tmp_path / "text.txt"),), str(out)), workers=1)
    vocab = tok.get_vocab_size()
    data = ["data.source=tokens", f"data.path={out}", f"model.vocab_size={vocab}"]
    cfg = load_config(None, [*ARCHS["gpt2"], *data])
    save_params(str(tmp_path / "ckpt"), random_params(cfg), cfg)

    texts, err = sample_ok(capsys, "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "x = f")
    assert err.endswith(f"tokenizer {tmp_path}/tok, fp32 on cpu\n")
    assert texts[0].startswith("x = f") and len(texts[0]) > len("x = f")

    meta = {"config": cfg.to_dict()}
    hf = text_tokenizer(cfg, meta)
    assert isinstance(hf, HFTokenizer)
    ids = hf.encode("def f(x):")
    assert ids[0] == tok.token_to_id("<s>") and hf.decode(ids[1:]) == "def f(x):"

    for named in (out / "index.json", out / "shard-00000.bin.json"):  # nothing names it now
        named.unlink()
    with pytest.raises(ConfigError, match=r"^data.path=.*tokens: no sidecar .* --tokenizer PATH"):
        text_tokenizer(cfg, meta)
    assert text_tokenizer(cfg, meta, str(tmp_path / "tok")).path == str(tmp_path / "tok")
    (out / "shard-00000.bin.json").write_text(json.dumps({"tokenizer": str(tmp_path / "gone")}))
    with pytest.raises(ConfigError, match=r"tokenizer .*/gone .* is not on this machine"):
        text_tokenizer(cfg, meta)


def one_line_error(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    return captured.err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-new-tokens", "0"], "error: --max-new-tokens=0: must be >= 1"),
        (["--temperature", "-0.5"], "error: --temperature=-0.5: must be a number >= 0"),
        (["--temperature", "inf"], "error: --temperature=inf: must be a number >= 0"),
        (["--top-k", "-1"], "error: --top-k=-1: must be >= 0"),
        (["--num-samples", "0"], "error: --num-samples=0: must be >= 1"),
        (["--prompt", ""], "error: --prompt='': encodes to no tokens"),
    ],
)
def test_bad_numbers_are_one_line(saved, capsys, flags, message):
    err = one_line_error(capsys, "--checkpoint", str(saved), *flags)
    assert err.startswith(message)


def test_bad_paths_and_another_model_are_one_line(saved, tmp_path, capsys):
    err = one_line_error(capsys, "--checkpoint", str(tmp_path / "nope"))
    assert err == f"error: --checkpoint={tmp_path}/nope: no such directory\n"
    err = one_line_error(capsys, "--checkpoint", str(tmp_path))
    assert err.startswith(f"error: --checkpoint={tmp_path}: holds no checkpoint")
    err = one_line_error(capsys, "--checkpoint", str(saved / "0" / "state"))
    assert "holds no checkpoint" in err
    other = tmp_path / "other.yaml"
    model = (
        f"{{num_layers: 3, hidden_size: 32, num_heads: 4, seq_len: {T}, tied_embeddings: false}}"
    )
    other.write_text(f"model: {model}\n")
    err = one_line_error(capsys, "--checkpoint", str(saved), "--config", str(other))
    assert err.startswith(f"error: --checkpoint={saved}/0: parameter blocks.")
    assert err.endswith("(model.num_layers=2 there, 3 here)\n"), err
