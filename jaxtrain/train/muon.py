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

Under a mesh (`muon(cfg, mask, part)` with a `Partitioning`) each matrix leaf is resharded before
the iteration so that its matrix dimensions are whole on every device (`iteration_spec`): the mesh
axes that split them move onto the batch axes (layers, experts) where those divide (one all-to-all
there and back: each device orthogonalises whole matrices of its own layers), and the rest are
gathered once (each device then iterates redundantly; back is a slice). The iteration itself then
runs without collectives; without this XLA re-gathers a split matrix in every Newton-Schulz step.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.config import Config, ConfigError
from jaxtrain.model.llama import model_logical_axes
from jaxtrain.parallel.sharding import Partitioning, fitted_spec
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
    return {key: matrix_dims(names) for key, names in _model_names(cfg).items()}


def _model_names(cfg: Config) -> dict:
    """{param path (tuple of keys): logical axis names} for the model `cfg` builds (shapes only)."""
    flat = jax.tree_util.tree_flatten_with_path(model_logical_axes(cfg.model), is_leaf=lambda n: isinstance(n, tuple))[0]
    return {tuple(str(getattr(k, "key", k)) for k in path): tuple(n) for path, n in flat}


def _entry_axes(entry: Any) -> tuple[str, ...]:
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def iteration_spec(spec: P, shape: tuple[int, ...], dims: MatrixDims, mesh_sizes: dict[str, int]) -> Optional[P]:
    """Where the Newton-Schulz iteration of a matrix stack runs: the PartitionSpec, from the
    parameter's `spec`, under which every matrix is whole on each device; None when `spec`
    already splits no matrix dimension (nothing to move).

    Rule: each mesh axis (of size > 1) that splits a matrix dimension moves onto a batch axis
    (layers, experts) whose size it divides (with the axes already there), choosing the placement
    that distributes the most devices; an axis that divides no batch axis is dropped (the matrix
    is gathered over it once and each of its devices iterates redundantly). A moved axis costs one
    all-to-all of the shard each way; a dropped one an all-gather before and a slice after."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    split = [a for i in dims.rows + dims.cols for a in _entry_axes(entries[i]) if mesh_sizes.get(a, 1) > 1]
    if not split:
        return None
    best, best_ways = [None] * len(split), 1
    for choice in itertools.product([None, *dims.batch], repeat=len(split)):
        placed = {b: math.prod(mesh_sizes[a] for a, c in zip(split, choice) if c == b) for b in dims.batch}
        ok = all(shape[b] % (math.prod(mesh_sizes.get(a, 1) for a in _entry_axes(entries[b])) * placed[b]) == 0
                 for b in dims.batch)
        ways = math.prod(placed.values()) if placed else 1
        if ok and ways > best_ways:  # strictly more: of equal ones the first in this order wins
            best, best_ways = list(choice), ways
    out = [None if i in dims.rows + dims.cols else entries[i] for i in range(len(shape))]
    for b in dims.batch:
        axes = _entry_axes(entries[b]) + tuple(a for a, c in zip(split, best) if c == b)
        out[b] = None if not axes else axes[0] if len(axes) == 1 else axes
    return P(*out)


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
                       ns_coeffs: tuple[float, float, float], b1: float, b2: float, eps: float,
                       shardings_of: Any = None) -> optax.GradientTransformationExtraArgs:
    """Muon's direction for the matrices, Adam's for the rest; the state kept on `skip=True`.

    `dims_of(path, leaf) -> MatrixDims | None` says which leaf is a matrix. `shardings_of(path,
    leaf, dims) -> (iteration sharding, parameter sharding) | None`, when given, places each
    matrix's iteration (`iteration_spec`) and its update back like the parameter. As in `guarded_adam`,
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
            placed = shardings_of(path, g, d) if shardings_of is not None else None
            if placed is not None:  # whole matrices per device before the loop, the parameter's layout after
                # Pinned in the parameter's layout first: else XLA moves the constraint back onto
                # m_hat's inputs and reshards both the momentum and the gradient (twice the bytes).
                m_hat = jax.lax.with_sharding_constraint(m_hat, placed[1])
                m_hat = jax.lax.with_sharding_constraint(m_hat, placed[0])
            o = orthogonalise(m_hat, d, ns_coeffs, ns_steps)
            if placed is not None:  # the same on the way back: else the last step's operands move
                o = jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(o, placed[0]), placed[1])
            return o * _rms_scale(g, d), m, v

        treedef = jax.tree_util.tree_structure(updates)
        triples = treedef.flatten_up_to(jax.tree_util.tree_map_with_path(leaf, updates, state.mu, state.nu))
        out, mu, nu = (treedef.unflatten([t[i] for t in triples]) for i in range(3))
        return out, MuonState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformationExtraArgs(init, update)


def muon(cfg: Config, decay_mask: Any, part: Optional[Partitioning] = None) -> optax.GradientTransformationExtraArgs:
    """Muon on the hidden matrices, AdamW (optim.b1, b2, eps) on the rest, then decoupled weight
    decay on `decay_mask`'s parameters and the learning-rate schedule (one ScaleByScheduleState).
    `update(..., skip=True)` keeps the whole state bitwise. Clipping is make_optimizer's.

    `part`: the mesh and rules the parameters are sharded by (`build_layout`'s); with a mesh, each
    model matrix is resharded for its iteration (`iteration_spec`). None (or no mesh): no constraint.

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

    shardings_of = None
    if part is not None and part.mesh is not None and part.mesh.size > 1:
        names_of, mesh = _model_names(cfg), part.mesh
        sizes = dict(mesh.shape)

        def shardings_of(path, x, d):
            names = names_of.get(tuple(str(getattr(k, "key", k)) for k in path))
            if names is None or len(names) != x.ndim:  # not the model's tree: leave it to XLA
                return None
            spec = fitted_spec(names, x.shape, mesh, part.rules)
            target = iteration_spec(spec, x.shape, d, sizes)
            return None if target is None else (NamedSharding(mesh, target), NamedSharding(mesh, spec))

    direction = scale_by_muon_adam(dims_of, momentum=o.muon_momentum, nesterov=o.muon_nesterov,
                                   ns_steps=o.muon_ns_steps, ns_coeffs=(o.muon_ns_a, o.muon_ns_b, o.muon_ns_c),
                                   b1=o.b1, b2=o.b2, eps=o.eps, shardings_of=shardings_of)
    return optax.chain(direction, optax.add_decayed_weights(o.weight_decay, decay_mask),
                       kept_on_skip(optax.scale_by_learning_rate(learning_rate_schedule(cfg))))

