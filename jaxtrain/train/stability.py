"""Loss-spike statistics inside the jitted step (`spike_check`, `update_statistics`).

Running statistics of the loss and the gradient norm (an exponential moving mean and variance over
about `stability.window` steps) live in the train state (`state["stability"]`). A step whose loss
or gradient norm lies more than `stability.spike_threshold` standard deviations above the mean is
a spike; with `stability.skip_spikes` its update is not applied. Skipped and non-finite steps never
enter the statistics, and each value that does enters clipped to mean +- threshold x std
(winsorised), so one NaN or one huge outlier cannot shift the mean or inflate the variance into
hiding (or faking) the next spike. No spike is flagged before `stability.min_history` clean steps
have been seen. What the host does with the flags (events, rollback) is `rollback.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.config import Config

Statistics = dict[str, jax.Array]

_EPS = 1e-12


def init_statistics() -> Statistics:
    """Empty statistics (`count` 0: nothing seen yet)."""
    zero = jnp.float32(0.0)
    return {"loss_mean": zero, "loss_var": zero, "grad_norm_mean": zero, "grad_norm_var": zero,
            "count": jnp.int32(0), "skipped_steps": jnp.int32(0)}


def _z(stats: Statistics, name: str, x: jax.Array) -> jax.Array:
    return (x - stats[f"{name}_mean"]) / jnp.sqrt(stats[f"{name}_var"] + _EPS)


def spike_check(cfg: Config, stats: Statistics, loss: jax.Array, grad_norm: jax.Array) -> dict[str, jax.Array]:
    """{"spike", "loss_z", "grad_norm_z"}: how far above their running means this step's values are."""
    s = cfg.stability
    loss_z, grad_norm_z = _z(stats, "loss", loss), _z(stats, "grad_norm", grad_norm)
    ready = stats["count"] >= s.min_history
    spike = ready & ((loss_z > s.spike_threshold) | (grad_norm_z > s.spike_threshold))
    return {"spike": spike, "loss_z": jnp.where(ready, loss_z, 0.0), "grad_norm_z": jnp.where(ready, grad_norm_z, 0.0)}


def update_statistics(cfg: Config, stats: Statistics, loss: jax.Array, grad_norm: jax.Array,
                      accepted: jax.Array) -> Statistics:
    """The statistics after a step; unchanged (bitwise) unless `accepted` (applied and finite)."""
    s = cfg.stability
    count = stats["count"]
    # A plain running mean while the history is short, then an EMA over ~window steps.
    alpha = jnp.maximum(2.0 / (s.window + 1), 1.0 / (count + 1).astype(jnp.float32))
    ready = count >= s.min_history
    new = dict(stats)
    for name, x in (("loss", loss), ("grad_norm", grad_norm)):
        mean, var = stats[f"{name}_mean"], stats[f"{name}_var"]
        band = s.spike_threshold * jnp.sqrt(var + _EPS)
        x = jnp.where(ready, jnp.clip(x, mean - band, mean + band), x)  # an outlier moves them a bounded step
        delta = x - mean
        new[f"{name}_mean"] = jnp.where(accepted, mean + alpha * delta, mean)
        new[f"{name}_var"] = jnp.where(accepted, (1.0 - alpha) * (var + alpha * delta * delta), var)
    new["count"] = jnp.where(accepted, count + 1, count)
    new["skipped_steps"] = jnp.where(accepted, stats["skipped_steps"], stats["skipped_steps"] + 1)
    return new
