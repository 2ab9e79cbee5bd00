"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 section 2.2): `model.mtp_depth` modules
after the decoder, module d (1..depth) predicting token t + 1 + d at position t.

Shape suffixes as in llama.py; C = 2D (the concatenated features).

    h_0 = the decoder's last hidden states, before the final norm (the paper's h^0, MaxText's
          "raw output from the main model")
    h_d = Block_d(eh_proj_d [hnorm_d(h_{d-1}) ; enorm_d(Emb(token t + d))])
    logits_d = head(final_norm(h_d))      (the embedding, final norm and head shared with the model)

Each module (`MTPLayer`) holds `hnorm`, `enorm` (RMSNorm [D]), `eh_proj` [2D, D] (logical axes
(None, "embed")) and `block`, a dense `Block` of the model's shapes (attention and a SwiGLU MLP of
`model.mlp_dim`; a mixture-of-experts model's MTP block is dense too, and unrouted). The modules are
stacked on a leading `mtp_layers` axis (no rule: replicated over the stage axis; the other axes as
the model's layers), the parameter tree's `mtp`. The concatenation puts h before the embedding as
the paper and MaxText do; DeepSeek-V3's checkpoints (and Megatron) order eh_proj's input as
[embedding ; h], so an importer would swap its halves (jaxtrain imports and exports no MTP weights;
transformers does not run them).

The loss: position t of module d is counted iff t + d < L, token t + d is in t's segment and its
target is counted (`loss_mask[t + d]`: a target across a document boundary is masked there). The
shifted tokens, targets and masks are made from the whole unpermuted batch (`shifted_batch`) before
context parallelism reorders it and grad accumulation splits it, so both keep them aligned.
mtp_loss = mean over d of module d's mean cross-entropy over its counted tokens of the whole batch;
the training loss adds `model.mtp_loss_weight` x mtp_loss.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.config import ModelConfig
from jaxtrain.model.loss import fused_loss
from jaxtrain.model.projection import project
from jaxtrain.parallel.sharding import Partitioning

STACKED = "mtp_layers"  # the logical name of the modules' leading axis


class MTPLayer(nnx.Module):
    """One MTP module: `layer(h_BLD, e_BLD, positions, segment_ids, dtype, part) -> h_BLD` (module doc)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, block: Callable[..., nnx.Module],
                 norm: Callable[..., nnx.Module]):
        D = cfg.d_model
        self.hnorm = norm(D, cfg.norm_eps, cfg.norm_plus_one)
        self.enorm = norm(D, cfg.norm_eps, cfg.norm_plus_one)
        self.eh_proj = nnx.Param(jax.random.normal(rngs.params(), (2 * D, D), jnp.float32) * cfg.init_std,
                                 out_sharding=(None, "embed"))
        self.block = block(cfg, rngs, False)

    def __call__(self, h_BLD, e_BLD, positions_BL, segment_ids_BL, dtype, part: Partitioning):
        x_BLC = jnp.concatenate([self.hnorm(h_BLD), self.enorm(e_BLD)], axis=-1)
        x_BLD = part.constrain(project("blc,cd->bld", x_BLC, self.eh_proj[...], dtype),
                               ("batch", "act_length", "act_embed"))
        return self.block(x_BLD, positions_BL, segment_ids_BL, dtype, part)


def make_mtp(cfg: ModelConfig, rngs: nnx.Rngs, block: Callable[..., nnx.Module],
             norm: Callable[..., nnx.Module]) -> MTPLayer:
    """The `model.mtp_depth` modules, created stacked on a leading `mtp_layers` axis. `block` and
    `norm`: the decoder's Block and RMSNorm classes (passed in: llama.py imports this module)."""
    @nnx.split_rngs(splits=cfg.mtp_depth)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: STACKED})
    def make(rngs: nnx.Rngs) -> MTPLayer:
        return MTPLayer(cfg, rngs, block, norm)
    return make(rngs)


