"""Model and step properties: scan == unroll, remat changes nothing, accumulation == one big batch."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from trees import assert_trees_close

from jaxtrain.config import load_config
from jaxtrain.data import build_train_data
from jaxtrain.model.llama import Transformer
from jaxtrain.train.optim import make_optimizer
from jaxtrain.train.precision import init_loss_scale
from jaxtrain.train.stability import init_statistics
from jaxtrain.train.step import loss_sum, make_train_step

SMALL = ["model.vocab_size=64", "model.d_model=32", "model.num_layers=3", "model.num_heads=4",
         "model.num_kv_heads=2", "model.head_dim=8", "model.mlp_dim=64", "model.attention=xla",
         "data.seq_len=16", "data.global_batch_size=8", "optim.warmup_steps=0"]


def params_and_batch(cfg):
    model = Transformer(cfg.model, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    batch = {k: jnp.asarray(v) for k, v in next(build_train_data(cfg)).items()}
    return graphdef, nnx.to_pure_dict(state), batch


def test_scanned_layers_equal_unrolled_layers():
    cfg = load_config(None, SMALL)
    graphdef, params, batch = params_and_batch(cfg)
    unrolled = nnx.split(Transformer(cfg.with_overrides("model.scan_layers=false").model, rngs=nnx.Rngs(0)))[0]
    f = lambda g: jax.jit(jax.value_and_grad(lambda p: loss_sum(p, g, batch)[0]))(params)
    (loss_s, grads_s), (loss_u, grads_u) = f(graphdef), f(unrolled)
    np.testing.assert_allclose(loss_s, loss_u, rtol=1e-6)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads_s, grads_u)


def test_local_and_global_layers_scanned_unrolled_and_rematerialised_agree():
    """Gemma 3's stack (layers 0 and 1 local with a window of 4, layer 2 global; a lax.cond per scanned
    layer): the scan, the unrolled layers (a Python bool per layer) and remat=full give the same loss
    and gradients, and the window is not ignored (one as long as the rows gives another loss)."""
    gemma = ["model.sliding_window=4", "model.sliding_window_pattern=3", "model.post_norms=true",
             "model.norm_plus_one=true", "model.embed_scale=true", "model.mlp_activation=gelu_tanh",
             "model.qk_norm=true", "model.rope_local_theta=500"]
    cfg = load_config(None, [*SMALL, *gemma])
    graphdef, params, batch = params_and_batch(cfg)
    f = lambda c: jax.jit(jax.value_and_grad(lambda p: loss_sum(p, nnx.split(Transformer(
        c.model, rngs=nnx.Rngs(0)))[0], batch)[0]))(params)
    loss, grads = f(cfg)
    for other in ("model.scan_layers=false", "model.remat=full"):
        loss_o, grads_o = f(cfg.with_overrides(other))
        np.testing.assert_allclose(loss_o, loss, rtol=1e-6)
        # atol 2e-6: jax 0.10 sums the unrolled layers' gradients in another order (|diff| < 1e-6 seen on leaves ~1)
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6), grads_o, grads)
    assert abs(float(f(cfg.with_overrides("model.sliding_window=16"))[0]) - float(loss)) > 1e-4


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_policies_do_not_change_gradients(remat):
    cfg = load_config(None, SMALL)
    graphdef, params, batch = params_and_batch(cfg)
    remat_def = nnx.split(Transformer(cfg.with_overrides(f"model.remat={remat}").model, rngs=nnx.Rngs(0)))[0]
    g = lambda gd: jax.jit(jax.grad(lambda p: loss_sum(p, gd, batch)[0]))(params)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g(remat_def), g(graphdef))


def test_grad_accumulation_equals_one_big_batch():
    cfg = load_config(None, SMALL)
    graphdef, params, batch = params_and_batch(cfg)
    # Padding in some rows: the mean must be over counted tokens of the whole batch, not per microbatch.
    batch["loss_mask"] = batch["loss_mask"].at[1, 5:].set(0.0).at[6, 2:].set(0.0)
    results = []
    for accum in (1, 4):
        c = cfg.with_overrides(f"train.grad_accum={accum}")
        opt = make_optimizer(c)
        state = {"step": jnp.int32(0), "params": params, "opt_state": opt.init(params),
                 "rng": jax.random.key_data(jax.random.key(0)), "loss_scale": init_loss_scale(c),
                 "stability": init_statistics()}
        new_state, metrics, grads = jax.jit(make_train_step(c, graphdef, opt, return_grads=True))(state, batch, jnp.float32(1))
        results.append((metrics, grads, new_state["params"]))
    (m1, g1, p1), (m4, g4, p4) = results
    np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=1e-6)
    np.testing.assert_allclose(m4["grad_norm"], m1["grad_norm"], rtol=1e-5)
    assert float(m1["tokens"]) == 8 * 16 - 11 - 14
    assert_trees_close(g4, g1, 1e-5, "gradient ")
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p4, p1)
    assert not np.allclose(p1["embed"], params["embed"])  # the step did update something


def test_segment_ids_block_attention_across_documents():
    cfg = load_config(None, SMALL)
    graphdef, params, _ = params_and_batch(cfg)
    model = nnx.merge(graphdef, params)
    rng = np.random.default_rng(0)
    doc_a, doc_b = rng.integers(0, 64, 6), rng.integers(0, 64, 10)
    packed = jnp.asarray(np.concatenate([doc_a, doc_b])[None], jnp.int32)
    positions = jnp.asarray(np.concatenate([np.arange(6), np.arange(10)])[None], jnp.int32)
    segments = jnp.asarray(np.concatenate([np.full(6, 1), np.full(10, 2)])[None], jnp.int32)
    logits = model(packed, positions, segments)
    alone_b = model(jnp.asarray(doc_b[None], jnp.int32))
    alone_a = model(jnp.asarray(doc_a[None], jnp.int32))
    np.testing.assert_allclose(logits[0, 6:], alone_b[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits[0, :6], alone_a[0], rtol=1e-5, atol=1e-5)
    # Without segment ids the second document would see the first: the check above can fail.
    assert not np.allclose(model(packed, positions)[0, 6:], alone_b[0], atol=1e-4)


SHIPPED = sorted((Path(__file__).resolve().parents[2] / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_initial_loss_is_near_ln_vocab_for_every_shipped_config(path):
    """The output projection starts small (logits std model.LOGIT_STD): the first loss is ~ln(vocab),
    not the ln(vocab) + 45**2/2 a unit-variance tied table used to give. Depth, MLP and vocabulary
    are shrunk to fit the test (the initial logits' scale depends on d_model only); d_model, heads,
    tying and a window pattern are the config's own."""
    import math

    from jaxtrain.model.llama import LOGIT_STD
    cfg = load_config(path)
    vocab = min(cfg.model.vocab_size, 4096)
    # A mixture of experts: its one layer MoE, with at most 16 narrow experts (DeepSeek-V3's 256 at d_model 7168
    # took two minutes; each expert's output is a convex mix, its count does not move the logits' scale).
    moe = ["model.first_dense_layers=0", f"model.moe_mlp_dim={min(cfg.model.moe_mlp_dim, 128)}",
           f"model.num_experts={min(cfg.model.num_experts, 16)}"] if cfg.model.num_experts else []
    # Local and global layers (Gemma 3): one whole pattern, its local layers and the global one.
    layers = cfg.model.sliding_window_pattern if cfg.model.mixed_windows else 1
    cfg = cfg.with_overrides(*moe, f"model.num_layers={layers}", f"model.vocab_size={vocab}", f"model.mlp_dim={min(cfg.model.mlp_dim, 512)}",
                             "data.source=markov", "data.path=null", f"data.markov_states={min(64, vocab)}",
                             "data.seq_len=128", "data.global_batch_size=4", "model.attention=xla",
                             "precision.policy=fp32", "train.grad_accum=1")
    model = Transformer(cfg.model, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (4, 129), 0, vocab)  # 512 targets: the mean is within ~0.02
    logits = model(tokens[:, :-1])
    loss = float(jnp.mean(optax_ce(logits, tokens[:, 1:])))
    expected = math.log(vocab) + LOGIT_STD ** 2 / 2
    assert abs(loss - expected) <= 0.1, (path.name, loss, expected)
    assert 0.5 * LOGIT_STD <= float(jnp.std(logits)) <= 1.5 * LOGIT_STD


def optax_ce(logits, targets):
    import optax
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
