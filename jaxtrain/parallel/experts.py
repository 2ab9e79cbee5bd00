"""Dispatch of routed tokens to SwiGLU experts, with or without expert parallelism.

`routed_experts(x, experts, gates, w_gate, w_up, w_down, capacity_factor, dtype, part)` returns the
gated sum of each token's k experts' outputs and the number of dropped assignments. Every kind
takes gpt-oss's per-expert biases and clamped SwiGLU (`biases`, `clamp`; `swiglu_product`).

With a mesh it runs per device (shard_map): each device routes its own tokens (a *group*, as in
GShard and MaxText), so capacity is per group. Chosen from the config and the devices' platform
(`dispatch_kind`; the `start` event names it):

- capacity (`model.capacity_factor` > 0): each expert takes at most C = ceil(factor x T x k / E)
  of a group's T x k assignments, first choices before second choices, then in token order; the
  overflow is dropped (its gate contributes nothing; counted in `moe_dropped_fraction`). Tokens go
  into an [E, C, D] buffer; under expert parallelism the buffer is exchanged by a dense all-to-all
  over the `expert` mesh axis, each device runs its E / ep experts on every group's slots, and a
  second all-to-all brings the results back.
- dropless without expert parallelism on GPU/TPU: the assignments sorted by expert and run as one
  grouped matmul (`jax.lax.ragged_dot`, XLA's grouped kernel).
- dropless without expert parallelism on the CPU, where XLA expands ragged_dot to a masked dense
  matmul over every expert (E x the FLOPs): tiled. Each expert's assignments are padded to whole
  tiles of m rows (`tile_rows`), every tile runs one batched matmul with its expert's weights
  (gathered per tile); the padding costs at most E x m rows.
- dropless with expert parallelism, where the platform has `ragged_all_to_all` (GPU, TPU): each
  device sorts its assignments by expert and sends every expert device exactly the rows routed to
  it (`jax.lax.ragged_all_to_all`, offsets from an all-gather of the per-expert counts); the
  receiver groups what it got by its own experts, runs them as one grouped matmul
  (`ragged_dot`), and a second ragged exchange returns the rows. Receive buffers hold ep x T x k rows
  (any one device could be sent every assignment).
- dropless with expert parallelism elsewhere (XLA:CPU has no ragged-all-to-all): the capacity path
  with C = T (no expert can receive more than every token of a group), so nothing is dropped; the
  buffer is E x larger than the tokens.

Expert weights enter per device as [E / ep, D, F / tensor]: XLA gathers their fsdp shards first
(the `embed` dimension), and the down projection's partial sums over `tensor` are added by a psum.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtrain.parallel.sharding import Partitioning


# Platforms whose XLA lowers ragged-all-to-all; XLA:CPU answers UNIMPLEMENTED (jax 0.10.2, 0.12).
RAGGED_ALL_TO_ALL_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")


def dispatch_kind(capacity_factor: float, expert_ways: int, platform: str) -> str:
    """What `routed_experts` runs on devices of `platform`: 'capacity'; dropless without expert
    parallelism 'dropless-ragged_dot' (GPU/TPU: XLA's grouped matmul) or 'dropless-tiled' (the CPU,
    where XLA expands ragged_dot over every expert); dropless with it 'dropless-ragged_all_to_all'
    (GPU/TPU) or 'dropless-dense-all_to_all' (the CPU)."""
    if capacity_factor > 0:
        return "capacity"
    native = platform in RAGGED_ALL_TO_ALL_PLATFORMS
    if expert_ways == 1:
        return "dropless-ragged_dot" if native else "dropless-tiled"
    return "dropless-ragged_all_to_all" if native else "dropless-dense-all_to_all"


def capacity(tokens: int, k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert for one group of `tokens` (dropless with expert parallelism: every token)."""
    if capacity_factor <= 0:
        return tokens
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * k / num_experts)))


