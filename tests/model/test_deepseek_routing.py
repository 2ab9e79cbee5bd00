"""DeepSeek-V3's routing in `jaxtrain.model.moe.route`: group-limited top-k on sigmoid scores + the
correction bias, gates the chosen scores normalised and times routed_scaling_factor. Checked against
a float64 numpy port of transformers' DeepseekV3TopkRouter and against that router itself (torch),
on logits whose choice scores have no ties; n_group=1 and scaling 1 against today's routing bitwise;
and expert parallelism (expert=4 x data=2) against data=8 with groups, after one train step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from trees import assert_trees_close

from jaxtrain.config import ConfigError, ModelConfig, load_config
from jaxtrain.model.moe import route
from jaxtrain.parallel.sharding import global_batch
from jaxtrain.train.step import BATCH_KEYS
from jaxtrain.trainer import Trainer

E, GROUPS, TOPK_GROUP, K, SCALING = 16, 4, 2, 3, 2.5


def hf_route_numpy(logits: np.ndarray, bias: np.ndarray, k: int, n_group: int, topk_group: int,
                   scaling: float, norm: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepseekV3TopkRouter.forward in float64 numpy -> (experts [T, k], gates [T, k], kept groups [T, G])."""
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    choice = scores + bias
    T, E = choice.shape
    group_scores = np.sort(choice.reshape(T, n_group, E // n_group), axis=-1)[..., -2:].sum(-1)
    kept_groups = np.argsort(-group_scores, axis=-1)[:, :topk_group]
    group_mask = np.zeros((T, n_group), bool)
    np.put_along_axis(group_mask, kept_groups, True, axis=-1)
    masked = np.where(np.repeat(group_mask, E // n_group, axis=-1), choice, -np.inf)
    experts = np.argsort(-masked, axis=-1)[:, :k]
    gates = np.take_along_axis(scores, experts, -1)
    if norm:
        gates = gates / (gates.sum(-1, keepdims=True) + 1e-20)
    return experts, gates * scaling, group_mask


def random_routing(seed: int, T: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """fp32 logits [T, E] and a bias [E] whose choice scores (and group scores) have no near-ties,
    so the chosen sets cannot depend on rounding or on tie-breaking order."""
    rng = np.random.default_rng(seed)
    while True:
        logits = rng.normal(size=(T, E)).astype(np.float32)
        bias = (rng.normal(size=E) * 0.1).astype(np.float32)
        choice = 1 / (1 + np.exp(-logits.astype(np.float64))) + bias
        s = np.sort(choice, axis=-1)
        groups = np.sort(np.sort(choice.reshape(T, GROUPS, -1), -1)[..., -2:].sum(-1), -1)
        if np.diff(s, axis=-1).min() > 1e-5 and np.diff(groups, axis=-1).min() > 1e-5:
            return logits, bias


def test_group_limited_routing_matches_numpy_port_of_transformers():
    logits, bias = random_routing(0)
    experts, gates, _ = route(jnp.asarray(logits), jnp.asarray(bias), K, "sigmoid", True, GROUPS, TOPK_GROUP, SCALING)
    want_experts, want_gates, group_mask = hf_route_numpy(logits, bias, K, GROUPS, TOPK_GROUP, SCALING)
    experts, gates = np.asarray(experts), np.asarray(gates)
    assert experts.shape == (64, K) and experts.dtype == np.int32
    for t in range(len(logits)):
        assert set(experts[t]) == set(want_experts[t]), t
        order = {e: i for i, e in enumerate(want_experts[t])}
        np.testing.assert_allclose(gates[t], want_gates[t][[order[e] for e in experts[t]]], rtol=1e-6)
    np.testing.assert_allclose(gates.sum(-1), SCALING, rtol=1e-6)  # normalised over the k, then scaled
    # Every chosen expert lies in a kept group.
    assert np.all(np.take_along_axis(np.repeat(group_mask, E // GROUPS, -1), experts, -1))
    # The group limit changed the choice: some token's unconstrained top-k uses an excluded group.
    free = np.argsort(-(1 / (1 + np.exp(-logits.astype(np.float64))) + bias), axis=-1)[:, :K]
    outside = ~np.take_along_axis(np.repeat(group_mask, E // GROUPS, -1), free, -1)
    assert outside.any(axis=-1).sum() > 5


def test_group_limited_routing_matches_transformers_router():
    """The same logits through transformers' DeepseekV3TopkRouter (its weight the identity, so its
    logits are ours), un-normalised gates too (norm_topk_prob false: HF's gates as they are)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    logits, bias = random_routing(1)
    for norm in (True, False):
        cfg = DeepseekV3Config(hidden_size=E, n_routed_experts=E, num_experts_per_tok=K, n_group=GROUPS,
                               topk_group=TOPK_GROUP, routed_scaling_factor=SCALING, norm_topk_prob=norm)
        router = DeepseekV3TopkRouter(cfg)
        with torch.no_grad():
            router.weight.copy_(torch.eye(E))
            router.e_score_correction_bias.copy_(torch.from_numpy(bias))
            _, hf_gates, hf_experts = router(torch.from_numpy(logits))
        experts, gates, _ = route(jnp.asarray(logits), jnp.asarray(bias), K, "sigmoid", norm, GROUPS, TOPK_GROUP,
                                  SCALING)
        hf = {(t, int(e)): float(g) for t in range(len(logits)) for e, g in zip(hf_experts[t], hf_gates[t])}
        ours = {(t, int(e)): float(g) for t in range(len(logits)) for e, g in zip(np.asarray(experts)[t],
                                                                                 np.asarray(gates)[t])}
        assert ours.keys() == hf.keys()
        np.testing.assert_allclose([ours[key] for key in hf], list(hf.values()), rtol=1e-6)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_one_group_and_unit_scaling_is_todays_routing_bitwise(router):
    logits, bias = random_routing(2)
    logits = jnp.asarray(logits)
    bias = jnp.asarray(bias if router == "sigmoid" else np.zeros(E, np.float32))
    for k in (1, K):
        today = jax.jit(lambda l, b: route(l, b, k, router))(logits, bias)
        one_group = jax.jit(lambda l, b: route(l, b, k, router, True, 1, 1, 1.0))(logits, bias)
        for a, b in zip(today, one_group):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The scaling factor multiplies the gates of either router and nothing else.
    exp, gates, probs = route(logits, bias, K, router, True, 1, 1, SCALING)
    exp1, gates1, probs1 = route(logits, bias, K, router)
    np.testing.assert_array_equal(np.asarray(exp), np.asarray(exp1))
    np.testing.assert_array_equal(np.asarray(probs), np.asarray(probs1))
    np.testing.assert_allclose(np.asarray(gates), SCALING * np.asarray(gates1), rtol=1e-6)


def test_gradient_reaches_the_router_through_the_chosen_scores_only():
    """The gates' gradient w.r.t. the logits: nonzero only on the chosen experts (the group choice
    and the bias are selections, not weights)."""
    logits, bias = random_routing(3, T=4)
    r = np.random.default_rng(0).normal(size=(4, K)).astype(np.float32)
    g = jax.grad(lambda l: jnp.sum(route(l, jnp.asarray(bias), K, "sigmoid", True, GROUPS, TOPK_GROUP,
                                         SCALING)[1] * r))(jnp.asarray(logits))
    experts = np.asarray(route(jnp.asarray(logits), jnp.asarray(bias), K, "sigmoid", True, GROUPS, TOPK_GROUP)[0])
    chosen = np.zeros((4, E), bool)
    np.put_along_axis(chosen, experts, True, -1)
    assert np.all(np.asarray(g)[~chosen] == 0) and np.all(np.asarray(g)[chosen] != 0)


@pytest.mark.parametrize("bad,match", [
    (dict(moe_n_group=3), "must be >= 1 and divide"),
    (dict(moe_n_group=4, moe_topk_group=5), "lie in"),
    (dict(moe_n_group=8, moe_topk_group=2, experts_per_token=2), "at least 2"),
    (dict(moe_n_group=4, moe_topk_group=1, experts_per_token=3), "exceeds"),
    (dict(moe_routed_scaling_factor=0.0), "must be positive"),
])
def test_bad_group_settings_are_refused(bad, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**{"num_experts": 8, "experts_per_token": 2, "moe_router": "sigmoid", **bad}).validate()


BASE = [
    "model.vocab_size=64", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
    "model.num_kv_heads=2", "model.head_dim=8", "model.mlp_dim=64", "model.attention=xla",
    "model.num_experts=8", "model.experts_per_token=3", "model.moe_mlp_dim=32", "model.moe_router=sigmoid",
    "model.moe_n_group=4", "model.moe_topk_group=2", "model.moe_routed_scaling_factor=2.5",
    "model.router_bias_update_rate=0.01", "model.capacity_factor=0", "model.moe_aux_loss=0.01",
    "data.seq_len=16", "data.global_batch_size=16", "train.steps=1", "optim.warmup_steps=0",
    "optim.learning_rate=1e-3", "checkpoint.compilation_cache_dir=null",
]


def one_step(layout: list[str]) -> tuple[dict, dict, dict]:
    """(metrics, gradients, state after one step) of the first batch on all 8 devices."""
    trainer = Trainer(load_config(None, BASE + layout), write_files=False, devices=jax.devices())
    first = next(type(trainer.data)(trainer.cfg, 0, 1))
    batch = global_batch({k: first[k] for k in BATCH_KEYS}, trainer.mesh, trainer.rules)
    state, metrics, grads = trainer.layout.jit_train_step(return_grads=True)(
        trainer.state, batch, trainer.layout.chaos_factor())
    return jax.device_get(metrics), jax.device_get(grads), jax.device_get({"params": state["params"],
                                                                            "moe": state["moe"]})


def test_grouped_routing_expert4_data2_equals_data8():
    m8, g8, s8 = one_step(["mesh.data=8"])
    m42, g42, s42 = one_step(["mesh.data=2", "mesh.expert=4"])
    for key in ("loss", "grad_norm", "moe_aux_loss", "moe_max_load"):
        assert abs(m42[key] - m8[key]) <= 1e-5 * abs(m8[key]), key
    assert_trees_close(g42, g8, 1e-5, "gradient ")
    assert_trees_close(s42, s8, 1e-5, "after one step ")
    assert np.any(s8["moe"]["router_bias"] != 0)  # the balancing moved the bias the groups are scored with
