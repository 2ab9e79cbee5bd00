"""The Triton flash-attention kernels' math on CPU, under the Triton interpreter, against the XLA
reference: forward output and dq, dk, dv.

The kernels are launched directly on CPU torch tensors (TRITON_INTERPRET=1) with the same
`launch_plan` the JAX wrapper uses. The JAX wrapper itself (custom VJP, D = rowsum(dO * O), the
GQA sum of dk/dv, argument order) is tested through a stand-in for `jax_triton.triton_call` that
runs the kernels the same way inside a `jax.pure_callback`; real jax-triton needs an NVIDIA GPU.

Test-only dependencies (the `dev` extra): torch and triton.
"""

from __future__ import annotations

import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from triton_stand_in import fake_jax_triton  # noqa: F401  (a fixture; importing the module sets TRITON_INTERPRET)
from triton_stand_in import to_numpy as _to_numpy
from triton_stand_in import to_torch as _to_torch
from triton_stand_in import triton_attention as ta

from jaxtrain.kernels.common import MASK_VALUE
from jaxtrain.kernels.reference import attention_block, attention_block_bwd
from jaxtrain.kernels.testing import TOLERANCE, assert_close, output_and_grads, random_inputs, reference_output_and_grads


def _launch(kind, kernel, inputs, outputs, q_shape, kv_heads, dtype_name, causal, has_seg, block_sizes,
            window=None):
    plan = ta.launch_plan(kind, q_shape, kv_heads, dtype_name, causal=causal, has_segments=has_seg,
                          block_sizes=block_sizes, window=window)
    kernel[plan.grid](*inputs, *plan.scalars, *outputs, **plan.meta)


