"""Hugging Face models in and out: ``config.json`` + safetensors <-> a holmes_jax checkpoint.

    python -m holmes_jax.hf import HF_DIR OUT_DIR     # OUT_DIR/config.yaml + OUT_DIR/checkpoint
    python -m holmes_jax.hf export CKPT_DIR HF_DIR    # HF_DIR/config.json + safetensors

Two families: GPT-2 (``GPT2LMHeadModel`` -> ``model.arch: gpt2``) and Llama
(``LlamaForCausalLM`` -> ``model.arch: llama``). :func:`import_hf` reads ``config.json``
and ``model.safetensors`` (or the shards named by ``model.safetensors.index.json``) one
tensor at a time, maps names and layouts to the logical parameter tree (blocks stacked
``[L, ...]``), and writes a parameters-only checkpoint (:func:`~holmes_jax.runtime.
checkpoint.save_params`) with the matching run config; a run starts from it with
``checkpoint.init_from`` (or from the HF directory itself, read the same way).
:func:`export_hf` reads the parameters of such a checkpoint or of any run's checkpoint
(local or ``gs://``) and writes what ``transformers`` loads with ``from_pretrained``:
``model.safetensors``, or shards of at most ``max_shard_size`` and their index.

The mapping (which HF tensor becomes which leaf, in which layout; config.json fields) is
:mod:`holmes_jax.runtime.hf.mapping`; the files are read and written by
:mod:`holmes_jax.runtime.hf.files`. Before any tensor is read, the import checks them
all: a missing tensor, one of another shape and one nothing maps (buffers such as GPT-2's
causal mask and ``inv_freq`` are skipped) are one-line :class:`ConfigError` s naming it.
Tensors keep their dtype (float32 or bfloat16; float16 and float64 become float32);
bfloat16 comes in and out of numpy through ``ml_dtypes``. Memory: the import holds the
whole model once in host memory (stacked per leaf); the export holds it once plus one
shard of converted tensors.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from typing import Any

import ml_dtypes  # bfloat16 for numpy (safetensors.numpy reads and writes it by name)
import numpy as np
import yaml

from holmes_jax.core.config import Config, config_from_dict
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.yamlio import apply_override, plain
from holmes_jax.runtime.data.loader import token_dtype_for
from holmes_jax.runtime.hf.files import (
    existing_weights,
    export_tensors,
    is_hf_dir,
    parse_size,
    read_hf_params,
    read_json,
    write_safetensors,
)
from holmes_jax.runtime.hf.mapping import HF_NAMES, hf_config, model_from_hf
from holmes_jax.runtime.rundir.checkpoint import find_step, read_params, save_params

EXPORT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
MAX_SHARD_SIZE = "5GB"  # export's default, as huggingface_hub's
CHECKPOINT_SUBDIR = "checkpoint"  # OUT_DIR/checkpoint/0: the imported parameters
CONFIG_NAME = "config.yaml"


# --------------------------------------------------------------------------- import / export


def import_hf(
    hf_dir: str, out_dir: str, overrides: Sequence[str] = (), *, progress: bool = True
) -> str:
    """Convert an HF model directory into ``out_dir/config.yaml`` + ``out_dir/checkpoint``.

    The config's model section comes from ``config.json`` (llama's ``seq_len``:
    ``max_position_embeddings`` up to :data:`LLAMA_SEQ_LEN`); ``checkpoint.init_from``
    points at the checkpoint and ``data`` at the shard directory ``out_dir/data`` (made
    by ``python -m holmes_jax.data prepare --out out_dir/data``); ``overrides``
    (``"train.steps=100"``) go on top. The model's shape must match the tensors, except
    ``model.seq_len`` of a GPT-2, which may be shorter (later positions are dropped).

    Returns:
      One line saying what was written.

    Raises:
      ConfigError: see :func:`model_from_hf` and :func:`read_hf_params`; an out_dir that
        already holds an import.
    """
    where = os.path.join(hf_dir, "config.json")
    hf = read_json(where)
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
            "path": os.path.join(out_dir, "data"),
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


def export_hf(
    ckpt: str,
    hf_dir: str,
    *,
    dtype: str = "float32",
    max_shard_size: int | str = MAX_SHARD_SIZE,
    progress: bool = True,
) -> str:
    """Write ``hf_dir/config.json`` and the weights of a checkpoint as safetensors.

    The weights are ``model.safetensors`` when they fit in one shard of
    ``max_shard_size``; else ``model-00001-of-0000N.safetensors`` ... and
    ``model.safetensors.index.json``, as ``save_pretrained`` writes them
    (:func:`~holmes_jax.runtime.hf.files.write_safetensors`, one shard in memory at a time).
    When the checkpoint descends from an import or an HF directory (itself, or a run
    started from it through ``checkpoint.init_from`` links) whose files are still there,
    ``config.json`` keeps the original's fields that the model does not set (token ids,
    ...) and the tokenizer and generation files (:data:`TOKENIZER_FILES`) are copied, so
    the directory is complete.

    Args:
      ckpt: an import's directory or its ``checkpoint``, a run's ``checkpoint.dir`` (its
        newest step) or one step directory; local or ``gs://``.
      hf_dir: new or empty local directory (no ``config.json`` or weights yet).
      dtype: ``float32`` or ``bfloat16``. The fp32 master weights of a bf16 run are read.
      max_shard_size: bytes, or ``"5GB"``, ``"500MB"``, ``"2GiB"``
        (:func:`~holmes_jax.runtime.hf.files.parse_size`).

    Returns:
      One line saying what was written.
    """
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype={dtype}: must be one of {', '.join(EXPORT_DTYPES)}")
    max_bytes = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    if max_bytes < 1:
        raise ConfigError(f"--max-shard-size={max_shard_size}: must be at least 1 byte")
    there = [n for n in ("config.json",) if os.path.exists(os.path.join(hf_dir, n))]
    there += existing_weights(hf_dir)
    if there:
        raise ConfigError(
            f"{hf_dir}: already holds {there[0]}; export into a new or empty directory"
        )
    step_dir, meta = find_step(ckpt, "CKPT_DIR")
    cfg = config_from_dict(meta["config"], f"{step_dir}/meta")
    params = read_params(step_dir, None, key="CKPT_DIR")
    m = cfg.model
    os.makedirs(hf_dir, exist_ok=True)
    tensors = export_tensors(params, m, EXPORT_DTYPES[dtype])
    files = write_safetensors(hf_dir, tensors, max_bytes, progress=progress)
    del params
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
    shards = len(files) - 1
    weights = f"{shards} shards of at most {max_shard_size}" if shards else files[0]
    also = f"; copied {', '.join(copied)} from {origin['source']}" if copied else ""
    return (
        f"exported {HF_NAMES[m.arch]} ({m.spec.num_params / 1e6:.2f}M params, step "
        f"{meta.get('step', 0)}, {dtype}, {weights}) from {step_dir} to {hf_dir}{also}"
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
    """Where a checkpoint's weights came from: the import's ``meta`` (itself, or reached
    through the runs' ``checkpoint.init_from``), or ``source`` and ``hf_config`` of the HF
    directory a run started from; {} when there is none or it is gone."""
    for _ in range(_ORIGIN_HOPS):
        if meta.get("params_only"):
            return meta
        start = (meta["config"].get("checkpoint") or {}).get("init_from")
        if not start:
            return {}
        if is_hf_dir(start):
            source = os.path.abspath(os.path.expanduser(start))
            try:
                return {"source": source, "hf_config": read_json(f"{source}/config.json")}
            except ConfigError:
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
