"""gpt-oss's pieces of the decoder (model.attention_bias, attention_sinks, mlp_bias, mlp_activation=
clamped_swiglu, local and global layers in a mixture of experts) against transformers' GptOss modules
built from a tiny random GptOssConfig in fp32 (the weights copied into jaxtrain's layout), a numpy
float64 dense MLP, and whole tiny models trained under expert, tensor and fsdp parallelism against
data parallelism and one device."""

from __future__ import annotations

import inspect
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import Mesh
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import (GptOssAttention, GptOssExperts, GptOssMLP,
                                                          GptOssRotaryEmbedding, GptOssTopKRouter)
from trees import assert_trees_close

import jaxtrain.kernels as kernels
from jaxtrain.config import ConfigError, ModelConfig, load_config
from jaxtrain.model.attention import attend
from jaxtrain.model.llama import MLP, Attention
from jaxtrain.model.moe import MoE, route
from jaxtrain.parallel.experts import routed_experts
from jaxtrain.parallel.sharding import Partitioning

# The parallel tests' helpers (tests/parallel/ is not on sys.path when only this folder is collected).
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parallel"))
import test_expert_parallel as ep_tests  # noqa: E402
import test_parallelism as layout_tests  # noqa: E402
from test_dispatch_kinds import emulated_ragged_all_to_all  # noqa: E402

D, N, K, H, F, E, TOPK = 16, 4, 2, 8, 8, 4, 2
LIMIT = 0.8  # small enough that the clamps act on these weights' activations
KERNEL_SINKS = "sinks" in inspect.signature(kernels.flash_attention).parameters
needs_kernel_sinks = pytest.mark.skipif(not KERNEL_SINKS, reason="kernels.flash_attention has no `sinks` yet")


def hf_config(window: int = 4) -> GptOssConfig:
    return GptOssConfig(hidden_size=D, intermediate_size=F, num_local_experts=E, num_experts_per_tok=TOPK,
                        num_attention_heads=N, num_key_value_heads=K, head_dim=H, num_hidden_layers=2,
                        sliding_window=window, swiglu_limit=LIMIT, attention_bias=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attn_implementation="eager")


def jax_config(**changes) -> ModelConfig:
    keys = dict(vocab_size=32, d_model=D, num_layers=2, num_heads=N, num_kv_heads=K, head_dim=H, mlp_dim=F,
                moe_mlp_dim=F, num_experts=E, experts_per_token=TOPK, attention="xla", attention_bias=True,
                attention_sinks=True, mlp_bias=True, mlp_activation="clamped_swiglu", swiglu_limit=LIMIT,
                rope_theta=10000.0, capacity_factor=0.0)
    return ModelConfig(**{**keys, **changes})


def randomize(module: torch.nn.Module, seed: int, std: float = 0.5) -> torch.nn.Module:
    """Every parameter (biases and sinks too) random: a zero bias would test nothing."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, std)
    return module.eval()


def t2j(x: torch.Tensor) -> jnp.ndarray:
    return jnp.asarray(x.detach().numpy())


def set_params(module: nnx.Module, values: dict) -> None:
    for name, value in values.items():
        getattr(module, name)[...] = jnp.asarray(value, jnp.float32)


def moe_params(mlp: GptOssMLP) -> dict:
    """GptOssMLP's router and experts in jaxtrain's MoE layout: gate_up_proj [E, D, 2F] interleaves
    gate (even columns) and up (odd columns), its bias likewise; nn.Linear's router weight is [E, D]."""
    ex, router = mlp.experts, mlp.router
    return {"router": t2j(router.weight).T, "router_b": t2j(router.bias),
            "w_gate": t2j(ex.gate_up_proj[..., ::2]), "w_up": t2j(ex.gate_up_proj[..., 1::2]),
            "b_gate": t2j(ex.gate_up_proj_bias[..., ::2]), "b_up": t2j(ex.gate_up_proj_bias[..., 1::2]),
            "w_down": t2j(ex.down_proj), "b_down": t2j(ex.down_proj_bias)}


def hf_moe(seed: int = 0) -> tuple[GptOssMLP, np.ndarray]:
    cfg = hf_config()
    cfg._experts_implementation = "eager"
    mlp = randomize(GptOssMLP(cfg), seed)
    x = np.random.default_rng(seed).normal(size=(2, 8, D)).astype(np.float32)
    return mlp, x


