"""Hugging Face models in and out: ``config.json`` + safetensors <-> a holmes_jax checkpoint.

    python -m holmes_jax.hf import HF_DIR OUT_DIR     # OUT_DIR/config.yaml + OUT_DIR/checkpoint
    python -m holmes_jax.hf export CKPT_DIR HF_DIR    # HF_DIR/config.json + model.safetensors

Two families: GPT-2 (``GPT2LMHeadModel`` -> ``model.arch: gpt2``) and Llama
(``LlamaForCausalLM`` -> ``model.arch: llama``). :func:`import_hf` reads ``config.json``
and ``model.safetensors`` (or the shards named by ``model.safetensors.index.json``) one
tensor at a time, maps names and layouts to the logical parameter tree (blocks stacked
``[L, ...]``), and writes a parameters-only checkpoint (:func:`~holmes_jax.runtime.
checkpoint.save_params`) with the matching run config; a run starts from it with
``checkpoint.init_from``. :func:`export_hf` reads the parameters of such a checkpoint or of
any run's checkpoint and writes what ``transformers`` loads with ``from_pretrained``.

The mapping (which HF tensor becomes which leaf, in which layout; config.json fields) is
:mod:`holmes_jax.runtime.hf_mapping`. Before any tensor is read, the import checks them
all: a missing tensor, one of another shape and one nothing maps (buffers such as GPT-2's
causal mask and ``inv_freq`` are skipped) are one-line :class:`ConfigError` s naming it.
Tensors keep their dtype (float32 or bfloat16; float16 and float64 become float32);
bfloat16 comes in and out of numpy through ``ml_dtypes``. Memory: the import holds the
whole model once in host memory (stacked per leaf), the export twice.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from typing import Any

import ml_dtypes  # bfloat16 for numpy (safetensors.numpy reads and writes it by name)
import numpy as np
import yaml
from safetensors import safe_open
from safetensors.numpy import save_file
from tqdm import tqdm

from holmes_jax.core.config import Config, ModelConfig, config_from_dict
from holmes_jax.core.errors import ConfigError, one_line
from holmes_jax.core.yamlio import apply_override, plain
from holmes_jax.runtime.checkpoint import find_step, read_params, save_params
from holmes_jax.runtime.data import token_dtype_for
from holmes_jax.runtime.hf_mapping import (
    HF_NAMES,
    PREFIX,
    Rule,
    hf_config,
    hf_name,
    model_from_hf,
    rules,
)

# Buffers some checkpoints carry that are not parameters (GPT-2's causal mask, rotary
# frequencies): skipped on import.
_BUFFERS = re.compile(r"(^|\.)attn\.(masked_)?bias$|rotary_emb\.inv_freq$")
_KEEP_DTYPES = ("float32", "bfloat16")
EXPORT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
CHECKPOINT_SUBDIR = "checkpoint"  # OUT_DIR/checkpoint/0: the imported parameters
CONFIG_NAME = "config.yaml"


# --------------------------------------------------------------------------- safetensors


class SafetensorsDir:
    """The tensors of an HF model directory, opened lazily, read one at a time."""

    def __init__(self, directory: str):
        self.directory = directory
        index = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                files = {str(name): str(file) for name, file in weight_map.items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ConfigError(f"{index}: not a safetensors index ({one_line(e)})") from None
        elif os.path.isfile(single):
            files = None
        else:
            others = [
                n
                for n in ("pytorch_model.bin", "model.bin")
                if os.path.exists(os.path.join(directory, n))
            ]
            hint = f" (found {others[0]}: only safetensors are read)" if others else ""
            raise ConfigError(
                f"{directory}: holds neither model.safetensors nor "
                f"model.safetensors.index.json{hint}"
            )
        self._stack = ExitStack()
        self._open: dict[str, Any] = {}
        if files is None:
            handle = self._handle("model.safetensors")
            files = {name: "model.safetensors" for name in handle.keys()}  # noqa: SIM118
        self.files = files

    def _handle(self, file: str):
        if file not in self._open:
            path = os.path.join(self.directory, file)
            try:
                self._open[file] = self._stack.enter_context(safe_open(path, framework="np"))
            except Exception as e:  # noqa: BLE001 (missing, truncated or not safetensors)
                raise ConfigError(
                    f"{path}: cannot be read as safetensors ({one_line(e)})"
                ) from None
        return self._open[file]

    def names(self) -> list[str]:
        return sorted(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.files[name]).get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        try:
            return self._handle(self.files[name]).get_tensor(name)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 (a short or damaged file)
            raise ConfigError(
                f"{self.directory}: tensor {name} cannot be read ({one_line(e)})"
            ) from None

    def close(self) -> None:
        self._stack.close()


def _leaf_dtype(x: np.ndarray) -> np.dtype:
    """float32 and bfloat16 are kept; every other float becomes float32."""
    return x.dtype if x.dtype.name in _KEEP_DTYPES else np.dtype(np.float32)


def read_hf_params(directory: str, m: ModelConfig, *, progress: bool = True) -> dict[str, Any]:
    """The logical parameter tree (numpy, blocks stacked ``[L, ...]``) of an HF model.

    Raises:
      ConfigError: a missing tensor, one of another shape, or one nothing maps.
    """
    tensors = SafetensorsDir(directory)
    try:
        params: dict[str, Any] = {}
        plan = _read_plan(tensors, m)
        bar = tqdm(
            total=len(plan),
            desc="reading tensors",
            unit="tensor",
            disable=not progress,
            leave=False,
        )
        with bar:
            for rule, layer, name in plan:
                x = tensors.get(name)
                if rule.leaf == ("embed", "wpe"):
                    x = x[: m.seq_len]  # a shorter model.seq_len drops the later positions
                ours = rule.to_ours(x)
                node = params
                for key in rule.leaf[:-1]:
                    node = node.setdefault(key, {})
                last = rule.leaf[-1]
                if layer is None:
                    node[last] = np.ascontiguousarray(ours, dtype=_leaf_dtype(ours))
                else:
                    if last not in node:
                        node[last] = np.empty((m.num_layers, *ours.shape), _leaf_dtype(ours))
                    node[last][layer] = ours
                bar.update()
        return params
    finally:
        tensors.close()


def _read_plan(tensors: SafetensorsDir, m: ModelConfig) -> list[tuple[Rule, int | None, str]]:
    """(rule, layer, name in the files) for every tensor to read, all checked first: no
    tensor is missing or of another shape, and every tensor present has a use."""
    present = set(tensors.names())
    plan, used = [], set()
    for rule in rules(m):
        for layer in range(m.num_layers) if rule.per_layer else [None]:
            name = _find(rule, m.arch, layer, present)
            if name is None:
                raise ConfigError(
                    f"{tensors.directory}: tensor {hf_name(rule, m.arch, layer)} is missing "
                    f"(a {HF_NAMES[m.arch]} of this config.json has it)"
                )
            shape = tensors.shape(name)
            want = rule.shape
            if rule.leaf == ("embed", "wpe") and len(shape) == 2 and shape[0] >= m.seq_len:
                want = (shape[0], *rule.shape[1:])  # more positions than model.seq_len: cut
            if shape != want:
                raise ConfigError(
                    f"{tensors.directory}: tensor {name} has shape {list(shape)}, expected "
                    f"{list(want)} from config.json"
                )
            plan.append((rule, layer, name))
            used.add(name)
    if m.tied_embeddings:  # some tied checkpoints store the head anyway: the same matrix
        used |= {"lm_head.weight"}
    unused = sorted(n for n in present - used if not _BUFFERS.search(n))
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise ConfigError(
            f"{tensors.directory}: tensor {unused[0]}{more} has no place in a "
            f"{HF_NAMES[m.arch]} of this config.json"
        )
    return plan


def _find(rule: Rule, arch: str, layer: int | None, present: set[str]) -> str | None:
    """The name ``rule`` has in these files: with the family prefix, or bare (old GPT-2)."""
    name = hf_name(rule, arch, layer)
    if name in present:
        return name
    bare = name.removeprefix(PREFIX[arch])
    return bare if bare in present else None


def hf_tensors(
    params: dict[str, Any], m: ModelConfig, dtype: str
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, contiguous tensor in ``dtype``) for every tensor of the HF model."""
    for rule in rules(m):
        leaf = params
        for key in rule.leaf:
            leaf = leaf[key]
        for layer in range(m.num_layers) if rule.per_layer else [None]:
            x = leaf if layer is None else leaf[layer]
            yield (
                hf_name(rule, m.arch, layer),
                np.ascontiguousarray(rule.to_hf(x), dtype=EXPORT_DTYPES[dtype]),
            )


