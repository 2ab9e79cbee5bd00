"""Flash attention as Pallas kernels: a forward kernel and two backward kernels (dq, and dk/dv).

Shape legend: B batch, L sequence length, Lp L padded to a multiple of the blocks, N query heads,
K kv heads, G = N // K query heads per kv head, H head_dim; bq / bk: query / key-value tile lengths.

Algorithm (FlashAttention-2): the grid runs one program per (batch, head, q tile) (forward, dq) or
per (batch, head, kv tile) (dk/dv); each program loops over the tiles of the other sequence axis
with an online softmax, so the [L, L] score matrix never exists in memory. Under a causal mask the
loops stop (or start) at the diagonal, which skips fully-masked tiles; with a sliding window they
also start (or stop) at the first (last) tile the window reaches, so the work is O(L * window)
(the whole K/V rows still sit in VMEM, see Working set). The forward pass saves the log-sum-exp
per row; the backward pass recomputes the probabilities from it.

Layout: kernels see [B, N, Lp, H] so that each tile is a plain 2-D [rows, H] slab whose last two
dims are (sequence, head_dim), which is what TPU tiling wants. The wrapper pads and transposes;
XLA fuses those copies with their neighbours.

Working set: a forward/dq program holds one q tile and the whole K and V rows of its head
(2 * Lp * H elements, double-buffered); a dk/dv program the whole q and dO rows. That is 8 MiB of
VMEM at Lp = 8k, H = 128, bf16, and caps the sequence on TPU near 16k with default limits; longer
sequences need the kv axis moved into the grid.

GQA: the forward and dq kernels read kv head n // G for q head n through their index maps. The
dk/dv kernel runs per *query* head and writes [B, N, Lp, H]; the G heads of a group are summed
afterwards in XLA (as FlashAttention-2 does), which keeps every program independent and its
working set at one head. It works on the transposed tile S^T = K Q^T, so that its three matmuls
need no in-kernel transpose and lse / D are read as lane-major rows.

Attention sinks (gpt-oss) stay outside the kernels: the wrapper folds them into the forward's lse and
output, and the unchanged backward kernels run on that (o', lse') (see _flash_padded_fwd).

On CPU the kernels run with interpret=True (chosen automatically), on TPU compiled by Mosaic. TPU
wants block sizes that are multiples of 128 (the default); interpret mode takes multiples of 8.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .common import (MASK_VALUE, BlockSizes, as_block_sizes, check_attention_inputs, check_sinks, check_window,
                     vary_like_all)

DEFAULT_BLOCK_SIZES = BlockSizes(block_q=128, block_kv=128)

# q @ k^T without materialising k^T: contract the last dim of both operands.
_NT_DIMS = (((1,), (1,)), ((), ()))


class _Segments(NamedTuple):
    """Segment ids [B, Lp] (int32) as columns [B, Lp, 1] and lane-major rows [B, 1, Lp], so each
    kernel gets the orientation that broadcasts against its tile. All four are free reshapes."""

    q_col: jax.Array
    kv_row: jax.Array
    q_row: jax.Array
    kv_col: jax.Array


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static facts of one call; hashable so it can be a nondiff argument of the custom VJP."""

    causal: bool
    scale: float
    seq_len: int  # L, the unpadded length: keys at positions >= L are padding and masked out.
    padded_len: int  # Lp
    block_q: int
    block_kv: int
    groups: int  # G
    head_dim: int  # H
    interpret: bool
    # lse written for a row that sees no key: 0 for the standalone kernel (its backward masks those
    # rows); MASK_VALUE for a block of a blockwise attention, so the row weighs nothing when combined.
    empty_lse: float = 0.0
    window: int | None = None  # causal sliding window: query i sees keys i - window < j <= i

    @property
    def needs_length_mask(self) -> bool:
        # Padding is only visible in tiles past L; without padding that mask is all-true.
        return self.padded_len != self.seq_len