def test_router_is_gpt_oss_top_k_router():
    """Top-k on logits + router_b, softmax over the chosen k: jaxtrain's softmax router with
    moe_norm_topk_prob=true and the bias added to the logits."""
    mlp, x = hf_moe(1)
    router: GptOssTopKRouter = mlp.router
    with torch.no_grad():
        logits, scores, indices = router(torch.from_numpy(x.reshape(-1, D)))
    moe = MoE(jax_config(), nnx.Rngs(0))
    set_params(moe, moe_params(mlp))
    j_logits = jnp.asarray(x.reshape(-1, D)) @ moe.router[...] + moe.router_b[...]
    experts, gates, _ = route(j_logits, jnp.zeros((E,)), TOPK, "softmax", True)
    np.testing.assert_allclose(np.asarray(j_logits), logits.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(experts), indices.numpy())
    np.testing.assert_allclose(np.asarray(gates), scores.numpy(), rtol=1e-6, atol=1e-7)


def test_moe_layer_is_gpt_oss_mlp():
    """Router, clamped SwiGLU experts with biases (the down bias weighted by the gate): the whole
    GptOssMLP, forward, with the clamps active."""
    mlp, x = hf_moe(2)
    with torch.no_grad():
        want, _ = mlp(torch.from_numpy(x))
        gate_up = torch.from_numpy(x.reshape(-1, D)) @ mlp.experts.gate_up_proj[0] + mlp.experts.gate_up_proj_bias[0]
    # Some gates above the limit and some up values outside [-limit, limit]: both clamps matter.
    assert (gate_up[:, ::2] > LIMIT).any() and (gate_up[:, 1::2].abs() > LIMIT).any()
    moe = MoE(jax_config(), nnx.Rngs(0))
    set_params(moe, moe_params(mlp))
    got, _ = moe(jnp.asarray(x), jnp.float32, Partitioning(), jnp.zeros((E,)))
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-5, atol=1e-5)


KINDS = {  # kind: (mesh shape over (data, expert, tensor) or None, capacity factor)
    "dropless-ragged_dot": (None, 0.0), "dropless-tiled": (None, 0.0), "capacity": (None, E / TOPK),
    "capacity-expert4": ((2, 4, 1), E / TOPK), "dropless-dense-all_to_all-expert2-tensor2": ((2, 2, 2), 0.0),
    "dropless-ragged_all_to_all-expert4": ((2, 4, 1), 0.0),
}


@pytest.mark.parametrize("case", sorted(KINDS))
def test_every_dispatch_kind_is_gpt_oss_experts(case):
    """Each dispatch kind applies the biases and the clamped SwiGLU: GptOssExperts' output for the
    same routing, and the gradients of every kind equal those of the one-device grouped matmul."""
    mlp, _ = hf_moe(3)
    experts_mod: GptOssExperts = mlp.experts
    x = np.random.default_rng(3).normal(size=(8, 4, D)).astype(np.float32)
    with torch.no_grad():
        _, scores, indices = mlp.router(torch.from_numpy(x.reshape(-1, D)))
        want = experts_mod(torch.from_numpy(x.reshape(-1, D)), indices, scores).numpy().reshape(8, 4, D)
    p = moe_params(mlp)
    experts, gates = jnp.asarray(indices.numpy().reshape(8, 4, TOPK), jnp.int32), t2j(scores).reshape(8, 4, TOPK)
    shape, factor = KINDS[case]
    kind = case.split("-expert")[0].split("-tensor")[0]
    part = Partitioning()
    if shape is not None:
        mesh = Mesh(np.array(jax.devices()).reshape(shape), ("data", "expert", "tensor"))
        part = Partitioning(mesh, {"batch": ["data", "expert"], "experts": "expert", "moe_mlp": "tensor"})

    def loss(x, gates, w, b, part, kind):
        y, dropped = routed_experts(x, experts, gates, *w, factor, jnp.float32, part,
                                    kind=kind, ragged_exchange=emulated_ragged_all_to_all, biases=b,
                                    clamp=(LIMIT, 1.702))
        return jnp.sum(y * jnp.cos(y)), (y, dropped)

    w = [p["w_gate"], p["w_up"], p["w_down"]]
    b = [p["b_gate"], p["b_up"], p["b_down"]]
    grad = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
    got_g, (got_y, dropped) = jax.jit(lambda *a: grad(*a, part, kind))(jnp.asarray(x), gates, w, b)
    assert float(dropped) == 0
    np.testing.assert_allclose(np.asarray(got_y), want, rtol=1e-5, atol=1e-5)
    want_g, _ = jax.jit(lambda *a: grad(*a, Partitioning(), "dropless-ragged_dot"))(jnp.asarray(x), gates, w, b)
    assert_trees_close(jax.device_get(got_g), jax.device_get(want_g), 1e-5, "gradient ")
    assert float(jnp.max(jnp.abs(got_g[3][2]))) > 0  # the down bias has a gradient


