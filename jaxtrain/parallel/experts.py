"""Dispatch of routed tokens to SwiGLU experts, with or without expert parallelism.

`routed_experts(x, experts, gates, w_gate, w_up, w_down, capacity_factor, dtype, part)` returns the
gated sum of each token's k experts' outputs and the number of dropped assignments.

With a mesh it runs per device (shard_map): each device routes its own tokens (a *group*, as in
GShard and MaxText), so capacity is per group. Three ways, chosen from the config:

- capacity (`model.capacity_factor` > 0): each expert takes at most C = ceil(factor x T x k / E)
  of a group's T x k assignments, first choices before second choices, then in token order; the
  overflow is dropped (its gate contributes nothing; counted in `moe_dropped_fraction`). Tokens go
  into an [E, C, D] buffer; under expert parallelism the buffer is exchanged by a dense all-to-all
  over the `expert` mesh axis, each device runs its E / ep experts on every group's slots, and a
  second all-to-all brings the results back.
- dropless without expert parallelism: the assignments sorted by expert and run as one grouped
  matmul (`jax.lax.ragged_dot`; on the CPU XLA expands it to masked dense matmuls).
- dropless with expert parallelism: the capacity path with C = T (no expert can receive more than
  every token of a group), so nothing is dropped; the buffer is E x larger than the tokens. A
  `ragged_all_to_all` exchange is not built (docs/moe.md).

Expert weights enter per device as [E / ep, D, F / tensor]: XLA gathers their fsdp shards first
(the `embed` dimension), and the down projection's partial sums over `tensor` are added by a psum.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtrain.parallel.sharding import Partitioning


def dispatch_kind(capacity_factor: float, expert_ways: int) -> str:
    """What `routed_experts` runs: 'capacity', 'dropless-ragged_dot' or 'dropless-dense-all_to_all'."""
    if capacity_factor > 0:
        return "capacity"
    return "dropless-ragged_dot" if expert_ways == 1 else "dropless-dense-all_to_all"


def capacity(tokens: int, k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert for one group of `tokens` (dropless with expert parallelism: every token)."""
    if capacity_factor <= 0:
        return tokens
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * k / num_experts)))


def _swiglu(x, w_gate, w_up, w_down, dtype, spec_in: str, spec_out: str):
    f32 = jnp.float32
    gate = jnp.einsum(spec_in, x.astype(dtype), w_gate.astype(dtype), preferred_element_type=f32).astype(dtype)
    up = jnp.einsum(spec_in, x.astype(dtype), w_up.astype(dtype), preferred_element_type=f32).astype(dtype)
    return jnp.einsum(spec_out, jax.nn.silu(gate) * up, w_down.astype(dtype), preferred_element_type=f32)