# --------------------------------------------------------------------------- import / export


def import_hf(
    hf_dir: str, out_dir: str, overrides: Sequence[str] = (), *, progress: bool = True
) -> str:
    """Convert an HF model directory into ``out_dir/config.yaml`` + ``out_dir/checkpoint``.

    The config's model section comes from ``config.json`` (llama's ``seq_len``:
    ``max_position_embeddings`` up to :data:`LLAMA_SEQ_LEN`); ``checkpoint.init_from``
    points at the checkpoint and ``data`` at ``out_dir/train.tokens`` (made by
    ``python -m holmes_jax.data prepare``); ``overrides`` (``"train.steps=100"``) go on
    top. The model's shape must match the tensors, except ``model.seq_len`` of a GPT-2,
    which may be shorter (later positions are dropped).

    Returns:
      One line saying what was written.

    Raises:
      ConfigError: see :func:`model_from_hf` and :func:`read_hf_params`; an out_dir that
        already holds an import.
    """
    where = os.path.join(hf_dir, "config.json")
    hf = _read_json(where)
    out_dir = os.path.abspath(out_dir)
    ckpt_dir = os.path.join(out_dir, CHECKPOINT_SUBDIR)
    if os.path.exists(ckpt_dir) or os.path.exists(os.path.join(out_dir, CONFIG_NAME)):
        raise ConfigError(f"{out_dir}: already holds an import; use a new or empty directory")
    model = model_from_hf(hf, where)
    vocab = model["vocab_size"]  # checked with the rest of the config below
    raw: dict[str, Any] = {
        "model": model,
        "data": {
            "source": "tokens",
            "path": os.path.join(out_dir, "train.tokens"),
            "token_dtype": token_dtype_for(vocab) if isinstance(vocab, int) else "uint16",
        },
        "checkpoint": {"init_from": ckpt_dir},
    }
    for item in overrides:
        apply_override(raw, item, Config)
    cfg = config_from_dict(raw, where)
    params = read_hf_params(hf_dir, cfg.model, progress=progress)
    os.makedirs(out_dir, exist_ok=True)
    origin = {"source": os.path.abspath(hf_dir), "hf_config": hf}  # for the export
    save_params(ckpt_dir, params, cfg, extra=origin)
    config_path = os.path.join(out_dir, CONFIG_NAME)
    with open(config_path, "w") as f:
        f.write(_config_yaml(cfg, raw, hf_dir, out_dir))
    n = cfg.model.spec.num_params
    return (
        f"imported {HF_NAMES[cfg.model.arch]} ({n / 1e6:.2f}M params) from {hf_dir}: "
        f"checkpoint {ckpt_dir}, config {config_path}"
    )


