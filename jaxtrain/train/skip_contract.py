"""The skip contract: an optimizer's `update(..., skip=True)` (the train step's guard: a step with
non-finite gradients, a spike) returns its old state, bitwise. The wrappers every optimizer of
`jaxtrain.train.optim` (and `jaxtrain.train.muon`) is built from, and the registry that tells the
step an optimizer keeps its own state."""

from __future__ import annotations

import weakref
from typing import Any

import jax
import jax.numpy as jnp
import optax


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
