"""The model's parts against naive references: attention, its kernel choice, remat policies."""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from holmes_jax.core.config import config_from_dict, load_config
from holmes_jax.core.errors import ConfigError
from holmes_jax.runtime.model import GPT, attention, attention_kernel
from tests.common import TINY_MODEL

TINY = [*TINY_MODEL, "model.seq_len=16", "model.attention=xla"]

# --------------------------------------------------------------------------- attention


def naive_attention(q, k, v):
    """Causal softmax attention, every score materialised. q, k, v [B, T, nh, hd]."""
    q, k, v = (jnp.swapaxes(a, 1, 2).astype(jnp.float32) for a in (q, k, v))  # [B, nh, T, hd]
    scores = q @ jnp.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])  # [B, nh, T, T]
    t = q.shape[2]
    scores = jnp.where(jnp.tril(jnp.ones((t, t), dtype=bool)), scores, -jnp.inf)
    weights = jnp.exp(scores - scores.max(axis=-1, keepdims=True))  # masked entries: exp(-inf)=0
    weights = weights / weights.sum(axis=-1, keepdims=True)
    return jnp.swapaxes(weights @ v, 1, 2)  # [B, T, nh, hd]


def test_xla_attention_equals_naive_reference():
    rng = np.random.RandomState(0)
    # Scale 2 makes the softmax peaked (scores ~ N(0, 4) before the 1/sqrt(hd)), not uniform.
    q, k, v, cotangent = (
        jnp.asarray(2 * rng.standard_normal((2, 16, 3, 8)), jnp.float32) for _ in range(4)
    )
    np.testing.assert_allclose(
        attention(q, k, v, "xla"), naive_attention(q, k, v), rtol=0, atol=1e-5
    )

    def grads(fn):
        return jax.grad(lambda *qkv: jnp.sum(fn(*qkv) * cotangent), argnums=(0, 1, 2))(q, k, v)

    got = grads(lambda *qkv: attention(*qkv, "xla"))
    want = grads(naive_attention)
    for name, a, b in zip("qkv", got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=f"d/d{name}")
    # Causal: the first query sees only the first key, so its output is the first value.
    np.testing.assert_allclose(attention(q, k, v, "xla")[:, 0], v[:, 0], rtol=0, atol=1e-6)


def test_attention_kernel_choice_on_cpu():
    for dtype in (jnp.float32, jnp.bfloat16):
        assert attention_kernel(load_config(None, TINY).model, dtype) == "xla"
        auto = load_config(None, TINY + ["model.attention=auto"]).model
        assert attention_kernel(auto, dtype) == "xla"
        cudnn = load_config(None, TINY + ["model.attention=cudnn"]).model
        with pytest.raises(ConfigError) as err:
            attention_kernel(cudnn, dtype)
        message = str(err.value)
        assert "\n" not in message and message.startswith("model.attention=cudnn: "), message
    assert load_config(None, []).model.attention == "auto"  # the default
    with pytest.raises(ConfigError, match="model.attention='flash'"):
        load_config(None, ["model.attention=flash"])


# --------------------------------------------------------------------------- remat


def test_remat_policies_agree_and_save_less():
    """The plain GPT on one device: none / full / selective give the same loss and gradients,
    and keep (as ``jax.vjp`` residuals) strictly less in that order."""
    cfg = load_config(None, TINY).model
    tokens = np.random.RandomState(0).randint(0, 256, (4, 17)).astype(np.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # [B, T] each
    params = nn.unbox(jax.jit(GPT(cfg).init)(jax.random.key(0), inputs)["params"])
    results = {}
    for remat in ("none", "full", "selective"):
        model = GPT(dataclasses.replace(cfg, remat=remat))

        def loss_fn(p, model=model):
            return model.apply({"params": p}, inputs, targets)

        loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
        # jax.vjp's backward function is a pytree whose leaves are the saved residuals.
        backward = jax.eval_shape(lambda p, f=loss_fn: jax.vjp(f, p)[1], params)
        saved = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(backward))
        results[remat] = float(loss), grads, saved
    loss, grads, saved = results["none"]
    for remat in ("full", "selective"):
        assert abs(results[remat][0] - loss) <= 1e-6, remat
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6),
            results[remat][1],
            grads,
        )
    assert results["full"][2] < results["selective"][2] < saved, {
        r: s for r, (_, _, s) in results.items()
    }


def test_remat_config_values(tmp_path):
    assert load_config(None, ["model.remat=true"]).model.remat == "full"
    assert load_config(None, ["model.remat=false"]).model.remat == "none"
    for policy in ("none", "full", "selective"):
        assert load_config(None, [f"model.remat={policy}"]).model.remat == policy
    assert load_config(None, []).model.remat == "none"  # the default
    path = tmp_path / "old.yaml"
    path.write_text("# an old config: the boolean switch\nmodel:\n  remat: true\n")
    cfg = load_config(path)
    assert cfg.model.remat == "full"
    assert config_from_dict(cfg.to_dict()).model.remat == "full"  # checkpoint metadata
    for bad in ("partial", "1", "[full]"):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"model.remat={bad}"])
        message = str(err.value)
        assert "model.remat" in message and "\n" not in message, message


@pytest.mark.parametrize("tied", [True, False])
def test_spec_counts_the_models_parameters(tied):
    """The one parameter count (core.spec.ModelSpec, also the planner's) equals the Flax
    model's, leaf by leaf: total parameters and the leaves the trainer reduces one by one."""
    over = [*TINY, "model.mlp_ratio=3", f"model.tied_embeddings={str(tied).lower()}"]
    cfg = load_config(None, over).model
    tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
    shapes = jax.eval_shape(GPT(cfg).init, jax.random.key(0), tokens)["params"]
    leaves = jax.tree.leaves(shapes)
    spec = cfg.spec
    assert sum(math.prod(x.shape) for x in leaves) == spec.num_params
    blocks = jax.tree.leaves(shapes["blocks"])
    assert sum(math.prod(x.shape) for x in blocks) == cfg.num_layers * spec.layer_params
    assert len(blocks) == spec.layer_leaves
    assert len(leaves) == spec.layer_leaves + spec.embedding_leaves + spec.head_leaves
