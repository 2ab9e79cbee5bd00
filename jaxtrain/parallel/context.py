"""Context parallelism: attention over a sequence split across the `context` mesh axis.

Each device holds `length / context` tokens of every sequence (the rules table maps `length` to
`context`); everything but attention is token-local. Attention runs per device inside `shard_map`
over every mesh axis, in one of two schedules (`context.attention`):

- `ring`: the K/V shard (with its segment ids) passes around the context ring by `ppermute`,
  C - 1 hops; each device attends its queries to each block as it passes and combines the partial
  results with their log-sum-exp (online softmax), so the result is exact. The backward pass is its
  own ring (custom VJP): K/V travel again, and the dK/dV accumulated for each block travel with it,
  C hops, arriving back at the owner complete. No device ever holds more than two K/V shards.
- `allgather`: K/V are all-gathered over `context` (MaxText's default), the same blockwise loop
  runs over the gathered shards, and dK/dV are reduce-scattered back. Simpler, one collective, but
  each device holds the whole sequence's K/V.

Load balance (`context.order`): with the causal mask and contiguous shards (`plain`) device i does
i + 1/2 blocks of work, the last ~2x the average. `zigzag` cuts the sequence into 2C chunks and
gives device i chunks i and 2C-1-i: every device then does 2C - 1 full chunk pairs and 2 diagonal
ones. The train step permutes each batch's [B, L] arrays once (`permute_batch`) so that the plain
`length` sharding puts those chunks on each device; positions and segment ids are permuted with the
tokens, so rotary and document masks follow, and the loss (a sum over tokens) does not notice.

The per-block work is a kernel with a blockwise form (`kernels.attention_block`: the XLA reference,
the Pallas or the Triton kernels, each returning its lse, with a backward that reads the combined o and lse);
this module takes the two block functions as arguments and imports no kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jaxtrain.config import Config

AXIS = "context"
SKIP, CAUSAL, FULL = 0, 1, 2  # how a (query chunk, key chunk) pair is masked under the causal mask
MASKED_LSE = -1e30  # the lse of a row that has seen no key yet (kernels.common.MASK_VALUE)


@dataclasses.dataclass(frozen=True)
class ContextSchedule:
    """How attention crosses the split sequence: `size` devices, `attention` ring | allgather,
    `order` zigzag | plain."""

    size: int
    attention: str = "ring"
    order: str = "zigzag"

    @property
    def chunks_per_device(self) -> int:
        return 2 if self.order == "zigzag" else 1

    def describe(self) -> str:
        return f"{self.attention} attention over context={self.size}, {self.order} order"


def schedule_for(cfg: Config, mesh_sizes: dict[str, int]) -> ContextSchedule | None:
    """The context schedule for this mesh; None when `context` is 1 (nothing to do)."""
    size = mesh_sizes.get(AXIS, 1)
    if size <= 1:
        return None
    return ContextSchedule(size, cfg.context.attention, cfg.context.order)


def chunk_index(device, sub: int, size: int, order: str):
    """Which of the sequence's chunks device `device` holds as its `sub`-th (0 or 1); works on ints
    and on traced indices. plain: chunk `device` of C; zigzag: chunk device, then 2C-1-device, of 2C."""
    if order == "plain":
        return device
    return device if sub == 0 else 2 * size - 1 - device


def sequence_permutation(seq_len: int, schedule: ContextSchedule | None) -> np.ndarray:
    """perm with x[:, perm] = the sequence in device order (device 0's chunks, device 1's, ...)."""
    if schedule is None or schedule.order == "plain":
        return np.arange(seq_len)
    C = schedule.size
    c = seq_len // (2 * C)
    return np.concatenate([np.arange(ch * c, (ch + 1) * c) for d in range(C) for ch in (d, 2 * C - 1 - d)])


def permute_batch(batch: dict, schedule: ContextSchedule | None) -> dict:
    """Every [B, L] array of the batch in the schedule's device order (identity for plain or None)."""
    if schedule is None or schedule.order == "plain":
        return batch
    C = schedule.size
    order = np.array([ch for d in range(C) for ch in (d, 2 * C - 1 - d)])

    def one(x):
        B, L = x.shape[:2]
        return x.reshape(B, 2 * C, L // (2 * C), *x.shape[2:])[:, order].reshape(x.shape)
    return {k: one(v) for k, v in batch.items()}


def pair_kind(q_chunk, k_chunk):
    """SKIP, CAUSAL or FULL for a query chunk against a key chunk of the same length."""
    return jnp.where(q_chunk > k_chunk, FULL, jnp.where(q_chunk == k_chunk, CAUSAL, SKIP)).astype(jnp.int32)


def block_counts(schedule: ContextSchedule, tiles: int = 1) -> np.ndarray:
    """Per device, the attention tiles computed (unmasked) over the whole ring, with each chunk cut
    into `tiles` x `tiles` tiles (a diagonal pair computes tiles(tiles+1)/2 of them). For the
    load-balance test and `jaxtrain inspect`."""
    C, n = schedule.size, schedule.chunks_per_device
    full, diagonal = tiles * tiles, tiles * (tiles + 1) // 2
    counts = np.zeros(C, dtype=np.int64)
    for d in range(C):
        for src in range(C):
            for a in range(n):
                for b in range(n):
                    cq, ck = chunk_index(d, a, C, schedule.order), chunk_index(src, b, C, schedule.order)
                    counts[d] += full if cq > ck else diagonal if cq == ck else 0
    return counts


def describe(cfg: Config, mesh_sizes: dict[str, int]) -> dict | None:
    """The context schedule for the `start` event and `jaxtrain inspect` (None: no context parallelism)."""
    schedule = schedule_for(cfg, mesh_sizes)
    if schedule is None:
        return None
    counts = block_counts(schedule)
    return {"size": schedule.size, "attention": schedule.attention, "order": schedule.order,
            "chunk_len": cfg.data.seq_len // (schedule.size * schedule.chunks_per_device),
            "chunk_pairs_per_device_max_over_mean": round(float(counts.max() / counts.mean()), 3)}


def ring_bytes_theory(cfg: Config, mesh_sizes: dict[str, int], dtype_bytes: int) -> int:
    """Collective-permute bytes one device sends per train step under the ring schedule (0 otherwise).

    Per layer and (micro)batch, with S = the K/V shard (K and V of this device's tokens and kv heads,
    in the compute dtype) and I its segment ids (int32): the forward ring sends (C-1)(S + I); the
    backward ring sends (C-1)(S + I) again and C hops of the fp32 dK/dV accumulators (S in fp32);
    a rematerialised layer (model.remat != none) runs the forward ring a second time.
    """
    schedule = schedule_for(cfg, mesh_sizes)
    if schedule is None or schedule.attention != "ring":
        return 0
    m, C = cfg.model, schedule.size
    rules = cfg.mesh.rules

    def ways(name):
        target = rules.get(name)
        return int(np.prod([mesh_sizes[a] for a in (target if isinstance(target, list) else [target]) if a]))
    rows = cfg.data.global_batch_size // ways("batch")
    tokens = rows * cfg.data.seq_len // C
    heads = ways("heads")
    kv_heads = int(np.lcm(m.num_kv_heads, heads)) // heads  # after repeat_kv_heads, per device
    kv = 2 * tokens * kv_heads * m.head_dim
    shard, ids = kv * dtype_bytes, tokens * 4
    forwards = 2 if m.remat != "none" else 1
    per_layer = forwards * (C - 1) * (shard + ids) + (C - 1) * (shard + ids) + C * kv * 4
    return per_layer * m.num_layers


BlockFwd = Callable[..., tuple[jax.Array, jax.Array]]  # (q, k, v, q_seg, kv_seg, causal) -> (o fp32, lse fp32)
BlockBwd = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]  # (q, k, v, o, lse, do, q_seg, kv_seg, causal)


