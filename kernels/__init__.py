"""Fused attention kernels behind one entry point, `flash_attention`.

This package depends on nothing in `jaxtrain/`; the model calls into it.
"""

from __future__ import annotations

from kernels.reference import mha_reference

IMPLEMENTATIONS = ("auto", "xla", "pallas", "triton", "cudnn")


def attention_flops(batch: int, seq: int, heads: int, head_dim: int, *, causal: bool = True) -> float:
    """Forward FLOPs of attention's two matmuls (QK^T and PV); causal counts half the score matrix."""
    flops = 4.0 * batch * seq * seq * heads * head_dim
    return flops / 2 if causal else flops


def flash_attention(q, k, v, *, causal: bool = True, segment_ids=None, implementation: str = "auto",
                    block_sizes=None):
    """Attention with q [B, L, N, H], k/v [B, L, K, H] (N a multiple of K), scale 1/sqrt(H).

    implementation: 'xla' (reference), 'pallas', 'triton', 'cudnn' or 'auto' (best for the platform).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {implementation!r}; choose from {IMPLEMENTATIONS}")
    if implementation in ("auto", "xla"):
        return mha_reference(q, k, v, causal=causal, segment_ids=segment_ids)
    raise NotImplementedError(f"attention implementation {implementation!r} is not available yet")
