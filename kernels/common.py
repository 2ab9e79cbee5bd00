"""Pieces shared by every attention implementation: block sizes, shape checks, the mask value.

Shape legend (used in every kernel file): B batch, L sequence length, N query heads, K kv heads,
G = N // K query heads per kv head, H head_dim (Hv: the value head size, H unless 'xla' is given another).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# Scores of masked positions. Finite (not -inf) so that `s - max(s)` of a fully masked row is 0,
# never inf - inf = NaN; masked probabilities are then zeroed explicitly.
MASK_VALUE = -1e30


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile lengths along the sequence for the fused kernels (forward and both backward kernels).

    Attributes:
      block_q: query rows per tile.
      block_kv: key/value rows per tile.

    Frozen (hashable) because it is a static argument of jitted functions.
    """

    block_q: int = 128
    block_kv: int = 128

    def __post_init__(self):
        for name in ("block_q", "block_kv"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"BlockSizes.{name} must be a positive int, got {value!r}")


def as_block_sizes(block_sizes: BlockSizes | tuple[int, int] | None, default: BlockSizes) -> BlockSizes:
    """Accepts None (use `default`), a BlockSizes, or a (block_q, block_kv) tuple."""
    if block_sizes is None:
        return default
    if isinstance(block_sizes, BlockSizes):
        return block_sizes
    if isinstance(block_sizes, (tuple, list)) and len(block_sizes) == 2:
        return BlockSizes(int(block_sizes[0]), int(block_sizes[1]))
    raise ValueError(f"block_sizes must be None, BlockSizes or (block_q, block_kv); got {block_sizes!r}")


def check_attention_inputs(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None,
                           implementation: str | None = None) -> None:
    """Raises ValueError unless q [B, L, N, H], k [B, L, K, H], v [B, L, K, Hv] with N % K == 0 and
    segment_ids [B, L].

    Hv != H (a value head size other than the query/key head size, as in multi-head latent
    attention) is taken only by `implementation` 'xla', and when `implementation` is None (not yet
    resolved: `flash_attention` checks shapes before it picks one, and the kernel entries then
    check again with their name). Every implementation calls this first, so they all reject the
    same inputs with the same message.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [batch, seq, heads, head_dim]; got {q.shape}, {k.shape}, {v.shape}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same batch, seq and kv heads; got {k.shape} and {v.shape}")
    B, L, N, H = q.shape
    if k.shape[0] != B or k.shape[1] != L or k.shape[3] != H:
        raise ValueError(f"k/v must be [{B}, {L}, kv_heads, {H}] to match q {q.shape}; got {k.shape}")
    Hv = v.shape[3]
    if Hv != H and implementation not in (None, "xla"):
        raise ValueError(f"attention implementation {implementation!r}: value head size {Hv} != query/key head "
                         f"size {H}: only implementation 'xla' takes that")
    K = k.shape[2]
    if K == 0 or N % K != 0:
        raise ValueError(f"q heads ({N}) must be a multiple of kv heads ({K})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if segment_ids is not None:
        if tuple(segment_ids.shape) != (B, L):
            raise ValueError(f"segment_ids must be [batch, seq] = [{B}, {L}]; got {tuple(segment_ids.shape)}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids must be integers; got {segment_ids.dtype}")


def check_sinks(sinks: jax.Array | None, num_heads: int, implementation: str) -> jax.Array | None:
    """Validates attention sinks (gpt-oss) and returns them as fp32 [N], or None (no sinks).

    A sink is one learned logit per query head that joins every softmax row of that head as an
    extra term exp(sink) in the denominator: it takes probability mass and adds no value.

    Raises:
      ValueError naming `implementation`: sinks that are not a floating [N] array, or sinks for
      'cudnn' (jax.nn.dot_product_attention has no sink term).
    """
    if sinks is None:
        return None
    if implementation == "cudnn":
        raise ValueError("attention implementation 'cudnn' takes no attention sinks "
                         "(jax.nn.dot_product_attention has no sink term); use 'triton', 'pallas' or 'xla'")
    shape = tuple(getattr(sinks, "shape", ()))
    if shape != (num_heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise ValueError(f"attention implementation {implementation!r}: sinks must be a float array [heads] = "
                         f"[{num_heads}]; got shape {shape}, dtype {getattr(sinks, 'dtype', type(sinks).__name__)}")
    return jnp.asarray(sinks, jnp.float32)


def check_window(window: int | None, causal: bool, implementation: str) -> int | None:
    """Validates a sliding window and returns it as a Python int (or None: no window).

    The window is causal and counts the query itself: query i sees key j iff 0 <= i - j < window
    (transformers' `sliding_window_overlay`, `kv_idx > q_idx - sliding_window`, under its causal
    mask; Gemma 2/3, Mistral). It is static: it sets the kernels' loop bounds.

    Raises:
      ValueError naming `implementation`: a window that is not a positive int, or one with
      causal=False (a two-sided window is another mask, which no kernel implements).
    """
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"attention window must be a positive int (static) or None; got {window!r} "
                         f"for implementation {implementation!r}")
    if not causal:
        raise ValueError(f"attention implementation {implementation!r}: window={window} needs causal=True "
                         "(the sliding window is causal: query i sees keys i - window < j <= i)")
    return int(window)


# ------------------------------------------------------------------------------------------------
# shard_map support. Inside `jax.shard_map` (check_vma=True, the default) every value records the
# mesh axes it varies over, and a custom VJP must return cotangents that vary exactly like its
# inputs. With MQA under tensor parallelism, q varies over 'tensor' while k/v do not; the kernels'
# dk/dv would then vary where k does not. Making every input vary like the union first lets JAX's
# own transpose of that cast insert the psum. The attribute names moved between JAX releases
# (`aval.vma` / `lax.pvary` before, `aval.manual_axis_type.varying` / `lax.pcast` now).
# ------------------------------------------------------------------------------------------------


def varying_axes(x: jax.Array) -> frozenset:
    """Mesh axes `x` varies over inside shard_map; empty outside."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None and hasattr(mat, "varying"):
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def vary_like_all(*xs):
    """Returns xs (None entries kept) cast to vary over the union of their varying axes."""
    target = frozenset().union(*(varying_axes(x) for x in xs if x is not None))
    out = []
    for x in xs:
        missing = tuple(sorted(target - varying_axes(x))) if x is not None else ()
        if missing:
            x = jax.lax.pcast(x, missing, to="varying") if hasattr(jax.lax, "pcast") else jax.lax.pvary(x, missing)
        out.append(x)
    return tuple(out)


