"""Sliding-window attention (`window=`) in the reference, the `xla` path (`mha_local`, banded) and the
Pallas kernels (interpret mode): the mask is transformers' `sliding_window`, outputs and dq/dk/dv equal a
float64 numpy attention, a window >= L is causal attention bitwise, and tiles wholly outside the window
are skipped, not masked (poisoned tiles stay out of the result; the xla path's compiled FLOPs fall).

The Triton kernels' window tests are in test_kernels_triton.py (they need the interpreter set up first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.kernels import attention_flops, flash_attention, mha_local, mha_reference, visited_tiles
from jaxtrain.kernels.common import kv_tile_range, q_tile_range
from jaxtrain.kernels.pallas_attention import pallas_flash_attention
from jaxtrain.kernels.testing import output_and_grads, random_inputs

TOL = 1e-5


def _assert_near(name, got, want, tol=TOL):
    """max|got - want| / max(max|want|, 1): relative, except that gradients which are zero in exact
    math (dq, dk at window 1: each query sees only itself) are held to `tol` absolutely."""
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert np.all(np.isfinite(got)), f"{name}: non-finite values"
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1.0)
    assert err <= tol, f"{name}: error {err:.3g} > {tol:g}"


def test_window_is_transformers_sliding_window():
    """`kv_idx > q_idx - sliding_window` on top of causal (transformers.masking_utils): the query
    and the window - 1 keys before it, for every window from 1 to past the length."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    torch = pytest.importorskip("torch")
    from jaxtrain.kernels.reference import _block_scores_and_mask

    L = 9
    idx = torch.arange(L)
    q, k, _, _, _ = random_inputs(0, 1, L, 1, 1, 16)
    one_hot_values = jnp.eye(L, 16)[None, :, None, :]  # [1, L, 1, 16]: value j is e_j
    for window in range(1, L + 2):
        fn = masking_utils.sliding_window_causal_mask_function(window)
        want = np.array([[bool(fn(0, 0, idx[i], idx[j])) for j in range(L)] for i in range(L)])
        mask = _block_scores_and_mask(q, k, True, None, None, window)[2]  # [B, 1, 1, L, S]
        np.testing.assert_array_equal(np.asarray(mask)[0, 0, 0], want, err_msg=f"window={window}")
        # And through the attention itself: with value j the unit vector e_j, output row i has weight
        # exactly on the keys it sees.
        out = mha_reference(q, k, one_hot_values, window=window)[0, :, 0, :L]
        np.testing.assert_array_equal(np.asarray(out) > 0, want, err_msg=f"window={window}")


# Windows against tiles of 16 and a 40-token row: 1, 3, block - 1, block, block + 1, L - 1, L, 2L.
WINDOWS = [1, 3, 15, 16, 17, 39, 40, 80]


@pytest.mark.parametrize("window", WINDOWS)
def test_window_matches_independent_float64(window):
    """Reference, xla (banded, small chunks) and Pallas (through flash_attention) against float64
    numpy with a hand-written backward: packed documents (segment ids), GQA 4 heads / 2 kv heads."""
    from independent_attention import attention_fwd_bwd

    q, k, v, do, seg = random_inputs(7, 2, 40, 4, 2, 16, jnp.float32, segments=True)
    want = attention_fwd_bwd(q, k, v, do, causal=True, segment_ids=seg, window=window)
    runs = (
        ("reference", mha_reference, {"causal": True}),
        ("xla banded", mha_local, {"chunk": 8}),
        ("pallas", flash_attention, {"implementation": "pallas", "block_sizes": (16, 16)}),
    )
    for name, attention, kwargs in runs:
        out, grads = output_and_grads(attention, q, k, v, do, segment_ids=seg, window=window, **kwargs)
        for part, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), want, strict=True):
            _assert_near(f"{name} window={window} {part}", got, ref)


