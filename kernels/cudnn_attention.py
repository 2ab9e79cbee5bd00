"""cuDNN fused attention through `jax.nn.dot_product_attention(..., implementation="cudnn")` (NVIDIA GPU).

Shape legend: B batch, L sequence length, N query heads, K kv heads, H head_dim.
"""

from __future__ import annotations

import jax

from .common import check_attention_inputs, check_sinks, check_window


def cudnn_flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                          segment_ids: jax.Array | None = None, window: int | None = None,
                          sinks: jax.Array | None = None) -> jax.Array:
    """cuDNN flash attention; GQA is native, scale 1/sqrt(H), differentiable (cuDNN's backward).

    Args:
      q: [B, L, N, H]; k, v: [B, L, K, H] with N a multiple of K; fp16 or bf16 (cuDNN's limits).
      causal: causal mask (cuDNN skips the masked half).
      segment_ids: [B, L]; passed to cuDNN as a boolean [B, 1, L, L] mask, which it turns into a
        bias, so it costs O(L^2) memory: fine for checks, slow for packed long sequences.
      window: sliding window (needs causal): query i sees keys i - window < j <= i. Passed as
        `local_window_size=(window - 1, 0)`, which jax turns into cuDNN's `sliding_window_length
        = window` (cuDNN's left window with an exclusive bound under the causal mask).
      sinks: must be None: jax.nn.dot_product_attention has no sink term (a ValueError otherwise).

    Returns:
      [B, L, N, H] in q's dtype.

    Raises:
      ValueError: bad shapes (v's head size must equal q's here), a bad window, or sinks.
    """
    check_attention_inputs(q, k, v, segment_ids, "cudnn")
    window = check_window(window, causal, "cudnn")
    check_sinks(sinks, q.shape[2], "cudnn")
    mask_B1LL = None
    if segment_ids is not None:
        mask_B1LL = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    local = None if window is None else (window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, mask=mask_B1LL, is_causal=causal, local_window_size=local,
                                        implementation="cudnn")
