"""The decoder in Flax linen, built from three parts a pipeline can cut apart.

    tokens [B, T] --Embed--> x [B, T, H] --Block x L--> x --Head--> loss (or logits)

Two architectures (``model.arch``) share the parts, the logical axis names and everything
downstream. ``gpt2``: learned positions, pre-LayerNorm attention with fused QKV and biases,
a GELU MLP ``proj(gelu(fc(x)))``, head tied by default. ``llama``: rotary positions,
pre-RMSNorm grouped-query attention, a SwiGLU MLP ``down(silu(gate(x)) * up(x))``, no
biases, head untied by default. Parameters (every ``blocks`` leaf stacked ``[L, ...]``)::

    gpt2   embed {wte [V,H], wpe [T,H]}
           blocks {ln1 {scale,bias}, qkv_kernel [H,3,nh,hd], qkv_bias [3,nh,hd],
                   out_kernel [nh,hd,H], out_bias [H], ln2 {scale,bias},
                   fc_kernel [H,F], fc_bias [F], proj_kernel [F,H], proj_bias [H]}
           head {ln_f {scale,bias}, lm_kernel [H,V] (untied only)}
    llama  embed {wte [V,H]}
           blocks {ln1 {scale}, q_kernel [H,nh,hd], k_kernel [H,nkv,hd], v_kernel [H,nkv,hd],
                   out_kernel [nh,hd,H], ln2 {scale}, gate_kernel [H,F], up_kernel [H,F],
                   down_kernel [F,H]}
           head {ln_f {scale}, lm_kernel [H,V] (untied only)}

``GPT`` stacks the blocks with ``nn.scan``; the pipeline re-cuts them into stages and
applies one layer with :func:`block_apply`. :data:`LOGICAL_RULES`, the one table from
logical axis names to mesh axes, puts heads, key-value heads, MLP width and vocabulary on
``tensor`` and the batch on ``data``. Norms, rotary embedding and attention kernels live
in :mod:`holmes_jax.runtime.model.layers`; shape, parameter and FLOP counts in
:class:`holmes_jax.core.spec.ModelSpec`.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from holmes_jax.core.axes import BATCH_AXES, TENSOR
from holmes_jax.core.config import ModelConfig
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import REMAT_CHOICES
from holmes_jax.runtime.model.layers import (
    LayerNorm,
    RMSNorm,
    Rope,
    attention,
    attention_kernel,
    norm,
    param,
    rope,
)

__all__ = [
    "GPT",
    "LOGICAL_RULES",
    "Block",
    "Embed",
    "Head",
    "LayerNorm",
    "RMSNorm",
    "attention",
    "attention_kernel",
    "block_apply",
    "cross_entropy",
    "init_model",
    "remat_block",
    "remat_policy",
]

# Logical axis name -> mesh axis. The only place parameters meet the mesh.
LOGICAL_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", BATCH_AXES),
    ("vocab", TENSOR),
    ("heads", TENSOR),
    ("kv_heads", TENSOR),
    ("mlp", TENSOR),
    ("embed", None),
    ("head_dim", None),
    ("qkv", None),
    ("seq", None),
    ("layers", None),
)

_INIT_STD = 0.02


# --------------------------------------------------------------------------- remat

# What ``model.remat=selective`` keeps per layer (named with ``checkpoint_name`` in Block):
# the matmul outputs and the attention output; norms, GELU / SiLU, rotary and softmax are
# recomputed. gpt2 names qkv, attn_out, attn_proj, mlp_fc, mlp_proj; llama names q, k, v
# (before the rotary embedding), attn_out, attn_proj, mlp_gate, mlp_up, mlp_down. A layer's
# last output (mlp_proj, mlp_down) is named but its backward never needs it.
SELECTIVE_SAVED = (
    "qkv",
    "q",
    "k",
    "v",
    "attn_out",
    "attn_proj",
    "mlp_fc",
    "mlp_gate",
    "mlp_up",
    "mlp_proj",
    "mlp_down",
)


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


# --------------------------------------------------------------------------- parts


class Embed(nn.Module):
    """Token embedding (+ learned positions for gpt2). ``attend`` is the tied LM head."""

    cfg: ModelConfig
    deterministic: bool = True

    def setup(self):
        c = self.cfg
        normal = nn.initializers.normal(_INIT_STD)
        # [padded_vocab, H]: rows past vocab_size exist only to split evenly over tensor
        self.wte = param(self, "wte", normal, (c.padded_vocab, c.hidden_size), ("vocab", "embed"))
        if c.arch == "gpt2":
            self.wpe = param(self, "wpe", normal, (c.seq_len, c.hidden_size), ("seq", "embed"))
        self.drop = nn.Dropout(c.dropout)

    def __call__(self, tokens):  # tokens [B, T] int32
        x = jnp.take(self.wte, tokens, axis=0)  # [B, T, H]
        if self.cfg.arch == "gpt2":
            x = x + self.wpe[: tokens.shape[1]]
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
        drop = nn.Dropout(c.dropout)
        llama = c.arch == "llama"
        y = (_llama_attention if llama else _gpt2_attention)(self, norm(c, "ln1")(x))
        x = x + drop(y, deterministic=self.deterministic)
        x = nn.with_logical_constraint(x, ("batch", "seq", "embed"))
        m = (_swiglu_mlp if llama else _gelu_mlp)(self, norm(c, "ln2")(x))
        x = x + drop(m, deterministic=self.deterministic)
        return nn.with_logical_constraint(x, ("batch", "seq", "embed")), None


# The halves of a Block, as functions of the Block (they create its parameters, in the
# order that keeps a seed's initial values unchanged). a, m: the normalised input [B, T, H].


def _normal(c: ModelConfig, residual: bool = False):
    # GPT-2: residual projections scaled by 1/sqrt(2L) so the residual stream stays O(1).
    return nn.initializers.normal(_INIT_STD / (math.sqrt(2 * c.num_layers) if residual else 1))


def _out_projection(block: nn.Module, y, bias: bool):
    """[B, T, nh/tensor, hd] -> [B, T, H] (+ bias), saved as ``attn_proj``."""
    c = block.cfg
    w_o = param(
        block, "out_kernel", _normal(c, True), (c.num_heads, c.head_dim, c.hidden_size),
        ("heads", "head_dim", "embed"),
    )  # fmt: skip
    y = jnp.einsum("btnd,ndh->bth", y, w_o)
    if bias:
        y = y + param(block, "out_bias", nn.initializers.zeros, (c.hidden_size,), ("embed",))
    return checkpoint_name(y, "attn_proj")


def _gpt2_attention(block: nn.Module, a):
    """Fused QKV with biases: [B, T, H] -> q, k, v [B, T, nh/tensor, hd] -> [B, T, H]."""
    c = block.cfg
    nh, hd, h = c.num_heads, c.head_dim, c.hidden_size
    w_qkv = param(
        block, "qkv_kernel", _normal(c), (h, 3, nh, hd), ("embed", "qkv", "heads", "head_dim")
    )
    b_qkv = param(
        block, "qkv_bias", nn.initializers.zeros, (3, nh, hd), ("qkv", "heads", "head_dim")
    )
    qkv = jnp.einsum("bth,hcnd->cbtnd", a, w_qkv) + b_qkv[:, None, None]
    qkv = checkpoint_name(qkv, "qkv")  # [3, B, T, nh, hd]: saved by `selective`
    y = attention(qkv[0], qkv[1], qkv[2], attention_kernel(c, a.dtype))  # [B, T, nh, hd]
    return _out_projection(block, checkpoint_name(y, "attn_out"), bias=True)


def _llama_attention(block: nn.Module, a):
    """q [B, T, nh/tensor, hd], k, v [B, T, nkv/tensor, hd], rotary q and k, no biases."""
    c = block.cfg
    nh, nkv, hd, h = c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size
    w_q = param(block, "q_kernel", _normal(c), (h, nh, hd), ("embed", "heads", "head_dim"))
    w_k = param(block, "k_kernel", _normal(c), (h, nkv, hd), ("embed", "kv_heads", "head_dim"))
    w_v = param(block, "v_kernel", _normal(c), (h, nkv, hd), ("embed", "kv_heads", "head_dim"))
    q = checkpoint_name(jnp.einsum("bth,hnd->btnd", a, w_q), "q")
    k = checkpoint_name(jnp.einsum("bth,hnd->btnd", a, w_k), "k")
    v = checkpoint_name(jnp.einsum("bth,hnd->btnd", a, w_v), "v")
    q, k = rope(q, Rope.of(c)), rope(k, Rope.of(c))
    y = attention(q, k, v, attention_kernel(c, a.dtype))  # [B, T, nh, hd]
    return _out_projection(block, checkpoint_name(y, "attn_out"), bias=False)


def _gelu_mlp(block: nn.Module, m):
    """[B, T, H] -> [B, T, F/tensor] -> [B, T, H], tanh-GELU, biases."""
    c = block.cfg
    h, f = c.hidden_size, c.mlp_size
    zeros = nn.initializers.zeros
    w_fc = param(block, "fc_kernel", _normal(c), (h, f), ("embed", "mlp"))
    b_fc = param(block, "fc_bias", zeros, (f,), ("mlp",))
    m = jax.nn.gelu(checkpoint_name(m @ w_fc + b_fc, "mlp_fc"), approximate=True)
    w_pr = param(block, "proj_kernel", _normal(c, True), (f, h), ("mlp", "embed"))
    b_pr = param(block, "proj_bias", zeros, (h,), ("embed",))
    return checkpoint_name(m @ w_pr + b_pr, "mlp_proj")


def _swiglu_mlp(block: nn.Module, m):
    """down(silu(gate(m)) * up(m)): [B, T, H] -> 2 x [B, T, F/tensor] -> [B, T, H]."""
    c = block.cfg
    h, f = c.hidden_size, c.mlp_size
    w_gate = param(block, "gate_kernel", _normal(c), (h, f), ("embed", "mlp"))
    w_up = param(block, "up_kernel", _normal(c), (h, f), ("embed", "mlp"))
    w_down = param(block, "down_kernel", _normal(c, True), (f, h), ("mlp", "embed"))
    gate = checkpoint_name(m @ w_gate, "mlp_gate")
    up = checkpoint_name(m @ w_up, "mlp_up")
    return checkpoint_name((jax.nn.silu(gate) * up) @ w_down, "mlp_down")


class Head(nn.Module):
    """Final norm, LM head and mean token cross-entropy."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, embed: Embed, targets=None):  # x [B, T, H], targets [B, T]
        c = self.cfg
        x = norm(c, "ln_f")(x)
        if c.tied_embeddings:
            logits = embed.attend(x)
        else:
            w = param(
                self,
                "lm_kernel",
                nn.initializers.normal(_INIT_STD),
                (c.hidden_size, c.padded_vocab),
                ("embed", "vocab"),
            )
            logits = x @ w
        logits = nn.with_logical_constraint(logits, ("batch", "seq", "vocab"))  # [B, T, Vp]
        if c.padded_vocab != c.vocab_size:  # padding rows: no probability, no gradient
            real = jnp.arange(c.padded_vocab) < c.vocab_size
            logits = jnp.where(real, logits, jnp.finfo(logits.dtype).min)
        if targets is None:
            return logits[..., : c.vocab_size]  # [B, T, V]
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


def init_model(cfg: ModelConfig) -> GPT:
    """The GPT to ``init`` parameters with. Init traces in fp32, where a forced cuDNN
    kernel cannot run, and the parameters do not depend on the attention kernel."""
    return GPT(dataclasses.replace(cfg, attention="xla"))


def block_apply(cfg: ModelConfig, layer_params, x, *, deterministic=True, rng=None):
    """Apply one transformer layer given its (unstacked) parameters. x [B, T, H]."""
    block = remat_block(cfg)
    rngs = {"dropout": rng} if rng is not None else None
    y, _ = block(cfg, deterministic).apply({"params": layer_params}, x, rngs=rngs)
    return y
