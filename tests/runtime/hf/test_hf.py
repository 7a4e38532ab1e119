"""Hugging Face import and export against ``transformers`` itself (fp32, 1e-4).

Small random ``transformers`` models (GPT-2 tied; Llama with grouped-query attention,
untied; weights drawn with std 0.2 so that the logits are far from uniform) are saved with
``save_pretrained``, imported, and our logits compared with theirs on random tokens; the
import is exported again and reloaded with ``from_pretrained``. The slow test imports a
Llama, trains one step from it (``checkpoint.init_from``) under an uneven 2-stage pipeline
with tensor 2 and data 2, checks that first loss against ``transformers``' loss on the
same batch, exports the run's checkpoint, and compares ``transformers``' logits of the
export with ours of the trained parameters.

A wider Llama is exported in 1 MB shards by the command line and loaded by
``transformers`` from the shards; a run starts straight from a sharded ``save_pretrained``
directory (``checkpoint.init_from``) with ``transformers``' loss on its first batch.

Skipped only where torch is absent (the ``dev`` extra installs ``torch==2.13.0``, the CPU
build, and ``transformers``).
"""

import jax
import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not installed (pip install -e '.[dev]' installs torch==2.13.0)"
)
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[dev]')"
)

from holmes_jax.core.config import CheckpointConfig, config_from_dict, load_config  # noqa: E402
from holmes_jax.core.errors import ConfigError  # noqa: E402
from holmes_jax.core.spec import Degrees  # noqa: E402
from holmes_jax.runtime.data.loader import BatchSampler, load_corpus  # noqa: E402
from holmes_jax.runtime.hf.convert import export_hf, import_hf  # noqa: E402
from holmes_jax.runtime.model.decoder import GPT  # noqa: E402
from holmes_jax.runtime.rundir.checkpoint import (  # noqa: E402
    Checkpointer,
    find_step,
    init_state_from,
    read_params,
)

VOCAB, SEQ = 63, 16  # 63: not a multiple of tensor 2, so imports pad it (to 128)
TOL = 1e-4  # the bar; the measured differences are printed (pytest -s)


# Llama 3.1's rotary scaling, with wavelengths on both sides of and between the bounds.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 5000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}


def hf_model(arch: str, layers: int = 2, *, tied=None, scaled: bool = False, seed: int = 0):
    """A random ``transformers`` model of the tiny shape, in eval mode."""
    torch.manual_seed(seed)
    if arch == "gpt2":
        config = transformers.GPT2Config(
            n_layer=layers, n_embd=32, n_head=4, n_positions=SEQ, vocab_size=VOCAB,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
            tie_word_embeddings=True if tied is None else tied,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=layers, hidden_size=32, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=48, vocab_size=VOCAB,
            max_position_embeddings=SEQ, rope_theta=5000.0, rms_norm_eps=1e-5,
            bos_token_id=0, eos_token_id=0, tie_word_embeddings=bool(tied),
            **({"rope_parameters": LLAMA3_ROPE} if scaled else {}),
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def our_logits(ckpt: str, tokens: np.ndarray) -> np.ndarray:
    """Our model's fp32 logits with the parameters of a checkpoint (its config's model)."""
    step_dir, meta = find_step(ckpt, "ckpt")
    model = config_from_dict(meta["config"]).model
    params = jax.tree.map(lambda a: np.asarray(a, np.float32), read_params(step_dir, key="ckpt"))
    return np.asarray(GPT(model).apply({"params": params}, tokens))


def random_tokens(seed: int = 1, batch: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, SEQ))


