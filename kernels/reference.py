"""Reference attention in plain jnp with an fp32 softmax: the ground truth every kernel is tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mha_reference(q, k, v, *, causal: bool = True, segment_ids=None, kv_segment_ids=None):
    """softmax(q k^T / sqrt(H)) v with GQA, causal and segment masking.

    q: [B, L, N, H]; k, v: [B, L, K, H] with N a multiple of K; segment_ids: [B, L] int32 or None.
    kv_segment_ids: ids of the keys when they differ from the queries' (default: segment_ids);
    tests use it to build rows that see no key at all.
    Returns [B, L, N, H] in q's dtype.
    """
    B, L, N, H = q.shape
    _, scores, mask = _block_scores_and_mask(q, k, causal, segment_ids, kv_segment_ids)
    scores = jnp.where(mask, scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1)
    # A row with nothing to attend to (fully masked) gives zeros, not a uniform average.
    probs = jnp.where(mask, probs, 0.0)
    out = jnp.einsum("bkgqs,bskh->bqkgh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(B, L, N, H).astype(q.dtype)


# ------------------------------------------------------------------------------------------------
# One block of a blockwise (ring / context-parallel) attention: the output with its log-sum-exp, so
# that blocks over disjoint key sets combine exactly (online softmax), and the backward pass of a
# block given the *combined* output and lse (FlashAttention's backward reads only o, lse and dO).
# ------------------------------------------------------------------------------------------------


def _block_scores_and_mask(q, k, causal, segment_ids, kv_segment_ids):
    B, L, N, H = q.shape
    K, S = k.shape[2], k.shape[1]
    q_BLKGH = q.reshape(B, L, K, N // K, H)
    scores = jnp.einsum("bqkgh,bskh->bkgqs", q_BLKGH, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / jnp.sqrt(jnp.float32(H)))
    mask = jnp.ones((L, S), dtype=bool)
    if causal:
        mask = jnp.arange(L)[:, None] >= jnp.arange(S)[None, :]
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
    return out.reshape(B, L, N, H), lse.reshape(B, N, L).transpose(0, 2, 1)


def attention_block_bwd(q, k, v, o, lse, do, *, causal: bool, segment_ids=None, kv_segment_ids=None):
    """(dq, dk, dv) fp32 of one block, given the combined output o [B, L, N, H], its lse [B, L, N]
    (over every block) and the output cotangent do: the block's share of the exact gradient."""
    B, L, N, H = q.shape
    K = k.shape[2]
    q_BLKGH, scores, mask = _block_scores_and_mask(q, k, causal, segment_ids, kv_segment_ids)
    lse_BKGL1 = lse.transpose(0, 2, 1).reshape(B, K, N // K, L, 1)
    p = jnp.where(mask, jnp.exp(scores - lse_BKGL1), 0.0)  # the combined softmax's probabilities
    do_BLKGH = do.reshape(B, L, K, N // K, H)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # [B, L, N]
    delta_BKGL1 = delta.transpose(0, 2, 1).reshape(B, K, N // K, L, 1)
    dv = jnp.einsum("bkgqs,bqkgh->bskh", p, do_BLKGH, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bqkgh,bskh->bkgqs", do_BLKGH, v, preferred_element_type=jnp.float32)
    ds = p * (dp - delta_BKGL1) * (1.0 / jnp.sqrt(jnp.float32(H)))
    dq = jnp.einsum("bkgqs,bskh->bqkgh", ds, k, preferred_element_type=jnp.float32).reshape(B, L, N, H)
    dk = jnp.einsum("bkgqs,bqkgh->bskh", ds, q_BLKGH, preferred_element_type=jnp.float32)
    return dq, dk, dv