def test_dense_mlp_with_biases_and_clamped_swiglu_is_numpy():
    cfg = jax_config(num_experts=0)
    mlp = MLP(cfg, nnx.Rngs(0))
    rng = np.random.default_rng(4)
    p = {"w_gate": rng.normal(size=(D, F)), "w_up": rng.normal(size=(D, F)), "w_down": rng.normal(size=(F, D)),
         "b_gate": rng.normal(size=F), "b_up": rng.normal(size=F), "b_down": rng.normal(size=D)}
    set_params(mlp, p)
    x = rng.normal(size=(2, 5, D))
    gate, up = x @ p["w_gate"] + p["b_gate"], x @ p["w_up"] + p["b_up"]
    assert (gate > LIMIT).any() and (np.abs(up) > LIMIT).any()
    g = np.minimum(gate, LIMIT)
    want = ((np.clip(up, -LIMIT, LIMIT) + 1) * g / (1 + np.exp(-1.702 * g))) @ p["w_down"] + p["b_down"]
    got = mlp(jnp.asarray(x, jnp.float32), jnp.float32, Partitioning())
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def attention_pair(window: int, local: bool, seed: int = 5):
    """GptOssAttention (layer 0 sliding, layer 1 full) and a jaxtrain Attention with its weights."""
    cfg = hf_config(window)
    hf = randomize(GptOssAttention(cfg, layer_idx=0 if local else 1), seed, std=0.3)
    att = Attention(jax_config(sliding_window=window, sliding_window_pattern=2), nnx.Rngs(0))
    set_params(att, {
        "wq": t2j(hf.q_proj.weight).T.reshape(D, N, H), "bq": t2j(hf.q_proj.bias).reshape(N, H),
        "wk": t2j(hf.k_proj.weight).T.reshape(D, K, H), "bk": t2j(hf.k_proj.bias).reshape(K, H),
        "wv": t2j(hf.v_proj.weight).T.reshape(D, K, H), "bv": t2j(hf.v_proj.bias).reshape(K, H),
        "wo": t2j(hf.o_proj.weight).T.reshape(N, H, D), "bo": t2j(hf.o_proj.bias), "sinks": t2j(hf.sinks)})
    return cfg, hf, att


def hf_attention(cfg, hf, x, local: bool, window: int):
    B, L = x.shape[:2]
    pos = torch.arange(L)[None].expand(B, L)
    cos_sin = GptOssRotaryEmbedding(cfg)(torch.from_numpy(x), pos)
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    visible = (j <= i) & ((i - j < window) if local else True)
    mask = torch.from_numpy(np.where(visible, 0.0, -1e9).astype(np.float32))[None, None].expand(B, 1, L, L)
    with torch.no_grad():
        out, _ = hf(torch.from_numpy(x), cos_sin, mask)
    return out.numpy()


@pytest.mark.parametrize("local", [True, False], ids=["sliding", "full"])
def test_cached_attention_with_biases_and_sinks_is_gpt_oss_attention(local):
    """The decode path (attend_cached with sinks), prefilling the whole sequence into the cache."""
    window = 3
    cfg, hf, att = attention_pair(window, local)
    x = np.random.default_rng(6).normal(size=(2, 7, D)).astype(np.float32)
    want = hf_attention(cfg, hf, x, local, window)
    cache = {kv: jnp.zeros((2, 7, K, H)) for kv in ("k", "v")}
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    got, _ = att.decode(jnp.asarray(x), pos, cache, jnp.float32, Partitioning(), local)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@needs_kernel_sinks
@pytest.mark.parametrize("local", [True, False], ids=["sliding", "full"])
def test_attention_with_biases_and_sinks_is_gpt_oss_attention(local):
    """The training path (attend -> kernels.flash_attention with sinks), both window kinds, and
    with a traced local flag (the scanned stack of mixed layers)."""
    window = 3
    cfg, hf, att = attention_pair(window, local)
    x = np.random.default_rng(7).normal(size=(2, 7, D)).astype(np.float32)
    want = hf_attention(cfg, hf, x, local, window)
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    got = att(jnp.asarray(x), pos, None, jnp.float32, Partitioning(), local)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    traced = jax.jit(lambda flag: att(jnp.asarray(x), pos, None, jnp.float32, Partitioning(), flag))(jnp.array(local))
    np.testing.assert_allclose(np.asarray(traced), want, rtol=1e-5, atol=1e-5)


