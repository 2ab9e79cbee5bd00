"""Precision policies and dynamic loss scaling.

Policies (`precision.policy`):
- `fp32`: everything in fp32.
- `bf16`: parameters and optimizer state stay fp32 (the "master" copy); matmuls and activations
  run in bf16; norms, softmax, logits and the loss in fp32 (the model casts where it matters).
  bf16 has fp32's exponent range, so gradients cannot overflow: no loss scaling.
- `fp16`: like bf16 with float16 compute. fp16's range is 6e-8 .. 65504: small gradients underflow
  unless the loss is scaled up before the backward pass, and a scale that is too large overflows.
  The dynamic loss scaler keeps the largest scale that does not overflow: it multiplies the mean
  loss (over the global batch's counted tokens, so a scale means the same at any tokens per step)
  by `scale`, divides the gradients by it, halves it (`backoff_factor`) on a step whose gradients are
  not finite (that step is skipped by the guard in the train step) and doubles it
  (`growth_factor`) after `growth_interval` clean steps in a row, never below `min_loss_scale`.

The scaler is part of the train state (`state["loss_scale"]`), so it is checkpointed and a resumed
run continues with the same scale, bitwise.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.config import Config

LossScale = dict[str, jax.Array]  # {"scale": f32[], "good_steps": i32[]}


def compute_dtype(cfg: Config) -> Any:
    """The dtype of matmuls and activations under `precision.policy`."""
    return {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}[cfg.precision.policy]


def uses_loss_scaling(cfg: Config) -> bool:
    return cfg.precision.policy == "fp16"


def init_loss_scale(cfg: Config) -> LossScale:
    """The scaler's first state: `loss_scale_init` under fp16, a constant 1 otherwise."""
    scale = cfg.precision.loss_scale_init if uses_loss_scaling(cfg) else 1.0
    return {"scale": jnp.float32(scale), "good_steps": jnp.int32(0)}


def update_loss_scale(cfg: Config, loss_scale: LossScale, grads_finite: jax.Array) -> LossScale:
    """The scaler after a step whose (unscaled) gradients were finite or not. Pure, jittable."""
    if not uses_loss_scaling(cfg):
        return loss_scale
    p = cfg.precision
    scale, good = loss_scale["scale"], loss_scale["good_steps"]
    grown = good + 1 >= p.growth_interval
    grown_scale = scale * p.growth_factor
    # Never grow into float32 inf: an infinite scale stays infinite after backoff and skips every step.
    finite_scale = jnp.where(grown & jnp.isfinite(grown_scale), grown_scale, scale)
    finite_good = jnp.where(grown, 0, good + 1)
    backed_off = jnp.maximum(scale * p.backoff_factor, p.min_loss_scale)
    return {"scale": jnp.where(grads_finite, finite_scale, backed_off).astype(jnp.float32),
            "good_steps": jnp.where(grads_finite, finite_good, 0).astype(jnp.int32)}
