"""cuDNN fused attention through `jax.nn.dot_product_attention(..., implementation="cudnn")` (NVIDIA GPU).

Shape legend: B batch, L sequence length, N query heads, K kv heads, H head_dim.
"""

from __future__ import annotations

import jax

from .common import check_attention_inputs


def cudnn_flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                          segment_ids: jax.Array | None = None) -> jax.Array:
    """cuDNN flash attention; GQA is native, scale 1/sqrt(H), differentiable (cuDNN's backward).

    Args:
      q: [B, L, N, H]; k, v: [B, L, K, H] with N a multiple of K; fp16 or bf16 (cuDNN's limits).
      causal: causal mask (cuDNN skips the masked half).
      segment_ids: [B, L]; passed to cuDNN as a boolean [B, 1, L, L] mask, which it turns into a
        bias, so it costs O(L^2) memory: fine for checks, slow for packed long sequences.

    Returns:
      [B, L, N, H] in q's dtype.
    """
    check_attention_inputs(q, k, v, segment_ids)
    mask_B1LL = None
    if segment_ids is not None:
        mask_B1LL = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask_B1LL, is_causal=causal, implementation="cudnn")
