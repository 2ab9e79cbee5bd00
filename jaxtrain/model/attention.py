"""Attention glue between the model and `kernels/`: which implementation runs, and how a kernel
that XLA cannot partition runs on each device's shard.

`resolve_attention` turns `model.attention` (`auto`, `xla`, `pallas`, `triton`, `cudnn`) into the
implementation for this platform, compute dtype and set of installed libraries, and refuses a
rules table under which a per-shard kernel would compute something else. `attend` is the causal
attention the decoder calls; it resolves `auto` by the same rule (`kernels.resolve_implementation`)
with the dtype it is traced with, so the model and the startup check agree.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

import jaxtrain.kernels as kernels
from jaxtrain.config import Config, ConfigError
from jaxtrain.parallel import context
from jaxtrain.parallel.sharding import KERNEL_WHOLE_AXES, Partitioning, check_attention_layout

# `precision.policy` -> the dtype q/k/v have in the model (jaxtrain.train.precision.compute_dtype,
# which this layer may not import).
_POLICY_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


def resolve_attention(cfg: Config, platform: str, mesh_sizes: dict[str, int], *, dtype=None,
                      available: tuple[str, ...] | None = None) -> str:
    """`model.attention` resolved for this platform and dtype, and checked against the rules table.

    Args:
      cfg: the config (`model.attention`, `precision.policy`, `mesh.rules`).
      platform: 'cpu', 'gpu', 'tpu' (the devices' platform).
      mesh_sizes: resolved mesh axis sizes.
      dtype: dtype of q/k/v; None = `precision.policy`'s compute dtype.
      available: implementations that can run here; None = what is installed
        (`kernels.available_implementations`). Tests pass a list to play another machine.
    Raises:
      ConfigError: not available here, cuDNN with fp32, or a rules table under which the kernel
        would be wrong.
    """
    dtype = _POLICY_DTYPES[cfg.precision.policy] if dtype is None else dtype
    if cfg.model.mla:
        _check_mla(cfg, mesh_sizes)
    try:
        # MLA's value heads (v_head_dim) differ from its query/key heads: only `xla` takes that
        implementation = kernels.resolve_implementation("xla" if cfg.model.mla else cfg.model.attention, platform,
                                                        dtype, available)
    except ValueError as e:
        raise ConfigError(f"model.attention={cfg.model.attention}: {e}") from None
    check_attention_layout(cfg.mesh.rules, mesh_sizes, implementation)
    if mesh_sizes.get("context", 1) > 1 and implementation not in kernels.BLOCK_IMPLEMENTATIONS:
        raise ConfigError(f"model.attention={cfg.model.attention} runs {implementation}, which has no blockwise form "
                          f"for context parallelism (mesh.context={mesh_sizes['context']}); use one of "
                          f"{', '.join(kernels.BLOCK_IMPLEMENTATIONS)}")
    return implementation


def _check_mla(cfg: Config, mesh_sizes: dict[str, int]) -> None:
    """Multi-head latent attention runs `xla` only (its value head size differs from q's and k's,
    which no fused kernel takes), and not over a context-split sequence (not built)."""
    if cfg.model.attention not in ("auto", "xla"):
        raise ConfigError(f"model.attention={cfg.model.attention} with multi-head latent attention (model.kv_lora_rank="
                          f"{cfg.model.kv_lora_rank}): its value heads (v_head_dim) differ from its query/key heads, "
                          "which only model.attention=xla (or auto) takes")
    if mesh_sizes.get("context", 1) > 1:
        raise ConfigError(f"mesh.context={mesh_sizes['context']} with multi-head latent attention (model.kv_lora_rank="
                          f"{cfg.model.kv_lora_rank}) is not built yet; use mesh.context=1")


def repeat_kv_heads(k_BLKH: jax.Array, num_heads: int, shards: int) -> jax.Array:
    """k (or v) with each kv head repeated so that `shards` equal head shards line up with q's.

    Query head n reads kv head n // (N/K). With the query heads split `shards` ways, a shard's kv
    heads are whole only when K divides by `shards`; otherwise each kv head is repeated r times,
    K·r = lcm(K, shards) (which divides N, as N divides by K and by `shards`): repeated head j is
    kv head j // r, and query head n now reads repeated head n // (N/(K·r)), the same kv head.
    Returns k unchanged when no repeat is needed.
    """
    K = k_BLKH.shape[2]
    r = math.lcm(K, shards) // K
    if r == 1:
        return k_BLKH
    assert num_heads % (K * r) == 0, (num_heads, K, shards)  # validated: heads divide by the shards
    return jnp.repeat(k_BLKH, r, axis=2)


@jax.named_scope("attention")  # `jaxtrain profile-summary` counts the ops under this scope as attention
def attend(q_BLNH: jax.Array, k_BLKH: jax.Array, v_BLKH: jax.Array, segment_ids_BL: jax.Array | None,
           implementation: str, partitioning: Partitioning, *, platform: str | None = None,
           available: tuple[str, ...] | None = None, window: int | None = None,
           sinks: jax.Array | None = None) -> jax.Array:
    """Causal grouped-query attention [B, L, N, H] with `model.attention`'s implementation.

    `xla` is plain jnp that XLA partitions itself; a kernel is opaque to the partitioner, so it
    runs per shard (batch and heads are independent; length and head_dim must be whole). Inside
    the kernel call the kv heads are split like the query heads, repeated first when there are
    fewer kv heads than head shards (`repeat_kv_heads`), so any tensor degree that divides the
    query heads works. `platform` (None = the mesh's devices, else JAX's default backend) and
    `available` are for tests, as in `resolve_attention`. `window`: the sliding window (static) of
    `kernels.flash_attention`, or None; refused with context parallelism (config validation).
    `sinks`: fp32 [N], a logit per query head in each softmax's denominator (gpt-oss), or None;
    per shard they split like the query heads; refused with context parallelism.
    """
    if platform is None:
        platform = (partitioning.mesh.devices.flat[0].platform if partitioning.mesh is not None
                    else jax.default_backend())
    implementation = kernels.resolve_implementation(implementation, platform, q_BLNH.dtype, available)
    if partitioning.context is not None:
        if sinks is not None:
            raise ConfigError("model.attention_sinks with context parallelism (mesh.context > 1) is not built yet")
        if window is not None:
            raise ConfigError(f"model.sliding_window={window} with context parallelism is not built yet")
        return _context_attend(q_BLNH, k_BLKH, v_BLKH, segment_ids_BL, implementation, partitioning)
    # Without sinks the kernel is called as before they existed (no `sinks` argument at all).
    extra = lambda sinks_N: {} if sinks_N is None else {"sinks": sinks_N}
    run = lambda q, k, v, seg, sinks_N=None: kernels.flash_attention(
        q, k, v, causal=True, segment_ids=seg, implementation=implementation, window=window, **extra(sinks_N))
    if implementation == "xla":
        return run(q_BLNH, k_BLKH, v_BLKH, segment_ids_BL, sinks)
    N, shards = q_BLNH.shape[2], partitioning.ways("heads")
    k_BLKH, v_BLKH = (repeat_kv_heads(x, N, shards) for x in (k_BLKH, v_BLKH))
    qkv = ("batch", "length", "heads", "head_dim")  # kv heads split exactly like the query heads
    # sinks [N] split like the heads (None: per_shard leaves the argument out)
    return partitioning.per_shard(run, (qkv, qkv, qkv, ("batch", "length"), ("heads",)), qkv,
                                  whole=KERNEL_WHOLE_AXES)(q_BLNH, k_BLKH, v_BLKH, segment_ids_BL, sinks)


def _context_attend(q_BLNH, k_BLKH, v_BLKH, segment_ids_BL, implementation: str, partitioning: Partitioning):
    """`attend` over a sequence split across `context` (jaxtrain.parallel.context): the schedule's ring
    or all-gather, with `implementation`'s blockwise kernel (kernels.attention_block) per block."""
    if implementation not in kernels.BLOCK_IMPLEMENTATIONS:
        raise ConfigError(f"model.attention={implementation} has no blockwise form for context parallelism; "
                          f"use one of {', '.join(kernels.BLOCK_IMPLEMENTATIONS)}")
    N, shards = q_BLNH.shape[2], partitioning.ways("heads")
    k_BLKH, v_BLKH = (repeat_kv_heads(x, N, shards) for x in (k_BLKH, v_BLKH))

    def block_fwd(q, k, v, qs, ks, *, causal):
        return kernels.attention_block(q, k, v, causal=causal, segment_ids=qs, kv_segment_ids=ks,
                                       implementation=implementation)

    def block_bwd(q, k, v, o, lse, do, qs, ks, *, causal):
        return kernels.attention_block_bwd(q, k, v, o, lse, do, causal=causal, segment_ids=qs, kv_segment_ids=ks,
                                           implementation=implementation)

    qkv = partitioning.spec(("batch", "length", "heads", "head_dim"))
    return context.context_attention(q_BLNH, k_BLKH, v_BLKH, segment_ids_BL, partitioning.context, partitioning.mesh,
                                     qkv, partitioning.spec(("batch", "length")), block_fwd, block_bwd)


# ----------------------------------------------------------------------------- decoding


def write_cache(cache_BSKH: jax.Array, new_BLKH: jax.Array, start_B: jax.Array) -> jax.Array:
    """`cache` with each row's new keys (or values) written at slots start_b .. start_b + L - 1."""
    def one_row(cache_SKH, new_LKH, start):
        return jax.lax.dynamic_update_slice_in_dim(cache_SKH, new_LKH.astype(cache_SKH.dtype), start, axis=0)
    return jax.vmap(one_row)(cache_BSKH, new_BLKH, start_B)


@jax.named_scope("attention")
def attend_cached(q_BLNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, positions_BL: jax.Array,
                  window: int | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention of new queries over a KV cache: [B, L, N, Hv] (v's head size; H, q's and
    k's, sets the 1/sqrt(H) scale; the two differ in multi-head latent attention).

    Cache slot s holds the token at position s of its row, so a query at position p sees slots
    0..p: the causal mask, and slots past p (padding of a shorter prompt, or not yet written) are
    never read; with a sliding `window` only slots p - window < s <= p. Plain jnp in fp32 (softmax statistics), whatever the cache's dtype: a decode step
    is a handful of queries against the cache, memory-bound, where a fused kernel gains little.
    `sinks` [N] (gpt-oss): a logit per query head added to each softmax's denominator only.
    """
    B, L, N, H = q_BLNH.shape
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    q_BLKGH = q_BLNH.reshape(B, L, K, N // K, H).astype(jnp.float32)  # query head n reads kv head n // (N/K)
    scores = jnp.einsum("blkgh,bskh->bkgls", q_BLKGH, k_BSKH.astype(jnp.float32)) / math.sqrt(H)
    visible_BLS = jnp.arange(S)[None, None, :] <= positions_BL[:, :, None]
    if window is not None:
        visible_BLS &= jnp.arange(S)[None, None, :] > positions_BL[:, :, None] - window
    scores = jnp.where(visible_BLS[:, None, None], scores, -jnp.inf)
    if sinks is not None:  # one more logit per row, its probability dropped (transformers' GptOss)
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, K, N // K, 1, 1), (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    else:
        probs = jax.nn.softmax(scores, axis=-1)
    o_BLKGH = jnp.einsum("bkgls,bskh->blkgh", probs, v_BSKH.astype(jnp.float32))
    return o_BLKGH.reshape(B, L, N, v_BSKH.shape[-1]).astype(q_BLNH.dtype)  # v's head size (MLA: not q's)
