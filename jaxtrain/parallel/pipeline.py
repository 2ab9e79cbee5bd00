"""Pipeline parallelism: the layer stack runs as stages over the `stage` mesh axis.

With mesh.stage = S > 1 the model's stacked layers run as S stages. Each step's batch is cut into
M = pipeline.microbatches x train.grad_accum microbatches (accumulation folded into one pass,
`pipeline.fold_grad_accum`, so the bubble is paid once per step; unfolded, each accumulation
microbatch is its own pass of pipeline.microbatches), and one `lax.scan` of R·M + S − 1
iterations moves them through the stages: in every iteration all stages
run at once (a `vmap` over the stage dimension, which is sharded over `stage`), then the
activations shift one stage on (`jnp.roll` along the stage-sharded dimension, which XLA lowers to
a collective-permute). Positions and segment ids travel with their microbatch. The backward pass
is autodiff through the scan; every iteration is rematerialised with model.remat's policy (named
checkpoints, which survive the vmap), so per iteration only the stages' inputs and what the
policy saves are kept, and activation memory stays bounded by (R·M + S − 1) microbatch inputs.
The layers inside an iteration are not checkpointed again (the model's `stack` skips its
per-layer checkpoint), or each layer's forward pass would run three times.

Schedules (S stages, M microbatches, R = pipeline.repeats):
- GPipe (R = 1): stage s runs layers [s·L/S, (s+1)·L/S). Bubble (S−1)/(M+S−1).
- Circular (R > 1, MaxText's "circular pipeline"): the layers form S·R groups; stage s runs the
  groups s, S+s, 2S+s, ... and each microbatch goes round the ring of stages R times. An
  iteration is 1/R of a GPipe stage's work, so the bubble falls to (S−1)/(R·M+S−1). A
  microbatch leaving the last stage waits on stage 0 until its next round starts, M iterations
  after its previous one; that needs M >= S.

Layout-free parameters. The train state keeps every stacked weight as [L, ...] in execution
order whatever S and R are, so a checkpoint restores under any schedule, or none. The rules table
maps `layers -> stage`, so device s stores the contiguous block of layers [s·L/S, (s+1)·L/S):
- GPipe: that block is exactly stage s's work; the reshape to [S, L/S, ...] is local and no
  weight moves between devices.
- Circular: stage s needs the non-adjacent groups s, S+s, .... A sharded dimension gives each
  device one contiguous block, so no sharding of an [L, ...] array can hold those groups on one
  device. Each step therefore permutes the groups into place: an all-to-all over `stage` of
  about (S−1)/S of the stacked weights, and the same for their gradients on the way back
  (`bench/bench_pipeline.py` reports the bytes). The alternative that moves nothing per step
  keeps the permuted order in the state; then checkpoints, `restore_params_only`, HF export and
  notebook inference would all depend on S and R and each would have to translate. We chose the
  self-contained cost: GPipe moves no weights, circular pays one weight all-to-all per model call
  for its smaller bubble.

The microbatches' inputs and outputs (MaxText's `state_io`). Stage 0 reads one microbatch per
iteration and the last stage writes one, but no stage device keeps all M of them: they lie in a
ring of S·ceil(M/S) positions sharded over `stage`, ceil(M/S) per device, that turns one position
per iteration (one microbatch per device moves one stage down, a collective-permute like the
activations' shift), so each microbatch reaches stage 0 when its round starts. The last stage
writes an item's output where it reaches stage 0 in time for its next round (circular), or where
it stays until the loop ends (its last round). Before, every stage device held all M
microbatches of its data shard (only stage 0's copy was read), plus the gathered inputs and
outputs: S times the memory, see docs/memory.md. Positions and segment ids (no model dimension)
are still kept whole on every stage device. Where a circular schedule's outputs must go to a
middle stage (for some S < M < S²; M = S and M >= S² write on stage 0 or the last stage), that
costs one more collective-permute of one microbatch per device and iteration (`_ring_positions`).

Outside the pipeline (embedding, final norm, head, loss) the batch is sharded over `stage` too
(default rules: batch -> [data, stage, fsdp]), so no stage device repeats that work; inside,
each microbatch is split only over the batch axes other than `stage`.

FSDP inside a stage regathers the weights in every iteration, unless `pipeline.gather_fsdp_once`
gathers them once per pass before the loop (the fsdp axes then act as replica axes, below).

Data parallelism inside a stage: every iteration adds to the stage's weight gradients. Left to
itself XLA all-reduces each iteration's share over `data`, R·M + S − 1 times per step. So each
stage runs one copy of its weights per `data` index (a second vmap, over the batch axes that
shard no weight; the copies are a broadcast of what each device holds anyway): the gradients
add up per copy inside the loop and are summed over `data` once, after it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.config import Config, ModelConfig
from jaxtrain.parallel.sharding import Partitioning, Rules, _targets, logical_to_spec

# stack(x_BLD, positions_BL, segment_ids_BL, layers, part) runs `layers` (stacked on a leading
# axis) in order, constrained by `part` (the partitioning inside one stage). -> x_BLD, or with
# `run(..., with_stats=True)` (x_BLD, statistics stacked per layer, sums over the tokens).
StackFn = Callable[[jax.Array, jax.Array, "jax.Array | None", Any, Partitioning], Any]

_X = ("layers", "batch", "length", "act_embed")  # a per-stage activation [S, B, L, D]
_IDS = ("layers", "batch", "length")  # per-stage positions / segment ids [S, B, L]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How the layer stack runs as pipeline stages."""

    stages: int  # S: size of the mesh axes that `layers` maps to
    microbatches: int  # microbatches per pipeline pass: M, times the folded accumulation microbatches
    repeats: int  # R: layer groups per stage (1 = GPipe, > 1 = circular)
    remat_iterations: bool = True  # rematerialise every scan iteration (`pipeline.remat_iterations`)
    folded_accum: int = 1  # train.grad_accum microbatches run as one pass (`pipeline.fold_grad_accum`)
    gather_fsdp_once: bool = False  # all-gather the stages' FSDP weights once per pass (`pipeline.gather_fsdp_once`)

    @property
    def name(self) -> str:
        return "gpipe" if self.repeats == 1 else "circular"

    @property
    def iterations(self) -> int:
        """Scan iterations per pipeline pass: R·M + S − 1 (M counting the folded accumulation)."""
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """Theoretical idle fraction of every stage: (S − 1) / (R·M + S − 1)."""
        return (self.stages - 1) / self.iterations


