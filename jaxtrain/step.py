"""The train step: one pure function `train_step(state, batch) -> (state, metrics)`.

State is a plain pytree `{"step", "params", "opt_state", "rng"}`; params are the model's pure
dict (the NNX graph is split once, outside the step, and merged inside it). The trainer jits the
step once with explicit in/out shardings and donates the state. Metrics come back as device
scalars; the host reads them later without stalling the next step.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxtrain.config import Config
from jaxtrain.sharding import Rules, constrain, use_rules

BATCH_KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")
Batch = dict[str, jax.Array]  # the BATCH_KEYS, each [B, L]
State = dict[str, Any]


def learning_rate_schedule(cfg: Config) -> optax.Schedule:
    """Linear warmup to optim.learning_rate, then cosine decay to min_lr_ratio at train.steps."""
    o = cfg.optim
    warmup = min(o.warmup_steps, cfg.train.steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.learning_rate, warmup_steps=warmup,
        decay_steps=max(cfg.train.steps, warmup + 1), end_value=o.learning_rate * o.min_lr_ratio)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW; no weight decay on norm scales (1-D per layer)."""
    o = cfg.optim

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: not any("norm" in str(getattr(k, "key", "")) for k in path), params)

    parts = [optax.clip_by_global_norm(o.grad_clip_norm)] if o.grad_clip_norm > 0 else []
    parts.append(optax.adamw(learning_rate_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps,
                             weight_decay=o.weight_decay, mask=decay_mask))
    return optax.chain(*parts)


def compute_dtype(cfg: Config) -> Any:
    return {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}[cfg.precision.policy]


def token_losses(logits_BLV: jax.Array, targets_BL: jax.Array) -> jax.Array:
    """Per-token cross-entropy in fp32."""
    logits_BLV = logits_BLV.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL)


def loss_sum(params: Any, graphdef: nnx.GraphDef, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """(sum of masked token losses, number of counted tokens) for one (micro)batch."""
    model = nnx.merge(graphdef, params)
    logits = model(batch["tokens"], batch["positions"], batch["segment_ids"])
    mask = batch["loss_mask"].astype(jnp.float32)
    return jnp.sum(token_losses(logits, batch["targets"]) * mask), jnp.sum(mask)


def split_microbatches(batch: Batch, n: int) -> Batch:
    """[B, L] -> [n, B/n, L], microbatch j taking rows j, j+n, j+2n, ...

    Strided rows keep every microbatch spread over all data-parallel devices, so the reshape
    moves no data between devices (each device's contiguous rows split evenly n ways).
    """
    def one(x):
        B = x.shape[0]
        x = x.reshape(B // n, n, *x.shape[1:]).swapaxes(0, 1)
        return constrain(x, (None, "batch", "length"))
    return {k: one(v) for k, v in batch.items()}


def advance_rng(rng: jax.Array, step: jax.Array) -> jax.Array:
    """The next step's RNG key data: this step's key folded with the step number.

    Randomness inside a step (dropout, ...) draws from the key it was given; the state carries
    the advanced key, so a resumed run continues the same stream bitwise.
    """
    return jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(rng), step))


def make_train_step(cfg: Config, graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                    mesh: Mesh | None = None, rules: Rules | None = None,
                    return_grads: bool = False) -> Callable[[State, Batch], tuple[State, dict]]:
    """Build the pure train step (not yet jitted: the trainer adds shardings and donation).

    Loss is the mean over all counted tokens of the global batch, however it is split into
    `train.grad_accum` microbatches, so accumulation equals one big batch. With `return_grads`
    the step returns (state, metrics, grads): the very gradients it applied, for tests that
    compare layouts and kernels on what the step computes rather than on a separate function.
    """
    schedule = learning_rate_schedule(cfg)
    accum = cfg.train.grad_accum
    grad_fn = jax.value_and_grad(loss_sum, has_aux=True)

    def step(state: State, batch: Batch) -> tuple[State, dict]:
        params = state["params"]
        if accum == 1:
            (loss_total, tokens), grads = grad_fn(params, graphdef, batch)
        else:
            def micro(carry, mb):
                (l, n), g = grad_fn(params, graphdef, mb)
                loss_acc, tok_acc, grad_acc = carry
                return (loss_acc + l, tok_acc + n, jax.tree_util.tree_map(jnp.add, grad_acc, g)), None

            zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
            (loss_total, tokens, grads), _ = jax.lax.scan(
                micro, (jnp.float32(0), jnp.float32(0), zeros), split_microbatches(batch, accum))
        denom = jnp.maximum(tokens, 1.0)
        grads = jax.tree_util.tree_map(lambda g: g / denom, grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        new_state = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates),
                     "opt_state": opt_state, "rng": advance_rng(state["rng"], state["step"])}
        metrics = {"loss": loss_total / denom, "grad_norm": optax.tree.norm(grads),
                   "learning_rate": schedule(state["step"]), "tokens": tokens,
                   "loss_scale": jnp.float32(1.0), "skipped": jnp.bool_(False)}
        return (new_state, metrics, grads) if return_grads else (new_state, metrics)

    if mesh is None:
        return step

    def step_with_rules(state: State, batch: Batch):
        with use_rules(mesh, rules):
            return step(state, batch)
    return step_with_rules


def make_eval_step(graphdef: nnx.GraphDef, mesh: Mesh | None = None,
                   rules: Rules | None = None) -> Callable[[Any, Batch], tuple[jax.Array, jax.Array]]:
    """(params, batch) -> (loss sum, token count) without gradients."""
    def eval_step(params, batch):
        if mesh is None:
            return loss_sum(params, graphdef, batch)
        with use_rules(mesh, rules):
            return loss_sum(params, graphdef, batch)
    return eval_step
