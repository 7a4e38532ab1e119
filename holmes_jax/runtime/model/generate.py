"""Text from a trained checkpoint: the library behind ``python -m holmes_jax.sample``.

    python -m holmes_jax.sample --checkpoint runs/quickstart --prompt "def "

- **Checkpoint** (:func:`find_checkpoint`): a run directory (its ``checkpoints/``), a
  checkpoint directory (its newest step) or one step directory. Every plan saves the same
  logical layout, so a checkpoint of any plan (pipeline, tensor, ZeRO-1, bf16, DiLoCo)
  loads here. :func:`~holmes_jax.runtime.rundir.checkpoint.read_params` reads the parameters
  alone onto one device in fp32: a bf16 run's fp32 master, a DiLoCo run's global model.
- **Config**: ``--config`` when given, else the run directory's ``config.yaml``, else the
  config stored with the step (the same config; every step directory carries it).
- **Tokenizer** (:func:`text_tokenizer`): bytes for ``data.source`` stdlib and text. For
  ``tokens``, the Hugging Face tokenizer that ``python -m holmes_jax.data prepare`` names in
  the shards' sidecars or index, else that of the Hugging Face import the checkpoint descends
  from. ``--tokenizer`` overrides both. Nothing is downloaded.
- **Decoding** (:class:`Generator`): one jitted step per new token, compiled once per model
  and number of samples, whatever the prompt length, the number of new tokens, the
  temperature or top-k. The step runs the model over a fixed ``[S, seq_len]`` window: the
  prompt, then the tokens drawn so far, then padding. Attention is causal, so the padding
  after position n - 1 cannot change its logits, and those logits pick the next token.
  Once the window is full it slides by one token, as nanoGPT crops to its block size.
  There is no KV cache: each new token costs a whole forward pass over ``seq_len``
  positions, about ``seq_len`` times the FLOPs of a cached step.
- **Sampling**: logits / temperature, restricted to the ``top_k`` largest (0: all);
  temperature 0 is greedy. Sample s draws its step-i token with
  ``fold_in(fold_in(key(seed), i), s)``, so a seed gives the same samples every time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from holmes_jax.core.config import Config, ModelConfig, config_from_dict, load_config
from holmes_jax.core.errors import ConfigError
from holmes_jax.runtime.data.loader import ByteTokenizer
from holmes_jax.runtime.data.prepare import load_tokenizer, wrap_ids
from holmes_jax.runtime.data.shards import list_shards
from holmes_jax.runtime.hf.convert import import_origin
from holmes_jax.runtime.model.decoder import GPT, init_model
from holmes_jax.runtime.rundir.checkpoint import find_step, read_params
from holmes_jax.runtime.rundir.paths import CHECKPOINTS_NAME, CONFIG_NAME

KEY = "--checkpoint"  # what the checkpoint path is called in messages
_TOKENIZER_HINT = "pass --tokenizer PATH (a local Hugging Face model directory or tokenizer.json)"


# --------------------------------------------------------------------------- checkpoint


def find_checkpoint(path: str) -> tuple[str, dict[str, Any], str | None]:
    """The step directory ``path`` names, its ``meta``, and the run's ``config.yaml``.

    Args:
      path: a run directory (holding ``checkpoints/`` and ``config.yaml``), a checkpoint
        directory, an import's directory, or one step directory.

    Returns:
      (step directory, its meta, the run directory's config.yaml or None).

    Raises:
      ConfigError: no such directory, or no checkpoint in it.
    """
    config = os.path.join(path, CONFIG_NAME)
    config = config if os.path.isfile(config) else None
    inner = os.path.join(path, CHECKPOINTS_NAME)
    if os.path.isdir(inner) and not os.path.isdir(os.path.join(path, "state")):
        step_dir, meta = find_step(inner, KEY)
    else:
        step_dir, meta = find_step(path, KEY)
    return step_dir, meta, config


def load_params(step_dir: str, meta: dict[str, Any], cfg: Config) -> Any:
    """The parameters of a step, fp32 on this process's first device, checked against the
    shapes of ``cfg.model`` (a differing key is named)."""
    m = cfg.model
    tokens = jnp.zeros((1, m.seq_len), jnp.int32)
    boxed = jax.eval_shape(
        lambda k: init_model(m).init({"params": k}, tokens)["params"], jax.random.key(0)
    )
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32, sharding=one), nn.unbox(boxed)
    )
    return read_params(
        step_dir,
        target,
        key=KEY,
        saved_model=meta["config"]["model"],
        running_model=cfg.to_dict()["model"],
    )


# --------------------------------------------------------------------------- tokenizer


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with :class:`ByteTokenizer`'s interface. A prompt starts
    as a document does in a token file: with the post-processor's prefix (Llama 3's
    ``<|begin_of_text|>``)."""

    def __init__(self, tok, path: str):
        self.tok = tok
        self.path = path
        self.prefix = wrap_ids(tok)[0]

    def encode(self, text: str) -> np.ndarray:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return np.asarray([*self.prefix, *ids], np.int64)

    def decode(self, ids: Any) -> str:
        ids = [int(i) for i in np.asarray(ids).ravel()]
        return self.tok.decode(ids, skip_special_tokens=False)


def text_tokenizer(cfg: Config, meta: dict[str, Any], path: str | None = None):
    """The tokenizer of a run's tokens (see the module docstring), or of ``path``.

    Raises:
      ConfigError: a token file whose tokenizer is unknown or not on this machine; an
        unreadable tokenizer.
    """
    if path is not None:
        return HFTokenizer(load_tokenizer(path), path)
    if cfg.data.source != "tokens":
        return ByteTokenizer()
    data = cfg.data.path
    try:
        named = next(
            (s.tokenizer for s in list_shards(data, cfg.data.token_dtype) if s.tokenizer), None
        )
    except ConfigError:  # the shards are not on this machine: the import may name it
        named = None
    if named is not None:
        if not os.path.exists(named):
            raise ConfigError(
                f"data.path={data}: its tokenizer {named} (named in its sidecars) is not on "
                f"this machine; {_TOKENIZER_HINT}"
            )
        return HFTokenizer(load_tokenizer(named), named)
    source = import_origin(meta).get("source")
    if source and os.path.isfile(os.path.join(source, "tokenizer.json")):
        return HFTokenizer(load_tokenizer(source), source)
    raise ConfigError(
        f"data.path={data}: no sidecar or index of its shards names the tokenizer of "
        f"these tokens and the checkpoint descends from no imported model; {_TOKENIZER_HINT}"
    )


def tokenizer_name(tokenizer) -> str:
    return f"tokenizer {tokenizer.path}" if isinstance(tokenizer, HFTokenizer) else "bytes"


# --------------------------------------------------------------------------- decoding


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How to draw tokens. ``check`` raises a one-line ConfigError naming the flag."""

    max_new_tokens: int = 200
    temperature: float = 0.8  # 0: greedy
    top_k: int = 200  # 0: the whole vocabulary
    seed: int = 0
    num_samples: int = 1

    def check(self) -> Sampling:
        rules = (
            ("--max-new-tokens", self.max_new_tokens, self.max_new_tokens >= 1, "must be >= 1"),
            (
                "--temperature",
                self.temperature,
                math.isfinite(self.temperature) and self.temperature >= 0,
                "must be a number >= 0 (0: greedy)",
            ),
            ("--top-k", self.top_k, self.top_k >= 0, "must be >= 0 (0: no limit)"),
            ("--seed", self.seed, 0 <= self.seed < 2**32, "must be in [0, 2**32)"),
            ("--num-samples", self.num_samples, self.num_samples >= 1, "must be >= 1"),
        )
        for flag, value, ok, rule in rules:
            if not ok:
                raise ConfigError(f"{flag}={value}: {rule}")
        return self


class Generator:
    """Decoding for one model: a jitted step that appends one token to each sample.

    Its step compiles once per number of samples; :func:`generator` keeps one per model.
    """

    def __init__(self, cfg: ModelConfig):
        # Inference: no remat, no dropout, XLA attention (fp32, where cuDNN cannot run).
        self.cfg = dataclasses.replace(cfg, remat="none", attention="xla", dropout=0.0)
        self.model = GPT(self.cfg, deterministic=True)
        self.step = jax.jit(self._step)

    def next_logits(self, params, window, n):
        """Logits ``[S, V]`` fp32 after the first ``n`` tokens of each row of ``window``
        ``[S, seq_len]`` int32 (1 <= n <= seq_len; what follows position n - 1 is ignored)."""

        def last(module: GPT, tokens):
            x = module.embed(tokens)  # [S, T, H]
            x, _ = module.blocks(x, None)  # [S, T, H]
            x = jax.lax.dynamic_slice_in_dim(x, n - 1, 1, axis=1)  # [S, 1, H]
            return module.head(x, module.embed)[:, 0]  # [S, V]

        return self.model.apply({"params": params}, window, method=last)

    def _step(self, params, window, n, key, i, temperature, top_k):
        """Draw token i of every sample and append it: ``(window, n, tokens [S])``."""
        t = self.cfg.seq_len
        logits = self.next_logits(params, window, n).astype(jnp.float32)  # [S, V]
        keys = jax.vmap(lambda s: jax.random.fold_in(jax.random.fold_in(key, i), s))(
            jnp.arange(window.shape[0])
        )
        tokens = jax.vmap(_choose, in_axes=(0, 0, None, None))(logits, keys, temperature, top_k)
        window = jnp.where(n == t, jnp.roll(window, -1, axis=1), window)  # full: slide by one
        at = jnp.minimum(n, t - 1)
        window = jax.lax.dynamic_update_slice_in_dim(window, tokens[:, None], at, axis=1)
        return window, jnp.minimum(n + 1, t), tokens

    def generate(self, params, prompt: np.ndarray, sampling: Sampling) -> np.ndarray:
        """``sampling.num_samples`` continuations of ``prompt`` (token ids, at least one;
        only its last ``seq_len`` are seen).

        Returns:
          int32 ``[num_samples, max_new_tokens]``: the new tokens alone.
        """
        sampling.check()
        prompt = np.asarray(prompt, np.int64).ravel()
        m = self.cfg
        if prompt.size == 0:
            raise ConfigError("--prompt='': encodes to no tokens; give at least one character")
        if prompt.max() >= m.vocab_size:
            raise ConfigError(
                f"--prompt: holds token id {int(prompt.max())}, the model's vocabulary is "
                f"model.vocab_size={m.vocab_size} (another tokenizer? {_TOKENIZER_HINT})"
            )
        prompt = prompt[-m.seq_len :]
        window = np.zeros((sampling.num_samples, m.seq_len), np.int32)  # [S, T]
        window[:, : prompt.size] = prompt
        window, n = jnp.asarray(window), jnp.int32(prompt.size)
        key = jax.random.key(sampling.seed)
        temperature, top_k = jnp.float32(sampling.temperature), jnp.int32(sampling.top_k)
        drawn = []
        for i in range(sampling.max_new_tokens):  # dispatched asynchronously, read once
            window, n, tokens = self.step(params, window, n, key, i, temperature, top_k)
            drawn.append(tokens)
        return np.stack(jax.device_get(drawn), axis=1)


@functools.lru_cache(maxsize=4)
def generator(cfg: ModelConfig) -> Generator:
    """The :class:`Generator` of a model, shared by every call in this process."""
    return Generator(cfg)


def _choose(logits, key, temperature, top_k):
    """One token from logits ``[V]``: greedy at temperature 0, else a draw from
    softmax(logits / temperature) over the ``top_k`` largest (0: all)."""
    v = logits.shape[-1]
    k = jnp.where((top_k > 0) & (top_k < v), top_k, v)
    kth = jnp.sort(logits)[v - k]  # the k-th largest: a traced k needs no recompile
    kept = jnp.where(logits >= kth, logits, -jnp.inf)
    drawn = jax.random.categorical(key, kept / jnp.where(temperature > 0, temperature, 1.0))
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits)).astype(jnp.int32)


# --------------------------------------------------------------------------- the command


def sample(
    checkpoint: str,
    prompt: str,
    sampling: Sampling,
    *,
    config: str | None = None,
    tokenizer: str | None = None,
) -> tuple[list[str], str]:
    """Continue ``prompt`` from a checkpoint (see the module docstring).

    Returns:
      (the continuations, without the prompt; one line saying what was loaded).

    Raises:
      ConfigError: a bad number, path, config or tokenizer; a model of another shape.
    """
    sampling.check()
    step_dir, meta, run_config = find_checkpoint(checkpoint)
    if config is not None or run_config is not None:
        cfg = load_config(config or run_config)
    else:
        cfg = config_from_dict(meta["config"], f"{step_dir}/meta")
    tok = text_tokenizer(cfg, meta, tokenizer)
    ids = tok.encode(prompt)
    params = load_params(step_dir, meta, cfg)
    new = generator(cfg.model).generate(params, ids, sampling)
    m = cfg.model
    line = (
        f"step {meta.get('step', 0)} of {step_dir}: {m.arch}, {m.spec.num_params / 1e6:.2f}M "
        f"params, {tokenizer_name(tok)}, fp32 on {jax.devices()[0].platform}"
    )
    return [tok.decode(row) for row in new], line
