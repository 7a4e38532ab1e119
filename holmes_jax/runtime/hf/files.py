"""The safetensors files of a Hugging Face model directory, read and written.

Reading (``python -m holmes_jax.hf import`` and ``checkpoint.init_from`` of an HF directory):
:class:`SafetensorsDir` opens ``model.safetensors`` or the shards that
``model.safetensors.index.json`` names, lazily, and :func:`read_hf_params` reads one tensor
at a time into the logical parameter tree (blocks stacked ``[L, ...]``), every tensor
checked before the first is read. :func:`read_hf_for_run` does the same for a run, after
checking ``config.json`` against the run's model section.

Writing (``python -m holmes_jax.hf export``): :func:`write_safetensors` writes what
``transformers`` writes with ``save_pretrained(max_shard_size=...)``:

- the tensors in the model's order, cut into shards by huggingface_hub's rule: a tensor
  that would take the current shard past the limit starts the next one, and a tensor
  larger than the limit is a shard of its own;
- one shard: ``model.safetensors`` and no index;
- several: ``model-00001-of-0000N.safetensors`` ... and ``model.safetensors.index.json``
  (``{"metadata": {"total_parameters", "total_size"}, "weight_map": {name: file}}``).

Memory: the plan needs only shapes and dtypes, so each shard's tensors are converted just
before it is written (safetensors writes them from their buffers, no copy) and dropped
after. Host memory holds the parameters read plus at most one shard of converted tensors
(a tensor over the limit: itself).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file
from tqdm import tqdm

from holmes_jax.core.config import ModelConfig
from holmes_jax.core.errors import ConfigError, one_line
from holmes_jax.runtime.hf.mapping import (
    HF_NAMES,
    PREFIX,
    Rule,
    hf_name,
    model_from_hf,
    rules,
)
from holmes_jax.runtime.rundir.storage import is_remote

# Buffers some checkpoints carry that are not parameters (GPT-2's causal mask, rotary
# frequencies): skipped on import.
_BUFFERS = re.compile(r"(^|\.)attn\.(masked_)?bias$|rotary_emb\.inv_freq$")
_KEEP_DTYPES = ("float32", "bfloat16")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


# --------------------------------------------------------------------------- reading


class SafetensorsDir:
    """The tensors of an HF model directory, opened lazily, read one at a time."""

    def __init__(self, directory: str):
        self.directory = directory
        index = os.path.join(directory, INDEX_FILE)
        single = os.path.join(directory, SINGLE_FILE)
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
            handle = self._handle(SINGLE_FILE)
            files = {name: SINGLE_FILE for name in handle.keys()}  # noqa: SIM118
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


def is_hf_dir(path: str) -> bool:
    """Whether ``path`` is a local Hugging Face model directory (it holds ``config.json``)."""
    return not is_remote(path) and os.path.isfile(
        os.path.join(os.path.expanduser(path), "config.json")
    )


def read_json(path: str) -> dict[str, Any]:
    """A JSON object from a file; a missing, unreadable or non-object file is one line."""
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


def read_hf_for_run(directory: str, m: ModelConfig, key: str) -> dict[str, Any]:
    """The parameters of an HF model directory for a run whose model section is ``m``
    (:func:`read_hf_params`), once ``config.json`` describes the same model.

    Every key ``config.json`` sets must equal the run's, except ``seq_len``: a llama takes
    any, a GPT-2 at most its learned positions (``n_positions``; the later ones are
    dropped). ``vocab_multiple`` is the run's choice (the padding rows are zeros).

    Raises:
      ConfigError: the first key that differs, named with both values; see also
        :func:`read_hf_params`.
    """
    where = os.path.join(directory, "config.json")
    theirs = model_from_hf(read_json(where), where)
    names = [f.name for f in dataclasses.fields(ModelConfig)]
    hf = dataclasses.asdict(ModelConfig(**{k: v for k, v in theirs.items() if k in names}))
    ours = dataclasses.asdict(m)
    compared = set(theirs) | {"num_kv_heads", "mlp_size"}
    if m.arch == "llama":
        compared.add("rope_scaling_factor")  # 0 (none) unless config.json scales
    for name in names:
        if name in compared - {"seq_len", "vocab_multiple"} and hf[name] != ours[name]:
            raise ConfigError(
                f"model.{name}={ours[name]}: {key}={directory} is a {HF_NAMES.get(hf['arch'])} "
                f"with model.{name}={hf[name]} (its config.json); set the run's model section "
                "to match (python -m holmes_jax.hf import writes it)"
            )
    if m.arch == "gpt2" and m.seq_len > hf["seq_len"]:
        raise ConfigError(
            f"model.seq_len={m.seq_len}: {key}={directory} has {hf['seq_len']} learned "
            "positions (n_positions); must be at most that"
        )
    return read_hf_params(directory, m, progress=False)


# --------------------------------------------------------------------------- writing


@dataclasses.dataclass(frozen=True)
class OutTensor:
    """One tensor to write: its name, shape and dtype, and how to make it (called just
    before its shard is written)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    make: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def export_tensors(params: dict[str, Any], m: ModelConfig, dtype: np.dtype) -> list[OutTensor]:
    """Every tensor of the HF model of ``m`` from the logical ``params``, in the order
    ``transformers`` holds them (embeddings, layer 0, layer 1, ..., final norm, head);
    nothing is converted yet."""
    every = rules(m)
    first = next((i for i, r in enumerate(every) if r.per_layer), len(every))
    last = max((i for i, r in enumerate(every) if r.per_layer), default=first - 1)
    layered = every[first : last + 1]
    order = [(r, None) for r in every[:first]]
    order += [(r, layer) for layer in range(m.num_layers) for r in layered]
    order += [(r, None) for r in every[last + 1 :]]

    def make(rule: Rule, layer: int | None) -> Callable[[], np.ndarray]:
        def convert() -> np.ndarray:
            leaf = params
            for key in rule.leaf:
                leaf = leaf[key]
            x = leaf if layer is None else leaf[layer]
            return np.ascontiguousarray(rule.to_hf(x), dtype=dtype)

        return convert

    return [
        OutTensor(hf_name(r, m.arch, layer), r.shape, np.dtype(dtype), make(r, layer))
        for r, layer in order
    ]


