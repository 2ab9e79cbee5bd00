"""Attention sinks (gpt-oss) in every implementation of `flash_attention`, and a value head size Hv != H
(multi-head latent attention) on the `xla` path.

The ground truth is a float64 numpy attention written here with the sink as an extra logit column
(softmax over keys + sink, the sink column dropped), forward and backward by hand, itself checked
against transformers' GptOss `eager_attention_forward` and torch autograd. Against it: outputs and
dq, dk, dv, d sinks of the `xla` path (whole-row and banded), the Pallas kernels (interpret mode) and
the Triton kernels (interpreter, through the stand-in for `jax_triton.triton_call`, as in
test_kernels_triton.py), with causal + packed documents + a window shorter than the row, GQA, and
lengths that are not a multiple of the tiles.
"""

from __future__ import annotations

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtrain.kernels.attention as attention_module
from jaxtrain.kernels import flash_attention, mha_local, mha_reference
from jaxtrain.kernels.cudnn_attention import cudnn_flash_attention
from jaxtrain.kernels.pallas_attention import pallas_flash_attention
from jaxtrain.kernels.reference import _block_scores_and_mask
from jaxtrain.kernels.testing import random_inputs

TOL = 1e-5  # fp32, as test_window.py / test_kernels.py

B, L, N, K, H = 2, 40, 4, 2, 16  # L = 40: not a multiple of the 16-row tiles; GQA 4 heads / 2 kv heads
WINDOW = 13  # shorter than the row
BLOCKS = (16, 16)


