"""Hugging Face names, layouts and config.json fields <-> the logical parameter tree.

The one home of the mapping :mod:`holmes_jax.runtime.hf.convert` reads and writes with:

- one :class:`Rule` per HF tensor: its name, its HF shape, the layout functions both ways;
- :func:`model_from_hf`: config.json -> the ``model`` section;
- :func:`hf_config`: the inverse.

GPT-2's ``Conv1D`` stores weights ``[in, out]``, so its kernels are only reshaped.
Llama's ``nn.Linear`` stores ``[out, in]``, so its kernels are transposed, then split into
heads. Both sides rotate q and k with ``rotate_half``, so nothing is permuted.
Llama 3.1's ``rope_scaling`` (``rope_type: llama3``) maps to ``model.rope_scaling_factor``
and its three companions. The table of every tensor: docs/huggingface.md, "The mapping".

Everything the mapping cannot represent is a one-line :class:`ConfigError` naming it:

- an unsupported architecture;
- a config field whose value the model does not implement (GPT-2's exact ``gelu``,
  another ``rope_scaling``, biases);
- a missing tensor, a tensor of another shape, a tensor nothing maps.

Buffers such as GPT-2's causal mask and ``inv_freq`` are skipped. Plain numpy, no files.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from holmes_jax.core.config import ModelConfig
from holmes_jax.core.errors import ConfigError

# HF ``architectures`` entry -> model.arch
ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama"}
HF_NAMES = {arch: name for name, arch in ARCHITECTURES.items()}
PREFIX = {"gpt2": "transformer.", "llama": "model."}  # lm_head.weight has none
_GPT2_GELU = ("gelu_new", "gelu_pytorch_tanh")  # the tanh approximation our GPT-2 uses
# An imported vocabulary not a multiple of this is padded to one (GPT-2: 50257 -> 50304).
VOCAB_MULTIPLE = 128
LLAMA_SEQ_LEN = 2048  # imported llama's model.seq_len unless max_position_embeddings is less


# --------------------------------------------------------------------------- mapping


@dataclass(frozen=True)
class Rule:
    """One HF tensor and the leaf it becomes (for one layer when ``hf`` holds ``{i}``)."""

    hf: str  # name without the family prefix; "{i}" is the layer index
    leaf: tuple[str, ...]  # path in the params tree, e.g. ("blocks", "ln1", "scale")
    shape: tuple[int, ...]  # the HF tensor's shape
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf


def _same(x: np.ndarray) -> np.ndarray:
    return x


def _reshape(*shape: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda x: x.reshape(shape)


def _transpose_to(*shape: int) -> Callable[[np.ndarray], np.ndarray]:
    """[out, in] -> transpose -> reshape to ``shape`` (nn.Linear weight -> our kernel)."""
    return lambda x: x.T.reshape(shape)


def _to_linear(rows: int, cols: int) -> Callable[[np.ndarray], np.ndarray]:
    """Our kernel -> [rows(in), cols(out)] -> transpose (our kernel -> nn.Linear weight)."""
    return lambda x: x.reshape(rows, cols).T


def _pad_rows(rows: int) -> Callable[[np.ndarray], np.ndarray]:
    """[V, ...] -> [rows, ...] with zero rows appended (the padded vocabulary)."""
    return lambda x: np.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def _rows(rows: int) -> Callable[[np.ndarray], np.ndarray]:
    """The first ``rows`` rows (the padded vocabulary cut back to the real one)."""
    return lambda x: x[:rows]


def rules(m: ModelConfig) -> list[Rule]:
    """Every tensor of the HF model of ``m``'s shape, in the module docstring's order.

    The embedding and head of a padded vocabulary (``model.vocab_multiple``) get zero
    rows / columns on the way in and lose them on the way out.
    """
    h, nh, hd, f, v = m.hidden_size, m.num_heads, m.head_dim, m.mlp_size, m.vocab_size
    vp = m.padded_vocab
    wte = Rule("wte.weight", ("embed", "wte"), (v, h), _pad_rows(vp), _rows(v))
    if m.arch == "gpt2":
        out = [
            wte,
            Rule("wpe.weight", ("embed", "wpe"), (m.seq_len, h), _same, _same),
        ]
        for hf, ours in (("ln_1", "ln1"), ("ln_2", "ln2")):
            out += [
                Rule(f"h.{{i}}.{hf}.weight", ("blocks", ours, "scale"), (h,), _same, _same),
                Rule(f"h.{{i}}.{hf}.bias", ("blocks", ours, "bias"), (h,), _same, _same),
            ]
        out += [
            Rule(
                "h.{i}.attn.c_attn.weight",
                ("blocks", "qkv_kernel"),
                (h, 3 * h),
                _reshape(h, 3, nh, hd),
                _reshape(h, 3 * h),
            ),
            Rule(
                "h.{i}.attn.c_attn.bias",
                ("blocks", "qkv_bias"),
                (3 * h,),
                _reshape(3, nh, hd),
                _reshape(3 * h),
            ),
            Rule(
                "h.{i}.attn.c_proj.weight",
                ("blocks", "out_kernel"),
                (h, h),
                _reshape(nh, hd, h),
                _reshape(h, h),
            ),
            Rule("h.{i}.attn.c_proj.bias", ("blocks", "out_bias"), (h,), _same, _same),
            Rule("h.{i}.mlp.c_fc.weight", ("blocks", "fc_kernel"), (h, f), _same, _same),
            Rule("h.{i}.mlp.c_fc.bias", ("blocks", "fc_bias"), (f,), _same, _same),
            Rule("h.{i}.mlp.c_proj.weight", ("blocks", "proj_kernel"), (f, h), _same, _same),
            Rule("h.{i}.mlp.c_proj.bias", ("blocks", "proj_bias"), (h,), _same, _same),
            Rule("ln_f.weight", ("head", "ln_f", "scale"), (h,), _same, _same),
            Rule("ln_f.bias", ("head", "ln_f", "bias"), (h,), _same, _same),
        ]
    else:
        kv = m.num_kv_heads
        out = [
            dataclasses.replace(wte, hf="embed_tokens.weight"),
            Rule(
                "layers.{i}.input_layernorm.weight", ("blocks", "ln1", "scale"), (h,), _same, _same
            ),
        ]
        for name, heads in (("q", nh), ("k", kv), ("v", kv)):
            out.append(
                Rule(
                    f"layers.{{i}}.self_attn.{name}_proj.weight",
                    ("blocks", f"{name}_kernel"),
                    (heads * hd, h),
                    _transpose_to(h, heads, hd),
                    _to_linear(h, heads * hd),
                )
            )
        out += [
            Rule(
                "layers.{i}.self_attn.o_proj.weight",
                ("blocks", "out_kernel"),
                (h, nh * hd),
                _transpose_to(nh, hd, h),
                _to_linear(nh * hd, h),
            ),
            Rule(
                "layers.{i}.post_attention_layernorm.weight",
                ("blocks", "ln2", "scale"),
                (h,),
                _same,
                _same,
            ),
        ]
        for name in ("gate", "up"):
            out.append(
                Rule(
                    f"layers.{{i}}.mlp.{name}_proj.weight",
                    ("blocks", f"{name}_kernel"),
                    (f, h),
                    _transpose_to(h, f),
                    _to_linear(h, f),
                )
            )
        out += [
            Rule(
                "layers.{i}.mlp.down_proj.weight",
                ("blocks", "down_kernel"),
                (h, f),
                _transpose_to(f, h),
                _to_linear(f, h),
            ),
            Rule("norm.weight", ("head", "ln_f", "scale"), (h,), _same, _same),
        ]
    if not m.tied_embeddings:
        out.append(
            Rule(
                "lm_head.weight",
                ("head", "lm_kernel"),
                (v, h),
                lambda x: _pad_rows(vp)(x).T,  # [V, H] -> [H, Vp]
                lambda x: x[:, :v].T,  # [H, Vp] -> [V, H]
            )
        )
    return out


def hf_name(rule: Rule, arch: str, layer: int | None = None) -> str:
    """The name ``transformers`` writes for ``rule`` (layer ``layer`` when per layer)."""
    name = rule.hf.replace("{i}", str(layer)) if layer is not None else rule.hf
    return name if name == "lm_head.weight" else PREFIX[arch] + name


# --------------------------------------------------------------------------- config.json


def model_from_hf(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The ``model`` section of a run config from an HF ``config.json`` (as a mapping).

    Raises:
      ConfigError: an architecture other than GPT-2 / Llama, or a field whose value the
        model does not implement; the message names the file, the field and the value.
    """
    arch = _arch(hf, where)

    def get(key: str, default: Any = None) -> Any:
        value = hf.get(key)
        return default if value is None else value

    def refuse(key: str, rule: str) -> None:
        raise ConfigError(f"{where}: {key}={json.dumps(hf.get(key))}: {rule}")

    if hf.get("quantization_config"):
        refuse("quantization_config", "quantized checkpoints are not supported")
    if arch == "gpt2":
        if get("activation_function", "gelu_new") not in _GPT2_GELU:
            refuse("activation_function", f"holmes_jax's gpt2 uses {' / '.join(_GPT2_GELU)}")
        for key, want in (
            ("scale_attn_weights", True),
            ("scale_attn_by_inverse_layer_idx", False),
            ("add_cross_attention", False),
        ):
            if get(key, want) != want:
                refuse(key, f"holmes_jax's gpt2 needs {json.dumps(want)}")
        hidden = get("n_embd")
        model = {
            "arch": "gpt2",
            "vocab_size": get("vocab_size"),
            "seq_len": get("n_positions", get("n_ctx")),
            "num_layers": get("n_layer"),
            "num_heads": get("n_head"),
            "hidden_size": hidden,
            "norm_eps": get("layer_norm_epsilon", 1e-5),
            "tied_embeddings": get("tie_word_embeddings", True),
        }
        inner = get("n_inner")
        if inner is not None and isinstance(hidden, int) and inner != 4 * hidden:
            model["mlp_size"] = inner
    else:
        if get("hidden_act", "silu") != "silu":
            refuse("hidden_act", "holmes_jax's llama uses silu (SwiGLU)")
        for key in ("attention_bias", "mlp_bias"):
            if get(key, False):
                refuse(key, "holmes_jax's llama has no biases")
        rope = hf.get("rope_parameters") or {}  # transformers >= 5: theta and scaling
        scaling = hf.get("rope_scaling") or (
            rope if rope.get("rope_type", "default") != "default" else None
        )
        if scaling and scaling.get("rope_type", scaling.get("type")) != "llama3":
            raise ConfigError(
                f"{where}: rope_scaling={json.dumps(scaling)}: holmes_jax's llama implements "
                "rope_type llama3 (Llama 3.1) only"
            )
        hidden, heads = get("hidden_size"), get("num_attention_heads")
        head_dim = get("head_dim")
        if head_dim is not None and isinstance(hidden, int) and isinstance(heads, int):
            if heads and head_dim * heads != hidden:
                refuse("head_dim", f"must be hidden_size / num_attention_heads = {hidden // heads}")
        positions = get("max_position_embeddings", LLAMA_SEQ_LEN)
        model = {
            "arch": "llama",
            "vocab_size": get("vocab_size"),
            "seq_len": min(positions, LLAMA_SEQ_LEN) if isinstance(positions, int) else positions,
            "num_layers": get("num_hidden_layers"),
            "num_heads": heads,
            "num_kv_heads": get("num_key_value_heads", heads),
            "hidden_size": hidden,
            "mlp_size": get("intermediate_size"),
            "rope_base": float(rope.get("rope_theta") or get("rope_theta", 10000.0)),
            "norm_eps": get("rms_norm_eps", 1e-6),
            "tied_embeddings": get("tie_word_embeddings", False),
        }
        if scaling:
            model |= {
                "rope_scaling_factor": scaling.get("factor"),
                "rope_low_freq_factor": scaling.get("low_freq_factor"),
                "rope_high_freq_factor": scaling.get("high_freq_factor"),
                "rope_original_max_positions": scaling.get("original_max_position_embeddings"),
            }
    for key, value in model.items():
        if value is None:
            raise ConfigError(
                f"{where}: has no value for model.{key} (a {arch} config.json names it)"
            )
    if isinstance(model["vocab_size"], int) and model["vocab_size"] % VOCAB_MULTIPLE:
        model["vocab_multiple"] = VOCAB_MULTIPLE  # so that tensor 2, 4, 8... divide it
    return model