@pytest.mark.parametrize("L, K, segments, blocks, window", [
    (50, 1, False, (32, 16), 21),  # MQA, q tiles twice the kv tiles, L not a multiple
    (48, 2, True, (16, 32), 9),  # kv tiles twice the q tiles
    (130, 2, True, None, 50),  # default 128 tiles
], ids=["mqa-32x16-w21", "gqa-16x32-w9", "default-blocks-w50"])
def test_window_pallas_unequal_tiles(L, K, segments, blocks, window):
    from independent_attention import attention_fwd_bwd

    q, k, v, do, seg = random_inputs(8, 1, L, 4, K, 16, jnp.float32, segments)
    want = attention_fwd_bwd(q, k, v, do, causal=True, segment_ids=seg, window=window)
    out, grads = output_and_grads(pallas_flash_attention, q, k, v, do, segment_ids=seg, window=window,
                                  block_sizes=blocks)
    for part, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), want, strict=True):
        _assert_near(part, got, ref)


def test_window_of_the_row_or_longer_is_causal_bitwise():
    q, k, v, do, seg = random_inputs(9, 1, 40, 4, 2, 16, jnp.float32, segments=True)
    for attention, kwargs in ((mha_reference, {}), (pallas_flash_attention, {"block_sizes": (16, 16)})):
        causal = output_and_grads(attention, q, k, v, do, segment_ids=seg, **kwargs)
        for window in (40, 80):
            windowed = output_and_grads(attention, q, k, v, do, segment_ids=seg, window=window, **kwargs)
            for got, want in zip(jax.tree.leaves(windowed), jax.tree.leaves(causal)):
                np.testing.assert_array_equal(got, want)
    # The xla path takes the plain reference from window >= L on.
    np.testing.assert_array_equal(flash_attention(q, k, v, segment_ids=seg, implementation="xla", window=40),
                                  mha_reference(q, k, v, segment_ids=seg))


# ------------------------------------------------------------------------------------------------
# Skipped, not masked. A kv tile the kernel visits with every score masked still multiplies its
# values by the zero probabilities, and 0 * NaN = NaN: poisoning one tile's keys/values makes every
# row of every q tile that visits it NaN, and leaves the q tiles that skip it exact. The pattern
# must be exactly what kv_tile_range / q_tile_range say (the same sets visited_tiles counts).
# ------------------------------------------------------------------------------------------------


def _poisoned_runs(attention, L, window, blocks, **kwargs):
    """(clean (out, dq, dk, dv), run with key/value 0 poisoned, run with query/dO row L-1 poisoned)."""
    q, k, v, do, _ = random_inputs(11, 1, L, 2, 1, 16)
    kw = dict(window=window, block_sizes=blocks, **kwargs)
    clean = jax.tree.leaves(output_and_grads(attention, q, k, v, do, **kw))
    bad_kv = jax.tree.leaves(output_and_grads(attention, q, k.at[:, 0].set(jnp.nan), v.at[:, 0].set(jnp.nan),
                                              do, **kw))
    bad_q = jax.tree.leaves(output_and_grads(attention, q.at[:, L - 1].set(jnp.nan), k, v,
                                             do.at[:, L - 1].set(jnp.nan), **kw))
    return clean, bad_kv, bad_q


