"""The MoE layer (jaxtrain/model/moe.py, jaxtrain/parallel/experts.py) against independent references:
a per-expert loop in float64 numpy (forward; gradients by float64 central differences), hand-made
routing for the capacity drop, hand-computed aux and z losses, and the routing bias's balancing."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.config import ConfigError, ModelConfig, load_config
from jaxtrain.model.moe import MoE, finish_stats, route, routing_stats
from jaxtrain.parallel.experts import routed_experts
from jaxtrain.train.step import moe_losses, update_router_bias
from jaxtrain.trainer import Trainer

D, F, E = 8, 6, 4


def layer_cfg(**kw) -> ModelConfig:
    base = dict(d_model=D, num_layers=2, num_experts=E, experts_per_token=2, moe_mlp_dim=F, init_std=0.5)
    return ModelConfig(**{**base, **kw})


def silu(x):
    return x / (1 + np.exp(-x))


def reference(p: dict, x: np.ndarray, bias: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Route, run each expert on its tokens, combine: float64 numpy, one expert at a time."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    T = x.reshape(-1, x.shape[-1]).astype(np.float64)
    logits = T @ p["router"]
    if cfg.moe_router == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    k = cfg.experts_per_token
    chosen = np.argsort(-(scores + bias), axis=-1, kind="stable")[:, :k]
    gates = np.take_along_axis(scores, chosen, -1)
    if cfg.moe_router == "sigmoid" or (k > 1 and cfg.moe_norm_topk_prob):
        gates = gates / gates.sum(-1, keepdims=True)
    y = np.zeros_like(T)
    for e in range(cfg.num_experts):
        tok, slot = np.nonzero(chosen == e)
        h = silu(T[tok] @ p["w_gate"][e]) * (T[tok] @ p["w_up"][e])
        y[tok] += gates[tok, slot][:, None] * (h @ p["w_down"][e])
    if cfg.num_shared_experts:
        y += (silu(T @ p["shared_gate"]) * (T @ p["shared_up"])) @ p["shared_down"]
    return y.reshape(x.shape)


CASES = {
    "top1": dict(experts_per_token=1),
    "top2": dict(),
    "top2_not_renormalised": dict(moe_norm_topk_prob=False),  # Qwen3-MoE's norm_topk_prob: false
    "top2_shared": dict(num_shared_experts=2),
    "top2_sigmoid_bias": dict(moe_router="sigmoid"),
    "top2_capacity_nodrop": dict(capacity_factor=float(E)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_matches_float64_per_expert_loop(case):
    cfg = layer_cfg(**CASES[case])
    moe = MoE(cfg, nnx.Rngs(1))
    graphdef, state = nnx.split(moe)
    params = nnx.to_pure_dict(state)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, D)).astype(np.float32)
    r = rng.normal(size=x.shape)  # the cotangent: f = sum(y * r)
    bias = (rng.normal(size=E) * 0.1 if cfg.moe_router == "sigmoid" else np.zeros(E)).astype(np.float32)

    def f(p, x):
        y, _ = nnx.merge(graphdef, p)(x, jnp.float32, nnx_part(), jnp.asarray(bias))
        return jnp.sum(y * r.astype(np.float32)), y

    (_, y), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(params, jnp.asarray(x))
    want = reference(params, x, bias, cfg)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())

    # Gradients: the directional derivative along a random direction, per parameter and for x,
    # against float64 central differences of the reference.
    g_params, g_x = grads
    leaves = dict(params, x=x)
    g_leaves = dict(g_params, x=g_x)
    for name, value in leaves.items():
        v = rng.normal(size=np.shape(value))
        eps = 1e-6

        def at(t):
            moved = {k: np.asarray(a, np.float64) for k, a in leaves.items()}
            moved[name] = moved[name] + t * v
            xx = moved.pop("x")
            return np.sum(reference(moved, xx, bias.astype(np.float64), cfg) * r)

        fd = (at(eps) - at(-eps)) / (2 * eps)
        got = float(np.sum(np.asarray(g_leaves[name], np.float64) * v))
        assert abs(got - fd) <= 1e-4 * max(abs(fd), 1e-3), (case, name, got, fd)


def nnx_part():
    from jaxtrain.parallel.sharding import Partitioning
    return Partitioning()


def identity_experts(num_experts: int, d: int):
    """Experts whose SwiGLU output is a distinct known function of x: silu(x) * x * (e + 1)."""
    eye = np.eye(d, dtype=np.float32)
    w_gate = np.stack([eye] * num_experts)
    w_up = np.stack([eye] * num_experts)
    w_down = np.stack([eye * (e + 1) for e in range(num_experts)])
    return jnp.asarray(w_gate), jnp.asarray(w_up), jnp.asarray(w_down)


def expert_out(x, e):
    return silu(x) * x * (e + 1)


@pytest.mark.parametrize("k", [1, 2])
def test_capacity_drops_the_overflow_as_specified(k):
    """Capacity C = ceil(factor x T x k / E) per expert; first choices before second, then token order."""
    rng = np.random.default_rng(0)
    if k == 1:
        experts = np.array([[0], [0], [0], [0], [0], [1]])
        factor, kept = 1.0, {(0, 0), (1, 0), (2, 0), (5, 1)}  # C = 3: tokens 3 and 4 overflow expert 0
    else:
        experts = np.array([[0, 1], [0, 1], [0, 1], [1, 0]])
        # C = ceil(0.5 x 4 x 2 / 2) = 2. First choices: expert 0 takes tokens 0, 1 (2 dropped), expert 1
        # token 3. Second choices: expert 1 has one slot left, token 0 takes it (1, 2 dropped); expert 0 is full (3 dropped).
        factor, kept = 0.5, {(0, 0), (1, 0), (3, 1), (0, 1)}
    T = experts.shape[0]
    x = rng.normal(size=(1, T, 4)).astype(np.float32)
    gates = rng.uniform(0.2, 1.0, size=(1, T, k)).astype(np.float32)
    y, dropped = routed_experts(jnp.asarray(x), jnp.asarray(experts[None], jnp.int32), jnp.asarray(gates),
                                *identity_experts(2, 4), factor, jnp.float32)
    want = np.zeros((T, 4))
    for t in range(T):
        for j in range(k):
            if (t, int(experts[t, j])) in kept:
                want[t] += gates[0, t, j] * expert_out(x[0, t].astype(np.float64), experts[t, j])
    np.testing.assert_allclose(np.asarray(y)[0], want, rtol=1e-6, atol=1e-6)
    assert float(dropped) == T * k - len(kept)


def test_dropped_fraction_metric_reports_the_drop(tmp_path):
    """capacity 1 slot per expert and group: each expert keeps one of a layer's T x k assignments;
    metrics.jsonl records it beside the other MoE metrics, the start event names the dispatch."""
    import json
    cfg = load_config("configs/moe-tiny.yaml", [f"run.output_dir={tmp_path}", "checkpoint.compilation_cache_dir=null",
                                                "model.capacity_factor=0.001", "data.global_batch_size=4",
                                                "data.seq_len=16", "train.steps=1", "train.log_every=1",
                                                "checkpoint.save_at_end=false"])
    trainer = Trainer(cfg, devices=jax.devices()[:1])
    trainer.fit()
    trainer.close()
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assigned = 4 * 16 * 2
    assert record["moe_dropped_fraction"] == pytest.approx(1 - 8 / assigned, rel=1e-6)
    assert record["moe_aux_loss"] > 0 and record["router_z_loss"] > 0 and record["moe_max_load"] >= 1
    start = json.loads((tmp_path / "events.jsonl").read_text().splitlines()[0])
    assert start["kind"] == "start" and start["moe_dispatch"] == "capacity" and start["expert_parallel"] == 1


def test_aux_and_z_loss_equal_hand_computed_values_and_reach_the_router():
    logits = np.array([[2.0, 0.0, -1.0, 0.5], [0.1, 0.3, 0.2, -0.4], [-1.0, 1.5, 0.0, 0.0]], np.float32)
    experts, _, probs = route(jnp.asarray(logits), jnp.zeros(4), 2, "softmax")
    stats = finish_stats(routing_stats(jnp.asarray(logits), experts, probs, 4))
    p = np.exp(logits.astype(np.float64))
    p /= p.sum(-1, keepdims=True)
    top2 = np.argsort(-p, axis=-1)[:, :2]  # [[0, 3], [1, 2], [1, 2]]
    f = np.array([np.sum(top2 == e) for e in range(4)]) / top2.size
    balance = 4 * np.sum(f * p.mean(0))
    z = np.mean(np.log(np.exp(logits.astype(np.float64)).sum(-1)) ** 2)
    assert float(stats["balance"]) == pytest.approx(balance, rel=1e-6)
    assert float(stats["z"]) == pytest.approx(z, rel=1e-6)
    np.testing.assert_array_equal(np.asarray(stats["load"]), f * top2.size)
    cfg = load_config(None, ["model.num_experts=4", "model.moe_aux_loss=0.1", "model.router_z_loss=0.01"])
    balance_w, z_w = moe_losses(cfg, {k: v[None] for k, v in stats.items()})
    assert float(balance_w) == pytest.approx(0.1 * balance, rel=1e-6) and float(z_w) == pytest.approx(0.01 * z, rel=1e-6)

    # Their gradients reach the router's weights (through P_i and the logits; f_i has none).
    moe = MoE(layer_cfg(), nnx.Rngs(0))
    graphdef, state = nnx.split(moe)
    params = nnx.to_pure_dict(state)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, D)), jnp.float32)
    for key in ("balance", "z"):
        g = jax.grad(lambda p: finish_stats(nnx.merge(graphdef, p)(x, jnp.float32, nnx_part(), jnp.zeros(E))[1])[key])(params)
        assert np.abs(np.asarray(g["router"])).max() > 0, key
        assert np.abs(np.asarray(g["w_gate"])).max() == 0, key  # the losses see only the router


def test_router_bias_update_moves_toward_balance():
    load = jnp.array([[10.0, 2.0, 2.0, 2.0], [4.0, 4.0, 4.0, 4.0]])
    bias = update_router_bias(jnp.zeros((2, 4)), load, 0.01)
    np.testing.assert_allclose(np.asarray(bias), [[-0.01, 0.01, 0.01, 0.01], [0, 0, 0, 0]])


def test_bias_balances_a_skewed_router_outside_the_optimizer(tmp_path):
    cfg = load_config("configs/moe-tiny.yaml", [f"run.output_dir={tmp_path}", "checkpoint.compilation_cache_dir=null",
                                                "model.moe_router=sigmoid", "model.router_bias_update_rate=0.05",
                                                "model.moe_aux_loss=0", "data.global_batch_size=4",
                                                "data.seq_len=16", "train.steps=30", "train.eval_every=1000"])
    trainer = Trainer(cfg, write_files=False, devices=jax.devices()[:1])
    state = trainer.state
    assert "moe" not in state["params"] and "router_bias" not in str(jax.tree_util.tree_structure(state["opt_state"]))
    skew = np.zeros((2, 8), np.float32)
    skew[:, 0] = 1.0  # sigmoid scores lie in (0, 1): every token chooses expert 0 first
    state["moe"]["router_bias"] = jax.device_put(skew, state["moe"]["router_bias"].sharding)
    loads = [trainer.step()["moe_max_load"] for _ in range(30)]
    assert loads[0] == pytest.approx(8 / 2)  # expert 0 takes every token: E / k times the mean
    assert np.mean(loads[-10:]) < 2.5, loads  # the bias pushed expert 0 down (sign steps oscillate around balance)
    bias = np.asarray(jax.device_get(trainer.state["moe"]["router_bias"]))
    assert bias[:, 0].max() < 1.0
    steps = (bias - skew) / 0.05
    assert np.all(np.abs(steps - np.round(steps)) < 1e-4)  # it moved in steps of the rate, nothing else
    # Evaluation routes with the state's bias too: the same parameters under a zero bias choose other experts.
    with_bias = trainer.evaluate(1)
    without = trainer.evaluator.evaluate(trainer.state["params"], 1, jnp.zeros_like(trainer.state["moe"]["router_bias"]))
    assert with_bias != without


def test_bad_moe_configs_are_config_errors():
    for overrides, words in ((["model.num_experts=4", "model.experts_per_token=5"], "experts_per_token"),
                             (["model.num_experts=4", "model.num_layers=3", "model.moe_every=2"], "moe_every"),
                             (["model.num_experts=4", "model.moe_every=0"], "moe_every"),
                             (["model.num_experts=4", "model.first_dense_layers=2"], "first_dense_layers"),
                             (["model.num_experts=4", "model.num_layers=4", "model.first_dense_layers=1",
                               "model.moe_every=3", "mesh.stage=2", "pipeline.microbatches=2"],
                              "the 1 MoE layers .* not divisible by mesh.stage=2"),
                             (["mesh.expert=2"], "num_experts"),
                             (["model.num_experts=4", "model.moe_aux_loss=-1"], "moe_aux_loss")):
        with pytest.raises(ConfigError, match=words):
            load_config(None, overrides)


def test_flops_count_active_parameters():
    from jaxtrain.observe.throughput import flops_per_step
    moe = load_config("configs/moe-tiny.yaml", ["model.num_shared_experts=1"])
    # Active per MoE layer: 2 routed + 1 shared expert of 64 = a dense MLP of 192, plus the router (64 x 8).
    dense = load_config("configs/moe-tiny.yaml", ["model.num_experts=0", "model.mlp_dim=192"])
    tokens = 16 * 64
    assert flops_per_step(moe) - flops_per_step(dense) == 6 * 2 * 64 * 8 * tokens


@pytest.mark.parametrize("layers, first_dense, every, scan", [(5, 1, 2, True), (6, 0, 3, False)])
def test_interleaved_moe_layers_run_in_their_order(layers, first_dense, every, scan):
    """`moe_every=k`: after `first_dense_layers`, k - 1 dense layers then one MoE layer, repeated
    (5, 1, 2: dense, dense, MoE, dense, MoE). The model's hidden states and per-layer routing
    statistics equal running each layer's own parameters one at a time in that order."""
    from jaxtrain.model.llama import Transformer
    cfg = layer_cfg(num_layers=layers, first_dense_layers=first_dense, moe_every=every, vocab_size=32, num_heads=2,
                    num_kv_heads=1, head_dim=4, mlp_dim=12, scan_layers=scan, moe_router="sigmoid")
    model = Transformer(cfg, rngs=nnx.Rngs(3))
    groups = (layers - first_dense) // every
    assert cfg.num_moe_layers == groups
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 32, (2, 7)), jnp.int32)
    bias = jnp.asarray(rng.normal(size=(groups, E)) * 0.1, jnp.float32)
    graphdef, state = nnx.split(model)
    hidden, stats = jax.jit(lambda st: nnx.merge(graphdef, st).hidden_and_stats(tokens, router_bias=bias))(state)

    def layer(stack, i):
        graphdef, state = nnx.split(stack)
        return nnx.merge(graphdef, jax.tree_util.tree_map(lambda a: a[i], state))

    order = [("dense", i) for i in range(first_dense)]
    for g in range(groups):
        order += [("between", g * (every - 1) + j) for j in range(every - 1)] + [("moe", g)]
    assert len(order) == layers
    stacks = {"dense": getattr(model, "dense_blocks", None), "between": getattr(model, "interleaved_dense_blocks", None),
              "moe": model.blocks}
    positions = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), tokens.shape)
    x = model.embed[...][tokens]
    want_stats = []
    for kind, i in order:
        block = layer(stacks[kind], i)
        if kind == "moe":
            x, st = block(x, positions, None, jnp.float32, nnx_part(), bias[i])
            want_stats.append(finish_stats(st))
        else:
            x = block(x, positions, None, jnp.float32, nnx_part())
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(model.final_norm(x)), rtol=1e-5, atol=1e-5)
    for name in stats:
        np.testing.assert_allclose(np.asarray(stats[name]), np.stack([np.asarray(s[name]) for s in want_stats]),
                                   rtol=1e-5, atol=1e-6, err_msg=name)


def test_interleaved_layers_count_dense_flops_where_dense():
    """With moe_every=2 over 4 layers, half the layers are MoE: the active matmul parameters are the
    mean of the all-dense and the all-MoE models' (each counts the head once)."""
    from jaxtrain.model.llama import matmul_params
    base = dict(num_layers=4, vocab_size=32, mlp_dim=12)
    every2, all_moe = layer_cfg(**base, moe_every=2), layer_cfg(**base)
    dense = layer_cfg(**base, num_experts=0)
    assert 2 * matmul_params(every2) == matmul_params(all_moe) + matmul_params(dense)
    assert matmul_params(every2) not in (matmul_params(all_moe), matmul_params(dense))