def mtp_hidden(model: Any, h_BLD: jax.Array, tokens_by_depth: list[jax.Array], positions_BL: jax.Array,
               segment_ids_BL: jax.Array, part: Partitioning = Partitioning()) -> list[jax.Array]:
    """The modules' hidden states after the shared final norm, one [B, L, D] per depth.

    `model`: a `Transformer` with `mtp`; `h_BLD`: its decoder output before the final norm;
    `tokens_by_depth[d - 1]`: the tokens module d embeds at each position (token t + d)."""
    graphdef, stacked = nnx.split(model.mtp)
    out = []
    for d, tokens_BL in enumerate(tokens_by_depth):  # unrolled: each depth has its own inputs
        layer = nnx.merge(graphdef, jax.tree_util.tree_map(lambda a, d=d: a[d], stacked))
        e_BLD = part.constrain(model._embed(tokens_BL, part), ("batch", "act_length", "act_embed"))
        h_BLD = layer(h_BLD, e_BLD, positions_BL, segment_ids_BL, model.dtype, part)
        out.append(model.final_norm(h_BLD))
    return out


def _shift(x_BL: jax.Array, d: int) -> jax.Array:
    """x[:, t + d] at t, zeros past the end."""
    return jnp.concatenate([x_BL[:, d:], jnp.zeros((x_BL.shape[0], d), x_BL.dtype)], axis=1)


def shifted_batch(batch: dict, depth: int) -> dict:
    """The batch plus, per depth d, `mtp_tokens_d` (token t + d), `mtp_targets_d` (token t + 1 + d)
    and `mtp_mask_d` (1 where that target counts: module doc), each [B, L]. Made from the batch in
    sequence order (before `context.permute_batch`)."""
    out = dict(batch)
    seg_BL = batch["segment_ids"]
    L = seg_BL.shape[1]
    for d in range(1, depth + 1):
        inside = (jnp.arange(L) + d < L)[None, :]
        same = _shift(seg_BL, d) == seg_BL
        out[f"mtp_tokens_{d}"] = _shift(batch["tokens"], d)
        out[f"mtp_targets_{d}"] = _shift(batch["targets"], d)
        out[f"mtp_mask_{d}"] = (inside & same).astype(jnp.float32) * _shift(batch["loss_mask"].astype(jnp.float32), d)
    return out


def mtp_counts(batch: dict, depth: int) -> jax.Array:
    """Counted tokens per depth [depth] of a `shifted_batch` (the whole batch: the loss's denominators)."""
    return jnp.stack([jnp.sum(batch[f"mtp_mask_{d}"]) for d in range(1, depth + 1)])


def mtp_loss_terms(model: Any, h_BLD: jax.Array, batch: dict, scales_d: jax.Array, weight: float,
                   part: Partitioning = Partitioning()) -> tuple[jax.Array, jax.Array]:
    """(sum over d of scales_d[d] x module d's cross-entropy sum, the cross-entropy sums [depth]).

    The first is what the train step differentiates: with scales_d = loss scale x weight /
    (depth x counted tokens of module d) it is weight x mtp_loss (x the loss scale). `weight`
    (static) = 0 keeps the head's fused gradient finite (its scale hint 1 instead of 0)."""
    depth = model.cfg.mtp_depth
    hs = mtp_hidden(model, h_BLD, [batch[f"mtp_tokens_{d}"] for d in range(1, depth + 1)], batch["positions"],
                    batch["segment_ids"], part)
    head_DV = model.head_weight()
    total, ces = jnp.float32(0), []
    for d, x_BLD in enumerate(hs, 1):
        s = scales_d[d - 1]
        objective, ce, _ = fused_loss(x_BLD, head_DV, batch[f"mtp_targets_{d}"], batch[f"mtp_mask_{d}"], part=part,
                                      grad_scale=s if weight > 0 else 1.0)
        total, ces = total + objective * s, ces + [ce]
    return total, jnp.stack(ces)
