"""The one entry point, `flash_attention`, and how an implementation is chosen for a platform.

Shape legend: B batch, L sequence length, N query heads, K kv heads, H head_dim, Hv value head size.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp

from .common import BlockSizes, check_attention_inputs, check_sinks, check_window
from .reference import mha_local, mha_reference

IMPLEMENTATIONS = ("auto", "xla", "pallas", "triton", "cudnn")

# What `auto` picks on an NVIDIA GPU. The single switch between our Triton kernel and cuDNN:
# set it to "cudnn" if tpu_gpu_setup/gpu/check_attention.py shows cuDNN faster on the target GPU.
AUTO_GPU_IMPLEMENTATION = "triton"

# The Pallas kernels are written for TPU (Mosaic) and run on CPU in interpret mode. On GPU they
# would go through Pallas' Triton backend, which is not verified: check_attention.py tries it and
# reports. Flip this only after that check passes on the GPU.
PALLAS_ON_GPU = False

_PLATFORM_ALIASES = {"cuda": "gpu"}


def _platform(platform: str | None) -> str:
    name = (platform or jax.default_backend()).lower()
    return _PLATFORM_ALIASES.get(name, name)


def _has_module(name: str) -> bool:
    # find_spec does not import: `import jax_triton` itself raises under a CPU-only jax.
    return importlib.util.find_spec(name) is not None


def available_implementations(platform: str | None = None) -> tuple[str, ...]:
    """Concrete implementations (not 'auto') that can run on `platform`.

    Args:
      platform: 'cpu', 'gpu' (or 'cuda'), 'tpu'; None = jax.default_backend().

    Returns:
      e.g. ('xla', 'pallas') on CPU (pallas in interpret mode), ('xla', 'pallas') on TPU,
      ('xla', 'triton', 'cudnn') on an NVIDIA GPU with triton and jax-triton installed.
    """
    platform = _platform(platform)
    if platform in ("cpu", "tpu"):
        return ("xla", "pallas")
    if platform == "gpu":
        found = ["xla"]
        if PALLAS_ON_GPU:
            found.append("pallas")
        if _has_module("triton") and _has_module("jax_triton"):
            found.append("triton")
        found.append("cudnn")
        return tuple(found)
    return ("xla",)


# cuDNN's fused attention has no fp32 path (jax.nn.dot_product_attention refuses it).
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def _cudnn_takes(dtype) -> bool:
    return dtype is None or jnp.dtype(dtype) in tuple(jnp.dtype(d) for d in CUDNN_DTYPES)


def _auto(platform: str, available: tuple[str, ...], dtype) -> str:
    if platform == "gpu":
        preference = (AUTO_GPU_IMPLEMENTATION, "triton", "cudnn", "xla")
        if not _cudnn_takes(dtype):  # fp32 without triton: XLA, not a cuDNN call that refuses fp32
            preference = tuple(name for name in preference if name != "cudnn")
    elif platform == "tpu":
        preference = ("pallas", "xla")
    else:  # CPU and anything else: interpret-mode Pallas is for tests, not speed.
        preference = ("xla",)
    return next(name for name in preference if name in available)


def resolve_implementation(name: str, platform: str | None = None, dtype=None,
                           available: tuple[str, ...] | None = None) -> str:
    """Validates an implementation name for a platform and input dtype, and resolves 'auto'.

    The one place that decides which implementation runs: `flash_attention` calls it with the
    inputs' dtype, and the trainer (through `jaxtrain.model.attention`) with the precision
    policy's compute dtype before training, so a bad choice fails at startup.

    Args:
      name: one of IMPLEMENTATIONS.
      platform: 'cpu', 'gpu' (or 'cuda'), 'tpu'; None = jax.default_backend().
      dtype: dtype of q/k/v; None = not known (no dtype rule applies). 'auto' never picks
        cuDNN for a dtype it refuses (fp32), and an explicit 'cudnn' with one is an error.
      available: the implementations that can run here; None = `available_implementations(platform)`
        (what is installed). Tests pass a fake list to play another machine.

    Returns:
      The concrete implementation to run ('xla', 'pallas', 'triton' or 'cudnn').

    Raises:
      ValueError: unknown name, not available on this platform (the message names the
        implementation, the platform and what is available), or 'cudnn' with fp32.
    """
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {name!r}; choose from {', '.join(IMPLEMENTATIONS)}")
    platform = _platform(platform)
    available = available_implementations(platform) if available is None else tuple(available)
    if name == "auto":
        return _auto(platform, available, dtype)
    if name not in available:
        hint = ""
        if name == "triton" and platform == "gpu":
            hint = " (needs the `triton` and `jax-triton` packages)"
        elif name in ("triton", "cudnn"):
            hint = " (needs an NVIDIA GPU)"
        elif name == "pallas" and platform == "gpu":
            hint = " (the Pallas kernels target TPU; see jaxtrain.kernels.attention.PALLAS_ON_GPU)"
        raise ValueError(
            f"attention implementation {name!r} is not available on platform {platform!r}{hint}; "
            f"available: {', '.join(('auto',) + available)}"
        )
    if name == "cudnn" and not _cudnn_takes(dtype):
        raise ValueError(f"attention implementation 'cudnn' takes bf16 or fp16 inputs, not {jnp.dtype(dtype).name}; "
                         "use a bf16/fp16 precision policy, or 'auto'/'xla'")
    return name


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    implementation: str = "auto",
    block_sizes: BlockSizes | tuple[int, int] | None = None,
    window: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """softmax(q k^T / sqrt(H)) v with GQA, causal, sliding-window and segment (packed document) masking,
    and optional attention sinks.

    Differentiable: 'pallas' and 'triton' have custom VJPs with fused backward kernels.

    Args:
      q: [B, L, N, H] queries.
      k: [B, L, K, H] keys; N must be a multiple of K (GQA; K == 1 is MQA).
      v: [B, L, K, Hv] values. Hv == H, except on 'xla', which takes any Hv (multi-head latent
        attention; the scale stays 1/sqrt(H)); the other implementations refuse Hv != H.
      causal: a query sees only keys at or before its position.
      segment_ids: [B, L] int32; a query sees only keys with the same id. None = one segment.
      implementation: 'auto', 'xla', 'pallas', 'triton' or 'cudnn' (see resolve_implementation).
      block_sizes: tile sizes for 'pallas'/'triton' (BlockSizes or (block_q, block_kv));
        None = each kernel's defaults. Ignored by 'xla' and 'cudnn'.
      window: sliding window (static int >= 1, needs causal=True) or None. Query i sees key j iff
        0 <= i - j < window: itself and the window - 1 keys before it, transformers'
        `sliding_window` (Gemma 2/3, Mistral). By index in the row, and a key must also share the
        query's segment: inside one packed document index distance is position distance, so this
        is the window per document. 'pallas' and 'triton' skip the kv tiles wholly outside the
        window (their loops start at the first tile in it), 'xla' computes only the band of
        scores the window reaches (`mha_local`), 'cudnn' passes it to cuDNN's sliding window.
        A window >= L is plain causal attention.
      sinks: [N] float (fp32) attention-sink logits, one per query head (gpt-oss), or None. Each
        softmax row of head n gets one more term exp(sinks[n]) in its denominator: o = sum_j
        exp(s_j) v_j / (sum_j exp(s_j) + exp(sinks[n])), transformers' GptOss eager attention (the
        sink as an extra logit column, dropped after the softmax). Differentiable: the sinks get
        gradients. 'pallas' and 'triton' apply it outside their kernels through the row log-sum-exp;
        'cudnn' refuses it.

    Returns:
      [B, L, N, Hv] in q's dtype. A row that sees no key is 0, and so are its gradients.

    Raises:
      ValueError: bad shapes (Hv != H outside 'xla'), an implementation not available on this
        platform, 'cudnn' with fp32 inputs ('auto' never picks cuDNN for fp32) or with sinks, bad
        sinks (not a float [N] array), or a bad window (not a positive int, or with causal=False).
    """
    check_attention_inputs(q, k, v, segment_ids)  # Hv != H is checked against the implementation below
    name = resolve_implementation(implementation, dtype=q.dtype)
    check_attention_inputs(q, k, v, segment_ids, name)
    window = check_window(window, causal, name)
    sinks = check_sinks(sinks, q.shape[2], name)
    if name == "xla":
        if window is not None and window < q.shape[1]:
            return mha_local(q, k, v, window=window, segment_ids=segment_ids, sinks=sinks)
        return mha_reference(q, k, v, causal=causal, segment_ids=segment_ids, sinks=sinks)
    if name == "pallas":
        from .pallas_attention import pallas_flash_attention

        return pallas_flash_attention(q, k, v, causal=causal, segment_ids=segment_ids, block_sizes=block_sizes,
                                      window=window, sinks=sinks)
    if name == "triton":
        from .triton_attention import triton_flash_attention

        return triton_flash_attention(q, k, v, causal=causal, segment_ids=segment_ids, block_sizes=block_sizes,
                                      window=window, sinks=sinks)
    from .cudnn_attention import cudnn_flash_attention

    return cudnn_flash_attention(q, k, v, causal=causal, segment_ids=segment_ids, window=window, sinks=sinks)


BLOCK_IMPLEMENTATIONS = ("xla", "pallas", "triton")  # those with a blockwise form (attention_block)


def attention_block(q, k, v, *, causal: bool, segment_ids=None, kv_segment_ids=None, implementation: str = "xla"):
    """One block of a blockwise attention (ring / context parallelism): (o, lse), o [B, L, N, H] fp32 and
    lse [B, L, N] fp32 (MASK_VALUE for a row that sees no key), so that blocks over disjoint keys combine
    exactly. Not differentiable by itself: its backward is `attention_block_bwd`. `implementation`:
    a concrete one of BLOCK_IMPLEMENTATIONS."""
    if implementation == "xla":
        from .reference import attention_block as block
    elif implementation == "pallas":
        from .pallas_attention import pallas_attention_block as block
    elif implementation == "triton":
        from .triton_attention import triton_attention_block as block
    else:
        raise ValueError(f"attention implementation {implementation!r} has no blockwise form; "
                         f"choose from {', '.join(BLOCK_IMPLEMENTATIONS)}")
    return block(q, k, v, causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids)


def attention_block_bwd(q, k, v, o, lse, do, *, causal: bool, segment_ids=None, kv_segment_ids=None,
                        implementation: str = "xla"):
    """(dq, dk, dv) fp32 of one block, given the combined output o, its lse over all blocks and dO."""
    if implementation == "xla":
        from .reference import attention_block_bwd as bwd
    elif implementation == "pallas":
        from .pallas_attention import pallas_attention_block_bwd as bwd
    elif implementation == "triton":
        from .triton_attention import triton_attention_block_bwd as bwd
    else:
        raise ValueError(f"attention implementation {implementation!r} has no blockwise form; "
                         f"choose from {', '.join(BLOCK_IMPLEMENTATIONS)}")
    return bwd(q, k, v, o, lse, do, causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids)


def attention_flops(batch: int, seq: int, heads: int, head_dim: int, *, causal: bool = True,
                    window: int | None = None) -> float:
    """Forward FLOPs of attention's two matmuls, QK^T and PV: 4 * B * L^2 * N * H.

    Causal counts half of the score matrix (what a kernel that skips masked tiles does, and the
    MaxText convention). A sliding window (causal) counts the band L * W - W^2 / 2 in place of
    L^2 / 2 (the same at W = L). Softmax and masking are not counted.
    """
    if window is not None and causal and window < seq:
        return 4.0 * batch * heads * head_dim * (seq * window - window * window / 2)
    flops = 4.0 * batch * seq * seq * heads * head_dim
    return flops / 2 if causal else flops


# Backward of flash attention = 5 matmuls of the forward's size (recompute QK^T, dP = dO V^T,
# dV = P^T dO, dQ = dS K, dK = dS^T Q) against the forward's 2: 2.5x, the FlashAttention convention.
BACKWARD_FLOPS_FACTOR = 2.5


def attention_training_flops(batch: int, seq: int, heads: int, head_dim: int, *, causal: bool = True,
                             window: int | None = None, backward_factor: float = BACKWARD_FLOPS_FACTOR) -> float:
    """Forward + backward attention FLOPs: (1 + backward_factor) * attention_flops(...).

    Args:
      batch, seq, heads, head_dim, causal, window: as for attention_flops (heads = query heads).
      backward_factor: backward FLOPs per forward FLOP. 2.5 (default) counts the backward's
        recomputation of QK^T, as flash-attention kernel benchmarks do; pass 2.0 for strict
        model FLOPs (no recomputation), as in PaLM-style MFU.

    Returns:
      FLOPs of one training step's attention (one layer).
    """
    return (1.0 + backward_factor) * attention_flops(batch, seq, heads, head_dim, causal=causal, window=window)
