"""Helpers for checking attention kernels against the reference (tests, GPU check, bench): inputs, errors."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from .reference import mha_reference

# Tolerances of the issue, on relative_error below.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def relative_error(actual, expected) -> float:
    """max|actual - expected| / max|expected|, computed in fp32.

    When `expected` is all zeros (e.g. dq and dk of a length-1 sequence, whose softmax is constant)
    the denominator is taken as 1, i.e. the absolute error.
    """
    a = np.asarray(jnp.asarray(actual, jnp.float32))
    b = np.asarray(jnp.asarray(expected, jnp.float32))
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    return float(np.max(np.abs(a - b))) / (scale if scale > 0 else 1.0)


def random_inputs(seed: int, B: int, L: int, N: int, K: int, H: int, dtype=jnp.float32, segments: bool = False):
    """Fresh q [B, L, N, H], k/v [B, L, K, H], output cotangent do, and sorted segment ids [B, L] (or None).

    Drawn with numpy in fp32 and cast, so the same seed gives the same values for every backend.
    """
    rng = np.random.default_rng(seed)
    q, do = (rng.standard_normal((B, L, N, H), np.float32) for _ in range(2))
    k, v = (rng.standard_normal((B, L, K, H), np.float32) for _ in range(2))
    seg = None
    if segments:
        # Sorted ids: packed documents of random lengths, boundaries anywhere in a tile.
        seg = jnp.asarray(np.sort(rng.integers(0, 3, size=(B, L)), axis=1).astype(np.int32))
    q, k, v, do = (jnp.asarray(x).astype(dtype) for x in (q, k, v, do))
    return q, k, v, do, seg


def output_and_grads(attention, q, k, v, do, **kwargs):
    """(out, (dq, dk, dv)) of `attention(q, k, v, **kwargs)` for cotangent `do`, in one jit."""

    @jax.jit
    def run(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, **kwargs), q, k, v)
        return out, vjp(do)

    return run(q, k, v, do)


def reference_output_and_grads(q, k, v, do, **kwargs):
    return output_and_grads(mha_reference, q, k, v, do, **kwargs)


def assert_close(name: str, actual, expected, tolerance: float) -> None:
    actual_np = np.asarray(jnp.asarray(actual, jnp.float32))
    assert np.all(np.isfinite(actual_np)), f"{name}: non-finite values"
    err = relative_error(actual, expected)
    assert err <= tolerance, f"{name}: relative error {err:.3g} > {tolerance:g}"


def time_call(fn, *args, warmup: int = 2, iters: int = 10) -> float:
    """Median wall-clock seconds of `fn(*args)` (already jitted), each call synchronised.

    The first call (compilation) and `warmup` more are not timed.
    """
    jax.block_until_ready(fn(*args))
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))
