"""The language-model loss: output head + cross-entropy (+ z-loss), fused and chunked.

Shape suffixes: B batch, L length, C chunk length, D d_model, V vocab, G batch shards.

The plain loss (cross-entropy on the model's logits, `token_losses` in tests/model/test_loss.py) materialises the fp32 logits
[B, L, V] and, in the backward pass, their gradient of the same size. At cpu-tiny's shape that is
2 x 262 MB per step, streamed through memory by a dozen elementwise passes, and the head is ~65%
of the model FLOPs. `fused_loss` never holds more than one chunk of the sequence's logits:

  forward (differentiated):  for each chunk of C positions (a `lax.scan`):
      logits = x_c @ W                       (matmul 1)
      lse, target logit -> loss sums
      dlogits = s * mask * (softmax * (1 + 2 z lse) - onehot(target))   (s: grad_scale, then cast)
      dx_c = dlogits @ W^T                   (matmul 2)
      dW  += x_c^T @ dlogits                 (matmul 3)
  backward: multiply the stored dx and dW by cotangent / s (the loss is a scalar).

`s` is the cotangent the caller will apply (the train step passes loss scale / counted tokens), so
the softmax gradient is scaled before it is rounded to the compute dtype: in fp16 the loss scale
then protects the head's backward matmuls as it does every other layer's.

So the three head matmuls of the plain loss remain, and nothing [B, L, V]-sized is ever stored:
the gradient is computed while the chunk's logits are in cache. Undifferentiated calls (evaluation)
run only matmul 1 per chunk (`jax.custom_vjp` calls the primal function then).

Sharding: the chunks cut the length axis. With fsdp (the `embed` axes the innermost batch axes,
as in the default rules) the loop is vocab-parallel over fsdp x tensor (`_layout`): the head is
never gathered; its shard is cast to the compute dtype and resharded once, by an all-to-all, to
[D, V / (tensor x fsdp)]; each chunk's hidden states are all-gathered over fsdp (activation-sized,
compute dtype), so every device computes its fsdp group's logits for its own vocabulary slice; dx
partials are summed back over the slices (per token), and dW = x^T dlogits is born sharded, fp32
[D, V / (tensor x fsdp)] per device, one per remaining (data) shard, reduced once after the loop
and moved into the parameter's [D/fsdp, V/tensor] layout by one all-to-all. So nothing
vocab-sized on a device grows with fsdp: at Llama-3-8B widths with fsdp 8 the step's vocab-sized
temporaries fell from 6.35 to 0.95 GiB (docs/memory.md). Without fsdp (or under other rules) the
head is gathered once, before the loop, and each batch shard keeps its own [D, V/tensor] partial.
The vocab axis may be sharded (tensor): the softmax reductions over it become all-reduces, and the
target logit is picked by an iota compare, which partitions without gathering the vocab.

The loss's contract (what the tests check against the plain loss): for fp32, the objective, the
cross-entropy and z-loss sums and the gradients with respect to the hidden states and the head
equal the plain loss's to ~1e-6 relative, masked tokens included.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.parallel.sharding import Partitioning

# Bytes of fp32 logits per device that one chunk may hold. On the CPU a chunk should stay near the
# last-level cache (32 MiB on the bench machine; on cpu-tiny 8 MiB chunks were slower, 16/32/64 MiB
# alike and the whole 262 MB slowest, docs/bench_cpu_tiny.md); accelerators want big matmuls and
# have the memory for them (1 GiB: 2k rows of a 128k vocabulary).
CHUNK_BYTES = {"cpu": 16 * 2**20}
DEFAULT_CHUNK_BYTES = 1 * 2**30


def chunk_length(B: int, L: int, V: int, chunk_bytes: int | None = None,
                 part: Partitioning = Partitioning()) -> int:
    """Positions per chunk: the largest divisor of L whose fp32 logits per device fit `chunk_bytes`
    (with the batch and vocab split as `part` splits them)."""
    if chunk_bytes is None:
        chunk_bytes = CHUNK_BYTES.get(jax.default_backend(), DEFAULT_CHUNK_BYTES)
    rows_per_position = max(B // part.ways("batch"), 1) * max(V // part.ways("vocab"), 1) * 4
    fitting = [c for c in range(1, L + 1) if L % c == 0 and c * rows_per_position <= chunk_bytes]
    return max(fitting, default=1)


def _chunk_sums(x_GBCD, head_DV, targets_GBC, mask_GBC, z_loss: float, with_grads: bool, place_logits,
                grad_scale=1.0):
    """Loss sums of one chunk, and (with_grads) grad_scale x d(objective)/d(x chunk) and
    grad_scale x d(objective)/d(logits) in the compute dtype (the caller forms dW from it).
    `place_logits`: the sharding constraint of the chunk's [G, B/G, C, V] logits."""
    logits = jnp.einsum("gbcd,dv->gbcv", x_GBCD, head_DV, preferred_element_type=jnp.float32)
    logits = place_logits(logits)
    peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    exp = jnp.exp(logits - peak)
    total = jnp.sum(exp, axis=-1, keepdims=True)
    lse_GBC = (jnp.log(total) + peak)[..., 0]
    # The target's logit by an iota compare (a masked sum): partitions over a sharded vocab axis.
    is_target = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == targets_GBC[..., None]
    target_logit = jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)
    ce = jnp.sum((lse_GBC - target_logit) * mask_GBC)
    z = jnp.sum(lse_GBC * lse_GBC * mask_GBC)
    if not with_grads:
        return ce, z
    # d/dlogits of mask * (lse - logit[target] + z_loss * lse^2) = mask * (p (1 + 2 z_loss lse) - onehot),
    # times the cotangent to come (the loss scale / tokens) *before* the cast: in fp16 p ~ 1/V is
    # mostly subnormal, and the loss scale exists to lift exactly these values into range.
    scaled_mask = mask_GBC * grad_scale
    weight = (scaled_mask * (1.0 + 2.0 * z_loss * lse_GBC))[..., None] / total
    dlogits = exp * weight - jnp.where(is_target, scaled_mask[..., None], 0.0)
    dlogits = dlogits.astype(x_GBCD.dtype)  # the backward matmuls run in the compute dtype
    dx = jnp.einsum("gbcv,dv->gbcd", dlogits, head_DV, preferred_element_type=jnp.float32)
    return ce, z, dx, dlogits