def export_hf(ckpt: str, hf_dir: str, *, dtype: str = "float32", progress: bool = True) -> str:
    """Write ``hf_dir/config.json`` + ``hf_dir/model.safetensors`` from a checkpoint.

    When the checkpoint descends from an import (itself, or a run started from it through
    ``checkpoint.init_from`` links) whose files are still there, ``config.json`` keeps the
    original's fields that the model does not set (token ids, ...) and the tokenizer and
    generation files (:data:`TOKENIZER_FILES`) are copied, so the directory is complete.

    Args:
      ckpt: an import's directory or its ``checkpoint``, a run's ``checkpoint.dir`` (its
        newest step) or one step directory.
      hf_dir: new or empty directory (no ``config.json`` or ``model.safetensors`` yet).
      dtype: ``float32`` or ``bfloat16``. The fp32 master weights of a bf16 run are read.

    Returns:
      One line saying what was written.
    """
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype={dtype}: must be one of {', '.join(EXPORT_DTYPES)}")
    for name in ("config.json", "model.safetensors"):
        if os.path.exists(os.path.join(hf_dir, name)):
            raise ConfigError(
                f"{hf_dir}: already holds {name}; export into a new or empty directory"
            )
    step_dir, meta = find_step(ckpt, "CKPT_DIR")
    cfg = config_from_dict(meta["config"], f"{step_dir}/meta")
    params = read_params(step_dir, None, key="CKPT_DIR")
    m = cfg.model
    tensors = {}
    total = len([1 for r in rules(m) for _ in range(m.num_layers if r.per_layer else 1)])
    with tqdm(
        total=total, desc="mapping tensors", unit="tensor", disable=not progress, leave=False
    ) as bar:
        for name, x in hf_tensors(params, m, dtype):
            tensors[name] = x
            bar.update()
    del params
    os.makedirs(hf_dir, exist_ok=True)
    save_file(tensors, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    origin = import_origin(meta)
    config = hf_config(m, dtype)
    base = origin.get("hf_config") or {}
    copied = []
    if _same_model(base, config):  # keep what we do not set (token ids, ...), and the tokenizer
        kept = {k: v for k, v in base.items() if k not in _NOT_KEPT}
        config = {**kept, **config, **({"n_ctx": m.seq_len} if "n_ctx" in base else {})}
        copied = _copy_tokenizer(origin.get("source"), hf_dir)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    also = f"; copied {', '.join(copied)} from {origin['source']}" if copied else ""
    return (
        f"exported {HF_NAMES[m.arch]} ({m.spec.num_params / 1e6:.2f}M params, step "
        f"{meta.get('step', 0)}, {dtype}) from {step_dir} to {hf_dir}{also}"
    )


# Files of an HF model directory that describe its tokenizer and generation defaults.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
)
_NOT_KEPT = ("torch_dtype", "transformers_version", "_name_or_path", "n_ctx")
_ORIGIN_HOPS = 16  # init_from links followed back to an import


