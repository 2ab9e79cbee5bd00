"""Multi-head latent attention (jaxtrain/model/mla.py) and YaRN rotary scaling (llama.py), against an
independent float64 numpy MLA and transformers' `_compute_yarn_parameters`."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.config import ConfigError, ModelConfig, load_config
from jaxtrain.model.attention import resolve_attention
from jaxtrain.model.llama import (Block, Transformer, inv_frequencies, matmul_params, rotate, yarn_attention_factor,
                                  yarn_parameters)
from jaxtrain.model.mla import MLA
from jaxtrain.parallel.sharding import Partitioning

# D 24, N 3 heads, Hn 6 + Hr 4 = Hqk 10, Hv 5 (!= Hqk), Rkv 7, Rq 9.
SHAPE = dict(vocab_size=32, d_model=24, num_layers=2, num_heads=3, num_kv_heads=3, head_dim=10, qk_nope_head_dim=6,
             qk_rope_head_dim=4, v_head_dim=5, kv_lora_rank=7, attention="xla", init_std=0.2)
# YaRN with DeepSeek's mscale and mscale_all_dim unequal: both the cos/sin factor and the softmax scale differ from 1.
YARN = dict(rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_len=64, rope_yarn_mscale=0.5,
            rope_yarn_mscale_all_dim=1.0, rope_theta=10.0)  # a ramp over dims 0..3 of the 4 rope channels


# ----------------------------------------------------------------------------- an independent MLA


def _rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _yarn_np(H, theta, factor, original, beta_fast, beta_slow, truncate):
    """YaRN's frequencies in float64 from the paper's formulas (and the attention factor)."""
    dim = lambda rot: H * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim(beta_fast), dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, H - 1)
    base = theta ** -(np.arange(0, H, 2) / H)
    ramp = np.clip((np.arange(H // 2) - low) / (high - low), 0, 1)  # 0: kept, 1: interpolated
    return base * (1 - ramp) + base / factor * ramp


def mla_numpy(p: dict, cfg: ModelConfig, x, positions, segment_ids):
    """DeepseekV3Attention's forward in float64 from the parameters (rotate-half rope channels)."""
    x = np.asarray(x, np.float64)
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), p)
    Hn, Hr, R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if "wq" in p:
        q = np.einsum("bld,dnh->blnh", x, p["wq"])
    else:
        q = np.einsum("blr,rnh->blnh", _rms(x @ p["wq_a"], p["q_a_norm"]["scale"], cfg.norm_eps), p["wq_b"])
    ckv = x @ p["wkv_a"]
    kv = np.einsum("blr,rnh->blnh", _rms(ckv[..., :R], p["kv_a_norm"]["scale"], cfg.norm_eps), p["wkv_b"])
    if cfg.rope_scaling == "yarn":
        freq = _yarn_np(Hr, cfg.rope_theta, cfg.rope_scaling_factor, cfg.rope_original_max_len,
                        cfg.rope_yarn_beta_fast, cfg.rope_yarn_beta_slow, cfg.rope_yarn_truncate)
        m = lambda s: 0.1 * s * math.log(cfg.rope_scaling_factor) + 1
        factor, mscale2 = m(cfg.rope_yarn_mscale) / m(cfg.rope_yarn_mscale_all_dim), m(cfg.rope_yarn_mscale_all_dim) ** 2
    else:
        freq, factor, mscale2 = cfg.rope_theta ** -(np.arange(0, Hr, 2) / Hr), 1.0, 1.0
    angle = np.asarray(positions, np.float64)[..., None, None] * freq  # [B, L, 1, Hr/2]
    cos, sin = np.cos(angle) * factor, np.sin(angle) * factor

    def rope(t):
        a, b = t[..., :Hr // 2], t[..., Hr // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    k_rope = rope(ckv[..., None, R:])
    q = np.concatenate([q[..., :Hn], rope(q[..., Hn:])], axis=-1)
    k = np.concatenate([kv[..., :Hn], np.broadcast_to(k_rope, (*kv.shape[:3], Hr))], axis=-1)
    v = kv[..., Hn:]
    scores = np.einsum("bqnh,bknh->bnqk", q, k) * mscale2 / math.sqrt(Hn + Hr)
    L = x.shape[1]
    seg = np.asarray(segment_ids)
    mask = np.tril(np.ones((L, L), bool))[None] & (seg[:, :, None] == seg[:, None, :])
    scores = np.where(mask[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    o = np.einsum("bnqk,bknh->bqnh", probs, v)
    return np.einsum("blnh,nhd->bld", o, p["wo"])


def _layer(cfg: ModelConfig) -> MLA:
    return Block(cfg, nnx.Rngs(1)).attn


def _inputs(cfg: ModelConfig):
    B, L = 2, 8
    x = jax.random.normal(jax.random.key(0), (B, L, cfg.d_model), jnp.float32)
    positions = jnp.array([list(range(L)), [0, 1, 2, 0, 1, 2, 3, 4]], jnp.int32)
    segment_ids = jnp.array([[1] * L, [1, 1, 1, 2, 2, 2, 2, 2]], jnp.int32)
    return x, positions, segment_ids


@pytest.mark.parametrize("variant", ["q_lora", "full_rank_q_yarn"])
def test_mla_forward_and_gradients_match_numpy(variant):
    cfg = ModelConfig(**SHAPE, q_lora_rank=9) if variant == "q_lora" else ModelConfig(**SHAPE, **YARN)
    layer = _layer(cfg)
    assert isinstance(layer, MLA)
    graphdef, state = nnx.split(layer)
    params = nnx.to_pure_dict(state)
    assert ("wq_a" in params) == (cfg.q_lora_rank > 0) and ("wq" in params) == (cfg.q_lora_rank == 0)
    x, positions, segment_ids = _inputs(cfg)
    cot = np.asarray(jax.random.normal(jax.random.key(2), (*x.shape[:2], cfg.d_model)), np.float64)

    def loss(p, x):
        nnx.replace_by_pure_dict(state, p)
        out = nnx.merge(graphdef, state)(x, positions, segment_ids, jnp.float32, Partitioning())
        return jnp.sum(out * cot.astype(np.float32)), out

    (_, out), (g_params, g_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    ref = mla_numpy(params, cfg, x, positions, segment_ids)
    assert np.abs(ref).max() > 0.1  # not a trivially small output
    np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())

    # Gradients: the derivative along a random direction of each input, against central differences
    # of the float64 reference (exact to ~1e-9 at this step).
    f = lambda p, x: float(np.sum(mla_numpy(p, cfg, x, positions, segment_ids) * cot))
    p64 = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    leaves, treedef = jax.tree_util.tree_flatten(p64)
    rng = np.random.default_rng(0)
    eps = 1e-6
    for i, (leaf, grad) in enumerate(zip(leaves, jax.tree_util.tree_leaves(g_params))):
        d = rng.standard_normal(leaf.shape)
        shifted = lambda s: jax.tree_util.tree_unflatten(treedef, [l + s * d if j == i else l for j, l in enumerate(leaves)])
        numeric = (f(shifted(eps), x) - f(shifted(-eps), x)) / (2 * eps)
        analytic = float(np.sum(np.asarray(grad, np.float64) * d))
        assert abs(analytic - numeric) <= 1e-4 * max(1.0, abs(numeric)), (i, analytic, numeric)
    d = rng.standard_normal(x.shape)
    x64 = np.asarray(x, np.float64)
    numeric = (f(p64, x64 + eps * d) - f(p64, x64 - eps * d)) / (2 * eps)
    assert abs(float(np.sum(np.asarray(g_x, np.float64) * d)) - numeric) <= 1e-4 * max(1.0, abs(numeric))


# ----------------------------------------------------------------------------- YaRN against transformers


def _hf_yarn(hf_config):
    from transformers.modeling_rope_utils import _compute_yarn_parameters
    inv_freq, factor = _compute_yarn_parameters(hf_config)
    return inv_freq.numpy(), factor


def test_yarn_matches_transformers_deepseek_v3():
    from transformers import DeepseekV3Config
    hf = DeepseekV3Config(qk_rope_head_dim=64, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1,
        original_max_position_embeddings=4096))
    cfg = ModelConfig(rope_theta=10000.0, rope_scaling="yarn", rope_scaling_factor=40.0, rope_yarn_mscale=1.0,
                      rope_yarn_mscale_all_dim=1.0, rope_yarn_beta_fast=32, rope_yarn_beta_slow=1,
                      rope_original_max_len=4096)
    inv_freq, factor = _hf_yarn(hf)
    ours = np.asarray(inv_frequencies(64, cfg.rope_theta, yarn=yarn_parameters(cfg)))
    np.testing.assert_array_equal(ours, inv_freq)  # bit for bit
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda: inv_frequencies(64, 10000.0, yarn=yarn_parameters(cfg)))()),
                                  inv_freq)
    assert yarn_attention_factor(cfg) == factor == 1.0
    # The frequencies really are scaled: the slow end interpolated by 40, the fast end kept.
    plain = np.asarray(inv_frequencies(64, 10000.0))
    assert ours[0] == plain[0] and np.isclose(ours[-1], plain[-1] / 40)