def _split(a, G: int, C: int):
    """[B, L, ...] -> [L/C, G, B/G, C, ...]: chunks of the length axis, batch shards explicit."""
    B, L = a.shape[:2]
    a = a.reshape(G, B // G, L // C, C, *a.shape[2:])
    return jnp.moveaxis(a, 2, 0)


def _unsplit(a):
    """[L/C, G, B/G, C, ...] -> [B, L, ...]."""
    n, G, b, C = a.shape[:4]
    return jnp.moveaxis(a, 0, 2).reshape(G * b, n * C, *a.shape[4:])


class _Layout(NamedTuple):
    """How the chunk loop places its values (see `_layout`)."""
    R: int  # dW partial sums kept apart (reduced once after the loop): one per `rest` batch shard
    head: Any  # the head inside the loop, [D, V]
    tokens: Any  # a chunk's [G, B/G, C, ...] inputs inside the loop
    logits: Any  # a chunk's [G, B/G, C, V] logits
    dW: Any  # the [R, D, V] fp32 accumulator


def _axes(part: Partitioning, name: str) -> tuple[str, ...]:
    """The mesh axes (of size > 1) that the rules map the logical axis `name` to."""
    entry = part.spec((name,))[0]
    entries = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
    return tuple(a for a in entries if part.mesh.shape[a] > 1)


def _layout(part: Partitioning, G: int, B: int, D: int, V: int) -> _Layout | None:
    """The vocab-parallel layout of the loop, or None where it does not apply.

    The head parameter is [D, V] with D over the `embed` axes (fsdp) and V over `vocab` (tensor).
    Gathering it over fsdp (as FSDP gathers every weight) would put a whole [D, V/tensor] head, and
    a whole [D, V/tensor] fp32 dW partial per chunk, on every device, whatever the fsdp degree.
    Instead the head is resharded once (an all-to-all of its shard) to [D, V / (tensor x fsdp)],
    and each chunk's hidden states are gathered over the embed axes (activation-sized, compute
    dtype): every device computes the logits of all the tokens of its fsdp group for its own
    vocabulary slice (Megatron's vocab-parallel cross-entropy, over fsdp too). The softmax
    reductions over V become all-reduces of [tokens] values, dx is reduce-scattered back to the
    tokens' shards, and dW = x^T dlogits is born sharded: [D, V / (tensor x fsdp)] fp32 per device.
    That needs the embed axes to be the innermost batch axes (the default rules), V and the batch
    to split evenly, and an unsplit length; otherwise the head is gathered (the earlier layout).
    """
    mesh = part.mesh
    if mesh is None or G == 1:
        return None
    batch, embed, vocab, length = (_axes(part, n) for n in ("batch", "embed", "vocab", "length"))
    if not embed or length or batch[len(batch) - len(embed):] != embed or set(embed) & set(vocab):
        return None
    rest = batch[:len(batch) - len(embed)]
    R = 1
    for a in rest:
        R *= mesh.shape[a]
    ways = R
    for a in embed + vocab:
        ways *= mesh.shape[a]
    if V % (ways // R) or B % G or G % R:
        return None
    vocab_all = vocab + embed
    sharding = lambda *spec: NamedSharding(mesh, P(*spec))
    return _Layout(R=R, head=sharding(None, vocab_all), tokens=sharding(rest or None),
                   logits=sharding(rest or None, None, None, vocab_all), dW=sharding(rest or None, None, vocab_all))


def _loss_and_grads(x_BLD, head_DV, targets_BL, mask_BL, z_loss: float, chunk: int, with_grads: bool,
                    part: Partitioning, grad_scale=1.0):
    B, L, D = x_BLD.shape
    V = head_DV.shape[1]
    G = part.ways("batch")
    constrain = part.constrain
    if B % G:
        G = 1  # a batch that does not split evenly (eval on odd shapes): one partial sum
    layout = _layout(part, G, B, D, V)
    wsc = jax.lax.with_sharding_constraint
    # The cast stays on the shard: whatever moves of the head moves 16-bit values under bf16/fp16.
    head = constrain(head_DV.astype(x_BLD.dtype), ("embed", "vocab"))
    if layout is None:
        # Gathered over fsdp once, before the loop, not once per chunk.
        head = constrain(head, (None, "vocab"))
        place_tokens = lambda a: a
        place_logits = lambda a: constrain(a, ("batch", None, "length", "vocab"))
        R = G
        place_dW = lambda a: a if part.mesh is None else constrain(a, ("batch", None, "vocab"))
    else:
        head = wsc(head, layout.head)  # resharded once, before the loop: an all-to-all of the shard
        place_tokens = lambda a: wsc(a, layout.tokens)
        place_logits = lambda a: wsc(a, layout.logits)
        R = layout.R
        place_dW = lambda a: wsc(a, layout.dW)
    # dx [G, B/G, C, D] stays on its tokens' length shards (context parallelism): constrained to the
    # batch alone, it was all-gathered over `context` and sliced back after the loop, and on the CPU
    # the gather's length-major layout reached YNNPACK's elementwise fusions, which reject it
    # ("Instruction with unsupported layout in YNN fusion" under `jaxtrain train`'s flags).
    place_batch = lambda a: a if part.mesh is None else constrain(a, ("batch", None, "length"))
    xs = (_split(x_BLD, G, chunk), _split(targets_BL, G, chunk), _split(mask_BL.astype(jnp.float32), G, chunk))

    def inputs(c):
        return tuple(place_tokens(a) for a in c)

    if not with_grads:
        def body(carry, c):
            x, t, m = inputs(c)
            ce, z = _chunk_sums(x, head, t, m, z_loss, with_grads=False, place_logits=place_logits)
            return (carry[0] + ce, carry[1] + z), None
        (ce, z), _ = jax.lax.scan(body, (jnp.float32(0), jnp.float32(0)), xs)
        return ce, z

    def body(carry, c):
        ce_acc, z_acc, dW_acc = carry
        x, t, m = inputs(c)
        ce, z, dx, dlogits = _chunk_sums(x, head, t, m, z_loss, with_grads=True, place_logits=place_logits,
                                         grad_scale=grad_scale)
        # dW summed over the batch shards of each of the R groups that share the head's shards; the
        # R partial sums are reduced once, after the loop.
        split = lambda a: a.reshape(R, G // R, *a.shape[1:])
        dW_RDV = jnp.einsum("rkbcd,rkbcv->rdv", split(x), split(dlogits), preferred_element_type=jnp.float32)
        # dx leaves the loop on its own tokens' shards (a reduce-scatter over the vocab slices).
        return (ce_acc + ce, z_acc + z, place_dW(dW_acc + place_dW(dW_RDV))), place_batch(dx)

    dW0 = place_dW(jnp.zeros((R, D, V), jnp.float32))
    (ce, z, dW_RDV), dx = jax.lax.scan(body, (jnp.float32(0), jnp.float32(0), dW0), xs)
    dx_BLD = constrain(_unsplit(dx), ("batch", "length", "act_embed"))
    dW_DV = constrain(jnp.sum(dW_RDV, axis=0), ("embed", "vocab"))  # the one reduction over the remaining shards
    return ce, z, dx_BLD, dW_DV


def fused_loss(x_BLD: jax.Array, head_DV: jax.Array, targets_BL: jax.Array, mask_BL: jax.Array,
               z_loss: float = 0.0, chunk: int | None = None,
               part: Partitioning = Partitioning(),
               grad_scale: jax.Array | float = 1.0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(objective, cross-entropy sum, z-loss sum) of the output head over the counted tokens.

    objective = sum(mask * ce) + z_loss * sum(mask * lse^2), lse = logsumexp of the logits. Only
    the objective is differentiable (the two sums are reported as they are, with stop_gradient).

    Args:
      x_BLD: final hidden states (after the last norm), in the compute dtype.
      head_DV: the output projection (fp32 parameter; cast to x's dtype for the matmuls; logits and
        softmax in fp32).
      targets_BL: int target ids; mask_BL: 1 for counted tokens, 0 for the rest (any float/int/bool).
      z_loss: weight of the z-loss term (static).
      chunk: positions per chunk (a divisor of L); default `chunk_length` for this platform.
      part: the mesh and rules the loss runs under (batch shards, vocab shards); none by default.
      grad_scale: the cotangent the caller expects to apply to the objective (the train step: loss
        scale / counted tokens). The softmax gradient is multiplied by it before it is rounded to
        the compute dtype, so under fp16 the loss scale protects the head's backward matmuls too;
        the backward pass then multiplies by cotangent / grad_scale (1 when it was right). Any
        value gives the same gradients in exact arithmetic; it changes only where fp16 rounds.
    Returns:
      (objective, ce_sum, z_sum), fp32 scalars.
    """
    B, L, _ = x_BLD.shape
    if chunk is None:
        chunk = chunk_length(B, L, head_DV.shape[1], part=part)
    if L % chunk:
        raise ValueError(f"chunk={chunk} does not divide the sequence length {L}")
    z_loss = float(z_loss)

    @jax.custom_vjp
    def objective(x, head, targets, mask, scale):
        ce, z = _loss_and_grads(x, head, targets, mask, z_loss, chunk, with_grads=False, part=part)
        return ce + z_loss * z, (ce, z)

    def forward(x, head, targets, mask, scale):
        ce, z, dx, dW = _loss_and_grads(x, head, targets, mask, z_loss, chunk, with_grads=True, part=part,
                                        grad_scale=scale)
        return (ce + z_loss * z, (ce, z)), (dx, dW, scale)

    def backward(grads, cotangents):
        dx, dW, scale = grads
        # The stored gradients already carry `scale`; the sums' cotangents are zero (they leave
        # through stop_gradient below).
        g = cotangents[0] / scale
        # Targets, mask and the scale are not differentiated (None: a zero cotangent).
        return (g * dx).astype(x_BLD.dtype), (g * dW).astype(head_DV.dtype), None, None, None

    objective.defvjp(forward, backward)
    scale = jax.lax.stop_gradient(jnp.asarray(grad_scale, jnp.float32))
    total, (ce, z) = objective(x_BLD, head_DV, targets_BL, mask_BL, scale)
    return total, jax.lax.stop_gradient(ce), jax.lax.stop_gradient(z)