def numpy_sink_attention(q, k, v, do, sinks, *, segment_ids=None, window=None):
    """(out, dq, dk, dv, dsinks) in float64 of causal attention whose every softmax row of head n has
    the extra logit sinks[n] (None = no sink: a logit of -inf). v may have a head size other than q's;
    the scale is 1/sqrt(H) of q. Backward by hand: the softmax over the L + 1 columns, the sink's
    column carrying no value (its dP is 0)."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    Bq, Lq, Nq, Hq = q.shape
    G = Nq // k.shape[2]
    sinks = np.full(Nq, -np.inf) if sinks is None else np.asarray(sinks, np.float64)
    allowed = np.broadcast_to(np.tril(np.ones((Lq, Lq), bool)), (Bq, Lq, Lq)).copy()
    if window is not None:
        allowed &= ~np.tril(np.ones((Lq, Lq), bool), -window)[None]
    if segment_ids is not None:
        seg = np.asarray(segment_ids)
        allowed &= seg[:, :, None] == seg[:, None, :]
    scale = 1.0 / np.sqrt(Hq)
    out, dq = np.zeros(q.shape[:3] + v.shape[3:]), np.zeros_like(q)
    dk, dv, dsinks = np.zeros_like(k), np.zeros_like(v), np.zeros(Nq)
    for b in range(Bq):
        for n in range(Nq):
            kv = n // G
            s = np.where(allowed[b], q[b, :, n] @ k[b, :, kv].T * scale, -np.inf)
            logits = np.concatenate([s, np.full((Lq, 1), sinks[n])], axis=1)  # the sink column
            e = np.exp(logits - logits.max(axis=1, keepdims=True))  # causal: every row sees itself
            p_all = e / e.sum(axis=1, keepdims=True)
            p, p_sink = p_all[:, :Lq], p_all[:, Lq]
            o = p @ v[b, :, kv]
            out[b, :, n] = o
            g = do[b, :, n]
            delta = np.sum(g * o, axis=1)
            dv[b, :, kv] += p.T @ g
            ds = p * (g @ v[b, :, kv].T - delta[:, None])
            dq[b, :, n] = ds @ k[b, :, kv] * scale
            dk[b, :, kv] += ds.T @ q[b, :, n] * scale
            dsinks[n] += np.sum(p_sink * (0.0 - delta))  # softmax backward of the sink column (dP = 0)
    return out, dq, dk, dv, dsinks


def _assert_near(name, got, want, tol=TOL):
    """max|got - want| / max(max|want|, 1), as test_window._assert_near."""
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert np.all(np.isfinite(got)), f"{name}: non-finite values"
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1.0)
    assert err <= tol, f"{name}: error {err:.3g} > {tol:g}"


def _sinks(seed, n=N):
    # Spread so that some heads' sink takes much of the mass and others little.
    return jnp.asarray(np.random.default_rng(seed).normal(0.0, 2.0, n).astype(np.float32))


def _inputs(seed=3, Hv=H):
    q, k, v, do, seg = random_inputs(seed, B, L, N, K, H, jnp.float32, segments=True)
    if Hv != H:
        rng = np.random.default_rng(seed + 1)
        v = jnp.asarray(rng.standard_normal((B, L, K, Hv), np.float32))
        do = jnp.asarray(rng.standard_normal((B, L, N, Hv), np.float32))
    return q, k, v, do, seg


def output_and_grads(attention, q, k, v, do, sinks, **kwargs):
    """(out, (dq, dk, dv, dsinks)) of attention(q, k, v, sinks=sinks, **kwargs) in one jit; with
    sinks None, (out, (dq, dk, dv))."""

    @jax.jit
    def run(q, k, v, do, sinks):
        if sinks is None:
            out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, **kwargs), q, k, v)
        else:
            out, vjp = jax.vjp(lambda q, k, v, s: attention(q, k, v, sinks=s, **kwargs), q, k, v, sinks)
        return out, vjp(do)

    return run(q, k, v, do, sinks)


@pytest.fixture
def triton_attention(monkeypatch):
    """kernels.triton_attention under the Triton interpreter, its `jax_triton.triton_call` the
    stand-in of tests/triton_stand_in.py (as test_kernels_triton.py runs it; torch and triton are
    dev dependencies there too, a missing one is a failure)."""
    import triton_stand_in  # sets TRITON_INTERPRET and reloads the module

    monkeypatch.setitem(sys.modules, "jax_triton", types.SimpleNamespace(triton_call=triton_stand_in.fake_triton_call))
    return triton_stand_in.triton_attention


# ------------------------------------------------------------------------------------------------
# The numpy ground truth is transformers' GptOss attention.
# ------------------------------------------------------------------------------------------------


def test_numpy_truth_is_transformers_gpt_oss_eager_attention():
    """Forward against transformers' `eager_attention_forward` of GptOss and gradients (q, k, v, sinks)
    against torch autograd through it, in float64, with the causal, segment and window mask."""
    torch = pytest.importorskip("torch")
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    q, k, v, do, seg = _inputs()
    sinks = _sinks(1)
    want = numpy_sink_attention(q, k, v, do, sinks, segment_ids=seg, window=WINDOW)

    t = [torch.tensor(np.asarray(x, np.float64), requires_grad=True) for x in (q, k, v, sinks)]
    tq, tk, tv, ts = t
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    allowed = (j <= i) & (i - j < WINDOW) & (np.asarray(seg)[:, :, None] == np.asarray(seg)[:, None, :])
    mask = torch.tensor(np.where(allowed[:, None], 0.0, np.finfo(np.float64).min))  # additive, [B, 1, L, L]
    module = types.SimpleNamespace(sinks=ts, num_key_value_groups=N // K, training=False)
    out, _ = gpt_oss.eager_attention_forward(module, tq.transpose(1, 2), tk.transpose(1, 2), tv.transpose(1, 2),
                                             mask, scaling=H ** -0.5)  # out [B, L, N, H]
    out.backward(torch.tensor(np.asarray(do, np.float64)))
    got = (out.detach().numpy(), *(x.grad.numpy() for x in t))
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10, err_msg=name)
    assert np.max(np.abs(want[4])) > 1.0  # the sinks' gradients are not negligible here


# ------------------------------------------------------------------------------------------------
# Every implementation against it.
# ------------------------------------------------------------------------------------------------


RUNS = {
    "xla": (flash_attention, {"implementation": "xla"}),
    "xla banded": (mha_local, {"chunk": 8}),  # the band with several key chunks (window < L)
    "pallas": (flash_attention, {"implementation": "pallas", "block_sizes": BLOCKS}),
}


@pytest.mark.parametrize("run, window", [(run, w) for run in RUNS for w in (WINDOW, None) if run != "xla banded" or w],
                         ids=lambda x: {WINDOW: "window13", None: "causal"}.get(x, x) if not isinstance(x, str) else x)
def test_sinks_match_float64(run, window):
    attention, kwargs = RUNS[run]
    q, k, v, do, seg = _inputs()
    sinks = _sinks(1)
    out, grads = output_and_grads(attention, q, k, v, do, sinks, segment_ids=seg, window=window, **kwargs)
    want = numpy_sink_attention(q, k, v, do, sinks, segment_ids=seg, window=window)
    assert grads[3].dtype == jnp.float32 and grads[3].shape == (N,)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *grads), want, strict=True):
        _assert_near(f"{run} {name}", g, w)
    # The sinks matter: without them the output is far from this one.
    plain = numpy_sink_attention(q, k, v, do, None, segment_ids=seg, window=window)[0]
    assert np.max(np.abs(plain - want[0])) > 100 * TOL


@pytest.mark.parametrize("window", [WINDOW, None], ids=["window13", "causal"])
def test_triton_sinks_match_float64(triton_attention, window):
    q, k, v, do, seg = _inputs()
    sinks = _sinks(1)
    out, grads = output_and_grads(triton_attention.triton_flash_attention, q, k, v, do, sinks, segment_ids=seg,
                                  window=window, block_sizes=BLOCKS)
    want = numpy_sink_attention(q, k, v, do, sinks, segment_ids=seg, window=window)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *grads), want, strict=True):
        _assert_near(f"triton {name}", g, w)


def test_sink_limits():
    """Big sinks take almost all the mass (output -> 0); a -inf-like sink takes none. Both through
    the kernels' lse route and the xla path."""
    q, k, v, do, seg = _inputs()
    for kwargs in ({"implementation": "xla"}, {"implementation": "pallas", "block_sizes": BLOCKS}):
        huge = flash_attention(q, k, v, segment_ids=seg, sinks=jnp.full((N,), 60.0), **kwargs)
        assert float(jnp.max(jnp.abs(huge))) < 1e-15, kwargs
        none = flash_attention(q, k, v, segment_ids=seg, sinks=jnp.full((N,), -1e30), **kwargs)
        _assert_near(f"{kwargs['implementation']} sink -1e30", none, flash_attention(q, k, v, segment_ids=seg,
                                                                                      **kwargs))