def test_yarn_matches_transformers_gpt_oss():
    from transformers import GptOssConfig
    hf = GptOssConfig(head_dim=64, rope_parameters=dict(
        rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
        original_max_position_embeddings=4096))
    cfg = ModelConfig(rope_theta=150000.0, rope_scaling="yarn", rope_scaling_factor=32.0, rope_yarn_beta_fast=32.0,
                      rope_yarn_beta_slow=1.0, rope_yarn_truncate=False, rope_original_max_len=4096)
    inv_freq, factor = _hf_yarn(hf)
    ours = np.asarray(jax.jit(lambda: inv_frequencies(64, cfg.rope_theta, yarn=yarn_parameters(cfg)))())
    # Bit for bit, but where torch's vectorised pow rounds 150000 ** (i / 64) differently from XLA's
    # (then by one ulp): torch's own base frequencies against correctly rounded ones say where.
    import torch
    exponent = (torch.arange(0, 64, 2).float() / 64).numpy()
    torch_pow = (150000.0 ** torch.from_numpy(exponent)).numpy()
    exact_pow = (150000.0 ** exponent.astype(np.float64)).astype(np.float32)
    off = torch_pow != exact_pow
    np.testing.assert_array_equal(ours[~off], inv_freq[~off])
    np.testing.assert_array_max_ulp(ours, inv_freq, maxulp=1)
    assert off.sum() <= 3
    assert yarn_attention_factor(cfg) == factor and factor > 1.3  # 0.1 ln 32 + 1
    # truncate matters here: with it the correction range rounds out and the frequencies differ
    truncated = yarn_parameters(ModelConfig(**{**cfg.__dict__, "rope_yarn_truncate": True}))
    assert not np.array_equal(np.asarray(inv_frequencies(64, cfg.rope_theta, yarn=truncated)), inv_freq)

    # The Llama-style Attention (gpt-oss: GQA) rotates with the factor on cos and sin, as
    # transformers' rotary embedding does (cos * attention_scaling).
    x = jax.random.normal(jax.random.key(3), (1, 5, 2, 64), jnp.float32)
    positions = jnp.arange(5, dtype=jnp.int32)[None] * 997
    got = np.asarray(rotate(x, positions, jnp.asarray(inv_freq), factor))
    angle = np.asarray(positions, np.float64)[..., None, None] * inv_freq.astype(np.float64)
    cos, sin = np.cos(angle) * factor, np.sin(angle) * factor
    a, b = np.split(np.asarray(x, np.float64), 2, axis=-1)
    np.testing.assert_allclose(got, np.concatenate([a * cos - b * sin, b * cos + a * sin], -1), rtol=1e-4, atol=1e-4)