def stage_axes(rules: Rules) -> tuple[str, ...]:
    """The mesh axes that the stage dimension (logical `layers`) is sharded over."""
    return tuple(_targets(rules.get("layers")))


def schedule_for(cfg: Config, mesh_sizes: Mapping[str, int]) -> Schedule | None:
    """The pipeline schedule of this config on a mesh of these axis sizes; None for one stage.

    Args:
      cfg: a validated config (phase 1 and 2 checked num_layers, microbatches and batch sizes).
      mesh_sizes: resolved mesh axis sizes, e.g. `dict(mesh.shape)` or what
        `mesh.validate_against_devices` returns.
    """
    stages = math.prod(mesh_sizes[a] for a in stage_axes(cfg.mesh.rules))
    if stages == 1:
        return None
    folded = cfg.train.grad_accum if cfg.pipeline.fold_grad_accum else 1
    return Schedule(stages=stages, microbatches=cfg.pipeline.microbatches * folded, repeats=cfg.pipeline.repeats,
                    remat_iterations=cfg.pipeline.remat_iterations, folded_accum=folded,
                    gather_fsdp_once=cfg.pipeline.gather_fsdp_once)


def accumulation_steps(grad_accum: int, schedule: Schedule | None) -> int:
    """How many times the train step calls the model per step (its `lax.scan` over accumulation
    microbatches): `train.grad_accum`, or 1 where the schedule folds them into one pipeline pass.

    Folding (`pipeline.fold_grad_accum`, the default) pays the fill/drain bubble once per step:
    with S=4, M=4 and grad_accum=8, (S−1)/(32+S−1) = 8.6% instead of (S−1)/(4+S−1) = 43% on every call.
    """
    return grad_accum if schedule is None else grad_accum // schedule.folded_accum


