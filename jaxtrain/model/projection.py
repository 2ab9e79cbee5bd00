"""Mixed-precision projections whose weight gradients leave their matmul in fp32.

The layers keep fp32 parameters and run their matmuls in the compute dtype (bf16, fp16). Plain
autodiff of `einsum(x, w.astype(dtype))` computes the weight gradient as a compute-dtype matmul,
and under data/FSDP parallelism XLA reduces that compute-dtype result across devices (the
all-reduce or reduce-scatter sits right after the matmul, before the cast back to fp32): the sum
over all data shards is rounded to 16 bits and, in fp16, overflows 65504 long before any one
shard's part does. `project` keeps the forward pass and the input gradient as they were and
computes the weight gradient with fp32 output (`preferred_element_type`, fp32 accumulation as
tensor cores do anyway), so every cross-device reduction of a weight gradient sums fp32: what
Megatron calls fp32 gradient reduction (`accumulate_allreduce_grads_in_fp32`). The cost is the
reduction's bytes, 2x those of a 16-bit reduction (docs/numerics.md has the measurement).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp


def project(spec: str, x: jax.Array, w: jax.Array, dtype: Any) -> jax.Array:
    """`jnp.einsum(spec, x, w.astype(dtype))`, with the gradient w.r.t. `w` computed in fp32.

    Args:
      spec: a two-operand einsum spec "x_indices,w_indices->out_indices" (every index of `w`
        appears in x or in the output: a projection, not a trace).
      x: the activations, in the compute dtype.
      w: the parameter (fp32).
      dtype: the compute dtype of the matmul (its output dtype too).
    Returns:
      The projection in `dtype`. Its cotangent w.r.t. `x` is in x's dtype, w.r.t. `w` in w's dtype
      (fp32), computed by a matmul whose output is fp32 before any cross-device reduction.
    """
    dtype = jnp.dtype(dtype)
    if dtype == jnp.dtype(w.dtype) or jnp.dtype(w.dtype) != jnp.float32:
        return jnp.einsum(spec, x, w.astype(dtype))  # fp32 compute: nothing is rounded, plain autodiff
    return _project(spec, dtype, x, w)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _project(spec: str, dtype: Any, x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, w.astype(dtype))


def _forward(spec, dtype, x, w):
    w_c = w.astype(dtype)
    # The residuals are what autodiff of the plain einsum keeps: the input and the compute-dtype weight.
    return jnp.einsum(spec, x, w_c), (x, w_c)


def _backward(spec, dtype, residuals, g):
    x, w_c = residuals
    inputs, out = spec.replace(" ", "").split("->")
    x_idx, w_idx = inputs.split(",")
    g = g.astype(dtype)
    dx = jnp.einsum(f"{out},{w_idx}->{x_idx}", g, w_c).astype(x.dtype)
    dw = jnp.einsum(f"{x_idx},{out}->{w_idx}", x, g, preferred_element_type=jnp.float32)
    return dx, dw


_project.defvjp(_forward, _backward)