def swiglu_product(gate: jax.Array, up: jax.Array, clamp: tuple[float, float] | None = None) -> jax.Array:
    """silu(gate) * up; with `clamp` = (limit, alpha) gpt-oss's clamped SwiGLU (transformers'
    GptOssExperts): gate clamped to <= limit, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)."""
    if clamp is None:
        return jax.nn.silu(gate) * up
    limit, alpha = clamp
    gate = jnp.minimum(gate, jnp.asarray(limit, gate.dtype))
    up = jnp.clip(up, jnp.asarray(-limit, up.dtype), jnp.asarray(limit, up.dtype))
    return (up + 1) * (gate * jax.nn.sigmoid(gate * jnp.asarray(alpha, gate.dtype)))


def _biased(y, b, dtype):
    """y (fp32) + b (fp32, or None) cast to `dtype`: the bias added before the rounding, and its
    gradient a sum of fp32 values (as `project` keeps weight gradients)."""
    return (y if b is None else y + b.astype(jnp.float32)).astype(dtype)


def _swiglu(x, w_gate, w_up, w_down, dtype, spec_in: str, spec_out: str, b_gate=None, b_up=None,
            clamp=None):
    """The experts' hidden activations and their down projection (fp32, without its bias: that
    goes on after the partial sums over `tensor` are added). `b_gate`, `b_up`: broadcast against
    the hidden activations, or None."""
    f32 = jnp.float32
    gate = _biased(jnp.einsum(spec_in, x.astype(dtype), w_gate.astype(dtype), preferred_element_type=f32), b_gate, dtype)
    up = _biased(jnp.einsum(spec_in, x.astype(dtype), w_up.astype(dtype), preferred_element_type=f32), b_up, dtype)
    return jnp.einsum(spec_out, swiglu_product(gate, up, clamp), w_down.astype(dtype), preferred_element_type=f32)


def _add(y, b):
    """y + b (the down projection's bias, fp32), or y when there is none."""
    return y if b is None else y + b.astype(jnp.float32)


def _combine(y_AD: jax.Array, k: int, T: int) -> jax.Array:
    """[k·T, D] (choice-major) -> [T, D]: each token's k gated outputs added. As k slices' adds, not a
    sum over a reshaped axis: XLA:CPU fuses that reduction with the gather feeding it and runs the
    combine ~10x slower (2.2 vs 0.2 ms at T=1024, k=2, D=64)."""
    y_TD = y_AD[:T]
    for i in range(1, k):
        y_TD = y_TD + y_AD[i * T:(i + 1) * T]
    return y_TD


def _exclusive_cumsum(a: jax.Array, axis: int = -1) -> jax.Array:
    return jnp.cumsum(a, axis=axis) - a


def _ragged_exchange(xs_AD, sizes_E, w_gate, w_up, w_down, dtype, ep_axes, ep, reduce_tensor, exchange,
                     biases=(None, None, None), clamp=None):
    """Dropless expert parallelism by ragged all-to-all: rows sorted by expert [A, D] -> their
    experts' outputs [A, D] fp32, same order. `exchange` has `jax.lax.ragged_all_to_all`'s signature.
    `biases`: this device's experts' (b_gate [El, F], b_up [El, F], b_down [El, D]) or Nones."""
    A, D = xs_AD.shape
    El = w_gate.shape[0]
    me = jax.lax.axis_index(ep_axes)
    # counts[i, j, e]: rows source device i sends to device j's local expert e.
    counts = jax.lax.all_gather(sizes_E, ep_axes).reshape(ep, ep, El)
    rows = counts.sum(-1)  # [source, destination]
    send, recv = rows[me], rows[:, me]
    send_offsets = _exclusive_cumsum(rows, axis=1)  # where each destination's rows start at the source
    # A receiver lays out what it gets by source: source i's rows after those of sources < i.
    recv_offsets = _exclusive_cumsum(rows, axis=0)
    got = exchange(xs_AD, jnp.zeros((ep * A, D), xs_AD.dtype), send_offsets[me], send, recv_offsets[me], recv,
                   axis_name=ep_axes)
    # Each received row's local expert: the segments are (source, local expert), source-major.
    segment = jnp.searchsorted(jnp.cumsum(counts[:, me].reshape(-1)), jnp.arange(ep * A), side="right")
    valid = segment < ep * El
    local_e = jnp.where(valid, segment % El, El)
    order = jnp.argsort(local_e, stable=True)  # by local expert, the unused tail last
    group_sizes = counts[:, me].sum(0).astype(jnp.int32)
    f32 = jnp.float32
    xs = got[order]
    out = _grouped_swiglu(xs, w_gate, w_up, w_down, group_sizes, jnp.minimum(local_e[order], El - 1), dtype,
                          reduce_tensor, biases, clamp)
    out = jnp.where(valid[order][:, None], out, 0.0).astype(dtype)
    out = jnp.zeros_like(out).at[order].set(out)  # back to the received layout
    # And back: what source i sent me returns to where it came from.
    back = exchange(out, jnp.zeros((A, D), dtype), recv_offsets[:, me], recv, send_offsets[:, me], send,
                    axis_name=ep_axes)
    return back.astype(f32)


