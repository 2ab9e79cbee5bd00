"""Flash attention written in Triton (forward, dq, dk/dv), called from JAX through jax-triton.

Shape legend: B batch, L sequence length, N query heads, K kv heads, G = N // K query heads per kv
head, H head_dim (D: H rounded up to a power of two >= 16 for the tiles); BLOCK_M / BLOCK_N:
query / key-value tile lengths.

Layout: the kernels read q/k/v in the model's own [B, L, N|K, H] layout through strides, so no
transposes or padding are needed; ragged tiles at the end of the sequence are masked loads.
Log-sum-exp and D = rowsum(dO * O) are [B, N, L] fp32.

Sliding window (WINDOW > 0): the forward and dq loops start at the first kv tile the window of
the q tile's first row reaches, and the dk/dv loop stops after the last q tile whose rows reach
the kv tile: tiles wholly outside the window are never loaded.

GQA: the forward and dq kernels read kv head n // G. The dk/dv kernel runs one program per
(kv tile, batch, *query* head) and writes fp32 partial gradients [B, L, N, H] that the wrapper
sums over the G heads of each group (FlashAttention-2 does the same), which keeps all programs
independent: no atomics.

Attention sinks (gpt-oss) stay outside the kernels: the custom VJP folds them into the forward's lse
and output, and the unchanged backward kernels run on that (o', lse') (see _flash_fwd).

The @triton.jit kernels and `launch_plan` need only `triton`; `jax_triton` is imported lazily in
the JAX wrapper (it fails to import under a CPU-only jax). Tests launch the kernels directly on
CPU torch tensors under TRITON_INTERPRET=1 with the same `launch_plan`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from .common import (MASK_VALUE, BlockSizes, as_block_sizes, check_attention_inputs, check_sinks, check_window,
                     vary_like_all)

# Globals read inside @triton.jit must be constexpr.
_MASK = tl.constexpr(MASK_VALUE)

DEFAULT_FWD_BLOCKS = BlockSizes(block_q=128, block_kv=64)
DEFAULT_BWD_BLOCKS = BlockSizes(block_q=64, block_kv=64)


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """a @ b with an fp32 accumulator. UPCAST_DOT is set only under TRITON_INTERPRET: the
    interpreter keeps bf16 as raw uint16 bits and tl.dot would multiply those bits, so there the
    (already rounded) operands are widened to fp32 first, which gives the same products."""
    if UPCAST_DOT:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _allowed(rows, cols, row_ok, col_ok, q_seg, kv_seg, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr,
             WINDOW: tl.constexpr):
    """[BLOCK_M, BLOCK_N] mask of (query, key) pairs that may attend. WINDOW > 0: causal sliding
    window, query i sees keys i - WINDOW < j <= i (0 = none)."""
    ok = row_ok[:, None] & col_ok[None, :]
    if CAUSAL:
        ok = ok & (rows[:, None] >= cols[None, :])
    if WINDOW > 0:
        ok = ok & (rows[:, None] - cols[None, :] < WINDOW)
    if HAS_SEG:
        ok = ok & (q_seg[:, None] == kv_seg[None, :])
    return ok


@triton.jit
def _fwd_kernel(
    Q, K, V, Q_SEG, KV_SEG,
    seq_len, num_heads, groups, sm_scale,
    stride_qb, stride_ql, stride_qn, stride_kb, stride_kl, stride_kn,
    O, LSE,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Grid (cdiv(L, BLOCK_M), B * N): one q tile of one head against the kv tiles it can see."""
    pid_m = tl.program_id(0)
    pid_bn = tl.program_id(1)
    b = pid_bn // num_heads
    n = pid_bn % num_heads
    # int64 offsets: B * L * N * H can pass 2**31 for long sequences.
    q_base = b.to(tl.int64) * stride_qb + n * stride_qn
    kv_base = b.to(tl.int64) * stride_kb + (n // groups) * stride_kn
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < seq_len
    dim_ok = dims < HEAD_DIM
    q = tl.load(Q + q_base + rows[:, None] * stride_ql + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q_seg = rows  # placeholder when HAS_SEG is False; never compared
    if HAS_SEG:
        q_seg = tl.load(Q_SEG + b * seq_len + rows, mask=row_ok, other=0)

    m_i = tl.full([BLOCK_M], _MASK, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = seq_len
    if CAUSAL:
        # Skip the kv tiles wholly after this tile's last query row.
        hi = tl.minimum(seq_len, (pid_m + 1) * BLOCK_M)
    lo = 0
    if WINDOW > 0:
        # ... and those wholly before the window of its first row (pid_m * BLOCK_M - WINDOW + 1 on).
        lo = tl.maximum(pid_m * BLOCK_M - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < seq_len
        kv_mask = col_ok[:, None] & dim_ok[None, :]
        k = tl.load(K + kv_base + cols[:, None] * stride_kl + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + kv_base + cols[:, None] * stride_kl + dims[None, :], mask=kv_mask, other=0.0)
        kv_seg = cols
        if HAS_SEG:
            kv_seg = tl.load(KV_SEG + b * seq_len + cols, mask=col_ok, other=0)
        ok = _allowed(rows, cols, row_ok, col_ok, q_seg, kv_seg, CAUSAL, HAS_SEG, WINDOW)
        s = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * sm_scale
        s = tl.where(ok, s, _MASK)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Masked entries are zeroed explicitly: in a fully masked row s - m_new is 0, not -inf.
        p = tl.where(ok, tl.exp(s - m_new[:, None]), 0.0)
        correction = tl.exp(m_i - m_new)
        l_i = l_i * correction + tl.sum(p, 1)
        acc = acc * correction[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        m_i = m_new

    # Rows that see no key (l == 0) output 0, like the reference, instead of 0 / 0.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(O + q_base + rows[:, None] * stride_ql + dims[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])
    # MASK_VALUE for a row that sees no key, so the blockwise form's blocks combine (it weighs nothing);
    # the backward never reads it (every pair of that row is masked).
    lse = tl.where(empty, _MASK, m_i + tl.log(l_safe))
    tl.store(LSE + pid_bn.to(tl.int64) * seq_len + rows, lse, mask=row_ok)


# Backward, with P = softmax(S), D = rowsum(dO * O):
#   dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dQ = scale * dS K,   dK = scale * dS^T Q.


@triton.jit
def _dq_kernel(
    Q, K, V, Q_SEG, KV_SEG, DO, LSE, DELTA,
    seq_len, num_heads, groups, sm_scale,
    stride_qb, stride_ql, stride_qn, stride_kb, stride_kl, stride_kn,
    DQ,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Grid (cdiv(L, BLOCK_M), B * N): dq of one q tile, looping over the kv tiles it sees."""
    pid_m = tl.program_id(0)
    pid_bn = tl.program_id(1)
    b = pid_bn // num_heads
    n = pid_bn % num_heads
    q_base = b.to(tl.int64) * stride_qb + n * stride_qn
    kv_base = b.to(tl.int64) * stride_kb + (n // groups) * stride_kn
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < seq_len
    dim_ok = dims < HEAD_DIM
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q_offsets = q_base + rows[:, None] * stride_ql + dims[None, :]
    q = tl.load(Q + q_offsets, mask=q_mask, other=0.0)
    do = tl.load(DO + q_offsets, mask=q_mask, other=0.0)
    row_base = pid_bn.to(tl.int64) * seq_len
    lse = tl.load(LSE + row_base + rows, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + row_base + rows, mask=row_ok, other=0.0)
    q_seg = rows
    if HAS_SEG:
        q_seg = tl.load(Q_SEG + b * seq_len + rows, mask=row_ok, other=0)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = seq_len
    if CAUSAL:
        hi = tl.minimum(seq_len, (pid_m + 1) * BLOCK_M)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(pid_m * BLOCK_M - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < seq_len
        kv_mask = col_ok[:, None] & dim_ok[None, :]
        k = tl.load(K + kv_base + cols[:, None] * stride_kl + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + kv_base + cols[:, None] * stride_kl + dims[None, :], mask=kv_mask, other=0.0)
        kv_seg = cols
        if HAS_SEG:
            kv_seg = tl.load(KV_SEG + b * seq_len + cols, mask=col_ok, other=0)
        ok = _allowed(rows, cols, row_ok, col_ok, q_seg, kv_seg, CAUSAL, HAS_SEG, WINDOW)
        s = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * sm_scale
        p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), DOT_PRECISION, UPCAST_DOT)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, DOT_PRECISION, UPCAST_DOT)
    tl.store(DQ + q_offsets, (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


@triton.jit
def _dkv_kernel(
    Q, K, V, Q_SEG, KV_SEG, DO, LSE, DELTA,
    seq_len, num_heads, groups, sm_scale,
    stride_qb, stride_ql, stride_qn, stride_kb, stride_kl, stride_kn,
    DK_PART, DV_PART,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Grid (cdiv(L, BLOCK_N), B * N): the share of query head n in dk/dv of one kv tile.

    DK_PART / DV_PART are fp32 [B, L, N, H] (q's strides); the wrapper sums each group's G heads.
    """
    pid_n = tl.program_id(0)
    pid_bn = tl.program_id(1)
    b = pid_bn // num_heads
    n = pid_bn % num_heads
    q_base = b.to(tl.int64) * stride_qb + n * stride_qn
    kv_base = b.to(tl.int64) * stride_kb + (n // groups) * stride_kn
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    col_ok = cols < seq_len
    dim_ok = dims < HEAD_DIM
    kv_mask = col_ok[:, None] & dim_ok[None, :]
    k = tl.load(K + kv_base + cols[:, None] * stride_kl + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + kv_base + cols[:, None] * stride_kl + dims[None, :], mask=kv_mask, other=0.0)
    kv_seg = cols
    if HAS_SEG:
        kv_seg = tl.load(KV_SEG + b * seq_len + cols, mask=col_ok, other=0)
    row_base = pid_bn.to(tl.int64) * seq_len

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = 0
    if CAUSAL:
        # Query tiles that end before this kv tile's first key never see it.
        lo = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M
    hi = seq_len
    if WINDOW > 0:
        # Rows from this tile's last key + WINDOW on are past the window of every key in it.
        hi = tl.minimum(seq_len, (pid_n + 1) * BLOCK_N - 1 + WINDOW)
    for start in range(lo, hi, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < seq_len
        q_mask = row_ok[:, None] & dim_ok[None, :]
        q_offsets = q_base + rows[:, None] * stride_ql + dims[None, :]
        q = tl.load(Q + q_offsets, mask=q_mask, other=0.0)
        do = tl.load(DO + q_offsets, mask=q_mask, other=0.0)
        lse = tl.load(LSE + row_base + rows, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + row_base + rows, mask=row_ok, other=0.0)
        q_seg = rows
        if HAS_SEG:
            q_seg = tl.load(Q_SEG + b * seq_len + rows, mask=row_ok, other=0)
        ok = _allowed(rows, cols, row_ok, col_ok, q_seg, kv_seg, CAUSAL, HAS_SEG, WINDOW)
        s = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * sm_scale
        p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
        dv += _dot(tl.trans(p.to(do.dtype)), do, DOT_PRECISION, UPCAST_DOT)
        dp = _dot(do, tl.trans(v), DOT_PRECISION, UPCAST_DOT)
        ds = p * (dp - delta[:, None])
        dk += _dot(tl.trans(ds.to(q.dtype)), q, DOT_PRECISION, UPCAST_DOT)
    out_offsets = q_base + cols[:, None] * stride_ql + dims[None, :]
    tl.store(DK_PART + out_offsets, dk * sm_scale, mask=kv_mask)
    tl.store(DV_PART + out_offsets, dv, mask=kv_mask)


# ------------------------------------------------------------------------------------------------
# Launch plan: grid, scalar arguments and constexprs, shared by the JAX wrapper and the tests.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Everything a launch needs besides the tensors.

    Kernel argument order: input tensors, then `scalars`, then output tensors; `meta` are the
    constexprs (keywords). jax-triton's triton_call passes its outputs after the inputs, which is
    why the outputs come last in every kernel signature.
    """

    grid: tuple[int, int]
    scalars: tuple
    meta: dict
    num_warps: int
    num_stages: int


def _check_blocks(blocks: BlockSizes) -> None:
    for name in ("block_q", "block_kv"):
        value = getattr(blocks, name)
        # tl.arange needs powers of two; tl.dot needs every tile dim >= 16.
        if value < 16 or value & (value - 1):
            raise ValueError(f"triton attention {name} must be a power of two >= 16, got {value}")


def launch_plan(
    kind: str,
    q_shape: tuple[int, int, int, int],
    kv_heads: int,
    dtype_name: str,
    *,
    causal: bool,
    has_segments: bool,
    block_sizes: BlockSizes | tuple[int, int] | None = None,
    window: int | None = None,
) -> LaunchPlan:
    """Grid, scalars and constexprs for kernel `kind` ('fwd', 'dq' or 'dkv').

    Args:
      kind: which kernel.
      q_shape: (B, L, N, H); q, k and v are contiguous in [B, L, heads, H].
      kv_heads: K.
      dtype_name: q's dtype name ('float32', 'bfloat16', 'float16'); fp32 uses exact fp32 dots
        (not TF32) so that fp32 results match the reference.
      causal: causal masking.
      has_segments: whether segment id tensors are real (else dummies, never read).
      block_sizes: (BLOCK_M, BLOCK_N) override; defaults differ for forward and backward.
      window: causal sliding window (int >= 1) or None; the WINDOW constexpr (0 = none), so
        each window size compiles its own kernels (a model has one or two).

    Returns:
      The LaunchPlan.
    """
    B, L, N, H = q_shape
    window = check_window(window, causal, "triton")
    default = DEFAULT_FWD_BLOCKS if kind == "fwd" else DEFAULT_BWD_BLOCKS
    blocks = as_block_sizes(block_sizes, default)
    _check_blocks(blocks)
    # Short sequences: shrink tiles toward L (still powers of two >= 16).
    block_m = min(blocks.block_q, max(16, triton.next_power_of_2(L)))
    block_n = min(blocks.block_kv, max(16, triton.next_power_of_2(L)))
    tiles = triton.cdiv(L, block_n) if kind == "dkv" else triton.cdiv(L, block_m)
    scalars = (
        L, N, N // kv_heads, 1.0 / math.sqrt(H),
        L * N * H, N * H, H,  # q strides (b, l, n); the h stride is 1
        L * kv_heads * H, kv_heads * H, H,  # k/v strides
    )
    meta = dict(
        HEAD_DIM=H, BLOCK_D=max(16, triton.next_power_of_2(H)), BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=bool(causal), HAS_SEG=bool(has_segments),
        DOT_PRECISION="ieee" if dtype_name == "float32" else "tf32",
        UPCAST_DOT=bool(triton.knobs.runtime.interpret) and dtype_name != "float32",
        WINDOW=window or 0,
    )
    num_warps = 4 if H <= 64 else 8
    # Three stages of fp32 k/v tiles would fill Hopper's 227 KiB of shared memory.
    num_stages = 3 if kind == "fwd" and dtype_name != "float32" else 2
    return LaunchPlan(grid=(tiles, B * N), scalars=scalars, meta=meta, num_warps=num_warps, num_stages=num_stages)


_POINTER_TYPES = {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16"}


def aot_compile(kind: str, q_shape, kv_heads: int, dtype_name: str, *, causal: bool, has_segments: bool,
                block_sizes=None, arch: int = 90, window: int | None = None):
    """Compiles one kernel for an NVIDIA GPU of compute capability `arch` without needing a GPU.

    Catches lowering errors and reports shared memory (`.metadata.shared`, bytes) on machines
    without a GPU; tests use it for sm_90 (H100/H200). Must run without TRITON_INTERPRET.

    Returns:
      The compiled kernel (triton.compiler.CompiledKernel).
    """
    from triton.backends.compiler import GPUTarget

    kernel = {"fwd": _fwd_kernel, "dq": _dq_kernel, "dkv": _dkv_kernel}[kind]
    plan = launch_plan(kind, q_shape, kv_heads, dtype_name, causal=causal, has_segments=has_segments,
                       block_sizes=block_sizes, window=window)
    ptr = _POINTER_TYPES[dtype_name]
    inputs = [ptr, ptr, ptr, "*i32", "*i32"] + ([] if kind == "fwd" else [ptr, "*fp32", "*fp32"])
    scalars = ["i32", "i32", "i32", "fp32"] + ["i32"] * 6
    outputs = {"fwd": [ptr, "*fp32"], "dq": [ptr], "dkv": ["*fp32", "*fp32"]}[kind]
    runtime_names = [n for n in kernel.arg_names if n not in plan.meta]
    signature = dict(zip(runtime_names, inputs + scalars + outputs))
    signature.update({name: "constexpr" for name in plan.meta})
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=dict(plan.meta))
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": plan.num_warps, "num_stages": plan.num_stages})


# ------------------------------------------------------------------------------------------------
# JAX entry point (GPU only).
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Config:
    causal: bool
    block_sizes: BlockSizes | None
    bwd_block_sizes: BlockSizes | None
    window: int | None = None


def _plan(cfg: _Config, kind: str, q, k, has_segments: bool) -> LaunchPlan:
    blocks = cfg.block_sizes if kind == "fwd" else cfg.bwd_block_sizes
    return launch_plan(kind, q.shape, k.shape[2], q.dtype.name, causal=cfg.causal,
                       has_segments=has_segments, block_sizes=blocks, window=cfg.window)


def _call(plan: LaunchPlan, kernel, inputs, out_shape, name: str):
    import jax_triton as jt  # lazily: importing it fails under a CPU-only jax

    return jt.triton_call(
        *inputs, *plan.scalars, kernel=kernel, out_shape=out_shape, grid=plan.grid, name=name,
        num_warps=plan.num_warps, num_stages=plan.num_stages, **plan.meta,
    )


def _segments(segs):
    """Real (q_seg, kv_seg) int32 [B, L], or 1-element dummies the kernels never read."""
    if segs is None:
        dummy = jnp.zeros((1,), jnp.int32)
        return dummy, dummy, False
    return segs[0], segs[1], True


def _fwd(cfg: _Config, q, k, v, segs, out_dtype=None):
    """(o [B, L, N, H] in `out_dtype` (default q's), lse [B, N, L] fp32)."""
    B, L, N, H = q.shape
    q_seg, kv_seg, has_seg = _segments(segs)
    plan = _plan(cfg, "fwd", q, k, has_seg)
    o, lse = _call(plan, _fwd_kernel, (q, k, v, q_seg, kv_seg),
                   [jax.ShapeDtypeStruct(q.shape, out_dtype or q.dtype), jax.ShapeDtypeStruct((B, N, L), jnp.float32)],
                   "flash_attention_fwd")
    return o, lse


def _bwd(cfg: _Config, q, k, v, segs, do, lse, delta, dq_dtype):
    """(dq in `dq_dtype`, dk fp32, dv fp32) from the dq and dk/dv kernels; lse and delta [B, N, L] fp32."""
    B, L, N, H = q.shape
    K = k.shape[2]
    q_seg, kv_seg, has_seg = _segments(segs)
    inputs = (q, k, v, q_seg, kv_seg, do, lse, delta)
    dq = _call(_plan(cfg, "dq", q, k, has_seg), _dq_kernel, inputs,
               jax.ShapeDtypeStruct(q.shape, dq_dtype), "flash_attention_dq")
    part = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    dk_part, dv_part = _call(_plan(cfg, "dkv", q, k, has_seg), _dkv_kernel, inputs, [part, part],
                             "flash_attention_dkv")
    # Query head n = kv_head * G + g: sum the G shares of each kv head.
    dk = dk_part.reshape(B, L, K, N // K, H).sum(axis=3)
    dv = dv_part.reshape(B, L, K, N // K, H).sum(axis=3)
    return dq, dk, dv


def _delta(do, o):
    """D = rowsum(dO * O) as [B, N, L] fp32: one fused elementwise pass in XLA."""
    return jnp.einsum("blnh,blnh->bnl", do.astype(jnp.float32), o.astype(jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg: _Config, q, k, v, segs, sinks):
    return _flash_fwd(cfg, q, k, v, segs, sinks)[0]


def _flash_fwd(cfg, q, k, v, segs, sinks):
    if sinks is None:
        o, lse = _fwd(cfg, q, k, v, segs)
        return o, (q, k, v, segs, o, lse, None)
    # Sinks outside the kernel: with lse' = logaddexp(lse, sink) the row's softmax gains the term
    # exp(sink), so o' = o * exp(lse - lse'). The kernel stores o in fp32 for that rescale.
    o, lse = _fwd(cfg, q, k, v, segs, jnp.float32)
    lse_sink = jnp.logaddexp(lse, sinks[None, :, None])  # [B, N, L]
    o = (o * jnp.exp(lse - lse_sink).transpose(0, 2, 1)[..., None]).astype(q.dtype)
    return o, (q, k, v, segs, o, lse_sink, sinks)


def _flash_bwd(cfg, residuals, do):
    q, k, v, segs, o, lse, sinks = residuals
    do = do.astype(q.dtype)
    # With sinks, (o', lse') are exactly what the flash backward needs: P' = exp(s - lse'),
    # D' = rowsum(dO * o'); and d sink = -sum over batch and rows of exp(sink - lse') * D'.
    delta = _delta(do, o)
    dq, dk, dv = _bwd(cfg, q, k, v, segs, do, lse, delta, q.dtype)
    dsinks = None if sinks is None else -jnp.sum(jnp.exp(sinks[None, :, None] - lse) * delta, axis=(0, 2))
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, dsinks  # segment ids are integers: no cotangent


_flash.defvjp(_flash_fwd, _flash_bwd)


def _setup(q, k, v, causal, segment_ids, kv_segment_ids, block_sizes, window=None):
    """Checked inputs -> (_Config, (q_seg, kv_seg) int32 or None); kv ids default to the queries'."""
    check_attention_inputs(q, k, v, segment_ids, "triton")
    window = check_window(window, causal, "triton")
    blocks = None if block_sizes is None else as_block_sizes(block_sizes, DEFAULT_FWD_BLOCKS)
    cfg = _Config(causal=bool(causal), block_sizes=blocks, bwd_block_sizes=blocks, window=window)
    if segment_ids is None:
        return cfg, None
    kv = segment_ids if kv_segment_ids is None else kv_segment_ids
    return cfg, (segment_ids.astype(jnp.int32), kv.astype(jnp.int32))


def triton_flash_attention(
    q,
    k,
    v,
    *,
    causal: bool = True,
    segment_ids=None,
    kv_segment_ids=None,
    block_sizes: BlockSizes | tuple[int, int] | None = None,
    window: int | None = None,
    sinks=None,
):
    """Flash attention with the Triton kernels via jax-triton (NVIDIA GPU); differentiable.

    Args:
      q: [B, L, N, H] queries.
      k: [B, L, K, H] keys, N a multiple of K.
      v: [B, L, K, H] values.
      causal: mask keys after the query position.
      segment_ids: [B, L] int; queries attend only to keys with the same id.
      kv_segment_ids: ids of the keys when they differ from the queries' (defaults to segment_ids).
      block_sizes: (BLOCK_M, BLOCK_N) powers of two >= 16 for all three kernels; None = defaults
        (forward 128x64, backward 64x64).
      window: causal sliding window (static int >= 1) or None: query i sees keys
        i - window < j <= i (transformers' sliding_window), by index in the row, and with
        segment ids only keys of its segment. The forward and dq loops start at the first kv
        tile the window reaches and the dk/dv loop ends at the last q tile that reaches its kv
        tile: tiles wholly outside the window are skipped, not masked.
      sinks: [N] float attention-sink logits (gpt-oss) or None: exp(sinks[n]) joins every softmax
        denominator of head n. Applied outside the kernels through the row log-sum-exp (see
        _flash_fwd); differentiable (d sinks from lse' and D').

    Returns:
      [B, L, N, H] in q's dtype; rows with no visible key are 0.
    """
    if segment_ids is not None and kv_segment_ids is None:
        kv_segment_ids = segment_ids
    check_attention_inputs(q, k, v, segment_ids, "triton")  # before the sinks' check reads N
    sinks = check_sinks(sinks, q.shape[2], "triton")
    q, k, v, segment_ids, kv_segment_ids, sinks = vary_like_all(q, k, v, segment_ids, kv_segment_ids, sinks)
    cfg, segs = _setup(q, k, v, causal, segment_ids, kv_segment_ids, block_sizes, window)
    return _flash(cfg, q, k, v, segs, sinks)


def triton_attention_block(q, k, v, *, causal: bool, segment_ids=None, kv_segment_ids=None, block_sizes=None):
    """(o, lse) of q against one block of keys with the forward kernel (kernels.reference.attention_block's
    contract): o [B, L, N, H] fp32 (the kernel stores its fp32 accumulator, not q's dtype), lse [B, L, N]
    fp32, MASK_VALUE for a row that sees no key. The q and kv blocks have the same length."""
    cfg, segs = _setup(q, k, v, causal, segment_ids, kv_segment_ids, block_sizes)
    o, lse = _fwd(cfg, q, k, v, segs, jnp.float32)
    return o, lse.transpose(0, 2, 1)


def triton_attention_block_bwd(q, k, v, o, lse, do, *, causal: bool, segment_ids=None, kv_segment_ids=None,
                               block_sizes=None):
    """(dq, dk, dv) fp32 of one block given the combined o, its lse [B, L, N] over every block and dO,
    with the dq and dk/dv kernels (kernels.reference.attention_block_bwd's contract): the kernels read
    P = exp(S - lse) and D = rowsum(dO * O) of the combined output, which is each block's exact share."""
    cfg, segs = _setup(q, k, v, causal, segment_ids, kv_segment_ids, block_sizes)
    do = do.astype(q.dtype)
    return _bwd(cfg, q, k, v, segs, do, lse.transpose(0, 2, 1), _delta(do, o), jnp.float32)