def check_poisoned_tiles_are_skipped(clean, bad_kv, bad_q, L, window, block_q, block_kv):
    """Rows of q tiles that skip kv tile 0 are exact with key 0 poisoned (out and dq); keys of kv
    tiles that skip the last q tile are exact with query row L-1 poisoned (dk and dv); every row a
    visited tile touches is NaN, so the test would see a tile that is masked instead of skipped."""
    q_tiles, kv_tiles = -(-L // block_q), -(-L // block_kv)
    visits_key0 = np.zeros(L, bool)
    for t in range(q_tiles):
        lo, hi = kv_tile_range(t, L, block_q, block_kv, window=window)
        visits_key0[t * block_q:(t + 1) * block_q] = lo == 0 < hi
    visits_last_row = np.zeros(L, bool)
    for j in range(kv_tiles):
        lo, hi = q_tile_range(j, L, block_q, block_kv, window=window)
        visits_last_row[j * block_kv:(j + 1) * block_kv] = hi == q_tiles
    assert visits_key0.any() and (~visits_key0).any() and visits_last_row.any() and (~visits_last_row).any()
    out, dq, dk, dv = bad_kv[0], bad_kv[1], bad_q[2], bad_q[3]
    for name, got, want, visited in (("out", out, clean[0], visits_key0), ("dq", dq, clean[1], visits_key0),
                                     ("dk", dk, clean[2], visits_last_row), ("dv", dv, clean[3], visits_last_row)):
        got, want = np.asarray(got), np.asarray(want)
        assert np.isnan(got[:, visited]).all(), f"{name}: a visited tile's rows should carry the poison"
        np.testing.assert_allclose(got[:, ~visited], want[:, ~visited], rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("L, window, blocks", [(64, 20, (16, 16)), (64, 9, (16, 8))], ids=["w20-16x16", "w9-16x8"])
def test_pallas_skips_tiles_outside_the_window(L, window, blocks):
    clean, bad_kv, bad_q = _poisoned_runs(pallas_flash_attention, L, window, blocks)
    check_poisoned_tiles_are_skipped(clean, bad_kv, bad_q, L, window, *blocks)


def test_work_falls_with_the_window():
    """The tiles the kernels visit (kv_tile_range, which the poison tests pin the kernels to) and the
    xla path's compiled FLOPs fall with the window; the analytic FLOPs count the band."""
    L = 4096
    full, windowed = visited_tiles(L, 128, 128), visited_tiles(L, 128, 128, window=512)
    # 32 q tiles: tile t visits kv tiles max(0, t - 4) .. t (the window's 511 earlier keys start mid-tile).
    assert full == 32 * 33 // 2 and windowed == (1 + 2 + 3 + 4) + 28 * 5
    assert windowed / full < 0.35
    assert attention_flops(1, L, 1, 1, window=512) / attention_flops(1, L, 1, 1) == pytest.approx(
        (L * 512 - 512 * 512 / 2) / (L * L / 2))
    assert attention_flops(1, L, 1, 1, window=L) == attention_flops(1, L, 1, 1)

    L, window = 1024, 64
    q = jax.ShapeDtypeStruct((1, L, 2, 32), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, L, 1, 32), jnp.float32)

    def compiled_flops(window):
        run = jax.jit(lambda q, k, v: flash_attention(q, k, v, implementation="xla", window=window))
        return run.lower(q, kv, kv).compile().cost_analysis()["flops"]

    dense, banded = compiled_flops(None), compiled_flops(window)
    # Band of (m + 1) * chunk = 256 keys per query against 1,024: about a quarter of the FLOPs.
    assert banded < 0.3 * dense, (banded, dense)


# ------------------------------------------------------------------------------------------------
# Refusals, and cuDNN's window.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_bad_windows_are_refused_by_name(implementation):
    q, k, v, _, _ = random_inputs(0, 1, 16, 2, 1, 16)
    with pytest.raises(ValueError, match=f"'{implementation}'.*needs causal=True"):
        flash_attention(q, k, v, causal=False, window=4, implementation=implementation)
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="positive int"):
            flash_attention(q, k, v, window=bad, implementation=implementation)


def test_cudnn_passes_the_window_as_its_left_window(monkeypatch):
    """cuDNN needs a GPU: run the wrapper with jax.nn.dot_product_attention's XLA implementation,
    which reads local_window_size=(window - 1, 0) as cuDNN does (sliding_window_length = window)."""
    from jaxtrain.kernels.cudnn_attention import cudnn_flash_attention

    real = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention",
                        lambda *a, implementation=None, **kw: real(*a, implementation="xla", **kw))
    q, k, v, _, seg = random_inputs(12, 1, 24, 4, 2, 16, jnp.float32, segments=True)
    for window in (1, 5, 24):
        got = cudnn_flash_attention(q, k, v, segment_ids=seg, window=window)
        _assert_near(f"window={window}", got, mha_reference(q, k, v, segment_ids=seg, window=window))
    with pytest.raises(ValueError, match="'cudnn'.*needs causal=True"):
        cudnn_flash_attention(q, k, v, causal=False, window=4)
