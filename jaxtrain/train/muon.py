"""Muon (optim.name=muon): momentum orthogonalised by a quintic Newton-Schulz iteration on the hidden
weight matrices, AdamW on every other parameter (docs/optim.md "Muon").

Which parameters are matrices is read from the model's logical axis names (`matrix_dims`):
the stacked-layer axes (`layers`, `dense_layers`, `mtp_layers`) and `experts` are batch
dimensions, each [d_in, d_out] slice orthogonalised on its own; `heads`/`kv_heads` with the
`head_dim` after it form one matrix dimension (wq [D, N, H] is D x N*H, wo [N, H, D] is N*H x D).
A parameter with two matrix dimensions left, other than the embedding and the output head (a
`vocab` axis), is a Muon matrix; the rest (embedding, head, norms, biases, sinks) take AdamW,
bitwise optim.name=adamw's arithmetic.

Scale (Moonlight, "Muon is Scalable for LLM Training"): the orthogonalised update of an m x n
matrix is multiplied by 0.2 * sqrt(max(m, n)), which gives it about AdamW's update RMS, so
optim.learning_rate and optim.weight_decay mean what they mean for AdamW (optax.contrib.muon's
`consistent_rms=0.2`; MaxText's `adjust_lr_fn="match_rms_adamw"`). Weight decay is decoupled,
on `decay_mask`'s parameters, multiplied by the scheduled rate as AdamW's is.

The state: `MuonState(count, mu, nu)` (mu: Muon momentum of the matrices and Adam's first moment
of the rest; nu: Adam's second moment, kept zero for matrices), then optax's weight-decay state
and the schedule's ScaleByScheduleState (its count is `applied_learning_rate`'s). Every state
leaf is param-shaped or a scalar, so `optax.tree_map_params` shards it like the parameters.
`update(..., skip=True)` keeps the whole state bitwise.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from jaxtrain.config import Config, ConfigError
from jaxtrain.model.llama import model_logical_axes
from jaxtrain.train.schedules import learning_rate_schedule
from jaxtrain.train.skip_contract import kept_on_skip

# Logical axes that index stacked copies of a matrix: orthogonalised one slice at a time.
BATCH_AXES = ("layers", "dense_layers", "mtp_layers", "experts")
# Heads axes merge with the head_dim that follows them into one matrix dimension.
HEAD_AXES = ("heads", "kv_heads")
RMS_SCALE = 0.2  # Moonlight's: the update RMS of AdamW (docs/optim.md "Muon")


class MatrixDims(NamedTuple):
    """How a parameter is a stack of matrices: its batch axes, then its input (rows) and output
    (columns) axes, as axis indices of the parameter."""
    batch: tuple[int, ...]
    rows: tuple[int, ...]
    cols: tuple[int, ...]


def matrix_dims(names: tuple[Optional[str], ...]) -> Optional[MatrixDims]:
    """The matrix layout of a parameter with logical axes `names`, or None when it is not a hidden
    matrix (AdamW's). Batch axes: BATCH_AXES. The remaining axes, with heads/kv_heads and the
    head_dim after it grouped, must form exactly two groups: rows then columns."""
    if "vocab" in names:  # the embedding [V, D] and the output head [D, V]
        return None
    batch = tuple(i for i, n in enumerate(names) if n in BATCH_AXES)
    groups: list[list[int]] = []
    rest = [i for i in range(len(names)) if i not in batch]
    for i in rest:
        if groups and names[i] == "head_dim" and names[groups[-1][-1]] in HEAD_AXES:
            groups[-1].append(i)
        else:
            groups.append([i])
    if len(groups) != 2:
        return None
    return MatrixDims(batch, tuple(groups[0]), tuple(groups[1]))


def _fallback_dims(path: tuple, x: Any) -> Optional[MatrixDims]:
    """A parameter outside the model's tree (tests, tools): 2-D arrays not named embed/head are matrices."""
    last = str(getattr(path[-1], "key", path[-1])) if path else ""
    if getattr(x, "ndim", 0) == 2 and last not in ("embed", "head"):
        return MatrixDims((), (0,), (1,))
    return None


def model_matrix_dims(cfg: Config) -> dict:
    """{param path (tuple of keys): MatrixDims or None} for the model `cfg` builds (shapes only)."""
    flat = jax.tree_util.tree_flatten_with_path(model_logical_axes(cfg.model), is_leaf=lambda n: isinstance(n, tuple))[0]
    return {tuple(str(getattr(k, "key", k)) for k in path): matrix_dims(n) for path, n in flat}


def orthogonalise(x: jax.Array, dims: MatrixDims, coeffs: tuple[float, float, float], steps: int,
                  eps: float = 1e-8) -> jax.Array:
    """Each matrix of the stack `x` (layout `dims`) -> its quintic Newton-Schulz orthogonalisation
    (optax.contrib.muon's: Frobenius-normalised, the Gram matrix on the shorter side), in x's layout.

    Batch axes stay array axes (a batched matmul, never one flattened matrix): under a sharded
    mesh they keep their sharding, and only the matrix dimensions' shards meet in collectives."""
    order = dims.batch + dims.rows + dims.cols
    moved = jnp.transpose(x, order)  # an identity for every jaxtrain parameter (batch axes lead)
    batch_shape = moved.shape[:len(dims.batch)]
    m = math.prod(x.shape[i] for i in dims.rows)
    n = math.prod(x.shape[i] for i in dims.cols)
    X = moved.reshape(*batch_shape, m, n).astype(jnp.float32)
    tall = m > n
    if tall:  # X X^T on the shorter side; f(X^T) = f(X)^T
        X = jnp.swapaxes(X, -1, -2)
    X = X / (jnp.linalg.norm(X, axis=(-2, -1), keepdims=True) + eps)
    a, b, c = coeffs
    for _ in range(steps):
        A = X @ jnp.swapaxes(X, -1, -2)
        X = a * X + (b * A + c * (A @ A)) @ X
    if tall:
        X = jnp.swapaxes(X, -1, -2)
    out = X.reshape(moved.shape).astype(x.dtype)
    return jnp.transpose(out, tuple(sorted(range(x.ndim), key=lambda i: order[i])))


def _rms_scale(x: jax.Array, dims: MatrixDims) -> float:
    m = math.prod(x.shape[i] for i in dims.rows)
    n = math.prod(x.shape[i] for i in dims.cols)
    return RMS_SCALE * math.sqrt(max(m, n))


class MuonState(NamedTuple):
    """count: updates applied; mu: Muon momentum (matrices) / Adam first moment (the rest); nu: Adam
    second moment (the rest; zeros, never updated, for matrices)."""
    count: jax.Array
    mu: Any
    nu: Any


def scale_by_muon_adam(dims_of: Any, *, momentum: float, nesterov: bool, ns_steps: int,
                       ns_coeffs: tuple[float, float, float], b1: float, b2: float, eps: float
                       ) -> optax.GradientTransformationExtraArgs:
    """Muon's direction for the matrices, Adam's for the rest; the state kept on `skip=True`.

    `dims_of(path, leaf) -> MatrixDims | None` says which leaf is a matrix. As in `guarded_adam`,
    the moments are selected first and the update computed from the selected moments, so each old
    moment has one reader (no copies of the large buffers)."""
    def init(params):
        mu = jax.tree_util.tree_map(jnp.zeros_like, params)
        # Param-shaped for every leaf (a matrix's stays zero): state shardings come from
        # optax.tree_map_params (param-shaped leaves) and Orbax refuses zero-size arrays.
        nu = jax.tree_util.tree_map(jnp.zeros_like, params)
        return MuonState(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

    def update(updates, state, params=None, *, skip: jax.Array | bool = False, **extra):
        del params, extra
        keep = lambda new, old: jnp.where(skip, old, new)
        count = keep(optax.safe_increment(state.count), state.count)
        bc = optax.tree.bias_correction  # optax's arithmetic, so the Adam leaves equal adamw's bitwise

        def leaf(path, g, m, v):
            d = dims_of(path, g)
            if d is None:  # optax.scale_by_adam, as guarded_adam computes it
                m = keep(optax.tree.update_moment(g, m, b1, 1), m)
                v = keep(optax.tree.update_moment_per_elem_norm(g, v, b2, 2), v)
                return bc(m, b1, count) / (jnp.sqrt(bc(v, b2, count) + 0.0) + eps), m, v
            m = keep(optax.tree.update_moment(g, m, momentum, 1), m)
            if nesterov:  # optax.contrib.scale_by_muon's Nesterov form
                m_hat = (momentum * bc(m, momentum, optax.safe_increment(count))
                         + (1 - momentum) * bc(g, momentum, count))
            else:
                m_hat = bc(m, momentum, count)
            return orthogonalise(m_hat, d, ns_coeffs, ns_steps) * _rms_scale(g, d), m, v

        treedef = jax.tree_util.tree_structure(updates)
        triples = treedef.flatten_up_to(jax.tree_util.tree_map_with_path(leaf, updates, state.mu, state.nu))
        out, mu, nu = (treedef.unflatten([t[i] for t in triples]) for i in range(3))
        return out, MuonState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformationExtraArgs(init, update)


def muon(cfg: Config, decay_mask: Any) -> optax.GradientTransformationExtraArgs:
    """Muon on the hidden matrices, AdamW (optim.b1, b2, eps) on the rest, then decoupled weight
    decay on `decay_mask`'s parameters and the learning-rate schedule (one ScaleByScheduleState).
    `update(..., skip=True)` keeps the whole state bitwise. Clipping is make_optimizer's.

    Raises:
      ConfigError: optim.qk_clip > 0 (MuonClip is not built).
    """

    o = cfg.optim
    if o.qk_clip > 0:
        raise ConfigError("config key 'optim.qk_clip' (MuonClip) is not built: only 0 (off) is accepted")
    known = model_matrix_dims(cfg)

    def dims_of(path, x) -> Optional[MatrixDims]:
        key = tuple(str(getattr(k, "key", k)) for k in path)
        if key not in known:
            return _fallback_dims(path, x)
        d = known[key]
        return d if d is not None and len(d.batch + d.rows + d.cols) == x.ndim else None

    direction = scale_by_muon_adam(dims_of, momentum=o.muon_momentum, nesterov=o.muon_nesterov,
                                   ns_steps=o.muon_ns_steps, ns_coeffs=(o.muon_ns_a, o.muon_ns_b, o.muon_ns_c),
                                   b1=o.b1, b2=o.b2, eps=o.eps)
    return optax.chain(direction, optax.add_decayed_weights(o.weight_decay, decay_mask),
                       kept_on_skip(optax.scale_by_learning_rate(learning_rate_schedule(cfg))))