def test_attention_with_yarn_scales_its_rotary():
    """Llama-style Attention with rope_scaling=yarn: q and k carry the YaRN frequencies and factor;
    without yarn, `rotate`'s default scale leaves results bit for bit as before."""
    base = dict(d_model=16, num_heads=2, num_kv_heads=1, head_dim=8, rope_theta=100.0)
    yarn = dict(rope_scaling="yarn", rope_scaling_factor=8.0, rope_original_max_len=4)
    q = jax.random.normal(jax.random.key(4), (1, 6, 2, 8))
    k = q[:, :, :1]
    pos = jnp.arange(6, dtype=jnp.int32)[None] * 3
    attn = Block(ModelConfig(**base, **yarn), nnx.Rngs(0)).attn
    q_rot, _ = attn._rope(q, k, pos, False)
    cfg = ModelConfig(**base, **yarn)
    want = rotate(q, pos, inv_frequencies(8, 100.0, yarn=yarn_parameters(cfg)), yarn_attention_factor(cfg))
    np.testing.assert_array_equal(np.asarray(q_rot), np.asarray(want))
    assert yarn_attention_factor(cfg) > 1.2
    plain = Block(ModelConfig(**base), nnx.Rngs(0)).attn
    np.testing.assert_array_equal(np.asarray(plain._rope(q, k, pos, False)[0]),
                                  np.asarray(rotate(q, pos, inv_frequencies(8, 100.0))))