def _combine(o, lse, o_b, lse_b):
    new = jnp.logaddexp(lse, lse_b)
    return o * jnp.exp(lse - new)[..., None] + o_b * jnp.exp(lse_b - new)[..., None], new


def _split(x, n):
    c = x.shape[1] // n
    return [x[:, i * c:(i + 1) * c] for i in range(n)]


def _local_attention(schedule: ContextSchedule, block_fwd: BlockFwd, block_bwd: BlockBwd):
    """The per-device attention [B, L/C, N, H] (inside shard_map), differentiable by its own ring."""
    C, n, order = schedule.size, schedule.chunks_per_device, schedule.order
    ring = schedule.attention == "ring"
    perm = [(i, (i + 1) % C) for i in range(C)]

    def kinds(idx, src):
        return [[pair_kind(chunk_index(idx, a, C, order), chunk_index(src, b, C, order)) for b in range(n)]
                for a in range(n)]

    def fwd_pair(kind, q, k, v, qs, ks):
        def skip(q, k, v, qs, ks):
            B, L, N, _ = q.shape
            return jnp.zeros(q.shape, jnp.float32), jnp.full((B, L, N), MASKED_LSE, jnp.float32)
        return jax.lax.switch(kind, [skip, lambda *a: block_fwd(*a, causal=True),
                                     lambda *a: block_fwd(*a, causal=False)], q, k, v, qs, ks)

    def bwd_pair(kind, q, k, v, o, lse, do, qs, ks):
        def skip(q, k, v, o, lse, do, qs, ks):
            return (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
                    jnp.zeros(v.shape, jnp.float32))
        return jax.lax.switch(kind, [skip, lambda *a: block_bwd(*a, causal=True),
                                     lambda *a: block_bwd(*a, causal=False)], q, k, v, o, lse, do, qs, ks)

    def blocks(k, v, seg, gathered):
        """The K/V blocks in the order they are visited: (source device, k, v, seg) per step."""
        if not ring:
            for src in range(C):
                yield src, gathered[0][src], gathered[1][src], gathered[2][src]
            return
        idx = jax.lax.axis_index(AXIS)
        for step in range(C):
            yield (idx - step) % C, k, v, seg
            if step < C - 1:
                k, v, seg = jax.lax.ppermute((k, v, seg), AXIS, perm)

    def forward(q, k, v, seg):
        idx = jax.lax.axis_index(AXIS)
        gathered = None if ring else tuple(jax.lax.all_gather(x, AXIS) for x in (k, v, seg))
        qp, qsp = _split(q, n), _split(seg, n)
        B, L, N, H = qp[0].shape
        o = [jnp.zeros((B, L, N, H), jnp.float32) for _ in range(n)]
        lse = [jnp.full((B, L, N), MASKED_LSE, jnp.float32) for _ in range(n)]
        for src, kb, vb, sb in blocks(k, v, seg, gathered):
            kp, vp, sp = _split(kb, n), _split(vb, n), _split(sb, n)
            kind = kinds(idx, src)
            for a in range(n):
                for b in range(n):
                    o_b, lse_b = fwd_pair(kind[a][b], qp[a], kp[b], vp[b], qsp[a], sp[b])
                    o[a], lse[a] = _combine(o[a], lse[a], o_b, lse_b)
        return jnp.concatenate(o, axis=1).astype(q.dtype), jnp.concatenate(lse, axis=1)

    @jax.custom_vjp
    def attention(q, k, v, seg):
        return forward(q, k, v, seg)[0]

    def attention_fwd(q, k, v, seg):
        o, lse = forward(q, k, v, seg)
        return o, (q, k, v, seg, o, lse)

    def attention_bwd(residuals, do):
        q, k, v, seg, o, lse = residuals
        idx = jax.lax.axis_index(AXIS)
        qp, qsp, op, lp, dop = _split(q, n), _split(seg, n), _split(o, n), _split(lse, n), _split(do, n)
        dq = [jnp.zeros(x.shape, jnp.float32) for x in qp]
        zeros_kv = jnp.zeros(k.shape, jnp.float32)

        def visit(src, kb, vb, sb, dk, dv):
            """Add one K/V block's pairs to dq (in place) and to the block's own (dk, dv)."""
            kp, vp, sp = _split(kb, n), _split(vb, n), _split(sb, n)
            dkp, dvp = _split(dk, n), _split(dv, n)
            kind = kinds(idx, src)
            for a in range(n):
                for b in range(n):
                    g = bwd_pair(kind[a][b], qp[a], kp[b], vp[b], op[a], lp[a], dop[a], qsp[a], sp[b])
                    dq[a], dkp[b], dvp[b] = dq[a] + g[0], dkp[b] + g[1], dvp[b] + g[2]
            return jnp.concatenate(dkp, axis=1), jnp.concatenate(dvp, axis=1)

        if ring:
            dk, dv = zeros_kv, zeros_kv
            kb, vb, sb = k, v, seg
            for step in range(C):
                dk, dv = visit((idx - step) % C, kb, vb, sb, dk, dv)
                if step < C - 1:  # the block moves on; its gradient accumulators with it
                    kb, vb, sb = jax.lax.ppermute((kb, vb, sb), AXIS, perm)
                dk, dv = jax.lax.ppermute((dk, dv), AXIS, perm)  # C hops: back at the block's owner
        else:
            gk, gv, gs = (jax.lax.all_gather(x, AXIS) for x in (k, v, seg))
            dks, dvs = zip(*(visit(src, gk[src], gv[src], gs[src], zeros_kv, zeros_kv) for src in range(C)))
            dk = jax.lax.psum_scatter(jnp.stack(dks), AXIS, scatter_dimension=0)
            dv = jax.lax.psum_scatter(jnp.stack(dvs), AXIS, scatter_dimension=0)
        return (jnp.concatenate(dq, axis=1).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None)

    attention.defvjp(attention_fwd, attention_bwd)
    return attention