def _grouped_swiglu(xs_AD, w_gate, w_up, w_down, group_sizes, e_A, dtype, reduce_tensor, biases, clamp):
    """Rows sorted by expert [A, D] (expert e_A per row) through their experts as grouped matmuls
    (`ragged_dot`), biases per row's expert -> [A, D] fp32, the partial sums over `tensor` added."""
    f32 = jnp.float32
    b_gate, b_up, b_down = (None if b is None else b[e_A] for b in biases)
    gate = _biased(jax.lax.ragged_dot(xs_AD, w_gate.astype(dtype), group_sizes, preferred_element_type=f32), b_gate, dtype)
    up = _biased(jax.lax.ragged_dot(xs_AD, w_up.astype(dtype), group_sizes, preferred_element_type=f32), b_up, dtype)
    out = jax.lax.ragged_dot(swiglu_product(gate, up, clamp), w_down.astype(dtype), group_sizes,
                             preferred_element_type=f32)
    return _add(reduce_tensor(out), b_down)


def tile_rows(assignments: int, num_experts: int) -> int:
    """Rows per tile of the tiled grouped matmul: a power of two, 8 to 128, with E tiles' padding at
    most about a quarter of the assignments (each expert's rows are padded to whole tiles)."""
    m = 8
    while m < 128 and 2 * m * num_experts <= assignments // 4:
        m *= 2
    return m


