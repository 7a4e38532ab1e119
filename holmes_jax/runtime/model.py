"""GPT-2 shaped decoder in Flax linen, built from three parts a pipeline can cut apart.

    tokens [B, T] --Embed--> x [B, T, H] --Block x L--> x --Head--> loss (or logits)

- ``Embed``: token embedding + learned positions (+ dropout).
- ``Block``: pre-LayerNorm causal self-attention and GELU MLP, each with a residual.
- ``Head``: final LayerNorm and the LM head (tied to the token embedding by default).

``GPT`` stacks the L blocks along a leading ``layers`` axis with ``nn.scan``, so its
parameter tree is ``{'embed': ..., 'blocks': <every leaf [L, ...]>, 'head': ...}``; the
pipeline re-cuts ``blocks`` into stages and applies one layer with :func:`block_apply`.

Every parameter carries logical axis names; :data:`LOGICAL_RULES`, the one table that maps
them to mesh axes, puts heads / MLP width / vocabulary on ``tensor`` (Megatron-style
tensor parallelism through GSPMD) and the batch on ``data``.

The model's shape, parameter and FLOP counts live in one place,
:class:`holmes_jax.core.spec.ModelSpec` (``cfg.spec``), shared with the planner.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from holmes_jax.core.axes import BATCH_AXES, TENSOR
from holmes_jax.core.config import ModelConfig
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import REMAT_CHOICES

# Logical axis name -> mesh axis. The only place parameters meet the mesh.
LOGICAL_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", BATCH_AXES),
    ("vocab", TENSOR),
    ("heads", TENSOR),
    ("mlp", TENSOR),
    ("embed", None),
    ("head_dim", None),
    ("qkv", None),
    ("seq", None),
    ("layers", None),
)

_INIT_STD = 0.02


def _param(module: nn.Module, name: str, init, shape, names):
    return module.param(name, nn.with_logical_partitioning(init, names), shape, jnp.float32)


# --------------------------------------------------------------------------- attention


def attention_kernel(cfg: ModelConfig, dtype) -> str:
    """The attention implementation a run uses: ``'xla'`` or ``'cudnn'``.

    ``auto`` takes cuDNN's fused kernel on a CUDA device when it can run (bf16/fp16,
    head_dim a multiple of 8 up to 128), else XLA.

    Raises:
      ConfigError: ``model.attention=cudnn`` where cuDNN cannot run.
    """
    if cfg.attention == "xla":
        return "xla"
    why = _cudnn_unavailable(cfg, dtype)
    if cfg.attention == "cudnn" and why:
        raise ConfigError(f"model.attention=cudnn: {why} (use auto or xla)")
    return "xla" if why else "cudnn"


def _cudnn_unavailable(cfg: ModelConfig, dtype) -> str | None:
    """Why cuDNN attention cannot run here, or None."""
    devices = jax.devices()
    if devices[0].platform != "gpu" or "cuda" not in devices[0].client.platform_version.lower():
        return f"needs a CUDA GPU, this run has {devices[0].platform} devices"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"needs bf16 or fp16 compute, this run computes in {jnp.dtype(dtype).name}"
    if cfg.head_dim % 8 or cfg.head_dim > 128:
        return f"needs head_dim a multiple of 8 and <= 128, got {cfg.head_dim}"
    return None


def attention(q, k, v, kernel: str):
    """Causal softmax attention. q, k, v [B, T, nh, hd] -> [B, T, nh, hd].

    Never keeps ``[B, nh, T, T]`` scores for the backward: cuDNN's fused kernel stores only
    its output and the softmax statistics; the XLA path is wrapped in a checkpoint that
    keeps q, k, v and recomputes scores and softmax (in fp32) in the backward.
    """
    if kernel == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return _xla_attention(q, k, v)


@jax.checkpoint
def _xla_attention(q, k, v):
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = jnp.einsum("btnd,bsnd->bnts", q, k).astype(jnp.float32) * scale  # [B, nh, T, T]
    t = q.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # softmax in fp32
    return jnp.einsum("bnts,bsnd->btnd", probs, v)


# --------------------------------------------------------------------------- remat

# What ``model.remat=selective`` keeps per layer (named with ``checkpoint_name`` in Block):
# the four matmul outputs and the attention output. Norms, GELU and softmax are recomputed.
SELECTIVE_SAVED = ("qkv", "attn_out", "attn_proj", "mlp_fc", "mlp_proj")


def remat_policy(name: str):
    """The ``jax.checkpoint`` policy of a ``model.remat`` value (None: no checkpoint)."""
    if name == "none":
        return None
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    if name == "selective":
        return jax.checkpoint_policies.save_only_these_names(*SELECTIVE_SAVED)
    if name == "auto":
        raise ConfigError(
            "model.remat='auto': the planner resolves it before the model is built "
            "(holmes_jax.planner.plans.resolve_auto; the trainer calls it)"
        )
    raise ConfigError(f"model.remat='{name}': must be one of {', '.join(REMAT_CHOICES)}")


def remat_block(cfg: ModelConfig):
    """``Block``, wrapped in ``nn.remat`` with the config's policy (or bare for none)."""
    policy = remat_policy(cfg.remat)
    if policy is None:
        return Block
    return nn.remat(Block, prevent_cse=False, policy=policy)


