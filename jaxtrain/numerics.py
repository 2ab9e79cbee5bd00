"""Whether a tree of arrays is finite: the one check behind the train step's non-finite skipping
(`all_finite`, traced inside the step: a device bool) and the checkpointer's refusal to save a
state with NaN/Inf in it (`all_finite_on_host`: a host bool, one sync).

Both reduce the same way: x * 0 is 0 for every finite x and NaN for NaN or +-Inf, and a sum of
zeros cannot overflow, so the total is finite exactly when every element is. One add-reduction per
leaf is ~2x faster on the CPU than all(isfinite(x)) (200 MB: 75 vs 142 ms), and the checkpointer's
check is on the save's blocking path. (max(abs(x)) is not an option: XLA's CPU max drops NaNs.)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def all_finite(tree: Any) -> jax.Array:
    """True (a scalar bool array) when every element of every leaf of `tree` is finite; traceable
    (the train step calls it on the gradients inside its jit). Integer leaves are always finite."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.bool_(True)
    return jnp.isfinite(sum(jnp.sum(x * 0, dtype=jnp.float32) for x in leaves))


_all_finite_jit = jax.jit(all_finite)


def all_finite_on_host(tree: Any) -> bool:
    """`all_finite` of the float leaves of `tree` as a Python bool: one jitted reduction over all
    device leaves, so one host sync; NumPy leaves are checked on the host; integer leaves (step,
    RNG key data) are not looked at."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    host = [x for x in leaves if not isinstance(x, jax.Array)]
    device = [x for x in leaves if isinstance(x, jax.Array)]
    if not all(np.isfinite(np.asarray(x)).all() for x in host):
        return False
    if not device:
        return True
    out = _all_finite_jit(device)
    # The result is replicated; addressable_data works when it spans several processes.
    return bool(np.asarray(out.addressable_data(0)))