def _group(x_TD, experts_Tk, gates_Tk, w_gate, w_up, w_down, capacity_factor, dtype,
           num_experts: int, ep_axes: tuple[str, ...], ep: int, tensor_axes: tuple[str, ...], kind: str,
           exchange=None, biases=(None, None, None), clamp=None):
    """One group's tokens -> (y [T, D] fp32, dropped assignments), by dispatch `kind` (`dispatch_kind`).
    `exchange`: the ragged all-to-all of 'dropless-ragged_all_to_all'. `biases`: the local experts'
    (b_gate [E, F], b_up [E, F], b_down [E, D]) or Nones; `clamp`: `swiglu_product`'s."""
    T, D = x_TD.shape
    k = experts_Tk.shape[1]
    E = num_experts
    A = T * k
    # Assignments in priority order: every token's first choice, then every second choice, ...
    e_A = experts_Tk.T.reshape(-1)
    g_A = gates_Tk.T.reshape(-1).astype(jnp.float32)
    tok_A = jnp.tile(jnp.arange(T, dtype=jnp.int32), k)

    def reduce_tensor(y):
        return jax.lax.psum(y, tensor_axes) if tensor_axes else y

    if kind in ("dropless-ragged_dot", "dropless-ragged_all_to_all"):  # tokens sorted by expert
        order = jnp.argsort(e_A, stable=True)
        sizes = jnp.bincount(e_A, length=E).astype(jnp.int32)
        xs = x_TD[tok_A[order]].astype(dtype)
        if kind == "dropless-ragged_all_to_all":
            out = _ragged_exchange(xs, sizes, w_gate, w_up, w_down, dtype, ep_axes, ep, reduce_tensor, exchange,
                                   biases, clamp)
        else:  # one grouped matmul
            out = _grouped_swiglu(xs, w_gate, w_up, w_down, sizes, e_A[order], dtype, reduce_tensor, biases, clamp)
        y_A = jnp.zeros_like(out).at[order].set(out)
        return _combine(y_A * g_A[:, None], k, T), jnp.float32(0)

    # Slots: each assignment's rank among its expert's, first choices first (GShard's priority).
    onehot_AE = jax.nn.one_hot(e_A, E, dtype=jnp.int32)
    pos_A = jnp.take_along_axis(jnp.cumsum(onehot_AE, axis=0), e_A[:, None], axis=1)[:, 0] - 1
    if kind == "dropless-tiled":
        # Each expert's rows padded to whole tiles of m; every tile runs its expert's weights
        # (gathered per tile). sum_e ceil(n_e / m) <= (A + E (m - 1)) / m tiles, reached when every
        # n_e = 1 mod m: the padding costs < E·m rows of compute, against ragged_dot's E x all rows
        # where XLA expands it (the CPU).
        m = tile_rows(A, E)
        tiles = (A + E * (m - 1)) // m
        per_expert = (jnp.sum(onehot_AE, axis=0) + m - 1) // m
        slot_A = _exclusive_cumsum(per_expert)[e_A] * m + pos_A
        buf = jnp.zeros((tiles * m, D), dtype).at[slot_A].add(x_TD[tok_A].astype(dtype)).reshape(tiles, m, D)
        # A tile's expert: how many experts' tiles end at or before it (E x tiles compares: cheap, where
        # searchsorted's default is a while loop).
        tile_e = jnp.minimum(jnp.sum(jnp.cumsum(per_expert)[None, :] <= jnp.arange(tiles)[:, None], axis=1), E - 1)
        tile_b = [None if b is None else b[tile_e][:, None, :] for b in biases]  # [tiles, 1, F or D]
        out = _add(reduce_tensor(_swiglu(buf, w_gate[tile_e], w_up[tile_e], w_down[tile_e], dtype,
                                         "tmd,tdf->tmf", "tmf,tfd->tmd", tile_b[0], tile_b[1], clamp)), tile_b[2])
        y_A = out.reshape(tiles * m, D).astype(jnp.float32)[slot_A] * g_A[:, None]
        return _combine(y_A, k, T), jnp.float32(0)

    C = capacity(T, k, E, capacity_factor)
    keep_A = pos_A < C
    slot_A = jnp.where(keep_A, e_A * C + pos_A, E * C)  # the dropped: past the end, not written
    buf = jnp.zeros((E * C, D), dtype).at[slot_A].add(x_TD[tok_A].astype(dtype), mode="drop").reshape(E, C, D)
    slot_b = [None if b is None else b[:, None, :] for b in biases]  # [E or E / ep, 1, F or D]
    if ep > 1:  # my slots for every device's experts out; every device's slots for my experts in
        El = E // ep
        buf = jax.lax.all_to_all(buf, ep_axes, 0, 0, tiled=True)  # [ep (source) * El, C, D]
        buf = buf.reshape(ep, El, C, D).swapaxes(0, 1).reshape(El, ep * C, D)
        out = _add(reduce_tensor(_swiglu(buf, w_gate, w_up, w_down, dtype, "ecd,edf->ecf", "ecf,efd->ecd",
                                         slot_b[0], slot_b[1], clamp)), slot_b[2])
        out = out.astype(dtype).reshape(El, ep, C, D).swapaxes(0, 1).reshape(ep * El, C, D)
        out = jax.lax.all_to_all(out, ep_axes, 0, 0, tiled=True)  # [E, C, D]: my slots' results
    else:
        out = _add(reduce_tensor(_swiglu(buf, w_gate, w_up, w_down, dtype, "ecd,edf->ecf", "ecf,efd->ecd",
                                         slot_b[0], slot_b[1], clamp)), slot_b[2])
    # The dropped read some kept slot (clamped) times a zero gate.
    y_A = out.reshape(E * C, D).astype(jnp.float32)[jnp.minimum(slot_A, E * C - 1)] * jnp.where(keep_A, g_A, 0.0)[:, None]
    return _combine(y_A, k, T), jnp.sum(~keep_A).astype(jnp.float32)


