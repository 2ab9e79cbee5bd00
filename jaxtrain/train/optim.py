"""The optimizer and its learning-rate schedule: global-norm clipping then AdamW, linear warmup
then cosine decay, and the rate an update actually used (`applied_learning_rate`)."""

from __future__ import annotations

from typing import Any

import jax
import optax

from jaxtrain.config import Config


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
