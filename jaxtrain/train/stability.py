"""Loss-spike statistics inside the jitted step (`spike_check`, `update_statistics`).

Robust statistics of the loss and of the gradient norm live in the train state
(`state["stability"]`): a ring buffer of each value over the last `stability.window` accepted
steps. A spike is a rise of the LOSS, in either of two ways (`spike_check`, `loss_levels`):
- sudden: more than `stability.spike_threshold` noise sigmas AND more than `stability.min_rise`
  (a fraction) above its current level, the median of the last LEVEL_VALUES accepted values. The
  noise is measured on successive differences (1.4826 x their median absolute value / sqrt 2), so
  the fast fall of the first hundred steps does not pass for noise and hide a jump; the relative
  floor keeps a smooth run's tiny spread from turning an ordinary wobble into "6 sigmas";
- diverging: more than `stability.divergence_rise` above the lowest level the window holds. A
  learning rate far too high makes the loss wander far above where it had got to while its noise
  grows with it, so no sigma test sees it (lr 1.0 on real text: 7 -> 12 nats at 2-5 "sigmas").
The gradient norm's z-score against its window median and MAD is computed and reported
(`grad_norm_z`) but flags nothing: in healthy training it rises for a hundred steps while the loss
falls (warmup, the first descent), 7-13 sigmas above its recent median on real text (the
new-user trial), and a gradient-norm jump without a loss rise costs nothing that clipping does not
already bound. Measured on real text (tests/train/test_spikes_on_real_text.py, docs/numerics.md):
healthy runs at lr 1e-3..1e-1, warmups 10..100 reach at most ~5.4 sigmas with a rise under 6%,
and at most 17% above the window's lowest level.

The test is one-sided: a falling loss is progress. With `stability.skip_spikes` a spike's update is
not applied. Only accepted steps (applied and finite) enter the buffer, and an outlier that does
enter (skip_spikes off) moves a median by at most one rank, so one NaN or one huge value can
neither hide nor fake the next spike. No spike is flagged before `stability.min_history` values are in.

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
LEVEL_VALUES = 10  # the loss's current level: the median of this many latest accepted values


def init_statistics(window: int = StabilityConfig.window) -> Statistics:
    """Empty statistics: `window`-long history buffers of which the first `count` slots hold values.
    (Empty slots hold 0, not NaN: a state with a NaN in it is never checkpointed.)"""
    empty = {f"{name}_history": jnp.zeros((window,), jnp.float32) for name in SERIES}
    return {**empty, "count": jnp.int32(0), "spike_run": jnp.int32(0), "skipped_steps": jnp.int32(0)}


def chronological(history: jax.Array, count: jax.Array) -> jax.Array:
    """The ring buffer's values oldest first, NaN where no value is (slots fill in order from 0, and
    once the buffer is full the oldest value sits at count % window; a re-baseline restarts at 0)."""
    window = history.shape[0]
    ordered = jnp.where(count >= window, jnp.roll(history, -(count % window)), history)
    return jnp.where(jnp.arange(window) < count, ordered, jnp.nan)


def robust_median_sigma(history: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(median, 1.4826 x MAD) over the filled slots of `history`; NaN when none is filled. Sigma is
    floored at MIN_SIGMA."""
    values = chronological(history, count)
    median = jnp.nanmedian(values)
    mad = jnp.nanmedian(jnp.abs(values - median))
    return median, jnp.maximum(SIGMA_PER_MAD * mad, MIN_SIGMA)


def robust_z(history: jax.Array, count: jax.Array, x: jax.Array) -> jax.Array:
    """(x - median) / (1.4826 x MAD) over the filled slots of `history`; NaN when none is filled."""
    median, sigma = robust_median_sigma(history, count)
    return (x - median) / sigma


def loss_levels(history: jax.Array, count: jax.Array) -> dict[str, jax.Array]:
    """What the loss history says, robust to single outliers:
      level: the loss's current level, the median of the last LEVEL_VALUES accepted values;
      lowest: the lowest such level anywhere in the window (where the run had got to);
      noise: the step-to-step noise, 1.4826 x the median |difference| of successive values / sqrt(2).
    Differences see the batch-to-batch noise, not the trend: over a window in which the loss falls
    fast (the first hundred steps), the MAD around the median measures the fall, and a jump of three
    nats at step 70 sat at 3 "sigmas" (measured on real text). NaN where too few values are in."""
    values = chronological(history, count)
    n, window = jnp.minimum(count, history.shape[0]), history.shape[0]
    index = jnp.arange(window)
    level = jnp.nanmedian(jnp.where(index >= n - LEVEL_VALUES, values, jnp.nan))
    # Sliding medians: row j holds the LEVEL_VALUES values ending at position j (NaN where any is missing).
    taps = index[:, None] - jnp.arange(LEVEL_VALUES)[None, :]
    rows = jnp.where(taps >= 0, values[jnp.clip(taps, 0, window - 1)], jnp.nan)
    full = jnp.all(~jnp.isnan(rows), axis=1)
    lowest = jnp.nanmin(jnp.where(full, jnp.nanmedian(rows, axis=1), jnp.nan))
    lowest = jnp.where(jnp.any(full), lowest, level)  # fewer values than LEVEL_VALUES: the level itself
    steps = jnp.abs(jnp.diff(values))  # NaN where either neighbour is missing
    noise = SIGMA_PER_MAD * jnp.nanmedian(steps) / jnp.sqrt(2.0)
    return {"level": level, "lowest": lowest, "noise": jnp.maximum(noise, MIN_SIGMA)}


def spike_check(cfg: Config, stats: Statistics, loss: jax.Array, grad_norm: jax.Array) -> dict[str, jax.Array]:
    """{"spike", "loss_z", "grad_norm_z", "loss_rise", "loss_divergence"} of one step (see the module doc).

    A spike: the loss more than `spike_threshold` noise sigmas AND more than `min_rise` above its
    current level (a sudden rise), or more than `divergence_rise` above the lowest level of the window
    (a run diverging: noise grows with it, so no sigma test can see it). Only the loss flags."""
    s = cfg.stability
    levels = loss_levels(stats["loss_history"], stats["count"])
    loss_z = (loss - levels["level"]) / levels["noise"]
    loss_rise = (loss - levels["level"]) / jnp.maximum(jnp.abs(levels["level"]), MIN_SIGMA)
    divergence = (loss - levels["lowest"]) / jnp.maximum(jnp.abs(levels["lowest"]), MIN_SIGMA)
    grad_norm_z = robust_z(stats["grad_norm_history"], stats["count"], grad_norm)
    ready = stats["count"] >= s.history_needed
    spike = ready & (((loss_z > s.spike_threshold) & (loss_rise > s.min_rise)) | (divergence > s.divergence_rise))
    zero = lambda x: jnp.where(ready, x, 0.0)
    return {"spike": spike, "loss_z": zero(loss_z), "grad_norm_z": zero(grad_norm_z), "loss_rise": zero(loss_rise),
            "loss_divergence": zero(divergence)}


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