def routed_experts(x_BLD: jax.Array, experts_BLk: jax.Array, gates_BLk: jax.Array, w_gate_EDF: jax.Array,
                   w_up_EDF: jax.Array, w_down_EFD: jax.Array, capacity_factor: float, dtype: Any,
                   part: Partitioning = Partitioning(), kind: str | None = None,
                   ragged_exchange: Callable = jax.lax.ragged_all_to_all, *,
                   biases: tuple[jax.Array, jax.Array, jax.Array] | None = None,
                   clamp: tuple[float, float] | None = None) -> tuple[jax.Array, jax.Array]:
    """(y [B, L, D] fp32, dropped assignments: a scalar) for routed tokens (module doc).

    `kind`: the dispatch (`dispatch_kind`); None chooses it by the devices' platform. Tests on the
    CPU name the GPU/TPU kinds, with `ragged_exchange` an exact emulation of the ragged all-to-all
    built from a dense one. `biases` (gpt-oss, model.mlp_bias): (b_gate [E, F], b_up [E, F],
    b_down [E, D]), each expert's down bias added to its output before the gate weights it (as
    transformers' GptOssExperts); `clamp`: (limit, alpha) of the clamped SwiGLU (`swiglu_product`).
    """
    biases = (None, None, None) if biases is None else tuple(biases)
    E = w_gate_EDF.shape[0]
    mesh = part.mesh
    platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
    if mesh is None or mesh.size == 1:
        B, L, D = x_BLD.shape
        kind = kind or dispatch_kind(capacity_factor, 1, platform)
        y, dropped = _group(x_BLD.reshape(B * L, D), experts_BLk.reshape(B * L, -1), gates_BLk.reshape(B * L, -1),
                            w_gate_EDF, w_up_EDF, w_down_EFD, capacity_factor, dtype, E, (), 1, (), kind,
                            biases=biases, clamp=clamp)
        return y.reshape(B, L, D), dropped

    def axes(entry) -> tuple[str, ...]:
        entries = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        return tuple(a for a in entries if mesh.shape[a] > 1)

    def spec(names) -> P:  # size-1 axes left out: nothing is split, summed or exchanged over them
        return P(*(axes(entry) or None for entry in part.spec(names)))

    tok = spec(("batch", "length", None))
    w_in, w_out = spec(("experts", None, "moe_mlp")), spec(("experts", "moe_mlp", None))
    ep_axes, tensor_axes = axes(w_in[0]), axes(w_in[2])
    ep = math.prod(mesh.shape[a] for a in ep_axes)
    group_axes = tuple(a for entry in tok for a in axes(entry))
    if ep > 1 and not set(ep_axes) <= set(group_axes):
        raise ValueError(f"expert parallelism over {ep_axes} needs the batch split over them too (mesh.rules['batch'])")

    kind = kind or dispatch_kind(capacity_factor, ep, platform)

    present = [b is not None for b in biases]
    # The biases split like their weights: b_gate and b_up as the hidden units, b_down over experts only.
    b_specs = [s for s, p in zip((spec(("experts", "moe_mlp")),) * 2 + (spec(("experts", None)),), present) if p]

    def local(x, e, g, wg, wu, wd, *bs):
        b, l, d = x.shape
        it = iter(bs)
        local_biases = tuple(next(it) if p else None for p in present)
        y, dropped = _group(x.reshape(b * l, d), e.reshape(b * l, -1), g.reshape(b * l, -1), wg, wu, wd,
                            capacity_factor, dtype, E, ep_axes, ep, tensor_axes, kind, ragged_exchange,
                            local_biases, clamp)
        return y.reshape(b, l, d), dropped.reshape(1)

    dropped_spec = P(group_axes or None)
    # check_vma=False: under the pipeline's vmaps (spmd_axis_name stage, data) JAX 0.10 and 0.12 give
    # the batched body's values mismatched varying-axes types and refuse it (as for
    # Partitioning.per_shard). Without the check, psum's transpose relies on shard_map scaling the
    # cotangents of axes the out_specs leave out; tests/parallel compare every gradient leaf.
    y, dropped = jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, w_in, w_in, w_out, *b_specs),
                               check_vma=False, out_specs=(tok, dropped_spec))(
        x_BLD, experts_BLk, gates_BLk, w_gate_EDF, w_up_EDF, w_down_EFD, *(b for b in biases if b is not None))
    return y, jnp.sum(dropped)
