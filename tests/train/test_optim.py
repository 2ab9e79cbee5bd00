"""The optimizer's own pieces against optax's: the clip and the guarded Adam keep optax's state
trees (checkpoints stay compatible) and its arithmetic, to rounding where stated."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from trees import assert_trees_close, assert_trees_equal

from jaxtrain.train.optim import clip_by_global_norm, guarded_adam


def gradients(scale: float) -> dict:
    keys = jax.random.split(jax.random.key(0), 3)
    return {"w": scale * jax.random.normal(keys[0], (64, 32)), "b": scale * jax.random.normal(keys[1], (32,)),
            "e": {"t": scale * jax.random.normal(keys[2], (16, 8))}}


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_clip_by_global_norm_matches_optax(scale):
    g, max_norm = gradients(scale), 1.0
    ours, theirs = clip_by_global_norm(max_norm), optax.clip_by_global_norm(max_norm)
    assert jax.tree_util.tree_structure(ours.init(g)) == jax.tree_util.tree_structure(theirs.init(g))
    got, _ = ours.update(g, ours.init(g))
    want, _ = theirs.update(g, theirs.init(g))
    if float(optax.global_norm(g)) <= max_norm:
        assert_trees_equal(got, g)  # not clipped: the gradient itself, bitwise
    else:
        assert_trees_close(got, want, rel=1e-6)
        np.testing.assert_allclose(float(optax.global_norm(got)), max_norm, rtol=1e-6)


def test_clip_of_a_zero_gradient_is_zero():
    g = jax.tree_util.tree_map(jnp.zeros_like, gradients(1.0))
    got, _ = clip_by_global_norm(1.0).update(g, optax.EmptyState())
    assert_trees_equal(got, g)


def test_guarded_adam_is_optax_adam_and_keeps_its_state_on_a_skip():
    g, params = gradients(1.0), gradients(2.0)
    ours, theirs = guarded_adam(0.9, 0.95, 1e-8), optax.scale_by_adam(0.9, 0.95, 1e-8)
    state = ours.init(params)
    assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(theirs.init(params))
    for _ in range(3):  # a few steps so the moments are not their zero start
        got, new = ours.update(g, state, params)
        want, want_state = theirs.update(g, state, params)
        assert_trees_equal(got, want)
        assert_trees_equal(new, want_state)
        state = new
    _, kept = ours.update(g, state, params, skip=True)
    assert_trees_equal(kept, state)