def _group(x_TD, experts_Tk, gates_Tk, w_gate, w_up, w_down, capacity_factor, dtype,
           num_experts: int, ep_axes: tuple[str, ...], ep: int, tensor_axes: tuple[str, ...]):
    """One group's tokens -> (y [T, D] fp32, dropped assignments)."""
    T, D = x_TD.shape
    k = experts_Tk.shape[1]
    E = num_experts
    # Assignments in priority order: every token's first choice, then every second choice, ...
    e_A = experts_Tk.T.reshape(-1)
    g_A = gates_Tk.T.reshape(-1).astype(jnp.float32)
    tok_A = jnp.tile(jnp.arange(T, dtype=jnp.int32), k)

    def reduce_tensor(y):
        return jax.lax.psum(y, tensor_axes) if tensor_axes else y

    if capacity_factor <= 0 and ep == 1:  # dropless: grouped matmul over tokens sorted by expert
        order = jnp.argsort(e_A, stable=True)
        sizes = jnp.bincount(e_A, length=E).astype(jnp.int32)
        xs = x_TD[tok_A[order]].astype(dtype)
        f32 = jnp.float32
        gate = jax.lax.ragged_dot(xs, w_gate.astype(dtype), sizes, preferred_element_type=f32).astype(dtype)
        up = jax.lax.ragged_dot(xs, w_up.astype(dtype), sizes, preferred_element_type=f32).astype(dtype)
        out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down.astype(dtype), sizes, preferred_element_type=f32)
        out = reduce_tensor(out)
        y_A = jnp.zeros_like(out).at[order].set(out)
        y_TD = jnp.sum((y_A * g_A[:, None]).reshape(k, T, D), axis=0)
        return y_TD, jnp.float32(0)

    C = capacity(T, k, E, capacity_factor)
    onehot_AE = jax.nn.one_hot(e_A, E, dtype=jnp.int32)
    pos_A = jnp.take_along_axis(jnp.cumsum(onehot_AE, axis=0), e_A[:, None], axis=1)[:, 0] - 1
    keep_A = pos_A < C
    slot_A = jnp.where(keep_A, e_A * C + pos_A, E * C)  # the dropped go to one extra slot, discarded
    buf = jnp.zeros((E * C + 1, D), dtype).at[slot_A].add(x_TD[tok_A].astype(dtype))[:-1].reshape(E, C, D)
    if ep > 1:  # my slots for every device's experts out; every device's slots for my experts in
        El = E // ep
        buf = jax.lax.all_to_all(buf, ep_axes, 0, 0, tiled=True)  # [ep (source) * El, C, D]
        buf = buf.reshape(ep, El, C, D).swapaxes(0, 1).reshape(El, ep * C, D)
        out = reduce_tensor(_swiglu(buf, w_gate, w_up, w_down, dtype, "ecd,edf->ecf", "ecf,efd->ecd"))
        out = out.astype(dtype).reshape(El, ep, C, D).swapaxes(0, 1).reshape(ep * El, C, D)
        out = jax.lax.all_to_all(out, ep_axes, 0, 0, tiled=True)  # [E, C, D]: my slots' results
    else:
        out = reduce_tensor(_swiglu(buf, w_gate, w_up, w_down, dtype, "ecd,edf->ecf", "ecf,efd->ecd"))
    out = jnp.concatenate([out.reshape(E * C, D).astype(jnp.float32), jnp.zeros((1, D), jnp.float32)])
    y_A = out[slot_A] * jnp.where(keep_A, g_A, 0.0)[:, None]
    y_TD = jnp.sum(y_A.reshape(k, T, D), axis=0)
    return y_TD, jnp.sum(~keep_A).astype(jnp.float32)


def routed_experts(x_BLD: jax.Array, experts_BLk: jax.Array, gates_BLk: jax.Array, w_gate_EDF: jax.Array,
                   w_up_EDF: jax.Array, w_down_EFD: jax.Array, capacity_factor: float, dtype: Any,
                   part: Partitioning = Partitioning()) -> tuple[jax.Array, jax.Array]:
    """(y [B, L, D] fp32, dropped assignments: a scalar) for routed tokens (module doc)."""
    E = w_gate_EDF.shape[0]
    mesh = part.mesh
    if mesh is None or mesh.size == 1:
        B, L, D = x_BLD.shape
        y, dropped = _group(x_BLD.reshape(B * L, D), experts_BLk.reshape(B * L, -1), gates_BLk.reshape(B * L, -1),
                            w_gate_EDF, w_up_EDF, w_down_EFD, capacity_factor, dtype, E, (), 1, ())
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

    def local(x, e, g, wg, wu, wd):
        b, l, d = x.shape
        y, dropped = _group(x.reshape(b * l, d), e.reshape(b * l, -1), g.reshape(b * l, -1), wg, wu, wd,
                            capacity_factor, dtype, E, ep_axes, ep, tensor_axes)
        return y.reshape(b, l, d), dropped.reshape(1)

    dropped_spec = P(group_axes or None)
    # check_vma=False: under the pipeline's vmaps (spmd_axis_name stage, data) JAX 0.10 and 0.12 give
    # the batched body's values mismatched varying-axes types and refuse it (as for
    # Partitioning.per_shard). Without the check, psum's transpose relies on shard_map scaling the
    # cotangents of axes the out_specs leave out; tests/parallel compare every gradient leaf.
    y, dropped = jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, w_in, w_in, w_out), check_vma=False,
                               out_specs=(tok, dropped_spec))(x_BLD, experts_BLk, gates_BLk, w_gate_EDF,
                                                              w_up_EDF, w_down_EFD)
    return y, jnp.sum(dropped)
