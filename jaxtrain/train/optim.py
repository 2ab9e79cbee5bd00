"""The optimizer and its learning-rate schedule: global-norm clipping then AdamW, linear warmup
then cosine decay, and the rate an update actually used (`applied_learning_rate`).

The optimizer's `update` takes a `skip` keyword (the train step's guard): a skipped step returns
the old state, bitwise, and updates that the step discards. The state's tree is optax's adamw's.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxtrain.config import Config


def schedule_steps(cfg: Config) -> tuple[int, int]:
    """(warmup steps, total steps) of the learning-rate schedule: optim.decay_steps long, or
    train.steps when that is unset. Past its end the rate stays at its final value."""
    o = cfg.optim
    total = o.decay_steps if o.decay_steps is not None else cfg.train.steps
    warmup = min(o.warmup_steps, total)
    return warmup, max(total, warmup + 1)


def learning_rate_schedule(cfg: Config) -> optax.Schedule:
    """Linear warmup to optim.learning_rate, then cosine decay to min_lr_ratio at optim.decay_steps
    (default train.steps)."""
    o = cfg.optim
    warmup, total = schedule_steps(cfg)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.learning_rate, warmup_steps=warmup,
        decay_steps=total, end_value=o.learning_rate * o.min_lr_ratio)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW; no weight decay on norm scales (1-D per layer)."""
    o = cfg.optim

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: not any("norm" in str(getattr(k, "key", "")) for k in path), params)

    parts = [clip_by_global_norm(o.grad_clip_norm)] if o.grad_clip_norm > 0 else []
    # optax.adamw's own chain (so its state tree, and checkpoints, stay the same), with the Adam
    # moments and the schedule's count kept on a skipped step.
    parts.append(optax.chain(
        guarded_adam(o.b1, o.b2, o.eps),
        optax.add_decayed_weights(o.weight_decay, decay_mask),
        kept_on_skip(optax.scale_by_learning_rate(learning_rate_schedule(cfg)))))
    return _guarded(optax.chain(*parts))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """optax.clip_by_global_norm's effect and state (EmptyState), as one scalar factor.

    Every gradient is multiplied by min(1, max_norm / norm): bitwise the gradient when it is not
    clipped. optax selects per element between the gradient and `g / norm * max_norm`, which keeps
    both alive into the Adam update: on jax 0.12's XLA that is one more gradient-sized buffer per
    large parameter at the step's peak (docs/memory.md).
    """
    def update(updates, state, params=None):
        del params
        norm = optax.global_norm(updates)
        factor = jnp.minimum(1.0, max_norm / norm)  # a zero norm gives inf, so 1
        return jax.tree_util.tree_map(lambda g: g * factor.astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


# The update functions of optimizers whose `update(..., skip=True)` keeps their state (make_optimizer's).
_KEEPS_STATE_ON_SKIP: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _guarded(tx: optax.GradientTransformationExtraArgs) -> optax.GradientTransformationExtraArgs:
    _KEEPS_STATE_ON_SKIP.add(tx.update)
    return tx


def keeps_state_on_skip(tx: optax.GradientTransformation) -> bool:
    """True for optimizers (`make_optimizer`'s) whose `update(..., skip=True)` returns the old state
    bitwise; any other optimizer ignores `skip`, and the step must select its state itself."""
    return tx.update in _KEEPS_STATE_ON_SKIP


def _keep(skip: jax.Array | bool, new: Any, old: Any) -> Any:
    """`old` where `skip`, else `new`, leaf by leaf (bitwise: a selection, not arithmetic)."""
    return jax.tree_util.tree_map(lambda n, o: jnp.where(skip, o, n), new, old)


def kept_on_skip(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """`tx` whose state stays as it was when `update(..., skip=True)` (for small states: counts)."""
    def update(updates, state, params=None, *, skip: jax.Array | bool = False, **extra):
        updates, new_state = tx.update(updates, state, params)
        return updates, _keep(skip, new_state, state)
    return optax.GradientTransformationExtraArgs(tx.init, update)


def guarded_adam(b1: float, b2: float, eps: float) -> optax.GradientTransformationExtraArgs:
    """optax.scale_by_adam (same state, same arithmetic) whose moments stay as they were on
    `update(..., skip=True)`.

    The moments are selected first and the updates computed from the *selected* moments (equal to
    the new ones unless skipped; the step discards a skipped step's updates). Selecting afterwards,
    `where(skip, old, new)` over optax's state, leaves two readers of each old moment (the new
    moment, written in place into the donated buffer, and the update): XLA then copies every large
    moment first (docs/memory.md). Here each moment is read once, by its own fused select.
    """
    inner = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)

    def update(updates, state, params=None, *, skip: jax.Array | bool = False, **extra):
        _, new = inner.update(updates, state, params)  # only its state is used
        kept = optax.ScaleByAdamState(count=_keep(skip, new.count, state.count), mu=_keep(skip, new.mu, state.mu),
                                      nu=_keep(skip, new.nu, state.nu))
        # optax.scale_by_adam's update, from the kept moments and count.
        mu_hat = optax.tree.bias_correction(kept.mu, b1, kept.count)
        nu_hat = optax.tree.bias_correction(kept.nu, b2, kept.count)
        out = jax.tree_util.tree_map(lambda m, v: m / (jnp.sqrt(v + 0.0) + eps), mu_hat, nu_hat)
        return out, kept

    return optax.GradientTransformationExtraArgs(inner.init, update)


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
