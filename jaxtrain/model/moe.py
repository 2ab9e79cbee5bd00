"""Mixture-of-experts MLP: a router, routed SwiGLU experts, optional always-on shared experts.

Shape suffixes as in llama.py, plus E experts, k experts per token, F each expert's hidden size.

Routing (`route`), in fp32 whatever the compute dtype:
- `softmax` (Mixtral): probabilities softmax(logits); the top-k are chosen on probabilities + bias
  and, for k > 1, renormalised over the chosen k (for k = 1 the gate is the raw probability, as in
  Switch, so the task loss still reaches the router). With `model.moe_norm_topk_prob=false`
  (Qwen3-MoE's `norm_topk_prob: false`) the gates are the chosen probabilities as they are.
- `sigmoid` (DeepSeek-V3): scores sigmoid(logits); the top-k are chosen on scores + bias; the gates
  are the chosen scores over their sum.
- Either router: with `model.moe_n_group` > 1 the choice is group-limited (DeepSeek-V3: only the
  experts of the `moe_topk_group` best groups, a group scored by its two best scores + bias), and
  the gates are multiplied by `model.moe_routed_scaling_factor` (DeepSeek-V3: 2.5).
The routing bias (`[E]` per layer, the train state's `moe.router_bias`, not a parameter) only
chooses experts: it never weights an output, so no gradient reaches it; the train step moves it by
`model.router_bias_update_rate` x sign(mean load - load) (DeepSeek-V3's aux-loss-free balancing).

Each layer returns statistics beside its output (`stats`), as sums over its tokens: the load per
expert, the routing probabilities, logsumexp(logits)**2, and the dropped assignments. From them
`finish_stats` forms the Switch load-balancing term E * sum_i f_i P_i (f_i: the fraction of the
T x k assignments sent to expert i, P_i: its mean routing probability; 1 at perfect balance) and
the router z-loss mean(logsumexp(logits)**2). They are taken over the whole batch (global f_i and
P_i), so they do not depend on how the batch is split over devices, nor, under a pipeline, into
microbatches.

The dispatch itself (capacity-padded or dropless, with or without expert parallelism) lives in
`jaxtrain.parallel.experts`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.config import ModelConfig
from jaxtrain.model.projection import project
from jaxtrain.parallel.experts import routed_experts, swiglu_product
from jaxtrain.parallel.sharding import Partitioning


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple, std: float) -> nnx.Param:
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) * std, out_sharding=names)


def expert_dim(cfg: ModelConfig) -> int:
    """Each routed expert's SwiGLU hidden size."""
    return cfg.moe_mlp_dim or cfg.mlp_dim