def run_kernels(q, k, v, do, q_seg, kv_seg, *, causal, block_sizes, window=None):
    """Forward, dq and dk/dv kernels on torch tensors; returns numpy (out, dq, dk, dv)."""
    B, L, N, H = q.shape
    K = k.shape[2]
    dtype_name = jnp.dtype(q.dtype).name
    tq, tk, tv, tdo = (_to_torch(x) for x in (q, k, v, do))
    has_seg = q_seg is not None
    t_q_seg = _to_torch(q_seg) if has_seg else torch.zeros(1, dtype=torch.int32)
    t_kv_seg = _to_torch(kv_seg) if has_seg else t_q_seg
    common = (q.shape, K, dtype_name, causal, has_seg, block_sizes, window)

    out = torch.empty_like(tq)
    lse = torch.empty((B, N, L), dtype=torch.float32)
    _launch("fwd", ta._fwd_kernel, (tq, tk, tv, t_q_seg, t_kv_seg), (out, lse), *common)

    delta = (tdo.float() * out.float()).sum(-1).permute(0, 2, 1).contiguous()  # [B, N, L]
    bwd_inputs = (tq, tk, tv, t_q_seg, t_kv_seg, tdo, lse, delta)
    dq = torch.empty_like(tq)
    _launch("dq", ta._dq_kernel, bwd_inputs, (dq,), *common)
    dk_part = torch.empty((B, L, N, H), dtype=torch.float32)
    dv_part = torch.empty_like(dk_part)
    _launch("dkv", ta._dkv_kernel, bwd_inputs, (dk_part, dv_part), *common)
    dk = dk_part.reshape(B, L, K, N // K, H).sum(3).to(tk.dtype)
    dv = dv_part.reshape(B, L, K, N // K, H).sum(3).to(tv.dtype)
    return tuple(_to_numpy(t) for t in (out, dq, dk, dv))


def _check(seed, B, L, N, K, H, *, causal, segments, block_sizes, dtype=jnp.float32):
    q, k, v, do, seg = random_inputs(seed, B, L, N, K, H, dtype, segments)
    got = run_kernels(q, k, v, do, seg, seg, causal=causal, block_sizes=block_sizes)
    ref_out, ref_grads = reference_output_and_grads(q, k, v, do, causal=causal, segment_ids=seg)
    tol = TOLERANCE[jnp.dtype(dtype).name]
    for name, g, ref in zip(("out", "dq", "dk", "dv"), got, (ref_out, *ref_grads)):
        assert g.dtype == ref.dtype and g.shape == ref.shape, name
        assert_close(name, g, ref, tol)


@pytest.mark.parametrize("causal, segments, K", [(True, True, 2), (False, True, 1)])
def test_triton_kernels_match_an_independent_implementation(causal, segments, K):
    """Against float64 numpy with a hand-written backward, not only against `mha_reference`."""
    from independent_attention import attention_fwd_bwd
    q, k, v, do, seg = random_inputs(7, 2, 40, 4, K, 16, jnp.float32, segments)
    got = run_kernels(q, k, v, do, seg, seg, causal=causal, block_sizes=(16, 32))
    want = attention_fwd_bwd(q, k, v, do, causal=causal, segment_ids=seg)
    for name, g, ref in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert_close(name, g, ref, TOLERANCE["float32"])


# (B, L, N, K, H, causal, segments, block_sizes, dtype)
CASES = [
    (2, 40, 4, 2, 16, True, True, (16, 32), jnp.float32),
    (1, 33, 4, 1, 32, False, False, (16, 16), jnp.float32),
    (2, 64, 2, 2, 16, True, False, (32, 16), jnp.float32),
    (2, 17, 4, 1, 16, False, True, (16, 16), jnp.float32),
    (2, 64, 2, 2, 16, True, False, (16, 16), jnp.bfloat16),
    (1, 40, 4, 1, 16, False, True, (16, 16), jnp.bfloat16),
    (1, 1, 2, 1, 16, True, False, None, jnp.float32),  # seq 1
    (1, 24, 2, 1, 64, False, True, (16, 16), jnp.float32),  # head_dim 64
    (1, 24, 2, 2, 128, True, True, (16, 16), jnp.float32),  # head_dim 128
    (1, 20, 2, 1, 96, True, False, (16, 16), jnp.float32),  # head_dim not a power of two
    (1, 130, 2, 1, 16, True, True, None, jnp.float32),  # default tiles, L not a multiple
]


def _case_id(case):
    B, L, N, K, H, causal, segments, blocks, dtype = case
    tiles = "default" if blocks is None else f"{blocks[0]}x{blocks[1]}"
    return (f"L{L}-N{N}K{K}-H{H}-{'causal' if causal else 'full'}-{'seg' if segments else 'noseg'}"
            f"-b{tiles}-{jnp.dtype(dtype).name}")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_triton_kernels_match_reference(case):
    B, L, N, K, H, causal, segments, blocks, dtype = case
    _check(100, B, L, N, K, H, causal=causal, segments=segments, block_sizes=blocks, dtype=dtype)


def test_triton_segments_starting_mid_tile():
    seg = jnp.asarray([[3] * 5 + [4] * 16 + [9] * 19, [0] * 13 + [1] * 27], jnp.int32)
    q, k, v, do, _ = random_inputs(110, 2, 40, 4, 2, 16)
    for causal in (True, False):
        got = run_kernels(q, k, v, do, seg, seg, causal=causal, block_sizes=(16, 16))
        ref_out, ref_grads = reference_output_and_grads(q, k, v, do, causal=causal, segment_ids=seg)
        for name, g, ref in zip(("out", "dq", "dk", "dv"), got, (ref_out, *ref_grads)):
            assert_close(name, g, ref, 1e-5)


def test_triton_fully_masked_rows_are_zero_not_nan():
    q_seg = jnp.asarray([[1] * 8 + [2] * 8 + [5] * 8], jnp.int32)
    kv_seg = jnp.asarray([[1] * 8 + [2] * 8 + [7] * 8], jnp.int32)
    q, k, v, do, _ = random_inputs(120, 1, 24, 2, 1, 16)
    out, dq, dk, dv = run_kernels(q, k, v, do, q_seg, kv_seg, causal=False, block_sizes=(16, 16))
    ref_out, ref_grads = reference_output_and_grads(q, k, v, do, causal=False, segment_ids=q_seg,
                                                    kv_segment_ids=kv_seg)
    for name, g, ref in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref_out, *ref_grads)):
        assert_close(name, g, ref, 1e-5)
    for x in (out, dq, dk, dv):
        np.testing.assert_array_equal(x[:, 16:], 0.0)