def import_origin(meta: dict[str, Any]) -> dict[str, Any]:
    """The import's ``meta`` a checkpoint descends from (itself, or through the runs'
    ``checkpoint.init_from``), or {} when there is none or it is gone."""
    for _ in range(_ORIGIN_HOPS):
        if meta.get("params_only"):
            return meta
        start = (meta["config"].get("checkpoint") or {}).get("init_from")
        if not start:
            return {}
        try:
            _, meta = find_step(start, "checkpoint.init_from")
        except ConfigError:
            return {}
    return {}


def _same_model(base: dict[str, Any], ours: dict[str, Any]) -> bool:
    """Whether the original config.json describes the exported model's family and vocab."""
    return bool(base) and (
        base.get("architectures") == ours["architectures"]
        and base.get("vocab_size") == ours["vocab_size"]
    )


def _copy_tokenizer(source: str | None, hf_dir: str) -> list[str]:
    """Copy the tokenizer (and generation) files of the imported directory, if still there."""
    copied = []
    for name in TOKENIZER_FILES:
        path = os.path.join(source or "", name)
        if source and os.path.isfile(path):
            shutil.copyfile(path, os.path.join(hf_dir, name))
            copied.append(name)
    return copied


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            value = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found (an HF model directory holds config.json)") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot be read as JSON ({one_line(e)})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: must hold a JSON object")
    return value


def _config_yaml(cfg: Config, raw: dict[str, Any], hf_dir: str, out_dir: str) -> str:
    """The run config an import writes: a header saying what it is and how to use it,
    the full model section, and the sections the import (or an override) set."""
    body = {"model": plain(cfg.to_dict()["model"])}
    full = cfg.to_dict()
    for section in raw:
        if section != "model":
            body[section] = {key: full[section][key] for key in raw[section]}
    config = os.path.join(out_dir, CONFIG_NAME)
    header = [
        f"# {HF_NAMES[cfg.model.arch]} imported from {os.path.abspath(hf_dir)}",
        "# by python -m holmes_jax.hf import. A run with this config starts from the imported",
        "# weights (checkpoint.init_from: a fresh optimizer at step 0). Tokenize text with the",
        "# model's own tokenizer into data.path first:",
        f"#   python -m holmes_jax.data prepare --tokenizer {os.path.abspath(hf_dir)} \\",
        f"#     --input TEXT_FILE_OR_DIR --out {cfg.data.path}",
        f"#   python -m holmes_jax.train --config {config} --set checkpoint.dir=RUN_DIR",
        "# and publish the fine-tuned model:",
        "#   python -m holmes_jax.hf export RUN_DIR HF_OUT_DIR",
    ]
    return "\n".join(header) + "\n" + yaml.safe_dump(body, sort_keys=False)