def kv_tile_range(q_tile: int, seq_len: int, block_q: int, block_kv: int, *, causal: bool = True,
                  window: int | None = None) -> tuple[int, int]:
    """kv tiles [lo, hi) the forward and dq loops of q tile `q_tile` visit, in plain Python.

    hi = cdiv(min(L, (t + 1) * bq), bk) when causal (the diagonal; else cdiv(L, bk)); lo =
    max(0, t * bq - window + 1) // bk with a window (the first tile holding a key that the tile's
    first query sees; else 0). Both kernel families compute the same bounds inside the kernel
    (pallas_attention._kv_tile_bounds, the Triton loops' lo/hi); tests check the kernels against
    this function by poisoning the tiles it says are skipped.
    """
    total = -(-seq_len // block_kv)
    hi = min(total, -(-((q_tile + 1) * block_q) // block_kv)) if causal else total
    lo = max(0, q_tile * block_q - window + 1) // block_kv if window is not None else 0
    return lo, max(lo, hi)


def q_tile_range(kv_tile: int, seq_len: int, block_q: int, block_kv: int, *, causal: bool = True,
                 window: int | None = None) -> tuple[int, int]:
    """q tiles [lo, hi) the dk/dv loop of kv tile `kv_tile` visits: from the tile holding its first
    key's row when causal, up to the tile holding row (last key + window - 1) with a window."""
    lo = kv_tile * block_kv // block_q if causal else 0
    hi = -(-seq_len // block_q)
    if window is not None:
        hi = min(hi, ((kv_tile + 1) * block_kv + window - 2) // block_q + 1)
    return lo, max(lo, hi)


def visited_tiles(seq_len: int, block_q: int, block_kv: int, *, causal: bool = True, window: int | None = None,
                  q_tiles: int | None = None) -> int:
    """(q tile, kv tile) pairs the forward (and dq) loops visit: the sum of kv_tile_range over the
    q tiles. Kernel FLOPs of the forward are visited_tiles * 4 * bq * bk * H per (batch, head); the
    dk/dv loop visits the same pairs from the other side (q_tile_range).

    q_tiles: how many q tiles the grid has (default cdiv(L, bq); the Pallas grid covers the padded
    length, whose extra tiles it counts).
    """
    count = 0
    for t in range(-(-seq_len // block_q) if q_tiles is None else q_tiles):
        lo, hi = kv_tile_range(t, seq_len, block_q, block_kv, causal=causal, window=window)
        count += hi - lo
    return count