# ----------------------------------------------------------------------------- the whole model


def test_mla_transformer_decode_matches_forward():
    """Prefill then one token at a time over the MLA cache (k [.., N, Hqk], v [.., N, Hv]) gives the
    full forward pass's hidden states."""
    cfg = ModelConfig(**SHAPE, q_lora_rank=9, **YARN)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(5), (2, 8), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    full = model.hidden(tokens, positions)
    cache = model.init_cache(2, 8)
    layer0 = cache["blocks"][0]
    assert layer0["k"].shape == (2, 8, 3, 10) and layer0["v"].shape == (2, 8, 3, 5)
    h, cache = model.decode(tokens[:, :5], positions[:, :5], cache)
    steps = [h]
    for t in range(5, 8):
        h, cache = model.decode(tokens[:, t:t + 1], positions[:, t:t + 1], cache)
        steps.append(h)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, axis=1)), np.asarray(full), rtol=1e-4, atol=1e-4)


def test_mla_matmul_params_count_the_layer():
    for q_lora in (0, 9):
        cfg = ModelConfig(**SHAPE, q_lora_rank=q_lora)
        params = nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param))
        attn = params["blocks"]["attn"]
        matmul = sum(v.size for k, v in attn.items() if k.startswith("w"))  # the norms' scales left out
        mlp = sum(v.size for v in jax.tree_util.tree_leaves(params["blocks"]["mlp"]))
        assert matmul_params(cfg) == matmul + mlp + cfg.d_model * cfg.vocab_size


def test_mla_refuses_fused_kernels():
    mla = ["model.kv_lora_rank=7", "model.num_heads=3", "model.num_kv_heads=3", "model.head_dim=10",
           "model.qk_nope_head_dim=6", "model.qk_rope_head_dim=4", "model.v_head_dim=5"]
    with pytest.raises(ConfigError, match=r"model.attention=pallas with multi-head latent attention"):
        resolve_attention(load_config(None, mla + ["model.attention=pallas"]), "tpu", {}, available=("xla", "pallas"))
    assert resolve_attention(load_config(None, mla + ["model.attention=auto"]), "tpu", {},
                             available=("xla", "pallas")) == "xla"
    with pytest.raises(ConfigError, match=r"mesh.context=2 with multi-head latent attention"):
        resolve_attention(load_config(None, mla + ["model.attention=xla"]), "cpu", {"context": 2})