_AOT_SCRIPT = """
import json, sys
from jaxtrain.kernels.triton_attention import aot_compile
shared = {}
for kind in ("fwd", "dq", "dkv"):
    for window in (None, 512):  # the sliding window's loop bounds too
        kernel = aot_compile(kind, (2, 4096, 16, 128), 4, "bfloat16", causal=True, has_segments=True, window=window)
        shared[f"{kind} window={window}"] = kernel.metadata.shared
print(json.dumps(shared))
"""


def test_triton_kernels_compile_for_sm90_without_a_gpu():
    # The real (non-interpreted) compiler path, in a child process without TRITON_INTERPRET:
    # bf16, head_dim 128, causal, segments, default tiles, without and with a window, down to sm_90
    # machine code.
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], env=env, cwd=repo, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    shared = json.loads(done.stdout.strip().splitlines()[-1])
    for kind, nbytes in shared.items():
        assert 0 < nbytes <= 227 * 1024, (kind, nbytes)  # Hopper's shared memory per block


def test_launch_plan_rejects_bad_tiles():
    with pytest.raises(ValueError, match="power of two >= 16"):
        ta.launch_plan("fwd", (1, 64, 2, 16), 1, "float32", causal=True, has_segments=False, block_sizes=(24, 32))
    with pytest.raises(ValueError, match="power of two >= 16"):
        ta.launch_plan("dq", (1, 64, 2, 16), 1, "float32", causal=True, has_segments=False, block_sizes=(8, 16))


# ------------------------------------------------------------------------------------------------
# The JAX wrapper, with jax_triton.triton_call replaced by an interpreter-backed stand-in.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "B, L, N, K, H, causal, segments, dtype",
    [(2, 40, 4, 2, 16, True, True, jnp.float32), (1, 33, 4, 1, 16, False, False, jnp.bfloat16)],
    ids=["gqa2-causal-seg-fp32", "mqa-full-bf16"],
)
def test_triton_jax_wrapper_with_stand_in_triton_call(fake_jax_triton, B, L, N, K, H, causal, segments, dtype):
    q, k, v, do, seg = random_inputs(130, B, L, N, K, H, dtype, segments)
    out, grads = output_and_grads(ta.triton_flash_attention, q, k, v, do, causal=causal, segment_ids=seg,
                                  block_sizes=(16, 16))
    ref_out, ref_grads = reference_output_and_grads(q, k, v, do, causal=causal, segment_ids=seg)
    tol = TOLERANCE[jnp.dtype(dtype).name]
    assert_close("out", out, ref_out, tol)
    for name, g, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.dtype == ref.dtype, name
        assert_close(name, g, ref, tol)


# (causal, K, dtype, q/kv segment layout): the ring's three kinds of pairs are causal diagonal and
# full off-diagonal blocks; "disjoint" gives rows that see no key of the block (lse = MASK_VALUE).
BLOCK_CASES = [(True, 2, jnp.float32, "same"), (False, 1, jnp.float32, "shifted"),
               (False, 2, jnp.float32, "disjoint"), (True, 1, jnp.bfloat16, "shifted")]


@pytest.mark.parametrize("causal, K, dtype, layout", BLOCK_CASES,
                         ids=[f"{'causal' if c else 'full'}-K{k}-{jnp.dtype(d).name}-{lay}" for c, k, d, lay in BLOCK_CASES])
