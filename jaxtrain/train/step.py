"""The train step: one pure function `train_step(state, batch) -> (state, metrics)`.

State is a plain pytree `{"step", "params", "opt_state", "rng", "loss_scale", "stability"}` (see
`jaxtrain.train.state`); params are the model's pure dict (the NNX graph is split once, outside the step,
and merged inside it). The trainer jits the step once with explicit in/out shardings and donates
the state. Metrics come back as device scalars; the host reads them later without stalling the
next step.

Inside the one step, with no extra host synchronisation: loss scaling (fp16, `precision.py`), the
guard that skips a step with non-finite gradients by keeping the old state, and spike detection
with optional skipping (`stability.py`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxtrain.parallel import pipeline
from jaxtrain.config import Config
from jaxtrain.model.loss import fused_loss
from jaxtrain.train.precision import update_loss_scale
from jaxtrain.parallel.sharding import Rules, constrain, use_rules
from jaxtrain.train.stability import spike_check, update_statistics

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


def applied_learning_rate(schedule: optax.Schedule, opt_state: Any) -> jax.Array:
    """The learning rate this step's update uses: the schedule at the optimizer's own count.

    optax's schedule (`ScaleByScheduleState.count`) counts applied updates, not train steps: a
    skipped step keeps the old optimizer state, count included, so after k skipped steps step N
    uses schedule(N - 1 - k), not schedule(N - 1). Reporting the train step's value would show a
    rate that no update used.

    Raises:
      ValueError: the optimizer state holds no schedule count, or more than one.
    """
    is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)
    counts = [s.count for s in jax.tree_util.tree_leaves(opt_state, is_leaf=is_schedule) if is_schedule(s)]
    if len(counts) != 1:
        raise ValueError(f"expected one ScaleByScheduleState in the optimizer state, found {len(counts)}")
    return schedule(counts[0])


def token_losses(logits_BLV: jax.Array, targets_BL: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token cross-entropy and log-partition (logsumexp of the logits), both in fp32.

    The plain loss on materialised logits: the reference that `jaxtrain.model.loss.fused_loss` (what the
    step uses) is tested against.
    """
    logits_BLV = logits_BLV.astype(jnp.float32)
    lse_BL = jax.nn.logsumexp(logits_BLV, axis=-1)
    target_logit_BL = jnp.take_along_axis(logits_BLV, targets_BL[..., None], axis=-1)[..., 0]
    return lse_BL - target_logit_BL, lse_BL