def _plan_blocks(seq_len: int, block_sizes: BlockSizes) -> tuple[int, int, int]:
    """Clamps the tiles to the (8-rounded) sequence and returns (bq, bk, Lp)."""
    rounded = -(-seq_len // 8) * 8
    bq = min(block_sizes.block_q, rounded)
    bk = min(block_sizes.block_kv, rounded)
    if bq % 8 or bk % 8:
        raise ValueError(f"pallas attention block sizes must be multiples of 8; got block_q={bq}, block_kv={bk}")
    tile = math.lcm(bq, bk)
    return bq, bk, -(-seq_len // tile) * tile


def _mask(cfg: _Config, q_start, k_start, q_seg, kv_seg, *, q_axis: int = 0):
    """Boolean mask of allowed (query, key) pairs for one tile, or None if all are allowed.

    q_axis=0: a [bq, bk] tile with q_seg [bq, 1] and kv_seg [1, bk]; q_axis=1: the transposed
    [bk, bq] tile of the dk/dv kernel with q_seg [1, bq] and kv_seg [bk, 1]. Either way the ids
    broadcast to the tile without reshapes.
    """
    shape = (cfg.block_q, cfg.block_kv) if q_axis == 0 else (cfg.block_kv, cfg.block_q)
    mask = None
    if cfg.causal or cfg.needs_length_mask:
        k_pos = k_start + lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
        if cfg.causal:
            q_pos = q_start + lax.broadcasted_iota(jnp.int32, shape, q_axis)
            mask = q_pos >= k_pos
            if cfg.window is not None:
                mask = mask & (q_pos - k_pos < cfg.window)
        if cfg.needs_length_mask:
            in_range = k_pos < cfg.seq_len
            mask = in_range if mask is None else mask & in_range
    if q_seg is not None:
        same = q_seg == kv_seg
        mask = same if mask is None else mask & same
    return mask


def _kv_tile_bounds(cfg: _Config, q_tile):
    """The kv tiles [lo, hi) q tile `q_tile` must visit: up to the diagonal when causal, from the
    first tile the sliding window reaches, and never the tiles that hold only padding
    (common.kv_tile_range is the same in plain Python)."""
    total = pl.cdiv(cfg.seq_len, cfg.block_kv)
    if not cfg.causal:
        return 0, total
    # Last query row of this tile is (q_tile + 1) * bq - 1; it sees keys up to that position.
    hi = jnp.minimum(total, lax.div((q_tile + 1) * cfg.block_q + cfg.block_kv - 1, cfg.block_kv))
    if cfg.window is None:
        return 0, hi
    # The first row, q_tile * bq, sees keys from q_tile * bq - window + 1 on; tiles before are skipped.
    return lax.div(jnp.maximum(q_tile * cfg.block_q - cfg.window + 1, 0), cfg.block_kv), hi


def _unpack(refs, n_in: int, n_seg: int):
    """Splits a kernel's refs into (inputs, segment refs, rest); the n_seg segment-id refs (0 when
    there are no segment ids) come right after the first n_in inputs."""
    return refs[:n_in], refs[n_in:n_in + n_seg], refs[n_in + n_seg:]


# ------------------------------------------------------------------------------------------------
# Forward kernel: grid (B, N, Lp // bq).
# ------------------------------------------------------------------------------------------------


def _fwd_kernel(*refs, cfg: _Config, has_segments: bool):
    (q_ref, k_ref, v_ref), seg_refs, (o_ref, lse_ref) = _unpack(refs, 3, 2 if has_segments else 0)
    q_seg_ref, kv_seg_ref = seg_refs if has_segments else (None, None)
    bq, bk = cfg.block_q, cfg.block_kv
    q_tile = pl.program_id(2)
    q_start = q_tile * bq
    q_bH = q_ref[...]
    q_seg = q_seg_ref[...] if has_segments else None  # [bq, 1]

    def body(j, carry):
        acc_bH, m_b1, l_b1 = carry
        k_start = pl.multiple_of(j * bk, bk)
        k_kH = k_ref[pl.ds(k_start, bk), :]
        v_kH = v_ref[pl.ds(k_start, bk), :]
        s_bk = lax.dot_general(q_bH, k_kH, _NT_DIMS, preferred_element_type=jnp.float32) * cfg.scale
        kv_seg = kv_seg_ref[:, pl.ds(k_start, bk)] if has_segments else None  # [1, bk]
        mask = _mask(cfg, q_start, k_start, q_seg, kv_seg)
        if mask is not None:
            s_bk = jnp.where(mask, s_bk, MASK_VALUE)
        m_new = jnp.maximum(m_b1, jnp.max(s_bk, axis=1, keepdims=True))
        p_bk = jnp.exp(s_bk - m_new)
        if mask is not None:
            # A fully masked row has s == m_new == MASK_VALUE, so exp gives 1: zero it explicitly.
            p_bk = jnp.where(mask, p_bk, 0.0)
        correction = jnp.exp(m_b1 - m_new)
        l_new = correction * l_b1 + jnp.sum(p_bk, axis=1, keepdims=True)
        pv_bH = jnp.dot(p_bk.astype(v_kH.dtype), v_kH, preferred_element_type=jnp.float32)
        return correction * acc_bH + pv_bH, m_new, l_new

    H = q_bH.shape[-1]
    init = (
        jnp.zeros((bq, H), jnp.float32),
        jnp.full((bq, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((bq, 1), jnp.float32),
    )
    acc_bH, m_b1, l_b1 = lax.fori_loop(*_kv_tile_bounds(cfg, q_tile), body, init)
    # Rows with nothing to attend to have l == 0: output 0 (as the reference does), not 0/0.
    empty = l_b1 == 0.0
    l_safe = jnp.where(empty, 1.0, l_b1)
    o_ref[...] = (acc_bH / l_safe).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, cfg.empty_lse, m_b1 + jnp.log(l_safe))


# ------------------------------------------------------------------------------------------------
# Backward kernels. With P = softmax(S), dO the output cotangent and D = rowsum(dO * O):
#   dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dQ = scale * dS K,   dK = scale * dS^T Q.
# ------------------------------------------------------------------------------------------------


def _dq_kernel(*refs, cfg: _Config, has_segments: bool):
    """Grid (B, N, Lp // bq): one q tile against the kv tiles it can see."""
    (q_ref, k_ref, v_ref), seg_refs, rest = _unpack(refs, 3, 2 if has_segments else 0)
    q_seg_ref, kv_seg_ref = seg_refs if has_segments else (None, None)
    do_ref, lse_ref, delta_ref, dq_ref = rest
    bq, bk = cfg.block_q, cfg.block_kv
    q_tile = pl.program_id(2)
    q_start = q_tile * bq
    q_bH, do_bH = q_ref[...], do_ref[...]
    lse_b1, delta_b1 = lse_ref[...], delta_ref[...]
    q_seg = q_seg_ref[...] if has_segments else None

    def body(j, dq_bH):
        k_start = pl.multiple_of(j * bk, bk)
        k_kH = k_ref[pl.ds(k_start, bk), :]
        v_kH = v_ref[pl.ds(k_start, bk), :]
        kv_seg = kv_seg_ref[:, pl.ds(k_start, bk)] if has_segments else None
        mask = _mask(cfg, q_start, k_start, q_seg, kv_seg)
        s_bk = lax.dot_general(q_bH, k_kH, _NT_DIMS, preferred_element_type=jnp.float32) * cfg.scale
        p_bk = jnp.exp(s_bk - lse_b1)
        if mask is not None:
            # Also zeroes fully masked rows, whose lse is the placeholder 0.
            p_bk = jnp.where(mask, p_bk, 0.0)
        dp_bk = lax.dot_general(do_bH, v_kH, _NT_DIMS, preferred_element_type=jnp.float32)
        ds_bk = p_bk * (dp_bk - delta_b1)
        return dq_bH + jnp.dot(ds_bk.astype(k_kH.dtype), k_kH, preferred_element_type=jnp.float32)

    dq_bH = lax.fori_loop(*_kv_tile_bounds(cfg, q_tile), body, jnp.zeros(q_bH.shape, jnp.float32))
    dq_ref[...] = (dq_bH * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, cfg: _Config, has_segments: bool):
    """Grid (B, N, Lp // bk): one kv tile against the q tiles of query head n that can see it.

    Works on the transposed tile, S^T = K Q^T [bk, bq], with lse and D as lane-major rows
    [1, Lp]: then dV += P^T dO and dK += dS^T Q are plain matmuls, and no transpose is needed.
    """
    (q_ref, k_ref, v_ref), seg_refs, rest = _unpack(refs, 3, 2 if has_segments else 0)
    q_seg_row_ref, kv_seg_col_ref = seg_refs if has_segments else (None, None)
    do_ref, lse_row_ref, delta_row_ref, dk_ref, dv_ref = rest
    bq, bk = cfg.block_q, cfg.block_kv
    kv_tile = pl.program_id(2)
    k_start = kv_tile * bk
    k_kH, v_kH = k_ref[...], v_ref[...]
    kv_seg = kv_seg_col_ref[...] if has_segments else None  # [bk, 1]

    def body(i, carry):
        dk_kH, dv_kH = carry
        q_start = pl.multiple_of(i * bq, bq)
        rows = pl.ds(q_start, bq)
        q_bH, do_bH = q_ref[rows, :], do_ref[rows, :]
        lse_1b, delta_1b = lse_row_ref[:, rows], delta_row_ref[:, rows]
        q_seg = q_seg_row_ref[:, rows] if has_segments else None  # [1, bq]
        mask = _mask(cfg, q_start, k_start, q_seg, kv_seg, q_axis=1)
        st_kb = lax.dot_general(k_kH, q_bH, _NT_DIMS, preferred_element_type=jnp.float32) * cfg.scale
        pt_kb = jnp.exp(st_kb - lse_1b)
        if mask is not None:
            pt_kb = jnp.where(mask, pt_kb, 0.0)
        dv_kH = dv_kH + jnp.dot(pt_kb.astype(do_bH.dtype), do_bH, preferred_element_type=jnp.float32)
        dpt_kb = lax.dot_general(v_kH, do_bH, _NT_DIMS, preferred_element_type=jnp.float32)
        dst_kb = pt_kb * (dpt_kb - delta_1b)
        dk_kH = dk_kH + jnp.dot(dst_kb.astype(q_bH.dtype), q_bH, preferred_element_type=jnp.float32)
        return dk_kH, dv_kH

    # Causal: query rows before this tile's first key never see it. Padded query rows (>= L) are
    # skipped: their dO is zero, so they would add nothing. Window: rows from this tile's last key
    # + window on (k_start + bk - 1 + window) are past the window of every key in it
    # (common.q_tile_range is the same in plain Python).
    first = lax.div(k_start, bq) if cfg.causal else 0
    last = pl.cdiv(cfg.seq_len, bq)
    if cfg.window is not None:
        last = jnp.minimum(last, lax.div(k_start + bk + cfg.window - 2, bq) + 1)
    zeros = jnp.zeros(k_kH.shape, jnp.float32)
    dk_kH, dv_kH = lax.fori_loop(first, last, body, (zeros, zeros))
    dk_ref[...] = (dk_kH * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_kH.astype(dv_ref.dtype)


# ------------------------------------------------------------------------------------------------
# pallas_call wrappers on the padded [B, N, Lp, H] layout.
# ------------------------------------------------------------------------------------------------


def _out_struct(shape, dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
    """An output shape that varies over the same shard_map axes as `like`.

    Inside `jax.shard_map` (check_vma=True, the default) pallas_call must be told how its outputs
    vary across mesh axes; they vary like q. The field is `manual_axis_type` in current JAX and was
    `vma` before, hence the lookup. Outside shard_map the value is empty and ignored.
    """
    aval = jax.typeof(like)
    for field in ("manual_axis_type", "vma"):
        if hasattr(aval, field):
            try:
                return jax.ShapeDtypeStruct(shape, dtype, **{field: getattr(aval, field)})
            except TypeError:
                continue
    return jax.ShapeDtypeStruct(shape, dtype)


def _compiler_params(cfg: _Config):
    """Backend hints: every grid axis is independent (megacore on TPU); none in interpret mode."""
    if cfg.interpret:
        return None
    platform = jax.default_backend()
    if platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel"))
    if platform == "gpu":
        from jax.experimental.pallas import triton as plgpu

        return plgpu.CompilerParams(num_warps=4, num_stages=2)
    return None


def _q_tile_spec(cfg):
    return pl.BlockSpec((None, None, cfg.block_q, cfg.head_dim), lambda b, n, i: (b, n, i, 0))


def _kv_whole_spec(cfg):
    G = cfg.groups
    return pl.BlockSpec((None, None, cfg.padded_len, cfg.head_dim), lambda b, n, i: (b, lax.div(n, G), 0, 0))


def _segment_specs_q_tiled(cfg):
    """Segment ids for kernels tiled over q: a q tile of [B, Lp, 1] and the whole kv row of [B, 1, Lp]."""
    return [
        pl.BlockSpec((None, cfg.block_q, 1), lambda b, n, i: (b, i, 0)),
        pl.BlockSpec((None, 1, cfg.padded_len), lambda b, n, i: (b, 0, 0)),
    ]


def _fwd_call(cfg: _Config, q, k, v, segs: _Segments | None, out_dtype=None):
    """q [B, N, Lp, H], k/v [B, K, Lp, H]. Returns o [B, N, Lp, H] in `out_dtype` (default q's) and
    lse [B, N, Lp, 1] fp32."""
    B, N, Lp, H = q.shape
    has_segments = segs is not None
    in_specs = [_q_tile_spec(cfg), _kv_whole_spec(cfg), _kv_whole_spec(cfg)]
    args = [q, k, v]
    if has_segments:
        in_specs += _segment_specs_q_tiled(cfg)
        args += [segs.q_col, segs.kv_row]
    row_spec = pl.BlockSpec((None, None, cfg.block_q, 1), lambda b, n, i: (b, n, i, 0))
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, has_segments=has_segments),
        grid=(B, N, Lp // cfg.block_q),
        in_specs=in_specs,
        out_specs=[_q_tile_spec(cfg), row_spec],
        out_shape=[_out_struct(q.shape, out_dtype or q.dtype, q), _out_struct((B, N, Lp, 1), jnp.float32, q)],
        compiler_params=_compiler_params(cfg),
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(*args)


def _bwd_call(cfg: _Config, q, k, v, segs: _Segments | None, o, lse, do):
    """Returns dq [B, N, Lp, H], dk and dv [B, K, Lp, H] for the padded layout."""
    B, N, Lp, H = q.shape
    K = k.shape[1]
    G = cfg.groups
    has_segments = segs is not None
    # D = rowsum(dO * O): one elementwise pass that XLA fuses; no kernel needed.
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)

    # dq: tiled over q rows like the forward pass.
    row_spec = pl.BlockSpec((None, None, cfg.block_q, 1), lambda b, n, i: (b, n, i, 0))
    in_specs = [_q_tile_spec(cfg), _kv_whole_spec(cfg), _kv_whole_spec(cfg)]
    args = [q, k, v]
    if has_segments:
        in_specs += _segment_specs_q_tiled(cfg)
        args += [segs.q_col, segs.kv_row]
    in_specs += [_q_tile_spec(cfg), row_spec, row_spec]
    args += [do, lse, delta]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, has_segments=has_segments),
        grid=(B, N, Lp // cfg.block_q),
        in_specs=in_specs,
        out_specs=_q_tile_spec(cfg),
        out_shape=_out_struct(q.shape, q.dtype, q),
        compiler_params=_compiler_params(cfg),
        interpret=cfg.interpret,
        name="flash_attention_dq",
    )(*args)

    # dk/dv: tiled over kv rows, one program per *query* head; whole q rows of that head, and lse
    # and D as lane-major rows [B, N, 1, Lp] (the same bytes as [B, N, Lp, 1]: a free reshape).
    q_whole = pl.BlockSpec((None, None, Lp, H), lambda b, n, j: (b, n, 0, 0))
    row_whole = pl.BlockSpec((None, None, 1, Lp), lambda b, n, j: (b, n, 0, 0))
    kv_tile = pl.BlockSpec((None, None, cfg.block_kv, H), lambda b, n, j: (b, lax.div(n, G), j, 0))
    out_tile = pl.BlockSpec((None, None, cfg.block_kv, H), lambda b, n, j: (b, n, j, 0))
    in_specs = [q_whole, kv_tile, kv_tile]
    args = [q, k, v]
    if has_segments:
        in_specs += [
            pl.BlockSpec((None, 1, Lp), lambda b, n, j: (b, 0, 0)),
            pl.BlockSpec((None, cfg.block_kv, 1), lambda b, n, j: (b, j, 0)),
        ]
        args += [segs.q_row, segs.kv_col]
    in_specs += [q_whole, row_whole, row_whole]
    args += [do, lse.reshape(B, N, 1, Lp), delta.reshape(B, N, 1, Lp)]
    # Per-q-head partial gradients are summed over the group below; keep them fp32 when G > 1.
    part_dtype = jnp.float32 if G > 1 else k.dtype
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, has_segments=has_segments),
        grid=(B, N, Lp // cfg.block_kv),
        in_specs=in_specs,
        out_specs=[out_tile, out_tile],
        out_shape=[_out_struct((B, N, Lp, H), part_dtype, q)] * 2,
        compiler_params=_compiler_params(cfg),
        interpret=cfg.interpret,
        name="flash_attention_dkv",
    )(*args)
    if G > 1:
        dk = dk.reshape(B, K, G, Lp, H).sum(axis=2).astype(k.dtype)
        dv = dv.reshape(B, K, G, Lp, H).sum(axis=2).astype(v.dtype)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash_padded(cfg: _Config, q, k, v, segs, sinks):
    return _flash_padded_fwd(cfg, q, k, v, segs, sinks)[0]


def _flash_padded_fwd(cfg, q, k, v, segs, sinks):
    if sinks is None:
        o, lse = _fwd_call(cfg, q, k, v, segs)
        return o, (q, k, v, segs, o, lse, None)
    # Sinks outside the kernel: with lse' = logaddexp(lse, sink) the row's softmax gains the term
    # exp(sink), so o' = o * exp(lse - lse'). The kernel's o is kept fp32 until that rescale.
    o, lse = _fwd_call(cfg, q, k, v, segs, out_dtype=jnp.float32)
    sink_1N11 = sinks.reshape(1, -1, 1, 1)
    lse_sink = jnp.logaddexp(lse, sink_1N11)
    o = (o * jnp.exp(lse - lse_sink)).astype(q.dtype)
    return o, (q, k, v, segs, o, lse_sink, sinks)


def _flash_padded_bwd(cfg, residuals, do):
    q, k, v, segs, o, lse, sinks = residuals
    # With sinks, (o', lse') are exactly what the flash backward needs: P' = exp(s - lse'),
    # D' = rowsum(dO * o'); and d sink = -sum over batch and rows of exp(sink - lse') * D'.
    dq, dk, dv = _bwd_call(cfg, q, k, v, segs, o, lse, do)
    dsinks = None
    if sinks is not None:
        delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)  # [B, N, Lp, 1]
        dsinks = -jnp.sum(jnp.exp(sinks.reshape(1, -1, 1, 1) - lse) * delta, axis=(0, 2, 3))
    return dq, dk, dv, None, dsinks  # segment ids are integers: no cotangent


_flash_padded.defvjp(_flash_padded_fwd, _flash_padded_bwd)


def pallas_flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    block_sizes: BlockSizes | tuple[int, int] | None = None,
    interpret: bool | None = None,
    window: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Flash attention with Pallas kernels; differentiable through a custom VJP with fused kernels.

    Args:
      q: [B, L, N, H] queries.
      k: [B, L, K, H] keys, N a multiple of K.
      v: [B, L, K, H] values.
      causal: mask keys after the query position.
      segment_ids: [B, L] int; a query attends only to keys with the same id (packed documents).
      kv_segment_ids: [B, L] ids of the keys when they differ from the queries' (defaults to
        segment_ids); lets tests build rows that see no key at all.
      block_sizes: tile lengths (clamped to the sequence); L need not be a multiple, it is padded.
      interpret: run the Pallas interpreter; None = interpret exactly when the backend is CPU.
      window: causal sliding window (static int >= 1) or None: query i sees keys
        i - window < j <= i (transformers' sliding_window), by index in the row, and with
        segment ids only keys of its segment. The forward and dq loops start at the first kv
        tile the window reaches and the dk/dv loop stops at the last q tile that reaches its
        kv tile: tiles wholly outside the window are skipped, not masked.
      sinks: [N] float attention-sink logits (gpt-oss) or None: exp(sinks[n]) joins every softmax
        denominator of head n. Applied outside the kernels through the row log-sum-exp (see
        _flash_padded_fwd); differentiable (d sinks from lse' and D').

    Returns:
      [B, L, N, H] in q's dtype. Rows with no visible key are 0 (their gradients too).
    """
    check_attention_inputs(q, k, v, segment_ids, "pallas")
    window = check_window(window, causal, "pallas")
    sinks = check_sinks(sinks, q.shape[2], "pallas")
    if kv_segment_ids is not None and segment_ids is None:
        raise ValueError("kv_segment_ids needs segment_ids")
    B, L, N, H = q.shape
    bq, bk, Lp = _plan_blocks(L, as_block_sizes(block_sizes, DEFAULT_BLOCK_SIZES))
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    cfg = _Config(
        causal=bool(causal), scale=1.0 / math.sqrt(H), seq_len=L, padded_len=Lp,
        block_q=bq, block_kv=bk, groups=N // k.shape[2], head_dim=H, interpret=bool(interpret), window=window,
    )

    def to_kernel_layout(x_BLXH):  # [B, L, X, H] -> [B, X, Lp, H]
        return jnp.pad(x_BLXH, ((0, 0), (0, Lp - L), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    if segment_ids is not None and kv_segment_ids is None:
        kv_segment_ids = segment_ids
    q, k, v, segment_ids, kv_segment_ids, sinks = vary_like_all(q, k, v, segment_ids, kv_segment_ids, sinks)
    segs = None
    if segment_ids is not None:
        # Padded positions get id 0; they are masked by length (keys) or sliced off (queries).
        q_seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, Lp - L)))
        kv_seg = jnp.pad(kv_segment_ids.astype(jnp.int32), ((0, 0), (0, Lp - L)))
        segs = _Segments(q_seg[:, :, None], kv_seg[:, None, :], q_seg[:, None, :], kv_seg[:, :, None])
    o_BNLH = _flash_padded(cfg, to_kernel_layout(q), to_kernel_layout(k), to_kernel_layout(v), segs, sinks)
    return o_BNLH.transpose(0, 2, 1, 3)[:, :L]


def _block_inputs(q, k, v, causal, segment_ids, kv_segment_ids, block_sizes, interpret):
    B, L, N, H = q.shape
    bq, bk, Lp = _plan_blocks(L, as_block_sizes(block_sizes, DEFAULT_BLOCK_SIZES))
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    cfg = _Config(causal=bool(causal), scale=1.0 / math.sqrt(H), seq_len=L, padded_len=Lp, block_q=bq,
                  block_kv=bk, groups=N // k.shape[2], head_dim=H, interpret=bool(interpret),
                  empty_lse=MASK_VALUE)
    segs = None
    if segment_ids is not None:
        kv_segment_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
        q_seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, Lp - L)))
        kv_seg = jnp.pad(kv_segment_ids.astype(jnp.int32), ((0, 0), (0, Lp - L)))
        segs = _Segments(q_seg[:, :, None], kv_seg[:, None, :], q_seg[:, None, :], kv_seg[:, :, None])
    layout = lambda x: jnp.pad(x, ((0, 0), (0, Lp - L), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    return cfg, segs, layout


def pallas_attention_block(q, k, v, *, causal: bool, segment_ids=None, kv_segment_ids=None,
                           block_sizes=None, interpret=None):
    """(o, lse) of q against one block of keys with the forward kernel (kernels.reference.attention_block's
    contract): o [B, L, N, H] fp32, lse [B, L, N] fp32, MASK_VALUE for a row that sees no key."""
    B, L, N, H = q.shape
    cfg, segs, layout = _block_inputs(q, k, v, causal, segment_ids, kv_segment_ids, block_sizes, interpret)
    o, lse = _fwd_call(cfg, layout(q), layout(k), layout(v), segs)
    return o.transpose(0, 2, 1, 3)[:, :L].astype(jnp.float32), lse[..., 0].transpose(0, 2, 1)[:, :L]


def pallas_attention_block_bwd(q, k, v, o, lse, do, *, causal: bool, segment_ids=None, kv_segment_ids=None,
                               block_sizes=None, interpret=None):
    """(dq, dk, dv) of one block given the combined o, lse [B, L, N] and dO, with the fused backward
    kernels (kernels.reference.attention_block_bwd's contract)."""
    B, L, N, H = q.shape
    cfg, segs, layout = _block_inputs(q, k, v, causal, segment_ids, kv_segment_ids, block_sizes, interpret)
    lse_p = jnp.pad(lse.transpose(0, 2, 1), ((0, 0), (0, 0), (0, cfg.padded_len - L)))[..., None]
    dq, dk, dv = _bwd_call(cfg, layout(q), layout(k), layout(v), segs, layout(o.astype(q.dtype)), lse_p,
                           layout(do.astype(q.dtype)))
    back = lambda x: x.transpose(0, 2, 1, 3)[:, :L].astype(jnp.float32)
    return back(dq), back(dk), back(dv)