def test_triton_blockwise_form_matches_the_reference_block(fake_jax_triton, causal, K, dtype, layout):
    """The blockwise form the context ring calls: (o, lse) of one block and its backward given a
    combined o and lse, against kernels.reference's blocks (which the ring is tested with)."""
    import jax
    B, L, N, H = 2, 24, 4, 16
    q, k, v, do, _ = random_inputs(140, B, L, N, K, H, dtype)
    q_seg = jnp.asarray(np.repeat([[1, 2, 3]], B, 0).repeat(8, 1), jnp.int32)  # [B, 24], documents of 8
    kv_seg = {"same": q_seg, "shifted": jnp.roll(q_seg, 5, axis=1), "disjoint": q_seg.at[:, 8:16].set(7)}[layout]
    kw = dict(causal=causal, segment_ids=q_seg, kv_segment_ids=kv_seg)
    o, lse = jax.jit(lambda q, k, v: ta.triton_attention_block(q, k, v, block_sizes=(16, 16), **kw))(q, k, v)
    o_ref, lse_ref = attention_block(q, k, v, **kw)
    assert o.dtype == jnp.float32 and lse.dtype == jnp.float32 and lse.shape == (B, L, N)
    tol = TOLERANCE[jnp.dtype(dtype).name]
    assert_close("o", o, o_ref, tol)
    seen = np.asarray(lse_ref) > MASK_VALUE / 2
    np.testing.assert_allclose(np.asarray(lse)[seen], np.asarray(lse_ref)[seen], rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.asarray(lse)[~seen], np.float32(MASK_VALUE))  # weighs nothing when combined
    if layout == "disjoint":
        assert (~seen).any()
    # The backward given another block's combined output: lse and o of the whole row, not this block's.
    o_all, lse_all = o_ref * 0.5 + 0.1, jnp.where(seen, lse_ref + 0.3, MASK_VALUE)
    got = jax.jit(lambda: ta.triton_attention_block_bwd(q, k, v, o_all.astype(dtype), lse_all, do,
                                                        block_sizes=(16, 16), **kw))()
    want = attention_block_bwd(q, k, v, o_all.astype(dtype), lse_all, do, **kw)
    for name, g, ref in zip(("dq", "dk", "dv"), got, want):
        assert g.dtype == jnp.float32, name
        assert_close(name, g, ref, tol)


# ------------------------------------------------------------------------------------------------
# Sliding window (the Pallas kernels' and the reference's window tests are in test_window.py).
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 3, 15, 16, 17, 39, 40, 80])
def test_triton_window_matches_an_independent_implementation(window):
    """Windows 1, 3, tile - 1, tile, tile + 1, L - 1, L, 2L against float64 numpy: packed documents, GQA."""
    from independent_attention import attention_fwd_bwd
    from test_window import _assert_near
    q, k, v, do, seg = random_inputs(7, 2, 40, 4, 2, 16, jnp.float32, True)
    got = run_kernels(q, k, v, do, seg, seg, causal=True, block_sizes=(16, 16), window=window)
    want = attention_fwd_bwd(q, k, v, do, causal=True, segment_ids=seg, window=window)
    for name, g, ref in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        _assert_near(f"window={window} {name}", g, ref)


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the poisoned rows' max, as intended
@pytest.mark.parametrize("L, window, blocks", [(64, 20, (16, 16)), (64, 9, (32, 16)), (64, 9, (16, 32))],
                         ids=["w20-16x16", "w9-32x16", "w9-16x32"])
def test_triton_skips_tiles_outside_the_window(L, window, blocks):
    """A poisoned kv tile (q row) reaches exactly the q tiles (kv tiles) whose loops visit it:
    tiles outside the window are not loaded (see test_window.check_poisoned_tiles_are_skipped)."""
    from test_window import check_poisoned_tiles_are_skipped
    q, k, v, do, _ = random_inputs(11, 1, L, 2, 1, 16)
    kw = dict(causal=True, block_sizes=blocks, window=window)
    clean = run_kernels(q, k, v, do, None, None, **kw)
    bad_kv = run_kernels(q, k.at[:, 0].set(jnp.nan), v.at[:, 0].set(jnp.nan), do, None, None, **kw)
    bad_q = run_kernels(q.at[:, L - 1].set(jnp.nan), k, v, do.at[:, L - 1].set(jnp.nan), None, None, **kw)
    check_poisoned_tiles_are_skipped(clean, bad_kv, bad_q, L, window, *blocks)


def test_triton_jax_wrapper_with_a_window(fake_jax_triton):
    from independent_attention import attention_fwd_bwd
    from test_window import _assert_near
    q, k, v, do, seg = random_inputs(131, 1, 40, 4, 2, 16, jnp.float32, True)
    out, grads = output_and_grads(ta.triton_flash_attention, q, k, v, do, segment_ids=seg, window=13,
                                  block_sizes=(16, 16))
    want = attention_fwd_bwd(q, k, v, do, causal=True, segment_ids=seg, window=13)
    for name, g, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), want, strict=True):
        _assert_near(name, g, ref)
    with pytest.raises(ValueError, match="'triton'.*needs causal=True"):
        ta.triton_flash_attention(q, k, v, causal=False, window=4)