def _arch(hf: dict[str, Any], where: str) -> str:
    names = hf.get("architectures") or []
    if not isinstance(names, list):
        names = [names]
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    what = f"architectures={json.dumps(names)}" if names else f"model_type={hf.get('model_type')!r}"
    raise ConfigError(
        f"{where}: {what}: unsupported architecture (holmes_jax reads {', '.join(ARCHITECTURES)})"
    )


def hf_config(m: ModelConfig, dtype: str) -> dict[str, Any]:
    """``config.json`` of the HF model equal to ``m`` (what ``from_pretrained`` reads)."""
    common = {"architectures": [HF_NAMES[m.arch]], "vocab_size": m.vocab_size, "dtype": dtype}
    common["tie_word_embeddings"] = m.tied_embeddings
    if m.arch == "gpt2":
        return {
            **common,
            "model_type": "gpt2",
            "n_positions": m.seq_len,
            "n_embd": m.hidden_size,
            "n_layer": m.num_layers,
            "n_head": m.num_heads,
            "n_inner": m.mlp_size,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": m.norm_eps,
            "resid_pdrop": m.dropout,
            "embd_pdrop": m.dropout,
            "attn_pdrop": 0.0,
            "scale_attn_weights": True,
        }
    rope: dict[str, Any] = {"rope_type": "default"}
    if m.rope_scaling_factor:
        rope = {
            "rope_type": "llama3",
            "factor": m.rope_scaling_factor,
            "low_freq_factor": m.rope_low_freq_factor,
            "high_freq_factor": m.rope_high_freq_factor,
            "original_max_position_embeddings": m.rope_original_max_positions,
        }
    return {
        **common,
        "model_type": "llama",
        "hidden_size": m.hidden_size,
        "intermediate_size": m.mlp_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "max_position_embeddings": m.seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_base,  # transformers < 5 reads these two
        "rope_scaling": rope if m.rope_scaling_factor else None,
        "rope_parameters": {**rope, "rope_theta": m.rope_base},  # transformers >= 5
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }
