"""Scoring text under a model: the log-probability of a continuation given its context, and whether
greedy decoding would have produced it (what lm-evaluation-harness's `loglikelihood` asks).

Each request is one row: context + continuation, cut on the left to the model's `max_seq_len` (the
continuation is kept whole; a continuation longer than that is refused). Rows are padded on the
right to a power-of-two length and run through the same cached forward pass decoding uses, so the
scores are the logits `generate` samples from; one program per (batch, length) bucket.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.config import ConfigError

MIN_LENGTH_BUCKET = 16


def score_rows(model, part, router_bias, tokens_BL, targets_BL, mask_BL, dtype, layers=None):
    """(sum of log p(target) over the masked positions [B], every masked target the argmax [B])."""
    B, L = tokens_BL.shape
    cache = model.init_cache(B, L, dtype)
    positions_BL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    hidden_BLD, _ = model.decode(tokens_BL, positions_BL, cache, part, router_bias, layers)
    logits_BLV = jnp.einsum("bld,dv->blv", hidden_BLD, model.head_weight().astype(dtype),
                            preferred_element_type=jnp.float32)
    logp_BLV = jax.nn.log_softmax(logits_BLV, axis=-1)
    target_logp_BL = jnp.take_along_axis(logp_BLV, targets_BL[..., None], axis=-1)[..., 0]
    greedy_BL = jnp.argmax(logits_BLV, axis=-1) == targets_BL
    return jnp.sum(jnp.where(mask_BL, target_logp_BL, 0.0), axis=1), jnp.all(greedy_BL | ~mask_BL, axis=1)


def make_scorer(generator):
    """A jitted `score_rows` over `generator`'s model, parameters and mesh."""
    def run(params, layers, router_bias, tokens_BL, targets_BL, mask_BL):
        model = nnx.merge(generator.graphdef, params)
        return score_rows(model, generator.part, router_bias, tokens_BL, targets_BL, mask_BL, generator.dtype, layers)
    return jax.jit(run)


def score(generator, requests: Sequence[tuple[Sequence[int], Sequence[int]]], batch_size: int = 8) -> list[tuple[float, bool]]:
    """(log p(continuation | context), greedy) for each (context ids, continuation ids) request.

    The context must hold at least one token (lm-eval passes the end-of-text id for an empty one).
    Raises:
      ConfigError: an empty context or continuation, or a continuation longer than max_seq_len - 1.
    """
    cfg = generator.cfg
    limit = cfg.max_seq_len
    rows = []
    for i, (context, continuation) in enumerate(requests):
        if not context or not continuation:
            raise ConfigError(f"request {i}: {'context' if not context else 'continuation'} is empty")
        if len(continuation) >= limit:
            raise ConfigError(f"request {i}: a continuation of {len(continuation)} tokens does not fit the "
                              f"model's max_seq_len {limit} with its context")
        whole = (list(context) + list(continuation))[-(limit + 1):]  # +1: the last token is only a target
        rows.append((whole, len(continuation)))
    scorer = generator.scorer()
    ways = generator.batch_ways
    batch_size = -(-max(batch_size, 1) // ways) * ways
    out: list[tuple[float, bool]] = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        B = -(-len(chunk) // ways) * ways
        L = min(max(MIN_LENGTH_BUCKET, 1 << (max(len(w) for w, _ in chunk) - 2).bit_length()), limit)
        tokens, targets, mask = (np.zeros((B, L), np.int32) for _ in range(3))
        for r, (whole, n) in enumerate(chunk):
            inputs, labels = whole[:-1], whole[1:]
            tokens[r, :len(inputs)], targets[r, :len(labels)] = inputs, labels
            mask[r, len(labels) - n:len(labels)] = 1
        logp, greedy = jax.device_get(scorer(generator.params, generator.layers, generator.router_bias, tokens, targets,
                                                   mask.astype(bool)))
        out += [(float(logp[r]), bool(greedy[r])) for r in range(len(chunk))]
    return out
