"""Learning-rate schedules (optim.schedule): linear warmup, then cosine, linear, constant or WSD.

Every schedule maps the optimizer's update count t (optax's `ScaleByScheduleState.count`: the update
of train step N uses t = N - 1 when no step was skipped) to a rate, as a pure jnp function (jit-safe,
elementwise over an array of counts). With W warmup steps, T the schedule's length
(`schedule_steps`), peak = optim.learning_rate and end = peak * optim.min_lr_ratio:

  warmup (t < W)   lr = peak * t / W                     (every schedule; cosine's is optax's)
  cosine           lr = end + (peak - end) * (1 + cos(pi * p)) / 2,  p = min(t - W, T - W) / (T - W)
  linear           lr = peak + (end - peak) * p,                     p as for cosine
  constant         lr = peak
  wsd              lr = peak for t < T - D, then end + (peak - end) * f(p) with p = min(t - (T - D), D) / D
                   and f(p) = 1 - p (linear), (1 + cos(pi * p)) / 2 (cosine) or 1 - sqrt(p) (sqrt)

Past T every rate stays at its final value (end; peak for constant). WSD (warmup-stable-decay; Hu et
al. 2024, MiniCPM; Hägele et al. 2024) decays over the last D = optim.wsd_decay_steps steps (0 = a
fifth of T): its stable phase does not depend on T, so a WSD run may be extended while it is still
there without changing any rate already used (jaxtrain/train/config_changes.py, docs/optim.md).
"""

from __future__ import annotations

from typing import Callable

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


def wsd_decay_steps(cfg: Config) -> int:
    """D, the length of a WSD schedule's final decay: optim.wsd_decay_steps, or a fifth of the
    schedule's length (at least 1) when that is 0; never more than the steps after the warmup."""
    warmup, total = schedule_steps(cfg)
    decay = cfg.optim.wsd_decay_steps if cfg.optim.wsd_decay_steps > 0 else max(1, total // 5)
    return min(decay, total - warmup)


def learning_rate_schedule(cfg: Config) -> optax.Schedule:
    """optim.schedule as a function of the update count (the module docstring gives each formula).

    cosine is optax.warmup_cosine_decay_schedule, bitwise what every run before the other schedules
    used; the others are this module's own.
    """
    o = cfg.optim
    warmup, total = schedule_steps(cfg)
    peak, end = o.learning_rate, o.learning_rate * o.min_lr_ratio
    if o.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=peak, warmup_steps=warmup,
                                                  decay_steps=total, end_value=end)
    if o.schedule == "linear":
        return warmup_linear_decay(peak, end, warmup, total)
    if o.schedule == "constant":
        return warmup_constant(peak, warmup)
    if o.schedule == "wsd":
        return warmup_stable_decay(peak, end, warmup, total, wsd_decay_steps(cfg), o.wsd_decay_shape)
    raise ValueError(f"unknown optim.schedule {o.schedule!r}")  # the config's Literal refuses it first


def _count(count: jax.typing.ArrayLike) -> jax.Array:
    # float32 as optax's schedules: exact up to 2**24 updates.
    return jnp.asarray(count, jnp.float32)


def _with_warmup(peak: float, warmup: int, after: Callable[[jax.Array], jax.Array]) -> optax.Schedule:
    """lr = peak * t / warmup for t < warmup, then `after(t)`."""
    def schedule(count):
        t = _count(count)
        if warmup == 0:
            return after(t)
        return jnp.where(t < warmup, peak * t / warmup, after(t))
    return schedule


def warmup_constant(peak: float, warmup: int) -> optax.Schedule:
    """Linear warmup from 0 to `peak` over `warmup` updates, then `peak` for ever."""
    return _with_warmup(peak, warmup, lambda t: jnp.full_like(t, peak))


def warmup_linear_decay(peak: float, end: float, warmup: int, total: int) -> optax.Schedule:
    """Linear warmup to `peak`, then linear decay to `end` at update `total`, then `end`:
    lr = peak + (end - peak) * p, p = min(t - warmup, total - warmup) / (total - warmup)."""
    span = total - warmup

    def after(t):
        p = jnp.clip((t - warmup) / span, 0.0, 1.0)
        return peak + (end - peak) * p

    return _with_warmup(peak, warmup, after)


# f(p) of a WSD decay: 1 at its start (p = 0), 0 at its end (p = 1).
DECAY_SHAPES: dict[str, Callable[[jax.Array], jax.Array]] = {
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: 0.5 * (1.0 + jnp.cos(jnp.pi * p)),
    "sqrt": lambda p: 1.0 - jnp.sqrt(p),  # Hägele et al. 2024: 1 - sqrt drops fast, then flattens
}


def warmup_stable_decay(peak: float, end: float, warmup: int, total: int, decay: int,
                        shape: str) -> optax.Schedule:
    """Warmup-stable-decay: linear warmup to `peak`, exactly `peak` up to update total - decay, then
    end + (peak - end) * f(p), p = min(t - (total - decay), decay) / decay, with f the `shape` of
    DECAY_SHAPES; `end` from update `total` on.

    The stable phase, the decay's start (f(0) = 1) included, is the constant `peak` itself (not
    through arithmetic), so it is bitwise the same whatever `total` and `decay` are.
    """
    if not 0 < decay <= total - warmup:
        raise ValueError(f"a WSD decay of {decay} steps does not fit {total} steps with {warmup} of warmup")
    start, f = total - decay, DECAY_SHAPES[shape]

    def after(t):
        p = jnp.clip((t - start) / decay, 0.0, 1.0)
        return jnp.where(t <= start, peak, end + (peak - end) * f(p))

    return _with_warmup(peak, warmup, after)


def same_rates(old: optax.Schedule, new: optax.Schedule, updates: int) -> bool:
    """Whether `new` gives bitwise the rates `old` gave to the first `updates` updates (counts
    0 .. updates - 1), evaluated the same way for both."""
    if updates <= 0:
        return True
    counts = jnp.arange(updates, dtype=jnp.int32)
    return bool(jnp.array_equal(jnp.asarray(old(counts), jnp.float32), jnp.asarray(new(counts), jnp.float32)))