@pytest.mark.parametrize(
    "arch, tied, scaled",
    [
        ("gpt2", True, False),
        ("gpt2", False, False),
        ("llama", False, False),
        ("llama", True, False),
        ("llama", False, True),
    ],
)
def test_import_and_export_match_transformers(tmp_path, arch, tied, scaled):
    model = hf_model(arch, tied=tied, scaled=scaled)
    model.save_pretrained(tmp_path / "hf")
    tokens = random_tokens()
    want = hf_logits(model, tokens)

    import_hf(str(tmp_path / "hf"), str(tmp_path / "imp"), progress=False)
    written = (tmp_path / "imp" / "config.yaml").read_text()
    assert ("rope_scaling_factor: 8.0" in written) == scaled
    got = our_logits(str(tmp_path / "imp"), tokens)
    diff = np.abs(got - want).max()
    print(f"{arch} tied={tied} rope scaling={scaled}: import max abs diff {diff:.2e}")
    assert diff <= TOL

    export_hf(str(tmp_path / "imp"), str(tmp_path / "out"), progress=False)
    again = type(model).from_pretrained(tmp_path / "out").eval()
    diff = np.abs(hf_logits(again, tokens) - want).max()
    print(f"{arch} tied={tied} rope scaling={scaled}: export max abs diff {diff:.2e}")
    assert diff <= TOL


def test_bf16_checkpoint_keeps_its_dtype_both_ways(tmp_path):
    model = hf_model("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "imp"), progress=False)
    step_dir, _ = find_step(str(tmp_path / "imp"), "imp")
    stored = read_params(step_dir, None, key="imp")
    assert stored["blocks"]["q_kernel"].dtype.name == "bfloat16"  # not widened on disk

    tokens = random_tokens()
    want = hf_logits(type(model).from_pretrained(tmp_path / "hf", dtype=torch.float32), tokens)
    assert np.abs(our_logits(str(tmp_path / "imp"), tokens) - want).max() <= TOL

    export_hf(str(tmp_path / "imp"), str(tmp_path / "out"), dtype="bfloat16", progress=False)
    again = type(model).from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    for (name, a), (_, b) in zip(
        sorted(model.state_dict().items()), sorted(again.state_dict().items()), strict=True
    ):
        assert torch.equal(a, b), name  # bit for bit


def test_init_from_refuses_another_shape_in_one_line(tmp_path, make_program):
    hf_model("llama").save_pretrained(tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "imp"), progress=False)
    cfg = load_config(
        str(tmp_path / "imp" / "config.yaml"),
        ["model.mlp_size=64", "train.global_batch_size=2"],
    )
    program = make_program(cfg, Degrees(1, 1, 1))
    with pytest.raises(ConfigError) as e:
        init_state_from(program, str(tmp_path / "imp"))
    message = str(e.value)
    assert "\n" not in message
    assert "blocks.down_kernel is [2, 48, 32] there, [2, 64, 32] in this run" in message
    assert "model.mlp_size=48 there, 64 here" in message


def test_an_import_cannot_be_resumed_only_started_from(tmp_path):
    hf_model("gpt2").save_pretrained(tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "imp"), progress=False)
    cfg = load_config(str(tmp_path / "imp" / "config.yaml"))
    ckpt = Checkpointer(CheckpointConfig(dir=str(tmp_path / "imp" / "checkpoint")))
    with pytest.raises(ConfigError, match="holds parameters only .* checkpoint.init_from="):
        ckpt.restore(None, cfg)
    ckpt.close()


def hf_loss(model, batch: np.ndarray) -> float:
    """``transformers``' mean next-token loss of ``model`` on ``batch`` [B, T + 1]."""
    with torch.no_grad():
        out = model(torch.tensor(batch[:, :-1], dtype=torch.long))
        logp = torch.log_softmax(out.logits, -1)
        picked = torch.gather(logp, -1, torch.tensor(batch[:, 1:, None], dtype=torch.long))
        return float(-picked.mean())


