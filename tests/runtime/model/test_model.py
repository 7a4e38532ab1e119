"""The model's parts against naive references: attention (grouped too), rotary positions,
the llama layer, the kernel choice, remat policies, the parameter counts of both archs."""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from holmes_jax.core.config import config_from_dict, load_config
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import Degrees
from holmes_jax.runtime.engine.mesh import build_mesh
from holmes_jax.runtime.model.decoder import GPT, attention, attention_kernel, init_model
from holmes_jax.runtime.model.layers import Rope, inv_freq, rope
from holmes_jax.runtime.program import Program
from tests.common import TINY_MODEL

TINY = [*TINY_MODEL, "model.seq_len=16", "model.attention=xla"]
# Llama: 2 key/value heads for 4 query heads, an MLP width that is no multiple of hidden.
LLAMA = ["model.arch=llama", "model.num_kv_heads=2", "model.mlp_size=48"]

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


def test_grouped_attention_equals_repeated_heads():
    """nkv < nh: query head j attends with key/value head j // (nh/nkv), as if k and v had
    been repeated (Hugging Face's repeat_kv), in value and gradient."""
    rng = np.random.RandomState(1)
    q, cotangent = (jnp.asarray(rng.standard_normal((2, 16, 6, 8)), jnp.float32) for _ in "qc")
    k, v = (jnp.asarray(rng.standard_normal((2, 16, 2, 8)), jnp.float32) for _ in "kv")

    def repeated(q, k, v):
        return naive_attention(q, jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2))

    np.testing.assert_allclose(attention(q, k, v, "xla"), repeated(q, k, v), rtol=0, atol=1e-5)

    def grads(fn):
        return jax.grad(lambda *qkv: jnp.sum(fn(*qkv) * cotangent), argnums=(0, 1, 2))(q, k, v)

    got, want = grads(lambda *qkv: attention(*qkv, "xla")), grads(repeated)
    for name, a, b in zip("qkv", got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=f"d/d{name}")


def naive_rope(x, base):
    """Rotary embedding written as 2-D rotations of the pairs (i, i + hd/2), position p by
    angle p·base^(-2i/hd) (Hugging Face's rotate_half layout). x [B, T, n, hd]."""
    _, t, _, hd = x.shape
    half = hd // 2
    angle = np.arange(t)[:, None] * base ** (-2.0 * np.arange(half) / hd)  # [T, hd/2]
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]  # [T, 1, hd/2]
    lo, hi = x[..., :half], x[..., half:]
    return jnp.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1)


def test_rope_equals_pairwise_rotation_and_its_backward_is_the_inverse():
    rng = np.random.RandomState(2)
    x, cotangent = (jnp.asarray(rng.standard_normal((2, 16, 3, 8)), jnp.float32) for _ in "xc")
    for base in (10000.0, 500000.0):
        np.testing.assert_allclose(rope(x, Rope(base)), naive_rope(x, base), rtol=0, atol=1e-5)
        got = jax.grad(lambda a, b=base: jnp.sum(rope(a, Rope(b)) * cotangent))(x)
        want = jax.grad(lambda a, b=base: jnp.sum(naive_rope(a, b) * cotangent))(x)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # Position 0 is not rotated; the rotation keeps every pair's norm.
    np.testing.assert_allclose(rope(x, Rope())[:, 0], x[:, 0], rtol=0, atol=1e-6)
    norms = lambda a: jnp.sqrt(a[..., :4] ** 2 + a[..., 4:] ** 2)  # noqa: E731
    np.testing.assert_allclose(norms(rope(x, Rope())), norms(x), rtol=0, atol=1e-5)


def test_llama3_rope_scaling_frequencies():
    """Llama 3.1 / 3.2 ``rope_type: llama3`` frequencies: the published rule, written out
    per frequency (and ``transformers``' own function where it is installed)."""
    r = Rope(500000.0, 32.0, 1.0, 4.0, 8192)
    plain = 1.0 / 500000.0 ** (np.arange(0, 64, 2) / 64)
    want = []
    for f in plain:
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4.0:
            want.append(f)  # high frequencies kept
        elif wavelen > 8192 / 1.0:
            want.append(f / 32.0)  # low frequencies stretched
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            want.append((1 - smooth) * f / 32.0 + smooth * f)
    np.testing.assert_allclose(inv_freq(64, r), want, rtol=1e-5)
    np.testing.assert_allclose(inv_freq(64, Rope(500000.0)), plain, rtol=1e-5)
    try:
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    except ImportError:
        return
    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0}
    params |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    params["original_max_position_embeddings"] = 8192
    hf = LlamaConfig(hidden_size=2048, num_attention_heads=32, rope_parameters=params)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    np.testing.assert_allclose(inv_freq(64, r), theirs.numpy(), rtol=1e-6)


