"""Fused attention kernels behind one entry point, `flash_attention`.

    from kernels import flash_attention
    out = flash_attention(q, k, v, causal=True, segment_ids=None, implementation="auto")

Implementations: 'xla' (plain jnp reference, kernels/reference.py), 'pallas' (Pallas kernels,
kernels/pallas_attention.py; TPU, and CPU in interpret mode), 'triton' (Triton kernels via
jax-triton, kernels/triton_attention.py; NVIDIA GPU), 'cudnn' (kernels/cudnn_attention.py; NVIDIA
GPU), 'auto' (best available for the platform). See docs/kernels.md.

This package depends on nothing in `jaxtrain/`; the model calls into it. Kernel modules are
imported on first use, so `import kernels` needs neither triton nor jax-triton.
"""

from __future__ import annotations

from kernels.attention import (
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
from kernels.common import BlockSizes
from kernels.reference import mha_reference

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
    "mha_reference",
    "resolve_implementation",
]