def test_export_in_1mb_shards_loads_in_transformers(tmp_path, capsys):
    """A 3.6 MB Llama exported with ``--max-shard-size 1MB``: several shards and the index
    ``from_pretrained`` reads; its logits are the original's bit for bit (the same
    weights) and ours within TOL."""
    from holmes_jax.hf import main

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=1024, vocab_size=VOCAB, max_position_embeddings=SEQ,
        rope_theta=5000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "imp"), progress=False)
    argv = ["export", str(tmp_path / "imp"), str(tmp_path / "out"), "--max-shard-size", "1MB"]
    assert main([*argv, "--quiet"]) == 0
    print(capsys.readouterr().out.strip())
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    sizes = [(tmp_path / "out" / f).stat().st_size for f in files]
    print(f"shards: {files}, bytes: {sizes}")
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert max(sizes) < 1_000_000 + 10_000  # each tensor < 1 MB; the header is small
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()

    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = random_tokens()
    want = hf_logits(model, tokens)
    np.testing.assert_array_equal(hf_logits(again, tokens), want)
    diff = np.abs(our_logits(str(tmp_path / "imp"), tokens) - want).max()
    print(f"sharded export: ours vs transformers max abs diff {diff:.2e}")
    assert diff <= TOL


def _hf_run_overrides(tmp_path) -> list[str]:
    """A run of ``hf_model("llama")``'s shape from its directory: two steps on one device
    (the fewest programs to compile)."""
    tokens = np.random.default_rng(2).integers(0, VOCAB, 4096).astype(np.uint16)
    tokens.tofile(tmp_path / "train.tokens")
    return [
        "model.arch=llama", f"model.vocab_size={VOCAB}", f"model.seq_len={SEQ}",
        "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
        "model.hidden_size=32", "model.mlp_size=48", "model.rope_base=5000.0",
        "model.norm_eps=1e-5", "model.tied_embeddings=false",
        "data.source=tokens", f"data.path={tmp_path / 'train.tokens'}",
        "train.global_batch_size=8", "train.steps=2", "train.eval_batches=1",
        "optimizer.warmup_steps=0", "logging.progress=plain", "parallel.devices=1",
        f"checkpoint.dir={tmp_path / 'run'}", f"checkpoint.init_from={tmp_path / 'hf'}",
    ]  # fmt: skip


@pytest.mark.slow
def test_a_run_starts_from_a_sharded_hf_directory(tmp_path, capsys):
    """checkpoint.init_from=<a save_pretrained directory in 3 shards>: imported on the fly,
    and the first step's loss is transformers' on that batch."""
    from holmes_jax.runtime.loop import run

    model = hf_model("llama")
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    shards = list((tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) >= 3 and (tmp_path / "hf" / "model.safetensors.index.json").exists()
    cfg = load_config(None, _hf_run_overrides(tmp_path))
    history = run(cfg)
    assert (
        f"initialised from {tmp_path / 'hf'} (fresh optimizer, step 0)" in capsys.readouterr().out
    )
    assert [r["step"] for r in history][-1] == 2

    corpus = load_corpus(cfg.data, cfg.model.vocab_size)
    batch = BatchSampler(corpus.train, SEQ, 8, cfg.train.seed).global_batch(0)
    want = hf_loss(model, batch)
    print(f"first step loss {history[0]['loss']:.6f}, transformers {want:.6f}")
    assert abs(history[0]["loss"] - want) <= TOL

    # Its export is a complete model directory again (config.json fields kept from the HF dir)
    said = export_hf(str(tmp_path / "run"), str(tmp_path / "out"), progress=False)
    assert said.endswith(f"copied generation_config.json from {tmp_path / 'hf'}")


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.norm_eps=1e-6", "model.norm_eps=1e-06: checkpoint.init_from={hf} is a "
         "LlamaForCausalLM with model.norm_eps=1e-05 (its config.json); set the run's model"),
        ("model.num_layers=3", "model.num_layers=3: checkpoint.init_from={hf} is a "
         "LlamaForCausalLM with model.num_layers=2"),
        ("model.rope_scaling_factor=8.0", "model.rope_scaling_factor=8.0: "),
        ("model.tied_embeddings=true", "model.tied_embeddings=True: "),
    ],
)  # fmt: skip
def test_init_from_an_hf_directory_of_another_model_is_one_line(
    tmp_path, make_program, override, message
):
    hf_model("llama").save_pretrained(tmp_path / "hf")
    cfg = load_config(None, [*_hf_run_overrides(tmp_path), override])
    program = make_program(cfg, Degrees(1, 1, 1))
    with pytest.raises(ConfigError) as e:
        init_state_from(program, str(tmp_path / "hf"))
    assert "\n" not in str(e.value)
    assert str(e.value).startswith(message.format(hf=tmp_path / "hf")), str(e.value)


