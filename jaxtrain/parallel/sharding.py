"""Logical axis names -> mesh axes, through the one rules table in `mesh.rules`.

Model code names logical axes (`embed`, `mlp`, `heads`, `kv_heads`, `vocab`, `layers`, `batch`,
`length`, ...) and never mesh axes. Everything here turns those names into `PartitionSpec`s:
parameters (with a divisibility check per parameter, never a silent fallback to replication, except
for kv heads fewer than their tensor degree: `REPLICATED_WHEN_SMALL`),
activations (`Partitioning.constrain`, which the model and the loss receive as an argument) and
input batches (`global_batch`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtrain.config import ConfigError

Rules = dict[str, Any]  # logical name -> mesh axis | [mesh axes] | None

def logical_to_spec(names: tuple[str | None, ...], rules: Rules) -> P:
    """PartitionSpec for a tensor whose dimensions carry these logical names."""
    spec, used = [], set()
    for name in names:
        target = rules.get(name) if name is not None else None
        axes = [a for a in (target if isinstance(target, list) else [target]) if a is not None]
        axes = [a for a in axes if a not in used]  # a mesh axis may shard only one dimension
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return P(*spec)


def _axis_size(mesh: Mesh, entry: Any) -> int:
    if entry is None:
        return 1
    entries = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[a] for a in entries)


# The one logical axis replicated, rather than refused, when its size does not divide its mesh
# axes: kv heads under a tensor degree above the kv head count (Llama-3-70B's 8 kv heads on 16-way
# tensor parallelism), as MaxText does. Each device keeps every kv head's weights; attention
# repeats the heads it needs per shard (jaxtrain.model.attention.attend).
REPLICATED_WHEN_SMALL = ("kv_heads",)


def fitted_spec(names: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh, rules: Rules) -> P:
    """`logical_to_spec`, with a REPLICATED_WHEN_SMALL dimension that its mesh axes do not divide
    replicated instead of split unevenly."""
    spec = logical_to_spec(names, rules)
    return P(*(None if name in REPLICATED_WHEN_SMALL and size % _axis_size(mesh, entry) else entry
               for name, size, entry in zip(names, shape, spec)))


def param_shardings(logical: Any, shapes: Any, mesh: Mesh, rules: Rules) -> Any:
    """NamedShardings for a parameter tree.

    Args:
      logical: tree of tuples of logical names (one per dimension), same structure as `shapes`.
      shapes: tree of arrays or ShapeDtypeStructs.
    Raises:
      ConfigError: a dimension not divisible by the mesh axes it maps to, naming the parameter.
    """
    def one(path, names, leaf):
        spec = fitted_spec(names, leaf.shape, mesh, rules)
        for dim, (size, entry) in enumerate(zip(leaf.shape, spec)):
            ways = _axis_size(mesh, entry)
            if size % ways:
                raise ConfigError(
                    f"parameter '{jax.tree_util.keystr(path)}' with shape {tuple(leaf.shape)}: dimension {dim} "
                    f"('{names[dim]}', size {size}) is not divisible by mesh axes {entry} of size {ways}; "
                    "change the mesh sizes or mesh.rules")
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, logical, shapes, is_leaf=lambda x: isinstance(x, tuple))


@dataclasses.dataclass(frozen=True)
class Partitioning:
    """Where a traced function's tensors live: the mesh, the rules table, the pipeline schedule.

    The model, the loss and the pipeline receive one as an argument; nothing is read from ambient
    state, so the same call traces the same program wherever it runs. The train and eval steps
    build it once from the config (`jaxtrain.train.step`); the default, `Partitioning()`, places
    nothing: constraints are no-ops and kernels see whole arrays (a single device, a notebook).
    """

    mesh: Mesh | None = None
    rules: Rules = dataclasses.field(default_factory=dict)
    schedule: Any = None  # jaxtrain.parallel.pipeline.Schedule when mesh.stage > 1, else None
    context: Any = None  # jaxtrain.parallel.context.ContextSchedule when mesh.context > 1, else None

    def spec(self, names: tuple[str | None, ...]) -> P:
        """PartitionSpec for a tensor whose dimensions carry these logical names."""
        return logical_to_spec(names, self.rules)

    def ways(self, name: str) -> int:
        """How many ways the rules split the logical axis `name` (1 without a mesh)."""
        return 1 if self.mesh is None else _axis_size(self.mesh, self.spec((name,))[0])

    def constrain(self, x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
        """Sharding constraint on an activation by logical names; a no-op without a mesh."""
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, fitted_spec(names, x.shape, self.mesh,
                                                                                      self.rules)))

    def without(self, taken: tuple[str, ...]) -> "Partitioning":
        """The partitioning for code inside vmapped dimensions that own the `taken` mesh axes (one
        pipeline stage, or one replica of it): no logical name may use those axes there, `layers`
        maps to nothing, and no schedule applies (the stage runs its layers plainly)."""
        inner = {name: ([a for a in _targets(t) if a not in taken] or None) for name, t in self.rules.items()}
        inner["layers"] = None
        return Partitioning(self.mesh, inner, None)

    def per_shard(self, fn: Callable, in_names: tuple, out_names: tuple[str | None, ...],
                  whole: tuple[str, ...] = ()) -> Callable:
        """Run `fn` on each device's shard (shard_map), with specs from logical names.

        For kernels XLA cannot partition (a `pallas_call` or a Triton custom call): every logical
        dimension they see must be one they treat independently (batch, heads). Dimensions named in
        `whole` (for attention: length, head_dim) must not be split, or each shard would silently
        compute something else (attention within its chunk of the sequence only): that raises
        ConfigError. `fn` itself without a mesh or on a single device. `in_names` holds one tuple
        per argument (None for an argument that is None).
        """
        mesh = self.mesh
        if mesh is None or mesh.size == 1:
            return fn
        split = [n for n in whole if self.ways(n) > 1]
        if split:
            raise ConfigError(f"mesh.rules shards {', '.join(split)} over mesh axes, but a fused kernel must see "
                              f"whole {', '.join(split)} on each device; map them to null or use model.attention=xla")

        def wrapped(*args):
            present = [i for i, a in enumerate(args) if a is not None]

            def inner(*shards):
                full = list(args)
                for i, x in zip(present, shards):
                    full[i] = x
                return fn(*full)

            in_specs = tuple(self.spec(in_names[i]) for i in present)
            # check_vma=False: under the pipeline's vmaps (spmd_axis_name stage, data) JAX 0.10 and 0.12
            # type the transposed body's cotangents with the vmapped axes that its primal types lack,
            # and refuse the gradient. The body is a kernel without collectives: the check guards nothing.
            return jax.shard_map(inner, mesh=mesh, in_specs=in_specs, check_vma=False,
                                 out_specs=self.spec(out_names))(*[args[i] for i in present])
        return wrapped


def _targets(target: Any) -> list[str]:
    """The mesh axes of one rules-table entry (a name, a list of names, or None)."""
    return [a for a in (target if isinstance(target, list) else [target]) if a is not None]


# Attention kernels see [batch, length, heads, head_dim] blocks: batch and heads are independent,
# the rest must be whole. Kv heads are split like the query heads inside the kernel call, repeated
# first where there are fewer of them than shards (jaxtrain.model.attention.attend).
KERNEL_WHOLE_AXES = ("length", "head_dim")


def check_attention_layout(rules: Rules, mesh_sizes: dict[str, int], implementation: str) -> None:
    """Refuse (ConfigError) a rules table under which a fused attention kernel would be wrong.

    Args:
      rules: the logical -> mesh axis table.
      mesh_sizes: resolved mesh axis sizes.
      implementation: the resolved attention implementation ('xla' is partitioned by XLA and
        accepts any table).
    """
    if implementation == "xla":
        return

    def axes(name: str) -> list[str]:
        target = rules.get(name)
        found = [a for a in (target if isinstance(target, list) else [target]) if a is not None and mesh_sizes.get(a, 1) > 1]
        # A length split over `context` is the context-parallel attention's (jaxtrain.parallel.context):
        # it runs the kernel on whole blocks and combines them.
        return [a for a in found if not (name == "length" and a == "context")]

    for name in KERNEL_WHOLE_AXES:
        if axes(name):
            raise ConfigError(
                f"mesh.rules maps '{name}' to {axes(name)}, but model.attention={implementation} runs a fused kernel "
                f"per shard that must see the whole {name}: each shard would attend only within its chunk. Map "
                f"'{name}' to null, or use model.attention=xla")


def batch_sharding(mesh: Mesh, rules: Rules) -> NamedSharding:
    """Sharding of [batch, length] inputs."""
    return NamedSharding(mesh, logical_to_spec(("batch", "length"), rules))


def process_rows(mesh: Mesh, rules: Rules, batch_size: int, process_index: int) -> np.ndarray:
    """The rows of each global batch that process `process_index` must load, sorted.

    The union of the batch shards its devices hold under `batch_sharding`. Usually a contiguous
    block of batch_size / processes rows, disjoint from the other processes'. Where the mesh runs a
    non-batch axis across hosts (a tensor ring following a TPU slice's torus, or a mesh whose
    batch is not split over every process) two processes hold the same shard: both load its rows,
    and each loads more than batch_size / processes. Works on any device objects with
    `process_index` (tests pass fake multi-host topologies).
    """
    spec = batch_sharding(mesh, rules).spec
    rows_spec = P(spec[0] if len(spec) else None)
    ways = _axis_size(mesh, rows_spec[0])
    if batch_size % ways:
        raise ConfigError(f"data.global_batch_size={batch_size} is not divisible by the {ways}-way batch sharding")
    size = batch_size // ways
    # Each device's batch-shard number: its index along the batch's mesh axes, major to minor.
    axes = [a for a in (rows_spec[0] if isinstance(rows_spec[0], tuple) else (rows_spec[0],)) if a is not None]
    held = set()
    for index in np.ndindex(mesh.devices.shape):
        if mesh.devices[index].process_index != process_index:
            continue
        shard = 0
        for a in axes:
            shard = shard * mesh.shape[a] + index[mesh.axis_names.index(a)]
        held.add(shard)
    return np.array([r for shard in sorted(held) for r in range(shard * size, (shard + 1) * size)], dtype=np.int64)


def global_batch(local: dict[str, np.ndarray], mesh: Mesh, rules: Rules,
                 batch_size: int | None = None) -> dict[str, jax.Array]:
    """Assemble this process's rows (`process_rows`, in that order) into global arrays.

    The same call on every process. `batch_size`: the global batch; needed whenever processes
    share batch shards (`process_rows`), where JAX cannot infer it from the local rows.
    """
    sharding = batch_sharding(mesh, rules)
    return {k: jax.make_array_from_process_local_data(
        sharding, v, None if batch_size is None or jax.process_count() == 1 else (batch_size, *v.shape[1:]))
        for k, v in local.items()}


def bytes_per_device(tree: Any) -> dict[int, int]:
    """Bytes each device holds for a tree of sharded arrays (for tests and `inspect`)."""
    out: dict[int, int] = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out
