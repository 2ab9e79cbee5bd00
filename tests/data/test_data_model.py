"""Packing is invisible to the model: a packed row gives each document the logits it gets alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.config import load_config
from jaxtrain.data.packing import pack_window

EOD = 31


@pytest.fixture
def fast_compile():
    old = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)  # compile speed on the CPU
    yield
    jax.config.update("jax_disable_most_optimizations", old)


def test_packed_forward_equals_each_document_alone(fast_compile):
    cfg = load_config(None, ["model.vocab_size=32", "model.d_model=32", "model.num_layers=2", "model.num_heads=2",
                             "model.num_kv_heads=1", "model.head_dim=16", "model.mlp_dim=64", "model.attention=xla", "data.markov_states=16"])
    from jaxtrain.model.llama import Transformer

    model = Transformer(cfg.model, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, EOD, n).tolist() + [EOD] for n in (5, 3, 6)]  # 17 tokens, then padding
    L = 20
    stream = np.array([t for d in docs for t in d])
    row = pack_window(stream, np.zeros(len(stream), bool), L, EOD)
    np.testing.assert_array_equal(row["segment_ids"][:17], np.repeat([1, 2, 3], [6, 4, 7]))

    packed = model(jnp.asarray(row["tokens"])[None], jnp.asarray(row["positions"])[None],
                   jnp.asarray(row["segment_ids"])[None])[0]
    start = 0
    for doc in docs:
        n = len(doc)
        alone = model(jnp.asarray(doc)[None], jnp.arange(n)[None], jnp.ones((1, n), jnp.int32))[0]
        np.testing.assert_allclose(packed[start:start + n], alone, rtol=1e-5, atol=1e-5)
        start += n
    # Sanity: without segment ids the later documents would see the earlier ones, and differ.
    unpacked = model(jnp.asarray(row["tokens"])[None], jnp.asarray(row["positions"])[None],
                     jnp.ones((1, L), jnp.int32))[0]
    assert np.abs(np.asarray(unpacked[6:10]) - np.asarray(packed[6:10])).max() > 1e-3