def pipelined_layers(m: ModelConfig) -> int:
    """Layers the stages split: all, or a mixture of experts' after its first dense layers (those run
    before the pipeline, batch-parallel over the stage devices too)."""
    return m.num_layers - (m.first_dense_layers if m.num_experts > 0 else 0)


def describe(cfg: Config, mesh_sizes: Mapping[str, int]) -> dict:
    """The pipeline schedule as plain data, for the `start` event and `jaxtrain inspect`.

    Returns:
      {"schedule": "none" | "gpipe" | "circular", "stages": S, "microbatches": M, "repeats": R,
       "layers_per_stage": L/S, "iterations": R·M+S−1, "bubble": (S−1)/(R·M+S−1),
       "passes_per_step": P}: M counts the microbatches of one pipeline pass (pipeline.microbatches
       times the folded train.grad_accum), and a step runs P passes (grad_accum unfolded, else 1).
    """
    s = schedule_for(cfg, mesh_sizes)
    if s is None:
        return {"schedule": "none", "stages": 1, "microbatches": 1, "repeats": 1,
                "layers_per_stage": cfg.model.num_layers, "iterations": 1, "bubble": 0.0,
                "passes_per_step": cfg.train.grad_accum}
    return {"schedule": s.name, "stages": s.stages, "microbatches": s.microbatches, "repeats": s.repeats,
            "layers_per_stage": pipelined_layers(cfg.model) // s.stages, "iterations": s.iterations,
            "bubble": round(s.bubble, 4), "passes_per_step": accumulation_steps(cfg.train.grad_accum, s)}


def _replica_axes(rules: Rules, taken: tuple[str, ...], layer_names: Any) -> tuple[str, ...]:
    """The outermost batch axes (besides the stage axes) that shard no stacked weight: `data` by default.

    A stage runs one copy of its weights per index of these axes (a second vmap), so the weight
    gradients of all R·M + S − 1 iterations add up per copy, inside the loop, and the copies are
    summed once after it. Without the copies XLA all-reduces every iteration's weight gradients
    over these axes: R·M + S − 1 times the data-parallel gradient traffic.
    """
    used: set[str] = set()
    for names in jax.tree_util.tree_leaves(layer_names, is_leaf=lambda x: isinstance(x, tuple)):
        for entry in logical_to_spec(names, rules):
            used.update(entry if isinstance(entry, tuple) else [entry] if entry else [])
    replicas = []
    for axis in _targets(rules.get("batch")):
        if axis in taken:
            continue
        if axis in used:
            break
        replicas.append(axis)
    return tuple(replicas)


def _gathered_once(part: Partitioning, taken: tuple[str, ...], layer_names: Any) -> Partitioning:
    """`part` with the FSDP axes (batch axes besides the stage axes that shard a stacked weight)
    dropped from every logical name but `batch` (`pipeline.gather_fsdp_once`).

    Placing the weights under it all-gathers them over those axes once, before the loop; those
    axes then shard no weight, so `_replica_axes` counts them as replica axes, and the weight
    gradients add up per copy inside the loop and are reduce-scattered once after it.
    """
    rules = part.rules
    used: set[str] = set()
    for names in jax.tree_util.tree_leaves(layer_names, is_leaf=lambda x: isinstance(x, tuple)):
        for entry in logical_to_spec(names, rules):
            used.update(entry if isinstance(entry, tuple) else [entry] if entry else [])
    fsdp = {a for a in _targets(rules.get("batch")) if a not in taken and a in used}
    gathered = {name: t if name == "batch" else ([a for a in _targets(t) if a not in fsdp] or None)
                for name, t in rules.items()}
    return Partitioning(part.mesh, gathered, part.schedule)


