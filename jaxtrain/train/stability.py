"""Loss-spike statistics inside the jitted step (`spike_check`, `update_statistics`).

Robust statistics of the loss and of the gradient norm live in the train state
(`state["stability"]`): a ring buffer of each value over the last `stability.window` accepted
steps, from which every step takes the median and the MAD (median absolute deviation from the
median; sigma = 1.4826 x MAD, the standard deviation for normal noise).

A spike is a rise of the LOSS: more than `stability.spike_threshold` sigmas above the median AND
more than `stability.min_rise` (a fraction) above it. The gradient norm's z-score is computed and
reported (`grad_norm_z`) but never flags a spike on its own: in healthy training it rises for
hundreds of steps while the loss falls (warmup, the first descent), at 7-13 sigmas of its own
recent history on real text (measured: docs/numerics.md), and a gradient-norm jump without a loss
rise costs nothing that clipping does not already bound. The relative floor keeps a plateau's
tiny spread from turning ordinary batch-to-batch noise into "6 sigmas". The test is one-sided: a
falling loss is progress. With `stability.skip_spikes` a spike's update is not applied. Only
accepted steps (applied and finite) enter the buffer, and an outlier that does enter (skip_spikes
off) moves a median by at most one rank, so one NaN or one huge value can neither hide nor fake
the next spike. No spike is flagged before `stability.min_history` values are in.

A genuine level shift (the loss settles higher and stays there) would make every later step a
spike, and with skip_spikes the statistics would never see the new level: the run would stop
learning for good. So after `stability.rebaseline_after` spikes in a row the buffer starts again
from the current value (re-baseline; the host logs `spike_rebaseline`, `rollback.SpikeGuard`).
What the host does with the flags (events, rollback) is `rollback.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.config import Config, StabilityConfig

Statistics = dict[str, jax.Array]

SIGMA_PER_MAD = 1.4826  # 1 / Phi^-1(3/4): sigma of normal noise from its MAD
MIN_SIGMA = 1e-6  # a floor for sigma, so a run of identical values does not make every change a spike
SERIES = ("loss", "grad_norm")


def init_statistics(window: int = StabilityConfig.window) -> Statistics:
    """Empty statistics: `window`-long history buffers of which the first `count` slots hold values.
    (Empty slots hold 0, not NaN: a state with a NaN in it is never checkpointed.)"""
    empty = {f"{name}_history": jnp.zeros((window,), jnp.float32) for name in SERIES}
    return {**empty, "count": jnp.int32(0), "spike_run": jnp.int32(0), "skipped_steps": jnp.int32(0)}


def robust_median_sigma(history: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(median, 1.4826 x MAD) over the filled slots of `history` (the first `count`, or all once
    count >= its length); NaN when none is filled. Sigma is floored at MIN_SIGMA."""
    values = jnp.where(jnp.arange(history.shape[0]) < count, history, jnp.nan)  # nanmedian skips the empty
    median = jnp.nanmedian(values)
    mad = jnp.nanmedian(jnp.abs(values - median))
    return median, jnp.maximum(SIGMA_PER_MAD * mad, MIN_SIGMA)


def robust_z(history: jax.Array, count: jax.Array, x: jax.Array) -> jax.Array:
    """(x - median) / (1.4826 x MAD) over the filled slots of `history`; NaN when none is filled."""
    median, sigma = robust_median_sigma(history, count)
    return (x - median) / sigma


def spike_check(cfg: Config, stats: Statistics, loss: jax.Array, grad_norm: jax.Array) -> dict[str, jax.Array]:
    """{"spike", "loss_z", "grad_norm_z", "loss_rise"}: how many robust sigmas above the median this
    step's values are, and the loss's rise over its median as a fraction of it. Only the loss flags."""
    s = cfg.stability
    median, sigma = robust_median_sigma(stats["loss_history"], stats["count"])
    loss_z = (loss - median) / sigma
    loss_rise = (loss - median) / jnp.maximum(jnp.abs(median), MIN_SIGMA)
    grad_norm_z = robust_z(stats["grad_norm_history"], stats["count"], grad_norm)
    ready = stats["count"] >= s.history_needed
    spike = ready & (loss_z > s.spike_threshold) & (loss_rise > s.min_rise)
    return {"spike": spike, "loss_z": jnp.where(ready, loss_z, 0.0), "grad_norm_z": jnp.where(ready, grad_norm_z, 0.0),
            "loss_rise": jnp.where(ready, loss_rise, 0.0)}


def update_statistics(cfg: Config, stats: Statistics, loss: jax.Array, grad_norm: jax.Array,
                      accepted: jax.Array) -> Statistics:
    """The statistics after a step. An accepted step (applied and finite) enters the buffers; any other
    step leaves them unchanged (bitwise), except the re-baseline after `rebaseline_after` spikes in a
    row, which empties them and lets this step's (finite) values in as the first of the new level."""
    s = cfg.stability
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    spike = finite & spike_check(cfg, stats, loss, grad_norm)["spike"]  # what the step flagged
    # Spikes in a row: a clean finite step ends the run, a non-finite one (no value seen) does not.
    run = jnp.where(spike, stats["spike_run"] + 1, jnp.where(finite, 0, stats["spike_run"]))
    rebaseline = run >= s.rebaseline_after
    count = stats["count"]
    enter = accepted | rebaseline
    slot = jnp.where(rebaseline, 0, count % s.window)  # the oldest value's slot once the buffer is full
    new = dict(stats)
    for name, x in zip(SERIES, (loss, grad_norm)):
        history = stats[f"{name}_history"]
        start = jnp.where(rebaseline, jnp.zeros_like(history), history)
        new[f"{name}_history"] = jnp.where(enter, start.at[slot].set(x), history)
    new["count"] = jnp.where(rebaseline, 1, jnp.where(accepted, count + 1, count))
    new["spike_run"] = jnp.where(rebaseline, 0, run)
    new["skipped_steps"] = jnp.where(accepted, stats["skipped_steps"], stats["skipped_steps"] + 1)
    return new
