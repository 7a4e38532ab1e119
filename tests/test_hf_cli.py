"""``python -m holmes_jax.hf``: import and export round trips, and one-line errors.

These need no torch: the model directories are written here with numpy and
``safetensors`` the way ``transformers`` writes them (its names, layouts and config.json
fields), so an import followed by an export must give back every tensor bit for bit.
A sharded export is checked against huggingface_hub's own shard rule. The comparison with
``transformers`` itself is ``tests/runtime/hf/test_hf.py``.
"""

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from holmes_jax.hf import main
from holmes_jax.runtime.hf.mapping import hf_config

H, HEADS, KV, F, V, T = 16, 4, 2, 24, 40, 8


def gpt2_files(layers=2, prefix="transformer.", buffers=True):
    """GPT-2 config.json and tensors (the original hub files have no prefix and keep the
    causal-mask buffers)."""
    rng = np.random.default_rng(0)
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": V,
        "n_positions": T,
        "n_embd": H,
        "n_layer": layers,
        "n_head": HEADS,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "bos_token_id": 7,
    }
    shapes = {"wte.weight": (V, H), "wpe.weight": (T, H), "ln_f.weight": (H,), "ln_f.bias": (H,)}
    for i in range(layers):
        shapes |= {
            f"h.{i}.ln_1.weight": (H,),
            f"h.{i}.ln_1.bias": (H,),
            f"h.{i}.attn.c_attn.weight": (H, 3 * H),
            f"h.{i}.attn.c_attn.bias": (3 * H,),
            f"h.{i}.attn.c_proj.weight": (H, H),
            f"h.{i}.attn.c_proj.bias": (H,),
            f"h.{i}.ln_2.weight": (H,),
            f"h.{i}.ln_2.bias": (H,),
            f"h.{i}.mlp.c_fc.weight": (H, 4 * H),
            f"h.{i}.mlp.c_fc.bias": (4 * H,),
            f"h.{i}.mlp.c_proj.weight": (4 * H, H),
            f"h.{i}.mlp.c_proj.bias": (H,),
        }
    tensors = {prefix + k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    if buffers:
        for i in range(layers):
            tensors[f"{prefix}h.{i}.attn.bias"] = np.tril(np.ones((1, 1, T, T), np.float32))
    return config, tensors


def llama_files(layers=2, dtype=ml_dtypes.bfloat16, tied=False):
    rng = np.random.default_rng(1)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": V,
        "hidden_size": H,
        "intermediate_size": F,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
    }
    hd = H // HEADS
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not tied:
        shapes["lm_head.weight"] = (V, H)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (HEADS * hd, H),
            p + "self_attn.k_proj.weight": (KV * hd, H),
            p + "self_attn.v_proj.weight": (KV * hd, H),
            p + "self_attn.o_proj.weight": (H, HEADS * hd),
            p + "post_attention_layernorm.weight": (H,),
            p + "mlp.gate_proj.weight": (F, H),
            p + "mlp.up_proj.weight": (F, H),
            p + "mlp.down_proj.weight": (H, F),
        }
    tensors = {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()}
    return config, tensors