# ------------------------------------------------------------------------------------------------
# sinks=None is today's attention, bitwise.
# ------------------------------------------------------------------------------------------------


def _todays_xla(q, k, v, *, segment_ids):
    """The `xla` path before sinks, verbatim (mha_reference's body)."""
    _, scores, mask = _block_scores_and_mask(q, k, True, segment_ids, None, None)
    scores = jnp.where(mask, scores, -1e30)
    probs = jnp.where(mask, jax.nn.softmax(scores, axis=-1), 0.0)
    out = jnp.einsum("bkgqs,bskh->bqkgh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(q.shape).astype(q.dtype)


def _assert_bitwise(name, got, want):
    for part, g, w in zip(("out", "dq", "dk", "dv"), jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{name} {part}")


def test_no_sinks_is_todays_output_bitwise(triton_attention):
    """sinks=None: the same output and gradients, bit for bit, as the call without the argument, as the
    pre-sinks xla formula, and (for the kernels, in fp32) as sinks of -1e30: exp(sink - lse) is exactly
    0, so the lse route gives lse' = lse and o' = o, the kernels' own numbers."""
    q, k, v, do, seg = _inputs()
    _assert_bitwise("xla vs today's formula", output_and_grads(flash_attention, q, k, v, do, None, segment_ids=seg,
                                                               implementation="xla"),
                    output_and_grads(_todays_xla, q, k, v, do, None, segment_ids=seg))
    kernels = {
        "xla": (flash_attention, {"implementation": "xla"}),
        "pallas": (flash_attention, {"implementation": "pallas", "block_sizes": BLOCKS}),
        "triton": (triton_attention.triton_flash_attention, {"block_sizes": BLOCKS}),
    }
    for name, (attention, kwargs) in kernels.items():
        kwargs = dict(kwargs, segment_ids=seg, window=WINDOW)
        without = output_and_grads(attention, q, k, v, do, None, **kwargs)
        explicit = lambda q, k, v, attention=attention, **kw: attention(q, k, v, sinks=None, **kw)
        _assert_bitwise(f"{name} sinks=None", output_and_grads(explicit, q, k, v, do, None, **kwargs), without)
        if name != "xla":
            out, (dq, dk, dv, _) = output_and_grads(attention, q, k, v, do, jnp.full((N,), -1e30), **kwargs)
            _assert_bitwise(f"{name} sinks=-1e30", (out, (dq, dk, dv)), without)


# ------------------------------------------------------------------------------------------------
# What is refused.
# ------------------------------------------------------------------------------------------------


def test_cudnn_refuses_sinks(monkeypatch):
    q, k, v, _, _ = random_inputs(0, 1, 16, 2, 1, 16, jnp.bfloat16)
    sinks = jnp.zeros((2,), jnp.float32)
    with pytest.raises(ValueError, match="'cudnn' takes no attention sinks"):
        cudnn_flash_attention(q, k, v, sinks=sinks)
    # Through the entry point, playing a GPU machine (the refusal comes before any cuDNN call).
    monkeypatch.setattr(attention_module, "available_implementations", lambda platform=None: ("xla", "cudnn"))
    with pytest.raises(ValueError, match="'cudnn' takes no attention sinks"):
        flash_attention(q, k, v, implementation="cudnn", sinks=sinks)


def test_bad_sinks_are_refused():
    q, k, v, _, _ = random_inputs(0, 1, 16, 2, 1, 16)
    for bad in (jnp.zeros((1,)), jnp.zeros((2, 1)), jnp.zeros((2,), jnp.int32)):
        for implementation in ("xla", "pallas"):
            with pytest.raises(ValueError, match=rf"'{implementation}': sinks must be a float array \[heads\] = \[2\]"):
                flash_attention(q, k, v, implementation=implementation, sinks=bad)


# ------------------------------------------------------------------------------------------------
# Value head size Hv != H (multi-head latent attention): 'xla' only.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_value_head_size_other_than_query_head_size_on_xla(with_sinks):
    """v [B, L, K, 24] against q/k head size 16: out [B, L, N, 24], scale 1/sqrt(16); the whole-row
    path, the banded path (window < L) and mha_reference with a window, forward and gradients."""
    Hv = 24
    q, k, v, do, seg = _inputs(5, Hv=Hv)
    sinks = _sinks(2) if with_sinks else None
    runs = (
        ("xla", flash_attention, {"implementation": "xla"}, None),
        ("xla window", flash_attention, {"implementation": "xla"}, WINDOW),
        ("xla banded", mha_local, {"chunk": 8}, WINDOW),
        ("reference window", mha_reference, {}, WINDOW),
    )
    for name, attention, kwargs, window in runs:
        out, grads = output_and_grads(attention, q, k, v, do, sinks, segment_ids=seg, window=window, **kwargs)
        assert out.shape == (B, L, N, Hv) and grads[2].shape == v.shape, name
        want = numpy_sink_attention(q, k, v, do, sinks, segment_ids=seg, window=window)
        names = ("out", "dq", "dk", "dv", "dsinks")[:len(grads) + 1]
        for part, g, w in zip(names, (out, *grads), want):
            _assert_near(f"{name} Hv={Hv} {part}", g, w)


def test_value_head_size_other_than_query_head_size_is_refused_by_the_kernels(triton_attention):
    q, k, _, _, _ = random_inputs(0, 1, 16, 2, 1, 192)
    v = jnp.zeros((1, 16, 1, 96), jnp.float32)
    message = "value head size 96 != query/key head size 192: only implementation 'xla' takes that"
    with pytest.raises(ValueError, match=f"'pallas': {message}"):
        flash_attention(q, k, v, implementation="pallas")
    with pytest.raises(ValueError, match=f"'pallas': {message}"):
        pallas_flash_attention(q, k, v)
    with pytest.raises(ValueError, match=f"'triton': {message}"):
        triton_attention.triton_flash_attention(q, k, v)
    with pytest.raises(ValueError, match=f"'cudnn': {message}"):
        cudnn_flash_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
    assert flash_attention(q, k, v, implementation="xla").shape == (1, 16, 2, 96)
    with pytest.raises(ValueError, match="same batch, seq and kv heads"):
        flash_attention(q, k, v[:, :, :0], implementation="xla")