def context_attention(q_BLNH: jax.Array, k_BLKH: jax.Array, v_BLKH: jax.Array, segment_ids_BL: jax.Array | None,
                      schedule: ContextSchedule, mesh: Mesh, qkv_spec: P, ids_spec: P,
                      block_fwd: BlockFwd, block_bwd: BlockBwd) -> jax.Array:
    """Causal GQA attention of a sequence sharded over `context` (in the schedule's chunk order).

    Args:
      q_BLNH, k_BLKH, v_BLKH: global arrays, `length` sharded over `context` (k/v with as many heads
        per shard as q needs: jaxtrain.model.attention.repeat_kv_heads).
      segment_ids_BL: packed-document ids, or None (one document).
      qkv_spec, ids_spec: their PartitionSpecs; the length entry must be exactly `context`.
      block_fwd, block_bwd: the per-block kernel pair (kernels.attention_block / _bwd).
    """
    if qkv_spec[1] != AXIS:
        raise ValueError(f"context attention needs the length sharded over exactly '{AXIS}', got {qkv_spec[1]!r}")
    if segment_ids_BL is None:
        segment_ids_BL = jnp.zeros(q_BLNH.shape[:2], jnp.int32)
    local = _local_attention(schedule, block_fwd, block_bwd)
    # check_vma=False as in Partitioning.per_shard: the custom VJP's cotangents carry no vma types.
    return jax.shard_map(local, mesh=mesh, in_specs=(qkv_spec, qkv_spec, qkv_spec, ids_spec), out_specs=qkv_spec,
                         check_vma=False)(q_BLNH, k_BLKH, v_BLKH, segment_ids_BL.astype(jnp.int32))