def loss_sum(params: Any, graphdef: nnx.GraphDef, batch: Batch,
             z_loss: float = 0.0) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    """(objective sum, (cross-entropy sum, z-loss sum, counted tokens)) for one (micro)batch.

    The objective is the cross-entropy plus `z_loss` x logsumexp(logits)**2 (PaLM's z-loss, which
    keeps the log-partition near 0 and the softmax well conditioned), summed over counted tokens.
    The head and the loss run fused and chunked (`jaxtrain.model.loss.fused_loss`): the full [B, L, V]
    logits and their gradient are never materialised.
    """
    model = nnx.merge(graphdef, params)
    x_BLD = model.hidden(batch["tokens"], batch["positions"], batch["segment_ids"])
    mask = batch["loss_mask"].astype(jnp.float32)
    objective, ce, z = fused_loss(x_BLD, model.head_weight(), batch["targets"], mask, z_loss)
    return objective, (ce, z, jnp.sum(mask))


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
    z_loss, guard = cfg.stability.z_loss, cfg.stability.guard

    def scaled_loss(params, batch, scale, inject):
        objective, aux = loss_sum(params, graphdef, batch, z_loss)
        # The loss scale (fp16) and the chaos drill's factor multiply what is differentiated.
        return objective * scale * inject, aux

    grad_fn = jax.value_and_grad(scaled_loss, has_aux=True)

    def step(state: State, batch: Batch):
        params = state["params"]
        batch = dict(batch)
        inject = batch.pop("chaos", jnp.float32(1.0))  # chaos.nan_at_steps / spike_at_steps; 1 otherwise
        scale = state["loss_scale"]["scale"]
        if accum == 1:
            (_, (ce, z, tokens)), grads = grad_fn(params, batch, scale, inject)
        else:
            def micro(carry, mb):
                (_, (c, zz, n)), g = grad_fn(params, mb, scale, inject)
                ce_acc, z_acc, tok_acc, grad_acc = carry
                return (ce_acc + c, z_acc + zz, tok_acc + n, jax.tree_util.tree_map(jnp.add, grad_acc, g)), None

            zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
            (ce, z, tokens, grads), _ = jax.lax.scan(
                micro, (jnp.float32(0), jnp.float32(0), jnp.float32(0), zeros), split_microbatches(batch, accum))
        denom = jnp.maximum(tokens, 1.0)
        grads = jax.tree_util.tree_map(lambda g: g / (scale * denom), grads)
        loss = ce * inject / denom  # what a drill injected shows in the loss too
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        stats = state["stability"]
        spike = spike_check(cfg, stats, loss, grad_norm)
        spike_flag = finite & spike["spike"]
        skip = ~finite | (spike_flag if cfg.stability.skip_spikes else False)
        if not guard:  # stability.guard=false: only to measure what the guard costs (bench/)
            spike_flag, skip = jnp.bool_(False), jnp.bool_(False)

        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        # A skipped step keeps the old parameters and optimizer state by selection: multiplying the
        # update by zero would not do (0 x NaN is NaN).
        keep = lambda new, old: jax.tree_util.tree_map(lambda n, o: jnp.where(skip, o, n), new, old)
        new_state = {"step": state["step"] + 1, "params": keep(new_params, params) if guard else new_params,
                     "opt_state": keep(opt_state, state["opt_state"]) if guard else opt_state,
                     "rng": advance_rng(state["rng"], state["step"]),
                     "loss_scale": update_loss_scale(cfg, state["loss_scale"], finite),
                     "stability": update_statistics(cfg, stats, loss, grad_norm, ~skip) if guard else stats}
        # The rate this update used (the optimizer's count, which skipped steps do not advance).
        learning_rate = applied_learning_rate(schedule, state["opt_state"])
        metrics = {"loss": loss, "grad_norm": grad_norm, "learning_rate": learning_rate, "tokens": tokens,
                   "loss_scale": scale, "next_loss_scale": new_state["loss_scale"]["scale"],
                   "skipped": skip, "nonfinite": ~finite, "spike": spike_flag, "loss_z": spike["loss_z"],
                   "grad_norm_z": spike["grad_norm_z"], "z_loss": z / denom,
                   "skipped_steps": new_state["stability"]["skipped_steps"]}
        return (new_state, metrics, grads) if return_grads else (new_state, metrics)

    if mesh is None:
        return step
    stages = pipeline.schedule_for(cfg, dict(mesh.shape))  # None unless mesh.stage > 1

    def step_with_rules(state: State, batch: Batch):
        with use_rules(mesh, rules), pipeline.use_schedule(stages):
            return step(state, batch)
    return step_with_rules


def make_eval_step(graphdef: nnx.GraphDef, mesh: Mesh | None = None, rules: Rules | None = None,
                   stages: pipeline.Schedule | None = None) -> Callable[[Any, Batch], tuple[jax.Array, jax.Array]]:
    """(params, batch) -> (loss sum, token count) without gradients.

    `stages`: the pipeline schedule when mesh.stage > 1 (`pipeline.schedule_for(cfg, mesh.shape)`);
    without it the layers still compute the same loss, as one scan over stage-sharded weights.
    """
    def eval_step(params, batch):
        if mesh is None:
            _, (ce, _, tokens) = loss_sum(params, graphdef, batch)
            return ce, tokens
        with use_rules(mesh, rules), pipeline.use_schedule(stages):
            _, (ce, _, tokens) = loss_sum(params, graphdef, batch)
            return ce, tokens
    return eval_step