# Decimal units as huggingface_hub's, binary ones as transformers' (KiB, MiB, GiB).
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str, key: str = "--max-shard-size") -> int:
    """Bytes from ``"5GB"``, ``"500MB"``, ``"2GiB"``, ``"1.5GB"`` or ``"1000000"``.

    Raises:
      ConfigError: anything else, or less than one byte.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if unit not in _SIZE_UNITS:
        raise ConfigError(
            f"{key}={text}: must be a number of bytes, or a number with KB, MB, GB, TB, "
            "KiB, MiB, GiB or TiB (e.g. 500MB, 2GiB)"
        )
    size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size < 1:
        raise ConfigError(f"{key}={text}: must be at least 1 byte")
    return size


def shard_plan(tensors: Sequence[OutTensor], max_bytes: int) -> list[list[OutTensor]]:
    """The shards, huggingface_hub's ``split_state_dict_into_shards_factory`` rule: in
    order, a tensor that would take the current shard past ``max_bytes`` closes it; a
    tensor larger than ``max_bytes`` becomes a shard of its own at once."""
    shards: list[list[OutTensor]] = []
    current: list[OutTensor] = []
    size = 0
    for t in tensors:
        if t.nbytes > max_bytes:
            shards.append([t])
            continue
        if size + t.nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current:
        shards.append(current)
    return shards


def existing_weights(directory: str) -> list[str]:
    """The weight files (single, index, shards) ``directory`` already holds, by name."""
    if not os.path.isdir(directory):
        return []
    return sorted(
        n
        for n in os.listdir(directory)
        if n in (SINGLE_FILE, INDEX_FILE) or SHARD_FILE.fullmatch(n)
    )


def write_safetensors(
    directory: str, tensors: Sequence[OutTensor], max_bytes: int, *, progress: bool = True
) -> list[str]:
    """Write ``tensors`` into ``directory`` as ``transformers`` would (module docstring),
    one shard at a time. Returns the files written, the index last when there is one."""
    shards = shard_plan(tensors, max_bytes)
    n = len(shards)
    files = (
        [SINGLE_FILE]
        if n == 1
        else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    )
    bar = tqdm(
        total=len(tensors), desc="writing tensors", unit="tensor", disable=not progress, leave=False
    )
    with bar:
        for file, shard in zip(files, shards, strict=True):
            converted = {t.name: t.make() for t in shard}  # this shard only
            save_file(converted, os.path.join(directory, file), metadata={"format": "pt"})
            del converted
            bar.update(len(shard))
    if n == 1:
        return files
    index = {
        "metadata": {
            "total_parameters": sum(math.prod(t.shape) for t in tensors),
            "total_size": sum(t.nbytes for t in tensors),
        },
        "weight_map": {
            t.name: file for file, shard in zip(files, shards, strict=True) for t in shard
        },
    }
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*files, INDEX_FILE]