def _place(w: jax.Array, names: tuple[str | None, ...], S: int, R: int, replicas: tuple[str, ...],
           copies: int, part: Partitioning) -> jax.Array:
    """[L, ...] in execution order -> [S, (copies,) R, L/(S·R), ...], where [s, r] is layer group r·S + s.

    For R = 1 this is a local reshape of the stage-sharded layers axis; for R > 1 it is the
    per-step all-to-all described in the module docstring. The copies (see `_replica_axes`) are a
    broadcast of what each device already holds.
    """
    L = w.shape[0]
    w = w.reshape(R, S, L // (S * R), *w.shape[1:]).swapaxes(0, 1)
    w = part.constrain(w, ("layers", None, None, *names[1:]))
    if copies == 1:
        return w
    spec = part.spec(("layers", None, None, None, *names[1:]))
    w = jnp.broadcast_to(w[:, None], (S, copies, *w.shape[1:]))
    return jax.lax.with_sharding_constraint(w, NamedSharding(part.mesh, P(spec[0], replicas, *spec[2:])))


def run(stack: StackFn, layers: Any, layer_names: Any, x_BLD: jax.Array, positions_BL: jax.Array,
        segment_ids_BL: jax.Array | None, part: Partitioning, remat_policy: Any = None,
        with_stats: bool = False) -> Any:
    """Run the stacked layers as pipeline stages; the same result as `stack(x, ..., layers)`.

    Args:
      stack: runs a stack of layers in order (the model's scan over layers).
      layers: tree of stacked weights, each [L, ...] in execution order.
      layer_names: the same tree with each weight's logical axis names (first one 'layers').
      x_BLD: the embedded batch. positions_BL, segment_ids_BL: they travel with their rows.
      part: the mesh and rules, and `part.schedule`: S, M, R (checked by config validation:
        L % (S·R) == 0, M >= S, B % M == 0).
      remat_policy: the `jax.checkpoint` policy of every iteration when the schedule
        rematerialises them (`model.remat`'s, named checkpoints survive the vmap); None saves
        nothing inside an iteration. `stack` then checkpoints no layer itself.
      with_stats: `stack` returns (x, per-layer statistics [L/(S·R), ...]) (a mixture of experts'
        routing sums): each stage's are added over the microbatches it really ran (not the
        bubble's) and over its weight copies, and returned per layer in execution order.
    Returns:
      x_BLD after all layers; with_stats: (x_BLD, statistics [L, ...]).
    """
    schedule = part.schedule
    S, M, R = schedule.stages, schedule.microbatches, schedule.repeats
    B = x_BLD.shape[0]
    placed = part.mesh is not None
    spmd_axes = stage_axes(part.rules) if placed else ()
    # The placed weights' partitioning: the rules, less the FSDP axes when they are gathered once.
    wpart = _gathered_once(part, spmd_axes, layer_names) if placed and schedule.gather_fsdp_once else part
    replicas = _replica_axes(wpart.rules, spmd_axes, layer_names) if placed else ()
    copies = math.prod(part.mesh.shape[a] for a in replicas) if replicas else 1
    weights = jax.tree_util.tree_map(lambda w, n: _place(w, n, S, R, replicas, copies, wpart), layers, layer_names)
    constrain = part.constrain
    in_stage = part.without(spmd_axes)  # inside one stage: the batch axes left besides the stage axes

    def split(a, names, inner):
        """[B, ...] -> [M, B/M, ...], microbatch m taking rows m, m+M, ... (as step.split_microbatches)."""
        a = inner.constrain(a, names)
        return inner.constrain(a.reshape(B // M, M, *a.shape[1:]).swapaxes(0, 1), (None, *names))

    # Positions and segment ids are small (no model dimension): every stage device keeps all of them.
    ids_MBL = jax.tree_util.tree_map(lambda a: split(a, ("batch", "length"), in_stage), (positions_BL, segment_ids_BL))
    # The ring of microbatch activations (MaxText's state_io): N = S·K positions, K per stage
    # device, so each device keeps K = ceil(M/S) microbatches, not all M. Position n lives on stage
    # n // K; at the start of iteration t it is local slot (n + t) % K there. Every iteration the
    # ring turns one position: slot t % K of every stage moves one stage down (a collective-permute
    # of one microbatch per device, like the activations' shift), position 0 (stage 0's input)
    # wrapping round to the last position. See `_ring_positions` for where items are written.
    K = -(-M // S)
    N = S * K
    ring_names = ("layers", None, "batch", "length", "act_embed")
    x_MBLD = x_BLD.reshape(B // M, M, *x_BLD.shape[1:]).swapaxes(0, 1)  # no gather over the stage axes
    if N > M:  # padding positions: read only by stage 0's discarded (bubble) work, as zeros
        x_MBLD = jnp.concatenate([x_MBLD, jnp.zeros((N - M, *x_MBLD.shape[1:]), x_MBLD.dtype)])
    ring = constrain(x_MBLD.reshape(S, K, *x_MBLD.shape[1:]), ring_names)  # microbatch m at position m
    stage_S = jnp.arange(S)
    recirc_pos, last_pos = _ring_positions(S, M, K)
    recirc_stage = recirc_pos // K

    in_replica = part.without(spmd_axes + replicas)

    def one_replica(x_BLD, pos_BL, seg_BL, w):
        out = stack(x_BLD, pos_BL, seg_BL, w, in_replica)
        return out if with_stats else (out, {})

    def one_stage(x_BLD, pos_BL, seg_BL, w, repeat):
        repeat_axis = 0 if copies == 1 else 1  # w: [(copies,) R, L/(S·R), ...] on this stage
        w = jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, repeat, repeat_axis, keepdims=False), w)
        if copies == 1:
            return one_replica(x_BLD, pos_BL, seg_BL, w)
        # Rows split over the replica axes, which are the outermost batch axes: a local reshape.
        rows = lambda a: None if a is None else a.reshape(copies, a.shape[0] // copies, *a.shape[1:])
        y, stats = jax.vmap(one_replica, spmd_axis_name=replicas)(rows(x_BLD), rows(pos_BL), rows(seg_BL), w)
        return y.reshape(x_BLD.shape), jax.tree_util.tree_map(lambda a: jnp.sum(a, axis=0), stats)

    all_stages = jax.vmap(one_stage, spmd_axis_name=spmd_axes or None)
    if schedule.remat_iterations:
        # Remat per iteration: the backward pass keeps each iteration's stage inputs and what the
        # policy saves (model.remat), not the rest of the layers' insides. One checkpoint level
        # only: the model checkpoints no layer inside it, so each layer runs forward twice, not three times.
        all_stages = jax.checkpoint(all_stages, policy=remat_policy, prevent_cse=False)

    def ids_at(t):
        """Positions and segment ids of microbatch t % M, in every stage slot (stage 0's are used)."""
        m = t % M
        return jax.tree_util.tree_map(
            lambda a: jnp.broadcast_to(jax.lax.dynamic_index_in_dim(a, m, 0, keepdims=False), (S, *a.shape[1:])),
            ids_MBL)

    def per_stage(tree):
        return tuple(None if a is None else constrain(a, _X if i == 0 else _IDS) for i, a in enumerate(tree))

    def on_stage(s, new, old):
        return jnp.where((stage_S == s).reshape(S, *[1] * (new.ndim - 1)), new, old)

    def iteration(carry, t):
        state, ring, stats_acc = carry
        col = t % K
        slots = constrain(jax.lax.dynamic_index_in_dim(ring, col, 1, keepdims=False), _X)  # stage 0's: position 0
        first = (slots, *ids_at(t))
        is_first = lambda a: (stage_S == 0).reshape(S, *[1] * (a.ndim - 1))
        inputs = per_stage(jax.tree_util.tree_map(lambda f, s: jnp.where(is_first(f), f, s), first, state))
        repeat_S = jnp.clip((t - stage_S) // M, 0, R - 1)  # stage s works on item t - s: round (t - s) // M
        y_SBLD, stats_S = all_stages(*inputs, weights, repeat_S)
        # Stage s's statistics count when item t - s is real (not the fill or drain bubble), under
        # the layer group it ran: round repeat_S.
        real_S = ((t - stage_S >= 0) & (t - stage_S < R * M)).astype(jnp.float32)
        into_SR = jax.nn.one_hot(repeat_S, R, dtype=jnp.float32) * real_S[:, None]
        stats_acc = jax.tree_util.tree_map(
            lambda acc, a: acc + into_SR.reshape(S, R, *[1] * (a.ndim - 1)) * a[:, None], stats_acc, stats_S)
        # Everything moves one stage on; the last stage's output lands in stage 0's slot.
        shifted = per_stage(jax.tree_util.tree_map(lambda a: jnp.roll(a, 1, axis=0), (y_SBLD, *inputs[1:])))
        done = t - (S - 1)  # the item the last stage just finished (negative while the pipeline fills)
        # The ring turns: slot `col` of each stage moves one stage down (what stage 0 just read
        # wraps round to the last stage, at the last position). An item's last round is written
        # there, where it stays until the loop ends.
        turned = constrain(jnp.roll(slots, -1, axis=0), _X)
        turned = on_stage(S - 1, jnp.where(done >= (R - 1) * M, y_SBLD, turned), turned)
        ring = jax.lax.dynamic_update_index_in_dim(ring, turned, col, 1)
        if R > 1:
            # An earlier round goes to the position that reaches stage 0 when its next round starts.
            if recirc_stage == 0:
                src = shifted[0]  # the shift already brought the last stage's output to stage 0
            elif recirc_stage == S - 1:
                src = y_SBLD
            else:  # one more collective-permute of one microbatch per device (see _ring_positions)
                src = constrain(jnp.roll(y_SBLD, recirc_stage + 1, axis=0), _X)
            rcol = (recirc_pos + t + 1) % K
            old = jax.lax.dynamic_index_in_dim(ring, rcol, 1, keepdims=False)
            new = on_stage(recirc_stage, jnp.where((done >= 0) & (done < (R - 1) * M), src, old), old)
            ring = jax.lax.dynamic_update_index_in_dim(ring, constrain(new, _X), rcol, 1)
        return (shifted, constrain(ring, ring_names), stats_acc), None

    # Every stage starts on its own first ring slot (real, finite rows), so even the bubble's
    # (discarded) work sees real rows; no microbatch is copied to other stages for it.
    init = per_stage((constrain(ring[:, 0], _X), *ids_at(jnp.int32(0))))
    stats0 = {}
    if with_stats:  # their shapes: every stage's stack on one microbatch, traced, not run
        shapes = jax.eval_shape(all_stages, *init, weights, jnp.zeros((S,), jnp.int32))[1]
        stats0 = jax.tree_util.tree_map(lambda a: jnp.zeros((S, R, *a.shape[1:]), a.dtype), shapes)
    (_, ring, stats_acc), _ = jax.lax.scan(iteration, (init, ring, stats0), jnp.arange(schedule.iterations))
    # After T iterations position n is slot (n + T) % K of stage n // K: a local roll puts the slots
    # in position order; microbatch m's output is at position last_pos - (M - 1) + m.
    T = schedule.iterations
    ring = constrain(jnp.roll(ring, -(T % K), axis=1), ring_names)
    y_MBLD = ring.reshape(N, *ring.shape[2:])[last_pos - (M - 1):last_pos + 1]
    y_BLD = y_MBLD.swapaxes(0, 1).reshape(x_BLD.shape)  # the inverse of the microbatch split
    y_BLD = constrain(y_BLD, ("batch", "length", "act_embed"))
    if not with_stats:
        return y_BLD
    # [S, R, L/(S·R), ...] -> [L, ...] in execution order: [s, r] is layer group r·S + s.
    return y_BLD, jax.tree_util.tree_map(lambda a: a.swapaxes(0, 1).reshape(-1, *a.shape[3:]), stats_acc)


def _ring_positions(S: int, M: int, K: int) -> tuple[int, int]:
    """(recirc, last): the ring positions the last stage's output is written to at the end of an
    iteration: `recirc` for an item with rounds to go (circular schedule), `last` for its last round.

    The ring turns one position per iteration and stage 0 reads position 0 at the start of each,
    so an item written at position n at the end of iteration t is read at iteration t + n + 1.
    - An item finished by the last stage at iteration t started its round at t − (S − 1) and its
      next round starts at t − (S − 1) + M: so recirc = M − S. That is the slot stage 0 read the
      item from (the turn wrapped it to the last position), turned S − 1 times since: a hole,
      nothing else lives there. It lies on stage (M − S) // K: stage 0 when M − S < K (M = S
      among them; the activations' shift brings the output there), the last stage when M >= S²,
      otherwise a stage in between, which costs a second collective-permute of one microbatch per
      device and iteration.
    - An item's last round (and GPipe's only one) goes to the last position, N − 1 (the last
      stage's own, which stage 0 just read and the turn wrapped round): it would come back to
      stage 0 only N >= M iterations later, after the loop has ended, so it stays in the ring.
    """
    return M - S, S * K - 1
