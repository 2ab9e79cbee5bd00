"""Fused attention kernels behind one entry point, `flash_attention`.

    from jaxtrain.kernels import flash_attention
    out = flash_attention(q, k, v, causal=True, segment_ids=None, implementation="auto", window=None,
                          sinks=None)

`sinks` ([N] fp32, gpt-oss attention sinks) work in every implementation but 'cudnn'; a value head
size other than the query/key head size (v [B, L, K, Hv]) only in 'xla'.

Implementations: 'xla' (plain jnp reference, kernels/reference.py), 'pallas' (Pallas kernels,
kernels/pallas_attention.py; TPU, and CPU in interpret mode), 'triton' (Triton kernels via
jax-triton, kernels/triton_attention.py; NVIDIA GPU), 'cudnn' (kernels/cudnn_attention.py; NVIDIA
GPU), 'auto' (best available for the platform). See docs/kernels.md.

The folder sits at the repository's top (kernels/) but installs as `jaxtrain.kernels`
(pyproject.toml's package-dir): a bare `kernels` is Hugging Face's package, which transformers
imports. Inside the package every import is relative; it depends on nothing else in `jaxtrain/`,
and the model calls into it. Kernel modules are imported on first use, so `import
jaxtrain.kernels` needs neither triton nor jax-triton.
"""

from __future__ import annotations

from .attention import (
    AUTO_GPU_IMPLEMENTATION,
    BACKWARD_FLOPS_FACTOR,
    BLOCK_IMPLEMENTATIONS,
    attention_block,
    attention_block_bwd,
    IMPLEMENTATIONS,
    attention_flops,
    attention_training_flops,
    available_implementations,
    flash_attention,
    resolve_implementation,
)
from .common import BlockSizes, visited_tiles
from .reference import mha_local, mha_reference

__all__ = [
    "AUTO_GPU_IMPLEMENTATION",
    "BACKWARD_FLOPS_FACTOR",
    "BLOCK_IMPLEMENTATIONS",
    "attention_block",
    "attention_block_bwd",
    "IMPLEMENTATIONS",
    "BlockSizes",
    "attention_flops",
    "attention_training_flops",
    "available_implementations",
    "flash_attention",
    "mha_local",
    "mha_reference",
    "resolve_implementation",
    "visited_tiles",
]
