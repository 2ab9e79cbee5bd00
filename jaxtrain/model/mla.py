"""Multi-head latent attention (MLA; DeepSeek-V2/V3), as transformers' `DeepseekV3Attention`.

Shape suffixes as in llama.py, plus Rq the query latent (model.q_lora_rank), Rkv the key/value latent
(model.kv_lora_rank), Hn / Hr / Hv each head's non-rotary query/key, rotary query/key and value
channels (qk_nope_head_dim, qk_rope_head_dim, v_head_dim) and Hqk = Hn + Hr (= model.head_dim).

    q       = wq(x)                         (q_lora_rank == 0)   [B, L, N, Hqk]
            | wq_b(q_a_norm(wq_a(x)))       (q_lora_rank > 0)
    latent, k_rope = wkv_a(x)                                    [B, L, Rkv], [B, L, Hr]
    k_nope, v      = wkv_b(kv_a_norm(latent))                    [B, L, N, Hn], [B, L, N, Hv]
    k       = [k_nope | rope(k_rope), the same for every head]   [B, L, N, Hqk]
    q       = [q_nope | rope(q_rope)]
    out     = wo(softmax(q.k * scale) v)                         from N * Hv channels

Rotary applies to the Hr rope channels only, and `scale` is 1/sqrt(Hqk), times mscale(factor,
rope_yarn_mscale_all_dim)^2 with rope_scaling=yarn and rope_yarn_mscale_all_dim > 0 (DeepSeek's
`yarn_get_mscale`; the rotary's cos and sin carry YaRN's own attention factor besides, which is 1
for DeepSeek-V3, where mscale = mscale_all_dim).

Parameters: `wq` [D, N, Hqk], or `wq_a` [D, Rq], `q_a_norm` (an RMSNorm over Rq) and `wq_b`
[Rq, N, Hqk]; `wkv_a` [D, Rkv + Hr]; `kv_a_norm` (over Rkv); `wkv_b` [Rkv, N, Hn + Hv]; `wo`
[N, Hv, D]. Within Hqk the channels are [nope | rope], and the rope channels use jaxtrain's
rotate-half layout: channel pairs (i, i + Hr/2). DeepSeek's checkpoints (transformers'
`rope_interleave`, the default) pair channels (2i, 2i + 1) instead; the Hugging Face importer
permutes those rows of q's and kv_a's projections (and the exporter back), which changes nothing
else: the rope channels of q and k meet only in their dot product.

The latent ranks carry their own logical axes, `q_lora` and `kv_lora`, which the rules table leaves
replicated (jaxtrain/config.py DEFAULT_RULES says why). Attention runs `attend` with the `xla`
implementation: the value head size Hv differs from Hqk, which the fused kernels do not take
(`resolve_attention` refuses them with MLA). Decoding caches the expanded per-head k [B, S, N, Hqk]
and v [B, S, N, Hv], not the compressed latent (simple; DeepSeek's absorbed-latent cache, a
fraction of the size, is not built).

This module may not import llama.py (which imports it): `Block` hands in the norm and the rotary.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.config import ModelConfig
from jaxtrain.model.attention import attend, attend_cached, write_cache
from jaxtrain.model.projection import project
from jaxtrain.parallel.sharding import Partitioning

QKV = ("batch", "length", "heads", "head_dim")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1), as
    transformers' `get_mscale` / DeepSeek's `yarn_get_mscale`."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale_factor(cfg: ModelConfig) -> float:
    """What MLA multiplies the usual 1/sqrt(Hqk) score scale by: mscale(factor, mscale_all_dim)^2
    with rope_scaling=yarn and rope_yarn_mscale_all_dim > 0 (DeepseekV3Attention's
    `yarn_apply_mscale`), else 1."""
    if cfg.rope_scaling != "yarn" or not cfg.rope_yarn_mscale_all_dim:
        return 1.0
    m = yarn_mscale(cfg.rope_scaling_factor, cfg.rope_yarn_mscale_all_dim)
    return m * m


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], std: float) -> nnx.Param:
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) * std, out_sharding=names)


class MLA(nnx.Module):
    """Multi-head latent attention with `llama.Attention`'s call signature and return (see the module
    docstring).

    Args:
      cfg: the model config (model.mla).
      rngs: parameter initialisation.
      norm: `norm(width)` -> an RMSNorm module (llama.RMSNorm with the model's eps), for the latents.
      rope: `rope(x_BLnH, positions_BL)` -> x with its channel pairs (i, i + H/2) rotated by the
        model's global rotary (rope_theta, rope_scaling and YaRN's attention factor).
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *, norm: Callable[[int], nnx.Module],
                 rope: Callable[[jax.Array, jax.Array], jax.Array]):
        D, N = cfg.d_model, cfg.num_heads
        Hn, Hr, Hv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        Rq, Rkv, std = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.init_std
        if Rq:
            self.wq_a = _param(rngs, (D, Rq), ("embed", "q_lora"), std)
            self.q_a_norm = norm(Rq)
            self.wq_b = _param(rngs, (Rq, N, Hn + Hr), ("q_lora", "heads", "head_dim"), std)
        else:
            self.wq = _param(rngs, (D, N, Hn + Hr), ("embed", "heads", "head_dim"), std)
        self.wkv_a = _param(rngs, (D, Rkv + Hr), ("embed", "kv_lora"), std)
        self.kv_a_norm = norm(Rkv)
        self.wkv_b = _param(rngs, (Rkv, N, Hn + Hv), ("kv_lora", "heads", "head_dim"), std)
        # Output projection scaled down with depth, as Attention's.
        self.wo = _param(rngs, (N, Hv, D), ("heads", "head_dim", "embed"), std / (2 * cfg.num_layers) ** 0.5)
        self.rope = rope
        self.dims = (Hn, Hr, Hv, Rkv)
        # The kernels' scale is 1/sqrt(Hqk); q times this makes it 1/sqrt(Hqk) * mscale^2.
        scale = softmax_scale_factor(cfg)
        self.q_scale = scale if scale != 1.0 else None

    def _qkv(self, x_BLD, positions_BL, dtype, part: Partitioning):
        """-> q [B, L, N, Hqk] (rotated, scaled), k [B, L, N, Hqk] (rotated), v [B, L, N, Hv]."""
        Hn, Hr, Hv, Rkv = self.dims
        # Checkpoint names as Attention's (REMAT_POLICIES): query_proj the full query, key_proj the
        # compressed latent and shared rope key, value_proj the per-head keys and values from it.
        if hasattr(self, "wq"):
            q_BLNH = project("bld,dnh->blnh", x_BLD, self.wq[...], dtype)
        else:
            cq_BLR = part.constrain(project("bld,dr->blr", x_BLD, self.wq_a[...], dtype), ("batch", "length", "q_lora"))
            q_BLNH = project("blr,rnh->blnh", self.q_a_norm(cq_BLR), self.wq_b[...], dtype)
        q_BLNH = checkpoint_name(q_BLNH, "query_proj")
        ckv_BLR = checkpoint_name(project("bld,dr->blr", x_BLD, self.wkv_a[...], dtype), "key_proj")
        ckv_BLR = part.constrain(ckv_BLR, ("batch", "length", "kv_lora"))
        latent_BLR, k_rope_BLH = ckv_BLR[..., :Rkv], ckv_BLR[..., Rkv:]
        kv_BLNH = checkpoint_name(project("blr,rnh->blnh", self.kv_a_norm(latent_BLR), self.wkv_b[...], dtype),
                                  "value_proj")
        k_nope_BLNH, v_BLNH = kv_BLNH[..., :Hn], kv_BLNH[..., Hn:]
        q_BLNH = jnp.concatenate([q_BLNH[..., :Hn], self.rope(q_BLNH[..., Hn:], positions_BL)], axis=-1)
        k_rope_BL1H = self.rope(k_rope_BLH[:, :, None, :], positions_BL)  # one rotary key shared by the heads
        k_BLNH = jnp.concatenate([k_nope_BLNH, jnp.broadcast_to(k_rope_BL1H, (*k_nope_BLNH.shape[:3], Hr))], axis=-1)
        if self.q_scale is not None:
            q_BLNH = q_BLNH * jnp.asarray(self.q_scale, q_BLNH.dtype)
        return q_BLNH, k_BLNH, v_BLNH

    def __call__(self, x_BLD, positions_BL, segment_ids_BL, dtype, part: Partitioning, local=None):
        """x_BLD -> the attention's output [B, L, D]. `local` is ignored: MLA has no sliding window
        (config validation refuses one)."""
        q_BLNH, k_BLNH, v_BLNH = (part.constrain(t, QKV) for t in self._qkv(x_BLD, positions_BL, dtype, part))
        o_BLNH = attend(q_BLNH, k_BLNH, v_BLNH, segment_ids_BL, "xla", part)
        o_BLNH = part.constrain(o_BLNH, QKV)
        return checkpoint_name(project("blnh,nhd->bld", o_BLNH, self.wo[...], dtype), "out_proj")

    def decode(self, x_BLD, positions_BL, cache: dict, dtype, part: Partitioning,
               local: bool | None = None) -> tuple[jax.Array, dict]:
        """New tokens (contiguous positions per row) attend over the KV cache they are written into.

        `cache` = {"k": [B, S, N, Hqk], "v": [B, S, N, Hv]}, slot s = position s: the expanded keys
        and values (not the latent). -> (out_BLD, the updated cache)."""
        q_BLNH, k_BLNH, v_BLNH = self._qkv(x_BLD, positions_BL, dtype, part)
        names = ("batch", None, "heads", "head_dim")
        cache = {name: part.constrain(write_cache(cache[name], new, positions_BL[:, 0]), names)
                 for name, new in (("k", k_BLNH), ("v", v_BLNH))}
        q_BLNH = part.constrain(q_BLNH, QKV)
        o_BLNH = attend_cached(q_BLNH, cache["k"], cache["v"], positions_BL)
        return project("blnh,nhd->bld", o_BLNH, self.wo[...], dtype), cache


def matmul_params(cfg: ModelConfig) -> int:
    """MLA's parameters that take part in matmuls per token, one layer (norm scales left out)."""
    D, N, Rq, Rkv = cfg.d_model, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    Hn, Hr, Hv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    query = (D * Rq + Rq * N * (Hn + Hr)) if Rq else D * N * (Hn + Hr)
    return query + D * (Rkv + Hr) + Rkv * N * (Hn + Hv) + N * Hv * D