class LayerNorm(nn.Module):
    """LayerNorm over the hidden axis with logical names on scale and bias."""

    eps: float = 1e-5

    @nn.compact
    def __call__(self, x):  # x [B, T, H]
        h = x.shape[-1]
        scale = _param(self, "scale", nn.initializers.ones, (h,), ("embed",))
        bias = _param(self, "bias", nn.initializers.zeros, (h,), ("embed",))
        x32 = x.astype(jnp.float32)  # statistics in fp32 even for bf16 activations
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


class Embed(nn.Module):
    """Token embedding + learned positions. ``attend`` is the tied LM head."""

    cfg: ModelConfig
    deterministic: bool = True

    def setup(self):
        c = self.cfg
        normal = nn.initializers.normal(_INIT_STD)
        self.wte = _param(self, "wte", normal, (c.vocab_size, c.hidden_size), ("vocab", "embed"))
        self.wpe = _param(self, "wpe", normal, (c.seq_len, c.hidden_size), ("seq", "embed"))
        self.drop = nn.Dropout(c.dropout)

    def __call__(self, tokens):  # tokens [B, T] int32
        t = tokens.shape[1]
        x = jnp.take(self.wte, tokens, axis=0) + self.wpe[:t]  # [B, T, H]
        x = nn.with_logical_constraint(x, ("batch", "seq", "embed"))
        return self.drop(x, deterministic=self.deterministic)

    def attend(self, x):  # x [B, T, H] -> logits [B, T, V]
        return jnp.einsum("bth,vh->btv", x, self.wte)