def write_hf(directory, config, tensors, shards=1):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        return directory
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, directory / file, metadata={"format": "pt"})
        weight_map |= {n: file for n in part}
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def read_all(path):
    with safe_open(path, "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def read_sharded(directory):
    """{name: tensor} of a sharded export (through its index), and the index."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        part = read_all(directory / file)
        assert all(index["weight_map"][name] == file for name in part), file
        tensors |= part
    return tensors, index


def run_ok(capsys, *argv):
    assert main([*argv, "--quiet"]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def one_line_error(capsys, *argv) -> str:
    assert main([*argv, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_gpt2_hub_layout_round_trips_bit_for_bit(tmp_path, capsys):
    config, tensors = gpt2_files(prefix="", buffers=True)  # the original hub layout
    hf = write_hf(tmp_path / "hf", config, tensors)
    (hf / "tokenizer.json").write_text("{}")
    said = run_ok(capsys, "import", str(hf), str(tmp_path / "imp"))
    assert said.startswith("imported GPT2LMHeadModel")
    written = (tmp_path / "imp" / "config.yaml").read_text()
    assert written.startswith("# GPT2LMHeadModel imported from")
    assert f"init_from: {tmp_path / 'imp' / 'checkpoint'}" in written

    said = run_ok(capsys, "export", str(tmp_path / "imp"), str(tmp_path / "out"))
    assert said.rstrip().endswith(f"copied tokenizer.json from {hf}")
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "{}"
    back = read_all(tmp_path / "out" / "model.safetensors")
    want = {"transformer." + k: v for k, v in tensors.items() if not k.endswith(".attn.bias")}
    assert sorted(back) == sorted(want)
    for name, x in want.items():
        np.testing.assert_array_equal(back[name], x, err_msg=name)
    out_config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out_config["n_inner"] == 4 * H and out_config["tie_word_embeddings"] is True
    assert out_config["bos_token_id"] == 7  # kept from the imported config.json


def test_sharded_bf16_llama_round_trips_bit_for_bit(tmp_path, capsys):
    config, tensors = llama_files()
    hf = write_hf(tmp_path / "hf", config, tensors, shards=3)
    run_ok(capsys, "import", str(hf), str(tmp_path / "imp"), "--set", "model.seq_len=64")
    written = (tmp_path / "imp" / "config.yaml").read_text()
    assert "seq_len: 64" in written and "num_kv_heads: 2" in written
    assert "rope_base: 500000.0" in written and "token_dtype: uint16" in written

    run_ok(capsys, "export", str(tmp_path / "imp"), str(tmp_path / "out"), "--dtype", "bfloat16")
    back = read_all(tmp_path / "out" / "model.safetensors")
    assert sorted(back) == sorted(tensors)
    for name, x in tensors.items():
        assert back[name].dtype == x.dtype, name
        np.testing.assert_array_equal(back[name], x, err_msg=name)
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (out["num_key_value_heads"], out["max_position_embeddings"]) == (KV, 64)


def test_gpt2_positions_past_seq_len_are_dropped(tmp_path, capsys):
    config, tensors = gpt2_files()
    hf = write_hf(tmp_path / "hf", config, tensors)
    run_ok(capsys, "import", str(hf), str(tmp_path / "imp"), "--set", "model.seq_len=4")
    run_ok(capsys, "export", str(tmp_path / "imp"), str(tmp_path / "out"))
    back = read_all(tmp_path / "out" / "model.safetensors")
    np.testing.assert_array_equal(
        back["transformer.wpe.weight"], tensors["transformer.wpe.weight"][:4]
    )


def _break(kind):
    """(config, tensors, expected message part) of a model directory that must fail."""
    config, tensors = llama_files()
    if kind == "architecture":
        config["architectures"] = ["MistralForCausalLM"]
        return config, tensors, 'architectures=["MistralForCausalLM"]: unsupported architecture'
    if kind == "missing tensor":
        del tensors["model.layers.1.mlp.up_proj.weight"]
        return config, tensors, "tensor model.layers.1.mlp.up_proj.weight is missing"
    if kind == "shape":
        tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((H, H), np.float32)
        return (
            config,
            tensors,
            "model.layers.0.self_attn.k_proj.weight has shape [16, 16], expected [8, 16]",
        )
    if kind == "unexpected tensor":
        tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(H, np.float32)
        return config, tensors, "tensor model.layers.0.self_attn.q_proj.bias has no place"
    if kind == "rope scaling":
        config["rope_scaling"] = {"rope_type": "yarn", "factor": 8.0}
        return config, tensors, 'rope_scaling={"rope_type": "yarn", "factor": 8.0}'
    if kind == "activation":
        config, tensors = gpt2_files()
        config["activation_function"] = "gelu"
        return config, tensors, 'activation_function="gelu"'
    if kind == "shape rule":
        config["num_key_value_heads"] = 3
        return config, tensors, "model.num_kv_heads=3: must divide model.num_heads=4"
    raise AssertionError(kind)


KINDS = ["architecture", "missing tensor", "shape", "unexpected tensor", "rope scaling"]


@pytest.mark.parametrize("kind", [*KINDS, "activation", "shape rule"])
def test_bad_model_directories_are_one_line(tmp_path, capsys, kind):
    config, tensors, part = _break(kind)
    hf = write_hf(tmp_path / "hf", config, tensors)
    err = one_line_error(capsys, "import", str(hf), str(tmp_path / "imp"))
    assert part in err
    assert not (tmp_path / "imp" / "checkpoint").exists()


def test_bad_paths_are_one_line(tmp_path, capsys):
    err = one_line_error(capsys, "import", str(tmp_path / "nowhere"), str(tmp_path / "imp"))
    assert "config.json: not found" in err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(gpt2_files()[0]))
    (tmp_path / "empty" / "pytorch_model.bin").write_text("")
    err = one_line_error(capsys, "import", str(tmp_path / "empty"), str(tmp_path / "imp"))
    assert "found pytorch_model.bin: only safetensors are read" in err

    config, tensors = gpt2_files()
    hf = write_hf(tmp_path / "hf", config, tensors, shards=2)
    (hf / "model-00002-of-00002.safetensors").unlink()
    err = one_line_error(capsys, "import", str(hf), str(tmp_path / "imp"))
    assert "model-00002-of-00002.safetensors: cannot be read as safetensors" in err

    err = one_line_error(capsys, "export", str(tmp_path / "empty"), str(tmp_path / "out"))
    assert "holds no checkpoint" in err
    hf = write_hf(tmp_path / "hf2", *gpt2_files())
    run_ok(capsys, "import", str(hf), str(tmp_path / "imp"))
    err = one_line_error(capsys, "import", str(hf), str(tmp_path / "imp"))
    assert "already holds an import" in err
    err = one_line_error(capsys, "export", str(tmp_path / "imp"), str(hf))
    assert "already holds config.json" in err


def test_exported_config_names_the_shape():
    from holmes_jax.core.config import load_config

    llama = load_config(None, ["model.arch=llama", "model.num_kv_heads=2", "model.mlp_size=48"])
    config = hf_config(llama.model, "float32")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["intermediate_size"] == 48 and config["tie_word_embeddings"] is False


def test_sharded_export_follows_huggingface_hubs_rule_and_imports_back(tmp_path, capsys):
    """2000-byte shards of a model whose embedding (2560 bytes) is larger: the embedding
    goes alone, the rest are packed in order, exactly as huggingface_hub would cut them."""
    from huggingface_hub import split_state_dict_into_shards_factory

    from holmes_jax.core.config import config_from_dict
    from holmes_jax.runtime.hf.files import export_tensors
    from holmes_jax.runtime.rundir.checkpoint import find_step, read_params

    config, tensors = llama_files(layers=3, dtype=np.float32)
    hf = write_hf(tmp_path / "hf", config, tensors)
    run_ok(capsys, "import", str(hf), str(tmp_path / "imp"))
    said = run_ok(capsys, "export", str(tmp_path / "imp"), str(tmp_path / "out"),
                  "--max-shard-size", "2000")  # fmt: skip
    assert not (tmp_path / "out" / "model.safetensors").exists()
    back, index = read_sharded(tmp_path / "out")
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert f"{n} shards of at most 2000" in said and n > 3
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(back) == sorted(tensors)
    for name, x in tensors.items():
        np.testing.assert_array_equal(back[name], x, err_msg=name)
    assert index["metadata"]["total_size"] == sum(x.nbytes for x in tensors.values())
    assert index["metadata"]["total_parameters"] == sum(x.size for x in tensors.values())

    # The same cut as huggingface_hub's, over the tensors in the order we write them.
    step_dir, meta = find_step(str(tmp_path / "imp"), "imp")
    model = config_from_dict(meta["config"]).model
    order = [t.name for t in export_tensors(read_params(step_dir, key="imp"), model, np.float32)]
    assert order[:2] == ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"]
    theirs = split_state_dict_into_shards_factory(
        {name: tensors[name] for name in order},
        get_storage_size=lambda x: x.nbytes,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=2000,
    )
    assert index["weight_map"] == theirs.tensor_to_filename
    sizes = {
        f: sum(back[t].nbytes for t in names) for f, names in theirs.filename_to_tensors.items()
    }
    alone = [f for f, names in theirs.filename_to_tensors.items() if len(names) == 1]
    assert all(sizes[f] <= 2000 for f in files if f not in alone)
    assert any(sizes[f] > 2000 for f in alone)  # the embedding, over the limit, alone

    # The sharded export imports back, bit for bit.
    run_ok(capsys, "import", str(tmp_path / "out"), str(tmp_path / "imp2"))
    run_ok(capsys, "export", str(tmp_path / "imp2"), str(tmp_path / "out2"))
    again = read_all(tmp_path / "out2" / "model.safetensors")  # 5GB default: one file
    assert not (tmp_path / "out2" / "model.safetensors.index.json").exists()
    for name, x in tensors.items():
        np.testing.assert_array_equal(again[name], x, err_msg=name)


@pytest.mark.parametrize(
    "size, rule",
    [
        ("5XB", "must be a number of bytes, or a number with KB"),
        ("GB", "must be a number of bytes, or a number with KB"),
        ("-1MB", "must be a number of bytes, or a number with KB"),
        ("0", "must be at least 1 byte"),
        ("0.1B", "must be at least 1 byte"),
    ],
)
def test_bad_shard_sizes_are_one_line(tmp_path, capsys, size, rule):
    hf = write_hf(tmp_path / "hf", *gpt2_files())
    run_ok(capsys, "import", str(hf), str(tmp_path / "imp"))
    flag = f"--max-shard-size={size}"  # one word: argparse reads a bare -1MB as an option
    err = one_line_error(capsys, "export", str(tmp_path / "imp"), str(tmp_path / "out"), flag)
    assert f"--max-shard-size={size}: {rule}" in err
    assert not (tmp_path / "out").exists()


def test_shard_sizes_parse_like_transformers():
    from holmes_jax.runtime.hf.files import parse_size

    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("1mib") == 2**20
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size("123") == 123
