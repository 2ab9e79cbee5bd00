"""Attention written out in float64 numpy, forward and backward by hand: an implementation that shares
no code with `kernels/` (neither `mha_reference`, the `xla` path, nor JAX's autodiff).

Conventions the kernels promise: q [B, L, N, H], k/v [B, L, K, H], query head n uses kv head
n // (N/K); scores scaled by 1/sqrt(H); causal keeps keys at or before the query; segment ids must
be equal to attend; a sliding window (with causal) keeps keys j with i - window < j <= i;
a query that sees no key at all gets zeros.
"""

from __future__ import annotations

import numpy as np


def attention_fwd_bwd(q, k, v, do, *, causal: bool, segment_ids=None, window=None):
    """(out, dq, dk, dv), all float64 numpy, for cotangent `do`."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    B, L, N, H = q.shape
    K = k.shape[2]
    group = N // K
    scale = 1.0 / np.sqrt(H)
    allowed = np.ones((B, L, L), bool)
    if causal:
        allowed &= np.tril(np.ones((L, L), bool))[None]
    if window is not None:
        allowed &= ~np.tril(np.ones((L, L), bool), -window)[None]  # drop keys window or more back
    if segment_ids is not None:
        seg = np.asarray(segment_ids)
        allowed &= seg[:, :, None] == seg[:, None, :]
    out, dq = np.zeros_like(q), np.zeros_like(q)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for b in range(B):
        for n in range(N):
            kv = n // group
            s = q[b, :, n] @ k[b, :, kv].T * scale  # [L, L]
            s = np.where(allowed[b], s, -np.inf)
            row_max = np.max(s, axis=1, keepdims=True)
            row_max = np.where(np.isfinite(row_max), row_max, 0.0)
            e = np.where(allowed[b], np.exp(s - row_max), 0.0)
            denom = e.sum(axis=1, keepdims=True)
            p = np.divide(e, denom, out=np.zeros_like(e), where=denom > 0)  # empty rows: zeros
            o = p @ v[b, :, kv]
            out[b, :, n] = o
            g = do[b, :, n]
            dv[b, :, kv] += p.T @ g
            dp = g @ v[b, :, kv].T
            ds = p * (dp - np.sum(g * o, axis=1, keepdims=True))
            dq[b, :, n] = ds @ k[b, :, kv] * scale
            dk[b, :, kv] += ds.T @ q[b, :, n] * scale
    return out, dq, dk, dv