class Block(nn.Module):
    """One transformer layer. Returns ``(x, None)`` so ``nn.scan`` can stack it."""

    cfg: ModelConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x, _=None):  # x [B, T, H]
        c = self.cfg
        nh, hd, h, f = c.num_heads, c.head_dim, c.hidden_size, c.mlp_size
        normal = nn.initializers.normal(_INIT_STD)
        # GPT-2: residual projections scaled by 1/sqrt(2L) so the residual stream stays O(1).
        resid = nn.initializers.normal(_INIT_STD / math.sqrt(2 * c.num_layers))
        zeros = nn.initializers.zeros
        drop = nn.Dropout(c.dropout)

        # --- attention: [B, T, H] -> q, k, v [B, T, nh/tensor, hd]
        a = LayerNorm(name="ln1")(x)
        w_qkv = _param(
            self, "qkv_kernel", normal, (h, 3, nh, hd), ("embed", "qkv", "heads", "head_dim")
        )
        b_qkv = _param(self, "qkv_bias", zeros, (3, nh, hd), ("qkv", "heads", "head_dim"))
        qkv = jnp.einsum("bth,hcnd->cbtnd", a, w_qkv) + b_qkv[:, None, None]
        qkv = checkpoint_name(qkv, "qkv")  # [3, B, T, nh, hd]: saved by `selective`
        q, k, v = qkv[0], qkv[1], qkv[2]
        y = attention(q, k, v, attention_kernel(c, q.dtype))  # [B, T, nh, hd]
        y = checkpoint_name(y, "attn_out")
        w_o = _param(self, "out_kernel", resid, (nh, hd, h), ("heads", "head_dim", "embed"))
        b_o = _param(self, "out_bias", zeros, (h,), ("embed",))
        y = checkpoint_name(jnp.einsum("btnd,ndh->bth", y, w_o) + b_o, "attn_proj")
        x = x + drop(y, deterministic=self.deterministic)
        x = nn.with_logical_constraint(x, ("batch", "seq", "embed"))

        # --- MLP: [B, T, H] -> [B, T, F/tensor] -> [B, T, H]
        m = LayerNorm(name="ln2")(x)
        w_fc = _param(self, "fc_kernel", normal, (h, f), ("embed", "mlp"))
        b_fc = _param(self, "fc_bias", zeros, (f,), ("mlp",))
        m = jax.nn.gelu(checkpoint_name(m @ w_fc + b_fc, "mlp_fc"), approximate=True)
        w_pr = _param(self, "proj_kernel", resid, (f, h), ("mlp", "embed"))
        b_pr = _param(self, "proj_bias", zeros, (h,), ("embed",))
        m = checkpoint_name(m @ w_pr + b_pr, "mlp_proj")
        x = x + drop(m, deterministic=self.deterministic)
        return nn.with_logical_constraint(x, ("batch", "seq", "embed")), None


class Head(nn.Module):
    """Final LayerNorm, LM head and mean token cross-entropy."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, embed: Embed, targets=None):  # x [B, T, H], targets [B, T]
        c = self.cfg
        x = LayerNorm(name="ln_f")(x)
        if c.tied_embeddings:
            logits = embed.attend(x)
        else:
            w = _param(
                self,
                "lm_kernel",
                nn.initializers.normal(_INIT_STD),
                (c.hidden_size, c.vocab_size),
                ("embed", "vocab"),
            )
            logits = x @ w
        logits = nn.with_logical_constraint(logits, ("batch", "seq", "vocab"))  # [B, T, V]
        if targets is None:
            return logits
        return cross_entropy(logits, targets)


def cross_entropy(logits, targets):
    """Mean token cross-entropy (in fp32). logits [B, T, V] float, targets [B, T] int."""
    logits = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - picked)


class GPT(nn.Module):
    """The whole model: ``GPT(cfg).apply(vars, tokens, targets)`` -> mean loss."""

    cfg: ModelConfig
    deterministic: bool = True

    def setup(self):
        block = remat_block(self.cfg)
        self.embed = Embed(self.cfg, self.deterministic)
        self.blocks = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            length=self.cfg.num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(self.cfg, self.deterministic)
        self.head = Head(self.cfg)

    def __call__(self, tokens, targets=None):  # tokens, targets [B, T]
        x = self.embed(tokens)
        x, _ = self.blocks(x, None)
        return self.head(x, self.embed, targets)

    # The three parts on their own, for the pipeline (params subsets suffice).
    def embed_tokens(self, tokens):
        return self.embed(tokens)

    def head_loss(self, x, targets):
        return self.head(x, self.embed, targets)


def block_apply(cfg: ModelConfig, layer_params, x, *, deterministic=True, rng=None):
    """Apply one transformer layer given its (unstacked) parameters. x [B, T, H]."""
    block = remat_block(cfg)
    rngs = {"dropout": rng} if rng is not None else None
    y, _ = block(cfg, deterministic).apply({"params": layer_params}, x, rngs=rngs)
    return y
