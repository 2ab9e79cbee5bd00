"""Attention glue between the model and `kernels/`: which implementation runs, and how a kernel
that XLA cannot partition runs on each device's shard.

`resolve_attention` turns `model.attention` (`auto`, `xla`, `pallas`, `triton`, `cudnn`) into the
implementation for this platform and refuses a rules table under which a per-shard kernel would
compute something else. `attend` is the causal attention the decoder calls.
"""

from __future__ import annotations

import jax

import kernels
from jaxtrain.config import Config, ConfigError
from jaxtrain.parallel.sharding import KERNEL_WHOLE_AXES, Partitioning, check_attention_layout


def resolve_attention(cfg: Config, platform: str, mesh_sizes: dict[str, int]) -> str:
    """`model.attention` resolved for this platform and checked against the rules table.

    Raises:
      ConfigError: not available here, or a rules table under which the kernel would be wrong.
    """
    try:
        implementation = kernels.resolve_implementation(cfg.model.attention, platform)
    except ValueError as e:
        raise ConfigError(f"model.attention={cfg.model.attention}: {e}") from None
    check_attention_layout(cfg.mesh.rules, mesh_sizes, implementation)
    return implementation


@jax.named_scope("attention")  # `jaxtrain profile-summary` counts the ops under this scope as attention
def attend(q_BLNH: jax.Array, k_BLKH: jax.Array, v_BLKH: jax.Array, segment_ids_BL: jax.Array | None,
           implementation: str, partitioning: Partitioning) -> jax.Array:
    """Causal grouped-query attention [B, L, N, H] with `model.attention`'s implementation.

    `xla` is plain jnp that XLA partitions itself; a kernel is opaque to the partitioner, so it
    runs per shard (batch and heads are independent; length and head_dim must be whole).
    """
    implementation = kernels.resolve_implementation(implementation)  # 'auto' -> this platform's best
    run = lambda q, k, v, seg: kernels.flash_attention(q, k, v, causal=True, segment_ids=seg,
                                                       implementation=implementation)
    if implementation == "xla":
        return run(q_BLNH, k_BLKH, v_BLKH, segment_ids_BL)
    qkv = ("batch", "length", "heads", "head_dim")
    kv = ("batch", "length", "kv_heads", "head_dim")
    return partitioning.per_shard(run, (qkv, kv, kv, ("batch", "length")), qkv,
                                  whole=KERNEL_WHOLE_AXES)(q_BLNH, k_BLKH, v_BLKH, segment_ids_BL)
