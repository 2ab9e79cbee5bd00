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
    K = k.shape[2]
    q_BLKGH = q.reshape(B, L, K, N // K, H)
    scores = jnp.einsum("bqkgh,bskh->bkgqs", q_BLKGH, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / jnp.sqrt(jnp.float32(H)))
    S = k.shape[1]
    mask = jnp.ones((L, S), dtype=bool)
    if causal:
        mask = jnp.arange(L)[:, None] >= jnp.arange(S)[None, :]
    mask = jnp.broadcast_to(mask, (B, L, S))
    if segment_ids is not None:
        kv_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
        mask = mask & (segment_ids[:, :, None] == kv_ids[:, None, :])
    scores = jnp.where(mask[:, None, None], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1)
    # A row with nothing to attend to (fully masked) gives zeros, not a uniform average.
    probs = jnp.where(mask[:, None, None], probs, 0.0)
    out = jnp.einsum("bkgqs,bskh->bqkgh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(B, L, N, H).astype(q.dtype)