def naive_llama_loss(cfg, p, inputs, targets):
    """The llama decoder written out from the published formulas, one layer at a time:
    RMSNorm, rotary q and k, grouped attention by repeated k / v, SwiGLU, untied head."""
    eps, g = cfg.norm_eps, cfg.num_heads // cfg.num_kv_heads

    def rms(x, scale):
        return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale

    x = p["embed"]["wte"][inputs]  # [B, T, H]
    for i in range(cfg.num_layers):
        w = jax.tree.map(lambda a, i=i: a[i], p["blocks"])
        a = rms(x, w["ln1"]["scale"])
        q = naive_rope(jnp.einsum("bth,hnd->btnd", a, w["q_kernel"]), cfg.rope_base)
        k = naive_rope(jnp.einsum("bth,hnd->btnd", a, w["k_kernel"]), cfg.rope_base)
        v = jnp.einsum("bth,hnd->btnd", a, w["v_kernel"])
        y = naive_attention(q, jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2))
        x = x + jnp.einsum("btnd,ndh->bth", y, w["out_kernel"])
        m = rms(x, w["ln2"]["scale"])
        x = x + (jax.nn.silu(m @ w["gate_kernel"]) * (m @ w["up_kernel"])) @ w["down_kernel"]
    x = rms(x, p["head"]["ln_f"]["scale"])
    logits = x @ p["head"]["lm_kernel"] if "lm_kernel" in p["head"] else x @ p["embed"]["wte"].T
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def test_llama_loss_and_grads_equal_the_written_out_model():
    cfg = load_config(None, [*TINY, *LLAMA, "model.rope_base=500.0"]).model
    assert not cfg.tied_embeddings  # llama's default
    tokens = np.random.RandomState(3).randint(0, 256, (3, 17)).astype(np.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    params = nn.unbox(jax.jit(GPT(cfg).init)(jax.random.key(0), inputs)["params"])
    assert set(params["embed"]) == {"wte"}
    assert set(params["blocks"]) == {
        "ln1", "q_kernel", "k_kernel", "v_kernel", "out_kernel",
        "ln2", "gate_kernel", "up_kernel", "down_kernel",
    }  # fmt: skip
    assert params["blocks"]["k_kernel"].shape == (2, 32, 2, 8)
    assert set(params["head"]) == {"ln_f", "lm_kernel"}
    # Norm scales away from 1, so that a scale that is not applied would show.
    params = jax.tree.map(lambda a: a + 0.1 * jnp.sin(jnp.arange(a.size).reshape(a.shape)), params)

    def loss(p):
        return GPT(cfg).apply({"params": p}, inputs, targets)

    got_loss, got = jax.jit(jax.value_and_grad(loss))(params)
    naive = lambda p: naive_llama_loss(cfg, p, inputs, targets)  # noqa: E731
    want_loss, want = jax.value_and_grad(naive)(params)
    assert abs(float(got_loss) - float(want_loss)) <= 1e-5
    assert np.isfinite(float(got_loss)) and abs(float(got_loss) - math.log(256)) < 1.0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), got, want)


def test_llama_tensor_parallel_equals_one_device(make_program):
    """GQA under tensor 2 (each rank: 2 query heads, 1 key/value head, half the MLP and
    vocabulary) gives the one-device loss and gradients in fp32."""
    batch = np.random.RandomState(4).randint(0, 256, (4, 17)).astype(np.int32)
    results, params = [], None
    for t in (1, 2):
        over = [*TINY, *LLAMA, "train.global_batch_size=4", f"parallel.tensor={t}"]
        prog = make_program(load_config(None, over), Degrees(1, 1, t))
        if params is None:
            params = jax.device_get(prog.init(0).params)
        spec = prog.shardings.params["blocks"]["k_kernel"].spec  # [L, H, nkv, hd]
        assert spec[2] == "tensor", spec
        loss, grads = prog.loss_and_grads(
            jax.device_put(params, prog.shardings.params),
            jax.device_put(batch, prog.shardings.batch),
        )
        results.append((float(loss), jax.device_get(grads)))
    (ref_loss, ref_grads), (loss, grads) = results
    assert abs(loss - ref_loss) <= 1e-5
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), grads, ref_grads)


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