def route(logits_TE: jax.Array, bias_E: jax.Array, k: int, router: str, norm_topk: bool = True,
          n_group: int = 1, topk_group: int = 1,
          scaling: float = 1.0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(experts [..., k] int32, gates [..., k] fp32, probabilities [..., E] fp32) from fp32 logits.

    The probabilities are what the load-balancing loss's P_i averages (sigmoid scores normalised
    over the experts for `sigmoid`). `norm_topk` (softmax, k > 1): renormalise the chosen k.
    `n_group` > 1 (DeepSeek-V3's group-limited routing, transformers' DeepseekV3TopkRouter): the
    E experts split into n_group contiguous groups, each scored by the sum of its two best choice
    scores (score + bias); the k experts are chosen among the `topk_group` best groups only.
    `scaling` (routed_scaling_factor) multiplies the gates last (1: exactly as without it).
    """
    if router == "softmax":
        probs = jax.nn.softmax(logits_TE, axis=-1)
        scores = probs
    else:
        scores = jax.nn.sigmoid(logits_TE)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    choice = jax.lax.stop_gradient(scores) + jax.lax.stop_gradient(bias_E)
    if n_group > 1:
        E = choice.shape[-1]
        grouped = choice.reshape(*choice.shape[:-1], n_group, E // n_group)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [..., n_group]
        kept = jnp.sum(jax.nn.one_hot(jax.lax.top_k(group_scores, topk_group)[1], n_group, dtype=jnp.int32),
                       axis=-2) > 0  # [..., n_group]; static shapes: a mask, not a gather of groups
        choice = jnp.where(jnp.repeat(kept, E // n_group, axis=-1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, k)
    gates = jnp.take_along_axis(scores, experts, axis=-1)
    if (router == "sigmoid" and norm_topk) or (router == "softmax" and k > 1 and norm_topk):
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    if scaling != 1.0:
        gates = gates * scaling
    return experts.astype(jnp.int32), gates, probs


def routing_stats(logits: jax.Array, experts: jax.Array, probs: jax.Array, num_experts: int) -> dict:
    """The layer's statistics as sums over every token of `logits` [..., E] (module doc).

    Sums, not means: the pipeline adds them over microbatches and stage replicas, and
    `finish_stats` then forms the load-balancing term and z-loss of the whole batch.
    """
    E = num_experts
    load_E = jnp.sum(jax.nn.one_hot(experts, E, dtype=jnp.float32), axis=tuple(range(experts.ndim)))
    return {"load": load_E, "prob_sum": jnp.sum(probs.reshape(-1, E), axis=0),
            "z_sum": jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1))),
            "tokens": jnp.float32(probs.size // E), "assigned": jnp.float32(experts.size)}


def finish_stats(stats: dict) -> dict:
    """`stats` (sums, `routing_stats`, per layer on a leading axis or not) plus the Switch term
    `balance` = E * sum_i f_i P_i and the router z-loss `z` = mean(logsumexp(logits)**2)."""
    E = stats["load"].shape[-1]
    f_E = stats["load"] / stats["assigned"][..., None]
    P_E = stats["prob_sum"] / stats["tokens"][..., None]
    return {**stats, "balance": E * jnp.sum(f_E * P_E, axis=-1), "z": stats["z_sum"] / stats["tokens"]}


class MoE(nnx.Module):
    """Routed SwiGLU experts [E, D, F] (+ shared experts): `moe(x_BLD, dtype, part, bias_E) -> (y_BLD, stats)`.

    gpt-oss: `model.mlp_bias` adds a router bias `router_b` [E] to the logits (a parameter, unlike
    the train state's routing bias) and biases to the routed experts (`b_gate`, `b_up` [E, F],
    `b_down` [E, D]; zeros at init); shared experts have none. `model.mlp_activation=clamped_swiglu`
    applies to the routed and the shared experts.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, E, F = cfg.d_model, cfg.num_experts, expert_dim(cfg)
        down_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
        self.router = _param(rngs, (D, E), ("embed", None), cfg.init_std)
        self.w_gate = _param(rngs, (E, D, F), ("experts", "embed", "moe_mlp"), cfg.init_std)
        self.w_up = _param(rngs, (E, D, F), ("experts", "embed", "moe_mlp"), cfg.init_std)
        self.w_down = _param(rngs, (E, F, D), ("experts", "moe_mlp", "embed"), down_std)
        if cfg.num_shared_experts:
            S = cfg.num_shared_experts * F
            self.shared_gate = _param(rngs, (D, S), ("embed", "mlp"), cfg.init_std)
            self.shared_up = _param(rngs, (D, S), ("embed", "mlp"), cfg.init_std)
            self.shared_down = _param(rngs, (S, D), ("mlp", "embed"), down_std)
        self.k, self.router_kind, self.num_experts = cfg.experts_per_token, cfg.moe_router, E
        self.norm_topk = cfg.moe_norm_topk_prob
        self.groups = (cfg.moe_n_group, cfg.moe_topk_group, cfg.moe_routed_scaling_factor)  # `route`'s
        self.clamp = ((cfg.swiglu_limit, cfg.swiglu_alpha) if cfg.mlp_activation == "clamped_swiglu" else None)
        if cfg.mlp_bias:
            self.router_b = nnx.Param(jnp.zeros((E,), jnp.float32), out_sharding=(None,))
            self.b_gate = nnx.Param(jnp.zeros((E, F), jnp.float32), out_sharding=("experts", "moe_mlp"))
            self.b_up = nnx.Param(jnp.zeros((E, F), jnp.float32), out_sharding=("experts", "moe_mlp"))
            self.b_down = nnx.Param(jnp.zeros((E, D), jnp.float32), out_sharding=("experts", "embed"))
        self.capacity_factor, self.shared = cfg.capacity_factor, cfg.num_shared_experts

    def __call__(self, x_BLD: jax.Array, dtype: Any, part: Partitioning, bias_E: jax.Array) -> tuple[jax.Array, dict]:
        logits_BLE = jnp.einsum("bld,de->ble", x_BLD.astype(jnp.float32), self.router[...])
        biases = None
        if hasattr(self, "router_b"):
            logits_BLE = logits_BLE + self.router_b[...]
            biases = (self.b_gate[...], self.b_up[...], self.b_down[...])
        logits_BLE = part.constrain(logits_BLE, ("batch", "length", None))
        experts_BLk, gates_BLk, probs_BLE = route(logits_BLE, bias_E, self.k, self.router_kind, self.norm_topk,
                                                  *self.groups)
        stats = routing_stats(logits_BLE, experts_BLk, probs_BLE, self.num_experts)
        y_BLD, dropped = routed_experts(x_BLD, experts_BLk, gates_BLk, self.w_gate[...], self.w_up[...],
                                        self.w_down[...], self.capacity_factor, dtype, part,
                                        biases=biases, clamp=self.clamp)
        stats["dropped"] = dropped
        if self.shared:
            gate_BLF = checkpoint_name(project("bld,df->blf", x_BLD, self.shared_gate[...], dtype), "mlpwi_0")
            up_BLF = checkpoint_name(project("bld,df->blf", x_BLD, self.shared_up[...], dtype), "mlpwi_1")
            h_BLF = part.constrain(swiglu_product(gate_BLF, up_BLF, self.clamp), ("batch", "length", "mlp"))
            y_BLD = y_BLD + checkpoint_name(project("blf,fd->bld", h_BLF, self.shared_down[...], dtype), "mlpwo")
        return y_BLD.astype(x_BLD.dtype), stats