def test_init_from_a_gpt2_directory_takes_at_most_its_positions(tmp_path, make_program):
    hf_model("gpt2").save_pretrained(tmp_path / "hf")
    gpt2 = ["model.arch=gpt2", f"model.vocab_size={VOCAB}", "model.num_layers=2",
            "model.num_heads=4", "model.hidden_size=32", "train.global_batch_size=2",
            "data.source=tokens", "data.path=unused.tokens"]  # fmt: skip
    program = make_program(load_config(None, [*gpt2, f"model.seq_len={SEQ * 2}"]), Degrees(1, 1, 1))
    with pytest.raises(ConfigError, match=f"model.seq_len={SEQ * 2}: .* has {SEQ} learned"):
        init_state_from(program, str(tmp_path / "hf"))


@pytest.mark.slow
def test_round_trip_through_a_pipelined_tensor_parallel_step(tmp_path, capsys):
    """import -> one step under stages [1, 3] x data 2 x tensor 2 -> export -> transformers."""
    from holmes_jax.runtime.loop import run

    model = hf_model("llama", layers=4)  # GQA: 4 query heads, 2 key/value heads
    model.save_pretrained(tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "imp"), progress=False)
    tokens = np.random.default_rng(2).integers(0, VOCAB, 4096).astype(np.uint16)
    (tmp_path / "imp" / "data").mkdir()  # the data.path the import names: a shard directory
    tokens.tofile(tmp_path / "imp" / "data" / "shard-00000.bin")
    overrides = [
        "parallel.stages=2",
        "parallel.layers_per_stage=[1,3]",
        "parallel.tensor=2",
        "parallel.microbatches=2",
        "train.global_batch_size=4",
        "train.steps=1",
        "train.eval_batches=1",
        "optimizer.warmup_steps=0",
        "optimizer.learning_rate=1e-2",
        "logging.progress=none",
        f"checkpoint.dir={tmp_path / 'run'}",
    ]
    cfg = load_config(str(tmp_path / "imp" / "config.yaml"), overrides)
    history = run(cfg)

    # The first step's loss is the imported model's: transformers' loss on that batch.
    corpus = load_corpus(cfg.data, cfg.model.vocab_size)
    batch = BatchSampler(corpus.train, SEQ, 4, cfg.train.seed).global_batch(0)
    want_loss = hf_loss(model, batch)
    print(f"first step loss {history[0]['loss']:.6f}, transformers {want_loss:.6f}")
    assert abs(history[0]["loss"] - want_loss) <= TOL

    said = export_hf(str(tmp_path / "run"), str(tmp_path / "out"), progress=False)
    assert said.endswith(f"copied generation_config.json from {tmp_path / 'hf'}")  # via init_from
    trained = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = random_tokens(batch=3)
    ours = our_logits(str(tmp_path / "run"), tokens)
    diff = np.abs(hf_logits(trained, tokens) - ours).max()
    print(f"trained: export max abs diff {diff:.2e}")
    assert diff <= TOL
    moved = np.abs(ours - hf_logits(model, tokens)).max()
    assert moved > 1e-3  # the step changed the model (and the export carries the change)

    # The run's own checkpoint wins over init_from (nothing left to train: no compile).
    capsys.readouterr()
    config = str(tmp_path / "imp" / "config.yaml")
    assert run(load_config(config, [*overrides, "logging.progress=plain"])) == []
    said = capsys.readouterr().out
    assert f"nothing to train: {tmp_path / 'run'} holds step 1 and train.steps=1" in said