def test_sinks_with_context_parallelism_are_refused():
    with pytest.raises(ConfigError, match="model.attention_sinks=true with mesh.context=2"):
        load_config(None, ["model.attention_sinks=true", "mesh.context=2", "mesh.data=-1", "data.seq_len=64"])
    q = jnp.zeros((1, 8, N, H))
    k = jnp.zeros((1, 8, K, H))
    mesh = Mesh(np.array(jax.devices()[:2]), ("context",))
    part = Partitioning(mesh, {"length": "context"}, context=object())
    with pytest.raises(ConfigError, match="model.attention_sinks"):
        attend(q, k, k, None, "xla", part, sinks=jnp.zeros((N,)))


# ----------------------------------------------------------------------------- whole models

GPT_OSS = ["model.attention_bias=true", "model.attention_sinks=true", "model.mlp_bias=true",
           "model.mlp_activation=clamped_swiglu", "model.sliding_window=4", "model.sliding_window_pattern=2",
           "model.capacity_factor=0"]


def test_mixed_windows_in_a_mixture_of_experts_are_built_but_not_in_pipeline_stages():
    cfg = load_config(None, ["model.num_experts=4", "model.num_layers=4", *GPT_OSS]).model
    assert [cfg.layer_is_local(i) for i in range(4)] == [True, False, True, False]
    with pytest.raises(ConfigError, match="model.sliding_window_pattern=2 with mesh.stage=2"):
        load_config(None, ["model.num_experts=4", "model.num_layers=4", *GPT_OSS, "mesh.stage=2", "mesh.data=-1",
                           "pipeline.microbatches=2"])


def test_mixed_windows_follow_each_layer_through_dense_and_moe_stacks():
    """A first dense layer, interleaved dense layers and MoE layers, local and global alternating:
    the scanned stacks (traced per-layer flags) equal decode's unrolled layers (Python flags, by each
    layer's index in the model), and each layer's own flag matters (another pattern differs)."""
    from jaxtrain.model.llama import Transformer
    cfg = jax_config(num_layers=5, first_dense_layers=1, moe_every=2, sliding_window=2, sliding_window_pattern=2)
    tokens = jnp.asarray(np.random.default_rng(8).integers(0, 32, (2, 8)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))

    def hidden(cfg):
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        return model, nnx.jit(lambda m: m.hidden(tokens))(model)
    model, want = hidden(cfg)
    got, _ = nnx.jit(lambda m: m.decode(tokens, positions, m.init_cache(2, 8)))(model)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    other = hidden(jax_config(**{**cfg.__dict__, "sliding_window_pattern": 3}))[1]
    assert float(jnp.max(jnp.abs(other - want))) > 1e-3


@pytest.mark.slow
@needs_kernel_sinks
def test_gpt_oss_model_expert4_data2_equals_data8():
    want = ep_tests.run(["mesh.data=8", *GPT_OSS])
    got = ep_tests.run(["mesh.data=2", "mesh.expert=4", *GPT_OSS])
    assert got[0]["moe_dropped_fraction"] == 0
    ep_tests.assert_runs_equal(got, want)
    params = got[3]["params"]["blocks"]
    assert {"bq", "bk", "bv", "bo", "sinks"} <= set(params["attn"])
    assert {"router_b", "b_gate", "b_up", "b_down"} <= set(params["mlp"])


@pytest.mark.slow
@needs_kernel_sinks
def test_gpt_oss_model_tensor2_fsdp2_equals_one_device():
    moe = ["model.num_experts=4", "model.experts_per_token=2", "model.moe_mlp_dim=32", *GPT_OSS]
    _, ref_grads, ref_losses, ref_params = layout_tests.run(moe, jax.devices()[:1])
    metrics, grads, losses, params = layout_tests.run(["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", *moe],
                                                      jax.devices())
    assert_trees_close(grads, ref_grads, 1e-4, "gradient ")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(params, ref_params, layout_tests.PARAM_RTOL, "parameter after 3 steps ")
