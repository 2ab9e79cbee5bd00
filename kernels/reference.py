"""Reference attention in plain jnp with an fp32 softmax: the ground truth every kernel is tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .common import check_window


def _sink_logits(sinks, K: int, G: int, ndim: int):
    """sinks [N] fp32 -> [1, K, G, 1, ...] against scores laid out [..., K, G, rows, keys] (ndim dims);
    query head n = kv head * G + g, as q.reshape(..., K, G, H) splits it."""
    return jnp.asarray(sinks, jnp.float32).reshape((1,) * (ndim - 4) + (K, G, 1, 1))


def _masked_softmax(scores, mask, sink=None):
    """softmax over the last axis, 0 where `mask` is False (a row that sees no key is all 0).

    With `sink` (logits broadcasting against the rows), each row's denominator gets one more term
    exp(sink): transformers' GptOss eager attention, which appends the sink as an extra logit
    column, takes the softmax and drops that column. The row max is a constant of the softmax, so it
    gets no gradient (as in jax.nn.softmax); d/d sink flows through exp(sink - m).
    """
    if sink is None:
        return jnp.where(mask, jax.nn.softmax(scores, axis=-1), 0.0)
    m = jax.lax.stop_gradient(jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink))
    e = jnp.where(mask, jnp.exp(scores - m), 0.0)
    return e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - m))


def mha_reference(q, k, v, *, causal: bool = True, segment_ids=None, kv_segment_ids=None, window=None, sinks=None):
    """softmax(q k^T / sqrt(H)) v with GQA, causal, sliding-window and segment masking, and attention sinks.

    q: [B, L, N, H]; k: [B, L, K, H]; v: [B, L, K, Hv] with N a multiple of K (Hv may differ from
    H: multi-head latent attention; the scale stays 1/sqrt(H)); segment_ids: [B, L] int32 or None.
    kv_segment_ids: ids of the keys when they differ from the queries' (default: segment_ids);
    tests use it to build rows that see no key at all.
    window: None, or a static int >= 1 with causal=True: query i also needs i - j < window
    (transformers' sliding_window: the query and the window - 1 keys before it). By index in
    the row: with packed documents the segment mask applies too, and inside one document the
    index distance is the position distance, so this is the per-document window. Masks the
    whole [L, L] score matrix (the ground truth); the `xla` path's windowed form is `mha_local`.
    sinks: None, or [N] float logits (gpt-oss): exp(sinks[n]) joins the softmax denominator of
    every row of head n (probability mass with no value); differentiable.
    Returns [B, L, N, Hv] in q's dtype.
    """
    B, L, N, H = q.shape
    K, Hv = k.shape[2], v.shape[3]
    window = check_window(window, causal, "xla")
    _, scores, mask = _block_scores_and_mask(q, k, causal, segment_ids, kv_segment_ids, window)
    scores = jnp.where(mask, scores, -1e30)
    sink = None if sinks is None else _sink_logits(sinks, K, N // K, scores.ndim)
    # A row with nothing to attend to (fully masked) gives zeros, not a uniform average.
    probs = _masked_softmax(scores, mask, sink)
    out = jnp.einsum("bkgqs,bskh->bqkgh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(B, L, N, Hv).astype(q.dtype)


def mha_local(q, k, v, *, window: int, segment_ids=None, kv_segment_ids=None, chunk: int | None = None,
              sinks=None):
    """Causal sliding-window attention that computes only the band of scores the window reaches:
    `mha_reference(q, k, v, causal=True, window=window, ...)` in O(L * (chunk + window)) FLOPs
    and memory instead of O(L^2). The `xla` path's form when the window is shorter than the row.

    Queries go in chunks of c rows (`chunk`; None = max(128, window / 4), at most L). Chunk t sees
    the keys of key chunks t - m .. t, m = ceil((window - 1) / c): a band of (m + 1) * c keys built
    from m + 1 shifted slices of the chunked keys (slices and a concatenation, whose transposes are
    pads and adds: no gather, no scatter). Inside the band the window, causal and segment masks
    apply as in mha_reference, and so do the sinks. When the band would hold the whole row this
    is mha_reference.

    q: [B, L, N, H]; k: [B, L, K, H]; v: [B, L, K, Hv]; segment_ids / kv_segment_ids: [B, L] int or
    None; sinks: [N] float or None (see mha_reference).
    Returns [B, L, N, Hv] in q's dtype.
    """
    window = check_window(window, True, "xla")
    B, L, N, H = q.shape
    K, Hv = k.shape[2], v.shape[3]
    c = min(L, chunk or max(128, -(-window // 4)))
    T = -(-L // c)  # query chunks
    Lp = T * c
    m = -(-(window - 1) // c)  # earlier key chunks a query chunk can reach
    band = (m + 1) * c
    if band >= L:
        return mha_reference(q, k, v, causal=True, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                             window=window, sinks=sinks)

    def key_band(x_BLX):  # [B, L, ...] -> [B, T, band, ...]: key chunks t - m .. t for query chunk t
        widths = ((0, 0), (m * c, Lp - L)) + ((0, 0),) * (x_BLX.ndim - 2)
        chunks = jnp.pad(x_BLX, widths).reshape(B, T + m, c, *x_BLX.shape[2:])
        return jnp.concatenate([chunks[:, i:i + T] for i in range(m + 1)], axis=2)

    q_BTCKGH = jnp.pad(q, ((0, 0), (0, Lp - L), (0, 0), (0, 0))).reshape(B, T, c, K, N // K, H)
    k_BTSKH, v_BTSKH = key_band(k), key_band(v)  # v: [B, T, band, K, Hv]
    scores = jnp.einsum("btckgh,btskh->btkgcs", q_BTCKGH, k_BTSKH, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / jnp.sqrt(jnp.float32(H)))
    q_pos_TC = jnp.arange(Lp).reshape(T, c)
    k_pos_TS = (jnp.arange(T)[:, None] - m) * c + jnp.arange(band)[None, :]
    distance = q_pos_TC[:, :, None] - k_pos_TS[:, None, :]
    mask = (distance >= 0) & (distance < window) & (k_pos_TS[:, None, :] >= 0)  # [T, c, band]
    mask = jnp.broadcast_to(mask, (B, T, c, band))
    if segment_ids is not None:
        kv_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
        q_seg = jnp.pad(segment_ids, ((0, 0), (0, Lp - L))).reshape(B, T, c)
        mask = mask & (q_seg[..., None] == key_band(kv_ids)[:, :, None, :])
    mask = mask[:, :, None, None]  # [B, T, 1, 1, c, band] against scores [B, T, K, G, c, band]
    scores = jnp.where(mask, scores, -1e30)
    sink = None if sinks is None else _sink_logits(sinks, K, N // K, scores.ndim)
    probs = _masked_softmax(scores, mask, sink)
    out = jnp.einsum("btkgcs,btskh->btckgh", probs.astype(v.dtype), v_BTSKH, preferred_element_type=jnp.float32)
    return out.reshape(B, Lp, N, Hv)[:, :L].astype(q.dtype)


# ------------------------------------------------------------------------------------------------
# One block of a blockwise (ring / context-parallel) attention: the output with its log-sum-exp, so
# that blocks over disjoint key sets combine exactly (online softmax), and the backward pass of a
# block given the *combined* output and lse (FlashAttention's backward reads only o, lse and dO).
# ------------------------------------------------------------------------------------------------


def _block_scores_and_mask(q, k, causal, segment_ids, kv_segment_ids, window=None):
    B, L, N, H = q.shape
    K, S = k.shape[2], k.shape[1]
    q_BLKGH = q.reshape(B, L, K, N // K, H)
    scores = jnp.einsum("bqkgh,bskh->bkgqs", q_BLKGH, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / jnp.sqrt(jnp.float32(H)))
    mask = jnp.ones((L, S), dtype=bool)
    if causal:
        distance = jnp.arange(L)[:, None] - jnp.arange(S)[None, :]
        mask = distance >= 0 if window is None else (distance >= 0) & (distance < window)
    mask = jnp.broadcast_to(mask, (B, L, S))
    if segment_ids is not None:
        kv_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
        mask = mask & (segment_ids[:, :, None] == kv_ids[:, None, :])
    return q_BLKGH, scores, mask[:, None, None]  # mask [B, 1, 1, L, S] against scores [B, K, G, L, S]


def attention_block(q, k, v, *, causal: bool, segment_ids=None, kv_segment_ids=None):
    """(o, lse) of q against one block of keys: o [B, L, N, H] fp32, lse [B, L, N] fp32.

    A row that sees no key of this block has o = 0 and lse = MASK_VALUE (-1e30), so it weighs
    nothing when blocks are combined: o = sum_b exp(lse_b - lse) o_b, lse = logsumexp_b lse_b.
    """
    B, L, N, H = q.shape
    _, scores, mask = _block_scores_and_mask(q, k, causal, segment_ids, kv_segment_ids)
    scores = jnp.where(mask, scores, -1e30)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(scores - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    out = jnp.einsum("bkgqs,bskh->bqkgh", (p / l_safe).astype(v.dtype), v, preferred_element_type=jnp.float32)
    lse = jnp.where(empty, -1e30, m + jnp.log(l_safe))[..., 0]  # [B, K, G, L]
    return out.reshape(B, L, N, v.shape[3]), lse.reshape(B, N, L).transpose(0, 2, 1)


def attention_block_bwd(q, k, v, o, lse, do, *, causal: bool, segment_ids=None, kv_segment_ids=None):
    """(dq, dk, dv) fp32 of one block, given the combined output o [B, L, N, H], its lse [B, L, N]
    (over every block) and the output cotangent do: the block's share of the exact gradient."""
    B, L, N, H = q.shape
    K = k.shape[2]
    q_BLKGH, scores, mask = _block_scores_and_mask(q, k, causal, segment_ids, kv_segment_ids)
    lse_BKGL1 = lse.transpose(0, 2, 1).reshape(B, K, N // K, L, 1)
    p = jnp.where(mask, jnp.exp(scores - lse_BKGL1), 0.0)  # the combined softmax's probabilities
    do_BLKGH = do.reshape(B, L, K, N // K, v.shape[3])
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # [B, L, N]
    delta_BKGL1 = delta.transpose(0, 2, 1).reshape(B, K, N // K, L, 1)
    dv = jnp.einsum("bkgqs,bqkgh->bskh", p, do_BLKGH, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bqkgh,bskh->bkgqs", do_BLKGH, v, preferred_element_type=jnp.float32)
    ds = p * (dp - delta_BKGL1) * (1.0 / jnp.sqrt(jnp.float32(H)))
    dq = jnp.einsum("bkgqs,bskh->bqkgh", ds, k, preferred_element_type=jnp.float32).reshape(B, L, N, H)
    dk = jnp.einsum("bkgqs,bqkgh->bskh", ds, q_BLKGH, preferred_element_type=jnp.float32)
    return dq, dk, dv
