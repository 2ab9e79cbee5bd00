"""The dynamic loss scaler alone (precision.py): growth, backoff, and its float32 ceiling."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxtrain.config import load_config
from jaxtrain.train.precision import init_loss_scale, update_loss_scale


def fp16(**precision: float) -> object:
    return load_config(None, ["precision.policy=fp16", *(f"precision.{k}={v}" for k, v in precision.items())])


def test_scale_grows_after_the_interval_and_backs_off_on_overflow():
    cfg = fp16(loss_scale_init=1024.0, growth_interval=2, growth_factor=2.0, backoff_factor=0.5, min_loss_scale=1.0)
    s = init_loss_scale(cfg)
    scales = []
    for finite in (True, True, True, False, False):
        s = update_loss_scale(cfg, s, jnp.bool_(finite))
        scales.append(float(s["scale"]))
    assert scales == [1024.0, 2048.0, 2048.0, 1024.0, 512.0]


def test_scale_never_grows_into_infinity():
    big = float(np.finfo(np.float32).max) / 2
    cfg = fp16(loss_scale_init=big, growth_interval=1, growth_factor=4.0)
    s = update_loss_scale(cfg, init_loss_scale(cfg), jnp.bool_(True))
    assert float(s["scale"]) == np.float32(big)  # kept, not inf: an inf scale would skip every later step
    s = update_loss_scale(cfg, s, jnp.bool_(False))
    assert np.isfinite(float(s["scale"])) and float(s["scale"]) < big