def test_a_forced_cudnn_kernel_initialises_and_refuses_only_where_it_computes():
    """Init traces in fp32, where cuDNN cannot run; the parameters do not depend on the
    kernel, so only the step that computes with it refuses (here: no CUDA device)."""
    cfg = load_config(None, [*TINY[:-1], "model.attention=cudnn", "train.precision=bf16"])
    tokens = jnp.zeros((1, cfg.model.seq_len), jnp.int32)
    forced = init_model(cfg.model).init(jax.random.key(0), tokens)["params"]
    plain = GPT(load_config(None, TINY).model).init(jax.random.key(0), tokens)["params"]
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), forced, plain))
    with pytest.raises(ConfigError, match="model.attention=cudnn: needs a CUDA GPU"):
        GPT(cfg.model).apply({"params": forced}, tokens, tokens)
    program = Program(cfg, build_mesh(Degrees(1, 1, 1)))  # builds its state abstractly
    assert program.abstract_state.params is not None


# --------------------------------------------------------------------------- remat


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_remat_policies_agree_and_save_less(arch):
    """The plain model on one device: none / full / selective give the same loss and
    gradients, and keep (as ``jax.vjp`` residuals) strictly less in that order."""
    cfg = load_config(None, TINY + (LLAMA if arch == "llama" else [])).model
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


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_padded_vocabulary_changes_nothing_but_the_shapes(arch):
    """With vocab 250 padded to 256 the loss, its gradients and the logits equal the
    unpadded model's with the same parameters (the padded rows start random, not zero)."""
    base = load_config(None, [*TINY, f"model.arch={arch}"]).model
    plain = dataclasses.replace(base, vocab_size=250)
    padded = dataclasses.replace(plain, vocab_multiple=64)
    tokens = jax.random.randint(jax.random.key(1), (2, plain.seq_len), 0, 250)
    params = nn.unbox(GPT(padded).init(jax.random.key(0), tokens)["params"])
    assert params["embed"]["wte"].shape == (256, plain.hidden_size)
    same = {**params, "embed": {**params["embed"], "wte": params["embed"]["wte"][:250]}}
    if "lm_kernel" in params["head"]:  # llama's untied head
        same["head"] = {**params["head"], "lm_kernel": params["head"]["lm_kernel"][:, :250]}

    def loss(model, p):
        return GPT(model).apply({"params": p}, tokens[:, :-1], tokens[:, 1:])

    l1, g1 = jax.value_and_grad(lambda p: loss(plain, p))(same)
    l2, g2 = jax.value_and_grad(lambda p: loss(padded, p))(params)
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    wte = g2["embed"]["wte"]
    np.testing.assert_allclose(wte[:250], g1["embed"]["wte"], rtol=1e-5, atol=1e-7)
    assert not np.any(wte[250:])  # no gradient reaches the padding
    logits = GPT(padded).apply({"params": params}, tokens)
    assert logits.shape[-1] == 250
    np.testing.assert_allclose(logits, GPT(plain).apply({"params": same}, tokens), atol=1e-5)


@pytest.mark.parametrize(
    "arch", ["gpt2", "llama", "model.arch=llama model.num_kv_heads=1 model.mlp_size=40"]
)
@pytest.mark.parametrize("tied", [True, False])
def test_spec_counts_the_models_parameters(tied, arch):
    """The one parameter count (core.spec.ModelSpec, also the planner's) equals the Flax
    model's, leaf by leaf: total parameters and the leaves the trainer reduces one by one,
    for gpt2, llama and llama with grouped-query attention (one key/value head)."""
    arch = arch.split() if " " in arch else [f"model.arch={arch}"]
    over = [*TINY, *arch, "model.mlp_ratio=3", f"model.tied_embeddings={str(tied).lower()}"]
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

    def sizes(tree, per=1):  # the leaves' sizes, in any order (the planner prices each)
        return sorted(math.prod(x.shape) // per for x in jax.tree.leaves(tree))

    assert sizes(shapes["blocks"], per=cfg.num_layers) == sorted(spec.layer_leaf_params)
    assert sizes(shapes["embed"]) == sorted(spec.embedding_leaf_params)
    assert sizes(shapes["head"]) == sorted(spec.head_leaf_params)
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(shapes["embed"])) == (
        spec.embedding_params
    )
    head = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes["head"]))
    assert head == spec.head_params
